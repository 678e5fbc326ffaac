//! ibverbs provider: two UD QPs of one device exchanging datagrams through
//! it (loopback). Runs in the rxe VM (`scripts/rxe-test.sh`); prints
//! SKIPPED without a device.
//!
//! What rxe does, as these tests assert (the soft device matches it):
//! - every UD receive buffer starts with the 40-byte GRH area; on RoCE v2
//!   over IPv4 it holds 20 zero bytes and the packet's IPv4 header, which
//!   [`Grh::parse`] reads as the sender's and receiver's GIDs
//!   (`::ffff:a.b.c.d`); the completion has `grh` set, `src_qp` = the
//!   sender's QPN, `slid` 0, `byte_len` = 40 + payload;
//! - a datagram with the wrong Q_Key, or arriving when no receive is
//!   posted, is dropped silently: no completion at the receiver, and the
//!   sender's completion is a success;
//! - a datagram larger than the port's active MTU (rxe0 in the VM: 1024 B,
//!   sent 1025 B) is accepted by `ibv_post_send` (returns 0) and completes
//!   at the sender with status SUCCESS, opcode SEND (rxe also reports
//!   `byte_len` 1025, which verbs leave undefined for send completions and
//!   this test does not check), but nothing is sent: no completion at the
//!   receiver, which had a big enough receive posted (IBTA C10-93.1.1: no
//!   packet and no error; rxe's requester completes the WR as if sent);
//!   both QPs stay in RTS and the next MTU-sized datagram is delivered.
#![cfg(feature = "ibverbs")]

mod ibverbs_support;

use std::time::{Duration, Instant};

use ibverbs_support::{device, gid_index, wait, Buf};
use verbio_runtime::provider::{
    AccessFlags, AddressHandle, AhAttr, Completion, Context, Cq, Endpoint, Grh, InitAttr, Pd,
    ProviderError, Qp, QpCaps, QpState, QpType, RecvWr, SendFlags, SendOp, SendWr, SgList, Sge,
    UdAttr, UdDest, WcOpcode, WcStatus, DEFAULT_QKEY, GRH_LEN,
};

/// How long a receiver waits to conclude a datagram was dropped. A
/// delivered one takes well under a millisecond in the VM; each test then
/// sends a good datagram after the dropped one and checks that the receive
/// buffer holds it, so a late delivery would fail the test anyway.
const DROP_WAIT: Duration = Duration::from_millis(500);

/// Two UD QPs in RTS with their own CQs and an address handle each for
/// the other.
struct UdPair {
    pd: Pd,
    cq_a: Cq,
    cq_b: Cq,
    a: Qp,
    b: Qp,
    ea: Endpoint,
    eb: Endpoint,
    /// A's route to B.
    ah_ab: AddressHandle,
    /// B's route to A.
    ah_ba: AddressHandle,
}

fn ud_pair(ctx: Context) -> UdPair {
    let pd = ctx.alloc_pd().expect("alloc_pd");
    let cq_a = ctx.create_cq(64, None).expect("create_cq a");
    let cq_b = ctx.create_cq(64, None).expect("create_cq b");
    let a = pd
        .create_ud_qp(&cq_a, &cq_a, QpCaps::default())
        .expect("create_ud_qp a");
    let b = pd
        .create_ud_qp(&cq_b, &cq_b, QpCaps::default())
        .expect("create_ud_qp b");
    for (q, psn) in [(&a, 0x12), (&b, 0x34)] {
        q.modify_ud_to_rts(&UdAttr {
            sq_psn: psn,
            ..UdAttr::default()
        })
        .expect("modify_ud_to_rts");
        assert_eq!(q.state(), QpState::Rts);
    }
    let gid = gid_index(&ctx);
    let ea = a.endpoint(gid).expect("endpoint a");
    let eb = b.endpoint(gid).expect("endpoint b");
    assert_eq!(
        (ea.psn, eb.psn),
        (0x12, 0x34),
        "endpoint reports the sq_psn"
    );
    let ah_ab = pd
        .create_ah(&AhAttr::to_endpoint(&eb, gid))
        .expect("AH a->b");
    let ah_ba = pd
        .create_ah(&AhAttr::to_endpoint(&ea, gid))
        .expect("AH b->a");
    UdPair {
        pd,
        cq_a,
        cq_b,
        a,
        b,
        ea,
        eb,
        ah_ab,
        ah_ba,
    }
}

fn dest(ah: &AddressHandle, to: &Qp, qkey: u32) -> UdDest {
    UdDest {
        ah: ah.raw(),
        remote_qpn: to.qp_num(),
        remote_qkey: qkey,
    }
}

fn send_to(wr_id: u64, sg_list: SgList, dest: UdDest, imm: Option<u32>) -> SendWr {
    SendWr {
        wr_id,
        sg_list,
        op: SendOp::SendTo { dest, imm },
        flags: SendFlags::SIGNALED,
    }
}

fn post_recv(qp: &Qp, wr_id: u64, buf: &Buf, len: u32) {
    // SAFETY: SGEs of Bufs, which uphold the post contract (see Buf).
    unsafe {
        qp.post_recv(&[RecvWr {
            wr_id,
            sg_list: buf.sge(0, len),
        }])
    }
    .expect("post_recv");
}

fn post_send(qp: &Qp, wr: SendWr) {
    // SAFETY: SGEs of Bufs (see Buf) or, for INLINE sends, of locals alive
    // during the call.
    unsafe { qp.post_send(&[wr]) }.expect("post_send");
}

/// Polls `cq` for `d`; true if nothing arrived.
fn quiet_for(cq: &Cq, d: Duration) -> Result<(), Vec<Completion>> {
    let end = Instant::now() + d;
    let mut buf = [Completion::EMPTY; 4];
    while Instant::now() < end {
        let k = cq.poll(&mut buf).expect("poll");
        if k > 0 {
            return Err(buf[..k].to_vec());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(())
}

/// Checks a UD receive completion of `payload` bytes from `from`, and the
/// GRH area of `buf`.
fn check_datagram(c: &Completion, buf: &Buf, payload: &[u8], from: &Endpoint, to: &Endpoint) {
    assert_eq!(c.status, WcStatus::Success, "{c:?}");
    assert_eq!(c.opcode, WcOpcode::Recv);
    assert_eq!(c.byte_len as usize, GRH_LEN + payload.len(), "{c:?}");
    assert_eq!(c.src_qp, from.qpn, "src_qp is the sender's QPN");
    assert_eq!(c.qp_num, to.qpn);
    assert!(c.grh, "RoCE datagrams carry a GRH: {c:?}");
    assert_eq!(c.slid, from.lid);
    let grh = Grh::parse(&buf.bytes()[..GRH_LEN])
        .unwrap_or_else(|| panic!("GRH area not parsed: {:02x?}", &buf.bytes()[..GRH_LEN]));
    assert_eq!(grh.sgid, from.gid, "GRH source GID is the sender's");
    assert_eq!(grh.dgid, to.gid, "GRH destination GID is ours");
    assert_eq!(&buf.bytes()[GRH_LEN..GRH_LEN + payload.len()], payload);
}

#[test]
fn ud_qp_type_and_transitions() {
    let Some(ctx) = device("ud_qp_type_and_transitions") else {
        return;
    };
    let pd = ctx.alloc_pd().expect("alloc_pd");
    let cq = ctx.create_cq(16, None).expect("create_cq");
    let ud = pd
        .create_ud_qp(&cq, &cq, QpCaps::default())
        .expect("create_ud_qp");
    let rc = pd
        .create_qp(&cq, &cq, QpCaps::default())
        .expect("create_qp");
    assert_eq!(ud.qp_type(), QpType::Ud);
    assert_eq!(rc.qp_type(), QpType::Rc);
    assert_eq!(ud.state(), QpState::Reset);
    let err = ud
        .modify_to_init(&InitAttr::default())
        .expect_err("RC transition on a UD QP");
    assert!(
        matches!(err, ProviderError::InvalidArgument { .. }),
        "{err:?}"
    );
    let err = rc
        .modify_ud_to_rts(&UdAttr::default())
        .expect_err("UD transition on an RC QP");
    assert!(
        matches!(err, ProviderError::InvalidArgument { .. }),
        "{err:?}"
    );
    ud.modify_ud_to_rts(&UdAttr::default()).expect("RTS");
    assert_eq!(ud.state(), QpState::Rts);
    // A second bring-up from RTS is refused by the device, named by state.
    let err = ud
        .modify_ud_to_rts(&UdAttr::default())
        .expect_err("RTS again");
    assert!(
        matches!(
            err,
            ProviderError::InvalidQpState {
                state: QpState::Rts,
                ..
            }
        ),
        "{err:?}"
    );
    let e = ud.endpoint(gid_index(&ctx)).expect("endpoint");
    assert_eq!(e.qpn, ud.qp_num());
    assert!(!e.gid.is_zero(), "RoCE port has a GID");
}

#[test]
fn ud_ping_pong_send_and_send_with_imm() {
    let Some(ctx) = device("ud_ping_pong_send_and_send_with_imm") else {
        return;
    };
    let p = ud_pair(ctx);
    let mut src_a = Buf::new(&p.pd, 512, AccessFlags::LOCAL_WRITE);
    let mut src_b = Buf::new(&p.pd, 512, AccessFlags::LOCAL_WRITE);
    let dst_a = Buf::new(&p.pd, GRH_LEN + 512, AccessFlags::LOCAL_WRITE);
    let dst_b = Buf::new(&p.pd, GRH_LEN + 512, AccessFlags::LOCAL_WRITE);
    let recv_len = (GRH_LEN + 512) as u32;
    for round in 0..8u64 {
        let len = 1 + (round as usize * 61) % 512;
        src_a.fill(|i| (i as u64 * 3 + round) as u8);
        src_b.fill(|i| (i as u64 * 5 + round + 1) as u8);
        post_recv(&p.b, 100 + round, &dst_b, recv_len);
        post_recv(&p.a, 200 + round, &dst_a, recv_len);
        // A -> B: plain SEND.
        post_send(
            &p.a,
            send_to(
                round,
                src_a.sge(0, len as u32),
                dest(&p.ah_ab, &p.b, DEFAULT_QKEY),
                None,
            ),
        );
        let sc = wait(&p.cq_a, 1);
        assert_eq!((sc[0].wr_id, sc[0].status), (round, WcStatus::Success));
        assert_eq!(sc[0].opcode, WcOpcode::Send);
        let rc = wait(&p.cq_b, 1);
        assert_eq!(rc[0].wr_id, 100 + round);
        assert_eq!(rc[0].imm_data, None);
        check_datagram(&rc[0], &dst_b, &src_a.bytes()[..len], &p.ea, &p.eb);
        // B -> A: SEND_WITH_IMM.
        let imm = 0xfeed_0000 | round as u32;
        post_send(
            &p.b,
            send_to(
                round,
                src_b.sge(0, len as u32),
                dest(&p.ah_ba, &p.a, DEFAULT_QKEY),
                Some(imm),
            ),
        );
        assert_eq!(wait(&p.cq_b, 1)[0].status, WcStatus::Success);
        let rc = wait(&p.cq_a, 1);
        assert_eq!(rc[0].wr_id, 200 + round);
        assert_eq!(rc[0].imm_data, Some(imm));
        check_datagram(&rc[0], &dst_a, &src_b.bytes()[..len], &p.eb, &p.ea);
    }
}

#[test]
fn ud_inline_send() {
    let Some(ctx) = device("ud_inline_send") else {
        return;
    };
    let p = ud_pair(ctx);
    let max_inline = p.a.caps().max_inline_data as usize;
    assert!(max_inline > 0, "rxe UD QPs take inline data");
    let dst_b = Buf::new(&p.pd, GRH_LEN + 256, AccessFlags::LOCAL_WRITE);
    post_recv(&p.b, 1, &dst_b, (GRH_LEN + 256) as u32);
    let payload: Vec<u8> = (0..max_inline.min(64)).map(|i| i as u8 ^ 0x5a).collect();
    let mut sgl = SgList::new();
    sgl.push(Sge {
        addr: payload.as_ptr() as u64,
        length: payload.len() as u32,
        lkey: 0,
    });
    post_send(
        &p.a,
        SendWr {
            wr_id: 2,
            sg_list: sgl,
            op: SendOp::SendTo {
                dest: dest(&p.ah_ab, &p.b, DEFAULT_QKEY),
                imm: Some(7),
            },
            flags: SendFlags::SIGNALED | SendFlags::INLINE,
        },
    );
    assert_eq!(wait(&p.cq_a, 1)[0].status, WcStatus::Success);
    let rc = wait(&p.cq_b, 1);
    assert_eq!(rc[0].imm_data, Some(7));
    check_datagram(&rc[0], &dst_b, &payload, &p.ea, &p.eb);
}

/// Sends `first` (expected to be dropped) from A, then a good datagram;
/// B's one receive must get the good one.
fn dropped_then_delivered(p: &UdPair, first: UdDest, post_receive_first: bool) {
    let mut src = Buf::new(&p.pd, 64, AccessFlags::LOCAL_WRITE);
    let dst = Buf::new(&p.pd, GRH_LEN + 64, AccessFlags::LOCAL_WRITE);
    src.fill(|i| i as u8);
    if post_receive_first {
        post_recv(&p.b, 10, &dst, (GRH_LEN + 64) as u32);
    }
    post_send(&p.a, send_to(1, src.sge(0, 32), first, None));
    let sc = wait(&p.cq_a, 1);
    assert_eq!(
        sc[0].status,
        WcStatus::Success,
        "a dropped datagram still completes at the sender"
    );
    if let Err(got) = quiet_for(&p.cq_b, DROP_WAIT) {
        panic!("the datagram was not dropped: {got:?}");
    }
    if !post_receive_first {
        post_recv(&p.b, 10, &dst, (GRH_LEN + 64) as u32);
    }
    post_send(
        &p.a,
        send_to(2, src.sge(32, 32), dest(&p.ah_ab, &p.b, DEFAULT_QKEY), None),
    );
    assert_eq!(wait(&p.cq_a, 1)[0].status, WcStatus::Success);
    let rc = wait(&p.cq_b, 1);
    assert_eq!(rc[0].wr_id, 10);
    check_datagram(&rc[0], &dst, &src.bytes()[32..64], &p.ea, &p.eb);
    assert!(quiet_for(&p.cq_b, Duration::from_millis(50)).is_ok());
}

#[test]
fn ud_wrong_qkey_is_dropped() {
    let Some(ctx) = device("ud_wrong_qkey_is_dropped") else {
        return;
    };
    let p = ud_pair(ctx);
    // High bit clear: the WR's Q_Key is used as given (with the high bit
    // set the sending QP's own Q_Key would replace it).
    let wrong = DEFAULT_QKEY ^ 0x0000_0101;
    dropped_then_delivered(&p, dest(&p.ah_ab, &p.b, wrong), true);
}

#[test]
fn ud_datagram_without_receive_is_dropped() {
    let Some(ctx) = device("ud_datagram_without_receive_is_dropped") else {
        return;
    };
    let p = ud_pair(ctx);
    dropped_then_delivered(&p, dest(&p.ah_ab, &p.b, DEFAULT_QKEY), false);
}

#[test]
fn ud_larger_than_mtu_is_not_sent() {
    let Some(ctx) = device("ud_larger_than_mtu_is_not_sent") else {
        return;
    };
    let p = ud_pair(ctx);
    let mtu = p.ea.mtu.bytes() as usize;
    let src = Buf::new(&p.pd, mtu + 1, AccessFlags::LOCAL_WRITE);
    let dst = Buf::new(&p.pd, GRH_LEN + mtu + 1, AccessFlags::LOCAL_WRITE);
    post_recv(&p.b, 10, &dst, (GRH_LEN + mtu + 1) as u32);
    // SAFETY: SGEs of Bufs, which uphold the post contract (see Buf).
    let posted = unsafe {
        p.a.post_send(&[send_to(
            1,
            src.sge(0, (mtu + 1) as u32),
            dest(&p.ah_ab, &p.b, DEFAULT_QKEY),
            None,
        )])
    };
    println!(
        "ud_larger_than_mtu: MTU {mtu}, post_send of {} B: {posted:?}",
        mtu + 1
    );
    posted.expect("rxe accepts an oversized UD send at post time");
    let sc = wait(&p.cq_a, 1);
    println!("ud_larger_than_mtu: sender completion {:?}", sc[0]);
    let quiet = quiet_for(&p.cq_b, DROP_WAIT);
    println!("ud_larger_than_mtu: receiver: {quiet:?}");
    assert_eq!(sc[0].status, WcStatus::Success, "{:?}", sc[0]);
    assert_eq!(sc[0].opcode, WcOpcode::Send);
    if let Err(got) = quiet {
        panic!("an oversized datagram arrived: {got:?}");
    }
    assert_eq!(p.a.state(), QpState::Rts, "the sender's QP stays usable");
    // An MTU-sized datagram still goes through, into the same receive.
    post_send(
        &p.a,
        send_to(
            2,
            src.sge(0, mtu as u32),
            dest(&p.ah_ab, &p.b, DEFAULT_QKEY),
            None,
        ),
    );
    assert_eq!(wait(&p.cq_a, 1)[0].status, WcStatus::Success);
    let rc = wait(&p.cq_b, 1);
    check_datagram(&rc[0], &dst, &src.bytes()[..mtu], &p.ea, &p.eb);
}

/// A UD provider reads `wr.ud.ah` as an address handle whatever the
/// opcode (rxe dereferences it: an RDMA WRITE's remote address would be
/// taken for one), so the provider refuses every opcode but a datagram on
/// UD, and datagrams on RC, before the device sees them.
#[test]
fn ud_qps_post_only_datagrams() {
    let Some(ctx) = device("ud_qps_post_only_datagrams") else {
        return;
    };
    let p = ud_pair(ctx);
    let src = Buf::new(&p.pd, 64, AccessFlags::LOCAL_WRITE);
    let dst = Buf::new(&p.pd, GRH_LEN + 64, AccessFlags::LOCAL_WRITE);
    post_recv(&p.b, 1, &dst, (GRH_LEN + 64) as u32);
    let write = SendWr {
        wr_id: 9,
        sg_list: src.sge(0, 8),
        op: SendOp::Write {
            remote_addr: 0x1000,
            rkey: 1,
        },
        flags: SendFlags::SIGNALED,
    };
    let good = send_to(8, src.sge(0, 16), dest(&p.ah_ab, &p.b, DEFAULT_QKEY), None);
    // SAFETY: SGEs of Bufs (see Buf); the WRITE is refused before posting.
    let err = unsafe { p.a.post_send(&[good, write.clone()]) }.expect_err("WRITE on UD");
    assert_eq!(err.posted, 1, "the datagram before it was posted");
    assert!(
        matches!(err.error, ProviderError::InvalidArgument { .. }),
        "{err:?}"
    );
    assert_eq!(wait(&p.cq_a, 1)[0].wr_id, 8);
    let rc = wait(&p.cq_b, 1);
    check_datagram(&rc[0], &dst, &src.bytes()[..16], &p.ea, &p.eb);
    assert_eq!(p.a.state(), QpState::Rts);

    // A datagram on an RC QP is refused the same way.
    let rc_qp =
        p.pd.create_qp(&p.cq_a, &p.cq_a, QpCaps::default())
            .expect("create_qp");
    // SAFETY: as above; refused before posting.
    let err = unsafe {
        rc_qp.post_send(&[send_to(
            7,
            src.sge(0, 8),
            dest(&p.ah_ab, &p.b, DEFAULT_QKEY),
            None,
        )])
    }
    .expect_err("datagram on RC");
    assert_eq!(err.posted, 0);
    assert!(
        matches!(err.error, ProviderError::InvalidArgument { .. }),
        "{err:?}"
    );
    assert!(quiet_for(&p.cq_a, Duration::from_millis(50)).is_ok());
}
