//! The safe submission entries: the SGE comes from the op's own buffer, and
//! an opcode that would write a buffer lent for reading is refused.

use futures::FutureExt;

use super::{GatherVerb, ScatterVerb};
use crate::buf::{IoBuf, IoBufMut, RegisteredBuf};
use crate::op::{Completable, SubmitError};
use crate::provider::{Completion, QpCaps, SendFlags, SendOp, WcStatus};
use crate::reactor::Runtime;
use crate::testing::{settle, FakeQp};

/// A `Vec<u8>` posing as registered memory (lkey 0: the fake never touches
/// memory).
#[derive(Debug, PartialEq)]
struct TestBuf(Vec<u8>);

// SAFETY: delegates to `Vec<u8>`'s `IoBuf` (a heap buffer that does not
// move with the value).
unsafe impl IoBuf for TestBuf {
    fn stable_ptr(&self) -> *const u8 {
        self.0.stable_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.0.bytes_init()
    }
    fn bytes_total(&self) -> usize {
        self.0.bytes_total()
    }
}

// SAFETY: delegates to `Vec<u8>`'s `IoBufMut`.
unsafe impl IoBufMut for TestBuf {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.0.stable_mut_ptr()
    }
    unsafe fn set_init(&mut self, pos: usize) {
        // SAFETY: forwarded contract.
        unsafe { self.0.set_init(pos) }
    }
}

// SAFETY: the fake QP never reads the lkey nor the memory.
unsafe impl RegisteredBuf for TestBuf {
    fn lkey(&self) -> u32 {
        0
    }
}

struct VecVerb(TestBuf);

impl Completable for VecVerb {
    type Output = (Result<Completion, String>, TestBuf);
    fn complete(self, c: Completion) -> Self::Output {
        (Ok(c), self.0)
    }
    fn fail(self, e: SubmitError) -> Self::Output {
        (Err(e.to_string()), self.0)
    }
}

impl GatherVerb for VecVerb {
    type Buf = TestBuf;
    fn gather_buf(&self) -> &TestBuf {
        &self.0
    }
}

impl ScatterVerb for VecVerb {
    type Buf = TestBuf;
    fn scatter_buf(&mut self) -> &mut TestBuf {
        &mut self.0
    }
    fn scatter_len(&self) -> usize {
        8
    }
}

fn caps() -> QpCaps {
    QpCaps {
        max_send_wr: 4,
        max_recv_wr: 4,
        max_send_sge: 1,
        max_recv_sge: 1,
        ..QpCaps::default()
    }
}

#[test]
fn gather_and_scatter_entries_post_and_complete() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(9, caps(), 64);
    let write = SendOp::Write {
        remote_addr: 0x1000,
        rkey: 1,
    };
    let mut w = qp.send_gather(VecVerb(TestBuf(b"hello".to_vec())), write, SendFlags::NONE);
    let mut r = qp.send_scatter(
        VecVerb(TestBuf(vec![0; 8])),
        SendOp::FetchAndAdd {
            remote_addr: 0x2000,
            rkey: 1,
            add: 1,
        },
    );
    settle(&rt);
    assert_eq!(fake.posted_sends().len(), 2);
    fake.complete_send(WcStatus::Success, 0).unwrap();
    fake.complete_send(WcStatus::Success, 8).unwrap();
    settle(&rt);
    let (res, buf) = (&mut w).now_or_never().expect("write completed");
    assert!(res.is_ok(), "{res:?}");
    assert_eq!(buf.0, b"hello");
    let (res, _) = (&mut r).now_or_never().expect("fetch-and-add completed");
    assert_eq!(res.unwrap().byte_len, 8);
}

#[test]
fn an_opcode_that_writes_memory_lent_for_reading_is_refused() {
    let _rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(9, caps(), 64);
    let read = SendOp::Read {
        remote_addr: 0x1000,
        rkey: 1,
    };
    let (res, buf) = qp
        .send_gather(VecVerb(TestBuf(vec![7; 16])), read, SendFlags::NONE)
        .now_or_never()
        .expect("refused at once");
    assert!(res.unwrap_err().contains("writes local memory"));
    assert_eq!(buf.0, vec![7; 16], "the buffer comes back");
    let (res, _) = qp
        .send_scatter(VecVerb(TestBuf(vec![0; 8])), SendOp::Send)
        .now_or_never()
        .expect("refused at once");
    assert!(res.unwrap_err().contains("does not write local memory"));
    assert!(fake.posted_sends().is_empty(), "nothing reached the queue");
}

#[test]
fn a_scatter_longer_than_the_buffer_is_refused_with_the_buffer_error() {
    let _rt = Runtime::new().unwrap();
    let (qp, _fake) = FakeQp::queue_pair(9, caps(), 64);
    // Capacity 4 < scatter_len 8.
    let (res, _) = qp
        .recv_scatter(VecVerb(TestBuf(Vec::with_capacity(4))))
        .now_or_never()
        .expect("refused at once");
    let err = res.unwrap_err();
    assert!(err.contains("out of bounds"), "{err}");
}

#[test]
fn a_window_bind_is_refused_outside_bind_window() {
    let _rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(9, caps(), 64);
    let bind = SendOp::BindMw {
        mw: crate::provider::MwHandle(1),
        mr: crate::provider::MrHandle(2),
        addr: 0x1000,
        len: 64,
        access: crate::provider::AccessFlags::REMOTE_READ,
        rkey: 0x101,
    };
    let (res, _) = qp
        .send_without_memory(VecVerb(TestBuf(Vec::new())), bind)
        .now_or_never()
        .expect("refused at once");
    assert!(res.unwrap_err().contains("bind_window"));
    let (res, _) = qp
        .send_scatter(VecVerb(TestBuf(vec![0; 8])), bind)
        .now_or_never()
        .expect("refused at once");
    assert!(res.is_err(), "a bind is no scatter");
    assert!(fake.posted_sends().is_empty(), "nothing reached the queue");
}

#[test]
fn turning_batching_off_in_a_poll_phase_posts_the_next_gather_at_once() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(9, caps(), 64);
    let write = SendOp::Write {
        remote_addr: 0x1000,
        rkey: 1,
    };
    let gather = || qp.send_gather(VecVerb(TestBuf(b"hi".to_vec())), write, SendFlags::NONE);
    let (ops, doorbells) = rt.block_on(async {
        let mut doorbells = Vec::new();
        let a = gather();
        doorbells.push(fake.doorbells());
        qp.set_doorbell_batching(false);
        doorbells.push(fake.doorbells());
        let b = gather();
        doorbells.push(fake.doorbells());
        qp.set_doorbell_batching(true);
        let c = gather();
        doorbells.push(fake.doorbells());
        ((a, b, c), doorbells)
    });
    assert_eq!(
        doorbells,
        [0, 1, 2, 2],
        "deferred; posted when batching went off; posted at once; deferred again"
    );
    assert_eq!(fake.doorbells(), 3, "the last one at the phase's end");
    for _ in 0..3 {
        fake.complete_send(WcStatus::Success, 2).unwrap();
    }
    let (a, b, c) = ops;
    let results = rt.block_on(async { (a.await.0, b.await.0, c.await.0) });
    assert!(results.0.is_ok() && results.1.is_ok() && results.2.is_ok());
}

#[test]
fn a_gather_on_a_faulted_or_closed_qp_is_refused() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(9, caps(), 1024);
    fake.set_flush_on_err(true);
    let write = SendOp::Write {
        remote_addr: 0x1000,
        rkey: 1,
    };
    let gather = || {
        qp.send_gather(VecVerb(TestBuf(b"hi".to_vec())), write, SendFlags::NONE)
            .now_or_never()
    };
    // An unsignaled inline send fails: later submissions report it.
    qp.post_send_inline(b"ping", None)
        .now_or_never()
        .expect("posted at once")
        .unwrap();
    fake.complete_send(WcStatus::RemOpErr, 0).unwrap();
    settle(&rt);
    let (res, buf) = gather().expect("refused at once");
    assert!(res.unwrap_err().contains("inline"), "the inline failure");
    assert_eq!(buf.0, b"hi");
    // A QP closed with no fault refuses too.
    let (qp, _fake) = FakeQp::queue_pair(10, caps(), 1024);
    rt.block_on(qp.close()).unwrap();
    let (res, _) = qp
        .send_gather(VecVerb(TestBuf(b"hi".to_vec())), write, SendFlags::NONE)
        .now_or_never()
        .expect("refused at once");
    assert!(res.unwrap_err().contains("closed"), "refused as closed");
}
