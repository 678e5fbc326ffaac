//! A runtime driven one poll at a time from whichever thread polls its
//! host (a task of tokio's multi-thread runtime, which may move between
//! worker threads): the thread-local state that makes a [`Runtime`] this
//! thread's current one is installed for the duration of a call and put
//! back after it.
//!
//! A runtime keeps per-thread state beside its `Rc`'d core: the current
//! handle (and through it the pass hooks' pointer), the executor's
//! same-thread wake queue and its flags (`wake.rs`). [`enter`] saves the
//! calling thread's values, installs the runtime's, and on drop collects
//! the same-thread wakes into the runtime's own ready queue (they stay
//! with the runtime, not with the thread) and restores the thread's.
//!
//! [`Runtime`]: crate::Runtime

use std::cell::Cell;
use std::collections::VecDeque;
use std::mem::ManuallyDrop;
use std::rc::{Rc, Weak};
use std::sync::Arc;

use crate::reactor::{Handle, Inner};
use crate::wake::{LOCAL_MAIN, LOCAL_PENDING, LOCAL_QUEUE, LOCAL_SHARED};

/// The calling thread's runtime state, put back when dropped (see the
/// [module docs](self)). `!Send`: dropped on the thread that entered.
pub(crate) struct Entered {
    /// The runtime entered (weak: one dropped inside the guard is gone).
    runtime: Option<Weak<Inner>>,
    saved_current: Option<Handle>,
    saved_shared: *const crate::wake::Shared,
    saved_queue: VecDeque<usize>,
    saved_pending: bool,
    saved_main: bool,
}

/// Makes `handle`'s runtime this thread's current one until the guard is
/// dropped (`None`: no runtime, e.g. to build one whose thread-local
/// state must not outlive the guard).
pub(crate) fn enter(handle: Option<&Handle>) -> Entered {
    let saved_current = Handle::take_current();
    let shared = handle.map_or(std::ptr::null(), |h| Arc::as_ptr(&h.inner.executor.shared));
    let saved_shared = LOCAL_SHARED
        .try_with(|l| l.replace(shared))
        .unwrap_or(std::ptr::null());
    let saved_queue = LOCAL_QUEUE
        .try_with(|q| {
            q.try_borrow_mut()
                .map(|mut q| std::mem::take(&mut **q))
                .unwrap_or_default()
        })
        .unwrap_or_default();
    let saved_pending = LOCAL_PENDING
        .try_with(|p| p.replace(false))
        .unwrap_or(false);
    let saved_main = LOCAL_MAIN.try_with(|m| m.replace(false)).unwrap_or(false);
    if let Some(h) = handle {
        Handle::set_current(Some(h.clone()));
    }
    Entered {
        runtime: handle.map(|h| Rc::downgrade(&h.inner)),
        saved_current,
        saved_shared,
        saved_queue,
        saved_pending,
        saved_main,
    }
}

impl Drop for Entered {
    fn drop(&mut self) {
        // Wakes made on this thread for the runtime go to its ready queue
        // (only while it is still this thread's: a runtime dropped inside
        // the guard took its state with it).
        if let Some(inner) = self.runtime.as_ref().and_then(Weak::upgrade) {
            let ours = Arc::as_ptr(&inner.executor.shared);
            if LOCAL_SHARED.try_with(Cell::get).ok() == Some(ours) {
                inner.executor.collect();
            }
        }
        // The runtime's queue buffer (traded with its ready queue) is
        // freed here; the thread gets its own back.
        let saved = std::mem::take(&mut self.saved_queue);
        let _ = LOCAL_QUEUE.try_with(|q| {
            if let Ok(mut q) = q.try_borrow_mut() {
                let ours = std::mem::replace(&mut *q, ManuallyDrop::new(saved));
                drop(ManuallyDrop::into_inner(ours));
            }
        });
        let _ = LOCAL_PENDING.try_with(|p| p.set(self.saved_pending));
        let _ = LOCAL_MAIN.try_with(|m| m.set(self.saved_main));
        let _ = LOCAL_SHARED.try_with(|l| l.set(self.saved_shared));
        Handle::set_current(self.saved_current.take());
    }
}
