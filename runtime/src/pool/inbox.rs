//! [`inbox()`]: a bounded queue from one task of a runtime thread to any
//! number of takers on any thread, the way arrivals reach them without
//! asking: the runtime thread reads ahead (e.g. a connection's messages)
//! and [`Feeder::push`]es what arrives; a taker that finds an item takes
//! it without crossing to the runtime thread at all, and one that finds
//! the queue empty waits to be woken once, by the push that brings its
//! item (given with the other wakes of the runtime thread's pass when it
//! is a pool thread).
//!
//! The queue is std's bounded channel (a preallocated ring; the feeder's
//! side takes no lock); the takers share its receiving end behind a lock
//! of their own, which the runtime thread never takes. Waiting takers are
//! kept in order in a list the runtime thread looks at only when someone
//! waits. What is read ahead is bounded twice: at most `capacity` items
//! and, past one item, at most `bytes` bytes ([`Feeder::poll_room`] is
//! ready only while there is room), so the memory a fast peer can make it
//! hold is bounded.
//!
//! The feeder [closes](Feeder::close) the inbox when nothing more will
//! come (takers get what is queued, then [`InboxEnd::Closed`]); a feeder
//! dropped without closing (its task dropped: its runtime thread died or
//! shut down) ends it with [`InboxEnd::Lost`]. Either way every waiting
//! taker is woken: nobody waits for an item that cannot come.

use std::collections::VecDeque;
use std::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use futures::task::AtomicWaker;

use super::relay::{self, Relay};

const OPEN: u8 = 0;
const CLOSED: u8 = 1;
const LOST: u8 = 2;

/// Why an [`Inbox`] has nothing more to give.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum InboxEnd {
    /// The feeder closed it: nothing more will come.
    #[error("the inbox was closed by its runtime thread")]
    Closed,
    /// The feeder was dropped without closing it (its runtime thread died,
    /// or its task was dropped).
    #[error("the runtime thread feeding the inbox is gone")]
    Lost,
}

struct Shared<T> {
    /// The takers' end of the queue (the feeder's end takes no lock).
    rx: Mutex<Receiver<(T, usize)>>,
    /// Items queued and their bytes (counted by the feeder before a push,
    /// uncounted by the taker after a take).
    queued: AtomicUsize,
    bytes: AtomicUsize,
    capacity: usize,
    byte_budget: usize,
    /// The feeder waits for room.
    room_wanted: AtomicBool,
    room: AtomicWaker,
    /// Takers waiting, oldest first, by id, with the relay each is woken
    /// through (see `super::relay`).
    waiters: Mutex<VecDeque<(u64, Waker, Option<&'static Relay>)>>,
    /// Length of `waiters` (read by the feeder without the lock).
    waiting: AtomicUsize,
    next_id: AtomicU64,
    end: AtomicU8,
}

impl<T> Shared<T> {
    fn ended(&self) -> Option<InboxEnd> {
        match self.end.load(Ordering::SeqCst) {
            OPEN => None,
            CLOSED => Some(InboxEnd::Closed),
            _ => Some(InboxEnd::Lost),
        }
    }

    fn has_room(&self) -> bool {
        let queued = self.queued.load(Ordering::SeqCst);
        queued == 0
            || (queued < self.capacity && self.bytes.load(Ordering::SeqCst) < self.byte_budget)
    }

    /// Wakes the oldest waiting taker, if any.
    fn wake_one(&self) {
        // Pairs with a taker's fence between its registration and its
        // last look at the queue.
        fence(Ordering::SeqCst);
        if self.waiting.load(Ordering::SeqCst) == 0 {
            return;
        }
        let w = {
            let mut ws = self.waiters.lock().unwrap_or_else(|p| p.into_inner());
            let w = ws.pop_front();
            self.waiting.store(ws.len(), Ordering::SeqCst);
            w
        };
        if let Some((_, w, via)) = w {
            super::reply_wakes::wake(w, via);
        }
    }

    fn wake_all(&self) {
        let ws = {
            let mut ws = self.waiters.lock().unwrap_or_else(|p| p.into_inner());
            self.waiting.store(0, Ordering::SeqCst);
            std::mem::take(&mut *ws)
        };
        for (_, w, _) in ws {
            w.wake();
        }
    }

    fn end_with(&self, end: u8) {
        let _ = self
            .end
            .compare_exchange(OPEN, end, Ordering::SeqCst, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        self.wake_all();
    }
}

/// A new inbox: at most `capacity` items (at least 1) and, past the first
/// item, `bytes` bytes queued.
pub fn inbox<T: Send>(capacity: usize, bytes: usize) -> (Feeder<T>, Inbox<T>) {
    let capacity = capacity.max(1);
    let (tx, rx) = sync_channel(capacity);
    let shared = Arc::new(Shared {
        rx: Mutex::new(rx),
        queued: AtomicUsize::new(0),
        bytes: AtomicUsize::new(0),
        capacity,
        byte_budget: bytes,
        room_wanted: AtomicBool::new(false),
        room: AtomicWaker::new(),
        waiters: Mutex::new(VecDeque::new()),
        waiting: AtomicUsize::new(0),
        next_id: AtomicU64::new(0),
        end: AtomicU8::new(OPEN),
    });
    (
        Feeder {
            tx,
            shared: shared.clone(),
            closed: false,
        },
        Inbox { shared },
    )
}

/// The feeding end, owned by one task of a runtime thread.
pub struct Feeder<T> {
    tx: SyncSender<(T, usize)>,
    shared: Arc<Shared<T>>,
    closed: bool,
}

impl<T> std::fmt::Debug for Feeder<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Feeder")
            .field("queued", &self.shared.queued.load(Ordering::Relaxed))
            .field("bytes", &self.shared.bytes.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl<T: Send> Feeder<T> {
    /// Ready while there is room for another item: fewer than `capacity`
    /// queued and fewer than `bytes` bytes (or nothing queued at all).
    /// Otherwise registers `cx` to be woken by the take that makes room.
    pub fn poll_room(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.shared.has_room() {
            return Poll::Ready(());
        }
        self.shared.room.register(cx.waker());
        self.shared.room_wanted.store(true, Ordering::SeqCst);
        // Pairs with the taker's fence after a take.
        fence(Ordering::SeqCst);
        if self.shared.has_room() {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }

    /// Queues `item` (of `bytes` bytes, for the budget) and wakes the
    /// oldest waiting taker. Call it when [`poll_room`](Self::poll_room)
    /// said there is room; without room the item is still queued if the
    /// ring has a place (the budget is then exceeded by this one item), and
    /// dropped otherwise (`false`). Also `false`, dropping the item, once
    /// every taker is gone.
    pub fn push(&self, item: T, bytes: usize) -> bool {
        self.shared.queued.fetch_add(1, Ordering::SeqCst);
        self.shared.bytes.fetch_add(bytes, Ordering::SeqCst);
        if self.tx.try_send((item, bytes)).is_err() {
            self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            self.shared.bytes.fetch_sub(bytes, Ordering::SeqCst);
            return false;
        }
        self.shared.wake_one();
        true
    }

    /// True once every [`Inbox`] is gone (nobody will take anything).
    pub fn is_orphaned(&self) -> bool {
        Arc::strong_count(&self.shared) == 1
    }

    /// Nothing more will come: takers get what is queued, then
    /// [`InboxEnd::Closed`].
    pub fn close(mut self) {
        self.closed = true;
        self.shared.end_with(CLOSED);
    }
}

impl<T> Drop for Feeder<T> {
    fn drop(&mut self) {
        if !self.closed {
            self.shared.end_with(LOST);
        }
    }
}

/// A taker's place in the line of waiting takers; keep one per waiting
/// call and hand it back with [`Inbox::cancel`] if the call is dropped
/// before it took an item.
#[derive(Debug, Default)]
pub struct Waiting {
    id: Option<u64>,
}

/// The taking end: `Send + Sync`, shared by any number of takers.
pub struct Inbox<T> {
    shared: Arc<Shared<T>>,
}

impl<T> std::fmt::Debug for Inbox<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inbox")
            .field("queued", &self.shared.queued.load(Ordering::Relaxed))
            .field("end", &self.shared.ended())
            .finish_non_exhaustive()
    }
}

impl<T: Send> Inbox<T> {
    /// Takes a queued item without waiting.
    pub fn try_take(&self) -> Option<T> {
        // Counted before the feeder's send and uncounted after a take: an
        // item in the queue keeps the count above zero, so an empty count
        // spares the lock and the channel's look (a taker's common case
        // before it waits).
        if self.shared.queued.load(Ordering::SeqCst) == 0 {
            return None;
        }
        let (item, bytes) = {
            let rx = self.shared.rx.lock().unwrap_or_else(|p| p.into_inner());
            match rx.try_recv() {
                Ok(got) => got,
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => return None,
            }
        };
        self.shared.queued.fetch_sub(1, Ordering::SeqCst);
        self.shared.bytes.fetch_sub(bytes, Ordering::SeqCst);
        // Pairs with the feeder's fence in `poll_room`.
        fence(Ordering::SeqCst);
        if self.shared.room_wanted.load(Ordering::SeqCst)
            && self.shared.room_wanted.swap(false, Ordering::SeqCst)
        {
            self.shared.room.wake();
        }
        Some(item)
    }

    /// Items queued now.
    pub fn len(&self) -> usize {
        self.shared.queued.load(Ordering::SeqCst)
    }

    /// True if nothing is queued now.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Why the inbox ended, `None` while it is open (items may still be
    /// queued after its end).
    pub fn ended(&self) -> Option<InboxEnd> {
        self.shared.ended()
    }

    /// The next item, or, once the inbox ended and is drained, why it
    /// ended. If there is none yet, `waiting` gets (or keeps) a place in
    /// the line of waiting takers and `cx` is woken by the push of its
    /// item. A taker that gives up before it took an item must call
    /// [`cancel`](Self::cancel) with its `waiting`.
    pub fn poll_take(
        &self,
        cx: &mut Context<'_>,
        waiting: &mut Waiting,
    ) -> Poll<Result<T, InboxEnd>> {
        if let Some(r) = self.take_or_end() {
            self.leave(waiting, false);
            return Poll::Ready(r);
        }
        // Looked up outside the waiters' lock.
        let relay = relay::current();
        {
            let mut ws = self
                .shared
                .waiters
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            // Ids are given in order under this lock and the line keeps
            // its order: a binary search finds a place.
            let place = waiting.id.and_then(|id| {
                ws.binary_search_by_key(&id, |(i, _, _)| *i)
                    .ok()
                    .and_then(|at| ws.get_mut(at))
            });
            match place {
                Some((_, w, via)) => {
                    if !w.will_wake(cx.waker()) {
                        *w = cx.waker().clone();
                        *via = relay;
                    }
                }
                None => {
                    let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
                    waiting.id = Some(id);
                    ws.push_back((id, cx.waker().clone(), relay));
                }
            }
            self.shared.waiting.store(ws.len(), Ordering::SeqCst);
        }
        // Pairs with the feeder's fence before it looks for waiters: either
        // it sees us waiting, or we see its item (or its end).
        fence(Ordering::SeqCst);
        match self.take_or_end() {
            Some(r) => {
                self.leave(waiting, false);
                Poll::Ready(r)
            }
            None => Poll::Pending,
        }
    }

    /// A taker gives up its place (its call was dropped before it took an
    /// item). If it had been woken for an item it did not take, the wake
    /// goes to the next waiting taker.
    pub fn cancel(&self, waiting: &mut Waiting) {
        self.leave(waiting, true);
    }

    fn take_or_end(&self) -> Option<Result<T, InboxEnd>> {
        if let Some(item) = self.try_take() {
            return Some(Ok(item));
        }
        let end = self.shared.ended()?;
        // An item pushed before the end is visible once the end is.
        Some(self.try_take().ok_or(end))
    }

    fn leave(&self, waiting: &mut Waiting, pass_on: bool) {
        let Some(id) = waiting.id.take() else { return };
        // Only this taker puts its id in the line, and every removal
        // stores the line's new length: a length of zero seen now means
        // its id is not there (the wake that took it off came first).
        if self.shared.waiting.load(Ordering::SeqCst) == 0 {
            if pass_on && !self.is_empty() {
                self.shared.wake_one();
            }
            return;
        }
        let still_waiting = {
            let mut ws = self
                .shared
                .waiters
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let found = ws.binary_search_by_key(&id, |(i, _, _)| *i).ok();
            if let Some(at) = found {
                ws.remove(at);
                self.shared.waiting.store(ws.len(), Ordering::SeqCst);
            }
            found.is_some()
        };
        // Woken (taken off the line) for an item it leaves: the next
        // taker in line gets the wake.
        if pass_on && !still_waiting && !self.is_empty() {
            self.shared.wake_one();
        }
    }
}

impl<T> Drop for Inbox<T> {
    fn drop(&mut self) {
        // The feeder's `is_orphaned` counts the references; a feeder
        // waiting for room must see that nobody will make any.
        if self.shared.room_wanted.swap(false, Ordering::SeqCst) {
            self.shared.room.wake();
        }
    }
}

#[cfg(test)]
mod tests;
