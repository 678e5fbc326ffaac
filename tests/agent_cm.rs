//! The agent (`Rdma`) over the connection manager: `RdmaBuilder::listen_cm`
//! / `connect_cm` on the test device (the soft device by default, rxe0 in
//! the VM with `RXE_IP`), both sides on one runtime.

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use common::{block, pattern, test_device};
use verbio::runtime::{spawn, Device, Runtime};
use verbio::{AgentError, RdmaBuilder};

/// Loopback on the soft device; on an ibverbs device `VERBIO_CM_IP`, else
/// `RXE_IP` (set in the rxe VM).
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
    let (rt, dev) = common::runtime_and_device();
    Some((rt, dev, ip))
}

#[test]
fn messages_both_ways_with_settings_from_private_data() {
    let Some((rt, dev, ip)) = setup("messages_both_ways_with_settings_from_private_data") else {
        return;
    };
    let big = pattern(100_000, 3);
    let server_builder = RdmaBuilder::new().device(dev.clone());
    // Small receive buffers on the client: the server learns their size
    // from the connect request's private data and splits its messages.
    let client_builder = RdmaBuilder::new()
        .device(dev.clone())
        .recv_buf_size(256)
        .recv_buf_count(32);
    block(&rt, async {
        let listener = server_builder
            .listen_cm(SocketAddr::new(ip, 0))
            .expect("listen_cm");
        let addr = listener.local_addr().expect("address");
        let big2 = big.clone();
        let server = spawn(async move {
            let r = listener.accept().await.expect("accept");
            assert_eq!(r.receive().await.unwrap(), b"hello");
            assert_eq!(r.receive().await.unwrap(), big2);
            r.send(&big2).await.unwrap();
            r.send(b"bye").await.unwrap();
            // The client leaves: receiving fails with why.
            let err = r.receive().await.expect_err("peer gone");
            assert!(r.close_reason().is_some(), "{err}");
        });
        let r = client_builder.connect_cm(addr).await.expect("connect_cm");
        r.send(b"hello").await.unwrap();
        r.send(&big).await.unwrap();
        assert_eq!(r.receive().await.unwrap(), big);
        assert_eq!(r.receive().await.unwrap(), b"bye");
        r.close().await.expect("close");
        server.await;
    });
}

#[test]
fn connect_cm_without_listener_is_refused() {
    let Some((rt, dev, ip)) = setup("connect_cm_without_listener_is_refused") else {
        return;
    };
    block(&rt, async {
        let builder = RdmaBuilder::new().device(dev.clone());
        let listener = builder
            .listen_cm(SocketAddr::new(ip, 0))
            .expect("listen_cm");
        let addr = listener.local_addr().expect("address");
        drop(listener);
        let err = builder.connect_cm(addr).await.expect_err("nobody listens");
        assert!(matches!(err, AgentError::Cm { .. }), "{err}");
        let io: std::io::Error = err.into();
        assert_eq!(io.kind(), std::io::ErrorKind::ConnectionRefused);
    });
}

#[test]
fn listen_cm_refuses_a_shared_receive_queue() {
    let Some((rt, dev, ip)) = setup("listen_cm_refuses_a_shared_receive_queue") else {
        return;
    };
    block(&rt, async {
        let builder = RdmaBuilder::new().device(dev).shared_receive_queue(64);
        let Err(err) = builder.listen_cm(SocketAddr::new(ip, 0)) else {
            panic!("a shared receive queue is refused on CM connections");
        };
        assert!(
            matches!(
                err,
                AgentError::Config {
                    setting: "shared_receive_queue",
                    ..
                }
            ),
            "{err}"
        );
    });
}

#[test]
fn new_connection_dials_the_cm_listener_again() {
    let Some((rt, dev, ip)) = setup("new_connection_dials_the_cm_listener_again") else {
        return;
    };
    let builder = RdmaBuilder::new().device(dev.clone());
    block(&rt, async {
        let listener = builder
            .listen_cm(SocketAddr::new(ip, 0))
            .expect("listen_cm");
        let addr = listener.local_addr().expect("address");
        let server = spawn(async move {
            // Each connection answers with its number, in a task of its own.
            let mut handlers = Vec::new();
            for i in 0..2u8 {
                let r = listener.accept().await.expect("accept");
                // The listening side knows no listener to dial.
                let err = r.new_connection().await.expect_err("listening side");
                assert!(matches!(err, AgentError::Config { .. }), "{err}");
                handlers.push(spawn(async move {
                    let mut m = r.receive().await.unwrap();
                    m.push(b'0' + i);
                    r.send(&m).await.unwrap();
                    let _ = r.receive().await;
                }));
            }
            for h in handlers {
                h.await;
            }
        });
        let first = builder.connect_cm(addr).await.expect("connect_cm");
        let second = first.new_connection().await.expect("second connection");
        first.send(b"a").await.unwrap();
        assert_eq!(first.receive().await.unwrap(), b"a0");
        second.send(b"b").await.unwrap();
        assert_eq!(second.receive().await.unwrap(), b"b1");
        first.close().await.expect("close");
        second.close().await.expect("close");
        server.await;
    });
}
