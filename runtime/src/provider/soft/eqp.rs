//! The engine's private per-QP state: the send WRs it has taken (requester)
//! and the expected PSN and current RECV (responder), plus completion and
//! error/flush handling.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::context::Shared;
use super::cq::{CqShared, Push};
use super::direct::Direct;
use super::engine::psn_add;
use super::lock;
use super::qp::{QpConfig, QpInner, QpShared, RecvWqe, SendWqe};
use super::wire::Wire;
use crate::provider::{
    ack_timeout_duration, Completion, QpState, SendFlags, SendOp, WcOpcode, WcStatus,
};

/// A send WR inside the engine.
pub(crate) struct EWqe {
    pub w: SendWqe,
    pub first_psn: u32,
    pub last_psn: u32,
    /// A local error found before sending; completes when it reaches the front.
    pub error: Option<WcStatus>,
    /// A local operation (bind, invalidate) that was executed: not again
    /// when the requester goes back to resend.
    pub executed: bool,
}

impl EWqe {
    pub fn needs_response(&self) -> bool {
        matches!(
            self.w.op,
            SendOp::Read { .. } | SendOp::CompareAndSwap { .. } | SendOp::FetchAndAdd { .. }
        )
    }
}

/// The engine's private view of a QP.
pub(crate) struct EQp {
    pub sh: Arc<QpShared>,
    /// The device (for the MR table).
    pub sh_ctx: Arc<Shared>,
    pub gen: u32,
    pub epoch: u32,
    pub configured: bool,
    pub cfg: QpConfig,
    // requester
    pub conn: Option<usize>,
    pub scheduled: bool,
    /// Taken WRs not completed yet, in order; `[..send_idx]` fully sent.
    pub wqes: VecDeque<EWqe>,
    pub send_idx: usize,
    pub send_off: u64,
    pub next_psn: u32,
    pub rnr_until: Option<Instant>,
    pub rnr_left: u8,
    pub ack_deadline: Option<Instant>,
    pub retries_left: u8,
    /// The probe an ACK timeout asked for on `conn`, until its answer
    /// (see `engine/liveness.rs`).
    pub probe: Option<u64>,
    /// The time of its entry in the engine's deadline queue (see
    /// `engine/timers.rs`), at or before its earliest deadline.
    pub queued: Option<Instant>,
    pub rd_outstanding: usize,
    /// The payload this QP may still be sending straight from its memory.
    pub zc: Option<super::conn::TxMemRef>,
    // responder
    pub epsn: u32,
    pub cur_recv: Option<RecvWqe>,
    /// `cur_recv` was taken for the SEND with this PSN before its first
    /// segment was whole (its payload is received straight into the WR's
    /// memory, see `engine/rx.rs`): that segment's handling uses it.
    pub recv_for: Option<u32>,
    /// The connection its last packet arrived on (see `drive::note_feed`).
    pub rx_conn: Option<usize>,
    /// The connection its responses leave on (once chosen, all of them:
    /// responses must stay in order).
    pub resp_conn: Option<usize>,
}

impl EQp {
    pub fn new(sh: Arc<QpShared>, sh_ctx: Arc<Shared>) -> EQp {
        EQp {
            sh,
            sh_ctx,
            gen: u32::MAX,
            epoch: 0,
            configured: false,
            cfg: QpConfig::default(),
            conn: None,
            scheduled: false,
            wqes: VecDeque::new(),
            send_idx: 0,
            send_off: 0,
            next_psn: 0,
            rnr_until: None,
            rnr_left: 0,
            ack_deadline: None,
            retries_left: 0,
            probe: None,
            queued: None,
            rd_outstanding: 0,
            zc: None,
            epsn: 0,
            cur_recv: None,
            recv_for: None,
            rx_conn: None,
            resp_conn: None,
        }
    }

    /// Copies a changed configuration; drops private state after a RESET.
    /// Returns the current state.
    pub fn refresh(&mut self, inner: &mut QpInner) -> QpState {
        if inner.epoch != self.epoch {
            self.epoch = inner.epoch;
            self.configured = false;
            self.wqes.clear();
            self.send_idx = 0;
            self.send_off = 0;
            self.rnr_until = None;
            self.ack_deadline = None;
            self.probe = None;
            self.rd_outstanding = 0;
            self.cur_recv = None;
            self.recv_for = None;
            self.resp_conn = None;
        }
        if inner.gen != self.gen {
            self.gen = inner.gen;
            self.cfg = inner.cfg;
            if !self.configured && matches!(inner.state, QpState::Rtr | QpState::Rts) {
                self.configured = true;
                self.epsn = self.cfg.remote_psn;
                self.next_psn = self.sh.psn;
            }
            self.rnr_left = self.cfg.rnr_retry;
            self.retries_left = self.cfg.retry_cnt;
        }
        self.absorb(inner);
        inner.state
    }

    /// Takes over the WRs posting threads transmitted (they were sent after
    /// every WR the engine holds, with consecutive PSNs).
    pub fn absorb(&mut self, inner: &mut QpInner) {
        if inner.sent.is_empty() {
            return;
        }
        for s in inner.sent.drain(..) {
            self.next_psn = psn_add(s.psn, 1);
            if let Some(z) = s.zc {
                // (Copied out of the memory if the QP fails before the
                // engine wrote it, see `unpin`.)
                self.zc = Some(z);
            }
            if matches!(s.w.op, SendOp::Read { .. }) {
                // (Counted as the engine counts the READs it sends.)
                self.rd_outstanding += 1;
            }
            if self.ack_deadline.is_none() {
                self.ack_deadline = self.ack_timeout().map(|t| s.at + t);
                self.retries_left = self.cfg.retry_cnt;
            }
            self.wqes.push_back(EWqe {
                w: s.w,
                first_psn: s.psn,
                last_psn: s.psn,
                error: None,
                executed: false,
            });
            self.send_idx += 1;
        }
    }

    /// Takes the permission to transmit back from posting threads (before
    /// the engine sends, resends or flushes this QP's WRs).
    pub fn stop_direct(&mut self, inner: &mut QpInner) {
        self.absorb(inner);
        if inner.direct.take().is_some() || inner.ud_direct {
            inner.ud_direct = false;
            self.sh.direct_hint.store(false, Ordering::Relaxed);
        }
    }

    /// UD: lets posting threads transmit datagrams themselves if the engine
    /// holds none of this QP's WRs.
    pub fn allow_ud_direct(&mut self, inner: &mut QpInner) {
        let idle = self.wqes.is_empty()
            && inner.state == QpState::Rts
            && inner.sq.is_empty()
            && self.gen == inner.gen;
        if idle && !inner.ud_direct {
            inner.ud_direct = true;
            self.sh.direct_hint.store(true, Ordering::Relaxed);
        }
    }

    /// Lets posting threads transmit on `wire` if the engine has nothing left
    /// to send for this QP.
    pub fn allow_direct(&mut self, inner: &mut QpInner, wire: &Arc<Wire>) {
        let idle = self.send_idx == self.wqes.len()
            && self.send_off == 0
            && self.rnr_until.is_none()
            && self.configured
            && inner.state == QpState::Rts
            && inner.sq.is_empty()
            && inner.sent.is_empty();
        if idle && inner.direct.is_none() && self.gen == inner.gen {
            inner.direct = Some(Direct {
                wire: wire.clone(),
                next_psn: self.next_psn,
            });
            self.sh.direct_hint.store(true, Ordering::Relaxed);
        }
    }

    pub fn ack_timeout(&self) -> Option<Duration> {
        ack_timeout_duration(self.cfg.timeout)
    }

    /// Restarts the ACK timer after progress (or stops it when idle).
    pub fn progress(&mut self, now: Instant) {
        self.retries_left = self.cfg.retry_cnt;
        self.rnr_left = self.cfg.rnr_retry;
        self.probe = None;
        self.ack_deadline = if self.send_idx > 0 || self.send_off > 0 {
            self.ack_timeout().map(|t| now + t)
        } else {
            None
        };
    }

    pub fn completion(&self, w: &SendWqe, status: WcStatus, byte_len: u32) -> Completion {
        Completion {
            wr_id: w.wr_id,
            status,
            opcode: w.op.completion_opcode(),
            byte_len: if status.is_success() { byte_len } else { 0 },
            imm_data: None,
            qp_num: self.sh.qpn,
            vendor_err: 0,
            ..Completion::EMPTY
        }
    }

    /// Completes the front WR (which must exist) with `status`.
    pub fn complete_front(&mut self, status: WcStatus, byte_len: u32) {
        let Some(e) = self.wqes.pop_front() else {
            return;
        };
        if self.send_idx > 0 {
            self.send_idx -= 1;
        } else {
            self.send_off = 0;
        }
        if e.needs_response() && self.rd_outstanding > 0 {
            self.rd_outstanding -= 1;
        }
        // Free the send-queue slot before the CQE is visible (as rxe does):
        // an application that posts as soon as it polls must find room.
        {
            let mut inner = lock(&self.sh.inner);
            inner.sq_outstanding = inner.sq_outstanding.saturating_sub(1);
        }
        if !status.is_success() || e.w.flags.contains(SendFlags::SIGNALED) {
            let wc = self.completion(&e.w, status, byte_len);
            self.deliver(&self.sh.send_cq, wc, true);
        }
    }

    /// Puts a completion on `cq`. Its channel event, if the CQ was armed,
    /// is raised at the end of the engine's loop turn, once for all of the
    /// turn's completions (like a NIC's interrupt moderation).
    pub fn deliver(&self, cq: &Arc<CqShared>, wc: Completion, solicited: bool) {
        match cq.push(wc, solicited) {
            Push::Fired => lock(&self.sh_ctx.fired).push(cq.clone()),
            Push::Overflowed => {
                lock(&self.sh_ctx.overflowed).push(cq.clone());
                self.sh_ctx.any_overflowed.store(true, Ordering::Relaxed);
            }
            Push::Queued | Push::Lost => {}
        }
        if wc.status.is_success() {
            self.sh_ctx.completed.store(true, Ordering::Relaxed);
        }
    }

    pub fn recv_completion(&self, r: &RecvWqe, status: WcStatus) -> Completion {
        Completion {
            wr_id: r.wr_id,
            status,
            opcode: WcOpcode::Recv,
            byte_len: 0,
            imm_data: None,
            qp_num: self.sh.qpn,
            vendor_err: 0,
            ..Completion::EMPTY
        }
    }

    /// Before completions may free the QP's memory: a payload still being
    /// sent from it is copied out (the engine never reads it afterwards).
    /// Takes the MR-table lock: callers must not hold it.
    pub fn unpin(&mut self) {
        if let Some(z) = self.zc.take() {
            // Only the connection and we hold it while it is unsent.
            if Arc::strong_count(&z) > 1 {
                let shared = self.sh_ctx.clone();
                lock(&z).snapshot(&shared.mrs());
            }
        }
    }

    /// Moves the QP to ERR: `first` completes the front send WR, then every
    /// other WR (send and receive) is flushed.
    pub fn fail(&mut self, first: Option<WcStatus>) {
        let sh = self.sh.clone();
        {
            let mut inner = lock(&sh.inner);
            self.stop_direct(&mut inner);
            // The QP is in ERR before its error completion is visible: an
            // application that queries the QP once it polled the error
            // finds it in ERR.
            if inner.state != QpState::Err {
                self.sh.set_state(&mut inner, QpState::Err);
                self.gen = inner.gen;
            }
        }
        self.unpin();
        if let Some(st) = first {
            if !self.wqes.is_empty() {
                self.complete_front(st, 0);
            }
        }
        let mut inner = lock(&sh.inner);
        self.flush(&mut inner);
    }

    /// Flushes every WR with `WR_FLUSH_ERR` (QP in ERR).
    pub fn flush(&mut self, inner: &mut QpInner) {
        self.stop_direct(inner);
        self.unpin();
        let sends: Vec<SendWqe> = self
            .wqes
            .drain(..)
            .map(|e| e.w)
            .chain(inner.sq.drain(..))
            .collect();
        // Slots are free before the flush CQEs become visible.
        inner.sq_outstanding = 0;
        inner.rq_outstanding = 0;
        for w in &sends {
            let wc = self.completion(w, WcStatus::WrFlushErr, 0);
            self.deliver(&self.sh.send_cq, wc, true);
        }
        self.recv_for = None;
        let recvs: Vec<RecvWqe> = self
            .cur_recv
            .take()
            .into_iter()
            .chain(inner.rq.drain(..))
            .collect();
        for r in &recvs {
            let wc = self.recv_completion(r, WcStatus::WrFlushErr);
            self.deliver(&self.sh.recv_cq, wc, true);
        }
        self.send_idx = 0;
        self.send_off = 0;
        self.rnr_until = None;
        self.ack_deadline = None;
        self.probe = None;
        self.rd_outstanding = 0;
    }
}
