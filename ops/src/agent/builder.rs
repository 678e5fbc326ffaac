//! [`RdmaBuilder`]: the settings of a high-level connection, and the
//! [`RdmaListener`] that accepts many of them.

use std::cell::RefCell;
use std::future::{poll_fn, Future};
use std::net::SocketAddr;
use std::pin::{pin, Pin};
use std::rc::Rc;
use std::task::Poll;
use std::time::Duration;

use futures::stream::FuturesUnordered;
use futures::StreamExt;

use verbio_runtime::provider::{
    open_device, open_hardware_device, AccessFlags, InitAttr, Mtu, QpCaps, RtsAttr,
};
use verbio_runtime::Device;

use super::error::AgentError;
use super::flow::reserve_for;
use super::qps::AgentQps;
use super::qps::{ListenerSrq, SrqPolicy};
use super::rdma::{Rdma, Redial};
use super::settings::MIN_RECV_BUF_SIZE;
use super::staging_budget::StagingBudget;
use super::wire::{Settings, DATA_OVERHEAD};
use crate::connect::{connect, DeviceQps, Listener, QpConfig};

/// Default of [`RdmaBuilder::max_inline_data`]: a 64-byte message and
/// its `Data` header (at most [`DATA_OVERHEAD`](super::wire::DATA_OVERHEAD)
/// = 48 bytes; 24 or 28 for a message sent in one piece) with room to
/// spare.
pub const DEFAULT_MAX_INLINE_DATA: u32 = 128;

/// Default of [`RdmaBuilder::recv_buf_count`]: the send window of a
/// connection's peer, in messages. A credit comes back a round trip after
/// its message (the receiver reads it, reposts the buffer and returns
/// credits in batches of [`RdmaBuilder::credit_batch`], by default a
/// quarter of this), so a stream of messages that each take a receive
/// buffer (whole messages, staged ones: up to a quarter of the staging
/// ring) moves at most this many per credit round trip, as a verbs window
/// of this many does. A sender with more in flight than this waits for a
/// batch of credits again and again, and each wait is a sleep and a
/// wake-up of the sending task (and, on one CPU, of the receiver): with
/// 64, a window of 128 16 KiB messages took 0.58 context switches per
/// message of both processes, with 128 0.25 (4 KiB: 0.092 and 0.065;
/// verbio-perf's verbs receiver posts 256 receives; docs/benchmarks.md
/// "The credit window and a window of 128"). With 128,
/// a connection's receive memory is 128 buffers, the reserve for the
/// peer's credit returns and up to 64 lent to the application, of
/// `recv_buf_size` + 48 bytes each: about 850 KB at 4 KiB (a shared
/// receive queue bounds it for many connections).
pub const DEFAULT_RECV_BUF_COUNT: u32 = 128;

/// Default of [`RdmaBuilder::shared_receive_queue_above`]: a listener
/// holding this many connections with receive queues of their own puts
/// new ones on a shared receive queue. Chosen from measurements
/// (docs/benchmarks.md, "Memory per connection with and without a shared
/// receive queue"): see [`RdmaBuilder::shared_receive_queue_above`].
pub const DEFAULT_SRQ_ABOVE: usize = 64;

/// Default of [`RdmaBuilder::shared_receive_queue_above`]'s depth: the
/// buffers of a listener's shared receive queue (at 4 KiB, 1 MiB: the
/// receive rings of about three connections of their own).
pub const DEFAULT_SRQ_DEPTH: u32 = 256;

/// Default of [`RdmaBuilder::staging_ring`]: messages from one receive
/// buffer up to 1 MiB go by one RDMA WRITE into it. Measured on the soft
/// device (docs/benchmarks.md, issue 35), the WRITE beats the READ path
/// at 512 KiB and 1 MiB too (its extra round trip and per-message
/// registrations); a connection holds the ring only once the peer has
/// sent it a message the ring would carry, and only within its
/// [`RdmaBuilder::staging_budget`].
pub const DEFAULT_STAGING_RING: usize = 4 << 20;

/// Default of [`RdmaBuilder::keepalive`]: a connection on which nothing
/// arrived for this long probes its peer.
pub const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(2);

/// Largest [`RdmaBuilder::max_inline_data`].
pub const MAX_INLINE_DATA: u32 = super::rdma::MAX_INLINE_MESSAGE as u32;

/// The settings of a connection, shared by its tasks.
#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) max_message_len: usize,
    pub(crate) recv_buf_size: usize,
    pub(crate) recv_buf_count: u32,
    pub(crate) credit_batch: u32,
    pub(crate) max_access: AccessFlags,
    pub(crate) token_lifetime: Duration,
    pub(crate) max_granted_bytes: u64,
    /// `Some(bytes)`: grant the peer's memory requests through memory
    /// windows over one region of that size (see `window_grants.rs`).
    pub(crate) grant_windows: Option<usize>,
    pub(crate) max_unread_bytes: u64,
    pub(crate) request_timeout: Duration,
    /// Limit of the agent settings exchange (the handshake timeout).
    pub(crate) settings_timeout: Duration,
    /// Bytes of this side's staging ring (`staging.rs`; 0: none), which
    /// the peer writes mid-size messages into.
    pub(crate) staging_ring: usize,
    /// Where the ring's bytes come from (`None`: the runtime thread's
    /// [`StagingBudget::this_thread`]).
    pub(crate) staging_budget: Option<StagingBudget>,
    /// Largest message (with its header) sent INLINE, as the application
    /// asked: a device may report a larger `max_inline_data` than asked
    /// for (rxe rounds it up), which does not raise this.
    pub(crate) max_inline: u32,
    /// Probe the peer when nothing arrived for this long (`None`: never).
    pub(crate) keepalive: Option<Duration>,
}

impl Config {
    /// Receive-queue entries to create the QP with: this side's buffers
    /// plus the largest reserve a peer with as many buffers can need (one
    /// that returns credits one by one), plus the receive ring's spare
    /// slots for messages lent to the application.
    pub(crate) fn recv_queue_depth(&self) -> u32 {
        self.recv_buf_count
            .saturating_add(reserve_for(self.recv_buf_count, 1))
            .saturating_add(super::task::lend_slots(self.recv_buf_count))
    }

    /// Bytes of each posted receive buffer: a piece of `recv_buf_size`
    /// message bytes plus the largest header a message carries
    /// ([`DATA_OVERHEAD`]), so that a message of exactly `recv_buf_size`
    /// bytes (the size applications pick most) is one SEND, not two.
    pub(crate) fn posted_buf_size(&self) -> usize {
        self.recv_buf_size.saturating_add(DATA_OVERHEAD)
    }

    /// This side's announcement for the settings exchange: the size of the
    /// buffers it posts (the peer's pieces are that less their header).
    pub(crate) fn settings(&self, max_recv_wr: u32) -> Settings {
        Settings {
            max_message_len: self.max_message_len as u64,
            recv_buf_size: u32::try_from(self.posted_buf_size()).unwrap_or(u32::MAX),
            recv_buf_count: self.recv_buf_count,
            credit_batch: self.credit_batch,
            max_recv_wr,
        }
    }
}

/// Builds [`Rdma`] connections: `RdmaBuilder::default().listen(addr)` on one
/// side, `RdmaBuilder::default().connect(addr).await` on the other. Each
/// side announces its receive-buffer count to the peer as its first send
/// credits. When a connection starts, the two sides exchange their agent
/// settings (receive-buffer size and count, credit batch, receive-queue
/// depth, maximum message length): message pieces are sized for the peer's
/// buffers, the largest message sent is the smaller of both maxima, and a
/// pair whose receive queues cannot hold the buffers each side needs is
/// refused on both sides with [`AgentError::Incompatible`].
///
/// # Example
///
/// A server that takes messages up to 1 MiB and bounds every handshake,
/// and a client on a device of its own choosing with a lower limit: both
/// sides settle on the smaller.
///
/// ```
/// # mod verbio { pub use verbio_ops::*; pub mod ops { pub use verbio_ops::*; } pub mod runtime { pub use verbio_runtime::*; } pub use verbio_runtime::provider; }
/// use std::time::Duration;
/// use verbio::provider::{Context, SoftConfig};
/// use verbio::runtime::{spawn, Device, Runtime};
/// use verbio::RdmaBuilder;
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let rt = Runtime::new()?;
/// rt.block_on(async {
///     let listener = RdmaBuilder::new()
///         .max_message_len(1 << 20)
///         .handshake_timeout(Duration::from_secs(5))
///         .listen("127.0.0.1:0".parse()?)?;
///     let addr = listener.local_addr()?;
///     let accepted = spawn(async move { listener.accept().await });
///
///     // Another software device here; `.device_name("mlx5_0")` would
///     // name hardware (built with the `ibverbs` feature).
///     let dev = Device::open(Context::open_soft(SoftConfig::default())?)?;
///     let rdma = RdmaBuilder::new()
///         .device(dev)
///         .max_message_len(64 << 10)
///         .connect(addr)
///         .await?;
///     let peer = accepted.await?;
///     assert_eq!(rdma.max_send_len(), 64 << 10);
///     assert_eq!(peer.max_send_len(), 64 << 10);
///     Ok::<_, Box<dyn std::error::Error>>(())
/// })?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct RdmaBuilder {
    device_name: Option<String>,
    require_hardware: bool,
    device: Option<Device>,
    cq_size: Option<u32>,
    qp: QpConfig,
    busy_poll: Duration,
    handshake_timeout: Duration,
    config: Config,
    /// When the listener's connections go on its shared receive queue
    /// (`None`: never).
    pub(super) srq: Option<SrqPolicy>,
    /// The application chose the shared receive queue's use
    /// ([`RdmaBuilder::shared_receive_queue`] or
    /// [`RdmaBuilder::shared_receive_queue_above`]).
    pub(super) srq_set: bool,
    /// `max_inline_data` was set by the application (else a device that
    /// refuses the default gets the runtime's default QP caps' instead).
    inline_set: bool,
    /// `credit_batch` was set: `recv_buf_count` leaves it alone.
    credit_batch_set: bool,
}

impl Default for RdmaBuilder {
    fn default() -> Self {
        RdmaBuilder {
            device_name: None,
            require_hardware: false,
            device: None,
            cq_size: None,
            qp: QpConfig {
                caps: QpCaps {
                    max_inline_data: DEFAULT_MAX_INLINE_DATA,
                    ..QpCaps::default()
                },
                ..QpConfig::default()
            },
            busy_poll: Duration::ZERO,
            handshake_timeout: Duration::from_secs(10),
            srq: Some(SrqPolicy {
                above: DEFAULT_SRQ_ABOVE,
                depth: DEFAULT_SRQ_DEPTH,
            }),
            srq_set: false,
            inline_set: false,
            credit_batch_set: false,
            config: Config {
                max_message_len: 64 << 20,
                recv_buf_size: 4096,
                recv_buf_count: DEFAULT_RECV_BUF_COUNT,
                credit_batch: DEFAULT_RECV_BUF_COUNT / 4,
                max_access: AccessFlags::REMOTE_READ
                    | AccessFlags::REMOTE_WRITE
                    | AccessFlags::REMOTE_ATOMIC,
                token_lifetime: Duration::from_secs(60),
                max_granted_bytes: 256 << 20,
                grant_windows: None,
                max_unread_bytes: 64 << 20,
                request_timeout: Duration::from_secs(5),
                settings_timeout: Duration::from_secs(10),
                max_inline: DEFAULT_MAX_INLINE_DATA,
                staging_ring: DEFAULT_STAGING_RING,
                staging_budget: None,
                keepalive: Some(DEFAULT_KEEPALIVE),
            },
        }
    }
}

impl RdmaBuilder {
    /// Default settings.
    pub fn new() -> RdmaBuilder {
        RdmaBuilder::default()
    }

    /// Device by name (`soft0`, `mlx5_0`, ...); default: `VERBIO_DEVICE`, else
    /// the first active ibverbs device, else the software device.
    pub fn device_name(mut self, name: impl Into<String>) -> Self {
        self.device_name = Some(name.into());
        self
    }

    /// Refuse the software device: the builder opens a hardware (ibverbs)
    /// device (the one named, or the first with an active port) or fails
    /// with [`AgentError::Device`] saying why, instead of falling back to
    /// `soft0`; a device passed with [`RdmaBuilder::device`] must be
    /// hardware too.
    pub fn require_hardware(mut self, yes: bool) -> Self {
        self.require_hardware = yes;
        self
    }

    /// An already opened device (its CQ size is kept).
    pub fn device(mut self, device: Device) -> Self {
        self.device = Some(device);
        self
    }

    /// Physical port (1-based).
    pub fn port(mut self, port: u8) -> Self {
        self.qp.init.port = port;
        self
    }

    /// GID index (default: the device's default for the port).
    pub fn gid_index(mut self, index: u8) -> Self {
        self.qp.gid_index = Some(index);
        self
    }

    /// How long a connection may receive nothing before it probes its
    /// peer (default [`DEFAULT_KEEPALIVE`]; `None`: never). The probe is a
    /// zero-length RDMA WRITE: it consumes none of the peer's receive
    /// buffers or credits and needs no answer from its application, and
    /// RC's own retransmission fails it (`RETRY_EXC_ERR`, after the QP's
    /// `timeout` × (`retry_cnt` + 1)) if the peer's port is gone; the QP
    /// then fails, and so does a pending [`Rdma::receive`](super::Rdma::receive)
    /// ([`CloseReason::Transport`](super::CloseReason::Transport)). A connection on which
    /// something arrived within the interval sends no probe. On the soft
    /// device the engine's `SoftConfig::peer_timeout` also detects a dead
    /// peer engine; on hardware and rxe a QP that only receives learns of
    /// a vanished peer only this way.
    pub fn keepalive(mut self, every: Option<Duration>) -> Self {
        self.config.keepalive = every;
        self
    }

    /// Completion-queue entries of a device this builder opens: one CQ of
    /// this size shared by its QPs (`Device::with_cq_size`); by default the
    /// device adds CQs as its QPs need them (`Device::open`).
    pub fn cq_size(mut self, cqe: u32) -> Self {
        self.cq_size = Some(cqe);
        self
    }

    /// Send-queue depth.
    pub fn max_send_wr(mut self, n: u32) -> Self {
        self.qp.caps.max_send_wr = n;
        self
    }

    /// Receive-queue depth (raised to hold the agent's receive buffers).
    pub fn max_recv_wr(mut self, n: u32) -> Self {
        self.qp.caps.max_recv_wr = n;
        self
    }

    /// Largest message, header included, the QP sends INLINE (copied
    /// into the work request at post time, no send buffer, and [`Rdma::send`]
    /// returns once it is posted): the QP is created with this
    /// `max_inline_data`. The default, [`DEFAULT_MAX_INLINE_DATA`], takes a
    /// 64-byte message with its `Data` header (at most
    /// [`DATA_OVERHEAD`](super::wire::DATA_OVERHEAD) bytes); 0 sends
    /// nothing inline. At most [`MAX_INLINE_DATA`] (else
    /// [`AgentError::Config`]); a device that takes less refuses to create
    /// the QP, and the error names the caps (rxe takes several hundred
    /// bytes, the software device 1024). Left at its default, a device
    /// that refuses it gets the runtime's default QP caps' 64 bytes
    /// instead (RDMA CM connections excepted).
    pub fn max_inline_data(mut self, bytes: u32) -> Self {
        self.qp.caps.max_inline_data = bytes;
        self.config.max_inline = bytes;
        self.inline_set = true;
        self
    }

    /// SGEs per send and receive WR.
    pub fn max_sge(mut self, n: u32) -> Self {
        self.qp.caps.max_send_sge = n;
        self.qp.caps.max_recv_sge = n;
        self
    }

    /// Largest path MTU (default: the port's active MTU). The connection
    /// uses the minimum of this, the peer's setting and both ports' MTUs.
    pub fn mtu(mut self, mtu: Mtu) -> Self {
        self.qp.mtu = Some(mtu);
        self
    }

    /// Transport timeout, retry and RNR-retry settings.
    pub fn rts(mut self, rts: RtsAttr) -> Self {
        self.qp.rts = rts;
        self
    }

    /// RNR NAK timer this side advertises (verbs encoding, 0..=31).
    pub fn min_rnr_timer(mut self, timer: u8) -> Self {
        self.qp.min_rnr_timer = timer;
        self
    }

    /// Incoming RDMA READ / atomic requests this side serves at once.
    pub fn max_dest_rd_atomic(mut self, n: u8) -> Self {
        self.qp.max_dest_rd_atomic = n;
        self
    }

    /// Hop limit of the GRH (RoCE, routed InfiniBand).
    pub fn hop_limit(mut self, hops: u8) -> Self {
        self.qp.hop_limit = hops;
        self
    }

    /// Partition-key index of the QP.
    pub fn pkey_index(mut self, index: u16) -> Self {
        self.qp.init.pkey_index = index;
        self
    }

    /// Bytes of the staging ring this side registers for the peer to
    /// write (REMOTE_WRITE only, this connection's protection domain):
    /// the peer sends a message longer than one receive buffer and at most
    /// a quarter of this by one RDMA WRITE into it and a short SEND naming
    /// where, instead of many pieces or a READ of its copy (one round trip
    /// more). The message is copied out of the ring into the vector
    /// [`Rdma::receive`] returns. Default [`DEFAULT_STAGING_RING`]; 0 for
    /// none (the peer then sends pieces or offers READs); else 64 KiB to
    /// 32 MiB (else [`AgentError::Config`]). None either when
    /// [`RdmaBuilder::qp_access`] leaves out `REMOTE_WRITE`.
    ///
    /// A connection registers its ring only the first time the peer sends
    /// a message the ring would carry, and only within its
    /// [`staging_budget`](Self::staging_budget) (by default 64 MiB shared
    /// by all connections of the runtime thread): when the budget is spent
    /// it announces none (the peer keeps to pieces and READs) and asks
    /// again at the peer's next such message; a connection gives its ring
    /// back when it goes down.
    pub fn staging_ring(mut self, bytes: usize) -> Self {
        self.config.staging_ring = bytes;
        self
    }

    /// The budget this builder's connections take their staging rings
    /// ([`RdmaBuilder::staging_ring`]) from, shared with every other
    /// connection given a clone of it: the bytes of rings they hold
    /// registered at once never exceed [`StagingBudget::limit`], however
    /// many connections peers open and send mid-size messages on. Default:
    /// the runtime thread's [`StagingBudget::this_thread`], of
    /// [`DEFAULT_STAGING_BUDGET`](super::DEFAULT_STAGING_BUDGET) (64 MiB,
    /// sixteen default rings).
    pub fn staging_budget(mut self, budget: StagingBudget) -> Self {
        self.config.staging_budget = Some(budget);
        self
    }

    /// Remote access this side's QP allows at all.
    pub fn qp_access(mut self, access: AccessFlags) -> Self {
        self.qp.init = InitAttr {
            access,
            ..self.qp.init
        };
        self
    }

    /// Largest user message `send` accepts and `receive` reassembles.
    pub fn max_message_len(mut self, len: usize) -> Self {
        self.config.max_message_len = len;
        self
    }

    /// Message bytes each posted receive buffer holds, at least
    /// [`MIN_RECV_BUF_SIZE`](super::MIN_RECV_BUF_SIZE): a message of up to
    /// the peer's `recv_buf_size` bytes travels as one SEND, a larger one
    /// in pieces of that size (or by one RDMA WRITE into the peer's staging
    /// ring, [`RdmaBuilder::staging_ring`], once the peer announced it;
    /// beyond the ring's messages, from 32 KiB, by one RDMA READ). Each
    /// buffer is this plus the largest message header,
    /// [`DATA_OVERHEAD`](super::wire::DATA_OVERHEAD) (48) bytes.
    pub fn recv_buf_size(mut self, len: usize) -> Self {
        self.config.recv_buf_size = len;
        self
    }

    /// Receive buffers the peer may fill before it must wait for credits
    /// (default [`DEFAULT_RECV_BUF_COUNT`]). Unless
    /// [`credit_batch`](Self::credit_batch) is set, the credit batch
    /// becomes a quarter of `n` (at least 1).
    pub fn recv_buf_count(mut self, n: u32) -> Self {
        self.config.recv_buf_count = n;
        if !self.credit_batch_set {
            self.config.credit_batch = (n / 4).max(1);
        }
        self
    }

    /// Reposted buffers returned to the peer per `Credit` message. Credits
    /// owed also ride on this side's next data message; a `Credit` message
    /// of their own goes out only once this many are owed (this side has
    /// had nothing to send meanwhile). Default: a quarter of
    /// [`recv_buf_count`](Self::recv_buf_count) (at least 1).
    pub fn credit_batch(mut self, n: u32) -> Self {
        self.config.credit_batch = n;
        self.credit_batch_set = true;
        self
    }

    /// Most access granted to a peer's memory requests (requests for more are capped).
    pub fn max_access(mut self, access: AccessFlags) -> Self {
        self.config.max_access = access;
        self
    }

    /// Most bytes of this side's memory granted to the peer at once; memory
    /// requests beyond it are refused with `RefuseCode::NoMemory`
    /// (default 256 MiB).
    pub fn max_granted_bytes(mut self, bytes: u64) -> Self {
        self.config.max_granted_bytes = bytes;
        self
    }

    /// Grants the peer's memory requests ([`Rdma::request_remote_mr`] there)
    /// through type 2 memory windows bound over one region of `pool_bytes`
    /// per connection (registered once, at the first request), instead of
    /// registering fresh memory per grant: a grant is one BIND_MW over
    /// exactly the range granted with exactly the access granted, a revoke
    /// (release, hand-back, deadline) one LOCAL_INV, and its rkey fails once
    /// that completed. Requests beyond the free room of the region are
    /// refused (`RefuseCode::NoMemory`). Memory handed over with
    /// [`Rdma::send_local_mr`] is still registered. Off by default: the
    /// exact bounds are the device's to enforce, and rxe (Linux 6.1) lets a
    /// peer reach the whole region through any of its windows; use it on
    /// devices that enforce a window's range (the soft device does).
    pub fn grant_windows(mut self, pool_bytes: usize) -> Self {
        self.config.grant_windows = Some(pool_bytes);
        self
    }

    /// Most bytes the peer may have delivered that the application has not
    /// taken yet (messages, counted by the receive buffer they hold or
    /// their length if reassembled; handed-over regions by their length;
    /// immediates and tokens at 64 bytes each), default 64 MiB. Beyond it
    /// the agent stops returning send credits to the peer, whose senders
    /// then wait, until the application has taken enough for the backlog to
    /// fall to half of it. Two applications that each only send and never
    /// receive stop there, as two TCP peers that never read do.
    pub fn max_unread_bytes(mut self, bytes: u64) -> Self {
        self.config.max_unread_bytes = bytes;
        self
    }

    /// Lifetime of the memory tokens this side grants (default 60 s). A
    /// peer's request may ask for a shorter one
    /// ([`Rdma::request_remote_mr_with_timeout`]), never a longer one;
    /// [`Rdma::send_local_mr_with_timeout`] sets it per hand-over.
    pub fn token_lifetime(mut self, d: Duration) -> Self {
        self.config.token_lifetime = d;
        self
    }

    /// How long a request to the peer (memory allocation) may take.
    pub fn request_timeout(mut self, d: Duration) -> Self {
        self.config.request_timeout = d;
        self
    }

    /// Limit of the TCP connect and endpoint exchange.
    pub fn handshake_timeout(mut self, d: Duration) -> Self {
        self.handshake_timeout = d;
        self.config.settings_timeout = d;
        self
    }

    /// Busy-poll time of the runtime built by [`RdmaBuilder::runtime_builder`]
    /// (zero = event mode: sleep on the completion channel at once).
    pub fn busy_poll(mut self, d: Duration) -> Self {
        self.busy_poll = d;
        self
    }

    /// Puts every connection a listener accepts on one shared receive
    /// queue of the device, filled with `depth` buffers of
    /// `recv_buf_size` bytes and a message header each: the listener's receive memory is these
    /// buffers whatever the number of connections, where without it each
    /// connection posts `recv_buf_count` buffers (plus a reserve) of its
    /// own. The same as [`shared_receive_queue_above`](Self::shared_receive_queue_above)`(0, depth)`.
    /// Applies to [`listen`](Self::listen); [`connect`](Self::connect)
    /// ignores it and [`listen_cm`](Self::listen_cm) refuses it.
    pub fn shared_receive_queue(self, depth: u32) -> Self {
        self.shared_receive_queue_above(0, depth)
    }

    /// A listener accepts its first `connections` connections (those live
    /// at once) with receive queues of their own, and puts each one beyond
    /// them on one shared receive queue of the device, of `depth` buffers
    /// of `recv_buf_size` bytes and a message header each, made when the
    /// first one needs it (as connections close, new ones get queues of
    /// their own again). The default: [`DEFAULT_SRQ_ABOVE`] connections,
    /// [`DEFAULT_SRQ_DEPTH`] buffers.
    ///
    /// A connection on the SRQ still grants its peer `recv_buf_count` send
    /// credits; when the buffers run out, senders wait (RNR retries) until
    /// a message is read. A message is read in place and copied out when
    /// delivered (no zero-copy hand-over). The QPs on an SRQ must share
    /// its protection domain (the device's), so the memory such a
    /// connection lets its peer reach (grants, its staging ring, a large
    /// message offered for READ) is reached through a type 2 memory window
    /// its QP binds, which the device lets only that QP's peer use: no
    /// other connection reaches it, even with its rkey. That costs one
    /// BIND_MW per grant and per large message sent by READ.
    ///
    /// Applies to [`listen`](Self::listen); [`connect`](Self::connect)
    /// ignores it and [`listen_cm`](Self::listen_cm) refuses it.
    pub fn shared_receive_queue_above(mut self, connections: usize, depth: u32) -> Self {
        self.srq = Some(SrqPolicy {
            above: connections,
            depth,
        });
        self.srq_set = true;
        self
    }

    /// Every connection a listener accepts has a receive queue (and a
    /// protection domain) of its own, however many there are: receive
    /// memory grows with the connections (see
    /// [`shared_receive_queue_above`](Self::shared_receive_queue_above)).
    pub fn no_shared_receive_queue(mut self) -> Self {
        self.srq = None;
        self.srq_set = false;
        self
    }

    /// A runtime builder with this builder's polling mode; the connection
    /// must run on a verbio runtime, and the polling mode is the runtime's.
    pub fn runtime_builder(&self) -> verbio_runtime::Builder {
        verbio_runtime::Runtime::builder().busy_poll(self.busy_poll)
    }

    fn checked(&self) -> Result<(QpConfig, Rc<Config>), AgentError> {
        let c = &self.config;
        if c.recv_buf_size < MIN_RECV_BUF_SIZE || u32::try_from(c.posted_buf_size()).is_err() {
            return Err(AgentError::Config {
                setting: "recv_buf_size",
                reason: "must be at least MIN_RECV_BUF_SIZE (128) and fit in 32 bits \
                         with its header (DATA_OVERHEAD)",
            });
        }
        if c.max_message_len == 0 {
            return Err(AgentError::Config {
                setting: "max_message_len",
                reason: "must be at least 1",
            });
        }
        if c.recv_buf_count == 0 || c.credit_batch == 0 || c.credit_batch > c.recv_buf_count {
            return Err(AgentError::Config {
                setting: "recv_buf_count / credit_batch",
                reason: "need 1 <= credit_batch <= recv_buf_count",
            });
        }
        if self.qp.caps.max_inline_data > MAX_INLINE_DATA {
            return Err(AgentError::Config {
                setting: "max_inline_data",
                reason: "at most MAX_INLINE_DATA (256): the agent copies an inline message \
                         on the stack",
            });
        }
        if c.keepalive.is_some_and(|d| d.is_zero()) {
            return Err(AgentError::Config {
                setting: "keepalive",
                reason: "a nonzero interval, or None for no keepalive",
            });
        }
        if c.staging_ring != 0
            && (c.staging_ring < super::staging::MIN_STAGING_RING
                || c.staging_ring > super::staging::MAX_STAGING_RING)
        {
            return Err(AgentError::Config {
                setting: "staging_ring",
                reason: "0 (none) or from 64 KiB to 32 MiB",
            });
        }
        let mut config = c.clone();
        if !self.qp.init.access.contains(AccessFlags::REMOTE_WRITE) {
            // The peer could not write it.
            config.staging_ring = 0;
        }
        let mut qp = self.qp;
        qp.caps = QpCaps {
            max_recv_wr: qp.caps.max_recv_wr.max(c.recv_queue_depth()),
            ..qp.caps
        };
        Ok((qp, Rc::new(config)))
    }

    fn open(&self) -> Result<Device, AgentError> {
        if let Some(d) = &self.device {
            if self.require_hardware && d.context().provider_caps().software {
                return Err(AgentError::Config {
                    setting: "require_hardware",
                    reason: "the device given to the builder is the software device",
                });
            }
            return Ok(d.clone());
        }
        let name = self.device_name.as_deref();
        let opened = if self.require_hardware {
            open_hardware_device(name)
        } else {
            open_device(name)
        };
        let ctx = opened.map_err(|source| AgentError::Device {
            stage: "opening the device",
            source,
        })?;
        let dev = match self.cq_size {
            Some(cqe) => Device::with_cq_size(ctx, cqe),
            None => Device::open(ctx),
        };
        dev.map_err(|source| AgentError::Runtime {
            stage: "binding the device to the runtime",
            source,
        })
    }

    /// The agent's QP factory on `device` with `qp`: if the device refuses
    /// the default `max_inline_data`, it retries with the runtime's
    /// default QP caps' one.
    fn agent_qps(&self, device: &Device, qp: QpConfig) -> AgentQps {
        let smaller = QpCaps::default().max_inline_data;
        let fallback = (!self.inline_set && qp.caps.max_inline_data > smaller).then(|| {
            let mut qp = qp;
            qp.caps.max_inline_data = smaller;
            DeviceQps::new(device.clone(), qp)
        });
        AgentQps::new(DeviceQps::new(device.clone(), qp)).with_fallback(fallback)
    }

    /// What a connection manager connection needs: the checked QP and
    /// agent settings, the device, and the handshake limit.
    pub(super) fn cm_parts(&self) -> Result<(QpConfig, Rc<Config>, Device, Duration), AgentError> {
        let (qp, config) = self.checked()?;
        Ok((qp, config, self.open()?, self.handshake_timeout))
    }

    /// Listens on `addr` (port 0 = ephemeral). Must run on a verbio runtime.
    pub fn listen(&self, addr: SocketAddr) -> Result<RdmaListener, AgentError> {
        let (qp, config) = self.checked()?;
        let device = self.open()?;
        let qps = self.agent_qps(&device, qp);
        let mut srqs = None;
        let qps = match self.srq {
            None => qps,
            Some(SrqPolicy { depth: 0, .. }) => {
                return Err(AgentError::Config {
                    setting: "shared_receive_queue",
                    reason: "needs at least 1 buffer",
                })
            }
            Some(policy) => {
                let srq = Rc::new(ListenerSrq::new(&device, policy, config.posted_buf_size())?);
                srqs = Some(srq.clone());
                qps.on_srq(srq)
            }
        };
        let listener = Listener::bind(addr, qps, self.handshake_timeout)?;
        Ok(RdmaListener {
            listener,
            srq: srqs,
            device,
            config,
            mtu: qp.mtu,
            starting: RefCell::new(FuturesUnordered::new()),
        })
    }

    /// Connects to a listener at `addr`. Must run on a verbio runtime.
    pub async fn connect(&self, addr: SocketAddr) -> Result<Rdma, AgentError> {
        let (qp, config) = self.checked()?;
        let device = self.open()?;
        let conn = connect(addr, &self.agent_qps(&device, qp), self.handshake_timeout).await?;
        let mut rdma = Rdma::start(conn, device.clone(), config, qp.mtu).await?;
        rdma.set_redial(self.clone().device(device), Redial::Tcp(addr));
        Ok(rdma)
    }
}

/// A connection whose agent settings exchange is running.
type Starting = Pin<Box<dyn Future<Output = Result<Rdma, AgentError>>>>;

/// Accepts [`Rdma`] connections.
pub struct RdmaListener {
    listener: Listener<AgentQps>,
    /// Its shared receive queue and count of connections with their own.
    srq: Option<Rc<ListenerSrq>>,
    device: Device,
    config: Rc<Config>,
    mtu: Option<Mtu>,
    /// Settings exchanges in progress: run side by side, so a client that
    /// stalls in its exchange does not hold up the others.
    starting: RefCell<FuturesUnordered<Starting>>,
}

impl std::fmt::Debug for RdmaListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaListener")
            .field("listener", &self.listener)
            .field("starting", &self.starting.borrow().len())
            .finish_non_exhaustive()
    }
}

impl RdmaListener {
    /// The bound address.
    pub fn local_addr(&self) -> Result<SocketAddr, AgentError> {
        Ok(self.listener.local_addr()?)
    }

    /// Connections this listener accepted (or is setting up) with a
    /// receive queue of their own, live: the count
    /// [`RdmaBuilder::shared_receive_queue_above`] compares with its
    /// threshold. 0 without a shared receive queue policy
    /// ([`RdmaBuilder::no_shared_receive_queue`]), where it is not counted.
    pub fn own_queue_connections(&self) -> usize {
        self.srq.as_ref().map_or(0, |s| s.own_queues())
    }

    /// The next connection. Clients whose endpoint handshake fails are
    /// skipped; a client whose agent settings are incompatible (or that
    /// fails the settings exchange) is refused with the error, which
    /// concerns that client only: keep accepting.
    ///
    /// Connections run their settings exchange side by side (each bounded
    /// by the handshake timeout): a client that stalls there does not hold
    /// up the next. Cancel-safe: exchanges in progress are kept for the
    /// next call.
    pub async fn accept(&self) -> Result<Rdma, AgentError> {
        let mut next = pin!(self.listener.accept());
        poll_fn(|cx| loop {
            if let Poll::Ready(Some(r)) = self.starting.borrow_mut().poll_next_unpin(cx) {
                return Poll::Ready(r);
            }
            match next.as_mut().poll(cx) {
                Poll::Ready(Ok(conn)) => {
                    let start =
                        Rdma::start(conn, self.device.clone(), self.config.clone(), self.mtu);
                    self.starting.borrow_mut().push(Box::pin(start));
                    // Poll the new exchange at once, and the listener again.
                    next.set(self.listener.accept());
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e.into())),
                Poll::Pending => return Poll::Pending,
            }
        })
        .await
    }
}
