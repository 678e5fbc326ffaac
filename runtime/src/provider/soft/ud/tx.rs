//! Sending datagrams: resolving the address handle, encoding the packet
//! (fault injection applied), and completing the WR once the packet left,
//! in the engine's fill of a connection or on the posting thread.

use std::cell::RefCell;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::super::ah::AhEntry;
use super::super::context::Shared;
use super::super::cq::{CqShared, Push};
use super::super::dma::{check_local, gather};
use super::super::engine::EQp;
use super::super::lock;
use super::super::mr::MrTable;
use super::super::packet::{Header, Opcode, FLAG_FIRST, FLAG_LAST, FLAG_SOLICITED};
use super::super::qp::{Qp, SendWqe};
use super::super::requester::Gen;
use super::super::wire::DirectWrite;
use super::Fate;
use crate::provider::{
    AhHandle, Completion, PostError, QpState, SendFlags, SendOp, SendWr, WcStatus,
};

/// The route of a live address handle of protection domain `pd`.
pub(crate) fn resolve(sh: &Shared, ah: AhHandle, pd: u32) -> Option<AhEntry> {
    lock(&sh.ahs).get(&ah.0).copied().filter(|e| e.pd == pd)
}

/// The header of the datagram `w` (a `SendTo`) from QP `src_qpn`.
fn header(w: &SendWqe, src_qpn: u32, psn: u32, hop_limit: u8) -> Option<Header> {
    let SendOp::SendTo { dest, imm } = w.op else {
        return None;
    };
    let mut h = Header::new(if imm.is_some() {
        Opcode::DatagramImm
    } else {
        Opcode::Datagram
    });
    h.payload_len = w.len as u32;
    h.dst_qpn = dest.remote_qpn;
    h.src_qpn = src_qpn;
    h.psn = psn;
    h.flags = FLAG_FIRST | FLAG_LAST;
    if w.flags.contains(SendFlags::SOLICITED) {
        h.flags |= FLAG_SOLICITED;
    }
    h.imm = imm.unwrap_or(0);
    h.rkey = dest.remote_qkey;
    h.arg0 = u64::from(hop_limit);
    Some(h)
}

/// Appends the datagram `h` + payload of `w` to `out` (twice for a
/// duplicate; not at all for a drop). False if its memory is not readable.
fn append(
    out: &mut Vec<u8>,
    h: &Header,
    w: &SendWqe,
    pd: u32,
    mrs: Option<&MrTable>,
    fate: Fate,
) -> bool {
    if fate == Fate::Drop {
        return true;
    }
    let at = out.len();
    out.extend_from_slice(&h.encode());
    let ok = match (&w.inline, mrs) {
        (Some(bytes), _) => {
            out.extend_from_slice(bytes);
            true
        }
        (None, Some(mrs)) => gather(&w.sges, pd, mrs, 0, w.len, out),
        (None, None) => false,
    };
    if !ok {
        out.truncate(at);
        return false;
    }
    if fate == Fate::Duplicate {
        out.extend_from_within(at..);
    }
    true
}

/// Engine: encodes the front datagram of UD QP `eq` into `tx`, the
/// transmit buffer of the connection to `peer`, and completes it. `Moved`
/// if it goes to another engine.
pub(crate) fn gen_datagram(
    eq: &mut EQp,
    sh: &Shared,
    peer: Option<SocketAddr>,
    tx: &mut Vec<u8>,
    mrs: &MrTable,
) -> Gen {
    if eq.sh.state() != QpState::Rts {
        return Gen::Idle;
    }
    let Some(front) = eq.wqes.front() else {
        return Gen::Idle;
    };
    let pd = eq.sh.pd;
    let route = match front.w.op {
        SendOp::SendTo { dest, .. } => resolve(sh, dest.ah, pd),
        _ => None,
    };
    let Some(route) = route else {
        // A dead address handle (or one of another PD): as rxe.
        tracing::debug!(
            qpn = eq.sh.qpn,
            "soft engine: datagram with no live address handle"
        );
        eq.fail(Some(WcStatus::LocQpOpErr));
        return Gen::Idle;
    };
    if peer != Some(route.addr) {
        return Gen::Moved;
    }
    if front.w.inline.is_none() && !check_local(&front.w.sges, pd, mrs, false) {
        eq.fail(Some(WcStatus::LocProtErr));
        return Gen::Idle;
    }
    let psn = eq.sh.next_ud_psn();
    let Some(h) = header(&front.w, eq.sh.qpn, psn, route.hop_limit) else {
        eq.fail(Some(WcStatus::LocQpOpErr));
        return Gen::Idle;
    };
    let fate = sh.ud.fate();
    if !append(tx, &h, &front.w, pd, Some(mrs), fate) {
        eq.fail(Some(WcStatus::LocProtErr));
        return Gen::Idle;
    }
    sh.ud.count_sent(fate);
    let len = front.w.len as u32;
    eq.complete_front(WcStatus::Success, len);
    Gen::Sent
}

thread_local! {
    /// Packet being built (reused: no allocation per post).
    static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Posting thread: transmits the datagram `wr` itself if the engine has
/// nothing queued for this QP and a connection to the destination is idle.
/// `None`: not possible; queue it as usual (which also reports any error).
///
/// # Safety
///
/// The contract of [`Qp::post_send`] holds for `wr`.
pub(crate) unsafe fn post_direct(qp: &Qp, wr: &SendWr) -> Option<Result<(), PostError>> {
    let sh = &qp.0.shared;
    let ctx = qp.0.ctx.shared();
    // SAFETY: forwarded contract.
    let w = unsafe { qp.check_send(wr) }.ok()?;
    let SendOp::SendTo { dest, .. } = w.op else {
        return None;
    };
    let route = resolve(ctx, dest.ah, sh.pd)?;
    // (Loopback datagrams go through the engine.)
    let wire = lock(&ctx.wires).get(&route.addr).cloned()?;
    SCRATCH.with(|scratch| {
        let mut buf = scratch.try_borrow_mut().ok()?;
        buf.clear();
        let fate = {
            let mut inner = lock(&sh.inner);
            if inner.state != QpState::Rts || !inner.sq.is_empty() || !inner.ud_direct {
                return None;
            }
            let h = header(&w, sh.qpn, sh.next_ud_psn(), route.hop_limit)?;
            let fate = ctx.ud.fate();
            let ok = if w.inline.is_some() {
                append(&mut buf, &h, &w, sh.pd, None, fate)
            } else {
                // (The engine takes the QP lock under the MR-table lock,
                // never the other way round: the memory is read with the
                // QP lock released.)
                drop(inner);
                let mrs = ctx.mrs();
                let ok = append(&mut buf, &h, &w, sh.pd, Some(&mrs), fate);
                drop(mrs);
                inner = lock(&sh.inner);
                ok && inner.state == QpState::Rts && inner.sq.is_empty() && inner.ud_direct
            };
            if !ok {
                // An unreadable SGE: the engine fails the WR.
                return None;
            }
            let wrote = if fate == Fate::Drop {
                DirectWrite::Sent
            } else {
                match wire.try_write(&buf) {
                    Some(r) => r,
                    None => {
                        // The engine writes to this connection: from now on
                        // (until it allows it again) WRs queue behind it.
                        inner.ud_direct = false;
                        sh.direct_hint.store(false, Ordering::Relaxed);
                        return None;
                    }
                }
            };
            drop(inner);
            if wrote == DirectWrite::Spilled {
                ctx.ring();
            }
            fate
        };
        ctx.ud.count_sent(fate);
        if w.flags.contains(SendFlags::SIGNALED) {
            let wc = Completion {
                wr_id: w.wr_id,
                status: WcStatus::Success,
                opcode: w.op.completion_opcode(),
                byte_len: w.len as u32,
                qp_num: sh.qpn,
                ..Completion::EMPTY
            };
            deliver(ctx, &sh.send_cq, wc);
        }
        Some(Ok(()))
    })
}

/// Posting thread: puts a completion on `cq` and raises its channel event
/// at once (the engine does it at the end of its loop turn for its own).
fn deliver(ctx: &Shared, cq: &Arc<CqShared>, wc: Completion) {
    match cq.push(wc, true) {
        Push::Fired => cq.signal(None),
        Push::Overflowed => {
            // (The list first, then the flag: the engine takes the list
            // after it saw the flag.)
            lock(&ctx.overflowed).push(cq.clone());
            ctx.any_overflowed.store(true, Ordering::Relaxed);
            ctx.ring();
        }
        Push::Queued | Push::Lost => {}
    }
}
