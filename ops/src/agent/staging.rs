//! The staging ring: mid-size messages by one RDMA WRITE into memory the
//! receiver granted in advance, instead of many `Data` pieces (each a SEND,
//! a credit and a copy into the reassembled message) or a READ (the
//! receiver fetches the message: one more round trip, and a registration
//! on both sides per message).
//!
//! A side registers a ring of `RdmaBuilder::staging_ring` bytes the peer
//! may write (REMOTE_WRITE only) and announces it in a `StagingRing`
//! message the first time the peer sends a message the ring would carry
//! (in pieces or by READ, as before): a connection that never sends one
//! costs no ring. The ring's bytes come out of the connection's
//! `StagingBudget` (`staging_budget.rs`), shared with other connections:
//! when it is spent the side announces nothing (the peer keeps to pieces
//! and READs) and asks again at the peer's next such message; the agent
//! gives the ring back when it stops. From then on a message longer than one receive buffer
//! and at most a quarter of the peer's ring is copied into a send buffer
//! (`send_buf`'s own buffer is written as it is) and written at the
//! ring's next free offset by one WRITE_WITH_IMM
//! (credited, like any user message) whose immediate tags it and gives
//! its length (`wire::STAGED_IMM_TAG`), and returns the send credits this
//! side owes when they are few (`wire::STAGED_GRANT_TAG`: staged messages
//! answering each other then need no `Credit` message, which cost the
//! peer a wake-up and a receive every 16 messages); a message with an immediate of
//! its own goes as a WRITE and a `Staged` SEND naming offset and length
//! (RC places the WRITE's bytes before the SEND arrives). The receiver
//! lends the message from its ring (`staged_lend.rs`: read only through
//! copies, since the peer may write the ring at any time; copied out
//! instead when lending would hold up too much of the ring or of the
//! unread backlog) and returns the messages it took out, once dropped, (wire version 12: a count, oldest first; the
//! sender knows the ring bytes each took): up to three at a time in the
//! immediate of a staged message of its own to the peer
//! (`wire::StagedImm::returned`), and, once the messages not returned so
//! took a quarter of the ring, all of them in a `StagingFreed` (credited).
//! A sender that has every message returned starts its next at the ring's
//! offset 0 and says so in the immediate (`wire::StagedImm::restart`; a
//! `Staged` names offset 0): staged messages answering each other then
//! use the first bytes of each ring over and over, which stay in the
//! caches, instead of cycling through the whole ring (4 MiB per direction
//! by default, more than this machine's L2).
//!
//! `max_unread_bytes`: while the unread backlog is over its limit, a
//! staged message stays in the ring (its bytes not freed, so the sender
//! soon waits for room) and so does every message after it, in order;
//! they are taken out as the application takes its messages, each once
//! the backlog is within the limit (so it exceeds it by one message at
//! most, as with READs).
//!
//! Placement is the same rule on both sides ([`place`]): a message starts
//! where the previous one ended, or at 0 if it does not fit before the
//! ring's end (the end is skipped and counted with it), or at 0 when its
//! immediate says it restarts (then it takes only its own bytes). The receiver
//! checks that every `Staged` names exactly that offset, so the sender
//! posts its WRITE and `Staged` pairs one at a time (`gate`), in the order
//! it placed them.
//!
//! Bounds and liveness: a message takes less than twice its length (with
//! a skipped end), at most half the ring; a sender that finds no room has
//! more than half the ring outstanding, of which the receiver returns a
//! quarter as soon as it has taken it out, whatever its application does
//! (the unread backlog holds credits back as for any message). So the
//! sender waits only for messages on their way.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::poll_fn;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

use tracing::Instrument;
use verbio_runtime::buf::LocalBuf;
use verbio_runtime::provider::AccessFlags;
use verbio_runtime::{Handle, Submit};

use super::copy_bufs::{Copied, CopyBufs};
use super::error::{AgentError, CloseReason};
use super::exposed::Exposed;
use super::flow::{Permit, Permits, Piggyback};
use super::msg::{Body, RecvMsg};
use super::rdma::{until_posted, Shared};
use super::staged_lend::{Lends, Ring};
use super::staging_budget::{Lease, StagingBudget};
use super::wire::{
    staged_grant_imm, Message, StagedImm, MAX_STAGED_GRANT, MAX_STAGED_GRANT_LEN,
    MAX_STAGED_RETURN, STAGED_IMM_TAG,
};
use crate::verbs::write::WriteVerb;
use crate::verbs::write_with_imm::WriteWithImmVerb;
use crate::verbs::{RemoteBuf, Verbs};

/// Smallest staging ring a side announces: four messages just above the
/// default receive buffer.
pub(crate) const MIN_STAGING_RING: usize = 64 * 1024;

/// Largest staging ring: a quarter of it, the longest message, fits the 24
/// length bits of a staged WRITE_WITH_IMM's immediate.
pub(crate) const MAX_STAGING_RING: usize = 32 << 20;

/// Where a message of `len` bytes goes in a ring of `ring` bytes whose next
/// free byte is `head`: its offset, and the ring bytes it takes (with the
/// end it skips when it does not fit before it).
pub(crate) fn place(head: u32, len: u32, ring: u32) -> (u32, u32) {
    if u64::from(head) + u64::from(len) <= u64::from(ring) {
        (head, len)
    } else {
        (0, ring.saturating_sub(head).saturating_add(len))
    }
}

/// The peer's ring, as announced.
#[derive(Debug, Clone, Copy)]
struct PeerRing {
    addr: u64,
    len: u32,
    rkey: u32,
}

/// A place taken in the peer's ring, given back if its message is not
/// posted ([`Staging::unreserve`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct Placed {
    pub(super) offset: u32,
    taken: u32,
    /// `head` before it.
    head: u32,
    /// Restarting at offset 0 (the ring was empty).
    pub(super) restart: bool,
}

/// What [`Staging::reserve_now`] found.
pub(super) enum Reserve {
    /// A place taken.
    Placed(Placed),
    /// The connection is down (or the peer has no ring).
    Closed,
    /// No room now.
    Full,
}

/// A message held back while the unread backlog is over its limit.
#[derive(Debug)]
enum Held {
    /// A staged message still in the ring: `len` bytes at `at`, taking
    /// `taken` ring bytes.
    Staged {
        imm: Option<u32>,
        at: u32,
        len: u32,
        taken: u32,
    },
    /// Any other message that arrived after one.
    Msg(RecvMsg),
}

/// One connection's staging: this side's ring (receiving) and the peer's
/// (sending).
#[derive(Debug)]
pub(crate) struct Staging {
    /// Bytes of this side's ring (0: none).
    ring_bytes: usize,
    /// This side's ring, once registered (at its announcement), with its
    /// lease of `budget`; shared with the messages lent from it.
    own: RefCell<Option<Rc<Ring>>>,
    /// Where the ring's bytes come from, shared with other connections.
    budget: StagingBudget,
    /// The ring was announced (or its registration failed: never again).
    /// Not set when the budget was spent: asked again at the peer's next
    /// message the ring would carry.
    announced: Cell<bool>,
    /// A refusal by the budget was logged.
    refusal_logged: Cell<bool>,
    /// Receiving: messages held back, in order (see the module's doc).
    held: RefCell<VecDeque<Held>>,
    /// Receiving: where the peer's next message must start.
    expect: Cell<u32>,
    /// Receiving: bytes taken out and not yet returned.
    freed: Cell<u32>,
    /// Receiving: the ring bytes each message taken out and not yet
    /// returned took, oldest first (`freed` is their sum).
    unreturned: RefCell<VecDeque<u32>>,
    /// Receiving: the vectors messages are copied out into, kept.
    copies: Rc<CopyBufs>,
    /// Receiving: the messages taken out from the oldest lent one on
    /// (`staged_lend.rs`), returned only once each before them is.
    lends: Lends,
    /// Sending: the peer's ring, once announced.
    peer: Cell<Option<PeerRing>>,
    /// Sending: where the next message goes.
    head: Cell<u32>,
    /// Sending: bytes written and not yet freed by the peer.
    used: Cell<u32>,
    /// Sending: the ring bytes each message written (or placed) and not
    /// yet returned took, oldest first (`used` is their sum).
    sent: RefCell<VecDeque<u32>>,
    /// Sending: the furthest end of a message placed in the peer's ring.
    reach: Cell<u32>,
    /// Senders waiting for room.
    waiters: RefCell<Vec<Waker>>,
    closed: Cell<bool>,
    /// One WRITE and `Staged` pair posted at a time, in placement order.
    gate: Permits,
}

impl Staging {
    /// A ring of `bytes` (none if 0) taken from `budget`, registered when
    /// first wanted.
    pub(crate) fn new(bytes: usize, budget: StagingBudget) -> Staging {
        Staging {
            ring_bytes: bytes,
            own: RefCell::new(None),
            budget,
            announced: Cell::new(false),
            refusal_logged: Cell::new(false),
            held: RefCell::new(VecDeque::new()),
            expect: Cell::new(0),
            freed: Cell::new(0),
            unreturned: RefCell::new(VecDeque::new()),
            copies: CopyBufs::new(bytes / 2),
            lends: Lends::default(),
            peer: Cell::new(None),
            head: Cell::new(0),
            used: Cell::new(0),
            sent: RefCell::new(VecDeque::new()),
            reach: Cell::new(0),
            waiters: RefCell::new(Vec::new()),
            closed: Cell::new(false),
            gate: Permits::new(1),
        }
    }

    /// Takes this side's ring's bytes from the budget, once: `None` if
    /// there is no ring, it was announced, the connection is down or the
    /// budget is spent (asked again next time).
    fn lease(&self) -> Option<Lease> {
        if self.ring_bytes == 0 || self.announced.get() || self.closed.get() {
            return None;
        }
        let Some(lease) = self.budget.take(self.ring_bytes) else {
            if !self.refusal_logged.replace(true) {
                tracing::debug!(
                    ring = self.ring_bytes,
                    in_use = self.budget.in_use(),
                    limit = self.budget.limit(),
                    "staging budget spent: no ring for now"
                );
            }
            return None;
        };
        self.announced.set(true);
        Some(lease)
    }

    /// Registers this side's ring for the peer to write (`exposed.rs`: a
    /// window its QP binds when the PD is shared) and returns its
    /// announcement; `None` if the registration failed (logged; the peer
    /// goes on without it) or the connection went down meanwhile.
    async fn register(&self, shared: &Shared, lease: Lease) -> Option<Message<'static>> {
        let exposed = Exposed::new(
            shared,
            vec![0u8; self.ring_bytes],
            AccessFlags::REMOTE_WRITE,
            "registering the staging ring",
        );
        let region = match exposed.await {
            Ok(r) => r,
            Err((e, _)) => {
                tracing::debug!(error = %crate::error::ErrorChain(&e), "no staging ring");
                return None;
            }
        };
        if self.closed.get() {
            return None;
        }
        let msg = Message::StagingRing {
            addr: region.addr(),
            // `RdmaBuilder::staging_ring` keeps it within MAX_STAGING_RING.
            len: region.len() as u32,
            rkey: region.rkey(),
        };
        *self.own.borrow_mut() = Some(Ring::new(region, lease));
        Some(msg)
    }

    /// This side's ring's keys, once registered (see `Exposed::keys`).
    pub(crate) fn keys(&self) -> Option<(super::wire::MrToken, u32)> {
        self.own.borrow().as_ref().map(|r| r.exposed().keys(0))
    }

    /// The agent stopped (nothing more arrives, the held messages were
    /// delivered): deregisters this side's ring and gives its bytes back
    /// to the budget (once the last message lent from it is dropped).
    pub(crate) fn release_ring(&self) {
        self.closed.set(true);
        self.lends.clear();
        self.own.borrow_mut().take();
    }

    /// The messages taken out from the oldest lent one on.
    #[inline(always)]
    pub(crate) fn lends(&self) -> &Lends {
        &self.lends
    }

    /// The connection's spare copy-out vectors.
    pub(crate) fn copy_bufs(&self) -> Rc<CopyBufs> {
        self.copies.clone()
    }

    /// A lent message was released: the messages now returnable (none
    /// before them held) count as taken out, and a quarter of the ring
    /// goes back to the peer.
    pub(crate) fn returnable_after_release(&self, shared: &Rc<Shared>) {
        self.lends.pop_returnable(|taken| {
            self.freed.set(self.freed.get().saturating_add(taken));
            self.unreturned.borrow_mut().push_back(taken);
        });
        if let Some(batch) = self.freed_batch() {
            return_freed(shared, batch);
        }
    }

    /// True while messages are held back.
    #[inline(always)]
    pub(crate) fn holding(&self) -> bool {
        !self.held.borrow().is_empty()
    }

    /// Holds `msg` back behind the staged messages held.
    pub(crate) fn hold(&self, msg: RecvMsg) {
        self.held.borrow_mut().push_back(Held::Msg(msg));
    }

    /// Longest message sent through the peer's ring (0: none, or not
    /// announced yet).
    #[inline]
    pub(crate) fn max_len(&self) -> usize {
        self.peer
            .get()
            .map_or(0, |p| (p.len as usize).min(MAX_STAGING_RING) / 4)
    }

    /// The furthest end of a message placed in the peer's ring so far.
    pub(crate) fn reach(&self) -> usize {
        self.reach.get() as usize
    }

    /// The connection is down: waiting senders give up.
    pub(crate) fn close(&self) {
        self.closed.set(true);
        self.gate.close(CloseReason::Local);
        self.wake();
    }

    fn wake(&self) {
        for w in std::mem::take(&mut *self.waiters.borrow_mut()) {
            w.wake();
        }
    }

    /// The peer announced its ring (once).
    pub(crate) fn peer_ring(&self, addr: u64, len: u32, rkey: u32) -> Result<(), CloseReason> {
        if self.peer.get().is_some() {
            return Err(CloseReason::Violation("staging ring announced twice"));
        }
        self.peer.set(Some(PeerRing { addr, len, rkey }));
        tracing::debug!(len, "the peer's staging ring");
        Ok(())
    }

    /// The peer took `count` more of the messages written into its ring
    /// out (the oldest not returned yet): the ring bytes they took are free.
    pub(crate) fn peer_freed(&self, count: u32) -> Result<(), CloseReason> {
        if count == 0 {
            return Ok(());
        }
        let mut sent = self.sent.borrow_mut();
        if count as usize > sent.len() {
            return Err(CloseReason::Violation(
                "staging ring bytes freed that were never written",
            ));
        }
        let bytes = sent
            .drain(..count as usize)
            .fold(0u32, |a, b| a.saturating_add(b));
        drop(sent);
        self.used.set(self.used.get().saturating_sub(bytes));
        self.wake();
        Ok(())
    }

    /// Takes a place for `len` bytes in the peer's ring, waiting for room;
    /// `None` once the connection is down. With `can_restart` (the message
    /// can say so) and every earlier message returned, at offset 0.
    fn poll_reserve(&self, len: u32, can_restart: bool, cx: &Context<'_>) -> Poll<Option<Placed>> {
        match self.reserve_now(len, can_restart) {
            Reserve::Placed(p) => Poll::Ready(Some(p)),
            Reserve::Closed => Poll::Ready(None),
            Reserve::Full => {
                let mut w = self.waiters.borrow_mut();
                if !w.iter().any(|w| w.will_wake(cx.waker())) {
                    w.push(cx.waker().clone());
                }
                Poll::Pending
            }
        }
    }

    /// Where a message of `len` bytes placed at `p` goes in the peer's
    /// ring (`None`: no ring announced).
    pub(super) fn remote_for(&self, p: &Placed, len: u32) -> Option<RemoteBuf> {
        let peer = self.peer.get()?;
        Some(RemoteBuf::new(
            peer.addr + u64::from(p.offset),
            u64::from(len),
            peer.rkey,
        ))
    }

    /// The gate of the WRITE and `Staged` pairs (one posted at a time, in
    /// placement order).
    pub(super) fn gate(&self) -> &Permits {
        &self.gate
    }

    /// [`Staging::poll_reserve`] without waiting: `Full` if there is no
    /// room now (nothing taken, no waker kept).
    #[inline]
    pub(super) fn reserve_now(&self, len: u32, can_restart: bool) -> Reserve {
        if self.closed.get() {
            return Reserve::Closed;
        }
        let Some(peer) = self.peer.get() else {
            return Reserve::Closed;
        };
        let head = self.head.get();
        let restart = can_restart && head != 0 && self.sent.borrow().is_empty();
        let (offset, taken) = if restart {
            (0, len)
        } else {
            place(head, len, peer.len)
        };
        let used = self.used.get();
        if u64::from(used) + u64::from(taken) > u64::from(peer.len) {
            return Reserve::Full;
        }
        self.used.set(used + taken);
        self.sent.borrow_mut().push_back(taken);
        self.head.set(offset + len);
        self.reach.set(self.reach.get().max(offset + len));
        Reserve::Placed(Placed {
            offset,
            taken,
            head,
            restart,
        })
    }

    /// Gives back a place whose message was not posted (the latest taken:
    /// the gate is still held, and the peer cannot have returned it).
    fn unreserve(&self, p: Placed) {
        self.head.set(p.head);
        self.sent.borrow_mut().pop_back();
        self.used.set(self.used.get().saturating_sub(p.taken));
        self.wake();
    }

    /// Receiving: places the next message, of `len` bytes (`offset`:
    /// where its `Staged` says it is, which must be where the ring's order
    /// puts it or 0, a restart; `restart`: its immediate says it starts at
    /// 0): its offset and the ring bytes it takes.
    fn arrived(
        &self,
        offset: Option<u32>,
        len: u32,
        restart: bool,
    ) -> Result<(u32, u32), CloseReason> {
        let own = self.own.borrow();
        let Some(ring) = own.as_ref() else {
            return Err(CloseReason::Violation(
                "staged message without a staging ring",
            ));
        };
        // Registered with at most MAX_STAGING_RING bytes.
        let size = ring.region().len() as u32;
        if len == 0 || len > size / 4 {
            return Err(CloseReason::Violation(
                "staged message empty or longer than a quarter of the ring",
            ));
        }
        let placed = place(self.expect.get(), len, size);
        let (at, taken) = match offset {
            _ if restart => (0, len),
            None => placed,
            Some(o) if o == placed.0 => placed,
            // A `Staged` restarting.
            Some(0) => (0, len),
            Some(_) => {
                return Err(CloseReason::Violation(
                    "staged message not where the ring's order puts it",
                ))
            }
        };
        self.expect.set(at + len);
        Ok((at, taken))
    }

    /// Receiving: copies a placed message out of the ring; its bytes count
    /// as freed (or, behind a lent message, once that one is released).
    fn take_out(&self, ring: &Ring, at: u32, len: u32, taken: u32) -> Result<Copied, CloseReason> {
        let mut bytes = self.copies.take(len as usize);
        ring.region()
            .append_to(at as usize, len as usize, &mut bytes)
            .map_err(|_| CloseReason::Violation("staged message outside the staging ring"))?;
        if self.lends.is_empty() {
            self.freed.set(self.freed.get().saturating_add(taken));
            self.unreturned.borrow_mut().push_back(taken);
        } else {
            self.lends.push(taken, None);
        }
        Ok(Copied::new(bytes, &self.copies))
    }

    /// Receiving: every message not returned yet, once they took a quarter
    /// of the ring (the ring bytes each took, oldest first).
    fn freed_batch(&self) -> Option<Vec<u32>> {
        let ring = self.own.borrow().as_ref()?.region().len() as u32;
        if self.freed.get() < ring / 4 {
            return None;
        }
        self.freed.set(0);
        Some(self.unreturned.borrow_mut().drain(..).collect())
    }

    /// Messages taken for a return were not returned (its message was not
    /// posted): they wait for the next.
    pub(super) fn unfreed(&self, taken: impl DoubleEndedIterator<Item = u32>) {
        let mut q = self.unreturned.borrow_mut();
        for t in taken.rev() {
            q.push_front(t);
            self.freed.set(self.freed.get().saturating_add(t));
        }
    }

    /// Receiving: up to [`MAX_STAGED_RETURN`] messages not returned yet, to
    /// ride on a staged message of this side's; returned again to the
    /// count (see [`Returns`]) unless that message is posted.
    pub(super) fn take_returns<'a>(&'a self, posted: &'a Cell<bool>) -> Returns<'a> {
        let mut taken = [0u32; MAX_STAGED_RETURN as usize];
        let mut q = self.unreturned.borrow_mut();
        let n = q.len().min(taken.len());
        for (t, b) in taken.iter_mut().zip(q.drain(..n)) {
            *t = b;
            self.freed.set(self.freed.get().saturating_sub(b));
        }
        Returns {
            staging: self,
            taken,
            n,
            posted,
        }
    }
}

/// Messages taken out of this side's ring, returned with one staged
/// message of this side's ([`Staging::take_returns`]). Dropped before that
/// message was posted, they are owed again.
#[must_use = "returns taken and not posted are owed again when dropped"]
pub(super) struct Returns<'a> {
    staging: &'a Staging,
    taken: [u32; MAX_STAGED_RETURN as usize],
    n: usize,
    posted: &'a Cell<bool>,
}

impl Returns<'_> {
    /// The messages returned.
    fn count(&self) -> u32 {
        self.n as u32
    }

    /// Kept for a message whose post is still to come
    /// (`staged_now::Waiting`): what [`Staging::unfreed`] takes back if it
    /// never is.
    pub(super) fn detach(self) -> ([u32; MAX_STAGED_RETURN as usize], usize) {
        let kept = (self.taken, self.n);
        std::mem::forget(self);
        kept
    }
}

impl Drop for Returns<'_> {
    fn drop(&mut self) {
        if !self.posted.get() && self.n > 0 {
            self.staging.unfreed(self.taken[..self.n].iter().copied());
        }
    }
}

/// What a staged message is written from: the caller's bytes (`&[u8]`),
/// copied into a send buffer once a place in the ring is taken, or the
/// caller's own registered buffer (`LocalBuf`, from `Rdma::send_buf`),
/// written as it is and given back when the send ends.
pub(crate) trait Source: Sized {
    /// What the caller gets back with the result.
    type Back;
    /// The message's length.
    fn len(&self) -> usize;
    /// The buffer the WRITE goes from (`Err`: none could be had).
    fn into_buf(self, s: &Shared) -> Result<LocalBuf, (AgentError, Self::Back)>;
    /// Given back unused.
    fn back(self) -> Self::Back;
    /// Given back by the WRITE's completion (or refusal).
    fn returned(buf: LocalBuf) -> Self::Back;
    /// What a failed send returns without awaiting its WRITE (left to the
    /// runtime, which frees the buffer at its completion); `None`: the
    /// WRITE is awaited to give the caller's buffer back (a failed
    /// connection's flush ends it).
    fn detached() -> Option<Self::Back>;
}

impl Source for &[u8] {
    type Back = ();
    fn len(&self) -> usize {
        <[u8]>::len(self)
    }
    fn into_buf(self, s: &Shared) -> Result<LocalBuf, (AgentError, ())> {
        s.pool.alloc_from(self).map_err(|source| {
            let e = AgentError::Buf {
                stage: "allocating a staging send buffer",
                source,
            };
            (e, ())
        })
    }
    fn back(self) {}
    fn returned(_: LocalBuf) {}
    fn detached() -> Option<()> {
        Some(())
    }
}

impl Source for LocalBuf {
    type Back = LocalBuf;
    fn len(&self) -> usize {
        LocalBuf::len(self)
    }
    fn into_buf(self, _: &Shared) -> Result<LocalBuf, (AgentError, LocalBuf)> {
        Ok(self)
    }
    fn back(self) -> LocalBuf {
        self
    }
    fn returned(buf: LocalBuf) -> LocalBuf {
        buf
    }
    fn detached() -> Option<LocalBuf> {
        None
    }
}

/// The sender's side: `data` (longer than a piece, at most
/// [`Staging::max_len`]) written into the peer's ring: one WRITE_WITH_IMM
/// whose immediate tags it and gives its length, or, for a message with an
/// immediate of its own, a WRITE and a `Staged` naming it. Returns once
/// posted (the runtime keeps the send buffer until the WRITE completes;
/// should it fail, the connection goes down with that error, as for an
/// INLINE send). Cancel-safe: dropped before it is posted, the place in the
/// ring and the credit are given back and the peer sees nothing.
pub(crate) async fn send_staged(
    s: &Rc<Shared>,
    data: &[u8],
    imm: Option<u32>,
) -> Result<(), AgentError> {
    send_staged_from(s, data, imm, None).await.0
}

/// [`send_staged`] from `src` (see [`Source`]; with `credit` if one was
/// taken already): from a `LocalBuf` the
/// device reads the caller's registered memory, no copy is made, and the
/// buffer comes back whenever the send ends.
pub(crate) async fn send_staged_from<'a, S: Source>(
    s: &'a Rc<Shared>,
    src: S,
    imm: Option<u32>,
    credit: Option<Permit<'a>>,
) -> (Result<(), AgentError>, S::Back) {
    let Ok(len) = u32::try_from(src.len()) else {
        return (Err(s.closed_error()), src.back());
    };
    let st = &s.staging;
    let credit = match credit {
        Some(c) => c,
        None => match s.send_credits.acquire().await {
            Ok(c) => c,
            Err(_) => return (Err(s.closed_error()), src.back()),
        },
    };
    let Ok(gate) = st.gate.acquire().await else {
        return (Err(s.closed_error()), src.back());
    };
    // A message with its own immediate names its offset in its `Staged`;
    // one without, in its WRITE_WITH_IMM's immediate if that has the bits.
    let can_restart = imm.is_some() || len <= MAX_STAGED_GRANT_LEN;
    let Some(placed) = poll_fn(|cx| st.poll_reserve(len, can_restart, cx)).await else {
        return (Err(s.closed_error()), src.back());
    };
    // Given back unless the message is posted.
    let mut undo = Unreserve {
        staging: st,
        placed: Some(placed),
    };
    let Some(peer) = st.peer.get() else {
        return (Err(s.closed_error()), src.back());
    };
    let buf = match src.into_buf(s) {
        Ok(b) => b,
        Err((e, back)) => return (Err(e), back),
    };
    let remote = RemoteBuf::new(
        peer.addr + u64::from(placed.offset),
        u64::from(len),
        peer.rkey,
    );
    let posted = Cell::new(false);
    // The WRITE in flight, awaited (once the gate is open again) before
    // `send` returns, as a piece's SEND is.
    let (outcome, res) = match imm {
        None => {
            let (tag, ride, returns) = staged_tag(s, len, placed.restart, &posted);
            let write = s.qp.write_with_imm(buf, remote, tag);
            let out = match until_posted(write, Some(credit), &posted).await {
                Ok(w) => (Outcome::Tagged(w), Ok(())),
                Err((Ok(_), b)) => (Outcome::Ended(b), Ok(())),
                Err((Err(e), b)) => (Outcome::Ended(b), Err(s.verb_error(e))),
            };
            // Owed again unless posted.
            drop(ride);
            drop(returns);
            out
        }
        Some(imm) => {
            let write = s.qp.write(buf, remote);
            match until_posted(write, None, &Cell::new(false)).await {
                Ok(w) => {
                    let msg = Message::Staged {
                        imm: Some(imm),
                        grant: 0, // the credits owed then, filled in at posting
                        offset: placed.offset,
                        len,
                    };
                    let sent = s.post_staged(&msg, credit, &posted).await;
                    (Outcome::Plain(w), sent)
                }
                Err((Ok(_), b)) => (Outcome::Ended(b), Err(s.closed_error())),
                Err((Err(e), b)) => (Outcome::Ended(b), Err(s.verb_error(e))),
            }
        }
    };
    if posted.get() {
        undo.placed = None;
    }
    drop(undo);
    drop(gate);
    if res.is_err() {
        if let Some(back) = S::detached() {
            return (res, back);
        }
    }
    let (done, back) = match outcome {
        Outcome::Tagged(w) => {
            let (r, b) = w.await;
            (s.verb_result(r.map(drop)), S::returned(b))
        }
        Outcome::Plain(w) => {
            let (r, b) = w.await;
            (s.verb_result(r.map(drop)), S::returned(b))
        }
        Outcome::Ended(b) => (Ok(()), S::returned(b)),
    };
    (res.and(done), back)
}

/// The immediate of a staged message of `len` bytes without an immediate
/// of its own (`restart`: placed at offset 0 as a restart), and what rides
/// on it: the credits owed and the peer's messages taken out of this
/// side's ring, if the immediate has room for them (else they stay owed,
/// for a `Credit`, a `StagingFreed` or a later message). Both are owed
/// again if dropped while `posted` is false.
pub(super) fn staged_tag<'a>(
    s: &'a Shared,
    len: u32,
    restart: bool,
    posted: &'a Cell<bool>,
) -> (u32, Option<Piggyback<'a>>, Option<Returns<'a>>) {
    let ride = s.owed.take_all(&s.granted_credits, posted);
    let ride = (ride.count() <= MAX_STAGED_GRANT).then_some(ride);
    let returns = s.staging.take_returns(posted);
    let said = StagedImm {
        len,
        grant: ride.as_ref().map_or(0, |r| r.count()),
        returned: returns.count(),
        restart,
    };
    match staged_grant_imm(said) {
        Some(tag) => (tag, ride, Some(returns)),
        None => {
            drop(ride);
            drop(returns);
            // Longer than the tag's bits: never restarting (`can_restart`).
            // `max_len` keeps `len` within the plain tag's 24 bits.
            (STAGED_IMM_TAG | len, None, None)
        }
    }
}

/// A staged message's WRITE: in flight, or ended (refused, or complete)
/// with its buffer given back.
enum Outcome {
    Tagged(Submit<WriteWithImmVerb<LocalBuf>>),
    Plain(Submit<WriteVerb<LocalBuf>>),
    Ended(LocalBuf),
}

/// Gives a place in the ring back unless its message was posted.
pub(super) struct Unreserve<'a> {
    pub(super) staging: &'a Staging,
    pub(super) placed: Option<Placed>,
}

impl Drop for Unreserve<'_> {
    fn drop(&mut self) {
        if let Some(p) = self.placed.take() {
            self.staging.unreserve(p);
        }
    }
}

/// The receiver's side of a staged message (a tagged WRITE_WITH_IMM, or a
/// `Staged` naming `offset`): taken out of the ring and returned, for the
/// caller to deliver (as `task::step` returns a whole message: straight to
/// a waiting receiver, not through the inbox, whose detour left the ring
/// looking untaken at the pass's end and woke the agent task for every
/// staged message), or `None`: held back (see the module's doc). A
/// quarter of the ring freed goes back to the peer.
pub(crate) fn received(
    shared: &Rc<Shared>,
    imm: Option<u32>,
    offset: Option<u32>,
    len: u32,
    restart: bool,
) -> Result<Option<RecvMsg>, CloseReason> {
    let st = &shared.staging;
    let (at, taken) = st.arrived(offset, len, restart)?;
    if imm.is_none() {
        // Landing slots would carry it: grant them.
        super::landing::wanted(shared, u64::from(len));
    }
    if st.holding() || shared.backlog.bytes() > shared.backlog.limit() {
        st.held.borrow_mut().push_back(Held::Staged {
            imm,
            at,
            len,
            taken,
        });
        return Ok(None);
    }
    take_staged(shared, imm, at, len, taken).map(Some)
}

/// Takes a staged message out of the ring: lent (`staged_lend.rs`) while
/// the unread backlog stays within half its limit with it; else copied
/// out (its bytes freed). (The receive that hands a lent message to the
/// application bounds the ring bytes lent messages hold up:
/// `staged_lend::handed`.)
fn take_staged(
    shared: &Rc<Shared>,
    imm: Option<u32>,
    at: u32,
    len: u32,
    taken: u32,
) -> Result<RecvMsg, CloseReason> {
    let st = &shared.staging;
    let Some(ring) = st.own.borrow().clone() else {
        return Err(CloseReason::Violation(
            "staged message without a staging ring",
        ));
    };
    if u64::from(at) + u64::from(len) > ring.region().len() as u64 {
        return Err(CloseReason::Violation(
            "staged message outside the staging ring",
        ));
    }
    let lend = shared.backlog.bytes().saturating_add(u64::from(len)) <= shared.backlog.limit() / 2;
    let body = if lend {
        Body::Staged(super::staged_lend::lend(shared, &ring, at, len, taken))
    } else {
        Body::Copied(st.take_out(&ring, at, len, taken)?)
    };
    if let Some(batch) = st.freed_batch() {
        return_freed(shared, batch);
    }
    Ok(RecvMsg { body, imm })
}

/// Delivers the messages held back, in order, while the unread backlog is
/// within its limit (or all of them with `all`: the receive side is
/// closing); [`Shared::taken`] calls this.
pub(crate) fn release_held(shared: &Rc<Shared>, all: bool) {
    let st = &shared.staging;
    loop {
        let front = {
            let mut held = st.held.borrow_mut();
            match held.front() {
                None => None,
                Some(Held::Staged { .. })
                    if !all && shared.backlog.bytes() > shared.backlog.limit() =>
                {
                    None
                }
                Some(_) => held.pop_front(),
            }
        };
        match front {
            Some(Held::Staged {
                imm,
                at,
                len,
                taken,
            }) => match take_staged(shared, imm, at, len, taken) {
                Ok(m) => super::task::deliver_now(shared, m),
                Err(reason) => {
                    shared.fail(reason);
                    return;
                }
            },
            Some(Held::Msg(m)) => super::task::deliver_now(shared, m),
            None => return,
        }
    }
}

/// Registers and announces this side's ring the first time the peer sends
/// a message of `len` bytes it would carry (by a task: a credited message
/// may wait for credits, which the agent's loop receives).
pub(crate) fn wanted(shared: &Rc<Shared>, len: u64) {
    super::landing::wanted(shared, len);
    let st = &shared.staging;
    if st.announced.get() || st.ring_bytes == 0 || len > (st.ring_bytes / 4) as u64 {
        return;
    }
    let Some(h) = Handle::try_current() else {
        return;
    };
    let Some(lease) = st.lease() else {
        return;
    };
    let s = shared.clone();
    h.spawn(
        async move {
            let Some(msg) = s.staging.register(&s, lease).await else {
                return;
            };
            if let Err(e) = s.send_message(&msg, true).await {
                tracing::debug!(error = %crate::error::ErrorChain(&e), "announcing the staging ring failed");
            }
        }
        .instrument(shared.span.clone()),
    );
}

/// Sends the peer a `StagingFreed` returning the messages of `batch` (the
/// ring bytes each took, by a task); owed again if it cannot be sent.
fn return_freed(shared: &Rc<Shared>, batch: Vec<u32>) {
    let Some(h) = Handle::try_current() else {
        shared.staging.unfreed(batch.into_iter());
        return;
    };
    let s = shared.clone();
    h.spawn(
        async move {
            // Counted by `freed_batch`, within the ring's bytes.
            let count = batch.len() as u32;
            if let Err(e) = s
                .send_message(&Message::StagingFreed { count }, true)
                .await
            {
                s.staging.unfreed(batch.into_iter());
                tracing::debug!(error = %crate::error::ErrorChain(&e), count, "returning staging ring messages failed");
            }
        }
        .instrument(shared.span.clone()),
    );
}

#[cfg(test)]
mod tests {
    use super::place;

    #[test]
    fn placement_wraps_and_counts_the_skipped_end() {
        assert_eq!(place(0, 10, 100), (0, 10));
        assert_eq!(place(90, 10, 100), (90, 10), "fits exactly before the end");
        assert_eq!(place(100, 10, 100), (0, 10), "at the end: starts over");
        assert_eq!(
            place(95, 10, 100),
            (0, 15),
            "the 5 bytes at the end are skipped"
        );
        assert_eq!(place(u32::MAX, 1, u32::MAX), (0, 1));
        assert_eq!(place(7, u32::MAX, 8), (0, u32::MAX), "never overflows");
    }
}
