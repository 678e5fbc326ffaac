//! [`SharedRecvQueue`]: a shared receive queue driven by the runtime, and
//! the receive queue a [`RecvRing`] posts to ([`RingTarget`]): a QP's own,
//! or an SRQ feeding many QPs.
//!
//! A ring on an SRQ ([`RecvRing::on_srq`]) is the same ring: the same
//! slots, guards, batching and entries; only its post target differs. Its
//! messages name the QP they came in on ([`RingMsg::qp_num`]). Its entries
//! are the SRQ's WR slots and the device's CQ entries (every QP on the SRQ
//! completes on the device's one CQ). With a limit set
//! ([`RecvRingConfig::srq_limit`]) the device raises the SRQ-limit event
//! when fewer buffers than that are posted; the ring then reposts every
//! released buffer waiting for its batch and re-arms the limit, so the SRQ
//! is refilled before it runs dry even while the application reads
//! nothing.
//!
//! An SRQ's buffers are not flushed when its QPs close (they belong to the
//! SRQ): a dropped ring keeps its memory while buffers are posted and a
//! QP on the SRQ or a [`SharedRecvQueue`] handle lives (a message may still
//! take one). Once neither does, nothing can reach the SRQ any more: the
//! ring's memory is freed at once, after its registration (which ends the
//! device's access); at runtime shutdown likewise.

use std::cell::{Cell, RefCell};
use std::rc::{Rc, Weak};

use super::recv_ring::{RecvRing, RecvRingConfig, RecvRingError, RingCore};
use super::{QpCore, QueuePair};
use crate::op::{Counters, QueueEntries};
use crate::provider::{Pd, PostError, RecvWr, Srq, SrqAttr};
use crate::reactor::Handle;

/// The part of a [`SharedRecvQueue`] its rings keep.
pub(crate) struct SrqCore {
    pub(crate) srq: Srq,
    pub(crate) handle: u32,
    /// One entry per WR slot of the SRQ.
    pub(crate) rq: QueueEntries,
    /// The device's CQ entries (shared with every QP of the device).
    pub(crate) recv_cq: Rc<QueueEntries>,
    counters: Rc<Counters>,
    /// Entries kept by rings between a buffer's completion and its repost.
    pub(crate) ring_kept: Cell<u32>,
    /// Never set: an SRQ is not closed (only its QPs are).
    pub(crate) closed: Cell<bool>,
    /// The device's async-event watch (for the limit event), if it has one.
    pub(crate) async_key: Option<usize>,
    /// The SRQ's claim on its CQ (every receive it holds may complete there).
    _cq: crate::reactor::CqClaim,
    pub(crate) runtime: Handle,
    /// [`SharedRecvQueue`] handles alive: the application's, its rings'
    /// and those of the QPs on the SRQ. None left: no message can reach
    /// the SRQ any more.
    users: Cell<usize>,
    /// Rings dropped with buffers still posted, by reactor key: freed once
    /// no handle is left.
    orphans: RefCell<Vec<(usize, Weak<RingCore>)>>,
}

impl SrqCore {
    /// A ring dropped with buffers posted (registered under `key`): freed
    /// once no [`SharedRecvQueue`] handle is left.
    pub(crate) fn orphan(&self, key: usize, ring: Weak<RingCore>) {
        self.orphans.borrow_mut().push((key, ring));
    }
}

/// A shared receive queue bound to the runtime: made by
/// [`Device::create_srq`](crate::Device::create_srq), feeding the QPs of
/// [`Device::create_qp_on_srq`](crate::Device::create_qp_on_srq);
/// receive buffers are posted to it by a [`RecvRing::on_srq`]. Cheap to
/// clone. Its rings and the QPs on it keep a handle each.
pub struct SharedRecvQueue {
    pub(crate) core: Rc<SrqCore>,
}

impl Clone for SharedRecvQueue {
    fn clone(&self) -> Self {
        self.core.users.set(self.core.users.get() + 1);
        SharedRecvQueue {
            core: self.core.clone(),
        }
    }
}

impl Drop for SharedRecvQueue {
    /// The last handle: no QP is on the SRQ and none can be created, so no
    /// message can take a buffer of a ring dropped with buffers posted any
    /// more. Such rings are unregistered: each frees its memory after its
    /// registration (which ends the device's access), once no guard of it
    /// lives.
    fn drop(&mut self) {
        let users = self.core.users.get() - 1;
        self.core.users.set(users);
        if users > 0 {
            return;
        }
        let orphans = std::mem::take(&mut *self.core.orphans.borrow_mut());
        for (key, ring) in orphans {
            if let Some(ring) = ring.upgrade() {
                ring.unregister(key);
            }
        }
    }
}

impl std::fmt::Debug for SharedRecvQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedRecvQueue")
            .field("handle", &self.core.handle)
            .field("max_wr", &self.core.rq.capacity())
            .field("posted", &self.core.rq.outstanding())
            .finish()
    }
}

impl SharedRecvQueue {
    pub(crate) fn new(
        runtime: Handle,
        srq: Srq,
        recv_cq: Rc<QueueEntries>,
        cq: crate::reactor::CqClaim,
        async_key: Option<usize>,
    ) -> Result<SharedRecvQueue, crate::provider::ProviderError> {
        let SrqAttr { max_wr, .. } = srq.attr()?;
        Ok(SharedRecvQueue {
            core: Rc::new(SrqCore {
                handle: srq.handle(),
                srq,
                rq: QueueEntries::new(max_wr),
                recv_cq,
                counters: runtime.driver().ops.counters.clone(),
                ring_kept: Cell::new(0),
                closed: Cell::new(false),
                async_key,
                _cq: cq,
                runtime,
                users: Cell::new(1),
                orphans: RefCell::new(Vec::new()),
            }),
        })
    }

    /// The provider SRQ.
    pub fn provider(&self) -> &Srq {
        &self.core.srq
    }

    /// The handle its async events name.
    pub fn handle(&self) -> u32 {
        self.core.handle
    }

    /// WR slots (`max_wr` as the device granted it).
    pub fn capacity(&self) -> u32 {
        self.core.rq.capacity()
    }

    /// Receive WRs posted and not completed yet.
    pub fn posted(&self) -> u32 {
        self.core.rq.outstanding()
    }
}

impl QueuePair {
    /// A QP on `srq` keeps a handle of it until the QP is destroyed (see
    /// the module docs).
    pub(crate) fn hold_srq(&self, srq: &SharedRecvQueue) {
        // (Set once, when the QP is made: the cell is empty.)
        let _ = self.inner.core.srq.set(srq.clone());
    }
}

/// The receive queue a ring posts to.
pub(crate) enum RingTarget {
    /// A QP's own receive queue.
    Qp(Rc<QpCore>),
    /// A shared receive queue.
    Srq(Rc<SrqCore>),
}

impl RingTarget {
    /// The QP number, or the SRQ's handle (in errors and logs).
    #[inline]
    pub(crate) fn id(&self) -> u32 {
        match self {
            RingTarget::Qp(q) => q.qp_num,
            RingTarget::Srq(s) => s.handle,
        }
    }

    /// Whether a completion on QP `qp_num` can be one of this target's.
    #[inline]
    pub(crate) fn accepts(&self, qp_num: u32) -> bool {
        match self {
            RingTarget::Qp(q) => q.qp_num == qp_num,
            RingTarget::Srq(_) => true,
        }
    }

    #[inline]
    pub(crate) fn rq(&self) -> &QueueEntries {
        match self {
            RingTarget::Qp(q) => &q.entries.rq,
            RingTarget::Srq(s) => &s.rq,
        }
    }

    #[inline]
    pub(crate) fn recv_cq(&self) -> &QueueEntries {
        match self {
            RingTarget::Qp(q) => &q.entries.recv_cq,
            RingTarget::Srq(s) => &s.recv_cq,
        }
    }

    #[inline]
    pub(crate) fn closed(&self) -> bool {
        match self {
            RingTarget::Qp(q) => q.closed.get(),
            RingTarget::Srq(s) => s.closed.get(),
        }
    }

    #[inline]
    pub(crate) fn ring_kept(&self) -> &Cell<u32> {
        match self {
            RingTarget::Qp(q) => &q.ring_kept,
            RingTarget::Srq(s) => &s.ring_kept,
        }
    }

    pub(crate) fn is_srq(&self) -> bool {
        matches!(self, RingTarget::Srq(_))
    }

    /// Posts `wrs` to the receive queue: one doorbell.
    ///
    /// # Safety
    ///
    /// The contract of [`Qp::post_recv`](crate::provider::Qp::post_recv)
    /// (the same for [`Srq::post_recv`]).
    #[inline(always)]
    pub(crate) unsafe fn post_recv(&self, wrs: &[RecvWr]) -> Result<(), PostError> {
        match self {
            // SAFETY: forwarded contract of this function.
            RingTarget::Qp(q) => unsafe { q.post_recv(wrs) },
            RingTarget::Srq(s) => {
                s.counters.posted(wrs.len());
                // SAFETY: forwarded contract of this function.
                unsafe { s.srq.post_recv(wrs) }
            }
        }
    }
}

impl RecvRing {
    /// A ring of `config.depth` buffers posted to the shared receive queue
    /// `srq`, registered with `pd` (the device's PD, the one of the QPs on
    /// the SRQ). Its messages come in on any QP of the SRQ and say which
    /// ([`RingMsg::qp_num`](super::RingMsg::qp_num)). Takes one SRQ slot
    /// and one device CQ entry per buffer; fails if they are not all
    /// available at once.
    pub fn on_srq(
        srq: &SharedRecvQueue,
        pd: &Pd,
        config: RecvRingConfig,
    ) -> Result<RecvRing, RecvRingError> {
        let core = &srq.core;
        let ring = RecvRing::create_on(
            RingTarget::Srq(core.clone()),
            core.runtime.clone(),
            false,
            Some(pd),
            config,
            RingOwner::Srq(srq.clone()),
        )?;
        if let Some(limit) = config.limit() {
            if let Some(key) = core.async_key {
                let weak: Weak<RingCore> = Rc::downgrade(&ring.core);
                core.runtime.driver().watch_srq_limit(
                    key,
                    core.handle,
                    Box::new(move || match weak.upgrade() {
                        Some(ring) => {
                            ring.limit_reached();
                            true
                        }
                        None => false,
                    }),
                );
            }
            if let Err(e) = core.srq.modify_limit(limit) {
                return Err(RecvRingError::Config {
                    qp_num: core.handle,
                    what: format!("arming the SRQ limit at {limit}: {e}"),
                });
            }
        }
        Ok(ring)
    }

    /// The shared receive queue the ring posts to, if it is on one.
    pub fn shared_recv_queue(&self) -> Option<&SharedRecvQueue> {
        match &self.owner {
            RingOwner::Srq(s) => Some(s),
            RingOwner::Qp(_) => None,
        }
    }

    /// How often the SRQ-limit event refilled the ring (0 on a QP's ring).
    pub fn limit_events(&self) -> u64 {
        self.core.limit_events()
    }
}

/// What a [`RecvRing`] keeps alive: its QP or its SRQ.
pub(crate) enum RingOwner {
    Qp(QueuePair),
    Srq(SharedRecvQueue),
}
