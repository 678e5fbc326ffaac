//! The handshake refuses a software-device peer whose engine listens on a
//! loopback address while the peer is on another host, on both sides, at
//! once (instead of a QP that can never reach it failing later).
//!
//! The "other host" is a network namespace joined by a veth pair; the
//! client is a thread that moved into it (`setns`, which moves only the
//! calling thread; the soft engine thread it starts inherits it). Needs
//! root and iproute2; where either is missing the test prints
//! `SKIPPED: <reason>` and returns. Soft device only.

mod common;

use std::fs::File;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::mpsc;

use common::*;
use verbio::ops::connect::{connect, HandshakeError, Listener};
use verbio::provider::{Context, SoftConfig};
use verbio::runtime::{Device, Runtime};

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("`ip` not runnable: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// A namespace with a veth into it (10.234.N.1 here, .2 there); removed on drop.
struct Netns {
    name: String,
    veth: String,
    host_ip: Ipv4Addr,
    peer_ip: Ipv4Addr,
}

impl Netns {
    fn create(tag: u8) -> Result<Netns, String> {
        let pid = std::process::id();
        let n = ((pid % 120) as u8) * 2 + tag;
        let ns = Netns {
            name: format!("verbio-lo-{pid}-{tag}"),
            veth: format!("vl{}t{tag}", pid % 100_000),
            host_ip: Ipv4Addr::new(10, 234, n, 1),
            peer_ip: Ipv4Addr::new(10, 234, n, 2),
        };
        let peer_end = format!("{}p", ns.veth);
        ip(&["netns", "add", &ns.name])?;
        ip(&[
            "link", "add", &ns.veth, "type", "veth", "peer", "name", &peer_end,
        ])?;
        ip(&["link", "set", &peer_end, "netns", &ns.name])?;
        ip(&[
            "addr",
            "add",
            &format!("{}/24", ns.host_ip),
            "dev",
            &ns.veth,
        ])?;
        ip(&["link", "set", &ns.veth, "up"])?;
        let inside = |args: &[&str]| {
            let mut all = vec!["netns", "exec", &ns.name, "ip"];
            all.extend_from_slice(args);
            ip(&all)
        };
        inside(&[
            "addr",
            "add",
            &format!("{}/24", ns.peer_ip),
            "dev",
            &peer_end,
        ])?;
        inside(&["link", "set", &peer_end, "up"])?;
        inside(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// Moves the calling thread into the namespace.
    fn enter(&self) -> Result<(), String> {
        let f = File::open(format!("/var/run/netns/{}", self.name))
            .map_err(|e| format!("opening the namespace: {e}"))?;
        // SAFETY: setns on a valid namespace fd; it changes only this
        // thread's network namespace.
        let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
        if rc == 0 {
            Ok(())
        } else {
            Err(format!("setns: {}", std::io::Error::last_os_error()))
        }
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = ip(&["link", "del", &self.veth]);
        let _ = ip(&["netns", "del", &self.name]);
    }
}

fn netns_or_skip(tag: u8) -> Option<Netns> {
    if let Some(dev) = test_device() {
        println!("SKIPPED: soft-device test ({TEST_DEVICE_ENV}={dev})");
        return None;
    }
    match Netns::create(tag) {
        Ok(ns) => Some(ns),
        Err(why) => {
            println!("SKIPPED: no network namespace for a second host: {why}");
            None
        }
    }
}

/// A runtime and a soft device whose engine listens on `engine`.
fn soft_on(engine: IpAddr) -> (Runtime, Device) {
    let rt = Runtime::new().expect("runtime");
    let ctx = Context::open_soft(SoftConfig {
        bind: SocketAddr::new(engine, 0),
        ..SoftConfig::default()
    })
    .expect("soft device");
    (rt, Device::open(ctx).expect("device"))
}

/// Runs one handshake: a server in this namespace (engine on
/// `server_engine`, listening on the veth address) and a client thread in
/// the other namespace (engine on `client_engine`). Returns the server's
/// and the client's errors.
fn handshake(
    ns: &Netns,
    server_engine: IpAddr,
    client_engine: IpAddr,
) -> (HandshakeError, HandshakeError) {
    let (tx, rx) = mpsc::channel::<SocketAddr>();
    let name = ns.name.clone();
    let enter = Netns {
        name: name.clone(),
        veth: String::new(),
        host_ip: ns.host_ip,
        peer_ip: ns.peer_ip,
    };
    let client = std::thread::spawn(move || {
        enter.enter().expect("enter the namespace");
        std::mem::forget(enter); // the test's `ns` removes it
        let addr = rx.recv_timeout(WAIT).expect("server address");
        let (rt, dev) = soft_on(client_engine);
        block(&rt, async {
            match connect(addr, &qps(&dev), HANDSHAKE).await {
                Ok(_) => panic!("the client connected"),
                Err(e) => e,
            }
        })
    });
    let (rt, dev) = soft_on(server_engine);
    let server_err = block(&rt, async {
        let l = Listener::bind(
            SocketAddr::new(IpAddr::V4(ns.host_ip), 0),
            qps(&dev),
            HANDSHAKE,
        )
        .expect("listen");
        tx.send(l.local_addr().unwrap()).unwrap();
        match l.accept_attempt().await {
            Ok(_) => panic!("the server accepted"),
            Err((peer, e)) => {
                assert_eq!(peer.map(|p| p.ip()), Some(IpAddr::V4(ns.peer_ip)));
                e
            }
        }
    });
    (server_err, client.join().expect("client thread"))
}

const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

#[test]
fn a_loopback_engine_is_refused_from_another_host_on_both_sides() {
    let Some(ns) = netns_or_skip(0) else { return };

    // The client's engine is on loopback: the server refuses it.
    let (server, client) = handshake(&ns, IpAddr::V4(ns.host_ip), LOOPBACK);
    match &server {
        HandshakeError::UnreachableEngine { engine, host } => {
            assert!(engine.ip().is_loopback(), "{server}");
            assert_eq!(*host, IpAddr::V4(ns.peer_ip));
        }
        other => panic!("server: expected UnreachableEngine, got {other}"),
    }
    match &client {
        HandshakeError::RejectedByPeer { reason } => {
            assert!(reason.contains("loopback"), "{reason}");
            assert!(reason.contains("SoftConfig::bind"), "{reason}");
        }
        other => panic!("client: expected RejectedByPeer, got {other}"),
    }

    // The server's engine is on loopback: the client refuses it.
    let (server, client) = handshake(&ns, LOOPBACK, IpAddr::V4(ns.peer_ip));
    match &client {
        HandshakeError::UnreachableEngine { engine, host } => {
            assert!(engine.ip().is_loopback(), "{client}");
            assert_eq!(*host, IpAddr::V4(ns.host_ip));
        }
        other => panic!("client: expected UnreachableEngine, got {other}"),
    }
    match &server {
        HandshakeError::RejectedByPeer { reason } => {
            assert!(reason.contains("loopback"), "{reason}")
        }
        other => panic!("server: expected RejectedByPeer, got {other}"),
    }
}
