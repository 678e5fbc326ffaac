//! How the engine knows whether a peer engine is alive, and when an RC
//! QP's ACK timer counts.
//!
//! RC runs over TCP here, which is reliable: nothing an RC requester
//! would retransmit is lost while the connection lives. So a QP never
//! fails while its connection is still recovering from loss; it fails
//! when the connection dies or when its peer's QP stays silent:
//!
//! - **The connection's own state.** A connection the peer closed or
//!   reset (its process died, its engine stopped) is closed at once. Each
//!   socket has `TCP_USER_TIMEOUT` (data unacknowledged that long: the
//!   kernel gives up) and TCP keepalive (an idle connection is probed
//!   every `peer_timeout / 4`, at least 1 s, and given up once nothing
//!   arrived for `peer_timeout`, by the same user timeout), both set to
//!   `SoftConfig::peer_timeout` (default 5 s): a vanished host is noticed
//!   within that bound whether the connection was busy or idle, and it
//!   costs nothing on a busy connection (the kernel probes only idle
//!   ones). A closed connection fails the QPs of its peer engine, those
//!   with only receives posted too (see `Engine::close`).
//! - **Probes.** When a QP's ACK timer expires, the engine queues a PING
//!   on the QP's connection, after everything the QP sent. The peer
//!   engine answers with a PONG after every response it owes there. A
//!   PONG without the ACK proves the peer engine holds the requests and
//!   its QP did not answer (destroyed, reset, ...): that expiry counts
//!   towards `retry_cnt`, as an rxe retransmission would. Until the PONG
//!   comes the connection is still delivering, and nothing counts. One
//!   probe per QP at a time.
//! - **A peer engine that stops answering** (its process stopped while
//!   its kernel still acknowledges TCP) answers no probe: a PING left
//!   unanswered for `peer_timeout` while nothing at all arrived on the
//!   connection closes it as dead.

use std::io;
use std::time::{Duration, Instant};

use socket2::{SockRef, TcpKeepalive};

use super::super::lock;
use super::{EWqe, Engine};
use crate::provider::{QpState, QpType, WcStatus};

/// Sets TCP keepalive and the user timeout of an engine connection's
/// socket for dead-peer detection within `bound` (see the module docs).
pub(crate) fn keep_alive(stream: &mio::net::TcpStream, bound: Duration) -> io::Result<()> {
    let sock = SockRef::from(stream);
    // The kernel counts keepalive times in whole seconds.
    let every = Duration::from_secs((bound.as_secs() / 4).max(1));
    let probes = (bound.as_secs() / every.as_secs()).clamp(1, 127) as u32 + 1;
    sock.set_tcp_keepalive(
        &TcpKeepalive::new()
            .with_time(every)
            .with_interval(every)
            .with_retries(probes),
    )?;
    sock.set_tcp_user_timeout(Some(bound))
}

impl Engine {
    /// A PING arrived on `cid`: its PONG follows what this engine owes there.
    pub(super) fn on_ping(&mut self, cid: usize, seq: u64) {
        if let Some(c) = self.conns.get_mut(cid) {
            c.push_pong(seq);
            self.activate(cid);
        }
    }

    /// A PONG arrived on `cid`: the QPs that probed may count an expiry
    /// (in `timers`, this loop turn).
    pub(super) fn on_pong(&mut self, cid: usize, seq: u64) {
        if let Some(c) = self.conns.get_mut(cid) {
            c.on_pong(seq);
            // (An application's receive: the engine must count it soon.)
            self.kick = true;
        }
    }

    /// The QPs waiting for a probe's answer: an answered probe without
    /// progress counts a retry (see the module docs).
    pub(super) fn probe_answers(&mut self) {
        let Engine {
            qps,
            conns,
            probing,
            ..
        } = self;
        probing.retain(|&qpn| {
            let Some(eq) = qps.get_mut(&qpn) else {
                return false;
            };
            let Some(seq) = eq.probe else {
                // (Progress, a reset or an error ended it.)
                return false;
            };
            let answered = match eq.conn.and_then(|c| conns.get(c)) {
                Some(c) if !c.probe.answered(seq) => return true,
                answered => answered,
            };
            eq.probe = None;
            if answered.is_none() {
                // (Its connection closed: that failed it, or it moved to
                // another one.)
            } else if eq.retries_left == 0 {
                tracing::debug!(qpn, "soft engine: peer QP silent, retries exhausted");
                eq.fail(Some(WcStatus::RetryExcErr));
            } else {
                eq.retries_left -= 1;
            }
            false
        });
    }

    /// QP `qpn`'s ACK timer, if it expired: asks for a probe (see the
    /// module docs), or counts a retry when there is no connection.
    pub(super) fn ack_timer(&mut self, qpn: u32, now: Instant) {
        let bound = self.peer_timeout();
        let Engine {
            qps,
            conns,
            probe_check,
            probing,
            ..
        } = self;
        let Some(eq) = qps.get_mut(&qpn) else {
            return;
        };
        if eq.ack_deadline.is_none_or(|t| t > now) {
            return;
        }
        eq.ack_deadline = eq.ack_timeout().map(|d| now + d);
        let pinged = match eq.conn.and_then(|c| conns.get_mut(c).map(|x| (c, x))) {
            Some((cid, c)) => {
                if eq.probe.is_some() {
                    return;
                }
                eq.probe = Some(c.want_ping(now));
                probing.push(qpn);
                let at = now + bound;
                *probe_check = Some(probe_check.map_or(at, |p| p.min(at)));
                cid
            }
            // No connection (none could be made): nothing to wait for.
            None if eq.retries_left == 0 => {
                tracing::debug!(
                    qpn,
                    "soft engine: ACK timeout without a connection, retries exhausted"
                );
                eq.fail(Some(WcStatus::RetryExcErr));
                return;
            }
            None => {
                eq.retries_left -= 1;
                return;
            }
        };
        self.activate(pinged);
    }

    /// Closes connections whose probe went unanswered for `peer_timeout`
    /// while nothing arrived on them: their peer engine is dead.
    pub(super) fn check_probes(&mut self, now: Instant) {
        if self.probe_check.is_none_or(|t| now < t) {
            return;
        }
        let bound = self.peer_timeout();
        let mut next: Option<Instant> = None;
        let mut dead: smallvec::SmallVec<[usize; 2]> = smallvec::SmallVec::new();
        for (cid, c) in self.conns.iter_mut() {
            let Some(since) = c.probe.waiting_since else {
                continue;
            };
            let mut due = since + bound;
            if due <= now {
                if !std::mem::take(&mut c.probe.input) {
                    dead.push(cid);
                    continue;
                }
                // Input came meanwhile (a long transfer ahead of the PONG):
                // the peer is alive; wait again.
                c.probe.waiting_since = Some(now);
                due = now + bound;
            }
            next = Some(next.map_or(due, |n| n.min(due)));
        }
        self.probe_check = next;
        for cid in dead {
            tracing::warn!(
                peer = ?self.conns.get(cid).and_then(|c| c.peer),
                ?bound,
                "soft engine: the peer engine answered no probe and sent nothing, closing the connection as dead"
            );
            self.close(cid);
        }
    }

    /// The connection to the engine at `peer` is gone (it was the one in
    /// use for that engine, and no other proven one is left): every RC QP
    /// in RTS whose peer is there moves to ERR, the front send WR with
    /// RETRY_EXC_ERR, the rest (receives too) flushed. A QP with only
    /// receives posted learns of its dead peer this way. QPs in RTR too
    /// if the connection was `proven` (the engine there was reached); not
    /// when only a dial failed: an application bringing a QP up must not
    /// find it in ERR between RTR and RTS because the peer's engine was
    /// not listening yet (its sends fail when they find no connection).
    pub(super) fn fail_qps_of(&mut self, peer: std::net::SocketAddr, proven: bool) {
        let other = self
            .conns
            .iter()
            .any(|(_, c)| c.proven() && c.peer.is_some_and(|p| super::port::same_addr(p, peer)));
        if other {
            return;
        }
        for (qpn, eq) in self.qps.iter_mut() {
            if eq.sh.qp_type != QpType::Rc
                || !eq.configured
                || !eq
                    .cfg
                    .remote_addr
                    .is_some_and(|a| super::port::same_addr(a, peer))
            {
                continue;
            }
            let state = eq.sh.state();
            if !(state == QpState::Rts || (state == QpState::Rtr && proven)) {
                continue;
            }
            tracing::debug!(qpn, %peer, "soft engine: connection to the peer engine lost, QP to ERR");
            if state == QpState::Rts {
                // What posting threads transmitted, and what waits to be
                // taken, is outstanding too: the oldest of all gives the
                // error, as the WR a NIC would have retried.
                let qp = eq.sh.clone();
                let mut inner = lock(&qp.inner);
                eq.absorb(&mut inner);
                let posted = inner.sq.len();
                eq.wqes.extend(inner.sq.drain(..posted).map(|w| EWqe {
                    w,
                    first_psn: 0,
                    last_psn: 0,
                    error: None,
                    executed: false,
                }));
            }
            let first =
                (state == QpState::Rts && !eq.wqes.is_empty()).then_some(WcStatus::RetryExcErr);
            eq.conn = None;
            eq.fail(first);
        }
    }
}
