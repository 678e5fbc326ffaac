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

use tracing::debug;

use crate::rpc::budget::Charge;
use crate::rpc::error::RpcError;
use crate::rpc::header::{packets_for, BulkDesc, Header, Status};
use crate::rpc::session::{slot_of, CallState, Role, ServeState};
use crate::rpc::transport::TransportError;

use super::call_end::{complete, fail_too_large};
use super::packets::{send_credit_return, send_response};
use super::paths::goes_bulk;
use super::receive::open_session;
use super::release::{close_link, close_link_if};
use super::server_requests::send_busy;
use super::write_format::response_room;
use super::{Core, ReadTarget};

impl<P: Clone> Core<P> {
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
            return Err(TransportError::bad_address(0, "no RC link here"));
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
        let i = slot_of(h.req_num);
        let slot = &mut s.server[i];
        if slot.takes_new(h.req_num) {
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
                slot.take_refused(h.req_num, h.req_type, msg_len, 1);
                self.refuse(sid, i, status);
                return;
            }
            // Charged before anything is read: a peer claiming large
            // requests gets no more memory than the budget.
            let mut charge = Charge::default();
            if !self.budget.grow(&mut charge, msg_len, false) {
                let (stats, budget) = (&mut self.stats, &self.budget);
                send_busy(stats, budget, &mut self.tx, &s.peer, s.remote, sid, h);
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
                send_credit_return(&mut self.tx, &s.peer, s.remote, sid, slot, 0);
            }
            ServeState::Responded if slot.writing.is_some() => {
                // The response is being written: the client waits.
                send_credit_return(&mut self.tx, &s.peer, s.remote, sid, slot, 0);
            }
            ServeState::Responded => {
                send_response(&mut self.tx, &s.peer, s.remote, sid, s.max_payload, slot, 0);
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
        self.relink_request(sid, i, buf);
        true
    }

    /// Sends client slot `i`'s request `req` of session `sid` again, once,
    /// in packets over a new link (its READ or WRITE over the old one
    /// failed): from its first packet, its credits back, waiting for the
    /// link while it is set up.
    pub(crate) fn relink_request(&mut self, sid: u32, i: usize, req: Vec<u8>) {
        let now = self.now;
        let Some(s) = self.sessions.get_mut(sid) else {
            return;
        };
        let max_payload = s.max_payload;
        let slot = &mut s.client[i];
        slot.n_req = packets_for(req.len(), max_payload);
        slot.req = req;
        s.credits += slot.in_flight();
        slot.num_tx = 0;
        slot.num_rx = 0;
        slot.answered = 0;
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
            fail_too_large(s, sid, i, h.req_num, msg_len, max_len);
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
            let e =
                TransportError::bad_address(0, "a read response on a session without an RC link");
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
                // (`written_responses.rs`): room for it, before the handler
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
        // (`written_requests.rs`).
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
        // Room for the response too (`written_responses.rs`): the request's
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
}
