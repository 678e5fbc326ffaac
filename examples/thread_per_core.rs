//! A thread-per-core RDMA echo server: one verbio `Runtime` per worker
//! thread, each with its own `Device` (its own CQ and completion channel)
//! and its own listening socket on one shared port (`SO_REUSEPORT`), so the
//! kernel spreads the clients over the workers and every connection lives
//! on one thread from handshake to close: no locks, no cross-thread
//! hand-off on the data path. Each connection is a task on its worker's
//! runtime that echoes SENDs until the client sends an empty message.
//!
//! The client side, in the same process: `--clients` threads, each with its
//! own runtime and device, connect and run `--rounds` ping-pongs of
//! `--size` bytes. At the end the example prints how the kernel spread the
//! connections over the workers and the aggregate round trips per second.
//!
//! ```text
//! cargo run --release --example thread_per_core -- [--workers 2] [--clients 4] [--rounds 2000] [--size 64]
//! ```
//!
//! On the soft device every `Device` has its own engine thread (playing its
//! NIC), so this runs twice as many threads as workers and clients; on
//! hardware (`--features ibverbs`, `-d DEVICE`) every worker opens the
//! same RNIC.

mod cli;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use clap::Parser;
use futures::future::{select, Either};
use futures::stream::{FuturesUnordered, StreamExt};
use socket2::{Domain, Socket, Type};
use verbio::ops::connect::{connect, DeviceQps, Listener, QpConfig};
use verbio::ops::verbs::Verbs;
use verbio::provider::open_device;
use verbio::runtime::buf::MrPool;
use verbio::runtime::{spawn, Device, QueuePair, Runtime};
use verbio::ErrorChain;

/// Longest a connection handshake takes.
const HANDSHAKE: Duration = Duration::from_secs(10);

/// A thread-per-core RDMA echo server and its clients, in one process.
#[derive(Parser)]
struct Args {
    /// Server worker threads (one runtime and device each).
    #[arg(long, default_value_t = 2, value_parser = cli::at_least_one)]
    workers: usize,
    /// Client threads (one connection each).
    #[arg(long, default_value_t = 4, value_parser = cli::at_least_one)]
    clients: usize,
    /// Ping-pongs per client.
    #[arg(long, default_value_t = 2000)]
    rounds: usize,
    /// Message size in bytes.
    #[arg(long, default_value_t = 64, value_parser = cli::at_least_one)]
    size: usize,
    /// RDMA device every thread opens (default: the first active RNIC, else
    /// a software device per thread).
    #[arg(short, long, env = "VERBIO_DEVICE")]
    device: Option<String>,
    /// Seconds the whole run (workers and clients, all in this process)
    /// may take before it is given up.
    #[arg(long, value_name = "SECONDS", default_value = "120", value_parser = cli::seconds)]
    timeout: Duration,
}

/// The `--device` of the run, for every thread's [`runtime_and_device`].
static DEVICE: OnceLock<Option<String>> = OnceLock::new();

/// A listening socket on `addr` that other sockets may share
/// (`SO_REUSEPORT`): each worker binds its own to the same port.
fn shared_listener(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    socket.set_reuse_port(true)?;
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    Ok(socket.into())
}

/// A runtime and a device on the current thread: `--device`, else the first
/// active RNIC, else a fresh soft device.
fn runtime_and_device() -> Result<(Runtime, Device), String> {
    let rt = Runtime::new().map_err(|e| format!("runtime: {}", ErrorChain(&e)))?;
    let name = DEVICE.get().and_then(|d| d.as_deref());
    let ctx = open_device(name).map_err(|e| format!("device: {}", ErrorChain(&e)))?;
    tracing::info!(device = ctx.name(), kind = %ctx.kind(), "opened the RDMA device");
    let dev = Device::open(ctx).map_err(|e| format!("device: {}", ErrorChain(&e)))?;
    Ok((rt, dev))
}

/// Echoes SENDs on `qp` until an empty one arrives; returns the count.
/// The next RECV is posted (a submission posts as it is made, when the
/// queue has room) before the reply goes out, so the client's next SEND
/// always finds one waiting instead of being refused (RNR) and retried.
async fn echo(qp: QueuePair, pool: MrPool, size: usize) -> Result<usize, String> {
    let alloc = || {
        pool.alloc(size)
            .map_err(|e| format!("buffer: {}", ErrorChain(&e)))
    };
    let mut spare = alloc()?;
    let mut next = qp.recv(alloc()?);
    let mut served = 0;
    loop {
        let (res, mut got) = next.await;
        let len = res.map_err(|e| format!("recv: {}", ErrorChain(&e)))?.len;
        if len == 0 {
            return Ok(served);
        }
        next = qp.recv(spare);
        got.truncate(len);
        let (res, sent) = qp.send(got).await;
        res.map_err(|e| format!("send: {}", ErrorChain(&e)))?;
        spare = sent;
        served += 1;
    }
}

/// What one worker did.
struct WorkerReport {
    connections: usize,
    messages: usize,
}

/// One worker: accepts on its own socket and serves each connection in a
/// task on this thread's runtime, until `stop` fires and every connection
/// it accepted has ended.
fn worker(
    listener: std::net::TcpListener,
    size: usize,
    stop: futures::channel::oneshot::Receiver<()>,
) -> Result<WorkerReport, String> {
    let (rt, dev) = runtime_and_device()?;
    let pool = MrPool::new(dev.pd());
    let qps = DeviceQps::new(dev.clone(), QpConfig::default());
    let listener = Listener::from_std(listener, qps, HANDSHAKE)
        .map_err(|e| format!("listener: {}", ErrorChain(&e)))?;
    rt.block_on(async {
        let mut conns = FuturesUnordered::new();
        let mut stop = stop;
        // Until `stop` fires: accept, and serve each connection in a task.
        while let Either::Left((conn, _)) =
            select(std::pin::pin!(listener.accept()), &mut stop).await
        {
            let qp = conn.map_err(|e| format!("accept: {}", ErrorChain(&e)))?.qp;
            conns.push(spawn(echo(qp, pool.clone(), size)));
        }
        let connections = conns.len();
        let mut messages = 0;
        while let Some(served) = conns.next().await {
            messages += served?;
        }
        Ok(WorkerReport {
            connections,
            messages,
        })
    })
}

/// One client: `rounds` ping-pongs of `size` bytes, then an empty SEND.
fn client(addr: SocketAddr, rounds: usize, size: usize) -> Result<(), String> {
    let (rt, dev) = runtime_and_device()?;
    let pool = MrPool::new(dev.pd());
    let qps = DeviceQps::new(dev.clone(), QpConfig::default());
    rt.block_on(async {
        let qp = connect(addr, &qps, HANDSHAKE)
            .await
            .map_err(|e| format!("connect: {}", ErrorChain(&e)))?
            .qp;
        let msg: Vec<u8> = (0..size).map(|i| i as u8).collect();
        for i in 0..rounds {
            let reply = qp.recv(
                pool.alloc(size)
                    .map_err(|e| format!("buffer: {}", ErrorChain(&e)))?,
            );
            let out = pool
                .alloc_from(&msg)
                .map_err(|e| format!("buffer: {}", ErrorChain(&e)))?;
            let (res, _) = qp.send(out).await;
            res.map_err(|e| format!("send {i}: {}", ErrorChain(&e)))?;
            let (res, back) = reply.await;
            let n = res
                .map_err(|e| format!("recv {i}: {}", ErrorChain(&e)))?
                .len;
            if back[..n] != msg[..] {
                return Err(format!("round {i}: the echo differs"));
            }
        }
        // An empty SEND ends the connection at the worker.
        let (res, _) = qp
            .send(
                pool.alloc(0)
                    .map_err(|e| format!("buffer: {}", ErrorChain(&e)))?,
            )
            .await;
        res.map(drop)
            .map_err(|e| format!("bye: {}", ErrorChain(&e)))
    })
}

fn run(args: &Args) -> Result<(), String> {
    // The first socket picks the port; the others join it.
    let first = shared_listener(SocketAddr::from(([127, 0, 0, 1], 0)))
        .map_err(|e| format!("listen: {}", ErrorChain(&e)))?;
    let addr = first
        .local_addr()
        .map_err(|e| format!("listen: {}", ErrorChain(&e)))?;
    let mut sockets = vec![first];
    for _ in 1..args.workers {
        sockets.push(
            shared_listener(addr).map_err(|e| format!("listen on {addr}: {}", ErrorChain(&e)))?,
        );
    }
    let mut stops = Vec::new();
    let workers: Vec<_> = sockets
        .into_iter()
        .enumerate()
        .map(|(i, socket)| {
            let (tx, rx) = futures::channel::oneshot::channel();
            stops.push(tx);
            let size = args.size;
            std::thread::Builder::new()
                .name(format!("worker-{i}"))
                .spawn(move || worker(socket, size, rx))
                .map_err(|e| format!("worker thread: {}", ErrorChain(&e)))
        })
        .collect::<Result<_, _>>()?;
    println!(
        "{} workers on {addr} (SO_REUSEPORT), {} clients x {} round trips of {} bytes",
        args.workers, args.clients, args.rounds, args.size
    );
    let started = Instant::now();
    let failures = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..args.clients)
        .map(|i| {
            let (rounds, size, failures) = (args.rounds, args.size, failures.clone());
            std::thread::spawn(move || {
                if let Err(e) = client(addr, rounds, size) {
                    eprintln!("client {i}: {e}");
                    failures.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for c in clients {
        c.join().map_err(|_| "a client panicked".to_string())?;
    }
    let elapsed = started.elapsed();
    for tx in stops {
        let _ = tx.send(());
    }
    let mut total = 0;
    for (i, w) in workers.into_iter().enumerate() {
        let report = w
            .join()
            .map_err(|_| format!("worker {i} panicked"))?
            .map_err(|e| format!("worker {i}: {e}"))?;
        println!(
            "  worker {i}: {} connections, {} messages echoed",
            report.connections, report.messages
        );
        total += report.messages;
    }
    let failed = failures.load(Ordering::Relaxed);
    if failed > 0 {
        return Err(format!("{failed} clients failed"));
    }
    let expected = args.clients * args.rounds;
    if total != expected {
        return Err(format!("echoed {total} messages, expected {expected}"));
    }
    println!(
        "{total} round trips in {:.2} s: {:.0} round trips/s over all connections",
        elapsed.as_secs_f64(),
        total as f64 / elapsed.as_secs_f64()
    );
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    cli::init_tracing();
    let _ = DEVICE.set(args.device.clone());
    // The whole run is bounded: a lost completion fails instead of hanging.
    let (tx, rx) = std::sync::mpsc::channel();
    let limit = args.timeout;
    std::thread::spawn(move || {
        let _ = tx.send(run(&args));
    });
    match rx.recv_timeout(limit) {
        Ok(Ok(())) => ExitCode::SUCCESS,
        Ok(Err(e)) => {
            eprintln!("thread_per_core: {e}");
            ExitCode::FAILURE
        }
        Err(_) => {
            eprintln!(
                "thread_per_core: no result from the workers and clients within {} s \
                 (--timeout sets the bound)",
                limit.as_secs()
            );
            ExitCode::FAILURE
        }
    }
}
