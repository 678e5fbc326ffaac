//! A requester keeps at most `max_rd_atomic` READs/atomics outstanding.
//! Observed from a fake remote engine (a TCP socket speaking the soft wire
//! format), which sees exactly how many requests arrive before it answers
//! any. (A unit test: the wire format is private to the device.)

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::packet::{
    decode_header, encode_hello, Header, Opcode, FLAG_FIRST, FLAG_LAST, HEADER_LEN, HELLO_LEN,
};
use super::{Context, Cq, Mr, Pd, Qp};
use crate::provider::{
    AccessFlags, Completion, InitAttr, Mtu, ProviderError, QpCaps, QpState, RtrAttr, RtsAttr,
    SendFlags, SendOp, SendWr, Sge, SoftConfig, WcStatus,
};

pub(super) const WAIT: Duration = Duration::from_secs(10);
pub(super) const FAKE_QPN: u32 = 0x777;

/// Registered memory the test reads only after the completions that end
/// the device's access to it; the registration is dropped first.
pub(super) struct Mem {
    pub mr: Option<Mr>,
    pub mem: Box<[u64]>,
}

impl Mem {
    pub fn sge(&self, off: usize, len: u32) -> Sge {
        Sge {
            addr: self.mem.as_ptr() as u64 + off as u64,
            length: len,
            lkey: self.mr.as_ref().expect("registered").lkey(),
        }
    }
}

impl Drop for Mem {
    fn drop(&mut self) {
        self.mr = None;
    }
}

/// Reads one packet (header and payload), or `None` if nothing arrives
/// within the socket's read timeout.
pub(super) fn next_packet(s: &mut TcpStream) -> Option<(Header, Vec<u8>)> {
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

/// Takes the engine's HELLO on `s` and answers it as the engine listening
/// at `addr` (the socket's read timeout is left at [`WAIT`]).
pub(super) fn exchange_hello(s: &mut TcpStream, addr: std::net::SocketAddr) {
    s.set_read_timeout(Some(WAIT)).unwrap();
    let (hello, _) = next_packet(s).expect("HELLO");
    assert_eq!(hello.opcode, Opcode::Hello);
    let mut h = Header::new(Opcode::Hello);
    h.payload_len = HELLO_LEN as u32;
    let mut me = h.encode().to_vec();
    me.extend_from_slice(&encode_hello(addr));
    s.write_all(&me).unwrap();
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

pub(super) fn poll_n(cq: &Cq, n: usize) -> Vec<Completion> {
    let deadline = Instant::now() + WAIT;
    let mut out = Vec::with_capacity(n);
    let mut buf = [Completion::EMPTY; 8];
    while out.len() < n {
        let got = cq.poll(&mut buf).expect("poll");
        out.extend_from_slice(&buf[..got]);
        if got == 0 {
            assert!(Instant::now() < deadline, "timed out: {out:?}");
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    out
}

pub(super) fn rtr(remote: crate::provider::Endpoint) -> RtrAttr {
    RtrAttr {
        remote,
        path_mtu: Mtu::Mtu4096,
        min_rnr_timer: 1,
        max_dest_rd_atomic: 16,
        sgid_index: 0,
        hop_limit: 64,
    }
}

/// A software device's RC QP whose remote is the fake engine at
/// `fake_addr` (QPN [`FAKE_QPN`], PSN 100), brought to RTR: the caller
/// picks its RTS attributes.
pub(super) struct AimedQp {
    pub ctx: Context,
    pub pd: Pd,
    pub scq: Cq,
    pub rcq: Cq,
    pub qp: Qp,
}

pub(super) fn aimed_at_fake_peer(fake_addr: std::net::SocketAddr) -> AimedQp {
    let ctx = Context::open(SoftConfig::default()).expect("open");
    let pd = ctx.alloc_pd().expect("pd");
    let scq = ctx.create_cq(64, None).expect("cq");
    let rcq = ctx.create_cq(64, None).expect("cq");
    let qp = pd.create_qp(&scq, &rcq, QpCaps::default()).expect("qp");
    let mut ep = qp.endpoint(0).unwrap();
    ep.addr = fake_addr.into();
    ep.qpn = FAKE_QPN;
    ep.psn = 100;
    qp.modify_to_init(&InitAttr::default()).expect("init");
    qp.modify_to_rtr(&rtr(ep)).expect("rtr");
    AimedQp {
        ctx,
        pd,
        scq,
        rcq,
        qp,
    }
}

fn outstanding_reads_are_limited(limit: u8) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let fake_addr = listener.local_addr().unwrap();
    let AimedQp {
        ctx: _ctx,
        pd,
        scq,
        rcq: _rcq,
        qp,
    } = aimed_at_fake_peer(fake_addr);
    qp.modify_to_rts(&RtsAttr {
        max_rd_atomic: limit,
        // The fake peer pauses before each answer: no ACK timeout then.
        timeout: 18,
        ..RtsAttr::default()
    })
    .expect("rts");
    const READS: usize = 5;
    let mut mem = vec![0u64; READS].into_boxed_slice();
    // SAFETY: the boxed memory outlives the registration (`Mem::drop`
    // deregisters first) and is read only after the completions.
    let mr = unsafe { pd.reg_mr(mem.as_mut_ptr().cast(), 8 * READS, AccessFlags::LOCAL_WRITE) }
        .expect("reg_mr");
    let local = Mem { mr: Some(mr), mem };
    for i in 0..READS {
        let w = SendWr {
            wr_id: i as u64,
            op: SendOp::Read {
                remote_addr: 0x1000 + 8 * i as u64,
                rkey: 0x55,
            },
            sg_list: [local.sge(8 * i, 8)].into_iter().collect(),
            flags: SendFlags::SIGNALED,
        };
        // SAFETY: the SGE lies in `local`'s registration, alive until the end.
        unsafe { qp.post_send(&[w]) }.unwrap();
    }
    let (mut s, _) = listener.accept().unwrap();
    exchange_hello(&mut s, fake_addr);
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
        let resp = read_response(&req, qp.qp_num(), 1000 + answered as u64);
        s.write_all(&resp).unwrap();
        answered += 1;
    }
    let c = poll_n(&scq, READS);
    for (i, c) in c.iter().enumerate() {
        assert_eq!((c.wr_id, c.status), (i as u64, WcStatus::Success));
        assert_eq!(local.mem[i], 1000 + i as u64);
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
    let ctx = Context::open(SoftConfig::default()).expect("open");
    let pd = ctx.alloc_pd().expect("pd");
    let cq = ctx.create_cq(16, None).expect("cq");
    let a = pd.create_qp(&cq, &cq, QpCaps::default()).expect("qp");
    let b = pd.create_qp(&cq, &cq, QpCaps::default()).expect("qp");
    let max = ctx.query_device().unwrap().max_qp_init_rd_atom;
    a.modify_to_init(&InitAttr::default()).unwrap();
    a.modify_to_rtr(&rtr(b.endpoint(0).unwrap())).unwrap();
    let too_many = RtsAttr {
        max_rd_atomic: (max + 1) as u8,
        ..RtsAttr::default()
    };
    assert!(matches!(
        a.modify_to_rts(&too_many),
        Err(ProviderError::InvalidArgument { .. })
    ));
    assert_eq!(a.state(), QpState::Rtr);
}
