//! The connection manager (`verbio::runtime::cm`) on the test device: the
//! soft device by default, rxe0 in the VM (`scripts/rxe-test.sh cm`, with
//! `RXE_IP` the address of rxe0's interface). Both sides run on one
//! runtime: the server as a spawned task.

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use common::{block, buf, buf_from, grant, pattern, test_device, WAIT};
use verbio::ops::verbs::{RemoteBuf, Verbs};
use verbio::provider::WcStatus;
use verbio::runtime::buf::MrPool;
use verbio::runtime::cm::{self, CmError, CmListener, CmOptions, DisconnectReason};
use verbio::runtime::{spawn, timeout, Device, Runtime};

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
    let (rt, dev) = common::runtime_and_device();
    Some((rt, dev, ip))
}

fn listen(dev: &Device, ip: IpAddr) -> (CmListener, SocketAddr) {
    let l = CmListener::bind(dev, SocketAddr::new(ip, 0), &CmOptions::default()).expect("bind");
    let addr = l.local_addr().expect("local address");
    assert_ne!(addr.port(), 0, "bound to a port");
    (l, addr)
}

/// The 16-byte region descriptor the server sends as private data.
fn encode(r: &RemoteBuf) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&r.addr().to_be_bytes());
    b[8..12].copy_from_slice(&r.rkey().to_be_bytes());
    b[12..].copy_from_slice(&(r.len() as u32).to_be_bytes());
    b
}

fn decode(b: &[u8]) -> RemoteBuf {
    let addr = u64::from_be_bytes(b[..8].try_into().unwrap());
    let rkey = u32::from_be_bytes(b[8..12].try_into().unwrap());
    let len = u32::from_be_bytes(b[12..16].try_into().unwrap());
    RemoteBuf::new(addr, u64::from(len), rkey)
}

#[test]
fn connect_accept_private_data_send_write_read() {
    let Some((rt, dev, ip)) = setup("connect_accept_private_data_send_write_read") else {
        return;
    };
    let (listener, addr) = listen(&dev, ip);
    let region = grant(&dev, 4096);
    let desc = RemoteBuf::new(region.addr(), region.len() as u64, region.rkey());
    let pool = MrPool::new(dev.pd());
    let spool = pool.clone();
    let server = spawn(async move {
        let req = listener.request().await.expect("request");
        assert_eq!(&req.private_data()[..5], b"hello");
        // Posted before accepting: the client's first SEND finds it.
        let recv = req.qp().recv(buf(&spool, 256));
        let conn = req.accept(&encode(&desc)).await.expect("accept");
        let (res, got) = recv.await;
        assert_eq!(res.expect("recv").len, 100);
        assert_eq!(&got[..], &pattern(100, 1)[..]);
        let (res, _) = conn.qp().send(buf_from(&spool, b"ack")).await;
        res.expect("send ack");
        let reason = conn.disconnected().await;
        assert_eq!(reason, DisconnectReason::Peer);
        region
    });
    block(&rt, async {
        let opts = CmOptions::default();
        let connector = cm::CmConnector::resolve(&dev, addr, &opts)
            .await
            .expect("resolve");
        let ack = connector.qp().recv(buf(&pool, 64));
        let conn = connector.connect(b"hello").await.expect("connect");
        let remote = decode(conn.peer_private_data());
        assert_eq!(remote, desc);
        let (res, _) = conn.qp().send(buf_from(&pool, &pattern(100, 1))).await;
        res.expect("send");
        let (res, got) = ack.await;
        res.expect("recv ack");
        assert_eq!(&got[..], b"ack");
        let (res, _) = conn
            .qp()
            .write(buf_from(&pool, &pattern(4096, 7)), remote)
            .await;
        res.expect("write");
        let (res, back) = conn.qp().read(buf(&pool, 4096), remote).await;
        res.expect("read");
        assert_eq!(&back[..], &pattern(4096, 7)[..]);
        assert!(conn.down_reason().is_none());
        conn.disconnect().await.expect("disconnect");
        assert_eq!(conn.down_reason(), Some(DisconnectReason::Local));
        let region = server.await;
        assert_eq!(region.to_vec(), pattern(4096, 7));
    });
}

#[test]
fn connect_without_listener_is_refused() {
    let Some((rt, dev, ip)) = setup("connect_without_listener_is_refused") else {
        return;
    };
    let (listener, addr) = listen(&dev, ip);
    drop(listener);
    block(&rt, async {
        let err = cm::connect(&dev, addr, &CmOptions::default(), b"x")
            .await
            .expect_err("nobody listens");
        // 8: the InfiniBand CM's "invalid service ID", on both providers.
        assert!(
            matches!(err, CmError::Rejected { status: 8, .. }),
            "refused, got: {err}"
        );
        assert!(err.to_string().contains("refused"), "{err}");
    });
}

#[test]
fn reject_carries_private_data() {
    let Some((rt, dev, ip)) = setup("reject_carries_private_data") else {
        return;
    };
    let (listener, addr) = listen(&dev, ip);
    let server = spawn(async move {
        let req = listener.request().await.expect("request");
        assert_eq!(&req.private_data()[..4], b"let ");
        req.reject(b"go away").expect("reject");
    });
    block(&rt, async {
        let err = cm::connect(&dev, addr, &CmOptions::default(), b"let me in")
            .await
            .expect_err("rejected");
        match &err {
            CmError::Rejected {
                private_data,
                status,
                ..
            } => {
                assert_eq!(&private_data[..7], b"go away", "{err}");
                assert_eq!(*status, 28, "consumer reject: {err}");
            }
            other => panic!("expected a reject, got: {other}"),
        }
        server.await;
    });
}

#[test]
fn peer_disconnect_fails_pending_ops() {
    let Some((rt, dev, ip)) = setup("peer_disconnect_fails_pending_ops") else {
        return;
    };
    let (listener, addr) = listen(&dev, ip);
    let pool = MrPool::new(dev.pd());
    let spool = pool.clone();
    let server = spawn(async move {
        let conn = listener.accept(b"").await.expect("accept");
        // Pending when the peer disconnects.
        let (res, _) = timeout(WAIT, conn.qp().recv(buf(&spool, 64)))
            .await
            .expect("the pending receive ended");
        let err = res.expect_err("flushed by the disconnect");
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
        assert_eq!(conn.down_reason(), Some(DisconnectReason::Peer));
        assert!(conn
            .check()
            .unwrap_err()
            .to_string()
            .contains("by the peer"));
        let (res, _) = conn.qp().send(buf_from(&spool, b"late")).await;
        assert!(res.is_err(), "a send after the peer left fails");
    });
    block(&rt, async {
        let conn = cm::connect(&dev, addr, &CmOptions::default(), b"")
            .await
            .expect("connect");
        // Let the server post its receive.
        verbio::runtime::sleep(std::time::Duration::from_millis(50)).await;
        conn.disconnect().await.expect("disconnect");
        server.await;
    });
}

#[test]
fn soft_listener_survives_a_foreign_peer() {
    if test_device().is_some() {
        println!("SKIPPED: soft_listener_survives_a_foreign_peer: the soft device's CM runs over TCP; RDMA CM does not");
        return;
    }
    let Some((rt, dev, ip)) = setup("soft_listener_survives_a_foreign_peer") else {
        return;
    };
    let (listener, addr) = listen(&dev, ip);
    // Not the CM protocol: the listener drops it and serves the next peer.
    let mut junk = std::net::TcpStream::connect(addr).expect("tcp connect");
    std::io::Write::write_all(&mut junk, b"GET / HTTP/1.0\r\n\r\n").expect("write");
    let server = spawn(async move {
        let conn = listener.accept(b"ok").await.expect("accept");
        conn.disconnected().await
    });
    block(&rt, async {
        let conn = cm::connect(&dev, addr, &CmOptions::default(), b"")
            .await
            .expect("connect after a foreign peer");
        assert_eq!(conn.peer_private_data(), b"ok");
        conn.disconnect().await.expect("disconnect");
        assert_eq!(server.await, DisconnectReason::Peer);
    });
    drop(junk);
}

/// Soft device: both engines bound to the unspecified address (as the
/// examples bind a client's). Each side announces its engine at the IP of
/// the CM connection (loopback here; the peer refuses an unspecified one),
/// and a SEND and a WRITE go across.
#[test]
fn engines_on_the_unspecified_address_connect_through_the_cm() {
    if let Some(dev) = test_device() {
        println!("SKIPPED: soft-device test (device {dev})");
        return;
    }
    let on_any = || {
        let ctx = verbio::provider::Context::open_soft(verbio::provider::SoftConfig {
            bind: SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0),
            ..verbio::provider::SoftConfig::default()
        })
        .expect("soft device on 0.0.0.0");
        Device::open(ctx).expect("device")
    };
    let rt = Runtime::new().expect("runtime");
    let (sdev, cdev) = (on_any(), on_any());
    let (listener, addr) = listen(&sdev, IpAddr::V4(Ipv4Addr::LOCALHOST));
    let region = grant(&sdev, 4096);
    let desc = RemoteBuf::new(region.addr(), region.len() as u64, region.rkey());
    let spool = MrPool::new(sdev.pd());
    let server = spawn(async move {
        let req = listener.request().await.expect("request");
        let recv = req.qp().recv(buf(&spool, 64));
        let conn = req.accept(&encode(&desc)).await.expect("accept");
        let (res, got) = recv.await;
        res.expect("recv");
        assert_eq!(&got[..], b"ping");
        conn.disconnected().await;
        region
    });
    let pool = MrPool::new(cdev.pd());
    block(&rt, async {
        let conn = cm::connect(&cdev, addr, &CmOptions::default(), b"")
            .await
            .expect("connect with engines on 0.0.0.0");
        let remote = decode(conn.peer_private_data());
        let (res, _) = conn.qp().send(buf_from(&pool, b"ping")).await;
        res.expect("send");
        let (res, _) = conn
            .qp()
            .write(buf_from(&pool, &pattern(4096, 3)), remote)
            .await;
        res.expect("write");
        conn.disconnect().await.expect("disconnect");
        let region = timeout(WAIT, server).await.expect("server done");
        assert_eq!(region.to_vec(), pattern(4096, 3));
    });
}
