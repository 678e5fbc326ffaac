//! Transmission from the posting thread (`direct.rs`): a SEND of one
//! packet, large ones included, goes out from the thread that posts it
//! when it is the QP's only request; behind another request, a large one
//! is left to the engine. Either way the peer receives it intact, in order.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::super::drive::tests::{pair, post_recv, post_send, send_wr, spin_one, Mem, Side};
use super::super::lock;
use super::super::packet::MAX_PAYLOAD;
use super::super::requester::ZC_MIN;
use crate::provider::{AccessFlags, SendOp, WcStatus};

fn direct_sends(side: &Side) -> u64 {
    side.ctx.shared().direct_sends.load(Ordering::Relaxed)
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

/// Sends `len` bytes from `src` at offset 0 into `dst` at 0 and checks them.
fn round(a: &Side, b: &Side, src: &Mem, dst: &Mem, len: usize, id: u64) {
    let data = pattern(len, id as u8);
    src.write(0, &data);
    post_recv(&b.qp, id, dst.sge(0, len));
    post_send(&a.qp, send_wr(id, SendOp::Send, src.sge(0, len)));
    let r = spin_one(&b.rcq);
    assert_eq!(
        (r.wr_id, r.status, r.byte_len),
        (id, WcStatus::Success, len as u32)
    );
    assert_eq!(dst.read(0, len), data, "message {id}");
    let s = spin_one(&a.scq);
    assert_eq!((s.wr_id, s.status), (id, WcStatus::Success));
}

/// Runs `attempt` (one lone post and its checks) until one of its posts
/// went out from the posting thread. The direct path is taken when the
/// engine allows it at that moment (it takes the socket back while it has
/// work of its own, e.g. a held ACK going out), so under load a lone post
/// may go through the engine; every attempt still checks its data.
fn until_direct(side: &Side, what: &str, mut attempt: impl FnMut()) {
    let deadline = Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let before = direct_sends(side);
        attempt();
        let sent = direct_sends(side) - before;
        assert!(sent <= 1, "{what}: one post, {sent} direct sends");
        if sent == 1 {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: never went out directly");
    }
}

#[test]
fn a_lone_large_send_goes_from_the_posting_thread_and_one_behind_another_from_the_engine() {
    let (a, b) = pair();
    let max = MAX_PAYLOAD as usize;
    let src = Mem::new(&a.pd, max, AccessFlags::LOCAL_WRITE);
    let dst = Mem::new(&b.pd, 2 * max, AccessFlags::LOCAL_WRITE);
    // The first exchanges set the connection up; then the engine lets
    // posts transmit (it may take a moment to say so).
    let deadline = Instant::now() + std::time::Duration::from_secs(10);
    let mut id = 0;
    loop {
        let before = direct_sends(&a);
        round(&a, &b, &src, &dst, 64, id);
        id += 1;
        if direct_sends(&a) > before {
            break;
        }
        assert!(Instant::now() < deadline, "no post ever went out directly");
    }
    // Large single-packet SENDs, one at a time: from the posting thread.
    for len in [ZC_MIN as usize, 64 * 1024 + 3, max] {
        until_direct(&a, &format!("a lone SEND of {len} bytes"), || {
            round(&a, &b, &src, &dst, len, id);
            id += 1;
        });
    }
    // No receive posted: the first SEND waits (RNR) and stays in flight,
    // so the second is left to the engine.
    let first = pattern(max, 1);
    src.write(0, &first);
    post_send(&a.qp, send_wr(100, SendOp::Send, src.sge(0, max)));
    let behind = direct_sends(&a);
    post_send(&a.qp, send_wr(101, SendOp::Send, src.sge(0, max / 2)));
    assert_eq!(direct_sends(&a), behind, "the one behind it did not");
    post_recv(&b.qp, 200, dst.sge(0, max));
    post_recv(&b.qp, 201, dst.sge(max, max));
    for (wr_id, len) in [(200, max), (201, max / 2)] {
        let r = spin_one(&b.rcq);
        assert_eq!(
            (r.wr_id, r.status, r.byte_len),
            (wr_id, WcStatus::Success, len as u32)
        );
    }
    // (The source was not written meanwhile: both carry its bytes.)
    assert_eq!(dst.read(0, max), first);
    assert_eq!(dst.read(max, max / 2), first[..max / 2]);
    for wr_id in [100, 101] {
        let s = spin_one(&a.scq);
        assert_eq!((s.wr_id, s.status), (wr_id, WcStatus::Success));
    }
}

#[test]
fn a_lone_read_request_goes_from_the_posting_thread_and_its_data_arrives() {
    let (a, b) = pair();
    let len = 200 * 1024;
    let local = Mem::new(&a.pd, len, AccessFlags::LOCAL_WRITE);
    let remote = Mem::new(
        &b.pd,
        len,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
    );
    let small = Mem::new(&a.pd, 64, AccessFlags::LOCAL_WRITE);
    let sink = Mem::new(&b.pd, 64, AccessFlags::LOCAL_WRITE);
    let data = pattern(len, 5);
    remote.write(0, &data);
    let deadline = Instant::now() + std::time::Duration::from_secs(10);
    let mut id = 0;
    loop {
        let before = direct_sends(&a);
        round(&a, &b, &small, &sink, 64, id);
        id += 1;
        if direct_sends(&a) > before {
            break;
        }
        assert!(Instant::now() < deadline, "no post ever went out directly");
    }
    let read = |wr_id| {
        send_wr(
            wr_id,
            SendOp::Read {
                remote_addr: remote.addr(),
                rkey: remote.mr().rkey(),
            },
            local.sge(0, len),
        )
    };
    let mut wr_id = 500;
    for _ in 0..3 {
        until_direct(&a, "a lone READ", || {
            local.write(0, &vec![0; len]);
            post_send(&a.qp, read(wr_id));
            let s = spin_one(&a.scq);
            assert_eq!(
                (s.wr_id, s.status, s.byte_len),
                (wr_id, WcStatus::Success, len as u32)
            );
            assert!(local.read(0, len) == data, "the bytes read");
            wr_id += 1;
        });
    }
    // Behind a SEND still in flight (no receive: RNR), a READ is left to
    // the engine, and both complete in order once the receive is posted.
    post_send(&a.qp, send_wr(600, SendOp::Send, small.sge(0, 64)));
    let behind = direct_sends(&a);
    post_send(&a.qp, read(601));
    assert_eq!(
        direct_sends(&a),
        behind,
        "the READ behind it did not go directly"
    );
    post_recv(&b.qp, 700, sink.sge(0, 64));
    assert_eq!(spin_one(&b.rcq).wr_id, 700);
    for wr_id in [600, 601] {
        let s = spin_one(&a.scq);
        assert_eq!((s.wr_id, s.status), (wr_id, WcStatus::Success));
    }
}

/// The socket a QP's posts may write to directly, once the engine lets
/// them (its fd).
fn direct_socket(side: &Side) -> std::os::fd::RawFd {
    let deadline = Instant::now() + std::time::Duration::from_secs(10);
    loop {
        if let Some(d) = lock(&side.qp.0.shared.inner).direct.as_ref() {
            return d.wire.fd();
        }
        assert!(Instant::now() < deadline, "posts never allowed to write");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// A lone large SEND whose payload the socket does not take whole in the
/// posting thread's write (its send buffer made small here) leaves the
/// rest in its memory, and the engine writes it from there: the peer
/// receives every byte in order, and the messages behind it follow intact.
#[test]
fn the_rest_of_a_lone_send_the_socket_did_not_take_goes_from_memory_intact() {
    let (a, b) = pair();
    let max = MAX_PAYLOAD as usize;
    let src = Mem::new(&a.pd, max, AccessFlags::LOCAL_WRITE);
    let dst = Mem::new(&b.pd, max, AccessFlags::LOCAL_WRITE);
    let rest = |s: &Side| s.ctx.shared().direct_rest_in_memory.load(Ordering::Relaxed);
    round(&a, &b, &src, &dst, 64, 0);
    let fd = direct_socket(&a);
    let small: libc::c_int = 16 * 1024;
    // SAFETY: `small` is a live c_int of the size passed; `fd` is the open
    // socket of the QP's connection (the engine keeps it open).
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            (&small as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "SO_SNDBUF");
    let deadline = Instant::now() + std::time::Duration::from_secs(20);
    let mut id = 1;
    let mut left = 0;
    while left < 3 {
        let before = rest(&a);
        // A large one (of a length that moves its end), then a small one
        // behind it on the same socket.
        round(&a, &b, &src, &dst, max - 3 * id as usize, id);
        round(&a, &b, &src, &dst, 100, id + 1);
        id += 2;
        left += rest(&a) - before;
        assert!(
            Instant::now() < deadline,
            "a lone SEND left its rest in memory {left} times, not 3"
        );
    }
}

/// A burst of small SENDs posted one at a time while the first is in
/// flight costs two `send`s, not one each: the first goes out at once, the
/// others are corked behind it (`Wire::try_write_or_cork`) until the
/// application's next poll. The engine of the posting side is kept from
/// running (its lock held) so that no ACK it would read flushes them
/// earlier. The peer receives every one, intact and in order.
#[test]
fn a_burst_of_small_sends_behind_one_in_flight_goes_out_in_one_write() {
    const N: u64 = 32;
    const LEN: usize = 64;
    let (a, b) = pair();
    let src = Mem::new(&a.pd, LEN * N as usize, AccessFlags::LOCAL_WRITE);
    let dst = Mem::new(&b.pd, LEN * N as usize, AccessFlags::LOCAL_WRITE);
    // The first exchanges set the connection up; then the engine lets
    // posts transmit.
    let deadline = Instant::now() + std::time::Duration::from_secs(10);
    let mut id = 1000;
    loop {
        let before = direct_sends(&a);
        round(&a, &b, &src, &dst, LEN, id);
        id += 1;
        if direct_sends(&a) > before {
            break;
        }
        assert!(Instant::now() < deadline, "no post ever went out directly");
    }
    for i in 0..N {
        let at = i as usize * LEN;
        src.write(at, &pattern(LEN, i as u8));
        post_recv(&b.qp, i, dst.sge(at, LEN));
    }
    let sh = a.ctx.shared();
    let (corked, flushes, engine_writes) = (
        sh.corked_sends.load(Ordering::Relaxed),
        sh.cork_flushes.load(Ordering::Relaxed),
        sh.tx_writes.load(Ordering::Relaxed),
    );
    let (wire, direct, writes) = {
        // The posting side's engine is kept out (it would read the first
        // SEND's ACK and flush at the end of that turn), once it lets
        // posts transmit (it may take the socket back for a moment).
        let (_engine, wire) = loop {
            let engine = lock(a.ctx.core());
            let wire = lock(&a.qp.0.shared.inner)
                .direct
                .as_ref()
                .map(|d| d.wire.clone());
            if let Some(w) = wire {
                break (engine, w);
            }
            drop(engine);
            assert!(Instant::now() < deadline, "posts never allowed to transmit");
            std::thread::sleep(std::time::Duration::from_millis(1));
        };
        let (direct, writes) = (direct_sends(&a), wire.writes());
        for i in 0..N {
            post_send(
                &a.qp,
                send_wr(i, SendOp::Send, src.sge(i as usize * LEN, LEN)),
            );
        }
        assert_eq!(direct_sends(&a) - direct, N, "every SEND went out directly");
        assert_eq!(
            sh.corked_sends.load(Ordering::Relaxed) - corked,
            N - 1,
            "all but the first were corked"
        );
        assert_eq!(wire.writes() - writes, 1, "only the first was written");
        (wire, direct, writes)
    };
    // The application's poll (or the engine's receive of the first ACK)
    // flushes them, in one write. On a loaded host the engine may have
    // output of its own first (a retransmission of the first SEND, whose
    // ACK it could not read while kept out): its write takes the corked
    // requests along, and no flush finds any left.
    for i in 0..N {
        let s = spin_one(&a.scq);
        assert_eq!((s.wr_id, s.status), (i, WcStatus::Success));
    }
    assert_eq!(direct_sends(&a) - direct, N);
    // The engine adds a service's writes to its count after the service:
    // read the counts once it went to sleep.
    while !sh.sleeping.load(Ordering::SeqCst) {
        assert!(Instant::now() < deadline, "the engine never went to sleep");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let flushed = sh.cork_flushes.load(Ordering::Relaxed) - flushes;
    if flushed == 0 {
        assert!(
            sh.tx_writes.load(Ordering::Relaxed) > engine_writes,
            "the corked burst went out with neither a flush nor an engine write"
        );
        assert_eq!(
            wire.writes() - writes,
            1,
            "the burst took the first write and the engine's"
        );
    } else {
        assert_eq!(flushed, 1, "one flush wrote the corked burst");
        assert_eq!(wire.writes() - writes, 2, "the burst took two writes");
    }
    for i in 0..N {
        let r = spin_one(&b.rcq);
        assert_eq!(
            (r.wr_id, r.status, r.byte_len),
            (i, WcStatus::Success, LEN as u32)
        );
        let at = i as usize * LEN;
        assert_eq!(dst.read(at, LEN), pattern(LEN, i as u8), "message {i}");
    }
}
