//! Staged messages lent to the application: `receive_msg` delivers a
//! message the peer wrote into this side's staging ring (`staging.rs`)
//! without copying it out. The message's ring bytes (and so the sender's
//! room for them) go back to the peer when the application drops it.
//!
//! # What the peer can do to lent bytes
//!
//! The peer's write key covers the whole ring, at any time: a buggy or
//! hostile peer can write a lent message's bytes while the application
//! holds it (an honest one never does: it writes only ring bytes
//! returned to it, and these are not returned while lent). So a lent
//! message never hands out a reference into the ring, which would promise
//! Rust unchanging bytes. Its bytes are read only by copies made under the
//! device's lock (`RemoteAccessRegion::append_to` and `read_into`, the
//! accessors of every memory a peer may write: see
//! `runtime/src/provider/soft/dma.rs` for why those are race-free), into
//!
//! - the caller's memory ([`RecvMsg::copy_to`](super::RecvMsg::copy_to)):
//!   each call copies what the ring holds then;
//! - or a private copy made at the message's first `Deref` (or
//!   `into_vec`, or an eviction, below) and kept in a `OnceCell`: every
//!   `&[u8]` the message hands out is of that copy, which nothing changes
//!   once made.
//!
//! So what the peer can do is choose the bytes the application reads:
//! before the copy, a mix of what it sent and what it wrote since (torn,
//! as a NIC's DMA leaves it); after it, nothing. Those are bytes it could
//! have sent in the message in the first place, and it reaches no memory
//! but its own messages' place in the ring (the registration's bounds,
//! checked by the device). That is no worse than the copy at take-out it
//! replaces: the peer could write the ring before that copy too; only the
//! window is longer (until the first read, not the take-out).
//!
//! # Bounds, order and liveness
//!
//! The ring returns messages to the sender by count, oldest first
//! (`wire::StagedImm::returned`, `StagingFreed`). A lent message holds up
//! the return of every message taken out after it (`Lends`), lent or
//! copied, so messages dropped out of order go back in the ring's order.
//! Two bounds keep a receiver that holds lent messages from stalling its
//! sender:
//!
//! - The ring bytes the application holds up (the lent messages a receive
//!   returned to it and it has not dropped, and every message taken out
//!   after the oldest of them, but the lent ones still queued in the
//!   inbox: `Lends::held_up`) stay within a quarter of the ring: the
//!   receive that would take them over first evicts every lent message
//!   (copies it into its private copy, which its later reads use, and
//!   returns its ring bytes). With the ring's usual rule (a quarter
//!   returned as soon as it is taken out), a sender that finds no room
//!   (more than half the ring outstanding) still waits only for messages
//!   on their way or in the inbox, which the application takes by reading,
//!   as before: an application that holds every message it got and waits
//!   for the next one never stalls its peer.
//! - Lent bytes count as unread (`max_unread_bytes`, in the inbox or
//!   not) until dropped or evicted; a message is lent only while the
//!   unread backlog stays within half the limit with it (else copied, as
//!   before), so lent messages alone never keep the peer's credits
//!   withheld (they come back at half the limit).
//!
//! A lent message does not hold its credit: the WRITE_WITH_IMM's receive
//! buffer is reposted at once, as for any staged message.

use std::cell::{Cell, OnceCell, RefCell};
use std::collections::VecDeque;
use std::rc::{Rc, Weak};

use tracing::Instrument;
use verbio_runtime::buf::RemoteAccessRegion;
use verbio_runtime::Handle;

use super::copy_bufs::Copied;
use super::exposed::Exposed;
use super::rdma::Shared;
use super::staging_budget::Lease;

/// This side's staging ring, registered: shared with the messages lent
/// from it, so its memory (and its lease of the budget) lives until the
/// last of them is dropped, also after the connection ended.
#[derive(Debug)]
pub(crate) struct Ring {
    /// Declared first: deregistered before the lease goes back.
    exposed: Exposed,
    _lease: Lease,
}

impl Ring {
    pub(crate) fn new(exposed: Exposed, lease: Lease) -> Rc<Ring> {
        Rc::new(Ring {
            exposed,
            _lease: lease,
        })
    }

    /// The ring as the peer reaches it.
    pub(crate) fn exposed(&self) -> &Exposed {
        &self.exposed
    }

    /// Its memory, read through the device-ordered accessors only.
    pub(crate) fn region(&self) -> &RemoteAccessRegion<Vec<u8>> {
        self.exposed.region()
    }
}

/// One lent message's state, shared by the message and the connection's
/// [`Lends`] (which evicts it).
#[derive(Debug)]
pub(crate) struct Lend {
    ring: Rc<Ring>,
    at: u32,
    len: u32,
    /// The ring bytes it took.
    taken: u32,
    /// Handed to the application (returned by a receive), not only queued
    /// in the inbox.
    handed: Cell<bool>,
    /// The private copy (made once; never changed after).
    copy: OnceCell<Copied>,
    /// Its ring bytes went back (dropped or evicted); `copy` is set if
    /// it was evicted.
    released: Cell<bool>,
}

impl Lend {
    /// The private copy, made now if it was not (from the ring: not
    /// released yet, so the peer was not given these bytes back).
    fn copy(&self, home: &Weak<Shared>) -> &Copied {
        self.copy.get_or_init(|| {
            let (mut v, bufs) = match home.upgrade() {
                Some(s) => {
                    let bufs = s.staging.copy_bufs();
                    (bufs.take(self.len as usize), Some(bufs))
                }
                None => (Vec::with_capacity(self.len as usize), None),
            };
            // Within the ring: checked at its arrival (`Staging::arrived`).
            let _ = self
                .ring
                .region()
                .append_to(self.at as usize, self.len as usize, &mut v);
            match bufs {
                Some(b) => Copied::new(v, &b),
                None => Copied::detached(v),
            }
        })
    }
}

/// The body of a [`RecvMsg`](super::RecvMsg) lent from the staging ring.
#[derive(Debug)]
pub(crate) struct LentStaged {
    lend: Rc<Lend>,
    home: Weak<Shared>,
}

impl LentStaged {
    /// The message's length.
    #[inline(always)]
    pub(crate) fn len(&self) -> usize {
        self.lend.len as usize
    }

    /// Its bytes: the private copy, made at the first call.
    #[inline]
    pub(crate) fn bytes(&self) -> &[u8] {
        self.lend.copy(&self.home).bytes()
    }

    /// True while its bytes are read from the ring (no private copy yet).
    pub(crate) fn in_ring(&self) -> bool {
        self.lend.copy.get().is_none()
    }

    /// Copies its bytes from `off` into `dst`, as many as both have:
    /// from the private copy if there is one, else from the ring (under
    /// the device's lock). Returns how many.
    pub(crate) fn copy_to(&self, off: usize, dst: &mut [u8]) -> usize {
        let len = self.len();
        let n = len.saturating_sub(off).min(dst.len());
        if n == 0 {
            return 0;
        }
        match self.lend.copy.get() {
            Some(c) => dst[..n].copy_from_slice(&c.bytes()[off..off + n]),
            None => {
                // Within the message (n above), so within the ring.
                let at = self.lend.at as usize + off;
                let _ = self.lend.ring.region().read_into(at, &mut dst[..n]);
            }
        }
        n
    }

    /// The bytes as a vector of their own (the private copy, or one made
    /// now); the ring bytes go back as the message is dropped.
    pub(crate) fn into_vec(self) -> Vec<u8> {
        if let Some(c) = self.lend.copy.get() {
            return c.bytes().to_vec();
        }
        let mut v = Vec::with_capacity(self.len());
        let _ = self
            .lend
            .ring
            .region()
            .append_to(self.lend.at as usize, self.len(), &mut v);
        v
    }
}

impl Drop for LentStaged {
    fn drop(&mut self) {
        if self.lend.released.get() {
            return;
        }
        if let Some(s) = self.home.upgrade() {
            release(&s, &self.lend);
        } else {
            self.lend.released.set(true);
        }
    }
}

/// The messages taken out of the ring from the oldest lent one on, oldest
/// first (see the module's doc): each with the ring bytes it took and its
/// lend (`None`: copied, returnable once the ones before are).
#[derive(Debug, Default)]
pub(crate) struct Lends {
    queue: RefCell<VecDeque<(u32, Option<Rc<Lend>>)>>,
    /// The ring bytes of `queue`.
    bytes: Cell<u32>,
    /// The ring bytes of the lent messages of `queue` not handed to the
    /// application yet (queued in the inbox: the newest, since the inbox
    /// hands them out in the order they were taken out).
    queued: Cell<u32>,
    /// Released lends kept for the next ones (at most [`SPARE`]): a lend
    /// allocates nothing in a steady stream (`tests/agent_alloc.rs`). One
    /// whose message is still being dropped is reused once it is gone.
    spare: RefCell<Vec<Rc<Lend>>>,
}

/// Released lends kept at most.
const SPARE: usize = 16;

impl Lends {
    /// True if no message is lent (a message taken out is returnable at once).
    #[inline(always)]
    pub(crate) fn is_empty(&self) -> bool {
        self.queue.borrow().is_empty()
    }

    /// The ring bytes held up by the application: lent messages handed to
    /// it and not dropped, and the messages taken out after them (all of
    /// `queue` but the lent messages still queued in the inbox).
    #[inline(always)]
    pub(crate) fn held_up(&self) -> u32 {
        self.bytes.get().saturating_sub(self.queued.get())
    }

    /// A message taken out behind a lent one, copied (`lend: None`), or lent.
    pub(crate) fn push(&self, taken: u32, lend: Option<Rc<Lend>>) {
        self.queue.borrow_mut().push_back((taken, lend));
        self.bytes.set(self.bytes.get().saturating_add(taken));
    }

    /// Pops the returnable messages at the front (copied, or lent and
    /// released): the ring bytes each took, oldest first.
    pub(crate) fn pop_returnable(&self, mut out: impl FnMut(u32)) {
        let mut q = self.queue.borrow_mut();
        while let Some((taken, lend)) = q.front() {
            if lend.as_ref().is_some_and(|l| !l.released.get()) {
                break;
            }
            let taken = *taken;
            if let Some((_, Some(l))) = q.pop_front() {
                let mut spare = self.spare.borrow_mut();
                if spare.len() < SPARE {
                    spare.push(l);
                }
            }
            self.bytes.set(self.bytes.get().saturating_sub(taken));
            out(taken);
        }
    }

    /// A lend of `len` bytes at `at` of `ring`: a spare one reset (its old
    /// copy's vector goes back to the connection's), or a new one.
    fn new_lend(&self, ring: &Rc<Ring>, at: u32, len: u32, taken: u32) -> Rc<Lend> {
        let mut spare = self.spare.borrow_mut();
        if let Some(i) = spare.iter().position(|l| Rc::strong_count(l) == 1) {
            let mut l = spare.swap_remove(i);
            drop(spare);
            if let Some(m) = Rc::get_mut(&mut l) {
                if !Rc::ptr_eq(&m.ring, ring) {
                    m.ring = ring.clone();
                }
                m.at = at;
                m.len = len;
                m.taken = taken;
                m.handed.set(false);
                m.copy.take();
                m.released.set(false);
                return l;
            }
        } else {
            drop(spare);
        }
        Rc::new(Lend {
            ring: ring.clone(),
            at,
            len,
            taken,
            handed: Cell::new(false),
            copy: OnceCell::new(),
            released: Cell::new(false),
        })
    }

    /// The lends not released yet (for eviction), oldest first.
    fn live(&self) -> Vec<Rc<Lend>> {
        self.queue
            .borrow()
            .iter()
            .filter_map(|(_, l)| l.clone())
            .filter(|l| !l.released.get())
            .collect()
    }

    /// Forgets every message (the agent stopped: nothing is returned any
    /// more). Lent messages keep their ring's memory alive.
    pub(crate) fn clear(&self) {
        let q = std::mem::take(&mut *self.queue.borrow_mut());
        let spare = std::mem::take(&mut *self.spare.borrow_mut());
        self.bytes.set(0);
        self.queued.set(0);
        drop(q);
        drop(spare);
    }
}

/// Lends the message of `len` bytes at `at` of `ring` (it took `taken`
/// ring bytes): counted as unread until released.
pub(crate) fn lend(
    shared: &Rc<Shared>,
    ring: &Rc<Ring>,
    at: u32,
    len: u32,
    taken: u32,
) -> LentStaged {
    let lends = shared.staging.lends();
    let lend = lends.new_lend(ring, at, len, taken);
    lends.push(taken, Some(lend.clone()));
    lends.queued.set(lends.queued.get().saturating_add(taken));
    shared.backlog.add(u64::from(len));
    LentStaged {
        lend,
        home: Rc::downgrade(shared),
    }
}

/// A receive returns `msg` to the application: a lent message counts as
/// held by it from now on, and if the application now holds up more than
/// a quarter of the ring, every lent message is copied out and its ring
/// bytes go back (see the module's doc).
#[inline]
pub(crate) fn handed(shared: &Rc<Shared>, msg: &super::msg::RecvMsg) {
    let super::msg::Body::Staged(l) = &msg.body else {
        return;
    };
    let lend = &l.lend;
    if lend.handed.replace(true) || lend.released.get() {
        return;
    }
    let lends = shared.staging.lends();
    lends
        .queued
        .set(lends.queued.get().saturating_sub(lend.taken));
    if lends.held_up() > lend.ring.region().len() as u32 / 4 {
        evict_all(shared);
    }
}

/// Copies every lent message (into its private copy) and gives its ring
/// bytes back: the application holds up more than a quarter of the ring.
fn evict_all(shared: &Rc<Shared>) {
    let live = shared.staging.lends().live();
    if live.is_empty() {
        return;
    }
    tracing::trace!(
        lent = live.len(),
        held_up = shared.staging.lends().held_up(),
        "staging ring mostly held by lent messages: copying them out"
    );
    let home = Rc::downgrade(shared);
    for l in &live {
        l.copy(&home);
        release(shared, l);
    }
}

/// `lend`'s ring bytes go back (its message was dropped, or evicted with
/// its copy made): the messages now returnable join the ring's returns,
/// and its unread charge ends.
fn release(shared: &Rc<Shared>, lend: &Lend) {
    if lend.released.replace(true) {
        return;
    }
    if !lend.handed.get() {
        let lends = shared.staging.lends();
        lends
            .queued
            .set(lends.queued.get().saturating_sub(lend.taken));
    }
    shared.staging.returnable_after_release(shared);
    let over = shared.backlog.bytes() > shared.backlog.limit();
    let n = shared.backlog.remove(u64::from(lend.len));
    if n == 0 && !over && !shared.staging.holding() {
        return;
    }
    // Withheld credits to return, held messages or READs to resume: by a
    // task (this may run in the application's drop, inside the agent's
    // own calls).
    let Some(h) = Handle::try_current() else {
        shared.owed.unsent(n);
        return;
    };
    let s = shared.clone();
    h.spawn(
        async move {
            s.owed.unsent(n);
            s.return_owed_batch("lent staged messages dropped: returning withheld credits");
            s.taken(0);
        }
        .instrument(shared.span.clone()),
    );
}
