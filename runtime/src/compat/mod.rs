//! Driving a [`Runtime`](crate::Runtime) from another executor on the same thread, so that
//! verbio's `Op` futures, timers and sockets can be awaited from tokio or
//! smol / async-std tasks.
//!
//! The runtime's epoll fd ([`Runtime::as_raw_fd`](std::os::fd::AsRawFd::as_raw_fd))
//! becomes readable whenever the reactor has something to do (a completion
//! channel event, a socket, a cross-thread wake); [`Runtime::turn`](crate::Runtime::turn) does one
//! non-blocking round of work. An adapter is the loop "turn; if idle, wait
//! until the fd is readable or the next verbio timer is due", written with
//! the host executor's own fd readiness and timer:
//!
//! - `tokio` (feature `tokio`): `tokio::run_until` / `tokio::drive`,
//!   inside a `LocalSet` of a current-thread runtime;
//! - `async-io` (feature `async-io`, the reactor of smol and async-std):
//!   `async_io::run_until` / `async_io::drive`.
//!
//! Both leave the host executor in charge: verbio's own spawned tasks run
//! inside `turn`, the host's tasks may await verbio ops directly (their
//! wakers are the host's), and nothing spins while idle.

#[cfg(feature = "async-io")]
#[cfg_attr(docsrs, doc(cfg(feature = "async-io")))]
pub mod async_io;
#[cfg(feature = "tokio")]
#[cfg_attr(docsrs, doc(cfg(feature = "tokio")))]
pub mod tokio;

#[cfg(any(feature = "tokio", feature = "async-io"))]
mod driver;
#[cfg(feature = "tokio")]
pub(crate) mod hosted;
#[cfg(any(feature = "tokio", feature = "async-io"))]
pub(crate) use driver::{drive_with, run_until_with, LentFd};
