//! [`OpTable`]: the slab of in-flight ops, keyed by wr_id.

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

use super::counters::Counters;
use super::entries::{HeldEntries, QpEntries};
use super::{wr_id, SubmitError};
use crate::provider::Completion;

/// The rare part of a slot (allocated only on an error path).
#[derive(Default)]
struct SlotErrors {
    /// First error completion of an earlier (unsignaled) WR of the chain.
    first_error: Option<Completion>,
    /// Set when only part of the chain was posted.
    post_error: Option<Box<SubmitError>>,
}

/// Where an op's slot is in its life: `Submitted` when posted, `Waiting`
/// once its future was polled (the waker is kept), then `Completed` when its
/// completion arrives, until the future collects it and frees the slot. An
/// op future dropped in flight leaves its data parked in the slot
/// (`Ignored`) until the completion or flush arrives, then the data is
/// dropped.
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
    /// The wr_id whose completion ends the op on the fast path of
    /// [`OpTable::complete_all`]: its last WR's, while it is in flight
    /// (`Submitted` or `Waiting`) with no error recorded; else
    /// [`NO_MATCH`]. One compare stands for the checks of key,
    /// generation, chain index, state and errors.
    expect: u64,
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
    /// The entry pools of the QP of the slot's latest op. Kept when the
    /// slot is freed and reused, as the waker is: the next op in it is
    /// mostly of the same QP, and then takes no reference count.
    pools: Option<Rc<QpEntries>>,
    /// Entries held on `pools` (its send or receive side, see `held_recv`)
    /// from the post until the last completion; 0 once given back.
    held_n: u32,
    held_recv: bool,
    /// What went wrong besides the last completion: boxed, it is rare.
    errors: Option<Box<SlotErrors>>,
    /// The data of an op dropped in flight (`Ignored`).
    parked: Option<Box<dyn Any>>,
}

/// End of the free list.
const NO_SLOT: u32 = u32::MAX;

/// [`Slot::expect`] of a slot no completion finishes on the fast path
/// (reserved wr_ids never reach the table).
const NO_MATCH: u64 = u64::MAX;

impl Slot {
    /// Takes the entries the slot holds, as a [`HeldEntries`] to give back.
    fn take_held(&mut self) -> Option<HeldEntries> {
        let n = std::mem::take(&mut self.held_n);
        if n == 0 {
            return None;
        }
        self.pools.clone().map(|pools| HeldEntries {
            pools,
            recv: self.held_recv,
            n,
        })
    }
}

/// The slots and their free list.
struct Slots {
    slots: Vec<Slot>,
    /// First free slot, [`NO_SLOT`] if none.
    free: u32,
    /// Slots in use.
    live: usize,
    /// Ops inserted so far ([`OpTable::submitted`]): counted here, under
    /// the insert's borrow, not through the shared counters.
    submitted: u64,
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
        slot.expect = NO_MATCH;
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
    /// Shared with the reactor and the QPs (see [`Counters`]).
    pub(crate) counters: Rc<Counters>,
}

impl OpTable {
    pub(crate) fn with_capacity(n: usize) -> OpTable {
        OpTable {
            table: RefCell::new(Slots {
                slots: Vec::with_capacity(n.min(wr_id::MAX_OPS)),
                free: NO_SLOT,
                live: 0,
                submitted: 0,
            }),
            next_gen: Cell::new(1),
            shut_down: Cell::new(false),
            graveyard: RefCell::new(Vec::new()),
            has_dead: Cell::new(false),
            stale: Cell::new(0),
            counters: Rc::new(Counters::default()),
        }
    }

    /// Reserves a slot before posting; returns the wr_id of the op's first
    /// WR (index 0: its key and generation). The slot holds `n` entries of
    /// `pools` (its send side, or with `recv` its receive side), which the
    /// caller has taken, from now on until the op's last completion;
    /// `None` (the table is full, nothing held) leaves them to the caller.
    #[inline(always)]
    pub(crate) fn insert(
        &self,
        last_index: u16,
        pools: &Rc<QpEntries>,
        recv: bool,
        n: u32,
    ) -> Option<u64> {
        let mut t = self.table.borrow_mut();
        let gen = self.next_gen.get();
        let next = wr_id::next_gen(gen);
        let key = t.free as usize;
        if let Some(slot) = t.slots.get_mut(key) {
            let next_free = slot.next_free;
            // `key` is a slot's (below MAX_OPS), `gen` a generation (at most
            // GEN_MASK): no masking needed.
            let first = key as u64 | u64::from(gen) << wr_id::GEN_SHIFT;
            slot.expect = wr_id::with_index(first, last_index);
            slot.gen = gen;
            slot.state = State::Submitted;
            slot.last_index = last_index;
            slot.held_n = n;
            slot.held_recv = recv;
            // The common case: the slot's last op was of the same QP.
            let old = match &slot.pools {
                Some(p) if Rc::ptr_eq(p, pools) => None,
                _ => slot.pools.replace(pools.clone()),
            };
            t.free = next_free;
            t.live += 1;
            t.submitted += 1;
            self.next_gen.set(next);
            drop(t);
            drop(old);
            return Some(first);
        }
        drop(t);
        self.insert_new(gen, next, last_index, pools, recv, n)
    }

    /// [`insert`](Self::insert) with no free slot: the table grows.
    #[cold]
    #[inline(never)]
    fn insert_new(
        &self,
        gen: u32,
        next: u32,
        last_index: u16,
        pools: &Rc<QpEntries>,
        recv: bool,
        n: u32,
    ) -> Option<u64> {
        let mut t = self.table.borrow_mut();
        let key = t.slots.len();
        if key >= wr_id::MAX_OPS {
            return None;
        }
        t.slots.push(Slot {
            expect: wr_id::encode(key, gen, last_index),
            gen,
            state: State::Submitted,
            last_index,
            next_free: NO_SLOT,
            waker: None,
            completion: Completion::EMPTY,
            pools: Some(pools.clone()),
            held_n: n,
            held_recv: recv,
            errors: None,
            parked: None,
        });
        t.live += 1;
        t.submitted += 1;
        self.next_gen.set(next);
        Some(wr_id::encode(key, gen, 0))
    }

    /// Frees a slot whose post failed entirely; returns its entry.
    pub(crate) fn remove_unposted(&self, key: usize) -> Option<HeldEntries> {
        let mut t = self.table.borrow_mut();
        let slot = t.live_mut(key)?;
        let entry = slot.take_held();
        let errors = slot.errors.take();
        t.release(key);
        drop(t);
        drop(errors);
        Counters::bump(&self.counters.ops_failed);
        entry
    }

    /// The deferred post of op `key` (generation `gen`) was refused: none
    /// of its WRs reached the queue. Its entries go back, except `absorbed`
    /// of them (inline sends' entries it took over, which the QP holds
    /// again), and the op ends with `error`: its future resolves with it,
    /// or, if it was dropped, its parked data is freed.
    pub(crate) fn fail_unposted(&self, key: usize, gen: u32, absorbed: u32, error: SubmitError) {
        let mut t = self.table.borrow_mut();
        let Some(slot) = t.live_mut(key).filter(|s| s.gen == gen) else {
            tracing::error!(key, "refused deferred post of an unknown op");
            return;
        };
        let mut entry = slot.take_held();
        if let Some(c) = &mut entry {
            c.n -= absorbed.min(c.n);
        }
        Counters::bump(&self.counters.ops_failed);
        match slot.state {
            State::Submitted | State::Waiting => {
                let waiting = slot.state == State::Waiting;
                slot.state = State::Completed;
                slot.expect = NO_MATCH;
                slot.errors.get_or_insert_with(Default::default).post_error = Some(Box::new(error));
                self.wake_completed(t, key, waiting, entry);
            }
            State::Ignored => self.free_ignored(t, key, entry),
            State::Completed | State::Free => {}
        }
    }

    /// Only `posted` WRs of the chain reached the queue: the op now ends with
    /// the flush of the last of them and reports `error`.
    pub(crate) fn set_partial(&self, key: usize, posted: usize, error: SubmitError) {
        if let Some(slot) = self.table.borrow_mut().live_mut(key) {
            slot.last_index = (posted - 1) as u16;
            slot.expect = NO_MATCH;
            slot.errors.get_or_insert_with(Default::default).post_error = Some(Box::new(error));
        }
    }

    /// Ops inserted so far.
    pub(crate) fn submitted(&self) -> u64 {
        self.table.borrow().submitted
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

    /// True if op `key`'s completion has arrived (a poll would return
    /// `Ready` without looking at its waker).
    pub(crate) fn is_completed(&self, key: usize) -> bool {
        self.table
            .borrow()
            .slots
            .get(key)
            .is_some_and(|s| s.state == State::Completed)
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
        // Tests in the order of the common polls (no jump table: the two
        // common states alternate at one branch).
        if slot.state == State::Completed {
            let c = slot.completion;
            if slot.errors.is_some() {
                drop(t);
                return Poll::Ready(done(c, self.take_post_error(key)));
            }
            t.release(key);
            drop(t);
            return Poll::Ready(done(c, None));
        }
        if !matches!(slot.state, State::Submitted | State::Waiting) {
            // Ignored (dropped) or free.
            drop(t);
            return Self::polled_without_slot(key);
        }
        slot.state = State::Waiting;
        match &slot.waker {
            Some(w) if w.will_wake(cx.waker()) => Poll::Pending,
            _ => {
                // The old waker is dropped outside the borrow (a foreign
                // waker's drop may run any code).
                let old = slot.waker.replace(cx.waker().clone());
                drop(t);
                drop(old);
                Poll::Pending
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
                slot.expect = NO_MATCH;
                slot.parked = Some(Box::new(data));
            }
            State::Ignored | State::Free => {
                tracing::error!(key, "op dropped twice");
                drop(t);
                std::mem::forget(data);
            }
        }
    }

    /// Routes completions of tracked wr_ids to their slots. Wakers are woken
    /// and parked data is queued in the graveyard, never dropped in here.
    ///
    /// The common case inline: the last WR of a chain without earlier
    /// errors, for an op still in flight. Everything else (stale, earlier
    /// WR of a chain, error bookkeeping, parked data, duplicates) goes to
    /// [`complete_slow`](Self::complete_slow).
    ///
    /// Each of `cs` in order, under one borrow of the table as long as no
    /// foreign code runs: it is released (and taken again) around the slow
    /// path, a foreign waker's wake, and `reserved`, which gets the
    /// completions of reserved wr_ids (they never touch the table).
    #[inline(always)]
    pub(crate) fn complete_all(&self, cs: &[Completion], mut reserved: impl FnMut(&Completion)) {
        // The entries of the ops completed on the fast path, given back
        // together: a run of completions of one QP's send side (the common
        // batch) adds to one count, released once a completion of another
        // pool comes or the batch ends (no borrow held: a release may wake).
        // Nothing runs on the op path in between that could take them.
        let mut pend: Option<HeldEntries> = None;
        let mut t = self.table.borrow_mut();
        for c in cs {
            if c.wr_id & wr_id::RESERVED != 0 {
                drop(t);
                reserved(c);
                t = self.table.borrow_mut();
                continue;
            }
            let key = (c.wr_id & wr_id::KEY_MASK) as usize;
            let Some(slot) = t.slots.get_mut(key).filter(|s| s.expect == c.wr_id) else {
                drop(t);
                self.complete_slow(c);
                t = self.table.borrow_mut();
                continue;
            };
            // `expect` matched: in flight, no error so far, the chain's
            // last WR.
            let waiting = slot.state == State::Waiting;
            // SAFETY: both are valid `Completion`s (plain data) and cannot
            // overlap: `c` is shared, `slot` exclusively borrowed. (A field
            // by field assignment is staged through the stack.)
            unsafe { std::ptr::copy_nonoverlapping(c, &mut slot.completion, 1) };
            slot.state = State::Completed;
            slot.expect = NO_MATCH;
            self.count_completion(c);
            let n = std::mem::take(&mut slot.held_n);
            let mut flush = None;
            if n > 0 {
                match (&mut pend, &slot.pools) {
                    (Some(p), Some(pools))
                        if p.recv == slot.held_recv && Rc::ptr_eq(&p.pools, pools) =>
                    {
                        p.n += n;
                    }
                    (_, Some(pools)) => {
                        flush = pend.replace(HeldEntries {
                            pools: pools.clone(),
                            recv: slot.held_recv,
                            n,
                        });
                    }
                    (_, None) => {}
                }
            }
            if waiting {
                if let Some(w) = Self::wake_in_place(&mut slot.waker) {
                    drop(t);
                    self.wake_foreign(key, w);
                    t = self.table.borrow_mut();
                }
            }
            if flush.is_some() {
                drop(t);
                drop(flush);
                t = self.table.borrow_mut();
            }
        }
        drop(t);
        drop(pend);
    }

    /// Counts an op's failed completion (every completion is counted by
    /// the reactor, per drain).
    #[inline(always)]
    fn count_completion(&self, c: &Completion) {
        if !c.status.is_success() {
            Counters::bump(&self.counters.ops_failed);
        }
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
            Some(w) if crate::wake::wake_if_task(w) => None,
            w => w.take(),
        }
    }

    /// [`complete_all`](Self::complete_all) outside its common case.
    #[cold]
    #[inline(never)]
    fn complete_slow(&self, c: &Completion) {
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
                slot.expect = NO_MATCH;
                slot.errors.get_or_insert_with(Default::default).first_error = Some(*c);
            } else if c.status.is_success() {
                tracing::debug!(wr_id = c.wr_id, "completion of an unsignaled WR");
            }
            return;
        }
        let effective = slot
            .errors
            .as_mut()
            .and_then(|e| e.first_error.take())
            .unwrap_or(*c);
        if matches!(
            slot.state,
            State::Submitted | State::Waiting | State::Ignored
        ) {
            self.count_completion(&effective);
        }
        match slot.state {
            State::Submitted | State::Waiting => {
                let waiting = slot.state == State::Waiting;
                slot.completion = effective;
                slot.state = State::Completed;
                slot.expect = NO_MATCH;
                let entry = slot.take_held();
                self.wake_completed(t, key, waiting, entry);
            }
            State::Ignored => {
                let entry = slot.take_held();
                self.free_ignored(t, key, entry);
            }
            State::Completed | State::Free => {
                tracing::warn!(wr_id = c.wr_id, "duplicate completion ignored");
            }
        }
    }

    /// Slot `key` just became `Completed`: wakes its waiter if it was
    /// `waiting` (a foreign waker once the borrow `t` is released), then
    /// gives `entry` back.
    #[inline(never)]
    fn wake_completed(
        &self,
        mut t: std::cell::RefMut<'_, Slots>,
        key: usize,
        waiting: bool,
        entry: Option<HeldEntries>,
    ) {
        let foreign = if waiting {
            Self::wake_in_place(&mut t.slots[key].waker)
        } else {
            None
        };
        drop(t);
        drop(entry);
        if let Some(w) = foreign {
            self.wake_foreign(key, w);
        }
    }

    /// Frees slot `key` of an op dropped in flight (`Ignored`) that the
    /// device is done with: its parked data goes to the graveyard (dropped
    /// after the drain, outside every borrow), `entry` back.
    fn free_ignored(
        &self,
        mut t: std::cell::RefMut<'_, Slots>,
        key: usize,
        entry: Option<HeldEntries>,
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
        drop(entry);
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
            // The entries stay taken: the QP is leaked too.
            slot.held_n = 0;
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
