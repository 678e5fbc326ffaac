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
