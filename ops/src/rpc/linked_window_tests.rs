//! A window of mid-size calls over a session's ready link answered by
//! small responses (what `verbio-perf send_bw --api rpc` does at 4 KiB):
//! the work each call takes on the client and the server, counted.

use verbio_runtime::Runtime;

use super::bulk_tests::PACKET;
use super::header::HEADER_LEN;
use super::mem::MemNetwork;
use super::tests::{config, request, server, wait_for};
use super::{Request, Rpc, SESSION_SLOTS};

/// Payload bytes of a datagram.
const PAYLOAD: usize = PACKET - HEADER_LEN;

/// Request type answered by the request's length (4 bytes): a small
/// response to a request of any size.
const LEN: u8 = 9;

/// Eight rounds of a session's eight slots of two-packet calls (16 of
/// its 32 credits under way): every request leaves whole over the link
/// at its start and every response completes its call, with no pump over
/// the session's slots; the server takes each request whole, not packet
/// by packet, and queues no credit return for its first packet (the
/// response answers it). The old code pumped twice per call, took each
/// request as its two packets and queued a credit return per request.
#[test]
fn a_window_of_linked_calls_is_sent_and_taken_whole() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(11, PACKET);
        let (srv, _) = server(&net, config());
        srv.register(LEN, |req: Request| {
            let mut resp = req.response();
            resp.extend_from_slice(&(req.data().len() as u32).to_le_bytes());
            std::future::ready(resp)
        })
        .unwrap();
        let cli = Rpc::new(net.endpoint(), config());
        let s = cli.connect(&srv.local_addr()).await.unwrap();
        // The session's first mid-size call asks for its link.
        let first = request(0, 0, 2 * PAYLOAD - 10);
        let resp = cli.call(s, LEN, &first).await.unwrap();
        assert_eq!(resp[..], (first.len() as u32).to_le_bytes());
        wait_for(|| cli.link_ready(s)).await;
        let (client_before, server_before) = (cli.work_counts(), srv.work_counts());
        let stats_before = cli.stats();
        let rounds = 8;
        for round in 0..rounds {
            let reqs: Vec<Vec<u8>> = (0..SESSION_SLOTS)
                .map(|i| request(round + 1, i, 2 * PAYLOAD - 10 + i))
                .collect();
            let calls = reqs.iter().map(|req| cli.call(s, LEN, req));
            let resps = futures::future::join_all(calls).await;
            for (req, resp) in reqs.iter().zip(resps) {
                assert_eq!(resp.unwrap()[..], (req.len() as u32).to_le_bytes());
            }
        }
        let calls = (rounds * SESSION_SLOTS) as u64;
        let stats = cli.stats();
        assert_eq!(
            stats.link_packets_sent - stats_before.link_packets_sent,
            calls,
            "{stats:?}"
        );
        assert_eq!(stats.retransmissions, 0, "{stats:?}");
        let (client, server) = (cli.work_counts(), srv.work_counts());
        assert_eq!(client.pumps - client_before.pumps, 0, "{client:?}");
        assert_eq!(
            server.request_packets - server_before.request_packets,
            0,
            "{server:?}"
        );
        assert_eq!(
            server.acks_queued - server_before.acks_queued,
            0,
            "{server:?}"
        );
        assert_eq!(srv.stats().handler_runs, calls + 1);
    });
}
