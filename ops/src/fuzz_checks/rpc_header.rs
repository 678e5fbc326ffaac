//! Checks for the RPC packet header codec ([`crate::rpc::header`]).

use super::{display, LenField, Seed};
use crate::rpc::header::{Header, PacketKind, Status, HEADER_LEN, PAYLOAD_LEN_OFFSET};

/// The header's payload length: `u16` at offset 6, counting what follows the
/// 32-byte header.
pub const LEN_FIELD: LenField = LenField {
    offset: PAYLOAD_LEN_OFFSET,
    width: 2,
    counted_from: HEADER_LEN,
};

/// Decodes `data` with [`Header::decode`] and [`Header::decode_header`] and
/// requires them to agree; a decoded header must re-encode to the very same
/// 32 bytes (the codec has one canonical form) and its payload must be the
/// rest of the input. Returns whether `data` decoded as a whole packet.
///
/// # Panics
///
/// On any violated property (that is the point).
pub fn check(data: &[u8]) -> bool {
    let alone = data.first_chunk::<HEADER_LEN>().map(Header::decode_header);
    if let Some(Err(e)) = &alone {
        display(e);
    }
    match Header::decode(data) {
        Ok((h, payload)) => {
            assert_eq!(alone, Some(Ok(h)), "decode and decode_header disagree");
            assert_eq!(
                h.encode().as_slice(),
                &data[..HEADER_LEN],
                "header is not canonical: {h:?}"
            );
            assert_eq!(payload, &data[HEADER_LEN..], "payload is not the rest");
            assert_eq!(usize::from(h.payload_len), payload.len());
            true
        }
        Err(e) => {
            display(&e);
            if let Some(Ok(h)) = alone {
                assert_ne!(
                    usize::from(h.payload_len),
                    data.len() - HEADER_LEN,
                    "decode_header accepts, decode refuses a packet of the declared length"
                );
            }
            false
        }
    }
}

fn packet(h: Header, payload: &[u8]) -> Vec<u8> {
    let mut v = h.encode().to_vec();
    v.extend_from_slice(payload);
    v
}

/// One valid packet of every kind (and the first, middle and last packet of
/// a multi-packet message).
pub fn seeds() -> Vec<Seed> {
    let req = Header {
        req_type: 3,
        payload_len: 32,
        dest_session: 1,
        src_session: 2,
        req_num: 8 * 41 + 5,
        msg_len: 32,
        pkt_idx: 0,
        pkt_count: 1,
        ..Header::new(PacketKind::Request)
    };
    let big = Header {
        payload_len: 16,
        msg_len: 40,
        pkt_count: 3,
        ..req
    };
    vec![
        Seed::new("request", packet(req, &[0x11; 32])),
        Seed::new("request-first", packet(big, &[1; 16])),
        Seed::new(
            "request-last",
            packet(
                Header {
                    pkt_idx: 2,
                    payload_len: 8,
                    ..big
                },
                &[3; 8],
            ),
        ),
        Seed::new(
            "response",
            packet(
                Header {
                    kind: PacketKind::Response,
                    pkt_idx: 1,
                    ..big
                },
                &[2; 16],
            ),
        ),
        Seed::new(
            "response-empty",
            packet(
                Header {
                    kind: PacketKind::Response,
                    payload_len: 0,
                    msg_len: 0,
                    ..req
                },
                &[],
            ),
        ),
        Seed::new(
            "response-no-handler",
            packet(
                Header {
                    kind: PacketKind::Response,
                    status: Status::NoHandler,
                    payload_len: 0,
                    msg_len: 0,
                    ..req
                },
                &[],
            ),
        ),
        Seed::new(
            "credit-return",
            packet(
                Header {
                    dest_session: 2,
                    src_session: 1,
                    req_num: 333,
                    pkt_idx: 1,
                    ..Header::new(PacketKind::CreditReturn)
                },
                &[],
            ),
        ),
        Seed::new(
            "request-for-response",
            packet(
                Header {
                    dest_session: 1,
                    src_session: 2,
                    req_num: 333,
                    pkt_idx: 2,
                    ..Header::new(PacketKind::RequestForResponse)
                },
                &[],
            ),
        ),
        Seed::new(
            "credit-return-range",
            packet(
                Header {
                    dest_session: 2,
                    src_session: 1,
                    req_num: 333,
                    pkt_idx: 40,
                    pkt_count: 15,
                    ..Header::new(PacketKind::CreditReturn)
                },
                &[],
            ),
        ),
        Seed::new(
            "request-for-response-range",
            packet(
                Header {
                    dest_session: 1,
                    src_session: 2,
                    req_num: 333,
                    pkt_idx: 33,
                    pkt_count: 31,
                    ..Header::new(PacketKind::RequestForResponse)
                },
                &[],
            ),
        ),
        Seed::new(
            "connect",
            packet(
                Header {
                    src_session: 4,
                    req_num: 0x1234_5678_9abc_def0,
                    msg_len: 4096,
                    payload_len: 4,
                    ..Header::new(PacketKind::Connect)
                },
                &[9, 0, 0, 0],
            ),
        ),
        Seed::new(
            "connect-ack",
            packet(
                Header {
                    dest_session: 4,
                    src_session: 7,
                    req_num: 0x1234_5678_9abc_def0,
                    msg_len: 4096,
                    pkt_idx: 10_000,
                    pkt_count: 32,
                    ..Header::new(PacketKind::ConnectAck)
                },
                &[],
            ),
        ),
        Seed::new(
            "disconnect",
            packet(
                Header {
                    dest_session: 7,
                    src_session: 4,
                    ..Header::new(PacketKind::Disconnect)
                },
                &[],
            ),
        ),
        Seed::new(
            "ping",
            packet(
                Header {
                    dest_session: 7,
                    src_session: 4,
                    ..Header::new(PacketKind::Ping)
                },
                &[],
            ),
        ),
    ]
}
