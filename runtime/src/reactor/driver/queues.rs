//! The queue pairs and receive rings registered with the reactor as
//! [`WorkQueue`]s: routing the completions of reserved wr_ids to them, the
//! poll phase whose end they hear, and their draining and shutdown.

use std::cell::RefCell;
use std::rc::Rc;

use slab::Slab;

use super::Driver;
use crate::op::wr_id;
use crate::provider::Completion;
use crate::reactor::WorkQueue;

impl Driver {
    /// A completion of a reserved wr_id: an inline send's, the agent's, or
    /// an untracked WR's. (An op's goes to the op table: `cqs.rs` hands
    /// each polled batch to `OpTable::complete_all`, which passes these
    /// on.)
    #[inline(never)]
    pub(super) fn complete_reserved(&self, c: &Completion) {
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
    /// (Called directly for a poll that returned one ring completion.)
    #[inline(never)]
    pub(super) fn complete_ring(&self, c: &Completion) {
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
        leak_lent(&self.rings)
    }

    /// Some submission waits for CQ entries: every QP gives back those it
    /// holds without need ([`WorkQueue::release_hoarded`]).
    pub(crate) fn release_hoarded_entries(&self) {
        let all: Vec<Rc<dyn WorkQueue>> =
            self.qps.borrow().iter().map(|(_, q)| q.clone()).collect();
        for q in all {
            q.release_hoarded();
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
    pub(super) fn forget_drained(&self) {
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

    /// Shutdown, first step: whether some registered QP still has send work
    /// requests on their way ([`WorkQueue::sends_in_flight`], which also
    /// posts what the QPs held back).
    pub(crate) fn sends_in_flight(&self) -> bool {
        self.end_batch();
        let all: Vec<Rc<dyn WorkQueue>> =
            self.qps.borrow().iter().map(|(_, q)| q.clone()).collect();
        let mut any = false;
        for q in all {
            any |= q.sends_in_flight(&self.ops);
        }
        any
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
        leak_lent(&self.qps)
    }
}

/// Shutdown: empties `queues`, leaking those that still lend buffers to the
/// device (it may still write them) and dropping the others. Returns how
/// many leaked.
fn leak_lent(queues: &RefCell<Slab<Rc<dyn WorkQueue>>>) -> usize {
    let all: Vec<Rc<dyn WorkQueue>> = queues.borrow_mut().drain().collect();
    let mut leaked = 0;
    for q in all {
        if q.lent() > 0 {
            leaked += 1;
            std::mem::forget(q);
        }
    }
    leaked
}
