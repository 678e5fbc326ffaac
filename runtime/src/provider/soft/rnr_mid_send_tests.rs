//! A NAK that comes while the requester still sends the rest of the WR it
//! answers (here RNR for the first packet of a large SEND on a connection
//! whose socket buffers cannot hold the whole message) is heard then: the
//! requester goes back to the WR's first packet after the RNR wait. Seen
//! from a fake remote engine that NAKs the first packet and reads nothing
//! more until the NAK has had time to arrive. (Before, such a NAK was
//! dropped as not for a sent WR, and the requester, once done sending,
//! waited for an answer that the responder, having NAKed, never gives; in
//! this test its engine then closes the connection, its probe unanswered,
//! and the fake peer's read fails.)

use std::io::Write;
use std::net::TcpListener;
use std::time::{Duration, Instant};

use super::fake_peer_tests::{
    aimed_at_fake_peer, exchange_hello, next_packet, AimedQp, Mem, FAKE_QPN, WAIT,
};
use super::packet::{Header, Opcode, FLAG_FIRST, NAK_RNR};
use crate::provider::{AccessFlags, RtsAttr, SendFlags, SendOp, SendWr};

/// Larger than what loopback's socket buffers take at once, so that the
/// requester is still sending it when the NAK of its first packet comes.
const LEN: usize = 48 << 20;

#[test]
fn an_rnr_nak_that_comes_while_the_wr_is_still_being_sent_is_heard() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let fake_addr = listener.local_addr().unwrap();
    let AimedQp {
        ctx: _ctx,
        pd,
        scq: _scq,
        rcq: _rcq,
        qp,
    } = aimed_at_fake_peer(fake_addr);
    qp.modify_to_rts(&RtsAttr {
        // The fake peer pauses on purpose: no ACK timeout meanwhile.
        timeout: 18,
        rnr_retry: 7,
        ..RtsAttr::default()
    })
    .expect("rts");
    let mut mem = vec![0u64; LEN / 8].into_boxed_slice();
    // SAFETY: the boxed memory outlives the registration (`Mem::drop`
    // deregisters first) and is not touched while the device reads it.
    let mr = unsafe { pd.reg_mr(mem.as_mut_ptr().cast(), LEN, AccessFlags::LOCAL_WRITE) }
        .expect("reg_mr");
    let local = Mem { mr: Some(mr), mem };
    let w = SendWr {
        wr_id: 1,
        op: SendOp::Send,
        sg_list: [local.sge(0, LEN as u32)].into_iter().collect(),
        flags: SendFlags::SIGNALED,
    };
    // SAFETY: the SGE lies in `local`'s registration, alive until the end.
    unsafe { qp.post_send(&[w]) }.unwrap();
    let (mut s, _) = listener.accept().unwrap();
    exchange_hello(&mut s, fake_addr);
    let (first, _) = next_packet(&mut s).expect("the SEND's first packet");
    assert_eq!(first.opcode, Opcode::Send);
    assert!(first.flags & FLAG_FIRST != 0, "{first:?}");
    assert!((first.payload_len as usize) < LEN, "one packet: {first:?}");
    let mut nak = Header::new(Opcode::Nak);
    nak.dst_qpn = qp.qp_num();
    nak.src_qpn = FAKE_QPN;
    nak.psn = first.psn;
    nak.syndrome = NAK_RNR;
    nak.arg0 = 1; // 10 µs
    s.write_all(&nak.encode()).unwrap();
    // Let the NAK arrive while the rest of the message waits in the
    // sockets, then read on: the first packet must come again.
    std::thread::sleep(Duration::from_millis(100));
    let deadline = Instant::now() + WAIT;
    let mut later = 0usize;
    loop {
        assert!(
            Instant::now() < deadline,
            "the first packet did not come again ({later} later packets read)"
        );
        let (p, _) = next_packet(&mut s).unwrap_or_else(|| {
            panic!("nothing more arrived after {later} packets: the NAK went unheard")
        });
        if p.opcode == Opcode::Send && p.flags & FLAG_FIRST != 0 {
            assert_eq!(p.psn, first.psn, "the retry starts at the NAKed packet");
            break;
        }
        later += 1;
    }
    drop(qp);
}
