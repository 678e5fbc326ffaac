//! RC and UD queue pairs: creation, the RESET→INIT→RTR→RTS/ERR state
//! machines (RC's step by step, UD's in one call), and posting
//! (work-request lists built on the stack, one doorbell per list, SGEs
//! handed to the device in place: no allocation and no copy per post).

use std::cell::RefCell;
use std::collections::hash_map::RandomState;
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::mem::{align_of, offset_of, size_of, MaybeUninit};
use std::ptr::{self, addr_of_mut};
use std::sync::atomic::{AtomicU32, AtomicU8, Ordering};
use std::sync::Arc;

use rdma_mummy_sys as sys;
use sys::ibv_qp_attr_mask as M;

use super::pd_mr::Pd;
use super::{errno_err, ret_err, Cq};
use crate::provider::{
    Endpoint, InitAttr, LinkLayer, PostError, ProviderAddr, ProviderError, ProviderKind, QpCaps,
    QpState, QpType, RecvWr, Result, RtrAttr, RtsAttr, SendFlags, SendOp, SendWr, Sge, UdAttr,
};

/// Work requests built on the stack per post; longer lists use a per-thread
/// scratch list. Either way the whole list goes to the device in one call.
const STACK_WRS: usize = 16;

struct QpInner {
    qp: *mut sys::ibv_qp,
    qp_num: u32,
    qp_type: QpType,
    caps: QpCaps,
    /// The send PSN: random for RC; UD's is set by `modify_ud_to_rts`.
    psn: AtomicU32,
    port: AtomicU8,
    // Dropped after the QP is destroyed in Drop.
    pd: Pd,
    _send_cq: Cq,
    _recv_cq: Cq,
    /// The SRQ its receives come from (kept alive by the QP).
    srq: Option<super::Srq>,
}

// SAFETY: libibverbs QP verbs (modify, query, post) are thread-safe; the
// providers serialise posts internally. Other fields are immutable or atomic.
unsafe impl Send for QpInner {}
// SAFETY: as above.
unsafe impl Sync for QpInner {}

impl Drop for QpInner {
    fn drop(&mut self) {
        // SAFETY: the last handle is gone; destroyed once, before the PD and CQs.
        let ret = unsafe { sys::ibv_destroy_qp(self.qp) };
        if ret != 0 {
            tracing::warn!(qp_num = self.qp_num, error = %ret_err("ibv_destroy_qp", ret), "destroying QP");
        }
    }
}

/// A reliable-connected or unreliable-datagram queue pair.
#[derive(Clone)]
pub struct Qp {
    inner: Arc<QpInner>,
}

impl fmt::Debug for Qp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ibverbs::Qp")
            .field("qp_num", &self.inner.qp_num)
            .field("qp_type", &self.inner.qp_type)
            .finish()
    }
}

fn random_psn(qp_num: u32) -> u32 {
    let mut h = RandomState::new().build_hasher();
    h.write_u32(qp_num);
    (h.finish() as u32) & 0x00ff_ffff
}

fn state_from_raw(raw: u32) -> QpState {
    match raw {
        0 => QpState::Reset,
        1 => QpState::Init,
        2 => QpState::Rtr,
        3 => QpState::Rts,
        4 => QpState::Sqd,
        5 => QpState::Sqe,
        _ => QpState::Err,
    }
}

fn zeroed_attr() -> sys::ibv_qp_attr {
    // SAFETY: ibv_qp_attr is integers, a GID union of bytes and nested plain
    // structs: all-zero is a valid value (what C callers memset to).
    unsafe { MaybeUninit::<sys::ibv_qp_attr>::zeroed().assume_init() }
}

fn invalid(call: &'static str, what: String) -> ProviderError {
    ProviderError::InvalidArgument { call, what }
}

impl Qp {
    /// Creates a QP of `qp_type` in RESET state (`ibv_create_qp`, never
    /// signaling all sends).
    pub(crate) fn create(
        pd: &Pd,
        send_cq: &Cq,
        recv_cq: &Cq,
        caps: QpCaps,
        qp_type: QpType,
        srq: Option<&super::Srq>,
    ) -> Result<Qp> {
        let ctx = &pd.inner.ctx.inner;
        if !Arc::ptr_eq(ctx, &send_cq.context().inner)
            || !Arc::ptr_eq(ctx, &recv_cq.context().inner)
        {
            return Err(invalid(
                "create_qp",
                "PD and CQs belong to different device contexts".into(),
            ));
        }
        // SAFETY: all-zero is valid for this plain struct (NULL pointers, zero ints).
        let mut init: sys::ibv_qp_init_attr =
            unsafe { MaybeUninit::<sys::ibv_qp_init_attr>::zeroed().assume_init() };
        init.send_cq = send_cq.raw();
        init.recv_cq = recv_cq.raw();
        init.qp_type = match qp_type {
            QpType::Rc => sys::ibv_qp_type::IBV_QPT_RC,
            QpType::Ud => sys::ibv_qp_type::IBV_QPT_UD,
        };
        init.sq_sig_all = 0;
        init.srq = srq.map_or(ptr::null_mut(), super::Srq::raw);
        // On an SRQ the receive sizes are the SRQ's (the device ignores these).
        let (max_recv_wr, max_recv_sge) = match srq {
            Some(_) => (0, 0),
            None => (caps.max_recv_wr, caps.max_recv_sge),
        };
        init.cap = sys::ibv_qp_cap {
            max_send_wr: caps.max_send_wr,
            max_recv_wr,
            max_send_sge: caps.max_send_sge,
            max_recv_sge,
            max_inline_data: caps.max_inline_data,
        };
        // SAFETY: valid PD and CQs of the same context; `init` is fully set.
        let qp = unsafe { sys::ibv_create_qp(pd.inner.pd, &mut init) };
        if qp.is_null() {
            return Err(match errno_err("ibv_create_qp") {
                // EINVAL: caps beyond the device's (often max_inline_data,
                // which no query reports): say which were asked.
                ProviderError::Verbs { call, source }
                    if source.raw_os_error() == Some(libc::EINVAL) =>
                {
                    invalid(
                        call,
                        format!(
                            "{qp_type:?} QP with {caps:?} refused by {}: {source}",
                            pd.context().name()
                        ),
                    )
                }
                other => other,
            });
        }
        // SAFETY: valid QP just created.
        let qp_num = unsafe { (*qp).qp_num };
        // ibv_create_qp writes the actual sizes back into init.cap.
        let actual = QpCaps {
            max_send_wr: init.cap.max_send_wr,
            max_recv_wr: init.cap.max_recv_wr,
            max_send_sge: init.cap.max_send_sge,
            max_recv_sge: init.cap.max_recv_sge,
            max_inline_data: init.cap.max_inline_data,
        };
        tracing::debug!(qp_num, ?qp_type, ?actual, "created QP");
        Ok(Qp {
            inner: Arc::new(QpInner {
                qp,
                qp_num,
                qp_type,
                caps: actual,
                psn: AtomicU32::new(random_psn(qp_num)),
                port: AtomicU8::new(1),
                pd: pd.clone(),
                _send_cq: send_cq.clone(),
                _recv_cq: recv_cq.clone(),
                srq: srq.cloned(),
            }),
        })
    }

    /// QP number.
    pub fn qp_num(&self) -> u32 {
        self.inner.qp_num
    }

    /// Current state (`ibv_query_qp`; a syscall, not for the hot path).
    pub fn state(&self) -> QpState {
        let mut attr = zeroed_attr();
        // SAFETY: all-zero is valid for ibv_qp_init_attr.
        let mut init = unsafe { MaybeUninit::<sys::ibv_qp_init_attr>::zeroed().assume_init() };
        // SAFETY: valid QP and out-structs.
        let ret = unsafe {
            sys::ibv_query_qp(
                self.inner.qp,
                &mut attr,
                M::IBV_QP_STATE.0 as libc::c_int,
                &mut init,
            )
        };
        if ret == 0 {
            state_from_raw(attr.qp_state)
        } else {
            // The library's view, as of the last modify.
            // SAFETY: valid QP; plain field.
            state_from_raw(unsafe { (*self.inner.qp).state })
        }
    }

    /// Actual queue sizes.
    pub fn caps(&self) -> QpCaps {
        self.inner.caps
    }

    fn port(&self) -> u8 {
        self.inner.port.load(Ordering::Relaxed)
    }

    /// Our side of the connection: QPN, PSN, LID, the GID at `gid_index` of
    /// the QP's port (1 until `modify_to_init` sets another) and its active MTU.
    pub fn endpoint(&self, gid_index: u8) -> Result<Endpoint> {
        let ctx = &self.inner.pd.inner.ctx;
        let port = self.port();
        let attr = ctx.query_port(port)?;
        let gid = ctx.query_gid(port, u32::from(gid_index))?;
        Ok(Endpoint {
            provider: ProviderKind::Ibverbs,
            qpn: self.inner.qp_num,
            psn: self.inner.psn.load(Ordering::Relaxed),
            lid: attr.lid,
            gid,
            mtu: attr.active_mtu,
            addr: ProviderAddr::NONE,
        })
    }

    fn modify(
        &self,
        attr: &mut sys::ibv_qp_attr,
        mask: M,
        op: &'static str,
        from: &[QpState],
    ) -> Result<()> {
        // SAFETY: valid QP; `attr` is fully initialised for the bits in `mask`.
        let ret = unsafe { sys::ibv_modify_qp(self.inner.qp, attr, mask.0 as libc::c_int) };
        if ret == 0 {
            return Ok(());
        }
        let err = ret_err("ibv_modify_qp", ret);
        if !from.is_empty() {
            let state = self.state();
            if !from.contains(&state) {
                return Err(ProviderError::InvalidQpState {
                    qp_num: self.inner.qp_num,
                    op,
                    state,
                });
            }
        }
        Err(err)
    }

    /// `ibv_modify_qp` with attributes made elsewhere (the connection
    /// manager's `rdma_init_qp_attr`), for the bits of `mask`.
    pub(crate) fn modify_with(&self, attr: &mut sys::ibv_qp_attr, mask: libc::c_int) -> Result<()> {
        // SAFETY: valid QP; `attr` is initialised for the bits in `mask`
        // (librdmacm filled them).
        let ret = unsafe { sys::ibv_modify_qp(self.inner.qp, attr, mask) };
        if ret != 0 {
            return Err(ret_err("ibv_modify_qp", ret));
        }
        if mask & (M::IBV_QP_PORT.0 as libc::c_int) != 0 {
            self.inner.port.store(attr.port_num, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Refuses the step-by-step RC transitions on a UD QP (and
    /// `modify_ud_to_rts` on an RC QP) before the device sees them.
    fn expect_type(&self, want: QpType, call: &'static str) -> Result<()> {
        if self.inner.qp_type == want {
            return Ok(());
        }
        Err(invalid(
            call,
            format!(
                "QP {} is {:?}; this transition is for {:?} QPs",
                self.inner.qp_num, self.inner.qp_type, want
            ),
        ))
    }

    /// RESET → INIT.
    pub fn modify_to_init(&self, attr: &InitAttr) -> Result<()> {
        self.expect_type(QpType::Rc, "modify_to_init")?;
        let mut a = zeroed_attr();
        a.qp_state = sys::ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = attr.pkey_index;
        a.port_num = attr.port;
        a.qp_access_flags = attr.access.bits();
        self.modify(
            &mut a,
            M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_ACCESS_FLAGS,
            "modify_to_init",
            &[QpState::Reset, QpState::Init],
        )?;
        self.inner.port.store(attr.port, Ordering::Relaxed);
        Ok(())
    }

    /// INIT → RTR: addresses the peer (GRH with the peer's GID when it is
    /// non-zero, as RoCE requires), path MTU = min of both sides.
    pub fn modify_to_rtr(&self, attr: &RtrAttr) -> Result<()> {
        const CALL: &str = "modify_to_rtr";
        self.expect_type(QpType::Rc, CALL)?;
        let remote = &attr.remote;
        if remote.provider != ProviderKind::Ibverbs {
            return Err(invalid(
                CALL,
                format!("endpoint of the {} provider", remote.provider),
            ));
        }
        if attr.min_rnr_timer > 31 {
            return Err(invalid(
                CALL,
                format!("min_rnr_timer {} > 31", attr.min_rnr_timer),
            ));
        }
        let ctx = &self.inner.pd.inner.ctx;
        let port = self.port();
        let port_attr = ctx.query_port(port)?;
        if remote.gid.is_zero() && port_attr.link_layer == LinkLayer::Ethernet {
            return Err(invalid(
                CALL,
                "RoCE port needs the peer's GID, the endpoint has none".into(),
            ));
        }
        let path_mtu = attr.path_mtu.min(remote.mtu).min(port_attr.active_mtu);
        let dev = ctx.cached_attr();
        let max_dest = clamp_rd_atomic(attr.max_dest_rd_atomic, dev.max_qp_rd_atom);

        let mut a = zeroed_attr();
        a.qp_state = sys::ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = path_mtu as u32;
        a.dest_qp_num = remote.qpn;
        a.rq_psn = remote.psn & 0x00ff_ffff;
        a.max_dest_rd_atomic = max_dest;
        a.min_rnr_timer = attr.min_rnr_timer;
        a.ah_attr.dlid = remote.lid;
        a.ah_attr.sl = 0;
        a.ah_attr.src_path_bits = 0;
        a.ah_attr.port_num = port;
        if !remote.gid.is_zero() {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid = sys::ibv_gid { raw: remote.gid.0 };
            a.ah_attr.grh.sgid_index = attr.sgid_index;
            a.ah_attr.grh.hop_limit = attr.hop_limit.max(1);
            a.ah_attr.grh.traffic_class = 0;
            a.ah_attr.grh.flow_label = 0;
        }
        self.modify(
            &mut a,
            M::IBV_QP_STATE
                | M::IBV_QP_AV
                | M::IBV_QP_PATH_MTU
                | M::IBV_QP_DEST_QPN
                | M::IBV_QP_RQ_PSN
                | M::IBV_QP_MAX_DEST_RD_ATOMIC
                | M::IBV_QP_MIN_RNR_TIMER,
            CALL,
            &[QpState::Init],
        )
    }

    /// RTR → RTS with the ACK timeout and retry counts of `attr`.
    pub fn modify_to_rts(&self, attr: &RtsAttr) -> Result<()> {
        const CALL: &str = "modify_to_rts";
        self.expect_type(QpType::Rc, CALL)?;
        if attr.timeout > 31 || attr.retry_cnt > 7 || attr.rnr_retry > 7 {
            return Err(invalid(
                CALL,
                format!(
                    "timeout {} (max 31), retry_cnt {} / rnr_retry {} (max 7)",
                    attr.timeout, attr.retry_cnt, attr.rnr_retry
                ),
            ));
        }
        let dev = self.inner.pd.inner.ctx.cached_attr();
        let mut a = zeroed_attr();
        a.qp_state = sys::ibv_qp_state::IBV_QPS_RTS;
        a.timeout = attr.timeout;
        a.retry_cnt = attr.retry_cnt;
        a.rnr_retry = attr.rnr_retry;
        a.sq_psn = self.inner.psn.load(Ordering::Relaxed);
        a.max_rd_atomic = clamp_rd_atomic(attr.max_rd_atomic, dev.max_qp_init_rd_atom);
        self.modify(
            &mut a,
            M::IBV_QP_STATE
                | M::IBV_QP_TIMEOUT
                | M::IBV_QP_RETRY_CNT
                | M::IBV_QP_RNR_RETRY
                | M::IBV_QP_SQ_PSN
                | M::IBV_QP_MAX_QP_RD_ATOMIC,
            CALL,
            &[QpState::Rtr],
        )
    }

    /// Any state → ERR: outstanding WRs complete with `WR_FLUSH_ERR`.
    pub fn modify_to_err(&self) -> Result<()> {
        let mut a = zeroed_attr();
        a.qp_state = sys::ibv_qp_state::IBV_QPS_ERR;
        self.modify(&mut a, M::IBV_QP_STATE, "modify_to_err", &[])
    }

    /// RC or UD.
    pub fn qp_type(&self) -> QpType {
        self.inner.qp_type
    }

    /// UD only: RESET → INIT (port, P_Key index, Q_Key) → RTR → RTS (send
    /// PSN), the three `ibv_modify_qp` calls of rdma-core's `ibv_ud_pingpong`.
    pub fn modify_ud_to_rts(&self, attr: &UdAttr) -> Result<()> {
        const CALL: &str = "modify_ud_to_rts";
        self.expect_type(QpType::Ud, CALL)?;
        if attr.port == 0 {
            return Err(invalid(CALL, "port 0 (ports are numbered from 1)".into()));
        }
        let sq_psn = attr.sq_psn & 0x00ff_ffff;
        let mut a = zeroed_attr();
        a.qp_state = sys::ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = attr.pkey_index;
        a.port_num = attr.port;
        a.qkey = attr.qkey;
        self.modify(
            &mut a,
            M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_QKEY,
            CALL,
            &[QpState::Reset],
        )?;
        self.inner.port.store(attr.port, Ordering::Relaxed);
        let mut a = zeroed_attr();
        a.qp_state = sys::ibv_qp_state::IBV_QPS_RTR;
        self.modify(&mut a, M::IBV_QP_STATE, CALL, &[QpState::Init])?;
        let mut a = zeroed_attr();
        a.qp_state = sys::ibv_qp_state::IBV_QPS_RTS;
        a.sq_psn = sq_psn;
        self.modify(
            &mut a,
            M::IBV_QP_STATE | M::IBV_QP_SQ_PSN,
            CALL,
            &[QpState::Rtr],
        )?;
        self.inner.psn.store(sq_psn, Ordering::Relaxed);
        tracing::debug!(qp_num = self.inner.qp_num, qkey = attr.qkey, "UD QP in RTS");
        Ok(())
    }

    /// Any state → RESET.
    pub fn modify_to_reset(&self) -> Result<()> {
        let mut a = zeroed_attr();
        a.qp_state = sys::ibv_qp_state::IBV_QPS_RESET;
        self.modify(&mut a, M::IBV_QP_STATE, "modify_to_reset", &[])
    }

    /// Maps a failed `ibv_post_*` return value.
    fn post_error(&self, call: &'static str, ret: i32, queue: &'static str) -> ProviderError {
        let code = if ret > 0 {
            ret
        } else {
            std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
        };
        if code == libc::ENOMEM {
            return ProviderError::QueueFull {
                qp_num: self.inner.qp_num,
                queue,
                depth: if queue == "send" {
                    self.inner.caps.max_send_wr
                } else {
                    self.inner.caps.max_recv_wr
                },
            };
        }
        if code == libc::EINVAL {
            let state = self.state();
            let ok = if queue == "send" {
                matches!(state, QpState::Rts | QpState::Sqd | QpState::Err)
            } else {
                state != QpState::Reset
            };
            if !ok {
                return ProviderError::InvalidQpState {
                    qp_num: self.inner.qp_num,
                    op: call,
                    state,
                };
            }
        }
        ret_err(call, ret)
    }

    /// True when the device takes `wr` as far as this QP's type and caps
    /// tell: a datagram (`SendTo`) on a UD QP and any other opcode on RC
    /// (a UD provider reads `wr.ud.ah` as an address handle whatever the
    /// opcode: rxe dereferences it), at most `max_send_sge` SGEs, an
    /// INLINE payload within `max_inline_data`. [`Qp::send_refusal`] says
    /// why not.
    #[inline(always)]
    fn send_fits(&self, wr: &SendWr, sgl: &[Sge]) -> bool {
        let caps = &self.inner.caps;
        matches!(wr.op, SendOp::SendTo { .. }) == (self.inner.qp_type == QpType::Ud)
            && sgl.len() <= caps.max_send_sge as usize
            && (!wr.flags.contains(SendFlags::INLINE)
                || inline_len(sgl) <= u64::from(caps.max_inline_data))
    }

    /// The error for a send WR [`Qp::send_fits`] refused.
    #[cold]
    #[inline(never)]
    fn send_refusal(&self, wr: &SendWr) -> ProviderError {
        let caps = &self.inner.caps;
        let datagram = matches!(wr.op, SendOp::SendTo { .. });
        if datagram != (self.inner.qp_type == QpType::Ud) {
            return invalid(
                "post_send",
                format!(
                    "{} on {:?} QP {}: UD QPs post only datagrams (SendTo), and only they do",
                    op_name(&wr.op),
                    self.inner.qp_type,
                    self.inner.qp_num
                ),
            );
        }
        let k = wr.sg_list.len();
        if k > caps.max_send_sge as usize {
            return too_many_sges("post_send", k, caps.max_send_sge);
        }
        invalid(
            "post_send",
            format!(
                "{} inline bytes exceed the QP's max_inline_data {}",
                inline_len(&wr.sg_list),
                caps.max_inline_data
            ),
        )
    }

    /// Posts send WRs with one `ibv_post_send` call (one doorbell), whatever
    /// the list's length: the `ibv_send_wr` list is built on the stack (a
    /// per-thread scratch list, grown once and reused, for lists longer
    /// than 16), and each WR's `sg_list` points at its [`SendWr::sg_list`]
    /// directly ([`Sge`] has `ibv_sge`'s layout): no allocation, no copy of
    /// the SGEs, no syscall besides the provider's own doorbell. WRs are
    /// passed as they are: unsignaled WRs stay unsignaled (the QP is created
    /// with `sq_sig_all = 0`), INLINE WRs are copied by the provider during
    /// the call.
    ///
    /// A WR refused before posting (more SGEs than `max_send_sge`, INLINE
    /// beyond `max_inline_data`: `InvalidArgument`) ends the list: the WRs
    /// before it are posted, and `posted` counts them. On a device failure
    /// `posted` counts the WRs the device accepted.
    ///
    /// # Safety
    ///
    /// As for [`crate::provider::Qp::post_send`]: every SGE the device may
    /// access (its lkey names a live registration containing it) stays
    /// allocated and free of Rust references (shared reads allowed for
    /// SEND/WRITE payloads) until the WR's completion has been polled or its
    /// registration is gone; INLINE payloads need only be readable during
    /// the call.
    pub unsafe fn post_send(&self, wrs: &[SendWr]) -> Result<(), PostError> {
        if let [_] = wrs {
            // The common single WR: a one-entry list, the loop unrolled.
            let mut raw = MaybeUninit::<sys::ibv_send_wr>::uninit();
            // SAFETY: room for the one WR; the caller's contract is ours.
            return unsafe { self.post_send_in(wrs, raw.as_mut_ptr()) };
        }
        if wrs.len() <= STACK_WRS {
            let mut raw: [MaybeUninit<sys::ibv_send_wr>; STACK_WRS] =
                [const { MaybeUninit::uninit() }; STACK_WRS];
            // SAFETY: room for wrs.len() WRs; the caller's contract is ours.
            return unsafe { self.post_send_in(wrs, raw.as_mut_ptr().cast()) };
        }
        // SAFETY: the caller's contract is ours.
        unsafe { self.post_send_long(wrs) }
    }

    /// [`Qp::post_send`] of a list longer than [`STACK_WRS`].
    ///
    /// # Safety
    ///
    /// As for [`Qp::post_send`].
    #[inline(never)]
    unsafe fn post_send_long(&self, wrs: &[SendWr]) -> Result<(), PostError> {
        SEND_SCRATCH.with(|cell| match cell.try_borrow_mut() {
            Ok(mut list) => {
                list.clear();
                list.reserve(wrs.len());
                // SAFETY: room for wrs.len() WRs (reserved); the caller's
                // contract is ours.
                unsafe { self.post_send_in(wrs, list.as_mut_ptr().cast()) }
            }
            // Unreachable (nothing posts from inside a post), but harmless.
            Err(_) => {
                let mut list = Vec::<MaybeUninit<sys::ibv_send_wr>>::with_capacity(wrs.len());
                // SAFETY: as above.
                unsafe { self.post_send_in(wrs, list.as_mut_ptr().cast()) }
            }
        })
    }

    /// [`Qp::post_send`] with the `ibv_send_wr` list built at `raw`.
    ///
    /// # Safety
    ///
    /// `raw` is valid for writing `wrs.len()` WRs; the contract of
    /// [`Qp::post_send`] holds.
    #[inline(always)]
    unsafe fn post_send_in(
        &self,
        wrs: &[SendWr],
        raw: *mut sys::ibv_send_wr,
    ) -> Result<(), PostError> {
        let mut n = 0;
        let mut binds = false;
        for wr in wrs {
            let sgl = wr.sg_list.as_slice();
            if !self.send_fits(wr, sgl) {
                break;
            }
            binds |= matches!(wr.op, SendOp::BindMw { .. });
            // SAFETY: n < wrs.len(): in bounds; `next` is one past at most.
            unsafe { write_send_wr(raw.add(n), wr, sgl, raw.add(n + 1)) };
            n += 1;
        }
        if n > 0 {
            // SAFETY: entries 0..n are written; terminate the list.
            unsafe { (*raw.add(n - 1)).next = ptr::null_mut() };
            let mut bad: *mut sys::ibv_send_wr = ptr::null_mut();
            // SAFETY: valid QP; a well-formed list of n WRs; their SGE lists
            // (the callers' SgLists, borrowed for the call) are only read by
            // the provider, which copies them (and INLINE data) into its
            // queue before returning. The memory they name is lent to the
            // device under this function's contract.
            let ret = unsafe { sys::ibv_post_send(self.inner.qp, raw, &mut bad) };
            if ret != 0 {
                let posted =
                    bad_index(raw as usize, bad as usize, size_of::<sys::ibv_send_wr>(), n);
                if binds {
                    // SAFETY: the windows of posted binds are alive (contract).
                    unsafe { super::mw::note_posted(&wrs[..posted]) };
                }
                return Err(self.post_failed("ibv_post_send", ret, "send", posted));
            }
            if binds {
                // SAFETY: as above.
                unsafe { super::mw::note_posted(&wrs[..n]) };
            }
        }
        if n < wrs.len() {
            return Err(PostError {
                posted: n,
                error: self.send_refusal(&wrs[n]),
            });
        }
        Ok(())
    }

    /// The error of a failed `ibv_post_*` call that took `posted` WRs.
    #[cold]
    #[inline(never)]
    fn post_failed(
        &self,
        call: &'static str,
        ret: i32,
        queue: &'static str,
        posted: usize,
    ) -> PostError {
        PostError {
            posted,
            error: self.post_error(call, ret, queue),
        }
    }

    /// Posts receive WRs with one `ibv_post_recv` call, built like
    /// [`Qp::post_send`]'s list (no allocation, SGEs not copied). A WR with
    /// more SGEs than the QP's `max_recv_sge` is refused (`InvalidArgument`)
    /// and ends the list.
    ///
    /// # Safety
    ///
    /// As for [`crate::provider::Qp::post_recv`]: every SGE the device may
    /// access (its lkey names a live registration containing it) stays
    /// allocated and free of Rust references until the WR's completion has
    /// been polled or its registration is gone.
    pub unsafe fn post_recv(&self, wrs: &[RecvWr]) -> Result<(), PostError> {
        if self.inner.srq.is_some() {
            return Err(PostError {
                posted: 0,
                error: invalid(
                    "post_recv",
                    format!("QP {} takes its receives from an SRQ", self.inner.qp_num),
                ),
            });
        }
        if let [_] = wrs {
            let mut raw = MaybeUninit::<sys::ibv_recv_wr>::uninit();
            // SAFETY: room for the one WR; the caller's contract is ours.
            return unsafe { self.post_recv_in(wrs, raw.as_mut_ptr()) };
        }
        if wrs.len() <= STACK_WRS {
            let mut raw = [MaybeUninit::<sys::ibv_recv_wr>::uninit(); STACK_WRS];
            // SAFETY: room for wrs.len() WRs; the caller's contract is ours.
            return unsafe { self.post_recv_in(wrs, raw.as_mut_ptr().cast()) };
        }
        // SAFETY: the caller's contract is ours.
        unsafe { self.post_recv_long(wrs) }
    }

    /// [`Qp::post_recv`] of a list longer than [`STACK_WRS`].
    ///
    /// # Safety
    ///
    /// As for [`Qp::post_recv`].
    #[inline(never)]
    unsafe fn post_recv_long(&self, wrs: &[RecvWr]) -> Result<(), PostError> {
        RECV_SCRATCH.with(|cell| match cell.try_borrow_mut() {
            Ok(mut list) => {
                list.clear();
                list.reserve(wrs.len());
                // SAFETY: room for wrs.len() WRs (reserved); the caller's
                // contract is ours.
                unsafe { self.post_recv_in(wrs, list.as_mut_ptr().cast()) }
            }
            Err(_) => {
                let mut list = Vec::<MaybeUninit<sys::ibv_recv_wr>>::with_capacity(wrs.len());
                // SAFETY: as above.
                unsafe { self.post_recv_in(wrs, list.as_mut_ptr().cast()) }
            }
        })
    }

    /// [`Qp::post_recv`] with the `ibv_recv_wr` list built at `raw`.
    ///
    /// # Safety
    ///
    /// `raw` is valid for writing `wrs.len()` WRs; the contract of
    /// [`Qp::post_recv`] holds.
    #[inline(always)]
    unsafe fn post_recv_in(
        &self,
        wrs: &[RecvWr],
        raw: *mut sys::ibv_recv_wr,
    ) -> Result<(), PostError> {
        let max_sge = self.inner.caps.max_recv_sge as usize;
        let mut n = 0;
        for wr in wrs {
            let sgl = wr.sg_list.as_slice();
            if sgl.len() > max_sge {
                break;
            }
            // SAFETY: n < wrs.len(): in bounds; `next` is one past at most.
            unsafe {
                raw.add(n).write(sys::ibv_recv_wr {
                    wr_id: wr.wr_id,
                    next: raw.add(n + 1),
                    sg_list: sge_ptr(sgl),
                    num_sge: sgl.len() as libc::c_int,
                })
            };
            n += 1;
        }
        if n > 0 {
            // SAFETY: entries 0..n are written; terminate the list.
            unsafe { (*raw.add(n - 1)).next = ptr::null_mut() };
            let mut bad: *mut sys::ibv_recv_wr = ptr::null_mut();
            // SAFETY: valid QP; a well-formed list of n WRs whose SGE lists
            // are only read (copied) by the provider during the call. The
            // memory they name is lent to the device under this function's
            // contract.
            let ret = unsafe { sys::ibv_post_recv(self.inner.qp, raw, &mut bad) };
            if ret != 0 {
                return Err(self.post_failed(
                    "ibv_post_recv",
                    ret,
                    "receive",
                    bad_index(raw as usize, bad as usize, size_of::<sys::ibv_recv_wr>(), n),
                ));
            }
        }
        if n < wrs.len() {
            return Err(PostError {
                posted: n,
                error: too_many_sges(
                    "post_recv",
                    wrs[n].sg_list.len(),
                    self.inner.caps.max_recv_sge,
                ),
            });
        }
        Ok(())
    }
}

/// The verb a send WR names, for errors.
fn op_name(op: &SendOp) -> &'static str {
    match op {
        SendOp::Send => "SEND",
        SendOp::SendWithImm { .. } => "SEND_WITH_IMM",
        SendOp::Write { .. } => "RDMA WRITE",
        SendOp::WriteWithImm { .. } => "RDMA WRITE_WITH_IMM",
        SendOp::Read { .. } => "RDMA READ",
        SendOp::CompareAndSwap { .. } => "ATOMIC CMP_AND_SWP",
        SendOp::FetchAndAdd { .. } => "ATOMIC FETCH_AND_ADD",
        SendOp::SendTo { .. } => "a datagram (SendTo)",
        SendOp::BindMw { .. } => "BIND_MW",
        SendOp::LocalInv { .. } => "LOCAL_INV",
        SendOp::SendWithInv { .. } => "SEND_WITH_INV",
    }
}

/// Bytes of an SGE list (what an INLINE WR copies).
#[inline(always)]
fn inline_len(sgl: &[Sge]) -> u64 {
    match sgl {
        [] => 0,
        [one] => u64::from(one.length),
        _ => sgl.iter().map(|s| u64::from(s.length)).sum(),
    }
}

thread_local! {
    /// Scratch `ibv_send_wr` list for posts longer than [`STACK_WRS`].
    static SEND_SCRATCH: RefCell<Vec<MaybeUninit<sys::ibv_send_wr>>> = const { RefCell::new(Vec::new()) };
    /// Scratch `ibv_recv_wr` list for posts longer than [`STACK_WRS`].
    static RECV_SCRATCH: RefCell<Vec<MaybeUninit<sys::ibv_recv_wr>>> = const { RefCell::new(Vec::new()) };
}

// `Sge` and `ibv_sge` have one layout, so a WR's `sg_list` can point at the
// caller's SGEs (checked at compile time).
const _: () = {
    assert!(size_of::<Sge>() == size_of::<sys::ibv_sge>());
    assert!(align_of::<Sge>() == align_of::<sys::ibv_sge>());
    assert!(offset_of!(Sge, addr) == offset_of!(sys::ibv_sge, addr));
    assert!(offset_of!(Sge, length) == offset_of!(sys::ibv_sge, length));
    assert!(offset_of!(Sge, lkey) == offset_of!(sys::ibv_sge, lkey));
};

/// The SGE list as `ibv_sge`s (NULL when empty). Providers only read it.
#[inline(always)]
fn sge_ptr(sgl: &[Sge]) -> *mut sys::ibv_sge {
    if sgl.is_empty() {
        ptr::null_mut()
    } else {
        sgl.as_ptr().cast::<sys::ibv_sge>().cast_mut()
    }
}

#[cold]
fn too_many_sges(call: &'static str, k: usize, max: u32) -> ProviderError {
    invalid(
        call,
        format!("{k} SGEs in one WR, the QP takes at most {max}"),
    )
}

/// The contract caps READ/atomic depth at the device limit instead of failing.
fn clamp_rd_atomic(wanted: u8, device_max: u32) -> u8 {
    if device_max == 0 {
        return wanted;
    }
    let max = u8::try_from(device_max).unwrap_or(u8::MAX);
    if wanted > max {
        tracing::debug!(
            wanted,
            max,
            "clamping RDMA READ/atomic depth to the device limit"
        );
    }
    wanted.min(max)
}

/// Index of `bad` in a list starting at `base` (`n` if it is not in the list).
fn bad_index(base: usize, bad: usize, size: usize, n: usize) -> usize {
    if bad < base || size == 0 {
        return 0;
    }
    ((bad - base) / size).min(n)
}

/// Writes the `ibv_send_wr` of `wr` at `dst`: the fields a provider reads
/// for these opcodes (`wr.rdma` / `wr.atomic` on RC, `wr.ud` for a UD
/// `SendTo`, `bind_mw` for a bind); the XRC and TSO fields (used only by
/// other QP types and opcodes) are left unwritten.
///
/// # Safety
///
/// `dst` is valid for writing one `ibv_send_wr`; `sgl` is `wr.sg_list`.
#[inline(always)]
unsafe fn write_send_wr(
    dst: *mut sys::ibv_send_wr,
    wr: &SendWr,
    sgl: &[Sge],
    next: *mut sys::ibv_send_wr,
) {
    use sys::ibv_wr_opcode as O;
    let rdma = |remote_addr: u64, rkey: u32| sys::wr_t {
        rdma: sys::rdma_t { remote_addr, rkey },
    };
    let atomic = |remote_addr: u64, rkey: u32, compare_add: u64, swap: u64| sys::wr_t {
        atomic: sys::atomic_t {
            remote_addr,
            compare_add,
            swap,
            rkey,
        },
    };
    let (opcode, imm, wr_u) = match wr.op {
        SendOp::Send => (O::IBV_WR_SEND, 0, rdma(0, 0)),
        SendOp::SendWithImm { imm } => (O::IBV_WR_SEND_WITH_IMM, imm, rdma(0, 0)),
        SendOp::Write { remote_addr, rkey } => (O::IBV_WR_RDMA_WRITE, 0, rdma(remote_addr, rkey)),
        SendOp::WriteWithImm {
            remote_addr,
            rkey,
            imm,
        } => (O::IBV_WR_RDMA_WRITE_WITH_IMM, imm, rdma(remote_addr, rkey)),
        SendOp::Read { remote_addr, rkey } => (O::IBV_WR_RDMA_READ, 0, rdma(remote_addr, rkey)),
        SendOp::CompareAndSwap {
            remote_addr,
            rkey,
            compare,
            swap,
        } => (
            O::IBV_WR_ATOMIC_CMP_AND_SWP,
            0,
            atomic(remote_addr, rkey, compare, swap),
        ),
        SendOp::FetchAndAdd {
            remote_addr,
            rkey,
            add,
        } => (
            O::IBV_WR_ATOMIC_FETCH_AND_ADD,
            0,
            atomic(remote_addr, rkey, add, 0),
        ),
        SendOp::SendTo { dest, imm } => {
            let ud = sys::wr_t {
                ud: sys::ud_t {
                    ah: dest.ah.0 as *mut sys::ibv_ah,
                    remote_qpn: dest.remote_qpn,
                    remote_qkey: dest.remote_qkey,
                },
            };
            match imm {
                Some(imm) => (O::IBV_WR_SEND_WITH_IMM, imm, ud),
                None => (O::IBV_WR_SEND, 0, ud),
            }
        }
        // `invalidate_rkey` shares the field of `imm_data` but is in host
        // order: written through the `to_be` below unchanged.
        SendOp::LocalInv { rkey } => (O::IBV_WR_LOCAL_INV, u32::from_be(rkey), rdma(0, 0)),
        SendOp::SendWithInv { rkey } => (O::IBV_WR_SEND_WITH_INV, u32::from_be(rkey), rdma(0, 0)),
        SendOp::BindMw { .. } => (O::IBV_WR_BIND_MW, 0, rdma(0, 0)),
    };
    // SAFETY: `dst` is valid for writes (contract); every write goes through
    // a raw field pointer, never a reference to the uninitialised struct.
    unsafe {
        addr_of_mut!((*dst).wr_id).write(wr.wr_id);
        addr_of_mut!((*dst).next).write(next);
        addr_of_mut!((*dst).sg_list).write(sge_ptr(sgl));
        addr_of_mut!((*dst).num_sge).write(sgl.len() as libc::c_int);
        addr_of_mut!((*dst).opcode).write(opcode);
        addr_of_mut!((*dst).send_flags).write(wr.flags.bits());
        addr_of_mut!((*dst).imm_data_invalidated_rkey_union).write(
            sys::imm_data_invalidated_rkey_union_t {
                imm_data: imm.to_be(),
            },
        );
        addr_of_mut!((*dst).wr).write(wr_u);
        if let SendOp::BindMw {
            mw,
            mr,
            addr,
            len,
            access,
            rkey,
        } = wr.op
        {
            addr_of_mut!((*dst).bind_mw_tso_union).write(sys::bind_mw_tso_union_t {
                bind_mw: sys::bind_mw_t {
                    mw: mw.0 as *mut sys::ibv_mw,
                    rkey,
                    bind_info: sys::ibv_mw_bind_info {
                        mr: mr.0 as *mut sys::ibv_mr,
                        addr,
                        length: len,
                        mw_access_flags: access.bits(),
                    },
                },
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_wr_index_is_bounded() {
        assert_eq!(bad_index(1000, 1000, 100, 4), 0);
        assert_eq!(bad_index(1000, 1200, 100, 4), 2);
        assert_eq!(bad_index(1000, 9000, 100, 4), 4);
        assert_eq!(bad_index(1000, 0, 100, 4), 0);
    }

    #[test]
    fn inline_len_sums_every_sge() {
        let sge = |length| Sge {
            addr: 0,
            length,
            lkey: 0,
        };
        assert_eq!(inline_len(&[]), 0);
        assert_eq!(inline_len(&[sge(7)]), 7);
        assert_eq!(
            inline_len(&[sge(7), sge(u32::MAX)]),
            7 + u64::from(u32::MAX)
        );
        assert_eq!(inline_len(&[sge(1), sge(2), sge(3), sge(4), sge(5)]), 15);
    }

    #[test]
    fn sge_list_is_passed_in_place() {
        let mut sgl = crate::provider::SgList::new();
        assert!(sge_ptr(&sgl).is_null());
        sgl.push(Sge {
            addr: 0x1000,
            length: 64,
            lkey: 9,
        });
        let p = sge_ptr(&sgl);
        assert_eq!(p.cast_const().cast::<Sge>(), sgl.as_ptr());
        // SAFETY: `p` points at the list's one element (same layout, checked
        // at compile time), alive for this read.
        let raw = unsafe { *p };
        assert_eq!((raw.addr, raw.length, raw.lkey), (0x1000, 64, 9));
    }

    #[test]
    fn psn_is_24_bits() {
        for q in 0..64 {
            assert!(random_psn(q) <= 0x00ff_ffff);
        }
    }

    #[test]
    fn rd_atomic_is_clamped_to_the_device() {
        assert_eq!(clamp_rd_atomic(16, 8), 8);
        assert_eq!(clamp_rd_atomic(4, 128), 4);
        assert_eq!(clamp_rd_atomic(200, 1000), 200);
        assert_eq!(clamp_rd_atomic(7, 0), 7);
    }
}
