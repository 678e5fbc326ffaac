//! Checks for the connection handshake codec ([`crate::connect::handshake`]).

use std::net::{SocketAddr, SocketAddrV6};

use verbio_runtime::provider::{Endpoint, Gid, Mtu, ProviderAddr, ProviderKind};

use super::{display, LenField, Seed};
use crate::connect::handshake::{self as hs, Frame, Hello, HEADER_LEN, HELLO_LEN};
use crate::connect::HandshakeError;

/// The handshake header's body length: `u16` at offset 10, counting what
/// follows the 12-byte header.
pub const LEN_FIELD: LenField = LenField {
    offset: 10,
    width: 2,
    counted_from: HEADER_LEN,
};

/// Hello body bytes the decoder ignores: the reserved ones. (The provider
/// address's padding must be zero, so it re-encodes exactly.)
fn hello_body_ignored(at: usize) -> bool {
    at == 3 || (14..16).contains(&at)
}

/// Decodes `data` with `parse_header`, `decode_frame` and `decode` and
/// requires them to agree; re-encodes what decodes and requires it to decode
/// to the same frame, and to equal the input on every byte the decoder reads
/// (the codec tolerates appended fields and ignores unused ones, so the
/// byte-exact comparison skips exactly those). Returns whether `data`
/// decoded as a frame.
///
/// # Panics
///
/// On any violated property (that is the point).
pub fn check(data: &[u8]) -> bool {
    if let Err(e) = hs::parse_header(data) {
        display(&e);
    }
    let hello = hs::decode(data);
    if let Err(e) = &hello {
        display(e);
    }
    let frame = match hs::decode_frame(data) {
        Ok(frame) => frame,
        Err(e) => {
            display(&e);
            assert!(hello.is_err(), "decode accepts what decode_frame refuses");
            return false;
        }
    };
    match (&frame, &hello) {
        (Frame::Hello(a), Ok(b)) => assert_eq!(a, b, "decode and decode_frame disagree"),
        (Frame::Hello(_), Err(e)) => panic!("decode_frame gives a hello, decode fails: {e}"),
        (_, Err(HandshakeError::UnexpectedFrame { .. })) => {}
        (other, r) => panic!("decode_frame gives {other:?}, decode gives {r:?}"),
    }
    let minor = data[9]; // decode_frame checked the header is present
    let body_len = data.len() - HEADER_LEN;
    match frame {
        Frame::Hello(h) => {
            let bytes = match hs::encode(&h) {
                Ok(bytes) => bytes,
                Err(e) => panic!("a decoded hello does not re-encode ({e}): {h:?}"),
            };
            match hs::decode(&bytes) {
                Ok(again) => assert_eq!(again, h, "hello round trip changed it"),
                Err(e) => panic!("a re-encoded hello does not decode ({e}): {h:?}"),
            }
            for (at, (&want, &got)) in bytes.iter().zip(&data[..HELLO_LEN]).enumerate() {
                let ignored = (at == 10 || at == 11) && data.len() != HELLO_LEN
                    || at >= HEADER_LEN && hello_body_ignored(at - HEADER_LEN);
                assert!(
                    ignored || want == got,
                    "byte {at} of the hello re-encodes as {want:#04x}, input had {got:#04x}: {h:?}"
                );
            }
        }
        Frame::Ready => {
            assert_eq!(
                hs::decode_frame(&hs::encode_ready()).ok(),
                Some(Frame::Ready)
            );
            if minor == hs::MINOR && body_len == 0 {
                assert_eq!(
                    hs::encode_ready().as_slice(),
                    data,
                    "ready is not canonical"
                );
            }
        }
        Frame::Reject(reason) => {
            let bytes = hs::encode_reject(&reason);
            let mut cut = reason.len().min(hs::MAX_REASON_LEN);
            while !reason.is_char_boundary(cut) {
                cut -= 1;
            }
            let expected = Frame::Reject(reason[..cut].to_owned());
            match hs::decode_frame(&bytes) {
                Ok(again) => assert_eq!(again, expected, "reject round trip"),
                Err(e) => panic!("a re-encoded reject does not decode ({e}): {reason:?}"),
            }
            // Canonical input: current minor, no appended bytes, a UTF-8
            // reason within the limit. Then encoding gives the input back.
            let n = usize::from(u16::from_le_bytes([data[12], data[13]]));
            if minor == hs::MINOR
                && body_len == 2 + n
                && n <= hs::MAX_REASON_LEN
                && std::str::from_utf8(&data[14..]).is_ok()
            {
                assert_eq!(bytes, data, "reject is not canonical");
            }
        }
    }
    true
}

fn soft(addr: &str) -> Endpoint {
    Endpoint {
        provider: ProviderKind::Soft,
        qpn: 0x00_1234,
        psn: 0x65_4321,
        lid: 0,
        gid: Gid::default(),
        mtu: Mtu::Mtu4096,
        // Invariant: the literals below parse.
        addr: addr
            .parse::<SocketAddr>()
            .expect("socket address literal")
            .into(),
    }
}

fn hello(ep: Endpoint) -> Vec<u8> {
    // Invariant: every seed endpoint passes `validate`.
    hs::encode(&Hello::new(ep))
        .expect("seed hello encodes")
        .to_vec()
}

/// One valid frame of every kind: hellos for each address family and
/// provider, one from a newer minor version with appended fields, ready and
/// reject.
pub fn seeds() -> Vec<Seed> {
    let mut v6 = soft("[::1]:4791");
    v6.addr = ProviderAddr::socket(SocketAddr::V6(SocketAddrV6::new(
        "fe80::1:2".parse().expect("address literal"),
        18515,
        0,
        2,
    )));
    let mut gid = [0u8; 16];
    gid[10] = 0xff;
    gid[11] = 0xff;
    gid[12..].copy_from_slice(&[192, 168, 1, 7]);
    let roce = Endpoint {
        provider: ProviderKind::Ibverbs,
        qpn: 0x11,
        psn: 0x42,
        lid: 0,
        gid: Gid(gid),
        mtu: Mtu::Mtu1024,
        addr: ProviderAddr::NONE,
    };
    let ib = Endpoint {
        lid: 7,
        gid: Gid::default(),
        mtu: Mtu::Mtu2048,
        ..roce
    };
    let mut newer = hello(soft("10.0.0.2:7000"));
    newer[9] = 3;
    let body = (hs::HELLO_BODY_LEN + 8) as u16;
    newer[10..12].copy_from_slice(&body.to_le_bytes());
    newer.extend_from_slice(&[0x5a; 8]);
    vec![
        Seed::new("hello-soft-v4", hello(soft("127.0.0.1:40123"))),
        Seed::new("hello-soft-v6", hello(v6)),
        Seed::new("hello-roce", hello(roce)),
        Seed::new("hello-ib-lid", hello(ib)),
        Seed::new("hello-newer-minor", newer),
        Seed::new("ready", hs::encode_ready()),
        Seed::new(
            "reject",
            hs::encode_reject("provider mismatch: soft vs ibverbs"),
        ),
        Seed::new("reject-empty", hs::encode_reject("")),
    ]
}
