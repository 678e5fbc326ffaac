//! Packs: whole messages that would wait for a send credit share one SEND
//! ([`Message::Packed`](super::wire::Message::Packed), wire version 8).
//!
//! A message that fits one receive buffer goes on its own while more than
//! `Negotiated::backlog_at` credits are at hand (all but half the peer's
//! credit window, or all but `settings::BACKLOG_SPENT`: INLINE or from a
//! send buffer, see `rdma.rs`), or when no other `send` is in progress (a
//! ping-pong, one send at a time: a pack would hold it alone). With a
//! backlog (that many spent and other sends in progress, or a pack
//! waiting), it is appended to
//! the newest pack not yet posted (a pool buffer of the
//! peer's receive-buffer size), or starts one; a pack's poster task waits
//! for its turn (the packs before it posted; it runs after the task that
//! started the pack yields, so every message that task sends meanwhile
//! joins), takes one credit, writes the
//! credits owed to the peer into the header and posts the pack as one
//! SEND. Its messages' `send`s return once it is posted, as an INLINE
//! message's does (each was copied into it; the poster awaits its
//! completion, and a failed one takes the connection down with its error).
//! A pack of one message goes as the usual whole frame, INLINE if it fits,
//! else from the pack's buffer with its `send` done at the completion, as
//! it would have gone on its own after waiting. So a sender with a backlog spends one credit, one doorbell,
//! one device packet and one receive buffer at the peer per pack instead
//! of per message, and the receiver one completion and one repost
//! (`task::unpack` copies each message out and delivers them in order).
//!
//! While a pack waits, every later whole message joins a pack too (never
//! goes INLINE past it), so messages keep their order. A `send` dropped
//! while its pack fills takes its message out again (nothing of it is
//! sent, as for any send dropped before its post); once the poster has
//! sealed the pack (it has its credit and posts), the message goes.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

use tracing::Instrument;
use verbio_runtime::buf::LocalBuf;
use verbio_runtime::Handle;

use super::error::AgentError;
use super::rdma::{until_posted, PostedSend, Shared};
use crate::verbs::Verbs;

use super::wire::{
    packed_entry_len, put_packed_entry, put_packed_header, put_whole_header, whole_overhead,
    PACKED_HEADER_LEN,
};

/// How much longer a pack of one message is than its whole frame: the
/// pack's header and the entry's length word, against the whole frame's
/// header (the immediate, if any, is in both).
const WHOLE_SHIFT: usize = PACKED_HEADER_LEN + packed_entry_len(0, false) - whole_overhead(false);

/// Where a pack is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Taking messages.
    Filling,
    /// Its poster has the credit and posts it: its messages go.
    Sealed,
    /// Posted (a lone message's not INLINE: and complete): its messages'
    /// sends are done.
    Posted,
    /// Not posted: the connection is down.
    Failed,
}

/// One message in a pack.
#[derive(Debug)]
struct Member {
    id: u64,
    /// Its entry's bytes in the pack's buffer.
    start: usize,
    end: usize,
    /// Its immediate.
    imm: Option<u32>,
    waker: Option<Waker>,
}

/// Messages going out in one SEND.
#[derive(Debug)]
pub(crate) struct Pack {
    /// The frame: the header (written when sealed), then the entries.
    buf: RefCell<Option<LocalBuf>>,
    members: RefCell<Vec<Member>>,
    state: Cell<State>,
    /// The poster, waiting for the packs before this one to be posted.
    turn: RefCell<Option<Waker>>,
}

impl Pack {
    fn finish(&self, state: State) {
        self.state.set(state);
        let members = std::mem::take(&mut *self.members.borrow_mut());
        for m in members {
            if let Some(w) = m.waker {
                w.wake();
            }
        }
    }
}

/// A connection's packs not posted yet, oldest first.
#[derive(Debug, Default)]
pub(crate) struct Packer {
    queue: RefCell<VecDeque<Rc<Pack>>>,
    next_member: Cell<u64>,
    /// Packs posted (for tests and figures).
    posted: Cell<u64>,
    /// `send`s in progress (polled, not finished): more than one is a
    /// backlog worth packing; one alone never is.
    live: Cell<u32>,
    /// Whole messages on their own path, possibly waiting for a credit: a
    /// pack's poster lets them go first (they were sent before it).
    lone: Cell<u32>,
    /// The front pack's poster, waiting for `lone` to reach 0.
    lone_waiter: RefCell<Option<Waker>>,
}

/// Counts one `send` in progress while it lives ([`Packer::live`]).
pub(crate) struct Live<'a>(&'a Packer);

impl Drop for Live<'_> {
    fn drop(&mut self) {
        self.0.live.set(self.0.live.get().saturating_sub(1));
    }
}

/// Counts one whole message on its own path while it lives; the last one
/// out lets a waiting pack poster go.
pub(crate) struct Lone<'a>(&'a Packer);

impl Drop for Lone<'_> {
    fn drop(&mut self) {
        let n = self.0.lone.get().saturating_sub(1);
        self.0.lone.set(n);
        if n == 0 {
            if let Some(w) = self.0.lone_waiter.borrow_mut().take() {
                w.wake();
            }
        }
    }
}

impl Packer {
    /// True while a pack waits to be posted: a whole message must then
    /// join one rather than go past it.
    #[inline(always)]
    pub(crate) fn pending(&self) -> bool {
        !self.queue.borrow().is_empty()
    }

    /// Packs posted so far.
    pub(crate) fn posted(&self) -> u64 {
        self.posted.get()
    }

    /// A `send` in progress, until the guard is dropped.
    pub(crate) fn live(&self) -> Live<'_> {
        self.live.set(self.live.get().saturating_add(1));
        Live(self)
    }

    /// True if another `send` than the caller's is in progress (`own`:
    /// the caller's is counted already).
    #[inline(always)]
    pub(crate) fn others_live(&self, own: bool) -> bool {
        self.live.get() > u32::from(own)
    }

    /// A whole message on its own path, until the guard is dropped.
    pub(crate) fn lone(&self) -> Lone<'_> {
        self.lone.set(self.lone.get().saturating_add(1));
        Lone(self)
    }

    fn is_front(&self, pack: &Rc<Pack>) -> bool {
        self.queue
            .borrow()
            .front()
            .is_some_and(|p| Rc::ptr_eq(p, pack))
    }

    /// Takes `pack` (the front) off the queue and lets the next poster go.
    fn pop(&self, pack: &Rc<Pack>) {
        let next = {
            let mut q = self.queue.borrow_mut();
            if q.front().is_some_and(|p| Rc::ptr_eq(p, pack)) {
                q.pop_front();
            }
            q.front().cloned()
        };
        if let Some(w) = next.and_then(|p| p.turn.borrow_mut().take()) {
            w.wake();
        }
    }
}

/// `data` (with `imm`, a whole message) into a pack if one is waiting or
/// the sender has a backlog (half its credit window or more is spent, or
/// `settings::BACKLOG_SPENT` credits, and another `send` is in progress):
/// the future of its send. `None` if it should go on its own (more than
/// `Negotiated::backlog_at` credits at hand and no pack waits; or two such messages would
/// not fit one pack), or if no pack buffer could be had (the caller's
/// path then reports or waits).
///
/// Inlined up to the test that most messages too long to share a pack
/// end at (a call of the whole was about 50 instructions of a 4 KiB
/// message's send, docs/benchmarks.md).
#[inline(always)]
pub(crate) fn try_join(shared: &Rc<Shared>, data: &[u8], imm: Option<u32>) -> Option<PackedSend> {
    let entry = packed_entry_len(data.len(), imm.is_some());
    // The peer's receive buffers hold a `Data` piece of `piece_len` bytes
    // and its header: a pack may fill one.
    let frame_max = shared.negotiated.piece_len + super::wire::DATA_OVERHEAD;
    // A pack that cannot hold two such messages saves nothing, unless a
    // pack waits: the message then goes in a pack of its own behind it,
    // not past it (on its own path it would take the next credit first).
    if PACKED_HEADER_LEN + 2 * entry > frame_max && !shared.packer.pending() {
        return None;
    }
    join(shared, data, imm, entry, frame_max)
}

/// [`try_join`] past its first test: `entry` is the message's entry
/// length, `frame_max` the largest pack.
fn join(
    shared: &Rc<Shared>,
    data: &[u8],
    imm: Option<u32>,
    entry: usize,
    frame_max: usize,
) -> Option<PackedSend> {
    let packer = &shared.packer;
    let joinable = {
        let q = packer.queue.borrow();
        match q.back() {
            Some(p) if p.state.get() == State::Filling => {
                let fits = p
                    .buf
                    .borrow()
                    .as_ref()
                    .is_some_and(|b| b.len() + entry <= frame_max);
                fits.then(|| p.clone())
            }
            _ => None,
        }
    };
    let pack = match joinable {
        Some(p) => p,
        // More than `backlog_at` credits at hand: no backlog, on its own.
        None if !packer.pending()
            && shared.send_credits.available() > shared.negotiated.backlog_at =>
        {
            return None
        }
        None => start(shared, frame_max)?,
    };
    let id = packer.next_member.get();
    packer.next_member.set(id + 1);
    let mut buf = pack.buf.borrow_mut();
    let b = buf.as_mut()?;
    let start = b.len();
    b.set_len(start + entry).ok()?;
    let Some(end) = put_packed_entry(&mut b[..], start, imm, data) else {
        b.truncate(start);
        return None;
    };
    drop(buf);
    pack.members.borrow_mut().push(Member {
        id,
        start,
        end,
        imm,
        waker: None,
    });
    Some(PackedSend {
        shared: shared.clone(),
        pack,
        id,
        done: false,
    })
}

/// Starts a pack at the back of the queue, with its poster task; `None`
/// if no buffer or runtime is at hand.
fn start(shared: &Rc<Shared>, frame_max: usize) -> Option<Rc<Pack>> {
    let handle = Handle::try_current()?;
    let mut buf = shared.pool.alloc(frame_max).ok()?;
    buf.set_len(PACKED_HEADER_LEN).ok()?;
    let pack = Rc::new(Pack {
        buf: RefCell::new(Some(buf)),
        members: RefCell::new(Vec::new()),
        state: Cell::new(State::Filling),
        turn: RefCell::new(None),
    });
    shared.packer.queue.borrow_mut().push_back(pack.clone());
    let s = shared.clone();
    let p = pack.clone();
    handle.spawn(post(s, p).instrument(shared.span.clone()));
    Some(pack)
}

/// The poster of `pack`: waits for its turn and a credit, then sends it.
async fn post(shared: Rc<Shared>, pack: Rc<Pack>) {
    let s = &shared;
    poll_fn(|cx| {
        if s.packer.is_front(&pack) {
            Poll::Ready(())
        } else {
            *pack.turn.borrow_mut() = Some(cx.waker().clone());
            Poll::Pending
        }
    })
    .await;
    // Whole messages that went their own way before this pack started
    // (and may wait for a credit) go first.
    poll_fn(|cx| {
        if s.packer.lone.get() == 0 {
            Poll::Ready(())
        } else {
            *s.packer.lone_waiter.borrow_mut() = Some(cx.waker().clone());
            Poll::Pending
        }
    })
    .await;
    let credit = match s.send_credits.acquire().await {
        Ok(c) if pack.state.get() == State::Filling => c,
        _ => {
            pack.finish(State::Failed);
            s.packer.pop(&pack);
            return;
        }
    };
    pack.state.set(State::Sealed);
    let buf = pack.buf.borrow_mut().take();
    let Some(mut buf) = buf.filter(|_| !pack.members.borrow().is_empty()) else {
        // Every message was taken out again: nothing to send (the credit
        // goes back).
        drop(credit);
        pack.finish(State::Posted);
        s.packer.pop(&pack);
        return;
    };
    let posted = Cell::new(false);
    let ride = s.owed.take_all(&s.granted_credits, &posted);
    let alone = {
        let members = pack.members.borrow();
        (members.len() == 1).then(|| members[0].imm)
    };
    match alone {
        // One message: the usual whole frame, the same bytes as had it
        // gone on its own (its entry's header is 4 bytes longer).
        Some(imm) => {
            let len = buf.len();
            buf.copy_within(WHOLE_SHIFT..len, 0);
            buf.truncate(len - WHOLE_SHIFT);
            put_whole_header(&mut buf[..], imm, ride.count());
            if buf.len() <= s.inline_limit() {
                let res = s.qp.post_send_inline(&buf[..], None).await;
                if res.is_ok() {
                    posted.set(true);
                    credit.spend();
                }
                drop(ride);
                s.packer.pop(&pack);
                match res {
                    Ok(()) => {
                        s.packer.posted.set(s.packer.posted.get() + 1);
                        pack.finish(State::Posted);
                    }
                    Err(source) => {
                        let _ = s.verb_error(crate::Error::Submit { op: "send", source });
                        pack.finish(State::Failed);
                    }
                }
                return;
            }
        }
        None => {
            put_packed_header(&mut buf[..], ride.count());
        }
    }
    let res = until_posted(s.qp.send(buf), Some(credit), &posted).await;
    drop(ride);
    s.packer.pop(&pack);
    let sent = match res {
        Ok(sent) => Some(PostedSend::Frame(sent)),
        Err((Ok(_), _buf)) => None,
        Err((Err(e), _buf)) => {
            let _ = s.verb_error(e);
            pack.finish(State::Failed);
            return;
        }
    };
    s.packer.posted.set(s.packer.posted.get() + 1);
    // Several messages: their sends are done once posted, as an INLINE
    // message's is (each was copied; the SEND's completion is awaited
    // here, and a failed one takes the connection down with its error as
    // the reason, which later calls return). One message alone is done
    // with its completion, as it would have been on its own.
    if alone.is_none() {
        pack.finish(State::Posted);
    }
    let ok = match sent {
        Some(sent) => s.completed(sent).await.is_ok(),
        None => true,
    };
    if alone.is_some() {
        pack.finish(if ok { State::Posted } else { State::Failed });
    }
}

/// The future of a message's send in a pack: done once the pack is posted
/// (a pack of one not sent INLINE: once it has completed).
/// Dropped while the pack still fills, it takes its message out.
#[derive(Debug)]
pub(crate) struct PackedSend {
    shared: Rc<Shared>,
    pack: Rc<Pack>,
    id: u64,
    done: bool,
}

impl Future for PackedSend {
    type Output = Result<(), AgentError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.pack.state.get() {
            State::Posted => {
                self.done = true;
                Poll::Ready(Ok(()))
            }
            State::Failed => {
                self.done = true;
                Poll::Ready(Err(self.shared.closed_error()))
            }
            State::Filling | State::Sealed => {
                let id = self.id;
                let mut members = self.pack.members.borrow_mut();
                if let Some(m) = members.iter_mut().find(|m| m.id == id) {
                    match &m.waker {
                        Some(w) if w.will_wake(cx.waker()) => {}
                        _ => m.waker = Some(cx.waker().clone()),
                    }
                }
                Poll::Pending
            }
        }
    }
}

impl Drop for PackedSend {
    fn drop(&mut self) {
        if self.done || self.pack.state.get() != State::Filling {
            return;
        }
        // Still filling: the message comes out, later entries move down.
        let mut members = self.pack.members.borrow_mut();
        let Some(at) = members.iter().position(|m| m.id == self.id) else {
            return;
        };
        let gone = members.remove(at);
        let n = gone.end - gone.start;
        for m in members.iter_mut().skip(at) {
            m.start -= n;
            m.end -= n;
        }
        if let Some(b) = self.pack.buf.borrow_mut().as_mut() {
            let len = b.len();
            b.copy_within(gone.end..len, gone.start);
            b.truncate(len - n);
        }
    }
}
