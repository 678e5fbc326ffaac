//! Pass hooks: checks that run once at the end of the first loop pass that
//! begins after they were scheduled, after the tasks that were ready by
//! then have run (and before that pass polls the CQs: a completion the poll
//! finds wakes its task for the next pass, and a hook it schedules fires
//! after that task ran).
//!
//! A library's background task that has work only sometimes (the `Rdma`
//! agent, when the application task it wakes first took the message) is
//! woken from such a check instead of on every event: the check runs on the
//! reactor's own stack, so a pass in which nothing is left to do costs no
//! task poll. Scheduling is possible from a [`Waker`](std::task::Waker)
//! (which must be `Send`): it names the hook by a [`PassHookId`] and finds
//! the runtime through the thread's current one ([`schedule_pass_hook`]).

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use slab::Slab;

use super::Handle;

/// A check run at the end of a loop pass (see the module docs).
pub trait PassHook {
    /// The pass in which this hook was scheduled ended: the tasks woken
    /// before it have been polled.
    fn pass_ended(&self);
}

/// Names a hook added with [`Handle::add_pass_hook`]; plain data, `Send`,
/// so that a waker can hold it. A stale id (the hook was removed, or the
/// id is of another runtime) schedules nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PassHookId {
    runtime: usize,
    key: u32,
    generation: u32,
}

struct Entry {
    hook: Rc<dyn PassHook>,
    generation: u32,
    scheduled: bool,
}

/// The hooks of one runtime and those scheduled for this pass and the next.
#[derive(Default)]
pub(crate) struct PassHooks {
    entries: RefCell<Slab<Entry>>,
    generation: Cell<u32>,
    /// Scheduled since the current pass began: fire at the next pass's end.
    pending: RefCell<Vec<u32>>,
    /// Fire at the end of the current pass.
    due: RefCell<Vec<u32>>,
}

impl PassHooks {
    fn add(&self, runtime: usize, hook: Rc<dyn PassHook>) -> PassHookId {
        let generation = self.generation.get().wrapping_add(1);
        self.generation.set(generation);
        let key = self.entries.borrow_mut().insert(Entry {
            hook,
            generation,
            scheduled: false,
        });
        PassHookId {
            runtime,
            key: key as u32,
            generation,
        }
    }

    fn remove(&self, id: PassHookId) {
        let mut entries = self.entries.borrow_mut();
        let key = id.key as usize;
        if entries
            .get(key)
            .is_some_and(|e| e.generation == id.generation)
        {
            // Dropped outside the borrow: the hook's drop may touch hooks.
            let e = entries.remove(key);
            drop(entries);
            drop(e);
        }
    }

    fn schedule(&self, id: PassHookId) {
        let mut entries = self.entries.borrow_mut();
        if let Some(e) = entries.get_mut(id.key as usize) {
            if e.generation == id.generation && !e.scheduled {
                e.scheduled = true;
                self.pending.borrow_mut().push(id.key);
            }
        }
    }

    /// A pass begins: the hooks scheduled so far fire at its end.
    #[inline(always)]
    pub(crate) fn begin_pass(&self) {
        if !self.pending.borrow().is_empty() {
            self.move_pending();
        }
    }

    #[inline(never)]
    fn move_pending(&self) {
        let mut due = self.due.borrow_mut();
        let mut pending = self.pending.borrow_mut();
        if due.is_empty() {
            std::mem::swap(&mut *due, &mut *pending);
        } else {
            due.append(&mut pending);
        }
    }

    /// Hooks wait for the next pass: the loop must not sleep before it.
    #[inline(always)]
    pub(crate) fn has_pending(&self) -> bool {
        !self.pending.borrow().is_empty()
    }

    /// The pass ends: fires the hooks due.
    #[inline(always)]
    pub(crate) fn end_pass(&self) {
        if !self.due.borrow().is_empty() {
            self.fire_due();
        }
    }

    #[inline(never)]
    fn fire_due(&self) {
        // Taken out: a hook may schedule hooks (they go to `pending`) or
        // add and remove them.
        let mut due = std::mem::take(&mut *self.due.borrow_mut());
        for key in due.drain(..) {
            let hook = {
                let mut entries = self.entries.borrow_mut();
                match entries.get_mut(key as usize) {
                    Some(e) if e.scheduled => {
                        e.scheduled = false;
                        e.hook.clone()
                    }
                    _ => continue,
                }
            };
            hook.pass_ended();
        }
        let mut cur = self.due.borrow_mut();
        if cur.is_empty() {
            // Keep the allocation.
            *cur = due;
        }
    }

    /// Shutdown: forgets every hook.
    pub(crate) fn clear(&self) {
        let entries = std::mem::take(&mut *self.entries.borrow_mut());
        self.pending.borrow_mut().clear();
        self.due.borrow_mut().clear();
        drop(entries);
    }
}

impl Handle {
    /// Adds `hook`, to be run at the end of each loop pass in which it is
    /// scheduled ([`schedule_pass_hook`]), until it is removed
    /// ([`Handle::remove_pass_hook`]) or the runtime is dropped.
    pub fn add_pass_hook(&self, hook: Rc<dyn PassHook>) -> PassHookId {
        self.inner.pass_hooks.add(self.runtime_id(), hook)
    }

    /// Removes the hook `id` names (nothing if it is stale).
    pub fn remove_pass_hook(&self, id: PassHookId) {
        if id.runtime == self.runtime_id() {
            self.inner.pass_hooks.remove(id);
        }
    }

    fn runtime_id(&self) -> usize {
        Rc::as_ptr(&self.inner) as usize
    }
}

/// Schedules the hook `id` names to run at the end of the first loop pass
/// of this thread's runtime that begins after now (once, however often it
/// is scheduled before it runs): the tasks woken before this call and the
/// `block_on` future have been polled by then. False if this thread's
/// current runtime is not the one the hook was added to (or there is none):
/// then nothing is scheduled, and the caller should do the work itself
/// (e.g. wake the task the hook would have woken).
pub fn schedule_pass_hook(id: PassHookId) -> bool {
    Handle::with_current(|h| {
        let ours = h.runtime_id() == id.runtime;
        if ours {
            h.inner.pass_hooks.schedule(id);
        }
        ours
    })
    .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use std::cell::{Cell, RefCell};
    use std::rc::Rc;
    use std::task::Waker;
    use std::time::Duration;

    use super::{schedule_pass_hook, PassHook};
    use crate::reactor::{yield_now, Runtime};

    /// Records what it saw when it ran, and wakes a stored waker.
    #[derive(Default)]
    struct Probe {
        runs: Cell<u32>,
        saw_task: Cell<bool>,
        task_ran: Rc<Cell<bool>>,
        wake: RefCell<Option<Waker>>,
    }

    impl PassHook for Probe {
        fn pass_ended(&self) {
            self.runs.set(self.runs.get() + 1);
            self.saw_task.set(self.task_ran.get());
            if let Some(w) = self.wake.borrow_mut().take() {
                w.wake();
            }
        }
    }

    #[test]
    fn a_hook_runs_once_after_the_tasks_woken_before_it() {
        let rt = Runtime::new().unwrap();
        let probe = Rc::new(Probe::default());
        let id = rt.handle().add_pass_hook(probe.clone());
        let ran = probe.task_ran.clone();
        rt.block_on(async {
            rt.spawn(async move { ran.set(true) });
            assert!(schedule_pass_hook(id));
            assert!(schedule_pass_hook(id), "scheduling again is a no-op");
            // Two passes: the hook has run by the second.
            yield_now().await;
            yield_now().await;
        });
        assert_eq!(probe.runs.get(), 1, "ran once");
        assert!(probe.saw_task.get(), "after the task woken before it");
    }

    #[test]
    fn a_hook_scheduled_from_a_task_keeps_the_loop_awake_until_it_runs() {
        // The main future waits for nothing but the hook: if the loop
        // slept with the hook pending, this would hang.
        let rt = Runtime::new().unwrap();
        let probe = Rc::new(Probe::default());
        let id = rt.handle().add_pass_hook(probe.clone());
        let p = probe.clone();
        let waits = std::future::poll_fn(move |cx| {
            if p.runs.get() > 0 {
                return std::task::Poll::Ready(());
            }
            *p.wake.borrow_mut() = Some(cx.waker().clone());
            // Scheduled from inside a spawned task's poll.
            crate::reactor::spawn(async move {
                assert!(schedule_pass_hook(id));
            });
            std::task::Poll::Pending
        });
        let t = std::time::Instant::now();
        // A timer bounds the test: the loop would sleep until it fires.
        let _ = rt.block_on(crate::reactor::timeout(Duration::from_secs(2), waits));
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "the loop slept with a hook pending"
        );
        assert_eq!(probe.runs.get(), 1);
    }

    #[test]
    fn stale_or_foreign_ids_schedule_nothing() {
        let rt = Runtime::new().unwrap();
        let probe = Rc::new(Probe::default());
        let id = rt.handle().add_pass_hook(probe.clone());
        // Another thread has no runtime (or another one): refused.
        assert!(!std::thread::spawn(move || schedule_pass_hook(id))
            .join()
            .unwrap());
        rt.handle().remove_pass_hook(id);
        rt.block_on(async {
            schedule_pass_hook(id);
            yield_now().await;
            yield_now().await;
        });
        assert_eq!(probe.runs.get(), 0, "a removed hook never runs");
        // The hook's slot reused by another hook: the old id does not name it.
        let other = Rc::new(Probe::default());
        let id2 = rt.handle().add_pass_hook(other.clone());
        assert_ne!(id, id2);
        rt.block_on(async {
            schedule_pass_hook(id);
            yield_now().await;
            yield_now().await;
        });
        assert_eq!(other.runs.get(), 0, "a stale id schedules nothing");
    }
}
