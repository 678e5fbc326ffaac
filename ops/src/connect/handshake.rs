//! The handshake frame codec: explicit little-endian, versioned, length-checked.
//!
//! Every frame is a 12-byte header and a body:
//!
//! ```text
//! header  0..6   magic  b"VRBIO\0"
//!         6..8   major version (u16 LE), must equal VERSION
//!         8      kind: 1 = hello, 2 = ready, 3 = reject
//!         9      minor version of the sender (u8; informational)
//!         10..12 body length (u16 LE), at most MAX_BODY_LEN
//! hello   0      provider (its tag: ProviderKind::wire_tag)
//!         1      MTU (verbs value 1..=5)
//!         2      provider address length n (at most MAX_ADDR_LEN)
//!         3      reserved (0)
//!         4..8   QP number (u32 LE, 24 bits)
//!         8..12  PSN (u32 LE, 24 bits)
//!         12..14 LID (u16 LE)
//!         14..16 reserved (0)
//!         16..32 GID (network order, as in the GID table)
//!         32..36 flags (u32 LE; unknown bits ignored)
//!         36..68 provider address: n bytes its provider defines
//!                (ProviderAddr), then zeros
//!         68..   fields appended by newer minor versions: skipped
//! ready   (empty)
//! reject  0..2   reason length n (u16 LE), then n bytes of UTF-8
//! ```
//!
//! The codec names no provider: the provider's tag and its address are
//! carried as they are, and [`Endpoint::check`] (the provider's own rules)
//! decides whether an endpoint can be connected to.
//!
//! A newer minor version may append fields to a body; older decoders skip
//! them because the header carries the body length. A new major version is
//! refused with [`HandshakeError::UnsupportedVersion`]. Version 1 carried
//! the software device's engine address in fields of its own; version 2
//! carries any provider's address, opaque and length-prefixed.

use verbio_runtime::provider::{Endpoint, Gid, Mtu, ProviderAddr, ProviderKind, MAX_ADDR_LEN};

use super::error::HandshakeError;

/// First bytes of every frame.
pub const MAGIC: [u8; 6] = *b"VRBIO\0";
/// The major version this build speaks.
pub const VERSION: u16 = 2;
/// The minor version this build sends.
pub const MINOR: u8 = 0;
/// Header bytes.
pub const HEADER_LEN: usize = 12;
/// Body bytes of a hello's fixed fields, before its provider address.
const HELLO_FIXED_LEN: usize = 36;
/// Body bytes of a version-2.0 hello.
pub const HELLO_BODY_LEN: usize = HELLO_FIXED_LEN + MAX_ADDR_LEN;
/// Bytes of an encoded hello (header + body).
pub const HELLO_LEN: usize = HEADER_LEN + HELLO_BODY_LEN;
/// Largest body accepted: bounds what a peer can make us read.
pub const MAX_BODY_LEN: usize = 1024;
/// Longest reject reason sent.
pub const MAX_REASON_LEN: usize = 256;

const KIND_HELLO: u8 = 1;
const KIND_READY: u8 = 2;
const KIND_REJECT: u8 = 3;

/// A peer's hello: its endpoint and what it announced about itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The sender's minor version.
    pub minor: u8,
    /// Feature flags (none defined yet; unknown bits are ignored).
    pub flags: u32,
    /// What is needed to connect to the sender's QP.
    pub endpoint: Endpoint,
}

impl Hello {
    /// A hello for `endpoint` from this build (current minor, no flags).
    pub fn new(endpoint: Endpoint) -> Hello {
        Hello {
            minor: MINOR,
            flags: 0,
            endpoint,
        }
    }
}

/// Any handshake frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    /// An endpoint announcement.
    Hello(Hello),
    /// "My QP is ready to receive" (ends the handshake).
    Ready,
    /// "I refuse your hello", with a reason.
    Reject(String),
}

impl Frame {
    /// The frame kind's name, for errors.
    pub fn kind_name(&self) -> &'static str {
        match self {
            Frame::Hello(_) => "hello",
            Frame::Ready => "ready",
            Frame::Reject(_) => "reject",
        }
    }
}

fn header(kind: u8, body_len: usize) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..6].copy_from_slice(&MAGIC);
    h[6..8].copy_from_slice(&VERSION.to_le_bytes());
    h[8] = kind;
    h[9] = MINOR;
    // Callers pass at most MAX_BODY_LEN, which fits u16.
    h[10..12].copy_from_slice(&(body_len.min(MAX_BODY_LEN) as u16).to_le_bytes());
    h
}

/// Encodes a hello. Fails if the endpoint is one the peer would refuse
/// (the same checks as [`decode`]), so a round trip always succeeds.
pub fn encode(hello: &Hello) -> Result<[u8; HELLO_LEN], HandshakeError> {
    validate(&hello.endpoint)?;
    let ep = &hello.endpoint;
    let mut f = [0u8; HELLO_LEN];
    f[..HEADER_LEN].copy_from_slice(&header(KIND_HELLO, HELLO_BODY_LEN));
    f[9] = hello.minor;
    let b = &mut f[HEADER_LEN..];
    let addr = ep.addr.as_bytes();
    b[0] = ep.provider.wire_tag();
    b[1] = ep.mtu as u8;
    // At most MAX_ADDR_LEN, which fits u8.
    b[2] = addr.len() as u8;
    b[4..8].copy_from_slice(&ep.qpn.to_le_bytes());
    b[8..12].copy_from_slice(&ep.psn.to_le_bytes());
    b[12..14].copy_from_slice(&ep.lid.to_le_bytes());
    b[16..32].copy_from_slice(&ep.gid.0);
    b[32..36].copy_from_slice(&hello.flags.to_le_bytes());
    b[HELLO_FIXED_LEN..HELLO_FIXED_LEN + addr.len()].copy_from_slice(addr);
    Ok(f)
}

/// Encodes the "ready" frame.
pub fn encode_ready() -> [u8; HEADER_LEN] {
    header(KIND_READY, 0)
}

/// Encodes a reject frame; the reason is cut to [`MAX_REASON_LEN`] bytes (at
/// a character boundary).
pub fn encode_reject(reason: &str) -> Vec<u8> {
    let mut end = reason.len().min(MAX_REASON_LEN);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    let r = &reason.as_bytes()[..end];
    let mut f = Vec::with_capacity(HEADER_LEN + 2 + r.len());
    f.extend_from_slice(&header(KIND_REJECT, 2 + r.len()));
    f.extend_from_slice(&(r.len() as u16).to_le_bytes());
    f.extend_from_slice(r);
    f
}

/// Checks a frame header (at least [`HEADER_LEN`] bytes) and returns the body
/// length that follows. Checks the magic first, on however many bytes there
/// are, so a non-verbio peer is named as such even when it sent little.
pub fn parse_header(buf: &[u8]) -> Result<usize, HandshakeError> {
    let n = buf.len().min(MAGIC.len());
    if buf[..n] != MAGIC[..n] {
        return Err(HandshakeError::BadMagic {
            expected: MAGIC,
            got: buf[..n].to_vec(),
        });
    }
    let h: &[u8; HEADER_LEN] = buf
        .get(..HEADER_LEN)
        .and_then(|h| h.try_into().ok())
        .ok_or(HandshakeError::Truncated {
            needed: HEADER_LEN,
            got: buf.len(),
        })?;
    let version = u16::from_le_bytes([h[6], h[7]]);
    if version != VERSION {
        return Err(HandshakeError::UnsupportedVersion {
            got: version,
            supported: VERSION,
        });
    }
    let body_len = usize::from(u16::from_le_bytes([h[10], h[11]]));
    if body_len > MAX_BODY_LEN {
        return Err(HandshakeError::InvalidField {
            field: "body_len",
            value: body_len as u64,
            reason: "larger than MAX_BODY_LEN",
        });
    }
    let min = match h[8] {
        KIND_HELLO => HELLO_BODY_LEN,
        KIND_READY => 0,
        KIND_REJECT => 2,
        other => {
            return Err(HandshakeError::InvalidField {
                field: "kind",
                value: u64::from(other),
                reason: "unknown frame kind",
            })
        }
    };
    if body_len < min {
        return Err(HandshakeError::InvalidField {
            field: "body_len",
            value: body_len as u64,
            reason: "too short for the frame kind",
        });
    }
    Ok(body_len)
}

/// Decodes exactly one frame of any kind. Never panics.
pub fn decode_frame(buf: &[u8]) -> Result<Frame, HandshakeError> {
    let body_len = parse_header(buf)?;
    let needed = HEADER_LEN + body_len;
    if buf.len() < needed {
        return Err(HandshakeError::Truncated {
            needed,
            got: buf.len(),
        });
    }
    if buf.len() > needed {
        return Err(HandshakeError::InvalidField {
            field: "frame_len",
            value: buf.len() as u64,
            reason: "trailing bytes after the frame",
        });
    }
    let minor = buf[9];
    let body = &buf[HEADER_LEN..];
    match buf[8] {
        KIND_HELLO => decode_hello_body(minor, body).map(Frame::Hello),
        KIND_READY => Ok(Frame::Ready),
        // parse_header accepts no other kind.
        _ => decode_reject_body(body).map(Frame::Reject),
    }
}

/// Decodes exactly one hello frame. Never panics: a fuzz target.
pub fn decode(buf: &[u8]) -> Result<Hello, HandshakeError> {
    match decode_frame(buf)? {
        Frame::Hello(h) => Ok(h),
        other => Err(HandshakeError::UnexpectedFrame {
            expected: "hello",
            got: other.kind_name(),
        }),
    }
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// `body` has at least HELLO_BODY_LEN bytes (checked by `parse_header`).
fn decode_hello_body(minor: u8, body: &[u8]) -> Result<Hello, HandshakeError> {
    let Some(b) = body.get(..HELLO_BODY_LEN) else {
        return Err(HandshakeError::Truncated {
            needed: HEADER_LEN + HELLO_BODY_LEN,
            got: HEADER_LEN + body.len(),
        });
    };
    let provider = ProviderKind::from_wire_tag(b[0]).ok_or(HandshakeError::InvalidField {
        field: "provider",
        value: u64::from(b[0]),
        reason: "unknown provider",
    })?;
    let mtu = Mtu::from_raw(b[1]).ok_or(HandshakeError::InvalidField {
        field: "mtu",
        value: u64::from(b[1]),
        reason: "not a verbs MTU value (1..=5)",
    })?;
    let area = &b[HELLO_FIXED_LEN..HELLO_BODY_LEN];
    let n = usize::from(b[2]);
    let (Some(bytes), Some(pad)) = (area.get(..n), area.get(n..)) else {
        return Err(HandshakeError::InvalidField {
            field: "addr_len",
            value: n as u64,
            reason: "longer than MAX_ADDR_LEN",
        });
    };
    if pad.iter().any(|&x| x != 0) {
        return Err(HandshakeError::InvalidField {
            field: "addr",
            value: n as u64,
            reason: "bytes past the address length are not zero",
        });
    }
    let addr = ProviderAddr::new(bytes).ok_or(HandshakeError::InvalidField {
        field: "addr_len",
        value: n as u64,
        reason: "longer than MAX_ADDR_LEN",
    })?;
    let mut gid = [0u8; 16];
    gid.copy_from_slice(&b[16..32]);
    let endpoint = Endpoint {
        provider,
        qpn: u32_at(b, 4),
        psn: u32_at(b, 8),
        lid: u16_at(b, 12),
        gid: Gid(gid),
        mtu,
        addr,
    };
    validate(&endpoint)?;
    Ok(Hello {
        minor,
        flags: u32_at(b, 32),
        endpoint,
    })
}

fn decode_reject_body(body: &[u8]) -> Result<String, HandshakeError> {
    let n = body
        .get(..2)
        .map(|l| usize::from(u16::from_le_bytes([l[0], l[1]])))
        .ok_or(HandshakeError::Truncated {
            needed: HEADER_LEN + 2,
            got: HEADER_LEN + body.len(),
        })?;
    let reason = body.get(2..2 + n).ok_or(HandshakeError::Truncated {
        needed: HEADER_LEN + 2 + n,
        got: HEADER_LEN + body.len(),
    })?;
    Ok(String::from_utf8_lossy(reason).into_owned())
}

/// The checks every endpoint passes, on both encode and decode: the
/// provider's own ([`Endpoint::check`]).
pub fn validate(ep: &Endpoint) -> Result<(), HandshakeError> {
    ep.check().map_err(|e| HandshakeError::InvalidField {
        field: e.field,
        value: e.value,
        reason: e.reason,
    })
}

#[cfg(test)]
mod tests {
    use std::net::{SocketAddr, SocketAddrV6};

    use super::*;

    pub(crate) fn soft_ep() -> Endpoint {
        Endpoint {
            provider: ProviderKind::Soft,
            qpn: 0x12_3456,
            psn: 0xab_cdef,
            lid: 0,
            gid: Gid::default(),
            mtu: Mtu::Mtu4096,
            addr: "127.0.0.1:40123".parse::<SocketAddr>().unwrap().into(),
        }
    }

    fn hw_ep() -> Endpoint {
        let mut gid = [0u8; 16];
        gid[10] = 0xff;
        gid[11] = 0xff;
        gid[12..].copy_from_slice(&[10, 0, 2, 15]);
        Endpoint {
            provider: ProviderKind::Ibverbs,
            qpn: 17,
            psn: 0x42,
            lid: 0,
            gid: Gid(gid),
            mtu: Mtu::Mtu1024,
            addr: ProviderAddr::NONE,
        }
    }

    #[test]
    fn round_trips_soft_v4_v6_and_hardware() {
        let mut v6 = soft_ep();
        v6.addr = SocketAddr::V6(SocketAddrV6::new("fe80::1".parse().unwrap(), 9999, 0, 3)).into();
        for ep in [soft_ep(), v6, hw_ep()] {
            let h = Hello {
                minor: 7,
                flags: 0xdead_beef,
                endpoint: ep,
            };
            let f = encode(&h).unwrap();
            assert_eq!(f.len(), HELLO_LEN);
            assert_eq!(decode(&f).unwrap(), h);
        }
    }

    #[test]
    fn layout_is_little_endian_and_fixed() {
        let f = encode(&Hello::new(soft_ep())).unwrap();
        assert_eq!(&f[..6], b"VRBIO\0");
        assert_eq!(&f[6..8], &[2, 0]);
        assert_eq!(f[8], 1);
        assert_eq!(&f[10..12], &[68, 0]);
        let b = &f[HEADER_LEN..];
        assert_eq!(b[0], ProviderKind::Soft.wire_tag());
        assert_eq!(b[1], 5);
        assert_eq!(b[2], 7, "the soft device's IPv4 address: 7 bytes");
        assert_eq!(&b[4..8], &[0x56, 0x34, 0x12, 0]);
        assert_eq!(&b[8..12], &[0xef, 0xcd, 0xab, 0]);
        assert_eq!(&b[32..36], &[0; 4], "flags");
        assert_eq!(&b[36..43], soft_ep().addr.as_bytes());
        assert!(b[43..].iter().all(|&x| x == 0));
        let hw = encode(&Hello::new(hw_ep())).unwrap();
        assert_eq!(hw[HEADER_LEN], ProviderKind::Ibverbs.wire_tag());
        assert_eq!(
            hw[HEADER_LEN + 2],
            0,
            "libibverbs' endpoints carry no address"
        );
    }

    /// A hello of `ep` whose address field says `n` bytes and holds `bytes`
    /// (written past the checks `encode` makes).
    fn with_addr(ep: Endpoint, n: u8, bytes: &[u8]) -> Vec<u8> {
        let mut f = encode(&Hello::new(ep)).unwrap().to_vec();
        let area = HEADER_LEN + HELLO_FIXED_LEN;
        f[area..area + MAX_ADDR_LEN].fill(0);
        f[area..area + bytes.len()].copy_from_slice(bytes);
        f[HEADER_LEN + 2] = n;
        f
    }

    #[test]
    fn malformed_truncated_and_oversized_addresses_are_refused() {
        let field = |f: &[u8]| match decode(f) {
            Err(HandshakeError::InvalidField { field, .. }) => field,
            other => panic!("expected a refused field, got {other:?}"),
        };
        let good = soft_ep().addr;
        let ok = with_addr(soft_ep(), good.len() as u8, good.as_bytes());
        assert_eq!(decode(&ok).unwrap().endpoint, soft_ep());
        // Longer than the area, and the largest length byte.
        for n in [MAX_ADDR_LEN as u8 + 1, u8::MAX] {
            assert_eq!(field(&with_addr(soft_ep(), n, good.as_bytes())), "addr_len");
        }
        // Truncated: the length cuts the provider's address short.
        let short = &good.as_bytes()[..4];
        assert_eq!(field(&with_addr(soft_ep(), 4, short)), "addr");
        // Bytes past the length.
        let mut tail = good.as_bytes().to_vec();
        tail.push(1);
        assert_eq!(
            field(&with_addr(soft_ep(), good.len() as u8, &tail)),
            "addr"
        );
        // Not the provider's format; none where one is needed; one where
        // none is allowed; the whole area used by garbage.
        assert_eq!(field(&with_addr(soft_ep(), 7, &[9; 7])), "addr");
        assert_eq!(field(&with_addr(soft_ep(), 0, &[])), "addr");
        assert_eq!(field(&with_addr(hw_ep(), 7, good.as_bytes())), "addr");
        let full = [0xa5; MAX_ADDR_LEN];
        assert_eq!(
            field(&with_addr(soft_ep(), MAX_ADDR_LEN as u8, &full)),
            "addr"
        );
        // A body cut inside the address area is a truncated frame.
        let cut = &ok[..HEADER_LEN + HELLO_FIXED_LEN + 3];
        assert!(matches!(decode(cut), Err(HandshakeError::Truncated { .. })));
    }

    #[test]
    fn newer_minor_versions_may_append_fields() {
        let f = encode(&Hello::new(soft_ep())).unwrap();
        let mut longer = f.to_vec();
        longer[9] = 3;
        longer[10..12].copy_from_slice(&((HELLO_BODY_LEN + 8) as u16).to_le_bytes());
        longer.extend_from_slice(&[0xaa; 8]);
        let h = decode(&longer).unwrap();
        assert_eq!(h.minor, 3);
        assert_eq!(h.endpoint, soft_ep());
    }

    #[test]
    fn named_errors_for_bad_frames() {
        let f = encode(&Hello::new(soft_ep())).unwrap();
        assert!(matches!(
            decode(b"GET / HTTP/1.1\r\n"),
            Err(HandshakeError::BadMagic { .. })
        ));
        assert!(matches!(decode(b"GE"), Err(HandshakeError::BadMagic { got, .. }) if got == b"GE"));
        assert!(matches!(
            decode(&f[..4]),
            Err(HandshakeError::Truncated {
                needed: HEADER_LEN,
                got: 4
            })
        ));
        assert!(matches!(
            decode(&f[..30]),
            Err(HandshakeError::Truncated {
                needed: HELLO_LEN,
                got: 30
            })
        ));
        assert!(matches!(decode(&[]), Err(HandshakeError::Truncated { .. })));
        let mut v1 = f;
        v1[6] = 1;
        assert!(matches!(
            decode(&v1),
            Err(HandshakeError::UnsupportedVersion {
                got: 1,
                supported: 2
            })
        ));
        let mut bad = f;
        bad[HEADER_LEN] = 9;
        assert!(matches!(
            decode(&bad),
            Err(HandshakeError::InvalidField {
                field: "provider",
                value: 9,
                ..
            })
        ));
        let mut bad = f;
        bad[HEADER_LEN + 1] = 0;
        assert!(matches!(
            decode(&bad),
            Err(HandshakeError::InvalidField { field: "mtu", .. })
        ));
        let mut bad = f;
        bad[HEADER_LEN + 7] = 1;
        assert!(matches!(
            decode(&bad),
            Err(HandshakeError::InvalidField { field: "qpn", .. })
        ));
        let mut bad = f;
        bad[HEADER_LEN + 2] = 0;
        assert!(matches!(
            decode(&bad),
            Err(HandshakeError::InvalidField { field: "addr", .. })
        ));
        let mut bad = f;
        bad[10] = 0xff;
        bad[11] = 0xff;
        assert!(matches!(
            decode(&bad),
            Err(HandshakeError::InvalidField {
                field: "body_len",
                ..
            })
        ));
        let mut long = f.to_vec();
        long.push(0);
        assert!(matches!(
            decode(&long),
            Err(HandshakeError::InvalidField {
                field: "frame_len",
                ..
            })
        ));
        assert!(matches!(
            decode(&encode_ready()),
            Err(HandshakeError::UnexpectedFrame {
                expected: "hello",
                got: "ready"
            })
        ));
    }

    #[test]
    fn encode_refuses_what_decode_would_refuse() {
        let mut ep = soft_ep();
        ep.psn = 1 << 24;
        assert!(encode(&Hello::new(ep)).is_err());
        let mut ep = hw_ep();
        ep.gid = Gid::default();
        assert!(encode(&Hello::new(ep)).is_err());
        ep.lid = 3;
        assert!(encode(&Hello::new(ep)).is_ok());
        let mut ep = soft_ep();
        ep.addr = "0.0.0.0:5".parse::<SocketAddr>().unwrap().into();
        assert!(encode(&Hello::new(ep)).is_err());
    }

    #[test]
    fn ready_and_reject_frames() {
        assert_eq!(decode_frame(&encode_ready()).unwrap(), Frame::Ready);
        let r = encode_reject("provider mismatch");
        assert_eq!(
            decode_frame(&r).unwrap(),
            Frame::Reject("provider mismatch".into())
        );
        let long = "é".repeat(200);
        let r = encode_reject(&long);
        match decode_frame(&r).unwrap() {
            Frame::Reject(s) => {
                assert!(s.len() <= MAX_REASON_LEN);
                assert!(s.chars().all(|c| c == 'é'));
            }
            other => panic!("{other:?}"),
        }
        let mut bad = r.clone();
        bad[HEADER_LEN] = 0xff; // reason longer than the body
        assert!(matches!(
            decode_frame(&bad),
            Err(HandshakeError::Truncated { .. })
        ));
    }

    /// xorshift64*: a tiny deterministic PRNG, no dependencies.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    #[test]
    fn decode_never_panics_on_random_and_mutated_input() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let seeds: Vec<Vec<u8>> = vec![
            encode(&Hello::new(soft_ep())).unwrap().to_vec(),
            encode(&Hello::new(hw_ep())).unwrap().to_vec(),
            encode_ready().to_vec(),
            encode_reject("nope"),
        ];
        let mut ok = 0usize;
        let mut buf = Vec::with_capacity(256);
        for i in 0..200_000 {
            buf.clear();
            if i % 4 == 0 {
                // Pure noise, sometimes with a valid header prefix.
                let n = rng.below(100);
                buf.extend((0..n).map(|_| rng.next() as u8));
                if rng.below(2) == 0 && buf.len() >= 8 {
                    buf[..6].copy_from_slice(&MAGIC);
                    buf[6..8].copy_from_slice(&VERSION.to_le_bytes());
                }
            } else {
                buf.extend_from_slice(&seeds[rng.below(seeds.len())]);
                for _ in 0..1 + rng.below(4) {
                    match rng.below(4) {
                        0 if !buf.is_empty() => {
                            let at = rng.below(buf.len());
                            buf[at] ^= 1 << rng.below(8);
                        }
                        1 if !buf.is_empty() => {
                            let at = rng.below(buf.len());
                            buf[at] = rng.next() as u8;
                        }
                        2 => buf.truncate(rng.below(buf.len() + 1)),
                        _ => buf.push(rng.next() as u8),
                    }
                }
            }
            if let Ok(frame) = decode_frame(&buf) {
                ok += 1;
                // Whatever decodes re-encodes to a frame that decodes the same.
                if let Frame::Hello(h) = frame {
                    let again = encode(&h).expect("decoded endpoints are valid");
                    assert_eq!(decode(&again).unwrap().endpoint, h.endpoint);
                }
            }
            let _ = decode(&buf);
        }
        // The mutator keeps some frames valid: the test exercises both paths.
        assert!(ok > 1000, "only {ok} inputs decoded");
    }
}
