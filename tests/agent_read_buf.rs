//! `Rdma::send_buf` of a message beyond the staging ring, which the peer
//! fetches with an RDMA READ (soft device, two runtimes on two threads):
//! the peer reads the caller's registered buffer itself (no copy of it is
//! made), the buffer comes back unchanged when the send ends (also when
//! the connection goes down while the peer has not read it yet), and a
//! send cancelled once its offer went out still delivers the message and
//! frees the buffer once the peer has read it; the receiver READs into
//! vectors it reuses once the application dropped their messages.

mod common;

use std::pin::pin;
use std::time::Duration;

use common::alloc_count::{big_allocs, Counting};
use common::*;
use verbio::runtime::{sleep, timeout};
use verbio::RdmaBuilder;

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Waits (without blocking the runtime thread, whose agent must go on
/// taking in what arrives) until the other side says so on `rx`.
async fn until_told(rx: &std::sync::mpsc::Receiver<()>, what: &str) {
    let end = std::time::Instant::now() + WAIT;
    while rx.try_recv().is_err() {
        assert!(std::time::Instant::now() < end, "never told: {what}");
        sleep(Duration::from_millis(2)).await;
    }
}

/// A 64 KiB ring: messages above 16 KiB go by READ.
fn builder() -> RdmaBuilder {
    RdmaBuilder::new().staging_ring(64 * 1024)
}

/// Above the ring's quarter and above [`BIG_ALLOC`]: a copy of it would
/// be a big allocation on the sender's thread.
///
/// [`BIG_ALLOC`]: common::alloc_count::BIG_ALLOC
const LEN: usize = (2 << 20) + 123;

#[test]
fn send_buf_of_a_message_read_by_the_peer_lends_the_callers_buffer() {
    let (addr, server) = serve_rdma(builder, 1, move |mut c| async move {
        let r = c.remove(0);
        for seed in 0..3 {
            assert!(r.receive().await.unwrap() == pattern(LEN, seed), "{seed}");
        }
        r.send(b"done").await.unwrap();
        let _ = r.receive().await;
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(builder(), &dev, addr).await;
        for seed in 0..3 {
            let buf = r
                .pool()
                .alloc_from(&pattern(LEN, seed))
                .expect("send buffer");
            let at = buf.as_ptr();
            let big = big_allocs();
            let (res, back) = timeout(WAIT, r.send_buf(buf)).await.expect("send");
            res.unwrap();
            assert_eq!(
                big_allocs(),
                big,
                "a big allocation while sending {LEN} bytes: the message was copied"
            );
            assert_eq!(back.as_ptr(), at, "the caller's buffer comes back");
            assert!(back[..] == pattern(LEN, seed)[..], "unchanged");
        }
        assert_eq!(r.receive().await.unwrap(), b"done");
        r.send(b"bye").await.unwrap();
    });
    server.join().expect("server");
}

#[test]
fn a_send_buf_cancelled_once_offered_still_arrives_and_frees_the_buffer_after() {
    // The peer takes in one message beyond its unread limit, so the next
    // offer waits there (unread) until its application reads the first.
    // (The peer reads once told: a sleep would have to outlast the
    // client's steps, which a loaded machine can stretch.)
    let (go, told) = std::sync::mpsc::channel();
    let server_builder = || builder().max_unread_bytes(64 * 1024);
    let (addr, server) = serve_rdma(server_builder, 1, move |mut c| async move {
        let r = c.remove(0);
        until_told(&told, "the client's cancelled send was offered").await;
        for seed in [6, 7, 8] {
            let got = r.receive().await.unwrap();
            assert!(
                got == pattern(LEN, seed),
                "message {seed}: {} bytes, starting {:?}",
                got.len(),
                &got[..8.min(got.len())]
            );
        }
        r.send(b"done").await.unwrap();
        let _ = r.receive().await;
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(builder(), &dev, addr).await;
        let buf = r.pool().alloc_from(&pattern(LEN, 6)).expect("send buffer");
        let (res, _first) = timeout(WAIT, r.send_buf(buf)).await.expect("send");
        res.unwrap();
        let before = r.pool().stats().dedicated_in_use;
        {
            let buf = r.pool().alloc_from(&pattern(LEN, 7)).expect("send buffer");
            let mut send = pin!(r.send_buf(buf));
            // Its offer goes out and waits at the peer; then it is dropped.
            let waited = timeout(Duration::from_millis(100), send.as_mut()).await;
            assert!(waited.is_err(), "the peer read it: {waited:?}");
        }
        assert_eq!(
            r.pool().stats().dedicated_in_use,
            before + 1,
            "the cancelled send's buffer is held while the peer may read it"
        );
        go.send(()).expect("the peer waits");
        // The next one goes after it (in order, the permit given back).
        let buf = r.pool().alloc_from(&pattern(LEN, 8)).expect("send buffer");
        let (res, last) = timeout(WAIT, r.send_buf(buf)).await.expect("send");
        res.unwrap();
        drop(last);
        assert_eq!(r.receive().await.unwrap(), b"done");
        // The cancelled one's buffer was freed once read.
        let end = std::time::Instant::now() + WAIT;
        while r.pool().stats().dedicated_in_use > before {
            assert!(
                std::time::Instant::now() < end,
                "the buffer was never freed"
            );
            sleep(Duration::from_millis(5)).await;
        }
        r.send(b"bye").await.unwrap();
    });
    server.join().expect("server");
}

#[test]
fn a_connection_that_goes_down_before_the_peer_reads_gives_the_buffer_back() {
    // The peer takes in one message beyond its unread limit, then none
    // until it drops the connection.
    let (go, told) = std::sync::mpsc::channel();
    let server_builder = || builder().max_unread_bytes(64 * 1024);
    let (addr, server) = serve_rdma(server_builder, 1, move |mut c| async move {
        let r = c.remove(0);
        until_told(&told, "the client's second send was offered").await;
        drop(r);
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(builder(), &dev, addr).await;
        let buf = r.pool().alloc_from(&pattern(LEN, 1)).expect("send buffer");
        let (res, _back) = timeout(WAIT, r.send_buf(buf)).await.expect("first send");
        res.unwrap();
        let buf = r.pool().alloc_from(&pattern(LEN, 2)).expect("send buffer");
        let at = buf.as_ptr();
        let mut send = pin!(r.send_buf(buf));
        // Its offer goes out and waits at the peer, which then goes down.
        let waited = timeout(Duration::from_millis(100), send.as_mut()).await;
        assert!(waited.is_err(), "the peer read it: {waited:?}");
        go.send(()).expect("the peer waits");
        let (res, back) = timeout(WAIT, send).await.expect("second send");
        assert!(res.is_err(), "the peer never read it: {res:?}");
        assert_eq!(back.as_ptr(), at, "the caller's buffer comes back");
        assert!(back[..] == pattern(LEN, 2)[..], "unchanged");
    });
    server.join().expect("server");
}

/// The receiver READs each large message into a registered vector, which
/// goes back to the connection when the application drops the message
/// (`receive_msg`): eight messages in a row take at most two vectors (one
/// the application holds, one being read), not one each.
#[test]
fn the_receiver_reuses_the_vectors_of_messages_it_dropped() {
    const N: u8 = 8;
    let (addr, server) = serve_rdma(builder, 1, move |mut c| async move {
        let r = c.remove(0);
        let want: Vec<Vec<u8>> = (0..N).map(|seed| pattern(LEN, seed)).collect();
        let big = big_allocs();
        for (seed, want) in want.iter().enumerate() {
            let m = r.receive_msg().await.unwrap();
            assert!(m[..] == want[..], "{seed}");
        }
        let fresh = big_allocs() - big;
        r.send(b"done").await.unwrap();
        let _ = r.receive().await;
        fresh
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(builder(), &dev, addr).await;
        for seed in 0..N {
            let buf = r
                .pool()
                .alloc_from(&pattern(LEN, seed))
                .expect("send buffer");
            let (res, _) = timeout(WAIT, r.send_buf(buf)).await.expect("send");
            res.unwrap();
        }
        assert_eq!(r.receive().await.unwrap(), b"done");
        r.send(b"bye").await.unwrap();
    });
    let fresh = server.join().expect("server");
    assert!(
        fresh <= 2,
        "{fresh} big allocations on the receiver for {N} messages of {LEN} bytes"
    );
}
