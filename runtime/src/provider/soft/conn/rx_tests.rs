//! The short read after a payload that arrived straight into memory.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use super::super::super::wire::loopback_wire;
use super::super::{Conn, RX_CAP};
use super::RX_PEEK;

/// A proven connection on one end of a TCP socket pair, and the other end.
fn connected() -> (Conn, std::net::TcpStream) {
    let (wire, peer, local) = loopback_wire(0);
    let wire = Arc::new(wire);
    let c = Conn::new(Some(wire), local, true);
    assert_eq!(c.rx.len(), RX_CAP);
    (c, peer)
}

/// Reads until `want` bytes are in the buffer (the peer's bytes may come
/// in several segments); returns the sizes of the reads.
fn read_all(c: &mut Conn, want: usize) -> Vec<(usize, bool)> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut reads = Vec::new();
    while c.rx_end - c.rx_start < want {
        assert!(
            std::time::Instant::now() < deadline,
            "{} of {want} bytes came",
            c.rx_end - c.rx_start
        );
        match c.read_some() {
            Ok(r) => reads.push(r),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => panic!("read: {e}"),
        }
    }
    reads
}

#[test]
fn after_a_payload_into_memory_the_next_read_is_short_and_the_rest_follows() {
    let (mut c, mut peer) = connected();
    let bytes: Vec<u8> = (0..3 * RX_PEEK).map(|i| i as u8).collect();
    peer.write_all(&bytes).expect("write");
    // (All of it in the socket before the first read.)
    std::thread::sleep(Duration::from_millis(50));
    c.rx_peek = true;
    let reads = read_all(&mut c, bytes.len());
    assert_eq!(
        reads[0],
        (RX_PEEK, true),
        "the first read is short: {reads:?}"
    );
    assert!(!c.rx_peek, "one short read only");
    assert!(
        reads[1..].iter().all(|&(n, _)| n > RX_PEEK),
        "the reads after it take what is there: {reads:?}"
    );
    assert_eq!(&c.rx[c.rx_start..c.rx_end], &bytes[..]);
}

#[test]
fn a_read_that_finds_the_socket_drained_keeps_the_short_read_for_the_next_packet() {
    let (mut c, mut peer) = connected();
    // The read right after a payload usually finds nothing yet: the
    // packet after it (another large one, in a ping-pong) comes later.
    c.rx_peek = true;
    let e = c.read_some().expect_err("nothing was sent yet");
    assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock);
    assert!(c.rx_peek, "a read that read nothing keeps the short read");
    let bytes: Vec<u8> = (0..3 * RX_PEEK).map(|i| (i * 3) as u8).collect();
    peer.write_all(&bytes).expect("write");
    std::thread::sleep(Duration::from_millis(50));
    let reads = read_all(&mut c, bytes.len());
    assert_eq!(
        reads[0],
        (RX_PEEK, true),
        "the first read that finds bytes is the short one: {reads:?}"
    );
    assert_eq!(&c.rx[c.rx_start..c.rx_end], &bytes[..]);
}

#[test]
fn without_a_payload_into_memory_a_read_takes_what_is_there() {
    let (mut c, mut peer) = connected();
    let bytes: Vec<u8> = (0..3 * RX_PEEK).map(|i| (i * 7) as u8).collect();
    peer.write_all(&bytes).expect("write");
    std::thread::sleep(Duration::from_millis(50));
    let reads = read_all(&mut c, bytes.len());
    assert!(reads[0].0 > RX_PEEK, "{reads:?}");
    assert_eq!(&c.rx[c.rx_start..c.rx_end], &bytes[..]);
}

#[test]
fn a_short_read_never_strands_part_of_a_packet_the_buffer_waits_for() {
    let (mut c, mut peer) = connected();
    // A packet of which the buffer needs more than a short read's worth.
    c.rx_need = 2 * RX_PEEK;
    c.rx_peek = true;
    let bytes = vec![5u8; 2 * RX_PEEK];
    peer.write_all(&bytes).expect("write");
    std::thread::sleep(Duration::from_millis(50));
    let reads = read_all(&mut c, bytes.len());
    assert_eq!(reads[0].0, 2 * RX_PEEK, "{reads:?}");
}
