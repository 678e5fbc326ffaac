//! Unreliable datagrams (UD QPs): one packet per message, at most one MTU
//! ([`UD_MTU`](super::packet::UD_MTU)), no ACKs, no retransmission, no
//! ordering promise between destinations.
//!
//! A datagram travels over the same engine-to-engine connections as RC
//! traffic (or the engine's loopback connection): `tx.rs` encodes it, in
//! the engine's fill of a connection or on the posting thread (as small RC
//! requests, see `../direct.rs`), `rx.rs` delivers it into the next posted
//! receive behind a GRH built as rxe builds it (`grh.rs`). This file holds
//! the device's UD counters and the fault injection tests use.

mod direct;
mod grh;
mod route;
mod rx;
mod tx;

pub(crate) use direct::post_direct;
pub(crate) use tx::gen_datagram;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use super::lock;

/// A snapshot of a soft device's UD counters (see
/// [`Context::ud_counters`](super::Context::ud_counters)). Datagrams on the
/// wire = `sent + duplicated`; at the receivers each of them is delivered,
/// dropped (one of the `dropped_*` counters of the receiving device), or
/// lost with a closed connection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct UdCounters {
    /// Datagram WRs transmitted (a duplicated one counts once, an injected
    /// drop not at all).
    pub sent: u64,
    /// Datagrams placed into a posted receive (successfully or with a
    /// length or protection error completion).
    pub delivered: u64,
    /// Arrived for a QP without a posted receive: dropped (as rxe does).
    pub dropped_no_recv: u64,
    /// Arrived with a Q_Key other than the destination QP's: dropped.
    pub dropped_qkey: u64,
    /// Arrived for a QP that does not exist, is not UD, or is not in RTR
    /// or RTS: dropped.
    pub dropped_no_qp: u64,
    /// Dropped by the fault injection before transmission.
    pub dropped_injected: u64,
    /// Extra copies transmitted by the fault injection.
    pub duplicated: u64,
    /// Completed as sent, but the connection to the destination's engine
    /// could not be established or closed with them queued.
    pub lost: u64,
}

/// Fault injection for tests: each datagram a device transmits is dropped
/// with probability `drop`, else duplicated with probability `duplicate`,
/// decided by a pseudo-random sequence seeded with `seed` (the same seed
/// and the same sequence of datagrams give the same decisions).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UdFaults {
    /// Fraction of datagrams dropped (0.0 ..= 1.0).
    pub drop: f64,
    /// Fraction of datagrams sent twice (0.0 ..= 1.0, `drop + duplicate` ≤ 1).
    pub duplicate: f64,
    /// Seed of the decisions.
    pub seed: u64,
}

/// What the fault injection decided for one datagram.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fate {
    Send,
    Drop,
    Duplicate,
}

/// The fault injection's state: thresholds on a 64-bit random number.
struct Faults {
    drop_below: u64,
    dup_below: u64,
    rng: u64,
}

impl Faults {
    /// xorshift64*.
    fn next(&mut self) -> u64 {
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// The fraction `p` of the 64-bit range.
fn threshold(p: f64) -> u64 {
    if p >= 1.0 {
        u64::MAX
    } else {
        // (Exact enough: a test asks for a few percent.)
        (p * 18_446_744_073_709_551_616.0) as u64
    }
}

/// A device's UD counters and fault injection.
#[derive(Default)]
pub(crate) struct UdShared {
    sent: AtomicU64,
    delivered: AtomicU64,
    dropped_no_recv: AtomicU64,
    dropped_qkey: AtomicU64,
    dropped_no_qp: AtomicU64,
    dropped_injected: AtomicU64,
    duplicated: AtomicU64,
    lost: AtomicU64,
    /// Mirror of `faults.is_some()`: the datagram path looks at it only.
    faults_on: AtomicBool,
    faults: Mutex<Option<Faults>>,
}

/// A counter of [`UdShared`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Count {
    Delivered,
    NoRecv,
    Qkey,
    NoQp,
    Lost,
}

impl UdShared {
    pub fn counters(&self) -> UdCounters {
        let r = |c: &AtomicU64| c.load(Ordering::Relaxed);
        UdCounters {
            sent: r(&self.sent),
            delivered: r(&self.delivered),
            dropped_no_recv: r(&self.dropped_no_recv),
            dropped_qkey: r(&self.dropped_qkey),
            dropped_no_qp: r(&self.dropped_no_qp),
            dropped_injected: r(&self.dropped_injected),
            duplicated: r(&self.duplicated),
            lost: r(&self.lost),
        }
    }

    pub fn count(&self, what: Count) {
        let c = match what {
            Count::Delivered => &self.delivered,
            Count::NoRecv => &self.dropped_no_recv,
            Count::Qkey => &self.dropped_qkey,
            Count::NoQp => &self.dropped_no_qp,
            Count::Lost => &self.lost,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a datagram transmitted with `fate`.
    pub fn count_sent(&self, fate: Fate) {
        match fate {
            Fate::Send => {
                self.sent.fetch_add(1, Ordering::Relaxed);
            }
            Fate::Duplicate => {
                self.sent.fetch_add(1, Ordering::Relaxed);
                self.duplicated.fetch_add(1, Ordering::Relaxed);
            }
            Fate::Drop => {
                self.dropped_injected.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Sets (or with `None` ends) the fault injection.
    pub fn set_faults(&self, faults: Option<UdFaults>) -> Result<(), String> {
        let state = match faults {
            None => None,
            Some(f) => {
                let ok = |p: f64| (0.0..=1.0).contains(&p);
                if !ok(f.drop) || !ok(f.duplicate) || f.drop + f.duplicate > 1.0 {
                    return Err(format!(
                        "drop {} and duplicate {} must be fractions with a sum of at most 1",
                        f.drop, f.duplicate
                    ));
                }
                let drop_below = threshold(f.drop);
                Some(Faults {
                    drop_below,
                    dup_below: drop_below.saturating_add(threshold(f.duplicate)),
                    // (xorshift must not start at 0.)
                    rng: f.seed ^ 0x9e37_79b9_7f4a_7c15,
                })
            }
        };
        let mut g = lock(&self.faults);
        self.faults_on.store(state.is_some(), Ordering::Relaxed);
        *g = state;
        Ok(())
    }

    /// Decides what happens to the next datagram transmitted.
    pub fn fate(&self) -> Fate {
        if !self.faults_on.load(Ordering::Relaxed) {
            return Fate::Send;
        }
        let mut g = lock(&self.faults);
        let Some(f) = g.as_mut() else {
            return Fate::Send;
        };
        let r = f.next();
        if r < f.drop_below {
            Fate::Drop
        } else if r < f.dup_below {
            Fate::Duplicate
        } else {
            Fate::Send
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_follow_the_requested_fractions_and_the_seed() {
        let ud = UdShared::default();
        assert_eq!(ud.fate(), Fate::Send);
        let faults = UdFaults {
            drop: 0.10,
            duplicate: 0.05,
            seed: 42,
        };
        ud.set_faults(Some(faults)).expect("valid");
        let run = |ud: &UdShared| (0..100_000).map(|_| ud.fate()).collect::<Vec<_>>();
        let a = run(&ud);
        let drops = a.iter().filter(|f| **f == Fate::Drop).count();
        let dups = a.iter().filter(|f| **f == Fate::Duplicate).count();
        assert!((9_500..10_500).contains(&drops), "{drops} drops");
        assert!((4_500..5_500).contains(&dups), "{dups} duplicates");
        ud.set_faults(Some(faults)).expect("valid");
        assert_eq!(run(&ud), a, "same seed, same decisions");
        ud.set_faults(None).expect("off");
        assert!(run(&ud).iter().all(|f| *f == Fate::Send));
        for bad in [(-0.1, 0.0), (0.7, 0.4), (f64::NAN, 0.0)] {
            assert!(ud
                .set_faults(Some(UdFaults {
                    drop: bad.0,
                    duplicate: bad.1,
                    seed: 1,
                }))
                .is_err());
        }
        ud.set_faults(Some(UdFaults {
            drop: 1.0,
            duplicate: 0.0,
            seed: 3,
        }))
        .expect("valid");
        assert!(run(&ud).iter().all(|f| *f == Fate::Drop));
    }
}
