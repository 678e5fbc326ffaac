//! [`JoinHandle`] and its fallible forms: a spawned task's output as a
//! future.

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::future::Future;
use std::panic::resume_unwind;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::{Mutex, PoisonError};
use std::task::{Context, Poll, Waker};

use super::task::panic_message;

pub(super) struct JoinState<T> {
    pub(super) value: RefCell<Option<T>>,
    /// The payload of the task's panic, until the handle takes it.
    pub(super) panic: RefCell<Option<Box<dyn Any + Send>>>,
    pub(super) waker: RefCell<Option<Waker>>,
    pub(super) finished: Cell<bool>,
    pub(super) aborted: Cell<bool>,
    /// The task's own waker, for `abort`.
    pub(super) task: RefCell<Option<Waker>>,
}

/// A spawned task's output, as a future. Dropping it detaches the task (it
/// keeps running).
///
/// If the task panics, awaiting the handle resumes the panic in the
/// awaiting task (as `std::thread::JoinHandle::join(..).unwrap()` would);
/// [`JoinHandle::result`] returns it as [`JoinError::Panicked`] instead.
///
/// If the runtime is dropped before the task finishes, the task is dropped
/// with it and a waiter on this handle is woken: awaiting the handle then
/// panics (the task has no output to give), as awaiting a cancelled
/// `async_task::Task` does; [`JoinHandle::fallible`] resolves to `None`
/// and [`JoinHandle::result`] to [`JoinError::Cancelled`] instead.
pub struct JoinHandle<T> {
    pub(super) state: Rc<JoinState<T>>,
}

/// A [`JoinHandle`] that resolves to `None` if its task ended without an
/// output (dropped unfinished because its runtime shut down, or panicked),
/// instead of panicking.
pub struct FallibleJoinHandle<T> {
    state: Rc<JoinState<T>>,
}

/// A [`JoinHandle`] that resolves to the task's output or to why there is
/// none ([`JoinHandle::result`]).
pub struct JoinResult<T> {
    state: Rc<JoinState<T>>,
}

/// Why a spawned task gave no output.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JoinError {
    /// The task was dropped unfinished: its runtime shut down first (or the
    /// output was taken already).
    #[error("the task was dropped unfinished (its runtime shut down)")]
    Cancelled,
    /// The task panicked.
    #[error("the task panicked: {message}")]
    Panicked {
        /// The panic's message (a placeholder for non-string payloads).
        message: String,
        /// The panic payload, for [`std::panic::resume_unwind`] (take it
        /// with [`JoinError::into_panic`]). The payload is `Send` but not
        /// `Sync`; the mutex (never locked by verbio) makes the error
        /// `Sync`, so it can be boxed into `Box<dyn Error + Send + Sync>`.
        payload: Mutex<Box<dyn Any + Send>>,
    },
}

impl JoinError {
    /// True if the task panicked.
    pub fn is_panic(&self) -> bool {
        matches!(self, JoinError::Panicked { .. })
    }

    /// The panic payload, if the task panicked.
    pub fn into_panic(self) -> Option<Box<dyn Any + Send>> {
        match self {
            JoinError::Panicked { payload, .. } => Some(take_payload(payload)),
            JoinError::Cancelled => None,
        }
    }
}

/// The payload out of its mutex (a poisoned one still holds it).
fn take_payload(payload: Mutex<Box<dyn Any + Send>>) -> Box<dyn Any + Send> {
    payload.into_inner().unwrap_or_else(PoisonError::into_inner)
}

impl<T> JoinState<T> {
    /// The output once the task is done, or why there is none (dropped
    /// unfinished, panicked, or the output was taken already).
    fn poll_output(&self, cx: &mut Context<'_>) -> Poll<Result<T, JoinError>> {
        if let Some(v) = self.value.borrow_mut().take() {
            return Poll::Ready(Ok(v));
        }
        if self.finished.get() {
            let payload = self.panic.borrow_mut().take();
            return Poll::Ready(Err(match payload {
                Some(payload) => JoinError::Panicked {
                    message: panic_message(&*payload).to_owned(),
                    payload: Mutex::new(payload),
                },
                None => JoinError::Cancelled,
            }));
        }
        let mut w = self.waker.borrow_mut();
        match &*w {
            Some(old) if old.will_wake(cx.waker()) => {}
            _ => *w = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}

impl<T> JoinHandle<T> {
    /// True once the task has finished (or was aborted and dropped).
    pub fn is_finished(&self) -> bool {
        self.state.finished.get()
    }

    /// This handle as a future of `Option<T>`: `None` if the task ended
    /// without an output (dropped unfinished because its runtime shut
    /// down, or panicked).
    pub fn fallible(self) -> FallibleJoinHandle<T> {
        FallibleJoinHandle { state: self.state }
    }

    /// This handle as a future of `Result<T, JoinError>`: the output, or
    /// [`JoinError::Panicked`] with the panic's payload, or
    /// [`JoinError::Cancelled`] if the task was dropped unfinished.
    pub fn result(self) -> JoinResult<T> {
        JoinResult { state: self.state }
    }

    /// Cancels the task: its future is dropped at the loop's next turn
    /// (dropping any ops it owns parks their buffers, as usual).
    pub fn abort(self) {
        self.state.aborted.set(true);
        let w = self.state.task.borrow_mut().take();
        if let Some(w) = w {
            w.wake();
        }
    }
}

impl<T> Future for JoinHandle<T> {
    type Output = T;

    /// # Panics
    ///
    /// With the task's own panic payload if the task panicked; if the task
    /// was dropped unfinished (its runtime shut down), or when polled again
    /// after it returned the output.
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        match self.state.poll_output(cx) {
            Poll::Ready(Ok(v)) => Poll::Ready(v),
            Poll::Ready(Err(JoinError::Panicked { payload, .. })) => {
                resume_unwind(take_payload(payload))
            }
            Poll::Ready(Err(JoinError::Cancelled)) => panic!(
                "JoinHandle polled after its task ended without an output \
                 (dropped by runtime shutdown, or the output was taken); \
                 use JoinHandle::fallible or JoinHandle::result instead"
            ),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<T> Future for FallibleJoinHandle<T> {
    type Output = Option<T>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
        self.state.poll_output(cx).map(Result::ok)
    }
}

impl<T> Future for JoinResult<T> {
    type Output = Result<T, JoinError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<T, JoinError>> {
        self.state.poll_output(cx)
    }
}

impl<T> std::fmt::Debug for JoinResult<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JoinResult")
            .field("finished", &self.state.finished.get())
            .finish()
    }
}

impl<T> std::fmt::Debug for FallibleJoinHandle<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FallibleJoinHandle")
            .field("finished", &self.state.finished.get())
            .finish()
    }
}

impl<T> std::fmt::Debug for JoinHandle<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JoinHandle")
            .field("finished", &self.is_finished())
            .finish()
    }
}
