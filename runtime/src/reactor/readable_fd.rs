//! [`ReadableFd`]: a file descriptor owned elsewhere (an RDMA connection
//! manager's event channel), registered with the reactor for readability
//! (edge-triggered), and the future-side loop that reads it.

use std::io;
use std::os::fd::RawFd;
use std::task::{Context, Poll};

use mio::unix::SourceFd;
use mio::Interest;

use super::driver::Direction;
use super::Handle;

/// A readable fd on the current thread's reactor; deregistered on drop
/// (before its owner closes it: keep this value's lifetime inside the fd's).
pub(crate) struct ReadableFd {
    handle: Handle,
    key: usize,
    fd: RawFd,
}

impl ReadableFd {
    /// Registers `fd` (non-blocking) with the current runtime.
    pub(crate) fn new(fd: RawFd) -> io::Result<ReadableFd> {
        let handle = Handle::try_current().ok_or_else(|| {
            io::Error::other("no verbio runtime on this thread: create a verbio::Runtime first")
        })?;
        let key = handle
            .driver()
            .register_io(&mut SourceFd(&fd), Interest::READABLE)?;
        Ok(ReadableFd { handle, key, fd })
    }

    /// Runs `op` until it returns something: `Ok(None)` means "would
    /// block", and the task waits for the fd's next readiness edge.
    pub(crate) fn poll_read<R, E>(
        &self,
        cx: &mut Context<'_>,
        mut op: impl FnMut() -> Result<Option<R>, E>,
    ) -> Poll<Result<R, E>> {
        match op() {
            Ok(Some(r)) => Poll::Ready(Ok(r)),
            Err(e) => Poll::Ready(Err(e)),
            Ok(None) => {
                // Single-threaded: no readiness can arrive between the
                // failed attempt and storing the waker.
                self.handle
                    .driver()
                    .clear_and_wait(self.key, Direction::Read, cx);
                Poll::Pending
            }
        }
    }
}

impl Drop for ReadableFd {
    fn drop(&mut self) {
        self.handle
            .driver()
            .deregister_io(&mut SourceFd(&self.fd), self.key);
    }
}
