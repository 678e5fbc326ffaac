//! 64 B echo round trips under tokio's multi-thread runtime (2 workers),
//! on one RDMA device: verbio's `Send` handles (`RdmaHandle` messages and
//! the `HandleStream` byte stream, connections on a `Pool` of runtime
//! threads) against rdma-io's `AsyncRdmaStream` (its send/receive
//! transport, as shipped and with 64 B inline sends), in one process and
//! one run; `RdmaHandle` again over a pool hosted on the tokio runtime
//! (`PoolBuilder::host_on_tokio`: the runtimes turned by tokio tasks, no
//! threads of their own); and, for reference, verbio without tokio: a local `Rdma` on a
//! runtime thread of its own (thread-per-core, no thread crossing). Each round runs every contender for `--iters` round trips, in
//! an order rotated per round; printed: median and p99 of each and their
//! ratios to rdma-io's (below 1: verbio is faster).
//!
//! ```text
//! rdma-io-echo --ip 10.77.0.1 [--size 64] [--iters 2000] [--rounds 5] [--warmup 200]
//!     [--only PREFIX] [--pool-threads 1|2] [--busy-poll-us N]
//! ```
//!
//! `--only` keeps the contenders whose name starts with PREFIX (`verbio`,
//! `rdma-io`, or a longer one such as `verbio RdmaHandle, hosted`), e.g.
//! to count one contender's system calls.
//!
//! verbio's pool threads open the device `VERBIO_DEVICE` names (e.g.
//! `rxe0`); rdma-io's RDMA CM binds `--ip` (an address of that device).

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::time::{Duration, Instant};

use futures::io::{AsyncReadExt, AsyncWriteExt};
use rdma_io::async_cm::AsyncCmListener;
use rdma_io::async_stream::AsyncRdmaStream;
use rdma_io::send_recv_transport::{SendRecvConfig, SendRecvTransport};
use rdma_io::transport::TransportBuilder;
use verbio::provider::open_device;
use verbio::runtime::{Placement, Pool};
use verbio::{HandleStream, ListenerHandle, RdmaHandle};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Bound of every setup step and of each round of a contender.
const WAIT: Duration = Duration::from_secs(120);

struct Args {
    ip: std::net::IpAddr,
    size: usize,
    iters: usize,
    rounds: usize,
    warmup: usize,
    /// Only these contenders (`verbio`, `rdma-io`), e.g. to see whether
    /// one side's idle connections slow the other's.
    only: Option<String>,
    /// verbio's pool: runtime threads (1: both ends of each connection on
    /// one thread; 2: the server's end on one, the client's on the other).
    pool_threads: usize,
    /// verbio's pool threads busy-poll this long before sleeping (µs).
    busy_poll_us: u64,
}

fn args() -> Result<Args, BoxError> {
    let mut a = Args {
        ip: "127.0.0.1".parse()?,
        size: 64,
        iters: 2000,
        rounds: 5,
        warmup: 200,
        only: None,
        pool_threads: 2,
        busy_poll_us: 0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--ip" => a.ip = value.parse()?,
            "--size" => a.size = value.parse()?,
            "--iters" => a.iters = value.parse()?,
            "--rounds" => a.rounds = value.parse()?,
            "--warmup" => a.warmup = value.parse()?,
            "--pool-threads" => a.pool_threads = value.parse()?,
            "--busy-poll-us" => a.busy_poll_us = value.parse()?,
            "--only" => a.only = Some(value),
            other => return Err(format!("unknown flag {other}").into()),
        }
    }
    if a.size == 0 || a.iters == 0 || a.rounds == 0 || !(1..=2).contains(&a.pool_threads) {
        return Err(
            "--size, --iters and --rounds must be at least 1, --pool-threads 1 or 2".into(),
        );
    }
    Ok(a)
}

/// A round of the local contender: its round trips, and where its samples
/// go.
type LocalRound = (
    usize,
    tokio::sync::oneshot::Sender<Result<Vec<Duration>, String>>,
);

/// One contender's client side: a round trip of `msg`, checked (the local
/// contender runs whole rounds on its own thread).
enum Client {
    Local(std::sync::mpsc::Sender<LocalRound>),
    Handle(RdmaHandle),
    Stream(Box<HandleStream>, Vec<u8>),
    RdmaIo(Box<AsyncRdmaStream<SendRecvTransport>>, Vec<u8>),
}

impl Client {
    async fn round_trip(&mut self, msg: &[u8]) -> Result<(), BoxError> {
        match self {
            Client::Local(_) => {
                let mut s = self.round(1).await?;
                s.pop().ok_or("no sample")?;
                Ok(())
            }
            Client::Handle(h) => {
                h.send(msg.to_vec()).await?;
                let back = h.receive().await?;
                check(&back, msg)
            }
            Client::Stream(s, buf) => {
                s.write_all(msg).await?;
                s.flush().await?;
                s.read_exact(buf).await?;
                check(buf, msg)
            }
            Client::RdmaIo(s, buf) => {
                s.write_all(msg).await?;
                let mut got = 0;
                while got < buf.len() {
                    let n = s.read(&mut buf[got..]).await?;
                    if n == 0 {
                        return Err("rdma-io stream ended".into());
                    }
                    got += n;
                }
                check(buf, msg)
            }
        }
    }
}

impl Client {
    /// A round of the local contender, timed on its thread.
    async fn round(&self, iters: usize) -> Result<Vec<Duration>, BoxError> {
        let Client::Local(tx) = self else {
            return Err("not the local contender".into());
        };
        let (done, samples) = tokio::sync::oneshot::channel();
        tx.send((iters, done))
            .map_err(|_| "the local contender's thread is gone")?;
        Ok(samples
            .await
            .map_err(|_| "the local contender's thread is gone")??)
    }
}

/// verbio without tokio or handles, for reference: a local `Rdma` client
/// and its echo server on one verbio runtime thread (thread-per-core), the
/// connection's device opened by `VERBIO_DEVICE` as the pool's.
fn local_contender(msg: Vec<u8>) -> Result<Client, BoxError> {
    let (tx, rx) = std::sync::mpsc::channel::<LocalRound>();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(), String>>();
    std::thread::Builder::new()
        .name("verbio-local".into())
        .spawn(move || {
            let run = || -> Result<(), BoxError> {
                let rt = verbio::runtime::Runtime::new()?;
                rt.block_on(async {
                    let listener = verbio::RdmaBuilder::new().listen("127.0.0.1:0".parse()?)?;
                    let addr = listener.local_addr()?;
                    verbio::runtime::spawn(async move {
                        if let Ok(r) = listener.accept().await {
                            while let Ok(m) = r.receive().await {
                                if r.send(&m).await.is_err() {
                                    break;
                                }
                            }
                        }
                    });
                    let c = verbio::RdmaBuilder::new().connect(addr).await?;
                    let _ = ready_tx.send(Ok(()));
                    // Between rounds this thread blocks here: the server
                    // task has nothing in flight then.
                    while let Ok((iters, done)) = rx.recv() {
                        let mut samples = Vec::with_capacity(iters);
                        let mut failed = None;
                        for _ in 0..iters {
                            let t = Instant::now();
                            let r = async {
                                c.send(&msg).await?;
                                let back = c.receive().await?;
                                check(&back, &msg)
                            };
                            if let Err(e) = r.await {
                                failed = Some(e.to_string());
                                break;
                            }
                            samples.push(t.elapsed());
                        }
                        let _ = done.send(failed.map_or(Ok(samples), Err));
                    }
                    Ok::<_, BoxError>(())
                })
            };
            if let Err(e) = run() {
                let _ = ready_tx.send(Err(e.to_string()));
            }
        })?;
    ready_rx
        .recv_timeout(WAIT)
        .map_err(|_| "the local contender did not start in time")??;
    Ok(Client::Local(tx))
}

fn check(back: &[u8], sent: &[u8]) -> Result<(), BoxError> {
    if back != sent {
        return Err(format!("echo came back changed ({} bytes)", back.len()).into());
    }
    Ok(())
}

/// verbio: an echo server on pool thread 0 (its tokio task echoes
/// messages), a client connection on thread 1.
async fn verbio_pair(pool: &Pool, stream: bool) -> Result<Client, BoxError> {
    let any: SocketAddr = "127.0.0.1:0".parse()?;
    let l = ListenerHandle::bind(pool, Placement::Thread(0), any).await?;
    let client_thread = pool.threads().len() - 1;
    let c = RdmaHandle::connect(pool, Placement::Thread(client_thread), l.local_addr());
    let (c, s) = tokio::time::timeout(WAIT, async { tokio::try_join!(c, l.accept()) }).await??;
    tokio::spawn(async move {
        while let Ok(m) = s.receive().await {
            if s.send(m).await.is_err() {
                break;
            }
        }
    });
    Ok(if stream {
        Client::Stream(Box::new(HandleStream::new(c)), Vec::new())
    } else {
        Client::Handle(c)
    })
}

/// rdma-io: an echo server task and a client stream, over RDMA CM on `ip`.
async fn rdma_io_pair(ip: std::net::IpAddr, config: SendRecvConfig) -> Result<Client, BoxError> {
    let listener = AsyncCmListener::bind(&SocketAddr::new(ip, 0))?;
    let addr = listener
        .local_addr()
        .ok_or("rdma-io listener has no address")?;
    let server_config = config.clone();
    let server = tokio::spawn(async move {
        let t = server_config.accept(&listener).await?;
        let mut s = AsyncRdmaStream::new(t);
        let mut buf = vec![0u8; 65536];
        tokio::spawn(async move {
            loop {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if s.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                }
            }
        });
        Ok::<_, rdma_io::Error>(())
    });
    let t = tokio::time::timeout(WAIT, config.connect(&addr)).await??;
    tokio::time::timeout(WAIT, server).await???;
    Ok(Client::RdmaIo(
        Box::new(AsyncRdmaStream::new(t)),
        Vec::new(),
    ))
}

type Setup<'a> = Pin<Box<dyn Future<Output = Result<Client, BoxError>> + 'a>>;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), BoxError> {
    let a = args()?;
    let pool = Pool::builder()
        .threads(a.pool_threads)
        .runtime(
            verbio::runtime::Runtime::builder().busy_poll(Duration::from_micros(a.busy_poll_us)),
        )
        .device_per_thread(|_| open_device(None))
        .build()?;
    // The same pool's runtimes hosted on this tokio runtime (turned by
    // tokio tasks on its workers, no threads of their own).
    let hosted = Pool::builder()
        .threads(a.pool_threads)
        .device_per_thread(|_| open_device(None))
        .host_on_tokio(tokio::runtime::Handle::current())
        .build()?;
    let inline = SendRecvConfig {
        max_inline_data: 64,
        ..SendRecvConfig::stream()
    };
    let msg: Vec<u8> = (0..a.size).map(|i| (i * 7 + 3) as u8).collect();
    let names = [
        "verbio Rdma, own runtime thread (no tokio)",
        "verbio RdmaHandle (messages)",
        "verbio HandleStream (bytes)",
        "verbio RdmaHandle, hosted on tokio",
        "rdma-io AsyncRdmaStream (stream config)",
        "rdma-io AsyncRdmaStream (64 B inline)",
    ];
    let local_msg = msg.clone();
    let setups: Vec<Setup<'_>> = vec![
        Box::pin(async move { local_contender(local_msg) }),
        Box::pin(verbio_pair(&pool, false)),
        Box::pin(verbio_pair(&pool, true)),
        Box::pin(verbio_pair(&hosted, false)),
        Box::pin(rdma_io_pair(a.ip, SendRecvConfig::stream())),
        Box::pin(rdma_io_pair(a.ip, inline)),
    ];
    let wanted = |name: &str| match &a.only {
        None => true,
        Some(lib) => name.starts_with(lib.as_str()),
    };
    let mut clients = Vec::new();
    let mut kept = Vec::new();
    for (name, setup) in names.iter().zip(setups) {
        if !wanted(name) {
            continue;
        }
        kept.push(*name);
        let mut c = setup.await.map_err(|e| format!("{name}: setup: {e}"))?;
        match &mut c {
            Client::Stream(_, buf) | Client::RdmaIo(_, buf) => *buf = vec![0; a.size],
            Client::Handle(_) | Client::Local(_) => {}
        }
        clients.push(c);
    }
    let names = kept;
    for (name, c) in names.iter().zip(&mut clients) {
        for _ in 0..a.warmup {
            c.round_trip(&msg)
                .await
                .map_err(|e| format!("{name}: warm-up: {e} ({e:?})"))?;
        }
    }
    let mut samples: Vec<Vec<Duration>> = vec![Vec::with_capacity(a.iters * a.rounds); names.len()];
    for round in 0..a.rounds {
        for k in 0..clients.len() {
            let i = (k + round) % clients.len();
            let c = &mut clients[i];
            let run = async {
                if let Client::Local(_) = c {
                    samples[i].extend(c.round(a.iters).await?);
                    return Ok(());
                }
                for _ in 0..a.iters {
                    let t = Instant::now();
                    c.round_trip(&msg).await?;
                    samples[i].push(t.elapsed());
                }
                Ok::<_, BoxError>(())
            };
            tokio::time::timeout(WAIT, run)
                .await
                .map_err(|_| format!("{}: round {round} took over {WAIT:?}", names[i]))?
                .map_err(|e| format!("{}: round {round}: {e} ({e:?})", names[i]))?;
        }
    }
    println!(
        "{} B echo, tokio multi-thread (2 workers), {} rounds of {} round trips each; \
         verbio pool: {} thread(s), busy-poll {} µs",
        a.size, a.rounds, a.iters, a.pool_threads, a.busy_poll_us
    );
    println!(
        "{:<42} {:>10} {:>10} {:>10} {:>14} {:>14}",
        "contender", "median µs", "p99 µs", "mean µs", "median/rdma-io", "p99/rdma-io"
    );
    let stats: Vec<(Duration, Duration, Duration)> = samples
        .iter_mut()
        .map(|s| {
            s.sort_unstable();
            let mean = s.iter().sum::<Duration>() / s.len() as u32;
            (percentile(s, 0.5), percentile(s, 0.99), mean)
        })
        .collect();
    // The reference: rdma-io as shipped (its stream config), else the
    // first contender.
    let r = names
        .iter()
        .position(|n| n.starts_with("rdma-io"))
        .unwrap_or(0);
    let (ref_med, ref_p99, _) = stats[r];
    for (name, (med, p99, mean)) in names.iter().zip(&stats) {
        println!(
            "{:<42} {:>10.1} {:>10.1} {:>10.1} {:>13.2}× {:>13.2}×",
            name,
            us(*med),
            us(*p99),
            us(*mean),
            us(*med) / us(ref_med),
            us(*p99) / us(ref_p99)
        );
    }
    drop(clients);
    Ok(())
}
