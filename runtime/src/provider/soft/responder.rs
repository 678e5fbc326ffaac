//! Responder side of the engine: executes incoming requests against local
//! memory and receive WRs, in PSN order, and queues ACKs/NAKs/responses.

use super::IdMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use super::conn::{ReadJob, Resp};
use super::context::Shared;
use super::dma::{check_local, scatter, Span};
use super::drive::note_feed;
use super::engine::{psn_add, EQp, Engine};
use super::lock;
use super::packet::{
    Header, Opcode, FLAG_FIRST, FLAG_LAST, FLAG_SOLICITED, NAK_REM_ACCESS, NAK_REM_INV_REQ,
    NAK_REM_OP, NAK_RNR,
};
use crate::provider::{AccessFlags, Completion, QpState, QpType, WcOpcode, WcStatus};

/// Loads (or refreshes) the engine view of the QP a packet names.
pub(crate) fn load_qp<'a>(
    qps: &'a mut IdMap<EQp>,
    sh: &Arc<Shared>,
    qpn: u32,
) -> Option<(&'a mut EQp, QpState)> {
    let eq = match qps.entry(qpn) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(v) => {
            let qp = lock(&sh.qps).get(&qpn).cloned()?;
            v.insert(EQp::new(qp, sh.clone()))
        }
    };
    if eq.sh.destroyed.load(Ordering::Acquire) {
        return None;
    }
    let qp = eq.sh.clone();
    let mut inner = lock(&qp.inner);
    let st = eq.refresh(&mut inner);
    drop(inner);
    Some((eq, st))
}

enum Outcome {
    /// Processed: advance the expected PSN and ACK.
    Ack,
    /// Processed, response already queued: advance the expected PSN.
    Responded,
    /// No RECV: answer RNR, keep the expected PSN.
    Rnr,
    /// Fatal for the QP: NAK with this syndrome; the RECV (if any) completes
    /// with the given status.
    Fatal(u8, Option<WcStatus>),
}

impl Engine {
    /// Handles a request packet arriving on connection `cid`. `placed` is
    /// `Some(ok)` for a WRITE whose payload was already received into memory
    /// (`ok` false: the region went away meanwhile).
    pub(crate) fn on_request(
        &mut self,
        cid: usize,
        hdr: &Header,
        payload: &[u8],
        placed: Option<bool>,
    ) {
        let clock = self.clock;
        let Engine {
            qps,
            sh,
            conns,
            ack_delay,
            cq_feeds,
            ..
        } = self;
        let Some((eq, st)) = load_qp(qps, sh, hdr.dst_qpn) else {
            return;
        };
        if eq.sh.qp_type != QpType::Rc {
            return;
        }
        note_feed(cq_feeds, conns, eq, cid);
        if !matches!(st, QpState::Rtr | QpState::Rts) || !eq.configured {
            return;
        }
        if hdr.src_qpn != eq.cfg.remote_qpn || hdr.psn != eq.epsn {
            // Not for this connection, or dropped after a NAK until the
            // requester goes back to the expected PSN.
            return;
        }
        // Responses leave on the connection this QP sends its own requests
        // on (where a held ACK can ride with the next one), chosen once so
        // that they stay in order.
        let out = match eq.resp_conn {
            Some(c) if conns.contains(c) => c,
            _ => {
                let c = eq.conn.filter(|c| conns.contains(*c)).unwrap_or(cid);
                eq.resp_conn = Some(c);
                c
            }
        };
        let Some(conn) = conns.get_mut(out) else {
            return;
        };
        let send = matches!(hdr.opcode, Opcode::Send | Opcode::SendImm | Opcode::SendInv);
        let outcome = match placed {
            // The receive WR's memory went away while its payload arrived.
            Some(false) if send => Outcome::Fatal(NAK_REM_OP, Some(WcStatus::LocProtErr)),
            Some(false) => Outcome::Fatal(NAK_REM_ACCESS, None),
            _ => {
                let mut mrs = sh.mrs();
                execute(eq, hdr, payload, placed.is_some(), &mut mrs, &mut |r| {
                    conn.push_resp(r)
                })
            }
        };
        let (dst, src, psn) = (hdr.src_qpn, hdr.dst_qpn, hdr.psn);
        match outcome {
            Outcome::Ack => {
                eq.epsn = psn_add(eq.epsn, 1);
                // The ACK of a message that completed a receive may wait a
                // little for the answer the application is likely to post.
                let completes_recv = hdr.flags & FLAG_LAST != 0
                    && matches!(
                        hdr.opcode,
                        Opcode::Send | Opcode::SendImm | Opcode::SendInv | Opcode::WriteImm
                    );
                let hold = (completes_recv && !ack_delay.is_zero())
                    .then(|| clock.unwrap_or_else(Instant::now) + *ack_delay);
                conn.push_ack(dst, src, psn, hold);
            }
            Outcome::Responded => eq.epsn = psn_add(eq.epsn, 1),
            Outcome::Rnr => conn.push_resp(Resp::Nak {
                dst,
                src,
                psn,
                syndrome: NAK_RNR,
                timer: eq.cfg.min_rnr_timer,
            }),
            Outcome::Fatal(syndrome, recv_status) => {
                if let (Some(status), Some(r)) = (recv_status, eq.cur_recv.take()) {
                    let wc = eq.recv_completion(&r, status);
                    recv_done(eq);
                    eq.deliver(&eq.sh.recv_cq, wc, true);
                }
                eq.fail(None);
                conn.push_resp(Resp::Nak {
                    dst,
                    src,
                    psn,
                    syndrome,
                    timer: 0,
                });
            }
        }
        self.activate(out);
    }
}

fn recv_done(eq: &EQp) {
    let mut inner = lock(&eq.sh.inner);
    inner.rq_outstanding = inner.rq_outstanding.saturating_sub(1);
}

/// Checks a remote access against the QP's and the MR's access flags.
fn remote_ptr<'t>(
    eq: &EQp,
    mrs: &'t super::mr::MrTable,
    rkey: u32,
    addr: u64,
    len: u64,
    need: AccessFlags,
) -> Option<Span<'t>> {
    if !eq.cfg.access.contains(need) {
        return None;
    }
    mrs.remote(eq.sh.qpn, rkey, eq.sh.pd, addr, len, need).ok()
}

/// Executes a request. `placed`: its payload is already in its target
/// memory (received there straight from the socket; `payload` is empty).
fn execute(
    eq: &mut EQp,
    hdr: &Header,
    payload: &[u8],
    placed: bool,
    mrs: &mut super::mr::MrTable,
    respond: &mut dyn FnMut(Resp),
) -> Outcome {
    let first = hdr.flags & FLAG_FIRST != 0;
    let last = hdr.flags & FLAG_LAST != 0;
    let pd = eq.sh.pd;
    match hdr.opcode {
        Opcode::Send | Opcode::SendImm | Opcode::SendInv => {
            if first {
                // The receive WR may have been taken while the payload
                // arrived (then it is there already).
                let early = eq.recv_for.take() == Some(hdr.psn) && eq.cur_recv.is_some();
                if placed && !early {
                    return Outcome::Fatal(NAK_REM_OP, None);
                }
                if !early {
                    let Some(r) = eq.sh.take_recv() else {
                        return Outcome::Rnr;
                    };
                    eq.cur_recv = Some(r);
                }
                let r = eq.cur_recv.as_ref().map_or(0, |r| r.len);
                if hdr.arg0 > r {
                    return Outcome::Fatal(NAK_REM_OP, Some(WcStatus::LocLenErr));
                }
                let sges_ok = eq
                    .cur_recv
                    .as_ref()
                    .is_some_and(|r| check_local(&r.sges, pd, mrs, true));
                if !sges_ok {
                    return Outcome::Fatal(NAK_REM_OP, Some(WcStatus::LocProtErr));
                }
            }
            let Some(r) = eq.cur_recv.as_ref() else {
                return Outcome::Fatal(NAK_REM_OP, None);
            };
            if !scatter(&r.sges, pd, mrs, hdr.arg1, payload) {
                return Outcome::Fatal(NAK_REM_OP, Some(WcStatus::LocProtErr));
            }
            if last {
                let imm = match hdr.opcode {
                    Opcode::SendImm => Some(hdr.imm),
                    Opcode::SendInv => {
                        // rxe: a failed invalidation completes the receive
                        // REM_INV_REQ_ERR and fails the QP.
                        if let Err(why) = mrs.windows.invalidate(hdr.rkey) {
                            tracing::debug!(
                                rkey = hdr.rkey,
                                why = why.0,
                                "soft device: SEND_WITH_INV refused"
                            );
                            return Outcome::Fatal(NAK_REM_INV_REQ, Some(WcStatus::RemInvReqErr));
                        }
                        Some(hdr.rkey)
                    }
                    _ => None,
                };
                complete_recv(eq, WcOpcode::Recv, hdr, imm);
            }
            Outcome::Ack
        }
        Opcode::Write | Opcode::WriteImm => {
            if first {
                // Validate the whole message before touching any byte.
                if hdr.arg0 > 0
                    && remote_ptr(
                        eq,
                        mrs,
                        hdr.rkey,
                        hdr.addr,
                        hdr.arg0,
                        AccessFlags::REMOTE_WRITE,
                    )
                    .is_none()
                {
                    return Outcome::Fatal(NAK_REM_ACCESS, None);
                }
                if hdr.opcode == Opcode::WriteImm {
                    let Some(r) = eq.sh.take_recv() else {
                        return Outcome::Rnr;
                    };
                    eq.cur_recv = Some(r);
                }
            }
            if !payload.is_empty() {
                let Some(p) = remote_ptr(
                    eq,
                    mrs,
                    hdr.rkey,
                    hdr.addr + hdr.arg1,
                    payload.len() as u64,
                    AccessFlags::REMOTE_WRITE,
                ) else {
                    return Outcome::Fatal(NAK_REM_ACCESS, None);
                };
                p.write(payload);
            }
            if last && hdr.opcode == Opcode::WriteImm {
                complete_recv(eq, WcOpcode::RecvRdmaWithImm, hdr, Some(hdr.imm));
            }
            Outcome::Ack
        }
        Opcode::ReadReq => {
            if hdr.arg0 > 0
                && remote_ptr(
                    eq,
                    mrs,
                    hdr.rkey,
                    hdr.addr,
                    hdr.arg0,
                    AccessFlags::REMOTE_READ,
                )
                .is_none()
            {
                return Outcome::Fatal(NAK_REM_ACCESS, None);
            }
            respond(Resp::Read(ReadJob {
                zc: None,
                dst: hdr.src_qpn,
                src: hdr.dst_qpn,
                psn: hdr.psn,
                pd,
                rkey: hdr.rkey,
                addr: hdr.addr,
                len: hdr.arg0,
                off: 0,
            }));
            Outcome::Responded
        }
        Opcode::CmpSwap | Opcode::FetchAdd => {
            let Some(p) = remote_ptr(eq, mrs, hdr.rkey, hdr.addr, 8, AccessFlags::REMOTE_ATOMIC)
            else {
                return Outcome::Fatal(NAK_REM_ACCESS, None);
            };
            let Some(a) = p.atomic_u64() else {
                return Outcome::Fatal(super::packet::NAK_REM_INV_REQ, None);
            };
            let orig = if hdr.opcode == Opcode::CmpSwap {
                match a.compare_exchange(hdr.arg0, hdr.arg1, Ordering::SeqCst, Ordering::SeqCst) {
                    Ok(v) | Err(v) => v,
                }
            } else {
                a.fetch_add(hdr.arg0, Ordering::SeqCst)
            };
            respond(Resp::Atomic {
                dst: hdr.src_qpn,
                src: hdr.dst_qpn,
                psn: hdr.psn,
                orig,
            });
            Outcome::Responded
        }
        _ => Outcome::Fatal(super::packet::NAK_REM_INV_REQ, None),
    }
}

fn complete_recv(eq: &mut EQp, opcode: WcOpcode, hdr: &Header, imm: Option<u32>) {
    let Some(r) = eq.cur_recv.take() else {
        return;
    };
    let wc = Completion {
        wr_id: r.wr_id,
        status: WcStatus::Success,
        opcode,
        byte_len: hdr.arg0 as u32,
        imm_data: imm,
        qp_num: eq.sh.qpn,
        vendor_err: 0,
        with_inv: hdr.opcode == Opcode::SendInv,
        ..Completion::EMPTY
    };
    // Free the receive-queue slot before the CQE is visible.
    recv_done(eq);
    eq.deliver(&eq.sh.recv_cq, wc, hdr.flags & FLAG_SOLICITED != 0);
}
