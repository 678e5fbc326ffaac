//! The staging budget (soft device, a server runtime and a client runtime
//! on two threads): the staging rings a side's connections hold registered
//! never exceed the `StagingBudget` they share; connections that find it
//! spent announce no ring and their mid-size messages still arrive whole
//! and in order (in pieces or by READ); a connection that goes down gives
//! its ring back, and the next connection that wants one gets it; and a
//! peer sending one mid-size message on each of many connections makes a
//! server with default settings pin at most `DEFAULT_STAGING_BUDGET`.

mod common;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;
use futures::future::join_all;
use verbio::ops::agent::{DEFAULT_STAGING_BUDGET, DEFAULT_STAGING_RING};
use verbio::runtime::sleep;
use verbio::{Rdma, RdmaBuilder, StagingBudget};

/// Receive buffers of 1 KiB and 64 KiB rings: messages from 1025 bytes to
/// 16 KiB go through a ring, larger ones (from 32 KiB) by READ.
const BUF: usize = 1024;
const RING: usize = 64 * 1024;

fn builder() -> RdmaBuilder {
    RdmaBuilder::new()
        .recv_buf_count(8)
        .credit_batch(2)
        .recv_buf_size(BUF)
        .staging_ring(RING)
}

/// Mid-size messages of every path: through the ring (or in pieces
/// without one), and by READ.
fn size(i: usize) -> usize {
    const SIZES: [usize; 5] = [BUF + 1, 5000, RING / 4, 12_345, 40_000];
    SIZES[i % SIZES.len()]
}

/// Runs `body` on a server thread (its own runtime and device) with a
/// listener built by `builder`; returns its address and the thread.
fn server<F, Fut, R>(
    builder: impl FnOnce() -> RdmaBuilder + Send + 'static,
    body: F,
) -> (SocketAddr, std::thread::JoinHandle<R>)
where
    F: FnOnce(verbio::RdmaListener) -> Fut + Send + 'static,
    Fut: Future<Output = R> + 'static,
    R: Send + 'static,
{
    let (tx, rx) = mpsc::channel();
    let th = std::thread::spawn(move || {
        let (rt, dev) = runtime_and_device();
        block(&rt, async move {
            let l = builder()
                .device(dev)
                .listen("127.0.0.1:0".parse().unwrap())
                .expect("listen");
            tx.send(l.local_addr().unwrap()).unwrap();
            body(l).await
        })
    });
    (rx.recv_timeout(WAIT).expect("server start"), th)
}

/// Waits (bounded by half of [`WAIT`], within the test's own bound) until
/// `budget` holds `bytes`.
async fn until_in_use(budget: &StagingBudget, bytes: usize) {
    let start = Instant::now();
    while budget.in_use() != bytes {
        assert!(
            start.elapsed() < WAIT / 2,
            "waited for the staging budget to hold {bytes} bytes: it holds {}",
            budget.in_use()
        );
        sleep(Duration::from_millis(5)).await;
    }
}

#[test]
fn connections_beyond_the_budget_fall_back_and_every_byte_arrives_in_order() {
    const CONNS: usize = 5;
    const RINGS: usize = 2;
    const N: usize = 30;
    let budget = StagingBudget::new(RINGS * RING);
    let server_budget = budget.clone();
    let budget_seen = budget.clone();
    let (addr, server) = server(
        move || builder().staging_budget(server_budget),
        move |l| async move {
            let mut conns = Vec::new();
            for _ in 0..CONNS {
                conns.push(l.accept().await.expect("accept"));
            }
            join_all(conns.iter().enumerate().map(|(c, r)| async move {
                // The first one, in pieces, makes this side want a ring.
                assert!(r.receive().await.unwrap() == pattern(10_000, c as u8));
                r.send(b"ready").await.unwrap();
                for i in 0..N {
                    let got = r.receive().await.unwrap();
                    assert!(
                        got == pattern(size(i), (c * N + i) as u8),
                        "connection {c}, message {i}"
                    );
                    let small = r.receive().await.unwrap();
                    assert_eq!(small, (i as u32).to_le_bytes(), "connection {c}, {i}");
                }
            }))
            .await;
            // Everything arrived; no connection has gone down yet.
            let in_use = StagingBudget::in_use(&budget_seen);
            join_all(conns.iter().map(|r| async move {
                r.send(b"done").await.unwrap();
                let _ = r.receive().await;
            }))
            .await;
            in_use
        },
    );
    let (rt, dev) = runtime_and_device();
    let staged = block(&rt, async {
        let mut conns: Vec<Rdma> = Vec::new();
        for _ in 0..CONNS {
            conns.push(dial_rdma(builder(), &dev, addr).await);
        }
        let staged = join_all(conns.iter().enumerate().map(|(c, r)| async move {
            r.send(&pattern(10_000, c as u8)).await.unwrap();
            assert_eq!(r.receive().await.unwrap(), b"ready");
            for i in 0..N {
                r.send(&pattern(size(i), (c * N + i) as u8)).await.unwrap();
                r.send(&(i as u32).to_le_bytes()).await.unwrap();
            }
            assert_eq!(r.receive().await.unwrap(), b"done");
            let staged = r.staged_max_len();
            r.send(b"bye").await.unwrap();
            staged
        }))
        .await;
        assert!(
            budget.peak() <= budget.limit(),
            "peak {} over the limit {}",
            budget.peak(),
            budget.limit()
        );
        assert!(
            budget.refused() >= (CONNS - RINGS) as u64,
            "{} refusals",
            budget.refused()
        );
        staged
    });
    let in_use = server.join().expect("server");
    assert_eq!(in_use, RINGS * RING, "every ring the budget allows");
    let with_ring = staged.iter().filter(|&&n| n > 0).count();
    assert_eq!(
        with_ring, RINGS,
        "connections whose peer announced a ring: {staged:?}"
    );
    assert!(
        staged.iter().all(|&n| n == 0 || n == RING / 4),
        "{staged:?}"
    );
}

#[test]
fn a_connection_that_goes_down_gives_its_ring_back_to_the_next() {
    let budget = StagingBudget::new(RING);
    let server_budget = budget.clone();
    let (addr, server) = server(
        move || builder().staging_budget(server_budget),
        move |l| async move {
            // Each connection: mid-size messages echoed until it closes.
            let mut served = Vec::new();
            for c in 0..3 {
                let r = l.accept().await.expect("accept");
                served.push(verbio::runtime::spawn(async move {
                    while let Ok(m) = r.receive().await {
                        if r.send(&m).await.is_err() {
                            break;
                        }
                    }
                    c
                }));
            }
            for s in served {
                s.await;
            }
        },
    );
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        async fn echo(r: &Rdma, seed: u8) {
            let data = pattern(5000, seed);
            r.send(&data).await.unwrap();
            assert!(r.receive().await.unwrap() == data, "echo {seed}");
        }
        let a = dial_rdma(builder(), &dev, addr).await;
        echo(&a, 1).await;
        until_in_use(&budget, RING).await;
        echo(&a, 2).await;
        assert_eq!(a.staged_max_len(), RING / 4, "the first gets the ring");

        let b = dial_rdma(builder(), &dev, addr).await;
        for i in 0..4 {
            echo(&b, 10 + i).await;
        }
        assert_eq!(b.staged_max_len(), 0, "the budget holds one ring");
        assert!(budget.refused() >= 4, "{} refusals", budget.refused());

        drop(a);
        until_in_use(&budget, 0).await;

        let c = dial_rdma(builder(), &dev, addr).await;
        echo(&c, 20).await;
        until_in_use(&budget, RING).await;
        echo(&c, 21).await;
        assert_eq!(c.staged_max_len(), RING / 4, "the ring given back");
        echo(&b, 30).await;
        assert_eq!(b.staged_max_len(), 0, "still one ring");
        assert!(budget.peak() <= RING, "peak {}", budget.peak());
        drop((b, c));
        until_in_use(&budget, 0).await;
    });
    server.join().expect("server");
}

#[test]
fn one_mid_size_message_on_each_of_many_connections_pins_at_most_the_default_budget() {
    // Default rings (4 MiB) and budget (the server thread's, 64 MiB):
    // more connections than it has rings for.
    const CONNS: usize = 20;
    let (addr, server) = server(RdmaBuilder::new, move |l| async move {
        let mut conns = Vec::new();
        for _ in 0..CONNS {
            conns.push(l.accept().await.expect("accept"));
        }
        join_all(conns.iter().enumerate().map(|(c, r)| async move {
            assert!(r.receive().await.unwrap() == pattern(5 * 1024, c as u8));
        }))
        .await;
        let budget = StagingBudget::this_thread();
        let held = (budget.in_use(), budget.peak(), budget.refused());
        join_all(conns.iter().map(|r| r.send(b"ok"))).await;
        // The peers close: their rings come back while this side still
        // holds the connections.
        until_in_use(&budget, 0).await;
        drop(conns);
        held
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let mut conns = Vec::new();
        for _ in 0..CONNS {
            conns.push(dial_rdma(RdmaBuilder::new(), &dev, addr).await);
        }
        join_all(conns.iter().enumerate().map(|(c, r)| async move {
            r.send(&pattern(5 * 1024, c as u8)).await.unwrap();
            assert_eq!(r.receive().await.unwrap(), b"ok");
        }))
        .await;
        join_all(conns.into_iter().map(Rdma::close)).await;
    });
    let (in_use, peak, refused) = server.join().expect("server");
    let rings = DEFAULT_STAGING_BUDGET / DEFAULT_STAGING_RING;
    assert!(rings < CONNS, "the test wants more connections than rings");
    assert!(peak <= DEFAULT_STAGING_BUDGET, "peak {peak}");
    assert_eq!(
        in_use, DEFAULT_STAGING_BUDGET,
        "every ring the budget allows"
    );
    assert_eq!(refused, (CONNS - rings) as u64);
}
