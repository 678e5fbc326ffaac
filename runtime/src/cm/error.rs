//! [`CmError`]: why a connection-manager step failed.

use std::net::SocketAddr;

use crate::provider::{ProviderError, ProviderKind};

use super::DisconnectReason;

/// A failed connection-manager step, with the step and the address it
/// concerned.
#[derive(Debug, thiserror::Error)]
pub enum CmError {
    /// This provider has no connection manager.
    #[error("RDMA CM is not available on the {provider} provider")]
    Unsupported {
        /// The device's provider.
        provider: ProviderKind,
    },
    /// A provider call of `step` failed.
    #[error("RDMA CM: {step}")]
    Provider {
        /// What was being done.
        step: &'static str,
        /// The provider's error.
        #[source]
        source: ProviderError,
    },
    /// An I/O step (reactor registration, the soft device's side channel).
    #[error("RDMA CM: {step}")]
    Io {
        /// What was being done.
        step: &'static str,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The connection manager reported `event` where `step` expected
    /// success (address or route resolution, connection set-up).
    #[error("RDMA CM: {step} with {addr:?} failed: event {event}, status {status}")]
    Event {
        /// What was being done.
        step: &'static str,
        /// The peer's address, if known.
        addr: Option<SocketAddr>,
        /// The event's name (e.g. `ADDR_ERROR`, `UNREACHABLE`).
        event: String,
        /// The event's status (a negative errno, or the CM's reason).
        status: i32,
    },
    /// The peer refused the connection (no listener on that address and
    /// port, or the application rejected it).
    #[error("RDMA CM: connection to {addr:?} refused by the peer (reason {status}, {} bytes of private data)", private_data.len())]
    Rejected {
        /// The peer's address.
        addr: Option<SocketAddr>,
        /// The reject reason, as InfiniBand CM numbers them
        /// ([`reject`](super::reject)): 8 = invalid service ID (nobody
        /// listens there), 28 = consumer reject (the application refused);
        /// the software device's listener also answers 3 (no resources),
        /// 5 (malformed or unsupported request), 12 (unusable address) and
        /// 26 (invalid MTU).
        status: i32,
        /// The private data of the reject.
        private_data: Vec<u8>,
    },
    /// The CM resolved the address to another device than the one the
    /// queue pair would be on.
    #[error("RDMA CM: {addr:?} is reached through device {cm_device}, the queue pair would be on {device}")]
    OtherDevice {
        /// The address.
        addr: Option<SocketAddr>,
        /// The device the CM picked.
        cm_device: String,
        /// The runtime device.
        device: String,
    },
    /// Private data longer than the step carries.
    #[error("RDMA CM: {len} bytes of private data for {step}, at most {max}")]
    PrivateDataTooLong {
        /// The step (connect, accept, reject).
        step: &'static str,
        /// Bytes given.
        len: usize,
        /// Bytes the step carries.
        max: usize,
    },
    /// The peer sent something that is not this connection manager's
    /// protocol (soft device side channel).
    #[error("RDMA CM: protocol error from {addr:?}: {what}")]
    Protocol {
        /// The peer.
        addr: Option<SocketAddr>,
        /// What was wrong.
        what: String,
    },
    /// The connection is down.
    #[error("RDMA CM: the connection is down ({reason})")]
    Disconnected {
        /// Who ended it.
        reason: DisconnectReason,
    },
}

impl CmError {
    pub(crate) fn provider(step: &'static str) -> impl FnOnce(ProviderError) -> CmError {
        move |source| CmError::Provider { step, source }
    }

    pub(crate) fn io(step: &'static str) -> impl FnOnce(std::io::Error) -> CmError {
        move |source| CmError::Io { step, source }
    }
}
