//! The shared-receive-queue cases, run on the soft device
//! (`soft_srq.rs`) and on rxe (`ibverbs_srq.rs`) with the same assertions:
//! what rxe does is what the soft device must do.
//!
//! Every case uses one device: the requesters and the responders on the
//! SRQ are QPs of the same context, connected in loopback.
//!
//! Posting over [`Buf`]s upholds the `unsafe` post contracts: a Buf is
//! written only while no WR uses it and read only after the completion
//! that ends the device's access; its memory does not move and outlives
//! its registration (`mr` is dropped first), so a WR still posted when a
//! case ends loses its access before the memory is freed.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use verbio_runtime::provider::{
    AccessFlags, AsyncElement, AsyncEvent, AsyncEventKind, Completion, Context, Cq, InitAttr, Mr,
    Pd, ProviderError, Qp, QpCaps, QpState, RecvWr, RtrAttr, RtsAttr, SendFlags, SendOp, SendWr,
    SgList, Sge, Srq, SrqAttr, WcOpcode, WcStatus,
};

/// Bound of every wait (the rxe VM is emulated and slow).
pub const WAIT: Duration = Duration::from_secs(20);

/// How long "nothing happens" is watched for.
const QUIET: Duration = Duration::from_millis(300);

/// A registered buffer (see the module docs for the post contract).
pub struct Buf {
    // Declared first: deregistered before `mem` is freed.
    pub mr: Mr,
    mem: Box<[u64]>,
}

impl Buf {
    pub fn new(pd: &Pd, len: usize) -> Buf {
        let mut mem = vec![0u64; len.div_ceil(8).max(1)].into_boxed_slice();
        // SAFETY: the boxed slice does not move and `mr` is dropped first.
        let mr = unsafe { pd.reg_mr(mem.as_mut_ptr().cast(), len, AccessFlags::LOCAL_WRITE) }
            .expect("reg_mr");
        Buf { mr, mem }
    }
    pub fn sge(&self, off: usize, len: usize) -> Sge {
        Sge {
            addr: self.mem.as_ptr() as u64 + off as u64,
            length: len as u32,
            lkey: self.mr.lkey(),
        }
    }
    pub fn fill(&mut self, off: usize, data: &[u8]) {
        let bytes: &mut [u8] = bytemuck_bytes(&mut self.mem);
        bytes[off..off + data.len()].copy_from_slice(data);
    }
    pub fn bytes(&self, off: usize, len: usize) -> Vec<u8> {
        // SAFETY: read after the completion that ends the device's access;
        // in bounds of the allocation (checked by the slice index below).
        let all = unsafe {
            std::slice::from_raw_parts(self.mem.as_ptr().cast::<u8>(), self.mem.len() * 8)
        };
        all[off..off + len].to_vec()
    }
}

fn bytemuck_bytes(words: &mut [u64]) -> &mut [u8] {
    // SAFETY: u64s reinterpreted as bytes: same memory, u8 has no
    // alignment or validity requirement.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast(), words.len() * 8) }
}

/// A responder side: one PD, one CQ, one SRQ, QPs on it.
pub struct Responders {
    pub pd: Pd,
    pub cq: Cq,
    pub srq: Srq,
    pub qps: Vec<Qp>,
}

/// The requesters: plain RC QPs on their own CQ, one per responder.
pub struct Requesters {
    pub pd: Pd,
    pub cq: Cq,
    pub qps: Vec<Qp>,
}

/// `n` requesters connected to `n` RC QPs on one SRQ of `srq_attr`.
pub fn setup(
    ctx: &Context,
    gid: u8,
    n: usize,
    srq_attr: SrqAttr,
    rts: RtsAttr,
) -> (Responders, Requesters) {
    let pd = ctx.alloc_pd().expect("alloc_pd");
    let cq = ctx.create_cq(256, None).expect("create_cq");
    let srq = pd.create_srq(&srq_attr).expect("create_srq");
    let rpd = ctx.alloc_pd().expect("alloc_pd");
    let rcq = ctx.create_cq(256, None).expect("create_cq");
    let caps = QpCaps {
        max_send_wr: 32,
        max_recv_wr: 32,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    let mut resp = Vec::new();
    let mut req = Vec::new();
    for _ in 0..n {
        let a = pd
            .create_qp_with_srq(&cq, &cq, caps, &srq)
            .expect("create_qp_with_srq");
        let b = rpd.create_qp(&rcq, &rcq, caps).expect("create_qp");
        let ea = a.endpoint(gid).expect("endpoint");
        let eb = b.endpoint(gid).expect("endpoint");
        for (q, remote) in [(&a, eb), (&b, ea)] {
            q.modify_to_init(&InitAttr::default()).expect("init");
            q.modify_to_rtr(&RtrAttr {
                remote,
                path_mtu: remote.mtu,
                min_rnr_timer: 1,
                max_dest_rd_atomic: 1,
                sgid_index: gid,
                hop_limit: 64,
            })
            .expect("rtr");
            q.modify_to_rts(&rts).expect("rts");
        }
        resp.push(a);
        req.push(b);
    }
    (
        Responders {
            pd,
            cq,
            srq,
            qps: resp,
        },
        Requesters {
            pd: rpd,
            cq: rcq,
            qps: req,
        },
    )
}

fn attr(max_wr: u32, limit: u32) -> SrqAttr {
    SrqAttr {
        max_wr,
        max_sge: 1,
        srq_limit: limit,
    }
}

fn rts(rnr_retry: u8) -> RtsAttr {
    RtsAttr {
        rnr_retry,
        ..RtsAttr::default()
    }
}

/// Posts one receive of `len` bytes at `off` of `buf` to the SRQ.
fn post_srq(srq: &Srq, buf: &Buf, wr_id: u64, off: usize, len: usize) {
    let mut sg_list = SgList::new();
    sg_list.push(buf.sge(off, len));
    // SAFETY: see the module docs.
    unsafe { srq.post_recv(&[RecvWr { wr_id, sg_list }]) }.expect("post_srq_recv");
}

/// Sends `len` bytes at `off` of `buf` on `qp` (signaled).
fn send(qp: &Qp, buf: &Buf, wr_id: u64, off: usize, len: usize) {
    let mut sg_list = SgList::new();
    sg_list.push(buf.sge(off, len));
    let wr = SendWr {
        wr_id,
        sg_list,
        op: SendOp::Send,
        flags: SendFlags::SIGNALED,
    };
    // SAFETY: see the module docs.
    unsafe { qp.post_send(&[wr]) }.expect("post_send");
}

/// Polls `n` completions (bounded by [`WAIT`]).
pub fn poll_n(cq: &Cq, n: usize) -> Vec<Completion> {
    let deadline = Instant::now() + WAIT;
    let mut out = Vec::new();
    let mut buf = [Completion::EMPTY; 16];
    while out.len() < n {
        let got = cq.poll(&mut buf[..(n - out.len()).min(16)]).expect("poll");
        out.extend_from_slice(&buf[..got]);
        if got == 0 {
            assert!(
                Instant::now() < deadline,
                "timed out: {} of {n} completions: {out:?}",
                out.len()
            );
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    out
}

/// Asserts no completion arrives on `cq` for [`QUIET`].
fn quiet(cq: &Cq) {
    let deadline = Instant::now() + QUIET;
    let mut buf = [Completion::EMPTY; 4];
    while Instant::now() < deadline {
        let got = cq.poll(&mut buf).expect("poll");
        assert_eq!(got, 0, "unexpected completion: {:?}", &buf[..got]);
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The async events raised within `within`.
fn async_events(ctx: &Context, within: Duration) -> Vec<AsyncEvent> {
    let deadline = Instant::now() + within;
    let mut out = Vec::new();
    while Instant::now() < deadline {
        match ctx.get_async_event().expect("get_async_event") {
            Some(ev) => out.push(ev),
            None => std::thread::sleep(Duration::from_millis(2)),
        }
    }
    out
}

fn limit_events(evs: &[AsyncEvent], srq: &Srq) -> usize {
    evs.iter()
        .filter(|e| {
            e.kind == AsyncEventKind::SrqLimitReached
                && e.element == AsyncElement::Srq(srq.handle())
        })
        .count()
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(13) ^ seed)
        .collect()
}

/// Three QPs on one SRQ: each message takes the oldest posted WR whatever
/// QP it comes in on, and its completion names that QP.
pub fn messages_of_many_qps_share_the_srq(ctx: &Context, gid: u8) {
    let (resp, req) = setup(ctx, gid, 3, attr(16, 0), rts(7));
    let rbuf = Buf::new(&resp.pd, 6 * 64);
    for i in 0..6 {
        post_srq(&resp.srq, &rbuf, 100 + i, i as usize * 64, 64);
    }
    let mut sbuf = Buf::new(&req.pd, 6 * 64);
    // Two messages per QP, one QP at a time (so the order is known).
    let mut sent = Vec::new();
    for i in 0..6usize {
        let q = i / 2;
        let data = pattern(i as u8, 40 + i);
        sbuf.fill(i * 64, &data);
        send(&req.qps[q], &sbuf, i as u64, i * 64, data.len());
        assert!(poll_n(&req.cq, 1)[0].status.is_success());
        let wc = poll_n(&resp.cq, 1)[0];
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        assert_eq!(wc.opcode, WcOpcode::Recv);
        assert_eq!(wc.wr_id, 100 + i as u64, "the oldest SRQ WR is taken");
        assert_eq!(
            wc.qp_num,
            resp.qps[q].qp_num(),
            "the completion names the QP"
        );
        assert_eq!(wc.byte_len as usize, data.len());
        sent.push((i, data));
    }
    for (i, data) in sent {
        assert_eq!(rbuf.bytes(i * 64, data.len()), data, "message {i}");
    }
}

/// `post_recv` on a QP created on an SRQ is refused (rxe: EINVAL).
pub fn post_recv_on_an_srq_qp_is_refused(ctx: &Context, gid: u8) {
    let (resp, _req) = setup(ctx, gid, 1, attr(4, 0), rts(7));
    let buf = Buf::new(&resp.pd, 64);
    let mut sg_list = SgList::new();
    sg_list.push(buf.sge(0, 64));
    // SAFETY: see the module docs.
    let err = unsafe { resp.qps[0].post_recv(&[RecvWr { wr_id: 1, sg_list }]) }
        .expect_err("post_recv on an SRQ QP");
    assert_eq!(err.posted, 0);
    assert!(
        matches!(err.error, ProviderError::InvalidArgument { .. }),
        "{err:?}"
    );
}

/// An SRQ holds `max_wr` WRs (as granted: `attr`); one more is refused as
/// a full queue. A limit above the device's WR maximum is refused.
pub fn srq_capacity_and_bad_limit(ctx: &Context, _gid: u8) {
    let pd = ctx.alloc_pd().expect("alloc_pd");
    let srq = pd.create_srq(&attr(8, 0)).expect("create_srq");
    let got = srq.attr().expect("query_srq");
    assert!(got.max_wr >= 8, "{got:?}");
    assert_eq!(got.srq_limit, 0);
    let buf = Buf::new(&pd, 64);
    for i in 0..got.max_wr {
        post_srq(&srq, &buf, u64::from(i), 0, 64);
    }
    let mut sg_list = SgList::new();
    sg_list.push(buf.sge(0, 64));
    // SAFETY: see the module docs.
    let err =
        unsafe { srq.post_recv(&[RecvWr { wr_id: 99, sg_list }]) }.expect_err("post to a full SRQ");
    assert_eq!(err.posted, 0);
    assert!(
        matches!(err.error, ProviderError::QueueFull { .. }),
        "{err:?}"
    );
    let err = srq
        .modify_limit(1 << 30)
        .expect_err("limit far above max_wr");
    assert!(
        matches!(err, ProviderError::InvalidArgument { .. }),
        "{err:?}"
    );
}

/// The limit event: armed by `modify_limit`, raised once when a message
/// leaves fewer WRs posted than the limit (not at equal), disarmed by
/// that (the limit reads 0), raised again only after re-arming.
pub fn limit_event_fires_once_until_rearmed(ctx: &Context, gid: u8) {
    // Events of earlier cases on the same context are not ours.
    let _ = async_events(ctx, Duration::ZERO);
    let (resp, req) = setup(ctx, gid, 1, attr(16, 0), rts(7));
    let rbuf = Buf::new(&resp.pd, 8 * 64);
    for i in 0..6 {
        post_srq(&resp.srq, &rbuf, i, i as usize * 64, 64);
    }
    resp.srq.modify_limit(4).expect("arm the limit");
    assert_eq!(resp.srq.attr().expect("query").srq_limit, 4);
    let mut sbuf = Buf::new(&req.pd, 64);
    sbuf.fill(0, b"ping");
    let exchange = |id: u64| {
        send(&req.qps[0], &sbuf, id, 0, 4);
        assert!(poll_n(&req.cq, 1)[0].status.is_success());
        assert!(poll_n(&resp.cq, 1)[0].status.is_success());
    };
    // 6 -> 5 -> 4 posted: not below the limit.
    exchange(1);
    exchange(2);
    assert_eq!(limit_events(&async_events(ctx, QUIET), &resp.srq), 0);
    assert_eq!(resp.srq.attr().expect("query").srq_limit, 4, "still armed");
    // 4 -> 3: below.
    exchange(3);
    let evs = async_events(ctx, QUIET);
    assert_eq!(limit_events(&evs, &resp.srq), 1, "{evs:?}");
    assert_eq!(resp.srq.attr().expect("query").srq_limit, 0, "disarmed");
    // 3 -> 2: disarmed, no event.
    exchange(4);
    assert_eq!(limit_events(&async_events(ctx, QUIET), &resp.srq), 0);
    // Re-armed at 2 with 2 posted: the next message (2 -> 1) raises it.
    resp.srq.modify_limit(2).expect("re-arm");
    exchange(5);
    let evs = async_events(ctx, QUIET);
    assert_eq!(limit_events(&evs, &resp.srq), 1, "{evs:?}");
}

/// A SEND to a QP whose SRQ is empty gets RNR, as on a plain QP: with
/// `rnr_retry` 0 the requester completes `RNR_RETRY_EXC_ERR`; with 7 it
/// retries until a WR is posted, and the message lands there.
pub fn empty_srq_answers_rnr(ctx: &Context, gid: u8) {
    let (resp, req) = setup(ctx, gid, 2, attr(4, 0), rts(0));
    let sbuf = Buf::new(&req.pd, 64);
    send(&req.qps[0], &sbuf, 1, 0, 16);
    let wc = poll_n(&req.cq, 1)[0];
    assert_eq!(wc.status, WcStatus::RnrRetryExcErr, "{wc:?}");
    quiet(&resp.cq);

    let (resp, req) = setup(ctx, gid, 1, attr(4, 0), rts(7));
    let mut sbuf = Buf::new(&req.pd, 64);
    sbuf.fill(0, b"late receive");
    send(&req.qps[0], &sbuf, 2, 0, 12);
    quiet(&resp.cq);
    let rbuf = Buf::new(&resp.pd, 64);
    post_srq(&resp.srq, &rbuf, 7, 0, 64);
    let wc = poll_n(&resp.cq, 1)[0];
    assert_eq!(
        (wc.status, wc.wr_id, wc.byte_len),
        (WcStatus::Success, 7, 12)
    );
    assert!(poll_n(&req.cq, 1)[0].status.is_success());
    assert_eq!(rbuf.bytes(0, 12), b"late receive");
}

/// A message longer than the SRQ WR it takes: the receiver's completion
/// is `status` naming its QP, as for a plain QP (`LOC_QP_OP_ERR` on rxe,
/// `LOC_LEN_ERR` on the soft device, which follows the spec there), the
/// requester's `REM_OP_ERR`; that QP goes to ERR; the SRQ's other WRs
/// stay posted (they are not the failed QP's) and serve the next message
/// of another QP on the SRQ.
pub fn too_small_srq_wr_fails_only_its_qp(ctx: &Context, gid: u8, status: WcStatus) {
    let (resp, req) = setup(ctx, gid, 2, attr(8, 0), rts(7));
    let rbuf = Buf::new(&resp.pd, 128);
    post_srq(&resp.srq, &rbuf, 1, 0, 8);
    post_srq(&resp.srq, &rbuf, 2, 64, 64);
    let mut sbuf = Buf::new(&req.pd, 64);
    sbuf.fill(0, &pattern(5, 32));
    send(&req.qps[0], &sbuf, 10, 0, 32);
    let wc = poll_n(&resp.cq, 1)[0];
    assert_eq!(wc.status, status, "{wc:?}");
    assert_eq!(wc.wr_id, 1);
    assert_eq!(wc.qp_num, resp.qps[0].qp_num());
    let wc = poll_n(&req.cq, 1)[0];
    assert_eq!(wc.status, WcStatus::RemOpErr, "{wc:?}");
    let deadline = Instant::now() + WAIT;
    while resp.qps[0].state() != QpState::Err {
        assert!(Instant::now() < deadline, "responder QP not in ERR");
        std::thread::sleep(Duration::from_millis(1));
    }
    // No flush of the SRQ's other WR on the failed QP.
    quiet(&resp.cq);
    send(&req.qps[1], &sbuf, 11, 0, 32);
    let wc = poll_n(&resp.cq, 1)[0];
    assert_eq!((wc.status, wc.wr_id), (WcStatus::Success, 2), "{wc:?}");
    assert_eq!(wc.qp_num, resp.qps[1].qp_num());
    assert!(poll_n(&req.cq, 1)[0].status.is_success());
    assert_eq!(rbuf.bytes(64, 32), pattern(5, 32));
}
