//! The server's requests: request packets taken and reassembled under
//! the request memory budget, duplicates answered from the slot, credit
//! returns sent, requests for response answered.

use tracing::{trace, warn};

use crate::rpc::budget::{Budget, Charge};
use crate::rpc::header::{packets_for, Header, PacketKind, Status};
use crate::rpc::session::{place_packet, slot_of, Role, ServeState, Session, SessionState};
use crate::rpc::transport::TxBatch;

use super::packets::{queue_ack, send_credit_return, send_response};
use super::receive::open_session;
use super::{Core, RpcStats};

/// Words of a slot's packet bitmap kept between requests (for requests of
/// up to 1024 packets); larger bitmaps are freed when their request is
/// complete.
pub(crate) const KEEP_BITMAP_WORDS: usize = 16;

/// A request's first packet dropped because the request memory budget
/// has no room for the request: answered busy (to `peer`, session
/// `remote`, from session `sid`), counted, and logged at the 1st, 2nd,
/// 4th, 8th... time.
pub(crate) fn send_busy<P: Clone>(
    stats: &mut RpcStats,
    budget: &Budget,
    tx: &mut TxBatch<P>,
    peer: &P,
    remote: u32,
    sid: u32,
    h: &Header,
) {
    // The client takes its credits back and sends the request again
    // after its timeout, when the budget may have room; the call stays
    // alive meanwhile.
    let busy = Header {
        status: Status::Busy,
        dest_session: remote,
        src_session: sid,
        req_num: h.req_num,
        pkt_idx: h.pkt_idx,
        ..Header::new(PacketKind::CreditReturn)
    };
    tx.push(peer, &busy, &[]);
    stats.budget_drops += 1;
    if stats.budget_drops.is_power_of_two() {
        warn!(
            session = sid,
            req_num = h.req_num,
            msg_len = h.msg_len,
            used = budget.used(),
            limit = budget.limit(),
            drops = stats.budget_drops,
            "rpc: request refused for now: the request memory budget (RpcConfig::request_memory) is spent; its client will send it again"
        );
    }
}

/// Whether request `h` starts a new request in server slot `i` of `s` at
/// once: the session connected, the peer's, its server side; the slot
/// idle or answered to an older request, nothing of it read, written or
/// exposed.
#[inline]
fn starts_fresh<P>(s: &Session<P>, i: usize, h: &Header) -> bool {
    let slot = &s.server[i];
    s.role == Role::Server
        && s.remote == h.src_session
        && matches!(s.state, SessionState::Connected)
        && match slot.state {
            ServeState::Idle => true,
            ServeState::Responded => h.req_num > slot.req_num,
            ServeState::Receiving | ServeState::Handling => false,
        }
        && slot.resp_exposed.is_none()
        && slot.reading.is_none()
        && slot.writing.is_none()
}

impl<P: Clone> Core<P> {
    /// A small call's request: one packet, a new request of a slot that
    /// is idle or answered (nothing of it read, written or exposed), of a
    /// type with a handler: taken into the slot and handed to the handler
    /// with what [`on_request`](Self::on_request) would do for it and no
    /// more. False, with nothing changed, for any other packet (the
    /// general path then takes it).
    #[inline]
    fn small_request(&mut self, h: &Header, payload: &[u8]) -> bool {
        let sid = h.dest_session;
        let max_len = self.config.max_msg_len;
        let Some(s) = self.sessions.get_mut(sid) else {
            return false;
        };
        let msg_len = h.msg_len as usize;
        let i = slot_of(h.req_num);
        let small = h.pkt_count == 1
            && payload.len() == msg_len
            && msg_len <= s.max_payload
            && msg_len <= max_len
            && starts_fresh(s, i, h)
            && self.handlers[usize::from(h.req_type)].is_some();
        if !small {
            return false;
        }
        let slot = &mut s.server[i];
        s.idle_sweeps = 0;
        // Charged as the general path charges a one-packet request (which
        // is admitted whatever the budget holds).
        slot.charge.release();
        self.budget.grow(&mut slot.charge, 8 + msg_len, true);
        slot.reuse_response_buffer(&self.pool);
        slot.req.clear();
        slot.req.extend_from_slice(payload);
        slot.begin_request(h.req_num, h.req_type, msg_len, 1, true);
        self.dispatch(sid, i);
        true
    }

    /// A whole request of several packets in one (`h`, packet 0, and the
    /// whole message: a SEND over the session's link, `link_send.rs`), of
    /// a slot that is idle or answered (nothing of it read, written or
    /// exposed), of a type with a handler, that the request memory has
    /// room for: taken into the slot at once and handed to the handler,
    /// as [`on_request`](Self::on_request) would take its packets one by
    /// one, with no acknowledgement queued for its first packets (the
    /// slot is handling it before the batch's acknowledgements go, and
    /// the response answers every packet). False, with nothing changed,
    /// for any other (the caller then gives it packet by packet).
    pub(crate) fn whole_request(&mut self, h: &Header, payload: &[u8]) -> bool {
        let sid = h.dest_session;
        let max_len = self.config.max_msg_len;
        let Some(s) = self.sessions.get_mut(sid) else {
            return false;
        };
        let msg_len = h.msg_len as usize;
        let n = usize::from(h.pkt_count);
        let i = slot_of(h.req_num);
        let whole = h.pkt_idx == 0
            && (2..=u64::BITS as usize).contains(&n)
            && payload.len() == msg_len
            && n == packets_for(msg_len, s.max_payload)
            && msg_len <= max_len
            && starts_fresh(s, i, h)
            && self.handlers[usize::from(h.req_type)].is_some();
        if !whole {
            return false;
        }
        let slot = &mut s.server[i];
        // Charged as the general path charges it (its packet bitmap and
        // bytes, not forced: a request of several packets waits for room).
        let mut charge = Charge::default();
        if !self.budget.grow(&mut charge, 8 + msg_len, false) {
            return false;
        }
        s.idle_sweeps = 0;
        slot.reuse_response_buffer(&self.pool);
        slot.begin_request(h.req_num, h.req_type, msg_len, n, false);
        // Every packet is in (one bitmap word holds them all).
        slot.got[0] = u64::MAX >> (u64::BITS as usize - n);
        slot.rx = n;
        slot.req.clear();
        slot.req.extend_from_slice(payload);
        // The old request's charge is given back.
        slot.charge = charge;
        self.dispatch(sid, i);
        true
    }

    /// A request packet.
    pub(crate) fn on_request(&mut self, h: &Header, payload: &[u8]) {
        if self.small_request(h, payload) {
            return;
        }
        #[cfg(test)]
        {
            self.work.request_packets += 1;
        }
        let sid = h.dest_session;
        let max_len = self.config.max_msg_len;
        let Some(s) = open_session(&mut self.sessions, &mut self.stats, h, Role::Server) else {
            return;
        };
        let max_payload = s.max_payload;
        let msg_len = h.msg_len as usize;
        let idx = usize::from(h.pkt_idx);
        let start = idx * max_payload;
        // Every field the peer sets is checked against this session's
        // packet size and this endpoint's largest message before anything
        // is allocated for it.
        let fits = usize::from(h.pkt_count) == packets_for(msg_len, max_payload)
            && payload.len() == (start + max_payload).min(msg_len).saturating_sub(start);
        if !fits {
            self.stats.malformed_packets += 1;
            trace!(
                ?h,
                max_payload,
                "rpc: request packet that does not fit the session's packet size dropped"
            );
            return;
        }
        let too_large = msg_len > max_len;
        let i = slot_of(h.req_num);
        let slot = &mut s.server[i];
        if slot.takes_new(h.req_num) {
            if slot.state == ServeState::Handling {
                // The previous request's handler still runs; the client
                // sends this one again.
                self.stats.stale_packets += 1;
                return;
            }
            if too_large {
                // Refused with nothing kept but the slot's answer.
                self.stats.malformed_packets += 1;
                slot.take_refused(h.req_num, h.req_type, msg_len, usize::from(h.pkt_count));
                self.refuse(sid, i, Status::RequestTooLarge);
                return;
            }
            let n_req = usize::from(h.pkt_count);
            let words = n_req.div_ceil(64);
            // The whole request is reserved now (its buffer is allocated
            // as packets arrive), so an admitted request never stalls
            // half way for memory.
            let mut charge = Charge::default();
            if !self
                .budget
                .grow(&mut charge, words * 8 + msg_len, n_req == 1)
            {
                let (stats, budget) = (&mut self.stats, &self.budget);
                send_busy(stats, budget, &mut self.tx, &s.peer, s.remote, sid, h);
                return;
            }
            slot.reuse_response_buffer(&self.pool);
            slot.reading = None;
            slot.writing = None;
            if let (Some((token, _, _)), Some(bulk)) = (slot.resp_exposed.take(), &mut self.bulk) {
                if let Some(buf) = bulk.unexpose(token) {
                    self.pool.put(buf);
                }
            }
            slot.begin_request(h.req_num, h.req_type, msg_len, n_req, false);
            slot.req.clear();
            // The old request's charge is given back.
            slot.charge = charge;
        } else if h.req_num < slot.req_num {
            self.stats.stale_packets += 1;
            return;
        }
        if h.req_type != slot.req_type || msg_len != slot.msg_len {
            self.stats.malformed_packets += 1;
            return;
        }
        let (peer, remote) = (&s.peer, s.remote);
        let mut complete = false;
        let (word, bit) = (idx / 64, 1u64 << (idx % 64));
        let got = slot.got.get(word).is_some_and(|w| w & bit != 0);
        match slot.state {
            ServeState::Receiving if !got => {
                place_packet(&mut slot.req, start, payload);
                slot.got[word] |= bit;
                slot.rx += 1;
                slot.stalled_sweeps = 0;
                if idx + 1 < slot.n_req {
                    // Acknowledged with its neighbours of this receive
                    // batch, in one credit return (`send_acks`).
                    queue_ack(&mut self.acks, sid, i, slot.req_num, h.pkt_idx);
                    #[cfg(test)]
                    {
                        self.work.acks_queued += 1;
                    }
                }
                if slot.rx == slot.n_req {
                    complete = true;
                }
            }
            ServeState::Receiving => {
                self.stats.duplicate_requests += 1;
                if idx + 1 < slot.n_req {
                    send_credit_return(&mut self.tx, peer, remote, sid, slot, h.pkt_idx);
                }
            }
            ServeState::Handling => {
                // Earlier packets: their credit return was lost. The last
                // one: the client waits; tell it the handler runs.
                self.stats.duplicate_requests += 1;
                send_credit_return(&mut self.tx, peer, remote, sid, slot, h.pkt_idx);
            }
            ServeState::Responded => {
                self.stats.duplicate_requests += 1;
                if idx + 1 == slot.n_req && slot.writing.is_none() {
                    send_response(&mut self.tx, peer, remote, sid, max_payload, slot, 0);
                } else {
                    send_credit_return(&mut self.tx, peer, remote, sid, slot, h.pkt_idx);
                }
            }
            ServeState::Idle => {
                self.stats.stale_packets += 1;
            }
        }
        if complete {
            self.dispatch(sid, i);
        }
    }

    /// A request for response packet `pkt_idx`.
    pub(crate) fn on_request_for_response(&mut self, h: &Header) {
        let sid = h.dest_session;
        let Some(s) = open_session(&mut self.sessions, &mut self.stats, h, Role::Server) else {
            return;
        };
        let slot = &s.server[slot_of(h.req_num)];
        let first = usize::from(h.pkt_idx);
        // Validated: below 64 more, no overflow.
        let last = first + usize::from(h.pkt_count);
        if slot.req_num != h.req_num || slot.state != ServeState::Responded || last >= slot.n_resp {
            self.stats.stale_packets += 1;
            return;
        }
        for j in first..=last {
            send_response(&mut self.tx, &s.peer, s.remote, sid, s.max_payload, slot, j);
        }
    }

    /// Sends the credit returns of the request packets received since the
    /// last call: one per contiguous run, for requests still arriving (a
    /// request that completed meanwhile is answered by its response, which
    /// returns every credit; if its handler outlasts the client's timeout,
    /// the packets the client sends again are acknowledged then).
    pub(crate) fn send_acks(&mut self) {
        if self.acks.is_empty() {
            return;
        }
        for a in self.acks.drain(..) {
            let Some(s) = self.sessions.get(a.sid) else {
                continue;
            };
            let slot = &s.server[a.slot];
            if slot.req_num != a.req_num || slot.state != ServeState::Receiving {
                continue;
            }
            let h = Header {
                dest_session: s.remote,
                src_session: a.sid,
                req_num: a.req_num,
                pkt_idx: a.last,
                pkt_count: a.last - a.first,
                ..Header::new(PacketKind::CreditReturn)
            };
            self.tx.push(&s.peer, &h, &[]);
        }
    }
}
