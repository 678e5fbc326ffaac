//! Connection setup on the software RDMA device: two devices (two engines)
//! connect their QPs through `Listener`/`connect`, then a SEND from a pooled
//! `LocalBuf` lands in the peer's posted RECV. With `VERBIO_TEST_DEVICE` set
//! (scripts/rxe-test.sh) both sides open that device instead.

use std::net::SocketAddr;
use std::time::Duration;

use verbio_ops::connect::{connect, DeviceQps, Listener, QpConfig};
use verbio_runtime::buf::{IoBufMut, LocalBuf, MrPool, RegisteredBuf};
use verbio_runtime::provider::{
    open_device, Completion, Context, QpState, SendFlags, SendOp, SendWr, SoftConfig, WcStatus,
};
use verbio_runtime::{spawn, timeout, Completable, Device, Runtime, SubmitError};

const LIMIT: Duration = Duration::from_secs(20);

/// An op that owns one `LocalBuf` while the device uses it.
struct Io(LocalBuf);

impl Completable for Io {
    type Output = (Result<Completion, String>, LocalBuf);
    fn complete(self, c: Completion) -> Self::Output {
        (Ok(c), self.0)
    }
    fn fail(self, e: SubmitError) -> Self::Output {
        (Err(e.to_string()), self.0)
    }
}

/// A soft device (or the one named by `VERBIO_TEST_DEVICE`) on this thread's
/// runtime, or `None` (after printing SKIPPED) while the soft device is a
/// placeholder in this build.
fn soft_device() -> Option<Device> {
    let Ok(ctx) = std::panic::catch_unwind(|| match std::env::var("VERBIO_TEST_DEVICE") {
        Ok(name) if !name.trim().is_empty() => open_device(Some(name.trim())),
        _ => Context::open_soft(SoftConfig::default()),
    }) else {
        println!("SKIPPED: the soft RDMA device is not implemented in this build");
        return None;
    };
    Some(Device::open(ctx.expect("open soft device")).expect("bind device"))
}

#[test]
fn listener_and_client_connect_soft_qps_that_carry_a_send() {
    let rt = Runtime::new().expect("runtime");
    let Some(server_dev) = soft_device() else {
        return;
    };
    let Some(client_dev) = soft_device() else {
        return;
    };
    rt.block_on(async {
        let listener = Listener::bind(
            SocketAddr::from(([127, 0, 0, 1], 0)),
            DeviceQps::new(server_dev.clone(), QpConfig::default()),
            LIMIT,
        )
        .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let client_qps = DeviceQps::new(client_dev.clone(), QpConfig::default());
        let client = spawn(async move { connect(addr, &client_qps, LIMIT).await });
        let server = timeout(LIMIT, listener.accept())
            .await
            .expect("accept in time")
            .expect("accept");
        let client = timeout(LIMIT, client)
            .await
            .expect("connect in time")
            .expect("connect");
        assert_eq!(server.qp.state().expect("state"), QpState::Rts);
        assert_eq!(client.qp.state().expect("state"), QpState::Rts);
        assert_eq!(server.remote.qpn, client.qp.qp_num());
        assert_eq!(client.remote.qpn, server.qp.qp_num());
        assert_eq!(client.remote.addr, server_dev.context().addr());

        let server_pool = MrPool::new(server_dev.pd());
        let client_pool = MrPool::new(client_dev.pd());
        let rx = server_pool.alloc(256).expect("alloc");
        // SAFETY: the SGE covers the pool block `rx`, moved into the op: its
        // memory is the pool's (stable while the op moves) and nothing else
        // can reach it until `complete` hands it back.
        let recv = unsafe {
            server.qp.submit_recv(Io(rx), |io, sgl| {
                sgl.push(io.0.sge_total().map_err(|e| SubmitError::Invalid {
                    what: e.to_string(),
                })?);
                Ok(())
            })
        };
        let receiver = spawn(recv);
        let tx = client_pool
            .alloc_from(b"over a handshaken QP")
            .expect("alloc");
        // SAFETY: as for the RECV: the SGE covers the pool block `tx`, owned
        // by the op until its completion.
        let send = unsafe {
            client.qp.submit_send(Io(tx), |io, chain| {
                let sge = io.0.sge_init().map_err(|e| SubmitError::Invalid {
                    what: e.to_string(),
                })?;
                chain.push(SendWr {
                    wr_id: 0,
                    sg_list: std::iter::once(sge).collect(),
                    op: SendOp::Send,
                    flags: SendFlags::NONE,
                });
                Ok(())
            })
        };
        let (res, _tx) = timeout(LIMIT, send).await.expect("send in time");
        assert_eq!(res.expect("send").status, WcStatus::Success);
        let (res, mut rx) = timeout(LIMIT, receiver).await.expect("recv in time");
        let c = res.expect("recv");
        assert_eq!(c.status, WcStatus::Success);
        // SAFETY: the completion reports how many bytes the device wrote.
        unsafe { rx.set_init(c.byte_len as usize) };
        assert_eq!(&rx[..], b"over a handshaken QP");
    });
}

#[test]
fn a_listener_made_elsewhere_serves_handshakes() {
    let rt = Runtime::new().expect("runtime");
    let Some(server_dev) = soft_device() else {
        return;
    };
    let Some(client_dev) = soft_device() else {
        return;
    };
    // A plain std socket (as one made with SO_REUSEPORT would be), blocking
    // as std makes it: `from_std` must switch it to non-blocking, or the
    // accept below would block the runtime's thread and the client with it.
    let std_listener = std::net::TcpListener::bind("127.0.0.1:0").expect("std bind");
    let addr = std_listener.local_addr().expect("addr");
    let listener = Listener::from_std(
        std_listener,
        DeviceQps::new(server_dev.clone(), QpConfig::default()),
        LIMIT,
    )
    .expect("from_std");
    assert_eq!(listener.local_addr().expect("addr"), addr);
    rt.block_on(async {
        let client_qps = DeviceQps::new(client_dev.clone(), QpConfig::default());
        let client = spawn(async move { connect(addr, &client_qps, LIMIT).await });
        let server = timeout(LIMIT, listener.accept())
            .await
            .expect("accept in time")
            .expect("accept");
        let client = timeout(LIMIT, client)
            .await
            .expect("connect in time")
            .expect("connect");
        assert_eq!(server.qp.state().expect("state"), QpState::Rts);
        assert_eq!(server.remote.qpn, client.qp.qp_num());
        assert_eq!(client.remote.qpn, server.qp.qp_num());
    });
}
