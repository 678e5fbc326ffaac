//! The agent task: owns the connection's receive queue, keeps its buffers
//! posted, decodes each message and routes it. Receives complete in posting
//! order on an RC QP, so the agent awaits them front to back.

use std::collections::VecDeque;
use std::rc::Rc;
use std::time::Duration;

use verbio_runtime::buf::LocalBuf;
use verbio_runtime::{timeout, Submit};

use super::error::{AgentError, CloseReason};
use super::rdma::{Partial, Shared};
use super::wire::{decode, Message};
use crate::verbs::{Received, RecvVerb, Verbs};

/// The posted receives, oldest first.
pub(crate) type Receives = VecDeque<Submit<RecvVerb<LocalBuf>>>;

/// How long the agent tries to tell a misbehaving peer why it closes.
const ERROR_NOTICE_LIMIT: Duration = Duration::from_secs(1);

/// `Error` code for a protocol violation.
const ERROR_CODE_PROTOCOL: u16 = 1;

/// Posts the connection's receive buffers (credits plus reserve).
pub(crate) fn post_receives(shared: &Shared) -> Result<Receives, AgentError> {
    let n = shared.config.posted_recvs();
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
    Ok(q)
}

/// What to do after one message.
enum Next {
    /// Repost the buffer; `true` if it carried a credit to return.
    Repost(bool),
    /// The connection is down.
    Stop,
}

/// The agent's loop; returns when the connection is down.
pub(crate) async fn run(shared: Rc<Shared>, mut posted: Receives) {
    while let Some(recv) = posted.pop_front() {
        let (res, mut buf) = recv.await;
        let next = match res {
            Ok(rcv) => handle(&shared, rcv, &buf).await,
            Err(e) => {
                if shared.failure().is_none() {
                    shared.fail(if e.is_flush() {
                        CloseReason::Disconnected
                    } else {
                        CloseReason::Transport(e.to_string())
                    });
                }
                Next::Stop
            }
        };
        let credited = match next {
            Next::Stop => break,
            Next::Repost(c) => c,
        };
        buf.clear();
        posted.push_back(shared.qp.recv(buf));
        if credited {
            if let Some(grant) = shared.owed.reposted() {
                if let Err(e) = shared.send_message(&Message::Credit { grant }, false).await {
                    tracing::debug!(error = %e, "returning credits failed");
                    break;
                }
            }
        }
    }
    tracing::debug!(qp = shared.qp.qp_num(), "agent stopped");
}

/// Routes one received message.
async fn handle(shared: &Shared, rcv: Received, buf: &LocalBuf) -> Next {
    if rcv.by_write {
        // A WRITE_WITH_IMM: the data is in granted memory, the immediate here.
        if let (Some(imm), Some(tx)) = (rcv.imm, shared.imm_tx.borrow().as_ref()) {
            let _ = tx.unbounded_send(imm);
        }
        return Next::Repost(true);
    }
    let frame = &buf[..rcv.len.min(buf.len())];
    let outcome = match decode(frame) {
        Ok(msg) => route(shared, msg),
        Err(e) => Err(CloseReason::Malformed(e)),
    };
    match outcome {
        Ok(next) => next,
        Err(reason) => {
            // Down first (pending calls fail with the reason), then tell the
            // peer why; the close waits for this last send.
            shared.fail(reason.clone());
            if reason.is_protocol() {
                tracing::warn!(qp = shared.qp.qp_num(), %reason, "peer broke the agent protocol");
                let text = reason.to_string();
                let notice = Message::Error {
                    code: ERROR_CODE_PROTOCOL,
                    text: &text,
                };
                let _ = timeout(ERROR_NOTICE_LIMIT, shared.send_unchecked(&notice)).await;
            }
            Next::Stop
        }
    }
}

/// Acts on a decoded message; `Err` closes the connection with that reason.
fn route(shared: &Shared, msg: Message<'_>) -> Result<Next, CloseReason> {
    match msg {
        Message::Credit { grant } => {
            shared.credits.grant(grant);
            Ok(Next::Repost(false))
        }
        Message::Data {
            msg_id,
            total_len,
            offset,
            imm,
            payload,
        } => {
            reassemble(shared, msg_id, total_len, offset, imm, payload)?;
            Ok(Next::Repost(true))
        }
        Message::Error { code, text } => Err(CloseReason::PeerError {
            code,
            text: text.to_owned(),
        }),
        Message::Close => Err(CloseReason::Disconnected),
        _ => Err(CloseReason::Violation(
            "memory-region messages are not supported by this side yet",
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
                let _ = tx.unbounded_send((done.bytes, done.imm));
            }
        }
    }
    Ok(())
}
