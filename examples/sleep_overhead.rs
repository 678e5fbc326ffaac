//! What the reactor's sleep/wake cycle costs, side by side in one run on the
//! software RDMA device: `depth` RDMA WRITEs kept in flight
//! (a) by a raw loop that sleeps like `ibv_get_cq_event` (poll the CQ; if
//! empty arm it, poll again, block in `poll(2)` on the completion channel
//! fd, take the events, acknowledge them in batches), and (b) by one future
//! on the runtime in its default mode (it sleeps in epoll on the same fd),
//! holding `depth` bare `submit_send` ops in a fixed array (no `join_all`,
//! no buffer pool: little besides the op path and the reactor loop); the
//! `+timeout` rows wrap each op in a one-hour `timeout` (a live timer per
//! op: what the reactor's timer checks and clock reads cost).
//!
//! It prints ops/s of both and their ratio, application-thread CPU per op
//! (`CLOCK_THREAD_CPUTIME_ID`) and the difference, and how many times each
//! loop blocked per op (voluntary context switches). A second table measures a cross-thread wake:
//! another thread wakes a task of the sleeping runtime (ping-pong through a
//! `std::sync::mpsc` and a `Waker`), against the same ping-pong between two
//! threads blocked in `read(2)` on eventfds. A third, a one-byte TCP
//! ping-pong on loopback with a thread in blocking socket calls: the
//! runtime's `TcpStream` against a blocking `std` one.
//!
//! Run: `cargo run --release --example sleep_overhead -- [ops-per-round] [rounds] [depths] [both|raw|op|xwake|tcp]`
//! (`raw` / `op`: only that loop, for `strace -c` or
//! `valgrind --tool=callgrind --toggle-collect='*sleep_run*'`).

mod cli;

use cli::thread_cpu;
use std::future::Future;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::pin::Pin;
use std::sync::{mpsc, Arc, Mutex};
use std::task::{Context as TaskContext, Poll, Waker};
use std::time::{Duration, Instant};

use verbio::ops::connect::{DeviceQps, QpConfig};
use verbio::provider::{
    AccessFlags, Completion, Context, Mr, QpCaps, SendFlags, SendOp, SendWr, Sge, SoftConfig,
};
use verbio::runtime::op::wr_id;
use verbio::runtime::{Completable, Device, QueuePair, Runtime, Submit, SubmitError};

const MSG: u32 = 64;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

#[derive(Clone, Copy)]
struct Sample {
    ops_per_s: f64,
    cpu_ns: f64,
}

fn measure(ops: usize, f: impl FnOnce()) -> Sample {
    let c0 = thread_cpu();
    let t0 = Instant::now();
    f();
    let wall = t0.elapsed();
    let cpu = thread_cpu() - c0;
    Sample {
        ops_per_s: ops as f64 / wall.as_secs_f64(),
        cpu_ns: cpu.as_nanos() as f64 / ops as f64,
    }
}

/// Registered memory no Rust reference ever touches (no accessor hands out
/// `_mem`), freed only after its registration (field order).
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

fn write_wr(src: &Mr, dst: &Mr) -> SendWr {
    let mut wr = SendWr {
        wr_id: wr_id::UNTRACKED,
        sg_list: Default::default(),
        op: SendOp::Write {
            remote_addr: dst.addr(),
            rkey: dst.rkey(),
        },
        flags: SendFlags::SIGNALED,
    };
    wr.sg_list.push(Sge {
        addr: src.addr(),
        length: MSG,
        lkey: src.lkey(),
    });
    wr
}

/// The op: nothing owned but the WR's parameters.
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

fn submit(qp: &QueuePair, wr: &SendWr) -> Submit<Write> {
    let wr = wr.clone();
    // SAFETY: the SGE names a `Region`'s memory, which no Rust reference
    // touches; it stays allocated until the `Region` drops, which
    // deregisters it first, ending the device's access.
    unsafe {
        qp.submit_send(Write, move |_, chain| {
            chain.push(wr);
            Ok(())
        })
    }
}

/// Voluntary context switches of the calling thread (each time it blocked).
fn thread_sleeps() -> u64 {
    // SAFETY: an all-zero rusage is a valid out-value.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer; RUSAGE_THREAD exists on Linux.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) };
    assert_eq!(rc, 0, "getrusage");
    ru.ru_nvcsw as u64
}

/// (a) The raw loop: `depth` WRs in flight, sleeping on the channel fd.
#[inline(never)]
fn sleep_run_raw(dev: &Device, qp: &QueuePair, wr: &SendWr, depth: usize, ops: usize) {
    let qp = qp.provider().expect("provider QP");
    let cq = dev.cq();
    let channel = dev.comp_channel();
    let wrs = std::slice::from_ref(wr);
    // SAFETY: the SGE names a `Region` (never referenced by Rust code,
    // deregistered before it is freed); every WR completes before return.
    let post = || unsafe { qp.post_send(wrs) }.expect("post");
    let mut wc = [Completion::EMPTY; 32];
    let (mut posted, mut done, mut unacked) = (0usize, 0usize, 0u32);
    while posted < depth.min(ops) {
        post();
        posted += 1;
    }
    let mut armed = false;
    while done < ops {
        let mut n = cq.poll(&mut wc).expect("poll");
        if n == 0 {
            if !armed {
                cq.req_notify(false).expect("req_notify");
                armed = true;
                n = cq.poll(&mut wc).expect("poll");
            }
            if n == 0 {
                let mut pfd = libc::pollfd {
                    fd: channel.fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd; bounded wait.
                let rc = unsafe { libc::poll(&mut pfd, 1, 1000) };
                assert!(rc >= 0, "poll(2) failed");
                while channel.get_event().expect("get_event").is_some() {
                    unacked += 1;
                    armed = false;
                }
                if unacked >= 16 {
                    cq.ack_events(unacked);
                    unacked = 0;
                }
                continue;
            }
        }
        for c in &wc[..n] {
            assert!(c.status.is_success(), "raw WRITE failed: {}", c.status);
        }
        done += n;
        for _ in 0..n {
            if posted < ops {
                post();
                posted += 1;
            }
        }
    }
    cq.ack_events(unacked);
}

/// (b) The same WRs as ops: one future holding `depth` lanes; with
/// `timed`, each op inside a one-hour `timeout` (a live timer per op, as
/// code guarding its ops with deadlines has).
#[inline(never)]
fn sleep_run_op(rt: &Runtime, qp: &QueuePair, wr: &SendWr, depth: usize, ops: usize, timed: bool) {
    if timed {
        run_lanes(rt, depth, ops, || {
            let op = verbio::runtime::timeout(Duration::from_secs(3600), submit(qp, wr));
            async move { op.await.expect("no timeout") }
        })
    } else {
        run_lanes(rt, depth, ops, || submit(qp, wr))
    }
}

/// Keeps `depth` futures made by `start` in flight until `ops` are done.
fn run_lanes<F, S>(rt: &Runtime, depth: usize, ops: usize, mut start: S)
where
    F: Future<Output = Result<Completion, SubmitError>>,
    S: FnMut() -> F,
{
    let mut lanes: Vec<Option<Pin<Box<F>>>> = (0..depth).map(|_| None).collect();
    let (mut started, mut done) = (0usize, 0usize);
    rt.block_on(std::future::poll_fn(|cx| {
        for lane in lanes.iter_mut() {
            loop {
                if let Some(op) = lane {
                    match op.as_mut().poll(cx) {
                        Poll::Ready(out) => {
                            assert!(out.expect("op").status.is_success());
                            done += 1;
                            *lane = None;
                        }
                        Poll::Pending => break,
                    }
                }
                if started == ops {
                    break;
                }
                *lane = Some(Box::pin(start()));
                started += 1;
            }
        }
        if done == ops {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }));
}

/// One round: (raw sample, raw sleeps per op), (op sample, op sleeps per op).
type Pair = ((Sample, f64), (Sample, f64));

struct Row {
    raw: Sample,
    op: Sample,
    ratio: f64,
    overhead_ns: f64,
    raw_sleeps: f64,
    op_sleeps: f64,
}

fn device_phase(depth: usize, ops: usize, rounds: usize, only: &str, timed: bool) -> Row {
    let rt = Runtime::new().expect("runtime");
    let ctx = Context::open_soft(SoftConfig::default()).expect("soft device");
    let dev = Device::open(ctx).expect("device");
    let config = QpConfig {
        caps: QpCaps {
            max_send_wr: 64,
            ..QpCaps::default()
        },
        ..QpConfig::default()
    };
    let (a, _b) = DeviceQps::new(dev.clone(), config)
        .connected_pair()
        .expect("connected QPs");
    let src = region(&dev, MSG as usize);
    let dst = region(&dev, MSG as usize);
    let wr = write_wr(&src.mr, &dst.mr);
    let (do_raw, do_op) = (only != "op", only != "raw");
    let counted = |f: &mut dyn FnMut()| {
        let s0 = thread_sleeps();
        let s = measure(ops, f);
        (s, (thread_sleeps() - s0) as f64 / ops as f64)
    };
    if do_op {
        sleep_run_op(&rt, &a, &wr, depth, ops / 10 + depth, timed);
    }
    if do_raw {
        sleep_run_raw(&dev, &a, &wr, depth, ops / 10 + depth);
    }
    let none = (
        Sample {
            ops_per_s: f64::NAN,
            cpu_ns: f64::NAN,
        },
        f64::NAN,
    );
    let mut pairs = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let raw = || {
            if do_raw {
                counted(&mut || sleep_run_raw(&dev, &a, &wr, depth, ops))
            } else {
                none
            }
        };
        let op = || {
            if do_op {
                counted(&mut || sleep_run_op(&rt, &a, &wr, depth, ops, timed))
            } else {
                none
            }
        };
        pairs.push(if round % 2 == 0 {
            let r = raw();
            (r, op())
        } else {
            let o = op();
            (raw(), o)
        });
    }
    let m = |f: &dyn Fn(&Pair) -> f64| median(pairs.iter().map(f).collect());
    Row {
        raw: Sample {
            ops_per_s: m(&|p| p.0 .0.ops_per_s),
            cpu_ns: m(&|p| p.0 .0.cpu_ns),
        },
        op: Sample {
            ops_per_s: m(&|p| p.1 .0.ops_per_s),
            cpu_ns: m(&|p| p.1 .0.cpu_ns),
        },
        ratio: m(&|p| p.1 .0.ops_per_s / p.0 .0.ops_per_s),
        overhead_ns: m(&|p| p.1 .0.cpu_ns - p.0 .0.cpu_ns),
        raw_sleeps: m(&|p| p.0 .1),
        op_sleeps: m(&|p| p.1 .1),
    }
}

fn eventfd() -> OwnedFd {
    // SAFETY: eventfd has no memory-safety preconditions.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    assert!(fd >= 0, "eventfd");
    // SAFETY: a fresh fd we own.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

fn efd_write(fd: &OwnedFd) {
    let one = 1u64;
    // SAFETY: 8 bytes from a live u64.
    let n = unsafe { libc::write(fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    assert_eq!(n, 8);
}

fn efd_read(fd: &OwnedFd) {
    let mut v = 0u64;
    // SAFETY: 8 bytes into a live u64 (blocking eventfd).
    let n = unsafe { libc::read(fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    assert_eq!(n, 8);
}

/// Raw cross-thread ping-pong: two threads blocked in `read(2)` on eventfds.
fn xwake_raw(n: usize) -> Sample {
    let (ping, pong) = (Arc::new(eventfd()), Arc::new(eventfd()));
    let (p2, q2) = (ping.clone(), pong.clone());
    let peer = std::thread::spawn(move || {
        for _ in 0..n {
            efd_read(&p2);
            efd_write(&q2);
        }
    });
    let s = measure(n, || {
        for _ in 0..n {
            efd_write(&ping);
            efd_read(&pong);
        }
    });
    peer.join().expect("peer");
    s
}

/// A future woken from another thread: the peer thread receives a waker
/// and wakes it; the task counts one round trip per wake.
struct Remote {
    slot: Arc<Mutex<Option<Waker>>>,
    tx: mpsc::Sender<()>,
    polls: usize,
    n: usize,
}

impl Future for Remote {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<()> {
        if self.polls == self.n {
            return Poll::Ready(());
        }
        self.polls += 1;
        *self.slot.lock().expect("slot") = Some(cx.waker().clone());
        self.tx.send(()).expect("peer alive");
        Poll::Pending
    }
}

/// The runtime asleep in epoll, woken by another thread through a `Waker`.
fn xwake_runtime(n: usize) -> Sample {
    let rt = Runtime::new().expect("runtime");
    let slot: Arc<Mutex<Option<Waker>>> = Arc::new(Mutex::new(None));
    let (tx, rx) = mpsc::channel::<()>();
    let s2 = slot.clone();
    let peer = std::thread::spawn(move || {
        while rx.recv().is_ok() {
            let w = s2.lock().expect("slot").take();
            if let Some(w) = w {
                w.wake();
            }
        }
    });
    let s = measure(n, || {
        rt.block_on(Remote {
            slot,
            tx,
            polls: 0,
            n,
        })
    });
    peer.join().expect("peer");
    s
}

/// Raw TCP ping-pong on loopback: two threads in blocking `read`/`write`.
fn tcp_raw(n: usize) -> Sample {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let peer = std::thread::spawn(move || tcp_echo_peer(listener, n));
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_nodelay(true).expect("nodelay");
    let mut b = [0u8; 1];
    let sample = measure(n, || {
        for _ in 0..n {
            s.write_all(&b).expect("write");
            s.read_exact(&mut b).expect("read");
        }
    });
    peer.join().expect("peer");
    sample
}

/// Echoes `n` one-byte messages on the first connection (blocking).
fn tcp_echo_peer(listener: std::net::TcpListener, n: usize) {
    use std::io::{Read, Write};
    let (mut s, _) = listener.accept().expect("accept");
    s.set_nodelay(true).expect("nodelay");
    let mut b = [0u8; 1];
    for _ in 0..n {
        s.read_exact(&mut b).expect("read");
        s.write_all(&b).expect("write");
    }
}

/// The same ping-pong with the runtime's `TcpStream` (it sleeps in epoll).
fn tcp_runtime(n: usize) -> Sample {
    use futures::io::{AsyncReadExt, AsyncWriteExt};
    let rt = Runtime::new().expect("runtime");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let peer = std::thread::spawn(move || tcp_echo_peer(listener, n));
    let sample = rt.block_on(async {
        let mut s = verbio::runtime::TcpStream::connect(addr)
            .await
            .expect("connect");
        s.set_nodelay(true).expect("nodelay");
        let mut b = [0u8; 1];
        let c0 = thread_cpu();
        let t0 = Instant::now();
        for _ in 0..n {
            s.write_all(&b).await.expect("write");
            s.read_exact(&mut b).await.expect("read");
        }
        Sample {
            ops_per_s: n as f64 / t0.elapsed().as_secs_f64(),
            cpu_ns: (thread_cpu() - c0).as_nanos() as f64 / n as f64,
        }
    });
    peer.join().expect("peer");
    sample
}

/// What the reactor's sleep/wake cycle costs against a raw loop, on the soft device.
#[derive(clap::Parser)]
struct Args {
    /// Ops per round.
    #[arg(default_value_t = 20_000)]
    ops: usize,
    /// Paired rounds (medians are printed).
    #[arg(default_value_t = 7, value_parser = cli::at_least_one)]
    rounds: usize,
    /// WRs in flight, comma-separated.
    #[arg(default_value = "1,32", value_parser = depth_list)]
    depths: Depths,
    /// What to run: both device loops and the other tables, one device loop
    /// only (raw, op: for `strace -c` or callgrind), or one other table.
    #[arg(default_value = "both", value_parser = ["both", "raw", "op", "xwake", "tcp"])]
    only: String,
}

/// The depths of a run.
#[derive(Clone)]
struct Depths(Vec<usize>);

fn depth_list(s: &str) -> Result<Depths, String> {
    s.split(',')
        .map(cli::at_least_one)
        .collect::<Result<_, _>>()
        .map(Depths)
}

fn main() {
    let args = <Args as clap::Parser>::parse();
    cli::init_tracing();
    let (ops, rounds, depths, only) = (args.ops, args.rounds, args.depths.0, args.only);
    if only != "xwake" && only != "tcp" {
        println!(
            "RDMA WRITE of {MSG} B, soft device, sleeping on the channel fd; {ops} ops per round, medians of {rounds} paired rounds"
        );
        println!(
            "{:<12} {:>10} {:>10} {:>7} {:>11} {:>11} {:>9} {:>17}",
            "depth",
            "raw ops/s",
            "op ops/s",
            "op/raw",
            "raw cpu/op",
            "op cpu/op",
            "overhead",
            "sleeps/op raw/op"
        );
        for &depth in &depths {
            for timed in [false, true] {
                let r = device_phase(depth, ops, rounds, &only, timed);
                let label = format!("{depth}{}", if timed { " +timeout" } else { "" });
                println!(
                    "{:<12} {:>10.0} {:>10.0} {:>7.2} {:>8.0} ns {:>8.0} ns {:>6.0} ns {:>8.3} / {:<6.3}",
                    label,
                    r.raw.ops_per_s,
                    r.op.ops_per_s,
                    r.ratio,
                    r.raw.cpu_ns,
                    r.op.cpu_ns,
                    r.overhead_ns,
                    r.raw_sleeps,
                    r.op_sleeps
                );
            }
        }
    }
    if only == "both" || only == "tcp" {
        let n = ops / 4;
        let samples: Vec<(Sample, Sample)> =
            (0..rounds).map(|_| (tcp_raw(n), tcp_runtime(n))).collect();
        let m = |f: &dyn Fn(&(Sample, Sample)) -> f64| median(samples.iter().map(f).collect());
        println!();
        println!("TCP ping-pong on loopback, 1 byte, {n} round trips per round (raw: blocking std sockets)");
        println!(
            "raw {:>8.0} trips/s {:>7.0} ns CPU/trip | runtime {:>8.0} trips/s {:>7.0} ns CPU/trip | ratio {:.2}",
            m(&|s| s.0.ops_per_s),
            m(&|s| s.0.cpu_ns),
            m(&|s| s.1.ops_per_s),
            m(&|s| s.1.cpu_ns),
            m(&|s| s.1.ops_per_s / s.0.ops_per_s),
        );
    }
    if only == "both" || only == "xwake" {
        let n = ops / 4;
        let samples: Vec<(Sample, Sample)> = (0..rounds)
            .map(|_| (xwake_raw(n), xwake_runtime(n)))
            .collect();
        let m = |f: &dyn Fn(&(Sample, Sample)) -> f64| median(samples.iter().map(f).collect());
        println!();
        println!("cross-thread wake, {n} round trips per round (raw: eventfd ping-pong)");
        println!(
            "raw {:>8.0} trips/s {:>7.0} ns CPU/trip | runtime {:>8.0} trips/s {:>7.0} ns CPU/trip | ratio {:.2}",
            m(&|s| s.0.ops_per_s),
            m(&|s| s.0.cpu_ns),
            m(&|s| s.1.ops_per_s),
            m(&|s| s.1.cpu_ns),
            m(&|s| s.1.ops_per_s / s.0.ops_per_s),
        );
    }
}
