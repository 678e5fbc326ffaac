//! Unit tests of the reactor, ops and queue pairs with synthetic completions.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::os::fd::AsRawFd;
use std::rc::Rc;
use std::task::Poll;
use std::time::{Duration, Instant};

use futures::io::{AsyncReadExt, AsyncWriteExt};
use futures::FutureExt;

use super::*;
use crate::op::{Completable, SubmitError};
use crate::provider::{
    Completion, ProviderError, QpCaps, SendFlags, SendOp, SendWr, Sge, WcStatus,
};
use crate::qp::{QueuePair, Submit};
use crate::testing::{settle, yield_now, FakeQp};

const LIMIT: Duration = Duration::from_secs(10);

/// Like `timeout`, but the deadline is checked first: a future that is only
/// ready because the deadline's wake-up polled it again still fails.
async fn unless_deadline<F: Future>(d: Duration, f: F) -> Result<F::Output, Elapsed> {
    let mut f = std::pin::pin!(f);
    let mut s = sleep(d);
    std::future::poll_fn(|cx| {
        if std::pin::Pin::new(&mut s).poll(cx).is_ready() {
            return Poll::Ready(Err(Elapsed));
        }
        f.as_mut().poll(cx).map(Ok)
    })
    .await
}

fn caps(send: u32, recv: u32) -> QpCaps {
    QpCaps {
        max_send_wr: send,
        max_recv_wr: recv,
        ..QpCaps::default()
    }
}

/// A test op: owns a buffer, reports the completion or the submit error.
struct TestOp {
    buf: Rc<Vec<u8>>,
}

type TestOut = (Result<Completion, String>, Rc<Vec<u8>>);

impl Completable for TestOp {
    type Output = TestOut;
    fn complete(self, c: Completion) -> TestOut {
        (Ok(c), self.buf)
    }
    fn fail(self, e: SubmitError) -> TestOut {
        (Err(e.to_string()), self.buf)
    }
}

fn buffer() -> Rc<Vec<u8>> {
    Rc::new(vec![7u8; 64])
}

/// Submits a chain of `n` RDMA WRITEs of `buf`.
///
/// Only for fake QPs (every QP in these tests): the fake never touches SGE
/// memory, so the shared `Rc` buffer the test may still read is never lent
/// to a device.
fn write_chain(qp: &QueuePair, buf: &Rc<Vec<u8>>, n: usize) -> Submit<TestOp> {
    assert!(
        qp.provider().is_some_and(|p| p.is_fake()),
        "write_chain is for fake QPs only"
    );
    // SAFETY: `qp` is a FakeQp (asserted above), which records wr_ids and
    // flags and never reads or writes the memory the SGEs name.
    unsafe {
        qp.submit_send(TestOp { buf: buf.clone() }, |op, chain| {
            for i in 0..n {
                let mut wr = SendWr {
                    wr_id: 0,
                    sg_list: Default::default(),
                    op: SendOp::Write {
                        remote_addr: 0x1000 + i as u64 * 64,
                        rkey: 42,
                    },
                    // The runtime must clear this on all but the last WR.
                    flags: SendFlags::SIGNALED,
                };
                wr.sg_list.push(Sge {
                    addr: op.buf.as_ptr() as u64,
                    length: op.buf.len() as u32,
                    lkey: 1,
                });
                chain.push(wr);
            }
            Ok(())
        })
    }
}

/// Submits a RECV into `buf`; like [`write_chain`], for fake QPs only.
fn recv(qp: &QueuePair, buf: &Rc<Vec<u8>>) -> Submit<TestOp> {
    assert!(
        qp.provider().is_some_and(|p| p.is_fake()),
        "recv is for fake QPs only"
    );
    // SAFETY: `qp` is a FakeQp (asserted above), which never reads or writes
    // the memory the SGE names.
    unsafe {
        qp.submit_recv(TestOp { buf: buf.clone() }, |op, sgl| {
            sgl.push(Sge {
                addr: op.buf.as_ptr() as u64,
                length: op.buf.len() as u32,
                lkey: 1,
            });
            Ok(())
        })
    }
}

fn is_pending<F: Future + Unpin>(f: &mut F) -> bool {
    f.now_or_never().is_none()
}

// ---- runtime basics ------------------------------------------------------

#[test]
fn block_on_runs_with_no_tasks() {
    let rt = Runtime::new().unwrap();
    assert_eq!(rt.block_on(async { 40 + 2 }), 42);
    let t = Instant::now();
    rt.block_on(sleep(Duration::from_millis(15)));
    assert!(t.elapsed() >= Duration::from_millis(15));
    assert_eq!(rt.task_count(), 0);
}

#[test]
fn one_runtime_per_thread() {
    let rt = Runtime::new().unwrap();
    assert!(matches!(Runtime::new(), Err(RuntimeError::AlreadyExists)));
    drop(rt);
    let _again = Runtime::new().unwrap();
}

#[test]
fn spawn_and_join_handles() {
    let rt = Runtime::new().unwrap();
    let hits = Rc::new(Cell::new(0));
    let h2 = hits.clone();
    // Detached: the handle is dropped, the task still runs.
    drop(rt.spawn(async move {
        sleep(Duration::from_millis(5)).await;
        h2.set(h2.get() + 1);
    }));
    let out = rt.block_on(async {
        let a = spawn(async { 1 });
        let b = spawn(async {
            yield_now().await;
            Rc::new(2) // !Send output is fine
        });
        let nested = spawn(async { spawn(async { 3 }).await });
        assert!(!a.is_finished() || a.is_finished());
        a.await + *b.await + nested.await
    });
    assert_eq!(out, 6);
    rt.block_on(unless_deadline(LIMIT, async {
        while hits.get() == 0 {
            sleep(Duration::from_millis(1)).await;
        }
    }))
    .unwrap();
    assert_eq!(hits.get(), 1);
}

#[test]
fn task_budget_lets_io_and_timers_run() {
    let rt = Runtime::builder().task_budget(2).build().unwrap();
    let stop = Rc::new(Cell::new(false));
    let s2 = stop.clone();
    // A task that never sleeps must not starve timers.
    rt.spawn(async move {
        while !s2.get() {
            yield_now().await;
        }
    });
    rt.block_on(unless_deadline(LIMIT, sleep(Duration::from_millis(10))))
        .unwrap();
    stop.set(true);
    settle(&rt);
    assert_eq!(rt.task_count(), 0);
}

#[test]
fn timers_fire_in_order() {
    let rt = Runtime::new().unwrap();
    let order = Rc::new(RefCell::new(Vec::new()));
    let mut handles = Vec::new();
    for ms in [30u64, 10, 20, 0] {
        let order = order.clone();
        handles.push(rt.spawn(async move {
            sleep(Duration::from_millis(ms)).await;
            order.borrow_mut().push(ms);
        }));
    }
    rt.block_on(unless_deadline(LIMIT, futures::future::join_all(handles)))
        .unwrap();
    assert_eq!(*order.borrow(), vec![0, 10, 20, 30]);
}

#[test]
fn timeout_elapses_or_passes_through() {
    let rt = Runtime::new().unwrap();
    let t = Instant::now();
    let r = rt.block_on(timeout(
        Duration::from_millis(10),
        sleep(Duration::from_secs(30)),
    ));
    assert_eq!(r, Err(Elapsed));
    assert!(t.elapsed() >= Duration::from_millis(10));
    assert!(t.elapsed() < Duration::from_secs(5));
    assert_eq!(rt.block_on(timeout(LIMIT, async { 5 })), Ok(5));
}

#[test]
fn many_dropped_timers_do_not_accumulate() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        for _ in 0..10_000 {
            let r = timeout(Duration::from_secs(3600), async { 1 }).await;
            assert_eq!(r, Ok(1));
            let mut s = sleep(Duration::from_secs(3600));
            assert!(is_pending(&mut s));
        }
    });
    let timers = &rt.handle().inner.timers;
    assert!(timers.heap_len() < 1000, "heap not compacted");
    assert_eq!(timers.next_deadline(), None);
}

#[test]
fn dropped_timers_leave_no_due_check_behind() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let mut s = sleep(Duration::from_secs(3600));
        assert!(is_pending(&mut s));
    });
    let timers = &rt.handle().inner.timers;
    // The last timer gone, its stale heap entry went with it: later loop
    // turns find nothing to check (and read no clock for it).
    assert_eq!(timers.heap_len(), 0);
    assert_eq!(timers.next_deadline(), None);
    assert_eq!(timers.fire_due(), 0);
}

#[test]
fn next_deadline_follows_the_live_timers_through_fires_and_drops() {
    let rt = Runtime::new().unwrap();
    let timers = &rt.handle().inner.timers;
    rt.block_on(async {
        let t0 = Instant::now();
        let mut far = sleep_until(t0 + Duration::from_secs(3600));
        let mut mid = sleep_until(t0 + Duration::from_secs(60));
        let mut near = sleep_until(t0 + Duration::from_millis(1));
        let mut nearer = sleep_until(t0 + Duration::from_micros(500));
        for s in [&mut far, &mut mid, &mut near, &mut nearer] {
            assert!(is_pending(s));
        }
        assert_eq!(timers.next_deadline(), Some(nearer.deadline()));
        // Dropped before it fires: no longer the next deadline.
        drop(nearer);
        assert_eq!(timers.next_deadline(), Some(near.deadline()));
        // Fired but not polled yet: not a deadline any more either.
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(timers.fire(Instant::now()), 1);
        assert_eq!(timers.next_deadline(), Some(mid.deadline()));
        assert!(!is_pending(&mut near));
        drop(mid);
        assert_eq!(timers.next_deadline(), Some(far.deadline()));
        assert_eq!(timers.fire(Instant::now()), 0);
        drop(far);
        assert_eq!(timers.next_deadline(), None);
        assert_eq!(timers.heap_len(), 0);
        // Still works afterwards.
        unless_deadline(LIMIT, sleep(Duration::from_millis(2)))
            .await
            .unwrap();
    });
    assert_eq!(timers.next_deadline(), None);
}

/// A far timer (an `Rdma` connection's keepalive) makes every park ask
/// for the next deadline: answered from the deadline remembered, the heap
/// looked at again only after the earliest timer fired or was dropped, and
/// a nearer timer inserted later still comes first.
#[test]
fn the_next_deadline_is_remembered_until_the_earliest_timer_goes() {
    let rt = Runtime::new().unwrap();
    let timers = &rt.handle().inner.timers;
    rt.block_on(async {
        let t0 = Instant::now();
        let mut far = sleep_until(t0 + Duration::from_secs(3600));
        assert!(is_pending(&mut far));
        let reads = timers.heap_reads.get();
        for _ in 0..100 {
            assert_eq!(timers.next_deadline(), Some(far.deadline()));
        }
        assert_eq!(timers.heap_reads.get(), reads, "the heap was read per ask");
        // Nearer ones inserted later come first; dropping a later one
        // changes nothing.
        let mut mid = sleep_until(t0 + Duration::from_secs(60));
        let mut near = sleep_until(t0 + Duration::from_secs(30));
        assert!(is_pending(&mut mid) && is_pending(&mut near));
        assert_eq!(timers.next_deadline(), Some(near.deadline()));
        drop(mid);
        assert_eq!(timers.next_deadline(), Some(near.deadline()));
        assert_eq!(timers.heap_reads.get(), reads);
        // The earliest dropped: looked up once, then remembered again.
        drop(near);
        assert_eq!(timers.next_deadline(), Some(far.deadline()));
        assert_eq!(timers.next_deadline(), Some(far.deadline()));
        assert_eq!(timers.heap_reads.get(), reads + 1);
        // A fire that finds nothing due keeps it; the last timer gone, none.
        assert_eq!(timers.fire(Instant::now()), 0);
        assert_eq!(timers.next_deadline(), Some(far.deadline()));
        drop(far);
        assert_eq!(timers.next_deadline(), None);
        // A timer after that is the next deadline, not a remembered one.
        let mut later = sleep_until(t0 + Duration::from_secs(7200));
        assert!(is_pending(&mut later));
        assert_eq!(timers.next_deadline(), Some(later.deadline()));
        // Fired: the next one is looked up (none left live).
        let mut soon = sleep(Duration::from_millis(1));
        assert!(is_pending(&mut soon));
        assert_eq!(timers.next_deadline(), Some(soon.deadline()));
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(timers.fire(Instant::now()), 1);
        assert_eq!(timers.next_deadline(), Some(later.deadline()));
        assert!(!is_pending(&mut soon));
    });
}

#[test]
fn a_registered_sleep_completes_once_the_reactor_fires_it() {
    let rt = Runtime::new().unwrap();
    let polls = Rc::new(Cell::new(0u32));
    let p2 = polls.clone();
    let t = Instant::now();
    rt.block_on(unless_deadline(LIMIT, async move {
        let mut s = std::pin::pin!(sleep(Duration::from_millis(5)));
        std::future::poll_fn(|cx| {
            p2.set(p2.get() + 1);
            // Polled again after every yield: stays pending until fired.
            let r = s.as_mut().poll(cx);
            if r.is_pending() {
                cx.waker().wake_by_ref();
            }
            r
        })
        .await
    }))
    .unwrap();
    assert!(t.elapsed() >= Duration::from_millis(5));
    assert!(polls.get() > 1, "{} polls", polls.get());
}

#[test]
fn cross_thread_wake_reaches_a_sleeping_runtime() {
    let rt = Runtime::new().unwrap();
    let (tx, rx) = futures::channel::oneshot::channel::<u32>();
    let th = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        tx.send(9).unwrap();
    });
    let v = rt.block_on(unless_deadline(LIMIT, rx)).unwrap().unwrap();
    assert_eq!(v, 9);
    th.join().unwrap();
}

/// A future that is ready once `flag` is set, handing its waker to `tx`
/// on its first poll. Spurious polls before the flag is set stay pending,
/// so only the peer's wake can finish it.
fn woken_by_peer(
    flag: std::sync::Arc<std::sync::atomic::AtomicBool>,
    tx: std::sync::mpsc::Sender<(
        std::sync::Arc<std::sync::atomic::AtomicBool>,
        std::task::Waker,
    )>,
) -> impl Future<Output = ()> {
    let mut sent = false;
    std::future::poll_fn(move |cx| {
        if flag.load(std::sync::atomic::Ordering::Acquire) {
            return Poll::Ready(());
        }
        if !sent {
            sent = true;
            tx.send((flag.clone(), cx.waker().clone())).unwrap();
        }
        Poll::Pending
    })
}

#[test]
fn cross_thread_wakes_racing_the_sleep_are_never_lost() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let rt = Runtime::new().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<(Arc<AtomicBool>, std::task::Waker)>();
    // Wakes at once: the wake lands while the runtime is on its way to
    // sleep, in epoll, or just out of it.
    let peer = std::thread::spawn(move || {
        for (flag, waker) in rx {
            flag.store(true, Ordering::Release);
            waker.wake();
        }
    });
    const ROUNDS: usize = 1000;
    rt.block_on(unless_deadline(LIMIT, async {
        for i in 0..ROUNDS {
            let flag = Arc::new(AtomicBool::new(false));
            if i % 2 == 0 {
                // The block_on future's own waker.
                woken_by_peer(flag, tx.clone()).await;
            } else {
                // A task's waker (the cross-thread queue).
                spawn(woken_by_peer(flag, tx.clone())).await;
            }
        }
    }))
    .expect("a cross-thread wake was lost");
    drop(tx);
    peer.join().unwrap();
}

#[test]
fn busy_polling_still_sees_sockets() {
    use std::io::{Read, Write};
    // Spins far longer than the test may last: the socket must be seen
    // while spinning, not once the spinning ends.
    let rt = Runtime::builder()
        .busy_poll(Duration::from_secs(3600))
        .build()
        .unwrap();
    let listener = TcpListener::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = listener.local_addr().unwrap();
    let client = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.write_all(b"ping").unwrap();
        let mut b = [0u8; 1];
        s.read_exact(&mut b).unwrap();
        b[0]
    });
    let got = rt
        .block_on(unless_deadline(LIMIT, async {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 4];
            s.read_exact(&mut buf).await.unwrap();
            s.write_all(b"k").await.unwrap();
            buf
        }))
        .expect("socket events were not seen while busy-polling");
    assert_eq!(&got, b"ping");
    assert_eq!(client.join().unwrap(), b'k');
}

#[test]
fn a_sleep_past_its_deadline_at_first_poll_completes_without_a_clock_read() {
    let rt = Runtime::new().unwrap();
    let timers = &rt.handle().inner.timers;
    rt.block_on(async {
        // Passed as of the reactor's last reading: ready at once.
        let before = Instant::now();
        std::thread::sleep(Duration::from_millis(1));
        timers.saw(Instant::now());
        assert!(!is_pending(&mut sleep_until(before)));
        // Passed, but after the reactor's last reading: registered, and
        // fired by the next turn of the loop.
        let t = Instant::now();
        let mut late = std::pin::pin!(sleep_until(t));
        assert!(futures::poll!(late.as_mut()).is_pending());
        assert_eq!(timers.next_deadline(), Some(t));
        unless_deadline(LIMIT, late).await.unwrap();
        // Zero-length sleeps and timeouts still elapse.
        unless_deadline(LIMIT, sleep(Duration::ZERO)).await.unwrap();
        let r = timeout(Duration::ZERO, std::future::pending::<()>()).await;
        assert_eq!(r, Err(Elapsed));
    });
    assert_eq!(timers.next_deadline(), None);
}

#[test]
fn busy_polling_fires_timers() {
    let rt = Runtime::builder()
        .busy_poll(Duration::from_secs(3600))
        .build()
        .unwrap();
    // The bound is a cross-thread wake, not a timer: if spinning never
    // fired timers, a timer could not end the test either.
    let (tx, watchdog) = futures::channel::oneshot::channel::<()>();
    let th = std::thread::spawn(move || {
        std::thread::sleep(LIMIT);
        let _ = tx.send(());
    });
    let t = Instant::now();
    let fired = rt.block_on(async {
        let mut s = std::pin::pin!(sleep(Duration::from_millis(5)).fuse());
        let mut w = watchdog.fuse();
        futures::select! {
            () = s => true,
            _ = w => false,
        }
    });
    assert!(fired, "the timer did not fire while the runtime spun");
    assert!(t.elapsed() >= Duration::from_millis(5));
    drop(th);
}

#[test]
fn same_thread_wakes_from_socket_events_cost_no_kick() {
    use std::io::{Read, Write};
    let rt = Runtime::new().unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    const TRIPS: usize = 50;
    let peer = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut b = [0u8; 1];
        for _ in 0..TRIPS {
            s.read_exact(&mut b).unwrap();
            // Late enough that the runtime is asleep in epoll when the
            // echo arrives: its readiness wakes the reader from there.
            std::thread::sleep(Duration::from_millis(1));
            s.write_all(&b).unwrap();
        }
    });
    let kicks = &rt.handle().inner.executor.shared.kicks;
    rt.block_on(unless_deadline(LIMIT, async {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let before = kicks.load(std::sync::atomic::Ordering::Relaxed);
        for i in 0..TRIPS {
            s.write_all(&[i as u8]).await.unwrap();
            let mut b = [0u8; 1];
            s.read_exact(&mut b).await.unwrap();
            assert_eq!(b[0], i as u8);
        }
        // The reader's wakes happen while the reactor dispatches epoll's
        // events, on its own thread: nothing to kick.
        assert_eq!(kicks.load(std::sync::atomic::Ordering::Relaxed), before);
    }))
    .unwrap();
    peer.join().unwrap();
}

#[test]
fn tcp_echo_on_loopback() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let listener = TcpListener::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = listener.local_addr().unwrap();
        let server = spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 1 << 20];
            let mut total = 0;
            loop {
                let n = s.read(&mut buf).await.unwrap();
                if n == 0 {
                    break;
                }
                s.write_all(&buf[..n]).await.unwrap();
                total += n;
            }
            s.close().await.unwrap();
            total
        });
        let c = TcpStream::connect(addr).await.unwrap();
        c.set_nodelay(true).unwrap();
        // Large enough to fill socket buffers both ways (exercises WouldBlock).
        let msg: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        let (mut rd, mut wr) = c.split();
        let writer = async {
            wr.write_all(&msg).await.unwrap();
            wr.close().await.unwrap();
        };
        let reader = async {
            let mut back = Vec::new();
            rd.read_to_end(&mut back).await.unwrap();
            back
        };
        let ((), back) = unless_deadline(LIMIT, futures::future::join(writer, reader))
            .await
            .unwrap();
        assert!(back == msg, "echo differs");
        assert_eq!(unless_deadline(LIMIT, server).await.unwrap(), msg.len());
    });
}

#[test]
fn tcp_connect_refused_is_an_error() {
    let rt = Runtime::new().unwrap();
    // Bind then drop to get a port nobody listens on.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let r = rt
        .block_on(unless_deadline(LIMIT, TcpStream::connect(addr)))
        .unwrap();
    assert!(r.is_err());
}

// ---- ops -----------------------------------------------------------------

#[test]
fn op_completes_with_its_completion_and_buffer() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(4, 4), 64);
    let buf = buffer();
    let op = write_chain(&qp, &buf, 1);
    assert!(!op.is_queued());
    assert_eq!(fake.outstanding_sends(), 1);
    let id = fake.complete_send(WcStatus::Success, 64).unwrap();
    let (res, back) = rt.block_on(unless_deadline(LIMIT, op)).unwrap();
    let c = res.unwrap();
    assert_eq!(c.wr_id, id);
    assert_eq!(c.status, WcStatus::Success);
    assert!(Rc::ptr_eq(&back, &buf));
    assert_eq!(rt.ops_in_slab(), 0);
    assert_eq!(qp.outstanding_sends(), 0);
}

#[test]
fn recv_op_completes() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(4, 4), 64);
    let buf = buffer();
    let op = recv(&qp, &buf);
    assert_eq!(qp.outstanding_recvs(), 1);
    fake.complete_recv(WcStatus::Success, 12).unwrap();
    let (res, _) = rt.block_on(unless_deadline(LIMIT, op)).unwrap();
    assert_eq!(res.unwrap().byte_len, 12);
    assert_eq!(qp.outstanding_recvs(), 0);
}

#[test]
fn drop_before_post_frees_immediately() {
    let _rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(1, 1), 64);
    let first = buffer();
    let _inflight = write_chain(&qp, &first, 1);
    let buf = buffer();
    let mut queued = write_chain(&qp, &buf, 1);
    assert!(queued.is_queued());
    assert!(is_pending(&mut queued));
    assert_eq!(Rc::strong_count(&buf), 2);
    drop(queued);
    assert_eq!(
        Rc::strong_count(&buf),
        1,
        "unposted op must free its data at once"
    );
    assert_eq!(fake.outstanding_sends(), 1);
    // A request the verb itself rejects frees its data too.
    // SAFETY: `build` pushes no WR (it fails), so nothing is posted; and `qp`
    // is a FakeQp, which never touches SGE memory anyway.
    let bad = unsafe {
        qp.submit_send(TestOp { buf: buf.clone() }, |_, _| {
            Err(SubmitError::Invalid {
                what: "test".into(),
            })
        })
    };
    let (r, _) = bad.now_or_never().unwrap();
    assert!(r.unwrap_err().contains("test"));
    assert_eq!(Rc::strong_count(&buf), 1);
}

#[test]
fn drop_in_flight_parks_until_late_completion() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(4, 4), 64);
    let buf = buffer();
    let mut op = write_chain(&qp, &buf, 1);
    assert!(is_pending(&mut op));
    drop(op);
    settle(&rt);
    assert_eq!(Rc::strong_count(&buf), 2, "in-flight data must stay parked");
    assert_eq!(rt.ops_in_slab(), 1);
    assert_eq!(qp.outstanding_sends(), 1, "entry held until completion");
    fake.complete_send(WcStatus::Success, 64).unwrap();
    settle(&rt);
    assert_eq!(Rc::strong_count(&buf), 1, "late completion frees the data");
    assert_eq!(rt.ops_in_slab(), 0);
    assert_eq!(qp.outstanding_sends(), 0);
}

#[test]
fn completion_before_first_poll_is_kept() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(4, 4), 64);
    let buf = buffer();
    let op = write_chain(&qp, &buf, 1);
    fake.complete_send(WcStatus::Success, 64).unwrap();
    settle(&rt);
    // Completed but not collected: dropping now frees at once.
    assert_eq!(rt.ops_in_slab(), 1);
    drop(op);
    assert_eq!(rt.ops_in_slab(), 0);
    assert_eq!(Rc::strong_count(&buf), 1);
}

#[test]
fn stale_generation_never_wakes_a_reused_slot() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(4, 4), 64);
    let buf = buffer();
    let a = write_chain(&qp, &buf, 1);
    let a_id = a.wr_id().unwrap();
    fake.complete_send(WcStatus::Success, 1).unwrap();
    rt.block_on(unless_deadline(LIMIT, a)).unwrap().0.unwrap();

    let mut b = write_chain(&qp, &buf, 1);
    let b_id = b.wr_id().unwrap();
    assert_eq!(
        b_id & crate::op::wr_id::KEY_MASK,
        a_id & crate::op::wr_id::KEY_MASK,
        "slot reused"
    );
    assert_ne!(a_id, b_id, "generation differs");
    // A duplicate/late completion carrying A's wr_id.
    fake.inject(Completion {
        wr_id: a_id,
        status: WcStatus::Success,
        ..Completion::EMPTY
    });
    settle(&rt);
    assert_eq!(rt.handle().stale_completions(), 1);
    assert!(is_pending(&mut b), "stale completion must not complete B");
    assert_eq!(qp.outstanding_sends(), 1);
    fake.complete_send(WcStatus::Success, 1).unwrap();
    let (r, _) = rt.block_on(unless_deadline(LIMIT, b)).unwrap();
    assert_eq!(r.unwrap().wr_id, b_id);
}

#[test]
fn full_send_queue_makes_submission_wait() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(2, 2), 64);
    let buf = buffer();
    let done = Rc::new(RefCell::new(Vec::new()));
    let mut handles = Vec::new();
    for i in 0..5 {
        let op = write_chain(&qp, &buf, 1);
        let done = done.clone();
        handles.push(rt.spawn(async move {
            let (r, _) = op.await;
            r.unwrap();
            done.borrow_mut().push(i);
        }));
    }
    settle(&rt);
    assert_eq!(fake.outstanding_sends(), 2);
    assert_eq!(qp.outstanding_sends(), 2);
    for _ in 0..5 {
        assert!(fake.complete_send(WcStatus::Success, 1).is_some());
        settle(&rt);
        assert!(fake.outstanding_sends() <= 2);
    }
    rt.block_on(unless_deadline(LIMIT, futures::future::join_all(handles)))
        .unwrap();
    assert_eq!(*done.borrow(), vec![0, 1, 2, 3, 4], "FIFO order");
    assert_eq!(fake.max_outstanding_sends(), 2, "never overran the SQ");
    assert_eq!(qp.outstanding_sends(), 0);
}

#[test]
fn chain_is_one_doorbell_and_releases_entries_at_the_signaled_completion() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(4, 4), 64);
    let buf = buffer();
    let mut chain = write_chain(&qp, &buf, 3);
    assert_eq!(fake.doorbells(), 1);
    let posted = fake.posted_sends();
    assert_eq!(posted.len(), 3);
    let signaled: Vec<bool> = posted
        .iter()
        .map(|(_, f)| f.contains(SendFlags::SIGNALED))
        .collect();
    assert_eq!(signaled, vec![false, false, true]);
    assert_eq!(qp.outstanding_sends(), 3);
    // Needs 2, only 1 left: waits.
    let mut second = write_chain(&qp, &buf, 2);
    assert!(second.is_queued());
    assert!(is_pending(&mut second));
    assert!(is_pending(&mut chain));
    fake.complete_send(WcStatus::Success, 64).unwrap(); // retires all three
    let (r, _) = rt.block_on(unless_deadline(LIMIT, &mut chain)).unwrap();
    assert_eq!(r.unwrap().wr_id, posted[2].0);
    assert!(is_pending(&mut second));
    assert!(!second.is_queued(), "posted once entries came back");
    assert_eq!(fake.outstanding_sends(), 2);
    fake.complete_send(WcStatus::Success, 64).unwrap();
    rt.block_on(unless_deadline(LIMIT, second))
        .unwrap()
        .0
        .unwrap();
    assert_eq!(qp.outstanding_sends(), 0);
}

#[test]
fn chain_reports_its_first_error() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(4, 4), 64);
    let buf = buffer();
    let chain = write_chain(&qp, &buf, 3);
    let first = fake.posted_sends()[0].0;
    fake.complete_send(WcStatus::RemAccessErr, 0).unwrap();
    // The device then moves the QP to ERR and flushes the rest.
    let h = rt.handle().clone();
    let f2 = fake.clone();
    rt.block_on(async move {
        yield_now().await;
        let _ = &h;
        f2.modify_to_err().unwrap();
    });
    let (r, _) = rt.block_on(unless_deadline(LIMIT, chain)).unwrap();
    let c = r.unwrap();
    assert_eq!(c.status, WcStatus::RemAccessErr);
    assert_eq!(c.wr_id, first);
    assert_eq!(qp.outstanding_sends(), 0);
}

#[test]
fn cq_capacity_is_a_entry_too() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(8, 8), 2);
    let buf = buffer();
    let a = write_chain(&qp, &buf, 1);
    let b = recv(&qp, &buf);
    let mut c = write_chain(&qp, &buf, 1);
    assert!(c.is_queued(), "CQ full: must wait");
    assert!(is_pending(&mut c));
    fake.complete_recv(WcStatus::Success, 1).unwrap();
    rt.block_on(unless_deadline(LIMIT, b)).unwrap().0.unwrap();
    assert!(is_pending(&mut c));
    assert!(!c.is_queued());
    fake.complete_send(WcStatus::Success, 1).unwrap();
    fake.complete_send(WcStatus::Success, 1).unwrap();
    rt.block_on(unless_deadline(LIMIT, a)).unwrap().0.unwrap();
    rt.block_on(unless_deadline(LIMIT, c)).unwrap().0.unwrap();
    // A chain longer than the CQ can ever hold fails instead of waiting forever.
    let (r, _) = write_chain(&qp, &buf, 3).now_or_never().unwrap();
    assert!(r.unwrap_err().contains("does not fit"));
}

#[test]
fn post_failure_returns_data_and_entries() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(4, 4), 64);
    let buf = buffer();
    fake.fail_next_post(
        0,
        ProviderError::InvalidArgument {
            call: "post_send",
            what: "test".into(),
        },
    );
    let (r, back) = write_chain(&qp, &buf, 2).now_or_never().unwrap();
    assert!(r.unwrap_err().contains("post failed"));
    drop(back);
    assert_eq!(Rc::strong_count(&buf), 1);
    assert_eq!(qp.outstanding_sends(), 0);
    assert_eq!(rt.ops_in_slab(), 0);

    // Partial post: the accepted part is flushed, then the op fails.
    fake.fail_next_post(
        1,
        ProviderError::InvalidArgument {
            call: "post_send",
            what: "test".into(),
        },
    );
    let op = write_chain(&qp, &buf, 3);
    assert_eq!(
        fake.err_transitions(),
        1,
        "QP moved to ERR to flush the part"
    );
    let (r, _) = rt.block_on(unless_deadline(LIMIT, op)).unwrap();
    assert!(r.unwrap_err().contains("post failed"));
    assert_eq!(qp.outstanding_sends(), 0);
    assert!(qp.is_closed());
}

#[test]
fn close_flushes_parked_ops_and_fails_waiters() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(1, 2), 64);
    let buf = buffer();
    let mut a = write_chain(&qp, &buf, 1);
    assert!(is_pending(&mut a));
    drop(a); // parked
    let r1 = recv(&qp, &buf);
    let queued = write_chain(&qp, &buf, 1);
    assert!(queued.is_queued());
    let waiter = rt.spawn(queued);
    settle(&rt);
    assert_eq!(Rc::strong_count(&buf), 4);
    let qp2 = qp.clone();
    let closing = rt.spawn(async move { qp2.close().await });
    settle(&rt);
    // Woken by the flushes themselves, not by any timer.
    assert!(closing.is_finished(), "close must resolve once flushed");
    rt.block_on(closing).unwrap();
    assert_eq!(fake.err_transitions(), 1);
    let (r, _) = rt.block_on(unless_deadline(LIMIT, waiter)).unwrap();
    assert!(r.unwrap_err().contains("closed"));
    let (r, _) = rt.block_on(unless_deadline(LIMIT, r1)).unwrap();
    assert_eq!(r.unwrap().status, WcStatus::WrFlushErr);
    assert_eq!(Rc::strong_count(&buf), 1, "flush freed the parked data");
    let (r, _) = write_chain(&qp, &buf, 1).now_or_never().unwrap();
    assert!(r.unwrap_err().contains("closed"));
    assert_eq!(rt.ops_in_slab(), 0);
}

#[test]
fn dropping_a_queue_pair_drains_it_in_the_background() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(4, 4), 64);
    let buf = buffer();
    let mut a = write_chain(&qp, &buf, 2);
    assert!(is_pending(&mut a));
    drop(a);
    drop(qp);
    assert_eq!(fake.err_transitions(), 1, "dropped QP moves to ERR");
    settle(&rt);
    assert_eq!(Rc::strong_count(&buf), 1);
    assert_eq!(rt.ops_in_slab(), 0);
    assert_eq!(rt.handle().driver().qp_count(), 0, "zombie reaped");
}

#[test]
fn dropping_the_runtime_drains_in_flight_ops() {
    let buf = buffer();
    let rt = Runtime::new().unwrap();
    let (qp, _fake) = FakeQp::queue_pair(7, caps(4, 4), 64);
    // An op owned by a task that never finishes, and a parked one.
    let op = write_chain(&qp, &buf, 1);
    rt.spawn(async move {
        let _ = op.await;
    });
    let mut parked = write_chain(&qp, &buf, 1);
    assert!(is_pending(&mut parked));
    drop(parked);
    settle(&rt);
    assert_eq!(Rc::strong_count(&buf), 3);
    drop(qp);
    drop(rt);
    assert_eq!(Rc::strong_count(&buf), 1, "flushed at shutdown, then freed");
}

#[test]
fn an_op_future_may_outlive_its_runtime() {
    let buf = buffer();
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(4, 4), 64);
    let mut op = write_chain(&qp, &buf, 1);
    assert!(is_pending(&mut op));
    drop(qp);
    drop(fake);
    // The shutdown flushes the op (its completion waits in its slot,
    // uncollected) and frees the runtime; the future outlives both.
    drop(rt);
    let (res, held) = op.now_or_never().expect("completed by the flush");
    assert_eq!(res.expect("a completion").status, WcStatus::WrFlushErr);
    assert!(Rc::ptr_eq(&held, &buf), "the output hands the buffer back");
}

#[test]
fn dropping_the_runtime_leaks_what_never_completes() {
    let buf = buffer();
    let rt = Runtime::builder()
        .drain_timeout(Duration::from_millis(30))
        .build()
        .unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(4, 4), 64);
    fake.set_flush_on_err(false); // a device that never answers
    let mut op = write_chain(&qp, &buf, 1);
    assert!(is_pending(&mut op));
    drop(op);
    drop(qp);
    let t = Instant::now();
    drop(rt);
    assert!(
        t.elapsed() >= Duration::from_millis(30),
        "waited for the drain"
    );
    assert!(t.elapsed() < Duration::from_secs(5));
    assert_eq!(
        Rc::strong_count(&buf),
        2,
        "memory the device may still touch is leaked, not freed"
    );
}

#[test]
fn reserved_wr_ids_go_to_the_handler() {
    let rt = Runtime::new().unwrap();
    let seen = Rc::new(RefCell::new(Vec::new()));
    let s2 = seen.clone();
    rt.handle()
        .set_reserved_handler(Some(Box::new(move |c| s2.borrow_mut().push(c.wr_id))));
    let h = rt.handle();
    let (_qp, fake) = FakeQp::queue_pair(1, QpCaps::default(), 16);
    for id in [
        crate::op::wr_id::UNTRACKED,
        crate::op::wr_id::AGENT_BASE + 5,
    ] {
        fake.inject(Completion {
            wr_id: id,
            ..Completion::EMPTY
        });
    }
    settle(&rt);
    assert_eq!(*seen.borrow(), vec![crate::op::wr_id::AGENT_BASE + 5]);
    assert_eq!(h.stale_completions(), 0);
}

// ---- driving from another executor -----------------------------------------

fn wait_fd(fd: i32, wait: Option<Duration>) {
    // Capped so a lost wake-up fails the test (see callers) instead of hanging.
    let ms = wait.map_or(3000, |d| d.as_micros().div_ceil(1000).min(3000) as i32);
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: `p` is a valid pollfd for the duration of the call.
    let r = unsafe { libc::poll(&mut p, 1, ms) };
    assert!(r >= 0, "poll failed");
}

#[test]
fn driven_by_a_plain_loop_on_the_epoll_fd() {
    let rt = Runtime::new().unwrap();
    let fd = rt.as_raw_fd();
    let (tx, rx) = futures::channel::oneshot::channel::<u32>();
    let got = Rc::new(Cell::new(0));
    let g2 = got.clone();
    rt.spawn(async move {
        sleep(Duration::from_millis(10)).await;
        g2.set(rx.await.unwrap());
    });
    let th = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(30));
        tx.send(5).unwrap();
    });
    let start = Instant::now();
    let mut waits = 0;
    while got.get() == 0 {
        assert!(start.elapsed() < LIMIT, "adapter loop hung");
        let t = rt.turn();
        if !t.ready && got.get() == 0 {
            waits += 1;
            wait_fd(fd, t.wait_for());
        }
    }
    th.join().unwrap();
    assert_eq!(got.get(), 5);
    // Far below the 3 s wait cap: the fd itself woke the loop.
    assert!(
        start.elapsed() < Duration::from_millis(2500),
        "missed wake-up"
    );
    assert!(
        (1..1000).contains(&waits),
        "slept on the fd ({waits} waits)"
    );
}

#[test]
fn ops_and_timers_work_under_a_foreign_executor() {
    let rt = Runtime::new().unwrap();
    let fd = rt.as_raw_fd();
    let (qp, fake) = FakeQp::queue_pair(7, caps(4, 4), 64);
    let buf = buffer();
    let mut pool = futures::executor::LocalPool::new();
    let result = Rc::new(RefCell::new(None));
    let r2 = result.clone();
    let op = write_chain(&qp, &buf, 1);
    use futures::task::LocalSpawnExt;
    pool.spawner()
        .spawn_local(async move {
            sleep(Duration::from_millis(5)).await;
            let (r, _) = op.await;
            *r2.borrow_mut() = Some(r.unwrap().status);
        })
        .unwrap();
    let start = Instant::now();
    let mut completed = false;
    while result.borrow().is_none() {
        assert!(start.elapsed() < LIMIT, "foreign executor hung");
        pool.run_until_stalled();
        if !completed && start.elapsed() > Duration::from_millis(10) {
            fake.complete_send(WcStatus::Success, 1).unwrap();
            completed = true;
        }
        let t = rt.turn();
        if !t.ready && result.borrow().is_none() {
            wait_fd(fd, Some(t.wait_for().unwrap_or(Duration::from_millis(5))));
        }
    }
    assert_eq!(*result.borrow(), Some(WcStatus::Success));
}

// ---- hot path: no allocation per op -----------------------------------------

mod counting_alloc {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    thread_local! {
        /// Allocations made by this thread (const-initialised: no lazy
        /// allocation inside the allocator).
        pub static ALLOCS: Cell<u64> = const { Cell::new(0) };
    }

    pub struct Counting;

    // SAFETY: forwards to the system allocator; only counts.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
            // SAFETY: same contract as ours.
            unsafe { System.alloc(layout) }
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            // SAFETY: same contract as ours.
            unsafe { System.dealloc(ptr, layout) }
        }
        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
            // SAFETY: same contract as ours.
            unsafe { System.realloc(ptr, layout, new_size) }
        }
    }

    #[global_allocator]
    static GLOBAL: Counting = Counting;

    pub fn count() -> u64 {
        ALLOCS.with(|c| c.get())
    }
}

#[test]
fn submit_and_complete_do_not_allocate() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(16, 16), 64);
    let buf = buffer();
    let run = |n: usize| {
        rt.block_on(async {
            for _ in 0..n {
                // A two-WR chain and a receive, each awaited after completion
                // arrives asynchronously (the task really waits).
                let op = write_chain(&qp, &buf, 2);
                let r = recv(&qp, &buf);
                let mut op = std::pin::pin!(op);
                assert!(futures::poll!(op.as_mut()).is_pending());
                fake.complete_send(WcStatus::Success, 1).unwrap();
                fake.complete_recv(WcStatus::Success, 1).unwrap();
                op.await.0.unwrap();
                r.await.0.unwrap();
            }
        })
    };
    run(64); // warm up: slab, queues, batch buffers reach their size
    let before = counting_alloc::count();
    run(1000);
    let allocs = counting_alloc::count() - before;
    assert_eq!(allocs, 0, "{allocs} allocations in 1000 op round trips");
    // The counter does see allocations.
    let probe = std::hint::black_box(vec![1u8; 16]);
    assert!(counting_alloc::count() > before + allocs);
    drop(probe);
}

#[test]
fn busy_poll_mode_still_sleeps_and_completes() {
    let rt = Runtime::builder()
        .busy_poll(Duration::from_micros(200))
        .cq_poll_batch(4)
        .build()
        .unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(4, 4), 64);
    let buf = buffer();
    let op = write_chain(&qp, &buf, 1);
    let f2 = fake.clone();
    rt.spawn(async move {
        sleep(Duration::from_millis(5)).await;
        f2.complete_send(WcStatus::Success, 1).unwrap();
    });
    let (r, _) = rt.block_on(unless_deadline(LIMIT, op)).unwrap();
    assert!(r.unwrap().status.is_success());
}

#[test]
fn spawning_between_turns_makes_the_fd_readable() {
    let rt = Runtime::new().unwrap();
    let fd = rt.as_raw_fd();
    while rt.turn().ready {}
    let done = Rc::new(Cell::new(false));
    let d2 = done.clone();
    spawn(async move { d2.set(true) });
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: `p` is a valid pollfd for the duration of the call.
    let r = unsafe { libc::poll(&mut p, 1, 3000) };
    assert_eq!(r, 1, "epoll fd not readable after spawn");
    while rt.turn().ready {}
    assert!(done.get());
}

#[test]
fn runtime_in_a_thread_local_drops_at_thread_exit() {
    thread_local! {
        static RT: RefCell<Option<Runtime>> = const { RefCell::new(None) };
    }
    let th = std::thread::spawn(|| {
        // Touch RT first so its destructor runs after CURRENT's.
        RT.with(|r| assert!(r.borrow().is_none()));
        let rt = Runtime::new().unwrap();
        rt.block_on(sleep(Duration::from_millis(1)));
        RT.with(|r| *r.borrow_mut() = Some(rt));
    });
    assert!(th.join().is_ok(), "teardown panicked");
}

#[test]
fn aborting_a_task_drops_its_future() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(4, 4), 64);
    let buf = buffer();
    let op = write_chain(&qp, &buf, 1);
    let h = rt.spawn(async move {
        let _ = op.await;
        unreachable!("aborted before completion");
    });
    settle(&rt);
    assert!(!h.is_finished());
    // Abort before the task was ever polled, too.
    let never = rt.spawn(async { unreachable!("never polled") });
    never.abort();
    let probe = Rc::new(());
    let p2 = probe.clone();
    let h2 = rt.spawn(async move {
        let _keep = p2;
        std::future::pending::<()>().await
    });
    settle(&rt);
    assert_eq!(Rc::strong_count(&probe), 2);
    h2.abort();
    h.abort();
    settle(&rt);
    assert_eq!(Rc::strong_count(&probe), 1, "aborted future dropped");
    assert_eq!(rt.task_count(), 0);
    // The op the task owned is parked until its completion.
    assert_eq!(Rc::strong_count(&buf), 2);
    fake.complete_send(WcStatus::Success, 1).unwrap();
    settle(&rt);
    assert_eq!(Rc::strong_count(&buf), 1);
}

/// Same-thread wakes skip the cross-thread queue; a waker of a dropped
/// runtime must still never schedule a task of a later runtime on the
/// thread (task ids are reused).
#[test]
fn waker_of_a_dropped_runtime_never_polls_a_later_ones_task() {
    let stash: Rc<RefCell<Option<std::task::Waker>>> = Rc::new(RefCell::new(None));
    {
        let rt = Runtime::new().unwrap();
        let s2 = stash.clone();
        rt.spawn(std::future::poll_fn(move |cx| {
            *s2.borrow_mut() = Some(cx.waker().clone());
            Poll::<()>::Pending
        }));
        while rt.turn().ready {}
    }
    assert!(stash.borrow().is_some(), "the old task ran");
    let rt = Runtime::new().unwrap();
    let polls = Rc::new(Cell::new(0u32));
    let p2 = polls.clone();
    rt.spawn(std::future::poll_fn(move |_| {
        p2.set(p2.get() + 1);
        Poll::<()>::Pending
    }));
    while rt.turn().ready {}
    let before = polls.get();
    assert_eq!(before, 1);
    stash.borrow_mut().take().unwrap().wake();
    while rt.turn().ready {}
    assert_eq!(polls.get(), before, "an old waker polled a new task");
}

/// A same-thread wake of a pending task between turns makes the epoll fd
/// readable (an outer poller must notice it).
#[test]
fn same_thread_wake_between_turns_makes_the_fd_readable() {
    let rt = Runtime::new().unwrap();
    let fd = rt.as_raw_fd();
    let stash: Rc<RefCell<Option<std::task::Waker>>> = Rc::new(RefCell::new(None));
    let s2 = stash.clone();
    let polls = Rc::new(Cell::new(0u32));
    let p2 = polls.clone();
    rt.spawn(std::future::poll_fn(move |cx| {
        p2.set(p2.get() + 1);
        *s2.borrow_mut() = Some(cx.waker().clone());
        Poll::<()>::Pending
    }));
    while rt.turn().ready {}
    // Drain the kick of the spawn itself.
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: `p` is a valid pollfd for the duration of the call.
    while unsafe { libc::poll(&mut p, 1, 0) } == 1 {
        while rt.turn().ready {}
    }
    let before = polls.get();
    stash.borrow().as_ref().unwrap().wake_by_ref();
    // SAFETY: as above.
    let r = unsafe { libc::poll(&mut p, 1, 3000) };
    assert_eq!(r, 1, "epoll fd not readable after a same-thread wake");
    while rt.turn().ready {}
    assert_eq!(polls.get(), before + 1);
}

#[test]
fn shutdown_wakes_and_settles_handles_of_unfinished_tasks() {
    let rt = Runtime::new().unwrap();
    let pending = rt.spawn(std::future::pending::<u32>());
    let done = rt.spawn(async { 7u32 });
    let panicking = rt.spawn(std::future::pending::<u32>());
    settle(&rt);
    assert!(done.is_finished());
    assert!(!pending.is_finished());
    // Another executor awaits the pending task's handle.
    let mut pool = futures::executor::LocalPool::new();
    let got = Rc::new(RefCell::new(None));
    let g2 = got.clone();
    let fallible = pending.fallible();
    use futures::task::LocalSpawnExt;
    pool.spawner()
        .spawn_local(async move {
            *g2.borrow_mut() = Some(fallible.await);
        })
        .unwrap();
    pool.run_until_stalled();
    assert!(got.borrow().is_none(), "resolved while the task was alive");
    drop(rt);
    // Dropping the runtime dropped the task and woke the waiter.
    pool.run_until_stalled();
    assert_eq!(*got.borrow(), Some(None));
    // A finished task's output survives the runtime.
    assert_eq!(futures::executor::block_on(done.fallible()), Some(7));
    // A plain handle of a dropped task panics rather than hanging.
    assert!(panicking.is_finished());
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        futures::executor::block_on(panicking)
    }));
    assert!(
        caught.is_err(),
        "awaiting a dropped task's handle must panic"
    );
}

// ---- task panics -----------------------------------------------------------

/// A task that panics with `msg` before it yields an output.
async fn panics_with(msg: &'static str) -> u32 {
    panic_now(msg);
    0
}

#[test]
fn a_panicking_task_ends_alone_and_its_handle_reports_the_panic() {
    let rt = Runtime::new().unwrap();
    let out = rt.block_on(async {
        let bad = spawn(panics_with("boom in a task"));
        let good = spawn(async {
            yield_now().await;
            5u32
        });
        let err = bad.result().await.unwrap_err();
        assert!(err.is_panic(), "{err}");
        assert!(err.to_string().contains("boom in a task"), "{err}");
        let payload = err.into_panic().expect("payload");
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"boom in a task"));
        // Without an output, `fallible` gives None.
        assert_eq!(spawn(panics_with("again")).fallible().await, None);
        good.await
    });
    assert_eq!(out, 5, "the other task and block_on went on");
    assert_eq!(rt.task_count(), 0, "the panicked tasks are gone");
    // The runtime still runs tasks afterwards.
    assert_eq!(rt.block_on(async { spawn(async { 9u32 }).await }), 9);
}

#[test]
fn awaiting_a_panicked_tasks_handle_resumes_its_panic() {
    let rt = Runtime::new().unwrap();
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        rt.block_on(async { spawn(panics_with("resumed")).await })
    }));
    let payload = caught.expect_err("the awaiting future panics");
    assert_eq!(payload.downcast_ref::<&str>(), Some(&"resumed"));
    // block_on is usable again after its future panicked.
    assert_eq!(rt.block_on(async { 3 }), 3);
}

#[test]
fn a_task_panicking_with_an_op_in_flight_parks_its_buffer() {
    let rt = Runtime::new().unwrap();
    let (qp, fake) = FakeQp::queue_pair(7, caps(4, 4), 64);
    let buf = buffer();
    let op = write_chain(&qp, &buf, 1);
    let h = rt.spawn(async move {
        let mut op = op;
        // Polled once (posted, waiting), then the task panics holding it.
        assert!(is_pending(&mut op));
        panic_now("panic with an op in flight");
        drop(op);
    });
    settle(&rt);
    assert!(h.is_finished(), "the panic ended the task");
    assert_eq!(rt.task_count(), 0);
    assert_eq!(fake.outstanding_sends(), 1, "the WR is still the device's");
    assert_eq!(Rc::strong_count(&buf), 2, "its buffer is parked, not freed");
    assert_eq!(rt.ops_in_slab(), 1);
    fake.complete_send(WcStatus::Success, 64)
        .expect("a WR to complete");
    settle(&rt);
    assert_eq!(Rc::strong_count(&buf), 1, "freed once it completed");
    assert_eq!(rt.ops_in_slab(), 0);
}

/// Panics with `msg` (a plain function: the code after a call stays
/// reachable for the compiler).
fn panic_now(msg: &'static str) {
    std::panic::panic_any(msg)
}
