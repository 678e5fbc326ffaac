//! One runtime thread of a [`Pool`](super::Pool): its loop (the dispatcher
//! running the jobs its mailbox brings), its [`ThreadContext`], and the
//! `Send` [`ThreadRef`] the rest of the world reaches it by.

use std::cell::RefCell;
use std::future::Future;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use super::join::PoolJoinHandle;
use super::mailbox::{MailReceiver, MailSender, SendError};
use super::slot::slot;
use super::{PoolError, ThreadEnd};
use crate::device::Device;
use crate::reactor::{Handle, Runtime};

/// Work for a runtime thread's loop.
pub(super) type Job = Box<dyn FnOnce(&ThreadContext) + Send>;

const RUNNING: u8 = 0;
const SHUT_DOWN: u8 = 1;
const PANICKED: u8 = 2;

pub(super) struct ThreadShared {
    pub(super) index: usize,
    pub(super) jobs: MailSender<Job>,
    state: AtomicU8,
    /// The pool's [`reply_spin`](super::PoolBuilder::reply_spin).
    reply_spin: std::time::Duration,
    /// The runtime's host, when it is hosted on tokio (set once its task
    /// is made).
    #[cfg(feature = "tokio")]
    pub(super) hosted: std::sync::OnceLock<Arc<super::hosted::HostShared>>,
}

impl ThreadShared {
    pub(super) fn new(
        index: usize,
        jobs: MailSender<Job>,
        reply_spin: std::time::Duration,
    ) -> ThreadShared {
        ThreadShared {
            index,
            jobs,
            state: AtomicU8::new(RUNNING),
            reply_spin,
            #[cfg(feature = "tokio")]
            hosted: std::sync::OnceLock::new(),
        }
    }
}

/// A runtime thread of a pool: `Send + Sync + Clone`. Handles keep one
/// to submit to the thread their object lives on and to tell, when a
/// request goes unanswered, whether the thread is gone.
#[derive(Clone)]
pub struct ThreadRef {
    pub(super) shared: Arc<ThreadShared>,
}

impl std::fmt::Debug for ThreadRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadRef")
            .field("index", &self.shared.index)
            .field("end", &self.end())
            .finish()
    }
}

impl ThreadRef {
    /// The thread's number in its pool.
    pub fn index(&self) -> usize {
        self.shared.index
    }

    /// How long a handle's reply future spins before parking
    /// ([`PoolBuilder::reply_spin`](super::PoolBuilder::reply_spin)).
    pub fn reply_spin(&self) -> std::time::Duration {
        self.shared.reply_spin
    }

    /// How the thread ended, `None` while it runs.
    pub fn end(&self) -> Option<ThreadEnd> {
        match self.shared.state.load(Ordering::Acquire) {
            RUNNING => None,
            SHUT_DOWN => Some(ThreadEnd::ShutDown),
            _ => Some(ThreadEnd::Panicked),
        }
    }

    /// `Ok` while the thread runs, else [`PoolError::ThreadGone`].
    pub fn check(&self) -> Result<(), PoolError> {
        match self.end() {
            None => Ok(()),
            Some(end) => Err(PoolError::ThreadGone {
                index: self.index(),
                end,
            }),
        }
    }

    /// The error for a request this thread dropped unanswered: the
    /// thread is gone ([`PoolError::ThreadGone`]), or the task answering
    /// it failed ([`PoolError::TaskFailed`]).
    pub fn lost_error(&self) -> PoolError {
        match self.check() {
            Err(e) => e,
            Ok(()) => PoolError::TaskFailed {
                index: self.index(),
            },
        }
    }

    /// True if the runtime is hosted on tokio
    /// ([`PoolBuilder::host_on_tokio`](super::PoolBuilder::host_on_tokio)):
    /// [`run_hosted`](Self::run_hosted) may then run calls on the asking
    /// thread.
    pub fn is_hosted(&self) -> bool {
        #[cfg(feature = "tokio")]
        return self.shared.hosted.get().is_some();
        #[cfg(not(feature = "tokio"))]
        false
    }

    /// Runs `f` on the calling thread with this runtime held and made the
    /// thread's current one, as its own turn would: for a handle that
    /// calls into its object on a runtime hosted on tokio
    /// ([`PoolBuilder::host_on_tokio`](super::PoolBuilder::host_on_tokio))
    /// directly, with no request, task or wake between it and the call.
    /// `None` (and `f` not run) unless the runtime is hosted, the calling
    /// thread runs inside the host tokio runtime (a worker, its
    /// `block_on`), no other thread holds the runtime at the moment (its
    /// task turning it, another asker), this thread is not turning a
    /// hosted runtime already, and the runtime has not ended: then take the
    /// usual way (a request). Tasks `f` wakes are turned before it returns
    /// (up to a few turns; the rest is left to the runtime's task). A
    /// panic of `f` ends the runtime (as a panic of a turn would) and
    /// goes on in the caller.
    ///
    /// What `f` reaches of the runtime (its objects are `!Send`) must not
    /// outlive the call: `f` and its output are `Send`, so that only what
    /// may cross threads leaves it.
    pub fn run_hosted<R: Send>(&self, f: impl FnOnce() -> R + Send) -> Option<R> {
        #[cfg(feature = "tokio")]
        return self.shared.hosted.get()?.run_direct(f);
        #[cfg(not(feature = "tokio"))]
        {
            drop(f);
            None
        }
    }

    /// Runs `make`'s future on this thread (see [`Pool::spawn`](super::Pool::spawn)).
    pub fn spawn<F, Fut, T>(&self, make: F) -> PoolJoinHandle<T>
    where
        F: FnOnce(&ThreadContext) -> Fut + Send + 'static,
        Fut: Future<Output = T> + 'static,
        T: Send + 'static,
    {
        let (done, answer) = slot();
        let job: Job = Box::new(move |cx: &ThreadContext| {
            // `make` runs in the loop's frame: its panic ends the thread.
            // The thread is marked ended before `done` drops, so that the
            // asker sees `ThreadGone`, not a failed task.
            let fut = match catch_unwind(AssertUnwindSafe(|| make(cx))) {
                Ok(fut) => fut,
                Err(panic) => {
                    cx.thread().mark_end(PANICKED);
                    drop(done);
                    resume_unwind(panic)
                }
            };
            // Detached: the answer goes through the slot (a panic drops
            // `done` unanswered, which the handle reports).
            drop(cx.handle().spawn(async move { done.complete(fut.await) }));
        });
        match self.shared.jobs.try_send(job) {
            Ok(()) => PoolJoinHandle::queued(self.clone(), answer),
            Err(SendError::Full(job)) => {
                PoolJoinHandle::waiting_for_room(self.clone(), job, answer)
            }
            Err(SendError::Closed(_)) => PoolJoinHandle::failed(self.lost_error_or_gone()),
        }
    }

    /// [`lost_error`](Self::lost_error) for a closed mailbox: the thread
    /// is gone or going, so `ThreadGone` even before its state says so.
    pub(super) fn lost_error_or_gone(&self) -> PoolError {
        PoolError::ThreadGone {
            index: self.index(),
            end: self.end().unwrap_or(ThreadEnd::ShutDown),
        }
    }

    /// Publishes the thread's end and closes its job mailbox.
    fn mark_end(&self, state: u8) {
        self.shared.state.store(state, Ordering::Release);
        self.shared.jobs.close();
    }

    pub(super) fn close(&self) {
        self.shared.jobs.close();
    }
}

/// What a runtime thread gives the jobs it runs: its runtime, its device
/// (if the pool was built with one), its number and a way to hear the
/// pool's shutdown. Lives on the thread (`!Send`).
pub struct ThreadContext {
    handle: Handle,
    device: Option<Device>,
    me: ThreadRef,
    shutdown: Rc<RefCell<ShutdownState>>,
}

#[derive(Default)]
struct ShutdownState {
    fired: bool,
    waiters: Vec<Waker>,
}

impl std::fmt::Debug for ThreadContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadContext")
            .field("index", &self.me.index())
            .field("device", &self.device)
            .finish()
    }
}

impl ThreadContext {
    /// The thread's number in its pool.
    pub fn index(&self) -> usize {
        self.me.index()
    }

    /// The thread's runtime.
    pub fn handle(&self) -> &Handle {
        &self.handle
    }

    /// The thread's device, if the pool was built with one
    /// ([`PoolBuilder::shared_device`](super::PoolBuilder::shared_device),
    /// [`PoolBuilder::device_per_thread`](super::PoolBuilder::device_per_thread)).
    pub fn device(&self) -> Option<&Device> {
        self.device.as_ref()
    }

    /// This thread, as other threads reach it.
    pub fn thread(&self) -> &ThreadRef {
        &self.me
    }

    /// Completes when the pool shuts down (the thread takes no more work):
    /// long-lived tasks (a connection's server) finish their requests in
    /// flight and end, within the pool's grace period.
    pub fn shutdown_signal(&self) -> ShutdownSignal {
        ShutdownSignal {
            state: self.shutdown.clone(),
        }
    }

    pub(super) fn new(handle: Handle, device: Option<Device>, shared: Arc<ThreadShared>) -> Self {
        ThreadContext {
            handle,
            device,
            me: ThreadRef { shared },
            shutdown: Default::default(),
        }
    }

    pub(super) fn fire_shutdown(&self) {
        let waiters = {
            let mut s = self.shutdown.borrow_mut();
            s.fired = true;
            std::mem::take(&mut s.waiters)
        };
        for w in waiters {
            w.wake();
        }
    }
}

/// The future of [`ThreadContext::shutdown_signal`]; clones hear the same
/// shutdown.
#[derive(Clone)]
pub struct ShutdownSignal {
    state: Rc<RefCell<ShutdownState>>,
}

impl std::fmt::Debug for ShutdownSignal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShutdownSignal")
            .field("fired", &self.state.borrow().fired)
            .finish()
    }
}

impl Future for ShutdownSignal {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let mut s = self.state.borrow_mut();
        if s.fired {
            return Poll::Ready(());
        }
        if !s.waiters.iter().any(|w| w.will_wake(cx.waker())) {
            s.waiters.push(cx.waker().clone());
        }
        Poll::Pending
    }
}

/// Marks the thread ended when dropped: `PANICKED` if dropped by an
/// unwinding panic. Made before the runtime, so dropped (and the state
/// published) before the runtime's own teardown fails the requests it
/// held: their askers then see `ThreadGone`.
pub(super) struct EndMark(pub(super) Arc<ThreadShared>);

impl Drop for EndMark {
    fn drop(&mut self) {
        // Unwinding out of the loop: the wakes it kept are given.
        super::reply_wakes::disable();
        let state = if std::thread::panicking() {
            PANICKED
        } else {
            SHUT_DOWN
        };
        // A panic of a job marked it already.
        if self.0.state.load(Ordering::Acquire) == RUNNING {
            self.0.state.store(state, Ordering::Release);
        }
        // No new work: senders fail at once instead of queueing.
        self.0.jobs.close();
    }
}

/// What a thread needs to run, built on the caller's thread.
pub(super) struct Start {
    pub(super) shared: Arc<ThreadShared>,
    pub(super) jobs: MailReceiver<Job>,
    pub(super) grace: Duration,
}

/// The thread's body once its runtime and device exist: runs jobs until
/// the mailbox closes, then gives the tasks the grace period.
pub(super) fn run(rt: Runtime, device: Option<Device>, start: Start) {
    let Start {
        shared,
        jobs,
        grace,
    } = start;
    let cx = ThreadContext::new(rt.handle().clone(), device, shared.clone());
    // Declared after `rt`: dropped first, also when unwinding.
    let mark = EndMark(shared);
    super::reply_wakes::enable(rt.handle());
    rt.block_on(async {
        while let Some(job) = jobs.recv().await {
            job(&cx);
        }
        cx.fire_shutdown();
        drop(jobs);
        let deadline = Instant::now() + grace;
        while rt.task_count() > 0 && Instant::now() < deadline {
            crate::reactor::sleep(Duration::from_millis(1)).await;
        }
    });
    // Answers of the last passes are given now, before anything else.
    super::reply_wakes::disable();
    super::note_tasks_dropped("pool thread", cx.index(), &rt);
    drop(mark);
    drop(cx);
    drop(rt);
}
