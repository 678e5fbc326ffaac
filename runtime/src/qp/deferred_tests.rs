//! Unit tests of doorbell batching (`deferred.rs`) on the fake QP: single
//! send ops submitted during a poll phase share one post list, send-queue
//! order holds against other posts, a refused list fails exactly the
//! refused ops and gives their entries back, and an op dropped before its
//! doorbell keeps its data until the device is done.

use std::cell::RefCell;
use std::rc::Rc;

use futures::FutureExt;

use crate::op::{wr_id, SubmitError};
use crate::provider::{Completion, ProviderError, SendFlags, WcStatus};
use crate::qp::test_ops::{caps, write_one};
use crate::qp::QueuePair;
use crate::reactor::Runtime;
use crate::testing::{settle, FakeQp};

fn refusal() -> ProviderError {
    ProviderError::InvalidArgument {
        call: "post_send",
        what: "test refusal".into(),
    }
}

type Results = Rc<RefCell<Vec<Result<Completion, SubmitError>>>>;

/// Spawns `n` tasks, each awaiting one `write_one` and recording its result.
fn spawn_writers(rt: &Runtime, qp: &QueuePair, token: &Rc<()>, n: usize) -> Results {
    let results: Results = Rc::new(RefCell::new(Vec::new()));
    for _ in 0..n {
        let (qp, token, results) = (qp.clone(), token.clone(), results.clone());
        rt.spawn(async move {
            let r = write_one(&qp, &token).await;
            results.borrow_mut().push(r);
        });
    }
    results
}

#[test]
fn ops_of_tasks_polled_in_one_run_share_one_doorbell() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(16), 64);
    let token = Rc::new(());
    let results = spawn_writers(&rt, &qp, &token, 8);
    settle(&rt);
    assert_eq!(fake.outstanding_sends(), 8);
    assert_eq!(fake.doorbells(), 1, "eight single-WR ops, one post list");
    let posted = fake.posted_sends();
    assert!(posted.iter().all(|(_, f)| f.contains(SendFlags::SIGNALED)));
    let mut ids: Vec<u64> = posted.iter().map(|(id, _)| *id).collect();
    ids.dedup();
    assert_eq!(ids.len(), 8, "each op its own wr_id");
    for _ in 0..8 {
        fake.complete_send(WcStatus::Success, 64).unwrap();
    }
    settle(&rt);
    let r = results.borrow();
    assert_eq!(r.len(), 8);
    assert!(r
        .iter()
        .all(|r| r.as_ref().is_ok_and(|c| c.status.is_success())));
    assert_eq!(qp.outstanding_sends(), 0);
    assert_eq!(rt.task_count(), 0);
}

#[test]
fn outside_a_poll_phase_a_single_op_is_posted_at_once() {
    let _rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(16), 64);
    let token = Rc::new(());
    let mut op = write_one(&qp, &token);
    assert!((&mut op).now_or_never().is_none());
    assert_eq!(fake.outstanding_sends(), 1);
    assert_eq!(fake.doorbells(), 1);
}

#[test]
fn deferred_wrs_are_posted_before_a_later_post_to_the_same_send_queue() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(16), 64);
    let token = Rc::new(());
    let (q, t, f) = (qp.clone(), token.clone(), fake.clone());
    rt.block_on(async move {
        let op = write_one(&q, &t);
        // Deferred (this is a poll phase): not on the queue yet.
        assert_eq!(f.outstanding_sends(), 0);
        assert_eq!(q.outstanding_sends(), 1, "but its entries are taken");
        // An inline send posts the deferred WR first.
        q.post_send_inline(b"after", None).await.unwrap();
        assert_eq!(f.outstanding_sends(), 2);
        drop(op);
    });
    let posted = fake.posted_sends();
    assert_eq!(posted.len(), 2);
    assert!(!wr_id::is_inline(posted[0].0), "the deferred op first");
    assert!(wr_id::is_inline(posted[1].0), "then the inline send");
    assert_eq!(fake.doorbells(), 2);
}

#[test]
fn a_refused_post_list_fails_the_refused_ops_and_gives_their_entries_back() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(16), 64);
    let token = Rc::new(());
    fake.fail_next_post(1, refusal());
    let results = spawn_writers(&rt, &qp, &token, 3);
    settle(&rt);
    assert_eq!(fake.outstanding_sends(), 1, "the first WR was posted");
    assert_eq!(
        qp.outstanding_sends(),
        1,
        "the refused ops' entries are back"
    );
    {
        let r = results.borrow();
        assert_eq!(r.len(), 2, "the two refused ops resolved");
        assert!(
            matches!(&r[0], Err(SubmitError::Post { source, .. }) if source.posted == 1),
            "{:?}",
            r[0]
        );
        assert!(
            matches!(&r[1], Err(SubmitError::PostBatchAborted { .. })),
            "{:?}",
            r[1]
        );
    }
    // The test's, and the pending task's (in its future and in its op).
    assert_eq!(Rc::strong_count(&token), 3, "the refused ops' data is back");
    fake.complete_send(WcStatus::Success, 64).unwrap();
    settle(&rt);
    assert_eq!(results.borrow().len(), 3);
    assert!(results.borrow()[2].is_ok());
    assert_eq!(Rc::strong_count(&token), 1);
    assert_eq!(rt.ops_in_slab(), 0);
}

#[test]
fn an_op_dropped_before_its_doorbell_keeps_its_data_until_the_completion() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(16), 64);
    let token = Rc::new(());
    let (q, t) = (qp.clone(), token.clone());
    rt.block_on(async move {
        drop(write_one(&q, &t));
    });
    assert_eq!(fake.outstanding_sends(), 1, "posted after all");
    assert_eq!(Rc::strong_count(&token), 2, "parked, not freed");
    fake.complete_send(WcStatus::Success, 64).unwrap();
    settle(&rt);
    assert_eq!(Rc::strong_count(&token), 1, "freed after the completion");
    assert_eq!(rt.ops_in_slab(), 0);

    // Dropped, and its post refused: freed at the refusal, entries back.
    fake.fail_next_post(0, refusal());
    let (q, t) = (qp.clone(), token.clone());
    rt.block_on(async move {
        drop(write_one(&q, &t));
    });
    assert_eq!(fake.outstanding_sends(), 0);
    assert_eq!(Rc::strong_count(&token), 1);
    assert_eq!(qp.outstanding_sends(), 0);
    assert_eq!(rt.ops_in_slab(), 0);
}

#[test]
fn closing_a_qp_posts_its_deferred_wrs_and_flushes_them() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(16), 64);
    let token = Rc::new(());
    let (q, t, f) = (qp.clone(), token.clone(), fake.clone());
    let r = rt.block_on(async move {
        let op = write_one(&q, &t);
        assert_eq!(f.doorbells(), 0, "deferred");
        let closing = q.close();
        // Posted before the ERR transition (rxe flushes WRs posted in ERR
        // only at a later transition: posted after it, it would hang).
        assert_eq!(f.doorbells(), 1, "posted by the close");
        assert_eq!(f.err_transitions(), 1);
        closing.await.unwrap();
        op.await
    });
    assert_eq!(fake.err_transitions(), 1);
    assert_eq!(r.unwrap().status, WcStatus::WrFlushErr);
    assert_eq!(Rc::strong_count(&token), 1);
    assert_eq!(qp.outstanding_sends(), 0);
}

#[test]
fn with_batching_off_each_op_rings_its_own_doorbell() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(16), 64);
    assert!(qp.doorbell_batching(), "on by default on the fake");
    qp.set_doorbell_batching(false);
    let token = Rc::new(());
    let _results = spawn_writers(&rt, &qp, &token, 4);
    settle(&rt);
    assert_eq!(fake.outstanding_sends(), 4);
    assert_eq!(fake.doorbells(), 4);
}

#[test]
fn a_long_phase_rings_once_per_defer_max_wrs() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(32), 64);
    let token = Rc::new(());
    let n = 2 * super::deferred::DEFER_MAX + 3;
    let _results = spawn_writers(&rt, &qp, &token, n);
    settle(&rt);
    assert_eq!(fake.outstanding_sends(), n);
    assert_eq!(
        fake.doorbells(),
        3,
        "two full lists while the phase ran, the rest at its end"
    );
}
