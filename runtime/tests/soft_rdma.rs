//! Soft device: RDMA WRITE / WRITE_WITH_IMM / READ and atomics move the right bytes.

mod common;

use common::*;
use verbio_runtime::provider::*;

const SIG: SendFlags = SendFlags::SIGNALED;

fn all() -> AccessFlags {
    AccessFlags::ALL
}

#[test]
fn write_and_write_with_imm() {
    let (a, b) = pair();
    let src = a.buf(4096, LW);
    let data = src.fill_pattern(1);
    let dst = b.buf(8192, all());
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        a.qp.post_send(&[wr(
            1,
            SendOp::Write {
                remote_addr: dst.addr() + 100,
                rkey: dst.rkey(),
            },
            &[src.sge(0, 4096)],
            SIG,
        )])
    }
    .unwrap();
    let c = poll_one(&a.scq);
    assert_eq!(
        (c.wr_id, c.status, c.opcode, c.byte_len),
        (1, WcStatus::Success, WcOpcode::RdmaWrite, 4096)
    );
    let got = dst.read();
    assert_eq!(&got[100..4196], &data[..]);
    assert!(got[..100].iter().all(|&x| x == 0) && got[4196..].iter().all(|&x| x == 0));
    // WRITE_WITH_IMM consumes a RECV (its SGEs are not written).
    let rbuf = b.buf(16, LW);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe { b.qp.post_recv(&[rwr(77, &[rbuf.sge(0, 16)])]) }.unwrap();
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        a.qp.post_send(&[wr(
            2,
            SendOp::WriteWithImm {
                remote_addr: dst.addr() + 5000,
                rkey: dst.rkey(),
                imm: 0x1234_5678,
            },
            &[src.sge(0, 1000)],
            SIG,
        )])
    }
    .unwrap();
    let r = poll_one(&b.rcq);
    assert_eq!(r.wr_id, 77);
    assert_eq!(r.status, WcStatus::Success);
    assert_eq!(r.opcode, WcOpcode::RecvRdmaWithImm);
    assert_eq!(r.imm_data, Some(0x1234_5678));
    assert_eq!(r.byte_len, 1000);
    assert_eq!(&dst.read()[5000..6000], &data[..1000]);
    assert!(rbuf.read().iter().all(|&x| x == 0));
    let c = poll_one(&a.scq);
    assert_eq!((c.wr_id, c.opcode), (2, WcOpcode::RdmaWrite));
}

#[test]
fn read_scatters_into_local_sges() {
    let (a, b) = pair();
    let remote = b.buf(1000, all());
    let data = remote.fill_pattern(42);
    let local = a.buf(1000, LW);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        a.qp.post_send(&[wr(
            5,
            SendOp::Read {
                remote_addr: remote.addr() + 10,
                rkey: remote.rkey(),
            },
            &[local.sge(0, 100), local.sge(500, 200)],
            SIG,
        )])
    }
    .unwrap();
    let c = poll_one(&a.scq);
    assert_eq!(
        (c.wr_id, c.status, c.opcode, c.byte_len),
        (5, WcStatus::Success, WcOpcode::RdmaRead, 300)
    );
    let got = local.read();
    assert_eq!(&got[..100], &data[10..110]);
    assert_eq!(&got[500..700], &data[110..310]);
    assert!(got[100..500].iter().all(|&x| x == 0));
}

#[test]
fn large_write_and_read_across_devices() {
    let (a, b) = pair();
    const LEN: usize = 3 * 1024 * 1024 + 123;
    let src = a.buf(LEN, LW);
    let data = src.fill_pattern(5);
    let dst = b.buf(LEN, all());
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        a.qp.post_send(&[wr(
            1,
            SendOp::Write {
                remote_addr: dst.addr(),
                rkey: dst.rkey(),
            },
            &[src.sge(0, LEN)],
            SIG,
        )])
    }
    .unwrap();
    assert_eq!(poll_one(&a.scq).status, WcStatus::Success);
    assert!(dst.read() == data);
    let back = a.buf(LEN, LW);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        a.qp.post_send(&[wr(
            2,
            SendOp::Read {
                remote_addr: dst.addr(),
                rkey: dst.rkey(),
            },
            &[back.sge(0, LEN)],
            SIG,
        )])
    }
    .unwrap();
    let c = poll_one(&a.scq);
    assert_eq!((c.status, c.byte_len as usize), (WcStatus::Success, LEN));
    assert!(back.read() == data);
}

/// Large WRITE payloads raise the receiving socket's `SO_RCVLOWAT` while
/// much of them is still to come (the engine then wakes for large reads);
/// every size around its thresholds (128 KiB and 256 KiB) must still arrive
/// whole, back to back and alone: a watermark above what is still to come
/// would strand the tail of a payload until the WR times out.
#[test]
fn writes_of_every_size_around_the_receive_watermark_arrive_whole() {
    let (a, b) = pair();
    const K: usize = 1024;
    let sizes = [
        128 * K - 1,
        128 * K,
        128 * K + 1,
        256 * K - 1,
        256 * K,
        256 * K + 1,
        300_001,
        1024 * K + 7,
        64 * K,
    ];
    let total: usize = sizes.iter().sum();
    let src = a.buf(total, LW);
    let data = src.fill_pattern(9);
    let dst = b.buf(total, all());
    // All in flight at once, then each alone (the last payload's tail has
    // nothing after it to wake the receiver).
    for together in [true, false] {
        let mut off = 0;
        for (i, &len) in sizes.iter().enumerate() {
            // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
            unsafe {
                a.qp.post_send(&[wr(
                    i as u64,
                    SendOp::Write {
                        remote_addr: dst.addr() + off as u64,
                        rkey: dst.rkey(),
                    },
                    &[src.sge(off, len)],
                    SIG,
                )])
            }
            .unwrap();
            off += len;
            if !together {
                let c = poll_one(&a.scq);
                assert_eq!((c.wr_id, c.status), (i as u64, WcStatus::Success));
            }
        }
        if together {
            for (i, c) in poll_n(&a.scq, sizes.len()).iter().enumerate() {
                assert_eq!((c.wr_id, c.status), (i as u64, WcStatus::Success));
            }
        }
        assert!(dst.read() == data, "together: {together}");
    }
}

#[test]
fn compare_and_swap_and_fetch_and_add() {
    let (a, b) = pair();
    let target = b.buf(16, all());
    target.write(8, &100u64.to_ne_bytes());
    let res = a.buf(16, LW);
    let op = |id, op| wr(id, op, &[res.sge(0, 8)], SIG);
    // CAS that matches: 0 -> 7, returns 0.
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        a.qp.post_send(&[op(
            1,
            SendOp::CompareAndSwap {
                remote_addr: target.addr(),
                rkey: target.rkey(),
                compare: 0,
                swap: 7,
            },
        )])
    }
    .unwrap();
    let c = poll_one(&a.scq);
    assert_eq!(
        (c.status, c.opcode, c.byte_len),
        (WcStatus::Success, WcOpcode::CompSwap, 8)
    );
    assert_eq!(res.u64_at(0), 0);
    assert_eq!(target.u64_at(0), 7);
    // CAS that does not match: unchanged, returns 7.
    res.write(0, &[0xff; 8]);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        a.qp.post_send(&[op(
            2,
            SendOp::CompareAndSwap {
                remote_addr: target.addr(),
                rkey: target.rkey(),
                compare: 1,
                swap: 9,
            },
        )])
    }
    .unwrap();
    assert_eq!(poll_one(&a.scq).status, WcStatus::Success);
    assert_eq!(res.u64_at(0), 7);
    assert_eq!(target.u64_at(0), 7);
    // FAA returns the old value.
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        a.qp.post_send(&[op(
            3,
            SendOp::FetchAndAdd {
                remote_addr: target.addr() + 8,
                rkey: target.rkey(),
                add: 5,
            },
        )])
    }
    .unwrap();
    let c = poll_one(&a.scq);
    assert_eq!(
        (c.status, c.opcode),
        (WcStatus::Success, WcOpcode::FetchAdd)
    );
    assert_eq!(res.u64_at(0), 100);
    assert_eq!(target.u64_at(8), 105);
}

#[test]
fn concurrent_fetch_and_add_from_two_qps_sums_exactly() {
    let target_ctx = open_test_context();
    let opts = PairOpts::default();
    let (ca, cb) = (open_test_context(), open_test_context());
    let (a1, t1) = connect_pair(&ca, &target_ctx, &opts);
    let (a2, t2) = connect_pair(&cb, &target_ctx, &opts);
    // Each responder QP has its own PD: register the same counter in both.
    let counter = t1.buf(8, all());
    // SAFETY: `counter` outlives `mr2` (dropped at the end of the test first).
    let mr2 = unsafe { t2.pd.reg_mr(counter.addr() as *mut u8, 8, all()) }.unwrap();
    const N: u64 = 500;
    let run = |side: Side, rkey: u32, add: u64| {
        let addr = counter.addr();
        let res = side.buf(8, LW);
        let mut done = 0u64;
        let mut posted = 0u64;
        let mut wc = [Completion::EMPTY; 16];
        let deadline = std::time::Instant::now() + WAIT;
        while done < N {
            assert!(std::time::Instant::now() < deadline, "stuck at {done}");
            while posted < N && posted - done < 16 {
                // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
                unsafe {
                    side.qp.post_send(&[wr(
                        posted,
                        SendOp::FetchAndAdd {
                            remote_addr: addr,
                            rkey,
                            add,
                        },
                        &[res.sge(0, 8)],
                        SIG,
                    )])
                }
                .unwrap();
                posted += 1;
            }
            let n = side.scq.poll(&mut wc).unwrap();
            for c in &wc[..n] {
                assert_eq!(c.status, WcStatus::Success);
            }
            done += n as u64;
            if n == 0 {
                std::thread::yield_now();
            }
        }
        side
    };
    let (rk1, rk2) = (counter.rkey(), mr2.rkey());
    std::thread::scope(|s| {
        let h1 = s.spawn(|| run(a1, rk1, 1));
        let h2 = s.spawn(|| run(a2, rk2, 1000));
        h1.join().unwrap();
        h2.join().unwrap();
    });
    assert_eq!(counter.u64_at(0), N + N * 1000);
    drop(mr2);
    drop((t1, t2));
}

#[test]
fn large_send_scatters_across_recv_sges() {
    let (a, b) = pair();
    const LEN: usize = 2 * 1024 * 1024 + 4321;
    let src = a.buf(LEN, LW);
    let data = src.fill_pattern(11);
    let dst = b.buf(LEN + 100, LW);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        b.qp.post_recv(&[rwr(1, &[dst.sge(0, 1000), dst.sge(1000, LEN + 100 - 1000)])])
    }
    .unwrap();
    // Two gather pieces, the first one small (copied), the second big (zero-copy).
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        a.qp.post_send(&[wr(
            1,
            SendOp::SendWithImm { imm: 5 },
            &[src.sge(0, 777), src.sge(777, LEN - 777)],
            SIG,
        )])
    }
    .unwrap();
    let r = poll_one(&b.rcq);
    assert_eq!(
        (r.status, r.byte_len as usize, r.imm_data),
        (WcStatus::Success, LEN, Some(5))
    );
    assert_eq!(poll_one(&a.scq).status, WcStatus::Success);
    assert!(dst.read()[..LEN] == data[..]);
}

#[test]
fn many_qps_share_one_connection() {
    let (ca, cb) = (open_test_context(), open_test_context());
    let opts = PairOpts::default();
    let pairs: Vec<(Side, Side)> = (0..8).map(|_| connect_pair(&ca, &cb, &opts)).collect();
    const LEN: usize = 200_000;
    let mut checks = Vec::new();
    for (i, (a, b)) in pairs.iter().enumerate() {
        let src = a.buf(LEN, LW);
        let data = src.fill_pattern(i as u8);
        let dst = b.buf(LEN, all());
        let rb = b.buf(64, LW);
        // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
        unsafe { b.qp.post_recv(&[rwr(i as u64, &[rb.sge(0, 64)])]) }.unwrap();
        // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
        unsafe {
            a.qp.post_send(&[
                wr(
                    1,
                    SendOp::Write {
                        remote_addr: dst.addr(),
                        rkey: dst.rkey(),
                    },
                    &[src.sge(0, LEN)],
                    SendFlags::NONE,
                ),
                wr(
                    2,
                    SendOp::SendWithImm { imm: i as u32 },
                    &[src.sge(0, 64)],
                    SIG,
                ),
            ])
        }
        .unwrap();
        checks.push((src, data, dst, rb));
    }
    for (i, (a, b)) in pairs.iter().enumerate() {
        let c = poll_one(&a.scq);
        assert_eq!((c.wr_id, c.status), (2, WcStatus::Success));
        let r = poll_one(&b.rcq);
        assert_eq!((r.wr_id, r.imm_data), (i as u64, Some(i as u32)));
        // The SEND completed after the WRITE: its data is there.
        let (_, data, dst, rb) = &checks[i];
        assert!(dst.read() == *data);
        assert_eq!(rb.read(), data[..64].to_vec());
    }
}
