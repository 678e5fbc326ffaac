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
//!   client to READ). The immediate names the slot, the request number's
//!   low bits and the length ([`encode_imm`]). The response's buffer is
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

use super::client::complete;
use super::core::{open_session, Core, ReadTarget};
use super::error::{RpcError, SessionId};
use super::header::{packets_for, BulkDesc, Header, PacketKind, BULK_DESC_LEN, MAX_MSG_LEN};
use super::session::{CallState, Role, ServeState, SESSION_SLOTS};
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

/// The session a client link's number belongs to: client links are
/// numbered `count << 32 | session` (`want_link`).
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
            Some((n, desc, cap)) if n == req_num && buf.len() <= cap => desc,
            _ => return Err(buf),
        };
        let token = self.next_token;
        let imm = encode_imm(req_num, buf.len());
        match bulk.write_imm(link, buf, desc.addr, desc.rkey, imm, token) {
            Ok(()) => {
                self.next_token += 1;
                slot.offer = None;
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
            Err((buf, error)) => {
                debug!(%error, session = sid, "rpc: response not written; it goes by READ or in packets");
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
            // completion came after the client's next calls.
            self.pool.put(buf);
            return;
        }
        slot.writing = None;
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
        if s.role != Role::Client || s.link.as_ref().map(|l| l.local) != Some(link) {
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
        if len == 0 || len > cap || len > max_len {
            // The server claims more than it could have written (or
            // nothing, which never goes by WRITE): the call fails.
            self.stats.malformed_packets += 1;
            self.pool.put(buf);
            let e = if len > max_len {
                RpcError::ResponseTooLarge {
                    session: SessionId(sid),
                    req_num,
                    len,
                    max: max_len,
                }
            } else {
                RpcError::Transport(TransportError::BadAddress {
                    len,
                    reason: "a WRITE with immediate claiming a length outside the offered buffer",
                })
            };
            complete(s, i, Err(e));
            return;
        }
        buf.truncate(len);
        self.stats.bulk_writes += 1;
        s.resp_hint = len;
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
    }

    /// Client: offers room for the response of slot `i`'s call when the
    /// session's last large response says one may come and the request
    /// carries no room of its own (it goes in packets, or by READ from a
    /// buffer too small): a buffer of that length from the pool, exposed
    /// for WRITE (zeroed: the peer may READ it too), announced by an offer
    /// packet queued ahead of the request's packets. So a large response
    /// comes by one WRITE whatever the request's size (`docs/rpc.md`).
    pub(crate) fn offer_room(&mut self, sid: u32, i: usize) {
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
            return;
        };
        let hint = s.resp_hint.min(max_len).min(MAX_MSG_LEN as usize);
        let max_link_packet = bulk.max_link_packet();
        if hint == 0 || !super::bulk::goes_bulk(config, max_link_packet, true, hint, s.max_payload)
        {
            return;
        }
        let Some(link) = s.link_ready() else {
            return;
        };
        match bulk.expose_writable(link, pool.take_for(hint), hint) {
            Ok((token, addr, rkey)) => {
                *requests_exposed += 1;
                if let Some(w) = dispatcher {
                    // Its next turn polls the link for the immediate.
                    w.wake_by_ref();
                }
                let slot = &mut s.client[i];
                slot.offer_exposed = Some(token);
                slot.offered = hint as u32;
                let h = Header {
                    payload_len: BULK_DESC_LEN as u16,
                    dest_session: s.remote,
                    src_session: sid,
                    req_num: slot.req_num,
                    msg_len: hint as u32,
                    ..Header::new(PacketKind::Offer)
                };
                tx.push(&s.peer, &h, &BulkDesc { addr, rkey }.encode());
            }
            Err((buf, error)) => {
                debug!(%error, "rpc: no room offered for the response; it goes by READ");
                pool.put(buf);
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
}
