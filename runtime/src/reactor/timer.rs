//! Timers: a binary heap of deadlines plus a slab of wakers. [`sleep`],
//! [`sleep_until`] and [`timeout`].

use std::cell::{Cell, RefCell};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use slab::Slab;

use super::Handle;

struct Entry {
    seq: u64,
    deadline: Instant,
    /// `None` once fired.
    waker: Option<Waker>,
}

/// A registered [`Sleep`]'s entry, as seen by its next poll.
enum EntryState {
    /// In the heap, not due yet as far as the reactor has seen.
    Armed,
    /// The reactor found its deadline passed and woke it.
    Fired,
    /// Removed behind its back (the runtime is being torn down).
    Gone,
}

pub(crate) struct Timers {
    /// (deadline, seq, key); entries whose seq no longer matches are stale.
    heap: RefCell<BinaryHeap<Reverse<(Instant, u64, usize)>>>,
    entries: RefCell<Slab<Entry>>,
    next_seq: Cell<u64>,
    /// Entries not fired yet (waker still set): while zero, `fire_due` and
    /// `next_deadline` return at once, touching neither the heap nor the
    /// clock (the reactor asks them several times per op).
    armed: Cell<usize>,
    /// The latest time the reactor read (a lower bound of the current
    /// time): a first poll compares its deadline with it instead of
    /// reading the clock.
    seen: Cell<Option<Instant>>,
    /// The earliest live deadline, while `next_known` (`None`: no live
    /// timer): `next_deadline` returns it without looking at the heap. A
    /// runtime with a far timer armed (an `Rdma` connection's keepalive)
    /// asks at every park; the heap and the slab are looked at only after
    /// the earliest timer fired or was dropped.
    next: Cell<Option<Instant>>,
    next_known: Cell<bool>,
    /// Clock reads of `fire_due` (tests count them).
    #[cfg(test)]
    pub(crate) clock_reads: Cell<usize>,
    /// Heap look-ups of `next_deadline` (tests count them).
    #[cfg(test)]
    pub(crate) heap_reads: Cell<usize>,
}

impl Timers {
    pub(crate) fn new() -> Timers {
        Timers {
            heap: RefCell::new(BinaryHeap::with_capacity(64)),
            entries: RefCell::new(Slab::with_capacity(64)),
            next_seq: Cell::new(0),
            armed: Cell::new(0),
            seen: Cell::new(None),
            next: Cell::new(None),
            next_known: Cell::new(true),
            #[cfg(test)]
            clock_reads: Cell::new(0),
            #[cfg(test)]
            heap_reads: Cell::new(0),
        }
    }

    fn insert(&self, deadline: Instant, waker: Waker) -> (usize, u64) {
        let seq = self.next_seq.get();
        self.next_seq.set(seq + 1);
        let key = self.entries.borrow_mut().insert(Entry {
            seq,
            deadline,
            waker: Some(waker),
        });
        self.armed.set(self.armed.get() + 1);
        if self.next_known.get() && self.next.get().is_none_or(|n| deadline < n) {
            self.next.set(Some(deadline));
        }
        let mut heap = self.heap.borrow_mut();
        heap.push(Reverse((deadline, seq, key)));
        // Dropped timers leave stale heap entries; compact when they dominate.
        let live = self.entries.borrow().len();
        if heap.len() > 64 && heap.len() > 4 * live {
            let entries = self.entries.borrow();
            heap.retain(|Reverse((_, s, k))| entries.get(*k).is_some_and(|e| e.seq == *s));
        }
        (key, seq)
    }

    fn update(&self, key: usize, seq: u64, waker: &Waker) {
        if let Some(e) = self.entries.borrow_mut().get_mut(key) {
            if e.seq == seq {
                match &e.waker {
                    Some(w) if w.will_wake(waker) => {}
                    _ => e.waker = Some(waker.clone()),
                }
            }
        }
    }

    fn remove(&self, key: usize, seq: u64) {
        let mut entries = self.entries.borrow_mut();
        if entries.get(key).is_some_and(|e| e.seq == seq) {
            let e = entries.remove(key);
            if e.waker.is_some() {
                self.armed.set(self.armed.get() - 1);
                if self.armed.get() == 0 {
                    self.next.set(None);
                    self.next_known.set(true);
                } else if self.next.get() == Some(e.deadline) {
                    // Maybe the earliest: looked up again when asked.
                    self.next_known.set(false);
                }
            }
            if entries.is_empty() {
                // Every heap entry is stale now.
                self.heap.borrow_mut().clear();
            }
        }
    }

    /// Where timer `key` (inserted as `seq`) stands, without reading the clock.
    fn state(&self, key: usize, seq: u64) -> EntryState {
        match self.entries.borrow().get(key) {
            Some(e) if e.seq == seq && e.waker.is_some() => EntryState::Armed,
            Some(e) if e.seq == seq => EntryState::Fired,
            _ => EntryState::Gone,
        }
    }

    /// [`fire`](Self::fire) at the current time; reads no clock when no
    /// live timer is pending (the common case on the op path: the stale
    /// entries dropped timers leave behind are discarded first).
    #[inline]
    pub(crate) fn fire_due(&self) -> usize {
        if self.next_deadline().is_none() {
            return 0;
        }
        #[cfg(test)]
        self.clock_reads.set(self.clock_reads.get() + 1);
        self.fire(Instant::now())
    }

    /// Wakes every timer whose deadline is at or before `now`, in deadline order.
    pub(crate) fn fire(&self, now: Instant) -> usize {
        self.saw(now);
        let mut fired = 0;
        loop {
            let waker = {
                let mut heap = self.heap.borrow_mut();
                match heap.peek() {
                    Some(Reverse((d, _, _))) if *d <= now => {}
                    _ => break,
                }
                let Some(Reverse((_, seq, key))) = heap.pop() else {
                    break;
                };
                let mut entries = self.entries.borrow_mut();
                match entries.get_mut(key) {
                    Some(e) if e.seq == seq => e.waker.take(),
                    _ => None,
                }
            };
            if waker.is_some() {
                self.armed.set(self.armed.get() - 1);
                self.next_known.set(false);
            }
            if let Some(w) = waker {
                fired += 1;
                w.wake();
            }
        }
        fired
    }

    /// Records a clock reading of the reactor's (see `seen`).
    #[inline]
    pub(crate) fn saw(&self, now: Instant) {
        match self.seen.get() {
            Some(t) if t >= now => {}
            _ => self.seen.set(Some(now)),
        }
    }

    /// True if `deadline` has passed as of the reactor's latest clock
    /// reading (false says nothing: it may have passed since).
    fn surely_passed(&self, deadline: Instant) -> bool {
        self.seen.get().is_some_and(|t| deadline <= t)
    }

    /// The earliest live deadline.
    #[inline]
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        if self.armed.get() == 0 {
            return None;
        }
        if self.next_known.get() {
            return self.next.get();
        }
        self.next_deadline_in_heap()
    }

    /// [`next_deadline`](Self::next_deadline) from the heap (its stale
    /// top entries discarded), remembered until the earliest live timer
    /// fires or is dropped.
    #[inline(never)]
    fn next_deadline_in_heap(&self) -> Option<Instant> {
        #[cfg(test)]
        self.heap_reads.set(self.heap_reads.get() + 1);
        let next = self.earliest_live();
        self.next.set(next);
        self.next_known.set(true);
        next
    }

    fn earliest_live(&self) -> Option<Instant> {
        let mut heap = self.heap.borrow_mut();
        let entries = self.entries.borrow();
        while let Some(Reverse((d, seq, key))) = heap.peek().copied() {
            if entries
                .get(key)
                .is_some_and(|e| e.seq == seq && e.waker.is_some())
            {
                return Some(d);
            }
            heap.pop();
        }
        None
    }

    #[cfg(test)]
    pub(crate) fn heap_len(&self) -> usize {
        self.heap.borrow().len()
    }

    pub(crate) fn clear(&self) {
        self.armed.set(0);
        self.next.set(None);
        self.next_known.set(true);
        self.heap.borrow_mut().clear();
        let all: Vec<Entry> = self.entries.borrow_mut().drain().collect();
        drop(all);
    }
}

/// A future that completes at a deadline. Created by [`sleep`] and [`sleep_until`].
#[must_use = "futures do nothing unless polled"]
pub struct Sleep {
    handle: Handle,
    deadline: Instant,
    entry: Option<(usize, u64)>,
}

impl Sleep {
    /// When it completes.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// True once the deadline has passed.
    pub fn is_elapsed(&self) -> bool {
        Instant::now() >= self.deadline
    }
}

impl Future for Sleep {
    type Output = ();

    /// Reads no clock: the first poll registers the deadline unless the
    /// reactor's latest clock reading already passed it (then it is ready
    /// at once), and from then on the timer is due exactly when the
    /// reactor has fired it, which it does at its next turn if the
    /// deadline has passed meanwhile (the reactor reads the clock before it
    /// sleeps, and on busy turns). So a [`Timeout`] around an op,
    /// polled at its creation and at every wake of the op, costs no clock
    /// read but the one that set its deadline: a read costs microseconds
    /// where the clocksource is emulated.
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = &mut *self;
        let timers = &this.handle.inner.timers;
        if let Some((key, seq)) = this.entry {
            match timers.state(key, seq) {
                EntryState::Armed => {
                    timers.update(key, seq, cx.waker());
                    return Poll::Pending;
                }
                EntryState::Fired => {
                    this.entry = None;
                    timers.remove(key, seq);
                    return Poll::Ready(());
                }
                EntryState::Gone => this.entry = None,
            }
        }
        if timers.surely_passed(this.deadline) {
            return Poll::Ready(());
        }
        this.entry = Some(timers.insert(this.deadline, cx.waker().clone()));
        Poll::Pending
    }
}

impl Drop for Sleep {
    fn drop(&mut self) {
        if let Some((key, seq)) = self.entry.take() {
            self.handle.inner.timers.remove(key, seq);
        }
    }
}

impl std::fmt::Debug for Sleep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sleep")
            .field("deadline", &self.deadline)
            .finish()
    }
}

/// Waits for `duration`.
///
/// # Panics
///
/// If no runtime exists on this thread.
pub fn sleep(duration: Duration) -> Sleep {
    sleep_until(Instant::now() + duration)
}

/// Waits until `deadline`.
///
/// # Panics
///
/// If no runtime exists on this thread.
pub fn sleep_until(deadline: Instant) -> Sleep {
    Sleep {
        handle: Handle::current(),
        deadline,
        entry: None,
    }
}

/// The deadline of a [`timeout`] passed first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("deadline elapsed")]
pub struct Elapsed;

/// A future with a deadline: [`timeout`].
#[must_use = "futures do nothing unless polled"]
#[pin_project::pin_project]
pub struct Timeout<F> {
    #[pin]
    future: F,
    sleep: Sleep,
}

impl<F: Future> Future for Timeout<F> {
    type Output = Result<F::Output, Elapsed>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Poll::Ready(v) = this.future.poll(cx) {
            return Poll::Ready(Ok(v));
        }
        match Pin::new(this.sleep).poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(Elapsed)),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// Runs `future` until it finishes or `duration` passes (`Err(Elapsed)`;
/// the future is then dropped when the `Timeout` is).
///
/// # Panics
///
/// If no runtime exists on this thread.
pub fn timeout<F: Future>(duration: Duration, future: F) -> Timeout<F> {
    Timeout {
        future,
        sleep: sleep(duration),
    }
}
