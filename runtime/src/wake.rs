//! The wakers of the runtime's tasks: an `Arc<TaskWaker>` behind a vtable
//! of our own. Waking pushes the task id into a thread-local queue when it
//! happens on the runtime's own thread (no mutex, no atomic read-modify-write,
//! no syscall), else into the runtime's mutex-protected [`Shared`] queue,
//! kicking the reactor's `mio::Waker` only if it sleeps in epoll.
//!
//! The op table recognizes these wakers ([`is_task_waker`]) and keeps and
//! wakes them by reference ([`wake_if_task`]): no refcount traffic per op.
//! This module sits below the op layer; the executor
//! (`reactor/executor/mod.rs`) creates the wakers, drains the queues and
//! polls the task in its next-task slot ([`NextSlot`]).

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{RawWaker, RawWakerVTable, Waker};

/// Id of the future passed to `block_on` (it is not in the slab).
pub(crate) const MAIN: usize = usize::MAX;

thread_local! {
    /// The `Shared` of the runtime living on this thread (null if none).
    /// Compared by address: a waker holds its `Arc<Shared>`, so while it
    /// exists no other `Shared` can get that address.
    pub(crate) static LOCAL_SHARED: Cell<*const Shared> = const { Cell::new(std::ptr::null()) };
    /// Task ids woken on this thread by wakers of `LOCAL_SHARED`'s runtime
    /// (never `MAIN`: see `LOCAL_MAIN`). Without drop glue, so that a wake
    /// makes no lazy-registration check of the thread-local: the executor
    /// frees the buffer when it is dropped (a thread that exits with a
    /// live runtime leaks it).
    /// A deque, as the executor's ready queue is: the two trade buffers
    /// with no conversion.
    pub(crate) static LOCAL_QUEUE: RefCell<ManuallyDrop<VecDeque<usize>>> =
        const { RefCell::new(ManuallyDrop::new(VecDeque::new())) };
    /// `LOCAL_QUEUE` may be non-empty (a cheap flag: no destructor, so no
    /// lazy-registration check on access).
    pub(crate) static LOCAL_PENDING: Cell<bool> = const { Cell::new(false) };
    /// The `block_on` future was woken on this thread (kept out of the
    /// queue: it is the common wake of the op path).
    pub(crate) static LOCAL_MAIN: Cell<bool> = const { Cell::new(false) };
    /// The next-task slot's owner: the `Shared` of the executor polling a
    /// task on this thread with the slot open (null: closed). See
    /// [`NextSlot`].
    static NEXT_OPEN: Cell<*const Shared> = const { Cell::new(std::ptr::null()) };
    /// The task the slot holds ([`NO_TASK`]: none yet).
    static NEXT_ID: Cell<usize> = const { Cell::new(NO_TASK) };
}

/// [`NEXT_ID`] holding no task (slab keys never reach it; [`MAIN`] is
/// never put in the slot).
const NO_TASK: usize = usize::MAX - 1;

/// The executor's next-task slot on this thread: while the executor polls
/// a task with nothing else queued on this thread, the first task that
/// poll wakes (a task of the same executor, not scheduled yet) is put here
/// instead of the same-thread queue, and the executor polls it next. A
/// chain of wakes (task A wakes B, which wakes C: a small RPC's caller,
/// server and client dispatchers) so costs a thread-local store per wake
/// and a load per task run: no queue borrow, push and pop, no pending
/// flag, no check of the reactor's sleep. The order is the queue's (FIFO):
/// the slot opens only when the same-thread queue is empty, so the task in
/// it is the oldest wake; the wakes after it go to the queue as before.
///
/// A poll may turn a runtime (the same one nested, or another one entered
/// on this thread): each open saves the slot's state and its close puts it
/// back, and a collect of the owning executor takes a filled slot into its
/// ready queue and closes it, so a task id only ever reaches its own
/// executor's queue, in order.
pub(crate) struct NextSlot {
    saved_open: *const Shared,
    saved_id: usize,
}

impl NextSlot {
    /// Opens the slot for `shared`'s executor (on its own thread, around
    /// the poll of one task).
    #[inline(always)]
    pub(crate) fn open(shared: *const Shared) -> NextSlot {
        NextSlot {
            saved_open: NEXT_OPEN.with(|o| o.replace(shared)),
            saved_id: NEXT_ID.with(|i| i.replace(NO_TASK)),
        }
    }

    /// Closes the slot (puts back the state `open` found); returns the
    /// task put in it meanwhile, if any.
    #[inline(always)]
    pub(crate) fn close(self) -> Option<usize> {
        NEXT_OPEN.with(|o| o.set(self.saved_open));
        let id = NEXT_ID.with(|i| i.replace(self.saved_id));
        (id != NO_TASK).then_some(id)
    }

    /// For `shared`'s executor collecting its wakes: the task in the slot
    /// if it is open for that executor, which closes it (the wakes after
    /// go to the queue, behind the ones collected now).
    #[inline(always)]
    pub(crate) fn take_for(shared: *const Shared) -> Option<usize> {
        if NEXT_OPEN.try_with(Cell::get).ok()? != shared {
            return None;
        }
        NEXT_OPEN.with(|o| o.set(std::ptr::null()));
        let id = NEXT_ID.with(|i| i.replace(NO_TASK));
        (id != NO_TASK).then_some(id)
    }

    /// True if the slot, open for `shared`'s executor, holds a task.
    #[inline]
    pub(crate) fn holds_for(shared: *const Shared) -> bool {
        NEXT_OPEN.try_with(Cell::get).ok() == Some(shared)
            && NEXT_ID.try_with(Cell::get).ok() != Some(NO_TASK)
    }

    /// Clears the slot if `shared`'s executor owns it (the executor's
    /// drop: its ids must not reach a later runtime).
    pub(crate) fn forget(shared: *const Shared) {
        if NEXT_OPEN.try_with(Cell::get).ok() == Some(shared) {
            let _ = NEXT_OPEN.try_with(|o| o.set(std::ptr::null()));
            let _ = NEXT_ID.try_with(|i| i.set(NO_TASK));
        }
    }

    /// Puts task `id` of `shared`'s executor in the slot if it is open
    /// for that executor and empty; false otherwise.
    #[inline(always)]
    fn offer(shared: *const Shared, id: usize) -> bool {
        NEXT_OPEN
            .try_with(|o| {
                o.get() == shared
                    && NEXT_ID.with(|i| {
                        let empty = i.get() == NO_TASK;
                        if empty {
                            i.set(id);
                        }
                        empty
                    })
            })
            .unwrap_or(false)
    }
}

pub(crate) struct Shared {
    pub(crate) queue: Mutex<Vec<usize>>,
    /// Something was pushed since the last collect.
    pub(crate) notified: AtomicBool,
    /// The reactor is (about to be) asleep in epoll.
    pub(crate) sleeping: AtomicBool,
    pub(crate) mio_waker: mio::Waker,
    /// Set for a runtime turned by a task of another executor on any of
    /// its threads (the pool's hosted runtimes): a kick wakes that task
    /// (`outside`) instead of writing the epoll fd's eventfd, so that a
    /// wake from one of the executor's workers is a local schedule there,
    /// not an event for whichever worker waits in the executor's reactor.
    pub(crate) outside_set: AtomicBool,
    /// The driving task's waker (see `outside_set`).
    pub(crate) outside: futures::task::AtomicWaker,
    /// Writes to the waker's eventfd (tests check which wakes need one).
    #[cfg(test)]
    pub(crate) kicks: std::sync::atomic::AtomicUsize,
}

impl Shared {
    /// Makes the epoll fd readable (a syscall).
    #[cold]
    pub(crate) fn kick(&self) {
        #[cfg(test)]
        self.kicks.fetch_add(1, Ordering::Relaxed);
        if self.outside_set.load(Ordering::Acquire) {
            return self.outside.wake();
        }
        if let Err(e) = self.mio_waker.wake() {
            tracing::warn!(error = %crate::report::ErrorChain(&e), "waking the reactor failed");
        }
    }

    /// Queues task `id` from another thread (or with the local queue
    /// unavailable); kicks the reactor if it sleeps.
    #[inline(never)]
    pub(crate) fn push(&self, id: usize) {
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

pub(crate) struct TaskWaker {
    pub(crate) id: usize,
    pub(crate) scheduled: AtomicBool,
    /// The executor is polling the task (its thread only reads and writes
    /// it; atomic only so that the waker stays `Sync`).
    pub(crate) running: AtomicBool,
    /// A nested turn took the task's id from the ready queue while the task
    /// was running (and so did not poll it): the running poll queues it
    /// again when it returns.
    pub(crate) missed: AtomicBool,
    pub(crate) shared: Arc<Shared>,
}

impl TaskWaker {
    /// Queues the task (once until it is polled). On the executor's own
    /// thread this touches no atomic read-modify-write: the flag is read and
    /// set with plain loads and stores (only this thread clears it, so a
    /// plain load sees its latest clear; a cross-thread wake racing the set
    /// can at worst queue the task twice, a spurious poll). Other threads
    /// swap the flag and push into the mutex-protected queue.
    #[inline(always)]
    pub(crate) fn wake_ref(&self) {
        if self.is_local() {
            if self.scheduled.load(Ordering::Acquire) {
                return;
            }
            self.wake_local_outlined();
        } else {
            self.wake_remote();
        }
    }

    /// True on the thread of the runtime the task belongs to.
    #[inline(always)]
    fn is_local(&self) -> bool {
        let shared = Arc::as_ptr(&self.shared);
        LOCAL_SHARED
            .try_with(|l| l.get() == shared)
            .unwrap_or(false)
    }

    /// [`wake_ref`](Self::wake_ref) from another thread.
    #[inline(always)]
    fn wake_remote(&self) {
        if !self.scheduled.swap(true, Ordering::AcqRel) {
            self.shared.push(self.id);
        }
    }

    /// [`wake_ref`](Self::wake_ref) on the runtime's thread, of a task not
    /// scheduled (as just read).
    #[inline(always)]
    fn wake_local(&self) {
        self.scheduled.store(true, Ordering::Release);
        // The executor is polling a task on this thread and polls this one
        // next (no queue, no kick: the executor runs, so it is awake).
        if !self.offer_next() {
            self.wake_queue();
        }
    }

    /// [`wake_local`](Self::wake_local) with the queue's path out of line,
    /// for the waker's vtable: the slot's path then saves no registers.
    #[inline(always)]
    fn wake_local_outlined(&self) {
        self.scheduled.store(true, Ordering::Release);
        if !self.offer_next() {
            self.wake_queue_outlined();
        }
    }

    /// Puts the task in the executor's next-task slot if it is open for
    /// this task's executor ([`NextSlot`]); false if not.
    #[inline(always)]
    fn offer_next(&self) -> bool {
        self.id != MAIN && NextSlot::offer(Arc::as_ptr(&self.shared), self.id)
    }

    #[inline(never)]
    fn wake_queue_outlined(&self) {
        self.wake_queue();
    }

    /// [`wake_local`](Self::wake_local) with the next-task slot closed
    /// or full: into the same-thread queue.
    #[inline(always)]
    fn wake_queue(&self) {
        let local = if self.id == MAIN {
            LOCAL_MAIN.try_with(|m| m.set(true)).is_ok()
        } else {
            LOCAL_QUEUE
                .try_with(|q| match q.try_borrow_mut() {
                    Ok(mut q) => {
                        q.push_back(self.id);
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
pub(crate) fn task_waker(flag: Arc<TaskWaker>) -> Waker {
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
        // `wake_ref` without its second look at the flag.
        if flag.is_local() {
            flag.wake_local();
        } else {
            flag.wake_remote();
        }
    }
    true
}
