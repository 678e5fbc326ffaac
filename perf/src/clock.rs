//! Cheap timestamps for the measured loops: the CPU's time-stamp counter on
//! x86-64 (perftest's `get_cycles`), else the monotonic clock in
//! nanoseconds. Reading the system clock costs a syscall per read where the
//! clocksource is emulated (a VM), which would be counted in every sample.

use std::time::Instant;

/// A tick source and its start, to convert ticks to time at the end.
#[derive(Debug)]
pub struct CycleClock {
    start: Instant,
    start_tick: u64,
}

impl CycleClock {
    /// Starts the clock.
    pub fn start() -> CycleClock {
        let start = Instant::now();
        CycleClock {
            start,
            start_tick: Self::tick(start),
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    fn tick(_: Instant) -> u64 {
        // SAFETY: RDTSC exists on every x86-64 CPU and only reads a counter.
        unsafe { std::arch::x86_64::_rdtsc() }
    }

    #[cfg(not(target_arch = "x86_64"))]
    #[inline]
    fn tick(base: Instant) -> u64 {
        base.elapsed().as_nanos() as u64
    }

    /// The current tick.
    #[inline]
    pub fn stamp(&self) -> u64 {
        Self::tick(self.start)
    }

    /// Ticks per microsecond (perftest's `get_cpu_mhz` for the TSC), measured
    /// against the system clock since [`CycleClock::start`] (call at the end).
    pub fn ticks_per_us(&self) -> f64 {
        let us = (self.start.elapsed().as_secs_f64() * 1e6).max(f64::MIN_POSITIVE);
        let ticks = Self::tick(self.start).wrapping_sub(self.start_tick).max(1);
        ticks as f64 / us
    }
}
