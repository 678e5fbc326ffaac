//! Connection set-up cost, side by side in one run: `conns` RC connections
//! made and torn down one after another (a) by the connection manager
//! (`cm::connect` against a `CmListener`, then `disconnect`, which waits
//! until both sides are down) and (b) by the TCP endpoint handshake
//! (`verbio::connect` against a `Listener`, then the QP closed and dropped),
//! both sides as tasks of one runtime. Rounds alternate which runs first;
//! it prints each round's connections per second and the median ratio.
//!
//! Run: `cargo run --release --example cm_setup -- [conns] [rounds]
//! [--timeout SECONDS]` (the software device unless `VERBIO_DEVICE` names
//! another; an ibverbs device needs `VERBIO_CM_IP`, its interface's
//! address, for the CM). `--timeout` bounds each handshake, accept and
//! disconnect (10 s unless given).

mod cli;

use std::error::Error;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use verbio::ops::connect::{connect, DeviceQps, Listener, QpConfig};
use verbio::provider::open_device;
use verbio::runtime::cm::{self, CmListener, CmOptions};
use verbio::runtime::{spawn, Device, Runtime};

type Res<T> = Result<T, Box<dyn Error>>;

/// The bound of each wait unless `--timeout` says otherwise.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

const USAGE: &str = "usage: cm_setup [CONNS (200)] [ROUNDS (5)] [--timeout SECONDS]
  --timeout SECONDS  bound of each handshake, accept and disconnect (default 10)";

/// `what` bounded by `limit`; on expiry fails saying what it waited for.
async fn within<T>(
    limit: Duration,
    peer: &str,
    doing: &str,
    what: impl std::future::Future<Output = T>,
) -> Res<T> {
    verbio::runtime::timeout(limit, what)
        .await
        .map_err(|_| cli::no_answer(peer, limit, doing).into())
}

/// Connections per second through the connection manager.
async fn cm_rate(dev: &Device, ip: IpAddr, conns: usize, limit: Duration) -> Res<f64> {
    let opts = CmOptions::default();
    let listener = CmListener::bind(dev, SocketAddr::new(ip, 0), &opts)?;
    let addr = listener.local_addr().ok_or("listener address")?;
    let server = spawn(async move {
        for _ in 0..conns {
            let conn = within(limit, "the CM client", "accepting", listener.accept(&[])).await??;
            let gone = conn.disconnected();
            within(limit, "the CM client", "waiting for its disconnect", gone).await?;
        }
        Ok::<_, Box<dyn Error>>(())
    });
    let t0 = Instant::now();
    let peer = format!("the CM listener at {addr}");
    for _ in 0..conns {
        let conn = within(
            limit,
            &peer,
            "connecting",
            cm::connect(dev, addr, &opts, &[]),
        )
        .await??;
        within(limit, &peer, "disconnecting", conn.disconnect()).await??;
    }
    let secs = t0.elapsed().as_secs_f64();
    server.await?;
    Ok(conns as f64 / secs)
}

/// Connections per second through the TCP endpoint handshake.
async fn tcp_rate(dev: &Device, conns: usize, limit: Duration) -> Res<f64> {
    let qps = DeviceQps::new(dev.clone(), QpConfig::default());
    let listener = Listener::bind(
        SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
        qps.clone(),
        limit,
    )?;
    let addr = listener.local_addr()?;
    let server = spawn(async move {
        for _ in 0..conns {
            let c = within(limit, "the TCP client", "accepting", listener.accept()).await??;
            let _ = c.qp.close().await;
        }
        Ok::<_, Box<dyn Error>>(())
    });
    let t0 = Instant::now();
    for _ in 0..conns {
        let c = connect(addr, &qps, limit).await?;
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

/// `[conns] [rounds]` and `--timeout SECONDS` (anywhere), or `None` for
/// `--help`.
fn parse_args() -> Res<Option<(usize, usize, Duration)>> {
    let mut positional = Vec::new();
    let mut limit = DEFAULT_TIMEOUT;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "-h" | "--help" => return Ok(None),
            "--timeout" => {
                let v = args.next().ok_or("--timeout needs SECONDS")?;
                limit = cli::seconds(&v).map_err(|e| format!("--timeout {v}: {e}"))?;
            }
            _ if a.starts_with('-') => return Err(format!("unknown flag {a}\n{USAGE}").into()),
            _ => positional.push(a),
        }
    }
    if positional.len() > 2 {
        return Err(format!("too many arguments\n{USAGE}").into());
    }
    let mut positional = positional.into_iter();
    let conns: usize = positional.next().map_or(Ok(200), |s| s.parse())?;
    let rounds: usize = positional.next().map_or(Ok(5), |s| s.parse())?;
    Ok(Some((conns, rounds, limit)))
}

fn run() -> Res<()> {
    let Some((conns, rounds, limit)) = parse_args()? else {
        println!("{USAGE}");
        return Ok(());
    };
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
        cm_rate(&dev, ip, 1, limit).await?;
        tcp_rate(&dev, 1, limit).await?;
        for r in 0..rounds {
            let (c, t) = if r % 2 == 0 {
                let c = cm_rate(&dev, ip, conns, limit).await?;
                (c, tcp_rate(&dev, conns, limit).await?)
            } else {
                let t = tcp_rate(&dev, conns, limit).await?;
                (cm_rate(&dev, ip, conns, limit).await?, t)
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
