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
