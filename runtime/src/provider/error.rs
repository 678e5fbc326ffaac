//! Errors of the provider contract.

use std::io;

use super::types::{QpState, WcStatus};

/// Result type of provider calls.
pub type Result<T, E = ProviderError> = std::result::Result<T, E>;

/// An error from a provider (software device or libibverbs).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProviderError {
    /// No RDMA device (libibverbs missing, or it lists none).
    #[error("no RDMA device: {reason}")]
    NoDevice {
        /// Why none was found.
        reason: String,
    },
    /// A device with that name does not exist.
    #[error("no RDMA device named {name:?}")]
    DeviceNotFound {
        /// The requested name.
        name: String,
    },
    /// A verbs call failed.
    #[error("{call} failed")]
    Verbs {
        /// The libibverbs function, e.g. `"ibv_reg_mr"`.
        call: &'static str,
        /// errno as an io::Error.
        #[source]
        source: io::Error,
    },
    /// An argument was out of range for this device or object.
    #[error("invalid argument to {call}: {what}")]
    InvalidArgument {
        /// The contract call.
        call: &'static str,
        /// What was wrong.
        what: String,
    },
    /// A work queue is full (`ENOMEM` from `ibv_post_*`).
    #[error("{queue} queue of QP {qp_num} is full ({depth} WRs outstanding)")]
    QueueFull {
        /// QP number.
        qp_num: u32,
        /// `"send"` or `"receive"`.
        queue: &'static str,
        /// The queue's depth.
        depth: u32,
    },
    /// A QP transition or post not allowed in the QP's current state.
    #[error("QP {qp_num}: {op} not allowed in state {state:?}")]
    InvalidQpState {
        /// QP number.
        qp_num: u32,
        /// What was attempted.
        op: &'static str,
        /// The state the QP was in.
        state: QpState,
    },
    /// The CQ overflowed: completions were lost, the CQ is in error.
    #[error("completion queue {cq} overflowed (capacity {capacity}): completions were lost")]
    CqOverflow {
        /// CQ handle.
        cq: u32,
        /// Its capacity.
        capacity: u32,
    },
    /// The device context is gone (engine thread ended, device removed).
    #[error("device {device} is no longer usable: {reason}")]
    DeviceLost {
        /// Device name.
        device: String,
        /// Why.
        reason: String,
    },
    /// An operating-system call failed.
    #[error("{context}")]
    Io {
        /// What was being done.
        context: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The provider does not implement the feature.
    #[error("not supported by the {provider} provider: {what}")]
    Unsupported {
        /// Provider name.
        provider: &'static str,
        /// The missing feature.
        what: &'static str,
    },
}

/// A failed post list: the first `posted` WRs were accepted, the one at index
/// `posted` failed with `error`, the rest were not looked at (verbs `bad_wr`).
#[derive(Debug, thiserror::Error)]
#[error("post failed at work request {posted}")]
pub struct PostError {
    /// How many WRs of the list were posted.
    pub posted: usize,
    /// Why the next one was refused.
    #[source]
    pub error: ProviderError,
}

/// A completion that did not succeed, for callers that turn a status into an error.
#[derive(Debug, Clone, Copy, thiserror::Error, PartialEq, Eq)]
#[error("work request {wr_id:#x} on QP {qp_num} completed with {status}")]
pub struct CompletionError {
    /// The WR.
    pub wr_id: u64,
    /// Its QP.
    pub qp_num: u32,
    /// The failure status.
    pub status: WcStatus,
}
