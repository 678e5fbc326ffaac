//! A waker kept for the task that polls again.

use std::task::{Context, Waker};

/// Keeps `cx`'s waker in `slot`, unless the one there wakes the same task
/// already (no clone, no drop per poll).
#[inline(always)]
pub(crate) fn keep_waker(slot: &mut Option<Waker>, cx: &Context<'_>) {
    match slot {
        Some(w) if w.will_wake(cx.waker()) => {}
        w => *w = Some(cx.waker().clone()),
    }
}
