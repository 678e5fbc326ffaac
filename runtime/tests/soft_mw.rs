//! Soft device: memory windows (type 2) follow rxe's rules; the cases are
//! shared with `ibverbs_mw.rs` (`mw_cases/`).

mod common;
mod mw_cases;

use common::open_test_context;
use verbio_runtime::provider::*;

#[test]
fn bind_then_access() {
    mw_cases::bind_then_access(&open_test_context(), 0);
}

#[test]
fn access_outside_window_fails() {
    let status = mw_cases::access_outside_window(&open_test_context(), 0);
    assert_eq!(status, WcStatus::RemAccessErr);
}

#[test]
fn access_outside_region_fails() {
    mw_cases::access_outside_region_fails(&open_test_context(), 0);
}

#[test]
fn access_beyond_window_rights_fails() {
    mw_cases::access_beyond_window_rights_fails(&open_test_context(), 0);
}

#[test]
fn local_inv_revokes_and_rebind_works() {
    mw_cases::local_inv_revokes_and_rebind_works(&open_test_context(), 0);
}

#[test]
fn send_with_inv_revokes() {
    let rc = mw_cases::send_with_inv_revokes(&open_test_context(), 0);
    assert!(rc.with_inv, "IBV_WC_WITH_INV");
    assert!(rc.imm_data.is_some(), "the invalidated rkey");
}

#[test]
fn bind_needs_mw_bind_access() {
    mw_cases::bind_needs_mw_bind_access(&open_test_context(), 0);
}

#[test]
fn bound_window_cannot_rebind() {
    mw_cases::bound_window_cannot_rebind(&open_test_context(), 0);
}

#[test]
fn local_inv_of_unbound_window_fails() {
    mw_cases::local_inv_of_unbound_window_fails(&open_test_context(), 0);
}

#[test]
fn window_belongs_to_its_qp() {
    mw_cases::window_belongs_to_its_qp(&open_test_context(), 0);
}

/// Soft device only (rxe refuses to deregister a region with bound
/// windows): once the region is gone, its window reaches nothing.
#[test]
fn window_over_a_deregistered_region_reaches_nothing() {
    let ctx = open_test_context();
    let r = mw_cases::Rig::new(&ctx, 0);
    let mut mem = r.buf(4096, mw_cases::BINDABLE);
    let mw = r.pd.alloc_mw().expect("alloc_mw");
    let op = mw_cases::bind(&mw, &mem, 0, 64, AccessFlags::REMOTE_READ);
    assert_eq!(mw_cases::run(&r.b, op, &[]).status, WcStatus::Success);
    mem.dereg();
    let dst = r.buf(64, AccessFlags::LOCAL_WRITE);
    let read = SendOp::Read {
        remote_addr: mem.addr(),
        rkey: mw.rkey(),
    };
    let c = mw_cases::run(&r.a, read, &[dst.sge(0, 64)]);
    assert_eq!(c.status, WcStatus::RemAccessErr);
}

/// A bind carries no local memory: one with SGEs is refused at post.
#[test]
fn bind_with_sges_is_refused_at_post() {
    let ctx = open_test_context();
    let r = mw_cases::Rig::new(&ctx, 0);
    let mem = r.buf(64, mw_cases::BINDABLE);
    let mw = r.pd.alloc_mw().expect("alloc_mw");
    let op = mw_cases::bind(&mw, &mem, 0, 64, AccessFlags::REMOTE_READ);
    // SAFETY: refused before the device sees it; the SGE is a RegBuf's.
    let e = unsafe {
        r.b.qp
            .post_send(&[common::wr(1, op, &[mem.sge(0, 8)], SendFlags::SIGNALED)])
    }
    .expect_err("refused");
    assert_eq!(e.posted, 0);
}

/// Soft device only (on rxe 6.1 it takes the kernel path that panics):
/// SEND_WITH_INV naming no bound window fails the receive and the send
/// `REM_INV_REQ_ERR`.
#[test]
fn send_with_inv_of_no_window_fails_both_sides() {
    let ctx = open_test_context();
    let r = mw_cases::Rig::new(&ctx, 0);
    let mw = r.pd.alloc_mw().expect("alloc_mw");
    let rbuf = r.buf(64, AccessFlags::LOCAL_WRITE);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe { r.b.qp.post_recv(&[common::rwr(5, &[rbuf.sge(0, 64)])]) }.expect("post_recv");
    let msg = r.buf(16, AccessFlags::LOCAL_WRITE);
    let op = SendOp::SendWithInv { rkey: mw.rkey() };
    let c = mw_cases::run(&r.a, op, &[msg.sge(0, 16)]);
    assert_eq!(c.status, WcStatus::RemInvReqErr);
    let rc = common::poll_one(&r.b.rcq);
    assert_eq!((rc.wr_id, rc.status), (5, WcStatus::RemInvReqErr));
}
