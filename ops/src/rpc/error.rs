//! The engine's errors.

use std::fmt;

use thiserror::Error;

use super::header::Status;
use super::transport::TransportError;

/// A session of an [`Rpc`](super::Rpc) endpoint: its local number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionId(pub(crate) u32);

impl SessionId {
    /// The session number (as packets carry it).
    pub fn number(self) -> u32 {
        self.0
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "session {}", self.0)
    }
}

/// Why a call, a connect, a session or a registration failed.
#[derive(Debug, Error)]
pub enum RpcError {
    /// The peer stopped answering: the request was sent `retries + 1` times
    /// without progress. The session fails with it.
    #[error("{session}: request {req_num} got no answer after {retries} retransmissions: the peer stopped answering")]
    Timeout {
        /// The session.
        session: SessionId,
        /// The request number.
        req_num: u64,
        /// Retransmissions made.
        retries: u32,
    },
    /// An earlier call timed out and failed the session.
    #[error("{session} failed: the peer stopped answering")]
    SessionFailed {
        /// The session.
        session: SessionId,
    },
    /// The session was disconnected (by either side) or never existed.
    #[error("{session} is closed")]
    SessionClosed {
        /// The session.
        session: SessionId,
    },
    /// The server did not answer the connect packet.
    #[error("connect ({session}) got no answer after {retries} retransmissions")]
    ConnectTimeout {
        /// The half-open session.
        session: SessionId,
        /// Retransmissions made.
        retries: u32,
    },
    /// The endpoint has as many sessions open as it can number.
    #[error("this endpoint has {max} sessions open, the most it can have")]
    TooManySessions {
        /// The limit.
        max: usize,
    },
    /// A request larger than the endpoint's limit.
    #[error("request of {len} bytes exceeds the limit of {max} bytes")]
    RequestTooLarge {
        /// Its length.
        len: usize,
        /// [`RpcConfig::max_msg_len`](super::RpcConfig::max_msg_len).
        max: usize,
    },
    /// The server's response is larger than this endpoint's limit.
    #[error(
        "{session}: the response to request {req_num} is {len} bytes, over the limit of {max}"
    )]
    ResponseTooLarge {
        /// The session.
        session: SessionId,
        /// The request number.
        req_num: u64,
        /// Its length.
        len: usize,
        /// [`RpcConfig::max_msg_len`](super::RpcConfig::max_msg_len).
        max: usize,
    },
    /// The server answered with an error instead of a response.
    #[error("{session}: request {req_num} (type {req_type}) failed at the server: {status}")]
    Remote {
        /// The session.
        session: SessionId,
        /// The request number.
        req_num: u64,
        /// The request type.
        req_type: u8,
        /// What went wrong there.
        status: Status,
    },
    /// [`Rpc::register`](super::Rpc::register) for a request type that has
    /// a handler already.
    #[error("request type {req_type} has a handler already")]
    HandlerExists {
        /// The request type.
        req_type: u8,
    },
    /// The transport refused the peer's address.
    #[error("connect failed")]
    Transport(#[from] TransportError),
}
