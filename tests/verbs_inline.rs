//! Inline sends without an op (`Verbs::send_inline`, mostly unsignaled) on
//! the software RDMA device (or rxe0 in the VM, `VERBIO_TEST_DEVICE`): hundreds in a row past the send-queue depth
//! (no `QueueFull`, delivered in order), mixed with signaled sends, an
//! error of an unsignaled one reported by the QP afterwards, and close
//! with unsignaled sends still trailing.

mod common;

use std::time::Duration;

use futures::future::join_all;
use verbio::ops::connect::{DeviceQps, QpConfig};
use verbio::ops::verbs::Verbs;
use verbio::ops::Error;
use verbio::provider::{QpCaps, WcStatus};
use verbio::runtime::buf::MrPool;
use verbio::runtime::{sleep, timeout, Device, QueuePair, Runtime, SubmitError};

const WAIT: Duration = Duration::from_secs(20);

/// A runtime, the test device (a fresh soft device, or the one named by
/// `VERBIO_TEST_DEVICE`: rxe0 in scripts/rxe-test.sh), and two of its QPs
/// connected to each other (loopback through the device).
fn pair(send_depth: u32, recv_depth: u32) -> (Runtime, Device, QueuePair, QueuePair) {
    let (rt, dev) = common::runtime_and_device();
    let config = QpConfig {
        caps: QpCaps {
            max_send_wr: send_depth,
            max_recv_wr: recv_depth,
            ..QpCaps::default()
        },
        ..QpConfig::default()
    };
    let (a, b) = DeviceQps::new(dev.clone(), config)
        .connected_pair()
        .expect("connected QPs");
    (rt, dev, a, b)
}

fn block<F: std::future::Future>(rt: &Runtime, f: F) -> F::Output {
    rt.block_on(timeout(WAIT, f)).expect("timed out")
}

#[test]
fn hundreds_of_inline_sends_past_the_queue_depth_arrive_in_order() {
    const N: usize = 300;
    let (rt, dev, a, b) = pair(8, 512);
    let pool = MrPool::new(dev.pd());
    block(&rt, async {
        let recvs: Vec<_> = (0..N)
            .map(|_| b.recv(pool.alloc(16).expect("pool")))
            .collect();
        for i in 0..N {
            a.send_inline(&(i as u64).to_le_bytes())
                .await
                .unwrap_or_else(|e| panic!("send {i}: {e}"));
            assert!(a.outstanding_sends() <= 8, "credits over-commit the SQ");
        }
        for (i, (res, got)) in join_all(recvs).await.into_iter().enumerate() {
            let r = res.unwrap_or_else(|e| panic!("recv {i}: {e}"));
            assert_eq!(r.len, 8);
            assert_eq!(&got[..], &(i as u64).to_le_bytes(), "message {i}");
        }
        // Trailing unsignaled sends are retired on demand.
        a.sends_idle().await;
        assert_eq!(a.outstanding_sends(), 0);
        assert!(a.inline_send_error().is_none());
    });
}

#[test]
fn inline_sends_mix_with_signaled_sends_and_immediates() {
    let (rt, dev, a, b) = pair(16, 64);
    let pool = MrPool::new(dev.pd());
    block(&rt, async {
        let recvs: Vec<_> = (0..40)
            .map(|_| b.recv(pool.alloc(64).expect("pool")))
            .collect();
        for i in 0..40u32 {
            match i % 4 {
                0 => {
                    let (res, _) = a.send(pool.alloc_from(&[i as u8; 40]).expect("pool")).await;
                    assert_eq!(res.expect("signaled send"), 40);
                }
                1 => a.send_inline_with_imm(&[i as u8; 3], i).await.expect("imm"),
                _ => a.send_inline(&[i as u8; 5]).await.expect("inline"),
            }
        }
        for (i, (res, got)) in join_all(recvs).await.into_iter().enumerate() {
            let r = res.unwrap_or_else(|e| panic!("recv {i}: {e}"));
            let (len, imm) = match i % 4 {
                0 => (40, None),
                1 => (3, Some(i as u32)),
                _ => (5, None),
            };
            assert_eq!((r.len, r.imm), (len, imm), "message {i}");
            assert!(got.iter().all(|&x| x == i as u8), "payload {i}");
        }
    });
}

#[test]
fn an_unsignaled_inline_send_that_fails_is_reported_by_the_qp() {
    let (rt, _dev, a, b) = pair(16, 16);
    block(&rt, async {
        // A receive with no buffer: a SEND with payload fails at the
        // responder, and the requester's (unsignaled) WR with it.
        let r = b.recv_empty();
        a.send_inline(b"too long for an empty receive")
            .await
            .expect("posted");
        assert!(r.await.is_err(), "the receive must fail");
        while a.inline_send_error().is_none() {
            sleep(Duration::from_millis(1)).await;
        }
        match a.inline_send_error() {
            Some(SubmitError::InlineSendFailed { status, .. }) => {
                assert_ne!(status, WcStatus::Success);
            }
            other => panic!("expected the inline failure, got {other:?}"),
        }
        // Later ops report it too.
        match a.send_inline(b"again").await {
            Err(Error::Submit {
                source: SubmitError::InlineSendFailed { .. },
                ..
            }) => {}
            other => panic!("expected the recorded failure, got {other:?}"),
        }
        a.close().await.expect("close");
        assert_eq!(a.outstanding_sends(), 0);
    });
}

#[test]
fn close_with_trailing_unsignaled_inline_sends_resolves() {
    let (rt, dev, a, b) = pair(32, 32);
    let pool = MrPool::new(dev.pd());
    block(&rt, async {
        let recvs: Vec<_> = (0..5)
            .map(|_| b.recv(pool.alloc(16).expect("pool")))
            .collect();
        for _ in 0..5 {
            a.send_inline(b"bye").await.expect("inline");
        }
        for (res, _) in join_all(recvs).await {
            res.expect("delivered");
        }
        assert!(a.outstanding_sends() > 0, "unsignaled sends hold credits");
        a.close().await.expect("close");
        assert_eq!(a.outstanding_sends(), 0);
        b.close().await.expect("close");
    });
}

#[test]
fn a_dropped_runtime_delivers_the_inline_sends_it_posted() {
    const N: u64 = 20;
    let (addr, server) = common::serve(1, |mut qps, dev| async move {
        let qp = qps.remove(0);
        let pool = MrPool::new(dev.pd());
        let (res, _) = qp.send(pool.alloc_from(b"go").expect("pool")).await;
        res.expect("go");
        // The client's sends meet no receive (RNR NAKs, retried) until
        // well after it dropped its runtime.
        sleep(Duration::from_millis(100)).await;
        let recvs: Vec<_> = (0..N)
            .map(|_| qp.recv(pool.alloc(16).expect("pool")))
            .collect();
        let got = timeout(Duration::from_secs(5), join_all(recvs))
            .await
            .expect("the client's inline sends were lost with its runtime");
        for (i, (res, got)) in got.into_iter().enumerate() {
            let r = res.unwrap_or_else(|e| panic!("message {i}: {e}"));
            assert_eq!(&got[..r.len], &(i as u64).to_le_bytes());
        }
    });
    let (rt, dev) = common::runtime_and_device();
    let pool = MrPool::new(dev.pd());
    let qp = block(&rt, async {
        let qp = common::dial(&dev, addr).await;
        let (res, _) = qp.recv(pool.alloc(16).expect("pool")).await;
        res.expect("go");
        for i in 0..N {
            qp.send_inline(&i.to_le_bytes()).await.expect("posted");
        }
        qp
    });
    let t = std::time::Instant::now();
    drop(rt);
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "bounded by drain_timeout"
    );
    drop(qp);
    drop(pool);
    drop(dev);
    server.join().expect("server");
}

#[test]
fn try_post_send_inline_posts_only_when_nothing_would_wait() {
    let (rt, dev, a, b) = pair(4, 64);
    let pool = MrPool::new(dev.pd());
    block(&rt, async {
        let recvs: Vec<_> = (0..40)
            .map(|_| b.recv(pool.alloc(16).expect("pool")))
            .collect();
        // Without a turn of the runtime no completion comes back: the send
        // queue (4, or what the device rounded it up to) fills, then `None`,
        // with nothing posted or held.
        let depth = u64::from(a.caps().max_send_wr);
        let mut posted = 0u64;
        while let Some(res) = a.try_post_send_inline(&posted.to_le_bytes(), None) {
            res.expect("posted");
            posted += 1;
            assert!(posted <= depth, "past the send-queue depth");
        }
        assert!(posted >= 1);
        let held = a.outstanding_sends();
        assert!(a.try_post_send_inline(b"x", None).is_none());
        assert_eq!(a.outstanding_sends(), held, "a refused try holds nothing");
        // The awaited path takes over (retiring the unsignaled sends).
        for i in posted..40 {
            a.post_send_inline(&i.to_le_bytes(), None)
                .await
                .expect("posted");
        }
        for (i, (res, got)) in join_all(recvs).await.into_iter().enumerate() {
            let r = res.unwrap_or_else(|e| panic!("recv {i}: {e}"));
            assert_eq!(&got[..r.len], &(i as u64).to_le_bytes(), "message {i}");
        }
        // Errors are the future's to report: a try on a closed QP is `None`.
        a.close().await.expect("close");
        assert!(a.try_post_send_inline(b"late", None).is_none());
        match a.post_send_inline(b"late", None).await {
            Err(SubmitError::Closed { .. }) => {}
            other => panic!("expected Closed, got {other:?}"),
        }
    });
}
