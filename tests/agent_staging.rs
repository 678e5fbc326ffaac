//! Mid-size messages through the receiver's staging ring (soft device, two
//! runtimes on two threads): once the receiver has announced its ring (the
//! first message it would carry goes in pieces), a message longer than one
//! receive buffer and at most a quarter of the ring is one RDMA
//! WRITE_WITH_IMM (one credit), with an immediate of its own a WRITE and a
//! `Staged` SEND; they arrive whole and in order with the messages around
//! them as the ring wraps; an application that does not read holds them in
//! the ring (`max_unread_bytes`), in order; a send cancelled before it is
//! posted sends nothing; and an application's `write_with_imm` whose
//! immediate looks like a staged message's still arrives as an immediate.

mod common;

use std::pin::pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use verbio::runtime::{sleep, timeout};
use verbio::RdmaBuilder;

/// Receive buffers of 1 KiB and a 64 KiB ring: messages from 1025 bytes
/// to 16 KiB go through the ring.
const BUF: usize = 1024;
const RING: usize = 64 * 1024;
const STAGED_MAX: usize = RING / 4;

fn builder() -> RdmaBuilder {
    RdmaBuilder::new()
        .recv_buf_count(8)
        .credit_batch(2)
        .recv_buf_size(BUF)
        .staging_ring(RING)
}

/// Opened by the client of the cancel tests once it has cut its send: until
/// then the reader reads nothing, however slowly the client gets there.
#[derive(Clone, Default)]
struct Gate(Arc<AtomicBool>);

impl Gate {
    fn open(&self) {
        self.0.store(true, Ordering::Release);
    }

    /// Waits (at most `WAIT`) for [`Gate::open`].
    async fn wait(&self) {
        let start = Instant::now();
        while !self.0.load(Ordering::Acquire) {
            assert!(
                start.elapsed() < WAIT,
                "waiting for the client to cut its send"
            );
            sleep(Duration::from_millis(2)).await;
        }
    }
}

/// The reader of the cancel tests: it takes a first message, answers
/// "ready", then reads nothing until the client opens the gate (its
/// `max_unread_bytes`, 16 KiB, holding back the sender's credits), and at
/// last returns every message before "bye", in order.
fn serve_a_reader_that_holds_back() -> (
    std::net::SocketAddr,
    std::thread::JoinHandle<Vec<Vec<u8>>>,
    Gate,
) {
    let gate = Gate::default();
    let held = gate.clone();
    let (addr, server) = serve_rdma(
        || builder().max_unread_bytes(16 * 1024),
        1,
        move |mut c| async move {
            let r = c.remove(0);
            assert!(r.receive().await.unwrap() == pattern(10_000, 0));
            r.send(b"ready").await.unwrap();
            // Reads nothing while the client runs out and cuts its send.
            held.wait().await;
            let mut got = Vec::new();
            loop {
                let m = r.receive().await.unwrap();
                if m == b"bye" {
                    break;
                }
                got.push(m);
            }
            got
        },
    );
    (addr, server, gate)
}

/// Connects to [`serve_a_reader_that_holds_back`] and waits for its
/// "ready".
async fn dial_the_reader_that_holds_back(
    dev: &verbio::runtime::Device,
    addr: std::net::SocketAddr,
) -> verbio::Rdma {
    let r = dial_rdma(builder(), dev, addr).await;
    r.send(&pattern(10_000, 0)).await.unwrap();
    assert_eq!(r.receive().await.unwrap(), b"ready");
    r
}

/// Polls `f` for about a second (500 tries, 2 ms apart): its output, or
/// `None` while it is still stuck. The reader holds its credits back until
/// the gate opens, so a send that is stuck stays stuck; one that is only
/// slow (a loaded host) finishes within the second.
async fn poll_briefly<F: std::future::Future + Unpin>(f: &mut F) -> Option<F::Output> {
    for _ in 0..500 {
        if let std::task::Poll::Ready(v) = futures::poll!(&mut *f) {
            return Some(v);
        }
        sleep(Duration::from_millis(2)).await;
    }
    None
}

/// The sizes of the stream test: every size class of the ring's placement
/// (just above a piece, odd, exactly a quarter of the ring).
fn size(i: usize) -> usize {
    const SIZES: [usize; 6] = [BUF + 1, 5000, STAGED_MAX, 7777, 16_000, 12_345];
    SIZES[i % SIZES.len()]
}

#[test]
fn mid_size_messages_go_by_one_write_into_the_ring_in_order() {
    const N: usize = 120;
    let (addr, server) = serve_rdma(builder, 1, move |mut c| async move {
        let r = c.remove(0);
        // The first one, in pieces, makes this side announce its ring.
        assert!(r.receive().await.unwrap() == pattern(10_000, 0));
        r.send(b"ready").await.unwrap();
        assert!(r.receive().await.unwrap() == pattern(10_000, 1));
        for i in 0..N {
            let (got, imm) = r.receive_with_imm().await.unwrap();
            assert!(got == pattern(size(i), i as u8), "message {i}");
            assert_eq!(imm, (i % 3 == 0).then_some(i as u32), "message {i}");
            let small = r.receive().await.unwrap();
            assert_eq!(small, (i as u32).to_le_bytes(), "small message {i}");
        }
        r.send(b"done").await.unwrap();
        let _ = r.receive().await;
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(builder(), &dev, addr).await;
        r.send(&pattern(10_000, 0)).await.unwrap();
        assert_eq!(r.receive().await.unwrap(), b"ready");
        // The ring's announcement came before "ready": one credit, one WRITE.
        let credits = r.send_credits();
        assert!(credits >= 2, "{credits} credits: not enough to test with");
        let data = pattern(10_000, 1);
        let mut send = pin!(r.send(&data));
        let first = futures::poll!(send.as_mut());
        assert!(first.is_pending(), "a staged send waits for its WRITE");
        assert_eq!(
            credits - r.send_credits(),
            1,
            "a 10,000-byte message with 1 KiB buffers: one WRITE, not ten pieces"
        );
        timeout(WAIT, send).await.expect("send").unwrap();
        // Many times around the ring, with and without immediates,
        // interleaved with whole messages.
        for i in 0..N {
            let data = pattern(size(i), i as u8);
            if i % 3 == 0 {
                r.send_with_imm(&data, i as u32).await.unwrap();
            } else {
                r.send(&data).await.unwrap();
            }
            r.send(&(i as u32).to_le_bytes()).await.unwrap();
        }
        assert_eq!(r.receive().await.unwrap(), b"done");
        r.send(b"bye").await.unwrap();
    });
    server.join().expect("server");
}

#[test]
fn a_reader_that_does_not_read_holds_staged_messages_in_the_ring_in_order() {
    const LIMIT: u64 = 32 * 1024;
    const N: usize = 40;
    let len = 12_000;
    let (addr, server) = serve_rdma(
        || builder().max_unread_bytes(LIMIT),
        1,
        move |mut c| async move {
            let r = c.remove(0);
            assert!(r.receive().await.unwrap() == pattern(10_000, 0));
            r.send(b"ready").await.unwrap();
            sleep(Duration::from_millis(300)).await;
            let unread = r.unread_bytes();
            for i in 0..N {
                let got = r.receive().await.unwrap();
                assert!(got == pattern(len, i as u8), "message {i}");
                assert_eq!(r.receive().await.unwrap(), [i as u8], "small {i}");
            }
            r.send(b"done").await.unwrap();
            let _ = r.receive().await;
            unread
        },
    );
    let (rt, dev) = runtime_and_device();
    let early = block(&rt, async {
        let r = dial_rdma(builder(), &dev, addr).await;
        r.send(&pattern(10_000, 0)).await.unwrap();
        assert_eq!(r.receive().await.unwrap(), b"ready");
        let all = async {
            for i in 0..N {
                r.send(&pattern(len, i as u8)).await.unwrap();
                r.send(&[i as u8]).await.unwrap();
            }
        };
        let mut all = pin!(all);
        let early = timeout(Duration::from_millis(150), all.as_mut())
            .await
            .is_ok();
        timeout(WAIT, all).await.expect("the reader reads at last");
        assert_eq!(r.receive().await.unwrap(), b"done");
        r.send(b"bye").await.unwrap();
        early
    });
    assert!(!early, "480 kB went out to a reader that reads nothing");
    let unread = server.join().expect("server");
    // The limit, one staged message over it, and the small messages the
    // credits let through.
    assert!(
        unread <= LIMIT + len as u64 + 8 * BUF as u64,
        "unread backlog {unread}"
    );
}

#[test]
fn a_staged_send_cancelled_before_it_is_posted_sends_nothing() {
    // The reader holds back its credits (max_unread_bytes), so the sender
    // runs out: a staged send then waits for a credit, and is dropped.
    let (addr, server, gate) = serve_a_reader_that_holds_back();
    let (rt, dev) = runtime_and_device();
    let sent = block(&rt, async {
        let r = dial_the_reader_that_holds_back(&dev, addr).await;
        let mut sent = Vec::new();
        for i in 1..200u8 {
            let data = pattern(8000, i);
            let mut send = Box::pin(r.send(&data));
            if let Some(res) = poll_briefly(&mut send).await {
                res.unwrap();
                sent.push(pattern(8000, i));
                continue;
            }
            // Stuck: waiting for a credit (or, holding one, for ring
            // room). Dropped now: it gives back what it took.
            let credits = r.send_credits();
            drop(send);
            assert!(r.send_credits() >= credits, "a credit lost");
            gate.open();
            r.send(b"bye").await.unwrap();
            return sent;
        }
        panic!("the reader's backlog never stopped the sender");
    });
    let got = server.join().expect("server");
    assert_eq!(got.len(), sent.len(), "the cut message was not delivered");
    assert!(got == sent, "every finished message, in order");
}

#[test]
fn a_write_with_imm_whose_immediate_looks_staged_arrives_as_an_immediate() {
    let imms = [
        0xff00_0000u32,
        0xff12_3456,
        u32::MAX,
        0xfd12_3456,
        0xfeed,
        0xf000_0000,
        0xf712_3456,
    ];
    let (addr, server) = serve_rdma(builder, 1, move |mut c| async move {
        let r = c.remove(0);
        let remote = r.request_remote_mr(64).await.unwrap();
        for (i, &imm) in imms.iter().enumerate() {
            let mut data = r.alloc_local_mr(64).unwrap();
            data.fill(i as u8);
            let (res, _) = r.write_with_imm(data, &remote, imm).await;
            res.unwrap();
        }
        r.send(b"bye").await.unwrap();
        let _ = r.receive().await;
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(builder(), &dev, addr).await;
        for &imm in &imms {
            let got = timeout(WAIT, r.receive_write_imm()).await.expect("imm");
            assert_eq!(got.unwrap(), imm);
        }
        assert_eq!(r.receive().await.unwrap(), b"bye");
        assert!(r.close_reason().is_none(), "{:?}", r.close_reason());
        r.send(b"ok").await.unwrap();
    });
    server.join().expect("server");
}

/// `send_buf` of a message the ring carries writes the caller's registered
/// buffer itself: while its WRITE is in flight the pool lends no second
/// buffer (the bytes were copied into one before), the buffer comes back
/// unchanged when the send ends, and the messages arrive whole and in
/// order.
#[test]
fn send_buf_writes_a_staged_message_from_the_callers_buffer() {
    const SIZES: [(usize, u8); 3] = [(10_000, 1), (STAGED_MAX, 2), (BUF + 1, 3)];
    let (addr, server) = serve_rdma(builder, 1, move |mut c| async move {
        let r = c.remove(0);
        // The first one, in pieces, makes this side announce its ring.
        assert!(r.receive().await.unwrap() == pattern(10_000, 0));
        r.send(b"ready").await.unwrap();
        for (len, b) in SIZES {
            assert!(r.receive().await.unwrap() == pattern(len, b), "{len} bytes");
        }
        r.send(b"done").await.unwrap();
        let _ = r.receive().await;
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(builder(), &dev, addr).await;
        r.send(&pattern(10_000, 0)).await.unwrap();
        assert_eq!(r.receive().await.unwrap(), b"ready");
        assert!(r.staged_max_len() >= STAGED_MAX, "the ring was announced");
        for (len, b) in SIZES {
            let buf = r.pool().alloc_from(&pattern(len, b)).expect("send buffer");
            let in_use = r.pool().stats().blocks_in_use;
            let mut send = pin!(r.send_buf(buf));
            let first = futures::poll!(send.as_mut());
            assert!(first.is_pending(), "a staged send waits for its WRITE");
            assert_eq!(
                r.pool().stats().blocks_in_use,
                in_use,
                "a second send buffer for the WRITE of {len} bytes: the message was copied"
            );
            let (res, back) = timeout(WAIT, send).await.expect("send");
            res.unwrap();
            assert!(
                back[..] == pattern(len, b)[..],
                "the buffer came back as it was"
            );
        }
        assert_eq!(r.receive().await.unwrap(), b"done");
        r.send(b"bye").await.unwrap();
    });
    server.join().expect("server");
}

/// A request-reply exchange of staged messages runs without either
/// side's agent task, as one of whole messages does
/// (`agent_receive.rs`): the receiver takes each message straight from the
/// ring (before, it went through the inbox, which left the ring looking
/// untaken at the end of the pass: the agent ran for nearly every
/// message), and the replies return their credits themselves, in the
/// WRITE_WITH_IMM's immediate, one per message (before, each side's agent
/// sent a `Credit` every `credit_batch`, 16, messages: one more SEND,
/// receive and wake-up for the peer, and the sender's credits went down
/// by up to 16 between batches).
#[test]
fn staged_replies_need_no_agent_and_carry_their_credits() {
    const ROUNDS: u64 = 200;
    const LEN: usize = 8192;
    let (addr, server) = serve_rdma(RdmaBuilder::new, 1, |mut c| async move {
        let r = c.remove(0);
        let mut echoed = 0u64;
        let mut before = None;
        loop {
            let m = r.receive_msg().await.expect("ping");
            if m.len() != LEN {
                break;
            }
            if m[0] == 0xaa && before.is_none() {
                // The client's first measured round.
                before = Some(r.agent_turns());
            }
            r.send(&m).await.expect("echo");
            echoed += 1;
        }
        let turns = r.agent_turns() - before.expect("measured rounds");
        r.send(b"bye").await.expect("bye");
        let _ = r.receive().await;
        (turns, echoed)
    });
    let (rt, dev) = runtime_and_device();
    let client_turns = block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        // Until the server's ring is announced (the first messages go in
        // pieces) and the credits of those are back.
        let mut warm = 0u8;
        while r.staged_max_len() < LEN || warm < 40 {
            assert!(warm < 200, "the peer's ring was never announced");
            let mut w = pattern(LEN, warm);
            w[0] = 0;
            r.send(&w).await.expect("send");
            assert!(r.receive().await.expect("echo") == w);
            warm += 1;
        }
        let full = r.send_credits();
        let mut low = full;
        let before = r.agent_turns();
        let mut m = pattern(LEN, 1);
        for i in 0..ROUNDS {
            m[0] = 0xaa;
            m[1] = i as u8;
            r.send(&m).await.expect("send");
            assert!(
                r.receive_msg().await.expect("echo")[..] == m[..],
                "echo {i}"
            );
            low = low.min(r.send_credits());
        }
        let turns = r.agent_turns() - before;
        println!(
            "send credits after each of {ROUNDS} round trips: at least {low} of {full}; \
             client agent turns {turns}"
        );
        // A `StagingFreed` (credited) spends one, which the next reply
        // returns: one short at most.
        assert!(
            low + 1 >= full,
            "credits fell to {low} of {full}: they waited for a batch"
        );
        r.send(b"done").await.expect("done");
        assert_eq!(r.receive().await.expect("bye"), b"bye");
        assert!(r.close_reason().is_none(), "{:?}", r.close_reason());
        r.close().await.expect("close");
        turns
    });
    let (server_turns, echoed) = server.join().expect("server");
    println!("server agent turns {server_turns} in {echoed} round trips");
    // What is left: `StagingFreed` returns (one per MiB taken out, one or
    // two here) that may arrive while no receiver waits. The bound allows
    // one turn per 20 round trips.
    assert!(
        client_turns * 20 < ROUNDS,
        "client agent ran {client_turns} turns in {ROUNDS} round trips"
    );
    assert!(
        server_turns * 20 < ROUNDS,
        "server agent ran {server_turns} turns in {ROUNDS} round trips"
    );
}

/// Staged messages answering each other return the ring bytes of the
/// messages they answer in their immediates (wire version 12), so a
/// sender has every earlier message returned when it writes the next, and
/// starts it at the ring's start: in a request-reply exchange each side
/// writes the same first bytes of the peer's ring over and over (they stay
/// in the caches) instead of cycling through the whole ring. Replies with immediates of their own (a WRITE and a
/// `Staged` naming offset 0) restart alike; one-way bursts in between, with
/// several messages in flight, go on from there, and everything arrives
/// whole and in order.
#[test]
fn staged_replies_return_ring_bytes_and_keep_to_the_ring_start() {
    const ROUNDS: usize = 120;
    const LEN: usize = 10_000;
    const BURST: usize = 12;
    // Until then the first replies go in pieces (the client's ring is
    // announced meanwhile) and return nothing: the requests go on.
    const WARM: usize = 10;
    // Where a request after a reply with an immediate of its own (which
    // returns nothing) ends: after the one before.
    const STEADY: usize = 2 * (LEN + 7);
    // A ring of which two requests take less than a quarter: the server
    // returns them in its replies, not in a `StagingFreed` of its own
    // (which the next request might not wait for).
    const BIG_RING: usize = 4 * RING;
    let builder = || builder().staging_ring(BIG_RING);
    let msg = |i: usize| pattern(LEN + i % 7, i as u8);
    let (addr, server) = serve_rdma(builder, 1, move |mut c| async move {
        let r = c.remove(0);
        // The first one, in pieces, makes this side announce its ring.
        assert!(r.receive().await.unwrap() == pattern(10_000, 0));
        r.send(b"ready").await.unwrap();
        let mut warm = 0;
        for i in 0..ROUNDS {
            let (got, imm) = r.receive_with_imm().await.unwrap();
            assert!(got == msg(i), "request {i}");
            assert_eq!(imm, None, "request {i}");
            if i % 5 == 4 {
                r.send_with_imm(&got, i as u32).await.unwrap();
            } else {
                r.send(&got).await.unwrap();
            }
            if i % 40 == 39 {
                for j in 0..BURST {
                    assert!(r.receive().await.unwrap() == msg(1000 + j), "burst {j}");
                }
            }
            if i == WARM {
                warm = r.staged_ring_reach();
            }
        }
        let reach = r.staged_ring_reach();
        r.send(b"done").await.unwrap();
        let _ = r.receive().await;
        (warm, reach)
    });
    let (rt, dev) = runtime_and_device();
    let client_reach = block(&rt, async {
        let r = dial_rdma(builder(), &dev, addr).await;
        r.send(&pattern(10_000, 0)).await.unwrap();
        assert_eq!(r.receive().await.unwrap(), b"ready");
        assert!(r.staged_max_len() >= LEN + 7, "the ring was announced");
        let mut warm = 0;
        let mut reach_before_bursts = 0;
        for i in 0..ROUNDS {
            r.send(&msg(i)).await.unwrap();
            let (got, imm) = r.receive_with_imm().await.unwrap();
            assert!(got == msg(i), "reply {i}");
            assert_eq!(imm, (i % 5 == 4).then_some(i as u32), "reply {i}");
            if i == WARM {
                warm = r.staged_ring_reach();
            }
            if i == 38 {
                reach_before_bursts = r.staged_ring_reach();
            }
            if i % 40 == 39 {
                // Several in flight: they go on from where the ring's
                // order puts them, waiting for returned bytes if need be.
                let burst = (0..BURST).map(|j| msg(1000 + j)).collect::<Vec<_>>();
                let sends = burst.iter().map(|m| r.send(m));
                for res in futures::future::join_all(sends).await {
                    res.unwrap();
                }
            }
        }
        println!(
            "client's reach into the server's ring: {warm} after {WARM} round trips, \
             {reach_before_bursts} after 39, {} at the end",
            r.staged_ring_reach()
        );
        assert!(
            reach_before_bursts <= warm.max(STEADY),
            "requests of about {LEN} bytes, each answered before the next, reached \
             {reach_before_bursts} bytes into a {BIG_RING}-byte ring after 39 round trips, \
             {warm} after {WARM}: they did not restart at its start"
        );
        assert_eq!(r.receive().await.unwrap(), b"done");
        assert!(r.close_reason().is_none(), "{:?}", r.close_reason());
        r.send(b"bye").await.unwrap();
        r.staged_ring_reach()
    });
    let (server_warm, server_reach) = server.join().expect("server");
    println!(
        "server's reach into the client's ring: {server_warm} after {WARM} round trips, \
         {server_reach} at the end"
    );
    assert!(
        server_reach <= server_warm.max(LEN + 7),
        "replies of about {LEN} bytes, each answered before the next, reached {server_reach} \
         bytes into a {BIG_RING}-byte ring after {ROUNDS} round trips, {server_warm} after \
         {WARM}: they did not restart at its start"
    );
    assert!(client_reach <= BIG_RING);
}

/// A window of `send_buf`s of staged messages larger than the peer's
/// credits (8) and than its ring holds (64 KiB: four of the largest) takes
/// every way `send_buf`'s staged future has: posted in its first poll,
/// waiting for a credit alone and then posted, and waiting for the ring's
/// gate or room on the general path. Every message arrives whole and in
/// the order the sends were started.
#[test]
fn a_window_of_staged_send_bufs_beyond_the_credits_and_the_ring_arrives_in_order() {
    use futures::stream::{FuturesUnordered, StreamExt};
    const N: usize = 240;
    const WINDOW: usize = 32;
    let (addr, server) = serve_rdma(builder, 1, move |mut c| async move {
        let r = c.remove(0);
        // The first one, in pieces, makes this side announce its ring.
        assert!(r.receive().await.unwrap() == pattern(10_000, 0));
        r.send(b"ready").await.unwrap();
        for i in 0..N {
            let got = r.receive().await.unwrap();
            assert!(got == pattern(size(i), i as u8), "message {i}");
        }
        r.send(b"done").await.unwrap();
        let _ = r.receive().await;
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(builder(), &dev, addr).await;
        r.send(&pattern(10_000, 0)).await.unwrap();
        assert_eq!(r.receive().await.unwrap(), b"ready");
        assert!(r.staged_max_len() >= STAGED_MAX, "the ring was announced");
        let mut in_flight = FuturesUnordered::new();
        let mut waited = 0;
        for i in 0..N {
            let buf = buf_from(r.pool(), &pattern(size(i), i as u8));
            let mut send = Box::pin(r.send_buf(buf));
            // Polled once here, in start order (as the window's first
            // poll would): it takes its credit and place in turn.
            if let std::task::Poll::Ready((res, _)) = futures::poll!(send.as_mut()) {
                res.unwrap();
                continue;
            }
            if r.send_credits() == 0 {
                waited += 1;
            }
            in_flight.push(send);
            while in_flight.len() >= WINDOW {
                let (res, _buf) = timeout(WAIT, in_flight.next())
                    .await
                    .expect("send")
                    .unwrap();
                res.unwrap();
            }
        }
        while let Some((res, _buf)) = timeout(WAIT, in_flight.next()).await.expect("send") {
            res.unwrap();
        }
        assert!(
            waited > 0,
            "the window never ran out of credits: nothing was tested"
        );
        assert_eq!(
            timeout(WAIT, r.receive()).await.expect("done").unwrap(),
            b"done"
        );
        assert!(r.close_reason().is_none(), "{:?}", r.close_reason());
        r.send(b"bye").await.unwrap();
    });
    server.join().expect("server");
}

/// A `send_buf` of a staged message dropped while it waits (for a credit,
/// the reader holding them back with `max_unread_bytes`, or holding one,
/// for room) gives back what it took: no credit is lost, the message never
/// arrives, its buffer goes back to the pool, and the messages before and
/// after it arrive in order.
#[test]
fn a_staged_send_buf_cancelled_while_it_waits_sends_nothing() {
    let (addr, server, gate) = serve_a_reader_that_holds_back();
    let (rt, dev) = runtime_and_device();
    let sent = block(&rt, async {
        let r = dial_the_reader_that_holds_back(&dev, addr).await;
        assert!(r.staged_max_len() >= 8000, "the ring was announced");
        let mut sent = Vec::new();
        for i in 1..200u8 {
            let in_use = r.pool().stats().blocks_in_use;
            let mut send = Box::pin(r.send_buf(buf_from(r.pool(), &pattern(8000, i))));
            if let Some((res, _buf)) = poll_briefly(&mut send).await {
                res.unwrap();
                sent.push(pattern(8000, i));
                continue;
            }
            // Stuck, never posted: dropped now, it gives back what it took.
            let credits = r.send_credits();
            drop(send);
            assert!(r.send_credits() >= credits, "a credit lost");
            assert_eq!(
                r.pool().stats().blocks_in_use,
                in_use,
                "the cancelled send's buffer did not go back to the pool"
            );
            gate.open();
            let after = pattern(9000, i);
            let (res, _) = r.send_buf(buf_from(r.pool(), &after)).await;
            res.unwrap();
            sent.push(after);
            r.send(b"bye").await.unwrap();
            return sent;
        }
        panic!("the reader's backlog never stopped the sender");
    });
    let got = server.join().expect("server");
    assert_eq!(got.len(), sent.len(), "the cut message was delivered");
    assert!(got == sent, "every finished message, in order");
}
