//! Send credits ride on data (soft device, two runtimes on two threads): a
//! raw endpoint plays the peer of an `Rdma` client in a ping-pong, so every
//! frame the client sends is seen as it is on the wire.
//! - the credits the client owes for the replies it read come back on its
//!   next data message, not in `Credit` messages of their own (its credit
//!   batch is never reached);
//! - credits the peer returns on its data messages let the client send
//!   (the peer announces a single receive buffer, so every round after the
//!   first needs the credit that came back with the reply).

mod common;

use std::collections::VecDeque;
use std::sync::mpsc;

use common::*;
use verbio::ops::agent::wire::{decode, Message};
use verbio::ops::connect::Listener;
use verbio::{RdmaBuilder, Verbs};

const BUF: usize = 4096;
const ROUNDS: u64 = 6;
/// The client's receive buffers and credit batch: a batch is never owed
/// in a ping-pong, so no `Credit` message should follow its first.
const CLIENT_BUFS: u32 = 8;

/// What the raw peer saw the client send, in order.
#[derive(Debug, PartialEq)]
enum Seen {
    Credit(u32),
    /// A whole message (one piece) returning `grant` credits.
    Whole {
        grant: u32,
    },
    Close,
    Other(String),
}

#[test]
fn owed_credits_ride_on_the_next_data_message_both_ways() {
    let (tx, rx) = mpsc::channel();
    let th = std::thread::spawn(move || {
        let (rt, dev) = runtime_and_device();
        let l: Listener<_> = listen(&dev);
        tx.send(l.local_addr().unwrap()).unwrap();
        block(&rt, async move {
            let mut conn = l.accept().await.expect("accept");
            // One receive buffer for the client's messages: it holds one
            // send credit at a time.
            let max_recv_wr = conn.qp.caps().max_recv_wr;
            raw_agent::exchange_settings(&mut conn.stream, BUF, 1, max_recv_wr).await;
            let pool = verbio::runtime::buf::MrPool::new(dev.pd());
            let mut recvs: VecDeque<_> = (0..8).map(|_| conn.qp.recv(buf(&pool, BUF))).collect();
            let send = |msg: Message<'_>| {
                let mut b = buf(&pool, msg.encoded_len());
                b.resize(msg.encoded_len(), 0).unwrap();
                msg.encode(&mut b).unwrap();
                conn.qp.send(b)
            };
            let (res, _) = send(Message::Credit { grant: 1 }).await;
            res.expect("announcing one buffer");
            let mut seen = Vec::new();
            let mut replies = 0;
            while replies < ROUNDS {
                let (res, b) = recvs.pop_front().expect("a posted receive").await;
                let rcv = res.expect("receive");
                let s = match decode(&b[..rcv.len]) {
                    Ok(Message::Credit { grant }) => Seen::Credit(grant),
                    Ok(Message::Whole { grant, .. }) => Seen::Whole { grant },
                    Ok(Message::Close) => Seen::Close,
                    other => Seen::Other(format!("{other:?}")),
                };
                recvs.push_back(conn.qp.recv(buf(&pool, BUF)));
                if let Seen::Whole { .. } = s {
                    // The reply returns the buffer the message used.
                    let reply = Message::Whole {
                        imm: None,
                        grant: 1,
                        payload: b"reply",
                    };
                    let (res, _) = send(reply).await;
                    res.expect("reply");
                    replies += 1;
                }
                seen.push(s);
            }
            // Keep the QP until the client is done with it.
            let _ = verbio::runtime::timeout(WAIT, recvs.pop_front().unwrap()).await;
            seen
        })
    });
    let addr = rx.recv_timeout(WAIT).expect("server start");
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let client = RdmaBuilder::new()
            .recv_buf_count(CLIENT_BUFS)
            .credit_batch(CLIENT_BUFS);
        let r = dial_rdma(client, &dev, addr).await;
        for i in 0..ROUNDS {
            r.send(format!("ping {i}").as_bytes()).await.expect("send");
            assert_eq!(r.receive().await.expect("reply"), b"reply");
        }
        r.close().await.expect("close");
    });
    let seen = th.join().expect("raw peer");
    let mut want = vec![Seen::Credit(CLIENT_BUFS), Seen::Whole { grant: 0 }];
    // Each later ping returns the buffer of the reply before it.
    want.extend((1..ROUNDS).map(|_| Seen::Whole { grant: 1 }));
    assert_eq!(seen, want);
}

/// A window of this many messages (verbio-perf's and perftest's `send_bw`
/// default, the sweep's) must go out without a wait for credits.
const WINDOW: usize = 128;

/// With the builder's defaults each side grants its peer a whole window of
/// `WINDOW` messages that each take a receive buffer (4 KiB: one SEND each,
/// not packed): a sender with that many in flight never waits for a batch
/// of credits. With 64 (before) such a sender waited for every batch of 16
/// the receiver returned, a sleep and a wake-up of both sides each time:
/// 1.3x the verbs path's time per byte on one CPU (docs/benchmarks.md).
#[test]
fn a_default_connection_takes_a_window_of_128_messages_without_waiting_for_credits() {
    const LEN: usize = 4096;
    let (addr, server) = serve_rdma(RdmaBuilder::new, 1, |mut c| async move {
        let r = c.remove(0);
        // Sent after this side's first credit grant, in order on the QP:
        // once the client has it, it has the grant too.
        r.send(b"hello").await.expect("hello");
        for i in 0..WINDOW {
            let m = r.receive().await.expect("a message of the window");
            assert_eq!(m, pattern(LEN, i as u8), "message {i}, in order");
        }
        // The window's first message returned the credit "hello" took.
        let credits = r.send_credits();
        r.send(b"done").await.expect("done");
        let _ = verbio::runtime::timeout(WAIT, r.receive()).await;
        credits
    });
    let (rt, dev) = runtime_and_device();
    let client_credits = block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        assert_eq!(r.receive().await.expect("hello"), b"hello");
        let credits = r.send_credits();
        let msgs: Vec<Vec<u8>> = (0..WINDOW).map(|i| pattern(LEN, i as u8)).collect();
        futures::future::try_join_all(msgs.iter().map(|m| r.send(m)))
            .await
            .expect("the window");
        assert_eq!(r.receive().await.expect("done"), b"done");
        r.close().await.expect("close");
        credits
    });
    let server_credits = server.join().expect("server");
    for (side, credits) in [("client", client_credits), ("server", server_credits)] {
        assert!(
            credits as usize >= WINDOW,
            "the {side} may send {credits} messages before it waits for credits, \
             fewer than a window of {WINDOW}"
        );
    }
}
