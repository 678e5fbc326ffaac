//! Where a UD QP's datagrams go: the engine its next one is for, and the
//! datagrams lost when no connection to an engine can be had.

use std::net::SocketAddr;

use super::super::engine::Engine;
use super::tx::resolve;
use super::Count;
use crate::provider::{QpState, SendOp, WcStatus};

impl Engine {
    /// UD: the engine the QP's next datagram goes to. A datagram whose
    /// address handle is gone (or of another PD) fails the QP as on rxe.
    pub(crate) fn ud_next_dest(&mut self, qpn: u32) -> Option<SocketAddr> {
        let Engine { qps, sh, .. } = self;
        let eq = qps.get_mut(&qpn)?;
        if eq.sh.state() != QpState::Rts {
            return None;
        }
        let front = eq.wqes.front()?;
        let route = match front.w.op {
            SendOp::SendTo { dest, .. } => resolve(sh, dest.ah, eq.sh.pd),
            _ => None,
        };
        match route {
            Some(r) => Some(r.addr),
            None => {
                tracing::debug!(qpn, "soft engine: datagram with no live address handle");
                eq.fail(Some(WcStatus::LocQpOpErr));
                None
            }
        }
    }

    /// UD: no connection to the engine at `addr`: the datagrams at the
    /// front of the QP's queue that go there complete as sent, and are lost.
    pub(crate) fn ud_lost(&mut self, qpn: u32, addr: SocketAddr) {
        let Engine { qps, sh, .. } = self;
        let Some(eq) = qps.get_mut(&qpn) else {
            return;
        };
        while let Some(f) = eq.wqes.front() {
            let to = match f.w.op {
                SendOp::SendTo { dest, .. } => resolve(sh, dest.ah, eq.sh.pd).map(|r| r.addr),
                _ => None,
            };
            if to != Some(addr) {
                break;
            }
            let len = f.w.len as u32;
            sh.ud.count(Count::Lost);
            eq.complete_front(WcStatus::Success, len);
        }
    }
}
