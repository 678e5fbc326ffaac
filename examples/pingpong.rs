//! Ping-pong over RC SEND/RECV with owned buffers, on the software RDMA
//! device (or hardware with `--features ibverbs` and `VERBIO_DEVICE`).
//!
//! The client sends a message, the server echoes it back, N times; the
//! client prints the average round trip and the message rate.
//!
//! Run both sides in one process (two threads, loopback):
//!
//! ```text
//! cargo run --release --example pingpong
//! ```
//!
//! or in two terminals / on two hosts:
//!
//! ```text
//! cargo run --release --example pingpong -- --server 0.0.0.0:18515
//! cargo run --release --example pingpong -- --client 127.0.0.1:18515 [--iters 10000] [--size 64]
//! ```
//!
//! The server receives into buffers of its own `--size`: give it at least
//! the client's (a longer message fails on both sides, each saying so).
//!
//! (For the soft device across hosts the engine listens on loopback by
//! default; this example binds the server's to the `--server` IP and a
//! client's to the unspecified address, announced at the client's IP.)

mod cli;

use std::net::SocketAddr;

use clap::Parser;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use verbio::ops::connect::{connect, DeviceQps, Listener, QpConfig};
use verbio::ops::verbs::Verbs;
use verbio::runtime::buf::MrPool;
use verbio::runtime::{spawn, timeout, Device, QueuePair, Runtime};
use verbio::ErrorChain;

/// Longest a connection handshake takes (less if `--timeout` is less).
const HANDSHAKE: Duration = Duration::from_secs(10);

/// Ping-pong over RC SEND/RECV; without --server/--client both sides run
/// in this process.
#[derive(Parser)]
struct Args {
    /// Serve on ADDR (the two-process mode's server).
    #[arg(long, value_name = "ADDR", conflicts_with = "client")]
    server: Option<SocketAddr>,
    /// Connect to the server at ADDR.
    #[arg(long, value_name = "ADDR")]
    client: Option<SocketAddr>,
    /// Round trips (at least 1).
    #[arg(long, default_value_t = 10_000, value_parser = cli::at_least_one)]
    iters: usize,
    /// Message size in bytes (the server: the largest it receives).
    #[arg(long, default_value_t = 64, value_parser = cli::at_least_one)]
    size: usize,
    /// RDMA device (e.g. rxe0; default: a software device bound to the
    /// address's IP).
    #[arg(short, long, env = "VERBIO_DEVICE")]
    device: Option<String>,
    /// Seconds to wait on the peer: for each echo, for the one-process
    /// run's client, and (capped at 10) for connection setup.
    #[arg(long, value_name = "SECONDS", default_value = "60", value_parser = cli::seconds)]
    timeout: Duration,
}

/// Opens the device for one side: `device` if given, else a soft device
/// whose engine listens on `ip`.
fn open(device: Option<&str>, ip: std::net::IpAddr) -> Result<Device, Box<dyn std::error::Error>> {
    Ok(Device::open(cli::open_device_or_soft(device, ip)?)?)
}

/// Echoes every message back until an empty one arrives.
async fn echo(
    qp: &QueuePair,
    pool: &MrPool,
    size: usize,
    peer: SocketAddr,
    limit: Duration,
) -> Result<usize, Box<dyn std::error::Error>> {
    let mut next = qp.recv(pool.alloc(size)?);
    let mut count = 0;
    loop {
        let (res, buf) = timeout(limit, next).await.map_err(|_| {
            cli::no_answer(
                &format!("the client at {peer}"),
                limit,
                &format!("waiting for message {count}"),
            )
        })?;
        let got = res.map_err(|e| {
            format!("receiving message {count}: {} (a message longer than this server's --size {size}?)", ErrorChain(&e))
        })?;
        if got.len == 0 {
            return Ok(count);
        }
        next = qp.recv(pool.alloc(size)?);
        let (res, _) = qp.send(buf).await;
        res?;
        count += 1;
    }
}

fn server(
    device: Option<&str>,
    addr: SocketAddr,
    size: usize,
    once: bool,
    ready: Option<std::sync::mpsc::Sender<SocketAddr>>,
    limit: Duration,
) -> Result<(), Box<dyn std::error::Error>> {
    let rt = Runtime::new()?;
    let dev = open(device, addr.ip())?;
    let listener = Listener::bind(
        addr,
        DeviceQps::new(dev.clone(), QpConfig::default()),
        limit.min(HANDSHAKE),
    )?;
    let local = listener.local_addr()?;
    match ready {
        Some(tx) => tx.send(local)?,
        None => println!("server listening on {local}"),
    }
    let pool = MrPool::new(dev.pd());
    rt.block_on(async {
        loop {
            // Clients whose handshake fails are logged and skipped by
            // `accept`, which fails only if the listening socket does
            // (EMFILE and the like are waited out).
            let c = if once {
                // One client, the one in this process: bounded, so a client
                // that failed before connecting cannot leave it waiting.
                timeout(limit, listener.accept()).await.map_err(|_| {
                    format!(
                        "no client connected within {} s (--timeout sets the bound)",
                        limit.as_secs()
                    )
                })??
            } else {
                listener.accept().await?
            };
            let session = serve_one(c.qp, c.peer_addr, pool.clone(), size, once, limit);
            if once {
                session.await;
                return Ok(());
            }
            // Each client in a task of its own: a slow or failing one
            // holds up nobody.
            spawn(session);
        }
    })
}

/// Echoes one client's messages (each wait for the next bounded by
/// `limit`), logs how it ended and closes its QP.
async fn serve_one(
    qp: QueuePair,
    peer: SocketAddr,
    pool: MrPool,
    size: usize,
    quiet: bool,
    limit: Duration,
) {
    match echo(&qp, &pool, size, peer, limit).await {
        Ok(n) if !quiet => println!("{peer}: echoed {n} messages"),
        Ok(_) => {}
        Err(e) => eprintln!("{peer}: {}", cli::chain(&*e)),
    }
    let _ = timeout(limit, qp.close()).await;
}

fn client(
    device: Option<&str>,
    addr: SocketAddr,
    iters: usize,
    size: usize,
    limit: Duration,
) -> Result<(), Box<dyn std::error::Error>> {
    let rt = Runtime::new()?;
    let local_ip = if addr.ip().is_loopback() {
        addr.ip()
    } else {
        std::net::IpAddr::from([0, 0, 0, 0])
    };
    let dev = open(device, local_ip)?;
    let pool = MrPool::new(dev.pd());
    // Sizes above the pool's classes get a registration of their own.
    if size <= pool.max_pooled_size() {
        pool.reserve(size, 4)?;
    }
    let server = format!("the server at {addr}");
    rt.block_on(async {
        // The handshake's own bound a second later: this one speaks.
        let setup = limit.min(HANDSHAKE);
        let qps = DeviceQps::new(dev.clone(), QpConfig::default());
        let qp = cli::bounded(
            setup,
            &server,
            "connecting",
            connect(addr, &qps, setup + Duration::from_secs(1)),
        )
        .await?
        .qp;
        let payload: Vec<u8> = (0..size).map(|i| i as u8).collect();
        let mut msg = pool.alloc_from(&payload)?;
        let mut rtts = Vec::with_capacity(iters);
        let start = Instant::now();
        for i in 0..iters {
            let t = Instant::now();
            // Post the RECV for the echo before the SEND, so it never waits.
            let reply = qp.recv(pool.alloc(size)?);
            let (res, m) = qp.send(msg).await;
            res.map_err(|e| {
                format!(
                    "message {i}: send: {e} (the server refused {size} bytes: \
                     is its --size at least {size}?)"
                )
            })?;
            let (res, back) = timeout(limit, reply)
                .await
                .map_err(|_| cli::no_answer(&server, limit, &format!("waiting for echo {i}")))?;
            let got =
                res.map_err(|e| format!("message {i}: receiving the echo: {}", ErrorChain(&e)))?;
            if got.len != size || back[..] != payload[..] {
                return Err(format!("message {i}: echo differs ({} bytes)", got.len).into());
            }
            rtts.push(t.elapsed());
            msg = m;
        }
        let total = start.elapsed();
        let (res, _) = qp.send(pool.alloc(0)?).await; // empty message: the end
        res?;
        rtts.sort();
        let avg = total / iters.max(1) as u32;
        let pct = |p: f64| {
            rtts.get(((rtts.len() as f64 * p) as usize).min(rtts.len().saturating_sub(1)))
                .copied()
                .unwrap_or_default()
        };
        println!(
            "{iters} round trips of {size} B: avg {avg:.2?}, p50 {:.2?}, p99 {:.2?}, {:.0} msg/s",
            pct(0.5),
            pct(0.99),
            iters as f64 / total.as_secs_f64()
        );
        let _ = timeout(limit, qp.close()).await;
        Ok::<(), Box<dyn std::error::Error>>(())
    })
}

fn main() -> ExitCode {
    let args = Args::parse();
    cli::init_tracing();
    let res = match (args.server, args.client) {
        (Some(addr), None) => server(
            args.device.as_deref(),
            addr,
            args.size,
            false,
            None,
            args.timeout,
        ),
        (None, Some(addr)) => client(
            args.device.as_deref(),
            addr,
            args.iters,
            args.size,
            args.timeout,
        ),
        (None, None) => {
            let (tx, rx) = std::sync::mpsc::channel();
            let size = args.size;
            let device = args.device.clone();
            let limit = args.timeout;
            let srv = std::thread::spawn(move || {
                let addr = "127.0.0.1:0".parse().expect("valid");
                server(device.as_deref(), addr, size, true, Some(tx), limit)
                    .map_err(|e| cli::chain(&*e))
            });
            match rx.recv_timeout(limit) {
                Ok(addr) => {
                    let r = client(args.device.as_deref(), addr, args.iters, size, limit);
                    if let Err(e) = r {
                        // Not waiting for the server: it may still be
                        // waiting for this client; exiting ends it.
                        return fail(e);
                    }
                    match srv.join() {
                        Ok(Ok(())) => r,
                        Ok(Err(e)) => Err(format!("server: {e}").into()),
                        Err(_) => Err("server thread panicked".into()),
                    }
                }
                Err(_) => match srv.join() {
                    Ok(Err(e)) => Err(format!("server: {e}").into()),
                    _ => Err("server did not start".into()),
                },
            }
        }
        (Some(_), Some(_)) => Err("choose --server or --client, not both".into()),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(e),
    }
}

/// Prints `e` with its causes and returns the failure exit code.
fn fail(e: Box<dyn std::error::Error>) -> ExitCode {
    cli::fail("pingpong", &*e)
}
