//! Many `Rdma` connections on one soft device (issue 31): a listener holds
//! `VERBIO_CROWD_CONNS` (default 1,000) connections at once, each with a
//! tiny message echoed and every byte checked, with and without a shared
//! receive queue; the device adds CQs as the connections' claims outgrow
//! its first CQ (before, the 4,096-entry CQ refused receive rings past
//! about 180 connections). Memory per connection (both ends, RSS) is
//! printed; docs/benchmarks.md records it. `VERBIO_CROWD_ONLY=ring` or
//! `=srq` runs one of the two, so its memory is measured in a fresh
//! process (the second run of a process reuses the first one's heap);
//! `=default` runs the listener's default instead (rings for its first
//! connections, its SRQ beyond), and `VERBIO_CROWD_SIZE=default` gives
//! the connections `RdmaBuilder`'s default sizes.

mod common;

use std::net::SocketAddr;
use std::sync::mpsc;

use common::crowd::*;
use common::*;
use verbio::runtime::spawn;
use verbio::{Rdma, RdmaBuilder};

/// Connections held at once.
fn crowd() -> usize {
    std::env::var("VERBIO_CROWD_CONNS")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(1000)
}

/// How a run's listener receives.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Receives {
    /// Every connection its own receive ring.
    Rings,
    /// Every connection on one shared receive queue of this depth.
    Srq(u32),
    /// The builder's default: rings for the first
    /// `DEFAULT_SRQ_ABOVE`, the SRQ beyond.
    Default,
}

/// Which runs `VERBIO_CROWD_ONLY` asks for (`ring`, `srq` or `default`;
/// by default the first two).
fn runs() -> Vec<Receives> {
    match std::env::var("VERBIO_CROWD_ONLY").as_deref() {
        Ok("ring") => vec![Receives::Rings],
        Ok("srq") => vec![Receives::Srq(256)],
        Ok("default") => vec![Receives::Default],
        _ => vec![Receives::Rings, Receives::Srq(256)],
    }
}

/// Connections dialled at once.
const DIAL_BATCH: usize = 32;

/// Small connections: the test is about how many, not how fast.
/// `VERBIO_CROWD_SIZE=default` keeps `RdmaBuilder`'s defaults instead
/// (64 receive buffers of 4 KiB), for the memory a default connection takes.
fn small() -> RdmaBuilder {
    if std::env::var("VERBIO_CROWD_SIZE").as_deref() == Ok("default") {
        return RdmaBuilder::new();
    }
    RdmaBuilder::new()
        .recv_buf_size(256)
        .recv_buf_count(8)
        .credit_batch(2)
        .staging_ring(0)
}

/// The message of connection `i`: its number, then a pattern.
fn message(i: usize) -> Vec<u8> {
    let mut m = (i as u32).to_le_bytes().to_vec();
    m.extend(pattern(1 + i % 200, i as u8));
    m
}

/// The connection number a message names, if it is that connection's
/// message byte for byte.
fn sender_of(m: &[u8]) -> Option<usize> {
    let i = u32::from_le_bytes(m.get(..4)?.try_into().ok()?) as usize;
    (m == message(i)).then_some(i)
}

/// A server thread holding `n` connections at once: it accepts them all,
/// then echoes one message of each, then waits for each to close. Returns
/// the device's CQ count and the process's RSS (KiB) once all echoed.
fn serve_crowd(
    receives: Receives,
    n: usize,
) -> (SocketAddr, std::thread::JoinHandle<(usize, u64)>) {
    let (tx, rx) = mpsc::channel();
    let th = std::thread::spawn(move || {
        let (rt, dev) = runtime_and_device();
        let d = dev.clone();
        let all_held = run(&rt, n, async move {
            let b = small().device(d);
            let b = match receives {
                Receives::Srq(depth) => b.shared_receive_queue(depth),
                // Every connection its own receive ring, however many.
                Receives::Rings => b.no_shared_receive_queue(),
                Receives::Default => b,
            };
            let l = b.listen("127.0.0.1:0".parse().unwrap()).expect("listen");
            tx.send(l.local_addr().unwrap()).unwrap();
            let mut conns = Vec::with_capacity(n);
            for i in 0..n {
                let r = l
                    .accept()
                    .await
                    .unwrap_or_else(|e| panic!("accept {i} of {n}: {e}"));
                conns.push(r);
            }
            // Accepted in the order the handshakes finished: each message
            // names its sender, and each sender is seen once.
            let mut seen = vec![false; n];
            for (k, r) in conns.iter().enumerate() {
                let m = r
                    .receive()
                    .await
                    .unwrap_or_else(|e| panic!("receive of accepted connection {k}: {e}"));
                let i = sender_of(&m)
                    .unwrap_or_else(|| panic!("accepted connection {k}: malformed message"));
                assert!(!std::mem::replace(&mut seen[i], true), "message {i} twice");
                r.send(&m).await.expect("echo");
            }
            let all_held = rss_kib();
            for (i, r) in conns.iter().enumerate() {
                assert!(
                    r.receive().await.is_err(),
                    "connection {i}: nothing more was sent"
                );
            }
            all_held
        });
        (dev.cq_count(), all_held)
    });
    (rx.recv_timeout(WAIT).expect("server start"), th)
}

/// Dials `n` connections to `addr` (in batches), sends each its message,
/// checks the echoes; returns the RSS growth since `before` while all
/// were open, the device's CQ count, and the seconds the dialing took.
fn dial_crowd(addr: SocketAddr, n: usize, before: u64) -> (u64, usize, f64) {
    let (rt, dev) = runtime_and_device();
    let r =
        run(&rt, n, async {
            let t0 = std::time::Instant::now();
            let mut conns: Vec<Rdma> = Vec::with_capacity(n);
            while conns.len() < n {
                let batch: Vec<_> = (0..DIAL_BATCH.min(n - conns.len()))
                    .map(|_| {
                        let dev = dev.clone();
                        spawn(async move { small().device(dev).connect(addr).await })
                    })
                    .collect();
                for h in batch {
                    let k = conns.len();
                    conns.push(h.await.unwrap_or_else(|e| {
                        panic!("connect {k} of {n}: {}", verbio::ErrorChain(&e))
                    }));
                    if n >= 2000 && conns.len() % (n / 10) == 0 {
                        let (user, sys) = cpu_secs();
                        eprintln!(
                            "{} of {n} Rdma connections at {:.2?} (process CPU user {user:.2} s, \
                         system {sys:.2} s)",
                            conns.len(),
                            t0.elapsed()
                        );
                    }
                }
            }
            let dialed = t0.elapsed().as_secs_f64();
            for (i, c) in conns.iter().enumerate() {
                c.send(&message(i)).await.expect("send");
            }
            for (i, c) in conns.iter().enumerate() {
                let back = c.receive().await.expect("echo");
                assert_eq!(back, message(i), "echo of connection {i}");
            }
            if n >= 2000 {
                eprintln!("{n} echoes back at {:.2?}", t0.elapsed());
            }
            (rss_kib().saturating_sub(before), dev.cq_count(), dialed)
        });
    drop(rt);
    r
}

/// Where a child process dials (`VERBIO_CROWD_DIAL`: the listener's
/// address, with `VERBIO_CROWD_CONNS` connections).
const DIAL_ENV: &str = "VERBIO_CROWD_DIAL";

/// A listener holding `n` connections, dialed from this process if its
/// file limit holds both ends' sockets, else from a child process (this
/// test with [`DIAL_ENV`] set); prints the memory per connection and
/// returns the client device's CQ count.
fn crowd_to(receives: Receives, n: usize) -> usize {
    let before = rss_kib();
    let one_process = fds_for(n, 2) == n;
    let n = if one_process { n } else { fds_for(n, 1) };
    let (addr, server) = serve_crowd(receives, n);
    let (grown, cqs, dialed, ends) = if one_process {
        let (grown, cqs, dialed) = dial_crowd(addr, n, before);
        (grown, cqs, dialed, "both ends")
    } else {
        let status = std::process::Command::new(std::env::current_exe().expect("test binary"))
            .args([
                "a_thousand_rdma_connections_on_one_device",
                "--exact",
                "--nocapture",
            ])
            .env(DIAL_ENV, addr.to_string())
            .env("VERBIO_CROWD_CONNS", n.to_string())
            .status()
            .expect("the client process");
        assert!(status.success(), "the client process: {status}");
        (0, 0, f64::NAN, "listener's process")
    };
    let (server_cqs, server_rss) = server.join().expect("server");
    let grown = if one_process {
        grown
    } else {
        server_rss.saturating_sub(before)
    };
    eprintln!(
        "{n} Rdma connections{}: client device {} CQs, server device {} CQs, \
         {} KiB RSS per connection ({ends}); dialed in {dialed:.2} s",
        match receives {
            Receives::Rings => String::new(),
            Receives::Srq(d) => format!(" (listener SRQ of {d})"),
            Receives::Default => " (listener's default: rings, then its SRQ)".to_string(),
        },
        cqs,
        server_cqs,
        grown / n as u64,
    );
    cqs
}

#[test]
fn a_thousand_rdma_connections_on_one_device() {
    let n = crowd();
    if let Some(addr) = std::env::var(DIAL_ENV).ok().and_then(|a| a.parse().ok()) {
        // The client process of a run too large for one.
        let n = fds_for(n, 1);
        let (grown, cqs, dialed) = dial_crowd(addr, n, rss_kib());
        eprintln!(
            "{n} Rdma connections dialed in {dialed:.2} s: client device {cqs} CQs, \
             {} KiB RSS per connection (client process)",
            grown / n as u64
        );
        return;
    }
    for receives in runs() {
        let cqs = crowd_to(receives, n);
        // 256 CQ entries claimed per QP: more than the first CQ holds.
        if receives == Receives::Rings && n > 16 && cqs > 0 {
            assert!(cqs > 1, "{n} connections fit in one CQ of 4,096?");
        }
    }
}
