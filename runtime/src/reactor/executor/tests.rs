//! The executor: spawning, wakes from every thread, panics and joins.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::task::{Poll, Waker};

use crate::reactor::Runtime;
use crate::testing::settle;

/// A task that counts its polls and hands out its waker.
fn counted(rt: &Runtime) -> (Rc<Cell<u32>>, Rc<RefCell<Option<Waker>>>) {
    let polls = Rc::new(Cell::new(0));
    let waker = Rc::new(RefCell::new(None));
    let (p, w) = (polls.clone(), waker.clone());
    rt.spawn(std::future::poll_fn(move |cx| {
        p.set(p.get() + 1);
        *w.borrow_mut() = Some(cx.waker().clone());
        Poll::<()>::Pending
    }));
    (polls, waker)
}

#[test]
fn same_thread_wakes_of_a_queued_task_poll_it_once() {
    let rt = Runtime::new().unwrap();
    let (polls, waker) = counted(&rt);
    settle(&rt);
    assert_eq!(polls.get(), 1);
    let w = waker.borrow().clone().unwrap();
    assert!(crate::wake::is_task_waker(&w));
    w.wake_by_ref();
    w.wake_by_ref();
    // A clone woken by value (the vtable's clone and wake).
    let owned = w.clone();
    owned.wake();
    settle(&rt);
    assert_eq!(polls.get(), 2, "three wakes before the poll: one poll");
    w.wake();
    settle(&rt);
    assert_eq!(polls.get(), 3, "a wake after the poll polls again");
}

#[test]
fn a_finished_task_hands_over_its_output_and_drops_its_future() {
    let rt = Runtime::new().unwrap();
    let held = Rc::new(());
    let h = held.clone();
    let gate = Rc::new(Cell::new(false));
    let g = gate.clone();
    let join = rt.spawn(async move {
        let _h = h;
        std::future::poll_fn(|cx| {
            if g.get() {
                Poll::Ready(())
            } else {
                cx.waker().wake_by_ref();
                Poll::Pending
            }
        })
        .await;
        7u32
    });
    settle(&rt);
    assert!(!join.is_finished());
    assert_eq!(Rc::strong_count(&held), 2, "the running task holds it");
    gate.set(true);
    settle(&rt);
    assert!(join.is_finished());
    assert_eq!(
        Rc::strong_count(&held),
        1,
        "the finished task's future is dropped"
    );
    assert_eq!(rt.block_on(join), 7);
    assert_eq!(rt.task_count(), 0);
}

#[test]
fn cross_thread_wakes_of_a_queued_task_poll_it_once() {
    let rt = Runtime::new().unwrap();
    let (polls, waker) = counted(&rt);
    settle(&rt);
    let w = waker.borrow().clone().unwrap();
    let w2 = w.clone();
    std::thread::spawn(move || {
        w2.wake_by_ref();
        w2.wake();
    })
    .join()
    .unwrap();
    w.wake_by_ref();
    settle(&rt);
    assert_eq!(
        polls.get(),
        2,
        "wakes from both threads before the poll: one poll"
    );
}

#[test]
fn a_task_that_turns_the_runtime_is_not_polled_inside_itself() {
    let rt = Rc::new(Runtime::new().unwrap());
    let depth = Rc::new(Cell::new(0u32));
    let nested_polls = Rc::new(Cell::new(0u32));
    let spawned_ran = Rc::new(Cell::new(0u32));
    let (d, n, ran) = (depth.clone(), nested_polls.clone(), spawned_ran.clone());
    let mut inner = Some(rt.clone());
    let join = rt.spawn(std::future::poll_fn(move |cx| {
        d.set(d.get() + 1);
        if d.get() > 1 {
            n.set(n.get() + 1);
        }
        let done = if let Some(rt) = inner.take() {
            // Queued again while running, and the slab grows past its
            // first allocation while this task's future is being polled.
            cx.waker().wake_by_ref();
            for _ in 0..100 {
                let ran = ran.clone();
                rt.spawn(async move { ran.set(ran.get() + 1) });
            }
            rt.turn();
            false
        } else {
            true
        };
        d.set(d.get() - 1);
        if done {
            Poll::Ready(5u8)
        } else {
            Poll::Pending
        }
    }));
    settle(&rt);
    assert_eq!(nested_polls.get(), 0, "never polled inside its own poll");
    assert_eq!(spawned_ran.get(), 100, "the nested turn ran the new tasks");
    // Its own wake, taken by the nested turn, is not lost: polled again.
    assert!(join.is_finished(), "the task's own wake was lost");
    assert_eq!(rt.block_on(join), 5);
}
