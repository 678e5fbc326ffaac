//! Futures of the high-level `Rdma` connection dropped in the middle of each
//! operation (soft device, two runtimes on two threads): afterwards the
//! connection still works (a ping/pong round trip succeeds), nothing panics,
//! and the owner's grant count returns to what the test expects.

mod common;

use std::future::Future;
use std::net::SocketAddr;
use std::pin::pin;
use std::sync::mpsc;
use std::time::Duration;

use common::*;
use verbio::runtime::{sleep, timeout};
use verbio::{Rdma, RdmaBuilder};

/// The operation whose future is dropped.
#[derive(Clone, Copy, Debug)]
enum Op {
    SendLarge,
    Receive,
    RequestRemoteMr,
    Read,
    Write,
    WriteWithImm,
    CompareAndSwap,
    FetchAndAdd,
    ReceiveRemoteMr,
}

/// Serves until "bye": answers "ping" with its live grant count (one
/// byte), "give" by handing over 64 bytes of its memory; other messages
/// (a dropped send that got through) are ignored.
fn server() -> (SocketAddr, std::thread::JoinHandle<()>) {
    let (tx, rx) = mpsc::channel();
    let th = std::thread::spawn(move || {
        let (rt, dev) = runtime_and_device();
        block(&rt, async move {
            let l = RdmaBuilder::new()
                .device(dev)
                .listen("127.0.0.1:0".parse().unwrap())
                .expect("listen");
            tx.send(l.local_addr().unwrap()).unwrap();
            let r = l.accept().await.expect("accept");
            loop {
                let m = r.receive().await.expect("server receive");
                match &m[..] {
                    b"bye" => break,
                    b"ping" => r.send(&[r.live_grants() as u8]).await.unwrap(),
                    b"give" => {
                        r.send_local_mr(vec![0; 64]).await.unwrap();
                    }
                    _ => {}
                }
            }
        })
    });
    (rx.recv_timeout(WAIT).expect("server start"), th)
}

/// Polls `fut` up to `polls` times (1 ms apart), then drops it. True if it
/// finished first.
async fn cut<F: Future>(fut: F, polls: usize) -> bool {
    let mut f = pin!(fut);
    for i in 0..polls {
        if futures::poll!(f.as_mut()).is_ready() {
            return true;
        }
        if i + 1 < polls {
            sleep(Duration::from_millis(1)).await;
        }
    }
    false
}

/// One ping/pong round trip: the server's live grant count.
async fn ping(r: &Rdma) -> u8 {
    timeout(WAIT, r.send(b"ping"))
        .await
        .expect("ping bounded")
        .expect("ping sent");
    let m = timeout(WAIT, r.receive())
        .await
        .expect("pong bounded")
        .expect("pong received");
    assert_eq!(m.len(), 1, "unexpected message {m:?}");
    m[0]
}

/// Pings until the server holds `want` grants (bounded).
async fn settle(r: &Rdma, want: u8) {
    let mut last = 0;
    for _ in 0..400 {
        last = ping(r).await;
        if last == want {
            return;
        }
        sleep(Duration::from_millis(5)).await;
    }
    panic!("server holds {last} grants, expected {want}");
}

fn dropped_mid(op: Op) {
    let (addr, server) = server();
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = RdmaBuilder::new()
            .device(dev.clone())
            .connect(addr)
            .await
            .expect("connect");
        let remote = r.request_remote_mr(4096).await.expect("grant");
        assert_eq!(ping(&r).await, 1);
        // READ/WRITE use the first 4088 bytes, the atomics the last word.
        let mut local = r.alloc_local_mr(4088).unwrap();
        local.copy_from_slice(&pattern(4088, 1));
        let bulk = remote.get(0..4088).unwrap();
        let word = remote.get(4088..4096).unwrap();
        match op {
            Op::SendLarge => {
                let big = pattern(200_000, 7);
                // (One poll: from 32 KiB the peer fetches the message with
                // one READ, which may well be done within a few.)
                let done = cut(r.send(&big), 1).await;
                assert!(!done, "a 200 kB send should take more than 1 poll");
            }
            Op::Receive => {
                assert!(!cut(r.receive(), 3).await, "nothing was sent");
            }
            Op::RequestRemoteMr => {
                assert!(
                    !cut(r.request_remote_mr(64), 1).await,
                    "finished at its first poll"
                );
            }
            Op::Read => {
                assert!(
                    !cut(r.read(local, &bulk), 1).await,
                    "finished at its first poll"
                );
            }
            Op::Write => {
                assert!(
                    !cut(r.write(local, &bulk), 1).await,
                    "finished at its first poll"
                );
            }
            Op::WriteWithImm => {
                assert!(
                    !cut(r.write_with_imm(local, &bulk, 9), 1).await,
                    "finished at its first poll"
                );
            }
            Op::CompareAndSwap => {
                assert!(
                    !cut(r.compare_and_swap(&word, 0, 1), 1).await,
                    "finished at its first poll"
                );
            }
            Op::FetchAndAdd => {
                assert!(
                    !cut(r.fetch_and_add(&word, 1), 1).await,
                    "finished at its first poll"
                );
            }
            Op::ReceiveRemoteMr => {
                assert!(!cut(r.receive_remote_mr(), 3).await, "nothing handed over");
                // The next hand-over still reaches the next receiver.
                r.send(b"give").await.unwrap();
                let given = timeout(WAIT, r.receive_remote_mr())
                    .await
                    .expect("hand-over bounded")
                    .expect("hand-over");
                assert_eq!(given.len(), 64);
                assert_eq!(ping(&r).await, 2);
                drop(given); // released in the background
            }
        }
        // The connection still works, and the owner is back to the one grant.
        settle(&r, 1).await;
        assert!(r.close_reason().is_none(), "{:?}", r.close_reason());
        // The grant is still usable (the word holds 0 or 1 after an atomic).
        let v = r.fetch_and_add(&word, 0).await.expect("atomic after drop");
        assert!(v <= 1, "{v}");
        let back = r.alloc_local_mr(8).unwrap();
        let (res, _) = r.read(back, &word).await;
        res.expect("read after drop");
        drop((bulk, word));
        r.release(remote).await.unwrap();
        settle(&r, 0).await;
        r.send(b"bye").await.unwrap();
    });
    server.join().expect("server");
}

#[test]
fn dropped_large_send() {
    dropped_mid(Op::SendLarge);
}

#[test]
fn dropped_receive() {
    dropped_mid(Op::Receive);
}

#[test]
fn dropped_request_remote_mr() {
    dropped_mid(Op::RequestRemoteMr);
}

#[test]
fn dropped_read() {
    dropped_mid(Op::Read);
}

#[test]
fn dropped_write() {
    dropped_mid(Op::Write);
}

#[test]
fn dropped_write_with_imm() {
    dropped_mid(Op::WriteWithImm);
}

#[test]
fn dropped_compare_and_swap() {
    dropped_mid(Op::CompareAndSwap);
}

#[test]
fn dropped_fetch_and_add() {
    dropped_mid(Op::FetchAndAdd);
}

#[test]
fn dropped_receive_remote_mr() {
    dropped_mid(Op::ReceiveRemoteMr);
}

#[test]
fn dropped_send_local_mr_revokes_the_unsent_grant() {
    // A one-entry send queue: while a piece of a large message is in flight
    // the hand-over cannot be posted, so dropping it leaves an unsent grant.
    let one_wr = || RdmaBuilder::new().max_send_wr(1);
    let (addr, server) = serve_rdma(RdmaBuilder::new, 1, |mut c| async move {
        let r = c.remove(0);
        let mut got = Vec::new();
        loop {
            let m = timeout(WAIT, r.receive()).await.expect("bounded").unwrap();
            if m == b"bye" {
                break;
            }
            got.push(m.len());
        }
        // No hand-over arrived: none was sent.
        let none = timeout(Duration::from_millis(20), r.receive_remote_mr()).await;
        (got, none.is_err())
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(one_wr(), &dev, addr).await;
        // Credits have arrived once a message got through.
        r.send(b"hello").await.unwrap();
        for round in 0..20 {
            let big = pattern(20_000, round);
            let mut send = std::pin::pin!(r.send(&big));
            assert!(futures::poll!(send.as_mut()).is_pending());
            assert!(
                !cut(r.send_local_mr(vec![round; 64]), 1).await,
                "the hand-over cannot have finished"
            );
            assert_eq!(r.live_grants(), 0, "round {round}: unsent grant revoked");
            timeout(WAIT, send).await.expect("bounded").unwrap();
        }
        r.send(b"bye").await.unwrap();
    });
    let (got, no_hand_over) = server.join().expect("server");
    assert_eq!(got.len(), 21, "{got:?}");
    assert!(
        no_hand_over,
        "a dropped, unposted hand-over reached the peer"
    );
}
