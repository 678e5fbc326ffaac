//! Queue entries: the runtime counts the entries of each work queue (send
//! queue, receive queue, SRQ) and of each CQ ([`QueueEntries`], a count with
//! a FIFO of waiters), and an op holds its [`HeldEntries`] from its post to
//! its last completion. A submission takes its entries before it posts, so
//! the device's queues and CQs are never overrun; a full queue makes it wait
//! instead. (These are not the agent's send credits, which count the peer's
//! receive buffers, nor the RPC engine's session credits.)

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

/// A waiter's place in a [`QueueEntries`] FIFO (nonzero: `Option<Ticket>` is
/// 8 bytes, which keeps a waiting [`Submit`] small).
pub(crate) type Ticket = std::num::NonZeroU64;

/// The free entries of one work queue or CQ, with a FIFO of waiters.
pub(crate) struct QueueEntries {
    cap: u32,
    avail: Cell<u32>,
    waiters: RefCell<VecDeque<(Ticket, Waker)>>,
    /// `waiters.len()` (the hot paths check it without borrowing the queue).
    queued: Cell<u32>,
    next_ticket: Cell<Ticket>,
    /// Woken whenever every entry is back (QP close waits on this).
    idle: RefCell<Vec<Waker>>,
    /// `!idle.is_empty()`.
    idle_waiting: Cell<bool>,
    /// `cap`, or 0 while `queued != 0 || idle_waiting` (a release must
    /// then look at the waiters): the most entries a release may leave
    /// available on [`release`](Self::release)'s fast path, one compare
    /// for both of its conditions.
    quiet_cap: Cell<u32>,
}

impl QueueEntries {
    pub(crate) fn new(cap: u32) -> QueueEntries {
        QueueEntries {
            cap,
            avail: Cell::new(cap),
            waiters: RefCell::new(VecDeque::with_capacity(8)),
            queued: Cell::new(0),
            next_ticket: Cell::new(Ticket::MIN),
            idle: RefCell::new(Vec::new()),
            idle_waiting: Cell::new(false),
            quiet_cap: Cell::new(cap),
        }
    }

    /// Sets the FIFO's length and the flag derived from it.
    fn set_queued(&self, n: usize) {
        self.queued.set(n as u32);
        self.set_attention(n != 0 || self.idle_waiting.get());
    }

    /// Sets `idle_waiting` and the flag derived from it.
    fn set_idle_waiting(&self, w: bool) {
        self.idle_waiting.set(w);
        self.set_attention(w || self.queued.get() != 0);
    }

    /// Sets `quiet_cap` from whether a release must look at the waiters.
    fn set_attention(&self, attention: bool) {
        self.quiet_cap.set(if attention { 0 } else { self.cap });
    }

    pub(crate) fn capacity(&self) -> u32 {
        self.cap
    }

    pub(crate) fn available(&self) -> u32 {
        self.avail.get()
    }

    pub(crate) fn outstanding(&self) -> u32 {
        self.cap - self.avail.get()
    }

    /// Someone waits in the FIFO.
    #[inline]
    pub(crate) fn has_waiters(&self) -> bool {
        self.queued.get() != 0
    }

    /// Takes `n` entries now if nobody is queued ahead and they are there.
    #[inline]
    pub(crate) fn try_acquire(&self, n: u32) -> bool {
        if self.queued.get() == 0 && self.avail.get() >= n {
            self.avail.set(self.avail.get() - n);
            true
        } else {
            false
        }
    }

    /// Takes `n` entries now if it is the caller's turn (`ticket` is first
    /// in the FIFO, or `None` and nobody waits) and they are there; leaves
    /// the FIFO then. Never registers a waker: a waiter that is not served
    /// keeps its place and the waker it last polled with.
    pub(crate) fn try_acquire_in_turn(&self, n: u32, ticket: &mut Option<Ticket>) -> bool {
        let mut waiters = self.waiters.borrow_mut();
        let first = match *ticket {
            None => waiters.is_empty(),
            Some(t) => waiters.front().map(|(id, _)| *id) == Some(t),
        };
        if !first || self.avail.get() < n {
            return false;
        }
        self.avail.set(self.avail.get() - n);
        if ticket.take().is_some() {
            waiters.pop_front();
            self.set_queued(waiters.len());
            // The next in line may fit in what is left.
            let next = waiters.front().map(|(_, w)| w.clone());
            drop(waiters);
            if let Some(w) = next {
                w.wake();
            }
        }
        true
    }

    /// Waits in FIFO order for `n` entries; `ticket` is the caller's place.
    pub(crate) fn poll_acquire(
        &self,
        n: u32,
        ticket: &mut Option<Ticket>,
        cx: &mut Context<'_>,
    ) -> Poll<()> {
        if self.try_acquire_in_turn(n, ticket) {
            return Poll::Ready(());
        }
        let mut waiters = self.waiters.borrow_mut();
        match *ticket {
            None => {
                let t = self.next_ticket.get();
                // (A u64 count of waits never wraps.)
                self.next_ticket
                    .set(t.checked_add(1).unwrap_or(Ticket::MIN));
                waiters.push_back((t, cx.waker().clone()));
                self.set_queued(waiters.len());
                *ticket = Some(t);
            }
            Some(t) => {
                if let Some((_, w)) = waiters.iter_mut().find(|(id, _)| *id == t) {
                    if !w.will_wake(cx.waker()) {
                        w.clone_from(cx.waker());
                    }
                }
            }
        }
        Poll::Pending
    }

    /// Leaves the queue (a waiting submission was dropped or failed).
    pub(crate) fn cancel(&self, ticket: &mut Option<Ticket>) {
        let Some(t) = ticket.take() else { return };
        let mut waiters = self.waiters.borrow_mut();
        let was_first = waiters.front().map(|(id, _)| *id) == Some(t);
        waiters.retain(|(id, _)| *id != t);
        self.set_queued(waiters.len());
        let next = if was_first {
            waiters.front().map(|(_, w)| w.clone())
        } else {
            None
        };
        drop(waiters);
        if let Some(w) = next {
            w.wake();
        }
    }

    /// Gives `n` entries back. The common case is one test: nobody waits
    /// (in the FIFO or for idleness) and the count stays within capacity.
    #[inline]
    pub(crate) fn release(&self, n: u32) {
        // No overflow: `avail <= cap`, and `n` was taken from this pool.
        let avail = self.avail.get() + n;
        if avail <= self.quiet_cap.get() {
            self.avail.set(avail);
        } else {
            self.release_slow(avail);
        }
    }

    /// The rare part of [`release`](Self::release): somebody waits (or more
    /// came back than was taken, which is clamped).
    #[cold]
    #[inline(never)]
    fn release_slow(&self, avail: u32) {
        let avail = avail.min(self.cap);
        self.avail.set(avail);
        if self.queued.get() != 0 || (avail == self.cap && self.idle_waiting.get()) {
            self.wake_after_release(avail);
        }
    }

    /// Wakes who may proceed after a release: the first in the FIFO, and
    /// the idle waiters once every entry is back.
    fn wake_after_release(&self, avail: u32) {
        let next = self.waiters.borrow().front().map(|(_, w)| w.clone());
        if let Some(w) = next {
            w.wake();
        }
        if avail == self.cap && self.idle_waiting.get() {
            self.set_idle_waiting(false);
            let idle = std::mem::take(&mut *self.idle.borrow_mut());
            for w in idle {
                w.wake();
            }
        }
    }

    /// Wakes every waiter (they re-check, e.g. to notice a closed QP).
    pub(crate) fn wake_all(&self) {
        let all: Vec<Waker> = self
            .waiters
            .borrow()
            .iter()
            .map(|(_, w)| w.clone())
            .collect();
        for w in all {
            w.wake();
        }
    }

    /// `Ready` once every entry is back.
    pub(crate) fn poll_idle(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.avail.get() == self.cap {
            return Poll::Ready(());
        }
        let mut idle = self.idle.borrow_mut();
        if !idle.iter().any(|w| w.will_wake(cx.waker())) {
            idle.push(cx.waker().clone());
        }
        self.set_idle_waiting(true);
        Poll::Pending
    }
}

/// The entry pools of one queue pair: its send and receive queues, and the
/// CQs (shared with other QPs) their completions land on.
pub(crate) struct QpEntries {
    pub(crate) sq: QueueEntries,
    pub(crate) rq: QueueEntries,
    pub(crate) send_cq: Rc<QueueEntries>,
    pub(crate) recv_cq: Rc<QueueEntries>,
}

impl QpEntries {
    /// The (work queue, CQ) pools of the send side, or of the receive side.
    #[inline(always)]
    pub(crate) fn pools(&self, recv: bool) -> (&QueueEntries, &QueueEntries) {
        if recv {
            (&self.rq, &self.recv_cq)
        } else {
            (&self.sq, &self.send_cq)
        }
    }

    /// Work requests outstanding on both queues.
    pub(crate) fn outstanding(&self) -> u32 {
        self.sq.outstanding() + self.rq.outstanding()
    }
}

/// Entries an op holds on its work queue and CQ; given back when its last
/// completion arrives (or when it is dropped unposted).
pub(crate) struct HeldEntries {
    pub(crate) pools: Rc<QpEntries>,
    /// Receive queue (and receive CQ) rather than send queue (and send CQ).
    pub(crate) recv: bool,
    pub(crate) n: u32,
}

impl Drop for HeldEntries {
    #[inline(always)]
    fn drop(&mut self) {
        let (queue, cq) = self.pools.pools(self.recv);
        queue.release(self.n);
        cq.release(self.n);
    }
}
