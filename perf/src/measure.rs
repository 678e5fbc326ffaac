//! What a measured loop returns, the latency loop's stamps, and the
//! memory polling of write_lat.

use std::sync::atomic::{fence, Ordering};

use verbio::runtime::buf::RemoteAccessRegion;

use crate::args::Test;
use crate::clock::CycleClock;
use crate::error::{msg, Result};
use crate::report::{Figures, Row};
use crate::session::Budget;
use crate::stats::{BwSamples, BwStats, LatStats};

/// The raw figures of one size.
#[derive(Debug)]
pub enum Measured {
    /// A bandwidth loop's completion progress.
    Bw {
        /// `(tick, messages done)` pairs.
        samples: BwSamples,
        /// Tick rate.
        ticks_per_us: f64,
    },
    /// A latency loop's stamps: one at each iteration's start and one at
    /// the end.
    Lat {
        /// The stamps.
        stamps: Vec<u64>,
        /// Tick rate.
        ticks_per_us: f64,
    },
}

impl Measured {
    /// The table row of `size`-byte messages of `test`, run with up to
    /// `in_flight` ops outstanding.
    pub fn row(&self, test: Test, size: usize, in_flight: u64) -> Result<Row> {
        let too_few = || msg(format!("{size} bytes: too few iterations for statistics"));
        Ok(match self {
            Measured::Bw {
                samples,
                ticks_per_us,
            } => Row {
                bytes: size,
                iterations: samples.points.last().map_or(0, |p| p.1),
                figures: Figures::Bw(
                    BwStats::of(size, samples, *ticks_per_us, in_flight).ok_or_else(too_few)?,
                ),
            },
            Measured::Lat {
                stamps,
                ticks_per_us,
            } => Row {
                bytes: size,
                iterations: stamps.len().saturating_sub(1) as u64,
                figures: Figures::Lat(
                    LatStats::of(stamps, *ticks_per_us, test.rtt_factor()).ok_or_else(too_few)?,
                ),
            },
        })
    }
}

/// A latency loop: `while lat.next() { ... iteration lat.i ... }` stamps
/// each iteration's start, and the end.
#[derive(Debug)]
pub struct LatLoop<'a> {
    budget: &'a Budget,
    clock: CycleClock,
    stamps: Vec<u64>,
    started: bool,
    /// The current iteration (after the loop: the number run).
    pub i: u64,
}

impl<'a> LatLoop<'a> {
    /// Starts the clock.
    pub fn start(budget: &'a Budget) -> LatLoop<'a> {
        LatLoop {
            budget,
            clock: CycleClock::start(),
            stamps: Vec::with_capacity(budget.wire_iters() as usize + 1),
            started: false,
            i: 0,
        }
    }

    /// Stamps and says whether another iteration runs.
    #[inline]
    pub fn next(&mut self) -> bool {
        if self.started {
            self.i += 1;
        }
        self.started = true;
        self.stamps.push(self.clock.stamp());
        self.budget.more(self.i)
    }

    /// The stamps taken.
    pub fn finish(self) -> Measured {
        Measured::Lat {
            ticks_per_us: self.clock.ticks_per_us(),
            stamps: self.stamps,
        }
    }
}

/// The value write_lat's iteration `i` writes in its message's last byte:
/// 1..=250, never [`LAT_STOP`] nor the zero the memory starts with.
#[inline]
pub fn lat_value(i: u64) -> u8 {
    (i % 250) as u8 + 1
}

/// The last byte of write_lat's closing message: the client is done.
pub const LAT_STOP: u8 = 0xff;

/// The immediate of send_bw's stop message: the client's messages on this
/// QP are all sent.
pub const STOP_IMM: u32 = 0x5354_4f50;

/// Spins until the byte at `off` of `region` (written by the peer's RDMA
/// WRITE) satisfies `ok`; returns it.
#[inline]
pub fn wait_byte(region: &RemoteAccessRegion<Vec<u8>>, off: usize, ok: impl Fn(u8) -> bool) -> u8 {
    loop {
        let b = read_byte(region, off);
        if ok(b) {
            return b;
        }
        std::hint::spin_loop();
    }
}

/// Reads the byte at `off` of `region` afresh (the device writes it behind
/// the compiler's back: the fence keeps a loop from reusing an earlier
/// read). Outside the region: 0, which no caller waits for.
#[inline]
pub fn read_byte(region: &RemoteAccessRegion<Vec<u8>>, off: usize) -> u8 {
    fence(Ordering::Acquire);
    let mut b = [0u8; 1];
    let _ = region.read_into(off, &mut b);
    b[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lat_values_skip_zero_and_stop() {
        let vals: Vec<u8> = (0..600).map(lat_value).collect();
        assert!(vals.iter().all(|&v| v != 0 && v != LAT_STOP));
        assert!(vals.windows(2).all(|w| w[0] != w[1]));
    }

    #[test]
    fn lat_loop_stamps_each_iteration_and_the_end() {
        let b = Budget::new(Some(5), None);
        let mut l = LatLoop::start(&b);
        let mut seen = Vec::new();
        while l.next() {
            seen.push(l.i);
        }
        assert_eq!(seen, [0, 1, 2, 3, 4]);
        match l.finish() {
            Measured::Lat { stamps, .. } => assert_eq!(stamps.len(), 6),
            Measured::Bw { .. } => panic!("latency loop"),
        }
    }
}
