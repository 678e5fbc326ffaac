//! The async-io adapter (the reactor under smol and async-std): a verbio
//! [`Runtime`] turned by a future of that executor, waiting on the runtime's
//! fd with `async_io::Async` and on verbio's timers with `async_io::Timer`.
//!
//! ```
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # mod verbio { pub mod runtime { pub use verbio_runtime::*; } pub use verbio_runtime::provider; }
//! use verbio::runtime::{compat, Runtime};
//! let rt = Runtime::new()?;
//! let answer = async_io::block_on(compat::async_io::run_until(&rt, async {
//!     verbio::runtime::sleep(std::time::Duration::from_millis(1)).await;
//!     42
//! }))?;
//! assert_eq!(answer, 42);
//! # Ok(()) }
//! ```

use std::future::Future;
use std::io;

use ::async_io::{Async, Timer};
use futures::future::{select, Either};

use super::{drive_with, run_until_with, LentFd};
use crate::reactor::Runtime;

/// Turns `rt` until the returned future is dropped; resolves only with an
/// error of async-io's fd registration. Await it on `rt`'s thread (e.g.
/// with `async_io::block_on`, or in a `LocalExecutor`).
pub async fn drive(rt: &Runtime) -> io::Error {
    // The epoll fd is made non-blocking by `Async::new`: harmless, verbio
    // never reads it, only waits on it.
    let fd = match Async::new(LentFd::new(rt)) {
        Ok(fd) => fd,
        Err(e) => return e,
    };
    drive_with(rt, |wait| {
        let fd = &fd;
        async move {
            // async-io's readiness is level-triggered: it resolves while
            // the epoll fd has events the next turn has not taken.
            let readable = std::pin::pin!(fd.readable());
            match wait {
                None => readable.await,
                Some(d) => match select(readable, Timer::after(d)).await {
                    Either::Left((r, _)) => r,
                    Either::Right(_) => Ok(()),
                },
            }
        }
    })
    .await
}

/// Runs `fut` to completion while turning `rt` (see [`drive`]). Fails only
/// if async-io cannot watch the runtime's fd.
pub async fn run_until<F: Future>(rt: &Runtime, fut: F) -> io::Result<F::Output> {
    run_until_with(fut, drive(rt)).await
}
