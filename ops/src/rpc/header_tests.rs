//! The packet header codec's unit tests.

use super::header::*;

fn request() -> Header {
    Header {
        req_type: 7,
        payload_len: 5,
        dest_session: 3,
        src_session: 9,
        req_num: 8 * 1000 + 2,
        msg_len: 5,
        pkt_idx: 0,
        pkt_count: 1,
        ..Header::new(PacketKind::Request)
    }
}

fn packet(h: &Header, payload: &[u8]) -> Vec<u8> {
    let mut v = h.encode().to_vec();
    v.extend_from_slice(payload);
    v
}

#[test]
fn round_trip() {
    let h = request();
    let p = packet(&h, b"hello");
    let (d, payload) = Header::decode(&p).unwrap();
    assert_eq!(d, h);
    assert_eq!(payload, b"hello");
    assert_eq!(d.encode().as_slice(), &p[..HEADER_LEN]);
}

#[test]
fn refuses_malformed_input() {
    let good = packet(&request(), b"hello");
    assert_eq!(
        Header::decode(&good[..10]),
        Err(HeaderError::Truncated { len: 10 })
    );
    let mut bad = good.clone();
    bad[0] = b'x';
    assert!(matches!(
        Header::decode(&bad),
        Err(HeaderError::BadMagic { .. })
    ));
    let mut bad = good.clone();
    bad[2] = 2;
    assert_eq!(
        Header::decode(&bad),
        Err(HeaderError::UnsupportedVersion { found: 2 })
    );
    let mut bad = good.clone();
    bad[3] = 0;
    assert_eq!(
        Header::decode(&bad),
        Err(HeaderError::UnknownKind { found: 0 })
    );
    let mut bad = good.clone();
    bad[5] = 1;
    assert!(matches!(
        Header::decode(&bad),
        Err(HeaderError::UnusedFieldSet {
            field: "status",
            ..
        })
    ));
    let mut resp = good.clone();
    resp[3] = PacketKind::Response as u8;
    resp[5] = 9;
    assert!(matches!(
        Header::decode(&resp),
        Err(HeaderError::OutOfRange {
            field: "status",
            ..
        })
    ));
    resp[5] = Status::NoHandler as u8;
    assert!(
        Header::decode(&resp).is_err(),
        "an error response with a body"
    );
    assert!(matches!(
        Header::decode(&good[..good.len() - 1]),
        Err(HeaderError::LengthMismatch {
            declared: 5,
            actual: 4
        })
    ));
    let h = Header {
        pkt_idx: 1,
        ..request()
    };
    let e = Header::decode(&packet(&h, b"hello")).unwrap_err();
    assert!(e.to_string().contains("pkt_idx = 1"), "{e}");
    let h = Header {
        msg_len: 2,
        ..request()
    };
    assert!(Header::decode(&packet(&h, b"hello")).is_err());
    let h = Header {
        pkt_idx: 1,
        msg_len: 4096,
        payload_len: 4,
        ..Header::new(PacketKind::Connect)
    };
    assert!(matches!(
        Header::decode(&h.encode()),
        Err(HeaderError::UnusedFieldSet {
            field: "pkt_idx",
            ..
        })
    ));
    let h = Header {
        pkt_idx: 0,
        ..Header::new(PacketKind::RequestForResponse)
    };
    assert!(Header::decode(&h.encode()).is_err());
    let h = Header {
        req_num: 1,
        ..Header::new(PacketKind::Ping)
    };
    assert!(matches!(
        Header::decode(&h.encode()),
        Err(HeaderError::UnusedFieldSet {
            field: "req_num",
            ..
        })
    ));
}

#[test]
fn every_kind_round_trips() {
    let headers = [
        request(),
        Header {
            kind: PacketKind::Response,
            ..request()
        },
        Header {
            kind: PacketKind::Response,
            status: Status::HandlerPanicked,
            payload_len: 0,
            msg_len: 0,
            ..request()
        },
        Header {
            pkt_idx: 3,
            req_num: 12,
            ..Header::new(PacketKind::CreditReturn)
        },
        Header {
            pkt_idx: 2,
            ..Header::new(PacketKind::RequestForResponse)
        },
        Header {
            msg_len: 4096,
            payload_len: 4,
            src_session: 1,
            ..Header::new(PacketKind::Connect)
        },
        Header {
            msg_len: 4096,
            dest_session: 1,
            src_session: 2,
            pkt_idx: 10_000,
            ..Header::new(PacketKind::ConnectAck)
        },
        Header::new(PacketKind::Disconnect),
        Header {
            dest_session: 3,
            src_session: 4,
            ..Header::new(PacketKind::Ping)
        },
        Header {
            req_num: 5,
            pkt_idx: 1,
            payload_len: 76,
            ..Header::new(PacketKind::BulkConnect)
        },
        Header {
            req_num: 5,
            payload_len: 12,
            ..Header::new(PacketKind::BulkConnectAck)
        },
        Header {
            req_type: 3,
            req_num: 9,
            msg_len: 1 << 24,
            pkt_count: 1,
            payload_len: 16,
            ..Header::new(PacketKind::ReadRequest)
        },
        Header {
            req_num: 9,
            msg_len: 1,
            pkt_count: 1,
            payload_len: 16,
            ..Header::new(PacketKind::ReadResponse)
        },
        Header {
            req_num: 17,
            msg_len: 1 << 24,
            payload_len: 16,
            ..Header::new(PacketKind::Offer)
        },
        Header {
            kind: PacketKind::Response,
            status: Status::ReadFailed,
            payload_len: 0,
            msg_len: 0,
            ..request()
        },
    ];
    for h in headers {
        let payload = vec![0xab; h.payload_len.into()];
        let p = packet(&h, &payload);
        assert_eq!(Header::decode(&p).map(|(h, _)| h), Ok(h));
    }
}

/// An offer carries one descriptor and the room offered, from 1 byte to
/// 16 MiB, and nothing else.
#[test]
fn offers_are_checked() {
    let offer = Header {
        req_num: 9,
        msg_len: 4096,
        payload_len: 16,
        ..Header::new(PacketKind::Offer)
    };
    let desc = super::header::BulkDesc { addr: 64, rkey: 7 };
    assert!(Header::decode(&packet(&offer, &desc.encode())).is_ok());
    let bad = [
        Header {
            msg_len: 0,
            ..offer
        },
        Header {
            msg_len: (1 << 24) + 1,
            ..offer
        },
        Header {
            req_type: 1,
            ..offer
        },
        Header {
            pkt_idx: 1,
            ..offer
        },
        Header {
            pkt_count: 1,
            ..offer
        },
        Header {
            status: Status::Busy,
            ..offer
        },
    ];
    for h in bad {
        assert!(
            Header::decode(&packet(&h, &desc.encode())).is_err(),
            "{h:?}"
        );
    }
    let short = Header {
        payload_len: 15,
        ..offer
    };
    assert!(Header::decode(&packet(&short, &[0; 15])).is_err());
}

/// Read requests and responses carry one descriptor of a message from 1
/// byte to 16 MiB; bulk connects a step (0 or 1) and an address: anything
/// else is refused. A descriptor's reserved bytes must be zero.
#[test]
fn read_and_bulk_packets_are_checked() {
    let rr = Header {
        req_num: 9,
        msg_len: 100,
        pkt_count: 1,
        payload_len: 16,
        ..Header::new(PacketKind::ReadRequest)
    };
    let desc = super::header::BulkDesc {
        addr: 0x1234,
        rkey: 7,
    };
    let ok = packet(&rr, &desc.encode());
    assert!(Header::decode(&ok).is_ok());
    let bad = [
        Header { msg_len: 0, ..rr },
        Header {
            msg_len: (1 << 24) + 1,
            ..rr
        },
        Header { pkt_count: 2, ..rr },
        Header { pkt_idx: 1, ..rr },
        Header {
            kind: PacketKind::ReadResponse,
            req_type: 1,
            ..rr
        },
        Header {
            status: Status::ReadFailed,
            ..rr
        },
    ];
    for h in bad {
        assert!(
            Header::decode(&packet(&h, &desc.encode())).is_err(),
            "{h:?}"
        );
    }
    let short = Header {
        payload_len: 15,
        ..rr
    };
    assert!(Header::decode(&packet(&short, &[0; 15])).is_err());
    let mut reserved = desc.encode();
    reserved[15] = 1;
    assert_eq!(super::header::BulkDesc::decode(&reserved), None);
    assert_eq!(super::header::BulkDesc::decode(&desc.encode()), Some(desc));
    // A read request's offer: carried in those 4 bytes, up to 16 MiB; a
    // read response's stay zero.
    use super::header::BulkDesc;
    for offer in [0, 1, 100_000, 1 << 24] {
        let b = desc.encode_offer(offer);
        assert_eq!(BulkDesc::decode_offer(&b), Some((desc, offer)));
        assert_eq!(BulkDesc::decode(&b).is_some(), offer == 0);
    }
    for offer in [(1 << 24) + 1, u32::MAX] {
        assert_eq!(BulkDesc::decode_offer(&desc.encode_offer(offer)), None);
    }
    assert_eq!(BulkDesc::decode_offer(&desc.encode_offer(8)[..15]), None);
    let bc = Header {
        payload_len: 4,
        ..Header::new(PacketKind::BulkConnect)
    };
    for h in [
        Header { pkt_idx: 2, ..bc },
        Header {
            payload_len: 0,
            ..bc
        },
        Header { msg_len: 1, ..bc },
        Header { pkt_count: 1, ..bc },
        Header { req_type: 1, ..bc },
    ] {
        let payload = vec![1; h.payload_len.into()];
        assert!(Header::decode(&packet(&h, &payload)).is_err(), "{h:?}");
    }
}

/// Credit returns and requests for response carry a range (`pkt_count`
/// more packets, below 64), a connect-ack the response window (at most
/// 64): in range they decode, past it they are refused.
#[test]
fn ranges_and_windows_are_bounded() {
    let cr = |pkt_idx, pkt_count| Header {
        pkt_idx,
        pkt_count,
        ..Header::new(PacketKind::CreditReturn)
    };
    let rfr = |pkt_idx, pkt_count| Header {
        pkt_idx,
        pkt_count,
        ..Header::new(PacketKind::RequestForResponse)
    };
    let ack = |pkt_count| Header {
        msg_len: 4096,
        pkt_count,
        ..Header::new(PacketKind::ConnectAck)
    };
    let ok = |h: Header| Header::decode(&h.encode()) == Ok((h, &[][..]));
    assert!(ok(cr(63, 63)) && ok(cr(100, 0)) && ok(cr(0, 0)));
    assert!(!ok(cr(5, 6)), "a range before packet 0");
    assert!(!ok(cr(100, 64)), "a range of 65");
    assert!(ok(rfr(1, 63)) && ok(rfr(65472, 63)));
    assert!(!ok(rfr(1, 64)), "a range of 65");
    assert!(!ok(rfr(65500, 63)), "a range past packet 65535");
    assert!(ok(ack(0)) && ok(ack(64)));
    assert!(!ok(ack(65)));
    let connect = Header {
        msg_len: 4096,
        payload_len: 4,
        pkt_count: 1,
        ..Header::new(PacketKind::Connect)
    };
    assert!(Header::decode(&packet(&connect, &[1, 2, 3, 4])).is_err());
    // Busy is a credit return's status only.
    let busy = Header {
        status: Status::Busy,
        ..cr(3, 0)
    };
    assert!(ok(busy));
    assert!(!ok(Header {
        status: Status::NoHandler,
        ..cr(3, 0)
    }));
    assert!(!ok(Header {
        status: Status::Busy,
        ..rfr(3, 0)
    }));
    let resp = Header {
        kind: PacketKind::Response,
        status: Status::Busy,
        payload_len: 0,
        msg_len: 0,
        ..request()
    };
    assert!(Header::decode(&resp.encode()).is_err());
}

#[test]
fn packet_counts() {
    assert_eq!(packets_for(0, 100), 1);
    assert_eq!(packets_for(100, 100), 1);
    assert_eq!(packets_for(101, 100), 2);
}
