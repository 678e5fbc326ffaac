//! The pieces of a split message (soft device, two runtimes on two
//! threads): they are posted back to back under the credit window, not
//! one per completion, and the message arrives whole and in order with
//! messages sent around it.

mod common;

use std::pin::pin;

use futures::FutureExt;

use common::*;
use verbio::runtime::timeout;
use verbio::RdmaBuilder;

/// Receive buffers of each side (the sender's credits) and their size.
const BUFS: u32 = 8;
const BUF: usize = 1024;

fn builder() -> RdmaBuilder {
    RdmaBuilder::new()
        .recv_buf_count(BUFS)
        .credit_batch(BUFS)
        .recv_buf_size(BUF)
        .max_inline_data(0)
}

#[test]
fn the_pieces_of_a_message_are_posted_without_waiting_for_each_completion() {
    // Five pieces: fewer than the credits, so all can be posted at once.
    let big = pattern(4 * BUF + 100, 9);
    let expect = big.clone();
    let (addr, server) = serve_rdma(builder, 1, move |mut c| async move {
        let r = c.remove(0);
        assert_eq!(r.receive().await.unwrap(), b"before");
        assert!(r.receive().await.unwrap() == expect, "the split message");
        assert_eq!(r.receive().await.unwrap(), b"after");
        r.send(b"done").await.unwrap();
        // Until the client has read the reply.
        let _ = r.receive().await;
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(builder(), &dev, addr).await;
        // A message whose send has returned was received: once it is
        // sent the server's announcement of its buffers has arrived.
        r.send(b"before").await.unwrap();
        let credits = r.send_credits();
        assert!(credits >= 5, "{credits} credits: not enough to test with");
        let mut send = pin!(r.send(&big));
        // One poll posts every piece the credits allow: with one piece
        // posted per completion, it would have spent one credit.
        let first = futures::poll!(send.as_mut());
        assert!(
            first.is_pending(),
            "a non-inline send waits for its completions"
        );
        assert_eq!(
            credits - r.send_credits(),
            5,
            "all five pieces posted in the first poll"
        );
        timeout(WAIT, send).await.expect("send").unwrap();
        r.send(b"after").await.unwrap();
        assert_eq!(r.receive().await.unwrap(), b"done");
        r.send(b"bye").await.unwrap();
    });
    server.join().expect("server");
}

#[test]
fn a_message_of_exactly_the_buffer_size_is_one_send() {
    // The size applications pick most: a message of `recv_buf_size` bytes
    // (and one with an immediate) takes one of the peer's buffers, one
    // credit; a byte more is split.
    let sizes = [BUF, BUF, BUF + 1];
    let (addr, server) = serve_rdma(builder, 1, move |mut c| async move {
        let r = c.remove(0);
        assert_eq!(r.receive().await.unwrap(), b"before");
        for (i, &len) in sizes.iter().enumerate() {
            let (got, imm) = r.receive_with_imm().await.unwrap();
            assert!(got == pattern(len, i as u8), "message {i}");
            assert_eq!(imm, (i == 1).then_some(7));
        }
        r.send(b"done").await.unwrap();
        let _ = r.receive().await;
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(builder(), &dev, addr).await;
        r.send(b"before").await.unwrap();
        for (i, &len) in sizes.iter().enumerate() {
            let data = pattern(len, i as u8);
            let credits = r.send_credits();
            assert!(credits >= 2, "{credits} credits: not enough to test with");
            let mut send = match i {
                1 => r.send_with_imm(&data, 7).boxed_local(),
                _ => r.send(&data).boxed_local(),
            };
            // Posted in the first poll (credits are at hand), completed later.
            let _ = futures::poll!(send.as_mut());
            let pieces = if len > BUF { 2 } else { 1 };
            assert_eq!(
                credits - r.send_credits(),
                pieces,
                "a message of {len} bytes with {BUF}-byte buffers"
            );
            timeout(WAIT, send).await.expect("send").unwrap();
        }
        assert_eq!(r.receive().await.unwrap(), b"done");
        r.send(b"bye").await.unwrap();
    });
    server.join().expect("server");
}

/// Sizes around the READ threshold (32 KiB) and the piece size, and a large one.
const LARGE: [usize; 6] = [
    BUF * 8,
    32 * 1024 - 1,
    32 * 1024,
    32 * 1024 + 1,
    100_000,
    3 << 20,
];

#[test]
fn large_messages_arrive_whole_and_in_order_with_their_immediates() {
    let (addr, server) = serve_rdma(builder, 1, move |mut c| async move {
        let r = c.remove(0);
        for (i, &len) in LARGE.iter().enumerate() {
            let (got, imm) = r.receive_with_imm().await.unwrap();
            assert!(
                got == pattern(len, i as u8),
                "message {i} ({} of {len} bytes)",
                got.len()
            );
            assert_eq!(imm, (i % 2 == 0).then_some(i as u32));
            assert_eq!(r.receive().await.unwrap(), [i as u8], "in order");
        }
        // Echo one back: the other way works the same.
        let back = r.receive_msg().await.unwrap();
        r.send(&back).await.unwrap();
        assert_eq!(r.incomplete_messages(), 0);
        let _ = r.receive().await;
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(builder(), &dev, addr).await;
        for (i, &len) in LARGE.iter().enumerate() {
            let data = pattern(len, i as u8);
            match i % 2 {
                0 => r.send_with_imm(&data, i as u32).await.unwrap(),
                _ => r.send(&data).await.unwrap(),
            }
            r.send(&[i as u8]).await.unwrap();
        }
        let big = pattern(1 << 20, 77);
        r.send(&big).await.unwrap();
        assert!(r.receive().await.unwrap() == big, "echoed");
        r.send(b"bye").await.unwrap();
    });
    server.join().expect("server");
}

#[test]
fn a_large_send_cancelled_after_its_first_poll_still_arrives_and_frees_its_slot() {
    // More cancelled sends than messages may be in progress at once: each
    // one's slot comes back when the peer has read it.
    const N: usize = 12;
    let len = 64 * 1024;
    let (addr, server) = serve_rdma(builder, 1, move |mut c| async move {
        let r = c.remove(0);
        assert_eq!(r.receive().await.unwrap(), b"before");
        for i in 0..N {
            let got = r.receive().await.unwrap();
            assert!(
                got == pattern(len, i as u8),
                "message {i} ({} bytes)",
                got.len()
            );
            r.send(&[i as u8]).await.unwrap();
        }
        let _ = r.receive().await;
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(builder(), &dev, addr).await;
        r.send(b"before").await.unwrap();
        for i in 0..N {
            let data = pattern(len, i as u8);
            let mut send = pin!(r.send(&data));
            // The first poll posts the offer (credits are at hand); the
            // send is dropped then, which cannot take the message back.
            let first = futures::poll!(send.as_mut());
            assert!(first.is_pending(), "a large send waits for the peer's read");
            let got = timeout(WAIT, r.receive()).await.expect("reply").unwrap();
            assert_eq!(got, [i as u8], "the peer got message {i}");
        }
        r.send(b"bye").await.unwrap();
    });
    server.join().expect("server");
}
