//! Plain data types of the provider contract: work requests, completions,
//! access flags, queue-pair attributes and endpoints. They mirror the verbs
//! structures (`ibv_send_wr`, `ibv_wc`, `ibv_qp_attr`, ...) with Rust names.

use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use smallvec::SmallVec;

use super::ProviderAddr;

/// Which provider implements a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProviderKind {
    /// The built-in software RDMA device (`provider::soft`).
    Soft,
    /// A real RDMA device through libibverbs (`provider::ibverbs`).
    Ibverbs,
}

impl fmt::Display for ProviderKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ProviderKind::Soft => "soft",
            ProviderKind::Ibverbs => "ibverbs",
        })
    }
}

/// What a provider does differently, as flags the layers above test instead
/// of asking which provider it is ([`Qp::provider_caps`](super::Qp::provider_caps),
/// [`Context::provider_caps`](super::Context::provider_caps)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct ProviderCaps {
    /// One post of a list of work requests costs about what one post of a
    /// single one does (it takes the QP's lock and wakes the device once), so
    /// a QP gathers single-WR posts of one phase into one list by default
    /// (`QueuePair::set_doorbell_batching`). Off where the doorbell runs the
    /// requester in the posting thread (rxe): there one doorbell per WR
    /// keeps it busy sooner.
    pub batches_posts: bool,
    /// A device in this process's own memory (software), not hardware
    /// behind a driver.
    pub software: bool,
    /// The completion channel's fd raises new readiness for every CQ event
    /// on its own (a verbs channel: the kernel makes it readable per
    /// event), so a poller watching it edge-triggered, directly or through
    /// nested epoll sets, never misses one and need not look for events it
    /// was not told of. A runtime hosted on another executor skips its
    /// nested `epoll_wait` when that executor saw no readiness only if
    /// every channel it serves has this flag. Off for the software device:
    /// its channel does raise readiness per event and per arriving packet
    /// (its eventfd is written for every event, its sockets wake it on
    /// every arrival), but with it on, a hosted runtime's echo at one in
    /// flight took 3 µs longer (docs/benchmarks.md, "The added CPU by
    /// thread").
    pub edge_triggered_channel: bool,
}

/// Memory-region and queue-pair access flags (`ibv_access_flags`, same bit values).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct AccessFlags(u32);

impl AccessFlags {
    /// No access beyond local read.
    pub const NONE: AccessFlags = AccessFlags(0);
    /// `IBV_ACCESS_LOCAL_WRITE`: the device may write the region locally (RECV, READ results).
    pub const LOCAL_WRITE: AccessFlags = AccessFlags(1);
    /// `IBV_ACCESS_REMOTE_WRITE`: peers may RDMA WRITE into the region.
    pub const REMOTE_WRITE: AccessFlags = AccessFlags(1 << 1);
    /// `IBV_ACCESS_REMOTE_READ`: peers may RDMA READ from the region.
    pub const REMOTE_READ: AccessFlags = AccessFlags(1 << 2);
    /// `IBV_ACCESS_REMOTE_ATOMIC`: peers may run atomics on the region.
    pub const REMOTE_ATOMIC: AccessFlags = AccessFlags(1 << 3);
    /// Everything: local write plus all remote access.
    pub const ALL: AccessFlags = AccessFlags(0b1111);
    /// `IBV_ACCESS_MW_BIND`: memory windows may be bound to the region
    /// (see [`SendOp::BindMw`]).
    pub const MW_BIND: AccessFlags = AccessFlags(1 << 4);

    /// The raw verbs bit mask.
    pub const fn bits(self) -> u32 {
        self.0
    }
    /// Builds flags from a raw mask, dropping unknown bits.
    pub const fn from_bits_truncate(bits: u32) -> AccessFlags {
        AccessFlags(bits & (Self::ALL.0 | Self::MW_BIND.0))
    }
    /// True if every flag in `other` is set in `self`.
    pub const fn contains(self, other: AccessFlags) -> bool {
        self.0 & other.0 == other.0
    }
    /// True if no flag is set.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }
}

impl std::ops::BitOr for AccessFlags {
    type Output = AccessFlags;
    fn bitor(self, rhs: AccessFlags) -> AccessFlags {
        AccessFlags(self.0 | rhs.0)
    }
}
impl std::ops::BitOrAssign for AccessFlags {
    fn bitor_assign(&mut self, rhs: AccessFlags) {
        self.0 |= rhs.0;
    }
}
impl std::ops::BitAnd for AccessFlags {
    type Output = AccessFlags;
    fn bitand(self, rhs: AccessFlags) -> AccessFlags {
        AccessFlags(self.0 & rhs.0)
    }
}

impl fmt::Debug for AccessFlags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = [
            (Self::LOCAL_WRITE, "LOCAL_WRITE"),
            (Self::REMOTE_WRITE, "REMOTE_WRITE"),
            (Self::REMOTE_READ, "REMOTE_READ"),
            (Self::REMOTE_ATOMIC, "REMOTE_ATOMIC"),
            (Self::MW_BIND, "MW_BIND"),
        ];
        let mut first = true;
        for (flag, name) in names {
            if self.contains(flag) {
                if !first {
                    f.write_str("|")?;
                }
                f.write_str(name)?;
                first = false;
            }
        }
        if first {
            f.write_str("NONE")?;
        }
        Ok(())
    }
}

/// Flags of a send work request (`ibv_send_flags`, same bit values).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct SendFlags(u32);

impl SendFlags {
    /// No flag: an unsignaled WR (unless the QP signals all).
    pub const NONE: SendFlags = SendFlags(0);
    /// `IBV_SEND_FENCE`: wait for prior READs/atomics before starting.
    pub const FENCE: SendFlags = SendFlags(1);
    /// `IBV_SEND_SIGNALED`: produce a completion.
    pub const SIGNALED: SendFlags = SendFlags(1 << 1);
    /// `IBV_SEND_SOLICITED`: set the solicited-event bit at the responder.
    pub const SOLICITED: SendFlags = SendFlags(1 << 2);
    /// `IBV_SEND_INLINE`: copy the payload at post time; lkeys are not checked.
    pub const INLINE: SendFlags = SendFlags(1 << 3);

    /// The raw verbs bit mask.
    pub const fn bits(self) -> u32 {
        self.0
    }
    /// True if every flag in `other` is set in `self`.
    pub const fn contains(self, other: SendFlags) -> bool {
        self.0 & other.0 == other.0
    }
    /// The flags set in both `self` and `other`.
    pub const fn intersection(self, other: SendFlags) -> SendFlags {
        SendFlags(self.0 & other.0)
    }
}

impl std::ops::BitOr for SendFlags {
    type Output = SendFlags;
    fn bitor(self, rhs: SendFlags) -> SendFlags {
        SendFlags(self.0 | rhs.0)
    }
}
impl std::ops::BitOrAssign for SendFlags {
    fn bitor_assign(&mut self, rhs: SendFlags) {
        self.0 |= rhs.0;
    }
}

/// One scatter/gather element (`ibv_sge`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Sge {
    /// Start address of the local memory.
    pub addr: u64,
    /// Length in bytes.
    pub length: u32,
    /// Local key of the memory region that contains `[addr, addr + length)`.
    pub lkey: u32,
}

/// Scatter/gather list. One element lives inline (no allocation), the
/// common case of a WR over one buffer; longer lists go to the heap. One
/// element keeps [`SendWr`] small: it is moved by value on the way to the
/// post (72 bytes, where four inline elements made it 120).
pub type SgList = SmallVec<[Sge; 1]>;

/// What a send work request does (`ibv_wr_opcode` plus its remote arguments).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SendOp {
    /// SEND: consumes the next RECV at the responder.
    Send,
    /// SEND with 32-bit immediate data.
    SendWithImm {
        /// Immediate data, delivered in the receive completion.
        imm: u32,
    },
    /// RDMA WRITE of the local SGEs to `[remote_addr, ..)`.
    Write {
        /// Remote virtual address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
    },
    /// RDMA WRITE with immediate: also consumes a RECV at the responder.
    WriteWithImm {
        /// Remote virtual address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
        /// Immediate data.
        imm: u32,
    },
    /// RDMA READ of `[remote_addr, ..)` into the local SGEs.
    Read {
        /// Remote virtual address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
    },
    /// 64-bit compare-and-swap; the original value lands in the local SGE (8 bytes).
    CompareAndSwap {
        /// Remote virtual address (8-byte aligned).
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
        /// Value to compare with.
        compare: u64,
        /// Value stored if equal.
        swap: u64,
    },
    /// 64-bit fetch-and-add; the original value lands in the local SGE (8 bytes).
    FetchAndAdd {
        /// Remote virtual address (8-byte aligned).
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
        /// Value to add.
        add: u64,
    },
    /// Binds a type 2 memory window to `[addr, addr + len)` of a memory
    /// region (`IBV_WR_BIND_MW`, as `ibv_wr_bind_mw`): from its completion
    /// on, peers reach that range through `rkey` over this QP only, with
    /// `access` (remote flags only). The window must be unbound (freshly
    /// allocated or invalidated), the region must allow
    /// [`AccessFlags::MW_BIND`] (and `LOCAL_WRITE` for a writable window),
    /// the range must lie inside the region, and `rkey` must be the window's
    /// current rkey with only its low byte changed
    /// ([`Mw::next_rkey`](super::Mw::next_rkey)); otherwise the WR
    /// completes `MW_BIND_ERR` and the QP fails. RC only, no SGEs.
    BindMw {
        /// The window ([`Mw::raw`](super::Mw::raw)); it must stay alive
        /// until the WR is done.
        mw: MwHandle,
        /// The region ([`Mr::raw`](super::Mr::raw)); it must stay alive
        /// while the window is bound to it.
        mr: MrHandle,
        /// Start of the window (an address inside the region).
        addr: u64,
        /// Length of the window in bytes (non-zero).
        len: u64,
        /// What peers may do through the window.
        access: AccessFlags,
        /// The window's rkey once bound.
        rkey: u32,
    },
    /// Invalidates the memory window `rkey` names (`IBV_WR_LOCAL_INV`):
    /// once it completes, every access through `rkey` fails. An rkey that
    /// names no bound window completes `LOC_QP_OP_ERR` and fails the QP.
    /// No SGEs.
    LocalInv {
        /// The window's current rkey.
        rkey: u32,
    },
    /// SEND that also invalidates the responder's memory window `rkey`
    /// names (`IBV_WR_SEND_WITH_INV`), before the receive completes; the
    /// receive completion carries [`Completion::with_inv`].
    SendWithInv {
        /// The rkey of a window bound at the responder, over the QP this
        /// SEND reaches.
        rkey: u32,
    },
    /// A UD datagram (SEND, or SEND with immediate when `imm` is set) to
    /// one remote QP. Only UD QPs accept it; the payload must fit the path
    /// MTU.
    SendTo {
        /// Where it goes.
        dest: UdDest,
        /// Immediate data, delivered in the receive completion.
        imm: Option<u32>,
    },
}

impl SendOp {
    /// The opcode a successful completion of this WR reports.
    pub fn completion_opcode(&self) -> WcOpcode {
        match self {
            SendOp::Send
            | SendOp::SendWithImm { .. }
            | SendOp::SendTo { .. }
            | SendOp::SendWithInv { .. } => WcOpcode::Send,
            SendOp::BindMw { .. } => WcOpcode::BindMw,
            SendOp::LocalInv { .. } => WcOpcode::LocalInv,
            SendOp::Write { .. } | SendOp::WriteWithImm { .. } => WcOpcode::RdmaWrite,
            SendOp::Read { .. } => WcOpcode::RdmaRead,
            SendOp::CompareAndSwap { .. } => WcOpcode::CompSwap,
            SendOp::FetchAndAdd { .. } => WcOpcode::FetchAdd,
        }
    }
}

/// A provider's raw name for a live memory window, as
/// [`SendOp::BindMw`] carries it. Only [`Mw::raw`](super::Mw::raw) makes one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MwHandle(pub(crate) u64);

/// A provider's raw name for a live memory region, as [`SendOp::BindMw`]
/// carries it. Only [`Mr::raw`](super::Mr::raw) makes one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MrHandle(pub(crate) u64);

/// The rkey a type 2 window gets at its next bind: `rkey` with its low
/// (key) byte incremented, as `ibv_inc_rkey` computes it.
pub const fn inc_rkey(rkey: u32) -> u32 {
    (rkey & !0xff) | (rkey.wrapping_add(1) & 0xff)
}

/// A send-queue work request (`ibv_send_wr`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SendWr {
    /// Returned unchanged in the completion.
    pub wr_id: u64,
    /// Local memory (gather for SEND/WRITE, scatter for READ/atomics).
    pub sg_list: SgList,
    /// The operation.
    pub op: SendOp,
    /// Signaled, inline, fence, solicited.
    pub flags: SendFlags,
}

/// Sizes and limit of a shared receive queue (`ibv_srq_attr`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SrqAttr {
    /// Receive WRs the SRQ holds.
    pub max_wr: u32,
    /// SGEs per receive WR.
    pub max_sge: u32,
    /// The limit: when an incoming message leaves fewer WRs than this
    /// posted, the device raises [`AsyncEventKind::SrqLimitReached`] once
    /// and disarms it (0 = disarmed).
    pub srq_limit: u32,
}

/// A receive-queue work request (`ibv_recv_wr`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecvWr {
    /// Returned unchanged in the completion.
    pub wr_id: u64,
    /// Where an incoming SEND's payload is scattered.
    pub sg_list: SgList,
}

/// Work-completion status (`ibv_wc_status`, same numeric values).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
#[allow(missing_docs)]
pub enum WcStatus {
    Success = 0,
    LocLenErr = 1,
    LocQpOpErr = 2,
    LocEecOpErr = 3,
    LocProtErr = 4,
    WrFlushErr = 5,
    MwBindErr = 6,
    BadRespErr = 7,
    LocAccessErr = 8,
    RemInvReqErr = 9,
    RemAccessErr = 10,
    RemOpErr = 11,
    RetryExcErr = 12,
    RnrRetryExcErr = 13,
    LocRddViolErr = 14,
    RemInvRdReqErr = 15,
    RemAbortErr = 16,
    InvEecnErr = 17,
    InvEecStateErr = 18,
    FatalErr = 19,
    RespTimeoutErr = 20,
    GeneralErr = 21,
    TmErr = 22,
    TmRndvIncomplete = 23,
}

impl WcStatus {
    /// Converts the raw verbs value; unknown values map to `GeneralErr`.
    pub fn from_raw(raw: u32) -> WcStatus {
        use WcStatus::*;
        const ALL: [WcStatus; 24] = [
            Success,
            LocLenErr,
            LocQpOpErr,
            LocEecOpErr,
            LocProtErr,
            WrFlushErr,
            MwBindErr,
            BadRespErr,
            LocAccessErr,
            RemInvReqErr,
            RemAccessErr,
            RemOpErr,
            RetryExcErr,
            RnrRetryExcErr,
            LocRddViolErr,
            RemInvRdReqErr,
            RemAbortErr,
            InvEecnErr,
            InvEecStateErr,
            FatalErr,
            RespTimeoutErr,
            GeneralErr,
            TmErr,
            TmRndvIncomplete,
        ];
        ALL.get(raw as usize).copied().unwrap_or(GeneralErr)
    }

    /// The verbs name, e.g. `"IBV_WC_REM_ACCESS_ERR"`.
    pub fn name(self) -> &'static str {
        use WcStatus::*;
        match self {
            Success => "IBV_WC_SUCCESS",
            LocLenErr => "IBV_WC_LOC_LEN_ERR",
            LocQpOpErr => "IBV_WC_LOC_QP_OP_ERR",
            LocEecOpErr => "IBV_WC_LOC_EEC_OP_ERR",
            LocProtErr => "IBV_WC_LOC_PROT_ERR",
            WrFlushErr => "IBV_WC_WR_FLUSH_ERR",
            MwBindErr => "IBV_WC_MW_BIND_ERR",
            BadRespErr => "IBV_WC_BAD_RESP_ERR",
            LocAccessErr => "IBV_WC_LOC_ACCESS_ERR",
            RemInvReqErr => "IBV_WC_REM_INV_REQ_ERR",
            RemAccessErr => "IBV_WC_REM_ACCESS_ERR",
            RemOpErr => "IBV_WC_REM_OP_ERR",
            RetryExcErr => "IBV_WC_RETRY_EXC_ERR",
            RnrRetryExcErr => "IBV_WC_RNR_RETRY_EXC_ERR",
            LocRddViolErr => "IBV_WC_LOC_RDD_VIOL_ERR",
            RemInvRdReqErr => "IBV_WC_REM_INV_RD_REQ_ERR",
            RemAbortErr => "IBV_WC_REM_ABORT_ERR",
            InvEecnErr => "IBV_WC_INV_EECN_ERR",
            InvEecStateErr => "IBV_WC_INV_EEC_STATE_ERR",
            FatalErr => "IBV_WC_FATAL_ERR",
            RespTimeoutErr => "IBV_WC_RESP_TIMEOUT_ERR",
            GeneralErr => "IBV_WC_GENERAL_ERR",
            TmErr => "IBV_WC_TM_ERR",
            TmRndvIncomplete => "IBV_WC_TM_RNDV_INCOMPLETE",
        }
    }

    /// True for `Success`.
    pub fn is_success(self) -> bool {
        self == WcStatus::Success
    }
}

impl fmt::Display for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Work-completion opcode (`ibv_wc_opcode`, same numeric values).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
#[allow(missing_docs)]
pub enum WcOpcode {
    Send = 0,
    RdmaWrite = 1,
    RdmaRead = 2,
    CompSwap = 3,
    FetchAdd = 4,
    BindMw = 5,
    LocalInv = 6,
    Tso = 7,
    Recv = 128,
    RecvRdmaWithImm = 129,
}

impl WcOpcode {
    /// Converts the raw verbs value (`None` if unknown).
    pub fn from_raw(raw: u32) -> Option<WcOpcode> {
        use WcOpcode::*;
        Some(match raw {
            0 => Send,
            1 => RdmaWrite,
            2 => RdmaRead,
            3 => CompSwap,
            4 => FetchAdd,
            5 => BindMw,
            6 => LocalInv,
            7 => Tso,
            128 => Recv,
            129 => RecvRdmaWithImm,
            _ => return None,
        })
    }
}

/// A work completion (`ibv_wc`).
///
/// Error completions carry only `wr_id`, `status`, `qp_num` and `vendor_err`
/// reliably; like hardware, their `opcode` and `byte_len` are unspecified
/// (the soft device reports the WR's opcode and `byte_len` 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The work request's id.
    pub wr_id: u64,
    /// Outcome.
    pub status: WcStatus,
    /// Which operation completed.
    pub opcode: WcOpcode,
    /// Bytes received (RECV, WRITE_WITH_IMM) or transferred.
    pub byte_len: u32,
    /// Immediate data (`IBV_WC_WITH_IMM`), host byte order.
    pub imm_data: Option<u32>,
    /// The local QP number the WR belonged to.
    pub qp_num: u32,
    /// Vendor-specific error syndrome (0 when none).
    pub vendor_err: u32,
    /// UD receives: the sender's QP number (0 otherwise).
    pub src_qp: u32,
    /// UD receives: the sender's LID (InfiniBand; 0 on RoCE and the soft device).
    pub slid: u16,
    /// UD receives: `IBV_WC_GRH`, the first [`GRH_LEN`] bytes of the
    /// receive buffer hold the packet's global route header (always on
    /// RoCE and the soft device); read its source with [`Grh::parse`].
    pub grh: bool,
    /// `IBV_WC_WITH_INV`: a receive of a [`SendOp::SendWithInv`], which
    /// invalidated the window whose rkey `imm_data` then holds (the two
    /// share a field, as in `ibv_wc`).
    pub with_inv: bool,
}

impl Completion {
    /// A completion with every field zeroed/success, for buffers and tests.
    pub const EMPTY: Completion = Completion {
        wr_id: 0,
        status: WcStatus::Success,
        opcode: WcOpcode::Send,
        byte_len: 0,
        imm_data: None,
        qp_num: 0,
        vendor_err: 0,
        src_qp: 0,
        slid: 0,
        grh: false,
        with_inv: false,
    };
}

impl Default for Completion {
    fn default() -> Self {
        Completion::EMPTY
    }
}

/// Path MTU (`ibv_mtu`, same numeric values 1..=5).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
#[allow(missing_docs)]
pub enum Mtu {
    Mtu256 = 1,
    Mtu512 = 2,
    Mtu1024 = 3,
    Mtu2048 = 4,
    Mtu4096 = 5,
}

impl Mtu {
    /// Size in bytes.
    pub fn bytes(self) -> u32 {
        128 << (self as u32)
    }
    /// From the raw verbs value.
    pub fn from_raw(raw: u8) -> Option<Mtu> {
        Some(match raw {
            1 => Mtu::Mtu256,
            2 => Mtu::Mtu512,
            3 => Mtu::Mtu1024,
            4 => Mtu::Mtu2048,
            5 => Mtu::Mtu4096,
            _ => return None,
        })
    }
}

/// A 128-bit global identifier (GID), network byte order.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// True if all bytes are zero (no GID).
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, pair) in self.0.chunks(2).enumerate() {
            if i > 0 {
                f.write_str(":")?;
            }
            write!(f, "{:02x}{:02x}", pair[0], pair[1])?;
        }
        Ok(())
    }
}

/// Queue-pair state (`ibv_qp_state`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(missing_docs)]
pub enum QpState {
    Reset,
    Init,
    Rtr,
    Rts,
    Sqd,
    Sqe,
    Err,
}

/// Queue sizes of a QP (`ibv_qp_cap`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpCaps {
    /// Send-queue depth (outstanding send WRs).
    pub max_send_wr: u32,
    /// Receive-queue depth.
    pub max_recv_wr: u32,
    /// SGEs per send WR.
    pub max_send_sge: u32,
    /// SGEs per receive WR.
    pub max_recv_sge: u32,
    /// Largest inline payload in bytes.
    pub max_inline_data: u32,
}

impl Default for QpCaps {
    fn default() -> Self {
        QpCaps {
            max_send_wr: 128,
            max_recv_wr: 128,
            max_send_sge: 4,
            max_recv_sge: 4,
            max_inline_data: 64,
        }
    }
}

/// Transport service of a queue pair (`ibv_qp_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum QpType {
    /// Reliable connected: one peer, every verb, delivery acknowledged.
    Rc,
    /// Unreliable datagram: SENDs of at most one MTU to any UD QP named by
    /// an address handle; lost datagrams are not retried.
    Ud,
}

/// The Q_Key rdma-core's `ibv_ud_pingpong` uses; any value works if both
/// sides agree.
pub const DEFAULT_QKEY: u32 = 0x1111_1111;

/// Attributes that bring a UD QP from RESET to RTS (INIT with port, P_Key
/// index and Q_Key; RTR; RTS with the send PSN), as `ibv_ud_pingpong` does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UdAttr {
    /// Physical port (1-based).
    pub port: u8,
    /// P_Key index.
    pub pkey_index: u16,
    /// The Q_Key datagrams to this QP must carry.
    pub qkey: u32,
    /// First send PSN (24 bits).
    pub sq_psn: u32,
}

impl Default for UdAttr {
    fn default() -> Self {
        UdAttr {
            port: 1,
            pkey_index: 0,
            qkey: DEFAULT_QKEY,
            sq_psn: 0,
        }
    }
}

/// Where an address handle points (`ibv_ah_attr`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AhAttr {
    /// Destination LID (InfiniBand; 0 on RoCE).
    pub dlid: u16,
    /// Destination GID; all zeros means no GRH (InfiniBand local subnet).
    pub dgid: Gid,
    /// Local GID index the GRH is sent from.
    pub sgid_index: u8,
    /// Hop limit of the GRH.
    pub hop_limit: u8,
    /// Service level.
    pub sl: u8,
    /// Local physical port (1-based).
    pub port: u8,
    /// The destination's provider address ([`Endpoint::addr`]; the
    /// software device routes by it, libibverbs by LID/GID).
    pub addr: ProviderAddr,
}

impl AhAttr {
    /// An address handle's attributes for the QP `remote` describes, sent
    /// from port 1 and local GID index `sgid_index`.
    pub fn to_endpoint(remote: &Endpoint, sgid_index: u8) -> AhAttr {
        AhAttr {
            dlid: remote.lid,
            dgid: remote.gid,
            sgid_index,
            hop_limit: 1,
            sl: 0,
            port: 1,
            addr: remote.addr,
        }
    }
}

/// A provider's raw name for a live address handle, as UD work requests
/// carry it. Only [`AddressHandle::raw`](super::AddressHandle::raw) makes one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AhHandle(pub(crate) u64);

/// The destination of a UD datagram (`ibv_send_wr.wr.ud`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UdDest {
    /// The address handle of the destination port.
    pub ah: AhHandle,
    /// The destination QP number.
    pub remote_qpn: u32,
    /// The Q_Key the destination QP expects.
    pub remote_qkey: u32,
}

/// Bytes of the global route header at the start of every UD receive buffer.
pub const GRH_LEN: usize = 40;

/// The parts of a received datagram's global route header that say who
/// sent it.
///
/// On RoCE v2 over IPv4 (rxe, and the soft device) the 40 bytes hold 20
/// zero bytes and then the packet's IPv4 header; otherwise they are an
/// InfiniBand/IPv6 GRH. `parse` reads both, as rdma-core's
/// `ibv_init_ah_from_wc` does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grh {
    /// The sender's GID (IPv4-mapped for RoCE v2 over IPv4).
    pub sgid: Gid,
    /// The GID the datagram was sent to.
    pub dgid: Gid,
}

impl Grh {
    /// Reads the GRH area of a receive buffer; `None` if it holds neither
    /// an IPv6-format GRH nor an IPv4 header.
    pub fn parse(area: &[u8]) -> Option<Grh> {
        let area: &[u8; GRH_LEN] = area.get(..GRH_LEN)?.try_into().ok()?;
        if area[20] >> 4 == 4 && area[..20].iter().all(|&b| b == 0) {
            let mapped = |ip: &[u8]| {
                let mut g = [0u8; 16];
                g[10] = 0xff;
                g[11] = 0xff;
                g[12..].copy_from_slice(ip);
                Gid(g)
            };
            return Some(Grh {
                sgid: mapped(&area[32..36]),
                dgid: mapped(&area[36..40]),
            });
        }
        if area[0] >> 4 == 6 {
            let gid = |b: &[u8]| Gid(b.try_into().expect("16 bytes"));
            return Some(Grh {
                sgid: gid(&area[8..24]),
                dgid: gid(&area[24..40]),
            });
        }
        None
    }
}

/// Everything a peer needs to connect its RC QP to ours; exchanged out of band.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// Which provider produced it (the two sides must match).
    pub provider: ProviderKind,
    /// QP number.
    pub qpn: u32,
    /// Initial packet sequence number (24 bits).
    pub psn: u32,
    /// Local identifier (InfiniBand; 0 on RoCE and the soft device).
    pub lid: u16,
    /// GID of the port (RoCE/IB global routing).
    pub gid: Gid,
    /// Active MTU of the port.
    pub mtu: Mtu,
    /// What else a peer needs to reach the QP, as its provider defines it
    /// ([`ProviderAddr`]; the software device: its engine's data-plane
    /// address; empty on libibverbs).
    pub addr: ProviderAddr,
}

/// Attributes for RESET → INIT.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InitAttr {
    /// Physical port (1-based).
    pub port: u8,
    /// P_Key index.
    pub pkey_index: u16,
    /// Remote access the QP allows (REMOTE_WRITE/READ/ATOMIC).
    pub access: AccessFlags,
}

impl Default for InitAttr {
    fn default() -> Self {
        InitAttr {
            port: 1,
            pkey_index: 0,
            access: AccessFlags::REMOTE_WRITE
                | AccessFlags::REMOTE_READ
                | AccessFlags::REMOTE_ATOMIC,
        }
    }
}

/// Attributes for INIT → RTR.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RtrAttr {
    /// The peer's endpoint.
    pub remote: Endpoint,
    /// Path MTU: the minimum of both sides' active MTU.
    pub path_mtu: Mtu,
    /// Encoded RNR NAK timer the responder advertises (verbs table, 0..=31; see [`rnr_timer_duration`]).
    pub min_rnr_timer: u8,
    /// Incoming RDMA READ/atomic requests allowed in flight.
    pub max_dest_rd_atomic: u8,
    /// Local GID index used for the GRH (RoCE).
    pub sgid_index: u8,
    /// Hop limit for the GRH.
    pub hop_limit: u8,
}

/// Attributes for RTR → RTS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RtsAttr {
    /// Local ACK timeout, encoded: 4.096 µs × 2^timeout (see [`ack_timeout_duration`]); 0 = infinite.
    pub timeout: u8,
    /// Transport retries before `RETRY_EXC_ERR` (0..=7; keep ≤ 6: rxe retries forever at 7).
    pub retry_cnt: u8,
    /// RNR retries before `RNR_RETRY_EXC_ERR` (0..=7; 7 = forever).
    pub rnr_retry: u8,
    /// Outgoing RDMA READ/atomic requests in flight.
    pub max_rd_atomic: u8,
}

impl Default for RtsAttr {
    fn default() -> Self {
        RtsAttr {
            timeout: 14,
            retry_cnt: 6,
            rnr_retry: 7,
            max_rd_atomic: 16,
        }
    }
}

/// Decodes the verbs `min_rnr_timer` encoding (IB spec table 45).
pub fn rnr_timer_duration(encoded: u8) -> Duration {
    const MICROS: [u32; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560,
        3_840, 5_120, 7_680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880,
        163_840, 245_760, 327_680, 491_520,
    ];
    Duration::from_micros(u64::from(MICROS[(encoded & 31) as usize]))
}

/// Decodes the verbs local ACK `timeout` encoding: 4.096 µs × 2^timeout; `None` = infinite (0).
pub fn ack_timeout_duration(encoded: u8) -> Option<Duration> {
    if encoded == 0 {
        return None;
    }
    let nanos = 4096u64 << u32::from(encoded.min(31));
    Some(Duration::from_nanos(nanos))
}

/// Port state (`ibv_port_state`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(missing_docs)]
pub enum PortState {
    Nop,
    Down,
    Init,
    Armed,
    Active,
    ActiveDefer,
}

/// Link layer of a port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(missing_docs)]
pub enum LinkLayer {
    Unspecified,
    InfiniBand,
    Ethernet,
}

/// Port attributes (`ibv_port_attr`, the useful subset).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortAttr {
    /// Logical port state.
    pub state: PortState,
    /// Largest MTU the port supports.
    pub max_mtu: Mtu,
    /// MTU in use.
    pub active_mtu: Mtu,
    /// Base LID (InfiniBand).
    pub lid: u16,
    /// Number of GID table entries.
    pub gid_tbl_len: u32,
    /// InfiniBand or Ethernet (RoCE).
    pub link_layer: LinkLayer,
}

/// Device attributes (`ibv_device_attr`, the useful subset).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceAttr {
    /// Firmware version string.
    pub fw_ver: String,
    /// Node GUID.
    pub node_guid: u64,
    /// IEEE vendor id.
    pub vendor_id: u32,
    /// Vendor part id.
    pub vendor_part_id: u32,
    /// Hardware version.
    pub hw_ver: u32,
    /// Largest registrable size.
    pub max_mr_size: u64,
    /// Maximum QPs.
    pub max_qp: u32,
    /// Maximum WRs per queue.
    pub max_qp_wr: u32,
    /// Maximum SGEs per WR.
    pub max_sge: u32,
    /// Maximum CQs.
    pub max_cq: u32,
    /// Maximum entries per CQ.
    pub max_cqe: u32,
    /// Maximum MRs.
    pub max_mr: u32,
    /// Maximum PDs.
    pub max_pd: u32,
    /// Incoming READ/atomic depth per QP.
    pub max_qp_rd_atom: u32,
    /// Outgoing READ/atomic depth per QP.
    pub max_qp_init_rd_atom: u32,
    /// Number of physical ports.
    pub phys_port_cnt: u8,
}

/// Kind of an asynchronous event (`ibv_event_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
#[allow(missing_docs)]
pub enum AsyncEventKind {
    CqErr,
    QpFatal,
    QpReqErr,
    QpAccessErr,
    CommEst,
    SqDrained,
    PathMig,
    PathMigErr,
    DeviceFatal,
    PortActive,
    PortErr,
    LidChange,
    PkeyChange,
    SmChange,
    SrqErr,
    SrqLimitReached,
    QpLastWqeReached,
    ClientReregister,
    GidChange,
    Other(u32),
}

/// What an asynchronous event refers to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(missing_docs)]
pub enum AsyncElement {
    Qp(u32),
    Cq(u32),
    Port(u8),
    Device,
    /// A shared receive queue, by its [`Srq::handle`](super::Srq::handle).
    Srq(u32),
}

/// An asynchronous event (`ibv_async_event`), already acknowledged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AsyncEvent {
    /// What happened.
    pub kind: AsyncEventKind,
    /// To which object.
    pub element: AsyncElement,
}

/// Description of a device found by [`devices`](super::devices).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device name (`soft0`, `mlx5_0`, `rxe0`, ...).
    pub name: String,
    /// Which provider drives it.
    pub kind: ProviderKind,
    /// Node GUID (0 if unknown).
    pub guid: u64,
}

/// Settings of a software device context.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SoftConfig {
    /// Device name reported by queries.
    pub name: String,
    /// Data-plane listen address of the engine (port 0 = ephemeral). Loopback by
    /// default; any address lets two hosts or network namespaces talk.
    pub bind: SocketAddr,
    /// How long a connection accepted by the engine may take to announce
    /// its engine (HELLO) and prove that address is its own; it is closed
    /// then. Default 5 s.
    pub handshake_timeout: Duration,
    /// A proven connection that no QP of this engine uses is closed after
    /// this long without input (the peer's engine reconnects when it needs
    /// to). Default 60 s.
    pub idle_timeout: Duration,
    /// Most connections the engine accepts at once; more are closed as
    /// soon as they are accepted. Default 1024.
    pub max_connections: usize,
    /// Most connections the engine accepts at once from one source IP
    /// address. Default 128.
    pub max_connections_per_ip: usize,
    /// The bound on noticing that a peer engine is dead (its host vanished,
    /// or its engine stopped answering while its kernel still acknowledges
    /// TCP): the connection's `TCP_USER_TIMEOUT` and keepalive, and how
    /// long an unanswered probe may wait while nothing arrives. The
    /// connection is closed then and the QPs of that engine move to ERR
    /// (a peer whose process died is noticed at once: its kernel closes
    /// the connection). Time the connection spends recovering from packet
    /// loss never fails a QP below this bound. Default 5 s.
    pub peer_timeout: Duration,
}

impl Default for SoftConfig {
    fn default() -> Self {
        SoftConfig {
            name: "soft0".to_string(),
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            handshake_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(60),
            max_connections: 1024,
            max_connections_per_ip: 128,
            peer_timeout: Duration::from_secs(5),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_round_trips_raw_values() {
        for raw in 0..24 {
            assert_eq!(WcStatus::from_raw(raw) as u32, raw);
        }
        assert_eq!(WcStatus::from_raw(999), WcStatus::GeneralErr);
        assert_eq!(WcStatus::RemAccessErr.name(), "IBV_WC_REM_ACCESS_ERR");
    }

    #[test]
    fn inc_rkey_changes_the_key_byte_only() {
        assert_eq!(inc_rkey(0x1234_5600), 0x1234_5601);
        assert_eq!(inc_rkey(0x1234_56ff), 0x1234_5600);
        // A bind's fields cost 16 bytes over the largest other WR opcode.
        assert_eq!(std::mem::size_of::<SendOp>(), 48);
    }

    #[test]
    fn timer_encodings_follow_the_spec() {
        assert_eq!(rnr_timer_duration(0), Duration::from_micros(655_360));
        assert_eq!(rnr_timer_duration(12), Duration::from_micros(640));
        assert_eq!(ack_timeout_duration(0), None);
        // 14 → 4.096 µs × 16384 ≈ 67 ms
        assert_eq!(
            ack_timeout_duration(14),
            Some(Duration::from_nanos(4096 << 14))
        );
        assert_eq!(Mtu::Mtu1024.bytes(), 1024);
        assert_eq!(Mtu::Mtu4096.bytes(), 4096);
    }

    #[test]
    fn grh_parses_roce_v2_ipv4_and_ipv6_forms() {
        let mut v4 = [0u8; GRH_LEN];
        v4[20] = 0x45;
        v4[32..36].copy_from_slice(&[10, 0, 0, 1]);
        v4[36..40].copy_from_slice(&[10, 0, 0, 2]);
        let g = Grh::parse(&v4).expect("ipv4 form");
        assert_eq!(
            g.sgid.to_string(),
            "0000:0000:0000:0000:0000:ffff:0a00:0001"
        );
        assert_eq!(g.dgid.0[12..], [10, 0, 0, 2]);

        let mut v6 = [0u8; GRH_LEN];
        v6[0] = 0x60;
        v6[8] = 0xfe;
        v6[9] = 0x80;
        v6[39] = 7;
        let g = Grh::parse(&v6).expect("ipv6 form");
        assert_eq!(g.sgid.0[..2], [0xfe, 0x80]);
        assert_eq!(g.dgid.0[15], 7);

        assert_eq!(Grh::parse(&[0u8; GRH_LEN]), None);
        assert_eq!(Grh::parse(&v6[..39]), None);
    }

    #[test]
    fn gid_prints_like_ibv_devinfo() {
        let mut g = Gid::default();
        g.0[10] = 0xff;
        g.0[11] = 0xff;
        g.0[12] = 10;
        g.0[15] = 1;
        assert_eq!(g.to_string(), "0000:0000:0000:0000:0000:ffff:0a00:0001");
        assert_eq!(
            format!("{:?}", AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ),
            "LOCAL_WRITE|REMOTE_READ"
        );
    }
}
