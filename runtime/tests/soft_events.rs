//! Soft device: completion channel and async-event semantics, CQ overflow,
//! and robustness against garbage on the data-plane listener.

mod common;

use std::io::Write;
use std::os::fd::RawFd;
use std::time::Duration;

use common::*;
use verbio_runtime::provider::*;

const SIG: SendFlags = SendFlags::SIGNALED;

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

fn side_with_channel(ctx: &Context, opts: &PairOpts) -> (Side, CompChannel) {
    let ch = ctx.create_comp_channel().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let scq = ctx.create_cq(opts.cqe, Some(&ch)).unwrap();
    let rcq = ctx.create_cq(opts.cqe, Some(&ch)).unwrap();
    let qp = pd.create_qp(&scq, &rcq, opts.caps).unwrap();
    (
        Side {
            ctx: ctx.clone(),
            pd,
            scq,
            rcq,
            qp,
        },
        ch,
    )
}

#[test]
fn channel_signals_once_after_arming_and_never_unarmed() {
    let ctx = open_test_context();
    let opts = PairOpts::default();
    let (a, ch) = side_with_channel(&ctx, &opts);
    let b = make_side(&ctx, &opts);
    bring_up(&a.qp, b.qp.endpoint(0).unwrap(), &opts);
    bring_up(&b.qp, a.qp.endpoint(0).unwrap(), &opts);
    let src = a.buf(64, LW);
    let dst = b.buf(64, AccessFlags::ALL);
    let write = |id| {
        wr(
            id,
            SendOp::Write {
                remote_addr: dst.addr(),
                rkey: dst.rkey(),
            },
            &[src.sge(0, 8)],
            SIG,
        )
    };
    // Unarmed: a completion arrives, the channel stays silent.
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe { a.qp.post_send(&[write(1)]) }.unwrap();
    assert_eq!(poll_one(&a.scq).wr_id, 1);
    assert!(!readable(ch.fd(), 20));
    assert_eq!(ch.get_event().unwrap(), None);
    // Armed: exactly one event for the next completion(s).
    a.scq.req_notify(false).unwrap();
    assert!(!readable(ch.fd(), 0));
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe { a.qp.post_send(&[write(2), write(3)]) }.unwrap();
    assert!(readable(ch.fd(), 5000));
    assert_eq!(ch.get_event().unwrap(), Some(a.scq.handle()));
    a.scq.ack_events(1);
    assert_eq!(ch.get_event().unwrap(), None);
    assert_eq!(poll_n(&a.scq, 2).len(), 2);
    // Disarmed again: no more events.
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe { a.qp.post_send(&[write(4)]) }.unwrap();
    assert_eq!(poll_one(&a.scq).wr_id, 4);
    assert!(!readable(ch.fd(), 20));
    // Arming the receive CQ: its completion names that CQ.
    a.rcq.req_notify(false).unwrap();
    let rb = a.buf(8, LW);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe { a.qp.post_recv(&[rwr(7, &[rb.sge(0, 8)])]) }.unwrap();
    let bsrc = b.buf(8, LW);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        b.qp.post_send(&[wr(8, SendOp::Send, &[bsrc.sge(0, 8)], SIG)])
    }
    .unwrap();
    assert!(readable(ch.fd(), 5000));
    assert_eq!(ch.get_event().unwrap(), Some(a.rcq.handle()));
    a.rcq.ack_events(1);
    assert!(!readable(ch.fd(), 0));
}

#[test]
fn solicited_only_ignores_unsolicited_receives() {
    let ctx = open_test_context();
    let opts = PairOpts::default();
    let (a, ch) = side_with_channel(&ctx, &opts);
    let b = make_side(&ctx, &opts);
    bring_up(&a.qp, b.qp.endpoint(0).unwrap(), &opts);
    bring_up(&b.qp, a.qp.endpoint(0).unwrap(), &opts);
    let rb = a.buf(16, LW);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        a.qp.post_recv(&[rwr(1, &[rb.sge(0, 8)]), rwr(2, &[rb.sge(8, 8)])])
    }
    .unwrap();
    a.rcq.req_notify(true).unwrap();
    let src = b.buf(8, LW);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        b.qp.post_send(&[wr(1, SendOp::Send, &[src.sge(0, 8)], SIG)])
    }
    .unwrap();
    assert_eq!(poll_one(&a.rcq).wr_id, 1);
    assert!(!readable(ch.fd(), 20));
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        b.qp.post_send(&[wr(
            2,
            SendOp::Send,
            &[src.sge(0, 8)],
            SIG | SendFlags::SOLICITED,
        )])
    }
    .unwrap();
    assert!(readable(ch.fd(), 5000));
    assert_eq!(ch.get_event().unwrap(), Some(a.rcq.handle()));
}

#[test]
fn cq_overflow_is_reported_on_poll_and_async_fd_and_fails_its_qps() {
    let ctx = open_test_context();
    let opts = PairOpts {
        cqe: 4,
        ..PairOpts::default()
    };
    let (a, b) = connect_pair(&ctx, &ctx, &opts);
    let src = a.buf(64, LW);
    let dst = b.buf(64, AccessFlags::ALL);
    assert!(!readable(ctx.async_fd(), 0));
    let writes: Vec<SendWr> = (0..6)
        .map(|i| {
            wr(
                i,
                SendOp::Write {
                    remote_addr: dst.addr(),
                    rkey: dst.rkey(),
                },
                &[src.sge(0, 8)],
                SIG,
            )
        })
        .collect();
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe { a.qp.post_send(&writes) }.unwrap();
    assert!(readable(ctx.async_fd(), 5000), "no async event");
    let ev = ctx.get_async_event().unwrap().unwrap();
    assert_eq!(ev.kind, AsyncEventKind::CqErr);
    assert_eq!(ev.element, AsyncElement::Cq(a.scq.handle()));
    let mut wc = [Completion::EMPTY; 8];
    assert!(matches!(
        a.scq.poll(&mut wc),
        Err(ProviderError::CqOverflow { capacity: 4, .. })
    ));
    // The QP whose completions were lost is in error (fatal event), its
    // peer on other CQs is not.
    wait_state(&a.qp, QpState::Err);
    assert!(readable(ctx.async_fd(), 5000), "no QP event");
    let ev = ctx.get_async_event().unwrap().unwrap();
    assert_eq!(ev.kind, AsyncEventKind::QpFatal);
    assert_eq!(ev.element, AsyncElement::Qp(a.qp.qp_num()));
    assert_eq!(b.qp.state(), QpState::Rts);
    // WRs posted to it now are flushed; a RECV shows it on its receive CQ
    // (its send CQ is the overflowed one).
    let r = a.buf(8, LW);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe { a.qp.post_recv(&[rwr(9, &[r.sge(0, 8)])]) }.unwrap();
    let c = poll_one(&a.rcq);
    assert_eq!((c.wr_id, c.status), (9, WcStatus::WrFlushErr));
}

#[test]
fn garbage_on_the_listener_does_not_hurt_other_qps() {
    let (ca, cb) = (open_test_context(), open_test_context());
    let (a, b) = connect_pair(&ca, &cb, &PairOpts::default());
    // b's engine serves a's TCP connection on the same listener.
    let addr = cb.addr().to_socket().unwrap();
    // Random junk, a valid-looking magic with a bad version, and a half header.
    let mut junk: Vec<Vec<u8>> = vec![
        (0..4096u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect(),
        vec![0x42, 0x56, 9, 1, 0, 0, 0, 0],
        vec![0x42, 0x56, 1],
    ];
    // A well-formed HELLO followed by a request for a QP number that does not exist.
    let mut hello = vec![0x42, 0x56, 1, 0x01, 19, 0, 0, 0];
    hello.resize(56, 0);
    hello.push(4);
    hello.extend_from_slice(&[0; 10]);
    hello.extend_from_slice(&[0xff, 0xff, 127, 0, 0, 1]);
    hello.extend_from_slice(&1u16.to_le_bytes());
    let mut req = vec![0x42, 0x56, 1, 0x16, 0, 0, 0, 0];
    req.extend_from_slice(&0x00ab_cdefu32.to_le_bytes());
    req.resize(56, 0);
    hello.extend_from_slice(&req);
    junk.push(hello);
    for j in &junk {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        let _ = s.write_all(j);
    }
    std::thread::sleep(Duration::from_millis(50));
    // The engine still serves the real QPs.
    let src = a.buf(64, LW);
    src.fill_pattern(8);
    let dst = b.buf(64, LW);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe { b.qp.post_recv(&[rwr(1, &[dst.sge(0, 64)])]) }.unwrap();
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        a.qp.post_send(&[wr(1, SendOp::Send, &[src.sge(0, 64)], SIG)])
    }
    .unwrap();
    assert_eq!(poll_one(&a.scq).status, WcStatus::Success);
    assert_eq!(poll_one(&b.rcq).byte_len, 64);
    assert_eq!(dst.read(), src.read());
}
