//! [`RecvMsg`]: a received message. A message that fit in one receive
//! buffer is lent zero-copy: the slot of the connection's receive ring it
//! landed in, reposted when the message is dropped (the ring has spare
//! slots for lent messages, see `Receiving`); a reassembled message, or
//! one that arrived while every spare slot was lent, is one contiguous
//! vector; a message copied out of the staging ring is a vector kept for
//! the next such copy once dropped (`copy_bufs.rs`); a message the peer
//! wrote into the staging ring is lent from there, its ring bytes given
//! back once dropped, and read through copies only (`staged_lend.rs`);
//! a message READ from the peer is the registered vector it was
//! read into, kept for the next READ once dropped (`read_bufs.rs`); a
//! message the peer wrote into a landing slot is that slot's memory, no
//! longer reachable by the peer, granted again once dropped
//! (`landing.rs`).

use std::cell::Cell;
use std::ops::{Deref, Range};
use std::rc::Rc;

use verbio_runtime::RingMsg;

use super::backlog::SMALL_ITEM_CHARGE;
use super::copy_bufs::Copied;
use super::landing::LentSlot;
use super::read_bufs::ReadInto;
use super::staged_lend::LentStaged;

/// Where the bytes are.
#[derive(Debug)]
pub(crate) enum Body {
    /// The payload inside the receive ring's slot it arrived in.
    Ring(Lent),
    /// Reassembled from pieces, or copied out of its slot.
    Vec(Vec<u8>),
    /// Copied out of the staging ring into a vector that goes back to the
    /// connection's spares when the message is dropped.
    Copied(Copied),
    /// READ from the peer into a registered vector, which goes back to
    /// the connection's spares when the message is dropped.
    Read(ReadInto),
    /// Written by the peer into a landing slot, revoked while lent.
    Landed(LentSlot),
    /// Written by the peer into the staging ring and lent from there.
    Staged(LentStaged),
}

/// A receive-ring slot lent to the application: the payload at `range`
/// of the slot. Dropping it reposts the slot and gives its spare back
/// (`lent` counts the connection's lent slots).
#[derive(Debug)]
pub(crate) struct Lent {
    slot: RingMsg,
    range: Range<usize>,
    lent: Rc<Cell<u32>>,
}

impl Lent {
    /// Lends `slot`'s bytes `range`; `None` (and the slot back at once) if
    /// the range is not within what it received.
    pub(crate) fn new(slot: RingMsg, range: Range<usize>, lent: &Rc<Cell<u32>>) -> Option<Lent> {
        slot.get(range.clone())?;
        lent.set(lent.get() + 1);
        Some(Lent {
            slot,
            range,
            lent: lent.clone(),
        })
    }

    #[inline(always)]
    fn bytes(&self) -> &[u8] {
        // Checked in `new`; a slot's bytes never change while lent.
        self.slot.get(self.range.clone()).unwrap_or_default()
    }
}

impl Drop for Lent {
    #[inline(always)]
    fn drop(&mut self) {
        self.lent.set(self.lent.get().saturating_sub(1));
    }
}

/// A received message and its immediate (`None` if sent without one).
#[derive(Debug)]
pub struct RecvMsg {
    pub(crate) body: Body,
    pub(crate) imm: Option<u32>,
}

impl RecvMsg {
    /// What this message counts for in the unread backlog: the receive
    /// buffer it holds (of `buf_size` bytes: `recv_buf_size` and the
    /// header) or its length as a vector, at least [`SMALL_ITEM_CHARGE`]
    /// (a pack's empty messages hold memory too).
    pub(crate) fn charge(&self, buf_size: usize) -> u64 {
        match &self.body {
            Body::Ring(_) => buf_size as u64,
            Body::Vec(v) => (v.len() as u64).max(SMALL_ITEM_CHARGE),
            Body::Copied(c) => (c.bytes().len() as u64).max(SMALL_ITEM_CHARGE),
            Body::Read(r) => r.len() as u64,
            Body::Landed(l) => l.capacity() as u64,
            // Charged while lent, in the inbox or not (`staged_lend::lend`);
            // an evicted one, then a copy, is no longer charged.
            Body::Staged(_) => 0,
        }
    }

    /// The message's length (without copying a lent staged message).
    #[inline]
    pub fn len(&self) -> usize {
        match &self.body {
            Body::Staged(l) => l.len(),
            _ => (**self).len(),
        }
    }

    /// True for an empty message.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True while the bytes are still in the connection's staging ring,
    /// where the peer wrote them (a message longer than one receive buffer
    /// and at most a quarter of the ring): lent, not copied, its ring bytes
    /// given back to the peer when this message is dropped. The first
    /// `Deref` (or [`into_vec`](Self::into_vec)) copies them into memory of
    /// the message's own; [`copy_to`](Self::copy_to) copies them where the
    /// caller wants, without that copy. The connection may also copy them
    /// itself while the application holds many lent messages, to give the
    /// peer room.
    ///
    /// The peer's key covers the whole ring, so a buggy or hostile peer can
    /// still write these bytes until they are copied: the copies are made
    /// under the device's ordering (as [`RemoteAccessRegion`]'s accessors
    /// are), so a read sees what the peer sent or a mix with what it wrote
    /// since, never memory outside the message, and the bytes a `Deref`
    /// hands out never change.
    ///
    /// [`RemoteAccessRegion`]: verbio_runtime::buf::RemoteAccessRegion
    pub fn is_lent_from_ring(&self) -> bool {
        matches!(&self.body, Body::Staged(l) if l.in_ring())
    }

    /// Copies the message's bytes from `offset` into `dst`, as many as
    /// both have, and returns how many: for a message lent from the
    /// staging ring ([`is_lent_from_ring`](Self::is_lent_from_ring)), one
    /// copy straight from the ring (each call reads what the ring holds
    /// then), without the copy a `Deref` makes.
    pub fn copy_to(&self, offset: usize, dst: &mut [u8]) -> usize {
        if let Body::Staged(l) = &self.body {
            return l.copy_to(offset, dst);
        }
        let src = (**self).get(offset..).unwrap_or_default();
        let n = src.len().min(dst.len());
        dst[..n].copy_from_slice(&src[..n]);
        n
    }

    /// The immediate of `send_with_imm`.
    pub fn imm(&self) -> Option<u32> {
        self.imm
    }

    /// True if the bytes are still in the receive buffer they arrived in
    /// (a slot of the connection's receive ring, reposted when this
    /// message is dropped).
    pub fn is_zero_copy(&self) -> bool {
        matches!(self.body, Body::Ring(_))
    }

    /// True if the bytes are still where the peer wrote them: one of the
    /// connection's landing slots (a message of 512 KiB or more without an
    /// immediate, written by one RDMA WRITE while the peer held a slot
    /// granted; the slot is revoked while this message lives, so the peer
    /// cannot write these bytes, and granted again when it is dropped).
    pub fn is_landed(&self) -> bool {
        matches!(self.body, Body::Landed(_))
    }

    /// The bytes as a vector (a copy unless reassembled); a lent receive
    /// buffer is reposted at once.
    pub fn into_vec(self) -> Vec<u8> {
        match self.body {
            Body::Ring(l) => l.bytes().to_vec(),
            Body::Vec(v) => v,
            Body::Copied(c) => c.into_vec(),
            Body::Read(r) => r.into_vec(),
            // A copy: the slot's memory goes back to the connection.
            Body::Landed(l) => l.bytes().to_vec(),
            // A copy: the ring bytes go back to the peer.
            Body::Staged(l) => l.into_vec(),
        }
    }
}

impl Deref for RecvMsg {
    type Target = [u8];
    #[inline(always)]
    fn deref(&self) -> &[u8] {
        match &self.body {
            Body::Ring(l) => l.bytes(),
            Body::Vec(v) => v,
            Body::Copied(c) => c.bytes(),
            Body::Read(r) => r.bytes(),
            Body::Landed(l) => l.bytes(),
            Body::Staged(l) => l.bytes(),
        }
    }
}
