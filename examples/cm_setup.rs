//! Connection set-up cost, side by side in one run: `conns` RC connections
//! made and torn down one after another (a) by the connection manager
//! (`cm::connect` against a `CmListener`, then `disconnect`, which waits
//! until both sides are down) and (b) by the TCP endpoint handshake
//! (`verbio::connect` against a `Listener`, then the QP closed and dropped),
//! both sides as tasks of one runtime. Rounds alternate which runs first;
//! it prints each round's connections per second and the median ratio.
//!
//! Run: `cargo run --release --example cm_setup -- [conns] [rounds]` (the
//! software device unless `VERBIO_DEVICE` names another; an ibverbs device
//! needs `VERBIO_CM_IP`, its interface's address, for the CM).

use std::error::Error;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use verbio::ops::connect::{connect, DeviceQps, Listener, QpConfig};
use verbio::provider::open_device;
use verbio::runtime::cm::{self, CmListener, CmOptions};
use verbio::runtime::{spawn, Device, Runtime};

type Res<T> = Result<T, Box<dyn Error>>;

const HANDSHAKE: Duration = Duration::from_secs(10);

/// Connections per second through the connection manager.
async fn cm_rate(dev: &Device, ip: IpAddr, conns: usize) -> Res<f64> {
    let opts = CmOptions::default();
    let listener = CmListener::bind(dev, SocketAddr::new(ip, 0), &opts)?;
    let addr = listener.local_addr().ok_or("listener address")?;
    let server = spawn(async move {
        for _ in 0..conns {
            let conn = listener.accept(&[]).await?;
            conn.disconnected().await;
        }
        Ok::<_, cm::CmError>(())
    });
    let t0 = Instant::now();
    for _ in 0..conns {
        let conn = cm::connect(dev, addr, &opts, &[]).await?;
        conn.disconnect().await?;
    }
    let secs = t0.elapsed().as_secs_f64();
    server.await?;
    Ok(conns as f64 / secs)
}

/// Connections per second through the TCP endpoint handshake.
async fn tcp_rate(dev: &Device, conns: usize) -> Res<f64> {
    let qps = DeviceQps::new(dev.clone(), QpConfig::default());
    let listener = Listener::bind(
        SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
        qps.clone(),
        HANDSHAKE,
    )?;
    let addr = listener.local_addr()?;
    let server = spawn(async move {
        for _ in 0..conns {
            let c = listener.accept().await?;
            let _ = c.qp.close().await;
        }
        Ok::<_, verbio::ops::connect::HandshakeError>(())
    });
    let t0 = Instant::now();
    for _ in 0..conns {
        let c = connect(addr, &qps, HANDSHAKE).await?;
        let _ = c.qp.close().await;
    }
    let secs = t0.elapsed().as_secs_f64();
    server.await?;
    Ok(conns as f64 / secs)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // The whole cause chain, not only the top error.
            eprintln!("cm_setup: {}", verbio::ErrorChain(&*e));
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Res<()> {
    let mut args = std::env::args().skip(1);
    let conns: usize = args.next().map_or(Ok(200), |s| s.parse())?;
    let rounds: usize = args.next().map_or(Ok(5), |s| s.parse())?;
    let rt = Runtime::new()?;
    let ctx = open_device(None)?;
    let ip = match std::env::var("VERBIO_CM_IP") {
        Ok(v) => v.trim().parse()?,
        Err(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
    };
    println!("device {}, {conns} connections per run", ctx.name());
    let dev = Device::open(ctx)?;
    let mut ratios = Vec::new();
    rt.block_on(async {
        // One warm-up connection each.
        cm_rate(&dev, ip, 1).await?;
        tcp_rate(&dev, 1).await?;
        for r in 0..rounds {
            let (c, t) = if r % 2 == 0 {
                let c = cm_rate(&dev, ip, conns).await?;
                (c, tcp_rate(&dev, conns).await?)
            } else {
                let t = tcp_rate(&dev, conns).await?;
                (cm_rate(&dev, ip, conns).await?, t)
            };
            println!(
                "round {r}: CM {c:.0} conn/s, TCP handshake {t:.0} conn/s, ratio CM/TCP {:.2}",
                c / t
            );
            ratios.push(c / t);
        }
        Ok::<_, Box<dyn Error>>(())
    })?;
    println!(
        "median ratio CM/TCP (connections per second): {:.2}",
        median(ratios)
    );
    Ok(())
}
