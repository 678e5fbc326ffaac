//! Where a [`register`](super::Rpc::register)ed handler's future runs: a
//! slot of its own per handler task, allocated once. The dispatcher
//! starts a request's future in an idle task's slot and polls it once
//! with that task's waker: a future that is ready at once (most handlers)
//! is answered with no task run at all; one that waits stays in the slot,
//! and what it waits for wakes the task, which polls it on to the end.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::task::{Context, Poll};

use super::buf::MsgBuf;
use super::request::Request;

/// The request a handler future works on: its session, slot and request
/// number (what [`Core::respond`](super::engine::Core::respond) needs).
#[derive(Clone, Copy, Debug)]
pub(crate) struct JobId {
    pub(crate) session: u32,
    pub(crate) slot: usize,
    pub(crate) req_num: u64,
}

/// A handler future's outcome: its response, or `Err` if the handler or
/// its future panicked.
pub(crate) type Outcome = Result<MsgBuf, ()>;

/// A handler task's future slot, its handler's type erased.
pub(crate) trait Runner {
    /// Calls the handler on `request` and polls its future once with `cx`
    /// (the task's waker). The slot must be empty: after `Ready` it is
    /// again; after `Pending` the future stays for [`resume`](Runner::resume).
    fn start(&self, request: Request, cx: &mut Context<'_>) -> Poll<Outcome>;

    /// Polls the future [`start`](Runner::start) left waiting.
    fn resume(&self, cx: &mut Context<'_>) -> Poll<Outcome>;

    /// The request of the future left waiting by the dispatcher, for the
    /// task to take over (set by the dispatcher, taken by the task).
    fn waiting(&self) -> &Cell<Option<JobId>>;
}

/// The slot of a handler `H` whose futures are `F`.
pub(crate) struct HandlerRunner<H, F> {
    handler: std::rc::Rc<H>,
    /// Pinned in its box, allocated once: a future polled here is never
    /// moved. Borrowed only while it is polled or replaced, never across
    /// either (a handler cannot reach its own slot).
    fut: RefCell<Pin<Box<Option<F>>>>,
    waiting: Cell<Option<JobId>>,
}

impl<H, F> HandlerRunner<H, F>
where
    H: Fn(Request) -> F,
    F: Future<Output = MsgBuf>,
{
    /// An empty slot for `handler`'s futures.
    pub(crate) fn new(handler: std::rc::Rc<H>) -> Self {
        HandlerRunner {
            handler,
            fut: RefCell::new(Box::pin(None)),
            waiting: Cell::new(None),
        }
    }

    /// Polls the future in the slot; empties the slot once it is done or
    /// panicked.
    fn poll_slot(&self, cx: &mut Context<'_>) -> Poll<Outcome> {
        let mut slot = self.fut.borrow_mut();
        let Some(fut) = slot.as_mut().as_pin_mut() else {
            // Not reachable: the engine resumes only a future it left
            // waiting; an empty slot answers as a panicked handler would.
            return Poll::Ready(Err(()));
        };
        let out = match catch_unwind(AssertUnwindSafe(|| fut.poll(cx))) {
            Ok(Poll::Pending) => return Poll::Pending,
            Ok(Poll::Ready(resp)) => Ok(resp),
            Err(_) => Err(()),
        };
        // A panicking drop fails this call only, as the panic above would.
        let _ = catch_unwind(AssertUnwindSafe(|| slot.as_mut().set(None)));
        Poll::Ready(out)
    }
}

impl<H, F> Runner for HandlerRunner<H, F>
where
    H: Fn(Request) -> F,
    F: Future<Output = MsgBuf>,
{
    fn start(&self, request: Request, cx: &mut Context<'_>) -> Poll<Outcome> {
        // A panicking handler fails its call, not the task or the
        // dispatcher; the handler and the first poll of its future are
        // caught together (one unwind guard per request).
        let mut slot = self.fut.borrow_mut();
        let polled = catch_unwind(AssertUnwindSafe(|| {
            let fut = (self.handler)(request);
            slot.as_mut().set(Some(fut));
            match slot.as_mut().as_pin_mut() {
                Some(fut) => fut.poll(cx),
                // Not reachable: set just now.
                None => Poll::Pending,
            }
        }));
        let out = match polled {
            Ok(Poll::Pending) if slot.is_some() => return Poll::Pending,
            Ok(Poll::Pending) => Err(()),
            Ok(Poll::Ready(resp)) => Ok(resp),
            Err(_) => Err(()),
        };
        // A panicking drop fails this call only, as the panic above would.
        if slot.is_some() {
            let _ = catch_unwind(AssertUnwindSafe(|| slot.as_mut().set(None)));
        }
        Poll::Ready(out)
    }

    fn resume(&self, cx: &mut Context<'_>) -> Poll<Outcome> {
        self.poll_slot(cx)
    }

    fn waiting(&self) -> &Cell<Option<JobId>> {
        &self.waiting
    }
}
