//! Bandwidth of `RdmaStream` (the byte stream over an `Rdma` connection)
//! next to the raw `Rdma::send` path it is built on, in one process (two
//! threads, one runtime and soft device each, loopback), side by side.
//!
//! Each round runs both modes (their order alternates from round to
//! round) on a fresh connection: the client moves `--total` bytes in
//! writes / messages of `--size` bytes; the clock stops when the server
//! has received the last byte and said so. Prints each run, the per-round
//! ratio stream / raw and the median ratio.
//!
//! ```text
//! cargo run --release --example agent_stream_bw
//! cargo run --release --example agent_stream_bw -- --size 4096 --total 16777216 --rounds 5
//! ```
//!
//! `--timeout SECONDS` bounds the wait for the server thread to listen.

mod cli;

use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use clap::Parser;
use futures::io::{AsyncReadExt, AsyncWriteExt};
use verbio::ops::agent::DEFAULT_STREAM_CHUNK;
use verbio::provider::{Context, SoftConfig};
use verbio::runtime::{Device, Runtime};
use verbio::ErrorChain;
use verbio::{Rdma, RdmaBuilder, RdmaStream};

/// RdmaStream vs raw Rdma::send bandwidth on the soft device.
#[derive(Parser, Debug, Clone)]
struct Args {
    /// Bytes per write (stream) and per message (raw).
    #[arg(long, default_value_t = 65_536)]
    size: usize,
    /// Bytes moved per run.
    #[arg(long, default_value_t = 64 << 20)]
    total: usize,
    /// Rounds (each runs both modes).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Largest message the stream sends at once.
    #[arg(long, default_value_t = DEFAULT_STREAM_CHUNK)]
    chunk: usize,
    /// Bound, in seconds, of the wait for the server thread to listen
    /// (20 s unless given).
    #[arg(long, default_value = "20", value_parser = cli::seconds)]
    timeout: Duration,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Raw,
    Stream,
}

impl Mode {
    fn tag(self) -> &'static [u8] {
        match self {
            Mode::Raw => b"raw",
            Mode::Stream => b"stream",
        }
    }
}

fn soft_runtime() -> Result<(Runtime, Device), Box<dyn std::error::Error>> {
    let rt = Runtime::new()?;
    let dev = Device::open(Context::open_soft(SoftConfig::default())?)?;
    Ok((rt, dev))
}

/// Serves `runs` connections: the first message names the mode; the
/// server then takes `total` bytes and answers "done".
fn server(
    runs: usize,
    total: usize,
    ready: mpsc::Sender<SocketAddr>,
) -> Result<(), Box<dyn std::error::Error>> {
    let (rt, dev) = soft_runtime()?;
    rt.block_on(async move {
        let l = RdmaBuilder::new()
            .device(dev)
            .listen("127.0.0.1:0".parse()?)?;
        ready.send(l.local_addr()?)?;
        for _ in 0..runs {
            let r = l.accept().await?;
            let mode = r.receive().await?;
            if mode == Mode::Raw.tag() {
                let mut got = 0;
                while got < total {
                    got += r.receive_msg().await?.len();
                }
                r.send(b"done").await?;
                let _ = r.receive().await; // until the client leaves
            } else {
                let mut s = RdmaStream::new(Rc::new(r));
                let mut buf = vec![0u8; 1 << 20];
                let mut got = 0;
                while got < total {
                    match s.read(&mut buf).await? {
                        0 => return Err("stream ended early".into()),
                        n => got += n,
                    }
                }
                s.write_all(b"done").await?;
                s.close().await?;
                let mut rest = Vec::new();
                s.read_to_end(&mut rest).await?;
            }
        }
        Ok::<(), Box<dyn std::error::Error>>(())
    })
}

/// One run of `mode`: bytes per second.
async fn run(
    dev: &Device,
    addr: SocketAddr,
    mode: Mode,
    args: &Args,
) -> Result<f64, Box<dyn std::error::Error>> {
    let r: Rdma = RdmaBuilder::new().device(dev.clone()).connect(addr).await?;
    r.send(mode.tag()).await?;
    let data = vec![0x5au8; args.size];
    let start = Instant::now();
    let mut sent = 0;
    match mode {
        Mode::Raw => {
            while sent < args.total {
                let n = args.size.min(args.total - sent);
                r.send(&data[..n]).await?;
                sent += n;
            }
            let done = r.receive().await?;
            if done != b"done" {
                return Err("bad answer".into());
            }
        }
        Mode::Stream => {
            let mut s = RdmaStream::with_chunk(Rc::new(r), args.chunk);
            while sent < args.total {
                let n = args.size.min(args.total - sent);
                s.write_all(&data[..n]).await?;
                sent += n;
            }
            s.flush().await?;
            let mut done = [0u8; 4];
            s.read_exact(&mut done).await?;
            if &done != b"done" {
                return Err("bad answer".into());
            }
            s.close().await?;
        }
    }
    Ok(args.total as f64 / start.elapsed().as_secs_f64())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> std::process::ExitCode {
    match measure() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // The whole cause chain, not only the top error.
            eprintln!("agent_stream_bw: {}", ErrorChain(&*e));
            std::process::ExitCode::FAILURE
        }
    }
}

fn measure() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if args.size == 0 || args.total == 0 || args.rounds == 0 {
        return Err("--size, --total and --rounds must be at least 1".into());
    }
    let (tx, rx) = mpsc::channel();
    let runs = args.rounds * 2;
    let total = args.total;
    let srv = std::thread::spawn(move || {
        server(runs, total, tx).map_err(|e| ErrorChain(&*e).to_string())
    });
    let addr = match rx.recv_timeout(args.timeout) {
        Ok(a) => a,
        Err(mpsc::RecvTimeoutError::Timeout) => {
            let doing = "waiting for it to listen";
            return Err(cli::no_answer("the server thread", args.timeout, doing).into());
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            return Err(srv
                .join()
                .map_err(|_| "server thread panicked")?
                .err()
                .unwrap_or_else(|| "the server thread ended before it listened".into())
                .into());
        }
    };
    let (rt, dev) = soft_runtime()?;
    println!(
        "soft device, loopback: {} bytes per run in {}-byte writes (stream chunk {})",
        args.total, args.size, args.chunk
    );
    println!("round  raw MB/s  stream MB/s  stream/raw");
    let mut ratios = Vec::new();
    for round in 0..args.rounds {
        let order = if round % 2 == 0 {
            [Mode::Raw, Mode::Stream]
        } else {
            [Mode::Stream, Mode::Raw]
        };
        let (mut raw, mut stream) = (0.0, 0.0);
        for mode in order {
            let bw = rt.block_on(run(&dev, addr, mode, &args))?;
            match mode {
                Mode::Raw => raw = bw,
                Mode::Stream => stream = bw,
            }
        }
        let ratio = stream / raw;
        ratios.push(ratio);
        println!(
            "{round:>5}  {:>8.1}  {:>11.1}  {ratio:>10.3}",
            raw / 1e6,
            stream / 1e6
        );
    }
    println!("median stream/raw: {:.3}", median(ratios));
    srv.join().map_err(|_| "server thread panicked")??;
    Ok(())
}
