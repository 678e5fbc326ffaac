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
