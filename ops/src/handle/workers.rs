//! [`Workers`]: a queue of requests on a runtime thread and the local
//! tasks that serve it, started as demand grows (up to a maximum) and
//! reused, so that a request costs no task of its own.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::Future;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

/// Serves one request (on the runtime thread).
pub(super) trait Serve<R> {
    /// Runs `req` to its end; its data stays in this future meanwhile.
    fn serve(self: &Rc<Self>, req: R) -> impl Future<Output = ()>;
}

/// A queue of requests and its workers.
pub(super) struct Workers<R> {
    work: RefCell<VecDeque<R>>,
    /// Wakers of workers waiting for work.
    idle: RefCell<Vec<Waker>>,
    running: Cell<usize>,
    max: usize,
    closed: Cell<bool>,
}

impl<R: 'static> Workers<R> {
    pub(super) fn new(max: usize) -> Workers<R> {
        Workers {
            work: RefCell::new(VecDeque::new()),
            idle: RefCell::new(Vec::new()),
            running: Cell::new(0),
            max: max.max(1),
            closed: Cell::new(false),
        }
    }

    pub(super) fn push(&self, req: R) {
        self.work.borrow_mut().push_back(req);
    }

    /// Wakes idle workers for the queued requests, and starts more (up to
    /// the maximum) if there are not enough, serving with `server`.
    pub(super) fn kick<S: Serve<R> + 'static>(self: &Rc<Self>, server: &Rc<S>) {
        let queued = self.work.borrow().len();
        if queued == 0 {
            return;
        }
        // Woken one at a time, with no borrow held (and no list built).
        let mut n = 0;
        while n < queued {
            let Some(w) = self.idle.borrow_mut().pop() else {
                break;
            };
            w.wake();
            n += 1;
        }
        let more = (queued - n).min(self.max - self.running.get());
        for _ in 0..more {
            self.running.set(self.running.get() + 1);
            verbio_runtime::spawn(work_loop(self.clone(), server.clone()));
        }
    }

    /// No more requests: the workers serve what is queued and end.
    pub(super) fn close(&self) {
        self.closed.set(true);
        for w in std::mem::take(&mut *self.idle.borrow_mut()) {
            w.wake();
        }
    }

    fn poll_next(&self, cx: &mut Context<'_>) -> Poll<Option<R>> {
        if let Some(r) = self.work.borrow_mut().pop_front() {
            return Poll::Ready(Some(r));
        }
        if self.closed.get() {
            return Poll::Ready(None);
        }
        let mut idle = self.idle.borrow_mut();
        if !idle.iter().any(|w| w.will_wake(cx.waker())) {
            idle.push(cx.waker().clone());
        }
        Poll::Pending
    }
}

async fn work_loop<R: 'static, S: Serve<R>>(workers: Rc<Workers<R>>, server: Rc<S>) {
    while let Some(req) = std::future::poll_fn(|cx| workers.poll_next(cx)).await {
        server.serve(req).await;
    }
    workers.running.set(workers.running.get() - 1);
}
