//! Unit tests of [`RecvRing`] on the fake QP with synthetic completions:
//! posting, routing by ring wr_id, reposting, entries, errors, drop.

use std::rc::Rc;
use std::task::Poll;

use futures::FutureExt;

use crate::op::wr_id;
use crate::provider::{QpCaps, WcStatus};
use crate::qp::{QueuePair, RecvRing, RecvRingConfig, RecvRingError, RingMsg};
use crate::reactor::Runtime;
use crate::testing::{settle, FakeQp};

fn caps(recv: u32) -> QpCaps {
    QpCaps {
        max_send_wr: 8,
        max_recv_wr: recv,
        ..QpCaps::default()
    }
}

fn ring(qp: &QueuePair, depth: u32, batch: u32) -> RecvRing {
    RecvRing::create(qp, None, RecvRingConfig::new(depth, 64).repost_batch(batch)).unwrap()
}

/// The next item if one is ready now.
fn next_now(r: &mut RecvRing) -> Option<Option<Result<RingMsg, RecvRingError>>> {
    r.next().now_or_never()
}

#[test]
fn posts_every_buffer_up_front_with_ring_wr_ids_and_no_ops() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(3, caps(16), 64);
    rt.block_on(async {
        let r = ring(&qp, 8, 1);
        assert_eq!(fake.outstanding_recvs(), 8);
        assert_eq!(fake.doorbells(), 1, "one post list for the whole ring");
        assert_eq!(qp.outstanding_recvs(), 8);
        assert_eq!(r.posted(), 8);
        assert_eq!(rt.ops_in_slab(), 0);
        let id = fake.complete_recv(WcStatus::Success, 5).unwrap();
        assert!(wr_id::is_ring(id));
        drop(r);
    });
}

#[test]
fn messages_come_in_order_with_len_and_imm_and_are_reposted_on_drop() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(3, caps(16), 64);
    let mut r = rt.block_on(async { ring(&qp, 4, 1) });
    assert!(next_now(&mut r).is_none(), "nothing received yet");
    // Three messages: the fake completes the oldest posted receives.
    let ids: Vec<u64> = (0..3)
        .map(|i| fake.complete_recv(WcStatus::Success, 10 + i).unwrap())
        .collect();
    settle(&rt);
    assert_eq!(
        qp.outstanding_recvs(),
        1,
        "completed buffers give their entries back"
    );
    let mut held = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        let m = next_now(&mut r).unwrap().unwrap().unwrap();
        assert_eq!(m.len(), 10 + i);
        assert_eq!(m.imm(), None);
        assert_eq!(u64::from(m.slot()), id & wr_id::RING_SLOT_MASK);
        held.push(m);
    }
    assert!(next_now(&mut r).is_none());
    assert_eq!(fake.outstanding_recvs(), 1);
    let bells = fake.doorbells();
    drop(held);
    assert_eq!(fake.outstanding_recvs(), 4, "dropping the guards reposts");
    assert_eq!(qp.outstanding_recvs(), 4);
    assert_eq!(fake.doorbells(), bells + 3);
    // Immediate data comes through.
    fake.complete_recv_imm(0, 0xabcd).unwrap();
    settle(&rt);
    let m = next_now(&mut r).unwrap().unwrap().unwrap();
    assert_eq!(m.imm(), Some(0xabcd));
    assert!(m.is_empty());
    // A held message keeps its own completion while the other slots
    // complete (and are reposted) again and again.
    for i in 0..9 {
        fake.complete_recv(WcStatus::Success, 20 + i).unwrap();
        settle(&rt);
        let other = next_now(&mut r).unwrap().unwrap().unwrap();
        assert_ne!(other.slot(), m.slot());
        let got = (other.imm(), other.len(), other.by_write());
        assert_eq!(got, (None, 20 + i as usize, false));
    }
    let held = (m.imm(), m.len(), m.by_write(), m.qp_num());
    assert_eq!(held, (Some(0xabcd), 0, true, 3));
    drop(m);
    drop(r);
    rt.block_on(async { qp.close().await.unwrap() });
    assert_eq!(rt.ops_in_slab(), 0);
}

#[test]
fn try_next_takes_a_received_message_and_leaves_failures_to_poll_next() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(3, caps(16), 64);
    let mut r = rt.block_on(async { ring(&qp, 4, 1) });
    assert!(r.try_next().is_none(), "nothing received yet");
    fake.complete_recv(WcStatus::Success, 7).unwrap();
    fake.complete_recv_imm(0, 0x5a).unwrap();
    fake.complete_recv(WcStatus::LocLenErr, 0).unwrap();
    settle(&rt);
    let m = r.try_next().expect("a received message");
    assert_eq!(m.len(), 7);
    let m2 = r.try_next().expect("a WRITE's immediate");
    assert_eq!(m2.imm(), Some(0x5a));
    assert!(m2.is_empty());
    assert!(r.try_next().is_none(), "a failure is left to poll_next");
    assert!(
        matches!(next_now(&mut r), Some(Some(Err(_)))),
        "poll_next reports it"
    );
    drop((m, m2));
    drop(r);
}

#[test]
fn reposts_are_batched_into_one_post_list() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(3, caps(16), 64);
    let mut r = rt.block_on(async { ring(&qp, 8, 4) });
    for _ in 0..5 {
        fake.complete_recv(WcStatus::Success, 1).unwrap();
    }
    settle(&rt);
    let bells = fake.doorbells();
    for _ in 0..5 {
        drop(next_now(&mut r).unwrap().unwrap().unwrap());
    }
    assert_eq!(fake.doorbells(), bells + 1, "4 reposts in one doorbell");
    assert_eq!(fake.outstanding_recvs(), 3 + 4);
    // Waiting for a message posts the rest of the batch first.
    assert!(next_now(&mut r).is_none());
    assert_eq!(fake.outstanding_recvs(), 8);
    assert_eq!(fake.doorbells(), bells + 2);
    drop(r);
    rt.block_on(async { qp.close().await.unwrap() });
}

#[test]
fn creation_needs_every_entry_at_once() {
    let rt = Runtime::new().unwrap();
    let (qp, _fake) = FakeQp::queue_pair(3, caps(4), 64);
    rt.block_on(async {
        let e = RecvRing::create(&qp, None, RecvRingConfig::new(5, 64)).unwrap_err();
        assert!(matches!(e, RecvRingError::Credits { depth: 5, .. }), "{e}");
        assert_eq!(qp.outstanding_recvs(), 0, "entries given back");
        let e = RecvRing::create(&qp, None, RecvRingConfig::new(0, 64)).unwrap_err();
        assert!(matches!(e, RecvRingError::Config { .. }), "{e}");
    });
    // The CQ bounds it too.
    let (qp, _fake) = FakeQp::queue_pair(4, caps(64), 16);
    rt.block_on(async {
        let e = RecvRing::create(&qp, None, RecvRingConfig::new(32, 64)).unwrap_err();
        assert!(
            matches!(
                e,
                RecvRingError::Credits {
                    cq_available: 16,
                    ..
                }
            ),
            "{e}"
        );
        assert_eq!(qp.outstanding_recvs(), 0);
        let r = ring(&qp, 16, 1);
        // No CQ entry left: a receive op must wait.
        let e = RecvRing::create(&qp, None, RecvRingConfig::new(1, 64)).unwrap_err();
        assert!(matches!(e, RecvRingError::Credits { .. }), "{e}");
        drop(r);
        qp.close().await.unwrap();
    });
}

#[test]
fn close_flushes_report_one_error_then_end() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(9, caps(16), 64);
    let mut r = rt.block_on(async { ring(&qp, 4, 1) });
    fake.complete_recv(WcStatus::Success, 3).unwrap();
    settle(&rt);
    let held = next_now(&mut r).unwrap().unwrap().unwrap();
    rt.block_on(async {
        qp.close().await.unwrap();
    });
    match next_now(&mut r) {
        Some(Some(Err(RecvRingError::Completion {
            qp_num: 9,
            status: WcStatus::WrFlushErr,
            ..
        }))) => {}
        other => panic!("expected one flush error, got {other:?}"),
    }
    assert!(matches!(next_now(&mut r), Some(None)), "then the end");
    // The held buffer is not reposted on a closed QP.
    drop(held);
    assert_eq!(fake.outstanding_recvs(), 0);
    assert_eq!(qp.outstanding_recvs(), 0);
}

#[test]
fn error_completion_is_typed_and_stops_reposting() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(9, caps(16), 64);
    let mut r = rt.block_on(async { ring(&qp, 4, 1) });
    fake.complete_recv(WcStatus::Success, 3).unwrap();
    fake.complete_recv(WcStatus::LocLenErr, 0).unwrap();
    settle(&rt);
    let held = next_now(&mut r).unwrap().unwrap().unwrap();
    let e = next_now(&mut r).unwrap().unwrap().unwrap_err();
    assert!(
        matches!(
            e,
            RecvRingError::Completion {
                qp_num: 9,
                status: WcStatus::LocLenErr,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("QP 9"), "{e}");
    drop(held);
    assert_eq!(fake.outstanding_recvs(), 2, "not reposted after an error");
    rt.block_on(async { qp.close().await.unwrap() });
}

#[test]
fn dropped_ring_keeps_its_memory_until_the_flush() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(9, caps(16), 64);
    fake.set_flush_on_err(false);
    let mut r = rt.block_on(async { ring(&qp, 4, 1) });
    fake.complete_recv(WcStatus::Success, 3).unwrap();
    settle(&rt);
    let held = next_now(&mut r).unwrap().unwrap().unwrap();
    let core = Rc::downgrade(&r.core);
    assert_eq!(rt.handle().driver().ring_count(), 1);
    drop(r);
    assert!(core.upgrade().is_some(), "3 buffers still posted");
    assert_eq!(rt.handle().driver().ring_count(), 1);
    // Messages landing in a dropped ring are discarded, not reposted.
    fake.complete_recv(WcStatus::Success, 3).unwrap();
    settle(&rt);
    assert_eq!(fake.outstanding_recvs(), 2);
    drop(qp);
    settle(&rt);
    assert!(core.upgrade().is_some(), "not flushed yet");
    fake.set_flush_on_err(true);
    fake.modify_to_err().unwrap();
    settle(&rt);
    assert_eq!(
        rt.handle().driver().ring_count(),
        0,
        "drained: unregistered"
    );
    assert!(core.upgrade().is_some(), "the guard still holds it");
    assert_eq!(held.len(), 3);
    drop(held);
    assert!(
        core.upgrade().is_none(),
        "freed after the flush and the guard"
    );
    assert_eq!(rt.handle().driver().qp_count(), 0, "zombie QP reaped");
}

#[test]
fn runtime_shutdown_leaks_a_ring_whose_buffers_never_flush() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(9, caps(16), 64);
    fake.set_flush_on_err(false);
    let r = rt.block_on(async { ring(&qp, 2, 1) });
    let core = Rc::downgrade(&r.core);
    drop(r);
    drop(qp);
    drop(rt);
    assert!(
        core.upgrade().is_some(),
        "leaked, never freed under the device"
    );
}

#[test]
fn stream_yields_messages() {
    use futures::StreamExt;
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(3, caps(16), 64);
    let limit = std::time::Duration::from_secs(10);
    rt.block_on(crate::reactor::timeout(limit, async {
        let mut r = ring(&qp, 2, 1);
        fake.complete_recv(WcStatus::Success, 7).unwrap();
        let m = r.next().await.unwrap().unwrap();
        assert_eq!(m.len(), 7);
        drop(m);
        let mut s = std::pin::pin!(r);
        assert!(matches!(
            futures::poll!(StreamExt::next(&mut s)),
            Poll::Pending
        ));
        fake.complete_recv(WcStatus::Success, 8).unwrap();
        let m = StreamExt::next(&mut s).await.unwrap().unwrap();
        assert_eq!(m.len(), 8);
    }))
    .expect("timed out");
}

struct Bare;

impl crate::op::Completable for Bare {
    type Output = Result<crate::provider::Completion, crate::op::SubmitError>;
    fn complete(self, c: crate::provider::Completion) -> Self::Output {
        Ok(c)
    }
    fn fail(self, e: crate::op::SubmitError) -> Self::Output {
        Err(e)
    }
}

/// A signaled zero-length WRITE op (no SGE): holds one send and one CQ entry.
fn bare_write(qp: &QueuePair) -> crate::qp::Submit<Bare> {
    use crate::provider::{SendFlags, SendOp, SendWr};
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

#[test]
// The ops are submitted inside the runtime, awaited later.
#[allow(clippy::async_yields_async)]
fn a_completed_buffer_keeps_its_entries_for_its_repost() {
    let rt = Runtime::new().unwrap();
    // One CQ for sends and receives, 5 entries: the ring takes 4.
    let (qp, fake) = FakeQp::queue_pair(3, caps(16), 5);
    let mut r = rt.block_on(async { ring(&qp, 4, 1) });
    let w1 = rt.block_on(async { bare_write(&qp) });
    fake.complete_recv(WcStatus::Success, 1).unwrap();
    settle(&rt);
    let m = next_now(&mut r).unwrap().unwrap().unwrap();
    assert_eq!(qp.outstanding_recvs(), 3, "3 receives posted");
    assert_eq!(
        qp.inner.core.entries.rq.outstanding(),
        4,
        "the 4th entry is kept"
    );
    // The completed buffer's CQ entry stays the ring's: another send waits.
    let w2 = rt.block_on(async { bare_write(&qp) });
    assert!(w2.is_queued(), "no CQ entry for the send");
    // So the repost needs no entry: posted at once.
    drop(m);
    assert_eq!(fake.outstanding_recvs(), 4, "reposted at once");
    assert_eq!(qp.outstanding_recvs(), 4);
    fake.complete_send(WcStatus::Success, 0).unwrap();
    settle(&rt);
    assert!(rt.block_on(w1).is_ok());
    // Dropped while queued: posts nothing.
    drop(w2);
    drop(r);
    rt.block_on(async { qp.close().await.unwrap() });
}

#[test]
fn close_gives_back_the_entries_of_held_and_unread_messages() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(3, caps(16), 64);
    let mut r = rt.block_on(async { ring(&qp, 4, 1) });
    fake.complete_recv(WcStatus::Success, 1).unwrap();
    fake.complete_recv(WcStatus::Success, 2).unwrap();
    settle(&rt);
    // One message held by its guard, one unread.
    let m = next_now(&mut r).unwrap().unwrap().unwrap();
    assert_eq!(qp.inner.core.entries.rq.outstanding(), 4);
    rt.block_on(async {
        crate::reactor::timeout(std::time::Duration::from_secs(5), qp.close())
            .await
            .expect("close waits only for posted receives")
            .unwrap()
    });
    assert_eq!(qp.inner.core.entries.rq.outstanding(), 0);
    assert_eq!(qp.inner.core.entries.recv_cq.outstanding(), 0);
    // The guard's drop after the close reposts nothing, gives nothing twice.
    let bells = fake.doorbells();
    drop(m);
    assert_eq!(fake.doorbells(), bells);
    assert_eq!(qp.inner.core.entries.rq.outstanding(), 0);
    drop(r);
    assert_eq!(qp.inner.core.ring_kept.get(), 0);
}

#[test]
fn a_dropped_ring_gives_back_the_entries_its_guards_kept() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(3, caps(16), 64);
    let mut r = rt.block_on(async { ring(&qp, 2, 1) });
    fake.complete_recv(WcStatus::Success, 1).unwrap();
    settle(&rt);
    let m = next_now(&mut r).unwrap().unwrap().unwrap();
    assert_eq!(qp.inner.core.entries.rq.outstanding(), 2);
    drop(r);
    assert_eq!(
        qp.inner.core.entries.rq.outstanding(),
        1,
        "only the posted buffer"
    );
    assert_eq!(qp.inner.core.ring_kept.get(), 0);
    drop(m);
    assert_eq!(qp.inner.core.entries.rq.outstanding(), 1);
    assert_eq!(qp.inner.core.entries.recv_cq.outstanding(), 1);
    rt.block_on(async { qp.close().await.unwrap() });
}

#[test]
fn a_failed_repost_is_reported_by_next_and_gives_its_entries_back() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(3, caps(16), 64);
    let mut r = rt.block_on(async { ring(&qp, 2, 1) });
    fake.complete_recv(WcStatus::Success, 1).unwrap();
    settle(&rt);
    let m = next_now(&mut r).unwrap().unwrap().unwrap();
    fake.fail_next_post(
        0,
        crate::provider::ProviderError::Unsupported {
            provider: "fake",
            what: "post_recv",
        },
    );
    drop(m);
    assert_eq!(
        qp.outstanding_recvs(),
        1,
        "the failed repost's entries came back"
    );
    match next_now(&mut r) {
        Some(Some(Err(RecvRingError::Post {
            qp_num: 3,
            count: 1,
            ..
        }))) => {}
        other => panic!("expected the post error, got {other:?}"),
    }
    drop(r);
    rt.block_on(async { qp.close().await.unwrap() });
}

#[test]
fn a_guard_dropped_elsewhere_is_reposted_while_next_waits_below_the_batch() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(3, caps(16), 64);
    let mut r = rt.block_on(async { ring(&qp, 4, 4) });
    fake.complete_recv(WcStatus::Success, 1).unwrap();
    settle(&rt);
    let m = next_now(&mut r).unwrap().unwrap().unwrap();
    let waiter = crate::reactor::spawn(async move {
        let got = r.next().await.map(|m| m.map(|m| m.len()).ok());
        (r, got)
    });
    settle(&rt);
    assert_eq!(fake.outstanding_recvs(), 3);
    // One buffer back, below the batch of 4: the waiting `next` posts it.
    drop(m);
    settle(&rt);
    assert_eq!(fake.outstanding_recvs(), 4, "reposted by the waiting next");
    fake.complete_recv(WcStatus::Success, 2).unwrap();
    let (r, got) = rt.block_on(waiter);
    assert_eq!(got, Some(Some(2)));
    drop(r);
    rt.block_on(async { qp.close().await.unwrap() });
}

#[test]
fn the_last_guard_dropped_after_close_ends_a_waiting_stream() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(3, caps(16), 64);
    let mut r = rt.block_on(async { ring(&qp, 1, 1) });
    fake.complete_recv(WcStatus::Success, 1).unwrap();
    settle(&rt);
    let m = next_now(&mut r).unwrap().unwrap().unwrap();
    let waiter = crate::reactor::spawn(async move { r.next().await.is_none() });
    settle(&rt);
    rt.block_on(async { qp.close().await.unwrap() });
    settle(&rt);
    drop(m);
    let limit = std::time::Duration::from_secs(5);
    let ended = rt.block_on(crate::reactor::timeout(limit, waiter));
    assert_eq!(
        ended.ok(),
        Some(true),
        "the stream ends once the last buffer is back"
    );
}

#[test]
fn a_waiting_task_is_woken_in_place_and_its_waker_kept_for_the_next_wait() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(3, caps(16), 64);
    let mut r = rt.block_on(async { ring(&qp, 4, 1) });
    let core = r.core.clone();
    let task = crate::reactor::spawn(async move {
        let got = r.next().await.map(|m| m.map(|m| m.len()).ok());
        (r, got)
    });
    settle(&rt);
    assert!(core.registered_waker().is_some(), "the task waits");
    fake.complete_recv(WcStatus::Success, 7).unwrap();
    // The completion only (the task is not run yet).
    assert_eq!(rt.handle().driver().drain_cqs(), 1);
    let kept = core
        .registered_waker()
        .expect("the task's waker stays registered");
    assert!(crate::wake::is_task_waker(&kept));
    drop(kept);
    let (r, got) = rt.block_on(task);
    assert_eq!(got, Some(Some(7)));
    drop(r);
    drop(core);
    rt.block_on(async { qp.close().await.unwrap() });
}

#[test]
// The op is submitted inside the runtime, awaited later.
#[allow(clippy::async_yields_async)]
fn one_drain_takes_every_ring_completion_whatever_the_poll_batch() {
    // A poll that returns one ring completion skips the op table; with a
    // poll batch of one that poll is a full batch, so the drain polls on.
    for batch in [1, 2, 32] {
        let rt = Runtime::builder().cq_poll_batch(batch).build().unwrap();
        let (qp, fake) = FakeQp::queue_pair(3, caps(16), 64);
        let mut r = rt.block_on(async { ring(&qp, 4, 1) });
        for len in [5, 6, 7] {
            fake.complete_recv(WcStatus::Success, len).unwrap();
        }
        assert_eq!(rt.handle().driver().drain_cqs(), 3, "poll batch {batch}");
        for len in [5, 6, 7] {
            let m = next_now(&mut r).expect("ready").expect("open").unwrap();
            assert_eq!(m.len(), len, "poll batch {batch}");
        }
        // One message alone, then an op's completion alone: each poll
        // returns one, one reserved and one not.
        let op = rt.block_on(async { bare_write(&qp) });
        fake.complete_recv(WcStatus::Success, 8).unwrap();
        assert_eq!(rt.handle().driver().drain_cqs(), 1);
        assert_eq!(next_now(&mut r).unwrap().unwrap().unwrap().len(), 8);
        fake.complete_send(WcStatus::Success, 0).unwrap();
        assert_eq!(rt.handle().driver().drain_cqs(), 1);
        let done = op.now_or_never().expect("the op completed");
        assert!(done.unwrap().status.is_success(), "poll batch {batch}");
        assert_eq!(fake.outstanding_sends(), 0);
        drop(r);
        rt.block_on(async { qp.close().await.unwrap() });
    }
}

#[test]
fn a_repost_that_fails_wakes_the_next_waiting_on_another_task() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(3, caps(16), 64);
    let mut r = rt.block_on(async { ring(&qp, 4, 1) });
    fake.complete_recv(WcStatus::Success, 1).unwrap();
    settle(&rt);
    let m = next_now(&mut r).unwrap().unwrap().unwrap();
    // One task waits in `next`...
    let waiter = crate::reactor::spawn(async move {
        let got = r.next().await;
        (r, got)
    });
    settle(&rt);
    fake.fail_next_post(
        0,
        crate::provider::ProviderError::Unsupported {
            provider: "fake",
            what: "post_recv",
        },
    );
    // ...another drops a guard: its repost fails, and the waiting `next`
    // must hear of it (not sleep until some message comes).
    rt.block_on(crate::reactor::spawn(async move { drop(m) }));
    let (r, got) = rt
        .block_on(crate::reactor::timeout(
            std::time::Duration::from_secs(5),
            waiter,
        ))
        .expect("the waiting next was not woken");
    match got {
        Some(Err(RecvRingError::Post {
            qp_num: 3,
            count: 1,
            ..
        })) => {}
        other => panic!("expected the post error, got {other:?}"),
    }
    assert_eq!(qp.outstanding_recvs(), 3, "its entries came back");
    drop(r);
    rt.block_on(async { qp.close().await.unwrap() });
}

/// A ring's check: counts its runs and what the consumer had taken then.
#[derive(Default)]
struct CheckProbe {
    runs: std::cell::Cell<u32>,
    taken: Rc<std::cell::Cell<u32>>,
    taken_then: std::cell::Cell<u32>,
}

impl crate::reactor::PassHook for CheckProbe {
    fn pass_ended(&self) {
        self.runs.set(self.runs.get() + 1);
        self.taken_then.set(self.taken.get());
    }
}

#[test]
fn a_ring_check_runs_once_per_pass_after_the_task_its_completions_woke() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(3, caps(16), 64);
    let mut r = rt.block_on(async { ring(&qp, 4, 1) });
    let probe = Rc::new(CheckProbe::default());
    r.check_after_wakes(Some(probe.clone()));
    let taken = probe.taken.clone();
    let task = crate::reactor::spawn(async move {
        for _ in 0..2 {
            let m = r.next().await;
            assert!(matches!(m, Some(Ok(_))));
            taken.set(taken.get() + 1);
        }
        r
    });
    settle(&rt);
    assert_eq!(probe.runs.get(), 0, "nothing completed yet");
    // Two completions routed before the pass: one check, at its end,
    // after the task they woke took both.
    fake.complete_recv(WcStatus::Success, 7).unwrap();
    fake.complete_recv(WcStatus::Success, 8).unwrap();
    assert_eq!(rt.handle().driver().drain_cqs(), 2);
    let mut r = rt.block_on(task);
    settle(&rt);
    assert_eq!(probe.runs.get(), 1, "once for both");
    assert_eq!(probe.taken_then.get(), 2, "after the woken task ran");
    // A completion nobody waits for still schedules it.
    fake.complete_recv(WcStatus::Success, 9).unwrap();
    settle(&rt);
    assert_eq!(probe.runs.get(), 2);
    // A consumer that takes the message and finds the ring waiting before
    // the pass ends: nothing left to look at, the check is skipped...
    let mut r = rt.block_on(async move {
        let m = r.next().await;
        assert!(matches!(m, Some(Ok(_))));
        drop(m);
        r
    });
    let task = crate::reactor::spawn(async move {
        let m = r.next().await;
        assert!(matches!(m, Some(Ok(_))));
        drop(m);
        let waits = std::future::poll_fn(|cx| Poll::Ready(r.poll_next(cx).is_pending())).await;
        assert!(waits, "waits again");
        r
    });
    settle(&rt);
    fake.complete_recv(WcStatus::Success, 10).unwrap();
    let r = rt.block_on(task);
    settle(&rt);
    assert_eq!(probe.runs.get(), 2, "skipped");
    // ...unless asked for.
    rt.block_on(async { r.schedule_check() });
    settle(&rt);
    assert_eq!(probe.runs.get(), 3);
    // Removed: no more runs.
    r.check_after_wakes(None);
    fake.complete_recv(WcStatus::Success, 11).unwrap();
    settle(&rt);
    assert_eq!(probe.runs.get(), 3);
    drop(r);
    rt.block_on(async { qp.close().await.unwrap() });
}

/// A foreign waker (any `Wake`) counting how it is woken; a wake drops
/// the ring in `DROP_ON_WAKE`, if any.
#[derive(Default)]
struct Counting {
    by_ref: std::sync::atomic::AtomicU32,
    by_value: std::sync::atomic::AtomicU32,
}

thread_local! {
    static DROP_ON_WAKE: std::cell::RefCell<Option<RecvRing>> = const { std::cell::RefCell::new(None) };
}

impl std::task::Wake for Counting {
    fn wake(self: std::sync::Arc<Self>) {
        self.by_value
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        drop(DROP_ON_WAKE.with(|r| r.borrow_mut().take()));
    }

    fn wake_by_ref(self: &std::sync::Arc<Self>) {
        self.by_ref
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        drop(DROP_ON_WAKE.with(|r| r.borrow_mut().take()));
    }
}

#[test]
fn a_foreign_waker_is_woken_by_reference_and_kept_unless_the_ring_is_dropped() {
    use std::sync::atomic::Ordering::Relaxed;
    use std::sync::Arc;
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(3, caps(16), 64);
    let r = rt.block_on(async { ring(&qp, 4, 1) });
    let core = r.core.clone();
    let counting = Arc::new(Counting::default());
    let waker = std::task::Waker::from(counting.clone());
    let mut cx = std::task::Context::from_waker(&waker);
    assert!(r.poll_next(&mut cx).is_pending());
    fake.complete_recv(WcStatus::Success, 7).unwrap();
    assert_eq!(rt.handle().driver().drain_cqs(), 1);
    assert_eq!(counting.by_ref.load(Relaxed), 1, "woken by reference");
    assert_eq!(counting.by_value.load(Relaxed), 0, "with no clone");
    assert!(
        core.registered_waker().is_some_and(|w| w.will_wake(&waker)),
        "and kept registered"
    );
    // Taken, then waited for again: this wake drops the ring.
    assert!(r.poll_next(&mut cx).is_ready());
    assert!(r.poll_next(&mut cx).is_pending());
    DROP_ON_WAKE.with(|d| *d.borrow_mut() = Some(r));
    fake.complete_recv(WcStatus::Success, 8).unwrap();
    assert_eq!(rt.handle().driver().drain_cqs(), 1);
    assert_eq!(counting.by_ref.load(Relaxed), 2);
    assert!(
        core.registered_waker().is_none(),
        "the dropped ring keeps no waker"
    );
    drop(waker);
    assert_eq!(Arc::strong_count(&counting), 1, "nothing holds the waker");
    drop(core);
    rt.block_on(async { qp.close().await.unwrap() });
}
