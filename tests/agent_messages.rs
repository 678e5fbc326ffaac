//! The high-level `Rdma` connection between two runtimes on two threads
//! (soft device): messages small and split, immediates, concurrent senders
//! under tight flow control, a garbage-sending peer, and a peer that leaves.

mod common;

use std::rc::Rc;
use std::sync::mpsc;

use common::*;
use verbio::ops::agent::wire::Message;
use verbio::ops::verbs::Verbs;
use verbio::runtime::buf::MrPool;
use verbio::runtime::timeout;
use verbio::{AgentError, CloseReason, RdmaBuilder};

#[test]
fn send_receive_split_and_immediates() {
    let big = pattern(100_000, 5);
    let big2 = big.clone();
    let (addr, server) = serve_rdma(RdmaBuilder::new, 1, move |mut c| async move {
        let r = c.remove(0);
        assert_eq!(r.receive().await.unwrap(), b"hello");
        assert_eq!(r.receive().await.unwrap(), big2, "split message");
        assert_eq!(
            r.receive_with_imm().await.unwrap(),
            (b"imm".to_vec(), Some(7))
        );
        assert_eq!(r.receive_with_imm().await.unwrap(), (Vec::new(), None));
        let small = r.receive_msg().await.unwrap();
        assert!(small.is_zero_copy(), "one-buffer message handed over as is");
        assert_eq!((&small[..], small.imm()), (&b"zero copy"[..], Some(3)));
        let split = r.receive_msg().await.unwrap();
        assert!(!split.is_zero_copy());
        assert_eq!(&split[..], &big2[..]);
        let b = r.receive_buf().await.unwrap();
        r.send(&b).await.unwrap(); // echo
        r.send(&big2).await.unwrap();
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        r.send(b"hello").await.unwrap();
        r.send(&big).await.unwrap();
        r.send_with_imm(b"imm", 7).await.unwrap();
        r.send(b"").await.unwrap();
        r.send_with_imm(b"zero copy", 3).await.unwrap();
        r.send(&big).await.unwrap();
        let pool = MrPool::new(dev.pd());
        let (res, _b) = r.send_buf(buf_from(&pool, b"echo")).await;
        res.unwrap();
        assert_eq!(r.receive().await.unwrap(), b"echo");
        assert_eq!(r.receive().await.unwrap(), big);
        let too_big = vec![0u8; 65 << 20];
        assert!(matches!(
            r.send(&too_big).await,
            Err(AgentError::MessageTooLarge { .. })
        ));
    });
    server.join().expect("server");
}

/// Whole messages too long for INLINE go without a frame (a SEND_WITH_IMM
/// of their bytes, `send_buf`'s from the caller's buffer itself if it is
/// of the connection's pool): they
/// arrive intact, zero-copy, in order with framed ones around them.
#[test]
fn frameless_whole_messages_arrive_in_order_zero_copy() {
    const SIZES: [usize; 4] = [129, 1000, 1024, 4096];
    let (addr, server) = serve_rdma(RdmaBuilder::new, 1, |mut c| async move {
        let r = c.remove(0);
        for (i, &n) in SIZES.iter().enumerate() {
            // As `send` sent it, then as `send_buf` did.
            for _ in 0..2 {
                let m = r.receive_msg().await.unwrap();
                assert!(m.is_zero_copy(), "{n} bytes lent in its slot");
                assert_eq!((&m[..], m.imm()), (&pattern(n, i as u8)[..], None));
                drop(m);
                let tagged = r.receive_msg().await.unwrap();
                assert_eq!((&tagged[..], tagged.imm()), (&b"after"[..], Some(n as u32)));
            }
        }
        let m = r.receive_msg().await.unwrap();
        r.send(&m).await.unwrap(); // echo the last one
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        for (i, &n) in SIZES.iter().enumerate() {
            let bytes = pattern(n, i as u8);
            r.send(&bytes).await.unwrap();
            r.send_with_imm(b"after", n as u32).await.unwrap();
            let (res, back) = r.send_buf(buf_from(r.pool(), &bytes)).await;
            res.unwrap();
            assert_eq!(&back[..], &bytes[..], "the buffer comes back as it was");
            r.send_with_imm(b"after", n as u32).await.unwrap();
        }
        // A buffer of another pool (its key not the connection's): copied.
        let other = MrPool::new(dev.pd());
        let last = pattern(3000, 9);
        let (res, _b) = r.send_buf(buf_from(&other, &last)).await;
        res.unwrap();
        assert_eq!(r.receive().await.unwrap(), last);
    });
    server.join().expect("server");
}

#[test]
fn concurrent_senders_under_tight_credits() {
    const TASKS: usize = 4;
    const EACH: usize = 150;
    let tight = || {
        RdmaBuilder::new()
            .recv_buf_count(2)
            .credit_batch(1)
            .recv_buf_size(256)
    };
    let (addr, server) = serve_rdma(tight, 1, |mut c| async move {
        let r = c.remove(0);
        let mut got = Vec::new();
        for _ in 0..TASKS * EACH {
            got.push(r.receive().await.unwrap());
        }
        got
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = Rc::new(dial_rdma(tight(), &dev, addr).await);
        let tasks: Vec<_> = (0..TASKS)
            .map(|t| {
                let r = r.clone();
                verbio::runtime::spawn(async move {
                    for i in 0..EACH {
                        // Some messages span several 256-byte buffers.
                        let mut m = format!("{t}:{i}:").into_bytes();
                        m.resize(m.len() + (i % 3) * 200, t as u8);
                        r.send(&m).await.unwrap();
                        assert!(r.send_credits() <= 2, "more credits than peer buffers");
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await;
        }
    });
    let got = server.join().expect("server");
    for t in 0..TASKS {
        let mine: Vec<usize> = got
            .iter()
            .filter_map(|m| {
                let s = String::from_utf8_lossy(m);
                let mut p = s.split(':');
                (p.next()? == t.to_string()).then(|| p.next()?.parse().ok())?
            })
            .collect();
        assert_eq!(
            mine,
            (0..EACH).collect::<Vec<_>>(),
            "task {t} in order, none lost"
        );
    }
}

#[test]
fn garbage_peer_gets_a_protocol_error_and_others_keep_working() {
    let (verdict_tx, verdict_rx) = mpsc::channel();
    let (addr, server) = serve_rdma(RdmaBuilder::new, 2, move |c| async move {
        // Which connection is the garbage one is unknown: race both.
        let (a, b) = (&c[0], &c[1]);
        let ra = timeout(WAIT, a.receive()).await.expect("a");
        let rb = timeout(WAIT, b.receive()).await.expect("b");
        let (bad, good, good_conn) = match (&ra, &rb) {
            (Err(_), Ok(_)) => (ra, rb, b),
            (Ok(_), Err(_)) => (rb, ra, a),
            _ => panic!("expected one failure: {ra:?} / {rb:?}"),
        };
        let reason = bad.unwrap_err().close_reason().cloned().expect("closed");
        assert!(reason.is_protocol(), "{reason}");
        assert_eq!(good.unwrap(), b"fine");
        good_conn.send(b"still here").await.unwrap();
        verdict_tx.send(reason.to_string()).unwrap();
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let bad = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let good = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let pool = bad.pool();
        let (res, _) = bad.qp().send(buf_from(pool, b"VBAG garbage!")).await;
        res.expect("raw send");
        // The server says why and closes.
        let e = bad.receive().await.unwrap_err();
        match e.close_reason() {
            Some(CloseReason::PeerError { text, .. }) => assert!(text.contains("protocol")),
            Some(CloseReason::Disconnected) => {}
            other => panic!("bad peer saw {other:?}"),
        }
        good.send(b"fine").await.unwrap();
        assert_eq!(good.receive().await.unwrap(), b"still here");
    });
    server.join().expect("server");
    let reason = verdict_rx.recv_timeout(WAIT).unwrap();
    assert!(reason.contains("protocol"), "{reason}");
}

#[test]
fn peer_disconnect_fails_pending_calls() {
    let (addr, server) = serve_rdma(RdmaBuilder::new, 1, |mut c| async move {
        let r = c.remove(0);
        let e = timeout(WAIT / 4, r.receive())
            .await
            .expect("receive must not hang")
            .unwrap_err();
        assert_eq!(e.close_reason(), Some(&CloseReason::Disconnected));
        // Later calls fail at once too.
        let e = timeout(WAIT / 4, r.send(b"x"))
            .await
            .expect("no hang")
            .unwrap_err();
        assert!(e.close_reason().is_some(), "{e}");
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        verbio::runtime::sleep(std::time::Duration::from_millis(50)).await;
        drop(r);
        // Keep the runtime turning while the dropped connection says goodbye.
        verbio::runtime::sleep(std::time::Duration::from_millis(200)).await;
    });
    server.join().expect("server");
}

#[test]
fn orderly_close_and_peer_error_message() {
    let (addr, server) = serve_rdma(RdmaBuilder::new, 2, |c| async move {
        let mut it = c.into_iter();
        let (a, b) = (it.next().unwrap(), it.next().unwrap());
        let ea = timeout(WAIT, a.receive()).await.expect("a").unwrap_err();
        let eb = timeout(WAIT, b.receive()).await.expect("b").unwrap_err();
        let mut reasons = [ea.close_reason().cloned(), eb.close_reason().cloned()];
        reasons.sort_by_key(|r| format!("{r:?}"));
        assert_eq!(reasons[0], Some(CloseReason::Disconnected));
        assert!(matches!(
            &reasons[1],
            Some(CloseReason::PeerError { code: 9, text }) if text == "bye"
        ));
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let a = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let b = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        a.close().await.expect("close");
        // An Error frame sent raw: the server reports the peer's error.
        let pool = b.pool();
        let msg = Message::Error {
            code: 9,
            text: "bye",
        };
        let mut frame = vec![0u8; msg.encoded_len()];
        msg.encode(&mut frame).unwrap();
        let (res, _) = b.qp().send(buf_from(pool, &frame)).await;
        res.expect("raw send");
        verbio::runtime::sleep(std::time::Duration::from_millis(100)).await;
    });
    server.join().expect("server");
}

#[test]
fn peer_runtime_gone_fails_pending_receive() {
    let (addr, server) = serve_rdma(RdmaBuilder::new, 1, |mut c| async move {
        let r = c.remove(0);
        assert_eq!(r.receive().await.unwrap(), b"last");
        let e = timeout(WAIT / 4, r.receive())
            .await
            .expect("receive must not hang")
            .unwrap_err();
        assert!(e.close_reason().is_some(), "{e}");
    });
    let (rt, dev) = runtime_and_device();
    let r = block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        r.send(b"last").await.unwrap();
        r
    });
    // No goodbye message: the runtime is gone, only the TCP side channel's
    // end tells the peer.
    drop(rt);
    drop(r);
    drop(dev);
    server.join().expect("server");
}

#[test]
fn second_connection_from_an_existing_one() {
    let (addr, server) = serve_rdma(RdmaBuilder::new, 2, |c| async move {
        for (i, r) in c.iter().enumerate() {
            let m = r.receive().await.unwrap();
            r.send(format!("{i}:{}", String::from_utf8_lossy(&m)).as_bytes())
                .await
                .unwrap();
        }
        for r in &c {
            let _ = timeout(WAIT, r.receive()).await;
        }
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let first = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let second = first.new_connection().await.expect("second connection");
        first.send(b"a").await.unwrap();
        assert_eq!(first.receive().await.unwrap(), b"0:a");
        second.send(b"b").await.unwrap();
        assert_eq!(second.receive().await.unwrap(), b"1:b");
        first.close().await.unwrap();
        second.close().await.unwrap();
    });
    server.join().expect("server");
}

#[test]
fn dropped_send_mid_message_leaves_the_connection_usable() {
    let tight = || {
        RdmaBuilder::new()
            .recv_buf_count(2)
            .credit_batch(2)
            .recv_buf_size(128)
    };
    let (addr, server) = serve_rdma(tight, 1, |mut c| async move {
        let r = c.remove(0);
        let got = r.receive().await.unwrap();
        r.send(&got).await.unwrap();
        let _ = timeout(WAIT, r.receive()).await;
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(tight(), &dev, addr).await;
        // 100 pieces with 2 credits: the send waits for credits mid-message.
        let big = vec![3u8; 100 * 80];
        let cut = timeout(std::time::Duration::from_millis(1), r.send(&big)).await;
        assert!(cut.is_err(), "the send should still have been running");
        r.send(b"after").await.unwrap();
        assert_eq!(r.receive().await.unwrap(), b"after");
        r.close().await.unwrap();
    });
    server.join().expect("server");
}

#[test]
fn credits_follow_the_peers_buffer_count() {
    let small = || RdmaBuilder::new().recv_buf_count(3).credit_batch(1);
    let (addr, server) = serve_rdma(small, 1, |mut c| async move {
        let r = c.remove(0);
        for i in 0..60u32 {
            assert_eq!(r.receive().await.unwrap(), i.to_le_bytes());
        }
        r.send(b"done").await.unwrap();
        let _ = timeout(WAIT, r.receive()).await;
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        for i in 0..60u32 {
            r.send(&i.to_le_bytes()).await.unwrap();
            assert!(r.send_credits() <= 3, "credits beyond the peer's 3 buffers");
        }
        assert_eq!(r.receive().await.unwrap(), b"done");
        r.close().await.unwrap();
    });
    server.join().expect("server");
}

#[test]
fn well_formed_but_out_of_sequence_data_is_a_protocol_violation() {
    let (addr, server) = serve_rdma(RdmaBuilder::new, 1, |mut c| async move {
        let r = c.remove(0);
        let e = timeout(WAIT, r.receive())
            .await
            .expect("no hang")
            .unwrap_err();
        let reason = e.close_reason().cloned().expect("closed");
        assert!(
            matches!(reason, CloseReason::Violation(_)),
            "expected a violation, got {reason}"
        );
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let pool = r.pool();
        // A piece in the middle of a message that never started.
        let msg = Message::Data {
            msg_id: 77,
            total_len: 100,
            offset: 50,
            imm: None,
            grant: 0,
            payload: &[1; 10],
        };
        let mut frame = vec![0u8; msg.encoded_len()];
        msg.encode(&mut frame).unwrap();
        let (res, _) = r.qp().send(buf_from(pool, &frame)).await;
        res.expect("raw send");
        let e = r.receive().await.unwrap_err();
        assert!(e.close_reason().is_some(), "{e}");
    });
    server.join().expect("server");
}

#[test]
fn path_mtu_is_the_minimum_of_both_settings_and_ports() {
    use verbio::provider::Mtu;
    let data = pattern(10_000, 4);
    let data2 = data.clone();
    // The server caps at 1024, the client at 512: both sides use 512.
    let (addr, server) = serve_rdma(
        || RdmaBuilder::new().mtu(Mtu::Mtu1024),
        2,
        move |c| async move {
            let mtus: Vec<Mtu> = c.iter().map(|r| r.path_mtu()).collect();
            let got = timeout(WAIT, c[0].receive()).await.expect("bounded");
            assert_eq!(got.unwrap(), data2);
            c[0].send(b"ok").await.unwrap();
            mtus
        },
    );
    let (rt, dev) = runtime_and_device();
    let port = block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new().mtu(Mtu::Mtu512), &dev, addr).await;
        assert_eq!(r.path_mtu(), Mtu::Mtu512);
        // A second connection without a client cap: the server's 1024
        // (or the port's, if smaller).
        let plain = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let port = dev
            .context()
            .query_port(1)
            .map(|p| p.active_mtu)
            .expect("port");
        assert_eq!(plain.path_mtu(), port.min(Mtu::Mtu1024));
        r.send(&data).await.unwrap();
        let ok = timeout(WAIT, r.receive()).await.expect("bounded");
        assert_eq!(ok.unwrap(), b"ok");
        port
    });
    let mtus = server.join().expect("server");
    assert_eq!(mtus, vec![Mtu::Mtu512, port.min(Mtu::Mtu1024)]);
}

#[test]
fn stray_abort_is_ignored_and_settings_after_the_start_are_a_violation() {
    let (addr, server) = serve_rdma(RdmaBuilder::new, 1, |mut c| async move {
        let r = c.remove(0);
        // An abort of a message never started changes nothing.
        assert_eq!(r.receive().await.unwrap(), b"still fine");
        let e = timeout(WAIT, r.receive())
            .await
            .expect("no hang")
            .unwrap_err();
        let reason = e.close_reason().cloned().expect("closed");
        assert!(
            matches!(reason, CloseReason::Violation(text) if text.contains("settings")),
            "expected a violation, got {reason}"
        );
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let raw = |msg: Message<'_>| {
            let mut frame = vec![0u8; msg.encoded_len()];
            msg.encode(&mut frame).unwrap();
            buf_from(r.pool(), &frame)
        };
        let (res, _) = r.qp().send(raw(Message::Abort { msg_id: 12345 })).await;
        res.expect("raw send");
        r.send(b"still fine").await.unwrap();
        let settings = Message::Settings(verbio::ops::agent::wire::Settings {
            max_message_len: 1,
            recv_buf_size: 4096,
            recv_buf_count: 1,
            credit_batch: 1,
            max_recv_wr: 1,
        });
        let (res, _) = r.qp().send(raw(settings)).await;
        res.expect("raw send");
        let e = timeout(WAIT, r.receive())
            .await
            .expect("no hang")
            .unwrap_err();
        assert!(e.close_reason().is_some(), "{e}");
    });
    server.join().expect("server");
}

/// `send_buf`'s future stays small (a window of sends in a
/// `FuturesUnordered`, as any application keeps one, moves each into its
/// box: 700 instructions of copying per message at 1 KiB), and a window
/// of `send_buf`s of every kind (INLINE, packed, from the pool's buffer
/// itself, from another pool's) arrives whole and in order.
#[test]
fn a_window_of_send_bufs_arrives_in_order_from_small_futures() {
    use futures::stream::{FuturesUnordered, StreamExt};
    const SIZES: [usize; 4] = [64, 1000, 4096, 200];
    const EACH: usize = 300;
    const WINDOW: usize = 64;
    let total = SIZES.len() * EACH;
    let (addr, server) = serve_rdma(RdmaBuilder::new, 1, move |mut c| async move {
        let r = c.remove(0);
        for i in 0..total {
            let m = r.receive_msg().await.unwrap();
            let n = SIZES[i / EACH];
            assert_eq!(
                &m[..],
                &pattern(n, i as u8)[..],
                "message {i} whole and in order"
            );
        }
        r.send(b"all").await.unwrap();
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let other = MrPool::new(dev.pd());
        let size = std::mem::size_of_val(&r.send_buf(buf_from(r.pool(), &[1; 4096])));
        eprintln!("send_buf future: {size} bytes");
        assert!(size <= 768, "send_buf's future is {size} bytes");
        // The last size from another pool's buffers: copied, boxed path.
        let mut in_flight = FuturesUnordered::new();
        for i in 0..total {
            let n = SIZES[i / EACH];
            let pool = if i / EACH == SIZES.len() - 1 {
                &other
            } else {
                r.pool()
            };
            in_flight.push(r.send_buf(buf_from(pool, &pattern(n, i as u8))));
            while in_flight.len() >= WINDOW {
                let (res, _buf) = in_flight.next().await.unwrap();
                res.unwrap();
            }
        }
        while let Some((res, _buf)) = in_flight.next().await {
            res.unwrap();
        }
        drop(in_flight);
        assert_eq!(r.receive().await.unwrap(), b"all");
    });
    server.join().expect("server");
}
