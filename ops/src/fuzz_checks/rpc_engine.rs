//! Checks for the RPC engine's handling of peer packets
//! ([`crate::rpc`]): a sequence of packets fed to a server endpoint (with
//! an echo handler) and to a client endpoint (with a call under way), as
//! the dispatcher would, timers and idle sweeps included. Never a panic,
//! and the limits hold after every packet: request memory within its
//! budget (plus the single-packet requests, which are not refused),
//! sessions within their caps. Both endpoints have the in-memory
//! large-message path (links, exposed buffers, READs): the client's
//! session has a ready link and its call goes as a read request, and the
//! packets may open links at the server, send read requests with any
//! descriptor, and answer the client with read responses.

use std::task::{Context, Waker};

use super::{LenField, Seed};
use crate::rpc::engine::client_calls::Req;
use crate::rpc::engine::Core;
use crate::rpc::header::{BulkDesc, Header, PacketKind, Status, HEADER_LEN, PAYLOAD_LEN_OFFSET};
use crate::rpc::mem::MemNetwork;
use crate::rpc::session::{Link, LinkStep, Role, Session, SessionState};
use crate::rpc::{MsgBuf, RpcConfig, TransportError, SESSION_SLOTS};

/// The first packet's payload length (packets follow each other, each
/// behind a `u16` length).
pub const LEN_FIELD: LenField = LenField {
    offset: 2 + PAYLOAD_LEN_OFFSET,
    width: 2,
    counted_from: 2 + HEADER_LEN,
};

/// The packet size of both endpoints.
const PACKET: usize = 256;
const ECHO: u8 = 1;
/// The client's call: a request of 3 packets, or one read request.
const CALL_LEN: usize = 600;
/// Messages from this size go by READ.
const READ_THRESHOLD: usize = 512;
/// The link number the client's session uses, and the one the seeds open.
const CLIENT_LINK: u64 = 1;
const SEED_LINK: u64 = 2;

fn config() -> RpcConfig {
    let mut c = RpcConfig {
        max_msg_len: 8 * 1024,
        request_memory: 16 * 1024,
        max_server_sessions: 4,
        max_sessions_per_peer: 2,
        read_threshold: READ_THRESHOLD,
        ..RpcConfig::default()
    };
    c.normalize();
    c
}

/// Splits `data` into packets: each a `u16` LE length, then its bytes.
fn packets(data: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = data;
    std::iter::from_fn(move || {
        let (len, tail) = rest.split_first_chunk::<2>()?;
        let n = usize::from(u16::from_le_bytes(*len)).min(tail.len());
        let (p, tail) = tail.split_at(n);
        rest = tail;
        Some(p)
    })
}

/// The network of the endpoints' large-message paths: endpoint 0 is the
/// server's, 1 the client's.
fn network() -> MemNetwork {
    let net = MemNetwork::new(1, PACKET);
    drop(net.endpoint());
    drop(net.endpoint());
    net
}

/// Endpoint `id`'s large-message path on `net`.
fn bulk(net: &MemNetwork, id: u32) -> Box<dyn crate::rpc::Bulk> {
    Box::new(crate::rpc::mem::bulk::MemBulk {
        net: net.clone(),
        id,
    })
}

/// A client endpoint with one session (its number 0, the server's 0), a
/// ready link to the server's endpoint, and a call of [`CALL_LEN`] bytes
/// under way (a read request).
fn client(net: &MemNetwork) -> Core<u32> {
    let mut c = Core::new(config(), PACKET, vec![1, 0, 0, 0]);
    let mut b = bulk(net, 1);
    let addr = b.open(CLIENT_LINK).expect("a link");
    let mut theirs = 0u32.to_le_bytes().to_vec();
    theirs.extend_from_slice(&SEED_LINK.to_le_bytes());
    b.connect(CLIENT_LINK, &theirs).expect("connected");
    c.bulk = Some(b);
    let mut s = Session::new(
        Role::Client,
        SessionState::Connected,
        0u32,
        PACKET - HEADER_LEN,
    );
    s.credits = c.config.session_credits;
    s.response_window = 4;
    s.link = Some(Link {
        local: CLIENT_LINK,
        id: CLIENT_LINK,
        addr,
        step: LinkStep::Ready,
        retries: 0,
        last: 0,
    });
    let sid = c.add_session(s).expect("a session");
    let mut cx = Context::from_waker(Waker::noop());
    let started = c.poll_start(sid, ECHO, &mut Req::Copy(&[0x5a; CALL_LEN]), &mut cx);
    assert!(started.is_ready(), "the call starts");
    c.tx.clear();
    c
}

/// A server endpoint with an echo handler (run at every turn) and a
/// large-message path.
fn server(net: &MemNetwork) -> Core<u32> {
    let mut c = Core::new(config(), PACKET, vec![0, 0, 0, 0]);
    c.handlers[usize::from(ECHO)] = Some(Default::default());
    c.bulk = Some(bulk(net, 0));
    c
}

/// One dispatcher turn after `packet`: connects, handlers, the batch's
/// pumps and acknowledgements, then the limits.
fn turn(c: &mut Core<u32>, packet: &[u8]) {
    c.on_packet(packet);
    c.poll_bulk(&mut Context::from_waker(Waker::noop()));
    c.accept_connects(|addr| match addr {
        [id, 0, 0, 0] => Ok(u32::from(*id)),
        _ => Err(TransportError::bad_address(
            addr.len(),
            "not a test address",
        )),
    });
    let jobs: Vec<_> = c
        .handlers
        .iter_mut()
        .flatten()
        .flat_map(|q| q.jobs.drain(..))
        .collect();
    for id in jobs {
        let Some(request) = c.take_request(id) else {
            continue;
        };
        let resp = MsgBuf::from(request.data().to_vec());
        c.respond(id.session, id.slot, id.req_num, resp);
    }
    c.run_pumps();
    c.send_acks();
    c.tx.clear();
    let config = &c.config;
    let m = c.memory();
    // Single-packet requests are counted but never refused.
    let unrefused = config.max_server_sessions * SESSION_SLOTS * (PACKET + 8);
    assert!(
        m.request_bytes <= m.request_budget + unrefused,
        "request memory {m:?} past its budget"
    );
    assert!(m.server_sessions <= config.max_server_sessions, "{m:?}");
    assert!(
        c.peer_sessions
            .values()
            .all(|&n| n <= config.max_sessions_per_peer),
        "a peer past its session cap"
    );
}

/// Feeds the packets of `data` to a server and a client endpoint, with a
/// timer tick every 4 packets and an idle sweep every 16. Returns whether
/// every packet decoded (and there was one).
///
/// # Panics
///
/// On any violated property (that is the point).
pub fn check(data: &[u8]) -> bool {
    let net = network();
    let (mut srv, mut cli) = (server(&net), client(&net));
    let mut decoded = false;
    let mut refused = false;
    for (n, p) in packets(data).enumerate() {
        match Header::decode(p) {
            Ok(_) => decoded = true,
            Err(_) => refused = true,
        }
        turn(&mut srv, p);
        turn(&mut cli, p);
        if n % 4 == 3 {
            for c in [&mut srv, &mut cli] {
                c.now += 1;
                c.on_timer();
                c.run_pumps();
                c.tx.clear();
            }
        }
        if n % 16 == 15 {
            srv.sweep_idle();
            srv.tx.clear();
        }
    }
    decoded && !refused
}

fn framed(packets: &[Vec<u8>]) -> Vec<u8> {
    let mut v = Vec::new();
    for p in packets {
        v.extend_from_slice(&(p.len() as u16).to_le_bytes());
        v.extend_from_slice(p);
    }
    v
}

fn packet(h: Header, payload: &[u8]) -> Vec<u8> {
    let mut v = h.encode().to_vec();
    v.extend_from_slice(payload);
    v
}

/// A connect from client address `id` for its session `src`.
fn connect(id: u8, src: u32) -> Vec<u8> {
    packet(
        Header {
            src_session: src,
            req_num: 77,
            msg_len: PACKET as u32,
            payload_len: 4,
            ..Header::new(PacketKind::Connect)
        },
        &[id, 0, 0, 0],
    )
}

/// Request packet `idx` of a `len`-byte request in server session 0 (the
/// first connect's, client session 5).
fn request(req_num: u64, len: usize, idx: usize) -> Vec<u8> {
    let per = PACKET - HEADER_LEN;
    let count = len.div_ceil(per).max(1);
    let start = idx * per;
    let n = (start + per).min(len).saturating_sub(start);
    packet(
        Header {
            req_type: ECHO,
            payload_len: n as u16,
            dest_session: 0,
            src_session: 5,
            req_num,
            msg_len: len as u32,
            pkt_idx: idx as u16,
            pkt_count: count as u16,
            ..Header::new(PacketKind::Request)
        },
        &vec![0xa5; n],
    )
}

/// Response packet `j` of a `len`-byte response to the client's call
/// (its session 0, request 0).
fn response(len: usize, j: usize, status: Status) -> Vec<u8> {
    let per = PACKET - HEADER_LEN;
    let start = j * per;
    let n = (start + per).min(len).saturating_sub(start);
    packet(
        Header {
            req_type: ECHO,
            status,
            payload_len: n as u16,
            dest_session: 0,
            src_session: 0,
            req_num: 0,
            msg_len: len as u32,
            pkt_idx: j as u16,
            pkt_count: len.div_ceil(per).max(1) as u16,
            ..Header::new(PacketKind::Response)
        },
        &vec![0x3c; n],
    )
}

fn credit_return(last: u16, more: u16, status: Status) -> Vec<u8> {
    packet(
        Header {
            status,
            dest_session: 0,
            src_session: 0,
            req_num: 0,
            pkt_idx: last,
            pkt_count: more,
            ..Header::new(PacketKind::CreditReturn)
        },
        &[],
    )
}

/// A link address of the in-memory path: endpoint `id`, link `link`.
fn link_addr(id: u32, link: u64) -> Vec<u8> {
    let mut v = id.to_le_bytes().to_vec();
    v.extend_from_slice(&link.to_le_bytes());
    v
}

/// Step `step` of a bulk connect of the seeds' link, from client session 5
/// (its end: the client endpoint's link).
fn bulk_connect(step: u16) -> Vec<u8> {
    let addr = link_addr(1, CLIENT_LINK);
    packet(
        Header {
            dest_session: 0,
            src_session: 5,
            req_num: SEED_LINK,
            pkt_idx: step,
            payload_len: addr.len() as u16,
            ..Header::new(PacketKind::BulkConnect)
        },
        &addr,
    )
}

/// Where the in-memory path puts the `n`th buffer exposed on the network.
fn exposed(n: u32) -> BulkDesc {
    BulkDesc {
        addr: (u64::from(n) << 32) | 0x40,
        rkey: n,
    }
}

/// A read request for server session 0 (client session 5).
fn read_request(req_num: u64, desc: BulkDesc, len: u32) -> Vec<u8> {
    packet(
        Header {
            req_type: ECHO,
            payload_len: 16,
            dest_session: 0,
            src_session: 5,
            req_num,
            msg_len: len,
            pkt_count: 1,
            ..Header::new(PacketKind::ReadRequest)
        },
        &desc.encode(),
    )
}

/// A read response to the client's call (its session 0, request 0).
fn read_response(desc: BulkDesc, len: u32) -> Vec<u8> {
    packet(
        Header {
            payload_len: 16,
            dest_session: 0,
            src_session: 0,
            req_num: 0,
            msg_len: len,
            pkt_count: 1,
            ..Header::new(PacketKind::ReadResponse)
        },
        &desc.encode(),
    )
}

/// An offer of room for request `req_num`'s response, for server session
/// 0 (client session 5).
fn offer(req_num: u64, desc: BulkDesc, room: u32) -> Vec<u8> {
    packet(
        Header {
            payload_len: 16,
            dest_session: 0,
            src_session: 5,
            req_num,
            msg_len: room,
            ..Header::new(PacketKind::Offer)
        },
        &desc.encode(),
    )
}

/// Sequences that reach every path: a session and its requests (one
/// packet, several, out of order, twice, past the limits, never
/// finished), requests for response, connect floods, and a client's
/// call answered in ranges, early, busy, or with an error.
pub fn seeds() -> Vec<Seed> {
    let rfr = packet(
        Header {
            dest_session: 0,
            src_session: 5,
            req_num: 1,
            pkt_idx: 1,
            pkt_count: 3,
            ..Header::new(PacketKind::RequestForResponse)
        },
        &[],
    );
    let n = 2000usize.div_ceil(PACKET - HEADER_LEN);
    let mut requests = vec![connect(9, 5), request(0, 100, 0)];
    requests.extend((0..n).rev().map(|i| request(1, 2000, i)));
    requests.push(request(1, 2000, 3));
    requests.push(rfr);
    requests.push(request(2, 20_000, 5));
    requests.push(request(3, 8000, 0));
    let flood: Vec<Vec<u8>> = (0..12).map(|i| connect(9 + (i % 3) as u8, i)).collect();
    let resp_len: usize = 1200;
    let r = resp_len.div_ceil(PACKET - HEADER_LEN);
    let mut answers = vec![credit_return(1, 1, Status::Ok)];
    answers.extend((1..r).rev().map(|j| response(resp_len, j, Status::Ok)));
    answers.push(response(resp_len, 0, Status::Ok));
    vec![
        Seed::new("session-and-requests", framed(&requests)),
        Seed::new("connect-flood", framed(&flood)),
        // The client's call (exposed first, as the 1st buffer) read by the
        // server, which then grants the slot room for written requests (the
        // 2nd), its response exposed (the 3rd) and read by the client;
        // descriptors with a bad key, past the limit and past the region.
        Seed::new(
            "read-requests-and-responses",
            framed(&[
                connect(9, 5),
                bulk_connect(0),
                bulk_connect(1),
                read_request(0, exposed(1), CALL_LEN as u32),
                read_response(exposed(3), CALL_LEN as u32),
                read_request(1, exposed(7), CALL_LEN as u32),
                read_request(2, exposed(1), 9000),
                bulk_connect(0),
                bulk_connect(1),
                read_request(3, exposed(1), 4000),
            ]),
        ),
        // Offers of room for responses: before the link, for a request
        // to come, twice, for an answered one.
        Seed::new(
            "offers",
            framed(&[
                connect(9, 5),
                offer(0, exposed(3), 5000),
                bulk_connect(0),
                bulk_connect(1),
                offer(0, exposed(3), 5000),
                offer(0, exposed(4), 6000),
                request(0, 100, 0),
                offer(0, exposed(4), 6000),
            ]),
        ),
        Seed::new("call-answered", framed(&answers)),
        Seed::new(
            "call-busy-then-refused",
            framed(&[
                credit_return(0, 0, Status::Busy),
                credit_return(2, 0, Status::Ok),
                response(0, 0, Status::RequestTooLarge),
            ]),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rpc::session::CallState;

    /// Calls of the client's session 0 that ended.
    fn calls_done(c: &Core<u32>) -> usize {
        let s = c.sessions.get(0).expect("the session");
        s.client
            .iter()
            .filter(|slot| matches!(slot.state, CallState::Done(_)))
            .count()
    }

    /// The seeds reach the paths they are for: sessions open (and are
    /// capped), handlers run, the client's call completes.
    #[test]
    fn seeds_reach_the_engine() {
        let seeds = seeds();
        let run = |name: &str, c: &mut Core<u32>| {
            let seed = seeds.iter().find(|s| s.name == name).unwrap();
            for p in packets(&seed.bytes) {
                turn(c, p);
            }
        };
        let net = network();
        let mut srv = server(&net);
        run("session-and-requests", &mut srv);
        assert_eq!(srv.stats.handler_runs, 2, "{:?}", srv.stats);
        assert!(srv.stats.duplicate_requests >= 1);
        assert!(srv.stats.malformed_packets >= 1, "past max_msg_len");
        let mut srv = server(&net);
        run("connect-flood", &mut srv);
        assert_eq!(srv.memory().server_sessions, 4);
        assert!(srv.stats.connects_refused > 0);
        let net = network();
        let (mut srv, mut cli) = (server(&net), client(&net));
        run("read-requests-and-responses", &mut srv);
        run("read-requests-and-responses", &mut cli);
        assert_eq!(srv.stats.handler_runs, 1, "{:?}", srv.stats);
        assert_eq!(srv.stats.bulk_reads, 1, "{:?}", srv.stats);
        assert_eq!(srv.stats.bulk_read_failures, 2, "{:?}", srv.stats);
        assert_eq!(cli.stats.bulk_reads, 1, "{:?}", cli.stats);
        assert!(calls_done(&cli) == 1, "{:?}", cli.stats);
        assert_eq!(srv.memory().request_bytes, 0);
        let net = network();
        let mut srv = server(&net);
        run("offers", &mut srv);
        assert_eq!(srv.stats.handler_runs, 1, "{:?}", srv.stats);
        assert!(srv.stats.stale_packets >= 2, "{:?}", srv.stats);
        let net = network();
        let mut cli = client(&net);
        run("call-answered", &mut cli);
        assert!(calls_done(&cli) == 1, "{:?}", cli.stats);
        let mut cli = client(&net);
        run("call-busy-then-refused", &mut cli);
        assert_eq!(cli.stats.busy_pauses, 1);
        assert!(calls_done(&cli) == 1, "{:?}", cli.stats);
    }
}
