//! Server: which connects open a session. A connect seen before (same
//! client address, session number and incarnation) finds its session
//! again; a new one is admitted only while the endpoint has fewer than
//! [`RpcConfig::max_server_sessions`](super::RpcConfig::max_server_sessions)
//! server sessions and its address fewer than
//! [`RpcConfig::max_sessions_per_peer`](super::RpcConfig::max_sessions_per_peer),
//! checked before the address is resolved, so a flood of connects costs
//! neither address handles nor sessions past those caps. Sessions expire
//! (`idle.rs`), so a flood's sessions make room again.

use tracing::{debug, warn};

use crate::rpc::header::{Header, PacketKind, HEADER_LEN};
use crate::rpc::session::{Role, Session, SessionState};
use crate::rpc::transport::TransportError;

use super::idle::keepalive_interval_ms;
use super::{ConnectRequest, Core};

impl<P: Clone> Core<P> {
    /// Answers the connect packets received: a connect seen before finds
    /// its session again; a new one is admitted before its address is
    /// resolved by `resolve` (an address handle on UD).
    pub(crate) fn accept_connects(
        &mut self,
        mut resolve: impl FnMut(&[u8]) -> Result<P, TransportError>,
    ) {
        let requests = std::mem::take(&mut self.connect_requests);
        for req in requests {
            if self.answer_known_connect(&req) || !self.admit_connect(&req) {
                continue;
            }
            match resolve(&req.addr) {
                Ok(peer) => self.accept_connect(req, peer),
                Err(error) => {
                    self.stats.malformed_packets += 1;
                    debug!(%error, "rpc: connect from an address that does not resolve");
                }
            }
        }
    }

    /// Answers `req` if it opened a session already (its connect-ack was
    /// lost); false if it is new.
    pub(crate) fn answer_known_connect(&mut self, req: &ConnectRequest) -> bool {
        let h = &req.header;
        let key = (req.addr.clone(), h.src_session, h.req_num);
        let Some(&sid) = self.connects.get(&key) else {
            return false;
        };
        self.send_connect_ack(sid, h);
        true
    }

    /// Whether a new session may be opened for `req`; counts and logs a
    /// refusal (the 1st, 2nd, 4th, 8th... one).
    pub(crate) fn admit_connect(&mut self, req: &ConnectRequest) -> bool {
        let max_total = self.config.max_server_sessions;
        let max_peer = self.config.max_sessions_per_peer;
        let of_peer = self.peer_sessions.get(&req.addr).copied().unwrap_or(0);
        let why = if self.server_sessions >= max_total {
            "the endpoint has RpcConfig::max_server_sessions sessions open"
        } else if of_peer >= max_peer {
            "its address has RpcConfig::max_sessions_per_peer sessions open"
        } else {
            return true;
        };
        self.stats.connects_refused += 1;
        let refused = self.stats.connects_refused;
        if refused.is_power_of_two() {
            warn!(
                server_sessions = self.server_sessions,
                max_server_sessions = max_total,
                peer_sessions = of_peer,
                max_sessions_per_peer = max_peer,
                refused,
                "rpc: connect refused: {why} (idle sessions expire after RpcConfig::session_idle_timeout)"
            );
        }
        false
    }

    /// Opens the server session `req` asks for (admitted, its address
    /// resolved to `peer`) and answers it.
    pub(crate) fn accept_connect(&mut self, req: ConnectRequest, peer: P) {
        let h = req.header;
        let key = (req.addr, h.src_session, h.req_num);
        // Validated: from MIN_PACKET (64) to MAX_PACKET.
        let packet = h.msg_len.min(self.max_packet as u32) as usize;
        let mut s = Session::new(
            Role::Server,
            SessionState::Connected,
            peer,
            packet - HEADER_LEN,
        );
        s.remote = h.src_session;
        s.connect_key = Some(key.clone());
        let Some(sid) = self.add_session(s) else {
            self.stats.connects_refused += 1;
            warn!("rpc: connect refused: the session table is full");
            return;
        };
        *self.peer_sessions.entry(key.0.clone()).or_insert(0) += 1;
        self.connects.insert(key, sid);
        self.server_sessions += 1;
        if self.server_sessions == 1 && self.config.session_idle_timeout.is_some() {
            // The timer task starts the idle sweep.
            self.wake_ticker();
        }
        self.send_connect_ack(sid, &h);
    }

    /// Answers connect `h` of server session `sid`.
    fn send_connect_ack(&mut self, sid: u32, h: &Header) {
        if let Some(s) = self.sessions.get(sid) {
            let ack = Header {
                dest_session: h.src_session,
                src_session: sid,
                req_num: h.req_num,
                msg_len: (s.max_payload + HEADER_LEN) as u32,
                pkt_idx: keepalive_interval_ms(self.config.session_idle_timeout),
                pkt_count: self.config.response_window as u16,
                ..Header::new(PacketKind::ConnectAck)
            };
            self.tx.push(&s.peer, &ack, &[]);
        }
    }
}
