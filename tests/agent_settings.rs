//! The agent settings exchange when a high-level `Rdma` connection starts
//! (soft device, two runtimes on two threads): different receive-buffer
//! sizes and maximum message lengths are negotiated; settings whose receive
//! queues cannot work together, and a peer speaking another agent protocol
//! version, are refused at connect time with clear errors on both sides.

mod common;

use std::sync::mpsc;

use common::*;
use verbio::ops::agent::wire::{Message, Settings, WireError, MAGIC};
use verbio::ops::connect::Listener;
use verbio::runtime::timeout;
use verbio::{AgentError, CloseReason, RdmaBuilder};

#[test]
fn buffer_sizes_and_message_limits_are_negotiated() {
    let small = || {
        RdmaBuilder::new()
            .recv_buf_size(256)
            .max_message_len(10_000)
    };
    let data = pattern(9_000, 6);
    let data2 = data.clone();
    let (addr, server) = serve_rdma(small, 1, move |mut c| async move {
        let r = c.remove(0);
        assert_eq!(r.max_send_len(), 10_000, "the smaller maximum");
        // The client's 4096-byte buffers take this side's 9000 bytes in
        // three pieces; this side's 256-byte buffers take the client's in
        // ~42 pieces (were the client to size pieces for its own buffers,
        // its first piece would not fit here and the connection would fail).
        let got = timeout(WAIT, r.receive()).await.expect("bounded").unwrap();
        assert_eq!(got, data2);
        r.send(&got).await.unwrap();
        let _ = timeout(WAIT, r.receive()).await;
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        assert_eq!(r.max_send_len(), 10_000, "the peer's smaller maximum");
        // Beyond the peer's maximum: refused here, the connection lives on.
        let too_long = vec![0u8; 10_001];
        let e = r.send(&too_long).await.unwrap_err();
        assert!(
            matches!(
                e,
                AgentError::MessageTooLarge {
                    len: 10_001,
                    max: 10_000
                }
            ),
            "{e}"
        );
        r.send(&data).await.unwrap();
        assert_eq!(r.receive().await.unwrap(), data, "echo");
        assert!(r.close_reason().is_none(), "{:?}", r.close_reason());
        r.send(b"bye").await.unwrap();
    });
    server.join().expect("server");
}

#[test]
fn receive_queues_that_cannot_hold_the_reserve_are_refused_on_both_sides() {
    // The server returns credits one by one for 64 buffers: the client
    // would need 64 / 1 + 3 reserve buffers beyond its own 4, but its
    // receive queue holds 4 + (4 + 3).
    let server_side = || {
        RdmaBuilder::new()
            .recv_buf_count(64)
            .credit_batch(1)
            .max_recv_wr(256)
    };
    let (tx, rx) = mpsc::channel();
    let th = std::thread::spawn(move || {
        let (rt, dev) = runtime_and_device();
        block(&rt, async move {
            let l = server_side()
                .device(dev)
                .listen("127.0.0.1:0".parse().unwrap())
                .expect("listen");
            tx.send(l.local_addr().unwrap()).unwrap();
            let refused = l.accept().await.err().map(|e| e.to_string());
            // The listener keeps accepting: a compatible client connects.
            let ok = l.accept().await.expect("a compatible client");
            let m = timeout(WAIT, ok.receive()).await.expect("bounded");
            (refused, m.unwrap())
        })
    });
    let addr = rx.recv_timeout(WAIT).expect("server start");
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let e = RdmaBuilder::new()
            .recv_buf_count(4)
            .credit_batch(4)
            .max_recv_wr(8)
            .device(dev.clone())
            .connect(addr)
            .await
            .unwrap_err();
        match &e {
            AgentError::Incompatible {
                setting: "max_recv_wr",
                local,
                peer,
                ..
            } => {
                // This side's QP: 4 buffers, a reserve of 7 for a peer of 4
                // returning credits one by one, 2 spare ring slots for lent
                // messages.
                assert_eq!((*local, *peer), (4 + 7 + 2, 4 + 64 + 3), "{e}");
            }
            other => panic!("expected an incompatible setting, got {other}"),
        }
        let ok = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        ok.send(b"compatible").await.unwrap();
    });
    let (refused, got) = th.join().expect("server");
    let refused = refused.expect("the server refused the first client");
    assert!(
        refused.contains("max_recv_wr") && refused.contains("peer's receive queue"),
        "{refused}"
    );
    assert_eq!(got, b"compatible");
}

#[test]
fn a_peer_speaking_another_agent_version_is_refused() {
    // A raw endpoint listener stands in for a version-1 agent: after the
    // (version-independent) endpoint handshake it sends a settings frame
    // with version 1 in its header.
    let (tx, rx) = mpsc::channel();
    let th = std::thread::spawn(move || {
        let (rt, dev) = runtime_and_device();
        let l: Listener<_> = listen(&dev);
        tx.send(l.local_addr().unwrap()).unwrap();
        block(&rt, async move {
            use futures::{AsyncReadExt, AsyncWriteExt};
            let mut conn = l.accept().await.expect("accept");
            let msg = Message::Settings(Settings {
                max_message_len: 1 << 20,
                recv_buf_size: 4096,
                recv_buf_count: 16,
                credit_batch: 4,
                max_recv_wr: 128,
            });
            let mut frame = vec![0u8; msg.encoded_len()];
            msg.encode(&mut frame).unwrap();
            frame[4] = 1; // version 1
            conn.stream.write_all(&frame).await.unwrap();
            // Read the client's settings: a current agent frame.
            let mut head = [0u8; 12];
            conn.stream.read_exact(&mut head).await.unwrap();
            assert_eq!(head[..4], MAGIC);
            head[4]
        })
    });
    let addr = rx.recv_timeout(WAIT).expect("server start");
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let e = RdmaBuilder::new()
            .device(dev.clone())
            .connect(addr)
            .await
            .unwrap_err();
        assert!(
            matches!(
                e,
                AgentError::Closed(CloseReason::Malformed(WireError::UnsupportedVersion {
                    got: 1
                }))
            ),
            "{e}"
        );
        let report = verbio::ops::ErrorChain(&e).to_string();
        assert!(report.contains("version"), "{report}");
    });
    assert_eq!(
        th.join().expect("server"),
        verbio::ops::agent::wire::VERSION
    );
}

#[test]
fn a_client_stalled_in_the_settings_exchange_does_not_hold_up_others() {
    // The server's exchange limit is longer than the test's bound: were the
    // stalled client's exchange awaited first, the good client would not be
    // accepted in time.
    let patient = || RdmaBuilder::new().handshake_timeout(std::time::Duration::from_secs(120));
    let (tx, rx) = mpsc::channel();
    let (stall_tx, stall_rx) = mpsc::channel::<()>();
    let th = std::thread::spawn(move || {
        let (rt, dev) = runtime_and_device();
        block(&rt, async move {
            let l = patient()
                .device(dev)
                .listen("127.0.0.1:0".parse().unwrap())
                .expect("listen");
            tx.send(l.local_addr().unwrap()).unwrap();
            let good = l.accept().await.expect("the good client");
            let m = timeout(WAIT, good.receive()).await.expect("bounded");
            assert_eq!(m.unwrap(), b"not held up");
            good.send(b"ok").await.unwrap();
            stall_tx.send(()).unwrap();
            // The stalled client leaves: its exchange fails, clearly.
            l.accept().await.err().map(|e| e.to_string())
        })
    });
    let addr = rx.recv_timeout(WAIT).expect("server start");
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        // Endpoint handshake only: never sends its agent settings.
        let stalled = verbio::ops::connect::connect(addr, &qps(&dev), HANDSHAKE)
            .await
            .expect("endpoint handshake");
        let good = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        good.send(b"not held up").await.unwrap();
        assert_eq!(good.receive().await.unwrap(), b"ok");
        while stall_rx.try_recv().is_err() {
            verbio::runtime::sleep(std::time::Duration::from_millis(1)).await;
        }
        drop(stalled);
    });
    let e = th
        .join()
        .expect("server")
        .expect("the stalled client fails");
    assert!(e.contains("settings exchange"), "{e}");
}
