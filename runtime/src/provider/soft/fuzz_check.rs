//! The property checks of the packet codec and of the handshake before a
//! peer is proven, for the fuzz targets `fuzz/fuzz_targets/soft_packet.rs`
//! and `soft_handshake.rs` and `tests/fuzz_replay.rs` (through
//! `verbio_ops::fuzz_checks::soft_packet` and `soft_handshake`). It lives here because the codec is
//! private to the device. Compiled only with the `fuzzing` feature; a failed
//! property panics, so none of this is for production paths.

use std::fmt;

use super::handshake::{self, Expect, Message, PRE_PROOF_MAX};
use super::packet::{
    self, Header, Opcode, FLAG_FIRST, FLAG_LAST, FLAG_SOLICITED, HEADER_LEN, HELLO_LEN, NAK_RNR,
};

/// Where the packet header keeps its payload length: a little-endian `u32`
/// at this offset, counting what follows the header.
#[doc(hidden)]
pub const SOFT_PACKET_LEN_OFFSET: usize = 4;
/// Bytes of the packet header (before the counted payload).
#[doc(hidden)]
pub const SOFT_PACKET_HEADER_LEN: usize = HEADER_LEN;

/// Formats `value` into nothing: runs its `Display` code without allocating.
fn display(value: &impl fmt::Display) {
    struct Sink;
    impl fmt::Write for Sink {
        fn write_str(&mut self, _: &str) -> fmt::Result {
            Ok(())
        }
    }
    // Writing to `Sink` cannot fail; a Display impl that returns an error is
    // itself a bug worth a panic.
    fmt::write(&mut Sink, format_args!("{value}")).expect("Display of a decode error failed");
}

/// Decodes `data` with `decode_header`, `decode` and `decode_hello` and
/// requires them to agree; whatever decodes must re-encode to the very same
/// bytes (the format has one encoding per packet). Returns whether `data`
/// decoded as a whole packet.
///
/// # Panics
///
/// On any violated property (that is the point).
#[doc(hidden)]
pub fn check_soft_packet(data: &[u8]) -> bool {
    if let Ok(addr) = packet::decode_hello(data) {
        assert_eq!(
            packet::encode_hello(addr).as_slice(),
            data,
            "hello payload is not canonical: {addr}"
        );
    }
    let header = packet::decode_header(data);
    match &header {
        Ok(h) => {
            let bytes = h.encode();
            assert_eq!(
                bytes.as_slice(),
                &data[..HEADER_LEN],
                "header re-encodes differently: {h:?}"
            );
            assert_eq!(packet::decode_header(&bytes).as_ref(), Ok(h));
        }
        Err(e) => display(e),
    }
    let p = match packet::decode(data) {
        Ok(p) => p,
        Err(e) => {
            display(&e);
            return false;
        }
    };
    assert_eq!(header, Ok(p.header), "decode and decode_header disagree");
    assert_eq!(
        p.payload.len(),
        p.header.payload_len as usize,
        "payload length: {:?}",
        p.header
    );
    let mut again = Vec::with_capacity(data.len());
    again.extend_from_slice(&p.header.encode());
    again.extend_from_slice(p.payload);
    assert_eq!(again, data, "packet re-encodes differently: {:?}", p.header);
    if p.header.opcode.is_datagram() {
        let h = &p.header;
        assert!(
            h.payload_len <= packet::UD_MTU
                && h.flags & (FLAG_FIRST | FLAG_LAST) == FLAG_FIRST | FLAG_LAST
                && h.arg0 <= 0xff
                && h.arg1 == 0
                && h.addr == 0
                && (h.opcode == Opcode::DatagramImm || h.imm == 0),
            "decode accepted a datagram the engine cannot take: {h:?}"
        );
    }
    if p.header.opcode == Opcode::Hello {
        match packet::decode_hello(p.payload) {
            Ok(addr) => assert_eq!(packet::encode_hello(addr).as_slice(), p.payload),
            Err(e) => panic!("decode accepted a hello that decode_hello refuses: {e}"),
        }
    }
    if p.header.opcode == Opcode::Verify {
        match packet::decode_verify(p.payload) {
            Ok((asker, src)) => assert_eq!(packet::encode_verify(asker, src).as_slice(), p.payload),
            Err(e) => panic!("decode accepted a verify that decode_verify refuses: {e}"),
        }
    }
    true
}

fn packet(name: &'static str, h: Header, payload: &[u8]) -> (&'static str, Vec<u8>) {
    let mut h = h;
    h.payload_len = payload.len() as u32;
    let mut bytes = h.encode().to_vec();
    bytes.extend_from_slice(payload);
    (name, bytes)
}

/// A segment of a message of `total` bytes at `offset`, flags set to match.
fn segment(opcode: Opcode, total: u64, offset: u64, len: u64) -> Header {
    let mut h = Header::new(opcode);
    h.dst_qpn = 0x00_0101;
    h.src_qpn = 0x00_0202;
    h.psn = 0xff_fffe;
    h.arg0 = total;
    h.arg1 = offset;
    if offset == 0 {
        h.flags |= FLAG_FIRST;
    }
    if offset + len == total {
        h.flags |= FLAG_LAST;
    }
    h
}

/// One valid packet of every opcode (and first/middle/last segments), by name.
#[doc(hidden)]
pub fn soft_packet_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let payload: Vec<u8> = (0..64u8).collect();
    let mut send_imm = segment(Opcode::SendImm, 64, 0, 64);
    send_imm.imm = 0xcafe_babe;
    send_imm.flags |= FLAG_SOLICITED;
    let mut write = segment(Opcode::Write, 192, 64, 64);
    write.addr = 0x7f00_0000_0000;
    write.rkey = 0x4242;
    let mut write_imm = segment(Opcode::WriteImm, 128, 64, 64);
    write_imm.addr = 0x1000;
    write_imm.rkey = 7;
    write_imm.imm = 99;
    let mut read_req = Header::new(Opcode::ReadReq);
    read_req.addr = 0x2000;
    read_req.rkey = 9;
    read_req.arg0 = 1 << 20;
    let mut cmp_swap = Header::new(Opcode::CmpSwap);
    cmp_swap.addr = 0x3008;
    cmp_swap.rkey = 3;
    cmp_swap.arg0 = 1;
    cmp_swap.arg1 = 2;
    let mut fetch_add = Header::new(Opcode::FetchAdd);
    fetch_add.addr = 0x3010;
    fetch_add.arg0 = 5;
    let mut send_inv = segment(Opcode::SendInv, 32, 0, 32);
    send_inv.rkey = 0x0000_0a07;
    let mut ack = Header::new(Opcode::Ack);
    ack.psn = 0x12_3456;
    let mut nak = Header::new(Opcode::Nak);
    nak.syndrome = NAK_RNR;
    nak.arg0 = 14;
    let mut atomic_resp = Header::new(Opcode::AtomicResp);
    atomic_resp.arg0 = u64::MAX;
    let mut datagram = Header::new(Opcode::Datagram);
    datagram.flags = FLAG_FIRST | FLAG_LAST;
    datagram.dst_qpn = 0x00_0101;
    datagram.src_qpn = 0x00_0202;
    datagram.psn = 0x00_0007;
    datagram.rkey = 0x1111_1111;
    datagram.arg0 = 64;
    let mut datagram_imm = datagram;
    datagram_imm.opcode = Opcode::DatagramImm;
    datagram_imm.imm = 0xdead_beef;
    datagram_imm.flags |= FLAG_SOLICITED;
    let hello4 = packet::encode_hello("127.0.0.1:4791".parse().expect("literal"));
    let hello6 = packet::encode_hello("[fe80::7]:4791".parse().expect("literal"));
    debug_assert_eq!(hello4.len(), HELLO_LEN);
    let verify = packet::encode_verify(
        "127.0.0.1:4791".parse().expect("literal"),
        "[::ffff:127.0.0.1]:40000".parse().expect("literal"),
    );
    let mut verify_reply = Header::new(Opcode::VerifyReply);
    verify_reply.arg0 = 1;
    let mut ping = Header::new(Opcode::Ping);
    ping.arg0 = 3;
    let mut pong = Header::new(Opcode::Pong);
    pong.arg0 = 3;
    vec![
        packet("hello-v4", Header::new(Opcode::Hello), &hello4),
        packet("hello-v6", Header::new(Opcode::Hello), &hello6),
        packet("verify", Header::new(Opcode::Verify), &verify),
        packet("verify-reply", verify_reply, &[]),
        packet(
            "send-only",
            segment(Opcode::Send, 16, 0, 16),
            &payload[..16],
        ),
        packet("send-empty", segment(Opcode::Send, 0, 0, 0), &[]),
        packet("send-imm", send_imm, &payload),
        packet("send-inv", send_inv, &payload[..32]),
        packet("send-middle", segment(Opcode::Send, 256, 64, 64), &payload),
        packet("write-middle", write, &payload),
        packet("write-imm-last", write_imm, &payload),
        packet("read-req", read_req, &[]),
        packet(
            "read-resp-first",
            segment(Opcode::ReadResp, 96, 0, 64),
            &payload,
        ),
        packet("cmp-swap", cmp_swap, &[]),
        packet("fetch-add", fetch_add, &[]),
        packet("ack", ack, &[]),
        packet("nak-rnr", nak, &[]),
        packet("atomic-resp", atomic_resp, &[]),
        packet("datagram", datagram, &payload[..32]),
        packet("datagram-imm", datagram_imm, &payload),
        packet("datagram-empty", datagram, &[]),
        packet("ping", ping, &[]),
        packet("pong", pong, &[]),
    ]
}

/// Where, in an input of the `soft_handshake` target, the first packet
/// header keeps its payload length (after the one byte naming the side).
#[doc(hidden)]
pub const SOFT_HANDSHAKE_LEN_OFFSET: usize = 1 + SOFT_PACKET_LEN_OFFSET;
/// Bytes of an input of the `soft_handshake` target before the first
/// packet's counted payload.
#[doc(hidden)]
pub const SOFT_HANDSHAKE_HEADER_LEN: usize = 1 + HEADER_LEN;

/// The handshake an engine runs on a connection before its peer is
/// proven, fed `data[1..]` as what the connection received; `data[0] % 3`
/// names the side: 0 a dialed connection (the dialed engine's HELLO), 1 an
/// accepted one (a HELLO or a VERIFY), 2 a verifier (HELLO, then
/// VERIFY_REPLY). Checks what `next_message` promises: it never waits for
/// more than `PRE_PROOF_MAX` bytes (the whole of what the engine buffers
/// before a proof), it never takes more than it was given, cutting the
/// bytes in two places gives what cutting them whole gives, and every
/// message re-encodes to the very bytes it was cut from. Returns whether a
/// message was cut.
///
/// # Panics
///
/// On any violated property (that is the point).
#[doc(hidden)]
pub fn check_soft_handshake(data: &[u8]) -> bool {
    let Some((&side, stream)) = data.split_first() else {
        return false;
    };
    let plan: &[Expect] = match side % 3 {
        0 => &[Expect::Hello],
        1 => &[Expect::HelloOrVerify],
        _ => &[Expect::Hello, Expect::VerifyReply],
    };
    let mut pos = 0;
    let mut cut = false;
    for &expect in plan {
        let rest = &stream[pos..];
        let whole = handshake::next_message(expect, rest);
        // The same bytes arriving in two reads: each prefix waits or
        // agrees with the whole.
        for split in [
            HEADER_LEN / 2,
            HEADER_LEN,
            HEADER_LEN + 7,
            PRE_PROOF_MAX - 1,
        ] {
            if split >= rest.len() {
                continue;
            }
            match handshake::next_message(expect, &rest[..split]) {
                Ok(None) => {}
                early => assert_eq!(early, whole, "a prefix of {split} bytes decides otherwise"),
            }
        }
        match whole {
            Ok(None) => {
                assert!(
                    rest.len() < PRE_PROOF_MAX,
                    "waits for more with {} bytes buffered",
                    rest.len()
                );
                return cut;
            }
            Ok(Some((msg, used))) => {
                assert!(
                    used <= rest.len() && used <= PRE_PROOF_MAX,
                    "took {used} bytes"
                );
                assert_eq!(
                    handshake::encode(msg).as_slice(),
                    &rest[..used],
                    "{msg:?} re-encodes differently"
                );
                cut = true;
                pos += used;
                // (The engine's next step depends on the message: a
                // verifier's HELLO only leads on.)
                if !matches!((expect, msg), (Expect::Hello, Message::Hello(_)) if plan.len() == 2) {
                    return cut;
                }
            }
            Err(e) => {
                display(&e);
                return cut;
            }
        }
    }
    cut
}

/// Valid handshakes of every side, and a few that stop early.
#[doc(hidden)]
pub fn soft_handshake_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let engine = "127.0.0.1:4791".parse().expect("literal");
    let peer = "[fe80::7]:4792".parse().expect("literal");
    let with = |side: u8, msgs: &[Message]| {
        let mut v = vec![side];
        for &m in msgs {
            v.extend_from_slice(&handshake::encode(m));
        }
        v
    };
    let verify = Message::Verify {
        asker: engine,
        src: "[::ffff:127.0.0.1]:40000".parse().expect("literal"),
    };
    let mut then_data = with(0, &[Message::Hello(engine)]);
    then_data.extend_from_slice(&Header::new(Opcode::Ack).encode());
    vec![
        ("dialed-hello", with(0, &[Message::Hello(engine)])),
        ("dialed-hello-then-ack", then_data),
        ("accepted-hello-v6", with(1, &[Message::Hello(peer)])),
        ("accepted-verify", with(1, &[verify])),
        (
            "verifier-yes",
            with(2, &[Message::Hello(engine), Message::VerifyReply(true)]),
        ),
        (
            "verifier-no",
            with(2, &[Message::Hello(engine), Message::VerifyReply(false)]),
        ),
    ]
}
