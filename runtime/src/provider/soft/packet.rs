//! The soft device's wire format: one fixed 56-byte header followed by
//! `payload_len` bytes. Everything is explicit little-endian; the header starts
//! with a magic and a version, and `decode` / `decode_header` validate
//! every field, so no input can make them panic (they are fuzz targets).
//!
//! Header layout (byte offsets):
//!
//! | off | size | field |
//! |----:|-----:|-------|
//! | 0 | 2 | magic `0x5642` ("VB") |
//! | 2 | 1 | version ([`VERSION`], 5) |
//! | 3 | 1 | opcode |
//! | 4 | 4 | payload_len (≤ 1 MiB) |
//! | 8 | 4 | dst_qpn (24 bits) |
//! | 12 | 4 | src_qpn (24 bits) |
//! | 16 | 4 | psn (24 bits) |
//! | 20 | 1 | flags (FIRST, LAST, SOLICITED) |
//! | 21 | 1 | syndrome (NAK only) |
//! | 22 | 2 | reserved, must be 0 |
//! | 24 | 4 | imm |
//! | 28 | 4 | rkey |
//! | 32 | 8 | addr |
//! | 40 | 8 | arg0 |
//! | 48 | 8 | arg1 |
//!
//! Per opcode: SEND/WRITE segments carry `arg0` = message length and
//! `arg1` = offset of this segment (SEND_INV segments also `rkey` = the
//! window the responder invalidates); READ_REQ `arg0` = length; CMP_SWP
//! `arg0`/`arg1` = compare/swap; FETCH_ADD `arg0` = add; READ_RESP `arg0` =
//! total length, `arg1` = offset; ATOMIC_RESP `arg0` = original value; NAK
//! `syndrome` plus `arg0` = encoded RNR timer; HELLO a 19-byte socket address
//! (the sender's listener); VERIFY two of them (the asking engine's listener,
//! then the source address of the connection asked about); VERIFY_REPLY no
//! payload, `arg0` = 1 (that connection is the answering engine's) or 0.
//! PING / PONG (on a proven connection): no payload, `arg0` = the probe's
//! sequence number, every other field 0; an engine answers a PING with a
//! PONG of the same number, queued after every response it owes on that
//! connection (see `engine/probe.rs`).
//! DATAGRAM / DATAGRAM_IMM (UD, one packet per message, at most
//! [`UD_MTU`] payload bytes, FIRST and LAST set): `rkey` = the Q_Key,
//! `arg0` = the hop limit of the sender's address handle (≤ 255), `imm`
//! (DATAGRAM_IMM only, else 0), `psn` = the sending QP's send PSN, `addr`
//! and `arg1` 0.
//!
//! Version 2 added the datagram opcodes, version 3 SEND_INV, version 4
//! VERIFY and VERIFY_REPLY, with which an engine proves that a connection
//! claiming its address in a HELLO is its own (see `engine/port.rs`; an
//! engine speaking another version refuses the connection at its first
//! packet, the HELLO), version 5 PING and PONG.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

/// First two bytes of every packet.
pub const MAGIC: u16 = 0x5642;
/// Wire-format version this code speaks.
pub const VERSION: u8 = 5;
/// Size of the fixed header.
pub const HEADER_LEN: usize = 56;
/// Largest payload of one packet (messages are segmented).
pub const MAX_PAYLOAD: u32 = 1024 * 1024;
/// Largest message (verbs `max_msg_sz`).
pub const MAX_MSG: u64 = 1 << 31;
/// Largest datagram payload: the port's active MTU.
pub const UD_MTU: u32 = 4096;
/// Length of a HELLO payload.
pub const HELLO_LEN: usize = 19;
/// Length of a VERIFY payload: two socket addresses.
pub const VERIFY_LEN: usize = 2 * HELLO_LEN;

/// Segment is the first of its message.
pub const FLAG_FIRST: u8 = 1;
/// Segment is the last of its message.
pub const FLAG_LAST: u8 = 2;
/// The sender asked for a solicited event.
pub const FLAG_SOLICITED: u8 = 4;
const FLAGS_KNOWN: u8 = FLAG_FIRST | FLAG_LAST | FLAG_SOLICITED;

/// NAK syndrome: receiver not ready (no RECV posted); `arg0` is the RNR timer.
pub const NAK_RNR: u8 = 1;
/// NAK syndrome: remote access error (rkey, bounds, access flags).
pub const NAK_REM_ACCESS: u8 = 2;
/// NAK syndrome: remote operational error (e.g. SEND longer than the RECV).
pub const NAK_REM_OP: u8 = 3;
/// NAK syndrome: invalid request.
pub const NAK_REM_INV_REQ: u8 = 4;

/// Packet type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    /// First packet on a connection: the sender's engine address.
    Hello = 0x01,
    /// First packet on a connection an engine opened to ask the engine it
    /// reaches whether a connection claiming that engine's address is its
    /// own (see [`encode_verify`]).
    Verify = 0x02,
    /// The answer to a VERIFY: `arg0` = 1 (yes) or 0 (no).
    VerifyReply = 0x03,
    /// A probe: the receiving engine answers with a PONG of the same
    /// `arg0` once it has handled everything sent before it.
    Ping = 0x04,
    /// The answer to a PING (`arg0` = its sequence number).
    Pong = 0x05,
    /// SEND segment.
    Send = 0x10,
    /// SEND with immediate segment.
    SendImm = 0x11,
    /// RDMA WRITE segment.
    Write = 0x12,
    /// RDMA WRITE with immediate segment.
    WriteImm = 0x13,
    /// RDMA READ request.
    ReadReq = 0x14,
    /// Atomic compare-and-swap request.
    CmpSwap = 0x15,
    /// Atomic fetch-and-add request.
    FetchAdd = 0x16,
    /// SEND with invalidate segment: `rkey` names the responder's memory
    /// window to invalidate.
    SendInv = 0x17,
    /// Cumulative acknowledgement up to `psn`.
    Ack = 0x20,
    /// Negative acknowledgement of `psn` (see `syndrome`).
    Nak = 0x21,
    /// RDMA READ response segment.
    ReadResp = 0x22,
    /// Atomic response (original value).
    AtomicResp = 0x23,
    /// UD datagram (SEND only).
    Datagram = 0x30,
    /// UD datagram with immediate data.
    DatagramImm = 0x31,
}

impl Opcode {
    /// From the wire byte.
    pub fn from_u8(v: u8) -> Option<Opcode> {
        use Opcode::*;
        Some(match v {
            0x01 => Hello,
            0x02 => Verify,
            0x03 => VerifyReply,
            0x04 => Ping,
            0x05 => Pong,
            0x10 => Send,
            0x11 => SendImm,
            0x12 => Write,
            0x13 => WriteImm,
            0x14 => ReadReq,
            0x15 => CmpSwap,
            0x16 => FetchAdd,
            0x17 => SendInv,
            0x20 => Ack,
            0x21 => Nak,
            0x22 => ReadResp,
            0x23 => AtomicResp,
            0x30 => Datagram,
            0x31 => DatagramImm,
            _ => return None,
        })
    }

    /// True for packets a requester sends (handled by the responder).
    pub fn is_request(self) -> bool {
        matches!(
            self,
            Opcode::Send
                | Opcode::SendImm
                | Opcode::Write
                | Opcode::WriteImm
                | Opcode::ReadReq
                | Opcode::CmpSwap
                | Opcode::FetchAdd
                | Opcode::SendInv
        )
    }

    /// True for UD datagrams.
    pub fn is_datagram(self) -> bool {
        matches!(self, Opcode::Datagram | Opcode::DatagramImm)
    }

    fn carries_segment(self) -> bool {
        matches!(
            self,
            Opcode::Send
                | Opcode::SendImm
                | Opcode::SendInv
                | Opcode::Write
                | Opcode::WriteImm
                | Opcode::ReadResp
        )
    }
}

/// A decoded packet header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Packet type.
    pub opcode: Opcode,
    /// Bytes following the header.
    pub payload_len: u32,
    /// Destination QP number.
    pub dst_qpn: u32,
    /// Source QP number.
    pub src_qpn: u32,
    /// Packet sequence number (24 bits).
    pub psn: u32,
    /// `FLAG_*` bits.
    pub flags: u8,
    /// NAK syndrome (`NAK_*`), else 0.
    pub syndrome: u8,
    /// Immediate data.
    pub imm: u32,
    /// Remote key.
    pub rkey: u32,
    /// Remote address.
    pub addr: u64,
    /// Opcode-specific argument (see the module docs).
    pub arg0: u64,
    /// Opcode-specific argument (see the module docs).
    pub arg1: u64,
}

impl Header {
    /// A header with every field zero except the opcode.
    pub fn new(opcode: Opcode) -> Header {
        Header {
            opcode,
            payload_len: 0,
            dst_qpn: 0,
            src_qpn: 0,
            psn: 0,
            flags: 0,
            syndrome: 0,
            imm: 0,
            rkey: 0,
            addr: 0,
            arg0: 0,
            arg1: 0,
        }
    }

    /// Serializes the header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..2].copy_from_slice(&MAGIC.to_le_bytes());
        b[2] = VERSION;
        b[3] = self.opcode as u8;
        b[4..8].copy_from_slice(&self.payload_len.to_le_bytes());
        b[8..12].copy_from_slice(&self.dst_qpn.to_le_bytes());
        b[12..16].copy_from_slice(&self.src_qpn.to_le_bytes());
        b[16..20].copy_from_slice(&self.psn.to_le_bytes());
        b[20] = self.flags;
        b[21] = self.syndrome;
        b[24..28].copy_from_slice(&self.imm.to_le_bytes());
        b[28..32].copy_from_slice(&self.rkey.to_le_bytes());
        b[32..40].copy_from_slice(&self.addr.to_le_bytes());
        b[40..48].copy_from_slice(&self.arg0.to_le_bytes());
        b[48..56].copy_from_slice(&self.arg1.to_le_bytes());
        b
    }
}

/// Coalesces the encoded ACK `next` into the encoded ACK `last` before it:
/// if both are ACKs between the same two QPs, `last` takes `next`'s PSN
/// (an ACK acknowledges everything up to its PSN, so the later one alone
/// says what both said) and true is returned; otherwise nothing changes.
/// Anything that is not an encoded ACK header is left alone.
pub(crate) fn merge_ack(last: &mut [u8], next: &[u8]) -> bool {
    if last.len() != HEADER_LEN || next.len() != HEADER_LEN {
        return false;
    }
    let ack = Header::new(Opcode::Ack).encode();
    // Magic, version and opcode, then every field but the PSN (16..20):
    // the QPs (8..16) and the zero rest.
    let same = |b: &[u8]| b[..16] == next[..16] && b[20..] == next[20..];
    if next[..4] != ack[..4] || !same(last) {
        return false;
    }
    last[16..20].copy_from_slice(&next[16..20]);
    true
}

/// A decoded packet: header plus borrowed payload (the fuzz check's view; the
/// engine cuts packets out of its stream with `decode_header`).
#[cfg(any(test, feature = "fuzzing"))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Packet<'a> {
    /// The header.
    pub header: Header,
    /// Exactly `header.payload_len` bytes.
    pub payload: &'a [u8],
}

/// Why bytes are not a valid packet.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PacketError {
    /// Fewer bytes than the header or the announced payload.
    #[error("truncated packet: need {need} bytes, have {have}")]
    Truncated {
        /// Bytes needed.
        need: usize,
        /// Bytes present.
        have: usize,
    },
    /// Bytes after the announced payload.
    #[cfg(any(test, feature = "fuzzing"))]
    #[error("{extra} trailing bytes after the packet")]
    Trailing {
        /// How many.
        extra: usize,
    },
    /// Not our magic.
    #[error("bad magic {0:#06x}")]
    BadMagic(u16),
    /// Unknown wire version.
    #[error("unsupported version {0}")]
    BadVersion(u8),
    /// Unknown opcode byte.
    #[error("unknown opcode {0:#04x}")]
    BadOpcode(u8),
    /// A field holds a value not allowed for this opcode.
    #[error("invalid field {field} = {value:#x} in {opcode:?} packet")]
    BadField {
        /// The opcode.
        opcode: Opcode,
        /// The field name.
        field: &'static str,
        /// Its value.
        value: u64,
    },
}

fn u16_at(b: &[u8], off: usize) -> u16 {
    let mut a = [0u8; 2];
    a.copy_from_slice(&b[off..off + 2]);
    u16::from_le_bytes(a)
}
fn u32_at(b: &[u8], off: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[off..off + 4]);
    u32::from_le_bytes(a)
}
fn u64_at(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(a)
}

/// Decodes and validates the fixed header at the start of `buf` (extra bytes
/// are ignored; the payload is not looked at).
pub fn decode_header(buf: &[u8]) -> Result<Header, PacketError> {
    if buf.len() < HEADER_LEN {
        return Err(PacketError::Truncated {
            need: HEADER_LEN,
            have: buf.len(),
        });
    }
    let b = &buf[..HEADER_LEN];
    let magic = u16_at(b, 0);
    if magic != MAGIC {
        return Err(PacketError::BadMagic(magic));
    }
    if b[2] != VERSION {
        return Err(PacketError::BadVersion(b[2]));
    }
    let opcode = Opcode::from_u8(b[3]).ok_or(PacketError::BadOpcode(b[3]))?;
    let h = Header {
        opcode,
        payload_len: u32_at(b, 4),
        dst_qpn: u32_at(b, 8),
        src_qpn: u32_at(b, 12),
        psn: u32_at(b, 16),
        flags: b[20],
        syndrome: b[21],
        imm: u32_at(b, 24),
        rkey: u32_at(b, 28),
        addr: u64_at(b, 32),
        arg0: u64_at(b, 40),
        arg1: u64_at(b, 48),
    };
    let bad = |field: &'static str, value: u64| {
        Err(PacketError::BadField {
            opcode,
            field,
            value,
        })
    };
    let reserved = u16_at(b, 22);
    if reserved != 0 {
        return bad("reserved", u64::from(reserved));
    }
    if h.flags & !FLAGS_KNOWN != 0 {
        return bad("flags", u64::from(h.flags));
    }
    if h.payload_len > MAX_PAYLOAD {
        return bad("payload_len", u64::from(h.payload_len));
    }
    for (name, v) in [
        ("dst_qpn", h.dst_qpn),
        ("src_qpn", h.src_qpn),
        ("psn", h.psn),
    ] {
        if v > 0x00ff_ffff {
            return bad(name, u64::from(v));
        }
    }
    if h.opcode != Opcode::Nak && h.syndrome != 0 {
        return bad("syndrome", u64::from(h.syndrome));
    }
    let len = u64::from(h.payload_len);
    if opcode.carries_segment() {
        if h.arg0 > MAX_MSG {
            return bad("message length", h.arg0);
        }
        match h.arg1.checked_add(len) {
            Some(end) if end <= h.arg0 => {
                if (h.flags & FLAG_FIRST != 0) != (h.arg1 == 0) {
                    return bad("flags", u64::from(h.flags));
                }
                if (h.flags & FLAG_LAST != 0) != (end == h.arg0) {
                    return bad("flags", u64::from(h.flags));
                }
            }
            _ => return bad("offset", h.arg1),
        }
        if len == 0 && h.arg0 != 0 {
            return bad("payload_len", 0);
        }
    } else if opcode.is_datagram() {
        if h.payload_len > UD_MTU {
            return bad("payload_len", len);
        }
        if h.flags & (FLAG_FIRST | FLAG_LAST) != FLAG_FIRST | FLAG_LAST {
            return bad("flags", u64::from(h.flags));
        }
        if h.arg0 > 0xff {
            return bad("hop limit", h.arg0);
        }
        if h.arg1 != 0 {
            return bad("arg1", h.arg1);
        }
        if h.addr != 0 {
            return bad("addr", h.addr);
        }
        if opcode == Opcode::Datagram && h.imm != 0 {
            return bad("imm", u64::from(h.imm));
        }
    } else if opcode == Opcode::Hello {
        if h.payload_len as usize != HELLO_LEN {
            return bad("payload_len", len);
        }
    } else if opcode == Opcode::Verify {
        if h.payload_len as usize != VERIFY_LEN {
            return bad("payload_len", len);
        }
    } else if len != 0 {
        return bad("payload_len", len);
    }
    match opcode {
        Opcode::Write | Opcode::WriteImm | Opcode::ReadReq => {
            let msg = h.arg0;
            if opcode == Opcode::ReadReq && msg > MAX_MSG {
                return bad("length", msg);
            }
            if h.addr.checked_add(msg).is_none() {
                return bad("addr", h.addr);
            }
        }
        Opcode::CmpSwap | Opcode::FetchAdd if h.addr & 7 != 0 => {
            return bad("addr", h.addr);
        }
        Opcode::VerifyReply if h.arg0 > 1 => {
            return bad("answer", h.arg0);
        }
        Opcode::Ping | Opcode::Pong => {
            for (name, v) in [
                ("dst_qpn", u64::from(h.dst_qpn)),
                ("src_qpn", u64::from(h.src_qpn)),
                ("psn", u64::from(h.psn)),
                ("flags", u64::from(h.flags)),
                ("imm", u64::from(h.imm)),
                ("rkey", u64::from(h.rkey)),
                ("addr", h.addr),
                ("arg1", h.arg1),
            ] {
                if v != 0 {
                    return bad(name, v);
                }
            }
        }
        Opcode::Nak => {
            if !(NAK_RNR..=NAK_REM_INV_REQ).contains(&h.syndrome) {
                return bad("syndrome", u64::from(h.syndrome));
            }
            if h.arg0 > 31 {
                return bad("rnr timer", h.arg0);
            }
        }
        _ => {}
    }
    Ok(h)
}

/// Decodes exactly one packet: header plus payload, nothing after it.
/// Never panics, whatever the input.
#[cfg(any(test, feature = "fuzzing"))]
pub fn decode(buf: &[u8]) -> Result<Packet<'_>, PacketError> {
    let header = decode_header(buf)?;
    let total = HEADER_LEN + header.payload_len as usize;
    if buf.len() < total {
        return Err(PacketError::Truncated {
            need: total,
            have: buf.len(),
        });
    }
    if buf.len() > total {
        return Err(PacketError::Trailing {
            extra: buf.len() - total,
        });
    }
    let payload = &buf[HEADER_LEN..total];
    if header.opcode == Opcode::Hello {
        // Its own error names the bad field (family or IPv4-mapped address).
        decode_hello(payload)?;
    }
    if header.opcode == Opcode::Verify {
        decode_verify(payload)?;
    }
    Ok(Packet { header, payload })
}

/// Encodes a HELLO payload: family (4 or 6), 16 address bytes, port.
pub fn encode_hello(addr: SocketAddr) -> [u8; HELLO_LEN] {
    let mut b = [0u8; HELLO_LEN];
    match addr.ip() {
        IpAddr::V4(v4) => {
            b[0] = 4;
            b[1..17].copy_from_slice(&v4.to_ipv6_mapped().octets());
        }
        IpAddr::V6(v6) => {
            b[0] = 6;
            b[1..17].copy_from_slice(&v6.octets());
        }
    }
    b[17..19].copy_from_slice(&addr.port().to_le_bytes());
    b
}

/// Encodes a VERIFY payload: `asker` (the asking engine's listener) and
/// `src` (the source address of the connection asked about, as the asker
/// saw it), each as a HELLO payload.
pub fn encode_verify(asker: SocketAddr, src: SocketAddr) -> [u8; VERIFY_LEN] {
    let mut b = [0u8; VERIFY_LEN];
    b[..HELLO_LEN].copy_from_slice(&encode_hello(asker));
    b[HELLO_LEN..].copy_from_slice(&encode_hello(src));
    b
}

/// Decodes a VERIFY payload: `(asker, src)` (see [`encode_verify`]).
pub fn decode_verify(p: &[u8]) -> Result<(SocketAddr, SocketAddr), PacketError> {
    if p.len() != VERIFY_LEN {
        return Err(PacketError::BadField {
            opcode: Opcode::Verify,
            field: "payload_len",
            value: p.len() as u64,
        });
    }
    let addr = |b: &[u8]| {
        decode_hello(b).map_err(|e| match e {
            PacketError::BadField { field, value, .. } => PacketError::BadField {
                opcode: Opcode::Verify,
                field,
                value,
            },
            other => other,
        })
    };
    Ok((addr(&p[..HELLO_LEN])?, addr(&p[HELLO_LEN..])?))
}

/// Decodes a HELLO payload.
pub fn decode_hello(p: &[u8]) -> Result<SocketAddr, PacketError> {
    if p.len() != HELLO_LEN {
        return Err(PacketError::BadField {
            opcode: Opcode::Hello,
            field: "payload_len",
            value: p.len() as u64,
        });
    }
    let mut oct = [0u8; 16];
    oct.copy_from_slice(&p[1..17]);
    let v6 = Ipv6Addr::from(oct);
    let port = u16_at(p, 17);
    let ip = match p[0] {
        4 => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                return Err(PacketError::BadField {
                    opcode: Opcode::Hello,
                    field: "ipv4 address",
                    value: 4,
                })
            }
        },
        6 => IpAddr::V6(v6),
        f => {
            return Err(PacketError::BadField {
                opcode: Opcode::Hello,
                field: "address family",
                value: u64::from(f),
            })
        }
    };
    Ok(SocketAddr::new(ip, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    struct XorShift(u64);
    impl XorShift {
        fn next(&mut self) -> u64 {
            let mut x = self.0;
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            self.0 = x;
            x
        }
    }

    fn packet(h: Header, payload: &[u8]) -> Vec<u8> {
        let mut v = h.encode().to_vec();
        v.extend_from_slice(payload);
        v
    }

    fn samples() -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let mut h = Header::new(Opcode::Send);
        h.payload_len = 5;
        h.arg0 = 5;
        h.flags = FLAG_FIRST | FLAG_LAST;
        h.dst_qpn = 7;
        h.psn = 99;
        out.push(packet(h, b"hello"));
        let mut w = Header::new(Opcode::Write);
        w.payload_len = 4;
        w.arg0 = 12;
        w.arg1 = 8;
        w.flags = FLAG_LAST;
        w.addr = 0x1000;
        w.rkey = 0xdead;
        out.push(packet(w, b"abcd"));
        let mut a = Header::new(Opcode::CmpSwap);
        a.addr = 0x2000;
        a.arg0 = 1;
        a.arg1 = 2;
        out.push(packet(a, &[]));
        let mut n = Header::new(Opcode::Nak);
        n.syndrome = NAK_RNR;
        n.arg0 = 12;
        out.push(packet(n, &[]));
        let mut d = Header::new(Opcode::DatagramImm);
        d.payload_len = 3;
        d.flags = FLAG_FIRST | FLAG_LAST;
        d.rkey = 0x1111_1111;
        d.imm = 7;
        d.arg0 = 64;
        out.push(packet(d, b"abc"));
        let mut hello = Header::new(Opcode::Hello);
        hello.payload_len = HELLO_LEN as u32;
        out.push(packet(
            hello,
            &encode_hello("127.0.0.1:4242".parse().expect("literal")),
        ));
        let mut ping = Header::new(Opcode::Ping);
        ping.arg0 = 77;
        out.push(packet(ping, &[]));
        let mut pong = Header::new(Opcode::Pong);
        pong.arg0 = 77;
        out.push(packet(pong, &[]));
        out
    }

    #[test]
    fn valid_packets_round_trip() {
        for s in samples() {
            let p = decode(&s).expect("valid sample");
            let mut again = p.header.encode().to_vec();
            again.extend_from_slice(p.payload);
            assert_eq!(again, s);
        }
        let addr: SocketAddr = "[::1]:7".parse().expect("literal");
        assert_eq!(decode_hello(&encode_hello(addr)), Ok(addr));
    }

    #[test]
    fn rejects_bad_fields() {
        let s = &samples()[0];
        let mut bad = s.clone();
        bad[0] = 0;
        assert!(matches!(decode(&bad), Err(PacketError::BadMagic(_))));
        let mut bad = s.clone();
        bad[2] = 1;
        assert_eq!(decode(&bad), Err(PacketError::BadVersion(1)));
        let mut bad = s.clone();
        bad[3] = 0x77;
        assert_eq!(decode(&bad), Err(PacketError::BadOpcode(0x77)));
        let mut bad = s.clone();
        bad.push(0);
        assert_eq!(decode(&bad), Err(PacketError::Trailing { extra: 1 }));
        // offset + len beyond the message length
        let mut h = Header::new(Opcode::Send);
        h.payload_len = 4;
        h.arg0 = 3;
        h.flags = FLAG_FIRST | FLAG_LAST;
        assert!(matches!(
            decode(&packet(h, b"abcd")),
            Err(PacketError::BadField { .. })
        ));
        // misaligned atomic
        let mut a = Header::new(Opcode::FetchAdd);
        a.addr = 3;
        assert!(decode(&packet(a, &[])).is_err());
    }

    #[test]
    fn datagrams_are_single_packets_of_at_most_one_mtu() {
        let mut d = Header::new(Opcode::Datagram);
        d.flags = FLAG_FIRST | FLAG_LAST;
        d.rkey = 5;
        d.payload_len = UD_MTU;
        let full = vec![1u8; UD_MTU as usize];
        assert!(decode(&packet(d, &full)).is_ok());
        let field = |h: Header, payload: &[u8]| match decode(&packet(h, payload)) {
            Err(PacketError::BadField { field, .. }) => field,
            other => panic!("expected a bad field, got {other:?}"),
        };
        let mut big = d;
        big.payload_len = UD_MTU + 1;
        assert_eq!(field(big, &vec![1u8; UD_MTU as usize + 1]), "payload_len");
        let mut first_only = d;
        first_only.flags = FLAG_FIRST;
        assert_eq!(field(first_only, &full), "flags");
        let mut imm = d;
        imm.imm = 1;
        assert_eq!(field(imm, &full), "imm");
        let mut hop = d;
        hop.arg0 = 256;
        assert_eq!(field(hop, &full), "hop limit");
        let mut off = d;
        off.arg1 = 1;
        assert_eq!(field(off, &full), "arg1");
        let mut addr = d;
        addr.addr = 8;
        assert_eq!(field(addr, &full), "addr");
        let mut with_imm = d;
        with_imm.opcode = Opcode::DatagramImm;
        with_imm.imm = 1;
        with_imm.flags |= FLAG_SOLICITED;
        assert!(decode(&packet(with_imm, &full)).is_ok());
    }

    #[test]
    fn bad_hello_names_the_bad_field() {
        let mut h = Header::new(Opcode::Hello);
        h.payload_len = HELLO_LEN as u32;
        let good = encode_hello("10.1.2.3:99".parse().expect("literal"));
        let field = |payload: &[u8]| match decode(&packet(h, payload)) {
            Err(PacketError::BadField { field, .. }) => field,
            other => panic!("expected a bad field, got {other:?}"),
        };
        // Family 4 with an address that is not IPv4-mapped.
        let mut bad = good;
        bad[11] = 0;
        assert_eq!(field(&bad), "ipv4 address");
        // Unknown family.
        let mut bad = good;
        bad[0] = 9;
        assert_eq!(field(&bad), "address family");
        assert!(decode(&packet(h, &good)).is_ok());
    }

    #[test]
    fn decode_never_panics_on_random_or_mutated_input() {
        let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
        let samples = samples();
        let mut ok = 0usize;
        for i in 0..200_000u32 {
            let buf: Vec<u8> = if i % 2 == 0 {
                let len = (rng.next() % 160) as usize;
                (0..len).map(|_| rng.next() as u8).collect()
            } else {
                let mut b = samples[(rng.next() % samples.len() as u64) as usize].clone();
                let flips = 1 + rng.next() % 4;
                for _ in 0..flips {
                    let pos = (rng.next() % b.len() as u64) as usize;
                    b[pos] ^= 1 << (rng.next() % 8);
                }
                if rng.next() & 3 == 0 {
                    let cut = (rng.next() % (b.len() as u64 + 1)) as usize;
                    b.truncate(cut);
                }
                b
            };
            if decode(&buf).is_ok() {
                ok += 1;
            }
            let _ = decode_header(&buf);
        }
        // Some mutations (e.g. in imm or psn) stay valid; most must not.
        assert!(ok > 0 && ok < 200_000, "ok = {ok}");
        for s in &samples {
            for cut in 0..s.len() {
                assert!(
                    matches!(decode(&s[..cut]), Err(PacketError::Truncated { .. })),
                    "cut {cut}"
                );
            }
        }
    }
}
