//! Memory regions over the high-level `Rdma` connection (soft device, two
//! runtimes on two threads): requested grants, READ/WRITE, atomics,
//! write_with_imm, hand-overs both ways, and every refusal by the owner
//! (released, expired, more access than granted, beyond the grant).

mod common;

use std::net::SocketAddr;
use std::sync::mpsc;
use std::time::Duration;

use common::*;
use verbio::ops::agent::wire::RefuseCode;
use verbio::ops::verbs::{RemoteBuf, Verbs};
use verbio::provider::{AccessFlags, WcStatus};
use verbio::runtime::{sleep, timeout};
use verbio::{AgentError, RdmaBuilder};

/// The completion status of a failed verb.
fn status(e: &AgentError) -> Option<WcStatus> {
    match e {
        AgentError::Verb(v) => v.status(),
        _ => None,
    }
}

/// A server that serves memory requests until the client says "bye".
fn memory_server(
    builder: impl FnOnce() -> RdmaBuilder + Send + 'static,
) -> (SocketAddr, std::thread::JoinHandle<()>) {
    serve_rdma(builder, 1, |mut c| async move {
        let r = c.remove(0);
        let _ = timeout(WAIT, r.receive()).await;
    })
}

#[test]
fn write_read_atomics_and_slices_on_a_requested_region() {
    let (addr, server) = memory_server(RdmaBuilder::new);
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let remote = r.request_remote_mr(4096).await.expect("grant");
        assert_eq!(remote.len(), 4096);
        assert!(remote.token().deadline_ms > 0);
        let mut local = r.alloc_local_mr(1024).unwrap();
        local.copy_from_slice(&pattern(1024, 9));
        let (res, local) = r.write(local, &remote.get(1024..2048).unwrap()).await;
        res.expect("write");
        let back = r.alloc_local_mr(4096).unwrap();
        let (res, back) = r.read(back, &remote).await;
        res.expect("read");
        assert_eq!(back.get(1024..2048).unwrap(), &local[..]);
        assert!(back.get(..1024).unwrap().iter().all(|&b| b == 0));
        assert!(back.get(4000..5000).is_none());
        assert!(remote.get(4000..5000).is_none());
        // Too large for the target: refused before posting.
        let big = r.alloc_local_mr(2048).unwrap();
        let (res, _) = r.write(big, &remote.get(0..1024).unwrap()).await;
        assert!(matches!(res, Err(AgentError::OutOfBounds { .. })));
        let word = remote.get(8..16).unwrap();
        assert_eq!(r.fetch_and_add(&word, 5).await.unwrap(), 0);
        assert_eq!(r.compare_and_swap(&word, 5, 42).await.unwrap(), 5);
        assert_eq!(r.compare_and_swap(&word, 5, 7).await.unwrap(), 42);
        assert_eq!(r.fetch_and_add(&word, 0).await.unwrap(), 42);
        r.release(remote).await.unwrap();
        r.send(b"bye").await.unwrap();
    });
    server.join().expect("server");
}

#[test]
fn write_to_a_released_grant_fails_with_rem_access_err() {
    let (addr, server) = memory_server(RdmaBuilder::new);
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let remote = r.request_remote_mr(64).await.expect("grant");
        let keep = remote.clone(); // a view outliving the release
        let local = r.alloc_local_mr(64).unwrap();
        let (res, local) = r.write(local, &keep).await;
        res.expect("write before release");
        r.release(remote).await.unwrap();
        // The owner handles messages in order: the answer to a later request
        // proves the release was processed.
        let _other = r.request_remote_mr(8).await.expect("round trip");
        let (res, _) = r.write(local, &keep).await;
        let e = res.unwrap_err();
        assert_eq!(status(&e), Some(WcStatus::RemAccessErr), "{e}");
        // The QP is in ERR: the connection reports it is down.
        assert!(r.close_reason().is_some());
    });
    server.join().expect("server");
}

#[test]
fn expired_grant_is_revoked_by_the_owner() {
    let short = || RdmaBuilder::new().token_lifetime(Duration::from_millis(150));
    let (addr, server) = memory_server(short);
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let remote = r.request_remote_mr(64).await.expect("grant");
        let local = r.alloc_local_mr(64).unwrap();
        let (res, local) = r.write(local, &remote).await;
        res.expect("write before the deadline");
        // Writes succeed until the owner's timer revokes the grant.
        let mut local = local;
        let e = loop {
            sleep(Duration::from_millis(25)).await;
            let (res, l) = r.write(local, &remote).await;
            local = l;
            if let Err(e) = res {
                break e;
            }
        };
        assert_eq!(status(&e), Some(WcStatus::RemAccessErr), "{e}");
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        assert!(
            now_ms + 50 >= remote.token().deadline_ms,
            "revoked {} ms before the deadline",
            remote.token().deadline_ms - now_ms
        );
    });
    server.join().expect("server");
}

#[test]
fn access_is_capped_by_the_owners_maximum() {
    let read_only = || RdmaBuilder::new().max_access(AccessFlags::REMOTE_READ);
    let (addr, server) = memory_server(read_only);
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let only_write = r
            .request_remote_mr_with(64, AccessFlags::REMOTE_WRITE)
            .await
            .unwrap_err();
        assert!(
            matches!(
                only_write,
                AgentError::Refused {
                    code: RefuseCode::AccessDenied,
                    ..
                }
            ),
            "{only_write}"
        );
        let empty = r.request_remote_mr(0).await.unwrap_err();
        assert!(
            matches!(
                empty,
                AgentError::Refused {
                    code: RefuseCode::BadLayout,
                    ..
                }
            ),
            "{empty}"
        );
        let remote = r.request_remote_mr(64).await.expect("grant");
        assert_eq!(remote.access(), AccessFlags::REMOTE_READ);
        let (res, local) = r.read(r.alloc_local_mr(64).unwrap(), &remote).await;
        res.expect("read is granted");
        let (res, _) = r.write(local, &remote).await;
        assert_eq!(status(&res.unwrap_err()), Some(WcStatus::RemAccessErr));
    });
    server.join().expect("server");
}

#[test]
fn hand_overs_both_ways_and_write_with_imm() {
    let (verdict_tx, verdict_rx) = mpsc::channel();
    // The client requests memory (a new grant here) only after the server has
    // counted its grants: the agent may serve that request right behind the
    // hand-back.
    let (counted_tx, counted_rx) = mpsc::channel::<()>();
    let (addr, server) = serve_rdma(RdmaBuilder::new, 1, move |mut c| async move {
        let r = c.remove(0);
        // 1. Lend own memory; the client reads it, writes its second half
        //    and hands it back.
        r.send_local_mr(pattern(256, 1)).await.unwrap();
        assert_eq!(r.live_grants(), 1);
        let back = r.receive_local_mr().await.unwrap();
        assert_eq!(r.live_grants(), 0, "revoked before it came back");
        counted_tx.send(()).unwrap();
        let mut want = pattern(256, 1);
        want[128..].fill(0xcd);
        verdict_tx.send(back == want).unwrap();
        // 2. The client requested memory, wrote it with an immediate and
        //    hands it back.
        assert_eq!(r.receive_write_imm().await.unwrap(), 0xfeed);
        let mem = r.receive_local_mr().await.unwrap();
        verdict_tx.send(mem == vec![0x5a; 32]).unwrap();
        let _ = timeout(WAIT, r.receive()).await;
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let lent = r.receive_remote_mr().await.unwrap();
        let (res, got) = r.read(r.alloc_local_mr(256).unwrap(), &lent).await;
        res.unwrap();
        assert_eq!(&got[..], &pattern(256, 1)[..]);
        let mut half = r.alloc_local_mr(128).unwrap();
        half.fill(0xcd);
        let (res, _) = r.write(half, &lent.get(128..).unwrap()).await;
        res.unwrap();
        r.send_remote_mr(lent).await.unwrap();
        let deadline = std::time::Instant::now() + WAIT;
        while counted_rx.try_recv().is_err() {
            assert!(std::time::Instant::now() < deadline, "server never counted");
            sleep(Duration::from_millis(1)).await;
        }

        let remote = r.request_remote_mr(32).await.unwrap();
        let mut data = r.alloc_local_mr(32).unwrap();
        data.fill(0x5a);
        let (res, _) = r.write_with_imm(data, &remote, 0xfeed).await;
        res.unwrap();
        r.send_remote_mr(remote).await.unwrap();
        r.send(b"bye").await.unwrap();
    });
    assert!(
        verdict_rx.recv_timeout(WAIT).unwrap(),
        "lent memory content"
    );
    assert!(
        verdict_rx.recv_timeout(WAIT).unwrap(),
        "requested memory content"
    );
    server.join().expect("server");
}

#[test]
fn dropped_remote_mr_is_released() {
    let (count_tx, count_rx) = mpsc::channel();
    // The client drops its grant only after the server has counted it (the
    // agent may process the Release right behind the "granted" message).
    let (counted_tx, counted_rx) = mpsc::channel::<()>();
    let (addr, server) = serve_rdma(RdmaBuilder::new, 1, move |mut c| async move {
        let r = c.remove(0);
        assert_eq!(r.receive().await.unwrap(), b"granted");
        count_tx.send(r.live_grants()).unwrap();
        counted_tx.send(()).unwrap();
        assert_eq!(r.receive().await.unwrap(), b"dropped");
        count_tx.send(r.live_grants()).unwrap();
        let _ = timeout(WAIT, r.receive()).await;
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let remote = r.request_remote_mr(64).await.unwrap();
        let view = remote.get(0..8).unwrap();
        r.send(b"granted").await.unwrap();
        let deadline = std::time::Instant::now() + WAIT;
        while counted_rx.try_recv().is_err() {
            assert!(std::time::Instant::now() < deadline, "server never counted");
            sleep(Duration::from_millis(1)).await;
        }
        drop(remote);
        drop(view); // the last view: a Release goes out
        sleep(Duration::from_millis(20)).await;
        r.send(b"dropped").await.unwrap();
        sleep(Duration::from_millis(50)).await;
        r.send(b"bye").await.unwrap();
    });
    assert_eq!(count_rx.recv_timeout(WAIT).unwrap(), 1);
    assert_eq!(count_rx.recv_timeout(WAIT).unwrap(), 0);
    server.join().expect("server");
}

#[test]
fn forged_rkey_and_beyond_the_grant_are_refused() {
    let (addr, server) = serve_rdma(RdmaBuilder::new, 2, |c| async move {
        for r in &c {
            let _ = timeout(WAIT, r.receive()).await;
        }
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        for forge in [
            |b: RemoteBuf| RemoteBuf::new(b.addr(), b.len(), b.rkey() ^ 0x5a5a),
            |b: RemoteBuf| RemoteBuf::new(b.addr() + b.len() - 4, 8, b.rkey()),
        ] {
            let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
            let remote = r.request_remote_mr(64).await.expect("grant");
            let (res, b) = r
                .qp()
                .write(
                    buf_from(r.pool(), &[1; 8]),
                    remote.get(0..8).unwrap().remote_buf(),
                )
                .await;
            res.expect("the granted bytes are writable");
            let (res, _) = r.qp().write(b, forge(remote.remote_buf())).await;
            assert_eq!(res.unwrap_err().status(), Some(WcStatus::RemAccessErr));
        }
    });
    server.join().expect("server");
}

#[test]
fn dropped_memory_request_does_not_leak_the_grant() {
    let (addr, server) = serve_rdma(RdmaBuilder::new, 1, |mut c| async move {
        let r = c.remove(0);
        let mut seen_grant = false;
        loop {
            let m = r.receive().await.unwrap();
            if m == b"bye" {
                break;
            }
            let n = r.live_grants();
            seen_grant |= n > 0;
            r.send(&[n as u8]).await.unwrap();
        }
        seen_grant
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let cut = timeout(Duration::from_micros(1), r.request_remote_mr(64)).await;
        assert!(cut.is_err(), "the request should still have been waiting");
        // The late answer is released: the owner's grant count drops to 0.
        loop {
            r.send(b"count?").await.unwrap();
            if r.receive().await.unwrap() == [0] {
                break;
            }
            sleep(Duration::from_millis(5)).await;
        }
        r.send(b"bye").await.unwrap();
    });
    let _ = server.join().expect("server");
}

#[test]
fn a_grant_cannot_be_reached_through_another_connection() {
    // Each connection has its own protection domain: memory granted on
    // connection A is out of reach of connection B's QP, even with A's rkey.
    let (addr, server) = serve_rdma(RdmaBuilder::new, 2, |c| async move {
        let _ = timeout(WAIT, c[0].receive()).await;
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let a = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let b = a.new_connection().await.expect("second connection");
        let remote = a.request_remote_mr(64).await.expect("grant on A");
        let local = a.alloc_local_mr(64).unwrap();
        let (res, _) = a.write(local, &remote).await;
        res.expect("write through A");
        let mut local = b.alloc_local_mr(64).unwrap();
        local.copy_from_slice(&pattern(64, 3));
        let (res, _) = timeout(WAIT, b.write(local, &remote))
            .await
            .expect("bounded");
        let e = res.unwrap_err();
        assert_eq!(status(&e), Some(WcStatus::RemAccessErr), "{e}");
        // A's grant still holds what A wrote (zeros), not B's pattern.
        let back = a.alloc_local_mr(64).unwrap();
        let (res, back) = a.read(back, &remote).await;
        res.expect("read through A");
        assert!(back.iter().all(|&x| x == 0));
        a.send(b"bye").await.unwrap();
    });
    server.join().expect("server");
}
