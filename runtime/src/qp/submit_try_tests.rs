//! Unit tests of the try forms of a submission ([`Submit::try_post`],
//! [`Submit::try_take`]) on the fake QP: a submission that waits for room
//! is posted once room is back and its turn has come, keeps its place in
//! line and the waker of its last poll when there is no room, is refused
//! as a poll would refuse it, and hands its output over once completed,
//! all without registering a waker.

use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use futures::FutureExt;

use crate::op::SubmitError;
use crate::provider::{ProviderError, WcStatus};
use crate::qp::test_ops::{caps, write_one};
use crate::reactor::Runtime;
use crate::testing::{settle, FakeQp};

/// Counts its wakes.
struct Count(AtomicUsize);

impl Wake for Count {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn counting() -> (Arc<Count>, Waker) {
    let count = Arc::new(Count(AtomicUsize::new(0)));
    let waker = Waker::from(count.clone());
    (count, waker)
}

/// A full send queue: `try_post` leaves the waiting submission in line
/// with the waker of its last poll (room coming back wakes that task:
/// a poll with a no-op waker in its place lost this wake), and posts it
/// once room is back; `try_take` hands its output over once its
/// completion arrived, and not before.
#[test]
fn a_full_queue_keeps_the_waiter_and_its_waker_until_try_post_posts_it() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(2), 64);
    let token = Rc::new(());
    let mut first = write_one(&qp, &token);
    let mut second = write_one(&qp, &token);
    assert!((&mut first).now_or_never().is_none());
    assert!((&mut second).now_or_never().is_none());
    assert_eq!(fake.outstanding_sends(), 2);

    let mut third = write_one(&qp, &token);
    assert!(third.is_queued(), "the send queue is full");
    let (count, waker) = counting();
    assert!(Pin::new(&mut third)
        .poll(&mut Context::from_waker(&waker))
        .is_pending());
    assert!(!third.try_post(), "no room: it still waits");
    assert!(third.is_queued());
    assert!(third.try_take().is_none(), "nothing to take while it waits");
    assert_eq!(fake.outstanding_sends(), 2);

    fake.complete_send(WcStatus::Success, 64).unwrap();
    settle(&rt);
    assert_eq!(
        count.0.load(Ordering::SeqCst),
        1,
        "the room that came back woke the waiter's task"
    );
    let doorbells = fake.doorbells();
    assert!(third.try_post(), "room is back: posted");
    assert!(!third.is_queued() && third.wr_id().is_some());
    assert_eq!(fake.doorbells() - doorbells, 1);
    assert_eq!(fake.outstanding_sends(), 2);
    assert!(third.try_post(), "posted: nothing more to do");

    assert!(third.try_take().is_none(), "in flight");
    fake.complete_send(WcStatus::Success, 64).unwrap();
    fake.complete_send(WcStatus::Success, 64).unwrap();
    settle(&rt);
    assert_eq!(count.0.load(Ordering::SeqCst), 1, "no waker was registered");
    assert!(matches!(third.try_take(), Some(Ok(c)) if c.status.is_success()));
    assert!(third.try_take().is_none(), "taken once");
    assert!(matches!(first.try_take(), Some(Ok(_))));
    assert!(matches!(second.try_take(), Some(Ok(_))));
    drop((first, second, third));
    assert_eq!(Rc::strong_count(&token), 1, "every op's data is back");
    assert_eq!(rt.ops_in_slab(), 0);
    assert_eq!(qp.outstanding_sends(), 0);
}

/// `try_post` keeps the queue's order: with room for one, a submission
/// that never waited does not pass one that waits before it.
#[test]
fn try_post_does_not_pass_a_submission_waiting_before_it() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(1), 64);
    let token = Rc::new(());
    let mut first = write_one(&qp, &token);
    assert!((&mut first).now_or_never().is_none());
    let mut waiting = write_one(&qp, &token);
    let (_count, waker) = counting();
    assert!(Pin::new(&mut waiting)
        .poll(&mut Context::from_waker(&waker))
        .is_pending());
    let mut later = write_one(&qp, &token);
    assert!(later.is_queued());

    fake.complete_send(WcStatus::Success, 64).unwrap();
    settle(&rt);
    assert!(!later.try_post(), "the waiting one goes first");
    assert!(waiting.try_post());
    let on_queue = || -> Vec<u64> { fake.posted_sends().iter().map(|(id, _)| *id).collect() };
    assert_eq!(on_queue(), [waiting.wr_id().unwrap()]);
    assert!(!later.try_post(), "no room left");
    fake.complete_send(WcStatus::Success, 64).unwrap();
    settle(&rt);
    assert!(later.try_post(), "its turn, and room");
    assert_eq!(on_queue(), [later.wr_id().unwrap()]);
    fake.complete_send(WcStatus::Success, 64).unwrap();
    settle(&rt);
    drop((first, waiting, later));
    assert_eq!(rt.ops_in_slab(), 0);
}

/// A post the provider refuses ends the wait as a poll's would: the
/// submission no longer waits, `try_take` hands over the error and the
/// data, and the entries are back.
#[test]
fn a_refused_post_is_taken_with_its_error_and_gives_its_entries_back() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(1), 64);
    let token = Rc::new(());
    let mut first = write_one(&qp, &token);
    assert!((&mut first).now_or_never().is_none());
    let mut refused = write_one(&qp, &token);
    assert!(refused.is_queued());
    fake.complete_send(WcStatus::Success, 64).unwrap();
    settle(&rt);
    fake.fail_next_post(
        0,
        ProviderError::InvalidArgument {
            call: "post_send",
            what: "test refusal".into(),
        },
    );
    assert!(refused.try_post(), "refused: it no longer waits");
    assert!(!refused.is_queued() && refused.wr_id().is_none());
    assert!(matches!(
        refused.try_take(),
        Some(Err(SubmitError::Post { .. }))
    ));
    assert_eq!(qp.outstanding_sends(), 0, "its entries are back");
    assert_eq!(
        Rc::strong_count(&token),
        2,
        "its data is back (first's is taken)"
    );
    assert!(matches!(first.try_take(), Some(Ok(_))));
    drop((first, refused));
    assert_eq!(Rc::strong_count(&token), 1);
    assert_eq!(rt.ops_in_slab(), 0);
}

/// A polled submission (a task's) is unaffected: `poll` still works
/// after `try_post` failed, and `Poll::Ready` after the completion.
#[test]
fn a_submission_tried_and_then_polled_completes_as_usual() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(1), 64);
    let token = Rc::new(());
    let mut first = write_one(&qp, &token);
    assert!((&mut first).now_or_never().is_none());
    let mut next = write_one(&qp, &token);
    assert!(!next.try_post());
    let (count, waker) = counting();
    let mut cx = Context::from_waker(&waker);
    assert!(Pin::new(&mut next).poll(&mut cx).is_pending());
    fake.complete_send(WcStatus::Success, 64).unwrap();
    settle(&rt);
    assert_eq!(count.0.load(Ordering::SeqCst), 1);
    assert!(Pin::new(&mut next).poll(&mut cx).is_pending(), "posted now");
    assert!(next.wr_id().is_some());
    fake.complete_send(WcStatus::Success, 64).unwrap();
    settle(&rt);
    assert!(matches!(
        Pin::new(&mut next).poll(&mut cx),
        Poll::Ready(Ok(_))
    ));
    drop((first, next));
    assert_eq!(rt.ops_in_slab(), 0);
}
