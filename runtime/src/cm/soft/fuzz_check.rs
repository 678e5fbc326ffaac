//! The property check of the software CM's frame codec, for the fuzz target
//! `fuzz/fuzz_targets/cm_frame.rs` and `tests/fuzz_replay.rs` (through
//! `verbio_ops::fuzz_checks::cm_frame`). It lives here because the codec is
//! private to the connection manager. Compiled only with the `fuzzing`
//! feature; a failed property panics, so none of this is for production
//! paths.

use std::net::SocketAddr;

use super::listener::check_request;
use super::wire::{self, Frame, Hello, HEADER_LEN};
use crate::provider::{Endpoint, Gid, Mtu, ProviderAddr, ProviderKind};

/// Offset of the low byte of the header's body length (a big-endian `u16`
/// at offsets 6..8): a fuzzer's length repair writes this byte.
#[doc(hidden)]
pub const CM_FRAME_LEN_LOW_BYTE: usize = 7;
/// Bytes of the frame header (before the counted body).
#[doc(hidden)]
pub const CM_FRAME_HEADER_LEN: usize = HEADER_LEN;

/// Decodes `data` as one whole frame (header, then body) the way the
/// listener does: the header's length first, then the body. Whatever
/// decodes must re-encode to the very same bytes (the format has one
/// encoding per frame); a request also goes through the listener's checks
/// (which must not panic either). Decode errors are formatted. Returns
/// whether `data` decoded as a whole frame.
///
/// # Panics
///
/// On any violated property (that is the point).
#[doc(hidden)]
pub fn check_cm_frame(data: &[u8]) -> bool {
    let Some(header) = data.get(..HEADER_LEN) else {
        return false;
    };
    let header: &[u8; HEADER_LEN] = header.try_into().expect("HEADER_LEN bytes");
    let body = &data[HEADER_LEN..];
    // Whatever the header says, decoding any body must not panic.
    if let Err(e) = wire::decode(header[4], body) {
        let _ = e.to_string();
    }
    let n = match wire::body_len(header) {
        Ok(n) => n,
        Err(e) => {
            let _ = e.to_string();
            return false;
        }
    };
    assert!(n <= wire::MAX_BODY, "body_len let {n} bytes through");
    if body.len() != n {
        return false;
    }
    let frame = match wire::decode(header[4], body) {
        Ok(f) => f,
        Err(e) => {
            assert!(
                e.reject.is_some(),
                "a frame with the right magic is answered, not dropped: {e}"
            );
            return false;
        }
    };
    assert_eq!(
        wire::encode(&frame),
        data,
        "frame re-encodes differently: {frame:?}"
    );
    if let Frame::Req(h) | Frame::Rep(h) = &frame {
        let _ = check_request(&h.endpoint);
    }
    true
}

fn hello(private: &[u8], soft_addr: Option<SocketAddr>) -> Hello {
    Hello {
        responder_resources: 16,
        initiator_depth: 4,
        private_data: private.to_vec(),
        endpoint: Endpoint {
            provider: ProviderKind::Soft,
            qpn: 0x00_0102,
            psn: 0xab_cdef,
            lid: 0,
            gid: Gid([0; 16]),
            mtu: Mtu::Mtu4096,
            addr: soft_addr.map_or(ProviderAddr::NONE, ProviderAddr::socket),
        },
    }
}

/// One valid frame of every type (requests with IPv4, IPv6 and no
/// address, accepts, rejects with and without private data, ready-to-use).
#[doc(hidden)]
pub fn cm_frame_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let v4 = Some("127.0.0.1:4791".parse().expect("literal"));
    let v6 = Some("[fe80::7]:4791".parse().expect("literal"));
    let frames = [
        ("req-v4", Frame::Req(hello(b"hello", v4))),
        ("req-v6", Frame::Req(hello(&[7; 56], v6))),
        ("req-no-address", Frame::Req(hello(b"", None))),
        ("rep-v4", Frame::Rep(hello(&[1; 196], v4))),
        (
            "rej-consumer",
            Frame::Rej {
                reason: 28,
                private_data: b"go away".to_vec(),
            },
        ),
        (
            "rej-empty",
            Frame::Rej {
                reason: 3,
                private_data: Vec::new(),
            },
        ),
        ("rtu", Frame::Rtu),
    ];
    frames
        .into_iter()
        .map(|(name, f)| (name, wire::encode(&f)))
        .collect()
}
