//! Soft device, UD queue pairs: the QP state machine and what posts refuse,
//! address handles, datagrams between two devices and inside one (GRH,
//! completions, immediate data, solicited events), what a receiver drops
//! and counts, and the fault injection.

mod common;

use std::net::Ipv4Addr;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use common::*;
use verbio_runtime::provider::soft::{UdCounters, UdFaults};
use verbio_runtime::provider::*;

const SIG: SendFlags = SendFlags::SIGNALED;
const QKEY: u32 = DEFAULT_QKEY;

/// Counts heap allocations per thread (see
/// `posting_and_polling_datagrams_do_not_allocate`).
struct Counting;

thread_local! {
    static ALLOCS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

fn count_alloc() {
    let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
}

// SAFETY: forwards to the system allocator; only counts calls.
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        count_alloc();
        // SAFETY: forwarded contract.
        unsafe { std::alloc::System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: forwarded contract.
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        count_alloc();
        // SAFETY: forwarded contract.
        unsafe { std::alloc::System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        count_alloc();
        // SAFETY: forwarded contract.
        unsafe { std::alloc::System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocs() -> u64 {
    ALLOCS.with(|c| c.get())
}

/// A UD QP in RTS with its own CQs (the receive CQ optionally on a channel).
struct Ud {
    ctx: Context,
    pd: Pd,
    scq: Cq,
    rcq: Cq,
    qp: Qp,
}

impl Ud {
    fn new(ctx: &Context, qkey: u32) -> Ud {
        Ud::with(ctx, qkey, None, QpCaps::default())
    }

    fn with(ctx: &Context, qkey: u32, ch: Option<&CompChannel>, caps: QpCaps) -> Ud {
        let pd = ctx.alloc_pd().expect("pd");
        let scq = ctx.create_cq(1024, None).expect("cq");
        let rcq = ctx.create_cq(1024, ch).expect("cq");
        let qp = pd.create_ud_qp(&scq, &rcq, caps).expect("ud qp");
        qp.modify_ud_to_rts(&UdAttr {
            qkey,
            ..UdAttr::default()
        })
        .expect("ud rts");
        Ud {
            ctx: ctx.clone(),
            pd,
            scq,
            rcq,
            qp,
        }
    }

    fn buf(&self, len: usize) -> RegBuf {
        RegBuf::new(&self.pd, len, LW)
    }

    /// An address handle for `to`'s port.
    fn ah(&self, to: &Ud) -> AddressHandle {
        let ep = to.qp.endpoint(0).expect("endpoint");
        self.pd
            .create_ah(&AhAttr::to_endpoint(&ep, 0))
            .expect("create_ah")
    }

    fn counters(&self) -> UdCounters {
        self.ctx.as_soft().expect("soft device").ud_counters()
    }

    /// Posts `n` receives of `len` bytes each at `buf` (ids `base..`).
    fn post_recvs(&self, buf: &RegBuf, base: u64, n: usize, len: usize) {
        let wrs: Vec<RecvWr> = (0..n)
            .map(|i| rwr(base + i as u64, &[buf.sge(i * len, len)]))
            .collect();
        // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
        unsafe { self.qp.post_recv(&wrs) }.expect("post_recv");
    }

    /// Posts one datagram.
    fn send_to(
        &self,
        id: u64,
        dest: UdDest,
        imm: Option<u32>,
        sges: &[Sge],
        flags: SendFlags,
    ) -> Result<(), PostError> {
        // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
        unsafe {
            self.qp
                .post_send(&[wr(id, SendOp::SendTo { dest, imm }, sges, flags)])
        }
    }
}

fn dest(ah: &AddressHandle, to: &Ud, qkey: u32) -> UdDest {
    UdDest {
        ah: ah.raw(),
        remote_qpn: to.qp.qp_num(),
        remote_qkey: qkey,
    }
}

fn ipv4_of(gid: Gid) -> [u8; 4] {
    let v6 = std::net::Ipv6Addr::from(gid.0);
    v6.to_ipv4_mapped()
        .expect("soft test devices are IPv4")
        .octets()
}

/// True if `fd` becomes readable within `ms` milliseconds.
fn readable(fd: RawFd, ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut p, 1, ms) };
    assert!(n >= 0, "poll failed");
    n == 1 && p.revents & libc::POLLIN != 0
}

/// Waits until `f` holds (bounded by [`WAIT`]).
fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn ud_qps_go_from_reset_to_rts_once_and_refuse_rc_transitions() {
    let ctx = open_test_context();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16, None).unwrap();
    let qp = pd.create_ud_qp(&cq, &cq, QpCaps::default()).unwrap();
    assert_eq!(qp.qp_type(), QpType::Ud);
    assert_eq!(qp.state(), QpState::Reset);
    // Caps are checked as for RC.
    let deep = QpCaps {
        max_send_wr: 1 << 20,
        ..QpCaps::default()
    };
    assert!(matches!(
        pd.create_ud_qp(&cq, &cq, deep),
        Err(ProviderError::InvalidArgument { .. })
    ));
    // RC transitions do not apply.
    assert!(matches!(
        qp.modify_to_init(&InitAttr::default()),
        Err(ProviderError::InvalidArgument { .. })
    ));
    let rc = pd.create_qp(&cq, &cq, QpCaps::default()).unwrap();
    assert_eq!(rc.qp_type(), QpType::Rc);
    assert!(matches!(
        qp.modify_to_rtr(&RtrAttr {
            remote: rc.endpoint(0).unwrap(),
            path_mtu: Mtu::Mtu4096,
            min_rnr_timer: 1,
            max_dest_rd_atomic: 1,
            sgid_index: 0,
            hop_limit: 1,
        }),
        Err(ProviderError::InvalidArgument { .. })
    ));
    assert!(matches!(
        rc.modify_ud_to_rts(&UdAttr::default()),
        Err(ProviderError::InvalidArgument { .. })
    ));
    // Bad attributes.
    for bad in [
        UdAttr {
            port: 2,
            ..UdAttr::default()
        },
        UdAttr {
            pkey_index: 3,
            ..UdAttr::default()
        },
        UdAttr {
            sq_psn: 1 << 24,
            ..UdAttr::default()
        },
    ] {
        assert!(qp.modify_ud_to_rts(&bad).is_err(), "{bad:?}");
        assert_eq!(qp.state(), QpState::Reset);
    }
    qp.modify_ud_to_rts(&UdAttr::default()).unwrap();
    assert_eq!(qp.state(), QpState::Rts);
    // From RESET only (as rxe: RTS -> INIT is not a transition).
    assert!(matches!(
        qp.modify_ud_to_rts(&UdAttr::default()),
        Err(ProviderError::InvalidQpState { .. })
    ));
    qp.modify_to_reset().unwrap();
    qp.modify_ud_to_rts(&UdAttr::default()).unwrap();
    qp.modify_to_err().unwrap();
    assert_eq!(qp.state(), QpState::Err);
}

#[test]
fn posts_refuse_rc_operations_on_ud_and_datagrams_on_rc() {
    let ctx = open_test_context();
    let a = Ud::new(&ctx, QKEY);
    let b = Ud::new(&ctx, QKEY);
    let ah = a.ah(&b);
    let src = a.buf(8192);
    let rkey = src.rkey();
    let remote_addr = src.addr();
    for op in [
        SendOp::Send,
        SendOp::SendWithImm { imm: 1 },
        SendOp::Write { remote_addr, rkey },
        SendOp::Read { remote_addr, rkey },
        SendOp::FetchAndAdd {
            remote_addr,
            rkey,
            add: 1,
        },
    ] {
        // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
        let e = unsafe { a.qp.post_send(&[wr(1, op, &[src.sge(0, 8)], SIG)]) }.unwrap_err();
        assert_eq!(e.posted, 0);
        match e.error {
            ProviderError::InvalidArgument { what, .. } => {
                assert!(what.contains("UD QPs send datagrams"), "{what}")
            }
            other => panic!("{op:?}: {other:?}"),
        }
    }
    // Larger than the active MTU: refused at post.
    let mtu = ctx.query_port(1).unwrap().active_mtu.bytes() as usize;
    let e = a
        .send_to(2, dest(&ah, &b, QKEY), None, &[src.sge(0, mtu + 1)], SIG)
        .unwrap_err();
    match e.error {
        ProviderError::InvalidArgument { what, .. } => assert!(what.contains("MTU"), "{what}"),
        other => panic!("{other:?}"),
    }
    // A datagram on an RC QP is refused.
    let (rc, _peer) = pair();
    let rbuf = rc.buf(8, LW);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    let e = unsafe {
        rc.qp.post_send(&[wr(
            3,
            SendOp::SendTo {
                dest: dest(&ah, &b, QKEY),
                imm: None,
            },
            &[rbuf.sge(0, 8)],
            SIG,
        )])
    }
    .unwrap_err();
    match e.error {
        ProviderError::InvalidArgument { what, .. } => assert!(what.contains("UD QP"), "{what}"),
        other => panic!("{other:?}"),
    }
    // Nothing was sent.
    expect_none(&a.scq, Duration::from_millis(20));
    assert_eq!(a.counters().sent, 0);
    // One MTU exactly is fine, and arrives whole behind the GRH.
    let rb = b.buf(GRH_LEN + mtu);
    b.post_recvs(&rb, 10, 1, GRH_LEN + mtu);
    let data = src.fill_pattern(9);
    a.send_to(4, dest(&ah, &b, QKEY), None, &[src.sge(0, mtu)], SIG)
        .unwrap();
    assert_eq!(poll_one(&a.scq).status, WcStatus::Success);
    let c = poll_one(&b.rcq);
    assert_eq!(
        (c.status, c.byte_len),
        (WcStatus::Success, (GRH_LEN + mtu) as u32)
    );
    assert_eq!(&rb.read()[GRH_LEN..], &data[..mtu]);
}

#[test]
fn address_handles_need_a_soft_destination() {
    let ctx = open_test_context();
    let a = Ud::new(&ctx, QKEY);
    let ep = a.qp.endpoint(0).unwrap();
    let good = AhAttr::to_endpoint(&ep, 0);
    assert!(a.pd.create_ah(&good).is_ok());
    for (bad, needle) in [
        (
            AhAttr {
                addr: verbio_runtime::provider::ProviderAddr::NONE,
                ..good
            },
            "no engine address",
        ),
        (
            AhAttr {
                dgid: Gid([0x20; 16]),
                ..good
            },
            "not the soft device GID",
        ),
    ] {
        match a.pd.create_ah(&bad) {
            Err(ProviderError::InvalidArgument { what, .. }) => {
                assert!(what.contains(needle), "{what}")
            }
            Err(other) => panic!("{other:?}"),
            Ok(_) => panic!("{bad:?} accepted"),
        }
    }
}

/// Checks a received datagram: completion fields, GRH, payload.
fn check_datagram(
    c: &Completion,
    buf: &[u8],
    from: &Ud,
    to: &Ud,
    payload: &[u8],
    imm: Option<u32>,
) {
    assert_eq!(c.status, WcStatus::Success, "{c:?}");
    assert_eq!(c.opcode, WcOpcode::Recv);
    assert_eq!(c.byte_len as usize, GRH_LEN + payload.len());
    assert_eq!(c.imm_data, imm);
    assert_eq!(c.src_qp, from.qp.qp_num());
    assert_eq!(c.qp_num, to.qp.qp_num());
    assert!(c.grh);
    assert_eq!(c.slid, 0);
    let sgid = from.ctx.query_gid(1, 0).unwrap();
    let dgid = to.ctx.query_gid(1, 0).unwrap();
    assert_eq!(Grh::parse(buf), Some(Grh { sgid, dgid }));
    // RoCE v2 over IPv4, as rxe writes it: 20 zero bytes, then the IPv4
    // header (UDP, don't fragment, TTL = the AH's hop limit, a valid
    // checksum, total length of IP + UDP + BTH + DETH [+ IMM] + padded
    // payload + ICRC).
    assert!(buf[..20].iter().all(|&b| b == 0));
    let ip = &buf[20..40];
    assert_eq!(ip[0], 0x45);
    let pad = payload.len().wrapping_neg() & 3;
    let total = 20 + 8 + 12 + 8 + if imm.is_some() { 4 } else { 0 } + payload.len() + pad + 4;
    assert_eq!(u16::from_be_bytes([ip[2], ip[3]]) as usize, total);
    assert_eq!(u16::from_be_bytes([ip[6], ip[7]]), 0x4000);
    assert_eq!(
        ip[8],
        AhAttr::to_endpoint(&to.qp.endpoint(0).unwrap(), 0).hop_limit
    );
    assert_eq!(ip[9], 17);
    let sum: u32 = ip
        .chunks(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
        .sum();
    assert_eq!((sum & 0xffff) + (sum >> 16), 0xffff, "IPv4 header checksum");
    assert_eq!(ip[12..16], ipv4_of(sgid));
    assert_eq!(ip[16..20], ipv4_of(dgid));
    assert_eq!(Ipv4Addr::from(ipv4_of(sgid)), Ipv4Addr::LOCALHOST);
    assert_eq!(&buf[GRH_LEN..GRH_LEN + payload.len()], payload);
}

fn round_trip(a: &Ud, b: &Ud) {
    let ab = a.ah(b);
    let ba = b.ah(a);
    let src = a.buf(256);
    let data = src.fill_pattern(1);
    let rb = b.buf(4 * 256);
    b.post_recvs(&rb, 100, 4, 256);
    // Plain, with immediate data, an odd length (padding), empty.
    let sends: [(usize, Option<u32>); 4] =
        [(32, None), (100, Some(0xfeed)), (3, None), (0, Some(7))];
    for (i, (len, imm)) in sends.iter().enumerate() {
        a.send_to(i as u64, dest(&ab, b, QKEY), *imm, &[src.sge(0, *len)], SIG)
            .unwrap();
    }
    let sc = poll_n(&a.scq, 4);
    for (i, c) in sc.iter().enumerate() {
        assert_eq!(
            (c.wr_id, c.status, c.opcode),
            (i as u64, WcStatus::Success, WcOpcode::Send)
        );
        assert_eq!(c.byte_len as usize, sends[i].0);
    }
    let rc = poll_n(&b.rcq, 4);
    let got = rb.read();
    for (i, c) in rc.iter().enumerate() {
        assert_eq!(c.wr_id, 100 + i as u64);
        let (len, imm) = sends[i];
        check_datagram(c, &got[i * 256..(i + 1) * 256], a, b, &data[..len], imm);
    }
    // And back, inline.
    let ra = a.buf(256);
    a.post_recvs(&ra, 200, 1, 256);
    let reply = b.buf(16);
    reply.write(0, b"reply, inline!!!");
    b.send_to(
        9,
        dest(&ba, a, QKEY),
        None,
        &[reply.sge(0, 16)],
        SIG | SendFlags::INLINE,
    )
    .unwrap();
    assert_eq!(poll_one(&b.scq).status, WcStatus::Success);
    let c = poll_one(&a.rcq);
    check_datagram(&c, &ra.read(), b, a, b"reply, inline!!!", None);
    let (ca, cb) = (a.counters(), b.counters());
    if a.ctx.as_soft().unwrap().local_addr() == b.ctx.as_soft().unwrap().local_addr() {
        assert_eq!((ca.sent, ca.delivered), (5, 5));
    } else {
        assert_eq!((ca.sent, ca.delivered, cb.sent, cb.delivered), (4, 1, 1, 4));
    }
}

#[test]
fn datagrams_travel_between_two_devices() {
    let a = Ud::new(&open_test_context(), QKEY);
    let b = Ud::new(&open_test_context(), QKEY);
    round_trip(&a, &b);
}

#[test]
fn datagrams_travel_inside_one_device() {
    let ctx = open_test_context();
    let a = Ud::new(&ctx, QKEY);
    let b = Ud::new(&ctx, QKEY);
    round_trip(&a, &b);
}

#[test]
fn receivers_drop_and_count_what_they_cannot_deliver() {
    let a = Ud::new(&open_test_context(), QKEY);
    let bctx = open_test_context();
    let b = Ud::new(&bctx, QKEY);
    let ah = a.ah(&b);
    let src = a.buf(64);
    let rb = b.buf(256);
    let send = |id: u64, d: UdDest| {
        a.send_to(id, d, None, &[src.sge(0, 16)], SIG).unwrap();
        assert_eq!(poll_one(&a.scq).status, WcStatus::Success);
    };
    // No receive posted: dropped (later receives do not see it).
    send(1, dest(&ah, &b, QKEY));
    wait_for("a drop for want of a receive", || {
        b.counters().dropped_no_recv == 1
    });
    // Wrong Q_Key.
    b.post_recvs(&rb, 1, 1, 256);
    send(2, dest(&ah, &b, QKEY ^ 1));
    wait_for("a Q_Key drop", || b.counters().dropped_qkey == 1);
    // No such QP; an RC QP; a UD QP still in RESET.
    let no_qp = UdDest {
        remote_qpn: 0xfffffe,
        ..dest(&ah, &b, QKEY)
    };
    send(3, no_qp);
    let pd = bctx.alloc_pd().unwrap();
    let cq = bctx.create_cq(8, None).unwrap();
    let rc = pd.create_qp(&cq, &cq, QpCaps::default()).unwrap();
    send(
        4,
        UdDest {
            remote_qpn: rc.qp_num(),
            ..dest(&ah, &b, QKEY)
        },
    );
    let reset = pd.create_ud_qp(&cq, &cq, QpCaps::default()).unwrap();
    send(
        5,
        UdDest {
            remote_qpn: reset.qp_num(),
            ..dest(&ah, &b, QKEY)
        },
    );
    wait_for("three no-QP drops", || b.counters().dropped_no_qp == 3);
    expect_none(&b.rcq, Duration::from_millis(20));
    expect_none(&cq, Duration::from_millis(1));
    // The receive posted above is still there for a good datagram.
    send(6, dest(&ah, &b, QKEY));
    let c = poll_one(&b.rcq);
    assert_eq!((c.wr_id, c.status), (1, WcStatus::Success));
    let cb = b.counters();
    assert_eq!(
        (
            cb.delivered,
            cb.dropped_no_recv,
            cb.dropped_qkey,
            cb.dropped_no_qp
        ),
        (1, 1, 1, 3)
    );
    assert_eq!(a.counters().sent, 6);
}

#[test]
fn a_receive_too_small_for_grh_and_payload_completes_loc_len_err() {
    let a = Ud::new(&open_test_context(), QKEY);
    let b = Ud::new(&open_test_context(), QKEY);
    let ah = a.ah(&b);
    let src = a.buf(64);
    let rb = b.buf(2 * 80);
    // Room for 40 + 39 bytes, then for 40 + 40.
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        b.qp.post_recv(&[
            rwr(1, &[rb.sge(0, GRH_LEN + 39)]),
            rwr(2, &[rb.sge(80, GRH_LEN + 40)]),
        ])
    }
    .unwrap();
    for id in [1, 2] {
        a.send_to(id, dest(&ah, &b, QKEY), None, &[src.sge(0, 40)], SIG)
            .unwrap();
    }
    let c = poll_n(&b.rcq, 2);
    assert_eq!((c[0].wr_id, c[0].status), (1, WcStatus::LocLenErr));
    assert_eq!((c[1].wr_id, c[1].status), (2, WcStatus::Success));
    assert_eq!(c[1].byte_len as usize, GRH_LEN + 40);
    // The QP stays usable (as on rxe, a UD length error is not fatal).
    assert_eq!(b.qp.state(), QpState::Rts);
}

#[test]
fn a_dead_address_handle_fails_the_wr_with_loc_qp_op_err_as_on_rxe() {
    let a = Ud::new(&open_test_context(), QKEY);
    let b = Ud::new(&open_test_context(), QKEY);
    let src = a.buf(64);
    let ah = a.ah(&b);
    let stale = dest(&ah, &b, QKEY);
    drop(ah);
    // A handle of another PD is no better.
    let other_pd = a.ctx.alloc_pd().unwrap();
    let foreign = other_pd
        .create_ah(&AhAttr::to_endpoint(&b.qp.endpoint(0).unwrap(), 0))
        .unwrap();
    a.send_to(1, stale, None, &[src.sge(0, 8)], SIG).unwrap();
    a.send_to(2, dest(&foreign, &b, QKEY), None, &[src.sge(0, 8)], SIG)
        .ok();
    let c = poll_n(&a.scq, 2);
    assert_eq!((c[0].wr_id, c[0].status), (1, WcStatus::LocQpOpErr));
    assert_eq!((c[1].wr_id, c[1].status), (2, WcStatus::WrFlushErr));
    wait_state(&a.qp, QpState::Err);
    assert_eq!(a.counters().sent, 0);
}

#[test]
fn send_completions_follow_posting_order_across_destinations() {
    let a = Ud::new(&open_test_context(), QKEY);
    let b = Ud::new(&open_test_context(), QKEY);
    let c = Ud::new(&open_test_context(), QKEY);
    let d = Ud::new(&a.ctx, QKEY);
    let targets = [&b, &c, &d];
    let ahs: Vec<AddressHandle> = targets.iter().map(|t| a.ah(t)).collect();
    const N: usize = 300;
    let rbufs: Vec<RegBuf> = targets
        .iter()
        .map(|t| {
            let rb = t.buf(N * 64);
            t.post_recvs(&rb, 0, N / 3 + 1, 64);
            rb
        })
        .collect();
    let src = a.buf(N * 8);
    let mut posted = 0;
    let mut got = Vec::new();
    while posted < N {
        let t = posted % 3;
        let flags = if posted % 2 == 0 {
            SIG
        } else {
            SendFlags::NONE
        };
        match a.send_to(
            posted as u64,
            dest(&ahs[t], targets[t], QKEY),
            Some(posted as u32),
            &[src.sge(posted * 8, 8)],
            flags,
        ) {
            Ok(()) => posted += 1,
            Err(e) => {
                assert!(matches!(e.error, ProviderError::QueueFull { .. }), "{e:?}");
                got.extend(poll_n(&a.scq, 1));
            }
        }
    }
    got.extend(poll_n(&a.scq, N / 2 - got.len()));
    let ids: Vec<u64> = got.iter().map(|c| c.wr_id).collect();
    let expect: Vec<u64> = (0..N as u64).step_by(2).collect();
    assert_eq!(ids, expect, "signaled completions in posting order");
    for (i, t) in targets.iter().enumerate() {
        let r = poll_n(&t.rcq, N / 3);
        let imms: Vec<u32> = r.iter().map(|c| c.imm_data.unwrap()).collect();
        let expect: Vec<u32> = (0..N as u32).filter(|k| *k as usize % 3 == i).collect();
        // One connection per destination: each one's datagrams in order.
        assert_eq!(imms, expect, "destination {i}");
    }
    drop(rbufs);
}

#[test]
fn datagrams_to_a_device_that_is_gone_complete_and_are_lost() {
    let a = Ud::new(&open_test_context(), QKEY);
    let b = Ud::new(&open_test_context(), QKEY);
    let ah = a.ah(&b);
    let to_b = dest(&ah, &b, QKEY);
    let src = a.buf(8);
    let rb = b.buf(64);
    b.post_recvs(&rb, 0, 1, 64);
    a.send_to(0, to_b, None, &[src.sge(0, 8)], SIG).unwrap();
    assert_eq!(poll_one(&a.scq).status, WcStatus::Success);
    assert_eq!(poll_one(&b.rcq).status, WcStatus::Success);
    // The destination's device closes (its engine stops, its listener
    // with it).
    drop(rb);
    drop(b);
    // (Time for `a`'s engine to see the connection end.)
    std::thread::sleep(Duration::from_millis(200));
    for id in 1..=5 {
        a.send_to(id, to_b, None, &[src.sge(0, 8)], SIG).unwrap();
    }
    let c = poll_n(&a.scq, 5);
    assert!(c.iter().all(|c| c.status == WcStatus::Success), "{c:?}");
    assert_eq!(a.qp.state(), QpState::Rts);
    // No connection to the destination's engine can be had: lost.
    let ca = a.counters();
    assert_eq!((ca.sent, ca.lost), (1, 5), "{ca:?}");
    // The QP still reaches live destinations.
    let c2 = Ud::new(&open_test_context(), QKEY);
    let rc2 = c2.buf(64);
    c2.post_recvs(&rc2, 0, 1, 64);
    let ah2 = a.ah(&c2);
    a.send_to(9, dest(&ah2, &c2, QKEY), None, &[src.sge(0, 8)], SIG)
        .unwrap();
    assert_eq!(poll_one(&a.scq).status, WcStatus::Success);
    assert_eq!(poll_one(&c2.rcq).status, WcStatus::Success);
}

#[test]
fn ipv6_devices_write_an_ipv6_grh() {
    let open = || {
        Context::open_soft(SoftConfig {
            bind: "[::1]:0".parse().expect("literal"),
            ..SoftConfig::default()
        })
    };
    let (Ok(ca), Ok(cb)) = (open(), open()) else {
        println!("SKIPPED: cannot bind the IPv6 loopback address here");
        return;
    };
    let a = Ud::new(&ca, QKEY);
    let b = Ud::new(&cb, QKEY);
    let ah = a.ah(&b);
    let src = a.buf(8);
    src.write(0, b"over ip6");
    let rb = b.buf(64);
    b.post_recvs(&rb, 0, 1, 64);
    a.send_to(0, dest(&ah, &b, QKEY), None, &[src.sge(0, 8)], SIG)
        .unwrap();
    assert_eq!(poll_one(&a.scq).status, WcStatus::Success);
    let c = poll_one(&b.rcq);
    assert_eq!(
        (c.status, c.byte_len),
        (WcStatus::Success, GRH_LEN as u32 + 8)
    );
    let got = rb.read();
    assert_eq!(got[0] >> 4, 6, "an IPv6 header");
    // Payload length: UDP + BTH + DETH + payload + ICRC.
    assert_eq!(u16::from_be_bytes([got[4], got[5]]), 8 + 12 + 8 + 8 + 4);
    assert_eq!((got[6], got[7]), (17, 1));
    let sgid = ca.query_gid(1, 0).unwrap();
    let dgid = cb.query_gid(1, 0).unwrap();
    assert_eq!(Grh::parse(&got), Some(Grh { sgid, dgid }));
    assert_eq!(&got[GRH_LEN..GRH_LEN + 8], b"over ip6");
}

#[test]
fn posted_lists_keep_their_order_across_destinations() {
    let a = Ud::new(&open_test_context(), QKEY);
    let b = Ud::new(&open_test_context(), QKEY);
    let c = Ud::new(&open_test_context(), QKEY);
    let d = Ud::new(&a.ctx, QKEY);
    let targets = [&b, &c, &d];
    let ahs: Vec<AddressHandle> = targets.iter().map(|t| a.ah(t)).collect();
    let rbufs: Vec<RegBuf> = targets
        .iter()
        .map(|t| {
            let rb = t.buf(128 * 64);
            t.post_recvs(&rb, 0, 128, 64);
            rb
        })
        .collect();
    let src = a.buf(64);
    // Lists of 1..=12 WRs in runs of 1..=4 per destination, the loopback
    // one (which the engine sends) among them.
    let mut next = 0u32;
    let mut sent = [Vec::new(), Vec::new(), Vec::new()];
    let mut rng = 0x2545_f491_u32;
    let mut step = || {
        rng ^= rng << 13;
        rng ^= rng >> 17;
        rng ^= rng << 5;
        rng
    };
    let mut signaled = Vec::new();
    while next < 300 {
        let len = 1 + step() % 12;
        let mut list = Vec::new();
        while list.len() < len as usize && next < 300 {
            let t = (step() % 3) as usize;
            for _ in 0..1 + step() % 4 {
                if list.len() == len as usize || next == 300 {
                    break;
                }
                let flags = if next % 3 == 0 { SIG } else { SendFlags::NONE };
                if flags == SIG {
                    signaled.push(u64::from(next));
                }
                list.push(wr(
                    u64::from(next),
                    SendOp::SendTo {
                        dest: dest(&ahs[t], targets[t], QKEY),
                        imm: Some(next),
                    },
                    &[src.sge(0, 8)],
                    flags,
                ));
                sent[t].push(next);
                next += 1;
            }
        }
        // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
        unsafe { a.qp.post_send(&list) }.unwrap();
        // (Keep the send queue and the receivers' queues from filling up.)
        if next % 60 < len {
            let want = signaled.len();
            let got = poll_n(&a.scq, want);
            let ids: Vec<u64> = got.iter().map(|c| c.wr_id).collect();
            assert_eq!(ids, signaled, "signaled completions in posting order");
            signaled.clear();
        }
    }
    let got = poll_n(&a.scq, signaled.len());
    assert_eq!(got.iter().map(|c| c.wr_id).collect::<Vec<_>>(), signaled);
    for (i, t) in targets.iter().enumerate() {
        let r = poll_n(&t.rcq, sent[i].len());
        let imms: Vec<u32> = r.iter().map(|c| c.imm_data.unwrap()).collect();
        assert_eq!(imms, sent[i], "destination {i}");
    }
    assert_eq!(a.counters().sent, 300);
    drop(rbufs);
}

#[test]
fn receive_completions_use_the_channel_and_solicited_machinery() {
    let a = Ud::new(&open_test_context(), QKEY);
    let bctx = open_test_context();
    let ch = bctx.create_comp_channel().unwrap();
    let b = Ud::with(&bctx, QKEY, Some(&ch), QpCaps::default());
    let ah = a.ah(&b);
    let src = a.buf(8);
    let rb = b.buf(2 * 64);
    b.post_recvs(&rb, 0, 2, 64);
    b.rcq.req_notify(true).unwrap();
    a.send_to(0, dest(&ah, &b, QKEY), None, &[src.sge(0, 8)], SIG)
        .unwrap();
    wait_for("the unsolicited datagram", || b.counters().delivered == 1);
    assert!(!readable(ch.fd(), 20), "unsolicited: no event");
    a.send_to(
        1,
        dest(&ah, &b, QKEY),
        Some(5),
        &[src.sge(0, 8)],
        SIG | SendFlags::SOLICITED,
    )
    .unwrap();
    let deadline = Instant::now() + WAIT;
    let ev = loop {
        assert!(Instant::now() < deadline, "no event");
        if readable(ch.fd(), 100) {
            if let Some(ev) = ch.get_event().unwrap() {
                break ev;
            }
        }
    };
    assert_eq!(ev, b.rcq.handle());
    b.rcq.ack_events(1);
    let c = poll_n(&b.rcq, 2);
    assert_eq!((c[0].wr_id, c[1].wr_id, c[1].imm_data), (0, 1, Some(5)));
}

#[test]
fn fault_injection_drops_and_duplicates_the_requested_fractions() {
    let a = Ud::new(&open_test_context(), QKEY);
    const N: usize = 1000;
    let caps = QpCaps {
        max_recv_wr: 2 * N as u32,
        ..QpCaps::default()
    };
    let b = Ud::with(&open_test_context(), QKEY, None, caps);
    let soft = a.ctx.as_soft().unwrap();
    assert!(soft
        .set_ud_faults(Some(UdFaults {
            drop: 0.6,
            duplicate: 0.6,
            seed: 1,
        }))
        .is_err());
    soft.set_ud_faults(Some(UdFaults {
        drop: 0.10,
        duplicate: 0.05,
        seed: 7,
    }))
    .unwrap();
    let rb = b.buf(2 * N * 64);
    b.post_recvs(&rb, 0, 2 * N, 64);
    let ah = a.ah(&b);
    let src = a.buf(8);
    for i in 0..N {
        // The last one signaled too: its completion means every send before
        // it was processed (counted), none left trailing.
        let flags = if i % 16 == 15 || i == N - 1 {
            SIG
        } else {
            SendFlags::NONE
        };
        loop {
            match a.send_to(
                i as u64,
                dest(&ah, &b, QKEY),
                Some(i as u32),
                &[src.sge(0, 8)],
                flags,
            ) {
                Ok(()) => break,
                Err(e) if matches!(e.error, ProviderError::QueueFull { .. }) => {
                    std::thread::sleep(Duration::from_micros(50))
                }
                Err(e) => panic!("{e:?}"),
            }
        }
    }
    let sc = poll_n(&a.scq, N.div_ceil(16));
    assert!(sc.iter().all(|c| c.status == WcStatus::Success));
    let ca = a.counters();
    assert_eq!(ca.sent + ca.dropped_injected, N as u64);
    assert!((70..=130).contains(&ca.dropped_injected), "{ca:?}");
    assert!((30..=70).contains(&ca.duplicated), "{ca:?}");
    let arrive = (ca.sent + ca.duplicated) as usize;
    let r = poll_n(&b.rcq, arrive);
    expect_none(&b.rcq, Duration::from_millis(20));
    let mut imms: Vec<u32> = r.iter().map(|c| c.imm_data.unwrap()).collect();
    let copies = imms.windows(2).filter(|w| w[0] == w[1]).count();
    assert_eq!(
        copies as u64, ca.duplicated,
        "duplicates arrive back to back"
    );
    imms.dedup();
    assert_eq!(imms.len() as u64, ca.sent);
    assert!(imms.windows(2).all(|w| w[0] < w[1]));
    assert_eq!(b.counters().delivered, arrive as u64);
    soft.set_ud_faults(None).unwrap();
}

#[test]
fn posting_and_polling_datagrams_do_not_allocate() {
    let a = Ud::new(&open_test_context(), QKEY);
    let b = Ud::new(&open_test_context(), QKEY);
    let (ab_ah, ba_ah) = (a.ah(&b), b.ah(&a));
    let (ab, ba) = (dest(&ab_ah, &b, QKEY), dest(&ba_ah, &a, QKEY));
    let (abuf, bbuf) = (a.buf(64 + GRH_LEN), b.buf(64 + GRH_LEN));
    let mut c = [Completion::EMPTY; 4];
    // One thread plays both sides: posts (transmitted on this thread once
    // the engine allows it), busy polls (which receive on this thread).
    let mut round = || {
        // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
        unsafe {
            b.qp.post_recv(&[rwr(1, &[bbuf.sge(0, 64 + GRH_LEN)])])
                .unwrap();
            a.qp.post_recv(&[rwr(2, &[abuf.sge(0, 64 + GRH_LEN)])])
                .unwrap();
        }
        a.send_to(3, ab, Some(1), &[abuf.sge(GRH_LEN, 32)], SendFlags::INLINE)
            .unwrap();
        let deadline = Instant::now() + WAIT;
        while b.rcq.poll(&mut c[..1]).unwrap() == 0 {
            assert!(Instant::now() < deadline, "request lost");
        }
        b.send_to(
            4,
            ba,
            None,
            &[bbuf.sge(GRH_LEN, 32)],
            SIG | SendFlags::INLINE,
        )
        .unwrap();
        while a.rcq.poll(&mut c[..1]).unwrap() == 0 {
            assert!(Instant::now() < deadline, "answer lost");
        }
        while b.scq.poll(&mut c[..1]).unwrap() == 0 {
            assert!(Instant::now() < deadline, "send completion lost");
        }
    };
    for _ in 0..200 {
        round();
    }
    let before = allocs();
    for _ in 0..1000 {
        round();
    }
    let n = allocs() - before;
    eprintln!("{n} allocations in 1000 round trips");
    // (A rare engine hand-over may allocate a little; not per datagram.)
    assert!(n < 20, "{n} allocations in 1000 round trips");
}

/// Median round-trip time of `rounds` ping-pongs of `len` bytes: `ping`
/// posts the request, `pong` waits for it and answers, `done` waits for
/// the answer.
fn median_rtt(rounds: usize, mut one: impl FnMut()) -> Duration {
    let mut t: Vec<Duration> = (0..rounds)
        .map(|_| {
            let s = Instant::now();
            one();
            s.elapsed()
        })
        .collect();
    t.sort();
    t[t.len() / 2]
}

/// Busy-polls `cq` for one completion (`None` after [`WAIT`]).
fn spin_one(cq: &Cq) -> Option<Completion> {
    let mut c = [Completion::EMPTY; 1];
    let deadline = Instant::now() + WAIT;
    loop {
        if cq.poll(&mut c).unwrap() == 1 {
            return Some(c[0]);
        }
        if Instant::now() >= deadline {
            return None;
        }
    }
}

/// Sets the flag when dropped (stops an echo thread should the test fail).
struct StopOnDrop<'a>(&'a std::sync::atomic::AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// UD and RC ping-pongs of 32 bytes between two devices and inside one,
/// in one run, each side on its own thread busy-polling: prints the
/// medians and their ratios.
/// `cargo test --release -p verbio-runtime --test soft_ud -- --ignored --nocapture`
#[test]
#[ignore = "a measurement: run it with --ignored --nocapture"]
fn ud_and_rc_ping_pong_rtt() {
    let (ca, cb) = (open_test_context(), open_test_context());
    ping_pong("two devices", &ca, &cb, 20_000);
    // (Inside one device the engine thread carries every message: with
    // both sides busy-polling, it needs a core of its own.)
    ping_pong("one device", &ca, &ca, 500);
}

fn ping_pong(what: &str, ca: &Context, cb: &Context, rounds: usize) {
    const LEN: usize = 32;
    // UD.
    let a = Ud::new(ca, QKEY);
    let b = Ud::new(cb, QKEY);
    let (ah_ab, ah_ba) = (a.ah(&b), b.ah(&a));
    let (ab, ba) = (dest(&ah_ab, &b, QKEY), dest(&ah_ba, &a, QKEY));
    let (abuf, bbuf) = (a.buf(LEN + GRH_LEN), b.buf(LEN + GRH_LEN));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let ud_rtt = std::thread::scope(|s| {
        let stop2 = stop.clone();
        let b = &b;
        let bbuf = &bbuf;
        // Echo: one receive posted ahead (before the first request: a
        // datagram finding none is dropped), answer each request inline.
        b.post_recvs(bbuf, 0, 1, LEN + GRH_LEN);
        s.spawn(move || {
            let mut c = [Completion::EMPTY; 4];
            while !stop2.load(std::sync::atomic::Ordering::Relaxed) {
                let n = b.rcq.poll(&mut c).unwrap();
                for _ in 0..n {
                    b.post_recvs(bbuf, 0, 1, LEN + GRH_LEN);
                    b.send_to(0, ba, None, &[bbuf.sge(GRH_LEN, LEN)], SendFlags::INLINE)
                        .unwrap();
                }
                b.scq.poll(&mut c).unwrap();
            }
        });
        let _stop = StopOnDrop(&stop);
        median_rtt(rounds, || {
            a.post_recvs(&abuf, 0, 1, LEN + GRH_LEN);
            a.send_to(0, ab, None, &[abuf.sge(GRH_LEN, LEN)], SendFlags::INLINE)
                .unwrap();
            if spin_one(&a.rcq).is_none() {
                panic!(
                    "UD ping-pong stalled: {:?} / {:?}",
                    a.counters(),
                    b.counters()
                );
            }
        })
    });
    // RC, the same exchange.
    let (ra, rb) = connect_pair(ca, cb, &PairOpts::default());
    let (rabuf, rbbuf) = (ra.buf(LEN, LW), rb.buf(LEN, LW));
    stop.store(false, std::sync::atomic::Ordering::Relaxed);
    let rc_rtt = std::thread::scope(|s| {
        let stop2 = stop.clone();
        let rb = &rb;
        let rbbuf = &rbbuf;
        // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
        unsafe { rb.qp.post_recv(&[rwr(0, &[rbbuf.sge(0, LEN)])]) }.unwrap();
        s.spawn(move || {
            let mut c = [Completion::EMPTY; 4];
            while !stop2.load(std::sync::atomic::Ordering::Relaxed) {
                let n = rb.rcq.poll(&mut c).unwrap();
                for _ in 0..n {
                    // SAFETY: as above.
                    unsafe {
                        rb.qp.post_recv(&[rwr(0, &[rbbuf.sge(0, LEN)])]).unwrap();
                        rb.qp
                            .post_send(&[wr(
                                0,
                                SendOp::Send,
                                &[rbbuf.sge(0, LEN)],
                                SIG | SendFlags::INLINE,
                            )])
                            .unwrap();
                    }
                }
                rb.scq.poll(&mut c).unwrap();
            }
        });
        let _stop = StopOnDrop(&stop);
        median_rtt(rounds, || {
            // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
            unsafe {
                ra.qp.post_recv(&[rwr(0, &[rabuf.sge(0, LEN)])]).unwrap();
                ra.qp
                    .post_send(&[wr(
                        0,
                        SendOp::Send,
                        &[rabuf.sge(0, LEN)],
                        SIG | SendFlags::INLINE,
                    )])
                    .unwrap();
            }
            assert!(spin_one(&ra.rcq).is_some(), "RC ping-pong stalled");
            assert!(spin_one(&ra.scq).is_some(), "RC ping-pong stalled");
        })
    });
    println!(
        "{what}: 32-byte ping-pong, median RTT over {rounds} rounds: UD {:.1} µs, RC SEND {:.1} µs, UD/RC {:.2}",
        ud_rtt.as_secs_f64() * 1e6,
        rc_rtt.as_secs_f64() * 1e6,
        ud_rtt.as_secs_f64() / rc_rtt.as_secs_f64()
    );
}
