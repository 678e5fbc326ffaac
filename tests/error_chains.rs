//! Error reports print each message once: the errors keep their source out
//! of their own `Display` and expose it through `source()`, so walking the
//! chain (as `ErrorChain`, anyhow or eyre do) never repeats a message.

use std::error::Error as StdError;
use std::io;

use verbio::ops::agent::wire::WireError;
use verbio::ops::connect::HandshakeError;
use verbio::ops::{AgentError, CloseReason, Error, ErrorChain};
use verbio::provider::{PostError, ProviderError};
use verbio::runtime::buf::BufError;

/// The messages of `e`'s chain, outermost first.
fn chain(e: &(dyn StdError + 'static)) -> Vec<String> {
    let mut out = vec![e.to_string()];
    let mut next = e.source();
    while let Some(s) = next {
        out.push(s.to_string());
        next = s.source();
    }
    out
}

/// Fails if a message contains a later one (its source printed inline).
fn assert_no_repeats(e: &(dyn StdError + 'static), depth: usize) {
    let msgs = chain(e);
    assert_eq!(msgs.len(), depth, "chain of {e:?}: {msgs:?}");
    for (i, outer) in msgs.iter().enumerate() {
        for inner in &msgs[i + 1..] {
            assert!(
                !outer.contains(inner.as_str()),
                "{outer:?} repeats its source {inner:?} (chain {msgs:?})"
            );
        }
    }
    let report = ErrorChain(e).to_string();
    assert_eq!(report, msgs.join(": "));
}

fn enomem() -> io::Error {
    io::Error::from_raw_os_error(libc::ENOMEM)
}

#[test]
fn provider_and_buffer_errors_name_their_source_once() {
    let verbs = ProviderError::Verbs {
        call: "ibv_reg_mr",
        source: enomem(),
    };
    assert_no_repeats(&verbs, 2);
    let reg = BufError::Register {
        what: "pool chunk",
        len: 4096,
        source: ProviderError::Io {
            context: "mmap",
            source: enomem(),
        },
    };
    assert_no_repeats(&reg, 3);
    let post = PostError {
        posted: 2,
        error: ProviderError::Io {
            context: "doorbell",
            source: io::Error::other("pipe closed"),
        },
    };
    assert_no_repeats(&post, 3);
}

#[test]
fn agent_errors_name_their_source_once() {
    let device = AgentError::Device {
        stage: "opening the device",
        source: ProviderError::Verbs {
            call: "ibv_open_device",
            source: io::Error::from_raw_os_error(libc::ENODEV),
        },
    };
    assert_no_repeats(&device, 3);
    let malformed = AgentError::Closed(CloseReason::Malformed(WireError::UnknownKind { kind: 99 }));
    assert_no_repeats(&malformed, 3);
    let setup = AgentError::Handshake(HandshakeError::Io {
        stage: "connecting over TCP",
        source: io::Error::from(io::ErrorKind::ConnectionRefused),
    });
    assert_no_repeats(&setup, 3);
    let settings = AgentError::SettingsExchange {
        stage: "reading the peer's settings",
        source: io::Error::from(io::ErrorKind::UnexpectedEof),
    };
    assert_no_repeats(&settings, 2);
    let buf = AgentError::Buf {
        stage: "allocating a send buffer",
        source: BufError::Register {
            what: "pool chunk",
            len: 1 << 20,
            source: ProviderError::Verbs {
                call: "ibv_reg_mr",
                source: enomem(),
            },
        },
    };
    assert_no_repeats(&buf, 4);
    let report = ErrorChain(&buf).to_string();
    assert!(
        report.starts_with("allocating a send buffer: pool chunk: registering 1048576 bytes failed: ibv_reg_mr failed"),
        "{report}"
    );
}

#[test]
fn verb_errors_name_their_source_once() {
    let setup = Error::Handshake(HandshakeError::Provider {
        stage: "creating the QP",
        source: ProviderError::Io {
            context: "engine socket",
            source: io::Error::from(io::ErrorKind::AddrInUse),
        },
    });
    assert_no_repeats(&setup, 4);
    let buf = Error::Buf {
        op: "send",
        source: BufError::TooLarge {
            what: "sge",
            len: 1 << 33,
            max: u32::MAX as usize,
        },
    };
    assert_no_repeats(&buf, 2);
}

/// Compiles only if `T` can cross threads and be boxed into
/// `Box<dyn Error + Send + Sync>` (what anyhow and `?` on tokio's
/// multi-thread runtime need).
fn assert_send_sync_error<T: StdError + Send + Sync + 'static>() {}

/// Every public error type of verbio crosses threads: a caller on another
/// thread (a tokio task, a pool handle's user) can `?` it into
/// `Box<dyn Error + Send + Sync>` or anyhow. A cause boxed as a plain
/// `Box<dyn Error>` (not `Send`) fails this at compile time.
#[test]
fn public_errors_are_send_sync_static() {
    assert_send_sync_error::<verbio::rpc::RpcError>();
    assert_send_sync_error::<verbio::rpc::TransportError>();
    assert_send_sync_error::<verbio::rpc::header::HeaderError>();
    assert_send_sync_error::<verbio::rpc::ParseRpcAddrError>();
    assert_send_sync_error::<verbio::HandleError>();
    assert_send_sync_error::<AgentError>();
    assert_send_sync_error::<CloseReason>();
    assert_send_sync_error::<WireError>();
    assert_send_sync_error::<HandshakeError>();
    assert_send_sync_error::<Error>();
    assert_send_sync_error::<ProviderError>();
    assert_send_sync_error::<PostError>();
    assert_send_sync_error::<verbio::provider::CompletionError>();
    assert_send_sync_error::<BufError>();
    assert_send_sync_error::<verbio::runtime::SubmitError>();
    assert_send_sync_error::<verbio::runtime::PoolError>();
    assert_send_sync_error::<verbio::runtime::RecvRingError>();
    assert_send_sync_error::<verbio::runtime::RuntimeError>();
    assert_send_sync_error::<verbio::runtime::JoinError>();
    assert_send_sync_error::<verbio::runtime::Elapsed>();
    assert_send_sync_error::<verbio::runtime::reactor::PendingRefusal>();
    assert_send_sync_error::<verbio::runtime::cm::CmError>();
    assert_send_sync_error::<verbio::runtime::pool::Lost>();
}
