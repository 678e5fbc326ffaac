//! rpc_echo's figures and its baselines: a plain TCP request/response loop,
//! RC SEND/RECV ping-pong on the same device kind, and the `Rdma`
//! connection's send/receive.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use verbio::ops::connect::{connect, DeviceQps, Listener, QpConfig};
use verbio::ops::verbs::Verbs;
use verbio::runtime::buf::MrPool;
use verbio::runtime::{timeout, Device, QueuePair, Runtime};
use verbio::ErrorChain;
use verbio::RdmaBuilder;

/// The examples' boxed error.
pub type BoxError = Box<dyn std::error::Error>;

const HANDSHAKE: Duration = Duration::from_secs(10);
const LIMIT: Duration = Duration::from_secs(120);

/// Rate and latency percentiles of a run.
pub struct Figures {
    pub rate: f64,
    pub p50: Duration,
    pub p99: Duration,
}

impl Figures {
    /// From the calls' latencies and the run's duration.
    pub fn new(mut lat: Vec<Duration>, elapsed: Duration) -> Figures {
        lat.sort_unstable();
        let at = |q: f64| lat[((lat.len() - 1) as f64 * q) as usize];
        Figures {
            rate: lat.len() as f64 / elapsed.as_secs_f64(),
            p50: at(0.50),
            p99: at(0.99),
        }
    }

    /// One line: rate, p50, p99.
    pub fn print(&self, what: &str) {
        println!(
            "{what:<28} {:>10.0} calls/s   p50 {:>8.1} µs   p99 {:>8.1} µs",
            self.rate,
            self.p50.as_secs_f64() * 1e6,
            self.p99.as_secs_f64() * 1e6
        );
    }

    /// Ratios of `self` to `base`: rate, p50 and p99 latency.
    pub fn print_ratio(&self, what: &str, base: &Figures) {
        println!(
            "{what:<36} rate {:>5.2}x   p50 latency {:>5.2}x   p99 latency {:>5.2}x",
            self.rate / base.rate,
            self.p50.as_secs_f64() / base.p50.as_secs_f64(),
            self.p99.as_secs_f64() / base.p99.as_secs_f64()
        );
    }
}

/// The round trips of a baseline loop: `calls / 10` of warm-up, then
/// `calls` measured.
struct Laps {
    warm_up: usize,
    calls: usize,
    done: usize,
    lat: Vec<Duration>,
    t0: Instant,
}

impl Laps {
    fn new(calls: usize) -> Laps {
        Laps {
            warm_up: calls / 10,
            calls,
            done: 0,
            lat: Vec::with_capacity(calls),
            t0: Instant::now(),
        }
    }

    /// Round trips to run, warm-up included.
    fn total(&self) -> usize {
        self.warm_up + self.calls
    }

    /// One round trip, begun at `started`, is done.
    fn lap(&mut self, started: Instant) {
        if self.done == self.warm_up {
            self.t0 = started;
        }
        if self.done >= self.warm_up {
            self.lat.push(started.elapsed());
        }
        self.done += 1;
    }

    fn figures(self) -> Figures {
        Figures::new(self.lat, self.t0.elapsed())
    }
}

/// TCP request/response on loopback: a server thread echoing `size`-byte
/// messages, the client one at a time.
pub fn tcp_loop(calls: usize, size: usize) -> Result<Figures, BoxError> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    let at = listener.local_addr()?;
    let server = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut conn, _) = listener.accept()?;
        conn.set_nodelay(true)?;
        let mut buf = vec![0u8; size];
        while conn.read_exact(&mut buf).is_ok() {
            conn.write_all(&buf)?;
        }
        Ok(())
    });
    let mut conn = TcpStream::connect(at)?;
    conn.set_nodelay(true)?;
    let req = vec![0x5a; size];
    let mut resp = vec![0u8; size];
    let mut laps = Laps::new(calls);
    for _ in 0..laps.total() {
        let t = Instant::now();
        conn.write_all(&req)?;
        conn.read_exact(&mut resp)?;
        laps.lap(t);
    }
    let f = laps.figures();
    drop(conn);
    server.join().map_err(|_| "TCP server panicked")??;
    Ok(f)
}

/// Echoes every message back until an empty one arrives.
async fn rc_echo(qp: &QueuePair, pool: &MrPool, size: usize) -> Result<(), BoxError> {
    let mut next = qp.recv(pool.alloc(size.max(1))?);
    loop {
        let (res, buf) = next.await;
        if res?.len == 0 {
            return Ok(());
        }
        next = qp.recv(pool.alloc(size.max(1))?);
        let (res, _) = qp.send(buf).await;
        res?;
    }
}

fn open(device: Option<&str>) -> Result<Device, BoxError> {
    Ok(Device::open(crate::cli::open_device_or_soft(
        device,
        Ipv4Addr::LOCALHOST.into(),
    )?)?)
}

/// RC SEND/RECV ping-pong: a server thread with its own runtime and device
/// echoing, the client one message at a time.
pub fn rc_loop(device: Option<&str>, calls: usize, size: usize) -> Result<Figures, BoxError> {
    let (tx, rx) = mpsc::channel::<SocketAddr>();
    let server_device = device.map(str::to_owned);
    let server = std::thread::spawn(move || -> Result<(), String> {
        let run = || -> Result<(), BoxError> {
            let rt = Runtime::new()?;
            let dev = open(server_device.as_deref())?;
            let qps = DeviceQps::new(dev.clone(), QpConfig::default());
            let listener = Listener::bind((Ipv4Addr::LOCALHOST, 0).into(), qps, HANDSHAKE)?;
            tx.send(listener.local_addr()?)?;
            let pool = MrPool::new(dev.pd());
            rt.block_on(async {
                let qp = listener.accept().await?.qp;
                timeout(LIMIT, rc_echo(&qp, &pool, size)).await??;
                let _ = qp.close().await;
                Ok(())
            })
        };
        run().map_err(|e| ErrorChain(&*e).to_string())
    });
    let at = rx.recv_timeout(LIMIT)?;
    let rt = Runtime::new()?;
    let dev = open(device)?;
    let pool = MrPool::new(dev.pd());
    let figures = rt.block_on(timeout(LIMIT, async {
        let qps = DeviceQps::new(dev.clone(), QpConfig::default());
        let qp = connect(at, &qps, HANDSHAKE).await?.qp;
        let mut msg = pool.alloc_from(&vec![0x5a; size.max(1)])?;
        let mut laps = Laps::new(calls);
        for _ in 0..laps.total() {
            let t = Instant::now();
            let reply = qp.recv(pool.alloc(size.max(1))?);
            let (res, m) = qp.send(msg).await;
            res?;
            let (res, _) = reply.await;
            res?;
            msg = m;
            laps.lap(t);
        }
        let f = laps.figures();
        let (res, _) = qp.send(pool.alloc(0)?).await;
        res?;
        let _ = qp.close().await;
        Ok::<_, BoxError>(f)
    }))??;
    server.join().map_err(|_| "RC server panicked")??;
    Ok(figures)
}

/// The `Rdma` connection's send/receive echo: a server thread with its own
/// runtime and device, the client one message at a time.
pub fn rdma_loop(device: Option<&str>, calls: usize, size: usize) -> Result<Figures, BoxError> {
    let (tx, rx) = mpsc::channel::<SocketAddr>();
    let server_device = device.map(str::to_owned);
    let server = std::thread::spawn(move || -> Result<(), String> {
        let run = || -> Result<(), BoxError> {
            let rt = Runtime::new()?;
            rt.block_on(async {
                let l = RdmaBuilder::new()
                    .device(open(server_device.as_deref())?)
                    .listen((Ipv4Addr::LOCALHOST, 0).into())?;
                tx.send(l.local_addr()?)?;
                let rdma = l.accept().await?;
                // Echo until the client's empty message.
                loop {
                    let m = timeout(LIMIT, rdma.receive()).await??;
                    if m.is_empty() {
                        return Ok(rdma.close().await?);
                    }
                    rdma.send(&m).await?;
                }
            })
        };
        run().map_err(|e| ErrorChain(&*e).to_string())
    });
    let at = rx.recv_timeout(LIMIT)?;
    let rt = Runtime::new()?;
    let f = rt.block_on(async {
        let rdma = RdmaBuilder::new().device(open(device)?).connect(at).await?;
        let req = vec![0x5a; size.max(1)];
        let mut laps = Laps::new(calls);
        for _ in 0..laps.total() {
            let t = Instant::now();
            rdma.send(&req).await?;
            let back = timeout(LIMIT, rdma.receive()).await??;
            laps.lap(t);
            if back.len() != req.len() {
                return Err(format!("echo of {} bytes, sent {}", back.len(), req.len()).into());
            }
        }
        let f = laps.figures();
        rdma.send(&[]).await?;
        let _ = rdma.receive().await; // the server closes
        Ok::<_, BoxError>(f)
    })?;
    drop(rt);
    server.join().map_err(|_| "the Rdma server panicked")??;
    Ok(f)
}
