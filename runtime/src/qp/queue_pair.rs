//! [`QueuePair`]: the public handle of a runtime-level queue pair: its
//! state transitions, queries, closing, and doorbell batching. Submission
//! lives in `submit.rs`.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::rc::Rc;
use std::task::Poll;

use super::core::batching_by_default;
use super::submit::Waiting;
use super::ud::UdState;
use super::{deferred, QpCore, DEFAULT_INLINE_SIGNAL_INTERVAL};
use crate::op::{wr_id, QpEntries, QueueEntries};
use crate::provider::{
    Endpoint, InitAttr, ProviderError, Qp, QpCaps, QpState, QpType, RtrAttr, RtsAttr, SendOp,
};
use crate::reactor::{CqClaim, Handle};

pub(super) struct QpInner {
    pub(super) handle: Handle,
    pub(super) core: Rc<QpCore>,
    pub(super) reg_key: usize,
    pub(super) caps: QpCaps,
    /// Longest chain a send op may have: the send queue, the send CQ and the
    /// wr_id index space must all hold it.
    pub(super) max_send_chain: usize,
    /// 1 if a receive fits the receive queue and CQ, else 0.
    pub(super) max_recv_chain: usize,
    /// Boxes for the WRs of submissions that wait for entries, recycled so
    /// that backpressure does not allocate per op (and `Submit` stays small).
    /// (Boxes, not a `Vec<Wrs>`: a waiting `Submit` owns its box.)
    #[allow(clippy::vec_box)]
    pub(super) spare_wrs: RefCell<Vec<Box<Waiting>>>,
    /// A UD queue pair's address handles and Q_Key (`None` on RC).
    pub(super) ud: Option<UdState>,
}

/// Most recycled WR boxes a QP keeps.
pub(super) const SPARE_WRS: usize = 64;

impl Drop for QpInner {
    fn drop(&mut self) {
        self.core.dropped.set(true);
        if self.core.outstanding() > 0 {
            if !self.core.closed.get() {
                if let Err(e) = self.core.shut(self.handle.ops()) {
                    tracing::warn!(qp = self.core.qp_num, error = %crate::report::ErrorChain(&e), "moving a dropped QP to ERR failed");
                }
            }
            // The reactor keeps the core until its flushes have drained.
            self.handle.driver().note_draining();
        } else {
            self.handle
                .driver()
                .unregister_qp(self.reg_key, &*self.core);
        }
    }
}

/// A queue pair driven by the runtime, RC or UD (`ud.rs`). Cheap to clone
/// (`Rc`); `!Send`.
///
/// Submissions wait for send-queue (or receive-queue) entries and CQ entries
/// in FIFO order, so the device's queues are never overrun. Dropping the last
/// handle with WRs outstanding moves the QP to ERR; the runtime keeps it alive
/// until the flushes arrive and the parked buffers are freed.
///
/// The verbs on it (`send`, `recv`, `write`, `read`, atomics, batches)
/// are the `Verbs` trait of `verbio::ops::verbs`; an RC pair is connected
/// by `verbio::ops::connect` or the connection manager ([`crate::cm`]).
///
/// # Example
///
/// Two UD queue pairs on a software device: one sends a datagram (copied
/// INLINE) to the other, whose [`RecvRing`](crate::RecvRing) receives it.
///
/// ```
/// # mod verbio { pub mod runtime { pub use verbio_runtime::*; } pub use verbio_runtime::provider; }
/// use verbio::provider::{Context, QpCaps, QpState, SoftConfig, UdAttr};
/// use verbio::runtime::{Device, Runtime};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let rt = Runtime::new()?;
/// let dev = Device::open(Context::open_soft(SoftConfig::default())?)?;
/// rt.block_on(async {
///     let a = dev.create_ud_qp(QpCaps::default(), &UdAttr::default())?;
///     let b = dev.create_ud_qp(QpCaps::default(), &UdAttr::default())?;
///     assert_eq!(a.state()?, QpState::Rts); // a UD QP is ready at once
///     let mut ring = b.recv_ring(dev.pd(), 16, 1024)?; // receives posted
///
///     // Where `b` is, as a peer would learn it (its GID, QPN and Q_Key).
///     let gid_index = dev.context().default_gid_index(1)?;
///     let to_b = a.ud_peer(&b.ud_endpoint(gid_index)?)?;
///     a.post_send_inline_to(&to_b, b"hello", None).await?;
///
///     let msg = ring.next().await.expect("the ring is open")?;
///     assert_eq!(&msg[..], b"hello");
///     assert_eq!(msg.source().map(|s| s.qpn), Some(a.qp_num()));
///     Ok::<_, Box<dyn std::error::Error>>(())
/// })?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct QueuePair {
    pub(super) inner: Rc<QpInner>,
}

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair")
            .field("qp_num", &self.inner.core.qp_num)
            .field(
                "outstanding_sends",
                &self.inner.core.entries.sq.outstanding(),
            )
            .field("outstanding_recvs", &self.outstanding_recvs())
            .field("closed", &self.inner.core.closed.get())
            .finish()
    }
}

impl QueuePair {
    /// A runtime queue pair over the provider QP `qp` (RC, or UD with its
    /// `ud` state).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn from_provider(
        handle: Handle,
        qp: Qp,
        qp_num: u32,
        caps: QpCaps,
        send_cq: Rc<QueueEntries>,
        recv_cq: Rc<QueueEntries>,
        cq: Option<CqClaim>,
        ud: Option<UdState>,
    ) -> QueuePair {
        let batch_posts = batching_by_default(&qp);
        let retire_op = match qp.qp_type() {
            QpType::Ud => None,
            _ => Some(SendOp::Write {
                remote_addr: 0,
                rkey: 0,
            }),
        };
        let core = Rc::new(QpCore {
            qp,
            qp_num,
            counters: handle.driver().ops.counters.clone(),
            entries: Rc::new(QpEntries {
                sq: QueueEntries::new(caps.max_send_wr),
                rq: QueueEntries::new(caps.max_recv_wr),
                send_cq,
                recv_cq,
            }),
            closed: Cell::new(false),
            dropped: Cell::new(false),
            _cq: cq,
            reg_key: Cell::new(0),
            unsig: Cell::new(0),
            inline_entries: Cell::new(0),
            signal_every: Cell::new(
                DEFAULT_INLINE_SIGNAL_INTERVAL.min((caps.max_send_wr / 2).max(1)),
            ),
            fault: Cell::new(None),
            sends_ok: Cell::new(false),
            ring_kept: Cell::new(0),
            deferred: RefCell::new(deferred::Deferred::default()),
            batch_posts: Cell::new(batch_posts),
            listed_in_phase: Cell::new(false),
            retire_op: Cell::new(retire_op),
            burst_wrs: Cell::new(Vec::new()),
            srq: std::cell::OnceCell::new(),
        });
        handle.driver().register_qp(|key| {
            core.reg_key.set(key);
            core.clone()
        });
        let reg_key = core.reg_key.get();
        let max_send_chain =
            (caps.max_send_wr.min(core.entries.send_cq.capacity()) as usize).min(wr_id::MAX_CHAIN);
        let max_recv_chain =
            (caps.max_recv_wr.min(core.entries.recv_cq.capacity()) as usize).min(1);
        core.sends_ok
            .set(max_send_chain > 0 && caps.max_send_sge > 0);
        QueuePair {
            inner: Rc::new(QpInner {
                handle,
                core,
                reg_key,
                caps,
                max_send_chain,
                max_recv_chain,
                spare_wrs: RefCell::new(Vec::new()),
                ud,
            }),
        }
    }

    /// The provider QP (for connection setup and queries). Always `Some`;
    /// the `Option` is kept for compatibility.
    pub fn provider(&self) -> Option<&Qp> {
        Some(&self.inner.core.qp)
    }

    /// QP number.
    pub fn qp_num(&self) -> u32 {
        self.inner.core.qp_num
    }

    /// Queue sizes the entries are based on.
    pub fn caps(&self) -> QpCaps {
        self.inner.caps
    }

    /// Current provider state.
    pub fn state(&self) -> Result<QpState, ProviderError> {
        Ok(self.inner.core.qp.state())
    }

    /// What the peer needs to connect to this QP.
    pub fn endpoint(&self, gid_index: u8) -> Result<Endpoint, ProviderError> {
        self.inner.core.qp.endpoint(gid_index)
    }

    /// RESET → INIT.
    pub fn modify_to_init(&self, attr: &InitAttr) -> Result<(), ProviderError> {
        self.inner.core.qp.modify_to_init(attr)
    }

    /// INIT → RTR.
    pub fn modify_to_rtr(&self, attr: &RtrAttr) -> Result<(), ProviderError> {
        self.inner.core.qp.modify_to_rtr(attr)
    }

    /// RTR → RTS.
    pub fn modify_to_rts(&self, attr: &RtsAttr) -> Result<(), ProviderError> {
        self.inner.core.qp.modify_to_rts(attr)
    }

    /// Send WRs posted and not yet completed (entries in use).
    pub fn outstanding_sends(&self) -> u32 {
        self.inner.core.entries.sq.outstanding()
    }

    /// Receive WRs posted and not yet completed.
    pub fn outstanding_recvs(&self) -> u32 {
        let core = &self.inner.core;
        core.entries
            .rq
            .outstanding()
            .saturating_sub(core.ring_kept.get())
    }

    /// True once [`close`](Self::close) was called (or the runtime shut down).
    pub fn is_closed(&self) -> bool {
        self.inner.core.closed.get()
    }

    /// Resolves once no send WR of this QP is outstanding (every one has
    /// completed or been flushed). Unlike [`close`](Self::close) it does not
    /// move the QP to ERR: sends in flight finish by the transport's rules.
    ///
    /// Trailing unsignaled inline sends are retired first (one signaled
    /// zero-length RDMA WRITE is posted for them).
    pub fn sends_idle(&self) -> impl Future<Output = ()> + '_ {
        if !self.inner.core.closed.get() {
            self.inner.core.retire_unsignaled();
        }
        let sq = &self.inner.core.entries.sq;
        std::future::poll_fn(move |cx| sq.poll_idle(cx))
    }

    /// Closes the QP: later submissions fail with [`SubmitError::Closed`](crate::op::SubmitError::Closed), the
    /// QP moves to ERR (re-issued even if already there), and this resolves
    /// once every outstanding WR has completed or been flushed, i.e. once the
    /// device no longer touches any buffer of this QP. Returns the error of
    /// the ERR transition, if any (the wait happens regardless). Wrap it in
    /// [`timeout`](crate::reactor::timeout) to bound it.
    ///
    /// An error of an inline send posted without an op
    /// ([`post_send_inline`](Self::post_send_inline)) is not this call's
    /// result: it stays readable with [`inline_send_error`](Self::inline_send_error)
    /// (and is logged here).
    pub fn close(&self) -> impl Future<Output = Result<(), ProviderError>> + '_ {
        let res = self.inner.core.shut(self.inner.handle.ops());
        if let Err(e) = &res {
            tracing::warn!(qp = self.qp_num(), error = %crate::report::ErrorChain(e), "modify_to_err on close failed");
        }
        let core = &self.inner.core;
        let mut res = Some(res);
        std::future::poll_fn(move |cx| {
            let sq = core.entries.sq.poll_idle(cx);
            let rq = core.entries.rq.poll_idle(cx);
            if sq.is_ready() && rq.is_ready() {
                if let Some(e) = core.fault_error() {
                    tracing::warn!(qp = core.qp_num, error = %crate::report::ErrorChain(&e), "closed a QP whose inline send failed");
                }
                Poll::Ready(res.take().unwrap_or(Ok(())))
            } else {
                Poll::Pending
            }
        })
    }

    /// True if single-WR send ops submitted during a poll phase wait for
    /// its end and go out in one post list (see
    /// [`submit_send_one`](Self::submit_send_one)). The default depends on
    /// the provider: on for the software device, off for libibverbs devices.
    pub fn doorbell_batching(&self) -> bool {
        self.inner.core.batch_posts.get()
    }

    /// Turns doorbell batching on or off for this QP (see
    /// [`doorbell_batching`](Self::doorbell_batching)). Turning it off
    /// posts the WRs waiting for the end of the current poll phase now.
    pub fn set_doorbell_batching(&self, on: bool) {
        let core = &self.inner.core;
        core.batch_posts.set(on);
        if !on {
            core.flush_deferred(self.inner.handle.ops());
            // Single WRs are posted at once from now on (`defers_now`).
            core.listed_in_phase.set(false);
        }
    }
}
