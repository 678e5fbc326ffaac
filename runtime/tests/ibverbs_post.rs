//! ibverbs provider: the posting and polling paths themselves. Lists longer
//! than the provider's stack list (16 WRs) go to the device whole, with a
//! refused WR in the middle of a long list ending it at the right index;
//! INLINE payloads gathered from several unregistered SGEs; unsignaled WRs
//! that complete through a later signaled one (no completion of their
//! own); polls into buffers longer than one `ibv_poll_cq` batch. Runs in the
//! rxe VM (`scripts/rxe-test.sh`); prints SKIPPED without a device.
#![cfg(feature = "ibverbs")]

mod ibverbs_support;

use std::time::{Duration, Instant};

use ibverbs_support::{device, pair, wait, Buf, WAIT};
use verbio_runtime::provider::{
    AccessFlags, Completion, ProviderError, RecvWr, SendFlags, SendOp, SendWr, SgList, Sge,
    WcOpcode, WcStatus,
};

/// A WRITE of `len` bytes at `off` of `local` to the same offset of `remote`.
fn write(id: u64, local: &Buf, remote: &Buf, off: usize, len: u32, flags: SendFlags) -> SendWr {
    SendWr {
        wr_id: id,
        sg_list: local.sge(off, len),
        op: SendOp::Write {
            remote_addr: remote.addr() + off as u64,
            rkey: remote.mr.rkey(),
        },
        flags,
    }
}

/// Polls `cq` with a buffer of `buf_len` until `n` completions arrived (or
/// [`WAIT`] passed); also returns the most one poll returned.
fn wait_with(
    cq: &verbio_runtime::provider::Cq,
    n: usize,
    buf_len: usize,
) -> (Vec<Completion>, usize) {
    let deadline = Instant::now() + WAIT;
    let mut buf = vec![Completion::EMPTY; buf_len];
    let mut got = Vec::new();
    let mut most = 0;
    while got.len() < n {
        let k = cq.poll(&mut buf).expect("poll");
        most = most.max(k);
        got.extend_from_slice(&buf[..k]);
        if k == 0 {
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {n} completions, got {}",
                got.len()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    (got, most)
}

/// No completion shows up on `cq` for a while (the VM is slow: 200 ms).
fn assert_quiet(cq: &verbio_runtime::provider::Cq) {
    std::thread::sleep(Duration::from_millis(200));
    let mut buf = [Completion::EMPTY; 4];
    let k = cq.poll(&mut buf).expect("poll");
    assert_eq!(k, 0, "unexpected completions {:?}", &buf[..k]);
}

#[test]
fn long_lists_are_posted_whole_and_polled_in_large_batches() {
    let Some(ctx) = device("long_lists_are_posted_whole_and_polled_in_large_batches") else {
        return;
    };
    let p = pair(ctx);
    const N: usize = 60; // > 16 (the stack list) and > 32 (one poll batch)
    let mut src = Buf::new(&p.pd, N * 64, AccessFlags::LOCAL_WRITE);
    let dst = Buf::new(&p.pd, N * 64, AccessFlags::LOCAL_WRITE);
    src.fill(|i| (i * 13 + 5) as u8);

    // 60 RECVs in one call, each into its own 64-byte slot.
    let recvs: Vec<RecvWr> = (0..N)
        .map(|i| RecvWr {
            wr_id: 100 + i as u64,
            sg_list: dst.sge(i * 64, 64),
        })
        .collect();
    // SAFETY: SGEs of Bufs, which uphold the post contract (see Buf).
    unsafe { p.b.post_recv(&recvs) }.expect("60 RECVs in one call");

    // 60 signaled SENDs in one call, message i of i + 1 bytes from slot i.
    let sends: Vec<SendWr> = (0..N)
        .map(|i| SendWr {
            wr_id: 1000 + i as u64,
            sg_list: src.sge(i * 64, i as u32 + 1),
            op: SendOp::Send,
            flags: SendFlags::SIGNALED,
        })
        .collect();
    // SAFETY: SGEs of Bufs, which uphold the post contract (see Buf).
    unsafe { p.a.post_send(&sends) }.expect("60 SENDs in one call");

    // Let the completions pile up, then poll with a buffer of 64 (more than
    // one ibv_poll_cq batch): all of them, in posting order.
    let (sc, most) = wait_with(&p.cq_a, N, 64);
    let (rc, most_r) = wait_with(&p.cq_b, N, 64);
    println!("largest single poll: {most} send / {most_r} receive completions");
    for (i, c) in sc.iter().enumerate() {
        assert_eq!(
            (c.wr_id, c.status, c.opcode),
            (1000 + i as u64, WcStatus::Success, WcOpcode::Send),
            "send completion {i}"
        );
    }
    for (i, c) in rc.iter().enumerate() {
        assert_eq!(
            (c.wr_id, c.status, c.opcode, c.byte_len),
            (
                100 + i as u64,
                WcStatus::Success,
                WcOpcode::Recv,
                i as u32 + 1
            ),
            "receive completion {i}"
        );
        let at = i * 64;
        assert_eq!(
            &dst.bytes()[at..at + i + 1],
            &src.bytes()[at..at + i + 1],
            "message {i}"
        );
    }
    assert_quiet(&p.cq_a);
    assert_quiet(&p.cq_b);
}

#[test]
fn a_refused_wr_ends_a_long_list_at_its_index() {
    let Some(ctx) = device("a_refused_wr_ends_a_long_list_at_its_index") else {
        return;
    };
    let p = pair(ctx);
    let local = Buf::new(&p.pd, 4096, AccessFlags::LOCAL_WRITE);
    let remote = Buf::new(
        &p.pd,
        4096,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
    );
    let max_sge = p.a.caps().max_send_sge as usize;
    let too_many: SgList = (0..max_sge + 1).flat_map(|i| local.sge(i * 8, 8)).collect();
    // 40 WRITEs, the 30th with one SGE too many: 29 go out, the error names
    // the limit, the rest are not posted.
    let mut wrs: Vec<SendWr> = (0..40)
        .map(|i| write(i, &local, &remote, i as usize * 8, 8, SendFlags::SIGNALED))
        .collect();
    wrs[29].sg_list = too_many;
    // SAFETY: SGEs of Bufs, which uphold the post contract (see Buf).
    let err = unsafe { p.a.post_send(&wrs) }.expect_err("too many SGEs");
    assert_eq!(err.posted, 29, "{err:?}");
    assert!(
        matches!(
            err.error,
            ProviderError::InvalidArgument {
                call: "post_send",
                ..
            }
        ),
        "{err:?}"
    );
    let c = wait(&p.cq_a, 29);
    assert!(
        c.iter()
            .enumerate()
            .all(|(i, c)| c.wr_id == i as u64 && c.status == WcStatus::Success),
        "{c:?}"
    );
    assert_quiet(&p.cq_a);

    // Same for receives: 20 in the list, the 18th with too many SGEs.
    let max_rsge = p.b.caps().max_recv_sge as usize;
    let mut recvs: Vec<RecvWr> = (0..20)
        .map(|i| RecvWr {
            wr_id: i,
            sg_list: local.sge(0, 8),
        })
        .collect();
    recvs[17].sg_list = (0..max_rsge + 1)
        .flat_map(|i| local.sge(i * 8, 8))
        .collect();
    // SAFETY: SGEs of Bufs, which uphold the post contract (see Buf).
    let err = unsafe { p.b.post_recv(&recvs) }.expect_err("too many SGEs");
    assert_eq!(err.posted, 17, "{err:?}");
    assert!(
        matches!(
            err.error,
            ProviderError::InvalidArgument {
                call: "post_recv",
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn inline_payloads_gather_unregistered_sges() {
    let Some(ctx) = device("inline_payloads_gather_unregistered_sges") else {
        return;
    };
    let p = pair(ctx);
    let max_inline = p.a.caps().max_inline_data as usize;
    if max_inline < 16 {
        println!("SKIPPED: inline_payloads_gather_unregistered_sges: max_inline_data {max_inline}");
        return;
    }
    let dst = Buf::new(&p.pd, 256, AccessFlags::LOCAL_WRITE);
    let remote = Buf::new(
        &p.pd,
        256,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
    );
    // SAFETY: SGEs of Bufs, which uphold the post contract (see Buf).
    unsafe {
        p.b.post_recv(&[RecvWr {
            wr_id: 7,
            sg_list: dst.sge(0, 256),
        }])
    }
    .expect("post_recv");
    // Two stack arrays, no registration, lkey 0: INLINE gathers them at post
    // time. Then the arrays change before the completion is polled.
    let mut head = *b"inline-";
    let mut tail = *b"gather";
    let sgl = |h: &[u8], t: &[u8]| -> SgList {
        [h, t]
            .iter()
            .map(|s| Sge {
                addr: s.as_ptr() as u64,
                length: s.len() as u32,
                lkey: 0,
            })
            .collect()
    };
    let wrs = [
        SendWr {
            wr_id: 1,
            sg_list: sgl(&head, &tail),
            op: SendOp::Send,
            flags: SendFlags::SIGNALED | SendFlags::INLINE,
        },
        SendWr {
            wr_id: 2,
            sg_list: sgl(&tail, &head),
            op: SendOp::Write {
                remote_addr: remote.addr() + 8,
                rkey: remote.mr.rkey(),
            },
            flags: SendFlags::SIGNALED | SendFlags::INLINE,
        },
    ];
    // SAFETY: INLINE: `head` and `tail` (live locals nobody writes during
    // the call) are copied during the call; their lkeys are not used.
    unsafe { p.a.post_send(&wrs) }.expect("inline SEND and WRITE");
    head.fill(b'x');
    tail.fill(b'y');
    let sc = wait(&p.cq_a, 2);
    assert!(sc.iter().all(|c| c.status == WcStatus::Success), "{sc:?}");
    let rc = wait(&p.cq_b, 1);
    assert_eq!((rc[0].wr_id, rc[0].byte_len), (7, 13));
    assert_eq!(&dst.bytes()[..13], b"inline-gather");
    assert_eq!(&remote.bytes()[8..21], b"gatherinline-");
    assert!(remote.bytes()[..8].iter().all(|&b| b == 0));
}

#[test]
fn unsignaled_wrs_complete_through_a_later_signaled_one() {
    let Some(ctx) = device("unsignaled_wrs_complete_through_a_later_signaled_one") else {
        return;
    };
    let p = pair(ctx);
    let mut local = Buf::new(&p.pd, 4096, AccessFlags::LOCAL_WRITE);
    let remote = Buf::new(
        &p.pd,
        4096,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
    );
    local.fill(|i| (i % 241) as u8 + 1);
    let rounds = (p.a.caps().max_send_wr as usize * 3).div_ceil(8) * 8;
    // Far more WRs than the send queue holds, one post each, only every 8th
    // signaled: polling a signaled completion retires the unsignaled WRs
    // before it, so the queue never fills. Only the signaled WRs complete.
    let mut signaled = Vec::new();
    let mut polled = Vec::new();
    for i in 0..rounds {
        let off = (i % 64) * 64;
        let flags = if i % 8 == 7 {
            signaled.push(i as u64);
            SendFlags::SIGNALED
        } else {
            SendFlags::NONE
        };
        // SAFETY: SGEs of Bufs, which uphold the post contract (see Buf).
        unsafe {
            p.a.post_send(&[write(i as u64, &local, &remote, off, 64, flags)])
        }
        .unwrap_or_else(|e| panic!("WR {i}: {e:?}"));
        if i % 32 == 31 {
            // Retire what is outstanding before the queue could fill.
            let want = signaled.len() - polled.len();
            polled.extend(wait(&p.cq_a, want).into_iter().map(|c| {
                assert_eq!(c.status, WcStatus::Success, "{c:?}");
                c.wr_id
            }));
        }
    }
    let want = signaled.len() - polled.len();
    polled.extend(wait(&p.cq_a, want).into_iter().map(|c| c.wr_id));
    assert_eq!(polled, signaled);
    assert_quiet(&p.cq_a);
    // RC executes in order: the last signaled completion covers every write.
    assert_eq!(remote.bytes(), local.bytes());
}
