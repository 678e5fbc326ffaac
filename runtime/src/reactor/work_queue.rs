//! [`WorkQueue`]: what the reactor knows of the objects above it that own
//! work requests on the device (queue pairs, receive rings). The reactor owns
//! this trait; the QP layer implements it, so the reactor never names a QP.

use crate::op::OpTable;
use crate::provider::Completion;

/// A queue pair or a receive ring as the reactor sees it: a target for
/// completions whose reserved wr_id names it, a hook at the end of each poll
/// phase, and what the shutdown drain needs.
pub(crate) trait WorkQueue {
    /// A completion with a reserved wr_id (`op::wr_id`) that names this
    /// queue by its registry key.
    fn complete_reserved(&self, c: &Completion);

    /// The poll phase that this queue asked to hear the end of
    /// ([`Driver::note_phase_end`](super::Driver::note_phase_end)) ended.
    fn phase_ended(&self, ops: &OpTable);

    /// Some submission waits for CQ entries: give back CQ entries held
    /// without need (e.g. by trailing unsignaled sends).
    fn release_hoarded(&self) {}

    /// Runtime shutdown, before anything moves to ERR: post what this
    /// queue still holds back (deferred WRs; the WR that retires trailing
    /// unsignaled inline sends) and say whether send work requests of it
    /// are still on their way, so that the shutdown can let them arrive.
    /// False for a queue that is closed or failed (its sends only flush).
    fn sends_in_flight(&self, _ops: &OpTable) -> bool {
        false
    }

    /// Runtime shutdown: refuse new work and move to ERR, so that every
    /// outstanding work request completes or flushes.
    fn shut_down(&self, ops: &OpTable);

    /// Work requests outstanding whose memory the device may still touch.
    /// At shutdown, a queue with any is leaked rather than dropped.
    fn lent(&self) -> u32;

    /// The owner is gone and nothing is outstanding: the reactor may forget
    /// this queue (checked after completions once a queue was noted as
    /// draining with [`Driver::note_draining`](super::Driver::note_draining)).
    fn finished(&self) -> bool;
}
