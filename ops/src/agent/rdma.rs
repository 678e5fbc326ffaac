//! [`Rdma`]: a high-level connection. Messages travel as agent `Data`
//! frames over SEND/RECV, with credit-based flow control; the agent task
//! (see `task.rs`) owns the receive queue.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Poll, Waker};
use tracing::Instrument;

use futures::channel::oneshot;
use std::time::Duration;
use verbio_runtime::buf::{LocalBuf, MrPool};

use verbio_runtime::provider::{Mtu, WcStatus};
use verbio_runtime::{spawn, timeout, Device, Handle, JoinHandle, QueuePair, Submit, SubmitError};

use std::net::SocketAddr;

use super::backlog::Backlog;
use super::builder::{Config, RdmaBuilder};
use super::error::{AgentError, CloseReason};
use super::flow::{GrantedCredits, Owed, Permit, Permits, Piggyback};
use super::inbox::TaggedInbox;
use super::landing::{send_landed_from, Landing};
use super::msg::RecvMsg;
use super::packing::Packer;
use super::pieces::PiecesInFlight;
use super::qps::{ConnPd, ConnQp};
use super::read_msg::{send_buf_by_read, send_by_read, Reads, READ_MIN};
use super::receive::{Receive, ReceiveImm};
use super::receiving::Receiving;
use super::send_msg::SendMsg;
use super::settings::{exchange, negotiate, Negotiated};
use super::side::SideChannel;
use super::staged_now::StagedSend;
use super::staging::{send_staged, Staging};
use super::staging_budget::StagingBudget;
use super::tokens::GrantTable;
use super::window_grants::WindowGrants;
use super::wire::Settings;
use super::wire::{
    put_whole_header, whole_overhead, whole_send_imm, Message, MrToken, RefuseCode,
    MAX_SPLIT_IN_PROGRESS,
};
use crate::connect::{path_mtu, Connection};
use crate::verbs::send::SendVerb;
use crate::verbs::send_with_imm::SendWithImmVerb;
use crate::verbs::Verbs;

/// How long a closing connection lets its in-flight sends finish.
const DRAIN_LIMIT: Duration = Duration::from_secs(2);

/// How long a dropped connection tries to tell the peer with a `Close`.
const CLOSE_LIMIT: Duration = Duration::from_secs(1);

/// Largest encoded message sent INLINE (it is encoded into a buffer of
/// this size and posted from there): the most
/// [`RdmaBuilder::max_inline_data`] accepts.
pub(crate) const MAX_INLINE_MESSAGE: usize = 256;

/// A message being reassembled from `Data` pieces.
#[derive(Debug)]
pub(crate) struct Partial {
    pub(crate) total_len: u64,
    pub(crate) imm: Option<u32>,
    pub(crate) bytes: Vec<u8>,
}

/// State shared by the [`Rdma`] handle, its agent and its watcher.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) qp: QueuePair,
    /// The connection's own protection domain: its QP, receive pool and
    /// grants are all in it, so no other connection can reach them.
    pub(crate) pd: ConnPd,
    pub(crate) device: Device,
    pub(crate) path_mtu: Mtu,
    pub(crate) pool: MrPool,
    pub(crate) config: Rc<Config>,
    /// What the settings exchange with the peer decided.
    pub(crate) negotiated: Negotiated,
    /// The send credits: the peer's receive buffers this side may still
    /// fill, one per credit-bearing message.
    pub(crate) send_credits: Permits,
    pub(crate) owed: Owed,
    /// The credits the peer holds, as this side counts them.
    pub(crate) granted_credits: GrantedCredits,
    /// Delivered and not taken by the application.
    pub(crate) backlog: Backlog,
    failure: RefCell<Option<CloseReason>>,
    /// The receive side: posted receives and the inbox of user messages.
    pub(crate) rx: Receiving,
    /// Polls of the agent task's turn (see [`Rdma::agent_turns`]).
    pub(crate) agent_turns: Cell<u64>,
    /// Messages taken from the receive ring (the keepalive's sign of life).
    pub(crate) arrivals: Cell<u64>,
    /// Keepalive probes sent (see [`Rdma::keepalive_probes`]).
    pub(crate) keepalive_probes: Cell<u64>,
    /// Immediates of the peer's WRITE_WITH_IMMs (tag unused).
    pub(crate) write_imms: TaggedInbox<u32>,
    pub(crate) partial: RefCell<HashMap<u64, Partial>>,
    /// Permits for this side's messages in progress in pieces
    /// ([`MAX_SPLIT_IN_PROGRESS`]).
    pub(crate) split_permits: Permits,
    /// Large messages sent or received by RDMA READ (`read_msg.rs`).
    pub(crate) reads: Reads,
    /// Mid-size messages written into the peer's staging ring
    /// (`staging.rs`).
    pub(crate) staging: Staging,
    /// Mid-size messages written into the peer's landing slots, received
    /// without a copy (`landing.rs`).
    pub(crate) landing: Landing,
    /// Whole messages that wait for a credit, packed into shared SENDs
    /// (`packing.rs`).
    pub(crate) packer: Packer,
    next_msg_id: Cell<u64>,
    /// Where [`Shared::try_send_whole`] encodes a message to send INLINE.
    inline_buf: RefCell<[u8; MAX_INLINE_MESSAGE]>,
    pub(crate) grants: GrantTable,
    /// Grants through memory windows, with `RdmaBuilder::grant_windows`.
    pub(crate) window_grants: Option<WindowGrants>,
    pub(crate) requests: RefCell<HashMap<u64, oneshot::Sender<Result<MrToken, RefuseCode>>>>,
    pub(crate) next_req_id: Cell<u64>,
    /// Grants the peer handed over (`send_local_mr` there), by tag.
    pub(crate) remote_mrs: TaggedInbox<MrToken>,
    /// This side's memory the peer handed back (`send_remote_mr` there), by tag.
    pub(crate) local_mrs: TaggedInbox<Vec<u8>>,
    stream: RefCell<Option<SideChannel>>,
    watch_waker: RefCell<Option<Waker>>,
    /// The connection's messages when its QP is on the listener's shared
    /// receive queue (they end when it fails: no flush ends them).
    pub(crate) srq_route: Option<super::srq::SrqRoute>,
    /// Counted by the listener while the connection lives (see `qps.rs`).
    _seat: Option<super::qps::Seat>,
    /// The connection's span (peer address, local and remote QPN): the
    /// agent task, the watcher and every task spawned for the connection
    /// run in it.
    pub(crate) span: tracing::Span,
}

/// A connected QP and what the agent needs around it, before the
/// settings are negotiated.
pub(crate) struct Link {
    pub(crate) qp: QueuePair,
    pub(crate) pd: ConnPd,
    pub(crate) device: Device,
    pub(crate) config: Rc<Config>,
    pub(crate) path_mtu: Mtu,
    pub(crate) side: SideChannel,
    /// Its messages, when its QP is on a shared receive queue.
    pub(crate) route: Option<super::srq::SrqRoute>,
    /// Its place in its listener's count of connections with their own
    /// receive queue.
    pub(crate) seat: Option<super::qps::Seat>,
    pub(crate) span: tracing::Span,
}

impl Shared {
    /// True when the connection's protection domain is shared with other
    /// connections (its QP is on a listener's shared receive queue): the
    /// memory it exposes is then reached through windows its QP binds
    /// (`exposed.rs`).
    #[inline]
    pub(crate) fn shares_pd(&self) -> bool {
        self.srq_route.is_some()
    }

    /// The reason the connection is down, if it is.
    pub(crate) fn failure(&self) -> Option<CloseReason> {
        self.failure.borrow().clone()
    }

    /// True once the connection is down (see [`Shared::failure`]).
    #[inline]
    pub(crate) fn is_down(&self) -> bool {
        self.failure.borrow().is_some()
    }

    /// Marks the connection down (first reason wins): pending and later
    /// calls fail with `reason`, the TCP side channel closes (the peer sees
    /// it), and the QP is closed so posted receives flush. Runs on the runtime.
    ///
    /// `Disconnected` (inferred from a flush or the side channel's end)
    /// gives way to the error of an inline send of this side that failed
    /// for a reason of its own ([`Shared::inline_fault`]): no op awaited it.
    pub(crate) fn fail(&self, reason: CloseReason) {
        if self.failure.borrow().is_some() {
            return;
        }
        let reason = match reason {
            CloseReason::Disconnected => self.inline_fault().unwrap_or(reason),
            reason => reason,
        };
        let _in_span = self.span.enter();
        tracing::debug!(qp = self.qp.qp_num(), reason = %crate::error::ErrorChain(&reason), "agent connection down");
        *self.failure.borrow_mut() = Some(reason.clone());
        self.send_credits.close(reason);
        // The inboxes stay open until the agent stops (`agent_stopped`): it
        // still delivers what completed before the failure (a departing
        // peer's last messages, a hand-back among them: the grants are
        // revoked now, their memory kept for it); the QP's flush then ends it.
        self.requests.borrow_mut().clear();
        self.grants.clear();
        self.reads.clear();
        self.staging.close();
        self.landing.close();
        if let Some(route) = &self.srq_route {
            route.close();
        }
        if let Some(w) = &self.window_grants {
            w.clear();
        }
        let Some(handle) = Handle::try_current() else {
            // Runtime teardown: the QP goes with the last handle.
            self.drop_stream();
            return;
        };
        let qp = self.qp.clone();
        let stream = self.stream.borrow_mut().take();
        let waker = self.watch_waker.borrow_mut().take();
        handle.spawn(
            async move {
                // Sends already on the wire (a last `Error` notice included)
                // finish by the transport's rules (ACK or retry limit); then the
                // side channel closes and the flush ends the posted receives.
                let _ = timeout(DRAIN_LIMIT, qp.sends_idle()).await;
                drop(stream);
                if let Some(w) = waker {
                    w.wake();
                }
                if let Err(e) = qp.close().await {
                    tracing::debug!(error = %crate::error::ErrorChain(&e), "closing the agent QP");
                }
            }
            .instrument(self.span.clone()),
        );
    }

    /// The error of an inline send of this side that completed in error,
    /// as a connection reason, unless its status is one a vanished peer
    /// causes (a flush, retries or a timeout: `Disconnected` says that).
    fn inline_fault(&self) -> Option<CloseReason> {
        let e = self.qp.inline_send_error()?;
        match e {
            SubmitError::InlineSendFailed { status, .. } if is_specific(status) => {
                let e = crate::Error::Submit {
                    op: "send",
                    source: e,
                };
                Some(CloseReason::Transport(
                    crate::error::ErrorChain(&e).to_string(),
                ))
            }
            _ => None,
        }
    }

    /// The application took something of `charge` bytes from an inbox:
    /// credits withheld while the backlog was over its limit go back to the
    /// peer once it has fallen to half (by a task; in whole batches, the
    /// rest rides with the next data piece or the agent's next return).
    pub(crate) fn taken(self: &Rc<Self>, charge: u64) {
        let n = self.backlog.remove(charge);
        super::read_msg::resume(self);
        super::staging::release_held(self, false);
        if n == 0 {
            return;
        }
        self.owed.unsent(n);
        self.return_owed_batch("backlog taken: returning withheld credits");
    }

    /// If a whole batch of credits is owed, returns it to the peer in a
    /// `Credit` message (by a task): the agent only returns a batch when a
    /// repost completes it, which may not happen again while the peer
    /// waits for these very credits.
    pub(crate) fn return_owed_batch(self: &Rc<Self>, why: &'static str) {
        let Some(grant) = self.owed.take_batch() else {
            return;
        };
        let Some(handle) = Handle::try_current() else {
            self.owed.unsent(grant);
            return;
        };
        tracing::debug!(qp = self.qp.qp_num(), grant, "{why}");
        let s = self.clone();
        handle.spawn(async move { s.return_credits(grant).await }.instrument(self.span.clone()));
    }

    /// Posts a user message's `Data` piece (or whole message) like
    /// [`Shared::send_message`] (credited); the credits owed to the peer
    /// ride on it. If the piece is dropped or fails before it is posted,
    /// they are owed again, and a whole batch of them goes back in a
    /// `Credit` message. Returns once the piece's SEND is posted, with the
    /// SEND to await for its completion ([`Shared::completed`]; `None` if
    /// it went INLINE, done once posted). The pieces of a split message are
    /// posted back to back this way (see `pieces.rs`).
    pub(crate) async fn post_data(
        self: &Rc<Self>,
        msg: &Message<'_>,
    ) -> Result<Option<PostedSend>, AgentError> {
        let posted = Cell::new(false);
        let unposted = Unposted {
            shared: self,
            posted: &posted,
        };
        // A statement, not the tail expression: dropped here, the piece's
        // future goes before the guard.
        let res = self.post_message_noting(msg, true, &posted).await;
        drop(unposted);
        res
    }

    /// Waits for the completion of a SEND [`Shared::post_data`] posted.
    pub(crate) async fn completed(&self, sent: PostedSend) -> Result<(), AgentError> {
        let (res, _buf) = sent.await;
        match res {
            Ok(_) => Ok(()),
            Err(e) => Err(self.verb_error(e)),
        }
    }

    /// Sends `buf` (a whole message of one piece, not empty, too long for
    /// INLINE) from the caller's buffer itself, no copy: one SEND_WITH_IMM
    /// of its bytes, its header in the immediate ([`whole_send_imm`]),
    /// under a credit like [`Shared::post_data`]'s. `lone` (the message's
    /// place before any pack started after it) is let go once it is
    /// posted. Done at the SEND's completion, which gives the buffer back;
    /// cancelled once posted, the runtime frees the buffer at the
    /// completion.
    pub(crate) async fn send_whole_buf(
        self: &Rc<Self>,
        buf: LocalBuf,
        lone: super::packing::Lone<'_>,
    ) -> (Result<(), AgentError>, LocalBuf) {
        let posted = Cell::new(false);
        let unposted = Unposted {
            shared: self,
            posted: &posted,
        };
        // A credit at hand is taken without the waiting future (its
        // construction, poll and drop were about 70 instructions of a
        // 4 KiB message's send, docs/benchmarks.md); `try_acquire_in_turn`
        // takes one exactly when that future's first poll would.
        let credit = match self.send_credits.try_acquire_in_turn() {
            Some(credit) => credit,
            None => match self.send_credits.acquire_noting_wait().await {
                Ok((credit, _held_back)) => credit,
                Err(_) => return (Err(self.closed_error()), buf),
            },
        };
        let ride = self.owed.take_all(&self.granted_credits, &posted);
        let Some(imm) = whole_send_imm(ride.count()) else {
            // More credits owed than the immediate carries: in a frame.
            drop(ride);
            drop(credit);
            drop(unposted);
            // Boxed: rare, and its state inline would make every
            // `send_buf` future larger (see `Rdma::send_buf`).
            let r = Box::pin(async {
                let msg = Message::Whole {
                    imm: None,
                    grant: 0, // the credits owed then, filled in at posting
                    payload: &buf,
                };
                match self.post_data(&msg).await {
                    Ok(Some(sent)) => {
                        drop(lone);
                        self.completed(sent).await
                    }
                    Ok(None) => Ok(()),
                    Err(e) => Err(e),
                }
            })
            .await;
            return (r, buf);
        };
        let res = until_posted(self.qp.send_with_imm(buf, imm), Some(credit), &posted).await;
        drop(ride);
        drop(unposted);
        drop(lone);
        match res {
            Ok(sent) => {
                let (r, buf) = sent.await;
                (r.map(drop).map_err(|e| self.verb_error(e)), buf)
            }
            Err((Ok(_), buf)) => (Ok(()), buf),
            Err((Err(e), buf)) => (Err(self.verb_error(e)), buf),
        }
    }

    /// Posts a `Staged` message (`staging.rs`) with `credit`, the credits
    /// owed to the peer riding on it; `posted` is set once it is. Returns
    /// once it is posted (INLINE, the usual case) or, from a send buffer,
    /// once it has completed.
    pub(crate) async fn post_staged(
        &self,
        msg: &Message<'_>,
        credit: Permit<'_>,
        posted: &Cell<bool>,
    ) -> Result<(), AgentError> {
        match self.post_with(msg, Some(credit), posted, true).await? {
            Some(sent) => self.completed(sent).await,
            None => Ok(()),
        }
    }

    /// Sends the peer a `Credit` returning `grant` buffers, counted as the
    /// peer's from the moment it is posted. If it cannot be sent, they are
    /// owed again (a local failure such as an empty pool must not cost the
    /// peer its credits) and go out with the next batch.
    pub(crate) async fn return_credits(&self, grant: u32) {
        self.granted_credits.granted(grant);
        if let Err(e) = self.send_message(&Message::Credit { grant }, false).await {
            self.granted_credits.ungranted(grant);
            self.owed.unsent(grant);
            tracing::debug!(error = %crate::error::ErrorChain(&e), grant, "returning credits failed");
        }
    }

    /// The agent task ended: nothing more will be delivered, so pending and
    /// later receives fail (after what is queued) with the failure reason.
    pub(crate) fn agent_stopped(&self) {
        self.rx.close();
        self.write_imms.close();
        self.partial.borrow_mut().clear();
        self.remote_mrs.close();
        self.local_mrs.close();
        self.grants.forget_revoked();
        if let Some(w) = &self.window_grants {
            w.forget_revoked();
        }
    }

    fn drop_stream(&self) {
        self.stream.borrow_mut().take();
        if let Some(w) = self.watch_waker.borrow_mut().take() {
            w.wake();
        }
    }

    pub(crate) fn closed_error(&self) -> AgentError {
        AgentError::Closed(self.failure().unwrap_or(CloseReason::Local))
    }

    /// Encodes `msg` into a pool buffer and SENDs it, spending a credit
    /// first unless `credited` is false (control messages in the reserve).
    /// Cancel-safe: the credit is spent only once the SEND is posted (a
    /// posted SEND completes even if this future is dropped); dropped
    /// before that, the credit goes back.
    pub(crate) async fn send_message(
        &self,
        msg: &Message<'_>,
        credited: bool,
    ) -> Result<(), AgentError> {
        self.send_message_noting(msg, credited, &Cell::new(false))
            .await
    }

    /// [`Shared::send_message`] that sets `posted` once the SEND is posted
    /// (it then reaches the peer even if this future is dropped).
    pub(crate) async fn send_message_noting(
        &self,
        msg: &Message<'_>,
        credited: bool,
        posted: &Cell<bool>,
    ) -> Result<(), AgentError> {
        match self.post_message_noting(msg, credited, posted).await? {
            Some(sent) => self.completed(sent).await,
            None => Ok(()),
        }
    }

    /// [`Shared::send_message_noting`] up to the post: the SEND to await
    /// for its completion, `None` if it went INLINE.
    async fn post_message_noting(
        &self,
        msg: &Message<'_>,
        credited: bool,
        posted: &Cell<bool>,
    ) -> Result<Option<PostedSend>, AgentError> {
        let (credit, held_back) = if credited {
            // The connection's reason, which may have become more specific
            // than the one the credits were closed with.
            let (credit, held_back) = self
                .send_credits
                .acquire_noting_wait()
                .await
                .map_err(|_| self.closed_error())?;
            (Some(credit), held_back)
        } else if let Some(r) = self.failure() {
            return Err(r.into());
        } else {
            (None, false)
        };
        // A message the window held back with others goes with the others
        // the grant released: from a send buffer, its SEND in the poll
        // phase's deferred list and posted with theirs (one doorbell for
        // up to eight), not INLINE, which posts each at once on its own
        // (measured in docs/benchmarks.md, issue 35).
        self.post_with(msg, credit, posted, !held_back).await
    }

    /// Sends `msg` without credit or state checks (the last notice of a
    /// failing connection).
    pub(crate) async fn send_unchecked(&self, msg: &Message<'_>) -> Result<(), AgentError> {
        match self.post_with(msg, None, &Cell::new(false), true).await? {
            Some(sent) => self.completed(sent).await,
            None => Ok(()),
        }
    }

    /// Posts `msg`, spending `credit` and setting `posted` once its SEND is
    /// posted: INLINE from a stack copy when `inline` and it fits the QP's
    /// `max_inline_data` (see [`Shared::send_inline`]; `None`: done), else
    /// from a pool buffer, returned with the SEND to await.
    async fn post_with(
        &self,
        msg: &Message<'_>,
        credit: Option<Permit<'_>>,
        posted: &Cell<bool>,
        inline: bool,
    ) -> Result<Option<PostedSend>, AgentError> {
        let len = msg.encoded_len();
        if inline && len <= self.inline_limit() {
            return self
                .send_inline(msg, len, credit, posted)
                .await
                .map(|()| None);
        }
        let mut buf = self.pool.alloc(len).map_err(|source| AgentError::Buf {
            stage: "allocating a send buffer",
            source,
        })?;
        // Not zeroed first: the encoding below writes every byte.
        buf.set_len(len).map_err(|source| AgentError::Buf {
            stage: "sizing a send buffer",
            source,
        })?;
        let (msg, ride) = self.riding(msg, posted);
        if let Message::Whole {
            imm: None,
            grant,
            payload,
        } = msg
        {
            if let (Some(imm), false) = (whole_send_imm(grant), payload.is_empty()) {
                // No frame: the message's bytes, its header in the
                // immediate (one packet fewer at an MTU-sized message).
                buf.set_len(payload.len())
                    .map_err(|source| AgentError::Buf {
                        stage: "sizing a send buffer",
                        source,
                    })?;
                buf[..].copy_from_slice(payload);
                let res = until_posted(self.qp.send_with_imm(buf, imm), credit, posted).await;
                drop(ride);
                return match res {
                    Ok(sent) => Ok(Some(PostedSend::Whole(sent))),
                    Err((Ok(_), _buf)) => Ok(None),
                    Err((Err(e), _buf)) => Err(self.verb_error(e)),
                };
            }
        }
        // The buffer holds exactly `encoded_len` bytes: encoding cannot fail
        // for a message this side built; report it as a violation if it does.
        msg.encode(&mut buf[..])
            .map_err(|e| AgentError::Closed(CloseReason::Malformed(e)))?;
        let res = until_posted(self.qp.send(buf), credit, posted).await;
        drop(ride);
        match res {
            Ok(sent) => Ok(Some(PostedSend::Frame(sent))),
            Err((Ok(_), _buf)) => Ok(None),
            Err((Err(e), _buf)) => Err(self.verb_error(e)),
        }
    }

    /// Largest encoded message sent INLINE: the QP's `max_inline_data`,
    /// at most what the builder asked for (a device may round it up) and
    /// [`MAX_INLINE_MESSAGE`] (the size of the buffers a message is
    /// encoded in to be sent INLINE).
    #[inline(always)]
    pub(crate) fn inline_limit(&self) -> usize {
        (self.qp.caps().max_inline_data.min(self.config.max_inline) as usize)
            .min(MAX_INLINE_MESSAGE)
    }

    /// `msg` with the credits owed to the peer riding on it if it is a user
    /// message or piece not yet posted: taken with nothing left to await but the post
    /// itself, and owed again if it is dropped or fails before that (see
    /// `Piggyback`).
    fn riding<'a, 'm>(
        &'a self,
        msg: &Message<'m>,
        posted: &'a Cell<bool>,
    ) -> (Message<'m>, Option<Piggyback<'a>>) {
        match *msg {
            Message::Data {
                msg_id,
                total_len,
                offset,
                imm,
                payload,
                ..
            } if !posted.get() => {
                let ride = self.owed.take_all(&self.granted_credits, posted);
                let msg = Message::Data {
                    msg_id,
                    total_len,
                    offset,
                    imm,
                    grant: ride.count(),
                    payload,
                };
                (msg, Some(ride))
            }
            Message::Whole { imm, payload, .. } if !posted.get() => {
                let ride = self.owed.take_all(&self.granted_credits, posted);
                let msg = Message::Whole {
                    imm,
                    grant: ride.count(),
                    payload,
                };
                (msg, Some(ride))
            }
            Message::Staged {
                imm, offset, len, ..
            } if !posted.get() => {
                let ride = self.owed.take_all(&self.granted_credits, posted);
                let msg = Message::Staged {
                    imm,
                    grant: ride.count(),
                    offset,
                    len,
                };
                (msg, Some(ride))
            }
            msg => (msg, None),
        }
    }

    /// SENDs `msg` (`len` bytes encoded, within [`Shared::inline_limit`])
    /// INLINE, without an op: encoded on the stack, copied by the device at
    /// post time, done once posted (no completion to wait for; the QP
    /// signals one in several and retires the rest). `credit` is spent and
    /// `posted` set as the WR is posted. A WR that later completes in error
    /// is recorded by the QP, which goes to ERR: every later submission
    /// fails with it ([`Shared::verb_error`] makes it the connection's
    /// reason), and so does a failure the agent infers from the flush
    /// ([`Shared::fail`]).
    async fn send_inline(
        &self,
        msg: &Message<'_>,
        len: usize,
        credit: Option<Permit<'_>>,
        posted: &Cell<bool>,
    ) -> Result<(), AgentError> {
        let mut bytes = [0u8; MAX_INLINE_MESSAGE];
        let (msg, ride) = self.riding(msg, posted);
        // `len` is within the copy (`inline_limit`); encoding cannot fail
        // for a message this side built: reported as a violation if it does.
        let len = len.min(MAX_INLINE_MESSAGE);
        msg.encode(&mut bytes[..len])
            .map_err(|e| AgentError::Closed(CloseReason::Malformed(e)))?;
        let mut send = self.qp.post_send_inline(&bytes[..len], None);
        let mut credit = credit;
        let res = poll_fn(|cx| {
            let out = Pin::new(&mut send).poll(cx);
            if let Poll::Ready(Ok(())) = out {
                posted.set(true);
                if let Some(c) = credit.take() {
                    c.spend();
                }
            }
            out
        })
        .await;
        drop(ride);
        res.map_err(|source| self.verb_error(crate::Error::Submit { op: "send", source }))
    }

    /// A message of one piece, `data` with `imm`, sent INLINE at once,
    /// with no future, if the connection is up, it fits
    /// [`Shared::inline_limit`], more than `Negotiated::backlog_at` credits are left
    /// or no other send is in progress (else a backlog: it goes in a pack,
    /// `packing.rs`), no pack waits
    /// and the QP's queues have room. `None` if it would have to wait for
    /// any of that, or be split: nothing was taken or sent, and the awaited
    /// path ([`Shared::post_data`]) takes over, which also reports errors.
    #[inline(always)]
    pub(crate) fn try_send_whole(
        self: &Rc<Self>,
        data: &[u8],
        imm: Option<u32>,
    ) -> Option<Result<(), AgentError>> {
        let len = whole_overhead(imm.is_some()) + data.len();
        if data.len() > self.negotiated.piece_len
            || data.len() > self.negotiated.max_send_len
            || len > self.inline_limit()
        {
            return None;
        }
        self.try_send_fitting(data, imm)
    }

    /// [`Shared::try_send_whole`] of a message the caller checked fits one
    /// INLINE piece (no longer than a piece, than the peer takes, and its
    /// frame than the inline limit): `send_buf`'s usual message, not
    /// checked twice.
    #[inline(always)]
    pub(crate) fn try_send_fitting(
        self: &Rc<Self>,
        data: &[u8],
        imm: Option<u32>,
    ) -> Option<Result<(), AgentError>> {
        let len = whole_overhead(imm.is_some()) + data.len();
        if self.is_down()
            || self.packer.pending()
            || (self.send_credits.available() <= self.negotiated.backlog_at
                && self.packer.others_live(false))
        {
            return None;
        }
        // Encoded into the connection's buffer for it, not a fresh (zeroed)
        // one on the stack; in use only if this runs inside itself, which
        // nothing it calls does.
        let mut bytes = self.inline_buf.try_borrow_mut().ok()?;
        let credit = self.send_credits.try_acquire_in_turn()?;
        let posted = Cell::new(false);
        // The credits owed to the peer ride on the message (owed again if
        // it is not posted: `Piggyback`'s drop).
        let ride = self.owed.take_all(&self.granted_credits, &posted);
        let n = put_whole_header(&mut bytes[..], imm, ride.count())?;
        bytes.get_mut(n..len)?.copy_from_slice(data);
        let res = self.qp.try_post_send_inline(&bytes[..len], None);
        drop(bytes);
        // Each outcome built in place: the usual one is a tag, not a copy
        // of the whole (large) error type.
        match res? {
            Ok(()) => {
                posted.set(true);
                credit.spend();
                drop(ride);
                Some(Ok(()))
            }
            Err(source) => {
                drop(credit);
                drop(ride);
                let e = self.verb_error(crate::Error::Submit { op: "send", source });
                if !self.is_down() {
                    self.return_owed_batch(
                        "data piece not posted: returning the credits it carried",
                    );
                }
                Some(Err(e))
            }
        }
    }

    /// A verb on this side failed with `e`. A flush on a connection already
    /// down reports the reason it went down. Otherwise the QP is in ERR
    /// because of `e`: the connection goes down with it as the reason, and
    /// if it was already marked `Disconnected` (inferred from a flush of the
    /// receives or the side channel's end, either of which may race ahead of
    /// this completion) while `e` is the peer's refusal or a local error
    /// (not a retry or timeout a vanished peer causes), `e` replaces that as
    /// the more specific reason.
    ///
    /// An earlier inline send's failure ([`SubmitError::InlineSendFailed`],
    /// reported by every later submission) counts as that send's own
    /// completion error, unless its status is one a vanished peer causes
    /// (flushed, out of retries, timed out: not `is_specific`): then the
    /// peer left before acknowledging it, and the connection goes down as
    /// [`CloseReason::Disconnected`] (as [`Shared::fail`] has it), which is
    /// what this returns (or the reason it went down with before). Such a
    /// send may have been a best-effort one of the agent's own (a credit
    /// return the departing peer never acknowledged), and must not read as
    /// a verb of the application's that failed (`Rdma::close` after the
    /// peer left, `tests/agent_peer_left.rs`).
    pub(crate) fn verb_error(&self, e: crate::Error) -> AgentError {
        let (status, inline) = match &e {
            crate::Error::Submit {
                source: SubmitError::InlineSendFailed { status, .. },
                ..
            } => (Some(*status), true),
            _ => (e.status(), false),
        };
        let specific = status.is_some_and(is_specific);
        if inline && !specific {
            tracing::debug!(error = %crate::error::ErrorChain(&e), "an inline send went unacknowledged: the peer left");
            self.fail(CloseReason::Disconnected);
            return self.closed_error();
        }
        let current = self.failure();
        match current {
            Some(reason) if e.is_flush() => return AgentError::Closed(reason),
            None => self.fail(CloseReason::Transport(
                crate::error::ErrorChain(&e).to_string(),
            )),
            Some(CloseReason::Disconnected) if specific => {
                tracing::debug!(error = %crate::error::ErrorChain(&e), "connection down because of a local verb");
                *self.failure.borrow_mut() = Some(CloseReason::Transport(
                    crate::error::ErrorChain(&e).to_string(),
                ));
            }
            Some(_) => {}
        }
        AgentError::Verb(e)
    }

    /// Maps a verb's outcome: a failed completion leaves the QP in ERR, so
    /// the connection goes down; the caller gets the verb's own error.
    pub(crate) fn verb_result<T>(&self, r: Result<T, crate::Error>) -> Result<T, AgentError> {
        r.map_err(|e| self.verb_error(e))
    }

    /// Truncates an `Error` notice's text to what the peer's buffers hold.
    pub(crate) fn error_text<'t>(&self, text: &'t str) -> &'t str {
        let mut cut = text.len().min(self.negotiated.max_error_text);
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        &text[..cut]
    }

    fn next_msg_id(&self) -> u64 {
        let id = self.next_msg_id.get();
        self.next_msg_id.set(id + 1);
        id
    }
}

/// How [`Rdma::new_connection`] reaches the peer's listener again.
#[derive(Debug)]
pub(crate) enum Redial {
    /// [`RdmaBuilder::connect`]'s TCP handshake.
    Tcp(SocketAddr),
    /// [`RdmaBuilder::connect_cm`].
    Cm(SocketAddr),
}

/// A connection to one peer (names follow async-rdma). Create it with
/// [`RdmaBuilder`](super::RdmaBuilder). Single-threaded: share it between
/// tasks of its runtime with `Rc`; every method takes `&self`.
///
/// Dropping it closes the connection: the peer's pending calls fail with
/// [`CloseReason::Disconnected`].
///
/// # Example
///
/// Messages both ways, then memory the peer grants: this side WRITEs into
/// it and hands it back (both sides in one runtime here, on software
/// devices; across processes the server runs the `spawn`ed part).
///
/// ```
/// # mod verbio { pub use verbio_ops::*; pub mod ops { pub use verbio_ops::*; } pub mod runtime { pub use verbio_runtime::*; } pub use verbio_runtime::provider; }
/// use verbio::runtime::{spawn, Runtime};
/// use verbio::RdmaBuilder;
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let rt = Runtime::new()?;
/// rt.block_on(async {
///     let listener = RdmaBuilder::new().listen("127.0.0.1:0".parse()?)?;
///     let addr = listener.local_addr()?;
///     let server = spawn(async move {
///         let rdma = listener.accept().await?;
///         let question = rdma.receive().await?;
///         rdma.send(&question).await?;
///         rdma.receive().await // until the client is done
///     });
///     let rdma = RdmaBuilder::new().connect(addr).await?;
///     rdma.send(b"ping").await?;
///     assert_eq!(rdma.receive().await?, b"ping");
///
///     // 4 KiB of the server's memory, granted to this side.
///     let remote = rdma.request_remote_mr(4096).await?;
///     let mut local = rdma.alloc_local_mr(remote.len())?;
///     local.copy_from_slice(&[7; 4096]);
///     let (res, _local) = rdma.write(local, &remote).await;
///     res?;
///     rdma.send_remote_mr(remote).await?; // hand it back
///     rdma.send(b"done").await?;
///     assert_eq!(server.await?, b"done");
///     Ok::<_, Box<dyn std::error::Error>>(())
/// })?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct Rdma {
    pub(super) shared: Rc<Shared>,
    agent: Option<JoinHandle<()>>,
    watcher: Option<JoinHandle<()>>,
    /// How to reach the peer's listener again (connecting side only).
    redial: Option<(Box<RdmaBuilder>, Redial)>,
}

impl Rdma {
    /// Exchanges the agent settings with the peer over the connection's
    /// TCP side channel, then starts the agent and the disconnect watcher
    /// on the connected QP.
    pub(crate) async fn start(
        conn: Connection<ConnQp>,
        device: Device,
        config: Rc<Config>,
        mtu_cap: Option<Mtu>,
    ) -> Result<Rdma, AgentError> {
        let span = tracing::info_span!(
            "rdma",
            peer = %conn.peer_addr,
            local_qpn = conn.local.qpn,
            remote_qpn = conn.remote.qpn,
        );
        Rdma::start_in(conn, device, config, mtu_cap, span.clone())
            .instrument(span)
            .await
    }

    async fn start_in(
        conn: Connection<ConnQp>,
        device: Device,
        config: Rc<Config>,
        mtu_cap: Option<Mtu>,
        span: tracing::Span,
    ) -> Result<Rdma, AgentError> {
        let path_mtu = path_mtu(&conn.local, &conn.remote, mtu_cap);
        let ConnQp {
            qp,
            pd,
            route,
            seat,
        } = conn.qp;
        let mut stream = conn.stream;
        // On a shared receive queue the QP has no receive queue of its own:
        // it offers the depth its own would have.
        let max_recv_wr = match route {
            Some(_) => config.recv_queue_depth(),
            None => qp.caps().max_recv_wr,
        };
        let own = config.settings(max_recv_wr);
        let peer = exchange(&mut stream, &own, config.settings_timeout).await?;
        let link = Link {
            qp,
            pd,
            device,
            config,
            path_mtu,
            side: SideChannel::Tcp(stream),
            route,
            seat,
            span,
        };
        Rdma::assemble(link, &own, &peer)
    }

    /// A connection whose QP is connected and whose agent settings were
    /// exchanged (`own` sent, `peer` received): negotiates, posts the
    /// receives and starts the agent and the watcher.
    pub(crate) fn assemble(
        link: Link,
        own: &Settings,
        peer: &Settings,
    ) -> Result<Rdma, AgentError> {
        let Link {
            qp,
            pd,
            device,
            config,
            path_mtu,
            side: stream,
            route,
            seat,
            span,
        } = link;
        let (own, peer) = (*own, *peer);
        let negotiated = negotiate(&own, &peer).inspect_err(|e| {
            tracing::warn!(qp = qp.qp_num(), error = %crate::error::ErrorChain(e), "agent settings refused");
        })?;
        tracing::debug!(qp = qp.qp_num(), ?own, ?peer, ?negotiated, "agent settings");
        let pool = MrPool::new(&pd.0);
        let own_receives = route.is_none();
        let window_grants = config.grant_windows.map(WindowGrants::new);
        let budget = config
            .staging_budget
            .clone()
            .unwrap_or_else(StagingBudget::this_thread);
        let landing = Landing::new(config.staging_ring, budget.clone());
        let staging = Staging::new(config.staging_ring, budget);
        let shared = Rc::new(Shared {
            qp,
            pd,
            device,
            path_mtu,
            pool,
            send_credits: Permits::new(0), // the peer's first `Credit` tells
            owed: Owed::new(config.credit_batch),
            granted_credits: GrantedCredits::default(),
            backlog: Backlog::new(config.max_unread_bytes),
            reads: Reads::new(config.max_unread_bytes),
            config,
            negotiated,
            failure: RefCell::new(None),
            rx: Receiving::new(own_receives),
            agent_turns: Cell::new(0),
            arrivals: Cell::new(0),
            keepalive_probes: Cell::new(0),
            write_imms: TaggedInbox::new(),
            partial: RefCell::new(HashMap::new()),
            split_permits: Permits::new(MAX_SPLIT_IN_PROGRESS as u32),
            packer: Packer::default(),
            staging,
            landing,
            next_msg_id: Cell::new(0),
            inline_buf: RefCell::new([0; MAX_INLINE_MESSAGE]),
            grants: GrantTable::default(),
            window_grants,
            requests: RefCell::new(HashMap::new()),
            next_req_id: Cell::new(0),
            remote_mrs: TaggedInbox::new(),
            local_mrs: TaggedInbox::new(),
            stream: RefCell::new(Some(stream)),
            watch_waker: RefCell::new(None),
            srq_route: route,
            _seat: seat,
            span,
        });
        let route = super::task::post_receives(&shared)?;
        if own_receives {
            shared.rx.use_check(Rc::downgrade(&shared));
        }
        let agent = spawn(super::task::run(shared.clone(), route).instrument(shared.span.clone()));
        let watcher = spawn(watch(Rc::downgrade(&shared)).instrument(shared.span.clone()));
        if let Some(every) = shared.config.keepalive {
            // Ends by itself once the connection is down or dropped.
            let _detached = spawn(
                super::keepalive::run(Rc::downgrade(&shared), every)
                    .instrument(shared.span.clone()),
            );
        }
        Ok(Rdma {
            shared,
            agent: Some(agent),
            watcher: Some(watcher),
            redial: None,
        })
    }

    pub(crate) fn set_redial(&mut self, builder: RdmaBuilder, to: Redial) {
        self.redial = Some((Box::new(builder), to));
    }

    /// A second connection to the same peer (same settings and device),
    /// made the way this one was ([`RdmaBuilder::connect`] or
    /// [`RdmaBuilder::connect_cm`]); only the side that connected knows
    /// the peer's listener.
    pub async fn new_connection(&self) -> Result<Rdma, AgentError> {
        match &self.redial {
            Some((builder, Redial::Tcp(addr))) => builder.connect(*addr).await,
            Some((builder, Redial::Cm(addr))) => builder.connect_cm(*addr).await,
            None => Err(AgentError::Config {
                setting: "new_connection",
                reason: "only the side that connected (connect, connect_cm) knows the peer's \
                         listener; not available on listening sides",
            }),
        }
    }

    /// The reason the connection is down, `None` while it works.
    pub fn close_reason(&self) -> Option<CloseReason> {
        self.shared.failure()
    }

    /// Bytes the peer delivered that the application has not taken yet
    /// (see [`RdmaBuilder::max_unread_bytes`](super::RdmaBuilder::max_unread_bytes)).
    pub fn unread_bytes(&self) -> u64 {
        self.shared.backlog.bytes()
    }

    /// Send credits withheld from the peer because the unread backlog is
    /// over its limit (the peer's senders wait for them).
    pub fn withheld_credits(&self) -> u32 {
        self.shared.backlog.withheld()
    }

    /// The connection's tracing span (`rdma`, with the peer address and
    /// the local and remote QPN): its agent task runs in it; enter it to
    /// tie the application's own events to the connection.
    pub fn span(&self) -> &tracing::Span {
        &self.shared.span
    }

    /// The path MTU the QP was connected with.
    pub fn path_mtu(&self) -> Mtu {
        self.shared.path_mtu
    }

    /// The device the connection runs on.
    pub fn device(&self) -> &Device {
        &self.shared.device
    }

    /// The connection's queue pair (for verbs beyond this API). It is in
    /// the connection's own protection domain: buffers posted on it must
    /// come from [`Rdma::pool`], not from the device's pool. A
    /// WRITE_WITH_IMM posted on it directly must not carry an immediate
    /// whose top byte is `0xff`: the peer's agent takes those for messages
    /// written into its staging ring ([`Rdma::write_with_imm`] sends such
    /// an immediate another way).
    pub fn qp(&self) -> &QueuePair {
        &self.shared.qp
    }

    /// The registered-buffer pool of the connection's protection domain
    /// (local buffers for verbs posted on [`Rdma::qp`]).
    pub fn pool(&self) -> &MrPool {
        &self.shared.pool
    }

    /// True if the connection's QP is on its listener's shared receive
    /// queue (see
    /// [`RdmaBuilder::shared_receive_queue_above`](super::RdmaBuilder::shared_receive_queue_above)):
    /// it shares the device's protection domain, and the memory it lets its
    /// peer reach is reached through memory windows its QP binds.
    pub fn on_shared_receive_queue(&self) -> bool {
        self.shared.shares_pd()
    }

    /// Test hook: every piece of memory this side lets its peer reach
    /// (`"grant"`, `"staging ring"`, `"read offer"`, `"landing slot"`: those
    /// granted now, the token's id the slot's number), each with the token
    /// naming it as the peer sees it and the rkey of the registration
    /// beneath (the token's own for a registered region; the region's,
    /// which reaches nothing remotely, under a window). Not for production
    /// use.
    #[doc(hidden)]
    pub fn exposed_memory_unchecked(&self) -> Vec<(&'static str, MrToken, u32)> {
        let s = &self.shared;
        let grants = s.grants.keys().into_iter().map(|(t, k)| ("grant", t, k));
        let ring = s.staging.keys().map(|(t, k)| ("staging ring", t, k));
        let reads = s
            .reads
            .keys()
            .into_iter()
            .map(|(t, k)| ("read offer", t, k));
        let slots = s
            .landing
            .keys()
            .into_iter()
            .map(|(t, k)| ("landing slot", t, k));
        grants.chain(ring).chain(reads).chain(slots).collect()
    }

    /// Landing slots the peer granted this side and it has not written a
    /// message into yet (a diagnostic): a message of 512 KiB or more
    /// without an immediate goes into one by one RDMA WRITE, and the peer
    /// receives it without a copy ([`RecvMsg::is_landed`]); with none
    /// granted it goes through the staging ring.
    pub fn landing_slots(&self) -> usize {
        self.shared.landing.granted()
    }

    /// Keepalive probes this side sent: one per
    /// [`RdmaBuilder::keepalive`](super::RdmaBuilder::keepalive) interval
    /// in which nothing arrived (a diagnostic; a busy connection sends
    /// none).
    pub fn keepalive_probes(&self) -> u64 {
        self.shared.keepalive_probes.get()
    }

    /// How often the connection's agent task has run its turn (a
    /// diagnostic). A task awaiting `receive_msg` takes its message itself,
    /// and credits ride on its replies, so in a request-reply exchange the
    /// agent stays asleep: this grows only with control work (credits no
    /// reply took, grants, messages no receiver was waiting for).
    pub fn agent_turns(&self) -> u64 {
        self.shared.agent_turns.get()
    }

    /// How many packs this side has sent (a diagnostic): SENDs that each
    /// carried several whole messages which had waited for a send credit
    /// together (or one that waited alone).
    pub fn packs_sent(&self) -> u64 {
        self.shared.packer.posted()
    }

    /// Send credits left (messages this side may send before waiting).
    pub fn send_credits(&self) -> u32 {
        self.shared.send_credits.available()
    }

    /// Longest message this side sends by one RDMA WRITE into the peer's
    /// staging ring ([`RdmaBuilder::staging_ring`](super::RdmaBuilder::staging_ring)):
    /// 0 until the peer has announced a ring, or when it has none (it
    /// has none, or its [`StagingBudget`] was spent); mid-size messages
    /// then go in pieces or by READ.
    pub fn staged_max_len(&self) -> usize {
        self.shared.staging.max_len()
    }

    /// How far into the peer's staging ring this side's staged messages
    /// have reached (a diagnostic: the furthest end of one, in bytes from
    /// the ring's start). A sender whose every message was returned starts
    /// the next at the ring's start, so staged messages answering each
    /// other keep to the first bytes of the ring, which stay in the caches.
    pub fn staged_ring_reach(&self) -> usize {
        self.shared.staging.reach()
    }

    /// Messages of which some pieces arrived and the rest are still due
    /// (the peer's `send` of a large message in progress). A sender whose
    /// `send` is cancelled tells this side to discard its pieces.
    pub fn incomplete_messages(&self) -> usize {
        self.shared.partial.borrow().len()
    }

    /// Largest message [`Rdma::send`] accepts: the smaller of this side's
    /// and the peer's `max_message_len`.
    pub fn max_send_len(&self) -> usize {
        self.shared.negotiated.max_send_len
    }

    /// The largest message (with or without an immediate) that goes in
    /// one piece INLINE when credits are at hand: its `send` is done once
    /// posted, without awaiting a completion. 0 if the QP sends nothing
    /// INLINE.
    pub(crate) fn inline_send_max(&self) -> usize {
        let s = &self.shared;
        s.inline_limit()
            .saturating_sub(super::wire::whole_overhead(true))
            .min(s.negotiated.piece_len)
            .min(s.negotiated.max_send_len)
    }

    /// Sends `data` as one message (split into pieces if it is larger than
    /// the peer's receive buffers; up to a quarter of the peer's staging
    /// ring, [`RdmaBuilder::staging_ring`], written into that ring by one
    /// RDMA WRITE once the peer has announced it; from 32 KiB and beyond the
    /// ring, copied into memory the peer fetches with one RDMA READ, and
    /// done once the peer has read it).
    /// Waits for credits when the peer's buffers are full. Cancel-safe:
    /// dropped before its last piece was posted, the peer is told to
    /// discard the pieces it received; a message the peer reads is
    /// delivered once its offer was posted (the copy stays registered until
    /// the peer releases it).
    ///
    /// A piece (a small message is one) that fits
    /// [`RdmaBuilder::max_inline_data`] with its header goes INLINE: done
    /// once posted, its completion not awaited; should it fail later, the
    /// connection goes down with that error as its reason, which later
    /// calls return ([`Rdma::close`] waits for it). A larger piece is done
    /// once its SEND has completed. Either way, a message whose `send`
    /// returned reaches the peer even if this side drops the `Rdma` (its
    /// `Close` is ordered after it) or the whole runtime right after (the
    /// runtime lets posted sends through before closing its QPs).
    #[inline(always)]
    pub fn send<'a>(&'a self, data: &'a [u8]) -> impl Future<Output = Result<(), AgentError>> + 'a {
        SendMsg::new(&self.shared, data, None, self.send_inner(data, None))
    }

    /// Sends `data` with a 32-bit immediate, received by [`Rdma::receive_with_imm`].
    #[inline]
    pub fn send_with_imm<'a>(
        &'a self,
        data: &'a [u8],
        imm: u32,
    ) -> impl Future<Output = Result<(), AgentError>> + 'a {
        SendMsg::new(
            &self.shared,
            data,
            Some(imm),
            self.send_inner(data, Some(imm)),
        )
    }

    /// Sends a registered buffer's bytes; the buffer is given back. A
    /// message that goes through the peer's staging ring (longer than one
    /// receive buffer, at most [`Rdma::staged_max_len`]) is written from
    /// this buffer itself, not copied (the WRITE owns it until it
    /// completes; cancelled once posted, the buffer is freed then); a
    /// larger one (from 32 KiB) is read by the peer from this buffer
    /// itself, registered once more for remote READ of exactly its
    /// message bytes until the peer has read it (cancelled once offered,
    /// the buffer stays registered until then and is freed after); one
    /// that fits a receive buffer but not INLINE, in a buffer of
    /// [`Rdma::pool`], is sent from this buffer itself too, one SEND_WITH_IMM of its bytes (done at its
    /// completion; cancelled once posted, the buffer is freed then)
    /// unless it joins a pack of small messages waiting for a credit;
    /// others go as [`Rdma::send`] sends them.
    pub async fn send_buf(&self, buf: LocalBuf) -> (Result<(), AgentError>, LocalBuf) {
        let s = &self.shared;
        let len = buf.len();
        // The general staged, landing and READ paths' states are boxed
        // (an allocation per message longer than a piece): inline, they
        // made every `send_buf` future, a whole message's too, about
        // 2 KiB, which each move (a `FuturesUnordered` of sends boxes it)
        // copies. A staged message that need not wait (for more than a
        // credit) is submitted before its small future exists instead
        // (`StagedNow`).
        if len > s.negotiated.piece_len && len <= s.negotiated.max_send_len {
            if let Some(slot) = s.landing.take(len) {
                return Box::pin(send_landed_from(s, buf, slot)).await;
            }
            if len <= s.staging.max_len() {
                // Posted in the first poll when nothing (or only a
                // credit) has to be waited for, unboxed; else the general
                // (boxed) path.
                return StagedSend::new(s, buf).await;
            }
            if len >= READ_MIN {
                return Box::pin(send_buf_by_read(s, buf, None)).await;
            }
        }
        if len > 0 && len <= s.negotiated.piece_len && len <= s.negotiated.max_send_len {
            let inline = whole_overhead(false) + len <= s.inline_limit();
            if inline || (s.pool.owns(&buf) && !s.is_down()) {
                // One piece, in `send_inner`'s order of things (this send
                // counted as in progress first): INLINE at once if it can
                // go; else into a pack if one waits or a backlog makes
                // one; else, not INLINE and from the connection's pool
                // (its key valid on the QP), from this buffer itself.
                let _live = s.packer.live();
                if inline {
                    // Checked above: one piece, within the inline limit.
                    // Each outcome built in place: the usual one a tag and
                    // the buffer, not a copy of the whole (large) error
                    // type's room.
                    match s.try_send_fitting(&buf, None) {
                        Some(Ok(())) => return (Ok(()), buf),
                        Some(Err(e)) => return (Err(e), buf),
                        None => {}
                    }
                }
                if let Some(packed) = super::packing::try_join(s, &buf, None) {
                    return (packed.await, buf);
                }
                if !inline {
                    let lone = s.packer.lone();
                    return s.send_whole_buf(buf, lone).await;
                }
            }
        }
        // Boxed (an allocation for a message none of the above took: of
        // another pool, waiting for a credit alone, split, or failing):
        // inline, `send_inner`'s state (its general path's) made every
        // `send_buf` future about 1 KiB, which each move copies (a window
        // of sends in a `FuturesUnordered` moves each one into its box).
        let r = Box::pin(self.send_inner(&buf, None)).await;
        (r, buf)
    }

    async fn send_inner(&self, data: &[u8], imm: Option<u32>) -> Result<(), AgentError> {
        let s = &self.shared;
        let _live = s.packer.live();
        let max = s.negotiated.max_send_len;
        if data.len() > max {
            return Err(AgentError::MessageTooLarge {
                len: data.len(),
                max,
            });
        }
        if data.len() > s.negotiated.piece_len {
            // Boxed (an allocation per message longer than a piece): the
            // state of the staged, READ and split paths, inline, made
            // every send future about 2 KiB, which each move copies.
            return Box::pin(send_split(s, data, imm)).await;
        }
        if let Some(r) = s.try_send_whole(data, imm) {
            return r;
        }
        // No credit at hand, or messages before it wait in a pack:
        // it joins them.
        if let Some(packed) = super::packing::try_join(s, data, imm) {
            return packed.await;
        }
        let msg = Message::Whole {
            imm,
            grant: 0, // the credits owed then, filled in at posting
            payload: data,
        };
        // Posted before any pack started after it (`packing::post`
        // waits for the post).
        let lone = s.packer.lone();
        match s.post_data(&msg).await? {
            Some(sent) => {
                drop(lone);
                s.completed(sent).await
            }
            None => Ok(()),
        }
    }

    /// The next message (in arrival order of its last piece).
    pub async fn receive(&self) -> Result<Vec<u8>, AgentError> {
        Ok(self.receive_with_imm().await?.0)
    }

    /// The next message with its immediate (`None` if sent without one).
    pub async fn receive_with_imm(&self) -> Result<(Vec<u8>, Option<u32>), AgentError> {
        let m = self.receive_msg().await?;
        let imm = m.imm();
        Ok((m.into_vec(), imm))
    }

    /// The next message without copying when it fit in one receive buffer:
    /// lent in the slot of the connection's receive ring it landed in,
    /// which is reposted when the message is dropped (while half of the
    /// connection's `recv_buf_count` messages are lent, later ones are
    /// copied out instead; see [`RecvMsg::is_zero_copy`]). A message the
    /// peer wrote into the staging ring is lent from there, its ring bytes
    /// given back to the peer when it is dropped, and copied only when
    /// read (see [`RecvMsg::is_lent_from_ring`]). Cancel-safe: a
    /// message is only taken by the poll that returns it.
    #[inline(always)]
    pub fn receive_msg(&self) -> impl Future<Output = Result<RecvMsg, AgentError>> + '_ {
        Receive::new(&self.shared)
    }

    /// The next message copied into a registered buffer of the
    /// connection's pool: one copy, from where the message lies (its
    /// receive buffer, the staging ring, a landing slot) straight into the
    /// buffer.
    pub async fn receive_buf(&self) -> Result<LocalBuf, AgentError> {
        let m = self.receive_msg().await?;
        let len = m.len();
        let err = |source| AgentError::Buf {
            stage: "allocating the receive buffer",
            source,
        };
        let mut buf = self.shared.pool.alloc(len).map_err(err)?;
        // (A pool buffer's bytes are all initialized: `set_len` exposes
        // only what `copy_to` then overwrites.)
        buf.set_len(len).map_err(err)?;
        let n = m.copy_to(0, &mut buf);
        buf.truncate(n);
        Ok(buf)
    }

    /// The immediate of the peer's next `write_with_imm`.
    pub async fn receive_write_imm(&self) -> Result<u32, AgentError> {
        ReceiveImm::new(&self.shared).await
    }

    /// Closes the connection: tells the peer, then stops the agent.
    pub async fn close(self) -> Result<(), AgentError> {
        self.shutdown().await
    }

    /// [`Rdma::close`] through a shared reference (the connection is in an
    /// `Rc`, a [`MessageSink`](super::MessageSink) closes it): tells the
    /// peer, whose calls then fail with [`CloseReason::Disconnected`], and
    /// stops the agent; later calls here fail with [`CloseReason::Local`].
    /// A connection already down returns its reason. Small messages go
    /// INLINE and [`Rdma::send`] returns once they are posted: this waits
    /// (up to two seconds) for every send posted before it, the `Close`
    /// last, to complete, and returns an error if one of them failed
    /// (if the peer left without acknowledging one, which may have been
    /// a credit return of the agent's own, [`CloseReason::Disconnected`],
    /// as when this side saw the peer leave first).
    pub async fn shutdown(&self) -> Result<(), AgentError> {
        let s = &self.shared;
        let mut r = s.send_message(&Message::Close, false).await;
        if r.is_ok() {
            let _ = timeout(DRAIN_LIMIT, s.qp.sends_idle()).await;
            if let Some(source) = s.qp.inline_send_error() {
                r = Err(s.verb_error(crate::Error::Submit { op: "send", source }));
            }
        }
        s.fail(CloseReason::Local);
        r
    }
}

impl Drop for Rdma {
    fn drop(&mut self) {
        // No await here: on a runtime, a task sends `Close` (ordered after
        // every message sent before) and then closes; otherwise the TCP
        // side channel is dropped (the peer's watcher sees EOF). The agent
        // is cancelled; its receive ring keeps its memory until the QP's flush.
        match Handle::try_current() {
            Some(h) if !self.shared.is_down() => {
                let shared = self.shared.clone();
                h.spawn(
                    async move {
                        let _ =
                            timeout(CLOSE_LIMIT, shared.send_message(&Message::Close, false)).await;
                        shared.fail(CloseReason::Local);
                    }
                    .instrument(self.shared.span.clone()),
                );
            }
            _ => self.shared.drop_stream(),
        }
        if let Some(a) = self.agent.take() {
            a.abort();
        }
        if let Some(w) = self.watcher.take() {
            w.abort();
        }
    }
}

/// True for a completion status that says why a work request failed,
/// false for those a vanished peer causes (a flush, retries, a timeout).
fn is_specific(status: WcStatus) -> bool {
    !matches!(
        status,
        WcStatus::WrFlushErr
            | WcStatus::RetryExcErr
            | WcStatus::RnrRetryExcErr
            | WcStatus::RespTimeoutErr
    )
}

/// Polls a submission to its end, spending `credit` and setting `posted`
/// once it is posted (dropped unposted, the credit goes back to the pool).
pub(crate) async fn posted_spends<T: verbio_runtime::Completable>(
    mut sub: Submit<T>,
    credit: Option<Permit<'_>>,
    posted: &Cell<bool>,
) -> T::Output {
    let mut credit = credit;
    poll_fn(|cx| {
        let out = Pin::new(&mut sub).poll(cx);
        if sub.wr_id().is_some() {
            posted.set(true);
            if let Some(c) = credit.take() {
                c.spend();
            }
        }
        out
    })
    .await
}

/// Returns a batch of credits owed again once a user message's future is
/// gone unposted (dropped after it, so the credits that would have ridden
/// on it are owed by then).
struct Unposted<'a> {
    shared: &'a Rc<Shared>,
    posted: &'a Cell<bool>,
}

impl Drop for Unposted<'_> {
    fn drop(&mut self) {
        if !self.posted.get() && !self.shared.is_down() {
            self.shared
                .return_owed_batch("data piece not posted: returning the credits it carried");
        }
    }
}

/// An agent SEND posted from a pool buffer, its completion not yet
/// awaited (awaiting it gives the buffer back): a frame, or a whole
/// message without its frame, its header in the immediate
/// ([`whole_send_imm`]).
pub(crate) enum PostedSend {
    /// A SEND of a frame.
    Frame(Submit<SendVerb<LocalBuf>>),
    /// A SEND_WITH_IMM of a whole message's bytes.
    Whole(Submit<SendWithImmVerb<LocalBuf>>),
}

impl Future for PostedSend {
    type Output = verbio_runtime::buf::BufResult<usize, LocalBuf, crate::Error>;
    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<Self::Output> {
        match self.get_mut() {
            PostedSend::Frame(s) => Pin::new(s).poll(cx),
            PostedSend::Whole(s) => Pin::new(s).poll(cx),
        }
    }
}

/// Polls a submission until it is posted, spending `credit` and setting
/// `posted` then: `Ok` with the submission to await for its completion,
/// or `Err` with its output if it ended without being left in flight
/// (refused, or already complete). Dropped unposted, the credit goes back
/// to the pool.
pub(crate) async fn until_posted<T: verbio_runtime::Completable>(
    mut sub: Submit<T>,
    credit: Option<Permit<'_>>,
    posted: &Cell<bool>,
) -> Result<Submit<T>, T::Output> {
    let mut credit = credit;
    let ended = poll_fn(|cx| {
        let out = Pin::new(&mut sub).poll(cx);
        let in_flight = sub.wr_id().is_some();
        if in_flight {
            posted.set(true);
            if let Some(c) = credit.take() {
                c.spend();
            }
        }
        match out {
            Poll::Ready(out) => Poll::Ready(Some(out)),
            Poll::Pending if in_flight => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    })
    .await;
    match ended {
        Some(out) => Err(out),
        None => Ok(sub),
    }
}

/// Sends an `Abort` for a message whose `send` was dropped mid-way.
#[derive(Debug)]
struct AbortOnDrop {
    shared: Rc<Shared>,
    msg_id: u64,
    /// False once the message was sent whole or the connection failed.
    armed: bool,
}

impl Drop for AbortOnDrop {
    /// Frees the message's reassembly slot at the peer: at once if the
    /// message went out whole or the connection failed, else once the
    /// `Abort` is posted.
    fn drop(&mut self) {
        let permits = &self.shared.split_permits;
        if !self.armed || self.shared.is_down() {
            permits.grant(1);
            return;
        }
        let Some(h) = Handle::try_current() else {
            permits.grant(1);
            return; // runtime teardown: the connection goes with it
        };
        let shared = self.shared.clone();
        let msg_id = self.msg_id;
        tracing::debug!(
            msg_id,
            "send cancelled mid-message: aborting it at the peer"
        );
        h.spawn(async move {
            if let Err(e) = shared.send_message(&Message::Abort { msg_id }, true).await {
                tracing::debug!(error = %crate::error::ErrorChain(&e), msg_id, "sending an abort failed");
            }
            shared.split_permits.grant(1);
        }.instrument(self.shared.span.clone()));
    }
}

/// Waits for EOF (or an error) on the connection's TCP stream, the sign that
/// the peer is gone, and marks the connection down.
async fn watch(shared: std::rc::Weak<Shared>) {
    let gone = poll_fn(|cx| {
        let Some(s) = shared.upgrade() else {
            return Poll::Ready(false);
        };
        let mut stream = s.stream.borrow_mut();
        let Some(st) = stream.as_mut() else {
            return Poll::Ready(false); // closed by this side
        };
        *s.watch_waker.borrow_mut() = Some(cx.waker().clone());
        st.poll_gone(cx).map(|()| true)
    })
    .await;
    if gone {
        // The peer's last messages may still sit in the CQ behind this EOF
        // (the two arrive on different fds); they are not lost: the agent keeps
        // delivering until the QP's flush ends it (`Shared::agent_stopped`).
        if let Some(s) = shared.upgrade() {
            s.fail(CloseReason::Disconnected);
        }
    }
}

/// Sends `data` (longer than a piece, at most `max_send_len`) with `imm`:
/// through the peer's staging ring, by READ, or in pieces.
async fn send_split(s: &Rc<Shared>, data: &[u8], imm: Option<u32>) -> Result<(), AgentError> {
    let piece = s.negotiated.piece_len;
    if imm.is_none() {
        if let Some(slot) = s.landing.take(data.len()) {
            // One WRITE into a landing slot the peer granted.
            return send_landed_from(s, data, slot).await.0;
        }
    }
    if data.len() <= s.staging.max_len() {
        // One WRITE into the peer's staging ring and a `Staged`.
        return send_staged(s, data, imm).await;
    }
    // A message in several pieces waits for one of the peer's
    // reassembly slots (taken here, given back by the guard).
    match s.split_permits.acquire().await {
        Ok(permit) => permit.spend(),
        Err(_) => return Err(s.closed_error()),
    }
    if data.len() >= READ_MIN {
        // Fetched by the peer with one READ (the permit is given back
        // when the peer releases it).
        return send_by_read(s, data, imm).await;
    }
    let msg_id = s.next_msg_id();
    // A message in several pieces, cut before its last one was posted,
    // leaves the peer a partial message: the guard tells it to discard
    // (and only then frees the slot, so the `Abort` reaches the peer
    // before a later message's first piece can take the slot).
    let mut abort = AbortOnDrop {
        shared: s.clone(),
        msg_id,
        armed: true,
    };
    // Pieces go out back to back (as credits allow); their
    // completions are awaited after the last one is posted.
    let mut in_flight = PiecesInFlight::new(s);
    let mut offset = 0usize;
    loop {
        let end = data.len().min(offset + piece);
        let msg = Message::Data {
            msg_id,
            total_len: data.len() as u64,
            offset: offset as u64,
            imm,
            grant: 0, // the credits owed then, filled in at posting
            payload: &data[offset..end],
        };
        let posted = match s.post_data(&msg).await {
            Ok(Some(sent)) => in_flight.push(sent).await,
            Ok(None) => Ok(()),
            Err(e) => Err(e),
        };
        if let Err(e) = posted {
            // The connection is down (or failed now): nothing to abort.
            abort.armed = false;
            return Err(e);
        }
        offset = end;
        if offset >= data.len() {
            abort.armed = false;
            return in_flight.finish().await;
        }
    }
}
