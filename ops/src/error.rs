//! Errors of the verbs.

use verbio_runtime::buf::BufError;
use verbio_runtime::provider::WcStatus;
use verbio_runtime::SubmitError;

use crate::connect::HandshakeError;

/// Result type of `verbio-ops`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why a verb or a connection failed. Every variant names the verb (`op`)
/// and, where one exists, the queue pair and work request.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The work request completed with an error status.
    #[error("{op} on QP {qp_num}: work request {wr_id:#x} completed with {status} (vendor error {vendor_err:#x})")]
    Completion {
        /// The verb (`"send"`, `"read"`, ...).
        op: &'static str,
        /// Local QP number.
        qp_num: u32,
        /// The failing WR's id.
        wr_id: u64,
        /// The status (its verbs name is printed).
        status: WcStatus,
        /// Vendor syndrome (0 if none).
        vendor_err: u32,
    },
    /// A WR of a [`Batch`](crate::verbs::Batch) completed with an error status.
    #[error(
        "batch WR {index} ({op}) on QP {qp_num}: work request {wr_id:#x} completed with {status}"
    )]
    BatchCompletion {
        /// Position of the failing WR in the batch.
        index: usize,
        /// Its kind (`"write"`, `"send"`, ...).
        op: &'static str,
        /// Local QP number.
        qp_num: u32,
        /// The failing WR's id.
        wr_id: u64,
        /// The status.
        status: WcStatus,
    },
    /// The runtime could not post the op (QP closed, queue refused, ...).
    #[error("{op}: could not post")]
    Submit {
        /// The verb.
        op: &'static str,
        /// The runtime's error.
        #[source]
        source: SubmitError,
    },
    /// A local buffer cannot describe the request (too large for an SGE, ...).
    #[error("{op}: buffer refused")]
    Buf {
        /// The verb.
        op: &'static str,
        /// The buffer error.
        #[source]
        source: BufError,
    },
    /// A local buffer is too small for the request.
    #[error("{op}: local buffer of {have} bytes, {need} needed")]
    BufferTooSmall {
        /// The verb.
        op: &'static str,
        /// Bytes needed.
        need: usize,
        /// Bytes the buffer has.
        have: usize,
    },
    /// A range of a remote buffer does not fit it.
    #[error(
        "{op}: range {offset}+{len} is out of bounds for a remote buffer of {remote_len} bytes"
    )]
    RemoteOutOfBounds {
        /// The verb or accessor.
        op: &'static str,
        /// Requested start offset.
        offset: u64,
        /// Requested length.
        len: u64,
        /// The remote buffer's length.
        remote_len: u64,
    },
    /// An atomic's remote target is not 8 bytes at an 8-byte aligned address.
    #[error("{op}: remote target {addr:#x}+{len} must be 8 bytes at an 8-byte aligned address")]
    BadAtomicTarget {
        /// The verb.
        op: &'static str,
        /// Remote address.
        addr: u64,
        /// Remote length.
        len: u64,
    },
    /// A batch was empty or too long.
    #[error("batch: {what}")]
    InvalidBatch {
        /// What is wrong.
        what: &'static str,
    },
    /// Connection setup failed (for callers that mix `connect` and verbs with `?`).
    #[error("connection setup failed")]
    Handshake(#[from] HandshakeError),
}

impl Error {
    /// The completion status, if the error is a failed work completion.
    pub fn status(&self) -> Option<WcStatus> {
        match self {
            Error::Completion { status, .. } | Error::BatchCompletion { status, .. } => {
                Some(*status)
            }
            _ => None,
        }
    }

    /// True if the QP was closed or moved to ERR underneath the op (flushed
    /// completion or refused post on a closed QP).
    pub fn is_flush(&self) -> bool {
        matches!(
            self,
            Error::Completion {
                status: WcStatus::WrFlushErr,
                ..
            } | Error::BatchCompletion {
                status: WcStatus::WrFlushErr,
                ..
            } | Error::Submit {
                source: SubmitError::Closed { .. },
                ..
            }
        )
    }
}

/// Displays an error and every error in its `source()` chain, joined by
/// `": "`: the errors of this crate and of `verbio-runtime` keep their
/// sources out of their own `Display`, so each message appears once.
pub use verbio_runtime::ErrorChain;
