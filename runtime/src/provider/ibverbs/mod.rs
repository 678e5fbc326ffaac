//! The hardware provider: real RDMA devices through libibverbs, via
//! `rdma-mummy-sys` (which `dlopen`s `libibverbs.so.1` at run time).
//!
//! Same object model and method names as the software device: every object is
//! an `Arc`-backed handle that keeps its parents alive (an [`Mr`] keeps its
//! [`Pd`], a [`Qp`] its [`Pd`] and [`Cq`]s, everything its [`Context`]), and the
//! verbs object is destroyed when the last handle goes, children first.
//!
//! All libibverbs objects are documented as thread-safe ("all verbs are thread
//! safe", rdma-core `libibverbs/man/ibv_*`), which is what the `Send`/`Sync`
//! impls in the submodules rely on.
//!
//! Without libibverbs, or when it lists no device (e.g. a kernel without RDMA
//! support: `ibv_get_device_list` fails with `ENOSYS`), [`devices`] and
//! [`Context::open`] return [`ProviderError::NoDevice`] with the reason.

mod cq;
mod device;
mod pd_mr;
mod qp;

use std::io;

pub use cq::{CompChannel, Cq};
pub use device::{devices, Context, GidEntry, GidType};
pub use pd_mr::{Mr, Pd};
pub use qp::Qp;

use super::ProviderError;

/// Environment variable that overrides the default GID index ([`Context::default_gid_index`]).
pub const GID_INDEX_ENV: &str = "VERBIO_GID_INDEX";

/// A `Verbs` error for `call` from the current `errno`.
pub(crate) fn errno_err(call: &'static str) -> ProviderError {
    let source = io::Error::last_os_error();
    // Some failures leave errno at 0; say so instead of "Success".
    let source = if source.raw_os_error() == Some(0) {
        io::Error::other("failed without setting errno")
    } else {
        source
    };
    ProviderError::Verbs { call, source }
}

/// A `Verbs` error for `call` from a verbs return value: positive values are
/// errno codes (most `ibv_*` that return `int`), anything else defers to `errno`.
pub(crate) fn ret_err(call: &'static str, ret: i32) -> ProviderError {
    if ret > 0 {
        ProviderError::Verbs {
            call,
            source: io::Error::from_raw_os_error(ret),
        }
    } else if ret < -1 {
        ProviderError::Verbs {
            call,
            source: io::Error::from_raw_os_error(-ret),
        }
    } else {
        errno_err(call)
    }
}
