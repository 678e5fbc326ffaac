//! The connection's receive path: [`step`] takes the next message of the
//! connection's receive ring, decodes and routes it, and reposts its slot
//! (or lends the slot to the application with the message it holds);
//! the application task waiting in `receive_msg` runs it (and gets its
//! message from it directly), or else the agent task does (see
//! `receiving.rs`). The agent task also sends the credits
//! owed in `Credit` messages of their own. On a listener's shared receive
//! queue (`srq.rs`) the agent reads the messages its route hands it
//! instead, in arrival order, each in the SRQ buffer it landed in
//! (dropping it reposts that buffer).

use std::future::poll_fn;
use std::rc::Rc;
use std::task::{Context, Poll};
use std::time::Duration;
use tracing::Instrument;

use verbio_runtime::provider::{AccessFlags, WcStatus};
use verbio_runtime::{sleep_until, spawn, timeout};

use super::backlog::{local_mr_charge, SMALL_ITEM_CHARGE};
use super::error::{AgentError, CloseReason};
use super::exposed::Exposed;
use super::msg::{Body, RecvMsg};
use super::rdma::{Partial, Shared};
use super::read_msg::{self, READ_ID};
use super::window_grants::WINDOW_ID;
use super::wire::{
    decode, decode_data, decode_short_whole, landed, staged, whole_send_grant, HandOverKind,
    Message, MrToken, PackedEntries, RefuseCode, MAX_SPLIT_IN_PROGRESS, WHOLE_HEADER_LEN,
};
use crate::verbs::Received;
use futures::channel::mpsc;
use futures::StreamExt;
use verbio_runtime::{RecvRing, RecvRingConfig, RecvRingError, RingMsg};

/// A connection's messages routed from a listener's shared receive queue.
pub(crate) type Route = mpsc::UnboundedReceiver<RingMsg>;

/// How long the agent tries to tell a misbehaving peer why it closes.
const ERROR_NOTICE_LIMIT: Duration = Duration::from_secs(1);

/// `Error` code for a protocol violation.
const ERROR_CODE_PROTOCOL: u16 = 1;

/// Posts the connection's receive buffers, a receive ring of the credits
/// plus the reserve the settings exchange sized for the peer, plus the
/// spare slots for messages lent to the application ([`lend_slots`]; none
/// if the QP's queues have no room for them); on a shared receive queue,
/// returns the connection's route instead.
pub(crate) fn post_receives(shared: &Shared) -> Result<Option<Route>, AgentError> {
    if let Some(route) = &shared.srq_route {
        return match route.take_messages() {
            Some(rx) => Ok(Some(rx)),
            None => Err(AgentError::Closed(CloseReason::Local)),
        };
    }
    let posted = shared.negotiated.posted_recvs;
    let ring = |spare: u32| {
        let config = RecvRingConfig::new(posted + spare, shared.config.posted_buf_size());
        RecvRing::new(&shared.qp, &shared.pd.0, config)
    };
    let spare = lend_slots(shared.config.recv_buf_count);
    let (ring, spare) = match ring(spare) {
        Ok(r) => (r, spare),
        Err(RecvRingError::Credits { .. }) if spare > 0 => {
            tracing::debug!(
                qp = shared.qp.qp_num(),
                spare,
                "no room for the spare receive slots: messages are copied out"
            );
            (ring(0).map_err(AgentError::ReceiveRing)?, 0)
        }
        Err(e) => return Err(AgentError::ReceiveRing(e)),
    };
    shared.rx.set_ring(ring, spare);
    Ok(None)
}

/// Spare receive-ring slots, for whole messages lent to the application
/// in the slot they landed in: half the connection's receive buffers.
pub(crate) fn lend_slots(recv_buf_count: u32) -> u32 {
    (recv_buf_count / 2).max(1)
}

/// What to do after one message.
enum Next {
    /// Repost the buffer; `true` if it carried a credit to return.
    Repost(bool),
    /// A whole message in this buffer: hand the buffer over (payload of
    /// `len` bytes at address `at`, after the data header, whose length
    /// depends on the frame's kind) and post a fresh one.
    Deliver {
        /// The payload's address (in the buffer the frame was decoded from).
        at: usize,
        /// Payload length.
        len: usize,
        /// Its immediate.
        imm: Option<u32>,
    },
    /// A whole message elsewhere (a landing slot): deliver it, repost the
    /// buffer and return its credit.
    Msg(RecvMsg),
    /// The connection is down.
    Stop,
}

/// The agent's loop; returns when the connection is down.
pub(crate) async fn run(shared: Rc<Shared>, route: Option<Route>) {
    serve(&shared, route).await;
    finish(&shared);
}

/// The receive side is done: the connection is down (for `Local` reasons
/// if nothing more specific was found) and nothing more is delivered.
fn finish(shared: &Rc<Shared>) {
    if !shared.is_down() {
        shared.fail(CloseReason::Local);
    }
    // What was held back behind staged messages goes to the inbox, which
    // keeps it for the application until it is read.
    super::staging::release_held(shared, true);
    // Nothing more arrives: the ring goes back to the budget (and the
    // landing slots once the messages lent in them are dropped).
    shared.staging.release_ring();
    shared.landing.release();
    shared.agent_stopped();
}

/// Handles the connection's messages until it is down and they have
/// drained.
async fn serve(shared: &Rc<Shared>, route: Option<Route>) {
    // The peer starts without credits: announce this side's buffers (they
    // are posted already).
    let hello = Message::Credit {
        grant: shared.config.recv_buf_count,
    };
    shared.granted_credits.granted(shared.config.recv_buf_count);
    if let Err(e) = shared.send_message(&hello, false).await {
        tracing::debug!(error = %crate::error::ErrorChain(&e), "announcing the receive buffers failed");
        return;
    }
    match route {
        None => serve_own(shared).await,
        Some(rx) => serve_shared(shared, rx).await,
    }
    tracing::debug!(qp = shared.qp.qp_num(), "agent stopped");
}

/// The credits to return for a message read, if any: a whole batch owed
/// and the backlog under its limit (over it, the credit stays here: see
/// `Backlog`).
fn credits_to_return(shared: &Shared, credited: bool) -> Option<u32> {
    if credited && shared.backlog.credit_may_return() {
        shared.owed.reposted()
    } else {
        None
    }
}

/// The messages routed from the shared receive queue, in arrival order;
/// each buffer goes back to the SRQ once handled (a delivered payload is
/// copied out).
async fn serve_shared(shared: &Rc<Shared>, mut rx: Route) {
    tracing::debug!("agent started on the shared receive queue");
    while let Some(m) = rx.next().await {
        shared.arrivals.set(shared.arrivals.get() + 1);
        let rcv = Received {
            len: m.len(),
            imm: m.imm(),
            by_write: m.by_write(),
        };
        let credited = match handle(shared, rcv, &m) {
            Next::Stop => break,
            Next::Repost(c) => c,
            Next::Msg(msg) => {
                deliver(shared, msg);
                true
            }
            Next::Deliver { at, len, imm } => {
                let start = at.wrapping_sub(m.as_ptr() as usize);
                let Some(payload) = start.checked_add(len).and_then(|end| m.get(start..end)) else {
                    shared.fail(CloseReason::Violation("payload outside the receive buffer"));
                    break;
                };
                deliver(
                    shared,
                    RecvMsg {
                        body: Body::Vec(payload.to_vec()),
                        imm,
                    },
                );
                true
            }
        };
        drop(m);
        if let Some(grant) = credits_to_return(shared, credited) {
            // Keep going even if it fails: the route's end ends the loop.
            shared.return_credits(grant).await;
        }
    }
}

/// Takes the connection's own receive completions while no application
/// task does (see `receiving.rs`) and sends the credits owed, until the
/// connection is down and its receives have drained.
async fn serve_own(shared: &Rc<Shared>) {
    tracing::debug!("agent started");
    while let Some(grant) = poll_fn(|cx| agent_turn(shared, cx)).await {
        // Keep going even if it fails: receives that completed before a
        // connection failure still carry the peer's last messages; the
        // flush ends the loop.
        shared.return_credits(grant).await;
    }
}

/// One turn of the agent: takes what completed (user messages go to the
/// inbox); `Some(credits)` to send, `None` once the receives are done.
fn agent_turn(shared: &Rc<Shared>, cx: &Context<'_>) -> Poll<Option<u32>> {
    shared.agent_turns.set(shared.agent_turns.get() + 1);
    shared.rx.agent_waits(cx);
    loop {
        if shared.rx.take_owed_check() {
            if let Some(grant) = shared.owed.take_batch() {
                return Poll::Ready(Some(grant));
            }
        }
        // The usual turn right after a receiver took its message (and
        // polled the next receive, see `Receive`): nothing to do.
        if shared.rx.armed() {
            return Poll::Pending;
        }
        match step(shared) {
            Step::Pending => return Poll::Pending,
            Step::Msg(m) => deliver(shared, m),
            Step::Continue => {}
            Step::Stop => return Poll::Ready(None),
        }
    }
}

/// What [`step`] did.
pub(crate) enum Step {
    /// A whole user message arrived (the caller delivers it).
    Msg(RecvMsg),
    /// A message was handled (control, a piece, a WRITE's immediate).
    Continue,
    /// The oldest receive has not completed (the fan waker will tell).
    Pending,
    /// The receive side is done (the connection is down).
    Stop,
}

/// Takes the next message of the receive ring if one arrived: handles it
/// and reposts its slot, or lends the slot with the whole message it holds
/// (the ring's spare slot stays posted meanwhile). Run by the driving
/// receiver or the agent.
pub(crate) fn step(shared: &Rc<Shared>) -> Step {
    let rx = &shared.rx;
    // The usual case first: a message, without the `Poll` around it.
    let slot = match rx.try_ring() {
        Some(slot) => slot,
        None => match poll_ring_slow(shared) {
            Ok(slot) => slot,
            Err(step) => return step,
        },
    };
    shared.arrivals.set(shared.arrivals.get() + 1);
    // The usual message of all, whole in the short frame with no immediate,
    // decoded and lent right here: no `Message` and no `Next` built and
    // moved (a third of the general way's instructions were such moves).
    // Any check it fails, it fails the general way below, which changed
    // nothing meanwhile (a failed `spend` spends nothing).
    if !slot.by_write() && slot.imm().is_none() {
        let buf = slot.as_slice();
        if let Some((grant, len)) = decode_short_whole(&buf[..slot.len().min(buf.len())]) {
            if len <= shared.config.max_message_len && shared.granted_credits.spend() {
                if grant > 0 {
                    shared.send_credits.grant(grant);
                }
                // Taken first: the message is then built in place of the
                // step's outcome, not moved there.
                credit_taken(shared);
                let holding = shared.staging.holding();
                return match rx.lend(WHOLE_HEADER_LEN, len, None, slot) {
                    Some(msg) if !holding => Step::Msg(msg),
                    Some(msg) => {
                        shared.staging.hold(msg);
                        Step::Continue
                    }
                    None => {
                        // Decoded from within the slot's bytes: never.
                        shared.fail(CloseReason::Violation("payload outside the receive buffer"));
                        finish(shared);
                        Step::Stop
                    }
                };
            }
        }
    }
    let rcv = Received {
        len: slot.len(),
        imm: slot.imm(),
        by_write: slot.by_write(),
    };
    let next = match handle_data(shared, &rcv, &slot) {
        Some(next) => next,
        None => handle(shared, rcv, &slot),
    };
    // Each outcome finished in its own arm: no `(credited, message)`
    // pair built and matched again (the message moved once more).
    match next {
        Next::Deliver { at, len, imm } => match rx.lend(
            at.wrapping_sub(slot.as_slice().as_ptr() as usize),
            len,
            imm,
            slot,
        ) {
            Some(msg) => {
                credit_taken(shared);
                hand_over(shared, msg)
            }
            None => {
                // The decoder checked the frame's length, so the range lies
                // in the slot; refuse the message rather than panic if not.
                shared.fail(CloseReason::Violation("payload outside the receive buffer"));
                finish(shared);
                Step::Stop
            }
        },
        Next::Msg(msg) => {
            drop(slot);
            credit_taken(shared);
            hand_over(shared, msg)
        }
        Next::Repost(credited) => {
            drop(slot);
            if credited {
                credit_taken(shared);
            }
            Step::Continue
        }
        Next::Stop => {
            finish(shared);
            Step::Stop
        }
    }
}

/// A credited buffer was taken: its credit is owed to the peer, unless
/// the unread limit keeps it here (see `Backlog`).
#[inline(always)]
fn credit_taken(shared: &Rc<Shared>) {
    if shared.backlog.credit_may_return() {
        shared.owed.add_one();
        if shared.owed.has_batch() {
            shared.rx.batch_owed();
        }
    }
}

/// [`step`]'s user message `m`: the caller's, or held behind the messages
/// held back (in order, after them).
#[inline(always)]
fn hand_over(shared: &Rc<Shared>, m: RecvMsg) -> Step {
    if shared.staging.holding() {
        shared.staging.hold(m);
        Step::Continue
    } else {
        Step::Msg(m)
    }
}

/// [`step`]'s poll of the ring when [`Receiving::try_ring`](super::receiving::Receiving::try_ring)
/// found no message: else [`Step::Pending`], or [`Step::Stop`] once the
/// receive side is done (then finished).
#[inline(never)]
fn poll_ring_slow(shared: &Rc<Shared>) -> Result<RingMsg, Step> {
    match shared.rx.poll_ring() {
        Poll::Pending => Err(Step::Pending),
        Poll::Ready(Some(Ok(slot))) => Ok(slot),
        Poll::Ready(Some(Err(e))) => {
            if !shared.is_down() {
                shared.fail(ring_failure(&e));
            }
            finish(shared);
            Err(Step::Stop)
        }
        Poll::Ready(None) => {
            finish(shared);
            Err(Step::Stop)
        }
    }
}

/// Why the connection is down when its receive ring reports `e`.
fn ring_failure(e: &RecvRingError) -> CloseReason {
    match e {
        RecvRingError::Completion {
            status: WcStatus::WrFlushErr,
            ..
        } => CloseReason::Disconnected,
        e => CloseReason::Transport(crate::error::ErrorChain(e).to_string()),
    }
}

/// [`handle`] for the usual messages, a whole message or a `Data` piece
/// (decoded from its fixed header), inlined into [`step`]; `None` for
/// anything else.
#[inline(always)]
fn handle_data(shared: &Rc<Shared>, rcv: &Received, buf: &[u8]) -> Option<Next> {
    if rcv.by_write {
        return None;
    }
    let frame = &buf[..rcv.len.min(buf.len())];
    if let Some(imm) = rcv.imm {
        return Some(whole_by_imm(shared, imm, frame));
    }
    let msg = decode_data(frame)?;
    if !shared.granted_credits.spend() {
        return Some(refuse(shared, CloseReason::Violation(CREDITLESS)));
    }
    Some(match msg {
        // The usual message: a `Next` built in place, with no `Result`
        // (whose error, a `CloseReason`, is large) moved around it.
        Message::Whole {
            imm,
            grant,
            payload,
        } => {
            if grant > 0 {
                shared.send_credits.grant(grant);
            }
            if payload.len() > shared.config.max_message_len {
                return Some(refuse(shared, CloseReason::Violation(TOO_LONG)));
            }
            Next::Deliver {
                at: payload.as_ptr() as usize,
                len: payload.len(),
                imm,
            }
        }
        // A piece of a split message (decode_data decodes nothing else).
        msg => match route(shared, msg) {
            Ok(next) => next,
            Err(reason) => refuse(shared, reason),
        },
    })
}

/// Routes one received message (`buf`: the receive buffer's bytes).
fn handle(shared: &Rc<Shared>, rcv: Received, buf: &[u8]) -> Next {
    if rcv.by_write {
        // A WRITE_WITH_IMM: the data is in granted memory, the immediate here.
        if !shared.granted_credits.spend() {
            return refuse(shared, CloseReason::Violation(CREDITLESS));
        }
        if let Some(imm) = rcv.imm {
            if let Some(si) = staged(imm) {
                // A message written into this side's staging ring, and the
                // credits and the peer's ring messages returned with it.
                if si.grant > 0 {
                    shared.send_credits.grant(si.grant);
                }
                if let Err(reason) = shared.staging.peer_freed(si.returned) {
                    return refuse(shared, reason);
                }
                return match super::staging::received(shared, None, None, si.len, si.restart) {
                    Ok(Some(msg)) => Next::Msg(msg),
                    Ok(None) => Next::Repost(true),
                    Err(reason) => refuse(shared, reason),
                };
            }
            if let Some((slot, len)) = landed(imm) {
                // A message written into one of this side's landing slots.
                return match super::landing::received(shared, slot, len) {
                    Ok(msg) => Next::Msg(msg),
                    Err(reason) => refuse(shared, reason),
                };
            }
            if shared.write_imms.push(0, imm) {
                shared.backlog.add(SMALL_ITEM_CHARGE);
            }
        }
        return Next::Repost(true);
    }
    let frame = &buf[..rcv.len.min(buf.len())];
    if let Some(imm) = rcv.imm {
        return whole_by_imm(shared, imm, frame);
    }
    let outcome = match decode(frame) {
        Ok(msg) if msg_is_credited(&msg) && !shared.granted_credits.spend() => {
            Err(CloseReason::Violation(CREDITLESS))
        }
        Ok(msg) => route(shared, msg),
        Err(e) => Err(CloseReason::Malformed(e)),
    };
    match outcome {
        Ok(next) => next,
        Err(reason) => refuse(shared, reason),
    }
}

/// A SEND_WITH_IMM: a whole message without a frame, `bytes` (its header
/// in `imm`, see [`whole_send_grant`]); the agent sends no other.
fn whole_by_imm(shared: &Rc<Shared>, imm: u32, bytes: &[u8]) -> Next {
    let outcome = match whole_send_grant(imm) {
        None => Err(CloseReason::Violation(
            "SEND with an immediate other than a whole message's",
        )),
        Some(_) if !shared.granted_credits.spend() => Err(CloseReason::Violation(CREDITLESS)),
        Some(grant) => whole(shared, None, grant, bytes),
    };
    match outcome {
        Ok(next) => next,
        Err(reason) => refuse(shared, reason),
    }
}

/// Why a peer that sends beyond its credits is disconnected.
const CREDITLESS: &str = "message sent without a send credit";

/// Why a peer that sends a whole message over the maximum is disconnected.
const TOO_LONG: &str = "message longer than the maximum";

/// True if the sender spent a credit on `msg` (everything but the
/// messages that travel in the receiver's reserve buffers).
fn msg_is_credited(msg: &Message<'_>) -> bool {
    !matches!(
        msg,
        Message::Credit { .. } | Message::Error { .. } | Message::Close | Message::Settings(_)
    )
}

/// Closes the connection for `reason`, telling the peer why if it broke
/// the protocol.
#[cold]
#[inline(never)]
fn refuse(shared: &Rc<Shared>, reason: CloseReason) -> Next {
    if reason.is_protocol() {
        let _in_span = shared.span.enter();
        tracing::warn!(qp = shared.qp.qp_num(), reason = %crate::error::ErrorChain(&reason), "peer broke the agent protocol");
        let text = crate::error::ErrorChain(&reason).to_string();
        // Spawned before `fail` spawns the close, which waits for the sends
        // in flight: the notice is posted first (tasks start in spawn
        // order), after the connection is marked down below.
        let s = shared.clone();
        spawn(
            async move {
                let notice = Message::Error {
                    code: ERROR_CODE_PROTOCOL,
                    text: s.error_text(&text),
                };
                let _ = timeout(ERROR_NOTICE_LIMIT, s.send_unchecked(&notice)).await;
            }
            .instrument(shared.span.clone()),
        );
    }
    // Down now: pending calls fail with the reason.
    shared.fail(reason);
    Next::Stop
}

/// Acts on a decoded message; `Err` closes the connection with that reason.
fn route(shared: &Rc<Shared>, msg: Message<'_>) -> Result<Next, CloseReason> {
    // The application's task may be the one running this: control
    // messages log in the connection's span (data messages do not log).
    let _in_span = (!matches!(
        msg,
        Message::Data { .. }
            | Message::Whole { .. }
            | Message::Staged { .. }
            | Message::Packed { .. }
    ))
    .then(|| shared.span.enter());
    match msg {
        Message::AllocRequest {
            req_id,
            len,
            align,
            access,
            lifetime_ms,
        } => {
            // Answered by a task: a reply may wait for credits, which arrive
            // through this loop (and a window grant for its bind).
            let checked = check_request(shared, len, align, access, lifetime_ms);
            // Window grants and grants on a shared PD need a bind first.
            let bind = shared.window_grants.is_some() || shared.shares_pd();
            let answer = match &checked {
                Ok(_) if bind => None,
                Ok((len, access, lifetime)) => Some(allocate(shared, *len, *access, *lifetime)),
                Err(code) => Some(Err(*code)),
            };
            let s = shared.clone();
            spawn(async move {
                let answer = match (answer, checked) {
                    (Some(a), _) => a,
                    (None, Ok((len, access, lifetime))) => allocate_bound(&s, len, access, lifetime).await,
                    (None, Err(code)) => Err(code),
                };
                let msg = Message::AllocResponse {
                    req_id,
                    result: answer,
                };
                if let Err(e) = s.send_message(&msg, true).await {
                    tracing::debug!(error = %crate::error::ErrorChain(&e), "answering a memory request failed");
                }
            }.instrument(shared.span.clone()));
            Ok(Next::Repost(true))
        }
        Message::AllocResponse { req_id, result } => {
            let waiter = shared.requests.borrow_mut().remove(&req_id);
            match waiter {
                Some(tx) => {
                    if let Err(Ok(token)) = tx.send(result) {
                        release_later(shared, token.token_id); // requester gave up
                    }
                }
                None => {
                    if let Ok(token) = result {
                        release_later(shared, token.token_id); // late answer
                    }
                }
            }
            Ok(Next::Repost(true))
        }
        Message::Release { token_id } => {
            if token_id & READ_ID != 0 {
                // The peer read a large message this side offered.
                if !read_msg::released(shared, token_id) {
                    tracing::debug!(token_id, "release of an unknown read-me refused");
                }
            } else if token_id & WINDOW_ID != 0 {
                let s = shared.clone();
                spawn(
                    async move {
                        let Some(w) = &s.window_grants else { return };
                        if w.revoke(&s, token_id, None, false).await.is_none() {
                            tracing::debug!(
                                token_id,
                                "release of an unknown or expired grant refused"
                            );
                        }
                    }
                    .instrument(shared.span.clone()),
                );
            } else if shared.grants.revoke(token_id, None).is_none() {
                tracing::debug!(token_id, "release of an unknown or expired grant refused");
            }
            Ok(Next::Repost(true))
        }
        Message::HandOver {
            kind: HandOverKind::Local,
            tag,
            token,
        } => {
            shared.backlog.add(SMALL_ITEM_CHARGE);
            shared.remote_mrs.push(tag, token);
            Ok(Next::Repost(true))
        }
        Message::HandOver {
            kind: HandOverKind::Remote,
            tag,
            token,
        } => {
            if token.token_id & WINDOW_ID != 0 {
                // The bytes come back once the window is invalidated.
                let s = shared.clone();
                spawn(
                    async move {
                        let Some(w) = &s.window_grants else { return };
                        match w.revoke(&s, token.token_id, Some(&token), false).await {
                            Some(mem) => {
                                s.backlog.add(local_mr_charge(&mem));
                                s.local_mrs.push(tag, mem);
                            }
                            None => tracing::warn!(
                                token_id = token.token_id,
                                "hand-back of an unknown, expired or forged grant refused"
                            ),
                        }
                    }
                    .instrument(shared.span.clone()),
                );
                return Ok(Next::Repost(true));
            }
            match shared.grants.revoke(token.token_id, Some(&token)) {
                Some(mem) => {
                    shared.backlog.add(local_mr_charge(&mem));
                    shared.local_mrs.push(tag, mem);
                }
                None => tracing::warn!(
                    token_id = token.token_id,
                    "hand-back of an unknown, expired or forged grant refused"
                ),
            }
            Ok(Next::Repost(true))
        }
        Message::Credit { grant } => {
            shared.send_credits.grant(grant);
            Ok(Next::Repost(false))
        }
        Message::Data {
            msg_id,
            total_len,
            offset,
            imm,
            grant,
            payload,
        } => {
            // A piece of a split message: reassembled, delivered once whole.
            if grant > 0 {
                shared.send_credits.grant(grant);
            }
            if offset == 0 {
                // The staging ring would carry it: announce it.
                super::staging::wanted(shared, total_len);
            }
            reassemble(shared, msg_id, total_len, offset, imm, payload)?;
            Ok(Next::Repost(true))
        }
        Message::Whole {
            imm,
            grant,
            payload,
        } => whole(shared, imm, grant, payload),
        Message::Error { code, text } => Err(CloseReason::PeerError {
            code,
            text: text.to_owned(),
        }),
        Message::Close => Err(CloseReason::Disconnected),
        Message::Abort { msg_id } => {
            // Unknown ids are fine: the sender aborts whenever a split send
            // is cut, also before its first piece went out.
            if shared.partial.borrow_mut().remove(&msg_id).is_some() {
                tracing::debug!(msg_id, "peer aborted a partly received message");
            }
            Ok(Next::Repost(true))
        }
        Message::Settings(_) => Err(CloseReason::Violation(
            "agent settings after the connection started",
        )),
        Message::ReadMe { imm, token } => {
            super::staging::wanted(shared, token.len);
            read_msg::fetch(shared, imm, token)?;
            Ok(Next::Repost(true))
        }
        Message::StagingRing { addr, len, rkey } => {
            shared.staging.peer_ring(addr, len, rkey)?;
            Ok(Next::Repost(true))
        }
        Message::Staged {
            imm,
            grant,
            offset,
            len,
        } => {
            if grant > 0 {
                shared.send_credits.grant(grant);
            }
            if len as usize > shared.config.max_message_len {
                return Err(CloseReason::Violation("message longer than the maximum"));
            }
            Ok(
                match super::staging::received(shared, imm, Some(offset), len, false)? {
                    Some(msg) => Next::Msg(msg),
                    None => Next::Repost(true),
                },
            )
        }
        Message::WriteImm { imm } => {
            // The immediate of the peer's write_with_imm (its WRITE came
            // just before): as a WRITE_WITH_IMM's would be.
            if shared.write_imms.push(0, imm) {
                shared.backlog.add(SMALL_ITEM_CHARGE);
            }
            Ok(Next::Repost(true))
        }
        Message::StagingFreed { count } => {
            shared.staging.peer_freed(count)?;
            Ok(Next::Repost(true))
        }
        Message::SlotGrant {
            slot,
            addr,
            len,
            rkey,
        } => {
            shared.landing.peer_granted(slot, addr, len, rkey)?;
            Ok(Next::Repost(true))
        }
        Message::Packed { grant, entries } => {
            if grant > 0 {
                shared.send_credits.grant(grant);
            }
            unpack(shared, entries)?;
            Ok(Next::Repost(true))
        }
    }
}

/// Delivers the messages of a pack (its credit spent), in order, each
/// copied out of the receive buffer (which is reposted at once): all are
/// checked before any is delivered, so a pack with a message over the
/// maximum delivers none of them.
fn unpack(shared: &Shared, entries: PackedEntries<'_>) -> Result<(), CloseReason> {
    let max = shared.config.max_message_len;
    if entries.into_iter().any(|(_, m)| m.len() > max) {
        return Err(CloseReason::Violation("message longer than the maximum"));
    }
    for (imm, m) in entries {
        deliver(
            shared,
            RecvMsg {
                body: Body::Vec(m.to_vec()),
                imm,
            },
        );
    }
    Ok(())
}

/// Acts on a whole message (its credit spent): delivered in its buffer.
#[inline(always)]
fn whole(
    shared: &Shared,
    imm: Option<u32>,
    grant: u32,
    payload: &[u8],
) -> Result<Next, CloseReason> {
    if grant > 0 {
        shared.send_credits.grant(grant);
    }
    if payload.len() > shared.config.max_message_len {
        return Err(CloseReason::Violation(TOO_LONG));
    }
    Ok(Next::Deliver {
        at: payload.as_ptr() as usize,
        len: payload.len(),
        imm,
    })
}

/// Adds a `Data` piece; delivers the message once complete. Pieces of one
/// message come from one sender task in order, so each must continue
/// exactly where the previous one ended.
fn reassemble(
    shared: &Shared,
    msg_id: u64,
    total_len: u64,
    offset: u64,
    imm: Option<u32>,
    payload: &[u8],
) -> Result<(), CloseReason> {
    if total_len > shared.config.max_message_len as u64 {
        return Err(CloseReason::Violation("message longer than the maximum"));
    }
    let mut partial = shared.partial.borrow_mut();
    let p = if offset == 0 {
        if partial.contains_key(&msg_id) {
            return Err(CloseReason::Violation("message id reused"));
        }
        if partial.len() + shared.reads.fetching() >= MAX_SPLIT_IN_PROGRESS {
            return Err(CloseReason::Violation(
                "more messages in pieces at once than the protocol allows",
            ));
        }
        // Room for the whole message at once: each piece is copied once,
        // into place, never again by the vector's growth. (`total_len` is
        // within `max_message_len`, checked above, which bounds what a
        // peer's first pieces make this side reserve, as the pieces
        // themselves would; the pages are only touched as they are filled.)
        partial.entry(msg_id).or_insert(Partial {
            total_len,
            imm,
            bytes: Vec::with_capacity(total_len as usize),
        })
    } else {
        match partial.get_mut(&msg_id) {
            Some(p) => p,
            None => return Err(CloseReason::Violation("data piece of an unknown message")),
        }
    };
    if p.total_len != total_len || p.imm != imm || p.bytes.len() as u64 != offset {
        return Err(CloseReason::Violation("data piece out of sequence"));
    }
    if offset + payload.len() as u64 > total_len {
        return Err(CloseReason::Violation(
            "data piece beyond the message length",
        ));
    }
    p.bytes.extend_from_slice(payload);
    if p.bytes.len() as u64 == total_len {
        if let Some(done) = partial.remove(&msg_id) {
            drop(partial);
            deliver(
                shared,
                RecvMsg {
                    body: Body::Vec(done.bytes),
                    imm: done.imm,
                },
            );
        }
    }
    Ok(())
}

/// Grants a peer's allocation request: checks the layout, caps the access
/// at this side's maximum, registers a fresh region and arms its expiry.
/// Checks a memory request: the length, access and lifetime to grant.
fn check_request(
    shared: &Rc<Shared>,
    len: u64,
    align: u32,
    access: u32,
    lifetime_ms: u32,
) -> Result<(usize, AccessFlags, Duration), RefuseCode> {
    let cfg = &shared.config;
    if len == 0 || len > cfg.max_message_len as u64 || !align.is_power_of_two() || align > 8 {
        return Err(RefuseCode::BadLayout);
    }
    let granted = shared.grants.bytes() + shared.window_grants.as_ref().map_or(0, |w| w.bytes());
    // A peer cannot make this side allocate without bound.
    if granted.saturating_add(len) > cfg.max_granted_bytes {
        tracing::debug!(len, "memory request beyond max_granted_bytes refused");
        return Err(RefuseCode::NoMemory);
    }
    let remote = AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC;
    let access = AccessFlags::from_bits_truncate(access) & remote & cfg.max_access;
    if access == AccessFlags::NONE {
        return Err(RefuseCode::AccessDenied);
    }
    let lifetime = match lifetime_ms {
        0 => cfg.token_lifetime,
        ms => Duration::from_millis(ms.into()).min(cfg.token_lifetime),
    };
    // `len <= max_message_len`, a usize.
    Ok((len as usize, access, lifetime))
}

/// Grants a checked request with fresh registered memory.
fn allocate(
    shared: &Rc<Shared>,
    len: usize,
    access: AccessFlags,
    lifetime: Duration,
) -> Result<MrToken, RefuseCode> {
    let mem = vec![0u8; len];
    let (token, deadline) = shared.grants.grant(&shared.pd.0, mem, access, lifetime)?;
    expire_at(shared, token.token_id, deadline);
    Ok(token)
}

/// Grants a checked request through a memory window: one of the
/// connection's window region (`grant_windows`), or, on a shared receive
/// queue, one over fresh memory (`exposed.rs`).
async fn allocate_bound(
    shared: &Rc<Shared>,
    len: usize,
    access: AccessFlags,
    lifetime: Duration,
) -> Result<MrToken, RefuseCode> {
    let (token, deadline) = match &shared.window_grants {
        Some(w) => w.grant(shared, len, access, lifetime).await?,
        None => {
            let exposed = Exposed::new(shared, vec![0u8; len], access, "registering a grant")
                .await
                .map_err(|(e, _)| {
                    tracing::debug!(error = %crate::error::ErrorChain(&e), "granting memory failed");
                    RefuseCode::NoMemory
                })?;
            shared.grants.insert(exposed, lifetime)
        }
    };
    expire_at(shared, token.token_id, deadline);
    Ok(token)
}

/// Revokes grant `id` at `deadline` unless it is gone by then.
pub(crate) fn expire_at(shared: &Rc<Shared>, id: u64, deadline: std::time::Instant) {
    let weak = Rc::downgrade(shared);
    spawn(
        async move {
            sleep_until(deadline).await;
            let Some(s) = weak.upgrade() else { return };
            let expired = match &s.window_grants {
                Some(w) if id & WINDOW_ID != 0 => w.revoke(&s, id, None, true).await.is_some(),
                _ => s.grants.expire(id),
            };
            if expired {
                tracing::debug!(token_id = id, "grant expired and revoked");
            }
        }
        .instrument(shared.span.clone()),
    );
}

/// Tells the peer to revoke a grant this side does not want.
fn release_later(shared: &Rc<Shared>, token_id: u64) {
    let s = shared.clone();
    spawn(
        async move {
            let _ = s.send_message(&Message::Release { token_id }, true).await;
        }
        .instrument(shared.span.clone()),
    );
}

/// Queues a whole message in the application's inbox (charged to the
/// unread backlog), or behind the messages held back if there are any
/// (`staging.rs`).
pub(crate) fn deliver(shared: &Shared, msg: RecvMsg) {
    if shared.staging.holding() {
        shared.staging.hold(msg);
        return;
    }
    deliver_now(shared, msg);
}

/// [`deliver`] to the inbox now.
pub(crate) fn deliver_now(shared: &Shared, msg: RecvMsg) {
    let charge = msg.charge(shared.config.posted_buf_size());
    if shared.rx.deliver(msg) {
        shared.backlog.add(charge);
    }
}
