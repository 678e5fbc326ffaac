//! What the reactor costs per op, measured side by side in one run on the
//! software RDMA device: a bare provider loop (post one signaled RDMA WRITE,
//! then wait for its completion) against the same WRITE awaited as an op
//! through the runtime. Two ways of waiting, each compared like for like:
//! sleeping on the completion channel (raw: arm + `poll(2)` on the channel
//! fd; runtime: default) and busy-polling (raw: spin on `Cq::poll`; runtime:
//! `busy_poll(100 µs)`).
//! It also prints pipelined throughput (many ops in flight, SQ backpressure).
//!
//! Run: `cargo run --release -p verbio-runtime --example reactor_overhead [iterations]`

mod common;

use std::time::{Duration, Instant};

use verbio_runtime::provider::{
    AccessFlags, Completion, Context, InitAttr, Mr, Mtu, QpCaps, RtrAttr, RtsAttr, SendFlags,
    SendOp, SendWr, Sge, SoftConfig,
};
use verbio_runtime::{Completable, Device, QueuePair, Runtime, Submit, SubmitError};

/// Registered memory that Rust code never references (no accessor hands
/// out `_mem`) and that outlives its registration (field order), so the
/// device may read and write it whenever a WR names it.
struct Region {
    mr: Mr,
    _mem: Vec<u8>,
}

fn region(dev: &Device, len: usize) -> Region {
    let mut mem = vec![0u8; len];
    // SAFETY: the memory is owned by `Region`, which drops `mr` first
    // (field order), and lives until the end of the benchmark.
    let mr = unsafe { dev.pd().reg_mr(mem.as_mut_ptr(), len, AccessFlags::ALL) }.expect("reg_mr");
    Region { mr, _mem: mem }
}

/// The op: nothing owned but a copy of the WR's parameters.
struct Write;

impl Completable for Write {
    type Output = Result<Completion, SubmitError>;
    fn complete(self, c: Completion) -> Self::Output {
        Ok(c)
    }
    fn fail(self, e: SubmitError) -> Self::Output {
        Err(e)
    }
}

fn wr(src: &Mr, dst: &Mr, len: u32) -> SendWr {
    let mut wr = SendWr {
        wr_id: 0,
        sg_list: Default::default(),
        op: SendOp::Write {
            remote_addr: dst.addr(),
            rkey: dst.rkey(),
        },
        flags: SendFlags::NONE,
    };
    wr.sg_list.push(Sge {
        addr: src.addr(),
        length: len,
        lkey: src.lkey(),
    });
    wr
}

fn write(qp: &QueuePair, src: &Region, dst: &Region) -> Submit<Write> {
    let w = wr(&src.mr, &dst.mr, 64);
    // SAFETY: the SGE names `src`'s memory, which no Rust reference ever
    // touches (see `Region`); it is not owned by the op, but it stays
    // allocated until `Region` drops, and that deregisters it first, which
    // ends the device's access even if a WR were still outstanding.
    unsafe {
        qp.submit_send(Write, move |_, chain| {
            chain.push(w);
            Ok(())
        })
    }
}

fn connect(a: &QueuePair, b: &QueuePair) {
    for q in [a, b] {
        q.modify_to_init(&InitAttr::default()).expect("init");
    }
    for (x, y) in [(a, b), (b, a)] {
        x.modify_to_rtr(&RtrAttr {
            remote: y.endpoint(0).expect("endpoint"),
            path_mtu: Mtu::Mtu4096,
            min_rnr_timer: 1,
            max_dest_rd_atomic: 16,
            sgid_index: 0,
            hop_limit: 1,
        })
        .expect("rtr");
    }
    for q in [a, b] {
        q.modify_to_rts(&RtsAttr::default()).expect("rts");
    }
}

struct Figures {
    raw: Duration,
    op: Duration,
    pipelined: Duration,
}

fn phase(busy: Duration, iters: u32) -> Figures {
    let rt = Runtime::builder().busy_poll(busy).build().expect("runtime");
    let ctx = Context::open_soft(SoftConfig::default()).expect("soft device");
    let dev = Device::open(ctx).expect("device");
    let caps = QpCaps {
        max_send_wr: 64,
        ..QpCaps::default()
    };
    let a = dev.create_qp(caps).expect("qp");
    let b = dev.create_qp(caps).expect("qp");
    connect(&a, &b);
    let src = region(&dev, 64);
    let dst = region(&dev, 64);

    // Bare provider loop on the same QP and CQ (the runtime is idle).
    let qp = a.provider().expect("provider qp").clone();
    let cq = dev.cq().clone();
    let mut raw_wr = wr(&src.mr, &dst.mr, 64);
    raw_wr.wr_id = verbio_runtime::op::wr_id::UNTRACKED;
    raw_wr.flags = SendFlags::SIGNALED;
    let channel = dev.comp_channel().clone();
    let sleep = busy.is_zero();
    let mut wc = [Completion::EMPTY; 4];
    let t = Instant::now();
    for _ in 0..iters {
        // SAFETY: the SGE names `src` (see `Region`: never referenced,
        // deregistered before freed); each WR completes before the next.
        unsafe { qp.post_send(std::slice::from_ref(&raw_wr)) }.expect("post");
        loop {
            let n = cq.poll(&mut wc).expect("poll");
            if n > 0 {
                assert!(wc[0].status.is_success());
                break;
            }
            if sleep {
                // The same sleep the reactor does, without the reactor:
                // arm, re-check, wait on the channel fd, take the event.
                cq.req_notify(false).expect("req_notify");
                if cq.poll(&mut wc).expect("poll") > 0 {
                    break;
                }
                let mut p = libc::pollfd {
                    fd: channel.fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: `p` is a valid pollfd for the duration of the call.
                unsafe { libc::poll(&mut p, 1, 1000) };
                while let Ok(Some(_)) = channel.get_event() {
                    cq.ack_events(1);
                }
            } else {
                std::hint::spin_loop();
            }
        }
    }
    let raw = t.elapsed() / iters;

    // The same WRITE as an op, awaited one at a time.
    let t = Instant::now();
    rt.block_on(async {
        for _ in 0..iters {
            let c = write(&a, &src, &dst).await.expect("op");
            assert!(c.status.is_success());
        }
    });
    let op = t.elapsed() / iters;

    // Pipelined: all submitted at once, 64 in flight at most.
    let t = Instant::now();
    rt.block_on(async {
        let ops: Vec<_> = (0..iters).map(|_| write(&a, &src, &dst)).collect();
        for r in futures::future::join_all(ops).await {
            assert!(r.expect("op").status.is_success());
        }
    });
    let pipelined = t.elapsed() / iters;
    Figures { raw, op, pipelined }
}

/// The reactor's cost per op against a bare provider loop, on the soft device.
#[derive(clap::Parser)]
struct Cli {
    /// RDMA WRITEs per mode.
    #[arg(default_value_t = 20_000)]
    iterations: u32,
}

fn main() {
    let iters = <Cli as clap::Parser>::parse().iterations;
    common::init_tracing();
    let opened = std::panic::catch_unwind(|| Context::open_soft(SoftConfig::default()));
    if !matches!(opened, Ok(Ok(_))) {
        println!("SKIPPED: the soft RDMA device is not available in this build");
        return;
    }
    println!("{iters} RDMA WRITEs of 64 B per mode, soft device, one thread + engine thread");
    println!(
        "{:<26} {:>12} {:>12} {:>8} {:>16}",
        "mode", "raw loop", "as an op", "op/raw", "pipelined op"
    );
    for (name, busy) in [
        ("sleep on channel", Duration::ZERO),
        ("busy-poll 100 us", Duration::from_micros(100)),
    ] {
        let f = phase(busy, iters);
        println!(
            "{:<26} {:>10.2?} {:>12.2?} {:>7.2}x {:>14.2?}/op",
            name,
            f.raw,
            f.op,
            f.op.as_secs_f64() / f.raw.as_secs_f64(),
            f.pipelined
        );
    }
}
