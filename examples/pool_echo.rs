//! An echo through [`RdmaHandle`] from tasks of tokio's multi-thread
//! runtime, next to the same work on the connection's own runtime thread
//! (a local [`Rdma`]), side by side in one process.
//!
//! One server thread (a verbio runtime, a soft device) echoes every
//! message. The *local* client is a verbio runtime thread with its own
//! soft device: `--window` local tasks each loop send, receive. The
//! *handle* client is a [`Pool`] of one runtime thread with its own soft
//! device, driven by `--window` tokio tasks (`--workers` worker threads)
//! looping the same calls on a shared [`RdmaHandle`]. Each point (message
//! size, window) runs both clients for `--secs` (their order alternates);
//! printed: messages per second of each and their ratio handle / local,
//! the median round trip (window 1), and the process CPU time per message
//! of each (server and devices included, the same work in both, so their
//! difference is what the handle path adds), and the sleeps per message
//! of each (`zz`: the process's voluntary context switches, a thread
//! going to sleep in epoll or on a futex, to be woken again; the handle
//! path's added cost is mostly these, see docs/tokio.md).
//!
//! ```text
//! cargo run --release --example pool_echo
//! cargo run --release --example pool_echo -- --sizes 64 --windows 1,32 --secs 2
//! ```
//!
//! `--serve ADDR` runs only the echo server (for the two clients of one
//! run), and `--server ADDR` runs the clients against such a server in
//! another process (start both with the same `--sizes`).

mod cli;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::ExitCode;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use verbio::provider::{Context, SoftConfig};
use verbio::runtime::{spawn, Device, Placement, Pool, Runtime};
use verbio::{Rdma, RdmaBuilder, RdmaHandle};

/// RdmaHandle from tokio multi-thread tasks vs a local Rdma, echo.
#[derive(Parser, Debug, Clone)]
struct Args {
    /// Message sizes in bytes (default: 64 B to 16 MiB in powers of 4).
    #[arg(long, value_delimiter = ',', default_values_t = default_sizes())]
    sizes: Vec<usize>,
    /// Messages in flight (tasks each looping one send and one receive);
    /// capped so that at most 64 MiB are in flight.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1, 32])]
    windows: Vec<usize>,
    /// Seconds per client per point.
    #[arg(long, default_value_t = 0.5)]
    secs: f64,
    /// tokio worker threads.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Busy-poll time of the pool's runtime thread, in µs (0: it sleeps
    /// in epoll at once when idle, and a request wakes it through its
    /// eventfd).
    #[arg(long, default_value_t = 0)]
    pool_busy_poll_us: u64,
    /// How long a handle's reply future spins on its reply slot before its
    /// tokio worker parks, in µs (`Pool::builder().reply_spin`; 0: no
    /// spin).
    #[arg(long, default_value_t = 0)]
    reply_spin_us: u64,
    /// Answers to tokio tasks through the tokio runtime's relay (`on`, the
    /// default with verbio's `tokio` feature: tokio's reactor wakes the
    /// task, on the worker that polls it) or woken from the pool thread
    /// directly (`off`); see `verbio::runtime::pool::relay`.
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    relay: String,
    /// Where the pool's runtime runs: a `thread` of its own, or hosted on
    /// the tokio runtime (`tokio`: `Pool::builder().host_on_tokio`, turned
    /// by a tokio task on whichever worker polls it).
    #[arg(long, default_value = "thread", value_parser = ["thread", "tokio"])]
    host: String,
    /// Bound of each wait, in seconds: for the server to start, for a
    /// client to connect, and for a point's results beyond its `--secs`
    /// (30 s unless given).
    #[arg(long, default_value = "30", value_parser = cli::seconds)]
    timeout: Duration,
    /// Only run the echo server, listening on ADDR, for the two clients of
    /// one run of `pool_echo --server` (each accepted within --timeout).
    #[arg(long, value_name = "ADDR", conflicts_with = "server")]
    serve: Option<SocketAddr>,
    /// Run the clients against the echo server of a `pool_echo --serve`
    /// at ADDR instead of one in this process.
    #[arg(long, value_name = "ADDR")]
    server: Option<SocketAddr>,
    /// Run only one of the two clients at each point (`local` or
    /// `handle`; the other's columns read 0), e.g. to count one path's
    /// system calls with `perf stat` or `strace -c`.
    #[arg(long, value_name = "CLIENT", value_parser = ["local", "handle"])]
    only: Option<String>,
    /// Also print, per point and client, each kind of thread's CPU time,
    /// sleeps and preemptions per message (the echo server, the client's
    /// runtime thread: the local client's or the pool's, tokio's workers,
    /// the soft devices' engines, the rest): where the handle path's
    /// added CPU goes.
    #[arg(long)]
    by_thread: bool,
}

fn default_sizes() -> Vec<usize> {
    (0..10).map(|i| 64usize << (2 * i)).collect()
}

/// What one client measured at one point.
#[derive(Clone, Copy, Debug, Default)]
struct Run {
    messages: u64,
    secs: f64,
    /// Median round trip (window 1 only).
    p50: Option<Duration>,
    cpu: Duration,
    /// Sleeps of the process's threads meanwhile ([`process_sleeps`]).
    sleeps: u64,
    /// What each kind of thread did meanwhile (`--by-thread`).
    by_kind: [Usage; KINDS.len()],
}

impl Run {
    fn rate(&self) -> f64 {
        self.messages as f64 / self.secs
    }
    fn cpu_per_msg(&self) -> Duration {
        self.cpu / self.messages.max(1) as u32
    }
    fn sleeps_per_msg(&self) -> f64 {
        self.sleeps as f64 / self.messages.max(1) as f64
    }
}

/// Voluntary context switches of the whole process so far (every
/// thread's): each is a thread going to sleep (in epoll, on a futex) to be
/// woken again. Preemptions are left out: they count the machine's load.
fn process_sleeps() -> u64 {
    // SAFETY: an all-zero `rusage` is a valid value of the plain C struct.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer; RUSAGE_SELF counts every thread.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    assert_eq!(rc, 0, "getrusage(RUSAGE_SELF)");
    ru.ru_nvcsw as u64
}

/// What the threads of one kind did: CPU time, sleeps (voluntary context
/// switches) and preemptions (involuntary ones).
#[derive(Clone, Copy, Debug, Default)]
struct Usage {
    cpu: Duration,
    sleeps: u64,
    preempted: u64,
}

/// The kinds of thread `--by-thread` tells apart, by thread name.
const KINDS: [&str; 6] = ["server", "local", "pool", "tokio", "soft", "other"];

/// The kind (an index into [`KINDS`]) of the thread named `comm`.
fn kind_of(comm: &str) -> usize {
    match comm {
        "echo-server" => 0,
        "local-client" => 1,
        c if c.starts_with("verbio-pool") => 2,
        "tokio-rt-worker" => 3,
        c if c.starts_with("verbio-soft") => 4,
        _ => 5,
    }
}

/// Every live thread of the process: its id, kind, CPU time (its
/// `CLOCK_THREAD_CPUTIME_ID`, read through the thread's CPU clock id),
/// sleeps and preemptions so far. A thread gone between the listing and
/// the reads is left out.
fn thread_usage() -> Vec<(u32, usize, Usage)> {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in dir.flatten() {
        let Some(tid) = e.file_name().to_str().and_then(|t| t.parse::<u32>().ok()) else {
            continue;
        };
        let path = e.path();
        let (Ok(comm), Ok(status)) = (
            std::fs::read_to_string(path.join("comm")),
            std::fs::read_to_string(path.join("status")),
        ) else {
            continue;
        };
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().parse::<u64>().ok())
                .unwrap_or(0)
        };
        // The CPU clock of thread `tid` (the kernel's MAKE_THREAD_CPUCLOCK
        // with CPUCLOCK_SCHED): `~tid << 3 | 6`.
        let clock = ((!(tid as libc::clockid_t)) << 3) | 6;
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: valid out-pointer; a clock id of a thread that has ended
        // fails with EINVAL, which leaves the thread out.
        if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
            continue;
        }
        out.push((
            tid,
            kind_of(comm.trim()),
            Usage {
                cpu: Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32),
                sleeps: field("voluntary_ctxt_switches:"),
                preempted: field("nonvoluntary_ctxt_switches:"),
            },
        ));
    }
    out
}

/// Per kind of thread, what its threads did between `before` and `after`
/// (a thread born meanwhile counts from zero).
fn usage_by_kind(
    before: &[(u32, usize, Usage)],
    after: &[(u32, usize, Usage)],
) -> [Usage; KINDS.len()] {
    let mut by = [Usage::default(); KINDS.len()];
    for (tid, kind, a) in after {
        let b = before
            .iter()
            .find(|(t, _, _)| t == tid)
            .map(|(_, _, u)| *u)
            .unwrap_or_default();
        let k = &mut by[*kind];
        k.cpu += a.cpu.saturating_sub(b.cpu);
        k.sleeps += a.sleeps.saturating_sub(b.sleeps);
        k.preempted += a.preempted.saturating_sub(b.preempted);
    }
    by
}

/// `--by-thread`'s line for one client: per kind of thread with any CPU
/// time, µs of CPU, sleeps and preemptions per message.
fn by_thread_line(client: &str, run: &Run) -> String {
    let n = run.messages.max(1) as f64;
    let mut line = format!("{:>16} {client:<6}", "by thread:");
    for (name, u) in KINDS.iter().zip(run.by_kind.iter()) {
        if u.cpu < Duration::from_micros(500) {
            continue;
        }
        line.push_str(&format!(
            "  {name} {:.2} µs {:.3} zz {:.3} pre",
            u.cpu.as_secs_f64() * 1e6 / n,
            u.sleeps as f64 / n,
            u.preempted as f64 / n
        ));
    }
    line
}

/// A soft device whose engine listens on `ip`: the server's address, or,
/// for a client of a server on another host, the unspecified address
/// (the engine then announces the address the server reaches it at).
fn soft_on(ip: IpAddr) -> Result<Context, verbio::provider::ProviderError> {
    Context::open_soft(SoftConfig {
        bind: SocketAddr::new(ip, 0),
        ..SoftConfig::default()
    })
}

/// The soft device of a client of the server at `server`.
fn soft_for(server: SocketAddr) -> Result<Context, verbio::provider::ProviderError> {
    if server.ip().is_loopback() {
        Context::open_soft(SoftConfig::default())
    } else {
        soft_on(IpAddr::V4(Ipv4Addr::UNSPECIFIED))
    }
}

fn builder(max: usize) -> RdmaBuilder {
    RdmaBuilder::new().max_message_len(max)
}

/// The echo server on `at`: a runtime thread accepting the two clients
/// (each within `limit`), echoing until both hang up.
fn serve(
    at: SocketAddr,
    max: usize,
    limit: Duration,
    ready: mpsc::Sender<Result<SocketAddr, String>>,
) {
    let run = || -> Result<(), Box<dyn std::error::Error>> {
        let rt = Runtime::new()?;
        let dev = Device::open(soft_on(at.ip())?)?;
        rt.block_on(async {
            let l = builder(max).device(dev).listen(at)?;
            let _ = ready.send(Ok(l.local_addr()?));
            let mut echoes = Vec::new();
            for client in ["local", "handle"] {
                let doing = format!("accepting the {client} client");
                let c = cli::bounded(limit, "the client", &doing, l.accept()).await?;
                echoes.push(spawn(async move {
                    while let Ok(m) = c.receive().await {
                        if c.send(&m).await.is_err() {
                            break;
                        }
                    }
                }));
            }
            for e in echoes {
                e.await;
            }
            Ok::<_, Box<dyn std::error::Error>>(())
        })
    };
    if let Err(e) = run() {
        let _ = ready.send(Err(cli::chain(&*e)));
    }
}

/// A point for a client: message size, window, how long.
#[derive(Clone, Copy)]
struct Point {
    size: usize,
    window: usize,
    time: Duration,
}

/// The local client: a runtime thread with its own connection, running
/// the points it is sent.
fn local_client(
    addr: SocketAddr,
    max: usize,
    points: mpsc::Receiver<Point>,
    results: mpsc::Sender<Result<Run, String>>,
) {
    let run = || -> Result<(), Box<dyn std::error::Error>> {
        let rt = Runtime::new()?;
        let dev = Device::open(soft_for(addr)?)?;
        let rdma = Rc::new(rt.block_on(builder(max).device(dev).connect(addr))?);
        results.send(Ok(Run::default()))?;
        for p in points {
            let r = rt.block_on(local_point(rdma.clone(), p));
            results.send(r.map_err(|e| cli::chain(&e)))?;
        }
        Ok(())
    };
    if let Err(e) = run() {
        let _ = results.send(Err(cli::chain(&*e)));
    }
}

async fn local_point(rdma: Rc<Rdma>, p: Point) -> Result<Run, verbio::AgentError> {
    let count = Rc::new(std::cell::Cell::new(0u64));
    let lat = Rc::new(std::cell::RefCell::new(Vec::with_capacity(1 << 16)));
    let start = Instant::now();
    let end = start + p.time;
    let tasks: Vec<_> = (0..p.window)
        .map(|_| {
            let (rdma, count, lat) = (rdma.clone(), count.clone(), lat.clone());
            let one = p.window == 1;
            spawn(async move {
                let mut m = vec![7u8; p.size];
                while Instant::now() < end {
                    let t = Instant::now();
                    rdma.send(&m).await?;
                    m = rdma.receive().await?;
                    if one {
                        lat.borrow_mut().push(t.elapsed());
                    }
                    count.set(count.get() + 1);
                }
                Ok::<_, verbio::AgentError>(())
            })
        })
        .collect();
    for t in tasks {
        t.await?;
    }
    let secs = start.elapsed().as_secs_f64();
    let p50 = median(&mut lat.borrow_mut());
    Ok(Run {
        messages: count.get(),
        secs,
        p50,
        cpu: Duration::ZERO,
        sleeps: 0,
        by_kind: Default::default(),
    })
}

async fn handle_point(h: &RdmaHandle, p: Point) -> Result<Run, verbio::HandleError> {
    let count = Arc::new(AtomicU64::new(0));
    let lat = Arc::new(Mutex::new(Vec::with_capacity(1 << 16)));
    let start = Instant::now();
    let end = start + p.time;
    let tasks: Vec<_> = (0..p.window)
        .map(|_| {
            let (h, count, lat) = (h.clone(), count.clone(), lat.clone());
            let one = p.window == 1;
            tokio::spawn(async move {
                let mut m = vec![7u8; p.size];
                while Instant::now() < end {
                    let t = Instant::now();
                    h.send(m).await?;
                    m = h.receive().await?;
                    if one {
                        lat.lock().unwrap().push(t.elapsed());
                    }
                    count.fetch_add(1, Ordering::Relaxed);
                }
                Ok::<_, verbio::HandleError>(())
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("task")?;
    }
    let secs = start.elapsed().as_secs_f64();
    let p50 = median(&mut lat.lock().unwrap());
    Ok(Run {
        messages: count.load(Ordering::Relaxed),
        secs,
        p50,
        cpu: Duration::ZERO,
        sleeps: 0,
        by_kind: Default::default(),
    })
}

fn median(v: &mut [Duration]) -> Option<Duration> {
    if v.is_empty() {
        return None;
    }
    v.sort_unstable();
    Some(v[v.len() / 2])
}

fn us(d: Option<Duration>) -> String {
    d.map_or("-".into(), |d| format!("{:.1} µs", d.as_secs_f64() * 1e6))
}

fn main() -> ExitCode {
    cli::init_tracing();
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => cli::fail("pool_echo", &*e),
    }
}

/// The next message on `rx`, waiting at most `limit`; on expiry fails
/// with [`cli::no_answer`] (`who`, `doing`), and when `who`'s thread has
/// ended without a word, says so.
fn within<T>(
    rx: &mpsc::Receiver<Result<T, String>>,
    limit: Duration,
    who: &str,
    doing: &str,
) -> Result<T, Box<dyn std::error::Error>> {
    match rx.recv_timeout(limit) {
        Ok(r) => Ok::<_, Box<dyn std::error::Error>>(r?),
        Err(mpsc::RecvTimeoutError::Timeout) => Err(cli::no_answer(who, limit, doing).into()),
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            Err(format!("{who} ended without a word while {doing}").into())
        }
    }
}

/// `--serve`: the echo server alone, until its two clients hang up.
fn serve_only(
    at: SocketAddr,
    max: usize,
    limit: Duration,
) -> Result<(), Box<dyn std::error::Error>> {
    let (ready_tx, ready_rx) = mpsc::channel();
    let server = std::thread::Builder::new()
        .name("echo-server".into())
        .spawn(move || serve(at, max, limit, ready_tx))?;
    let addr = within(
        &ready_rx,
        limit,
        "the echo server",
        "waiting for it to listen",
    )?;
    println!("pool_echo: echo server listening on {addr}");
    // An error after listening comes on the same channel.
    server.join().map_err(|_| "the echo server panicked")?;
    match ready_rx.try_recv() {
        Ok(Err(e)) => Err(e.into()),
        _ => Ok(()),
    }
}

fn run(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let max = args.sizes.iter().copied().max().unwrap_or(64).max(64);
    let limit = args.timeout;
    if let Some(at) = args.serve {
        return serve_only(at, max, limit);
    }
    let addr = match args.server {
        Some(addr) => addr,
        None => {
            let (ready_tx, ready_rx) = mpsc::channel();
            let at = SocketAddr::from(([127, 0, 0, 1], 0));
            std::thread::Builder::new()
                .name("echo-server".into())
                .spawn(move || serve(at, max, limit, ready_tx))?;
            within(
                &ready_rx,
                limit,
                "the echo server",
                "waiting for it to listen",
            )?
        }
    };

    let (points_tx, points_rx) = mpsc::channel();
    let (results_tx, results_rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("local-client".into())
        .spawn(move || local_client(addr, max, points_rx, results_tx))?;
    within(
        &results_rx,
        limit,
        &format!("the server at {addr}"),
        "connecting the local client",
    )?;

    verbio::runtime::pool::relay::set_enabled(args.relay == "on");
    let tokio_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.workers)
        .enable_all()
        .build()?;
    let mut pool = Pool::builder()
        .threads(1)
        .runtime(Runtime::builder().busy_poll(Duration::from_micros(args.pool_busy_poll_us)))
        .reply_spin(Duration::from_micros(args.reply_spin_us))
        .device_per_thread(move |_| soft_for(addr));
    if args.host == "tokio" {
        pool = pool.host_on_tokio(tokio_rt.handle().clone());
    }
    let pool = pool.build()?;
    let handle = tokio_rt.block_on(async {
        let connect = RdmaHandle::connect_with(&pool, Placement::Thread(0), addr, move |b| {
            b.max_message_len(max)
        });
        match tokio::time::timeout(limit, connect).await {
            Ok(h) => Ok::<_, Box<dyn std::error::Error>>(h?),
            Err(_) => Err(cli::no_answer(
                &format!("the server at {addr}"),
                limit,
                "connecting the handle client",
            )
            .into()),
        }
    })?;

    println!(
        "{:>9} {:>6} {:>12} {:>12} {:>7} {:>10} {:>10} {:>11} {:>11} {:>9} {:>9}",
        "size",
        "window",
        "local msg/s",
        "handle msg/s",
        "ratio",
        "local p50",
        "handle p50",
        "local CPU",
        "handle CPU",
        "local zz",
        "handle zz"
    );
    let time = Duration::from_secs_f64(args.secs);
    let mut turn = 0;
    for &size in &args.sizes {
        for &window in &args.windows {
            // At most 64 MiB in flight per client.
            let window = window.min((64 << 20) / size).max(1);
            let p = Point { size, window, time };
            let mut local = Run::default();
            let mut remote = Run::default();
            for first_local in [turn % 2 == 0, turn % 2 != 0] {
                let skip = match args.only.as_deref() {
                    Some("local") => !first_local,
                    Some(_) => first_local,
                    None => false,
                };
                if skip {
                    continue;
                }
                let threads0 = if args.by_thread {
                    thread_usage()
                } else {
                    Vec::new()
                };
                let (cpu0, sleeps0) = (cli::process_cpu(), process_sleeps());
                if first_local {
                    points_tx.send(p)?;
                    local = within(
                        &results_rx,
                        time + limit,
                        "the local client",
                        "waiting for the result of its point",
                    )?;
                    local.cpu = cli::process_cpu() - cpu0;
                    local.sleeps = process_sleeps() - sleeps0;
                    if args.by_thread {
                        local.by_kind = usage_by_kind(&threads0, &thread_usage());
                    }
                } else {
                    remote = tokio_rt.block_on(async {
                        match tokio::time::timeout(time + limit, handle_point(&handle, p)).await {
                            Ok(r) => Ok::<_, Box<dyn std::error::Error>>(r?),
                            Err(_) => Err(cli::no_answer(
                                &format!("the server at {addr}"),
                                time + limit,
                                "echoing the handle client's point",
                            )
                            .into()),
                        }
                    })?;
                    remote.cpu = cli::process_cpu() - cpu0;
                    remote.sleeps = process_sleeps() - sleeps0;
                    if args.by_thread {
                        remote.by_kind = usage_by_kind(&threads0, &thread_usage());
                    }
                }
            }
            turn += 1;
            println!(
                "{:>9} {:>6} {:>12.0} {:>12.0} {:>6.2}× {:>10} {:>10} {:>8.2} µs {:>8.2} µs {:>9.2} {:>9.2}",
                size,
                window,
                local.rate(),
                remote.rate(),
                remote.rate() / local.rate(),
                us(local.p50),
                us(remote.p50),
                local.cpu_per_msg().as_secs_f64() * 1e6,
                remote.cpu_per_msg().as_secs_f64() * 1e6,
                local.sleeps_per_msg(),
                remote.sleeps_per_msg(),
            );
            if args.by_thread {
                println!("{}", by_thread_line("local", &local));
                println!("{}", by_thread_line("handle", &remote));
            }
        }
    }
    drop(handle);
    drop(pool);
    Ok(())
}
