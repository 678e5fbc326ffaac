//! A receive ring on a shared receive queue (`RecvRing::on_srq`) feeding
//! many RC QPs, on the software device (or rxe0 in the VM,
//! `VERBIO_TEST_DEVICE`): every message arrives once with its bytes and
//! the QP it came in on, buffers are reused across QPs, and the SRQ-limit
//! event reposts released buffers before the SRQ runs dry.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use verbio::ops::connect::{DeviceQps, QpConfig, QpFactory};
use verbio::ops::verbs::Verbs;
use verbio::provider::InitAttr;
use verbio::runtime::buf::MrPool;
use verbio::runtime::{sleep, Device, QueuePair, RecvRing, RecvRingConfig, SharedRecvQueue};

/// `n` plain RC QPs (the senders) connected to `n` RC QPs on `srq`.
fn connect_on_srq(dev: &Device, srq: &SharedRecvQueue, n: usize) -> Vec<(QueuePair, QueuePair)> {
    let qps = DeviceQps::new(dev.clone(), QpConfig::default());
    let gid = dev.context().default_gid_index(1).expect("GID index");
    (0..n)
        .map(|_| {
            let (sender, es) = qps.create().expect("sender QP");
            let receiver = dev
                .create_qp_on_srq(srq, QpConfig::default().caps)
                .expect("QP on the SRQ");
            receiver.modify_to_init(&InitAttr::default()).expect("INIT");
            let er = receiver.endpoint(gid).expect("endpoint");
            qps.connect(&sender, &es, &er).expect("connect sender");
            qps.connect(&receiver, &er, &es).expect("connect receiver");
            (sender, receiver)
        })
        .collect()
}

#[test]
fn one_ring_serves_many_qps_and_names_each_message_qp() {
    const QPS: usize = 8;
    const PER_QP: usize = 12;
    let (rt, dev) = common::runtime_and_device();
    let pool = MrPool::new(dev.pd());
    common::block(&rt, async {
        let srq = dev.create_srq(64).expect("SRQ");
        let mut ring =
            RecvRing::on_srq(&srq, dev.pd(), RecvRingConfig::new(16, 128)).expect("ring");
        assert_eq!(srq.posted(), 16);
        assert!(ring.queue_pair().is_none());
        let pairs = connect_on_srq(&dev, &srq, QPS);
        let index: HashMap<u32, usize> = pairs
            .iter()
            .enumerate()
            .map(|(i, (_, r))| (r.qp_num(), i))
            .collect();
        // Round robin over the senders: more messages than buffers, so
        // every buffer serves several QPs.
        let mut next_seq = [0usize; QPS];
        let mut slots_of = vec![std::collections::HashSet::new(); QPS];
        for k in 0..PER_QP {
            for (i, (sender, _)) in pairs.iter().enumerate() {
                let data = common::pattern(16 + (k + i) % 100, (i * 31 + k) as u8);
                let (res, _) = sender.send(common::buf_from(&pool, &data)).await;
                res.unwrap_or_else(|e| panic!("send {k} on QP {i}: {e}"));
            }
            for _ in 0..QPS {
                let m = ring
                    .next()
                    .await
                    .expect("stream ended")
                    .unwrap_or_else(|e| panic!("message: {e}"));
                let i = *index
                    .get(&m.qp_num())
                    .unwrap_or_else(|| panic!("message on unknown QP {}", m.qp_num()));
                let seq = next_seq[i];
                next_seq[i] += 1;
                assert_eq!(
                    &m[..],
                    &common::pattern(16 + (seq + i) % 100, (i * 31 + seq) as u8)[..],
                    "QP {i} message {seq}"
                );
                slots_of[i].insert(m.slot());
            }
        }
        assert_eq!(next_seq, [PER_QP; QPS]);
        assert!(
            slots_of.iter().all(|s| s.len() > 1),
            "buffers shared across QPs: {slots_of:?}"
        );
        assert_eq!(ring.posted(), 16, "all reposted");
        for (s, r) in &pairs {
            s.close().await.expect("close sender");
            r.close().await.expect("close receiver");
        }
        assert_eq!(ring.posted(), 16, "an SRQ's buffers outlive its QPs");
    });
}

#[test]
fn the_limit_event_reposts_released_buffers() {
    let (rt, dev) = common::runtime_and_device();
    let pool = MrPool::new(dev.pd());
    common::block(&rt, async {
        let srq = dev.create_srq(16).expect("SRQ");
        // Reposts wait for a batch of 8; the limit is 3 buffers.
        let config = RecvRingConfig::new(8, 64).repost_batch(8).srq_limit(3);
        let mut ring = RecvRing::on_srq(&srq, dev.pd(), config).expect("ring");
        let pairs = connect_on_srq(&dev, &srq, 2);
        let send = |i: usize, n: u8| {
            let buf = common::buf_from(&pool, &[n; 32]);
            let qp = pairs[i].0.clone();
            async move {
                let (res, _) = qp.send(buf).await;
                res.expect("send");
            }
        };
        // 8 -> 4 posted: at or above the limit.
        for n in 0..4 {
            send(n as usize % 2, n).await;
        }
        for n in 0..4u8 {
            let m = ring.next().await.expect("open").expect("message");
            assert_eq!(&m[..], &[n; 32][..]);
            // Released: pending until a batch of 8 (or the event).
        }
        assert_eq!(ring.posted(), 4);
        assert_eq!(ring.limit_events(), 0);
        // 4 -> 3 -> 2: below the limit; the event reposts the 4 released.
        send(0, 4).await;
        send(1, 5).await;
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while ring.limit_events() == 0 {
            assert!(std::time::Instant::now() < deadline, "no limit event");
            sleep(Duration::from_millis(2)).await;
        }
        assert_eq!(ring.posted(), 6, "2 posted + 4 reposted by the event");
        assert_eq!(
            srq.provider().attr().expect("query").srq_limit,
            3,
            "re-armed"
        );
        for n in 4..6u8 {
            let m = ring.next().await.expect("open").expect("message");
            assert_eq!(&m[..], &[n; 32][..]);
            assert_eq!(m.qp_num(), pairs[n as usize % 2].1.qp_num());
        }
    });
}

/// A ring dropped with buffers posted keeps them, and its memory, while a
/// QP on its SRQ could still receive into them (a message that lands is
/// discarded), and frees them as soon as none can: its QPs closed and the
/// SRQ's last handle dropped (issue 31). Before, the memory stayed until
/// the runtime shut down.
#[test]
fn a_dropped_ring_frees_its_memory_once_no_qp_can_reach_its_srq() {
    let (rt, dev) = common::runtime_and_device();
    let pool = MrPool::new(dev.pd());
    common::block(&rt, async {
        let srq = dev.create_srq(64).expect("SRQ");
        let ring = RecvRing::on_srq(&srq, dev.pd(), RecvRingConfig::new(16, 128)).expect("ring");
        let pairs = connect_on_srq(&dev, &srq, 2);
        let rings = rt.receive_rings();
        drop(ring);
        assert_eq!(rt.receive_rings(), rings, "16 buffers posted: kept");
        // A message still lands in one (and is discarded).
        let (res, _) = pairs[0].0.send(common::buf_from(&pool, b"late")).await;
        res.expect("send into a dropped ring's buffer");
        assert_eq!(srq.posted(), 15);
        // Without the application's handle, the QPs still reach the SRQ.
        drop(srq);
        sleep(Duration::from_millis(20)).await;
        assert_eq!(rt.receive_rings(), rings, "QPs on the SRQ: kept");
        for (s, r) in pairs {
            s.close().await.expect("close sender");
            r.close().await.expect("close receiver");
        }
        // (The closed QPs are destroyed once the reactor reaps them.)
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while rt.receive_rings() == rings {
            assert!(
                std::time::Instant::now() < deadline,
                "the dropped ring's memory is still held with no QP on its SRQ"
            );
            sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(rt.receive_rings(), rings - 1);
    });
}
