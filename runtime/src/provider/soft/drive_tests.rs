//! App-driven receive: what a busy-polling application receives itself is
//! delivered exactly as the engine would deliver it, and the engine takes
//! the socket back when the application arms its CQ or its lease ends.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::super::{CompChannel, Context, Cq, Mr, Pd, Qp};
use crate::provider::{
    AccessFlags, Completion, InitAttr, Mtu, QpCaps, RecvWr, RtrAttr, RtsAttr, SendFlags, SendOp,
    SendWr, Sge, SoftConfig, WcOpcode, WcStatus,
};

const WAIT: Duration = Duration::from_secs(10);
const SIG: SendFlags = SendFlags::SIGNALED;

/// Registered memory read and written only through raw-pointer copies
/// (never while a WR that may write it is outstanding, except where noted);
/// the registration is dropped before the memory.
pub(crate) struct Mem {
    mr: Option<Mr>,
    mem: Box<[u64]>,
}

impl Mem {
    pub(crate) fn new(pd: &Pd, len: usize, access: AccessFlags) -> Mem {
        let mut mem = vec![0u64; len.div_ceil(8)].into_boxed_slice();
        // SAFETY: the boxed memory outlives the registration (`Drop`
        // deregisters first) and is never reallocated.
        let mr = unsafe { pd.reg_mr(mem.as_mut_ptr().cast(), len, access) }.expect("reg_mr");
        Mem { mr: Some(mr), mem }
    }
    pub(crate) fn addr(&self) -> u64 {
        self.mem.as_ptr() as u64
    }
    pub(crate) fn mr(&self) -> &Mr {
        self.mr.as_ref().expect("registered")
    }
    pub(crate) fn sge(&self, off: usize, len: usize) -> Sge {
        Sge {
            addr: self.addr() + off as u64,
            length: len as u32,
            lkey: self.mr().lkey(),
        }
    }
    pub(crate) fn write(&self, off: usize, data: &[u8]) {
        assert!(off + data.len() <= self.mem.len() * 8);
        // SAFETY: in bounds (checked); no WR uses these bytes now.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                (self.mem.as_ptr() as *mut u8).add(off),
                data.len(),
            )
        };
    }
    pub(crate) fn read(&self, off: usize, len: usize) -> Vec<u8> {
        assert!(off + len <= self.mem.len() * 8);
        let mut v = vec![0u8; len];
        // SAFETY: in bounds (checked); read through a copy.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (self.mem.as_ptr() as *const u8).add(off),
                v.as_mut_ptr(),
                len,
            )
        };
        v
    }
}

impl Drop for Mem {
    fn drop(&mut self) {
        self.mr = None;
    }
}

pub(crate) struct Side {
    pub(crate) ctx: Context,
    pub(crate) pd: Pd,
    pub(crate) scq: Cq,
    pub(crate) rcq: Cq,
    ch: CompChannel,
    pub(crate) qp: Qp,
}

fn pair_with(rts: RtsAttr) -> (Side, Side) {
    let side = || {
        let ctx = Context::open(SoftConfig::default()).expect("open");
        let pd = ctx.alloc_pd().expect("pd");
        let ch = ctx.create_comp_channel().expect("channel");
        let scq = ctx.create_cq(256, None).expect("cq");
        let rcq = ctx.create_cq(256, Some(&ch)).expect("cq");
        let qp = pd.create_qp(&scq, &rcq, QpCaps::default()).expect("qp");
        Side {
            ctx,
            pd,
            scq,
            rcq,
            ch,
            qp,
        }
    };
    let (a, b) = (side(), side());
    let up = |qp: &Qp, remote| {
        qp.modify_to_init(&InitAttr {
            access: AccessFlags::REMOTE_WRITE
                | AccessFlags::REMOTE_READ
                | AccessFlags::REMOTE_ATOMIC,
            ..InitAttr::default()
        })
        .expect("init");
        qp.modify_to_rtr(&RtrAttr {
            remote,
            path_mtu: Mtu::Mtu4096,
            min_rnr_timer: 1,
            max_dest_rd_atomic: 16,
            sgid_index: 0,
            hop_limit: 64,
        })
        .expect("rtr");
        qp.modify_to_rts(&rts).expect("rts");
    };
    up(&a.qp, b.qp.endpoint(0).expect("ep"));
    up(&b.qp, a.qp.endpoint(0).expect("ep"));
    (a, b)
}

pub(crate) fn pair() -> (Side, Side) {
    pair_with(RtsAttr::default())
}

/// Busy-polls `cq` (as a spinning application does) for one completion.
pub(crate) fn spin_one(cq: &Cq) -> Completion {
    let mut wc = [Completion::EMPTY; 1];
    let deadline = Instant::now() + WAIT;
    loop {
        if cq.poll(&mut wc).expect("poll") == 1 {
            return wc[0];
        }
        assert!(Instant::now() < deadline, "no completion");
        std::thread::yield_now();
    }
}

pub(crate) fn send_wr(wr_id: u64, op: SendOp, sge: Sge) -> SendWr {
    SendWr {
        wr_id,
        sg_list: [sge].into_iter().collect(),
        op,
        flags: SIG,
    }
}

pub(crate) fn post_recv(qp: &Qp, wr_id: u64, sge: Sge) {
    let wr = RecvWr {
        wr_id,
        sg_list: [sge].into_iter().collect(),
    };
    // SAFETY: the SGE names a `Mem`, read only after this WR completed.
    unsafe { qp.post_recv(&[wr]) }.expect("post_recv");
}

pub(crate) fn post_send(qp: &Qp, wr: SendWr) {
    // SAFETY: the SGE names a `Mem`, not accessed until the WR completed.
    unsafe { qp.post_send(&[wr]) }.expect("post_send");
}

fn app_packets(ctx: &Context) -> u64 {
    super::super::lock(ctx.core()).app_packets
}

/// Keeps `cq` busy-polled on another thread until dropped.
struct Spinner {
    stop: Arc<AtomicBool>,
    t: Option<std::thread::JoinHandle<()>>,
}

impl Spinner {
    fn new(cq: &Cq) -> Spinner {
        let stop = Arc::new(AtomicBool::new(false));
        let (cq, s) = (cq.clone(), stop.clone());
        let t = std::thread::spawn(move || {
            let mut wc = [Completion::EMPTY; 4];
            while !s.load(Ordering::Relaxed) {
                assert_eq!(cq.poll(&mut wc).expect("poll"), 0, "{wc:?}");
                std::thread::yield_now();
            }
        });
        Spinner { stop, t: Some(t) }
    }
}

impl Drop for Spinner {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.t.take() {
            let r = t.join();
            if !std::thread::panicking() {
                r.expect("spinner");
            }
        }
    }
}

#[test]
fn busy_polling_app_receives_in_order_with_opcode_len_and_imm() {
    let (a, b) = pair();
    let src = Mem::new(&a.pd, 4096, AccessFlags::LOCAL_WRITE);
    let dst = Mem::new(&b.pd, 4096, AccessFlags::ALL);
    const N: usize = 60;
    for i in 0..N {
        let len = 1 + (i * 37) % 2000;
        let pattern: Vec<u8> = (0..len).map(|k| (k + i) as u8).collect();
        src.write(0, &pattern);
        post_recv(&b.qp, 1000 + i as u64, dst.sge(0, 4096));
        let (op, opcode, imm) = match i % 3 {
            0 => (SendOp::Send, WcOpcode::Recv, None),
            1 => (
                SendOp::SendWithImm { imm: i as u32 },
                WcOpcode::Recv,
                Some(i as u32),
            ),
            _ => (
                SendOp::WriteWithImm {
                    remote_addr: dst.addr(),
                    rkey: dst.mr().rkey(),
                    imm: 7 * i as u32,
                },
                WcOpcode::RecvRdmaWithImm,
                Some(7 * i as u32),
            ),
        };
        post_send(&a.qp, send_wr(i as u64, op, src.sge(0, len)));
        let r = spin_one(&b.rcq);
        assert_eq!(
            (r.wr_id, r.status, r.opcode, r.byte_len, r.imm_data),
            (1000 + i as u64, WcStatus::Success, opcode, len as u32, imm),
            "message {i}"
        );
        assert_eq!(dst.read(0, len), pattern, "message {i}");
        let s = spin_one(&a.scq);
        assert_eq!((s.wr_id, s.status), (i as u64, WcStatus::Success));
        if i == 0 {
            // (So that what follows surely reaches the polls, even if this
            // thread stalls while the engines are awake.)
            force_mute(&b, &b.rcq);
            force_mute(&a, &a.scq);
        }
    }
    assert!(
        app_packets(&b.ctx) > 0,
        "the receiving application never received"
    );
    assert!(
        app_packets(&a.ctx) > 0,
        "the requester never received its ACKs"
    );
}

#[test]
fn rnr_waits_and_rnr_exhaustion_fail_as_before() {
    // Infinite RNR retries: the SEND lands once a RECV is posted.
    let (a, b) = pair();
    let src = Mem::new(&a.pd, 64, AccessFlags::LOCAL_WRITE);
    let dst = Mem::new(&b.pd, 64, AccessFlags::LOCAL_WRITE);
    src.write(0, b"hello, responder");
    // Both sides busy-poll first, so that their polls receive.
    {
        let _spin = Spinner::new(&b.rcq);
        post_send(&a.qp, send_wr(1, SendOp::Send, src.sge(0, 16)));
        let mut wc = [Completion::EMPTY; 1];
        let until = Instant::now() + Duration::from_millis(30);
        while Instant::now() < until {
            assert_eq!(a.scq.poll(&mut wc).expect("poll"), 0, "{wc:?}");
            std::thread::yield_now();
        }
    }
    post_recv(&b.qp, 9, dst.sge(0, 64));
    let r = spin_one(&b.rcq);
    assert_eq!((r.wr_id, r.status, r.byte_len), (9, WcStatus::Success, 16));
    assert_eq!(dst.read(0, 16), b"hello, responder");
    let s = spin_one(&a.scq);
    assert_eq!((s.wr_id, s.status), (1, WcStatus::Success));

    // No RNR retries: the requester's busy-polling fails the SEND.
    let (a, b) = pair_with(RtsAttr {
        rnr_retry: 0,
        ..RtsAttr::default()
    });
    let src = Mem::new(&a.pd, 64, AccessFlags::LOCAL_WRITE);
    let _spin = Spinner::new(&b.rcq);
    post_send(&a.qp, send_wr(2, SendOp::Send, src.sge(0, 8)));
    let s = spin_one(&a.scq);
    assert_eq!((s.wr_id, s.status), (2, WcStatus::RnrRetryExcErr));
}

#[test]
fn access_errors_fail_both_sides_as_before() {
    let (a, b) = pair();
    let src = Mem::new(&a.pd, 64, AccessFlags::LOCAL_WRITE);
    let dst = Mem::new(&b.pd, 64, AccessFlags::ALL);
    let rbuf = Mem::new(&b.pd, 64, AccessFlags::LOCAL_WRITE);
    // A round trip first, so that both polls receive.
    post_recv(&b.qp, 5, rbuf.sge(0, 64));
    post_send(&a.qp, send_wr(1, SendOp::Send, src.sge(0, 8)));
    assert_eq!(spin_one(&b.rcq).status, WcStatus::Success);
    assert_eq!(spin_one(&a.scq).status, WcStatus::Success);
    post_recv(&b.qp, 6, rbuf.sge(0, 64));
    // One byte past the region.
    let bad = SendOp::Write {
        remote_addr: dst.addr() + 1,
        rkey: dst.mr().rkey(),
    };
    post_send(&a.qp, send_wr(2, bad, src.sge(0, 64)));
    let r = spin_one(&b.rcq);
    assert_eq!((r.wr_id, r.status), (6, WcStatus::WrFlushErr));
    let s = spin_one(&a.scq);
    assert_eq!((s.wr_id, s.status), (2, WcStatus::RemAccessErr));
    assert_eq!(dst.read(0, 64), vec![0u8; 64], "memory untouched");
    assert_eq!(b.qp.state(), crate::provider::QpState::Err);
}

#[test]
fn read_and_atomic_responses_from_a_polling_responder_are_right() {
    let (a, b) = pair();
    let local = Mem::new(&a.pd, 4096, AccessFlags::LOCAL_WRITE);
    let remote = Mem::new(&b.pd, 4096, AccessFlags::ALL);
    let pattern: Vec<u8> = (0..4096).map(|k| (k * 7 + 3) as u8).collect();
    remote.write(0, &pattern);
    remote.write(0, &100u64.to_ne_bytes());
    let mut expect = pattern.clone();
    // The responder's application busy-polls its (idle) receive CQ: its
    // polls answer the READs and atomics.
    let mut value = 100u64;
    let complete = |i: u64| -> Completion {
        if i == 1 {
            force_mute(&b, &b.rcq);
            force_mute(&a, &a.scq);
        }
        let mut wc = [Completion::EMPTY; 1];
        let deadline = Instant::now() + WAIT;
        loop {
            assert_eq!(b.rcq.poll(&mut wc).expect("poll"), 0, "{wc:?}");
            if a.scq.poll(&mut wc).expect("poll") == 1 {
                return wc[0];
            }
            assert!(Instant::now() < deadline, "no completion");
            std::thread::yield_now();
        }
    };
    for i in 0..40u64 {
        match i % 3 {
            0 => {
                let (off, len) = (8 + (i as usize * 97) % 3000, 1 + (i as usize * 13) % 1000);
                let op = SendOp::Read {
                    remote_addr: remote.addr() + off as u64,
                    rkey: remote.mr().rkey(),
                };
                post_send(&a.qp, send_wr(i, op, local.sge(8, len)));
                let s = complete(i);
                assert_eq!(
                    (s.wr_id, s.status, s.opcode, s.byte_len),
                    (i, WcStatus::Success, WcOpcode::RdmaRead, len as u32)
                );
                assert_eq!(local.read(8, len), expect[off..off + len], "READ {i}");
            }
            1 => {
                let op = SendOp::FetchAndAdd {
                    remote_addr: remote.addr(),
                    rkey: remote.mr().rkey(),
                    add: i,
                };
                post_send(&a.qp, send_wr(i, op, local.sge(0, 8)));
                let s = complete(i);
                assert_eq!(
                    (s.wr_id, s.status, s.opcode),
                    (i, WcStatus::Success, WcOpcode::FetchAdd)
                );
                assert_eq!(local.read(0, 8), value.to_ne_bytes());
                value += i;
            }
            _ => {
                let op = SendOp::CompareAndSwap {
                    remote_addr: remote.addr(),
                    rkey: remote.mr().rkey(),
                    compare: value,
                    swap: value * 2,
                };
                post_send(&a.qp, send_wr(i, op, local.sge(0, 8)));
                let s = complete(i);
                assert_eq!(
                    (s.wr_id, s.status, s.opcode),
                    (i, WcStatus::Success, WcOpcode::CompSwap)
                );
                assert_eq!(local.read(0, 8), value.to_ne_bytes());
                value *= 2;
            }
        }
        expect[..8].copy_from_slice(&value.to_ne_bytes());
    }
    assert_eq!(remote.read(0, 8), value.to_ne_bytes());
    assert!(
        app_packets(&b.ctx) > 0,
        "the responder's polls never answered"
    );
    assert!(
        app_packets(&a.ctx) > 0,
        "the requester's polls never received"
    );
}

/// Busy-polls a few ping-pongs so that both sides' polls receive (and the
/// engines mute the sockets).
fn warm_up(a: &Side, b: &Side, sbuf: &Mem, rbuf: &Mem) {
    for i in 0..20 {
        post_recv(&b.qp, 100 + i, rbuf.sge(0, 64));
        post_send(&a.qp, send_wr(i, SendOp::Send, sbuf.sge(0, 8)));
        assert_eq!(spin_one(&b.rcq).status, WcStatus::Success);
        assert_eq!(spin_one(&a.scq).status, WcStatus::Success);
    }
}

/// Makes `s`'s engine stop watching the sockets that feed `cq`
/// (as after its poll reported input during a lease of a polling
/// application); the engine is rung to learn of it.
fn force_mute(s: &Side, cq: &Cq) {
    let mut eng = super::super::lock(s.ctx.core());
    let now = Instant::now();
    let until = eng.sh.nanos_at(now + eng.sh.lease);
    let cids: Vec<usize> = eng.cq_feeds[&cq.handle()].to_vec();
    assert!(!cids.is_empty());
    for cid in cids {
        let w = eng.conns[cid].stream.clone().expect("socket");
        w.renew_lease(until);
        eng.mute(cid, now);
        assert!(w.is_muted());
    }
    eng.sh.ring();
}

fn wait_readable(fd: std::os::fd::RawFd, timeout: Duration) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    unsafe { libc::poll(&mut p, 1, timeout.as_millis() as i32) == 1 }
}

fn muted(s: &Side) -> Vec<bool> {
    let eng = super::super::lock(s.ctx.core());
    eng.conns
        .iter()
        .filter_map(|(_, c)| Some(c.stream.as_ref()?.is_muted()))
        .collect()
}

#[test]
fn arming_a_cq_without_channel_hands_the_socket_back_at_once() {
    let (a, b) = pair();
    let sbuf = Mem::new(&a.pd, 64, AccessFlags::LOCAL_WRITE);
    let rbuf = Mem::new(&b.pd, 64, AccessFlags::LOCAL_WRITE);
    warm_up(&a, &b, &sbuf, &rbuf);
    force_mute(&b, &b.rcq);
    // The receiver now sleeps on its channel; a CQ of the connection with
    // no channel to wake anyone is armed too: the engine must deliver.
    post_recv(&b.qp, 7, rbuf.sge(0, 64));
    b.rcq.req_notify(false).expect("arm");
    b.scq.req_notify(false).expect("arm");
    let mut wc = [Completion::EMPTY; 1];
    assert_eq!(b.rcq.poll(&mut wc).expect("poll"), 0);
    assert!(
        muted(&b).iter().all(|m| !m),
        "armed, yet the engine does not watch"
    );
    let sender = std::thread::spawn({
        let qp = a.qp.clone();
        let sge = sbuf.sge(0, 8);
        move || {
            std::thread::sleep(Duration::from_millis(5));
            post_send(&qp, send_wr(99, SendOp::Send, sge));
        }
    });
    assert!(wait_readable(b.ch.fd(), WAIT), "no completion event");
    let deadline = Instant::now() + WAIT;
    while b.ch.get_event().expect("event") != Some(b.rcq.handle()) {
        assert!(Instant::now() < deadline, "no completion event");
        wait_readable(b.ch.fd(), Duration::from_millis(10));
    }
    b.rcq.ack_events(1);
    assert_eq!(b.rcq.poll(&mut wc).expect("poll"), 1);
    assert_eq!((wc[0].wr_id, wc[0].status), (7, WcStatus::Success));
    sender.join().expect("sender");
    assert_eq!(spin_one(&a.scq).status, WcStatus::Success);
}

/// Waits for one completion of `cq` as a sleeping application does:
/// arms, polls once more, sleeps on the channel, takes the events.
/// Returns the completion and the events taken.
fn sleep_one(cq: &Cq, ch: &CompChannel) -> (Completion, u32) {
    let mut wc = [Completion::EMPTY; 1];
    let mut events = 0;
    let deadline = Instant::now() + WAIT;
    loop {
        if cq.poll(&mut wc).expect("poll") == 1 {
            return (wc[0], events);
        }
        cq.req_notify(false).expect("arm");
        if cq.poll(&mut wc).expect("poll") == 1 {
            return (wc[0], events);
        }
        assert!(Instant::now() < deadline, "no completion");
        wait_readable(ch.fd(), Duration::from_millis(100));
        while let Some(h) = ch.get_event().expect("event") {
            assert_eq!(h, cq.handle());
            cq.ack_events(1);
            events += 1;
        }
    }
}

/// Takes one event of `cq` from `ch` if there is one (and acks it).
fn ch_event(ch: &CompChannel, cq: &Cq) -> bool {
    match ch.get_event().expect("event") {
        Some(h) => {
            assert_eq!(h, cq.handle());
            cq.ack_events(1);
            true
        }
        None => false,
    }
}

#[test]
fn a_sleeping_app_receives_itself_when_its_channel_wakes_it() {
    let (a, b) = pair();
    let sbuf = Mem::new(&a.pd, 64, AccessFlags::LOCAL_WRITE);
    let rbuf = Mem::new(&b.pd, 64, AccessFlags::LOCAL_WRITE);
    // One message so that the connection feeds B's CQs.
    post_recv(&b.qp, 100, rbuf.sge(0, 64));
    post_send(&a.qp, send_wr(0, SendOp::Send, sbuf.sge(0, 8)));
    assert_eq!(sleep_one(&b.rcq, &b.ch).0.status, WcStatus::Success);
    assert_eq!(spin_one(&a.scq).status, WcStatus::Success);
    let before = app_packets(&b.ctx);
    let mut events = 0;
    for i in 1..40u64 {
        post_recv(&b.qp, 100 + i, rbuf.sge(0, 64));
        if i == 1 {
            // (So that what follows surely wakes the application, even if
            // this thread stalls while the engine is awake: arming keeps
            // the socket muted.)
            force_mute(&b, &b.rcq);
        }
        sbuf.write(0, &i.to_ne_bytes());
        post_send(&a.qp, send_wr(i, SendOp::Send, sbuf.sge(0, 8)));
        let (r, ev) = sleep_one(&b.rcq, &b.ch);
        events += ev;
        assert_eq!(
            (r.wr_id, r.status, r.byte_len),
            (100 + i, WcStatus::Success, 8),
            "message {i}"
        );
        assert_eq!(rbuf.read(0, 8), i.to_ne_bytes(), "message {i}");
        assert_eq!(spin_one(&a.scq).status, WcStatus::Success);
    }
    assert!(events > 0, "no completion event");
    assert!(
        app_packets(&b.ctx) > before,
        "the sleeping application never received"
    );
    // An unarmed CQ raises no event, whoever receives. First settle what
    // `sleep_one` may leave: it returns with the CQ still armed when its
    // poll after arming found the message, and an event it did not wait for
    // stays on the channel. Drain those; message 40 takes a leftover arm
    // (its event is awaited); message 41's round trip comes after any
    // signal still owed, which the last drain takes.
    let armed = b.rcq.shared.armed();
    while ch_event(&b.ch, &b.rcq) {}
    let round_trip = |i: u64| {
        post_recv(&b.qp, 100 + i, rbuf.sge(0, 64));
        post_send(&a.qp, send_wr(i, SendOp::Send, sbuf.sge(0, 8)));
        assert_eq!(spin_one(&b.rcq).wr_id, 100 + i);
        assert_eq!(spin_one(&a.scq).status, WcStatus::Success);
    };
    round_trip(40);
    let deadline = Instant::now() + WAIT;
    while armed && !ch_event(&b.ch, &b.rcq) {
        assert!(Instant::now() < deadline, "the last arm raised no event");
        wait_readable(b.ch.fd(), Duration::from_millis(100));
    }
    round_trip(41);
    while ch_event(&b.ch, &b.rcq) {}
    assert!(!b.rcq.shared.armed());
    post_recv(&b.qp, 500, rbuf.sge(0, 64));
    post_send(&a.qp, send_wr(50, SendOp::Send, sbuf.sge(0, 8)));
    let deadline = Instant::now() + WAIT;
    while b.rcq.shared.queued() == 0 {
        assert!(Instant::now() < deadline, "not delivered");
        wait_readable(b.ch.fd(), Duration::from_millis(1));
        assert_eq!(b.ch.get_event().expect("event"), None, "unarmed");
    }
    assert_eq!(spin_one(&b.rcq).wr_id, 500);
    assert_eq!(spin_one(&a.scq).status, WcStatus::Success);
}

#[test]
fn a_channel_that_finds_the_engine_at_work_hands_the_socket_back() {
    let (a, b) = pair();
    let sbuf = Mem::new(&a.pd, 64, AccessFlags::LOCAL_WRITE);
    let rbuf = Mem::new(&b.pd, 64, AccessFlags::LOCAL_WRITE);
    warm_up(&a, &b, &sbuf, &rbuf);
    post_recv(&b.qp, 7, rbuf.sge(0, 64));
    // The socket is lent for a lease: a test thread preempted longer than
    // that before its look finds the engine watching it again, as it
    // should, and an engine writing to the connection when the CQ is armed
    // keeps it; such an attempt proves nothing and is made again.
    let deadline = Instant::now() + 3 * WAIT;
    loop {
        force_mute(&b, &b.rcq);
        b.rcq.req_notify(false).expect("arm");
        if muted(&b).iter().any(|&m| m) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "armed: the application receives (no attempt found the socket lent)"
        );
    }
    // The engine is at work (its lock is held) when the packet wakes the
    // application.
    let eng = super::super::lock(b.ctx.core());
    post_send(&a.qp, send_wr(1, SendOp::Send, sbuf.sge(0, 8)));
    assert!(wait_readable(b.ch.fd(), WAIT), "the packet did not wake");
    assert_eq!(b.ch.get_event().expect("event"), None);
    let wires: Vec<_> = eng
        .conns
        .iter()
        .filter_map(|(_, c)| c.stream.clone())
        .collect();
    drop(eng);
    assert!(
        wires.iter().all(|w| !w.is_muted()),
        "the engine was not handed the socket"
    );
    // The engine delivers, with the event of the armed CQ.
    let deadline = Instant::now() + WAIT;
    while b.rcq.shared.queued() == 0 {
        assert!(Instant::now() < deadline, "the engine never delivered");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(wait_readable(b.ch.fd(), WAIT), "no completion event");
    assert_eq!(b.ch.get_event().expect("event"), Some(b.rcq.handle()));
    b.rcq.ack_events(1);
    assert_eq!(spin_one(&b.rcq).wr_id, 7);
    assert_eq!(spin_one(&a.scq).status, WcStatus::Success);
}

#[test]
fn an_expired_lease_hands_the_socket_back() {
    let (a, b) = pair();
    let sbuf = Mem::new(&a.pd, 64, AccessFlags::LOCAL_WRITE);
    let rbuf = Mem::new(&b.pd, 64, AccessFlags::LOCAL_WRITE);
    warm_up(&a, &b, &sbuf, &rbuf);
    // The receiving engine does not watch the socket now; the application
    // stops polling without arming.
    force_mute(&b, &b.rcq);
    post_recv(&b.qp, 8, rbuf.sge(0, 64));
    post_send(&a.qp, send_wr(50, SendOp::Send, sbuf.sge(0, 8)));
    // Nobody polls B: its engine receives once the lease ended.
    let deadline = Instant::now() + WAIT;
    while b.rcq.shared.queued() == 0 {
        assert!(
            Instant::now() < deadline,
            "the engine never took the socket back"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let eng = super::super::lock(b.ctx.core());
    assert!(eng.muted.is_empty());
    drop(eng);
    let r = spin_one(&b.rcq);
    assert_eq!((r.wr_id, r.status), (8, WcStatus::Success));
    assert_eq!(spin_one(&a.scq).status, WcStatus::Success);
}

#[test]
fn acks_held_by_a_receive_that_stops_polling_still_leave() {
    let (a, b) = pair();
    let sbuf = Mem::new(&a.pd, 64, AccessFlags::LOCAL_WRITE);
    let rbuf = Mem::new(&b.pd, 64, AccessFlags::LOCAL_WRITE);
    warm_up(&a, &b, &sbuf, &rbuf);
    // Let the receiver's engine take its socket back and sleep without a
    // deadline; then keep what arrives from waking it (as when the
    // application reads it before the engine's poll looks): the socket's
    // input is not watched, and the engine does not know.
    std::thread::sleep(Duration::from_millis(10));
    let wires: Vec<_> = {
        let eng = super::super::lock(b.ctx.core());
        let now = Instant::now();
        let until = eng.sh.nanos_at(now + Duration::from_secs(60));
        eng.cq_feeds[&b.rcq.handle()]
            .iter()
            .filter_map(|&cid| eng.conns[cid].stream.clone())
            .inspect(|w| {
                w.renew_lease(until);
                assert!(w.mute(&eng.sh.registry, eng.sh.nanos_at(now), || false));
            })
            .collect()
    };
    post_recv(&b.qp, 300, rbuf.sge(0, 64));
    post_send(&a.qp, send_wr(30, SendOp::Send, sbuf.sge(0, 8)));
    // The receiver's poll receives (holding the ACK for an answer that
    // never comes), then the receiver stops polling.
    let r = spin_one(&b.rcq);
    assert_eq!((r.wr_id, r.status), (300, WcStatus::Success));
    // The requester's SEND completes (its ACK was sent), not with
    // RETRY_EXC_ERR after its timeouts.
    let s = spin_one(&a.scq);
    assert_eq!((s.wr_id, s.status), (30, WcStatus::Success));
    for w in wires {
        w.revoke(&b.ctx.shared().registry);
    }
}

#[test]
fn arming_while_the_engine_writes_to_the_connection_leaves_it_to_the_engine() {
    let (a, b) = pair();
    let sbuf = Mem::new(&a.pd, 64, AccessFlags::LOCAL_WRITE);
    let rbuf = Mem::new(&b.pd, 64, AccessFlags::LOCAL_WRITE);
    warm_up(&a, &b, &sbuf, &rbuf);
    force_mute(&b, &b.rcq);
    // The engine has output for the connection (as in a bulk transfer)
    // when the application arms: the engine receives, and the socket does
    // not wake the application's channel.
    let eng = super::super::lock(b.ctx.core());
    let wires: Vec<_> = eng
        .conns
        .iter()
        .filter_map(|(_, c)| c.stream.clone())
        .collect();
    for w in &wires {
        w.claim();
    }
    b.rcq.req_notify(false).expect("arm");
    for w in &wires {
        assert!(!w.is_muted(), "the engine does not watch");
        assert!(!b.ch.shared.holds(w), "the channel wakes for it");
        w.release(true);
    }
    drop(eng);
    post_recv(&b.qp, 9, rbuf.sge(0, 64));
    post_send(&a.qp, send_wr(9, SendOp::Send, sbuf.sge(0, 8)));
    let (r, _) = sleep_one(&b.rcq, &b.ch);
    assert_eq!((r.wr_id, r.status), (9, WcStatus::Success));
    assert_eq!(spin_one(&a.scq).status, WcStatus::Success);
}

#[test]
fn the_engine_does_not_stay_awake_for_acks_an_application_holds() {
    let (a, b) = pair();
    let sbuf = Mem::new(&a.pd, 64, AccessFlags::LOCAL_WRITE);
    let rbuf = Mem::new(&b.pd, 64, AccessFlags::LOCAL_WRITE);
    let abuf = Mem::new(&a.pd, 64, AccessFlags::LOCAL_WRITE);
    let bbuf = Mem::new(&b.pd, 64, AccessFlags::LOCAL_WRITE);
    warm_up(&a, &b, &sbuf, &rbuf);
    // Each poll of the receive renews the lease for the usual short time:
    // a test thread preempted longer than that while it polls, or between
    // its poll and its look at the engine, finds the lease ended and the
    // ACK sent by the engine, as it should be. Such an attempt proves
    // nothing and is made again (a loaded machine); one made within half a
    // lease must find the ACK held.
    let deadline = Instant::now() + 3 * WAIT;
    let mut wr_id = 7;
    let wires = loop {
        assert!(
            Instant::now() < deadline,
            "no attempt looked at the engine within a lease of its receive"
        );
        // B's application drives its socket (a long lease, so that the
        // test decides when it ends), and the ACK of what it receives
        // waits long for its answer.
        let wires: Vec<_> = {
            let mut eng = super::super::lock(b.ctx.core());
            eng.ack_delay = Duration::from_secs(60);
            let now = Instant::now();
            let until = eng.sh.nanos_at(now + Duration::from_secs(60));
            let cids: Vec<usize> = eng.cq_feeds[&b.rcq.handle()].to_vec();
            cids.into_iter()
                .map(|cid| {
                    // (The warm-up sent one way only: B's holds had
                    // stopped paying; an application that answers makes
                    // them pay.)
                    eng.conns[cid].hold_pays = true;
                    let w = eng.conns[cid].stream.clone().expect("socket");
                    w.renew_lease(until);
                    eng.mute(cid, now);
                    w
                })
                .collect()
        };
        wr_id += 1;
        post_recv(&b.qp, wr_id, rbuf.sge(0, 64));
        // (Every poll renews the lease to a lease from then: it cannot end
        // within a lease of this instant.)
        let sent = Instant::now();
        post_send(&a.qp, send_wr(wr_id, SendOp::Send, sbuf.sge(0, 8)));
        let r = spin_one(&b.rcq);
        assert_eq!((r.wr_id, r.status), (wr_id, WcStatus::Success));
        let eng = super::super::lock(b.ctx.core());
        if eng.held.is_empty() {
            assert!(
                sent.elapsed() >= eng.sh.lease / 2,
                "the receive does not hold the ACK"
            );
            drop(eng);
            // (The engine sent the ACK: the send completes.)
            let s = spin_one(&a.scq);
            assert_eq!((s.wr_id, s.status), (wr_id, WcStatus::Success));
            continue;
        }
        // The application holds its lease again, long.
        let until = eng.sh.nanos_at(Instant::now() + Duration::from_secs(60));
        for w in &wires {
            w.renew_lease(until);
        }
        assert!(
            !eng.awaits_post_for_held(Instant::now()),
            "the engine stays awake for the application's post"
        );
        // Once the lease ended, held ACKs are the engine's to wait for.
        for w in &wires {
            w.renew_lease(0);
        }
        assert!(eng.awaits_post_for_held(Instant::now()));
        let until = eng.sh.nanos_at(Instant::now() + Duration::from_secs(60));
        for w in &wires {
            w.renew_lease(until);
        }
        break wires;
    };
    // B's answer takes the ACK along.
    post_recv(&a.qp, 8, abuf.sge(0, 64));
    post_send(&b.qp, send_wr(8, SendOp::Send, bbuf.sge(0, 8)));
    assert_eq!(spin_one(&a.rcq).status, WcStatus::Success);
    let s = spin_one(&a.scq);
    assert_eq!((s.wr_id, s.status), (wr_id, WcStatus::Success));
    assert_eq!(spin_one(&b.scq).status, WcStatus::Success);
    for w in wires {
        w.revoke(&b.ctx.shared().registry);
    }
}

#[test]
fn arming_takes_the_socket_from_the_engine_until_the_lease_ends() {
    let (a, b) = pair();
    let sbuf = Mem::new(&a.pd, 64, AccessFlags::LOCAL_WRITE);
    let rbuf = Mem::new(&b.pd, 64, AccessFlags::LOCAL_WRITE);
    warm_up(&a, &b, &sbuf, &rbuf);
    // (The sockets that feed the CQ: the engines may hold another
    // connection between them, which no arming of this CQ concerns.)
    let wires: Vec<_> = {
        let eng = super::super::lock(b.ctx.core());
        eng.cq_feeds[&b.rcq.handle()]
            .iter()
            .filter_map(|&cid| eng.conns[cid].stream.clone())
            .collect()
    };
    post_recv(&b.qp, 7, rbuf.sge(0, 64));
    // Arming lends the socket for a lease: a test thread preempted longer
    // than that before its look finds the engine watching it again, as it
    // should; such an attempt proves nothing and is made again.
    let deadline = Instant::now() + 3 * WAIT;
    loop {
        assert!(
            Instant::now() < deadline,
            "no attempt looked at the socket within a lease of arming"
        );
        // The engine watches the socket (as after a hand-back, or an ended
        // lease).
        for w in &wires {
            w.revoke(&b.ctx.shared().registry);
            assert!(!w.is_muted());
        }
        // Arming puts it in the channel's set: the application wakes for
        // what arrives, and the engine need not.
        let armed = Instant::now();
        b.rcq.req_notify(false).expect("arm");
        let in_set = b
            .rcq
            .shared
            .feeds
            .lock()
            .expect("feeds")
            .iter()
            .all(|w| b.ch.shared.holds(w));
        let muted = wires.iter().all(|w| w.is_muted());
        if in_set && muted {
            break;
        }
        assert!(
            armed.elapsed() >= b.ctx.shared().lease / 2,
            "both the engine and the application wake for the next packet \
             (in the channel's set: {in_set}, engine muted: {muted}; per socket \
             (muted, engine busy, closed, lease until, in the set): {:?}; now {})",
            wires
                .iter()
                .map(|w| (
                    w.is_muted(),
                    w.engine_busy(),
                    w.is_closed(),
                    w.lease_until(),
                    b.ch.shared.holds(w)
                ))
                .collect::<Vec<_>>(),
            b.ctx.shared().nanos_at(Instant::now())
        );
    }
    post_send(&a.qp, send_wr(7, SendOp::Send, sbuf.sge(0, 8)));
    let (r, _) = sleep_one(&b.rcq, &b.ch);
    assert_eq!((r.wr_id, r.status), (7, WcStatus::Success));
    assert_eq!(spin_one(&a.scq).status, WcStatus::Success);
    // Nobody arms or polls any more: the engine watches the socket again
    // once the lease ended.
    let deadline = Instant::now() + WAIT;
    while wires.iter().any(|w| w.is_muted()) {
        assert!(
            Instant::now() < deadline,
            "the engine never took the socket back"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn an_engine_woken_only_for_leases_does_not_wait_for_a_receiving_application() {
    let (a, b) = pair();
    let sbuf = Mem::new(&a.pd, 64, AccessFlags::LOCAL_WRITE);
    let rbuf = Mem::new(&b.pd, 64, AccessFlags::LOCAL_WRITE);
    warm_up(&a, &b, &sbuf, &rbuf);
    force_mute(&b, &b.rcq);
    let sh = b.ctx.shared();
    let cids: Vec<usize> = {
        let eng = super::super::lock(b.ctx.core());
        eng.cq_feeds[&b.rcq.handle()].to_vec()
    };
    let wires: Vec<_> = {
        let eng = super::super::lock(b.ctx.core());
        cids.iter()
            .filter_map(|&cid| eng.conns[cid].stream.clone())
            .collect()
    };
    let renew = || {
        let until = sh.nanos_at(Instant::now() + sh.lease);
        for w in &wires {
            w.renew_lease(until);
        }
    };
    // An application keeps renewing the lease; the engine sleeps until the
    // lease's end (its first deadline: the next one is far later). Then the
    // application receives (holds the engine lock) and renews the lease
    // meanwhile: once the old end passed, the engine sleeps on (a later
    // `wake_by`) instead of waiting for the lock. An engine woken by an
    // event instead (one of its own timers, a socket becoming writable)
    // waits for its lock by design: such an attempt proves nothing, so it
    // is retried (on a loaded machine many attempts may find the engine
    // woken by something else), until a bound that only an engine that
    // always waits for the lock reaches.
    let give_up = Instant::now() + 3 * WAIT;
    let mut attempts = 0;
    let (eng, until) = loop {
        attempts += 1;
        let deadline = Instant::now() + WAIT;
        let (eng, until) = loop {
            assert!(Instant::now() < deadline, "the engine never slept");
            renew();
            let mut eng = super::super::lock(b.ctx.core());
            if !wires.iter().all(|w| w.is_muted()) {
                // (This thread was too slow: the lease had ended.)
                let now = Instant::now();
                for &cid in &cids {
                    eng.mute(cid, now);
                }
                let wakes = sh.wakes.load(Ordering::SeqCst);
                let was_sleeping = sh.sleeping.load(Ordering::SeqCst);
                sh.ring();
                drop(eng);
                // Until the engine has taken the ring (it counts a wake-up
                // once it holds its lock; it may be asleep again by the
                // time this thread looks): a ring still pending would wake
                // it with an event, and an engine woken by an event waits
                // for its lock, which the check below would then hold.
                while was_sleeping && sh.wakes.load(Ordering::SeqCst) == wakes {
                    assert!(Instant::now() < deadline, "the engine never took the ring");
                    std::thread::sleep(Duration::from_micros(50));
                }
                continue;
            }
            let until = sh.wake_by.load(Ordering::SeqCst);
            let soon = sh.nanos_at(Instant::now() + 2 * sh.lease);
            if sh.sleeping.load(Ordering::SeqCst)
                && until <= soon
                && wires.iter().all(|w| w.is_muted())
            {
                break (eng, until);
            }
            drop(eng);
            std::thread::sleep(Duration::from_micros(200));
        };
        // (A lease is a millisecond: an engine asleep for its lease only
        // wakes well within this, unless the machine is loaded, when the
        // attempt is made again.)
        let bound = Instant::now() + Duration::from_millis(500);
        while sh.wake_by.load(Ordering::SeqCst) == until && Instant::now() < bound {
            renew();
            std::thread::sleep(Duration::from_micros(200));
        }
        if sh.wake_by.load(Ordering::SeqCst) != until {
            break (eng, until);
        }
        drop(eng);
        assert!(
            Instant::now() < give_up,
            "the engine waits for the application's lock ({attempts} attempts)"
        );
    };
    assert!(sh.sleeping.load(Ordering::SeqCst));
    // ... but not forever: after a few leases it waits for its lock (its
    // timers must run).
    let mut seen = vec![until, sh.wake_by.load(Ordering::SeqCst)];
    let end = Instant::now() + 20 * sh.lease;
    while Instant::now() < end {
        renew();
        let w = sh.wake_by.load(Ordering::SeqCst);
        if seen.last() != Some(&w) {
            seen.push(w);
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    assert!(
        seen.len() - 1 <= super::super::engine::LEASE_SKIPS as usize,
        "the engine skipped its turn {} times",
        seen.len() - 1
    );
    drop(eng);
    // Everything works on.
    post_recv(&b.qp, 9, rbuf.sge(0, 64));
    post_send(&a.qp, send_wr(9, SendOp::Send, sbuf.sge(0, 8)));
    assert_eq!(spin_one(&b.rcq).wr_id, 9);
    assert_eq!(spin_one(&a.scq).status, WcStatus::Success);
}

#[test]
fn an_engine_woken_only_for_renewed_leases_sleeps_on_without_a_loop_turn() {
    let (a, b) = pair();
    let sbuf = Mem::new(&a.pd, 64, AccessFlags::LOCAL_WRITE);
    let rbuf = Mem::new(&b.pd, 64, AccessFlags::LOCAL_WRITE);
    warm_up(&a, &b, &sbuf, &rbuf);
    force_mute(&b, &b.rcq);
    let sh = b.ctx.shared();
    let wires: Vec<_> = {
        let eng = super::super::lock(b.ctx.core());
        eng.cq_feeds[&b.rcq.handle()]
            .iter()
            .filter_map(|&cid| eng.conns[cid].stream.clone())
            .collect()
    };
    // An application keeps renewing its leases between its receives,
    // without holding the engine lock (as while it writes a large
    // payload): the engine, woken for a lease's end, finds it renewed and
    // sleeps on without taking its lock.
    let before = sh.lease_sleeps.load(Ordering::SeqCst);
    let deadline = Instant::now() + WAIT;
    while sh.lease_sleeps.load(Ordering::SeqCst) == before {
        assert!(
            Instant::now() < deadline,
            "the engine never slept on for renewed leases"
        );
        let until = sh.nanos_at(Instant::now() + sh.lease);
        for w in &wires {
            w.renew_lease(until);
        }
        if !wires.iter().all(|w| w.is_muted()) {
            // (This thread was too slow: the lease had ended.)
            force_mute(&b, &b.rcq);
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    // Everything works on, once the leases end too.
    std::thread::sleep(2 * sh.lease);
    post_recv(&b.qp, 9, rbuf.sge(0, 64));
    post_send(&a.qp, send_wr(9, SendOp::Send, sbuf.sge(0, 8)));
    assert_eq!(spin_one(&b.rcq).wr_id, 9);
    assert_eq!(spin_one(&a.scq).status, WcStatus::Success);
}

#[test]
fn an_engine_asleep_for_leases_a_polling_application_renews_does_not_wake_for_them() {
    let (a, b) = pair();
    let sbuf = Mem::new(&a.pd, 64, AccessFlags::LOCAL_WRITE);
    let rbuf = Mem::new(&b.pd, 64, AccessFlags::LOCAL_WRITE);
    warm_up(&a, &b, &sbuf, &rbuf);
    force_mute(&b, &b.rcq);
    let sh = b.ctx.shared();
    // B's application busy-polls its receive CQ (nothing arrives): every
    // poll that finds the engine asleep receives itself and renews the
    // lease on the socket. The engine, asleep until the lease's end for it
    // only, used to wake at every end to find the lease renewed (a
    // `lease_sleep`, two thread switches), once a lease; the renewals now
    // move its timer instead. A poll that comes over half a lease after
    // the one before (this thread was descheduled) may find the engine's
    // timer too close to move: such late polls are counted and allowed a
    // wake-up each (as are leases that ended meanwhile: the socket is
    // muted again then).
    let mut out = [Completion::EMPTY; 4];
    let leases = 100u32;
    let before = sh.lease_sleeps.load(Ordering::SeqCst);
    let moves = sh.lease_moves.load(Ordering::SeqCst);
    let start = Instant::now();
    let mut last = start;
    let mut late = 0u64;
    while last.duration_since(start) < leases * sh.lease {
        assert_eq!(b.rcq.poll(&mut out).expect("poll"), 0);
        std::thread::sleep(sh.lease / 10);
        let now = Instant::now();
        if now.duration_since(last) > sh.lease / 2 {
            late += 1;
        }
        if !muted(&b).iter().all(|m| *m) {
            // (This thread was too slow: the lease had ended, and the
            // engine took the socket back.)
            late += 1;
            force_mute(&b, &b.rcq);
        }
        last = Instant::now();
    }
    let sleeps = sh.lease_sleeps.load(Ordering::SeqCst) - before;
    assert!(
        sleeps <= late + 2,
        "the engine woke {sleeps} times for leases renewed all along \
         ({late} of the polls came late, over {leases} leases)"
    );
    assert!(
        sh.lease_moves.load(Ordering::SeqCst) > moves,
        "no renewal moved the engine's sleep"
    );
    // Once the application stops polling, the lease ends and the engine
    // takes the socket back: it receives what arrives without the
    // application's poll.
    std::thread::sleep(2 * sh.lease);
    post_recv(&b.qp, 9, rbuf.sge(0, 64));
    post_send(&a.qp, send_wr(9, SendOp::Send, sbuf.sge(0, 8)));
    assert_eq!(spin_one(&a.scq).status, WcStatus::Success);
    assert!(
        muted(&b).iter().all(|m| !m),
        "B's engine took its socket back"
    );
    assert_eq!(spin_one(&b.rcq).wr_id, 9);
}

#[test]
fn arming_sends_the_acks_a_receive_held_for_a_request_that_does_not_come() {
    // No ACK timeout: only B's ACK completes A's SEND (no resend).
    let (a, b) = pair_with(RtsAttr {
        timeout: 0,
        ..RtsAttr::default()
    });
    let sbuf = Mem::new(&a.pd, 64, AccessFlags::LOCAL_WRITE);
    let rbuf = Mem::new(&b.pd, 64, AccessFlags::LOCAL_WRITE);
    warm_up(&a, &b, &sbuf, &rbuf);
    // B's receives hold their ACK long for an answer (as in a
    // request-reply exchange, where holds pay), and the engine leaves the
    // socket to B's application for long.
    let wires: Vec<_> = {
        let mut eng = super::super::lock(b.ctx.core());
        eng.ack_delay = Duration::from_secs(60);
        let now = Instant::now();
        let until = eng.sh.nanos_at(now + Duration::from_secs(60));
        // (The ACK leaves on the connection B's requests to A would use,
        // which may be another one than the one A's requests arrive on.)
        for (_, c) in eng.conns.iter_mut() {
            c.hold_pays = true;
        }
        let cids: Vec<usize> = eng.cq_feeds[&b.rcq.handle()].to_vec();
        for cid in cids {
            eng.conns[cid]
                .stream
                .as_ref()
                .expect("socket")
                .renew_lease(until);
            eng.mute(cid, now);
        }
        eng.conns
            .iter()
            .filter_map(|(_, c)| c.stream.clone())
            .collect()
    };
    let late = b.ctx.shared().late_holds.load(Ordering::SeqCst);
    post_recv(&b.qp, 300, rbuf.sge(0, 64));
    post_send(&a.qp, send_wr(30, SendOp::Send, sbuf.sge(0, 8)));
    let r = spin_one(&b.rcq);
    assert_eq!((r.wr_id, r.status), (300, WcStatus::Success));
    assert!(
        !super::super::lock(b.ctx.core()).held.is_empty(),
        "the receive holds the ACK"
    );
    // B has nothing to answer and goes to sleep: arming its CQ sends the
    // held ACK, which A's SEND waits for (before, it waited for the hold to
    // end, at the engine's wake-up a lease later than that).
    b.rcq.req_notify(false).expect("arm");
    let s = spin_one(&a.scq);
    assert_eq!((s.wr_id, s.status), (30, WcStatus::Success));
    assert!(wires.iter().all(|w| w.held_gone()));
    // B's engine did not send it late (nor at all: it is still asleep or
    // finds the hold taken along).
    assert_eq!(b.ctx.shared().late_holds.load(Ordering::SeqCst), late);
    // The connection still works both ways; holds still pay.
    post_recv(&b.qp, 301, rbuf.sge(0, 64));
    post_send(&a.qp, send_wr(31, SendOp::Send, sbuf.sge(0, 8)));
    assert_eq!(spin_one(&b.rcq).wr_id, 301);
    assert!(super::super::lock(b.ctx.core())
        .conns
        .iter()
        .any(|(_, c)| c.hold_pays));
    b.rcq.req_notify(false).expect("arm");
    assert_eq!(spin_one(&a.scq).wr_id, 31);
    for w in wires {
        w.revoke(&b.ctx.shared().registry);
    }
}

#[test]
fn a_polling_application_that_answers_does_not_wake_its_engine_by_time() {
    // No ACK timeout: the WRs leave the engine no deadline of their own.
    let (a, b) = pair_with(RtsAttr {
        timeout: 0,
        ..RtsAttr::default()
    });
    let sbuf = Mem::new(&a.pd, 64, AccessFlags::LOCAL_WRITE);
    let rbuf = Mem::new(&b.pd, 64, AccessFlags::LOCAL_WRITE);
    let abuf = Mem::new(&a.pd, 64, AccessFlags::LOCAL_WRITE);
    let bbuf = Mem::new(&b.pd, 64, AccessFlags::LOCAL_WRITE);
    warm_up(&a, &b, &sbuf, &rbuf);
    force_mute(&b, &b.rcq);
    let sh = b.ctx.shared();
    // B's application busy-polls and answers every message A sends (a
    // request-reply exchange: its receives hold each ACK for the answer,
    // which takes it along), two leases apart. Its engine, asleep for the
    // lease on the muted socket (which the polls renew), has nothing to
    // do: the ACKs held on that socket used to be noted as a need of their
    // own (their hold plus a lease), and the engine's next wake-up for
    // leases became a whole loop turn, one per exchange; and it woke every
    // 10 ms while posting threads transmitted (a tick for their WRs'
    // timeouts, which their posts note for it). Allowed: a wake-up for
    // each poll that came over half a lease late (this thread was
    // descheduled: the renewal could not move the engine's timer) and for
    // each lease that ended meanwhile (the socket is muted again).
    let mut out = [Completion::EMPTY; 4];
    let exchanges = 60u64;
    let wakes = sh.timer_wakes.load(Ordering::SeqCst);
    let began = Instant::now();
    let mut late = 0u64;
    for i in 0..exchanges {
        post_recv(&b.qp, 1000 + i, rbuf.sge(0, 64));
        post_recv(&a.qp, 2000 + i, abuf.sge(0, 64));
        post_send(&a.qp, send_wr(3000 + i, SendOp::Send, sbuf.sge(0, 8)));
        let r = spin_one(&b.rcq);
        assert_eq!((r.wr_id, r.status), (1000 + i, WcStatus::Success));
        post_send(&b.qp, send_wr(4000 + i, SendOp::Send, bbuf.sge(0, 8)));
        assert_eq!(spin_one(&a.rcq).wr_id, 2000 + i);
        assert_eq!(spin_one(&a.scq).wr_id, 3000 + i);
        assert_eq!(spin_one(&b.scq).wr_id, 4000 + i);
        // B polls on for two leases before the next message.
        let start = Instant::now();
        let mut last = start;
        while last.duration_since(start) < 2 * sh.lease {
            assert_eq!(b.rcq.poll(&mut out).expect("poll"), 0);
            std::thread::sleep(sh.lease / 10);
            let now = Instant::now();
            if now.duration_since(last) > sh.lease / 2 {
                late += 1;
            }
            if !muted(&b).iter().all(|m| *m) {
                late += 1;
                force_mute(&b, &b.rcq);
            }
            last = Instant::now();
        }
    }
    let turns = sh.timer_wakes.load(Ordering::SeqCst) - wakes;
    assert!(
        turns <= late + 4,
        "B's engine woke by time {turns} times in {exchanges} answered exchanges, \
         two leases apart, in {:?} ({late} of the polls came late)",
        began.elapsed()
    );
}
