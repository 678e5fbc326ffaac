//! The soft device's connection-manager messages, over TCP: a connect
//! request (`Req`), the accept (`Rep`) or reject (`Rej`), and the
//! requester's "ready to use" (`Rtu`), after which the stream stays open
//! and its end (FIN or reset) is the disconnect.
//!
//! Every frame: `b"vCM1"`, the type (1 byte), a zero byte, the body's
//! length (u16, big-endian) and the body. `Req` and `Rep` bodies: the READ
//! depths (responder resources, initiator depth: 1 byte each), the private
//! data (length byte, bytes), then the QP's endpoint: QPN and PSN (u32
//! each), LID (u16), GID (16 bytes), MTU (1 byte, verbs encoding), and the
//! engine's address (0 = none, 4 + 4 bytes or 6 + 16 bytes, then the port
//! as u16). `Rej`: the reject reason (u16, big-endian: the InfiniBand CM's
//! numbers, e.g. 28 = consumer reject), then the private data. `Rtu`:
//! empty. Decoding refuses any malformed frame with a [`DecodeError`] that
//! names the reject reason a listener answers it with; it never panics.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use crate::cm::reject::{REJECT_INVALID_ADDRESS, REJECT_INVALID_MTU, REJECT_UNSUPPORTED};
use crate::provider::{Endpoint, Gid, Mtu, ProviderAddr, ProviderKind};

/// Frame magic and version.
pub(crate) const MAGIC: [u8; 4] = *b"vCM1";
/// Bytes before the body.
pub(crate) const HEADER_LEN: usize = 8;
/// Largest body any frame has.
pub(crate) const MAX_BODY: usize = 512;

/// A frame's type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Req = 1,
    Rep = 2,
    Rej = 3,
    Rtu = 4,
}

/// A connect request or accept.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Hello {
    pub(crate) responder_resources: u8,
    pub(crate) initiator_depth: u8,
    pub(crate) private_data: Vec<u8>,
    pub(crate) endpoint: Endpoint,
}

/// A decoded frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Frame {
    Req(Hello),
    Rep(Hello),
    Rej {
        /// The reject reason (InfiniBand CM numbering).
        reason: u16,
        private_data: Vec<u8>,
    },
    Rtu,
}

/// Why a frame was refused, and the reject reason a listener answers a
/// connect request that fails this way with (`None`: not this protocol at
/// all; the connection is closed without an answer).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct DecodeError {
    pub(crate) what: String,
    pub(crate) reject: Option<u16>,
}

impl DecodeError {
    fn malformed(what: impl Into<String>) -> DecodeError {
        DecodeError {
            what: what.into(),
            reject: Some(REJECT_UNSUPPORTED),
        }
    }
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.what)
    }
}

fn frame(kind: Kind, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + body.len());
    out.extend_from_slice(&MAGIC);
    out.push(kind as u8);
    out.push(0);
    out.extend_from_slice(&(body.len() as u16).to_be_bytes());
    out.extend_from_slice(body);
    out
}

fn put_private(out: &mut Vec<u8>, data: &[u8]) {
    // Callers check the length (at most 196 bytes) first.
    let n = data.len().min(usize::from(u8::MAX));
    out.push(n as u8);
    out.extend_from_slice(&data[..n]);
}

fn hello_body(h: &Hello) -> Vec<u8> {
    let mut b = vec![h.responder_resources, h.initiator_depth];
    put_private(&mut b, &h.private_data);
    let ep = &h.endpoint;
    b.extend_from_slice(&ep.qpn.to_be_bytes());
    b.extend_from_slice(&ep.psn.to_be_bytes());
    b.extend_from_slice(&ep.lid.to_be_bytes());
    b.extend_from_slice(&ep.gid.0);
    b.push(ep.mtu as u8);
    match ep.addr.to_socket() {
        None => b.push(0),
        Some(a) => {
            match a.ip() {
                IpAddr::V4(ip) => {
                    b.push(4);
                    b.extend_from_slice(&ip.octets());
                }
                IpAddr::V6(ip) => {
                    b.push(6);
                    b.extend_from_slice(&ip.octets());
                }
            }
            b.extend_from_slice(&a.port().to_be_bytes());
        }
    }
    b
}

/// The bytes of `f`.
pub(crate) fn encode(f: &Frame) -> Vec<u8> {
    match f {
        Frame::Req(h) => frame(Kind::Req, &hello_body(h)),
        Frame::Rep(h) => frame(Kind::Rep, &hello_body(h)),
        Frame::Rej {
            reason,
            private_data,
        } => {
            let mut b = reason.to_be_bytes().to_vec();
            put_private(&mut b, private_data);
            frame(Kind::Rej, &b)
        }
        Frame::Rtu => frame(Kind::Rtu, &[]),
    }
}

/// The body length a header announces, or why the header is bad.
pub(crate) fn body_len(header: &[u8; HEADER_LEN]) -> Result<usize, DecodeError> {
    if header[..4] != MAGIC {
        return Err(DecodeError {
            what: format!("not a verbio CM frame (starts with {:02x?})", &header[..4]),
            reject: None,
        });
    }
    if header[5] != 0 {
        return Err(DecodeError::malformed(format!(
            "reserved header byte {:#04x}, must be 0",
            header[5]
        )));
    }
    let len = usize::from(u16::from_be_bytes([header[6], header[7]]));
    if len > MAX_BODY {
        return Err(DecodeError::malformed(format!(
            "frame body of {len} bytes, at most {MAX_BODY}"
        )));
    }
    Ok(len)
}

/// Reads a body field by field.
struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], DecodeError> {
        if self.buf.len() < n {
            return Err(DecodeError::malformed(format!("frame ends inside {what}")));
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }
    fn u8(&mut self, what: &str) -> Result<u8, DecodeError> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16, DecodeError> {
        let b = self.take(2, what)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }
    fn u32(&mut self, what: &str) -> Result<u32, DecodeError> {
        let b = self.take(4, what)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn private(&mut self) -> Result<Vec<u8>, DecodeError> {
        let n = usize::from(self.u8("the private data's length")?);
        Ok(self.take(n, "the private data")?.to_vec())
    }
    fn end(&self) -> Result<(), DecodeError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(DecodeError::malformed(format!(
                "{} bytes after the frame's fields",
                self.buf.len()
            )))
        }
    }
}

fn decode_hello(body: &[u8]) -> Result<Hello, DecodeError> {
    let mut r = Reader { buf: body };
    let responder_resources = r.u8("the responder resources")?;
    let initiator_depth = r.u8("the initiator depth")?;
    let private_data = r.private()?;
    let qpn = r.u32("the QPN")?;
    let psn = r.u32("the PSN")?;
    let lid = r.u16("the LID")?;
    let mut gid = [0u8; 16];
    gid.copy_from_slice(r.take(16, "the GID")?);
    let mtu_raw = r.u8("the MTU")?;
    let mtu = Mtu::from_raw(mtu_raw).ok_or_else(|| DecodeError {
        what: format!("MTU code {mtu_raw}"),
        reject: Some(REJECT_INVALID_MTU),
    })?;
    let addr = match r.u8("the address family")? {
        0 => None,
        4 => {
            let b = r.take(4, "the IPv4 address")?;
            let ip = Ipv4Addr::new(b[0], b[1], b[2], b[3]);
            Some(SocketAddr::new(IpAddr::V4(ip), r.u16("the port")?))
        }
        6 => {
            let mut o = [0u8; 16];
            o.copy_from_slice(r.take(16, "the IPv6 address")?);
            Some(SocketAddr::new(
                IpAddr::V6(Ipv6Addr::from(o)),
                r.u16("the port")?,
            ))
        }
        other => {
            return Err(DecodeError {
                what: format!("address family {other}"),
                reject: Some(REJECT_INVALID_ADDRESS),
            })
        }
    };
    r.end()?;
    Ok(Hello {
        responder_resources,
        initiator_depth,
        private_data,
        endpoint: Endpoint {
            provider: ProviderKind::Soft,
            qpn,
            psn,
            lid,
            gid: Gid(gid),
            mtu,
            addr: addr.map_or(ProviderAddr::NONE, ProviderAddr::socket),
        },
    })
}

/// Decodes a frame of type `kind` (the header's byte 4) and its body.
pub(crate) fn decode(kind: u8, body: &[u8]) -> Result<Frame, DecodeError> {
    match kind {
        1 => Ok(Frame::Req(decode_hello(body)?)),
        2 => Ok(Frame::Rep(decode_hello(body)?)),
        3 => {
            let mut r = Reader { buf: body };
            let reason = r.u16("the reject reason")?;
            let private_data = r.private()?;
            r.end()?;
            Ok(Frame::Rej {
                reason,
                private_data,
            })
        }
        4 if body.is_empty() => Ok(Frame::Rtu),
        4 => Err(DecodeError::malformed("RTU with a body")),
        other => Err(DecodeError::malformed(format!("frame type {other}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(addr: Option<SocketAddr>) -> Hello {
        Hello {
            responder_resources: 16,
            initiator_depth: 4,
            private_data: b"settings".to_vec(),
            endpoint: Endpoint {
                provider: ProviderKind::Soft,
                qpn: 0x12_3456,
                psn: 0xab_cdef,
                lid: 0,
                gid: Gid([7; 16]),
                mtu: Mtu::Mtu4096,
                addr: addr.map_or(ProviderAddr::NONE, ProviderAddr::socket),
            },
        }
    }

    fn round_trip(f: &Frame) -> Result<Frame, DecodeError> {
        let bytes = encode(f);
        let header: [u8; HEADER_LEN] = bytes[..HEADER_LEN].try_into().unwrap();
        let n = body_len(&header)?;
        assert_eq!(n, bytes.len() - HEADER_LEN);
        decode(header[4], &bytes[HEADER_LEN..])
    }

    #[test]
    fn frames_round_trip() {
        for f in [
            Frame::Req(hello(Some("127.0.0.1:4791".parse().unwrap()))),
            Frame::Rep(hello(Some("[::1]:9".parse().unwrap()))),
            Frame::Req(hello(None)),
            Frame::Rej {
                reason: 28,
                private_data: b"go away".to_vec(),
            },
            Frame::Rej {
                reason: 3,
                private_data: Vec::new(),
            },
            Frame::Rtu,
        ] {
            assert_eq!(round_trip(&f).unwrap(), f);
        }
    }

    #[test]
    fn malformed_frames_are_refused() {
        let mut h = [0u8; HEADER_LEN];
        h[..4].copy_from_slice(b"HTTP");
        let foreign = body_len(&h).unwrap_err();
        assert!(foreign.what.contains("not a verbio CM frame"));
        assert_eq!(foreign.reject, None, "a foreign peer gets no answer");
        h[..4].copy_from_slice(&MAGIC);
        h[6..].copy_from_slice(&600u16.to_be_bytes());
        assert_eq!(body_len(&h).unwrap_err().reject, Some(REJECT_UNSUPPORTED));
        h[6..].copy_from_slice(&6u16.to_be_bytes());
        h[5] = 1;
        assert_eq!(body_len(&h).unwrap_err().reject, Some(REJECT_UNSUPPORTED));
        assert!(decode(9, &[]).is_err());
        assert!(decode(4, &[1]).is_err());
        let body = encode(&Frame::Req(hello(None)));
        let body = &body[HEADER_LEN..];
        // Every truncation and every extra byte is an error, never a panic.
        for n in 0..body.len() {
            assert!(decode(1, &body[..n]).is_err(), "truncated at {n}");
        }
        let mut long = body.to_vec();
        long.push(0);
        assert!(decode(1, &long).is_err());
    }

    #[test]
    fn bad_fields_name_their_reject_reason() {
        let body = encode(&Frame::Req(hello(None)));
        let body = &body[HEADER_LEN..];
        // The MTU byte, then the address family (last byte without an address).
        let mtu_at = body.len() - 2;
        let mut bad = body.to_vec();
        bad[mtu_at] = 9;
        assert_eq!(
            decode(1, &bad).unwrap_err().reject,
            Some(REJECT_INVALID_MTU)
        );
        let mut bad = body.to_vec();
        bad[mtu_at + 1] = 5;
        assert_eq!(
            decode(1, &bad).unwrap_err().reject,
            Some(REJECT_INVALID_ADDRESS)
        );
        assert_eq!(
            decode(1, &body[..3]).unwrap_err().reject,
            Some(REJECT_UNSUPPORTED)
        );
    }

    #[test]
    fn decode_never_panics_on_mutated_input() {
        let body = encode(&Frame::Rep(hello(Some("10.0.0.1:1".parse().unwrap()))));
        let body = &body[HEADER_LEN..];
        let mut x: u32 = 0x9e37_79b9;
        for _ in 0..5000 {
            let mut b = body.to_vec();
            for _ in 0..3 {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                let i = (x as usize) % b.len();
                b[i] = (x >> 8) as u8;
            }
            let _ = decode(2, &b);
            let _ = decode((x % 6) as u8, &b);
        }
    }
}
