//! The client's answers: credit returns and response packets taken,
//! calls completed once their response is all in.

use crate::rpc::error::{RpcError, SessionId};
use crate::rpc::header::{packets_for, Header, Status, HEADER_LEN};
use crate::rpc::session::{place_packet, slot_of, CallState, Role, SessionState, WINDOW};

use super::call_end::{complete, complete_ok, fail_too_large};
use super::release::close_link;
use super::Core;

impl<P: Clone> Core<P> {
    /// The active slot of a client session `h` answers, if `h`'s request
    /// number is its current one.
    pub(crate) fn answered_slot(&mut self, h: &Header) -> Option<usize> {
        let s = self.session_for(h, Role::Client)?;
        let i = slot_of(h.req_num);
        let slot = &s.client[i];
        if matches!(slot.state, CallState::Active) && slot.req_num == h.req_num {
            Some(i)
        } else {
            self.stats.stale_packets += 1;
            None
        }
    }

    /// A credit return: request packet `pkt_idx` arrived; for the last one,
    /// the handler is running.
    pub(crate) fn on_credit_return(&mut self, h: &Header) {
        let Some(i) = self.answered_slot(h) else {
            return;
        };
        let now = self.now;
        let Some(s) = self.sessions.get_mut(h.dest_session) else {
            return;
        };
        let slot = &mut s.client[i];
        if h.status == Status::Busy {
            if slot.num_rx == 0 && !slot.paused {
                self.stats.busy_pauses += 1;
                // Nothing of the request was taken: its credits come back
                // and it starts again from packet 0 after the timeout.
                s.credits += slot.in_flight();
                slot.num_tx = 0;
                slot.answered = 0;
                slot.paused = true;
                slot.progress = now;
                slot.retries = 0;
                self.defer_pump(h.dest_session);
            }
            return;
        }
        let last = usize::from(h.pkt_idx);
        // Validated: the range starts at or after packet 0.
        let first = last - usize::from(h.pkt_count);
        if last >= slot.n_req {
            self.stats.malformed_packets += 1;
            return;
        }
        if last + 1 == slot.n_req && first == last {
            // The server has the whole request ("in progress": it reads
            // it or its handler runs).
            s.rtt.sample(now - slot.sent);
            slot.progress = now;
            slot.retries = 0;
            return;
        }
        let before = slot.in_flight();
        for k in first..=last {
            // The last packet's credit returns with the response.
            if k + 1 < slot.n_req {
                slot.answer(k);
            }
        }
        let returned = before - slot.in_flight();
        if returned == 0 {
            self.stats.stale_packets += 1;
            return;
        }
        s.rtt.sample(now - slot.sent);
        slot.progress = now;
        slot.retries = 0;
        s.credits += returned;
        self.defer_pump(h.dest_session);
    }

    /// A response packet.
    pub(crate) fn on_response(&mut self, h: &Header, payload: &[u8]) {
        if self.small_response(h, payload) {
            return;
        }
        let Some(i) = self.answered_slot(h) else {
            return;
        };
        let now = self.now;
        let sid = h.dest_session;
        let max_len = self.config.max_msg_len;
        let max_link_packet = self.max_link_packet();
        let read_threshold = self.config.read_threshold;
        let Some(s) = self.sessions.get_mut(sid) else {
            return;
        };
        let max_payload = s.max_payload;
        let window = s.response_window;
        let slot = &mut s.client[i];
        let j = usize::from(h.pkt_idx);
        if j == 0 && h.status != Status::Ok {
            // An error (the header allows it only as one empty packet) may
            // come before the whole request was sent: it ends the call.
            let e = RpcError::Remote {
                session: SessionId(sid),
                req_num: h.req_num,
                req_type: slot.req_type,
                status: h.status,
            };
            if h.status == Status::ReadFailed {
                // The server's end of the link is closed (it could not
                // READ the request, so no handler ran): the request goes
                // again over a new link, once (`read_path.rs`).
                if self.read_failed_retry(sid, i) {
                    return;
                }
                let Some(s) = self.sessions.get_mut(sid) else {
                    return;
                };
                close_link(&mut self.bulk, s);
                complete(s, i, Err(e));
                return;
            }
            complete(s, i, Err(e));
            return;
        }
        let k = slot.n_req - 1 + j;
        let msg_len = h.msg_len as usize;
        let n_resp = usize::from(h.pkt_count);
        if slot.n_resp == 0 {
            // The response's first packet to arrive (packet 0, or one the
            // server sent unasked, reordered ahead of it).
            if msg_len > max_len {
                fail_too_large(s, sid, i, h.req_num, msg_len, max_len);
                return;
            }
            if n_resp != packets_for(msg_len, max_payload) || j >= n_resp {
                self.stats.malformed_packets += 1;
                return;
            }
            if msg_len > max_payload
                && msg_len < read_threshold
                && read_threshold != usize::MAX
                && HEADER_LEN + msg_len <= max_link_packet
                && s.link.is_none()
                && !s.link_refused
                && !self.links_wanted.contains(&sid)
            {
                // Mid-size responses come: over the link once it is
                // ready (`link_send.rs`).
                self.links_wanted.push(sid);
            }
            if msg_len >= self.config.read_threshold && self.bulk.is_some() {
                // Large responses come: the next calls offer room for
                // one (`written_responses.rs`), and the session asks for its
                // link.
                s.resp_hint = msg_len;
                if !self.links_wanted.contains(&sid) {
                    self.links_wanted.push(sid);
                }
            } else if slot.offered > 0 {
                // Room was offered for nothing: the next calls offer
                // none until a large response comes again (a session's
                // small calls after a large one do not each register
                // and zero a buffer of its size).
                s.resp_hint = 0;
            }
            slot.resp.clear();
            slot.resp_len = msg_len;
            slot.n_resp = n_resp;
            slot.resp_got.clear();
            if n_resp <= 64 {
                slot.resp_got.push(0);
            } else {
                slot.resp_got.resize(n_resp.div_ceil(64), 0);
            }
            slot.unasked = n_resp.min(window);
        } else if n_resp != slot.n_resp || msg_len != slot.resp_len {
            self.stats.malformed_packets += 1;
            return;
        }
        // Response packets after the first may come before the client
        // asked for them (the server's response window).
        let early = j >= 1 && k >= slot.num_tx;
        let fresh = if early {
            !slot.has_response_packet(j)
        } else {
            k < slot.num_tx && !slot.is_answered(k)
        };
        if !fresh {
            self.stats.stale_packets += 1;
            return;
        }
        let start = j * max_payload;
        let end = (start + max_payload).min(msg_len);
        if payload.len() != end - start {
            self.stats.malformed_packets += 1;
            return;
        }
        place_packet(&mut slot.resp, start, payload);
        slot.mark_response_packet(j);
        let before = slot.in_flight();
        if j == 0 {
            // The server had the whole request: every request packet is
            // answered, whichever credit returns were lost.
            for k in slot.num_rx..slot.n_req {
                slot.answer(k);
            }
        } else if !early {
            slot.answer(k);
        }
        s.credits += before - slot.in_flight();
        s.rtt.sample(now - slot.sent);
        slot.progress = now;
        slot.retries = 0;
        if slot.num_rx == slot.total_tx() && slot.reading.is_none() {
            // Every packet of the response is in (a small call's only
            // one): completed now, and the session pumped at the end of
            // the receive batch only if other calls of it may use the
            // credits returned.
            complete(s, i, Ok(()));
            if s.active != 0 {
                self.defer_pump(sid);
            }
            return;
        }
        // Asks for what is missing (skipping what came early) and
        // completes the call, at the end of the receive batch.
        self.defer_pump(sid);
    }

    /// A small call's response: one packet, `Ok`, answering a call whose
    /// request was one packet or went whole over the link (sent once,
    /// nothing of it answered), with no READ or
    /// offer of its own: taken and the call completed here, with what
    /// [`on_response`](Self::on_response) would do for it and no more.
    /// False, with nothing changed, for any other packet (the general
    /// path then takes it, and counts what is wrong with it).
    #[inline]
    fn small_response(&mut self, h: &Header, payload: &[u8]) -> bool {
        let sid = h.dest_session;
        let (max_len, read_threshold, now) = (
            self.config.max_msg_len,
            self.config.read_threshold,
            self.now,
        );
        let Some(s) = self.sessions.get_mut(sid) else {
            return false;
        };
        let msg_len = h.msg_len as usize;
        let slot = &s.client[slot_of(h.req_num)];
        let small = h.pkt_idx == 0
            && h.pkt_count == 1
            && h.status == Status::Ok
            && s.role == Role::Client
            && s.remote == h.src_session
            && matches!(s.state, SessionState::Connected)
            && matches!(slot.state, CallState::Active)
            && slot.req_num == h.req_num
            && (slot.n_req == 1 || slot.link_sent.is_some())
            && slot.n_req <= WINDOW
            && slot.num_tx == slot.n_req
            && slot.num_rx == 0
            && slot.answered == 0
            && slot.n_resp == 0
            && slot.reading.is_none()
            && slot.offered == 0
            && payload.len() == msg_len
            && msg_len <= s.max_payload
            && msg_len <= max_len
            && msg_len < read_threshold;
        if !small {
            return false;
        }
        let i = slot_of(h.req_num);
        s.idle_sweeps = 0;
        let slot = &mut s.client[i];
        slot.resp.clear();
        slot.resp.extend_from_slice(payload);
        slot.resp_len = msg_len;
        slot.n_resp = 1;
        slot.resp_got.clear();
        slot.resp_got.push(1);
        slot.unasked = 1;
        // The request's packets are answered (a whole request over the
        // link, all of them): their credits come back.
        slot.num_rx = slot.n_req;
        s.credits += slot.n_req;
        s.rtt.sample(now - slot.sent);
        slot.progress = now;
        slot.retries = 0;
        complete_ok(s, i);
        // The credit back is for a call that waited for one, if any did:
        // the others sent what they had at their start or last pump.
        if s.active != 0 && s.starved {
            self.defer_pump(sid);
        }
        true
    }
}
