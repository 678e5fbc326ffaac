//! Grants through memory windows (`RdmaBuilder::grant_windows` on the
//! owner's side; soft device, two runtimes on two threads): the peer
//! reaches exactly the granted range with the granted access, and nothing
//! after a release, a hand-back or the deadline.

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

/// An owner granting through windows over a region of 64 KiB.
fn windows() -> RdmaBuilder {
    RdmaBuilder::new().grant_windows(64 * 1024)
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
fn a_window_grant_is_read_written_and_exactly_bounded() {
    let (addr, server) = memory_server(windows);
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let other = r.request_remote_mr(64).await.expect("a first grant");
        let remote = r.request_remote_mr(4096).await.expect("grant");
        assert!(remote.token().token_id & (1 << 63) != 0, "a window grant");
        assert_eq!(remote.len(), 4096);
        let mut local = r.alloc_local_mr(1024).unwrap();
        local.copy_from_slice(&pattern(1024, 9));
        let (res, local) = r.write(local, &remote.get(1024..2048).unwrap()).await;
        res.expect("write");
        let (res, back) = r.read(r.alloc_local_mr(4096).unwrap(), &remote).await;
        res.expect("read");
        assert_eq!(back.get(1024..2048).unwrap(), &local[..]);
        assert!(back.get(..1024).unwrap().iter().all(|&b| b == 0), "zeroed");
        let word = remote.get(8..16).unwrap();
        assert_eq!(r.fetch_and_add(&word, 5).await.unwrap(), 0);
        assert_eq!(r.fetch_and_add(&word, 0).await.unwrap(), 5);
        r.release(other).await.unwrap();
        if test_device().is_some() {
            println!("SKIPPED: beyond-the-grant part: rxe (Linux 6.1) checks the region's bounds, not the window's");
            r.send(b"bye").await.unwrap();
        } else {
            let b = remote.remote_buf();
            let past = RemoteBuf::new(b.addr() + b.len() - 4, 8, b.rkey());
            let (res, _) = r.qp().write(buf_from(r.pool(), &[1; 8]), past).await;
            assert_eq!(res.unwrap_err().status(), Some(WcStatus::RemAccessErr));
        }
    });
    server.join().expect("server");
}

#[test]
fn before_the_grant_is_refused() {
    if test_device().is_some() {
        println!(
            "SKIPPED: soft-only: rxe (Linux 6.1) checks the region's bounds, not the window's"
        );
        return;
    }
    let (addr, server) = memory_server(windows);
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let _first = r.request_remote_mr(64).await.expect("grant");
        let second = r.request_remote_mr(64).await.expect("grant");
        // The first grant's bytes sit right before the second's, in the
        // same region: the second's rkey does not reach them.
        let b = second.remote_buf();
        let before = RemoteBuf::new(b.addr() - 64, 64, b.rkey());
        let (res, _) = r.qp().read(buf(r.pool(), 64), before).await;
        assert_eq!(res.unwrap_err().status(), Some(WcStatus::RemAccessErr));
    });
    server.join().expect("server");
}

#[test]
fn a_released_window_grant_is_refused() {
    let (addr, server) = memory_server(windows);
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let remote = r.request_remote_mr(64).await.expect("grant");
        let keep = remote.clone();
        let (res, local) = r.write(r.alloc_local_mr(64).unwrap(), &keep).await;
        res.expect("write before release");
        r.release(remote).await.unwrap();
        // The owner invalidates the window before it binds the next one on
        // the same QP: the answer to a later request proves it.
        let _other = r.request_remote_mr(8).await.expect("round trip");
        let (res, _) = r.write(local, &keep).await;
        let e = res.unwrap_err();
        assert_eq!(status(&e), Some(WcStatus::RemAccessErr), "{e}");
    });
    server.join().expect("server");
}

#[test]
fn an_expired_window_grant_is_refused() {
    let short = || windows().token_lifetime(Duration::from_millis(150));
    let (addr, server) = memory_server(short);
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let remote = r.request_remote_mr(64).await.expect("grant");
        let mut local = r.alloc_local_mr(64).unwrap();
        let e = loop {
            let (res, l) = r.write(local, &remote).await;
            local = l;
            if let Err(e) = res {
                break e;
            }
            sleep(Duration::from_millis(25)).await;
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
fn a_window_grant_has_only_the_access_asked_for() {
    let (addr, server) = memory_server(windows);
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let remote = r
            .request_remote_mr_with(64, AccessFlags::REMOTE_READ)
            .await
            .expect("grant");
        assert_eq!(remote.access(), AccessFlags::REMOTE_READ);
        let (res, local) = r.read(r.alloc_local_mr(64).unwrap(), &remote).await;
        res.expect("read is granted");
        let (res, _) = r.write(local, &remote).await;
        assert_eq!(status(&res.unwrap_err()), Some(WcStatus::RemAccessErr));
    });
    server.join().expect("server");
}

#[test]
fn requests_beyond_the_window_region_are_refused_and_room_comes_back() {
    let small = || RdmaBuilder::new().grant_windows(4096);
    let (addr, server) = memory_server(small);
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let a = r.request_remote_mr(4096).await.expect("the whole region");
        let e = r.request_remote_mr(8).await.unwrap_err();
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
        r.release(a).await.unwrap();
        let mut again = None;
        for _ in 0..100 {
            if let Ok(g) = r.request_remote_mr(4096).await {
                again = Some(g);
                break;
            }
            sleep(Duration::from_millis(5)).await;
        }
        assert!(again.is_some(), "the released range is granted again");
        r.send(b"bye").await.unwrap();
    });
    server.join().expect("server");
}

#[test]
fn a_handed_back_window_grant_returns_its_bytes() {
    let (verdict_tx, verdict_rx) = mpsc::channel();
    let (addr, server) = serve_rdma(windows, 1, move |mut c| async move {
        let r = c.remove(0);
        let mem = r.receive_local_mr().await.unwrap();
        assert_eq!(r.live_grants(), 0, "revoked before it came back");
        verdict_tx.send(mem == vec![0x5a; 32]).unwrap();
        let _ = timeout(WAIT, r.receive()).await;
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let remote = r.request_remote_mr(32).await.unwrap();
        let keep = remote.clone();
        let mut data = r.alloc_local_mr(32).unwrap();
        data.fill(0x5a);
        let (res, data) = r.write(data, &remote).await;
        res.unwrap();
        r.send_remote_mr(remote).await.unwrap();
        assert!(verdict_rx.recv_timeout(WAIT).unwrap(), "handed-back bytes");
        let (res, _) = r.write(data, &keep).await;
        assert_eq!(status(&res.unwrap_err()), Some(WcStatus::RemAccessErr));
    });
    server.join().expect("server");
}
