//! Checks for the handshake's two roles ([`crate::connect::accept_exchange`],
//! [`crate::connect::connect_exchange`]) against arbitrary peer bytes: the
//! streaming frame reader and the state machine above the frame codec.

use std::cell::Cell;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::executor::block_on;
use futures::io::{AsyncRead, AsyncWrite};
use verbio_runtime::provider::{Endpoint, Gid, Mtu, ProviderKind};

use super::{display, LenField, Seed};
use crate::connect::handshake::{self as hs, Frame, Hello, HEADER_LEN};
use crate::connect::{accept_exchange, connect_exchange, Deadline, HandshakeError};

/// The first frame's body length (the handshake header's).
pub const LEN_FIELD: LenField = super::handshake::LEN_FIELD;

/// Failures injected into a run, chosen by the input's length so that every
/// input maps to one deterministic run.
#[derive(Clone, Copy)]
struct Faults {
    /// Every fourth read fails with `Interrupted` (to be retried).
    interrupt: bool,
    /// Reading past the input fails with `ConnectionReset` instead of EOF.
    reset_at_eof: bool,
    /// The QP setup / connect callback fails.
    fail_setup: bool,
}

impl Faults {
    fn for_input(data: &[u8]) -> Faults {
        let n = data.len();
        Faults {
            interrupt: n % 4 == 1,
            reset_at_eof: n % 16 == 14,
            fail_setup: n % 16 == 15,
        }
    }
}

/// An in-memory peer: reads hand out `input` in varying chunk sizes (so
/// frames arrive split at every kind of boundary), writes are collected.
struct Peer<'a> {
    input: &'a [u8],
    reads: usize,
    faults: Faults,
    written: Vec<u8>,
}

impl<'a> Peer<'a> {
    fn new(input: &'a [u8], faults: Faults) -> Peer<'a> {
        Peer {
            input,
            reads: 0,
            faults,
            written: Vec::new(),
        }
    }
}

impl AsyncRead for Peer<'_> {
    fn poll_read(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        const CHUNKS: [usize; 5] = [1, 11, 3, 64, 1024];
        let this = self.get_mut();
        this.reads += 1;
        if this.faults.interrupt && this.reads % 4 == 0 {
            return Poll::Ready(Err(io::ErrorKind::Interrupted.into()));
        }
        if this.faults.reset_at_eof && this.input.is_empty() && !buf.is_empty() {
            return Poll::Ready(Err(io::ErrorKind::ConnectionReset.into()));
        }
        let n = buf
            .len()
            .min(this.input.len())
            .min(CHUNKS[this.reads % CHUNKS.len()]);
        buf[..n].copy_from_slice(&this.input[..n]);
        this.input = &this.input[n..];
        Poll::Ready(Ok(n))
    }
}

impl AsyncWrite for Peer<'_> {
    fn poll_write(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().written.extend_from_slice(buf);
        Poll::Ready(Ok(buf.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_close(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

fn deadline() -> Deadline<futures::future::Pending<()>> {
    Deadline {
        timer: futures::future::pending(),
        after: Duration::from_secs(1),
    }
}

fn local(qpn: u32) -> Endpoint {
    Endpoint {
        provider: ProviderKind::Soft,
        qpn,
        psn: 0x00_0100,
        lid: 0,
        gid: Gid::default(),
        mtu: Mtu::Mtu4096,
        addr: std::net::SocketAddr::from(([127, 0, 0, 1], 4791)).into(),
    }
}

/// The frame at the start of `data`, with its length, if one decodes there.
fn first_frame(data: &[u8]) -> Option<(Frame, usize)> {
    let len = HEADER_LEN + hs::parse_header(data).ok()?;
    let frame = hs::decode_frame(data.get(..len)?).ok()?;
    Some((frame, len))
}

/// Everything a role wrote must be a sequence of whole, valid frames.
fn frames_written(written: &[u8]) -> Vec<Frame> {
    let mut rest = written;
    let mut frames = Vec::new();
    while !rest.is_empty() {
        match first_frame(rest) {
            Some((frame, len)) => {
                frames.push(frame);
                rest = &rest[len..];
            }
            None => panic!("the exchange wrote a malformed frame: {rest:02x?}"),
        }
    }
    frames
}

/// Runs the server role, then the client role, with `data` as everything the
/// peer sends (and, depending on its length, interrupted reads, a reset
/// connection or a failing QP setup). Neither may panic or hang; what they
/// write must be valid frames; success must mean `data` held exactly the
/// frames the protocol requires; a failed setup must be told to the peer. Returns whether `data` starts with a valid frame.
///
/// # Panics
///
/// On any violated property (that is the point).
pub fn check(data: &[u8]) -> bool {
    let first = first_frame(data);
    let second = first
        .as_ref()
        .and_then(|(_, len)| first_frame(&data[*len..]).map(|(f, _)| f));
    let soft_hello = match &first {
        Some((Frame::Hello(h), _)) if h.endpoint.provider == ProviderKind::Soft => Some(h.endpoint),
        _ => None,
    };
    let faults = Faults::for_input(data);
    let refused = || HandshakeError::InvalidField {
        field: "fuzz",
        value: 0,
        reason: "injected setup failure",
    };

    // Server: the peer's hello, our hello, the peer's ready.
    let mut peer = Peer::new(data, faults);
    let setup_saw = Cell::new(None);
    let server = block_on(accept_exchange(
        &mut peer,
        ProviderKind::Soft,
        |remote| {
            setup_saw.set(Some(*remote));
            if faults.fail_setup {
                return Err(refused());
            }
            Ok((local(0x22), *remote))
        },
        deadline(),
    ));
    assert_eq!(setup_saw.get(), soft_hello, "server setup ran on {first:?}");
    let wrote = frames_written(&peer.written);
    match server {
        Ok((remote, echoed)) => {
            assert!(!faults.fail_setup, "server succeeded although setup failed");
            assert_eq!(Some(remote), soft_hello);
            assert_eq!(echoed, remote);
            assert_eq!(second, Some(Frame::Ready), "server accepted without ready");
            assert_eq!(wrote, [Frame::Hello(Hello::new(local(0x22)))]);
        }
        Err(e) => {
            display(&e);
            if faults.fail_setup && soft_hello.is_some() {
                // The peer is told why.
                assert!(matches!(
                    e,
                    HandshakeError::InvalidField { field: "fuzz", .. }
                ));
                assert!(matches!(wrote.as_slice(), [Frame::Reject(_)]), "{wrote:?}");
            }
            if let HandshakeError::RejectedByPeer { reason } = &e {
                // Instead of its hello, or instead of its ready.
                let reject = Frame::Reject(reason.clone());
                let at = match &first {
                    Some((Frame::Reject(_), _)) => first.as_ref().map(|(f, _)| f),
                    _ => second.as_ref(),
                };
                assert_eq!(at, Some(&reject), "server: reject from nowhere");
            }
        }
    }

    // Client: our hello, the peer's hello, our ready.
    let mut peer = Peer::new(data, faults);
    let connect_saw = Cell::new(None);
    let client = block_on(connect_exchange(
        &mut peer,
        &local(0x11),
        |remote| {
            connect_saw.set(Some(*remote));
            if faults.fail_setup {
                return Err(refused());
            }
            Ok(())
        },
        deadline(),
    ));
    assert_eq!(
        connect_saw.get(),
        soft_hello,
        "client connect ran on {first:?}"
    );
    let wrote = frames_written(&peer.written);
    assert_eq!(wrote.first(), Some(&Frame::Hello(Hello::new(local(0x11)))));
    match client {
        Ok(remote) => {
            assert!(
                !faults.fail_setup,
                "client succeeded although connect failed"
            );
            assert_eq!(Some(remote), soft_hello);
            assert_eq!(wrote[1..], [Frame::Ready]);
        }
        Err(e) => {
            display(&e);
            if faults.fail_setup && soft_hello.is_some() {
                assert!(matches!(
                    e,
                    HandshakeError::InvalidField { field: "fuzz", .. }
                ));
                assert!(matches!(wrote[1..], [Frame::Reject(_)]), "{wrote:?}");
            }
            if let HandshakeError::RejectedByPeer { reason } = &e {
                assert_eq!(
                    first.as_ref().map(|(f, _)| f),
                    Some(&Frame::Reject(reason.clone()))
                );
            }
            assert!(
                !wrote[1..].contains(&Frame::Ready),
                "client failed after sending ready: {e}"
            );
        }
    }
    first.is_some()
}

/// What a peer may send: hello + ready (both roles succeed), hello + reject,
/// a lone reject, a hello of the other provider.
pub fn seeds() -> Vec<Seed> {
    let hello = |ep: Endpoint| -> Vec<u8> {
        // Invariant: the endpoints below pass `validate`.
        hs::encode(&Hello::new(ep)).expect("seed hello").to_vec()
    };
    let mut peer = local(0x33);
    peer.addr = "[::1]:7000"
        .parse::<std::net::SocketAddr>()
        .expect("literal")
        .into();
    let mut ibverbs = local(0x44);
    ibverbs.provider = ProviderKind::Ibverbs;
    ibverbs.addr = verbio_runtime::provider::ProviderAddr::NONE;
    ibverbs.lid = 1;
    let cat = |a: Vec<u8>, b: &[u8]| [a.as_slice(), b].concat();
    vec![
        Seed::new("hello-ready", cat(hello(local(0x33)), &hs::encode_ready())),
        Seed::new("hello-v6-ready", cat(hello(peer), &hs::encode_ready())),
        Seed::new(
            "hello-reject",
            cat(hello(local(0x33)), &hs::encode_reject("QP setup failed")),
        ),
        Seed::new("reject", hs::encode_reject("provider mismatch")),
        Seed::new("hello-ibverbs", hello(ibverbs)),
    ]
}
