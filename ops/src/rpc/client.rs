//! The client half: starting calls, sending request packets under the
//! session's credits, taking answers, and completing calls.

use std::task::{Context, Poll};

use super::buf::MsgBuf;
use super::core::{Core, RpcStats};
use super::error::{RpcError, SessionId};
use super::header::{packets_for, Header, PacketKind, Status, HEADER_LEN, MAX_RANGE};
use super::link_send::{link_for, send_whole};
use super::session::{CallState, ClientSlot, Role, Session, SessionState, SESSION_SLOTS, WINDOW};
use super::transport::{Bulk, TxBatch};

/// Sends client packet `k` of `slot`: request packet `k`, or past the
/// request the request for response packet `k - n_req + 1` (and, in the
/// same packet, for the `more` response packets after it: client packets
/// `k + 1 ..= k + more`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn send_client_packet<P: Clone>(
    tx: &mut TxBatch<P>,
    s_peer: &P,
    remote: u32,
    local: u32,
    max_payload: usize,
    slot: &ClientSlot,
    k: usize,
    more: usize,
) {
    if let (true, Some((desc, len))) = (k < slot.n_req, &slot.req_desc) {
        let h = Header {
            req_type: slot.req_type,
            payload_len: super::header::BULK_DESC_LEN as u16,
            dest_session: remote,
            src_session: local,
            req_num: slot.req_num,
            msg_len: *len as u32,
            pkt_count: 1,
            ..Header::new(PacketKind::ReadRequest)
        };
        // (An offer of a buffer of its own went in an offer packet.)
        let offered = if slot.offer_exposed.is_some() {
            0
        } else {
            slot.offered
        };
        tx.push(s_peer, &h, &desc.encode_offer(offered));
    } else if k < slot.n_req {
        let start = k * max_payload;
        let end = (start + max_payload).min(slot.req.len());
        let h = Header {
            req_type: slot.req_type,
            payload_len: (end - start) as u16,
            dest_session: remote,
            src_session: local,
            req_num: slot.req_num,
            msg_len: slot.req.len() as u32,
            pkt_idx: k as u16,
            pkt_count: slot.n_req as u16,
            ..Header::new(PacketKind::Request)
        };
        tx.push(s_peer, &h, &slot.req[start..end]);
    } else {
        let h = Header {
            dest_session: remote,
            src_session: local,
            req_num: slot.req_num,
            pkt_idx: (k - slot.n_req + 1) as u16,
            pkt_count: more as u16,
            ..Header::new(PacketKind::RequestForResponse)
        };
        tx.push(s_peer, &h, &[]);
    }
}

/// Ends the call of slot `i` with `result`, returning the credits it holds.
pub(crate) fn complete<P>(s: &mut Session<P>, i: usize, result: Result<(), RpcError>) {
    let slot = &mut s.client[i];
    s.credits += slot.in_flight();
    slot.num_tx = slot.num_rx;
    slot.answered = 0;
    slot.state = CallState::Done(result);
    s.active &= !(1 << i);
    if slot.abandoned {
        free_slot(s, i);
    } else if let Some(w) = &slot.waker {
        // Kept: the slot's next call, made by the same task as a rule,
        // registers the same waker again (no clone, no drop per call).
        w.wake_by_ref();
    }
}

/// [`complete`] with `Ok` (a small call's response): inline.
#[inline(always)]
fn complete_ok<P>(s: &mut Session<P>, i: usize) {
    let slot = &mut s.client[i];
    s.credits += slot.in_flight();
    slot.num_tx = slot.num_rx;
    slot.answered = 0;
    slot.state = CallState::Done(Ok(()));
    s.active &= !(1 << i);
    if slot.abandoned {
        free_slot(s, i);
    } else if let Some(w) = &slot.waker {
        w.wake_by_ref();
    }
}

/// Makes slot `i` free for the next call (with the next request number).
#[inline]
pub(crate) fn free_slot<P>(s: &mut Session<P>, i: usize) {
    let slot = &mut s.client[i];
    slot.state = CallState::Free;
    slot.abandoned = false;
    slot.req_num += SESSION_SLOTS as u64;
    if let Some(w) = s.slot_waiters.pop_front() {
        w.wake();
    }
}

/// A call's request: bytes to copy into the slot, or a buffer the slot
/// takes (`None` once taken).
pub(crate) enum Req<'a> {
    Copy(&'a [u8]),
    Owned(&'a mut Option<Vec<u8>>),
}

impl Req<'_> {
    /// The request's length in bytes.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        match self {
            Req::Copy(data) => data.len(),
            Req::Owned(buf) => buf.as_ref().map_or(0, Vec::len),
        }
    }
}

/// Sends slot `i`'s request of session `s` (numbered `sid` here) whole
/// over `link` (`link_send.rs`), its packets' credits taken as sent:
/// whether it went (else the link broke and the pump sends it in packets).
#[allow(clippy::too_many_arguments)]
fn send_request_whole<P>(
    bulk: &mut Option<Box<dyn Bulk>>,
    stats: &mut RpcStats,
    broken: &mut Vec<u64>,
    s: &mut Session<P>,
    sid: u32,
    i: usize,
    link: u64,
    now: u64,
) -> bool {
    let slot = &mut s.client[i];
    let h = Header {
        req_type: slot.req_type,
        payload_len: slot.req.len() as u16,
        dest_session: s.remote,
        src_session: sid,
        req_num: slot.req_num,
        msg_len: slot.req.len() as u32,
        pkt_count: slot.n_req as u16,
        ..Header::new(PacketKind::Request)
    };
    if !send_whole(bulk, stats, broken, link, &h, &slot.req) {
        return false;
    }
    slot.num_tx = slot.n_req;
    slot.progress = now;
    slot.sent = now;
    slot.link_sent = Some(link);
    s.credits -= slot.n_req;
    true
}

impl<P: Clone> Core<P> {
    /// Takes a free slot of session `sid` for a call and sends what the
    /// credits allow; `Pending` while all slots are busy.
    pub(crate) fn poll_start(
        &mut self,
        sid: u32,
        req_type: u8,
        data: &mut Req<'_>,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(usize, u64), RpcError>> {
        let len = data.len();
        let session = SessionId(sid);
        let max = self.config.max_msg_len;
        let now = self.now;
        let read_threshold = self.config.read_threshold;
        let Some(s) = self.sessions.get(sid) else {
            return Poll::Ready(Err(RpcError::SessionClosed { session }));
        };
        // A message that fits a packet and is below the READ threshold
        // goes neither by READ nor over the link (`goes_bulk`): a small
        // call (its request, and the response its session expects) asks
        // the transport's large-message path nothing.
        let small = |n: usize| n <= s.max_payload && n < read_threshold;
        let small_call = small(len) && small(s.resp_hint);
        // A large request (by READ), or a large response expected (room
        // offered for it): the session's link is involved.
        let bulk_len = !small_call && self.is_bulk(len, s.max_payload);
        let (max_link_packet, has_bulk) = if small_call {
            (0, false)
        } else {
            (self.max_link_packet(), self.bulk.is_some())
        };
        let Some(s) = self.sessions.get_mut(sid) else {
            return Poll::Ready(Err(RpcError::SessionClosed { session }));
        };
        match s.state {
            SessionState::Connected if s.role == Role::Client => {}
            SessionState::Failed => return Poll::Ready(Err(RpcError::SessionFailed { session })),
            _ => return Poll::Ready(Err(RpcError::SessionClosed { session })),
        }
        let max = max.min(s.max_payload * u16::MAX as usize);
        if len > max {
            return Poll::Ready(Err(RpcError::RequestTooLarge { len, max }));
        }
        let Some(i) = s
            .client
            .iter()
            .position(|c| matches!(c.state, CallState::Free))
        else {
            if !s.slot_waiters.iter().any(|w| w.will_wake(cx.waker())) {
                s.slot_waiters.push_back(cx.waker().clone());
            }
            return Poll::Pending;
        };
        s.active |= 1 << i;
        let slot = &s.client[i];
        let s = if slot.holds_request() || slot.req_desc.is_some() {
            // The last call's request was read by the server: taken back.
            self.take_back_request(sid, i);
            match self.sessions.get_mut(sid) {
                Some(s) => s,
                None => return Poll::Ready(Err(RpcError::SessionClosed { session })),
            }
        } else {
            s
        };
        let max_payload = s.max_payload;
        let offer = !small_call
            && !bulk_len
            && super::bulk::goes_bulk(
                &self.config,
                max_link_packet,
                has_bulk,
                s.resp_hint,
                max_payload,
            );
        let slot = &mut s.client[i];
        slot.state = CallState::Active;
        slot.abandoned = false;
        // The caller's waker, registered now: whatever completes the call
        // from here on wakes it, so the caller need not poll the call
        // before it yields (`Rpc::call_req`).
        match &mut slot.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            w => *w = Some(cx.waker().clone()),
        }
        slot.req_type = req_type;
        match data {
            Req::Copy(data) => {
                slot.req.clear();
                slot.req.extend_from_slice(data);
            }
            Req::Owned(buf) => {
                let old = std::mem::replace(&mut slot.req, buf.take().unwrap_or_default());
                self.pool.put(old);
            }
        }
        slot.resp.clear();
        slot.n_req = packets_for(len, max_payload);
        slot.n_resp = 0;
        slot.unasked = 0;
        slot.paused = false;
        slot.awaits_link = false;
        slot.relinked = false;
        slot.link_sent = None;
        slot.req_writing = None;
        slot.num_tx = 0;
        slot.num_rx = 0;
        slot.answered = 0;
        slot.retries = 0;
        slot.progress = now;
        slot.sent = now;
        let req_num = slot.req_num;
        if !bulk_len && !offer && slot.n_req == 1 {
            // Neither the request nor the response goes over the link (a
            // request of several packets may: it asks for the link below):
            // a one-packet request leaves now, no pump over the slots, if
            // it has a credit and no other call waits for one (none did at
            // the last pump, and whatever let one send since, a credit
            // come back, a pause over, a link settled, pumps the session
            // at the end of its batch).
            if s.credits > 0 && !s.starved {
                // Its one packet (what `send_client_packet` sends for
                // packet 0 of a request that is not read, inline).
                let h = Header {
                    req_type,
                    payload_len: slot.req.len() as u16,
                    dest_session: s.remote,
                    src_session: sid,
                    req_num,
                    msg_len: slot.req.len() as u32,
                    pkt_idx: 0,
                    pkt_count: 1,
                    ..Header::new(PacketKind::Request)
                };
                self.tx.push(&s.peer, &h, &slot.req);
                slot.num_tx = 1;
                s.credits -= 1;
            } else {
                self.pump(sid);
            }
            self.want_timer();
            return Poll::Ready(Ok((i, req_num)));
        }
        if bulk_len {
            if self.expose_request(sid, i) {
                if let Some(s) = self.sessions.get_mut(sid) {
                    let slot = &mut s.client[i];
                    slot.n_req = 1;
                    if slot.req_writing.is_some() {
                        // Written (`bulk_write.rs`): its one packet is
                        // the WRITE, under way, which took its credit and
                        // so let no other call send: nothing to pump.
                        self.want_timer();
                        return Poll::Ready(Ok((i, req_num)));
                    }
                }
            } else {
                self.want_link(sid);
                // While the link is set up the request waits for it rather
                // than streaming: a window of large calls at a session's
                // start would otherwise all stream, about a thousand
                // packets per MiB at rxe's 1 KiB MTU. `link_settled`
                // sends it.
                if let Some(s) = self.sessions.get_mut(sid) {
                    if s.link_pending() {
                        s.client[i].awaits_link = true;
                    }
                }
            }
        } else {
            // A large response may come: room for it (`bulk_write.rs`;
            // none unless `offer`).
            if offer {
                self.offer_room(sid, i);
            }
            // A mid-size request (above a packet, below the READ threshold,
            // fitting a link packet: `is_bulk` is false here) goes over the link.
            if len > max_payload
                && read_threshold != usize::MAX
                && HEADER_LEN + len <= max_link_packet
            {
                // Mid-size requests go over the link once it is ready;
                // this one waits for it while it is set up (`link_send.rs`).
                self.want_link(sid);
                self.await_link(sid, i);
            }
        }
        if !self.send_lone_request(sid, i) && !self.send_linked_request(sid, i) {
            self.pump(sid);
        }
        self.want_timer();
        Poll::Ready(Ok((i, req_num)))
    }

    /// Sends the request of slot `i`, of several packets, whole over
    /// session `sid`'s ready link (`link_send.rs`) at its start, as the
    /// pump would, if its credits cover all its packets and no other call
    /// waits for credits (none did at the last pump): no pump over the
    /// slots. False (nothing sent) otherwise: the pump sends it.
    fn send_linked_request(&mut self, sid: u32, i: usize) -> bool {
        let now = self.now;
        let read_threshold = self.config.read_threshold;
        let max_link_packet = self.max_link_packet();
        let Some(s) = self.sessions.get_mut(sid) else {
            return false;
        };
        let slot = &s.client[i];
        if s.starved
            || slot.num_tx != 0
            || slot.req_desc.is_some()
            || slot.paused
            || slot.awaits_link
            || slot.n_req > WINDOW
            || s.credits < slot.n_req
        {
            return false;
        }
        let Some(link) = link_for(
            s.link_ready(),
            slot.n_req,
            slot.req.len(),
            read_threshold,
            max_link_packet,
        ) else {
            return false;
        };
        send_request_whole(
            &mut self.bulk,
            &mut self.stats,
            &mut self.links_broken,
            s,
            sid,
            i,
            link,
            now,
        )
    }

    /// Sends the request of slot `i` if it is one packet and the only call
    /// of session `sid` under way (as a call made one at a time is): no
    /// pump over the slots, as no other call waits for the credit. False
    /// (nothing sent) otherwise: the pump sends it.
    fn send_lone_request(&mut self, sid: u32, i: usize) -> bool {
        let Some(s) = self.sessions.get_mut(sid) else {
            return false;
        };
        let slot = &s.client[i];
        let lone = s.active == 1 << i
            && s.credits > 0
            && slot.n_req == 1
            && slot.num_tx == 0
            && slot.req_desc.is_none()
            && !slot.paused
            && !slot.awaits_link;
        if !lone {
            return false;
        }
        send_client_packet(
            &mut self.tx,
            &s.peer,
            s.remote,
            sid,
            s.max_payload,
            slot,
            0,
            0,
        );
        s.client[i].num_tx = 1;
        s.credits -= 1;
        true
    }

    /// Whether calls of session `sid` other than slot `i`'s are under way.
    pub(crate) fn others_active(&self, sid: u32, i: usize) -> bool {
        self.sessions
            .get(sid)
            .is_some_and(|s| s.active & !(1u8 << i) != 0)
    }

    /// A call that waited for a slot was dropped: hands its turn on.
    pub(crate) fn pass_slot_turn(&mut self, sid: u32) {
        if let Some(s) = self.sessions.get_mut(sid) {
            if s.client.iter().any(|c| matches!(c.state, CallState::Free)) {
                if let Some(w) = s.slot_waiters.pop_front() {
                    w.wake();
                }
            }
        }
    }

    /// The result of the call in slot `i`, once it is there.
    pub(crate) fn poll_call(
        &mut self,
        sid: u32,
        i: usize,
        req_num: u64,
        cx: &mut Context<'_>,
    ) -> Poll<Result<MsgBuf, RpcError>> {
        let session = SessionId(sid);
        let Some(s) = self.sessions.get_mut(sid) else {
            return Poll::Ready(Err(RpcError::SessionClosed { session }));
        };
        let slot = &mut s.client[i];
        if slot.req_num != req_num {
            return Poll::Ready(Err(RpcError::SessionClosed { session }));
        }
        if slot.holds_request() && matches!(slot.state, CallState::Done(_)) {
            // The call is over: the server reads and writes its buffer no
            // more, so it is withdrawn now rather than kept exposed until
            // the slot's next call.
            self.take_back_request(sid, i);
            return self.poll_call(sid, i, req_num, cx);
        }
        if matches!(slot.state, CallState::Done(Ok(()))) {
            // A call that succeeded, as most do (its buffers withdrawn
            // above): its response, with no move of the state out and
            // back.
            let resp = std::mem::replace(&mut slot.resp, self.pool.take());
            free_slot(s, i);
            return Poll::Ready(Ok(self.pool.msg(resp)));
        }
        match std::mem::replace(&mut slot.state, CallState::Active) {
            CallState::Active => {
                match &mut slot.waker {
                    Some(w) if w.will_wake(cx.waker()) => {}
                    w => *w = Some(cx.waker().clone()),
                }
                Poll::Pending
            }
            CallState::Done(result) => {
                let out = result.map(|()| {
                    let resp = std::mem::replace(&mut slot.resp, self.pool.take());
                    self.pool.msg(resp)
                });
                free_slot(s, i);
                Poll::Ready(out)
            }
            CallState::Free => {
                slot.state = CallState::Free;
                Poll::Ready(Err(RpcError::SessionClosed { session }))
            }
        }
    }

    /// The call future of slot `i` was dropped before its result.
    pub(crate) fn abandon(&mut self, sid: u32, i: usize, req_num: u64) {
        if let Some(s) = self.sessions.get_mut(sid) {
            let slot = &mut s.client[i];
            if slot.req_num != req_num {
                return;
            }
            match slot.state {
                CallState::Active => {
                    slot.abandoned = true;
                    slot.waker = None;
                }
                CallState::Done(_) => {
                    free_slot(s, i);
                    let slot = &s.client[i];
                    if slot.holds_request() {
                        self.take_back_request(sid, i);
                    }
                }
                CallState::Free => {}
            }
        }
    }

    /// Sends what the credits of session `sid` allow, slots in round robin,
    /// and completes the calls whose response is all in.
    pub(crate) fn pump(&mut self, sid: u32) {
        let now = self.now;
        let read_threshold = self.config.read_threshold;
        let max_link_packet = self.max_link_packet();
        #[cfg(test)]
        {
            self.work.pumps += 1;
        }
        let Some(s) = self.sessions.get_mut(sid) else {
            return;
        };
        let start = s.pump_from;
        s.pump_from = (start + 1) % SESSION_SLOTS;
        s.starved = false;
        // The active slots, from `start` on: bit `step` is slot
        // `(start + step) % SESSION_SLOTS`.
        let mut todo = s.active.rotate_right(start as u32);
        let link_ready = s.link_ready();
        while todo != 0 {
            let step = todo.trailing_zeros() as usize;
            todo &= todo - 1;
            let i = (start + step) % SESSION_SLOTS;
            let slot = &mut s.client[i];
            debug_assert!(matches!(slot.state, CallState::Active));
            if slot.paused || slot.awaits_link {
                continue;
            }
            if slot.num_tx == 0 && slot.req_desc.is_none() && slot.n_req <= WINDOW {
                slot.link_sent = None;
                // The whole request in one packet over the link
                // (`link_send.rs`), its packets' credits taken as sent.
                let link = link_for(
                    link_ready,
                    slot.n_req,
                    slot.req.len(),
                    read_threshold,
                    max_link_packet,
                );
                if link.is_some() && s.credits < slot.n_req {
                    // It waits for the credits of all its packets rather
                    // than streaming on a part of them (`link_send.rs`).
                    s.starved = true;
                    continue;
                }
                if let Some(link) = link {
                    send_request_whole(
                        &mut self.bulk,
                        &mut self.stats,
                        &mut self.links_broken,
                        s,
                        sid,
                        i,
                        link,
                        now,
                    );
                }
            }
            let slot = &mut s.client[i];
            while slot.num_tx < slot.total_tx() && slot.num_tx - slot.num_rx < WINDOW {
                let k = slot.num_tx;
                if k >= slot.n_req && slot.has_response_packet(k - slot.n_req + 1) {
                    // Came before it was asked for: answered, no credit.
                    slot.num_tx += 1;
                    slot.answer(k);
                    continue;
                }
                if s.credits == 0 {
                    s.starved = true;
                    break;
                }
                if k >= slot.n_req && k - slot.n_req + 1 < slot.unasked {
                    // Sent by the server unasked: counted, not sent.
                    slot.num_tx += 1;
                    slot.progress = now;
                    slot.sent = now;
                    s.credits -= 1;
                    continue;
                }
                // Requests for response packets go out as one packet per
                // run of missing ones (each still takes a credit).
                let n = if k < slot.n_req {
                    1
                } else {
                    let room = WINDOW - (slot.num_tx - slot.num_rx);
                    let most = (slot.total_tx() - k)
                        .min(s.credits)
                        .min(room)
                        .min(MAX_RANGE);
                    let first = k - slot.n_req + 1;
                    (1..most)
                        .find(|&m| slot.has_response_packet(first + m))
                        .unwrap_or(most)
                };
                send_client_packet(
                    &mut self.tx,
                    &s.peer,
                    s.remote,
                    sid,
                    s.max_payload,
                    slot,
                    k,
                    n - 1,
                );
                slot.num_tx += n;
                slot.progress = now;
                slot.sent = now;
                s.credits -= n;
            }
            if slot.n_resp > 0 && slot.num_rx == slot.total_tx() && slot.reading.is_none() {
                // Every packet of the response is in.
                complete(s, i, Ok(()));
            }
        }
    }

    /// The active slot of a client session `h` answers, if `h`'s request
    /// number is its current one.
    pub(crate) fn answered_slot(&mut self, h: &Header) -> Option<usize> {
        let s = self.session_for(h, Role::Client)?;
        let i = (h.req_num % SESSION_SLOTS as u64) as usize;
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
                // again over a new link, once (`bulk.rs`).
                if self.read_failed_retry(sid, i) {
                    return;
                }
                let Some(s) = self.sessions.get_mut(sid) else {
                    return;
                };
                super::bulk::close_link(&mut self.bulk, s);
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
                let e = RpcError::ResponseTooLarge {
                    session: SessionId(sid),
                    req_num: h.req_num,
                    len: msg_len,
                    max: max_len,
                };
                complete(s, i, Err(e));
                return;
            }
            if n_resp != packets_for(msg_len, max_payload) || j >= n_resp {
                self.stats.malformed_packets += 1;
                return;
            }
            if msg_len > max_payload
                && msg_len < read_threshold
                && read_threshold != usize::MAX
                && super::header::HEADER_LEN + msg_len <= max_link_packet
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
                // one (`bulk_write.rs`), and the session asks for its
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
        if start == slot.resp.len() {
            // In order: appended, no zero fill.
            slot.resp.extend_from_slice(payload);
        } else {
            if end > slot.resp.len() {
                // Grown as packets arrive, never to the claimed length at once.
                slot.resp.resize(end, 0);
            }
            slot.resp[start..end].copy_from_slice(payload);
        }
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
        let slot = &s.client[(h.req_num % SESSION_SLOTS as u64) as usize];
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
        let i = (h.req_num % SESSION_SLOTS as u64) as usize;
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

    /// Pumps session `sid` at the end of the receive batch (`run_pumps`):
    /// the credits its packets return add up to runs.
    pub(crate) fn defer_pump(&mut self, sid: u32) {
        if !self.pumps.contains(&sid) {
            self.pumps.push(sid);
        }
    }

    /// Pumps the sessions that had answers in this receive batch.
    pub(crate) fn run_pumps(&mut self) {
        while let Some(sid) = self.pumps.pop() {
            self.pump(sid);
        }
        while let Some(sid) = self.links_wanted.pop() {
            self.want_link(sid);
        }
    }
}
