//! Soft-device benchmark: RDMA over the built-in software device versus raw
//! TCP loopback, measured side by side in one run.
//!
//! It prints:
//! - 1 MiB RDMA WRITE bandwidth between two soft contexts (raw post/poll, a
//!   few WRs in flight; the poster sleeps on the completion channel like the
//!   blocking TCP writer sleeps in `write`) vs two threads moving 1 MiB
//!   chunks over a blocking TCP loopback socket, and the ratio;
//! - 64-byte SEND bandwidth with a window: one thread posts SENDs one WR
//!   per `post_send`, up to `WINDOW` in flight, another keeps `RECV_DEPTH`
//!   receives posted, both sleeping on their completion channel, against a
//!   TCP writer making one `write` per 64-byte message and a reader reading
//!   the stream in 64 KiB reads (both blocking); messages per second and
//!   the CPU time of the whole process per message (engines included);
//! - 64-byte SEND/RECV round trips per second (ping-pong between two
//!   threads, QPs on two soft devices) vs a 64-byte TCP ping-pong (two
//!   threads blocking in `read`), and the ratio, for both ways an
//!   application waits for its receive completion:
//!   - "busy-poll": the thread polls its CQ in a loop (`yield_now` between
//!     polls); its polls receive themselves (app-driven receive: no engine
//!     thread wakes per message), and for comparison the same with the
//!     engine threads receiving (`VERBIO_SOFT_LEASE_US=0`);
//!   - "sleep": the thread arms the CQ (`req_notify`), polls once more, then
//!     sleeps in `poll(2)` on the completion channel's fd (the verbs event
//!     loop, like the TCP thread sleeping in `read`); the packet wakes it
//!     and its `get_event` receives (no engine thread wakes per message);
//!
//!   plus, for reference, the busy-poll ping-pong with both QPs on one soft
//!   device (the engine's internal loopback, no TCP), and a second TCP
//!   ping-pong whose threads spin on non-blocking sockets (`yield_now`
//!   between empty reads): the like-for-like reference for busy-polling
//!   applications, which never pay a thread wake-up (on a VM whose idle
//!   vCPUs take 100+ µs to wake, blocking TCP pays one per message).
//!
//! Each measurement runs `rounds` times, alternating soft and TCP so that
//! background load hits both alike; the medians and their ratios are printed.
//!
//! Run: `cargo run --release --example soft_bench` (optional arguments:
//! seconds per bandwidth run (0 = skip), round trips per latency run, rounds;
//! `--help` lists them).
//! `VERBIO_SOFT_SPIN_US` sets how long the engine polls after delivering a
//! completion before sleeping (default 50 µs), `VERBIO_SOFT_ACK_DELAY_US`
//! how long an ACK may wait for an answer to ride with (default 50 µs, at
//! most the spin), `VERBIO_SOFT_LEASE_US` how long a busy-polling
//! application keeps a connection's input to itself (default 1000, 0 = the
//! engine always receives). `--only busy|busy-engine|sleep|tcp|tcp-spin`
//! runs one ping-pong only, `--only soft-bw|tcp-bw` one 64-byte bandwidth
//! run of `secs` (for profiling, e.g. under `perf stat`).

mod cli;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use verbio::provider::*;

const CHUNK: usize = 1 << 20;
const DEPTH: usize = 4;
const MSG: usize = 64;
/// SENDs in flight in the small-message bandwidth run.
const WINDOW: usize = 128;
/// Receives posted in the small-message bandwidth run.
const RECV_DEPTH: usize = 1024;

/// Registered memory that Rust code never reads or writes (only its
/// address is used), so WRs may name it at any time; `Drop` deregisters it
/// (ending the device's access) before the memory is freed.
struct Buf {
    mem: Vec<u64>,
    mr: Option<Mr>,
}

impl Buf {
    fn new(pd: &Pd, len: usize, access: AccessFlags) -> Buf {
        let mut mem = vec![0u64; len.div_ceil(8)];
        // SAFETY: `mem` is heap memory that is never resized and outlives the
        // registration (Drop deregisters before the Vec is freed).
        let mr = unsafe { pd.reg_mr(mem.as_mut_ptr().cast(), len, access) }.expect("reg_mr");
        Buf { mem, mr: Some(mr) }
    }
    fn mr(&self) -> &Mr {
        self.mr.as_ref().expect("registered")
    }
    fn sge(&self, len: usize) -> Sge {
        Sge {
            addr: self.mem.as_ptr() as u64,
            length: len as u32,
            lkey: self.mr().lkey(),
        }
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        self.mr = None;
    }
}

struct Side {
    pd: Pd,
    scq: Cq,
    rcq: Cq,
    qp: Qp,
}

fn side(ctx: &Context, ch: Option<&CompChannel>) -> Side {
    let pd = ctx.alloc_pd().expect("pd");
    let scq = ctx.create_cq(4096, None).expect("cq");
    let rcq = ctx.create_cq(4096, ch).expect("cq");
    let qp = pd.create_qp(&scq, &rcq, QpCaps::default()).expect("qp");
    Side { pd, scq, rcq, qp }
}

fn up(qp: &Qp, remote: Endpoint) {
    qp.modify_to_init(&InitAttr::default()).expect("init");
    qp.modify_to_rtr(&RtrAttr {
        remote,
        path_mtu: Mtu::Mtu4096,
        min_rnr_timer: 1,
        max_dest_rd_atomic: 16,
        sgid_index: 0,
        hop_limit: 64,
    })
    .expect("rtr");
    qp.modify_to_rts(&RtsAttr::default()).expect("rts");
}

/// Busy-polls `cq` for one completion (yielding so the engines get the CPU).
fn wait_one(cq: &Cq) -> Completion {
    let mut wc = [Completion::EMPTY; 1];
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if cq.poll(&mut wc).expect("poll") == 1 {
            assert!(wc[0].status.is_success(), "{:?}", wc[0]);
            return wc[0];
        }
        assert!(Instant::now() < deadline, "no completion");
        std::thread::yield_now();
    }
}

/// Waits for one completion without spinning: arm the CQ, poll once more,
/// then sleep on the completion channel's fd (the verbs event loop).
fn wait_one_blocking(cq: &Cq, ch: &CompChannel) -> Completion {
    let mut wc = [Completion::EMPTY; 1];
    wait_some_blocking(cq, ch, &mut wc);
    wc[0]
}

fn soft_write_bw(secs: f64) -> f64 {
    let ca = Context::open_soft(SoftConfig::default()).expect("open");
    let cb = Context::open_soft(SoftConfig::default()).expect("open");
    let ch = ca.create_comp_channel().expect("channel");
    let a = {
        let pd = ca.alloc_pd().expect("pd");
        let scq = ca.create_cq(4096, Some(&ch)).expect("cq");
        let rcq = ca.create_cq(4096, None).expect("cq");
        let qp = pd.create_qp(&scq, &rcq, QpCaps::default()).expect("qp");
        Side { pd, scq, rcq, qp }
    };
    let b = side(&cb, None);
    up(&a.qp, b.qp.endpoint(0).expect("ep"));
    up(&b.qp, a.qp.endpoint(0).expect("ep"));
    let src = Buf::new(&a.pd, CHUNK, AccessFlags::LOCAL_WRITE);
    let dst = Buf::new(&b.pd, CHUNK, AccessFlags::ALL);
    let wr = SendWr {
        wr_id: 0,
        sg_list: [src.sge(CHUNK)].into_iter().collect(),
        op: SendOp::Write {
            remote_addr: dst.mem.as_ptr() as u64,
            rkey: dst.mr().rkey(),
        },
        flags: SendFlags::SIGNALED,
    };
    let mut inflight = 0;
    let mut done = 0u64;
    let start = Instant::now();
    let stop = start + Duration::from_secs_f64(secs);
    loop {
        while inflight < DEPTH && Instant::now() < stop {
            // SAFETY: the SGE names `src` (see `Buf`: never accessed by Rust
            // code); the device only reads it, and the loop waits for every
            // completion before `src` is dropped.
            unsafe { a.qp.post_send(std::slice::from_ref(&wr)) }.expect("post");
            inflight += 1;
        }
        if inflight == 0 {
            break;
        }
        wait_one_blocking(&a.scq, &ch);
        inflight -= 1;
        done += 1;
    }
    let el = start.elapsed().as_secs_f64();
    drop(b);
    (done as f64 * CHUNK as f64) / el / 1e6
}

fn tcp_bw(secs: f64) -> f64 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    let reader = std::thread::spawn(move || {
        let (mut s, _) = l.accept().expect("accept");
        let mut buf = vec![0u8; CHUNK];
        let mut total = 0u64;
        loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => return total,
                Ok(n) => total += n as u64,
            }
        }
    });
    let mut s = TcpStream::connect(addr).expect("connect");
    let buf = vec![7u8; CHUNK];
    let start = Instant::now();
    let stop = start + Duration::from_secs_f64(secs);
    while Instant::now() < stop {
        s.write_all(&buf).expect("write");
    }
    drop(s);
    let total = reader.join().expect("reader");
    total as f64 / start.elapsed().as_secs_f64() / 1e6
}

/// Messages per second and CPU time per message of one bandwidth run.
#[derive(Clone, Copy)]
struct Rate {
    msgs_per_sec: f64,
    cpu_us_per_msg: f64,
}

impl Rate {
    fn of(msgs: u64, wall: Duration, cpu: Duration) -> Rate {
        Rate {
            msgs_per_sec: msgs as f64 / wall.as_secs_f64(),
            cpu_us_per_msg: cpu.as_secs_f64() * 1e6 / msgs as f64,
        }
    }
}

/// Waits for completions on `cq` without spinning: poll, arm the CQ, poll
/// once more, then sleep on the completion channel's fd (the verbs event
/// loop); takes up to `out.len()` of them and checks that they succeeded.
fn wait_some_blocking(cq: &Cq, ch: &CompChannel, out: &mut [Completion]) -> usize {
    loop {
        let mut n = cq.poll(out).expect("poll");
        if n == 0 {
            cq.req_notify(false).expect("arm");
            n = cq.poll(out).expect("poll");
        }
        if n > 0 {
            for wc in &out[..n] {
                assert!(wc.status.is_success(), "{wc:?}");
            }
            return n;
        }
        let mut p = libc::pollfd {
            fd: ch.fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let r = unsafe { libc::poll(&mut p, 1, 10_000) };
        assert!(r == 1, "no completion event");
        // One event per wake, as `ibv_get_cq_event` takes (and as the
        // reactor does): the CQ was armed once, so it raised at most one.
        // A spurious wake finds none; poll(2) is level-triggered, so
        // nothing left pending can be missed.
        if ch.get_event().expect("event").is_some() {
            cq.ack_events(1);
        }
    }
}

/// 64-byte SENDs between two soft devices for `secs`, `WINDOW` in flight,
/// each its own `post_send`; both threads sleep on their channels.
fn soft_small_bw(secs: f64) -> Rate {
    let ca = Context::open_soft(SoftConfig::default()).expect("open");
    let cb = Context::open_soft(SoftConfig::default()).expect("open");
    let (cha, chb) = (
        ca.create_comp_channel().expect("channel"),
        cb.create_comp_channel().expect("channel"),
    );
    let a = {
        let pd = ca.alloc_pd().expect("pd");
        let scq = ca.create_cq(4096, Some(&cha)).expect("cq");
        let rcq = ca.create_cq(4096, None).expect("cq");
        let qp = pd.create_qp(&scq, &rcq, QpCaps::default()).expect("qp");
        Side { pd, scq, rcq, qp }
    };
    let b = {
        let pd = cb.alloc_pd().expect("pd");
        let scq = cb.create_cq(4096, None).expect("cq");
        let rcq = cb.create_cq(4096, Some(&chb)).expect("cq");
        let caps = QpCaps {
            max_recv_wr: RECV_DEPTH as u32,
            ..QpCaps::default()
        };
        let qp = pd.create_qp(&scq, &rcq, caps).expect("qp");
        Side { pd, scq, rcq, qp }
    };
    up(&a.qp, b.qp.endpoint(0).expect("ep"));
    up(&b.qp, a.qp.endpoint(0).expect("ep"));
    let sbuf = Buf::new(&a.pd, MSG, AccessFlags::LOCAL_WRITE);
    let rbuf = Buf::new(&b.pd, MSG * RECV_DEPTH, AccessFlags::LOCAL_WRITE);
    let recv_wr = |i: usize| RecvWr {
        wr_id: i as u64,
        sg_list: [Sge {
            addr: rbuf.mem.as_ptr() as u64 + (i * MSG) as u64,
            length: MSG as u32,
            lkey: rbuf.mr().lkey(),
        }]
        .into_iter()
        .collect(),
    };
    for i in 0..RECV_DEPTH {
        // SAFETY: the SGE names slot `i` of `rbuf` (see `Buf`: never
        // accessed by Rust code, deregistered before freed); each slot has
        // one receive outstanding at a time.
        unsafe { b.qp.post_recv(std::slice::from_ref(&recv_wr(i))) }.expect("recv");
    }
    let send = SendWr {
        wr_id: 0,
        sg_list: [sbuf.sge(MSG)].into_iter().collect(),
        op: SendOp::Send,
        flags: SendFlags::SIGNALED,
    };
    let stop = std::sync::atomic::AtomicBool::new(false);
    let cpu0 = cli::process_cpu();
    let start = Instant::now();
    let (sent, received) = std::thread::scope(|sc| {
        let receiver = sc.spawn(|| {
            let mut wcs = [Completion::EMPTY; 64];
            let mut got = 0u64;
            // Until the sender is done and every SEND it made has landed.
            loop {
                let n = wait_some_blocking(&b.rcq, &chb, &mut wcs);
                for wc in &wcs[..n] {
                    // SAFETY: as above; this slot's receive just completed.
                    unsafe {
                        b.qp.post_recv(std::slice::from_ref(&recv_wr(wc.wr_id as usize)))
                    }
                    .expect("recv");
                }
                got += n as u64;
                if stop.load(std::sync::atomic::Ordering::Acquire) {
                    return got;
                }
            }
        });
        let deadline = start + Duration::from_secs_f64(secs);
        let mut wcs = [Completion::EMPTY; 64];
        let (mut posted, mut done) = (0u64, 0u64);
        loop {
            let more = Instant::now() < deadline;
            while more && posted - done < WINDOW as u64 {
                // SAFETY: the SGE names `sbuf` (see `Buf`), which the
                // device only reads; every SEND completes before it drops.
                unsafe { a.qp.post_send(std::slice::from_ref(&send)) }.expect("send");
                posted += 1;
            }
            if posted == done {
                break;
            }
            done += wait_some_blocking(&a.scq, &cha, &mut wcs) as u64;
        }
        // Every SEND completed, so every one of them landed in a receive:
        // one more SEND wakes the receiver to see `stop`.
        stop.store(true, std::sync::atomic::Ordering::Release);
        // SAFETY: as above.
        unsafe { a.qp.post_send(std::slice::from_ref(&send)) }.expect("send");
        let _ = wait_some_blocking(&a.scq, &cha, &mut wcs);
        (posted, receiver.join().expect("receiver"))
    });
    let (wall, cpu) = (start.elapsed(), cli::process_cpu() - cpu0);
    assert!(received >= sent, "{received} of {sent} SENDs received");
    Rate::of(sent, wall, cpu)
}

/// 64-byte messages over TCP loopback for `secs`: one `write` per message
/// (Nagle off), the reader reading the stream 64 KiB at a time.
fn tcp_small_bw(secs: f64) -> Rate {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    let cpu0 = cli::process_cpu();
    let start = Instant::now();
    let reader = std::thread::spawn(move || {
        let (mut s, _) = l.accept().expect("accept");
        let mut buf = vec![0u8; 64 * 1024];
        let mut total = 0u64;
        loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => return total,
                Ok(n) => total += n as u64,
            }
        }
    });
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_nodelay(true).expect("nodelay");
    let msg = [7u8; MSG];
    let mut sent = 0u64;
    let deadline = start + Duration::from_secs_f64(secs);
    while Instant::now() < deadline {
        for _ in 0..WINDOW {
            s.write_all(&msg).expect("write");
        }
        sent += WINDOW as u64;
    }
    drop(s);
    let total = reader.join().expect("reader");
    assert_eq!(total, sent * MSG as u64, "bytes received");
    Rate::of(sent, start.elapsed(), cli::process_cpu() - cpu0)
}

/// How the ping-pong threads wait for their receive completion.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Wait {
    /// Poll the CQ in a loop, yielding between polls.
    BusyPoll,
    /// Arm the CQ and sleep on the completion channel.
    Sleep,
}

/// The busy-poll ping-pong with the engine threads receiving (app-driven
/// receive off for the contexts opened meanwhile).
fn soft_pingpong_engine_rx(iters: usize) -> f64 {
    let before = std::env::var_os("VERBIO_SOFT_LEASE_US");
    // (No other thread reads the environment now: every engine of the
    // previous runs has stopped.)
    std::env::set_var("VERBIO_SOFT_LEASE_US", "0");
    let v = soft_pingpong(iters, false, Wait::BusyPoll);
    match before {
        Some(b) => std::env::set_var("VERBIO_SOFT_LEASE_US", b),
        None => std::env::remove_var("VERBIO_SOFT_LEASE_US"),
    }
    v
}

fn soft_pingpong(iters: usize, same_device: bool, wait: Wait) -> f64 {
    let ca = Context::open_soft(SoftConfig::default()).expect("open");
    let cb = if same_device {
        ca.clone()
    } else {
        Context::open_soft(SoftConfig::default()).expect("open")
    };
    let cha = ca.create_comp_channel().expect("channel");
    let chb = cb.create_comp_channel().expect("channel");
    let (a, b) = (side(&ca, Some(&cha)), side(&cb, Some(&chb)));
    up(&a.qp, b.qp.endpoint(0).expect("ep"));
    up(&b.qp, a.qp.endpoint(0).expect("ep"));
    let run = |s: &Side, ch: &CompChannel, initiator: bool| {
        let sbuf = Buf::new(&s.pd, MSG, AccessFlags::LOCAL_WRITE);
        let rbuf = Buf::new(&s.pd, MSG, AccessFlags::LOCAL_WRITE);
        let recv = RecvWr {
            wr_id: 1,
            sg_list: [rbuf.sge(MSG)].into_iter().collect(),
        };
        let send = SendWr {
            wr_id: 2,
            sg_list: [sbuf.sge(MSG)].into_iter().collect(),
            op: SendOp::Send,
            flags: SendFlags::SIGNALED,
        };
        let mut sends = 0usize;
        let mut sends_done = 0usize;
        // SAFETY: the SGE names `rbuf` (see `Buf`: never accessed by Rust
        // code, deregistered before freed); one RECV is outstanding at a time.
        unsafe { s.qp.post_recv(std::slice::from_ref(&recv)) }.expect("recv");
        let mut post = |q: &Qp| {
            // SAFETY: the SGE names `sbuf` (see `Buf`), which the device
            // only reads; concurrent reads of it are fine.
            unsafe { q.post_send(std::slice::from_ref(&send)) }.expect("send");
            sends += 1;
        };
        let mut scratch = [Completion::EMPTY; 16];
        let start = Instant::now();
        for _ in 0..iters {
            if initiator {
                post(&s.qp);
            }
            match wait {
                Wait::BusyPoll => wait_one(&s.rcq),
                Wait::Sleep => wait_one_blocking(&s.rcq, ch),
            };
            // SAFETY: as above; the previous RECV's completion was just polled.
            unsafe { s.qp.post_recv(std::slice::from_ref(&recv)) }.expect("recv");
            if !initiator {
                post(&s.qp);
            }
            // Drain send completions without waiting.
            sends_done += s.scq.poll(&mut scratch).expect("poll");
        }
        let el = start.elapsed();
        // Keep the buffers registered until every SEND completed.
        while sends_done < sends {
            wait_one(&s.scq);
            sends_done += 1;
        }
        el
    };
    let el = std::thread::scope(|sc| {
        let hb = sc.spawn(|| run(&b, &chb, false));
        let ea = run(&a, &cha, true);
        hb.join().expect("responder");
        ea
    });
    iters as f64 / el.as_secs_f64()
}

fn tcp_pingpong(iters: usize) -> f64 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    let echo = std::thread::spawn(move || {
        let (mut s, _) = l.accept().expect("accept");
        s.set_nodelay(true).expect("nodelay");
        let mut buf = [0u8; MSG];
        for _ in 0..iters {
            s.read_exact(&mut buf).expect("read");
            s.write_all(&buf).expect("write");
        }
    });
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_nodelay(true).expect("nodelay");
    let mut buf = [1u8; MSG];
    let start = Instant::now();
    for _ in 0..iters {
        s.write_all(&buf).expect("write");
        s.read_exact(&mut buf).expect("read");
    }
    let el = start.elapsed();
    echo.join().expect("echo");
    iters as f64 / el.as_secs_f64()
}

/// The TCP ping-pong with both threads spinning on non-blocking sockets
/// (`yield_now` between empty reads, as the busy-polling soft threads
/// yield between empty polls): the like-for-like reference for busy-polling
/// applications, which never sleep and so never pay a wake-up.
fn tcp_pingpong_spin(iters: usize) -> f64 {
    fn spin_read(s: &mut TcpStream, buf: &mut [u8]) {
        let mut got = 0;
        while got < buf.len() {
            match s.read(&mut buf[got..]) {
                Ok(0) => panic!("peer closed"),
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::yield_now(),
                Err(e) => panic!("read: {e}"),
            }
        }
    }
    fn spin_write(s: &mut TcpStream, buf: &[u8]) {
        let mut put = 0;
        while put < buf.len() {
            match s.write(&buf[put..]) {
                Ok(n) => put += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::yield_now(),
                Err(e) => panic!("write: {e}"),
            }
        }
    }
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    let echo = std::thread::spawn(move || {
        let (mut s, _) = l.accept().expect("accept");
        s.set_nodelay(true).expect("nodelay");
        s.set_nonblocking(true).expect("nonblocking");
        let mut buf = [0u8; MSG];
        for _ in 0..iters {
            spin_read(&mut s, &mut buf);
            spin_write(&mut s, &buf);
        }
    });
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_nodelay(true).expect("nodelay");
    s.set_nonblocking(true).expect("nonblocking");
    let mut buf = [1u8; MSG];
    let start = Instant::now();
    for _ in 0..iters {
        spin_write(&mut s, &buf);
        spin_read(&mut s, &mut buf);
    }
    let el = start.elapsed();
    echo.join().expect("echo");
    iters as f64 / el.as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn print_bw(soft: f64, tcp: f64, rounds: usize) {
    println!(
        "bandwidth, 1 MiB messages ({DEPTH} WRs in flight for the soft device), median of {rounds}:"
    );
    println!("  soft RDMA WRITE : {soft:9.1} MB/s");
    println!("  TCP loopback    : {tcp:9.1} MB/s");
    println!("  ratio soft/TCP  : {:9.2}", soft / tcp);
}

fn print_small_bw(soft: &[Rate], tcp: &[Rate], rounds: usize) {
    let rate = |v: &[Rate]| median(v.iter().map(|r| r.msgs_per_sec).collect());
    let cpu = |v: &[Rate]| median(v.iter().map(|r| r.cpu_us_per_msg).collect());
    let (sr, tr, sc, tc) = (rate(soft), rate(tcp), cpu(soft), cpu(tcp));
    println!(
        "bandwidth, {MSG}-byte messages ({WINDOW} SENDs in flight for the soft device), median of {rounds}:"
    );
    let mb = |r: f64| r * MSG as f64 / f64::from(1 << 20);
    println!(
        "  soft SEND       : {sr:9.0} msgs/s ({:6.1} MB/s), {sc:5.2} us of CPU per message",
        mb(sr)
    );
    println!(
        "  TCP loopback    : {tr:9.0} msgs/s ({:6.1} MB/s), {tc:5.2} us of CPU per message",
        mb(tr)
    );
    println!(
        "  ratio soft/TCP  : {:9.2} (rate), {:5.2} (CPU per message)",
        sr / tr,
        sc / tc
    );
}

/// One ping-pong of `--only`.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Only {
    /// Soft SEND/RECV, the applications busy-poll their CQ.
    Busy,
    /// The same, the engine threads receiving (lease 0).
    BusyEngine,
    /// Soft SEND/RECV, the applications sleep on the completion channel.
    Sleep,
    /// TCP, threads blocking in read.
    Tcp,
    /// TCP, threads spinning on read.
    TcpSpin,
    /// The soft device's 64-byte SEND bandwidth run (`secs` long).
    SoftBw,
    /// TCP's 64-byte message bandwidth run (`secs` long).
    TcpBw,
}

/// The software device against TCP on loopback: bandwidth and ping-pong
/// round trips, medians of alternating rounds.
#[derive(clap::Parser)]
struct Args {
    /// Seconds per bandwidth run (0: skip the bandwidth runs).
    #[arg(default_value_t = 1.0)]
    secs: f64,
    /// Round trips per latency run.
    #[arg(default_value_t = 10_000)]
    iters: usize,
    /// Rounds.
    #[arg(default_value_t = 5, value_parser = cli::at_least_one)]
    rounds: usize,
    /// Run just this ping-pong once, without warm-up (for profiling).
    #[arg(long, value_enum)]
    only: Option<Only>,
}

fn main() {
    let args = <Args as clap::Parser>::parse();
    cli::init_tracing();
    let (secs, iters, rounds) = (args.secs, args.iters, args.rounds);
    if let Some(only) = args.only {
        let el = Instant::now();
        let v = match only {
            Only::Busy => soft_pingpong(iters, false, Wait::BusyPoll),
            Only::BusyEngine => soft_pingpong_engine_rx(iters),
            Only::Sleep => soft_pingpong(iters, false, Wait::Sleep),
            Only::Tcp => tcp_pingpong(iters),
            Only::TcpSpin => tcp_pingpong_spin(iters),
            Only::SoftBw | Only::TcpBw => {
                let r = if only == Only::SoftBw {
                    soft_small_bw(secs)
                } else {
                    tcp_small_bw(secs)
                };
                println!(
                    "{MSG}-byte messages: {:.0} msgs/s, {:.2} us of CPU per message",
                    r.msgs_per_sec, r.cpu_us_per_msg
                );
                return;
            }
        };
        let name = clap::ValueEnum::to_possible_value(&only)
            .map(|v| v.get_name().to_string())
            .unwrap_or_default();
        println!("{name}: {v:.0} round trips/s ({:?} in all)", el.elapsed());
        return;
    }
    // Warm up both paths briefly.
    if secs > 0.0 {
        let _ = soft_write_bw(0.2);
        let _ = tcp_bw(0.2);
        let _ = soft_small_bw(0.2);
        let _ = tcp_small_bw(0.2);
    }
    let _ = soft_pingpong(iters / 10, false, Wait::BusyPoll);
    let _ = soft_pingpong(iters / 10, false, Wait::Sleep);
    let _ = tcp_pingpong(iters / 10);
    let _ = tcp_pingpong_spin(iters / 10);
    // Alternate the configurations so background load hits all alike; report medians.
    let (mut sb, mut tb, mut tl, mut ts) = (vec![], vec![], vec![], vec![]);
    let (mut busy, mut sleep, mut one) = (vec![], vec![], vec![]);
    let mut busy_eng = vec![];
    let (mut ssb, mut tsb) = (vec![], vec![]);
    for _ in 0..rounds {
        if secs > 0.0 {
            sb.push(soft_write_bw(secs));
            tb.push(tcp_bw(secs));
            ssb.push(soft_small_bw(secs));
            tsb.push(tcp_small_bw(secs));
        }
        busy.push(soft_pingpong(iters, false, Wait::BusyPoll));
        tl.push(tcp_pingpong(iters));
        ts.push(tcp_pingpong_spin(iters));
        busy_eng.push(soft_pingpong_engine_rx(iters));
        sleep.push(soft_pingpong(iters, false, Wait::Sleep));
        one.push(soft_pingpong(iters, true, Wait::BusyPoll));
    }
    if secs > 0.0 {
        print_bw(median(sb), median(tb), rounds);
        print_small_bw(&ssb, &tsb, rounds);
    }
    let (tcp, tcp_spin) = (median(tl), median(ts));
    let (busy, sleep) = (median(busy), median(sleep));
    println!("round trips, 64-byte messages ({iters} per run), median of {rounds}:");
    let line = |what: &str, v: f64| {
        println!(
            "  {what:<44}: {v:7.0} round trips/s ({:6.1} us each), ratio to TCP blocking {:5.2}, spinning {:5.2}",
            1e6 / v,
            v / tcp,
            v / tcp_spin
        )
    };
    line("TCP ping-pong (threads block in read)", tcp);
    line("TCP ping-pong (threads spin on read)", tcp_spin);
    line("soft SEND/RECV, apps busy-poll their CQ", busy);
    line("  same, engine threads receive (lease 0)", median(busy_eng));
    line("soft SEND/RECV, apps sleep on comp. channel", sleep);
    line("(reference: one soft device, busy-poll)", median(one));
    println!(
        "  like for like: busy-poll / spinning TCP {:.2}, sleep / blocking TCP {:.2}",
        busy / tcp_spin,
        sleep / tcp
    );
}
