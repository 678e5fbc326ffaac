//! Receive memory of many connections with and without a shared receive
//! queue (software device): with a receive ring per QP it grows with the
//! number of QPs; with one ring on an SRQ feeding them all it stays what
//! the ring allocated, whatever their number. The last QP of the largest
//! set is connected and receives through it, so the SRQ figure is that of
//! a working setup. Prints the figures (`--nocapture`).

mod common;

use verbio::ops::connect::{DeviceQps, QpConfig, QpFactory};
use verbio::ops::verbs::Verbs;
use verbio::provider::{Context, InitAttr, QpCaps, SoftConfig};
use verbio::runtime::buf::MrPool;
use verbio::runtime::{Device, RecvRing, RecvRingConfig, Runtime};

/// Each connection's own ring: 16 buffers of 4 KiB (the agent posts
/// `DEFAULT_RECV_BUF_COUNT`, 128, by default: eight times this).
const PER_QP_DEPTH: u32 = 16;
/// The shared ring: 256 buffers of 4 KiB for all connections.
const SRQ_DEPTH: u32 = 256;
const BUF: usize = 4096;

fn caps() -> QpCaps {
    QpCaps {
        max_send_wr: 4,
        max_recv_wr: PER_QP_DEPTH,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    }
}

/// Receive memory of `n` QPs with a ring each.
fn per_qp(n: u32) -> usize {
    let rt = Runtime::new().expect("runtime");
    let ctx = Context::open_soft(SoftConfig::default()).expect("soft device");
    let dev = Device::with_cq_size(ctx, n * PER_QP_DEPTH + 64).expect("device");
    rt.block_on(async {
        let mut rings = Vec::new();
        for _ in 0..n {
            let qp = dev.create_qp(caps()).expect("QP");
            qp.modify_to_init(&InitAttr::default()).expect("INIT");
            rings.push(qp.recv_ring(dev.pd(), PER_QP_DEPTH, BUF).expect("ring"));
        }
        rings.iter().map(RecvRing::memory_len).sum()
    })
}

/// Receive memory of `n` QPs on one SRQ; the last one receives a message
/// from a peer QP through it.
fn on_srq(n: u32) -> usize {
    let rt = Runtime::new().expect("runtime");
    let ctx = Context::open_soft(SoftConfig::default()).expect("soft device");
    let dev = Device::with_cq_size(ctx, SRQ_DEPTH + 64).expect("device");
    rt.block_on(async {
        let srq = dev.create_srq(SRQ_DEPTH).expect("SRQ");
        let mut ring =
            RecvRing::on_srq(&srq, dev.pd(), RecvRingConfig::new(SRQ_DEPTH, BUF)).expect("ring");
        let mut qps = Vec::new();
        for _ in 0..n {
            let qp = dev.create_qp_on_srq(&srq, caps()).expect("QP on the SRQ");
            qp.modify_to_init(&InitAttr::default()).expect("INIT");
            qps.push(qp);
        }
        let last = qps.last().expect("n > 0");
        let factory = DeviceQps::new(dev.clone(), QpConfig::default());
        let (peer, ep) = factory.create().expect("peer QP");
        let el = last.endpoint(0).expect("endpoint");
        factory.connect(last, &el, &ep).expect("connect");
        factory.connect(&peer, &ep, &el).expect("connect peer");
        let pool = MrPool::new(dev.pd());
        let (res, _) = peer
            .send(pool.alloc_from(b"through the SRQ").expect("buf"))
            .await;
        res.expect("send");
        let m = ring.next().await.expect("open").expect("message");
        assert_eq!(
            (&m[..], m.qp_num()),
            (&b"through the SRQ"[..], last.qp_num())
        );
        ring.memory_len()
    })
}

#[test]
fn receive_memory_of_1000_connections_with_and_without_srq() {
    let mut srq_bytes = Vec::new();
    for n in [10u32, 100, 1000] {
        let own = per_qp(n);
        let shared = on_srq(n);
        println!(
            "{n:>5} QPs: a ring each {:>9} KiB, one SRQ ring {:>6} KiB, ratio {:.1}",
            own / 1024,
            shared / 1024,
            own as f64 / shared as f64
        );
        assert_eq!(
            own,
            n as usize * PER_QP_DEPTH as usize * BUF,
            "{n} QPs: linear"
        );
        srq_bytes.push(shared);
    }
    assert_eq!(srq_bytes[0], SRQ_DEPTH as usize * BUF);
    assert!(
        srq_bytes.iter().all(|&b| b == srq_bytes[0]),
        "SRQ memory independent of the QP count: {srq_bytes:?}"
    );
}
