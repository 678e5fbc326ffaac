//! A session's RC link for the large-message path: opened by the client
//! on the session's first large message (a bulk connect carrying its RC
//! endpoint, answered by the server's, then a confirmation, answered
//! again; each step resent after `rto`, up to `max_retries` times, after
//! which the session keeps to packets). Either side uses the link only
//! once it is confirmed.

use tracing::debug;

use crate::rpc::header::{Header, PacketKind, HEADER_LEN};
use crate::rpc::session::{CallState, Link, LinkStep, Role, Session};
use crate::rpc::transport::{Bulk, TransportError, TxBatch};

use super::receive::open_session;
use super::release::close_link;
use super::Core;

/// Sends the bulk connect of the client's current link step.
fn send_bulk_connect<P: Clone>(tx: &mut TxBatch<P>, s: &Session<P>, sid: u32) {
    let Some(l) = &s.link else {
        return;
    };
    let h = Header {
        dest_session: s.remote,
        src_session: sid,
        req_num: l.id,
        pkt_idx: u16::from(l.step == LinkStep::Confirming),
        payload_len: l.addr.len() as u16,
        ..Header::new(PacketKind::BulkConnect)
    };
    tx.push(&s.peer, &h, &l.addr);
}

/// Client timer: resends the link's current step after `rto`; after
/// `max_retries` the session keeps to packets. Returns whether the link
/// is still being set up (the timer stays armed).
pub(crate) fn link_tick<P: Clone>(
    bulk: &mut Option<Box<dyn Bulk>>,
    tx: &mut TxBatch<P>,
    s: &mut Session<P>,
    sid: u32,
    now: u64,
    rto: u64,
    max_retries: u32,
) -> bool {
    let Some(l) = &mut s.link else {
        return false;
    };
    if !matches!(l.step, LinkStep::Opening | LinkStep::Confirming) {
        return false;
    }
    if now - l.last < rto {
        return true;
    }
    if l.retries >= max_retries {
        debug!(
            session = sid,
            "rpc: the server did not open an RC link; large messages stay in packets"
        );
        close_link(bulk, s);
        s.link_refused = true;
        return false;
    }
    l.retries += 1;
    l.last = now;
    debug!(session = sid, retries = l.retries, step = ?l.step, "rpc: RC link step resent");
    send_bulk_connect(tx, s, sid);
    true
}

impl<P: Clone> Core<P> {
    /// Client: asks for session `sid`'s RC link, unless it has one, asked
    /// for one, or its server did not answer.
    pub(crate) fn want_link(&mut self, sid: u32) {
        let Some(bulk) = self.bulk.as_mut() else {
            return;
        };
        let Some(s) = self.sessions.get_mut(sid) else {
            return;
        };
        if s.role != Role::Client || s.link.is_some() || s.link_refused {
            return;
        }
        // The session in the low bits (`bulk_write::link_session`).
        let local = (self.next_link << 32) | u64::from(sid);
        self.next_link += 1;
        match bulk.open(local) {
            Ok(addr) if addr.len() + HEADER_LEN <= self.max_packet => {
                s.link = Some(Link {
                    local,
                    id: local,
                    addr,
                    step: LinkStep::Opening,
                    retries: 0,
                    last: self.now,
                });
                debug!(session = sid, "rpc: opening an RC link");
                send_bulk_connect(&mut self.tx, s, sid);
                self.want_timer();
                self.link_opened();
            }
            Ok(_) => {
                bulk.close(local);
                s.link_refused = true;
            }
            Err(error) => {
                debug!(%error, session = sid, "rpc: no RC link; large messages stay in packets");
                s.link_refused = true;
            }
        }
    }

    /// Server: a bulk connect (open, or confirm).
    pub(crate) fn on_bulk_connect(&mut self, h: &Header, payload: &[u8]) {
        let sid = h.dest_session;
        let willing = self.config.read_threshold != usize::MAX;
        let Core {
            bulk,
            sessions,
            stats,
            tx,
            next_link,
            ..
        } = self;
        let mut opened = false;
        let Some(s) = open_session(sessions, stats, h, Role::Server) else {
            return;
        };
        if bulk.is_none() || !willing {
            // No link here: the client keeps to packets after its retries.
            stats.stale_packets += 1;
            return;
        }
        match &mut s.link {
            Some(l) if l.id == h.req_num => {
                if h.pkt_idx == 1 {
                    l.step = LinkStep::Ready;
                }
            }
            _ if h.pkt_idx == 1 => {
                // A confirmation of a link this side does not have.
                stats.stale_packets += 1;
                return;
            }
            _ => {
                // A new link (the client's last one broke): replaces it.
                close_link(bulk, s);
                let Some(b) = bulk.as_mut() else {
                    return;
                };
                // The session in the low bits, as a client's
                // (`bulk_write::link_session`).
                let local = (*next_link << 32) | u64::from(sid);
                *next_link += 1;
                let addr = match b.open(local) {
                    Ok(addr) => addr,
                    Err(error) => {
                        debug!(%error, session = sid, "rpc: could not open an RC link");
                        return;
                    }
                };
                if let Err(error) = b.connect(local, payload) {
                    stats.malformed_packets += 1;
                    debug!(%error, session = sid, "rpc: bulk connect to an address that does not connect");
                    b.close(local);
                    return;
                }
                debug!(session = sid, "rpc: opened an RC link for a client");
                s.link = Some(Link {
                    local,
                    id: h.req_num,
                    addr,
                    step: LinkStep::Offered,
                    retries: 0,
                    last: 0,
                });
                opened = true;
            }
        }
        let Some(l) = &s.link else {
            return;
        };
        let ack = Header {
            dest_session: s.remote,
            src_session: sid,
            req_num: h.req_num,
            pkt_idx: h.pkt_idx,
            payload_len: l.addr.len() as u16,
            ..Header::new(PacketKind::BulkConnectAck)
        };
        tx.push(&s.peer, &ack, &l.addr);
        if opened {
            self.link_opened();
        }
    }

    /// Client: the answer to a bulk connect.
    pub(crate) fn on_bulk_connect_ack(&mut self, h: &Header, payload: &[u8]) {
        let sid = h.dest_session;
        let now = self.now;
        let Core {
            bulk,
            sessions,
            stats,
            tx,
            ..
        } = self;
        let Some(s) = open_session(sessions, stats, h, Role::Client) else {
            return;
        };
        let Some(l) = s.link.as_mut().filter(|l| l.id == h.req_num) else {
            stats.stale_packets += 1;
            return;
        };
        let settled = match (l.step, h.pkt_idx) {
            (LinkStep::Opening, 0) => {
                let local = l.local;
                let connected = bulk
                    .as_mut()
                    .map(|b| b.connect(local, payload))
                    .unwrap_or(Err(TransportError::bad_address(
                        payload.len(),
                        "no RC link here",
                    )));
                if let Err(error) = connected {
                    stats.malformed_packets += 1;
                    debug!(%error, session = sid, "rpc: the server's RC endpoint does not connect; large messages stay in packets");
                    close_link(bulk, s);
                    s.link_refused = true;
                    true
                } else {
                    l.step = LinkStep::Confirming;
                    l.retries = 0;
                    l.last = now;
                    send_bulk_connect(tx, s, sid);
                    false
                }
            }
            (LinkStep::Confirming, 1) => {
                l.step = LinkStep::Ready;
                true
            }
            _ => {
                stats.stale_packets += 1;
                false
            }
        };
        if settled {
            self.link_settled(sid);
        }
    }

    /// Client: session `sid`'s link is ready or given up: the calls that
    /// waited for it go, large ones by READ, mid-size ones by SEND over
    /// the link (the pump), or (no link) streamed.
    pub(crate) fn link_settled(&mut self, sid: u32) {
        let now = self.now;
        let Some(s) = self.sessions.get_mut(sid) else {
            return;
        };
        debug!(
            session = sid,
            ready = s.link_ready().is_some(),
            "rpc: RC link settled"
        );
        let mut waited = 0u32;
        for (i, slot) in s.client.iter_mut().enumerate() {
            if slot.awaits_link && matches!(slot.state, CallState::Active) {
                slot.awaits_link = false;
                slot.progress = now;
                slot.retries = 0;
                waited |= 1 << i;
            }
        }
        if waited == 0 {
            return;
        }
        let max_payload = s.max_payload;
        while waited != 0 {
            let i = waited.trailing_zeros() as usize;
            waited &= waited - 1;
            // A mid-size call that waited goes over the link by SEND
            // (`link_send.rs`, the pump), not by READ.
            let len = self.sessions.get(sid).map_or(0, |s| s.client[i].req.len());
            if self.is_bulk(len, max_payload) && self.expose_request(sid, i) {
                if let Some(s) = self.sessions.get_mut(sid) {
                    s.client[i].n_req = 1;
                }
            }
        }
        self.defer_pump(sid);
    }
}
