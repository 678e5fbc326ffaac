//! Verbs between two processes on the software RDMA device: the test binary
//! re-executes itself as the peer (selected by an environment variable),
//! which prints its listen address on stdout.
//!
//! - every verb against a peer process;
//! - the peer is SIGKILLed mid-stream: every pending op fails (transport
//!   retry exhausted or flushed), nothing hangs, and every buffer comes back.

mod common;

use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

use common::peer::{spawn_announcing, Peer, ADDR_PREFIX};
use common::*;
use futures::stream::{FuturesUnordered, StreamExt};
use verbio::ops::verbs::{RemoteBuf, Verbs};
use verbio::provider::WcStatus;
use verbio::runtime::buf::MrPool;
use verbio::runtime::{sleep, timeout};

const PEER_ENV: &str = "VERBIO_VERBS_TEST_PEER";

/// Entry point of the peer process. Run directly (no env var), it checks
/// that the peer roles exist and returns.
#[test]
fn peer_process_entry() {
    let Ok(role) = std::env::var(PEER_ENV) else {
        assert!(["verbs", "sink"].iter().all(|r| !r.is_empty()));
        return;
    };
    let (rt, dev) = runtime_and_device();
    let listener = listen(&dev);
    println!("{ADDR_PREFIX}{}", listener.local_addr().unwrap());
    block(&rt, async {
        let qp = listener.accept().await.expect("accept").qp;
        match role.as_str() {
            "verbs" => verbs_server(qp, dev.clone()).await.expect("verbs check"),
            "sink" => {
                // Grant a region, announce it, then wait to be killed.
                let pool = MrPool::new(dev.pd());
                let region = grant(&dev, 1 << 16);
                send_remote(&qp, &pool, RemoteBuf::from(&region)).await;
                sleep(Duration::from_secs(15)).await;
            }
            other => panic!("unknown peer role {other}"),
        }
    });
}

fn spawn_peer(role: &str) -> (Peer, SocketAddr) {
    let exe = std::env::current_exe().unwrap();
    spawn_announcing(Command::new(exe), "peer_process_entry", (PEER_ENV, role))
}

#[test]
fn every_verb_between_two_processes() {
    let (mut peer, addr) = spawn_peer("verbs");
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let qp = dial(&dev, addr).await;
        verbs_client(qp, dev.clone()).await;
    });
    let deadline = Instant::now() + WAIT;
    let status = loop {
        if let Some(s) = peer.0.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "peer did not exit");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(status.success(), "peer failed: {status}");
}

#[test]
fn peer_killed_mid_stream_fails_pending_ops_and_returns_buffers() {
    const IN_FLIGHT: usize = 64;
    let (mut peer, addr) = spawn_peer("sink");
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        // The peer's death closes the engines' TCP connection: detected at
        // once; the transport timeout (≈ 67 ms × 6) bounds the silent case.
        let qp = dial(&dev, addr).await;
        let pool = MrPool::new(dev.pd());
        let remote = recv_remote(&qp, &pool).await;
        let mut pending = FuturesUnordered::new();
        let mut issued = 0usize;
        let next = |issued: &mut usize| {
            let off = (*issued % 1024) as u64 * 64;
            *issued += 1;
            qp.write(buf_from(&pool, &[0x5a; 64]), remote.at(off, 64).unwrap())
        };
        for _ in 0..IN_FLIGHT {
            pending.push(next(&mut issued));
        }
        let mut ok = 0usize;
        let mut failed = Vec::new();
        let mut returned = 0usize;
        let mut killed = false;
        while let Some((res, b)) = timeout(WAIT, pending.next()).await.expect("an op hung") {
            returned += 1;
            assert_eq!(b.len(), 64, "buffer came back intact");
            drop(b);
            match res {
                Ok(()) => {
                    ok += 1;
                    if ok == 2000 && !killed {
                        peer.0.kill().expect("SIGKILL the peer");
                        killed = true;
                    }
                    if failed.is_empty() {
                        pending.push(next(&mut issued));
                    }
                }
                Err(e) => {
                    assert!(killed, "op failed before the kill: {e}");
                    failed.push(e);
                }
            }
        }
        eprintln!(
            "ok {ok} issued {issued} failed {} first {:?}",
            failed.len(),
            failed.first().map(|e| e.to_string())
        );
        assert!(killed && ok >= 2000);
        assert_eq!(returned, issued, "every buffer came back");
        assert!(!failed.is_empty(), "the kill must fail some op");
        // On rxe the dead process's MRs may be torn down before its QP: the
        // still-alive responder then NAKs a WRITE with REM_ACCESS_ERR.
        let peer_gone = |e: &verbio::ops::Error| {
            e.status() == Some(WcStatus::RetryExcErr)
                || (test_device().is_some() && e.status() == Some(WcStatus::RemAccessErr))
        };
        for e in &failed {
            assert!(
                peer_gone(e) || e.status() == Some(WcStatus::WrFlushErr) || e.is_flush(),
                "unexpected error after the kill: {e}"
            );
        }
        assert!(
            failed.iter().any(peer_gone),
            "the kill should show as RETRY_EXC_ERR (rxe: or REM_ACCESS_ERR): {:?}",
            failed.first()
        );
        assert_eq!(pool.stats().blocks_in_use, 0);
        timeout(WAIT, qp.close()).await.expect("close hung").ok();
    });
}
