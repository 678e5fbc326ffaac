//! Doorbell batching: single-WR send ops submitted while the runtime polls
//! its tasks (or the `block_on` future) are not posted one by one. Their
//! WRs wait in their QP's deferred list and go out as one post list (one
//! `ibv_post_send`, one doorbell; on the soft device one lock of the QP and
//! one wake of the engine) when the poll phase ends, before the reactor
//! polls its CQs or sleeps, or as soon as [`DEFER_MAX`] of them wait. This is io_uring's submission batching applied
//! to verbs. It is a per-QP setting (`QueuePair::set_doorbell_batching`),
//! on by default on the software device only (see `batching_by_default`).
//!
//! The op is in flight from its submission: its data is in its op slot
//! (parked if the future is dropped), its entries are taken, so nothing
//! changes for its owner but the moment of the doorbell. Send-queue order
//! is kept: any other post to the same send queue (a chain, an inline send,
//! a single op outside a poll phase, the close) posts the deferred WRs
//! first. If the provider refuses the list, the refused WR's op fails with
//! its `PostError`, the ops after it with [`SubmitError::PostBatchAborted`]
//! (their WRs were never looked at), and their entries come back; the WRs
//! before it are posted.

use std::cell::RefMut;

use super::core::Ordered;
use super::submit::OneWr;
use super::QpCore;
use crate::op::{wr_id, OpTable, SubmitError};
use crate::provider::{PostError, SendWr};

/// Most WRs a QP's deferred list holds: the eighth goes out with the seven
/// before it at once, without waiting for the end of the phase. Measured
/// with `op_overhead` (64-byte WRITEs, depth 32, one soft device) and
/// `perf write_bw --size 64 --depth 32` (two soft devices), side by side:
/// unbounded lists (one per phase) made the device wait for the whole
/// phase, and with wake-ups as slow as this VM's idle vCPUs (tens of µs)
/// the op loop halved (0.46-0.51x the raw loop, was 0.93-0.95x without
/// batching); lists of up to 8 keep the device busy while the phase goes
/// on (1.07x, and 0.56 M/s where unbatched posts gave 0.30 M/s); with fast
/// wake-ups both bounds did alike (overhead 47-56 ns, was 69-83 ns).
pub(crate) const DEFER_MAX: usize = 8;

/// A QP's send WRs waiting for the end of the poll phase.
#[derive(Default)]
pub(crate) struct Deferred {
    pub(crate) wrs: Vec<SendWr>,
    /// Inline-send entries the first WR took over (see
    /// `QpCore::order_deferred`). Only the first can have any: an inline
    /// send posts the deferred WRs before itself, so after the first
    /// deferred WR took them no unsignaled sends are pending until the list
    /// is posted.
    pub(crate) absorbed: u32,
}

/// Room for a full list (the first deferral, or after a refused list).
#[cold]
#[inline(never)]
fn grow(wrs: &mut Vec<SendWr>) {
    wrs.reserve(DEFER_MAX);
}

impl QpCore {
    /// Queues the single WR `wr` with `wr_id` (an op already in the table,
    /// its entries held, the `ordered` ones it absorbed among them) to be
    /// posted at the end of the poll phase: written once, straight into
    /// the list. The caller has listed the QP for the phase's end. True
    /// once [`DEFER_MAX`] WRs wait: the caller posts them now.
    #[inline(always)]
    pub(crate) fn defer_one(&self, ordered: Ordered, wr: &OneWr, wr_id: u64) -> bool {
        let (mut d, len) = self.deferred_with_room(ordered.absorbed);
        // SAFETY: `len < capacity` (just ensured): slot `len` is allocated and unused; it is written, then counted.
        unsafe {
            std::ptr::write(d.wrs.as_mut_ptr().add(len), wr.send_wr(wr_id));
            d.wrs.set_len(len + 1);
        }
        len + 1 >= DEFER_MAX
    }

    /// The deferred list with room for one more WR, and its length (the
    /// first WR of a list records the entries `absorbed` into the post).
    #[inline(always)]
    fn deferred_with_room(&self, absorbed: u32) -> (RefMut<'_, Deferred>, usize) {
        let mut d = self.deferred.borrow_mut();
        let len = d.wrs.len();
        if len == 0 {
            d.absorbed = absorbed;
        }
        if len == d.wrs.capacity() {
            grow(&mut d.wrs);
        }
        (d, len)
    }

    /// True if WRs wait in the deferred list.
    #[inline(always)]
    pub(crate) fn has_deferred(&self) -> bool {
        !self.deferred.borrow().wrs.is_empty()
    }

    /// Posts the deferred WRs, if any, as one list; fails the ops of those
    /// the provider refused (see the module docs).
    #[inline]
    pub(crate) fn flush_deferred(&self, ops: &OpTable) {
        if self.has_deferred() {
            self.post_deferred(ops);
        }
    }

    #[inline(never)]
    fn post_deferred(&self, ops: &OpTable) {
        let mut d = self.deferred.borrow_mut();
        // SAFETY: every deferred WR was built by `QueuePair::submit` under
        // the contract of `submit_send` for the data of an op already in
        // the op table (in flight, or parked if its future was dropped),
        // which keeps that memory until the WR's completion or flush has
        // been polled; the provider's post contract holds for each.
        let res = unsafe { self.post_send_unordered(&d.wrs) };
        let absorbed = std::mem::take(&mut d.absorbed);
        match res {
            Ok(()) => d.wrs.clear(),
            Err(e) => {
                let wrs = std::mem::take(&mut d.wrs);
                // No borrow while ops are failed: their wakers may run
                // foreign code that submits again on this QP.
                drop(d);
                self.deferred_post_failed(ops, &wrs, absorbed, e);
                let mut d = self.deferred.borrow_mut();
                if d.wrs.is_empty() {
                    // Keep the allocation.
                    let mut wrs = wrs;
                    wrs.clear();
                    d.wrs = wrs;
                }
            }
        }
    }

    /// The provider took only `e.posted` WRs of the deferred list.
    #[cold]
    #[inline(never)]
    fn deferred_post_failed(&self, ops: &OpTable, wrs: &[SendWr], absorbed: u32, e: PostError) {
        let posted = e.posted.min(wrs.len());
        tracing::warn!(
            qp = self.qp_num,
            posted,
            refused = wrs.len() - posted,
            error = %crate::report::ErrorChain(&e),
            "deferred post list refused"
        );
        let reason = e.to_string();
        let mut first = Some(e);
        for (i, wr) in wrs.iter().enumerate().skip(posted) {
            let (key, gen, _) = wr_id::decode(wr.wr_id);
            let error = match first.take() {
                Some(source) => SubmitError::Post {
                    qp_num: self.qp_num,
                    source,
                },
                None => SubmitError::PostBatchAborted {
                    qp_num: self.qp_num,
                    wr_id: wr.wr_id,
                    reason: reason.clone(),
                },
            };
            let taken = if i == 0 { absorbed } else { 0 };
            ops.fail_unposted(key, gen, taken, error);
            if taken > 0 {
                // The inline sends' entries stay held, by the QP again.
                self.unabsorb(taken);
            }
        }
    }
}
