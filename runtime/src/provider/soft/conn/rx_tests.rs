//! The short read after a payload that arrived straight into memory.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use super::super::super::packet::{Header, Opcode};
use super::super::super::wire::loopback_wire;
use super::super::super::{Context, Cq, Mr, Pd, Qp};
use super::super::{Conn, DirectInto, RxDirect, RX_CAP};
use super::RX_PEEK;
use crate::provider::{AccessFlags, QpCaps, SoftConfig};

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
fn a_short_read_that_drains_the_socket_keeps_the_short_read_for_the_next_packet() {
    let (mut c, mut peer) = connected();
    // After a payload into memory, a small packet (a READ request: a large
    // call's small trip) comes first, then the large one (the call's data).
    c.rx_peek = true;
    let small = [0x5au8; 56];
    peer.write_all(&small).expect("write");
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        c.read_some().expect("the small packet"),
        (small.len(), false)
    );
    assert!(c.rx_peek, "a short read that drained the socket keeps it");
    c.rx_start = c.rx_end;
    let bytes: Vec<u8> = (0..3 * RX_PEEK).map(|i| (i * 5) as u8).collect();
    peer.write_all(&bytes).expect("write");
    std::thread::sleep(Duration::from_millis(50));
    let reads = read_all(&mut c, bytes.len());
    assert_eq!(
        reads[0],
        (RX_PEEK, true),
        "the large packet's first read is the short one: {reads:?}"
    );
    assert!(!c.rx_peek, "a short read that filled is spent");
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

/// A soft device's region open to remote WRITE, and a QP of its PD: where
/// a WRITE's payload received straight into memory lands.
struct Target {
    ctx: Context,
    _pd: Pd,
    _cq: Cq,
    qp: Qp,
    mr: Mr,
    mem: Box<[u8]>,
}

impl Target {
    fn new(len: usize) -> Target {
        let ctx = Context::open(SoftConfig::default()).expect("open");
        let pd = ctx.alloc_pd().expect("pd");
        let cq = ctx.create_cq(16, None).expect("cq");
        let qp = pd.create_qp(&cq, &cq, QpCaps::default()).expect("qp");
        let mut mem = vec![0u8; len].into_boxed_slice();
        let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
        // SAFETY: the memory outlives the registration (`mr` is dropped
        // first: fields drop in order, and `mem` is last).
        let mr = unsafe { pd.reg_mr(mem.as_mut_ptr(), len, access) }.expect("reg_mr");
        Target {
            ctx,
            _pd: pd,
            _cq: cq,
            qp,
            mr,
            mem,
        }
    }

    /// A WRITE of the whole region, its header read, its payload to come.
    fn direct(&self) -> RxDirect {
        let sh = self.qp.0.shared.clone();
        let mut hdr = Header::new(Opcode::Write);
        hdr.dst_qpn = self.qp.qp_num();
        hdr.rkey = self.mr.rkey();
        RxDirect {
            pd: sh.pd,
            qp: sh,
            hdr,
            into: DirectInto::Remote {
                at: self.mem.as_ptr() as u64,
            },
            remaining: self.mem.len(),
            broken: false,
        }
    }
}

#[test]
fn the_read_that_ends_a_payload_into_memory_takes_the_next_packets_first_bytes_along() {
    let len = 64 * 1024;
    let payload: Vec<u8> = (0..len).map(|i| (i * 3 + i / 256) as u8).collect();
    // A small packet after the payload (an ACK, a READ request): one read
    // takes both, and says the socket is drained (not full), so no read
    // follows only to find it empty. A larger one: the read is full, and
    // the next packet's first `RX_PEEK` bytes wait in the buffer.
    for (after, full) in [(56, false), (3 * RX_PEEK, true)] {
        let (mut c, mut peer) = connected();
        let t = Target::new(len);
        c.rx_direct = Some(t.direct());
        let next: Vec<u8> = (0..after).map(|i| (i * 11) as u8).collect();
        peer.write_all(&payload).expect("write");
        peer.write_all(&next).expect("write");
        std::thread::sleep(Duration::from_millis(50));
        let got = {
            let mrs = t.ctx.shared().mrs();
            c.read_direct(&mrs).expect("read")
        };
        assert_eq!(got, (len, full), "{after} bytes after the payload");
        assert_eq!(c.rx_direct.as_ref().map(|d| d.remaining), Some(0));
        let took = after.min(RX_PEEK);
        assert_eq!(&c.rx[c.rx_start..c.rx_end], &next[..took]);
        assert_eq!(c.rx_peek, !full, "a short read spent only once it filled");
        c.rx_direct = None;
        assert!(t.mem[..] == payload[..], "the payload in memory");
    }
}
