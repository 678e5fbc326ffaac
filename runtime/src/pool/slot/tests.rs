use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use super::*;

fn poll<T: Send>(a: &mut Answer<T>) -> Poll<Result<T, Lost>> {
    let waker = futures::task::noop_waker();
    Pin::new(a).poll(&mut Context::from_waker(&waker))
}

#[test]
fn an_answer_crosses_threads() {
    let (done, answer) = slot::<Vec<u8>>();
    let t = std::thread::spawn(move || done.complete(vec![1, 2, 3]));
    assert_eq!(futures::executor::block_on(answer), Ok(vec![1, 2, 3]));
    t.join().unwrap();
}

#[test]
fn a_completer_dropped_unanswered_reports_the_loss() {
    let (done, mut answer) = slot::<u32>();
    assert!(poll(&mut answer).is_pending());
    drop(done);
    assert_eq!(poll(&mut answer), Poll::Ready(Err(Lost)));
}

#[test]
fn a_completer_sees_its_answer_abandoned() {
    let (done, answer) = slot::<u32>();
    assert!(!done.is_abandoned());
    let waker = futures::task::noop_waker();
    let mut cx = Context::from_waker(&waker);
    assert!(done.poll_abandoned(&mut cx).is_pending());
    let t = std::thread::spawn(move || drop(answer));
    futures::executor::block_on(done.abandoned());
    t.join().unwrap();
    assert!(done.is_abandoned());
    done.complete(1);
}

struct Tracked(Arc<AtomicUsize>);

impl Drop for Tracked {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn an_answer_never_taken_is_dropped_once() {
    let drops = Arc::new(AtomicUsize::new(0));
    let (done, answer) = slot();
    done.complete(Tracked(drops.clone()));
    assert_eq!(drops.load(Ordering::SeqCst), 0);
    drop(answer);
    assert_eq!(drops.load(Ordering::SeqCst), 1);
    // Taken: dropped by its taker only.
    let (done, mut answer) = slot();
    done.complete(Tracked(drops.clone()));
    let Poll::Ready(Ok(v)) = poll(&mut answer) else {
        panic!("completed")
    };
    drop(answer);
    assert_eq!(drops.load(Ordering::SeqCst), 1);
    drop(v);
    assert_eq!(drops.load(Ordering::SeqCst), 2);
}

#[test]
fn the_cache_reuses_answered_slots_only() {
    let cache = SlotCache::<u32>::new(4);
    let (done, mut answer) = cache.pair();
    let first = Arc::as_ptr(answer.slot.as_ref().unwrap());
    done.complete(5);
    assert_eq!(poll(&mut answer), Poll::Ready(Ok(5)));
    cache.give_back(answer);
    let (done, answer) = cache.pair();
    assert_eq!(
        Arc::as_ptr(answer.slot.as_ref().unwrap()),
        first,
        "recycled"
    );
    // Still pending (its completer lives): not kept.
    cache.give_back(answer);
    let (_d2, a2) = cache.pair();
    assert_ne!(Arc::as_ptr(a2.slot.as_ref().unwrap()), first);
    // The recycled slot works like a new one.
    drop(done);
}

/// A waker counting its wakes.
struct CountWakes(AtomicUsize);

impl std::task::Wake for CountWakes {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn a_spin_is_bounded_and_a_later_answer_still_wakes() {
    let cache = SlotCache::<u32>::new(4).reply_spin(std::time::Duration::from_millis(20));
    let (done, mut answer) = cache.pair();
    let wakes = Arc::new(CountWakes(AtomicUsize::new(0)));
    let waker = std::task::Waker::from(wakes.clone());
    let mut cx = Context::from_waker(&waker);
    let start = std::time::Instant::now();
    // Nobody answers: the poll spins its budget, then parks.
    assert!(Pin::new(&mut answer).poll(&mut cx).is_pending());
    assert!(start.elapsed() >= std::time::Duration::from_millis(20));
    assert_eq!(wakes.0.load(Ordering::SeqCst), 0);
    // The answer coming later wakes the registered waker.
    std::thread::spawn(move || done.complete(7)).join().unwrap();
    assert_eq!(wakes.0.load(Ordering::SeqCst), 1);
    assert_eq!(Pin::new(&mut answer).poll(&mut cx), Poll::Ready(Ok(7)));
    cache.give_back(answer);
    // A recycled slot's answer spins too, and a loss ends the spin.
    let (done, mut answer) = cache.pair();
    let t = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(1));
        drop(done);
    });
    answer.spin_for(std::time::Duration::from_secs(60));
    // Spins until the completer's loss shows (not for 60 s).
    assert_eq!(Pin::new(&mut answer).poll(&mut cx), Poll::Ready(Err(Lost)));
    t.join().unwrap();
}

#[test]
fn a_spinning_poll_takes_an_answer_made_meanwhile_without_a_wake() {
    let (done, mut answer) = slot::<u32>();
    answer.spin_for(std::time::Duration::from_secs(60));
    let wakes = Arc::new(CountWakes(AtomicUsize::new(0)));
    let waker = std::task::Waker::from(wakes.clone());
    let t = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(1));
        done.complete(5);
    });
    let r = Pin::new(&mut answer).poll(&mut Context::from_waker(&waker));
    assert_eq!(r, Poll::Ready(Ok(5)));
    t.join().unwrap();
    // The waker was never registered while the poll spun.
    assert_eq!(wakes.0.load(Ordering::SeqCst), 0);
}

#[test]
fn no_spin_returns_pending_at_once() {
    let cache = SlotCache::<u32>::new(4);
    let (done, mut answer) = cache.pair();
    assert!(poll(&mut answer).is_pending());
    done.complete(3);
    assert_eq!(poll(&mut answer), Poll::Ready(Ok(3)));
}
