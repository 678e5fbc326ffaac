//! Large requests by RDMA WRITE with immediate into room the server
//! granted (`write_format.rs` has the immediate and the trailers).
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
//!   WRITE ([`RESP_TRAILER`](super::write_format::RESP_TRAILER): its descriptor
//!   and capacity, 0 for none),
//!   not by a packet. A response not written announces nothing: the
//!   slot's next request goes by READ and gets a grant by packet.
//! * The WRITE: the client's next large request of that slot that fits
//!   the room goes by one RDMA WRITE with immediate into it, followed by
//!   a trailer ([`WRITE_TRAILER`]: its request number and type, and the
//!   room it offers for the response), the immediate naming the slot, the
//!   generation and the length as a response's does. The request's
//!   buffer is the WRITE's until its completion; then the slot keeps it
//!   unexposed, and exposes it for READ as a read request's is only when
//!   a resend is due ([`expose_written`](super::release::expose_written)), so
//!   the slot's resends after a
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

use crate::rpc::error::RpcError;
use crate::rpc::header::{BulkDesc, Header, PacketKind, BULK_DESC_LEN, MAX_MSG_LEN};
use crate::rpc::session::{slot_of, CallState, Role, ServeState, SessionState};
use crate::rpc::transport::TransportError;

use super::call_end::complete;
use super::receive::linked_session;
use super::release::{close_link_if, keep_spare};
use super::write_format::{
    decode_imm, decode_trailer, encode_imm, encode_trailer, generation, link_session,
    WRITE_TRAILER, WRITTEN_REQUEST_MAX,
};
use super::{Core, ReadTarget};

impl<P: Clone> Core<P> {
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
    pub(crate) fn on_grant(&mut self, h: &Header, desc: BulkDesc) {
        let Some(s) = linked_session(&mut self.sessions, &mut self.stats, h, Role::Client) else {
            return;
        };
        let slot = &mut s.client[slot_of(h.req_num)];
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
    pub(crate) fn on_request_written(
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
        if let Err(error) = result {
            self.stats.bulk_write_failures += 1;
            debug!(%error, session = t.sid, "rpc: RDMA WRITE of a request failed");
            close_link_if(&mut self.bulk, s, t.link);
            let slot = &mut s.client[t.slot];
            if slot.relinked {
                self.pool.put(buf);
                complete(s, t.slot, Err(RpcError::Transport(error)));
                return;
            }
            self.relink_request(t.sid, t.slot, buf);
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
    pub(crate) fn on_request_landed(&mut self, link: u64, imm: u32) {
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
            || !matches!(s.state, SessionState::Connected)
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
        let Some((req_num, req_type, desc, room)) =
            trailer.filter(|&(n, _, _, _)| slot_of(n) == i && generation(n) == gen && fresh(n))
        else {
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
