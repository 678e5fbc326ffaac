//! The responder's READ responses, seen by a fake requester engine (a TCP
//! socket speaking the soft wire format): a large READ comes back in order
//! with the region's bytes, its segments (as large as a packet's payload)
//! sent from memory but its last; malformed and oversized READ requests
//! are refused with a NAK (never a panic) while the engine keeps serving;
//! a region deregistered while its READ is on the wire fails that READ
//! (the rest goes as zeros, then a NAK), never completes it, and the freed
//! memory is not read.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::fake_peer_tests::{next_packet, poll_n, rtr, Mem, FAKE_QPN, WAIT};
use super::packet::{
    encode_hello, Header, Opcode, FLAG_FIRST, FLAG_LAST, HELLO_LEN, MAX_PAYLOAD, NAK_REM_ACCESS,
};
use super::requester::{RESP_TAIL, RESP_ZC_SEG};
use super::{lock, Context, Cq, Mr, Pd, Qp};
use crate::provider::{
    AccessFlags, InitAttr, QpCaps, RtsAttr, SendFlags, SendOp, SendWr, SoftConfig, WcStatus,
};

/// The fake requester's first PSN on every QP.
const FIRST_PSN: u32 = 100;

/// A soft device whose QPs all talk to one fake engine.
struct Fake {
    listener: TcpListener,
    stream: Option<TcpStream>,
    /// The device (kept open while the test runs).
    ctx: Context,
    pd: Pd,
    cq: Cq,
}

/// A responder QP of the device, connected to the fake peer.
struct Side {
    qp: Qp,
    /// The next PSN the fake requester uses.
    psn: u32,
}

impl Fake {
    /// `rcvbuf`: the fake's socket receive buffer (small, so that the
    /// device's writes block while the fake does not read).
    fn new(rcvbuf: usize) -> Fake {
        let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
            .expect("socket");
        sock.set_recv_buffer_size(rcvbuf).expect("SO_RCVBUF");
        let addr: std::net::SocketAddr = "127.0.0.1:0".parse().expect("address");
        sock.bind(&addr.into()).expect("bind");
        sock.listen(4).expect("listen");
        let ctx = Context::open(SoftConfig::default()).expect("open");
        let pd = ctx.alloc_pd().expect("pd");
        let cq = ctx.create_cq(64, None).expect("cq");
        Fake {
            listener: sock.into(),
            stream: None,
            ctx,
            pd,
            cq,
        }
    }

    fn stream(&mut self) -> &mut TcpStream {
        self.stream.as_mut().expect("connected")
    }

    /// A responder QP allowing remote READ, in RTS, whose first SEND made
    /// the device dial the fake (on the first QP) and was acknowledged.
    fn qp(&mut self, trigger: &Mem) -> Side {
        let qp = self
            .pd
            .create_qp(&self.cq, &self.cq, QpCaps::default())
            .expect("qp");
        let mut ep = qp.endpoint(0).expect("endpoint");
        ep.addr = self.listener.local_addr().expect("address").into();
        ep.qpn = FAKE_QPN;
        ep.psn = FIRST_PSN;
        qp.modify_to_init(&InitAttr::default()).expect("init");
        qp.modify_to_rtr(&rtr(ep)).expect("rtr");
        qp.modify_to_rts(&RtsAttr {
            timeout: 18,
            ..RtsAttr::default()
        })
        .expect("rts");
        let w = SendWr {
            wr_id: 1,
            op: SendOp::Send,
            sg_list: [trigger.sge(0, 8)].into_iter().collect(),
            flags: SendFlags::SIGNALED,
        };
        // SAFETY: the SGE lies in `trigger`'s registration, alive until
        // the completion polled below.
        unsafe { qp.post_send(&[w]) }.expect("post");
        if self.stream.is_none() {
            let (mut s, _) = self.listener.accept().expect("accept");
            s.set_read_timeout(Some(WAIT)).expect("timeout");
            let (hello, _) = next_packet(&mut s).expect("HELLO");
            assert_eq!(hello.opcode, Opcode::Hello);
            let mut h = Header::new(Opcode::Hello);
            h.payload_len = HELLO_LEN as u32;
            let mut me = h.encode().to_vec();
            let addr = self.listener.local_addr().expect("address");
            me.extend_from_slice(&encode_hello(addr));
            s.write_all(&me).expect("HELLO back");
            self.stream = Some(s);
        }
        let (send, _) = next_packet(self.stream()).expect("the SEND");
        assert_eq!((send.opcode, send.src_qpn), (Opcode::Send, qp.qp_num()));
        let mut ack = Header::new(Opcode::Ack);
        (ack.dst_qpn, ack.src_qpn, ack.psn) = (qp.qp_num(), FAKE_QPN, send.psn);
        self.stream().write_all(&ack.encode()).expect("ACK");
        let c = poll_n(&self.cq, 1);
        assert_eq!(c[0].status, WcStatus::Success);
        Side { qp, psn: FIRST_PSN }
    }

    /// Sends a READ request of `len` bytes at `addr` under `rkey` on
    /// `side`; returns its PSN.
    fn read(&mut self, side: &mut Side, addr: u64, rkey: u32, len: u64) -> u32 {
        let mut h = Header::new(Opcode::ReadReq);
        (h.dst_qpn, h.src_qpn, h.psn) = (side.qp.qp_num(), FAKE_QPN, side.psn);
        (h.addr, h.rkey, h.arg0) = (addr, rkey, len);
        h.flags = FLAG_FIRST | FLAG_LAST;
        side.psn += 1;
        self.stream().write_all(&h.encode()).expect("READ request");
        h.psn
    }

    /// Reads the responses to the READ `psn` of `len` bytes until its last
    /// segment: the bytes, checking every segment's framing.
    fn response(&mut self, qpn: u32, psn: u32, len: u64) -> Vec<u8> {
        self.response_segments(qpn, psn, len).0
    }

    /// As [`response`](Self::response), also counting the segments.
    fn response_segments(&mut self, qpn: u32, psn: u32, len: u64) -> (Vec<u8>, usize) {
        let mut got = Vec::new();
        let mut segments = 0;
        loop {
            let (h, payload) = next_packet(self.stream()).expect("a READ response");
            assert_eq!(h.opcode, Opcode::ReadResp, "{h:?}");
            assert_eq!((h.dst_qpn, h.src_qpn, h.psn), (FAKE_QPN, qpn, psn));
            assert_eq!((h.arg0, h.arg1), (len, got.len() as u64));
            assert_eq!(h.flags & FLAG_FIRST != 0, got.is_empty());
            assert_eq!(payload.len(), h.payload_len as usize);
            let last = h.flags & FLAG_LAST != 0;
            if last {
                // The last segment is a copy of at most the tail (or of a
                // small READ's bytes): never sent from memory.
                assert!(payload.len() as u64 <= 64 * 1024, "last segment {h:?}");
                assert!(
                    payload.len() as u64 >= RESP_TAIL.min(len),
                    "last segment {h:?}"
                );
            } else {
                assert!(payload.len() as u64 <= RESP_ZC_SEG, "segment {h:?}");
            }
            got.extend_from_slice(&payload);
            segments += 1;
            if last {
                return (got, segments);
            }
        }
    }

    /// Waits until the device closes the connection (what it does with a
    /// packet it cannot parse); the next QP dials anew.
    fn closed_by_device(&mut self) {
        let mut sink = [0u8; 4096];
        loop {
            match self.stream().read(&mut sink) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
                Err(e) => panic!("waiting for the device to close: {e}"),
            }
        }
        self.stream = None;
    }

    /// Reads packets until the NAK of `psn`: its syndrome, and the READ
    /// response bytes before it (none of them a last segment).
    fn until_nak(&mut self, psn: u32) -> (u8, usize) {
        let mut bytes = 0;
        loop {
            let (h, payload) = next_packet(self.stream()).expect("a response or the NAK");
            match h.opcode {
                Opcode::Nak => {
                    assert_eq!(h.psn, psn);
                    return (h.syndrome, bytes);
                }
                Opcode::ReadResp => {
                    assert_eq!(h.flags & FLAG_LAST, 0, "the READ completed: {h:?}");
                    bytes += payload.len();
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    }
}

/// `len` bytes of a pattern, registered for remote READ.
fn region(pd: &Pd, len: usize) -> (Mr, Box<[u8]>) {
    let mut mem: Box<[u8]> = (0..len).map(|i| (i * 7 + i / 251) as u8).collect();
    // SAFETY: the memory outlives the registration (the tests drop the
    // `Mr` first).
    let mr = unsafe { pd.reg_mr(mem.as_mut_ptr(), len, AccessFlags::REMOTE_READ) }.expect("reg_mr");
    (mr, mem)
}

/// Local memory for the SENDs that make the device dial.
fn trigger(pd: &Pd) -> Mem {
    let mut mem = vec![0u64; 1].into_boxed_slice();
    // SAFETY: `Mem` deregisters before its memory is freed.
    let mr =
        unsafe { pd.reg_mr(mem.as_mut_ptr().cast(), 8, AccessFlags::LOCAL_WRITE) }.expect("reg_mr");
    Mem { mr: Some(mr), mem }
}

#[test]
fn large_reads_come_back_in_order_with_the_regions_bytes() {
    let mut f = Fake::new(1 << 20);
    let t = trigger(&f.pd);
    let mut side = f.qp(&t);
    let len = (1 << 20) + 12_345;
    let (mr, mem) = region(&f.pd, len);
    let base = mem.as_ptr() as u64;
    // The whole region, a middle part, a small READ and an empty one, in
    // one go: answered in order.
    let reads = [
        (0, len),
        (1000, 300_000),
        (77, 5000),
        (len - 20_000, 20_000),
        (0, 0),
    ];
    let psns: Vec<u32> = reads
        .iter()
        .map(|&(off, n)| f.read(&mut side, base + off as u64, mr.rkey(), n as u64))
        .collect();
    let qpn = side.qp.qp_num();
    for (&(off, n), psn) in reads.iter().zip(psns) {
        let got = f.response(qpn, psn, n as u64);
        assert!(got == mem[off..off + n], "READ of {n} bytes at {off}");
    }
    drop(mr);
}

#[test]
fn a_large_read_comes_back_in_segments_of_a_packets_largest_payload() {
    let mut f = Fake::new(1 << 20);
    let t = trigger(&f.pd);
    let mut side = f.qp(&t);
    let len = 3 * MAX_PAYLOAD as usize + 100;
    let (mr, mem) = region(&f.pd, len);
    let psn = f.read(&mut side, mem.as_ptr() as u64, mr.rkey(), len as u64);
    let (got, segments) = f.response_segments(side.qp.qp_num(), psn, len as u64);
    assert!(got == mem[..], "the region's bytes");
    // Sent from memory in segments as large as a SEND's (1 MiB), but the
    // copied tail: 4, where segments of 256 KiB made 13 (about 16 system
    // calls per MiB of a large READ).
    assert_eq!(segments, 4, "segments of a {len}-byte READ");
    drop(mr);
}

#[test]
fn malformed_and_oversized_reads_are_refused_and_the_responder_keeps_serving() {
    let mut f = Fake::new(1 << 20);
    let t = trigger(&f.pd);
    let len = 256 * 1024;
    let (mr, mem) = region(&f.pd, len);
    let base = mem.as_ptr() as u64;
    let rkey = mr.rkey();
    // Well-formed requests the region does not allow: NAKed, the QP
    // fails (as verbs say), the connection and the engine go on.
    let refused = [
        (base, rkey, len as u64 + 1),   // past the end
        (base - 1, rkey, 16),           // before the start
        (base, rkey ^ 0x5a5a_5a5a, 16), // a key nobody registered
        (base + 8, rkey, 1 << 31),      // the longest READ, far past the end
    ];
    for (addr, key, n) in refused {
        let mut side = f.qp(&t);
        let psn = f.read(&mut side, addr, key, n);
        let (syndrome, bytes) = f.until_nak(psn);
        assert_eq!((syndrome, bytes), (NAK_REM_ACCESS, 0), "READ {addr:#x}+{n}");
    }
    // Malformed ones (longer than any message, or wrapping the address
    // space): the device drops the connection that carried them, and
    // serves the next one.
    let malformed = [
        (base, rkey, (1 << 31) + 1),
        (base + 8, rkey, u64::MAX),
        (u64::MAX - 8, rkey, 64),
    ];
    for (addr, key, n) in malformed {
        let mut side = f.qp(&t);
        f.read(&mut side, addr, key, n);
        f.closed_by_device();
    }
    // A fresh QP on the same engine and connection is served.
    let mut side = f.qp(&t);
    let psn = f.read(&mut side, base, rkey, len as u64);
    let got = f.response(side.qp.qp_num(), psn, len as u64);
    assert!(got == mem[..]);
    drop(mr);
}

#[test]
fn a_region_deregistered_while_its_read_is_sent_fails_the_read() {
    // The fake reads nothing for a while: with its small receive buffer,
    // the device's writes block partway through the response.
    let mut f = Fake::new(64 * 1024);
    let t = trigger(&f.pd);
    let mut side = f.qp(&t);
    let len = 16 << 20;
    let (mr, mem) = region(&f.pd, len);
    let psn = f.read(&mut side, mem.as_ptr() as u64, mr.rkey(), len as u64);
    std::thread::sleep(Duration::from_millis(200));
    // Deregistered, and the memory freed: what is still to be sent must
    // not come from it.
    drop(mr);
    drop(mem);
    let (syndrome, bytes) = f.until_nak(psn);
    assert_eq!(syndrome, NAK_REM_ACCESS);
    assert!(bytes < len, "{bytes} bytes of {len}");
    // The engine goes on: a new QP's READ of another region is answered.
    let (mr, mem) = region(&f.pd, 100_000);
    let mut side = f.qp(&t);
    let psn = f.read(&mut side, mem.as_ptr() as u64, mr.rkey(), 100_000);
    let got = f.response(side.qp.qp_num(), psn, 100_000);
    assert!(got == mem[..]);
    drop(mr);
}

#[test]
fn a_long_read_response_lets_other_qps_send_between_its_segments() {
    // The fake reads slowly (a small receive buffer): the device's writes
    // block partway through a 16 MiB READ response. A SEND posted on
    // another QP of the connection meanwhile goes between two segments,
    // not after the READ's last byte (a datagram or request stuck behind
    // a long READ for its whole length left RPC calls unanswered).
    let mut f = Fake::new(64 * 1024);
    let t = trigger(&f.pd);
    let mut side = f.qp(&t);
    let other = f.qp(&t);
    let len = 16 << 20;
    let (mr, mem) = region(&f.pd, len);
    let psn = f.read(&mut side, mem.as_ptr() as u64, mr.rkey(), len as u64);
    // The response has started: the READ is at the front of the
    // connection's responses.
    let (first, mut bytes) = match next_packet(f.stream()) {
        Some((h, payload)) => (h, payload.len()),
        None => panic!("no READ response in {WAIT:?}"),
    };
    assert_eq!((first.opcode, first.psn), (Opcode::ReadResp, psn));
    let w = SendWr {
        wr_id: 2,
        op: SendOp::Send,
        sg_list: [t.sge(0, 8)].into_iter().collect(),
        flags: SendFlags::SIGNALED,
    };
    // SAFETY: the SGE lies in `t`'s registration, which outlives the QP
    // (dropped at the end of the test, before `t`).
    unsafe { other.qp.post_send(&[w]) }.expect("post");
    let mut send_before = None;
    loop {
        let (h, payload) = next_packet(f.stream()).expect("a packet");
        match h.opcode {
            Opcode::Send => {
                assert_eq!(h.src_qpn, other.qp.qp_num());
                send_before = Some(bytes);
            }
            Opcode::ReadResp => {
                bytes += payload.len();
                if h.flags & FLAG_LAST != 0 {
                    break;
                }
            }
            op => panic!("unexpected {op:?}"),
        }
    }
    assert_eq!(bytes, len);
    let at = send_before.expect("the SEND came after the READ's last segment");
    assert!(at < len / 2, "the SEND waited for {at} of {len} bytes");
    drop(other);
    drop(side);
    drop(mr);
}

/// Sets the send buffer of the socket `side`'s QP sends on (the engine's
/// connection to the fake; posts may write to it once the first SEND was
/// acknowledged).
fn set_sndbuf(side: &Side, bytes: libc::c_int) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let fd = loop {
        if let Some(d) = lock(&side.qp.0.shared.inner).direct.as_ref() {
            break d.wire.fd();
        }
        assert!(
            Instant::now() < deadline,
            "the QP's posts never allowed to write"
        );
        std::thread::sleep(Duration::from_millis(1));
    };
    // SAFETY: `bytes` is a live c_int of the size passed; `fd` is the open
    // socket of the QP's connection (the engine keeps it open).
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            (&bytes as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "SO_SNDBUF");
}

#[test]
fn a_read_of_a_packets_largest_payload_leaves_in_one_write() {
    // A socket that takes the whole response at once: the segment sent
    // from memory and the copied tail go in one `sendmsg` (they went in
    // two, the tail's a write of its own after the segment's, and on a
    // shared CPU often a wake-up of the requester more).
    let mut f = Fake::new(4 << 20);
    let t = trigger(&f.pd);
    let mut side = f.qp(&t);
    set_sndbuf(&side, 4 << 20);
    let len = MAX_PAYLOAD as usize;
    let (mr, mem) = region(&f.pd, len);
    let writes = |f: &Fake| f.ctx.shared().tx_writes.load(Ordering::SeqCst);
    for round in 0..3 {
        let before = writes(&f);
        let psn = f.read(&mut side, mem.as_ptr() as u64, mr.rkey(), len as u64);
        let (got, segments) = f.response_segments(side.qp.qp_num(), psn, len as u64);
        assert!(got == mem[..], "the region's bytes");
        assert_eq!(segments, 2, "the segment from memory and the tail");
        // The engine adds a service's writes to the count after the
        // service, which may be after the fake read what they carried:
        // read the count once the engine went to sleep.
        let deadline = Instant::now() + WAIT;
        while !f.ctx.shared().sleeping.load(Ordering::SeqCst) {
            assert!(Instant::now() < deadline, "the engine never went to sleep");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(writes(&f) - before, 1, "writes of READ {round}'s response");
    }
    drop(mr);
}

#[test]
fn a_region_deregistered_while_its_last_segment_from_memory_is_sent_fails_the_read() {
    // A READ of one packet's payload: its one segment from memory goes with
    // the tail queued behind it. The fake reads nothing for a while and
    // the device's send buffer is small, so the write blocks partway
    // through that segment; the region goes away meanwhile. The queued
    // tail must not complete the READ: a NAK refuses it instead.
    let mut f = Fake::new(64 * 1024);
    let t = trigger(&f.pd);
    let mut side = f.qp(&t);
    set_sndbuf(&side, 16 * 1024);
    let len = MAX_PAYLOAD as usize;
    let (mr, mem) = region(&f.pd, len);
    let psn = f.read(&mut side, mem.as_ptr() as u64, mr.rkey(), len as u64);
    std::thread::sleep(Duration::from_millis(200));
    drop(mr);
    drop(mem);
    let (syndrome, bytes) = f.until_nak(psn);
    assert_eq!(syndrome, NAK_REM_ACCESS);
    assert!(bytes < len, "{bytes} bytes of {len}");
    // The engine goes on: a new QP's READ of another region is answered.
    let (mr, mem) = region(&f.pd, 100_000);
    let mut side = f.qp(&t);
    let psn = f.read(&mut side, mem.as_ptr() as u64, mr.rkey(), 100_000);
    let got = f.response(side.qp.qp_num(), psn, 100_000);
    assert!(got == mem[..]);
    drop(mr);
}
