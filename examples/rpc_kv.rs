//! A thread-per-core key-value server over the RPC engine (`verbio::rpc`),
//! and a load client that prints the throughput and the p50/p99 latency.
//!
//! Each server worker thread has its own runtime, device, UD queue pair and
//! RPC endpoint, and owns the keys `k` with `k % workers == its index`: no
//! locks, no hand-off between threads. Each client thread likewise has its
//! own endpoint, opens one session to every worker and keeps
//! `--concurrency` calls in flight, each sent to the key's owner (GETs and
//! `--put-percent` PUTs of `--value-size`-byte values over `--keys`
//! uniformly chosen keys).
//!
//! ```text
//! cargo run --release --example rpc_kv [-- --workers 2 --clients 2 --seconds 3]
//! ```
//!
//! On the software device every `Device` has its own engine thread (its
//! NIC), so this runs twice as many threads as workers and clients; on
//! hardware (`--features ibverbs`, `-d DEVICE`) every thread opens the
//! same RNIC.

mod cli;

use std::cell::RefCell;
use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::process::ExitCode;
use std::rc::Rc;
use std::sync::{mpsc, Arc, Barrier};
use std::time::{Duration, Instant};

use clap::Parser;
use futures::channel::oneshot;
use verbio::rpc::ud::{UdConfig, UdTransport};
use verbio::rpc::{Request, Rpc, RpcConfig, SessionId, SESSION_SLOTS};
use verbio::runtime::{spawn, Device, Runtime};
use verbio::ErrorChain;

/// GET: request = key (8 bytes LE); response = the value, or empty.
const GET: u8 = 1;
/// PUT: request = key then value; response = empty.
const PUT: u8 = 2;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A thread-per-core key-value server over RPC, and its load client.
#[derive(Parser, Clone)]
struct Args {
    /// Server worker threads (one endpoint each).
    #[arg(long, default_value_t = 2, value_parser = cli::at_least_one)]
    workers: usize,
    /// Client threads (one endpoint each, a session to every worker).
    #[arg(long, default_value_t = 2, value_parser = cli::at_least_one)]
    clients: usize,
    /// Calls in flight per client thread.
    #[arg(long, default_value_t = 8, value_parser = cli::at_least_one)]
    concurrency: usize,
    /// Seconds of measured load (after a short warm-up).
    #[arg(long, default_value_t = 3, value_parser = cli::at_least_one)]
    seconds: usize,
    /// Keys in the store (preloaded).
    #[arg(long, default_value_t = 100_000, value_parser = cli::at_least_one)]
    keys: usize,
    /// Value size in bytes.
    #[arg(long, default_value_t = 32)]
    value_size: usize,
    /// Largest preload (keys × value size, held by the workers) run
    /// without complaint, in MiB; a larger one is refused.
    #[arg(long, default_value_t = 1024)]
    max_preload_mib: usize,
    /// Share of PUTs among the calls, in percent.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u8).range(0..=100))]
    put_percent: u8,
    /// RDMA device every thread opens (default: a software device per thread).
    #[arg(short, long, env = "VERBIO_DEVICE")]
    device: Option<String>,
    /// Seconds the whole run (preload, sessions, load, shutdown; all in
    /// this process) may take before it is given up (default: --seconds
    /// plus 120).
    #[arg(long, value_name = "SECONDS", value_parser = cli::seconds)]
    timeout: Option<Duration>,
}

fn endpoint(device: Option<&str>) -> Result<Rpc<UdTransport>, BoxError> {
    let ctx = cli::open_device_or_soft(device, Ipv4Addr::LOCALHOST.into())
        .map_err(|e| ErrorChain(&e).to_string())?;
    let dev = Device::open(ctx).map_err(|e| ErrorChain(&e).to_string())?;
    let transport =
        UdTransport::new(&dev, &UdConfig::default()).map_err(|e| ErrorChain(&e).to_string())?;
    Ok(Rpc::new(transport, RpcConfig::default()))
}

/// The value stored under `key` before the run.
fn initial_value(key: u64, size: usize) -> Vec<u8> {
    (0..size).map(|i| (key as usize + i) as u8).collect()
}

/// One server worker: preloads its keys, serves GET and PUT until `stop`.
fn worker(
    index: usize,
    args: Args,
    addr_tx: mpsc::Sender<(usize, Vec<u8>)>,
    stop: oneshot::Receiver<()>,
) -> Result<(), BoxError> {
    let rt = Runtime::new()?;
    rt.block_on(async {
        let rpc = endpoint(args.device.as_deref())?;
        let store: Rc<RefCell<HashMap<u64, Vec<u8>>>> = Rc::default();
        {
            let mut s = store.borrow_mut();
            for key in (index..args.keys).step_by(args.workers) {
                s.insert(key as u64, initial_value(key as u64, args.value_size));
            }
        }
        let get_store = store.clone();
        rpc.register(GET, move |req: Request| {
            let mut resp = req.response();
            if let Some(k) = key_of(req.data()) {
                if let Some(v) = get_store.borrow().get(&k) {
                    resp.extend_from_slice(v);
                }
            }
            async move { resp }
        })
        .map_err(|e| ErrorChain(&e).to_string())?;
        rpc.register(PUT, move |req: Request| {
            if let Some(k) = key_of(req.data()) {
                let value = &req.data()[8..];
                let mut s = store.borrow_mut();
                match s.get_mut(&k) {
                    // Same size: overwritten in place (no allocation).
                    Some(v) if v.len() == value.len() => v.copy_from_slice(value),
                    _ => {
                        s.insert(k, value.to_vec());
                    }
                }
            }
            let resp = req.response();
            async move { resp }
        })
        .map_err(|e| ErrorChain(&e).to_string())?;
        addr_tx.send((index, rpc.local_addr().into_bytes()))?;
        drop(addr_tx);
        // Ends when `run` sends (or drops) the stop.
        let _ = rpc.serve_until(stop).await;
        Ok(())
    })
}

fn key_of(req: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(req.get(..8)?.try_into().ok()?))
}

/// What one client thread measured.
struct Load {
    calls: u64,
    lat_ns: Vec<u32>,
    elapsed: Duration,
}

/// A small xorshift generator (each task its own).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// One client thread: a session to every worker, `concurrency` tasks
/// calling until the deadline; checks every GET against what it may hold.
fn client(
    index: usize,
    args: Args,
    workers: Arc<Vec<Vec<u8>>>,
    start: Arc<Barrier>,
) -> Result<Load, BoxError> {
    let rt = Runtime::new()?;
    rt.block_on(async {
        let rpc = Rc::new(endpoint(args.device.as_deref())?);
        let mut sessions: Vec<SessionId> = Vec::new();
        for w in workers.iter() {
            sessions.push(
                rpc.connect(w)
                    .await
                    .map_err(|e| ErrorChain(&e).to_string())?,
            );
        }
        let sessions = Rc::new(sessions);
        start.wait();
        let warm_up = Instant::now() + Duration::from_millis(300);
        let deadline = warm_up + Duration::from_secs(args.seconds as u64);
        let tasks: Vec<_> = (0..args.concurrency)
            .map(|t| {
                let rpc = rpc.clone();
                let sessions = sessions.clone();
                let args = args.clone();
                spawn(async move {
                    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ ((index * 1000 + t) as u64 + 1));
                    let mut req = Vec::with_capacity(8 + args.value_size);
                    let mut lat_ns = Vec::with_capacity(1 << 16);
                    let mut calls = 0u64;
                    loop {
                        let now = Instant::now();
                        if now >= deadline {
                            break;
                        }
                        let key = rng.next() % args.keys as u64;
                        let session = sessions[key as usize % sessions.len()];
                        let put = rng.next() % 100 < u64::from(args.put_percent);
                        req.clear();
                        req.extend_from_slice(&key.to_le_bytes());
                        if put {
                            // A PUT keeps the value's size and first byte
                            // (so a GET can be checked), and changes its last.
                            req.extend((0..args.value_size).map(|i| (key as usize + i) as u8));
                            if args.value_size > 1 {
                                *req.last_mut().expect("a value byte") = rng.next() as u8;
                            }
                        }
                        let resp = rpc
                            .call(session, if put { PUT } else { GET }, &req)
                            .await
                            .map_err(|e| ErrorChain(&e).to_string())?;
                        if !put
                            && (resp.len() != args.value_size
                                || (args.value_size > 0 && resp[0] != key as u8))
                        {
                            return Err(format!("GET {key}: a wrong value"));
                        }
                        if now >= warm_up {
                            calls += 1;
                            let ns = now.elapsed().as_nanos().min(u128::from(u32::MAX));
                            lat_ns.push(ns as u32);
                        }
                    }
                    Ok::<_, String>((calls, lat_ns))
                })
            })
            .collect();
        let mut load = Load {
            calls: 0,
            lat_ns: Vec::new(),
            elapsed: Duration::ZERO,
        };
        for t in tasks {
            let (calls, lat) = t.await?;
            load.calls += calls;
            load.lat_ns.extend(lat);
        }
        load.elapsed = Instant::now().saturating_duration_since(warm_up);
        for s in sessions.iter() {
            rpc.disconnect(*s);
        }
        Ok(load)
    })
}

/// Preloads above this many bytes are announced (they take a while).
const PRELOAD_NOTE: usize = 64 << 20;

/// The bytes of values the workers preload, refused above
/// `--max-preload-mib`: `--value-size 100000` with the default keys would
/// be 10 GB.
fn preload_bytes(args: &Args) -> Result<usize, String> {
    let max = args.max_preload_mib.saturating_mul(1 << 20);
    match args.keys.checked_mul(args.value_size) {
        Some(bytes) if bytes <= max => Ok(bytes),
        bytes => Err(format!(
            "preloading {} keys × {} B values = {} MiB, over --max-preload-mib {}: \
             lower --keys or --value-size, or raise --max-preload-mib",
            args.keys,
            args.value_size,
            bytes.map_or("more than usize::MAX bytes".to_string(), |b| (b >> 20)
                .to_string()),
            args.max_preload_mib
        )),
    }
}

/// Stops the workers and returns why the first that failed did (or
/// `what` if none says).
fn workers_failed(
    what: &str,
    stops: Vec<oneshot::Sender<()>>,
    servers: Vec<std::thread::JoinHandle<Result<(), BoxError>>>,
) -> BoxError {
    for s in stops {
        let _ = s.send(());
    }
    let mut why = None;
    for (i, s) in servers.into_iter().enumerate() {
        let failed = match s.join() {
            Ok(Ok(())) => continue,
            Ok(Err(e)) => format!("worker {i}: {}", ErrorChain(&*e)),
            Err(_) => format!("worker {i} panicked"),
        };
        why.get_or_insert(failed);
    }
    why.unwrap_or_else(|| what.to_string()).into()
}

fn run(args: &Args) -> Result<(), BoxError> {
    let preload = preload_bytes(args)?;
    if preload > PRELOAD_NOTE {
        println!(
            "note: preloading {} MiB ({} keys × {} B) across the workers",
            preload >> 20,
            args.keys,
            args.value_size
        );
    }
    if args.concurrency > SESSION_SLOTS * args.workers {
        println!(
            "note: {} calls in flight per client exceed the {} slots of its {} sessions; \
             the rest wait for a slot",
            args.concurrency,
            SESSION_SLOTS * args.workers,
            args.workers
        );
    }
    let (addr_tx, addr_rx) = mpsc::channel();
    let mut stops = Vec::new();
    let mut servers = Vec::new();
    for i in 0..args.workers {
        let (stop_tx, stop_rx) = oneshot::channel();
        stops.push(stop_tx);
        let (a, tx) = (args.clone(), addr_tx.clone());
        servers.push(std::thread::spawn(move || worker(i, a, tx, stop_rx)));
    }
    drop(addr_tx);
    let mut addrs = vec![Vec::new(); args.workers];
    for _ in 0..args.workers {
        // Every worker drops its sender once it sent or failed: no wait
        // for one that is gone.
        let Ok((i, a)) = addr_rx.recv() else {
            return Err(workers_failed("a worker failed to start", stops, servers));
        };
        addrs[i] = a;
    }
    let addrs = Arc::new(addrs);
    let start = Arc::new(Barrier::new(args.clients));
    let clients: Vec<_> = (0..args.clients)
        .map(|i| {
            let (a, w, s) = (args.clone(), addrs.clone(), start.clone());
            std::thread::spawn(move || client(i, a, w, s))
        })
        .collect();
    let mut loads = Vec::new();
    for c in clients {
        loads.push(c.join().map_err(|_| "a client thread panicked")??);
    }
    for s in stops {
        let _ = s.send(());
    }
    for s in servers {
        s.join().map_err(|_| "a worker panicked")??;
    }
    let calls: u64 = loads.iter().map(|l| l.calls).sum();
    let secs = loads
        .iter()
        .map(|l| l.elapsed.as_secs_f64())
        .fold(0.0, f64::max);
    let mut lat: Vec<u32> = loads.into_iter().flat_map(|l| l.lat_ns).collect();
    if lat.is_empty() {
        return Err("no call completed".into());
    }
    lat.sort_unstable();
    let at = |q: f64| f64::from(lat[((lat.len() - 1) as f64 * q) as usize]) / 1e3;
    println!(
        "{} workers, {} clients × {} in flight, {} B values, {}% PUT: {:.0} calls/s, p50 {:.1} µs, p99 {:.1} µs",
        args.workers,
        args.clients,
        args.concurrency,
        args.value_size,
        args.put_percent,
        calls as f64 / secs,
        at(0.50),
        at(0.99)
    );
    Ok(())
}

fn main() -> ExitCode {
    cli::init_tracing();
    let args = Args::parse();
    // The whole run is bounded: a lost call or a stuck worker fails
    // instead of hanging.
    let limit = args
        .timeout
        .unwrap_or(Duration::from_secs(args.seconds as u64 + 120));
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(run(&args));
    });
    match rx.recv_timeout(limit) {
        Ok(Ok(())) => ExitCode::SUCCESS,
        Ok(Err(e)) => cli::fail("rpc_kv", &*e),
        Err(_) => {
            eprintln!(
                "rpc_kv: no result from the workers and clients within {} s \
                 (--timeout sets the bound)",
                limit.as_secs()
            );
            ExitCode::FAILURE
        }
    }
}
