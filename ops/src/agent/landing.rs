//! Landing slots: mid-size messages received without a copy.
//!
//! The staging ring (`staging.rs`) lends its bytes to the application
//! only through copies (`staged_lend.rs`): its one rkey lets the peer
//! write anywhere in it at any time, so no reference into it is handed
//! out, and a message that is read is copied once. At 256 KiB that copy
//! (then made at take-out) was the whole gap to the verbs path
//! (docs/benchmarks.md).
//! A landing slot is memory the peer may write exactly one message into:
//!
//! - A side registers [`SLOTS`] slots of `staging_ring / 4` bytes (at most
//!   [`MAX_SLOT`]) each, the first time the peer sends a message of at least
//!   [`LEND_MIN`] bytes a slot would carry, and grants each with a
//!   `SlotGrant` (address, length and an rkey of that slot's own
//!   registration, or of a window its QP binds on a shared PD:
//!   `exposed.rs`). The bytes come out of the connection's
//!   `StagingBudget`, as the ring's do; a spent budget grants nothing.
//! - The sender writes a message of at least [`LEND_MIN`] bytes without an
//!   immediate of its own into the oldest slot granted to it, by one
//!   WRITE_WITH_IMM whose immediate names the slot and the length
//!   (`wire::landed_imm`; credited like any user message). Each grant is
//!   used once. With no slot granted, the message goes through the ring
//!   as before: a sender never waits for a slot.
//! - The receiver checks that the slot is granted and the length fits,
//!   revokes the slot's registration (deregisters it, or deallocates its
//!   window: from then on no rkey reaches it), and delivers the slot's
//!   memory itself as the message ([`LentSlot`]). When the application
//!   drops the message, the slot is registered again, under a fresh rkey,
//!   and granted again. `receive()` (a `Vec`) copies the message out and
//!   grants the slot again at once.
//!
//! So the peer cannot write a message's bytes while the application holds
//! them, whatever it does: a WRITE through a revoked key fails at the
//! device (`REM_ACCESS_ERR`, the peer's connection goes down). Memory: at
//! most the slots' bytes, leased from the budget until the last slot's
//! memory is freed (a message held after its connection ended still holds
//! it). Order: a landed message is a user message like a whole one (held
//! behind staged messages held back, charged to the unread backlog by its
//! slot's size).

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::rc::{Rc, Weak};

use tracing::Instrument;
use verbio_runtime::provider::AccessFlags;
use verbio_runtime::Handle;

use super::error::{AgentError, CloseReason};
use super::exposed::Exposed;
use super::msg::{Body, RecvMsg};
use super::rdma::{until_posted, Shared};
use super::staging::Source;
use super::staging_budget::{Lease, StagingBudget};
use super::wire::{landed_imm, Message, MAX_LANDED_LEN, MAX_SLOTS};
use crate::verbs::{RemoteBuf, Verbs};

/// Slots a side grants (at most `wire::MAX_SLOTS`).
pub(crate) const SLOTS: u32 = 4;

/// Shortest message sent into a slot, by measurement (soft device,
/// `send_lat`, docs/benchmarks.md "Landing slots"). A slot costs its
/// revocation, a registration and a `SlotGrant` (a SEND and a receive on
/// each side) per message; on the soft device that SEND, a small packet
/// arriving on its own after the large payload, also makes the next
/// payload's bytes arrive through the engine's buffer and a copy. A staged
/// message lent from the ring (`staged_lend.rs`) costs none of that and no
/// copy unless the application reads it, then one. At 256 KiB the ring is
/// 0.8x verbs' latency where the slot was 1.3-1.4x, so that even an
/// application that reads the message (one copy, about 11 us here) pays
/// no more than the slot; from 512 KiB the copy costs more than the slot
/// saves it (512 KiB: slot 113 us, ring 90-110 plus a 25 us copy; 1 MiB:
/// the same time without the 60-100 us copy). (Before staged messages
/// were lent, the ring copied every message out and the slot paid from
/// 128 KiB.)
pub(crate) const LEND_MIN: usize = 512 * 1024;

/// Largest slot.
pub(crate) const MAX_SLOT: usize = 1 << 20;

const _: () = assert!(SLOTS <= MAX_SLOTS && MAX_SLOT <= MAX_LANDED_LEN as usize);

/// A slot the peer granted.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PeerSlot {
    slot: u32,
    addr: u64,
    len: u32,
    rkey: u32,
}

/// One of this side's slots.
#[derive(Debug)]
enum Own {
    /// Being registered, or its memory is held by a message.
    Away,
    /// Granted to the peer (or about to be).
    Granted(Exposed),
}

/// One connection's landing slots: this side's (receiving) and the peer's
/// (sending).
#[derive(Debug)]
pub(crate) struct Landing {
    /// Bytes of each of this side's slots (0: none).
    slot_bytes: usize,
    /// Where the slots' bytes come from.
    budget: StagingBudget,
    /// The slots were asked for (or their registration failed: never
    /// again). Not set when the budget was spent.
    announced: Cell<bool>,
    /// This side's slots, once registered.
    own: RefCell<Vec<Own>>,
    /// The slots' bytes taken from the budget, given back once the last
    /// slot's memory is freed.
    lease: RefCell<Option<Rc<Lease>>>,
    /// Slots the peer granted, oldest first.
    peer: RefCell<VecDeque<PeerSlot>>,
    closed: Cell<bool>,
}

impl Landing {
    /// Slots of `staging_ring / 4` bytes (none below [`LEND_MIN`]) taken
    /// from `budget` when first wanted.
    pub(crate) fn new(staging_ring: usize, budget: StagingBudget) -> Landing {
        let bytes = (staging_ring / 4).min(MAX_SLOT);
        Landing {
            slot_bytes: if bytes >= LEND_MIN { bytes } else { 0 },
            budget,
            announced: Cell::new(false),
            own: RefCell::new(Vec::new()),
            lease: RefCell::new(None),
            peer: RefCell::new(VecDeque::new()),
            closed: Cell::new(false),
        }
    }

    /// The connection is down: no slot is used or granted again (what
    /// completed before is still delivered, until [`Landing::release`]).
    pub(crate) fn close(&self) {
        self.closed.set(true);
        self.peer.borrow_mut().clear();
    }

    /// The agent stopped (nothing more arrives): this side's granted slots
    /// are revoked and freed; the ones lent are freed when their messages
    /// are dropped, and the budget's bytes go back with the last.
    pub(crate) fn release(&self) {
        self.closed.set(true);
        self.own.borrow_mut().clear();
        self.lease.borrow_mut().take();
    }

    /// Slots the peer granted and this side has not used yet (tests).
    pub(crate) fn granted(&self) -> usize {
        self.peer.borrow().len()
    }

    /// This side's slots granted now: the token naming each as the peer
    /// sees it (its id the slot's number) and the rkey of the
    /// registration beneath (see `Exposed::keys`).
    pub(crate) fn keys(&self) -> Vec<(super::wire::MrToken, u32)> {
        self.own
            .borrow()
            .iter()
            .enumerate()
            .filter_map(|(i, o)| match o {
                Own::Granted(e) => Some(e.keys(i as u64)),
                Own::Away => None,
            })
            .collect()
    }

    /// Sending: the oldest slot granted, for a message of `len` bytes
    /// without an immediate of its own, if one fits.
    pub(crate) fn take(&self, len: usize) -> Option<PeerSlot> {
        if len < LEND_MIN || self.closed.get() {
            return None;
        }
        let mut peer = self.peer.borrow_mut();
        if peer.front()?.len as usize >= len {
            peer.pop_front()
        } else {
            None
        }
    }

    /// Sending: gives back a slot whose message was not posted (first in
    /// line again), unless the peer granted it again meanwhile.
    fn put_back(&self, slot: PeerSlot) {
        if self.closed.get() {
            return;
        }
        let mut peer = self.peer.borrow_mut();
        if !peer.iter().any(|p| p.slot == slot.slot) {
            peer.push_front(slot);
        }
    }

    /// The peer granted a slot.
    pub(crate) fn peer_granted(
        &self,
        slot: u32,
        addr: u64,
        len: u32,
        rkey: u32,
    ) -> Result<(), CloseReason> {
        if self.closed.get() {
            return Ok(());
        }
        let mut peer = self.peer.borrow_mut();
        if peer.iter().any(|p| p.slot == slot) {
            return Err(CloseReason::Violation(
                "landing slot granted again before it was used",
            ));
        }
        peer.push_back(PeerSlot {
            slot,
            addr,
            len,
            rkey,
        });
        Ok(())
    }

    /// Takes the slots' bytes from the budget, once: `None` if there are
    /// none, they were asked for, the connection is down or the budget is
    /// spent (asked again next time).
    fn lease(&self) -> Option<Lease> {
        if self.slot_bytes == 0 || self.announced.get() || self.closed.get() {
            return None;
        }
        let lease = self.budget.take(self.slot_bytes * SLOTS as usize)?;
        self.announced.set(true);
        Some(lease)
    }
}

/// A message written into a landing slot, lent to the application: the
/// first `len` bytes of the slot's memory, no longer reachable by the
/// peer. Dropped, the slot is registered again and granted to the peer.
#[derive(Debug)]
pub(crate) struct LentSlot {
    /// Always `Some` until dropped or taken.
    mem: Option<Vec<u8>>,
    len: usize,
    slot: u32,
    home: Weak<Shared>,
    /// The budget's bytes, held while the memory lives.
    _lease: Rc<Lease>,
}

impl LentSlot {
    /// The message's bytes.
    #[inline]
    pub(crate) fn bytes(&self) -> &[u8] {
        match &self.mem {
            Some(m) => m.get(..self.len).unwrap_or_default(),
            None => &[],
        }
    }

    /// What it holds (its slot's size), for the unread backlog.
    pub(crate) fn capacity(&self) -> usize {
        self.mem.as_ref().map_or(0, Vec::len)
    }
}

impl Drop for LentSlot {
    fn drop(&mut self) {
        if let (Some(mem), Some(s)) = (self.mem.take(), self.home.upgrade()) {
            regrant(&s, self.slot, mem, self._lease.clone());
        }
    }
}

/// Registers the slots and grants them the first time the peer sends a
/// message of `len` bytes one would carry (by a task: credited messages
/// may wait for credits, which the agent's loop receives).
pub(crate) fn wanted(shared: &Rc<Shared>, len: u64) {
    let l = &shared.landing;
    if l.announced.get() || len < LEND_MIN as u64 || len > l.slot_bytes as u64 {
        return;
    }
    let Some(h) = Handle::try_current() else {
        return;
    };
    let Some(lease) = l.lease() else {
        return;
    };
    *l.lease.borrow_mut() = Some(Rc::new(lease));
    l.own.borrow_mut().extend((0..SLOTS).map(|_| Own::Away));
    let s = shared.clone();
    h.spawn(
        async move {
            for slot in 0..SLOTS {
                let mem = vec![0u8; s.landing.slot_bytes];
                if !grant(&s, slot, mem).await {
                    return;
                }
            }
            tracing::debug!(
                slots = SLOTS,
                bytes = s.landing.slot_bytes,
                "landing slots granted"
            );
        }
        .instrument(shared.span.clone()),
    );
}

/// Exposes `mem` as slot `slot` and grants it to the peer; false if that
/// failed (logged; the slot stays away, the peer goes on with the others)
/// or the connection is down.
async fn grant(s: &Rc<Shared>, slot: u32, mem: Vec<u8>) -> bool {
    if s.landing.closed.get() {
        return false;
    }
    let exposed = match Exposed::new(
        s,
        mem,
        AccessFlags::REMOTE_WRITE,
        "registering a landing slot",
    )
    .await
    {
        Ok(e) => e,
        Err((e, _)) => {
            tracing::debug!(error = %crate::error::ErrorChain(&e), slot, "no landing slot");
            return false;
        }
    };
    let l = &s.landing;
    if l.closed.get() {
        return false;
    }
    let msg = Message::SlotGrant {
        slot,
        addr: exposed.addr(),
        // At most MAX_SLOT bytes.
        len: exposed.len() as u32,
        rkey: exposed.rkey(),
    };
    match l.own.borrow_mut().get_mut(slot as usize) {
        Some(own) => *own = Own::Granted(exposed),
        None => return false,
    }
    if let Err(e) = s.send_message(&msg, true).await {
        tracing::debug!(error = %crate::error::ErrorChain(&e), slot, "granting a landing slot failed");
        return false;
    }
    true
}

/// A lent slot's memory came back: registered again and granted (by a
/// task), unless the connection is down.
fn regrant(s: &Rc<Shared>, slot: u32, mem: Vec<u8>, lease: Rc<Lease>) {
    if s.landing.closed.get() {
        return;
    }
    let Some(h) = Handle::try_current() else {
        return;
    };
    let sh = s.clone();
    h.spawn(
        async move {
            grant(&sh, slot, mem).await;
            drop(lease);
        }
        .instrument(s.span.clone()),
    );
}

/// The receiver's side: the peer wrote `len` bytes into slot `slot` (a
/// WRITE_WITH_IMM tagged [`wire::SLOT_IMM_TAG`](super::wire::SLOT_IMM_TAG)):
/// the slot is revoked and its memory becomes the message.
pub(crate) fn received(shared: &Rc<Shared>, slot: u32, len: u32) -> Result<RecvMsg, CloseReason> {
    let l = &shared.landing;
    let exposed = {
        let mut own = l.own.borrow_mut();
        let Some(entry) = own.get_mut(slot as usize) else {
            return Err(CloseReason::Violation(
                "message written into a slot never granted",
            ));
        };
        match std::mem::replace(entry, Own::Away) {
            Own::Granted(e) if e.len() >= len as usize => e,
            Own::Granted(e) => {
                *entry = Own::Granted(e);
                return Err(CloseReason::Violation(
                    "message longer than its landing slot",
                ));
            }
            Own::Away => {
                return Err(CloseReason::Violation(
                    "message written into a landing slot not granted to it",
                ))
            }
        }
    };
    if len as usize > shared.config.max_message_len {
        return Err(CloseReason::Violation("message longer than the maximum"));
    }
    let lease = l.lease.borrow().clone();
    let (Some(mem), Some(lease)) = (exposed.revoke(), lease) else {
        return Err(CloseReason::Violation("landing slot gone while granted"));
    };
    Ok(RecvMsg {
        body: Body::Landed(LentSlot {
            mem: Some(mem),
            len: len as usize,
            slot,
            home: Rc::downgrade(shared),
            _lease: lease,
        }),
        imm: None,
    })
}

/// The sender's side: `src` (at least [`LEND_MIN`] bytes, at most the
/// slot's length) written into the peer's slot `slot` by one
/// WRITE_WITH_IMM. Returns once the WRITE completed. Cancel-safe: dropped
/// before it is posted, the slot and the credit are given back and the
/// peer sees nothing.
pub(crate) async fn send_landed_from<S: Source>(
    s: &Rc<Shared>,
    src: S,
    slot: PeerSlot,
) -> (Result<(), AgentError>, S::Back) {
    let mut back = PutBack {
        landing: &s.landing,
        slot: Some(slot),
    };
    // `Landing::take` keeps the length within the slot, and so within
    // what an immediate can name (a grant is at most MAX_LANDED_LEN).
    let Some(imm) = u32::try_from(src.len())
        .ok()
        .and_then(|len| landed_imm(slot.slot, len))
    else {
        let len = src.len();
        return (
            Err(AgentError::MessageTooLarge {
                len,
                max: slot.len as usize,
            }),
            src.back(),
        );
    };
    let Ok(credit) = s.send_credits.acquire().await else {
        return (Err(s.closed_error()), src.back());
    };
    let len = src.len() as u64;
    let buf = match src.into_buf(s) {
        Ok(b) => b,
        Err((e, back)) => return (Err(e), back),
    };
    let remote = RemoteBuf::new(slot.addr, len, slot.rkey);
    let posted = Cell::new(false);
    let write = s.qp.write_with_imm(buf, remote, imm);
    let outcome = until_posted(write, Some(credit), &posted).await;
    if posted.get() {
        back.slot = None;
    }
    drop(back);
    match outcome {
        Ok(w) => {
            let (r, b) = w.await;
            (s.verb_result(r.map(drop)), S::returned(b))
        }
        Err((Ok(_), b)) => (Ok(()), S::returned(b)),
        Err((Err(e), b)) => (Err(s.verb_error(e)), S::returned(b)),
    }
}

/// Gives a slot back unless its message was posted.
struct PutBack<'a> {
    landing: &'a Landing,
    slot: Option<PeerSlot>,
}

impl Drop for PutBack<'_> {
    fn drop(&mut self) {
        if let Some(p) = self.slot.take() {
            self.landing.put_back(p);
        }
    }
}
