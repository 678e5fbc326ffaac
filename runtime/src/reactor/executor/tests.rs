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

/// Tasks that log their polls and, when polled, wake the tasks their
/// script names for that poll (in order).
struct Scripted {
    log: Rc<RefCell<Vec<&'static str>>>,
    script: Rc<RefCell<Script>>,
    wakers: Rc<RefCell<Vec<(&'static str, Waker)>>>,
}

/// Per task, the tasks it wakes at its next poll.
type Script = Vec<(&'static str, Vec<&'static str>)>;

impl Scripted {
    fn new(rt: &Runtime, names: &[&'static str]) -> Scripted {
        let s = Scripted {
            log: Rc::default(),
            script: Rc::default(),
            wakers: Rc::default(),
        };
        for &name in names {
            let (log, script, wakers) = (s.log.clone(), s.script.clone(), s.wakers.clone());
            rt.spawn(std::future::poll_fn(move |cx| {
                log.borrow_mut().push(name);
                if !wakers.borrow().iter().any(|(n, _)| *n == name) {
                    wakers.borrow_mut().push((name, cx.waker().clone()));
                }
                let wakes = {
                    let mut script = script.borrow_mut();
                    match script.iter().position(|(n, _)| *n == name) {
                        Some(k) => script.remove(k).1,
                        None => Vec::new(),
                    }
                };
                for w in wakes {
                    s_wake(&wakers, w);
                }
                Poll::<()>::Pending
            }));
        }
        settle(rt);
        s.log.borrow_mut().clear();
        s
    }

    /// Runs the script: a wake of `x` made outside any task, and `x`
    /// wakes the tasks in `first` (so that they run in the executor's
    /// chain of same-thread wakes, where the next-task slot opens); returns
    /// the polls after `x`'s, in order.
    fn run(
        &self,
        rt: &Runtime,
        first: &[&'static str],
        script: &[(&'static str, &[&'static str])],
    ) -> Vec<&'static str> {
        let mut all: Vec<_> = script.iter().map(|(n, w)| (*n, w.to_vec())).collect();
        all.push(("x", first.to_vec()));
        *self.script.borrow_mut() = all;
        s_wake(&self.wakers, "x");
        settle(rt);
        let log = std::mem::take(&mut *self.log.borrow_mut());
        assert_eq!(log.first(), Some(&"x"));
        log[1..].to_vec()
    }
}

fn s_wake(wakers: &RefCell<Vec<(&'static str, Waker)>>, name: &str) {
    let w = wakers
        .borrow()
        .iter()
        .find(|(n, _)| *n == name)
        .unwrap()
        .1
        .clone();
    w.wake();
}

#[test]
fn same_thread_wakes_run_in_the_order_they_were_made() {
    let rt = Runtime::new().unwrap();
    let s = Scripted::new(&rt, &["x", "a", "b", "c", "d"]);
    // A wakes B (into the next-task slot) then C (queued); B, polled
    // next, wakes D: D goes behind C (the slot opens only with the queue
    // empty), not ahead of it.
    assert_eq!(
        s.run(&rt, &["a"], &[("a", &["b", "c"]), ("b", &["d"])]),
        ["a", "b", "c", "d"]
    );
    // A chain through the slot: each task wakes the next.
    assert_eq!(
        s.run(&rt, &["a"], &[("a", &["b"]), ("b", &["c"]), ("c", &["d"])]),
        ["a", "b", "c", "d"]
    );
    // A task that wakes itself first is polled again at once (its wake is
    // the oldest), one that wakes itself after another after that one.
    assert_eq!(s.run(&rt, &["a"], &[("a", &["a", "b"])]), ["a", "a", "b"]);
    assert_eq!(s.run(&rt, &["a"], &[("a", &["b", "a"])]), ["a", "b", "a"]);
    // Two woken at once: A's wake of itself queues behind B.
    assert_eq!(s.run(&rt, &["a", "b"], &[("a", &["a"])]), ["a", "b", "a"]);
}

/// With the tokio feature: a runtime turned by a task of another one on
/// the same thread (`compat::hosted::enter`, as the pool's hosted
/// runtimes are).
#[cfg(feature = "tokio")]
#[test]
fn a_task_turning_another_runtime_keeps_each_runtimes_wakes_its_own() {
    use crate::compat::hosted::enter;
    // Task T of runtime 1 wakes its sibling (into runtime 1's next-task
    // slot), then turns runtime 2 entered on this thread, whose task wakes
    // its own sibling (into runtime 2's slot, opened over runtime 1's):
    // each sibling is polled by its own runtime, once.
    let rt1 = Runtime::new().unwrap();
    let rt2 = Rc::new({
        let _entered = enter(None);
        Runtime::new().unwrap()
    });
    let (polls1, waker1) = counted(&rt1);
    let (polls2, waker2) = {
        let _entered = enter(Some(rt2.handle()));
        let c = counted(&rt2);
        settle(&rt2);
        c
    };
    settle(&rt1);
    let (w1, w2) = (
        waker1.borrow().clone().unwrap(),
        waker2.borrow().clone().unwrap(),
    );
    let woke2 = Rc::new(Cell::new(false));
    {
        let _entered = enter(Some(rt2.handle()));
        let w = woke2.clone();
        rt2.spawn(std::future::poll_fn(move |_| {
            w2.wake_by_ref();
            w.set(true);
            Poll::<()>::Ready(())
        }));
    }
    let r2 = rt2.clone();
    let mut first = true;
    let done = rt1.spawn(std::future::poll_fn(move |cx| {
        if std::mem::take(&mut first) {
            // Polled again in the chain of same-thread wakes, where the
            // slot opens (a task's first poll is in a batch, where not).
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        w1.wake_by_ref();
        let _entered = enter(Some(r2.handle()));
        while r2.turn().ready {}
        Poll::Ready(())
    }));
    settle(&rt1);
    assert!(done.is_finished());
    assert!(woke2.get(), "runtime 2's task ran in the nested turn");
    assert_eq!(polls2.get(), 2, "runtime 2's sibling polled once more");
    assert_eq!(polls1.get(), 2, "runtime 1's sibling polled once more");
    settle(&rt1);
    {
        let _entered = enter(Some(rt2.handle()));
        settle(&rt2);
    }
    assert_eq!((polls1.get(), polls2.get()), (2, 2), "no spurious polls");
}

#[test]
fn the_next_task_slot_counts_against_the_budget_and_keeps_its_task() {
    // A chain X, A, B, C, D (each wakes the next) under a budget of 3 per
    // turn: the first turn polls X, A, B and leaves C (in the slot when
    // the budget ran out) for the next, which polls C and D.
    let rt = Runtime::builder().task_budget(3).build().unwrap();
    let s = Scripted::new(&rt, &["x", "a", "b", "c", "d"]);
    *s.script.borrow_mut() = vec![
        ("x", vec!["a"]),
        ("a", vec!["b"]),
        ("b", vec!["c"]),
        ("c", vec!["d"]),
    ];
    s_wake(&s.wakers, "x");
    let turn = rt.turn();
    assert_eq!(*s.log.borrow(), ["x", "a", "b"]);
    assert!(turn.ready, "the slot's task is left ready");
    rt.turn();
    assert_eq!(*s.log.borrow(), ["x", "a", "b", "c", "d"]);
}
