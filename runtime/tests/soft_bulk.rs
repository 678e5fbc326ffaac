//! Soft device: large SENDs and READs. The receiving engine reads a large
//! SEND's payload from its socket straight into the receive WR's memory,
//! and a large READ response's into the READ's (no copy through its
//! receive buffer); these tests hold those paths to the bytes: every size
//! around the packet and direct-receive boundaries, scattered over several
//! SGEs, alone and many in flight, nothing written past the message, and
//! the errors a short or unwritable receive gives.

mod common;

use common::*;
use verbio_runtime::provider::*;

const SIG: SendFlags = SendFlags::SIGNALED;
const K: usize = 1024;
const M: usize = 1024 * K;

/// Sizes around the engine's boundaries: the direct receive starts at 16
/// KiB, a packet carries at most 1 MiB, the receive buffer holds 64 KiB.
const SIZES: [usize; 11] = [
    16 * K - 1,
    16 * K,
    16 * K + 1,
    64 * K - 56,
    64 * K + 3,
    256 * K + 1,
    M - 1,
    M,
    M + 1,
    2 * M + 4321,
    3 * M + 5,
];

/// Bytes after each message's receive region that must stay untouched.
const GUARD: usize = 64;
const UNTOUCHED: u8 = 0xee;

/// The receive WR of message `i` (of `len` bytes) at `off` in `dst`: three
/// SGEs cut at odd places, with room for `GUARD` more bytes.
fn scattered_recv(i: usize, dst: &RegBuf, off: usize, len: usize) -> RecvWr {
    let a = 7.min(len);
    let b = len / 2 + 3;
    rwr(
        i as u64,
        &[
            dst.sge(off, a),
            dst.sge(off + a, b - a),
            dst.sge(off + b, len + GUARD - b),
        ],
    )
}

/// The send WR of message `i`: two SGEs (a small one first).
fn gathered_send(i: usize, src: &RegBuf, off: usize, len: usize) -> SendWr {
    let cut = 777.min(len);
    wr(
        i as u64,
        SendOp::SendWithImm { imm: i as u32 },
        &[src.sge(off, cut), src.sge(off + cut, len - cut)],
        SIG,
    )
}

fn check_message(i: usize, got: &[u8], want: &[u8]) {
    let len = want.len();
    assert!(got[..len] == want[..], "message {i} ({len} bytes) differs");
    assert!(
        got[len..len + GUARD].iter().all(|&x| x == UNTOUCHED),
        "message {i} ({len} bytes) wrote past its end"
    );
}

/// Checks every message of [`SIZES`], sent back to back from `data`, in
/// `got`, where each one lands [`GUARD`] bytes after the one before.
fn check_messages(got: &[u8], data: &[u8]) {
    let (mut s, mut d) = (0, 0);
    for (i, &len) in SIZES.iter().enumerate() {
        check_message(i, &got[d..], &data[s..s + len]);
        s += len;
        d += len + GUARD;
    }
}

#[test]
fn sends_of_every_size_land_byte_exact_in_scattered_receives() {
    let (a, b) = pair();
    let total: usize = SIZES.iter().sum();
    let src = a.buf(total, LW);
    let data = src.fill_pattern(21);
    let dst = b.buf(total + SIZES.len() * GUARD, LW);
    // Each alone (the receiver's engine meets every payload's header with
    // nothing after it), then all in flight at once (payloads back to back).
    for together in [false, true] {
        dst.write(0, &vec![UNTOUCHED; dst.len()]);
        let mut at = (0, 0);
        for (i, &len) in SIZES.iter().enumerate() {
            let (s, d) = at;
            // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
            unsafe { b.qp.post_recv(&[scattered_recv(i, &dst, d, len)]) }.unwrap();
            // SAFETY: as above.
            unsafe { a.qp.post_send(&[gathered_send(i, &src, s, len)]) }.unwrap();
            if !together {
                let c = poll_one(&a.scq);
                assert_eq!((c.wr_id, c.status), (i as u64, WcStatus::Success));
                let r = poll_one(&b.rcq);
                assert_eq!(
                    (r.wr_id, r.status, r.byte_len as usize, r.imm_data),
                    (i as u64, WcStatus::Success, len, Some(i as u32))
                );
            }
            at = (s + len, d + len + GUARD);
        }
        if together {
            for (i, c) in poll_n(&a.scq, SIZES.len()).iter().enumerate() {
                assert_eq!((c.wr_id, c.status), (i as u64, WcStatus::Success));
            }
            for (i, r) in poll_n(&b.rcq, SIZES.len()).iter().enumerate() {
                assert_eq!(
                    (r.wr_id, r.status, r.byte_len as usize),
                    (i as u64, WcStatus::Success, SIZES[i])
                );
            }
        }
        check_messages(&dst.read(), &data);
    }
}

/// A large SEND that finds no receive WR waits (RNR) and lands whole once
/// one is posted; the receive taken for a payload that is received straight
/// into memory is the one its completion names.
#[test]
fn a_large_send_without_a_receive_waits_for_one_and_lands_whole() {
    let (a, b) = pair();
    const LEN: usize = 2 * M + 99;
    let src = a.buf(LEN, LW);
    let data = src.fill_pattern(4);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        a.qp.post_send(&[wr(1, SendOp::Send, &[src.sge(0, LEN)], SIG)])
    }
    .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(30));
    let dst = b.buf(LEN + GUARD, LW);
    dst.write(0, &vec![UNTOUCHED; dst.len()]);
    // SAFETY: as above.
    unsafe {
        b.qp.post_recv(&[scattered_recv(7, &dst, 0, LEN), rwr(8, &[dst.sge(0, 8)])])
    }
    .unwrap();
    let r = poll_one(&b.rcq);
    assert_eq!(
        (r.wr_id, r.status, r.byte_len as usize),
        (7, WcStatus::Success, LEN)
    );
    assert_eq!(poll_one(&a.scq).status, WcStatus::Success);
    check_message(0, &dst.read(), &data);
}

/// A large SEND longer than its receive fails as a small one does (the
/// receive LOC_LEN_ERR, the sender REM_OP_ERR), writing nothing.
#[test]
fn a_large_send_longer_than_its_receive_is_loc_len_err_and_writes_nothing() {
    let (a, b) = pair();
    let rb = b.buf(M, LW);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe {
        b.qp.post_recv(&[rwr(1, &[rb.sge(0, 64 * K)]), rwr(2, &[rb.sge(0, M)])])
    }
    .unwrap();
    let src = a.buf(M, LW);
    src.fill_pattern(3);
    // SAFETY: as above.
    unsafe {
        a.qp.post_send(&[wr(1, SendOp::Send, &[src.sge(0, 64 * K + 1)], SIG)])
    }
    .unwrap();
    let c = poll_one(&a.scq);
    assert_eq!((c.status, c.byte_len), (WcStatus::RemOpErr, 0));
    let r = poll_n(&b.rcq, 2);
    assert_eq!(
        (r[0].wr_id, r[0].status, r[0].byte_len),
        (1, WcStatus::LocLenErr, 0)
    );
    assert_eq!((r[1].wr_id, r[1].status), (2, WcStatus::WrFlushErr));
    wait_state(&b.qp, QpState::Err);
    assert!(rb.read().iter().all(|&x| x == 0));
}

/// A large SEND into a receive whose memory is not locally writable fails
/// the receive LOC_PROT_ERR, writing nothing.
#[test]
fn a_large_send_into_an_unwritable_receive_is_loc_prot_err_and_writes_nothing() {
    let (a, b) = pair();
    let rb = b.buf(M, AccessFlags::NONE);
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe { b.qp.post_recv(&[rwr(1, &[rb.sge(0, M)])]) }.unwrap();
    let src = a.buf(M, LW);
    src.fill_pattern(8);
    // SAFETY: as above.
    unsafe {
        a.qp.post_send(&[wr(1, SendOp::Send, &[src.sge(0, M)], SIG)])
    }
    .unwrap();
    let c = poll_one(&a.scq);
    assert_eq!(c.status, WcStatus::RemOpErr);
    let r = poll_one(&b.rcq);
    assert_eq!((r.wr_id, r.status), (1, WcStatus::LocProtErr));
    wait_state(&b.qp, QpState::Err);
    assert!(rb.read().iter().all(|&x| x == 0));
}

/// READs of every size (responses come in segments of up to 256 KiB, the
/// last 4 KiB copied), scattered over three SGEs, each alone, then all in
/// flight behind a SEND whose acknowledgement the first response carries:
/// byte-exact, nothing written past each.
#[test]
fn reads_of_every_size_land_byte_exact_in_scattered_sges() {
    let (a, b) = pair();
    let total: usize = SIZES.iter().sum();
    let remote = b.buf(total, LW | AccessFlags::REMOTE_READ);
    let data = remote.fill_pattern(33);
    let dst = a.buf(total + SIZES.len() * GUARD, LW);
    let small = a.buf(64, LW);
    let sink = b.buf(64, LW);
    for together in [false, true] {
        dst.write(0, &vec![UNTOUCHED; dst.len()]);
        if together {
            // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
            unsafe { b.qp.post_recv(&[rwr(99, &[sink.sge(0, 64)])]) }.unwrap();
            // SAFETY: as above.
            unsafe {
                a.qp.post_send(&[wr(99, SendOp::Send, &[small.sge(0, 64)], SIG)])
            }
            .unwrap();
        }
        let (mut s, mut d) = (0, 0);
        for (i, &len) in SIZES.iter().enumerate() {
            let r = scattered_recv(i, &dst, d, len);
            let read = SendWr {
                wr_id: i as u64,
                sg_list: r.sg_list,
                op: SendOp::Read {
                    remote_addr: remote.addr() + s as u64,
                    rkey: remote.rkey(),
                },
                flags: SIG,
            };
            // The last SGE has room for more: the READ's length is `len`.
            let mut read = read;
            if let Some(last) = read.sg_list.last_mut() {
                last.length -= GUARD as u32;
            }
            // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
            unsafe { a.qp.post_send(&[read]) }.unwrap();
            if !together {
                let c = poll_one(&a.scq);
                assert_eq!(
                    (c.wr_id, c.status, c.byte_len as usize),
                    (i as u64, WcStatus::Success, len)
                );
            }
            s += len;
            d += len + GUARD;
        }
        if together {
            let c = poll_n(&a.scq, SIZES.len() + 1);
            assert_eq!((c[0].wr_id, c[0].status), (99, WcStatus::Success));
            for (i, c) in c[1..].iter().enumerate() {
                assert_eq!(
                    (c.wr_id, c.status, c.byte_len as usize),
                    (i as u64, WcStatus::Success, SIZES[i])
                );
            }
            assert_eq!(poll_one(&b.rcq).wr_id, 99);
        }
        check_messages(&dst.read(), &data);
    }
}

/// A large READ into local memory that is not writable fails LOC_PROT_ERR
/// (its responses are not received into that memory).
#[test]
fn a_large_read_into_unwritable_memory_is_loc_prot_err_and_writes_nothing() {
    let (a, b) = pair();
    let remote = b.buf(M, LW | AccessFlags::REMOTE_READ);
    remote.fill_pattern(2);
    let local = a.buf(M, AccessFlags::NONE);
    let read = wr(
        1,
        SendOp::Read {
            remote_addr: remote.addr(),
            rkey: remote.rkey(),
        },
        &[local.sge(0, M)],
        SIG,
    );
    // SAFETY: SGEs of RegBufs, which uphold the post contract (see RegBuf).
    unsafe { a.qp.post_send(&[read]) }.unwrap();
    assert_eq!(poll_one(&a.scq).status, WcStatus::LocProtErr);
    assert!(local.read().iter().all(|&x| x == 0));
}
