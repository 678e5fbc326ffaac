//! A spawned task's future: the user's future, the catch of its panic, and
//! the hand-over of its output to the [`JoinHandle`].

use std::any::Any;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

use pin_project::pin_project;

use super::join::JoinState;
#[allow(unused_imports)]
use super::JoinHandle;

/// A spawned task's future: polls the user's future until it is done or
/// the task is aborted, then hands the output to the [`JoinHandle`].
#[pin_project]
pub(super) struct TaskFuture<F: Future> {
    /// Polled in place, dropped with the task (which is removed right after
    /// its last poll). Declared first: dropped before `st` tells the handle.
    #[pin]
    pub(super) fut: F,
    pub(super) st: Settle<F::Output>,
    /// The task's waker: it is always polled with this one ([`Run::run`]).
    pub(super) waker: Waker,
}

/// A task as the executor runs it: polled with its own waker.
pub(super) trait Run {
    /// Polls the task once.
    fn run(self: Pin<&mut Self>) -> Poll<()>;
}

impl<F: Future> Run for TaskFuture<F> {
    #[inline]
    fn run(self: Pin<&mut Self>) -> Poll<()> {
        let this = self.project();
        let mut cx = Context::from_waker(this.waker);
        poll_task(this.fut, this.st, &mut cx)
    }
}

/// The task's side of its [`JoinState`]. Dropped with the task: if the
/// task never finished (the runtime shut down with it pending), it marks
/// the state finished without a value and wakes the handle's waiter, which
/// would otherwise wait forever (e.g. a task of another executor awaiting
/// the handle).
pub(super) struct Settle<T>(pub(super) Rc<JoinState<T>>);

impl<T> Drop for Settle<T> {
    fn drop(&mut self) {
        if self.0.finished.replace(true) {
            return;
        }
        let w = self.0.waker.borrow_mut().take();
        if let Some(w) = w {
            w.wake();
        }
    }
}

/// Polls the user's future `fut` of a task once; once it is done
/// (or the task was aborted), hands its output to the handle through `st`.
/// Inlined into [`Run::run`]: one call per task poll, the executor's.
#[inline(always)]
fn poll_task<F: Future>(
    fut: Pin<&mut F>,
    st: &Settle<F::Output>,
    cx: &mut Context<'_>,
) -> Poll<()> {
    // Never polled again once `Ready`: the executor removes the task right
    // after that poll (and a nested turn never polls a running task).
    let st = &st.0;
    let out = if st.aborted.get() {
        None
    } else {
        // After a panic the future is never polled again (the task is
        // `Ready`, see above).
        // Unwind safety: after a panic the future is only dropped (with
        // the task, right after this poll), never polled again, and the
        // runtime holds no borrow while a task runs.
        match catch_unwind(AssertUnwindSafe(|| fut.poll(cx))) {
            Ok(Poll::Pending) => return Poll::Pending,
            Ok(Poll::Ready(v)) => Some(Ok(v)),
            Err(payload) => Some(Err(payload)),
        }
    };
    match out {
        Some(Ok(v)) => *st.value.borrow_mut() = Some(v),
        Some(Err(payload)) => {
            tracing::error!(
                panic = panic_message(&*payload),
                "a spawned task panicked; the task ended, the runtime goes on"
            );
            *st.panic.borrow_mut() = Some(payload);
        }
        None => {}
    }
    st.finished.set(true);
    let w = st.waker.borrow_mut().take();
    if let Some(w) = w {
        w.wake();
    }
    Poll::Ready(())
}

/// The text of a panic payload (`&str` or `String`), else a placeholder.
pub(super) fn panic_message(payload: &(dyn Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(a non-string panic payload)")
}
