//! Sessions: opened (a client's connect and the server's answer),
//! closed, disconnected.

use crate::rpc::header::{Header, PacketKind, HEADER_LEN};
use crate::rpc::session::{Role, Session, SessionState};

use super::packets::send_bare;
use super::Core;

impl<P: Clone> Core<P> {
    /// Opens `session`; its number, or `None` if the table is full.
    pub(crate) fn add_session(&mut self, session: Session<P>) -> Option<u32> {
        let sid = self.sessions.insert(session)?;
        self.open_sessions += 1;
        Some(sid)
    }

    /// Client: sends the connect packet of session `sid`.
    pub(crate) fn send_connect(&mut self, sid: u32) {
        if let Some(s) = self.sessions.get(sid) {
            let h = Header {
                src_session: sid,
                req_num: s.connect_id,
                msg_len: self.max_packet as u32,
                payload_len: self.local_addr.len() as u16,
                ..Header::new(PacketKind::Connect)
            };
            self.tx.push(&s.peer, &h, &self.local_addr);
        }
    }

    /// Client: the server opened the session.
    pub(crate) fn on_connect_ack(&mut self, h: &Header) {
        let max_packet = self.max_packet;
        let Some(s) = self.sessions.get_mut(h.dest_session) else {
            self.stats.stale_packets += 1;
            return;
        };
        if s.role != Role::Client || !matches!(s.state, SessionState::Connecting { .. }) {
            self.stats.stale_packets += 1;
            return;
        }
        if h.msg_len as usize > max_packet || h.req_num != s.connect_id {
            self.stats.malformed_packets += 1;
            return;
        }
        s.remote = h.src_session;
        s.max_payload = h.msg_len as usize - HEADER_LEN;
        s.response_window = usize::from(h.pkt_count).max(1);
        s.state = SessionState::Connected;
        if let Some(w) = s.connect_waker.take() {
            w.wake();
        }
        if self.config.session_keepalive && h.pkt_idx > 0 {
            self.keep_alive(h.dest_session, h.pkt_idx);
        }
    }

    /// Ends session `sid`: its calls fail with `SessionClosed`.
    pub(crate) fn close_session(&mut self, sid: u32) {
        let Some(mut s) = self.sessions.take(sid) else {
            return;
        };
        self.open_sessions -= 1;
        if let Some(key) = s.connect_key.take() {
            self.connects.remove(&key);
            if let Some(n) = self.peer_sessions.get_mut(&key.0) {
                *n -= 1;
                if *n == 0 {
                    self.peer_sessions.remove(&key.0);
                }
            }
        }
        if s.role == Role::Server {
            self.server_sessions -= 1;
        }
        self.release_session(&mut s);
        s.wake_all();
    }

    /// Client: sends a disconnect for session `sid` and closes it.
    pub(crate) fn disconnect(&mut self, sid: u32) {
        if let Some(s) = self.sessions.get(sid) {
            if matches!(s.state, SessionState::Connected) {
                send_bare(&mut self.tx, s, sid, PacketKind::Disconnect);
            }
        }
        self.close_session(sid);
    }
}
