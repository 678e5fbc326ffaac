//! The large-message path (`engine/read_path.rs`) over the in-memory network: every
//! byte at sizes around the threshold, calls dropped and peers dying
//! while a READ is under way, and descriptors from a hostile peer.

use std::pin::pin;
use std::task::{Context, Waker};
use std::time::{Duration, Instant};

use futures::future::{select, Either};
use verbio_runtime::Runtime;

use super::header::{BulkDesc, Header, PacketKind, Status, HEADER_LEN};
use super::mem::{MemNetwork, MemTransport};
use super::tests::{answer, config, request, server, wait_for, ECHO};
use super::{
    Bulk, MsgBuf, Request, Rpc, RpcConfig, RpcError, SessionId, Transport, TxBatch, SESSION_SLOTS,
};

/// Packets of 1 KiB of payload; messages from 4 KiB go by READ.
pub(super) const PACKET: usize = 1024 + HEADER_LEN;
const THRESHOLD: usize = 4096;
/// A handler answering any request with [`BIG_LEN`] bytes.
const BIG: u8 = 2;
const BIG_LEN: usize = 50_000;

fn bulk_config() -> RpcConfig {
    RpcConfig {
        read_threshold: THRESHOLD,
        ..config()
    }
}

fn big_response(i: usize) -> u8 {
    (i * 13 + 5) as u8
}

/// A client endpoint with a session to `srv` whose link is ready (its
/// first large call opened it).
async fn linked_client(
    net: &MemNetwork,
    srv: &Rpc<MemTransport>,
) -> (Rpc<MemTransport>, SessionId) {
    let cli = Rpc::new(net.endpoint(), bulk_config());
    let s = cli.connect(&srv.local_addr()).await.unwrap();
    let req = request(9, 0, THRESHOLD);
    let resp = cli.call(s, ECHO, &req).await.unwrap();
    assert_eq!(&resp[..], &answer(&req)[..]);
    wait_for(|| cli.link_ready(s)).await;
    (cli, s)
}

/// Every size around the threshold, and up to 1 MiB, each byte checked:
/// requests and responses of at least the threshold go by READ (one
/// READ each), smaller ones in packets.
#[test]
fn messages_from_the_threshold_on_go_by_read() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(21, PACKET);
        let (srv, runs) = server(&net, bulk_config());
        let (cli, s) = linked_client(&net, &srv).await;
        let sizes = [
            1,
            1000,
            THRESHOLD - 5,
            THRESHOLD - 4,
            THRESHOLD - 1,
            THRESHOLD,
            THRESHOLD + 1,
            3 * THRESHOLD + 7,
            100_000,
            (1 << 20) - 4,
        ];
        for (i, &len) in sizes.iter().enumerate() {
            let bulk = |rpc: &Rpc<MemTransport>| rpc.stats().bulk_reads + rpc.stats().bulk_writes;
            // A large request is read, or written into room the server
            // granted after the last one (`engine/written_requests.rs`).
            let taken =
                |rpc: &Rpc<MemTransport>| rpc.stats().bulk_reads + rpc.stats().bulk_request_writes;
            let (c0, s0) = (bulk(&cli), taken(&srv));
            let req = request(1, i, len);
            let resp = cli.call(s, ECHO, &req).await.unwrap();
            assert_eq!(&resp[..], &answer(&req)[..], "{len} bytes");
            let len = req.len();
            assert_eq!(taken(&srv) - s0, u64::from(len >= THRESHOLD), "{len}");
            // The response by READ, or written into the room offered.
            assert_eq!(bulk(&cli) - c0, u64::from(len + 4 >= THRESHOLD), "{len}");
        }
        assert!(runs.borrow().values().all(|&n| n == 1));
        assert_eq!(
            cli.stats().bulk_read_failures + srv.stats().bulk_read_failures,
            0
        );
        assert_eq!(srv.memory().request_bytes, 0);
    });
}

/// A handler answering with the request's own buffer (`Request::into_data`)
/// echoes every byte, in packets and by READ (the READ's target is exposed
/// in turn as the response, or written into the client's offered buffer),
/// and the request's bytes leave the budget.
#[test]
fn a_request_buffer_serves_as_its_response() {
    const IN_PLACE: u8 = 3;
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(23, PACKET);
        let (srv, _) = server(&net, bulk_config());
        srv.register_inline(IN_PLACE, |req: Request| {
            let mut resp = req.into_data();
            resp.reverse();
            resp
        })
        .unwrap();
        let (cli, s) = linked_client(&net, &srv).await;
        for (i, len) in [0, 100, THRESHOLD - 1, THRESHOLD, 3 * THRESHOLD + 7, 300_000]
            .into_iter()
            .enumerate()
        {
            let c0 = cli.stats().bulk_reads + cli.stats().bulk_writes;
            let req = request(2, i, len);
            let resp = cli.call(s, IN_PLACE, &req).await.unwrap();
            let mut want = req.clone();
            want.reverse();
            assert!(
                resp[..] == want[..],
                "{len} bytes: not the request reversed"
            );
            // Read, or written into the buffer the request offered
            // (`engine/written_responses.rs`).
            let moved = cli.stats().bulk_reads + cli.stats().bulk_writes;
            assert_eq!(moved - c0, u64::from(len >= THRESHOLD));
            assert_eq!(srv.memory().request_bytes, 0, "{len}");
        }
    });
}

/// `Rpc::call_owned` sends a buffer of the caller's without a copy, in
/// packets and by READ: each response fed back as the next request comes
/// back intact, and a request past the limit fails clearly.
#[test]
fn owned_requests_round_trip_and_chain() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(24, PACKET);
        let (srv, _) = server(&net, bulk_config());
        let (cli, s) = linked_client(&net, &srv).await;
        for (i, len) in [0, 100, THRESHOLD - 1, THRESHOLD, 3 * THRESHOLD + 7, 300_000]
            .into_iter()
            .enumerate()
        {
            let req = request(3, i, len);
            let c0 = cli.stats().bulk_reads + cli.stats().bulk_writes;
            let mut buf = MsgBuf::from(req.clone());
            let want = answer(&req);
            buf = cli.call_owned(s, ECHO, buf).await.unwrap();
            assert!(buf[..] == want[..], "{len} bytes");
            // Read, or written into the buffer the request offered.
            assert_eq!(
                cli.stats().bulk_reads + cli.stats().bulk_writes - c0,
                u64::from(want.len() >= THRESHOLD)
            );
            // The response goes out again as it is.
            let again = cli.call_owned(s, ECHO, buf).await.unwrap();
            assert!(again[..] == answer(&want)[..], "{len} bytes, chained");
        }
        let too_large = MsgBuf::from(vec![0u8; bulk_config().max_msg_len + 1]);
        let e = cli.call_owned(s, ECHO, too_large).await.unwrap_err();
        assert!(matches!(e, RpcError::RequestTooLarge { .. }), "{e}");
    });
}

/// A call dropped while the server READs its request: the request stays
/// exposed (the server reads every byte of it), and the slot serves the
/// next call.
#[test]
fn a_call_dropped_mid_read_keeps_its_buffer() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(22, PACKET);
        let (srv, runs) = server(&net, bulk_config());
        let (cli, s) = linked_client(&net, &srv).await;
        let cli_id = cli.with_transport(MemTransport::id);
        net.hold_reads(true);
        let req = request(2, 0, 50_000);
        // Owned, so dropping it here really drops the call.
        let call = Box::pin(cli.call(s, ECHO, &req));
        let held = pin!(wait_for(|| net.held_reads() == 1));
        match select(call, held).await {
            Either::Right(((), call)) => drop(call),
            Either::Left(_) => panic!("the call ended while its READ was held"),
        }
        assert_eq!(net.exposed_by(cli_id), 1, "exposed while the server reads");
        net.hold_reads(false);
        wait_for(|| runs.borrow().get(&req) == Some(&1)).await;
        for i in 1..20 {
            let req = request(2, i, 20_000 + i);
            let resp = cli.call(s, ECHO, &req).await.unwrap();
            assert_eq!(&resp[..], &answer(&req)[..]);
        }
        assert_eq!(srv.stats().bulk_read_failures, 0);
    });
}

/// A client that vanishes while the server READs its request: that
/// request fails (its memory given back), the server serves others.
#[test]
fn a_client_vanishing_mid_read_fails_its_request_only() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(23, PACKET);
        let (srv, _) = server(&net, bulk_config());
        let (other, so) = linked_client(&net, &srv).await;
        let (cli, s) = linked_client(&net, &srv).await;
        net.hold_reads(true);
        let req = request(3, 0, 60_000);
        {
            let call = pin!(cli.call(s, ECHO, &req));
            let held = pin!(wait_for(|| net.held_reads() == 1));
            assert!(matches!(select(call, held).await, Either::Right(_)));
        }
        assert!(
            srv.memory().request_bytes >= 60_000,
            "charged before the READ"
        );
        drop(cli);
        net.hold_reads(false);
        wait_for(|| srv.stats().bulk_read_failures == 1).await;
        assert_eq!(srv.memory().request_bytes, 0);
        let req = request(3, 1, 70_000);
        let resp = other.call(so, ECHO, &req).await.unwrap();
        assert_eq!(&resp[..], &answer(&req)[..]);
    });
}

/// A server that vanishes while the client READs its response: the call
/// fails with a timeout within the session's retry bound.
#[test]
fn a_server_vanishing_mid_read_fails_the_call_in_bounds() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(24, PACKET);
        let quick = RpcConfig {
            max_retries: 4,
            ..bulk_config()
        };
        let (srv, _) = server(&net, quick.clone());
        srv.register(BIG, |req: Request| async move {
            let mut resp = req.response();
            resp.extend((0..BIG_LEN).map(big_response));
            resp
        })
        .unwrap();
        let (cli, s) = linked_client(&net, &srv).await;
        // (The session's largest response so far is 4,100 bytes: the
        // call offers that much, so its 50,000 bytes come by READ.)
        net.hold_reads(true);
        let t = Instant::now();
        let call = pin!(cli.call(s, BIG, b"y"));
        let held = pin!(wait_for(|| net.held_reads() == 1));
        let Either::Right(((), call)) = select(call, held).await else {
            panic!("the call ended while its READ was held");
        };
        drop(srv);
        let e = call.await.unwrap_err();
        assert!(matches!(e, RpcError::Timeout { .. }), "{e}");
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        net.hold_reads(false);
        assert_eq!(cli.stats().timeouts, 1);
    });
}

/// "In progress" answers (a credit return for a read request's only
/// packet: the server has the request and reads it or runs its handler,
/// the call waits) forged by another endpoint are harmless: from a
/// stranger (not the session's server session number) or for a slot or
/// request number not in progress they are dropped and counted stale;
/// twice for the call in progress they only say what the server's own
/// do. The call ends with its response, its handler ran once, and the
/// session's credits are whole after (a window of calls at once).
#[test]
fn forged_in_progress_answers_are_harmless() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(31, PACKET);
        let (srv, runs) = server(&net, bulk_config());
        let (cli, s) = linked_client(&net, &srv).await;
        let cli_id = cli.with_transport(MemTransport::id);
        let mut forger = net.endpoint();
        let mut tx = TxBatch::default();
        // The client's only session is the server's first: number 0.
        let mut forge = |src_session: u32, req_num: u64| {
            let h = Header {
                dest_session: s.0,
                src_session,
                req_num,
                ..Header::new(PacketKind::CreditReturn)
            };
            tx.clear();
            tx.push(&cli_id, &h, &[]);
            forger.send(&tx).unwrap();
        };
        net.hold_reads(true);
        let req = request(4, 0, 60_000);
        let call = pin!(cli.call(s, ECHO, &req));
        let held = pin!(wait_for(|| net.held_reads() == 1));
        let Either::Right(((), call)) = select(call, held).await else {
            panic!("the call ended while its READ was held");
        };
        let stale = cli.stats().stale_packets;
        // From strangers, for every request number a slot could hold.
        for req_num in 0..2 * SESSION_SLOTS as u64 {
            forge(77, req_num);
            forge(u32::MAX, req_num);
        }
        let strangers = 4 * SESSION_SLOTS as u64;
        wait_for(|| cli.stats().stale_packets == stale + strangers).await;
        // As the server, twice each: one is the call's, the rest stale.
        for _ in 0..2 {
            for req_num in 0..2 * SESSION_SLOTS as u64 {
                forge(0, req_num);
            }
        }
        let others = 2 * (2 * SESSION_SLOTS as u64 - 1);
        wait_for(|| cli.stats().stale_packets == stale + strangers + others).await;
        net.hold_reads(false);
        let resp = call.await.unwrap();
        assert_eq!(&resp[..], &answer(&req)[..]);
        assert_eq!(runs.borrow().get(&req), Some(&1));
        // For a call that ended: stale.
        let stale = cli.stats().stale_packets;
        for req_num in 0..2 * SESSION_SLOTS as u64 {
            forge(0, req_num);
        }
        wait_for(|| cli.stats().stale_packets == stale + 2 * SESSION_SLOTS as u64).await;
        // The session's credits are whole: a window of calls, small,
        // streamed and read, all at once.
        let reqs: Vec<_> = (0..SESSION_SLOTS)
            .map(|i| request(5, i, [100, 3000, 2 * THRESHOLD][i % 3]))
            .collect();
        let calls = reqs.iter().map(|r| cli.call(s, ECHO, r));
        for (resp, req) in futures::future::join_all(calls).await.iter().zip(&reqs) {
            assert_eq!(&resp.as_ref().unwrap()[..], &answer(req)[..]);
        }
        assert_eq!(cli.stats().timeouts, 0);
    });
}

/// A call that times out fails its session, which gives back its link
/// and the buffers it exposed at once, not at its disconnect: nothing of
/// it stays reachable by the peer.
#[test]
fn a_failed_session_gives_back_its_link_and_exposed_buffers() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(25, PACKET);
        let quick = RpcConfig {
            max_retries: 4,
            ..bulk_config()
        };
        let (srv, _) = server(&net, quick.clone());
        let (cli, s) = linked_client(&net, &srv).await;
        let cli_id = cli.with_transport(MemTransport::id);
        net.set_reachable(srv.with_transport(MemTransport::id), false);
        let e = cli
            .call(s, ECHO, &request(3, 0, 2 * THRESHOLD))
            .await
            .unwrap_err();
        assert!(matches!(e, RpcError::Timeout { .. }), "{e}");
        assert_eq!(net.exposed_by(cli_id), 0, "the request is withdrawn");
        assert!(!cli.link_ready(s), "the link is closed");
        cli.disconnect(s);
        assert_eq!(net.exposed_by(cli_id), 0);
    });
}

/// A peer speaking raw packets (with a link of its own).
pub(super) struct RawPeer {
    pub(super) t: MemTransport,
    pub(super) bulk: Box<dyn Bulk>,
    srv: u32,
    /// The server's session number.
    pub(super) remote: u32,
    tx: TxBatch<u32>,
}

pub(super) const RAW_SESSION: u32 = 7;

impl RawPeer {
    pub(super) fn send(&mut self, h: Header, payload: &[u8]) {
        let h = Header {
            payload_len: payload.len() as u16,
            dest_session: self.remote,
            src_session: RAW_SESSION,
            ..h
        };
        self.tx.clear();
        self.tx.push(&self.srv, &h, payload);
        self.t.send(&self.tx).unwrap();
    }

    /// The next packet of `kind` (others skipped), waiting up to 5 s.
    pub(super) async fn expect(&mut self, kind: PacketKind) -> (Header, Vec<u8>) {
        let t = Instant::now();
        loop {
            let mut got = None;
            let mut cx = Context::from_waker(Waker::noop());
            let _ = self.t.poll_recv(&mut cx, 64, &mut |p| {
                if got.is_none() {
                    if let Ok((h, payload)) = Header::decode(p) {
                        if h.kind == kind {
                            got = Some((h, payload.to_vec()));
                        }
                    }
                }
            });
            if let Some(g) = got {
                return g;
            }
            assert!(t.elapsed() < Duration::from_secs(5), "no {kind:?} came");
            verbio_runtime::sleep(Duration::from_millis(2)).await;
        }
    }

    pub(super) async fn connect(net: &MemNetwork, srv: &Rpc<MemTransport>) -> RawPeer {
        let mut t = net.endpoint();
        let bulk = t.bulk().expect("a bulk path");
        let srv_id = srv.with_transport(MemTransport::id);
        let mut raw = RawPeer {
            t,
            bulk,
            srv: srv_id,
            remote: 0,
            tx: TxBatch::default(),
        };
        let addr = raw.t.local_addr();
        raw.send(
            Header {
                req_num: 1,
                msg_len: PACKET as u32,
                ..Header::new(PacketKind::Connect)
            },
            &addr,
        );
        let (ack, _) = raw.expect(PacketKind::ConnectAck).await;
        raw.remote = ack.src_session;
        raw
    }

    /// Opens (again) a link numbered `id`.
    pub(super) async fn open_link(&mut self, id: u64) {
        let addr = self.bulk.open(id).unwrap();
        let step = |pkt_idx| Header {
            req_num: id,
            pkt_idx,
            ..Header::new(PacketKind::BulkConnect)
        };
        self.send(step(0), &addr);
        let (_, theirs) = self.expect(PacketKind::BulkConnectAck).await;
        self.bulk.connect(id, &theirs).unwrap();
        self.send(step(1), &addr);
        let (ack, _) = self.expect(PacketKind::BulkConnectAck).await;
        assert_eq!(ack.pkt_idx, 1);
    }

    fn read_request(&mut self, req_num: u64, desc: BulkDesc, len: u32) {
        self.read_request_offering(req_num, ECHO, desc, len, 0);
    }

    /// A read request of `req_type` offering `offer` bytes at `desc` for
    /// the response.
    fn read_request_offering(
        &mut self,
        req_num: u64,
        req_type: u8,
        desc: BulkDesc,
        len: u32,
        offer: u32,
    ) {
        let h = Header {
            req_type,
            req_num,
            msg_len: len,
            pkt_count: 1,
            ..Header::new(PacketKind::ReadRequest)
        };
        self.send(h, &desc.encode_offer(offer));
    }
}

/// A server answering BIG.
fn big_server(net: &MemNetwork) -> Rpc<MemTransport> {
    let (srv, _) = server(net, bulk_config());
    srv.register_inline(BIG, |req: Request| {
        let mut resp = req.response();
        resp.extend((0..BIG_LEN).map(big_response));
        resp
    })
    .unwrap();
    srv
}

/// Large responses are written into room the call offers whatever the
/// request: one in a single packet, one streamed, and a read request
/// whose own buffer (up to twice the request) is too small, each offer a
/// buffer of the session's last large response (an offer packet); only
/// the first large response, longer than any before, is read. Nothing
/// stays exposed after a call.
#[test]
fn large_responses_are_written_whatever_the_request() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(29, PACKET);
        let srv = big_server(&net);
        let (cli, s) = linked_client(&net, &srv).await;
        let id = cli.with_transport(MemTransport::id);
        let check = |resp: &[u8]| {
            assert_eq!(resp.len(), BIG_LEN);
            assert!(resp.iter().enumerate().all(|(i, &b)| b == big_response(i)));
        };
        // Longer than the 4,100 bytes offered: read; the next calls
        // offer 50,000.
        let r0 = cli.stats().bulk_reads;
        check(&cli.call(s, BIG, b"x").await.unwrap());
        assert_eq!(cli.stats().bulk_reads, r0 + 1);
        for (i, len) in [1, 10, 3000, THRESHOLD - 1, THRESHOLD, 20_000]
            .into_iter()
            .enumerate()
        {
            let (r0, w0) = (cli.stats().bulk_reads, cli.stats().bulk_writes);
            let req = request(2, i, len);
            check(&cli.call(s, BIG, &req).await.unwrap());
            assert_eq!(cli.stats().bulk_writes, w0 + 1, "{len}: written");
            assert_eq!(cli.stats().bulk_reads, r0, "{len}: not read");
            assert_eq!(net.exposed_by(id), 0, "{len}");
        }
        // A window of them, slot by slot.
        let reqs: Vec<Vec<u8>> = (0..12).map(|i| request(3, i, 100 + i)).collect();
        let w0 = cli.stats().bulk_writes;
        let resps = futures::future::join_all(reqs.iter().map(|r| cli.call(s, BIG, r))).await;
        for resp in resps {
            check(&resp.unwrap());
        }
        assert_eq!(cli.stats().bulk_writes, w0 + 12);
        // A small response to a call that offered room ends the offers:
        // the next large response is read, and says how large again.
        assert_eq!(
            &cli.call(s, ECHO, b"ab").await.unwrap()[..],
            &answer(b"ab")[..]
        );
        let (r0, w0) = (cli.stats().bulk_reads, cli.stats().bulk_writes);
        check(&cli.call(s, BIG, b"x").await.unwrap());
        assert_eq!(cli.stats().bulk_reads, r0 + 1);
        check(&cli.call(s, BIG, b"x").await.unwrap());
        assert_eq!(cli.stats().bulk_writes, w0 + 1);
        assert_eq!(srv.stats().bulk_write_failures, 0);
        assert_eq!(cli.stats().timeouts + cli.stats().malformed_packets, 0);
        assert_eq!(net.exposed_by(id), 0);
        wait_for(|| srv.memory().request_bytes == 0).await;
    });
}

/// A small request whose response is being written: the client's resends
/// are answered (the server is alive) while the WRITE is held for many
/// times the retry bound, and the call completes once it lands; a server
/// that vanishes then fails the next such call within the bound.
#[test]
fn a_call_waits_for_its_write_however_long_and_not_for_a_vanished_server() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(27, PACKET);
        let quick = RpcConfig {
            max_retries: 4,
            ..bulk_config()
        };
        let (srv, _) = server(&net, quick.clone());
        srv.register_inline(BIG, |req: Request| {
            let mut resp = req.response();
            resp.extend((0..BIG_LEN).map(big_response));
            resp
        })
        .unwrap();
        let cli = Rpc::new(net.endpoint(), quick);
        let s = cli.connect(&srv.local_addr()).await.unwrap();
        // The first large response comes in packets (no link yet) and
        // opens the link: the calls after it offer room for one.
        check_big(&cli.call(s, BIG, b"a").await.unwrap());
        wait_for(|| cli.link_ready(s)).await;
        check_big(&cli.call(s, BIG, b"b").await.unwrap());
        net.hold_writes(true);
        {
            let call = pin!(cli.call(s, BIG, b"c"));
            let held = pin!(wait_for(|| net.held_writes() == 1));
            let Either::Right(((), call)) = select(call, held).await else {
                panic!("the call ended while its WRITE was held");
            };
            // 20 rto against a bound of 5.
            verbio_runtime::sleep(Duration::from_millis(100)).await;
            net.hold_writes(false);
            check_big(&call.await.unwrap());
        }
        assert_eq!(cli.stats().timeouts, 0);
        net.hold_writes(true);
        let t = Instant::now();
        let call = pin!(cli.call(s, BIG, b"d"));
        let held = pin!(wait_for(|| net.held_writes() == 1));
        let Either::Right(((), call)) = select(call, held).await else {
            panic!("the call ended while its WRITE was held");
        };
        drop(srv);
        let e = call.await.unwrap_err();
        assert!(matches!(e, RpcError::Timeout { .. }), "{e}");
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        net.hold_writes(false);
    });
}

/// Offers from a raw peer: malformed (dropped, counted), for an older or
/// an answered request (stale, ignored), twice for one request (the
/// later one counts), with a bad key (the WRITE fails: that link is
/// closed and the response goes in packets when asked again), on a
/// session without a link (ignored). The server serves a legitimate
/// client throughout and holds nothing after.
#[test]
fn hostile_offers_fail_their_write_only() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(30, PACKET);
        let srv = big_server(&net);
        let (cli, s) = linked_client(&net, &srv).await;
        let mut raw = RawPeer::connect(&net, &srv).await;
        let offer = |req_num, room| Header {
            req_num,
            msg_len: room,
            ..Header::new(PacketKind::Offer)
        };
        let big = |req_num| Header {
            req_type: BIG,
            req_num,
            msg_len: 1,
            pkt_count: 1,
            ..Header::new(PacketKind::Request)
        };
        let bad_key = BulkDesc {
            addr: 0x40,
            rkey: 0xdead,
        };
        let stats = srv.stats();
        // No link yet: ignored.
        raw.send(offer(0, 60_000), &bad_key.encode());
        wait_for(|| srv.stats().stale_packets == stats.stale_packets + 1).await;
        raw.open_link(1).await;
        // Reserved bytes set: malformed.
        raw.send(offer(0, 60_000), &bad_key.encode_offer(5));
        wait_for(|| srv.stats().malformed_packets == stats.malformed_packets + 1).await;
        // A bad key: the WRITE fails, the link is closed; asked again,
        // the response comes in packets.
        raw.send(offer(0, 60_000), &bad_key.encode());
        raw.send(big(0), b"x");
        wait_for(|| srv.stats().bulk_write_failures == 1).await;
        raw.send(big(0), b"x");
        let (h, payload) = raw.expect(PacketKind::Response).await;
        assert_eq!((h.req_num, h.msg_len), (0, BIG_LEN as u32));
        assert!(payload
            .iter()
            .enumerate()
            .all(|(i, &b)| b == big_response(i)));
        // Twice for one request, the bad one first: the good one counts.
        raw.open_link(2).await;
        let room = vec![0u8; 60_000];
        let (_, addr, rkey) = raw.bulk.expose_writable(2, Vec::new(), room.len()).unwrap();
        raw.send(offer(8, 60_000), &bad_key.encode());
        raw.send(offer(8, 60_000), &BulkDesc { addr, rkey }.encode());
        raw.send(big(8), b"y");
        wait_for(|| srv.stats().bulk_writes == stats.bulk_writes + 1).await;
        assert_eq!(srv.stats().bulk_write_failures, 1);
        // For an answered request, and an older one: stale.
        let stale = srv.stats().stale_packets;
        raw.send(offer(8, 60_000), &BulkDesc { addr, rkey }.encode());
        raw.send(offer(0, 60_000), &BulkDesc { addr, rkey }.encode());
        wait_for(|| srv.stats().stale_packets == stale + 2).await;
        let req = request(8, 1, 30_000);
        assert_eq!(
            &cli.call(s, ECHO, &req).await.unwrap()[..],
            &answer(&req)[..]
        );
        check_big(&cli.call(s, BIG, b"z").await.unwrap());
        wait_for(|| srv.memory().request_bytes == 0).await;
    });
}

fn check_big(resp: &[u8]) {
    assert_eq!(resp.len(), BIG_LEN);
    assert!(resp.iter().enumerate().all(|(i, &b)| b == big_response(i)));
}

/// A client offering more room for the response than its buffer has (or
/// more than 16 MiB): the server's WRITE fails (that link is closed, the
/// response kept for packets, which the peer gets when it asks again),
/// the oversized offer is refused as malformed, and a legitimate client
/// is served throughout with nothing left charged.
#[test]
fn offers_larger_than_the_buffer_fail_that_write_only() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(28, PACKET);
        let (srv, _) = server(&net, bulk_config());
        srv.register(BIG, |req: Request| async move {
            let mut resp = req.response();
            resp.extend((0..BIG_LEN).map(big_response));
            resp
        })
        .unwrap();
        let (cli, s) = linked_client(&net, &srv).await;
        let mut raw = RawPeer::connect(&net, &srv).await;
        raw.open_link(1).await;
        let data = request(8, 0, 5000);
        let (_, addr, rkey) = raw.bulk.expose(data).unwrap();
        let desc = BulkDesc { addr, rkey };
        // Past 16 MiB: malformed, dropped.
        let malformed = srv.stats().malformed_packets;
        let h = Header {
            req_type: BIG,
            req_num: 0,
            msg_len: 5000,
            pkt_count: 1,
            ..Header::new(PacketKind::ReadRequest)
        };
        let mut bad = desc.encode_offer(0);
        bad[12..16].copy_from_slice(&((1u32 << 24) + 1).to_le_bytes());
        raw.send(h, &bad);
        wait_for(|| srv.stats().malformed_packets == malformed + 1).await;
        // 60,000 offered, 5,000 there: the 50,000-byte WRITE fails.
        raw.read_request_offering(0, BIG, desc, 5000, 60_000);
        wait_for(|| srv.stats().bulk_write_failures == 1).await;
        // Asked again: the response in packets.
        raw.read_request_offering(0, BIG, desc, 5000, 60_000);
        let (h, payload) = raw.expect(PacketKind::Response).await;
        assert_eq!(
            (h.req_num, h.status, h.msg_len),
            (0, Status::Ok, BIG_LEN as u32)
        );
        assert!(payload
            .iter()
            .enumerate()
            .all(|(i, &b)| b == big_response(i)));
        let req = request(8, 1, 30_000);
        assert_eq!(
            &cli.call(s, ECHO, &req).await.unwrap()[..],
            &answer(&req)[..]
        );
        wait_for(|| srv.memory().request_bytes == 0).await;
    });
}

/// Read requests with a bad key, address or length fail that request
/// only (`Status::ReadFailed`; the server closes the link, the peer opens
/// another); one past `max_msg_len` is refused without a READ; claims past
/// the request memory are answered busy before anything is read; a good
/// one is served; a legitimate client is served throughout, and nothing
/// stays charged.
#[test]
fn hostile_descriptors_fail_their_request_only() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(25, PACKET);
        let small = RpcConfig {
            max_msg_len: 64 << 10,
            request_memory: 100 << 10,
            ..bulk_config()
        };
        let (srv, runs) = server(&net, small);
        let (cli, s) = linked_client(&net, &srv).await;
        let mut raw = RawPeer::connect(&net, &srv).await;
        let data = request(5, 0, 1000);
        let (_, addr, rkey) = raw.bulk.expose(data.clone()).unwrap();
        let good = BulkDesc { addr, rkey };
        let bad = [
            (
                BulkDesc {
                    addr,
                    rkey: rkey ^ 0x55,
                },
                1000,
            ),
            (good, 1001),
            (
                BulkDesc {
                    addr: addr + 1,
                    rkey,
                },
                1000,
            ),
            (
                BulkDesc {
                    addr: addr - 1,
                    rkey,
                },
                10,
            ),
            (
                BulkDesc {
                    addr: u64::MAX,
                    rkey,
                },
                1000,
            ),
        ];
        let mut link = 1;
        for (n, (desc, len)) in bad.into_iter().enumerate() {
            raw.open_link(link).await;
            link += 1;
            raw.read_request(n as u64, desc, len);
            let (h, _) = raw.expect(PacketKind::Response).await;
            assert_eq!((h.req_num, h.status), (n as u64, Status::ReadFailed));
            let req = request(5, n + 1, 10_000);
            assert_eq!(
                &cli.call(s, ECHO, &req).await.unwrap()[..],
                &answer(&req)[..]
            );
        }
        assert_eq!(srv.stats().bulk_read_failures, bad.len() as u64);
        // Without a link: refused at once.
        raw.read_request(8 + 5, good, 1000);
        let (h, _) = raw.expect(PacketKind::Response).await;
        assert_eq!(h.status, Status::ReadFailed);
        raw.open_link(link).await;
        // Past the message limit: refused, nothing read.
        let reads = net.reads();
        raw.read_request(8 + 6, good, (64 << 10) + 1);
        let (h, _) = raw.expect(PacketKind::Response).await;
        assert_eq!(h.status, Status::RequestTooLarge);
        assert_eq!(net.reads(), reads);
        // Claims of the whole budget: the second is answered busy before
        // any READ, the first charged while its READ is held.
        net.hold_reads(true);
        raw.read_request(8 + 7, good, 60_000);
        wait_for(|| net.held_reads() == 1).await;
        raw.read_request(16 + 8, good, 60_000);
        let (h, _) = raw.expect(PacketKind::CreditReturn).await;
        assert_eq!((h.req_num, h.status), (16 + 8, Status::Busy));
        assert_eq!(net.held_reads(), 1);
        assert!(srv.memory().request_bytes <= srv.memory().request_budget);
        net.hold_reads(false);
        let (h, _) = raw.expect(PacketKind::Response).await;
        assert_eq!((h.req_num, h.status), (8 + 7, Status::ReadFailed));
        // A good one, on a new link.
        raw.open_link(link + 1).await;
        raw.read_request(24 + 9, good, 1000);
        let (h, payload) = raw.expect(PacketKind::Response).await;
        assert_eq!((h.req_num, h.status), (24 + 9, Status::Ok));
        assert_eq!(payload, answer(&data)[..payload.len()]);
        assert_eq!(runs.borrow().get(&data), Some(&1));
        wait_for(|| srv.memory().request_bytes == 0).await;
        let req = request(5, 99, 30_000);
        assert_eq!(
            &cli.call(s, ECHO, &req).await.unwrap()[..],
            &answer(&req)[..]
        );
    });
}

/// A server that ignores bulk connects (a transport without the path):
/// the client's link attempt gives up after its retries and large
/// messages keep streaming.
#[test]
fn without_a_bulk_path_large_messages_stream() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(26, PACKET);
        net.set_bulk(false);
        let (srv, _) = server(&net, bulk_config());
        net.set_bulk(true);
        let cli = Rpc::new(net.endpoint(), bulk_config());
        let s = cli.connect(&srv.local_addr()).await.unwrap();
        for i in 0..10 {
            let req = request(6, i, 30_000);
            let resp = cli.call(s, ECHO, &req).await.unwrap();
            assert_eq!(&resp[..], &answer(&req)[..]);
            verbio_runtime::sleep(Duration::from_millis(10)).await;
        }
        assert!(!cli.link_ready(s));
        assert_eq!(cli.stats().bulk_reads + srv.stats().bulk_reads, 0);
        assert_eq!(cli.stats().timeouts, 0);
    });
}

/// A window of large calls at a session's start waits for the RC link
/// being set up and goes by READ, rather than all streaming in packets
/// (at rxe's 1 KiB MTU, about a thousand packets a MiB).
#[test]
fn large_calls_at_a_sessions_start_wait_for_the_link() {
    const CALLS: usize = super::session::SESSION_SLOTS;
    const LEN: usize = 100_000;
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(27, PACKET);
        let (srv, _) = server(&net, bulk_config());
        let cli = Rpc::new(net.endpoint(), bulk_config());
        let s = cli.connect(&srv.local_addr()).await.unwrap();
        let reqs: Vec<Vec<u8>> = (0..CALLS).map(|i| request(7, i, LEN)).collect();
        let resps = futures::future::join_all(reqs.iter().map(|req| cli.call(s, ECHO, req))).await;
        for (req, resp) in reqs.iter().zip(resps) {
            assert_eq!(&resp.unwrap()[..], &answer(req)[..]);
        }
        assert_eq!(
            srv.stats().bulk_reads,
            CALLS as u64,
            "every request by READ"
        );
        assert_eq!(
            cli.stats().bulk_reads,
            CALLS as u64,
            "every response by READ"
        );
        // Streamed, each request alone would be about 100 packets.
        let sent = cli.stats().packets_sent;
        assert!(sent < 10 * CALLS as u64, "{sent} packets sent");
        assert_eq!(cli.stats().timeouts, 0);
    });
}
