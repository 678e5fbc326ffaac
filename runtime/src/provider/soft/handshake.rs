//! The packets a connection between engines carries before its peer proved
//! which engine it is: HELLO (the sender's listener address), VERIFY (an
//! engine asks the engine it dialed whether a connection is that engine's)
//! and VERIFY_REPLY. Cutting them out of the received bytes is one pure
//! function, [`next_message`], so that the bound on what an unproven peer
//! can make the engine buffer is checked in one place (and fuzzed: see
//! `fuzz_check.rs`).

use std::net::SocketAddr;

use super::packet::{
    decode_header, decode_hello, decode_verify, encode_hello, encode_verify, Header, Opcode,
    PacketError, HEADER_LEN, HELLO_LEN, VERIFY_LEN,
};

/// The largest packet a connection may send before its peer is proven (a
/// header with a VERIFY payload). Every other header is refused before a
/// byte of its payload is buffered.
pub(crate) const PRE_PROOF_MAX: usize = HEADER_LEN + VERIFY_LEN;

/// The receive buffer of a connection whose peer is not proven yet (the
/// buffer grows to its working size once the peer is proven).
pub(crate) const PRE_PROOF_BUF: usize = 256;

const _: () = assert!(PRE_PROOF_MAX <= PRE_PROOF_BUF);

/// What a connection may carry next, before its peer is proven.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// A connection this engine dialed: the dialed engine's HELLO.
    Hello,
    /// A connection this engine accepted: a HELLO (an engine that will send
    /// traffic) or a VERIFY (an engine asking about a connection).
    HelloOrVerify,
    /// A connection this engine dialed to ask (VERIFY): the dialed engine's
    /// HELLO came, now its answer.
    VerifyReply,
}

/// One handshake packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Message {
    /// The sender's listener address.
    Hello(SocketAddr),
    /// "Is the connection from `src` to my listener `asker` yours?"
    Verify {
        /// The asking engine's listener address.
        asker: SocketAddr,
        /// The source address of the connection asked about, as the asker
        /// saw it.
        src: SocketAddr,
    },
    /// The answer to a VERIFY.
    VerifyReply(bool),
}

/// The packet carrying `msg` (what [`next_message`] cuts).
pub fn encode(msg: Message) -> Vec<u8> {
    let mut out = Vec::with_capacity(PRE_PROOF_MAX);
    match msg {
        Message::Hello(addr) => {
            let mut h = Header::new(Opcode::Hello);
            h.payload_len = HELLO_LEN as u32;
            out.extend_from_slice(&h.encode());
            out.extend_from_slice(&encode_hello(addr));
        }
        Message::Verify { asker, src } => {
            let mut h = Header::new(Opcode::Verify);
            h.payload_len = VERIFY_LEN as u32;
            out.extend_from_slice(&h.encode());
            out.extend_from_slice(&encode_verify(asker, src));
        }
        Message::VerifyReply(yes) => {
            let mut h = Header::new(Opcode::VerifyReply);
            h.arg0 = u64::from(yes);
            out.extend_from_slice(&h.encode());
        }
    }
    out
}

/// Why a connection's first bytes are refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    /// Not a valid packet header or payload.
    #[error("bad handshake packet")]
    Packet(#[from] PacketError),
    /// A handshake packet with header fields set that it does not use.
    #[error("{0:?} packet with header fields that must be zero")]
    StrayFields(Opcode),
    /// A valid packet, but not one the connection may send now.
    #[error("{got:?} packet where {expected:?} was expected (the peer is not proven yet)")]
    Unexpected {
        /// The packet's opcode.
        got: Opcode,
        /// What the connection could send.
        expected: Expect,
    },
}

/// Cuts the next handshake message out of `buf`, the connection's
/// unprocessed bytes: `Ok(None)` if more bytes are needed (never more than
/// [`PRE_PROOF_MAX`] in all), else the message and how many bytes it took.
/// A header of any other packet is refused as soon as it is complete,
/// whatever length it announces.
pub fn next_message(
    expect: Expect,
    buf: &[u8],
) -> Result<Option<(Message, usize)>, HandshakeError> {
    if buf.len() < HEADER_LEN {
        return Ok(None);
    }
    let hdr = decode_header(buf)?;
    let allowed = match expect {
        Expect::Hello => hdr.opcode == Opcode::Hello,
        Expect::HelloOrVerify => matches!(hdr.opcode, Opcode::Hello | Opcode::Verify),
        Expect::VerifyReply => hdr.opcode == Opcode::VerifyReply,
    };
    if !allowed {
        return Err(HandshakeError::Unexpected {
            got: hdr.opcode,
            expected: expect,
        });
    }
    // Nothing but the opcode, the length and a reply's answer may be set.
    let mut canonical = Header::new(hdr.opcode);
    canonical.payload_len = hdr.payload_len;
    canonical.arg0 = if hdr.opcode == Opcode::VerifyReply {
        hdr.arg0
    } else {
        0
    };
    if hdr != canonical {
        return Err(HandshakeError::StrayFields(hdr.opcode));
    }
    // (`decode_header` fixed the payload length of these three opcodes.)
    let total = HEADER_LEN + hdr.payload_len as usize;
    debug_assert!(total <= PRE_PROOF_MAX);
    if buf.len() < total {
        return Ok(None);
    }
    let payload = &buf[HEADER_LEN..total];
    let msg = match hdr.opcode {
        Opcode::Hello => Message::Hello(decode_hello(payload)?),
        Opcode::Verify => {
            let (asker, src) = decode_verify(payload)?;
            Message::Verify { asker, src }
        }
        _ => Message::VerifyReply(hdr.arg0 == 1),
    };
    Ok(Some((msg, total)))
}

#[cfg(test)]
mod tests {
    use super::super::packet::{encode_hello, encode_verify, Header, HELLO_LEN, MAX_PAYLOAD};
    use super::*;

    fn hello(addr: &str) -> Vec<u8> {
        let mut h = Header::new(Opcode::Hello);
        h.payload_len = HELLO_LEN as u32;
        let mut v = h.encode().to_vec();
        v.extend_from_slice(&encode_hello(addr.parse().expect("literal")));
        v
    }

    #[test]
    fn a_hello_is_cut_whole_and_only_whole() {
        let b = hello("10.0.0.1:7");
        for cut in 0..b.len() {
            assert_eq!(next_message(Expect::Hello, &b[..cut]), Ok(None), "{cut}");
        }
        let mut more = b.clone();
        more.extend_from_slice(b"next");
        assert_eq!(
            next_message(Expect::Hello, &more),
            Ok(Some((
                Message::Hello("10.0.0.1:7".parse().expect("literal")),
                b.len()
            )))
        );
    }

    #[test]
    fn a_verify_round_trips_and_is_refused_where_a_hello_is_due() {
        let asker: SocketAddr = "127.0.0.1:5".parse().expect("literal");
        let src: SocketAddr = "[::1]:6".parse().expect("literal");
        let mut h = Header::new(Opcode::Verify);
        h.payload_len = VERIFY_LEN as u32;
        let mut b = h.encode().to_vec();
        b.extend_from_slice(&encode_verify(asker, src));
        assert_eq!(
            next_message(Expect::HelloOrVerify, &b),
            Ok(Some((Message::Verify { asker, src }, PRE_PROOF_MAX)))
        );
        assert!(matches!(
            next_message(Expect::Hello, &b),
            Err(HandshakeError::Unexpected { .. })
        ));
    }

    #[test]
    fn any_other_header_is_refused_before_its_payload_whatever_its_length() {
        let mut h = Header::new(Opcode::Send);
        h.payload_len = MAX_PAYLOAD;
        h.arg0 = u64::from(MAX_PAYLOAD);
        h.flags = 3;
        let b = h.encode();
        for expect in [Expect::Hello, Expect::HelloOrVerify, Expect::VerifyReply] {
            assert!(matches!(
                next_message(expect, &b),
                Err(HandshakeError::Unexpected {
                    got: Opcode::Send,
                    ..
                })
            ));
        }
        let mut stray = hello("10.0.0.1:7");
        stray[8] = 1; // dst_qpn
        assert_eq!(
            next_message(Expect::Hello, &stray),
            Err(HandshakeError::StrayFields(Opcode::Hello))
        );
        let mut bad = hello("10.0.0.1:7");
        bad[4] = 200; // a HELLO announcing 200 payload bytes
        assert!(matches!(
            next_message(Expect::Hello, &bad),
            Err(HandshakeError::Packet(_))
        ));
    }

    #[test]
    fn a_reply_says_yes_or_no_and_nothing_else() {
        let mut h = Header::new(Opcode::VerifyReply);
        h.arg0 = 1;
        assert_eq!(
            next_message(Expect::VerifyReply, &h.encode()),
            Ok(Some((Message::VerifyReply(true), HEADER_LEN)))
        );
        h.arg0 = 0;
        assert_eq!(
            next_message(Expect::VerifyReply, &h.encode()),
            Ok(Some((Message::VerifyReply(false), HEADER_LEN)))
        );
        h.arg0 = 2;
        assert!(next_message(Expect::VerifyReply, &h.encode()).is_err());
    }
}
