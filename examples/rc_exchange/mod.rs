//! What `rc_pingpong` and `srq_pingpong` share: the flags of rdma-core's
//! `ibv_rc_pingpong` / `ibv_srq_pingpong`, their address exchange
//! (`wire.rs`), and their ping-pong, run the way those programs run it.
//!
//! The ping-pong (rdma-core's algorithm, on `n` RC QPs): the client sends
//! on every QP; a QP sends again once its last send completed and a
//! message arrived on it; both sides count sends and receives over all QPs
//! and stop when both counts reach `--iters` (so a side may send up to
//! `n - 1` more). Verbio receives through one [`RecvRing`]: the QP's own
//! (`rc_pingpong`) or one on a shared receive queue (`srq_pingpong`),
//! whose messages say which QP they came in on.
//!
//! Data checked with `-c`: verbio's client sends self-describing payloads
//! (a 4-byte sequence number and bytes derived from it) and checks every
//! byte of each reply. With one QP each message has its own number and the
//! reply must be that message. With several, every message carries the
//! same one: `ibv_srq_pingpong` receives and sends all its QPs' messages
//! in one buffer, so a reply can be made of parts of several messages
//! (measured on rxe: it is, with 16 QPs), which is the message sent only
//! if they are all alike. Verbio's server answers each message with its
//! bytes and checks them: verbio's payloads must be intact, rdma-core's
//! (a constant buffer) the same every time.
#![allow(dead_code)]

pub mod wire;

use std::cell::Cell;
use std::error::Error;
use std::net::{Ipv6Addr, SocketAddr};
use std::task::Poll;
use std::time::{Duration, Instant};

use futures::stream::FuturesUnordered;
use futures::StreamExt;

use verbio::ops::verbs::Verbs;
use verbio::provider::{Context, Endpoint, Gid, InitAttr, Mtu, ProviderKind, RtrAttr, RtsAttr};
use verbio::runtime::buf::{LocalBuf, MrPool};
use verbio::runtime::{timeout, Device, QueuePair, RecvRing, Runtime};

use verbio::ErrorChain;
use wire::{Oob, WireDest};

/// The flags both programs have (their names and defaults).
#[derive(clap::Args, Clone, Debug)]
pub struct Common {
    /// Server to connect to; without it, serve and wait for a client.
    pub server: Option<String>,
    /// TCP port of the address exchange.
    #[arg(short, long, default_value_t = 18515)]
    pub port: u16,
    /// RDMA device (e.g. rxe0); else `VERBIO_DEVICE`, else the first
    /// ibverbs device, else the software device.
    #[arg(short = 'd', long = "ib-dev")]
    pub device: Option<String>,
    /// Port of the RDMA device.
    #[arg(short = 'i', long = "ib-port", default_value_t = 1)]
    pub ib_port: u8,
    /// Message size in bytes.
    #[arg(short, long, default_value_t = 4096)]
    pub size: usize,
    /// Path MTU (256 .. 4096).
    #[arg(short, long, default_value_t = 1024)]
    pub mtu: u32,
    /// Receives kept posted.
    #[arg(short, long = "rx-depth", default_value_t = 500)]
    pub rx_depth: u32,
    /// Messages each way (over all QPs).
    #[arg(short = 'n', long, default_value_t = 1000)]
    pub iters: usize,
    /// Service level.
    #[arg(short = 'l', long, default_value_t = 0)]
    pub sl: u8,
    /// Local GID index (needed on RoCE); without it no GID is sent.
    #[arg(short = 'g', long = "gid-idx")]
    pub gid_idx: Option<u8>,
    /// Check the data of every message.
    #[arg(short = 'c', long = "chk")]
    pub chk: bool,
    /// Sleep on completion events instead of busy-polling.
    #[arg(short = 'e', long = "events")]
    pub events: bool,
    /// Seconds the exchange, and then the ping-pong, may take.
    #[arg(long, default_value_t = 60)]
    pub timeout: u64,
}

/// How long the runtime spins on the CQ before sleeping, unless `-e`.
const BUSY_POLL: Duration = Duration::from_millis(50);

/// How the QPs receive.
pub enum Receive {
    /// Each QP its own receive queue (one QP).
    OwnQueue,
    /// All on one shared receive queue; 256 address slots exchanged, as
    /// `ibv_srq_pingpong` does.
    Shared,
}

/// `ibv_srq_pingpong`'s `MAX_QP`: the addresses it always exchanges.
pub const SRQ_SLOTS: usize = 256;

/// The self-describing payload of sequence number `seq` (nonzero).
pub fn payload(seq: u32, out: &mut [u8]) {
    for (i, b) in out.iter_mut().enumerate() {
        *b = if i < 4 {
            seq.to_le_bytes()[i]
        } else {
            (seq.wrapping_mul(2_654_435_761) >> ((i % 4) * 8)) as u8 ^ (i as u8)
        };
    }
}

/// The sequence number of an intact payload.
fn payload_seq(data: &[u8]) -> Option<u32> {
    if data.len() < 8 {
        return None;
    }
    let seq = u32::from_le_bytes([data[0], data[1], data[2], data[3]]);
    let mut want = vec![0u8; data.len()];
    payload(seq, &mut want);
    (seq != 0 && want == data).then_some(seq)
}

/// What the server has seen from its client.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum ClientKind {
    /// Intact verbio payloads.
    Payloads,
    /// The same bytes every time (rdma-core's client).
    Constant,
}

const SEND: u8 = 2;
const RECV: u8 = 1;

/// The ping-pong over `qps`, receiving from `ring`; returns the time it
/// took. `progress` counts received messages.
async fn ping_pong(
    args: &Common,
    qps: &[QueuePair],
    ring: &mut RecvRing,
    pool: &MrPool,
    progress: &Cell<usize>,
) -> Result<Duration, Box<dyn Error>> {
    let client = args.server.is_some();
    let n = qps.len();
    let size = args.size;
    let check = args.chk && size >= 8;
    let mut bufs: Vec<Option<LocalBuf>> = Vec::with_capacity(n);
    for _ in 0..n {
        bufs.push(Some(pool.alloc_from(&vec![0u8; size])?));
    }
    // What each QP sends next (the server: what it received last).
    let mut next: Vec<Vec<u8>> = vec![vec![0u8; size]; n];
    // The client's last payload sent on each QP, and the highest seq sent.
    let mut sent_seq = vec![0u32; n];
    let mut max_seq = 0u32;
    let mut kind: Option<(ClientKind, Vec<u8>)> = None;
    let mut pending = vec![if client { SEND | RECV } else { RECV }; n];
    let (mut scnt, mut rcnt) = (0usize, 0usize);
    let mut sends = FuturesUnordered::new();
    let send = |q: usize, mut buf: LocalBuf, data: &[u8]| {
        buf.copy_from_slice(data);
        let qp = qps[q].clone();
        async move {
            let (res, buf) = qp.send(buf).await;
            (q, res, buf)
        }
    };
    let start = Instant::now();
    if client {
        for q in 0..n {
            if n == 1 || max_seq == 0 {
                max_seq += 1;
            }
            sent_seq[q] = max_seq;
            payload(max_seq, &mut next[q]);
            let buf = bufs[q].take().ok_or("send buffer in use")?;
            sends.push(send(q, buf, &next[q]));
        }
    }
    enum Event<M, S> {
        Msg(M),
        Sent(S),
    }
    while rcnt < args.iters || scnt < args.iters {
        let ev = std::future::poll_fn(|cx| {
            if let Poll::Ready(Some(s)) = sends.poll_next_unpin(cx) {
                return Poll::Ready(Event::Sent(s));
            }
            ring.poll_next(cx).map(Event::Msg)
        })
        .await;
        let q = match ev {
            Event::Sent((q, res, buf)) => {
                res.map_err(|e| format!("send on QP {q}: {}", ErrorChain(&e)))?;
                bufs[q] = Some(buf);
                scnt += 1;
                pending[q] &= !SEND;
                q
            }
            Event::Msg(None) => return Err("the receive ring ended".into()),
            Event::Msg(Some(m)) => {
                let m = m?;
                let q = qps
                    .iter()
                    .position(|qp| qp.qp_num() == m.qp_num())
                    .ok_or_else(|| format!("message on unknown QP {:#x}", m.qp_num()))?;
                if m.len() != size {
                    return Err(
                        format!("QP {q}: received {} bytes, expected {size}", m.len()).into(),
                    );
                }
                if client && check {
                    let seq = payload_seq(&m)
                        .ok_or_else(|| format!("QP {q}: message {rcnt}: corrupt reply"))?;
                    if seq != sent_seq[q] {
                        return Err(format!(
                            "QP {q}: message {rcnt}: reply {seq}, not a message sent (last {})",
                            sent_seq[q]
                        )
                        .into());
                    }
                } else if check {
                    let k = &*kind.get_or_insert_with(|| match payload_seq(&m) {
                        Some(_) => (ClientKind::Payloads, Vec::new()),
                        None => (ClientKind::Constant, m.to_vec()),
                    });
                    let ok = match k {
                        (ClientKind::Payloads, _) => payload_seq(&m).is_some(),
                        (ClientKind::Constant, first) => first[..] == m[..],
                    };
                    if !ok {
                        return Err(format!("QP {q}: message {rcnt}: unexpected data").into());
                    }
                }
                if !client {
                    next[q].copy_from_slice(&m);
                }
                rcnt += 1;
                progress.set(rcnt);
                pending[q] &= !RECV;
                q
            }
        };
        if scnt < args.iters && pending[q] == 0 {
            if client && n == 1 {
                max_seq += 1;
                sent_seq[q] = max_seq;
                payload(max_seq, &mut next[q]);
            }
            let buf = bufs[q].take().ok_or("send buffer in use")?;
            sends.push(send(q, buf, &next[q]));
            pending[q] = SEND | RECV;
        }
    }
    Ok(start.elapsed())
}

fn mtu_of(bytes: u32) -> Result<Mtu, Box<dyn Error>> {
    Ok(match bytes {
        256 => Mtu::Mtu256,
        512 => Mtu::Mtu512,
        1024 => Mtu::Mtu1024,
        2048 => Mtu::Mtu2048,
        4096 => Mtu::Mtu4096,
        other => return Err(format!("MTU {other} is not 256, 512, 1024, 2048 or 4096").into()),
    })
}

/// Runs one side: `qps` RC QPs receiving as `receive` says. Prints
/// rdma-core's summary lines and `name: ...` on success.
pub fn run(
    name: &str,
    args: &Common,
    ctx: Context,
    qps_wanted: usize,
    receive: Receive,
) -> Result<(), Box<dyn Error>> {
    tracing::info!(device = ctx.name(), kind = %ctx.kind(), "opened the RDMA device");
    let soft = ctx.kind() == ProviderKind::Soft;
    let gid_index = args.gid_idx.or(soft.then_some(0));
    let active = ctx.query_port(args.ib_port)?.active_mtu;
    let mtu = mtu_of(args.mtu)?.min(active);
    let busy = if args.events || soft {
        Duration::ZERO
    } else {
        BUSY_POLL
    };
    let rt = Runtime::builder().busy_poll(busy).build()?;
    let rx_depth = args.rx_depth.max(qps_wanted as u32);
    let dev = Device::with_cq_size(ctx, rx_depth + 2 * qps_wanted as u32 + 64)?;
    let caps = verbio::provider::QpCaps {
        max_send_wr: 4,
        max_recv_wr: rx_depth,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    let srq = match receive {
        Receive::OwnQueue => None,
        Receive::Shared => Some(dev.create_srq(rx_depth)?),
    };
    let qps = match &srq {
        None => vec![dev.create_qp(caps)?],
        Some(srq) => (0..qps_wanted)
            .map(|_| dev.create_qp_on_srq(srq, caps))
            .collect::<Result<Vec<_>, _>>()?,
    };
    let sgid = gid_index.unwrap_or(dev.context().default_gid_index(args.ib_port)?);
    let mut ours = Vec::with_capacity(qps.len());
    let mut local_soft = None;
    for qp in &qps {
        qp.modify_to_init(&InitAttr {
            port: args.ib_port,
            ..InitAttr::default()
        })?;
        let ep = qp.endpoint(sgid)?;
        local_soft = ep.addr.to_socket();
        let d = WireDest {
            lid: ep.lid,
            qpn: ep.qpn,
            psn: ep.psn,
            gid: if gid_index.is_some() {
                ep.gid
            } else {
                Gid([0; 16])
            },
        };
        println!(
            "  local address:  LID {:#06x}, QPN {:#08x}, PSN {:#08x}, GID {}",
            d.lid,
            d.qpn,
            d.psn,
            Ipv6Addr::from(d.gid.0)
        );
        ours.push(d);
    }
    // Posted before the exchange: the peer may send as soon as it has our
    // address.
    let (mut ring, slots) = match &srq {
        None => (qps[0].recv_ring(dev.pd(), rx_depth, args.size)?, 1),
        Some(srq) => (
            RecvRing::on_srq(
                srq,
                dev.pd(),
                verbio::runtime::RecvRingConfig::new(rx_depth, args.size),
            )?,
            SRQ_SLOTS,
        ),
    };
    let local = qps[0].endpoint(sgid)?;
    let connect =
        |theirs: &[WireDest], their_soft: Option<SocketAddr>| -> Result<(), Box<dyn Error>> {
            for (i, qp) in qps.iter().enumerate() {
                let t = theirs[i];
                let remote = Endpoint {
                    qpn: t.qpn,
                    psn: t.psn,
                    lid: t.lid,
                    gid: t.gid,
                    addr: their_soft.map_or(verbio::provider::ProviderAddr::NONE, Into::into),
                    mtu,
                    ..local
                };
                qp.modify_to_rtr(&RtrAttr {
                    remote,
                    path_mtu: mtu,
                    min_rnr_timer: 12,
                    max_dest_rd_atomic: 1,
                    sgid_index: sgid,
                    hop_limit: 1,
                })?;
                qp.modify_to_rts(&RtsAttr {
                    timeout: 14,
                    retry_cnt: 7,
                    rnr_retry: 7,
                    max_rd_atomic: 1,
                })?;
            }
            Ok(())
        };
    let oob = Oob {
        server: args.server.as_deref(),
        port: args.port,
        timeout: Duration::from_secs(args.timeout),
    };
    let mut connect_server = |t: &[WireDest], s: Option<SocketAddr>| connect(t, s);
    let (theirs, their_soft) = wire::exchange(&oob, &ours, slots, local_soft, &mut connect_server)?;
    for t in theirs.iter().take(qps.len()) {
        println!(
            "  remote address: LID {:#06x}, QPN {:#08x}, PSN {:#08x}, GID {}",
            t.lid,
            t.qpn,
            t.psn,
            Ipv6Addr::from(t.gid.0)
        );
    }
    if args.server.is_some() {
        connect(&theirs, their_soft)?;
    }
    let pool = MrPool::new(dev.pd());
    let limit = Duration::from_secs(args.timeout);
    let progress = Cell::new(0);
    let elapsed = match rt.block_on(timeout(
        limit,
        ping_pong(args, &qps, &mut ring, &pool, &progress),
    )) {
        Ok(r) => r?,
        Err(_) => {
            return Err(format!(
                "timed out after {limit:?} with {} messages received",
                progress.get()
            )
            .into())
        }
    };
    let secs = elapsed.as_secs_f64();
    let bytes = (args.size * args.iters * 2) as u64;
    println!(
        "{bytes} bytes in {secs:.2} seconds = {:.2} Mbit/sec",
        bytes as f64 * 8.0 / secs / 1e6
    );
    println!(
        "{} iters in {secs:.2} seconds = {:.2} usec/iter",
        args.iters,
        secs * 1e6 / args.iters as f64
    );
    println!(
        "{name}: {} messages each way of {} B on {} QP(s){}",
        args.iters,
        args.size,
        qps.len(),
        if args.chk && args.size >= 8 {
            ", data checked"
        } else {
            ", lengths checked"
        }
    );
    Ok(())
}
