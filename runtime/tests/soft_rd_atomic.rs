//! Soft device: a requester keeps at most `max_rd_atomic` READs/atomics
//! outstanding. Observed from a fake remote engine (a TCP socket speaking
//! the soft wire format), which sees exactly how many requests arrive
//! before it answers any.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use common::*;
use verbio_runtime::provider::soft::packet::{
    decode_header, encode_hello, Header, Opcode, FLAG_FIRST, FLAG_LAST, HEADER_LEN, HELLO_LEN,
};
use verbio_runtime::provider::*;

const FAKE_QPN: u32 = 0x777;

/// Reads one packet (header and payload), or `None` if nothing arrives
/// within the socket's read timeout.
fn next_packet(s: &mut TcpStream) -> Option<(Header, Vec<u8>)> {
    let mut h = [0u8; HEADER_LEN];
    match s.read_exact(&mut h) {
        Ok(()) => {}
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => return None,
        Err(e) => panic!("fake peer read: {e}"),
    }
    let hdr = decode_header(&h).expect("valid header");
    let mut payload = vec![0u8; hdr.payload_len as usize];
    s.read_exact(&mut payload).expect("payload");
    Some((hdr, payload))
}

fn read_response(to: &Header, qpn: u32, value: u64) -> Vec<u8> {
    let mut h = Header::new(Opcode::ReadResp);
    h.dst_qpn = qpn;
    h.src_qpn = FAKE_QPN;
    h.psn = to.psn;
    h.payload_len = 8;
    h.arg0 = 8;
    h.flags = FLAG_FIRST | FLAG_LAST;
    let mut p = h.encode().to_vec();
    p.extend_from_slice(&value.to_le_bytes());
    p
}

fn outstanding_reads_are_limited(limit: u8) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let fake_addr = listener.local_addr().unwrap();
    let ctx = open_test_context();
    let opts = PairOpts {
        rts: RtsAttr {
            max_rd_atomic: limit,
            // The fake peer pauses before each answer: no ACK timeout then.
            timeout: 18,
            ..RtsAttr::default()
        },
        ..PairOpts::default()
    };
    let a = make_side(&ctx, &opts);
    let mut ep = a.qp.endpoint(0).unwrap();
    ep.soft_addr = Some(fake_addr);
    ep.qpn = FAKE_QPN;
    ep.psn = 100;
    bring_up(&a.qp, ep, &opts);
    const READS: usize = 5;
    let local = a.buf(8 * READS, LW);
    for i in 0..READS {
        let w = wr(
            i as u64,
            SendOp::Read {
                remote_addr: 0x1000 + 8 * i as u64,
                rkey: 0x55,
            },
            &[local.sge(8 * i, 8)],
            SendFlags::SIGNALED,
        );
        // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
        unsafe { a.qp.post_send(&[w]) }.unwrap();
    }
    let (mut s, _) = listener.accept().unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    let (hello, _) = next_packet(&mut s).expect("HELLO");
    assert_eq!(hello.opcode, Opcode::Hello);
    let mut h = Header::new(Opcode::Hello);
    h.payload_len = HELLO_LEN as u32;
    let mut me = h.encode().to_vec();
    me.extend_from_slice(&encode_hello(fake_addr));
    s.write_all(&me).unwrap();
    let limit = usize::from(limit.max(1));
    let mut pending = Vec::new();
    let mut answered = 0;
    while answered < READS {
        // Exactly `limit` requests (or what is left) arrive, then nothing
        // until one is answered (unlimited, all would have been sent at once).
        let want = limit.min(READS - answered);
        s.set_read_timeout(Some(WAIT)).unwrap();
        while pending.len() < want {
            let (h, _) = next_packet(&mut s).expect("a READ request");
            assert_eq!(h.opcode, Opcode::ReadReq);
            pending.push(h);
        }
        s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        if let Some((h, _)) = next_packet(&mut s) {
            panic!("{want} READs outstanding, and then {h:?}");
        }
        let req = pending.remove(0);
        let resp = read_response(&req, a.qp.qp_num(), 1000 + answered as u64);
        s.write_all(&resp).unwrap();
        answered += 1;
    }
    let c = poll_n(&a.scq, READS);
    for (i, c) in c.iter().enumerate() {
        assert_eq!((c.wr_id, c.status), (i as u64, WcStatus::Success));
        assert_eq!(local.u64_at(8 * i), 1000 + i as u64);
    }
}

#[test]
fn at_most_max_rd_atomic_reads_are_outstanding() {
    outstanding_reads_are_limited(2);
}

#[test]
fn max_rd_atomic_of_one_serializes_reads() {
    outstanding_reads_are_limited(1);
}

#[test]
fn max_rd_atomic_above_the_device_limit_is_rejected() {
    let ctx = open_test_context();
    let a = make_side(&ctx, &PairOpts::default());
    let b = make_side(&ctx, &PairOpts::default());
    bring_up(&b.qp, a.qp.endpoint(0).unwrap(), &PairOpts::default());
    let max = ctx.query_device().unwrap().max_qp_init_rd_atom;
    a.qp.modify_to_init(&InitAttr::default()).unwrap();
    a.qp.modify_to_rtr(&RtrAttr {
        remote: b.qp.endpoint(0).unwrap(),
        path_mtu: Mtu::Mtu4096,
        min_rnr_timer: 1,
        max_dest_rd_atomic: 16,
        sgid_index: 0,
        hop_limit: 64,
    })
    .unwrap();
    let too_many = RtsAttr {
        max_rd_atomic: (max + 1) as u8,
        ..RtsAttr::default()
    };
    assert!(matches!(
        a.qp.modify_to_rts(&too_many),
        Err(ProviderError::InvalidArgument { .. })
    ));
    assert_eq!(a.qp.state(), QpState::Rtr);
}
