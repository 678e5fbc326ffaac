//! Shared receive queues: one queue of receive WRs that the RC (and UD) QPs
//! created on it take their receives from, as rxe does.
//!
//! A message arriving on such a QP takes the oldest WR of the SRQ; with
//! none posted the QP answers RNR, as a plain QP with an empty receive
//! queue. The SRQ's limit, once armed (at creation or by
//! [`Srq::modify_limit`]), raises [`AsyncEventKind::SrqLimitReached`] the
//! first time a message leaves fewer WRs posted than the limit, and is
//! disarmed by doing so (rxe's `get_srq_wqe`). A QP on an SRQ refuses
//! `post_recv`; when it goes to ERR the SRQ's WRs stay posted (they belong
//! to the SRQ, not to the QP), and only the message it was receiving is
//! flushed. Destroying the SRQ (its last handle and every QP on it gone)
//! drops its WRs without completions.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use super::context::{Pd, MAX_QP_WR, MAX_SGE};
use super::events::EventQueue;
use super::lock;
use super::qp::{QpShared, RecvWqe};
use crate::provider::{
    AsyncElement, AsyncEvent, AsyncEventKind, PostError, ProviderError, RecvWr, Result, SrqAttr,
};

/// Handles of the SRQs of all soft devices (unique per process, which is
/// more than the per-context uniqueness the contract asks).
static NEXT_HANDLE: AtomicU32 = AtomicU32::new(1);

struct SrqInner {
    /// Posted receive WRs not taken by a message yet, oldest first.
    rq: VecDeque<RecvWqe>,
    /// Armed limit (0 = disarmed).
    limit: u32,
}

/// SRQ state shared by its handles, its QPs and the engine.
pub(crate) struct SrqShared {
    handle: u32,
    max_wr: u32,
    max_sge: u32,
    inner: Mutex<SrqInner>,
    async_events: Arc<EventQueue<AsyncEvent>>,
}

impl SrqShared {
    /// Takes the oldest posted WR for an incoming message; raises the limit
    /// event (and disarms it) if that leaves fewer WRs than the limit.
    pub(crate) fn take(&self) -> Option<RecvWqe> {
        let mut inner = lock(&self.inner);
        let wqe = inner.rq.pop_front()?;
        let fire = inner.limit != 0 && (inner.rq.len() as u32) < inner.limit;
        if fire {
            inner.limit = 0;
        }
        drop(inner);
        if fire {
            self.async_events.push(AsyncEvent {
                kind: AsyncEventKind::SrqLimitReached,
                element: AsyncElement::Srq(self.handle),
            });
        }
        Some(wqe)
    }

    /// True if no WR is posted.
    pub(crate) fn is_empty(&self) -> bool {
        lock(&self.inner).rq.is_empty()
    }
}

impl QpShared {
    /// Takes the receive WR for an incoming message: from the QP's SRQ if
    /// it has one, else from its own receive queue.
    pub(crate) fn take_recv(&self) -> Option<RecvWqe> {
        match &self.srq {
            Some(srq) => srq.take(),
            None => lock(&self.inner).rq.pop_front(),
        }
    }

    /// True if a message arriving now would find no receive WR.
    pub(crate) fn no_recv(&self) -> bool {
        match &self.srq {
            Some(srq) => srq.is_empty(),
            None => lock(&self.inner).rq.is_empty(),
        }
    }
}

struct SrqHandle {
    shared: Arc<SrqShared>,
    pd: Pd,
}

/// A shared receive queue of the soft device.
#[derive(Clone)]
pub struct Srq(Arc<SrqHandle>);

impl std::fmt::Debug for Srq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("soft::Srq")
            .field("handle", &self.0.shared.handle)
            .field("max_wr", &self.0.shared.max_wr)
            .finish()
    }
}

fn invalid(call: &'static str, what: String) -> ProviderError {
    ProviderError::InvalidArgument { call, what }
}

impl Srq {
    /// Creates an SRQ in `pd` (`ibv_create_srq`): `attr.max_wr` WRs of up
    /// to `attr.max_sge` SGEs, the limit armed if `attr.srq_limit` is
    /// nonzero (rxe's checks: 1..=16384 WRs, at most 16 SGEs, the limit at
    /// most `max_wr`).
    pub(crate) fn create(
        pd: &Pd,
        async_events: Arc<EventQueue<AsyncEvent>>,
        attr: &SrqAttr,
    ) -> Result<Srq> {
        let call = "create_srq";
        if attr.max_wr == 0 || attr.max_wr > MAX_QP_WR {
            return Err(invalid(
                call,
                format!("max_wr {} not in 1..={MAX_QP_WR}", attr.max_wr),
            ));
        }
        if attr.max_sge > MAX_SGE {
            return Err(invalid(
                call,
                format!("max_sge {} above {MAX_SGE}", attr.max_sge),
            ));
        }
        if attr.srq_limit > attr.max_wr {
            return Err(invalid(
                call,
                format!("srq_limit {} above max_wr {}", attr.srq_limit, attr.max_wr),
            ));
        }
        let shared = Arc::new(SrqShared {
            handle: NEXT_HANDLE.fetch_add(1, Ordering::Relaxed),
            max_wr: attr.max_wr,
            max_sge: attr.max_sge.max(1),
            inner: Mutex::new(SrqInner {
                rq: VecDeque::with_capacity(attr.max_wr as usize),
                limit: attr.srq_limit,
            }),
            async_events,
        });
        Ok(Srq(Arc::new(SrqHandle {
            shared,
            pd: pd.clone(),
        })))
    }

    pub(crate) fn shared(&self) -> &Arc<SrqShared> {
        &self.0.shared
    }

    pub(crate) fn pd(&self) -> &Pd {
        &self.0.pd
    }

    /// The handle its async events name.
    pub fn handle(&self) -> u32 {
        self.0.shared.handle
    }

    /// Sizes and the limit now armed (`ibv_query_srq`).
    pub fn attr(&self) -> Result<SrqAttr> {
        let sh = &self.0.shared;
        Ok(SrqAttr {
            max_wr: sh.max_wr,
            max_sge: sh.max_sge,
            srq_limit: lock(&sh.inner).limit,
        })
    }

    /// Arms the limit (`ibv_modify_srq` with `IBV_SRQ_LIMIT`; 0 disarms).
    pub fn modify_limit(&self, limit: u32) -> Result<()> {
        let sh = &self.0.shared;
        if limit > sh.max_wr {
            return Err(invalid(
                "modify_srq",
                format!("srq_limit {limit} above max_wr {}", sh.max_wr),
            ));
        }
        lock(&sh.inner).limit = limit;
        Ok(())
    }

    /// Queues receive WRs for the SRQ's QPs.
    ///
    /// # Safety
    ///
    /// As for [`crate::provider::Srq::post_recv`]: every SGE the engine may
    /// access (its lkey names a live registration containing it) stays
    /// allocated and free of Rust references until the WR's completion has
    /// been polled or its registration is gone.
    pub unsafe fn post_recv(&self, wrs: &[RecvWr]) -> std::result::Result<(), PostError> {
        let sh = &self.0.shared;
        let mut inner = lock(&sh.inner);
        for (i, wr) in wrs.iter().enumerate() {
            let error = if inner.rq.len() as u32 >= sh.max_wr {
                ProviderError::QueueFull {
                    qp_num: 0,
                    queue: "shared receive",
                    depth: sh.max_wr,
                }
            } else if wr.sg_list.len() > sh.max_sge as usize {
                invalid(
                    "post_srq_recv",
                    format!("{} SGEs > max_sge {}", wr.sg_list.len(), sh.max_sge),
                )
            } else {
                inner.rq.push_back(RecvWqe {
                    wr_id: wr.wr_id,
                    sges: wr.sg_list.clone(),
                    len: wr.sg_list.iter().map(|s| u64::from(s.length)).sum(),
                });
                continue;
            };
            return Err(PostError { posted: i, error });
        }
        Ok(())
    }
}
