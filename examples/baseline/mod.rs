//! Request/response loops the RPC examples compare themselves with, side
//! by side in one run: the `Rdma` connection's send/receive over RC (two
//! threads, a software device each unless `device` names one) and kernel
//! TCP over loopback. Each returns the latency of every measured call and
//! the time they took together.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use verbio::runtime::{Device, Runtime};
use verbio::RdmaBuilder;

use crate::cli;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Latencies of `calls` measured calls (after `calls / 10` of warm-up) and
/// the time they took.
pub struct Run {
    /// Each call's round trip.
    pub lat: Vec<Duration>,
    /// All of them together.
    pub elapsed: Duration,
}

fn device(name: Option<&str>) -> Result<Device, BoxError> {
    let ctx =
        cli::open_device_or_soft(name, Ipv4Addr::LOCALHOST.into()).map_err(|e| e.to_string())?;
    Ok(Device::open(ctx).map_err(|e| e.to_string())?)
}

/// `Rdma` send/receive echo of `size`-byte messages, one at a time.
pub fn rdma_loop(calls: usize, size: usize, dev_name: Option<&str>) -> Result<Run, BoxError> {
    let (addr_tx, addr_rx) = mpsc::channel::<SocketAddr>();
    let server_dev = dev_name.map(str::to_owned);
    let server = std::thread::spawn(move || -> Result<(), String> {
        let rt = Runtime::new().map_err(|e| e.to_string())?;
        rt.block_on(async {
            let dev = device(server_dev.as_deref()).map_err(|e| e.to_string())?;
            let l = RdmaBuilder::new()
                .device(dev)
                .listen((Ipv4Addr::LOCALHOST, 0).into())
                .map_err(|e| e.to_string())?;
            addr_tx
                .send(l.local_addr().map_err(|e| e.to_string())?)
                .map_err(|e| e.to_string())?;
            let rdma = l.accept().await.map_err(|e| e.to_string())?;
            // Echo until the client's empty message.
            loop {
                let m = rdma.receive().await.map_err(|e| e.to_string())?;
                if m.is_empty() {
                    return rdma.close().await.map_err(|e| e.to_string());
                }
                rdma.send(&m).await.map_err(|e| e.to_string())?;
            }
        })
    });
    let addr = addr_rx
        .recv()
        .map_err(|_| "the Rdma server failed to start")?;
    let client_dev = dev_name.map(str::to_owned);
    // The client on a thread of its own: the caller's may have a runtime.
    let client = std::thread::spawn(move || rdma_client(addr, calls, size, client_dev));
    let run = client.join().map_err(|_| "the Rdma client panicked")??;
    server.join().map_err(|_| "the Rdma server panicked")??;
    Ok(run)
}

fn rdma_client(
    addr: SocketAddr,
    calls: usize,
    size: usize,
    dev_name: Option<String>,
) -> Result<Run, BoxError> {
    let rt = Runtime::new()?;
    rt.block_on(async {
        let rdma = RdmaBuilder::new()
            .device(device(dev_name.as_deref())?)
            .connect(addr)
            .await?;
        let req = vec![0x5a; size.max(1)];
        let mut lat = Vec::with_capacity(calls);
        let mut t0 = Instant::now();
        for i in 0..calls / 10 + calls {
            if i == calls / 10 {
                t0 = Instant::now();
            }
            let t = Instant::now();
            rdma.send(&req).await?;
            let back = rdma.receive().await?;
            if i >= calls / 10 {
                lat.push(t.elapsed());
            }
            if back.len() != req.len() {
                return Err(format!("echo of {} bytes, sent {}", back.len(), req.len()).into());
            }
        }
        let elapsed = t0.elapsed();
        rdma.send(&[]).await?;
        let _ = rdma.receive().await; // the server closes
        Ok::<_, BoxError>(Run { lat, elapsed })
    })
}

/// Kernel TCP over loopback: a server thread echoing `size`-byte
/// messages, the client one at a time (Nagle off).
pub fn tcp_loop(calls: usize, size: usize) -> Result<Run, BoxError> {
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
    for _ in 0..calls / 10 {
        conn.write_all(&req)?;
        conn.read_exact(&mut resp)?;
    }
    let mut lat = Vec::with_capacity(calls);
    let t0 = Instant::now();
    for _ in 0..calls {
        let t = Instant::now();
        conn.write_all(&req)?;
        conn.read_exact(&mut resp)?;
        lat.push(t.elapsed());
    }
    let elapsed = t0.elapsed();
    drop(conn);
    server.join().map_err(|_| "the TCP server panicked")??;
    Ok(Run { lat, elapsed })
}
