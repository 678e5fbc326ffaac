//! Every verb through the runtime between two runtimes on two threads, on
//! the software RDMA device; backpressure with 10,000 ops in flight; a
//! dropped op's buffer outlives it until the flush; a garbage client;
//! payloads around the QP's inline limit (INLINE sends and writes).

mod common;

use std::io::{Read, Write};
use std::time::Duration;

use common::*;
use verbio::ops::connect::{connect, HandshakeError};
use verbio::ops::verbs::{RemoteBuf, Verbs};
use verbio::ops::Error;
use verbio::provider::WcStatus;
use verbio::runtime::buf::MrPool;
use verbio::runtime::{sleep, timeout, QueuePair};

#[test]
fn every_verb_between_two_threads() {
    let (addr, server) = serve(1, |mut qps, dev| verbs_server(qps.remove(0), dev));
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let qp = dial(&dev, addr).await;
        verbs_client(qp, dev.clone()).await;
    });
    server
        .join()
        .expect("server panicked")
        .expect("server check");
}

#[test]
fn ten_thousand_ops_over_four_qps_respect_queue_credits() {
    const OPS: usize = 10_000;
    const QPS: usize = 4;
    let (verdict_tx, verdict_rx) = std::sync::mpsc::channel::<Vec<u64>>();
    let (bye_tx, bye_rx) = std::sync::mpsc::channel::<()>();
    let (addr, server) = serve(QPS, move |qps, dev| async move {
        let pool = MrPool::new(dev.pd());
        let region = grant(&dev, OPS * 8);
        send_remote(&qps[0], &pool, RemoteBuf::from(&region)).await;
        // Wait for the client's "done" on QP 0, then report every word.
        let (res, _) = qps[0].recv(buf(&pool, 64)).await;
        res.expect("done message");
        let words: Vec<u64> = (0..OPS)
            .map(|i| region.load_u64(i * 8).expect("word"))
            .collect();
        verdict_tx.send(words).unwrap();
        // Stay connected until the client has its last ACK (closing the
        // engine earlier would fail the client's "done" with RETRY_EXC_ERR).
        let _ = bye_rx.recv_timeout(WAIT);
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let mut qps = Vec::new();
        for _ in 0..QPS {
            qps.push(dial(&dev, addr).await);
        }
        let pool = MrPool::new(dev.pd());
        pool.reserve(8, OPS).unwrap();
        let remote = recv_remote(&qps[0], &pool).await;
        let depth = qps[0].caps().max_send_wr;
        let ops: Vec<_> = (0..OPS)
            .map(|i| {
                let qp = &qps[i % QPS];
                let b = buf_from(&pool, &(i as u64 + 1).to_ne_bytes());
                qp.write(b, remote.word(i as u64 * 8).unwrap())
            })
            .collect();
        for qp in &qps {
            assert!(qp.outstanding_sends() <= depth, "SQ overrun");
        }
        assert!(
            ops.iter().filter(|o| o.is_queued()).count() >= OPS - QPS * depth as usize,
            "submissions beyond the SQ depth must wait"
        );
        let results = futures::future::join_all(ops).await;
        for (i, (r, b)) in results.into_iter().enumerate() {
            r.unwrap_or_else(|e| panic!("op {i}: {e}"));
            assert_eq!(&b[..], &(i as u64 + 1).to_ne_bytes());
        }
        assert_eq!(pool.stats().blocks_in_use, 0, "every buffer came back");
        let (res, _) = qps[0].send(buf_from(&pool, b"done")).await;
        res.expect("done");
    });
    let words = verdict_rx.recv_timeout(WAIT).expect("verdict");
    bye_tx.send(()).unwrap();
    for (i, w) in words.iter().enumerate() {
        assert_eq!(*w, i as u64 + 1, "word {i}");
    }
    server.join().expect("server");
}

#[test]
fn dropped_op_buffer_is_freed_only_after_the_flush() {
    let (addr, server) = serve(1, |qps, _dev| async move {
        // Keep the QP until the client closed its side.
        sleep(Duration::from_millis(300)).await;
        drop(qps);
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let qp = dial(&dev, addr).await;
        let pool = MrPool::new(dev.pd());
        let op = qp.recv(buf(&pool, 256));
        assert_eq!(pool.stats().blocks_in_use, 1);
        drop(op); // in flight: the device may still write the buffer
        sleep(Duration::from_millis(20)).await;
        assert_eq!(
            pool.stats().blocks_in_use,
            1,
            "buffer freed while the device owns it"
        );
        timeout(WAIT, qp.close())
            .await
            .expect("close")
            .expect("close");
        assert_eq!(
            pool.stats().blocks_in_use,
            0,
            "buffer not freed after the flush"
        );
        // Later submissions fail as flushes, giving the buffer back.
        let (res, b) = qp.send(buf_from(&pool, b"late")).await;
        assert!(res.unwrap_err().is_flush());
        assert_eq!(&b[..], b"late");
    });
    server.join().expect("server");
}

#[test]
fn remote_access_violation_is_reported_with_its_status() {
    let (addr, server) = serve(1, |qps, dev| async move {
        let pool = MrPool::new(dev.pd());
        let region = grant(&dev, 64);
        // The client's forged WRITE moves this QP to ERR, possibly before the
        // ACK of this SEND was processed: then the SEND is flushed, which is
        // RC behaviour. The client checks that the descriptor arrived.
        match try_send_remote(&qps[0], &pool, RemoteBuf::from(&region)).await {
            Ok(_) => {}
            Err(e) => assert!(e.is_flush(), "descriptor send: {e}"),
        }
        sleep(Duration::from_millis(300)).await;
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let qp = dial(&dev, addr).await;
        let pool = MrPool::new(dev.pd());
        let remote = recv_remote(&qp, &pool).await;
        let forged = RemoteBuf::new(remote.addr(), 64, remote.rkey() ^ 0x5a5a);
        let (res, b) = qp.write(buf_from(&pool, &[9; 8]), forged).await;
        match res.unwrap_err() {
            Error::Completion {
                op, status, qp_num, ..
            } => {
                assert_eq!(op, "write");
                assert_eq!(status, WcStatus::RemAccessErr);
                assert_eq!(qp_num, qp.qp_num());
            }
            e => panic!("unexpected {e}"),
        }
        assert_eq!(&b[..], &[9; 8]);
        // The QP is in ERR now: the next op is flushed.
        let (res, _) = qp
            .write(buf_from(&pool, &[9; 8]), remote.at(0, 8).unwrap())
            .await;
        assert!(res.unwrap_err().is_flush());
    });
    server.join().expect("server");
}

#[test]
fn garbage_client_gets_an_error_and_the_listener_keeps_serving() {
    let (rt, dev) = runtime_and_device();
    let listener = listen(&dev);
    let addr = listener.local_addr().unwrap();
    // A raw TCP client sending garbage, then a good client, each on its own thread.
    let garbage = std::thread::spawn(move || {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut answer = Vec::new();
        let _ = s.read_to_end(&mut answer); // reject frame then EOF (or reset)
        answer
    });
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let good = std::thread::spawn(move || {
        // Connect only after the garbage client was refused.
        go_rx.recv_timeout(WAIT).expect("go");
        let (rt, dev) = runtime_and_device();
        block(&rt, async {
            let qp = dial(&dev, addr).await;
            let pool = MrPool::new(dev.pd());
            let (res, _) = qp.send(buf_from(&pool, b"hi")).await;
            res.expect("send over the good connection");
        });
    });
    block(&rt, async {
        match listener.accept_attempt().await {
            Err((Some(_peer), HandshakeError::BadMagic { .. })) => {}
            Err((peer, e)) => panic!("garbage client ({peer:?}) gave {e}"),
            Ok(_) => panic!("garbage client was accepted"),
        }
        go_tx.send(()).unwrap();
        let qp = listener.accept().await.expect("good client").qp;
        let pool = MrPool::new(dev.pd());
        let (res, b) = qp.recv(buf(&pool, 64)).await;
        assert_eq!(res.expect("recv").len, 2);
        assert_eq!(&b[..], b"hi");
    });
    let answer = garbage.join().unwrap();
    assert!(
        answer.is_empty() || answer.starts_with(b"VRBIO"),
        "garbage client got {answer:?}"
    );
    good.join().expect("good client");
}

#[test]
fn connecting_to_a_closed_port_is_an_io_error() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    }; // closed again
    let (rt, dev) = runtime_and_device();
    let res = block(&rt, connect(port, &qps(&dev), HANDSHAKE));
    match res {
        Err(HandshakeError::Io { .. }) => {}
        other => panic!("expected an I/O error, got {:?}", other.map(|c| c.qp)),
    }
}

#[test]
fn dropped_reads_keep_their_buffers_while_the_device_writes_them() {
    const SIZE: usize = 256 << 10;
    let (addr, server) = serve(1, |qps, dev| async move {
        let pool = MrPool::new(dev.pd());
        let region = grant(&dev, SIZE);
        region.write_from(0, &pattern(SIZE, 3)).unwrap();
        send_remote(&qps[0], &pool, RemoteBuf::from(&region)).await;
        // Keep the region until the client is done.
        let (res, _) = qps[0].recv(buf(&pool, 64)).await;
        res.expect("bye");
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let qp = dial(&dev, addr).await;
        let pool = MrPool::new(dev.pd());
        let remote = recv_remote(&qp, &pool).await;
        // Dropped at once: the device writes 256 KiB into each parked buffer
        // afterwards (AddressSanitizer would flag a premature free).
        for _ in 0..16 {
            drop(qp.read(buf(&pool, SIZE), remote));
        }
        assert_eq!(
            pool.stats().blocks_in_use + pool.stats().dedicated_in_use,
            16
        );
        let deadline = std::time::Instant::now() + WAIT;
        while pool.stats().blocks_in_use + pool.stats().dedicated_in_use > 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "parked buffers never freed"
            );
            sleep(Duration::from_millis(2)).await;
        }
        // The QP is still usable: one more READ, awaited, has the data.
        let (res, b) = qp.read(buf(&pool, SIZE), remote).await;
        res.expect("read");
        assert_eq!(&b[..], &pattern(SIZE, 3)[..]);
        let (res, _) = qp.send(buf_from(&pool, b"bye")).await;
        res.expect("bye");
    });
    server.join().expect("server");
}

/// Rounds of the inline test: each sends and writes every size once.
const INLINE_ROUNDS: usize = 30;

/// Payload sizes around `qp`'s inline limit: the verbs post them INLINE up
/// to `max_inline_data` (copied at post time) and gathered past it.
fn inline_sizes(qp: &QueuePair) -> Vec<usize> {
    let max = qp.caps().max_inline_data as usize;
    let mut v = vec![1, max / 2, max, max + 1];
    v.retain(|&n| n > 0);
    v.dedup();
    v
}

#[test]
fn inline_sized_sends_and_writes_deliver_their_bytes() {
    // Both QPs come from the same configuration on the same kind of device:
    // same caps, so both sides compute the same sizes.
    let (addr, server) = serve(1, |mut qps, dev| async move {
        let qp = qps.remove(0);
        let pool = MrPool::new(dev.pd());
        let sizes = inline_sizes(&qp);
        let slot = sizes.iter().max().copied().unwrap_or(1).next_multiple_of(8);
        let n = sizes.len() * INLINE_ROUNDS;
        let region = grant(&dev, n * slot);
        // Every RECV (n SENDs and the "done") is posted before the client starts.
        let recvs: Vec<_> = (0..=n).map(|_| qp.recv(buf(&pool, slot))).collect();
        send_remote(&qp, &pool, RemoteBuf::from(&region)).await;
        let got = futures::future::join_all(recvs).await;
        let mut problems = Vec::new();
        for (i, (res, b)) in got.iter().enumerate().take(n) {
            let want = pattern(sizes[i % sizes.len()], i as u8);
            match res {
                Ok(r) if r.len == want.len() && b[..] == want[..] => {}
                Ok(r) => problems.push(format!("send {i}: {} bytes {:?}", r.len, &b[..])),
                Err(e) => problems.push(format!("send {i}: {e}")),
            }
        }
        match &got[n] {
            (Ok(_), b) if &b[..] == b"done" => {}
            (res, b) => problems.push(format!("done: {res:?} {:?}", &b[..])),
        }
        let all = region.to_vec();
        for i in 0..n {
            let want = pattern(sizes[i % sizes.len()], !(i as u8));
            if all[i * slot..i * slot + want.len()] != want[..] {
                problems.push(format!("write {i} ({} bytes)", want.len()));
            }
        }
        let reply = if problems.is_empty() { "ok" } else { "bad" };
        let (res, _) = qp.send(buf_from(&pool, reply.as_bytes())).await;
        res.map_err(|e| format!("reply: {e}"))?;
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems.join("; "))
        }
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let qp = dial(&dev, addr).await;
        let pool = MrPool::new(dev.pd());
        let sizes = inline_sizes(&qp);
        assert!(
            sizes.len() > 1,
            "max_inline_data {}: no inline sizes to test",
            qp.caps().max_inline_data
        );
        let slot = sizes.iter().max().copied().unwrap_or(1).next_multiple_of(8);
        let n = sizes.len() * INLINE_ROUNDS;
        let remote = recv_remote(&qp, &pool).await;
        let reply = qp.recv(buf(&pool, 64));
        // More WRs than the send queue holds: the later ones (INLINE too) wait
        // for room and are posted, their payload copied, only then.
        let mut sends = Vec::with_capacity(n);
        let mut writes = Vec::with_capacity(n);
        for i in 0..n {
            let len = sizes[i % sizes.len()];
            sends.push(qp.send(buf_from(&pool, &pattern(len, i as u8))));
            let at = remote.at((i * slot) as u64, len as u64).expect("slot");
            writes.push(qp.write(buf_from(&pool, &pattern(len, !(i as u8))), at));
        }
        assert!(
            writes.iter().any(|w| w.is_queued()),
            "expected submissions beyond the send queue's depth to wait"
        );
        let (sent, written) = futures::join!(
            futures::future::join_all(sends),
            futures::future::join_all(writes)
        );
        for (i, ((sres, sb), (wres, wb))) in sent.into_iter().zip(written).enumerate() {
            let len = sizes[i % sizes.len()];
            assert_eq!(sres.unwrap_or_else(|e| panic!("send {i}: {e}")), len);
            wres.unwrap_or_else(|e| panic!("write {i}: {e}"));
            // The buffers come back untouched.
            assert_eq!(&sb[..], &pattern(len, i as u8)[..], "send buffer {i}");
            assert_eq!(&wb[..], &pattern(len, !(i as u8))[..], "write buffer {i}");
        }
        let (res, _) = qp.send(buf_from(&pool, b"done")).await;
        res.expect("done");
        let (res, b) = reply.await;
        res.expect("reply");
        assert_eq!(&b[..], b"ok", "the server found mismatches");
    });
    server
        .join()
        .expect("server panicked")
        .expect("server check");
}
