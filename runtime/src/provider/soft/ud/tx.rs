//! Sending datagrams: resolving the address handle, encoding the packet
//! (fault injection applied), and completing the WR once the packet left,
//! in the engine's fill of a connection (the posting thread's way is in
//! `direct.rs`).

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
use super::super::qp::SendWqe;
use super::super::requester::Gen;
use super::Fate;
use crate::provider::{AhHandle, Completion, QpState, SendFlags, SendOp, WcStatus};

/// The route of a live address handle of protection domain `pd`.
/// (The destination engine's address as one to connect to, see
/// `engine::dial::reachable`.)
pub(crate) fn resolve(sh: &Shared, ah: AhHandle, pd: u32) -> Option<AhEntry> {
    lock(&sh.ahs)
        .get(&ah.0)
        .copied()
        .filter(|e| e.pd == pd)
        .map(|e| AhEntry {
            addr: crate::provider::soft::engine::dial::reachable(e.addr),
            ..e
        })
}

/// The header of the datagram `w` (a `SendTo`) from QP `src_qpn`.
pub(super) fn header(w: &SendWqe, src_qpn: u32, psn: u32, hop_limit: u8) -> Option<Header> {
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
pub(super) fn append(
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
/// if it goes to another engine, `Wait` while the connection is not
/// established (a datagram completes once it left; if the connection
/// fails, it is lost).
pub(crate) fn gen_datagram(
    eq: &mut EQp,
    sh: &Shared,
    peer: Option<SocketAddr>,
    connected: bool,
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
    if !connected {
        return Gen::Wait;
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

/// Posting thread: puts a completion on `cq` and raises its channel event
/// at once (the engine does it at the end of its loop turn for its own).
pub(super) fn deliver(ctx: &Shared, cq: &Arc<CqShared>, wc: Completion) {
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
