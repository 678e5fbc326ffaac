//! The engine's timers: RNR waits, ACK timeouts (see `liveness.rs`), and
//! when to wake next.
//!
//! A QP's deadlines (`rnr_until`, `ack_deadline`) are kept in time order
//! in [`Deadlines`], so a loop turn looks only at the QPs whose deadline
//! came (and at those waiting for a probe's answer), never at idle ones:
//! with thousands of QPs per device, scanning them all each turn was most
//! of the engine's work.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::{Duration, Instant};

use super::{EQp, Engine};

/// How often the engine checks that every QP's deadline is queued (a
/// backstop: every change is queued where it is made).
const AUDIT_EVERY: Duration = Duration::from_secs(1);

/// The QPs' deadlines in time order: `(when, qpn)`, earliest first.
///
/// Lazy: a QP's entry is the one at its `EQp::queued` time; its deadline
/// may have moved later since (re-queued when the entry comes due) or gone
/// (nothing to do then). Entries of QPs that moved earlier or went away
/// stay until they come due, and are skipped.
#[derive(Default)]
pub(crate) struct Deadlines {
    heap: BinaryHeap<Reverse<(Instant, u32)>>,
    /// When `audit` next runs.
    audit_at: Option<Instant>,
    /// QP deadlines looked at (tests: idle QPs are never looked at).
    #[cfg(test)]
    pub visits: u64,
}

impl Deadlines {
    /// Queues `eq`'s (QP `qpn`'s) earliest deadline unless an entry at
    /// that time or before is queued already.
    pub(crate) fn note(&mut self, qpn: u32, eq: &mut EQp) {
        let Some(d) = eq.next_timer() else {
            return;
        };
        if eq.queued.is_some_and(|q| q <= d) {
            return;
        }
        eq.queued = Some(d);
        self.heap.push(Reverse((d, qpn)));
    }

    /// The earliest queued time (possibly of a stale entry: the engine
    /// wakes for nothing then, once).
    fn first(&self) -> Option<Instant> {
        self.heap.peek().map(|Reverse((t, _))| *t)
    }

    /// Takes the next QP whose entry is due at `now`; stale entries are
    /// dropped on the way.
    fn pop_due(&mut self, now: Instant, qps: &mut super::super::IdMap<EQp>) -> Option<u32> {
        while let Some(&Reverse((t, qpn))) = self.heap.peek() {
            if t > now {
                return None;
            }
            self.heap.pop();
            if let Some(eq) = qps.get_mut(&qpn) {
                if eq.queued == Some(t) {
                    eq.queued = None;
                    return Some(qpn);
                }
            }
        }
        None
    }

    /// Rebuilds the queue once stale entries outnumber the QPs (deadlines
    /// that kept moving earlier, e.g. RNR waits under a long ACK timeout):
    /// its memory stays bounded by the QPs.
    fn compact(&mut self, qps: &mut super::super::IdMap<EQp>) {
        if self.heap.len() <= 2 * qps.len() + 64 {
            return;
        }
        self.heap.clear();
        for (qpn, eq) in qps.iter_mut() {
            eq.queued = None;
            self.note(*qpn, eq);
        }
    }
}

impl EQp {
    /// The earliest of its deadlines.
    pub(crate) fn next_timer(&self) -> Option<Instant> {
        match (self.rnr_until, self.ack_deadline) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

impl Engine {
    /// Queues QP `qpn`'s deadline if it changed (called after everything
    /// that may set one: taking posted WRs, sending, handling a packet).
    pub(crate) fn note_timer(&mut self, qpn: u32) {
        if let Some(eq) = self.qps.get_mut(&qpn) {
            self.deadlines.note(qpn, eq);
        }
    }

    pub(super) fn timers(&mut self, now: Instant) {
        self.audit_deadlines(now);
        self.probe_answers();
        let mut resched = std::mem::take(&mut self.resched_buf);
        let mut due = std::mem::take(&mut self.due_buf);
        while let Some(qpn) = self.deadlines.pop_due(now, &mut self.qps) {
            due.push(qpn);
        }
        for &qpn in &due {
            let Some(eq) = self.qps.get_mut(&qpn) else {
                continue;
            };
            #[cfg(test)]
            {
                self.deadlines.visits += 1;
            }
            if let Some(t) = eq.rnr_until {
                if t <= now {
                    eq.rnr_until = None;
                    resched.push(qpn);
                }
            }
            self.ack_timer(qpn, now);
        }
        for qpn in due.drain(..) {
            self.note_timer(qpn);
        }
        self.due_buf = due;
        self.check_probes(now);
        for qpn in resched.drain(..) {
            self.ensure_conn(qpn);
            self.schedule(qpn);
        }
        self.resched_buf = resched;
        self.deadlines.compact(&mut self.qps);
    }

    /// Every `AUDIT_EVERY`: checks that every QP's deadline is queued,
    /// and queues one that is not (a change made somewhere that did not
    /// queue it: a bug, reported). It is logged, never a panic, in debug
    /// builds too: the engine serves every QP of the device, and a late
    /// timer of one QP must not stop all of them.
    fn audit_deadlines(&mut self, now: Instant) {
        if self.deadlines.audit_at.is_some_and(|t| now < t) {
            return;
        }
        self.deadlines.audit_at = Some(now + AUDIT_EVERY);
        for (qpn, eq) in self.qps.iter_mut() {
            let Some(d) = eq.next_timer() else {
                continue;
            };
            if eq.queued.is_none_or(|q| q > d) {
                tracing::error!(qpn, deadline = ?d, "soft engine: a QP's deadline was not queued");
                self.deadlines.note(*qpn, eq);
            }
        }
    }

    /// The first of the deadlines that are neither leases nor held ACKs:
    /// the QPs' (possibly a stale entry's:
    /// early, never late), connection waits and probe answers.
    pub(crate) fn first_due(&self) -> Option<Instant> {
        let conn_wait = self.conn_wait.iter().map(|(_, t)| *t).min();
        self.deadlines
            .first()
            .into_iter()
            .chain(conn_wait)
            .chain(self.probe_check)
            .min()
    }

    /// When the engine must wake next; whether only to see if leases
    /// ended (the first deadline is a lease's, before every other one);
    /// and the first deadline that is not a lease's.
    pub(super) fn next_deadline(&self) -> (Option<Instant>, bool, Option<Instant>) {
        let held = self
            .held
            .iter()
            .filter_map(|&cid| self.conns.get(cid).and_then(|c| c.ack_hold));
        // (WRs posting threads transmitted need no tick of their own: a
        // post notes its WR's timeout in `Shared::turn_by`, which a sleep
        // for leases only honours, and rings if the engine would wake
        // later, see `Shared::notify_direct`; the engine's next turn takes
        // the WR over and queues its deadline.)
        let lease = self.lease_deadline();
        // (QPs waiting for a probe's answer are looked at when it comes:
        // a PONG sets `kick`.)
        let other = self.first_due().into_iter().chain(held).min();
        match (lease, other) {
            (Some(l), Some(o)) if l < o => (Some(l), true, other),
            (Some(l), None) => (Some(l), true, None),
            (l, o) => (l.into_iter().chain(o).min(), false, other),
        }
    }
}
