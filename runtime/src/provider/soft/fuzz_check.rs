//! The property check of the packet codec for the fuzz target
//! `fuzz/fuzz_targets/soft_packet.rs` and `tests/fuzz_replay.rs` (through
//! `verbio_ops::fuzz_checks::soft_packet`). It lives here because the codec is
//! private to the device. Compiled only with the `fuzzing` feature; a failed
//! property panics, so none of this is for production paths.

use std::fmt;

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
    ]
}
