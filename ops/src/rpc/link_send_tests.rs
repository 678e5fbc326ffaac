//! Mid-size messages over the session's RC link (`engine/link_send.rs`) on the
//! in-memory network: every byte at sizes around the edges, over lossy
//! and reordering datagrams, across a broken link, and link packets from
//! a hostile peer next to a legitimate client.

use std::cell::Cell;
use std::rc::Rc;
use std::task::{Context, Waker};
use std::time::{Duration, Instant};

use verbio_runtime::Runtime;

use super::bulk_tests::{RawPeer, PACKET, RAW_SESSION};
use super::header::{Header, PacketKind, Status, HEADER_LEN};
use super::mem::bulk::MEM_LINK_PACKET;
use super::mem::{Faults, MemNetwork, MemTransport};
use super::tests::{answer, config, request, server, wait_for, ECHO};
use super::{LinkPacket, Request, Rpc, RpcConfig, SessionId};

/// Payload bytes of a datagram.
const PAYLOAD: usize = PACKET - HEADER_LEN;

/// A client with a session to `srv` whose link is ready (its first
/// mid-size call asked for it).
async fn linked(net: &MemNetwork, srv: &Rpc<MemTransport>) -> (Rpc<MemTransport>, SessionId) {
    linked_with(net, srv, config()).await
}

/// [`linked`] with the client's `config`.
async fn linked_with(
    net: &MemNetwork,
    srv: &Rpc<MemTransport>,
    config: RpcConfig,
) -> (Rpc<MemTransport>, SessionId) {
    let cli = Rpc::new(net.endpoint(), config);
    let s = cli.connect(&srv.local_addr()).await.unwrap();
    let req = request(0, 0, 3 * PAYLOAD);
    assert_eq!(
        &cli.call(s, ECHO, &req).await.unwrap()[..],
        &answer(&req)[..]
    );
    wait_for(|| cli.link_ready(s)).await;
    (cli, s)
}

/// Requests and responses larger than a datagram and below the READ
/// threshold (in at most the session's credits of packets) go as one
/// packet each over the link, no datagram at all; one datagram's worth
/// and one packet past the link's stay on their paths.
#[test]
fn mid_size_messages_go_over_the_link_in_one_packet() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(3, PACKET);
        let (srv, runs) = server(&net, config());
        let (cli, s) = linked(&net, &srv).await;
        // The largest message the link carries in one go: below the
        // threshold, in at most the session's credits (and the response
        // window) of packets.
        let most = (config().read_threshold - 1)
            .min(config().session_credits.min(config().response_window) * PAYLOAD);
        // Echo responses are 4 bytes longer than their requests.
        for (i, len) in [PAYLOAD + 1, 5000, 10_000, most - 4]
            .into_iter()
            .enumerate()
        {
            let (sent, links) = (net.stats().sent, net.link_packets());
            let req = request(1, i, len);
            let resp = cli.call(s, ECHO, &req).await.unwrap();
            assert_eq!(&resp[..], &answer(&req)[..], "{len} bytes");
            assert_eq!(
                net.link_packets() - links,
                2,
                "{len} bytes: one packet each way"
            );
            assert_eq!(net.stats().sent, sent, "{len} bytes: no datagram");
        }
        // One datagram each way: not over the link.
        let links = net.link_packets();
        let req = request(2, 0, PAYLOAD - 4);
        assert_eq!(
            &cli.call(s, ECHO, &req).await.unwrap()[..],
            &answer(&req)[..]
        );
        // A response one byte past the link's goes by WRITE or READ, its
        // request over the link.
        let req = request(2, 1, most - 3);
        assert_eq!(
            &cli.call(s, ECHO, &req).await.unwrap()[..],
            &answer(&req)[..]
        );
        assert_eq!(net.link_packets() - links, 1);
        assert!(runs.borrow().values().all(|&n| n == 1));
        assert_eq!(srv.stats().malformed_packets, 0);
        assert_eq!(cli.stats().retransmissions, 0, "{:?}", cli.stats());
        assert!(srv.memory().request_bytes <= srv.memory().request_budget);
    });
}

/// With datagrams lost, duplicated and reordered, a window of calls of
/// every size from four tasks: every byte right, each handler run once.
#[test]
fn link_packets_and_lossy_datagrams_mix() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(11, PACKET);
        let (srv, runs) = server(&net, config());
        let (cli, s) = linked(&net, &srv).await;
        net.set_faults(Faults {
            drop: 0.05,
            duplicate: 0.05,
            reorder: 0.2,
        });
        let cli = std::rc::Rc::new(cli);
        let mut tasks = Vec::new();
        for t in 0..4 {
            let cli = cli.clone();
            tasks.push(verbio_runtime::spawn(async move {
                for i in 0..20 {
                    let req = request(10 + t, i, 100 + (i * 1777 + t * 311) % 30_000);
                    let resp = cli.call(s, ECHO, &req).await.unwrap();
                    assert_eq!(&resp[..], &answer(&req)[..]);
                }
            }));
        }
        for t in tasks {
            t.await;
        }
        assert_eq!(runs.borrow().len(), 81);
        assert!(runs.borrow().values().all(|&n| n == 1));
        assert!(cli.stats().link_packets_sent > 20, "{:?}", cli.stats());
    });
}

/// A window of mid-size calls at a session's start, more packets than
/// the session's credits: the calls wait while the link is set up and
/// then for the credits of all their packets, and each goes as one packet
/// over the link; no request goes in datagrams (streamed, the window was
/// hundreds of datagrams at once, and on rxe each one lost cost a
/// timeout).
#[test]
fn a_window_of_mid_size_calls_waits_for_the_link_and_its_credits() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(7, PACKET);
        let (srv, runs) = server(&net, config());
        let cli = Rpc::new(net.endpoint(), config());
        let s = cli.connect(&srv.local_addr()).await.unwrap();
        let before = cli.stats().packets_sent;
        // Eight calls of five packets each: 40 packets, 32 credits.
        let len = 5 * PAYLOAD - 10;
        let reqs: Vec<Vec<u8>> = (0..8).map(|i| request(40, i, len)).collect();
        let calls = reqs.iter().map(|req| cli.call(s, ECHO, req));
        let resps = futures::future::join_all(calls).await;
        for (req, resp) in reqs.iter().zip(resps) {
            assert_eq!(&resp.unwrap()[..], &answer(req)[..]);
        }
        let stats = cli.stats();
        assert_eq!(stats.link_packets_sent, 8, "{stats:?}");
        // The link's two set-up datagrams, no request packet.
        assert_eq!(stats.packets_sent - before, 2, "{stats:?}");
        assert_eq!(stats.retransmissions, 0, "{stats:?}");
        assert!(runs.borrow().values().all(|&n| n == 1));
    });
}

/// A link that breaks under a session loses nothing: the calls whose
/// packets went over it complete by datagrams, and the next mid-size call
/// opens a new link.
#[test]
fn a_broken_link_loses_nothing_and_is_replaced() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(5, PACKET);
        let (srv, runs) = server(&net, config());
        let (cli, s) = linked(&net, &srv).await;
        for (round, id) in [
            srv.with_transport(MemTransport::id),
            cli.with_transport(MemTransport::id),
        ]
        .into_iter()
        .enumerate()
        {
            net.break_links(id);
            for i in 0..6 {
                let req = request(20 + round, i, 6000 + i);
                let resp = cli.call(s, ECHO, &req).await.unwrap();
                assert_eq!(&resp[..], &answer(&req)[..]);
            }
            wait_for(|| cli.link_ready(s)).await;
            let links = net.link_packets();
            let req = request(30 + round, 0, 7000);
            assert_eq!(
                &cli.call(s, ECHO, &req).await.unwrap()[..],
                &answer(&req)[..]
            );
            assert_eq!(net.link_packets() - links, 2, "a new link carries the call");
        }
        assert!(runs.borrow().values().all(|&n| n == 1));
    });
}

/// A mid-size request that went over the link to a handler slower than
/// the client's timeout is resent as its last packet alone, one datagram
/// per timeout (the server answers it "in progress"); its other packets
/// are with the server. (Before, its first timeout resent every packet
/// of it by datagram: on rxe, 4 KiB calls are 5 datagrams each.)
#[test]
fn a_slow_handler_is_resent_only_the_last_packet_of_a_link_sent_request() {
    const SLOW: u8 = 9;
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(5, PACKET);
        // An rto wide enough that the server's "in progress" answer comes
        // back before the next timeout also on a loaded host (with 5 ms a
        // thread stalled past it made the second resend one of every
        // packet, in one transport call).
        let wide = RpcConfig {
            rto: Duration::from_millis(40),
            ..config()
        };
        let (srv, runs) = server(&net, wide.clone());
        // The handler answers once the client has resent (its transport's
        // send calls grew: the request itself went over the link), not
        // after a fixed time: with a fixed 400 ms a host that stalled the
        // thread past it let the response beat the client's timer.
        let client_id: Rc<Cell<Option<u32>>> = Rc::default();
        let (h_net, h_id) = (net.clone(), client_id.clone());
        srv.register(SLOW, move |req: Request| {
            let (net, id) = (h_net.clone(), h_id.get());
            async move {
                let id = id.expect("the client's transport is known before it calls");
                let (start, t) = (net.send_calls(id), Instant::now());
                // Past the client's timeout: at most 4 rto (160 ms)
                // learned; bounded, the test's checks then fail.
                while net.send_calls(id) == start && t.elapsed() < Duration::from_secs(5) {
                    verbio_runtime::sleep(Duration::from_millis(5)).await;
                }
                let mut resp = req.response();
                resp.extend_from_slice(&answer(req.data()));
                resp
            }
        })
        .unwrap();
        let (cli, s) = linked_with(&net, &srv, wide).await;
        let cli_id = cli.with_transport(MemTransport::id);
        client_id.set(Some(cli_id));
        for i in 0..3 {
            let req = request(40, i, 3 * PAYLOAD + 1);
            let (calls, before, links) = (net.send_calls(cli_id), cli.stats(), net.link_packets());
            let resp = cli.call(s, SLOW, &req).await.unwrap();
            assert_eq!(&resp[..], &answer(&req)[..]);
            let after = cli.stats();
            let resent = after.retransmissions - before.retransmissions;
            assert!(resent >= 1, "the handler outlasted no timeout: {after:?}");
            // Every datagram of the call a resend, each alone in its
            // transport call: one packet per timeout.
            assert_eq!(net.send_calls(cli_id) - calls, resent, "{after:?}");
            assert_eq!(net.link_packets() - links, 2, "one packet each way");
            assert_eq!(after.timeouts, 0);
        }
        assert!(runs.borrow().values().all(|&n| n == 1));
        assert_eq!(srv.stats().handler_runs, 4);
    });
}

/// The link packets `raw`'s link brought, waiting up to 5 s for `n`.
async fn link_packets_of(raw: &mut RawPeer, n: usize) -> Vec<Vec<u8>> {
    let t = Instant::now();
    let mut got = Vec::new();
    loop {
        let mut out = Vec::new();
        let mut cx = Context::from_waker(Waker::noop());
        raw.bulk.poll_received(&mut cx, &mut out, &mut Vec::new());
        got.extend(
            out.iter()
                .map(|(_, p): &(u64, LinkPacket)| p.as_slice().to_vec()),
        );
        if got.len() >= n {
            return got;
        }
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "{} of {n} link packets came",
            got.len()
        );
        verbio_runtime::sleep(Duration::from_millis(2)).await;
    }
}

/// Link packets from a peer with a link of its own: malformed, truncated,
/// not packet 0, shorter or longer than the message, with a wrong packet
/// count, of a kind a link does not carry, naming another client's
/// session, twice, and larger than the receive buffer (its link breaks):
/// each is dropped and counted (the valid one answered once), nothing is
/// held, and the legitimate client is served throughout and after.
#[test]
fn hostile_link_packets_fail_nothing_but_themselves() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(9, PACKET);
        let (srv, runs) = server(&net, config());
        let (cli, s) = linked(&net, &srv).await;
        let mut raw = RawPeer::connect(&net, &srv).await;
        raw.open_link(1).await;
        let legit = |i: usize| {
            let cli = &cli;
            async move {
                let req = request(40, i, 9000 + i);
                assert_eq!(
                    &cli.call(s, ECHO, &req).await.unwrap()[..],
                    &answer(&req)[..]
                );
            }
        };
        let msg = request(41, 0, 3000);
        let n = 3000usize.div_ceil(PAYLOAD) as u16;
        let head = |h: Header| Header {
            dest_session: raw.remote,
            src_session: RAW_SESSION,
            ..h
        };
        let good = head(Header {
            req_type: ECHO,
            payload_len: 3000,
            req_num: 8,
            msg_len: 3000,
            pkt_count: n,
            ..Header::new(PacketKind::Request)
        });
        let malformed_before = srv.stats().malformed_packets;
        let stale_before = srv.stats().stale_packets;
        let bad: Vec<(Header, &[u8])> = vec![
            (Header { pkt_idx: 1, ..good }, &msg),
            (
                Header {
                    pkt_count: n + 1,
                    ..good
                },
                &msg,
            ),
            (
                Header {
                    msg_len: 3001,
                    ..good
                },
                &msg,
            ),
            (
                Header {
                    payload_len: 2999,
                    ..good
                },
                &msg[..2999],
            ),
            (
                Header {
                    kind: PacketKind::Response,
                    ..good
                },
                &msg,
            ),
            (
                Header {
                    kind: PacketKind::Offer,
                    ..good
                },
                &msg,
            ),
        ];
        for (h, payload) in &bad {
            let mut bytes = [0u8; HEADER_LEN];
            h.encode_into(&mut bytes);
            raw.bulk.send_packet(1, &bytes, payload).unwrap();
        }
        // Garbage and truncated headers.
        raw.bulk.send_packet(1, &[0xAB; HEADER_LEN], &msg).unwrap();
        let mut bytes = [0u8; HEADER_LEN];
        good.encode_into(&mut bytes);
        raw.bulk.send_packet(1, &bytes, &msg[..100]).unwrap();
        // Another client's session, over this link: stale.
        let mut other = [0u8; HEADER_LEN];
        Header {
            dest_session: raw.remote ^ 1,
            ..good
        }
        .encode_into(&mut other);
        raw.bulk.send_packet(1, &other, &msg).unwrap();
        legit(0).await;
        wait_for(|| srv.stats().malformed_packets - malformed_before >= 7).await;
        wait_for(|| srv.stats().stale_packets - stale_before >= 2).await;
        assert_eq!(srv.stats().malformed_packets - malformed_before, 7);
        // The valid request, twice: handled once, answered over the link
        // (the second, a duplicate, from the cached response by datagram).
        let dups = srv.stats().duplicate_requests;
        raw.bulk.send_packet(1, &bytes, &msg).unwrap();
        let answers = link_packets_of(&mut raw, 1).await;
        let (h, payload) = Header::decode(&answers[0]).unwrap();
        assert_eq!(
            (h.kind, h.status, h.req_num),
            (PacketKind::Response, Status::Ok, 8)
        );
        assert_eq!(payload, &answer(&msg)[..]);
        raw.bulk.send_packet(1, &bytes, &msg).unwrap();
        let (h, _) = raw.expect(PacketKind::Response).await;
        assert_eq!((h.req_num, h.pkt_idx), (8, 0));
        assert_eq!(srv.stats().duplicate_requests - dups, u64::from(n));
        assert_eq!(runs.borrow().get(&msg), Some(&1));
        legit(1).await;
        // Larger than the receive buffer: the server's end of that link
        // breaks; the server serves on.
        let huge = vec![7u8; MEM_LINK_PACKET];
        raw.bulk.send_packet(1, &bytes, &huge).unwrap();
        legit(2).await;
        assert!(srv.memory().request_bytes <= srv.memory().request_budget);
        assert_eq!(srv.memory().request_bytes, 0, "nothing held");
    });
}
