use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use super::{current, hand, ring};
use crate::pool::slot;

/// Wakers handed to a relay, by every test of the process (they run in
/// parallel: a test checks that the count grew by at least its own).
pub(super) static HANDED: AtomicUsize = AtomicUsize::new(0);

/// Bound of every wait here.
const WAIT: Duration = Duration::from_secs(20);

fn multi_thread(io: bool) -> tokio::runtime::Runtime {
    let mut b = tokio::runtime::Builder::new_multi_thread();
    b.worker_threads(2);
    if io {
        b.enable_io().enable_time();
    }
    b.build().expect("a tokio runtime")
}

/// Counts its wakes.
struct Counting(AtomicUsize);

impl Wake for Counting {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// A future that says (once) when it was first polled and found nothing.
struct Announce<F> {
    inner: Pin<Box<F>>,
    told: Option<mpsc::Sender<()>>,
}

impl<F: Future> Future for Announce<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let r = self.inner.as_mut().poll(cx);
        if r.is_pending() {
            if let Some(t) = self.told.take() {
                let _ = t.send(());
            }
        }
        r
    }
}

#[test]
fn answers_reach_multi_thread_tokio_tasks_through_the_relay() {
    let rt = multi_thread(true);
    let before = HANDED.load(Ordering::SeqCst);
    const ANSWERS: usize = 50;
    for i in 0..ANSWERS {
        let (done, answer) = slot::slot::<usize>();
        let (told, polled) = mpsc::channel();
        let task = rt.spawn(Announce {
            inner: Box::pin(answer),
            told: Some(told),
        });
        polled
            .recv_timeout(WAIT)
            .expect("the task waits for its answer");
        // Completed from a thread that is not tokio's: the wake goes
        // through the runtime's relay.
        std::thread::spawn(move || done.complete(i)).join().unwrap();
        let got = rt
            .block_on(async { tokio::time::timeout(WAIT, task).await })
            .expect("the answer comes within the bound")
            .expect("the task ends");
        assert_eq!(got, Ok(i));
    }
    assert!(
        HANDED.load(Ordering::SeqCst) - before >= ANSWERS,
        "every wake went through the relay"
    );
}

#[test]
fn a_relay_is_made_only_for_a_multi_thread_runtime_with_io() {
    let with_io = multi_thread(true);
    let r = with_io.block_on(async { with_io.spawn(async { current().is_some() }).await });
    assert!(r.unwrap(), "a worker of a multi-thread runtime has a relay");
    assert!(
        with_io.block_on(async { current().is_none() }),
        "a block_on thread is no worker: woken directly"
    );
    let without_io = multi_thread(false);
    // (tokio prints the panic it raises here, which the relay catches.)
    let r = without_io.block_on(async { without_io.spawn(async { current().is_some() }).await });
    assert!(!r.unwrap(), "no I/O driver: no relay, and no panic");
    let local = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .unwrap();
    assert!(local.block_on(async { current().is_none() }));
    assert!(current().is_none(), "not in a tokio runtime");
}

#[test]
fn a_relay_whose_runtime_ends_wakes_what_it_holds_and_later_wakes_directly() {
    let rt = multi_thread(true);
    let relay = rt
        .block_on(async { rt.spawn(async { current() }).await })
        .unwrap()
        .expect("a relay");
    let held = Arc::new(Counting(AtomicUsize::new(0)));
    // Handed, not rung: the relay holds it.
    hand(relay, Waker::from(held.clone()));
    assert_eq!(held.0.load(Ordering::SeqCst), 0);
    drop(rt);
    assert_eq!(
        held.0.load(Ordering::SeqCst),
        1,
        "the relay's end woke what it held"
    );
    let later = Arc::new(Counting(AtomicUsize::new(0)));
    // The relay is dead (or, reused meanwhile by another test's runtime,
    // alive again: then rung, its task wakes it).
    if hand(relay, Waker::from(later.clone())) {
        ring(relay);
    }
    let start = std::time::Instant::now();
    while later.0.load(Ordering::SeqCst) == 0 {
        assert!(
            start.elapsed() < WAIT,
            "a wake handed to a dead relay was lost"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Says whether it was woken outside the relay task's poll.
struct WhereWoken(mpsc::Sender<bool>);

impl Wake for WhereWoken {
    fn wake(self: Arc<Self>) {
        let _ = self.0.send(!super::imp::IN_TASK.with(std::cell::Cell::get));
    }
}

#[test]
fn the_relay_wakes_its_askers_from_tokios_reactor() {
    let rt = multi_thread(true);
    let relay = rt
        .block_on(async { rt.spawn(async { current() }).await })
        .unwrap()
        .expect("a relay");
    // The relay task waits for its eventfd, its waker registered.
    let start = std::time::Instant::now();
    while !relay.idle.load(Ordering::SeqCst) {
        assert!(
            start.elapsed() < WAIT,
            "the relay task went idle (waited {WAIT:?})"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let (tx, rx) = mpsc::channel();
    const BURST: usize = 8;
    for i in 0..BURST {
        assert_eq!(
            hand(relay, Waker::from(Arc::new(WhereWoken(tx.clone())))),
            i == 0,
            "rung once per burst"
        );
    }
    ring(relay);
    for _ in 0..BURST {
        let outside_task = rx.recv_timeout(WAIT).expect("the relay wakes every asker");
        // From the reactor's dispatch (a parked worker: tokio unparks at
        // most one other worker for the lot), not from a task's poll
        // (where each wake that displaces another may unpark one).
        assert!(
            outside_task,
            "woken from tokio's reactor, not from the relay task"
        );
    }
}
