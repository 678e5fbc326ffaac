//! The agent on a listener's shared receive queue
//! (`RdmaBuilder::shared_receive_queue`), soft device: many connections'
//! messages arrive whole and in order through one SRQ of fewer buffers
//! than their credits add up to, control traffic (credits) included, and a
//! connection that ends leaves the others running.

mod common;

use common::*;
use verbio::RdmaBuilder;

const CONNS: usize = 6;
const EACH: usize = 40;

fn srq_builder() -> RdmaBuilder {
    RdmaBuilder::new()
        .shared_receive_queue(24)
        .recv_buf_size(512)
        .recv_buf_count(8)
        .credit_batch(2)
}

#[test]
fn connections_of_a_listener_share_one_srq() {
    let (addr, server) = serve_rdma(srq_builder, CONNS, |conns| async move {
        // Echo every message of every connection, round robin.
        for k in 0..EACH {
            for (i, r) in conns.iter().enumerate() {
                let m = r
                    .receive()
                    .await
                    .unwrap_or_else(|e| panic!("conn {i} msg {k}: {e}"));
                assert_eq!(
                    m,
                    pattern(1 + (i * 7 + k) % 1500, (i + k) as u8),
                    "conn {i} msg {k}"
                );
                r.send(&m).await.expect("echo");
            }
        }
        // One connection leaves; the others still work.
        let mut conns = conns.into_iter();
        drop(conns.next());
        for r in conns {
            let m = r.receive().await.expect("after one left");
            r.send(&m).await.expect("echo after one left");
        }
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let mut clients = Vec::new();
        for _ in 0..CONNS {
            clients.push(
                dial_rdma(
                    RdmaBuilder::new()
                        .recv_buf_size(512)
                        .recv_buf_count(8)
                        .credit_batch(2),
                    &dev,
                    addr,
                )
                .await,
            );
        }
        for k in 0..EACH {
            // Messages of up to 1.5 KB: larger ones are split into
            // buffer-sized pieces and reassembled.
            for (i, c) in clients.iter().enumerate() {
                c.send(&pattern(1 + (i * 7 + k) % 1500, (i + k) as u8))
                    .await
                    .expect("send");
            }
            for (i, c) in clients.iter().enumerate() {
                let back = c.receive().await.expect("echo");
                assert_eq!(
                    back,
                    pattern(1 + (i * 7 + k) % 1500, (i + k) as u8),
                    "echo {i} {k}"
                );
            }
        }
        for c in &clients[1..] {
            c.send(b"after").await.expect("send after one left");
            assert_eq!(c.receive().await.expect("echo after one left"), b"after");
        }
    });
    server.join().expect("server");
}

#[test]
fn a_zero_depth_srq_is_refused() {
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let err = RdmaBuilder::new()
            .shared_receive_queue(0)
            .device(dev)
            .listen("127.0.0.1:0".parse().unwrap())
            .expect_err("depth 0");
        assert!(matches!(err, verbio::AgentError::Config { .. }), "{err:?}");
    });
}
