//! Test doubles (feature `test-util`): a fake queue pair that records what
//! is posted and produces synthetic completions, so ops and verbs can be
//! unit-tested without any device.
//!
//! The fake follows the verbs rules the runtime relies on: it refuses a post
//! that would overrun its queues (`QueueFull`), a successful completion of a
//! signaled send retires every earlier unsignaled WR, and moving to ERR
//! flushes every outstanding WR (signaled or not) with `WR_FLUSH_ERR`, as
//! does any post made while in ERR.
//!
//! The fake never reads or writes the memory the posted SGEs name (it keeps
//! only wr_ids, flags and opcodes), so submitting to a fake QP lends no
//! memory to anything: the `unsafe` contract of
//! [`QueuePair::submit_send`]/[`QueuePair::submit_recv`] has nothing to
//! protect there.

pub use crate::qp::FakeQp;
use crate::reactor::Runtime;

pub use crate::reactor::yield_now;

/// Turns `rt`'s loop a few times, so completions injected into a
/// [`FakeQp`] are delivered to their ops.
pub fn settle(rt: &Runtime) {
    for _ in 0..3 {
        rt.block_on(yield_now());
    }
}
