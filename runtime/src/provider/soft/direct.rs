//! Transmission from the posting thread: while the engine has nothing left
//! to send for a QP (it says so by setting `QpInner::direct`), `post_send`
//! of one SEND or WRITE of one packet encodes the request packet and writes
//! it to the connection's socket itself (see `wire.rs` for how this is
//! ordered with the engine's own writes), instead of queueing the WR and
//! waking the engine. A payload of `ZC_MIN` bytes or more is written from
//! registered memory, uncopied, and only while it is the QP's only request
//! (one at a time, the hand-off is the latency; behind others, the engine
//! streams it as the socket drains). The WR then waits in `QpInner::sent` until the engine takes it
//! over (when it next looks at the QP: a response for it, a tick, a state
//! change) with its PSN, for completion, RNR retransmission and timeouts.
//! A lone READ's request goes the same way (its responses come back to the
//! engine or to the application's receive, like those of any READ).
//! This removes one thread hand-off from every such request, at the price of
//! the packet's encoding and `send` syscall on the posting thread.
//!
//! A small request posted while its QP has requests in flight is corked on
//! the connection instead of written (`Wire::try_write_or_cork`): the next
//! write on the connection takes it along, or a flush
//! (`Shared::flush_corked`) at the application's next poll or arming of a
//! CQ, or at the end of the receive that the ACKs of those in flight bring.
//! A burst of single posts then costs one `send` (and one wake-up of the
//! peer) instead of one per request.

use std::cell::RefCell;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use smallvec::SmallVec;

use super::conn::TxMemRef;
use super::dma::{check_local, gather, spans, Span};
use super::engine::psn_add;
use super::lock;
use super::packet::{Header, Opcode, FLAG_FIRST, FLAG_LAST, HEADER_LEN, MAX_PAYLOAD};
use super::qp::{Qp, SendWqe};
use super::requester::{data_header, ZC_MIN};
use super::wire::{DirectWrite, Posted, SpillTail, Wire};
use crate::provider::{ack_timeout_duration, PostError, QpState, SendFlags, SendOp, SendWr};

/// Largest message sent from the posting thread: one packet. (Messages of
/// several packets go through the engine.)
pub(crate) const DIRECT_MAX: u64 = MAX_PAYLOAD as u64;

/// The engine's permission to transmit directly.
pub(crate) struct Direct {
    /// The connection to the peer's engine.
    pub wire: Arc<Wire>,
    /// PSN of the next request (owned by posting threads while set).
    pub next_psn: u32,
}

/// A WR a posting thread transmitted.
pub(crate) struct DirectSent {
    pub w: SendWqe,
    pub psn: u32,
    /// When it was written (its ACK timeout runs from here).
    pub at: Instant,
    /// The unsent rest of its payload, left in its memory for the engine
    /// to write (see `Wire::try_write_gather`).
    pub zc: Option<TxMemRef>,
}

thread_local! {
    /// Packet being built (reused: no allocation per post).
    static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// True if `wr` may be transmitted by the posting thread.
pub(crate) fn eligible(wr: &SendWr) -> bool {
    let fits = || wr.sg_list.iter().map(|s| u64::from(s.length)).sum::<u64>() <= DIRECT_MAX;
    !wr.flags.contains(SendFlags::FENCE)
        && match wr.op {
            SendOp::Send
            | SendOp::SendWithImm { .. }
            | SendOp::Write { .. }
            | SendOp::WriteWithImm { .. } => fits(),
            // (A request without payload, whatever the length read.)
            SendOp::Read { .. } => true,
            _ => false,
        }
}

/// Transmits `wr` from this thread if the engine allows it now. `None`: not
/// possible; queue it as usual (which also reports any error).
///
/// # Safety
///
/// The contract of [`Qp::post_send`] holds for `wr`.
pub(crate) unsafe fn post(qp: &Qp, wr: &SendWr) -> Option<Result<(), PostError>> {
    let sh = &qp.0.shared;
    let ctx = qp.0.ctx.shared();
    // SAFETY: forwarded contract.
    // An invalid WR is reported by the queueing path (which checks the
    // state first).
    let w = unsafe { qp.check_send(wr) }.ok()?;
    SCRATCH.with(|scratch| {
        let mut buf = scratch.try_borrow_mut().ok()?;
        buf.clear();
        buf.resize(HEADER_LEN, 0);
        // A large payload is written from registered memory, as the engine
        // writes it (`ZC_MIN`): the MR table stays locked until the write
        // is done, taken before the QP lock (the engine's order).
        let read = matches!(w.op, SendOp::Read { .. });
        let from_memory = !read && w.inline.is_none() && w.len >= ZC_MIN;
        let mrs = from_memory.then(|| ctx.mrs());
        let mut body = SmallVec::<[Span<'_>; 4]>::new();
        match (&w.inline, &mrs) {
            // A READ's responses land in its SGEs: invalid ones are left to
            // the engine, which completes the WR with the error.
            _ if read => {
                if !check_local(&w.sges, sh.pd, &ctx.mrs(), true) {
                    return None;
                }
            }
            (Some(bytes), _) => buf.extend_from_slice(bytes),
            (None, Some(mrs)) => {
                // An invalid SGE is left to the engine, which completes the
                // WR with the error.
                body = spans(&w.sges, sh.pd, mrs, 0, w.len)?;
            }
            (None, None) => {
                // Copied before the QP lock is taken (the engine takes the
                // QP lock under the MR-table lock).
                let mrs = ctx.mrs();
                if !gather(&w.sges, sh.pd, &mrs, 0, w.len, &mut buf) {
                    return None;
                }
            }
        }
        let mut inner = lock(&sh.inner);
        if inner.state != QpState::Rts
            || !inner.sq.is_empty()
            || inner.sq_outstanding >= sh.caps.max_send_wr
            // A large payload goes from here only when it is the QP's only
            // request (one at a time, where the hand-off to the engine is
            // the latency). Behind others, the engine streams it from memory
            // as the socket drains, without a copy of what the socket did
            // not take, and without this thread holding the MR table meanwhile.
            || (from_memory && inner.sq_outstanding > 0)
            // So is a READ (also within max_rd_atomic and any fence then).
            || (read && inner.sq_outstanding > 0)
        {
            return None;
        }
        let remote_qpn = inner.cfg.remote_qpn;
        let timeout = ack_timeout_duration(inner.cfg.timeout);
        // Behind requests in flight (their ACKs, or the application's next
        // poll, bring a flush) a small request is corked, to go out with
        // the rest of its burst in one write.
        let cork = !from_memory && !read && inner.sq_outstanding > 0;
        let d = inner.direct.as_mut()?;
        let mut h = Header::new(Opcode::Send);
        h.dst_qpn = remote_qpn;
        h.src_qpn = sh.qpn;
        h.psn = d.next_psn;
        match w.op {
            SendOp::Read { remote_addr, rkey } => {
                h.opcode = Opcode::ReadReq;
                h.addr = remote_addr;
                h.rkey = rkey;
                h.arg0 = w.len;
                h.flags = FLAG_FIRST | FLAG_LAST;
            }
            _ => data_header(&mut h, &w, 0, w.len),
        }
        buf[..HEADER_LEN].copy_from_slice(&h.encode());
        let mut corked = None;
        let written = if from_memory {
            // (The last span lies in the last SGE of non-zero length.)
            let tail = w
                .sges
                .iter()
                .rev()
                .find(|s| s.length > 0)
                .map(|s| SpillTail {
                    qpn: sh.qpn,
                    lkey: s.lkey,
                    pd: sh.pd,
                    addr: s.addr + u64::from(s.length) - body.last().map_or(0, |b| b.len() as u64),
                });
            match tail {
                Some(tail) => d.wire.try_write_gather(&buf, &body, tail),
                None => d.wire.try_write(&buf).map(|r| (r, None)),
            }
        } else {
            match d.wire.try_write_or_cork(&buf, cork) {
                Some(Posted::Wrote(r)) => Some((r, None)),
                Some(Posted::Corked { first }) => {
                    corked = Some(first.then(|| d.wire.clone()));
                    Some((DirectWrite::Sent, None))
                }
                None => None,
            }
        };
        let (wrote, zc) = match written {
            Some(r) => r,
            None => {
                // The engine has output pending: from now on (until it
                // allows it again) WRs queue behind it, in order.
                inner.direct = None;
                sh.direct_hint.store(false, Ordering::Relaxed);
                return None;
            }
        };
        d.next_psn = psn_add(d.next_psn, 1);
        let psn = h.psn;
        let at = Instant::now();
        if zc.is_some() {
            ctx.direct_rest_in_memory.fetch_add(1, Ordering::Relaxed);
        }
        inner.sent.push_back(DirectSent { w, psn, at, zc });
        inner.sq_outstanding += 1;
        drop(inner);
        drop(body);
        drop(mrs);
        ctx.direct_sends.fetch_add(1, Ordering::Relaxed);
        if let Some(first) = corked {
            ctx.corked_sends.fetch_add(1, Ordering::Relaxed);
            if let Some(wire) = first {
                ctx.note_corked(&wire);
            }
        }
        ctx.notify_direct(sh, wrote == DirectWrite::Spilled, timeout, at);
        Some(Ok(()))
    })
}

#[cfg(test)]
#[path = "direct_tests.rs"]
mod tests;
