//! The provider contract: a small, synchronous interface modelled on verbs,
//! implemented by the software RDMA device ([`soft`]) and, with the `ibverbs`
//! feature, by real hardware through libibverbs.
//!
//! Every object is a cheap handle (`Clone`, `Send + Sync`) that keeps its parents
//! alive: a [`Qp`] keeps its [`Pd`], CQs and [`Context`]; an [`Mr`] keeps its
//! [`Pd`]. Nothing above this module knows which provider it runs on.
//!
//! Dispatch is an enum per object ([`ProviderKind`] tells which); the
//! providers' own types have the same method names and signatures.

mod addr;
mod contract;
mod error;
#[cfg(any(test, feature = "test-util"))]
pub(crate) mod fake;
mod select;
pub mod soft;
mod types;

#[cfg(feature = "ibverbs")]
#[cfg_attr(docsrs, doc(cfg(feature = "ibverbs")))]
pub mod ibverbs;

use std::os::fd::RawFd;

pub use addr::{InvalidEndpoint, ProviderAddr, MAX_ADDR_LEN};
pub use error::{CompletionError, PostError, ProviderError, Result};
pub use select::{open_device, open_hardware_device, DEVICE_ENV, SYSFS_INFINIBAND};
pub use srq::Srq;
pub use types::*;

use contract::{
    AddressHandleOps, CompletionChannel, CompletionQueue, DeviceContext, MemoryRegion,
    MemoryWindow, ProtectionDomain, QueuePairOps, SharedReceiveQueue,
};

/// Calls the same method on whichever provider implements `$val`.
macro_rules! dispatch {
    ($imp:ident, $val:expr, |$x:ident| $body:expr) => {
        match $val {
            $imp::Soft($x) => $body,
            #[cfg(feature = "ibverbs")]
            $imp::Ibverbs($x) => $body,
        }
    };
}

/// [`dispatch!`] for the objects the test-only fake provider also has
/// (completion channels, CQs, QPs).
macro_rules! dispatch_q {
    ($imp:ident, $val:expr, |$x:ident| $body:expr) => {
        match $val {
            $imp::Soft($x) => $body,
            #[cfg(feature = "ibverbs")]
            $imp::Ibverbs($x) => $body,
            #[cfg(any(test, feature = "test-util"))]
            $imp::Fake($x) => $body,
        }
    };
}

// After the macros, which it uses.
mod srq;

/// Lists the devices of every provider: the software device `soft0` always,
/// then the hardware devices libibverbs finds (with the `ibverbs` feature).
pub fn devices() -> Result<Vec<DeviceInfo>> {
    #[allow(unused_mut)]
    let mut list = vec![soft::device_info()];
    #[cfg(feature = "ibverbs")]
    match ibverbs::devices() {
        Ok(found) => list.extend(found),
        Err(e) => tracing::debug!(error = %crate::report::ErrorChain(&e), "no ibverbs devices"),
    }
    Ok(list)
}

/// The capability flags of each provider: the one place that maps a
/// provider to what it does differently.
fn caps_of(kind: ProviderKind) -> ProviderCaps {
    match kind {
        ProviderKind::Soft => ProviderCaps {
            batches_posts: true,
            software: true,
            edge_triggered_channel: false,
        },
        ProviderKind::Ibverbs => ProviderCaps {
            batches_posts: false,
            software: false,
            edge_triggered_channel: true,
        },
    }
}

#[derive(Clone)]
enum ContextImp {
    Soft(soft::Context),
    #[cfg(feature = "ibverbs")]
    Ibverbs(ibverbs::Context),
}

/// An opened device (`ibv_context`). For the soft device this owns the engine
/// thread and its data-plane listener.
#[derive(Clone)]
pub struct Context {
    imp: ContextImp,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("name", &self.name())
            .field("kind", &self.kind())
            .finish()
    }
}

impl Context {
    /// Opens a new software device with its own engine thread.
    pub fn open_soft(config: SoftConfig) -> Result<Context> {
        Ok(Context {
            imp: ContextImp::Soft(soft::Context::open(config)?),
        })
    }

    /// Opens the device described by `info`.
    pub fn open(info: &DeviceInfo) -> Result<Context> {
        match info.kind {
            ProviderKind::Soft => Context::open_soft(SoftConfig {
                name: info.name.clone(),
                ..SoftConfig::default()
            }),
            #[cfg(feature = "ibverbs")]
            ProviderKind::Ibverbs => Ok(Context {
                imp: ContextImp::Ibverbs(ibverbs::Context::open(&info.name)?),
            }),
            #[allow(unreachable_patterns)]
            _ => Err(ProviderError::Unsupported {
                provider: "ibverbs",
                what: "built without the `ibverbs` feature",
            }),
        }
    }

    /// Which provider drives this device.
    pub fn kind(&self) -> ProviderKind {
        match &self.imp {
            ContextImp::Soft(_) => ProviderKind::Soft,
            #[cfg(feature = "ibverbs")]
            ContextImp::Ibverbs(_) => ProviderKind::Ibverbs,
        }
    }

    /// What this device's provider does differently (see [`ProviderCaps`]).
    pub fn provider_caps(&self) -> ProviderCaps {
        caps_of(self.kind())
    }

    /// Device name.
    pub fn name(&self) -> &str {
        dispatch!(ContextImp, &self.imp, |c| DeviceContext::name(c))
    }

    /// Device attributes (`ibv_query_device`).
    pub fn query_device(&self) -> Result<DeviceAttr> {
        dispatch!(ContextImp, &self.imp, |c| DeviceContext::query_device(c))
    }

    /// Port attributes (`ibv_query_port`), `port` is 1-based.
    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        dispatch!(ContextImp, &self.imp, |c| DeviceContext::query_port(
            c, port
        ))
    }

    /// One GID table entry (`ibv_query_gid`).
    pub fn query_gid(&self, port: u8, index: u32) -> Result<Gid> {
        dispatch!(ContextImp, &self.imp, |c| DeviceContext::query_gid(
            c, port, index
        ))
    }

    /// Allocates a protection domain.
    pub fn alloc_pd(&self) -> Result<Pd> {
        Ok(Pd {
            imp: match &self.imp {
                ContextImp::Soft(c) => PdImp::Soft(DeviceContext::alloc_pd(c)?),
                #[cfg(feature = "ibverbs")]
                ContextImp::Ibverbs(c) => PdImp::Ibverbs(DeviceContext::alloc_pd(c)?),
            },
        })
    }

    /// Creates a completion channel: a non-blocking pollable fd.
    pub fn create_comp_channel(&self) -> Result<CompChannel> {
        Ok(CompChannel {
            imp: match &self.imp {
                ContextImp::Soft(c) => CompChannelImp::Soft(DeviceContext::create_comp_channel(c)?),
                #[cfg(feature = "ibverbs")]
                ContextImp::Ibverbs(c) => {
                    CompChannelImp::Ibverbs(DeviceContext::create_comp_channel(c)?)
                }
            },
        })
    }

    /// Creates a CQ with room for at least `cqe` completions, optionally bound
    /// to a completion channel.
    pub fn create_cq(&self, cqe: u32, channel: Option<&CompChannel>) -> Result<Cq> {
        let imp = match &self.imp {
            ContextImp::Soft(c) => {
                let ch = match channel.map(|ch| &ch.imp) {
                    None => None,
                    Some(CompChannelImp::Soft(ch)) => Some(ch),
                    #[cfg(any(feature = "ibverbs", test, feature = "test-util"))]
                    Some(_) => return Err(mismatch("create_cq")),
                };
                CqImp::Soft(DeviceContext::create_cq(c, cqe, ch)?)
            }
            #[cfg(feature = "ibverbs")]
            ContextImp::Ibverbs(c) => {
                let ch = match channel.map(|ch| &ch.imp) {
                    None => None,
                    Some(CompChannelImp::Ibverbs(ch)) => Some(ch),
                    Some(_) => return Err(mismatch("create_cq")),
                };
                CqImp::Ibverbs(DeviceContext::create_cq(c, cqe, ch)?)
            }
        };
        Ok(Cq { imp })
    }

    /// The asynchronous-event fd (non-blocking; readable = an event is pending).
    pub fn async_fd(&self) -> RawFd {
        dispatch!(ContextImp, &self.imp, |c| DeviceContext::async_fd(c))
    }

    /// Takes (and acknowledges) the next asynchronous event, if any. Never blocks.
    pub fn get_async_event(&self) -> Result<Option<AsyncEvent>> {
        dispatch!(ContextImp, &self.imp, |c| DeviceContext::get_async_event(c))
    }

    /// The GID index to use on `port` by default: 0 for the soft device; for
    /// ibverbs see `ibverbs::Context::default_gid_index` (RoCE v2 IPv4-mapped
    /// preferred, `VERBIO_GID_INDEX` overrides).
    pub fn default_gid_index(&self, port: u8) -> Result<u8> {
        match &self.imp {
            ContextImp::Soft(_) => {
                let _ = port;
                Ok(0)
            }
            #[cfg(feature = "ibverbs")]
            ContextImp::Ibverbs(c) => c.default_gid_index(port),
        }
    }

    /// The ibverbs context behind this device (GID types, transport, ...), if it is one.
    #[cfg(feature = "ibverbs")]
    pub fn as_ibverbs(&self) -> Option<&ibverbs::Context> {
        match &self.imp {
            ContextImp::Ibverbs(c) => Some(c),
            _ => None,
        }
    }

    /// The software device behind this context, if it is one: its UD
    /// counters ([`soft::Context::ud_counters`]) and fault injection
    /// ([`soft::Context::set_ud_faults`]) for tests.
    pub fn as_soft(&self) -> Option<&soft::Context> {
        match &self.imp {
            ContextImp::Soft(c) => Some(c),
            #[cfg(feature = "ibverbs")]
            ContextImp::Ibverbs(_) => None,
        }
    }

    /// The device's address as its endpoints carry it
    /// ([`Endpoint::addr`]; the software device: its engine's data-plane
    /// socket address; empty for a provider that routes by LID/GID).
    pub fn addr(&self) -> ProviderAddr {
        match &self.imp {
            ContextImp::Soft(c) => ProviderAddr::socket(c.local_addr()),
            #[cfg(feature = "ibverbs")]
            ContextImp::Ibverbs(_) => ProviderAddr::NONE,
        }
    }
}

#[cfg(any(feature = "ibverbs", test, feature = "test-util"))]
fn mismatch(call: &'static str) -> ProviderError {
    ProviderError::InvalidArgument {
        call,
        what: "objects from different providers".to_string(),
    }
}

#[derive(Clone)]
enum PdImp {
    Soft(soft::Pd),
    #[cfg(feature = "ibverbs")]
    Ibverbs(ibverbs::Pd),
}

/// A protection domain: MRs and QPs of one PD can only reach each other.
#[derive(Clone)]
pub struct Pd {
    imp: PdImp,
}

impl Pd {
    /// Registers `[addr, addr + len)` for the device.
    ///
    /// # Safety
    ///
    /// The memory must stay valid (allocated, not moved) until the returned
    /// [`Mr`] and every clone of it is dropped, and while it is registered the
    /// device may read it (and write it, per `access`) at any time: the caller
    /// must not create Rust references to it that assume exclusive or
    /// unchanging contents while a work request or a peer may touch it.
    pub unsafe fn reg_mr(&self, addr: *mut u8, len: usize, access: AccessFlags) -> Result<Mr> {
        Ok(Mr {
            imp: match &self.imp {
                PdImp::Soft(p) => {
                    // SAFETY: forwarded contract of this function.
                    let mr = unsafe { ProtectionDomain::reg_mr(p, addr, len, access)? };
                    MrImp::Soft(mr)
                }
                #[cfg(feature = "ibverbs")]
                PdImp::Ibverbs(p) => {
                    // SAFETY: forwarded contract of this function.
                    let mr = unsafe { ProtectionDomain::reg_mr(p, addr, len, access)? };
                    MrImp::Ibverbs(mr)
                }
            },
        })
    }

    /// Creates an RC queue pair in RESET state.
    pub fn create_qp(&self, send_cq: &Cq, recv_cq: &Cq, caps: QpCaps) -> Result<Qp> {
        let imp = match (&self.imp, &send_cq.imp, &recv_cq.imp) {
            (PdImp::Soft(p), CqImp::Soft(s), CqImp::Soft(r)) => {
                QpImp::Soft(ProtectionDomain::create_qp(p, s, r, caps)?)
            }
            #[cfg(feature = "ibverbs")]
            (PdImp::Ibverbs(p), CqImp::Ibverbs(s), CqImp::Ibverbs(r)) => {
                QpImp::Ibverbs(ProtectionDomain::create_qp(p, s, r, caps)?)
            }
            #[cfg(any(feature = "ibverbs", test, feature = "test-util"))]
            _ => return Err(mismatch("create_qp")),
        };
        Ok(Qp { imp })
    }

    /// Creates a UD queue pair in RESET state; bring it up with
    /// [`Qp::modify_ud_to_rts`].
    pub fn create_ud_qp(&self, send_cq: &Cq, recv_cq: &Cq, caps: QpCaps) -> Result<Qp> {
        let imp = match (&self.imp, &send_cq.imp, &recv_cq.imp) {
            (PdImp::Soft(p), CqImp::Soft(s), CqImp::Soft(r)) => {
                QpImp::Soft(ProtectionDomain::create_ud_qp(p, s, r, caps)?)
            }
            #[cfg(feature = "ibverbs")]
            (PdImp::Ibverbs(p), CqImp::Ibverbs(s), CqImp::Ibverbs(r)) => {
                QpImp::Ibverbs(ProtectionDomain::create_ud_qp(p, s, r, caps)?)
            }
            #[cfg(any(feature = "ibverbs", test, feature = "test-util"))]
            _ => return Err(mismatch("create_ud_qp")),
        };
        Ok(Qp { imp })
    }

    /// Creates an address handle: the route UD datagrams take to the port
    /// `attr` names.
    pub fn create_ah(&self, attr: &AhAttr) -> Result<AddressHandle> {
        let imp = match &self.imp {
            PdImp::Soft(p) => AhImp::Soft(ProtectionDomain::create_ah(p, attr)?),
            #[cfg(feature = "ibverbs")]
            PdImp::Ibverbs(p) => AhImp::Ibverbs(ProtectionDomain::create_ah(p, attr)?),
        };
        Ok(AddressHandle { imp })
    }

    /// Allocates a type 2 memory window (`ibv_alloc_mw`), unbound: bind it
    /// with a [`SendOp::BindMw`] work request.
    pub fn alloc_mw(&self) -> Result<Mw> {
        let imp = match &self.imp {
            PdImp::Soft(p) => MwImp::Soft(ProtectionDomain::alloc_mw(p)?),
            #[cfg(feature = "ibverbs")]
            PdImp::Ibverbs(p) => MwImp::Ibverbs(ProtectionDomain::alloc_mw(p)?),
        };
        Ok(Mw { imp })
    }
}

#[derive(Clone)]
enum MwImp {
    Soft(soft::Mw),
    #[cfg(feature = "ibverbs")]
    Ibverbs(ibverbs::Mw),
}

/// A type 2 memory window (`ibv_mw`): a second rkey over part of a memory
/// region, bound and invalidated by work requests ([`SendOp::BindMw`],
/// [`SendOp::LocalInv`], a peer's [`SendOp::SendWithInv`]). Dropping the
/// last clone deallocates it; from then on its rkey fails at once.
#[derive(Clone)]
pub struct Mw {
    imp: MwImp,
}

impl Mw {
    /// The window's rkey: the one the last posted bind gives it (from the
    /// post on; the bind takes effect when the WR executes), or the
    /// allocated one before any bind.
    pub fn rkey(&self) -> u32 {
        dispatch!(MwImp, &self.imp, |m| MemoryWindow::rkey(m))
    }
    /// The rkey to give the window at its next bind ([`inc_rkey`] of
    /// [`rkey`](Self::rkey)).
    pub fn next_rkey(&self) -> u32 {
        inc_rkey(self.rkey())
    }
    /// The handle a [`SendOp::BindMw`] carries; valid while a clone of this
    /// lives.
    pub fn raw(&self) -> MwHandle {
        MwHandle(dispatch!(MwImp, &self.imp, |m| MemoryWindow::raw(m)))
    }
}

impl std::fmt::Debug for Mw {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mw").field("rkey", &self.rkey()).finish()
    }
}

#[derive(Clone)]
enum AhImp {
    Soft(soft::Ah),
    #[cfg(feature = "ibverbs")]
    Ibverbs(ibverbs::Ah),
}

/// An address handle (`ibv_ah`). UD work requests name it by its
/// [`raw`](Self::raw) handle, which is valid while any clone of this lives;
/// dropping the last clone destroys it.
#[derive(Clone)]
pub struct AddressHandle {
    imp: AhImp,
}

impl AddressHandle {
    /// The handle a [`UdDest`] carries.
    pub fn raw(&self) -> AhHandle {
        dispatch!(AhImp, &self.imp, |a| AddressHandleOps::raw(a))
    }
}

impl std::fmt::Debug for AddressHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("AddressHandle").field(&self.raw()).finish()
    }
}

#[derive(Clone)]
enum MrImp {
    Soft(soft::Mr),
    #[cfg(feature = "ibverbs")]
    Ibverbs(ibverbs::Mr),
}

/// A registered memory region. Dropping the last clone deregisters it; from
/// then on its rkey fails at once and the device never touches the memory.
#[derive(Clone)]
pub struct Mr {
    imp: MrImp,
}

impl std::fmt::Debug for Mr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mr")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("lkey", &self.lkey())
            .field("rkey", &self.rkey())
            .field("access", &self.access())
            .finish()
    }
}

impl Mr {
    /// Local key, for SGEs.
    pub fn lkey(&self) -> u32 {
        dispatch!(MrImp, &self.imp, |m| MemoryRegion::lkey(m))
    }
    /// Remote key, for peers.
    pub fn rkey(&self) -> u32 {
        dispatch!(MrImp, &self.imp, |m| MemoryRegion::rkey(m))
    }
    /// Start address.
    pub fn addr(&self) -> u64 {
        dispatch!(MrImp, &self.imp, |m| MemoryRegion::addr(m))
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        dispatch!(MrImp, &self.imp, |m| MemoryRegion::len(m))
    }
    /// True for a zero-length region.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Access flags it was registered with.
    pub fn access(&self) -> AccessFlags {
        dispatch!(MrImp, &self.imp, |m| MemoryRegion::access(m))
    }
    /// The handle a [`SendOp::BindMw`] carries; valid while a clone of this
    /// lives.
    pub fn raw(&self) -> MrHandle {
        MrHandle(dispatch!(MrImp, &self.imp, |m| MemoryRegion::raw(m)))
    }
    /// Runs `f` ordered with the device's own Rust threads' accesses to the
    /// memory (the soft device's lock; hardware has no such threads).
    pub(crate) fn with_memory<R>(&self, f: impl FnOnce() -> R) -> R {
        match &self.imp {
            MrImp::Soft(m) => m.with_memory(f),
            #[cfg(feature = "ibverbs")]
            MrImp::Ibverbs(_) => f(),
        }
    }
}

#[derive(Clone)]
enum CompChannelImp {
    Soft(soft::CompChannel),
    #[cfg(feature = "ibverbs")]
    Ibverbs(ibverbs::CompChannel),
    #[cfg(any(test, feature = "test-util"))]
    Fake(fake::CompChannel),
}

/// A completion channel (`ibv_comp_channel`): its fd becomes readable when an
/// armed CQ bound to it receives a completion.
#[derive(Clone)]
pub struct CompChannel {
    imp: CompChannelImp,
}

impl CompChannel {
    /// What this channel's provider does differently (see
    /// [`ProviderCaps`]); the test-only fake has the software device's.
    pub fn provider_caps(&self) -> ProviderCaps {
        caps_of(match &self.imp {
            CompChannelImp::Soft(_) => ProviderKind::Soft,
            #[cfg(feature = "ibverbs")]
            CompChannelImp::Ibverbs(_) => ProviderKind::Ibverbs,
            #[cfg(any(test, feature = "test-util"))]
            CompChannelImp::Fake(_) => ProviderKind::Soft,
        })
    }

    /// The non-blocking fd to register with a poller.
    pub fn fd(&self) -> RawFd {
        dispatch_q!(CompChannelImp, &self.imp, |c| CompletionChannel::fd(c))
    }
    /// Takes one pending CQ event: the handle of the CQ that fired, or `None`
    /// if nothing is pending. Never blocks. Each event must later be
    /// acknowledged with [`Cq::ack_events`] (in batches).
    pub fn get_event(&self) -> Result<Option<u32>> {
        dispatch_q!(CompChannelImp, &self.imp, |c| CompletionChannel::get_event(
            c
        ))
    }
}

#[derive(Clone)]
enum CqImp {
    Soft(soft::Cq),
    #[cfg(feature = "ibverbs")]
    Ibverbs(ibverbs::Cq),
    #[cfg(any(test, feature = "test-util"))]
    Fake(fake::Cq),
}

/// A completion queue.
#[derive(Clone)]
pub struct Cq {
    imp: CqImp,
}

impl Cq {
    /// A handle unique within the context; what [`CompChannel::get_event`] returns.
    pub fn handle(&self) -> u32 {
        dispatch_q!(CqImp, &self.imp, |c| CompletionQueue::handle(c))
    }
    /// Number of entries the CQ holds.
    pub fn capacity(&self) -> u32 {
        dispatch_q!(CqImp, &self.imp, |c| CompletionQueue::capacity(c))
    }
    /// Arms the CQ: the next completion (the next solicited one if
    /// `solicited_only`) signals the channel once.
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        dispatch_q!(CqImp, &self.imp, |c| CompletionQueue::req_notify(
            c,
            solicited_only
        ))
    }
    /// Moves up to `out.len()` completions into `out`; returns how many. Never
    /// blocks. Fails with [`ProviderError::CqOverflow`] once completions were lost.
    #[inline]
    pub fn poll(&self, out: &mut [Completion]) -> Result<usize> {
        dispatch_q!(CqImp, &self.imp, |c| CompletionQueue::poll(c, out))
    }
    /// Acknowledges `n` events taken from the channel for this CQ.
    pub fn ack_events(&self, n: u32) {
        dispatch_q!(CqImp, &self.imp, |c| CompletionQueue::ack_events(c, n))
    }
}

#[derive(Clone)]
enum QpImp {
    Soft(soft::Qp),
    #[cfg(feature = "ibverbs")]
    Ibverbs(ibverbs::Qp),
    #[cfg(any(test, feature = "test-util"))]
    Fake(fake::Qp),
}

/// A queue pair: reliable connected ([`Pd::create_qp`]) or unreliable
/// datagram ([`Pd::create_ud_qp`]).
#[derive(Clone)]
pub struct Qp {
    imp: QpImp,
}

impl Qp {
    /// Which provider drives this QP.
    ///
    /// The test-only fake (feature `test-util`) reports the software
    /// device's kind: it stands in for it in unit tests.
    pub fn kind(&self) -> ProviderKind {
        match &self.imp {
            QpImp::Soft(_) => ProviderKind::Soft,
            #[cfg(feature = "ibverbs")]
            QpImp::Ibverbs(_) => ProviderKind::Ibverbs,
            #[cfg(any(test, feature = "test-util"))]
            QpImp::Fake(_) => ProviderKind::Soft,
        }
    }

    /// What this QP's provider does differently (see [`ProviderCaps`]); the
    /// test-only fake has the software device's.
    pub fn provider_caps(&self) -> ProviderCaps {
        caps_of(self.kind())
    }

    /// The libibverbs QP, if this is one.
    #[cfg(feature = "ibverbs")]
    pub(crate) fn as_ibverbs(&self) -> Option<&ibverbs::Qp> {
        match &self.imp {
            QpImp::Ibverbs(q) => Some(q),
            _ => None,
        }
    }
}

/// The test-only fake provider's objects as provider handles.
#[cfg(any(test, feature = "test-util"))]
impl Qp {
    pub(crate) fn fake(qp: fake::Qp) -> Qp {
        Qp {
            imp: QpImp::Fake(qp),
        }
    }

    /// True for a QP of the test-only fake provider.
    pub fn is_fake(&self) -> bool {
        matches!(self.imp, QpImp::Fake(_))
    }
}

#[cfg(any(test, feature = "test-util"))]
impl Cq {
    pub(crate) fn fake(cq: fake::Cq) -> Cq {
        Cq {
            imp: CqImp::Fake(cq),
        }
    }
}

#[cfg(any(test, feature = "test-util"))]
impl CompChannel {
    pub(crate) fn fake(ch: fake::CompChannel) -> CompChannel {
        CompChannel {
            imp: CompChannelImp::Fake(ch),
        }
    }
}

impl std::fmt::Debug for Qp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qp")
            .field("qp_num", &self.qp_num())
            .field("state", &self.state())
            .finish()
    }
}

impl Qp {
    /// QP number.
    pub fn qp_num(&self) -> u32 {
        dispatch_q!(QpImp, &self.imp, |q| QueuePairOps::qp_num(q))
    }
    /// RC or UD.
    pub fn qp_type(&self) -> QpType {
        dispatch_q!(QpImp, &self.imp, |q| QueuePairOps::qp_type(q))
    }
    /// Current state (ERR once an error completion was generated).
    pub fn state(&self) -> QpState {
        dispatch_q!(QpImp, &self.imp, |q| QueuePairOps::state(q))
    }
    /// Actual queue sizes (at least those requested).
    pub fn caps(&self) -> QpCaps {
        dispatch_q!(QpImp, &self.imp, |q| QueuePairOps::caps(q))
    }
    /// What the peer needs to connect to this QP (port 1, GID index `gid_index`).
    pub fn endpoint(&self, gid_index: u8) -> Result<Endpoint> {
        dispatch_q!(QpImp, &self.imp, |q| QueuePairOps::endpoint(q, gid_index))
    }
    /// RESET → INIT.
    pub fn modify_to_init(&self, attr: &InitAttr) -> Result<()> {
        dispatch_q!(QpImp, &self.imp, |q| QueuePairOps::modify_to_init(q, attr))
    }
    /// INIT → RTR: connects to the peer's endpoint.
    pub fn modify_to_rtr(&self, attr: &RtrAttr) -> Result<()> {
        dispatch_q!(QpImp, &self.imp, |q| QueuePairOps::modify_to_rtr(q, attr))
    }
    /// RTR → RTS.
    pub fn modify_to_rts(&self, attr: &RtsAttr) -> Result<()> {
        dispatch_q!(QpImp, &self.imp, |q| QueuePairOps::modify_to_rts(q, attr))
    }
    /// Any state → ERR: every outstanding and later-posted WR completes with `WR_FLUSH_ERR`.
    pub fn modify_to_err(&self) -> Result<()> {
        dispatch_q!(QpImp, &self.imp, |q| QueuePairOps::modify_to_err(q))
    }
    /// Any state → RESET (queues emptied without completions).
    pub fn modify_to_reset(&self) -> Result<()> {
        dispatch_q!(QpImp, &self.imp, |q| QueuePairOps::modify_to_reset(q))
    }
    /// UD only: RESET → INIT → RTR → RTS, ready to send and receive
    /// datagrams carrying `attr.qkey`.
    pub fn modify_ud_to_rts(&self, attr: &UdAttr) -> Result<()> {
        dispatch_q!(QpImp, &self.imp, |q| QueuePairOps::modify_ud_to_rts(
            q, attr
        ))
    }
    /// Posts a list of send WRs with one doorbell.
    ///
    /// On failure, [`PostError::posted`] counts the leading WRs that were
    /// accepted; the device never touches the memory of the others.
    ///
    /// # Safety
    ///
    /// Posting lends local memory to the device, which reads it (SEND and
    /// WRITE payloads) or writes it (READ destinations, atomic results)
    /// asynchronously, by DMA. For every SGE of every posted WR, the caller
    /// guarantees that from this call until the device is done with that WR:
    ///
    /// - the range `[addr, addr + length)` stays allocated and in place;
    /// - no Rust reference (`&` or `&mut`) to any byte of it is used, and
    ///   nothing but the device writes it. Exception: memory the device only
    ///   reads (the SGEs of SEND and WRITE WRs) may be read through shared
    ///   references meanwhile.
    ///
    /// The device is done with a WR once its completion (success, error or
    /// `WR_FLUSH_ERR`) has been polled from the send CQ; for an unsignaled WR,
    /// once the completion of a later WR of this send queue has been polled;
    /// or once the registration the SGE's `lkey` names has been deregistered
    /// (every [`Mr`] handle of it dropped), which revokes the device's access.
    ///
    /// The obligation covers the SGEs the device may access: those whose
    /// `lkey` names a live registration that contains the whole range. Any
    /// other SGE makes the WR fail with an error completion, unaccessed.
    ///
    /// An [`INLINE`](SendFlags::INLINE) WR's payload is copied during this
    /// call: its SGEs need only be readable (allocated, not written by
    /// anyone) until the call returns; their lkeys are not used.
    ///
    /// A [`SendOp::SendTo`] WR's `dest.ah` must name a live
    /// [`AddressHandle`] (a clone of it alive) until the WR is done: the
    /// ibverbs provider hands the handle's pointer to the device. Likewise
    /// a [`SendOp::BindMw`] WR's `mw` and `mr` must name a live [`Mw`] and
    /// [`Mr`] of this QP's device until the WR is done, and the region must
    /// stay registered while the window is bound to it (rxe refuses to
    /// deregister it meanwhile).
    ///
    /// Remote addresses and rkeys are not part of this contract: the peer's
    /// responder checks them against its own registrations.
    pub unsafe fn post_send(&self, wrs: &[SendWr]) -> Result<(), PostError> {
        // SAFETY: forwarded contract of this function.
        dispatch_q!(QpImp, &self.imp, |q| unsafe {
            QueuePairOps::post_send(q, wrs)
        })
    }

    /// Posts a list of receive WRs with one doorbell.
    ///
    /// On failure, [`PostError::posted`] counts the leading WRs that were
    /// accepted; the device never touches the memory of the others.
    ///
    /// # Safety
    ///
    /// The device writes an incoming SEND's payload into the SGEs of a
    /// receive WR asynchronously, by DMA. For every SGE of every posted WR,
    /// the caller guarantees that from this call until the device is done
    /// with that WR, the range `[addr, addr + length)` stays allocated and in
    /// place, and no Rust reference (`&` or `&mut`) to any byte of it is used
    /// and nothing but the device writes it.
    ///
    /// The device is done with a receive WR once its completion (success,
    /// error or `WR_FLUSH_ERR`) has been polled from the receive CQ, or once
    /// the registration the SGE's `lkey` names has been deregistered (every
    /// [`Mr`] handle of it dropped), which revokes the device's access.
    ///
    /// As for [`post_send`](Self::post_send), the obligation covers the SGEs
    /// whose `lkey` names a live registration containing the whole range;
    /// any other SGE makes a message landing in that WR fail, unaccessed.
    #[inline]
    pub unsafe fn post_recv(&self, wrs: &[RecvWr]) -> Result<(), PostError> {
        // SAFETY: forwarded contract of this function.
        dispatch_q!(QpImp, &self.imp, |q| unsafe {
            QueuePairOps::post_recv(q, wrs)
        })
    }
}
