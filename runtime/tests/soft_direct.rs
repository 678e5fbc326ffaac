//! Soft device, QPs on two devices (a TCP connection between their engines):
//! small SENDs and WRITEs posted while the engine has nothing to send are
//! transmitted by the posting thread itself. These tests mix them with WRs
//! the engine sends (READ, atomics, large messages) and with the engine's
//! RNR retries and ACK timeouts, and check order, data and statuses.

mod common;

use std::time::{Duration, Instant};

use common::*;
use verbio_runtime::provider::*;

const SIG: SendFlags = SendFlags::SIGNALED;

fn two_devices(opts: &PairOpts) -> (Side, Side) {
    connect_pair(&open_test_context(), &open_test_context(), opts)
}

/// One SEND through the engine (which then lets posts transmit directly).
fn warm_up(a: &Side, b: &Side) {
    let s = a.buf(8, LW);
    let r = b.buf(8, LW);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf);
    // both stay alive until the completions below.
    unsafe { b.qp.post_recv(&[rwr(900, &[r.sge(0, 8)])]) }.unwrap();
    // SAFETY: as above.
    unsafe {
        a.qp.post_send(&[wr(900, SendOp::Send, &[s.sge(0, 8)], SIG)])
    }
    .unwrap();
    assert_eq!(poll_one(&a.scq).status, WcStatus::Success);
    assert_eq!(poll_one(&b.rcq).status, WcStatus::Success);
}

#[test]
fn direct_posts_interleave_in_order_with_engine_sent_wrs() {
    let (a, b) = two_devices(&PairOpts::default());
    warm_up(&a, &b);
    const ROUNDS: usize = 40;
    const SMALL: usize = 100;
    const LARGE: usize = 40 * 1024;
    let src = a.buf(LARGE, LW);
    let data = src.fill_pattern(3);
    let local = a.buf(ROUNDS * 8 + SMALL * ROUNDS, LW);
    let remote = b.buf(LARGE + SMALL * ROUNDS + 8, AccessFlags::ALL);
    let rbuf = b.buf(SMALL * ROUNDS, LW);
    let counter = LARGE + SMALL * ROUNDS;
    let recvs: Vec<RecvWr> = (0..ROUNDS)
        .map(|i| rwr(i as u64, &[rbuf.sge(i * SMALL, SMALL)]))
        .collect();
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe { b.qp.post_recv(&recvs) }.unwrap();
    let mut expect = Vec::new();
    for i in 0..ROUNDS {
        let base = (i * 10) as u64;
        let remote_at = |off: usize| SendOp::Write {
            remote_addr: remote.addr() + off as u64,
            rkey: remote.rkey(),
        };
        let wrs = [
            // Small SEND (direct when the engine is idle).
            wr(base, SendOp::Send, &[src.sge(i, SMALL)], SIG),
            // READ of what the previous round's small WRITE wrote.
            wr(
                base + 1,
                SendOp::Read {
                    remote_addr: remote.addr() + (LARGE + SMALL * i.saturating_sub(1)) as u64,
                    rkey: remote.rkey(),
                },
                &[local.sge(ROUNDS * 8 + SMALL * i, SMALL)],
                SIG,
            ),
            // Small WRITE (direct or queued behind the READ).
            wr(
                base + 2,
                remote_at(LARGE + SMALL * i),
                &[src.sge(i + 1, SMALL)],
                SIG,
            ),
            // Atomic.
            wr(
                base + 3,
                SendOp::FetchAndAdd {
                    remote_addr: remote.addr() + counter as u64,
                    rkey: remote.rkey(),
                    add: 1,
                },
                &[local.sge(i * 8, 8)],
                SIG,
            ),
            // Large WRITE (the engine's zero-copy path).
            wr(base + 4, remote_at(0), &[src.sge(0, LARGE)], SIG),
        ];
        for w in &wrs {
            // One WR per call: each may go direct.
            // SAFETY: SGEs of RegBufs (see RegBuf), alive until the end.
            unsafe { a.qp.post_send(std::slice::from_ref(w)) }.unwrap();
            expect.push(w.wr_id);
        }
        // Every other round starts with an idle engine (so that the SEND
        // is transmitted directly, the READ queued, and the WRITE must
        // queue behind the READ); the others pile up behind the engine.
        if i % 2 == 1 {
            let c = poll_n(&a.scq, expect.len());
            assert!(c.iter().all(|c| c.status == WcStatus::Success), "{c:?}");
            let got: Vec<u64> = c.iter().map(|c| c.wr_id).collect();
            assert_eq!(got, expect, "completions in posting order");
            expect.clear();
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    let c = poll_n(&a.scq, expect.len());
    assert!(c.iter().all(|c| c.status == WcStatus::Success), "{c:?}");
    assert_eq!(c.iter().map(|c| c.wr_id).collect::<Vec<_>>(), expect);
    let r = poll_n(&b.rcq, ROUNDS);
    assert!(r.iter().all(|c| c.status == WcStatus::Success));
    let got = rbuf.read();
    let mem = remote.read();
    let loc = local.read();
    for i in 0..ROUNDS {
        assert_eq!(r[i].wr_id, i as u64);
        assert_eq!(&got[i * SMALL..(i + 1) * SMALL], &data[i..i + SMALL]);
        let w = &mem[LARGE + SMALL * i..LARGE + SMALL * (i + 1)];
        assert_eq!(w, &data[i + 1..i + 1 + SMALL], "small WRITE {i}");
        if i > 0 {
            // The READ saw the previous round's WRITE (RC order).
            let rd = &loc[ROUNDS * 8 + SMALL * i..ROUNDS * 8 + SMALL * (i + 1)];
            assert_eq!(rd, &data[i..i + SMALL], "READ {i}");
        }
        let fetched = u64::from_ne_bytes(loc[i * 8..i * 8 + 8].try_into().unwrap());
        assert_eq!(fetched, i as u64, "fetch-and-add {i}");
    }
    assert_eq!(&mem[..LARGE], &data[..]);
    assert_eq!(remote.u64_at(counter), ROUNDS as u64);
}

#[test]
fn direct_posts_are_retried_after_rnr() {
    let opts = PairOpts {
        rts: RtsAttr {
            rnr_retry: 7,
            ..RtsAttr::default()
        },
        min_rnr_timer: 12,
        ..PairOpts::default()
    };
    let (a, b) = two_devices(&opts);
    warm_up(&a, &b);
    let src = a.buf(64, LW);
    let data = src.fill_pattern(9);
    // No RECV posted: these are NAKed (RNR) and retransmitted by the engine.
    for i in 0..3u64 {
        // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
        unsafe {
            a.qp.post_send(&[wr(i, SendOp::Send, &[src.sge(i as usize * 8, 8)], SIG)])
        }
        .unwrap();
    }
    std::thread::sleep(Duration::from_millis(30));
    expect_none(&a.scq, Duration::from_millis(1));
    let rbuf = b.buf(24, LW);
    let recvs: Vec<RecvWr> = (0..3)
        .map(|i| rwr(10 + i as u64, &[rbuf.sge(i * 8, 8)]))
        .collect();
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe { b.qp.post_recv(&recvs) }.unwrap();
    let c = poll_n(&a.scq, 3);
    assert_eq!(
        c.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
        (0..3).map(|i| (i, WcStatus::Success)).collect::<Vec<_>>()
    );
    let r = poll_n(&b.rcq, 3);
    assert_eq!(r.iter().map(|c| c.wr_id).collect::<Vec<_>>(), [10, 11, 12]);
    assert_eq!(rbuf.read(), data[..24].to_vec());
    // And the QP keeps working (direct again).
    let r2 = b.buf(8, LW);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe { b.qp.post_recv(&[rwr(20, &[r2.sge(0, 8)])]) }.unwrap();
    // SAFETY: as above.
    unsafe {
        a.qp.post_send(&[wr(20, SendOp::Send, &[src.sge(0, 8)], SIG)])
    }
    .unwrap();
    assert_eq!(poll_one(&a.scq).status, WcStatus::Success);
    assert_eq!(poll_one(&b.rcq).wr_id, 20);
}

#[test]
fn direct_post_to_a_silent_peer_times_out() {
    // The remote QP is destroyed after the warm-up: its engine drops our
    // packets, the connection stays up, and only the ACK timer can notice,
    // although the engine was not rung for the directly transmitted WR.
    let opts = PairOpts {
        rts: RtsAttr {
            timeout: 12, // 16.8 ms
            retry_cnt: 3,
            ..RtsAttr::default()
        },
        ..PairOpts::default()
    };
    let (a, b) = two_devices(&opts);
    warm_up(&a, &b);
    let ctx_b = b.ctx.clone();
    drop(b);
    // Let the engine settle into its sleep.
    std::thread::sleep(Duration::from_millis(50));
    let src = a.buf(64, LW);
    let start = Instant::now();
    for i in 0..2 {
        // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
        unsafe {
            a.qp.post_send(&[wr(i, SendOp::Send, &[src.sge(0, 8)], SIG)])
        }
        .unwrap();
    }
    let c = poll_n(&a.scq, 2);
    let elapsed = start.elapsed();
    assert_eq!((c[0].wr_id, c[0].status), (0, WcStatus::RetryExcErr));
    assert_eq!((c[1].wr_id, c[1].status), (1, WcStatus::WrFlushErr));
    // 4 periods of ~16.8 ms.
    assert!(
        elapsed >= Duration::from_millis(60),
        "too early: {elapsed:?}"
    );
    assert!(elapsed < Duration::from_secs(5), "too late: {elapsed:?}");
    drop(ctx_b);
}

#[test]
fn bursts_of_small_writes_survive_a_full_socket() {
    // Many 16 KiB - 1 WRITEs as fast as the send queue allows: posting
    // threads fill the socket, leave the rest to the engine, and the byte
    // stream stays intact (a framing error would fail the connection).
    let opts = PairOpts {
        caps: QpCaps {
            max_send_wr: 512,
            ..QpCaps::default()
        },
        cqe: 4096,
        ..PairOpts::default()
    };
    let (a, b) = two_devices(&opts);
    warm_up(&a, &b);
    const SLOT: usize = 16 * 1024 - 1;
    const SLOTS: usize = 32;
    const WRITES: usize = 3000;
    let src = a.buf(SLOT * SLOTS, LW);
    let data = src.fill_pattern(77);
    let dst = b.buf(SLOT * SLOTS, AccessFlags::ALL);
    let mut posted = 0usize;
    let mut done = 0usize;
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut wc = [Completion::EMPTY; 64];
    while done < WRITES {
        while posted < WRITES && posted - done < 512 {
            let s = posted % SLOTS;
            let w = wr(
                posted as u64,
                SendOp::Write {
                    remote_addr: dst.addr() + (s * SLOT) as u64,
                    rkey: dst.rkey(),
                },
                &[src.sge(s * SLOT, SLOT)],
                SIG,
            );
            // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
            unsafe { a.qp.post_send(&[w]) }.unwrap();
            posted += 1;
        }
        let n = a.scq.poll(&mut wc).unwrap();
        for c in &wc[..n] {
            assert_eq!((c.wr_id, c.status), (done as u64, WcStatus::Success));
            done += 1;
        }
        assert!(Instant::now() < deadline, "{done} of {WRITES} completed");
        if n == 0 {
            std::thread::yield_now();
        }
    }
    assert_eq!(dst.read(), data);
}
