//! The completion slot: how an answer made on a runtime thread reaches the
//! future that asked for it on another thread, with no lock and, when
//! slots are recycled ([`SlotCache`]), no allocation per request.
//!
//! A [`Completer`] (the runtime thread's end) either
//! [completes](Completer::complete) the slot or, dropped unanswered (its
//! task panicked, its runtime shut down, the message carrying it was
//! dropped), marks it lost: the [`Answer`] (the asking future's end) never
//! waits for an answer that cannot come.

use std::cell::UnsafeCell;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::task::AtomicWaker;

use super::relay::{self, Relay};

const EMPTY: u8 = 0;
const FULL: u8 = 1;
const LOST: u8 = 2;
const TAKEN: u8 = 3;

/// One answer's cell, shared by a [`Completer`] and an [`Answer`].
pub struct Slot<T> {
    state: AtomicU8,
    /// # Invariant
    /// Initialized exactly while `state` is `FULL`.
    value: UnsafeCell<MaybeUninit<T>>,
    waker: AtomicWaker,
    /// The relay `waker` is delivered through (null: woken directly), set
    /// by the asker before it registers `waker` (see `super::relay`).
    relay: AtomicPtr<Relay>,
    /// The answer was dropped (nobody will read the value).
    abandoned: AtomicBool,
    /// The completer's task, woken when the answer is dropped.
    abandon_waker: AtomicWaker,
}

// SAFETY: `value` is written by the one `Completer` before it publishes
// `FULL` (release) and read by the one `Answer` after it sees `FULL`
// (acquire), which then moves it out and marks it `TAKEN`: never accessed
// by two threads at once. Moving a `T` between threads needs `T: Send`.
unsafe impl<T: Send> Sync for Slot<T> {}
// SAFETY: as above; the slot owns at most one `T`.
unsafe impl<T: Send> Send for Slot<T> {}

impl<T> Slot<T> {
    fn new() -> Slot<T> {
        Slot {
            state: AtomicU8::new(EMPTY),
            value: UnsafeCell::new(MaybeUninit::uninit()),
            waker: AtomicWaker::new(),
            relay: AtomicPtr::new(std::ptr::null_mut()),
            abandoned: AtomicBool::new(false),
            abandon_waker: AtomicWaker::new(),
        }
    }
}

impl<T> Drop for Slot<T> {
    fn drop(&mut self) {
        if *self.state.get_mut() == FULL {
            // SAFETY: `FULL` means initialized (the invariant), and nobody
            // else can reach the slot any more (`&mut self`).
            unsafe { self.value.get_mut().assume_init_drop() };
        }
    }
}

/// A new slot's two ends.
pub fn slot<T: Send>() -> (Completer<T>, Answer<T>) {
    let s = Arc::new(Slot::new());
    (
        Completer {
            slot: Some(s.clone()),
        },
        Answer {
            slot: Some(s),
            spin: Duration::ZERO,
        },
    )
}

/// The answering end: completes the slot once, or marks it lost when
/// dropped unanswered. `Send`.
pub struct Completer<T: Send> {
    slot: Option<Arc<Slot<T>>>,
}

impl<T: Send> std::fmt::Debug for Completer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completer").finish_non_exhaustive()
    }
}

impl<T: Send> Completer<T> {
    /// Hands `value` to the asking future and wakes it.
    pub fn complete(mut self, value: T) {
        let Some(s) = self.slot.take() else { return };
        // SAFETY: the state is `EMPTY` (a completer completes once; an
        // `Answer` never writes the value), so nobody reads `value` until
        // the `FULL` store below publishes it.
        unsafe { (*s.value.get()).write(value) };
        s.state.store(FULL, Ordering::Release);
        // On a pool thread, given with the other answers of the pass.
        let via = s.relay.load(Ordering::Relaxed);
        if let Some(w) = take_waker_and_release(s) {
            // SAFETY: a non-null `relay` is a `&'static Relay` the asker
            // stored (`Answer::poll`) before registering the waker taken
            // here (the waker's registration orders the store before the
            // take; a stale one from an earlier use of the slot still names
            // a relay, which wakes correctly).
            let via = unsafe { via.cast_const().as_ref() };
            super::reply_wakes::wake(w, via);
        }
    }

    /// True if the asking future is gone (nobody will read the answer).
    pub fn is_abandoned(&self) -> bool {
        self.slot
            .as_ref()
            .is_none_or(|s| s.abandoned.load(Ordering::Acquire))
    }

    /// Ready once the asking future is gone: a request that waits (for a
    /// message, a connection) races it, so that what it would take is left
    /// for the next asker rather than answered to nobody.
    pub fn poll_abandoned(&self, cx: &mut Context<'_>) -> Poll<()> {
        let Some(s) = &self.slot else {
            return Poll::Ready(());
        };
        s.abandon_waker.register(cx.waker());
        if s.abandoned.load(Ordering::Acquire) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }

    /// Completes when the asking future is gone ([`poll_abandoned`](Self::poll_abandoned)).
    pub async fn abandoned(&self) {
        std::future::poll_fn(|cx| self.poll_abandoned(cx)).await
    }
}

impl<T: Send> Drop for Completer<T> {
    fn drop(&mut self) {
        if let Some(s) = self.slot.take() {
            s.state.store(LOST, Ordering::Release);
            wake_after_release(s);
        }
    }
}

/// Wakes the asker of `s` (whose state was just published) after letting go
/// of the completer's reference: the woken asker finds itself the slot's
/// only holder, so that [`SlotCache::give_back`] can recycle it.
fn wake_after_release<T>(s: Arc<Slot<T>>) {
    if let Some(w) = take_waker_and_release(s) {
        w.wake();
    }
}

/// The asker's waker of `s` (whose state was just published), taken after
/// letting go of the completer's reference (see [`wake_after_release`]).
fn take_waker_and_release<T>(s: Arc<Slot<T>>) -> Option<std::task::Waker> {
    // Taken after the state's store: an asker registering later sees the
    // state, one registering earlier is the waker taken here.
    let w = s.waker.take();
    drop(s);
    w
}

/// Why an [`Answer`] has no value: its completer was dropped unanswered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the runtime thread dropped the request unanswered (its task panicked or its runtime shut down)")]
pub struct Lost;

/// The asking end: a `Send` future of the answer.
pub struct Answer<T: Send> {
    slot: Option<Arc<Slot<T>>>,
    /// How long the first poll that finds no answer spins on the slot
    /// before registering the waker (then zero: one spin per answer).
    spin: Duration,
}

impl<T: Send> std::fmt::Debug for Answer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Answer").finish_non_exhaustive()
    }
}

impl<T: Send> Drop for Answer<T> {
    fn drop(&mut self) {
        if let Some(s) = self.slot.take() {
            s.abandoned.store(true, Ordering::Release);
            s.abandon_waker.wake();
        }
    }
}

impl<T: Send> Answer<T> {
    /// Makes the first poll that finds no answer spin on the slot for up
    /// to `budget` (checking it between [`std::hint::spin_loop`]s) before
    /// registering the waker and returning `Pending`: a caller whose
    /// answer is due within microseconds gets it without its thread
    /// parking and being woken. Zero (the default) does not spin.
    pub fn spin_for(&mut self, budget: Duration) {
        self.spin = budget;
    }
}

/// Spins on `s` for up to `budget`; true once it is no longer `EMPTY`.
fn spin_until_answered<T>(s: &Slot<T>, budget: Duration) -> bool {
    // Reads the clock every CHECK spins: `Instant::now` costs tens of ns.
    const CHECK: u32 = 64;
    let start = Instant::now();
    loop {
        for _ in 0..CHECK {
            if s.state.load(Ordering::Acquire) != EMPTY {
                return true;
            }
            std::hint::spin_loop();
        }
        if start.elapsed() >= budget {
            return false;
        }
    }
}

impl<T: Send> std::future::Future for Answer<T> {
    type Output = Result<T, Lost>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let budget = std::mem::take(&mut self.spin);
        let Some(s) = self.slot.as_ref() else {
            return Poll::Ready(Err(Lost));
        };
        if !budget.is_zero() && spin_until_answered(s, budget) {
            // Answered while spinning: taken without registering the waker
            // (the completer would wake it for nothing).
            if let Some(r) = take_answer(s) {
                return Poll::Ready(r);
            }
        }
        if s.state.load(Ordering::Acquire) == EMPTY {
            // Registered before the state is read again: a completion after
            // that read wakes this registration (through the relay of the
            // tokio runtime polling us, if any).
            let via =
                relay::current().map_or(std::ptr::null_mut(), |r| (r as *const Relay).cast_mut());
            s.relay.store(via, Ordering::Relaxed);
            s.waker.register(cx.waker());
        }
        match take_answer(s) {
            Some(r) => Poll::Ready(r),
            None => Poll::Pending,
        }
    }
}

/// Takes the answer out of `s` if it has one (`Ok`) or if it never will
/// (`Err(Lost)`); `None` while it is still to come.
fn take_answer<T>(s: &Slot<T>) -> Option<Result<T, Lost>> {
    match s.state.load(Ordering::Acquire) {
        FULL => {
            // SAFETY: `FULL` (acquire) means the completer wrote the value
            // and will not touch it again; we move it out once and mark it
            // `TAKEN` so that nothing reads or drops it again.
            let v = unsafe { (*s.value.get()).assume_init_read() };
            s.state.store(TAKEN, Ordering::Relaxed);
            Some(Ok(v))
        }
        LOST | TAKEN => Some(Err(Lost)),
        _ => None,
    }
}

/// Slots kept for reuse: a request takes one ([`pair`](Self::pair)) and its
/// future gives it back once answered ([`give_back`](Self::give_back)), so
/// that a steady flow of requests allocates no slot. Touched only by the
/// asking side (with `try_lock`: under contention it allocates instead of
/// waiting); the runtime thread never takes its lock.
pub struct SlotCache<T> {
    free: Mutex<Vec<Arc<Slot<T>>>>,
    max: usize,
    /// Given to every answer ([`Answer::spin_for`]).
    spin: Duration,
}

impl<T> std::fmt::Debug for SlotCache<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotCache")
            .field("max", &self.max)
            .field("spin", &self.spin)
            .finish()
    }
}

impl<T: Send> SlotCache<T> {
    /// A cache keeping up to `max` idle slots.
    pub fn new(max: usize) -> SlotCache<T> {
        SlotCache {
            free: Mutex::new(Vec::with_capacity(max)),
            max,
            spin: Duration::ZERO,
        }
    }

    /// Makes every answer of [`pair`](Self::pair) spin for up to `budget`
    /// before parking ([`Answer::spin_for`]; e.g. a pool's
    /// [`ThreadRef::reply_spin`](super::ThreadRef::reply_spin)).
    pub fn reply_spin(mut self, budget: Duration) -> Self {
        self.spin = budget;
        self
    }

    /// A completer and its answer, on a recycled slot if one is idle.
    pub fn pair(&self) -> (Completer<T>, Answer<T>) {
        let reused = self.free.try_lock().ok().and_then(|mut f| f.pop());
        let (done, mut answer) = match reused {
            Some(s) => (
                Completer {
                    slot: Some(s.clone()),
                },
                Answer {
                    slot: Some(s),
                    spin: Duration::ZERO,
                },
            ),
            None => slot(),
        };
        answer.spin = self.spin;
        (done, answer)
    }

    /// Keeps `answer`'s slot for reuse if it is done with: its completer
    /// gone and its value taken (or lost). Otherwise just drops it.
    pub fn give_back(&self, mut answer: Answer<T>) {
        let Some(mut s) = answer.slot.take() else {
            return;
        };
        if let Some(inner) = Arc::get_mut(&mut s) {
            if matches!(*inner.state.get_mut(), TAKEN | LOST) {
                *inner.state.get_mut() = EMPTY;
                *inner.abandoned.get_mut() = false;
                if let Ok(mut f) = self.free.try_lock() {
                    if f.len() < self.max {
                        f.push(s);
                    }
                }
                return;
            }
        }
        // Not done with: dropped like any answer.
        s.abandoned.store(true, Ordering::Release);
        s.abandon_waker.wake();
    }
}

#[cfg(test)]
mod tests;
