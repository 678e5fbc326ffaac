//! Large responses by WRITE with immediate (`engine/written_responses.rs`) over the
//! in-memory network: every byte when the response fits the offer, READ
//! when it does not, peers vanishing while a WRITE is under way, and
//! immediates from a hostile server.

use std::pin::pin;
use std::task::{Context, Waker};
use std::time::{Duration, Instant};

use futures::future::{join, select, Either};
use verbio_runtime::Runtime;

use super::engine::write_format::{encode_imm, RESP_TRAILER};
use super::header::{BulkDesc, Header, PacketKind, HEADER_LEN};
use super::mem::{MemNetwork, MemTransport};
use super::tests::{answer, config, request, server, wait_for, ECHO};
use super::{Bulk, Request, Rpc, RpcConfig, RpcError, SessionId, Transport, TxBatch};

/// Packets of 1 KiB of payload; messages from 4 KiB go by READ or WRITE.
const PACKET: usize = 1024 + HEADER_LEN;
const THRESHOLD: usize = 4096;
/// A handler answering with the request reversed, in its own buffer: a
/// response as long as the request, so it fits the offer.
const SAME: u8 = 3;

fn bulk_config() -> RpcConfig {
    RpcConfig {
        read_threshold: THRESHOLD,
        ..config()
    }
}

fn reversed(req: &[u8]) -> Vec<u8> {
    req.iter().rev().copied().collect()
}

/// A server answering ECHO ([`answer`]: 4 bytes longer than the request)
/// and SAME ([`reversed`]).
fn write_server(net: &MemNetwork, config: RpcConfig) -> Rpc<MemTransport> {
    let (srv, _) = server(net, config);
    srv.register_inline(SAME, |req: Request| {
        let mut resp = req.into_data();
        resp.reverse();
        resp
    })
    .unwrap();
    srv
}

/// A client with a session to `srv` whose link is ready.
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

/// A large response that fits the buffer its read request offered is
/// written into it (no READ, no read response), every byte right; one
/// larger than the offer goes by READ, and the next call offers room for
/// it; small responses stay in packets.
#[test]
fn responses_that_fit_the_offer_are_written() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(31, PACKET);
        let srv = write_server(&net, bulk_config());
        let (cli, s) = linked_client(&net, &srv).await;
        for (i, len) in [THRESHOLD, THRESHOLD + 1, 100_000, (1 << 20) - 4]
            .into_iter()
            .enumerate()
        {
            let (r0, w0) = (cli.stats().bulk_reads, cli.stats().bulk_writes);
            let req = request(1, i, len);
            let resp = cli.call(s, SAME, &req).await.unwrap();
            assert!(resp[..] == reversed(&req)[..], "{len} bytes");
            assert_eq!(cli.stats().bulk_writes - w0, 1, "{len}: written");
            assert_eq!(cli.stats().bulk_reads - r0, 0, "{len}: not read");
            // The response the offer cannot hold (4 bytes more) is read.
            let resp = cli.call(s, ECHO, &req).await.unwrap();
            assert!(resp[..] == answer(&req)[..], "{len} bytes");
            assert_eq!(cli.stats().bulk_reads - r0, 1, "{len}: read");
            // The next call offers room for a response that long.
            let resp = cli.call(s, ECHO, &req).await.unwrap();
            assert!(resp[..] == answer(&req)[..], "{len} bytes");
            assert_eq!(cli.stats().bulk_writes - w0, 2, "{len}: written");
        }
        // A small response to a large request: in packets.
        let w0 = cli.stats().bulk_writes;
        srv.register_inline(4, |req: Request| req.response())
            .unwrap();
        let resp = cli.call(s, 4, &request(1, 9, 50_000)).await.unwrap();
        assert!(resp.is_empty());
        assert_eq!(cli.stats().bulk_writes, w0);
        wait_for(|| srv.stats().bulk_writes == cli.stats().bulk_writes).await;
        assert_eq!(srv.stats().bulk_write_failures, 0);
        assert_eq!(srv.memory().request_bytes, 0);
        assert_eq!(cli.stats().timeouts, 0);
    });
}

/// A window of calls on one session, each written into its own buffer.
#[test]
fn a_window_of_calls_is_written_slot_by_slot() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(32, PACKET);
        let srv = write_server(&net, bulk_config());
        let (cli, s) = linked_client(&net, &srv).await;
        for round in 0..3 {
            let reqs: Vec<Vec<u8>> = (0..12).map(|i| request(round, i, 30_000 + i)).collect();
            let resps = futures::future::join_all(reqs.iter().map(|r| cli.call(s, SAME, r))).await;
            for (req, resp) in reqs.iter().zip(resps) {
                assert!(resp.unwrap()[..] == reversed(req)[..]);
            }
        }
        assert_eq!(cli.stats().bulk_writes, 36);
        assert_eq!(cli.stats().timeouts + cli.stats().malformed_packets, 0);
    });
}

/// A server that vanishes while its WRITE is under way: the call fails
/// with a timeout within the session's retry bound; the WRITE landing
/// afterwards is stale.
#[test]
fn a_server_vanishing_mid_write_fails_the_call_in_bounds() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(33, PACKET);
        let quick = RpcConfig {
            max_retries: 4,
            ..bulk_config()
        };
        let srv = write_server(&net, quick);
        let (cli, s) = linked_client(&net, &srv).await;
        let req = request(2, 0, 40_000);
        net.hold_writes(true);
        let t = Instant::now();
        let call = pin!(cli.call(s, SAME, &req));
        let held = pin!(wait_for(|| net.held_writes() == 1));
        let Either::Right(((), call)) = select(call, held).await else {
            panic!("the call ended while its WRITE was held");
        };
        drop(srv);
        let e = call.await.unwrap_err();
        assert!(matches!(e, RpcError::Timeout { .. }), "{e}");
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        // The server is gone: its WRITE finds no link.
        net.hold_writes(false);
        assert_eq!(cli.stats().bulk_writes, 0);
    });
}

/// A client that vanishes while the server WRITEs its response: the
/// WRITE fails, the server closes that link and serves others.
#[test]
fn a_client_vanishing_mid_write_fails_that_write_only() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(34, PACKET);
        let srv = write_server(&net, bulk_config());
        let (other, so) = linked_client(&net, &srv).await;
        let (cli, s) = linked_client(&net, &srv).await;
        let req = request(3, 0, 40_000);
        net.hold_writes(true);
        {
            let call = pin!(cli.call(s, SAME, &req));
            let held = pin!(wait_for(|| net.held_writes() == 1));
            assert!(matches!(select(call, held).await, Either::Right(_)));
        }
        drop(cli);
        net.hold_writes(false);
        wait_for(|| srv.stats().bulk_write_failures == 1).await;
        for i in 0..4 {
            let req = request(3, 1 + i, 70_000);
            let resp = other.call(so, SAME, &req).await.unwrap();
            assert!(resp[..] == reversed(&req)[..]);
        }
        assert_eq!(srv.memory().request_bytes, 0);
    });
}

/// A WRITE that fails (the client's buffer withdrawn under it) closes the
/// server's end of the link; the call still gets its response (in packets,
/// from the server's cache), and the session's next large call, which the
/// server cannot READ without a link, goes again over a new link instead
/// of failing with `ReadFailed`.
#[test]
fn a_link_broken_by_a_failed_write_is_replaced_for_the_next_call() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(35, PACKET);
        let srv = write_server(&net, bulk_config());
        let (cli, s) = linked_client(&net, &srv).await;
        let id = cli.with_transport(|t| t.id());
        let req = request(4, 0, 40_000);
        net.hold_writes(true);
        let resp = {
            let call = pin!(cli.call(s, SAME, &req));
            let held = pin!(wait_for(|| net.held_writes() == 1));
            let Either::Right(((), call)) = select(call, held).await else {
                panic!("the call ended while its WRITE was held");
            };
            net.withdraw_exposed(id);
            net.hold_writes(false);
            call.await.unwrap()
        };
        assert!(resp[..] == reversed(&req)[..]);
        assert_eq!(srv.stats().bulk_write_failures, 1);
        for i in 1..4 {
            let req = request(4, i, 50_000 + i);
            let resp = cli.call(s, SAME, &req).await.unwrap();
            assert!(resp[..] == reversed(&req)[..], "call {i}");
        }
        assert_eq!(cli.stats().bulk_relinks, 1);
        assert!(cli.link_ready(s));
        assert_eq!(srv.memory().request_bytes, 0);
        assert_eq!(cli.stats().timeouts, 0);
    });
}

/// A call's exposed buffer (its request, and the room offered for its
/// response) is withdrawn when the call ends, whichever way its response
/// came (written, read, or in packets), not kept exposed to the server
/// until the slot's next call.
#[test]
fn a_finished_call_withdraws_its_buffer() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(36, PACKET);
        let srv = write_server(&net, bulk_config());
        srv.register_inline(4, |req: Request| req.response())
            .unwrap();
        let (cli, s) = linked_client(&net, &srv).await;
        let id = cli.with_transport(|t| t.id());
        assert_eq!(net.exposed_by(id), 0);
        for (i, kind) in [SAME, ECHO, 4, SAME].into_iter().enumerate() {
            let req = request(5, i, 40_000);
            let resp = cli.call(s, kind, &req).await.unwrap();
            let want = match kind {
                SAME => reversed(&req),
                ECHO => answer(&req),
                _ => Vec::new(),
            };
            assert!(resp[..] == want[..], "call {i}");
            assert_eq!(net.exposed_by(id), 0, "call {i} (type {kind})");
        }
        assert_eq!(cli.stats().timeouts, 0);
    });
}

/// A server speaking raw packets, with a link of its own: it answers a
/// client's connect, opens the link the client asks for, and writes what
/// it likes into the buffers the client offers.
struct RawServer {
    t: MemTransport,
    bulk: Box<dyn Bulk>,
    /// The client's endpoint and its session number.
    cli: u32,
    remote: u32,
    tx: TxBatch<u32>,
    link: u64,
    next_token: u64,
    /// The last read request taken (resent ones are skipped).
    last_req: Option<u64>,
}

const RAW_SESSION: u32 = 5;
const RAW_LINK: u64 = 77;

impl RawServer {
    fn new(net: &MemNetwork) -> RawServer {
        let mut t = net.endpoint();
        let bulk = t.bulk().expect("a bulk path");
        RawServer {
            t,
            bulk,
            cli: 0,
            remote: 0,
            tx: TxBatch::default(),
            link: RAW_LINK,
            next_token: 1,
            last_req: None,
        }
    }

    fn send(&mut self, h: Header, payload: &[u8]) {
        let h = Header {
            payload_len: payload.len() as u16,
            dest_session: self.remote,
            src_session: RAW_SESSION,
            ..h
        };
        self.tx.clear();
        self.tx.push(&self.cli, &h, payload);
        self.t.send(&self.tx).unwrap();
    }

    /// The next packet of `kind` (others skipped), waiting up to 5 s.
    async fn expect(&mut self, kind: PacketKind) -> (Header, Vec<u8>) {
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
            verbio_runtime::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Answers a connect.
    async fn accept(&mut self) {
        let (h, addr) = self.expect(PacketKind::Connect).await;
        self.cli = self.t.resolve(&addr).unwrap();
        self.remote = h.src_session;
        let ack = Header {
            req_num: h.req_num,
            msg_len: PACKET as u32,
            pkt_count: 1,
            ..Header::new(PacketKind::ConnectAck)
        };
        self.send(ack, &[]);
    }

    /// Answers the two steps of a bulk connect.
    async fn accept_link(&mut self) {
        let (h, theirs) = self.expect(PacketKind::BulkConnect).await;
        assert_eq!(h.pkt_idx, 0);
        let addr = self.bulk.open(self.link).unwrap();
        self.bulk.connect(self.link, &theirs).unwrap();
        let ack = |h: Header| Header {
            req_num: h.req_num,
            pkt_idx: h.pkt_idx,
            ..Header::new(PacketKind::BulkConnectAck)
        };
        self.send(ack(h), &addr);
        let (h, _) = self.expect(PacketKind::BulkConnect).await;
        assert_eq!(h.pkt_idx, 1);
        self.send(ack(h), &addr);
    }

    /// The next read request: its header, descriptor and offer.
    async fn read_request(&mut self) -> (Header, BulkDesc, u32) {
        loop {
            let (h, payload) = self.expect(PacketKind::ReadRequest).await;
            if self.last_req.is_some_and(|n| h.req_num <= n) {
                continue;
            }
            self.last_req = Some(h.req_num);
            let (desc, offer) = BulkDesc::decode_offer(&payload).expect("a descriptor");
            return (h, desc, offer);
        }
    }

    /// WRITEs response `bytes` of request `req_num` to `desc`, with the
    /// trailer that grants no room.
    fn respond(&mut self, desc: BulkDesc, bytes: &[u8], req_num: u64) {
        let mut b = bytes.to_vec();
        b.extend_from_slice(&BulkDesc { addr: 0, rkey: 0 }.encode_offer(0));
        let imm = encode_imm(req_num, b.len());
        self.write(desc, &b, imm);
    }

    /// WRITEs `bytes` with `imm` to `desc`.
    fn write(&mut self, desc: BulkDesc, bytes: &[u8], imm: u32) {
        let token = self.next_token;
        self.next_token += 1;
        self.bulk
            .write_imm(self.link, bytes.to_vec(), desc.addr, desc.rkey, imm, token)
            .map_err(|(_, e)| e)
            .unwrap();
    }
}

/// Immediates from a hostile server: one naming another call (an old
/// generation, another slot) is ignored and counted; one claiming more
/// than the offer, or nothing, or with a trailer that does not decode,
/// fails that call only; the session serves the next call, and a proper
/// WRITE completes it.
#[test]
fn hostile_immediates_fail_or_are_ignored() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(35, PACKET);
        let mut raw = RawServer::new(&net);
        let cli = Rpc::new(net.endpoint(), bulk_config());
        let cli_addr = cli.local_addr();
        let raw_addr = raw.t.local_addr();
        let (s, ()) = join(cli.connect(&raw_addr), raw.accept()).await;
        let s = s.unwrap();
        assert_eq!(raw.cli, raw.t.resolve(&cli_addr).unwrap());
        let len = 20_000;

        // 1: claims one byte more than offered: the call fails.
        let req = request(4, 1, len);
        let hostile = async {
            raw.accept_link().await;
            let (h, desc, offer) = raw.read_request().await;
            // (With room for the response WRITE's trailer.)
            assert_eq!(offer as usize, len + RESP_TRAILER, "the request's own room");
            raw.write(desc, &[7; 100], encode_imm(h.req_num, offer as usize + 1));
        };
        let (r, ()) = join(cli.call(s, ECHO, &req), hostile).await;
        let e = r.unwrap_err();
        assert!(matches!(e, RpcError::Transport(_)), "{e}");

        // 2: nothing (length 0): fails too.
        let req = request(4, 2, len);
        let hostile = async {
            let (h, desc, _) = raw.read_request().await;
            raw.write(desc, &[], encode_imm(h.req_num, 0));
        };
        let (r, ()) = join(cli.call(s, ECHO, &req), hostile).await;
        let e = r.unwrap_err();
        assert!(matches!(e, RpcError::Transport(_)), "{e}");

        // 2b: a trailer whose capacity is past the message limit: fails.
        let req = request(4, 5, len);
        let hostile = async {
            let (h, desc, _) = raw.read_request().await;
            let mut b = vec![7; 100];
            b.extend_from_slice(&[0xff; RESP_TRAILER]);
            raw.write(desc, &b, encode_imm(h.req_num, b.len()));
        };
        let (r, ()) = join(cli.call(s, ECHO, &req), hostile).await;
        let e = r.unwrap_err();
        assert!(matches!(e, RpcError::Transport(_)), "{e}");

        // 3: an old generation and another slot: ignored; then the
        // proper one completes the call with what was written.
        let req = request(4, 3, len);
        let stale0 = cli.stats().stale_packets;
        let hostile = async {
            let (h, desc, _) = raw.read_request().await;
            let want = reversed(&req);
            raw.respond(desc, &want, h.req_num + 8);
            raw.respond(desc, &want, h.req_num + 1);
            wait_for(|| cli.stats().stale_packets >= stale0 + 2).await;
            raw.respond(desc, &want, h.req_num);
        };
        let (r, ()) = join(cli.call(s, ECHO, &req), hostile).await;
        assert!(r.unwrap()[..] == reversed(&req)[..]);
        assert_eq!(cli.stats().stale_packets - stale0, 2);

        // 4: after the call, its buffer is taken back: a WRITE to it fails
        // at the device, and nothing reaches the client.
        let w0 = cli.stats().bulk_writes;
        let req = request(4, 4, len);
        let hostile = async {
            let (h, desc, _) = raw.read_request().await;
            raw.respond(desc, &req[..100], h.req_num);
            (h, desc)
        };
        let (r, (h, desc)) = join(cli.call(s, ECHO, &req), hostile).await;
        assert_eq!(&r.unwrap()[..], &req[..100]);
        raw.respond(desc, &req[..100], h.req_num);
        let mut cx = Context::from_waker(Waker::noop());
        let mut done = Vec::new();
        raw.bulk.poll_done(&mut cx, &mut done);
        assert!(
            done.last().is_some_and(|d| d.2.is_err()),
            "the region is gone"
        );
        assert_eq!(cli.stats().bulk_writes, w0 + 1);
        assert_eq!(cli.stats().timeouts, 0);
    });
}
