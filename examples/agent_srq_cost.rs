//! `agent_srq_cost`: what a listener's shared receive queue
//! (`RdmaBuilder::shared_receive_queue`) costs an `Rdma` connection, against
//! the receive ring a connection has of its own, side by side in one run:
//! one listener of each kind on one device, one connection to each, an
//! echo server behind both. For each size (64 B to 16 MiB, powers of 4)
//! and round, both connections run a ping-pong (one message in flight)
//! and a window (`--window` messages sent, then their echoes read), in
//! alternating order; the medians and the ratio SRQ ÷ own ring are
//! printed (above 1: the SRQ is slower), with the receive memory of each
//! kind per connection. `--timeout` bounds each run.
//!
//! ```text
//! cargo run --release --example agent_srq_cost -- --rounds 5
//! ```

mod cli;

use std::error::Error;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use clap::Parser;

use verbio::provider::{Context, SoftConfig};
use verbio::runtime::{spawn, timeout, Device, Runtime};
use verbio::{Rdma, RdmaBuilder};

/// The cost of a listener's SRQ to one `Rdma` connection.
#[derive(Parser)]
struct Args {
    /// Rounds (each runs both connections at every size).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Round trips per ping-pong run of messages up to 4 KiB (fewer for
    /// larger ones, at least 4).
    #[arg(long, default_value_t = 200)]
    iters: usize,
    /// Messages in flight in the window runs (fewer for large messages:
    /// at most 16 MiB in flight).
    #[arg(long, default_value_t = 16)]
    window: usize,
    /// Buffers of the listener's shared receive queue.
    #[arg(long, default_value_t = 256)]
    srq_depth: u32,
    /// Largest message size, in bytes.
    #[arg(long, default_value_t = 16 << 20)]
    max_size: usize,
    /// Bound of each run, in seconds.
    #[arg(long, default_value = "120", value_parser = cli::seconds)]
    timeout: Duration,
}

type Res<T> = Result<T, Box<dyn Error>>;

/// A soft device of this process.
fn soft() -> Res<Device> {
    Ok(Device::open(Context::open_soft(SoftConfig::default())?)?)
}

/// Echoes every message of `r` until it closes.
async fn echo(r: Rdma) {
    while let Ok(m) = r.receive().await {
        if r.send(&m).await.is_err() {
            return;
        }
    }
}

/// The server: a listener with a receive ring per connection and one with
/// a shared receive queue, on one device; echoes on every connection.
fn serve(srq_depth: u32) -> Res<(SocketAddr, SocketAddr)> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let run = || -> Res<()> {
            let rt = Runtime::new()?;
            rt.block_on(async {
                let dev = soft()?;
                let own = RdmaBuilder::new()
                    .device(dev.clone())
                    .no_shared_receive_queue()
                    .listen("127.0.0.1:0".parse()?)?;
                let shared = RdmaBuilder::new()
                    .device(dev)
                    .shared_receive_queue(srq_depth)
                    .listen("127.0.0.1:0".parse()?)?;
                tx.send(Ok((own.local_addr()?, shared.local_addr()?)))?;
                let a = spawn(async move {
                    while let Ok(r) = own.accept().await {
                        spawn(echo(r));
                    }
                });
                while let Ok(r) = shared.accept().await {
                    spawn(echo(r));
                }
                a.abort();
                Ok::<_, Box<dyn Error>>(())
            })
        };
        if let Err(e) = run() {
            let _ = tx.send(Err(cli::chain(&*e)));
        }
    });
    rx.recv_timeout(Duration::from_secs(30))?
        .map_err(|e| format!("the server: {e}").into())
}

/// Round trips of one ping-pong run of `size` bytes.
fn iters_for(args: &Args, size: usize) -> usize {
    (args.iters * 4096 / size.max(4096)).max(4)
}

/// Messages in flight in a window run of `size` bytes.
fn window_for(args: &Args, size: usize) -> usize {
    args.window.min((16 << 20) / size).max(1)
}

/// Microseconds per round trip of `size`-byte messages on `r`.
async fn ping_pong(r: &Rdma, msg: &[u8], iters: usize) -> Res<f64> {
    let t = Instant::now();
    for _ in 0..iters {
        r.send(msg).await?;
        let back = r.receive().await?;
        if back.len() != msg.len() || back[..] != msg[..] {
            return Err("an echo differs from its message".into());
        }
    }
    Ok(t.elapsed().as_secs_f64() * 1e6 / iters as f64)
}

/// Messages per second through `r` with `window` in flight (sent, then
/// their echoes read), `rounds` times.
async fn windowed(r: &Rdma, msg: &[u8], window: usize, rounds: usize) -> Res<f64> {
    let t = Instant::now();
    for _ in 0..rounds {
        for _ in 0..window {
            r.send(msg).await?;
        }
        for _ in 0..window {
            let back = r.receive().await?;
            if back.len() != msg.len() {
                return Err("an echo differs from its message".into());
            }
        }
    }
    Ok((window * rounds) as f64 / t.elapsed().as_secs_f64())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Bytes of `n` with a binary unit.
fn human(n: usize) -> String {
    match n {
        n if n >= 1 << 20 => format!("{} MiB", n >> 20),
        n if n >= 1 << 10 => format!("{} KiB", n >> 10),
        n => format!("{n} B"),
    }
}

fn run(args: &Args) -> Res<()> {
    let (own_addr, srq_addr) = serve(args.srq_depth)?;
    let rt = Runtime::new()?;
    rt.block_on(async {
        let dev = soft()?;
        let b = RdmaBuilder::new().device(dev);
        let own = b.connect(own_addr).await?;
        let shared = b.connect(srq_addr).await?;
        // RdmaBuilder's defaults: buffers of 4 KiB and a 48-byte header.
        let buf = 4096 + 48;
        println!(
            "receive memory: own ring, per connection, {} buffers of {buf} B plus the \
             credit-return reserve and lend slots; SRQ, for the whole listener, {} \
             buffers of {buf} B",
            verbio::ops::agent::DEFAULT_RECV_BUF_COUNT,
            args.srq_depth,
        );
        println!("size | ping-pong µs own / SRQ | ratio | window msgs/s own / SRQ | ratio");
        let mut size = 64;
        while size <= args.max_size {
            let msg: Vec<u8> = (0..size).map(|i| (i * 7) as u8).collect();
            let (iters, window) = (iters_for(args, size), window_for(args, size));
            let wrounds = (iters / window).max(2);
            let (mut lat, mut bw) = ([Vec::new(), Vec::new()], [Vec::new(), Vec::new()]);
            for round in 0..args.rounds {
                let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
                for k in order {
                    let r = if k == 0 { &own } else { &shared };
                    let what = if k == 0 { "own ring" } else { "SRQ" };
                    let l = timeout(args.timeout, ping_pong(r, &msg, iters))
                        .await
                        .map_err(|_| {
                            format!("{what}, {size} B ping-pong: over {:?}", args.timeout)
                        })??;
                    let w = timeout(args.timeout, windowed(r, &msg, window, wrounds))
                        .await
                        .map_err(|_| {
                            format!("{what}, {size} B window: over {:?}", args.timeout)
                        })??;
                    lat[k].push(l);
                    bw[k].push(w);
                }
            }
            let (l0, l1) = (median(lat[0].clone()), median(lat[1].clone()));
            let (w0, w1) = (median(bw[0].clone()), median(bw[1].clone()));
            println!(
                "{} | {l0:.1} / {l1:.1} | {:.2}x | {w0:.0} / {w1:.0} (window {window}) | {:.2}x",
                human(size),
                l1 / l0,
                w0 / w1,
            );
            size *= 4;
        }
        own.close().await?;
        shared.close().await?;
        Ok(())
    })
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => cli::fail("agent_srq_cost", &*e),
    }
}
