//! The executor-independent part of the adapters: the turn/wait loop and
//! the runtime's fd lent to the host's reactor.

use std::future::Future;
use std::io;
use std::pin::pin;
use std::time::Duration;

use futures::future::{select, Either};

use crate::reactor::Runtime;

/// Turns `rt` forever: after each idle turn, `wait(timeout)` waits until the
/// runtime's fd is readable or `timeout` passes (`None`: no timer is due).
/// Returns only the first error `wait` reports.
pub(crate) async fn drive_with<W, Fut>(rt: &Runtime, mut wait: W) -> io::Error
where
    W: FnMut(Option<Duration>) -> Fut,
    Fut: Future<Output = io::Result<()>>,
{
    loop {
        let t = rt.turn();
        if t.ready {
            // Let the host's other tasks run between busy turns.
            crate::reactor::yield_now().await;
            continue;
        }
        if let Err(e) = wait(t.wait_for()).await {
            return e;
        }
    }
}

/// Runs `fut` to completion while `drive` turns the runtime; an error of
/// the driver ends the wait.
pub(crate) async fn run_until_with<F, D>(fut: F, drive: D) -> io::Result<F::Output>
where
    F: Future,
    D: Future<Output = io::Error>,
{
    // `fut` is polled first: ops it submits are then seen by the turn that
    // follows in the same poll.
    match select(pin!(fut), pin!(drive)).await {
        Either::Left((out, _)) => Ok(out),
        Either::Right((err, _)) => Err(err),
    }
}

/// The runtime's epoll fd, lent to the host executor's reactor.
pub(crate) struct LentFd<'a> {
    fd: std::os::fd::RawFd,
    _rt: std::marker::PhantomData<&'a Runtime>,
}

impl<'a> LentFd<'a> {
    pub(crate) fn new(rt: &'a Runtime) -> Self {
        use std::os::fd::AsRawFd;
        LentFd {
            fd: rt.as_raw_fd(),
            _rt: std::marker::PhantomData,
        }
    }
}

impl std::os::fd::AsRawFd for LentFd<'_> {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.fd
    }
}

impl std::os::fd::AsFd for LentFd<'_> {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        // SAFETY: `fd` is the epoll fd owned by the `Runtime` this value
        // borrows for `'a`, which outlives `&self`: the fd stays open for
        // the borrow's whole life.
        unsafe { std::os::fd::BorrowedFd::borrow_raw(self.fd) }
    }
}
