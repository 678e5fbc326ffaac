//! [`QpCore`]: the part of a queue pair the reactor keeps until every work
//! request of it has completed, and its policy as a [`WorkQueue`].

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use super::deferred;
use super::InlineFault;
use crate::op::{Counters, OpTable, QpEntries};
use crate::provider::{Completion, PostError, ProviderError, Qp, RecvWr, SendOp, SendWr};
use crate::reactor::{CqClaim, WorkQueue};

/// The part of a QP the reactor keeps until every WR of it has completed,
/// even after the last `QueuePair` handle is gone (then it is a zombie: in
/// ERR, waiting for its flushes).
pub(crate) struct QpCore {
    /// The provider QP work is posted to.
    pub(crate) qp: Qp,
    pub(crate) qp_num: u32,
    /// Its queues' and CQs' entry pools (shared with its ops' entries).
    pub(crate) entries: Rc<QpEntries>,
    /// The runtime's counters (doorbells and post lists are counted here).
    pub(crate) counters: Rc<Counters>,
    pub(crate) closed: Cell<bool>,
    /// The last `QueuePair` handle is gone.
    pub(crate) dropped: Cell<bool>,
    /// Keeps the CQ registered while WRs are outstanding.
    pub(crate) _cq: Option<CqClaim>,
    /// This QP's key in the reactor's QP registry (named by inline wr_ids).
    pub(crate) reg_key: Cell<usize>,
    /// Send-queue and CQ entries (each) held by the unsignaled inline sends
    /// posted since the last signaled send WR, plus one reserve entry for
    /// the WR that retires them; 0 if there are none.
    ///
    /// # Invariant
    ///
    /// Nonzero only while the last WR posted to the send queue was an
    /// unsignaled inline send: every signaled send post takes these entries
    /// over (they come back with its completion, which by RC ordering
    /// implies the unsignaled WRs' completion).
    pub(crate) unsig: Cell<u32>,
    /// Send-queue entries held by inline sends (those of `unsig`, and those
    /// carried by posted signaled inline WRs not completed yet). They lend
    /// no memory to the device: a QP holding only these is not leaked at
    /// runtime shutdown.
    pub(crate) inline_entries: Cell<u32>,
    /// At most `signal_every - 1` inline sends in a row go unsignaled.
    pub(crate) signal_every: Cell<u32>,
    /// The first error completion of an inline send posted without an op.
    pub(crate) fault: Cell<Option<InlineFault>>,
    /// A single send WR of at most one SGE passes its submission checks
    /// with no other look (`QueuePair::check_one`): the QP is not closed,
    /// has no inline fault, and takes a chain of one with one SGE. Cleared
    /// when the QP closes or faults.
    pub(crate) sends_ok: Cell<bool>,
    /// Receive-queue and receive-CQ entries (each) that this QP's receive
    /// rings keep between a buffer's completion and its repost (so the
    /// repost needs no acquire). Given back by [`shut`](Self::shut): a
    /// closing QP waits only for its posted receives.
    pub(crate) ring_kept: Cell<u32>,
    /// Single send WRs submitted during the current poll phase, posted as
    /// one list when it ends (`deferred.rs`).
    pub(crate) deferred: RefCell<deferred::Deferred>,
    /// Doorbell batching is on for this QP (see
    /// [`QueuePair::set_doorbell_batching`]).
    pub(crate) batch_posts: Cell<bool>,
    /// Listed for the end of the current poll phase (`deferred.rs`): set
    /// only in a phase with `batch_posts` on, cleared at the phase's end
    /// and when `batch_posts` is turned off.
    pub(crate) listed_in_phase: Cell<bool>,
    /// The operation of the zero-length WR that retires unsignaled inline
    /// sends (`inline.rs`): an RDMA WRITE on RC, a refused datagram to
    /// itself on UD (`ud.rs`); `None` while a UD QP has none yet.
    pub(crate) retire_op: Cell<Option<SendOp>>,
    /// The WR list of an inline burst (`inline_burst.rs`), kept for reuse.
    pub(crate) burst_wrs: Cell<Vec<SendWr>>,
    /// The SRQ a QP made by `Device::create_qp_on_srq` takes its receives
    /// from: held until the QP is destroyed (declared after `qp`), so that
    /// the SRQ's dropped rings are freed only once no QP can receive into
    /// them (see `srq_ring.rs`).
    pub(crate) srq: std::cell::OnceCell<super::SharedRecvQueue>,
}

/// A send post put in order by [`QpCore::order_sends`] (or, for a single WR
/// that waits for the poll phase's doorbell, [`QpCore::order_deferred`]):
/// the only way to [`QpCore::post_sends`] or [`QpCore::defer_one`], so the
/// compiler checks that every send post went through the steps of the one
/// ordered post (flush, absorb) before its own (post, count).
#[must_use = "an ordered post that is not posted gives its absorbed entries back (QpCore::unabsorb)"]
pub(crate) struct Ordered {
    /// The send-queue and CQ entries (each) of the unsignaled inline sends
    /// before this post that its signaled WR takes over (0 if none, or if
    /// the post absorbs nothing). The caller puts them where the WR's
    /// completion gives them back: its op's entry, or the entries an
    /// inline wr_id carries. If nothing is posted, they go back to the QP
    /// ([`QpCore::unabsorb`]).
    pub(crate) absorbed: u32,
}

impl QpCore {
    /// The one ordered post of send WRs, steps 1 and 2 (every send path
    /// takes them: single WRs and chains in `submit.rs`, inline sends in
    /// `inline.rs`, inline bursts in `inline_burst.rs`):
    ///
    /// 1. **flush**: the single WRs waiting for the poll phase's doorbell
    ///    are posted first, so the send queue keeps submission order;
    /// 2. **absorb** (with `absorb`, for a post whose last WR is signaled
    ///    and carries the entries of the unsignaled inline sends before
    ///    it): those entries are taken over ([`Ordered::absorbed`]), as
    ///    its completion implies theirs.
    ///
    /// Steps 3 and 4 are [`post_sends`](Self::post_sends). In between, the
    /// caller gives its WRs their wr_ids, which may carry the absorbed
    /// entries (an op's slot in the table holds them, or an inline wr_id).
    /// An inline send absorbs nothing here: whether it is signaled depends
    /// on the unsignaled group it reads after the flush.
    #[inline(always)]
    pub(crate) fn order_sends(&self, ops: &OpTable, absorb: bool) -> Ordered {
        self.flush_deferred(ops);
        Ordered {
            absorbed: if absorb { self.absorb_unsignaled() } else { 0 },
        }
    }

    /// A signaled send post takes over the unsignaled inline sends' entries
    /// (from the QP's inline entries into the post's).
    #[inline(always)]
    fn absorb_unsignaled(&self) -> u32 {
        let n = self.unsig.get();
        if n != 0 {
            self.unsig.set(0);
            self.inline_entries.set(self.inline_entries.get() - n);
        }
        n
    }

    /// [`order_sends`](Self::order_sends) of a single signaled WR that
    /// joins the deferred list ([`defer_one`](Self::defer_one)) instead of
    /// being posted now: the list keeps the order, so there is nothing to
    /// flush; the unsignaled inline sends are absorbed.
    #[inline(always)]
    pub(crate) fn order_deferred(&self) -> Ordered {
        Ordered {
            absorbed: self.absorb_unsignaled(),
        }
    }

    /// The one ordered post of send WRs, steps 3 and 4: **post** `wrs` in
    /// one doorbell, **counted** (doorbells, WRs per post), after the
    /// steps of `ordered`. On an error the caller gives back what the
    /// refused WRs hold (the absorbed entries among them, if the WR that
    /// carries them was refused).
    ///
    /// # Safety
    ///
    /// The contract of [`Qp::post_send`] for `wrs`.
    #[inline(always)]
    pub(crate) unsafe fn post_sends(
        &self,
        ordered: Ordered,
        wrs: &[SendWr],
    ) -> Result<(), PostError> {
        let Ordered { absorbed: _ } = ordered;
        // SAFETY: forwarded contract of this function.
        unsafe { self.post_send_unordered(wrs) }
    }

    /// Posts `wrs` to the send queue (one doorbell, counted) without
    /// posting the deferred WRs first: only for the deferred list itself
    /// (`deferred.rs`) and for the WR that retires unsignaled inline sends
    /// (`inline.rs`), which never has deferred WRs before it (the first
    /// deferred WR absorbs the unsignaled sends, and an inline send posts
    /// the deferred WRs before it adds to them, so while WRs are deferred
    /// there are none to retire). Everything else posts through
    /// [`order_sends`](Self::order_sends) and [`post_sends`](Self::post_sends).
    ///
    /// # Safety
    ///
    /// The contract of [`Qp::post_send`].
    #[inline(always)]
    pub(super) unsafe fn post_send_unordered(&self, wrs: &[SendWr]) -> Result<(), PostError> {
        self.counters.posted(wrs.len());
        // SAFETY: forwarded contract of this function.
        unsafe { self.qp.post_send(wrs) }
    }

    /// Posts `wrs` to the receive queue: one doorbell.
    ///
    /// # Safety
    ///
    /// The contract of [`Qp::post_recv`].
    #[inline(always)]
    pub(crate) unsafe fn post_recv(&self, wrs: &[RecvWr]) -> Result<(), PostError> {
        self.counters.posted(wrs.len());
        // SAFETY: forwarded contract of this function.
        unsafe { self.qp.post_recv(wrs) }
    }

    pub(crate) fn outstanding(&self) -> u32 {
        self.entries.outstanding()
    }

    /// Marks the QP closed, wakes queued submitters and moves it to ERR
    /// (again: rxe flushes receives posted in ERR only on a new transition).
    ///
    /// Trailing unsignaled inline sends are retired by a WR posted once the
    /// QP is in ERR (so it is flushed, never executed), followed by one more
    /// ERR transition (rxe flushes WRs posted in ERR only then). If that post
    /// fails, their entries are given back at once.
    pub(crate) fn shut(&self, ops: &crate::op::OpTable) -> Result<(), ProviderError> {
        // Deferred WRs go out first: the ERR transition flushes them with
        // the rest, so their ops end as every posted WR of a closed QP does.
        self.flush_deferred(ops);
        self.closed.set(true);
        self.sends_ok.set(false);
        // The receive rings repost nothing once closed: their kept entries
        // come back now (they check `closed` before using them).
        let kept = self.ring_kept.replace(0);
        if kept > 0 {
            self.entries.rq.release(kept);
            self.entries.recv_cq.release(kept);
        }
        self.entries.sq.wake_all();
        self.entries.rq.wake_all();
        self.entries.send_cq.wake_all();
        self.entries.recv_cq.wake_all();
        let res = self.qp.modify_to_err();
        if self.unsig.get() > 0 {
            if self.retire_unsignaled() {
                if let Err(e) = self.qp.modify_to_err() {
                    tracing::debug!(qp = self.qp_num, error = %crate::report::ErrorChain(&e), "second modify_to_err");
                }
            } else {
                let n = self.absorb_unsignaled();
                self.entries.sq.release(n);
                self.entries.send_cq.release(n);
            }
        }
        res
    }
}

impl WorkQueue for QpCore {
    /// An inline send's completion (or that of the WR retiring them).
    fn complete_reserved(&self, c: &Completion) {
        if c.qp_num == self.qp_num {
            self.inline_completed(c);
        } else {
            tracing::debug!(
                wr_id = c.wr_id,
                qp = c.qp_num,
                "inline completion of another QP"
            );
        }
    }

    /// Posts the single WRs deferred during the phase, in one list.
    fn phase_ended(&self, ops: &OpTable) {
        self.flush_deferred(ops);
        self.listed_in_phase.set(false);
    }

    /// Retires trailing unsignaled inline sends, which hold CQ entries.
    fn release_hoarded(&self) {
        if self.unsig.get() > 0 && !self.closed.get() {
            self.retire_unsignaled();
        }
    }

    /// Inline sends returned at their post, and ops whose futures the
    /// shutdown is about to drop, still travel: moving the QP to ERR now
    /// would flush those the device has not sent yet.
    fn sends_in_flight(&self, ops: &OpTable) -> bool {
        if self.closed.get() || self.fault.get().is_some() {
            return false;
        }
        self.flush_deferred(ops);
        if self.unsig.get() > 0 && !self.retire_unsignaled() {
            return false;
        }
        self.entries.sq.outstanding() > 0
    }

    fn shut_down(&self, ops: &OpTable) {
        if let Err(e) = self.shut(ops) {
            tracing::debug!(qp = self.qp_num, error = %crate::report::ErrorChain(&e), "modify_to_err at shutdown");
        }
    }

    /// Inline sends lend no memory.
    fn lent(&self) -> u32 {
        self.outstanding_with_memory()
    }

    fn finished(&self) -> bool {
        self.dropped.get() && self.outstanding() == 0
    }
}

/// Whether a new QP batches its single-WR posts (see
/// `QueuePair::set_doorbell_batching`): where the provider says one post of
/// a list costs about what one post of a single WR does
/// ([`ProviderCaps::batches_posts`](crate::provider::ProviderCaps)); the
/// software device does (one post list takes the QP's lock and wakes the
/// engine once for all its WRs), rxe does not (its doorbell runs the
/// requester in the posting thread and one doorbell per WR keeps it busy;
/// see `docs/benchmarks.md`).
pub(super) fn batching_by_default(qp: &Qp) -> bool {
    qp.provider_caps().batches_posts
}
