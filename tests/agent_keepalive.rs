//! The `Rdma` keepalive (`RdmaBuilder::keepalive`, issue 31 item 4): an
//! idle connection probes its peer once per interval with a zero-length
//! WRITE, which disturbs nothing (messages still flow, every byte
//! checked); a busy connection sends no probe; `None` turns it off; a zero
//! interval is refused.

mod common;

use std::time::{Duration, Instant};

use common::*;
use verbio::runtime::sleep;
use verbio::{AgentError, RdmaBuilder};

fn every(d: Option<Duration>) -> RdmaBuilder {
    RdmaBuilder::new()
        .recv_buf_size(256)
        .recv_buf_count(8)
        .credit_batch(2)
        .staging_ring(0)
        .keepalive(d)
}

/// Waits (a sleep of `every` at a time, at most `WAIT`) until `probes()`
/// reads at least two: an idle connection probes once per interval, so
/// two come after about three intervals, or later on a stalled host.
async fn two_probes(side: &str, every: Duration, probes: impl Fn() -> u64) -> u64 {
    let start = Instant::now();
    while probes() < 2 {
        assert!(
            start.elapsed() < WAIT,
            "the idle {side} sent {} probes in {WAIT:?} (one every {every:?} expected)",
            probes()
        );
        sleep(every).await;
    }
    probes()
}

#[test]
fn an_idle_connection_probes_and_keeps_working() {
    const EVERY: Duration = Duration::from_millis(50);
    let (addr, server) = serve_rdma(
        || every(Some(EVERY)),
        1,
        |conns| async move {
            let r = &conns[0];
            // Idle (the client's message, when it comes, counts as
            // something received once): probes by the interval.
            let probes = two_probes("server", EVERY, || r.keepalive_probes()).await;
            let m = r.receive().await.expect("message after the idle time");
            r.send(&m).await.expect("echo");
            probes
        },
    );
    let (rt, dev) = runtime_and_device();
    let idle_probes = block(&rt, async {
        let c = dial_rdma(every(Some(EVERY)), &dev, addr).await;
        let probes = two_probes("client", EVERY, || c.keepalive_probes()).await;
        // The probes disturbed nothing: a message goes and comes back.
        let m = pattern(100, 7);
        c.send(&m).await.expect("send after probes");
        assert_eq!(c.receive().await.expect("echo"), m);
        probes
    });
    let server_probes = server.join().expect("server");
    assert!(idle_probes >= 2, "client sent {idle_probes} probes");
    assert!(server_probes >= 2, "server sent {server_probes} probes");
}

#[test]
fn a_busy_connection_sends_no_probe_and_none_turns_it_off() {
    const EVERY: Duration = Duration::from_secs(1);
    const BUSY: Duration = Duration::from_millis(2500);
    let (addr, server) = serve_rdma(
        || every(Some(EVERY)),
        1,
        |conns| async move {
            let r = &conns[0];
            while let Ok(m) = r.receive().await {
                if r.send(&m).await.is_err() {
                    break;
                }
            }
            r.keepalive_probes()
        },
    );
    let (rt, dev) = runtime_and_device();
    let probes = block(&rt, async {
        let c = dial_rdma(every(Some(EVERY)), &dev, addr).await;
        let start = Instant::now();
        let mut i = 0usize;
        while start.elapsed() < BUSY {
            let m = pattern(1 + i % 200, i as u8);
            c.send(&m).await.expect("send");
            assert_eq!(c.receive().await.expect("echo"), m, "round {i}");
            i += 1;
            // A round every few ms: far more often than the interval.
            sleep(Duration::from_millis(5)).await;
        }
        c.keepalive_probes()
    });
    drop(rt);
    let server_probes = server.join().expect("server");
    assert_eq!(probes, 0, "the busy client probed");
    assert_eq!(server_probes, 0, "the busy server probed");

    // Off: an idle connection sends nothing.
    let (addr, server) = serve_rdma(
        || every(None),
        1,
        |conns| async move {
            sleep(Duration::from_millis(300)).await;
            conns[0].keepalive_probes()
        },
    );
    let (rt, dev) = runtime_and_device();
    let off = block(&rt, async {
        let c = dial_rdma(every(None), &dev, addr).await;
        sleep(Duration::from_millis(300)).await;
        c.keepalive_probes()
    });
    assert_eq!((off, server.join().expect("server")), (0, 0));
}

#[test]
fn a_zero_interval_is_refused() {
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        match every(Some(Duration::ZERO))
            .device(dev)
            .connect("127.0.0.1:9".parse().unwrap())
            .await
        {
            Err(AgentError::Config { setting, .. }) => assert_eq!(setting, "keepalive"),
            other => panic!("expected a Config error, got {:?}", other.err()),
        }
    });
}
