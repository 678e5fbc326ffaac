//! The server half: reassembling requests, suppressing duplicates, handing
//! requests to handler tasks, and sending (and resending) responses.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::rc::Rc;
use std::task::{Context, Poll};

use tracing::{error, trace, warn};

use super::budget::{Budget, Charge};
use super::buf::MsgBuf;
use super::core::{open_session, Core, RpcStats, Start, StartRunner};
use super::endpoint::Request;
use super::error::SessionId;
use super::header::{packets_for, Header, PacketKind, Status, MAX_MSG_LEN, MAX_RANGE};
use super::link_send::{link_for, send_whole};
use super::runner::{JobId, Outcome, Runner};
use super::session::{Role, ServeState, ServerSlot, Session, SessionState, SESSION_SLOTS};
use super::transport::TxBatch;

/// What a handler task does next ([`Core::poll_work`]).
pub(crate) enum Work {
    /// Polls the future the dispatcher left waiting in its slot.
    Resume(JobId),
    /// Starts a request that was queued while every task was busy.
    Start(JobId, Request),
}

/// Sends a credit return for request packet `idx` of `slot`.
fn send_credit_return<P: Clone>(
    tx: &mut TxBatch<P>,
    peer: &P,
    remote: u32,
    local: u32,
    slot: &ServerSlot,
    idx: u16,
) {
    let h = Header {
        dest_session: remote,
        src_session: local,
        req_num: slot.req_num,
        pkt_idx: idx,
        ..Header::new(PacketKind::CreditReturn)
    };
    tx.push(peer, &h, &[]);
}

/// Sends response packet `j` of `slot` (which holds its response), or
/// its read response if the response is exposed.
pub(crate) fn send_response<P: Clone>(
    tx: &mut TxBatch<P>,
    peer: &P,
    remote: u32,
    local: u32,
    max_payload: usize,
    slot: &ServerSlot,
    j: usize,
) {
    if let Some((_, desc, len)) = &slot.resp_exposed {
        let h = Header {
            payload_len: super::header::BULK_DESC_LEN as u16,
            dest_session: remote,
            src_session: local,
            req_num: slot.req_num,
            msg_len: *len as u32,
            pkt_count: 1,
            ..Header::new(PacketKind::ReadResponse)
        };
        tx.push(peer, &h, &desc.encode());
        return;
    }
    let Some(resp) = &slot.resp else {
        return;
    };
    let start = j * max_payload;
    let end = (start + max_payload).min(resp.len());
    let h = Header {
        req_type: slot.req_type,
        status: slot.status,
        payload_len: (end - start) as u16,
        dest_session: remote,
        src_session: local,
        req_num: slot.req_num,
        msg_len: resp.len() as u32,
        pkt_idx: j as u16,
        pkt_count: slot.n_resp as u16,
        ..Header::new(PacketKind::Response)
    };
    tx.push(peer, &h, &resp[start..end]);
}

/// Request packets received in this receive batch, to acknowledge: the
/// contiguous run `first..=last` of request `req_num` in a slot.
pub(crate) struct PendingAck {
    sid: u32,
    slot: usize,
    req_num: u64,
    first: u16,
    last: u16,
}

/// Adds request packet `idx` to the acknowledgements of this batch: to
/// the run it extends, or as a new one.
fn queue_ack(acks: &mut Vec<PendingAck>, sid: u32, slot: usize, req_num: u64, idx: u16) {
    let run = acks
        .iter_mut()
        .rev()
        .find(|a| a.sid == sid && a.slot == slot);
    match run {
        Some(a)
            if a.req_num == req_num
                && idx.checked_sub(1) == Some(a.last)
                && usize::from(idx - a.first) < MAX_RANGE =>
        {
            a.last = idx;
        }
        _ => acks.push(PendingAck {
            sid,
            slot,
            req_num,
            first: idx,
            last: idx,
        }),
    }
}

/// Words of a slot's packet bitmap kept between requests (for requests of
/// up to 1024 packets); larger bitmaps are freed when their request is
/// complete.
const KEEP_BITMAP_WORDS: usize = 16;

/// A request's first packet dropped because the request memory budget
/// has no room for the request:
/// counted, and logged at the 1st, 2nd, 4th, 8th... time.
pub(crate) fn budget_drop(stats: &mut RpcStats, budget: &Budget, sid: u32, h: &Header) {
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
        let i = (h.req_num % SESSION_SLOTS as u64) as usize;
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
        let i = (h.req_num % SESSION_SLOTS as u64) as usize;
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
        let i = (h.req_num % SESSION_SLOTS as u64) as usize;
        let slot = &mut s.server[i];
        if slot.state == ServeState::Idle || h.req_num > slot.req_num || slot.read_failed(h.req_num)
        {
            if slot.state == ServeState::Handling {
                // The previous request's handler still runs; the client
                // sends this one again.
                self.stats.stale_packets += 1;
                return;
            }
            if too_large {
                // Refused with nothing kept but the slot's answer.
                self.stats.malformed_packets += 1;
                slot.drop_partial();
                slot.req_num = h.req_num;
                slot.req_type = h.req_type;
                slot.msg_len = msg_len;
                slot.n_req = usize::from(h.pkt_count);
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
                budget_drop(&mut self.stats, &self.budget, sid, h);
                // Busy: the client takes its credits back and sends the
                // request again after its timeout, when the budget may
                // have room; the call stays alive meanwhile.
                let busy = Header {
                    status: Status::Busy,
                    dest_session: s.remote,
                    src_session: sid,
                    req_num: h.req_num,
                    pkt_idx: h.pkt_idx,
                    ..Header::new(PacketKind::CreditReturn)
                };
                self.tx.push(&s.peer, &busy, &[]);
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
                let end = start + payload.len();
                if start == slot.req.len() {
                    // In order: appended, no zero fill.
                    slot.req.extend_from_slice(payload);
                } else {
                    if end > slot.req.len() {
                        // Grown to this packet's end (reserved already).
                        slot.req.resize(end, 0);
                    }
                    slot.req[start..end].copy_from_slice(payload);
                }
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

    /// Hands the whole request in slot `i` of session `sid` to a handler task.
    pub(crate) fn dispatch(&mut self, sid: u32, i: usize) {
        let Some(s) = self.sessions.get_mut(sid) else {
            return;
        };
        let slot = &mut s.server[i];
        if slot.got.capacity() > KEEP_BITMAP_WORDS {
            // A large request's bitmap: not kept.
            slot.got = Vec::new();
        }
        let Some(queue) = self.handlers[usize::from(slot.req_type)].as_mut() else {
            self.pool.put(std::mem::take(&mut slot.req));
            slot.charge.release();
            self.stats.unhandled_requests += 1;
            warn!(
                session = sid,
                req_num = slot.req_num,
                req_type = slot.req_type,
                "rpc: no handler for the request type; request ignored"
            );
            self.refuse(sid, i, Status::NoHandler);
            return;
        };
        slot.state = ServeState::Handling;
        self.stats.handler_runs += 1;
        let id = JobId {
            session: sid,
            slot: i,
            req_num: slot.req_num,
        };
        let req_type = slot.req_type;
        if let Some(handler) = queue.inline.clone() {
            let request = Request {
                req_type,
                session: SessionId(sid),
                data: self.pool.msg(std::mem::take(&mut slot.req)),
                _charge: std::mem::take(&mut slot.charge),
            };
            // Run here: no task, no queue; a panic fails this call only.
            match catch_unwind(AssertUnwindSafe(|| handler(request))) {
                Ok(resp) => self.respond(sid, i, id.req_num, resp),
                Err(_) => self.handler_panicked(sid, i, id.req_num),
            }
            return;
        }
        // The request stays in its slot until a task takes it
        // (`take_request`). A task that ended (its runtime shutting down)
        // is skipped.
        let idle =
            std::iter::from_fn(|| queue.idle.pop()).find_map(|(w, r)| Some((w, r.upgrade()?)));
        match idle {
            // Started in that task's slot once the dispatcher holds no
            // borrow of the engine (`Engine::start_handlers`).
            Some(runner) => self.starts.push_back(Start {
                id,
                req_type,
                runner,
            }),
            // Every task is busy: the next one to finish takes it.
            None => {
                self.jobs_open += 1;
                queue.jobs.push_back(id);
            }
        }
    }

    /// The request `id` dispatched to a handler task, taken out of its
    /// slot for the handler: `None` if it is not there any more (its
    /// session closed meanwhile: no handler runs for it).
    pub(crate) fn take_request(&mut self, id: JobId) -> Option<Request> {
        let s = self.sessions.get_mut(id.session)?;
        let slot = &mut s.server[id.slot];
        if slot.req_num != id.req_num || slot.state != ServeState::Handling {
            return None;
        }
        Some(Request {
            req_type: slot.req_type,
            session: SessionId(id.session),
            data: self.pool.msg(std::mem::take(&mut slot.req)),
            _charge: std::mem::take(&mut slot.charge),
        })
    }

    /// A handler task waits for work: a future the dispatcher started in
    /// its slot and left waiting (`Resume`), or a request queued while
    /// every task was busy (`Start`); else it is idle, and the dispatcher
    /// starts the next request in its slot with its waker.
    pub(crate) fn poll_work(
        &mut self,
        req_type: u8,
        runner: &Rc<dyn Runner>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Work>> {
        if let Some(id) = runner.waiting().take() {
            return Poll::Ready(Some(Work::Resume(id)));
        }
        loop {
            let Some(queue) = self.handlers[usize::from(req_type)].as_mut() else {
                return Poll::Ready(None);
            };
            let Some(id) = queue.jobs.pop_front() else {
                break;
            };
            match self.take_request(id) {
                Some(request) => return Poll::Ready(Some(Work::Start(id, request))),
                // Its session closed while it waited: no longer open.
                None => self.jobs_open = self.jobs_open.saturating_sub(1),
            }
        }
        let Some(queue) = self.handlers[usize::from(req_type)].as_mut() else {
            return Poll::Ready(None);
        };
        if !queue.idle.iter().any(|(w, _)| w.will_wake(cx.waker())) {
            queue.idle.push((cx.waker().clone(), Rc::downgrade(runner)));
        }
        Poll::Pending
    }

    /// The dispatcher started a request in an idle task's slot and got
    /// `outcome` (`Engine::start_handlers`): a response is sent and the
    /// task is idle again (or takes the next queued request, started
    /// likewise); a future that waits is left to the task.
    pub(crate) fn started(
        &mut self,
        id: JobId,
        req_type: u8,
        runner: StartRunner,
        outcome: Poll<Outcome>,
    ) {
        match outcome {
            Poll::Ready(Ok(resp)) => self.respond(id.session, id.slot, id.req_num, resp),
            Poll::Ready(Err(())) => self.handler_panicked(id.session, id.slot, id.req_num),
            Poll::Pending => {
                // Its waker, the task's, brings the task to it.
                runner.1.waiting().set(Some(id));
                self.jobs_open += 1;
                return;
            }
        }
        self.runner_free(req_type, runner);
    }

    /// An idle handler task's slot is free again: it takes the next
    /// request queued for its type (started likewise), or goes idle.
    pub(crate) fn runner_free(&mut self, req_type: u8, runner: StartRunner) {
        let Some(queue) = self.handlers[usize::from(req_type)].as_mut() else {
            return;
        };
        match queue.jobs.pop_front() {
            Some(id) => {
                self.jobs_open -= 1;
                self.starts.push_back(Start {
                    id,
                    req_type,
                    runner,
                });
            }
            None => queue.idle.push((runner.0, Rc::downgrade(&runner.1))),
        }
    }

    /// A handler finished: caches the response in its slot and sends its
    /// first [`response_window`](super::RpcConfig::response_window) packets
    /// (the rest go out as the client asks for them).
    pub(crate) fn respond(&mut self, sid: u32, i: usize, req_num: u64, resp: MsgBuf) {
        let window = self.config.response_window;
        let Some(s) = self.sessions.get_mut(sid) else {
            return;
        };
        let slot = &s.server[i];
        if slot.req_num != req_num || slot.state != ServeState::Handling {
            return;
        }
        let max_payload = s.max_payload;
        // One that fits a packet below the READ threshold goes in it (see
        // `goes_bulk`): the large-message path is not asked.
        let small = resp.len() <= max_payload && resp.len() < self.config.read_threshold;
        if small && window > 0 {
            // A small call's response: one packet, sent now (what the
            // general path below does for it, with no second lookup of
            // the session, no link asked and no loop).
            let (peer, remote) = (&s.peer, s.remote);
            let slot = &mut s.server[i];
            slot.n_resp = 1;
            slot.state = ServeState::Responded;
            let h = Header {
                req_type: slot.req_type,
                status: slot.status,
                payload_len: resp.len() as u16,
                dest_session: remote,
                src_session: sid,
                req_num,
                msg_len: resp.len() as u32,
                pkt_idx: 0,
                pkt_count: 1,
                ..Header::new(PacketKind::Response)
            };
            self.tx.push(peer, &h, &resp);
            slot.resp = Some(resp);
            return;
        }
        let resp = if !small
            && self.is_bulk(resp.len(), max_payload)
            && resp.len() <= MAX_MSG_LEN as usize
        {
            // Written into the client's offered buffer, else exposed for
            // it to READ (`bulk_write.rs`, `bulk.rs`).
            let resp = match self.write_response(sid, i, req_num, resp.into_vec()) {
                Ok(()) => return,
                Err(buf) => buf,
            };
            match self.expose_response(sid, i, resp) {
                // Exposed: the client READs it.
                None => {
                    if let Some(s) = self.sessions.get_mut(sid) {
                        let slot = &mut s.server[i];
                        slot.n_resp = 1;
                        slot.state = ServeState::Responded;
                        send_response(&mut self.tx, &s.peer, s.remote, sid, s.max_payload, slot, 0);
                    }
                    return;
                }
                Some(buf) => self.pool.msg(buf),
            }
        } else {
            resp
        };
        let Some(s) = self.sessions.get_mut(sid) else {
            return;
        };
        let max_payload = s.max_payload;
        let link_ready = s.link_ready();
        let slot = &mut s.server[i];
        let n_resp = packets_for(resp.len(), max_payload);
        if resp.len() > MAX_MSG_LEN as usize || n_resp > usize::from(u16::MAX) {
            error!(
                session = sid,
                req_num,
                len = resp.len(),
                "rpc: a handler's response is larger than a message may be; not sent"
            );
            self.refuse(sid, i, Status::ResponseTooLarge);
            return;
        }
        slot.n_resp = n_resp;
        slot.resp = Some(resp);
        slot.state = ServeState::Responded;
        if n_resp > 1 && n_resp <= window {
            // All of it unasked: in one packet over the link, if it has
            // one ready (`link_send.rs`).
            let len = slot.resp.as_ref().map_or(0, |r| r.len());
            // Asked only here: a link carries no one-packet message.
            let max_link_packet = self.bulk.as_ref().map_or(0, |b| b.max_link_packet());
            let link = link_for(
                link_ready,
                n_resp,
                len,
                self.config.read_threshold,
                max_link_packet,
            );
            if let (Some(link), Some(resp)) = (link, &slot.resp) {
                let h = Header {
                    req_type: slot.req_type,
                    status: slot.status,
                    payload_len: len as u16,
                    dest_session: s.remote,
                    src_session: sid,
                    req_num,
                    msg_len: len as u32,
                    pkt_count: n_resp as u16,
                    ..Header::new(PacketKind::Response)
                };
                if send_whole(
                    &mut self.bulk,
                    &mut self.stats,
                    &mut self.links_broken,
                    link,
                    &h,
                    resp,
                ) {
                    return;
                }
            }
        }
        // The first packets at once; the client asks for the rest.
        for j in 0..n_resp.min(window) {
            send_response(&mut self.tx, &s.peer, s.remote, sid, max_payload, slot, j);
        }
    }

    /// A handler task panicked on request `req_num` of slot `i`.
    pub(crate) fn handler_panicked(&mut self, sid: u32, i: usize, req_num: u64) {
        self.stats.handler_panics += 1;
        error!(session = sid, req_num, "rpc: a handler panicked");
        if let Some(s) = self.sessions.get(sid) {
            let slot = &s.server[i];
            if slot.req_num == req_num && slot.state == ServeState::Handling {
                self.refuse(sid, i, Status::HandlerPanicked);
            }
        }
    }

    /// Answers the request in slot `i` with the error `status` (an empty
    /// response, cached like any other).
    pub(crate) fn refuse(&mut self, sid: u32, i: usize, status: Status) {
        let empty = self.pool.msg(self.pool.take());
        let Some(s) = self.sessions.get_mut(sid) else {
            return;
        };
        let slot = &mut s.server[i];
        if let (Some((token, _, _)), Some(bulk)) = (slot.resp_exposed.take(), &mut self.bulk) {
            if let Some(buf) = bulk.unexpose(token) {
                self.pool.put(buf);
            }
        }
        slot.status = status;
        slot.resp = Some(empty);
        slot.n_resp = 1;
        slot.state = ServeState::Responded;
        send_response(&mut self.tx, &s.peer, s.remote, sid, s.max_payload, slot, 0);
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

    /// A request for response packet `pkt_idx`.
    pub(crate) fn on_request_for_response(&mut self, h: &Header) {
        let sid = h.dest_session;
        let Some(s) = open_session(&mut self.sessions, &mut self.stats, h, Role::Server) else {
            return;
        };
        let slot = &s.server[(h.req_num % SESSION_SLOTS as u64) as usize];
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
}
