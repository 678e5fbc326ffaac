//! UD queue pairs through the runtime on the software RDMA device (or rxe0
//! in the VM, `VERBIO_TEST_DEVICE`): datagrams with their payload, immediate
//! and source, inline sends and bursts with one doorbell, selective
//! signaling whose retiring WR never reaches anyone, a wrong Q_Key or a
//! missing receive as silent loss, and RC-only verbs refused.

mod common;

use std::time::Duration;

use verbio::ops::verbs::{RemoteBuf, Verbs};
use verbio::provider::{QpCaps, QpType, UdAttr};
use verbio::runtime::buf::MrPool;
use verbio::runtime::{
    timeout, Datagram, Device, QueuePair, RecvRing, Runtime, UdEndpoint, UdPeer,
};

const QKEY: u32 = 0x1111_1111;

fn ud_qp(dev: &Device, depth: u32) -> QueuePair {
    let caps = QpCaps {
        max_send_wr: depth,
        max_recv_wr: depth,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 64,
    };
    let attr = UdAttr {
        qkey: QKEY,
        ..UdAttr::default()
    };
    dev.create_ud_qp(caps, &attr).expect("UD QP")
}

fn gid_index(dev: &Device) -> u8 {
    dev.context().default_gid_index(1).expect("gid index")
}

fn endpoint(dev: &Device, qp: &QueuePair) -> UdEndpoint {
    qp.ud_endpoint(gid_index(dev)).expect("UD endpoint")
}

/// Two UD QPs on one device, `b` with a receive ring of `ring_depth`
/// buffers of 256 bytes; `a`'s peer naming `b`.
fn pair(depth: u32, ring_depth: u32) -> (Runtime, Device, QueuePair, QueuePair, UdPeer, RecvRing) {
    let (rt, dev) = common::runtime_and_device();
    let (a, b, peer, ring) = common::block(&rt, async {
        let a = ud_qp(&dev, depth);
        let b = ud_qp(&dev, depth.max(ring_depth));
        let ring = b.recv_ring(dev.pd(), ring_depth, 256).expect("ring");
        let peer = a.ud_peer(&endpoint(&dev, &b)).expect("peer");
        (a, b, peer, ring)
    });
    (rt, dev, a, b, peer, ring)
}

const QUIET: Duration = Duration::from_millis(300);

#[test]
fn datagrams_arrive_with_payload_imm_and_source() {
    let (rt, dev, a, b, peer, mut ring) = pair(16, 16);
    let pool = MrPool::new(dev.pd());
    common::block(&rt, async {
        assert_eq!((a.qp_type(), b.qp_type()), (QpType::Ud, QpType::Ud));
        let me = endpoint(&dev, &a);
        for n in 0..40u32 {
            let data = common::pattern(1 + (n as usize * 7) % 200, n as u8);
            let buf = common::buf_from(&pool, &data);
            let (res, _) = if n % 2 == 0 {
                a.send_to(&peer, buf).await
            } else {
                a.send_to_with_imm(&peer, buf, 0xbeef_0000 + n).await
            };
            assert_eq!(
                res.unwrap_or_else(|e| panic!("send_to {n}: {e}")),
                data.len()
            );
            let m = timeout(Duration::from_secs(5), ring.next())
                .await
                .expect("datagram in time")
                .expect("ring open")
                .expect("datagram");
            assert_eq!(&m[..], &data[..], "datagram {n}");
            assert_eq!(m.imm(), (n % 2 == 1).then_some(0xbeef_0000 + n));
            let src = m.source().expect("source");
            assert_eq!(src.qpn, a.qp_num());
            assert_eq!(src.gid, Some(me.endpoint.gid), "GRH source GID");
        }
    });
}

#[test]
fn inline_sends_and_bursts_use_one_doorbell_and_selective_signals() {
    const N: u32 = 200;
    let (rt, dev, a, _b, peer, mut ring) = pair(8, 256);
    common::block(&rt, async {
        a.set_inline_signal_interval(64);
        // More inline datagrams than the send queue holds: unsignaled ones
        // are retired by a refused datagram to `a` itself.
        for n in 0..N {
            a.post_send_inline_to(&peer, &n.to_le_bytes(), None)
                .await
                .unwrap_or_else(|e| panic!("inline {n}: {e}"));
            let m = timeout(Duration::from_secs(5), ring.next())
                .await
                .expect("datagram in time")
                .expect("open")
                .expect("datagram");
            assert_eq!(&m[..], &n.to_le_bytes());
        }
        // A burst alternating two peer handles made from one endpoint.
        let other = a.ud_peer(peer.endpoint()).expect("same peer again");
        assert_eq!(other.dest(), peer.dest(), "address handles are cached");
        let payloads: Vec<[u8; 4]> = (0..6u32).map(|i| (1000 + i).to_le_bytes()).collect();
        let burst: Vec<Datagram<'_>> = payloads
            .iter()
            .enumerate()
            .map(|(i, p)| Datagram {
                peer: if i % 2 == 0 { &peer } else { &other },
                data: p,
                imm: Some(i as u32),
            })
            .collect();
        // The unsignaled sends before it are retired first (a doorbell of
        // its own), so the burst finds the send queue free.
        a.sends_idle().await;
        let before = verbio::runtime::Handle::current().stats().doorbells;
        a.post_send_inline_burst(&burst).await.expect("burst");
        let after = verbio::runtime::Handle::current().stats().doorbells;
        assert_eq!(after - before, 1, "one doorbell for the burst");
        for (i, p) in payloads.iter().enumerate() {
            let m = timeout(Duration::from_secs(5), ring.next())
                .await
                .expect("burst datagram in time")
                .expect("open")
                .expect("datagram");
            assert_eq!((&m[..], m.imm()), (&p[..], Some(i as u32)));
        }
        a.sends_idle().await;
        assert!(a.inline_send_error().is_none());
    });
    // The retiring datagrams were refused by `a`: it never had receives.
    drop(dev);
}

#[test]
fn a_wrong_qkey_or_no_receive_loses_the_datagram_silently() {
    let (rt, dev, a, b, _peer, mut ring) = pair(16, 1);
    let pool = MrPool::new(dev.pd());
    common::block(&rt, async {
        let mut wrong = endpoint(&dev, &b);
        wrong.qkey ^= 0x10;
        let stranger = a.ud_peer(&wrong).expect("peer with a wrong Q_Key");
        let (res, _) = a.send_to(&stranger, common::buf_from(&pool, b"lost")).await;
        res.expect("a UD send completes even if nobody takes it");
        assert!(
            timeout(QUIET, ring.next()).await.is_err(),
            "wrong Q_Key dropped"
        );
        // The ring has one buffer: two datagrams, one lost, then the ring
        // takes the next once its buffer is back.
        let right = a.ud_peer(&endpoint(&dev, &b)).expect("peer");
        for word in [b"one", b"two"] {
            let (res, _) = a.send_to(&right, common::buf_from(&pool, word)).await;
            res.expect("send");
        }
        let m = timeout(Duration::from_secs(5), ring.next())
            .await
            .expect("first in time")
            .expect("open")
            .expect("datagram");
        assert_eq!(&m[..], b"one");
        drop(m);
        assert!(
            timeout(QUIET, ring.next()).await.is_err(),
            "no receive posted: lost"
        );
        let (res, _) = a.send_to(&right, common::buf_from(&pool, b"three")).await;
        res.expect("send");
        let m = timeout(Duration::from_secs(5), ring.next())
            .await
            .expect("third in time")
            .expect("open")
            .expect("datagram");
        assert_eq!(&m[..], b"three");
    });
}

#[test]
fn rc_only_verbs_and_oversized_datagrams_are_refused() {
    let (rt, dev, a, _b, peer, _ring) = pair(16, 4);
    let pool = MrPool::new(dev.pd());
    common::block(&rt, async {
        let remote = RemoteBuf::new(0x1000, 64, 1);
        let (res, _) = a.write(common::buf_from(&pool, b"x"), remote).await;
        assert!(res.is_err(), "RDMA WRITE on a UD QP");
        let res = a.post_send_inline(b"no peer", None).await;
        assert!(res.is_err(), "a UD send without a peer");
        let mtu = dev
            .context()
            .query_port(1)
            .expect("port")
            .active_mtu
            .bytes() as usize;
        let big = common::buf_from(&pool, &vec![7u8; mtu + 1]);
        let (res, _) = a.send_to(&peer, big).await;
        let e = res.expect_err("a datagram larger than the MTU");
        println!("oversized datagram: {e}");
        // The QP still works.
        let (res, _) = a.send_to(&peer, common::buf_from(&pool, b"ok")).await;
        res.expect("send after the refusal");
    });
}
