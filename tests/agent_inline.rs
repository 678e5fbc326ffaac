//! `Rdma::send` of a small message is an INLINE send (soft device, or the
//! device named by `VERBIO_TEST_DEVICE`):
//! - a message that fits the QP's `max_inline_data` with its header is
//!   posted inline without an op: `send` returns once it is posted, and the
//!   QP still holds its send-queue slot (an unsignaled inline send keeps it
//!   until a later signaled WR retires it), where an awaited SEND op has
//!   completed and freed its slot by the time `send` returns; a larger
//!   message, or any with `max_inline_data(0)`, takes the awaited path;
//! - the builder refuses a `max_inline_data` above `MAX_INLINE_DATA`;
//! - an inline send that fails at the peer (a raw peer posts a receive too
//!   small for it) brings the connection down with that send's error as
//!   the reason (not a bare "disconnected"): later sends fail with it, and
//!   `close`, which waits for the sends posted before it, reports it.

mod common;

use std::sync::mpsc;
use std::time::Duration;

use common::*;
use verbio::ops::agent::wire::{Message, Settings, DATA_OVERHEAD};
use verbio::ops::agent::{AgentError, CloseReason, DEFAULT_MAX_INLINE_DATA, MAX_INLINE_DATA};
use verbio::ops::connect::Listener;
use verbio::runtime::sleep;
use verbio::{RdmaBuilder, Verbs};

/// A server that receives `n` messages and returns them.
fn receiver(n: usize) -> (std::net::SocketAddr, std::thread::JoinHandle<Vec<Vec<u8>>>) {
    serve_rdma(RdmaBuilder::new, 1, move |mut c| async move {
        let r = c.remove(0);
        let mut got = Vec::new();
        for _ in 0..n {
            got.push(r.receive().await.expect("message"));
        }
        // Until the client closes.
        let _ = r.receive().await;
        got
    })
}

/// Send-queue slots the connection's QP holds once every send so far has
/// completed and trailing inline sends are retired.
async fn settled(r: &verbio::Rdma) -> u32 {
    r.qp().sends_idle().await;
    r.qp().outstanding_sends()
}

#[test]
fn a_small_send_goes_inline_and_a_large_one_does_not() {
    let small = pattern(64, 1);
    let large = pattern(DEFAULT_MAX_INLINE_DATA as usize + 1, 2);
    let (addr, server) = receiver(4);
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        assert!(r.qp().caps().max_inline_data as usize >= small.len() + DATA_OVERHEAD);
        for _ in 0..2 {
            assert_eq!(settled(&r).await, 0);
            r.send(&small).await.expect("small send");
            assert!(
                r.qp().outstanding_sends() > 0,
                "a 64-byte send returned with no send-queue slot held: not posted inline"
            );
            assert_eq!(settled(&r).await, 0);
            r.send(&large).await.expect("large send");
            assert_eq!(
                r.qp().outstanding_sends(),
                0,
                "a send too large for inline returned before its completion"
            );
        }
        r.close().await.expect("close");
    });
    let got = server.join().expect("server");
    assert_eq!(got, [&small[..], &large, &small, &large]);
}

#[test]
fn max_inline_data_zero_sends_nothing_inline() {
    let small = pattern(16, 3);
    let (addr, server) = receiver(3);
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new().max_inline_data(0), &dev, addr).await;
        for _ in 0..3 {
            r.send(&small).await.expect("send");
            assert_eq!(
                r.qp().outstanding_sends(),
                0,
                "with max_inline_data(0) a send returned before its completion"
            );
        }
        r.close().await.expect("close");
    });
    assert_eq!(server.join().expect("server"), [&small[..], &small, &small]);
}

#[test]
fn max_inline_data_above_the_limit_is_refused() {
    let (rt, _dev) = runtime_and_device();
    block(&rt, async {
        // Refused before any connection is attempted (nothing listens here).
        let err = RdmaBuilder::new()
            .max_inline_data(MAX_INLINE_DATA + 1)
            .connect("127.0.0.1:1".parse().unwrap())
            .await
            .expect_err("refused");
        assert!(
            matches!(
                err,
                AgentError::Config {
                    setting: "max_inline_data",
                    ..
                }
            ),
            "{err:?}"
        );
    });
}

/// A raw peer of an `Rdma` client: announces 4 receive buffers, takes the
/// client's first `Credit` in a full-size buffer, then posts an 8-byte
/// receive (too small for any `Data` message) and grants the credits.
/// Keeps its QP and TCP stream until `done` says so.
fn raw_peer_with_a_small_receive() -> (
    std::net::SocketAddr,
    mpsc::Sender<()>,
    std::thread::JoinHandle<()>,
) {
    let (tx, rx) = mpsc::channel();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let th = std::thread::spawn(move || {
        let (rt, dev) = runtime_and_device();
        let l: Listener<_> = listen(&dev);
        tx.send(l.local_addr().unwrap()).unwrap();
        block(&rt, async move {
            use futures::{AsyncReadExt, AsyncWriteExt};
            let mut conn = l.accept().await.expect("accept");
            let pool = verbio::runtime::buf::MrPool::new(dev.pd());
            let first = conn.qp.recv(buf(&pool, 4096));
            let settings = Message::Settings(Settings {
                max_message_len: 1 << 20,
                recv_buf_size: 4096,
                recv_buf_count: 4,
                credit_batch: 1,
                max_recv_wr: conn.qp.caps().max_recv_wr,
            });
            let mut frame = vec![0u8; settings.encoded_len()];
            settings.encode(&mut frame).unwrap();
            conn.stream.write_all(&frame).await.unwrap();
            let mut theirs = [0u8; 512];
            let n = conn.stream.read(&mut theirs).await.unwrap();
            assert!(n > 0, "the client's settings");
            let (res, _) = first.await;
            res.expect("the client's credits");
            let small = conn.qp.recv(buf(&pool, 8));
            let credit = Message::Credit { grant: 4 };
            let mut b = buf(&pool, credit.encoded_len());
            b.resize(credit.encoded_len(), 0).unwrap();
            credit.encode(&mut b).unwrap();
            let (res, _) = conn.qp.send(b).await;
            res.expect("granting credits");
            let (res, _) = small.await;
            assert!(res.is_err(), "a Data message cannot fit 8 bytes");
            // Keep the QP and the stream until the client is done.
            while done_rx.try_recv().is_err() {
                sleep(Duration::from_millis(5)).await;
            }
        });
    });
    (rx.recv_timeout(WAIT).expect("peer start"), done_tx, th)
}

/// The reason names the failed inline send.
fn names_the_inline_send(reason: &CloseReason) -> bool {
    matches!(reason, CloseReason::Transport(text) if text.contains("inline send"))
}

#[test]
fn a_failed_inline_send_fails_the_connection_with_its_error() {
    let (addr, done, peer) = raw_peer_with_a_small_receive();
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        while r.send_credits() == 0 {
            sleep(Duration::from_millis(1)).await;
        }
        // Posted inline: nothing fails yet.
        r.send(&[5u8; 64]).await.expect("posted");
        while r.close_reason().is_none() {
            sleep(Duration::from_millis(1)).await;
        }
        let reason = r.close_reason().unwrap();
        assert!(names_the_inline_send(&reason), "{reason:?}");
        match r.send(b"again").await {
            Err(AgentError::Closed(reason)) => {
                assert!(names_the_inline_send(&reason), "{reason:?}")
            }
            other => panic!("expected the inline send's failure, got {other:?}"),
        }
        assert!(r.close().await.is_err(), "close of a failed connection");
    });
    done.send(()).unwrap();
    peer.join().expect("raw peer");
}

#[test]
fn close_reports_an_inline_send_that_failed_before_it() {
    let (addr, done, peer) = raw_peer_with_a_small_receive();
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        while r.send_credits() == 0 {
            sleep(Duration::from_millis(1)).await;
        }
        r.send(&[6u8; 64]).await.expect("posted");
        // At once: close waits for the send to complete and reports it.
        let err = r.close().await.expect_err("the send before close failed");
        let text = verbio::ops::ErrorChain(&err).to_string();
        assert!(text.contains("inline send"), "{text}");
    });
    done.send(()).unwrap();
    peer.join().expect("raw peer");
}
