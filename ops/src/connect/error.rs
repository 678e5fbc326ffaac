//! Errors of connection setup.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use verbio_runtime::provider::{ProviderError, ProviderKind};

/// Why a connection handshake failed. Every malformed, truncated or
/// mismatched frame from a peer maps to one of these; decoding never panics.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    /// The frame does not start with the verbio magic (not a verbio peer).
    #[error("bad magic: expected {expected:02x?}, got {got:02x?}")]
    BadMagic {
        /// What was expected.
        expected: [u8; 6],
        /// The first bytes received (up to 6).
        got: Vec<u8>,
    },
    /// The peer speaks a major version this build does not.
    #[error("unsupported handshake version {got} (this side supports {supported})")]
    UnsupportedVersion {
        /// The peer's major version.
        got: u16,
        /// Ours.
        supported: u16,
    },
    /// Fewer bytes than the frame needs (short buffer, or the peer closed the
    /// connection mid-frame).
    #[error("truncated frame: needed {needed} bytes, got {got}")]
    Truncated {
        /// Bytes the frame needs.
        needed: usize,
        /// Bytes available.
        got: usize,
    },
    /// The two sides run different providers (soft device vs hardware).
    #[error("provider mismatch: local {local}, remote {remote}")]
    ProviderMismatch {
        /// Our provider.
        local: ProviderKind,
        /// The peer's.
        remote: ProviderKind,
    },
    /// A field has a value that is out of range or inconsistent.
    #[error("invalid field {field} = {value:#x}: {reason}")]
    InvalidField {
        /// Field name.
        field: &'static str,
        /// Its raw value (truncated to 64 bits).
        value: u64,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A well-formed frame of the wrong kind for this step.
    #[error("unexpected {got} frame while waiting for {expected}")]
    UnexpectedFrame {
        /// The kind we waited for.
        expected: &'static str,
        /// The kind we got.
        got: &'static str,
    },
    /// The peer refused our hello and said why.
    #[error("rejected by peer: {reason}")]
    RejectedByPeer {
        /// The peer's reason (lossy UTF-8, bounded).
        reason: String,
    },
    /// A software-device engine bound to a loopback address on one host, and
    /// the other side on another host: the QPs could never reach each
    /// other. Refused at the handshake on both sides (the side that finds it
    /// sends the text as its `reject`).
    #[error(
        "the software-device engine of the host at {host} listens on {engine}, a loopback \
         address the other host cannot reach: bind that host's soft device to a routable \
         address (SoftConfig::bind)"
    )]
    UnreachableEngine {
        /// The loopback engine address announced in the hello.
        engine: SocketAddr,
        /// The address of the host that announced it, as the other side sees it.
        host: IpAddr,
    },
    /// The handshake did not finish in time.
    #[error("handshake timed out after {after:?} while {stage}")]
    Timeout {
        /// What was being waited for.
        stage: &'static str,
        /// The limit.
        after: Duration,
    },
    /// A socket operation failed.
    #[error("I/O error while {stage}")]
    Io {
        /// What was being done.
        stage: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Setting up the local queue pair failed.
    #[error("queue-pair setup failed while {stage}")]
    Provider {
        /// What was being done.
        stage: &'static str,
        /// The provider's error.
        #[source]
        source: ProviderError,
    },
}

impl HandshakeError {
    /// What `map_err` makes of an I/O error while `stage`.
    pub(crate) fn io(stage: &'static str) -> impl FnOnce(io::Error) -> HandshakeError {
        move |source| HandshakeError::Io { stage, source }
    }
}
