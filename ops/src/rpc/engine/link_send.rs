//! Mid-size messages over the session's RC link by SEND: a request or
//! response larger than one datagram and below the READ threshold goes
//! as one packet over the link, when the session has one ready, instead
//! of one datagram per packet.
//!
//! * What it carries: the message's packets `0..pkt_count` all at once:
//!   one header (`pkt_idx` 0, the `pkt_count` the session's packet size
//!   gives, as in packets) and the whole message as its payload. The
//!   receiver takes it as those packets, each through the datagram path
//!   (`on_request`, `on_response`), so everything else stays as it is:
//!   credits (the client takes one per packet), duplicates, the cached
//!   response, and retransmission, which resends single packets by
//!   datagram: a link that breaks (its SEND fails, or the peer's end
//!   closed) loses nothing, the packets go again after `rto`, and the
//!   engine closes the link on hearing of it (the client's next large
//!   call opens a new one).
//! * When: the client sends a request so when its link is ready, once
//!   the session's credits cover all its packets (it waits for them
//!   rather than streaming on a part); a server a response so when the
//!   session's link is ready and the response fits its response window
//!   (the client counts those packets as sent unasked). The client asks
//!   for the link on its session's first message larger than a datagram;
//!   the session's mid-size calls wait while it is set up, and go in
//!   packets only if it is given up. (Streamed, a window of them at a
//!   session's start was hundreds of datagrams at once: on rxe they
//!   overflowed the send queue, and each loss cost a timeout.)
//! * Memory: the packets land in one pool of receive buffers for all the
//!   links of the endpoint ([`Bulk::link_recv_memory`]:
//!   on UD a shared receive queue of rings of 64 buffers of 32 KiB, one
//!   ring per 8 links open, at most 4), charged to `request_memory` as
//!   the rings are posted, bounded whatever the number of peers; a
//!   buffer is reposted as soon as its packet is taken. A packet over a
//!   link is checked as a datagram is, and besides must name the session
//!   the link belongs to (in its role), start at packet 0 and carry the
//!   whole message: anything else is dropped and counted malformed (or
//!   stale, for a link closed since), never failing the session.

use std::task::Context;

use tracing::trace;

use crate::rpc::header::{packets_for, Header, PacketKind, HEADER_LEN};
use crate::rpc::session::Role;
use crate::rpc::transport::Bulk;

use super::release::close_link;
use super::{Core, RpcStats};

/// Sends `head` and `payload` (a whole message) over `link`: whether it
/// went (else it goes in datagrams, and the link, which failed, is closed
/// at the next poll: `broken`).
pub(crate) fn send_whole(
    bulk: &mut Option<Box<dyn Bulk>>,
    stats: &mut RpcStats,
    broken: &mut Vec<u64>,
    link: u64,
    head: &Header,
    payload: &[u8],
) -> bool {
    let Some(bulk) = bulk.as_mut() else {
        return false;
    };
    let mut bytes = [0u8; HEADER_LEN];
    head.encode_into(&mut bytes);
    match bulk.send_packet(link, &bytes, payload) {
        Ok(()) => {
            stats.link_packets_sent += 1;
            true
        }
        Err(error) => {
            trace!(%error, link, "rpc: a packet could not go over the link; in datagrams");
            broken.push(link);
            false
        }
    }
}

impl<P: Clone> Core<P> {
    /// Client: the mid-size call of slot `i` waits while session `sid`'s
    /// link is set up (`link_settled` sends it then, over the link or, if
    /// the link was given up, in packets): a window of such calls at a
    /// session's start would otherwise all stream at once, hundreds of
    /// datagrams where the link carries one SEND each.
    pub(crate) fn await_link(&mut self, sid: u32, i: usize) {
        if let Some(s) = self.sessions.get_mut(sid) {
            if s.link_pending() {
                s.client[i].awaits_link = true;
            }
        }
    }

    /// A link was opened: its receives are polled from now on, and the
    /// links' receive buffers charged to the request memory (as many as
    /// the transport keeps now: it may post more as links open).
    pub(crate) fn link_opened(&mut self) {
        self.links_opened = true;
        let bytes = self.bulk.as_ref().map_or(0, |b| b.link_recv_memory());
        let more = bytes.saturating_sub(self.link_recv_bytes);
        // Forced: the buffers exist whatever the budget says; requests
        // have that much less room.
        if more > 0 && self.budget.grow(&mut self.link_recv_charge, more, true) {
            self.link_recv_bytes = bytes;
        }
    }

    /// Takes the packets that came over links and closes the links whose
    /// sends failed; registers `cx`.
    pub(crate) fn poll_link_packets(&mut self, cx: &mut Context<'_>) {
        let Some(bulk) = self.bulk.as_mut() else {
            return;
        };
        bulk.poll_received(cx, &mut self.link_rx, &mut self.links_broken);
        if !self.links_broken.is_empty() {
            let broken = std::mem::take(&mut self.links_broken);
            for &link in &broken {
                self.close_broken_link(link);
            }
            self.links_broken = broken;
            self.links_broken.clear();
        }
        if self.link_rx.is_empty() {
            return;
        }
        let mut rx = std::mem::take(&mut self.link_rx);
        for (link, packet) in rx.drain(..) {
            self.on_link_packet(link, packet.as_slice());
        }
        self.link_rx = rx;
    }

    /// Closes the link numbered `link` here, whichever session holds it.
    fn close_broken_link(&mut self, link: u64) {
        for index in 0..self.sessions.capacity() {
            let Some((_, s)) = self.sessions.at_mut(index) else {
                continue;
            };
            if s.link.as_ref().is_some_and(|l| l.local == link) {
                close_link(&mut self.bulk, s);
                return;
            }
        }
    }

    /// A packet over `link`: a whole request (server) or response
    /// (client), taken as its packets.
    pub(crate) fn on_link_packet(&mut self, link: u64, packet: &[u8]) {
        self.stats.link_packets_received += 1;
        let Ok((h, payload)) = Header::decode(packet) else {
            self.stats.malformed_packets += 1;
            return;
        };
        let role = match h.kind {
            PacketKind::Request => Role::Server,
            PacketKind::Response => Role::Client,
            _ => {
                self.stats.malformed_packets += 1;
                return;
            }
        };
        let Some(s) = self.sessions.get(h.dest_session) else {
            self.stats.stale_packets += 1;
            return;
        };
        if s.role != role || s.link.as_ref().map(|l| l.local) != Some(link) {
            // Another session's, or a link closed since.
            self.stats.stale_packets += 1;
            return;
        }
        let max_payload = s.max_payload;
        let msg_len = h.msg_len as usize;
        let n = usize::from(h.pkt_count);
        if h.pkt_idx != 0 || payload.len() != msg_len || n != packets_for(msg_len, max_payload) {
            self.stats.malformed_packets += 1;
            return;
        }
        if role == Role::Server && self.whole_request(&h, payload) {
            // Taken whole (`Core::whole_request`): no packet by packet.
            return;
        }
        for k in 0..n {
            let start = k * max_payload;
            let chunk = &payload[start..(start + max_payload).min(msg_len)];
            let sub = Header {
                pkt_idx: k as u16,
                payload_len: chunk.len() as u16,
                ..h
            };
            match role {
                Role::Server => self.on_request(&sub, chunk),
                Role::Client => self.on_response(&sub, chunk),
            }
        }
    }
}
