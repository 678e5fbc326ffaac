//! ACKs: coalescing consecutive ones of a QP, and holding those of a
//! message that completed a receive for a request to ride with.
//!
//! A hold pays when the receiving application answers (a request-reply
//! exchange: the ACK rides with the answer). When it does not (one side
//! only sends; each SEND's completion waits for its ACK), a hold only
//! delays every ACK by the hold. So once a hold ends with its ACKs going
//! out alone, the connection stops holding (`hold_pays`) until this side
//! sends a request again (the application answers again).

use std::time::Instant;

use super::super::packet::{Header, Opcode, HEADER_LEN};
use super::{Conn, Resp};

/// How many queued responses (or parked ACKs, see `Wire::hold`) an ACK
/// looks back over for an earlier ACK of its QP to coalesce with: a
/// bound on the work per ACK on a connection many QPs share.
pub(crate) const ACK_SCAN: usize = 64;

impl Conn {
    /// Queues an ACK. `hold_until`: it may wait until then for a request
    /// to go out with it (see `ack_hold`); `None` = send it at once.
    pub fn push_ack(&mut self, dst: u32, src: u32, psn: u32, hold_until: Option<Instant>) {
        let hold_until = hold_until.filter(|_| self.holds_pay());
        match hold_until {
            // (ACKs parked on the wire keep their hold's deadline; once a
            // poster took them along, the deadline was theirs, not this
            // ACK's: a new hold starts.)
            Some(t) if self.resp.is_empty() && (self.ack_hold.is_none() || self.parked_gone()) => {
                self.ack_hold = Some(t)
            }
            // Keep what is pending: held ACKs stay held, anything else
            // (`ack_hold` is `None` then) goes out at once anyway.
            Some(_) => {}
            None => self.ack_hold = None,
        }
        self.push_resp(Resp::Ack { dst, src, psn });
    }

    /// True while holding ACKs pays (see the module docs): a request went
    /// out since a hold last ended alone.
    fn holds_pay(&mut self) -> bool {
        if !self.hold_pays && self.stream.as_ref().is_some_and(|w| w.take_request_sent()) {
            self.hold_pays = true;
        }
        self.hold_pays
    }

    /// The connection is about to be serviced with its hold (if any) over
    /// at `now`: a request to send means the application answers (holds
    /// pay again); ACKs going out alone at their deadline mean it did not.
    /// Returns when that deadline was if they go out alone now.
    pub fn end_hold(&mut self, now: Instant) -> Option<Instant> {
        let mut alone = None;
        if !self.senders.is_empty() {
            self.hold_pays = true;
        } else if self.ack_hold.is_some_and(|t| t <= now)
            && self.tx_pending() == 0
            && self.tx_mem.is_none()
            && (self.resp.iter().any(|r| matches!(r, Resp::Ack { .. }))
                || self.stream.as_ref().is_some_and(|w| !w.held_gone()))
        {
            self.hold_pays = false;
            alone = self.ack_hold;
        }
        self.ack_hold = None;
        alone
    }

    /// True if no ACKs wait parked on the wire (a posting thread took them
    /// along, or none were parked).
    fn parked_gone(&self) -> bool {
        match &self.stream {
            // (Only the hold's deadline depends on it.)
            Some(w) => w.held_gone_hint(),
            None => true,
        }
    }

    /// True while the pending output is only held ACKs, not yet due.
    pub fn holding(&self, now: Instant) -> bool {
        self.ack_hold.is_some_and(|t| now < t)
            && self.senders.is_empty()
            && self.tx_pending() == 0
            && self.tx_mem.is_none()
    }

    /// Queues a response, coalescing an ACK with the last one of its QP
    /// still queued when nothing else of that QP is queued after it: an
    /// ACK acknowledges everything up to its PSN, so the later one says
    /// what both said, and responses of other QPs do not care about the
    /// order (a window of SENDs spread over several QPs, one ACK per QP
    /// and read instead of one per message). Looks back over at most
    /// [`ACK_SCAN`] responses.
    pub fn push_resp(&mut self, r: Resp) {
        match r {
            Resp::Ack { dst, src, psn } => {
                // (Most often the last one: one QP's messages back to back.)
                match self.resp.back_mut() {
                    Some(Resp::Ack {
                        dst: d,
                        src: s,
                        psn: p,
                    }) if *d == dst && *s == src => {
                        *p = psn;
                        return;
                    }
                    _ => {}
                }
                if !self.resp.is_empty() && self.merge_earlier_ack(dst, src, psn) {
                    return;
                }
            }
            _ => self.ack_hold = None,
        }
        self.resp.push_back(r);
    }

    /// Gives an earlier queued ACK of the QPs `dst`/`src` the PSN `psn`,
    /// unless another response of theirs follows it or it is not among
    /// the last [`ACK_SCAN`] responses. True if it did.
    fn merge_earlier_ack(&mut self, dst: u32, src: u32, psn: u32) -> bool {
        for q in self.resp.iter_mut().rev().take(ACK_SCAN) {
            match q {
                Resp::Ack {
                    dst: d,
                    src: s,
                    psn: p,
                } if *d == dst && *s == src => {
                    *p = psn;
                    return true;
                }
                // Another response of these QPs: the ACK goes after it.
                Resp::Nak { dst: d, src: s, .. } | Resp::Atomic { dst: d, src: s, .. }
                    if *d == dst && *s == src =>
                {
                    return false
                }
                Resp::Read(j) if j.dst == dst && j.src == src => return false,
                _ => {}
            }
        }
        false
    }

    /// While holding: parks the held ACKs on the wire, where a posting
    /// thread's write takes them along. False once that happened (or for
    /// the loopback connection, which keeps them queued): the hold is over.
    pub fn park_acks(&mut self) -> bool {
        let Some(w) = &self.stream else {
            return true;
        };
        if self.resp.is_empty() {
            // (What arrived meanwhile produced no output: posters may write.)
            w.release(true);
            return !w.held_gone();
        }
        if !self.resp.iter().all(|r| matches!(r, Resp::Ack { .. })) {
            return true;
        }
        let mut bytes = [0u8; 4 * HEADER_LEN];
        let mut n = 0;
        while let Some(Resp::Ack { dst, src, psn }) = self.resp.front() {
            if n == bytes.len() {
                w.hold(&bytes[..n]);
                n = 0;
            }
            let mut h = Header::new(Opcode::Ack);
            (h.dst_qpn, h.src_qpn, h.psn) = (*dst, *src, *psn);
            bytes[n..n + HEADER_LEN].copy_from_slice(&h.encode());
            n += HEADER_LEN;
            self.resp.pop_front();
        }
        w.hold(&bytes[..n]);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::wire::loopback_wire;
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    fn conn() -> Conn {
        let mut c = Conn::new(None, "127.0.0.1:1".parse().expect("addr"), true);
        c.tx.clear(); // the HELLO
        c
    }

    #[test]
    fn an_ack_after_parked_acks_were_taken_along_gets_its_own_hold() {
        let (wire, _peer, local) = loopback_wire(0);
        let wire = Arc::new(wire);
        let mut c = Conn::new(Some(wire.clone()), local, true);
        c.tx.clear(); // the HELLO
        let now = Instant::now();
        let first = now + Duration::from_micros(50);
        c.push_ack(1, 2, 3, Some(first));
        assert!(c.park_acks(), "parked on the wire");
        assert!(c.resp.is_empty() && !wire.held_gone());
        // Another ACK while the first still waits parked: the hold keeps
        // the first one's deadline.
        c.push_ack(1, 2, 4, Some(first + Duration::from_micros(30)));
        assert!(!c.holding(first));
        assert!(c.park_acks());
        // A poster's request takes them along.
        let mut h = Header::new(Opcode::Send);
        h.payload_len = 0;
        assert_eq!(
            wire.try_write(&h.encode()),
            Some(super::super::super::wire::DirectWrite::Sent)
        );
        assert!(wire.held_gone());
        // The next message's ACK may wait its own full delay.
        let second = first + Duration::from_micros(100);
        c.push_ack(1, 2, 5, Some(second));
        assert!(c.holding(first), "held until its own deadline");
        assert!(!c.holding(second));
    }

    #[test]
    fn a_qps_acks_parked_in_several_reads_leave_as_one_ack() {
        use std::io::Read;
        let (wire, mut peer, local) = loopback_wire(0);
        let wire = Arc::new(wire);
        let mut c = Conn::new(Some(wire.clone()), local, true);
        c.tx.clear(); // the HELLO
        let until = Instant::now() + Duration::from_micros(50);
        // Each ACK is parked by its own read's turn (as messages that
        // arrive one per read are), while none of them has left yet.
        for (dst, src, psn) in [(1, 2, 3), (1, 2, 4), (1, 2, 5), (7, 8, 1), (1, 2, 6)] {
            c.push_ack(dst, src, psn, Some(until));
            assert!(c.park_acks(), "parked on the wire");
        }
        let mut h = Header::new(Opcode::Send);
        h.dst_qpn = 9;
        h.flags = super::super::super::packet::FLAG_FIRST | super::super::super::packet::FLAG_LAST;
        assert_eq!(
            wire.try_write(&h.encode()),
            Some(super::super::super::wire::DirectWrite::Sent)
        );
        // What the peer reads: one ACK per QP, with its last PSN, then the
        // request.
        let mut got = [0u8; 3 * HEADER_LEN];
        peer.read_exact(&mut got).expect("read");
        let acks: Vec<(Opcode, u32, u32, u32)> = got
            .chunks(HEADER_LEN)
            .map(|b| {
                let h = super::super::super::packet::decode_header(b).expect("header");
                (h.opcode, h.dst_qpn, h.src_qpn, h.psn)
            })
            .collect();
        assert_eq!(
            acks,
            [
                (Opcode::Ack, 1, 2, 6),
                (Opcode::Ack, 7, 8, 1),
                (Opcode::Send, 9, 0, 0)
            ]
        );
        peer.set_nonblocking(true).expect("nonblocking");
        let mut more = [0u8; 1];
        assert!(peer.read(&mut more).is_err(), "nothing else was sent");
    }

    #[test]
    fn a_window_of_sends_over_several_qps_queues_one_ack_per_qp() {
        let mut c = conn();
        // 8 messages on each of 4 QPs, round robin (as a window of RPC
        // requests spread over a session's QPs arrives).
        for psn in 0..8 {
            for qp in 0..4 {
                c.push_ack(100 + qp, 200 + qp, psn, None);
            }
        }
        let acks: Vec<(u32, u32)> = c
            .resp
            .iter()
            .map(|r| match r {
                Resp::Ack { dst, psn, .. } => (*dst, *psn),
                other => panic!("not an ACK: {other:?}"),
            })
            .collect();
        assert_eq!(acks, [(100, 7), (101, 7), (102, 7), (103, 7)]);
        // Another response of a QP keeps its later ACK behind it.
        c.push_resp(Resp::Nak {
            dst: 101,
            src: 201,
            psn: 8,
            syndrome: 0,
            timer: 0,
        });
        c.push_ack(101, 201, 9, None);
        c.push_ack(100, 200, 8, None);
        let order: Vec<(u32, u32)> = c
            .resp
            .iter()
            .map(|r| match r {
                Resp::Ack { dst, psn, .. } | Resp::Nak { dst, psn, .. } => (*dst, *psn),
                other => panic!("unexpected: {other:?}"),
            })
            .collect();
        assert_eq!(
            order,
            [(100, 8), (101, 7), (102, 7), (103, 7), (101, 8), (101, 9)]
        );
    }

    #[test]
    fn a_hold_that_ends_alone_stops_holding_until_a_request_goes_out() {
        let now = Instant::now();
        let until = now + Duration::from_micros(50);
        let mut c = conn();
        c.push_ack(1, 2, 3, Some(until));
        assert!(c.holding(now));
        // Nothing rode with it: it ends alone at its deadline.
        c.end_hold(until);
        assert!(!c.hold_pays);
        c.resp.clear(); // (written)
        c.push_ack(1, 2, 4, Some(until + Duration::from_micros(100)));
        assert!(!c.holding(until), "sent at once, not held");
        c.resp.clear();
        // This side sends a request: the application answers again.
        c.senders.push_back(9);
        c.end_hold(until);
        c.senders.clear();
        assert!(c.hold_pays);
        let later = until + Duration::from_micros(200);
        c.push_ack(1, 2, 5, Some(later));
        assert!(c.holding(until), "held again");
        // A hold that ends with a request to ride with keeps holding on.
        c.senders.push_back(9);
        c.end_hold(later);
        assert!(c.hold_pays);
    }

    #[test]
    fn a_hold_ends_alone_only_when_its_acks_go_out_alone() {
        let now = Instant::now();
        let until = now + Duration::from_micros(50);
        let mut c = conn();
        c.push_ack(1, 2, 3, Some(until));
        // Serviced before its deadline (something else is pending): not alone.
        c.end_hold(now);
        assert!(c.hold_pays);
        // Nothing held any more: nothing goes out alone.
        c.resp.clear();
        c.ack_hold = Some(until);
        c.end_hold(until);
        assert!(c.hold_pays);
    }

    #[test]
    fn held_acks_wait_only_while_nothing_else_is_pending() {
        let now = Instant::now();
        let until = now + Duration::from_millis(10);
        let mut c = conn();
        assert!(!c.holding(now));
        c.push_ack(1, 2, 3, Some(until));
        c.push_ack(1, 2, 4, Some(until + Duration::from_millis(5)));
        assert_eq!(c.resp.len(), 1, "consecutive ACKs coalesce");
        assert!(c.holding(now));
        assert!(!c.holding(until), "due at the first hold's deadline");
        // A request to send ends the hold: the ACK rides with it.
        c.senders.push_back(9);
        assert!(!c.holding(now));
        c.senders.clear();
        // Bytes waiting in the transmit buffer end it too.
        c.tx.push(0);
        assert!(!c.holding(now));
        c.tx.clear();
        // An ACK that must go at once ends it, and a later delayable ACK
        // does not start a new hold behind it.
        c.push_ack(5, 6, 1, None);
        assert!(!c.holding(now));
        c.push_ack(1, 2, 5, Some(until));
        assert!(!c.holding(now));
        // Any other response ends a hold.
        let mut c = conn();
        c.push_ack(1, 2, 3, Some(until));
        c.push_resp(Resp::Nak {
            dst: 1,
            src: 2,
            psn: 4,
            syndrome: 0,
            timer: 0,
        });
        assert!(!c.holding(now));
    }
}
