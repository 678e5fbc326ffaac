//! The hardware provider: real RDMA devices through libibverbs, via
//! `rdma-mummy-sys` (which `dlopen`s `libibverbs.so.1` at run time).
//!
//! Same object model and method names as the software device: every object is
//! an `Arc`-backed handle that keeps its parents alive (an [`Mr`] and an
//! [`Ah`] keep their [`Pd`], a [`Qp`] (RC or UD) its [`Pd`] and [`Cq`]s,
//! everything its [`Context`]), and the verbs object is destroyed when the
//! last handle goes, children first.
//!
//! All libibverbs objects are documented as thread-safe ("all verbs are thread
//! safe", rdma-core `libibverbs/man/ibv_*`), which is what the `Send`/`Sync`
//! impls in the submodules rely on.
//!
//! Data path (what a post, poll, arm or event costs here, beyond the
//! device's own provider library):
//! - `Qp::post_send`/`post_recv`: one `ibv_post_*` call per list, whatever
//!   its length (one doorbell; on rxe one `write` syscall per send list, none
//!   per receive list), the `ibv_*_wr` list built on the stack (a per-thread
//!   scratch list past 16 WRs, grown once), SGEs handed over in place (the
//!   contract's `Sge` has `ibv_sge`'s layout, checked at compile time), flags
//!   passed through as given (unsignaled stays unsignaled, INLINE within the
//!   QP's `max_inline_data`). Never `ibv_query_qp` on a success path.
//! - `Cq::poll`: one `ibv_poll_cq` of up to 32 entries into an uninitialised
//!   stack array, converted in place; more calls only while the CQ has more.
//! - `Cq::req_notify`, `CompChannel::get_event`, `Cq::ack_events`: one verb
//!   each; an empty channel costs one failed `read` (`EAGAIN`), no error
//!   value built.
//!
//! Measured with callgrind on rxe (`scripts/rxe-test.sh --callgrind`): this
//! layer's own instructions per call are ≈84 for a one-WR `post_send`, ≈48
//! for a one-WR `post_recv`, ≈45 plus ≈30 per completion for `poll`.
//!
//! Without libibverbs, or when it lists no device (e.g. a kernel without RDMA
//! support: `ibv_get_device_list` fails with `ENOSYS`), [`devices`] and
//! [`Context::open`] return [`ProviderError::NoDevice`] with the reason.

mod ah;
pub mod cm;
mod cq;
mod device;
mod mw;
mod pd_mr;
mod qp;
mod srq;

use std::io;

pub use ah::Ah;
pub use cq::{CompChannel, Cq};
pub use device::{devices, Context, GidEntry, GidType};
pub use mw::Mw;
pub use pd_mr::{Mr, Pd};
pub use qp::Qp;
pub use srq::Srq;

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
