//! Checks for the MR-token agent's wire codec ([`crate::agent::wire`]).

use super::{display, LenField, Seed};
use crate::agent::wire::{self, HandOverKind, Message, MrToken, RefuseCode, Settings, WireError};

/// The agent header's body length: `u32` at offset 8, counting what follows
/// the 12-byte header.
pub const LEN_FIELD: LenField = LenField {
    offset: 8,
    width: 4,
    counted_from: wire::HEADER_LEN,
};

/// Decodes `data`; if it decodes, re-encodes it and requires the very same
/// bytes (the codec has exactly one encoding per message), and a buffer one
/// byte short must be refused. Returns whether `data` decoded.
///
/// # Panics
///
/// On any violated property (that is the point).
pub fn check(data: &[u8]) -> bool {
    let msg = match wire::decode(data) {
        Ok(msg) => msg,
        Err(e) => {
            display(&e);
            return false;
        }
    };
    let len = msg.encoded_len();
    assert_eq!(
        len,
        data.len(),
        "encoded_len disagrees with the decoded frame: {msg:?}"
    );
    let mut out = vec![0u8; len];
    let n = match msg.encode(&mut out) {
        Ok(n) => n,
        Err(e) => panic!("a decoded message does not re-encode ({e}): {msg:?}"),
    };
    assert_eq!(n, len, "encode wrote {n} bytes, encoded_len says {len}");
    assert_eq!(
        out.as_slice(),
        data,
        "re-encoding differs from the input (non-canonical form accepted?): {msg:?}"
    );
    // Decoding the re-encoded frame gives the same message (trivially true
    // after the byte comparison, but keeps the property explicit if the
    // comparison above is ever relaxed).
    assert_eq!(wire::decode(&out), Ok(msg));
    let short = len - 1; // len >= HEADER_LEN > 0
    assert!(
        matches!(
            msg.encode(&mut out[..short]),
            Err(WireError::BufferTooSmall { .. })
        ),
        "encode into a too-small buffer must fail: {msg:?}"
    );
    true
}

fn token(token_id: u64, access: u32) -> MrToken {
    MrToken {
        token_id,
        addr: 0x7f00_dead_0000,
        len: 1 << 16,
        rkey: 0x1234_5678,
        access,
        deadline_ms: 1_800_000_000_000,
        flags: 0,
    }
}

/// One valid frame of every message kind (and of each variant of a kind).
pub fn seeds() -> Vec<Seed> {
    let messages: [(&'static str, Message<'static>); 18] = [
        ("credit", Message::Credit { grant: 32 }),
        (
            "alloc-request",
            Message::AllocRequest {
                req_id: 1,
                len: 1 << 20,
                align: 64,
                access: 0b0111,
                lifetime_ms: 30_000,
            },
        ),
        (
            "alloc-response-ok",
            Message::AllocResponse {
                req_id: 1,
                result: Ok(token(11, 0b0110)),
            },
        ),
        (
            "alloc-response-refused",
            Message::AllocResponse {
                req_id: 2,
                result: Err(RefuseCode::NoMemory),
            },
        ),
        (
            "alloc-response-other-code",
            Message::AllocResponse {
                req_id: 3,
                result: Err(RefuseCode::Other(0x0102)),
            },
        ),
        ("release", Message::Release { token_id: 11 }),
        (
            "hand-over-local",
            Message::HandOver {
                kind: HandOverKind::Local,
                tag: 5,
                token: token(12, 0b0010),
            },
        ),
        (
            "hand-over-remote",
            Message::HandOver {
                kind: HandOverKind::Remote,
                tag: 6,
                token: token(13, 0b1111),
            },
        ),
        (
            "data-first-piece",
            Message::Data {
                msg_id: 1,
                total_len: 64,
                offset: 0,
                imm: None,
                grant: 0,
                payload: b"the first piece of a longer message",
            },
        ),
        (
            "whole-imm",
            Message::Whole {
                imm: Some(0xfeed_f00d),
                grant: 0,
                payload: b"whole",
            },
        ),
        (
            "whole-grant",
            Message::Whole {
                imm: None,
                grant: 4,
                payload: b"with credits",
            },
        ),
        (
            "whole-empty",
            Message::Whole {
                imm: None,
                grant: 0,
                payload: b"",
            },
        ),
        (
            "error",
            Message::Error {
                code: 4,
                text: "unknown token 42 (ünïcödé)",
            },
        ),
        ("close", Message::Close),
        (
            "packed",
            Message::Packed {
                grant: 2,
                // Invariant: well-formed entries ("ab", then "c" with an immediate).
                entries: wire::PackedEntries::new(
                    b"\x02\x00\x00\x00ab\x01\x00\x00\x80\x0d\xf0\xed\xfec",
                )
                .expect("seed pack is well-formed"),
            },
        ),
        ("abort", Message::Abort { msg_id: 7 }),
        (
            "slot-grant",
            Message::SlotGrant {
                slot: 3,
                addr: 0x7f00_beef_0000,
                len: 1 << 20,
                rkey: 0x0bad_cafe,
            },
        ),
        (
            "settings",
            Message::Settings(Settings {
                max_message_len: 64 << 20,
                recv_buf_size: 4096,
                recv_buf_count: 16,
                credit_batch: 4,
                max_recv_wr: 35,
            }),
        ),
    ];
    messages
        .iter()
        .map(|(name, msg)| {
            let mut out = vec![0u8; msg.encoded_len()];
            // Invariant: the buffer has encoded_len bytes and every sample is valid.
            let n = msg.encode(&mut out).expect("seed message encodes");
            out.truncate(n);
            Seed::new(name, out)
        })
        .collect()
}
