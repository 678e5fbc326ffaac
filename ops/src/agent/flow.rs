//! Credit-based flow control: a sender spends one credit per message that
//! consumes a receive buffer at the peer, and waits when it has none; the
//! peer returns credits as it reposts its buffers, on its next `Data`
//! piece, or in a `Credit` message of their own once a batch is owed.
//!
//! Three counts live here, each named by what it counts:
//! - the send credits ([`Permits`], `Shared::send_credits`): the peer's
//!   receive buffers this side may still fill, one per credit-bearing
//!   message; the same FIFO pool also serves as the agent's other permits
//!   (messages split in progress, the staging ring's one-at-a-time gate);
//! - the credits owed ([`Owed`]): this side's reposted receive buffers not
//!   yet announced to the peer;
//! - the granted credits ([`GrantedCredits`]): this side's receive buffers
//!   announced to the peer and not used by it yet.
//!
//! None of these is the runtime's count of free send-queue and CQ entries
//! (`verbio_runtime`'s queue entries), which every SEND also takes, below.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use smallvec::SmallVec;

use super::error::CloseReason;

/// A FIFO pool of permits (single-threaded): a connection's send credits
/// (the peer's receive buffers it may fill), and its other one-at-a-time
/// or few-at-a-time gates. A grant of `n`
/// wakes at most `n` waiting senders, oldest first (not all of them: with
/// a window of senders waiting, waking every one per grant made each
/// message cost several polls of senders that found no credit); a woken
/// sender that goes away without taking a credit passes its wake on.
///
/// Senders take credits in the order they first asked (a message's place
/// on the wire is its credit's): a woken sender's credit is set aside for
/// it until it is polled (`reserved`), and a sender that asks while others
/// wait, or while woken ones have not taken theirs, waits behind them. A
/// window of `send`s each first polled as an earlier one completes (a
/// `FuturesUnordered`) took the credit a grant had woken an older sender
/// for: that sender went to the back of the queue and its message after
/// the newer ones.
#[derive(Debug)]
pub(crate) struct Permits {
    available: Cell<u32>,
    /// Of `available`, the credits set aside for senders a grant woke that
    /// have not been polled since.
    reserved: Cell<u32>,
    /// Waiting senders, oldest first, by the id of their [`Acquire`].
    waiters: RefCell<VecDeque<(u64, Waker)>>,
    next_id: Cell<u64>,
    /// One past the largest id a grant took out of `waiters`: ids only grow
    /// from the front of the queue to its back and grants drain it from the
    /// front, so every waiter with a smaller id is out of the queue (woken,
    /// or gone), every one with this id or more still in it.
    woken_below: Cell<u64>,
    /// Senders the last grant woke together.
    woken_together: Cell<usize>,
    closed: RefCell<Option<CloseReason>>,
}

impl Permits {
    /// Starts with `initial` credits (the peer's receive-buffer count).
    pub(crate) fn new(initial: u32) -> Permits {
        Permits {
            available: Cell::new(initial),
            reserved: Cell::new(0),
            waiters: RefCell::new(VecDeque::new()),
            next_id: Cell::new(0),
            woken_below: Cell::new(0),
            woken_together: Cell::new(0),
            closed: RefCell::new(None),
        }
    }

    /// Credits available now to a sender that asks (those set aside for
    /// woken senders not counted).
    pub(crate) fn available(&self) -> u32 {
        self.available.get().saturating_sub(self.reserved.get())
    }

    /// Takes one credit, waiting for a grant if none is left; fails once the
    /// connection is closed. Cancel-safe: a credit is only taken by the
    /// poll that returns it, and the returned [`Permit`] gives it back
    /// unless it is [spent](Permit::spend) (the message was posted).
    pub(crate) async fn acquire(&self) -> Result<Permit<'_>, CloseReason> {
        self.acquire_noting_wait().await.map(|(c, _)| c)
    }

    /// [`Permits::acquire`], and whether this sender is one of several
    /// the window held back: it waited for a grant that woke others with
    /// it, which then post in the same poll phase.
    pub(crate) fn acquire_noting_wait(&self) -> Acquire<'_> {
        Acquire {
            pool: self,
            id: None,
            waited: false,
            done: false,
        }
    }

    /// Takes one credit now if the connection is open and one is left.
    #[inline(always)]
    pub(crate) fn try_acquire(&self) -> Option<Permit<'_>> {
        if self.closed.borrow().is_some() {
            return None;
        }
        self.take()
    }

    /// Takes one credit now if the connection is open, one is left that
    /// no woken sender was woken for, and no sender waits: a sender that
    /// asks now comes after those.
    #[inline(always)]
    pub(crate) fn try_acquire_in_turn(&self) -> Option<Permit<'_>> {
        if self.available() == 0 || !self.waiters.borrow().is_empty() {
            return None;
        }
        self.try_acquire()
    }

    #[inline(always)]
    fn take(&self) -> Option<Permit<'_>> {
        let n = self.available.get();
        if n == 0 {
            return None;
        }
        self.available.set(n - 1);
        Some(Permit {
            pool: self,
            spent: false,
        })
    }

    /// Adds `n` credits granted by the peer and wakes as many waiting
    /// senders.
    #[inline]
    pub(crate) fn grant(&self, n: u32) {
        self.available.set(self.available.get().saturating_add(n));
        if !self.waiters.borrow().is_empty() {
            self.wake_some();
        }
    }

    /// Fails every current and future waiter with `reason` (first reason wins).
    pub(crate) fn close(&self, reason: CloseReason) {
        {
            let mut c = self.closed.borrow_mut();
            if c.is_none() {
                *c = Some(reason);
            }
        }
        let waiters = std::mem::take(&mut *self.waiters.borrow_mut());
        for (_, w) in waiters {
            w.wake();
        }
    }

    /// Wakes the oldest waiters, one per credit available that is not set
    /// aside yet, and sets those credits aside for them.
    #[inline(never)]
    fn wake_some(&self) {
        let woken: SmallVec<[Waker; 16]> = {
            let mut waiters = self.waiters.borrow_mut();
            let n = (self.available() as usize).min(waiters.len());
            if let Some(&(last, _)) = n.checked_sub(1).and_then(|i| waiters.get(i)) {
                self.woken_below.set(last + 1);
            }
            waiters.drain(..n).map(|(_, w)| w).collect()
        };
        if woken.is_empty() {
            return;
        }
        // (`woken.len()` is at most `available()`, a u32.)
        self.reserved.set(self.reserved.get() + woken.len() as u32);
        self.woken_together.set(woken.len());
        for w in woken {
            w.wake();
        }
    }
}

/// The future of [`Permits::acquire_noting_wait`].
#[derive(Debug)]
#[must_use = "futures do nothing unless polled"]
pub(crate) struct Acquire<'a> {
    pool: &'a Permits,
    /// Its place in the waiters' queue, once it waited.
    id: Option<u64>,
    waited: bool,
    done: bool,
}

impl<'a> Future for Acquire<'a> {
    type Output = Result<(Permit<'a>, bool), CloseReason>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let c = self.pool;
        if let Some(r) = c.closed.borrow().as_ref() {
            self.done = true;
            return Poll::Ready(Err(r.clone()));
        }
        // Woken by a grant (out of the queue): a credit was set aside for
        // it. Else it may take one only if none is set aside for others
        // and nobody waits before it.
        let woken = self.woken();
        if woken {
            c.reserved.set(c.reserved.get().saturating_sub(1));
        }
        let in_turn = woken || (self.id.is_none() && c.waiters.borrow().is_empty());
        if in_turn && c.available.get() > c.reserved.get() {
            if let Some(credit) = c.take() {
                self.done = true;
                self.id = None;
                let held_back = self.waited && c.woken_together.get() > 1;
                return Poll::Ready(Ok((credit, held_back)));
            }
        }
        self.waited = true;
        let mut waiters = c.waiters.borrow_mut();
        match self
            .id
            .and_then(|id| place(&waiters, id))
            .and_then(|at| waiters.get_mut(at))
        {
            Some((_, w)) => {
                if !w.will_wake(cx.waker()) {
                    *w = cx.waker().clone();
                }
            }
            None => {
                // First wait, or woken and beaten to the credit: at the back.
                let id = c.next_id.get();
                c.next_id.set(id + 1);
                waiters.push_back((id, cx.waker().clone()));
                drop(waiters);
                self.id = Some(id);
            }
        }
        Poll::Pending
    }
}

impl Acquire<'_> {
    /// True if it waited and a grant took it out of the queue (and set a
    /// credit aside for it) since it was last polled: its id is below the
    /// last one a grant took (a comparison: a search of the queue for it
    /// cost each woken sender about 100 instructions with a window of 128,
    /// docs/benchmarks.md).
    #[inline]
    fn woken(&self) -> bool {
        self.id.is_some_and(|id| id < self.pool.woken_below.get())
    }

    /// Leaves the waiters' queue if it is still in it.
    fn leave(&mut self) {
        if let Some(id) = self.id.take() {
            let mut waiters = self.pool.waiters.borrow_mut();
            if let Some(at) = place(&waiters, id) {
                waiters.remove(at);
            }
        }
    }
}

/// Where the waiter `id` is in `waiters`, if it still is: a binary search,
/// as ids only grow from front to back (a waiter joins at the back with
/// the next id; grants take from the front). A linear search cost each
/// woken sender a walk of the whole queue (it is no longer in it: the
/// grant took it out), about 400 instructions per message with a window
/// of 128 senders (docs/benchmarks.md, issue 35).
#[inline]
fn place(waiters: &VecDeque<(u64, Waker)>, id: u64) -> Option<usize> {
    waiters.binary_search_by_key(&id, |(i, _)| *i).ok()
}

impl Drop for Acquire<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        if self.woken() {
            // The credit set aside for it is free again.
            let c = self.pool;
            c.reserved.set(c.reserved.get().saturating_sub(1));
        }
        self.leave();
        // Woken for a credit it will not take: the next waiter gets it.
        if self.pool.available.get() > 0 && !self.pool.waiters.borrow().is_empty() {
            self.pool.wake_some();
        }
    }
}

/// One taken permit (a send credit, for `Shared::send_credits`). Dropped unspent (the message it was taken for was
/// never posted: its future was cancelled while waiting for send-queue room,
/// or the send failed before posting), it goes back to the pool: the peer
/// will never return a credit for a message it never received.
#[derive(Debug)]
#[must_use = "an unspent credit returns to the pool when dropped"]
pub(crate) struct Permit<'a> {
    pool: &'a Permits,
    spent: bool,
}

impl Permit<'_> {
    /// The message was posted: the credit now belongs to the peer's buffer.
    #[inline(always)]
    pub(crate) fn spend(mut self) {
        self.spent = true;
    }
}

impl Drop for Permit<'_> {
    #[inline(always)]
    fn drop(&mut self) {
        if !self.spent {
            self.pool.grant(1);
        }
    }
}

/// The receiver's side: counts reposted buffers, hands them to the next
/// outgoing `Data` piece ([`Owed::take_all`]), and decides when to return
/// them to the peer as one `Credit` message (a whole batch owed).
#[derive(Debug)]
pub(crate) struct Owed {
    owed: Cell<u32>,
    batch: u32,
}

impl Owed {
    /// Returns credits once `batch` (at least 1) have accumulated.
    pub(crate) fn new(batch: u32) -> Owed {
        Owed {
            owed: Cell::new(0),
            batch: batch.max(1),
        }
    }

    /// One credit-bearing buffer was reposted: `Some(n)` when `n` credits
    /// should now be sent to the peer (the count restarts at 0).
    pub(crate) fn reposted(&self) -> Option<u32> {
        let n = self.owed.get() + 1;
        if n >= self.batch {
            self.owed.set(0);
            Some(n)
        } else {
            self.owed.set(n);
            None
        }
    }

    /// One credit-bearing buffer was reposted; the credit waits here for
    /// the next outgoing `Data` piece or a whole batch ([`Owed::take_batch`]).
    pub(crate) fn add_one(&self) {
        self.owed.set(self.owed.get().saturating_add(1));
    }

    /// A `Credit` message returning `n` could not be sent: they are owed
    /// again and go out with the next batch (the peer would otherwise lose
    /// them for good).
    pub(crate) fn unsent(&self, n: u32) {
        self.owed.set(self.owed.get().saturating_add(n));
    }

    /// Everything owed now, to ride on an outgoing `Data` piece (the count
    /// restarts at 0). The returned [`Piggyback`] counts them as the peer's
    /// ([`GrantedCredits::granted`]) and, dropped while `posted` (false now,
    /// set once that piece's SEND is posted) is still false, owes them again.
    pub(crate) fn take_all<'a>(
        &'a self,
        peer: &'a GrantedCredits,
        posted: &'a Cell<bool>,
    ) -> Piggyback<'a> {
        let n = self.owed.replace(0);
        peer.granted(n);
        Piggyback {
            owed: self,
            peer,
            n,
            posted,
        }
    }

    /// `n` credits taken to ride on a message ([`Piggyback::detach`]) that
    /// was never posted: owed again, and no longer the peer's.
    pub(crate) fn unride(&self, peer: &GrantedCredits, n: u32) {
        if n > 0 {
            peer.ungranted(n);
            self.unsent(n);
        }
    }

    /// True if what is owed makes at least one batch.
    pub(crate) fn has_batch(&self) -> bool {
        self.owed.get() >= self.batch
    }

    /// Everything owed, if it makes at least one batch (the count restarts
    /// at 0); `None` leaves it for the next [`reposted`](Self::reposted).
    pub(crate) fn take_batch(&self) -> Option<u32> {
        let n = self.owed.get();
        if n >= self.batch {
            self.owed.set(0);
            Some(n)
        } else {
            None
        }
    }
}

/// Owed credits taken to ride on one outgoing message. Dropped before the
/// message was posted (its send was cancelled or failed first), they are
/// owed again and the peer's count goes back down: the peer never got them.
#[derive(Debug)]
#[must_use = "credits taken and not posted return to the owed count when dropped"]
pub(crate) struct Piggyback<'a> {
    owed: &'a Owed,
    peer: &'a GrantedCredits,
    n: u32,
    posted: &'a Cell<bool>,
}

impl Piggyback<'_> {
    /// The credits carried.
    pub(crate) fn count(&self) -> u32 {
        self.n
    }

    /// Kept for a message whose post is still to come: the credits, which
    /// [`Owed::unride`] owes again if it never is.
    pub(crate) fn detach(self) -> u32 {
        let n = self.n;
        std::mem::forget(self);
        n
    }
}

impl Drop for Piggyback<'_> {
    fn drop(&mut self) {
        if !self.posted.get() {
            self.owed.unride(self.peer, self.n);
        }
    }
}

/// The credits this side has given the peer and the peer has not used yet,
/// as this side counts them: a grant counts from the moment its `Credit`
/// message is posted (before the peer can have it), so a peer that keeps
/// to the protocol never sends a credit-bearing message while the count is
/// 0; one that does is sending without permission.
#[derive(Debug, Default)]
pub(crate) struct GrantedCredits {
    left: Cell<u64>,
}

impl GrantedCredits {
    /// `n` credits are on their way to the peer.
    pub(crate) fn granted(&self, n: u32) {
        self.left.set(self.left.get().saturating_add(n.into()));
    }

    /// A grant of `n` could not be posted after all.
    pub(crate) fn ungranted(&self, n: u32) {
        self.left.set(self.left.get().saturating_sub(n.into()));
    }

    /// A credit-bearing message arrived: false if the peer had no credit
    /// left to send it with.
    pub(crate) fn spend(&self) -> bool {
        match self.left.get() {
            0 => false,
            n => {
                self.left.set(n - 1);
                true
            }
        }
    }
}

/// Extra receive buffers (beyond the credits this side announced) for the
/// messages the peer sends without credits, when the peer has `credits`
/// receive buffers for this side and returns credits in batches of
/// `batch` (both learnt in the settings exchange): the peer's `Credit`
/// messages (each returns at least `batch`, and the peer cannot owe more
/// than `credits`, so at most `credits / batch` are unprocessed at once),
/// its first `Credit` (the announcement), its `Error` and its `Close`.
pub(crate) fn reserve_for(credits: u32, batch: u32) -> u32 {
    credits.div_ceil(batch.max(1)) + 3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owed_batches() {
        let o = Owed::new(3);
        assert_eq!(o.reposted(), None);
        assert_eq!(o.reposted(), None);
        assert_eq!(o.reposted(), Some(3));
        assert_eq!(o.reposted(), None);
        o.unsent(3); // a Credit message that failed to go out
        assert_eq!(o.reposted(), Some(5), "the unsent credits ride along");
    }

    #[test]
    fn granted_credits_catch_overspending() {
        let p = GrantedCredits::default();
        assert!(!p.spend(), "nothing granted yet");
        p.granted(2);
        assert!(p.spend());
        p.granted(3);
        p.ungranted(3); // that grant was never posted
        assert!(p.spend());
        assert!(!p.spend(), "a third message with two credits");
    }

    #[test]
    fn owed_whole_batches_only() {
        let o = Owed::new(4);
        o.unsent(3);
        assert_eq!(o.take_batch(), None, "less than a batch stays owed");
        assert_eq!(o.reposted(), Some(4));
        o.unsent(9);
        assert_eq!(o.take_batch(), Some(9));
        assert_eq!(o.take_batch(), None);
    }

    #[test]
    fn piggybacked_credits_come_back_unless_posted() {
        let o = Owed::new(4);
        let p = GrantedCredits::default();
        o.unsent(3);
        let posted = Cell::new(false);
        let ride = o.take_all(&p, &posted);
        assert_eq!(ride.count(), 3);
        assert_eq!(o.take_batch(), None, "taken: nothing owed");
        assert!(p.spend(), "counted as the peer's while on their way");
        p.granted(1); // undo the spend above
        drop(ride); // the send was cancelled before posting
        assert!(!p.spend(), "the peer's count went back down");
        assert_eq!(o.reposted(), Some(4), "owed again, with the next one");
        o.unsent(2);
        let ride = o.take_all(&p, &posted);
        posted.set(true);
        drop(ride);
        assert!(p.spend() && p.spend(), "posted: the peer holds them");
        assert!(!p.spend());
        assert_eq!(
            o.take_all(&p, &Cell::new(false)).count(),
            0,
            "nothing owed any more"
        );
    }

    #[test]
    fn credits_count_and_close() {
        let c = Permits::new(1);
        futures::executor::block_on(c.acquire()).unwrap().spend();
        assert_eq!(c.available(), 0);
        c.grant(2);
        assert_eq!(c.available(), 2);
        c.close(CloseReason::Disconnected);
        assert!(matches!(
            futures::executor::block_on(c.acquire()),
            Err(CloseReason::Disconnected)
        ));
    }

    #[test]
    fn an_unspent_credit_comes_back() {
        let c = Permits::new(2);
        let a = futures::executor::block_on(c.acquire()).unwrap();
        let b = futures::executor::block_on(c.acquire()).unwrap();
        assert_eq!(c.available(), 0);
        drop(a); // never posted
        assert_eq!(c.available(), 1);
        b.spend();
        assert_eq!(c.available(), 1);
        // A waiter cancelled before it got a credit takes none.
        let waiting = c.acquire();
        drop(waiting);
        assert_eq!(c.available(), 1);
    }

    #[test]
    fn a_grant_wakes_one_waiter_per_credit_and_a_dropped_one_passes_it_on() {
        use std::future::Future;
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;
        struct Count(AtomicUsize);
        impl futures::task::ArcWake for Count {
            fn wake_by_ref(me: &Arc<Self>) {
                me.0.fetch_add(1, Ordering::Relaxed);
            }
        }
        let c = Permits::new(0);
        let counts: Vec<_> = (0..3)
            .map(|_| Arc::new(Count(AtomicUsize::new(0))))
            .collect();
        let wakers: Vec<_> = counts
            .iter()
            .map(|k| futures::task::waker(k.clone()))
            .collect();
        let mut w: Vec<_> = (0..3).map(|_| Box::pin(c.acquire_noting_wait())).collect();
        for (f, waker) in w.iter_mut().zip(&wakers) {
            let mut cx = std::task::Context::from_waker(waker);
            assert!(f.as_mut().poll(&mut cx).is_pending());
        }
        let woken = || {
            counts
                .iter()
                .map(|k| k.0.load(Ordering::Relaxed))
                .collect::<Vec<_>>()
        };
        c.grant(1);
        assert_eq!(woken(), [1, 0, 0], "one credit: the oldest waiter only");
        // The woken one goes away without taking it: the next gets the wake.
        drop(w.remove(0));
        assert_eq!(woken(), [1, 1, 0]);
        let mut cx = std::task::Context::from_waker(&wakers[1]);
        match w[0].as_mut().poll(&mut cx) {
            Poll::Ready(Ok((credit, _))) => credit.spend(),
            other => panic!("the woken waiter takes the credit: {other:?}"),
        }
        assert_eq!(woken(), [1, 1, 0], "the last one still sleeps");
        c.close(CloseReason::Disconnected);
        assert_eq!(woken(), [1, 1, 1], "a close wakes every waiter");
    }

    #[test]
    fn a_sender_that_asks_after_a_grant_woke_another_waits_behind_it() {
        use futures::FutureExt;
        let c = Permits::new(0);
        let mut old = Box::pin(c.acquire_noting_wait());
        assert!((&mut old).now_or_never().is_none());
        c.grant(1);
        assert_eq!(
            c.available(),
            0,
            "the credit is set aside for the woken sender"
        );
        assert!(c.try_acquire_in_turn().is_none());
        // First polled before the woken one: it does not take its credit.
        let mut new = Box::pin(c.acquire_noting_wait());
        assert!(
            (&mut new).now_or_never().is_none(),
            "the newer sender waits"
        );
        let (credit, _) = (&mut old).now_or_never().unwrap().unwrap();
        credit.spend();
        assert!((&mut new).now_or_never().is_none(), "no credit for it yet");
        c.grant(1);
        let (credit, _) = (&mut new).now_or_never().unwrap().unwrap();
        credit.spend();
        // A woken sender dropped gives its credit to the next one.
        let mut a = Box::pin(c.acquire_noting_wait());
        let mut b = Box::pin(c.acquire_noting_wait());
        assert!((&mut a).now_or_never().is_none());
        assert!((&mut b).now_or_never().is_none());
        c.grant(1);
        drop(a);
        let (credit, _) = (&mut b).now_or_never().unwrap().unwrap();
        credit.spend();
        assert_eq!(c.available(), 0);
        c.grant(1);
        assert!(c.try_acquire_in_turn().is_some(), "nobody waits: at once");
    }

    #[test]
    fn senders_a_grant_wakes_together_are_told_they_were_held_back() {
        use futures::FutureExt;
        use std::future::Future;
        let c = Permits::new(1);
        // A credit at hand: not held back.
        let (first, held) = c.acquire_noting_wait().now_or_never().unwrap().unwrap();
        assert!(!held);
        first.spend();
        // A lone waiter (e.g. for the peer's first announcement): not held
        // back with others.
        let mut lone = Box::pin(c.acquire_noting_wait());
        assert!((&mut lone).now_or_never().is_none());
        c.grant(1);
        let (credit, held) = lone.now_or_never().unwrap().unwrap();
        assert!(!held, "a lone waiter");
        credit.spend();
        // Three waiting (three tasks: wakers of their own), one grant of
        // two: the two that get a credit were held back with others; the
        // third waits on.
        struct Task;
        impl futures::task::ArcWake for Task {
            fn wake_by_ref(_: &std::sync::Arc<Self>) {}
        }
        let wakers: Vec<_> = (0..3)
            .map(|_| futures::task::waker(std::sync::Arc::new(Task)))
            .collect();
        let mut w: Vec<_> = (0..3).map(|_| Box::pin(c.acquire_noting_wait())).collect();
        for (f, waker) in w.iter_mut().zip(&wakers) {
            let mut cx = std::task::Context::from_waker(waker);
            assert!(f.as_mut().poll(&mut cx).is_pending());
        }
        c.grant(2);
        let mut got = Vec::new();
        for (f, waker) in w.iter_mut().zip(&wakers) {
            let mut cx = std::task::Context::from_waker(waker);
            if let Poll::Ready(r) = f.as_mut().poll(&mut cx) {
                got.push(r.unwrap());
            }
        }
        assert_eq!(got.len(), 2);
        assert!(got.iter().all(|(_, held)| *held), "woken together");
    }

    #[test]
    fn waiters_leave_from_anywhere_in_the_queue_and_the_rest_keep_their_order() {
        use std::future::Future;
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;
        struct Count(AtomicUsize);
        impl futures::task::ArcWake for Count {
            fn wake_by_ref(me: &Arc<Self>) {
                me.0.fetch_add(1, Ordering::Relaxed);
            }
        }
        const N: usize = 9;
        let c = Permits::new(0);
        let counts: Vec<_> = (0..N)
            .map(|_| Arc::new(Count(AtomicUsize::new(0))))
            .collect();
        let wakers: Vec<_> = counts
            .iter()
            .map(|k| futures::task::waker(k.clone()))
            .collect();
        let mut w: Vec<_> = (0..N)
            .map(|_| Some(Box::pin(c.acquire_noting_wait())))
            .collect();
        let poll = |w: &mut Vec<_>, i: usize| {
            let mut cx = std::task::Context::from_waker(&wakers[i]);
            let f: &mut Option<std::pin::Pin<Box<Acquire<'_>>>> = &mut w[i];
            f.as_mut().expect("waiter").as_mut().poll(&mut cx)
        };
        for i in 0..N {
            assert!(poll(&mut w, i).is_pending());
            // Polled again while waiting: still one place in the queue.
            assert!(poll(&mut w, i).is_pending());
        }
        assert_eq!(c.waiters.borrow().len(), N);
        // Cancelled from the middle, the front and the back.
        for i in [4, 0, N - 1] {
            w[i] = None;
        }
        assert_eq!(c.waiters.borrow().len(), N - 3);
        let woken = || {
            counts
                .iter()
                .map(|k| k.0.load(Ordering::Relaxed))
                .collect::<Vec<_>>()
        };
        c.grant(3);
        assert_eq!(
            woken(),
            [0, 1, 1, 1, 0, 0, 0, 0, 0],
            "the three oldest left"
        );
        for i in [1, 2, 3] {
            match poll(&mut w, i) {
                Poll::Ready(Ok((credit, _))) => credit.spend(),
                other => panic!("waiter {i} takes its credit: {other:?}"),
            }
        }
        assert_eq!(c.waiters.borrow().len(), 3, "5, 6 and 7 wait on");
        c.grant(1);
        assert_eq!(woken(), [0, 1, 1, 1, 0, 1, 0, 0, 0], "then the next oldest");
        // Woken and beaten to the credit: back in the queue, at its end.
        c.try_acquire().expect("the credit").spend();
        assert!(poll(&mut w, 5).is_pending());
        c.grant(1);
        assert_eq!(
            woken(),
            [0, 1, 1, 1, 0, 1, 1, 0, 0],
            "waiter 6 was first now"
        );
        assert_eq!(c.waiters.borrow().len(), 2, "7, then 5");
    }
}
