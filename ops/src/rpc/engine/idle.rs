//! Idle server sessions: a sweep every quarter of
//! [`RpcConfig::session_idle_timeout`](super::RpcConfig::session_idle_timeout)
//! closes the server sessions that heard nothing from their client through
//! more than four sweeps, so a client that vanished without disconnecting
//! does not hold its session (its cached responses, its address handle)
//! forever; a request whose packets stopped arriving for as long is
//! dropped half received (its memory given back), even in a session kept
//! open by other traffic.
//!
//! Keepalive: a server announces in its connect-ack the interval at which
//! a client should ping the session ([`PINGS_PER_TIMEOUT`] pings per idle
//! timeout); the client pings every session it holds at that interval
//! ([`RpcConfig::session_keepalive`](super::RpcConfig::session_keepalive)),
//! so a quiet client's session stays open (its next call succeeds), and
//! what expires is the session of a client that vanished. A session closes
//! only after about six pings in a row were lost, or its client's thread
//! stalled for an idle timeout; its client is then told, as before.
//!
//! Why pings and not a transparent reconnect-and-resend: a resend is safe
//! only for requests no handler got (a request whose response was lost
//! would run twice, breaking at-most-once), the client cannot always tell
//! which those are (the disconnect packet can be lost too), and the call
//! would pay a connect round trip; a ping costs one 32-byte packet per
//! session per interval (10 s by default), on no call's path.

use std::time::{Duration, Instant};

use tracing::debug;

use crate::rpc::header::PacketKind;
use crate::rpc::session::{Role, ServeState, SessionState};

use super::packets::send_bare;
use super::Core;

/// Sweeps per idle timeout: a session is closed after more than this many
/// sweeps without a packet, so after between the timeout and a quarter
/// more.
pub(crate) const SWEEPS_PER_TIMEOUT: u32 = 4;

/// Keepalive pings a client sends per idle timeout of its server.
pub(crate) const PINGS_PER_TIMEOUT: u32 = 6;

/// The keepalive interval a server announces in its connect-ack, in
/// milliseconds (from 1 to 65535; 0: sessions never expire, no pings).
pub(crate) fn keepalive_interval_ms(idle_timeout: Option<Duration>) -> u16 {
    idle_timeout.map_or(0, |t| {
        (t / PINGS_PER_TIMEOUT)
            .as_millis()
            .clamp(1, u16::MAX.into()) as u16
    })
}

impl<P: Clone> Core<P> {
    /// One idle sweep: ages every server session without a handler
    /// running, and closes (telling the client) those idle too long.
    /// Returns whether server sessions remain (the sweep stays armed).
    pub(crate) fn sweep_idle(&mut self) -> bool {
        let mut expired = Vec::new();
        for index in 0..self.sessions.capacity() {
            let Some((sid, s)) = self.sessions.at_mut(index) else {
                continue;
            };
            if s.role != Role::Server {
                continue;
            }
            // A request whose packets stopped coming: its memory is given
            // back (a client still there sends it again).
            for slot in &mut s.server {
                // (A request being read is bounded by its link's READ.)
                if slot.state == ServeState::Receiving && slot.reading.is_none() {
                    slot.stalled_sweeps += 1;
                    if slot.stalled_sweeps > SWEEPS_PER_TIMEOUT {
                        debug!(
                            session = sid,
                            req_num = slot.req_num,
                            "rpc: stalled request dropped"
                        );
                        slot.drop_partial();
                        self.stats.partial_requests_dropped += 1;
                    }
                }
            }
            // A running handler will answer: the client is waiting, not gone.
            if s.server
                .iter()
                .any(|slot| slot.state == ServeState::Handling)
            {
                s.idle_sweeps = 0;
                continue;
            }
            s.idle_sweeps += 1;
            if s.idle_sweeps > SWEEPS_PER_TIMEOUT {
                expired.push(sid);
            }
        }
        for sid in expired {
            if let Some(s) = self.sessions.get(sid) {
                debug!(session = sid, "rpc: idle session closed");
                send_bare(&mut self.tx, s, sid, PacketKind::Disconnect);
            }
            self.stats.sessions_expired += 1;
            self.close_session(sid);
        }
        self.server_sessions > 0
    }

    /// Client: session `sid` pings its server every `interval_ms`
    /// milliseconds from now on (the keepalive timer runs at the shortest
    /// interval of all).
    pub(crate) fn keep_alive(&mut self, sid: u32, interval_ms: u16) {
        let every = Duration::from_millis(interval_ms.into());
        let Some(s) = self.sessions.get_mut(sid) else {
            return;
        };
        s.ping_every = every;
        s.next_ping = Some(Instant::now() + every);
        if self.keepalive_period.is_none_or(|p| every < p) {
            // (Re)armed with the shorter period by the timer task.
            self.keepalive_period = Some(every);
            self.keepalive_timer = None;
            self.wake_ticker();
        }
    }

    /// The keepalive timer fired: pings the client sessions whose ping is
    /// due (within half an interval: the timer runs at the shortest one),
    /// and sets the timer's period to the shortest interval left (`None`
    /// when no session pings).
    pub(crate) fn send_pings(&mut self) {
        let now = Instant::now();
        let mut period: Option<Duration> = None;
        for index in 0..self.sessions.capacity() {
            let Some((sid, s)) = self.sessions.at_mut(index) else {
                continue;
            };
            let Some(due) = s.next_ping else {
                continue;
            };
            if s.role != Role::Client || !matches!(s.state, SessionState::Connected) {
                continue;
            }
            if due <= now + s.ping_every / 2 {
                send_bare(&mut self.tx, s, sid, PacketKind::Ping);
                self.stats.pings_sent += 1;
                s.next_ping = Some(now + s.ping_every);
            }
            period = Some(period.map_or(s.ping_every, |p| p.min(s.ping_every)));
        }
        self.keepalive_period = period;
    }
}
