//! Large messages by RDMA READ: instead of splitting a message of at least
//! [`READ_MIN`] bytes into many `Data` pieces (each a SEND into a receive
//! buffer, with its header, its completion and its copy into the
//! reassembled message), the sender copies it into memory registered for
//! the peer to read and sends a `ReadMe` naming it; the receiver fetches it
//! with one RDMA READ straight into the vector it delivers, and releases
//! the region with a `Release` of the token's id. `send` returns once the
//! region is released (the message was received).
//!
//! The receiver counts a message as unread from the start of its READ,
//! and starts one only while the unread backlog is within
//! `max_unread_bytes` (the others wait for the application to take its
//! messages), so the backlog exceeds the limit by one message at most.
//!
//! Bounds: a sender has at most [`MAX_SPLIT_IN_PROGRESS`] messages offered
//! or in pieces at once (the permit is held until the release, also when
//! the `send` is cancelled after the `ReadMe` was posted: the peer may be
//! reading the region); the receiver refuses a peer that starts more, and
//! a message longer than `max_message_len`.
//!
//! [`MAX_SPLIT_IN_PROGRESS`]: super::wire::MAX_SPLIT_IN_PROGRESS

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

use futures::channel::oneshot;
use tracing::Instrument;
use verbio_runtime::buf::{IoBuf, LocalBuf, RegisteredMem, Slice};
use verbio_runtime::provider::AccessFlags;
use verbio_runtime::spawn;

use super::error::{AgentError, CloseReason};
use super::exposed::Exposed;
use super::msg::{Body, RecvMsg};
use super::rdma::Shared;
use super::read_bufs::{ReadBufs, ReadInto};
use super::wire::{Message, MrToken, MAX_SPLIT_IN_PROGRESS};
use crate::verbs::{RemoteBuf, Verbs};

/// Messages at least this long go by READ when they fit neither one
/// receive buffer nor the peer's staging ring (`staging.rs`, which takes
/// them up to a quarter of its size once announced). Measured on the soft device (docs/benchmarks.md): from
/// 32 KiB a window of READs moves more per second than the pieces (1.35x),
/// from 64 KiB one READ at a time is also faster; below, the READ's extra
/// round trip costs more than the pieces save.
pub(crate) const READ_MIN: usize = 32 * 1024;

/// Token ids of regions offered for a READ have this bit set, so they never
/// meet the ids of grants (`tokens.rs`) or window grants (`WINDOW_ID`).
pub(crate) const READ_ID: u64 = 1 << 62;

/// One side's large messages: those it offered (sender) and those it is
/// fetching (receiver).
#[derive(Debug)]
pub(crate) struct Reads {
    /// Vectors to READ into, back from dropped messages.
    bufs: Rc<ReadBufs>,
    next_id: Cell<u64>,
    /// Regions offered to the peer, by token id, until it releases them.
    offered: RefCell<HashMap<u64, Offer>>,
    /// The peer's offers being fetched or waiting to be (`waiting`).
    fetching: Cell<usize>,
    /// Offers not fetched yet because the unread backlog is over its limit
    /// (fetched, in order, as the application takes its messages).
    waiting: RefCell<std::collections::VecDeque<(Option<u32>, MrToken)>>,
}

/// The memory an offer lends the peer: a copy of a `send`'s bytes, or the
/// caller's own registered buffer (`send_buf`), registered once more (for
/// remote READ, exactly its message bytes) and given back once released.
/// On a shared protection domain both are reached through a window the
/// connection's QP binds (`exposed.rs`).
#[derive(Debug)]
enum Lent {
    Copy(Exposed<Vec<u8>>),
    Buf(Exposed<Slice<LocalBuf>>),
}

impl Lent {
    /// The token naming it (id `id`) and the rkey of its registration.
    fn keys(&self, id: u64) -> (MrToken, u32) {
        match self {
            Lent::Copy(r) => r.keys(id),
            Lent::Buf(r) => r.keys(id),
        }
    }

    /// Ends the peer's access and gives the caller's buffer back (`None`
    /// for a copy, which is freed).
    fn revoke(self) -> Option<LocalBuf> {
        match self {
            Lent::Copy(r) => {
                drop(r);
                None
            }
            Lent::Buf(r) => r.revoke().map(Slice::into_inner),
        }
    }
}

#[derive(Debug)]
struct Offer {
    /// The token the peer was given and the rkey of the registration
    /// beneath (for the test hook `Rdma::exposed_memory_unchecked`).
    keys: (MrToken, u32),
    /// The memory of a `send` cancelled after its `ReadMe` was posted:
    /// kept registered (the peer may be reading it) until released or the
    /// connection is down. A running `send` holds its memory itself.
    orphan: Option<Lent>,
    /// Tells the waiting `send` (gone if it was cancelled).
    done: Option<oneshot::Sender<()>>,
}

impl Reads {
    /// Keeps at most `max_unread_bytes` of vectors to READ into.
    pub(crate) fn new(max_unread_bytes: u64) -> Reads {
        Reads {
            bufs: ReadBufs::new(max_unread_bytes),
            next_id: Cell::new(0),
            offered: RefCell::default(),
            fetching: Cell::new(0),
            waiting: RefCell::default(),
        }
    }

    /// The live offers' keys (see `Exposed::keys`).
    pub(crate) fn keys(&self) -> Vec<(MrToken, u32)> {
        self.offered.borrow().values().map(|o| o.keys).collect()
    }

    /// Offers and READs in progress, for the receiver's bound.
    pub(crate) fn fetching(&self) -> usize {
        self.fetching.get()
    }

    /// The connection is down: every offer is withdrawn (their `send`s
    /// fail, and give the memory they hold back) and the memory of
    /// cancelled ones freed.
    pub(crate) fn clear(&self) {
        let offers = std::mem::take(&mut *self.offered.borrow_mut());
        drop(offers);
        self.waiting.borrow_mut().clear();
    }
}

/// Sends `data` (at least [`READ_MIN`] bytes, more than one piece) as a
/// `ReadMe` of a registered copy; the caller holds a split permit, which
/// this gives back once the offer ends.
pub(crate) async fn send_by_read(
    s: &Rc<Shared>,
    data: &[u8],
    imm: Option<u32>,
) -> Result<(), AgentError> {
    // Failed or cancelled (a bind is awaited on a shared PD), the permit
    // goes back.
    let mut permit = PermitBack {
        shared: s,
        armed: true,
    };
    let exposed = Exposed::new(s, data.to_vec(), AccessFlags::REMOTE_READ, REGISTERING);
    let lent = Lent::Copy(exposed.await.map_err(|(e, _)| e)?);
    permit.armed = false;
    offer(s, lent, imm).await.0
}

/// `Rdma::send_buf` of a message that goes by READ: the peer reads `buf`
/// itself (registered once more, for remote READ, for the time of the
/// offer), no copy is made. Takes a split permit (given back once the
/// offer ends); the buffer comes back whenever the send ends, except when
/// it is cancelled after its `ReadMe` was posted: then it stays registered
/// until the peer released it (or the connection is down) and is freed.
pub(crate) async fn send_buf_by_read(
    s: &Rc<Shared>,
    buf: LocalBuf,
    imm: Option<u32>,
) -> (Result<(), AgentError>, LocalBuf) {
    match s.split_permits.acquire().await {
        Ok(permit) => permit.spend(),
        Err(_) => return (Err(s.closed_error()), buf),
    }
    let len = buf.len();
    // (`0..len` is within the capacity: cannot fail.)
    let slice = match buf.slice(0..len) {
        Ok(slice) => slice,
        Err(r) => {
            s.split_permits.grant(1);
            let e = AgentError::Buf {
                stage: "lending a large message for the peer to read",
                source: r.error,
            };
            return (Err(e), r.buf);
        }
    };
    let mut permit = PermitBack {
        shared: s,
        armed: true,
    };
    let lent = match Exposed::new(s, slice, AccessFlags::REMOTE_READ, REGISTERING).await {
        Ok(r) => Lent::Buf(r),
        Err((e, Some(back))) => return (Err(e), back.into_inner()),
        // `Exposed::new` gives the memory back on every path that returns.
        Err((_, None)) => unreachable!("exposed memory comes back when exposing fails"),
    };
    permit.armed = false;
    let (r, back) = offer(s, lent, imm).await;
    match back {
        Some(buf) => (r, buf),
        // `offer` gives a `Lent::Buf` back on every path that returns.
        None => unreachable!("an offered buffer comes back"),
    }
}

/// Offers `lent` to the peer with a `ReadMe` and waits until it is
/// released; gives the caller's buffer back (if it lent one) whenever it
/// returns. Cancelled before the `ReadMe` was posted, the offer is
/// withdrawn (the memory freed); after, the memory stays registered in
/// the offer until released.
async fn offer(
    s: &Rc<Shared>,
    lent: Lent,
    imm: Option<u32>,
) -> (Result<(), AgentError>, Option<LocalBuf>) {
    let reads = &s.reads;
    let id = READ_ID | (reads.next_id.get() + 1);
    reads.next_id.set(reads.next_id.get() + 1);
    let keys = lent.keys(id);
    let token = MrToken {
        access: AccessFlags::REMOTE_READ.bits(),
        ..keys.0
    };
    let (tx, done) = oneshot::channel();
    reads.offered.borrow_mut().insert(
        id,
        Offer {
            keys,
            orphan: None,
            done: Some(tx),
        },
    );
    // Until the `ReadMe` is posted the offer is withdrawn if this is
    // cancelled or fails; once posted the peer may be reading it, so a
    // cancelled send leaves its memory in the offer until released.
    let posted = Cell::new(false);
    let mut held = Held {
        shared: s,
        id,
        lent: Some(lent),
        posted: &posted,
    };
    let sent = s
        .send_message_noting(&Message::ReadMe { imm, token }, true, &posted)
        .await;
    if let Err(e) = sent {
        if !posted.get() {
            // Never offered: withdrawn, the permit given back.
            held.withdraw();
            return (Err(e), held.take());
        }
        // Posted, but its SEND failed: the connection is down (the offer
        // goes with it, `clear`).
        return (Err(e), held.take());
    }
    let r = match done.await {
        Ok(()) => Ok(()),
        // Withdrawn by `clear`: the connection is down.
        Err(oneshot::Canceled) => Err(s.closed_error()),
    };
    (r, held.take())
}

/// What a failed registration of a message for READ says.
const REGISTERING: &str = "registering a large message for the peer to read";

/// Gives a split permit back unless disarmed.
struct PermitBack<'a> {
    shared: &'a Shared,
    armed: bool,
}

impl Drop for PermitBack<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.shared.split_permits.grant(1);
        }
    }
}

/// The memory of an offer while its `send` runs: cancelled before the
/// `ReadMe` was posted, the offer is withdrawn and the memory freed;
/// after, the memory moves into the offer (if it is still there), freed
/// once the peer released it or the connection is down.
struct Held<'a> {
    shared: &'a Rc<Shared>,
    id: u64,
    lent: Option<Lent>,
    /// Set once the `ReadMe` is posted (it then reaches the peer, also
    /// if the send is cancelled while its completion is awaited).
    posted: &'a Cell<bool>,
}

impl Held<'_> {
    /// Removes the offer (never posted) and gives its permit back.
    fn withdraw(&mut self) {
        let removed = self.shared.reads.offered.borrow_mut().remove(&self.id);
        if removed.is_some() {
            self.shared.split_permits.grant(1);
        }
    }

    /// Deregisters the memory and gives the caller's buffer back.
    fn take(&mut self) -> Option<LocalBuf> {
        self.lent.take().and_then(Lent::revoke)
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let Some(lent) = self.lent.take() else {
            return;
        };
        if !self.posted.get() {
            self.withdraw();
            drop(lent);
            return;
        }
        match self.shared.reads.offered.borrow_mut().get_mut(&self.id) {
            Some(offer) => offer.orphan = Some(lent),
            // Released or the connection is down meanwhile: the peer no
            // longer reads it.
            None => drop(lent),
        }
    }
}

/// The peer released offer `id` (it read the message): the `send` returns
/// (and frees or gives back the memory) or, if it was cancelled, the
/// memory is freed. False for an id this side never offered or already
/// saw released.
pub(crate) fn released(shared: &Shared, id: u64) -> bool {
    let Some(mut offer) = shared.reads.offered.borrow_mut().remove(&id) else {
        return false;
    };
    shared.split_permits.grant(1);
    if let Some(tx) = offer.done.take() {
        let _ = tx.send(()); // (the `send` may have been cancelled)
    }
    drop(offer.orphan.take());
    true
}

/// The peer offers a message to READ: checks it against this side's bounds
/// and fetches it in a task, which delivers it and releases the region (at
/// once, or once the backlog allows: [`resume`]).
pub(crate) fn fetch(
    shared: &Rc<Shared>,
    imm: Option<u32>,
    token: MrToken,
) -> Result<(), CloseReason> {
    if token.len > shared.config.max_message_len as u64 {
        return Err(CloseReason::Violation("message longer than the maximum"));
    }
    if token.len == 0 || token.token_id & READ_ID == 0 {
        return Err(CloseReason::Violation(
            "read-me of an empty message or a foreign token id",
        ));
    }
    let reads = &shared.reads;
    if reads.fetching() + shared.partial.borrow().len() >= MAX_SPLIT_IN_PROGRESS {
        return Err(CloseReason::Violation(
            "more messages in pieces at once than the protocol allows",
        ));
    }
    reads.fetching.set(reads.fetching() + 1);
    reads.waiting.borrow_mut().push_back((imm, token));
    resume(shared);
    Ok(())
}

/// Starts the waiting fetches while the unread backlog is within its
/// limit: a fetch counts its message as unread from its start, so the
/// backlog exceeds the limit by one message at most (as it does by the
/// credits the peer held); the rest wait for the application to take its
/// messages ([`Shared::taken`] calls this).
pub(crate) fn resume(shared: &Rc<Shared>) {
    while shared.backlog.bytes() <= shared.backlog.limit() {
        let Some((imm, token)) = shared.reads.waiting.borrow_mut().pop_front() else {
            return;
        };
        shared.backlog.add(token.len);
        start(shared, imm, token);
    }
}

/// Fetches one offer in a task: READ, deliver, release.
fn start(shared: &Rc<Shared>, imm: Option<u32>, token: MrToken) {
    let s = shared.clone();
    spawn(
        async move {
            let delivered = read_message(&s, imm, &token).await;
            s.reads.fetching.set(s.reads.fetching().saturating_sub(1));
            if let Err(e) = delivered {
                tracing::debug!(error = %crate::error::ErrorChain(&e), "fetching a large message failed");
                return;
            }
            let release = Message::Release {
                token_id: token.token_id,
            };
            if let Err(e) = s.send_message(&release, true).await {
                tracing::debug!(error = %crate::error::ErrorChain(&e), "releasing a large message failed");
            }
        }
        .instrument(shared.span.clone()),
    );
}

/// READs the message `token` names into a registered vector (one kept
/// from an earlier message, else a new one) and delivers it (no further
/// copy: the vector is the message; the backlog counted it when the fetch
/// started).
async fn read_message(s: &Rc<Shared>, imm: Option<u32>, token: &MrToken) -> Result<(), AgentError> {
    // `token.len` is within `max_message_len` (a usize), checked by `fetch`.
    let len = token.len as usize;
    let mem = match s.reads.bufs.take(len) {
        Some(mem) => mem,
        None => RegisteredMem::register(&s.pd.0, Vec::with_capacity(len), AccessFlags::LOCAL_WRITE)
            .map_err(|r| AgentError::Buf {
                stage: "registering the memory of a large message",
                source: r.error,
            })?,
    };
    let remote = RemoteBuf::new(token.addr, token.len, token.rkey);
    let (r, mem) = s.qp.read(mem, remote).await;
    s.verb_result(r)?;
    s.rx.deliver(RecvMsg {
        body: Body::Read(ReadInto::new(mem, len, &s.reads.bufs)),
        imm,
    });
    Ok(())
}
