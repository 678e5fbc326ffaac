//! `ud_pingpong`: UD SEND ping-pong that speaks rdma-core's
//! `ibv_ud_pingpong` protocol, so either side can be verbio or
//! `ibv_ud_pingpong` (from rdma-core's `ibverbs-utils`).
//!
//! Out of band, over TCP (port 18515 by default), each side sends its
//! address as `ibv_ud_pingpong` does: a 52-byte NUL-terminated text
//! `LID:QPN:PSN:GID` (`%04x:%06x:%06x:` and the GID as 32 hex digits, its
//! 16 bytes in order); the client writes its address, reads the server's
//! and writes `done`. Then the client sends `--size` bytes, the server
//! answers with the same bytes, `--iters` times; datagrams carry Q_Key
//! 0x11111111 and every receive buffer has 40 bytes of room for the GRH
//! before the payload.
//!
//! Checked on every datagram: its status and length. With `-c` (as
//! `ibv_ud_pingpong -c`) also the sender's QP number, (with a GID) the
//! sender's GID in the GRH, and the data: verbio's client sends a
//! different pattern each round trip and expects it back; verbio's server
//! answers with what it received and expects either verbio's patterns or,
//! from `ibv_ud_pingpong` (which answers with the payload it last
//! received), the same bytes every time. Without `-c` the loop is what
//! perftest's `ib_send_lat` measures (which checks no data either).
//!
//! ```text
//! ibv_ud_pingpong -d rxe0 -g 1 &          # rdma-core server
//! cargo run --example ud_pingpong --features ibverbs -- -d rxe0 -g 1 -c 127.0.0.1
//! cargo run --example ud_pingpong --features ibverbs -- -d rxe0 -g 1 -c &
//! ibv_ud_pingpong -d rxe0 -g 1 127.0.0.1  # rdma-core client
//! ```
//!
//! On verbio's side it is the runtime's UD queue pair
//! ([`Device::create_ud_qp`]): receives through a [`RecvRing`] (its slots
//! leave room for the GRH; [`RingMsg::source`] says who sent a datagram),
//! sends with [`QueuePair::post_send_inline_to`] when the payload fits the
//! QP's inline data, else [`Verbs::send_to`] from a registered buffer, to
//! the [`UdPeer`] made from the peer's address.
//!
//! [`RecvRing`]: verbio::runtime::RecvRing
//! [`RingMsg::source`]: verbio::runtime::RingMsg::source
//!
//! The device is `-d`, else `VERBIO_DEVICE`, else the first ibverbs device
//! with an active port, else the software device (both sides verbio: the
//! soft device's engine address follows each side's 52-byte address).
//! `scripts/rxe-test.sh` runs both pairings against `ibv_ud_pingpong` in the
//! rxe VM.

mod cli;
#[path = "rc_exchange/wire.rs"]
mod wire;

use std::cell::Cell;
use std::error::Error;
use std::net::Ipv6Addr;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;

use verbio::ops::verbs::Verbs;
use verbio::provider::{open_device, Endpoint, Gid, ProviderKind, QpCaps, UdAttr, DEFAULT_QKEY};
use verbio::runtime::buf::{LocalBuf, MrPool};
use verbio::runtime::{timeout, Device, QueuePair, RecvRing, RingMsg, Runtime, UdEndpoint, UdPeer};
use wire::{exchange, Oob, WireDest};

/// UD ping-pong, wire-compatible with rdma-core's `ibv_ud_pingpong`.
#[derive(Parser)]
struct Args {
    /// Server to connect to; without it, serve and wait for a client.
    server: Option<String>,
    /// TCP port of the address exchange.
    #[arg(short, long, default_value_t = 18515)]
    port: u16,
    /// RDMA device (e.g. rxe0).
    #[arg(short = 'd', long = "ib-dev")]
    device: Option<String>,
    /// Port of the RDMA device.
    #[arg(short = 'i', long = "ib-port", default_value_t = 1)]
    ib_port: u8,
    /// Message size in bytes (at most the port's MTU).
    #[arg(short, long, default_value_t = 1024, value_parser = cli::at_least_one)]
    size: usize,
    /// Receives kept posted.
    #[arg(short, long = "rx-depth", default_value_t = 500)]
    rx_depth: u32,
    /// Round trips.
    #[arg(short = 'n', long, default_value_t = 1000)]
    iters: usize,
    /// Service level of the datagrams.
    #[arg(short = 'l', long, default_value_t = 0)]
    sl: u8,
    /// Local GID index; without it no GID is sent and datagrams carry no
    /// GRH (InfiniBand only: RoCE needs one).
    #[arg(short = 'g', long = "gid-idx")]
    gid_idx: Option<u8>,
    /// Check each datagram's sender and data, not only its length.
    #[arg(short = 'c', long = "chk")]
    chk: bool,
    /// Sleep on completion events instead of busy-polling (the default on
    /// hardware, as `ibv_ud_pingpong` polls).
    #[arg(short = 'e', long = "events")]
    events: bool,
    /// Seconds the address exchange, and then the round trips, may take.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
}

/// How long the runtime spins on the CQ before sleeping, unless `-e`.
const BUSY_POLL: Duration = Duration::from_millis(50);

/// The payload verbio's client sends in round trip `i`.
fn pattern(i: usize, out: &mut [u8]) {
    for (j, b) in out.iter_mut().enumerate() {
        *b = (i.wrapping_mul(131) ^ j.wrapping_mul(7)) as u8;
    }
}

fn random_psn() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    (h.finish() as u32) & 0x00ff_ffff
}

/// What verbio's server has seen from its client so far.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ClientKind {
    /// Round trip `i` carried [`pattern`]`(i)`.
    Patterns,
    /// Every datagram repeats the first (`ibv_ud_pingpong`'s client).
    Echo,
}

/// Checks a received datagram's length and sender; returns its payload.
fn check_source<'m>(
    msg: &'m RingMsg,
    size: usize,
    peer: &UdPeer,
    chk: bool,
) -> Result<&'m [u8], String> {
    if msg.len() != size {
        return Err(format!("received {} bytes, expected {size}", msg.len()));
    }
    if !chk {
        return Ok(msg.as_slice());
    }
    let src = msg.source().ok_or("a UD ring message without a source")?;
    if src.qpn != peer.qpn() {
        return Err(format!(
            "datagram from QP {:#x}, not the peer's {:#x}",
            src.qpn,
            peer.qpn()
        ));
    }
    let gid = peer.endpoint().endpoint.gid;
    if !gid.is_zero() && src.gid != Some(gid) {
        return Err(format!(
            "datagram from GID {:?}, not the peer's {gid}",
            src.gid
        ));
    }
    Ok(msg.as_slice())
}

/// Sends `size`-byte datagrams: inline (copied at post time) when the QP
/// takes that much inline data, as `ibv_ud_pingpong` does, else from a
/// registered buffer.
struct Sender {
    qp: QueuePair,
    peer: UdPeer,
    buf: Option<LocalBuf>,
}

impl Sender {
    async fn send(&mut self, payload: &[u8]) -> Result<(), Box<dyn Error>> {
        let Some(mut buf) = self.buf.take() else {
            self.qp
                .post_send_inline_to(&self.peer, payload, None)
                .await?;
            return Ok(());
        };
        buf.copy_from_slice(payload);
        let (res, buf) = self.qp.send_to(&self.peer, buf).await;
        self.buf = Some(buf);
        res?;
        Ok(())
    }
}

/// What a run of round trips measured.
struct Run {
    elapsed: Duration,
    kind: Option<ClientKind>,
    /// The client's round trips.
    rtts: Vec<Duration>,
}

/// The round trips: the client sends and checks the echo; the server
/// checks what arrives and answers with it. `progress` counts the round
/// trips done.
async fn ping_pong(
    args: &Args,
    client: bool,
    ring: &mut RecvRing,
    sender: &mut Sender,
    progress: &Cell<usize>,
) -> Result<Run, Box<dyn Error>> {
    let size = args.size;
    let peer = sender.peer.clone();
    let mut payload = vec![0u8; size];
    let mut kind = None;
    let mut rtts = Vec::with_capacity(if client { args.iters } else { 0 });
    let clock = Ticks::start();
    // One tick read per round trip: each ends where the previous did.
    let mut t = clock.now();
    // Each received buffer goes back to the ring once the next datagram is
    // out, off the round trip's path (as perftest reposts).
    let mut last: Option<RingMsg> = None;
    for i in 0..args.iters {
        progress.set(i);
        if client {
            if args.chk {
                pattern(i, &mut payload);
            }
            sender.send(&payload).await?;
            drop(last.take());
        }
        let msg = match ring.next().await {
            Some(m) => m?,
            None => return Err("the receive ring ended".into()),
        };
        let got = check_source(&msg, size, &peer, args.chk)
            .map_err(|e| format!("round trip {i}: {e}"))?;
        if client {
            if args.chk && got != &payload[..] {
                return Err(format!("round trip {i}: the reply is not the message sent").into());
            }
            let now = clock.now();
            rtts.push(now.wrapping_sub(t));
            t = now;
            last = Some(msg);
            continue;
        }
        if !args.chk {
            payload.copy_from_slice(got);
            sender.send(&payload).await?;
            drop(msg);
            continue;
        }
        let k = *kind.get_or_insert_with(|| {
            pattern(0, &mut payload);
            if got == &payload[..] {
                ClientKind::Patterns
            } else {
                payload.copy_from_slice(got);
                ClientKind::Echo
            }
        });
        if k == ClientKind::Patterns {
            pattern(i, &mut payload);
        }
        if got != &payload[..] {
            return Err(format!("round trip {i}: unexpected data from the client").into());
        }
        // `payload` now equals the datagram: answer with it.
        sender.send(&payload).await?;
        drop(msg);
    }
    drop(last);
    let per_us = clock.per_us();
    Ok(Run {
        elapsed: clock.start.elapsed(),
        kind,
        rtts: rtts
            .into_iter()
            .map(|d| Duration::from_secs_f64(d as f64 / per_us / 1e6))
            .collect(),
    })
}

/// Cheap timestamps for the round trips: the CPU's time-stamp counter on
/// x86-64 (as perftest's `get_cycles`), else the monotonic clock; reading
/// the system clock costs a system call where the clocksource is emulated.
struct Ticks {
    start: Instant,
    start_tick: u64,
}

impl Ticks {
    fn start() -> Ticks {
        let start = Instant::now();
        Ticks {
            start,
            start_tick: Self::tick(start),
        }
    }

    #[cfg(target_arch = "x86_64")]
    fn tick(_: Instant) -> u64 {
        // SAFETY: RDTSC exists on every x86-64 CPU and only reads a counter.
        unsafe { std::arch::x86_64::_rdtsc() }
    }

    #[cfg(not(target_arch = "x86_64"))]
    fn tick(start: Instant) -> u64 {
        start.elapsed().as_nanos() as u64
    }

    fn now(&self) -> u64 {
        Self::tick(self.start)
    }

    /// Ticks per microsecond, measured against the system clock since
    /// [`Ticks::start`] (call at the end).
    fn per_us(&self) -> f64 {
        let us = (self.start.elapsed().as_secs_f64() * 1e6).max(f64::MIN_POSITIVE);
        let ticks = self.now().wrapping_sub(self.start_tick).max(1);
        ticks as f64 / us
    }
}

fn run(args: &Args) -> Result<(), Box<dyn Error>> {
    let ctx = open_device(args.device.as_deref())?;
    let ctx = wire::reachable(ctx, args.server.as_deref(), args.port)?;
    tracing::info!(device = ctx.name(), kind = %ctx.kind(), "opened the RDMA device");
    let mtu = ctx.query_port(args.ib_port)?.active_mtu.bytes() as usize;
    if args.size > mtu {
        return Err(format!("size {} is larger than the port's MTU {mtu}", args.size).into());
    }
    let soft = ctx.kind() == ProviderKind::Soft;
    // The soft device has one GID (index 0), which it always sends.
    let gid_index = args.gid_idx.or(soft.then_some(0));
    let sgid_index = ctx.default_gid_index(args.ib_port)?;
    if gid_index.is_some_and(|g| g != sgid_index) {
        tracing::warn!(
            gid_index,
            sgid_index,
            "datagrams are sent from the device's default GID index (VERBIO_GID_INDEX), not -g"
        );
    }
    // Busy-polling spins on the CQ this long before sleeping.
    let busy = if args.events || soft {
        Duration::ZERO
    } else {
        BUSY_POLL
    };
    let rt = Runtime::builder().busy_poll(busy).build()?;
    let rx_depth = args.rx_depth.max(1);
    let dev = Device::with_cq_size(ctx, rx_depth + 64)?;
    let attr = UdAttr {
        port: args.ib_port,
        sq_psn: random_psn(),
        ..UdAttr::default()
    };
    let caps = |max_inline_data| QpCaps {
        max_send_wr: 64,
        max_recv_wr: rx_depth,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data,
    };
    // Inline sends of the whole payload if the device takes that much
    // inline data (devices refuse a QP asking for more than they have).
    let qp = match dev.create_ud_qp(caps(args.size as u32), &attr) {
        Ok(qp) => qp,
        Err(e) => {
            tracing::info!(error = %e, size = args.size, "no QP with that much inline data; sending from a registered buffer");
            dev.create_ud_qp(caps(0), &attr)?
        }
    };
    // Posted now: a datagram that finds no receive is dropped.
    let mut ring = qp.recv_ring(dev.pd(), rx_depth, args.size)?;
    let local = qp.ud_endpoint(gid_index.unwrap_or(sgid_index))?.endpoint;
    let ours = WireDest {
        lid: local.lid,
        qpn: local.qpn,
        psn: local.psn,
        gid: if gid_index.is_some() {
            local.gid
        } else {
            Gid([0; 16])
        },
    };
    println!(
        "  local address:  LID {:#06x}, QPN {:#08x}, PSN {:#08x}: GID {}",
        ours.lid,
        ours.qpn,
        ours.psn,
        Ipv6Addr::from(ours.gid.0)
    );
    let oob = Oob {
        server: args.server.as_deref(),
        port: args.port,
        timeout: Duration::from_secs(args.timeout),
    };
    let (theirs, their_soft) =
        exchange(&oob, &[ours], 1, local.addr.to_socket(), &mut |_, _| Ok(()))?;
    let theirs = theirs[0];
    println!(
        "  remote address: LID {:#06x}, QPN {:#08x}, PSN {:#08x}, GID {}",
        theirs.lid,
        theirs.qpn,
        theirs.psn,
        Ipv6Addr::from(theirs.gid.0)
    );
    let peer = qp.ud_peer(&UdEndpoint {
        endpoint: Endpoint {
            qpn: theirs.qpn,
            psn: theirs.psn,
            lid: theirs.lid,
            gid: theirs.gid,
            addr: their_soft.map_or(verbio::provider::ProviderAddr::NONE, Into::into),
            ..local
        },
        qkey: DEFAULT_QKEY,
    })?;
    let inline = qp.caps().max_inline_data as usize >= args.size;
    let buf = if inline {
        None
    } else {
        Some(MrPool::new(dev.pd()).alloc_from(&vec![0u8; args.size])?)
    };
    let mut sender = Sender {
        qp: qp.clone(),
        peer,
        buf,
    };
    let client = args.server.is_some();
    let size = args.size;
    let limit = Duration::from_secs(args.timeout);
    let progress = Cell::new(0);
    let run = ping_pong(args, client, &mut ring, &mut sender, &progress);
    let Run {
        elapsed,
        kind,
        mut rtts,
    } = match rt.block_on(timeout(limit, run)) {
        Ok(r) => r?,
        Err(_) => {
            return Err(format!(
                "timed out after {limit:?} in round trip {} (a datagram lost, or the peer gone)",
                progress.get()
            )
            .into())
        }
    };
    let secs = elapsed.as_secs_f64();
    let bytes = (size * args.iters * 2) as f64;
    println!(
        "{} bytes in {secs:.2} seconds = {:.2} Mbit/sec",
        bytes as u64,
        bytes * 8.0 / secs / 1e6
    );
    println!(
        "{} iters in {secs:.2} seconds = {:.2} usec/iter",
        args.iters,
        secs * 1e6 / args.iters as f64
    );
    if !rtts.is_empty() {
        // Half a round trip, as perftest's ib_send_lat reports latency.
        rtts.sort();
        let half_us = |d: Duration| d.as_secs_f64() * 1e6 / 2.0;
        let pct = |p: usize| half_us(rtts[(rtts.len() * p / 100).min(rtts.len() - 1)]);
        println!(
            "latency (half round trip, usec): typical {:.2} avg {:.2}",
            pct(50),
            secs * 1e6 / args.iters as f64 / 2.0
        );
        println!(
            "latency (half round trip, usec): min {:.2} p90 {:.2} p99 {:.2} max {:.2}",
            half_us(rtts[0]),
            pct(90),
            pct(99),
            half_us(rtts[rtts.len() - 1])
        );
    }
    println!(
        "ud_pingpong: {} round trips of {size} B{}{}{}",
        args.iters,
        if inline { " (inline)" } else { "" },
        if args.chk {
            ", senders and data checked"
        } else {
            ", lengths checked"
        },
        match kind {
            Some(ClientKind::Echo) => " (the client echoes)",
            _ => "",
        }
    );
    Ok(())
}

fn main() -> ExitCode {
    cli::init_tracing();
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => cli::fail("ud_pingpong", &*e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both sides verbio on software devices, in two threads.
    #[test]
    fn soft_devices_ping_pong_with_checks() {
        let port = cli::free_tcp_port();
        fn args(port: u16, server: Option<&str>) -> Args {
            let port = port.to_string();
            let mut a = vec!["ud_pingpong", "-d", "soft0", "-s", "512", "-n", "50"];
            a.extend(["-r", "8", "-c", "-p", &port, "--timeout", "20"]);
            a.extend(server);
            Args::parse_from(a)
        }
        let server = std::thread::spawn(move || run(&args(port, None)).map_err(|e| e.to_string()));
        let client = run(&args(port, Some("127.0.0.1"))).map_err(|e| e.to_string());
        let server = server.join().expect("server thread");
        assert_eq!((client, server), (Ok(()), Ok(())));
    }
}
