//! Datagrams transmitted by the posting thread: while the engine holds
//! none of a UD QP's WRs (it says so with `QpInner::ud_direct`), `post_send`
//! encodes the datagrams of its list and writes each run of consecutive
//! ones that go to the same remote engine to that connection's socket in
//! one `send` (`../wire.rs` orders this with the engine's writes), then
//! completes them. The first WR it cannot transmit so (its destination is
//! this engine or has no connection yet, the engine writes to the
//! connection, an invalid WR) and all after it are queued for the engine
//! as usual, in order.

use std::cell::RefCell;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use smallvec::SmallVec;

use super::super::lock;
use super::super::qp::{Qp, SendWqe};
use super::super::wire::{DirectWrite, Wire};
use super::tx::{append, deliver, header, resolve};
use super::Fate;
use crate::provider::{Completion, QpState, SendFlags, SendOp, SendWr, WcStatus};

/// Most datagrams written in one `send`.
const BATCH: usize = 32;

thread_local! {
    /// The packets being built (reused: no allocation per post).
    static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// A datagram encoded into the batch.
struct Encoded {
    w: SendWqe,
    fate: Fate,
}

/// Transmits the longest prefix of `wrs` it can from this thread; returns
/// its length (those WRs are done: completed if signaled). The caller
/// queues the rest.
///
/// # Safety
///
/// The contract of [`Qp::post_send`] holds for `wrs`.
pub(crate) unsafe fn post_direct(qp: &Qp, wrs: &[SendWr]) -> usize {
    SCRATCH.with(|scratch| {
        let Ok(mut buf) = scratch.try_borrow_mut() else {
            return 0;
        };
        let mut done = 0;
        while done < wrs.len() {
            // SAFETY: forwarded contract.
            let n = unsafe { batch(qp, &wrs[done..], &mut buf) };
            if n == 0 {
                break;
            }
            done += n;
        }
        done
    })
}

/// Encodes up to [`BATCH`] WRs from the front of `wrs` that go to one
/// remote engine, writes them, completes them. Returns how many (0: none
/// could go).
///
/// # Safety
///
/// The contract of [`Qp::post_send`] holds for `wrs`.
unsafe fn batch(qp: &Qp, wrs: &[SendWr], buf: &mut Vec<u8>) -> usize {
    let sh = &qp.0.shared;
    let ctx = qp.0.ctx.shared();
    buf.clear();
    let mut wire: Option<Arc<Wire>> = None;
    let mut out: SmallVec<[Encoded; 4]> = SmallVec::new();
    let mut mrs = None;
    for wr in wrs.iter().take(BATCH) {
        // SAFETY: forwarded contract.
        let Ok(w) = (unsafe { qp.check_send(wr) }) else {
            // (Reported by the queueing path.)
            break;
        };
        let SendOp::SendTo { dest, .. } = w.op else {
            break;
        };
        let Some(route) = resolve(ctx, dest.ah, sh.pd) else {
            // (The engine fails it.)
            break;
        };
        // (Loopback datagrams go through the engine.)
        let Some(to) = lock(&ctx.wires).get(&route.addr).cloned() else {
            break;
        };
        match &wire {
            Some(cur) if !Arc::ptr_eq(cur, &to) => break,
            Some(_) => {}
            None => wire = Some(to),
        }
        let Some(h) = header(&w, sh.qpn, sh.next_ud_psn(), route.hop_limit) else {
            break;
        };
        let fate = ctx.ud.fate();
        // The memory is read under the MR-table lock (taken once per batch,
        // released before the QP lock: the engine takes them the other way
        // round only as MR table, then QP).
        if w.inline.is_none() && mrs.is_none() {
            mrs = Some(ctx.mrs());
        }
        let table = if w.inline.is_some() {
            None
        } else {
            mrs.as_deref()
        };
        if !append(buf, &h, &w, sh.pd, table, fate) {
            break;
        }
        out.push(Encoded { w, fate });
    }
    drop(mrs);
    let Some(wire) = wire.filter(|_| !out.is_empty()) else {
        return 0;
    };
    let wrote = {
        let mut inner = lock(&sh.inner);
        if inner.state != QpState::Rts || !inner.sq.is_empty() || !inner.ud_direct {
            return 0;
        }
        if buf.is_empty() {
            // (Every one of them dropped by the fault injection.)
            DirectWrite::Sent
        } else {
            match wire.try_write(buf) {
                Some(w) => w,
                None => {
                    // The engine writes to this connection: from now on
                    // (until it allows it again) WRs queue behind it.
                    inner.ud_direct = false;
                    sh.direct_hint.store(false, Ordering::Relaxed);
                    return 0;
                }
            }
        }
    };
    if wrote == DirectWrite::Spilled {
        // (The engine writes the rest first.)
        ctx.ring();
    }
    let n = out.len();
    for e in out {
        ctx.ud.count_sent(e.fate);
        if e.w.flags.contains(SendFlags::SIGNALED) {
            let wc = Completion {
                wr_id: e.w.wr_id,
                status: WcStatus::Success,
                opcode: e.w.op.completion_opcode(),
                byte_len: e.w.len as u32,
                qp_num: sh.qpn,
                ..Completion::EMPTY
            };
            deliver(ctx, &sh.send_cq, wc);
        }
    }
    n
}
