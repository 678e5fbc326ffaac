//! Memory-window cases run on both providers (`soft_mw.rs` on the soft
//! device, `ibverbs_mw.rs` on rxe): the statuses asserted here are the
//! ones measured on rxe, so the soft device is held to them.
#![allow(dead_code)]

use verbio_runtime::provider::*;

use crate::common::{poll_one, rwr, wait_state, wr, RegBuf};

const SIG: SendFlags = SendFlags::SIGNALED;

/// The region windows are bound to: local write and MW_BIND, no remote
/// access of its own.
pub const BINDABLE: AccessFlags =
    AccessFlags::from_bits_truncate(AccessFlags::LOCAL_WRITE.bits() | AccessFlags::MW_BIND.bits());

/// A requester `a` and a responder `b`, connected QPs of one PD on one
/// device, each with its own send and receive CQs.
pub struct Rig {
    pub ctx: Context,
    pub pd: Pd,
    pub a: End,
    pub b: End,
}

pub struct End {
    pub qp: Qp,
    pub scq: Cq,
    pub rcq: Cq,
}

impl Rig {
    pub fn new(ctx: &Context, gid: u8) -> Rig {
        let pd = ctx.alloc_pd().expect("alloc_pd");
        let end = || {
            let scq = ctx.create_cq(64, None).expect("cq");
            let rcq = ctx.create_cq(64, None).expect("cq");
            let qp = pd.create_qp(&scq, &rcq, QpCaps::default()).expect("qp");
            qp.modify_to_init(&InitAttr::default()).expect("INIT");
            End { qp, scq, rcq }
        };
        let (a, b) = (end(), end());
        let ea = a.qp.endpoint(gid).expect("endpoint");
        let eb = b.qp.endpoint(gid).expect("endpoint");
        for (q, remote, local) in [(&a.qp, eb, ea), (&b.qp, ea, eb)] {
            q.modify_to_rtr(&RtrAttr {
                remote,
                path_mtu: local.mtu.min(remote.mtu),
                min_rnr_timer: 12,
                max_dest_rd_atomic: 16,
                sgid_index: gid,
                hop_limit: 64,
            })
            .expect("RTR");
            q.modify_to_rts(&RtsAttr {
                rnr_retry: 6,
                ..RtsAttr::default()
            })
            .expect("RTS");
        }
        Rig {
            ctx: ctx.clone(),
            pd,
            a,
            b,
        }
    }

    pub fn buf(&self, len: usize, access: AccessFlags) -> RegBuf {
        RegBuf::new(&self.pd, len, access)
    }
}

/// Posts one send WR on `end` and returns its completion.
pub fn run(end: &End, op: SendOp, sges: &[Sge]) -> Completion {
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf);
    // bind WRs name windows and regions the caller keeps alive.
    unsafe { end.qp.post_send(&[wr(1, op, sges, SIG)]) }.expect("post_send");
    poll_one(&end.scq)
}

/// A bind of `mw` over `[off, off + len)` of `buf` with `access`.
pub fn bind(mw: &Mw, buf: &RegBuf, off: u64, len: u64, access: AccessFlags) -> SendOp {
    SendOp::BindMw {
        mw: mw.raw(),
        mr: buf.mr().raw(),
        addr: buf.addr() + off,
        len,
        access,
        rkey: mw.next_rkey(),
    }
}

fn rw() -> AccessFlags {
    AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE
}

/// Bind, then WRITE and READ inside the window through its rkey; the rkey
/// changes only in its key byte.
pub fn bind_then_access(ctx: &Context, gid: u8) {
    let r = Rig::new(ctx, gid);
    let mem = r.buf(4096, BINDABLE);
    let mw = r.pd.alloc_mw().expect("alloc_mw");
    let before = mw.rkey();
    let c = run(&r.b, bind(&mw, &mem, 1024, 512, rw()), &[]);
    assert_eq!((c.status, c.opcode), (WcStatus::Success, WcOpcode::BindMw));
    let rkey = mw.rkey();
    assert_eq!(rkey, inc_rkey(before));
    assert_eq!(rkey >> 8, before >> 8, "only the key byte changes");
    let src = r.buf(512, AccessFlags::LOCAL_WRITE);
    let data = src.fill_pattern(9);
    let write = SendOp::Write {
        remote_addr: mem.addr() + 1024,
        rkey,
    };
    let c = run(&r.a, write, &[src.sge(0, 512)]);
    assert_eq!(c.status, WcStatus::Success);
    assert_eq!(&mem.read()[1024..1536], &data[..]);
    let dst = r.buf(256, AccessFlags::LOCAL_WRITE);
    let read = SendOp::Read {
        remote_addr: mem.addr() + 1024 + 256,
        rkey,
    };
    let c = run(&r.a, read, &[dst.sge(0, 256)]);
    assert_eq!(c.status, WcStatus::Success);
    assert_eq!(dst.read(), data[256..].to_vec());
}

/// The status of a READ that leaves a window by one byte but stays inside
/// its region. The soft device refuses it (REM_ACCESS_ERR, the spec);
/// rxe (Linux 6.1) lets it through: it checks the region's range only.
pub fn access_outside_window(ctx: &Context, gid: u8) -> WcStatus {
    let r = Rig::new(ctx, gid);
    let mem = r.buf(4096, BINDABLE);
    let mw = r.pd.alloc_mw().expect("alloc_mw");
    let c = run(&r.b, bind(&mw, &mem, 1024, 512, rw()), &[]);
    assert_eq!(c.status, WcStatus::Success);
    let dst = r.buf(64, AccessFlags::LOCAL_WRITE);
    let read = SendOp::Read {
        remote_addr: mem.addr() + 1024 + 512 - 63,
        rkey: mw.rkey(),
    };
    run(&r.a, read, &[dst.sge(0, 64)]).status
}

/// A READ that leaves the window's region fails REM_ACCESS_ERR (both
/// providers) and the requester's QP goes to ERR.
pub fn access_outside_region_fails(ctx: &Context, gid: u8) {
    let r = Rig::new(ctx, gid);
    let mem = r.buf(4096, BINDABLE);
    let mw = r.pd.alloc_mw().expect("alloc_mw");
    let c = run(&r.b, bind(&mw, &mem, 4096 - 512, 512, rw()), &[]);
    assert_eq!(c.status, WcStatus::Success);
    let dst = r.buf(64, AccessFlags::LOCAL_WRITE);
    let read = SendOp::Read {
        remote_addr: mem.addr() + 4096 - 63,
        rkey: mw.rkey(),
    };
    let c = run(&r.a, read, &[dst.sge(0, 64)]);
    assert_eq!(c.status, WcStatus::RemAccessErr);
    wait_state(&r.a.qp, QpState::Err);
}

/// A WRITE through a read-only window fails REM_ACCESS_ERR.
pub fn access_beyond_window_rights_fails(ctx: &Context, gid: u8) {
    let r = Rig::new(ctx, gid);
    let mem = r.buf(4096, BINDABLE);
    let mw = r.pd.alloc_mw().expect("alloc_mw");
    let c = run(
        &r.b,
        bind(&mw, &mem, 0, 4096, AccessFlags::REMOTE_READ),
        &[],
    );
    assert_eq!(c.status, WcStatus::Success);
    let src = r.buf(64, AccessFlags::LOCAL_WRITE);
    let write = SendOp::Write {
        remote_addr: mem.addr(),
        rkey: mw.rkey(),
    };
    let c = run(&r.a, write, &[src.sge(0, 64)]);
    assert_eq!(c.status, WcStatus::RemAccessErr);
    assert!(mem.read().iter().all(|&x| x == 0), "nothing was written");
}

/// LOCAL_INV completes LOCAL_INV; the old rkey then fails REM_ACCESS_ERR.
/// A second bind gives the next key byte and works.
pub fn local_inv_revokes_and_rebind_works(ctx: &Context, gid: u8) {
    let r = Rig::new(ctx, gid);
    let mem = r.buf(4096, BINDABLE);
    let mw = r.pd.alloc_mw().expect("alloc_mw");
    assert_eq!(
        run(&r.b, bind(&mw, &mem, 0, 64, rw()), &[]).status,
        WcStatus::Success
    );
    let old = mw.rkey();
    let c = run(&r.b, SendOp::LocalInv { rkey: old }, &[]);
    assert_eq!(
        (c.status, c.opcode),
        (WcStatus::Success, WcOpcode::LocalInv)
    );
    let c = run(&r.b, bind(&mw, &mem, 64, 64, rw()), &[]);
    assert_eq!(
        c.status,
        WcStatus::Success,
        "rebinding an invalidated window"
    );
    let new = mw.rkey();
    assert_eq!(new, inc_rkey(old));
    let dst = r.buf(64, AccessFlags::LOCAL_WRITE);
    let c = run(
        &r.a,
        SendOp::Read {
            remote_addr: mem.addr() + 64,
            rkey: new,
        },
        &[dst.sge(0, 64)],
    );
    assert_eq!(c.status, WcStatus::Success);
    let c = run(
        &r.a,
        SendOp::Read {
            remote_addr: mem.addr(),
            rkey: old,
        },
        &[dst.sge(0, 64)],
    );
    assert_eq!(c.status, WcStatus::RemAccessErr, "the invalidated rkey");
    wait_state(&r.a.qp, QpState::Err);
}

/// SEND_WITH_INV invalidates the responder's window before the receive
/// completes; returns the receive completion (the soft device sets
/// `with_inv` and the rkey in `imm_data`; rxe on Linux 6.1 was measured
/// not to report `IBV_WC_WITH_INV`).
pub fn send_with_inv_revokes(ctx: &Context, gid: u8) -> Completion {
    let r = Rig::new(ctx, gid);
    let mem = r.buf(4096, BINDABLE);
    let mw = r.pd.alloc_mw().expect("alloc_mw");
    assert_eq!(
        run(&r.b, bind(&mw, &mem, 0, 128, rw()), &[]).status,
        WcStatus::Success
    );
    let rkey = mw.rkey();
    let rbuf = r.buf(64, AccessFlags::LOCAL_WRITE);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe { r.b.qp.post_recv(&[rwr(5, &[rbuf.sge(0, 64)])]) }.expect("post_recv");
    let msg = r.buf(16, AccessFlags::LOCAL_WRITE);
    let data = msg.fill_pattern(3);
    let c = run(&r.a, SendOp::SendWithInv { rkey }, &[msg.sge(0, 16)]);
    assert_eq!((c.status, c.opcode), (WcStatus::Success, WcOpcode::Send));
    let rc = poll_one(&r.b.rcq);
    assert_eq!(
        (rc.wr_id, rc.status, rc.opcode),
        (5, WcStatus::Success, WcOpcode::Recv)
    );
    assert_eq!(&rbuf.read()[..16], &data[..]);
    let dst = r.buf(64, AccessFlags::LOCAL_WRITE);
    let c = run(
        &r.a,
        SendOp::Read {
            remote_addr: mem.addr(),
            rkey,
        },
        &[dst.sge(0, 64)],
    );
    assert_eq!(c.status, WcStatus::RemAccessErr, "the invalidated rkey");
    rc
}

/// A bind over a region without MW_BIND completes MW_BIND_ERR and fails
/// the QP.
pub fn bind_needs_mw_bind_access(ctx: &Context, gid: u8) {
    let r = Rig::new(ctx, gid);
    let mem = r.buf(4096, AccessFlags::ALL);
    let mw = r.pd.alloc_mw().expect("alloc_mw");
    let c = run(&r.b, bind(&mw, &mem, 0, 64, rw()), &[]);
    assert_eq!(c.status, WcStatus::MwBindErr);
    wait_state(&r.b.qp, QpState::Err);
}

/// A bound type 2 window cannot be bound again before it is invalidated.
pub fn bound_window_cannot_rebind(ctx: &Context, gid: u8) {
    let r = Rig::new(ctx, gid);
    let mem = r.buf(4096, BINDABLE);
    let mw = r.pd.alloc_mw().expect("alloc_mw");
    assert_eq!(
        run(&r.b, bind(&mw, &mem, 0, 64, rw()), &[]).status,
        WcStatus::Success
    );
    let c = run(&r.b, bind(&mw, &mem, 0, 64, rw()), &[]);
    assert_eq!(c.status, WcStatus::MwBindErr);
}

/// LOCAL_INV of an rkey that names no bound window: LOC_QP_OP_ERR on the
/// soft device. Not run on rxe: Linux 6.1's rxe dereferences the unbound
/// window's NULL QP in `rxe_do_invalidate_mw` and the kernel panics
/// (measured in the VM).
pub fn local_inv_of_unbound_window_fails(ctx: &Context, gid: u8) {
    let r = Rig::new(ctx, gid);
    let mw = r.pd.alloc_mw().expect("alloc_mw");
    let c = run(&r.b, SendOp::LocalInv { rkey: mw.rkey() }, &[]);
    assert_eq!(c.status, WcStatus::LocQpOpErr);
    wait_state(&r.b.qp, QpState::Err);
}

/// A window bound over one QP is not reachable from another QP of the same
/// PD (type 2 windows belong to the QP that bound them).
pub fn window_belongs_to_its_qp(ctx: &Context, gid: u8) {
    let r = Rig::new(ctx, gid);
    let mem = r.buf(4096, BINDABLE);
    let mw = r.pd.alloc_mw().expect("alloc_mw");
    // Bound over A's QP: B's requests reach A's QP, so B may use it...
    assert_eq!(
        run(&r.a, bind(&mw, &mem, 0, 64, rw()), &[]).status,
        WcStatus::Success
    );
    let dst = r.buf(64, AccessFlags::LOCAL_WRITE);
    let read = SendOp::Read {
        remote_addr: mem.addr(),
        rkey: mw.rkey(),
    };
    assert_eq!(run(&r.b, read, &[dst.sge(0, 64)]).status, WcStatus::Success);
    // ...but A's requests reach B's QP, which did not bind it.
    assert_eq!(
        run(&r.a, read, &[dst.sge(0, 64)]).status,
        WcStatus::RemAccessErr
    );
}
