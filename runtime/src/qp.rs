//! [`QueuePair`]: a runtime-level RC queue pair. It accounts for send-queue,
//! receive-queue and CQ capacity as credits, so a submission waits (a future)
//! when a queue is full instead of failing or overrunning it, and turns each
//! posted chain of work requests into an [`Op`] tracked by wr_id.
//!
//! # Writing a verb
//!
//! A verb is a type that owns what the device touches and implements
//! [`Completable`], plus a function that calls [`QueuePair::submit_send`]
//! (or [`QueuePair::submit_recv`]) and returns the [`Submit`] future:
//!
//! ```no_run
//! use verbio_runtime::provider::{Completion, CompletionError, Mr, SendFlags, SendOp, SendWr, Sge};
//! use verbio_runtime::{Completable, QueuePair, Submit, SubmitError};
//!
//! /// An RDMA WRITE of `buf[..len]` (registered as `mr`) to the peer's `remote_addr`.
//! pub struct WriteOp {
//!     buf: Vec<u8>, // heap memory: its address is stable while the op moves
//!     mr: Mr,       // keeps the registration alive while the device reads
//!     len: usize,
//! }
//!
//! #[derive(Debug)]
//! pub enum WriteError {
//!     Submit(SubmitError),
//!     Completion(CompletionError),
//! }
//!
//! impl Completable for WriteOp {
//!     type Output = (Result<usize, WriteError>, Vec<u8>, Mr);
//!     fn complete(self, c: Completion) -> Self::Output {
//!         let r = if c.status.is_success() {
//!             Ok(self.len)
//!         } else {
//!             Err(WriteError::Completion(CompletionError {
//!                 wr_id: c.wr_id,
//!                 qp_num: c.qp_num,
//!                 status: c.status,
//!             }))
//!         };
//!         (r, self.buf, self.mr)
//!     }
//!     fn fail(self, e: SubmitError) -> Self::Output {
//!         (Err(WriteError::Submit(e)), self.buf, self.mr)
//!     }
//! }
//!
//! /// Safe: the buffer is moved into the op, so nobody else can touch it
//! /// until the op hands it back.
//! pub fn write(qp: &QueuePair, buf: Vec<u8>, mr: Mr, len: usize, remote_addr: u64, rkey: u32)
//!     -> Submit<WriteOp>
//! {
//!     // SAFETY: the only SGE is `buf[..len]` (checked below): heap memory
//!     // owned by the op, so its address survives the op's moves, and the
//!     // runtime keeps the op until the WRITE's completion. `WriteOp` never
//!     // touches `buf` before `complete`/`fail` hands it back. (If `mr` does
//!     // not cover `buf`, the device fails the WR without touching memory.)
//!     unsafe { qp.submit_send(WriteOp { buf, mr, len }, |op, chain| {
//!         if op.len > op.buf.len() || op.len > u32::MAX as usize {
//!             return Err(SubmitError::Invalid { what: format!("len {} > buffer", op.len) });
//!         }
//!         let mut wr = SendWr {
//!             wr_id: 0, // set by the runtime
//!             sg_list: Default::default(),
//!             op: SendOp::Write { remote_addr, rkey },
//!             flags: SendFlags::NONE, // the runtime signals the last WR
//!         };
//!         wr.sg_list.push(Sge { addr: op.buf.as_ptr() as u64, length: op.len as u32, lkey: op.mr.lkey() });
//!         chain.push(wr);
//!         Ok(())
//!     }) }
//! }
//! ```

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::mem::ManuallyDrop;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};

use smallvec::SmallVec;

use crate::op::{wr_id, Completable, Credit, Credits, Op, OpTable, QpCredits, SubmitError, Ticket};
use crate::provider::{
    Completion, Endpoint, InitAttr, PostError, ProviderError, Qp, QpCaps, QpState, RecvWr, RtrAttr,
    RtsAttr, SendFlags, SendOp, SendWr, SgList,
};
use crate::reactor::{CqRegistration, Handle, WorkQueue};

mod deferred;
#[cfg(test)]
mod deferred_tests;
mod inline;
#[cfg(test)]
mod inline_tests;
#[cfg(test)]
mod one_tests;
mod recv_ring;
#[cfg(test)]
mod recv_ring_tests;

pub(crate) use inline::InlineFault;
pub use inline::{SendInline, DEFAULT_INLINE_SIGNAL_INTERVAL, MAX_INLINE_SIGNAL_INTERVAL};
pub use recv_ring::{NextMsg, RecvMsg, RecvRing, RecvRingConfig, RecvRingError};

/// The WRs of one send op; up to four live inline (no allocation).
pub type SendChain = SmallVec<[SendWr; 4]>;

/// What the runtime posts to: a provider QP, or (in tests) a recording fake.
#[derive(Clone)]
pub(crate) enum Backend {
    Provider(Qp),
    #[cfg(any(test, feature = "test-util"))]
    Fake(Rc<crate::testing::FakeQp>),
}

impl Backend {
    /// # Safety
    ///
    /// The contract of [`Qp::post_send`].
    #[inline]
    unsafe fn post_send(&self, wrs: &[SendWr]) -> Result<(), PostError> {
        match self {
            // SAFETY: forwarded contract of this function.
            Backend::Provider(qp) => unsafe { qp.post_send(wrs) },
            #[cfg(any(test, feature = "test-util"))]
            Backend::Fake(f) => f.post_send(wrs),
        }
    }
    /// # Safety
    ///
    /// The contract of [`Qp::post_recv`].
    unsafe fn post_recv(&self, wrs: &[RecvWr]) -> Result<(), PostError> {
        match self {
            // SAFETY: forwarded contract of this function.
            Backend::Provider(qp) => unsafe { qp.post_recv(wrs) },
            #[cfg(any(test, feature = "test-util"))]
            Backend::Fake(f) => f.post_recv(wrs),
        }
    }
    pub(crate) fn modify_to_err(&self) -> Result<(), ProviderError> {
        match self {
            Backend::Provider(qp) => qp.modify_to_err(),
            #[cfg(any(test, feature = "test-util"))]
            Backend::Fake(f) => f.modify_to_err(),
        }
    }
}

/// The part of a QP the reactor keeps until every WR of it has completed,
/// even after the last `QueuePair` handle is gone (then it is a zombie: in
/// ERR, waiting for its flushes).
pub(crate) struct QpCore {
    pub(crate) backend: Backend,
    pub(crate) qp_num: u32,
    /// Its queues' and CQs' credit pools (shared with its ops' credits).
    pub(crate) credits: Rc<QpCredits>,
    pub(crate) closed: Cell<bool>,
    /// The last `QueuePair` handle is gone.
    pub(crate) dropped: Cell<bool>,
    /// Keeps the CQ registered while WRs are outstanding.
    pub(crate) _cq: Option<Rc<CqRegistration>>,
    /// This QP's key in the reactor's QP registry (named by inline wr_ids).
    pub(crate) reg_key: Cell<usize>,
    /// Send-queue and CQ credits (each) held by the unsignaled inline sends
    /// posted since the last signaled send WR, plus one reserve credit for
    /// the WR that retires them; 0 if there are none.
    ///
    /// # Invariant
    ///
    /// Nonzero only while the last WR posted to the send queue was an
    /// unsignaled inline send: every signaled send post takes these credits
    /// over (they come back with its completion, which by RC ordering
    /// implies the unsignaled WRs' completion).
    pub(crate) unsig: Cell<u32>,
    /// Send-queue credits held by inline sends (those of `unsig`, and those
    /// carried by posted signaled inline WRs not completed yet). They lend
    /// no memory to the device: a QP holding only these is not leaked at
    /// runtime shutdown.
    pub(crate) inline_credits: Cell<u32>,
    /// At most `signal_every - 1` inline sends in a row go unsignaled.
    pub(crate) signal_every: Cell<u32>,
    /// The first error completion of an inline send posted without an op.
    pub(crate) fault: Cell<Option<InlineFault>>,
    /// Receive-queue and receive-CQ credits (each) that this QP's receive
    /// rings keep between a buffer's completion and its repost (so the
    /// repost needs no acquire). Given back by [`shut`](Self::shut): a
    /// closing QP waits only for its posted receives.
    pub(crate) ring_kept: Cell<u32>,
    /// Single send WRs submitted during the current poll phase, posted as
    /// one list when it ends (`deferred.rs`).
    pub(crate) deferred: RefCell<deferred::Deferred>,
    /// Doorbell batching is on for this QP (see
    /// [`QueuePair::set_doorbell_batching`]).
    pub(crate) batch_posts: Cell<bool>,
    /// Listed for the end of the current poll phase (`deferred.rs`).
    pub(crate) listed_in_phase: Cell<bool>,
}

impl QpCore {
    pub(crate) fn outstanding(&self) -> u32 {
        self.credits.outstanding()
    }

    /// Marks the QP closed, wakes queued submitters and moves it to ERR
    /// (again: rxe flushes receives posted in ERR only on a new transition).
    ///
    /// Trailing unsignaled inline sends are retired by a WR posted once the
    /// QP is in ERR (so it is flushed, never executed), followed by one more
    /// ERR transition (rxe flushes WRs posted in ERR only then). If that post
    /// fails, their credits are given back at once.
    pub(crate) fn shut(&self, ops: &crate::op::OpTable) -> Result<(), ProviderError> {
        // Deferred WRs go out first: the ERR transition flushes them with
        // the rest, so their ops end as every posted WR of a closed QP does.
        self.flush_deferred(ops);
        self.closed.set(true);
        // The receive rings repost nothing once closed: their kept credits
        // come back now (they check `closed` before using them).
        let kept = self.ring_kept.replace(0);
        if kept > 0 {
            self.credits.rq.release(kept);
            self.credits.recv_cq.release(kept);
        }
        self.credits.sq.wake_all();
        self.credits.rq.wake_all();
        self.credits.send_cq.wake_all();
        self.credits.recv_cq.wake_all();
        let res = self.backend.modify_to_err();
        if self.unsig.get() > 0 {
            if self.retire_unsignaled() {
                if let Err(e) = self.backend.modify_to_err() {
                    tracing::debug!(qp = self.qp_num, error = %e, "second modify_to_err");
                }
            } else {
                let n = self.absorb_unsignaled();
                self.credits.sq.release(n);
                self.credits.send_cq.release(n);
            }
        }
        res
    }
}

impl WorkQueue for QpCore {
    /// An inline send's completion (or that of the WR retiring them).
    fn complete_reserved(&self, c: &Completion) {
        if c.qp_num == self.qp_num {
            self.inline_completed(c);
        } else {
            tracing::debug!(
                wr_id = c.wr_id,
                qp = c.qp_num,
                "inline completion of another QP"
            );
        }
    }

    /// Posts the single WRs deferred during the phase, in one list.
    fn phase_ended(&self, ops: &OpTable) {
        self.flush_deferred(ops);
        self.listed_in_phase.set(false);
    }

    /// Retires trailing unsignaled inline sends, which hold CQ credits.
    fn release_hoarded(&self) {
        if self.unsig.get() > 0 && !self.closed.get() {
            self.retire_unsignaled();
        }
    }

    fn shut_down(&self, ops: &OpTable) {
        if let Err(e) = self.shut(ops) {
            tracing::debug!(qp = self.qp_num, error = %e, "modify_to_err at shutdown");
        }
    }

    /// Inline sends lend no memory.
    fn lent(&self) -> u32 {
        self.outstanding_with_memory()
    }

    fn finished(&self) -> bool {
        self.dropped.get() && self.outstanding() == 0
    }
}

struct QpInner {
    handle: Handle,
    core: Rc<QpCore>,
    reg_key: usize,
    caps: QpCaps,
    /// Longest chain a send op may have: the send queue, the send CQ and the
    /// wr_id index space must all hold it.
    max_send_chain: usize,
    /// 1 if a receive fits the receive queue and CQ, else 0.
    max_recv_chain: usize,
    /// Boxes for the WRs of submissions that wait for credits, recycled so
    /// that backpressure does not allocate per op (and `Submit` stays small).
    /// (Boxes, not a `Vec<Wrs>`: a waiting `Submit` owns its box.)
    #[allow(clippy::vec_box)]
    spare_wrs: RefCell<Vec<Box<Waiting>>>,
}

/// Most recycled WR boxes a QP keeps.
const SPARE_WRS: usize = 64;

impl Drop for QpInner {
    fn drop(&mut self) {
        self.core.dropped.set(true);
        if self.core.outstanding() > 0 {
            if !self.core.closed.get() {
                if let Err(e) = self.core.shut(self.handle.ops()) {
                    tracing::warn!(qp = self.core.qp_num, error = %e, "moving a dropped QP to ERR failed");
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

/// An RC queue pair driven by the runtime. Cheap to clone (`Rc`); `!Send`.
///
/// Submissions wait for send-queue (or receive-queue) credits and CQ credits
/// in FIFO order, so the device's queues are never overrun. Dropping the last
/// handle with WRs outstanding moves the QP to ERR; the runtime keeps it alive
/// until the flushes arrive and the parked buffers are freed.
#[derive(Clone)]
pub struct QueuePair {
    inner: Rc<QpInner>,
}

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair")
            .field("qp_num", &self.inner.core.qp_num)
            .field(
                "outstanding_sends",
                &self.inner.core.credits.sq.outstanding(),
            )
            .field("outstanding_recvs", &self.outstanding_recvs())
            .field("closed", &self.inner.core.closed.get())
            .finish()
    }
}

impl QueuePair {
    pub(crate) fn from_backend(
        handle: Handle,
        backend: Backend,
        qp_num: u32,
        caps: QpCaps,
        send_cq: Rc<Credits>,
        recv_cq: Rc<Credits>,
        cq: Option<Rc<CqRegistration>>,
    ) -> QueuePair {
        let batch_posts = batching_by_default(&backend);
        let core = Rc::new(QpCore {
            backend,
            qp_num,
            credits: Rc::new(QpCredits {
                sq: Credits::new(caps.max_send_wr),
                rq: Credits::new(caps.max_recv_wr),
                send_cq,
                recv_cq,
            }),
            closed: Cell::new(false),
            dropped: Cell::new(false),
            _cq: cq,
            reg_key: Cell::new(0),
            unsig: Cell::new(0),
            inline_credits: Cell::new(0),
            signal_every: Cell::new(
                DEFAULT_INLINE_SIGNAL_INTERVAL.min((caps.max_send_wr / 2).max(1)),
            ),
            fault: Cell::new(None),
            ring_kept: Cell::new(0),
            deferred: RefCell::new(deferred::Deferred::default()),
            batch_posts: Cell::new(batch_posts),
            listed_in_phase: Cell::new(false),
        });
        handle.driver().register_qp(|key| {
            core.reg_key.set(key);
            core.clone()
        });
        let reg_key = core.reg_key.get();
        let max_send_chain =
            (caps.max_send_wr.min(core.credits.send_cq.capacity()) as usize).min(wr_id::MAX_CHAIN);
        let max_recv_chain =
            (caps.max_recv_wr.min(core.credits.recv_cq.capacity()) as usize).min(1);
        QueuePair {
            inner: Rc::new(QpInner {
                handle,
                core,
                reg_key,
                caps,
                max_send_chain,
                max_recv_chain,
                spare_wrs: RefCell::new(Vec::new()),
            }),
        }
    }

    /// The provider QP (for connection setup and queries); `None` for a test fake.
    pub fn provider(&self) -> Option<&Qp> {
        match &self.inner.core.backend {
            Backend::Provider(qp) => Some(qp),
            #[cfg(any(test, feature = "test-util"))]
            Backend::Fake(_) => None,
        }
    }

    fn provider_or_err(&self, call: &'static str) -> Result<&Qp, ProviderError> {
        self.provider().ok_or(ProviderError::Unsupported {
            provider: "fake",
            what: call,
        })
    }

    /// QP number.
    pub fn qp_num(&self) -> u32 {
        self.inner.core.qp_num
    }

    /// Queue sizes the credits are based on.
    pub fn caps(&self) -> QpCaps {
        self.inner.caps
    }

    /// Current provider state (`Err` for a fake backend).
    pub fn state(&self) -> Result<QpState, ProviderError> {
        Ok(self.provider_or_err("state")?.state())
    }

    /// What the peer needs to connect to this QP.
    pub fn endpoint(&self, gid_index: u8) -> Result<Endpoint, ProviderError> {
        self.provider_or_err("endpoint")?.endpoint(gid_index)
    }

    /// RESET → INIT.
    pub fn modify_to_init(&self, attr: &InitAttr) -> Result<(), ProviderError> {
        self.provider_or_err("modify_to_init")?.modify_to_init(attr)
    }

    /// INIT → RTR.
    pub fn modify_to_rtr(&self, attr: &RtrAttr) -> Result<(), ProviderError> {
        self.provider_or_err("modify_to_rtr")?.modify_to_rtr(attr)
    }

    /// RTR → RTS.
    pub fn modify_to_rts(&self, attr: &RtsAttr) -> Result<(), ProviderError> {
        self.provider_or_err("modify_to_rts")?.modify_to_rts(attr)
    }

    /// Send WRs posted and not yet completed (credits in use).
    pub fn outstanding_sends(&self) -> u32 {
        self.inner.core.credits.sq.outstanding()
    }

    /// Receive WRs posted and not yet completed.
    pub fn outstanding_recvs(&self) -> u32 {
        let core = &self.inner.core;
        core.credits
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
        let sq = &self.inner.core.credits.sq;
        std::future::poll_fn(move |cx| sq.poll_idle(cx))
    }

    /// Closes the QP: later submissions fail with [`SubmitError::Closed`], the
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
            tracing::warn!(qp = self.qp_num(), error = %e, "modify_to_err on close failed");
        }
        let core = &self.inner.core;
        let mut res = Some(res);
        std::future::poll_fn(move |cx| {
            let sq = core.credits.sq.poll_idle(cx);
            let rq = core.credits.rq.poll_idle(cx);
            if sq.is_ready() && rq.is_ready() {
                if let Some(e) = core.fault_error() {
                    tracing::warn!(qp = core.qp_num, error = %e, "closed a QP whose inline send failed");
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
        }
    }

    /// Submits a chain of send-queue WRs as one op (one doorbell).
    ///
    /// `build` runs at once and pushes the WRs, reading buffer addresses and
    /// keys from `data` (which must own that memory at stable addresses). The
    /// runtime then overwrites each WR's `wr_id` and makes only the last WR
    /// signaled. If the send queue or the CQ lacks room, the returned future
    /// waits (FIFO) and posts when room frees up; otherwise the chain is
    /// posted before this function returns (a single WR submitted through
    /// [`submit_send_one`](Self::submit_send_one) while the runtime polls
    /// a task or the `block_on` future is posted when that poll phase ends,
    /// in one post list with the phase's other such WRs: see
    /// [`submit_send_one`](Self::submit_send_one)). The future resolves with
    /// [`Completable::complete`] (or [`Completable::fail`]).
    ///
    /// The runtime keeps `data` from this call until the chain's completion
    /// (or flush) has been polled, even if the returned future is dropped
    /// meanwhile (the data is then parked); at runtime shutdown it leaks
    /// whatever is still in flight rather than dropping it.
    ///
    /// # Safety
    ///
    /// The WRs are posted under the contract of [`Qp::post_send`], and the
    /// device is done with them by the time the runtime hands `data` back
    /// (to [`Completable::complete`] or [`Completable::fail`]) or drops it
    /// (a parked op's data is dropped once its completion or flush has been
    /// polled). So every SGE (address range and lkey) of every WR `build`
    /// pushes must name memory that, from this call until then, stays
    /// allocated and is accessed through no Rust reference but the
    /// device's: the device only reads the SGEs of SEND and WRITE WRs, so
    /// shared (`&`) reads of those are allowed meanwhile; memory it writes
    /// (READ destinations, atomic results) must not be referenced at all,
    /// neither by another owner of a shared buffer nor by code of `T`.
    ///
    /// The usual way to meet this: `data` owns the memory (or keeps it alive
    /// through an `Rc`/`Arc` nobody else uses meanwhile) at a heap address
    /// that does not change when `data` moves, never in a field stored
    /// inline in `data`.
    ///
    /// As for [`Qp::post_send`], the obligation ends early once the
    /// registration the SGE's lkey names is deregistered, and an SGE whose
    /// lkey names no live registration containing its range is exempt (the
    /// device fails the WR without touching memory).
    ///
    /// INLINE-flagged WRs are no exception: the post may happen later (when
    /// queue room frees up), so their memory must stay readable (allocated,
    /// not written) until `data` comes back; keeping it in `data` does that.
    ///
    /// Remote addresses and rkeys are not part of this contract: the peer's
    /// responder checks them.
    pub unsafe fn submit_send<T, F>(&self, mut data: T, build: F) -> Submit<T>
    where
        T: Completable,
        F: FnOnce(&mut T, &mut SendChain) -> Result<(), SubmitError>,
    {
        // Built in place: the chain is large (inline WRs), so it is never
        // moved on the way to the post.
        let mut wrs = Wrs::Send(SendChain::new());
        if let Wrs::Send(chain) = &mut wrs {
            if let Err(e) = build(&mut data, chain) {
                return Submit::ready(data.fail(e));
            }
        }
        // SAFETY: the chain was built from `data` under this function's
        // contract.
        unsafe { self.submit(data, &mut wrs) }
    }

    /// [`submit_send`](Self::submit_send) for a single WR, the common case:
    /// `build` fills one WR in place (its `wr_id` and SIGNALED flag are set
    /// by the runtime), which is posted without a chain around it.
    ///
    /// Doorbell batching (on by default on the software device, off on
    /// libibverbs devices; see [`set_doorbell_batching`](Self::set_doorbell_batching)):
    /// called while the runtime polls its tasks or the
    /// `block_on` future (a poll phase), the WR is not posted at once but
    /// when the phase ends (before the reactor polls its CQs or sleeps),
    /// with every other single WR of the phase for the same QP in one post
    /// list: one `ibv_post_send` and one doorbell for the ops the tasks of
    /// one reactor turn submitted (a list goes out early once 8 WRs wait,
    /// so the device is not left idle through a long phase). The op is in flight from this
    /// call on (data owned, credits taken); send-queue order is kept (any
    /// other post to the QP posts the waiting WRs first). If the provider
    /// refuses the list, the refused WR's op fails with
    /// [`SubmitError::Post`] and the ops after it with
    /// [`SubmitError::PostBatchAborted`]. Outside a poll phase (a future
    /// polled by another executor) the WR is posted before this returns.
    ///
    /// # Safety
    ///
    /// The contract of [`submit_send`](Self::submit_send), for the WR
    /// `build` fills.
    #[inline(always)]
    pub unsafe fn submit_send_one<T, F>(&self, mut data: T, build: F) -> Submit<T>
    where
        T: Completable,
        F: FnOnce(&mut T, &mut SendWr) -> Result<(), SubmitError>,
    {
        let mut wrs = Wrs::One(SendWr {
            wr_id: 0,
            sg_list: SgList::new(),
            op: SendOp::Send,
            flags: SendFlags::NONE,
        });
        if let Wrs::One(wr) = &mut wrs {
            if let Err(e) = build(&mut data, wr) {
                return Submit::ready(data.fail(e));
            }
        }
        // SAFETY: the WR was built from `data` under this function's
        // contract.
        unsafe { self.submit(data, &mut wrs) }
    }

    /// Submits one receive WR as an op. `build` fills its scatter list from
    /// `data`; the runtime sets the wr_id. Waits for receive-queue and CQ
    /// credits like [`submit_send`](Self::submit_send), and keeps `data`
    /// until the completion (or flush) has been polled.
    ///
    /// # Safety
    ///
    /// As for [`submit_send`](Self::submit_send), under the contract of
    /// [`Qp::post_recv`]: every SGE (address range and lkey) `build` pushes
    /// must name memory that, from this call until the runtime hands `data`
    /// back (to [`Completable::complete`] or [`Completable::fail`]) or drops
    /// it, stays allocated and is not accessed through Rust references at
    /// all (the device writes it), neither by another owner of a shared
    /// buffer nor by code of `T`. The usual way: `data` owns that memory at
    /// a heap address that does not change when `data` moves. The same
    /// exemptions apply (deregistered registration, lkey naming no live
    /// registration containing the range).
    pub unsafe fn submit_recv<T, F>(&self, mut data: T, build: F) -> Submit<T>
    where
        T: Completable,
        F: FnOnce(&mut T, &mut SgList) -> Result<(), SubmitError>,
    {
        let mut wrs = Wrs::Recv(RecvWr {
            wr_id: 0,
            sg_list: SgList::new(),
        });
        if let Wrs::Recv(wr) = &mut wrs {
            if let Err(e) = build(&mut data, &mut wr.sg_list) {
                return Submit::ready(data.fail(e));
            }
        }
        // SAFETY: the scatter list was built from `data` under this
        // function's contract.
        unsafe { self.submit(data, &mut wrs) }
    }

    /// Validates a chain before it takes credits; returns its length.
    #[inline(always)]
    fn check(&self, wrs: &Wrs) -> Result<u32, SubmitError> {
        let inner = &*self.inner;
        if inner.core.closed.get() {
            return Err(SubmitError::Closed {
                qp_num: inner.core.qp_num,
            });
        }
        if let Some(e) = inner.core.fault_error() {
            return Err(e);
        }
        match wrs {
            Wrs::Send(c) => {
                let len = c.len();
                if len == 0 || len > inner.max_send_chain {
                    return Err(self.chain_length("send", len));
                }
                let max_sge = inner.caps.max_send_sge as usize;
                // INLINE WRs are copied at post time: their SGE count is free.
                for wr in c.iter() {
                    if wr.sg_list.len() > max_sge && !wr.flags.contains(SendFlags::INLINE) {
                        return Err(SubmitError::TooManySges {
                            qp_num: inner.core.qp_num,
                            queue: "send",
                            sges: wr.sg_list.len(),
                            max: inner.caps.max_send_sge,
                        });
                    }
                }
                Ok(len as u32)
            }
            Wrs::One(wr) => {
                // A chain of one always fits (the queues hold at least one).
                if wr.sg_list.len() > inner.caps.max_send_sge as usize
                    && !wr.flags.contains(SendFlags::INLINE)
                {
                    return Err(SubmitError::TooManySges {
                        qp_num: inner.core.qp_num,
                        queue: "send",
                        sges: wr.sg_list.len(),
                        max: inner.caps.max_send_sge,
                    });
                }
                if inner.max_send_chain == 0 {
                    return Err(self.chain_length("send", 1));
                }
                Ok(1)
            }
            Wrs::Recv(r) => {
                if inner.max_recv_chain == 0 {
                    return Err(self.chain_length("receive", 1));
                }
                if r.sg_list.len() > inner.caps.max_recv_sge as usize {
                    return Err(SubmitError::TooManySges {
                        qp_num: inner.core.qp_num,
                        queue: "receive",
                        sges: r.sg_list.len(),
                        max: inner.caps.max_recv_sge,
                    });
                }
                Ok(1)
            }
        }
    }

    #[cold]
    fn chain_length(&self, queue: &'static str, len: usize) -> SubmitError {
        let core = &self.inner.core;
        let (depth, cq_cap) = if queue == "send" {
            (core.credits.sq.capacity(), core.credits.send_cq.capacity())
        } else {
            (core.credits.rq.capacity(), core.credits.recv_cq.capacity())
        };
        SubmitError::ChainLength {
            qp_num: core.qp_num,
            queue,
            len,
            depth: depth.min(cq_cap),
        }
    }

    /// # Safety
    ///
    /// `wrs` name memory kept by `data` under the contract of
    /// [`submit_send`](Self::submit_send) / [`submit_recv`](Self::submit_recv).
    ///
    /// `data` is moved once, into the returned future: each outcome
    /// (posted, refused, waiting for credits) builds its `Submit` in one
    /// expression, which the compiler builds right in the caller's return
    /// slot (no `Submit` is built first and copied out). The post itself
    /// ([`post`](Self::post)) never touches `data`; it is moved into its
    /// op right after a successful post, with no code that can unwind in
    /// between, so it is owned by the op while the device may use it.
    #[inline(always)]
    unsafe fn submit<T: Completable>(&self, data: T, wrs: &mut Wrs) -> Submit<T> {
        let n = match self.check(wrs) {
            Ok(n) => n,
            Err(e) => return Submit::from_state(State::Ready(refused(Some(data), e))),
        };
        let (queue, cq) = self.credits_for(wrs);
        if !queue.try_acquire(n) {
            return Submit::from_state(self.wait_for_credits(data, wrs, n, false));
        }
        if !cq.try_acquire(n) {
            return Submit::from_state(self.wait_for_credits(data, wrs, n, true));
        }
        // SAFETY: forwarded contract of this function; on success `data`
        // moves into the op at once (below).
        match unsafe { self.post(wrs, n) } {
            Ok(first) => Submit::from_state(State::InFlight(Op::posted(
                self.inner.handle.driver().ops.clone(),
                first,
                data,
            ))),
            Err(e) => Submit::from_state(State::Ready(refused(Some(data), e))),
        }
    }

    /// A submission that must wait for credits (`queue_held`: it already
    /// holds its queue credits, and waits for the CQ's).
    #[cold]
    #[inline(never)]
    fn wait_for_credits<T: Completable>(
        &self,
        data: T,
        wrs: &mut Wrs,
        n: u32,
        queue_held: bool,
    ) -> State<T> {
        if queue_held {
            // Unsignaled inline sends of any QP may hold CQ credits.
            self.inner.handle.driver().release_hoarded_credits();
        } else if !matches!(wrs, Wrs::Recv(_)) {
            self.inner.core.retire_unsignaled();
        }
        State::Queued(Queued {
            qp: self.clone(),
            data: Some(data),
            wait: Some(self.boxed(wrs, n, queue_held)),
        })
    }

    /// Moves `wrs` into a (recycled) box with the rest of a waiting
    /// submission's state, for a submission that must wait.
    fn boxed(&self, wrs: &mut Wrs, n: u32, queue_held: bool) -> Box<Waiting> {
        let spare = self.inner.spare_wrs.borrow_mut().pop();
        let mut b = spare.unwrap_or_else(|| {
            Box::new(Waiting {
                wrs: Wrs::Recv(RecvWr {
                    wr_id: 0,
                    sg_list: SgList::new(),
                }),
                recv: false,
                n: 0,
                queue_held: false,
                queue_ticket: None,
                cq_ticket: None,
            })
        });
        std::mem::swap(&mut b.wrs, wrs);
        b.recv = matches!(b.wrs, Wrs::Recv(_));
        b.n = n;
        b.queue_held = queue_held;
        b.queue_ticket = None;
        b.cq_ticket = None;
        b
    }

    /// Gives a WR box back for reuse (its old contents are dropped later,
    /// when it is reused, or now if the pool is full).
    fn recycle(&self, b: Box<Waiting>) {
        let mut spare = self.inner.spare_wrs.borrow_mut();
        if spare.len() < SPARE_WRS {
            spare.push(b);
        } else {
            drop(spare);
            drop(b);
        }
    }

    #[inline(always)]
    fn credits_for(&self, wrs: &Wrs) -> (&Credits, &Credits) {
        self.inner.core.credits.pools(matches!(wrs, Wrs::Recv(_)))
    }

    /// Posts `wrs` with `n` queue and CQ credits already taken, in a new
    /// slot of the op table that takes the credits over. Returns the first
    /// WR's wr_id on success or on a partial post (the slot then reports
    /// the post error once the posted part has flushed): the op is in
    /// flight. On failure nothing was posted and the slot and credits are
    /// given back.
    ///
    /// # Safety
    ///
    /// `wrs` name memory kept by some op data under the contract of
    /// [`submit_send`](Self::submit_send) / [`submit_recv`](Self::submit_recv).
    /// On `Ok`, the caller moves that data into an [`Op`] of the returned
    /// wr_id before anything that can unwind, which keeps (parks, or at
    /// shutdown leaks) it until the completion or flush; so the provider's
    /// post contract holds.
    #[inline(always)]
    unsafe fn post(&self, wrs: &mut Wrs, n: u32) -> Result<u64, SubmitError> {
        let core = &self.inner.core;
        let recv = matches!(wrs, Wrs::Recv(_));
        // A signaled send takes over the credits of the unsignaled inline
        // sends before it: its completion implies theirs.
        let absorbed = if recv { 0 } else { core.absorb_unsignaled() };
        let credit = Credit {
            pools: core.credits.clone(),
            recv,
            n: n + absorbed,
        };
        let ops = self.inner.handle.ops();
        let (key, gen) = match ops.insert((n - 1) as u16, credit) {
            Ok(k) => k,
            Err(mut credit) => {
                credit.n -= absorbed;
                core.unabsorb(absorbed);
                drop(credit);
                return Err(SubmitError::SlabFull {
                    limit: wr_id::MAX_OPS,
                });
            }
        };
        let first = wr_id::encode(key, gen, 0);
        let res = match wrs {
            Wrs::Send(chain) => {
                // Send-queue order: what waits for the doorbell goes first.
                core.flush_deferred(ops);
                let last = chain.len() - 1;
                for (i, wr) in chain.iter_mut().enumerate() {
                    wr.wr_id = wr_id::encode(key, gen, i as u16);
                    if i == last {
                        wr.flags |= SendFlags::SIGNALED;
                    } else {
                        wr.flags = unsignaled(wr.flags);
                    }
                }
                // SAFETY: the chain's memory is kept by op data that the
                // caller moves into the op of this wr_id on success (this
                // function's contract), which holds it until the completion
                // of the last (signaled) WR has been polled.
                unsafe { core.backend.post_send(chain) }
            }
            Wrs::One(wr) => {
                wr.wr_id = first;
                wr.flags |= SendFlags::SIGNALED;
                let driver = self.inner.handle.driver();
                if driver.batching() && core.batch_posts.get() {
                    // Posted with the poll phase's other WRs (deferred.rs),
                    // or with the previous ones once DEFER_MAX wait; the op
                    // is in flight from now on, as after a post.
                    if !core.listed_in_phase.replace(true) {
                        driver.note_phase_end(core.clone());
                    }
                    if core.defer(wr, absorbed) {
                        core.flush_deferred(ops);
                    }
                    return Ok(first);
                }
                core.flush_deferred(ops);
                // SAFETY: as above, for the single WR.
                unsafe { core.backend.post_send(std::slice::from_ref(wr)) }
            }
            Wrs::Recv(wr) => {
                wr.wr_id = first;
                // SAFETY: as above, for the receive WR's scatter list.
                unsafe { core.backend.post_recv(std::slice::from_ref(wr)) }
            }
        };
        match res {
            Ok(()) => Ok(first),
            Err(e) => match self.post_failed(key, absorbed, e) {
                // Part of the chain is on the queue: the op is in flight.
                None => Ok(first),
                Some(e) => Err(e),
            },
        }
    }

    /// The provider refused (part of) the chain of op `key`. If nothing was
    /// posted, the slot and the credits are given back and the error is
    /// returned (for the op's data); after a partial post the slot reports
    /// the error once the posted part has flushed, and `None` is returned.
    #[cold]
    #[inline(never)]
    fn post_failed(&self, key: usize, absorbed: u32, e: PostError) -> Option<SubmitError> {
        let core = &self.inner.core;
        let ops = self.inner.handle.ops();
        match e {
            e if e.posted == 0 => {
                if let Some(mut credit) = ops.remove_unposted(key) {
                    credit.n -= absorbed;
                    drop(credit);
                }
                core.unabsorb(absorbed);
                Some(SubmitError::Post {
                    qp_num: core.qp_num,
                    source: e,
                })
            }
            e => {
                // Part of the chain is on the queue, unsignaled: flush it so
                // its buffers come back, and report the post error then.
                tracing::warn!(qp = core.qp_num, posted = e.posted, error = %e, "partial post: moving QP to ERR");
                let posted = e.posted;
                ops.set_partial(
                    key,
                    posted,
                    SubmitError::Post {
                        qp_num: core.qp_num,
                        source: e,
                    },
                );
                if let Err(err) = core.shut(ops) {
                    tracing::warn!(qp = core.qp_num, error = %err, "modify_to_err after partial post failed");
                }
                None
            }
        }
    }
}

/// Whether a new QP batches its single-WR posts (see
/// [`QueuePair::set_doorbell_batching`]): on the software device, where one
/// post list takes the QP's lock and wakes the engine once for all its WRs
/// (measured: about 20 ns less CPU per op at depth 32, `op_overhead`), and
/// on the test fake; not on libibverbs devices: on rxe, whose doorbell
/// `write` runs the requester in the posting thread, one doorbell per WR
/// keeps it pumping and batching halved `perf write_bw` (measured side by
/// side in the rxe VM), and on hardware it is unmeasured.
fn batching_by_default(backend: &Backend) -> bool {
    match backend {
        Backend::Provider(qp) => qp.kind() == crate::provider::ProviderKind::Soft,
        #[cfg(any(test, feature = "test-util"))]
        Backend::Fake(_) => true,
    }
}

/// A submission refused before anything was posted: its data goes to
/// [`Completable::fail`], whose output is returned (for `State::Ready`).
#[cold]
#[inline(never)]
fn refused<T: Completable>(data: Option<T>, e: SubmitError) -> Option<Box<T::Output>> {
    data.map(|data| Box::new(data.fail(e)))
}

/// `flags` without SIGNALED.
fn unsignaled(flags: SendFlags) -> SendFlags {
    let mut out = SendFlags::NONE;
    for f in [SendFlags::FENCE, SendFlags::SOLICITED, SendFlags::INLINE] {
        if flags.contains(f) {
            out |= f;
        }
    }
    out
}

// The chain is built and posted in place; a waiting submission keeps it in
// a box recycled through the QP's spare list (no allocation per op).
#[allow(clippy::large_enum_variant)]
enum Wrs {
    Send(SendChain),
    /// A chain of one ([`QueuePair::submit_send_one`]).
    One(SendWr),
    Recv(RecvWr),
}

/// What a submission waiting for credits keeps besides its data: boxed
/// (and the box recycled), so that a `Queued` is no larger than an
/// in-flight `Op` and every `Submit` stays small.
struct Waiting {
    wrs: Wrs,
    recv: bool,
    n: u32,
    queue_held: bool,
    queue_ticket: Option<Ticket>,
    cq_ticket: Option<Ticket>,
}

impl Waiting {
    fn credits(&self, qp: &QueuePair) -> Rc<QpCredits> {
        qp.inner.core.credits.clone()
    }

    /// Gives back whatever this waiting submission holds.
    fn abandon(&mut self, qp: &QueuePair) {
        let pools = self.credits(qp);
        let (queue, cq) = pools.pools(self.recv);
        queue.cancel(&mut self.queue_ticket);
        cq.cancel(&mut self.cq_ticket);
        if self.queue_held {
            self.queue_held = false;
            queue.release(self.n);
        }
    }

    fn poll_credits(&mut self, qp: &QueuePair, cx: &mut Context<'_>) -> Poll<()> {
        let pools = self.credits(qp);
        let (queue, cq) = pools.pools(self.recv);
        if !self.queue_held {
            if queue
                .poll_acquire(self.n, &mut self.queue_ticket, cx)
                .is_pending()
            {
                return Poll::Pending;
            }
            self.queue_held = true;
        }
        if cq
            .poll_acquire(self.n, &mut self.cq_ticket, cx)
            .is_pending()
        {
            return Poll::Pending;
        }
        // Both held from here on; the post takes them over.
        self.queue_held = false;
        Poll::Ready(())
    }
}

struct Queued<T> {
    qp: QueuePair,
    /// `Some` until posted or failed.
    data: Option<T>,
    /// `Some` until posted or failed; given back to the QP's spare list.
    /// (Once taken, nothing is held: the credits passed to the post, or
    /// were given back.)
    wait: Option<Box<Waiting>>,
}

impl<T> Drop for Queued<T> {
    fn drop(&mut self) {
        if let Some(mut b) = self.wait.take() {
            b.abandon(&self.qp);
            self.qp.recycle(b);
        }
    }
}

// An explicit tag: cheaper to test (and to drop) than a niche nested in
// the output type.
#[repr(u8)]
enum State<T: Completable> {
    /// Waiting for queue or CQ credits.
    Queued(Queued<T>),
    InFlight(Op<T>),
    /// Boxed: only refusals and failures get here, and the output (which
    /// holds the op's buffers and an error) would make every `Submit`
    /// larger and slower to move.
    Ready(Option<Box<T::Output>>),
}

/// The future of a submission: waits for queue credits if needed, then for
/// the op's completion. Dropping it before the post frees `T` at once;
/// dropping it after parks `T` until the device is done.
#[must_use = "dropping a submission before it is posted cancels it"]
pub struct Submit<T: Completable> {
    /// Dropped by hand ([`Drop`] below): the future of a completed op, the
    /// common case, then only drops its runtime handle, inline (the
    /// state's drop glue is an out-of-line call). Assign through `*` (which
    /// drops the old state), never replace the `ManuallyDrop` itself.
    state: ManuallyDrop<State<T>>,
}

impl<T: Completable> Submit<T> {
    #[inline(always)]
    fn from_state(state: State<T>) -> Submit<T> {
        Submit {
            state: ManuallyDrop::new(state),
        }
    }

    /// Drops a state that is not a completed op (waiting for credits,
    /// in flight: parks the data, ready: an unclaimed output).
    #[inline(never)]
    fn drop_state(&mut self) {
        // SAFETY: called once, from `drop`: the state is never used again.
        unsafe { ManuallyDrop::drop(&mut self.state) }
    }
}

impl<T: Completable> Drop for Submit<T> {
    #[inline(always)]
    fn drop(&mut self) {
        if let State::InFlight(op) = &mut *self.state {
            if op.is_done() {
                // SAFETY: we are dropping `self`: the state is never used
                // again, and the op's data was taken (`is_done`).
                unsafe { op.drop_done() };
                return;
            }
        }
        self.drop_state();
    }
}

// `Submit` never pins its contents: `T` is plain owned state.
impl<T: Completable> Unpin for Submit<T> {}

impl<T: Completable> Submit<T> {
    /// A submission that already has its result (validation failed). The
    /// output is boxed (an error path: it keeps the common `Submit` small).
    #[cold]
    pub fn ready(output: T::Output) -> Submit<T> {
        Submit::from_state(State::Ready(Some(Box::new(output))))
    }

    /// True while waiting for queue or CQ credits (not posted yet).
    pub fn is_queued(&self) -> bool {
        matches!(*self.state, State::Queued(_))
    }

    /// The wr_id of the first WR, once posted.
    pub fn wr_id(&self) -> Option<u64> {
        match &*self.state {
            State::InFlight(op) => Some(op.wr_id()),
            _ => None,
        }
    }
}

impl<T: Completable> Future for Submit<T> {
    type Output = T::Output;

    #[inline(always)]
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T::Output> {
        let this = &mut *self;
        // The common case first, in a small frame: posted, in flight.
        if let State::InFlight(op) = &mut *this.state {
            return Pin::new(op).poll(cx);
        }
        this.poll_slow(cx)
    }
}

impl<T: Completable> Submit<T> {
    /// [`Submit::poll`] when not in flight: waiting for credits, or ready.
    #[inline(never)]
    fn poll_slow(&mut self, cx: &mut Context<'_>) -> Poll<T::Output> {
        let this = self;
        loop {
            match &mut *this.state {
                State::InFlight(op) => return Pin::new(op).poll(cx),
                State::Ready(out) => {
                    return match out.take() {
                        Some(o) => Poll::Ready(*o),
                        None => {
                            tracing::error!("submission polled after completion");
                            Poll::Pending
                        }
                    };
                }
                State::Queued(q) => {
                    let qp = q.qp.clone();
                    let closed = qp.inner.core.closed.get();
                    let Some(w) = q.wait.as_deref_mut() else {
                        // Invariant: `Some` while the state is Queued.
                        return Poll::Pending;
                    };
                    if !closed && w.poll_credits(&qp, cx).is_pending() {
                        return Poll::Pending;
                    }
                    if closed {
                        w.abandon(&qp);
                    }
                    let n = w.n;
                    let (Some(data), Some(mut w)) = (q.data.take(), q.wait.take()) else {
                        // Invariant: both are `Some` while the state is Queued.
                        return Poll::Pending;
                    };
                    if closed {
                        *this.state =
                            State::Ready(Some(Box::new(data.fail(SubmitError::Closed {
                                qp_num: qp.qp_num(),
                            }))));
                    } else {
                        // SAFETY: a `Queued` is only created by `submit`,
                        // whose caller vouched for the WRs and `data` under
                        // the `submit_*` contract; both were kept together
                        // since, and on success `data` moves into the op at
                        // once.
                        *this.state = match unsafe { qp.post(&mut w.wrs, n) } {
                            Ok(first) => State::InFlight(Op::posted(
                                qp.inner.handle.driver().ops.clone(),
                                first,
                                data,
                            )),
                            Err(e) => State::Ready(refused(Some(data), e)),
                        };
                    }
                    qp.recycle(w);
                }
            }
        }
    }
}
