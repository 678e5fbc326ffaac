//! Pool runtimes hosted on tokio's multi-thread runtime
//! ([`PoolBuilder::host_on_tokio`](super::PoolBuilder::host_on_tokio)):
//! instead of a thread of its own, each runtime is turned by a tokio task,
//! on whichever worker polls it, so that a handle's request and its answer
//! never cross to another thread.
//!
//! The task waits on the runtime's epoll fd in tokio's own reactor (the
//! completion channels, the sockets and the cross-thread wake are all
//! behind it) and on its next timer with `tokio::time`; each poll turns
//! the runtime ([`Runtime::turn`]) with its thread-local state installed
//! for the poll (`compat::hosted`). An echo from a tokio task then costs
//! the worker one sleep (for the reply, in tokio's reactor, as a tokio
//! socket would): the request's wake makes the runtime's fd readable,
//! which the same worker finds before it parks, and the reply's
//! completion wakes the task on the worker that polled the CQ's channel.
//! Answers wake their askers directly (a local schedule on that worker;
//! no relay, no batching).
//!
//! What a runtime thread guarantees holds here too: requests own their
//! data inside the runtime until their operation completes; a panic of a
//! job's `make` marks the runtime ended ([`PoolError::ThreadGone`]) and it
//! is dropped; dropping the task (tokio shutting down) ends it the same
//! way, with the runtime's usual drain.
//!
//! [`PoolError::ThreadGone`]: super::PoolError::ThreadGone

use std::cell::Cell;
use std::future::Future;
use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use super::mailbox::MailReceiver;
use super::thread::{EndMark, Job, ThreadContext, ThreadShared};
use crate::compat::hosted::enter;
use crate::device::Device;
use crate::reactor::Runtime;

/// Busy turns per poll before the task yields to tokio's other tasks.
const TURNS_PER_POLL: u32 = 16;

/// A runtime's epoll fd, watched by tokio's reactor. The runtime it
/// belongs to outlives it (dropped after it, see [`HostedRuntime`]).
struct EpollFd(RawFd);

impl AsRawFd for EpollFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// What the task owns of its runtime: `!Send` objects, touched only
/// inside the task's poll and drop (see the `Send` impl).
struct Owned {
    /// Dropped first: the thread is marked ended before the runtime's
    /// teardown fails the requests it held (as on a runtime thread).
    mark: EndMark,
    cx: Rc<ThreadContext>,
    /// The job loop ended (the pool shuts down, or a job's `make`
    /// panicked): the grace period runs.
    jobs_done: Rc<Cell<bool>>,
    rt: Runtime,
}

/// Wraps the `!Send` runtime so that a tokio task may own it.
struct SendOwned(Owned);

// SAFETY: the wrapped values (`Rc`s, `Cell`s, the runtime and every task,
// op and object living in it) are reached only through `HostedRuntime`'s
// `poll` and `drop`, which tokio never runs concurrently and orders
// (happens-before) when the task moves between workers; during each, the
// thread-local state naming the runtime is installed (`enter`) and put
// back before it returns, so nothing on the worker keeps a pointer to it
// afterwards. What leaves the runtime (wakers, completion slots, mailbox
// senders, job outputs) is `Send` on its own.
unsafe impl Send for SendOwned {}

/// The tokio task's future: turns the runtime until the pool shuts down
/// and its tasks end (or the grace period passes).
pub(super) struct HostedRuntime {
    /// Deregistered before the runtime (and its fd) goes.
    fd: Option<AsyncFd<EpollFd>>,
    owned: Option<SendOwned>,
    timer: Pin<Box<tokio::time::Sleep>>,
    timer_at: Option<Instant>,
    grace: Duration,
    grace_end: Option<Instant>,
}

/// Makes the runtime (and its device) of pool slot `index` on the calling
/// thread without leaving it the thread's current one; `prepare` opens
/// them.
pub(super) fn prepare<E>(
    prepare: impl FnOnce() -> Result<(Runtime, Option<Device>), E>,
) -> Result<SendRuntime, E> {
    let entered = enter(None);
    let made = prepare();
    drop(entered);
    made.map(|(rt, device)| SendRuntime(rt, device))
}

/// A runtime and device made for hosting, on their way into their task.
pub(super) struct SendRuntime(Runtime, Option<Device>);

// SAFETY: made by `prepare`, which leaves no thread-local state naming the
// runtime on the thread that made it; nothing else holds its `Rc`s until
// `HostedRuntime::start` takes it (inside the task), so moving it moves
// every reference to it.
unsafe impl Send for SendRuntime {}

impl HostedRuntime {
    /// The task's future for `rt`; registers its fd with the tokio
    /// runtime of `tokio` (so call it there or inside `tokio.enter()`).
    pub(super) fn start(
        made: SendRuntime,
        shared: Arc<ThreadShared>,
        jobs: MailReceiver<Job>,
        grace: Duration,
    ) -> std::io::Result<HostedRuntime> {
        let SendRuntime(rt, device) = made;
        let mark = EndMark(shared.clone());
        let entered = enter(Some(rt.handle()));
        let cx = Rc::new(ThreadContext::new(rt.handle().clone(), device, shared));
        let jobs_done = Rc::new(Cell::new(false));
        {
            let (cx, done) = (cx.clone(), jobs_done.clone());
            drop(rt.spawn(async move {
                // On panic (a job's `make`, marked ended by the job) the
                // flag is set as the task unwinds.
                let _done = SetOnDrop(done);
                while let Some(job) = jobs.recv().await {
                    job(&cx);
                }
                cx.fire_shutdown();
            }));
        }
        drop(entered);
        // SAFETY: the fd is `rt`'s epoll fd, open for as long as `rt`
        // lives; `HostedRuntime` owns `rt` and drops the `AsyncFd`
        // (deregistering it) before `rt` (`finish`), so the fd stays open
        // and the same for the `AsyncFd`'s whole life.
        let fd = unsafe {
            AsyncFd::register_with_interest(EpollFd(rt.as_raw_fd()), Interest::READABLE)
        }?;
        Ok(HostedRuntime {
            fd: Some(fd),
            owned: Some(SendOwned(Owned {
                mark,
                cx,
                jobs_done,
                rt,
            })),
            timer: Box::pin(tokio::time::sleep(Duration::from_secs(3600))),
            timer_at: None,
            grace,
            grace_end: None,
        })
    }

    /// Drops the runtime with its state installed (its teardown waits for
    /// its work requests, as a runtime thread's does).
    fn finish(&mut self) {
        self.fd = None;
        if let Some(SendOwned(o)) = self.owned.take() {
            let entered = enter(Some(o.rt.handle()));
            let Owned {
                mark,
                cx,
                jobs_done,
                rt,
            } = o;
            let tasks = rt.task_count();
            if tasks > 0 {
                tracing::debug!(
                    index = cx.index(),
                    tasks,
                    "hosted pool runtime: tasks still running after the grace period are dropped"
                );
            }
            drop(mark);
            drop(jobs_done);
            drop(cx);
            drop(rt);
            drop(entered);
        }
    }

    /// Waits for the timer at `at` (`None`: none); true if it is due.
    fn timer_due(&mut self, at: Option<Instant>, cx: &mut Context<'_>) -> bool {
        let Some(at) = at else { return false };
        if self.timer_at != Some(at) {
            self.timer.as_mut().reset(at.into());
            self.timer_at = Some(at);
        }
        self.timer.as_mut().poll(cx).is_ready()
    }
}

/// Sets its flag when dropped.
struct SetOnDrop(Rc<Cell<bool>>);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.set(true);
    }
}

impl Future for HostedRuntime {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = &mut *self;
        for _ in 0..TURNS_PER_POLL {
            let Some(SendOwned(o)) = this.owned.as_ref() else {
                return Poll::Ready(());
            };
            let Some(fd) = this.fd.as_ref() else {
                return Poll::Ready(());
            };
            // Take the readiness tokio saw before turning (edge-triggered:
            // the turn handles every event behind it), so that the wake
            // that brought this poll costs one turn, not a second one to
            // find the same readiness again.
            if let Poll::Ready(Ok(mut ready)) = fd.poll_read_ready(cx) {
                ready.clear_ready();
            }
            o.rt.handle().wake_outside(cx.waker());
            let (turn, tasks) = {
                let _entered = enter(Some(o.rt.handle()));
                super::reply_wakes::direct(|| (o.rt.turn(), o.rt.task_count()))
            };
            if o.jobs_done.get() {
                let end = *this
                    .grace_end
                    .get_or_insert_with(|| Instant::now() + this.grace);
                if tasks == 0 || Instant::now() >= end {
                    this.finish();
                    return Poll::Ready(());
                }
            }
            if turn.ready {
                continue;
            }
            // Idle: wait for the fd (an event since the readiness was
            // taken, seen by another worker's reactor, means turn again).
            match fd.poll_read_ready(cx) {
                Poll::Ready(Ok(_)) => continue,
                Poll::Ready(Err(e)) => {
                    tracing::warn!(
                        error = %crate::report::ErrorChain(&e),
                        "hosted pool runtime: tokio stopped watching its fd; the runtime ends"
                    );
                    this.finish();
                    return Poll::Ready(());
                }
                Poll::Pending => {}
            }
            let at = match (turn.next_timer, this.grace_end) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            if this.timer_due(at, cx) {
                continue;
            }
            return Poll::Pending;
        }
        // Busy: let the worker's other tasks run, then turn again.
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

impl Drop for HostedRuntime {
    fn drop(&mut self) {
        self.finish();
    }
}
