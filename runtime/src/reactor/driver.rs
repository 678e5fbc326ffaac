//! The I/O side of the reactor: `mio::Poll`, the completion channels and
//! their CQs, socket registrations, the op slab and the QP registry.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::io;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use mio::unix::SourceFd;
use mio::{Events, Interest, Registry, Token};
use slab::Slab;

use super::work_queue::WorkQueue;
use super::RuntimeError;
use crate::op::{wr_id, OpTable};
use crate::provider::{AsyncEvent, AsyncEventKind, CompChannel, Completion, Cq};

/// Token of the cross-thread waker.
pub(crate) const WAKER_TOKEN: Token = Token(usize::MAX);
/// Completion channels use tokens `CHANNEL_BASE + cq key`.
const CHANNEL_BASE: usize = 1 << (usize::BITS - 2);
/// Async-event fds use tokens `ASYNC_BASE + key`.
const ASYNC_BASE: usize = CHANNEL_BASE + (1 << (usize::BITS - 3));
/// Async events kept per device until someone takes them.
const ASYNC_QUEUE: usize = 64;

struct AsyncEntry {
    ctx: crate::provider::Context,
    queue: VecDeque<AsyncEvent>,
    waker: Option<Waker>,
}

struct CqEntry {
    cq: Cq,
    channel: CompChannel,
    /// `req_notify` was called and no event has been taken since.
    armed: bool,
    /// Events taken from the channel and not yet acknowledged.
    unacked: u32,
    /// The CQ overflowed; it is no longer polled.
    broken: bool,
}

#[derive(Default)]
struct IoEntry {
    read_ready: bool,
    write_ready: bool,
    read: Option<Waker>,
    write: Option<Waker>,
}

/// Receives completions of reserved wr_ids.
pub(crate) type ReservedHandler = Box<dyn FnMut(Completion)>;

/// Which direction a socket waits for.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Direction {
    Read,
    Write,
}

pub(crate) struct Driver {
    poll: RefCell<mio::Poll>,
    events: RefCell<Events>,
    registry: Registry,
    pub(crate) ops: Rc<OpTable>,
    cqs: RefCell<Slab<CqEntry>>,
    asyncs: RefCell<Slab<AsyncEntry>>,
    io: RefCell<Slab<IoEntry>>,
    /// Queue pairs, named by the key in inline wr_ids; kept until dropped
    /// and drained.
    qps: RefCell<Slab<Rc<dyn WorkQueue>>>,
    /// Receive rings, named by ring wr_ids; kept until dropped and drained.
    rings: RefCell<Slab<Rc<dyn WorkQueue>>>,
    /// Queue pairs dropped by their owner and still draining.
    draining: Cell<usize>,
    /// A poll phase is running: single send WRs wait for its end
    /// (`qp/deferred.rs`).
    batching: Cell<bool>,
    /// Queues to tell when the poll phase ends.
    phase_waiters: RefCell<Vec<Rc<dyn WorkQueue>>>,
    /// Where CQs are polled into; borrowed by `drain_cqs` throughout, so a
    /// nested call (from user code its completions run) polls no CQ.
    batch: RefCell<Vec<Completion>>,
    /// One past the highest CQ key ever registered.
    cq_bound: Cell<usize>,
    ack_batch: u32,
    pub(crate) reserved_handler: RefCell<Option<ReservedHandler>>,
    #[cfg(any(test, feature = "test-util"))]
    injected: RefCell<VecDeque<Completion>>,
    /// An empty queue swapped with `injected` to drain it without a borrow
    /// per completion (keeps its capacity: no allocation per drain).
    #[cfg(any(test, feature = "test-util"))]
    injected_spare: Cell<VecDeque<Completion>>,
}

impl Driver {
    pub(crate) fn new(
        poll: mio::Poll,
        events: usize,
        op_slots: usize,
        cq_batch: usize,
    ) -> Result<Driver, RuntimeError> {
        let registry = poll
            .registry()
            .try_clone()
            .map_err(|source| RuntimeError::Io {
                context: "cloning the mio registry",
                source,
            })?;
        Ok(Driver {
            poll: RefCell::new(poll),
            events: RefCell::new(Events::with_capacity(events.max(16))),
            registry,
            ops: Rc::new(OpTable::with_capacity(op_slots)),
            cqs: RefCell::new(Slab::new()),
            asyncs: RefCell::new(Slab::new()),
            io: RefCell::new(Slab::new()),
            qps: RefCell::new(Slab::new()),
            rings: RefCell::new(Slab::new()),
            draining: Cell::new(0),
            batching: Cell::new(false),
            phase_waiters: RefCell::new(Vec::new()),
            batch: RefCell::new(vec![Completion::EMPTY; cq_batch.max(1)]),
            cq_bound: Cell::new(0),
            ack_batch: 16,
            reserved_handler: RefCell::new(None),
            #[cfg(any(test, feature = "test-util"))]
            injected: RefCell::new(VecDeque::new()),
            #[cfg(any(test, feature = "test-util"))]
            injected_spare: Cell::new(VecDeque::new()),
        })
    }

    /// Events taken per epoll call.
    pub(crate) fn event_capacity(&self) -> usize {
        self.events.borrow().capacity()
    }

    pub(crate) fn poll_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.poll.borrow().as_raw_fd()
    }

    // ---- CQs -------------------------------------------------------------

    /// Registers a CQ and its completion channel (one CQ per channel).
    pub(crate) fn register_cq(&self, cq: Cq, channel: CompChannel) -> Result<usize, RuntimeError> {
        let mut cqs = self.cqs.borrow_mut();
        let entry = cqs.vacant_entry();
        let key = entry.key();
        let fd = channel.fd();
        self.registry
            .register(
                &mut SourceFd(&fd),
                Token(CHANNEL_BASE + key),
                Interest::READABLE,
            )
            .map_err(|source| RuntimeError::Io {
                context: "registering a completion channel with mio",
                source,
            })?;
        entry.insert(CqEntry {
            cq,
            channel,
            armed: false,
            unacked: 0,
            broken: false,
        });
        self.cq_bound.set(self.cq_bound.get().max(key + 1));
        Ok(key)
    }

    /// Forgets a CQ: acknowledges its remaining events, deregisters its channel.
    pub(crate) fn deregister_cq(&self, key: usize) {
        let Some(entry) = self.cqs.borrow_mut().try_remove(key) else {
            return;
        };
        // Take what is pending so the acknowledgement count is complete.
        let mut unacked = entry.unacked;
        while let Ok(Some(_)) = entry.channel.get_event() {
            unacked += 1;
        }
        if unacked > 0 {
            entry.cq.ack_events(unacked);
        }
        let fd = entry.channel.fd();
        if let Err(e) = self.registry.deregister(&mut SourceFd(&fd)) {
            tracing::debug!(error = %e, "deregistering a completion channel");
        }
    }

    // ---- async events ----------------------------------------------------

    /// Watches a context's async-event fd. `None` if it cannot be registered
    /// (e.g. another `Device` on the same context already watches it).
    pub(crate) fn register_async(&self, ctx: crate::provider::Context) -> Option<usize> {
        let mut asyncs = self.asyncs.borrow_mut();
        let entry = asyncs.vacant_entry();
        let key = entry.key();
        let fd = ctx.async_fd();
        match self.registry.register(
            &mut SourceFd(&fd),
            Token(ASYNC_BASE + key),
            Interest::READABLE,
        ) {
            Ok(()) => {
                entry.insert(AsyncEntry {
                    ctx,
                    queue: VecDeque::new(),
                    waker: None,
                });
                Some(key)
            }
            Err(e) => {
                tracing::debug!(error = %e, "async-event fd not watched");
                None
            }
        }
    }

    pub(crate) fn deregister_async(&self, key: usize) {
        let Some(entry) = self.asyncs.borrow_mut().try_remove(key) else {
            return;
        };
        let fd = entry.ctx.async_fd();
        if let Err(e) = self.registry.deregister(&mut SourceFd(&fd)) {
            tracing::debug!(error = %e, "deregistering an async-event fd");
        }
    }

    /// Takes every pending async event of `key`, logs it and queues it.
    fn async_ready(&self, key: usize) {
        let waker = {
            let mut asyncs = self.asyncs.borrow_mut();
            let Some(e) = asyncs.get_mut(key) else { return };
            loop {
                match e.ctx.get_async_event() {
                    Ok(Some(ev)) => {
                        match ev.kind {
                            AsyncEventKind::CommEst
                            | AsyncEventKind::PortActive
                            | AsyncEventKind::SqDrained
                            | AsyncEventKind::LidChange
                            | AsyncEventKind::GidChange => {
                                tracing::debug!(?ev, "async event")
                            }
                            _ => tracing::warn!(?ev, "async event"),
                        }
                        if e.queue.len() >= ASYNC_QUEUE {
                            e.queue.pop_front();
                        }
                        e.queue.push_back(ev);
                    }
                    Ok(None) => break,
                    Err(err) => {
                        tracing::warn!(error = %err, "get_async_event failed");
                        break;
                    }
                }
            }
            e.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// The next async event of `key` (`Ready(None)` if it is not watched).
    pub(crate) fn poll_async_event(
        &self,
        key: usize,
        cx: &mut Context<'_>,
    ) -> Poll<Option<AsyncEvent>> {
        let mut asyncs = self.asyncs.borrow_mut();
        let Some(e) = asyncs.get_mut(key) else {
            return Poll::Ready(None);
        };
        if let Some(ev) = e.queue.pop_front() {
            return Poll::Ready(Some(ev));
        }
        match &e.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            _ => e.waker = Some(cx.waker().clone()),
        }
        Poll::Pending
    }

    /// Arms every CQ not armed yet. Returns false if a call failed.
    pub(crate) fn arm_cqs(&self) {
        for (_, e) in self.cqs.borrow_mut().iter_mut() {
            if !e.armed && !e.broken {
                match e.cq.req_notify(false) {
                    Ok(()) => e.armed = true,
                    Err(err) => {
                        tracing::warn!(cq = e.cq.handle(), error = %err, "req_notify failed")
                    }
                }
            }
        }
    }

    /// Marks CQ `key` unarmed: something outside the reactor armed it or
    /// took its channel's events, so the next sleep arms it again.
    pub(crate) fn forget_arming(&self, key: usize) {
        if let Some(e) = self.cqs.borrow_mut().get_mut(key) {
            e.armed = false;
        }
    }

    /// Takes the pending events of channel `key` and acknowledges them in
    /// batches.
    ///
    /// The channel serves one CQ, and an armed CQ raises one event, after
    /// which it stays disarmed until the next `req_notify`, which the
    /// reactor calls only once that event is taken. So an event taken for
    /// an armed CQ is the channel's only one: stop there, sparing the
    /// `get_event` that would find the channel empty (a failed `read` on a
    /// verbs channel, per wake). Readiness without an event the reactor was
    /// waiting for (a stale wake-up, a stray event) takes events until the
    /// channel is empty (edge-triggered: none may be left behind).
    fn channel_ready(&self, key: usize) {
        let mut cqs = self.cqs.borrow_mut();
        let Some(e) = cqs.get_mut(key) else { return };
        loop {
            match e.channel.get_event() {
                Ok(Some(handle)) => {
                    if handle != e.cq.handle() {
                        tracing::warn!(handle, "event for an unknown CQ on a channel");
                        continue;
                    }
                    let expected = std::mem::replace(&mut e.armed, false);
                    e.unacked += 1;
                    if e.unacked >= self.ack_batch {
                        e.cq.ack_events(e.unacked);
                        e.unacked = 0;
                    }
                    if expected {
                        break;
                    }
                }
                Ok(None) => break,
                Err(err) => {
                    tracing::warn!(error = %err, "get_event failed");
                    break;
                }
            }
        }
    }

    /// Polls every CQ until empty, completing ops. Returns the number of
    /// completions handled.
    ///
    /// The busy-poll spin calls this once per spin, so the empty case is
    /// kept short: one borrow of the batch, then per CQ one borrow of the
    /// table and one provider poll. Completion handling may run user code
    /// (wakers, the reserved handler): no borrow of the CQ table is held
    /// then; the batch stays borrowed, so a nested call polls no CQ (its
    /// caller's loop takes what is left).
    ///
    /// Inlined into its callers (the spin loop above all): the empty case
    /// then costs no call frame; handling completions is out of line.
    #[inline(always)]
    pub(crate) fn drain_cqs(&self) -> usize {
        let mut total = 0;
        #[cfg(any(test, feature = "test-util"))]
        if !self.injected.borrow().is_empty() {
            total += self.drain_injected();
        }
        let Ok(mut batch) = self.batch.try_borrow_mut() else {
            return total;
        };
        let bound = self.cq_bound.get();
        let mut key = 0;
        while key < bound {
            let polled = self.poll_cq(key, &mut batch);
            if polled > 0 {
                total += self.complete_batch(key, polled, &mut batch);
            }
            key += 1;
        }
        drop(batch);
        if total > 0 {
            self.completed();
        }
        total
    }

    /// Completes the `polled` completions at the start of `batch`, taken
    /// from CQ `key`, and whatever else that CQ holds. Returns how many.
    #[inline(never)]
    fn complete_batch(&self, key: usize, mut polled: usize, batch: &mut [Completion]) -> usize {
        let mut total = 0;
        loop {
            for c in &batch[..polled] {
                self.complete(*c);
            }
            total += polled;
            // Only a full batch leaves the CQ possibly holding more.
            if polled < batch.len() {
                return total;
            }
            polled = self.poll_cq(key, batch);
            if polled == 0 {
                return total;
            }
        }
    }

    /// After completions: frees the data of dropped ops they finished,
    /// forgets the dropped queues that drained. Two flag tests inline; the
    /// work out of line.
    #[inline(always)]
    fn completed(&self) {
        self.ops.bury();
        if self.draining.get() > 0 {
            self.forget_drained();
        }
    }

    /// Polls CQ `key` into `batch`; 0 if it is gone or broken.
    #[inline(always)]
    fn poll_cq(&self, key: usize, batch: &mut [Completion]) -> usize {
        let res = match self.cqs.borrow().get(key) {
            Some(e) if !e.broken => e.cq.poll(batch),
            _ => return 0,
        };
        match res {
            Ok(n) => n,
            Err(err) => {
                self.cq_broken(key, err);
                0
            }
        }
    }

    #[cold]
    fn cq_broken(&self, key: usize, err: crate::provider::ProviderError) {
        if let Some(e) = self.cqs.borrow_mut().get_mut(key) {
            tracing::error!(cq = e.cq.handle(), error = %err, "CQ poll failed; CQ abandoned");
            e.broken = true;
        }
    }

    #[cfg(any(test, feature = "test-util"))]
    #[cold]
    fn drain_injected(&self) -> usize {
        let mut total = 0;
        loop {
            let (next, more) = {
                let mut q = self.injected.borrow_mut();
                (q.pop_front(), !q.is_empty())
            };
            let Some(c) = next else { return total };
            self.complete(c);
            total += 1;
            if more {
                total += self.drain_injected_batch();
            }
        }
    }

    /// More than one completion injected: swapped out whole, so there is no
    /// borrow per completion. Completions injected meanwhile (flushes, user
    /// code) land in the other queue and are taken by the caller's loop.
    #[cfg(any(test, feature = "test-util"))]
    #[cold]
    fn drain_injected_batch(&self) -> usize {
        let mut batch = self.injected_spare.take();
        std::mem::swap(&mut batch, &mut *self.injected.borrow_mut());
        let n = batch.len();
        for c in batch.drain(..) {
            self.complete(c);
        }
        self.injected_spare.set(batch);
        n
    }

    /// Routes one completion: an op's (inline here, the common case) or a
    /// reserved wr_id's ([`complete_reserved`](Self::complete_reserved)).
    #[inline(always)]
    fn complete(&self, c: Completion) {
        if c.wr_id & wr_id::RESERVED == 0 {
            self.ops.complete(c);
        } else {
            self.complete_reserved(&c);
        }
    }

    /// A completion of a reserved wr_id: an inline send's, the agent's, or
    /// an untracked WR's.
    #[inline(never)]
    fn complete_reserved(&self, c: &Completion) {
        // Ring receives first: one per message on a ring's QP.
        if wr_id::is_ring(c.wr_id) {
            self.complete_ring(c);
        } else if wr_id::is_inline(c.wr_id) {
            self.complete_inline(c);
        } else if c.wr_id >= wr_id::AGENT_BASE {
            // Taken out while it runs, so it may replace itself.
            let taken = self.reserved_handler.borrow_mut().take();
            match taken {
                Some(mut f) => {
                    f(*c);
                    let mut slot = self.reserved_handler.borrow_mut();
                    if slot.is_none() {
                        *slot = Some(f);
                    }
                }
                None => tracing::debug!(wr_id = c.wr_id, "reserved completion without a handler"),
            }
        } else {
            tracing::trace!(wr_id = c.wr_id, status = %c.status, "untracked completion");
        }
    }

    /// A completion of an inline send (or of the WR retiring them): goes to
    /// its QP, named by the registry key in the wr_id.
    fn complete_inline(&self, c: &Completion) {
        let (key, _, _) = wr_id::decode_inline(c.wr_id);
        let qp = self.qps.borrow().get(key).cloned();
        match qp {
            Some(q) => q.complete_reserved(c),
            None => {
                tracing::debug!(wr_id = c.wr_id, status = %c.status, "inline completion of an unknown QP")
            }
        }
    }

    // ---- receive rings (runtime/src/qp/recv_ring.rs) ----------------------

    /// A completion of a ring's buffer: goes to the ring its wr_id names.
    fn complete_ring(&self, c: &Completion) {
        let ring = self.rings.borrow().get(wr_id::ring_key(c.wr_id)).cloned();
        match ring {
            Some(r) => r.complete_reserved(c),
            None => {
                tracing::debug!(wr_id = c.wr_id, status = %c.status, "completion of an unknown receive ring")
            }
        }
    }

    /// Registers the ring `make` builds with its key; `None` if the ring
    /// key space is full.
    pub(crate) fn register_ring<R: WorkQueue + 'static>(
        &self,
        make: impl FnOnce(usize) -> Rc<R>,
    ) -> Option<Rc<R>> {
        let mut rings = self.rings.borrow_mut();
        let entry = rings.vacant_entry();
        if entry.key() as u64 > wr_id::RING_KEY_MASK {
            return None;
        }
        let ring = make(entry.key());
        entry.insert(ring.clone());
        Some(ring)
    }

    /// Forgets `ring` (dropped, nothing posted any more), registered under
    /// `key`, if it is still there.
    pub(crate) fn unregister_ring(&self, key: usize, ring: &dyn WorkQueue) {
        let removed = {
            let mut rings = self.rings.borrow_mut();
            match rings.get(key) {
                Some(r) if std::ptr::addr_eq(Rc::as_ptr(r), ring) => rings.try_remove(key),
                _ => None,
            }
        };
        drop(removed);
    }

    /// Buffers posted by every registered ring (the shutdown drain waits
    /// for them).
    pub(crate) fn ring_buffers_posted(&self) -> u32 {
        self.rings.borrow().iter().map(|(_, r)| r.lent()).sum()
    }

    /// Rings the reactor keeps (live or draining).
    pub(crate) fn ring_count(&self) -> usize {
        self.rings.borrow().len()
    }

    /// Shutdown: leaks the rings whose buffers are still posted (the device
    /// may still write them), drops the others. Returns how many leaked.
    pub(crate) fn release_rings(&self) -> usize {
        let all: Vec<Rc<dyn WorkQueue>> = self.rings.borrow_mut().drain().collect();
        let mut leaked = 0;
        for r in all {
            if r.lent() > 0 {
                leaked += 1;
                std::mem::forget(r);
            }
        }
        leaked
    }

    /// Some submission waits for CQ credits: every QP gives back those it
    /// holds without need ([`WorkQueue::release_hoarded`]).
    pub(crate) fn release_hoarded_credits(&self) {
        let all: Vec<Rc<dyn WorkQueue>> =
            self.qps.borrow().iter().map(|(_, q)| q.clone()).collect();
        for q in all {
            q.release_hoarded();
        }
    }

    #[cfg(any(test, feature = "test-util"))]
    pub(crate) fn inject(&self, c: Completion) {
        self.injected.borrow_mut().push_back(c);
    }

    pub(crate) fn has_injected(&self) -> bool {
        #[cfg(any(test, feature = "test-util"))]
        {
            !self.injected.borrow().is_empty()
        }
        #[cfg(not(any(test, feature = "test-util")))]
        {
            false
        }
    }

    // ---- QPs -------------------------------------------------------------

    /// Registers the QP `make` builds with its key (the key inline wr_ids
    /// name it by).
    pub(crate) fn register_qp<Q: WorkQueue + 'static>(
        &self,
        make: impl FnOnce(usize) -> Rc<Q>,
    ) -> Rc<Q> {
        let mut qps = self.qps.borrow_mut();
        let entry = qps.vacant_entry();
        let qp = make(entry.key());
        entry.insert(qp.clone());
        qp
    }

    /// Forgets `qp` (registered under `key`) if it is still there.
    pub(crate) fn unregister_qp(&self, key: usize, qp: &dyn WorkQueue) {
        let removed = {
            let mut qps = self.qps.borrow_mut();
            match qps.get(key) {
                Some(q) if std::ptr::addr_eq(Rc::as_ptr(q), qp) => qps.try_remove(key),
                _ => None,
            }
        };
        drop(removed);
    }

    /// QPs the reactor tracks (open, or dropped and still draining).
    #[cfg(test)]
    pub(crate) fn qp_count(&self) -> usize {
        self.qps.borrow().len()
    }

    /// A QP's owner dropped it with work outstanding: the reactor keeps it
    /// until it is [`finished`](WorkQueue::finished).
    pub(crate) fn note_draining(&self) {
        self.draining.set(self.draining.get() + 1);
    }

    /// Forgets the dropped QPs whose work requests have all completed.
    fn forget_drained(&self) {
        let mut dead = Vec::new();
        {
            let mut qps = self.qps.borrow_mut();
            let keys: Vec<usize> = qps
                .iter()
                .filter(|(_, q)| q.finished())
                .map(|(k, _)| k)
                .collect();
            for k in keys {
                dead.push(qps.remove(k));
            }
        }
        self.draining
            .set(self.draining.get().saturating_sub(dead.len()));
        drop(dead);
    }

    /// True while a poll phase runs (single send posts wait for its end).
    #[inline(always)]
    pub(crate) fn batching(&self) -> bool {
        self.batching.get()
    }

    /// Starts a poll phase: single send WRs submitted from now on wait for
    /// [`end_batch`](Self::end_batch).
    #[inline(always)]
    pub(crate) fn begin_batch(&self) {
        self.batching.set(true);
    }

    /// Ends the poll phase: posts every QP's deferred WRs, one list each.
    #[inline(always)]
    pub(crate) fn end_batch(&self) {
        self.batching.set(false);
        if !self.phase_waiters.borrow().is_empty() {
            self.phase_end();
        }
    }

    /// `queue` is told when the current poll phase ends
    /// ([`WorkQueue::phase_ended`]), once per call.
    pub(crate) fn note_phase_end(&self, queue: Rc<dyn WorkQueue>) {
        self.phase_waiters.borrow_mut().push(queue);
    }

    #[inline(never)]
    fn phase_end(&self) {
        // Taken out: failing an op may wake foreign code that submits.
        let mut list = std::mem::take(&mut *self.phase_waiters.borrow_mut());
        for q in list.drain(..) {
            q.phase_ended(&self.ops);
        }
        // The parked data of dropped ops whose post was refused.
        self.ops.bury();
        let mut cur = self.phase_waiters.borrow_mut();
        if cur.is_empty() {
            // Keep the allocation.
            *cur = list;
        }
    }

    /// Shutdown: closes every QP still registered (moves it to ERR).
    pub(crate) fn close_all_qps(&self) {
        self.end_batch();
        let all: Vec<Rc<dyn WorkQueue>> =
            self.qps.borrow().iter().map(|(_, q)| q.clone()).collect();
        for q in all {
            q.shut_down(&self.ops);
        }
    }

    /// Shutdown: leaks QPs that still have outstanding WRs whose buffers
    /// the device may still use, and drops the others (inline sends lend
    /// no memory).
    pub(crate) fn release_qps(&self) -> usize {
        let all: Vec<Rc<dyn WorkQueue>> = self.qps.borrow_mut().drain().collect();
        let mut leaked = 0;
        for q in all {
            if q.lent() > 0 {
                leaked += 1;
                std::mem::forget(q);
            }
        }
        leaked
    }

    // ---- sockets ---------------------------------------------------------

    pub(crate) fn register_io(
        &self,
        source: &mut impl mio::event::Source,
        interest: Interest,
    ) -> io::Result<usize> {
        let mut io = self.io.borrow_mut();
        let entry = io.vacant_entry();
        let key = entry.key();
        self.registry.register(source, Token(key), interest)?;
        entry.insert(IoEntry::default());
        Ok(key)
    }

    pub(crate) fn deregister_io(&self, source: &mut impl mio::event::Source, key: usize) {
        if let Err(e) = self.registry.deregister(source) {
            tracing::debug!(error = %e, "deregistering a socket");
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

    fn io_ready(&self, key: usize, ev: &mio::event::Event) {
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

    // ---- sleeping --------------------------------------------------------

    /// Waits in epoll for up to `timeout` (`None` = forever), then dispatches
    /// the events. Returns the number of events.
    pub(crate) fn poll_io(&self, timeout: Option<Duration>) -> io::Result<usize> {
        self.poll_io_then(timeout, || {})
    }

    /// [`poll_io`](Self::poll_io), calling `awake` once epoll has returned
    /// and before any event is dispatched (the reactor marks itself awake
    /// there, so the wakes the dispatch makes on this thread kick nothing).
    pub(crate) fn poll_io_then(
        &self,
        timeout: Option<Duration>,
        awake: impl FnOnce(),
    ) -> io::Result<usize> {
        let mut events = self.events.borrow_mut();
        let polled = self.poll.borrow_mut().poll(&mut events, timeout);
        awake();
        match polled {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return Ok(0),
            Err(e) => return Err(e),
        }
        let mut n = 0;
        for ev in events.iter() {
            n += 1;
            let t = ev.token();
            if t == WAKER_TOKEN {
                continue;
            }
            if t.0 >= ASYNC_BASE {
                self.async_ready(t.0 - ASYNC_BASE);
            } else if t.0 >= CHANNEL_BASE {
                self.channel_ready(t.0 - CHANNEL_BASE);
            } else {
                self.io_ready(t.0, ev);
            }
        }
        Ok(n)
    }

    /// Shutdown: forgets every socket registration and CQ (their owners may
    /// outlive the runtime; their later deregistration is harmless).
    pub(crate) fn clear(&self) {
        let io: Vec<IoEntry> = self.io.borrow_mut().drain().collect();
        drop(io);
        let keys: Vec<usize> = self.cqs.borrow().iter().map(|(k, _)| k).collect();
        for k in keys {
            self.deregister_cq(k);
        }
        let keys: Vec<usize> = self.asyncs.borrow().iter().map(|(k, _)| k).collect();
        for k in keys {
            self.deregister_async(k);
        }
        let handler = self.reserved_handler.borrow_mut().take();
        drop(handler);
    }
}
