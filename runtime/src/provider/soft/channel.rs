//! The completion channel: its events and the sockets an application
//! sleeping on it receives from itself.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use smallvec::SmallVec;

use super::context::Context;
use super::events::EventQueue;
use super::lock;
use super::wire::Wire;
use crate::provider::{ProviderError, Result};

/// The completion channel of the soft device.
#[derive(Clone)]
pub struct CompChannel {
    pub(crate) shared: Arc<Channel>,
    pub(crate) _ctx: Context,
}

impl CompChannel {
    /// The fd to register with a poller: an epoll fd holding the channel's
    /// eventfd and, once a CQ on it is armed, the sockets feeding that CQ.
    pub fn fd(&self) -> RawFd {
        self.shared.ep.as_raw_fd()
    }
    /// Takes one pending CQ event (the CQ handle), if any. First receives
    /// what waits on the sockets in the channel's set: an application
    /// sleeping on the channel receives on its own thread.
    pub fn get_event(&self) -> Result<Option<u32>> {
        if !self._ctx.shared().lease.is_zero() && self.receive() {
            return Ok(self.shared.events.pop_quiet());
        }
        Ok(self.shared.events.pop())
    }

    /// Receives on this thread what waits on the channel's sockets, if the
    /// engine is not at work; if it is, hands the sockets back to it. True
    /// if it received (events it raised on this channel may be queued
    /// without a signal: see `Engine::quiet`).
    fn receive(&self) -> bool {
        let mut ready = self.shared.ready();
        let registry = &self._ctx.shared().registry;
        // A connection the engine is writing to (a bulk transfer) is the
        // engine's to receive on too: it is awake for it anyway, and this
        // thread would take its lock away from it.
        ready.retain(|w| {
            let busy = w.engine_busy();
            if busy {
                self._ctx
                    .shared()
                    .hand_backs
                    .fetch_add(1, Ordering::Relaxed);
                self.shared.hand_back(w, registry);
            }
            !busy
        });
        if ready.is_empty() {
            return false;
        }
        let cids: SmallVec<[usize; 4]> = ready.iter().map(|w| w.cid()).collect();
        if self._ctx.drive_conns(&cids, Some(&self.shared)) {
            true
        } else {
            // (The engine delivers, and signals the channel if that fires
            // an armed CQ.)
            self._ctx
                .shared()
                .hand_backs
                .fetch_add(1, Ordering::Relaxed);
            for w in &ready {
                self.shared.hand_back(w, registry);
            }
            false
        }
    }
}

/// A completion channel's state. Its pollable fd is an epoll fd whose set
/// holds the eventfd of its event queue and, from the arming of a CQ on
/// the channel, the sockets feeding that CQ (`drive.rs`): an application
/// that sleeps on the channel wakes when a packet arrives, and its
/// `get_event` receives it on its own thread (which raises the event if
/// that completed an armed CQ), instead of waiting for the engine thread
/// to wake, receive and signal. Arming renews the application's lease on
/// the sockets and stops the engine from watching their input meanwhile
/// (as for a busy-polling application; an expired lease hands them back),
/// so that a packet wakes the application only, not the engine too.
///
/// The sockets are registered level-triggered: the fd is readable while
/// one of them holds data, which the next `get_event` reads. A socket
/// leaves the set when it is handed back to the engine (the engine is at
/// work when `get_event` would receive, or writes to the connection when
/// the CQ is armed: a bulk transfer), so that the fd is not left readable
/// for data only the engine will read; and when its connection closes.
///
/// Watched edge-triggered (as the runtime's poll watches it), the fd
/// raises readiness for every event (the event queue writes its eventfd
/// for each, see `events.rs`) and for every packet arriving on a socket
/// of the set (each arrival wakes the set, also while unread data waits).
/// (`ProviderCaps::edge_triggered_channel` stays off for it all the same:
/// see there.)
pub(crate) struct Channel {
    pub events: EventQueue<u32>,
    ep: OwnedFd,
    /// The sockets in the set (epoll data: the `Wire`'s address, which the
    /// weak reference keeps from being reused).
    members: Mutex<SmallVec<[Weak<Wire>; 2]>>,
    /// Mirror of `!members.is_empty()`.
    has_members: AtomicBool,
}

/// Epoll data of the event queue's eventfd.
const EVENTS_KEY: u64 = u64::MAX;

impl Channel {
    pub fn new() -> Result<Channel> {
        let events = EventQueue::new()?;
        // SAFETY: epoll_create1 has no memory-safety preconditions.
        let raw = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if raw < 0 {
            return Err(ProviderError::Io {
                context: "epoll_create1",
                source: io::Error::last_os_error(),
            });
        }
        // SAFETY: `raw` is a fresh fd we own.
        let ep = unsafe { OwnedFd::from_raw_fd(raw) };
        let ch = Channel {
            events,
            ep,
            members: Mutex::new(SmallVec::new()),
            has_members: AtomicBool::new(false),
        };
        ch.ctl(libc::EPOLL_CTL_ADD, ch.events.fd(), EVENTS_KEY)
            .map_err(|source| ProviderError::Io {
                context: "epoll_ctl",
                source,
            })?;
        Ok(ch)
    }

    fn ctl(&self, op: libc::c_int, fd: RawFd, key: u64) -> io::Result<()> {
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: key,
        };
        // SAFETY: `ev` is a live epoll_event; both fds are open (the caller
        // owns `fd` or holds what owns it).
        if unsafe { libc::epoll_ctl(self.ep.as_raw_fd(), op, fd, &mut ev) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// True if `wire` is in the set.
    pub fn holds(&self, wire: &Wire) -> bool {
        lock(&self.members)
            .iter()
            .any(|w| std::ptr::eq(w.as_ptr(), wire))
    }

    /// Puts `wire` in the set (if it is not there yet). True if it is there.
    pub fn join(&self, wire: &Arc<Wire>) -> bool {
        let mut m = lock(&self.members);
        if m.iter().any(|w| w.as_ptr() == Arc::as_ptr(wire)) {
            return true;
        }
        if wire.is_closed() {
            return false;
        }
        match self.ctl(libc::EPOLL_CTL_ADD, wire.fd(), Arc::as_ptr(wire) as u64) {
            Ok(()) => {
                m.push(Arc::downgrade(wire));
                self.has_members.store(true, Ordering::SeqCst);
                true
            }
            Err(e) => {
                tracing::debug!(error = %crate::report::ErrorChain(&e), "soft channel: cannot watch a socket");
                false
            }
        }
    }

    /// Hands `wire` back to the engine: ends the lease, watches its input
    /// again, and takes it out of the set (where it would keep the fd
    /// readable until the engine reads).
    pub fn hand_back(&self, wire: &Wire, registry: &mio::Registry) {
        wire.revoke(registry);
        let mut m = lock(&self.members);
        if let Some(i) = m.iter().position(|w| std::ptr::eq(w.as_ptr(), wire)) {
            m.swap_remove(i);
            let _ = self.ctl(libc::EPOLL_CTL_DEL, wire.fd(), 0);
            self.has_members.store(!m.is_empty(), Ordering::SeqCst);
        }
    }

    /// The sockets in the set that hold data now (closed ones leave the
    /// set: they would stay readable). With one socket in the set, that
    /// one (reading it costs no more than asking epoll).
    fn ready(&self) -> SmallVec<[Arc<Wire>; 2]> {
        let mut out = SmallVec::new();
        if !self.has_members.load(Ordering::SeqCst) {
            return out;
        }
        {
            let m = lock(&self.members);
            if m.len() == 1 {
                if let Some(w) = m[0].upgrade().filter(|w| !w.is_closed()) {
                    out.push(w);
                    return out;
                }
            }
        }
        let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 8];
        // SAFETY: `evs` is a live array of 8 epoll_events; no wait.
        let n = unsafe { libc::epoll_wait(self.ep.as_raw_fd(), evs.as_mut_ptr(), 8, 0) };
        if n <= 0 {
            return out;
        }
        let mut m = lock(&self.members);
        for ev in &evs[..n as usize] {
            let key = ev.u64;
            if key == EVENTS_KEY {
                continue;
            }
            let Some(i) = m.iter().position(|w| w.as_ptr() as u64 == key) else {
                continue;
            };
            match m[i].upgrade() {
                Some(w) if !w.is_closed() => out.push(w),
                w => {
                    if let Some(w) = w {
                        let _ = self.ctl(libc::EPOLL_CTL_DEL, w.fd(), key);
                    }
                    // (A dropped socket's fd was closed: it left the set.)
                    m.swap_remove(i);
                }
            }
        }
        self.has_members.store(!m.is_empty(), Ordering::SeqCst);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::soft::fd_readable as readable;
    use crate::provider::soft::EdgeWatch;

    /// The runtime watches the channel's fd edge-triggered and, told of
    /// it, takes events up to the one its arming raised
    /// (`reactor/driver/cqs.rs`): every event must raise readiness of its
    /// own, also while an earlier one is still queued (a CQ re-armed by
    /// code outside the reactor before its event was taken); and a
    /// member's data raises it once per arrival.
    #[test]
    fn an_edge_triggered_watcher_is_told_of_each_event_even_with_one_left_queued() {
        use std::io::Write;
        let ch = Channel::new().expect("channel");
        let watch = EdgeWatch::new(ch.ep.as_raw_fd());
        assert_eq!(watch.edges(), 0);
        ch.events.push(1);
        assert_eq!(watch.edges(), 1);
        assert_eq!(watch.edges(), 0, "told twice of one event");
        ch.events.push(2);
        assert_eq!(watch.edges(), 1, "a second event was not told");
        // The consumer takes one event per readiness and leaves one.
        assert_eq!(ch.events.pop(), Some(1));
        assert_eq!(watch.edges(), 0);
        ch.events.push(3);
        assert_eq!(
            watch.edges(),
            1,
            "an event queued behind another raised no readiness"
        );
        assert_eq!(ch.events.pop(), Some(2));
        assert_eq!(ch.events.pop(), Some(3));
        assert_eq!(ch.events.pop(), None);
        assert!(!readable(ch.ep.as_raw_fd()));
        assert_eq!(watch.edges(), 0);
        // A member socket: once per arrival, also while unread data waits.
        let (wire, mut peer, _) = super::super::wire::loopback_wire(4);
        let wire = Arc::new(wire);
        assert!(ch.join(&wire));
        assert_eq!(watch.edges(), 0);
        for round in 0..3 {
            peer.write_all(b"data").expect("write");
            // (Loopback delivery is synchronous: the data is in the
            // socket when `write` returns.)
            assert_eq!(watch.edges(), 1, "arrival {round} was not told");
            assert_eq!(watch.edges(), 0);
        }
    }

    #[test]
    fn channel_fd_is_readable_while_a_member_holds_data_until_handed_back_or_closed() {
        use std::io::Write;
        let (wire, mut peer, _) = super::super::wire::loopback_wire(3);
        let wire = Arc::new(wire);
        let poll = mio::Poll::new().expect("epoll");
        let ch = Channel::new().expect("channel");
        let fd = ch.ep.as_raw_fd();
        let wait = |fd| {
            let mut p = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd, bounded wait.
            unsafe { libc::poll(&mut p, 1, 10_000) == 1 }
        };
        assert!(ch.join(&wire) && ch.holds(&wire));
        assert!(!readable(fd));
        peer.write_all(b"data").expect("write");
        assert!(wait(fd), "a member's data does not wake");
        assert_eq!(ch.ready().len(), 1);
        assert_eq!(wire.cid(), 3);
        // Handed back to the engine: its unread data no longer wakes.
        ch.hand_back(&wire, poll.registry());
        assert!(!ch.holds(&wire));
        assert!(!readable(fd));
        assert!(ch.ready().is_empty());
        // A closed connection leaves the set (it would stay readable).
        assert!(ch.join(&wire));
        assert!(readable(fd));
        wire.close();
        assert!(ch.ready().is_empty());
        assert!(!ch.holds(&wire));
        assert!(!readable(fd));
        assert!(!ch.join(&wire), "closed");
        // Events the receiving `get_event` queues quietly: what it leaves
        // behind is signalled.
        ch.events.enqueue_quiet(1);
        assert!(!readable(fd));
        assert_eq!(ch.events.pop_quiet(), Some(1));
        assert!(!readable(fd));
        ch.events.enqueue_quiet(2);
        ch.events.enqueue_quiet(3);
        assert_eq!(ch.events.pop_quiet(), Some(2));
        assert!(readable(fd));
        assert_eq!(ch.events.pop(), Some(3));
        assert!(!readable(fd));
    }
}
