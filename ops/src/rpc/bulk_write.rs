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
//!   client to READ), followed by a trailer ([`RESP_TRAILER`]: the room
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
//!
//! Requests written (a large request in one one-way trip instead of three):
//!
//! * The grant: a server that took a large request of at most
//!   [`WRITTEN_REQUEST_MAX`] in slot `i` (by READ, or written) exposes
//!   room for the slot's next request, of that request's length and a
//!   trailer, for WRITE over the session's link, and tells the client in
//!   an offer packet (server to client: the slot's request number, the
//!   room's capacity and descriptor). So a peer is granted room only
//!   after the server took a large request of it, at most one room per
//!   slot, of at most `WRITTEN_REQUEST_MAX` and a trailer; all grants
//!   together are charged to a budget of their own, half of
//!   `request_memory` (`Core::grants`, `RpcMemory::granted_bytes`): past
//!   it none is granted and the next request goes by READ, and what
//!   peers are granted never takes room from requests. A room is the
//!   slot's until a request is written into it (then it is that
//!   request's buffer), the link closes or the session ends (an idle
//!   session expires); a larger request (read) replaces it, an offer for
//!   the same room announces it again.
//! * The next room: when a written request lands, the slot's next room
//!   is the buffer of its last response, whose WRITE is done (bytes this
//!   peer was sent: only room past them is zeroed when exposed), of the
//!   request's or that response's length, whichever is more, and the
//!   trailer; it is announced in the trailer of the request's response
//!   WRITE ([`RESP_TRAILER`]: its descriptor and capacity, 0 for none),
//!   not by a packet. A response not written announces nothing: the
//!   slot's next request goes by READ and gets a grant by packet.
//! * The WRITE: the client's next large request of that slot that fits
//!   the room goes by one RDMA WRITE with immediate into it, followed by
//!   a trailer ([`WRITE_TRAILER`]: its request number and type, and the
//!   room it offers for the response), the immediate naming the slot, the
//!   generation and the length as a response's does. The request's
//!   buffer is the WRITE's until its completion; then the slot keeps it
//!   unexposed, and exposes it for READ as a read request's is only when
//!   a resend is due ([`expose_written`]), so the slot's resends after a
//!   timeout are read requests (the server answers them as duplicates,
//!   or reads the request if it never took the written one) and a call
//!   that needs none registers its request once. A WRITE that fails
//!   closes the link and the call goes again over a new link by READ
//!   (once; then it fails). The room offered for the response is the
//!   slot's spare ([`keep_spare`]): the buffer of its last request, whose
//!   bytes the server received, exposed again with no pass zeroing it
//!   (only room past its length is zeroed), not a pool buffer zeroed
//!   whole per call. The client forgets the grant once its WRITE is
//!   under way (the room is the server's request now) and takes the next
//!   from the response's trailer.
//! * The arrival: the server's link takes the immediate; only the
//!   request's trailer is copied out of the slot's room, checked as a
//!   read request's header is (a request number after the slot's, a
//!   length within the room and the message limit; anything else is
//!   dropped as malformed, never failing the session, the room kept).
//!   Then the room is deregistered (no WRITE reaches it afterwards) and
//!   itself becomes the handler's request, charged to the request memory
//!   in place of the grants: no copy of the request in user space.
//!
//! The last two of the READ path's four one-way trips for an echo are the
//! response's; the first three (read request, the READ's request, its
//! data) become the one WRITE.

use tracing::debug;

use super::client::complete;
use super::core::{open_session, Core, ReadTarget};
use super::error::{RpcError, SessionId};
use super::header::{packets_for, BulkDesc, Header, PacketKind, BULK_DESC_LEN, MAX_MSG_LEN};
use super::session::{CallState, Role, ServeState, SESSION_SLOTS};
use super::transport::Bulk;
use super::transport::TransportError;

/// Bits of the immediate that carry the response's length (up to
/// [`MAX_MSG_LEN`]).
const IMM_LEN_BITS: u32 = 25;
const _: () = assert!(MAX_MSG_LEN < 1 << IMM_LEN_BITS);
/// Bits that carry the slot.
const IMM_SLOT_BITS: u32 = 3;
const _: () = assert!(SESSION_SLOTS == 1 << IMM_SLOT_BITS);
/// Bits that carry the request number's generation (`req_num / 8`).
const IMM_GEN_BITS: u32 = 32 - IMM_LEN_BITS - IMM_SLOT_BITS;

/// The generation bits of request number `req_num`.
fn generation(req_num: u64) -> u32 {
    ((req_num / SESSION_SLOTS as u64) & ((1 << IMM_GEN_BITS) - 1)) as u32
}

/// The immediate of the WRITE of request `req_num`'s response of `len`
/// bytes (at most [`MAX_MSG_LEN`]).
pub(crate) fn encode_imm(req_num: u64, len: usize) -> u32 {
    let slot = (req_num % SESSION_SLOTS as u64) as u32;
    (generation(req_num) << (IMM_LEN_BITS + IMM_SLOT_BITS))
        | (slot << IMM_LEN_BITS)
        | (len as u32 & ((1 << IMM_LEN_BITS) - 1))
}

/// An immediate's slot, generation and length.
pub(crate) fn decode_imm(imm: u32) -> (usize, u32, usize) {
    let len = (imm & ((1 << IMM_LEN_BITS) - 1)) as usize;
    let slot = ((imm >> IMM_LEN_BITS) & ((1 << IMM_SLOT_BITS) - 1)) as usize;
    (slot, imm >> (IMM_LEN_BITS + IMM_SLOT_BITS), len)
}

/// The largest request written into granted room; larger ones go by READ
/// (and get no grant, so no room of their size is held for a peer).
/// Picked by measuring written requests against READ on the soft device,
/// one call at a time (`docs/benchmarks.md`, "Where one large call's time
/// goes"): they save two small trips, which outweighs the server's copy
/// of the request out of its room up to 128 KiB, tie around 256 KiB and
/// lose at 1 MiB.
pub(crate) const WRITTEN_REQUEST_MAX: usize = 128 << 10;

/// Bytes a written request carries after its message: its request
/// number (8), type (1), 3 zero bytes, and the descriptor and capacity of
/// the room it offers for its response ([`BulkDesc::encode_offer`]; a
/// capacity of 0: none).
pub(crate) const WRITE_TRAILER: usize = 12 + BULK_DESC_LEN;

/// Bytes a response WRITE carries after its message: the descriptor and
/// capacity of the room granted for its slot's next request
/// ([`BulkDesc::encode_offer`]; a capacity of 0: none). So the grant needs
/// no packet of its own (see the module's "Requests written").
pub(crate) const RESP_TRAILER: usize = BULK_DESC_LEN;

/// The largest room offered for a response whose WRITE carries a
/// [`RESP_TRAILER`]: one for a written request's response and its
/// trailer. Both sides know the offer, so they agree on the trailer; a
/// larger offer (a call by READ past [`WRITTEN_REQUEST_MAX`]) is used as
/// before, with no trailer, so its buffer is not grown (a copy of it).
pub(crate) const TRAILED_ROOM_MAX: usize = WRITTEN_REQUEST_MAX + WRITE_TRAILER + RESP_TRAILER;

/// The room to offer for a response of up to `len` bytes: `len` and the
/// trailer, unless that is past [`TRAILED_ROOM_MAX`].
pub(crate) fn response_room(len: usize) -> usize {
    if len + RESP_TRAILER <= TRAILED_ROOM_MAX {
        len + RESP_TRAILER
    } else {
        len
    }
}

/// The trailer a response WRITE into a room of `cap` bytes carries.
fn trailer_len(cap: usize) -> usize {
    if cap <= TRAILED_ROOM_MAX {
        RESP_TRAILER
    } else {
        0
    }
}

/// A written request's trailer.
pub(crate) fn encode_trailer(
    req_num: u64,
    req_type: u8,
    room: Option<(BulkDesc, u32)>,
) -> [u8; WRITE_TRAILER] {
    let mut t = [0u8; WRITE_TRAILER];
    t[0..8].copy_from_slice(&req_num.to_le_bytes());
    t[8] = req_type;
    let (desc, cap) = room.unwrap_or((BulkDesc { addr: 0, rkey: 0 }, 0));
    t[12..].copy_from_slice(&desc.encode_offer(cap));
    t
}

/// Decodes what [`encode_trailer`] wrote: request number, type, room.
fn decode_trailer(t: &[u8]) -> Option<(u64, u8, BulkDesc, u32)> {
    let t: &[u8; WRITE_TRAILER] = t.try_into().ok()?;
    if t[9..12] != [0; 3] {
        return None;
    }
    let req_num = u64::from_le_bytes(t[0..8].try_into().ok()?);
    let (desc, cap) = BulkDesc::decode_offer(&t[12..])?;
    Some((req_num, t[8], desc, cap))
}

/// The session a link's number belongs to: links are numbered
/// `count << 32 | session` on both sides (`want_link`, `on_bulk_connect`).
pub(crate) fn link_session(link: u64) -> u32 {
    link as u32
}

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
            super::bulk::close_link_if(&mut self.bulk, s, t.link);
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
            let e = TransportError::BadAddress {
                len,
                reason: "a WRITE with immediate for a call whose buffer is gone",
            };
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
                RpcError::Transport(TransportError::BadAddress {
                    len,
                    reason: "a WRITE with immediate claiming a length outside the offered buffer",
                })
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
    fn room_for_response(
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
        if hint == 0 || !super::bulk::goes_bulk(config, max_link_packet, true, hint, s.max_payload)
        {
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
        let Some(s) = open_session(&mut self.sessions, &mut self.stats, h, Role::Server) else {
            return;
        };
        if s.link_ready().is_none() {
            self.stats.stale_packets += 1;
            return;
        }
        let slot = &mut s.server[(h.req_num % SESSION_SLOTS as u64) as usize];
        let open = matches!(slot.state, ServeState::Receiving | ServeState::Handling);
        let later = h.req_num > slot.req_num || slot.state == ServeState::Idle;
        let again = slot.read_failed(h.req_num);
        if !(later || again || (h.req_num == slot.req_num && open)) {
            self.stats.stale_packets += 1;
            return;
        }
        slot.offer = Some((h.req_num, desc, h.msg_len as usize));
    }

    /// Server: grants slot `i` of session `sid` room for its next request
    /// of up to `len` bytes, written by the client (see the module's
    /// "Requests written"): exposed on the session's link, charged to the
    /// request memory, announced by an offer packet. Room the slot holds
    /// already that is large enough is announced again (the last offer
    /// packet may have been lost); nothing is granted without a ready
    /// link or past the budget.
    pub(crate) fn grant_room(&mut self, sid: u32, i: usize, len: usize) {
        let cap = len + WRITE_TRAILER;
        if len > WRITTEN_REQUEST_MAX || cap > MAX_MSG_LEN as usize {
            return;
        }
        let Core {
            bulk,
            sessions,
            pool,
            tx,
            grants,
            ..
        } = self;
        let (Some(bulk), Some(s)) = (bulk.as_mut(), sessions.get_mut(sid)) else {
            return;
        };
        if s.role != Role::Server {
            return;
        }
        let Some(link) = s.link_ready() else {
            return;
        };
        let slot = &mut s.server[i];
        let desc = match slot.granted {
            Some((_, desc, held)) if held >= cap => desc,
            _ => {
                if let Some((token, _, _)) = slot.granted.take() {
                    drop(bulk.unexpose(token));
                }
                slot.grant_charge.release();
                // Bounded apart from the requests: past half the request
                // memory, no grant (the next request goes by READ).
                if !grants.grow(&mut slot.grant_charge, cap, false) {
                    return;
                }
                match bulk.expose_writable(link, pool.take_for(cap), cap) {
                    Ok((token, addr, rkey)) => {
                        let desc = BulkDesc { addr, rkey };
                        slot.granted = Some((token, desc, cap));
                        desc
                    }
                    Err((buf, error)) => {
                        debug!(%error, "rpc: no room granted for a request; it goes by READ");
                        pool.put(buf);
                        slot.grant_charge.release();
                        return;
                    }
                }
            }
        };
        let h = Header {
            payload_len: BULK_DESC_LEN as u16,
            dest_session: s.remote,
            src_session: sid,
            req_num: slot.req_num,
            msg_len: slot.granted.map_or(cap, |(_, _, c)| c) as u32,
            ..Header::new(PacketKind::Offer)
        };
        tx.push(&s.peer, &h, &desc.encode());
    }

    /// Client: the server granted room for slot `h.req_num % 8`'s next
    /// request (an offer packet from the server). Kept for the slot's
    /// next large request that fits it; replaced by a later grant, and
    /// forgotten when the link closes.
    fn on_grant(&mut self, h: &Header, desc: BulkDesc) {
        let Some(s) = open_session(&mut self.sessions, &mut self.stats, h, Role::Client) else {
            return;
        };
        if s.link_ready().is_none() {
            self.stats.stale_packets += 1;
            return;
        }
        let slot = &mut s.client[(h.req_num % SESSION_SLOTS as u64) as usize];
        if h.req_num < slot.req_num {
            // Granted after an older request: a late (or duplicated)
            // packet, its room possibly taken by a request written since.
            self.stats.stale_packets += 1;
            return;
        }
        slot.grant = Some((desc, h.msg_len as usize));
    }

    /// Client: WRITEs the request of slot `i` (in `slot.req`) into the room
    /// the server granted the slot, with the trailer naming it and the
    /// room offered for the response; false (nothing changed) if the slot
    /// has no grant it fits, the link is not ready, the session has no
    /// credit, or the WRITE cannot start.
    pub(crate) fn write_request(&mut self, sid: u32, i: usize) -> bool {
        let Some(s) = self.sessions.get_mut(sid) else {
            return false;
        };
        let Some(link) = s.link_ready() else {
            return false;
        };
        let slot = &s.client[i];
        let len = slot.req.len();
        let Some((grant, cap)) = slot.grant else {
            return false;
        };
        if len + WRITE_TRAILER > cap || s.credits == 0 || slot.req_writing.is_some() {
            return false;
        }
        let (req_num, req_type) = (slot.req_num, slot.req_type);
        let room = self.room_for_response(sid, i, false, len);
        let token = self.next_token;
        let Some(s) = self.sessions.get_mut(sid) else {
            return false;
        };
        let slot = &mut s.client[i];
        let mut buf = std::mem::take(&mut slot.req);
        buf.extend_from_slice(&encode_trailer(req_num, req_type, room));
        let imm = encode_imm(req_num, buf.len());
        let Some(bulk) = self.bulk.as_mut() else {
            return false;
        };
        match bulk.write_imm(link, buf, grant.addr, grant.rkey, imm, token) {
            Ok(()) => {
                self.next_token += 1;
                // Used: the server hands the room to the request's handler
                // and grants the next in the response's trailer.
                slot.grant = None;
                slot.req_writing = Some(token);
                slot.n_req = 1;
                // Its one packet is in flight (a credit), answered when
                // the WRITE completes.
                slot.num_tx = 1;
                s.credits -= 1;
                self.writes.insert(
                    token,
                    ReadTarget {
                        sid,
                        slot: i,
                        req_num,
                        link,
                    },
                );
                // Its completion wakes the dispatcher: no run of the
                // dispatcher now just to poll it once.
                self.arm_bulk_ops();
                true
            }
            Err((mut buf, error)) => {
                debug!(%error, session = sid, "rpc: request not written; it goes by READ");
                buf.truncate(len);
                slot.req = buf;
                slot.grant = None;
                false
            }
        }
    }

    /// Client: the WRITE of a request (token `token`) finished. Done, the
    /// request's buffer is exposed for READ (so that a resend after a
    /// timeout is a read request, which the server answers as a
    /// duplicate, or reads if it never took the written one) and its
    /// packet is answered; failed, the link is closed and the call goes
    /// again over a new link (once; then it fails).
    fn on_request_written(
        &mut self,
        token: u64,
        t: ReadTarget,
        mut buf: Vec<u8>,
        result: Result<(), TransportError>,
    ) {
        let now = self.now;
        let Some(s) = self.sessions.get_mut(t.sid) else {
            self.pool.put(buf);
            return;
        };
        let slot = &mut s.client[t.slot];
        if slot.req_num != t.req_num
            || slot.req_writing != Some(token)
            || !matches!(slot.state, CallState::Active)
        {
            // The call ended meanwhile (its response came first, or it
            // failed): nothing else to do.
            if slot.req_writing == Some(token) {
                slot.req_writing = None;
            }
            if result.is_ok() {
                // Every byte of it went to the server: the slot's spare,
                // the room for its next response (`room_for_response`).
                keep_spare(&self.pool, slot, buf);
            } else {
                self.pool.put(buf);
            }
            return;
        }
        slot.req_writing = None;
        buf.truncate(buf.len().saturating_sub(WRITE_TRAILER));
        let len = buf.len();
        if let Err(error) = result {
            self.stats.bulk_write_failures += 1;
            debug!(%error, session = t.sid, "rpc: RDMA WRITE of a request failed");
            super::bulk::close_link_if(&mut self.bulk, s, t.link);
            let slot = &mut s.client[t.slot];
            if slot.relinked {
                self.pool.put(buf);
                complete(s, t.slot, Err(RpcError::Transport(error)));
                return;
            }
            let max_payload = s.max_payload;
            let slot = &mut s.client[t.slot];
            slot.req = buf;
            s.credits += slot.in_flight();
            slot.num_tx = 0;
            slot.num_rx = 0;
            slot.answered = 0;
            slot.n_req = packets_for(len, max_payload);
            slot.relinked = true;
            slot.retries = 0;
            slot.progress = now;
            self.stats.bulk_relinks += 1;
            self.want_link(t.sid);
            if let Some(s) = self.sessions.get_mut(t.sid) {
                if s.link_pending() {
                    s.client[t.slot].awaits_link = true;
                }
            }
            self.defer_pump(t.sid);
            return;
        }
        self.stats.bulk_request_writes += 1;
        // Kept, not exposed: the server has it (the WRITE completed), so
        // it is exposed for READ only if a resend is due
        // (`expose_written`), and the call registers it once, as the
        // WRITE's source (exposed here, a second registration per call).
        let slot = &mut s.client[t.slot];
        slot.req = buf;
        slot.req_written = true;
        // Its packet stays in flight (a credit) until the response
        // answers it, as a read request's: answered here, the response's
        // first packet would read as a duplicate and the call never end.
        slot.progress = now;
        slot.retries = 0;
    }

    /// Server: a request landed by WRITE with immediate `imm` in room
    /// granted over `link` (see the module's "Requests written").
    fn on_request_landed(&mut self, link: u64, imm: u32) {
        let sid = link_session(link);
        let (i, gen, len) = decode_imm(imm);
        let max_len = self.config.max_msg_len;
        let Core {
            bulk,
            sessions,
            stats,
            pool,
            budget,
            grants,
            ..
        } = self;
        let Some(bulk) = bulk.as_mut() else {
            stats.stale_packets += 1;
            return;
        };
        let Some(s) = sessions.get_mut(sid) else {
            stats.stale_packets += 1;
            return;
        };
        if s.link.as_ref().map(|l| l.local) != Some(link)
            || !matches!(s.state, super::session::SessionState::Connected)
        {
            stats.stale_packets += 1;
            return;
        }
        let slot = &mut s.server[i];
        let Some((token, _, cap)) = slot.granted else {
            // No room there: not this side's WRITE to take.
            stats.malformed_packets += 1;
            return;
        };
        // Only the trailer is copied out of the room, and checked, before
        // the room is handed over: a malformed or stale WRITE leaves it
        // exposed and the slot as it was.
        let mut t = Vec::with_capacity(WRITE_TRAILER);
        let trailer = len
            .checked_sub(WRITE_TRAILER)
            .filter(|_| len <= cap)
            .filter(|&at| bulk.copy_out(token, at, WRITE_TRAILER, &mut t))
            .and_then(|_| decode_trailer(&t));
        let fresh = |n: u64| {
            (n > slot.req_num || slot.state == ServeState::Idle)
                && !matches!(slot.state, ServeState::Receiving | ServeState::Handling)
        };
        let Some((req_num, req_type, desc, room)) = trailer.filter(|&(n, _, _, _)| {
            (n % SESSION_SLOTS as u64) as usize == i && generation(n) == gen && fresh(n)
        }) else {
            stats.malformed_packets += 1;
            return;
        };
        let msg_len = len - WRITE_TRAILER;
        if msg_len > max_len {
            stats.malformed_packets += 1;
            return;
        }
        // The room itself becomes the request (no copy): deregistered
        // first, so no WRITE reaches it afterwards. Its charge moves from
        // the grants to the request memory.
        slot.granted = None;
        slot.grant_charge.release();
        let Some(mut buf) = bulk.unexpose(token) else {
            stats.malformed_packets += 1;
            return;
        };
        buf.truncate(msg_len);
        let old_req = std::mem::replace(&mut slot.req, buf);
        let old_resp = slot.resp.take();
        let old_exposed = slot.resp_exposed.take();
        slot.begin_request(req_num, req_type, msg_len, 1, true);
        slot.charge.release();
        budget.grow(&mut slot.charge, msg_len, true);
        slot.writing = None;
        slot.offer = (room > 0).then_some((req_num, desc, room as usize));
        stats.bulk_request_writes += 1;
        pool.put(old_req);
        // The room for the slot's next request: the buffer of its last
        // response, whose WRITE is done (bytes this peer was sent: only
        // room past them is zeroed), or, if it went by READ, the one it
        // was exposed in (deregistered first; bytes this peer could READ),
        // else one of the pool (zeroed whole); announced in this
        // request's response's trailer (`write_response`). Of the
        // request's length or the response's, whichever is more (so an
        // echo's room is what the response holds and the trailer).
        let last = match (old_resp, old_exposed) {
            (Some(resp), exposed) => {
                if let Some((token, _, _)) = exposed {
                    if let Some(b) = bulk.unexpose(token) {
                        pool.put(b);
                    }
                }
                resp.into_vec()
            }
            (None, Some((token, _, _))) => bulk.unexpose(token).unwrap_or_default(),
            (None, None) => Vec::new(),
        };
        let next = msg_len.max(last.len()).min(WRITTEN_REQUEST_MAX) + WRITE_TRAILER;
        if grants.grow(&mut slot.grant_charge, next, false) {
            let mut room = if last.capacity() == 0 {
                pool.take_for(next)
            } else {
                last
            };
            room.truncate(next);
            match bulk.expose_writable(link, room, next) {
                Ok((token, addr, rkey)) => {
                    slot.granted = Some((token, BulkDesc { addr, rkey }, next));
                }
                Err((room, error)) => {
                    debug!(%error, "rpc: no room granted for a request; it goes by READ");
                    pool.put(room);
                    slot.grant_charge.release();
                }
            }
        } else {
            pool.put(last);
        }
        self.dispatch(sid, i);
    }
}

/// Client: exposes slot `slot`'s written request for READ if it is kept
/// unexposed (`ClientSlot::req_written`), so that its resend is a read
/// request (the server answers it as a duplicate, or reads the request if
/// it never took the written one). False if it could not be exposed (no
/// resend then: the server has it, the WRITE completed; the call's
/// retries still run out).
pub(crate) fn expose_written(
    bulk: &mut Option<Box<dyn Bulk>>,
    requests_exposed: &mut usize,
    slot: &mut super::session::ClientSlot,
) -> bool {
    if !slot.req_written {
        return true;
    }
    let Some(bulk) = bulk.as_mut() else {
        return false;
    };
    let len = slot.req.len();
    match bulk.expose(std::mem::take(&mut slot.req)) {
        Ok((token, addr, rkey)) => {
            slot.req_written = false;
            slot.req_exposed = Some(token);
            slot.req_desc = Some((BulkDesc { addr, rkey }, len));
            *requests_exposed += 1;
            true
        }
        Err((buf, error)) => {
            debug!(%error, "rpc: a written request not exposed for its resend");
            slot.req = buf;
            false
        }
    }
}

/// Keeps `buf`, whose bytes (all its length) the slot's server received
/// or could READ, as client slot `slot`'s spare: the room offered for
/// its next response, exposed again without zeroing what it holds. The
/// spare it replaces goes back to the pool; a buffer larger than a
/// written request does too (no room that large is kept per slot).
pub(crate) fn keep_spare(
    pool: &super::buf::BufPool,
    slot: &mut super::session::ClientSlot,
    buf: Vec<u8>,
) {
    if buf.len() > WRITTEN_REQUEST_MAX + WRITE_TRAILER {
        pool.put(buf);
        return;
    }
    pool.put(std::mem::replace(&mut slot.spare, buf));
}

/// Gives back the room session `s`'s server slots were granted (its link
/// closes) and forgets the grants its client slots hold.
pub(crate) fn release_grants<P>(bulk: &mut dyn Bulk, s: &mut super::session::Session<P>) {
    for slot in &mut s.server {
        if let Some((token, _, _)) = slot.granted.take() {
            drop(bulk.unexpose(token));
        }
        slot.grant_charge.release();
    }
    for slot in &mut s.client {
        slot.grant = None;
    }
}
