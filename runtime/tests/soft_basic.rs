//! Soft device: SEND/RECV semantics, SGEs, inline, signaling, limits, queries.

mod common;

use std::time::Duration;

use common::*;
use verbio_runtime::provider::*;

const SIG: SendFlags = SendFlags::SIGNALED;

#[test]
fn handles_are_send_and_sync() {
    fn check<T: Send + Sync + Clone>() {}
    check::<Context>();
    check::<Pd>();
    check::<Mr>();
    check::<Cq>();
    check::<CompChannel>();
    check::<Qp>();
}

#[test]
fn queries_report_the_enforced_limits() {
    let ctx = open_test_context();
    assert_eq!(ctx.kind(), ProviderKind::Soft);
    let dev = ctx.query_device().unwrap();
    assert!(dev.max_qp_wr >= 1024 && dev.max_sge >= 4);
    assert_eq!(dev.phys_port_cnt, 1);
    let port = ctx.query_port(1).unwrap();
    assert_eq!(port.state, PortState::Active);
    assert_eq!(port.link_layer, LinkLayer::Ethernet);
    assert_eq!(port.active_mtu, Mtu::Mtu4096);
    assert!(ctx.query_port(2).is_err());
    let gid = ctx.query_gid(1, 0).unwrap();
    assert_eq!(&gid.0[..12], &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff]);
    assert_eq!(&gid.0[12..], &[127, 0, 0, 1]);
    // Limits are enforced as advertised.
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16, None).unwrap();
    let too_deep = QpCaps {
        max_send_wr: dev.max_qp_wr + 1,
        ..QpCaps::default()
    };
    assert!(matches!(
        pd.create_qp(&cq, &cq, too_deep),
        Err(ProviderError::InvalidArgument { .. })
    ));
    let qp = pd.create_qp(&cq, &cq, QpCaps::default()).unwrap();
    let ep = qp.endpoint(0).unwrap();
    assert_eq!(ep.provider, ProviderKind::Soft);
    assert_eq!(ep.addr, ctx.addr());
    assert_eq!(ep.gid, gid);
    assert_eq!(ep.qpn, qp.qp_num());
    assert_eq!(qp.state(), QpState::Reset);
}

#[test]
fn mr_keys_are_distinct_and_not_reused() {
    let ctx = open_test_context();
    let pd = ctx.alloc_pd().unwrap();
    let mut seen = std::collections::HashSet::new();
    for _ in 0..200 {
        let b = RegBuf::new(&pd, 64, LW);
        assert!(seen.insert(b.mr().lkey()));
        assert!(seen.insert(b.mr().rkey()));
    }
    // remote write without local write is refused, like ibv_reg_mr.
    let mut x = [0u8; 8];
    // SAFETY: the call fails; nothing is registered.
    let r = unsafe { pd.reg_mr(x.as_mut_ptr(), 8, AccessFlags::REMOTE_WRITE) };
    assert!(r.is_err());
}

#[test]
fn state_machine_is_strict() {
    let ctx = open_test_context();
    let opts = PairOpts::default();
    let a = make_side(&ctx, &opts);
    let b = make_side(&ctx, &opts);
    let buf = a.buf(64, LW);
    let send = wr(1, SendOp::Send, &[buf.sge(0, 8)], SIG);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    let err = unsafe { a.qp.post_send(std::slice::from_ref(&send)) }.unwrap_err();
    assert_eq!(err.posted, 0);
    assert!(matches!(
        err.error,
        ProviderError::InvalidQpState {
            state: QpState::Reset,
            ..
        }
    ));
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    assert!(unsafe { a.qp.post_recv(&[rwr(1, &[buf.sge(0, 8)])]) }.is_err());
    assert!(a.qp.modify_to_rts(&RtsAttr::default()).is_err());
    a.qp.modify_to_init(&InitAttr::default()).unwrap();
    assert!(matches!(
        // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
        unsafe { a.qp.post_send(std::slice::from_ref(&send)) }
            .unwrap_err()
            .error,
        ProviderError::InvalidQpState {
            state: QpState::Init,
            ..
        }
    ));
    // RECVs may be posted from INIT on.
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe { a.qp.post_recv(&[rwr(2, &[buf.sge(0, 8)])]) }.unwrap();
    let eb = b.qp.endpoint(0).unwrap();
    let rtr = RtrAttr {
        remote: eb,
        path_mtu: Mtu::Mtu4096,
        min_rnr_timer: 1,
        max_dest_rd_atomic: 1,
        sgid_index: 0,
        hop_limit: 1,
    };
    a.qp.modify_to_rtr(&rtr).unwrap();
    assert!(a.qp.modify_to_rtr(&rtr).is_err());
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    assert!(unsafe { a.qp.post_send(&[send]) }.is_err());
    a.qp.modify_to_rts(&RtsAttr::default()).unwrap();
    assert_eq!(a.qp.state(), QpState::Rts);
    // A non-soft endpoint is refused.
    let c = make_side(&ctx, &opts);
    c.qp.modify_to_init(&InitAttr::default()).unwrap();
    let mut bad = rtr;
    bad.remote.addr = verbio_runtime::provider::ProviderAddr::NONE;
    assert!(c.qp.modify_to_rtr(&bad).is_err());
}

#[test]
fn send_consumes_next_recv_with_len_imm_and_opcode() {
    let (a, b) = pair();
    let src = a.buf(256, LW);
    src.fill_pattern(7);
    let dst = b.buf(512, LW);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        b.qp.post_recv(&[rwr(10, &[dst.sge(0, 256)]), rwr(11, &[dst.sge(256, 256)])])
    }
    .unwrap();
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        a.qp.post_send(&[
            wr(1, SendOp::Send, &[src.sge(0, 100)], SIG),
            wr(
                2,
                SendOp::SendWithImm { imm: 0xfeed },
                &[src.sge(100, 56)],
                SIG,
            ),
        ])
    }
    .unwrap();
    let rc = poll_n(&b.rcq, 2);
    assert_eq!(rc[0].wr_id, 10);
    assert_eq!(rc[0].status, WcStatus::Success);
    assert_eq!(rc[0].opcode, WcOpcode::Recv);
    assert_eq!(rc[0].byte_len, 100);
    assert_eq!(rc[0].imm_data, None);
    assert_eq!(rc[0].qp_num, b.qp.qp_num());
    assert_eq!(rc[1].wr_id, 11);
    assert_eq!(rc[1].byte_len, 56);
    assert_eq!(rc[1].imm_data, Some(0xfeed));
    let sc = poll_n(&a.scq, 2);
    assert_eq!(
        sc.iter()
            .map(|c| (c.wr_id, c.status, c.opcode))
            .collect::<Vec<_>>(),
        vec![
            (1, WcStatus::Success, WcOpcode::Send),
            (2, WcStatus::Success, WcOpcode::Send)
        ]
    );
    let got = dst.read();
    let want = src.read();
    assert_eq!(&got[..100], &want[..100]);
    assert_eq!(&got[256..312], &want[100..156]);
    assert!(got[100..256].iter().all(|&x| x == 0));
}

#[test]
fn many_sends_arrive_in_order() {
    let opts = PairOpts {
        caps: QpCaps {
            max_send_wr: 512,
            max_recv_wr: 512,
            ..QpCaps::default()
        },
        cqe: 4096,
        ..PairOpts::default()
    };
    let ctx = open_test_context();
    let (a, b) = connect_pair(&ctx, &ctx, &opts);
    const N: usize = 2000;
    let src = a.buf(N * 8, LW);
    let dst = b.buf(N * 8, LW);
    for i in 0..N {
        src.write(i * 8, &(i as u64).to_le_bytes());
    }
    let mut posted_recv = 0;
    let mut posted_send = 0;
    let mut recvd = Vec::new();
    let mut sends_done = 0;
    let deadline = std::time::Instant::now() + WAIT;
    let mut wc = [Completion::EMPTY; 64];
    while recvd.len() < N || sends_done < N {
        assert!(std::time::Instant::now() < deadline, "stuck");
        while posted_recv < N && posted_recv - recvd.len() < 500 {
            // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
            unsafe {
                b.qp.post_recv(&[rwr(posted_recv as u64, &[dst.sge(posted_recv * 8, 8)])])
            }
            .unwrap();
            posted_recv += 1;
        }
        while posted_send < N && posted_send - sends_done < 500 && posted_send < posted_recv {
            // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
            unsafe {
                a.qp.post_send(&[wr(
                    posted_send as u64,
                    SendOp::Send,
                    &[src.sge(posted_send * 8, 8)],
                    SIG,
                )])
            }
            .unwrap();
            posted_send += 1;
        }
        let n = b.rcq.poll(&mut wc).unwrap();
        recvd.extend(wc[..n].iter().map(|c| c.wr_id));
        let n = a.scq.poll(&mut wc).unwrap();
        for c in &wc[..n] {
            assert_eq!(c.wr_id, sends_done as u64);
            assert_eq!(c.status, WcStatus::Success);
            sends_done += 1;
        }
        if n == 0 {
            std::thread::yield_now();
        }
    }
    assert_eq!(recvd, (0..N as u64).collect::<Vec<_>>());
    let got = dst.read();
    for i in 0..N {
        let mut x = [0u8; 8];
        x.copy_from_slice(&got[i * 8..i * 8 + 8]);
        assert_eq!(u64::from_le_bytes(x), i as u64);
    }
}

#[test]
fn multi_sge_gather_and_scatter() {
    let (a, b) = pair();
    let src = a.buf(300, LW);
    let data = src.fill_pattern(3);
    let dst = b.buf(300, LW);
    // scatter over three pieces of uneven size
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        b.qp.post_recv(&[rwr(
            1,
            &[dst.sge(0, 10), dst.sge(100, 50), dst.sge(200, 100)],
        )])
    }
    .unwrap();
    // gather from three pieces: 5 + 40 + 60 = 105 bytes
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        a.qp.post_send(&[wr(
            7,
            SendOp::Send,
            &[src.sge(0, 5), src.sge(50, 40), src.sge(200, 60)],
            SIG,
        )])
    }
    .unwrap();
    let rc = poll_one(&b.rcq);
    assert_eq!((rc.status, rc.byte_len), (WcStatus::Success, 105));
    let msg: Vec<u8> = [&data[0..5], &data[50..90], &data[200..260]].concat();
    let got = dst.read();
    assert_eq!(&got[0..10], &msg[0..10]);
    assert_eq!(&got[100..150], &msg[10..60]);
    assert_eq!(&got[200..245], &msg[60..105]);
    assert!(got[245..].iter().all(|&x| x == 0));
    assert_eq!(poll_one(&a.scq).status, WcStatus::Success);
}

#[test]
fn inline_send_copies_at_post_time_without_lkey() {
    let (a, b) = pair();
    let dst = b.buf(64, LW);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe { b.qp.post_recv(&[rwr(1, &[dst.sge(0, 64)])]) }.unwrap();
    let mut local = *b"inline payload, not registered!!";
    let sge = Sge {
        addr: local.as_mut_ptr() as u64,
        length: local.len() as u32,
        lkey: 0xdead_beef,
    };
    // SAFETY: INLINE: `local` is copied during the call (its lkey is unused)
    // and is a live local nobody writes meanwhile.
    unsafe {
        a.qp.post_send(&[wr(1, SendOp::Send, &[sge], SIG | SendFlags::INLINE)])
    }
    .unwrap();
    // Overwrite right away: the payload was copied at post time.
    local.fill(b'x');
    assert_eq!(poll_one(&a.scq).status, WcStatus::Success);
    let rc = poll_one(&b.rcq);
    assert_eq!(rc.byte_len, 32);
    assert_eq!(&dst.read()[..32], b"inline payload, not registered!!");
    // Too big for max_inline_data.
    let big = [0u8; 65];
    let sge = Sge {
        addr: big.as_ptr() as u64,
        length: 65,
        lkey: 0,
    };
    // SAFETY: INLINE: `big` is a live local, readable during the call (the
    // post is refused anyway: too big for max_inline_data).
    let e = unsafe {
        a.qp.post_send(&[wr(2, SendOp::Send, &[sge], SIG | SendFlags::INLINE)])
    }
    .unwrap_err();
    assert!(matches!(e.error, ProviderError::InvalidArgument { .. }));
}

#[test]
fn unsignaled_wrs_complete_silently_and_are_implied() {
    let (a, b) = pair();
    let src = a.buf(64, LW);
    let dst = b.buf(64, LW | AccessFlags::REMOTE_WRITE);
    let w = |id, off| {
        wr(
            id,
            SendOp::Write {
                remote_addr: dst.addr() + off,
                rkey: dst.rkey(),
            },
            &[src.sge(off as usize, 8)],
            SendFlags::NONE,
        )
    };
    src.fill_pattern(9);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe { a.qp.post_send(&[w(1, 0), w(2, 8), w(3, 16)]) }.unwrap();
    expect_none(&a.scq, Duration::from_millis(50));
    let mut last = w(4, 24);
    last.flags = SIG;
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe { a.qp.post_send(&[last]) }.unwrap();
    let c = poll_one(&a.scq);
    assert_eq!((c.wr_id, c.status), (4, WcStatus::Success));
    // The signaled completion implies the earlier writes landed.
    assert_eq!(&dst.read()[..32], &src.read()[..32]);
    expect_none(&a.scq, Duration::from_millis(20));
}

#[test]
fn queue_limits_are_enforced() {
    let ctx = open_test_context();
    let opts = PairOpts {
        caps: QpCaps {
            max_send_wr: 4,
            max_recv_wr: 2,
            max_send_sge: 2,
            max_recv_sge: 1,
            max_inline_data: 16,
        },
        ..PairOpts::default()
    };
    let (a, b) = connect_pair(&ctx, &ctx, &opts);
    let buf = a.buf(64, LW);
    // Receive queue: two fit, the third fails with QueueFull at index 2.
    let rb = b.buf(64, LW);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    let e = unsafe {
        b.qp.post_recv(&[
            rwr(1, &[rb.sge(0, 8)]),
            rwr(2, &[rb.sge(8, 8)]),
            rwr(3, &[rb.sge(16, 8)]),
        ])
    }
    .unwrap_err();
    assert_eq!(e.posted, 2);
    assert!(matches!(
        e.error,
        ProviderError::QueueFull {
            queue: "receive",
            ..
        }
    ));
    // Too many SGEs.
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    let e = unsafe {
        a.qp.post_send(&[wr(
            1,
            SendOp::Send,
            &[buf.sge(0, 1), buf.sge(1, 1), buf.sge(2, 1)],
            SIG,
        )])
    }
    .unwrap_err();
    assert_eq!(e.posted, 0);
    assert!(matches!(e.error, ProviderError::InvalidArgument { .. }));
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    let e = unsafe { b.qp.post_recv(&[rwr(9, &[rb.sge(0, 1), rb.sge(1, 1)])]) }.unwrap_err();
    assert!(matches!(
        e.error,
        ProviderError::QueueFull { .. } | ProviderError::InvalidArgument { .. }
    ));
    // Send queue: RNR keeps the sends outstanding (no more RECVs), so the
    // fifth post fails.
    let sends: Vec<SendWr> = (0..5)
        .map(|i| wr(i, SendOp::Send, &[buf.sge(0, 4)], SIG))
        .collect();
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    let e = unsafe { a.qp.post_send(&sends) }.unwrap_err();
    assert_eq!(e.posted, 4);
    assert!(matches!(
        e.error,
        ProviderError::QueueFull {
            queue: "send",
            depth: 4,
            ..
        }
    ));
}

#[test]
fn ping_pong_between_two_threads() {
    let (a, b) = pair();
    const N: usize = 2000;
    let run = |s: Side, initiator: bool| {
        let sb = s.buf(64, LW);
        let rb = s.buf(64, LW);
        // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
        unsafe { s.qp.post_recv(&[rwr(1, &[rb.sge(0, 64)])]) }.unwrap();
        let mut wc = [Completion::EMPTY; 16];
        let mut sent = 0;
        for i in 0..N {
            if initiator {
                sb.write(0, &(i as u64).to_le_bytes());
                // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
                unsafe {
                    s.qp.post_send(&[wr(2, SendOp::Send, &[sb.sge(0, 64)], SIG)])
                }
                .unwrap();
            }
            let c = poll_one(&s.rcq);
            assert_eq!(c.status, WcStatus::Success, "iteration {i}");
            assert_eq!(rb.u64_at(0), i as u64);
            // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
            unsafe { s.qp.post_recv(&[rwr(1, &[rb.sge(0, 64)])]) }.unwrap();
            if !initiator {
                sb.write(0, &(i as u64).to_le_bytes());
                // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
                unsafe {
                    s.qp.post_send(&[wr(2, SendOp::Send, &[sb.sge(0, 64)], SIG)])
                }
                .unwrap();
            }
            let n = s.scq.poll(&mut wc).unwrap();
            assert!(wc[..n].iter().all(|c| c.status == WcStatus::Success));
            sent += n;
        }
        // The buffers must stay registered until the last SEND completed.
        let rest = poll_n(&s.scq, N - sent);
        assert!(rest.iter().all(|c| c.status == WcStatus::Success));
        s
    };
    std::thread::scope(|sc| {
        let h = sc.spawn(|| run(b, false));
        // Keep both sides alive until both are done.
        let sa = run(a, true);
        let sb = h.join().unwrap();
        drop((sa, sb));
    });
}

#[test]
fn engine_stops_when_the_last_handle_is_dropped() {
    let ctx = open_test_context();
    let addr = ctx.addr().to_socket().unwrap();
    let (a, b) = connect_pair(&ctx, &ctx, &PairOpts::default());
    let cq_other = open_test_context().create_cq(4, None).unwrap();
    // Objects of another device are refused.
    assert!(a
        .pd
        .create_qp(&cq_other, &a.rcq, QpCaps::default())
        .is_err());
    drop(ctx);
    // Still alive: the QPs keep the device open.
    assert!(std::net::TcpStream::connect(addr).is_ok());
    drop((a, b));
    // The engine thread was joined and its listener closed.
    assert!(std::net::TcpStream::connect(addr).is_err());
}

#[test]
fn reset_and_reconnect_after_error() {
    let ctx = open_test_context();
    let opts = PairOpts::default();
    let (a, b) = connect_pair(&ctx, &ctx, &opts);
    let src = a.buf(64, LW);
    src.fill_pattern(2);
    let dst = b.buf(64, LW);
    // Break both QPs, then start over from RESET.
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        a.qp.post_send(&[wr(1, SendOp::Send, &[src.sge(0, 8)], SIG)])
    }
    .unwrap();
    a.qp.modify_to_err().unwrap();
    b.qp.modify_to_err().unwrap();
    let _ = poll_one(&a.scq);
    for qp in [&a.qp, &b.qp] {
        qp.modify_to_reset().unwrap();
        assert_eq!(qp.state(), QpState::Reset);
    }
    bring_up(&a.qp, b.qp.endpoint(0).unwrap(), &opts);
    bring_up(&b.qp, a.qp.endpoint(0).unwrap(), &opts);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe { b.qp.post_recv(&[rwr(5, &[dst.sge(0, 64)])]) }.unwrap();
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        a.qp.post_send(&[wr(2, SendOp::Send, &[src.sge(0, 64)], SIG)])
    }
    .unwrap();
    let c = poll_one(&a.scq);
    assert_eq!((c.wr_id, c.status), (2, WcStatus::Success));
    assert_eq!(poll_one(&b.rcq).wr_id, 5);
    assert_eq!(dst.read(), src.read());
}
