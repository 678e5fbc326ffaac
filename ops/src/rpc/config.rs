//! The engine's settings.

use std::time::Duration;

/// Settings of an [`Rpc`](super::Rpc) endpoint.
#[derive(Clone, Debug)]
pub struct RpcConfig {
    /// Retransmission timeout: a request slot that made no progress for this
    /// long (up to a third more: the timer ticks three times per timeout)
    /// resends its unanswered packets.
    pub rto: Duration,
    /// Retransmissions without progress before the call (and its session)
    /// fails with [`RpcError::Timeout`](super::RpcError::Timeout); connects
    /// fail after as many. A dead peer is detected within about
    /// `rto * (max_retries + 1)`.
    pub max_retries: u32,
    /// Largest request or response, in bytes (at most 16 MiB).
    pub max_msg_len: usize,
    /// Tasks per registered request type that run its handler (requests
    /// beyond that wait in a queue).
    pub handler_tasks: usize,
    /// Packets taken from the transport per receive call.
    pub recv_batch: usize,
    /// Server: a session that has heard nothing from its client for this
    /// long (up to a quarter more), with no handler of it running, is
    /// closed, its memory freed, and the client told (best effort: one
    /// disconnect packet; its next call fails with
    /// [`RpcError::SessionClosed`](super::RpcError::SessionClosed), or with
    /// a timeout if that packet was lost). This reclaims the sessions of
    /// clients that vanished without disconnecting. `None` (the default,
    /// as gRPC's idle limit) keeps sessions until their client disconnects.
    pub session_idle_timeout: Option<Duration>,
}

impl Default for RpcConfig {
    fn default() -> Self {
        RpcConfig {
            rto: Duration::from_millis(20),
            max_retries: 5,
            max_msg_len: 1 << 20,
            handler_tasks: 16,
            recv_batch: 16,
            session_idle_timeout: None,
        }
    }
}
