//! The op table's slot reuse and waker handling.

use std::cell::Cell;
use std::future::Future;
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use super::wr_id::KEY_MASK;
use super::{Completable, SubmitError};
use crate::provider::{Completion, QpCaps, SendFlags, SendOp, WcStatus};
use crate::qp::{QueuePair, Submit};
use crate::reactor::Runtime;
use crate::testing::{settle, FakeQp};

struct Bare;

impl Completable for Bare {
    type Output = Result<Completion, String>;
    fn complete(self, c: Completion) -> Self::Output {
        Ok(c)
    }
    fn fail(self, e: SubmitError) -> Self::Output {
        Err(e.to_string())
    }
}

/// A zero-length WRITE (no SGE: it names no memory).
fn write(qp: &QueuePair) -> Submit<Bare> {
    // SAFETY: the WR has no SGE, so it lends no memory to anything (and
    // the QP is a fake, which never touches memory anyway).
    unsafe {
        qp.submit_send_one(Bare, |_, wr| {
            wr.op = SendOp::Write {
                remote_addr: 0x1000,
                rkey: 1,
            };
            wr.flags = SendFlags::NONE;
            Ok(())
        })
    }
}

fn fake_qp() -> (QueuePair, Rc<FakeQp>) {
    let caps = QpCaps {
        max_send_wr: 8,
        max_recv_wr: 8,
        ..QpCaps::default()
    };
    FakeQp::queue_pair(3, caps, 64)
}

/// A foreign (non-runtime) waker counting its wakes.
struct Counter(AtomicUsize);

impl Wake for Counter {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn counter() -> (Arc<Counter>, Waker) {
    let c = Arc::new(Counter(AtomicUsize::new(0)));
    let w = Waker::from(c.clone());
    (c, w)
}

fn poll<F: Future + Unpin>(f: &mut F, w: &Waker) -> Poll<F::Output> {
    std::pin::Pin::new(f).poll(&mut Context::from_waker(w))
}

#[test]
fn runtime_wakers_are_recognized_and_foreign_ones_are_not() {
    let rt = Runtime::new().unwrap();
    let ours = rt.block_on(std::future::poll_fn(|cx| {
        Poll::Ready(crate::wake::is_task_waker(cx.waker()))
    }));
    assert!(ours);
    let (_c, w) = counter();
    assert!(!crate::wake::is_task_waker(&w));
    assert!(!crate::wake::is_task_waker(Waker::noop()));
}

#[test]
fn a_foreign_waker_is_replaced_woken_once_and_released() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = fake_qp();
    let (c1, w1) = counter();
    let (c2, w2) = counter();
    let mut op = write(&qp);
    assert!(poll(&mut op, &w1).is_pending());
    assert!(poll(&mut op, &w1).is_pending());
    assert_eq!(Arc::strong_count(&c1), 3, "one clone kept by the slot");
    assert!(poll(&mut op, &w2).is_pending());
    assert_eq!(Arc::strong_count(&c1), 2, "replaced waker dropped");
    fake.complete_send(WcStatus::Success, 0).unwrap();
    settle(&rt);
    assert_eq!(c1.0.load(Ordering::SeqCst), 0, "old waker never woken");
    assert_eq!(c2.0.load(Ordering::SeqCst), 1, "latest waker woken once");
    assert_eq!(Arc::strong_count(&c2), 3, "woken by reference, kept");
    let Poll::Ready(r) = poll(&mut op, &w2) else {
        panic!("completed op still pending")
    };
    assert!(r.unwrap().status.is_success());
    assert_eq!(rt.ops_in_slab(), 0);
    // The next op of the same waiter reuses the slot and its waker: no
    // clone; a completion wakes it again, once.
    let mut next = write(&qp);
    assert!(poll(&mut next, &w2).is_pending());
    assert_eq!(Arc::strong_count(&c2), 3, "cached waker reused");
    fake.complete_send(WcStatus::Success, 0).unwrap();
    settle(&rt);
    assert_eq!(c2.0.load(Ordering::SeqCst), 2);
    assert!(poll(&mut next, &w2).is_ready());
    drop((op, next, qp, fake));
    drop(rt);
    assert_eq!(Arc::strong_count(&c2), 2, "released with the runtime");
    assert_eq!(Arc::strong_count(&c1), 2);
}

/// A foreign waker whose wake polls the op at once (re-entering the
/// table, which frees the slot and lets a new op take it).
#[test]
fn a_foreign_wake_may_reenter_the_table() {
    struct Reenter {
        op: std::sync::Mutex<Option<Submit<Bare>>>,
        qp: std::sync::Mutex<Option<QueuePair>>,
        next: std::sync::Mutex<Option<Submit<Bare>>>,
    }
    struct Shared(Rc<Reenter>);
    // SAFETY: the waker is only ever used on the test's thread (the
    // runtime and the fake are single-threaded), so the `Rc` inside is
    // never touched from two threads.
    unsafe impl Send for Shared {}
    // SAFETY: as above.
    unsafe impl Sync for Shared {}
    impl Wake for Shared {
        fn wake(self: Arc<Self>) {
            self.wake_by_ref();
        }
        fn wake_by_ref(self: &Arc<Self>) {
            let op = self.0.op.lock().unwrap().take();
            if let Some(mut op) = op {
                assert!(poll(&mut op, Waker::noop()).is_ready());
                let qp = self.0.qp.lock().unwrap().take().unwrap();
                let mut next = write(&qp);
                assert!(poll(&mut next, Waker::noop()).is_pending());
                *self.0.next.lock().unwrap() = Some(next);
            }
        }
    }
    let rt = Runtime::new().unwrap();
    let (qp, fake) = fake_qp();
    let r = Rc::new(Reenter {
        op: std::sync::Mutex::new(None),
        qp: std::sync::Mutex::new(Some(qp.clone())),
        next: std::sync::Mutex::new(None),
    });
    let shared = Arc::new(Shared(r.clone()));
    let w = Waker::from(shared.clone());
    let mut op = write(&qp);
    let key = op.wr_id().unwrap() & KEY_MASK;
    assert!(poll(&mut op, &w).is_pending());
    *r.op.lock().unwrap() = Some(op);
    fake.complete_send(WcStatus::Success, 0).unwrap();
    settle(&rt);
    let mut next = r.next.lock().unwrap().take().expect("woken and re-entered");
    assert_eq!(
        next.wr_id().unwrap() & KEY_MASK,
        key,
        "slot reused inside the wake"
    );
    assert_eq!(Arc::strong_count(&shared), 2, "the older waker was dropped");
    fake.complete_send(WcStatus::Success, 0).unwrap();
    settle(&rt);
    assert!(poll(&mut next, Waker::noop()).is_ready());
}

/// `Completable::complete` is user code: it runs once the table's borrow
/// is released, so it may submit (re-enter the table) right away.
#[test]
fn complete_may_submit_another_op() {
    struct Chain(QueuePair, Rc<std::cell::RefCell<Option<Submit<Bare>>>>);
    impl Completable for Chain {
        type Output = bool;
        fn complete(self, c: Completion) -> bool {
            *self.1.borrow_mut() = Some(write(&self.0));
            c.status.is_success()
        }
        fn fail(self, _: SubmitError) -> bool {
            false
        }
    }
    let rt = Runtime::new().unwrap();
    let (qp, fake) = fake_qp();
    let next = Rc::new(std::cell::RefCell::new(None));
    // SAFETY: no SGE: the WR lends no memory (and the fake touches none).
    let mut op = unsafe {
        qp.submit_send_one(Chain(qp.clone(), next.clone()), |_, wr| {
            wr.op = SendOp::Write {
                remote_addr: 0x1000,
                rkey: 1,
            };
            Ok(())
        })
    };
    assert!(poll(&mut op, Waker::noop()).is_pending());
    fake.complete_send(WcStatus::Success, 0).unwrap();
    settle(&rt);
    assert_eq!(poll(&mut op, Waker::noop()), Poll::Ready(true));
    let mut second = next.borrow_mut().take().expect("submitted from complete");
    assert!(second.wr_id().is_some(), "posted at once");
    fake.complete_send(WcStatus::Success, 0).unwrap();
    settle(&rt);
    assert!(poll(&mut second, Waker::noop()).is_ready());
    assert_eq!(rt.ops_in_slab(), 0);
}

/// Completions of ops whose task is already queued skip its waker (one
/// flag load): the task is still polled once, and sees every result.
#[test]
fn completions_for_an_already_queued_task_wake_it_once() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = fake_qp();
    let polls = Rc::new(Cell::new(0u32));
    let done = Rc::new(Cell::new(0u32));
    let (p, d) = (polls.clone(), done.clone());
    let mut ops: Vec<Submit<Bare>> = (0..3).map(|_| write(&qp)).collect();
    let task = rt.spawn(async move {
        std::future::poll_fn(|cx| {
            p.set(p.get() + 1);
            ops.retain_mut(|op| match std::pin::Pin::new(op).poll(cx) {
                Poll::Ready(out) => {
                    assert!(out.unwrap().status.is_success());
                    d.set(d.get() + 1);
                    false
                }
                Poll::Pending => true,
            });
            if ops.is_empty() {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await;
    });
    settle(&rt);
    assert_eq!(polls.get(), 1);
    for _ in 0..3 {
        fake.complete_send(WcStatus::Success, 0).unwrap();
    }
    settle(&rt);
    assert_eq!(done.get(), 3, "every completion reached the task");
    assert_eq!(polls.get(), 2, "woken once for the three completions");
    assert!(task.is_finished());
    let (_c, w) = counter();
    assert!(
        !crate::wake::wake_if_task(&w),
        "a foreign waker is left alone"
    );
}

#[test]
fn a_reused_slot_never_wakes_the_task_of_its_previous_op() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = fake_qp();
    let first = write(&qp);
    let first_key = first.wr_id().unwrap() & KEY_MASK;
    let polls = Rc::new(Cell::new(0u32));
    let gate = Rc::new(Cell::new(false));
    let (p, g) = (polls.clone(), gate.clone());
    let task = rt.spawn(async move {
        first.await.unwrap();
        // Stays alive (and countable) after its op: polled only if woken.
        std::future::poll_fn(|_| {
            p.set(p.get() + 1);
            if g.get() {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await;
    });
    settle(&rt);
    fake.complete_send(WcStatus::Success, 0).unwrap();
    settle(&rt);
    assert_eq!(polls.get(), 1, "the task ran past its op");
    assert_eq!(rt.ops_in_slab(), 0);
    // The slot still caches the task's waker; a new op in it, never
    // polled, completes without waking that task.
    let second = write(&qp);
    assert_eq!(second.wr_id().unwrap() & KEY_MASK, first_key, "slot reused");
    fake.complete_send(WcStatus::Success, 0).unwrap();
    settle(&rt);
    assert_eq!(polls.get(), 1, "the previous op's task was woken");
    // Polled by another waiter (a foreign waker), it wakes that one.
    let mut third = write(&qp);
    let (c, w) = counter();
    assert!(poll(&mut third, &w).is_pending());
    fake.complete_send(WcStatus::Success, 0).unwrap();
    settle(&rt);
    assert_eq!(c.0.load(Ordering::SeqCst), 1);
    assert_eq!(polls.get(), 1);
    assert!(poll(&mut third, &w).is_ready());
    let mut second = second;
    assert!(poll(&mut second, Waker::noop()).is_ready());
    assert!(!task.is_finished());
}

/// Refused submissions (by the checks, or by the provider's post) are
/// built as ops of their own before they have a slot: giving their data
/// back must not touch any live slot (slot 0 here).
#[test]
fn refused_submissions_leave_live_slots_alone() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = fake_qp();
    let mut live = write(&qp);
    assert_eq!(live.wr_id().unwrap() & KEY_MASK, 0);
    assert!(poll(&mut live, Waker::noop()).is_pending());
    // SAFETY: no SGE names memory (`Sge::default` has length 0 and
    // lkey 0), and the QP is a fake.
    let mut refused = unsafe {
        qp.submit_send_one(Bare, |_, wr| {
            for _ in 0..5 {
                wr.sg_list.push(crate::provider::Sge::default());
            }
            Ok(())
        })
    };
    let Poll::Ready(r) = poll(&mut refused, Waker::noop()) else {
        panic!("a refused submission is ready at once")
    };
    assert!(r.unwrap_err().contains("SGEs"));
    drop(refused);
    fake.fail_next_post(
        0,
        crate::provider::ProviderError::Unsupported {
            provider: "fake",
            what: "test",
        },
    );
    let mut failed = write(&qp);
    assert!(failed.wr_id().is_none());
    assert!(poll(&mut failed, Waker::noop()).is_ready());
    drop(failed);
    assert_eq!(rt.ops_in_slab(), 1);
    assert_eq!(qp.outstanding_sends(), 1);
    fake.complete_send(WcStatus::Success, 0).unwrap();
    settle(&rt);
    assert!(poll(&mut live, Waker::noop()).is_ready());
    assert_eq!(rt.ops_in_slab(), 0);
    assert_eq!(rt.handle().stale_completions(), 0);
}

#[test]
fn a_completion_for_a_freed_slot_is_stale() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = fake_qp();
    let mut op = write(&qp);
    let id = op.wr_id().unwrap();
    fake.complete_send(WcStatus::Success, 0).unwrap();
    settle(&rt);
    assert!(poll(&mut op, Waker::noop()).is_ready());
    assert_eq!(rt.ops_in_slab(), 0);
    // The slot is free (same generation as the late completion's).
    fake.inject(Completion {
        wr_id: id,
        status: WcStatus::Success,
        ..Completion::EMPTY
    });
    settle(&rt);
    assert_eq!(rt.handle().stale_completions(), 1);
    assert_eq!(rt.ops_in_slab(), 0);
    assert_eq!(qp.outstanding_sends(), 0);
}

#[test]
fn ops_of_many_tasks_wake_each_their_own() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = fake_qp();
    let done = Rc::new(Cell::new(0u32));
    // Rounds of four tasks, each awaiting one op: every round, the
    // slots (and the wakers they cache) are reused by new tasks.
    for round in 0..4 {
        let mut tasks = Vec::new();
        for _ in 0..4 {
            let op = write(&qp);
            let d = done.clone();
            tasks.push(rt.spawn(async move {
                op.await.unwrap();
                d.set(d.get() + 1);
            }));
        }
        settle(&rt);
        for i in 0..4 {
            fake.complete_send(WcStatus::Success, 0).unwrap();
            settle(&rt);
            assert_eq!(done.get(), round * 4 + i + 1);
        }
        assert!(tasks.iter().all(|t| t.is_finished()));
    }
    assert_eq!(rt.ops_in_slab(), 0);
}

/// A slot keeps its QP's entry pools when freed; an op of another QP
/// that reuses it gives its entries back to its own QP, and a waiter for
/// entries is still woken by a completion (the release is not quiet then).
#[test]
fn a_reused_slot_gives_entries_back_to_the_op_s_own_qp() {
    let rt = Runtime::new().unwrap();
    let (a, fake_a) = fake_qp();
    let (b, fake_b) = FakeQp::queue_pair(
        4,
        QpCaps {
            max_send_wr: 1,
            ..QpCaps::default()
        },
        64,
    );
    let w = Waker::noop();
    let mut op = write(&a);
    let key = op.wr_id().unwrap() & KEY_MASK;
    assert!(poll(&mut op, w).is_pending());
    assert_eq!(a.outstanding_sends(), 1);
    fake_a.complete_send(WcStatus::Success, 0).unwrap();
    settle(&rt);
    assert_eq!(a.outstanding_sends(), 0);
    assert!(poll(&mut op, w).is_ready());
    // B's op takes the slot A's op left (with A's pools in it).
    let mut first = write(&b);
    assert_eq!(first.wr_id().unwrap() & KEY_MASK, key, "slot reused");
    assert!(poll(&mut first, w).is_pending());
    assert_eq!((a.outstanding_sends(), b.outstanding_sends()), (0, 1));
    // B's send queue is full: the next op waits for the first's entry.
    let (c, cw) = counter();
    let mut second = write(&b);
    assert!(second.is_queued());
    assert!(poll(&mut second, &cw).is_pending());
    fake_b.complete_send(WcStatus::Success, 0).unwrap();
    settle(&rt);
    assert_eq!(c.0.load(Ordering::SeqCst), 1, "the waiter was woken");
    assert!(poll(&mut first, w).is_ready());
    assert!(poll(&mut second, &cw).is_pending(), "posted, in flight");
    assert!(!second.is_queued());
    assert_eq!((a.outstanding_sends(), b.outstanding_sends()), (0, 1));
    fake_b.complete_send(WcStatus::Success, 0).unwrap();
    settle(&rt);
    assert!(poll(&mut second, &cw).is_ready());
    assert_eq!((a.outstanding_sends(), b.outstanding_sends()), (0, 0));
}
