//! RPC round trips over UD on the test device: the software device, or
//! rxe0 in the VM (`VERBIO_TEST_DEVICE`, run by `scripts/rxe-test.sh`), so
//! the engine is proven on real rdma-core too: calls of one packet and of
//! many (the MTU of the device's port decides), eight at once from one
//! session, and a GET-like handler that answers from server state.

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
