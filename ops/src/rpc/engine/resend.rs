//! Retransmission: resends what a slot or a connect has not had answered
//! for a timeout (a slot's first resend: the session's learned one,
//! `rtt.rs`), and fails the session of a peer that stopped answering.

use tracing::debug;

use crate::rpc::session::{CallState, Role, SessionState, SESSION_SLOTS};

use super::call_end::fail_session;
use super::links::link_tick;
use super::packets::send_client_packet;
use super::release::{expose_written, release_bulk};
use super::Core;

/// Timer ticks per retransmission timeout: a slot is resent after 3 to 4
/// ticks without progress, between `rto` and `4/3 rto`.
pub(crate) const TICKS_PER_RTO: u32 = 3;

/// Doublings of a connect's resend interval at most (then it stays at
/// `rto * 2^CONNECT_BACKOFF_MAX`).
const CONNECT_BACKOFF_MAX: u32 = 6;

/// The slowest rate (bytes per second) a READ or WRITE under way is
/// granted: a call whose request or response moves in one transfer
/// may go unanswered one more `rto` per `rto`'s worth of its bytes at
/// this rate, beyond `max_retries` (`extra_retries`). The answers to its
/// resends ("in progress") normally keep it alive however long it takes;
/// this covers a device that carries no datagram for a while around a
/// transfer (the soft device with its engine thread preempted on a
/// loaded host, the datagrams queued behind it), and still fails a call
/// whose peer vanished within the session's bound plus the transfer's
/// time at this rate (16 MiB: 250 ms).
pub(crate) const TRANSFER_FLOOR_RATE: u64 = 64 << 20;

/// The resends a call whose `bytes` may be under way gets beyond
/// `max_retries`, with resends `rto` apart.
pub(crate) fn extra_retries(bytes: usize, rto: std::time::Duration) -> u32 {
    if bytes == 0 {
        return 0;
    }
    let per_rto = (u128::from(TRANSFER_FLOOR_RATE) * rto.as_micros() / 1_000_000).max(1);
    u32::try_from((bytes as u128).div_ceil(per_rto)).unwrap_or(u32::MAX)
}

impl<P: Clone> Core<P> {
    /// Runs timer tick `self.now`; returns whether a call or connect is
    /// still under way (the timer stays armed).
    pub(crate) fn on_timer(&mut self) -> bool {
        let now = self.now;
        let rto = u64::from(TICKS_PER_RTO);
        let max_retries = self.config.max_retries;
        let rto_time = self.config.rto;
        let mut busy = false;
        let mut settled = Vec::new();
        for index in 0..self.sessions.capacity() {
            let Some((sid, s)) = self.sessions.at_mut(index) else {
                continue;
            };
            if s.role != Role::Client {
                continue;
            }
            match &mut s.state {
                SessionState::Connecting { retries, last } => {
                    busy = true;
                    // Each resend waits twice as long as the one before (as
                    // TCP's SYN does): a peer that is busy or still starting
                    // gets about 63 timeouts with the default 5 retries,
                    // not 6.
                    if now - *last < rto << (*retries).min(CONNECT_BACKOFF_MAX) {
                        continue;
                    }
                    if *retries >= max_retries {
                        debug!(session = sid, "rpc: connect timed out");
                        s.state = SessionState::Failed;
                        s.wake_all();
                        continue;
                    }
                    *retries += 1;
                    *last = now;
                    self.stats.retransmissions += 1;
                    self.send_connect(sid);
                }
                SessionState::Connected => {
                    if link_tick(&mut self.bulk, &mut self.tx, s, sid, now, rto, max_retries) {
                        busy = true;
                    } else if s.client.iter().any(|c| c.awaits_link) {
                        // The link was given up: its waiting calls stream.
                        settled.push(sid);
                    }
                    let learned = s.rtt.rto(rto);
                    let link_ready = s.link_ready();
                    for i in 0..SESSION_SLOTS {
                        let slot = &mut s.client[i];
                        if !matches!(slot.state, CallState::Active) {
                            continue;
                        }
                        busy = true;
                        if slot.awaits_link || slot.req_writing.is_some() {
                            // Bounded by the link's retries (`link_tick`),
                            // or by the RC WRITE of the request's own
                            // (it completes in error if the server's end
                            // vanished: `written_responses.rs`).
                            continue;
                        }
                        if slot.paused && now - slot.progress >= rto {
                            // The server was busy: try again.
                            slot.paused = false;
                            slot.progress = now;
                            if !self.pumps.contains(&sid) {
                                self.pumps.push(sid);
                            }
                            continue;
                        }
                        // While a response is read, the last request packet
                        // is sent again: the server answers it while alive.
                        // So too for a request that went whole over the link
                        // (`link_send.rs`) still ready, unanswered past its
                        // first timeout: the server has all its packets or
                        // none, and answers the last "in progress" while its
                        // handler runs (which makes the next timeout a
                        // first one again). Unanswered, the resend after is
                        // of every unanswered packet.
                        let reading = slot.reading.is_some();
                        let last_only = reading
                            || (slot.retries == 0
                                && slot.link_sent.is_some()
                                && slot.link_sent == link_ready
                                && slot.num_tx == slot.n_req
                                && !slot.is_answered(slot.n_req - 1));
                        // The first resend waits the learned timeout (a
                        // slow but live server is not resent to); later
                        // ones `rto`, which bounds a vanished peer.
                        let wait = if slot.retries == 0 { learned } else { rto };
                        if (slot.in_flight() == 0 && !reading) || now - slot.progress < wait {
                            continue;
                        }
                        let bound = max_retries
                            .saturating_add(extra_retries(slot.transfer_bytes(), rto_time));
                        if slot.retries >= bound {
                            let (req_num, retries) = (slot.req_num, slot.retries);
                            debug!(session = sid, req_num, "rpc: call timed out");
                            self.stats.timeouts += 1;
                            fail_session(s, sid, i, req_num, retries);
                            // Its link and what it exposed go now, not at
                            // its disconnect.
                            release_bulk(&mut self.bulk, &mut self.requests_exposed, &self.pool, s);
                            break;
                        }
                        slot.retries += 1;
                        slot.progress = now;
                        if !expose_written(&mut self.bulk, &mut self.requests_exposed, slot) {
                            continue;
                        }
                        debug!(
                            session = sid,
                            req_num = slot.req_num,
                            retries = slot.retries,
                            last_only,
                            "rpc: call resent after a timeout"
                        );
                        let resend = if last_only {
                            slot.n_req - 1..slot.n_req
                        } else {
                            slot.num_rx..slot.num_tx
                        };
                        for k in resend {
                            if !last_only && slot.is_answered(k) {
                                continue;
                            }
                            send_client_packet(
                                &mut self.tx,
                                &s.peer,
                                s.remote,
                                sid,
                                s.max_payload,
                                slot,
                                k,
                                0,
                            );
                            self.stats.retransmissions += 1;
                        }
                    }
                }
                SessionState::Failed => {}
            }
        }
        for sid in settled {
            self.link_settled(sid);
        }
        busy
    }
}
