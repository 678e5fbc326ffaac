//! Staged messages lent from the receiver's staging ring (soft device, two
//! runtimes on two threads): `receive_msg` delivers a message the peer
//! wrote into the ring without copying it out; its bytes stay intact while
//! newer messages arrive; its ring bytes go back to the sender when it is
//! dropped, in the ring's order whatever the order of the drops; a
//! receiver that holds many lent messages never stalls the sender (they
//! are copied out once they hold up a quarter of the ring); lent bytes
//! count as unread until dropped; a receive cancelled while waiting loses
//! nothing; and a lent message outlives its connection.

mod common;

use std::pin::pin;
use std::time::Duration;

use common::*;
use verbio::runtime::timeout;
use verbio::RdmaBuilder;

/// Receive buffers of 1 KiB and a 64 KiB ring: messages from 1025 bytes
/// to 16 KiB go through the ring; a quarter of it is 16 KiB.
const BUF: usize = 1024;
const RING: usize = 64 * 1024;
/// A staged message: five are lent before they hold up a quarter.
const LEN: usize = 3000;

fn builder() -> RdmaBuilder {
    RdmaBuilder::new()
        .recv_buf_count(8)
        .credit_batch(2)
        .recv_buf_size(BUF)
        .staging_ring(RING)
}

/// The receiver's start: takes the dialer's first message (in pieces: it
/// makes this side announce its ring), answers one in pieces (the dialer
/// announces its ring) and waits for "ready".
async fn accept_side(r: &verbio::Rdma) {
    assert!(r.receive().await.unwrap() == pattern(10_000, 0));
    r.send(&pattern(10_000, 1)).await.unwrap();
    assert_eq!(r.receive().await.unwrap(), b"ready");
}

/// The dialer's start, against [`accept_side`].
async fn dial_side(dev: &verbio::runtime::Device, addr: std::net::SocketAddr) -> verbio::Rdma {
    let r = dial_rdma(builder(), dev, addr).await;
    r.send(&pattern(10_000, 0)).await.unwrap();
    assert!(r.receive().await.unwrap() == pattern(10_000, 1));
    r.send(b"ready").await.unwrap();
    assert!(r.staged_max_len() >= LEN, "the peer's ring was announced");
    r
}

/// The first 16 bytes of `m`, copied without its `Deref`.
fn head(m: &verbio::RecvMsg) -> [u8; 16] {
    let mut h = [0u8; 16];
    assert_eq!(m.copy_to(0, &mut h), 16);
    h
}

#[test]
fn a_lent_message_stays_intact_while_newer_ones_arrive() {
    const N: usize = 60; // 180 kB: the ring's bytes almost three times over
    let (addr, server) = serve_rdma(builder, 1, move |mut c| async move {
        let r = c.remove(0);
        accept_side(&r).await;
        let first = r.receive_msg().await.unwrap();
        assert!(first.is_lent_from_ring(), "a staged message is lent");
        assert!(!first.is_zero_copy(), "not in a receive buffer");
        assert_eq!(first.len(), LEN);
        let want = pattern(LEN, 0);
        assert!(head(&first) == want[..16]);
        let mut lent = 0;
        let mut copied_out_at = None;
        let all = async {
            for i in 1..N {
                let m = r.receive_msg().await.unwrap();
                lent += usize::from(m.is_lent_from_ring());
                // Read from the ring and through the private copy.
                assert!(head(&m) == pattern(LEN, i as u8)[..16], "message {i}");
                assert!(*m == pattern(LEN, i as u8), "message {i}");
                assert!(!m.is_lent_from_ring(), "a Deref copies");
                assert!(head(&first) == want[..16], "first, at message {i}");
                if copied_out_at.is_none() && !first.is_lent_from_ring() {
                    copied_out_at = Some(i);
                }
            }
        };
        timeout(WAIT, all)
            .await
            .expect("the sender went on while the first message was held");
        assert!(*first == want, "the first message, at the end");
        r.send(b"done").await.unwrap();
        let _ = r.receive().await;
        (lent, copied_out_at)
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_side(&dev, addr).await;
        for i in 0..N {
            timeout(WAIT, r.send(&pattern(LEN, i as u8)))
                .await
                .expect("the receiver held a lent message: the ring stayed full")
                .unwrap();
        }
        assert_eq!(r.receive().await.unwrap(), b"done");
        r.send(b"bye").await.unwrap();
    });
    let (lent, copied_out_at) = server.join().expect("server");
    assert!(lent >= N / 2, "only {lent} of {N} messages lent");
    // Held up behind the first: 3,000 bytes each, a quarter of the ring is
    // 16,384: the sixth would take them over.
    assert_eq!(
        copied_out_at,
        Some(5),
        "the held message is copied out once the messages behind it hold up a quarter of the ring"
    );
}

#[test]
fn lent_messages_dropped_out_of_order_return_their_ring_bytes_in_order() {
    let (addr, server) = serve_rdma(builder, 1, move |mut c| async move {
        let r = c.remove(0);
        accept_side(&r).await;
        let a = r.receive_msg().await.unwrap();
        let b = r.receive_msg().await.unwrap();
        let c = r.receive_msg().await.unwrap();
        for (m, i) in [(&a, 0u8), (&b, 1), (&c, 2)] {
            assert!(m.is_lent_from_ring(), "message {i} lent");
            assert!(head(m) == pattern(LEN, 0xa0 + i)[..16], "message {i}");
        }
        let unread_held = r.unread_bytes();
        // The newer ones first: nothing can go back while `a` is held.
        drop(c);
        drop(b);
        r.send(&pattern(2000, 0xb0)).await.unwrap();
        let d = r.receive_msg().await.unwrap();
        assert!(d.is_lent_from_ring(), "d lent");
        assert!(head(&a) == pattern(LEN, 0xa0)[..16], "a intact");
        assert!(*d == pattern(LEN, 0xa3));
        drop(d);
        drop(a);
        let unread_dropped = r.unread_bytes();
        // Four messages returned: three ride on the first reply, one on
        // the second.
        r.send(&pattern(2000, 0xb1)).await.unwrap();
        r.send(&pattern(2000, 0xb2)).await.unwrap();
        let e = r.receive_msg().await.unwrap();
        assert!(*e == pattern(LEN, 0xa4));
        r.send(b"done").await.unwrap();
        let _ = r.receive().await;
        (unread_held, unread_dropped)
    });
    let (rt, dev) = runtime_and_device();
    let (after_abc, after_d, after_e) = block(&rt, async {
        let r = dial_side(&dev, addr).await;
        for i in 0..3 {
            r.send(&pattern(LEN, 0xa0 + i)).await.unwrap();
        }
        let after_abc = r.staged_ring_reach();
        assert!(r.receive().await.unwrap() == pattern(2000, 0xb0));
        r.send(&pattern(LEN, 0xa3)).await.unwrap();
        let after_d = r.staged_ring_reach();
        assert!(r.receive().await.unwrap() == pattern(2000, 0xb1));
        assert!(r.receive().await.unwrap() == pattern(2000, 0xb2));
        r.send(&pattern(LEN, 0xa4)).await.unwrap();
        let after_e = r.staged_ring_reach();
        assert_eq!(r.receive().await.unwrap(), b"done");
        assert!(r.close_reason().is_none(), "{:?}", r.close_reason());
        r.send(b"bye").await.unwrap();
        (after_abc, after_d, after_e)
    });
    let (unread_held, unread_dropped) = server.join().expect("server");
    assert_eq!(after_abc, 3 * LEN, "a, b and c one after the other");
    assert_eq!(
        after_d,
        4 * LEN,
        "d after c: nothing returned while a was held, though b and c were dropped"
    );
    assert_eq!(
        after_e,
        4 * LEN,
        "e at the ring's start: every message returned once a was dropped"
    );
    assert!(
        unread_held >= 3 * LEN as u64,
        "three lent messages count as unread: {unread_held}"
    );
    assert!(
        unread_dropped < LEN as u64,
        "dropped, they do not: {unread_dropped}"
    );
}

#[test]
fn a_receiver_holding_every_lent_message_never_stalls_the_sender() {
    const N: usize = 80; // 240 kB into a 64 KiB ring
    let (addr, server) = serve_rdma(builder, 1, move |mut c| async move {
        let r = c.remove(0);
        accept_side(&r).await;
        // The first ones wait in the inbox, lent, until the sender finds
        // the ring full.
        verbio::runtime::sleep(Duration::from_millis(100)).await;
        let mut held = Vec::new();
        let mut max_unread = 0;
        let all = async {
            for _ in 0..N {
                held.push(r.receive_msg().await.unwrap());
                max_unread = max_unread.max(r.unread_bytes());
            }
        };
        timeout(WAIT, all)
            .await
            .expect("the sender went on while every message was held");
        let still_lent = held.iter().filter(|m| m.is_lent_from_ring()).count();
        for (i, m) in held.iter().enumerate() {
            assert!(**m == pattern(LEN, i as u8), "message {i}");
        }
        drop(held);
        r.send(b"done").await.unwrap();
        assert!(r.receive().await.unwrap() == pattern(LEN, 0xee));
        let _ = r.receive().await;
        (still_lent, max_unread)
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_side(&dev, addr).await;
        for i in 0..N {
            timeout(WAIT, r.send(&pattern(LEN, i as u8)))
                .await
                .expect("the receiver held its lent messages: the ring stayed full")
                .unwrap();
        }
        assert_eq!(r.receive().await.unwrap(), b"done");
        r.send(&pattern(LEN, 0xee)).await.unwrap();
        r.send(b"bye").await.unwrap();
    });
    let (still_lent, max_unread) = server.join().expect("server");
    assert!(
        (1..=6).contains(&still_lent),
        "{still_lent} messages still lent at the end: at most a quarter of the ring's worth"
    );
    // Lent messages count as unread (those in the inbox too), within the
    // ring they are in.
    assert!(
        (LEN as u64..=RING as u64).contains(&max_unread),
        "lent bytes held unread: {max_unread}"
    );
}

#[test]
fn a_cancelled_receive_loses_no_lent_message_and_one_outlives_its_connection() {
    let (addr, server) = serve_rdma(builder, 1, move |mut c| async move {
        let r = c.remove(0);
        accept_side(&r).await;
        {
            // Driving the receives, then dropped before anything arrived.
            let mut pending = pin!(r.receive_msg());
            assert!(futures::poll!(pending.as_mut()).is_pending());
        }
        r.send(b"go").await.unwrap();
        {
            let mut cancelled = pin!(r.receive_msg());
            assert!(futures::poll!(cancelled.as_mut()).is_pending());
            // The messages arrive while a receive that never runs again
            // waits.
            verbio::runtime::sleep(Duration::from_millis(100)).await;
        }
        let a = r.receive_msg().await.unwrap();
        let b = r.receive_msg().await.unwrap();
        assert!(a.is_lent_from_ring() && b.is_lent_from_ring());
        assert!(head(&a) == pattern(LEN, 1)[..16], "a, first");
        assert!(head(&b) == pattern(LEN, 2)[..16], "b, second");
        drop(a);
        // The peer closes; `b` is still lent.
        assert!(r.receive_msg().await.is_err(), "closed by the peer");
        assert!(b.is_lent_from_ring());
        assert!(head(&b) == pattern(LEN, 2)[..16], "b after the close");
        drop(r);
        assert!(*b == pattern(LEN, 2), "b after its connection was dropped");
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_side(&dev, addr).await;
        assert_eq!(r.receive().await.unwrap(), b"go");
        r.send(&pattern(LEN, 1)).await.unwrap();
        r.send(&pattern(LEN, 2)).await.unwrap();
        verbio::runtime::sleep(Duration::from_millis(300)).await;
        r.close().await.unwrap();
    });
    server.join().expect("server");
}
