//! Connect/close cycles of `Rdma` connections reusing one client device
//! (issue 31): `VERBIO_CHURN_CYCLES` (default 2,000) cycles, each a connect,
//! one message echoed and checked, and a close, none refused; the process's
//! memory (RSS) after the cycles stays within a bound of what it was after
//! the first few hundred (the QPs, rings, CQ claims and handshake state of
//! closed connections come back). The RSS per cycle is printed.

mod common;

use std::sync::mpsc;

use common::*;
use verbio::runtime::timeout;
use verbio::RdmaBuilder;

/// Connect/close cycles.
fn cycles() -> usize {
    std::env::var("VERBIO_CHURN_CYCLES")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(2000)
}

/// Cycles before the first measurement (allocator arenas, slabs and
/// caches reach their working size).
const WARM_UP: usize = 300;

/// How much RSS may grow after the warm-up. Closing connections linger a
/// little (their agents say goodbye, their QPs drain), so the resident
/// set moves by a few MiB from run to run; a closed connection that kept
/// 10 KiB (a connection here is about 250 KiB per end) would add 17 MiB
/// over the default cycles.
const GROWTH_BOUND: u64 = 16 << 20;

/// Why the resident set says nothing about leaks in this build, if it
/// does not: under AddressSanitizer (`scripts/asan-test.sh` sets
/// `VERBIO_ASAN`) freed memory stays in the sanitizer's quarantine (256
/// MiB by default), so RSS grows with every byte freed.
fn rss_not_meaningful() -> Option<&'static str> {
    std::env::var_os("VERBIO_ASAN")
        .map(|_| "under AddressSanitizer, whose quarantine keeps freed memory resident")
}

/// The process's resident memory, in bytes (`VmRSS`).
fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/self/status");
    kb * 1024
}

fn small() -> RdmaBuilder {
    RdmaBuilder::new()
        .recv_buf_size(256)
        .recv_buf_count(8)
        .credit_batch(2)
        .staging_ring(0)
}

#[test]
fn connect_and_close_many_times_on_one_device_memory_flat() {
    let n = cycles();
    let (tx, rx) = mpsc::channel();
    let server = std::thread::spawn(move || {
        let (rt, dev) = runtime_and_device();
        // Each wait is bounded by WAIT; the whole by the cycle count.
        rt.block_on(async move {
            let l = small()
                .device(dev)
                .listen("127.0.0.1:0".parse().unwrap())
                .expect("listen");
            tx.send(l.local_addr().unwrap()).unwrap();
            for i in 0..n {
                let r = timeout(WAIT, l.accept())
                    .await
                    .unwrap_or_else(|_| panic!("accept {i} of {n}: timed out"))
                    .unwrap_or_else(|e| panic!("accept {i} of {n}: {e}"));
                let m = timeout(WAIT, r.receive())
                    .await
                    .expect("message in time")
                    .expect("message");
                r.send(&m).await.expect("echo");
                // The client closes after reading the echo.
                let end = timeout(WAIT, r.receive()).await.expect("close in time");
                assert!(end.is_err(), "cycle {i}: nothing more sent");
            }
        })
    });
    let addr = rx.recv_timeout(WAIT).expect("server start");
    let (rt, dev) = runtime_and_device();
    let mut warm = 0;
    let started = std::time::Instant::now();
    let cqs = rt.block_on(async {
        for i in 0..n {
            if i == WARM_UP.min(n / 2) {
                warm = rss();
            }
            let c = timeout(WAIT, small().device(dev.clone()).connect(addr))
                .await
                .unwrap_or_else(|_| panic!("connect {i} of {n}: timed out"))
                .unwrap_or_else(|e| panic!("connect {i} of {n}: {}", verbio::ErrorChain(&e)));
            let m = pattern(1 + i % 300, i as u8);
            c.send(&m).await.expect("send");
            let back = timeout(WAIT, c.receive()).await.expect("echo in time");
            assert_eq!(back.expect("echo"), m, "echo of cycle {i}");
            drop(c);
        }
        dev.cq_count()
    });
    // The last close reaches the server while this runtime shuts down.
    drop((rt, dev));
    server.join().expect("server");
    let end = rss();
    let grown = end.saturating_sub(warm);
    eprintln!(
        "{n} connect/close cycles: RSS {} KiB after {} cycles, {} KiB at the end \
         ({} bytes per cycle after the warm-up); client device {} CQs; {:.1} s",
        warm / 1024,
        WARM_UP.min(n / 2),
        end / 1024,
        grown / (n - WARM_UP.min(n / 2)) as u64,
        cqs,
        started.elapsed().as_secs_f64(),
    );
    if let Some(why) = rss_not_meaningful() {
        eprintln!("skipped: the RSS bound ({why}); the cycles ran and were checked");
        return;
    }
    assert!(
        grown <= GROWTH_BOUND,
        "RSS grew {grown} bytes over {} cycles after the warm-up",
        n - WARM_UP.min(n / 2)
    );
}
