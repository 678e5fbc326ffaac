//! Soft device: RNR, access violations, local errors and flushing follow RC
//! hardware (see DESIGN.md §2.1 for the status table).

mod common;

use std::time::Duration;

use common::*;
use verbio_runtime::provider::*;

const SIG: SendFlags = SendFlags::SIGNALED;

fn rnr_opts(rnr_retry: u8, min_rnr_timer: u8) -> PairOpts {
    PairOpts {
        rts: RtsAttr {
            rnr_retry,
            ..RtsAttr::default()
        },
        min_rnr_timer,
        ..PairOpts::default()
    }
}

#[test]
fn rnr_waits_then_succeeds_once_a_recv_is_posted() {
    let ctx = open_test_context();
    // 7 = retry forever; timer 12 = 0.64 ms.
    let (a, b) = connect_pair(&ctx, &ctx, &rnr_opts(7, 12));
    let src = a.buf(32, LW);
    src.fill_pattern(4);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        a.qp.post_send(&[wr(1, SendOp::Send, &[src.sge(0, 32)], SIG)])
    }
    .unwrap();
    expect_none(&a.scq, Duration::from_millis(60));
    assert_eq!(a.qp.state(), QpState::Rts);
    let dst = b.buf(32, LW);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe { b.qp.post_recv(&[rwr(9, &[dst.sge(0, 32)])]) }.unwrap();
    let c = poll_one(&a.scq);
    assert_eq!((c.wr_id, c.status), (1, WcStatus::Success));
    let r = poll_one(&b.rcq);
    assert_eq!((r.wr_id, r.byte_len), (9, 32));
    assert_eq!(dst.read(), src.read());
}

#[test]
fn rnr_retry_exhausted_fails_and_flushes() {
    let ctx = open_test_context();
    let (a, b) = connect_pair(&ctx, &ctx, &rnr_opts(2, 1));
    let src = a.buf(32, LW);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        a.qp.post_send(&[
            wr(1, SendOp::Send, &[src.sge(0, 8)], SIG),
            wr(2, SendOp::Send, &[src.sge(8, 8)], SendFlags::NONE),
        ])
    }
    .unwrap();
    let c = poll_n(&a.scq, 2);
    assert_eq!(
        (c[0].wr_id, c[0].status, c[0].byte_len),
        (1, WcStatus::RnrRetryExcErr, 0)
    );
    // Errors after the first one flush, even unsignaled WRs.
    assert_eq!((c[1].wr_id, c[1].status), (2, WcStatus::WrFlushErr));
    assert_eq!(a.qp.state(), QpState::Err);
    // The responder is unaffected.
    assert_eq!(b.qp.state(), QpState::Rts);
    expect_none(&b.rcq, Duration::from_millis(10));
}

/// Sets up a pair whose responder has two posted RECVs, runs `op` (built
/// from the responder buffer) and checks the full access-error outcome.
fn access_error_case(
    mr_access: AccessFlags,
    qp_access: AccessFlags,
    op: impl Fn(&RegBuf) -> SendOp,
) {
    let ctx = open_test_context();
    let opts = PairOpts {
        access: qp_access,
        ..PairOpts::default()
    };
    let (a, b) = connect_pair(&ctx, &ctx, &opts);
    let target = b.buf(64, mr_access);
    let rb = b.buf(16, LW);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        b.qp.post_recv(&[rwr(100, &[rb.sge(0, 8)]), rwr(101, &[rb.sge(8, 8)])])
    }
    .unwrap();
    let local = a.buf(64, LW);
    local.fill_pattern(0x55);
    let sge_len = match op(&target) {
        SendOp::CompareAndSwap { .. } | SendOp::FetchAndAdd { .. } => 8,
        _ => 16,
    };
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        a.qp.post_send(&[wr(1, op(&target), &[local.sge(0, sge_len)], SIG)])
    }
    .unwrap();
    let c = poll_one(&a.scq);
    assert_eq!(
        (c.wr_id, c.status, c.byte_len),
        (1, WcStatus::RemAccessErr, 0)
    );
    wait_state(&a.qp, QpState::Err);
    wait_state(&b.qp, QpState::Err);
    // Responder: posted RECVs flushed, memory untouched.
    let r = poll_n(&b.rcq, 2);
    assert_eq!(
        r.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
        vec![(100, WcStatus::WrFlushErr), (101, WcStatus::WrFlushErr)]
    );
    assert!(
        target.read().iter().all(|&x| x == 0),
        "responder memory touched"
    );
    if sge_len == 16 {
        // READ results never landed either.
        assert_eq!(local.read(), {
            let l = a.buf(64, LW);
            l.fill_pattern(0x55)
        });
    }
    // Later WRs on the requester are flushed.
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        a.qp.post_send(&[wr(2, SendOp::Send, &[local.sge(0, 4)], SIG)])
    }
    .unwrap();
    let c = poll_one(&a.scq);
    assert_eq!(
        (c.wr_id, c.status, c.byte_len),
        (2, WcStatus::WrFlushErr, 0)
    );
}

fn write_to(t: &RegBuf, off: u64, rkey: u32) -> SendOp {
    SendOp::Write {
        remote_addr: t.addr() + off,
        rkey,
    }
}

#[test]
fn write_with_wrong_rkey_is_rem_access_err() {
    access_error_case(AccessFlags::ALL, InitAttr::default().access, |t| {
        write_to(t, 0, t.rkey() ^ 0x5a5a)
    });
}

#[test]
fn write_one_byte_out_of_bounds_is_rem_access_err() {
    // 16 bytes at offset 49 of a 64-byte region: the last byte is outside.
    access_error_case(AccessFlags::ALL, InitAttr::default().access, |t| {
        write_to(t, 49, t.rkey())
    });
}

#[test]
fn write_to_read_only_mr_is_rem_access_err() {
    access_error_case(
        LW | AccessFlags::REMOTE_READ,
        InitAttr::default().access,
        |t| write_to(t, 0, t.rkey()),
    );
}

#[test]
fn write_without_qp_remote_write_is_rem_access_err() {
    access_error_case(AccessFlags::ALL, AccessFlags::REMOTE_READ, |t| {
        write_to(t, 0, t.rkey())
    });
}

#[test]
fn read_without_remote_read_is_rem_access_err() {
    access_error_case(
        LW | AccessFlags::REMOTE_WRITE,
        InitAttr::default().access,
        |t| SendOp::Read {
            remote_addr: t.addr(),
            rkey: t.rkey(),
        },
    );
}

#[test]
fn atomic_without_remote_atomic_is_rem_access_err() {
    access_error_case(
        LW | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        InitAttr::default().access,
        |t| SendOp::FetchAndAdd {
            remote_addr: t.addr(),
            rkey: t.rkey(),
            add: 1,
        },
    );
}

#[test]
fn misaligned_atomic_is_refused_at_post() {
    let (a, b) = pair();
    let t = b.buf(64, AccessFlags::ALL);
    let local = a.buf(16, LW);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    let e = unsafe {
        a.qp.post_send(&[wr(
            1,
            SendOp::FetchAndAdd {
                remote_addr: t.addr() + 4,
                rkey: t.rkey(),
                add: 1,
            },
            &[local.sge(0, 8)],
            SIG,
        )])
    }
    .unwrap_err();
    assert_eq!(e.posted, 0);
    assert!(matches!(e.error, ProviderError::InvalidArgument { .. }));
    // An atomic needs one 8-byte local SGE.
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    let e = unsafe {
        a.qp.post_send(&[wr(
            2,
            SendOp::CompareAndSwap {
                remote_addr: t.addr(),
                rkey: t.rkey(),
                compare: 0,
                swap: 1,
            },
            &[local.sge(0, 4)],
            SIG,
        )])
    }
    .unwrap_err();
    assert!(matches!(e.error, ProviderError::InvalidArgument { .. }));
    expect_none(&a.scq, Duration::from_millis(20));
    assert_eq!(a.qp.state(), QpState::Rts);
    assert!(t.read().iter().all(|&x| x == 0));
}

#[test]
fn deregistered_rkey_fails_at_once() {
    let (a, b) = pair();
    let mut t = b.buf(64, AccessFlags::ALL);
    let (addr, rkey) = (t.addr(), t.rkey());
    let local = a.buf(64, LW);
    local.fill_pattern(1);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        a.qp.post_send(&[wr(1, write_to(&t, 0, rkey), &[local.sge(0, 8)], SIG)])
    }
    .unwrap();
    assert_eq!(poll_one(&a.scq).status, WcStatus::Success);
    t.write(0, &[0; 8]);
    t.dereg();
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        a.qp.post_send(&[wr(
            2,
            SendOp::Write {
                remote_addr: addr,
                rkey,
            },
            &[local.sge(0, 8)],
            SIG,
        )])
    }
    .unwrap();
    assert_eq!(poll_one(&a.scq).status, WcStatus::RemAccessErr);
    assert!(t.read().iter().all(|&x| x == 0));
}

#[test]
fn modify_to_err_flushes_outstanding_and_later_wrs() {
    let ctx = open_test_context();
    // No RECV at the responder and infinite RNR retry: the SENDs stay outstanding.
    let (a, b) = connect_pair(&ctx, &ctx, &rnr_opts(7, 14));
    let src = a.buf(64, LW);
    let sends: Vec<SendWr> = (1..=3)
        .map(|i| {
            wr(
                i,
                SendOp::Send,
                &[src.sge(0, 8)],
                if i == 2 { SendFlags::NONE } else { SIG },
            )
        })
        .collect();
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe { a.qp.post_send(&sends) }.unwrap();
    let rb = a.buf(8, LW);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe { a.qp.post_recv(&[rwr(50, &[rb.sge(0, 8)])]) }.unwrap();
    expect_none(&a.scq, Duration::from_millis(20));
    a.qp.modify_to_err().unwrap();
    let c = poll_n(&a.scq, 3);
    for (i, c) in c.iter().enumerate() {
        assert_eq!(
            (c.wr_id, c.status, c.byte_len),
            (i as u64 + 1, WcStatus::WrFlushErr, 0)
        );
    }
    let r = poll_one(&a.rcq);
    assert_eq!((r.wr_id, r.status), (50, WcStatus::WrFlushErr));
    // Posted after ERR: flushed too.
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        a.qp.post_send(&[wr(9, SendOp::Send, &[src.sge(0, 8)], SIG)])
    }
    .unwrap();
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe { a.qp.post_recv(&[rwr(51, &[rb.sge(0, 8)])]) }.unwrap();
    assert_eq!(poll_one(&a.scq).status, WcStatus::WrFlushErr);
    assert_eq!(poll_one(&a.rcq).wr_id, 51);
    drop(b);
}

#[test]
fn bad_lkey_is_loc_prot_err_and_nothing_is_sent() {
    let (a, b) = pair();
    let rb = b.buf(64, LW);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe { b.qp.post_recv(&[rwr(1, &[rb.sge(0, 64)])]) }.unwrap();
    let src = a.buf(64, LW);
    let mut bad = src.sge(0, 8);
    bad.lkey ^= 0x77;
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        a.qp.post_send(&[
            wr(1, SendOp::Send, &[bad], SIG),
            wr(2, SendOp::Send, &[src.sge(0, 8)], SIG),
        ])
    }
    .unwrap();
    let c = poll_n(&a.scq, 2);
    assert_eq!(
        (c[0].wr_id, c[0].status, c[0].byte_len),
        (1, WcStatus::LocProtErr, 0)
    );
    assert_eq!((c[1].wr_id, c[1].status), (2, WcStatus::WrFlushErr));
    assert_eq!(a.qp.state(), QpState::Err);
    // Nothing reached the responder: its RECV is still posted, QP still RTS.
    expect_none(&b.rcq, Duration::from_millis(30));
    assert_eq!(b.qp.state(), QpState::Rts);
    // An SGE outside its MR (1 byte beyond) is a bad local SGE too.
    let (a, _b) = pair();
    let src = a.buf(64, LW);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        a.qp.post_send(&[wr(1, SendOp::Send, &[src.sge(60, 5)], SIG)])
    }
    .unwrap();
    assert_eq!(poll_one(&a.scq).status, WcStatus::LocProtErr);
}

#[test]
fn send_longer_than_recv_is_rem_op_err_and_loc_len_err() {
    let (a, b) = pair();
    let rb = b.buf(64, LW);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        b.qp.post_recv(&[rwr(1, &[rb.sge(0, 16)]), rwr(2, &[rb.sge(16, 16)])])
    }
    .unwrap();
    let src = a.buf(64, LW);
    src.fill_pattern(3);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        a.qp.post_send(&[wr(1, SendOp::Send, &[src.sge(0, 17)], SIG)])
    }
    .unwrap();
    let c = poll_one(&a.scq);
    // rxe: REM_OP_ERR (spec/mlx5: REM_INV_REQ_ERR); we follow rxe.
    assert_eq!((c.status, c.byte_len), (WcStatus::RemOpErr, 0));
    let r = poll_n(&b.rcq, 2);
    assert_eq!(
        (r[0].wr_id, r[0].status, r[0].byte_len),
        (1, WcStatus::LocLenErr, 0)
    );
    assert_eq!((r[1].wr_id, r[1].status), (2, WcStatus::WrFlushErr));
    wait_state(&b.qp, QpState::Err);
    wait_state(&a.qp, QpState::Err);
    assert!(rb.read().iter().all(|&x| x == 0));
}

#[test]
fn memory_of_another_pd_is_not_reachable() {
    let ctx = open_test_context();
    let (a, b) = connect_pair(&ctx, &ctx, &PairOpts::default());
    // Local: an lkey of another PD of the same device.
    let other_pd = ctx.alloc_pd().unwrap();
    let foreign = RegBuf::new(&other_pd, 64, AccessFlags::ALL);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        a.qp.post_send(&[wr(
            1,
            SendOp::Write {
                remote_addr: 0,
                rkey: 0,
            },
            &[foreign.sge(0, 8)],
            SIG,
        )])
    }
    .unwrap();
    assert_eq!(poll_one(&a.scq).status, WcStatus::LocProtErr);
    // Remote: an rkey of a PD other than the responder QP's.
    let (a, b2) = connect_pair(&ctx, &ctx, &PairOpts::default());
    let target = RegBuf::new(&b.pd, 64, AccessFlags::ALL); // b's PD, not b2's
    let src = a.buf(64, LW);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        a.qp.post_send(&[wr(
            2,
            write_to(&target, 0, target.rkey()),
            &[src.sge(0, 8)],
            SIG,
        )])
    }
    .unwrap();
    assert_eq!(poll_one(&a.scq).status, WcStatus::RemAccessErr);
    assert!(target.read().iter().all(|&x| x == 0));
    drop(b2);
}

#[test]
fn no_memory_access_after_a_flush_completion() {
    // A peer that accepts but never reads: a big WRITE stalls mid-payload.
    // After its flush completion the source buffer is reused; the new
    // contents must never reach the wire.
    use std::io::Read;
    let ctx = open_test_context();
    let a = make_side(&ctx, &PairOpts::default());
    let fake = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    fake.set_nonblocking(true).unwrap();
    let mut ep = a.qp.endpoint(0).unwrap();
    ep.addr = fake.local_addr().unwrap().into();
    ep.qpn = 0x77;
    bring_up(&a.qp, ep, &PairOpts::default());
    const LEN: usize = 16 * 1024 * 1024;
    let src = a.buf(LEN, LW);
    src.write(0, &vec![1u8; LEN]);
    let write = |id| {
        wr(
            id,
            SendOp::Write {
                remote_addr: 0x1000,
                rkey: 1,
            },
            &[src.sge(0, LEN)],
            SIG,
        )
    };
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe { a.qp.post_send(&[write(1), write(2)]) }.unwrap();
    let deadline = std::time::Instant::now() + WAIT;
    let mut peer = loop {
        match fake.accept() {
            Ok((s, _)) => break s,
            Err(_) => {
                assert!(std::time::Instant::now() < deadline, "no connection");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    };
    std::thread::sleep(Duration::from_millis(50)); // socket buffers fill up
    a.qp.modify_to_err().unwrap();
    let c = poll_n(&a.scq, 2);
    assert!(c.iter().all(|c| c.status == WcStatus::WrFlushErr), "{c:?}");
    // Reuse the memory right after the completions, then drain the wire.
    src.write(0, &vec![0xEEu8; LEN]);
    peer.set_nonblocking(false).unwrap();
    peer.set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let (mut total, mut marked) = (0usize, 0usize);
    let mut buf = vec![0u8; 1 << 16];
    while let Ok(n) = peer.read(&mut buf) {
        if n == 0 {
            break;
        }
        total += n;
        marked += buf[..n].iter().filter(|&&x| x == 0xEE).count();
    }
    assert!(total > 0);
    // Only header bytes may happen to be 0xEE; no payload.
    assert!(marked < 4096, "{marked} bytes of reused memory were sent");
}
