//! The local task queue: `spawn`, wakers and [`JoinHandle`].
//!
//! Tasks live in a slab on the runtime's thread. Their wakers are
//! thread-safe (an `Arc` behind a vtable of our own): waking pushes the task
//! id into a small mutex-protected queue and, only if the reactor is asleep
//! in epoll, kicks the `mio::Waker`. Same-thread wakes therefore cost no
//! syscall, and skip the mutex and atomic read-modify-writes too: a waker
//! that fires on its runtime's own thread (the op path: the reactor
//! completes an op and wakes its task) pushes into a thread-local queue
//! instead. The op table recognizes these wakers (`crate::wake::is_task_waker`) and
//! keeps and wakes them by reference (no refcount traffic per op). While a
//! task runs with nothing else queued on the thread, the first task it
//! wakes goes into a next-task slot (`crate::wake::NextSlot`) instead, and
//! is polled right after it: a chain of tasks waking each other (a small
//! RPC's caller and dispatchers) costs no queue traffic, in FIFO order.
//!
//! A panic in a spawned task ends that task only: it is caught where the
//! task is polled, the task's future is dropped (its in-flight ops park
//! their buffers as usual), the panic is logged, and its payload goes to
//! the [`JoinHandle`], whose `await` resumes it in the awaiting task
//! ([`JoinHandle::result`] returns it as a [`JoinError`] instead). The
//! other tasks and the loop go on, as in tokio. A panic of the future given
//! to `block_on` itself propagates to its caller.

mod join;
mod task;

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::ptr::NonNull;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Waker;

use slab::Slab;

use crate::wake::{
    task_waker, NextSlot, Shared, TaskWaker, LOCAL_MAIN, LOCAL_PENDING, LOCAL_QUEUE, LOCAL_SHARED,
    MAIN,
};
use join::JoinState;
pub use join::{FallibleJoinHandle, JoinError, JoinHandle, JoinResult};
use task::{Run, Settle, TaskFuture};

/// The next task id woken on this thread (`LOCAL_QUEUE`), if any. Clears
/// `LOCAL_PENDING` with the queue's last id, so that the flag also says
/// whether the queue is empty (see [`NextSlot`]).
#[inline(always)]
fn pop_local() -> Option<usize> {
    LOCAL_QUEUE
        .try_with(|q| {
            let mut q = q.try_borrow_mut().ok()?;
            let id = q.pop_front();
            if q.is_empty() {
                LOCAL_PENDING.with(|p| p.set(false));
            }
            id
        })
        .ok()
        .flatten()
}

/// True if no same-thread wake waits in `LOCAL_QUEUE` (see [`pop_local`]).
#[inline(always)]
fn local_queue_empty() -> bool {
    !LOCAL_PENDING.try_with(Cell::get).unwrap_or(true)
}

/// A spawned task: its future (which holds the waker it is polled with)
/// and its wake flag.
struct Task {
    /// A leaked `Box` (freed by `Drop`), pinned: polled in place through
    /// this pointer with no borrow of the slab held (see `poll_task`), not
    /// moved out and back per poll. A raw pointer rather than a `Box`, so
    /// that moving the `Task` (the slab growing during a poll) asserts no
    /// uniqueness over the future being polled.
    future: NonNull<dyn Run>,
    flag: Arc<TaskWaker>,
}

impl Task {
    fn new(future: Box<dyn Run>, flag: Arc<TaskWaker>) -> Task {
        Task {
            // Never null: `Box::into_raw`.
            future: NonNull::from(Box::leak(future)),
            flag,
        }
    }
}

impl Drop for Task {
    fn drop(&mut self) {
        // SAFETY: `future` comes from `Box::leak` (`Task::new`) and is freed
        // only here, once; no poll of it is running (a task is removed from
        // the slab only after its poll returned, see `poll_task`).
        drop(unsafe { Box::from_raw(self.future.as_ptr()) });
    }
}

pub(crate) struct Executor {
    tasks: RefCell<Slab<Task>>,
    ready: RefCell<VecDeque<usize>>,
    /// The ids `run_ready` is polling: taken from the front of `ready` a
    /// batch at a time (the whole queue by a swap, the common case; not
    /// popped one by one), then walked with no borrow held. Kept between
    /// runs for its capacity.
    batch: Cell<VecDeque<usize>>,
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
            outside_set: AtomicBool::new(false),
            outside: Default::default(),
            #[cfg(test)]
            kicks: std::sync::atomic::AtomicUsize::new(0),
        });
        let main = Arc::new(TaskWaker {
            id: MAIN,
            scheduled: AtomicBool::new(false),
            running: AtomicBool::new(false),
            missed: AtomicBool::new(false),
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
            batch: Cell::new(VecDeque::with_capacity(64)),
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
        let mut tasks = self.tasks.borrow_mut();
        let entry = tasks.vacant_entry();
        let id = entry.key();
        let flag = Arc::new(TaskWaker {
            id,
            scheduled: AtomicBool::new(false),
            running: AtomicBool::new(false),
            missed: AtomicBool::new(false),
            shared: self.shared.clone(),
        });
        let waker = task_waker(flag.clone());
        // The task is only ever polled with this waker (by `poll_task`):
        // `abort` wakes it through this copy.
        *state.task.borrow_mut() = Some(waker.clone());
        let task = TaskFuture {
            fut,
            st: Settle(state.clone()),
            waker: waker.clone(),
        };
        entry.insert(Task::new(Box::new(task), flag));
        drop(tasks);
        // Scheduled like any wake, so a runtime driven from outside (asleep
        // between turns) sees its epoll fd become readable.
        waker.wake();
        JoinHandle { state }
    }

    /// Moves cross-thread and same-thread wakes into the local ready queue.
    #[inline]
    pub(crate) fn collect(&self) {
        // The next-task slot first: its task is older than the queue's.
        if let Some(id) = NextSlot::take_for(Arc::as_ptr(&self.shared)) {
            self.ready.borrow_mut().push_back(id);
        }
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
            // `wake_ref` never queues `MAIN` here (it has `LOCAL_MAIN`).
            debug_assert!(!q.contains(&MAIN));
            let mut ready = self.ready.borrow_mut();
            if ready.is_empty() {
                // The common case: the buffers trade places.
                std::mem::swap(&mut *ready, &mut **q);
            } else {
                ready.extend(q.drain(..));
            }
        });
    }

    /// Same-thread wakes not collected yet.
    fn has_local(&self) -> bool {
        LOCAL_PENDING.try_with(Cell::get).unwrap_or(false)
            || LOCAL_MAIN.try_with(Cell::get).unwrap_or(false)
            || NextSlot::holds_for(Arc::as_ptr(&self.shared))
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
    ///
    /// The ready queue is taken a batch at a time (the whole queue by a
    /// swap, the common case: many tasks woken by one CQ drain) and walked
    /// with no borrow held; tasks woken meanwhile on this thread are then
    /// taken one at a time straight from `LOCAL_QUEUE` (FIFO), with no
    /// collect. A task polled with that queue empty is polled with the
    /// next-task slot open ([`NextSlot`]): the first task it wakes is
    /// polled right after it, with no queue in between, so a chain of
    /// wakes (task A wakes B, which wakes C, as a small RPC does) costs a
    /// thread-local store and load per task run, and a task that wakes
    /// itself is polled again at once. Collects again only once both are
    /// empty. Every poll counts against `budget`, the slot's too.
    #[inline(never)]
    fn run_ready(&self, budget: usize) -> usize {
        let mut polled = 0;
        let mut batch = self.batch.take();
        let shared = Arc::as_ptr(&self.shared);
        'turn: while polled < budget {
            {
                let mut ready = self.ready.borrow_mut();
                if !ready.is_empty() {
                    if ready.len() <= budget - polled {
                        std::mem::swap(&mut *ready, &mut batch);
                    } else {
                        batch.extend(ready.drain(..budget - polled));
                    }
                }
            }
            if !batch.is_empty() {
                for &id in &batch {
                    self.poll_task(id);
                }
                polled += batch.len();
                batch.clear();
                continue;
            }
            // The chain of same-thread wakes: the slot's task or a pop, and
            // a look at `ready` (filled only by a nested turn or a missed
            // wake) per task run.
            let mut next = pop_local();
            while let Some(id) = next {
                // Open only with the queue empty: then the first wake of
                // this poll is the oldest one (FIFO).
                let slot = local_queue_empty().then(|| NextSlot::open(shared));
                self.poll_task(id);
                polled += 1;
                next = slot.and_then(NextSlot::close);
                if polled >= budget || !self.ready.borrow().is_empty() {
                    if let Some(id) = next {
                        // Left for the next turn, as the oldest wake (a
                        // nested turn's collect would have closed the slot).
                        self.ready.borrow_mut().push_front(id);
                    }
                    continue 'turn;
                }
                if next.is_none() {
                    next = pop_local();
                }
            }
            // Both empty: the main future's wake and the other threads'
            // wakes (the local queue's flag is cleared).
            self.collect();
            if self.ready.borrow().is_empty() {
                break;
            }
        }
        self.batch.set(batch);
        polled
    }

    #[inline(always)]
    fn poll_task(&self, id: usize) {
        // The future is polled in place with no borrow held (user code
        // runs); `running` keeps a nested turn (a task turning the runtime)
        // from polling it again meanwhile.
        let (fut, flag) = {
            let mut tasks = self.tasks.borrow_mut();
            let Some(task) = tasks.get_mut(id) else {
                return;
            };
            let flag = &*task.flag;
            if flag.running.load(Ordering::Relaxed) {
                // Its `scheduled` flag stays set with the id in no queue:
                // the running poll queues it again (else later wakes,
                // seeing the flag, would queue nothing).
                flag.missed.store(true, Ordering::Relaxed);
                return;
            }
            flag.running.store(true, Ordering::Relaxed);
            flag.scheduled.store(false, Ordering::Release);
            (task.future, flag as *const TaskWaker)
        };
        // SAFETY: the future and the flag stay allocated while the task is
        // in the slab, and it leaves the slab only below, after this poll
        // (a nested `poll_task` of it returns at `running`), or in
        // `drop_all`, which only `Runtime`'s drop calls, never during a
        // poll: the runtime is borrowed by the `block_on` or `turn` that
        // polls. The future was pinned when leaked (`Task::new`) and is
        // only ever used in place; nothing else references it meanwhile.
        let ready = unsafe { Pin::new_unchecked(&mut *fut.as_ptr()) }
            .run()
            .is_ready();
        if ready {
            let task = self.tasks.borrow_mut().try_remove(id);
            drop(task);
        } else {
            // SAFETY: as above, the task is still in the slab.
            let flag = unsafe { &*flag };
            flag.running.store(false, Ordering::Relaxed);
            if flag.missed.load(Ordering::Relaxed) {
                self.requeue_missed(flag, id);
            }
        }
    }

    /// A nested turn took task `id`'s wake while it ran: queued again.
    #[cold]
    #[inline(never)]
    fn requeue_missed(&self, flag: &TaskWaker, id: usize) {
        flag.missed.store(false, Ordering::Relaxed);
        self.ready.borrow_mut().push_back(id);
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
        NextSlot::forget(ours);
        let _ = LOCAL_SHARED.try_with(|l| {
            if l.get() == ours {
                l.set(std::ptr::null());
                // Ids of our tasks must not reach a later runtime's queue;
                // the buffer is freed (the thread-local never drops it).
                let _ = LOCAL_QUEUE.try_with(|q| {
                    if let Ok(mut q) = q.try_borrow_mut() {
                        drop(std::mem::take(&mut **q));
                    }
                    let _ = LOCAL_PENDING.try_with(|p| p.set(false));
                    let _ = LOCAL_MAIN.try_with(|m| m.set(false));
                });
            }
        });
    }
}

#[cfg(test)]
mod tests;
