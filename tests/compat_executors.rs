//! verbio driven from other executors (`verbio::runtime::compat`): tokio
//! (a `LocalSet` on a current-thread runtime) and async-io (the reactor of
//! smol and async-std). Ops on the soft device are awaited by the host's
//! own tasks, side by side with the host's sockets and timers, and with
//! verbio's own spawned tasks and timers; the peer runs on another thread
//! with a plain verbio runtime, so completions arrive while the host
//! executor sleeps in its own poller (a lost wake-up fails the test's time
//! bound instead of hanging).

mod common;

use std::cell::Cell;
use std::future::Future;
use std::rc::Rc;
use std::time::{Duration, Instant};

use common::*;
use verbio::ops::verbs::Verbs;
use verbio::runtime::buf::MrPool;
use verbio::runtime::compat;
use verbio::runtime::{Device, QueuePair, Runtime};

/// Round trips per test.
const ROUNDS: usize = 300;

/// A peer thread (its own verbio runtime and device) that echoes `rounds`
/// messages back on one QP, then exits.
fn echo_peer(rounds: usize) -> (std::net::SocketAddr, std::thread::JoinHandle<()>) {
    serve(1, move |mut qps: Vec<QueuePair>, dev: Device| async move {
        let qp = qps.pop().expect("one QP");
        let pool = MrPool::new(dev.pd());
        for i in 0..rounds {
            let (res, b) = qp.recv(buf(&pool, 256)).await;
            let n = res.unwrap_or_else(|e| panic!("peer recv {i}: {e}")).len;
            let (res, _) = qp.send(buf_from(&pool, &b[..n])).await;
            res.unwrap_or_else(|e| panic!("peer send {i}: {e}"));
        }
    })
}

/// `ROUNDS` SENDs, each awaited with its echo, checked byte for byte.
async fn ping(qp: &QueuePair, pool: &MrPool) {
    for i in 0..ROUNDS {
        let msg = pattern(64 + i % 128, i as u8);
        let reply = qp.recv(buf(pool, 256));
        let (res, _) = qp.send(buf_from(pool, &msg)).await;
        res.unwrap_or_else(|e| panic!("send {i}: {e}"));
        let (res, b) = reply.await;
        let n = res.unwrap_or_else(|e| panic!("recv {i}: {e}")).len;
        assert_eq!(&b[..n], &msg[..], "echo {i}");
    }
}

/// `fut` under tokio, failing the test after [`WAIT`] (a lost wake-up
/// would otherwise hang it).
async fn tokio_bounded<F: Future>(fut: F) -> F::Output {
    tokio::time::timeout(WAIT, fut)
        .await
        .expect("timed out: a wake-up was lost")
}

/// `fut` under async-io, failing the test after [`WAIT`].
async fn async_io_bounded<F: Future>(fut: F) -> F::Output {
    use futures::future::{select, Either};
    match select(std::pin::pin!(fut), async_io::Timer::after(WAIT)).await {
        Either::Left((out, _)) => out,
        Either::Right(_) => panic!("timed out: a wake-up was lost"),
    }
}

fn soft_device() -> Option<(Runtime, Device)> {
    if let Some(dev) = test_device() {
        println!("SKIPPED: soft-device test ({TEST_DEVICE_ENV}={dev})");
        return None;
    }
    Some(runtime_and_device())
}

#[test]
fn tokio_tasks_await_ops_beside_tokio_sockets_and_timers() {
    let Some((rt, dev)) = soft_device() else {
        return;
    };
    let (addr, peer) = echo_peer(ROUNDS);
    let host = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let local = tokio::task::LocalSet::new();
    let started = Instant::now();
    let out = local.block_on(
        &host,
        tokio_bounded(compat::tokio::run_until(&rt, async {
            let qp = verbio::connect(addr, &qps(&dev), HANDSHAKE)
                .await
                .expect("connect")
                .qp;
            let pool = MrPool::new(dev.pd());
            // A tokio TCP echo running at the same time, on tokio's reactor.
            let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let tcp_addr = tcp.local_addr().unwrap();
            let tcp_echo = tokio::task::spawn_local(async move {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let (mut s, _) = tcp.accept().await.unwrap();
                let mut b = [0u8; 64];
                for _ in 0..ROUNDS {
                    s.read_exact(&mut b).await.unwrap();
                    s.write_all(&b).await.unwrap();
                }
            });
            let tcp_ping = tokio::task::spawn_local(async move {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let mut s = tokio::net::TcpStream::connect(tcp_addr).await.unwrap();
                let mut b = [7u8; 64];
                for _ in 0..ROUNDS {
                    s.write_all(&b).await.unwrap();
                    s.read_exact(&mut b).await.unwrap();
                }
            });
            // A verbio task and a verbio timer, run by the turns.
            let ticks = Rc::new(Cell::new(0));
            let t2 = ticks.clone();
            let ticker = verbio::runtime::spawn(async move {
                for _ in 0..5 {
                    verbio::runtime::sleep(Duration::from_millis(2)).await;
                    t2.set(t2.get() + 1);
                }
            });
            // The RDMA ping-pong in a tokio task, with tokio's timer.
            let pinger = tokio::task::spawn_local({
                let qp = qp.clone();
                async move {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    ping(&qp, &pool).await;
                }
            });
            pinger.await.unwrap();
            tcp_echo.await.unwrap();
            tcp_ping.await.unwrap();
            ticker.await;
            ticks.get()
        })),
    );
    assert_eq!(out.expect("tokio adapter"), 5);
    peer.join().expect("peer");
    assert!(
        started.elapsed() < WAIT,
        "took {:?}: a completion waited for an unrelated wake-up",
        started.elapsed()
    );
}

#[test]
fn async_io_drives_ops_and_both_timers() {
    let Some((rt, dev)) = soft_device() else {
        return;
    };
    let (addr, peer) = echo_peer(ROUNDS);
    let started = Instant::now();
    let out = async_io::block_on(async_io_bounded(compat::async_io::run_until(&rt, async {
        let qp = verbio::connect(addr, &qps(&dev), HANDSHAKE)
            .await
            .expect("connect")
            .qp;
        let pool = MrPool::new(dev.pd());
        async_io::Timer::after(Duration::from_millis(1)).await;
        let ping = ping(&qp, &pool);
        let timers = async {
            for _ in 0..3 {
                verbio::runtime::sleep(Duration::from_millis(3)).await;
            }
        };
        futures::join!(ping, timers);
        "done"
    })));
    assert_eq!(out.expect("async-io adapter"), "done");
    peer.join().expect("peer");
    assert!(started.elapsed() < WAIT, "took {:?}", started.elapsed());
}

#[test]
fn an_idle_tokio_driver_sleeps_until_the_completion() {
    let Some((rt, dev)) = soft_device() else {
        return;
    };
    // The peer answers only after 300 ms: meanwhile the driver must sleep
    // in tokio's poller (few turns), and wake for the completion.
    let (addr, peer) = serve(1, |mut qps: Vec<QueuePair>, dev: Device| async move {
        let qp = qps.pop().expect("one QP");
        let pool = MrPool::new(dev.pd());
        verbio::runtime::sleep(Duration::from_millis(300)).await;
        let (res, _) = qp.send(buf_from(&pool, b"late")).await;
        res.expect("peer send");
    });
    let host = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let local = tokio::task::LocalSet::new();
    let polls = Rc::new(Cell::new(0u32));
    let started = Instant::now();
    let got = local.block_on(&host, async {
        let p = polls.clone();
        // Counts how often tokio polls the task that awaits the op: a
        // driver that spins instead of sleeping would keep it busy.
        let work = async {
            let qp = verbio::connect(addr, &qps(&dev), HANDSHAKE)
                .await
                .expect("connect")
                .qp;
            let pool = MrPool::new(dev.pd());
            let mut recv = std::pin::pin!(qp.recv(buf(&pool, 64)));
            let (res, b) = std::future::poll_fn(|cx| {
                p.set(p.get() + 1);
                recv.as_mut().poll(cx)
            })
            .await;
            let n = res.expect("recv").len;
            b[..n].to_vec()
        };
        tokio_bounded(compat::tokio::run_until(&rt, work)).await
    });
    assert_eq!(got.expect("tokio adapter"), b"late");
    let waited = started.elapsed();
    peer.join().expect("peer");
    assert!(waited >= Duration::from_millis(250), "returned early");
    assert!(waited < Duration::from_secs(5), "woke late: {waited:?}");
    println!("{} polls of the waiting task in {waited:?}", polls.get());
    assert!(polls.get() < 50, "{} polls while idle", polls.get());
}

#[test]
fn the_rdma_agent_works_under_tokio() {
    let Some((rt, dev)) = soft_device() else {
        return;
    };
    // An async-rdma-style server on a plain verbio thread: echoes messages
    // and lends memory.
    let (addr, server) = serve_rdma(verbio::RdmaBuilder::new, 1, |mut conns| async move {
        let rdma = conns.pop().expect("one connection");
        for _ in 0..50 {
            let m = rdma.receive().await.expect("server receive");
            rdma.send(&m).await.expect("server send");
        }
        let lent = rdma.receive_remote_mr().await.expect("lent memory");
        let back = rdma.alloc_local_mr(lent.len()).expect("local mr");
        let (res, back) = rdma.read(back, &lent).await;
        res.expect("server read");
        rdma.send(&back[..]).await.expect("server send read bytes");
        rdma.send_remote_mr(lent).await.expect("hand back");
        // Stay connected until the client has it: a send resolves once
        // posted, and a device torn down with it in flight loses it.
        assert_eq!(rdma.receive().await.expect("client done"), b"done");
    });
    let host = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let local = tokio::task::LocalSet::new();
    local
        .block_on(
            &host,
            tokio_bounded(compat::tokio::run_until(&rt, async {
                let rdma = dial_rdma(verbio::RdmaBuilder::new(), &dev, addr).await;
                for i in 0..50u32 {
                    let msg = pattern(100 + i as usize * 37, i as u8);
                    rdma.send(&msg).await.expect("send");
                    // A tokio timer between the verbio futures.
                    tokio::time::sleep(Duration::from_micros(200)).await;
                    assert_eq!(rdma.receive().await.expect("receive"), msg);
                }
                rdma.send_local_mr(pattern(4096, 9)).await.expect("lend");
                let read = rdma.receive().await.expect("read bytes");
                assert_eq!(read, pattern(4096, 9));
                let mem = rdma.receive_local_mr().await.expect("handed back");
                assert_eq!(mem, pattern(4096, 9));
                rdma.send(b"done").await.expect("send done");
            })),
        )
        .expect("tokio adapter");
    server.join().expect("server");
}
