use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use futures::executor::block_on;

use super::*;

/// `T: Send + Sync` at compile time.
fn send_sync<T: Send + Sync>() {}
/// `T: Send` at compile time.
fn send<T: Send>() {}

#[test]
fn the_pool_types_cross_threads() {
    send_sync::<Pool>();
    send_sync::<ThreadRef>();
    send_sync::<PoolError>();
    send_sync::<MailSender<u32>>();
    send::<MailReceiver<u32>>();
    send::<PoolJoinHandle<Vec<u8>>>();
    send_sync::<Answer<Vec<u8>>>();
    send::<Completer<Vec<u8>>>();
    send_sync::<SlotCache<Vec<u8>>>();
    send_sync::<PoolBuilder>();
}

fn pool(threads: usize) -> Pool {
    Pool::builder()
        .threads(threads)
        .grace_period(Duration::from_millis(100))
        .build()
        .expect("pool")
}

#[test]
fn tasks_run_on_the_thread_placed_and_may_be_local() {
    let p = pool(2);
    for i in 0..2 {
        let h = p.spawn(Placement::Thread(i), |cx| {
            // `!Send` state is fine on the thread.
            let local = Rc::new(cx.index());
            async move {
                crate::reactor::yield_now().await;
                (*local, std::thread::current().name().map(str::to_owned))
            }
        });
        let (index, name) = block_on(h).unwrap();
        assert_eq!(index, i);
        assert_eq!(name.as_deref(), Some(format!("verbio-pool-{i}").as_str()));
    }
    // Round-robin visits both; a key always lands on the same thread.
    let mut seen = [0; 2];
    for _ in 0..4 {
        let i = block_on(p.spawn(Placement::RoundRobin, |cx| {
            let i = cx.index();
            async move { i }
        }))
        .unwrap();
        seen[i] += 1;
    }
    assert_eq!(seen, [2, 2]);
    let a = p.place(Placement::Key(42)).unwrap().index();
    for _ in 0..3 {
        assert_eq!(p.place(Placement::Key(42)).unwrap().index(), a);
    }
    assert!(matches!(
        block_on(p.spawn(Placement::Thread(2), |_| async {})),
        Err(PoolError::NoSuchThread {
            index: 2,
            threads: 2
        })
    ));
}

#[test]
fn many_threads_submit_at_once() {
    let p = Arc::new(Pool::builder().threads(2).queue_depth(8).build().unwrap());
    let callers: Vec<_> = (0..6u64)
        .map(|c| {
            let p = p.clone();
            std::thread::spawn(move || {
                let handles: Vec<_> = (0..100u64)
                    .map(|i| {
                        p.spawn(Placement::Key(i), move |_| async move {
                            crate::reactor::yield_now().await;
                            c * 1000 + i
                        })
                    })
                    .collect();
                for (i, h) in handles.into_iter().enumerate() {
                    assert_eq!(block_on(h).unwrap(), c * 1000 + i as u64);
                }
            })
        })
        .collect();
    for c in callers {
        c.join().unwrap();
    }
}

#[test]
fn a_task_that_panics_fails_its_handle_only() {
    let p = pool(1);
    let h = p.spawn(Placement::Thread(0), |_| async {
        if true {
            panic!("task panic (expected by the test)");
        }
    });
    assert!(matches!(
        block_on(h),
        Err(PoolError::TaskFailed { index: 0 })
    ));
    assert_eq!(
        block_on(p.spawn(Placement::Thread(0), |_| async { 7 })).unwrap(),
        7
    );
}

#[test]
fn a_thread_that_dies_fails_its_handles_fast() {
    let p = pool(2);
    // A task that waits forever, answered never: the thread's death must
    // end its wait.
    let stuck = p.spawn(Placement::Thread(0), |_| std::future::pending::<()>());
    let boom = p.spawn(Placement::Thread(0), |_| -> std::future::Ready<()> {
        panic!("thread panic (expected by the test)")
    });
    let gone = |r: Result<(), PoolError>| {
        matches!(
            r,
            Err(PoolError::ThreadGone {
                index: 0,
                end: ThreadEnd::Panicked
            })
        )
    };
    let r = block_on(boom);
    assert!(gone(r), "the panicking job's handle fails with ThreadGone");
    let r = block_on(stuck);
    assert!(gone(r), "the waiting task's handle fails with ThreadGone");
    assert_eq!(p.threads()[0].end(), Some(ThreadEnd::Panicked));
    assert!(gone(block_on(p.spawn(Placement::Thread(0), |_| async {}))));
    // The other thread goes on.
    assert_eq!(
        block_on(p.spawn(Placement::Thread(1), |_| async { 1 })).unwrap(),
        1
    );
    assert_eq!(p.shutdown(), 1, "one thread had panicked");
}

#[test]
fn shutdown_is_graceful_and_later_calls_fail() {
    let p = pool(2);
    // A task that ends on the shutdown signal finishes within the grace
    // period and answers.
    let polite = p.spawn(Placement::Thread(1), |cx| {
        let signal = cx.shutdown_signal();
        async move {
            signal.await;
            "done"
        }
    });
    let stuck = p.spawn(Placement::Thread(0), |_| std::future::pending::<()>());
    let t0 = p.threads()[0].clone();
    assert_eq!(p.shutdown(), 0);
    assert_eq!(block_on(polite).unwrap(), "done");
    assert!(matches!(
        block_on(stuck),
        Err(PoolError::ThreadGone {
            index: 0,
            end: ThreadEnd::ShutDown
        })
    ));
    assert_eq!(t0.end(), Some(ThreadEnd::ShutDown));
    assert!(matches!(
        block_on(t0.spawn(|_| async {})),
        Err(PoolError::ThreadGone { .. })
    ));
    // Twice is fine.
    assert_eq!(p.shutdown(), 0);
}

#[test]
fn a_device_per_thread_is_bound_to_each_runtime() {
    use crate::provider::{Context as DevContext, SoftConfig};
    let p = Pool::builder()
        .threads(2)
        .device_per_thread(|_| DevContext::open_soft(SoftConfig::default()))
        .build()
        .unwrap();
    for i in 0..2 {
        let has = block_on(p.spawn(Placement::Thread(i), |cx| {
            let ok = cx.device().is_some();
            async move { ok }
        }))
        .unwrap();
        assert!(has);
    }
}

#[test]
fn bad_settings_are_refused() {
    assert!(matches!(
        Pool::builder().threads(0).build(),
        Err(PoolError::Config { .. })
    ));
    assert!(matches!(
        Pool::builder().threads(1).pin_to_cpus(vec![]).build(),
        Err(PoolError::Config { .. })
    ));
    // Pinning to CPU 0 works where the process may run there.
    Pool::builder().threads(1).pin_to_cpus(vec![0]).build().ok();
}

/// A waker that counts its wakes.
struct CountWakes(std::sync::atomic::AtomicUsize);

impl std::task::Wake for CountWakes {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// `answer` polled once with a counting waker (it must be pending).
fn registered(answer: &mut Answer<u32>) -> Arc<CountWakes> {
    let count = Arc::new(CountWakes(Default::default()));
    let waker = std::task::Waker::from(count.clone());
    let mut cx = std::task::Context::from_waker(&waker);
    assert!(std::future::Future::poll(std::pin::Pin::new(answer), &mut cx).is_pending());
    count
}

/// On a pool thread the answers completed in a pass wake their askers at
/// the end of the next pass, together; an answer completed as the thread's
/// loop ends (shutdown) still wakes its asker.
#[test]
fn answers_wake_their_askers_after_the_pass_all_at_once() {
    use std::sync::atomic::Ordering::SeqCst;
    let p = pool(1);
    let mut answers = Vec::new();
    let mut completers = Vec::new();
    let mut counts = Vec::new();
    for _ in 0..3 {
        let (c, mut a) = slot::<u32>();
        counts.push(registered(&mut a));
        answers.push(a);
        completers.push(c);
    }
    let seen = counts.clone();
    let h = p.spawn(Placement::Thread(0), move |_| async move {
        for (i, c) in completers.into_iter().enumerate() {
            c.complete(i as u32);
        }
        let in_pass: Vec<usize> = seen.iter().map(|c| c.0.load(SeqCst)).collect();
        // A later pass gives them (a yield may be polled again within
        // this pass: a timer needs the loop to go round).
        crate::reactor::sleep(Duration::from_millis(1)).await;
        let after: Vec<usize> = seen.iter().map(|c| c.0.load(SeqCst)).collect();
        (in_pass, after)
    });
    let (in_pass, after) = block_on(h).unwrap();
    assert_eq!(in_pass, [0, 0, 0], "woken in the middle of the pass");
    assert_eq!(after, [1, 1, 1], "not woken after the next pass");
    for (i, a) in answers.into_iter().enumerate() {
        assert_eq!(block_on(a), Ok(i as u32));
    }
    // Completed by the last job before the loop ends: given by `disable`.
    let (c, mut a) = slot::<u32>();
    let count = registered(&mut a);
    drop(p.spawn(Placement::Thread(0), move |_| {
        c.complete(7);
        async {}
    }));
    p.shutdown();
    assert_eq!(count.0.load(SeqCst), 1, "the last answer's wake was lost");
    assert_eq!(block_on(a), Ok(7));
    // Off a pool thread the wake is immediate.
    let (c, mut a) = slot::<u32>();
    let count = registered(&mut a);
    c.complete(1);
    assert_eq!(count.0.load(SeqCst), 1);
    assert_eq!(block_on(a), Ok(1));
}
