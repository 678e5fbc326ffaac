//! The software device between two "hosts": two network namespaces joined
//! by a veth pair, each engine bound to its own namespace's address (not
//! loopback), the peer a second process started inside the other namespace.
//! Every verb runs across; then the link is cut under a stream of WRITEs
//! and the pending ops fail with transport errors instead of hanging.
//!
//! Needs root and iproute2 (`ip netns`, veth); where either is missing the
//! test prints `SKIPPED: <reason>` and returns. Soft device only (skipped
//! when `VERBIO_TEST_DEVICE` names another device).

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::Command;
use std::time::{Duration, Instant};

use common::netns::Netns;
use common::peer::{spawn_announcing, Peer, ADDR_PREFIX};
use common::*;
use futures::stream::{FuturesUnordered, StreamExt};
use verbio::ops::connect::{connect, Listener};
use verbio::ops::verbs::{RemoteBuf, Verbs};
use verbio::provider::{Context, SoftConfig};
use verbio::runtime::buf::MrPool;
use verbio::runtime::{sleep, Device, Runtime};

/// Set in the peer process: the address its engine and listener bind to.
const PEER_ENV: &str = "VERBIO_NETNS_TEST_PEER";

/// A runtime with a soft device whose engine listens on `ip` (ephemeral port).
fn soft_on(ip: IpAddr) -> (Runtime, Device) {
    let rt = Runtime::new().expect("runtime");
    let ctx = Context::open_soft(SoftConfig {
        bind: SocketAddr::new(ip, 0),
        ..SoftConfig::default()
    })
    .expect("soft device");
    (rt, Device::open(ctx).expect("device"))
}

/// Entry point of the peer process (inside the peer namespace). Run
/// directly (no env var), it returns at once.
#[test]
fn netns_peer_entry() {
    let Ok(spec) = std::env::var(PEER_ENV) else {
        return;
    };
    let mut parts = spec.split(',');
    let (ip, role) = (parts.next().expect("IP"), parts.next().expect("ROLE"));
    let ip: IpAddr = ip.parse().expect("peer IP");
    // (A third field, `any`: the engine binds the unspecified address.)
    let engine_ip = match parts.next() {
        Some("any") => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        _ => ip,
    };
    let (rt, dev) = soft_on(engine_ip);
    let listener = Listener::bind(SocketAddr::new(ip, 0), qps(&dev), HANDSHAKE).expect("listener");
    println!("{ADDR_PREFIX}{}", listener.local_addr().unwrap());
    block(&rt, async {
        let conn = listener.accept().await.expect("accept");
        let qp = conn.qp;
        match role {
            "verbs" => verbs_server(qp, dev.clone()).await.expect("verbs check"),
            "sink" => {
                let pool = MrPool::new(dev.pd());
                let region = grant(&dev, 1 << 16);
                send_remote(&qp, &pool, RemoteBuf::from(&region)).await;
                sleep(Duration::from_secs(15)).await;
            }
            other => panic!("unknown peer role {other}"),
        }
    });
}

/// The namespace, or `None` after printing why the test is skipped.
fn netns_or_skip(tag: u8) -> Option<Netns> {
    if let Some(dev) = test_device() {
        println!("SKIPPED: soft-device test ({TEST_DEVICE_ENV}={dev})");
        return None;
    }
    match Netns::create("netns", 233, tag) {
        Ok(ns) => Some(ns),
        Err(why) => {
            println!("SKIPPED: no network namespace for a second host: {why}");
            None
        }
    }
}

/// Starts this test binary's [`netns_peer_entry`] inside `ns`.
fn spawn_peer(ns: &Netns, role: &str) -> (Peer, SocketAddr) {
    spawn_peer_with(ns, role, false)
}

/// [`spawn_peer`], its engine bound to the unspecified address if
/// `engine_on_any` (its listener still on the namespace's address).
fn spawn_peer_with(ns: &Netns, role: &str, engine_on_any: bool) -> (Peer, SocketAddr) {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &ns.name])
        .arg(std::env::current_exe().unwrap());
    let any = if engine_on_any { ",any" } else { "" };
    let spec = format!("{},{role}{any}", ns.peer_ip);
    spawn_announcing(cmd, "netns_peer_entry", (PEER_ENV, &spec))
}

#[test]
fn every_verb_between_two_network_namespaces() {
    let Some(ns) = netns_or_skip(0) else { return };
    let (peer, addr) = spawn_peer(&ns, "verbs");
    assert_eq!(addr.ip(), IpAddr::V4(ns.peer_ip));
    let (rt, dev) = soft_on(IpAddr::V4(ns.host_ip));
    block(&rt, async {
        let conn = connect(addr, &qps(&dev), HANDSHAKE)
            .await
            .expect("connect across namespaces");
        // The data plane runs between the two engines' own addresses.
        let theirs = conn.remote.addr.to_socket().expect("soft endpoint");
        assert_eq!(theirs.ip(), IpAddr::V4(ns.peer_ip));
        let ours = conn.local.addr.to_socket().expect("soft endpoint");
        assert_eq!(ours.ip(), IpAddr::V4(ns.host_ip));
        verbs_client(conn.qp, dev.clone()).await;
    });
    peer.wait_success();
}

/// Every verb across the namespaces with the client's engine, the server's,
/// or both bound to the unspecified address (as the examples bind them):
/// each side announces the address the other reaches it at, the IP of the
/// handshake's own connection, and its engine proves it.
fn every_verb_with_engines_on_any(tag: u8, client_on_any: bool, server_on_any: bool) {
    let Some(ns) = netns_or_skip(tag) else { return };
    let (peer, addr) = spawn_peer_with(&ns, "verbs", server_on_any);
    let client_ip = if client_on_any {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    } else {
        IpAddr::V4(ns.host_ip)
    };
    let (rt, dev) = soft_on(client_ip);
    block(&rt, async {
        let conn = connect(addr, &qps(&dev), HANDSHAKE)
            .await
            .expect("connect across namespaces, an engine on the unspecified address");
        let theirs = conn.remote.addr.to_socket().expect("soft endpoint");
        assert_eq!(theirs.ip(), IpAddr::V4(ns.peer_ip));
        let ours = conn.local.addr.to_socket().expect("soft endpoint");
        assert_eq!(ours.ip(), IpAddr::V4(ns.host_ip));
        assert_eq!(
            ours.port(),
            dev.context().addr().to_socket().expect("soft").port()
        );
        verbs_client(conn.qp, dev.clone()).await;
    });
    peer.wait_success();
}

#[test]
fn a_client_engine_on_the_unspecified_address_reaches_another_namespace() {
    every_verb_with_engines_on_any(2, true, false);
}

#[test]
fn a_server_engine_on_the_unspecified_address_is_reached_from_another_namespace() {
    every_verb_with_engines_on_any(3, false, true);
}

#[test]
fn engines_on_the_unspecified_address_on_both_sides_reach_each_other() {
    every_verb_with_engines_on_any(4, true, true);
}

#[test]
fn a_cut_link_fails_pending_ops_instead_of_hanging() {
    let Some(ns) = netns_or_skip(1) else { return };
    let (_peer, addr) = spawn_peer(&ns, "sink");
    let (rt, dev) = soft_on(IpAddr::V4(ns.host_ip));
    let pool = MrPool::new(dev.pd());
    block(&rt, async {
        let qp = connect(addr, &qps(&dev), HANDSHAKE)
            .await
            .expect("connect across namespaces")
            .qp;
        let remote = recv_remote(&qp, &pool).await;
        let target = remote.at(0, 4096).expect("range");
        // The link works: one WRITE goes through.
        let (res, _) = qp.write(buf_from(&pool, &[1; 4096]), target).await;
        res.expect("first write");
        ns.cut();
        let started = Instant::now();
        let mut pending: FuturesUnordered<_> = (0..32)
            .map(|i| qp.write(buf_from(&pool, &[i as u8; 4096]), target))
            .collect();
        let (mut failed, mut gave_up) = (0, 0);
        while let Some((res, buf)) = pending.next().await {
            assert_eq!(buf.len(), 4096, "a buffer came back short");
            if let Err(e) = res {
                // The transport gave up (RETRY_EXC_ERR), and what was
                // queued behind it was flushed: nothing else.
                let msg = e.to_string();
                assert!(
                    msg.contains("RETRY_EXC_ERR") || msg.contains("WR_FLUSH_ERR"),
                    "unexpected failure over a cut link: {msg}"
                );
                failed += 1;
                gave_up += usize::from(msg.contains("RETRY_EXC_ERR"));
            }
        }
        assert!(failed > 0, "every write succeeded over a cut link");
        assert!(
            gave_up > 0,
            "no WRITE reported the lost peer (RETRY_EXC_ERR)"
        );
        // SoftConfig::peer_timeout (5 s by default): TCP's user timeout
        // on the WRITEs' unacknowledged bytes, or their probe left
        // unanswered; allow for load.
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "pending ops took {:?} to fail",
            started.elapsed()
        );
    });
}
