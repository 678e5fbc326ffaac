//! The receive side: reading a connection, cutting its bytes into packets,
//! and WRITE and SEND payloads received straight into their target memory.

use std::io;
use std::time::Instant;

use super::super::conn::{Auth, DirectInto, RxDirect, BIG_BUF_KEEP, RX_CAP};
use super::super::dma::{check_local, writable_spans};
use super::super::packet::{decode_header, Header, Opcode, FLAG_FIRST, HEADER_LEN};
use super::super::requester::read_answered;
use super::super::responder::load_qp;
use super::port::Handshake;
use super::Engine;
use crate::provider::{AccessFlags, QpState, QpType};

/// WRITE and SEND payloads at least this big are received straight into
/// memory.
const DIRECT_MIN: usize = 16 * 1024;

/// Where a connection's next bytes go.
#[derive(Clone, Copy)]
enum ReadInto {
    /// Nowhere: the rest of a dropped packet's payload.
    Discard,
    /// Straight into registered memory: a large WRITE's or SEND's payload.
    Memory,
    /// The receive buffer, to be cut into packets.
    Buffer,
}

impl Engine {
    /// Reads and handles what arrived. Edge-triggered: a short read means the
    /// socket is drained (new data raises a new event), except when the peer
    /// also closed (`drain`), where we read on until end of stream.
    pub(crate) fn on_readable(&mut self, cid: usize, drain: bool) {
        loop {
            let Some(conn) = self.conns.get_mut(cid) else {
                return;
            };
            if conn.auth == Auth::Proving {
                // Its input waits (in the socket) for the proof.
                return;
            }
            let into = if conn.rx_skip > 0 {
                ReadInto::Discard
            } else if conn.rx_direct.is_some() {
                ReadInto::Memory
            } else {
                ReadInto::Buffer
            };
            let res = match into {
                ReadInto::Discard => conn.skip_some(),
                ReadInto::Memory => {
                    let mrs = self.sh.mrs();
                    conn.read_direct(&mrs)
                }
                ReadInto::Buffer => conn.read_some(),
            };
            let full = match res {
                Ok((0, _)) => {
                    self.close(cid);
                    return;
                }
                Ok((_, full)) => full,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::debug!(error = %crate::report::ErrorChain(&e), "soft engine: read failed");
                    self.close(cid);
                    return;
                }
            };
            conn.rx_seen = true;
            conn.probe.input = true;
            match into {
                ReadInto::Discard => {
                    if conn.rx_skip > 0 && !full && !drain {
                        return;
                    }
                }
                ReadInto::Memory => {
                    if conn.rx_direct.as_ref().is_some_and(|d| d.remaining == 0) {
                        if let Some(d) = conn.rx_direct.take() {
                            if d.hdr.opcode == Opcode::ReadResp {
                                self.on_response(cid, &d.hdr, &[], Some(!d.broken));
                            } else {
                                self.on_request(cid, &d.hdr, &[], Some(!d.broken));
                            }
                            self.note_timer(d.hdr.dst_qpn);
                        }
                        // The read that ended the payload may have read the
                        // next packet's first bytes into the buffer.
                        if self.conns.get(cid).is_some_and(|c| c.rx_end > c.rx_start)
                            && !self.process_rx(cid)
                        {
                            self.close(cid);
                            return;
                        }
                        self.activate(cid);
                    }
                    if !full && !drain {
                        return;
                    }
                }
                ReadInto::Buffer => {
                    if !self.process_rx(cid) {
                        self.close(cid);
                        return;
                    }
                    // What the packets produced (ACKs, data) goes out in
                    // this loop turn.
                    self.activate(cid);
                    if !full && !drain {
                        return;
                    }
                }
            }
        }
    }

    /// Handles every complete packet in the receive buffer. False = protocol
    /// violation, drop the connection.
    pub(super) fn process_rx(&mut self, cid: usize) -> bool {
        if !self.conns.get(cid).is_some_and(|c| c.proven()) {
            // Before the peer is proven: handshake packets only, in a
            // small buffer (see `port.rs`).
            match self.handshake_rx(cid) {
                Handshake::Close => return false,
                Handshake::Wait => return true,
                Handshake::Proven => {}
            }
        }
        let Some(conn) = self.conns.get_mut(cid) else {
            return false;
        };
        if conn.rx_direct.is_some() || conn.rx_skip > 0 {
            // A packet's payload is arriving straight into memory (or is
            // being dropped as it arrives): the buffer holds nothing until
            // it is in, and where its bytes go must not be forgotten (the
            // resumption of a connection proven in the turn that started
            // such a payload gets here).
            return true;
        }
        // Responses go out before anything a poster would write now.
        conn.claim();
        let rx = std::mem::take(&mut conn.rx);
        let (mut start, end) = (conn.rx_start, conn.rx_end);
        let mut ok = true;
        let mut need = 0;
        let mut skip = 0;
        let mut direct = None;
        while end - start >= HEADER_LEN {
            let hdr = match decode_header(&rx[start..end]) {
                Ok(h) => h,
                Err(e) => {
                    tracing::warn!(error = %crate::report::ErrorChain(&e), "soft engine: bad packet, closing connection");
                    ok = false;
                    break;
                }
            };
            let total = HEADER_LEN + hdr.payload_len as usize;
            if end - start < total {
                let foreign =
                    !hdr.opcode.is_datagram() && self.peer_of_qp(cid, hdr.dst_qpn) != Some(true);
                // (Its view of the QP may have been refreshed.)
                self.note_timer(hdr.dst_qpn);
                if foreign {
                    // No QP here takes it from this peer: the rest of its
                    // payload is dropped as it arrives, never buffered.
                    self.port.foreign_packet();
                    skip = total - (end - start);
                    start = end;
                    break;
                }
                if hdr.payload_len as usize >= DIRECT_MIN {
                    direct = self.direct_target(cid, &hdr);
                    self.note_timer(hdr.dst_qpn);
                }
                if let Some(d) = &mut direct {
                    // Place the bytes already here; read the rest straight
                    // into the registered memory.
                    d.place(&self.sh.mrs(), &rx[start + HEADER_LEN..end]);
                    start = end;
                } else {
                    need = total;
                }
                break;
            }
            let payload = &rx[start + HEADER_LEN..start + total];
            start += total;
            if matches!(
                hdr.opcode,
                Opcode::Hello | Opcode::Verify | Opcode::VerifyReply
            ) {
                refusal!(self.port, opcode = ?hdr.opcode, "soft engine: handshake packet after the handshake, closing connection");
                ok = false;
                break;
            }
            self.handle_packet(cid, &hdr, payload);
            self.note_timer(hdr.dst_qpn);
        }
        if let Some(conn) = self.conns.get_mut(cid) {
            if start == end {
                start = 0;
                conn.rx_end = 0;
            }
            conn.rx = rx;
            if conn.rx.len() > RX_CAP {
                // It grew for a large packet: kept while they keep coming
                // (`BIG_BUF_KEEP`), shrunk by the port's sweep after.
                conn.big_buf_used = true;
                self.port.sweep_by(Instant::now() + BIG_BUF_KEEP);
            }
            conn.rx_start = start;
            conn.rx_need = need;
            conn.rx_skip = skip;
            conn.rx_direct = direct;
        }
        ok
    }

    /// Checks whether a WRITE or SEND segment whose payload is still
    /// arriving can be received straight into its target memory (the
    /// request will succeed): a WRITE's region, or the SGEs of the receive
    /// WR a SEND lands in (taken from the receive queue now for a first
    /// segment, as its handling would take it, see `responder.rs`).
    fn direct_target(&mut self, cid: usize, hdr: &Header) -> Option<RxDirect> {
        if hdr.opcode == Opcode::ReadResp {
            return self.direct_read_resp(cid, hdr);
        }
        let send = matches!(hdr.opcode, Opcode::Send | Opcode::SendImm | Opcode::SendInv);
        if !send && !matches!(hdr.opcode, Opcode::Write | Opcode::WriteImm) {
            return None;
        }
        if !self.sent_by_peer_of(cid, hdr.dst_qpn) {
            // (Handled, and dropped, once it is whole.)
            return None;
        }
        let (eq, st) = load_qp(&mut self.qps, &self.sh, hdr.dst_qpn)?;
        if !matches!(st, QpState::Rtr | QpState::Rts)
            || eq.sh.qp_type != QpType::Rc
            || !eq.configured
            || hdr.src_qpn != eq.cfg.remote_qpn
            || hdr.psn != eq.epsn
        {
            return None;
        }
        let first = hdr.flags & FLAG_FIRST != 0;
        let pd = eq.sh.pd;
        let mrs = self.sh.mrs();
        if send {
            if first && eq.recv_for != Some(hdr.psn) {
                if eq.cur_recv.is_some() {
                    // (A message in progress: the first segment of another
                    // is the handler's to refuse.)
                    return None;
                }
                // No receive WR: the handler answers RNR.
                eq.cur_recv = Some(eq.sh.take_recv()?);
                eq.recv_for = Some(hdr.psn);
            }
            let r = eq.cur_recv.as_ref()?;
            // A receive too short, or memory not writable: the handler
            // fails the request once the payload is in.
            if hdr.arg0 > r.len || !check_local(&r.sges, pd, &mrs, true) {
                return None;
            }
            let len = u64::from(hdr.payload_len);
            writable_spans(&r.sges, pd, &mrs, hdr.arg1, len)?;
            return Some(RxDirect {
                qp: eq.sh.clone(),
                hdr: *hdr,
                pd,
                into: DirectInto::Local {
                    sges: r.sges.clone(),
                    at: hdr.arg1,
                },
                remaining: hdr.payload_len as usize,
                broken: false,
            });
        }
        if !eq.cfg.access.contains(AccessFlags::REMOTE_WRITE) {
            return None;
        }
        if first && hdr.opcode == Opcode::WriteImm && eq.sh.no_recv() {
            return None;
        }
        let (from, len) = if first {
            (hdr.addr, hdr.arg0)
        } else {
            (hdr.addr + hdr.arg1, u64::from(hdr.payload_len))
        };
        mrs.remote(
            hdr.dst_qpn,
            hdr.rkey,
            pd,
            from,
            len,
            AccessFlags::REMOTE_WRITE,
        )
        .ok()?;
        Some(RxDirect {
            qp: eq.sh.clone(),
            hdr: *hdr,
            pd,
            into: DirectInto::Remote {
                at: hdr.addr + hdr.arg1,
            },
            remaining: hdr.payload_len as usize,
            broken: false,
        })
    }

    /// Checks whether a READ response segment whose payload is still
    /// arriving answers the READ at the front of its QP (as its handling
    /// will check, see `requester.rs`), and can be received straight into
    /// that READ's SGEs.
    fn direct_read_resp(&mut self, cid: usize, hdr: &Header) -> Option<RxDirect> {
        if !self.sent_by_peer_of(cid, hdr.dst_qpn) {
            return None;
        }
        let eq = self.qps.get_mut(&hdr.dst_qpn)?;
        let (qp, pd) = (eq.sh.clone(), eq.sh.pd);
        let f = read_answered(eq, hdr)?;
        let mrs = self.sh.mrs();
        writable_spans(&f.w.sges, pd, &mrs, hdr.arg1, u64::from(hdr.payload_len))?;
        Some(RxDirect {
            qp,
            hdr: *hdr,
            pd,
            into: DirectInto::Local {
                sges: f.w.sges.clone(),
                at: hdr.arg1,
            },
            remaining: hdr.payload_len as usize,
            broken: false,
        })
    }

    fn handle_packet(&mut self, cid: usize, hdr: &Header, payload: &[u8]) {
        if self.in_app {
            self.app_packets += 1;
        }
        match hdr.opcode {
            Opcode::Ping => return self.on_ping(cid, hdr.arg0),
            Opcode::Pong => return self.on_pong(cid, hdr.arg0),
            _ => {}
        }
        // (A datagram may come from any proven engine: the UD receive
        // checks and counts it, for an RC QP too.)
        if !hdr.opcode.is_datagram() && !self.sent_by_peer_of(cid, hdr.dst_qpn) {
            self.port.foreign_packet();
            tracing::debug!(
                qpn = hdr.dst_qpn,
                opcode = ?hdr.opcode,
                "soft engine: packet for a QP whose peer is another engine, dropped"
            );
            return;
        }
        match hdr.opcode {
            Opcode::Hello | Opcode::Verify | Opcode::VerifyReply => {}
            op if op.is_datagram() => self.on_datagram(cid, hdr, payload),
            op if op.is_request() => self.on_request(cid, hdr, payload, None),
            _ => self.on_response(cid, hdr, payload, None),
        }
    }
}
