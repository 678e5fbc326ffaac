//! Large responses by RDMA WRITE with immediate, into the buffer the client
//! offered: a call's round trip in four one-way trips instead of six.
//!
//! * The offer: a read request exposes the client's copy of the request
//!   for READ *and* WRITE, over `max(request length, the session's last
//!   large response)` bytes (at most twice the request), and says how
//!   many in its descriptor
//!   ([`BulkDesc::encode_offer`]). No second registration: the request's
//!   buffer is the response's once the server has read it.
//! * The WRITE: a server whose handler answered with a response of at
//!   least `read_threshold` bytes that fits the offer WRITEs it with
//!   immediate to the start of the offered buffer over the session's RC
//!   link (instead of exposing it and sending a read response for the
//!   client to READ), followed by a trailer
//!   ([`RESP_TRAILER`](super::write_format::RESP_TRAILER): the room
//!   granted for the slot's next request, if any; offers count it). The
//!   immediate names the slot, the request number's low bits and the
//!   length of both ([`encode_imm`]). The response's buffer is
//!   the WRITE's until its completion; then the server keeps it as the
//!   slot's cached response, so a resent request is answered in packets.
//!   A WRITE that fails (the client's end broke, its buffer is gone)
//!   closes the link and keeps the response the same way.
//! * The arrival: the client's link takes the immediate in a receive
//!   posted for it; the call of that slot, if it is the one the immediate
//!   names and has an offer, takes its buffer back from the transport (no
//!   WRITE reaches it afterwards), cut to the length, as its response. An
//!   immediate for another call is stale and ignored; one claiming more
//!   than the offer, or nothing, fails the call. While the WRITE is under
//!   way the client resends its read request every `rto` as for any
//!   unanswered packet, and the server answers with a credit return (or,
//!   once written, with the response in packets): a server that vanished
//!   fails the call within the session's retry bound.

use tracing::debug;

use crate::rpc::error::{RpcError, SessionId};
use crate::rpc::header::{packets_for, BulkDesc, Header, PacketKind, BULK_DESC_LEN, MAX_MSG_LEN};
use crate::rpc::session::{slot_of, CallState, Role, ServeState};
use crate::rpc::transport::TransportError;

use super::call_end::complete;
use super::paths::goes_bulk;
use super::receive::linked_session;
use super::release::close_link_if;
use super::write_format::{
    decode_imm, encode_imm, generation, link_session, response_room, trailer_len, WRITE_TRAILER,
    WRITTEN_REQUEST_MAX,
};
use super::{Core, ReadTarget};

impl<P: Clone> Core<P> {
    /// Server: WRITEs the response `buf` of request `req_num` in slot `i`
    /// into the buffer its client offered, if it offered one large enough
    /// and the link is ready; else gives `buf` back (to READ or stream).
    pub(crate) fn write_response(
        &mut self,
        sid: u32,
        i: usize,
        req_num: u64,
        buf: Vec<u8>,
    ) -> Result<(), Vec<u8>> {
        let (Some(bulk), Some(s)) = (self.bulk.as_mut(), self.sessions.get_mut(sid)) else {
            return Err(buf);
        };
        let Some(link) = s.link_ready() else {
            return Err(buf);
        };
        let slot = &mut s.server[i];
        let desc = match slot.offer {
            Some((n, desc, cap))
                if n == req_num
                    && slot.writing.is_none()
                    && buf.len() + trailer_len(cap) <= cap =>
            {
                (desc, cap)
            }
            _ => return Err(buf),
        };
        let (desc, offered) = desc;
        let token = self.next_token;
        // The room for the slot's next request, if it holds one, in the
        // trailer.
        let (room, room_cap) = slot
            .granted
            .map_or((BulkDesc { addr: 0, rkey: 0 }, 0), |(_, d, c)| {
                (d, c as u32)
            });
        let len = buf.len();
        let mut buf = buf;
        if trailer_len(offered) > 0 {
            buf.extend_from_slice(&room.encode_offer(room_cap));
        }
        let imm = encode_imm(req_num, buf.len());
        match bulk.write_imm(link, buf, desc.addr, desc.rkey, imm, token) {
            Ok(()) => {
                self.next_token += 1;
                // (The offer stays until the WRITE is done: its capacity
                // says whether the WRITE carried a trailer.)
                slot.writing = Some(token);
                slot.resp = None;
                slot.n_resp = 1;
                slot.state = ServeState::Responded;
                self.writes.insert(
                    token,
                    ReadTarget {
                        sid,
                        slot: i,
                        req_num,
                        link,
                    },
                );
                Ok(())
            }
            Err((mut buf, error)) => {
                debug!(%error, session = sid, "rpc: response not written; it goes by READ or in packets");
                buf.truncate(len);
                Err(buf)
            }
        }
    }

    /// Server: the WRITE of token `token` (a response) finished: its buffer
    /// becomes the slot's cached response (sent in packets if the client
    /// asks again); a failed WRITE closes the link.
    pub(crate) fn on_write_done(
        &mut self,
        token: u64,
        t: ReadTarget,
        buf: Vec<u8>,
        result: Result<(), TransportError>,
    ) {
        if self
            .sessions
            .get(t.sid)
            .is_some_and(|s| s.role == Role::Client)
        {
            self.on_request_written(token, t, buf, result);
            return;
        }
        match &result {
            Ok(()) => self.stats.bulk_writes += 1,
            Err(error) => {
                self.stats.bulk_write_failures += 1;
                debug!(%error, session = t.sid, "rpc: RDMA WRITE of a response failed");
            }
        }
        let Some(s) = self.sessions.get_mut(t.sid) else {
            self.pool.put(buf);
            return;
        };
        let slot = &mut s.server[t.slot];
        if slot.req_num != t.req_num || slot.writing != Some(token) {
            // The slot moved on (a new request, the session closed): the
            // completion came after the client's next calls. The buffer
            // becomes the slot's next room if it has none and its
            // current request's response is not written yet (that
            // response announces it).
            let next = slot.msg_len + WRITE_TRAILER;
            let link = s.link_ready();
            let slot = &mut s.server[t.slot];
            let wanted = result.is_ok()
                && slot.granted.is_none()
                && slot.writing.is_none()
                && slot.msg_len > 0
                && slot.msg_len <= WRITTEN_REQUEST_MAX
                && matches!(slot.state, ServeState::Handling);
            match (link, self.bulk.as_mut()) {
                (Some(link), Some(bulk))
                    if wanted && self.grants.grow(&mut slot.grant_charge, next, false) =>
                {
                    let mut room = buf;
                    room.truncate(next);
                    match bulk.expose_writable(link, room, next) {
                        Ok((token, addr, rkey)) => {
                            slot.granted = Some((token, BulkDesc { addr, rkey }, next));
                        }
                        Err((room, _)) => {
                            self.pool.put(room);
                            slot.grant_charge.release();
                        }
                    }
                }
                _ => self.pool.put(buf),
            }
            return;
        }
        slot.writing = None;
        let trailer = match slot.offer.take() {
            Some((n, _, cap)) if n == t.req_num => trailer_len(cap),
            _ => 0,
        };
        let mut buf = buf;
        // (Without its trailer: a resend in packets is the response alone.)
        buf.truncate(buf.len().saturating_sub(trailer));
        if result.is_err() {
            close_link_if(&mut self.bulk, s, t.link);
        }
        let slot = &mut s.server[t.slot];
        let n_resp = packets_for(buf.len(), s.max_payload);
        if n_resp <= usize::from(u16::MAX) {
            slot.n_resp = n_resp;
            slot.resp = Some(self.pool.msg(buf));
        } else {
            // Too many packets to resend: a resent request gets credit
            // returns until the client gives up.
            self.pool.put(buf);
        }
    }

    /// Client: takes the WRITEs with immediate that landed; registers `cx`
    /// for the next.
    pub(crate) fn poll_written(&mut self, cx: &mut std::task::Context<'_>) {
        let Some(bulk) = self.bulk.as_mut() else {
            return;
        };
        bulk.poll_written(cx, &mut self.bulk_written);
        if self.bulk_written.is_empty() {
            return;
        }
        let mut written = std::mem::take(&mut self.bulk_written);
        for (link, imm) in written.drain(..) {
            self.on_written(link, imm);
        }
        self.bulk_written = written;
    }

    /// Client: a WRITE with immediate `imm` landed over `link`.
    pub(crate) fn on_written(&mut self, link: u64, imm: u32) {
        let sid = link_session(link);
        let (i, gen, len) = decode_imm(imm);
        let max_len = self.config.max_msg_len;
        let Some(s) = self.sessions.get_mut(sid) else {
            self.stats.stale_packets += 1;
            return;
        };
        if s.role == Role::Server {
            self.on_request_landed(link, imm);
            return;
        }
        if s.link.as_ref().map(|l| l.local) != Some(link) {
            self.stats.stale_packets += 1;
            return;
        }
        let slot = &mut s.client[i];
        if !matches!(slot.state, CallState::Active)
            || slot.offered == 0
            || generation(slot.req_num) != gen
        {
            // For a call that ended (or never offered): its buffer, if the
            // WRITE reached one, was taken back before.
            self.stats.stale_packets += 1;
            return;
        }
        let cap = slot.offered as usize;
        slot.offered = 0;
        let req_num = slot.req_num;
        // The offer's own buffer, else the request's (which the server
        // read before it wrote).
        let separate = slot.offer_exposed.is_some();
        let region = if separate {
            slot.offer_exposed.take()
        } else {
            slot.req_desc = None;
            slot.req_exposed.take()
        };
        if region.is_some() {
            self.requests_exposed -= 1;
        }
        let buf = region.and_then(|token| self.bulk.as_mut()?.unexpose(token));
        let Some(s) = self.sessions.get_mut(sid) else {
            return;
        };
        let Some(mut buf) = buf else {
            let e = TransportError::bad_address(
                len,
                "a WRITE with immediate for a call whose buffer is gone",
            );
            complete(s, i, Err(RpcError::Transport(e)));
            return;
        };
        // The response and its trailer (the room granted for the slot's
        // next request).
        let tl = trailer_len(cap);
        let trailer = match len.checked_sub(tl).filter(|_| len <= cap) {
            Some(at) if tl > 0 => buf.get(at..len).and_then(BulkDesc::decode_offer),
            Some(_) => Some((BulkDesc { addr: 0, rkey: 0 }, 0)),
            None => None,
        };
        let msg_len = len.saturating_sub(tl);
        if trailer.is_none() || msg_len == 0 || msg_len > max_len {
            // The server claims more than it could have written (or
            // nothing, which never goes by WRITE): the call fails.
            self.stats.malformed_packets += 1;
            self.pool.put(buf);
            let e = if trailer.is_some() && msg_len > max_len {
                RpcError::ResponseTooLarge {
                    session: SessionId(sid),
                    req_num,
                    len: msg_len,
                    max: max_len,
                }
            } else {
                RpcError::Transport(TransportError::bad_address(
                    len,
                    "a WRITE with immediate claiming a length outside the offered buffer",
                ))
            };
            complete(s, i, Err(e));
            if s.active != 0 && s.starved {
                self.defer_pump(sid);
            }
            return;
        }
        let len = msg_len;
        buf.truncate(len);
        self.stats.bulk_writes += 1;
        s.resp_hint = len;
        if let Some((desc, room)) = trailer.filter(|&(_, room)| room > 0) {
            // The server's room for the slot's next request: the buffer of
            // its last response (`on_request_landed`).
            s.client[i].grant = Some((desc, room as usize));
        }
        // (`complete` returns the credits of the packets in flight: the
        // server had the whole request.)
        let slot = &mut s.client[i];
        let old = std::mem::replace(&mut slot.resp, buf);
        if !separate {
            // The request's buffer is the response now: the slot's next
            // request goes into one the pool has for it (a response given
            // back, as the READ path's targets are).
            slot.req = self.pool.take_for(cap);
        }
        slot.resp_len = len;
        slot.resp_got.clear();
        slot.resp_got.push(1);
        self.pool.put(old);
        complete(s, i, Ok(()));
        // Its credit back is for a call that waited for one, if any did
        // (as `small_response` does): without a pump it would wait for a
        // packet that may never come (a session whose calls all go by
        // WRITE receives none).
        if s.active != 0 && s.starved {
            self.defer_pump(sid);
        }
    }

    /// Client: offers room for the response of slot `i`'s call when the
    /// session's last large response says one may come and the request
    /// carries no room of its own (it goes in packets, or by READ from a
    /// buffer too small): a buffer of that length from the pool, exposed
    /// for WRITE (zeroed: the peer may READ it too), announced by an offer
    /// packet queued ahead of the request's packets. So a large response
    /// comes by one WRITE whatever the request's size (`docs/rpc.md`).
    pub(crate) fn offer_room(&mut self, sid: u32, i: usize) {
        self.room_for_response(sid, i, true, 0);
    }

    /// [`offer_room`](Self::offer_room)'s work: the room offered, if any
    /// (announced by an offer packet if `packet`, else returned for the
    /// caller to announce).
    pub(crate) fn room_for_response(
        &mut self,
        sid: u32,
        i: usize,
        packet: bool,
        at_least: usize,
    ) -> Option<(BulkDesc, u32)> {
        let max_len = self.config.max_msg_len;
        let Core {
            config,
            bulk,
            sessions,
            pool,
            tx,
            dispatcher,
            requests_exposed,
            ..
        } = self;
        let (Some(bulk), Some(s)) = (bulk.as_mut(), sessions.get_mut(sid)) else {
            return None;
        };
        // At least `at_least` (a written request's length: an echo's
        // response fits), as a read request's own buffer offers.
        let hint = s
            .resp_hint
            .max(at_least)
            .min(max_len)
            .min(MAX_MSG_LEN as usize);
        let max_link_packet = bulk.max_link_packet();
        if hint == 0 || !goes_bulk(config, max_link_packet, true, hint, s.max_payload) {
            return None;
        }
        let link = s.link_ready()?;
        // Room for the response's trailer too.
        let hint = response_room(hint);
        // The slot's spare, if large enough: what it holds the server
        // could READ already, so only room past its length is zeroed when
        // exposed (a pool buffer is zeroed whole: a pass over the room per
        // call).
        let spare = &mut s.client[i].spare;
        let room = if spare.capacity() >= hint {
            std::mem::take(spare)
        } else {
            pool.take_for(hint)
        };
        match bulk.expose_writable(link, room, hint) {
            Ok((token, addr, rkey)) => {
                *requests_exposed += 1;
                let slot = &mut s.client[i];
                slot.offer_exposed = Some(token);
                slot.offered = hint as u32;
                if !packet {
                    // (The room of a written request: the link's
                    // receives, which take the response's immediate, are
                    // registered with the dispatcher by each of its runs
                    // since the link opened (`poll_bulk`), the run that
                    // took the grant among them: no run now.)
                    return Some((BulkDesc { addr, rkey }, hint as u32));
                }
                if let Some(w) = dispatcher {
                    // Its next turn polls the link for the immediate.
                    w.wake_by_ref();
                }
                let h = Header {
                    payload_len: BULK_DESC_LEN as u16,
                    dest_session: s.remote,
                    src_session: sid,
                    req_num: slot.req_num,
                    msg_len: hint as u32,
                    ..Header::new(PacketKind::Offer)
                };
                tx.push(&s.peer, &h, &BulkDesc { addr, rkey }.encode());
                None
            }
            Err((buf, error)) => {
                debug!(%error, "rpc: no room offered for the response; it goes by READ");
                pool.put(buf);
                None
            }
        }
    }

    /// Server: an offer of room for request `h.req_num`'s response. Kept
    /// in its slot for the request, current (not answered yet) or next;
    /// one for an older request, or on a session without a ready link,
    /// is stale; a later offer for the same request replaces it. Nothing
    /// is allocated: a bad descriptor fails the WRITE, which closes the
    /// link, and the response goes in packets when the client asks again.
    pub(crate) fn on_offer(&mut self, h: &Header, payload: &[u8]) {
        let Some(desc) = BulkDesc::decode(payload) else {
            self.stats.malformed_packets += 1;
            return;
        };
        if self
            .sessions
            .get(h.dest_session)
            .is_some_and(|s| s.role == Role::Client)
        {
            self.on_grant(h, desc);
            return;
        }
        let Some(s) = linked_session(&mut self.sessions, &mut self.stats, h, Role::Server) else {
            return;
        };
        let slot = &mut s.server[slot_of(h.req_num)];
        let open = matches!(slot.state, ServeState::Receiving | ServeState::Handling);
        let later = h.req_num > slot.req_num || slot.state == ServeState::Idle;
        let again = slot.read_failed(h.req_num);
        if !(later || again || (h.req_num == slot.req_num && open)) {
            self.stats.stale_packets += 1;
            return;
        }
        slot.offer = Some((h.req_num, desc, h.msg_len as usize));
    }
}
