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
//! A request from a worker of the same tokio runtime does not schedule
//! the task at all when it can help it: the request's wake of the idle
//! runtime is caught ([`inline_scope`]) and the asking task turns the
//! runtime itself, right after queuing the request, as if it polled the
//! task (see [`HostShared::turn_inline`]). The runtime is behind a lock
//! that the task and such turns take (never waiting: whoever finds it
//! taken leaves the turn to the holder), so no second worker is woken to
//! run the task (tokio unparks one whenever the task goes to its run
//! queue instead of its LIFO slot) and the request costs no trip through
//! tokio's scheduler. The same holds for a request from a thread that is
//! not a worker but runs inside that tokio runtime (its `block_on`, such
//! as `#[tokio::main]`'s body, or a `spawn_blocking` thread): it turns
//! the runtime too, where the task's wake would have unparked a worker
//! (a remote schedule) for every request.
//!
//! What a runtime thread guarantees holds here too: requests own their
//! data inside the runtime until their operation completes; a panic of a
//! job's `make` marks the runtime ended ([`PoolError::ThreadGone`]) and it
//! is dropped; dropping the task (tokio shutting down) ends it the same
//! way, with the runtime's usual drain.
//!
//! [`PoolError::ThreadGone`]: super::PoolError::ThreadGone

use std::cell::{Cell, RefCell, UnsafeCell};
use std::future::Future;
use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use futures::task::AtomicWaker;
use smallvec::SmallVec;

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use super::mailbox::MailReceiver;
use super::thread::{EndMark, Job, ThreadContext, ThreadShared};
use crate::compat::hosted::enter;
use crate::device::Device;
use crate::reactor::Runtime;

/// Busy turns per poll before the task yields to tokio's other tasks.
const TURNS_PER_POLL: u32 = 16;

/// Busy turns an asking task makes inline before it leaves the rest to
/// the runtime's task.
const INLINE_TURNS: u32 = 4;

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
    /// The deadline the task's tokio timer waits for: a turn inline that
    /// leaves an earlier one wakes the task to wait for that instead.
    timer_at: Cell<Option<Instant>>,
    /// The waker the runtime's cross-thread wakes go to while it is idle
    /// ([`HostShared`]'s, registered before every turn).
    outside: Waker,
    rt: Runtime,
}

/// Wraps the `!Send` runtime so that a tokio task may own it.
struct SendOwned(Owned);

// SAFETY: the wrapped values (`Rc`s, `Cell`s, the runtime and every task,
// op and object living in it) are reached only by the holder of
// `HostShared`'s lock (`HostedRuntime`'s `poll` and `drop`, a turn inline
// by an asking worker), one thread at a time, each holder ordered after
// the previous one by the lock's `Release`/`Acquire`; while it holds it,
// the thread-local state naming the runtime is installed (`enter`) and
// put back before it lets go, so nothing on the thread keeps a pointer to
// it afterwards. What leaves the runtime (wakers, completion slots,
// mailbox senders, job outputs) is `Send` on its own.
unsafe impl Send for SendOwned {}

/// What the runtime's task and the asking tasks that turn it inline
/// share: the runtime behind a lock that nobody waits for.
pub(super) struct HostShared {
    /// The lock on `owned`: taken with a swap, never waited for.
    busy: AtomicBool,
    /// The task was polled while an inline turn held the lock: the
    /// holder wakes it when it lets go.
    wanted: AtomicBool,
    /// The task was dropped while an inline turn held the lock: the
    /// holder tears the runtime down when it lets go.
    abandoned: AtomicBool,
    /// A turn inline panicked: the task ends the runtime at its next poll.
    poisoned: AtomicBool,
    /// The runtime's task (its waker of its latest poll).
    task: AtomicWaker,
    /// The tokio runtime the task runs on: only threads inside it (its
    /// workers, its `block_on`) turn inline.
    host: tokio::runtime::Id,
    /// `None` once torn down.
    owned: UnsafeCell<Option<SendOwned>>,
}

// SAFETY: `owned` (the `!Sync` part) is reached only by the holder of the
// `busy` lock (taken with an `Acquire` swap, given back with a `Release`
// store), so never from two threads at once, and each holder sees the
// previous holder's writes; the rest are atomics.
unsafe impl Sync for HostShared {}

thread_local! {
    /// The hosted runtimes woken on this thread inside an
    /// [`inline_scope`], to turn when it ends (`None`: no scope open).
    static CAUGHT: RefCell<Option<SmallVec<[Arc<HostShared>; 2]>>> =
        const { RefCell::new(None) };
    /// A hosted runtime turns on this thread (its task or inline): wakes
    /// made here are not caught (no nested turn of another runtime).
    static TURNING: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` (the queuing of a request into a pool runtime's mailbox),
/// then turns inline each hosted runtime that `f` woke from idle, if this
/// thread runs inside that runtime's tokio runtime (a worker, its
/// `block_on`) and nothing else
/// turns it at the moment (otherwise its task is woken as usual). Call it
/// with no lock held: the turn runs the runtime's tasks.
pub(super) fn inline_scope<R>(f: impl FnOnce() -> R) -> R {
    let opened = CAUGHT
        .try_with(|c| {
            let mut c = c.borrow_mut();
            if c.is_some() || TURNING.try_with(Cell::get).unwrap_or(true) {
                return false;
            }
            *c = Some(SmallVec::new());
            true
        })
        .unwrap_or(false);
    if !opened {
        return f();
    }
    struct Close;
    impl Drop for Close {
        fn drop(&mut self) {
            let caught = CAUGHT
                .try_with(|c| c.borrow_mut().take())
                .ok()
                .flatten()
                .unwrap_or_default();
            for host in caught {
                if std::thread::panicking() {
                    host.task.wake();
                } else {
                    host.turn_inline();
                }
            }
        }
    }
    let _close = Close;
    f()
}

/// Marks this thread as turning a hosted runtime until dropped.
struct Turning(bool);

impl Turning {
    fn enter() -> Turning {
        Turning(TURNING.try_with(|t| t.replace(true)).unwrap_or(true))
    }
}

impl Drop for Turning {
    fn drop(&mut self) {
        let _ = TURNING.try_with(|t| t.set(self.0));
    }
}

/// The lock on [`HostShared::owned`], let go when dropped.
struct Locked<'a>(&'a HostShared);

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        let host = self.0;
        host.busy.store(false, Ordering::SeqCst);
        if host.abandoned.load(Ordering::SeqCst) {
            // The task is gone: whoever takes the lock now tears down.
            if !host.busy.swap(true, Ordering::Acquire) {
                // SAFETY: the lock is held; nothing borrows `owned`.
                unsafe { host.teardown() };
                host.busy.store(false, Ordering::Release);
            }
            return;
        }
        if host.wanted.swap(false, Ordering::SeqCst) {
            host.task.wake();
        }
    }
}

impl Locked<'_> {
    /// The runtime, `None` once torn down.
    fn owned(&self) -> Option<&Owned> {
        // SAFETY: the lock is held (see `HostShared`'s `Sync`); the
        // reference does not outlive `self`, and only `finish` (which
        // takes `&self` too, and is called with no such reference live)
        // writes.
        unsafe { (*self.0.owned.get()).as_ref().map(|SendOwned(o)| o) }
    }

    /// Drops the runtime with its state installed (its teardown waits for
    /// its work requests, as a runtime thread's does). The fd registered
    /// with tokio must be deregistered first.
    fn finish(&self) {
        // SAFETY: the lock is held and no reference from `owned` is used
        // again (callers return right after).
        unsafe { self.0.teardown() };
    }
}

impl HostShared {
    /// [`Locked::finish`].
    ///
    /// # Safety
    ///
    /// The caller holds the lock (`busy`) and uses no reference into
    /// `owned` afterwards.
    unsafe fn teardown(&self) {
        // SAFETY: per this function's contract.
        let taken = unsafe { (*self.owned.get()).take() };
        if let Some(SendOwned(o)) = taken {
            let _turning = Turning::enter();
            let entered = enter(Some(o.rt.handle()));
            let Owned {
                mark,
                cx,
                jobs_done,
                timer_at: _,
                outside,
                rt,
            } = o;
            super::note_tasks_dropped("hosted pool runtime", cx.index(), &rt);
            drop(mark);
            drop(jobs_done);
            drop(cx);
            drop(rt);
            drop(entered);
            // Last: it may hold the last reference to `HostShared`.
            drop(outside);
        }
    }
}

impl HostShared {
    fn try_lock(&self) -> Option<Locked<'_>> {
        // `then`, not `then_some`: a `Locked` made and dropped on failure
        // would let go of the holder's lock.
        (!self.busy.swap(true, Ordering::Acquire)).then(|| Locked(self))
    }

    /// Turns the runtime on the calling worker (see the module docs): up
    /// to [`INLINE_TURNS`] turns while work is ready. Waiting (on its fd,
    /// its timers) stays the task's business: it is woken when work is
    /// left, when a timer is due earlier than it waits for, or when the
    /// pool shuts down.
    fn turn_inline(&self) {
        let Some(locked) = self.try_lock() else {
            // The task or another worker turns it; the one turning now
            // finds the request (the runtime was not idle) or the task,
            // woken, does.
            self.task.wake();
            return;
        };
        if locked.owned().is_none() {
            return;
        }
        if self.poisoned.load(Ordering::Relaxed) {
            self.task.wake();
            return;
        }
        self.turns_locked(locked);
    }

    /// Runs `f` on the calling thread with the runtime held and entered
    /// (see [`ThreadRef::run_hosted`](super::ThreadRef::run_hosted)):
    /// `None`, without running it, if this thread is not inside the host
    /// tokio runtime, turns a hosted runtime already, or another thread
    /// holds this one, or the runtime ended. Work `f` leaves ready (a task
    /// it woke) is turned here, as a request's turn inline is.
    pub(super) fn run_direct<R>(&self, f: impl FnOnce() -> R) -> Option<R> {
        if TURNING.try_with(Cell::get).unwrap_or(true) || !in_context_of(self.host) {
            return None;
        }
        let locked = self.try_lock()?;
        let o = locked.owned()?;
        if self.poisoned.load(Ordering::Relaxed) {
            drop(locked);
            self.task.wake();
            return None;
        }
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _turning = Turning::enter();
            let _entered = enter(Some(o.rt.handle()));
            let r = super::reply_wakes::direct(f);
            // Wakes `f` made on this thread are collected when the guard
            // goes; cross-thread ones set the executor's flag.
            drop(_entered);
            (r, o.rt.handle().inner.executor.has_ready())
        }));
        match ran {
            Ok((r, false)) => Some(r),
            Ok((r, true)) => {
                self.turns_locked(locked);
                Some(r)
            }
            Err(panic) => {
                tracing::error!("hosted pool runtime: a direct call panicked; the runtime ends");
                self.poisoned.store(true, Ordering::SeqCst);
                drop(locked);
                self.task.wake();
                std::panic::resume_unwind(panic)
            }
        }
    }

    /// [`turn_inline`](Self::turn_inline)'s turns, with the lock held.
    fn turns_locked(&self, locked: Locked<'_>) {
        let Some(o) = locked.owned() else { return };
        let turned = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _turning = Turning::enter();
            o.rt.handle().wake_outside(&o.outside);
            let _entered = enter(Some(o.rt.handle()));
            super::reply_wakes::direct(|| {
                // Not told of readiness: with edge-triggered channels the
                // events behind the fd are the task's (tokio tells it).
                // Timers are the task's too (its tokio timer waits for the
                // next one; an earlier one made here wakes it, below): no
                // clock read per request.
                let mut turn = o.rt.turn_told(false, false);
                for _ in 1..INLINE_TURNS {
                    if !turn.ready {
                        break;
                    }
                    turn = o.rt.turn_told(false, false);
                }
                let ready = turn.ready;
                let due = turn.next_timer;
                let earlier = match (due, o.timer_at.get()) {
                    (Some(d), Some(w)) => d < w,
                    (Some(_), None) => true,
                    (None, _) => false,
                };
                ready || earlier || o.jobs_done.get()
            })
        }));
        let wake = match turned {
            Ok(wake) => wake,
            Err(_) => {
                tracing::error!("hosted pool runtime: a turn inline panicked; the runtime ends");
                self.poisoned.store(true, Ordering::SeqCst);
                true
            }
        };
        drop(locked);
        if wake {
            self.task.wake();
        }
    }
}

impl Wake for HostShared {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    /// A cross-thread wake of the idle runtime: caught by an open
    /// [`inline_scope`] on a thread in the host runtime (a worker, its
    /// `block_on`), else the task's.
    fn wake_by_ref(self: &Arc<Self>) {
        let wake_task = CAUGHT
            .try_with(|c| {
                let mut c = c.borrow_mut();
                let Some(list) = c.as_mut() else { return true };
                if list.iter().any(|h| Arc::ptr_eq(h, self)) {
                    return false;
                }
                if !in_context_of(self.host) {
                    return true;
                }
                list.push(self.clone());
                false
            })
            .unwrap_or(true);
        if wake_task {
            self.task.wake();
        }
    }
}

/// This thread runs in the tokio runtime `id`: one of its workers, or a
/// thread inside its context (its `block_on`, e.g. `#[tokio::main]`'s
/// body; a `spawn_blocking` thread; a thread in `Handle::enter`). A turn
/// there runs the runtime's tasks where tokio's own APIs work, as on a
/// worker; a thread outside it wakes the runtime's task instead.
fn in_context_of(id: tokio::runtime::Id) -> bool {
    tokio::runtime::Handle::try_current().is_ok_and(|h| h.id() == id)
}

/// The tokio task's future: turns the runtime until the pool shuts down
/// and its tasks end (or the grace period passes).
pub(super) struct HostedRuntime {
    /// Deregistered before the runtime (and its fd) goes.
    fd: Option<AsyncFd<EpollFd>>,
    host: Arc<HostShared>,
    timer: Pin<Box<tokio::time::Sleep>>,
    /// The deadline `timer` was last reset to.
    sleep_at: Option<Instant>,
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
        let cx = Rc::new(ThreadContext::new(
            rt.handle().clone(),
            device,
            shared.clone(),
        ));
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
        let host = Arc::new(HostShared {
            busy: AtomicBool::new(false),
            wanted: AtomicBool::new(false),
            abandoned: AtomicBool::new(false),
            poisoned: AtomicBool::new(false),
            task: AtomicWaker::new(),
            host: tokio::runtime::Handle::current().id(),
            owned: UnsafeCell::new(None),
        });
        // The runtime's wakes hold the shared part: a cycle, broken when
        // the runtime is torn down (`Locked::finish`).
        let owned = SendOwned(Owned {
            mark,
            cx,
            jobs_done,
            timer_at: Cell::new(None),
            outside: Waker::from(host.clone()),
            rt,
        });
        // SAFETY: nothing else has reached `host` yet (its only other
        // reference is the waker, not yet registered anywhere).
        unsafe { *host.owned.get() = Some(owned) };
        // Handles on this runtime call into it directly through this
        // (`ThreadRef::run_hosted`); a cycle too, broken with the one above.
        let _ = shared.hosted.set(host.clone());
        Ok(HostedRuntime {
            fd: Some(fd),
            host,
            timer: Box::pin(tokio::time::sleep(Duration::from_secs(3600))),
            sleep_at: None,
            grace,
            grace_end: None,
        })
    }

    /// Waits for the timer at `at` (`None`: none); true if it is due.
    /// Records what it waits for in `o` (see [`Owned::timer_at`]).
    fn timer_due(&mut self, o: &Owned, at: Option<Instant>, cx: &mut Context<'_>) -> bool {
        o.timer_at.set(at);
        let Some(at) = at else { return false };
        if self.sleep_at != Some(at) {
            self.timer.as_mut().reset(at.into());
            self.sleep_at = Some(at);
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
        let host = this.host.clone();
        host.task.register(cx.waker());
        let locked = match host.try_lock() {
            Some(l) => l,
            None => {
                // A worker turns it inline: it wakes this task when done
                // (asked for before the second look, so the ask is seen).
                host.wanted.store(true, Ordering::SeqCst);
                match host.try_lock() {
                    Some(l) => {
                        host.wanted.store(false, Ordering::SeqCst);
                        l
                    }
                    None => return Poll::Pending,
                }
            }
        };
        if host.poisoned.load(Ordering::SeqCst) {
            this.fd = None;
            locked.finish();
            return Poll::Ready(());
        }
        let mut budget = TURNS_PER_POLL;
        loop {
            let Some(o) = locked.owned() else {
                return Poll::Ready(());
            };
            let Some(fd) = this.fd.as_ref() else {
                return Poll::Ready(());
            };
            // Take the readiness tokio saw before turning (edge-triggered:
            // the turn handles every event behind it), so that the wake
            // that brought this poll costs one turn, not a second one to
            // find the same readiness again.
            let readable = match fd.poll_read_ready(cx) {
                Poll::Ready(Ok(mut ready)) => {
                    ready.clear_ready();
                    true
                }
                _ => false,
            };
            // Timers are fired (a clock read) only once the tokio timer
            // waiting for the next one fired, or while none is set.
            let timers = this.sleep_at.is_none() || this.timer.is_elapsed();
            o.rt.handle().wake_outside(&o.outside);
            // Busy turns run back to back inside one entry of the
            // runtime's state (entering and leaving it cost about a third
            // of an idle turn). With edge-triggered channels a turn not
            // told of readiness takes no events, so readiness tokio sees
            // meanwhile is work for the look at the fd below. Otherwise
            // every turn takes them, and the readiness is taken before
            // each: left for that look, it would cost an idle turn more.
            let edge_safe = o.rt.handle().driver().channels_edge_safe();
            let (turn, tasks, turned) = {
                let _turning = Turning::enter();
                let _entered = enter(Some(o.rt.handle()));
                super::reply_wakes::direct(|| {
                    let mut turn = o.rt.turn_told(readable, timers);
                    let mut turned = 1;
                    while turn.ready && turned < budget && !o.jobs_done.get() {
                        if !edge_safe {
                            if let Poll::Ready(Ok(mut ready)) = fd.poll_read_ready(cx) {
                                ready.clear_ready();
                            }
                        }
                        turn = o.rt.turn_told(false, timers);
                        turned += 1;
                    }
                    (turn, o.rt.task_count(), turned)
                })
            };
            budget = budget.saturating_sub(turned);
            if o.jobs_done.get() {
                let end = *this
                    .grace_end
                    .get_or_insert_with(|| Instant::now() + this.grace);
                if tasks == 0 || Instant::now() >= end {
                    this.fd = None;
                    locked.finish();
                    return Poll::Ready(());
                }
            }
            // Busy (the budget spent while work is left): yield below.
            let more = if turn.ready {
                true
            } else {
                // Idle: wait for the fd (an event since the readiness was
                // taken, seen by another worker's reactor, means turn
                // again).
                match fd.poll_read_ready(cx) {
                    Poll::Ready(Ok(_)) => true,
                    Poll::Ready(Err(e)) => {
                        tracing::warn!(
                            error = %crate::report::ErrorChain(&e),
                            "hosted pool runtime: tokio stopped watching its fd; the runtime ends"
                        );
                        this.fd = None;
                        locked.finish();
                        return Poll::Ready(());
                    }
                    Poll::Pending => {
                        let at = match (turn.next_timer, this.grace_end) {
                            (Some(a), Some(b)) => Some(a.min(b)),
                            (a, b) => a.or(b),
                        };
                        this.timer_due(o, at, cx)
                    }
                }
            };
            if !more {
                return Poll::Pending;
            }
            if budget == 0 {
                break;
            }
        }
        // Busy: let the worker's other tasks run, then turn again.
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

impl Drop for HostedRuntime {
    fn drop(&mut self) {
        // Deregistered while the runtime (and its fd) still lives.
        self.fd = None;
        self.host.abandoned.store(true, Ordering::SeqCst);
        // Whoever holds the lock, or takes it last, tears down (see
        // `Locked`'s drop).
        if let Some(locked) = self.host.try_lock() {
            locked.finish();
        }
    }
}

#[cfg(test)]
#[path = "hosted_tests.rs"]
mod tests;
