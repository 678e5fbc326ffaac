//! Hosted runtimes turned inline by the worker that asks
//! (`hosted::inline_scope`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::pool::{mailbox, Placement, Pool};

/// Bound of every wait here.
const WAIT: Duration = Duration::from_secs(20);

/// A request that a task of the host's own tokio runtime queues for an
/// idle hosted runtime is served before `try_send` returns: the asking
/// worker turns the runtime instead of scheduling the runtime's task
/// (which, on the only worker, could run only once the asking task
/// yields; before the inline turn none of these was served at hand-over).
#[test]
fn a_request_from_a_worker_is_served_at_hand_over() {
    let tokio = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let at_hand_over = tokio.block_on(async {
        let pool = Pool::builder()
            .threads(1)
            .grace_period(Duration::from_millis(100))
            .host_on_tokio(tokio::runtime::Handle::current())
            .build()
            .expect("hosted pool");
        let (tx, rx) = mailbox::<u32>(64);
        let served = Arc::new(AtomicUsize::new(0));
        let counter = served.clone();
        drop(pool.spawn(Placement::Thread(0), move |_| async move {
            while rx.recv().await.is_some() {
                counter.fetch_add(1, Ordering::SeqCst);
            }
        }));
        let asking = tokio::spawn(async move {
            tx.try_send(0).expect("first request");
            let deadline = Instant::now() + WAIT;
            while served.load(Ordering::SeqCst) == 0 {
                assert!(
                    Instant::now() < deadline,
                    "the hosted runtime's task took no message within {WAIT:?}"
                );
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let mut at_hand_over = 0;
            for i in 1..=100 {
                // Whatever the runtime's task had left to do runs first:
                // the runtime is idle when the request comes.
                for _ in 0..3 {
                    tokio::task::yield_now().await;
                }
                let before = served.load(Ordering::SeqCst);
                tx.try_send(i).expect("request");
                if served.load(Ordering::SeqCst) > before {
                    at_hand_over += 1;
                }
            }
            at_hand_over
        });
        let n = tokio::time::timeout(WAIT, asking)
            .await
            .expect("the asking task ends within the bound")
            .expect("the asking task");
        drop(pool);
        n
    });
    assert!(
        at_hand_over >= 90,
        "{at_hand_over} of 100 requests served at hand-over"
    );
}

/// A request queued from the host runtime's `block_on` thread (not a
/// worker: `#[tokio::main]`'s body, where a program's client often runs)
/// for an idle hosted runtime is served before `try_send` returns, even
/// while the only worker is held by another task: that thread turns the
/// runtime itself. Before, its wake scheduled the runtime's task from
/// outside the workers (a remote schedule and an unpark of a worker for
/// every request), and with the worker held none was served at hand-over.
#[test]
fn a_request_from_the_block_on_thread_is_served_at_hand_over() {
    let tokio = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let at_hand_over = tokio.block_on(async {
        let pool = Pool::builder()
            .threads(1)
            .grace_period(Duration::from_millis(100))
            .host_on_tokio(tokio::runtime::Handle::current())
            .build()
            .expect("hosted pool");
        let (tx, rx) = mailbox::<u32>(128);
        let served = Arc::new(AtomicUsize::new(0));
        let counter = served.clone();
        drop(pool.spawn(Placement::Thread(0), move |_| async move {
            while rx.recv().await.is_some() {
                counter.fetch_add(1, Ordering::SeqCst);
            }
        }));
        tx.try_send(0).expect("first request");
        let deadline = Instant::now() + WAIT;
        while served.load(Ordering::SeqCst) == 0 {
            assert!(
                Instant::now() < deadline,
                "the hosted runtime took no message within {WAIT:?}"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // The only worker is held (blocked on a channel) until the
        // requests are made: only this thread can turn the runtime.
        let (held_tx, held_rx) = std::sync::mpsc::channel();
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let holder = tokio::spawn(async move {
            held_tx.send(()).expect("the test waits");
            let _ = release_rx.recv_timeout(WAIT);
        });
        held_rx
            .recv_timeout(WAIT)
            .expect("the worker takes the holding task within the bound");
        let mut at_hand_over = 0;
        for i in 1..=100 {
            let before = served.load(Ordering::SeqCst);
            tx.try_send(i).expect("request");
            if served.load(Ordering::SeqCst) > before {
                at_hand_over += 1;
            }
        }
        drop(release_tx);
        tokio::time::timeout(WAIT, holder)
            .await
            .expect("the holding task ends within the bound")
            .expect("the holding task");
        drop(pool);
        at_hand_over
    });
    assert!(
        at_hand_over >= 90,
        "{at_hand_over} of 100 requests served at hand-over"
    );
}

/// A request turned inline reads no clock, even with a timer live in the
/// runtime (each connection of the agent keeps one): the runtime's timers
/// are fired by its task once its tokio timer fires. Before, every inline
/// turn that ended idle fired the due timers, a clock read per request (a
/// system call where the clocksource is emulated, as in the rxe VM): 100
/// requests made 100 or more.
#[test]
fn a_request_turned_inline_reads_no_clock() {
    let tokio = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let (served, reads) = tokio.block_on(async {
        let pool = Pool::builder()
            .threads(1)
            .grace_period(Duration::from_millis(100))
            .host_on_tokio(tokio::runtime::Handle::current())
            .build()
            .expect("hosted pool");
        let (tx, rx) = mailbox::<u32>(128);
        // The runtime's clock reads so far, as of each message taken.
        let reads = Arc::new(AtomicUsize::new(0));
        let served = Arc::new(AtomicUsize::new(0));
        let (reads2, served2) = (reads.clone(), served.clone());
        drop(pool.spawn(Placement::Thread(0), move |cx| {
            // A live timer that never fires within the test.
            drop(
                cx.handle()
                    .spawn(crate::reactor::sleep(Duration::from_secs(3600))),
            );
            async move {
                while rx.recv().await.is_some() {
                    let h = crate::reactor::Handle::current();
                    reads2.store(h.inner.timers.clock_reads.get(), Ordering::SeqCst);
                    served2.fetch_add(1, Ordering::SeqCst);
                }
            }
        }));
        let asking = tokio::spawn(async move {
            tx.try_send(0).expect("first request");
            let deadline = Instant::now() + WAIT;
            while served.load(Ordering::SeqCst) == 0 {
                assert!(
                    Instant::now() < deadline,
                    "the hosted runtime took no message within {WAIT:?}"
                );
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            for _ in 0..3 {
                tokio::task::yield_now().await;
            }
            let before = reads.load(Ordering::SeqCst);
            let mut inline = 0;
            for i in 1..=100 {
                for _ in 0..3 {
                    tokio::task::yield_now().await;
                }
                let at = served.load(Ordering::SeqCst);
                tx.try_send(i).expect("request");
                if served.load(Ordering::SeqCst) > at {
                    inline += 1;
                }
            }
            // One more, to read the count the last turns left.
            tx.try_send(101).expect("request");
            let deadline = Instant::now() + WAIT;
            while served.load(Ordering::SeqCst) < 102 {
                assert!(Instant::now() < deadline, "requests left unserved");
                tokio::task::yield_now().await;
            }
            (inline, reads.load(Ordering::SeqCst) - before)
        });
        let r = tokio::time::timeout(WAIT, asking)
            .await
            .expect("the asking task ends within the bound")
            .expect("the asking task");
        drop(pool);
        r
    });
    assert!(served >= 90, "{served} of 100 requests turned inline");
    assert!(
        reads <= 10,
        "{reads} clock reads for 100 requests turned inline"
    );
}

/// `ThreadRef::run_hosted` runs its call on the asking worker with the
/// hosted runtime entered (its handle is the thread's current one inside,
/// and not after), and a task the call wakes has run when it returns;
/// from a thread outside the host tokio runtime, and on a pool of runtime
/// threads, it runs nothing.
#[test]
fn run_hosted_calls_into_the_runtime_on_the_asking_worker() {
    let tokio = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("tokio runtime");
    tokio.block_on(async {
        let pool = Pool::builder()
            .threads(1)
            .grace_period(Duration::from_millis(100))
            .host_on_tokio(tokio::runtime::Handle::current())
            .build()
            .expect("hosted pool");
        let thread = pool.threads()[0].clone();
        assert!(thread.is_hosted());
        let asking = tokio::spawn(async move {
            let ran = Arc::new(AtomicUsize::new(0));
            let mut direct = 0;
            for _ in 0..100 {
                // Whatever the runtime's task had left runs first.
                for _ in 0..3 {
                    tokio::task::yield_now().await;
                }
                let before = ran.load(Ordering::SeqCst);
                let r = ran.clone();
                let called = thread.run_hosted(move || {
                    assert!(crate::reactor::Handle::try_current().is_some());
                    drop(crate::reactor::spawn(async move {
                        r.fetch_add(1, Ordering::SeqCst);
                    }));
                });
                assert!(crate::reactor::Handle::try_current().is_none());
                if called.is_some() {
                    direct += 1;
                    assert_eq!(
                        ran.load(Ordering::SeqCst),
                        before + 1,
                        "the task spawned in the call ran before it returned"
                    );
                }
            }
            let from_outside = std::thread::spawn(move || thread.run_hosted(|| ()).is_some())
                .join()
                .expect("the outside thread");
            (direct, from_outside)
        });
        let (direct, from_outside) = tokio::time::timeout(WAIT, asking)
            .await
            .expect("the asking task ends within the bound")
            .expect("the asking task");
        assert!(direct >= 90, "{direct} of 100 calls run on the worker");
        assert!(!from_outside, "a thread outside tokio ran a call");
        drop(pool);
    });
    let threads = Pool::builder().threads(1).build().expect("pool");
    assert!(!threads.threads()[0].is_hosted());
    assert!(threads.threads()[0].run_hosted(|| ()).is_none());
}
