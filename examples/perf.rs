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
//!   perftest, both sides keep a RECV posted ahead and send INLINE without
//!   waiting for the send's completion (`Verbs::send_inline`: mostly
//!   unsignaled, one signaled in every few) when the message fits the QP's
//!   `max_inline_data`; `--signaled` runs the SENDs as ordinary ops instead
//!   (each waits for its own completion), for comparison.
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
use verbio::provider::{open_device, AccessFlags, Mtu, ProviderKind, QpCaps, RtsAttr};
use verbio::runtime::buf::{LocalBuf, MrPool, RemoteAccessRegion};
use verbio::runtime::{sleep, spawn, timeout, Device, QueuePair, Runtime, TcpStream};

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
}

const USAGE: &str = "usage: perf write_bw|send_lat [--server ADDR | --client ADDR] \
[--size BYTES] [--iters N] [--depth N] [--busy-poll MICROS | --events] [--signaled]";

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
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    if args.size == 0 || args.iters == 0 || args.depth == 0 {
        return Err("--size, --iters and --depth must be at least 1".into());
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
        if inline_sends(args, args.size, max_inline) {
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

/// The client's first message: magic, test, message size.
fn hello(test: Test, size: usize) -> [u8; HELLO] {
    let mut m = [0u8; HELLO];
    m[..4].copy_from_slice(b"PERF");
    m[4..8].copy_from_slice(&(test as u32).to_le_bytes());
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
    let size = match parse_hello(&m) {
        Some((t, size)) if t == args.test as u32 && size > 0 => size,
        _ => return Err(format!("bad hello from the client: {:?}", &m[..]).into()),
    };
    match args.test {
        Test::WriteBw => write_bw_server(size, dev, qp, pool).await,
        Test::SendLat => send_lat_server(args, size, qp, pool).await,
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

/// Echoes every message until an empty one; each RECV is re-posted before
/// the reply goes out.
async fn send_lat_server(args: &Args, size: usize, qp: &QueuePair, pool: &MrPool) -> Res<()> {
    let inline = inline_sends(args, size, qp.caps().max_inline_data as usize);
    let mut spare = pool.alloc(size)?;
    let mut next = qp.recv(pool.alloc(size)?);
    // The first ping finds its RECV posted: tell the client to start.
    qp.send(pool.alloc_from(b"ready")?).await.0?;
    loop {
        let (res, got) = next.await;
        if res?.len == 0 {
            return Ok(());
        }
        next = qp.recv(spare);
        if inline {
            // Copied at post time: `got` is free again at once.
            qp.send_inline(&got).await?;
            spare = got;
        } else {
            let (res, sent) = qp.send(got).await;
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
        let (qp, _stream) = timeout(LIMIT, dial(args, &dev, addr, busy))
            .await
            .map_err(|_| "connect timed out")??;
        // Bounded by the watchdog (see `main`), not by a reactor timer.
        let res = match args.test {
            Test::WriteBw => write_bw_client(args, &qp, &pool).await,
            Test::SendLat => send_lat_client(args, &qp, &pool).await,
        };
        let _ = timeout(Duration::from_secs(5), qp.close()).await;
        res
    })
}

/// Sends the hello and returns the server's answer (posted for first).
async fn greet(args: &Args, qp: &QueuePair, pool: &MrPool) -> Res<LocalBuf> {
    let answer = qp.recv(pool.alloc(64)?);
    qp.send(pool.alloc_from(&hello(args.test, args.size))?)
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

async fn send_lat_client(args: &Args, qp: &QueuePair, pool: &MrPool) -> Res<()> {
    if &greet(args, qp, pool).await?[..] != b"ready" {
        return Err("the server did not answer \"ready\"".into());
    }
    let payload: Vec<u8> = (0..args.size).map(|i| i as u8).collect();
    let mut msg = pool.alloc_from(&payload)?;
    let mut reply = pool.alloc(args.size)?;
    // One timestamp per iteration, as perftest: iteration i took
    // stamps[i + 1] - stamps[i]. Like perftest's `get_cycles`, a stamp is a
    // cycle counter read where there is one (the system clock costs a
    // syscall and µs per read in a VM with an emulated clocksource, which
    // would be counted in every round trip), converted with a rate measured
    // against the system clock over the whole loop.
    let mut stamps = Vec::with_capacity(args.iters + 1);
    let inline = inline_sends(args, args.size, qp.caps().max_inline_data as usize);
    let clock = CycleClock::start();
    if inline {
        // perftest's loop: the RECV for the next echo is always posted
        // ahead; the SEND is copied inline and not waited for.
        let mut next = qp.recv(reply);
        for i in 0..args.iters {
            stamps.push(clock.stamp());
            qp.send_inline(&payload)
                .await
                .map_err(|e| format!("send {i}: {e}"))?;
            let (rres, back) = next.await;
            let n = rres.map_err(|e| format!("recv {i}: {e}"))?.len;
            if n != args.size {
                return Err(format!("echo {i}: {n} bytes, expected {}", args.size).into());
            }
            next = qp.recv(back);
        }
        stamps.push(clock.stamp());
        // The last RECV stays posted; dropping it parks its buffer until the
        // close flushes it.
        drop(next);
    } else {
        for i in 0..args.iters {
            stamps.push(clock.stamp());
            // The RECV for the echo goes first, so it never finds the queue empty.
            let r = qp.recv(reply);
            let s = qp.send(msg);
            let ((sres, m), (rres, back)) = futures::join!(s, r);
            sres.map_err(|e| format!("send {i}: {e}"))?;
            let n = rres.map_err(|e| format!("recv {i}: {e}"))?.len;
            if n != args.size {
                return Err(format!("echo {i}: {n} bytes, expected {}", args.size).into());
            }
            msg = m;
            reply = back;
        }
        stamps.push(clock.stamp());
    }
    let us_per_tick = clock.us_per_tick();
    let mut half_rtts: Vec<f64> = stamps
        .windows(2)
        .map(|w| w[1].wrapping_sub(w[0]) as f64 * us_per_tick / 2.0)
        .collect();
    // An empty message ends the server's echo loop.
    qp.send(pool.alloc(0)?).await.0?;
    let s = LatStats::of(&mut half_rtts);
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

    /// Microseconds per tick, measured since `start` (call at the end).
    fn us_per_tick(&self) -> f64 {
        let us = self.start.elapsed().as_secs_f64() * 1e6;
        let ticks = Self::tick(self.start).wrapping_sub(self.start_tick).max(1);
        us / ticks as f64
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

impl LatStats {
    fn of(v: &mut [f64]) -> LatStats {
        v.sort_by(f64::total_cmp);
        let n = v.len().max(1) as f64;
        let avg = v.iter().sum::<f64>() / n;
        let var = v.iter().map(|x| (x - avg) * (x - avg)).sum::<f64>() / n;
        let at = |p: f64| {
            let i = ((v.len() as f64 * p).ceil() as usize).saturating_sub(1);
            v.get(i.min(v.len().saturating_sub(1)))
                .copied()
                .unwrap_or(0.0)
        };
        LatStats {
            min: v.first().copied().unwrap_or(0.0),
            max: v.last().copied().unwrap_or(0.0),
            typical: at(0.5),
            avg,
            stdev: var.sqrt(),
            p99: at(0.99),
            p999: at(0.999),
        }
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
