//! The transmit side: which QPs and connections have output, and the
//! fill+flush rounds that turn WRs and responses into bytes on the wire.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::super::conn::{Flush, BIG_BUF_KEEP};
use super::Engine;
use crate::provider::WcStatus;

/// Rounds of fill+flush per connection before looking at other events.
const SERVICE_ROUNDS: usize = 8;

/// Held ACKs the engine sends alone (no request came to take them along)
/// longer than this after their hold ended count as late
/// (`Shared::late_holds`): they waited for the engine to wake.
const LATE_HOLD: Duration = Duration::from_micros(200);

impl Engine {
    /// Puts a requester QP on its connection's sender list.
    pub fn schedule(&mut self, qpn: u32) {
        let Some(eq) = self.qps.get_mut(&qpn) else {
            return;
        };
        if eq.scheduled || eq.send_idx >= eq.wqes.len() {
            return;
        }
        let Some(cid) = eq.conn else {
            return;
        };
        let Some(conn) = self.conns.get_mut(cid) else {
            return;
        };
        eq.scheduled = true;
        conn.claim();
        conn.senders.push_back(qpn);
        if !conn.active {
            conn.active = true;
            self.active.push(cid);
        }
    }

    pub fn activate(&mut self, cid: usize) {
        if let Some(conn) = self.conns.get_mut(cid) {
            if !conn.active {
                conn.active = true;
                self.active.push(cid);
            }
        }
    }

    /// Fills and flushes every active connection. True if some still has
    /// work that can proceed now. `force`: held ACKs go out too.
    pub(crate) fn service_active(&mut self, force: bool) -> bool {
        let mut list = std::mem::take(&mut self.active_buf);
        std::mem::swap(&mut list, &mut self.active);
        let mut busy = false;
        let now = self.now();
        for cid in list.drain(..) {
            if let Some(c) = self.conns.get_mut(cid) {
                c.active = false;
                if !force && c.holding(now) {
                    if c.park_acks() {
                        self.held.push(cid);
                        continue;
                    }
                    // A posting thread took the ACKs along.
                    c.ack_hold = None;
                    if !c.stream.as_ref().is_some_and(|w| w.engine_busy()) {
                        continue;
                    }
                    // (What the socket did not take of them waits in the
                    // spill: written now.)
                }
                let alone = c.end_hold(now);
                if alone.is_some_and(|t| now.saturating_duration_since(t) > LATE_HOLD) {
                    self.sh.late_holds.fetch_add(1, Ordering::Relaxed);
                }
            } else {
                continue;
            }
            if self.service_conn(cid) {
                busy = true;
                self.activate(cid);
            }
        }
        self.active_buf = list;
        // (Servicing one connection can give another one work: a UD QP
        // whose next datagram goes elsewhere, a loopback request answered
        // on another connection.)
        busy || !self.active.is_empty()
    }

    /// Generates and writes packets for one connection. True if it stopped
    /// with work left that does not wait for the socket.
    fn service_conn(&mut self, cid: usize) -> bool {
        let Some(conn) = self.conns.get(cid) else {
            return false;
        };
        conn.claim();
        let more = self.service_conn_rounds(cid);
        if let Some(conn) = self.conns.get_mut(cid) {
            conn.settle();
            if conn.big_buffers() {
                // Kept while large packets keep going (`BIG_BUF_KEEP`).
                conn.big_buf_used = true;
                self.port.sweep_by(Instant::now() + BIG_BUF_KEEP);
            }
        }
        more
    }

    fn service_conn_rounds(&mut self, cid: usize) -> bool {
        for round in 0..SERVICE_ROUNDS {
            if round > 0 {
                // WRs posted meanwhile join this connection's senders now,
                // not after the last round: a long transfer's rounds can
                // take milliseconds, and a datagram posted during them
                // would wait for all of them.
                self.service_dirty();
            }
            self.fill_tx(cid);
            let Some(conn) = self.conns.get_mut(cid) else {
                return false;
            };
            let res = {
                let mrs = self.sh.mrs();
                conn.flush(&mrs)
            };
            let writes = std::mem::take(&mut conn.writes);
            self.sh.tx_writes.fetch_add(writes, Ordering::Relaxed);
            if !conn.broken.is_empty() {
                let broken = std::mem::take(&mut conn.broken);
                for qpn in broken {
                    if let Some(eq) = self.qps.get_mut(&qpn) {
                        eq.fail(Some(WcStatus::LocProtErr));
                    }
                }
            }
            if !conn.refused_reads.is_empty() {
                // (Their NAKs are queued.)
                let refused = std::mem::take(&mut conn.refused_reads);
                for qpn in refused {
                    if let Some(eq) = self.qps.get_mut(&qpn) {
                        eq.fail(None);
                    }
                }
            }
            match res {
                Flush::Closed => {
                    self.close(cid);
                    return false;
                }
                Flush::Blocked => {
                    if conn.connected {
                        self.sh.tx_blocked.fetch_add(1, Ordering::Relaxed);
                    }
                    return false;
                }
                Flush::Done => {}
            }
            let lo = self.conns.get(cid).is_some_and(|c| c.is_loopback());
            if lo && !self.process_rx(cid) {
                tracing::error!("soft engine: loopback produced an invalid packet");
                self.close(cid);
                return false;
            }
            let conn = &self.conns[cid];
            if conn.resp.is_empty() && conn.senders.is_empty() {
                return false;
            }
        }
        true
    }
}
