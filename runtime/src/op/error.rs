//! [`SubmitError`]: why an op could not be (fully) posted.

use crate::provider::{PostError, ProviderError};

/// Why an op could not be (fully) posted. The op's data comes back through
/// [`Completable::fail`](crate::op::Completable::fail).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SubmitError {
    /// The queue pair was closed (or dropped, or the runtime shut down).
    #[error("QP {qp_num} is closed")]
    Closed {
        /// QP number.
        qp_num: u32,
    },
    /// The chain is empty or longer than the queue can ever hold.
    #[error("QP {qp_num}: a chain of {len} WRs does not fit the {queue} queue (depth {depth})")]
    ChainLength {
        /// QP number.
        qp_num: u32,
        /// `"send"` or `"receive"`.
        queue: &'static str,
        /// WRs in the chain.
        len: usize,
        /// Queue depth.
        depth: u32,
    },
    /// A WR has more SGEs than the QP allows.
    #[error("QP {qp_num}: WR with {sges} SGEs, the {queue} queue allows {max}")]
    TooManySges {
        /// QP number.
        qp_num: u32,
        /// `"send"` or `"receive"`.
        queue: &'static str,
        /// SGEs in the WR.
        sges: usize,
        /// Allowed.
        max: u32,
    },
    /// The verb refused its own arguments while building the WRs.
    #[error("invalid request: {what}")]
    Invalid {
        /// What was wrong.
        what: String,
    },
    /// The provider refused the post. If part of a chain had been accepted,
    /// the QP was moved to ERR and this is reported once those WRs flushed.
    #[error("QP {qp_num}: post failed: {source}")]
    Post {
        /// QP number.
        qp_num: u32,
        /// The provider's error.
        #[source]
        source: PostError,
    },
    /// An earlier inline send of this QP posted without waiting
    /// ([`QueuePair::post_send_inline`](crate::QueuePair::post_send_inline))
    /// completed with an error; the QP is in ERR and refuses new work.
    #[error("QP {qp_num}: an earlier inline send (wr_id {wr_id:#x}) failed: {status}")]
    InlineSendFailed {
        /// QP number.
        qp_num: u32,
        /// wr_id of the failed WR.
        wr_id: u64,
        /// Its completion status.
        status: crate::provider::WcStatus,
        /// Vendor error code.
        vendor_err: u32,
    },
    /// The op's WR waited for the end of the poll phase to be posted with
    /// others in one list (see `QueuePair::submit_send`), and the provider
    /// refused an earlier WR of that list: this one was not posted.
    #[error("QP {qp_num}: work request {wr_id:#x} not posted: an earlier one of its post list was refused ({reason})")]
    PostBatchAborted {
        /// QP number.
        qp_num: u32,
        /// This op's WR.
        wr_id: u64,
        /// The refusal of the earlier WR.
        reason: String,
    },
    /// Too many ops in flight for the wr_id space.
    #[error("too many ops in flight (limit {limit})")]
    SlabFull {
        /// The limit.
        limit: usize,
    },
    /// A buffer could not name the memory for its work request.
    #[error("buffer refused: {0}")]
    Buf(#[from] crate::buf::BufError),
    /// A provider call around the post failed.
    #[error(transparent)]
    Provider(#[from] ProviderError),
}
