//! Registered buffers against the software RDMA device: pool blocks, user
//! memory and granted regions used by real work requests, and revoked rkeys
//! refused by the responder.

use std::time::{Duration, Instant};

use verbio_runtime::buf::{IoBuf, MrPool, RegisteredBuf, RegisteredMem, RemoteAccessRegion};
use verbio_runtime::provider::{
    AccessFlags, Completion, Context, Cq, InitAttr, Pd, Qp, QpCaps, RecvWr, RtrAttr, RtsAttr,
    SendFlags, SendOp, SendWr, SgList, SoftConfig, WcStatus,
};

struct Side {
    qp: Qp,
    cq: Cq,
}

struct Pair {
    _ctx: Context,
    pd: Pd,
    a: Side,
    b: Side,
}

fn side(ctx: &Context, pd: &Pd) -> Side {
    let cq = ctx.create_cq(64, None).expect("create_cq");
    let qp = pd
        .create_qp(&cq, &cq, QpCaps::default())
        .expect("create_qp");
    qp.modify_to_init(&InitAttr::default()).expect("INIT");
    Side { qp, cq }
}

fn connect(s: &Side, peer: &Side) {
    let remote = peer.qp.endpoint(0).expect("endpoint");
    s.qp.modify_to_rtr(&RtrAttr {
        remote,
        path_mtu: remote.mtu,
        min_rnr_timer: 12,
        max_dest_rd_atomic: 16,
        sgid_index: 0,
        hop_limit: 64,
    })
    .expect("RTR");
    s.qp.modify_to_rts(&RtsAttr {
        // Fail fast if something is lost: ≈ 67 ms × 2 retries.
        retry_cnt: 2,
        rnr_retry: 2,
        ..RtsAttr::default()
    })
    .expect("RTS");
}

/// Two connected RC QPs on one soft device (ephemeral port), or `None`
/// (after printing SKIPPED) while the soft device is a placeholder.
fn pair() -> Option<Pair> {
    let opened = std::panic::catch_unwind(|| Context::open_soft(SoftConfig::default()));
    let Ok(ctx) = opened else {
        println!("SKIPPED: the soft RDMA device is not implemented in this build");
        return None;
    };
    let ctx = ctx.expect("open soft device");
    let pd = ctx.alloc_pd().expect("alloc_pd");
    let a = side(&ctx, &pd);
    let b = side(&ctx, &pd);
    connect(&a, &b);
    connect(&b, &a);
    Some(Pair {
        _ctx: ctx,
        pd,
        a,
        b,
    })
}

/// Polls one completion, failing the test after 10 s instead of hanging.
fn wait(cq: &Cq) -> Completion {
    let start = Instant::now();
    let mut out = [Completion::EMPTY; 1];
    loop {
        if cq.poll(&mut out).expect("poll") == 1 {
            return out[0];
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no completion within 10 s"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn sg(sge: verbio_runtime::provider::Sge) -> SgList {
    std::iter::once(sge).collect()
}

fn write(qp: &Qp, wr_id: u64, src: &impl RegisteredBuf, remote_addr: u64, rkey: u32) {
    qp.post_send(&[SendWr {
        wr_id,
        sg_list: sg(src.sge_init().expect("sge")),
        op: SendOp::Write { remote_addr, rkey },
        flags: SendFlags::SIGNALED,
    }])
    .expect("post WRITE");
}

#[test]
fn pool_blocks_carry_working_lkeys() {
    let Some(p) = pair() else { return };
    let pool = MrPool::new(&p.pd);
    let rx = pool.alloc(4096).expect("alloc rx");
    p.b.qp
        .post_recv(&[RecvWr {
            wr_id: 1,
            sg_list: sg(rx.sge_total().expect("sge")),
        }])
        .expect("post RECV");
    let tx = pool.alloc_from(b"from a pooled block").expect("alloc tx");
    p.a.qp
        .post_send(&[SendWr {
            wr_id: 2,
            sg_list: sg(tx.sge_init().expect("sge")),
            op: SendOp::Send,
            flags: SendFlags::SIGNALED,
        }])
        .expect("post SEND");
    let c = wait(&p.a.cq);
    assert_eq!((c.wr_id, c.status), (2, WcStatus::Success));
    let c = wait(&p.b.cq);
    assert_eq!((c.wr_id, c.status, c.byte_len), (1, WcStatus::Success, 19));
    let mut rx = rx;
    // SAFETY: the completion says the device wrote 19 bytes.
    unsafe { verbio_runtime::buf::IoBufMut::set_init(&mut rx, c.byte_len as usize) };
    assert_eq!(&rx[..], b"from a pooled block");
    // The freed blocks are reused, without new registrations.
    let regs = pool.stats().registrations;
    let addr = tx.stable_ptr();
    drop(tx);
    assert_eq!(pool.alloc(10).expect("realloc").stable_ptr(), addr);
    assert_eq!(pool.stats().registrations, regs);
}

#[test]
fn user_memory_registered_in_place_receives_and_comes_back() {
    let Some(p) = pair() else { return };
    let mem = RegisteredMem::register(&p.pd, vec![0u8; 256], AccessFlags::LOCAL_WRITE)
        .expect("register user memory");
    let dst_addr = mem.stable_ptr();
    p.b.qp
        .post_recv(&[RecvWr {
            wr_id: 1,
            sg_list: sg(mem.sge(16..48).expect("sge")),
        }])
        .expect("post RECV");
    let pool = MrPool::new(&p.pd);
    let tx = pool.alloc_from(b"zero-copy receive").expect("alloc");
    p.a.qp
        .post_send(&[SendWr {
            wr_id: 2,
            sg_list: sg(tx.sge_init().expect("sge")),
            op: SendOp::Send,
            flags: SendFlags::SIGNALED,
        }])
        .expect("post SEND");
    assert_eq!(wait(&p.a.cq).status, WcStatus::Success);
    assert_eq!(wait(&p.b.cq).status, WcStatus::Success);
    let v = mem.into_inner();
    assert_eq!(v.as_ptr(), dst_addr, "no copy");
    assert_eq!(&v[16..33], b"zero-copy receive");
    assert!(v[..16].iter().chain(&v[33..]).all(|&b| b == 0));
}

#[test]
fn granted_region_takes_writes_until_revoked() {
    let Some(p) = pair() else { return };
    let pool = MrPool::new(&p.pd);
    let target = pool.alloc_zeroed(128).expect("alloc");
    let region =
        RemoteAccessRegion::grant(&p.pd, target, AccessFlags::REMOTE_WRITE).expect("grant");
    let src = pool.alloc_from(b"peer data").expect("alloc");
    write(&p.a.qp, 1, &src, region.addr() + 4, region.rkey());
    assert_eq!(wait(&p.a.cq).status, WcStatus::Success);
    let mut seen = [0u8; 9];
    region.read_into(4, &mut seen).expect("read_into");
    assert_eq!(&seen, b"peer data");
    let (addr, rkey) = (region.addr(), region.rkey());
    let back = region.revoke();
    assert_eq!(&back[4..13], b"peer data");
    // The revoked rkey fails at once, and the memory is untouched.
    let src2 = pool.alloc_from(b"too late!").expect("alloc");
    write(&p.a.qp, 2, &src2, addr + 4, rkey);
    let c = wait(&p.a.cq);
    assert_eq!((c.wr_id, c.status), (2, WcStatus::RemAccessErr));
    assert_eq!(&back[4..13], b"peer data");
}

#[test]
fn region_flags_are_minimal() {
    let Some(p) = pair() else { return };
    let pool = MrPool::new(&p.pd);
    let region = RemoteAccessRegion::grant(
        &p.pd,
        pool.alloc_zeroed(64).expect("alloc"),
        AccessFlags::REMOTE_READ,
    )
    .expect("grant");
    let src = pool.alloc_from(b"x").expect("alloc");
    write(&p.a.qp, 1, &src, region.addr(), region.rkey());
    assert_eq!(wait(&p.a.cq).status, WcStatus::RemAccessErr);
    let mut b = [1u8; 1];
    region.read_into(0, &mut b).expect("read");
    assert_eq!(b, [0], "a read-only grant was not written");
}

#[test]
fn region_bounds_are_exact() {
    let Some(p) = pair() else { return };
    let pool = MrPool::new(&p.pd);
    let block = pool.alloc_zeroed(128).expect("alloc");
    let region = RemoteAccessRegion::grant(
        &p.pd,
        block.slice(0..64).expect("slice"),
        AccessFlags::REMOTE_WRITE,
    )
    .expect("grant");
    // 8 bytes at offset 60: 4 of them past the grant (but inside the block).
    let src = pool.alloc_from(&[0xee; 8]).expect("alloc");
    write(&p.a.qp, 1, &src, region.addr() + 60, region.rkey());
    assert_eq!(wait(&p.a.cq).status, WcStatus::RemAccessErr);
    let block = region.revoke().into_inner();
    assert!(
        block.iter().all(|&b| b == 0),
        "nothing written, not even in range"
    );
}
