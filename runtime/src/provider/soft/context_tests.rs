//! The device's shared state (`context.rs`): the doorbell.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::super::drive::tests::pair;
use super::super::lock;

/// Posts made before a sleeping engine wakes (a window posted as many
/// lists) ring its doorbell with one system call: the first wakes it, the
/// others would only write the eventfd again. The engine cannot finish
/// waking while this test holds its lock, so every ring here falls in one
/// sleep; the next sleep is rung again.
#[test]
fn rings_before_the_engine_wakes_make_one_system_call() {
    let (a, _b) = pair();
    let sh = a.ctx.shared();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut sleeps_rung = 0;
    while sleeps_rung < 2 {
        assert!(
            Instant::now() < deadline,
            "the engine was seen asleep {sleeps_rung} times, not 2"
        );
        let eng = lock(a.ctx.core());
        if !sh.sleeping.load(Ordering::SeqCst) {
            drop(eng);
            std::thread::sleep(Duration::from_millis(1));
            continue;
        }
        // (Only the engine clears `rung`, under its lock; nothing else in
        // this test rings.)
        let rung_before = sh.rung.load(Ordering::SeqCst);
        let rings = sh.rings.load(Ordering::SeqCst);
        let wakes = sh.wakes.load(Ordering::SeqCst);
        for _ in 0..16 {
            sh.ring();
        }
        let calls = sh.rings.load(Ordering::SeqCst) - rings;
        assert_eq!(
            calls,
            u64::from(!rung_before),
            "16 rings in one sleep (rung before: {rung_before})"
        );
        drop(eng);
        // It wakes (for the ring, or sooner for something else).
        while sh.wakes.load(Ordering::SeqCst) == wakes {
            assert!(Instant::now() < deadline, "the rung engine never woke");
            std::thread::sleep(Duration::from_millis(1));
        }
        sleeps_rung += 1;
    }
}
