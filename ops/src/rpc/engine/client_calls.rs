//! The client's calls: a call takes a free slot, sends what the
//! session's credits allow (a one-packet request at once, a larger one
//! by the pump over the slots, in round robin), and takes its result.

use std::task::{Context, Poll};

use crate::rpc::buf::MsgBuf;
use crate::rpc::error::{RpcError, SessionId};
use crate::rpc::header::{packets_for, Header, PacketKind, HEADER_LEN, MAX_RANGE};
use crate::rpc::session::{CallState, Role, Session, SessionState, SESSION_SLOTS, WINDOW};
use crate::rpc::transport::Bulk;
use crate::rpc::waker::keep_waker;

use super::call_end::{complete, free_slot};
use super::link_send::send_whole;
use super::packets::send_client_packet;
use super::paths::{goes_bulk, link_for};
use super::{Core, RpcStats};

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
            && goes_bulk(
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
        keep_waker(&mut slot.waker, cx);
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
                        // Written (`written_requests.rs`): its one packet is
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
            // A large response may come: room for it (`written_responses.rs`;
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
                keep_waker(&mut slot.waker, cx);
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
