//! A session's credits with more calls under way than credits: the calls
//! that wait for one are sent as credits come back, although a call that
//! starts while none waits leaves at its start and a small response's
//! credit comes back with no pump (`Session::starved`, `engine/client_calls.rs`).

use std::time::Duration;

use verbio_runtime::Runtime;

use super::mem::MemNetwork;
use super::tests::{answer, config, request, server, ECHO};
use super::{Rpc, RpcConfig, SESSION_SLOTS};

/// Longest a round of calls that should complete may take (the machine
/// may be loaded).
const BOUND: Duration = Duration::from_secs(10);

/// Rounds of 8 calls at once on one session with `credits` credits,
/// requests of one packet and (every third call) of two: every call gets
/// its answer, none is sent again, and each handler runs once.
fn calls_wait_for_credits(credits: usize) {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(44 + credits as u64, 1024);
        // Packets only: no link, no READ.
        net.set_bulk(false);
        let (srv, runs) = server(&net, config());
        let cli = Rpc::new(
            net.endpoint(),
            RpcConfig {
                session_credits: credits,
                ..config()
            },
        );
        let s = cli.connect(&srv.local_addr()).await.unwrap();
        let two_packets = cli.max_payload() + 40;
        let mut calls = 0;
        for round in 0..20 {
            let reqs: Vec<Vec<u8>> = (0..SESSION_SLOTS)
                .map(|i| request(round, i, if i % 3 == 2 { two_packets } else { 32 }))
                .collect();
            let done = futures::future::join_all(reqs.iter().map(|r| cli.call(s, ECHO, r)));
            let resps = verbio_runtime::timeout(BOUND, done)
                .await
                .unwrap_or_else(|_| panic!("round {round}: calls waiting for credits are sent"));
            for (req, resp) in reqs.iter().zip(resps) {
                assert_eq!(&resp.unwrap()[..], &answer(req)[..]);
            }
            calls += reqs.len();
        }
        let stats = cli.stats();
        assert_eq!(stats.retransmissions, 0, "{stats:?}");
        assert_eq!(stats.timeouts, 0, "{stats:?}");
        assert_eq!(runs.borrow().len(), calls);
        assert!(runs.borrow().values().all(|&n| n == 1));
    });
}

#[test]
fn with_one_credit_every_call_is_sent_as_credits_come_back() {
    calls_wait_for_credits(1);
}

#[test]
fn with_three_credits_every_call_is_sent_as_credits_come_back() {
    calls_wait_for_credits(3);
}

#[test]
fn with_the_default_credits_every_call_leaves_at_its_start() {
    calls_wait_for_credits(RpcConfig::default().session_credits);
}
