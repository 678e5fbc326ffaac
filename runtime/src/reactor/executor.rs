//! The local task queue: `spawn`, wakers and [`JoinHandle`].
//!
//! Tasks live in a slab on the runtime's thread. Their wakers are
//! thread-safe (an `Arc` behind a vtable of our own): waking pushes the task
//! id into a small mutex-protected queue and, only if the reactor is asleep
//! in epoll, kicks the `mio::Waker`. Same-thread wakes therefore cost no
//! syscall, and skip the mutex and atomic read-modify-writes too: a waker
//! that fires on its runtime's own thread (the op path: the reactor
//! completes an op and wakes its task) pushes into a thread-local queue
//! instead. The op table recognizes these wakers ([`is_task_waker`]) and
//! keeps and wakes them by reference (no refcount traffic per op).
//!
//! A panic in a spawned task ends that task only: it is caught where the
//! task is polled, the task's future is dropped (its in-flight ops park
//! their buffers as usual), the panic is logged, and its payload goes to
//! the [`JoinHandle`], whose `await` resumes it in the awaiting task
//! ([`JoinHandle::result`] returns it as a [`JoinError`] instead). The
//! other tasks and the loop go on, as in tokio. A panic of the future given
//! to `block_on` itself propagates to its caller.

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::Future;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, RawWaker, RawWakerVTable, Waker};

use slab::Slab;

/// Id of the future passed to `block_on` (it is not in the slab).
const MAIN: usize = usize::MAX;

thread_local! {
    /// The `Shared` of the runtime living on this thread (null if none).
    /// Compared by address: a waker holds its `Arc<Shared>`, so while it
    /// exists no other `Shared` can get that address.
    static LOCAL_SHARED: Cell<*const Shared> = const { Cell::new(std::ptr::null()) };
    /// Task ids woken on this thread by wakers of `LOCAL_SHARED`'s runtime.
    static LOCAL_QUEUE: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
    /// `LOCAL_QUEUE` may be non-empty (a cheap flag: no destructor, so no
    /// lazy-registration check on access).
    static LOCAL_PENDING: Cell<bool> = const { Cell::new(false) };
    /// The `block_on` future was woken on this thread (kept out of the
    /// queue: it is the common wake of the op path).
    static LOCAL_MAIN: Cell<bool> = const { Cell::new(false) };
}

pub(crate) struct Shared {
    queue: Mutex<Vec<usize>>,
    /// Something was pushed since the last collect.
    notified: AtomicBool,
    /// The reactor is (about to be) asleep in epoll.
    pub(crate) sleeping: AtomicBool,
    mio_waker: mio::Waker,
    /// Writes to the waker's eventfd (tests check which wakes need one).
    #[cfg(test)]
    pub(crate) kicks: std::sync::atomic::AtomicUsize,
}

impl Shared {
    /// Makes the epoll fd readable (a syscall).
    fn kick(&self) {
        #[cfg(test)]
        self.kicks.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = self.mio_waker.wake() {
            tracing::warn!(error = %e, "waking the reactor failed");
        }
    }

    fn push(&self, id: usize) {
        self.queue
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push(id);
        self.notified.store(true, Ordering::SeqCst);
        if self.sleeping.load(Ordering::SeqCst) {
            self.kick();
        }
    }
}

struct TaskWaker {
    id: usize,
    scheduled: AtomicBool,
    shared: Arc<Shared>,
}

impl TaskWaker {
    /// Queues the task (once until it is polled). On the executor's own
    /// thread this touches no atomic read-modify-write: the flag is read and
    /// set with plain loads and stores (only this thread clears it, so a
    /// plain load sees its latest clear; a cross-thread wake racing the set
    /// can at worst queue the task twice, a spurious poll). Other threads
    /// swap the flag and push into the mutex-protected queue.
    fn wake_ref(&self) {
        let shared = Arc::as_ptr(&self.shared);
        let ours = LOCAL_SHARED
            .try_with(|l| l.get() == shared)
            .unwrap_or(false);
        if ours {
            if self.scheduled.load(Ordering::Acquire) {
                return;
            }
            self.scheduled.store(true, Ordering::Release);
            let local = if self.id == MAIN {
                LOCAL_MAIN.try_with(|m| m.set(true)).is_ok()
            } else {
                LOCAL_QUEUE
                    .try_with(|q| match q.try_borrow_mut() {
                        Ok(mut q) => {
                            q.push(self.id);
                            // `with`, not `LocalKey::set` (an out-of-line
                            // initialization check per call).
                            LOCAL_PENDING.with(|p| p.set(true));
                            true
                        }
                        Err(_) => false,
                    })
                    .unwrap_or(false)
            };
            if !local {
                self.shared.push(self.id);
            } else if self.shared.sleeping.load(Ordering::SeqCst) {
                // Driven from outside (between turns): the outer poller
                // waits on our epoll fd, so make it readable.
                self.shared.kick();
            }
        } else if !self.scheduled.swap(true, Ordering::AcqRel) {
            self.shared.push(self.id);
        }
    }
}

/// The wakers of the executor's tasks: an `Arc<TaskWaker>` behind a vtable
/// of our own, so that [`is_task_waker`] can recognize them.
static TASK_WAKER_VTABLE: RawWakerVTable = RawWakerVTable::new(
    task_waker_clone,
    task_waker_wake,
    task_waker_wake_by_ref,
    task_waker_drop,
);

/// A waker owning one strong count of `flag`.
fn task_waker(flag: Arc<TaskWaker>) -> Waker {
    let raw = RawWaker::new(Arc::into_raw(flag).cast::<()>(), &TASK_WAKER_VTABLE);
    // SAFETY: the data pointer comes from `Arc::into_raw::<TaskWaker>` and
    // owns one strong count; the vtable's functions treat it as exactly that
    // (clone adds a count, wake and drop give one back, wake_by_ref only
    // borrows), and `TaskWaker` is `Send + Sync`, as `Waker` requires.
    unsafe { Waker::from_raw(raw) }
}

/// # Safety
///
/// `p` is the data pointer of a live waker made by [`task_waker`].
unsafe fn task_waker_clone(p: *const ()) -> RawWaker {
    // SAFETY: `p` comes from `Arc::into_raw::<TaskWaker>` and the waker
    // holding it keeps that count alive during this call.
    unsafe { Arc::increment_strong_count(p.cast::<TaskWaker>()) };
    RawWaker::new(p, &TASK_WAKER_VTABLE)
}

/// # Safety
///
/// `p` is the data pointer of a waker made by [`task_waker`], whose strong
/// count this call consumes.
unsafe fn task_waker_wake(p: *const ()) {
    // SAFETY: the waker being consumed owns this count (caller contract).
    let flag = unsafe { Arc::from_raw(p.cast::<TaskWaker>()) };
    flag.wake_ref();
}

/// # Safety
///
/// `p` is the data pointer of a live waker made by [`task_waker`].
unsafe fn task_waker_wake_by_ref(p: *const ()) {
    // SAFETY: the live waker keeps the `TaskWaker` alive during this call.
    let flag = unsafe { &*p.cast::<TaskWaker>() };
    flag.wake_ref();
}

/// # Safety
///
/// `p` is the data pointer of a waker made by [`task_waker`], whose strong
/// count this call consumes.
unsafe fn task_waker_drop(p: *const ()) {
    // SAFETY: the waker being dropped owns this count (caller contract).
    drop(unsafe { Arc::from_raw(p.cast::<TaskWaker>()) });
}

/// True for the wakers of a verbio executor's tasks (of any runtime). Their
/// wake runs no foreign code: it only queues the task (or, from another
/// thread, pushes it into the runtime's shared queue and kicks its epoll).
#[inline]
pub(crate) fn is_task_waker(w: &Waker) -> bool {
    std::ptr::eq(w.vtable(), &TASK_WAKER_VTABLE)
}

/// Wakes `w` by reference if it is a verbio task waker ([`is_task_waker`])
/// and returns true; false (nothing done) for any other waker. A task that
/// is already queued (the common case when many ops of one task complete
/// in one drain) costs one load here: no call through the vtable, no
/// thread-local lookup.
#[inline(always)]
pub(crate) fn wake_if_task(w: &Waker) -> bool {
    if !is_task_waker(w) {
        return false;
    }
    // SAFETY: `w`'s vtable is `TASK_WAKER_VTABLE`, so its data pointer comes
    // from `Arc::into_raw::<TaskWaker>` (see `task_waker`), and the live
    // waker keeps that `TaskWaker` alive while we borrow it.
    let flag = unsafe { &*w.data().cast::<TaskWaker>() };
    // Already queued: it will be polled (the flag is cleared right before
    // the poll), exactly the early return `wake_ref` itself would take.
    if !flag.scheduled.load(Ordering::Acquire) {
        flag.wake_ref();
    }
    true
}

struct Task {
    future: Option<Pin<Box<dyn Future<Output = ()>>>>,
    waker: Waker,
    flag: Arc<TaskWaker>,
}

pub(crate) struct Executor {
    tasks: RefCell<Slab<Task>>,
    ready: RefCell<VecDeque<usize>>,
    spare: RefCell<Vec<usize>>,
    pub(crate) shared: Arc<Shared>,
    main: Arc<TaskWaker>,
    main_waker: Waker,
    main_woken: Cell<bool>,
}

impl Executor {
    pub(crate) fn new(mio_waker: mio::Waker) -> Executor {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Vec::with_capacity(64)),
            notified: AtomicBool::new(false),
            sleeping: AtomicBool::new(false),
            mio_waker,
            #[cfg(test)]
            kicks: std::sync::atomic::AtomicUsize::new(0),
        });
        let main = Arc::new(TaskWaker {
            id: MAIN,
            scheduled: AtomicBool::new(false),
            shared: shared.clone(),
        });
        // `try_with`: during thread-local teardown wakes just take the
        // cross-thread path.
        let _ = LOCAL_SHARED.try_with(|l| l.set(Arc::as_ptr(&shared)));
        let _ = LOCAL_QUEUE.try_with(|q| {
            if let Ok(mut q) = q.try_borrow_mut() {
                q.clear();
                q.reserve(64);
            }
        });
        let _ = LOCAL_PENDING.try_with(|p| p.set(false));
        let _ = LOCAL_MAIN.try_with(|m| m.set(false));
        Executor {
            tasks: RefCell::new(Slab::with_capacity(64)),
            ready: RefCell::new(VecDeque::with_capacity(64)),
            spare: RefCell::new(Vec::with_capacity(64)),
            shared,
            main_waker: task_waker(main.clone()),
            main,
            main_woken: Cell::new(false),
        }
    }

    pub(crate) fn spawn<F>(&self, fut: F) -> JoinHandle<F::Output>
    where
        F: Future + 'static,
        F::Output: 'static,
    {
        let state = Rc::new(JoinState {
            value: RefCell::new(None),
            panic: RefCell::new(None),
            waker: RefCell::new(None),
            finished: Cell::new(false),
            aborted: Cell::new(false),
            task: RefCell::new(None),
        });
        let task = TaskFuture {
            fut,
            st: Settle(state.clone()),
            done: false,
        };
        let mut tasks = self.tasks.borrow_mut();
        let entry = tasks.vacant_entry();
        let id = entry.key();
        let flag = Arc::new(TaskWaker {
            id,
            scheduled: AtomicBool::new(false),
            shared: self.shared.clone(),
        });
        let waker = task_waker(flag.clone());
        // The task is only ever polled with this waker (by `poll_task`):
        // `abort` wakes it through this copy.
        *state.task.borrow_mut() = Some(waker.clone());
        entry.insert(Task {
            future: Some(Box::pin(task)),
            waker: waker.clone(),
            flag,
        });
        drop(tasks);
        // Scheduled like any wake, so a runtime driven from outside (asleep
        // between turns) sees its epoll fd become readable.
        waker.wake();
        JoinHandle { state }
    }

    /// Moves cross-thread and same-thread wakes into the local ready queue.
    #[inline]
    pub(crate) fn collect(&self) {
        if LOCAL_MAIN.try_with(|m| m.replace(false)).unwrap_or(false) {
            self.main_woken.set(true);
        }
        if LOCAL_PENDING
            .try_with(|p| p.replace(false))
            .unwrap_or(false)
        {
            self.collect_local();
        }
        // A plain load first: the locked swap only when something came in.
        if self.shared.notified.load(Ordering::SeqCst) {
            self.collect_shared();
        }
    }

    /// Moves the cross-thread wakes into the ready queue.
    fn collect_shared(&self) {
        if !self.shared.notified.swap(false, Ordering::SeqCst) {
            return;
        }
        let mut spare = self.spare.borrow_mut();
        {
            let mut q = self
                .shared
                .queue
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            std::mem::swap(&mut *q, &mut *spare);
        }
        let mut ready = self.ready.borrow_mut();
        for id in spare.drain(..) {
            if id == MAIN {
                self.main_woken.set(true);
            } else {
                ready.push_back(id);
            }
        }
    }

    /// Moves the same-thread wakes (see `LOCAL_QUEUE`) into the ready queue.
    fn collect_local(&self) {
        let _ = LOCAL_QUEUE.try_with(|q| {
            let Ok(mut q) = q.try_borrow_mut() else {
                // Not reachable (no user code runs while it is borrowed);
                // keep the ids for the next collect rather than lose them.
                LOCAL_PENDING.with(|p| p.set(true));
                return;
            };
            if q.is_empty() {
                return;
            }
            let mut ready = self.ready.borrow_mut();
            for id in q.drain(..) {
                if id == MAIN {
                    self.main_woken.set(true);
                } else {
                    ready.push_back(id);
                }
            }
        });
    }

    /// Same-thread wakes not collected yet.
    fn has_local(&self) -> bool {
        LOCAL_PENDING.try_with(Cell::get).unwrap_or(false)
            || LOCAL_MAIN.try_with(Cell::get).unwrap_or(false)
    }

    /// Polls up to `budget` ready tasks; returns how many were polled.
    ///
    /// Inline up to the common idle check (every reactor turn makes it):
    /// with no task ready it costs the collect and one test, no call.
    #[inline(always)]
    pub(crate) fn run(&self, budget: usize) -> usize {
        self.collect();
        if budget == 0 || self.ready.borrow().is_empty() {
            return 0;
        }
        self.run_ready(budget)
    }

    /// [`run`](Self::run) with tasks ready (just collected).
    #[inline(never)]
    fn run_ready(&self, budget: usize) -> usize {
        let mut polled = 0;
        while polled < budget {
            let next = self.ready.borrow_mut().pop_front();
            let Some(id) = next else {
                if polled == 0 {
                    // Nothing was ready and nothing ran since the collect
                    // above, so no wake of ours can have come in.
                    break;
                }
                self.collect();
                if self.ready.borrow().is_empty() {
                    break;
                }
                continue;
            };
            self.poll_task(id);
            polled += 1;
        }
        polled
    }

    fn poll_task(&self, id: usize) {
        // The future and the waker are moved out for the poll (no borrow is
        // held while user code runs) and back in after: no refcount traffic.
        let (mut fut, waker) = {
            let mut tasks = self.tasks.borrow_mut();
            let Some(task) = tasks.get_mut(id) else {
                return;
            };
            let Some(fut) = task.future.take() else {
                return;
            };
            task.flag.scheduled.store(false, Ordering::Release);
            (
                fut,
                std::mem::replace(&mut task.waker, Waker::noop().clone()),
            )
        };
        let mut cx = Context::from_waker(&waker);
        match fut.as_mut().poll(&mut cx) {
            Poll::Ready(()) => {
                let task = self.tasks.borrow_mut().try_remove(id);
                drop(task);
                drop(fut);
            }
            Poll::Pending => {
                if let Some(task) = self.tasks.borrow_mut().get_mut(id) {
                    task.future = Some(fut);
                    task.waker = waker;
                }
            }
        }
    }

    /// True if a task or the main future can make progress right now.
    pub(crate) fn has_ready(&self) -> bool {
        !self.ready.borrow().is_empty()
            || self.main_woken.get()
            || self.has_local()
            || self.shared.notified.load(Ordering::SeqCst)
    }

    pub(crate) fn main_waker(&self) -> &Waker {
        &self.main_waker
    }

    /// Takes the "main future was woken" flag.
    #[inline]
    pub(crate) fn take_main_woken(&self) -> bool {
        self.collect();
        let woken = self.main_woken.replace(false);
        if woken {
            self.main.scheduled.store(false, Ordering::Release);
        }
        woken
    }

    pub(crate) fn wake_main(&self) {
        self.main_woken.set(true);
    }

    pub(crate) fn task_count(&self) -> usize {
        self.tasks.borrow().len()
    }

    /// Drops every task (runtime shutdown). Task destructors may spawn or
    /// drop ops; nothing is borrowed while they run.
    pub(crate) fn drop_all(&self) {
        loop {
            let all: Vec<Task> = self.tasks.borrow_mut().drain().collect();
            if all.is_empty() {
                break;
            }
            drop(all);
        }
        self.ready.borrow_mut().clear();
    }
}

impl Drop for Executor {
    fn drop(&mut self) {
        let ours = Arc::as_ptr(&self.shared);
        let _ = LOCAL_SHARED.try_with(|l| {
            if l.get() == ours {
                l.set(std::ptr::null());
                // Ids of our tasks must not reach a later runtime's queue.
                let _ = LOCAL_QUEUE.try_with(|q| {
                    if let Ok(mut q) = q.try_borrow_mut() {
                        q.clear();
                    }
                    let _ = LOCAL_PENDING.try_with(|p| p.set(false));
                    let _ = LOCAL_MAIN.try_with(|m| m.set(false));
                });
            }
        });
    }
}

/// A spawned task's future: polls the user's future until it is done or
/// the task is aborted, then hands the output to the [`JoinHandle`].
struct TaskFuture<F: Future> {
    /// Structurally pinned: polled in place, never moved out, dropped with
    /// the task (which is removed right after its last poll). Declared
    /// first: dropped before `st` tells the handle.
    fut: F,
    st: Settle<F::Output>,
    /// Returned `Ready` already.
    done: bool,
}

/// The task's side of its [`JoinState`]. Dropped with the task: if the
/// task never finished (the runtime shut down with it pending), it marks
/// the state finished without a value and wakes the handle's waiter, which
/// would otherwise wait forever (e.g. a task of another executor awaiting
/// the handle).
struct Settle<T>(Rc<JoinState<T>>);

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

impl<F: Future> Future for TaskFuture<F> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        // SAFETY: only `fut` needs pinning, and it is never moved: it is
        // polled through the `Pin::new_unchecked` below and dropped in
        // place with `self` (`TaskFuture` has no `Drop` impl that could move
        // it); the other fields are never pinned.
        let this = unsafe { self.get_unchecked_mut() };
        if this.done {
            return Poll::Ready(());
        }
        let out = if this.st.0.aborted.get() {
            None
        } else {
            // SAFETY: `fut` lives inside the pinned `self` and is not moved
            // (see above); after a panic it is never polled again (`done`).
            let fut = unsafe { Pin::new_unchecked(&mut this.fut) };
            // Unwind safety: after a panic the future is only dropped (with
            // the task, right after this poll), never polled again, and the
            // runtime holds no borrow while a task runs.
            match catch_unwind(AssertUnwindSafe(|| fut.poll(cx))) {
                Ok(Poll::Pending) => return Poll::Pending,
                Ok(Poll::Ready(v)) => Some(Ok(v)),
                Err(payload) => Some(Err(payload)),
            }
        };
        this.done = true;
        let st = &this.st.0;
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
}

/// The text of a panic payload (`&str` or `String`), else a placeholder.
fn panic_message(payload: &(dyn Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(a non-string panic payload)")
}

struct JoinState<T> {
    value: RefCell<Option<T>>,
    /// The payload of the task's panic, until the handle takes it.
    panic: RefCell<Option<Box<dyn Any + Send>>>,
    waker: RefCell<Option<Waker>>,
    finished: Cell<bool>,
    aborted: Cell<bool>,
    /// The task's own waker, for `abort`.
    task: RefCell<Option<Waker>>,
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
    state: Rc<JoinState<T>>,
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
        /// The panic payload, for [`std::panic::resume_unwind`].
        payload: Box<dyn Any + Send>,
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
            JoinError::Panicked { payload, .. } => Some(payload),
            JoinError::Cancelled => None,
        }
    }
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
                    payload,
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
            Poll::Ready(Err(JoinError::Panicked { payload, .. })) => resume_unwind(payload),
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

#[cfg(test)]
mod tests {
    use std::cell::{Cell, RefCell};
    use std::rc::Rc;
    use std::task::{Poll, Waker};

    use crate::reactor::Runtime;
    use crate::testing::settle;

    /// A task that counts its polls and hands out its waker.
    fn counted(rt: &Runtime) -> (Rc<Cell<u32>>, Rc<RefCell<Option<Waker>>>) {
        let polls = Rc::new(Cell::new(0));
        let waker = Rc::new(RefCell::new(None));
        let (p, w) = (polls.clone(), waker.clone());
        rt.spawn(std::future::poll_fn(move |cx| {
            p.set(p.get() + 1);
            *w.borrow_mut() = Some(cx.waker().clone());
            Poll::<()>::Pending
        }));
        (polls, waker)
    }

    #[test]
    fn same_thread_wakes_of_a_queued_task_poll_it_once() {
        let rt = Runtime::new().unwrap();
        let (polls, waker) = counted(&rt);
        settle(&rt);
        assert_eq!(polls.get(), 1);
        let w = waker.borrow().clone().unwrap();
        assert!(super::is_task_waker(&w));
        w.wake_by_ref();
        w.wake_by_ref();
        // A clone woken by value (the vtable's clone and wake).
        let owned = w.clone();
        owned.wake();
        settle(&rt);
        assert_eq!(polls.get(), 2, "three wakes before the poll: one poll");
        w.wake();
        settle(&rt);
        assert_eq!(polls.get(), 3, "a wake after the poll polls again");
    }

    #[test]
    fn a_finished_task_hands_over_its_output_and_drops_its_future() {
        let rt = Runtime::new().unwrap();
        let held = Rc::new(());
        let h = held.clone();
        let gate = Rc::new(Cell::new(false));
        let g = gate.clone();
        let join = rt.spawn(async move {
            let _h = h;
            std::future::poll_fn(|cx| {
                if g.get() {
                    Poll::Ready(())
                } else {
                    cx.waker().wake_by_ref();
                    Poll::Pending
                }
            })
            .await;
            7u32
        });
        settle(&rt);
        assert!(!join.is_finished());
        assert_eq!(Rc::strong_count(&held), 2, "the running task holds it");
        gate.set(true);
        settle(&rt);
        assert!(join.is_finished());
        assert_eq!(
            Rc::strong_count(&held),
            1,
            "the finished task's future is dropped"
        );
        assert_eq!(rt.block_on(join), 7);
        assert_eq!(rt.task_count(), 0);
    }

    #[test]
    fn cross_thread_wakes_of_a_queued_task_poll_it_once() {
        let rt = Runtime::new().unwrap();
        let (polls, waker) = counted(&rt);
        settle(&rt);
        let w = waker.borrow().clone().unwrap();
        let w2 = w.clone();
        std::thread::spawn(move || {
            w2.wake_by_ref();
            w2.wake();
        })
        .join()
        .unwrap();
        w.wake_by_ref();
        settle(&rt);
        assert_eq!(
            polls.get(),
            2,
            "wakes from both threads before the poll: one poll"
        );
    }
}
