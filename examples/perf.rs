//! perf: perftest-style benchmarks of verbio's verbs through the runtime
//! (owned-buffer `Op` futures driven by the reactor, never raw post/poll),
//! to put next to perftest's `ib_write_bw` and `ib_send_lat` on one device.
//!
//! - `write_bw`: the client keeps `--depth` RDMA WRITEs of `--size` bytes in
//!   flight to one remote buffer, `--iters` in all, and reports the average
//!   bandwidth from the first post to the last completion (MB = 2^20 bytes,
//!   as perftest). The server grants the buffer and waits.
//! - `send_lat`: SEND ping-pong of `--size` bytes, `--iters` round trips; the
//!   latency of one iteration is half its round trip (as perftest), reported
//!   as min / max / typical (median) / average / stdev / 99% / 99.9%. Like
//!   perftest, both sides keep RECVs posted ahead (a `RecvRing` of
//!   `RING_DEPTH` buffers) and send INLINE without
//!   waiting for the send's completion (`Verbs::send_inline`: mostly
//!   unsignaled, one signaled in every few) when the message fits the QP's
//!   `max_inline_data`; `--signaled` runs the SENDs as ordinary ops instead
//!   (each waits for its own completion), for comparison. The figures are
//!   computed as perftest's `print_report_lat` does: one stamp per SEND
//!   posted, `iters - 1` deltas, sorted, the two largest dropped, typical =
//!   its median, average over the rest. Unlike perftest, which reposts a
//!   RECV before sending the next message, both sides repost a message's
//!   buffer after their next SEND is posted (reply first, then recycle:
//!   the ring's other buffers take what comes meanwhile), which keeps the
//!   repost off the round trip. In the rxe VM that order measured 3.5%
//!   faster than reposting first (1.08× vs 1.12× perftest, 24 rounds).
//! - `send_lat --raw`: the same ping-pong on the provider's QP and CQ
//!   directly (verbio's ibverbs layer, no runtime: post, then spin on
//!   `Cq::poll`), perftest's loop in Rust: what the runtime adds is the
//!   difference to the default mode, in one run.
//! - `PERF_SERVER_LOOP=raw|ops` (environment, send_lat server): the server
//!   runs that echo loop whatever the client runs (they are compatible), to
//!   tell which side a latency difference comes from.
//! - `send_lat --breakdown`: also prints the median time per iteration of
//!   each segment of the client's loop: posting the SEND (on rxe the doorbell
//!   `write` runs the whole exchange in the kernel), waiting for the echo
//!   (the peer's detection and turnaround plus this side's detection and
//!   wake-up), re-posting the RECV (in the default loop: nothing, as the
//!   previous echo's buffer is reposted in the first segment), and the rest
//!   up to the next stamp.
//!
//! Both run on whatever `open_device(None)` picks: `VERBIO_DEVICE` if set
//! (e.g. `rxe0`, built with `--features ibverbs`), else the first active
//! ibverbs device, else the software device `soft0`. On hardware, like
//! perftest, the reactor busy-polls the CQ (`--busy-poll MICROS`, default
//! 50 ms of spinning before each sleep); `--events` sleeps on the completion
//! channel instead (perftest `-e`), the default on the software device, whose
//! engine threads need the CPU a spinning reactor would take. The `write_bw`
//! server never spins (perftest's waits in a socket read).
//!
//! Both sides in one process (two threads, loopback):
//!
//! ```text
//! cargo run --release --example perf -- write_bw [--size 65536] [--iters 2000] [--depth 128]
//! cargo run --release --example perf -- send_lat [--size 64] [--iters 1000]
//! ```
//!
//! or as two processes (the client retries connecting for 10 s):
//!
//! ```text
//! cargo run --release --example perf -- write_bw --server 0.0.0.0:18516
//! cargo run --release --example perf -- write_bw --client 127.0.0.1:18516
//! ```
//!
//! On soft-RoCE in the rxe VM, side by side with perftest:
//! `scripts/rxe-test.sh --perftest` (builds this with `--features ibverbs`,
//! runs both with `VERBIO_DEVICE=rxe0` and prints the ratios).

use std::error::Error;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use std::pin::pin;

use futures::future::{select, Either};
use futures::io::AsyncReadExt;
use futures::stream::{FuturesUnordered, StreamExt};
use verbio::ops::connect::{connect, DeviceQps, HandshakeError, Listener, QpConfig};
use verbio::ops::verbs::{RemoteBuf, Verbs};
use verbio::provider::{
    open_device, AccessFlags, Completion, Mtu, ProviderKind, QpCaps, RecvWr, RtsAttr, SendFlags,
    SendOp, SendWr, SgList, Sge, WcStatus,
};
use verbio::runtime::buf::{LocalBuf, MrPool, RegisteredBuf, RemoteAccessRegion};
use verbio::runtime::{
    sleep, spawn, timeout, Device, QueuePair, RecvRing, RecvRingConfig, Runtime, TcpStream,
};

type Res<T> = Result<T, Box<dyn Error>>;

/// Bound of a whole run (the rxe VM is emulated and slow).
const LIMIT: Duration = Duration::from_secs(300);
/// Bound of one connect + handshake.
const HANDSHAKE: Duration = Duration::from_secs(10);
/// How long a client retries connecting to a server that is not up yet.
const CONNECT_RETRY: Duration = Duration::from_secs(10);
/// Default busy-poll time on hardware: longer than any gap between two
/// completions of a run (so the reactor spins throughout, like perftest),
/// short enough for the sockets of the setup (not polled while spinning).
const BUSY_POLL: Duration = Duration::from_millis(50);
/// Size of the region descriptor (addr, len, rkey).
const DESCRIPTOR: usize = 20;
/// Size of the client's hello (magic, test, message size).
const HELLO: usize = 16;
/// Fewest iterations (perftest's `MIN_ITER`): the statistics drop the two
/// largest of `iters - 1` samples.
const MIN_ITERS: usize = 5;

/// The hello's test field carries this bit for `send_lat --raw`.
const RAW_BIT: u32 = 1 << 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Test {
    WriteBw = 1,
    SendLat = 2,
}

impl Test {
    fn title(self) -> &'static str {
        match self {
            Test::WriteBw => "RDMA_Write BW Test (verbio)",
            Test::SendLat => "Send Latency Test (verbio)",
        }
    }
}

#[derive(Clone, Debug)]
struct Args {
    test: Test,
    server: Option<SocketAddr>,
    client: Option<SocketAddr>,
    size: usize,
    iters: usize,
    depth: u32,
    /// `None`: spin on hardware, sleep on the soft device.
    busy_poll: Option<Duration>,
    /// send_lat: SENDs as signaled ops (each awaits its completion) rather
    /// than inline sends that return once posted.
    signaled: bool,
    /// send_lat: the loop on the provider's QP and CQ, without the runtime.
    raw: bool,
    /// send_lat: also stamp after the SEND is posted, after the echo came
    /// and after the RECV is re-posted, and print each segment's median.
    breakdown: bool,
}

const USAGE: &str = "usage: perf write_bw|send_lat [--server ADDR | --client ADDR] \
[--size BYTES] [--iters N] [--depth N] [--busy-poll MICROS | --events] [--signaled | --raw] \
[--breakdown]";

fn parse_args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let test = match it.next().as_deref() {
        Some("write_bw") => Test::WriteBw,
        Some("send_lat") => Test::SendLat,
        Some("-h" | "--help") | None => return Err(USAGE.into()),
        Some(other) => return Err(format!("unknown test {other:?}\n{USAGE}")),
    };
    let (size, iters) = match test {
        Test::WriteBw => (65536, 2000),
        Test::SendLat => (64, 1000),
    };
    let mut args = Args {
        test,
        server: None,
        client: None,
        size,
        iters,
        depth: 128,
        busy_poll: None,
        signaled: false,
        raw: false,
        breakdown: false,
    };
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        let bad = |e: &dyn std::fmt::Display| format!("{flag}: {e}");
        match flag.as_str() {
            "--server" => args.server = Some(value()?.parse().map_err(|e| bad(&e))?),
            "--client" => args.client = Some(value()?.parse().map_err(|e| bad(&e))?),
            "--size" | "-s" => args.size = value()?.parse().map_err(|e| bad(&e))?,
            "--iters" | "-n" => args.iters = value()?.parse().map_err(|e| bad(&e))?,
            "--depth" | "-t" => args.depth = value()?.parse().map_err(|e| bad(&e))?,
            "--busy-poll" => {
                let us = value()?.parse().map_err(|e| bad(&e))?;
                args.busy_poll = Some(Duration::from_micros(us));
            }
            "--events" | "-e" => args.busy_poll = Some(Duration::ZERO),
            "--signaled" => args.signaled = true,
            "--raw" => args.raw = true,
            "--breakdown" => args.breakdown = true,
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    if args.size == 0 || args.depth == 0 {
        return Err("--size and --depth must be at least 1".into());
    }
    if args.iters < MIN_ITERS {
        return Err(format!(
            "--iters must be at least {MIN_ITERS} (as perftest)"
        ));
    }
    if args.raw && (args.test != Test::SendLat || args.signaled) {
        return Err("--raw is a send_lat mode (inline sends), not with --signaled".into());
    }
    if args.server.is_some() && args.client.is_some() {
        return Err("choose --server or --client, not both".into());
    }
    Ok(args)
}

/// The device `open_device(None)` picks, bound to a new runtime that spins
/// on the CQ before each sleep if `spin` (see the module docs). Returns the
/// busy-poll time used.
fn open(args: &Args, spin: bool) -> Res<(Runtime, Device, Duration)> {
    let ctx = open_device(None)?;
    let busy = match args.busy_poll {
        _ if !spin => Duration::ZERO,
        Some(d) => d,
        None if ctx.kind() == ProviderKind::Soft => Duration::ZERO,
        None => BUSY_POLL,
    };
    let rt = Runtime::builder().busy_poll(busy).build()?;
    let dev = Device::open(ctx)?;
    Ok((rt, dev, busy))
}

fn qp_config(args: &Args) -> QpConfig {
    let default = QpConfig::default();
    QpConfig {
        caps: QpCaps {
            max_send_wr: args.depth.max(16),
            max_recv_wr: 16,
            ..QpCaps::default()
        },
        // ≈ 1 s per transport retry: the emulated rxe VM on a loaded host can
        // leave a responder unscheduled for longer than the default 67 ms × 6.
        rts: RtsAttr {
            timeout: 18,
            ..default.rts
        },
        ..default
    }
}

fn banner(args: &Args, dev: &Device, mtu: Mtu, busy: Duration) {
    let line = "-".repeat(87);
    println!("{line}");
    println!("                    {}", args.test.title());
    println!(
        " Device         : {} ({})",
        dev.context().name(),
        dev.context().kind()
    );
    println!(" Number of qps  : 1\t\tConnection type : RC");
    if args.test == Test::WriteBw {
        println!(" TX depth       : {}", args.depth);
    }
    if args.test == Test::SendLat {
        let max_inline = qp_config(args).caps.max_inline_data as usize;
        if args.raw {
            println!(" Sends          : raw provider loop, no runtime (inline if it fits, 1 in {RAW_SIGNAL_EVERY} signaled)");
        } else if inline_sends(args, args.size, max_inline) {
            println!(" Sends          : inline, returning once posted (mostly unsignaled)");
        } else {
            println!(" Sends          : ops awaiting their own (signaled) completion");
        }
    }
    println!(" Mtu            : {}[B]", mtu.bytes());
    if busy.is_zero() {
        println!(" Completions    : events (sleeps on the completion channel)");
    } else {
        println!(" Completions    : busy poll ({busy:?} before sleeping)");
    }
    println!("{line}");
}

// ------------------------------------------------------------------ server

fn server(
    args: &Args,
    addr: SocketAddr,
    ready: Option<std::sync::mpsc::Sender<SocketAddr>>,
) -> Res<()> {
    // write_bw's server only waits: it must not take a CPU from the client.
    let (rt, dev, _) = open(args, args.test == Test::SendLat)?;
    let listener = Listener::bind(
        addr,
        DeviceQps::new(dev.clone(), qp_config(args)),
        HANDSHAKE,
    )?;
    let local = listener.local_addr()?;
    match ready {
        Some(tx) => tx.send(local)?,
        None => println!("perf {:?} server listening on {local}", args.test),
    }
    let pool = MrPool::new(dev.pd());
    rt.block_on(async {
        let conn = timeout(LIMIT, listener.accept())
            .await
            .map_err(|_| "no client came")??;
        let (qp, mut stream) = (conn.qp, conn.stream);
        // The handshake's TCP connection stays open while the client runs:
        // its end (the client exited or failed) ends the server too. It is
        // watched by a task of its own, polled only when the socket wakes it:
        // next to the test's future in one `select`, it would be polled (a
        // read syscall) at every completion of the test's ops.
        let work = pin!(serve(args, &dev, &qp, &pool));
        let gone = spawn(async move {
            let mut byte = [0u8; 1];
            let _ = stream.read(&mut byte).await;
        });
        // Bounded by the watchdog (see `main`), not by a reactor timer.
        let res = match select(work, gone).await {
            Either::Left((res, _)) => res,
            Either::Right(_) => Err("the client went away".into()),
        };
        let _ = timeout(Duration::from_secs(5), qp.close()).await;
        res
    })
}

/// The client's first message: magic, test (with [`RAW_BIT`]), message size.
fn hello(test: Test, raw: bool, size: usize) -> [u8; HELLO] {
    let mut m = [0u8; HELLO];
    m[..4].copy_from_slice(b"PERF");
    let t = test as u32 | if raw { RAW_BIT } else { 0 };
    m[4..8].copy_from_slice(&t.to_le_bytes());
    m[8..].copy_from_slice(&(size as u64).to_le_bytes());
    m
}

/// Decodes [`hello`]; `None` for anything else.
fn parse_hello(m: &[u8]) -> Option<(u32, usize)> {
    if m.len() != HELLO || &m[..4] != b"PERF" {
        return None;
    }
    let test = u32::from_le_bytes(m[4..8].try_into().ok()?);
    let size = u64::from_le_bytes(m[8..].try_into().ok()?);
    Some((test, usize::try_from(size).ok()?))
}

/// Serves one client: reads its hello, then runs the server half of the test.
async fn serve(args: &Args, dev: &Device, qp: &QueuePair, pool: &MrPool) -> Res<()> {
    let (res, m) = qp.recv(pool.alloc(64)?).await;
    res?;
    let (size, raw) = match parse_hello(&m) {
        Some((t, size)) if t & !RAW_BIT == args.test as u32 && size > 0 => (size, t & RAW_BIT != 0),
        _ => return Err(format!("bad hello from the client: {:?}", &m[..]).into()),
    };
    // `PERF_SERVER_LOOP=raw|ops` overrides the client's choice of send_lat
    // server loop (both echo the same way): to see which side's loop a
    // latency difference comes from.
    let raw = match std::env::var("PERF_SERVER_LOOP").as_deref() {
        Ok("raw") => true,
        Ok("ops") => false,
        _ => raw,
    };
    match args.test {
        Test::WriteBw => write_bw_server(size, dev, qp, pool).await,
        Test::SendLat if raw => raw_server(size, dev, qp, pool).await,
        Test::SendLat => send_lat_server(args, size, dev, qp, pool).await,
    }
}

/// Grants one buffer of `size` bytes for the client's WRITEs, sends its
/// descriptor and waits for the client's "done".
async fn write_bw_server(size: usize, dev: &Device, qp: &QueuePair, pool: &MrPool) -> Res<()> {
    let region = RemoteAccessRegion::grant(dev.pd(), vec![0u8; size], AccessFlags::REMOTE_WRITE)
        .map_err(|r| r.error)?;
    let done = qp.recv(pool.alloc(64)?);
    let r = RemoteBuf::from(&region);
    let mut msg = Vec::with_capacity(DESCRIPTOR);
    msg.extend_from_slice(&r.addr().to_le_bytes());
    msg.extend_from_slice(&r.len().to_le_bytes());
    msg.extend_from_slice(&r.rkey().to_le_bytes());
    qp.send(pool.alloc_from(&msg)?).await.0?;
    let (res, b) = done.await;
    res?;
    if &b[..] != b"done" {
        return Err(format!("expected \"done\", got {:?}", &b[..]).into());
    }
    Ok(())
}

/// True if send_lat's SENDs of `size` bytes go as inline sends that return
/// once posted (else as ops awaiting their completion).
fn inline_sends(args: &Args, size: usize, max_inline: usize) -> bool {
    !args.signaled && size <= max_inline
}

/// send_lat's receive ring: buffers posted ahead on each side.
const RING_DEPTH: u32 = 8;

/// The receive ring of send_lat's `size`-byte messages on `qp`.
fn lat_ring(dev: &Device, qp: &QueuePair, size: usize) -> Res<RecvRing> {
    let depth = RING_DEPTH.min(qp.caps().max_recv_wr);
    Ok(RecvRing::new(
        qp,
        dev.pd(),
        RecvRingConfig::new(depth, size.max(1)),
    )?)
}

/// Echoes every message until an empty one. The receives come from a ring
/// posted ahead; each buffer is reposted once its echo is posted (inline:
/// copied at post time) or copied out (signaled sends).
async fn send_lat_server(
    args: &Args,
    size: usize,
    dev: &Device,
    qp: &QueuePair,
    pool: &MrPool,
) -> Res<()> {
    let inline = inline_sends(args, size, qp.caps().max_inline_data as usize);
    let mut spare = pool.alloc(size)?;
    let mut ring = lat_ring(dev, qp, size)?;
    // The first ping finds the ring posted: tell the client to start.
    qp.send(pool.alloc_from(b"ready")?).await.0?;
    loop {
        let got = ring.next().await.ok_or("the receive ring ended")??;
        if got.is_empty() {
            return Ok(());
        }
        if inline {
            qp.send_inline(&got).await?;
            drop(got);
        } else {
            spare.clear();
            spare.extend_from_slice(&got)?;
            drop(got);
            let (res, sent) = qp.send(spare).await;
            res?;
            spare = sent;
        }
    }
}

// ------------------------------------------------------------------ client

/// Connects, retrying while nobody listens yet (two-process runs). The TCP
/// stream is kept open until the end: the server watches it.
async fn dial(
    args: &Args,
    dev: &Device,
    addr: SocketAddr,
    busy: Duration,
) -> Res<(QueuePair, TcpStream)> {
    let qps = DeviceQps::new(dev.clone(), qp_config(args));
    let deadline = Instant::now() + CONNECT_RETRY;
    loop {
        match connect(addr, &qps, HANDSHAKE).await {
            Ok(c) => {
                banner(args, dev, c.local.mtu.min(c.remote.mtu), busy);
                return Ok((c.qp, c.stream));
            }
            Err(HandshakeError::Io { .. }) if Instant::now() < deadline => {
                sleep(Duration::from_millis(50)).await
            }
            Err(e) => return Err(e.into()),
        }
    }
}

fn client(args: &Args, addr: SocketAddr) -> Res<()> {
    let (rt, dev, busy) = open(args, true)?;
    let pool = MrPool::new(dev.pd());
    rt.block_on(async {
        let (qp, mut stream) = timeout(LIMIT, dial(args, &dev, addr, busy))
            .await
            .map_err(|_| "connect timed out")??;
        // Bounded by the watchdog (see `main`), not by a reactor timer.
        let res = match args.test {
            Test::WriteBw => write_bw_client(args, &qp, &pool).await,
            Test::SendLat if args.raw => raw_client(args, &dev, &qp, &pool).await,
            Test::SendLat => send_lat_client(args, &dev, &qp, &pool).await,
        };
        if res.is_ok() {
            // The server's last WRs (the raw loop's retiring WRITE) need
            // this QP alive to be acknowledged: close it only once the
            // server is done (it closes the TCP connection when it ends).
            let mut byte = [0u8; 1];
            let _ = timeout(Duration::from_secs(10), stream.read(&mut byte)).await;
        }
        let _ = timeout(Duration::from_secs(5), qp.close()).await;
        res
    })
}

/// Sends the hello and returns the server's answer (posted for first).
async fn greet(args: &Args, qp: &QueuePair, pool: &MrPool) -> Res<LocalBuf> {
    let answer = qp.recv(pool.alloc(64)?);
    qp.send(pool.alloc_from(&hello(args.test, args.raw, args.size))?)
        .await
        .0?;
    let (res, b) = answer.await;
    res?;
    Ok(b)
}

async fn write_bw_client(args: &Args, qp: &QueuePair, pool: &MrPool) -> Res<()> {
    let b = greet(args, qp, pool).await?;
    if b.len() != DESCRIPTOR {
        return Err("bad region descriptor".into());
    }
    let u = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or_default());
    let rkey = u32::from_le_bytes(b[16..20].try_into().unwrap_or_default());
    let remote = RemoteBuf::new(u(0), u(8), rkey).at(0, args.size as u64)?;

    // `depth` buffers, registered before the clock starts, each reused by the
    // next WRITE as soon as its previous one completed.
    let payload: Vec<u8> = (0..args.size).map(|i| i as u8).collect();
    let slots = (args.depth as usize).min(args.iters);
    let mut bufs = Vec::with_capacity(slots);
    for _ in 0..slots {
        bufs.push(pool.alloc_from(&payload)?);
    }
    let mut in_flight = FuturesUnordered::new();
    let start = Instant::now();
    let mut posted = 0;
    for b in bufs {
        in_flight.push(qp.write(b, remote));
        posted += 1;
    }
    let mut done = 0;
    while let Some((res, b)) = in_flight.next().await {
        res.map_err(|e| format!("write {done}: {e}"))?;
        done += 1;
        if posted < args.iters {
            in_flight.push(qp.write(b, remote));
            posted += 1;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let (res, _) = qp.send(pool.alloc_from(b"done")?).await;
    res?;
    let bytes = args.size as f64 * args.iters as f64;
    println!(" #bytes     #iterations    BW average[MB/sec]   MsgRate[Mpps]");
    println!(
        " {:<10} {:<14} {:<20.2} {:.6}",
        args.size,
        args.iters,
        bytes / secs / (1u64 << 20) as f64,
        args.iters as f64 / secs / 1e6
    );
    println!("{}", "-".repeat(87));
    Ok(())
}

async fn send_lat_client(args: &Args, dev: &Device, qp: &QueuePair, pool: &MrPool) -> Res<()> {
    if &greet(args, qp, pool).await?[..] != b"ready" {
        return Err("the server did not answer \"ready\"".into());
    }
    let payload: Vec<u8> = (0..args.size).map(|i| i as u8).collect();
    let mut msg = pool.alloc_from(&payload)?;
    // Posted before the first ping goes out.
    let mut ring = lat_ring(dev, qp, args.size)?;
    // One timestamp per SEND posted, as perftest's `tposted`: iteration i
    // took stamps[i + 1] - stamps[i]. Like perftest's `get_cycles`, a stamp
    // is a cycle counter read where there is one (the system clock costs a
    // syscall and µs per read in a VM with an emulated clocksource, which
    // would be counted in every round trip), converted with a rate measured
    // against the system clock over the whole loop.
    let mut stamps = Vec::with_capacity(args.iters);
    let mut parts = Breakdown::new(args);
    let inline = inline_sends(args, args.size, qp.caps().max_inline_data as usize);
    let clock = CycleClock::start();
    if inline {
        // perftest's loop: RECVs for the next echoes are always posted
        // ahead; the SEND is copied inline and not waited for. Each echo's
        // buffer is reposted once the next ping is out (as the server
        // does: reply first, then recycle), which keeps the repost off
        // the round trip; the ring's other buffers take the next echo.
        let mut last_echo = None;
        for i in 0..args.iters {
            stamps.push(clock.stamp());
            qp.send_inline(&payload)
                .await
                .map_err(|e| format!("send {i}: {e}"))?;
            // Reposts the previous echo's buffer.
            drop(last_echo.take());
            parts.mark(0, &clock);
            let back = ring
                .next()
                .await
                .ok_or("the receive ring ended")?
                .map_err(|e| format!("recv {i}: {e}"))?;
            parts.mark(1, &clock);
            if back.len() != args.size {
                return Err(
                    format!("echo {i}: {} bytes, expected {}", back.len(), args.size).into(),
                );
            }
            last_echo = Some(back);
            parts.mark(2, &clock);
        }
    } else {
        for i in 0..args.iters {
            stamps.push(clock.stamp());
            let s = qp.send(msg);
            let r = ring.next();
            let ((sres, m), back) = futures::join!(s, r);
            sres.map_err(|e| format!("send {i}: {e}"))?;
            let back = back
                .ok_or("the receive ring ended")?
                .map_err(|e| format!("recv {i}: {e}"))?;
            if back.len() != args.size {
                return Err(
                    format!("echo {i}: {} bytes, expected {}", back.len(), args.size).into(),
                );
            }
            msg = m;
        }
    }
    // The ring's buffers stay posted; the close flushes them before their
    // memory is freed.
    drop(ring);
    let ticks_per_us = clock.ticks_per_us();
    // An empty message ends the server's echo loop.
    qp.send(pool.alloc(0)?).await.0?;
    parts.report(&stamps, ticks_per_us);
    report_lat(args, &stamps, ticks_per_us)
}

/// `--breakdown`: per iteration, the stamps after the SEND was posted, after
/// the echo came and after the RECV was re-posted; printed as the median of
/// each segment (the last one runs to the next iteration's stamp).
struct Breakdown {
    on: bool,
    marks: Vec<[u64; 3]>,
    cur: [u64; 3],
}

impl Breakdown {
    fn new(args: &Args) -> Breakdown {
        let on = args.breakdown;
        Breakdown {
            on,
            marks: Vec::with_capacity(if on { args.iters } else { 0 }),
            cur: [0; 3],
        }
    }

    #[inline]
    fn mark(&mut self, i: usize, clock: &CycleClock) {
        if self.on {
            self.cur[i] = clock.stamp();
            if i == 2 {
                self.marks.push(self.cur);
            }
        }
    }

    fn report(&self, stamps: &[u64], ticks_per_us: f64) {
        if !self.on || self.marks.len() < 2 {
            return;
        }
        let median_us = |mut v: Vec<u64>| {
            v.sort_unstable();
            v[v.len() / 2] as f64 / ticks_per_us
        };
        let seg = |f: &dyn Fn(usize) -> u64| median_us((0..self.marks.len() - 1).map(f).collect());
        let m = &self.marks;
        println!(
            " breakdown (median us per iteration): post SEND {:.2} | wait for the echo {:.2} | \
             re-post RECV {:.2} | to the next stamp {:.2}",
            seg(&|i| m[i][0].wrapping_sub(stamps[i])),
            seg(&|i| m[i][1].wrapping_sub(m[i][0])),
            seg(&|i| m[i][2].wrapping_sub(m[i][1])),
            seg(&|i| stamps[i + 1].wrapping_sub(m[i][2])),
        );
    }
}

/// Prints perftest's latency line for per-SEND stamps.
fn report_lat(args: &Args, stamps: &[u64], ticks_per_us: f64) -> Res<()> {
    let s = LatStats::of(stamps, ticks_per_us).ok_or("too few iterations for statistics")?;
    println!(
        " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    \
         t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] "
    );
    println!(
        " {:<7} {:<10} {:>10.2} {:>14.2} {:>14.2} {:>16.2} {:>14.2} {:>16.2} {:>22.2}",
        args.size, args.iters, s.min, s.max, s.typical, s.avg, s.stdev, s.p99, s.p999
    );
    println!("{}", "-".repeat(87));
    Ok(())
}

// --------------------------------------------------------------- raw loop

/// `--raw`: one SEND in this many is signaled (its completion frees the send
/// queue slots of the unsignaled ones before it).
const RAW_SIGNAL_EVERY: u64 = 32;
/// wr_ids of the raw loop's WRs. The loop polls every completion of its
/// WRs itself before the runtime runs again; should one reach the reactor
/// anyway, the top bit (the runtime's untracked range) makes it ignore it.
const RAW_RECV: u64 = 1 << 63 | 1;
const RAW_SEND: u64 = 1 << 63 | 2;
/// The last WR of a raw loop: all earlier ones are done once it completes.
const RAW_LAST: u64 = 1 << 63 | 3;

/// perftest's latency loop on the provider's QP and CQ: no ops, no reactor.
/// The runtime is idle meanwhile (the caller blocks its thread), and nothing
/// of the runtime's is outstanding on the QP.
struct RawLoop<'a> {
    qp: &'a verbio::provider::Qp,
    cq: &'a verbio::provider::Cq,
    recv: RecvWr,
    send: SendWr,
    inline: bool,
    sent: u64,
    wcs: [Completion; 8],
    last_done: bool,
}

impl<'a> RawLoop<'a> {
    /// `recv` receives, `send` is what goes out (both registered by the
    /// caller, alive and untouched through Rust references while the loop
    /// runs).
    fn new(qp: &'a QueuePair, dev: &'a Device, recv: &LocalBuf, send: Sge) -> Res<RawLoop<'a>> {
        let prov = qp.provider().ok_or("the QP has no provider QP")?;
        let mut sg = SgList::new();
        sg.push(recv.sge_total()?);
        let mut ssg = SgList::new();
        ssg.push(send);
        Ok(RawLoop {
            qp: prov,
            cq: dev.cq(),
            recv: RecvWr {
                wr_id: RAW_RECV,
                sg_list: sg,
            },
            send: SendWr {
                wr_id: RAW_SEND,
                sg_list: ssg,
                op: SendOp::Send,
                flags: SendFlags::NONE,
            },
            inline: send.length <= qp.caps().max_inline_data,
            sent: 0,
            wcs: [Completion::EMPTY; 8],
            last_done: false,
        })
    }

    fn post_recv(&self) -> Res<()> {
        // SAFETY: the SGE names the caller's registered buffer, which stays
        // allocated and unreferenced until the loop has polled the RECV's
        // completion (every RECV posted is consumed by a SEND before the
        // loop ends).
        unsafe { self.qp.post_recv(std::slice::from_ref(&self.recv)) }
            .map_err(|e| format!("raw post_recv: {e}").into())
    }

    /// Posts the SEND (of `len` bytes); `last` signals it as [`RAW_LAST`].
    fn post_send(&mut self, len: u32, last: bool) -> Res<()> {
        self.sent += 1;
        let signaled = last || self.sent % RAW_SIGNAL_EVERY == 0;
        let mut flags = if self.inline {
            SendFlags::INLINE
        } else {
            SendFlags::NONE
        };
        if signaled {
            flags |= SendFlags::SIGNALED;
        }
        self.send.flags = flags;
        self.send.wr_id = if last { RAW_LAST } else { RAW_SEND };
        self.send.sg_list[0].length = len;
        // SAFETY: the SGE names registered memory of the caller's that stays
        // allocated and is only read meanwhile (inline: copied at post time);
        // the send is waited for (a later signaled WR, or `RAW_LAST`) before
        // the loop ends.
        unsafe { self.qp.post_send(std::slice::from_ref(&self.send)) }
            .map_err(|e| format!("raw post_send: {e}").into())
    }

    /// Posts one signaled SEND of `sge` (not inline), outside the loop's
    /// count; its completion is polled (and ignored) by the loop.
    fn post_one(&self, sge: Sge) -> Res<()> {
        let mut sg_list = SgList::new();
        sg_list.push(sge);
        let wr = SendWr {
            wr_id: RAW_SEND,
            sg_list,
            op: SendOp::Send,
            flags: SendFlags::SIGNALED,
        };
        // SAFETY: the SGE names registered memory of the caller's, kept
        // alive and unwritten until the loop ended (its last WR completed,
        // so this one did).
        unsafe { self.qp.post_send(std::slice::from_ref(&wr)) }
            .map_err(|e| format!("raw post_send: {e}").into())
    }

    /// Spins on the CQ until the RECV completes; returns its byte count.
    fn wait_recv(&mut self) -> Res<u32> {
        let mut got = None;
        while got.is_none() {
            got = self.poll()?;
        }
        Ok(got.unwrap_or(0))
    }

    /// Spins until the [`RAW_LAST`] send completed.
    fn wait_last(&mut self) -> Res<()> {
        while !self.last_done {
            if self.poll()?.is_some() {
                return Err("raw loop: unexpected message".into());
            }
        }
        Ok(())
    }

    /// One poll of the CQ: the byte count of a RECV completion if one came.
    #[inline]
    fn poll(&mut self) -> Res<Option<u32>> {
        let n = self.cq.poll(&mut self.wcs)?;
        let mut got = None;
        for c in &self.wcs[..n] {
            if c.status != WcStatus::Success {
                return Err(format!("raw loop: wr_id {} failed: {}", c.wr_id, c.status).into());
            }
            match c.wr_id {
                RAW_RECV => got = Some(c.byte_len),
                RAW_LAST => self.last_done = true,
                _ => {}
            }
        }
        Ok(got)
    }

    /// The server's end: a signaled zero-length RDMA WRITE (rkey 0, no
    /// memory touched) as the last WR, so that once it completed every send
    /// before it did, and the runtime finds the send queue and the CQ
    /// empty of the loop's WRs.
    fn retire(&mut self) -> Res<()> {
        let wr = SendWr {
            wr_id: RAW_LAST,
            sg_list: SgList::new(),
            op: SendOp::Write {
                remote_addr: 0,
                rkey: 0,
            },
            flags: SendFlags::SIGNALED,
        };
        // SAFETY: no SGE: the WR names no local memory.
        unsafe { self.qp.post_send(std::slice::from_ref(&wr)) }
            .map_err(|e| format!("raw retire: {e}"))?;
        self.wait_last()
    }
}

/// `send_lat --raw`, client: perftest's loop on the provider directly.
async fn raw_client(args: &Args, dev: &Device, qp: &QueuePair, pool: &MrPool) -> Res<()> {
    if &greet(args, qp, pool).await?[..] != b"ready" {
        return Err("the server did not answer \"ready\"".into());
    }
    let payload: Vec<u8> = (0..args.size).map(|i| i as u8).collect();
    let msg = pool.alloc_from(&payload)?;
    let reply = pool.alloc(args.size)?;
    let len = u32::try_from(args.size)?;
    let mut raw = RawLoop::new(qp, dev, &reply, msg.sge_init()?)?;
    let mut stamps = Vec::with_capacity(args.iters);
    let mut parts = Breakdown::new(args);
    let clock = CycleClock::start();
    raw.post_recv()?;
    for i in 0..args.iters {
        stamps.push(clock.stamp());
        raw.post_send(len, false)?;
        parts.mark(0, &clock);
        let n = raw.wait_recv()?;
        parts.mark(1, &clock);
        if n != len {
            return Err(format!("echo {i}: {n} bytes, expected {len}").into());
        }
        if i + 1 < args.iters {
            raw.post_recv()?;
        }
        parts.mark(2, &clock);
    }
    let ticks_per_us = clock.ticks_per_us();
    parts.report(&stamps, ticks_per_us);
    // An empty message ends the server's loop; once it completed, so did
    // every send before it.
    raw.post_send(0, true)?;
    raw.wait_last()?;
    drop((msg, reply));
    report_lat(args, &stamps, ticks_per_us)
}

/// `send_lat --raw`, server: echoes every message until an empty one, the
/// RECV re-posted before the reply goes out.
async fn raw_server(size: usize, dev: &Device, qp: &QueuePair, pool: &MrPool) -> Res<()> {
    let buf = pool.alloc(size)?;
    let len = u32::try_from(size)?;
    // The echo is sent from the receive buffer: inline, it is copied at post
    // time; otherwise the next message cannot land before the echo left,
    // since the client waits for the echo before sending it.
    let mut raw = RawLoop::new(qp, dev, &buf, buf.sge_total()?)?;
    // "ready" goes out raw too: from here on the runtime must not poll the
    // CQ, which may hold the loop's completions.
    let ready = pool.alloc_from(b"ready")?;
    raw.post_recv()?;
    raw.post_one(ready.sge_init()?)?;
    loop {
        let n = raw.wait_recv()?;
        if n == 0 {
            break;
        }
        raw.post_recv()?;
        raw.post_send(len, false)?;
    }
    // Once the retiring WRITE completed, so did "ready" and every echo.
    raw.retire()?;
    drop((buf, ready));
    Ok(())
}

/// Timestamps for the latency loop: the CPU's time-stamp counter on x86-64
/// (perftest's `get_cycles`), else the system clock in nanoseconds.
struct CycleClock {
    start: Instant,
    start_tick: u64,
}

impl CycleClock {
    fn start() -> CycleClock {
        let start = Instant::now();
        CycleClock {
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
    fn tick(base: Instant) -> u64 {
        base.elapsed().as_nanos() as u64
    }

    fn stamp(&self) -> u64 {
        Self::tick(self.start)
    }

    /// Ticks per microsecond (perftest's `get_cpu_mhz` for the TSC),
    /// measured since `start` (call at the end).
    fn ticks_per_us(&self) -> f64 {
        let us = (self.start.elapsed().as_secs_f64() * 1e6).max(f64::MIN_POSITIVE);
        let ticks = Self::tick(self.start).wrapping_sub(self.start_tick).max(1);
        ticks as f64 / us
    }
}

/// perftest's latency figures, in microseconds.
struct LatStats {
    min: f64,
    max: f64,
    typical: f64,
    avg: f64,
    stdev: f64,
    p99: f64,
    p999: f64,
}

/// Samples perftest drops from the top before its statistics
/// (`LAT_MEASURE_TAIL`).
const LAT_MEASURE_TAIL: usize = 2;

impl LatStats {
    /// perftest's `print_report_lat` for a SEND ping-pong (`rtt_factor` 2),
    /// step by step: the `n - 1` deltas of the `n` per-post stamps, sorted;
    /// the [`LAT_MEASURE_TAIL`] largest dropped, leaving `m`; typical = the
    /// median of those `m` in whole ticks (the mean of the middle two,
    /// truncated, when `m` is even); average and stdev over the `m` (stdev
    /// with perftest's truncations to `int`); max = the first dropped
    /// sample; 99% / 99.9% = the samples at `ceil(m * p)`. `None` with
    /// fewer than 5 stamps.
    fn of(stamps: &[u64], ticks_per_us: f64) -> Option<LatStats> {
        let mut delta: Vec<u64> = stamps.windows(2).map(|w| w[1].wrapping_sub(w[0])).collect();
        if delta.len() <= LAT_MEASURE_TAIL + 1 {
            return None;
        }
        delta.sort_unstable();
        let m = delta.len() - LAT_MEASURE_TAIL;
        let median = if (m - 1) % 2 != 0 {
            (delta[m / 2] + delta[m / 2 - 1]) / 2
        } else {
            delta[m / 2]
        };
        let q = ticks_per_us * 2.0;
        let avg = delta[..m].iter().map(|&d| d as f64 / q).sum::<f64>() / m as f64;
        let var_sum: f64 = delta[..m]
            .iter()
            .map(|&d| {
                let t = (avg - d as f64 / q) as i32;
                f64::from(t).powi(2) as i32 as f64
            })
            .sum();
        let at = |p: f64| delta[((m as f64 * p).ceil() as usize).min(delta.len() - 1)] as f64 / q;
        Some(LatStats {
            min: delta[0] as f64 / q,
            max: delta[m] as f64 / q,
            typical: median as f64 / q,
            avg,
            stdev: (var_sum / m as f64).sqrt(),
            p99: at(0.99),
            p999: at(0.999),
        })
    }
}

// -------------------------------------------------------------------- main

fn both(args: &Args) -> Res<()> {
    let (tx, rx) = std::sync::mpsc::channel();
    let srv_args = args.clone();
    let srv = std::thread::spawn(move || {
        server(&srv_args, "127.0.0.1:0".parse().expect("valid"), Some(tx))
            .map_err(|e| e.to_string())
    });
    let res = match rx.recv_timeout(HANDSHAKE) {
        Ok(addr) => client(args, addr),
        Err(_) => Err("server did not start".into()),
    };
    match srv.join() {
        Ok(Ok(())) => res,
        Ok(Err(e)) => Err(format!("server: {e}").into()),
        Err(_) => Err("server thread panicked".into()),
    }
}

/// Ends the process if the run takes longer than [`LIMIT`]. The measured
/// loops are not wrapped in the reactor's `timeout`: its timer reads the
/// clock at every poll, which costs microseconds where the clocksource is
/// emulated (HPET in the rxe VM).
fn watchdog() {
    std::thread::spawn(|| {
        std::thread::sleep(LIMIT);
        eprintln!("perf: did not finish within {LIMIT:?}");
        std::process::exit(1);
    });
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    watchdog();
    let res = match (args.server, args.client) {
        (Some(addr), _) => server(&args, addr, None),
        (None, Some(addr)) => client(&args, addr),
        (None, None) => both(&args),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("perf: {e}");
            ExitCode::FAILURE
        }
    }
}
