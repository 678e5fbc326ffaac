//! The agent task: owns the connection's receive queue, keeps its buffers
//! posted, decodes each message and routes it. Receives complete in posting
//! order on an RC QP, so the agent awaits them front to back. On a
//! listener's shared receive queue (`srq.rs`) the agent reads the messages
//! its route hands it instead, in arrival order, each in the SRQ buffer it
//! landed in (dropping it reposts that buffer).

use std::collections::VecDeque;
use std::rc::Rc;
use std::time::Duration;
use tracing::Instrument;

use verbio_runtime::buf::IoBuf;
use verbio_runtime::buf::LocalBuf;
use verbio_runtime::provider::AccessFlags;
use verbio_runtime::{sleep_until, spawn, timeout, Submit};

use super::backlog::{local_mr_charge, SMALL_ITEM_CHARGE};
use super::error::{AgentError, CloseReason};
use super::msg::{Body, RecvMsg};
use super::rdma::{Partial, Shared};
use super::window_grants::WINDOW_ID;
use super::wire::{
    decode, HandOverKind, Message, MrToken, RefuseCode, DATA_OVERHEAD, MAX_SPLIT_IN_PROGRESS,
};
use crate::verbs::{Received, RecvVerb, Verbs};
use futures::channel::mpsc;
use futures::StreamExt;
use verbio_runtime::RingMsg;

/// Where the connection's messages come from.
pub(crate) enum Receives {
    /// Its own posted receives, oldest first.
    Own(VecDeque<Submit<RecvVerb<LocalBuf>>>),
    /// Its route from the listener's shared receive queue.
    Shared(mpsc::UnboundedReceiver<RingMsg>),
}

/// How long the agent tries to tell a misbehaving peer why it closes.
const ERROR_NOTICE_LIMIT: Duration = Duration::from_secs(1);

/// `Error` code for a protocol violation.
const ERROR_CODE_PROTOCOL: u16 = 1;

/// Posts the connection's receive buffers (credits plus the reserve the
/// settings exchange sized for the peer).
pub(crate) fn post_receives(shared: &Shared) -> Result<Receives, AgentError> {
    if let Some(route) = &shared.srq_route {
        return match route.take_messages() {
            Some(rx) => Ok(Receives::Shared(rx)),
            None => Err(AgentError::Closed(CloseReason::Local)),
        };
    }
    let n = shared.negotiated.posted_recvs;
    let mut q = VecDeque::with_capacity(n as usize);
    for _ in 0..n {
        let buf = shared
            .pool
            .alloc(shared.config.recv_buf_size)
            .map_err(|source| AgentError::Buf {
                stage: "allocating the receive buffers",
                source,
            })?;
        q.push_back(shared.qp.recv(buf));
    }
    Ok(Receives::Own(q))
}

/// What to do after one message.
enum Next {
    /// Repost the buffer; `true` if it carried a credit to return.
    Repost(bool),
    /// A whole message in this buffer: hand the buffer over (payload of
    /// `len` bytes after the data header) and post a fresh one.
    Deliver {
        /// Payload length.
        len: usize,
        /// Its immediate.
        imm: Option<u32>,
    },
    /// The connection is down.
    Stop,
}

/// The agent's loop; returns when the connection is down.
pub(crate) async fn run(shared: Rc<Shared>, posted: Receives) {
    serve(&shared, posted).await;
    if shared.failure().is_none() {
        shared.fail(CloseReason::Local);
    }
    shared.agent_stopped();
}

/// Handles the connection's messages until it is down and they have
/// drained.
async fn serve(shared: &Rc<Shared>, posted: Receives) {
    // The peer starts without credits: announce this side's buffers (they
    // are posted already).
    let hello = Message::Credit {
        grant: shared.config.recv_buf_count,
    };
    shared.peer_credits.granted(shared.config.recv_buf_count);
    if let Err(e) = shared.send_message(&hello, false).await {
        tracing::debug!(error = %crate::error::ErrorChain(&e), "announcing the receive buffers failed");
        return;
    }
    match posted {
        Receives::Own(posted) => serve_own(shared, posted).await,
        Receives::Shared(rx) => serve_shared(shared, rx).await,
    }
    tracing::debug!(qp = shared.qp.qp_num(), "agent stopped");
}

/// Returns a credit for a message read, if the backlog allows.
async fn credit_back(shared: &Rc<Shared>, credited: bool) {
    // Over the unread limit, the credit stays here (see `Backlog`).
    if credited && shared.backlog.credit_may_return() {
        if let Some(grant) = shared.owed.reposted() {
            // Keep going even if it fails: receives that completed
            // before a connection failure still carry the peer's last
            // messages; the flush (or the route's end) ends the loop.
            shared.return_credits(grant).await;
        }
    }
}

/// The messages routed from the shared receive queue, in arrival order;
/// each buffer goes back to the SRQ once handled (a delivered payload is
/// copied out).
async fn serve_shared(shared: &Rc<Shared>, mut rx: mpsc::UnboundedReceiver<RingMsg>) {
    tracing::debug!("agent started on the shared receive queue");
    while let Some(m) = rx.next().await {
        let rcv = Received {
            len: m.len(),
            imm: m.imm(),
            by_write: m.by_write(),
        };
        let credited = match handle(shared, rcv, &m).await {
            Next::Stop => break,
            Next::Repost(c) => c,
            Next::Deliver { len, imm } => {
                let Some(payload) = m.get(DATA_OVERHEAD..DATA_OVERHEAD + len) else {
                    shared.fail(CloseReason::Violation("payload outside the receive buffer"));
                    break;
                };
                deliver(shared, Body::Vec(payload.to_vec()), imm);
                true
            }
        };
        drop(m);
        credit_back(shared, credited).await;
    }
}

/// Handles receive completions in order until the connection is down and
/// its receives have drained.
async fn serve_own(shared: &Rc<Shared>, mut posted: VecDeque<Submit<RecvVerb<LocalBuf>>>) {
    tracing::debug!(posted = posted.len(), "agent started");
    while let Some(recv) = posted.pop_front() {
        let (res, mut buf) = recv.await;
        let next = match res {
            Ok(rcv) => handle(shared, rcv, &buf[..]).await,
            Err(e) => {
                if shared.failure().is_none() {
                    shared.fail(if e.is_flush() {
                        CloseReason::Disconnected
                    } else {
                        CloseReason::Transport(crate::error::ErrorChain(&e).to_string())
                    });
                }
                Next::Stop
            }
        };
        let credited = match next {
            Next::Stop => break,
            Next::Repost(c) => c,
            Next::Deliver { len, imm } => {
                match hand_over(shared, buf, len, imm) {
                    Some(fresh) => buf = fresh,
                    None => break,
                }
                true
            }
        };
        buf.clear();
        posted.push_back(shared.qp.recv(buf));
        credit_back(shared, credited).await;
    }
}

/// Routes one received message (`buf`: the receive buffer's bytes).
async fn handle(shared: &Rc<Shared>, rcv: Received, buf: &[u8]) -> Next {
    if rcv.by_write {
        // A WRITE_WITH_IMM: the data is in granted memory, the immediate here.
        if !shared.peer_credits.spend() {
            return refuse(shared, CloseReason::Violation(CREDITLESS)).await;
        }
        if let (Some(imm), Some(tx)) = (rcv.imm, shared.imm_tx.borrow().as_ref()) {
            if tx.unbounded_send(imm).is_ok() {
                shared.backlog.add(SMALL_ITEM_CHARGE);
            }
        }
        return Next::Repost(true);
    }
    let frame = &buf[..rcv.len.min(buf.len())];
    let outcome = match decode(frame) {
        Ok(msg) if msg_is_credited(&msg) && !shared.peer_credits.spend() => {
            Err(CloseReason::Violation(CREDITLESS))
        }
        Ok(msg) => route(shared, msg),
        Err(e) => Err(CloseReason::Malformed(e)),
    };
    match outcome {
        Ok(next) => next,
        Err(reason) => refuse(shared, reason).await,
    }
}

/// Why a peer that sends beyond its credits is disconnected.
const CREDITLESS: &str = "message sent without a send credit";

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
async fn refuse(shared: &Rc<Shared>, reason: CloseReason) -> Next {
    // Down first (pending calls fail with the reason), then tell the peer
    // why; the close waits for this last send.
    shared.fail(reason.clone());
    if reason.is_protocol() {
        tracing::warn!(qp = shared.qp.qp_num(), reason = %crate::error::ErrorChain(&reason), "peer broke the agent protocol");
        let text = crate::error::ErrorChain(&reason).to_string();
        let notice = Message::Error {
            code: ERROR_CODE_PROTOCOL,
            text: shared.error_text(&text),
        };
        let _ = timeout(ERROR_NOTICE_LIMIT, shared.send_unchecked(&notice)).await;
    }
    Next::Stop
}

/// Acts on a decoded message; `Err` closes the connection with that reason.
fn route(shared: &Rc<Shared>, msg: Message<'_>) -> Result<Next, CloseReason> {
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
            let answer = match (&checked, &shared.window_grants) {
                (Ok(_), Some(_)) => None,
                (Ok((len, access, lifetime)), None) => {
                    Some(allocate(shared, *len, *access, *lifetime))
                }
                (Err(code), _) => Some(Err(*code)),
            };
            let s = shared.clone();
            spawn(async move {
                let answer = match (answer, checked) {
                    (Some(a), _) => a,
                    (None, Ok((len, access, lifetime))) => allocate_window(&s, len, access, lifetime).await,
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
            if token_id & WINDOW_ID != 0 {
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
            shared.credits.grant(grant);
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
            if grant > 0 {
                shared.credits.grant(grant);
            }
            let whole = offset == 0 && payload.len() as u64 == total_len;
            if whole && !shared.partial.borrow().contains_key(&msg_id) {
                if total_len > shared.config.max_message_len as u64 {
                    return Err(CloseReason::Violation("message longer than the maximum"));
                }
                return Ok(Next::Deliver {
                    len: payload.len(),
                    imm,
                });
            }
            reassemble(shared, msg_id, total_len, offset, imm, payload)?;
            Ok(Next::Repost(true))
        }
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
    }
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
        if partial.len() >= MAX_SPLIT_IN_PROGRESS {
            return Err(CloseReason::Violation(
                "more messages in pieces at once than the protocol allows",
            ));
        }
        partial.entry(msg_id).or_insert(Partial {
            total_len,
            imm,
            bytes: Vec::new(),
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
            if let Some(tx) = shared.inbox_tx.borrow().as_ref() {
                let msg = RecvMsg {
                    body: Body::Vec(done.bytes),
                    imm: done.imm,
                };
                let charge = msg.charge(shared.config.recv_buf_size);
                if tx.unbounded_send(msg).is_ok() {
                    shared.backlog.add(charge);
                }
            }
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

/// Grants a checked request through a memory window.
async fn allocate_window(
    shared: &Rc<Shared>,
    len: usize,
    access: AccessFlags,
    lifetime: Duration,
) -> Result<MrToken, RefuseCode> {
    let w = shared.window_grants.as_ref().ok_or(RefuseCode::NoMemory)?;
    let (token, deadline) = w.grant(shared, len, access, lifetime).await?;
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

/// Hands a receive buffer holding one whole message to the user (zero
/// copy) and returns a fresh buffer to repost; `None` if none could be had
/// (the connection goes down).
/// Puts a whole message in the application's inbox.
fn deliver(shared: &Shared, body: Body, imm: Option<u32>) {
    if let Some(tx) = shared.inbox_tx.borrow().as_ref() {
        let msg = RecvMsg { body, imm };
        let charge = msg.charge(shared.config.recv_buf_size);
        if tx.unbounded_send(msg).is_ok() {
            shared.backlog.add(charge);
        }
    }
}

fn hand_over(shared: &Shared, buf: LocalBuf, len: usize, imm: Option<u32>) -> Option<LocalBuf> {
    let fresh = match shared.pool.alloc(shared.config.recv_buf_size) {
        Ok(b) => b,
        Err(e) => {
            shared.fail(CloseReason::Transport(format!(
                "no receive buffer to repost: {}",
                crate::error::ErrorChain(&e)
            )));
            return None;
        }
    };
    match buf.slice(DATA_OVERHEAD..DATA_OVERHEAD + len) {
        Ok(payload) => deliver(shared, Body::Buf(payload), imm),
        Err(rejected) => {
            // The decoder checked the frame's length, so the range lies in
            // the buffer; refuse the message rather than panic if not.
            tracing::warn!(error = %rejected.error, "payload range outside the receive buffer");
            shared.fail(CloseReason::Violation("payload outside the receive buffer"));
            return None;
        }
    }
    Some(fresh)
}
