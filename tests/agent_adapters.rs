//! The calls that make a port from async-rdma direct: per-call grant
//! lifetimes (`*_with_timeout`, carried in the request and enforced by the
//! owner), `LocalMr` access and hand-over, uninitialized allocation, and
//! `?` into `io::Result`.

mod common;

use std::io;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::*;
use verbio::provider::{AccessFlags, WcStatus};
use verbio::runtime::{sleep, timeout};
use verbio::{AgentError, RdmaBuilder};

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

fn status(e: &AgentError) -> Option<WcStatus> {
    match e {
        AgentError::Verb(v) => v.status(),
        _ => None,
    }
}

#[test]
fn a_requested_lifetime_travels_and_the_owner_revokes_at_it() {
    // The owner's default lifetime is long; the request asks for 300 ms.
    let (addr, server) = serve_rdma(RdmaBuilder::new, 1, |mut c| async move {
        let r = c.remove(0);
        // One grant is live while the requester writes...
        let live = r.receive().await.expect("first note");
        assert_eq!(live, b"granted");
        let during = r.live_grants();
        // ...and none once the requested lifetime is over (the connection
        // still up: the requester has not touched the revoked grant yet).
        let later = r.receive().await.expect("second note");
        assert_eq!(later, b"later");
        let after = r.live_grants();
        let _ = timeout(WAIT, r.receive()).await;
        (during, after)
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let asked = now_ms();
        let remote = r
            .request_remote_mr_with_timeout(64, Duration::from_millis(300))
            .await
            .expect("grant");
        let deadline = remote.token().deadline_ms;
        assert!(
            deadline >= asked + 250 && deadline <= now_ms() + 350,
            "deadline {} ms after the request, not the requested 300",
            deadline.saturating_sub(asked)
        );
        r.send(b"granted").await.unwrap();
        let local = r.alloc_local_mr(64).unwrap();
        let (res, mut local) = r.write(local, &remote).await;
        res.expect("write before the deadline");
        // After the deadline the owner has revoked the grant: RDMA fails.
        sleep(Duration::from_millis(450)).await;
        r.send(b"later").await.unwrap();
        let e = loop {
            let (res, l) = r.write(local, &remote).await;
            local = l;
            if let Err(e) = res {
                break e;
            }
            sleep(Duration::from_millis(25)).await;
        };
        assert_eq!(status(&e), Some(WcStatus::RemAccessErr), "{e}");
    });
    let (during, after) = server.join().expect("server");
    assert_eq!((during, after), (1, 0));
}

#[test]
fn a_requested_lifetime_is_capped_by_the_owners_token_lifetime() {
    let short = || RdmaBuilder::new().token_lifetime(Duration::from_millis(200));
    let (addr, server) = serve_rdma(short, 1, |mut c| async move {
        let r = c.remove(0);
        let _ = timeout(WAIT, r.receive()).await;
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let remote = r
            .request_remote_mr_with_lifetime(
                64,
                AccessFlags::REMOTE_READ,
                Duration::from_secs(3600),
            )
            .await
            .expect("grant");
        assert!(remote.token().deadline_ms <= now_ms() + 250);
        assert_eq!(remote.access(), AccessFlags::REMOTE_READ);
        r.send(b"bye").await.unwrap();
    });
    server.join().expect("server");
}

#[test]
fn a_local_mr_is_handed_over_with_its_access_and_lifetime() {
    let (addr, server) = serve_rdma(RdmaBuilder::new, 1, |mut c| async move {
        let r = c.remove(0);
        let remote = r.receive_remote_mr().await.expect("hand-over");
        let access = remote.access();
        let deadline = remote.token().deadline_ms;
        let local = r.alloc_local_mr(remote.len()).unwrap();
        let (res, local) = r.read(local, &remote).await;
        res.expect("read the handed-over region");
        let bytes = local.to_vec();
        r.send_remote_mr(remote).await.expect("hand back");
        let _ = timeout(WAIT, r.receive()).await;
        (access, deadline, bytes)
    });
    let (rt, dev) = runtime_and_device();
    let sent_at = now_ms();
    let granted = block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let mut mr = r
            .alloc_local_mr_with_access(256, AccessFlags::REMOTE_READ)
            .unwrap();
        assert_eq!(mr.access(), AccessFlags::REMOTE_READ);
        mr.copy_from_slice(&pattern(256, 3));
        let token = r
            .send_local_mr_with_timeout(mr, Duration::from_secs(2))
            .await
            .expect("hand over");
        assert_eq!(r.live_grants(), 1);
        let back = r.receive_local_mr().await.expect("handed back");
        assert_eq!(back, pattern(256, 3));
        assert_eq!(r.live_grants(), 0);
        r.send(b"bye").await.unwrap();
        token
    });
    let (access, deadline, bytes) = server.join().expect("server");
    assert_eq!(access, AccessFlags::REMOTE_READ);
    assert_eq!(deadline, granted.deadline_ms);
    assert!(deadline >= sent_at + 1900 && deadline <= now_ms() + 2100);
    assert_eq!(bytes, pattern(256, 3));
}

#[test]
fn a_local_mr_without_remote_access_is_not_granted() {
    let (addr, server) = serve_rdma(RdmaBuilder::new, 1, |mut c| async move {
        let r = c.remove(0);
        let _ = timeout(WAIT, r.receive()).await;
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let mr = r
            .alloc_local_mr_with_access(16, AccessFlags::LOCAL_WRITE)
            .unwrap();
        let e = r.send_local_mr(mr).await.unwrap_err();
        assert!(matches!(e, AgentError::Refused { .. }), "{e}");
        assert_eq!(io::Error::from(e).kind(), io::ErrorKind::PermissionDenied);
        assert_eq!(r.live_grants(), 0);
        r.send(b"bye").await.unwrap();
    });
    server.join().expect("server");
}

#[test]
fn an_uninit_region_has_the_length_asked_for() {
    let (addr, server) = serve_rdma(RdmaBuilder::new, 1, |mut c| async move {
        let r = c.remove(0);
        r.receive().await.expect("payload")
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let mut mr = r.alloc_local_mr_uninit(100).unwrap();
        assert_eq!(mr.len(), 100);
        mr.copy_from_slice(&pattern(100, 1));
        r.send(&mr).await.unwrap();
    });
    assert_eq!(server.join().expect("server"), pattern(100, 1));
}

/// async-rdma code is written against `io::Result`: `?` converts.
async fn ported(r: &verbio::Rdma) -> io::Result<Vec<u8>> {
    r.send(b"ping").await?;
    let reply = r.receive().await?;
    let too_big = vec![0u8; r.max_send_len() + 1];
    let e = r.send(&too_big).await.map_err(io::Error::from).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    let inner = e.get_ref().and_then(|i| i.downcast_ref::<AgentError>());
    assert!(matches!(inner, Some(AgentError::MessageTooLarge { .. })));
    Ok(reply)
}

#[test]
fn agent_errors_convert_into_io_errors() {
    let (addr, server) = serve_rdma(RdmaBuilder::new, 1, |mut c| async move {
        let r = c.remove(0);
        let m = r.receive().await.expect("ping");
        r.send(&m).await.expect("pong");
        drop(r);
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        assert_eq!(ported(&r).await.unwrap(), b"ping");
        // The peer left: the next receive is a connection reset.
        let e: io::Error = r.receive().await.unwrap_err().into();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionReset, "{e}");
    });
    server.join().expect("server");
}

#[test]
fn a_hand_back_after_the_requested_lifetime_is_refused() {
    let (addr, server) = serve_rdma(RdmaBuilder::new, 1, |mut c| async move {
        let r = c.remove(0);
        // The requester hands the grant back after its deadline: the owner
        // revoked it then, so nothing comes back and the connection stays up.
        let back = timeout(Duration::from_millis(600), r.receive_local_mr()).await;
        let note = r.receive().await.expect("note after the hand-back");
        (back.is_err(), note, r.live_grants())
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let remote = r
            .request_remote_mr_with_timeout(32, Duration::from_millis(150))
            .await
            .expect("grant");
        sleep(Duration::from_millis(350)).await;
        r.send_remote_mr(remote).await.expect("hand-back sent");
        sleep(Duration::from_millis(700)).await;
        r.send(b"still up").await.expect("connection up");
    });
    let (refused, note, live) = server.join().expect("server");
    assert!(refused, "an expired grant's memory came back");
    assert_eq!(note, b"still up");
    assert_eq!(live, 0);
}
