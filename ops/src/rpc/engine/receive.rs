//! A received packet: decoded and handed to the job of its kind; the
//! open session it is addressed to.

use tracing::trace;

use crate::rpc::header::{Header, PacketKind};
use crate::rpc::session::{Role, Session, SessionState};
use crate::rpc::table::SessionTable;

use super::{ConnectRequest, Core, RpcStats};

impl<P: Clone> Core<P> {
    /// Handles one received packet. Inline: into the receive loop's
    /// closure, its one caller on the hot path (a call level per packet).
    #[inline]
    pub(crate) fn on_packet(&mut self, packet: &[u8]) {
        self.stats.packets_received += 1;
        let (h, payload) = match Header::decode(packet) {
            Ok(v) => v,
            Err(error) => {
                self.stats.malformed_packets += 1;
                trace!(%error, "rpc: malformed packet dropped");
                return;
            }
        };
        match h.kind {
            PacketKind::Request => self.on_request(&h, payload),
            PacketKind::RequestForResponse => self.on_request_for_response(&h),
            PacketKind::CreditReturn => self.on_credit_return(&h),
            PacketKind::Response => self.on_response(&h, payload),
            PacketKind::Connect => self.connect_requests.push(ConnectRequest {
                header: h,
                addr: payload.to_vec(),
            }),
            PacketKind::ConnectAck => self.on_connect_ack(&h),
            PacketKind::BulkConnect => self.on_bulk_connect(&h, payload),
            PacketKind::BulkConnectAck => self.on_bulk_connect_ack(&h, payload),
            PacketKind::ReadRequest => self.on_read_request(&h, payload),
            PacketKind::ReadResponse => self.on_read_response(&h, payload),
            PacketKind::Offer => self.on_offer(&h, payload),
            PacketKind::Ping => {
                // Seen: the session's idle count starts again (`idle.rs`).
                let _ = self.session_for(&h, Role::Server);
            }
            PacketKind::Disconnect => {
                let from_peer = matches!(
                    self.sessions.get(h.dest_session),
                    Some(s) if s.remote == h.src_session
                );
                if from_peer {
                    self.close_session(h.dest_session);
                } else {
                    self.stats.stale_packets += 1;
                }
            }
        }
    }

    /// The open session `h` is addressed to (see [`open_session`]).
    pub(crate) fn session_for(&mut self, h: &Header, role: Role) -> Option<&mut Session<P>> {
        open_session(&mut self.sessions, &mut self.stats, h, role)
    }
}

/// The open session `h` is addressed to, if it has `role` and its peer is
/// `h`'s sender; else counts a stale packet.
pub(crate) fn open_session<'a, P>(
    sessions: &'a mut SessionTable<P>,
    stats: &mut RpcStats,
    h: &Header,
    role: Role,
) -> Option<&'a mut Session<P>> {
    match sessions.get_mut(h.dest_session) {
        Some(s)
            if s.role == role
                && matches!(s.state, SessionState::Connected)
                && s.remote == h.src_session =>
        {
            s.idle_sweeps = 0;
            Some(s)
        }
        _ => {
            stats.stale_packets += 1;
            trace!(?h, "rpc: packet for no open session dropped");
            None
        }
    }
}

/// The open session `h` is addressed to (see [`open_session`]), if its
/// link is ready; else counts a stale packet.
pub(crate) fn linked_session<'a, P>(
    sessions: &'a mut SessionTable<P>,
    stats: &mut RpcStats,
    h: &Header,
    role: Role,
) -> Option<&'a mut Session<P>> {
    let s = open_session(sessions, stats, h, role)?;
    if s.link_ready().is_none() {
        stats.stale_packets += 1;
        return None;
    }
    Some(s)
}
