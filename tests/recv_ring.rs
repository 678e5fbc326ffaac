//! The pre-posted receive ring (`RecvRing`) on the software RDMA device (or
//! rxe0 in the VM, `VERBIO_TEST_DEVICE`): messages in order with their
//! bytes and immediates across many reposts, a length error as a typed
//! error, close ending the stream, and a ring dropped with buffers posted
//! kept by the reactor until the QP's flush.

mod common;

use std::time::Duration;

use verbio::ops::connect::{DeviceQps, QpConfig};
use verbio::ops::verbs::Verbs;
use verbio::provider::{QpCaps, WcStatus};
use verbio::runtime::buf::MrPool;
use verbio::runtime::{sleep, Device, QueuePair, RecvRing, RecvRingConfig, RecvRingError, Runtime};

fn pair(depth: u32) -> (Runtime, Device, QueuePair, QueuePair) {
    let (rt, dev) = common::runtime_and_device();
    let config = QpConfig {
        caps: QpCaps {
            max_send_wr: depth,
            max_recv_wr: depth,
            ..QpCaps::default()
        },
        ..QpConfig::default()
    };
    let (a, b) = DeviceQps::new(dev.clone(), config)
        .connected_pair()
        .expect("connected QPs");
    (rt, dev, a, b)
}

#[test]
fn messages_arrive_in_order_with_bytes_and_imm_across_reposts() {
    const DEPTH: u32 = 4;
    const ROUNDS: u32 = 6;
    let (rt, dev, a, b) = pair(16);
    let pool = MrPool::new(dev.pd());
    common::block(&rt, async {
        let mut ring = b.recv_ring(dev.pd(), DEPTH, 64).expect("ring");
        assert_eq!(b.outstanding_recvs(), DEPTH);
        let mut slots = std::collections::HashSet::new();
        for round in 0..ROUNDS {
            // A full ring's worth per round: every buffer is reused.
            for i in 0..DEPTH {
                let n = round * DEPTH + i;
                let data = common::pattern(1 + (n as usize % 60), n as u8);
                let buf = common::buf_from(&pool, &data);
                let (res, _) = if n % 2 == 0 {
                    a.send(buf).await
                } else {
                    a.send_with_imm(buf, 0x1000 + n).await
                };
                res.unwrap_or_else(|e| panic!("send {n}: {e}"));
            }
            for i in 0..DEPTH {
                let n = round * DEPTH + i;
                let m = ring
                    .next()
                    .await
                    .expect("stream ended")
                    .unwrap_or_else(|e| panic!("message {n}: {e}"));
                assert_eq!(&m[..], &common::pattern(1 + (n as usize % 60), n as u8)[..]);
                let want_imm = if n % 2 == 0 { None } else { Some(0x1000 + n) };
                assert_eq!(m.imm(), want_imm, "message {n}");
                slots.insert(m.slot());
                // Dropped here: reposted.
            }
            assert_eq!(ring.posted(), DEPTH, "round {round}: all reposted");
        }
        assert_eq!(slots.len(), DEPTH as usize);
        drop(ring);
        b.close().await.expect("close");
    });
    assert_eq!(rt.ops_in_slab(), 0);
    assert_eq!(rt.receive_rings(), 0);
}

#[test]
fn a_message_longer_than_the_buffer_is_a_typed_error_then_the_stream_ends() {
    let (rt, dev, a, b) = pair(8);
    let pool = MrPool::new(dev.pd());
    common::block(&rt, async {
        let mut ring = b.recv_ring(dev.pd(), 4, 16).expect("ring");
        let (res, _) = a.send(common::buf_from(&pool, b"fits")).await;
        res.expect("short send");
        let ok = ring.next().await.expect("message").expect("ok");
        assert_eq!(&ok[..], b"fits");
        let (res, _) = a.send(common::buf_from(&pool, &[7u8; 100])).await;
        assert!(res.is_err(), "the responder refuses it");
        let e = ring.next().await.expect("an error").unwrap_err();
        match e {
            // Spec (soft device): LOC_LEN_ERR; rxe: LOC_QP_OP_ERR.
            RecvRingError::Completion { qp_num, status, .. } => {
                assert_eq!(qp_num, b.qp_num());
                assert!(
                    matches!(status, WcStatus::LocLenErr | WcStatus::LocQpOpErr),
                    "{status}"
                );
            }
            other => panic!("expected a completion error, got {other}"),
        }
        // The QP is in ERR: the other buffers flush (one flush error is
        // reported), then the stream ends. The held message is not reposted.
        let mut rest = Vec::new();
        while let Some(item) = ring.next().await {
            rest.push(item.map(|m| m.len()).map_err(|e| e.to_string()));
        }
        assert!(rest.len() <= 1, "{rest:?}");
        if let Some(Err(e)) = rest.first() {
            assert!(e.contains("WR_FLUSH_ERR"), "{e}");
        }
        drop(ok);
        assert_eq!(b.outstanding_recvs(), 0);
        b.close().await.expect("close");
    });
}

#[test]
fn close_flushes_the_ring_and_ends_the_stream() {
    let (rt, dev, _a, b) = pair(8);
    common::block(&rt, async {
        let mut ring = b.recv_ring(dev.pd(), 8, 64).expect("ring");
        let closing = b.close();
        let e = ring.next().await.expect("the flush").unwrap_err();
        assert!(
            matches!(
                e,
                RecvRingError::Completion {
                    status: WcStatus::WrFlushErr,
                    ..
                }
            ),
            "{e}"
        );
        assert!(ring.next().await.is_none(), "then the end");
        closing.await.expect("close");
        assert_eq!(ring.posted(), 0);
    });
}

#[test]
fn a_dropped_ring_is_kept_until_the_qp_flushes_its_buffers() {
    let (rt, dev, a, b) = pair(8);
    let pool = MrPool::new(dev.pd());
    let held = common::block(&rt, async {
        let mut ring = RecvRing::new(&b, dev.pd(), RecvRingConfig::new(4, 64)).expect("ring");
        a.send(common::buf_from(&pool, b"kept"))
            .await
            .0
            .expect("send");
        let held = ring.next().await.expect("message").expect("ok");
        drop(ring);
        held
    });
    assert_eq!(rt.receive_rings(), 1, "3 buffers still posted");
    assert_eq!(b.outstanding_recvs(), 3);
    common::block(&rt, async {
        // A message landing in the dropped ring is taken and discarded.
        a.send(common::buf_from(&pool, b"lost"))
            .await
            .0
            .expect("send");
        while b.outstanding_recvs() != 2 {
            sleep(Duration::from_millis(5)).await;
        }
    });
    assert_eq!(rt.receive_rings(), 1);
    common::block(&rt, async { b.close().await.expect("close") });
    assert_eq!(rt.receive_rings(), 0, "released after the flush");
    // The guard outlives the ring and keeps its bytes.
    assert_eq!(&held[..], b"kept");
    drop(held);
    assert_eq!(rt.ops_in_slab(), 0);
}
