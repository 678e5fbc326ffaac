//! The receive path of the high-level `Rdma` connection (soft device, two
//! runtimes on two threads): the task awaiting `receive_msg` takes its
//! message from the completion itself, yet the connection's control
//! messages keep flowing when no receiver polls (a `receive_msg` future
//! held without being polled), and concurrent receivers share the
//! messages without losing or duplicating any.

mod common;

use std::cell::{Cell, RefCell};
use std::future::poll_fn;
use std::pin::pin;
use std::rc::Rc;
use std::task::{Poll, Waker};
use std::time::Duration;

use common::*;
use verbio::runtime::{sleep, spawn, timeout};
use verbio::RdmaBuilder;

const WAIT: Duration = Duration::from_secs(10);

/// Server: returns every credit at once (batch 1), so the client's sends
/// depend on its `Credit` messages.
fn server_builder() -> RdmaBuilder {
    RdmaBuilder::new().recv_buf_count(1).credit_batch(1)
}

/// Closes a connection its receivers shared, once they are done with it.
async fn close_shared(r: Rc<verbio::Rdma>) {
    Rc::try_unwrap(r)
        .expect("last handle")
        .close()
        .await
        .expect("close");
}

#[test]
fn a_receive_future_held_without_polls_does_not_stall_the_credits() {
    const SENDS: usize = 40; // 40 times the server's one buffer
    let (addr, server) = serve_rdma(server_builder, 1, |mut c| async move {
        let r = c.remove(0);
        let hello = r.receive().await.expect("hello");
        r.send(&hello).await.expect("echo");
        for i in 0..SENDS {
            let m = r.receive().await.expect("server receive");
            assert_eq!(m, (i as u32).to_le_bytes(), "in order");
        }
        r.send(b"done").await.expect("done");
        // Until the client closes.
        let _ = r.receive().await;
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        // A round trip first: the server's first credits have arrived and
        // the connection is quiet.
        r.send(b"hello").await.expect("hello");
        assert_eq!(r.receive().await.expect("echo"), b"hello");
        // Polled once: it now waits as the connection's receiver, and is
        // then left alone while this task sends.
        let mut held = pin!(r.receive_msg());
        assert!(futures::poll!(held.as_mut()).is_pending());
        for i in 0..SENDS as u32 {
            // Each send after the first waits for a `Credit` from the
            // server, which only the agent can take while `held` sleeps.
            timeout(WAIT, r.send(&i.to_le_bytes()))
                .await
                .expect("a send waiting for credits must not hang")
                .expect("send");
        }
        let m = timeout(WAIT, held).await.expect("bounded").expect("done");
        assert_eq!(&m[..], b"done");
        r.shutdown().await.expect("close");
    });
    server.join().expect("server");
}

/// A receiver woken by its message that neither polls again nor is
/// dropped: the agent takes the message into the inbox (charged to the
/// unread bytes) at the end of the pass; the receiver dropped then, the
/// next one gets it from there.
#[test]
fn a_message_a_woken_receiver_does_not_take_goes_to_the_inbox() {
    let (addr, server) = serve_rdma(RdmaBuilder::new, 1, |mut c| async move {
        let r = c.remove(0);
        assert_eq!(r.receive().await.expect("go"), b"go");
        r.send(b"late").await.expect("send");
        let _ = r.receive().await; // until the client closes
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let mut held = Box::pin(r.receive_msg());
        assert!(futures::poll!(held.as_mut()).is_pending());
        r.send(b"go").await.expect("send");
        let t = std::time::Instant::now();
        while r.unread_bytes() == 0 {
            assert!(t.elapsed() < WAIT, "the message never reached the inbox");
            sleep(Duration::from_millis(1)).await;
        }
        drop(held);
        let m = timeout(WAIT, r.receive()).await.expect("bounded");
        assert_eq!(m.expect("receive"), b"late");
        assert_eq!(r.unread_bytes(), 0);
        r.close().await.expect("close");
    });
    server.join().expect("server");
}

#[test]
fn concurrent_receivers_share_the_messages() {
    const MSGS: u32 = 600;
    let (addr, server) = serve_rdma(RdmaBuilder::new, 1, |mut c| async move {
        let r = c.remove(0);
        for i in 0..MSGS {
            r.send(&i.to_le_bytes()).await.expect("send");
        }
        let _ = r.receive().await; // until the client closes
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = Rc::new(dial_rdma(RdmaBuilder::new(), &dev, addr).await);
        let receivers: Vec<_> = (0..3)
            .map(|k| {
                let r = r.clone();
                spawn(async move {
                    let mut got = Vec::new();
                    // Each takes its share; the last ones stop on a timeout.
                    while let Ok(m) = timeout(Duration::from_millis(500), r.receive()).await {
                        let m = m.expect("receive");
                        got.push(u32::from_le_bytes(m[..4].try_into().unwrap()));
                        if k == 0 {
                            sleep(Duration::from_micros(50)).await;
                        }
                    }
                    got
                })
            })
            .collect();
        let mut all = Vec::new();
        let mut shares = Vec::new();
        for h in receivers {
            let got = h.await;
            // Each receiver sees its messages in arrival order.
            assert!(got.windows(2).all(|w| w[0] < w[1]), "out of order: {got:?}");
            shares.push(got.len());
            all.extend(got);
        }
        all.sort_unstable();
        assert_eq!(
            all,
            (0..MSGS).collect::<Vec<_>>(),
            "each message exactly once"
        );
        assert_eq!(r.unread_bytes(), 0);
        // Receivers take turns at the connection's receives.
        assert!(
            shares.iter().all(|&n| n > 0),
            "a receiver got nothing: {shares:?}"
        );
        println!("shares of {MSGS} messages: {shares:?}");
        close_shared(r).await;
    });
    server.join().expect("server");
}

#[test]
fn the_agent_task_sleeps_through_a_request_reply_exchange() {
    const ROUNDS: u64 = 500;
    let (addr, server) = serve_rdma(RdmaBuilder::new, 1, |mut c| async move {
        let r = c.remove(0);
        for _ in 0..ROUNDS + 10 {
            let m = r.receive_msg().await.expect("ping");
            r.send(&m).await.expect("echo");
        }
        let turns = r.agent_turns();
        let _ = r.receive_msg().await;
        turns
    });
    let (rt, dev) = runtime_and_device();
    let client_turns = block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        for _ in 0..10 {
            r.send(b"warm").await.expect("send");
            r.receive_msg().await.expect("echo");
        }
        let before = r.agent_turns();
        for i in 0..ROUNDS {
            r.send(&i.to_le_bytes()).await.expect("send");
            let m = r.receive_msg().await.expect("echo");
            assert_eq!(&m[..], &i.to_le_bytes());
        }
        let turns = r.agent_turns() - before;
        r.close().await.expect("close");
        turns
    });
    let server_turns = server.join().expect("server");
    println!("agent turns in {ROUNDS} round trips: client {client_turns}, server {server_turns}");
    // Each message reaches the receiver without the agent; the credits
    // ride on the replies. Without the pass hook the agent runs at least
    // once per message on each side. A completion polled in the same pass
    // right after the receiver ran (common on rxe) wakes the receiver for
    // the next pass, and its hook fires only after that pass's tasks. The
    // bound allows one turn per 50 round trips.
    assert!(
        client_turns * 50 < ROUNDS,
        "client agent ran {client_turns} turns in {ROUNDS} round trips"
    );
    assert!(
        server_turns * 50 < ROUNDS + 10,
        "server agent ran {server_turns} turns in {} round trips",
        ROUNDS + 10
    );
}

/// The driving receiver's waker stays registered across its round trips:
/// a receiver that left (one that returned, and one dropped while it
/// waited) is not woken by later messages (its task, now waiting for
/// something else, is left alone and the agent queues them), and a
/// receiver of another task that drives next is woken, not the task of
/// the receiver before it.
#[test]
fn a_receiver_that_left_is_not_woken_and_the_next_one_is() {
    let (addr, server) = serve_rdma(RdmaBuilder::new, 1, |mut c| async move {
        let r = c.remove(0);
        // Echoes until the client closes.
        while let Ok(m) = r.receive().await {
            r.send(&m).await.expect("echo");
        }
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = Rc::new(dial_rdma(RdmaBuilder::new(), &dev, addr).await);
        // Task A receives one message, drops a receiver that waited, then
        // waits (counting its polls) until released.
        let polls = Rc::new(Cell::new(0u32));
        let release: Rc<RefCell<(bool, Option<Waker>)>> = Rc::default();
        let a = spawn({
            let (r, polls, release) = (r.clone(), polls.clone(), release.clone());
            async move {
                let m = r.receive().await.expect("receive");
                {
                    let mut dropped = pin!(r.receive_msg());
                    assert!(futures::poll!(dropped.as_mut()).is_pending());
                }
                poll_fn(|cx| {
                    polls.set(polls.get() + 1);
                    let mut rel = release.borrow_mut();
                    if rel.0 {
                        Poll::Ready(())
                    } else {
                        rel.1 = Some(cx.waker().clone());
                        Poll::Pending
                    }
                })
                .await;
                m
            }
        });
        r.send(b"1").await.expect("send");
        let t = std::time::Instant::now();
        while polls.get() == 0 {
            assert!(t.elapsed() < WAIT, "A never received");
            sleep(Duration::from_millis(1)).await;
        }
        // A message with no receiver: the agent queues it; A sleeps on.
        r.send(b"late").await.expect("send");
        while r.unread_bytes() == 0 {
            assert!(t.elapsed() < WAIT, "the message never reached the inbox");
            sleep(Duration::from_millis(1)).await;
        }
        sleep(Duration::from_millis(20)).await;
        assert_eq!(polls.get(), 1, "a receiver that left was woken");
        // Task B takes the queued message, then drives and waits.
        let b = spawn({
            let r = r.clone();
            async move {
                let late = r.receive().await.expect("queued");
                let next = r.receive().await.expect("receive");
                (late, next)
            }
        });
        sleep(Duration::from_millis(20)).await;
        r.send(b"2").await.expect("send");
        let (late, next) = timeout(WAIT, b)
            .await
            .expect("the next receiver was not woken");
        assert_eq!((&late[..], &next[..]), (&b"late"[..], &b"2"[..]));
        assert_eq!(polls.get(), 1, "B's message woke A");
        let w = {
            let mut rel = release.borrow_mut();
            rel.0 = true;
            rel.1.take()
        };
        w.expect("A waits").wake();
        assert_eq!(timeout(WAIT, a).await.expect("A ends"), b"1");
        close_shared(r).await;
    });
    server.join().expect("server");
}

/// Whole messages are lent in the receive-ring slots they landed in: held
/// ones keep their bytes while later messages arrive and credits keep
/// flowing; once the ring's spare slots (half of `recv_buf_count`) are
/// lent, later messages are copied out; dropped, lent messages free their
/// slots for zero-copy again; and a lent message outlives its connection
/// and its runtime.
#[test]
fn held_messages_stay_in_their_slots_and_later_ones_are_copied_out() {
    const HELD: usize = 40;
    const BUFS: u32 = 16;
    let builder = || RdmaBuilder::new().recv_buf_count(BUFS).credit_batch(4);
    let msg = |i: usize| pattern(64, i as u8);
    let (addr, server) = serve_rdma(builder, 1, move |mut c| async move {
        let r = c.remove(0);
        for i in 0..HELD {
            r.send(&msg(i)).await.expect("send");
        }
        assert_eq!(r.receive().await.expect("go on"), b"dropped");
        r.send(&msg(100)).await.expect("send");
        r.send(&msg(101)).await.expect("send");
        let _ = r.receive_msg().await;
    });
    let (rt, dev) = runtime_and_device();
    let last = block(&rt, async {
        let r = dial_rdma(builder(), &dev, addr).await;
        // More messages than the peer has credits: held ones cannot block it.
        let mut held = Vec::new();
        for _ in 0..HELD {
            held.push(r.receive_msg().await.expect("message"));
        }
        let lent: Vec<bool> = held.iter().map(|m| m.is_zero_copy()).collect();
        let spare = BUFS as usize / 2;
        assert!(
            lent[..spare].iter().all(|&z| z) && lent[spare..].iter().all(|&z| !z),
            "the first {spare} lent, the rest copied out: {lent:?}"
        );
        for (i, m) in held.iter().enumerate() {
            assert_eq!(
                &m[..],
                &msg(i)[..],
                "message {i} intact while later ones arrived"
            );
        }
        drop(held);
        r.send(b"dropped").await.expect("send");
        let a = r.receive_msg().await.expect("message");
        assert!(
            a.is_zero_copy(),
            "slots given back by dropped messages lend again"
        );
        assert_eq!(&a[..], &msg(100)[..]);
        let b = r.receive_msg().await.expect("message");
        r.close().await.expect("close");
        (a, b)
    });
    server.join().expect("server");
    // The runtime goes first: the lent slots' memory stays with them.
    drop(rt);
    assert_eq!(
        &last.0[..],
        &msg(100)[..],
        "a lent message outlives its connection"
    );
    assert_eq!(&last.1[..], &msg(101)[..], "and its runtime");
    drop(last);
}

/// A receiver that lets go of each message before it takes the next one
/// gets every message of a window-sized burst in its slot: the burst is
/// not taken whole into the inbox, where the messages past the ring's
/// spare slots were copied out (half of a 4 KiB window was).
#[test]
fn a_burst_taken_message_by_message_stays_in_its_slots() {
    use futures::stream::{FuturesUnordered, StreamExt};
    const N: usize = 600;
    const LEN: usize = 4096;
    const WINDOW: usize = 128;
    let (addr, server) = serve_rdma(RdmaBuilder::new, 1, |mut c| async move {
        let r = c.remove(0);
        let mut in_flight = FuturesUnordered::new();
        for i in 0..N {
            in_flight.push(r.send_buf(buf_from(r.pool(), &pattern(LEN, i as u8))));
            while in_flight.len() >= WINDOW {
                in_flight.next().await.unwrap().0.expect("send");
            }
        }
        while let Some((res, _buf)) = in_flight.next().await {
            res.expect("send");
        }
        drop(in_flight);
        assert_eq!(r.receive().await.expect("done"), b"done");
        r.send(b"bye").await.expect("bye");
    });
    let (rt, dev) = runtime_and_device();
    let copied = block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let mut copied = Vec::new();
        for i in 0..N {
            let m = timeout(WAIT, r.receive_msg())
                .await
                .expect("a message within the bound")
                .expect("message");
            assert_eq!(&m[..], &pattern(LEN, i as u8)[..], "message {i}");
            if !m.is_zero_copy() {
                copied.push(i);
            }
        }
        r.send(b"done").await.expect("done");
        assert_eq!(r.receive().await.expect("bye"), b"bye");
        copied
    });
    server.join().expect("server");
    assert!(copied.is_empty(), "messages copied out: {copied:?}");
}
