//! The tokio adapter: a verbio [`Runtime`] turned by a task of a tokio
//! current-thread runtime, waiting on the runtime's fd with
//! `tokio::io::unix::AsyncFd` and on verbio's timers with `tokio::time`.
//!
//! ```
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # mod verbio { pub mod runtime { pub use verbio_runtime::*; } pub use verbio_runtime::provider; }
//! use verbio::runtime::{compat, Runtime};
//! let rt = Runtime::new()?; // on this thread, beside tokio's
//! let host = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
//! let local = tokio::task::LocalSet::new();
//! let answer = local.block_on(&host, compat::tokio::run_until(&rt, async {
//!     // tokio and verbio futures side by side: ops, verbio timers,
//!     // tokio sockets, `tokio::task::spawn_local` tasks awaiting ops ...
//!     verbio::runtime::sleep(std::time::Duration::from_millis(1)).await;
//!     42
//! }))?;
//! assert_eq!(answer, 42);
//! # Ok(()) }
//! ```

use std::future::Future;
use std::io;

use ::tokio::io::unix::AsyncFd;
use ::tokio::io::Interest;

use super::{drive_with, run_until_with, LentFd};
use crate::reactor::Runtime;

/// Turns `rt` until the returned future is dropped; resolves only with an
/// error of tokio's fd registration. Await it (or `select!` it) in a task
/// of a current-thread tokio runtime on `rt`'s thread (e.g. in a
/// `LocalSet`, since `rt` is not `Send`), with tokio's I/O and time drivers
/// enabled.
///
/// # Panics
///
/// When first polled outside a tokio runtime (tokio's own rule for
/// registering an fd).
pub async fn drive(rt: &Runtime) -> io::Error {
    // SAFETY: the fd is `rt`'s epoll fd, open for as long as `rt` lives;
    // `rt` is borrowed for this whole future and the `AsyncFd` is dropped
    // with it, so the fd stays open and the same for the `AsyncFd`'s life
    // (`LentFd::as_raw_fd` always returns it).
    let registered =
        unsafe { AsyncFd::register_with_interest(LentFd::new(rt), Interest::READABLE) };
    let fd = match registered {
        Ok(fd) => fd,
        Err(e) => return e.into(),
    };
    drive_with(rt, |wait| {
        let fd = &fd;
        async move {
            let readable = async {
                // Readiness is edge-triggered in tokio: clear what this
                // wait saw, then the next turn takes the events behind it.
                fd.readable().await?.clear_ready();
                Ok(())
            };
            match wait {
                None => readable.await,
                Some(d) => match ::tokio::time::timeout(d, readable).await {
                    Ok(r) => r,
                    Err(_elapsed) => Ok(()),
                },
            }
        }
    })
    .await
}

/// Runs `fut` to completion while turning `rt` (see [`drive`] for where to
/// call it). Fails only if tokio cannot watch the runtime's fd.
///
/// # Panics
///
/// Outside a tokio runtime, as [`drive`].
pub async fn run_until<F: Future>(rt: &Runtime, fut: F) -> io::Result<F::Output> {
    run_until_with(fut, drive(rt)).await
}
