//! Helpers of the `Pool` tests (tokio side).

use verbio::runtime::{Placement, Pool};

use super::WAIT;

/// Blocks runtime thread 0 of `pool` until the returned sender sends
/// `true` (it then goes on) or `false` (it panics: the thread dies), or
/// [`WAIT`] passes (it panics too).
pub async fn block_thread(pool: &Pool) -> std::sync::mpsc::Sender<bool> {
    let (go, wait) = std::sync::mpsc::channel::<bool>();
    let (blocked, is_blocked) = tokio::sync::oneshot::channel::<()>();
    // Blocked (and panicking) in the closure, which runs on the thread
    // itself: a panicking task would be caught by its runtime.
    // (Its join handle is dropped: the job runs detached.)
    drop(pool.spawn(Placement::Thread(0), move |_| {
        let _ = blocked.send(());
        if !wait.recv_timeout(WAIT).unwrap_or(false) {
            panic!("runtime thread panic (expected by the test)");
        }
        std::future::ready(())
    }));
    tokio::time::timeout(WAIT, is_blocked)
        .await
        .expect("the runtime thread blocks")
        .unwrap();
    go
}
