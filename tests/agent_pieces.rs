//! The pieces of a split message (soft device, two runtimes on two
//! threads): they are posted back to back under the credit window, not
//! one per completion, and the message arrives whole and in order with
//! messages sent around it.

mod common;

use std::pin::pin;

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
        assert_eq!(r.receive().await.unwrap(), expect, "the split message");
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
