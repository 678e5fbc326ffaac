//! [`mailbox()`]: a bounded queue from any thread to one task of a runtime
//! thread, woken through the reactor's own wake path once per burst.
//!
//! The queue is std's bounded channel (a preallocated ring: no allocation
//! per message, no lock). A sender wakes the receiving task only when it
//! finds the receiver *disarmed*, that is, waiting with the queue seen
//! empty; while the receiver drains, further sends just push. A burst of
//! sends from any number of threads therefore costs one wake of the task
//! (one push on the executor's cross-thread queue, and one write of the
//! reactor's eventfd only if it sleeps in epoll).
//!
//! A full queue makes senders wait for room (their wakers in a list the
//! receiver looks at only when someone waits). Closing the mailbox
//! ([`MailSender::close`]) lets the receiver take what is queued and then
//! end; dropping the receiver drops every queued message (so that what
//! they carry, e.g. a completion slot, reports the loss) and fails every
//! later send.

use std::sync::atomic::{fence, AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TryRecvError, TrySendError};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use futures::task::AtomicWaker;

/// Why a message was not queued; the message comes back.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum SendError<M> {
    /// The queue is full (try again once there is room).
    #[error("the runtime thread's mailbox is full")]
    Full(M),
    /// The mailbox is closed or its receiver is gone.
    #[error("the runtime thread's mailbox is closed (its receiver is gone or ending)")]
    Closed(M),
}

impl<M> SendError<M> {
    /// The message that was not queued.
    pub fn into_inner(self) -> M {
        match self {
            SendError::Full(m) | SendError::Closed(m) => m,
        }
    }
}

struct Shared {
    /// The receiving task's waker.
    waker: AtomicWaker,
    /// Set by the sender that wakes the receiver; cleared by the receiver
    /// when it finds the queue empty. While set, sends do not wake.
    armed: AtomicBool,
    /// No more messages are accepted (the receiver ends once drained).
    closed: AtomicBool,
    /// The receiver is gone.
    gone: AtomicBool,
    /// Live senders: the last one gone closes the mailbox and wakes the
    /// receiver (which may be waiting with the queue seen empty).
    senders: AtomicUsize,
    /// Senders waiting for room.
    room_waiting: AtomicUsize,
    room: Mutex<Vec<Waker>>,
    /// The other buffer of `room` (see `wake_room_waiters`).
    spare: Mutex<Vec<Waker>>,
}

impl Shared {
    fn wake_receiver(&self) {
        // Pairs with the receiver's fence between its disarm and its last
        // look at the queue: either it sees our message, or we see it
        // disarmed and wake it.
        fence(Ordering::SeqCst);
        if !self.armed.swap(true, Ordering::AcqRel) {
            self.waker.wake();
        }
    }

    fn wake_room_waiters(&self) {
        // The waiters are swapped into the spare list and woken from there,
        // outside the lock senders take: both lists keep their buffers, so
        // a sender that waits for room again and again allocates nothing.
        // (Another thread waking at the same time uses a fresh list.)
        let mut spare_guard = self.spare.try_lock().ok();
        let mut fresh = Vec::new();
        let spare = spare_guard.as_deref_mut().unwrap_or(&mut fresh);
        std::mem::swap(
            &mut *self.room.lock().unwrap_or_else(|p| p.into_inner()),
            spare,
        );
        self.room_waiting.store(0, Ordering::SeqCst);
        for w in spare.drain(..) {
            w.wake();
        }
    }
}

/// A bounded mailbox of `capacity` messages (at least 1).
pub fn mailbox<M: Send>(capacity: usize) -> (MailSender<M>, MailReceiver<M>) {
    let (tx, rx) = sync_channel(capacity.max(1));
    let shared = Arc::new(Shared {
        waker: AtomicWaker::new(),
        armed: AtomicBool::new(false),
        closed: AtomicBool::new(false),
        gone: AtomicBool::new(false),
        senders: AtomicUsize::new(1),
        room_waiting: AtomicUsize::new(0),
        room: Mutex::new(Vec::new()),
        spare: Mutex::new(Vec::new()),
    });
    (
        MailSender {
            tx,
            shared: shared.clone(),
        },
        MailReceiver { rx, shared },
    )
}

/// The sending side: `Send + Sync + Clone`, usable from any thread.
pub struct MailSender<M> {
    tx: SyncSender<M>,
    shared: Arc<Shared>,
}

impl<M> Clone for MailSender<M> {
    fn clone(&self) -> Self {
        self.shared.senders.fetch_add(1, Ordering::Relaxed);
        MailSender {
            tx: self.tx.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<M> Drop for MailSender<M> {
    fn drop(&mut self) {
        if self.shared.senders.fetch_sub(1, Ordering::AcqRel) == 1 {
            // The last sender: what is queued is still taken, then the
            // receiver ends. A waiting receiver must hear of it (std's
            // channel disconnects only after this returns, and wakes no
            // one).
            self.shared.closed.store(true, Ordering::SeqCst);
            self.shared.waker.wake();
        }
    }
}

impl<M> std::fmt::Debug for MailSender<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MailSender")
            .field("closed", &self.is_closed())
            .finish()
    }
}

impl<M> MailSender<M> {
    /// True once closed, or once the receiver is gone.
    pub fn is_closed(&self) -> bool {
        self.shared.closed.load(Ordering::Acquire) || self.shared.gone.load(Ordering::Acquire)
    }
}

impl<M: Send> MailSender<M> {
    /// Queues `m` without waiting; wakes the receiver if it is disarmed.
    pub fn try_send(&self, m: M) -> Result<(), SendError<M>> {
        if self.is_closed() {
            return Err(SendError::Closed(m));
        }
        match self.tx.try_send(m) {
            Ok(()) => {
                // A hosted runtime woken from idle by a worker of its tokio
                // runtime is turned here, by the sender, rather than
                // scheduled (`hosted::inline_scope`).
                #[cfg(feature = "tokio")]
                super::hosted::inline_scope(|| self.shared.wake_receiver());
                #[cfg(not(feature = "tokio"))]
                self.shared.wake_receiver();
                Ok(())
            }
            Err(TrySendError::Full(m)) => Err(SendError::Full(m)),
            Err(TrySendError::Disconnected(m)) => Err(SendError::Closed(m)),
        }
    }

    /// Queues the message in `msg`, or, if the queue is full, leaves it
    /// there and registers `cx` to be woken when there is room
    /// (`Pending`). A closed mailbox gives it back as `Ready(Err)`.
    ///
    /// # Panics
    ///
    /// If `msg` is `None`.
    pub fn poll_send(&self, cx: &mut Context<'_>, msg: &mut Option<M>) -> Poll<Result<(), M>> {
        let m = msg.take().expect("poll_send needs a message");
        let m = match self.try_send(m) {
            Ok(()) => return Poll::Ready(Ok(())),
            Err(SendError::Closed(m)) => return Poll::Ready(Err(m)),
            Err(SendError::Full(m)) => m,
        };
        self.shared
            .room
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(cx.waker().clone());
        self.shared.room_waiting.fetch_add(1, Ordering::SeqCst);
        // Pairs with the receiver's fence after a take: either it sees us
        // waiting, or we see the room it made.
        fence(Ordering::SeqCst);
        match self.try_send(m) {
            Ok(()) => Poll::Ready(Ok(())),
            Err(SendError::Closed(m)) => Poll::Ready(Err(m)),
            Err(SendError::Full(m)) => {
                *msg = Some(m);
                Poll::Pending
            }
        }
    }

    /// Queues `m`, waiting for room while the queue is full; gives it back
    /// if the mailbox is closed.
    pub async fn send(&self, m: M) -> Result<(), M> {
        let mut msg = Some(m);
        std::future::poll_fn(|cx| self.poll_send(cx, &mut msg)).await
    }

    /// Stops accepting messages; the receiver takes what is queued, then
    /// ends ([`MailReceiver::poll_recv`] returns `None`).
    pub fn close(&self) {
        self.shared.closed.store(true, Ordering::SeqCst);
        // Wake it even if armed: it must see the close.
        self.shared.waker.wake();
        self.shared.wake_room_waiters();
    }
}

/// The receiving side, owned by one task of a runtime thread.
pub struct MailReceiver<M> {
    rx: Receiver<M>,
    shared: Arc<Shared>,
}

impl<M> std::fmt::Debug for MailReceiver<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MailReceiver").finish_non_exhaustive()
    }
}

impl<M> MailReceiver<M> {
    /// Takes a queued message without waiting.
    fn take(&self) -> Result<M, TryRecvError> {
        let r = self.rx.try_recv();
        if r.is_ok() {
            fence(Ordering::SeqCst);
            if self.shared.room_waiting.load(Ordering::SeqCst) > 0 {
                self.shared.wake_room_waiters();
            }
        }
        r
    }

    /// The next message; `Ready(None)` once the mailbox is closed and
    /// drained, or every sender is gone. While it returns messages the
    /// senders do not wake the task; the `Pending` that ends a drain
    /// re-arms them.
    pub fn poll_recv(&self, cx: &mut Context<'_>) -> Poll<Option<M>> {
        match self.take() {
            Ok(m) => return Poll::Ready(Some(m)),
            Err(TryRecvError::Disconnected) => return Poll::Ready(None),
            Err(TryRecvError::Empty) => {}
        }
        self.shared.waker.register(cx.waker());
        self.shared.armed.store(false, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        match self.take() {
            Ok(m) => Poll::Ready(Some(m)),
            Err(TryRecvError::Disconnected) => Poll::Ready(None),
            Err(TryRecvError::Empty) if self.shared.closed.load(Ordering::SeqCst) => {
                Poll::Ready(None)
            }
            Err(TryRecvError::Empty) => Poll::Pending,
        }
    }

    /// Stops accepting messages, as [`MailSender::close`]: what is queued
    /// is still taken, then [`poll_recv`](Self::poll_recv) returns `None`.
    pub fn close(&self) {
        self.shared.closed.store(true, Ordering::SeqCst);
        self.shared.wake_room_waiters();
    }

    /// Waits for the next message (see [`poll_recv`](Self::poll_recv)).
    pub async fn recv(&self) -> Option<M> {
        std::future::poll_fn(|cx| self.poll_recv(cx)).await
    }
}

impl<M> Drop for MailReceiver<M> {
    fn drop(&mut self) {
        self.shared.gone.store(true, Ordering::SeqCst);
        // Queued messages are dropped with `rx` (std's channel discards
        // them when its receiver goes); senders waiting for room fail.
        self.shared.wake_room_waiters();
    }
}

#[cfg(test)]
mod tests;
