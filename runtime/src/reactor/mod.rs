//! The reactor: a single-threaded (`!Send`) runtime, one per thread.
//!
//! One loop ([`Runtime::block_on`], or [`Runtime::turn`] when another
//! executor drives it):
//!
//! 1. run ready tasks (up to a budget);
//! 2. drain the CQs with `poll` in batches, completing slab entries by wr_id;
//! 3. if work is ready: fire expired timers (and every few turns poll the
//!    sockets without waiting), then turn again;
//! 4. if nothing is runnable: optionally spin on the CQs (busy poll; the
//!    sockets are polled every thousand spins or so), fire expired timers
//!    (one clock read, none without live timers), arm the CQs
//!    (`req_notify`), poll them once more (a completion may have landed
//!    before the arming), then sleep in `mio::Poll` until a completion-channel
//!    fd, a socket, a cross-thread wake or the next timer, and on waking
//!    take the completions at once. A wake needs two syscalls, as for a bare
//!    verbs loop: `epoll_wait` and the one `get_event` of the channel (an
//!    armed CQ raises one event); events are acknowledged in batches. Wakes
//!    made on the runtime's thread (the dispatch of socket events, a
//!    completion waking its task) write no eventfd.

mod accept;
mod cq_registration;
mod driver;
mod executor;
mod net;
mod pass_hooks;
#[cfg(feature = "ibverbs")]
mod readable_fd;
mod runtime;
mod spin;
mod stats;
mod timer;
mod work_queue;

use std::cell::{Cell, RefCell};
use std::rc::Rc;

pub use crate::accept_error::{ACCEPT_BACKOFF_MAX, ACCEPT_BACKOFF_MIN};
pub use accept::{AcceptBackoff, PendingLimits, PendingRefusal, PendingSlot};
pub use executor::{FallibleJoinHandle, JoinError, JoinHandle, JoinResult};
pub use net::{TcpListener, TcpStream, LISTEN_BACKLOG};
pub use pass_hooks::{schedule_pass_hook, PassHook, PassHookId};
pub use runtime::{Builder, Runtime, Turn};
pub use stats::RuntimeStats;
pub use timer::{sleep, sleep_until, timeout, Elapsed, Sleep, Timeout};

pub(crate) use cq_registration::{CqClaim, CqRegistration};
pub(crate) use driver::Driver;
pub(crate) use pass_hooks::PassCheck;
#[cfg(feature = "ibverbs")]
pub(crate) use readable_fd::ReadableFd;
pub(crate) use work_queue::WorkQueue;

use crate::op::OpTable;
use crate::provider::Completion;

/// Errors of the runtime itself.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RuntimeError {
    /// An OS call (epoll, eventfd, registration) failed.
    #[error("{context}")]
    Io {
        /// What was being done.
        context: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A runtime already exists on this thread (one per thread).
    #[error("a verbio runtime already exists on this thread")]
    AlreadyExists,
    /// A provider call failed.
    #[error(transparent)]
    Provider(#[from] crate::provider::ProviderError),
    /// The call needs a verbio runtime on this thread and there is none.
    #[error("no verbio runtime on this thread: {what} needs one (create a verbio::Runtime first)")]
    NoRuntime {
        /// What was being done.
        what: &'static str,
    },
}

pub(crate) struct Config {
    pub(crate) busy_poll: std::time::Duration,
    pub(crate) task_budget: usize,
    pub(crate) drain_timeout: std::time::Duration,
}

pub(crate) struct Inner {
    pub(crate) driver: Driver,
    pub(crate) executor: executor::Executor,
    pub(crate) timers: timer::Timers,
    pub(crate) config: Config,
    pub(crate) in_block_on: Cell<bool>,
    pub(crate) pass_hooks: pass_hooks::PassHooks,
}

/// A handle to the thread's runtime: what ops, timers, sockets and tasks use
/// to reach the reactor. Cheap to clone; `!Send`.
#[derive(Clone)]
pub struct Handle {
    pub(crate) inner: Rc<Inner>,
}

/// The thread's current runtime. Its drop at thread exit resets the pass
/// hooks' pointer to it before the handle goes.
struct Current(RefCell<Option<Handle>>);

impl Drop for Current {
    fn drop(&mut self) {
        pass_hooks::set_hooks_of_current(None);
    }
}

thread_local! {
    static CURRENT: Current = const { Current(RefCell::new(None)) };
}

impl Handle {
    /// The runtime of this thread.
    ///
    /// # Panics
    ///
    /// If no [`Runtime`] exists on this thread.
    pub fn current() -> Handle {
        match Handle::try_current() {
            Some(h) => h,
            None => panic!("no verbio runtime on this thread: create a verbio::Runtime first"),
        }
    }

    /// The runtime of this thread, if there is one.
    pub fn try_current() -> Option<Handle> {
        // `try_with`: during thread-local teardown there is no runtime.
        CURRENT.try_with(|c| c.0.borrow().clone()).ok().flatten()
    }

    pub(crate) fn set_current(h: Option<Handle>) {
        let old = CURRENT.try_with(|c| {
            pass_hooks::set_hooks_of_current(h.as_ref());
            std::mem::replace(&mut *c.0.borrow_mut(), h)
        });
        // Dropped outside the borrow.
        drop(old);
    }

    /// Takes the thread's current runtime away (it has none afterwards).
    #[cfg(feature = "tokio")]
    pub(crate) fn take_current() -> Option<Handle> {
        CURRENT
            .try_with(|c| {
                pass_hooks::set_hooks_of_current(None);
                c.0.borrow_mut().take()
            })
            .ok()
            .flatten()
    }

    /// From now on, a wake from another thread while the runtime is idle
    /// (between turns) wakes `w`, the task of another executor that turns
    /// it, instead of making its epoll fd readable. Called by that task at
    /// each poll, before it turns the runtime (so that no wake between the
    /// turn and its `Pending` is lost).
    #[cfg(feature = "tokio")]
    pub(crate) fn wake_outside(&self, w: &std::task::Waker) {
        let s = &self.inner.executor.shared;
        s.outside.register(w);
        s.outside_set
            .store(true, std::sync::atomic::Ordering::Release);
    }

    pub(crate) fn driver(&self) -> &Driver {
        &self.inner.driver
    }

    pub(crate) fn ops(&self) -> &OpTable {
        &self.inner.driver.ops
    }

    /// Spawns a local task (it may be `!Send`); it starts at the next turn
    /// of the loop. The returned handle is a future of its output; dropping
    /// it detaches the task.
    pub fn spawn<F>(&self, fut: F) -> JoinHandle<F::Output>
    where
        F: std::future::Future + 'static,
        F::Output: 'static,
    {
        self.inner.executor.spawn(fut)
    }

    /// Number of ops in the slab (in flight, parked, or completed but not
    /// yet collected by their future).
    pub fn ops_in_slab(&self) -> usize {
        self.ops().len()
    }

    /// Completions ignored because their wr_id was stale (freed or reused slot).
    pub fn stale_completions(&self) -> u64 {
        self.ops().stale_count()
    }

    /// Routes completions with a reserved wr_id at or above
    /// [`wr_id::AGENT_BASE`](crate::op::wr_id::AGENT_BASE) to `handler`
    /// (called from the reactor loop; it must not block). `None` removes it.
    pub fn set_reserved_handler(&self, handler: Option<Box<dyn FnMut(Completion)>>) {
        *self.inner.driver.reserved_handler.borrow_mut() = handler;
    }
}

/// Yields once: the awaiting task returns `Pending` (waking itself) and
/// goes on at the executor's next turn, after the other ready tasks (and,
/// on a verbio runtime, after the loop drains completions). Works on any
/// executor.
pub async fn yield_now() {
    let mut yielded = false;
    std::future::poll_fn(|cx| {
        if yielded {
            std::task::Poll::Ready(())
        } else {
            yielded = true;
            cx.waker().wake_by_ref();
            std::task::Poll::Pending
        }
    })
    .await
}

/// Spawns a local task on the current thread's runtime.
///
/// # Panics
///
/// If no [`Runtime`] exists on this thread.
pub fn spawn<F>(fut: F) -> JoinHandle<F::Output>
where
    F: std::future::Future + 'static,
    F::Output: 'static,
{
    Handle::current().spawn(fut)
}

#[cfg(test)]
mod stats_tests;
#[cfg(test)]
mod tests;
