//! Sockets registered with the reactor: readiness per direction and the
//! wakers waiting on it.

use std::task::{Context, Poll, Waker};

use mio::{Interest, Token};

use super::Driver;

#[derive(Default)]
pub(super) struct IoEntry {
    read_ready: bool,
    write_ready: bool,
    read: Option<Waker>,
    write: Option<Waker>,
}

/// Which direction a socket waits for.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Direction {
    Read,
    Write,
}

impl Driver {
    // ---- sockets ---------------------------------------------------------

    pub(crate) fn register_io(
        &self,
        source: &mut impl mio::event::Source,
        interest: Interest,
    ) -> std::io::Result<usize> {
        let mut io = self.io.borrow_mut();
        let entry = io.vacant_entry();
        let key = entry.key();
        self.registry.register(source, Token(key), interest)?;
        entry.insert(IoEntry::default());
        Ok(key)
    }

    pub(crate) fn deregister_io(&self, source: &mut impl mio::event::Source, key: usize) {
        if let Err(e) = self.registry.deregister(source) {
            tracing::debug!(error = %crate::report::ErrorChain(&e), "deregistering a socket");
        }
        let entry = self.io.borrow_mut().try_remove(key);
        drop(entry);
    }

    /// Remembers `cx`'s waker for the next readiness event in `dir`. Returns
    /// `Ready` if such an event already arrived (and consumes it).
    pub(crate) fn poll_ready(&self, key: usize, dir: Direction, cx: &mut Context<'_>) -> Poll<()> {
        let mut io = self.io.borrow_mut();
        let Some(e) = io.get_mut(key) else {
            return Poll::Ready(());
        };
        let (ready, slot) = match dir {
            Direction::Read => (&mut e.read_ready, &mut e.read),
            Direction::Write => (&mut e.write_ready, &mut e.write),
        };
        if std::mem::take(ready) {
            return Poll::Ready(());
        }
        match slot {
            Some(w) if w.will_wake(cx.waker()) => {}
            _ => *slot = Some(cx.waker().clone()),
        }
        Poll::Pending
    }

    /// The operation in `dir` would block: forget stale readiness, wait.
    pub(crate) fn clear_and_wait(&self, key: usize, dir: Direction, cx: &mut Context<'_>) {
        if let Some(e) = self.io.borrow_mut().get_mut(key) {
            match dir {
                Direction::Read => e.read_ready = false,
                Direction::Write => e.write_ready = false,
            }
        }
        let _ = self.poll_ready(key, dir, cx);
    }

    pub(super) fn io_ready(&self, key: usize, ev: &mio::event::Event) {
        let mut wake = [None, None];
        {
            let mut io = self.io.borrow_mut();
            let Some(e) = io.get_mut(key) else { return };
            if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
                e.read_ready = true;
                wake[0] = e.read.take();
            }
            if ev.is_writable() || ev.is_write_closed() || ev.is_error() {
                e.write_ready = true;
                wake[1] = e.write.take();
            }
        }
        for w in wake.into_iter().flatten() {
            w.wake();
        }
    }
}
