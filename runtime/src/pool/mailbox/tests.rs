use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use super::*;

/// A waker counting its wakes.
#[derive(Default)]
struct Count(AtomicUsize);

impl Wake for Count {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn counting() -> (Arc<Count>, Waker) {
    let c = Arc::new(Count::default());
    (c.clone(), Waker::from(c))
}

#[test]
fn a_burst_of_sends_wakes_the_receiver_once() {
    let (tx, rx) = mailbox::<u32>(256);
    let (count, waker) = counting();
    let mut cx = Context::from_waker(&waker);
    assert!(rx.poll_recv(&mut cx).is_pending());
    let senders: Vec<_> = (0..4)
        .map(|t| {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for i in 0..50 {
                    tx.try_send(t * 1000 + i).unwrap();
                }
            })
        })
        .collect();
    for s in senders {
        s.join().unwrap();
    }
    assert_eq!(count.0.load(Ordering::SeqCst), 1, "one wake for the burst");
    let mut got = Vec::new();
    while let Poll::Ready(Some(m)) = rx.poll_recv(&mut cx) {
        got.push(m);
    }
    got.sort_unstable();
    let mut want: Vec<u32> = (0..4)
        .flat_map(|t| (0..50).map(move |i| t * 1000 + i))
        .collect();
    want.sort_unstable();
    assert_eq!(got, want);
    // Drained and disarmed: the next send wakes again.
    tx.try_send(7).unwrap();
    assert_eq!(count.0.load(Ordering::SeqCst), 2);
}

#[test]
fn a_full_mailbox_makes_senders_wait_for_room() {
    let (tx, rx) = mailbox::<u32>(2);
    tx.try_send(1).unwrap();
    tx.try_send(2).unwrap();
    let full = tx.try_send(3).unwrap_err();
    assert!(full.to_string().contains("full"), "{full}");
    assert_eq!(full, SendError::Full(3));
    let (count, waker) = counting();
    let mut cx = Context::from_waker(&waker);
    let mut msg = Some(3);
    assert!(tx.poll_send(&mut cx, &mut msg).is_pending());
    assert_eq!(msg, Some(3), "the message stays with the sender");
    let (_, rwaker) = counting();
    let mut rcx = Context::from_waker(&rwaker);
    assert_eq!(rx.poll_recv(&mut rcx), Poll::Ready(Some(1)));
    assert_eq!(
        count.0.load(Ordering::SeqCst),
        1,
        "the take made room and woke the sender"
    );
    assert_eq!(tx.poll_send(&mut cx, &mut msg), Poll::Ready(Ok(())));
    assert_eq!(rx.poll_recv(&mut rcx), Poll::Ready(Some(2)));
    assert_eq!(rx.poll_recv(&mut rcx), Poll::Ready(Some(3)));
}

#[test]
fn closing_lets_the_receiver_drain_then_end() {
    let (tx, rx) = mailbox::<u32>(8);
    let (count, waker) = counting();
    let mut cx = Context::from_waker(&waker);
    tx.try_send(1).unwrap();
    tx.close();
    assert!(tx.is_closed());
    let refused = tx.try_send(2).unwrap_err();
    assert_eq!(refused, SendError::Closed(2));
    // A std error (e.g. for `?` into a boxed error), saying why.
    let e: Box<dyn std::error::Error> = Box::new(refused);
    assert!(e.to_string().contains("closed"), "{e}");
    assert_eq!(rx.poll_recv(&mut cx), Poll::Ready(Some(1)));
    assert_eq!(rx.poll_recv(&mut cx), Poll::Ready(None));
    // A receiver waiting when the close comes is woken.
    let (tx, rx) = mailbox::<u32>(8);
    assert!(rx.poll_recv(&mut cx).is_pending());
    let before = count.0.load(Ordering::SeqCst);
    tx.close();
    assert_eq!(count.0.load(Ordering::SeqCst), before + 1);
    assert_eq!(rx.poll_recv(&mut cx), Poll::Ready(None));
}

/// Counts its drops.
#[derive(Debug)]
struct Tracked(Arc<AtomicUsize>);

impl Drop for Tracked {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn dropping_the_receiver_drops_queued_messages_and_fails_senders() {
    let drops = Arc::new(AtomicUsize::new(0));
    let (tx, rx) = mailbox::<Tracked>(1);
    tx.try_send(Tracked(drops.clone())).unwrap();
    // A sender waiting for room.
    let (count, waker) = counting();
    let mut cx = Context::from_waker(&waker);
    let mut msg = Some(Tracked(drops.clone()));
    assert!(tx.poll_send(&mut cx, &mut msg).is_pending());
    drop(rx);
    assert_eq!(
        drops.load(Ordering::SeqCst),
        1,
        "the queued message is dropped"
    );
    assert_eq!(
        count.0.load(Ordering::SeqCst),
        1,
        "the waiting sender is woken"
    );
    assert!(tx.is_closed());
    match tx.poll_send(&mut cx, &mut msg) {
        Poll::Ready(Err(m)) => drop(m),
        other => panic!("expected the message back, got {:?}", other.is_ready()),
    }
    assert_eq!(drops.load(Ordering::SeqCst), 2);
}

#[test]
fn the_last_sender_gone_wakes_a_waiting_receiver() {
    let (tx, rx) = mailbox::<u32>(4);
    let tx2 = tx.clone();
    let (count, waker) = counting();
    let mut cx = Context::from_waker(&waker);
    assert!(rx.poll_recv(&mut cx).is_pending());
    tx.try_send(1).unwrap();
    assert_eq!(rx.poll_recv(&mut cx), Poll::Ready(Some(1)));
    assert!(
        rx.poll_recv(&mut cx).is_pending(),
        "waiting, the queue seen empty"
    );
    let woken = count.0.load(Ordering::SeqCst);
    tx2.try_send(2).unwrap();
    drop(tx);
    drop(tx2);
    assert!(
        count.0.load(Ordering::SeqCst) > woken,
        "no wake for the senders' end"
    );
    assert_eq!(
        rx.poll_recv(&mut cx),
        Poll::Ready(Some(2)),
        "queued before the end"
    );
    assert_eq!(rx.poll_recv(&mut cx), Poll::Ready(None));
    // On another thread: the receiver is woken, not left waiting.
    let (tx, rx) = mailbox::<u32>(4);
    let (count, waker) = counting();
    let mut cx = Context::from_waker(&waker);
    assert!(rx.poll_recv(&mut cx).is_pending());
    std::thread::spawn(move || drop(tx)).join().unwrap();
    assert_eq!(count.0.load(Ordering::SeqCst), 1);
    assert_eq!(rx.poll_recv(&mut cx), Poll::Ready(None));
}

#[test]
fn every_sender_gone_ends_the_receiver() {
    let (tx, rx) = mailbox::<u32>(4);
    let (_, waker) = counting();
    let mut cx = Context::from_waker(&waker);
    drop(tx);
    assert_eq!(rx.poll_recv(&mut cx), Poll::Ready(None));
}
