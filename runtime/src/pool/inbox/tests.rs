use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use super::*;

/// A waker that counts its wakes.
#[derive(Default)]
struct Count(AtomicUsize);

impl Wake for Count {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn counting() -> (Arc<Count>, Waker) {
    let c = Arc::new(Count::default());
    (c.clone(), Waker::from(c))
}

fn wakes(c: &Count) -> usize {
    c.0.load(Ordering::SeqCst)
}

#[test]
fn items_come_out_in_order_without_waiting() {
    let (feed, inbox) = inbox::<u32>(8, 1 << 20);
    for i in 0..5 {
        assert!(feed.push(i, 4));
    }
    assert_eq!(inbox.len(), 5);
    let (_, w) = counting();
    let mut cx = Context::from_waker(&w);
    let mut waiting = Waiting::default();
    for i in 0..5 {
        assert_eq!(inbox.poll_take(&mut cx, &mut waiting), Poll::Ready(Ok(i)));
    }
    assert!(inbox.is_empty());
    assert!(inbox.poll_take(&mut cx, &mut waiting).is_pending());
    inbox.cancel(&mut waiting);
}

#[test]
fn room_is_bounded_by_count_and_by_bytes() {
    let (feed, inbox) = inbox::<Vec<u8>>(3, 100);
    let (room, w) = counting();
    let mut cx = Context::from_waker(&w);
    // The first item always fits, whatever its size.
    assert!(feed.poll_room(&mut cx).is_ready());
    feed.push(vec![0; 500], 500);
    assert!(feed.poll_room(&mut cx).is_pending(), "over the byte budget");
    assert_eq!(inbox.try_take().map(|v| v.len()), Some(500));
    assert_eq!(wakes(&room), 1, "the take that made room woke the feeder");
    for _ in 0..3 {
        assert!(feed.poll_room(&mut cx).is_ready());
        feed.push(vec![1], 1);
    }
    assert!(feed.poll_room(&mut cx).is_pending(), "at the item capacity");
    inbox.try_take().unwrap();
    assert_eq!(wakes(&room), 2);
    assert!(feed.poll_room(&mut cx).is_ready());
}

#[test]
fn a_waiting_taker_is_woken_once_by_the_push_of_its_item() {
    let (feed, inbox) = inbox::<u32>(8, 1 << 20);
    let (a, wa) = counting();
    let (b, wb) = counting();
    let (mut first, mut second) = (Waiting::default(), Waiting::default());
    assert!(inbox
        .poll_take(&mut Context::from_waker(&wa), &mut first)
        .is_pending());
    assert!(inbox
        .poll_take(&mut Context::from_waker(&wb), &mut second)
        .is_pending());
    feed.push(7, 4);
    assert_eq!((wakes(&a), wakes(&b)), (1, 0), "the oldest waiter first");
    assert_eq!(
        inbox.poll_take(&mut Context::from_waker(&wa), &mut first),
        Poll::Ready(Ok(7))
    );
    feed.push(8, 4);
    assert_eq!((wakes(&a), wakes(&b)), (1, 1));
    assert_eq!(
        inbox.poll_take(&mut Context::from_waker(&wb), &mut second),
        Poll::Ready(Ok(8))
    );
}

#[test]
fn a_woken_taker_that_gives_up_passes_the_wake_on() {
    let (feed, inbox) = inbox::<u32>(8, 1 << 20);
    let (a, wa) = counting();
    let (b, wb) = counting();
    let (mut first, mut second) = (Waiting::default(), Waiting::default());
    assert!(inbox
        .poll_take(&mut Context::from_waker(&wa), &mut first)
        .is_pending());
    assert!(inbox
        .poll_take(&mut Context::from_waker(&wb), &mut second)
        .is_pending());
    feed.push(1, 4);
    assert_eq!(wakes(&a), 1);
    // Dropped before it took the item: the next in line is woken for it.
    inbox.cancel(&mut first);
    assert_eq!(wakes(&b), 1);
    assert_eq!(
        inbox.poll_take(&mut Context::from_waker(&wb), &mut second),
        Poll::Ready(Ok(1))
    );
    // A taker that gives up while still waiting wakes nobody.
    let (c, wc) = counting();
    let mut third = Waiting::default();
    assert!(inbox
        .poll_take(&mut Context::from_waker(&wc), &mut third)
        .is_pending());
    inbox.cancel(&mut third);
    feed.push(2, 4);
    assert_eq!(wakes(&c), 0);
    assert_eq!(inbox.try_take(), Some(2));
}

#[test]
fn a_taker_polled_again_keeps_its_place_in_a_long_line() {
    let (feed, inbox) = inbox::<u32>(16, 1 << 20);
    let counts: Vec<_> = (0..6).map(|_| counting()).collect();
    let mut places: Vec<Waiting> = (0..6).map(|_| Waiting::default()).collect();
    for ((_, w), place) in counts.iter().zip(places.iter_mut()) {
        assert!(inbox
            .poll_take(&mut Context::from_waker(w), place)
            .is_pending());
    }
    // Taker 3 polled again with another waker: the same place, the new
    // waker; taker 1 leaves from the middle of the line.
    let (moved, wm) = counting();
    assert!(inbox
        .poll_take(&mut Context::from_waker(&wm), &mut places[3])
        .is_pending());
    inbox.cancel(&mut places[1]);
    assert_eq!(inbox.shared.waiting.load(Ordering::SeqCst), 5);
    // Pushes wake 0, 2, 3 (through its new waker), 4, 5 in that order.
    for (n, expect) in [0usize, 2, 3, 4, 5].into_iter().enumerate() {
        feed.push(n as u32, 4);
        let woken: Vec<usize> = (0..6)
            .filter(|&i| i != 3 && wakes(&counts[i].0) == 1)
            .chain((wakes(&moved) == 1).then_some(3))
            .collect();
        assert!(woken.contains(&expect), "push {n} woke {woken:?}");
        assert_eq!(woken.len(), n + 1, "one wake per push");
    }
    assert_eq!(wakes(&counts[3].0), 0, "the replaced waker is not woken");
    assert_eq!(inbox.shared.waiting.load(Ordering::SeqCst), 0);
    // A woken taker takes without the line (its place is gone already).
    assert_eq!(
        inbox.poll_take(&mut Context::from_waker(&counts[0].1), &mut places[0]),
        Poll::Ready(Ok(0))
    );
}

#[test]
fn close_gives_what_is_queued_then_the_end_to_every_taker() {
    let (feed, inbox) = inbox::<u32>(8, 1 << 20);
    let (a, wa) = counting();
    let mut waiting = Waiting::default();
    let mut cx = Context::from_waker(&wa);
    assert!(inbox.poll_take(&mut cx, &mut waiting).is_pending());
    feed.push(5, 4);
    feed.close();
    assert!(wakes(&a) >= 1);
    assert_eq!(inbox.poll_take(&mut cx, &mut waiting), Poll::Ready(Ok(5)));
    assert_eq!(
        inbox.poll_take(&mut cx, &mut waiting),
        Poll::Ready(Err(InboxEnd::Closed))
    );
    assert_eq!(
        inbox.poll_take(&mut cx, &mut waiting),
        Poll::Ready(Err(InboxEnd::Closed)),
        "and again"
    );
}

#[test]
fn a_feeder_dropped_without_closing_ends_waiting_takers_with_lost() {
    let (feed, inbox) = inbox::<u32>(8, 1 << 20);
    let (a, wa) = counting();
    let mut waiting = Waiting::default();
    let mut cx = Context::from_waker(&wa);
    assert!(inbox.poll_take(&mut cx, &mut waiting).is_pending());
    std::thread::spawn(move || drop(feed)).join().unwrap();
    assert_eq!(wakes(&a), 1);
    assert_eq!(
        inbox.poll_take(&mut cx, &mut waiting),
        Poll::Ready(Err(InboxEnd::Lost))
    );
}

#[test]
fn items_cross_threads_to_many_takers_each_once() {
    const ITEMS: u64 = 20_000;
    let (feed, inbox) = inbox::<u64>(16, 1 << 20);
    let inbox = Arc::new(inbox);
    let takers: Vec<_> = (0..4)
        .map(|_| {
            let inbox = inbox.clone();
            std::thread::spawn(move || {
                let mut got = Vec::new();
                futures::executor::block_on(async {
                    let mut waiting = Waiting::default();
                    while let Ok(v) =
                        std::future::poll_fn(|cx| inbox.poll_take(cx, &mut waiting)).await
                    {
                        got.push(v);
                    }
                });
                got
            })
        })
        .collect();
    futures::executor::block_on(async {
        for i in 0..ITEMS {
            std::future::poll_fn(|cx| feed.poll_room(cx)).await;
            assert!(feed.push(i, 8));
        }
    });
    feed.close();
    let mut all: Vec<u64> = takers.into_iter().flat_map(|t| t.join().unwrap()).collect();
    all.sort_unstable();
    assert_eq!(all, (0..ITEMS).collect::<Vec<_>>(), "every item once");
}
