//! Probes (PING/PONG) on a connection: a PONG tells the engine that the
//! peer engine handled everything this one sent before the PING, and that
//! everything the peer owed on this connection before it has arrived.
//! The engine uses them to tell a QP whose peer stays silent (its ACK
//! timer counts) from a connection that is still recovering from loss
//! (it does not count: TCP retransmits), see `engine/liveness.rs`.

use std::time::Instant;

use super::{Conn, Resp};

/// A connection's probes.
#[derive(Debug, Default)]
pub(crate) struct Probe {
    /// Number of the last PING queued (0: none yet).
    pub asked: u64,
    /// Highest number a PONG answered.
    pub answered: u64,
    /// Since when the oldest unanswered PING waits (restarted when input
    /// arrives, see `input`).
    pub waiting_since: Option<Instant>,
    /// Bytes arrived since `waiting_since`.
    pub input: bool,
}

impl Probe {
    /// True if the PING numbered `seq` (or a later one) was answered.
    pub fn answered(&self, seq: u64) -> bool {
        self.answered >= seq
    }
}

impl Conn {
    /// Queues a PING after everything queued so far (or reuses one that
    /// is queued and not written yet: it goes out after all that was
    /// written before) and returns the number its PONG will carry.
    pub fn want_ping(&mut self, now: Instant) -> u64 {
        if let Some(seq) = self.resp.iter().find_map(|r| match r {
            Resp::Ping { seq } => Some(*seq),
            _ => None,
        }) {
            return seq;
        }
        self.probe.asked += 1;
        let seq = self.probe.asked;
        self.push_resp(Resp::Ping { seq });
        if self.probe.waiting_since.is_none() {
            self.probe.waiting_since = Some(now);
            self.probe.input = false;
        }
        seq
    }

    /// A PING arrived: its PONG goes after every response queued before
    /// it. A PONG still queued at the back is renumbered instead (nothing
    /// was queued since), so a peer's PINGs cost at most one queued PONG
    /// per response between them.
    pub fn push_pong(&mut self, seq: u64) {
        if let Some(Resp::Pong { seq: s }) = self.resp.back_mut() {
            *s = seq;
            return;
        }
        self.push_resp(Resp::Pong { seq });
    }

    /// A PONG arrived.
    pub fn on_pong(&mut self, seq: u64) {
        if seq > self.probe.asked {
            // (Never asked: ignored.)
            return;
        }
        self.probe.answered = self.probe.answered.max(seq);
        if self.probe.answered == self.probe.asked {
            self.probe.waiting_since = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conn() -> Conn {
        let mut c = Conn::new(None, "127.0.0.1:1".parse().expect("addr"), true);
        c.tx.clear(); // the HELLO
        c
    }

    #[test]
    fn a_queued_ping_is_shared_and_a_pong_answers_it() {
        let now = Instant::now();
        let mut c = conn();
        let a = c.want_ping(now);
        let b = c.want_ping(now);
        assert_eq!(a, b, "one queued PING serves every QP that asks");
        assert_eq!(c.resp.len(), 1);
        assert!(c.probe.waiting_since.is_some());
        c.resp.clear(); // (written)
        let d = c.want_ping(now);
        assert_eq!(d, a + 1);
        c.on_pong(a);
        assert!(c.probe.answered(a) && !c.probe.answered(d));
        assert!(c.probe.waiting_since.is_some(), "the second still waits");
        c.on_pong(d + 5); // never asked
        assert!(!c.probe.answered(d));
        c.on_pong(d);
        assert!(c.probe.answered(d));
        assert_eq!(c.probe.waiting_since, None);
    }

    #[test]
    fn pongs_queue_behind_responses_and_coalesce_at_the_back() {
        let mut c = conn();
        c.push_pong(1);
        c.push_pong(2);
        assert_eq!(c.resp.len(), 1, "back-to-back PINGs: one PONG");
        c.push_ack(1, 2, 3, None);
        c.push_pong(3);
        assert_eq!(c.resp.len(), 3, "a PONG never overtakes a response");
        assert!(matches!(c.resp.back(), Some(Resp::Pong { seq: 3 })));
    }
}
