//! Test doubles (feature `test-util`): a fake queue pair that records what
//! is posted and produces synthetic completions, so ops and verbs can be
//! unit-tested without any device. The fake is a test-only provider
//! (`provider/fake.rs`): its QP and CQ are provider objects the runtime
//! posts to and polls like any other.
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

use std::rc::Rc;

use crate::op::QueueEntries;
pub use crate::provider::fake::FakeQp;
use crate::provider::{fake, CompChannel, Cq, Qp, QpCaps, QpType, DEFAULT_QKEY};
use crate::qp::{QueuePair, UdState};
use crate::reactor::{CqClaim, CqRegistration, Handle, Runtime};

pub use crate::reactor::yield_now;

impl FakeQp {
    /// A [`QueuePair`] over a new fake QP number `qp_num` with queue sizes
    /// `caps`, on its own fake CQ of `cq_capacity` entries registered with
    /// the current runtime.
    ///
    /// # Panics
    ///
    /// If no runtime exists on this thread, or the fake CQ's channel (an
    /// eventfd) cannot be created.
    pub fn queue_pair(qp_num: u32, caps: QpCaps, cq_capacity: u32) -> (QueuePair, Rc<FakeQp>) {
        Self::typed_queue_pair(qp_num, QpType::Rc, caps, cq_capacity)
    }

    /// [`queue_pair`](Self::queue_pair) as a UD queue pair: its receive
    /// rings leave room for the GRH and its sends need a peer. It has no
    /// address handles (no protection domain): `ud_peer` fails on it.
    pub fn ud_queue_pair(qp_num: u32, caps: QpCaps, cq_capacity: u32) -> (QueuePair, Rc<FakeQp>) {
        Self::typed_queue_pair(qp_num, QpType::Ud, caps, cq_capacity)
    }

    fn typed_queue_pair(
        qp_num: u32,
        qp_type: QpType,
        caps: QpCaps,
        cq_capacity: u32,
    ) -> (QueuePair, Rc<FakeQp>) {
        let handle = Handle::current();
        let (qp, cq, channel, fake) =
            fake::create(qp_num, qp_type, caps, cq_capacity).expect("creating a fake CQ's eventfd");
        let registration =
            CqRegistration::new(handle.clone(), Cq::fake(cq), CompChannel::fake(channel))
                .expect("registering a fake CQ with the runtime");
        let entries = Rc::new(QueueEntries::new(cq_capacity));
        let qp = QueuePair::from_provider(
            handle,
            Qp::fake(qp),
            qp_num,
            caps,
            entries.clone(),
            entries,
            Some(CqClaim::new(Rc::new(registration), 0)),
            (qp_type == QpType::Ud).then(|| UdState::new(None, DEFAULT_QKEY, 0, 4096)),
        );
        (qp, fake)
    }
}

/// Turns `rt`'s loop a few times, so completions injected into a
/// [`FakeQp`] are delivered to their ops.
pub fn settle(rt: &Runtime) {
    for _ in 0..3 {
        rt.block_on(yield_now());
    }
}
