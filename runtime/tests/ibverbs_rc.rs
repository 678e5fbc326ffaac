//! ibverbs provider: two RC QPs of one device connected to each other
//! (loopback), exercising every send opcode, error completions, flushes,
//! post lists and the completion channel. Runs in the rxe VM
//! (`scripts/rxe-test.sh`); prints SKIPPED without a device.
#![cfg(feature = "ibverbs")]

mod ibverbs_support;

use std::time::{Duration, Instant};

use ibverbs_support::{device, pair, pair_cfg, pair_with, wait, Buf, PairCfg, WAIT};
use verbio_runtime::provider::{
    AccessFlags, AsyncElement, AsyncEventKind, Completion, PostError, ProviderError, QpCaps,
    QpState, RecvWr, RtsAttr, SendFlags, SendOp, SendWr, SgList, Sge, WcOpcode, WcStatus,
};

fn send(wr_id: u64, sg_list: SgList, op: SendOp) -> SendWr {
    SendWr {
        wr_id,
        sg_list,
        op,
        flags: SendFlags::SIGNALED,
    }
}

#[test]
fn send_recv_with_immediate() {
    let Some(ctx) = device("send_recv_with_immediate") else {
        return;
    };
    let p = pair(ctx);
    let mut src = Buf::new(&p.pd, 4096, AccessFlags::LOCAL_WRITE);
    let dst = Buf::new(&p.pd, 4096, AccessFlags::LOCAL_WRITE);
    src.fill(|i| (i * 7 + 3) as u8);
    // SAFETY: SGEs of Bufs, which uphold the post contract (see Buf).
    unsafe {
        p.b.post_recv(&[RecvWr {
            wr_id: 11,
            sg_list: dst.sge(0, 4096),
        }])
    }
    .expect("post_recv");
    // SAFETY: SGEs of Bufs, which uphold the post contract (see Buf).
    unsafe {
        p.a.post_send(&[send(
            22,
            src.sge(0, 3000),
            SendOp::SendWithImm { imm: 0xdead_beef },
        )])
    }
    .expect("post_send");
    let sc = wait(&p.cq_a, 1);
    assert_eq!(sc[0].wr_id, 22);
    assert_eq!(sc[0].status, WcStatus::Success);
    assert_eq!(sc[0].opcode, WcOpcode::Send);
    assert_eq!(sc[0].qp_num, p.a.qp_num());
    let rc = wait(&p.cq_b, 1);
    assert_eq!(rc[0].wr_id, 11);
    assert_eq!(rc[0].status, WcStatus::Success);
    assert_eq!(rc[0].opcode, WcOpcode::Recv);
    assert_eq!(rc[0].byte_len, 3000);
    assert_eq!(rc[0].imm_data, Some(0xdead_beef));
    assert_eq!(rc[0].qp_num, p.b.qp_num());
    assert_eq!(&dst.bytes()[..3000], &src.bytes()[..3000]);
    assert!(dst.bytes()[3000..].iter().all(|&b| b == 0));

    // Plain SEND with two SGEs gathers them in order; no immediate.
    // SAFETY: SGEs of Bufs, which uphold the post contract (see Buf).
    unsafe {
        p.b.post_recv(&[RecvWr {
            wr_id: 12,
            sg_list: dst.sge(0, 4096),
        }])
    }
    .expect("post_recv");
    let mut sgl = src.sge(100, 10);
    sgl.extend(src.sge(0, 5));
    // SAFETY: SGEs of Bufs, which uphold the post contract (see Buf).
    unsafe { p.a.post_send(&[send(23, sgl, SendOp::Send)]) }.expect("post_send");
    assert_eq!(wait(&p.cq_a, 1)[0].status, WcStatus::Success);
    let rc = wait(&p.cq_b, 1);
    assert_eq!((rc[0].byte_len, rc[0].imm_data), (15, None));
    assert_eq!(&dst.bytes()[..10], &src.bytes()[100..110]);
    assert_eq!(&dst.bytes()[10..15], &src.bytes()[..5]);
}

#[test]
fn inline_send_needs_no_registered_memory() {
    let Some(ctx) = device("inline_send_needs_no_registered_memory") else {
        return;
    };
    let p = pair(ctx);
    let dst = Buf::new(&p.pd, 256, AccessFlags::LOCAL_WRITE);
    // SAFETY: SGEs of Bufs, which uphold the post contract (see Buf).
    unsafe {
        p.b.post_recv(&[RecvWr {
            wr_id: 1,
            sg_list: dst.sge(0, 256),
        }])
    }
    .expect("post_recv");
    let payload = *b"inline payload, copied at post time";
    let mut sgl = SgList::new();
    sgl.push(Sge {
        addr: payload.as_ptr() as u64,
        length: payload.len() as u32,
        lkey: 0,
    });
    // SAFETY: INLINE: `payload` (a live local nobody writes) is copied
    // during the call; its lkey is not used.
    unsafe {
        p.a.post_send(&[SendWr {
            wr_id: 2,
            sg_list: sgl.clone(),
            op: SendOp::Send,
            flags: SendFlags::SIGNALED | SendFlags::INLINE,
        }])
    }
    .expect("inline post_send");
    assert_eq!(wait(&p.cq_a, 1)[0].status, WcStatus::Success);
    let rc = wait(&p.cq_b, 1);
    assert_eq!(rc[0].byte_len as usize, payload.len());
    assert_eq!(&dst.bytes()[..payload.len()], &payload);

    // More than max_inline_data is refused before reaching the device.
    let big = vec![0u8; p.a.caps().max_inline_data as usize + 1];
    let mut sgl = SgList::new();
    sgl.push(Sge {
        addr: big.as_ptr() as u64,
        length: big.len() as u32,
        lkey: 0,
    });
    // SAFETY: INLINE: `big` is a live Vec, readable during the call (which
    // refuses it: too big for max_inline_data).
    let err = unsafe {
        p.a.post_send(&[SendWr {
            wr_id: 3,
            sg_list: sgl,
            op: SendOp::Send,
            flags: SendFlags::SIGNALED | SendFlags::INLINE,
        }])
    }
    .expect_err("oversized inline");
    assert_eq!(err.posted, 0);
    assert!(
        matches!(err.error, ProviderError::InvalidArgument { .. }),
        "{err:?}"
    );
}

#[test]
fn rdma_write_write_with_imm_and_read() {
    let Some(ctx) = device("rdma_write_write_with_imm_and_read") else {
        return;
    };
    let p = pair(ctx);
    let mut local = Buf::new(&p.pd, 8192, AccessFlags::LOCAL_WRITE);
    let mut remote = Buf::new(
        &p.pd,
        8192,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
    );
    local.fill(|i| (i % 251) as u8);
    let (raddr, rkey) = (remote.addr(), remote.mr.rkey());

    // SAFETY: SGEs of Bufs, which uphold the post contract (see Buf).
    unsafe {
        p.a.post_send(&[send(
            1,
            local.sge(0, 5000),
            SendOp::Write {
                remote_addr: raddr + 1000,
                rkey,
            },
        )])
    }
    .expect("WRITE");
    let c = wait(&p.cq_a, 1);
    assert_eq!(
        (c[0].wr_id, c[0].status, c[0].opcode),
        (1, WcStatus::Success, WcOpcode::RdmaWrite)
    );
    assert_eq!(&remote.bytes()[1000..6000], &local.bytes()[..5000]);
    assert!(remote.bytes()[..1000].iter().all(|&b| b == 0));

    // WRITE_WITH_IMM consumes a RECV at the responder, which reports the imm.
    // SAFETY: SGEs of Bufs, which uphold the post contract (see Buf).
    unsafe {
        p.b.post_recv(&[RecvWr {
            wr_id: 50,
            sg_list: SgList::new(),
        }])
    }
    .expect("post_recv");
    // SAFETY: SGEs of Bufs, which uphold the post contract (see Buf).
    unsafe {
        p.a.post_send(&[send(
            2,
            local.sge(0, 16),
            SendOp::WriteWithImm {
                remote_addr: raddr,
                rkey,
                imm: 77,
            },
        )])
    }
    .expect("WRITE_WITH_IMM");
    assert_eq!(wait(&p.cq_a, 1)[0].status, WcStatus::Success);
    let rc = wait(&p.cq_b, 1);
    assert_eq!(rc[0].wr_id, 50);
    assert_eq!(rc[0].opcode, WcOpcode::RecvRdmaWithImm);
    assert_eq!(rc[0].imm_data, Some(77));
    assert_eq!(rc[0].byte_len, 16);
    assert_eq!(&remote.bytes()[..16], &local.bytes()[..16]);

    // READ back a different pattern into the local buffer.
    remote.fill(|i| (255 - i % 256) as u8);
    local.fill(|_| 0);
    // SAFETY: SGEs of Bufs, which uphold the post contract (see Buf).
    unsafe {
        p.a.post_send(&[send(
            3,
            local.sge(8, 4000),
            SendOp::Read {
                remote_addr: raddr + 100,
                rkey,
            },
        )])
    }
    .expect("READ");
    let c = wait(&p.cq_a, 1);
    assert_eq!(
        (c[0].status, c[0].opcode),
        (WcStatus::Success, WcOpcode::RdmaRead)
    );
    assert_eq!(c[0].byte_len, 4000);
    assert_eq!(&local.bytes()[8..4008], &remote.bytes()[100..4100]);
    assert!(local.bytes()[..8].iter().all(|&b| b == 0));
}

#[test]
fn atomics_compare_and_swap_and_fetch_and_add() {
    let Some(ctx) = device("atomics_compare_and_swap_and_fetch_and_add") else {
        return;
    };
    let p = pair(ctx);
    let local = Buf::new(&p.pd, 64, AccessFlags::LOCAL_WRITE);
    let mut remote = Buf::new(
        &p.pd,
        64,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_ATOMIC,
    );
    remote.set_word(1, 5);
    let (raddr, rkey) = (remote.addr() + 8, remote.mr.rkey());

    // SAFETY: SGEs of Bufs, which uphold the post contract (see Buf).
    unsafe {
        p.a.post_send(&[send(
            1,
            local.sge(0, 8),
            SendOp::CompareAndSwap {
                remote_addr: raddr,
                rkey,
                compare: 5,
                swap: 9,
            },
        )])
    }
    .expect("CAS");
    let c = wait(&p.cq_a, 1);
    assert_eq!(
        (c[0].status, c[0].opcode),
        (WcStatus::Success, WcOpcode::CompSwap)
    );
    assert_eq!(local.word(0), 5, "CAS returns the original value");
    assert_eq!(remote.word(1), 9);

    // SAFETY: SGEs of Bufs, which uphold the post contract (see Buf).
    unsafe {
        p.a.post_send(&[send(
            2,
            local.sge(8, 8),
            SendOp::FetchAndAdd {
                remote_addr: raddr,
                rkey,
                add: 3,
            },
        )])
    }
    .expect("FAA");
    let c = wait(&p.cq_a, 1);
    assert_eq!(
        (c[0].status, c[0].opcode),
        (WcStatus::Success, WcOpcode::FetchAdd)
    );
    assert_eq!(local.word(1), 9);
    assert_eq!(remote.word(1), 12);

    // A failing compare leaves the value alone and still returns it.
    // SAFETY: SGEs of Bufs, which uphold the post contract (see Buf).
    unsafe {
        p.a.post_send(&[send(
            3,
            local.sge(16, 8),
            SendOp::CompareAndSwap {
                remote_addr: raddr,
                rkey,
                compare: 1,
                swap: 100,
            },
        )])
    }
    .expect("CAS miss");
    assert_eq!(wait(&p.cq_a, 1)[0].status, WcStatus::Success);
    assert_eq!(local.word(2), 12);
    assert_eq!(remote.word(1), 12);
}

#[test]
fn bad_rkey_is_remote_access_error() {
    let Some(ctx) = device("bad_rkey_is_remote_access_error") else {
        return;
    };
    let p = pair(ctx);
    let local = Buf::new(&p.pd, 64, AccessFlags::LOCAL_WRITE);
    let remote = Buf::new(
        &p.pd,
        64,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
    );
    // A posted RECV at the responder gets flushed once its QP goes to ERR.
    // SAFETY: SGEs of Bufs, which uphold the post contract (see Buf).
    unsafe {
        p.b.post_recv(&[RecvWr {
            wr_id: 9,
            sg_list: remote.sge(0, 64),
        }])
    }
    .expect("post_recv");
    // SAFETY: SGEs of Bufs, which uphold the post contract (see Buf).
    unsafe {
        p.a.post_send(&[send(
            1,
            local.sge(0, 32),
            SendOp::Write {
                remote_addr: remote.addr(),
                rkey: remote.mr.rkey() ^ 0x00ff_ff00,
            },
        )])
    }
    .expect("post WRITE");
    let c = wait(&p.cq_a, 1);
    assert_eq!(c[0].wr_id, 1);
    assert_eq!(c[0].status, WcStatus::RemAccessErr, "{c:?}");
    assert_eq!(p.a.state(), QpState::Err);
    let r = wait(&p.cq_b, 1);
    assert_eq!((r[0].wr_id, r[0].status), (9, WcStatus::WrFlushErr));
    assert!(remote.bytes().iter().all(|&b| b == 0), "memory was touched");
    // Later WRs on the errored requester are flushed.
    // SAFETY: SGEs of Bufs, which uphold the post contract (see Buf).
    unsafe { p.a.post_send(&[send(2, local.sge(0, 8), SendOp::Send)]) }.expect("post after ERR");
    let c = wait(&p.cq_a, 1);
    assert_eq!((c[0].wr_id, c[0].status), (2, WcStatus::WrFlushErr));
    let deadline = Instant::now() + Duration::from_millis(200);
    while Instant::now() < deadline {
        if let Some(ev) = p.ctx.get_async_event().expect("get_async_event") {
            println!("async event after the access error: {ev:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn modify_to_err_flushes_outstanding_receives() {
    let Some(ctx) = device("modify_to_err_flushes_outstanding_receives") else {
        return;
    };
    let p = pair(ctx);
    let buf = Buf::new(&p.pd, 256, AccessFlags::LOCAL_WRITE);
    let wrs: Vec<RecvWr> = (0..3)
        .map(|i| RecvWr {
            wr_id: 100 + i,
            sg_list: buf.sge(i as usize * 64, 64),
        })
        .collect();
    // SAFETY: SGEs of Bufs, which uphold the post contract (see Buf).
    unsafe { p.b.post_recv(&wrs) }.expect("post_recv");
    assert_eq!(p.b.state(), QpState::Rts);
    p.b.modify_to_err().expect("modify_to_err");
    assert_eq!(p.b.state(), QpState::Err);
    let mut c = wait(&p.cq_b, 3);
    c.sort_by_key(|c| c.wr_id);
    for (i, c) in c.iter().enumerate() {
        assert_eq!(c.wr_id, 100 + i as u64);
        assert_eq!(c.status, WcStatus::WrFlushErr);
        assert_eq!(c.qp_num, p.b.qp_num());
    }
    // RESET empties the queues; the QP can be brought up again from there.
    p.b.modify_to_reset().expect("modify_to_reset");
    assert_eq!(p.b.state(), QpState::Reset);
    // Transitions out of order are refused with the state named.
    let err =
        p.b.modify_to_rts(&Default::default())
            .expect_err("RESET -> RTS");
    assert!(
        matches!(
            err,
            ProviderError::InvalidQpState {
                state: QpState::Reset,
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn post_list_reports_the_failing_index() {
    let Some(ctx) = device("post_list_reports_the_failing_index") else {
        return;
    };
    let p = pair(ctx);
    let local = Buf::new(&p.pd, 4096, AccessFlags::LOCAL_WRITE);
    let remote = Buf::new(
        &p.pd,
        4096,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
    );
    let write = |id: u64, sgl: SgList| {
        send(
            id,
            sgl,
            SendOp::Write {
                remote_addr: remote.addr(),
                rkey: remote.mr.rkey(),
            },
        )
    };
    let too_many: SgList = (0..p.a.caps().max_send_sge + 1)
        .flat_map(|i| local.sge(i as usize * 8, 8))
        .collect();
    let err: PostError =
        // SAFETY: SGEs of Bufs, which uphold the post contract (see Buf).
        unsafe { p.a.post_send(&[
            write(1, local.sge(0, 8)),
            write(2, too_many),
            write(3, local.sge(0, 8)),
        ]) }
        .expect_err("too many SGEs");
    assert_eq!(err.posted, 1, "{err:?}");
    // The first WR went out and completes.
    let c = wait(&p.cq_a, 1);
    assert_eq!((c[0].wr_id, c[0].status), (1, WcStatus::Success));

    // A long list (more than one internal chunk) is posted whole.
    let many: Vec<SendWr> = (0..40)
        .map(|i| SendWr {
            wr_id: 1000 + i,
            sg_list: local.sge(0, 8),
            op: SendOp::Write {
                remote_addr: remote.addr(),
                rkey: remote.mr.rkey(),
            },
            flags: if i == 39 {
                SendFlags::SIGNALED
            } else {
                SendFlags::NONE
            },
        })
        .collect();
    // SAFETY: SGEs of Bufs, which uphold the post contract (see Buf).
    unsafe { p.a.post_send(&many) }.expect("40 WRs");
    let c = wait(&p.cq_a, 1);
    assert_eq!((c[0].wr_id, c[0].status), (1039, WcStatus::Success));
}

#[test]
fn completion_channel_becomes_readable() {
    let Some(ctx) = device("completion_channel_becomes_readable") else {
        return;
    };
    let p = pair(ctx);
    let fd = p.channel.fd();
    // SAFETY: fcntl on the channel's fd.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    assert!(flags & libc::O_NONBLOCK != 0, "channel fd is blocking");
    assert_eq!(
        p.channel.get_event().expect("get_event"),
        None,
        "nothing armed yet"
    );

    let src = Buf::new(&p.pd, 64, AccessFlags::LOCAL_WRITE);
    let dst = Buf::new(&p.pd, 64, AccessFlags::LOCAL_WRITE);
    p.cq_b.req_notify(false).expect("req_notify");
    // SAFETY: SGEs of Bufs, which uphold the post contract (see Buf).
    unsafe {
        p.b.post_recv(&[RecvWr {
            wr_id: 5,
            sg_list: dst.sge(0, 64),
        }])
    }
    .expect("post_recv");
    // SAFETY: SGEs of Bufs, which uphold the post contract (see Buf).
    unsafe { p.a.post_send(&[send(6, src.sge(0, 64), SendOp::Send)]) }.expect("post_send");

    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut pfd, 1, WAIT.as_millis() as i32) };
    assert_eq!(n, 1, "channel fd did not become readable");
    assert!(pfd.revents & libc::POLLIN != 0);
    let ev = p.channel.get_event().expect("get_event");
    assert_eq!(ev, Some(p.cq_b.handle()));
    assert_eq!(
        p.channel.get_event().expect("get_event"),
        None,
        "one event per arm"
    );
    let c = wait(&p.cq_b, 1);
    assert_eq!((c[0].wr_id, c[0].status), (5, WcStatus::Success));
    assert_eq!(wait(&p.cq_a, 1)[0].wr_id, 6);
    p.cq_b.ack_events(1);
    // Over-acknowledging is clamped (it would hang ibv_destroy_cq otherwise).
    p.cq_b.ack_events(5);

    // An event taken but never acknowledged must not hang the CQ's destruction.
    p.cq_a.req_notify(false).expect("req_notify a");
    // SAFETY: SGEs of Bufs, which uphold the post contract (see Buf).
    unsafe {
        p.b.post_recv(&[RecvWr {
            wr_id: 7,
            sg_list: dst.sge(0, 64),
        }])
    }
    .expect("post_recv");
    // SAFETY: SGEs of Bufs, which uphold the post contract (see Buf).
    unsafe { p.a.post_send(&[send(8, src.sge(0, 8), SendOp::Send)]) }.expect("post_send");
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut pfd, 1, WAIT.as_millis() as i32) };
    assert_eq!(n, 1);
    assert_eq!(
        p.channel.get_event().expect("get_event"),
        Some(p.cq_a.handle())
    );
    wait(&p.cq_a, 1);
    wait(&p.cq_b, 1);
    drop(p); // must return
}

#[test]
fn cq_overrun_is_reported_by_poll() {
    let Some(ctx) = device("cq_overrun_is_reported_by_poll") else {
        return;
    };
    let p = pair_with(ctx, 2);
    let cap = p.cq_a.capacity() as usize;
    let sends = cap + 8;
    if sends > p.a.caps().max_send_wr as usize {
        println!("SKIPPED: cq_overrun_is_reported_by_poll: CQ capacity {cap} too large to overrun");
        return;
    }
    let local = Buf::new(&p.pd, 64, AccessFlags::LOCAL_WRITE);
    let remote = Buf::new(
        &p.pd,
        64,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
    );
    let wrs: Vec<SendWr> = (0..sends as u64)
        .map(|i| {
            send(
                i,
                local.sge(0, 8),
                SendOp::Write {
                    remote_addr: remote.addr(),
                    rkey: remote.mr.rkey(),
                },
            )
        })
        .collect();
    // SAFETY: SGEs of Bufs, which uphold the post contract (see Buf).
    unsafe { p.a.post_send(&wrs) }.expect("post_send");
    let deadline = Instant::now() + WAIT;
    loop {
        match p.ctx.get_async_event().expect("get_async_event") {
            Some(ev) if ev.kind == AsyncEventKind::CqErr => {
                assert_eq!(ev.element, AsyncElement::Cq(p.cq_a.handle()));
                break;
            }
            Some(ev) => println!("other async event: {ev:?}"),
            None => {
                assert!(
                    Instant::now() < deadline,
                    "no CQ_ERR event after overrunning a {cap}-entry CQ"
                );
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }
    let mut out = [Completion::EMPTY; 4];
    match p.cq_a.poll(&mut out) {
        Err(ProviderError::CqOverflow { cq, capacity }) => {
            assert_eq!((cq, capacity as usize), (p.cq_a.handle(), cap));
        }
        other => panic!("expected CqOverflow, got {other:?}"),
    }
}

#[test]
fn full_send_queue_is_queue_full() {
    let Some(ctx) = device("full_send_queue_is_queue_full") else {
        return;
    };
    // B never posts a RECV and NAKs with the longest RNR timer; A retries for
    // ever: A's SENDs stay outstanding, so its send queue fills up.
    let p = pair_cfg(
        ctx,
        PairCfg {
            caps: QpCaps {
                max_send_wr: 8,
                ..QpCaps::default()
            },
            min_rnr_timer: 31,
            rts: RtsAttr {
                rnr_retry: 7,
                ..RtsAttr::default()
            },
            ..PairCfg::default()
        },
    );
    let depth = p.a.caps().max_send_wr as usize;
    assert!(depth >= 8);
    let local = Buf::new(&p.pd, 64, AccessFlags::LOCAL_WRITE);
    // Devices may round the ring up (rxe: to a power of two), so the queue
    // holds at least `depth`; post well past that.
    let wrs: Vec<SendWr> = (0..depth as u64 * 4 + 16)
        .map(|i| send(i, local.sge(0, 8), SendOp::Send))
        .collect();
    // SAFETY: SGEs of Bufs, which uphold the post contract (see Buf).
    let err = unsafe { p.a.post_send(&wrs) }.expect_err("queue should be full");
    assert!(
        err.posted >= depth && err.posted < wrs.len(),
        "posted {} of {} with depth {depth}: {err:?}",
        err.posted,
        wrs.len()
    );
    match err.error {
        ProviderError::QueueFull {
            qp_num,
            queue,
            depth: d,
        } => {
            assert_eq!((qp_num, queue, d as usize), (p.a.qp_num(), "send", depth));
        }
        other => panic!("expected QueueFull, got {other:?}"),
    }
    println!(
        "send queue of requested depth {depth} took {} WRs",
        err.posted
    );
    // Tear down: ERR flushes every posted WR.
    p.a.modify_to_err().expect("modify_to_err");
    let c = wait(&p.cq_a, err.posted);
    assert!(
        c.iter()
            .all(|c| matches!(c.status, WcStatus::WrFlushErr | WcStatus::RnrRetryExcErr)),
        "{c:?}"
    );
}

#[test]
fn no_receive_posted_exhausts_rnr_retries() {
    let Some(ctx) = device("no_receive_posted_exhausts_rnr_retries") else {
        return;
    };
    let p = pair_cfg(
        ctx,
        PairCfg {
            min_rnr_timer: 1, // 10 µs
            rts: RtsAttr {
                rnr_retry: 1,
                ..RtsAttr::default()
            },
            ..PairCfg::default()
        },
    );
    let local = Buf::new(&p.pd, 64, AccessFlags::LOCAL_WRITE);
    // SAFETY: SGEs of Bufs, which uphold the post contract (see Buf).
    unsafe { p.a.post_send(&[send(1, local.sge(0, 8), SendOp::Send)]) }.expect("post_send");
    let c = wait(&p.cq_a, 1);
    assert_eq!(
        (c[0].wr_id, c[0].status),
        (1, WcStatus::RnrRetryExcErr),
        "{c:?}"
    );
    assert_eq!(p.b.state(), QpState::Rts, "the responder is not affected");
}

#[test]
fn silent_peer_exhausts_transport_retries() {
    let Some(ctx) = device("silent_peer_exhausts_transport_retries") else {
        return;
    };
    // Short ACK timeout (4.096 µs × 2^8 ≈ 1 ms, rxe rounds up to its 4 ms tick)
    // and one retry, then the peer goes silent (RESET drops every packet).
    let p = pair_cfg(
        ctx,
        PairCfg {
            rts: RtsAttr {
                timeout: 8,
                retry_cnt: 1,
                ..RtsAttr::default()
            },
            ..PairCfg::default()
        },
    );
    p.b.modify_to_reset().expect("silence the peer");
    let local = Buf::new(&p.pd, 64, AccessFlags::LOCAL_WRITE);
    let start = Instant::now();
    // SAFETY: SGEs of Bufs, which uphold the post contract (see Buf).
    unsafe {
        p.a.post_send(&[send(
            1,
            local.sge(0, 8),
            SendOp::Write {
                remote_addr: 0x1000,
                rkey: 1,
            },
        )])
    }
    .expect("post_send");
    let c = wait(&p.cq_a, 1);
    assert_eq!(
        (c[0].wr_id, c[0].status),
        (1, WcStatus::RetryExcErr),
        "{c:?}"
    );
    println!("RETRY_EXC_ERR after {:?}", start.elapsed());
}
