//! Receiving datagrams: the destination QP must exist, be UD, be in RTR or
//! RTS and expect the datagram's Q_Key; the datagram takes the next posted
//! receive (none: dropped, as rxe does), whose first 40 bytes get the GRH
//! and the rest the payload. Every drop is counted.

use super::super::context::gid_of;
use super::super::dma::{check_local, scatter};
use super::super::drive::note_feed;
use super::super::engine::Engine;
use super::super::lock;
use super::super::packet::{Header, Opcode, FLAG_SOLICITED};
use super::super::responder::load_qp;
use super::grh;
use super::Count;
use crate::provider::{Completion, QpState, QpType, WcOpcode, WcStatus, GRH_LEN};

impl Engine {
    /// Handles a datagram arriving on connection `cid`.
    pub(crate) fn on_datagram(&mut self, cid: usize, hdr: &Header, payload: &[u8]) {
        let Engine {
            qps,
            sh,
            conns,
            cq_feeds,
            ..
        } = self;
        let sgid = conns
            .get(cid)
            .and_then(|c| c.peer)
            .map_or(sh.gid, |a| gid_of(a.ip()));
        let Some((eq, st)) = load_qp(qps, sh, hdr.dst_qpn) else {
            sh.ud.count(Count::NoQp);
            return;
        };
        if eq.sh.qp_type != QpType::Ud || !matches!(st, QpState::Rtr | QpState::Rts) {
            sh.ud.count(Count::NoQp);
            return;
        }
        if hdr.rkey != eq.cfg.qkey {
            sh.ud.count(Count::Qkey);
            return;
        }
        note_feed(cq_feeds, conns, eq, cid);
        let Some(r) = eq.sh.take_recv() else {
            sh.ud.count(Count::NoRecv);
            return;
        };
        let imm = (hdr.opcode == Opcode::DatagramImm).then_some(hdr.imm);
        let need = (GRH_LEN + payload.len()) as u64;
        let pd = eq.sh.pd;
        let status = if r.len < need {
            WcStatus::LocLenErr
        } else {
            let mrs = sh.mrs();
            // (The IPv4 identification: the low bits of the datagram's PSN,
            // where rxe has the kernel's IP ID.)
            let g = grh::build(
                &sgid,
                &sh.gid,
                hdr.arg0 as u8,
                payload.len(),
                imm.is_some(),
                hdr.psn as u16,
            );
            if check_local(&r.sges, pd, &mrs, true)
                && scatter(&r.sges, pd, &mrs, 0, &g)
                && scatter(&r.sges, pd, &mrs, GRH_LEN as u64, payload)
            {
                WcStatus::Success
            } else {
                WcStatus::LocProtErr
            }
        };
        sh.ud.count(Count::Delivered);
        let ok = status.is_success();
        let wc = Completion {
            wr_id: r.wr_id,
            status,
            opcode: WcOpcode::Recv,
            byte_len: if ok { need as u32 } else { 0 },
            imm_data: if ok { imm } else { None },
            qp_num: eq.sh.qpn,
            src_qp: if ok { hdr.src_qpn } else { 0 },
            slid: 0,
            grh: ok,
            ..Completion::EMPTY
        };
        // Free the receive-queue slot before the CQE is visible.
        {
            let mut inner = lock(&eq.sh.inner);
            inner.rq_outstanding = inner.rq_outstanding.saturating_sub(1);
        }
        eq.deliver(&eq.sh.recv_cq, wc, hdr.flags & FLAG_SOLICITED != 0);
    }
}
