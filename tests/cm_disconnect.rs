//! Disconnects through the connection manager (`verbio::runtime::cm`), on
//! the test device: the soft device by default, rxe0 in the VM
//! (`scripts/rxe-test.sh cm_disconnect`, with `RXE_IP`). A peer's
//! disconnect is answered at once and reported, `disconnect()` after it is
//! a no-op success, and every disconnect is bounded: the peer disconnects
//! first, both at once, twice, a drop mid-disconnect, a peer process
//! killed, a peer that never answers (software device). In the VM also
//! rdma-core's `rdma_client` / `rdma_server` / `ucmatose` (rdmacm-utils)
//! against verbio both ways, asserting that they finish promptly after the
//! disconnect (whoever starts it).

mod common;

use std::cell::Cell;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::{Child, Command, Stdio};
use std::rc::Rc;
use std::time::{Duration, Instant};

use common::{block, buf, buf_from, runtime_and_device, test_device, WAIT};
use verbio::ops::verbs::Verbs;
use verbio::provider::WcStatus;
use verbio::runtime::buf::MrPool;
use verbio::runtime::cm::{self, CmConnection, CmError, CmListener, CmOptions, DisconnectReason};
use verbio::runtime::{sleep, spawn, timeout, Device, Runtime};

/// How long a disconnect may take in these tests before it counts as
/// hung (far above what it takes, far below the ~69 s the kernel CM takes
/// to give up on an unanswered DREQ).
const PROMPT: Duration = Duration::from_secs(10);

/// The IP address the CM listens on: loopback on the soft device; on an
/// ibverbs device `VERBIO_CM_IP`, else `RXE_IP` (set in the rxe VM).
fn cm_ip(test: &str) -> Option<IpAddr> {
    if test_device().is_none() {
        return Some(IpAddr::V4(Ipv4Addr::LOCALHOST));
    }
    for var in ["VERBIO_CM_IP", "RXE_IP"] {
        if let Ok(v) = std::env::var(var) {
            return Some(
                v.trim()
                    .parse()
                    .unwrap_or_else(|e| panic!("{var}={v}: {e}")),
            );
        }
    }
    println!("SKIPPED: {test}: RDMA CM needs the device's IP address (set VERBIO_CM_IP)");
    None
}

fn setup(test: &str) -> Option<(Runtime, Device, IpAddr)> {
    let ip = cm_ip(test)?;
    let (rt, dev) = runtime_and_device();
    Some((rt, dev, ip))
}

fn listen(dev: &Device, ip: IpAddr) -> (CmListener, SocketAddr) {
    let l = CmListener::bind(dev, SocketAddr::new(ip, 0), &CmOptions::default()).expect("bind");
    let addr = l.local_addr().expect("local address");
    (l, addr)
}

/// A connected pair on one runtime: (client, server).
async fn pair(dev: &Device, ip: IpAddr) -> (CmConnection, CmConnection) {
    let (listener, addr) = listen(dev, ip);
    let server = spawn(async move { listener.accept(b"").await.expect("accept") });
    let client = cm::connect(dev, addr, &CmOptions::default(), b"")
        .await
        .expect("connect");
    (client, server.await)
}

/// `f` must finish within [`PROMPT`]; returns its output and how long it took.
async fn prompt<F: std::future::Future>(what: &str, f: F) -> (F::Output, Duration) {
    let t0 = Instant::now();
    match timeout(PROMPT, f).await {
        Ok(out) => (out, t0.elapsed()),
        Err(_) => panic!("{what}: not done within {PROMPT:?}"),
    }
}

#[test]
fn the_peer_disconnects_first_and_a_later_disconnect_is_a_no_op() {
    let Some((rt, dev, ip)) = setup("the_peer_disconnects_first_and_a_later_disconnect_is_a_no_op")
    else {
        return;
    };
    block(&rt, async {
        let (client, server) = pair(&dev, ip).await;
        let pool = MrPool::new(dev.pd());
        let pending = server.qp().recv(buf(&pool, 64));
        // The server does not call disconnect() nor drop its connection:
        // its connection manager must answer the client's disconnect alone.
        let (res, took) = prompt("the client's disconnect", client.disconnect()).await;
        res.expect("client disconnect");
        assert_eq!(client.down_reason(), Some(DisconnectReason::Local));
        println!("client disconnect answered in {took:?}");
        let (reason, _) = prompt("the server's disconnected()", server.disconnected()).await;
        assert_eq!(reason, DisconnectReason::Peer);
        let ((res, _), _) = prompt("the flush of a pending receive", pending).await;
        let err = res.expect_err("flushed");
        assert!(
            matches!(
                err,
                verbio::ops::Error::Completion {
                    status: WcStatus::WrFlushErr,
                    ..
                }
            ),
            "{err}"
        );
        // After the peer's disconnect: a no-op success, at once and again.
        for _ in 0..2 {
            let (res, _) = prompt("disconnect() after the peer's", server.disconnect()).await;
            res.expect("disconnect after the peer's is a no-op success");
        }
        assert_eq!(server.down_reason(), Some(DisconnectReason::Peer));
        let (res, _) = server.qp().send(buf_from(&pool, b"late")).await;
        assert!(res.is_err(), "a send after the disconnect fails");
        // And the client's second disconnect too.
        let (res, _) = prompt("a second disconnect()", client.disconnect()).await;
        res.expect("a second disconnect");
    });
}

#[test]
fn both_sides_disconnect_at_once() {
    let Some((rt, dev, ip)) = setup("both_sides_disconnect_at_once") else {
        return;
    };
    block(&rt, async {
        for round in 0..3 {
            let (client, server) = pair(&dev, ip).await;
            // Both requests go out before either side hears the other's
            // (crossing DREQs on RDMA CM, crossing FINs on the soft device).
            let ((a, b), took) = prompt(
                "two crossing disconnects",
                futures::future::join(client.disconnect(), server.disconnect()),
            )
            .await;
            a.unwrap_or_else(|e| panic!("round {round}: client: {e}"));
            b.unwrap_or_else(|e| panic!("round {round}: server: {e}"));
            assert_eq!(client.down_reason(), Some(DisconnectReason::Local));
            assert_eq!(server.down_reason(), Some(DisconnectReason::Local));
            println!("round {round}: crossing disconnects in {took:?}");
        }
    });
}

#[test]
fn disconnect_twice_at_once_and_after() {
    let Some((rt, dev, ip)) = setup("disconnect_twice_at_once_and_after") else {
        return;
    };
    block(&rt, async {
        let (client, server) = pair(&dev, ip).await;
        let ((a, b), _) = prompt(
            "two disconnects of one connection",
            futures::future::join(client.disconnect(), client.disconnect()),
        )
        .await;
        a.expect("first disconnect");
        b.expect("second, concurrent disconnect");
        let (res, _) = prompt("a third disconnect", client.disconnect()).await;
        res.expect("a disconnect after it is done");
        assert_eq!(client.down_reason(), Some(DisconnectReason::Local));
        let (reason, _) = prompt("the server's disconnected()", server.disconnected()).await;
        assert_eq!(reason, DisconnectReason::Peer);
    });
}

#[test]
fn a_disconnect_dropped_midway_can_be_resumed_and_a_dropped_connection_is_seen() {
    let Some((rt, dev, ip)) =
        setup("a_disconnect_dropped_midway_can_be_resumed_and_a_dropped_connection_is_seen")
    else {
        return;
    };
    block(&rt, async {
        // The disconnect future dropped after its first poll (the request
        // is out), then called again: it waits for the same end.
        let (client, server) = pair(&dev, ip).await;
        {
            let mut f = std::pin::pin!(client.disconnect());
            assert!(futures::poll!(f.as_mut()).is_pending() || client.down_reason().is_some());
        }
        let (res, _) = prompt("disconnect() after a dropped one", client.disconnect()).await;
        res.expect("resumed disconnect");
        assert_eq!(client.down_reason(), Some(DisconnectReason::Local));
        let (reason, _) = prompt("the server's disconnected()", server.disconnected()).await;
        assert_eq!(reason, DisconnectReason::Peer);

        // The connection itself dropped mid-disconnect: the peer sees it.
        let (client, server) = pair(&dev, ip).await;
        {
            let mut f = std::pin::pin!(client.disconnect());
            let _ = futures::poll!(f.as_mut());
        }
        drop(client);
        let (reason, _) = prompt("the server's disconnected()", server.disconnected()).await;
        assert_eq!(reason, DisconnectReason::Peer);
        let (res, _) = prompt("disconnect() after the peer's", server.disconnect()).await;
        res.expect("no-op");
    });
}

const KILLED_CHILD: &str = "VERBIO_CM_KILLED_CHILD";
const CHILD_CONNECTED: &str = "killed_peer_child: connected";

/// Kills the child process when dropped (a failing test leaves none).
struct Killer(Option<Child>);

impl Killer {
    fn new(child: Child) -> Killer {
        Killer(Some(child))
    }

    fn child(&mut self) -> &mut Child {
        self.0.as_mut().expect("the child is here until into_inner")
    }

    /// The child, no longer killed on drop (for [`exited`], which kills it
    /// when it overstays).
    fn into_inner(mut self) -> Child {
        self.0.take().expect("the child is here until into_inner")
    }
}

impl Drop for Killer {
    fn drop(&mut self) {
        if let Some(c) = &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The child of `a_peer_process_killed_is_seen_as_a_disconnect`: connects
/// to the address in the environment and waits to be killed. Does nothing
/// in a normal test run.
#[test]
fn killed_peer_child() {
    let Ok(addr) = std::env::var(KILLED_CHILD) else {
        return;
    };
    let addr: SocketAddr = addr.parse().expect("address");
    let (rt, dev) = runtime_and_device();
    let conn = block(
        &rt,
        cm::connect(&dev, addr, &CmOptions::default(), b"child"),
    )
    .expect("child connect");
    // On a line of its own (libtest prints the test's name before it).
    println!("\n{CHILD_CONNECTED}");
    std::io::stdout().flush().unwrap();
    // Killed while connected (bounded in case the parent is gone).
    std::thread::sleep(Duration::from_secs(60));
    drop(conn);
}

#[test]
fn a_peer_process_killed_is_seen_as_a_disconnect() {
    let Some((rt, dev, ip)) = setup("a_peer_process_killed_is_seen_as_a_disconnect") else {
        return;
    };
    let (listener, addr) = listen(&dev, ip);
    let child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "killed_peer_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(KILLED_CHILD, addr.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn the child");
    let mut child = Killer::new(child);
    let stdout = child.child().stdout.take().unwrap();
    let connected = std::thread::spawn(move || {
        BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .any(|l| l == CHILD_CONNECTED)
    });
    let killed = Rc::new(Cell::new(false));
    block(&rt, async {
        let conn = listener.accept(b"").await.expect("accept the child");
        while !connected.is_finished() {
            sleep(Duration::from_millis(10)).await;
        }
        assert!(connected.join().unwrap(), "the child did not connect");
        let pool = MrPool::new(dev.pd());
        let pending = conn.qp().recv(buf(&pool, 64));
        child.child().kill().expect("kill the child");
        killed.set(true);
        let (reason, took) = prompt("disconnected() after the kill", conn.disconnected()).await;
        assert_eq!(reason, DisconnectReason::Peer);
        println!("killed peer seen in {took:?}");
        let ((res, _), _) = prompt("the flush", pending).await;
        assert!(res.is_err(), "the pending receive is flushed");
        let (res, _) = prompt("disconnect() after the peer's", conn.disconnect()).await;
        res.expect("no-op");
    });
    assert!(killed.get());
}

/// Soft device: a peer that completes the set-up by hand and then never
/// answers the disconnect (never closes its end): `disconnect()` gives up
/// after `CmOptions::disconnect_timeout` with an error naming the wait,
/// and the connection is down all the same.
#[test]
fn a_disconnect_the_peer_never_answers_is_bounded() {
    if test_device().is_some() {
        println!("SKIPPED: a_disconnect_the_peer_never_answers_is_bounded: a raw TCP peer speaks only the soft device's CM");
        return;
    }
    let (rt, dev) = runtime_and_device();
    let opts = CmOptions {
        disconnect_timeout: Duration::from_millis(300),
        ..CmOptions::default()
    };
    let listener = CmListener::bind(
        &dev,
        SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
        &opts,
    )
    .expect("bind");
    let addr = listener.local_addr().unwrap();
    // A requester by hand: request, read the accept, confirm, then silence
    // until the test is done.
    let (done, wait_done) = std::sync::mpsc::channel::<()>();
    let peer = std::thread::spawn(move || {
        let mut s = std::net::TcpStream::connect(addr).expect("connect");
        s.write_all(&frame(1, &req_body())).unwrap();
        let mut header = [0u8; 8];
        s.read_exact(&mut header).unwrap();
        assert_eq!(&header[..5], b"vCM1\x02", "an accept");
        let mut body = vec![0u8; usize::from(u16::from_be_bytes([header[6], header[7]]))];
        s.read_exact(&mut body).unwrap();
        s.write_all(&frame(4, &[])).unwrap();
        // Keep the stream open (never read, never close).
        let _ = wait_done.recv_timeout(WAIT);
        drop(s);
    });
    block(&rt, async {
        let conn = listener.accept(b"").await.expect("accept");
        let t0 = Instant::now();
        let err = prompt("a disconnect nobody answers", conn.disconnect())
            .await
            .0
            .expect_err("the peer never answers");
        let took = t0.elapsed();
        assert!(took >= Duration::from_millis(300), "waited {took:?}");
        match &err {
            CmError::Io { source, .. } => {
                assert_eq!(source.kind(), std::io::ErrorKind::TimedOut, "{err}")
            }
            other => panic!("expected a timeout, got: {other}"),
        }
        let text = verbio::runtime::ErrorChain(&err).to_string();
        assert!(text.contains("disconnect_timeout"), "{text}");
        assert_eq!(conn.down_reason(), Some(DisconnectReason::Local));
        let pool = MrPool::new(dev.pd());
        let (res, _) = conn.qp().send(buf_from(&pool, b"late")).await;
        assert!(res.is_err(), "the QP is in ERR");
        // A second call does not wait again.
        let (res, _) = prompt("disconnect() after the timeout", conn.disconnect()).await;
        res.expect("no-op after the timeout");
    });
    drop(done);
    peer.join().unwrap();
}

/// A soft CM frame: magic, kind, zero, body length (u16 BE), body.
fn frame(kind: u8, body: &[u8]) -> Vec<u8> {
    let mut f = b"vCM1".to_vec();
    f.push(kind);
    f.push(0);
    f.extend_from_slice(&(body.len() as u16).to_be_bytes());
    f.extend_from_slice(body);
    f
}

/// A valid connect request's body (QPN 7 at an engine on 127.0.0.1:4791).
fn req_body() -> Vec<u8> {
    let mut b = vec![16, 16, 0];
    b.extend_from_slice(&7u32.to_be_bytes()); // QPN
    b.extend_from_slice(&0x42u32.to_be_bytes()); // PSN
    b.extend_from_slice(&0u16.to_be_bytes()); // LID
    b.extend_from_slice(&[0; 16]); // GID
    b.push(5); // MTU 4096
    b.push(4);
    b.extend_from_slice(&[127, 0, 0, 1]);
    b.extend_from_slice(&4791u16.to_be_bytes());
    b
}

// ------------------------------------------------------------ interop

/// The rdma-core program `name` when the test device is an ibverbs device
/// and the program is installed; else prints why the test is skipped.
fn rdma_core_program(test: &str, name: &str) -> Option<()> {
    if test_device().is_none() {
        println!("SKIPPED: {test}: rdma-core's {name} needs an RDMA CM device (the soft device's CM speaks TCP)");
        return None;
    }
    let found = std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(name).is_file()));
    if !found {
        println!("SKIPPED: {test}: {name} is not installed (Debian package rdmacm-utils)");
        return None;
    }
    Some(())
}

/// Waits (polling, the runtime running) until `child` exits, at most
/// `limit`; returns its output and when it exited, or kills it and fails.
async fn exited(what: &str, mut child: Child, limit: Duration) -> (String, Instant) {
    let t0 = Instant::now();
    loop {
        match child.try_wait().expect("try_wait") {
            Some(status) => {
                let at = Instant::now();
                let mut out = String::new();
                if let Some(mut o) = child.stdout.take() {
                    let _ = o.read_to_string(&mut out);
                }
                if let Some(mut e) = child.stderr.take() {
                    let _ = e.read_to_string(&mut out);
                }
                assert!(status.success(), "{what} failed ({status}): {out}");
                return (out, at);
            }
            None if t0.elapsed() > limit => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{what} still running after {limit:?}: it waits for verbio's answer");
            }
            None => sleep(Duration::from_millis(20)).await,
        }
    }
}

/// rdma-core's `rdma_client` against a verbio server: it sends 16 bytes,
/// receives 16, and disconnects first (`rdma_disconnect` waits for the
/// DISCONNECTED event, i.e. verbio's DREP). The server keeps its
/// connection (no drop, no disconnect()) until the client has exited.
#[test]
fn rdma_client_finishes_promptly_against_a_verbio_server() {
    const T: &str = "rdma_client_finishes_promptly_against_a_verbio_server";
    let Some(ip) = cm_ip(T) else { return };
    if rdma_core_program(T, "rdma_client").is_none() {
        return;
    }
    let (rt, dev) = runtime_and_device();
    let (listener, addr) = listen(&dev, ip);
    let pool = MrPool::new(dev.pd());
    let t0 = Instant::now();
    let child = Command::new("rdma_client")
        .args(["-s", &ip.to_string(), "-p", &addr.port().to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn rdma_client");
    let child = Killer::new(child);
    rt.block_on(async {
        let req = timeout(WAIT, listener.request())
            .await
            .expect("rdma_client's request within WAIT")
            .expect("request");
        let recv = req.qp().recv(buf(&pool, 16));
        let conn = req.accept(b"").await.expect("accept");
        let (res, got) = timeout(WAIT, recv).await.expect("rdma_client's SEND");
        assert_eq!(res.expect("recv").len, 16);
        drop(got);
        let (res, _) = conn.qp().send(buf_from(&pool, &[7u8; 16])).await;
        res.expect("send to rdma_client");
        let reason = timeout(WAIT, conn.disconnected())
            .await
            .expect("rdma_client's disconnect");
        assert_eq!(reason, DisconnectReason::Peer);
        let seen = Instant::now();
        let (_, at) = exited("rdma_client", child.into_inner(), PROMPT * 3).await;
        let after = at.saturating_duration_since(seen);
        println!(
            "cm interop: rdma_client ran {:.2} s, exited {:.3} s after its disconnect reached verbio",
            at.duration_since(t0).as_secs_f64(),
            after.as_secs_f64()
        );
        assert!(after < PROMPT, "rdma_client exited {after:?} after its disconnect");
        // The connection was never dropped meanwhile; disconnect() is a no-op now.
        let (res, _) = prompt("disconnect() after rdma_client's", conn.disconnect()).await;
        res.expect("no-op");
    });
}

/// verbio as the client of rdma-core's `rdma_server`, which disconnects
/// first once its SEND is done: verbio answers at once, so `rdma_server`
/// (waiting for its DISCONNECTED event) exits promptly.
#[test]
fn rdma_server_finishes_promptly_against_a_verbio_client() {
    const T: &str = "rdma_server_finishes_promptly_against_a_verbio_client";
    let Some(ip) = cm_ip(T) else { return };
    if rdma_core_program(T, "rdma_server").is_none() {
        return;
    }
    let (rt, dev) = runtime_and_device();
    // A free CM port: bound then released.
    let port = listen(&dev, ip).1.port();
    let addr = SocketAddr::new(ip, port);
    let pool = MrPool::new(dev.pd());
    let t0 = Instant::now();
    let child = Command::new("rdma_server")
        .args(["-s", &ip.to_string(), "-p", &port.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn rdma_server");
    let child = Killer::new(child);
    rt.block_on(async {
        // Until rdma_server listens (refused with reason 8 before).
        let conn = loop {
            let connector = cm::CmConnector::resolve(&dev, addr, &CmOptions::default())
                .await
                .expect("resolve");
            let recv = connector.qp().recv(buf(&pool, 16));
            match connector.connect(b"").await {
                Ok(conn) => break (conn, recv),
                Err(CmError::Rejected { status: 8, .. }) if t0.elapsed() < WAIT => {
                    drop(recv);
                    sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("connect to rdma_server: {e}"),
            }
        };
        let (conn, recv) = conn;
        let (res, _) = conn.qp().send(buf_from(&pool, &[9u8; 16])).await;
        res.expect("send to rdma_server");
        let (res, _) = timeout(WAIT, recv).await.expect("rdma_server's SEND");
        assert_eq!(res.expect("recv").len, 16);
        let reason = timeout(WAIT, conn.disconnected())
            .await
            .expect("rdma_server's disconnect");
        assert_eq!(reason, DisconnectReason::Peer);
        let seen = Instant::now();
        let (_, at) = exited("rdma_server", child.into_inner(), PROMPT * 3).await;
        let after = at.saturating_duration_since(seen);
        println!(
            "cm interop: rdma_server ran {:.2} s, exited {:.3} s after its disconnect reached verbio",
            at.duration_since(t0).as_secs_f64(),
            after.as_secs_f64()
        );
        assert!(after < PROMPT, "rdma_server exited {after:?} after its disconnect");
        let (res, _) = prompt("disconnect() after rdma_server's", conn.disconnect()).await;
        res.expect("no-op");
    });
}

/// ucmatose's messages: its defaults (`-C 10 -S 100`).
const UCMA_COUNT: usize = 10;
const UCMA_SIZE: usize = 100;

/// verbio as the server of rdma-core's `ucmatose` client, which receives
/// 10 messages, replies with 10, then waits for the server to disconnect
/// (answering with its own `rdma_disconnect`): verbio disconnects first
/// and its `disconnect()` returns once ucmatose has answered.
#[test]
fn verbio_server_disconnects_first_and_ucmatose_answers() {
    const T: &str = "verbio_server_disconnects_first_and_ucmatose_answers";
    let Some(ip) = cm_ip(T) else { return };
    if rdma_core_program(T, "ucmatose").is_none() {
        return;
    }
    let (rt, dev) = runtime_and_device();
    let (listener, addr) = listen(&dev, ip);
    let pool = MrPool::new(dev.pd());
    let t0 = Instant::now();
    let child = Command::new("ucmatose")
        .args(["-s", &ip.to_string(), "-p", &addr.port().to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn ucmatose");
    let child = Killer::new(child);
    rt.block_on(async {
        let req = timeout(WAIT, listener.request())
            .await
            .expect("ucmatose's request within WAIT")
            .expect("request");
        let recvs: Vec<_> = (0..UCMA_COUNT)
            .map(|_| req.qp().recv(buf(&pool, UCMA_SIZE)))
            .collect();
        let conn = req.accept(b"").await.expect("accept");
        let sends = (0..UCMA_COUNT).map(|i| conn.qp().send(buf_from(&pool, &[i as u8; UCMA_SIZE])));
        for (res, _) in futures::future::join_all(sends).await {
            res.expect("send to ucmatose");
        }
        let got = timeout(WAIT, futures::future::join_all(recvs))
            .await
            .expect("ucmatose's replies");
        for (res, _) in got {
            assert_eq!(res.expect("recv").len, UCMA_SIZE);
        }
        let (res, took) = prompt(
            "verbio's disconnect, answered by ucmatose",
            conn.disconnect(),
        )
        .await;
        res.expect("disconnect");
        assert_eq!(conn.down_reason(), Some(DisconnectReason::Local));
        let (out, at) = exited("ucmatose (client)", child.into_inner(), PROMPT).await;
        assert!(out.contains("return status 0"), "{out}");
        println!(
            "cm interop: ucmatose client ran {:.2} s; verbio's disconnect took {:.3} s",
            at.duration_since(t0).as_secs_f64(),
            took.as_secs_f64()
        );
    });
}

/// verbio as the client of rdma-core's `ucmatose` server, which sends 10
/// messages, receives 10 replies and disconnects; verbio disconnects as
/// soon as its replies are sent, so the two disconnects cross (or nearly:
/// either way both end promptly).
#[test]
fn verbio_client_and_a_ucmatose_server_disconnect_at_once() {
    const T: &str = "verbio_client_and_a_ucmatose_server_disconnect_at_once";
    let Some(ip) = cm_ip(T) else { return };
    if rdma_core_program(T, "ucmatose").is_none() {
        return;
    }
    let (rt, dev) = runtime_and_device();
    let port = listen(&dev, ip).1.port();
    let addr = SocketAddr::new(ip, port);
    let pool = MrPool::new(dev.pd());
    let t0 = Instant::now();
    let child = Command::new("ucmatose")
        .args(["-b", &ip.to_string(), "-p", &port.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn ucmatose");
    let child = Killer::new(child);
    rt.block_on(async {
        let (conn, recvs) = loop {
            let connector = cm::CmConnector::resolve(&dev, addr, &CmOptions::default())
                .await
                .expect("resolve");
            let recvs: Vec<_> = (0..UCMA_COUNT)
                .map(|_| connector.qp().recv(buf(&pool, UCMA_SIZE)))
                .collect();
            match connector.connect(b"").await {
                Ok(conn) => break (conn, recvs),
                Err(CmError::Rejected { status: 8, .. }) if t0.elapsed() < WAIT => {
                    drop(recvs);
                    sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("connect to ucmatose: {e}"),
            }
        };
        let got = timeout(WAIT, futures::future::join_all(recvs))
            .await
            .expect("ucmatose's messages");
        for (res, _) in got {
            assert_eq!(res.expect("recv").len, UCMA_SIZE);
        }
        let sends = (0..UCMA_COUNT).map(|i| conn.qp().send(buf_from(&pool, &[i as u8; UCMA_SIZE])));
        for (res, _) in futures::future::join_all(sends).await {
            res.expect("reply to ucmatose");
        }
        let (res, took) = prompt("crossing disconnects with ucmatose", conn.disconnect()).await;
        res.expect("disconnect");
        assert!(conn.down_reason().is_some());
        let (out, at) = exited("ucmatose (server)", child.into_inner(), PROMPT).await;
        assert!(out.contains("return status 0"), "{out}");
        println!(
            "cm interop: ucmatose server ran {:.2} s; verbio's disconnect took {:.3} s ({})",
            at.duration_since(t0).as_secs_f64(),
            took.as_secs_f64(),
            conn.down_reason().unwrap()
        );
    });
}
