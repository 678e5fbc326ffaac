//! Idle server sessions: a sweep every quarter of
//! [`RpcConfig::session_idle_timeout`](super::RpcConfig::session_idle_timeout)
//! closes the server sessions that heard nothing from their client through
//! more than four sweeps, so a client that vanished without disconnecting
//! does not hold its session (its cached responses, its address handle)
//! forever; a request whose packets stopped arriving for as long is
//! dropped half received (its memory given back), even in a session kept
//! open by other traffic.

use tracing::debug;

use super::core::Core;
use super::header::{Header, PacketKind};
use super::session::{Role, ServeState};

/// Sweeps per idle timeout: a session is closed after more than this many
/// sweeps without a packet, so after between the timeout and a quarter
/// more.
pub(crate) const SWEEPS_PER_TIMEOUT: u32 = 4;

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
                if slot.state == ServeState::Receiving {
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
                let bye = Header {
                    dest_session: s.remote,
                    src_session: sid,
                    ..Header::new(PacketKind::Disconnect)
                };
                self.tx.push(&s.peer, &bye, &[]);
            }
            self.stats.sessions_expired += 1;
            self.close_session(sid);
        }
        self.server_sessions > 0
    }
}
