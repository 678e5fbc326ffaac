//! `impl From<AgentError> for std::io::Error`: code written against
//! `io::Result` (as async-rdma's API is) can use `?` on every [`Rdma`]
//! call. The kind follows the variant; the `AgentError` stays inside
//! (`io::Error::get_ref` / `into_inner` give it back, with its source chain).
//!
//! [`Rdma`]: super::Rdma

use std::io::{self, ErrorKind};

use verbio_runtime::buf::BufError;
use verbio_runtime::cm::CmError;
use verbio_runtime::provider::ProviderError;

use super::error::{AgentError, CloseReason};
use super::wire::RefuseCode;
use crate::connect::HandshakeError;

impl From<AgentError> for io::Error {
    fn from(e: AgentError) -> io::Error {
        io::Error::new(kind_of(&e), e)
    }
}

/// The `io::ErrorKind` that best names `e`.
pub(crate) fn kind_of(e: &AgentError) -> ErrorKind {
    match e {
        AgentError::Closed(reason) => close_kind(reason),
        AgentError::Handshake(h) => handshake_kind(h),
        AgentError::Device { source, .. } => provider_kind(source),
        AgentError::Runtime { .. } => ErrorKind::Other,
        AgentError::SharedReceiveRing(_) | AgentError::ReceiveRing(_) => ErrorKind::Other,
        AgentError::Verb(v) if v.is_flush() => ErrorKind::ConnectionAborted,
        AgentError::Verb(_) => ErrorKind::Other,
        AgentError::Buf { source, .. } => buf_kind(source),
        AgentError::MessageTooLarge { .. } => ErrorKind::InvalidInput,
        AgentError::Timeout { .. } => ErrorKind::TimedOut,
        AgentError::Refused { code, .. } => match code {
            RefuseCode::NoMemory => ErrorKind::OutOfMemory,
            RefuseCode::AccessDenied => ErrorKind::PermissionDenied,
            RefuseCode::BadLayout => ErrorKind::InvalidInput,
            _ => ErrorKind::Other,
        },
        AgentError::OutOfBounds { .. } => ErrorKind::InvalidInput,
        AgentError::Incompatible { .. } => ErrorKind::Unsupported,
        AgentError::SettingsExchange { source, .. } => source.kind(),
        AgentError::Config { .. } => ErrorKind::InvalidInput,
        AgentError::Cm { source, .. } => cm_kind(source),
    }
}

fn cm_kind(e: &CmError) -> ErrorKind {
    match e {
        CmError::Rejected { .. } => ErrorKind::ConnectionRefused,
        CmError::Disconnected { .. } => ErrorKind::ConnectionReset,
        CmError::Provider { source, .. } => provider_kind(source),
        CmError::Io { source, .. } => source.kind(),
        CmError::Unsupported { .. } => ErrorKind::Unsupported,
        CmError::PrivateDataTooLong { .. } => ErrorKind::InvalidInput,
        CmError::Protocol { .. } => ErrorKind::InvalidData,
        CmError::Event { .. } | CmError::OtherDevice { .. } => ErrorKind::Other,
    }
}

fn close_kind(r: &CloseReason) -> ErrorKind {
    match r {
        CloseReason::Malformed(_) | CloseReason::Violation(_) => ErrorKind::InvalidData,
        CloseReason::PeerError { .. } => ErrorKind::ConnectionAborted,
        CloseReason::Disconnected => ErrorKind::ConnectionReset,
        CloseReason::Transport(_) => ErrorKind::ConnectionAborted,
        CloseReason::Local => ErrorKind::NotConnected,
    }
}

fn handshake_kind(h: &HandshakeError) -> ErrorKind {
    match h {
        HandshakeError::Io { source, .. } => source.kind(),
        HandshakeError::Timeout { .. } => ErrorKind::TimedOut,
        HandshakeError::RejectedByPeer { .. } => ErrorKind::ConnectionRefused,
        HandshakeError::Provider { source, .. } => provider_kind(source),
        HandshakeError::ProviderMismatch { .. } | HandshakeError::UnsupportedVersion { .. } => {
            ErrorKind::Unsupported
        }
        HandshakeError::UnreachableEngine { .. } => ErrorKind::AddrNotAvailable,
        _ => ErrorKind::InvalidData,
    }
}

fn provider_kind(p: &ProviderError) -> ErrorKind {
    match p {
        ProviderError::NoDevice { .. } | ProviderError::DeviceNotFound { .. } => {
            ErrorKind::NotFound
        }
        ProviderError::Verbs { source, .. } | ProviderError::Io { source, .. } => source.kind(),
        ProviderError::MemlockLimit { .. } => ErrorKind::OutOfMemory,
        ProviderError::InvalidArgument { .. } => ErrorKind::InvalidInput,
        ProviderError::QueueFull { .. } => ErrorKind::WouldBlock,
        ProviderError::Unsupported { .. } => ErrorKind::Unsupported,
        _ => ErrorKind::Other,
    }
}

fn buf_kind(b: &BufError) -> ErrorKind {
    match b {
        BufError::Alloc { .. } => ErrorKind::OutOfMemory,
        BufError::Register { source, .. } => match provider_kind(source) {
            ErrorKind::Other => ErrorKind::OutOfMemory,
            k => k,
        },
        _ => ErrorKind::InvalidInput,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::wire::WireError;
    use std::time::Duration;

    fn kind(e: AgentError) -> (ErrorKind, io::Error) {
        let k = kind_of(&e);
        (k, io::Error::from(e))
    }

    #[test]
    fn each_variant_maps_to_a_fitting_kind_and_keeps_the_error() {
        let cases = [
            (
                AgentError::Closed(CloseReason::Disconnected),
                ErrorKind::ConnectionReset,
            ),
            (
                AgentError::Closed(CloseReason::Local),
                ErrorKind::NotConnected,
            ),
            (
                AgentError::Closed(CloseReason::Malformed(WireError::UnknownKind { kind: 1 })),
                ErrorKind::InvalidData,
            ),
            (
                AgentError::Timeout {
                    what: "memory request",
                    after: Duration::from_secs(1),
                },
                ErrorKind::TimedOut,
            ),
            (
                AgentError::MessageTooLarge { len: 2, max: 1 },
                ErrorKind::InvalidInput,
            ),
            (
                AgentError::Refused {
                    what: "memory request",
                    code: RefuseCode::AccessDenied,
                },
                ErrorKind::PermissionDenied,
            ),
            (
                AgentError::Refused {
                    what: "memory request",
                    code: RefuseCode::NoMemory,
                },
                ErrorKind::OutOfMemory,
            ),
            (
                AgentError::Handshake(HandshakeError::Io {
                    stage: "connecting over TCP",
                    source: io::Error::from(ErrorKind::ConnectionRefused),
                }),
                ErrorKind::ConnectionRefused,
            ),
            (
                AgentError::Handshake(HandshakeError::RejectedByPeer {
                    reason: "no".into(),
                }),
                ErrorKind::ConnectionRefused,
            ),
            (
                AgentError::Device {
                    stage: "opening the device",
                    source: ProviderError::DeviceNotFound {
                        name: "mlx5_9".into(),
                        known: "the devices here: mlx5_0".into(),
                    },
                },
                ErrorKind::NotFound,
            ),
            (
                AgentError::Config {
                    setting: "x",
                    reason: "y",
                },
                ErrorKind::InvalidInput,
            ),
        ];
        for (e, want) in cases {
            let text = e.to_string();
            let (k, io) = kind(e);
            assert_eq!(k, want, "{text}");
            assert_eq!(io.kind(), want, "{text}");
            let inner = io.get_ref().expect("the AgentError is kept");
            assert!(inner.is::<AgentError>(), "{text}");
            assert_eq!(inner.to_string(), text);
        }
    }
}
