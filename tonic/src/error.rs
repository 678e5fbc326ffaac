//! Why a connection or the listener failed.

use std::net::SocketAddr;

use http::Uri;
use verbio::HandleError;

/// Why [`RdmaConnector`](crate::RdmaConnector) could not connect.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The `Uri` names no host.
    #[error("{uri}: the address names no host")]
    NoHost {
        /// The address.
        uri: Uri,
    },
    /// The `Uri` names no port (verbio has no default port).
    #[error("{uri}: the address names no port")]
    NoPort {
        /// The address.
        uri: Uri,
    },
    /// The host name could not be resolved.
    #[error("{uri}: resolving the host failed")]
    Resolve {
        /// The address.
        uri: Uri,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The host name resolved to no address.
    #[error("{uri}: the host has no address")]
    NoAddress {
        /// The address.
        uri: Uri,
    },
    /// The verbio connection failed.
    #[error("connecting to {addr} over verbio failed")]
    Connect {
        /// The address dialled.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: HandleError,
    },
}

/// Why [`RdmaIncoming`](crate::RdmaIncoming) yielded an error: one client
/// failed (the stream goes on), or the listener is gone (the stream ends
/// after this item).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AcceptError {
    /// A client failed its handshake: that client only.
    #[error("accepting a client on {listener} failed")]
    Client {
        /// The listener's address.
        listener: SocketAddr,
        /// Why.
        #[source]
        source: HandleError,
    },
    /// The listener is gone (its pool thread ended or the pool shut
    /// down): no more connections come.
    #[error("the listener on {listener} is gone")]
    Listener {
        /// The listener's address.
        listener: SocketAddr,
        /// Why.
        #[source]
        source: HandleError,
    },
}
