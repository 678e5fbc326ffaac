//! RPC round trips over UD on the test device: the software device, or
//! rxe0 in the VM (`VERBIO_TEST_DEVICE`, run by `scripts/rxe-test.sh`), so
//! the engine is proven on real rdma-core too: calls of one packet and of
//! many (the MTU of the device's port decides), eight at once from one
//! session, and an idle session's expiry.

mod common;

use std::rc::Rc;
use std::time::Duration;

use verbio::rpc::ud::{UdConfig, UdTransport};
use verbio::rpc::{Request, Rpc, RpcConfig, SESSION_SLOTS};
use verbio::runtime::{spawn, timeout, Device};

const ECHO: u8 = 1;
const WAIT: Duration = Duration::from_secs(60);

fn endpoint(dev: &Device) -> Rpc<UdTransport> {
    // The GID index is the device's default (RoCE v2 IPv4-mapped on rxe).
    let transport = UdTransport::new(dev, &UdConfig::default()).expect("UD transport");
    Rpc::new(transport, RpcConfig::default())
}

/// `req` reversed, so a wrong routing of responses shows.
fn answer(req: &[u8]) -> Vec<u8> {
    req.iter().rev().copied().collect()
}

#[test]
fn calls_of_one_and_many_packets_round_trip() {
    let (rt, dev) = common::runtime_and_device();
    common::block(&rt, async {
        let server = endpoint(&dev);
        server.register(ECHO, |req: Request| {
            let mut resp = req.response();
            resp.extend_from_slice(&answer(req.data()));
            async move { resp }
        });
        let client = Rc::new(endpoint(&dev));
        let session = timeout(WAIT, client.connect(&server.local_addr()))
            .await
            .expect("connect in time")
            .expect("session");
        let packet = client.max_payload();
        for len in [0, 1, 32, packet, packet + 1, 3 * packet + 17, 64 << 10] {
            let req = common::pattern(len, len as u8);
            let resp = timeout(WAIT, client.call(session, ECHO, &req))
                .await
                .expect("call in time")
                .unwrap_or_else(|e| panic!("call of {len} bytes: {e}"));
            assert_eq!(&resp[..], &answer(&req)[..], "{len} bytes");
        }
        // Every slot of the session busy at once.
        let calls: Vec<_> = (0..SESSION_SLOTS * 4)
            .map(|i| {
                let client = client.clone();
                spawn(async move {
                    let req = common::pattern(100 + i, i as u8);
                    let resp = client
                        .call(session, ECHO, &req)
                        .await
                        .map_err(|e| e.to_string())?;
                    if resp[..] != answer(&req)[..] {
                        return Err(format!("call {i}: a wrong answer"));
                    }
                    Ok(())
                })
            })
            .collect();
        for c in calls {
            timeout(WAIT, c)
                .await
                .expect("concurrent calls in time")
                .expect("right answers");
        }
        let stats = client.stats();
        println!("client counters: {stats:?}");
    });
}

/// Idle server sessions over UD: the server closes a session its client
/// left idle (dropping its address handle), and the client, told by the
/// server's disconnect datagram, fails its next call clearly and reconnects.
#[test]
fn an_idle_session_is_closed_and_the_client_told() {
    let (rt, dev) = common::runtime_and_device();
    common::block(&rt, async {
        let idle = Duration::from_millis(200);
        let transport = UdTransport::new(&dev, &UdConfig::default()).expect("UD transport");
        let config = RpcConfig {
            session_idle_timeout: Some(idle),
            ..RpcConfig::default()
        };
        let server = Rpc::new(transport, config);
        server.register(ECHO, |req: Request| {
            let mut resp = req.response();
            resp.extend_from_slice(&answer(req.data()));
            async move { resp }
        });
        let client = endpoint(&dev);
        let session = timeout(WAIT, client.connect(&server.local_addr()))
            .await
            .expect("connect in time")
            .expect("session");
        timeout(WAIT, client.call(session, ECHO, b"ping"))
            .await
            .expect("call in time")
            .expect("call");
        let t = std::time::Instant::now();
        while server.stats().sessions_expired == 0 {
            assert!(t.elapsed() < WAIT, "the session never expired");
            verbio::runtime::sleep(Duration::from_millis(10)).await;
        }
        // Not early: the timeout counts from the server's last packet, a
        // round trip before `t`.
        let early = idle - Duration::from_millis(20);
        assert!(t.elapsed() >= early, "expired after {:?}", t.elapsed());
        let err = timeout(WAIT, client.call(session, ECHO, b"ping"))
            .await
            .expect("call in time")
            .expect_err("the session was closed");
        assert!(
            matches!(err, verbio::rpc::RpcError::SessionClosed { .. }),
            "{err}"
        );
        let session = timeout(WAIT, client.connect(&server.local_addr()))
            .await
            .expect("connect in time")
            .expect("a new session");
        let resp = timeout(WAIT, client.call(session, ECHO, b"pong"))
            .await
            .expect("call in time")
            .expect("call");
        assert_eq!(&resp[..], b"gnop");
    });
}
