//! How often the busy-poll spin reads the clock.
//!
//! The spin needs the time for two things only: to stop after the
//! busy-poll duration and to fire a timer that came due. A clock read costs
//! about 20 ns on hardware with a TSC clocksource, but about 650 ns in a VM
//! whose clocksource is emulated (HPET under QEMU: measured in the rxe VM),
//! where one read per few dozen spins lands inside many round trips of a
//! latency loop. So the spins between two reads adapt to what a spin costs
//! here: about one read per [`READ_INTERVAL`] (a quarter of the busy-poll
//! time if that is shorter). The runtime's first spin session measures the
//! spin rate (one read more, at its start); later sessions long enough for
//! two reads (every idle period that spins out its busy-poll time is)
//! correct it. A session shorter than the interval, the common case of a
//! latency loop whose completion comes within microseconds, then reads no
//! clock at all.

use std::cell::Cell;
use std::time::{Duration, Instant};

/// The clock is read about this often while spinning: the busy-poll time
/// is overrun, and a due timer fired late, by about that much at worst.
const READ_INTERVAL: Duration = Duration::from_micros(50);
/// Spins between two reads at first (and at least): accurate, even where
/// a spin costs a microsecond.
const MIN_SPINS_PER_READ: u32 = 64;
/// Spins between two reads at most.
const MAX_SPINS_PER_READ: u32 = 1 << 20;

/// The spins between two clock reads, kept across spin sessions.
#[derive(Debug)]
pub(crate) struct SpinPacer {
    spins_per_read: Cell<u32>,
    /// The spin rate was measured once.
    calibrated: Cell<bool>,
    /// The time wanted between two reads.
    interval: Duration,
}

impl SpinPacer {
    /// For spin sessions of `busy_poll` each: reads about every
    /// [`READ_INTERVAL`], or every quarter of `busy_poll` if that is
    /// shorter (at least every microsecond).
    pub(crate) fn new(busy_poll: Duration) -> SpinPacer {
        SpinPacer {
            spins_per_read: Cell::new(MIN_SPINS_PER_READ),
            calibrated: Cell::new(false),
            interval: READ_INTERVAL
                .min(busy_poll / 4)
                .max(Duration::from_micros(1)),
        }
    }

    /// Spins between two clock reads now.
    #[cfg(test)]
    pub(crate) fn spins_per_read(&self) -> u32 {
        self.spins_per_read.get()
    }

    /// A new spin session (one busy-poll wait). Until the spin rate was
    /// measured, it reads the clock at its start too.
    #[inline]
    pub(crate) fn session(&self) -> SpinSession<'_> {
        SpinSession {
            pacer: self,
            spins: 0,
            last_read: (!self.calibrated.get()).then(Instant::now),
        }
    }

    /// `spins` spins took `elapsed`: the first time, sets the spins per
    /// read that take the interval; later, moves them towards it by at most
    /// a factor of 2 per step (one slow interval, say a preemption, must
    /// not collapse it).
    fn observe(&self, spins: u32, elapsed: Duration) {
        let next = if self.calibrated.replace(true) {
            next_spins_per_read(spins, elapsed, self.interval)
        } else {
            spins_per_interval(spins, elapsed, self.interval)
        };
        self.spins_per_read.set(next);
    }
}

/// The spins per read that would have taken `interval`, given that `spins`
/// took `elapsed`; within a factor of 2 of `spins` and within
/// [`MIN_SPINS_PER_READ`]`..=`[`MAX_SPINS_PER_READ`].
fn next_spins_per_read(spins: u32, elapsed: Duration, interval: Duration) -> u32 {
    spins_per_interval(spins, elapsed, interval).clamp(
        (spins / 2).max(MIN_SPINS_PER_READ),
        spins
            .saturating_mul(2)
            .clamp(MIN_SPINS_PER_READ, MAX_SPINS_PER_READ),
    )
}

/// The spins that would take `interval`, given that `spins` took
/// `elapsed`, within [`MIN_SPINS_PER_READ`]`..=`[`MAX_SPINS_PER_READ`].
fn spins_per_interval(spins: u32, elapsed: Duration, interval: Duration) -> u32 {
    let want = u128::from(spins.max(1)) * interval.as_nanos() / elapsed.as_nanos().max(1);
    want.clamp(
        u128::from(MIN_SPINS_PER_READ),
        u128::from(MAX_SPINS_PER_READ),
    ) as u32
}

/// One busy-poll wait: counts its spins and reads the clock every so many
/// of them (the pacer's current spins per read).
pub(crate) struct SpinSession<'a> {
    pacer: &'a SpinPacer,
    spins: u32,
    last_read: Option<Instant>,
}

impl SpinSession<'_> {
    /// Counts one spin; the time if this spin read the clock.
    #[inline]
    pub(crate) fn spin(&mut self) -> Option<Instant> {
        self.spins += 1;
        let per_read = self.pacer.spins_per_read.get();
        if self.spins < per_read {
            return None;
        }
        self.spins = 0;
        let now = Instant::now();
        if let Some(prev) = self.last_read.replace(now) {
            self.pacer
                .observe(per_read, now.saturating_duration_since(prev));
        }
        Some(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const I: Duration = READ_INTERVAL;

    #[test]
    fn fast_spins_read_the_clock_less_often_and_slow_ones_more() {
        // 64 spins in 5 µs: 640 would take the 50 µs interval, but one step
        // at most doubles.
        assert_eq!(next_spins_per_read(64, Duration::from_micros(5), I), 128);
        // Within a factor of 2: moved exactly.
        assert_eq!(
            next_spins_per_read(1000, Duration::from_micros(40), I),
            1250
        );
        assert_eq!(next_spins_per_read(1000, Duration::from_micros(80), I), 625);
        // A preempted interval (10 ms) halves it, no more.
        assert_eq!(
            next_spins_per_read(4096, Duration::from_millis(10), I),
            2048
        );
    }

    #[test]
    fn the_spins_per_read_stay_within_their_bounds() {
        assert_eq!(
            next_spins_per_read(MIN_SPINS_PER_READ, Duration::from_secs(1), I),
            MIN_SPINS_PER_READ
        );
        assert_eq!(
            next_spins_per_read(MAX_SPINS_PER_READ, Duration::ZERO, I),
            MAX_SPINS_PER_READ
        );
        assert_eq!(
            next_spins_per_read(0, Duration::ZERO, I),
            MIN_SPINS_PER_READ
        );
    }

    #[test]
    fn a_short_busy_poll_time_reads_the_clock_every_quarter_of_it() {
        let pacer = SpinPacer::new(Duration::from_micros(8));
        pacer.calibrated.set(true);
        assert_eq!(pacer.interval, Duration::from_micros(2));
        // 1000 spins in 4 µs: 500 would take 2 µs.
        pacer.observe(1000, Duration::from_micros(4));
        assert_eq!(pacer.spins_per_read(), 500);
        assert_eq!(
            SpinPacer::new(Duration::ZERO).interval,
            Duration::from_micros(1)
        );
    }

    #[test]
    fn the_first_session_measures_the_spin_rate_from_its_start() {
        let pacer = SpinPacer::new(Duration::from_millis(50));
        let mut s = pacer.session();
        assert!(s.last_read.is_some(), "uncalibrated: read at the start");
        assert!((1..MIN_SPINS_PER_READ).all(|_| s.spin().is_none()));
        assert!(s.spin().is_some());
        assert!(pacer.calibrated.get());
        // Calibrated: later sessions read no clock at their start.
        assert!(pacer.session().last_read.is_none());
    }

    #[test]
    fn the_first_measurement_sets_the_spins_per_read_outright() {
        let pacer = SpinPacer::new(Duration::from_millis(50));
        // 64 spins in 5 µs: straight to the 640 that take 50 µs.
        pacer.observe(64, Duration::from_micros(5));
        assert_eq!(pacer.spins_per_read(), 640);
        // Later ones move it by at most a factor of 2.
        pacer.observe(640, Duration::from_micros(5));
        assert_eq!(pacer.spins_per_read(), 1280);
    }

    #[test]
    fn a_calibrated_session_reads_the_clock_every_spins_per_read_spins() {
        let pacer = SpinPacer::new(Duration::from_millis(50));
        pacer.calibrated.set(true);
        let mut s = pacer.session();
        let reads: Vec<u32> = (1..=2 * MIN_SPINS_PER_READ)
            .filter(|_| s.spin().is_some())
            .collect();
        assert_eq!(reads, [MIN_SPINS_PER_READ, 2 * MIN_SPINS_PER_READ]);
        // What the second read measured moves the spacing; by how much
        // depends on this thread's scheduling (a preemption between the
        // reads looks like slow spins), so the rule itself is checked with
        // given durations in the tests above.
    }

    #[test]
    fn a_short_session_after_a_long_fast_one_reads_no_clock() {
        let pacer = SpinPacer::new(Duration::from_millis(50));
        pacer.calibrated.set(true);
        // A long session of cheap spins: the reads space out.
        let mut long = pacer.session();
        let start = Instant::now();
        while start.elapsed() < Duration::from_millis(20) {
            long.spin();
        }
        let per_read = pacer.spins_per_read();
        assert!(
            per_read > 2 * MIN_SPINS_PER_READ,
            "a spin here costs nanoseconds, so reads should be far apart: {per_read}"
        );
        // A latency loop's wait of a few dozen spins then reads nothing.
        let mut short = pacer.session();
        assert!((0..4 * MIN_SPINS_PER_READ).all(|_| short.spin().is_none()));
    }
}
