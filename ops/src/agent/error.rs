//! Errors of the high-level [`Rdma`](super::Rdma) connection.

use std::time::Duration;

use verbio_runtime::buf::BufError;
use verbio_runtime::provider::ProviderError;

use super::wire::WireError;
use crate::connect::HandshakeError;

/// Why a connection stopped working. Cloned into every call pending on it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CloseReason {
    /// The peer sent a frame the codec refuses.
    #[error("protocol error")]
    Malformed(#[from] WireError),
    /// The peer sent a well-formed message that breaks the protocol.
    #[error("protocol violation: {0}")]
    Violation(&'static str),
    /// The peer reported an error and closed.
    #[error("peer reported error {code}: {text}")]
    PeerError {
        /// The peer's code.
        code: u16,
        /// The peer's text.
        text: String,
    },
    /// The peer closed the connection (orderly or not).
    #[error("peer disconnected")]
    Disconnected,
    /// A receive on the connection's queue pair failed.
    #[error("transport failure: {0}")]
    Transport(String),
    /// This side was dropped.
    #[error("connection closed locally")]
    Local,
}

impl CloseReason {
    /// True for the reasons caused by bad peer input.
    pub fn is_protocol(&self) -> bool {
        matches!(self, CloseReason::Malformed(_) | CloseReason::Violation(_))
    }
}

/// Why an [`Rdma`](super::Rdma) call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AgentError {
    /// The connection is down (see the reason).
    #[error("connection down")]
    Closed(#[from] CloseReason),
    /// Setting up the connection failed.
    #[error("connection setup")]
    Handshake(#[from] HandshakeError),
    /// The device could not be opened or configured.
    #[error("{stage}")]
    Device {
        /// What was being done.
        stage: &'static str,
        /// The provider's error.
        #[source]
        source: ProviderError,
    },
    /// The runtime refused the device.
    #[error("{stage}")]
    Runtime {
        /// What was being done.
        stage: &'static str,
        /// The runtime's error.
        #[source]
        source: verbio_runtime::RuntimeError,
    },
    /// A verb failed.
    #[error(transparent)]
    Verb(#[from] crate::Error),
    /// The connection's receive ring could not be made.
    #[error("setting up the connection's receive ring")]
    ReceiveRing(#[source] verbio_runtime::RecvRingError),
    /// The listener's shared receive ring could not be made.
    #[error("setting up the shared receive ring")]
    SharedReceiveRing(#[source] verbio_runtime::RecvRingError),
    /// A registered buffer could not be allocated.
    #[error("{stage}")]
    Buf {
        /// What was being done.
        stage: &'static str,
        /// The buffer error.
        #[source]
        source: BufError,
    },
    /// A message beyond the configured maximum length.
    #[error("message of {len} bytes exceeds the maximum of {max}")]
    MessageTooLarge {
        /// The message length.
        len: usize,
        /// The configured maximum.
        max: usize,
    },
    /// The peer did not answer in time.
    #[error("{what}: no answer within {after:?}")]
    Timeout {
        /// The request.
        what: &'static str,
        /// The limit.
        after: Duration,
    },
    /// The peer refused a request.
    #[error("{what} refused by the peer: {code:?}")]
    Refused {
        /// The request.
        what: &'static str,
        /// The peer's reason.
        code: super::wire::RefuseCode,
    },
    /// A transfer does not fit the memory region.
    #[error("{what}: {need} bytes do not fit in {have}")]
    OutOfBounds {
        /// The operation.
        what: &'static str,
        /// Bytes needed.
        need: u64,
        /// Bytes available.
        have: u64,
    },
    /// The two sides' agent settings cannot work together; both sides
    /// refuse the connection with the same error when it starts.
    #[error("incompatible agent setting {setting} (this side {local}, peer {peer}): {reason}")]
    Incompatible {
        /// The setting.
        setting: &'static str,
        /// This side's value (or what this side needs).
        local: u64,
        /// The peer's value (or what the peer needs).
        peer: u64,
        /// What is wrong, and what to change.
        reason: &'static str,
    },
    /// The agent settings exchange on the TCP side channel failed.
    #[error("agent settings exchange: {stage}")]
    SettingsExchange {
        /// What was being done.
        stage: &'static str,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A connection manager step failed (`connect_cm`, `listen_cm`).
    #[error("{stage}")]
    Cm {
        /// What was being done.
        stage: &'static str,
        /// The connection manager's error.
        #[source]
        source: verbio_runtime::cm::CmError,
    },
    /// A setting of the builder is out of range.
    #[error("invalid setting {setting}: {reason}")]
    Config {
        /// The setting.
        setting: &'static str,
        /// What is wrong.
        reason: &'static str,
    },
}

impl AgentError {
    /// The close reason, if the call failed because the connection is down.
    pub fn close_reason(&self) -> Option<&CloseReason> {
        match self {
            AgentError::Closed(r) => Some(r),
            _ => None,
        }
    }
}
