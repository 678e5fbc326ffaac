//! The text form of [`RpcAddr`] and its bounded line reader.

use std::io::{Cursor, ErrorKind};

use super::addr::{ParseRpcAddrError, RpcAddr, MAX_RPC_ADDR_LEN};

#[test]
fn text_form_round_trips() {
    for bytes in [vec![0u8], vec![0xde, 0xad, 0xbe, 0xef], (0..=255).collect()] {
        let addr = RpcAddr::from(bytes.clone());
        let text = addr.to_string();
        assert!(text.starts_with("rpc:"), "{text}");
        assert_eq!(text.len(), 4 + 2 * bytes.len());
        assert_eq!(text.parse::<RpcAddr>().unwrap().as_bytes(), &bytes[..]);
    }
}

#[test]
fn parse_takes_upper_case_and_surrounding_whitespace() {
    let addr: RpcAddr = "  rpc:0A1b\r\n".parse().unwrap();
    assert_eq!(addr.as_bytes(), &[0x0a, 0x1b]);
}

#[test]
fn parse_says_what_is_wrong() {
    let cases: [(&str, ParseRpcAddrError); 6] = [
        (
            "",
            ParseRpcAddrError::NoPrefix {
                start: String::new(),
            },
        ),
        (
            "0a1b",
            ParseRpcAddrError::NoPrefix {
                start: "0a1b".into(),
            },
        ),
        ("rpc:", ParseRpcAddrError::Empty),
        ("rpc:0a1", ParseRpcAddrError::OddLength { digits: 3 }),
        ("rpc:0a 1b", ParseRpcAddrError::NotHex { at: 6, found: ' ' }),
        ("rpc:0aé1", ParseRpcAddrError::NotHex { at: 6, found: 'é' }),
    ];
    for (text, want) in cases {
        assert_eq!(text.parse::<RpcAddr>().unwrap_err(), want, "{text:?}");
    }
    let long = format!("rpc:{}", "ab".repeat(MAX_RPC_ADDR_LEN + 1));
    assert_eq!(
        long.parse::<RpcAddr>().unwrap_err(),
        ParseRpcAddrError::TooLong {
            len: MAX_RPC_ADDR_LEN + 1
        }
    );
    let longest = format!("rpc:{}", "ab".repeat(MAX_RPC_ADDR_LEN));
    assert!(longest.parse::<RpcAddr>().is_ok());
}

#[test]
fn the_error_message_names_the_form() {
    let e = "hello".parse::<RpcAddr>().unwrap_err().to_string();
    assert!(e.contains("rpc:") && e.contains("hello"), "{e}");
}

#[test]
fn read_from_takes_one_line_and_leaves_the_rest() {
    let mut input = Cursor::new(b"rpc:0102\nmore".to_vec());
    let addr = RpcAddr::read_from(&mut input).unwrap();
    assert_eq!(addr.as_bytes(), &[1, 2]);
    assert_eq!(&input.get_ref()[input.position() as usize..], b"more");
}

#[test]
fn read_from_refuses_a_truncated_line() {
    let e = RpcAddr::read_from(Cursor::new(b"rpc:0102".to_vec())).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidData);
    assert!(e.to_string().contains("end of the stream"), "{e}");
}

#[test]
fn read_from_stops_at_the_longest_address() {
    // An endless line: the read stops after the longest text form.
    let mut endless = std::io::BufReader::new(std::io::repeat(b'a'));
    let e = RpcAddr::read_from(&mut endless).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidData);
    assert!(e.to_string().contains("longer than an RPC address"), "{e}");
}

#[test]
fn read_from_refuses_garbage() {
    let e = RpcAddr::read_from(Cursor::new(b"HTTP/1.1 400\n".to_vec())).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidData);
    assert!(e.to_string().contains("HTTP/1.1"), "{e}");
    let e = RpcAddr::read_from(Cursor::new(b"rpc:\xff\xfe\n".to_vec())).unwrap_err();
    assert!(e.to_string().contains("not text"), "{e}");
}
