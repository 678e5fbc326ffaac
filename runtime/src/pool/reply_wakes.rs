//! Answers' wakes batched per reactor pass on a pool thread.
//!
//! A runtime thread that answers requests from tokio tasks wakes each
//! asker when its answer is ready ([`Completer::complete`](super::Completer::complete)).
//! Woken one at a time in the middle of the pass, a parked worker of the
//! asking runtime is unparked by the first, runs that one task, finds
//! nothing more (the next answer is a few microseconds away) and parks
//! again, to be unparked by the next: a futex wake and a context switch
//! per answer (measured with `pool_echo`, 64 B, 32 in flight: 0.7 unparks
//! of a tokio worker per message, each unparking the other worker too).
//! Here the wakes of a pass are kept and given at the end of the next pass
//! (a [`PassHook`]), all at once: the asking runtime's worker, unparked by
//! the first, finds the others' tasks queued behind it. A wake for a task
//! of tokio's multi-thread runtime goes through that runtime's relay
//! ([`relay`]): handed there, each relay rung once per pass.
//!
//! Only on a pool thread while its loop runs ([`enable`] .. [`disable`]);
//! elsewhere, and for a slot dropped unanswered, the wake is immediate.
//! `disable` (when the loop returns, or unwinds) gives the wakes still
//! kept, so no answer waits for a pass that never comes.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::task::Waker;

use smallvec::SmallVec;

use super::relay::{self, Relay};
use crate::reactor::{schedule_pass_hook, Handle, PassHook, PassHookId};

/// A kept wake: the asker's waker and the relay it is delivered through
/// (`None`: woken directly; see [`relay`]).
type Kept = (Waker, Option<&'static Relay>);

thread_local! {
    /// This pool thread's batch, while its loop runs.
    static BATCH: RefCell<Option<Batch>> = const { RefCell::new(None) };
    /// Answers made here wake their askers directly, relay or not: set
    /// while a hosted runtime turns on a worker of the askers' own tokio
    /// runtime (`super::hosted`), where a wake is a local schedule.
    static DIRECT: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with this thread's answer wakes given directly (see `DIRECT`).
#[cfg(feature = "tokio")]
pub(super) fn direct<R>(f: impl FnOnce() -> R) -> R {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            let _ = DIRECT.try_with(|d| d.set(self.0));
        }
    }
    let _reset = Reset(DIRECT.try_with(|d| d.replace(true)).unwrap_or(false));
    f()
}

struct Batch {
    hook: PassHookId,
    handle: Handle,
    kept: Rc<RefCell<Vec<Kept>>>,
}

/// The hook: gives the kept wakes.
struct Give(Rc<RefCell<Vec<Kept>>>);

impl PassHook for Give {
    fn pass_ended(&self) {
        give(&self.0);
    }
}

/// Wakes every kept waker (none is kept while they run: a wake that
/// completes another answer on this thread keeps it for the next pass).
fn give(kept: &RefCell<Vec<Kept>>) {
    let mut wakers = std::mem::take(&mut *kept.borrow_mut());
    // Each relay is rung once, after every waker for it was handed.
    let mut rings: SmallVec<[&'static Relay; 2]> = SmallVec::new();
    for (w, r) in wakers.drain(..) {
        match r {
            None => w.wake(),
            Some(r) => {
                if relay::hand(r, w) && !rings.iter().any(|x| std::ptr::eq(*x, r)) {
                    rings.push(r);
                }
            }
        }
    }
    for r in rings {
        relay::ring(r);
    }
    // The buffer goes back (no allocation per pass), unless a wake kept
    // another meanwhile.
    let mut k = kept.borrow_mut();
    if k.is_empty() {
        *k = wakers;
    }
}

/// Batches this thread's answer wakes into the passes of `handle`'s loop,
/// until [`disable`].
pub(super) fn enable(handle: &Handle) {
    let kept = Rc::new(RefCell::new(Vec::new()));
    let hook = handle.add_pass_hook(Rc::new(Give(kept.clone())));
    let old = BATCH.with(|b| {
        b.borrow_mut().replace(Batch {
            hook,
            handle: handle.clone(),
            kept,
        })
    });
    if let Some(old) = old {
        finish(old);
    }
}

/// Stops batching on this thread and gives the wakes still kept.
pub(super) fn disable() {
    if let Some(b) = BATCH.try_with(|b| b.borrow_mut().take()).ok().flatten() {
        finish(b);
    }
}

fn finish(b: Batch) {
    b.handle.remove_pass_hook(b.hook);
    give(&b.kept);
}

/// Wakes `w` (through the relay `via`, if any) at the end of the next pass
/// of this pool thread's loop, or now if this thread batches nothing (or
/// its loop is not the current runtime).
pub(super) fn wake(w: Waker, via: Option<&'static Relay>) {
    let mut w = Some((w, via));
    let _ = BATCH.try_with(|b| {
        if let Some(batch) = &*b.borrow() {
            if schedule_pass_hook(batch.hook) {
                batch.kept.borrow_mut().extend(w.take());
            }
        }
    });
    if let Some((w, via)) = w {
        wake_now(w, via);
    }
}

/// Wakes `w` now, through the relay `via` if any.
fn wake_now(w: Waker, via: Option<&'static Relay>) {
    let Some(r) = via else { return w.wake() };
    if DIRECT.try_with(Cell::get).unwrap_or(false) {
        return w.wake();
    }
    if relay::hand(r, w) {
        relay::ring(r);
    }
}
