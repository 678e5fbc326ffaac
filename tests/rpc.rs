//! RPC round trips over UD on the test device: the software device, or
//! rxe0 in the VM (`VERBIO_TEST_DEVICE`, run by `scripts/rxe-test.sh`), so
//! the engine is proven on real rdma-core too: calls of one packet and of
//! many (the MTU of the device's port decides), eight at once from one
//! session, an idle session's expiry, a raw peer claiming 1 MiB
//! requests in 64-byte packets, and 16 MiB calls by READ and WRITE: under
//! a timeout far shorter than their transfers, and to a server that
//! vanishes mid-READ.

mod common;

use std::rc::Rc;
use std::time::Duration;

use verbio::rpc::ud::{UdConfig, UdTransport};
use verbio::rpc::{Request, Rpc, RpcConfig, SessionId, SESSION_SLOTS};
use verbio::runtime::{spawn, timeout, Device};

const ECHO: u8 = 1;
/// Answers with the request reversed, in the request's own buffer.
const SAME: u8 = 2;
/// Answers an 8-byte length with a response that long.
const GET: u8 = 3;
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

/// Registers the echo handler (answering [`answer`]) on `server`.
fn register_echo(server: &Rpc<UdTransport>) {
    server
        .register(ECHO, |req: Request| {
            let mut resp = req.response();
            resp.extend_from_slice(&answer(req.data()));
            async move { resp }
        })
        .unwrap();
}

/// `n` calls at once, call `i` on `sessions[i % len]` with a pattern of
/// `len_of(i)` bytes; every answer checked.
async fn call_window(
    client: &Rc<Rpc<UdTransport>>,
    sessions: &[SessionId],
    n: usize,
    len_of: impl Fn(usize) -> usize,
) {
    let calls: Vec<_> = (0..n)
        .map(|i| {
            let client = client.clone();
            let session = sessions[i % sessions.len()];
            let req = common::pattern(len_of(i), i as u8);
            spawn(async move {
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
}

#[test]
fn calls_of_one_and_many_packets_round_trip() {
    let (rt, dev) = common::runtime_and_device();
    common::block(&rt, async {
        let server = endpoint(&dev);
        register_echo(&server);
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
        call_window(&client, &[session], SESSION_SLOTS * 4, |i| 100 + i).await;
        let stats = client.stats();
        println!("client counters: {stats:?}");
    });
}

/// Large messages over the session's RC link on the device: the first
/// large call opens the link (and streams), the later ones' requests go
/// by READ and their responses by WRITE with immediate into the buffer
/// the request offered (or by READ), every byte checked, at sizes around
/// the threshold and up to the 16 MiB limit; eight at once.
#[test]
fn large_messages_go_by_read_over_an_rc_link() {
    let (rt, dev) = common::runtime_and_device();
    common::block(&rt, async {
        let config = RpcConfig {
            max_msg_len: 16 << 20,
            ..RpcConfig::default()
        };
        let t = |dev| UdTransport::new(dev, &UdConfig::default()).expect("UD transport");
        let server = Rpc::new(t(&dev), config.clone());
        register_echo(&server);
        server
            .register_inline(SAME, |req: Request| {
                let mut resp = req.into_data();
                resp.reverse();
                resp
            })
            .unwrap();
        let client = Rc::new(Rpc::new(t(&dev), config.clone()));
        let session = timeout(WAIT, client.connect(&server.local_addr()))
            .await
            .expect("connect in time")
            .expect("session");
        let th = config.read_threshold;
        for len in [th, th - 1, th, th + 1, 100_000, 1 << 20, (16 << 20) - 1, 32] {
            let req = common::pattern(len, len as u8);
            let resp = timeout(WAIT, client.call(session, ECHO, &req))
                .await
                .expect("call in time")
                .unwrap_or_else(|e| panic!("call of {len} bytes: {e}"));
            assert!(resp[..] == answer(&req)[..], "{len} bytes");
        }
        call_window(&client, &[session], SESSION_SLOTS, |i| 200_000 + i).await;
        // A response as long as its request fits the buffer the request
        // offered: written into it by WRITE with immediate.
        let writes = client.stats().bulk_writes;
        for len in [th, 100_000, 1 << 20, 4 << 20] {
            let req = common::pattern(len, len as u8 ^ 0x5a);
            let resp = timeout(WAIT, client.call(session, SAME, &req))
                .await
                .expect("call in time")
                .unwrap_or_else(|e| panic!("call of {len} bytes: {e}"));
            assert!(resp.iter().eq(req.iter().rev()), "{len} bytes");
        }
        // Small requests, large responses: written into room each call
        // offers (from the second: the first says how large), every byte
        // right; a small response ends the offers.
        server
            .register_inline(GET, |req: Request| {
                let len = <[u8; 8]>::try_from(req.data()).map_or(0, u64::from_le_bytes);
                common::pattern(len as usize, 0xc3).into()
            })
            .unwrap();
        let get_writes = client.stats().bulk_writes;
        for i in 0..4 {
            let len = 300_000u64;
            let resp = timeout(WAIT, client.call(session, GET, &len.to_le_bytes()))
                .await
                .expect("call in time")
                .unwrap_or_else(|e| panic!("GET {i}: {e}"));
            assert!(
                resp[..] == common::pattern(len as usize, 0xc3)[..],
                "GET {i}"
            );
        }
        assert!(client.stats().bulk_writes - get_writes >= 3, "GETs written");
        let writes = writes + client.stats().bulk_writes - get_writes;
        let (c, s) = (client.stats(), server.stats());
        println!("client counters: {c:?}\nserver counters: {s:?}");
        // (Requests up to 128 KiB after the first of their slot are
        // written into the room the server granted, not read.)
        assert!(
            s.bulk_reads + s.bulk_request_writes >= 16,
            "requests read or written: {s:?}"
        );
        // (Responses as long as their requests fit the offer: written.)
        let moved = c.bulk_reads + writes;
        assert!(moved >= 12, "responses read or written: {c:?}");
        assert_eq!(c.bulk_writes - writes, 4, "responses written: {c:?}");
        assert_eq!(c.bulk_read_failures + s.bulk_read_failures, 0);
        assert_eq!(s.bulk_write_failures, 0);
        assert_eq!(server.memory().request_bytes, 0);
    });
}

/// 16 MiB calls under a timeout far shorter than their transfers: a
/// response read by the client (the session's first large response),
/// then a request read by the server and its response written by the
/// server into the buffer the request offered, each transfer taking
/// longer than the session's bound on the device. The resends
/// made meanwhile are answered (the server is alive: "in progress", or
/// the read response again), so the calls succeed, every byte right.
#[test]
fn a_16_mib_call_outlives_a_short_timeout() {
    let (rt, dev) = common::runtime_and_device();
    // (Bounded by WAIT, not `common::block`'s 20 s: under ASan, making
    // and checking 16 MiB messages takes seconds.)
    let run = async {
        // Half the default timeout; twice the retries, so that the
        // session's own steps (its link's set-up, the first call) survive
        // a loaded host as with the defaults: a bound of 110 ms, shorter
        // than each 16 MiB transfer here.
        let config = RpcConfig {
            max_msg_len: 16 << 20,
            rto: Duration::from_millis(10),
            max_retries: 10,
            ..RpcConfig::default()
        };
        let t = |dev| UdTransport::new(dev, &UdConfig::default()).expect("UD transport");
        let server = Rpc::new(t(&dev), config.clone());
        server
            .register_inline(ECHO, |req: Request| req.into_data())
            .unwrap();
        server
            .register_inline(GET, |req: Request| {
                let len = <[u8; 8]>::try_from(req.data()).map_or(0, u64::from_le_bytes);
                let mut resp = req.response_with_capacity(len as usize);
                resp.resize(len as usize, 0xc3);
                resp
            })
            .unwrap();
        let client = Rpc::new(t(&dev), config);
        let session = timeout(WAIT, client.connect(&server.local_addr()))
            .await
            .expect("connect in time")
            .expect("session");
        // A large call opens the session's link (the first streams).
        let req = common::pattern(100_000, 9);
        let resp = timeout(WAIT, client.call(session, ECHO, &req))
            .await
            .expect("call in time")
            .expect("the first large call");
        assert!(resp[..] == req[..]);
        let len = 16usize << 20;
        let resp = timeout(WAIT, client.call(session, GET, &(len as u64).to_le_bytes()))
            .await
            .expect("call in time")
            .unwrap_or_else(|e| panic!("GET: {e}"));
        assert!(resp[..] == vec![0xc3; len][..], "GET");
        // Each 4 KiB of the request its own byte: a misplaced piece shows.
        let mut req = vec![0u8; len];
        for (i, piece) in req.chunks_mut(4096).enumerate() {
            piece.fill((i % 251) as u8);
        }
        let resp = timeout(WAIT, client.call(session, ECHO, &req))
            .await
            .expect("call in time")
            .unwrap_or_else(|e| panic!("echo: {e}"));
        assert!(resp[..] == req[..], "echo");
        let (c, s) = (client.stats(), server.stats());
        println!("client counters: {c:?}\nserver counters: {s:?}");
        assert_eq!(c.timeouts, 0);
        assert!(s.bulk_reads >= 2, "requests read: {s:?}");
        assert!(c.bulk_reads >= 1, "the GET's response read: {c:?}");
        assert!(c.bulk_writes >= 1, "the echo's response written: {c:?}");
        assert_eq!(c.bulk_read_failures + s.bulk_read_failures, 0);
    };
    rt.block_on(timeout(WAIT, run)).expect("the calls in time");
}

/// A server that vanishes while it READs a 16 MiB request: the call fails
/// with a timeout after the session's resends and those its transfer
/// adds, not later.
#[test]
fn a_server_vanishing_mid_read_fails_the_call_within_its_bound() {
    let (rt, dev) = common::runtime_and_device();
    common::block(&rt, async {
        let config = RpcConfig {
            max_msg_len: 16 << 20,
            ..RpcConfig::default()
        };
        let t = |dev| UdTransport::new(dev, &UdConfig::default()).expect("UD transport");
        let server = Rpc::new(t(&dev), config.clone());
        server
            .register_inline(SAME, |req: Request| req.into_data())
            .unwrap();
        let client = Rc::new(Rpc::new(t(&dev), config.clone()));
        let session = timeout(WAIT, client.connect(&server.local_addr()))
            .await
            .expect("connect in time")
            .expect("session");
        // A large call first: the link is open for the next.
        let req = common::pattern(100_000, 1);
        let resp = timeout(WAIT, client.call(session, SAME, &req))
            .await
            .expect("call in time")
            .expect("the first large call");
        assert!(resp[..] == req[..]);
        let call = {
            let client = client.clone();
            spawn(async move {
                let req = common::pattern(16 << 20, 2);
                client.call(session, SAME, &req).await.map(|_| ())
            })
        };
        // The server charges the request before it READs it.
        let started = std::time::Instant::now();
        while server.memory().request_bytes < 16 << 20 {
            assert!(started.elapsed() < WAIT, "the server never read");
            verbio::runtime::sleep(Duration::from_micros(200)).await;
        }
        drop(server);
        let gone = std::time::Instant::now();
        let e = timeout(WAIT, call)
            .await
            .expect("the call ends")
            .expect_err("a call to a vanished server fails");
        println!("failed {:?} after the server went: {e}", gone.elapsed());
        // The session's resends, and at most one per `rto` of the bytes
        // its transfers may move at the floor rate (64 MiB/s: 13 for 16
        // MiB at 20 ms), twice: the request read, the response written
        // into the room it offers.
        match e {
            verbio::rpc::RpcError::Timeout { retries, .. } => {
                let most = config.max_retries + 2 * 13;
                assert!((config.max_retries..=most).contains(&retries), "{e}");
            }
            e => panic!("not a timeout: {e}"),
        }
        assert_eq!(client.stats().timeouts, 1);
    });
}

/// Messages larger than a datagram and below the READ threshold over the
/// session's RC link on the device, one SEND each way into the links'
/// shared receive queue: every byte checked at sizes from one packet and
/// one byte to the threshold, a window of them from eight calls at once,
/// and the receive buffers charged to the request memory.
#[test]
fn mid_size_messages_go_by_send_over_the_rc_link() {
    let (rt, dev) = common::runtime_and_device();
    common::block(&rt, async {
        let server = endpoint(&dev);
        register_echo(&server);
        let client = Rc::new(endpoint(&dev));
        let session = timeout(WAIT, client.connect(&server.local_addr()))
            .await
            .expect("connect in time")
            .expect("session");
        let packet = client.max_payload();
        let th = RpcConfig::default().read_threshold;
        let mut sizes = vec![packet + 1, 2 * packet, 3 * packet + 17, 16 << 10];
        sizes.extend([th - 1, packet + 1, 4 << 10, th / 2]);
        for len in sizes {
            let req = common::pattern(len, len as u8);
            let resp = timeout(WAIT, client.call(session, ECHO, &req))
                .await
                .expect("call in time")
                .unwrap_or_else(|e| panic!("call of {len} bytes: {e}"));
            assert!(resp[..] == answer(&req)[..], "{len} bytes");
        }
        call_window(&client, &[session], SESSION_SLOTS * 4, |i| {
            packet + 1 + i * 701
        })
        .await;
        let (c, s) = (client.stats(), server.stats());
        println!("client counters: {c:?}\nserver counters: {s:?}");
        assert!(c.link_packets_sent >= 10, "requests over the link: {c:?}");
        assert!(s.link_packets_sent >= 10, "responses over the link: {s:?}");
        assert_eq!(s.malformed_packets + c.malformed_packets, 0);
        let m = server.memory();
        assert!(m.link_recv_bytes > 0, "{m:?}");
        assert_eq!(m.request_bytes, 0, "{m:?}");
    });
}

/// The links' receives grow with the links: a window of mid-size calls
/// on 16 sessions (16 links, up to 8 SENDs each under way) finds receives
/// posted for all of them. With one ring of 64 for every number of links,
/// about one SEND in ten of such a window met an empty shared receive
/// queue (an RNR NAK, a go-back and the RNR timer's wait; on rxe a kernel
/// tick). Every byte checked; the server's link receive memory, charged
/// to its request memory, is the second ring's after the ninth link.
#[test]
fn link_receives_grow_with_the_links() {
    let (rt, dev) = common::runtime_and_device();
    common::block(&rt, async {
        let server = endpoint(&dev);
        register_echo(&server);
        let client = Rc::new(endpoint(&dev));
        let len = 4 << 10;
        let mut sessions = Vec::new();
        let mut one_ring = 0;
        for i in 0..16 {
            let session = timeout(WAIT, client.connect(&server.local_addr()))
                .await
                .expect("connect in time")
                .expect("session");
            let req = common::pattern(len, i as u8);
            let resp = timeout(WAIT, client.call(session, ECHO, &req))
                .await
                .expect("a link's first call in time")
                .unwrap_or_else(|e| panic!("session {i}: {e}"));
            assert!(resp[..] == answer(&req)[..], "session {i}");
            let bytes = server.memory().link_recv_bytes;
            if i == 0 {
                one_ring = bytes;
                assert!(one_ring > 0, "the first link's ring charged");
            } else if i < 8 {
                assert_eq!(bytes, one_ring, "links 1-{}: one ring", i + 1);
            }
            sessions.push(session);
        }
        let m = server.memory();
        assert_eq!(
            m.link_recv_bytes,
            2 * one_ring,
            "16 links: two rings of receives: {m:?}"
        );
        call_window(&client, &sessions, sessions.len() * SESSION_SLOTS, |i| {
            len + i
        })
        .await;
        let c = client.stats();
        assert!(c.link_packets_sent >= 128, "requests over the links: {c:?}");
        assert_eq!(c.timeouts, 0, "{c:?}");
        let m = server.memory();
        assert_eq!(m.request_bytes, 0, "{m:?}");
    });
}

/// Idle server sessions over UD: the server closes a session its client
/// left idle without pinging it (dropping its address handle), and the client, told by the
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
        register_echo(&server);
        // A client that does not ping its sessions (with pings, the
        // default, its session would stay open: `tests.rs` in the engine).
        let transport = UdTransport::new(&dev, &UdConfig::default()).expect("UD transport");
        let quiet = RpcConfig {
            session_keepalive: false,
            ..RpcConfig::default()
        };
        let client = Rpc::new(transport, quiet);
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

/// The issue-30 attack over UD (the real port): a raw peer opens a session
/// announcing 64-byte packets and claims a 1 MiB request in every slot.
/// The server holds at most its request budget meanwhile (the claims past
/// it are answered "busy"), keeps serving a legitimate client, and holds
/// nothing once the attacker's session expired; then large calls pass.
#[test]
fn claimed_lengths_over_ud_cost_at_most_the_budget() {
    use std::future::poll_fn;
    use std::task::Poll;
    use verbio::rpc::header::{packets_for, Header, PacketKind, HEADER_LEN};
    use verbio::rpc::{Transport, TxBatch};

    let (rt, dev) = common::runtime_and_device();
    common::block(&rt, async {
        let budget = 4 << 20;
        let config = RpcConfig {
            request_memory: budget,
            session_idle_timeout: Some(Duration::from_millis(300)),
            ..RpcConfig::default()
        };
        let transport = UdTransport::new(&dev, &UdConfig::default()).expect("UD transport");
        let server = Rpc::new(transport, config);
        register_echo(&server);
        let client = endpoint(&dev);
        let session = timeout(WAIT, client.connect(&server.local_addr()))
            .await
            .expect("connect in time")
            .expect("session");
        let call = |len: usize| {
            let req = common::pattern(len, 7);
            let client = &client;
            async move {
                let resp = timeout(WAIT, client.call(session, ECHO, &req))
                    .await
                    .expect("call in time")
                    .expect("call");
                assert_eq!(&resp[..], &answer(&req)[..]);
            }
        };
        // The attacker: a UD queue pair writing packets itself.
        let mut atk = UdTransport::new(&dev, &UdConfig::default()).expect("UD transport");
        let to = atk.resolve(&server.local_addr()).expect("server address");
        let addr = atk.local_addr();
        let mut tx = TxBatch::default();
        let connect = Header {
            src_session: 1,
            req_num: 99,
            msg_len: 64,
            payload_len: addr.len() as u16,
            ..Header::new(PacketKind::Connect)
        };
        tx.push(&to, &connect, &addr);
        atk.send(&tx).expect("send");
        tx.clear();
        let mut ack = None;
        let t = std::time::Instant::now();
        while ack.is_none() {
            assert!(t.elapsed() < WAIT, "no connect-ack");
            verbio::runtime::sleep(Duration::from_millis(2)).await;
            poll_fn(|cx| {
                while let Poll::Ready(Ok(n)) = atk.poll_recv(cx, 16, &mut |p| {
                    if let Ok((h, _)) = Header::decode(p) {
                        if h.kind == PacketKind::ConnectAck {
                            ack = Some(h);
                        }
                    }
                }) {
                    if n == 0 {
                        break;
                    }
                }
                Poll::Ready(())
            })
            .await;
        }
        let ack = ack.unwrap();
        let per = ack.msg_len as usize - HEADER_LEN;
        assert_eq!(per, 32, "the smallest packets");
        let claim = 1 << 20;
        let n = packets_for(claim, per);
        for slot in 0..SESSION_SLOTS as u64 {
            let h = Header {
                req_type: ECHO,
                payload_len: per as u16,
                dest_session: ack.src_session,
                src_session: 1,
                req_num: slot,
                msg_len: claim as u32,
                pkt_idx: (n - 1) as u16,
                pkt_count: n as u16,
                ..Header::new(PacketKind::Request)
            };
            tx.push(&to, &h, &vec![0xa5; per]);
        }
        atk.send(&tx).expect("send");
        let t = std::time::Instant::now();
        while server.stats().budget_drops == 0 {
            assert!(t.elapsed() < WAIT, "the claims never arrived");
            call(100).await;
        }
        let during = server.memory();
        assert!(during.request_bytes_peak <= budget, "{during:?}");
        assert!(during.request_bytes > 0, "claims admitted: {during:?}");
        for _ in 0..20 {
            call(1000).await;
        }
        drop(atk);
        let t = std::time::Instant::now();
        while server.memory().server_sessions > 1 {
            assert!(t.elapsed() < WAIT, "the attacker's session never expired");
            call(100).await;
            verbio::runtime::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(server.memory().request_bytes, 0);
        call(200 << 10).await;
    });
}
