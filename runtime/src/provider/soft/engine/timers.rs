//! The engine's timers: RNR waits, ACK timeouts (see `liveness.rs`), and
//! when to wake next.

use std::time::{Duration, Instant};

use super::Engine;

/// While posting threads transmit requests themselves, the engine wakes at
/// least this often (to time their WRs out without being rung for each).
pub(crate) const DIRECT_TICK: Duration = Duration::from_millis(10);
/// ... for this long after the last such post it learned of.
pub(super) const DIRECT_AWAKE: Duration = Duration::from_secs(1);

impl Engine {
    pub(super) fn timers(&mut self, now: Instant) {
        let mut resched = std::mem::take(&mut self.resched_buf);
        for (qpn, eq) in self.qps.iter_mut() {
            if let Some(t) = eq.rnr_until {
                if t <= now {
                    eq.rnr_until = None;
                    resched.push(*qpn);
                }
            }
        }
        self.ack_timers(now);
        for qpn in resched.drain(..) {
            self.ensure_conn(qpn);
            self.schedule(qpn);
        }
        self.resched_buf = resched;
    }

    /// When the engine must wake next, and whether only to see if leases
    /// ended (the first deadline is a lease's, before every other one).
    pub(super) fn next_deadline(&mut self, now: Instant) -> (Option<Instant>, bool) {
        let held = self
            .held
            .iter()
            .filter_map(|&cid| self.conns.get(cid).and_then(|c| c.ack_hold));
        // While posting threads transmit, wake now and then, so that their
        // posts need not ring the doorbell for the WRs' timeouts.
        if self.direct_until.is_some_and(|t| t <= now) {
            self.direct_until = None;
        }
        let tick = self.direct_until.map(|_| now + DIRECT_TICK);
        let lease = self.lease_deadline();
        let conn_wait = self.conn_wait.iter().map(|(_, t)| *t).min();
        let other = self
            .qps
            .values()
            .flat_map(|eq| [eq.rnr_until, eq.ack_deadline])
            .flatten()
            .chain(held)
            .chain(tick)
            .chain(conn_wait)
            .chain(self.probe_check)
            .min();
        match (lease, other) {
            (Some(l), Some(o)) if l < o => (Some(l), true),
            (Some(l), None) => (Some(l), true),
            (l, o) => (l.into_iter().chain(o).min(), false),
        }
    }
}
