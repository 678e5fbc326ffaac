//! When an RC QP's ACK timer counts, seen from a fake remote engine (a TCP
//! socket speaking the soft wire format) that holds or answers the
//! engine's probes: nothing counts while a probe is unanswered (the
//! connection may still be recovering), each answered probe without an ACK
//! counts one retry, and a peer that answers no probe and sends nothing is
//! dead after `peer_timeout`. (A unit test: the wire format is private.)

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::fake_peer_tests::{exchange_hello, next_packet, poll_n, rtr, Mem, FAKE_QPN, WAIT};
use super::packet::{Header, Opcode};
use super::{Context, Cq, Qp};
use crate::provider::{
    AccessFlags, Completion, InitAttr, QpCaps, QpState, RtsAttr, SendFlags, SendOp, SendWr,
    SoftConfig, WcStatus,
};

/// A QP whose peer is the fake engine, one SEND posted; the fake's
/// connection after the HELLOs and that SEND.
struct Setup {
    _ctx: Context,
    qp: Qp,
    scq: Cq,
    _mem: Mem,
    peer: TcpStream,
    posted: Instant,
}

fn setup(config: SoftConfig, rts: RtsAttr) -> Setup {
    setup_among(config, rts, 0).0
}

/// [`setup`], its QP created after `idle` others (in INIT: the engine
/// knows them, they have no timer), which are returned.
fn setup_among(config: SoftConfig, rts: RtsAttr, idle: usize) -> (Setup, Vec<Qp>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let fake_addr = listener.local_addr().unwrap();
    let ctx = Context::open(config).expect("open");
    let pd = ctx.alloc_pd().expect("pd");
    let scq = ctx.create_cq(64, None).expect("cq");
    let rcq = ctx.create_cq(64, None).expect("cq");
    let others: Vec<Qp> = (0..idle)
        .map(|_| {
            let qp = pd.create_qp(&scq, &rcq, QpCaps::default()).expect("qp");
            qp.modify_to_init(&InitAttr::default()).expect("init");
            qp
        })
        .collect();
    let qp = pd.create_qp(&scq, &rcq, QpCaps::default()).expect("qp");
    let mut ep = qp.endpoint(0).unwrap();
    ep.addr = fake_addr.into();
    ep.qpn = FAKE_QPN;
    qp.modify_to_init(&InitAttr::default()).expect("init");
    qp.modify_to_rtr(&rtr(ep)).expect("rtr");
    qp.modify_to_rts(&rts).expect("rts");
    let mut mem = vec![0u64; 1].into_boxed_slice();
    // SAFETY: the boxed memory outlives the registration (`Mem::drop`
    // deregisters first).
    let mr =
        unsafe { pd.reg_mr(mem.as_mut_ptr().cast(), 8, AccessFlags::LOCAL_WRITE) }.expect("reg");
    let mem = Mem { mr: Some(mr), mem };
    let w = SendWr {
        wr_id: 1,
        op: SendOp::Send,
        sg_list: [mem.sge(0, 8)].into_iter().collect(),
        flags: SendFlags::SIGNALED,
    };
    // SAFETY: the SGE lies in `mem`'s registration, alive until the end.
    unsafe { qp.post_send(&[w]) }.unwrap();
    let posted = Instant::now();
    let (mut peer, _) = listener.accept().unwrap();
    exchange_hello(&mut peer, fake_addr);
    let (send, _) = next_packet(&mut peer).expect("the SEND");
    assert_eq!(send.opcode, Opcode::Send);
    let s = Setup {
        _ctx: ctx,
        qp,
        scq,
        _mem: mem,
        peer,
        posted,
    };
    (s, others)
}

fn poll_none(cq: &Cq) -> Option<Completion> {
    let mut buf = [Completion::EMPTY; 1];
    (cq.poll(&mut buf).expect("poll") == 1).then_some(buf[0])
}

/// 4.096 µs × 2^12 ≈ 16.8 ms.
const SHORT: u8 = 12;

#[test]
fn an_ack_timeout_counts_only_once_its_probe_is_answered() {
    let retry_cnt = 2;
    let mut s = setup(
        SoftConfig::default(),
        RtsAttr {
            timeout: SHORT,
            retry_cnt,
            ..RtsAttr::default()
        },
    );
    // Hold the probe for ~18 ACK timeouts: the connection might still be
    // recovering, so nothing counts, and no second probe is sent.
    s.peer
        .set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let (ping, _) = next_packet(&mut s.peer).expect("a probe");
    assert_eq!(ping.opcode, Opcode::Ping);
    assert!(next_packet(&mut s.peer).is_none(), "one probe at a time");
    assert_eq!(
        poll_none(&s.scq),
        None,
        "the QP failed while its probe was unanswered"
    );
    assert_eq!(s.qp.state(), QpState::Rts);
    // Answer every probe, never the SEND: each answer counts one retry;
    // the answer to the (retry_cnt + 1)-th fails the SEND.
    s.peer.set_read_timeout(Some(WAIT)).unwrap();
    let mut next = Some(ping);
    let mut answered = 0;
    while let Some(p) = next.take() {
        assert_eq!(p.opcode, Opcode::Ping, "{p:?}");
        let mut pong = Header::new(Opcode::Pong);
        pong.arg0 = p.arg0;
        s.peer.write_all(&pong.encode()).unwrap();
        answered += 1;
        if answered <= retry_cnt {
            next = next_packet(&mut s.peer).map(|(h, _)| h);
        }
    }
    let c = poll_n(&s.scq, 1);
    assert_eq!((c[0].wr_id, c[0].status), (1, WcStatus::RetryExcErr));
    assert_eq!(answered, retry_cnt + 1);
}

#[test]
fn a_peer_that_answers_no_probe_and_sends_nothing_is_dead_after_the_peer_timeout() {
    let bound = Duration::from_secs(1);
    let s = setup(
        SoftConfig {
            peer_timeout: bound,
            ..SoftConfig::default()
        },
        RtsAttr {
            timeout: SHORT,
            ..RtsAttr::default()
        },
    );
    // (The fake's kernel acknowledges everything: TCP sees a live peer.)
    let c = poll_n(&s.scq, 1);
    let took = s.posted.elapsed();
    assert_eq!((c[0].wr_id, c[0].status), (1, WcStatus::RetryExcErr));
    assert_eq!(s.qp.state(), QpState::Err);
    assert!(took >= bound, "failed after {took:?}, before the bound");
    assert!(took < bound * 5, "failed only after {took:?}");
}

#[test]
fn a_due_timer_among_thousands_of_idle_qps_fires_and_idle_ones_are_never_looked_at() {
    const IDLE: usize = 5000;
    let (mut s, idle) = setup_among(
        SoftConfig::default(),
        RtsAttr {
            timeout: SHORT,
            ..RtsAttr::default()
        },
        IDLE,
    );
    // The last QP's ACK timer fires: its probe comes.
    let (ping, _) = next_packet(&mut s.peer).expect("a probe");
    assert_eq!(ping.opcode, Opcode::Ping);
    // Hold the probe over several more ACK timeouts (many engine turns).
    s.peer
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    assert!(next_packet(&mut s.peer).is_none(), "one probe at a time");
    let visits = super::lock(s._ctx.core()).deadlines.visits;
    // Only the timed QP is looked at, once per expiry; one scan of every
    // QP would look at more than `IDLE`.
    assert!(visits >= 1, "the due timer was never looked at");
    assert!(
        visits < IDLE as u64 / 10,
        "{visits} QP deadlines looked at: idle QPs are scanned"
    );
    drop(idle);
}
