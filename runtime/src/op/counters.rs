//! Counters of the runtime's work, kept by the op table and the layers
//! above it (plain `Cell`s: the runtime is single-threaded), read as a
//! [`RuntimeStats`](crate::reactor::RuntimeStats) snapshot.

use std::cell::Cell;

/// The runtime's counters. Each increment is one add on a `Cell`.
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) completions: Cell<u64>,
    pub(crate) ops_failed: Cell<u64>,
    pub(crate) doorbells: Cell<u64>,
    pub(crate) wrs_posted: Cell<u64>,
    pub(crate) parks: Cell<u64>,
    pub(crate) wakeups: Cell<u64>,
}

impl Counters {
    /// Adds one to `c`.
    #[inline(always)]
    pub(crate) fn bump(c: &Cell<u64>) {
        c.set(c.get() + 1);
    }

    /// One provider post call (a doorbell) of a list of `wrs` work requests.
    #[inline(always)]
    pub(crate) fn posted(&self, wrs: usize) {
        Counters::bump(&self.doorbells);
        self.wrs_posted.set(self.wrs_posted.get() + wrs as u64);
    }
}
