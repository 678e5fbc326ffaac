//! The agent on a listener's shared receive queue
//! (`RdmaBuilder::shared_receive_queue`), soft device: many connections'
//! messages arrive whole and in order through one SRQ of fewer buffers
//! than their credits add up to, control traffic (credits) included, and a
//! connection that ends leaves the others running.

mod common;

use common::*;
use verbio::runtime::timeout;
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

#[test]
fn an_immediate_and_a_hand_back_reach_a_connection_on_the_srq() {
    // `receive_write_imm` on a connection on the SRQ took the next
    // message from a receive ring of its own, which it has not: the
    // connection went down ("closed locally") at the first immediate.
    let (tx, rx) = std::sync::mpsc::channel();
    let (addr, server) = serve_rdma(srq_builder, 1, move |mut c| async move {
        let r = c.remove(0);
        assert!(r.on_shared_receive_queue());
        let imm = r.receive_write_imm().await.expect("immediate");
        let mem = r.receive_local_mr().await.expect("hand-back");
        let after = r.receive().await.expect("message after");
        tx.send((imm, mem, after)).unwrap();
        r.send(b"done").await.expect("done");
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let remote = r.request_remote_mr(32).await.expect("grant");
        let mut data = r.alloc_local_mr(32).unwrap();
        data.fill(0x5a);
        let (res, _) = r.write_with_imm(data, &remote, 0xfeed).await;
        res.expect("write_with_imm");
        r.send_remote_mr(remote).await.expect("hand back");
        r.send(b"after").await.expect("send");
        assert_eq!(r.receive().await.expect("done"), b"done");
    });
    let (imm, mem, after) = rx.recv_timeout(WAIT).expect("server's findings");
    assert_eq!(imm, 0xfeed);
    assert_eq!(mem, vec![0x5a; 32]);
    assert_eq!(after, b"after");
    server.join().expect("server");
}

/// Messages a departing peer sends right before it leaves.
const TRAILING: u8 = 20;

async fn send_trailing(r: &verbio::Rdma) {
    for i in 0..TRAILING {
        r.send(&pattern(100, i)).await.expect("trailing message");
    }
}

/// Serves one connection on the SRQ whose `receive` must end with the
/// peer's departure, within a bound, and whose later calls fail at once.
fn serve_one_expecting_departure() -> (std::net::SocketAddr, std::thread::JoinHandle<()>) {
    serve_rdma(srq_builder, 1, |mut c| async move {
        let r = c.remove(0);
        assert!(r.on_shared_receive_queue());
        assert_eq!(r.receive().await.expect("hello"), b"hello");
        // What the peer sent before it left arrives, then the departure.
        let mut got = 0;
        let e = loop {
            match timeout(WAIT / 2, r.receive())
                .await
                .expect("receive on the SRQ must end when the peer leaves")
            {
                Ok(m) => {
                    assert_eq!(m, pattern(100, got), "message {got} after hello");
                    got += 1;
                }
                Err(e) => break e,
            }
        };
        assert!(got <= TRAILING, "{got} messages after hello");
        assert!(e.close_reason().is_some(), "{e}");
        let e = timeout(WAIT / 4, r.send(b"x"))
            .await
            .expect("a send after the peer left must not hang")
            .unwrap_err();
        assert!(e.close_reason().is_some(), "{e}");
    })
}

#[test]
fn a_connection_on_the_srq_notices_its_peer_closing() {
    let (addr, server) = serve_one_expecting_departure();
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        r.send(b"hello").await.expect("hello");
        send_trailing(&r).await;
        // Dropped on its runtime: the connection says goodbye (`Close`).
        drop(r);
        verbio::runtime::sleep(std::time::Duration::from_millis(200)).await;
    });
    server.join().expect("server");
}

#[test]
fn a_connection_on_the_srq_notices_its_peer_vanishing() {
    let (addr, server) = serve_one_expecting_departure();
    let (rt, dev) = runtime_and_device();
    let r = block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        r.send(b"hello").await.expect("hello");
        send_trailing(&r).await;
        r
    });
    // Dropped off its runtime, then the runtime and device go: no goodbye,
    // the side channel just closes.
    drop(r);
    drop(rt);
    drop(dev);
    server.join().expect("server");
}
