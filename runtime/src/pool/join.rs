//! [`PoolJoinHandle`]: the `Send` future of a task spawned on a pool thread.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use super::slot::Answer;
use super::thread::{Job, ThreadRef};
use super::PoolError;

/// The output of a task spawned with [`Pool::spawn`](super::Pool::spawn),
/// as a `Send` future: `Ok(output)`, or why there is none
/// ([`PoolError::TaskFailed`] if the task panicked,
/// [`PoolError::ThreadGone`] if its thread is gone).
///
/// Unlike verbio's local [`JoinHandle`](crate::reactor::JoinHandle) (which yields
/// the output itself and resumes a task's panic), and like tokio's, it
/// yields a `Result`. Dropping it detaches the task; a task not yet queued
/// because its thread's queue was full (it is queued by the handle's
/// polls) is then never run.
#[must_use = "a pool task's handle is its only way to report the output"]
pub struct PoolJoinHandle<T: Send> {
    state: State<T>,
}

enum State<T: Send> {
    Failed(Option<PoolError>),
    Room(ThreadRef, Option<Job>, Option<Answer<T>>),
    Queued(ThreadRef, Answer<T>),
}

impl<T: Send> std::fmt::Debug for PoolJoinHandle<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.state {
            State::Failed(_) => "failed",
            State::Room(..) => "waiting for room in the thread's queue",
            State::Queued(..) => "queued",
        };
        f.debug_struct("PoolJoinHandle")
            .field("state", &state)
            .finish()
    }
}

impl<T: Send> PoolJoinHandle<T> {
    pub(super) fn failed(e: PoolError) -> Self {
        PoolJoinHandle {
            state: State::Failed(Some(e)),
        }
    }

    pub(super) fn queued(t: ThreadRef, a: Answer<T>) -> Self {
        PoolJoinHandle {
            state: State::Queued(t, a),
        }
    }

    pub(super) fn waiting_for_room(t: ThreadRef, job: Job, a: Answer<T>) -> Self {
        PoolJoinHandle {
            state: State::Room(t, Some(job), Some(a)),
        }
    }
}

impl<T: Send> Unpin for PoolJoinHandle<T> {}

impl<T: Send> Future for PoolJoinHandle<T> {
    type Output = Result<T, PoolError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        loop {
            match &mut self.state {
                State::Failed(e) => {
                    return Poll::Ready(Err(e
                        .take()
                        .unwrap_or(PoolError::TaskFailed { index: usize::MAX })))
                }
                State::Room(t, job, answer) => match t.shared.jobs.poll_send(cx, job) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Err(_)) => {
                        let e = t.lost_error_or_gone();
                        self.state = State::Failed(Some(e));
                    }
                    Poll::Ready(Ok(())) => {
                        let (t, a) = (t.clone(), answer.take());
                        self.state = match a {
                            Some(a) => State::Queued(t, a),
                            None => State::Failed(Some(t.lost_error())),
                        };
                    }
                },
                State::Queued(t, answer) => {
                    return match Pin::new(answer).poll(cx) {
                        Poll::Pending => Poll::Pending,
                        Poll::Ready(Ok(v)) => Poll::Ready(Ok(v)),
                        Poll::Ready(Err(_lost)) => Poll::Ready(Err(t.lost_error())),
                    }
                }
            }
        }
    }
}
