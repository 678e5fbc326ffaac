//! Completion mapping of every verb, on the runtime's fake QP (synthetic
//! completions; no device touches memory).

use std::future::Future;
use std::rc::Rc;
use std::time::Duration;

use futures::FutureExt;
use verbio_runtime::buf::{IoBuf, IoBufMut, RegisteredBuf};
use verbio_runtime::provider::{Completion, QpCaps, SendFlags, WcOpcode, WcStatus};
use verbio_runtime::testing::FakeQp;
use verbio_runtime::{timeout, Runtime};

use super::*;

/// A Vec with a made-up lkey and a drop counter (the fake never touches memory).
#[derive(Debug)]
struct TestBuf {
    v: Vec<u8>,
    token: Rc<()>,
}

impl TestBuf {
    fn new(init: &[u8], cap: usize) -> TestBuf {
        let mut v = Vec::with_capacity(cap.max(init.len()));
        v.extend_from_slice(init);
        TestBuf {
            v,
            token: Rc::new(()),
        }
    }
}

// SAFETY: delegates to Vec<u8>, whose heap memory is stable across moves.
unsafe impl IoBuf for TestBuf {
    fn stable_ptr(&self) -> *const u8 {
        self.v.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.v.len()
    }
    fn bytes_total(&self) -> usize {
        self.v.capacity()
    }
}

// SAFETY: delegates to Vec<u8>.
unsafe impl IoBufMut for TestBuf {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.v.as_mut_ptr()
    }
    unsafe fn set_init(&mut self, pos: usize) {
        // SAFETY: forwarded contract.
        unsafe { self.v.set_init(pos) }
    }
}

// SAFETY: test only: the lkey is never used by a real device (fake QP).
unsafe impl RegisteredBuf for TestBuf {
    fn lkey(&self) -> u32 {
        0x77
    }
}

const LIMIT: Duration = Duration::from_secs(5);
const REMOTE: RemoteBuf = RemoteBuf::new(0x10_0000, 4096, 0xabc);

fn caps(sq: u32, rq: u32) -> QpCaps {
    QpCaps {
        max_send_wr: sq,
        max_recv_wr: rq,
        ..QpCaps::default()
    }
}

fn run<F: Future>(rt: &Runtime, f: F) -> F::Output {
    rt.block_on(timeout(LIMIT, f))
        .expect("op did not finish in time")
}

fn inject(
    fake: &FakeQp,
    wr_id: u64,
    status: WcStatus,
    opcode: WcOpcode,
    byte_len: u32,
    imm: Option<u32>,
) {
    fake.inject(Completion {
        wr_id,
        status,
        opcode,
        byte_len,
        imm_data: imm,
        qp_num: 7,
        vendor_err: 0,
        ..Completion::EMPTY
    });
}

#[test]
fn send_resolves_to_bytes_sent_and_gives_the_buffer_back() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(4, 4), 64);
    let op = qp.send(TestBuf::new(b"hello", 64));
    assert_eq!(fake.outstanding_sends(), 1);
    assert_eq!(fake.doorbells(), 1);
    fake.complete_send(WcStatus::Success, 5).unwrap();
    let (res, buf) = run(&rt, op);
    assert_eq!(res.unwrap(), 5);
    assert_eq!(buf.v, b"hello");
    assert_eq!(rt.ops_in_slab(), 0);
}

#[test]
fn failed_completion_names_op_qp_wr_and_status() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(4, 4), 64);
    let op = qp.send_with_imm(TestBuf::new(b"x", 8), 9);
    let id = fake.complete_send(WcStatus::RnrRetryExcErr, 0).unwrap();
    let (res, buf) = run(&rt, op);
    let err = res.unwrap_err();
    match &err {
        Error::Completion {
            op,
            qp_num,
            wr_id,
            status,
            ..
        } => {
            assert_eq!(*op, "send_with_imm");
            assert_eq!(*qp_num, 7);
            assert_eq!(*wr_id, id);
            assert_eq!(*status, WcStatus::RnrRetryExcErr);
        }
        other => panic!("unexpected error {other:?}"),
    }
    let msg = err.to_string();
    assert!(msg.contains("send_with_imm") && msg.contains("IBV_WC_RNR_RETRY_EXC_ERR"));
    assert!(msg.contains(&format!("{id:#x}")), "{msg}");
    assert_eq!(err.status(), Some(WcStatus::RnrRetryExcErr));
    assert_eq!(buf.v, b"x");
}

#[test]
fn recv_reports_length_and_marks_bytes_initialized() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(4, 4), 64);
    let op = qp.recv(TestBuf::new(b"", 32));
    assert_eq!(fake.outstanding_recvs(), 1);
    fake.complete_recv(WcStatus::Success, 12).unwrap();
    let (res, buf) = run(&rt, op);
    let r = res.unwrap();
    assert_eq!(
        r,
        Received {
            len: 12,
            imm: None,
            by_write: false
        }
    );
    assert_eq!(buf.bytes_init(), 12);
}

#[test]
fn recv_reports_the_immediate_of_a_send_and_of_a_write() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(4, 4), 64);
    let op = qp.recv(TestBuf::new(b"", 32));
    let id = op.wr_id().unwrap();
    inject(
        &fake,
        id,
        WcStatus::Success,
        WcOpcode::Recv,
        3,
        Some(0xdead),
    );
    let (res, buf) = run(&rt, op);
    let r = res.unwrap();
    assert_eq!((r.len, r.imm, r.by_write), (3, Some(0xdead), false));
    assert_eq!(buf.bytes_init(), 3);

    // WRITE_WITH_IMM: the data went to granted memory, not to this buffer.
    let op = qp.recv(TestBuf::new(b"", 32));
    let id = op.wr_id().unwrap();
    inject(
        &fake,
        id,
        WcStatus::Success,
        WcOpcode::RecvRdmaWithImm,
        4096,
        Some(5),
    );
    let (res, buf) = run(&rt, op);
    let r = res.unwrap();
    assert_eq!((r.len, r.imm, r.by_write), (4096, Some(5), true));
    assert_eq!(buf.bytes_init(), 0);

    let op = qp.recv_empty();
    let id = op.wr_id().unwrap();
    inject(
        &fake,
        id,
        WcStatus::Success,
        WcOpcode::RecvRdmaWithImm,
        8,
        Some(6),
    );
    let r = run(&rt, op).unwrap();
    assert_eq!((r.len, r.imm, r.by_write), (8, Some(6), true));
}

#[test]
fn write_and_write_with_imm_resolve_to_unit() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(4, 4), 64);
    let a = qp.write(TestBuf::new(&[1; 64], 64), REMOTE);
    let b = qp.write_with_imm(
        TestBuf::new(&[2; 64], 64),
        REMOTE.slice(64..128).unwrap(),
        1,
    );
    assert_eq!(fake.outstanding_sends(), 2);
    fake.complete_send(WcStatus::Success, 0).unwrap();
    fake.complete_send(WcStatus::RemAccessErr, 0).unwrap();
    let (ra, _) = run(&rt, a);
    ra.unwrap();
    let (rb, _) = run(&rt, b);
    let e = rb.unwrap_err();
    assert_eq!(e.status(), Some(WcStatus::RemAccessErr));
    assert!(e.to_string().contains("write_with_imm"));
}

#[test]
fn remote_bounds_are_checked_before_posting() {
    let _rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(4, 4), 64);
    let small = REMOTE.slice(0..16).unwrap();
    let (res, buf) = qp
        .write(TestBuf::new(&[0; 17], 17), small)
        .now_or_never()
        .unwrap();
    assert!(matches!(
        res,
        Err(Error::RemoteOutOfBounds {
            op: "write",
            len: 17,
            remote_len: 16,
            ..
        })
    ));
    assert_eq!(buf.v.len(), 17);
    let (res, _) = qp
        .read(TestBuf::new(b"", 8), REMOTE.slice(0..16).unwrap())
        .now_or_never()
        .unwrap();
    assert!(matches!(
        res,
        Err(Error::BufferTooSmall {
            op: "read",
            need: 16,
            have: 8
        })
    ));
    assert!(REMOTE.slice(4000..4097).is_err());
    assert!(REMOTE.at(u64::MAX, 2).is_err());
    assert_eq!(REMOTE.at(8, 8).unwrap().addr(), REMOTE.addr() + 8);
    assert_eq!(fake.doorbells(), 0, "nothing may be posted");
}

#[test]
fn read_marks_the_read_bytes_initialized() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(4, 4), 64);
    let op = qp.read(TestBuf::new(b"", 128), REMOTE.at(0, 100).unwrap());
    fake.complete_send(WcStatus::Success, 100).unwrap();
    let (res, buf) = run(&rt, op);
    res.unwrap();
    assert_eq!(buf.bytes_init(), 100);
    // A failed READ marks nothing.
    let op = qp.read(TestBuf::new(b"", 128), REMOTE.at(0, 100).unwrap());
    fake.complete_send(WcStatus::RemAccessErr, 0).unwrap();
    let (res, buf) = run(&rt, op);
    assert!(res.is_err());
    assert_eq!(buf.bytes_init(), 0);
}

#[test]
fn atomics_return_the_original_value_from_the_buffer() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(4, 4), 64);
    // The fake does not write; pre-fill what the device would have written.
    let op = qp.compare_and_swap(
        TestBuf::new(&41u64.to_ne_bytes(), 8),
        REMOTE.word(8).unwrap(),
        41,
        42,
    );
    fake.complete_send(WcStatus::Success, 8).unwrap();
    let (res, _) = run(&rt, op);
    assert_eq!(res.unwrap(), 41);
    let op = qp.fetch_and_add(
        TestBuf::new(&7u64.to_ne_bytes(), 16),
        REMOTE.word(16).unwrap(),
        1,
    );
    fake.complete_send(WcStatus::Success, 8).unwrap();
    let (res, _) = run(&rt, op);
    assert_eq!(res.unwrap(), 7);
}

#[test]
fn atomics_refuse_bad_targets_and_small_buffers() {
    let _rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(4, 4), 64);
    let (r, _) = qp
        .fetch_and_add(TestBuf::new(b"", 8), REMOTE.at(4, 8).unwrap(), 1)
        .now_or_never()
        .unwrap();
    assert!(matches!(r, Err(Error::BadAtomicTarget { addr, .. }) if addr == REMOTE.addr() + 4));
    let (r, _) = qp
        .compare_and_swap(TestBuf::new(b"", 8), REMOTE.at(0, 16).unwrap(), 0, 1)
        .now_or_never()
        .unwrap();
    assert!(matches!(r, Err(Error::BadAtomicTarget { len: 16, .. })));
    let mut tiny = TestBuf::new(b"", 4);
    tiny.v.shrink_to(4);
    if tiny.bytes_total() < 8 {
        let (r, _) = qp
            .fetch_and_add(tiny, REMOTE.word(0).unwrap(), 1)
            .now_or_never()
            .unwrap();
        assert!(matches!(r, Err(Error::BufferTooSmall { need: 8, .. })));
    }
    assert_eq!(fake.doorbells(), 0);
}

#[test]
fn batch_posts_one_chain_with_only_the_last_signaled() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(8, 4), 64);
    let batch = Batch::new()
        .write(TestBuf::new(&[1; 8], 8), REMOTE.at(0, 8).unwrap())
        .write(TestBuf::new(&[2; 8], 8), REMOTE.at(8, 8).unwrap())
        .write_with_imm(TestBuf::new(&[3; 8], 8), REMOTE.at(16, 8).unwrap(), 3)
        .send(TestBuf::new(b"done", 8));
    assert_eq!(batch.len(), 4);
    let op = qp.post_batch(batch);
    assert_eq!(fake.doorbells(), 1);
    let posted = fake.posted_sends();
    assert_eq!(posted.len(), 4);
    for (i, (_, flags)) in posted.iter().enumerate() {
        assert_eq!(flags.contains(SendFlags::SIGNALED), i == 3, "WR {i}");
        // 8 bytes or fewer each: within the default max_inline_data.
        assert!(flags.contains(SendFlags::INLINE), "WR {i}");
    }
    fake.complete_send(WcStatus::Success, 0).unwrap();
    let (res, bufs) = run(&rt, op);
    res.unwrap();
    assert_eq!(bufs.len(), 4);
    assert_eq!(bufs[3].v, b"done");
}

#[test]
fn batch_error_names_the_failing_wr() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(8, 4), 64);
    let op = Batch::new()
        .write(TestBuf::new(&[1; 8], 8), REMOTE.at(0, 8).unwrap())
        .write(TestBuf::new(&[2; 8], 8), REMOTE.at(8, 8).unwrap())
        .send(TestBuf::new(b"done", 8))
        .post(&qp);
    let ids: Vec<u64> = fake.posted_sends().iter().map(|(id, _)| *id).collect();
    // WR 1 fails; the QP goes to ERR and the rest flushes.
    inject(
        &fake,
        ids[1],
        WcStatus::RemAccessErr,
        WcOpcode::RdmaWrite,
        0,
        None,
    );
    let (res, bufs) = run(&rt, async {
        let close = qp.close();
        let (r, _) = futures::join!(op, close);
        r
    });
    match res.unwrap_err() {
        Error::BatchCompletion {
            index, op, status, ..
        } => {
            assert_eq!((index, op, status), (1, "write", WcStatus::RemAccessErr));
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(bufs.len(), 3);
}

#[test]
fn batch_build_errors_post_nothing_and_return_every_buffer() {
    let _rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(8, 4), 64);
    let (res, bufs) = Batch::new()
        .write(TestBuf::new(&[1; 8], 8), REMOTE.at(0, 4).unwrap())
        .send(TestBuf::new(b"x", 8))
        .post(&qp)
        .now_or_never()
        .unwrap();
    assert!(matches!(res, Err(Error::RemoteOutOfBounds { .. })));
    assert_eq!(bufs.len(), 2);
    let (res, bufs) = Batch::<TestBuf>::new().post(&qp).now_or_never().unwrap();
    assert!(matches!(res, Err(Error::InvalidBatch { .. })));
    assert!(bufs.is_empty());
    assert_eq!(fake.doorbells(), 0);
}

#[test]
fn closed_qp_fails_with_a_flush_error_and_returns_the_buffer() {
    let rt = Runtime::new().unwrap();
    let (qp, _fake) = FakeQp::queue_pair(7, caps(4, 4), 64);
    let inflight = qp.send(TestBuf::new(b"a", 8));
    run(&rt, qp.close()).unwrap();
    let (res, buf) = run(&rt, inflight);
    let e = res.unwrap_err();
    assert_eq!(e.status(), Some(WcStatus::WrFlushErr));
    assert!(e.is_flush());
    assert_eq!(buf.v, b"a");
    let (res, _) = run(&rt, qp.send(TestBuf::new(b"b", 8)));
    let e = res.unwrap_err();
    assert!(e.is_flush(), "{e}");
    assert!(matches!(e, Error::Submit { op: "send", .. }));
}

#[test]
fn dropped_op_keeps_its_buffer_until_the_flush() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(4, 4), 64);
    let buf = TestBuf::new(b"", 64);
    let token = buf.token.clone();
    let op = qp.recv(buf);
    assert_eq!(Rc::strong_count(&token), 2);
    drop(op);
    assert_eq!(
        Rc::strong_count(&token),
        2,
        "freed while the device owns it"
    );
    assert_eq!(fake.outstanding_recvs(), 1);
    run(&rt, qp.close()).unwrap();
    assert_eq!(Rc::strong_count(&token), 1, "not freed after the flush");
    assert_eq!(rt.ops_in_slab(), 0);
}

#[test]
fn submissions_wait_for_send_queue_credits() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(4, 4), 64);
    let ops: Vec<_> = (0..20)
        .map(|i| qp.write(TestBuf::new(&[i as u8; 8], 8), REMOTE.at(0, 8).unwrap()))
        .collect();
    assert_eq!(fake.outstanding_sends(), 4);
    let results = run(&rt, async {
        let all = futures::future::join_all(ops);
        futures::pin_mut!(all);
        loop {
            // Complete whatever is posted, one at a time, until all resolve.
            fake.complete_send(WcStatus::Success, 8);
            if let std::task::Poll::Ready(r) = futures::poll!(all.as_mut()) {
                break r;
            }
            verbio_runtime::sleep(Duration::from_micros(10)).await;
        }
    });
    assert_eq!(results.len(), 20);
    for (i, (r, b)) in results.into_iter().enumerate() {
        r.unwrap();
        assert_eq!(b.v[0], i as u8);
    }
    assert!(fake.max_outstanding_sends() <= 4);
}

#[test]
fn small_gathered_payloads_go_inline_up_to_max_inline_data() {
    let rt = Runtime::new().unwrap();
    let caps = QpCaps {
        max_inline_data: 16,
        ..caps(16, 4)
    };
    let (qp, fake) = FakeQp::queue_pair(7, caps, 64);
    let ops = vec![
        qp.send(TestBuf::new(&[1; 16], 16)),
        qp.send(TestBuf::new(&[1; 17], 17)),
        qp.send(TestBuf::new(b"", 8)),
    ];
    let imm = qp.send_with_imm(TestBuf::new(&[2; 8], 8), 9);
    let w = qp.write(TestBuf::new(&[3; 16], 16), REMOTE);
    let w_big = qp.write(TestBuf::new(&[3; 32], 32), REMOTE);
    let wi = qp.write_with_imm(TestBuf::new(&[4; 1], 1), REMOTE, 1);
    let r = qp.read(TestBuf::new(b"", 8), REMOTE.at(0, 8).unwrap());
    let inline: Vec<bool> = fake
        .posted_sends()
        .iter()
        .map(|(_, f)| f.contains(SendFlags::INLINE))
        .collect();
    // send 16, send 17, empty send, send_with_imm 8, write 16, write 32,
    // write_with_imm 1, read 8 (a READ scatters: never inline).
    assert_eq!(inline, [true, false, false, true, true, false, true, false]);
    for _ in 0..8 {
        fake.complete_send(WcStatus::Success, 0).unwrap();
    }
    for op in ops {
        run(&rt, op).0.unwrap();
    }
    run(&rt, imm).0.unwrap();
    run(&rt, w).0.unwrap();
    run(&rt, w_big).0.unwrap();
    run(&rt, wi).0.unwrap();
    run(&rt, r).0.unwrap();
}

#[test]
fn nothing_goes_inline_without_inline_room() {
    let rt = Runtime::new().unwrap();
    let caps = QpCaps {
        max_inline_data: 0,
        ..caps(8, 4)
    };
    let (qp, fake) = FakeQp::queue_pair(7, caps, 64);
    let s = qp.send(TestBuf::new(b"x", 8));
    let batch = Batch::new()
        .write(TestBuf::new(&[1; 8], 8), REMOTE.at(0, 8).unwrap())
        .send(TestBuf::new(b"done", 8));
    let b = qp.post_batch(batch);
    assert!(fake
        .posted_sends()
        .iter()
        .all(|(_, f)| !f.contains(SendFlags::INLINE)));
    fake.complete_send(WcStatus::Success, 1).unwrap();
    fake.complete_send(WcStatus::Success, 0).unwrap();
    run(&rt, s).0.unwrap();
    run(&rt, b).0.unwrap();
}
