//! `Op<T>`: an in-flight chain of work requests, tracked by wr_id in a
//! preallocated slab, completed by the reactor.
//!
//! # wr_id layout
//!
//! ```text
//!  63   62     48 47          24 23           0
//! [ R | index   | generation    | slab key     ]
//! ```
//!
//! * `key` (24 bits): the op's slot in the reactor's slab.
//! * `generation` (24 bits, never 0): taken from a per-runtime counter when the
//!   slot is filled. A completion whose generation does not match the slot is
//!   stale (its op is gone, the slot was reused) and is ignored.
//! * `index` (14 bits): the WR's position in the op's chain. Only the last WR
//!   of a chain is signaled; a completion for an earlier index only happens on
//!   error (or flush) and is remembered until the last one arrives.
//! * `R` (bit 63): the reserved namespace, see [`wr_id`]. Such completions never
//!   touch the slab. Inside it, [`wr_id::INLINE`] ids belong to inline sends
//!   posted without an op (they name their QP and the credits they return).

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

use crate::provider::{Completion, PostError, ProviderError};
use crate::qp::QpCore;
use crate::reactor::Handle;

/// Reserved wr_ids and the layout constants of tracked ones.
pub mod wr_id {
    /// The reserved namespace bit: wr_ids with this bit set are not slab keys.
    pub const RESERVED: u64 = 1 << 63;
    /// A WR whose completion the runtime drops silently (fire and forget, e.g.
    /// a raw post made outside the `QueuePair` API).
    pub const UNTRACKED: u64 = RESERVED;
    /// First wr_id handed to the reserved-completion handler
    /// ([`Handle::set_reserved_handler`](crate::reactor::Handle::set_reserved_handler)),
    /// e.g. for agent-internal receives. Every id in `AGENT_BASE..` goes there.
    pub const AGENT_BASE: u64 = RESERVED | (1 << 32);
    /// Inline sends posted without an op ([`QueuePair::post_send_inline`](crate::QueuePair::post_send_inline)):
    /// `INLINE | marker << 30 | credits << 20 | QP registry key`. Their
    /// completions release `credits` send-queue and CQ credits of that QP
    /// and record its first error; they never touch the op slab.
    pub const INLINE: u64 = RESERVED | (1 << 31);
    /// Bits of the QP registry key in an inline wr_id.
    pub const INLINE_KEY_BITS: u32 = 20;
    /// Bits of the credit count in an inline wr_id.
    pub const INLINE_CREDIT_BITS: u32 = 10;
    /// Set in the wr_id of the zero-length WR that retires a QP's trailing
    /// unsignaled inline sends (it carries no data: its errors are not recorded).
    pub const INLINE_MARKER: u64 = 1 << 30;
    /// Receives of a [`RecvRing`](crate::qp::RecvRing):
    /// `RING | ring key << RING_SLOT_BITS | slot`. Their completions go to
    /// the ring (named by its key in the reactor's ring registry); they
    /// never touch the op slab.
    pub const RING: u64 = RESERVED | (1 << 30);
    /// Bits of the slot (buffer index) in a ring wr_id.
    pub const RING_SLOT_BITS: u32 = 16;
    /// Bits of the ring key in a ring wr_id.
    pub const RING_KEY_BITS: u32 = 14;
    pub(crate) const RING_SLOT_MASK: u64 = (1 << RING_SLOT_BITS) - 1;
    pub(crate) const RING_KEY_MASK: u64 = (1 << RING_KEY_BITS) - 1;

    /// True for the wr_ids of [`RING`] WRs.
    #[inline]
    pub(crate) fn is_ring(id: u64) -> bool {
        id & !((1u64 << 30) - 1) == RING
    }

    /// Builds a ring wr_id (`key` < 2^14, `slot` < 2^16).
    #[inline]
    pub(crate) fn encode_ring(key: usize, slot: u32) -> u64 {
        RING | (key as u64 & RING_KEY_MASK) << RING_SLOT_BITS | (u64::from(slot) & RING_SLOT_MASK)
    }

    /// The ring key of a ring wr_id.
    #[inline]
    pub(crate) fn ring_key(id: u64) -> usize {
        ((id >> RING_SLOT_BITS) & RING_KEY_MASK) as usize
    }

    /// Bits of the slab key.
    pub const KEY_BITS: u32 = 24;
    /// Bits of the generation.
    pub const GEN_BITS: u32 = 24;
    /// Bits of the index within a chain.
    pub const INDEX_BITS: u32 = 14;
    /// Largest number of WRs in one op's chain.
    pub const MAX_CHAIN: usize = 1 << INDEX_BITS;
    /// Largest number of ops in flight at once per runtime.
    pub const MAX_OPS: usize = 1 << KEY_BITS;

    pub(crate) const KEY_MASK: u64 = (1 << KEY_BITS) - 1;
    pub(crate) const GEN_SHIFT: u32 = KEY_BITS;
    pub(crate) const GEN_MASK: u64 = (1 << GEN_BITS) - 1;
    pub(crate) const INDEX_SHIFT: u32 = KEY_BITS + GEN_BITS;
    pub(crate) const INDEX_MASK: u64 = (1 << INDEX_BITS) - 1;

    /// Builds a tracked wr_id.
    pub(crate) fn encode(key: usize, gen: u32, index: u16) -> u64 {
        (key as u64 & KEY_MASK)
            | ((u64::from(gen) & GEN_MASK) << GEN_SHIFT)
            | ((u64::from(index) & INDEX_MASK) << INDEX_SHIFT)
    }

    /// The generation after `gen`: they run `1..=GEN_MASK` and wrap to 1
    /// (never 0, so a tracked wr_id is never 0).
    #[inline(always)]
    pub(crate) fn next_gen(gen: u32) -> u32 {
        if gen >= GEN_MASK as u32 {
            1
        } else {
            gen + 1
        }
    }

    /// True for the wr_ids of [`INLINE`] WRs.
    pub(crate) fn is_inline(id: u64) -> bool {
        id & !((1u64 << 31) - 1) == INLINE
    }

    /// Builds an inline wr_id (`key` < 2^20, `credits` < 2^10).
    pub(crate) fn encode_inline(key: usize, credits: u32, marker: bool) -> u64 {
        INLINE
            | if marker { INLINE_MARKER } else { 0 }
            | (u64::from(credits) & ((1 << INLINE_CREDIT_BITS) - 1)) << INLINE_KEY_BITS
            | (key as u64 & ((1 << INLINE_KEY_BITS) - 1))
    }

    /// Splits an inline wr_id into (QP registry key, credits, marker).
    pub(crate) fn decode_inline(id: u64) -> (usize, u32, bool) {
        (
            (id & ((1 << INLINE_KEY_BITS) - 1)) as usize,
            ((id >> INLINE_KEY_BITS) & ((1 << INLINE_CREDIT_BITS) - 1)) as u32,
            id & INLINE_MARKER != 0,
        )
    }

    /// Splits a tracked wr_id into (key, generation, index).
    pub(crate) fn decode(id: u64) -> (usize, u32, u16) {
        (
            (id & KEY_MASK) as usize,
            ((id >> GEN_SHIFT) & GEN_MASK) as u32,
            ((id >> INDEX_SHIFT) & INDEX_MASK) as u16,
        )
    }
}

/// Why an op could not be (fully) posted. The op's data comes back through
/// [`Completable::fail`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SubmitError {
    /// The queue pair was closed (or dropped, or the runtime shut down).
    #[error("QP {qp_num} is closed")]
    Closed {
        /// QP number.
        qp_num: u32,
    },
    /// The chain is empty or longer than the queue can ever hold.
    #[error("QP {qp_num}: a chain of {len} WRs does not fit the {queue} queue (depth {depth})")]
    ChainLength {
        /// QP number.
        qp_num: u32,
        /// `"send"` or `"receive"`.
        queue: &'static str,
        /// WRs in the chain.
        len: usize,
        /// Queue depth.
        depth: u32,
    },
    /// A WR has more SGEs than the QP allows.
    #[error("QP {qp_num}: WR with {sges} SGEs, the {queue} queue allows {max}")]
    TooManySges {
        /// QP number.
        qp_num: u32,
        /// `"send"` or `"receive"`.
        queue: &'static str,
        /// SGEs in the WR.
        sges: usize,
        /// Allowed.
        max: u32,
    },
    /// The verb refused its own arguments while building the WRs.
    #[error("invalid request: {what}")]
    Invalid {
        /// What was wrong.
        what: String,
    },
    /// The provider refused the post. If part of a chain had been accepted,
    /// the QP was moved to ERR and this is reported once those WRs flushed.
    #[error("QP {qp_num}: post failed: {source}")]
    Post {
        /// QP number.
        qp_num: u32,
        /// The provider's error.
        #[source]
        source: PostError,
    },
    /// An earlier inline send of this QP posted without waiting
    /// ([`QueuePair::post_send_inline`](crate::QueuePair::post_send_inline))
    /// completed with an error; the QP is in ERR and refuses new work.
    #[error("QP {qp_num}: an earlier inline send (wr_id {wr_id:#x}) failed: {status}")]
    InlineSendFailed {
        /// QP number.
        qp_num: u32,
        /// wr_id of the failed WR.
        wr_id: u64,
        /// Its completion status.
        status: crate::provider::WcStatus,
        /// Vendor error code.
        vendor_err: u32,
    },
    /// The op's WR waited for the end of the poll phase to be posted with
    /// others in one list (see `QueuePair::submit_send`), and the provider
    /// refused an earlier WR of that list: this one was not posted.
    #[error("QP {qp_num}: work request {wr_id:#x} not posted: an earlier one of its post list was refused ({reason})")]
    PostBatchAborted {
        /// QP number.
        qp_num: u32,
        /// This op's WR.
        wr_id: u64,
        /// The refusal of the earlier WR.
        reason: String,
    },
    /// Too many ops in flight for the wr_id space.
    #[error("too many ops in flight (limit {limit})")]
    SlabFull {
        /// The limit.
        limit: usize,
    },
    /// A provider call around the post failed.
    #[error(transparent)]
    Provider(#[from] ProviderError),
}

/// What an op turns into when its work completes: implemented by each verb.
///
/// The value owns everything the device may touch (buffers, MR handles) at
/// stable (heap) addresses; the runtime keeps it alive until the device is
/// done with it, even if the op future is dropped.
pub trait Completable: 'static {
    /// The op future's output, typically `(Result<..>, buffers)`.
    type Output;
    /// Called with the completion of the op: the first error completion of
    /// the chain if there was one, else the last (signaled) WR's completion.
    fn complete(self, completion: Completion) -> Self::Output;
    /// Called instead when the op could not be posted (nothing of it reached
    /// the device, or what did has been flushed).
    fn fail(self, error: SubmitError) -> Self::Output;
}

/// The states an op's slot goes through in the reactor's table (a
/// description: the table keeps them in a compact form, see `OpTable`).
pub enum Lifecycle {
    /// Posted; nobody polled the op yet.
    Submitted,
    /// Posted; the op's task waits with this waker.
    Waiting(Waker),
    /// The op future was dropped while in flight: its data is parked here
    /// until the completion (success or `WR_FLUSH_ERR`) arrives, then dropped.
    Ignored(Box<dyn Any>),
    /// The completion arrived; the op future has not collected it yet.
    Completed(Completion),
}

impl std::fmt::Debug for Lifecycle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Lifecycle::Submitted => f.write_str("Submitted"),
            Lifecycle::Waiting(_) => f.write_str("Waiting"),
            Lifecycle::Ignored(_) => f.write_str("Ignored"),
            Lifecycle::Completed(c) => write!(f, "Completed({:?})", c.status),
        }
    }
}

/// Credits an op holds on its work queue and CQ; given back when its last
/// completion arrives (or when it is dropped unposted).
///
/// One `Rc` of the QP's core (not one per credit pool): the core owns both
/// pools, and keeping it alive is what the zombie logic expects anyway.
pub(crate) struct Credit {
    pub(crate) core: Rc<QpCore>,
    /// Receive queue (and receive CQ) rather than send queue (and send CQ).
    pub(crate) recv: bool,
    pub(crate) n: u32,
}

impl Drop for Credit {
    fn drop(&mut self) {
        let c = &*self.core;
        let (queue, cq) = if self.recv {
            (&c.rq, &c.recv_cq)
        } else {
            (&c.sq, &c.send_cq)
        };
        queue.release(self.n);
        cq.release(self.n);
    }
}

/// The rare part of a slot (allocated only on an error path).
#[derive(Default)]
struct SlotErrors {
    /// First error completion of an earlier (unsignaled) WR of the chain.
    first_error: Option<Completion>,
    /// Set when only part of the chain was posted.
    post_error: Option<Box<SubmitError>>,
}

/// Where a slot is in its [`Lifecycle`] (or free).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum State {
    /// Not in use; on the free list.
    Free,
    Submitted,
    /// Polled: `waker` is the waiting task's.
    Waiting,
    /// Dropped in flight: `parked` holds the op's data.
    Ignored,
    /// `completion` holds the op's result.
    Completed,
}

/// One op's place in the table. Slots are never moved in or out whole:
/// each step of the lifecycle writes the fields it changes, in place.
struct Slot {
    gen: u32,
    state: State,
    /// Index of the WR whose completion ends the op.
    last_index: u16,
    /// Next free slot (while `Free`); [`NO_SLOT`] ends the list.
    next_free: u32,
    /// The waker of the task that last polled an op of this slot. Kept
    /// when the slot is freed and reused: the next op polled by the same
    /// task (the common case) needs no clone, and the reactor's own task
    /// wakers are woken by reference, so the op path touches no refcount.
    /// Only meaningful while `Waiting`.
    waker: Option<Waker>,
    /// Valid while `Completed`.
    completion: Completion,
    /// Held from the post until the last completion.
    credit: Option<Credit>,
    /// What went wrong besides the last completion: boxed, it is rare.
    errors: Option<Box<SlotErrors>>,
    /// The data of an op dropped in flight (`Ignored`).
    parked: Option<Box<dyn Any>>,
}

/// End of the free list.
const NO_SLOT: u32 = u32::MAX;

/// The slots and their free list.
struct Slots {
    slots: Vec<Slot>,
    /// First free slot, [`NO_SLOT`] if none.
    free: u32,
    /// Slots in use.
    live: usize,
}

impl Slots {
    /// The slot of a live op, `None` for an unknown or free key.
    #[inline(always)]
    fn live_mut(&mut self, key: usize) -> Option<&mut Slot> {
        self.slots.get_mut(key).filter(|s| s.state != State::Free)
    }

    /// Puts slot `key` on the free list. Its waker stays (see [`Slot::waker`]);
    /// the caller has taken whatever else it owned.
    #[inline(always)]
    fn release(&mut self, key: usize) {
        let free = self.free;
        let slot = &mut self.slots[key];
        slot.state = State::Free;
        slot.next_free = free;
        self.free = key as u32;
        self.live -= 1;
    }
}

/// The table of in-flight ops, keyed by wr_id.
pub(crate) struct OpTable {
    table: RefCell<Slots>,
    next_gen: Cell<u32>,
    /// Set at runtime shutdown: from then on parked data is leaked, not parked.
    shut_down: Cell<bool>,
    /// Data of ignored ops whose completion arrived, dropped after the drain
    /// loop releases its borrows (user `Drop` code may call back into us).
    graveyard: RefCell<Vec<Box<dyn Any>>>,
    /// `!graveyard.is_empty()` (checked after every drain without a borrow).
    has_dead: Cell<bool>,
    stale: Cell<u64>,
}

impl OpTable {
    pub(crate) fn with_capacity(n: usize) -> OpTable {
        OpTable {
            table: RefCell::new(Slots {
                slots: Vec::with_capacity(n.min(wr_id::MAX_OPS)),
                free: NO_SLOT,
                live: 0,
            }),
            next_gen: Cell::new(1),
            shut_down: Cell::new(false),
            graveyard: RefCell::new(Vec::new()),
            has_dead: Cell::new(false),
            stale: Cell::new(0),
        }
    }

    /// Reserves a slot before posting; returns its key and generation.
    #[inline(always)]
    pub(crate) fn insert(&self, last_index: u16, credit: Credit) -> Result<(usize, u32), Credit> {
        let mut t = self.table.borrow_mut();
        let gen = self.next_gen.get();
        let next = wr_id::next_gen(gen);
        let key = t.free as usize;
        if let Some(slot) = t.slots.get_mut(key) {
            let next_free = slot.next_free;
            slot.gen = gen;
            slot.state = State::Submitted;
            slot.last_index = last_index;
            slot.credit = Some(credit);
            t.free = next_free;
            t.live += 1;
            self.next_gen.set(next);
            return Ok((key, gen));
        }
        drop(t);
        self.insert_new(gen, next, last_index, credit)
    }

    /// [`insert`](Self::insert) with no free slot: the table grows.
    #[cold]
    #[inline(never)]
    fn insert_new(
        &self,
        gen: u32,
        next: u32,
        last_index: u16,
        credit: Credit,
    ) -> Result<(usize, u32), Credit> {
        let mut t = self.table.borrow_mut();
        let key = t.slots.len();
        if key >= wr_id::MAX_OPS {
            return Err(credit);
        }
        t.slots.push(Slot {
            gen,
            state: State::Submitted,
            last_index,
            next_free: NO_SLOT,
            waker: None,
            completion: Completion::EMPTY,
            credit: Some(credit),
            errors: None,
            parked: None,
        });
        t.live += 1;
        self.next_gen.set(next);
        Ok((key, gen))
    }

    /// Frees a slot whose post failed entirely; returns its credit.
    pub(crate) fn remove_unposted(&self, key: usize) -> Option<Credit> {
        let mut t = self.table.borrow_mut();
        let slot = t.live_mut(key)?;
        let credit = slot.credit.take();
        let errors = slot.errors.take();
        t.release(key);
        drop(t);
        drop(errors);
        credit
    }

    /// The deferred post of op `key` (generation `gen`) was refused: none
    /// of its WRs reached the queue. Its credits go back, except `absorbed`
    /// of them (inline sends' credits it took over, which the QP holds
    /// again), and the op ends with `error`: its future resolves with it,
    /// or, if it was dropped, its parked data is freed.
    pub(crate) fn fail_unposted(&self, key: usize, gen: u32, absorbed: u32, error: SubmitError) {
        let mut t = self.table.borrow_mut();
        let Some(slot) = t.live_mut(key).filter(|s| s.gen == gen) else {
            tracing::error!(key, "refused deferred post of an unknown op");
            return;
        };
        let mut credit = slot.credit.take();
        if let Some(c) = &mut credit {
            c.n -= absorbed.min(c.n);
        }
        match slot.state {
            State::Submitted | State::Waiting => {
                let waiting = slot.state == State::Waiting;
                slot.state = State::Completed;
                slot.errors.get_or_insert_with(Default::default).post_error = Some(Box::new(error));
                self.wake_completed(t, key, waiting, credit);
            }
            State::Ignored => self.free_ignored(t, key, credit),
            State::Completed | State::Free => {}
        }
    }

    /// Only `posted` WRs of the chain reached the queue: the op now ends with
    /// the flush of the last of them and reports `error`.
    pub(crate) fn set_partial(&self, key: usize, posted: usize, error: SubmitError) {
        if let Some(slot) = self.table.borrow_mut().live_mut(key) {
            slot.last_index = (posted - 1) as u16;
            slot.errors.get_or_insert_with(Default::default).post_error = Some(Box::new(error));
        }
    }

    /// Number of slots (in flight, parked or completed-but-uncollected).
    pub(crate) fn len(&self) -> usize {
        self.table.borrow().live
    }

    /// Number of slots still waiting for the device.
    pub(crate) fn in_flight(&self) -> usize {
        self.table
            .borrow()
            .slots
            .iter()
            .filter(|s| matches!(s.state, State::Submitted | State::Waiting | State::Ignored))
            .count()
    }

    /// Completions ignored because their generation or key was stale.
    pub(crate) fn stale_count(&self) -> u64 {
        self.stale.get()
    }

    /// Polls op `key`: once its completion arrived, frees the slot and
    /// returns `Ready` with what `done` makes of the completion (and of the
    /// post error of a partial post), called after the table's borrow is
    /// released (it may run user code).
    ///
    /// Inlined into each `Op<T>::poll`: one borrow, the common states in a
    /// small frame, the rare ones out of line. `done` builds the output in
    /// place: the completion is not passed through an intermediate `Poll`.
    #[inline(always)]
    pub(crate) fn poll_op<R>(
        &self,
        key: usize,
        cx: &mut Context<'_>,
        done: impl FnOnce(Completion, Option<Box<SubmitError>>) -> R,
    ) -> Poll<R> {
        let mut t = self.table.borrow_mut();
        let Some(slot) = t.live_mut(key) else {
            drop(t);
            return Self::polled_without_slot(key);
        };
        match slot.state {
            State::Completed => {
                let c = slot.completion;
                if slot.errors.is_some() {
                    drop(t);
                    return Poll::Ready(done(c, self.take_post_error(key)));
                }
                t.release(key);
                drop(t);
                Poll::Ready(done(c, None))
            }
            State::Submitted | State::Waiting => {
                slot.state = State::Waiting;
                match &slot.waker {
                    Some(w) if w.will_wake(cx.waker()) => Poll::Pending,
                    _ => {
                        // The old waker is dropped outside the borrow (a
                        // foreign waker's drop may run any code).
                        let old = slot.waker.replace(cx.waker().clone());
                        drop(t);
                        drop(old);
                        Poll::Pending
                    }
                }
            }
            State::Ignored | State::Free => {
                drop(t);
                Self::polled_without_slot(key)
            }
        }
    }

    /// Frees completed slot `key` that carries errors; returns its post error.
    #[cold]
    #[inline(never)]
    fn take_post_error(&self, key: usize) -> Option<Box<SubmitError>> {
        let mut t = self.table.borrow_mut();
        let errors = t.live_mut(key).and_then(|s| s.errors.take());
        t.release(key);
        drop(t);
        errors.and_then(|e| e.post_error)
    }

    /// Invariant violation: an `Op` owns its slot until it returns Ready or
    /// is dropped, so this cannot happen; stay pending rather than panic.
    #[cold]
    #[inline(never)]
    fn polled_without_slot<R>(key: usize) -> Poll<R> {
        tracing::error!(key, "op polled without a live slot");
        Poll::Pending
    }

    /// The op future of slot `key` is dropped with its data unclaimed.
    pub(crate) fn drop_op<T: 'static>(&self, key: usize, data: T) {
        let mut t = self.table.borrow_mut();
        let Some(slot) = t.live_mut(key) else {
            drop(t);
            drop(data);
            return;
        };
        match slot.state {
            State::Completed => {
                let errors = slot.errors.take();
                t.release(key);
                drop(t);
                drop(errors);
                drop(data);
            }
            State::Submitted | State::Waiting => {
                if self.shut_down.get() {
                    // The runtime is gone: nobody will ever see this op's
                    // completion, and the device may still use the memory.
                    tracing::warn!(
                        key,
                        "op dropped after runtime shutdown: leaking its buffers"
                    );
                    std::mem::forget(data);
                    return;
                }
                slot.state = State::Ignored;
                slot.parked = Some(Box::new(data));
            }
            State::Ignored | State::Free => {
                tracing::error!(key, "op dropped twice");
                drop(t);
                std::mem::forget(data);
            }
        }
    }

    /// Routes one completion of a tracked wr_id to its slot. Wakers are woken
    /// and parked data is queued in the graveyard, never dropped in here.
    ///
    /// The common case inline: the last WR of a chain without earlier
    /// errors, for an op still in flight. Everything else (stale, earlier
    /// WR of a chain, error bookkeeping, parked data, duplicates) goes to
    /// [`complete_slow`](Self::complete_slow).
    #[inline(always)]
    pub(crate) fn complete(&self, c: Completion) {
        let (key, gen, index) = wr_id::decode(c.wr_id);
        let mut t = self.table.borrow_mut();
        let Some(slot) = t.slots.get_mut(key) else {
            drop(t);
            return self.complete_slow(c);
        };
        let waiting = slot.state == State::Waiting;
        if slot.gen != gen
            || index != slot.last_index
            || slot.errors.is_some()
            || !(waiting || slot.state == State::Submitted)
        {
            drop(t);
            return self.complete_slow(c);
        }
        slot.completion = c;
        slot.state = State::Completed;
        let credit = slot.credit.take();
        self.wake_completed(t, key, waiting, credit);
    }

    /// Wakes a waker that is not the runtime's own (taken out of slot `key`
    /// by [`wake_in_place`](Self::wake_in_place)) with no borrow held, by
    /// reference, then puts it back as the slot's cached waker: the waiter's
    /// next op, which mostly gets this same slot, needs no clone, and the
    /// wake no refcount change. If the wake re-entered the table and the
    /// slot has a waker again, that one is newer: ours is dropped.
    #[inline(always)]
    fn wake_foreign(&self, key: usize, w: Waker) {
        w.wake_by_ref();
        let mut t = self.table.borrow_mut();
        if let Some(slot) = t.slots.get_mut(key) {
            if slot.waker.is_none() {
                slot.waker = Some(w);
                return;
            }
        }
        drop(t);
        drop(w);
    }

    /// Wakes the waiter of a completed slot: the reactor's own task wakers
    /// by reference, in place (their wake only queues the task: it runs no
    /// foreign code, so the table's borrow may be held); any other waker is
    /// taken out and returned, to be woken once the borrow is released
    /// ([`wake_foreign`](Self::wake_foreign)).
    #[inline(always)]
    fn wake_in_place(waker: &mut Option<Waker>) -> Option<Waker> {
        match waker {
            Some(w) if crate::reactor::wake_if_task(w) => None,
            w => w.take(),
        }
    }

    /// [`complete`](Self::complete) outside its common case.
    #[cold]
    #[inline(never)]
    fn complete_slow(&self, c: Completion) {
        let (key, gen, index) = wr_id::decode(c.wr_id);
        let mut t = self.table.borrow_mut();
        let slot = match t.live_mut(key) {
            Some(slot) if slot.gen == gen => slot,
            _ => {
                self.stale.set(self.stale.get() + 1);
                tracing::debug!(wr_id = c.wr_id, status = %c.status, "stale completion ignored");
                return;
            }
        };
        if index != slot.last_index {
            if index > slot.last_index {
                // A WR past a partial post's end cannot exist: stale.
                self.stale.set(self.stale.get() + 1);
                return;
            }
            if !c.status.is_success()
                && slot.errors.as_ref().is_none_or(|e| e.first_error.is_none())
            {
                slot.errors.get_or_insert_with(Default::default).first_error = Some(c);
            } else if c.status.is_success() {
                tracing::debug!(wr_id = c.wr_id, "completion of an unsignaled WR");
            }
            return;
        }
        let effective = slot
            .errors
            .as_mut()
            .and_then(|e| e.first_error.take())
            .unwrap_or(c);
        match slot.state {
            State::Submitted | State::Waiting => {
                let waiting = slot.state == State::Waiting;
                slot.completion = effective;
                slot.state = State::Completed;
                let credit = slot.credit.take();
                self.wake_completed(t, key, waiting, credit);
            }
            State::Ignored => {
                let credit = slot.credit.take();
                self.free_ignored(t, key, credit);
            }
            State::Completed | State::Free => {
                tracing::warn!(wr_id = c.wr_id, "duplicate completion ignored");
            }
        }
    }

    /// Slot `key` just became `Completed`: wakes its waiter if it was
    /// `waiting` (a foreign waker once the borrow `t` is released), then
    /// gives `credit` back. Inline: `complete`'s fast path ends here.
    #[inline(always)]
    fn wake_completed(
        &self,
        mut t: std::cell::RefMut<'_, Slots>,
        key: usize,
        waiting: bool,
        credit: Option<Credit>,
    ) {
        let foreign = if waiting {
            Self::wake_in_place(&mut t.slots[key].waker)
        } else {
            None
        };
        drop(t);
        drop(credit);
        if let Some(w) = foreign {
            self.wake_foreign(key, w);
        }
    }

    /// Frees slot `key` of an op dropped in flight (`Ignored`) that the
    /// device is done with: its parked data goes to the graveyard (dropped
    /// after the drain, outside every borrow), `credit` back.
    fn free_ignored(
        &self,
        mut t: std::cell::RefMut<'_, Slots>,
        key: usize,
        credit: Option<Credit>,
    ) {
        let slot = &mut t.slots[key];
        let data = slot.parked.take();
        let errors = slot.errors.take();
        t.release(key);
        drop(t);
        if let Some(data) = data {
            self.graveyard.borrow_mut().push(data);
            self.has_dead.set(true);
        }
        drop(errors);
        drop(credit);
    }

    /// Drops the data of ignored ops whose completion arrived.
    #[inline]
    pub(crate) fn bury(&self) {
        if self.has_dead.get() {
            self.bury_all();
        }
    }

    #[cold]
    #[inline(never)]
    fn bury_all(&self) {
        loop {
            // Cleared before each pop; the loop ends only on an empty
            // graveyard, whatever a `Drop` run here queues meanwhile.
            self.has_dead.set(false);
            let dead = self.graveyard.borrow_mut().pop();
            match dead {
                Some(d) => drop(d),
                None => break,
            }
        }
    }

    pub(crate) fn shut_down(&self) {
        self.shut_down.set(true);
    }

    pub(crate) fn is_shut_down(&self) -> bool {
        self.shut_down.get()
    }

    /// Leaks every parked buffer still in the table (runtime shutdown after
    /// the drain deadline): the device may still write that memory.
    pub(crate) fn leak_parked(&self) -> usize {
        let mut t = self.table.borrow_mut();
        let mut leaked = 0;
        for key in 0..t.slots.len() {
            if t.slots[key].state != State::Ignored {
                continue;
            }
            let slot = &mut t.slots[key];
            if let Some(data) = slot.parked.take() {
                std::mem::forget(data);
                leaked += 1;
            }
            // The credits stay taken: the QP is leaked too.
            std::mem::forget(slot.credit.take());
            t.release(key);
        }
        leaked
    }
}

impl Drop for OpTable {
    fn drop(&mut self) {
        let leaked = self.leak_parked();
        if leaked > 0 {
            tracing::warn!(leaked, "runtime dropped with parked ops: buffers leaked");
        }
    }
}

/// An in-flight op: resolves to `T::Output` when its completion arrives.
///
/// Dropping it before completion parks `T` in the reactor until the device
/// is done (see [`Lifecycle::Ignored`]).
pub struct Op<T: 'static> {
    handle: Handle,
    /// The first WR's wr_id (its slot key in the low bits). An `Op` exists
    /// only once its WRs are posted (the data waits in the `Submit` before).
    wr_id: u64,
    data: Option<T>,
}

// `Op` never pins its data: it is plain owned state handed to `complete`.
impl<T: 'static> Unpin for Op<T> {}

impl<T: 'static> Op<T> {
    /// The op of WRs just posted: `first` is the first WR's wr_id, `data`
    /// what they lend to the device (kept until the completion, or parked).
    #[inline(always)]
    pub(crate) fn posted(handle: Handle, first: u64, data: T) -> Op<T> {
        Op {
            handle,
            wr_id: first,
            data: Some(data),
        }
    }

    /// True once the op has handed its data to its output (polled `Ready`).
    #[inline(always)]
    pub(crate) fn is_done(&self) -> bool {
        self.data.is_none()
    }

    /// Drops a done op's fields in place, without running `Drop` for it
    /// (which does nothing for a done op): only its runtime handle owns
    /// anything. Inlined where an op's future is dropped after its output
    /// was taken (the common case), in place of the drop glue's call.
    ///
    /// # Safety
    ///
    /// The op is done ([`is_done`](Self::is_done)) and is never used nor
    /// dropped again (its owner is being dropped, without drop glue for it).
    #[inline(always)]
    pub(crate) unsafe fn drop_done(&mut self) {
        debug_assert!(self.is_done());
        // SAFETY: the caller guarantees the op is not used nor dropped
        // again, so its handle is dropped exactly once; `data` is `None`
        // and `wr_id` a plain value: nothing else to drop.
        unsafe { std::ptr::drop_in_place(&mut self.handle) }
    }

    #[inline(always)]
    fn key(&self) -> usize {
        (self.wr_id & wr_id::KEY_MASK) as usize
    }

    /// The wr_id of the op's first WR (index 0 of its chain).
    pub fn wr_id(&self) -> u64 {
        self.wr_id
    }

    /// The op's data, while it is in flight.
    pub fn data(&self) -> Option<&T> {
        self.data.as_ref()
    }
}

impl<T: Completable> std::future::Future for Op<T> {
    type Output = T::Output;

    #[inline(always)]
    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T::Output> {
        let this = &mut *self;
        if this.data.is_none() {
            tracing::error!(wr_id = this.wr_id, "op polled after completion");
            return Poll::Pending;
        }
        let key = this.key();
        let data = &mut this.data;
        this.handle.ops().poll_op(key, cx, |c, post_error| {
            // Invariant: `data` is `Some` (checked at the top of this
            // function, and nothing took it since).
            let data = data.take().expect("op data present until Ready");
            match post_error {
                Some(e) => data.fail(*e),
                None => data.complete(c),
            }
        })
    }
}

impl<T: 'static> Drop for Op<T> {
    /// Inline: a completed op (the common case) has nothing to give back.
    #[inline]
    fn drop(&mut self) {
        if self.data.is_some() {
            self.drop_in_flight();
        }
    }
}

impl<T: 'static> Op<T> {
    /// Dropped before its completion was collected: parks the data.
    #[cold]
    #[inline(never)]
    fn drop_in_flight(&mut self) {
        if let Some(data) = self.data.take() {
            self.handle.ops().drop_op(self.key(), data);
        }
    }
}

impl<T: 'static> std::fmt::Debug for Op<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Op")
            .field("wr_id", &format_args!("{:#x}", self.wr_id))
            .field("done", &self.data.is_none())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::wr_id::*;

    #[test]
    fn wr_id_round_trips() {
        let id = encode(0xab_cdef, 0x12_3456, 0x2abc);
        assert_eq!(decode(id), (0xab_cdef, 0x12_3456, 0x2abc));
        assert_eq!(id & RESERVED, 0);
        assert_ne!(AGENT_BASE & RESERVED, 0);
    }

    #[test]
    fn generations_skip_zero_when_they_wrap() {
        assert_eq!(next_gen(1), 2);
        assert_eq!(next_gen(GEN_MASK as u32 - 1), GEN_MASK as u32);
        assert_eq!(next_gen(GEN_MASK as u32), 1);
    }

    #[test]
    fn inline_wr_ids_round_trip_below_the_agent_range() {
        let id = encode_inline(0xf_abcd, 0x3ff, true);
        assert!(is_inline(id));
        assert!(id < AGENT_BASE && id & RESERVED != 0);
        assert_eq!(decode_inline(id), (0xf_abcd, 0x3ff, true));
        let id = encode_inline(7, 3, false);
        assert_eq!(decode_inline(id), (7, 3, false));
        assert!(!is_inline(UNTRACKED));
        assert!(!is_inline(AGENT_BASE));
        assert!(!is_inline(encode(1, 1, 0)));
    }

    #[test]
    fn ring_wr_ids_are_neither_inline_nor_agent_nor_slab() {
        for (key, slot) in [(0, 0), (0x3fff, 0xffff), (5, 77)] {
            let id = encode_ring(key, slot);
            assert!(is_ring(id));
            assert!(!is_inline(id));
            assert!(id < AGENT_BASE && id & RESERVED != 0);
            assert_eq!(ring_key(id), key);
            assert_eq!(id & RING_SLOT_MASK, u64::from(slot));
        }
        assert!(!is_ring(UNTRACKED));
        assert!(!is_ring(AGENT_BASE));
        assert!(!is_ring(encode_inline(7, 3, true)));
        assert!(!is_ring(encode_inline(0xf_ffff, 0x3ff, false)));
        assert!(!is_ring(encode(1, 1, 0)));
    }
}

/// The op table's slot reuse and waker handling.
#[cfg(test)]
mod table_tests {
    use std::cell::Cell;
    use std::future::Future;
    use std::rc::Rc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::{Context, Poll, Wake, Waker};

    use super::wr_id::KEY_MASK;
    use super::{Completable, SubmitError};
    use crate::provider::{Completion, QpCaps, SendFlags, SendOp, WcStatus};
    use crate::qp::{QueuePair, Submit};
    use crate::reactor::Runtime;
    use crate::testing::{settle, FakeQp};

    struct Bare;

    impl Completable for Bare {
        type Output = Result<Completion, String>;
        fn complete(self, c: Completion) -> Self::Output {
            Ok(c)
        }
        fn fail(self, e: SubmitError) -> Self::Output {
            Err(e.to_string())
        }
    }

    /// A zero-length WRITE (no SGE: it names no memory).
    fn write(qp: &QueuePair) -> Submit<Bare> {
        // SAFETY: the WR has no SGE, so it lends no memory to anything (and
        // the QP is a fake, which never touches memory anyway).
        unsafe {
            qp.submit_send_one(Bare, |_, wr| {
                wr.op = SendOp::Write {
                    remote_addr: 0x1000,
                    rkey: 1,
                };
                wr.flags = SendFlags::NONE;
                Ok(())
            })
        }
    }

    fn fake_qp() -> (QueuePair, Rc<FakeQp>) {
        let caps = QpCaps {
            max_send_wr: 8,
            max_recv_wr: 8,
            ..QpCaps::default()
        };
        FakeQp::queue_pair(3, caps, 64)
    }

    /// A foreign (non-runtime) waker counting its wakes.
    struct Counter(AtomicUsize);

    impl Wake for Counter {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn counter() -> (Arc<Counter>, Waker) {
        let c = Arc::new(Counter(AtomicUsize::new(0)));
        let w = Waker::from(c.clone());
        (c, w)
    }

    fn poll<F: Future + Unpin>(f: &mut F, w: &Waker) -> Poll<F::Output> {
        std::pin::Pin::new(f).poll(&mut Context::from_waker(w))
    }

    #[test]
    fn runtime_wakers_are_recognized_and_foreign_ones_are_not() {
        let rt = Runtime::new().unwrap();
        let ours = rt.block_on(std::future::poll_fn(|cx| {
            Poll::Ready(crate::reactor::is_task_waker(cx.waker()))
        }));
        assert!(ours);
        let (_c, w) = counter();
        assert!(!crate::reactor::is_task_waker(&w));
        assert!(!crate::reactor::is_task_waker(Waker::noop()));
    }

    #[test]
    fn a_foreign_waker_is_replaced_woken_once_and_released() {
        let rt = Runtime::new().unwrap();
        let (qp, fake) = fake_qp();
        let (c1, w1) = counter();
        let (c2, w2) = counter();
        let mut op = write(&qp);
        assert!(poll(&mut op, &w1).is_pending());
        assert!(poll(&mut op, &w1).is_pending());
        assert_eq!(Arc::strong_count(&c1), 3, "one clone kept by the slot");
        assert!(poll(&mut op, &w2).is_pending());
        assert_eq!(Arc::strong_count(&c1), 2, "replaced waker dropped");
        fake.complete_send(WcStatus::Success, 0).unwrap();
        settle(&rt);
        assert_eq!(c1.0.load(Ordering::SeqCst), 0, "old waker never woken");
        assert_eq!(c2.0.load(Ordering::SeqCst), 1, "latest waker woken once");
        assert_eq!(Arc::strong_count(&c2), 3, "woken by reference, kept");
        let Poll::Ready(r) = poll(&mut op, &w2) else {
            panic!("completed op still pending")
        };
        assert!(r.unwrap().status.is_success());
        assert_eq!(rt.ops_in_slab(), 0);
        // The next op of the same waiter reuses the slot and its waker: no
        // clone; a completion wakes it again, once.
        let mut next = write(&qp);
        assert!(poll(&mut next, &w2).is_pending());
        assert_eq!(Arc::strong_count(&c2), 3, "cached waker reused");
        fake.complete_send(WcStatus::Success, 0).unwrap();
        settle(&rt);
        assert_eq!(c2.0.load(Ordering::SeqCst), 2);
        assert!(poll(&mut next, &w2).is_ready());
        drop((op, next, qp, fake));
        drop(rt);
        assert_eq!(Arc::strong_count(&c2), 2, "released with the runtime");
        assert_eq!(Arc::strong_count(&c1), 2);
    }

    /// A foreign waker whose wake polls the op at once (re-entering the
    /// table, which frees the slot and lets a new op take it).
    #[test]
    fn a_foreign_wake_may_reenter_the_table() {
        struct Reenter {
            op: std::sync::Mutex<Option<Submit<Bare>>>,
            qp: std::sync::Mutex<Option<QueuePair>>,
            next: std::sync::Mutex<Option<Submit<Bare>>>,
        }
        struct Shared(Rc<Reenter>);
        // SAFETY: the waker is only ever used on the test's thread (the
        // runtime and the fake are single-threaded), so the `Rc` inside is
        // never touched from two threads.
        unsafe impl Send for Shared {}
        // SAFETY: as above.
        unsafe impl Sync for Shared {}
        impl Wake for Shared {
            fn wake(self: Arc<Self>) {
                self.wake_by_ref();
            }
            fn wake_by_ref(self: &Arc<Self>) {
                let op = self.0.op.lock().unwrap().take();
                if let Some(mut op) = op {
                    assert!(poll(&mut op, Waker::noop()).is_ready());
                    let qp = self.0.qp.lock().unwrap().take().unwrap();
                    let mut next = write(&qp);
                    assert!(poll(&mut next, Waker::noop()).is_pending());
                    *self.0.next.lock().unwrap() = Some(next);
                }
            }
        }
        let rt = Runtime::new().unwrap();
        let (qp, fake) = fake_qp();
        let r = Rc::new(Reenter {
            op: std::sync::Mutex::new(None),
            qp: std::sync::Mutex::new(Some(qp.clone())),
            next: std::sync::Mutex::new(None),
        });
        let shared = Arc::new(Shared(r.clone()));
        let w = Waker::from(shared.clone());
        let mut op = write(&qp);
        let key = op.wr_id().unwrap() & KEY_MASK;
        assert!(poll(&mut op, &w).is_pending());
        *r.op.lock().unwrap() = Some(op);
        fake.complete_send(WcStatus::Success, 0).unwrap();
        settle(&rt);
        let mut next = r.next.lock().unwrap().take().expect("woken and re-entered");
        assert_eq!(
            next.wr_id().unwrap() & KEY_MASK,
            key,
            "slot reused inside the wake"
        );
        assert_eq!(Arc::strong_count(&shared), 2, "the older waker was dropped");
        fake.complete_send(WcStatus::Success, 0).unwrap();
        settle(&rt);
        assert!(poll(&mut next, Waker::noop()).is_ready());
    }

    /// `Completable::complete` is user code: it runs once the table's borrow
    /// is released, so it may submit (re-enter the table) right away.
    #[test]
    fn complete_may_submit_another_op() {
        struct Chain(QueuePair, Rc<std::cell::RefCell<Option<Submit<Bare>>>>);
        impl Completable for Chain {
            type Output = bool;
            fn complete(self, c: Completion) -> bool {
                *self.1.borrow_mut() = Some(write(&self.0));
                c.status.is_success()
            }
            fn fail(self, _: SubmitError) -> bool {
                false
            }
        }
        let rt = Runtime::new().unwrap();
        let (qp, fake) = fake_qp();
        let next = Rc::new(std::cell::RefCell::new(None));
        // SAFETY: no SGE: the WR lends no memory (and the fake touches none).
        let mut op = unsafe {
            qp.submit_send_one(Chain(qp.clone(), next.clone()), |_, wr| {
                wr.op = SendOp::Write {
                    remote_addr: 0x1000,
                    rkey: 1,
                };
                Ok(())
            })
        };
        assert!(poll(&mut op, Waker::noop()).is_pending());
        fake.complete_send(WcStatus::Success, 0).unwrap();
        settle(&rt);
        assert_eq!(poll(&mut op, Waker::noop()), Poll::Ready(true));
        let mut second = next.borrow_mut().take().expect("submitted from complete");
        assert!(second.wr_id().is_some(), "posted at once");
        fake.complete_send(WcStatus::Success, 0).unwrap();
        settle(&rt);
        assert!(poll(&mut second, Waker::noop()).is_ready());
        assert_eq!(rt.ops_in_slab(), 0);
    }

    /// Completions of ops whose task is already queued skip its waker (one
    /// flag load): the task is still polled once, and sees every result.
    #[test]
    fn completions_for_an_already_queued_task_wake_it_once() {
        let rt = Runtime::new().unwrap();
        let (qp, fake) = fake_qp();
        let polls = Rc::new(Cell::new(0u32));
        let done = Rc::new(Cell::new(0u32));
        let (p, d) = (polls.clone(), done.clone());
        let mut ops: Vec<Submit<Bare>> = (0..3).map(|_| write(&qp)).collect();
        let task = rt.spawn(async move {
            std::future::poll_fn(|cx| {
                p.set(p.get() + 1);
                ops.retain_mut(|op| match std::pin::Pin::new(op).poll(cx) {
                    Poll::Ready(out) => {
                        assert!(out.unwrap().status.is_success());
                        d.set(d.get() + 1);
                        false
                    }
                    Poll::Pending => true,
                });
                if ops.is_empty() {
                    Poll::Ready(())
                } else {
                    Poll::Pending
                }
            })
            .await;
        });
        settle(&rt);
        assert_eq!(polls.get(), 1);
        for _ in 0..3 {
            fake.complete_send(WcStatus::Success, 0).unwrap();
        }
        settle(&rt);
        assert_eq!(done.get(), 3, "every completion reached the task");
        assert_eq!(polls.get(), 2, "woken once for the three completions");
        assert!(task.is_finished());
        let (_c, w) = counter();
        assert!(
            !crate::reactor::wake_if_task(&w),
            "a foreign waker is left alone"
        );
    }

    #[test]
    fn a_reused_slot_never_wakes_the_task_of_its_previous_op() {
        let rt = Runtime::new().unwrap();
        let (qp, fake) = fake_qp();
        let first = write(&qp);
        let first_key = first.wr_id().unwrap() & KEY_MASK;
        let polls = Rc::new(Cell::new(0u32));
        let gate = Rc::new(Cell::new(false));
        let (p, g) = (polls.clone(), gate.clone());
        let task = rt.spawn(async move {
            first.await.unwrap();
            // Stays alive (and countable) after its op: polled only if woken.
            std::future::poll_fn(|_| {
                p.set(p.get() + 1);
                if g.get() {
                    Poll::Ready(())
                } else {
                    Poll::Pending
                }
            })
            .await;
        });
        settle(&rt);
        fake.complete_send(WcStatus::Success, 0).unwrap();
        settle(&rt);
        assert_eq!(polls.get(), 1, "the task ran past its op");
        assert_eq!(rt.ops_in_slab(), 0);
        // The slot still caches the task's waker; a new op in it, never
        // polled, completes without waking that task.
        let second = write(&qp);
        assert_eq!(second.wr_id().unwrap() & KEY_MASK, first_key, "slot reused");
        fake.complete_send(WcStatus::Success, 0).unwrap();
        settle(&rt);
        assert_eq!(polls.get(), 1, "the previous op's task was woken");
        // Polled by another waiter (a foreign waker), it wakes that one.
        let mut third = write(&qp);
        let (c, w) = counter();
        assert!(poll(&mut third, &w).is_pending());
        fake.complete_send(WcStatus::Success, 0).unwrap();
        settle(&rt);
        assert_eq!(c.0.load(Ordering::SeqCst), 1);
        assert_eq!(polls.get(), 1);
        assert!(poll(&mut third, &w).is_ready());
        let mut second = second;
        assert!(poll(&mut second, Waker::noop()).is_ready());
        assert!(!task.is_finished());
    }

    /// Refused submissions (by the checks, or by the provider's post) are
    /// built as ops of their own before they have a slot: giving their data
    /// back must not touch any live slot (slot 0 here).
    #[test]
    fn refused_submissions_leave_live_slots_alone() {
        let rt = Runtime::new().unwrap();
        let (qp, fake) = fake_qp();
        let mut live = write(&qp);
        assert_eq!(live.wr_id().unwrap() & KEY_MASK, 0);
        assert!(poll(&mut live, Waker::noop()).is_pending());
        // SAFETY: no SGE names memory (`Sge::default` has length 0 and
        // lkey 0), and the QP is a fake.
        let mut refused = unsafe {
            qp.submit_send_one(Bare, |_, wr| {
                for _ in 0..5 {
                    wr.sg_list.push(crate::provider::Sge::default());
                }
                Ok(())
            })
        };
        let Poll::Ready(r) = poll(&mut refused, Waker::noop()) else {
            panic!("a refused submission is ready at once")
        };
        assert!(r.unwrap_err().contains("SGEs"));
        drop(refused);
        fake.fail_next_post(
            0,
            crate::provider::ProviderError::Unsupported {
                provider: "fake",
                what: "test",
            },
        );
        let mut failed = write(&qp);
        assert!(failed.wr_id().is_none());
        assert!(poll(&mut failed, Waker::noop()).is_ready());
        drop(failed);
        assert_eq!(rt.ops_in_slab(), 1);
        assert_eq!(qp.outstanding_sends(), 1);
        fake.complete_send(WcStatus::Success, 0).unwrap();
        settle(&rt);
        assert!(poll(&mut live, Waker::noop()).is_ready());
        assert_eq!(rt.ops_in_slab(), 0);
        assert_eq!(rt.handle().stale_completions(), 0);
    }

    #[test]
    fn a_completion_for_a_freed_slot_is_stale() {
        let rt = Runtime::new().unwrap();
        let (qp, fake) = fake_qp();
        let mut op = write(&qp);
        let id = op.wr_id().unwrap();
        fake.complete_send(WcStatus::Success, 0).unwrap();
        settle(&rt);
        assert!(poll(&mut op, Waker::noop()).is_ready());
        assert_eq!(rt.ops_in_slab(), 0);
        // The slot is free (same generation as the late completion's).
        rt.handle().inject_completion(Completion {
            wr_id: id,
            status: WcStatus::Success,
            ..Completion::EMPTY
        });
        settle(&rt);
        assert_eq!(rt.handle().stale_completions(), 1);
        assert_eq!(rt.ops_in_slab(), 0);
        assert_eq!(qp.outstanding_sends(), 0);
    }

    #[test]
    fn ops_of_many_tasks_wake_each_their_own() {
        let rt = Runtime::new().unwrap();
        let (qp, fake) = fake_qp();
        let done = Rc::new(Cell::new(0u32));
        // Rounds of four tasks, each awaiting one op: every round, the
        // slots (and the wakers they cache) are reused by new tasks.
        for round in 0..4 {
            let mut tasks = Vec::new();
            for _ in 0..4 {
                let op = write(&qp);
                let d = done.clone();
                tasks.push(rt.spawn(async move {
                    op.await.unwrap();
                    d.set(d.get() + 1);
                }));
            }
            settle(&rt);
            for i in 0..4 {
                fake.complete_send(WcStatus::Success, 0).unwrap();
                settle(&rt);
                assert_eq!(done.get(), round * 4 + i + 1);
            }
            assert!(tasks.iter().all(|t| t.is_finished()));
        }
        assert_eq!(rt.ops_in_slab(), 0);
    }
}
