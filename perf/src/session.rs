//! Setup shared by the verbs and raw APIs: the runtime and device, the QP
//! connections, the memory each side grants, and the run budget.

use std::cell::Cell;
use std::net::{SocketAddr, ToSocketAddrs};
use std::time::{Duration, Instant};

use verbio::ops::connect::{connect, DeviceQps, HandshakeError, Listener, QpConfig, QpFactory};
use verbio::ops::verbs::RemoteBuf;
use verbio::provider::{open_device, AccessFlags, Endpoint, Mtu, ProviderKind, QpCaps, RtsAttr};
use verbio::runtime::buf::RemoteAccessRegion;
use verbio::runtime::cm::CmConnection;
use verbio::runtime::{sleep, Device, QueuePair, Runtime, SharedRecvQueue, TcpStream, UdPeer};

use crate::args::{Api, Config, MIN_ITERS};
use crate::ctl::{self, Frame};
use crate::error::{msg, Context, Result};
use crate::report::RunInfo;

/// Bound of one connection handshake.
pub const HANDSHAKE: Duration = Duration::from_secs(10);
/// How long a client retries connecting to a server that is not up yet.
const CONNECT_RETRY: Duration = Duration::from_secs(10);
/// Busy-poll time on hardware: longer than any gap between two completions
/// of a run, so the reactor spins throughout (as perftest).
const BUSY_POLL: Duration = Duration::from_millis(50);
/// Receives posted per QP at most (send tests).
pub const RX_DEPTH: u32 = 256;
/// Receives posted per QP for the latency ping-pong.
pub const LAT_RX_DEPTH: u32 = 8;
/// Completion queue entries: room for every QP's posted sends and receives.
const CQ_SIZE: u32 = 16384;
/// Bound of the memory posted for receives per QP.
const RX_MEMORY: usize = 128 << 20;
/// WR slots of a `--use-srq` shared receive queue (all of a side's QPs).
pub const SRQ_DEPTH: u32 = 2 * RX_DEPTH;

/// Receive buffers to post per QP for messages up to `max_size` bytes.
pub fn rx_depth(max_size: usize, lat: bool) -> u32 {
    let fit = (RX_MEMORY / max_size.max(1)).clamp(2, RX_DEPTH as usize) as u32;
    if lat {
        fit.min(LAT_RX_DEPTH)
    } else {
        fit
    }
}

/// Opens the device and a runtime for it. `spin`: busy-poll before
/// sleeping unless `-e` or the software device (or `--busy-poll` says).
/// Returns the busy-poll time used.
pub fn open(cfg: &Config, spin: bool) -> Result<(Runtime, Device, Duration)> {
    let ctx = open_device(cfg.device.as_deref()).ctx("opening the RDMA device")?;
    let busy = match cfg.busy_poll {
        _ if !spin || cfg.events => Duration::ZERO,
        Some(d) => d,
        None if ctx.kind() == ProviderKind::Soft => Duration::ZERO,
        None => BUSY_POLL,
    };
    tracing::info!(device = ctx.name(), kind = %ctx.kind(), ?busy, "opened the device");
    let rt = Runtime::builder()
        .busy_poll(busy)
        .build()
        .ctx("starting the runtime")?;
    let dev = Device::with_cq_size(ctx, CQ_SIZE).ctx("binding the device to the runtime")?;
    Ok((rt, dev, busy))
}

/// The QP attributes of a run.
pub fn qp_config(cfg: &Config) -> QpConfig {
    let default = QpConfig::default();
    QpConfig {
        caps: QpCaps {
            // Room for the stop marker and the raw loops' closing WR too.
            max_send_wr: cfg.tx_depth.max(16) + 2,
            // A step's receive rings, and what the previous step's left.
            max_recv_wr: 2 * RX_DEPTH,
            max_inline_data: cfg.inline,
            ..QpCaps::default()
        },
        init: verbio::provider::InitAttr {
            port: cfg.ib_port,
            ..default.init
        },
        gid_index: cfg.gid_index,
        // A sender that finds no receive posted (the receive rings of large
        // sizes are shallow) retries after 10 µs instead of 640 µs.
        min_rnr_timer: 1,
        // About 1 s per transport retry: an emulated VM on a loaded host can
        // leave a responder unscheduled longer than the default 67 ms × 6.
        rts: RtsAttr {
            timeout: 18,
            ..default.rts
        },
        ..default
    }
}

/// The server's listening address for `port`.
pub fn listen_addr(port: u16) -> SocketAddr {
    SocketAddr::from(([0, 0, 0, 0], port))
}

/// Resolves the client's `host` with the run's port.
pub fn resolve(host: &str, port: u16) -> Result<SocketAddr> {
    (host, port)
        .to_socket_addrs()
        .ctx(format!("resolving {host}"))?
        .next()
        .ok_or_else(|| msg(format!("{host} resolves to no address")))
}

/// Counts the run's iterations, or its time.
#[derive(Debug)]
pub struct Budget {
    iters: Option<u64>,
    duration: Option<Duration>,
    /// With a duration: set at the first iteration (a step's setup, such
    /// as registering its buffers, does not count).
    deadline: Cell<Option<Instant>>,
    /// With a duration: the clock is read every `stride` iterations.
    stride: u64,
    expired: Cell<bool>,
}

impl Budget {
    /// `iters` iterations, or (without) `duration` from the first
    /// iteration on, and at least [`MIN_ITERS`] (the statistics need them).
    pub fn new(iters: Option<u64>, duration: Option<Duration>) -> Budget {
        Budget {
            iters,
            duration,
            deadline: Cell::new(None),
            stride: 64,
            expired: Cell::new(false),
        }
    }

    /// The budget of a step of `size`-byte messages: as [`Budget::new`],
    /// reading the clock every 64 iterations up to 1 KiB and more often
    /// above (every iteration from 64 KiB), so that a slow large message
    /// cannot run the step far past its time.
    pub fn step(cfg: &Config, size: usize) -> Budget {
        let mut b = Budget::new(cfg.iters, cfg.duration);
        b.stride = (65536 / size.max(1)).clamp(1, 64) as u64;
        b
    }

    /// Whether iteration `n` (0-based) runs.
    #[inline]
    pub fn more(&self, n: u64) -> bool {
        if let Some(max) = self.iters {
            return n < max;
        }
        if n == 0 && self.deadline.get().is_none() {
            self.deadline.set(self.duration.map(|d| Instant::now() + d));
        }
        if n < MIN_ITERS {
            return true;
        }
        if (n % self.stride == 0 || n == MIN_ITERS) && !self.expired.get() {
            let over = self.deadline.get().is_none_or(|d| Instant::now() >= d);
            self.expired.set(over);
        }
        !self.expired.get()
    }

    /// The budget of a step as the client announced it (`Frame::Step`):
    /// `iters`, or (0) `ms` milliseconds; for the server's own loop of
    /// `-b`, which runs what the client's runs.
    pub fn from_wire(iters: u64, ms: u32, size: usize) -> Budget {
        let mut b = match iters {
            0 => Budget::new(None, Some(Duration::from_millis(u64::from(ms).max(1)))),
            n => Budget::new(Some(n), None),
        };
        b.stride = (65536 / size.max(1)).clamp(1, 64) as u64;
        b
    }

    /// The step's iteration count on the wire (0: until the stop marker).
    pub fn wire_iters(&self) -> u64 {
        self.iters.unwrap_or(0)
    }

    /// A timed step's duration on the wire, in milliseconds (0 with
    /// iterations).
    pub fn wire_ms(&self) -> u32 {
        match (self.iters, self.duration) {
            (None, Some(d)) => u32::try_from(d.as_millis()).unwrap_or(u32::MAX).max(1),
            _ => 0,
        }
    }
}

/// One side's connected QPs, control stream and memory.
pub struct Conn {
    /// The QPs, connected.
    pub qps: Vec<QueuePair>,
    /// The control stream (the first QP's setup connection).
    pub ctl: TcpStream,
    /// The path MTU.
    pub mtu: Mtu,
    /// Memory this side grants to the peer (the run's largest size, at
    /// least one 8-byte word).
    pub region: RemoteAccessRegion<Vec<u8>>,
    /// The peer's granted memory.
    pub remote: RemoteBuf,
    /// The run's largest message.
    pub max_size: usize,
    /// `-c UD`: where this side's datagrams go.
    pub peer: Option<UdPeer>,
    /// `--use-srq`: the shared receive queue of this side's QPs.
    pub srq: Option<SharedRecvQueue>,
    /// `-R`: the RDMA CM connections of the QPs (dropping one tears it
    /// down).
    pub cm: Vec<CmConnection>,
}

/// Swaps memory grants over `ctl` (the client first) and returns the
/// connection.
#[allow(clippy::too_many_arguments)]
pub async fn finish(
    dev: &Device,
    mut ctl: TcpStream,
    qps: Vec<QueuePair>,
    mtu: Mtu,
    max_size: usize,
    peer: Option<UdPeer>,
    client: bool,
) -> Result<Conn> {
    let (region, remote) = if client {
        let region = grant(dev, max_size)?;
        ctl::send(&mut ctl, region_frame(&region))
            .await
            .ctx("sending this side's memory")?;
        (region, peer_region(&mut ctl).await?)
    } else {
        let remote = peer_region(&mut ctl).await?;
        let region = grant(dev, max_size)?;
        ctl::send(&mut ctl, region_frame(&region))
            .await
            .ctx("sending this side's memory")?;
        (region, remote)
    };
    Ok(Conn {
        qps,
        ctl,
        mtu,
        region,
        remote,
        max_size,
        peer,
        srq: None,
        cm: Vec::new(),
    })
}

/// Grants `len` bytes (at least 8, 8-byte aligned) with remote read, write
/// and atomic access.
fn grant(dev: &Device, len: usize) -> Result<RemoteAccessRegion<Vec<u8>>> {
    let access = AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC;
    let region = RemoteAccessRegion::grant(dev.pd(), vec![0u8; len.max(8)], access)
        .map_err(|r| r.error)
        .ctx(format!("registering {len} bytes for the peer"))?;
    if region.addr() % 8 != 0 {
        return Err(msg(
            "the granted memory is not 8-byte aligned (atomics need it)",
        ));
    }
    Ok(region)
}

fn region_frame(r: &RemoteAccessRegion<Vec<u8>>) -> Frame {
    Frame::Region {
        addr: r.addr(),
        len: r.len() as u64,
        rkey: r.rkey(),
    }
}

async fn peer_region(ctl: &mut TcpStream) -> Result<RemoteBuf> {
    match ctl::recv(ctl).await.ctx("reading the peer's memory")? {
        Frame::Region { addr, len, rkey } => Ok(RemoteBuf::new(addr, len, rkey)),
        got => Err(msg(format!("expected the peer's memory, got {got:?}"))),
    }
}

/// Client: connects `cfg.qps` QPs to the server, announces the run and
/// swaps memory grants.
pub async fn dial(cfg: &Config, dev: &Device, addr: SocketAddr) -> Result<Conn> {
    let qps = PerfQps::new(cfg, dev)?;
    let max_size = cfg.max_size();
    let mut conns = Vec::new();
    let deadline = Instant::now() + CONNECT_RETRY;
    let mut ctl_stream = None;
    let mut mtu = Mtu::Mtu4096;
    while conns.len() < cfg.qps as usize {
        match connect(addr, &qps, HANDSHAKE).await {
            Ok(c) => {
                mtu = mtu.min(c.local.mtu.min(c.remote.mtu));
                if ctl_stream.is_none() {
                    let mut s = c.stream;
                    ctl::send(
                        &mut s,
                        Frame::Hello {
                            test: cfg.test,
                            api: cfg.api.code(),
                            connection: cfg.connection.code(),
                            qps: u16::try_from(cfg.qps).map_err(|_| msg("-q is too large"))?,
                            max_size: max_size as u64,
                            mode: cfg.mode(),
                        },
                    )
                    .await
                    .ctx("sending the hello")?;
                    ctl_stream = Some(s);
                }
                conns.push(c.qp);
            }
            Err(HandshakeError::Io { .. }) if conns.is_empty() && Instant::now() < deadline => {
                sleep(Duration::from_millis(50)).await
            }
            Err(e) => return Err(e).ctx(format!("connecting to {addr}")),
        }
    }
    let ctl = ctl_stream.ok_or_else(|| msg("no connection"))?;
    let mut conn = finish(dev, ctl, conns, mtu, max_size, None, true).await?;
    conn.srq = qps.srq;
    Ok(conn)
}

/// The server's listener of TCP handshakes, and the shared receive queue
/// its QPs go on (`--use-srq`).
pub struct RcListener {
    l: Listener<PerfQps>,
    srq: Option<SharedRecvQueue>,
}

/// Server: binds the listener (printing its address on stderr).
pub fn bind(cfg: &Config, dev: &Device) -> Result<RcListener> {
    let qps = PerfQps::new(cfg, dev)?;
    let srq = qps.srq.clone();
    let l = Listener::bind(listen_addr(cfg.port), qps, HANDSHAKE)
        .ctx(format!("listening on TCP port {}", cfg.port))?;
    let local = l.local_addr().ctx("reading the listening address")?;
    eprintln!(
        "verbio-perf: {} server listening on {local}",
        cfg.test.name()
    );
    Ok(RcListener { l, srq })
}

/// Server: accepts one client's QPs, checks its hello and swaps memory
/// grants.
pub async fn accept(cfg: &Config, dev: &Device, rc: &RcListener) -> Result<Conn> {
    let l = &rc.l;
    let first = l.accept().await.ctx("accepting the client")?;
    let mut ctl = first.stream;
    let mut mtu = first.local.mtu.min(first.remote.mtu);
    let hello = ctl::recv(&mut ctl)
        .await
        .ctx("reading the client's hello")?;
    let (n, max_size) = ctl::check_hello(hello, cfg.test, cfg.api, cfg.connection, cfg.mode())
        .ctx("the client's hello")?;
    let mut qps = vec![first.qp];
    while qps.len() < n as usize {
        let c = l.accept().await.ctx("accepting the client's next QP")?;
        mtu = mtu.min(c.local.mtu.min(c.remote.mtu));
        qps.push(c.qp);
    }
    let mut conn = finish(dev, ctl, qps, mtu, max_size, None, false).await?;
    conn.srq = rc.srq.clone();
    Ok(conn)
}

/// Makes a run's RC QPs: [`DeviceQps`], on the side's shared receive
/// queue with `--use-srq`.
pub struct PerfQps {
    qps: DeviceQps,
    srq: Option<SharedRecvQueue>,
}

impl PerfQps {
    /// The QPs of `cfg` on `dev`; with `--use-srq`, creates the SRQ.
    pub fn new(cfg: &Config, dev: &Device) -> Result<PerfQps> {
        let srq = if cfg.srq {
            Some(
                dev.create_srq(SRQ_DEPTH)
                    .ctx("creating the shared receive queue")?,
            )
        } else {
            None
        };
        Ok(PerfQps {
            qps: DeviceQps::new(dev.clone(), qp_config(cfg)),
            srq,
        })
    }
}

impl QpFactory for PerfQps {
    type Qp = QueuePair;

    fn provider(&self) -> ProviderKind {
        self.qps.provider()
    }

    fn create(&self) -> std::result::Result<(QueuePair, Endpoint), HandshakeError> {
        match &self.srq {
            Some(srq) => self.qps.create_on_srq(srq),
            None => self.qps.create(),
        }
    }

    fn connect(
        &self,
        qp: &QueuePair,
        local: &Endpoint,
        remote: &Endpoint,
    ) -> std::result::Result<(), HandshakeError> {
        self.qps.connect(qp, local, remote)
    }
}

/// The banner's facts about a verbs or raw run.
pub fn run_info(cfg: &Config, dev: &Device, conn: &Conn, busy: Duration) -> RunInfo {
    RunInfo {
        test: cfg.test,
        api: cfg.api,
        transport: cfg.transport,
        connection: cfg.connection,
        device: dev.context().name().to_string(),
        provider: dev.context().kind().to_string(),
        qps: conn.qps.len() as u32,
        tx_depth: cfg.tx_depth,
        inline_size: conn.qps.first().map_or(0, |q| q.caps().max_inline_data),
        mtu: conn.mtu.bytes(),
        completions: completions(cfg.api, busy),
        bw_units: if cfg.gbits { "Gb/sec" } else { "MB/sec" }.into(),
        bidirectional: cfg.bidirectional,
        srq: cfg.srq,
        rdma_cm: cfg.rdma_cm,
    }
}

/// How completions are waited for, for the banner.
pub fn completions(api: Api, busy: Duration) -> String {
    match api {
        Api::Raw => "busy poll of the CQ (raw loop)".into(),
        _ if busy.is_zero() => "events (sleeps on the completion channel)".into(),
        _ => format!("busy poll ({busy:?} before sleeping)"),
    }
}

/// Closes the QPs (bounded): disconnects them through the RDMA CM with
/// `-R`.
pub async fn close(conn: &Conn) {
    for c in &conn.cm {
        if let Err(e) = c.disconnect().await {
            tracing::debug!(error = %verbio::ErrorChain(&e), "disconnecting through the RDMA CM");
        }
    }
    for qp in &conn.qps {
        let _ = verbio::runtime::timeout(Duration::from_secs(5), qp.close()).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn receive_depth_bounds_memory() {
        assert_eq!(rx_depth(64, false), RX_DEPTH);
        assert_eq!(rx_depth(64, true), LAT_RX_DEPTH);
        assert_eq!(rx_depth(1 << 23, false), 16);
        assert_eq!(rx_depth(1 << 30, false), 2);
    }

    #[test]
    fn budget_counts_iterations_or_time() {
        let b = Budget::new(Some(3), None);
        assert!(b.more(2) && !b.more(3));
        assert_eq!(b.wire_iters(), 3);
        let t = Budget::new(None, Some(Duration::ZERO));
        assert!(
            (0..MIN_ITERS).all(|n| t.more(n)),
            "the statistics' minimum runs"
        );
        assert!(!t.more(MIN_ITERS) && !t.more(MIN_ITERS + 1));
        assert_eq!(t.wire_iters(), 0);
        let long = Budget::new(None, Some(Duration::from_secs(60)));
        assert!(long.more(0) && long.more(1000));
        // The time counts from the first iteration, not from the budget's making.
        let late = Budget::new(None, Some(Duration::from_millis(200)));
        std::thread::sleep(Duration::from_millis(250));
        assert!(late.more(0) && late.more(MIN_ITERS) && late.more(64));
    }
}
