//! The RPC endpoint attacked by a hostile peer over the in-memory network:
//! a raw-packet attacker (it speaks the wire format itself) next to a
//! legitimate client. Lengths claimed far past what is sent, session
//! floods from one address and from many, requests never finished,
//! malformed, truncated and foreign packets, lengths at and past every
//! limit, duplicates. Each test checks what the server holds (its own
//! gauges, [`Rpc::memory`], and the bytes its thread allocated, counted by
//! the allocator) stays bounded during the attack and returns when the
//! attacker leaves, and that the legitimate client is served during and
//! after.

mod common;

use std::future::poll_fn;
use std::rc::Rc;
use std::task::Poll;
use std::time::{Duration, Instant};

use common::alloc_count::{live_bytes, Counting};

use verbio::rpc::header::{packets_for, Header, PacketKind, Status, HEADER_LEN, MAX_MSG_LEN};
use verbio::rpc::mem::{MemNetwork, MemTransport};
use verbio::rpc::{Request, Rpc, RpcConfig, RpcError, SessionId, Transport, TxBatch};
use verbio::runtime::{sleep, timeout, Runtime};

#[global_allocator]
static GLOBAL: Counting = Counting;

const ECHO: u8 = 1;
const WAIT: Duration = Duration::from_secs(20);
const MIB: usize = 1 << 20;

fn config() -> RpcConfig {
    RpcConfig {
        rto: Duration::from_millis(10),
        max_retries: 20,
        session_idle_timeout: Some(Duration::from_millis(300)),
        ..RpcConfig::default()
    }
}

fn echo_server(net: &MemNetwork, config: RpcConfig) -> Rpc<MemTransport> {
    let rpc = Rpc::new(net.endpoint(), config);
    rpc.register(ECHO, |req: Request| {
        let mut resp = req.response();
        resp.extend_from_slice(req.data());
        async move { resp }
    })
    .unwrap();
    rpc
}

/// A legitimate client with its session to `server`.
async fn client(
    net: &MemNetwork,
    server: &Rpc<MemTransport>,
) -> (Rc<Rpc<MemTransport>>, SessionId) {
    let cli = Rc::new(Rpc::new(net.endpoint(), config()));
    let s = timeout(WAIT, cli.connect(&server.local_addr()))
        .await
        .expect("connect in time")
        .expect("connect");
    (cli, s)
}

/// One echo call of `len` bytes that must succeed.
async fn served(cli: &Rpc<MemTransport>, s: SessionId, len: usize) {
    let req: Vec<u8> = (0..len).map(|i| (i * 31 + len) as u8).collect();
    let resp = timeout(WAIT, cli.call(s, ECHO, &req))
        .await
        .unwrap_or_else(|_| panic!("call of {len} bytes in time"))
        .unwrap_or_else(|e| panic!("call of {len} bytes: {e}"));
    assert_eq!(&resp[..], &req[..], "echo of {len} bytes");
}

/// Lets the endpoints' tasks run.
async fn settle() {
    sleep(Duration::from_millis(5)).await;
}

/// A peer that writes packets itself.
struct Attacker {
    t: MemTransport,
    server: u32,
    tx: TxBatch<u32>,
}

/// What a server said when it opened a session.
#[derive(Clone, Copy, Debug)]
struct Opened {
    /// Our session number.
    ours: u32,
    /// The server's.
    theirs: u32,
    max_payload: usize,
}

impl Attacker {
    fn new(net: &MemNetwork, server: &Rpc<MemTransport>) -> Attacker {
        let mut t = net.endpoint();
        let server = t.resolve(&server.local_addr()).expect("server address");
        Attacker {
            t,
            server,
            tx: TxBatch::default(),
        }
    }

    fn push(&mut self, h: Header, payload: &[u8]) {
        self.tx.push(&self.server, &h, payload);
    }

    fn push_bytes(&mut self, bytes: &[u8]) {
        self.tx.push_bytes(&self.server, bytes);
    }

    fn flush(&mut self) {
        self.t.send(&self.tx).expect("send");
        self.tx.clear();
    }

    /// Every packet received so far, decoded.
    async fn received(&mut self) -> Vec<(Header, Vec<u8>)> {
        let mut out = Vec::new();
        poll_fn(|cx| {
            while let Poll::Ready(Ok(n)) = self.t.poll_recv(cx, 256, &mut |p| {
                let (h, payload) = Header::decode(p).expect("the server's packets decode");
                out.push((h, payload.to_vec()));
            }) {
                if n == 0 {
                    break;
                }
            }
            Poll::Ready(())
        })
        .await;
        out
    }

    /// A connect for our session `ours` announcing `packet`-byte packets.
    fn connect(&mut self, ours: u32, packet: u32) {
        let addr = self.t.local_addr();
        let h = Header {
            src_session: ours,
            req_num: 0x5eed_0000 + u64::from(ours),
            msg_len: packet,
            payload_len: addr.len() as u16,
            ..Header::new(PacketKind::Connect)
        };
        self.push(h, &addr);
    }

    /// Opens sessions `ours` announcing `packet`-byte packets.
    async fn open(&mut self, ours: std::ops::Range<u32>, packet: u32) -> Vec<Opened> {
        for n in ours.clone() {
            self.connect(n, packet);
        }
        self.flush();
        settle().await;
        let mut opened: Vec<Opened> = self
            .received()
            .await
            .into_iter()
            .filter(|(h, _)| h.kind == PacketKind::ConnectAck)
            .map(|(h, _)| Opened {
                ours: h.dest_session,
                theirs: h.src_session,
                max_payload: h.msg_len as usize - HEADER_LEN,
            })
            .collect();
        opened.sort_by_key(|o| o.ours);
        opened.dedup_by_key(|o| o.ours);
        opened
    }

    /// Pings sessions `opened` (keeps them from expiring).
    fn ping(&mut self, opened: &[Opened]) {
        if opened.is_empty() {
            return;
        }
        for o in opened {
            let h = Header {
                dest_session: o.theirs,
                src_session: o.ours,
                ..Header::new(PacketKind::Ping)
            };
            self.push(h, &[]);
        }
        self.flush();
    }

    /// Request packet `idx` of a request of `msg_len` bytes (payload
    /// filled with 0xa5) in session `o`, request number `req_num`.
    fn request(&mut self, o: Opened, req_num: u64, msg_len: usize, idx: usize) {
        let h = request_header(o, req_num, msg_len, idx);
        let payload = vec![0xa5; usize::from(h.payload_len)];
        self.push(h, &payload);
    }
}

fn request_header(o: Opened, req_num: u64, msg_len: usize, idx: usize) -> Header {
    let n = packets_for(msg_len, o.max_payload);
    let start = idx * o.max_payload;
    let len = (start + o.max_payload).min(msg_len).saturating_sub(start);
    Header {
        req_type: ECHO,
        payload_len: len as u16,
        dest_session: o.theirs,
        src_session: o.ours,
        req_num,
        msg_len: msg_len as u32,
        pkt_idx: idx as u16,
        pkt_count: n as u16,
        ..Header::new(PacketKind::Request)
    }
}

/// Waits (serving the legitimate client meanwhile) until `done`.
async fn until(what: &str, cli: &Rpc<MemTransport>, s: SessionId, mut done: impl FnMut() -> bool) {
    let t = Instant::now();
    while !done() {
        assert!(t.elapsed() < WAIT, "waited {WAIT:?} for {what}");
        served(cli, s, 100).await;
        sleep(Duration::from_millis(10)).await;
    }
}

/// The attack: sessions announcing the smallest packets, then one
/// request packet per slot claiming a 1 MiB message (the last packet, so
/// the whole message would be allocated up to it; and the first). Before
/// the budget, 128 such packets (15 KB on the wire) cost the server
/// 129 MiB, kept after the attacker left.
#[test]
fn claimed_lengths_cost_at_most_the_request_budget() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(7, 4096);
        let budget = 4 * MIB;
        let srv = echo_server(
            &net,
            RpcConfig {
                request_memory: budget,
                ..config()
            },
        );
        let (cli, s) = client(&net, &srv).await;
        // Warm-up: the legitimate traffic's buffers exist before the baseline.
        for len in [100, 64 * 1024] {
            served(&cli, s, len).await;
        }
        let baseline = live_bytes();
        let mut atk = Attacker::new(&net, &srv);
        let sessions = atk.open(0..16, 64).await;
        assert_eq!(sessions.len(), 16, "the attacker's sessions open");
        assert_eq!(sessions[0].max_payload, 32, "the smallest packets");
        for (n, &o) in sessions.iter().enumerate() {
            let last = packets_for(MIB, o.max_payload) - 1;
            for slot in 0..8u64 {
                // Half the sessions send the last packet, half the first.
                atk.request(o, slot, MIB, if n % 2 == 0 { last } else { 0 });
            }
        }
        atk.flush();
        served(&cli, s, 100).await;
        let during = srv.memory();
        let grown = live_bytes() - baseline;
        println!("during: {during:?}, {grown} bytes more than before");
        assert!(during.request_bytes <= budget, "{during:?}");
        assert!(during.request_bytes_peak <= budget, "{during:?}");
        assert!(srv.stats().budget_drops > 0, "the budget was reached");
        // Before: +129 MiB. Now: the budget, the sessions and some slack.
        assert!(
            grown < (budget + MIB) as i64,
            "the server's thread holds {grown} bytes more than before the attack"
        );
        // Served during: small calls, and (once the attacker's claims are
        // gone) large ones.
        for _ in 0..10 {
            served(&cli, s, 1000).await;
        }
        // The attacker leaves: its sessions expire, their memory is back.
        drop(atk);
        until("the attacker's sessions to expire", &cli, s, || {
            srv.memory().server_sessions == 1
        })
        .await;
        let after = srv.memory();
        assert_eq!(after.request_bytes, 0, "{after:?}");
        let left = live_bytes() - baseline;
        println!("after: {after:?}, {left} bytes more than before");
        assert!(left < (MIB / 4) as i64, "{left} bytes still held");
        served(&cli, s, 300 * 1024).await;
        assert_eq!(srv.memory().request_bytes, 0);
    });
}

/// While claims fill the request budget, a legitimate large request is
/// not admitted but told to wait: it outlives its client's retry limit
/// (more retransmissions than `max_retries`, no timeout) and is served
/// once the claims expire.
#[test]
fn a_full_budget_makes_large_requests_wait_not_fail() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(13, 4096);
        let srv = echo_server(
            &net,
            RpcConfig {
                request_memory: 2 * MIB,
                ..config()
            },
        );
        let (cli, s) = client(&net, &srv).await;
        let mut atk = Attacker::new(&net, &srv);
        let o = atk.open(0..1, 4096).await[0];
        // Two claims of a million bytes leave less than 100 KB.
        let claim = 1_000_000;
        let last = packets_for(claim, o.max_payload) - 1;
        for slot in 0..2 {
            atk.request(o, slot, claim, last);
        }
        atk.flush();
        settle().await;
        assert!(srv.memory().request_bytes > 2 * claim, "the budget is full");
        let len = 200 * 1024;
        let req: Vec<u8> = (0..len).map(|i| i as u8).collect();
        // The claims make progress (one new packet each per 20 ms, never
        // their last) until the call has waited past its retry limit: how
        // long the wait is then does not hang on how fast a loaded machine
        // runs the client's timers against the server's idle sweeps. Then
        // they stall, and expire.
        let limit = u64::from(config().max_retries);
        let keep_claims = async {
            let t = Instant::now();
            let mut idx = last;
            while cli.stats().busy_pauses <= limit && t.elapsed() < WAIT && idx > 1 {
                idx -= 1;
                for slot in 0..2 {
                    atk.request(o, slot, claim, idx);
                }
                atk.flush();
                sleep(Duration::from_millis(20)).await;
            }
        };
        let (resp, ()) = futures::join!(timeout(WAIT, cli.call(s, ECHO, &req)), keep_claims);
        let resp = resp.expect("served in time").expect("served, not failed");
        assert_eq!(&resp[..], &req[..]);
        let c = cli.stats();
        assert_eq!(c.timeouts, 0);
        assert!(
            c.busy_pauses > u64::from(config().max_retries),
            "it waited past its retry limit: {c:?}"
        );
        assert!(
            srv.stats().partial_requests_dropped > 0,
            "the claims expired"
        );
    });
}

/// A request whose packets stop coming, in a session kept alive by other
/// requests: dropped after the idle timeout, its memory given back, and a
/// request of the same number sent again later is served in full.
#[test]
fn a_request_never_finished_is_dropped_and_its_memory_freed() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(8, 4096);
        let srv = echo_server(&net, config());
        let (cli, s) = client(&net, &srv).await;
        let mut atk = Attacker::new(&net, &srv);
        let o = atk.open(0..1, 4096).await[0];
        let len = 1_000_000;
        let before = live_bytes();
        for idx in 0..5 {
            atk.request(o, 0, len, idx);
        }
        atk.flush();
        settle().await;
        let held = srv.memory().request_bytes;
        assert_eq!(held, len + 32, "reserved whole, with its bitmap");
        // The 5 packets, at most twice over (the buffer's growth), and the
        // network's and the attacker's own buffers: not the claimed length.
        let grown = live_bytes() - before;
        assert!(
            grown < (20 * o.max_payload) as i64,
            "allocated as packets arrived: {grown} bytes"
        );
        // Slot 1 keeps the session alive; slot 0 never finishes.
        let mut req_num = 1;
        let t = Instant::now();
        while srv.stats().partial_requests_dropped == 0 {
            assert!(t.elapsed() < WAIT, "the stalled request was never dropped");
            atk.request(o, req_num, 10, 0);
            atk.flush();
            req_num += 8;
            served(&cli, s, 100).await;
            sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(srv.memory().server_sessions, 2, "the session stays open");
        assert_eq!(srv.memory().request_bytes, 0);
        // Sent again in full, the request is served.
        let before = srv.stats().handler_runs;
        let n = packets_for(len, o.max_payload);
        for idx in (0..n).rev() {
            atk.request(o, 0, len, idx);
        }
        atk.flush();
        settle().await;
        let got = atk.received().await;
        assert_eq!(srv.stats().handler_runs, before + 1);
        assert!(
            got.iter()
                .any(|(h, _)| h.kind == PacketKind::Response && h.req_num == 0),
            "answered"
        );
    });
}

/// Connect floods: from one address (capped per peer) and from many
/// (capped per endpoint), each refusal counted; the sessions cost bounded
/// memory, expire when the flood stops, and the legitimate client is
/// served throughout and a new one can connect after.
#[test]
fn session_floods_are_capped_and_expire() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(9, 4096);
        let (max_total, max_peer) = (64, 8);
        let srv = echo_server(
            &net,
            RpcConfig {
                max_server_sessions: max_total,
                max_sessions_per_peer: max_peer,
                ..config()
            },
        );
        let (cli, s) = client(&net, &srv).await;
        served(&cli, s, 100).await;
        let baseline = live_bytes();
        // One address, 2,000 session numbers.
        let mut one = Attacker::new(&net, &srv);
        let mut kept = Vec::new();
        for chunk in 0..20 {
            kept.extend(one.open(chunk * 100..chunk * 100 + 100, 4096).await);
            // Kept open by pings (as a client does) while the flood
            // lasts longer than the idle timeout: pings lift no cap.
            one.ping(&kept);
            served(&cli, s, 100).await;
        }
        assert_eq!(kept.len(), max_peer);
        assert_eq!(srv.memory().server_sessions, 1 + max_peer);
        assert_eq!(srv.stats().connects_refused, 2000 - max_peer as u64);
        // Many addresses, 10,000 connects.
        let mut many: Vec<Attacker> = (0..50).map(|_| Attacker::new(&net, &srv)).collect();
        let mut opened: Vec<Vec<Opened>> = Vec::new();
        for i in 0..many.len() {
            opened.push(many[i].open(0..200, 4096).await);
            one.ping(&kept);
            for (a, o) in many.iter_mut().zip(&opened) {
                a.ping(o);
            }
        }
        served(&cli, s, 100).await;
        let m = srv.memory();
        assert_eq!(m.server_sessions, max_total, "{m:?}");
        let grown = live_bytes() - baseline;
        println!("flooded: {m:?}, {grown} bytes more, {:?}", srv.stats());
        assert!(
            grown < 2 * MIB as i64,
            "{grown} bytes for {max_total} sessions"
        );
        drop((one, many));
        until("the flood's sessions to expire", &cli, s, || {
            srv.memory().server_sessions == 1
        })
        .await;
        let (cli2, s2) = client(&net, &srv).await;
        served(&cli2, s2, 5000).await;
        served(&cli, s, 5000).await;
    });
}

/// Packets that are malformed, truncated, for no session, for another
/// peer's session, of the wrong kind for a server, or past a limit: each
/// is dropped and counted, nothing else changes, and the legitimate
/// client's session keeps working.
#[test]
fn malformed_and_foreign_packets_fail_only_themselves() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(10, 4096);
        let max_msg = 64 * 1024;
        let srv = echo_server(
            &net,
            RpcConfig {
                max_msg_len: max_msg,
                ..config()
            },
        );
        let (cli, s) = client(&net, &srv).await;
        let mut atk = Attacker::new(&net, &srv);
        let o = atk.open(0..1, 4096).await[0];
        // The legitimate client's session at the server: the first opened
        // (a session number is its table index under a generation).
        let legit = 0;
        assert_ne!(o.theirs, legit);
        let good = request_header(o, 0, 100, 0).encode();
        let mut bad: Vec<(&str, Vec<u8>)> = Vec::new();
        for len in [0, 1, 16, HEADER_LEN - 1] {
            bad.push(("truncated", good[..len].to_vec()));
        }
        let mut with = |what: &'static str, at: usize, v: u8| {
            let mut p = good.to_vec();
            p[at] = v;
            p.extend_from_slice(&[0; 100]);
            bad.push((what, p));
        };
        with("bad magic", 0, b'x');
        with("bad version", 2, 9);
        with("unknown kind", 3, 99);
        with("status on a request", 5, 1);
        bad.push(("payload shorter than payload_len", {
            let mut p = good.to_vec();
            p.extend_from_slice(&[0; 99]);
            p
        }));
        let mut headers: Vec<(&str, Header, usize)> = Vec::new();
        let req = request_header(o, 0, 100, 0);
        headers.push((
            "no such session",
            Header {
                dest_session: 12345,
                ..req
            },
            100,
        ));
        headers.push((
            "another peer's session",
            Header {
                dest_session: legit,
                ..req
            },
            100,
        ));
        headers.push((
            "wrong source session",
            Header {
                src_session: 77,
                ..req
            },
            100,
        ));
        headers.push((
            "msg_len past the header's limit",
            Header {
                msg_len: MAX_MSG_LEN + 1,
                ..req
            },
            100,
        ));
        headers.push((
            "pkt_count too small",
            Header {
                pkt_count: 1,
                ..request_header(o, 0, 10_000, 1)
            },
            4064,
        ));
        headers.push((
            "pkt_count too large",
            Header {
                pkt_count: 9,
                ..req
            },
            100,
        ));
        headers.push((
            "pkt_idx past pkt_count",
            Header {
                pkt_idx: 3,
                pkt_count: 3,
                ..req
            },
            100,
        ));
        headers.push((
            "payload longer than the packet's share",
            Header {
                msg_len: 10_000,
                pkt_count: 3,
                payload_len: 4000,
                ..req
            },
            4000,
        ));
        for kind in [
            PacketKind::Response,
            PacketKind::CreditReturn,
            PacketKind::ConnectAck,
        ] {
            let h = match kind {
                PacketKind::Response => req,
                PacketKind::ConnectAck => Header {
                    dest_session: o.theirs,
                    src_session: o.ours,
                    msg_len: 4096,
                    ..Header::new(kind)
                },
                _ => Header {
                    dest_session: o.theirs,
                    src_session: o.ours,
                    ..Header::new(kind)
                },
            };
            let n = usize::from(h.payload_len);
            headers.push((
                "a client's packet sent to a server",
                Header { kind, ..h },
                n,
            ));
        }
        headers.push((
            "request for a response never made",
            Header {
                dest_session: o.theirs,
                src_session: o.ours,
                req_num: 5,
                pkt_idx: 3,
                ..Header::new(PacketKind::RequestForResponse)
            },
            0,
        ));
        headers.push((
            "disconnect of the client's session from a stranger",
            Header {
                dest_session: legit,
                src_session: 99,
                ..Header::new(PacketKind::Disconnect)
            },
            0,
        ));
        for (what, h, n) in headers {
            let mut p = h.encode().to_vec();
            p.extend_from_slice(&vec![0x11; n]);
            p[6..8].copy_from_slice(&(n as u16).to_le_bytes());
            bad.push((what, p));
        }
        bad.push(("connect from an address that does not resolve", {
            let h = Header {
                src_session: 5,
                msg_len: 4096,
                payload_len: 40,
                ..Header::new(PacketKind::Connect)
            };
            let mut p = h.encode().to_vec();
            p.extend_from_slice(&[0xee; 40]);
            p
        }));
        for (what, p) in &bad {
            let before = srv.stats();
            atk.push_bytes(p);
            atk.flush();
            settle().await;
            let after = srv.stats();
            let refused = (after.malformed_packets + after.stale_packets)
                - (before.malformed_packets + before.stale_packets);
            assert_eq!(refused, 1, "{what}: refused and counted once: {after:?}");
            assert_eq!(
                after.handler_runs, before.handler_runs,
                "{what}: no handler ran"
            );
            assert_eq!(srv.memory().request_bytes, 0, "{what}: nothing held");
            assert!(atk.received().await.is_empty(), "{what}: not answered");
            served(&cli, s, 100).await;
        }
        // Lengths at the limits are served: the largest message, the
        // smallest and largest single packet.
        for len in [0, o.max_payload, o.max_payload + 1, max_msg] {
            served(&cli, s, len).await;
        }
        // Past the server's limit: refused at its first packet with an
        // error status, nothing kept.
        let before = srv.stats();
        let err = timeout(WAIT, cli.call(s, ECHO, &vec![0; max_msg + 1]))
            .await
            .expect("refused in time")
            .unwrap_err();
        assert!(
            matches!(
                err,
                RpcError::Remote {
                    status: Status::RequestTooLarge,
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(srv.stats().handler_runs, before.handler_runs);
        assert_eq!(srv.memory().request_bytes, 0);
        let strict = Rpc::new(
            net.endpoint(),
            RpcConfig {
                max_msg_len: max_msg,
                ..config()
            },
        );
        let s3 = strict.connect(&srv.local_addr()).await.unwrap();
        let err = strict
            .call(s3, ECHO, &vec![0; max_msg + 1])
            .await
            .unwrap_err();
        assert!(matches!(err, RpcError::RequestTooLarge { .. }), "{err}");
        // The attacker's request past the limit: the error, nothing kept.
        let n = packets_for(max_msg + 1, o.max_payload);
        atk.request(o, 8, max_msg + 1, n - 1);
        atk.flush();
        settle().await;
        let got = atk.received().await;
        assert!(
            got.iter()
                .any(|(h, _)| h.req_num == 8 && h.status == Status::RequestTooLarge),
            "{got:?}"
        );
        assert_eq!(srv.memory().request_bytes, 0);
        // The attacker's own session still works too: it was not failed.
        atk.request(o, 16, 100, 0);
        atk.flush();
        settle().await;
        assert!(atk
            .received()
            .await
            .iter()
            .any(|(h, _)| h.kind == PacketKind::Response));
    });
}

/// The same request packets 50 times over, in and out of order: the
/// handler runs once per request, every copy is answered from the slot's
/// state, and nothing accumulates.
#[test]
fn duplicates_run_the_handler_once() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(11, 4096);
        let srv = echo_server(&net, config());
        let (cli, s) = client(&net, &srv).await;
        let mut atk = Attacker::new(&net, &srv);
        let o = atk.open(0..1, 4096).await[0];
        let len = 10_000;
        let n = packets_for(len, o.max_payload);
        for round in 0..50 {
            for idx in 0..n {
                atk.request(o, 0, len, if round % 2 == 0 { idx } else { n - 1 - idx });
            }
            atk.request(o, 1, 10, 0);
            atk.flush();
            settle().await;
            atk.received().await;
        }
        // Twice: request 0 (three packets) and request 1.
        assert_eq!(srv.stats().handler_runs, 2);
        assert!(srv.stats().duplicate_requests >= 49 * 4);
        assert_eq!(srv.memory().request_bytes, 0);
        served(&cli, s, 20_000).await;
    });
}
