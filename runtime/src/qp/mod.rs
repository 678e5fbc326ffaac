//! [`QueuePair`]: a runtime-level RC queue pair. It accounts for send-queue,
//! receive-queue and CQ capacity as entries, so a submission waits (a future)
//! when a queue is full instead of failing or overrunning it, and turns each
//! posted chain of work requests into an [`Op`](crate::op::Op) tracked by wr_id.
//!
//! # Writing a verb
//!
//! A verb is a type that owns what the device touches and implements
//! [`Completable`](crate::op::Completable), plus a function that calls [`QueuePair::submit_send`]
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

mod core;
mod datagram;
mod deferred;
#[cfg(test)]
mod deferred_tests;
mod inline;
mod inline_burst;
#[cfg(test)]
mod inline_tests;
mod lend;
#[cfg(test)]
mod lend_tests;
#[cfg(test)]
mod one_tests;
mod queue_pair;
mod recv_ring;
#[cfg(test)]
mod recv_ring_tests;
mod srq_ring;
mod submit;
#[cfg(test)]
mod submit_try_tests;
#[cfg(test)]
mod test_ops;
mod ud;
#[cfg(test)]
mod ud_tests;
mod window;

use smallvec::SmallVec;

use crate::provider::SendWr;

pub(crate) use self::core::QpCore;
pub use datagram::DatagramSource;
pub(crate) use inline::InlineFault;
pub use inline::{SendInline, DEFAULT_INLINE_SIGNAL_INTERVAL, MAX_INLINE_SIGNAL_INTERVAL};
pub use inline_burst::{Datagram, SendInlineBurst, MAX_INLINE_BURST};
pub use lend::{GatherChainVerb, GatherVerb, ScatterVerb};
pub use queue_pair::QueuePair;
pub use recv_ring::{NextMsg, RecvRing, RecvRingConfig, RecvRingError, RingMsg};
pub use srq_ring::SharedRecvQueue;
pub use submit::Submit;
pub(crate) use ud::UdState;
pub use ud::{UdEndpoint, UdPeer};
pub use window::{Bind, Invalidate, WindowVerb};

/// The WRs of one send op; up to four live inline (no allocation).
pub type SendChain = SmallVec<[SendWr; 4]>;
