//! [`Receiving`]: a connection's receive side: its receive ring, the
//! user messages delivered and not yet taken (the inbox), and who polls the
//! ring.
//!
//! The receives are a [`RecvRing`] of the runtime: buffers posted once,
//! their completions routed to the ring by reserved wr_ids (no op, no
//! allocation per message). The ring has `lend_max` slots more than the
//! posted buffers the settings exchange agreed (credits and reserve): a
//! whole message is lent to the application in the slot it landed in
//! (zero-copy, its credit returned at once), and the spare slots keep the
//! agreed number posted meanwhile. With every spare slot lent, a message
//! is copied out instead.
//!
//! One message, one wake-up on its way to the application: every poll of
//! the ring uses one waker of the connection's own ([`Fan`]), which
//! wakes the application task waiting in `receive_msg`. The receiver then
//! takes the completion in its own poll (`task::step`) and returns the
//! message from there, zero-copy and with no queue in between. Each
//! completion (and each wake of the fan) also schedules the connection's
//! check on the ring ([`RecvRing::check_after_wakes`]): at the end of the
//! loop pass, after the receiver ran, it wakes the agent task only if the
//! completions are still untaken (no receiver waited, or it holds a
//! `receive_msg` future it does not poll: the connection's control
//! messages, such as credits the application's own sends wait for, keep
//! flowing) or if a whole batch of credits is owed that no reply carried.
//! In the usual round trip neither holds: the check costs a flag check
//! and a push when the completion lands, and is skipped at the end of the
//! pass (the receiver found the ring waiting again, see `receive::settle`). With no receiver waiting, the agent takes the completions and
//! queues user messages in the inbox, charged to the unread backlog.
//!
//! One receiver at a time polls the ring (the driver); others
//! wait for the inbox or their turn. The inbox is a `VecDeque`: no
//! allocation per message once it has grown to the connection's burst.

use std::cell::{Cell, RefCell, UnsafeCell};
use std::collections::VecDeque;
use std::rc::{Rc, Weak};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use futures::task::AtomicWaker;
use verbio_runtime::{PassHook, RecvRing, RecvRingError, RingMsg};

use super::msg::{Body, Lent, RecvMsg};
use super::rdma::Shared;

/// The driving receiver's waker, kept across wakes: a receiver waiting
/// again on the same task (the usual round trip) only marks it waiting
/// again, with no clone, and a wake wakes it by reference. A receiver that
/// leaves withdraws (not woken until a receiver waits again); the next
/// driver's waker replaces it unless it would wake the same task.
///
/// Everything here runs on the connection's runtime thread, except a wake
/// of the fan from elsewhere: `busy` keeps the accesses apart, and is
/// never waited for (see each method).
#[derive(Default)]
struct ReceiverSlot {
    busy: AtomicBool,
    cell: UnsafeCell<Registered>,
}

#[derive(Default)]
struct Registered {
    /// The last driving receiver's waker (kept after it leaves, for reuse).
    waker: Option<Waker>,
    /// A receiver waits on `waker`: the next wake wakes it (and clears it).
    waiting: bool,
}

// SAFETY: `cell` is only accessed through a `Held`, which exists only
// while this thread set `busy` (from false), so accesses never overlap;
// `Waker` is `Send + Sync`.
unsafe impl Sync for ReceiverSlot {}

/// `busy` held: the slot's contents.
struct Held<'a>(&'a ReceiverSlot);

impl Held<'_> {
    #[inline(always)]
    fn get(&mut self) -> &mut Registered {
        // SAFETY: `busy` is held by this `Held` (see `ReceiverSlot`), and
        // the `&mut self` borrow makes this the only reference through it.
        unsafe { &mut *self.0.cell.get() }
    }
}

impl Drop for Held<'_> {
    #[inline(always)]
    fn drop(&mut self) {
        self.0.busy.store(false, Ordering::SeqCst);
    }
}

impl ReceiverSlot {
    /// The slot, unless another access holds it (a wake in progress).
    #[inline(always)]
    fn hold(&self) -> Option<Held<'_>> {
        if self.busy.swap(true, Ordering::SeqCst) {
            None
        } else {
            Some(Held(self))
        }
    }

    /// The driving receiver waits on `waker`. Should a wake hold the slot
    /// now (from another thread: one on this thread never polls), the
    /// receiver is woken at once instead, as `AtomicWaker` does.
    #[inline(always)]
    fn register(&self, waker: &Waker) {
        let Some(mut held) = self.hold() else {
            waker.wake_by_ref();
            return;
        };
        let r = held.get();
        r.waiting = true;
        if !r.waker.as_ref().is_some_and(|w| w.will_wake(waker)) {
            // A waker's drop may run anything: after `busy` is released.
            let old = r.waker.replace(waker.clone());
            drop(held);
            drop(old);
        }
    }

    /// Wakes the waiting receiver, if one waits. Should another access
    /// hold the slot, it is a registration (it then sees the fan's `armed`
    /// cleared and looks again) or a wake in progress (which wakes it).
    #[inline(always)]
    fn wake(&self) {
        let Some(mut held) = self.hold() else {
            return;
        };
        let r = held.get();
        if r.waiting {
            r.waiting = false;
            if let Some(w) = &r.waker {
                w.wake_by_ref();
            }
        }
    }

    /// The receiver left: not woken until one waits again (a wake in
    /// progress, the only other access, clears it anyway).
    #[inline(always)]
    fn withdraw(&self) {
        if let Some(mut held) = self.hold() {
            held.get().waiting = false;
        }
    }
}

impl std::fmt::Debug for ReceiverSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReceiverSlot")
    }
}

/// The waker the connection's receive ring is polled with: wakes the
/// driving receiver (if one waits); the ring's check
/// ([`Receiving::pass_ended`]) wakes the agent task if needed, or the fan
/// does at once while the ring has none.
#[derive(Debug, Default)]
struct Fan {
    receiver: ReceiverSlot,
    agent: AtomicWaker,
    /// The ring was polled pending (with this waker) and has not woken it
    /// since: nothing to take until it does.
    armed: AtomicBool,
    /// The ring has the connection's check: it wakes the agent task.
    checked: AtomicBool,
    /// A whole batch of credits became owed since the agent last looked:
    /// it returns them in a `Credit` message of their own if no data piece
    /// took them first.
    owed_check: AtomicBool,
}

impl Fan {
    /// Has the agent task look at the connection once the tasks woken
    /// before now have run: the ring's check does at the end of the loop
    /// pass (waking it only if work is left); without one, a wake now.
    #[inline]
    fn wake_agent_later(&self) {
        if !self.checked.load(Ordering::Relaxed) {
            self.agent.wake();
        }
    }
}

impl Wake for Fan {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        // Before the receiver's slot: a registration racing with this wake
        // sees it (`Receiving::drive_wait`).
        self.armed.store(false, Ordering::SeqCst);
        self.receiver.wake();
        self.wake_agent_later();
    }
}

/// The connection's check on its receive ring, run at the end of a loop
/// pass in which a receive completed or the ring woke the fan: wakes the
/// agent task if a receiver did not take the completions, or if a whole
/// batch of credits is owed that no reply took. In the usual round trip
/// neither holds and the agent sleeps.
struct AgentCheck {
    fan: Arc<Fan>,
    shared: Weak<Shared>,
}

impl PassHook for AgentCheck {
    fn pass_ended(&self) {
        let fan = &*self.fan;
        // The usual case: all taken, no batch of credits owed since the
        // agent looked.
        if fan.armed.load(Ordering::Relaxed) && !fan.owed_check.load(Ordering::Relaxed) {
            return;
        }
        let Some(s) = self.shared.upgrade() else {
            return;
        };
        if !fan.armed.load(Ordering::Relaxed) || s.owed.has_batch() {
            fan.agent.wake();
        }
    }
}

/// What a receiver does next ([`Receiving::begin`]).
pub(crate) enum Begin {
    /// A message from the inbox (charged to the backlog: give it back).
    Queued(RecvMsg),
    /// Nothing more will arrive.
    Closed,
    /// Waits (registered) for the inbox or its turn to drive.
    Wait,
    /// Drives: polls the ring itself.
    Drive,
}

/// The receive side of one connection (single-threaded).
pub(crate) struct Receiving {
    state: RefCell<State>,
    /// The receive ring (`None` on a shared receive queue, and once closed).
    ring: RefCell<Option<RecvRing>>,
    /// Ring slots lent to the application now, and at most.
    lent: Rc<Cell<u32>>,
    lend_max: Cell<u32>,
    fan: Arc<Fan>,
    fan_waker: Waker,
}

struct State {
    /// True if this side polls its own ring (false: the agent reads the
    /// connection's route from a shared receive queue).
    own: bool,
    /// User messages delivered and not taken, oldest first.
    inbox: VecDeque<RecvMsg>,
    /// The agent stopped: nothing more arrives.
    closed: bool,
    /// The receiver that polls the ring now (its id).
    driver: Option<u64>,
    next_id: u64,
    /// Receivers waiting for the inbox or their turn (id, waker), in the
    /// order they came.
    waiters: Vec<(u64, Waker)>,
}

impl std::fmt::Debug for Receiving {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never panics, even when printed from inside a borrow.
        let Ok(s) = self.state.try_borrow() else {
            return f.write_str("Receiving { <in use> }");
        };
        f.debug_struct("Receiving")
            .field("lent", &self.lent.get())
            .field("queued", &s.inbox.len())
            .field("closed", &s.closed)
            .field("driver", &s.driver)
            .finish()
    }
}

impl Receiving {
    /// An empty receive side (`own`: the connection posts its own
    /// receives, else messages come from a shared receive queue's route).
    pub(crate) fn new(own: bool) -> Receiving {
        let fan = Arc::new(Fan::default());
        Receiving {
            ring: RefCell::new(None),
            lent: Rc::new(Cell::new(0)),
            lend_max: Cell::new(0),
            state: RefCell::new(State {
                own,
                inbox: VecDeque::new(),
                closed: false,
                driver: None,
                next_id: 1,
                waiters: Vec::new(),
            }),
            fan_waker: Waker::from(fan.clone()),
            fan,
        }
    }

    /// The connection's receive ring, with `lend_max` of its slots spare
    /// for messages lent to the application.
    pub(crate) fn set_ring(&self, ring: RecvRing, lend_max: u32) {
        *self.ring.borrow_mut() = Some(ring);
        self.lend_max.set(lend_max);
    }

    /// The next received message if the ring's oldest completion is one
    /// ([`RecvRing::try_next`]); else [`Receiving::poll_ring`] tells.
    #[inline(always)]
    pub(crate) fn try_ring(&self) -> Option<RingMsg> {
        self.ring.borrow().as_ref()?.try_next()
    }

    /// The next received message, in arrival order, polled with the fan
    /// waker; `Ready(None)` once the ring has ended or was closed.
    #[inline]
    pub(crate) fn poll_ring(&self) -> Poll<Option<Result<RingMsg, RecvRingError>>> {
        let ring = self.ring.borrow();
        let Some(r) = ring.as_ref() else {
            return Poll::Ready(None);
        };
        let p = r.poll_next(&mut Context::from_waker(&self.fan_waker));
        if p.is_pending() {
            self.fan.armed.store(true, Ordering::Relaxed);
        }
        p
    }

    /// True if this side polls a receive ring of its own (false on a
    /// shared receive queue: the agent task reads the connection's route).
    #[inline(always)]
    pub(crate) fn owns_ring(&self) -> bool {
        self.state.borrow().own
    }

    /// True if polling the ring would find nothing and change nothing (see
    /// [`RecvRing::is_waiting`]): then it counts as polled pending
    /// ([`Receiving::armed`]).
    #[inline(always)]
    pub(crate) fn ring_waiting(&self) -> bool {
        let waiting = self
            .ring
            .borrow()
            .as_ref()
            .is_some_and(|r| r.is_waiting(&self.fan_waker));
        if waiting {
            self.fan.armed.store(true, Ordering::Relaxed);
        }
        waiting
    }

    /// A whole message of `len` payload bytes at `start` of `slot`, with
    /// immediate `imm`: lent in its slot if a spare slot is left, else
    /// copied out (the slot reposted at once). `None` if the range is not
    /// within what the slot received.
    #[inline(always)]
    pub(crate) fn lend(
        &self,
        start: usize,
        len: usize,
        imm: Option<u32>,
        slot: RingMsg,
    ) -> Option<RecvMsg> {
        let range = start..start.checked_add(len)?;
        let body = if self.lent.get() < self.lend_max.get() {
            Body::Ring(Lent::new(slot, range, &self.lent)?)
        } else {
            Body::Vec(slot.get(range)?.to_vec())
        };
        Some(RecvMsg { body, imm })
    }

    /// True once every spare slot is lent: a whole message taken from the
    /// ring now would be copied out ([`Receiving::lend`]).
    #[inline(always)]
    pub(crate) fn lending_full(&self) -> bool {
        self.lent.get() >= self.lend_max.get()
    }

    /// True if nothing completed since the ring was last polled pending:
    /// the agent's turn has nothing to take.
    #[inline]
    pub(crate) fn armed(&self) -> bool {
        self.fan.armed.load(Ordering::Relaxed)
    }

    /// The driving receiver found the ring pending ([`Receiving::armed`])
    /// and waits on `cx`: true if it may return pending (the fan wakes it),
    /// false if a completion came in before it registered (it looks again).
    #[inline(always)]
    pub(crate) fn drive_wait(&self, cx: &Context<'_>) -> bool {
        self.fan.receiver.register(cx.waker());
        self.fan.armed.load(Ordering::SeqCst)
    }

    /// Queues a user message for the application; false if the receive
    /// side is closed (the message is dropped).
    pub(crate) fn deliver(&self, msg: RecvMsg) -> bool {
        let waiters = {
            let mut s = self.state.borrow_mut();
            if s.closed {
                return false;
            }
            s.inbox.push_back(msg);
            std::mem::take(&mut s.waiters)
        };
        for (_, w) in waiters {
            w.wake();
        }
        self.fan.receiver.wake();
        true
    }

    /// A whole batch of credits became owed (a message was taken): at the
    /// end of the loop pass, once the application task that took the
    /// message had its chance to send them on a reply, the ring's check
    /// (scheduled here, not skipped) wakes the agent task if they still
    /// make one.
    #[inline]
    pub(crate) fn batch_owed(&self) {
        self.fan.owed_check.store(true, Ordering::Relaxed);
        match self.ring.borrow().as_ref() {
            Some(ring) if self.fan.checked.load(Ordering::Relaxed) => ring.schedule_check(),
            _ => self.fan.agent.wake(),
        }
    }

    /// From now on the agent task of connection `shared` is woken through
    /// the ring's check ([`AgentCheck`]), run after each completion and
    /// wake of the ring.
    pub(crate) fn use_check(&self, shared: Weak<Shared>) {
        if let Some(ring) = self.ring.borrow().as_ref() {
            let check = AgentCheck {
                fan: self.fan.clone(),
                shared,
            };
            ring.check_after_wakes(Some(Rc::new(check)));
            self.fan.checked.store(true, Ordering::Relaxed);
        }
    }

    /// True if a whole batch of credits became owed since the last call.
    pub(crate) fn take_owed_check(&self) -> bool {
        let owed = self.fan.owed_check.load(Ordering::Relaxed);
        if owed {
            self.fan.owed_check.store(false, Ordering::Relaxed);
        }
        owed
    }

    /// The agent task waits on `cx` for completions and for credits to send.
    pub(crate) fn agent_waits(&self, cx: &Context<'_>) {
        self.fan.agent.register(cx.waker());
    }

    /// Nothing more arrives: pending and later receivers get what is
    /// queued, then [`Begin::Closed`]. The ring is dropped (its posted
    /// buffers stay the device's until the QP's flush completes them; lent
    /// messages stay valid).
    pub(crate) fn close(&self) {
        let waiters = {
            let mut s = self.state.borrow_mut();
            s.closed = true;
            std::mem::take(&mut s.waiters)
        };
        let ring = self.ring.borrow_mut().take();
        drop(ring);
        // The ring and its check are gone: the fan wakes the agent itself.
        self.fan.checked.store(false, Ordering::Relaxed);
        for (_, w) in waiters {
            w.wake();
        }
        self.fan.wake_by_ref();
    }

    /// A new receiver's id.
    #[inline(always)]
    pub(crate) fn receiver_id(&self) -> u64 {
        let mut s = self.state.borrow_mut();
        let id = s.next_id;
        s.next_id += 1;
        id
    }

    /// What receiver `id`, polled with `cx`, does next; `messages`: it
    /// takes user messages from the inbox (a receiver of WRITE immediates
    /// does not, it only drives).
    #[inline(always)]
    pub(crate) fn begin(&self, id: u64, messages: bool, cx: &Context<'_>) -> Begin {
        let mut s = self.state.borrow_mut();
        if messages {
            if let Some(m) = s.inbox.pop_front() {
                return Begin::Queued(m);
            }
        }
        if s.closed {
            return Begin::Closed;
        }
        if s.own && s.driver.is_none_or(|d| d == id) {
            // Registered only when it waits ([`Receiving::drive_wait`]):
            // the usual poll takes a message and registers nothing.
            s.driver = Some(id);
            return Begin::Drive;
        }
        // Polled again without a wake (a `select!` loop): one entry each.
        match s.waiters.iter_mut().find(|(w, _)| *w == id) {
            Some((_, w)) => {
                if !w.will_wake(cx.waker()) {
                    *w = cx.waker().clone();
                }
            }
            None => s.waiters.push((id, cx.waker().clone())),
        }
        Begin::Wait
    }

    /// Receiver `id` is done (it returned or was dropped): if it drove,
    /// the receiver waiting longest drives next (so concurrent receivers
    /// take turns).
    #[inline(always)]
    pub(crate) fn leave(&self, id: u64) {
        let next = {
            let mut s = self.state.borrow_mut();
            if s.driver != Some(id) {
                s.waiters.retain(|(w, _)| *w != id);
                return;
            }
            s.driver = None;
            if s.waiters.is_empty() {
                None
            } else {
                let (next, waker) = s.waiters.remove(0);
                s.driver = Some(next);
                Some(waker)
            }
        };
        // Later completions wake the agent (and the next driver once it
        // registers); its waker stays for a receiver of the same task.
        self.fan.receiver.withdraw();
        if let Some(w) = next {
            w.wake();
        }
    }
}
