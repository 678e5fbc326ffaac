//! Memory regions over the high-level `Rdma` connection (soft device, two
//! runtimes on two threads): requested grants, READ/WRITE, atomics,
//! write_with_imm, hand-overs both ways, and every refusal by the owner
//! (released, expired, more access than granted, beyond the grant).

mod common;

use std::net::SocketAddr;
use std::sync::mpsc;
use std::time::Duration;

use common::*;
use verbio::ops::agent::wire::{MrToken, RefuseCode};
use verbio::ops::verbs::{RemoteBuf, Verbs};
use verbio::provider::{AccessFlags, WcStatus};
use verbio::runtime::{sleep, timeout};
use verbio::{AgentError, CloseReason, RdmaBuilder};

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
        // A misaligned or wrong-sized word fails the call, before anything
        // is posted, and the connection goes on.
        for bad in [remote.get(4..12).unwrap(), remote.get(8..24).unwrap()] {
            assert!(matches!(
                r.fetch_and_add(&bad, 1).await,
                Err(AgentError::Verb(verbio::ops::Error::BadAtomicTarget { .. }))
            ));
            assert!(matches!(
                r.compare_and_swap(&bad, 0, 1).await,
                Err(AgentError::Verb(verbio::ops::Error::BadAtomicTarget { .. }))
            ));
        }
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

#[test]
fn tagged_hand_overs_are_matched_by_tag() {
    let (verdict_tx, verdict_rx) = mpsc::channel();
    let (addr, server) = serve_rdma(RdmaBuilder::new, 1, move |mut c| async move {
        let r = c.remove(0);
        r.send_local_mr_with_tag(vec![1; 16], 1).await.unwrap();
        r.send_local_mr_with_tag(vec![2; 32], 2).await.unwrap();
        r.send_local_mr(vec![3; 48]).await.unwrap(); // tag 0
                                                     // The client hands them back with its own tags, in another order.
        let a = r.receive_local_mr_with_tag(11).await.unwrap();
        let (b, tag_b) = r.receive_local_mr_tagged().await.unwrap();
        let c = r.receive_local_mr().await.unwrap();
        verdict_tx.send((a, b, tag_b, c)).unwrap();
        let _ = timeout(WAIT, r.receive()).await;
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        // By tag, out of arrival order: the others stay queued.
        let two = r.receive_remote_mr_with_tag(2).await.unwrap();
        assert_eq!(two.len(), 32);
        let (one, tag) = r.receive_remote_mr_tagged().await.unwrap();
        assert_eq!((one.len(), tag), (16, 1));
        // A receiver waiting for a tag that never comes takes nothing.
        let absent = timeout(Duration::from_millis(20), r.receive_remote_mr_with_tag(9)).await;
        assert!(absent.is_err(), "no grant has tag 9");
        let (zero, tag) = r.receive_remote_mr_tagged().await.unwrap();
        assert_eq!((zero.len(), tag), (48, 0), "send_local_mr sends tag 0");
        let (res, got) = r.read(r.alloc_local_mr(32).unwrap(), &two).await;
        res.unwrap();
        assert_eq!(&got[..], &[2; 32]);
        r.send_remote_mr_with_tag(two, 22).await.unwrap();
        r.send_remote_mr_with_tag(one, 11).await.unwrap();
        r.send_remote_mr(zero).await.unwrap();
        let (a, b, tag_b, c) = verdict_rx.recv_timeout(WAIT).expect("server verdict");
        assert_eq!(a, vec![1; 16], "tag 11 matched the first grant");
        assert_eq!((b, tag_b), (vec![2; 32], 22));
        assert_eq!(c, vec![3; 48]);
        r.send(b"bye").await.unwrap();
    });
    server.join().expect("server");
}

#[test]
fn partial_ranges_of_local_and_remote_regions() {
    let (addr, server) = memory_server(RdmaBuilder::new);
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let remote = r.request_remote_mr(1024).await.expect("grant");
        let mut local = r.alloc_local_mr(1024).unwrap();
        local.copy_from_slice(&pattern(1024, 5));
        // local[100..300] -> remote[500..700]
        let target = remote.get(500..700).unwrap();
        let (res, local) = r.write_range(local, 100..300, &target).await;
        res.expect("write_range");
        assert_eq!(local.len(), 1024, "the whole region comes back");
        // A shorter range into a longer view writes only its own bytes.
        let (res, local) = r
            .write_range(local, 0..=9, &remote.get(900..).unwrap())
            .await;
        res.expect("write_range of 10 bytes");
        let (res, whole) = r.read(r.alloc_local_mr(1024).unwrap(), &remote).await;
        res.expect("read");
        let want = pattern(1024, 5);
        assert_eq!(&whole[500..700], &want[100..300]);
        assert_eq!(&whole[900..910], &want[..10]);
        assert!(whole[..500].iter().all(|&b| b == 0));
        assert!(whole[700..900].iter().all(|&b| b == 0));
        assert!(whole[910..].iter().all(|&b| b == 0));
        // remote[500..700] -> back[10..210]; the rest of `back` untouched.
        let mut back = r.alloc_local_mr(512).unwrap();
        back.fill(0xee);
        let (res, back) = r.read_range(back, 10..210, &target).await;
        res.expect("read_range");
        assert_eq!(back.len(), 512);
        assert_eq!(&back[10..210], &want[100..300]);
        assert!(back[..10].iter().chain(&back[210..]).all(|&b| b == 0xee));
        // A shorter view than the range: reads the view into its start.
        let (res, back) = r.read_range(back, 300.., &remote.get(0..8).unwrap()).await;
        res.expect("read_range of 8 bytes");
        assert!(back[300..308].iter().all(|&b| b == 0));
        assert!(back[308..].iter().all(|&b| b == 0xee));

        // Out of range: errors, never panics; the region comes back whole.
        let oob = |e: &AgentError| matches!(e, AgentError::OutOfBounds { .. });
        let (res, local) = r.write_range(local, 1000..1100, &remote).await;
        assert!(oob(res.as_ref().unwrap_err()), "{res:?}");
        assert_eq!(local.len(), 1024);
        #[allow(clippy::reversed_empty_ranges)]
        let (res, local) = r.write_range(local, 300..100, &remote).await;
        assert!(oob(res.as_ref().unwrap_err()), "reversed range: {res:?}");
        let (res, local) = r.write_range(local, ..=usize::MAX, &remote).await;
        assert!(oob(res.as_ref().unwrap_err()), "overflowing end: {res:?}");
        let (res, local) = r
            .write_range(local, 0..300, &remote.get(0..200).unwrap())
            .await;
        assert!(
            oob(res.as_ref().unwrap_err()),
            "longer than the view: {res:?}"
        );
        let (res, local) = r
            .read_range(local, 0..100, &remote.get(0..200).unwrap())
            .await;
        assert!(
            oob(res.as_ref().unwrap_err()),
            "view longer than the range: {res:?}"
        );
        let (res, local) = r
            .read_range(local, 1020..1030, &remote.get(0..4).unwrap())
            .await;
        assert!(oob(res.as_ref().unwrap_err()), "{res:?}");
        let e = res.unwrap_err().to_string();
        assert!(
            e.contains("1030") && e.contains("1024"),
            "names the sizes: {e}"
        );
        assert_eq!(local.len(), 1024);
        assert!(
            remote.get(1000..1025).is_none(),
            "views stay inside the grant"
        );
        assert!(local.get(1000..1025).is_none());
        // Nothing was posted for the refusals: the connection still works.
        assert!(r.close_reason().is_none(), "{:?}", r.close_reason());
        let (res, _) = r.write_range(local, 0..8, &remote.get(0..8).unwrap()).await;
        res.expect("write after the refusals");
        r.release(remote).await.unwrap();
        r.send(b"bye").await.unwrap();
    });
    server.join().expect("server");
}

#[test]
fn forged_tokens_through_the_agent_api_are_refused_and_reported() {
    let (verdict_tx, verdict_rx) = mpsc::channel();
    let (addr, server) = serve_rdma(RdmaBuilder::new, 2, move |c| async move {
        for r in &c {
            // The forger's connection goes down; the owner's side says so
            // (bounded) instead of hanging.
            let e = timeout(WAIT, r.receive())
                .await
                .expect("owner must not hang")
                .unwrap_err();
            verdict_tx
                .send((e.close_reason().is_some(), r.live_grants()))
                .unwrap();
        }
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let forgeries: [fn(MrToken) -> MrToken; 2] = [
            |t| MrToken {
                rkey: t.rkey ^ 0x5a5a,
                ..t
            },
            |t| MrToken {
                addr: t.addr + t.len - 4,
                len: 8,
                ..t
            },
        ];
        for forge in forgeries {
            let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
            let remote = r.request_remote_mr(64).await.expect("grant");
            let (res, local) = r.write(r.alloc_local_mr(8).unwrap(), &remote).await;
            res.expect("the granted bytes are writable");
            let forged = r.remote_mr_from_token_unchecked(forge(*remote.token()));
            let (res, _) = r.write(local, &forged).await;
            let e = res.unwrap_err();
            assert_eq!(status(&e), Some(WcStatus::RemAccessErr), "{e}");
            // The connection is down and says why.
            let reason = r.close_reason().expect("connection down");
            let text = reason.to_string();
            assert!(
                matches!(reason, CloseReason::Transport(_))
                    && text.contains(&WcStatus::RemAccessErr.to_string()),
                "{text}"
            );
            let later = r.send(b"x").await.unwrap_err();
            assert_eq!(later.close_reason(), Some(&reason), "{later}");
        }
    });
    for _ in 0..2 {
        let (closed, grants) = verdict_rx.recv_timeout(WAIT).expect("owner verdict");
        assert!(closed, "the owner reports the connection down");
        assert_eq!(grants, 0, "the owner revoked the connection's grants");
    }
    server.join().expect("server");
}

#[test]
fn memory_requests_beyond_the_owners_budget_are_refused() {
    let budget = || RdmaBuilder::new().max_granted_bytes(100);
    let (addr, server) = memory_server(budget);
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let first = r.request_remote_mr(64).await.expect("within the budget");
        let e = r.request_remote_mr(64).await.unwrap_err();
        assert!(
            matches!(
                e,
                AgentError::Refused {
                    code: RefuseCode::NoMemory,
                    ..
                }
            ),
            "{e}"
        );
        r.release(first).await.unwrap();
        // The owner handles messages in order: the release frees the budget.
        let again = r.request_remote_mr(64).await.expect("budget freed");
        assert_eq!(again.len(), 64);
        r.send(b"bye").await.unwrap();
    });
    server.join().expect("server");
}

/// A peer that hands lent memory back and leaves at once: the hand-back
/// completed before the departure, so the owner gets its memory even when
/// it notices the departure (the side channel's end) first.
#[test]
fn a_hand_back_just_before_the_peer_leaves_still_returns_the_memory() {
    let (addr, server) = serve_rdma(RdmaBuilder::new, 1, |mut c| async move {
        let r = c.remove(0);
        let lent = r.receive_remote_mr().await.unwrap();
        r.send_remote_mr(lent).await.unwrap();
        // Returns: the connection, the runtime and the device go away.
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        r.send_local_mr(pattern(512, 4)).await.unwrap();
        // Busy elsewhere while the peer hands back and leaves: both the
        // hand-back and the side channel's end are pending when this
        // thread's reactor looks again.
        std::thread::sleep(Duration::from_millis(300));
        let back = r.receive_local_mr().await.expect("the handed-back memory");
        assert_eq!(back, pattern(512, 4));
    });
    server.join().unwrap();
}
