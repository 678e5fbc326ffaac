//! [`RuntimeStats`]: a snapshot of the runtime's counters.

use super::Handle;

/// What the runtime has done since it was created: read with
/// [`Handle::stats`] (or [`Runtime::stats`](super::Runtime::stats)).
/// Counting costs one add per event on the runtime's own thread.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RuntimeStats {
    /// Ops given a slot (posted, or deferred to the end of the poll phase).
    pub ops_submitted: u64,
    /// Completions the reactor handled: those of ops (flushes included)
    /// and of reserved wr_ids (receive rings, inline sends, the agent).
    pub completions: u64,
    /// Ops that ended in error: an error completion (flushes included) or
    /// a post the provider refused.
    pub ops_failed: u64,
    /// Provider post calls (one doorbell each), on send and receive queues.
    pub doorbells: u64,
    /// Work requests those calls posted (`wrs_posted / doorbells` is the
    /// mean post-list size).
    pub wrs_posted: u64,
    /// Times the reactor slept in epoll.
    pub parks: u64,
    /// Sleeps that ended with an event (a completion channel, a socket, a
    /// cross-thread wake) rather than a timeout.
    pub wakeups: u64,
    /// Ops in the slab right now (in flight, parked, or completed but not
    /// yet collected).
    pub ops_in_slab: usize,
    /// Completions ignored because their wr_id was stale.
    pub stale_completions: u64,
}

impl Handle {
    /// A snapshot of the runtime's counters.
    pub fn stats(&self) -> RuntimeStats {
        let ops = &self.inner.driver.ops;
        let c = &ops.counters;
        RuntimeStats {
            ops_submitted: ops.submitted(),
            completions: c.completions.get(),
            ops_failed: c.ops_failed.get(),
            doorbells: c.doorbells.get(),
            wrs_posted: c.wrs_posted.get(),
            parks: c.parks.get(),
            wakeups: c.wakeups.get(),
            ops_in_slab: ops.len(),
            stale_completions: ops.stale_count(),
        }
    }
}
