//! The packets built from a session's and a slot's state: a client's
//! request and request-for-response packets, a server's credit returns
//! and responses, and the packets that carry nothing but the session
//! numbers (pings, disconnects). Shared by the jobs that send them (first
//! sends and resends).

use crate::rpc::header::{Header, PacketKind, BULK_DESC_LEN, MAX_RANGE};
use crate::rpc::session::{ClientSlot, ServerSlot, Session};
use crate::rpc::transport::TxBatch;

use super::PendingAck;

/// Sends client packet `k` of `slot`: request packet `k`, or past the
/// request the request for response packet `k - n_req + 1` (and, in the
/// same packet, for the `more` response packets after it: client packets
/// `k + 1 ..= k + more`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn send_client_packet<P: Clone>(
    tx: &mut TxBatch<P>,
    s_peer: &P,
    remote: u32,
    local: u32,
    max_payload: usize,
    slot: &ClientSlot,
    k: usize,
    more: usize,
) {
    if let (true, Some((desc, len))) = (k < slot.n_req, &slot.req_desc) {
        let h = Header {
            req_type: slot.req_type,
            payload_len: BULK_DESC_LEN as u16,
            dest_session: remote,
            src_session: local,
            req_num: slot.req_num,
            msg_len: *len as u32,
            pkt_count: 1,
            ..Header::new(PacketKind::ReadRequest)
        };
        // (An offer of a buffer of its own went in an offer packet.)
        let offered = if slot.offer_exposed.is_some() {
            0
        } else {
            slot.offered
        };
        tx.push(s_peer, &h, &desc.encode_offer(offered));
    } else if k < slot.n_req {
        let start = k * max_payload;
        let end = (start + max_payload).min(slot.req.len());
        let h = Header {
            req_type: slot.req_type,
            payload_len: (end - start) as u16,
            dest_session: remote,
            src_session: local,
            req_num: slot.req_num,
            msg_len: slot.req.len() as u32,
            pkt_idx: k as u16,
            pkt_count: slot.n_req as u16,
            ..Header::new(PacketKind::Request)
        };
        tx.push(s_peer, &h, &slot.req[start..end]);
    } else {
        let h = Header {
            dest_session: remote,
            src_session: local,
            req_num: slot.req_num,
            pkt_idx: (k - slot.n_req + 1) as u16,
            pkt_count: more as u16,
            ..Header::new(PacketKind::RequestForResponse)
        };
        tx.push(s_peer, &h, &[]);
    }
}

/// Sends a credit return for request packet `idx` of `slot`.
pub(crate) fn send_credit_return<P: Clone>(
    tx: &mut TxBatch<P>,
    peer: &P,
    remote: u32,
    local: u32,
    slot: &ServerSlot,
    idx: u16,
) {
    let h = Header {
        dest_session: remote,
        src_session: local,
        req_num: slot.req_num,
        pkt_idx: idx,
        ..Header::new(PacketKind::CreditReturn)
    };
    tx.push(peer, &h, &[]);
}

/// Sends response packet `j` of `slot` (which holds its response), or
/// its read response if the response is exposed.
pub(crate) fn send_response<P: Clone>(
    tx: &mut TxBatch<P>,
    peer: &P,
    remote: u32,
    local: u32,
    max_payload: usize,
    slot: &ServerSlot,
    j: usize,
) {
    if let Some((_, desc, len)) = &slot.resp_exposed {
        let h = Header {
            payload_len: BULK_DESC_LEN as u16,
            dest_session: remote,
            src_session: local,
            req_num: slot.req_num,
            msg_len: *len as u32,
            pkt_count: 1,
            ..Header::new(PacketKind::ReadResponse)
        };
        tx.push(peer, &h, &desc.encode());
        return;
    }
    let Some(resp) = &slot.resp else {
        return;
    };
    let start = j * max_payload;
    let end = (start + max_payload).min(resp.len());
    let h = Header {
        req_type: slot.req_type,
        status: slot.status,
        payload_len: (end - start) as u16,
        dest_session: remote,
        src_session: local,
        req_num: slot.req_num,
        msg_len: resp.len() as u32,
        pkt_idx: j as u16,
        pkt_count: slot.n_resp as u16,
        ..Header::new(PacketKind::Response)
    };
    tx.push(peer, &h, &resp[start..end]);
}

/// Adds request packet `idx` to the acknowledgements of this batch: to
/// the run it extends, or as a new one.
pub(crate) fn queue_ack(acks: &mut Vec<PendingAck>, sid: u32, slot: usize, req_num: u64, idx: u16) {
    let run = acks
        .iter_mut()
        .rev()
        .find(|a| a.sid == sid && a.slot == slot);
    match run {
        Some(a)
            if a.req_num == req_num
                && idx.checked_sub(1) == Some(a.last)
                && usize::from(idx - a.first) < MAX_RANGE =>
        {
            a.last = idx;
        }
        _ => acks.push(PendingAck {
            sid,
            slot,
            req_num,
            first: idx,
            last: idx,
        }),
    }
}

/// Sends a packet of `kind` that carries nothing but the session numbers
/// (a ping, a disconnect) to the peer of session `s` (numbered `sid`).
pub(crate) fn send_bare<P: Clone>(tx: &mut TxBatch<P>, s: &Session<P>, sid: u32, kind: PacketKind) {
    let h = Header {
        dest_session: s.remote,
        src_session: sid,
        ..Header::new(kind)
    };
    tx.push(&s.peer, &h, &[]);
}
