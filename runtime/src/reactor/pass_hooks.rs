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
//!
//! The scheduled hooks are one queue in the order they were scheduled;
//! `begin_pass` marks how many of them are due (those scheduled before the
//! pass began), `end_pass` fires that prefix. Scheduling an already
//! scheduled hook is one flag check. The thread's current hook table is a
//! plain pointer in a thread-local without a destructor, kept in step with
//! the thread's current runtime (`Handle::set_current`).
//!
//! The runtime's own objects schedule hooks without an id: a receive ring
//! schedules its [`PassCheck`] at each completion and each wake of the task
//! waiting on it ([`RecvRing::check_after_wakes`](crate::qp::RecvRing::check_after_wakes)).
//! On the runtime's thread with the runtime at hand, that is a flag check
//! and a push into the same queue; nothing takes it back (a check that
//! finds nothing to do costs about what taking it back would).

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

/// A hook scheduled by the runtime's own objects ([`Handle::schedule_check`]):
/// no id, no table; `listed` makes scheduling it again before it runs one
/// flag check. Its owner can withdraw the reason it was scheduled for
/// ([`PassCheck::withdraw`]): then it is skipped, unless it was also
/// scheduled with `forced`.
pub(crate) struct PassCheck {
    listed: Cell<bool>,
    /// Scheduled, not withdrawn since.
    wanted: Cell<bool>,
    /// Scheduled with `forced` (not withdrawn by `withdraw`).
    forced: Cell<bool>,
    hook: Rc<dyn PassHook>,
}

impl PassCheck {
    pub(crate) fn new(hook: Rc<dyn PassHook>) -> Rc<PassCheck> {
        Rc::new(PassCheck {
            listed: Cell::new(false),
            wanted: Cell::new(false),
            forced: Cell::new(false),
            hook,
        })
    }

    /// What it was scheduled for (other than `forced`) is done: when its
    /// turn comes, it is skipped, unless scheduled again meanwhile.
    #[inline(always)]
    pub(crate) fn withdraw(&self) {
        self.wanted.set(false);
    }

    /// Its turn came: runs the hook unless withdrawn.
    #[inline(always)]
    fn fire(&self) {
        self.listed.set(false);
        if self.wanted.replace(false) | self.forced.replace(false) {
            self.hook.pass_ended();
        }
    }
}

/// A scheduled hook.
enum Scheduled {
    /// An id's hook (key, generation).
    Id(u32, u32),
    Check(Rc<PassCheck>),
}

struct Entry {
    hook: Rc<dyn PassHook>,
    generation: u32,
    scheduled: bool,
}

/// The hooks of one runtime and those scheduled.
#[derive(Default)]
pub(crate) struct PassHooks {
    entries: RefCell<Slab<Entry>>,
    /// Scheduled hooks, oldest first.
    queue: RefCell<Vec<Scheduled>>,
    /// `queue`'s length.
    queued: Cell<usize>,
    /// The first `due` of `queue` fire at the end of the current pass.
    due: Cell<usize>,
    /// A hook is running now.
    firing: Cell<bool>,
    /// Hooks removed while one ran: dropped when it returns (the running
    /// one may be among them, its slot even reused and removed again).
    retired: RefCell<Vec<Rc<dyn PassHook>>>,
    /// `clear` ran while hooks were firing: the rest taken out to fire
    /// do not.
    cleared: Cell<bool>,
}

/// Generations of hook ids, across all runtimes.
static NEXT_GENERATION: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);

thread_local! {
    /// The hooks of this thread's current runtime (null: none). Set and
    /// cleared with the current runtime's handle, which keeps them alive
    /// (`set_hooks_of_current`); no destructor, so reading it is one load.
    static CURRENT_HOOKS: Cell<*const PassHooks> = const { Cell::new(std::ptr::null()) };
}

/// The thread's current runtime became `h` (`None`: none, or the current
/// handle is being dropped). Called by `Handle::set_current` before it
/// replaces the handle it keeps, and when that handle is dropped at thread
/// exit, so the pointer never outlives the handle that keeps it valid.
pub(crate) fn set_hooks_of_current(h: Option<&Handle>) {
    let p = h.map_or(std::ptr::null(), |h| {
        &h.inner.pass_hooks as *const PassHooks
    });
    CURRENT_HOOKS.with(|c| c.set(p));
}

impl PassHooks {
    fn add(&self, runtime: usize, hook: Rc<dyn PassHook>) -> PassHookId {
        // Process-wide: an id of a dropped runtime never matches a hook of
        // a later one at the same address.
        let generation = NEXT_GENERATION.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
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
            let e = entries.remove(key);
            drop(entries);
            if self.firing.get() {
                // A hook is running (maybe this one): dropped once it returns.
                self.retired.borrow_mut().push(e.hook);
            } else {
                // Dropped outside the borrow: the hook's drop may touch hooks.
                drop(e);
            }
        }
    }

    #[inline]
    fn schedule(&self, id: PassHookId) {
        let mut entries = self.entries.borrow_mut();
        if let Some(e) = entries.get_mut(id.key as usize) {
            if e.generation == id.generation && !e.scheduled {
                e.scheduled = true;
                drop(entries);
                self.queue
                    .borrow_mut()
                    .push(Scheduled::Id(id.key, id.generation));
                self.queued.set(self.queued.get() + 1);
            }
        }
    }

    /// Schedules `check` like [`schedule_pass_hook`] schedules an id's
    /// hook: it runs at the end of the first pass that begins after now
    /// (once, however often it is scheduled before).
    #[inline(always)]
    fn schedule_check(&self, check: &Rc<PassCheck>, forced: bool) {
        if forced {
            check.forced.set(true);
        } else {
            check.wanted.set(true);
        }
        if !check.listed.replace(true) {
            self.queue
                .borrow_mut()
                .push(Scheduled::Check(check.clone()));
            self.queued.set(self.queued.get() + 1);
        }
    }

    /// A pass begins: the hooks scheduled so far fire at its end.
    #[inline(always)]
    pub(crate) fn begin_pass(&self) {
        self.due.set(self.queued.get());
    }

    /// Hooks wait for the next pass: the loop must not sleep before it.
    #[inline(always)]
    pub(crate) fn has_pending(&self) -> bool {
        self.queued.get() > self.due.get()
    }

    /// The pass ends: fires the hooks due.
    #[inline(always)]
    pub(crate) fn end_pass(&self) {
        if self.due.get() != 0 {
            self.fire_first();
        }
    }

    /// Fires the hooks due: the usual single check here (a small frame),
    /// the rest in [`PassHooks::fire_due`].
    #[inline(never)]
    fn fire_first(&self) {
        if self.firing.get() {
            // Reentered from a hook (it drove the loop): the outer call
            // fires the rest.
            return;
        }
        let Some(check) = self.only_check() else {
            return self.fire_due();
        };
        if !check.wanted.get() && !check.forced.get() {
            // The usual end of a round trip: its consumer found the ring
            // waiting and withdrew the check; nothing runs, so nothing
            // can be removed or cleared meanwhile.
            check.listed.set(false);
            return;
        }
        self.firing.set(true);
        check.fire();
        self.firing.set(false);
        self.cleared.set(false);
        self.drop_retired();
    }

    #[inline(never)]
    fn fire_due(&self) {
        if self.firing.get() {
            // Reentered from a hook (it drove the loop): the outer call
            // fires the rest.
            return;
        }
        // The queue is taken out: hooks scheduled while these run (by a
        // hook) queue in its place, due at the end of the next pass. A
        // hook may also add and remove hooks, or clear them all.
        let mut queue = self.queue.take();
        let n = self.due.replace(0).min(queue.len());
        self.firing.set(true);
        for s in &queue[..n] {
            if self.cleared.get() {
                // Cleared by a hook: the rest do not run.
                if let Scheduled::Check(c) = s {
                    c.listed.set(false);
                }
                continue;
            }
            match s {
                Scheduled::Check(c) => c.fire(),
                &Scheduled::Id(key, generation) => {
                    let hook: *const dyn PassHook = {
                        let mut entries = self.entries.borrow_mut();
                        match entries.get_mut(key as usize) {
                            Some(e) if e.scheduled && e.generation == generation => {
                                e.scheduled = false;
                                Rc::as_ptr(&e.hook)
                            }
                            _ => continue,
                        }
                    };
                    // SAFETY: the `Rc` the pointer came from stays alive
                    // while the hook runs: while `firing` is set, `remove`
                    // and `clear` move the hooks they take into `retired`,
                    // dropped after the hooks returned.
                    unsafe { &*hook }.pass_ended();
                }
            }
        }
        self.firing.set(false);
        if self.cleared.replace(false) {
            for s in &queue[n..] {
                if let Scheduled::Check(c) = s {
                    c.listed.set(false);
                }
            }
            queue.clear();
        } else if n == queue.len() {
            // The usual case: all of them were due.
            queue.clear();
        } else {
            queue.drain(..n);
        }
        self.drop_retired();
        // Back in place, before those scheduled meanwhile (the usual case:
        // none, and the queue keeps its capacity).
        let mut q = self.queue.borrow_mut();
        if !q.is_empty() {
            queue.append(&mut q);
        }
        *q = queue;
        self.queued.set(q.len());
    }

    /// The usual end of a pass with hooks due: one check, scheduled
    /// before the pass began, and nothing else. Taken out of the queue
    /// (which is then empty).
    #[inline(always)]
    fn only_check(&self) -> Option<Rc<PassCheck>> {
        let mut queue = self.queue.borrow_mut();
        if self.due.get() != 1 || queue.len() != 1 || !matches!(queue[0], Scheduled::Check(_)) {
            return None;
        }
        self.due.set(0);
        self.queued.set(0);
        match queue.pop() {
            Some(Scheduled::Check(c)) => Some(c),
            _ => None,
        }
    }

    /// Drops the hooks removed while hooks ran.
    #[inline(always)]
    fn drop_retired(&self) {
        if !self.retired.borrow().is_empty() {
            self.drop_retired_now();
        }
    }

    #[cold]
    #[inline(never)]
    fn drop_retired_now(&self) {
        let retired = std::mem::take(&mut *self.retired.borrow_mut());
        drop(retired);
    }

    /// Shutdown: forgets every hook.
    pub(crate) fn clear(&self) {
        let entries = std::mem::take(&mut *self.entries.borrow_mut());
        let queue = self.queue.take();
        for s in &queue {
            if let Scheduled::Check(c) = s {
                c.listed.set(false);
            }
        }
        // A check's hook may run anything when dropped: outside the borrow.
        drop(queue);
        self.queued.set(0);
        self.due.set(0);
        if self.firing.get() {
            // Those taken out to fire do not.
            self.cleared.set(true);
            // A hook is running: none is dropped before it returns.
            let mut retired = self.retired.borrow_mut();
            retired.extend(entries.into_iter().map(|(_, e)| e.hook));
        } else {
            drop(entries);
        }
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

    /// Schedules the runtime object's `check` to run at the end of the
    /// first loop pass that begins after now (see [`schedule_pass_hook`]);
    /// on the runtime's thread. `forced`: it runs even if withdrawn
    /// ([`PassCheck::withdraw`]) before then.
    #[inline(always)]
    pub(crate) fn schedule_check(&self, check: &Rc<PassCheck>, forced: bool) {
        self.inner.pass_hooks.schedule_check(check, forced);
    }

    /// The address of the runtime's hook table (what `CURRENT_HOOKS` holds).
    fn runtime_id(&self) -> usize {
        &self.inner.pass_hooks as *const PassHooks as usize
    }
}

/// Schedules the hook `id` names to run at the end of the first loop pass
/// of this thread's runtime that begins after now (once, however often it
/// is scheduled before it runs): the tasks woken before this call and the
/// `block_on` future have been polled by then. False if this thread's
/// current runtime is not the one the hook was added to (or there is none):
/// then nothing is scheduled, and the caller should do the work itself
/// (e.g. wake the task the hook would have woken).
#[inline]
pub fn schedule_pass_hook(id: PassHookId) -> bool {
    let hooks = CURRENT_HOOKS.with(Cell::get);
    if hooks.is_null() || hooks as usize != id.runtime {
        return false;
    }
    // SAFETY: a non-null `CURRENT_HOOKS` points into the `Inner` of the
    // handle this thread's `CURRENT` holds, which keeps it alive; it is
    // reset before that handle is replaced or dropped (`set_hooks_of_current`).
    unsafe { &*hooks }.schedule(id);
    true
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

    /// Logs its name when it runs; may schedule another hook, or remove
    /// itself, when it does.
    struct Logger {
        name: &'static str,
        log: Rc<RefCell<Vec<&'static str>>>,
        then_schedule: Cell<Option<super::PassHookId>>,
        remove_self: Cell<Option<super::PassHookId>>,
        /// After removing itself, adds a hook (which takes its slot) and
        /// removes that one too.
        churn_slot: Cell<bool>,
        dropped: Rc<Cell<bool>>,
        dropped_while_running: Rc<Cell<bool>>,
    }

    impl Logger {
        fn new(name: &'static str, log: &Rc<RefCell<Vec<&'static str>>>) -> Logger {
            Logger {
                name,
                log: log.clone(),
                then_schedule: Cell::new(None),
                remove_self: Cell::new(None),
                churn_slot: Cell::new(false),
                dropped: Rc::default(),
                dropped_while_running: Rc::default(),
            }
        }
    }

    impl PassHook for Logger {
        fn pass_ended(&self) {
            self.log.borrow_mut().push(self.name);
            if let Some(id) = self.then_schedule.get() {
                assert!(schedule_pass_hook(id));
            }
            if let Some(id) = self.remove_self.take() {
                let h = crate::reactor::Handle::current();
                h.remove_pass_hook(id);
                if self.churn_slot.get() {
                    let other = h.add_pass_hook(Rc::new(Logger::new("C", &self.log)));
                    assert_eq!(other.key, id.key, "the slot is reused");
                    h.remove_pass_hook(other);
                }
                // Still alive: the runtime keeps it until this returns.
                self.dropped_while_running.set(self.dropped.get());
                self.log.borrow_mut().push("removed");
            }
        }
    }

    impl Drop for Logger {
        fn drop(&mut self) {
            self.dropped.set(true);
        }
    }

    #[test]
    fn a_hook_scheduled_by_a_hook_runs_at_the_end_of_the_next_pass() {
        let rt = Runtime::new().unwrap();
        let log = Rc::new(RefCell::new(Vec::new()));
        let b = rt.handle().add_pass_hook(Rc::new(Logger::new("B", &log)));
        let a_hook = Logger::new("A", &log);
        a_hook.then_schedule.set(Some(b));
        let a = rt.handle().add_pass_hook(Rc::new(a_hook));
        let l = log.clone();
        rt.block_on(async move {
            assert!(schedule_pass_hook(a));
            for _ in 0..3 {
                l.borrow_mut().push("main");
                yield_now().await;
            }
        });
        assert_eq!(
            *log.borrow(),
            ["main", "A", "main", "B", "main"],
            "one pass each, the loop did not sleep in between"
        );
    }

    #[test]
    fn a_check_runs_once_at_the_end_of_the_next_pass_in_turn_with_the_id_hooks() {
        let rt = Runtime::new().unwrap();
        let log = Rc::new(RefCell::new(Vec::new()));
        let a = rt.handle().add_pass_hook(Rc::new(Logger::new("A", &log)));
        let check = super::PassCheck::new(Rc::new(Logger::new("C", &log)));
        let h = rt.handle().clone();
        let l = log.clone();
        rt.block_on(async move {
            assert!(schedule_pass_hook(a));
            h.schedule_check(&check, false);
            h.schedule_check(&check, false);
            l.borrow_mut().push("main");
            yield_now().await;
            // Alone (the usual case), and again while it waits.
            h.schedule_check(&check, false);
            l.borrow_mut().push("main");
            yield_now().await;
            l.borrow_mut().push("main");
            yield_now().await;
            // Scheduled from a task of the pass: due a pass later.
            let c = check.clone();
            crate::reactor::spawn(async move {
                crate::reactor::Handle::current().schedule_check(&c, false)
            });
            l.borrow_mut().push("main");
            yield_now().await;
            l.borrow_mut().push("main");
            yield_now().await;
            l.borrow_mut().push("main");
        });
        assert_eq!(
            *log.borrow(),
            ["main", "A", "C", "main", "C", "main", "main", "main", "C", "main"]
        );
    }

    #[test]
    fn a_hook_removing_itself_while_it_runs_is_dropped_after_it_returns() {
        removing_itself(false);
    }

    /// The same, when it also adds a hook that takes its slot and removes
    /// that one before it returns.
    #[test]
    fn a_hook_that_removes_itself_and_a_hook_in_its_slot_is_dropped_after_it_returns() {
        removing_itself(true);
    }

    fn removing_itself(churn: bool) {
        let rt = Runtime::new().unwrap();
        let log = Rc::new(RefCell::new(Vec::new()));
        let hook = Logger::new("A", &log);
        let (dropped, early) = (hook.dropped.clone(), hook.dropped_while_running.clone());
        let hook = Rc::new(hook);
        let id = rt.handle().add_pass_hook(hook.clone());
        hook.remove_self.set(Some(id));
        hook.churn_slot.set(churn);
        drop(hook); // the runtime holds the only reference
        rt.block_on(async {
            assert!(schedule_pass_hook(id));
            yield_now().await;
            yield_now().await;
            schedule_pass_hook(id);
            yield_now().await;
            yield_now().await;
        });
        assert_eq!(*log.borrow(), ["A", "removed"], "ran once");
        assert!(!early.get(), "not dropped while it ran");
        assert!(dropped.get(), "dropped once it returned");
    }

    #[test]
    fn a_removed_hook_due_this_pass_does_not_fire_the_hook_reusing_its_slot_early() {
        let rt = Runtime::new().unwrap();
        let log = Rc::new(RefCell::new(Vec::new()));
        let a = rt.handle().add_pass_hook(Rc::new(Logger::new("A", &log)));
        let h = rt.handle().clone();
        let (l, l2) = (log.clone(), log.clone());
        rt.block_on(async move {
            // Scheduled inside pass 1's task run: due at the end of pass 2.
            crate::reactor::spawn(async move { assert!(schedule_pass_hook(a)) });
            yield_now().await;
            // Inside pass 2's task run: A goes, B takes its slot and is
            // scheduled, due at the end of pass 3 (not at pass 2's, where
            // A's queue entry is).
            crate::reactor::spawn(async move {
                h.remove_pass_hook(a);
                let b = h.add_pass_hook(Rc::new(Logger::new("B", &l2)));
                assert!(schedule_pass_hook(b));
            });
            l.borrow_mut().push("main 2");
            yield_now().await;
            l.borrow_mut().push("main 3");
            yield_now().await;
            l.borrow_mut().push("main 4");
        });
        assert_eq!(*log.borrow(), ["main 2", "main 3", "B", "main 4"]);
    }
}
