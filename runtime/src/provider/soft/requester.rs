//! Requester side of the engine: turns send WRs into request packets, writes
//! queued responses, and completes WRs from ACKs, NAKs and responses.

use std::time::Instant;

use super::conn::{ReadTail, Resp, TxKey, TxMem};
use super::dma::{check_local, gather, scatter};
use super::drive::note_feed;
use super::engine::{psn_add, psn_le, EQp, Engine, PSN_MASK};
use super::lock;
use super::mr::MrTable;
use super::mw;
use super::packet::{
    Header, Opcode, FLAG_FIRST, FLAG_LAST, FLAG_SOLICITED, MAX_PAYLOAD, NAK_REM_ACCESS,
    NAK_REM_INV_REQ, NAK_REM_OP, NAK_RNR,
};
use super::ud;
use crate::provider::{
    rnr_timer_duration, AccessFlags, QpState, QpType, SendFlags, SendOp, WcStatus,
};
use smallvec::SmallVec;
use std::sync::{Arc, Mutex};

/// What generating a QP's next packet did.
pub(crate) enum Gen {
    /// A packet was added.
    Sent,
    /// Nothing to send now.
    Idle,
    /// UD: the next datagram goes to another engine's connection.
    Moved,
    /// UD: the next datagram waits for this connection to be established.
    Wait,
}

/// Payload bytes copied into one packet (inline, multi-SGE, a READ
/// response's last segment).
const COPY_CHUNK: u64 = 64 * 1024;
/// A READ response's segments sent from memory are at most this big (the
/// requester receives each straight into the READ's memory, or where it
/// cannot, into its buffer, which grows to hold one): a packet's largest
/// payload, as a SEND's or WRITE's. (At 256 KiB the engine made 2.7 times
/// the system calls per MiB of a large READ: docs/benchmarks.md, "The soft
/// device's large messages against TCP".)
pub(crate) const RESP_ZC_SEG: u64 = MAX_PAYLOAD as u64;
/// A READ response's last bytes, copied into its last segment: a segment
/// sent from memory is never the last one, so if the memory goes away
/// while one is on its way (the rest of it goes as zeros), a NAK refusing
/// the READ still follows before the READ could complete.
pub(crate) const RESP_TAIL: u64 = 4 * 1024;
/// Segments at least this big within one SGE are sent from memory, uncopied.
pub(crate) const ZC_MIN: u64 = 16 * 1024;

/// The zero-copy piece for message bytes from `off`: (lkey, address, length)
/// within the SGE that contains `off`, if big enough.
fn zc_piece(w: &super::qp::SendWqe, off: u64) -> Option<(u32, u64, u64)> {
    if w.inline.is_some() {
        return None;
    }
    let mut pos = 0u64;
    for s in &w.sges {
        let l = u64::from(s.length);
        if off < pos + l {
            let seg = (pos + l - off).min(w.len - off).min(u64::from(MAX_PAYLOAD));
            return (seg >= ZC_MIN).then_some((s.lkey, s.addr + (off - pos), seg));
        }
        pos += l;
    }
    None
}

/// Fills the opcode-specific fields of a SEND/WRITE segment header: message
/// bytes `[off, off + chunk)` of `w` (whose op must be a SEND or WRITE).
pub(crate) fn data_header(h: &mut Header, w: &super::qp::SendWqe, off: u64, chunk: u64) {
    let last = off + chunk == w.len;
    h.opcode = match w.op {
        SendOp::SendWithImm { imm } => {
            h.imm = imm;
            Opcode::SendImm
        }
        SendOp::SendWithInv { rkey } => {
            h.rkey = rkey;
            Opcode::SendInv
        }
        SendOp::Write { remote_addr, rkey } => {
            h.addr = remote_addr;
            h.rkey = rkey;
            Opcode::Write
        }
        SendOp::WriteWithImm {
            remote_addr,
            rkey,
            imm,
        } => {
            h.addr = remote_addr;
            h.rkey = rkey;
            h.imm = imm;
            Opcode::WriteImm
        }
        _ => Opcode::Send,
    };
    h.payload_len = chunk as u32;
    h.arg0 = w.len;
    h.arg1 = off;
    h.flags = if off == 0 { FLAG_FIRST } else { 0 } | if last { FLAG_LAST } else { 0 };
    if last && w.flags.contains(SendFlags::SOLICITED) {
        h.flags |= FLAG_SOLICITED;
    }
}

/// Builds the next request packet of `eq` into `tx` (its payload possibly
/// as a zero-copy reference in `zc`).
fn gen_request(
    eq: &mut EQp,
    tx: &mut Vec<u8>,
    zc: &mut Option<super::conn::TxMemRef>,
    mrs: &mut MrTable,
    now: Instant,
) -> Gen {
    if eq.sh.state() != QpState::Rts || eq.rnr_until.is_some() || eq.send_idx >= eq.wqes.len() {
        return Gen::Idle;
    }
    let idx = eq.send_idx;
    let pd = eq.sh.pd;
    {
        let e = &eq.wqes[idx];
        if e.error.is_some() {
            return Gen::Idle;
        }
        if e.w.flags.contains(SendFlags::FENCE) && eq.rd_outstanding > 0 {
            return Gen::Idle;
        }
        // At most `max_rd_atomic` READs/atomics outstanding (0 is taken as
        // 1: such a WR must not wait forever); a response resumes sending.
        let rd_limit = usize::from(eq.cfg.max_rd_atomic.max(1));
        if e.needs_response() && eq.rd_outstanding >= rd_limit {
            return Gen::Idle;
        }
    }
    if eq.send_off == 0 {
        let e = &mut eq.wqes[idx];
        let ok = e.w.inline.is_some() || check_local(&e.w.sges, pd, mrs, e.needs_response());
        if !ok {
            e.error = Some(WcStatus::LocProtErr);
            if idx == 0 {
                eq.fail(Some(WcStatus::LocProtErr));
            }
            return Gen::Idle;
        }
        e.first_psn = eq.next_psn;
    }
    if matches!(
        eq.wqes[idx].w.op,
        SendOp::BindMw { .. } | SendOp::LocalInv { .. }
    ) {
        return local_op(eq, idx, mrs);
    }
    let psn = eq.next_psn;
    let off = eq.send_off;
    let e = &mut eq.wqes[idx];
    let mut h = Header::new(Opcode::Send);
    h.dst_qpn = eq.cfg.remote_qpn;
    h.src_qpn = eq.sh.qpn;
    h.psn = psn;
    h.flags = FLAG_FIRST | FLAG_LAST;
    let mut last = true;
    let mut data = None;
    match e.w.op {
        SendOp::Send
        | SendOp::SendWithImm { .. }
        | SendOp::SendWithInv { .. }
        | SendOp::SendTo { .. }
        | SendOp::Write { .. }
        | SendOp::WriteWithImm { .. } => {
            let piece = zc_piece(&e.w, off);
            let chunk = match piece {
                Some((_, _, seg)) => seg,
                None => (e.w.len - off).min(COPY_CHUNK),
            };
            last = off + chunk == e.w.len;
            data_header(&mut h, &e.w, off, chunk);
            data = Some((off, chunk, piece));
        }
        SendOp::Read { remote_addr, rkey } => {
            h.opcode = Opcode::ReadReq;
            h.addr = remote_addr;
            h.rkey = rkey;
            h.arg0 = e.w.len;
        }
        SendOp::CompareAndSwap {
            remote_addr,
            rkey,
            compare,
            swap,
        } => {
            h.opcode = Opcode::CmpSwap;
            h.addr = remote_addr;
            h.rkey = rkey;
            h.arg0 = compare;
            h.arg1 = swap;
        }
        SendOp::FetchAndAdd {
            remote_addr,
            rkey,
            add,
        } => {
            h.opcode = Opcode::FetchAdd;
            h.addr = remote_addr;
            h.rkey = rkey;
            h.arg0 = add;
        }
        // (Executed by `local_op` above.)
        SendOp::BindMw { .. } | SendOp::LocalInv { .. } => return Gen::Idle,
    }
    let at = tx.len();
    tx.extend_from_slice(&h.encode());
    if let Some((off, chunk, piece)) = data {
        let ok = match (&e.w.inline, piece) {
            (Some(bytes), _) => {
                tx.extend_from_slice(&bytes[off as usize..(off + chunk) as usize]);
                true
            }
            (None, Some((lkey, addr, len))) => {
                let ok = mrs.local(lkey, pd, addr, len, false).is_some();
                if ok {
                    let m = Arc::new(Mutex::new(TxMem {
                        qpn: eq.sh.qpn,
                        key: TxKey::Local(lkey),
                        pd,
                        addr,
                        len: len as usize,
                        pos: 0,
                        copy: None,
                        lost: false,
                    }));
                    eq.zc = Some(m.clone());
                    *zc = Some(m);
                }
                ok
            }
            (None, None) => gather(&e.w.sges, pd, mrs, off, chunk, tx),
        };
        if !ok {
            // The memory was deregistered while the WR was outstanding.
            tx.truncate(at);
            e.error = Some(WcStatus::LocProtErr);
            if idx == 0 && off == 0 {
                eq.fail(Some(WcStatus::LocProtErr));
            }
            return Gen::Idle;
        }
    }
    eq.next_psn = psn_add(psn, 1);
    if last {
        let e = &mut eq.wqes[idx];
        e.last_psn = psn;
        if e.needs_response() {
            eq.rd_outstanding += 1;
        }
        eq.send_idx += 1;
        eq.send_off = 0;
    } else {
        eq.send_off = off + u64::from(h.payload_len);
    }
    if eq.ack_deadline.is_none() {
        eq.ack_deadline = eq.ack_timeout().map(|t| now + t);
        eq.retries_left = eq.cfg.retry_cnt;
    }
    Gen::Sent
}

/// Executes the local operation (bind, invalidate) at `idx`, the next WR
/// to send. It takes no PSN: it completes at once at the front of the
/// send queue, else with the ACK or response of the WR before it.
fn local_op(eq: &mut EQp, idx: usize, mrs: &mut MrTable) -> Gen {
    let (qpn, pd) = (eq.sh.qpn, eq.sh.pd);
    let prev = psn_add(eq.next_psn, PSN_MASK);
    let e = &mut eq.wqes[idx];
    if !e.executed {
        if let Err((status, why)) = mw::execute_local(&e.w.op, qpn, pd, mrs) {
            tracing::debug!(qpn, op = ?e.w.op, why = why.0, "soft device: local operation failed");
            e.error = Some(status);
            if idx == 0 {
                eq.fail(Some(status));
            }
            return Gen::Idle;
        }
        e.executed = true;
    }
    e.first_psn = prev;
    e.last_psn = prev;
    if idx == 0 {
        eq.complete_front(WcStatus::Success, 0);
    } else {
        eq.send_idx += 1;
        eq.send_off = 0;
    }
    Gen::Sent
}

/// Writes (part of) one queued response into `tx` (a READ response's
/// payload possibly as a zero-copy reference in `zc`). True when it is
/// finished; `Err` names a READ whose memory went away (NAKed).
pub(crate) fn gen_resp(
    r: &mut Resp,
    tx: &mut Vec<u8>,
    zc: &mut Option<super::conn::TxMemRef>,
    mrs: &MrTable,
) -> Result<bool, (u32, u32, u32)> {
    let mut h;
    match r {
        Resp::Ack { dst, src, psn } => {
            h = Header::new(Opcode::Ack);
            (h.dst_qpn, h.src_qpn, h.psn) = (*dst, *src, *psn);
        }
        Resp::Nak {
            dst,
            src,
            psn,
            syndrome,
            timer,
        } => {
            h = Header::new(Opcode::Nak);
            (h.dst_qpn, h.src_qpn, h.psn) = (*dst, *src, *psn);
            h.syndrome = *syndrome;
            h.arg0 = u64::from(*timer);
        }
        Resp::Atomic {
            dst,
            src,
            psn,
            orig,
        } => {
            h = Header::new(Opcode::AtomicResp);
            (h.dst_qpn, h.src_qpn, h.psn) = (*dst, *src, *psn);
            h.arg0 = *orig;
        }
        Resp::Ping { seq } => {
            h = Header::new(Opcode::Ping);
            h.arg0 = *seq;
        }
        Resp::Pong { seq } => {
            h = Header::new(Opcode::Pong);
            h.arg0 = *seq;
        }
        Resp::Read(job) => {
            if job.zc.as_ref().is_some_and(|m| lock(m).lost) {
                // Its memory went away while a segment was being sent.
                return Err((job.dst, job.src, job.psn));
            }
            let rest = job.len - job.off;
            // Sent from memory, uncopied, but for the last `RESP_TAIL`.
            let seg = rest.saturating_sub(RESP_TAIL).min(RESP_ZC_SEG);
            let from_mem = seg >= ZC_MIN;
            let chunk = if from_mem { seg } else { rest.min(COPY_CHUNK) };
            let span = if chunk == 0 {
                None
            } else {
                match mrs.remote(
                    job.src,
                    job.rkey,
                    job.pd,
                    job.addr + job.off,
                    chunk,
                    AccessFlags::REMOTE_READ,
                ) {
                    Ok(span) => Some(span),
                    Err(_) => return Err((job.dst, job.src, job.psn)),
                }
            };
            h = Header::new(Opcode::ReadResp);
            (h.dst_qpn, h.src_qpn, h.psn) = (job.dst, job.src, job.psn);
            h.payload_len = chunk as u32;
            h.arg0 = job.len;
            h.arg1 = job.off;
            let last = job.off + chunk == job.len;
            h.flags = if job.off == 0 { FLAG_FIRST } else { 0 } | if last { FLAG_LAST } else { 0 };
            tx.extend_from_slice(&h.encode());
            if from_mem {
                // (Checked above; the flush checks it again before every
                // write.)
                let m = Arc::new(Mutex::new(TxMem {
                    qpn: job.src,
                    key: TxKey::Remote(job.rkey),
                    pd: job.pd,
                    addr: job.addr + job.off,
                    len: chunk as usize,
                    pos: 0,
                    copy: None,
                    lost: false,
                }));
                job.zc = Some(m.clone());
                *zc = Some(m);
            } else if let Some(span) = span {
                span.append_to(tx);
            }
            job.off += chunk;
            return Ok(last);
        }
    }
    tx.extend_from_slice(&h.encode());
    Ok(true)
}

/// After a READ response's segment from memory: if all that is left of
/// the READ is its copied tail, writes that last segment into `after` (to
/// follow the segment in the same write; the caller records it in
/// `Conn::read_tail`, which refuses the READ instead should the segment's
/// memory go away before it is written). True if it did (the READ's
/// response is all queued).
fn queue_read_tail(r: &mut Resp, after: &mut Vec<u8>, mrs: &MrTable) -> bool {
    let Resp::Read(job) = r else {
        return false;
    };
    if job.len - job.off > RESP_TAIL || !after.is_empty() {
        return false;
    }
    let mut none = None;
    match gen_resp(r, after, &mut none, mrs) {
        Ok(true) => true,
        // (A tail below `ZC_MIN` is copied whole; one its memory does not
        // allow is refused when `gen_resp` comes to it again.)
        Ok(false) | Err(_) => {
            after.clear();
            false
        }
    }
}

impl Engine {
    /// Fills the connection's transmit buffer: responses first, then
    /// requests of its sender QPs, round-robin.
    pub(crate) fn fill_tx(&mut self, cid: usize) {
        let now = self.now();
        let Engine {
            conns,
            qps,
            sh,
            deadlines,
            ..
        } = self;
        let Some(conn) = conns.get_mut(cid) else {
            return;
        };
        let mut mrs = sh.mrs();
        let mut failed = None;
        let mut moved: SmallVec<[u32; 4]> = SmallVec::new();
        // A READ answered segment by segment lets the senders put a packet
        // between two segments: a long READ response does not hold back
        // the connection's requests and datagrams until its last byte (a
        // NIC arbitrates between its QPs so too).
        while conn.tx_room() {
            let turn = conn.senders_turn && !conn.senders.is_empty();
            if let Some(r) = conn.resp.front_mut().filter(|_| !turn) {
                conn.senders_turn = matches!(r, Resp::Read(_));
                match gen_resp(r, &mut conn.tx, &mut conn.tx_mem, &mrs) {
                    Ok(true) => {
                        conn.resp.pop_front();
                    }
                    Ok(false) => {
                        if conn.tx_mem.is_some() && queue_read_tail(r, &mut conn.tx_after, &mrs) {
                            // One write takes the segment and its tail.
                            if let Resp::Read(job) = r {
                                conn.read_tail = Some(ReadTail {
                                    dst: job.dst,
                                    src: job.src,
                                    psn: job.psn,
                                });
                            }
                            conn.resp.pop_front();
                        }
                    }
                    Err((dst, src, psn)) => {
                        // The MR went away during a READ: access error.
                        conn.resp.pop_front();
                        conn.resp.push_front(Resp::Nak {
                            dst,
                            src,
                            psn,
                            syndrome: NAK_REM_ACCESS,
                            timer: 0,
                        });
                        // Failed below, once the MR-table lock is released.
                        failed = Some(src);
                        break;
                    }
                }
                continue;
            }
            conn.senders_turn = false;
            let Some(&qpn) = conn.senders.front() else {
                break;
            };
            let Some(eq) = qps.get_mut(&qpn) else {
                conn.senders.pop_front();
                continue;
            };
            let ud = eq.sh.qp_type == QpType::Ud;
            let gen = if ud {
                ud::gen_datagram(eq, sh, conn.peer, conn.connected, &mut conn.tx, &mrs)
            } else {
                gen_request(eq, &mut conn.tx, &mut conn.tx_mem, &mut mrs, now)
            };
            deadlines.note(qpn, eq);
            match gen {
                Gen::Sent => {
                    if conn.senders.len() > 1 {
                        conn.senders.rotate_left(1);
                    }
                }
                Gen::Idle => {
                    conn.senders.pop_front();
                    eq.scheduled = false;
                    let qp = eq.sh.clone();
                    if ud {
                        eq.allow_ud_direct(&mut lock(&qp.inner));
                    } else if let Some(wire) = &conn.stream {
                        eq.allow_direct(&mut lock(&qp.inner), wire);
                    }
                }
                Gen::Moved => {
                    conn.senders.pop_front();
                    eq.scheduled = false;
                    moved.push(qpn);
                }
                // (Established, the connection is filled again.)
                Gen::Wait => break,
            }
        }
        drop(mrs);
        for qpn in moved {
            self.ensure_conn(qpn);
            self.schedule(qpn);
        }
        let Engine { qps, .. } = self;
        if let Some(qpn) = failed {
            if let Some(eq) = qps.get_mut(&qpn) {
                eq.fail(None);
            }
        }
    }

    /// Handles an ACK, NAK, READ response or atomic response. `placed` is
    /// `Some(ok)` for a READ response whose payload was already received
    /// into the READ's memory (`ok` false: that memory went away meanwhile).
    pub(crate) fn on_response(
        &mut self,
        cid: usize,
        hdr: &Header,
        payload: &[u8],
        placed: Option<bool>,
    ) {
        let now = self.now();
        let qpn = hdr.dst_qpn;
        let Engine {
            qps,
            sh,
            conns,
            cq_feeds,
            kick,
            ..
        } = self;
        let Some(eq) = qps.get_mut(&qpn) else {
            return;
        };
        if eq.sh.qp_type != QpType::Rc
            || eq.sh.state() != QpState::Rts
            || hdr.src_qpn != eq.cfg.remote_qpn
        {
            return;
        }
        note_feed(cq_feeds, conns, eq, cid);
        // WRs posting threads transmitted may be the ones answered.
        let qp = eq.sh.clone();
        eq.absorb(&mut lock(&qp.inner));
        match hdr.opcode {
            Opcode::Ack => {
                ack_upto(eq, hdr.psn);
                eq.progress(now);
            }
            Opcode::Nak => {
                ack_upto(eq, psn_add(hdr.psn, PSN_MASK));
                if !nak_is_for_front(eq, hdr.psn) {
                    return;
                }
                match hdr.syndrome {
                    NAK_RNR => {
                        if eq.cfg.rnr_retry != 7 {
                            if eq.rnr_left == 0 {
                                eq.fail(Some(WcStatus::RnrRetryExcErr));
                                return;
                            }
                            eq.rnr_left -= 1;
                        }
                        // Go back to the NAKed WR; the responder dropped the rest.
                        eq.stop_direct(&mut lock(&qp.inner));
                        eq.send_idx = 0;
                        eq.send_off = 0;
                        eq.next_psn = hdr.psn;
                        eq.rd_outstanding = 0;
                        eq.ack_deadline = None;
                        eq.probe = None;
                        eq.rnr_until = Some(now + rnr_timer_duration(hdr.arg0 as u8));
                        // (An application's receive: the engine must know.)
                        *kick = true;
                    }
                    NAK_REM_ACCESS => eq.fail(Some(WcStatus::RemAccessErr)),
                    NAK_REM_OP => eq.fail(Some(WcStatus::RemOpErr)),
                    NAK_REM_INV_REQ => eq.fail(Some(WcStatus::RemInvReqErr)),
                    _ => eq.fail(Some(WcStatus::BadRespErr)),
                }
                return;
            }
            Opcode::ReadResp => {
                ack_upto(eq, psn_add(hdr.psn, PSN_MASK));
                if !front_is(eq, hdr.psn) {
                    return;
                }
                let Some(f) = eq.wqes.front() else {
                    return;
                };
                if !matches!(f.w.op, SendOp::Read { .. }) || hdr.arg0 != f.w.len {
                    eq.fail(Some(WcStatus::BadRespErr));
                    return;
                }
                let ok = placed.unwrap_or_else(|| {
                    let mrs = sh.mrs();
                    scatter(&f.w.sges, eq.sh.pd, &mrs, hdr.arg1, payload)
                });
                if !ok {
                    eq.fail(Some(WcStatus::LocProtErr));
                    return;
                }
                if hdr.flags & FLAG_LAST != 0 {
                    let len = f.w.len as u32;
                    eq.complete_front(WcStatus::Success, len);
                    ack_upto(eq, hdr.psn);
                }
                eq.progress(now);
            }
            Opcode::AtomicResp => {
                ack_upto(eq, psn_add(hdr.psn, PSN_MASK));
                if !front_is(eq, hdr.psn) {
                    return;
                }
                let Some(f) = eq.wqes.front() else {
                    return;
                };
                if !matches!(
                    f.w.op,
                    SendOp::CompareAndSwap { .. } | SendOp::FetchAndAdd { .. }
                ) {
                    eq.fail(Some(WcStatus::BadRespErr));
                    return;
                }
                let ok = {
                    let mrs = sh.mrs();
                    scatter(&f.w.sges, eq.sh.pd, &mrs, 0, &hdr.arg0.to_ne_bytes())
                };
                if !ok {
                    eq.fail(Some(WcStatus::LocProtErr));
                    return;
                }
                eq.complete_front(WcStatus::Success, 8);
                ack_upto(eq, hdr.psn);
                eq.progress(now);
            }
            _ => return,
        }
        self.schedule(qpn);
    }
}

/// True if the front WR was sent and starts at `psn`.
/// The sent READ of `eq` a READ response with header `hdr` answers (the
/// checks the response's handling makes before it places the payload,
/// where the WRs before the READ, which the response acknowledges, will
/// have completed; those that fail there fail the QP, here they only keep
/// the payload out of the READ's memory).
pub(crate) fn read_answered<'e>(eq: &'e mut EQp, hdr: &Header) -> Option<&'e super::eqp::EWqe> {
    if eq.sh.qp_type != QpType::Rc
        || eq.sh.state() != QpState::Rts
        || hdr.src_qpn != eq.cfg.remote_qpn
    {
        return None;
    }
    let qp = eq.sh.clone();
    eq.absorb(&mut lock(&qp.inner));
    eq.wqes
        .iter()
        .take(eq.send_idx)
        .find(|f| f.first_psn == hdr.psn)
        .filter(|f| matches!(f.w.op, SendOp::Read { .. }) && hdr.arg0 == f.w.len)
}

/// True if a NAK of `psn` answers the front WR: it names the WR's first
/// packet, and that packet was sent, though the rest of the WR may still be
/// on its way out. A responder NAKs a message at its first packet and drops
/// the rest, so a NAK that comes while the requester still sends the WR's
/// later packets (an RNR round of a multi-packet SEND on an unpaced
/// connection) must be heard then: ignored, nothing would ever answer the
/// packets that follow it.
fn nak_is_for_front(eq: &EQp, psn: u32) -> bool {
    eq.sh.state() == QpState::Rts
        && eq.wqes.front().is_some_and(|f| f.first_psn == psn)
        && (eq.send_idx > 0 || (psn != eq.next_psn && psn_le(psn, eq.next_psn)))
}

fn front_is(eq: &EQp, psn: u32) -> bool {
    eq.sh.state() == QpState::Rts
        && eq.send_idx > 0
        && eq.wqes.front().is_some_and(|f| f.first_psn == psn)
}

/// Completes every sent WR that needs no response and ends at or before
/// `psn`; then a WR with a local error at the front completes with it.
fn ack_upto(eq: &mut EQp, psn: u32) {
    while let Some(f) = eq.wqes.front() {
        if eq.send_idx == 0 {
            if let Some(st) = f.error {
                eq.fail(Some(st));
            }
            break;
        }
        if f.needs_response() || !psn_le(f.last_psn, psn) {
            break;
        }
        let len = f.w.len as u32;
        eq.complete_front(WcStatus::Success, len);
    }
}
