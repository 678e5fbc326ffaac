//! Cancelled sends of the high-level `Rdma` connection (soft device, two
//! runtimes on two threads): a split message cut mid-way is discarded by the
//! receiver (the sender's `Abort`), and sends dropped at every await point
//! (waiting for credits, for send-queue room, for the completion) neither
//! lose nor duplicate flow-control credits.

mod common;

use std::future::{poll_fn, Future};
use std::pin::{pin, Pin};
use std::task::{Context, Poll};
use std::time::Duration;

use common::*;
use verbio::runtime::{sleep, timeout};
use verbio::{AgentError, Rdma, RdmaBuilder};

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

/// A server that collects user messages until "bye"; answers "count?" with
/// its number of incomplete (partly received) messages and "ping" with
/// "pong". Returns the collected messages.
fn collector(
    builder: fn() -> RdmaBuilder,
) -> (std::net::SocketAddr, std::thread::JoinHandle<Vec<Vec<u8>>>) {
    serve_rdma(builder, 1, |mut c| async move {
        let r = c.remove(0);
        let mut got = Vec::new();
        loop {
            let m = r.receive().await.expect("server receive");
            match &m[..] {
                b"bye" => break,
                b"count?" => r
                    .send(&[r.incomplete_messages() as u8])
                    .await
                    .expect("reply"),
                b"ping" => r.send(b"pong").await.expect("pong"),
                _ => got.push(m),
            }
        }
        got
    })
}

/// Asks until the server holds no partly received message (bounded).
async fn until_no_partial(r: &Rdma) {
    let mut last = 0;
    for _ in 0..400 {
        r.send(b"count?").await.expect("count?");
        let m = timeout(WAIT, r.receive())
            .await
            .expect("bounded")
            .expect("count");
        last = m[0];
        if last == 0 {
            return;
        }
        sleep(Duration::from_millis(5)).await;
    }
    panic!("the server still holds {last} partial message(s)");
}

/// Small buffers and no staging ring: a message of a few KiB goes in
/// pieces (what these tests cut).
fn tight() -> RdmaBuilder {
    RdmaBuilder::new()
        .recv_buf_count(2)
        .credit_batch(2)
        .recv_buf_size(128)
        .staging_ring(0)
}

#[test]
fn a_split_send_cut_mid_way_is_discarded_by_the_receiver() {
    let (addr, server) = collector(tight);
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(tight(), &dev, addr).await;
        // A round trip: the server's credits have arrived.
        until_no_partial(&r).await;
        for round in 0..5 {
            // ~100 pieces of 84 bytes with 2 credits: the first poll posts
            // the first piece, three polls cannot finish it.
            let big = vec![round as u8; 100 * 84];
            assert!(!cut(r.send(&big), 3).await, "round {round}: finished");
            until_no_partial(&r).await;
        }
        r.send(b"after").await.unwrap();
        r.send(b"bye").await.unwrap();
    });
    let got = server.join().expect("server");
    assert_eq!(got, vec![b"after".to_vec()], "no cut message was delivered");
}

/// Server's credit settings: every reposted buffer returned at once, so a
/// quiet connection has all of them back.
fn server_builder() -> RdmaBuilder {
    RdmaBuilder::new()
        .recv_buf_count(8)
        .credit_batch(1)
        .recv_buf_size(256)
}

/// Client: a one-entry send queue, so a second send waits for room.
fn client_builder() -> RdmaBuilder {
    RdmaBuilder::new().max_send_wr(1).recv_buf_size(256)
}

/// Pings until every credit is back (bounded): the server has processed
/// every message that was posted and returned its buffer.
async fn credits_balance(r: &Rdma, want: u32) {
    let mut last = 0;
    for _ in 0..400 {
        r.send(b"ping").await.expect("ping");
        let m = timeout(WAIT, r.receive())
            .await
            .expect("bounded")
            .expect("pong");
        assert_eq!(m, b"pong");
        last = r.send_credits();
        assert!(
            last <= want,
            "{last} credits, the peer has only {want} buffers"
        );
        if last == want {
            return;
        }
        sleep(Duration::from_millis(5)).await;
    }
    panic!("{last} credits after the drops, expected {want}");
}

type SendFut<'a> = Pin<Box<dyn Future<Output = Result<(), AgentError>> + 'a>>;

#[test]
fn sends_dropped_at_every_await_point_keep_the_credits_balanced() {
    const ROUNDS: usize = 60;
    const FUTURES: usize = 12; // more than the server's 8 credits
    let (addr, server) = serve_rdma(server_builder, 1, |mut c| async move {
        let r = c.remove(0);
        let mut n = 0usize;
        loop {
            let m = r.receive().await.expect("server receive");
            match &m[..] {
                b"bye" => break,
                b"ping" => r.send(b"pong").await.expect("pong"),
                _ => n += 1,
            }
        }
        n
    });
    let (rt, dev) = runtime_and_device();
    let sent = block(&rt, async {
        let r = dial_rdma(client_builder(), &dev, addr).await;
        credits_balance(&r, 8).await;
        let small = b"small message".to_vec();
        let large = pattern(2_000, 3); // 10 pieces for the server's 256-byte buffers
        let mut finished = 0usize;
        for round in 0..ROUNDS {
            // A crowd of sends polled once each: the first takes a credit and
            // is posted, the next take credits and wait for send-queue room,
            // the rest wait for credits. Then they are dropped in an order
            // that varies with the round, some after more polls.
            // (A send that finished is not polled again: `None`.)
            let mut futs: Vec<Option<SendFut<'_>>> = (0..FUTURES)
                .map(|i| {
                    let data = if (round + i) % 5 == 0 { &large } else { &small };
                    Some(Box::pin(r.send(data)) as SendFut<'_>)
                })
                .collect();
            let mut poll_all = |futs: &mut [Option<SendFut<'_>>], cx: &mut Context<'_>| {
                for slot in futs.iter_mut() {
                    if let Some(f) = slot {
                        if f.as_mut().poll(cx).is_ready() {
                            finished += 1;
                            *slot = None;
                        }
                    }
                }
            };
            poll_fn(|cx| {
                poll_all(&mut futs, cx);
                Poll::Ready(())
            })
            .await;
            // Some survive a few more polls (their sends complete, or move on
            // to the next await point) before being dropped.
            let keep = round % FUTURES;
            for _ in 0..(round % 3) {
                sleep(Duration::from_millis(1)).await;
                poll_fn(|cx| {
                    poll_all(&mut futs[keep..], cx);
                    Poll::Ready(())
                })
                .await;
            }
            match round % 3 {
                0 => drop(futs),
                1 => futs.into_iter().rev().for_each(drop),
                _ => {
                    let tail = futs.split_off(FUTURES / 2);
                    drop(futs);
                    drop(tail);
                }
            }
        }
        // Every credit comes back: none was lost to a dropped send.
        credits_balance(&r, 8).await;
        // And full-throughput sending still works.
        for i in 0..300u32 {
            timeout(WAIT, r.send(&i.to_le_bytes()))
                .await
                .expect("send after the drops must not hang")
                .expect("send");
        }
        credits_balance(&r, 8).await;
        r.send(b"bye").await.unwrap();
        finished
    });
    let received = server.join().expect("server");
    // `finished` counts only polls that saw the end; dropped posted sends
    // arrive too, so the server got at least the sends that finished.
    assert!(
        received >= sent + 300,
        "server got {received}, {sent} + 300 finished"
    );
}
