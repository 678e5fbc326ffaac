//! Many plain RC connections held by one handshake listener (issue 31):
//! a client device dials `VERBIO_HANDSHAKE_CONNS` (default 1,000)
//! connections, `DIAL_WINDOW` at a time (half the listener's per-source
//! cap of handshakes at once: a handshake ends on the client before the
//! listener has read its last frame, so a client dialing at the cap
//! itself gets refusals), and the listener's device holds them all, each
//! QP checked by one SEND at the end. The connect rate of each tenth and
//! the memory per connection are printed (docs/benchmarks.md records
//! them): a rate that falls by an order of magnitude late in the run is
//! the cliff the issue reported (8,000 connections: 176 handshakes timed
//! out and the rate fell 20 times).
//!
//! Each connection holds a TCP socket at both ends (the handshake's
//! stream, kept as the liveness signal), so the test raises its
//! `RLIMIT_NOFILE` soft limit to what it needs, up to the hard limit;
//! when two sockets per connection do not fit, the clients run in a
//! child process (this test again), and a count one socket per
//! connection does not fit either is lowered, saying so.

mod common;

use std::net::SocketAddr;
use std::sync::mpsc;
use std::time::Instant;

use common::crowd::*;
use common::*;
use verbio::ops::connect::{connect, Connection, Listener};
use verbio::runtime::spawn;
use verbio::runtime::QueuePair;
use verbio::Verbs;

/// Connections held at once.
fn wanted() -> usize {
    std::env::var("VERBIO_HANDSHAKE_CONNS")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(1000)
}

/// Handshakes the client runs at once: half the listener's per-source cap.
const DIAL_WINDOW: usize = verbio::ops::connect::DEFAULT_MAX_PENDING_PER_SOURCE / 2;

/// Connections whose SENDs are timed one after another.
const TIMED: usize = 200;

/// A server holding `n` connections: accepts them all, then receives one
/// message on each QP (each posted a receive as it was accepted). Returns
/// the process's RSS once all were accepted (KiB).
fn serve_held(n: usize) -> (SocketAddr, std::thread::JoinHandle<u64>) {
    let (tx, rx) = mpsc::channel();
    let th = std::thread::spawn(move || {
        let (rt, dev) = runtime_and_device();
        let pool = verbio::runtime::buf::MrPool::new(dev.pd());
        let listener: Listener<_> = listen(&dev);
        tx.send(listener.local_addr().unwrap()).unwrap();
        run(&rt, n, async {
            let mut held: Vec<Connection<QueuePair>> = Vec::with_capacity(n);
            let mut receives = Vec::with_capacity(n);
            while held.len() < n {
                let c = listener
                    .accept()
                    .await
                    .unwrap_or_else(|e| panic!("accept {} of {n}: {e}", held.len()));
                receives.push(c.qp.recv(buf(&pool, 64)));
                held.push(c);
            }
            let all_held = rss_kib();
            // Accepted in the order the handshakes finished: each message
            // names its client, and each client is seen once.
            let mut seen = vec![false; n];
            for (i, r) in receives.into_iter().enumerate() {
                let (res, b) = r.await;
                let got = res.unwrap_or_else(|e| panic!("receive on connection {i}: {e}"));
                let k = <[u8; 8]>::try_from(&b[..got.len])
                    .map(|k| u64::from_le_bytes(k) as usize)
                    .unwrap_or_else(|_| panic!("connection {i}: {} bytes", got.len));
                assert!(k < n, "connection {i}: client {k}?");
                assert!(!std::mem::replace(&mut seen[k], true), "client {k} twice");
            }
            all_held
        })
    });
    (rx.recv_timeout(WAIT).expect("server start"), th)
}

/// Dials `n` connections to `addr` and holds them, sending one message
/// on each; prints the rates, and the RSS grown since `before` (KiB) per
/// connection.
fn dial_held(addr: SocketAddr, n: usize, before: u64, ends: &str) {
    let (rt, dev) = runtime_and_device();
    let pool = verbio::runtime::buf::MrPool::new(dev.pd());
    let tenth = n.div_ceil(10).max(1);
    run(&rt, n, async {
        let t0 = Instant::now();
        let mut mark = t0;
        let mut rates = Vec::new();
        let mut held: Vec<Connection<QueuePair>> = Vec::with_capacity(n);
        let mut slowest = std::time::Duration::ZERO;
        while held.len() < n {
            let batch: Vec<_> = (0..DIAL_WINDOW.min(n - held.len()))
                .map(|_| {
                    let qps = qps(&dev);
                    spawn(async move {
                        let t = Instant::now();
                        connect(addr, &qps, HANDSHAKE)
                            .await
                            .map(|c| (c, t.elapsed()))
                    })
                })
                .collect();
            for h in batch {
                let k = held.len();
                let (c, took) = h
                    .await
                    .unwrap_or_else(|e| panic!("connect {k} of {n}: {}", verbio::ErrorChain(&e)));
                slowest = slowest.max(took);
                held.push(c);
                if held.len() % tenth == 0 {
                    let now = Instant::now();
                    rates.push(tenth as f64 / (now - mark).as_secs_f64());
                    eprintln!(
                        "{} of {n} connected at {:.2?} ({:.0}/s, process CPU user {:.2} s, \
                         system {:.2} s)",
                        held.len(),
                        now - t0,
                        rates[rates.len() - 1],
                        cpu_secs().0,
                        cpu_secs().1
                    );
                    mark = now;
                }
            }
        }
        let secs = t0.elapsed().as_secs_f64();
        let grown = rss_kib().saturating_sub(before);
        // One SEND on each: on the first `TIMED` one after another (the
        // time of one SEND's completion with this many QPs on the device),
        // on the others all at once.
        let t1 = Instant::now();
        let timed = TIMED.min(n);
        for (i, c) in held.iter().enumerate().take(timed) {
            let (res, _) = c.qp.send(buf_from(&pool, &(i as u64).to_le_bytes())).await;
            res.unwrap_or_else(|e| panic!("send on connection {i}: {e}"));
        }
        let one_send = t1.elapsed() / timed.max(1) as u32;
        let rest: Vec<_> = held
            .iter()
            .enumerate()
            .skip(timed)
            .map(|(i, c)| c.qp.send(buf_from(&pool, &(i as u64).to_le_bytes())))
            .collect();
        for (i, (res, _)) in futures::future::join_all(rest)
            .await
            .into_iter()
            .enumerate()
        {
            res.unwrap_or_else(|e| panic!("send on connection {}: {e}", timed + i));
        }
        let worst = rates.iter().copied().fold(f64::INFINITY, f64::min);
        let best = rates.iter().copied().fold(0.0, f64::max);
        eprintln!(
            "{n} connections held by one handshake listener in {secs:.2} s \
             ({:.0}/s, slowest handshake {slowest:.2?}); per tenth: {}; worst tenth \
             {:.1}x below the best; {} KiB RSS per connection ({ends}); \
             a SEND's completion {one_send:.2?} (one after another on {timed})",
            n as f64 / secs,
            rates
                .iter()
                .map(|r| format!("{r:.0}"))
                .collect::<Vec<_>>()
                .join(" "),
            best / worst,
            grown / n as u64,
        );
        held
    });
    drop(rt);
}

/// Where a child process runs the clients (`VERBIO_HANDSHAKE_DIAL`: the
/// listener's address).
const DIAL_ENV: &str = "VERBIO_HANDSHAKE_DIAL";

#[test]
fn a_handshake_listener_holds_many_connections() {
    let want = wanted();
    if let Some(addr) = std::env::var(DIAL_ENV).ok().and_then(|a| a.parse().ok()) {
        // The client process of a run too large for one (see below).
        dial_held(addr, fds_for(want, 1), rss_kib(), "client process");
        return;
    }
    if fds_for(want, 2) == want {
        let before = rss_kib();
        let (addr, server) = serve_held(want);
        dial_held(addr, want, before, "both ends");
        server.join().expect("server");
        return;
    }
    // Two sockets per connection do not fit this process's file limit:
    // the clients run in a child process (this test, `DIAL_ENV` set), so
    // each process holds one socket per connection.
    let n = fds_for(want, 1);
    let before = rss_kib();
    let (addr, server) = serve_held(n);
    let status = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "a_handshake_listener_holds_many_connections",
            "--exact",
            "--nocapture",
        ])
        .env(DIAL_ENV, addr.to_string())
        .env("VERBIO_HANDSHAKE_CONNS", n.to_string())
        .status()
        .expect("the client process");
    assert!(status.success(), "the client process: {status}");
    let grown = server.join().expect("server").saturating_sub(before);
    eprintln!(
        "{n} connections: {} KiB RSS per connection in the listener's process",
        grown / n as u64
    );
}
