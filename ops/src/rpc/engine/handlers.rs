//! The server's handlers: a whole request handed to its handler task (or
//! inline handler), the handler's response sent (or its panic or a
//! refusal answered).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::rc::Rc;
use std::task::{Context, Poll};

use tracing::{error, warn};

use crate::rpc::buf::MsgBuf;
use crate::rpc::error::SessionId;
use crate::rpc::header::{packets_for, Header, PacketKind, Status, MAX_MSG_LEN};
use crate::rpc::request::Request;
use crate::rpc::runner::{JobId, Outcome, Runner};
use crate::rpc::session::ServeState;

use super::link_send::send_whole;
use super::packets::send_response;
use super::paths::link_for;
use super::server_requests::KEEP_BITMAP_WORDS;
use super::{Core, Start, StartRunner};

/// What a handler task does next ([`Core::poll_work`]).
pub(crate) enum Work {
    /// Polls the future the dispatcher left waiting in its slot.
    Resume(JobId),
    /// Starts a request that was queued while every task was busy.
    Start(JobId, Request),
}

impl<P: Clone> Core<P> {
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
    /// first [`response_window`](crate::rpc::RpcConfig::response_window) packets
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
            // it to READ (`written_responses.rs`, `read_path.rs`).
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
}
