//! Completion queues, the completion channel and the async-event queue. Both
//! pollable fds are non-blocking eventfds that are readable while their
//! queue holds an event. The producer writes the eventfd after releasing
//! the queue lock (a consumer woken by the write must not find the lock
//! still held and go back to sleep on it), so readiness can lag a push by a
//! moment, and can outlive the event it announced until the next
//! `get_event` (which then returns `None` and clears it).

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use std::time::Instant;

use smallvec::SmallVec;

use super::context::Context;
use super::wire::Wire;
use crate::provider::{
    AsyncElement, AsyncEvent, AsyncEventKind, Completion, ProviderError, Result,
};

/// Locks a mutex, recovering from poisoning (the data stays consistent:
/// every critical section leaves it valid before anything can panic).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

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
        if self.enqueue(ev) {
            self.signal();
        }
    }

    /// Queues an event; true if the caller must then `signal` (the queue
    /// was empty). The signal is sent after the lock is released, so a
    /// consumer it wakes does not find the lock still held.
    fn enqueue(&self, ev: T) -> bool {
        let mut g = lock(&self.inner);
        let was_empty = g.queue.is_empty();
        g.queue.push_back(ev);
        if was_empty {
            g.unread += 1;
        }
        was_empty
    }

    /// Makes the eventfd readable. It is cleared only under the lock with
    /// the queue empty, so a signal sent after its event went in cannot be
    /// lost: the fd is readable while the event waits.
    fn signal(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our eventfd.
        let _ = unsafe { libc::write(self.fd(), (&one as *const u64).cast(), 8) };
    }

    /// Queues an event without making the eventfd readable: for a
    /// consumer that takes it at once (see `Engine::quiet`); what it
    /// leaves behind is signalled by [`pop_quiet`](Self::pop_quiet).
    fn enqueue_quiet(&self, ev: T) {
        lock(&self.inner).queue.push_back(ev);
    }

    /// Pops after quiet enqueues: signals the events left behind, which
    /// other consumers must see.
    fn pop_quiet(&self) -> Option<T> {
        let mut g = lock(&self.inner);
        let ev = g.queue.pop_front();
        if g.queue.is_empty() {
            self.clear(&mut g);
            return ev;
        }
        let left = g.unread == 0;
        if left {
            g.unread += 1;
        }
        drop(g);
        if left {
            self.signal();
        }
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

/// What [`CqShared::push`] did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Push {
    /// Queued.
    Queued,
    /// Queued, and it disarmed the CQ: its channel must be signalled.
    Fired,
    /// Not queued: the CQ is full and in error from now on (the engine
    /// moves its QPs to ERR).
    Overflowed,
    /// Not queued: the CQ had overflowed before.
    Lost,
}

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
                tracing::debug!(error = %e, "soft channel: cannot watch a socket");
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

pub(crate) struct CqState {
    queue: VecDeque<Completion>,
    /// `Some(solicited_only)` while armed.
    armed: Option<bool>,
    overflow: bool,
    /// Polls that found the queue empty since the CQ was last armed: from
    /// the second on, the application busy-polls, and its polls receive
    /// themselves (see `drive.rs`).
    idle_polls: u32,
}

/// CQ state shared by the handle and the engine.
pub(crate) struct CqShared {
    pub handle: u32,
    pub capacity: u32,
    state: Mutex<CqState>,
    /// Events acknowledged (outside `state`: the application acks while
    /// the engine pushes).
    acked: AtomicU64,
    channel: Option<Arc<Channel>>,
    async_events: Arc<EventQueue<AsyncEvent>>,
    /// Mirror of `state.armed.is_some()`, read by the engine without the
    /// CQ's lock.
    armed_flag: AtomicBool,
    /// The sockets whose packets complete this CQ's WRs (kept by the
    /// engine): arming the CQ hands them back to the engine.
    pub feeds: Mutex<SmallVec<[Arc<Wire>; 2]>>,
}

impl CqShared {
    pub fn new(
        handle: u32,
        capacity: u32,
        channel: Option<Arc<Channel>>,
        async_events: Arc<EventQueue<AsyncEvent>>,
    ) -> CqShared {
        CqShared {
            handle,
            capacity,
            state: Mutex::new(CqState {
                queue: VecDeque::with_capacity(capacity as usize),
                armed: None,
                overflow: false,
                idle_polls: 0,
            }),
            acked: AtomicU64::new(0),
            channel,
            async_events,
            armed_flag: AtomicBool::new(false),
            feeds: Mutex::new(SmallVec::new()),
        }
    }

    /// Pushes a completion (engine side). `solicited` marks a receive
    /// completion of a solicited message; error completions count as
    /// solicited. True if this disarmed the CQ: the caller must then
    /// [`signal`](Self::signal) its channel (the engine does so once per
    /// loop turn, after all of that turn's completions are in).
    #[must_use]
    pub fn push(&self, wc: Completion, solicited: bool) -> Push {
        let mut st = lock(&self.state);
        if st.overflow {
            return Push::Lost;
        }
        if st.queue.len() >= self.capacity as usize {
            st.overflow = true;
            drop(st);
            tracing::warn!(cq = self.handle, "soft CQ overflow");
            self.async_events.push(AsyncEvent {
                kind: AsyncEventKind::CqErr,
                element: AsyncElement::Cq(self.handle),
            });
            return Push::Overflowed;
        }
        st.queue.push_back(wc);
        let fire = match st.armed {
            Some(only_solicited) => !only_solicited || solicited || !wc.status.is_success(),
            None => false,
        };
        if fire {
            st.armed = None;
            self.armed_flag.store(false, Ordering::SeqCst);
            Push::Fired
        } else {
            Push::Queued
        }
    }

    /// Queues this CQ's event on its channel (after a `push` that fired).
    /// `quiet`: the channel whose `get_event` receives now, and takes the
    /// event itself (no signal needed for it).
    pub fn signal(&self, quiet: Option<&Channel>) {
        if let Some(ch) = &self.channel {
            if quiet.is_some_and(|q| std::ptr::eq(q, &**ch)) {
                ch.events.enqueue_quiet(self.handle);
                return;
            }
            ch.events.push(self.handle);
        }
    }

    /// Completions waiting (tests: looks without receiving).
    #[cfg(test)]
    pub fn queued(&self) -> usize {
        lock(&self.state).queue.len()
    }

    /// True while armed.
    pub fn armed(&self) -> bool {
        self.armed_flag.load(Ordering::SeqCst)
    }

    /// Takes completions; also says whether the caller should receive
    /// itself (nothing there, not armed, and polled empty before).
    fn poll(&self, out: &mut [Completion]) -> Result<(usize, bool)> {
        let mut st = lock(&self.state);
        if st.overflow {
            return Err(ProviderError::CqOverflow {
                cq: self.handle,
                capacity: self.capacity,
            });
        }
        let n = out.len().min(st.queue.len());
        for (slot, wc) in out.iter_mut().zip(st.queue.drain(..n)) {
            *slot = wc;
        }
        let mut drive = false;
        if n == 0 && !out.is_empty() && st.armed.is_none() {
            st.idle_polls = st.idle_polls.saturating_add(1);
            drive = st.idle_polls >= 2;
        }
        Ok((n, drive))
    }

    /// Arms the CQ. Its sockets join its channel's set (the application
    /// is going to sleep on the channel, and its `get_event` receives what
    /// wakes it), the lease on them is renewed to `lease_until`, and the
    /// engine stops watching their input (`muted` is told of each socket
    /// muted now: the engine must learn of it); a
    /// socket that cannot join (the engine is writing to it, or with
    /// app-driven receive off, `None`) is handed back to the engine at once
    /// (after the arming, which keeps the engine from taking it away again).
    fn req_notify(
        &self,
        solicited_only: bool,
        registry: &mio::Registry,
        lease_until: impl FnOnce() -> Option<u64>,
        mut muted: impl FnMut(&Wire, u64),
    ) {
        {
            let mut st = lock(&self.state);
            st.armed = Some(solicited_only);
            st.idle_polls = 0;
            self.armed_flag.store(true, Ordering::SeqCst);
        }
        let feeds = lock(&self.feeds);
        if feeds.is_empty() {
            return;
        }
        let lease_until = lease_until();
        for w in feeds.iter() {
            match (&self.channel, lease_until) {
                // (A connection the engine is writing to stays the
                // engine's: see `CompChannel::receive`.)
                (Some(ch), Some(until)) if !w.engine_busy() && ch.join(w) => {
                    w.renew_lease(until);
                    // The engine need not wake for what arrives now: the
                    // application does (usually the socket is muted already;
                    // after a hand-back it is not). (The lease was just
                    // renewed: it lasts beyond `until - 1`.)
                    if w.mute(registry, until.saturating_sub(1), || false) {
                        muted(w, until);
                    }
                }
                (Some(ch), _) => ch.hand_back(w, registry),
                (None, _) => w.revoke(registry),
            }
        }
    }

    /// True if an application sleeping on this CQ's channel wakes when
    /// `wire` receives (it is in the channel's set).
    pub fn app_wakes(&self, wire: &Wire) -> bool {
        self.channel.as_ref().is_some_and(|ch| ch.holds(wire))
    }
}

/// A completion queue of the soft device.
#[derive(Clone)]
pub struct Cq {
    pub(crate) shared: Arc<CqShared>,
    pub(crate) _channel: Option<CompChannel>,
    pub(crate) _ctx: Context,
}

impl Cq {
    /// Handle unique within the context.
    pub fn handle(&self) -> u32 {
        self.shared.handle
    }
    /// Capacity.
    pub fn capacity(&self) -> u32 {
        self.shared.capacity
    }
    /// Arms the CQ for one event.
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        let sh = self._ctx.shared();
        let until = || (!sh.lease.is_zero()).then(|| sh.nanos_at(Instant::now() + sh.lease));
        let muted = |w: &Wire, until| sh.app_muted(w.cid(), until);
        self.shared
            .req_notify(solicited_only, &sh.registry, until, muted);
        Ok(())
    }
    /// Takes up to `out.len()` completions. An application that polls an
    /// empty CQ again without arming it busy-polls: then the poll reads
    /// the CQ's connections itself and runs the engine's receive work
    /// (`drive.rs`), sparing the engine thread's wakeup.
    pub fn poll(&self, out: &mut [Completion]) -> Result<usize> {
        let (n, drive) = self.shared.poll(out)?;
        if !drive || self._ctx.shared().lease.is_zero() {
            return Ok(n);
        }
        self._ctx.drive(&self.shared);
        Ok(self.shared.poll(out)?.0)
    }
    /// Acknowledges `n` events.
    pub fn ack_events(&self, n: u32) {
        self.shared.acked.fetch_add(u64::from(n), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn readable(fd: RawFd) -> bool {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, no wait.
        unsafe { libc::poll(&mut p, 1, 0) == 1 }
    }

    #[test]
    fn only_a_cq_polled_empty_again_without_arming_receives_itself() {
        let events = Arc::new(EventQueue::new().expect("eventfd"));
        let cq = CqShared::new(1, 4, None, events);
        let registry = mio::Poll::new()
            .expect("epoll")
            .registry()
            .try_clone()
            .expect("registry");
        let mut out = [Completion::EMPTY; 2];
        // A sleeping application: drains, arms, polls once more, sleeps.
        assert_eq!(cq.poll(&mut out).expect("poll"), (0, false));
        cq.req_notify(false, &registry, || None, |_, _| {});
        assert!(cq.armed());
        assert_eq!(cq.poll(&mut out).expect("poll"), (0, false));
        assert_eq!(cq.poll(&mut out).expect("poll"), (0, false), "armed");
        let wc = Completion {
            wr_id: 7,
            ..Completion::EMPTY
        };
        assert_eq!(cq.push(wc, false), Push::Fired);
        assert!(!cq.armed());
        assert_eq!(cq.poll(&mut out).expect("poll"), (1, false));
        assert_eq!(cq.poll(&mut out).expect("poll"), (0, false));
        // A busy-polling one: from the second empty poll on, until it arms.
        assert_eq!(cq.poll(&mut out).expect("poll"), (0, true));
        assert_eq!(cq.push(wc, false), Push::Queued);
        assert_eq!(cq.poll(&mut out).expect("poll"), (1, false));
        assert_eq!(cq.poll(&mut out).expect("poll"), (0, true));
        assert_eq!(cq.poll(&mut []).expect("poll"), (0, false), "no room asked");
        cq.req_notify(true, &registry, || None, |_, _| {});
        assert_eq!(cq.poll(&mut out).expect("poll"), (0, false));
    }

    #[test]
    fn channel_fd_is_readable_while_a_member_holds_data_until_handed_back_or_closed() {
        use std::io::Write;
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let mut peer =
            std::net::TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let (s, _) = l.accept().expect("accept");
        s.set_nonblocking(true).expect("nonblocking");
        let wire = Arc::new(Wire::new(
            mio::net::TcpStream::from_std(s),
            mio::Token(super::super::engine::CONN_BASE + 3),
        ));
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
        assert!(q.enqueue(3));
        assert_eq!(q.pop(), Some(3));
        assert!(!readable(q.fd()));
        q.signal();
        assert!(readable(q.fd()));
        assert_eq!(q.pop(), None);
        assert!(!readable(q.fd()));
        assert_eq!(q.pop(), None);
        assert!(!readable(q.fd()));
    }
}
