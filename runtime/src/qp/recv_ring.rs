//! [`RecvRing`]: a pre-posted receive ring, what perftest and RDMA servers
//! use. `depth` buffers of `buf_size` bytes (one registered allocation) are
//! all posted up front with reserved wr_ids ([`wr_id::RING`]); the reactor
//! routes their completions straight to the ring (no op slot, no `Submit`,
//! no allocation per message), and [`RecvRing::next`] (or the
//! [`Stream`](futures::Stream) impl) yields each received message as a
//! [`RingMsg`] guard. Dropping the guard reposts its buffer (reposts are
//! batched into one `post_recv` list when `repost_batch > 1`).
//!
//! # Memory safety
//!
//! The ring's memory is owned by a core shared (`Rc`) by the ring, its
//! guards and the reactor's ring registry. A buffer is handed out as `&[u8]`
//! only between its completion and its repost (the guard's life), never
//! while posted. Dropping the ring with buffers posted leaves the core
//! registered with the reactor: the posted buffers stay the device's until
//! their completions (success, discarded, or `WR_FLUSH_ERR` once the QP is
//! closed or dropped) have been polled; only then is the memory freed. A
//! ring on an SRQ (never flushed) is freed once no QP on its SRQ and no
//! handle of it is left (`srq_ring.rs`). At runtime shutdown a ring still
//! holding posted buffers is leaked, like the runtime's parked ops.
//!
//! # QueueEntries
//!
//! Each posted buffer holds one receive-queue entry and one receive-CQ
//! entry of its QP, taken when it is posted, like a `submit_recv` op: the
//! CQ can never overflow, and [`QueuePair::close`] waits for the ring's
//! flushes. A buffer that completes successfully keeps its entries until
//! its repost (no give-back and re-acquire per message); they are given
//! back at once if the ring stops, is dropped, or the QP is closed
//! (`QpCore::shut` returns every ring's kept entries, so a close never
//! waits for buffers lent to guards or unread).

use std::alloc::Layout;
use std::cell::{Cell, RefCell, RefMut};
use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::ptr::NonNull;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

use super::datagram::{DatagramSource, SlotGeometry};
use super::srq_ring::{RingOwner, RingTarget};
use super::QueuePair;
use crate::op::wr_id;
use crate::op::OpTable;
use crate::op::{QueueEntries, Ticket};
use crate::provider::{
    AccessFlags, Completion, Mr, Pd, PostError, ProviderError, RecvWr, SgList, Sge, WcOpcode,
    WcStatus, GRH_LEN,
};
use crate::reactor::{Handle, PassCheck, PassHook, WorkQueue};

/// Why a [`RecvRing`] could not be created, or what its stream reports.
/// For a ring on a shared receive queue, `qp_num` is the SRQ's handle.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RecvRingError {
    /// The configuration cannot work (zero depth or size, too large, ...).
    #[error("receive ring on QP {qp_num}: {what}")]
    Config {
        /// QP number.
        qp_num: u32,
        /// What is wrong.
        what: String,
    },
    /// The QP's receive queue or its CQ has not room for `depth` buffers.
    #[error(
        "receive ring on QP {qp_num}: {depth} buffers do not fit: {rq_available} receive-queue \
         and {cq_available} CQ entries available"
    )]
    Credits {
        /// QP number.
        qp_num: u32,
        /// Buffers asked for.
        depth: u32,
        /// Free receive-queue slots.
        rq_available: u32,
        /// Free CQ entries.
        cq_available: u32,
    },
    /// The QP is closed.
    #[error("receive ring on QP {qp_num}: the QP is closed")]
    Closed {
        /// QP number.
        qp_num: u32,
    },
    /// Allocating or registering the ring's memory failed.
    #[error("receive ring on QP {qp_num}: {what} ({len} bytes) failed")]
    Memory {
        /// QP number.
        qp_num: u32,
        /// `"allocating"` or `"registering"`.
        what: &'static str,
        /// Bytes.
        len: usize,
        /// The provider's error, if any.
        #[source]
        source: Option<ProviderError>,
    },
    /// Posting (reposting) buffers failed; they are no longer posted.
    #[error("receive ring on QP {qp_num}: posting {count} buffers failed")]
    Post {
        /// QP number.
        qp_num: u32,
        /// Buffers not posted.
        count: usize,
        /// The provider's error.
        #[source]
        source: PostError,
    },
    /// A buffer completed with an error status (a length error, a flush
    /// after the QP went to ERR, ...). The ring stops reposting after the
    /// first error: RC moves the QP to ERR on any receive error.
    #[error("receive ring on QP {qp_num}: buffer {slot} (wr_id {wr_id:#x}) completed with {status} (vendor error {vendor_err:#x})")]
    Completion {
        /// QP number.
        qp_num: u32,
        /// The buffer's index in the ring.
        slot: u32,
        /// The WR.
        wr_id: u64,
        /// The failure status.
        status: WcStatus,
        /// Vendor syndrome.
        vendor_err: u32,
    },
    /// The device reported more bytes than the buffer holds.
    #[error("receive ring on QP {qp_num}: buffer {slot} completed with {byte_len} bytes, larger than its {buf_size}")]
    Length {
        /// QP number.
        qp_num: u32,
        /// The buffer's index in the ring.
        slot: u32,
        /// Reported length.
        byte_len: u32,
        /// Buffer size.
        buf_size: usize,
    },
}

/// Settings of a [`RecvRing`].
#[derive(Clone, Copy, Debug)]
pub struct RecvRingConfig {
    depth: u32,
    buf_size: usize,
    repost_batch: u32,
    srq_limit: u32,
}

impl RecvRingConfig {
    /// `depth` buffers of `buf_size` bytes each; reposted one by one.
    pub fn new(depth: u32, buf_size: usize) -> RecvRingConfig {
        RecvRingConfig {
            depth,
            buf_size,
            repost_batch: 1,
            srq_limit: 0,
        }
    }

    /// On a shared receive queue ([`RecvRing::on_srq`]): arms the SRQ's
    /// limit at `n` buffers; when fewer are posted the ring reposts every
    /// released buffer at once (not waiting for a full batch) and re-arms
    /// it. 0 (the default) arms nothing. Ignored on a QP's ring.
    pub fn srq_limit(mut self, n: u32) -> RecvRingConfig {
        self.srq_limit = n;
        self
    }

    pub(crate) fn limit(&self) -> Option<u32> {
        (self.srq_limit != 0).then_some(self.srq_limit)
    }

    /// Reposts released buffers in lists of `n` (one doorbell each); fewer
    /// are posted whenever the ring would otherwise wait for a message.
    /// Clamped to `1..=depth`.
    pub fn repost_batch(mut self, n: u32) -> RecvRingConfig {
        self.repost_batch = n;
        self
    }
}

/// Where a buffer of the ring is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    /// Owned by the device (posted).
    Posted,
    /// Completed: in the ready queue, or lent to a [`RingMsg`].
    Taken,
    /// Waiting to be reposted (in `pending`).
    Pending,
    /// Not posted and never again (error, closed QP, dropped ring).
    Idle,
}

/// Consumed by an RDMA WRITE with immediate (no bytes in the buffer).
#[inline(always)]
fn by_write(c: &Completion) -> bool {
    c.opcode == WcOpcode::RecvRdmaWithImm
}

struct State {
    slots: Box<[Slot]>,
    /// Slots completed and not yet taken by `next`, in order (their
    /// completions are in [`RingCore::done`]).
    ready: VecDeque<u32>,
    /// Slots released by their guards, not yet reposted.
    pending: Vec<u32>,
    /// Buffers posted (owned by the device).
    posted: u32,
    waker: Option<Waker>,
    /// Scheduled at each completion and each wake of `waker`
    /// ([`RecvRing::check_after_wakes`]).
    check: Option<Rc<PassCheck>>,
    /// The `RecvRing` handle is gone.
    dropped: bool,
    /// A buffer failed (or the QP closed): nothing is reposted any more.
    stopped: bool,
    /// Flush completions absorbed after the first error was reported.
    reported_flush: bool,
    /// A repost failed; reported by the next `next`.
    post_error: Option<RecvRingError>,
    rq_ticket: Option<Ticket>,
    cq_ticket: Option<Ticket>,
    /// Entries (each: receive queue and CQ) acquired for pending slots.
    held_rq: u32,
    held_cq: u32,
    /// Reused list for batched reposts.
    wrs: Vec<RecvWr>,
    /// Entries (each: receive queue and CQ) kept from successful
    /// completions for reposts, also counted in the QP's `ring_kept`
    /// unless the QP is closed (then `shut` gave them back already).
    kept: u32,
}

impl State {
    /// Buffers are posted, nothing waits to be reposted or reported, and
    /// `waker` is the one registered: with nothing completed, a poll would
    /// only return pending.
    #[inline(always)]
    fn waits_on(&self, waker: &Waker) -> bool {
        self.posted != 0
            && self.pending.is_empty()
            && self.post_error.is_none()
            && self.waker.as_ref().is_some_and(|w| w.will_wake(waker))
    }
}

/// The shared part of a ring: memory, registration and state. Kept by the
/// ring, its guards, and the reactor's registry while buffers are posted.
pub(crate) struct RingCore {
    target: RingTarget,
    /// The SRQ limit re-armed after each limit event (0: none).
    limit: u32,
    /// Limit events that refilled the ring.
    limit_events: Cell<u64>,
    handle: Handle,
    key: usize,
    depth: u32,
    buf_size: usize,
    /// Where each slot's SGE and payload lie (UD leaves room for the GRH).
    geometry: SlotGeometry,
    batch: u32,
    /// One prebuilt receive WR per slot (its wr_id and its buffer's SGE).
    slot_wrs: Box<[RecvWr]>,
    /// Each slot's last completion: written when it completes (the slot
    /// is then in `ready` or lent to a [`RingMsg`], which reads it here and
    /// stays small), rewritten only after its repost.
    done: Box<[Cell<Completion>]>,
    /// Declared before the memory: deregistered first (`None` in tests
    /// without a device).
    _mr: Option<Mr>,
    /// # Invariant
    /// `depth * geometry.stride` bytes from `alloc(layout)`, freed only on drop.
    /// Never referenced as a whole: only the bytes of a completed,
    /// not-yet-reposted slot are ever borrowed.
    mem: NonNull<u8>,
    layout: Layout,
    state: RefCell<State>,
}

impl Drop for RingCore {
    fn drop(&mut self) {
        // The registration first: from here on the device reaches none of
        // the memory (a ring on an SRQ may be freed with buffers posted,
        // see `srq_ring.rs`).
        self._mr = None;
        // SAFETY: `mem` came from `alloc_zeroed(layout)` and is freed only
        // here. The core is dropped only when no guard (slice) exists and
        // the reactor no longer keeps it: no buffer is posted, or (a ring
        // on an SRQ) no QP on its SRQ is left and its registration is gone
        // (at shutdown a core with posted buffers is leaked instead).
        unsafe { std::alloc::dealloc(self.mem.as_ptr(), self.layout) };
    }
}

impl WorkQueue for RingCore {
    /// A completion of one of the ring's buffers.
    fn complete_reserved(&self, c: &Completion) {
        self.completed(c);
    }

    fn phase_ended(&self, _ops: &OpTable) {}

    /// The ring's QP is shut down with the other QPs: its flushes drain the
    /// ring.
    fn shut_down(&self, _ops: &OpTable) {}

    /// A ring on an SRQ lends nothing the shutdown can wait for: its
    /// buffers are never flushed, and once every QP is closed the device
    /// writes none of them; its registration, dropped before its memory,
    /// ends the device's access.
    fn lent(&self) -> u32 {
        if self.target.is_srq() {
            0
        } else {
            self.posted()
        }
    }

    /// A ring unregisters itself once dropped and drained.
    fn finished(&self) -> bool {
        false
    }
}

impl RingCore {
    /// Lets the reactor forget this ring (registered under `key`), which
    /// then lives only as long as its guards.
    pub(crate) fn unregister(&self, key: usize) {
        self.handle.driver().unregister_ring(key, self);
    }

    /// Buffers posted (for the reactor's shutdown drain).
    pub(crate) fn posted(&self) -> u32 {
        self.state.borrow().posted
    }

    /// The waker of the task waiting in `next` (tests).
    #[cfg(test)]
    pub(crate) fn registered_waker(&self) -> Option<Waker> {
        self.state.borrow().waker.clone()
    }

    /// A completion of one of this ring's buffers, routed by the reactor.
    #[inline]
    pub(crate) fn completed(&self, c: &Completion) {
        let slot = wr_id::ring_slot(c.wr_id);
        let (waker, unregister, kept) = {
            let mut st = self.state.borrow_mut();
            if !self.target.accepts(c.qp_num)
                || slot >= self.depth
                || st.slots[slot as usize] != Slot::Posted
            {
                tracing::debug!(
                    wr_id = c.wr_id,
                    qp = c.qp_num,
                    "stray receive-ring completion"
                );
                return;
            }
            st.posted -= 1;
            // On UD a failed receive (a datagram too long for the buffer)
            // is that datagram's loss only: the QP stays up. On an SRQ it
            // is the failure of one QP of many (a flush included): the
            // buffer goes back to the SRQ.
            let fatal = !c.status.is_success()
                && !self.target.is_srq()
                && (!self.geometry.grh || c.status == WcStatus::WrFlushErr);
            if fatal {
                st.stopped = true;
                self.give_back_kept(&mut st);
            }
            if st.dropped {
                st.slots[slot as usize] = Slot::Idle;
                if !c.status.is_success() {
                    tracing::debug!(qp = c.qp_num, status = %c.status, "dropped receive ring: buffer completed");
                }
                (None, st.posted == 0, false)
            } else {
                st.slots[slot as usize] = Slot::Taken;
                // A message: its entries stay for its repost.
                let keep = !fatal && !st.stopped && !self.target.closed();
                if keep {
                    st.kept += 1;
                    self.target
                        .ring_kept()
                        .set(self.target.ring_kept().get() + 1);
                }
                self.done[slot as usize].set(*c);
                st.ready.push_back(slot);
                self.schedule_check(&st);
                let waker = match &st.waker {
                    // A verbio task's waker only queues its task (no
                    // foreign code runs under the borrow): woken in place
                    // and kept, so the task's next wait needs no clone.
                    Some(w) if crate::wake::wake_if_task(w) => None,
                    // Another waker may run anything: taken out to be
                    // woken by reference outside the borrow, then put back
                    // (no clone), so the consumer's next poll of an empty
                    // ring takes the fast path (the same waker) instead of
                    // registering again.
                    Some(_) => st.waker.take(),
                    None => None,
                };
                (waker, false, keep)
            }
        };
        if !kept {
            self.target.rq().release(1);
            self.target.recv_cq().release(1);
        }
        if unregister {
            self.handle
                .driver()
                .unregister_ring(self.key, self as &dyn WorkQueue);
        }
        if let Some(w) = waker {
            w.wake_by_ref();
            // Unless the wake registered another or dropped the ring.
            let mut st = self.state.borrow_mut();
            if st.waker.is_none() && !st.dropped {
                st.waker = Some(w);
            }
        }
    }

    /// Posts `slots` (entries already held for each). On failure the
    /// unposted slots go idle, their entries are given back, and the error
    /// is returned.
    fn post(&self, st: &mut State, slots: &[u32]) -> Result<(), RecvRingError> {
        if slots.is_empty() {
            return Ok(());
        }
        let mut wrs = std::mem::take(&mut st.wrs);
        wrs.clear();
        wrs.extend(slots.iter().map(|&s| self.slot_wrs[s as usize].clone()));
        // Marked posted first: the device may complete them inside the post.
        for &s in slots {
            st.slots[s as usize] = Slot::Posted;
        }
        st.posted += slots.len() as u32;
        // SAFETY: each SGE names one buffer of this ring's allocation
        // (`slot_wrs`), registered by `_mr`; the core (memory and registration)
        // is kept alive, by the reactor's registry when nothing else holds
        // it, until the buffer's completion has been polled (`completed`),
        // and no reference to a posted buffer exists (slots are lent to
        // guards only between completion and repost).
        let res = unsafe { self.target.post_recv(&wrs) };
        st.wrs = wrs;
        match res {
            Ok(()) => Ok(()),
            Err(e) => Err(self.post_failed(st, slots, e)),
        }
    }

    /// Posts one slot (entries held) with its prebuilt WR: the repost
    /// fast path (inlined into `release`, one call frame less). False if
    /// the post failed (then recorded for the next `next`).
    #[inline(always)]
    fn post_one(&self, st: &mut State, slot: u32) -> bool {
        st.slots[slot as usize] = Slot::Posted;
        st.posted += 1;
        // SAFETY: as in `post`: the slot's buffer belongs to this ring's
        // allocation, kept (with its registration) until its completion
        // has been polled, and no reference to it exists while posted (its
        // guard is being dropped).
        let res = unsafe {
            self.target
                .post_recv(std::slice::from_ref(&self.slot_wrs[slot as usize]))
        };
        if let Err(e) = res {
            let e = self.post_failed(st, &[slot], e);
            tracing::warn!(error = %crate::report::ErrorChain(&e), "receive ring repost failed");
            st.post_error.get_or_insert(e);
            self.release_pending(st);
            return false;
        }
        true
    }

    /// The provider refused `slots[e.posted..]`: they go idle, their
    /// entries are given back, the ring stops.
    #[cold]
    #[inline(never)]
    fn post_failed(&self, st: &mut State, slots: &[u32], e: PostError) -> RecvRingError {
        let unposted = &slots[e.posted.min(slots.len())..];
        for &s in unposted {
            st.slots[s as usize] = Slot::Idle;
        }
        let n = unposted.len() as u32;
        st.posted -= n;
        st.stopped = true;
        self.give_back_kept(st);
        self.target.rq().release(n);
        self.target.recv_cq().release(n);
        RecvRingError::Post {
            qp_num: self.target.id(),
            count: unposted.len(),
            source: e,
        }
    }

    /// Reposts the pending slots for which entries can be had (waiting for
    /// the rest with `cx`, if given). Nothing is reposted once stopped.
    fn flush_pending(&self, st: &mut State, mut cx: Option<&mut Context<'_>>) {
        if st.stopped || self.target.closed() {
            st.stopped = true;
            self.release_pending(st);
            return;
        }
        let want = st.pending.len() as u32;
        acquire_up_to(
            self.target.rq(),
            &mut st.rq_ticket,
            &mut cx,
            &mut st.held_rq,
            want,
        );
        let rq = st.held_rq;
        acquire_up_to(
            self.target.recv_cq(),
            &mut st.cq_ticket,
            &mut cx,
            &mut st.held_cq,
            rq,
        );
        let n = st.held_cq as usize;
        if n == 0 {
            return;
        }
        st.held_rq -= n as u32;
        st.held_cq = 0;
        let pending = std::mem::take(&mut st.pending);
        let res = self.post(st, &pending[..n]);
        let mut pending = pending;
        pending.drain(..n);
        st.pending = pending;
        if let Err(e) = res {
            tracing::warn!(error = %crate::report::ErrorChain(&e), "receive ring repost failed");
            st.post_error.get_or_insert(e);
            self.release_pending(st);
        }
    }

    /// Gives up the pending slots (and the entries held for them).
    fn release_pending(&self, st: &mut State) {
        for i in 0..st.pending.len() {
            let s = st.pending[i] as usize;
            st.slots[s] = Slot::Idle;
        }
        st.pending.clear();
        self.target.rq().cancel(&mut st.rq_ticket);
        self.target.recv_cq().cancel(&mut st.cq_ticket);
        self.target.rq().release(st.held_rq);
        self.target.recv_cq().release(st.held_cq);
        st.held_rq = 0;
        st.held_cq = 0;
        self.give_back_kept(st);
    }

    /// Takes one kept entry pair for a repost, if there is one. Only while
    /// the QP is open (a closed QP's `shut` took the kept entries back).
    #[inline]
    fn take_kept(&self, st: &mut State) -> bool {
        if st.kept == 0 {
            return false;
        }
        st.kept -= 1;
        let all = self.target.ring_kept();
        all.set(all.get().saturating_sub(1));
        true
    }

    /// Gives every kept entry back (nothing will be reposted). If the QP
    /// is closed, `QpCore::shut` has already done so.
    fn give_back_kept(&self, st: &mut State) {
        let n = std::mem::take(&mut st.kept);
        if n == 0 || self.target.closed() {
            return;
        }
        let all = self.target.ring_kept();
        all.set(all.get().saturating_sub(n));
        self.target.rq().release(n);
        self.target.recv_cq().release(n);
    }

    /// The SRQ-limit event: reposts every released buffer now (those
    /// waiting for their batch) and re-arms the limit.
    pub(crate) fn limit_reached(&self) {
        self.limit_events.set(self.limit_events.get() + 1);
        {
            let mut st = self.state.borrow_mut();
            if !st.dropped {
                self.flush_pending(&mut st, None);
            }
        }
        if let RingTarget::Srq(s) = &self.target {
            if self.limit != 0 {
                if let Err(e) = s.srq.modify_limit(self.limit) {
                    tracing::warn!(srq = s.handle, error = %crate::report::ErrorChain(&e), "re-arming the SRQ limit");
                }
            }
        }
    }

    pub(crate) fn limit_events(&self) -> u64 {
        self.limit_events.get()
    }

    /// A guard gave its slot back.
    #[inline]
    fn release(&self, slot: u32) {
        let mut st = self.state.borrow_mut();
        if st.dropped || st.stopped || self.target.closed() {
            st.slots[slot as usize] = Slot::Idle;
            self.give_back_kept(&mut st);
            // The last buffer: a waiting `next` can end the stream now.
            if st.posted == 0 {
                let waker = st.waker.take();
                self.wake_reader(st, waker);
            }
            return;
        }
        // Unbatched, nothing pending, entries at hand (kept from the
        // completion, else new): post it now.
        if self.batch == 1 && st.pending.is_empty() {
            let credited = self.take_kept(&mut st) || self.acquire_pair();
            if credited {
                if !self.post_one(&mut st, slot) {
                    // A task waiting in `next` (the guard may have been
                    // dropped on another one) must hear of the failure.
                    let waker = st.waker.take();
                    self.wake_reader(st, waker);
                }
                return;
            }
        }
        let waker = self.release_slow(&mut st, slot);
        self.wake_reader(st, waker);
    }

    /// Wakes `waker` (a task waiting in `next`), if any, after the ring's
    /// check is scheduled and the state's borrow released.
    #[inline(always)]
    fn wake_reader(&self, st: RefMut<'_, State>, waker: Option<Waker>) {
        if waker.is_some() {
            self.schedule_check(&st);
        }
        drop(st);
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// Schedules the ring's check, if it has one (a completion, or a wake).
    #[inline(always)]
    fn schedule_check(&self, st: &State) {
        if let Some(c) = &st.check {
            self.handle.schedule_check(c, false);
        }
    }

    /// A consumer found the ring waiting: the check, if scheduled, has
    /// nothing to look at for the ring (see [`RecvRing::check_after_wakes`]).
    #[inline(always)]
    fn withdraw_check(st: &State) {
        if let Some(c) = &st.check {
            c.withdraw();
        }
    }

    /// One receive-queue and one CQ entry, if both are free.
    #[inline]
    fn acquire_pair(&self) -> bool {
        if self.target.rq().try_acquire(1) {
            if self.target.recv_cq().try_acquire(1) {
                return true;
            }
            self.target.rq().release(1);
        }
        false
    }

    /// [`release`](Self::release) into the pending list (batching, or
    /// waiting for entries). Returns the waiting `next`'s waker if the slot
    /// stays pending: the wait reposts what is pending (a guard dropped on
    /// another task must not leave its buffer unposted while `next`
    /// sleeps).
    #[inline(never)]
    fn release_slow(&self, st: &mut State, slot: u32) -> Option<Waker> {
        st.slots[slot as usize] = Slot::Pending;
        st.pending.push(slot);
        // Its kept entries go with it.
        if self.take_kept(st) {
            st.held_rq += 1;
            st.held_cq += 1;
        }
        if st.pending.len() as u32 >= self.batch {
            self.flush_pending(st, None);
        }
        if st.pending.is_empty() {
            None
        } else {
            st.waker.take()
        }
    }
}

/// A pre-posted receive ring on a [`QueuePair`]; see the module docs.
///
/// Every message received on the QP while the ring's buffers are the
/// oldest posted receives lands in the ring (RC consumes receives in
/// posting order). Dropping the ring does not close the QP: its posted
/// buffers stay posted (messages landing there are discarded) until the QP
/// is closed or dropped, and their memory is freed after their flush.
///
/// # Example
///
/// A ring of 16 buffers of 1 KiB on a UD queue pair receiving three
/// datagrams (sent by another UD QP of the same software device); each
/// message is lent out and its buffer posted again when it is dropped.
///
/// ```
/// # mod verbio { pub mod runtime { pub use verbio_runtime::*; } pub use verbio_runtime::provider; }
/// use verbio::provider::{Context, QpCaps, SoftConfig, UdAttr};
/// use verbio::runtime::{Device, RecvRingConfig, RecvRing, Runtime};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let rt = Runtime::new()?;
/// let dev = Device::open(Context::open_soft(SoftConfig::default())?)?;
/// rt.block_on(async {
///     let rx = dev.create_ud_qp(QpCaps::default(), &UdAttr::default())?;
///     let tx = dev.create_ud_qp(QpCaps::default(), &UdAttr::default())?;
///     // Reposts in batches of 4 (one doorbell each).
///     let config = RecvRingConfig::new(16, 1024).repost_batch(4);
///     let mut ring = RecvRing::new(&rx, dev.pd(), config)?;
///     assert_eq!(ring.posted(), 16);
///
///     let gid_index = dev.context().default_gid_index(1)?;
///     let peer = tx.ud_peer(&rx.ud_endpoint(gid_index)?)?;
///     for (i, text) in [&b"one"[..], b"two", b"three"].into_iter().enumerate() {
///         tx.post_send_inline_to(&peer, text, Some(i as u32)).await?;
///     }
///     for i in 0..3 {
///         let msg = ring.next().await.expect("the ring is open")?;
///         assert_eq!(msg.imm(), Some(i)); // the immediate data, if any
///         println!("{} bytes: {:?}", msg.len(), &msg[..]);
///     } // each `msg` dropped: its buffer goes back to the ring
///     Ok::<_, Box<dyn std::error::Error>>(())
/// })?;
/// # Ok(())
/// # }
/// ```
pub struct RecvRing {
    pub(super) core: Rc<RingCore>,
    pub(super) owner: RingOwner,
}

impl fmt::Debug for RecvRing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.core.state.borrow();
        f.debug_struct("RecvRing")
            .field("target", &self.core.target.id())
            .field("depth", &self.core.depth)
            .field("buf_size", &self.core.buf_size)
            .field("posted", &st.posted)
            .field("ready", &st.ready.len())
            .finish()
    }
}

impl RecvRing {
    /// Allocates `config.depth` buffers of `config.buf_size` bytes in one
    /// allocation, registers it with `pd` (which must be the QP's protection
    /// domain, else every receive fails), and posts them all. Takes one
    /// receive-queue and one CQ entry per buffer; fails if they are not
    /// all available at once.
    pub fn new(qp: &QueuePair, pd: &Pd, config: RecvRingConfig) -> Result<RecvRing, RecvRingError> {
        Self::create(qp, Some(pd), config)
    }

    /// `pd == None` (tests on a fake QP): the memory is not registered.
    pub(crate) fn create(
        qp: &QueuePair,
        pd: Option<&Pd>,
        config: RecvRingConfig,
    ) -> Result<RecvRing, RecvRingError> {
        RecvRing::create_on(
            RingTarget::Qp(qp.inner.core.clone()),
            qp.inner.handle.clone(),
            qp.inner.ud.is_some(),
            pd,
            RecvRingConfig {
                srq_limit: 0,
                ..config
            },
            RingOwner::Qp(qp.clone()),
        )
    }

    /// A ring posting to `target` (`datagram`: UD slots, with room for the
    /// GRH), keeping `owner` alive.
    pub(super) fn create_on(
        target: RingTarget,
        handle: Handle,
        datagram: bool,
        pd: Option<&Pd>,
        config: RecvRingConfig,
        owner: RingOwner,
    ) -> Result<RecvRing, RecvRingError> {
        let qp_num = target.id();
        let config_err = |what: String| RecvRingError::Config { qp_num, what };
        let RecvRingConfig {
            depth,
            buf_size,
            repost_batch,
            srq_limit,
        } = config;
        if depth == 0 || buf_size == 0 {
            return Err(config_err(format!(
                "depth {depth} and buffer size {buf_size} must be nonzero"
            )));
        }
        if depth as u64 > wr_id::RING_SLOT_MASK + 1 {
            return Err(config_err(format!(
                "depth {depth} exceeds {}",
                wr_id::RING_SLOT_MASK + 1
            )));
        }
        let geometry = if datagram {
            SlotGeometry::datagram(buf_size)
                .ok_or_else(|| config_err(format!("buffer size {buf_size} overflows")))?
        } else {
            SlotGeometry::reliable(buf_size)
        };
        if geometry.sge_len > u32::MAX as usize {
            return Err(config_err(format!("buffer size {buf_size} exceeds u32")));
        }
        let len = (depth as usize)
            .checked_mul(geometry.stride)
            .ok_or_else(|| config_err(format!("{depth} × {buf_size} bytes overflow")))?;
        let layout = Layout::from_size_align(len, 64)
            .map_err(|e| config_err(format!("{len} bytes: {e}")))?;
        if target.closed() {
            return Err(RecvRingError::Closed { qp_num });
        }
        if !target.rq().try_acquire(depth) {
            return Err(RecvRingError::Credits {
                qp_num,
                depth,
                rq_available: target.rq().available(),
                cq_available: target.recv_cq().available(),
            });
        }
        if !target.recv_cq().try_acquire(depth) {
            target.rq().release(depth);
            return Err(RecvRingError::Credits {
                qp_num,
                depth,
                rq_available: target.rq().available(),
                cq_available: target.recv_cq().available(),
            });
        }
        let give_back = |target: &RingTarget| {
            target.rq().release(depth);
            target.recv_cq().release(depth);
        };
        // SAFETY: `layout` has a nonzero size (depth, buf_size > 0).
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let Some(mem) = NonNull::new(raw) else {
            give_back(&target);
            return Err(RecvRingError::Memory {
                qp_num,
                what: "allocating",
                len,
                source: None,
            });
        };
        let mr = match pd {
            // SAFETY: `mem` is `len` bytes owned by the ring core built
            // below, which drops the registration (field order) before
            // freeing the memory.
            Some(pd) => match unsafe { pd.reg_mr(mem.as_ptr(), len, AccessFlags::LOCAL_WRITE) } {
                Ok(mr) => Some(mr),
                Err(e) => {
                    // SAFETY: allocated above with `layout`, never shared.
                    unsafe { std::alloc::dealloc(mem.as_ptr(), layout) };
                    give_back(&target);
                    return Err(RecvRingError::Memory {
                        qp_num,
                        what: "registering",
                        len,
                        source: Some(e),
                    });
                }
            },
            None => None,
        };
        let lkey = mr.as_ref().map_or(0, Mr::lkey);
        let slot_sge = |slot: u32| Sge {
            addr: mem.as_ptr() as u64
                + u64::from(slot) * geometry.stride as u64
                + geometry.sge_off as u64,
            length: geometry.sge_len as u32,
            lkey,
        };
        let state = State {
            slots: vec![Slot::Idle; depth as usize].into_boxed_slice(),
            ready: VecDeque::with_capacity(depth as usize),
            pending: Vec::with_capacity(depth as usize),
            posted: 0,
            waker: None,
            check: None,
            dropped: false,
            stopped: false,
            reported_flush: false,
            post_error: None,
            rq_ticket: None,
            cq_ticket: None,
            held_rq: 0,
            held_cq: 0,
            wrs: Vec::with_capacity(depth as usize),
            kept: 0,
        };
        let mut state = Some(state);
        let mut mr = Some(mr);
        let mut target = Some(target);
        let registered = handle.driver().register_ring(|key| {
            Rc::new(RingCore {
                target: target.take().unwrap_or_else(|| unreachable!()),
                limit: srq_limit,
                limit_events: Cell::new(0),
                handle: handle.clone(),
                key,
                depth,
                buf_size,
                geometry,
                batch: repost_batch.clamp(1, depth),
                slot_wrs: (0..depth)
                    .map(|slot| {
                        let mut sg_list = SgList::new();
                        sg_list.push(slot_sge(slot));
                        RecvWr {
                            wr_id: wr_id::encode_ring(key, slot),
                            sg_list,
                        }
                    })
                    .collect(),
                done: vec![Cell::new(Completion::EMPTY); depth as usize].into_boxed_slice(),
                _mr: mr.take().flatten(),
                mem,
                layout,
                state: RefCell::new(state.take().unwrap_or_else(|| unreachable!())),
            })
        });
        let Some(ring) = registered else {
            drop(mr);
            // SAFETY: allocated above, never posted (the core was not built).
            unsafe { std::alloc::dealloc(mem.as_ptr(), layout) };
            if let Some(target) = &target {
                give_back(target);
            }
            return Err(config_err(format!(
                "more than {} receive rings at once",
                wr_id::RING_KEY_MASK + 1
            )));
        };
        let all: Vec<u32> = (0..depth).collect();
        let res = {
            let mut st = ring.state.borrow_mut();
            ring.post(&mut st, &all)
        };
        let ring = RecvRing { core: ring, owner };
        match res {
            Ok(()) => Ok(ring),
            // Dropping `ring` keeps whatever was posted until its flush.
            Err(e) => Err(e),
        }
    }

    /// The QP the ring receives on (`None` for a ring on a shared
    /// receive queue: see [`shared_recv_queue`](Self::shared_recv_queue)).
    pub fn queue_pair(&self) -> Option<&QueuePair> {
        match &self.owner {
            RingOwner::Qp(qp) => Some(qp),
            RingOwner::Srq(_) => None,
        }
    }

    /// Number of buffers.
    pub fn depth(&self) -> u32 {
        self.core.depth
    }

    /// Size of each buffer.
    pub fn buf_size(&self) -> usize {
        self.core.buf_size
    }

    /// Bytes of receive memory the ring allocated and registered (its
    /// buffers, and on UD their GRH room), fixed for its life.
    pub fn memory_len(&self) -> usize {
        self.core.layout.size()
    }

    /// Buffers currently posted (owned by the device).
    pub fn posted(&self) -> u32 {
        self.core.posted()
    }

    /// Has `hook` run after each completion of the ring and each wake of
    /// the task waiting on it (for a failure it must hear of): at the end
    /// of the first loop pass that begins afterwards, once per pass however
    /// many came, when the tasks woken before have been polled (see
    /// [`PassHook`]). A second consumer can so look at what the first left
    /// without a wake of its own per message. Scheduling costs a flag check
    /// and a push. The hook is skipped if, since the last completion or
    /// wake, a consumer found the ring waiting ([`poll_next`](Self::poll_next)
    /// pending, or [`is_waiting`](Self::is_waiting) true): nothing is left
    /// to look at then, unless [`schedule_check`](Self::schedule_check)
    /// asked for it. `None` removes the hook; dropping the ring does too.
    pub fn check_after_wakes(&self, hook: Option<Rc<dyn PassHook>>) {
        let check = hook.map(PassCheck::new);
        let old = std::mem::replace(&mut self.core.state.borrow_mut().check, check);
        // Dropped outside the borrow: a hook's drop may run anything.
        drop(old);
    }

    /// Schedules the hook of [`check_after_wakes`](Self::check_after_wakes)
    /// to run at the end of the next loop pass even if the ring is found
    /// waiting before then: for work of the consumer's own that the hook
    /// looks at. Nothing without a hook; on the ring's runtime thread.
    pub fn schedule_check(&self) {
        let st = self.core.state.borrow();
        if let Some(c) = &st.check {
            self.core.handle.schedule_check(c, true);
        }
    }

    /// Reposts every released buffer now (those waiting for a full batch).
    pub fn flush_reposts(&self) {
        let mut st = self.core.state.borrow_mut();
        self.core.flush_pending(&mut st, None);
    }

    /// The next message if the oldest completion is a received message;
    /// `None` if nothing completed or the oldest completion is a failure
    /// (then [`poll_next`](Self::poll_next) reports it, or waits). What
    /// `poll_next` would return first, without its `Poll` around it; it
    /// registers no waker (a ready message never does).
    #[inline]
    pub fn try_next(&self) -> Option<RingMsg> {
        let mut st = self.core.state.borrow_mut();
        let slot = *st.ready.front()?;
        let len = self.message_len(&self.core.done[slot as usize].get())?;
        st.ready.pop_front();
        drop(st);
        Some(self.message(slot, len))
    }

    /// The payload length of `c` if it is a received message (a WRITE with
    /// immediate leaves the buffer empty); `None` for a failure.
    #[inline(always)]
    fn message_len(&self, c: &Completion) -> Option<u32> {
        if !c.status.is_success() {
            return None;
        }
        if by_write(c) {
            Some(0)
        } else {
            self.core.geometry.payload_len(c.byte_len)
        }
    }

    /// The message in `slot`, `len` payload bytes.
    #[inline(always)]
    fn message(&self, slot: u32, len: u32) -> RingMsg {
        RingMsg {
            core: self.core.clone(),
            slot,
            len,
        }
    }

    /// True if [`poll_next`](Self::poll_next) with `waker` would return
    /// `Pending` at once and change nothing: nothing completed, buffers are
    /// posted, none waits to be reposted, and `waker` is the one registered.
    /// A cheaper poll for a caller that only wants to know.
    #[inline]
    pub fn is_waiting(&self, waker: &Waker) -> bool {
        let st = self.core.state.borrow();
        let waiting = st.ready.is_empty() && st.waits_on(waker);
        if waiting {
            RingCore::withdraw_check(&st);
        }
        waiting
    }

    /// The next message, in arrival order. `None` once the ring has
    /// stopped (after an error or the QP's close) and every buffer has
    /// completed.
    // An async `next`, as on tokio's and futures' streams (not Iterator's).
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> NextMsg<'_> {
        NextMsg { ring: self }
    }

    /// Polls for the next message (see [`next`](Self::next)). Released
    /// buffers still waiting for their batch are reposted before waiting.
    #[inline(always)]
    pub fn poll_next(&self, cx: &mut Context<'_>) -> Poll<Option<Result<RingMsg, RecvRingError>>> {
        let mut st = self.core.state.borrow_mut();
        while let Some(slot) = st.ready.pop_front() {
            let c = self.core.done[slot as usize].get();
            if let Some(len) = self.message_len(&c) {
                drop(st);
                return Poll::Ready(Some(Ok(self.message(slot, len))));
            }
            if let Some(e) = self.failed(&mut st, c) {
                return Poll::Ready(Some(Err(e)));
            }
        }
        // The common wait (kept registered by `completed`).
        if st.waits_on(cx.waker()) {
            RingCore::withdraw_check(&st);
            return Poll::Pending;
        }
        self.poll_empty(&mut st, cx)
    }

    /// Nothing ready: reposts what is pending, reports a repost failure,
    /// ends the stream or registers the waker.
    #[inline(never)]
    fn poll_empty(
        &self,
        st: &mut State,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<RingMsg, RecvRingError>>> {
        if !st.pending.is_empty() {
            self.core.flush_pending(st, Some(cx));
        }
        if let Some(e) = st.post_error.take() {
            return Poll::Ready(Some(Err(e)));
        }
        if st.posted == 0 && (st.stopped || self.core.target.closed()) {
            return Poll::Ready(None);
        }
        match &st.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            _ => st.waker = Some(cx.waker().clone()),
        }
        Poll::Pending
    }

    /// A completion that is not a message: its buffer goes idle (the QP is
    /// in ERR: nothing is reposted any more) and its error is returned,
    /// except for flushes after the first one reported (`None`: they only
    /// drain).
    #[cold]
    #[inline(never)]
    fn failed(&self, st: &mut State, c: Completion) -> Option<RecvRingError> {
        let slot = wr_id::ring_slot(c.wr_id);
        let qp_num = self.core.target.id();
        let one_of_many = self.core.target.is_srq()
            || (self.core.geometry.grh && c.status != WcStatus::WrFlushErr);
        if one_of_many && !st.stopped {
            // UD: one lost datagram; SRQ: one QP's failure. The buffer
            // goes back to the device.
            let _ = self.core.release_slow(st, slot);
        } else {
            st.slots[slot as usize] = Slot::Idle;
            st.stopped = true;
            self.core.give_back_kept(st);
        }
        if c.status.is_success() {
            return Some(RecvRingError::Length {
                qp_num,
                slot,
                byte_len: c.byte_len,
                buf_size: self.core.buf_size,
            });
        }
        if c.status == WcStatus::WrFlushErr && !self.core.target.is_srq() {
            if st.reported_flush {
                return None;
            }
            st.reported_flush = true;
        }
        Some(RecvRingError::Completion {
            qp_num,
            slot,
            wr_id: wr_id::encode_ring(self.core.key, slot),
            status: c.status,
            vendor_err: c.vendor_err,
        })
    }
}

impl Drop for RecvRing {
    fn drop(&mut self) {
        let (unregister, check) = {
            let mut st = self.core.state.borrow_mut();
            st.dropped = true;
            st.waker = None;
            let check = st.check.take();
            // Completed, unread messages: their buffers go idle.
            while let Some(slot) = st.ready.pop_front() {
                st.slots[slot as usize] = Slot::Idle;
            }
            self.core.release_pending(&mut st);
            (st.posted == 0, check)
        };
        drop(check);
        if unregister {
            self.core.unregister(self.core.key);
        } else if let RingTarget::Srq(srq) = &self.core.target {
            // Freed once no QP on the SRQ is left (this ring's own handle,
            // `owner`, goes right after this).
            srq.orphan(self.core.key, Rc::downgrade(&self.core));
        }
    }
}

impl futures::Stream for RecvRing {
    type Item = Result<RingMsg, RecvRingError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        RecvRing::poll_next(&self, cx)
    }
}

/// The future of [`RecvRing::next`].
#[must_use = "futures do nothing unless polled"]
pub struct NextMsg<'a> {
    ring: &'a mut RecvRing,
}

impl Future for NextMsg<'_> {
    type Output = Option<Result<RingMsg, RecvRingError>>;

    #[inline(always)]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.ring.poll_next(cx)
    }
}

/// A received message: a buffer of a [`RecvRing`] lent out between its
/// completion and its repost. Dereferences to the received bytes; dropping
/// it reposts the buffer.
pub struct RingMsg {
    core: Rc<RingCore>,
    slot: u32,
    len: u32,
}

impl RingMsg {
    /// The received bytes.
    #[inline]
    pub fn as_slice(&self) -> &[u8] {
        let g = &self.core.geometry;
        let off = self.slot as usize * g.stride + g.payload_off;
        // SAFETY: slot < depth and len <= payload_cap (checked when the
        // guard was made), so the range lies in the ring's allocation. The slot
        // is not posted while this guard lives (it is reposted only by the
        // guard's drop), so the device does not write it, and no other
        // reference to it exists (one guard per completed slot).
        unsafe { std::slice::from_raw_parts(self.core.mem.as_ptr().add(off), self.len as usize) }
    }

    /// Bytes received.
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// True for an empty message.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Immediate data, if the message carried some (host byte order).
    pub fn imm(&self) -> Option<u32> {
        self.completion().imm_data
    }

    /// The buffer's index in the ring.
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// The QP the message came in on (the completion's `qp_num`): the
    /// ring's QP, or for a ring on a shared receive queue, whichever QP of
    /// it received the message.
    pub fn qp_num(&self) -> u32 {
        self.completion().qp_num
    }

    /// True if an RDMA WRITE with immediate consumed the buffer: the data
    /// went to the peer-granted memory and the buffer holds none of it
    /// ([`len`](Self::len) is 0); [`imm`](Self::imm) is the immediate.
    pub fn by_write(&self) -> bool {
        by_write(&self.completion())
    }

    /// On a UD queue pair, who sent the datagram: its QP number, LID, and
    /// GID (read from the GRH the device wrote before the payload). `None`
    /// on RC.
    pub fn source(&self) -> Option<DatagramSource> {
        let g = &self.core.geometry;
        if !g.grh {
            return None;
        }
        let off = self.slot as usize * g.stride + g.sge_off;
        // SAFETY: the slot's GRH area, `GRH_LEN` bytes inside its SGE, in
        // the ring's allocation; the slot is not posted while this guard
        // lives (see `as_slice`).
        let area = unsafe { std::slice::from_raw_parts(self.core.mem.as_ptr().add(off), GRH_LEN) };
        let c = self.completion();
        Some(DatagramSource::read(c.src_qp, c.slid, c.grh, area))
    }

    /// Reposts the buffer now (same as dropping the guard).
    pub fn repost(self) {}

    /// The buffer's completion (its slot is not reposted while this
    /// guard lives, so it is this message's).
    fn completion(&self) -> Completion {
        self.core.done[self.slot as usize].get()
    }
}

impl std::ops::Deref for RingMsg {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl fmt::Debug for RingMsg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RingMsg")
            .field("slot", &self.slot)
            .field("len", &self.len)
            .field("imm", &self.imm())
            .finish()
    }
}

impl Drop for RingMsg {
    #[inline]
    fn drop(&mut self) {
        self.core.release(self.slot);
    }
}

impl QueuePair {
    /// A [`RecvRing`] of `depth` buffers of `buf_size` bytes on this QP,
    /// registered with `pd` (the QP's protection domain); see
    /// [`RecvRing::new`].
    pub fn recv_ring(
        &self,
        pd: &Pd,
        depth: u32,
        buf_size: usize,
    ) -> Result<RecvRing, RecvRingError> {
        RecvRing::new(self, pd, RecvRingConfig::new(depth, buf_size))
    }
}

/// Takes entries of `pool` one at a time until `held` reaches `want` or
/// none is left, waiting in line with `cx` if given (its `ticket` is the
/// ring's place in the line).
#[inline]
fn acquire_up_to(
    pool: &QueueEntries,
    ticket: &mut Option<Ticket>,
    cx: &mut Option<&mut Context<'_>>,
    held: &mut u32,
    want: u32,
) {
    while *held < want {
        let got = match cx.as_deref_mut() {
            None => pool.try_acquire(1),
            Some(cx) => pool.poll_acquire(1, ticket, cx).is_ready(),
        };
        if !got {
            break;
        }
        *held += 1;
    }
}
