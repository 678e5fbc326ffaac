//! Inline sends posted without an op ([`QueuePair::post_send_inline`]):
//! mostly unsignaled, their send-queue and CQ entries held by the QP until
//! a later signaled WR's completion retires them; their errors recorded on
//! the QP.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use super::{QpCore, QueuePair, UdPeer};
use crate::op::{wr_id, SubmitError, Ticket};
use crate::provider::{Completion, SendFlags, SendOp, SendWr, SgList, Sge, UdDest, WcStatus};

/// An inline send's error completion, kept by its QP.
#[derive(Clone, Copy, Debug)]
pub(crate) struct InlineFault {
    wr_id: u64,
    status: WcStatus,
    vendor_err: u32,
}

/// Default of [`QueuePair::set_inline_signal_interval`].
pub const DEFAULT_INLINE_SIGNAL_INTERVAL: u32 = 16;
/// Largest inline signal interval (the entries a signaled inline WR carries
/// must fit its wr_id).
pub const MAX_INLINE_SIGNAL_INTERVAL: u32 = 512;

impl QpCore {
    pub(crate) fn fault_error(&self) -> Option<SubmitError> {
        self.fault.get().map(|f| SubmitError::InlineSendFailed {
            qp_num: self.qp_num,
            wr_id: f.wr_id,
            status: f.status,
            vendor_err: f.vendor_err,
        })
    }

    /// A completion of an inline wr_id of this QP (see [`wr_id::INLINE`]):
    /// gives back the entries it carries, records the first error of a
    /// data-carrying WR.
    pub(crate) fn inline_completed(&self, c: &Completion) {
        let (_, entries, marker) = wr_id::decode_inline(c.wr_id);
        if !c.status.is_success() && !marker && self.fault.get().is_none() {
            tracing::warn!(qp = self.qp_num, wr_id = c.wr_id, status = %c.status, "inline send failed");
            self.fault.set(Some(InlineFault {
                wr_id: c.wr_id,
                status: c.status,
                vendor_err: c.vendor_err,
            }));
            self.sends_ok.set(false);
        }
        if entries > 0 {
            self.inline_entries
                .set(self.inline_entries.get().saturating_sub(entries));
            self.entries.sq.release(entries);
            self.entries.send_cq.release(entries);
        }
    }

    /// Send WRs outstanding that lend memory to the device (all but inline sends).
    pub(crate) fn outstanding_with_memory(&self) -> u32 {
        self.outstanding().saturating_sub(self.inline_entries.get())
    }

    /// Undoes the absorption of an [`Ordered`](super::core::Ordered) post
    /// (nothing that carries its entries was posted).
    pub(super) fn unabsorb(&self, n: u32) {
        self.unsig.set(n);
        self.inline_entries.set(self.inline_entries.get() + n);
    }

    /// Posts a signaled zero-length WR ([`QpCore::retire_op`]: on RC an RDMA
    /// WRITE with no SGE and no rkey, C9-88, which the responder neither
    /// validates nor places) that retires the trailing unsignaled inline
    /// sends; it uses their reserve entry. Called
    /// only when someone must wait for entries those sends hold, or to close.
    /// False if the post failed (the entries stay held).
    pub(crate) fn retire_unsignaled(&self) -> bool {
        let n = self.unsig.get();
        if n == 0 {
            return true;
        }
        let Some(op) = self.retire_op.get() else {
            tracing::warn!(
                qp = self.qp_num,
                "a UD QP without its retiring WR cannot retire unsignaled inline sends"
            );
            return false;
        };
        let wr = SendWr {
            wr_id: wr_id::encode_inline(self.reg_key.get(), n, true),
            sg_list: SgList::new(),
            op,
            flags: SendFlags::SIGNALED,
        };
        // SAFETY: the WR has no SGE: it names no local memory.
        match unsafe { self.post_send_unordered(std::slice::from_ref(&wr)) } {
            Ok(()) => {
                self.unsig.set(0);
                true
            }
            Err(e) => {
                tracing::warn!(qp = self.qp_num, error = %crate::report::ErrorChain(&e), "posting the WR that retires unsignaled inline sends failed");
                false
            }
        }
    }
}

impl QueuePair {
    /// Posts a SEND (with `imm`, a SEND_WITH_IMM) of `data`, copied INLINE
    /// at post time, without an op: the returned future resolves as soon as
    /// the WR is posted (at once if the send queue and the CQ have room,
    /// else once they have, in FIFO order with the other submissions), not
    /// when it completes. `data` is borrowed only until then.
    ///
    /// Like perftest's latency loops, such sends go unsignaled (no
    /// completion to poll): one in every
    /// [`inline_signal_interval`](Self::inline_signal_interval) is signaled,
    /// and so is one that would otherwise leave the send queue or the CQ
    /// without a free entry; a signaled completion frees the queue slots of
    /// every unsignaled send before it. When some submission has to wait for
    /// entries that trailing unsignaled sends hold (and when the QP is
    /// closed or dropped), the runtime posts one signaled zero-length RDMA
    /// WRITE (no SGE, no rkey: the responder validates and touches nothing)
    /// to retire them, so entries never over-commit the device's queues and
    /// never stay stuck.
    ///
    /// Errors: `data` longer than the QP's `max_inline_data`, a closed QP,
    /// or a post the provider refused. A send that later completes with an
    /// error (the QP then goes to ERR) is recorded: from then on every
    /// submission on this QP, inline or not, fails with
    /// [`SubmitError::InlineSendFailed`], and
    /// [`inline_send_error`](Self::inline_send_error) returns it.
    pub fn post_send_inline<'a>(&'a self, data: &'a [u8], imm: Option<u32>) -> SendInline<'a> {
        SendInline {
            qp: self,
            data,
            imm,
            dest: None,
            entries: SendEntries::default(),
            done: false,
        }
    }

    /// [`post_send_inline`](Self::post_send_inline) without waiting: posts
    /// now (`Some`, with the post's result) if nothing is queued ahead and
    /// the send queue and the CQ have room; otherwise posts nothing, holds
    /// nothing and returns `None`, and the future reports what stood in
    /// the way (a closed or failed QP, `data` too long, no room).
    #[inline]
    pub fn try_post_send_inline(
        &self,
        data: &[u8],
        imm: Option<u32>,
    ) -> Option<Result<(), SubmitError>> {
        // Dropped unposted, the future gives back what it took.
        self.post_send_inline(data, imm).try_post_now()
    }

    /// UD: posts a datagram of `data` (with `imm`, a SEND_WITH_IMM) to
    /// `peer`, copied INLINE at post time, without an op; otherwise as
    /// [`post_send_inline`](Self::post_send_inline). The datagram may be
    /// lost: UD neither acknowledges nor retries.
    pub fn post_send_inline_to<'a>(
        &'a self,
        peer: &UdPeer,
        data: &'a [u8],
        imm: Option<u32>,
    ) -> SendInline<'a> {
        SendInline {
            qp: self,
            data,
            imm,
            dest: Some(peer.dest()),
            entries: SendEntries::default(),
            done: false,
        }
    }

    /// [`post_send_inline_to`](Self::post_send_inline_to) without waiting,
    /// as [`try_post_send_inline`](Self::try_post_send_inline) is for RC:
    /// posts now (`Some`, with the post's result) if nothing is queued
    /// ahead and the send queue and the CQ have room; otherwise posts
    /// nothing, holds nothing and returns `None`. Signaled one in
    /// [`inline_signal_interval`](Self::inline_signal_interval), unlike a
    /// burst's last datagram
    /// ([`try_post_send_inline_burst`](Self::try_post_send_inline_burst)),
    /// which always is.
    #[inline]
    pub fn try_post_send_inline_to(
        &self,
        peer: &UdPeer,
        data: &[u8],
        imm: Option<u32>,
    ) -> Option<Result<(), SubmitError>> {
        // Dropped unposted, the future gives back what it took.
        self.post_send_inline_to(peer, data, imm).try_post_now()
    }

    /// How often an inline send of [`post_send_inline`](Self::post_send_inline)
    /// is signaled (1 = always).
    pub fn inline_signal_interval(&self) -> u32 {
        self.inner.core.signal_every.get()
    }

    /// Signals one inline send in every `every` (clamped to
    /// `1..=`[`MAX_INLINE_SIGNAL_INTERVAL`]; the default is
    /// [`DEFAULT_INLINE_SIGNAL_INTERVAL`], at most half the send queue).
    /// Larger intervals take fewer completions but hold send-queue slots
    /// longer.
    pub fn set_inline_signal_interval(&self, every: u32) {
        self.inner
            .core
            .signal_every
            .set(every.clamp(1, MAX_INLINE_SIGNAL_INTERVAL));
    }

    /// The error completion of an inline send posted without an op, if one
    /// failed (see [`post_send_inline`](Self::post_send_inline)).
    pub fn inline_send_error(&self) -> Option<SubmitError> {
        self.inner.core.fault_error()
    }

    /// Why an inline send of `len` bytes (to `dest` on UD) cannot be
    /// posted now, if it can't.
    fn inline_check(&self, len: usize, dest: Option<&UdDest>) -> Result<(), SubmitError> {
        self.inline_state_check()?;
        let core = &self.inner.core;
        let ud = self.inner.ud.is_some();
        if ud != dest.is_some() {
            return Err(SubmitError::Invalid {
                what: format!(
                    "inline send on QP {}: {}",
                    core.qp_num,
                    if ud {
                        "a UD QP sends to a peer: use post_send_inline_to"
                    } else {
                        "post_send_inline_to needs a UD QP"
                    }
                ),
            });
        }
        if len > self.inner.caps.max_inline_data as usize {
            return Err(SubmitError::Invalid {
                what: format!(
                    "inline send of {len} bytes on QP {}: max_inline_data is {}",
                    core.qp_num, self.inner.caps.max_inline_data
                ),
            });
        }
        self.check_datagram_len(len)
    }

    /// Why the QP takes no inline send now (closed, failed, or too many
    /// QPs for an inline wr_id to name it), if so.
    pub(super) fn inline_state_check(&self) -> Result<(), SubmitError> {
        let core = &self.inner.core;
        if core.closed.get() {
            return Err(SubmitError::Closed {
                qp_num: core.qp_num,
            });
        }
        if let Some(e) = core.fault_error() {
            return Err(e);
        }
        if core.reg_key.get() >= 1 << wr_id::INLINE_KEY_BITS {
            return Err(SubmitError::SlabFull {
                limit: 1 << wr_id::INLINE_KEY_BITS,
            });
        }
        Ok(())
    }

    /// Posts an inline send with one send-queue and one CQ entry held.
    #[inline(always)]
    fn post_inline_now(
        &self,
        data: &[u8],
        imm: Option<u32>,
        dest: Option<UdDest>,
    ) -> Result<(), SubmitError> {
        let core = &self.inner.core;
        // Send-queue order: WRs waiting for the poll phase's doorbell go
        // first, before `unsig` is read (the first of them absorbs it).
        // Nothing is absorbed: a signaled inline send carries the group's
        // entries in its own wr_id (they stay inline entries).
        let ordered = core.order_sends(self.inner.handle.ops(), false);
        let (sq, cq) = (&core.entries.sq, &*core.entries.send_cq);
        let unsig = core.unsig.get();
        // Unsignaled WRs in the current group (`unsig` counts a reserve too).
        let group = unsig.saturating_sub(1);
        let need_reserve = u32::from(unsig == 0);
        // Unsignaled only if that leaves an entry free in both, and the
        // group's reserve (for the WR that may have to retire it) is there.
        let mut signal = group + 1 >= core.signal_every.get()
            || sq.has_waiters()
            || cq.has_waiters()
            || sq.available() < 1 + need_reserve
            || cq.available() < 1 + need_reserve;
        let mut reserve = 0;
        if !signal && need_reserve > 0 {
            // Checked just above, so these succeed; if not, signal instead.
            if sq.try_acquire(1) {
                if cq.try_acquire(1) {
                    reserve = 1;
                } else {
                    sq.release(1);
                    signal = true;
                }
            } else {
                signal = true;
            }
        }
        let entries = if signal { 1 + unsig } else { 0 };
        let wr = SendWr {
            wr_id: wr_id::encode_inline(core.reg_key.get(), entries, false),
            // Built whole, not pushed into (a call per send).
            sg_list: if data.is_empty() {
                SgList::new()
            } else {
                SgList::from_buf([Sge {
                    addr: data.as_ptr() as u64,
                    length: data.len() as u32,
                    lkey: 0,
                }])
            },
            op: match (dest, imm) {
                (Some(dest), imm) => SendOp::SendTo { dest, imm },
                (None, Some(imm)) => SendOp::SendWithImm { imm },
                (None, None) => SendOp::Send,
            },
            flags: if signal {
                SendFlags::INLINE | SendFlags::SIGNALED
            } else {
                SendFlags::INLINE
            },
        };
        // SAFETY: one INLINE WR whose only SGE is `data` (length checked
        // against max_inline_data, so it fits u32): borrowed shared, so
        // readable and unwritten for this whole call, during which the
        // provider copies it (the INLINE part of the `post_send` contract);
        // its lkey is not used. Nothing is lent beyond the call.
        match unsafe { core.post_sends(ordered, std::slice::from_ref(&wr)) } {
            Ok(()) => {
                core.unsig.set(if signal { 0 } else { unsig + 1 + reserve });
                core.inline_entries
                    .set(core.inline_entries.get() + 1 + reserve);
                Ok(())
            }
            Err(e) => Err(self.inline_post_failed(1 + reserve, e)),
        }
    }

    /// The provider refused an inline send: its `n` entries (each) back.
    #[cold]
    #[inline(never)]
    fn inline_post_failed(&self, n: u32, e: crate::provider::PostError) -> SubmitError {
        let core = &self.inner.core;
        core.entries.sq.release(n);
        core.entries.send_cq.release(n);
        SubmitError::Post {
            qp_num: core.qp_num,
            source: e,
        }
    }
}

/// What a waiting inline send (or burst) holds of its QP's send-queue and
/// send-CQ entries while it waits for `n` of each, in FIFO order with the
/// QP's other submissions.
#[derive(Debug, Default)]
pub(super) struct SendEntries {
    sq_ticket: Option<Ticket>,
    cq_ticket: Option<Ticket>,
    /// The send-queue entries are held (waiting for the CQ's).
    pub(super) sq_held: bool,
}

impl SendEntries {
    /// Nothing held or queued for.
    #[inline(always)]
    pub(super) fn is_idle(&self) -> bool {
        !self.sq_held && self.sq_ticket.is_none() && self.cq_ticket.is_none()
    }

    /// Ready once `n` send-queue and `n` CQ entries are held (then this is
    /// idle again and the caller owns them). Waiting for the send queue
    /// retires the QP's unsignaled sends first, waiting for the CQ
    /// releases the entries the reactor hoards.
    pub(super) fn poll_acquire(
        &mut self,
        qp: &QueuePair,
        n: u32,
        cx: &mut Context<'_>,
    ) -> Poll<()> {
        let core = &qp.inner.core;
        if !self.sq_held {
            if self.sq_ticket.is_some() || !core.entries.sq.try_acquire(n) {
                if self.sq_ticket.is_none() {
                    core.retire_unsignaled();
                }
                if core
                    .entries
                    .sq
                    .poll_acquire(n, &mut self.sq_ticket, cx)
                    .is_pending()
                {
                    return Poll::Pending;
                }
            }
            self.sq_held = true;
        }
        if self.cq_ticket.is_some() || !core.entries.send_cq.try_acquire(n) {
            if self.cq_ticket.is_none() {
                qp.inner.handle.driver().release_hoarded_entries();
            }
            if core
                .entries
                .send_cq
                .poll_acquire(n, &mut self.cq_ticket, cx)
                .is_pending()
            {
                return Poll::Pending;
            }
        }
        self.sq_held = false;
        Poll::Ready(())
    }

    /// Gives back whatever is held or queued for (`n` per queue).
    pub(super) fn abandon(&mut self, core: &QpCore, n: u32) {
        core.entries.sq.cancel(&mut self.sq_ticket);
        core.entries.send_cq.cancel(&mut self.cq_ticket);
        if std::mem::take(&mut self.sq_held) {
            core.entries.sq.release(n);
        }
    }
}

/// The future of [`QueuePair::post_send_inline`]: resolves once the inline
/// send is posted (not completed). Dropping it before that posts nothing.
#[must_use = "dropping it before it resolves cancels the send"]
pub struct SendInline<'a> {
    qp: &'a QueuePair,
    data: &'a [u8],
    imm: Option<u32>,
    /// UD: the destination.
    dest: Option<UdDest>,
    entries: SendEntries,
    done: bool,
}

impl std::fmt::Debug for SendInline<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendInline")
            .field("qp_num", &self.qp.qp_num())
            .field("len", &self.data.len())
            .field("done", &self.done)
            .finish()
    }
}

impl SendInline<'_> {
    /// Gives back whatever this waiting send holds.
    fn abandon(&mut self) {
        self.entries.abandon(&self.qp.inner.core, 1);
    }
}

impl SendInline<'_> {
    /// The first poll's fast path: nothing to report, nobody queued ahead
    /// and both entries at hand. Posts and returns `Some`; else `None`
    /// (holding the send-queue entry if it got only that one), leaving
    /// everything to [`poll_slow`](Self::poll_slow).
    #[inline(always)]
    fn try_post_now(&mut self) -> Option<Result<(), SubmitError>> {
        if self.done || !self.entries.is_idle() {
            return None;
        }
        let qp = self.qp;
        let core = &qp.inner.core;
        // What `inline_check` tests, without building its errors.
        if core.closed.get()
            || core.fault.get().is_some()
            || self.data.len() > qp.inner.caps.max_inline_data as usize
            || qp.inner.ud.is_some() != self.dest.is_some()
            || qp
                .inner
                .ud
                .as_ref()
                .is_some_and(|u| self.data.len() > u.mtu as usize)
            || core.reg_key.get() >= 1 << wr_id::INLINE_KEY_BITS
            || !core.entries.sq.try_acquire(1)
        {
            return None;
        }
        if !core.entries.send_cq.try_acquire(1) {
            self.entries.sq_held = true;
            return None;
        }
        self.done = true;
        // Each outcome built in place: the usual one a tag, not a copy of
        // the whole (large) error type's room.
        match qp.post_inline_now(self.data, self.imm, self.dest) {
            Ok(()) => Some(Ok(())),
            Err(e) => Some(Err(e)),
        }
    }

    /// Everything but [`try_post_now`](Self::try_post_now): errors, waits
    /// for entries, later polls.
    #[inline(never)]
    fn poll_slow(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), SubmitError>> {
        let this = self;
        if this.done {
            tracing::error!("inline send polled after it resolved");
            return Poll::Pending;
        }
        let qp = this.qp;
        if let Err(e) = qp.inline_check(this.data.len(), this.dest.as_ref()) {
            this.abandon();
            this.done = true;
            return Poll::Ready(Err(e));
        }
        if this.entries.poll_acquire(qp, 1, cx).is_pending() {
            return Poll::Pending;
        }
        this.done = true;
        Poll::Ready(qp.post_inline_now(this.data, this.imm, this.dest))
    }
}

impl Future for SendInline<'_> {
    type Output = Result<(), SubmitError>;

    #[inline]
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.try_post_now() {
            Some(res) => Poll::Ready(res),
            None => self.poll_slow(cx),
        }
    }
}

impl Drop for SendInline<'_> {
    #[inline]
    fn drop(&mut self) {
        if !self.done {
            self.abandon();
        }
    }
}
