//! `tx_burst`: a list of small datagrams to any number of UD peers, copied
//! INLINE and posted as one post list (one doorbell), without ops. Only the
//! burst's last WR is signaled; its completion retires the whole burst and
//! the unsignaled inline sends before it (`inline.rs`).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use super::inline::SendEntries;
use super::{QueuePair, UdPeer};
use crate::op::{wr_id, SubmitError};
use crate::provider::{PostError, SendFlags, SendOp, SendWr, SgList, Sge};

/// Most datagrams in one burst.
pub const MAX_INLINE_BURST: usize = 64;

/// One datagram of a burst.
#[derive(Clone, Copy, Debug)]
pub struct Datagram<'a> {
    /// Where it goes.
    pub peer: &'a UdPeer,
    /// Its payload (at most the QP's `max_inline_data` bytes).
    pub data: &'a [u8],
    /// Immediate data (a SEND_WITH_IMM), if any.
    pub imm: Option<u32>,
}

impl QueuePair {
    /// UD: posts `datagrams` (at most [`MAX_INLINE_BURST`]) as one post
    /// list, each copied INLINE at post time, without ops: the returned
    /// future resolves once they are posted (waiting, in FIFO order with
    /// the QP's other submissions, for send-queue and CQ room for all of
    /// them), not when they complete. Errors as
    /// [`post_send_inline_to`](Self::post_send_inline_to); if the provider
    /// refuses the list part-way, the leading datagrams it took are sent
    /// and the error's [`PostError::posted`] counts them.
    pub fn post_send_inline_burst<'a>(
        &'a self,
        datagrams: &'a [Datagram<'a>],
    ) -> SendInlineBurst<'a> {
        SendInlineBurst {
            qp: self,
            datagrams,
            entries: SendEntries::default(),
            done: false,
        }
    }

    /// [`post_send_inline_burst`](Self::post_send_inline_burst) without
    /// waiting, for a caller with somewhere else to put the datagrams (a
    /// transport that sends them from registered buffers instead):
    ///
    /// - `Some(Ok(()))`: posted now, as one post list;
    /// - `Some(Err(_))`: refused (the burst's errors: a closed or failed
    ///   QP, a datagram too long, too many of them, or the provider's
    ///   refusal of the list, which may have taken its leading datagrams:
    ///   [`PostError::posted`]);
    /// - `None`: the send queue or the CQ has no room for all of them now,
    ///   or other submissions wait for room ahead of them. Nothing is posted
    ///   or held. As when the future would wait, what holds entries is
    ///   asked to give them back (the QP's trailing unsignaled inline sends
    ///   are retired, or the runtime's hoarded CQ entries released), so
    ///   that room comes back with their completions.
    ///
    /// Unlike [`try_post_send_inline`](Self::try_post_send_inline), which
    /// leaves the errors to its future, this reports them: there is no
    /// future to fall back on.
    pub fn try_post_send_inline_burst(
        &self,
        datagrams: &[Datagram<'_>],
    ) -> Option<Result<(), SubmitError>> {
        if let Err(e) = self
            .inline_state_check()
            .and_then(|()| self.burst_check(datagrams))
        {
            return Some(Err(e));
        }
        let n = datagrams.len() as u32;
        if n == 0 {
            return Some(Ok(()));
        }
        let core = &self.inner.core;
        if !core.entries.sq.try_acquire(n) {
            core.retire_unsignaled();
            return None;
        }
        if !core.entries.send_cq.try_acquire(n) {
            core.entries.sq.release(n);
            self.inner.handle.driver().release_hoarded_entries();
            return None;
        }
        Some(self.post_burst_now(datagrams))
    }

    fn burst_check(&self, datagrams: &[Datagram<'_>]) -> Result<(), SubmitError> {
        let core = &self.inner.core;
        let invalid = |what: String| SubmitError::Invalid {
            what: format!("inline burst on QP {}: {what}", core.qp_num),
        };
        if self.inner.ud.is_none() {
            return Err(invalid("needs a UD queue pair".into()));
        }
        let n = datagrams.len();
        if n > MAX_INLINE_BURST
            || n as u32
                > self
                    .inner
                    .caps
                    .max_send_wr
                    .min(core.entries.send_cq.capacity())
        {
            return Err(invalid(format!(
                "{n} datagrams: at most {MAX_INLINE_BURST}, the send queue's {} and the CQ's {}",
                self.inner.caps.max_send_wr,
                core.entries.send_cq.capacity()
            )));
        }
        if let Some((i, e)) = datagrams
            .iter()
            .enumerate()
            .find_map(|(i, d)| self.check_datagram_len(d.data.len()).err().map(|e| (i, e)))
        {
            return Err(invalid(format!("datagram {i}: {e}")));
        }
        let max = self.inner.caps.max_inline_data as usize;
        if let Some((i, d)) = datagrams
            .iter()
            .enumerate()
            .find(|(_, d)| d.data.len() > max)
        {
            return Err(invalid(format!(
                "datagram {i} has {} bytes: max_inline_data is {max}",
                d.data.len()
            )));
        }
        Ok(())
    }

    /// Posts the burst with `n` send-queue and CQ entries (each) held.
    fn post_burst_now(&self, datagrams: &[Datagram<'_>]) -> Result<(), SubmitError> {
        let core = &self.inner.core;
        let n = datagrams.len() as u32;
        // Send-queue order: deferred WRs first, before the unsignaled sends
        // are absorbed (the first deferred WR takes them over); the last
        // datagram, signaled, carries their entries.
        let ordered = core.order_sends(self.inner.handle.ops(), true);
        let unsig = ordered.absorbed;
        let key = core.reg_key.get();
        let mut wrs = core.burst_wrs.take();
        wrs.clear();
        wrs.extend(datagrams.iter().enumerate().map(|(i, d)| {
            let last = i + 1 == datagrams.len();
            let mut sg_list = SgList::new();
            if !d.data.is_empty() {
                sg_list.push(Sge {
                    addr: d.data.as_ptr() as u64,
                    length: d.data.len() as u32,
                    lkey: 0,
                });
            }
            SendWr {
                wr_id: wr_id::encode_inline(key, if last { n + unsig } else { 0 }, false),
                sg_list,
                op: SendOp::SendTo {
                    dest: d.peer.dest(),
                    imm: d.imm,
                },
                flags: if last {
                    SendFlags::INLINE | SendFlags::SIGNALED
                } else {
                    SendFlags::INLINE
                },
            }
        }));
        // SAFETY: INLINE WRs whose SGEs are the datagrams' payloads
        // (lengths checked against max_inline_data): borrowed shared, so
        // readable and unwritten for this whole call, during which the
        // provider copies them; their lkeys are not used. Each names the
        // address handle of its `UdPeer`, which the QP keeps alive (its
        // handle cache) for as long as it lives.
        let res = unsafe { core.post_sends(ordered, &wrs) };
        wrs.clear();
        core.burst_wrs.set(wrs);
        match res {
            Ok(()) => {
                // The absorbed entries stay inline: the last WR's inline
                // wr_id carries them.
                core.inline_entries
                    .set(core.inline_entries.get() + n + unsig);
                Ok(())
            }
            Err(e) => Err(self.burst_post_failed(n, unsig, e)),
        }
    }

    /// The provider took only the first `e.posted` WRs of a burst of `n`
    /// (all unsignaled): they join the unsignaled group, with a reserve
    /// entry for the WR that may have to retire them; the other entries
    /// come back.
    #[cold]
    #[inline(never)]
    fn burst_post_failed(&self, n: u32, unsig: u32, e: PostError) -> SubmitError {
        let core = &self.inner.core;
        core.unabsorb(unsig);
        let posted = (e.posted as u32).min(n.saturating_sub(1));
        let reserve = u32::from(posted > 0 && core.unsig.get() == 0);
        if posted > 0 {
            core.unsig.set(core.unsig.get() + posted + reserve);
            core.inline_entries
                .set(core.inline_entries.get() + posted + reserve);
        }
        let back = n - posted - reserve;
        core.entries.sq.release(back);
        core.entries.send_cq.release(back);
        SubmitError::Post {
            qp_num: core.qp_num,
            source: e,
        }
    }
}

/// The future of [`QueuePair::post_send_inline_burst`]: resolves once the
/// burst is posted. Dropping it before that posts nothing.
#[must_use = "dropping it before it resolves cancels the burst"]
pub struct SendInlineBurst<'a> {
    qp: &'a QueuePair,
    datagrams: &'a [Datagram<'a>],
    entries: SendEntries,
    done: bool,
}

impl std::fmt::Debug for SendInlineBurst<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendInlineBurst")
            .field("qp_num", &self.qp.qp_num())
            .field("datagrams", &self.datagrams.len())
            .field("done", &self.done)
            .finish()
    }
}

impl SendInlineBurst<'_> {
    fn abandon(&mut self) {
        let n = self.datagrams.len() as u32;
        self.entries.abandon(&self.qp.inner.core, n);
    }
}

impl Future for SendInlineBurst<'_> {
    type Output = Result<(), SubmitError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        if this.done {
            tracing::error!("inline burst polled after it resolved");
            return Poll::Pending;
        }
        let qp = this.qp;
        let check = qp
            .inline_state_check()
            .and_then(|()| qp.burst_check(this.datagrams));
        if let Err(e) = check {
            this.abandon();
            this.done = true;
            return Poll::Ready(Err(e));
        }
        let n = this.datagrams.len() as u32;
        if n == 0 {
            this.done = true;
            return Poll::Ready(Ok(()));
        }
        if this.entries.poll_acquire(qp, n, cx).is_pending() {
            return Poll::Pending;
        }
        this.done = true;
        Poll::Ready(qp.post_burst_now(this.datagrams))
    }
}

impl Drop for SendInlineBurst<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.abandon();
        }
    }
}
