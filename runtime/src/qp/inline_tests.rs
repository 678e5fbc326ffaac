//! Unit tests of unsignaled inline sends ([`QueuePair::post_send_inline`])
//! on the fake QP: entries, signaling, retiring, errors, close.

use std::future::Future;
use std::rc::Rc;
use std::task::Poll;

use futures::FutureExt;

use crate::op::{wr_id, Completable, SubmitError};
use crate::provider::{Completion, QpCaps, SendFlags, SendOp, SendWr, WcStatus};
use crate::qp::{QueuePair, Submit};
use crate::reactor::Runtime;
use crate::testing::{settle, FakeQp};

fn caps(send: u32) -> QpCaps {
    QpCaps {
        max_send_wr: send,
        max_recv_wr: 8,
        ..QpCaps::default()
    }
}

/// Completes every signaled send the fake holds (and the unsignaled ones
/// before them), then lets the reactor deliver.
fn complete_all(rt: &Runtime, fake: &FakeQp) {
    while fake.complete_send(WcStatus::Success, 0).is_some() {}
    settle(rt);
}

/// Posts one inline send, which must be posted at once.
fn post_now(qp: &QueuePair, data: &[u8]) -> Result<(), SubmitError> {
    match qp.post_send_inline(data, None).now_or_never() {
        Some(r) => r,
        None => panic!("inline send had to wait"),
    }
}

struct Bare;

impl Completable for Bare {
    type Output = Result<Completion, SubmitError>;
    fn complete(self, c: Completion) -> Self::Output {
        Ok(c)
    }
    fn fail(self, e: SubmitError) -> Self::Output {
        Err(e)
    }
}

/// A signaled zero-length WRITE op (no SGE), for the fake.
fn bare_write(qp: &QueuePair) -> Submit<Bare> {
    // SAFETY: no SGE: the WR names no local memory.
    unsafe {
        qp.submit_send(Bare, |_, chain| {
            chain.push(SendWr {
                wr_id: 0,
                sg_list: Default::default(),
                op: SendOp::Write {
                    remote_addr: 0,
                    rkey: 1,
                },
                flags: SendFlags::NONE,
            });
            Ok(())
        })
    }
}

fn signaled(flags: &[(u64, SendFlags)]) -> usize {
    flags
        .iter()
        .filter(|(_, f)| f.contains(SendFlags::SIGNALED))
        .count()
}

#[test]
fn inline_sends_go_unsignaled_and_signal_every_interval() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(1, caps(64), 1024);
    assert_eq!(qp.inline_signal_interval(), 16);
    for i in 0..16u8 {
        post_now(&qp, &[i; 8]).unwrap();
    }
    let posted = fake.posted_sends();
    assert_eq!(posted.len(), 16);
    // 15 unsignaled, the 16th signaled; all INLINE, all inline wr_ids.
    for (i, (id, f)) in posted.iter().enumerate() {
        assert!(f.contains(SendFlags::INLINE));
        assert_eq!(f.contains(SendFlags::SIGNALED), i == 15, "WR {i}");
        assert!(wr_id::is_inline(*id));
    }
    // The signaled one carries every entry: 16 WRs + the group's reserve.
    assert_eq!(wr_id::decode_inline(posted[15].0).1, 17);
    assert_eq!(qp.outstanding_sends(), 17);
    complete_all(&rt, &fake);
    assert_eq!(qp.outstanding_sends(), 0);
    assert_eq!(fake.outstanding_sends(), 0);
    assert!(qp.inline_send_error().is_none());
}

#[test]
fn many_inline_sends_beyond_the_queue_depth_wait_instead_of_overrunning() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(1, caps(8), 1024);
    const N: usize = 200;
    let done = Rc::new(std::cell::Cell::new(0usize));
    let (q2, d2) = (qp.clone(), done.clone());
    let task = rt.spawn(async move {
        for i in 0..N {
            q2.post_send_inline(&(i as u32).to_le_bytes(), None)
                .await
                .map_err(|e| format!("send {i}: {e}"))?;
            d2.set(i + 1);
        }
        Ok::<(), String>(())
    });
    let mut turns = 0;
    while done.get() < N {
        turns += 1;
        assert!(turns < 10 * N, "stuck at {} sends", done.get());
        settle(&rt);
        assert!(qp.outstanding_sends() <= 8, "entries over-commit the SQ");
        // The device completes whatever is signaled.
        complete_all(&rt, &fake);
    }
    rt.block_on(task).unwrap();
    assert!(fake.max_outstanding_sends() <= 8);
    // Fewer completions than sends.
    assert!(signaled(&fake.posted_sends()) <= 1);
    // Trailing unsignaled sends are retired on demand.
    let mut idle = Box::pin(qp.sends_idle());
    assert!(idle.as_mut().now_or_never().is_none());
    let marker = fake.posted_sends().last().copied().unwrap();
    assert!(marker.1.contains(SendFlags::SIGNALED));
    assert_ne!(marker.0 & wr_id::INLINE_MARKER, 0);
    complete_all(&rt, &fake);
    assert!(idle.as_mut().now_or_never().is_some());
    assert_eq!(qp.outstanding_sends(), 0);
}

#[test]
fn a_signaled_op_retires_the_inline_sends_before_it() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(1, caps(16), 1024);
    for _ in 0..3 {
        post_now(&qp, b"hi").unwrap();
    }
    assert_eq!(qp.outstanding_sends(), 4, "3 WRs + reserve");
    // Inline sends lend no memory: shutdown need not leak for them.
    assert_eq!(qp.inner.core.outstanding_with_memory(), 0);
    let mut op = bare_write(&qp);
    assert!(!op.is_queued());
    assert_eq!(qp.outstanding_sends(), 5);
    // The op took their entries over.
    assert_eq!(qp.inner.core.outstanding_with_memory(), 5);
    // Retires the 3 unsignaled sends and the op.
    assert!(fake.complete_send(WcStatus::Success, 0).is_some());
    settle(&rt);
    let c = (&mut op).now_or_never().expect("op done").unwrap();
    assert!(c.status.is_success());
    assert_eq!(qp.outstanding_sends(), 0);
    assert_eq!(fake.outstanding_sends(), 0);
}

#[test]
fn the_last_entry_goes_to_a_signaled_send() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(1, caps(4), 1024);
    qp.set_inline_signal_interval(100);
    assert_eq!(qp.inline_signal_interval(), 100);
    // 4 slots: unsignaled (+ reserve), unsignaled, then the last free
    // entry must not go unsignaled.
    for _ in 0..3 {
        post_now(&qp, b"x").unwrap();
    }
    let flags: Vec<bool> = fake
        .posted_sends()
        .iter()
        .map(|(_, f)| f.contains(SendFlags::SIGNALED))
        .collect();
    assert_eq!(flags, [false, false, true]);
    // Three WRs and the (now absorbed) reserve: the SQ is full, never over.
    assert_eq!(qp.outstanding_sends(), 4);
    complete_all(&rt, &fake);
    assert_eq!(qp.outstanding_sends(), 0);
}

#[test]
fn an_error_of_an_unsignaled_inline_send_is_reported_later() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(1, caps(16), 1024);
    fake.set_flush_on_err(true);
    for _ in 0..3 {
        post_now(&qp, b"ping").unwrap();
    }
    // The oldest (unsignaled) WR fails; the device moves the QP to ERR and
    // flushes the rest.
    let failed = fake.complete_send(WcStatus::RemOpErr, 0).unwrap();
    fake.modify_to_err().unwrap();
    settle(&rt);
    match qp.inline_send_error() {
        Some(SubmitError::InlineSendFailed { wr_id, status, .. }) => {
            assert_eq!(wr_id, failed);
            assert_eq!(status, WcStatus::RemOpErr);
        }
        other => panic!("expected the inline failure, got {other:?}"),
    }
    // Later submissions, inline or not, report it.
    assert!(matches!(
        post_now(&qp, b"again"),
        Err(SubmitError::InlineSendFailed { .. })
    ));
    let out = bare_write(&qp).now_or_never().expect("refused at once");
    assert!(matches!(out, Err(SubmitError::InlineSendFailed { .. })));
    // Closing retires the trailing sends (flushed) and resolves.
    rt.block_on(crate::reactor::timeout(
        std::time::Duration::from_secs(5),
        qp.close(),
    ))
    .expect("close hung")
    .unwrap();
    assert_eq!(qp.outstanding_sends(), 0);
}

#[test]
fn close_retires_trailing_unsignaled_sends() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(1, caps(16), 1024);
    for _ in 0..5 {
        post_now(&qp, b"tail").unwrap();
    }
    assert_eq!(qp.outstanding_sends(), 6);
    rt.block_on(crate::reactor::timeout(
        std::time::Duration::from_secs(5),
        qp.close(),
    ))
    .expect("close hung")
    .unwrap();
    assert_eq!(qp.outstanding_sends(), 0);
    // ERR, the retiring WR (posted in ERR, flushed), ERR again.
    assert_eq!(fake.err_transitions(), 2);
    assert!(matches!(
        post_now(&qp, b"late"),
        Err(SubmitError::Closed { .. })
    ));
}

#[test]
fn inline_sends_refuse_what_does_not_fit_inline() {
    let _rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(1, caps(16), 1024);
    let big = vec![0u8; qp.caps().max_inline_data as usize + 1];
    assert!(matches!(
        post_now(&qp, &big),
        Err(SubmitError::Invalid { .. })
    ));
    assert_eq!(fake.outstanding_sends(), 0);
    assert_eq!(qp.outstanding_sends(), 0);
    // Empty is fine (a zero-length SEND).
    post_now(&qp, &[]).unwrap();
}

#[test]
fn a_waiting_chain_gets_the_entries_unsignaled_sends_hold() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(1, caps(8), 1024);
    qp.set_inline_signal_interval(100);
    for _ in 0..5 {
        post_now(&qp, b"u").unwrap();
    }
    // 5 WRs + reserve = 6 of 8 entries held by unsignaled sends.
    assert_eq!(qp.outstanding_sends(), 6);
    // A chain of 4 cannot fit: it waits, and the runtime retires the
    // unsignaled sends with the reserve entry.
    let chain = chain_of(&qp, 4);
    let mut chain = Box::pin(chain);
    assert!(chain.as_mut().now_or_never().is_none());
    assert!(chain.is_queued());
    let last = fake.posted_sends().last().copied().unwrap();
    assert_ne!(last.0 & wr_id::INLINE_MARKER, 0);
    complete_all(&rt, &fake);
    // Now it is posted; complete it.
    let r = rt.block_on(async {
        let mut c = chain;
        std::future::poll_fn(|cx| {
            while fake.complete_send(WcStatus::Success, 0).is_some() {}
            match c.as_mut().poll(cx) {
                Poll::Ready(r) => Poll::Ready(r),
                Poll::Pending => {
                    cx.waker().wake_by_ref();
                    Poll::Pending
                }
            }
        })
        .await
    });
    assert!(r.unwrap().status.is_success());
    assert_eq!(qp.outstanding_sends(), 0);
}

/// A chain of `n` zero-length WRITEs (no SGE).
fn chain_of(qp: &QueuePair, n: usize) -> Submit<Bare> {
    // SAFETY: no SGE: the WRs name no local memory.
    unsafe {
        qp.submit_send(Bare, move |_, chain| {
            for _ in 0..n {
                chain.push(SendWr {
                    wr_id: 0,
                    sg_list: Default::default(),
                    op: SendOp::Write {
                        remote_addr: 0,
                        rkey: 1,
                    },
                    flags: SendFlags::NONE,
                });
            }
            Ok(())
        })
    }
}

#[test]
fn a_submission_waiting_for_cq_credits_gets_those_unsignaled_sends_hold() {
    let rt = Runtime::new().unwrap();
    // Room in the send queue, but a CQ of 8 entries.
    let (qp, fake) = FakeQp::queue_pair(1, caps(64), 8);
    qp.set_inline_signal_interval(100);
    for _ in 0..5 {
        post_now(&qp, b"u").unwrap();
    }
    // 5 WRs + reserve hold 6 of the CQ's 8 entries; a chain of 3 waits for
    // the CQ, and the runtime retires the unsignaled sends to free them.
    let mut chain = Box::pin(chain_of(&qp, 3));
    assert!(chain.as_mut().now_or_never().is_none());
    assert!(chain.is_queued());
    let last = fake.posted_sends().last().copied().unwrap();
    assert_ne!(last.0 & wr_id::INLINE_MARKER, 0, "retiring WR posted");
    complete_all(&rt, &fake);
    let r = rt.block_on(async {
        let mut c = chain;
        std::future::poll_fn(|cx| {
            while fake.complete_send(WcStatus::Success, 0).is_some() {}
            match c.as_mut().poll(cx) {
                Poll::Ready(r) => Poll::Ready(r),
                Poll::Pending => {
                    cx.waker().wake_by_ref();
                    Poll::Pending
                }
            }
        })
        .await
    });
    assert!(r.unwrap().status.is_success());
    assert_eq!(qp.outstanding_sends(), 0);
}

#[test]
fn dropping_a_waiting_inline_send_gives_its_place_back() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(1, caps(2), 1024);
    qp.set_inline_signal_interval(1);
    post_now(&qp, b"a").unwrap();
    post_now(&qp, b"b").unwrap();
    assert_eq!(qp.outstanding_sends(), 2);
    // The queue is full: the third waits, then is dropped unposted.
    let mut third = Box::pin(qp.post_send_inline(b"c", None));
    assert!(third.as_mut().now_or_never().is_none());
    drop(third);
    assert_eq!(fake.outstanding_sends(), 2);
    complete_all(&rt, &fake);
    assert_eq!(qp.outstanding_sends(), 0);
    // Nobody waits any more: the next one goes at once.
    post_now(&qp, b"d").unwrap();
}
