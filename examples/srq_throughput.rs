//! `srq_throughput`: message throughput of many RC connections received
//! through a shared receive queue (one `RecvRing::on_srq` for all) against
//! a receive ring per QP, side by side in one run, on one device
//! (loopback: the software device by default, `-d rxe0` in the VM).
//!
//! `--conns` sender QPs each send `--msgs` SENDs of `--size` bytes, one at
//! a time (each its own task), to a receiver QP; one task receives every
//! message: from the rings of all receiver QPs (merged), or from the one
//! ring on the SRQ they share. Each round runs both setups (alternating
//! which goes first); the medians and their ratio (SRQ / per-QP rings)
//! are printed, with the receive memory of each. `--timeout` bounds each
//! run.
//!
//! ```text
//! cargo run --release --example srq_throughput -- --conns 64
//! ```

mod cli;

use std::error::Error;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use futures::StreamExt;

use verbio::ops::connect::{DeviceQps, QpConfig, QpFactory};
use verbio::ops::verbs::Verbs;
use verbio::provider::{open_device, InitAttr, QpCaps};
use verbio::runtime::buf::MrPool;
use verbio::runtime::{spawn, Device, QueuePair, RecvRing, RecvRingConfig, Runtime};

/// Throughput of many connections: SRQ vs a receive ring per QP.
#[derive(Parser)]
struct Args {
    /// RDMA device; default: `VERBIO_DEVICE`, else the first ibverbs
    /// device, else the software device.
    #[arg(short = 'd', long = "ib-dev")]
    device: Option<String>,
    /// Connections.
    #[arg(long, default_value_t = 64)]
    conns: u32,
    /// Messages per connection per run.
    #[arg(long, default_value_t = 500)]
    msgs: u32,
    /// Message size in bytes.
    #[arg(long, default_value_t = 64)]
    size: usize,
    /// Buffers of each per-QP ring.
    #[arg(long, default_value_t = 16)]
    depth: u32,
    /// Buffers of the SRQ ring (default: a quarter of all per-QP buffers).
    #[arg(long)]
    srq_depth: Option<u32>,
    /// Rounds (each runs both setups).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Bound of each run (one setup of one round), in seconds: a lost
    /// message or completion ends the run saying so (120 s unless given).
    #[arg(long, default_value = "120", value_parser = cli::seconds)]
    timeout: Duration,
}

/// One setup's result.
struct Run {
    msgs_per_sec: f64,
    memory: usize,
}

/// Connects `conns` senders to receivers made by `receiver`; sends and
/// receives every message; returns the rate.
async fn run_once(dev: &Device, args: &Args, srq: bool) -> Result<Run, Box<dyn Error>> {
    let caps = QpCaps {
        max_send_wr: 4,
        max_recv_wr: args.depth,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    let factory = DeviceQps::new(
        dev.clone(),
        QpConfig {
            caps,
            ..QpConfig::default()
        },
    );
    let gid = dev.context().default_gid_index(1)?;
    let srq_depth = args
        .srq_depth
        .unwrap_or((args.conns * args.depth / 4).max(1));
    let shared = if srq {
        Some(dev.create_srq(srq_depth)?)
    } else {
        None
    };
    let mut senders: Vec<QueuePair> = Vec::new();
    let mut rings: Vec<RecvRing> = Vec::new();
    let mut receivers = Vec::new();
    for _ in 0..args.conns {
        let (s, es) = factory.create()?;
        let r = match &shared {
            Some(q) => dev.create_qp_on_srq(q, caps)?,
            None => dev.create_qp(caps)?,
        };
        r.modify_to_init(&InitAttr::default())?;
        if shared.is_none() {
            rings.push(r.recv_ring(dev.pd(), args.depth, args.size)?);
        }
        let er = r.endpoint(gid)?;
        factory.connect(&s, &es, &er)?;
        factory.connect(&r, &er, &es)?;
        senders.push(s);
        receivers.push(r);
    }
    if let Some(q) = &shared {
        rings.push(RecvRing::on_srq(
            q,
            dev.pd(),
            RecvRingConfig::new(srq_depth, args.size),
        )?);
    }
    let memory = rings.iter().map(RecvRing::memory_len).sum();
    let total = u64::from(args.conns) * u64::from(args.msgs);
    let pool = MrPool::new(dev.pd());
    let start = Instant::now();
    let mut tasks = Vec::new();
    for s in &senders {
        let s = s.clone();
        let mut buf = pool.alloc_from(&vec![7u8; args.size])?;
        let msgs = args.msgs;
        tasks.push(spawn(async move {
            for _ in 0..msgs {
                let (res, b) = s.send(buf).await;
                buf = b;
                res?;
            }
            Ok::<(), verbio::ops::Error>(())
        }));
    }
    let mut all = futures::stream::select_all(rings);
    let mut got = 0u64;
    while got < total {
        match all.next().await {
            Some(Ok(m)) => {
                if m.len() != args.size {
                    return Err(format!("message of {} bytes", m.len()).into());
                }
                got += 1;
            }
            Some(Err(e)) => return Err(e.into()),
            None => return Err("a receive ring ended".into()),
        }
    }
    let secs = start.elapsed().as_secs_f64();
    for t in tasks {
        t.await?;
    }
    drop(all);
    for q in senders.iter().chain(&receivers) {
        q.close().await?;
    }
    Ok(Run {
        msgs_per_sec: total as f64 / secs,
        memory,
    })
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn run(args: &Args) -> Result<(), Box<dyn Error>> {
    let ctx = open_device(args.device.as_deref())?;
    println!(
        "srq_throughput: {} connections x {} messages of {} B on {} ({}), {} round(s)",
        args.conns,
        args.msgs,
        args.size,
        ctx.name(),
        ctx.kind(),
        args.rounds
    );
    let rt = Runtime::builder().busy_poll(Duration::ZERO).build()?;
    let cqe = args.conns * (args.depth + 8) + 1024;
    let dev = Device::with_cq_size(ctx, cqe)?;
    let (mut own, mut srq) = (Vec::new(), Vec::new());
    let (mut own_mem, mut srq_mem) = (0, 0);
    rt.block_on(async {
        for round in 0..args.rounds {
            let order = if round % 2 == 0 {
                [false, true]
            } else {
                [true, false]
            };
            for shared in order {
                let setup = if shared { "SRQ ring" } else { "per-QP rings" };
                let r = verbio::runtime::timeout(args.timeout, run_once(&dev, args, shared))
                    .await
                    .map_err(|_| {
                        let doing = format!("moving round {round}'s messages ({setup})");
                        cli::no_answer("the device", args.timeout, &doing)
                    })??;
                println!(
                    "  round {round}: {:<15} {:>10.0} msg/s",
                    if shared { "SRQ ring" } else { "per-QP rings" },
                    r.msgs_per_sec
                );
                if shared {
                    srq.push(r.msgs_per_sec);
                    srq_mem = r.memory;
                } else {
                    own.push(r.msgs_per_sec);
                    own_mem = r.memory;
                }
            }
        }
        Ok::<(), Box<dyn Error>>(())
    })?;
    let (o, s) = (median(&mut own), median(&mut srq));
    println!(
        "per-QP rings: {o:.0} msg/s (median), receive memory {} KiB",
        own_mem / 1024
    );
    println!(
        "SRQ ring:     {s:.0} msg/s (median), receive memory {} KiB",
        srq_mem / 1024
    );
    println!("ratio SRQ / per-QP rings: {:.2}", s / o);
    Ok(())
}

fn main() -> ExitCode {
    cli::init_tracing();
    match run(&Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("srq_throughput: {}", verbio::runtime::ErrorChain(&*e));
            ExitCode::FAILURE
        }
    }
}
