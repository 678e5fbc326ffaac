//! Queue pairs: the state shared with the engine, the state machine, and the
//! post path (which only queues work requests and rings the doorbell; it
//! never touches sockets).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use smallvec::SmallVec;

use super::context::{Context, Pd, MAX_INLINE, MAX_QP_WR, MAX_RD_ATOM, MAX_SGE};
use super::cq::{Cq, CqShared};
use super::direct::{self, Direct, DirectSent};
use super::lock;
use super::packet::{MAX_MSG, UD_MTU};
use super::ud;
use crate::provider::{
    AccessFlags, Endpoint, InitAttr, Mtu, PostError, ProviderAddr, ProviderError, ProviderKind,
    QpCaps, QpState, QpType, RecvWr, Result, RtrAttr, RtsAttr, SendFlags, SendOp, SendWr, SgList,
    UdAttr,
};

/// Inline payload copied at post time: up to 128 bytes without a heap
/// copy (a 64-byte `Rdma` message with its 48-byte agent header fits).
pub(crate) type InlineData = SmallVec<[u8; 128]>;

/// A send WR as queued for the engine.
pub(crate) struct SendWqe {
    pub wr_id: u64,
    pub op: SendOp,
    pub flags: SendFlags,
    pub sges: SgList,
    pub inline: Option<InlineData>,
    /// Total message length (payload for SEND/WRITE, destination for READ).
    pub len: u64,
}

/// A receive WR as queued for the engine.
pub(crate) struct RecvWqe {
    pub wr_id: u64,
    pub sges: SgList,
    pub len: u64,
}

/// Connection attributes the engine copies when they change.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct QpConfig {
    pub access: AccessFlags,
    pub remote_qpn: u32,
    pub remote_psn: u32,
    pub remote_addr: Option<SocketAddr>,
    pub min_rnr_timer: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    /// READs and atomics this QP may have outstanding as requester.
    pub max_rd_atomic: u8,
    /// UD: the Q_Key datagrams to this QP must carry.
    pub qkey: u32,
}

pub(crate) struct QpInner {
    pub state: QpState,
    pub cfg: QpConfig,
    /// Bumped by every transition; the engine resyncs when it differs.
    pub gen: u32,
    /// Bumped by RESET; the engine drops its private state when it differs.
    pub epoch: u32,
    /// Posted send WRs the engine has not taken yet.
    pub sq: VecDeque<SendWqe>,
    /// Posted receive WRs not consumed yet.
    pub rq: VecDeque<RecvWqe>,
    /// Send WRs posted and not yet completed (queued or in the engine).
    pub sq_outstanding: u32,
    /// Receive WRs posted and not yet completed.
    pub rq_outstanding: u32,
    /// Set by the engine while it has nothing left to send for this QP:
    /// posts may transmit themselves (see `direct.rs`).
    pub direct: Option<Direct>,
    /// UD: set by the engine while it holds no WR of this QP: posts may
    /// transmit datagrams themselves (see `ud/tx.rs`).
    pub ud_direct: bool,
    /// WRs transmitted by posting threads, not yet taken over by the engine.
    pub sent: VecDeque<DirectSent>,
}

/// QP state shared by the handle and the engine.
pub(crate) struct QpShared {
    pub qpn: u32,
    pub pd: u32,
    pub psn: u32,
    pub qp_type: QpType,
    /// UD: PSN of the next datagram.
    pub ud_psn: AtomicU32,
    pub caps: QpCaps,
    pub send_cq: Arc<CqShared>,
    pub recv_cq: Arc<CqShared>,
    /// Mirror of `inner.state` for lock-free reads.
    pub state: AtomicU8,
    pub inner: Mutex<QpInner>,
    /// Queued on the context's dirty list.
    pub dirty: AtomicBool,
    /// The last handle was dropped.
    pub destroyed: AtomicBool,
    /// Mirror of `inner.direct.is_some() || inner.ud_direct` (a hint read
    /// without the lock).
    pub direct_hint: AtomicBool,
    /// The shared receive queue its receives come from (`srq.rs`).
    pub srq: Option<Arc<super::srq::SrqShared>>,
}

pub(crate) fn state_to_u8(s: QpState) -> u8 {
    match s {
        QpState::Reset => 0,
        QpState::Init => 1,
        QpState::Rtr => 2,
        QpState::Rts => 3,
        QpState::Sqd => 4,
        QpState::Sqe => 5,
        QpState::Err => 6,
    }
}

pub(crate) fn state_from_u8(v: u8) -> QpState {
    match v {
        0 => QpState::Reset,
        1 => QpState::Init,
        2 => QpState::Rtr,
        3 => QpState::Rts,
        4 => QpState::Sqd,
        5 => QpState::Sqe,
        _ => QpState::Err,
    }
}

impl QpShared {
    pub fn set_state(&self, inner: &mut QpInner, s: QpState) {
        inner.state = s;
        inner.gen = inner.gen.wrapping_add(1);
        self.state.store(state_to_u8(s), Ordering::Release);
    }
    pub fn state(&self) -> QpState {
        state_from_u8(self.state.load(Ordering::Acquire))
    }
    /// UD: takes the PSN of the next datagram.
    pub fn next_ud_psn(&self) -> u32 {
        self.ud_psn.fetch_add(1, Ordering::Relaxed) & 0x00ff_ffff
    }
}

pub(crate) struct QpHandle {
    pub shared: Arc<QpShared>,
    pub ctx: Context,
    pub _pd: Pd,
    pub _send_cq: Cq,
    pub _recv_cq: Cq,
}

impl Drop for QpHandle {
    fn drop(&mut self) {
        self.shared.destroyed.store(true, Ordering::Release);
        let sh = self.ctx.shared();
        lock(&sh.qps).remove(&self.shared.qpn);
        sh.notify(&self.shared);
    }
}

/// A queue pair of the soft device (RC or UD).
#[derive(Clone)]
pub struct Qp(pub(crate) Arc<QpHandle>);

fn post_err(posted: usize, error: ProviderError) -> PostError {
    PostError { posted, error }
}

fn invalid(call: &'static str, what: String) -> ProviderError {
    ProviderError::InvalidArgument { call, what }
}

impl Qp {
    fn sh(&self) -> &QpShared {
        &self.0.shared
    }

    /// QP number.
    pub fn qp_num(&self) -> u32 {
        self.sh().qpn
    }
    /// Current state.
    pub fn state(&self) -> QpState {
        self.sh().state()
    }
    /// Queue sizes.
    pub fn caps(&self) -> QpCaps {
        self.sh().caps
    }

    /// What the peer needs to connect.
    pub fn endpoint(&self, gid_index: u8) -> Result<Endpoint> {
        let ctx = self.0.ctx.shared();
        if gid_index != 0 {
            return Err(invalid(
                "endpoint",
                format!("GID index {gid_index} (only 0)"),
            ));
        }
        Ok(Endpoint {
            provider: ProviderKind::Soft,
            qpn: self.sh().qpn,
            psn: self.sh().psn,
            lid: 0,
            gid: ctx.gid,
            mtu: Mtu::Mtu4096,
            addr: ProviderAddr::socket(ctx.addr),
        })
    }

    fn transition(
        &self,
        op: &'static str,
        from: &[QpState],
        to: QpState,
        f: impl FnOnce(&mut QpInner) -> Result<()>,
    ) -> Result<()> {
        let sh = self.sh();
        let mut inner = lock(&sh.inner);
        if !from.contains(&inner.state) {
            return Err(ProviderError::InvalidQpState {
                qp_num: sh.qpn,
                op,
                state: inner.state,
            });
        }
        f(&mut inner)?;
        sh.set_state(&mut inner, to);
        drop(inner);
        self.0.ctx.shared().notify(&self.0.shared);
        Ok(())
    }

    /// Refuses an RC-only call on a UD QP.
    fn rc_only(&self, call: &'static str) -> Result<()> {
        if self.sh().qp_type == QpType::Ud {
            return Err(invalid(
                call,
                format!(
                    "QP {} is UD: RC transitions do not apply (use modify_ud_to_rts)",
                    self.sh().qpn
                ),
            ));
        }
        Ok(())
    }

    /// RESET → INIT.
    pub fn modify_to_init(&self, attr: &InitAttr) -> Result<()> {
        self.rc_only("modify_to_init")?;
        if attr.port != 1 {
            return Err(invalid("modify_to_init", format!("port {}", attr.port)));
        }
        let access = attr.access;
        self.transition("modify_to_init", &[QpState::Reset], QpState::Init, |i| {
            i.cfg.access = access;
            Ok(())
        })
    }

    /// INIT → RTR: records the peer; the engine connects to it lazily.
    pub fn modify_to_rtr(&self, attr: &RtrAttr) -> Result<()> {
        self.rc_only("modify_to_rtr")?;
        let remote = attr.remote;
        let addr = match (remote.provider, remote.addr.to_socket()) {
            (ProviderKind::Soft, Some(a)) => a,
            _ => {
                return Err(invalid(
                    "modify_to_rtr",
                    "remote endpoint is not a soft-device endpoint with an engine address"
                        .to_string(),
                ))
            }
        };
        if remote.qpn > 0x00ff_ffff || remote.psn > 0x00ff_ffff {
            return Err(invalid(
                "modify_to_rtr",
                "qpn/psn wider than 24 bits".into(),
            ));
        }
        let timer = attr.min_rnr_timer;
        self.transition("modify_to_rtr", &[QpState::Init], QpState::Rtr, |i| {
            i.cfg.remote_qpn = remote.qpn;
            i.cfg.remote_psn = remote.psn;
            // (An engine on this host bound to the unspecified address is
            // reached, and claims to be, on loopback.)
            i.cfg.remote_addr = Some(super::engine::dial::reachable(addr));
            i.cfg.min_rnr_timer = timer & 31;
            Ok(())
        })
    }

    /// RTR → RTS.
    pub fn modify_to_rts(&self, attr: &RtsAttr) -> Result<()> {
        self.rc_only("modify_to_rts")?;
        let a = *attr;
        if a.retry_cnt > 7
            || a.rnr_retry > 7
            || a.timeout > 31
            || u32::from(a.max_rd_atomic) > MAX_RD_ATOM
        {
            return Err(invalid("modify_to_rts", format!("{a:?}")));
        }
        self.transition("modify_to_rts", &[QpState::Rtr], QpState::Rts, |i| {
            i.cfg.timeout = a.timeout;
            i.cfg.retry_cnt = a.retry_cnt;
            i.cfg.rnr_retry = a.rnr_retry;
            i.cfg.max_rd_atomic = a.max_rd_atomic;
            Ok(())
        })
    }

    /// Any state → ERR; the engine flushes every WR.
    pub fn modify_to_err(&self) -> Result<()> {
        use QpState::*;
        self.transition(
            "modify_to_err",
            &[Reset, Init, Rtr, Rts, Sqd, Sqe, Err],
            Err,
            |_| Ok(()),
        )
    }

    /// RC or UD.
    pub fn qp_type(&self) -> QpType {
        self.sh().qp_type
    }

    /// UD only: RESET → INIT → RTR → RTS (from RESET only), with the Q_Key
    /// datagrams to this QP must carry and the first send PSN.
    pub fn modify_ud_to_rts(&self, attr: &UdAttr) -> Result<()> {
        let call = "modify_ud_to_rts";
        if self.sh().qp_type != QpType::Ud {
            return Err(invalid(
                call,
                format!("QP {} is RC (use the RC transitions)", self.sh().qpn),
            ));
        }
        if attr.port != 1 {
            return Err(invalid(call, format!("port {}", attr.port)));
        }
        if attr.pkey_index != 0 {
            return Err(invalid(
                call,
                format!(
                    "P_Key index {} (the soft device has 1 P_Key)",
                    attr.pkey_index
                ),
            ));
        }
        if attr.sq_psn > 0x00ff_ffff {
            return Err(invalid(
                call,
                format!("sq_psn {:#x} wider than 24 bits", attr.sq_psn),
            ));
        }
        let (qkey, psn) = (attr.qkey, attr.sq_psn);
        self.transition(call, &[QpState::Reset], QpState::Rts, |i| {
            i.cfg.qkey = qkey;
            self.sh().ud_psn.store(psn, Ordering::Relaxed);
            Ok(())
        })
    }

    /// Any state → RESET: queues emptied without completions.
    pub fn modify_to_reset(&self) -> Result<()> {
        use QpState::*;
        self.transition(
            "modify_to_reset",
            &[Reset, Init, Rtr, Rts, Sqd, Sqe, Err],
            Reset,
            |i| {
                i.sq.clear();
                i.rq.clear();
                i.sq_outstanding = 0;
                i.rq_outstanding = 0;
                i.sent.clear();
                i.direct = None;
                i.ud_direct = false;
                i.epoch = i.epoch.wrapping_add(1);
                i.cfg = QpConfig::default();
                Ok(())
            },
        )
    }

    /// Validates `wr` and copies an INLINE payload.
    ///
    /// # Safety
    ///
    /// The contract of [`Qp::post_send`] holds for `wr`.
    pub(crate) unsafe fn check_send(&self, wr: &SendWr) -> Result<SendWqe> {
        let caps = self.sh().caps;
        if wr.sg_list.len() > caps.max_send_sge as usize {
            return Err(invalid(
                "post_send",
                format!(
                    "{} SGEs > max_send_sge {}",
                    wr.sg_list.len(),
                    caps.max_send_sge
                ),
            ));
        }
        let len: u64 = wr.sg_list.iter().map(|s| u64::from(s.length)).sum();
        if len > MAX_MSG {
            return Err(invalid("post_send", format!("message of {len} bytes")));
        }
        check_op(self.sh(), &wr.op, len)?;
        if matches!(wr.op, SendOp::BindMw { .. } | SendOp::LocalInv { .. }) && len > 0 {
            return Err(invalid(
                "post_send",
                format!("{:?} with local memory: it takes no SGEs", wr.op),
            ));
        }
        let inline_ok = matches!(
            wr.op,
            SendOp::Send
                | SendOp::SendWithImm { .. }
                | SendOp::SendWithInv { .. }
                | SendOp::SendTo { .. }
                | SendOp::Write { .. }
                | SendOp::WriteWithImm { .. }
        );
        let is_inline = wr.flags.contains(SendFlags::INLINE);
        if is_inline && !inline_ok {
            return Err(invalid("post_send", format!("INLINE with {:?}", wr.op)));
        }
        if is_inline && len > u64::from(caps.max_inline_data) {
            return Err(invalid(
                "post_send",
                format!(
                    "inline payload {len} > max_inline_data {}",
                    caps.max_inline_data
                ),
            ));
        }
        if let SendOp::CompareAndSwap { remote_addr, .. }
        | SendOp::FetchAndAdd { remote_addr, .. } = wr.op
        {
            if remote_addr & 7 != 0 {
                return Err(invalid(
                    "post_send",
                    format!("atomic on misaligned address {remote_addr:#x}"),
                ));
            }
            if wr.sg_list.len() != 1 || wr.sg_list[0].length != 8 {
                return Err(invalid(
                    "post_send",
                    "atomics need exactly one 8-byte local SGE".into(),
                ));
            }
        }
        let inline = if is_inline {
            let mut data = InlineData::with_capacity(len as usize);
            for s in &wr.sg_list {
                if s.length == 0 {
                    continue;
                }
                // SAFETY: INLINE part of the `post_send` contract (forwarded
                // by this function's): the SGE memory is readable for
                // `length` bytes during the call; it is copied here and never
                // touched again.
                let src = unsafe {
                    std::slice::from_raw_parts(s.addr as usize as *const u8, s.length as usize)
                };
                data.extend_from_slice(src);
            }
            Some(data)
        } else {
            None
        };
        Ok(SendWqe {
            wr_id: wr.wr_id,
            op: wr.op,
            flags: wr.flags,
            sges: wr.sg_list.clone(),
            inline,
            len,
        })
    }

    /// Queues send WRs and rings the engine's doorbell once.
    ///
    /// # Safety
    ///
    /// As for [`crate::provider::Qp::post_send`]: every SGE the engine may
    /// access (its lkey names a live registration containing it) stays
    /// allocated and free of Rust references (shared reads allowed for
    /// SEND/WRITE payloads) until the WR's completion has been polled or its
    /// registration is gone; INLINE payloads need only be readable during
    /// the call.
    pub unsafe fn post_send(&self, wrs: &[SendWr]) -> Result<(), PostError> {
        let mut start = 0;
        if self.sh().direct_hint.load(Ordering::Relaxed) {
            if self.sh().qp_type == QpType::Ud {
                // SAFETY: forwarded contract of this function.
                start = unsafe { ud::post_direct(self, wrs) };
                if start == wrs.len() {
                    return Ok(());
                }
            } else if let [wr] = wrs {
                if direct::eligible(wr) {
                    // SAFETY: forwarded contract of this function.
                    if let Some(r) = unsafe { direct::post(self, wr) } {
                        return r;
                    }
                }
            }
        }
        let wrs = &wrs[start..];
        let sh = self.sh();
        let mut inner = lock(&sh.inner);
        match inner.state {
            QpState::Rts | QpState::Err | QpState::Sqd | QpState::Sqe => {}
            state => {
                return Err(post_err(
                    start,
                    ProviderError::InvalidQpState {
                        qp_num: sh.qpn,
                        op: "post_send",
                        state,
                    },
                ))
            }
        }
        let mut result = Ok(());
        let mut binds: SmallVec<[(u32, u32); 2]> = SmallVec::new();
        for (i, wr) in wrs.iter().enumerate() {
            if inner.sq_outstanding >= sh.caps.max_send_wr {
                result = Err(post_err(
                    start + i,
                    ProviderError::QueueFull {
                        qp_num: sh.qpn,
                        queue: "send",
                        depth: sh.caps.max_send_wr,
                    },
                ));
                break;
            }
            // SAFETY: forwarded contract of this function.
            match unsafe { self.check_send(wr) } {
                Ok(wqe) => {
                    // The engine sends it: posts queue behind it from now
                    // on, until the engine allows direct transmission again.
                    if inner.direct.take().is_some() || inner.ud_direct {
                        inner.ud_direct = false;
                        sh.direct_hint.store(false, Ordering::Relaxed);
                    }
                    if let SendOp::BindMw { mw, rkey, .. } = wqe.op {
                        binds.push((mw.0 as u32, rkey));
                    }
                    inner.sq.push_back(wqe);
                    inner.sq_outstanding += 1;
                }
                Err(e) => {
                    result = Err(post_err(start + i, e));
                    break;
                }
            }
        }
        let posted_any = !inner.sq.is_empty();
        drop(inner);
        if !binds.is_empty() {
            let mut mrs = self.0.ctx.shared().mrs();
            for (index, rkey) in binds {
                mrs.windows.note_posted(index, rkey);
            }
        }
        if posted_any {
            self.0.ctx.shared().notify(&self.0.shared);
        }
        result
    }

    /// Queues receive WRs (allowed from INIT on).
    ///
    /// # Safety
    ///
    /// As for [`crate::provider::Qp::post_recv`]: every SGE the engine may
    /// access (its lkey names a live registration containing it) stays
    /// allocated and free of Rust references until the WR's completion has
    /// been polled or its registration is gone.
    pub unsafe fn post_recv(&self, wrs: &[RecvWr]) -> Result<(), PostError> {
        let sh = self.sh();
        if sh.srq.is_some() {
            return Err(post_err(
                0,
                invalid(
                    "post_recv",
                    format!("QP {} takes its receives from an SRQ", sh.qpn),
                ),
            ));
        }
        let mut inner = lock(&sh.inner);
        if inner.state == QpState::Reset {
            return Err(post_err(
                0,
                ProviderError::InvalidQpState {
                    qp_num: sh.qpn,
                    op: "post_recv",
                    state: QpState::Reset,
                },
            ));
        }
        let mut result = Ok(());
        for (i, wr) in wrs.iter().enumerate() {
            if inner.rq_outstanding >= sh.caps.max_recv_wr {
                result = Err(post_err(
                    i,
                    ProviderError::QueueFull {
                        qp_num: sh.qpn,
                        queue: "receive",
                        depth: sh.caps.max_recv_wr,
                    },
                ));
                break;
            }
            if wr.sg_list.len() > sh.caps.max_recv_sge as usize {
                result = Err(post_err(
                    i,
                    invalid(
                        "post_recv",
                        format!(
                            "{} SGEs > max_recv_sge {}",
                            wr.sg_list.len(),
                            sh.caps.max_recv_sge
                        ),
                    ),
                ));
                break;
            }
            let len = wr.sg_list.iter().map(|s| u64::from(s.length)).sum();
            inner.rq.push_back(RecvWqe {
                wr_id: wr.wr_id,
                sges: wr.sg_list.clone(),
                len,
            });
            inner.rq_outstanding += 1;
        }
        let flush = inner.state == QpState::Err;
        drop(inner);
        if flush {
            self.0.ctx.shared().notify(&self.0.shared);
        }
        result
    }
}

/// Checks that `op` suits the QP's type: UD QPs send `SendTo` datagrams of
/// at most one MTU only, RC QPs everything else.
fn check_op(sh: &QpShared, op: &SendOp, len: u64) -> Result<()> {
    match (sh.qp_type, op) {
        (QpType::Ud, SendOp::SendTo { dest, .. }) => {
            if len > u64::from(UD_MTU) {
                return Err(invalid(
                    "post_send",
                    format!(
                        "datagram of {len} bytes on UD QP {}: larger than the port's active MTU \
                         ({UD_MTU})",
                        sh.qpn
                    ),
                ));
            }
            if dest.remote_qpn > 0x00ff_ffff {
                return Err(invalid(
                    "post_send",
                    format!("remote QPN {:#x} wider than 24 bits", dest.remote_qpn),
                ));
            }
            Ok(())
        }
        (QpType::Ud, op) => Err(invalid(
            "post_send",
            format!(
                "{op:?} on UD QP {}: UD QPs send datagrams (SendOp::SendTo) only",
                sh.qpn
            ),
        )),
        (_, SendOp::SendTo { .. }) => Err(invalid(
            "post_send",
            format!("SendOp::SendTo on RC QP {}: datagrams need a UD QP", sh.qpn),
        )),
        _ => Ok(()),
    }
}

/// Checks requested QP sizes against the device limits.
pub(crate) fn check_caps(caps: &QpCaps) -> Result<QpCaps> {
    let bad = |what: String| Err(invalid("create_qp", what));
    if caps.max_send_wr > MAX_QP_WR || caps.max_recv_wr > MAX_QP_WR {
        return bad(format!("queue depth above {MAX_QP_WR}: {caps:?}"));
    }
    if caps.max_send_sge > MAX_SGE || caps.max_recv_sge > MAX_SGE {
        return bad(format!("more than {MAX_SGE} SGEs: {caps:?}"));
    }
    if caps.max_inline_data > MAX_INLINE {
        return bad(format!("inline above {MAX_INLINE}: {caps:?}"));
    }
    Ok(*caps)
}
