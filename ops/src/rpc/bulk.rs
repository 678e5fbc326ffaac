//! The large-message path, the rrppcc way: a message of at least
//! [`RpcConfig::read_threshold`](super::RpcConfig::read_threshold) bytes
//! travels as one packet carrying where its sender's registered copy is
//! (a [`BulkDesc`]), and the receiver copies it with one RDMA READ over
//! an RC link of the session.
//!
//! * The link: opened by the client on the session's first large message
//!   (large calls wait while it is set up, and stream if it is given up):
//!   a bulk connect carrying its RC
//!   endpoint, answered by the server's (the server connects its end
//!   then), then a confirmation that the client's end is connected,
//!   answered again; each step resent after `rto`, up to `max_retries`
//!   times, after which the session keeps to packets. Either side uses
//!   the link only once it is confirmed.
//! * A read request: the client exposes its copy of the request (kept
//!   exposed until the slot's next call or the session's end, so never
//!   withdrawn while the server may read it) and sends its descriptor.
//!   The server charges the whole length to its request memory *before*
//!   it reads (a claim past the budget is answered busy, as a streamed
//!   request's first packet is), READs it into a buffer of its own and
//!   runs the handler. A READ that fails (bad address, key or length, a
//!   link that broke) fails that request only, with
//!   [`Status::ReadFailed`], and closes the link (the client opens a new
//!   one for its next large message). While the READ runs, a resent read
//!   request is answered by a credit return (the server is alive), so
//!   the client's retry bound covers a server that vanished.
//! * A read response: the server exposes the handler's response (kept
//!   like a cached response, until the slot's next request or the
//!   session's end) and sends its descriptor; the client READs it. While
//!   it reads, the client resends its last request packet every `rto`
//!   and the server answers with the read response again: a server that
//!   vanished fails the call within the session's retry bound.

use std::task::Context;

use tracing::debug;

use super::bulk_write::{keep_spare, response_room, WRITE_TRAILER, WRITTEN_REQUEST_MAX};
use super::client::complete;
use super::core::{open_session, Core, ReadTarget};
use super::error::{RpcError, SessionId};
use super::header::{BulkDesc, Header, PacketKind, Status};
use super::session::{CallState, Link, LinkStep, Role, ServeState, Session, SESSION_SLOTS};
use super::transport::{Bulk, TransportError, TxBatch};

/// Whether a message of `len` bytes on a session of `max_payload`-byte
/// packets goes by READ or WRITE ([`Core::is_bulk`]), for callers holding
/// a session: `max_link_packet` is the transport's
/// ([`Bulk::max_link_packet`]), `has_bulk` whether it has a large-message
/// path.
pub(crate) fn goes_bulk(
    config: &super::config::RpcConfig,
    max_link_packet: usize,
    has_bulk: bool,
    len: usize,
    max_payload: usize,
) -> bool {
    if !has_bulk || config.read_threshold == usize::MAX {
        return false;
    }
    if len >= config.read_threshold {
        return true;
    }
    // Below the threshold, over the link by SEND when the session's
    // credits and the response window cover the message's packets, and
    // one link packet carries it (`link_send.rs`); else by READ or WRITE,
    // not in datagrams.
    let in_one_go = config.session_credits.min(config.response_window);
    len > max_payload
        && (len > max_link_packet.saturating_sub(super::header::HEADER_LEN)
            || super::header::packets_for(len, max_payload) > in_one_go)
}

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

/// Closes the session's link (its READs under way end in error).
pub(crate) fn close_link<P>(bulk: &mut Option<Box<dyn Bulk>>, s: &mut Session<P>) {
    if let (Some(l), Some(bulk)) = (s.link.take(), bulk.as_mut()) {
        bulk.close(l.local);
        // Room granted over it goes with it (`bulk_write.rs`).
        super::bulk_write::release_grants(bulk.as_mut(), s);
    }
}

/// Closes the session's link if it is `link` (an operation over an older
/// link, which the session replaced, failing later leaves the new one).
pub(crate) fn close_link_if<P>(bulk: &mut Option<Box<dyn Bulk>>, s: &mut Session<P>, link: u64) {
    if s.link.as_ref().is_some_and(|l| l.local == link) {
        close_link(bulk, s);
    }
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
    /// Whether messages of `len` bytes on a session of `max_payload`-byte
    /// packets go by READ or WRITE (when a link is ready): from the READ
    /// threshold on, and below it those larger than one link packet or
    /// with more packets than the session's credits or the response
    /// window cover (they would not go over the link in one go,
    /// `link_send.rs`).
    pub(crate) fn is_bulk(&self, len: usize, max_payload: usize) -> bool {
        goes_bulk(
            &self.config,
            self.max_link_packet(),
            self.bulk.is_some(),
            len,
            max_payload,
        )
    }

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
            Ok(addr) if addr.len() + super::header::HEADER_LEN <= self.max_packet => {
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
                    .unwrap_or(Err(TransportError::BadAddress {
                        len: payload.len(),
                        reason: "no RC link here",
                    }));
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

    /// Starts a READ of `len` bytes at `desc` over `link` into a buffer of
    /// the pool, for `target`; its token, or the error.
    fn start_read(
        &mut self,
        link: u64,
        desc: BulkDesc,
        len: usize,
        target: ReadTarget,
    ) -> Result<u64, TransportError> {
        let Some(bulk) = self.bulk.as_mut() else {
            return Err(TransportError::BadAddress {
                len: 0,
                reason: "no RC link here",
            });
        };
        let into = self.pool.take_for(len);
        let token = self.next_token;
        self.next_token += 1;
        match bulk.read(link, desc.addr, desc.rkey, len, into, token) {
            Ok(()) => {
                self.reads.insert(token, target);
                Ok(token)
            }
            Err((buf, error)) => {
                self.pool.put(buf);
                Err(error)
            }
        }
    }

    /// Server: a read request.
    pub(crate) fn on_read_request(&mut self, h: &Header, payload: &[u8]) {
        let sid = h.dest_session;
        let max_len = self.config.max_msg_len;
        let Some((desc, offer)) = BulkDesc::decode_offer(payload) else {
            self.stats.malformed_packets += 1;
            return;
        };
        let Some(s) = open_session(&mut self.sessions, &mut self.stats, h, Role::Server) else {
            return;
        };
        let link = s.link_ready();
        let msg_len = h.msg_len as usize;
        let i = (h.req_num % SESSION_SLOTS as u64) as usize;
        let slot = &mut s.server[i];
        if slot.state == ServeState::Idle || h.req_num > slot.req_num || slot.read_failed(h.req_num)
        {
            if slot.state == ServeState::Handling {
                self.stats.stale_packets += 1;
                return;
            }
            let status = if msg_len > max_len {
                self.stats.malformed_packets += 1;
                Some(Status::RequestTooLarge)
            } else if link.is_none() {
                Some(Status::ReadFailed)
            } else {
                None
            };
            if let Some(status) = status {
                slot.drop_partial();
                slot.req_num = h.req_num;
                slot.req_type = h.req_type;
                slot.msg_len = msg_len;
                slot.n_req = 1;
                self.refuse(sid, i, status);
                return;
            }
            // Charged before anything is read: a peer claiming large
            // requests gets no more memory than the budget.
            let mut charge = super::budget::Charge::default();
            if !self.budget.grow(&mut charge, msg_len, false) {
                super::server::budget_drop(&mut self.stats, &self.budget, sid, h);
                let busy = Header {
                    status: Status::Busy,
                    dest_session: s.remote,
                    src_session: sid,
                    req_num: h.req_num,
                    ..Header::new(PacketKind::CreditReturn)
                };
                self.tx.push(&s.peer, &busy, &[]);
                return;
            }
            let old_req = std::mem::take(&mut slot.req);
            let old_resp = slot.resp_exposed.take();
            slot.resp = None;
            slot.begin_request(h.req_num, h.req_type, msg_len, 1, false);
            slot.charge = charge;
            slot.writing = None;
            if offer > 0 {
                slot.offer = Some((h.req_num, desc, offer as usize));
            } else if slot.offer.is_some_and(|(n, _, _)| n != h.req_num) {
                // (An offer packet for this request, come first, stays.)
                slot.offer = None;
            }
            let req_num = h.req_num;
            self.pool.put(old_req);
            self.release_exposed(old_resp);
            let link = link.unwrap_or_default();
            let target = ReadTarget {
                sid,
                slot: i,
                req_num,
                link,
            };
            match self.start_read(link, desc, msg_len, target) {
                Ok(token) => {
                    if let Some(s) = self.sessions.get_mut(sid) {
                        s.server[i].reading = Some(token);
                    }
                }
                Err(error) => self.read_failed(sid, i, Role::Server, link, error),
            }
            return;
        } else if h.req_num < slot.req_num {
            self.stats.stale_packets += 1;
            return;
        }
        if h.req_type != slot.req_type || msg_len != slot.msg_len || slot.n_req != 1 {
            self.stats.malformed_packets += 1;
            return;
        }
        self.stats.duplicate_requests += 1;
        match slot.state {
            ServeState::Receiving | ServeState::Handling => {
                // Still reading, or the handler runs: the client waits.
                let h = Header {
                    dest_session: s.remote,
                    src_session: sid,
                    req_num: slot.req_num,
                    ..Header::new(PacketKind::CreditReturn)
                };
                self.tx.push(&s.peer, &h, &[]);
            }
            ServeState::Responded if slot.writing.is_some() => {
                // The response is being written: the client waits.
                let h = Header {
                    dest_session: s.remote,
                    src_session: sid,
                    req_num: slot.req_num,
                    ..Header::new(PacketKind::CreditReturn)
                };
                self.tx.push(&s.peer, &h, &[]);
            }
            ServeState::Responded => {
                super::server::send_response(
                    &mut self.tx,
                    &s.peer,
                    s.remote,
                    sid,
                    s.max_payload,
                    slot,
                    0,
                );
            }
            ServeState::Idle => self.stats.stale_packets += 1,
        }
    }

    /// Client: the server answered slot `i`'s read request with
    /// [`Status::ReadFailed`]: its end of the link is gone (a READ or
    /// WRITE over it failed, or it never had one), and no handler ran.
    /// The call closes this side's end, takes its request back from the
    /// transport and sends it again over a new link (or in packets, if
    /// none opens), once; returns false if it cannot (not a read request,
    /// or its second failure): the call fails then.
    pub(crate) fn read_failed_retry(&mut self, sid: u32, i: usize) -> bool {
        let now = self.now;
        let Some(s) = self.sessions.get_mut(sid) else {
            return false;
        };
        let slot = &mut s.client[i];
        if slot.awaits_link {
            // The answer to a resend of the first attempt: the call waits
            // for its new link already.
            self.stats.stale_packets += 1;
            return true;
        }
        let Some((_, len)) = slot.req_desc else {
            return false;
        };
        if slot.relinked {
            return false;
        }
        close_link(&mut self.bulk, s);
        let max_payload = s.max_payload;
        let slot = &mut s.client[i];
        slot.req_desc = None;
        slot.offered = 0;
        if let Some(token) = slot.offer_exposed.take() {
            // Offered at the old link: the new one gets a new offer.
            self.requests_exposed -= 1;
            if let Some(buf) = self.bulk.as_mut().and_then(|b| b.unexpose(token)) {
                self.pool.put(buf);
            }
        }
        let Some(token) = slot.req_exposed.take() else {
            return false;
        };
        self.requests_exposed -= 1;
        let Some(mut buf) = self.bulk.as_mut().and_then(|b| b.unexpose(token)) else {
            return false;
        };
        // (It spans the offered room: cut to the request.)
        buf.truncate(len);
        slot.req = buf;
        s.credits += slot.in_flight();
        slot.num_tx = 0;
        slot.num_rx = 0;
        slot.answered = 0;
        slot.n_req = super::header::packets_for(len, max_payload);
        slot.relinked = true;
        slot.retries = 0;
        slot.progress = now;
        self.stats.bulk_relinks += 1;
        self.want_link(sid);
        if let Some(s) = self.sessions.get_mut(sid) {
            if s.link_pending() {
                s.client[i].awaits_link = true;
            }
        }
        self.defer_pump(sid);
        true
    }

    /// Gives an exposed response's buffer back to the pool.
    pub(crate) fn release_exposed(&mut self, exposed: Option<(u64, BulkDesc, usize)>) {
        if let (Some((token, _, _)), Some(bulk)) = (exposed, self.bulk.as_mut()) {
            if let Some(buf) = bulk.unexpose(token) {
                self.pool.put(buf);
            }
        }
    }

    /// A READ of slot `i` of session `sid` failed or could not start: the
    /// request (server) or call (client) fails, and the link is closed.
    fn read_failed(&mut self, sid: u32, i: usize, role: Role, link: u64, error: TransportError) {
        self.stats.bulk_read_failures += 1;
        debug!(%error, session = sid, "rpc: RDMA READ failed");
        let Some(s) = self.sessions.get_mut(sid) else {
            return;
        };
        close_link_if(&mut self.bulk, s, link);
        match role {
            Role::Server => {
                let slot = &mut s.server[i];
                slot.reading = None;
                slot.charge.release();
                self.refuse(sid, i, Status::ReadFailed);
            }
            Role::Client => {
                s.client[i].reading = None;
                complete(s, i, Err(RpcError::Transport(error)));
            }
        }
    }

    /// Client: a read response.
    pub(crate) fn on_read_response(&mut self, h: &Header, payload: &[u8]) {
        let Some(desc) = BulkDesc::decode(payload) else {
            self.stats.malformed_packets += 1;
            return;
        };
        let Some(i) = self.answered_slot(h) else {
            return;
        };
        let sid = h.dest_session;
        let now = self.now;
        let max_len = self.config.max_msg_len;
        let Some(s) = self.sessions.get_mut(sid) else {
            return;
        };
        let link = s.link_to_read();
        if link.is_some() && s.client.iter().any(|c| c.awaits_link) {
            // This read response confirmed the link: the calls waiting
            // for it go.
            self.link_settled(sid);
        }
        let Some(s) = self.sessions.get_mut(sid) else {
            return;
        };
        let slot = &mut s.client[i];
        if slot.reading.is_some() || slot.n_resp > 0 {
            // Again (the answer to a resent packet): the server is alive.
            slot.progress = now;
            slot.retries = 0;
            self.stats.stale_packets += 1;
            return;
        }
        let msg_len = h.msg_len as usize;
        if msg_len > max_len {
            let e = RpcError::ResponseTooLarge {
                session: SessionId(sid),
                req_num: h.req_num,
                len: msg_len,
                max: max_len,
            };
            complete(s, i, Err(e));
            return;
        }
        // The server had the whole request: every request packet is
        // answered.
        let before = slot.in_flight();
        for k in slot.num_rx..slot.n_req {
            slot.answer(k);
        }
        s.credits += before - s.client[i].in_flight();
        let Some(link) = link else {
            let e = TransportError::BadAddress {
                len: 0,
                reason: "a read response on a session without an RC link",
            };
            self.read_failed(sid, i, Role::Client, 0, e);
            return;
        };
        let target = ReadTarget {
            sid,
            slot: i,
            req_num: h.req_num,
            link,
        };
        match self.start_read(link, desc, msg_len, target) {
            Ok(token) => {
                if let Some(s) = self.sessions.get_mut(sid) {
                    let slot = &mut s.client[i];
                    slot.reading = Some(token);
                    slot.n_resp = 1;
                    slot.resp_len = msg_len;
                    slot.progress = now;
                    slot.retries = 0;
                }
            }
            Err(error) => self.read_failed(sid, i, Role::Client, link, error),
        }
    }

    /// Whether the large-message path may have something to report: READs
    /// or WRITEs under way, or requests exposed (a WRITE with immediate
    /// may land in them).
    pub(crate) fn bulk_busy(&self) -> bool {
        !self.reads.is_empty() || !self.writes.is_empty() || self.requests_exposed > 0
    }

    /// Takes the READs and WRITEs that finished and the WRITEs with
    /// immediate that landed; registers `cx` for the next.
    pub(crate) fn poll_bulk(&mut self, cx: &mut Context<'_>) {
        if self.links_opened {
            self.poll_link_packets(cx);
        }
        // Completions before immediates: a server's response WRITE done
        // before its client's next request lands makes that buffer the
        // slot's next room (`bulk_write.rs`, `on_request_landed`).
        if let Some(bulk) = self.bulk.as_mut() {
            bulk.poll_done(cx, &mut self.bulk_done);
            if !self.bulk_done.is_empty() {
                let mut done = std::mem::take(&mut self.bulk_done);
                for (token, buf, result) in done.drain(..) {
                    self.on_read_done(token, buf, result);
                }
                self.bulk_done = done;
            }
        }
        self.poll_written(cx);
    }

    /// Polls the large-message path's operations once with the
    /// dispatcher's waker, so that one just started (a written request's
    /// WRITE) wakes the dispatcher when it completes, or when it can be
    /// posted if it waits for credits, without a run of the dispatcher
    /// for it now (a task run and a poll of every receive source, per
    /// call). What finished already stays in `bulk_done` for the
    /// dispatcher's next run, woken for it.
    pub(crate) fn arm_bulk_ops(&mut self) {
        let (Some(bulk), Some(w)) = (self.bulk.as_mut(), self.dispatcher.as_ref()) else {
            return;
        };
        bulk.poll_done(&mut Context::from_waker(w), &mut self.bulk_done);
        if !self.bulk_done.is_empty() {
            w.wake_by_ref();
        }
    }

    /// A READ finished.
    pub(crate) fn on_read_done(
        &mut self,
        token: u64,
        buf: Vec<u8>,
        result: Result<(), TransportError>,
    ) {
        if let Some(t) = self.writes.remove(&token) {
            self.on_write_done(token, t, buf, result);
            return;
        }
        let Some(t) = self.reads.remove(&token) else {
            self.pool.put(buf);
            return;
        };
        let Some(s) = self.sessions.get_mut(t.sid) else {
            self.pool.put(buf);
            return;
        };
        let role = s.role;
        let current = match role {
            Role::Server => {
                let slot = &s.server[t.slot];
                slot.req_num == t.req_num
                    && slot.state == ServeState::Receiving
                    && slot.reading == Some(token)
            }
            Role::Client => {
                let slot = &s.client[t.slot];
                slot.req_num == t.req_num
                    && matches!(slot.state, CallState::Active)
                    && slot.reading == Some(token)
            }
        };
        if !current {
            // The request or call ended meanwhile (dropped, timed out, the
            // session closed).
            self.pool.put(buf);
            return;
        }
        if let Err(error) = result {
            self.pool.put(buf);
            self.read_failed(t.sid, t.slot, role, t.link, error);
            return;
        }
        self.stats.bulk_reads += 1;
        match role {
            Role::Server => {
                let slot = &mut s.server[t.slot];
                slot.reading = None;
                let len = buf.len();
                let old = std::mem::replace(&mut slot.req, buf);
                slot.rx = 1;
                slot.got[0] = 1;
                self.pool.put(old);
                // The slot's next request may be written instead
                // (`bulk_write.rs`): room for it, before the handler
                // answers.
                self.grant_room(t.sid, t.slot, len);
                self.dispatch(t.sid, t.slot);
            }
            Role::Client => {
                s.resp_hint = buf.len();
                let slot = &mut s.client[t.slot];
                slot.reading = None;
                let old = std::mem::replace(&mut slot.resp, buf);
                slot.resp_got.clear();
                slot.resp_got.push(1);
                self.pool.put(old);
                complete(s, t.slot, Ok(()));
            }
        }
    }

    /// Client: exposes the request of slot `i` (in `slot.req`) for the
    /// server to READ; false (the request left in `slot.req`, to stream)
    /// if the session has no link or the buffer cannot be exposed.
    pub(crate) fn expose_request(&mut self, sid: u32, i: usize) -> bool {
        // Written into room the server granted, if it has some: one trip
        // (`bulk_write.rs`).
        if self.write_request(sid, i) {
            return true;
        }
        let Some(bulk) = self.bulk.as_mut() else {
            return false;
        };
        let Some(s) = self.sessions.get_mut(sid) else {
            return false;
        };
        let Some(link) = s.link_ready() else {
            return false;
        };
        // Room for the response too (`bulk_write.rs`): the request's
        // length or the session's last large response, whichever is more,
        // but at most twice the request (the room past the request is
        // zeroed when exposed: a call does not pay for a far larger one).
        let hint = s.resp_hint.min(self.config.max_msg_len);
        let hint_bulk = goes_bulk(
            &self.config,
            bulk.max_link_packet(),
            true,
            hint,
            s.max_payload,
        );
        let slot = &mut s.client[i];
        let len = slot.req.len();
        // A response more than twice as long gets room of its own
        // (`offer_room`).
        let separate = hint > 2 * len && hint_bulk;
        // (And the response WRITE's trailer, `RESP_TRAILER`.)
        let cap = if separate {
            len
        } else {
            response_room(len.max(hint))
        };
        match bulk.expose_writable(link, std::mem::take(&mut slot.req), cap) {
            Ok((token, addr, rkey)) => {
                slot.req_exposed = Some(token);
                self.requests_exposed += 1;
                if let Some(w) = &self.dispatcher {
                    // Its next turn polls the link for the response's
                    // immediate (registering for it: a new link's
                    // receives have no waker yet, and the dispatcher
                    // polls the path only while `bulk_busy`).
                    w.wake_by_ref();
                }
                slot.req_desc = Some((BulkDesc { addr, rkey }, len));
                slot.offered = cap as u32;
                if separate {
                    self.offer_room(sid, i);
                }
                true
            }
            Err((buf, error)) => {
                debug!(%error, "rpc: request not exposed; it streams");
                slot.req = buf;
                false
            }
        }
    }

    /// Client: takes slot `i`'s exposed request buffer back (at its next
    /// call: the last one ended, so the server reads it no more).
    pub(crate) fn take_back_request(&mut self, sid: u32, i: usize) {
        let Some(s) = self.sessions.get_mut(sid) else {
            return;
        };
        let slot = &mut s.client[i];
        slot.req_desc = None;
        slot.reading = None;
        slot.offered = 0;
        if std::mem::take(&mut slot.req_written) {
            // Written and never exposed (no resend was due): every byte
            // of it went to the server, so it is the slot's spare, as an
            // exposed request below.
            let buf = std::mem::take(&mut slot.req);
            let len = buf.len();
            keep_spare(&self.pool, slot, buf);
            slot.req = self.pool.take_for(len);
        }
        let Some(bulk) = self.bulk.as_mut() else {
            return;
        };
        if let Some(token) = slot.req_exposed.take() {
            self.requests_exposed -= 1;
            if let Some(mut buf) = bulk.unexpose(token) {
                if buf.len() <= WRITTEN_REQUEST_MAX + WRITE_TRAILER {
                    // The server could READ all of its bytes: kept whole
                    // as the room for the slot's next response (offered
                    // with no zeroing, `room_for_response`); the next
                    // request goes into a buffer of the pool (the spare
                    // before it, given back, as a rule).
                    let len = buf.len();
                    keep_spare(&self.pool, slot, buf);
                    slot.req = self.pool.take_for(len);
                } else {
                    // (It spans the offered room; the next request
                    // replaces its bytes.)
                    buf.clear();
                    slot.req = buf;
                }
            }
        }
        if let Some(token) = slot.offer_exposed.take() {
            self.requests_exposed -= 1;
            if let Some(buf) = bulk.unexpose(token) {
                self.pool.put(buf);
            }
        }
    }

    /// Server: exposes the response `buf` of slot `i` for the client to
    /// READ, if it is large and the session has a link; else gives it
    /// back, to stream.
    pub(crate) fn expose_response(&mut self, sid: u32, i: usize, buf: Vec<u8>) -> Option<Vec<u8>> {
        let max_payload = self.sessions.get(sid).map_or(0, |s| s.max_payload);
        if !self.is_bulk(buf.len(), max_payload) {
            return Some(buf);
        }
        let (Some(bulk), Some(s)) = (self.bulk.as_mut(), self.sessions.get_mut(sid)) else {
            return Some(buf);
        };
        if s.link_ready().is_none() {
            return Some(buf);
        }
        let len = buf.len();
        match bulk.expose(buf) {
            Ok((token, addr, rkey)) => {
                let slot = &mut s.server[i];
                slot.resp_exposed = Some((token, BulkDesc { addr, rkey }, len));
                None
            }
            Err((buf, error)) => {
                debug!(%error, "rpc: response not exposed; it streams");
                Some(buf)
            }
        }
    }

    /// Gives back what session `s` has exposed and closes its link (the
    /// session ends).
    pub(crate) fn release_session(&mut self, s: &mut Session<P>) {
        release_bulk(&mut self.bulk, &mut self.requests_exposed, &self.pool, s);
    }
}

/// Gives back what session `s` has exposed and closes its link (it ends,
/// or failed: nothing of it stays reachable by the peer).
pub(crate) fn release_bulk<P>(
    bulk: &mut Option<Box<dyn Bulk>>,
    requests_exposed: &mut usize,
    pool: &super::buf::BufPool,
    s: &mut Session<P>,
) {
    close_link(bulk, s);
    let Some(bulk) = bulk.as_mut() else {
        return;
    };
    for slot in &mut s.client {
        for token in [slot.req_exposed.take(), slot.offer_exposed.take()]
            .into_iter()
            .flatten()
        {
            *requests_exposed -= 1;
            drop(bulk.unexpose(token));
        }
    }
    for slot in &mut s.server {
        if let Some((token, _, _)) = slot.resp_exposed.take() {
            if let Some(buf) = bulk.unexpose(token) {
                pool.put(buf);
            }
        }
    }
}
