//! Unit tests of single-WR submissions ([`QueuePair::submit_send_one`]) on
//! the fake QP: wr_id and signaling, validation, waiting for entries (FIFO
//! with chains), and a dropped op parking its data until the flush.

use std::rc::Rc;

use futures::FutureExt;

use crate::op::{wr_id, Completable, SubmitError};
use crate::provider::{Completion, QpCaps, SendFlags, SendOp, SendWr, Sge, WcStatus};
use crate::qp::test_ops::Probe;
use crate::qp::{QueuePair, Submit};
use crate::reactor::Runtime;
use crate::testing::{settle, FakeQp};

fn caps(send: u32, sge: u32) -> QpCaps {
    QpCaps {
        max_send_wr: send,
        max_recv_wr: 8,
        max_send_sge: sge,
        ..QpCaps::default()
    }
}

/// A WRITE of `sges` fake SGEs (the fake QP never touches memory).
fn write_one(qp: &QueuePair, token: &Rc<()>, sges: usize, flags: SendFlags) -> Submit<Probe> {
    // SAFETY: the fake QP never reads or writes the memory SGEs name.
    unsafe {
        qp.submit_send_one(Probe(token.clone()), move |_, wr| {
            for i in 0..sges {
                wr.sg_list.push(Sge {
                    addr: 0x1000 + 64 * i as u64,
                    length: 64,
                    lkey: 1,
                });
            }
            wr.op = SendOp::Write {
                remote_addr: 0x2000,
                rkey: 2,
            };
            wr.flags = flags;
            Ok(())
        })
    }
}

/// A one-WR chain through [`QueuePair::submit_send`].
fn write_chain(qp: &QueuePair, token: &Rc<()>) -> Submit<Probe> {
    // SAFETY: no SGE; the fake QP never touches memory.
    unsafe {
        qp.submit_send(Probe(token.clone()), |_, chain| {
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
fn one_wr_is_posted_signaled_with_the_runtimes_wr_id() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(3, caps(8, 1), 64);
    let token = Rc::new(());
    let mut op = write_one(&qp, &token, 1, SendFlags::FENCE);
    let id = op.wr_id().expect("posted at once");
    assert_eq!(id & wr_id::RESERVED, 0);
    let posted = fake.posted_sends();
    assert_eq!(posted.len(), 1);
    assert_eq!(posted[0].0, id);
    assert!(posted[0].1.contains(SendFlags::SIGNALED));
    assert!(posted[0].1.contains(SendFlags::FENCE));
    assert_eq!(fake.doorbells(), 1);
    assert!((&mut op).now_or_never().is_none());
    assert_eq!(fake.complete_send(WcStatus::Success, 64), Some(id));
    let c = rt.block_on(op).expect("completion");
    assert_eq!((c.wr_id, c.status), (id, WcStatus::Success));
    assert_eq!(qp.outstanding_sends(), 0);
    assert_eq!(rt.ops_in_slab(), 0);
    assert_eq!(Rc::strong_count(&token), 1, "data not handed back");
}

#[test]
fn one_wr_with_too_many_sges_is_refused_unless_inline() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(3, caps(8, 1), 64);
    let token = Rc::new(());
    let refused = rt.block_on(write_one(&qp, &token, 2, SendFlags::NONE));
    assert!(
        matches!(
            refused,
            Err(SubmitError::TooManySges {
                sges: 2,
                max: 1,
                ..
            })
        ),
        "{refused:?}"
    );
    assert_eq!(fake.outstanding_sends(), 0);
    assert_eq!(qp.outstanding_sends(), 0);
    // INLINE WRs are copied at post time: their SGE count is free.
    let op = write_one(&qp, &token, 2, SendFlags::INLINE);
    assert!(op.wr_id().is_some());
    fake.complete_send(WcStatus::Success, 128);
    rt.block_on(op).expect("inline completion");
    assert_eq!(Rc::strong_count(&token), 1);
}

/// A single WR with more SGEs than one goes as a chain of one (the single-WR
/// form holds at most one SGE): posted at once, signaled, with one doorbell,
/// and completed like any other.
#[test]
fn one_wr_with_several_sges_goes_as_a_chain_of_one() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(3, caps(8, 3), 64);
    let token = Rc::new(());
    let op = write_one(&qp, &token, 3, SendFlags::SOLICITED);
    let id = op.wr_id().expect("posted at once");
    let posted = fake.posted_sends();
    assert_eq!(posted.len(), 1);
    assert_eq!(posted[0].0, id);
    assert!(posted[0].1.contains(SendFlags::SIGNALED));
    assert!(posted[0].1.contains(SendFlags::SOLICITED));
    assert_eq!(fake.doorbells(), 1);
    assert_eq!(fake.complete_send(WcStatus::Success, 192), Some(id));
    let c = rt.block_on(op).expect("completion");
    assert_eq!(c.wr_id, id);
    assert_eq!(qp.outstanding_sends(), 0);
    assert_eq!(rt.ops_in_slab(), 0);
    assert_eq!(Rc::strong_count(&token), 1, "data not handed back");
}

#[test]
fn one_wr_waits_for_send_queue_entries_in_fifo_order_with_chains() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(3, caps(2, 1), 64);
    let token = Rc::new(());
    let mut ops = vec![
        write_one(&qp, &token, 1, SendFlags::NONE),
        write_chain(&qp, &token),
        write_one(&qp, &token, 1, SendFlags::NONE),
        write_chain(&qp, &token),
        write_one(&qp, &token, 1, SendFlags::NONE),
    ];
    assert_eq!(fake.outstanding_sends(), 2);
    assert!(ops[2].is_queued() && ops[3].is_queued() && ops[4].is_queued());
    let results = rt.block_on(async {
        let mut out: Vec<Option<Result<Completion, SubmitError>>> =
            ops.iter().map(|_| None).collect();
        let mut order = Vec::new();
        for _ in 0..1000 {
            for (i, op) in ops.iter_mut().enumerate() {
                if out[i].is_none() {
                    if let Some(r) = op.now_or_never() {
                        order.push((i, r.as_ref().map(|c| c.wr_id).unwrap_or(0)));
                        out[i] = Some(r);
                    }
                }
            }
            if out.iter().all(Option::is_some) {
                break;
            }
            assert!(fake.max_outstanding_sends() <= 2, "send queue overrun");
            fake.complete_send(WcStatus::Success, 64);
            crate::reactor::sleep(std::time::Duration::from_micros(10)).await;
        }
        (out, order)
    });
    let (out, order) = results;
    assert!(out.iter().all(|r| matches!(r, Some(Ok(_)))), "{out:?}");
    // Posted (and so completed) in submission order.
    let completed: Vec<usize> = order.iter().map(|(i, _)| *i).collect();
    assert_eq!(completed, vec![0, 1, 2, 3, 4]);
    assert!(fake.max_outstanding_sends() <= 2);
    drop(ops);
    assert_eq!(Rc::strong_count(&token), 1);
    assert_eq!(rt.ops_in_slab(), 0);
}

#[test]
fn dropped_one_wr_op_parks_its_data_until_the_flush() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(3, caps(8, 1), 64);
    let token = Rc::new(());
    let op = write_one(&qp, &token, 1, SendFlags::NONE);
    assert!(op.wr_id().is_some());
    drop(op);
    assert_eq!(Rc::strong_count(&token), 2, "data freed while in flight");
    rt.block_on(qp.close()).expect("close");
    settle(&rt);
    assert_eq!(fake.outstanding_sends(), 0);
    assert_eq!(
        Rc::strong_count(&token),
        1,
        "parked data not freed after the flush"
    );
    assert_eq!(rt.ops_in_slab(), 0);
}

/// A submission waiting for entries keeps its WRs and tickets in a boxed
/// `Waiting`: the `Submit` is as small as an in-flight op plus its tag
/// (every op's future is moved a few times on its way to the caller).
#[test]
fn a_submit_is_an_op_and_a_tag() {
    struct Big(#[allow(dead_code)] [u64; 6]);
    impl Completable for Big {
        type Output = ();
        fn complete(self, _: Completion) {}
        fn fail(self, _: SubmitError) {}
    }
    let op = std::mem::size_of::<crate::op::Op<Big>>();
    assert_eq!(std::mem::size_of::<Submit<Big>>(), op + 8);
    assert_eq!(
        std::mem::size_of::<Submit<Probe>>(),
        std::mem::size_of::<crate::op::Op<Probe>>() + 8
    );
}

/// `QueueEntries::release`'s fast path tests one flag: it must still wake the
/// first waiter of the FIFO and the idle watchers, and clamp an excess.
#[test]
fn entry_releases_wake_waiters_and_idle_watchers() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::{Context, Wake, Waker};

    use crate::op::QueueEntries;

    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let (fifo, idle) = (
        Arc::new(Count(AtomicUsize::new(0))),
        Arc::new(Count(AtomicUsize::new(0))),
    );
    let (wf, wi) = (Waker::from(fifo.clone()), Waker::from(idle.clone()));
    let c = QueueEntries::new(2);
    assert!(c.try_acquire(2));
    // A waiter in the FIFO: a release wakes it, and it then gets its entry.
    let mut ticket = None;
    assert!(c
        .poll_acquire(1, &mut ticket, &mut Context::from_waker(&wf))
        .is_pending());
    assert!(!c.try_acquire(1), "nobody jumps the queue");
    c.release(1);
    assert_eq!(fifo.0.load(Ordering::SeqCst), 1);
    assert!(c
        .poll_acquire(1, &mut ticket, &mut Context::from_waker(&wf))
        .is_ready());
    assert!(!c.has_waiters());
    // An idle watcher: woken only once every entry is back.
    assert!(c.poll_idle(&mut Context::from_waker(&wi)).is_pending());
    c.release(1);
    assert_eq!(idle.0.load(Ordering::SeqCst), 0);
    c.release(1);
    assert_eq!(idle.0.load(Ordering::SeqCst), 1);
    assert_eq!(c.available(), 2);
    // Nobody waits any more: the fast path; an excess is clamped.
    assert!(c.try_acquire(1));
    c.release(5);
    assert_eq!(c.available(), 2);
    assert_eq!(fifo.0.load(Ordering::SeqCst), 1);
    assert_eq!(idle.0.load(Ordering::SeqCst), 1);
}

/// A `Submit` is dropped by hand: a completed op's future drops nothing
/// (inline); one dropped while waiting or in flight drops its whole state
/// (the data is parked until the flush, or freed if it was never posted).
/// Each path frees the data exactly once, and every slot is given back.
#[test]
fn dropping_a_submission_frees_its_data_once() {
    let rt = Runtime::new().unwrap();
    let slots = || rt.handle().inner.driver.ops.len();
    let (qp, fake) = FakeQp::queue_pair(1, caps(1, 1), 64);
    let token = Rc::new(());
    // Completed, output taken: the inline path.
    let mut done = write_one(&qp, &token, 1, SendFlags::NONE);
    assert_eq!(slots(), 1);
    fake.complete_send(WcStatus::Success, 0).unwrap();
    settle(&rt);
    assert!((&mut done).now_or_never().expect("complete").is_ok());
    assert_eq!(slots(), 0);
    assert_eq!(Rc::strong_count(&token), 1, "the output took the data");
    drop(done);
    assert_eq!(Rc::strong_count(&token), 1);
    // In flight (parks its data), then one waiting for the only entry.
    let flying = write_one(&qp, &token, 1, SendFlags::NONE);
    let waiting = write_one(&qp, &token, 1, SendFlags::NONE);
    assert!(waiting.is_queued());
    assert_eq!(Rc::strong_count(&token), 3);
    drop(waiting);
    assert_eq!(Rc::strong_count(&token), 2, "unposted data freed at once");
    drop(flying);
    assert_eq!(Rc::strong_count(&token), 2, "posted data parked");
    fake.complete_send(WcStatus::Success, 0).unwrap();
    settle(&rt);
    assert_eq!(
        Rc::strong_count(&token),
        1,
        "parked data freed after the completion"
    );
    assert_eq!(slots(), 0);
}
