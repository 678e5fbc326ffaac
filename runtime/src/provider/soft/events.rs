//! The device's event queues (CQ events of a completion channel, async
//! events): a queue with a non-blocking eventfd that is readable while the
//! queue holds an event. The producer writes the eventfd after releasing
//! the queue lock (a consumer woken by the write must not find the lock
//! still held and go back to sleep on it), so readiness can lag a push by a
//! moment, and can outlive the event it announced until the next pop
//! (which then returns `None` and clears it).
//!
//! Every event queued writes the eventfd, also when earlier ones still
//! wait: a poller that watches the fd edge-triggered (the runtime's, see
//! `ProviderCaps::edge_triggered_channel`) and takes one event per
//! readiness is told of each, as a verbs channel tells of each event.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Mutex;

use super::lock;
use crate::provider::{ProviderError, Result};

/// A queue of events with an eventfd that is readable while it is not empty.
pub(crate) struct EventQueue<T> {
    fd: OwnedFd,
    inner: Mutex<Events<T>>,
}

struct Events<T> {
    queue: VecDeque<T>,
    /// Signals written (or about to be) to the eventfd and not read back.
    unread: u64,
}

impl<T> EventQueue<T> {
    pub fn new() -> Result<Self> {
        // SAFETY: eventfd has no memory-safety preconditions.
        let raw = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if raw < 0 {
            return Err(ProviderError::Io {
                context: "eventfd",
                source: io::Error::last_os_error(),
            });
        }
        // SAFETY: `raw` is a fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        Ok(EventQueue {
            fd,
            inner: Mutex::new(Events {
                queue: VecDeque::new(),
                unread: 0,
            }),
        })
    }

    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    pub fn push(&self, ev: T) {
        self.enqueue(ev);
        self.signal();
    }

    /// Queues an event; the caller must then `signal` (every event, so
    /// that an edge-triggered poller is told of each: one left queued by
    /// a consumer that took only the first must not silence the next).
    /// The signal is sent after the lock is released, so a consumer it
    /// wakes does not find the lock still held.
    pub(super) fn enqueue(&self, ev: T) {
        let mut g = lock(&self.inner);
        g.queue.push_back(ev);
        g.unread += 1;
    }

    /// Makes the eventfd readable. It is cleared only under the lock with
    /// the queue empty, so a signal sent after its event went in cannot be
    /// lost: the fd is readable while the event waits.
    pub(super) fn signal(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our eventfd.
        let _ = unsafe { libc::write(self.fd(), (&one as *const u64).cast(), 8) };
    }

    /// Queues an event without making the eventfd readable: for a
    /// consumer that takes it at once (see `Engine::quiet`); what it
    /// leaves behind is signalled by [`pop_quiet`](Self::pop_quiet).
    pub(super) fn enqueue_quiet(&self, ev: T) {
        lock(&self.inner).queue.push_back(ev);
    }

    /// Pops after quiet enqueues: signals the events left behind, which
    /// other consumers must see (also while an earlier signal is still
    /// counted: an edge-triggered poller was told of that one already).
    pub(super) fn pop_quiet(&self) -> Option<T> {
        let mut g = lock(&self.inner);
        let ev = g.queue.pop_front();
        if g.queue.is_empty() {
            self.clear(&mut g);
            return ev;
        }
        g.unread += 1;
        drop(g);
        self.signal();
        ev
    }

    pub fn pop(&self) -> Option<T> {
        let mut g = lock(&self.inner);
        let ev = g.queue.pop_front();
        if g.queue.is_empty() {
            self.clear(&mut g);
        }
        ev
    }

    /// With the queue empty: clears the eventfd's readiness. A signal that
    /// lands after its event was taken stays counted in `unread` and is
    /// cleared by the next pop; with nothing unread, no syscall.
    fn clear(&self, g: &mut Events<T>) {
        if g.unread > 0 {
            let mut v: u64 = 0;
            // SAFETY: reads 8 bytes into a live u64 from our non-blocking eventfd.
            let n = unsafe { libc::read(self.fd(), (&mut v as *mut u64).cast(), 8) };
            if n == 8 {
                g.unread = g.unread.saturating_sub(v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::soft::fd_readable as readable;

    #[test]
    fn event_fd_is_readable_while_events_wait_and_late_signals_clear() {
        let q = EventQueue::<u32>::new().expect("eventfd");
        assert!(!readable(q.fd()));
        q.push(1);
        q.push(2);
        assert!(readable(q.fd()));
        assert_eq!(q.pop(), Some(1));
        assert!(readable(q.fd()));
        assert_eq!(q.pop(), Some(2));
        assert!(!readable(q.fd()));
        // A producer's signal landing after its event was taken (it signals
        // after unlocking) leaves the fd readable with nothing queued: the
        // next pop finds nothing and clears it.
        q.enqueue(3);
        assert_eq!(q.pop(), Some(3));
        assert!(!readable(q.fd()));
        q.signal();
        assert!(readable(q.fd()));
        assert_eq!(q.pop(), None);
        assert!(!readable(q.fd()));
        assert_eq!(q.pop(), None);
        assert!(!readable(q.fd()));
    }

    /// An edge-triggered watcher of the eventfd is told of events a
    /// receiving consumer leaves behind, even while a late signal of an
    /// earlier event is still counted (`unread`).
    #[test]
    fn events_left_behind_by_a_quiet_pop_are_told_to_an_edge_triggered_watcher() {
        let q = EventQueue::<u32>::new().expect("eventfd");
        let watch = crate::provider::soft::EdgeWatch::new(q.fd());
        // A producer's late signal: counted, readable, then told.
        q.enqueue(1);
        assert_eq!(q.pop(), Some(1));
        q.signal();
        assert_eq!(watch.edges(), 1);
        q.enqueue_quiet(2);
        q.enqueue_quiet(3);
        assert_eq!(watch.edges(), 0, "quiet");
        assert_eq!(q.pop_quiet(), Some(2));
        assert_eq!(watch.edges(), 1, "the event left behind was not told");
        assert_eq!(q.pop(), Some(3));
        assert!(!readable(q.fd()));
    }
}
