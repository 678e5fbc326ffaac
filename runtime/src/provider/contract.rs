//! The provider contract at a glance: the objects every provider supplies
//! and the methods each must have (the model is mio's `sys/mod.rs`). The
//! public handles in `provider/mod.rs` are enums over the providers and
//! dispatch every call through these traits, so the compiler checks that
//! each provider implements the whole contract: the software device always,
//! libibverbs when the `ibverbs` feature is on.
//!
//! | object | provider types | required methods |
//! |---|---|---|
//! | [`DeviceContext`] | `soft::Context`, `ibverbs::Context` | `name`, `query_device`, `query_port`, `query_gid`, `alloc_pd`, `create_comp_channel`, `create_cq`, `async_fd`, `get_async_event` |
//! | [`ProtectionDomain`] | `soft::Pd`, `ibverbs::Pd` | `reg_mr` (unsafe), `create_qp`, `create_ud_qp`, `create_ah`, `alloc_mw`, `create_srq`, `create_qp_with_srq` |
//! | [`SharedReceiveQueue`] | `soft::Srq`, `ibverbs::Srq` | `handle`, `attr`, `modify_limit`, `post_recv` (unsafe) |
//! | [`AddressHandleOps`] | `soft::Ah`, `ibverbs::Ah` | `raw` |
//! | [`MemoryRegion`] | `soft::Mr`, `ibverbs::Mr` | `lkey`, `rkey`, `addr`, `len`, `access`, `raw` |
//! | [`MemoryWindow`] | `soft::Mw`, `ibverbs::Mw` | `rkey`, `raw` |
//! | [`CompletionChannel`] | `soft::CompChannel`, `ibverbs::CompChannel` | `fd`, `get_event` |
//! | [`CompletionQueue`] | `soft::Cq`, `ibverbs::Cq` | `handle`, `capacity`, `req_notify`, `poll`, `ack_events` |
//! | [`QueuePairOps`] | `soft::Qp`, `ibverbs::Qp` | `qp_num`, `qp_type`, `state`, `caps`, `endpoint`, `modify_to_{init,rtr,rts,err,reset}`, `modify_ud_to_rts`, `post_send` and `post_recv` (unsafe) |
//!
//! Every object is `Clone + Send + Sync` and keeps its parents alive.
//! The implementations forward to each provider's inherent methods.

use std::os::fd::RawFd;

use super::{
    AccessFlags, AhAttr, AhHandle, AsyncEvent, Completion, DeviceAttr, Endpoint, Gid, InitAttr,
    PortAttr, PostError, QpCaps, QpState, QpType, RecvWr, Result, RtrAttr, RtsAttr, SendWr,
    SrqAttr, UdAttr,
};

/// An opened device (`ibv_context`).
pub(crate) trait DeviceContext: Clone + Send + Sync {
    /// Its protection domains.
    type Pd: ProtectionDomain<Cq = Self::Cq>;
    /// Its completion channels.
    type CompChannel: CompletionChannel;
    /// Its CQs.
    type Cq: CompletionQueue;
    /// Device name.
    fn name(&self) -> &str;
    /// `ibv_query_device`.
    fn query_device(&self) -> Result<DeviceAttr>;
    /// `ibv_query_port` (1-based port).
    fn query_port(&self, port: u8) -> Result<PortAttr>;
    /// `ibv_query_gid`.
    fn query_gid(&self, port: u8, index: u32) -> Result<Gid>;
    /// `ibv_alloc_pd`.
    fn alloc_pd(&self) -> Result<Self::Pd>;
    /// `ibv_create_comp_channel`: a non-blocking pollable fd.
    fn create_comp_channel(&self) -> Result<Self::CompChannel>;
    /// `ibv_create_cq`, raising its events on `channel`.
    fn create_cq(&self, cqe: u32, channel: Option<&Self::CompChannel>) -> Result<Self::Cq>;
    /// The async-event fd (non-blocking).
    fn async_fd(&self) -> RawFd;
    /// `ibv_get_async_event` + ack; `None` when there is none.
    fn get_async_event(&self) -> Result<Option<AsyncEvent>>;
}

/// A protection domain (`ibv_pd`).
pub(crate) trait ProtectionDomain: Clone + Send + Sync {
    /// Its memory registrations.
    type Mr: MemoryRegion;
    /// The CQs its QPs complete on.
    type Cq: CompletionQueue;
    /// Its queue pairs.
    type Qp: QueuePairOps;
    /// Its address handles.
    type Ah: AddressHandleOps;
    /// Its memory windows.
    type Mw: MemoryWindow;
    /// Its shared receive queues.
    type Srq: SharedReceiveQueue;
    /// `ibv_reg_mr`.
    ///
    /// # Safety
    ///
    /// The contract of [`Pd::reg_mr`](super::Pd::reg_mr).
    unsafe fn reg_mr(&self, addr: *mut u8, len: usize, access: AccessFlags) -> Result<Self::Mr>;
    /// `ibv_create_qp` (RC, in RESET).
    fn create_qp(&self, send_cq: &Self::Cq, recv_cq: &Self::Cq, caps: QpCaps) -> Result<Self::Qp>;
    /// `ibv_create_qp` (UD, in RESET).
    fn create_ud_qp(
        &self,
        send_cq: &Self::Cq,
        recv_cq: &Self::Cq,
        caps: QpCaps,
    ) -> Result<Self::Qp>;
    /// `ibv_create_ah`.
    fn create_ah(&self, attr: &AhAttr) -> Result<Self::Ah>;
    /// `ibv_alloc_mw` (type 2).
    fn alloc_mw(&self) -> Result<Self::Mw>;
    /// `ibv_create_srq`.
    fn create_srq(&self, attr: &SrqAttr) -> Result<Self::Srq>;
    /// `ibv_create_qp` (RC, in RESET) with `ibv_qp_init_attr.srq`: its
    /// receives come from `srq`.
    fn create_qp_with_srq(
        &self,
        send_cq: &Self::Cq,
        recv_cq: &Self::Cq,
        caps: QpCaps,
        srq: &Self::Srq,
    ) -> Result<Self::Qp>;
}

/// A shared receive queue (`ibv_srq`).
pub(crate) trait SharedReceiveQueue: Clone + Send + Sync {
    /// The handle its async events name.
    fn handle(&self) -> u32;
    /// `ibv_query_srq`.
    fn attr(&self) -> Result<SrqAttr>;
    /// `ibv_modify_srq` with `IBV_SRQ_LIMIT`.
    fn modify_limit(&self, limit: u32) -> Result<()>;
    /// `ibv_post_srq_recv`.
    ///
    /// # Safety
    ///
    /// The contract of [`Srq::post_recv`](super::Srq::post_recv).
    unsafe fn post_recv(&self, wrs: &[RecvWr]) -> std::result::Result<(), PostError>;
}

/// A memory window, type 2 (`ibv_mw`).
pub(crate) trait MemoryWindow: Clone + Send + Sync {
    /// The rkey it has, or gets once the last posted bind executes.
    fn rkey(&self) -> u32;
    /// The handle bind WRs carry while this one lives.
    fn raw(&self) -> u64;
}

/// An address handle (`ibv_ah`): the route to one remote port, named by
/// UD work requests.
pub(crate) trait AddressHandleOps: Clone + Send + Sync {
    /// The handle UD work requests carry while this one lives.
    fn raw(&self) -> AhHandle;
}

/// A memory registration (`ibv_mr`).
pub(crate) trait MemoryRegion: Clone + Send + Sync {
    /// Local key.
    fn lkey(&self) -> u32;
    /// Remote key.
    fn rkey(&self) -> u32;
    /// Start address.
    fn addr(&self) -> u64;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// Granted access.
    fn access(&self) -> AccessFlags;
    /// The handle bind WRs carry while this one lives.
    fn raw(&self) -> u64;
}

/// A completion channel (`ibv_comp_channel`).
pub(crate) trait CompletionChannel: Clone + Send + Sync {
    /// The fd to poll for readability.
    fn fd(&self) -> RawFd;
    /// `ibv_get_cq_event` without blocking: the CQ handle, or `None`.
    fn get_event(&self) -> Result<Option<u32>>;
}

/// A completion queue (`ibv_cq`).
pub(crate) trait CompletionQueue: Clone + Send + Sync {
    /// The handle its channel events name.
    fn handle(&self) -> u32;
    /// Entries.
    fn capacity(&self) -> u32;
    /// `ibv_req_notify_cq`.
    fn req_notify(&self, solicited_only: bool) -> Result<()>;
    /// `ibv_poll_cq` into `out`; returns how many were written.
    fn poll(&self, out: &mut [Completion]) -> Result<usize>;
    /// `ibv_ack_cq_events`.
    fn ack_events(&self, n: u32);
}

/// A queue pair (`ibv_qp`).
pub(crate) trait QueuePairOps: Clone + Send + Sync {
    /// QP number.
    fn qp_num(&self) -> u32;
    /// RC or UD.
    fn qp_type(&self) -> QpType;
    /// Current state.
    fn state(&self) -> QpState;
    /// Queue sizes granted.
    fn caps(&self) -> QpCaps;
    /// What a peer needs to connect to it.
    fn endpoint(&self, gid_index: u8) -> Result<Endpoint>;
    /// RESET -> INIT.
    fn modify_to_init(&self, attr: &InitAttr) -> Result<()>;
    /// INIT -> RTR.
    fn modify_to_rtr(&self, attr: &RtrAttr) -> Result<()>;
    /// RTR -> RTS.
    fn modify_to_rts(&self, attr: &RtsAttr) -> Result<()>;
    /// Any state -> ERR (flushes outstanding work requests).
    fn modify_to_err(&self) -> Result<()>;
    /// Any state -> RESET.
    fn modify_to_reset(&self) -> Result<()>;
    /// UD only: RESET -> INIT -> RTR -> RTS.
    fn modify_ud_to_rts(&self, attr: &UdAttr) -> Result<()>;
    /// `ibv_post_send`.
    ///
    /// # Safety
    ///
    /// The contract of [`Qp::post_send`](super::Qp::post_send).
    unsafe fn post_send(&self, wrs: &[SendWr]) -> std::result::Result<(), PostError>;
    /// `ibv_post_recv`.
    ///
    /// # Safety
    ///
    /// The contract of [`Qp::post_recv`](super::Qp::post_recv).
    unsafe fn post_recv(&self, wrs: &[RecvWr]) -> std::result::Result<(), PostError>;
}

/// Implements the contract for one provider module by forwarding to the
/// inherent methods of its types.
macro_rules! implement_contract {
    ($p:ident) => {
        impl DeviceContext for super::$p::Context {
            type Pd = super::$p::Pd;
            type CompChannel = super::$p::CompChannel;
            type Cq = super::$p::Cq;
            fn name(&self) -> &str {
                super::$p::Context::name(self)
            }
            fn query_device(&self) -> Result<DeviceAttr> {
                super::$p::Context::query_device(self)
            }
            fn query_port(&self, port: u8) -> Result<PortAttr> {
                super::$p::Context::query_port(self, port)
            }
            fn query_gid(&self, port: u8, index: u32) -> Result<Gid> {
                super::$p::Context::query_gid(self, port, index)
            }
            fn alloc_pd(&self) -> Result<Self::Pd> {
                super::$p::Context::alloc_pd(self)
            }
            fn create_comp_channel(&self) -> Result<Self::CompChannel> {
                super::$p::Context::create_comp_channel(self)
            }
            fn create_cq(&self, cqe: u32, channel: Option<&Self::CompChannel>) -> Result<Self::Cq> {
                super::$p::Context::create_cq(self, cqe, channel)
            }
            fn async_fd(&self) -> RawFd {
                super::$p::Context::async_fd(self)
            }
            fn get_async_event(&self) -> Result<Option<AsyncEvent>> {
                super::$p::Context::get_async_event(self)
            }
        }

        impl ProtectionDomain for super::$p::Pd {
            type Mr = super::$p::Mr;
            type Cq = super::$p::Cq;
            type Qp = super::$p::Qp;
            type Ah = super::$p::Ah;
            type Mw = super::$p::Mw;
            type Srq = super::$p::Srq;
            unsafe fn reg_mr(
                &self,
                addr: *mut u8,
                len: usize,
                access: AccessFlags,
            ) -> Result<Self::Mr> {
                // SAFETY: forwarded contract of this function.
                unsafe { super::$p::Pd::reg_mr(self, addr, len, access) }
            }
            fn create_qp(
                &self,
                send_cq: &Self::Cq,
                recv_cq: &Self::Cq,
                caps: QpCaps,
            ) -> Result<Self::Qp> {
                super::$p::Pd::create_qp(self, send_cq, recv_cq, caps)
            }
            fn create_ud_qp(
                &self,
                send_cq: &Self::Cq,
                recv_cq: &Self::Cq,
                caps: QpCaps,
            ) -> Result<Self::Qp> {
                super::$p::Pd::create_ud_qp(self, send_cq, recv_cq, caps)
            }
            fn create_ah(&self, attr: &AhAttr) -> Result<Self::Ah> {
                super::$p::Pd::create_ah(self, attr)
            }
            fn alloc_mw(&self) -> Result<Self::Mw> {
                super::$p::Pd::alloc_mw(self)
            }
            fn create_srq(&self, attr: &SrqAttr) -> Result<Self::Srq> {
                super::$p::Pd::create_srq(self, attr)
            }
            fn create_qp_with_srq(
                &self,
                send_cq: &Self::Cq,
                recv_cq: &Self::Cq,
                caps: QpCaps,
                srq: &Self::Srq,
            ) -> Result<Self::Qp> {
                super::$p::Pd::create_qp_with_srq(self, send_cq, recv_cq, caps, srq)
            }
        }

        impl SharedReceiveQueue for super::$p::Srq {
            fn handle(&self) -> u32 {
                super::$p::Srq::handle(self)
            }
            fn attr(&self) -> Result<SrqAttr> {
                super::$p::Srq::attr(self)
            }
            fn modify_limit(&self, limit: u32) -> Result<()> {
                super::$p::Srq::modify_limit(self, limit)
            }
            unsafe fn post_recv(&self, wrs: &[RecvWr]) -> std::result::Result<(), PostError> {
                // SAFETY: forwarded contract of this function.
                unsafe { super::$p::Srq::post_recv(self, wrs) }
            }
        }

        impl MemoryWindow for super::$p::Mw {
            fn rkey(&self) -> u32 {
                super::$p::Mw::rkey(self)
            }
            fn raw(&self) -> u64 {
                super::$p::Mw::raw(self)
            }
        }

        impl AddressHandleOps for super::$p::Ah {
            fn raw(&self) -> AhHandle {
                super::$p::Ah::raw(self)
            }
        }

        impl MemoryRegion for super::$p::Mr {
            fn lkey(&self) -> u32 {
                super::$p::Mr::lkey(self)
            }
            fn rkey(&self) -> u32 {
                super::$p::Mr::rkey(self)
            }
            fn addr(&self) -> u64 {
                super::$p::Mr::addr(self)
            }
            fn len(&self) -> usize {
                super::$p::Mr::len(self)
            }
            fn access(&self) -> AccessFlags {
                super::$p::Mr::access(self)
            }
            fn raw(&self) -> u64 {
                super::$p::Mr::raw(self)
            }
        }

        impl CompletionChannel for super::$p::CompChannel {
            fn fd(&self) -> RawFd {
                super::$p::CompChannel::fd(self)
            }
            fn get_event(&self) -> Result<Option<u32>> {
                super::$p::CompChannel::get_event(self)
            }
        }

        impl CompletionQueue for super::$p::Cq {
            fn handle(&self) -> u32 {
                super::$p::Cq::handle(self)
            }
            fn capacity(&self) -> u32 {
                super::$p::Cq::capacity(self)
            }
            fn req_notify(&self, solicited_only: bool) -> Result<()> {
                super::$p::Cq::req_notify(self, solicited_only)
            }
            #[inline(always)]
            fn poll(&self, out: &mut [Completion]) -> Result<usize> {
                super::$p::Cq::poll(self, out)
            }
            fn ack_events(&self, n: u32) {
                super::$p::Cq::ack_events(self, n)
            }
        }

        impl QueuePairOps for super::$p::Qp {
            fn qp_num(&self) -> u32 {
                super::$p::Qp::qp_num(self)
            }
            fn qp_type(&self) -> QpType {
                super::$p::Qp::qp_type(self)
            }
            fn state(&self) -> QpState {
                super::$p::Qp::state(self)
            }
            fn caps(&self) -> QpCaps {
                super::$p::Qp::caps(self)
            }
            fn endpoint(&self, gid_index: u8) -> Result<Endpoint> {
                super::$p::Qp::endpoint(self, gid_index)
            }
            fn modify_to_init(&self, attr: &InitAttr) -> Result<()> {
                super::$p::Qp::modify_to_init(self, attr)
            }
            fn modify_to_rtr(&self, attr: &RtrAttr) -> Result<()> {
                super::$p::Qp::modify_to_rtr(self, attr)
            }
            fn modify_to_rts(&self, attr: &RtsAttr) -> Result<()> {
                super::$p::Qp::modify_to_rts(self, attr)
            }
            fn modify_to_err(&self) -> Result<()> {
                super::$p::Qp::modify_to_err(self)
            }
            fn modify_to_reset(&self) -> Result<()> {
                super::$p::Qp::modify_to_reset(self)
            }
            fn modify_ud_to_rts(&self, attr: &UdAttr) -> Result<()> {
                super::$p::Qp::modify_ud_to_rts(self, attr)
            }
            #[inline(always)]
            unsafe fn post_send(&self, wrs: &[SendWr]) -> std::result::Result<(), PostError> {
                // SAFETY: forwarded contract of this function.
                unsafe { super::$p::Qp::post_send(self, wrs) }
            }
            #[inline(always)]
            unsafe fn post_recv(&self, wrs: &[RecvWr]) -> std::result::Result<(), PostError> {
                // SAFETY: forwarded contract of this function.
                unsafe { super::$p::Qp::post_recv(self, wrs) }
            }
        }
    };
}

implement_contract!(soft);
#[cfg(feature = "ibverbs")]
implement_contract!(ibverbs);

/// The test-only fake provider has the objects a queue pair needs: a
/// completion channel, a CQ and the QP itself.
#[cfg(any(test, feature = "test-util"))]
mod fake_contract {
    use super::*;
    use crate::provider::fake;

    impl CompletionChannel for fake::CompChannel {
        fn fd(&self) -> RawFd {
            fake::CompChannel::fd(self)
        }
        fn get_event(&self) -> Result<Option<u32>> {
            fake::CompChannel::get_event(self)
        }
    }

    impl CompletionQueue for fake::Cq {
        fn handle(&self) -> u32 {
            fake::Cq::handle(self)
        }
        fn capacity(&self) -> u32 {
            fake::Cq::capacity(self)
        }
        fn req_notify(&self, solicited_only: bool) -> Result<()> {
            fake::Cq::req_notify(self, solicited_only)
        }
        #[inline(always)]
        fn poll(&self, out: &mut [Completion]) -> Result<usize> {
            fake::Cq::poll(self, out)
        }
        fn ack_events(&self, n: u32) {
            fake::Cq::ack_events(self, n)
        }
    }

    impl QueuePairOps for fake::Qp {
        fn qp_num(&self) -> u32 {
            fake::Qp::qp_num(self)
        }
        fn qp_type(&self) -> QpType {
            fake::Qp::qp_type(self)
        }
        fn state(&self) -> QpState {
            fake::Qp::state(self)
        }
        fn caps(&self) -> QpCaps {
            fake::Qp::caps(self)
        }
        fn endpoint(&self, gid_index: u8) -> Result<Endpoint> {
            fake::Qp::endpoint(self, gid_index)
        }
        fn modify_to_init(&self, attr: &InitAttr) -> Result<()> {
            fake::Qp::modify_to_init(self, attr)
        }
        fn modify_to_rtr(&self, attr: &RtrAttr) -> Result<()> {
            fake::Qp::modify_to_rtr(self, attr)
        }
        fn modify_to_rts(&self, attr: &RtsAttr) -> Result<()> {
            fake::Qp::modify_to_rts(self, attr)
        }
        fn modify_to_err(&self) -> Result<()> {
            fake::Qp::modify_to_err(self)
        }
        fn modify_to_reset(&self) -> Result<()> {
            fake::Qp::modify_to_reset(self)
        }
        fn modify_ud_to_rts(&self, attr: &UdAttr) -> Result<()> {
            fake::Qp::modify_ud_to_rts(self, attr)
        }
        #[inline(always)]
        unsafe fn post_send(&self, wrs: &[SendWr]) -> std::result::Result<(), PostError> {
            // SAFETY: forwarded contract of this function.
            unsafe { fake::Qp::post_send(self, wrs) }
        }
        unsafe fn post_recv(&self, wrs: &[RecvWr]) -> std::result::Result<(), PostError> {
            // SAFETY: forwarded contract of this function.
            unsafe { fake::Qp::post_recv(self, wrs) }
        }
    }
}
