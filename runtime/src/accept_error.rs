//! How an `accept(2)` error is handled, for every listener of the crate:
//! the reactor's ([`crate::reactor::AcceptBackoff`]) and the soft device
//! engine's, which accepts on its own thread without the reactor. The
//! groups are documented with `reactor::AcceptBackoff`'s module; this leaf
//! module only holds them and the pauses, so that both layers can use them.

use std::io;
use std::time::Duration;

/// First pause after a resource error.
pub const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(10);
/// Longest pause between retries.
pub const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// How an `accept(2)` error is handled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ErrorClass {
    /// That connection failed: accept the next one at once.
    Connection,
    /// Out of descriptors or memory: retry after a pause.
    Resources,
    /// The listening socket itself is broken.
    Listener,
}

/// The group of an `accept(2)` error (the groups are listed with
/// [`crate::reactor::AcceptBackoff`]'s module).
pub(crate) fn classify(e: &io::Error) -> ErrorClass {
    match e.raw_os_error() {
        Some(
            libc::ECONNABORTED
            | libc::ECONNRESET
            | libc::EPROTO
            | libc::EPERM
            | libc::EINTR
            | libc::ENETDOWN
            | libc::ENOPROTOOPT
            | libc::EHOSTDOWN
            | libc::ENONET
            | libc::EHOSTUNREACH
            | libc::EOPNOTSUPP
            | libc::ENETUNREACH
            | libc::ETIMEDOUT,
        ) => ErrorClass::Connection,
        Some(libc::EBADF | libc::EINVAL | libc::ENOTSOCK | libc::EFAULT) => ErrorClass::Listener,
        Some(_) => ErrorClass::Resources,
        None => match e.kind() {
            io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::Interrupted => ErrorClass::Connection,
            _ => ErrorClass::Resources,
        },
    }
}
