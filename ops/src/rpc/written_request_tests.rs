//! Large requests written into room the server granted (`engine/written_requests.rs`,
//! "Requests written"): one trip instead of the READ's three, and the
//! memory a peer can make the server hold for it bounded, against
//! clients that never use their grants and raw peers that misuse them.

use super::bulk_tests::RawPeer;
use super::engine::write_format::{
    encode_imm, encode_trailer, RESP_TRAILER, WRITE_TRAILER, WRITTEN_REQUEST_MAX,
};
use super::header::{BulkDesc, Header, PacketKind, HEADER_LEN};
use super::mem::{MemNetwork, MemTransport};
use super::tests::{answer, config, lossy, request, server, wait_for, ECHO};
use super::{Request, Rpc, RpcConfig, SessionId};
use std::cell::Cell;
use std::rc::Rc;
use std::time::Duration;
use verbio_runtime::Runtime;

const PACKET: usize = 1024 + HEADER_LEN;
const THRESHOLD: usize = 4096;

fn bulk_config() -> RpcConfig {
    RpcConfig {
        read_threshold: THRESHOLD,
        ..config()
    }
}

/// A client whose session to `srv` has its link (its first large call,
/// by READ, made it).
async fn linked_client(
    net: &MemNetwork,
    srv: &Rpc<MemTransport>,
    tag: usize,
) -> (Rpc<MemTransport>, SessionId) {
    let cli = Rpc::new(net.endpoint(), bulk_config());
    let s = cli.connect(&srv.local_addr()).await.unwrap();
    let req = request(900 + tag, 0, THRESHOLD);
    assert_eq!(cli.call(s, ECHO, &req).await.unwrap()[..], answer(&req)[..]);
    wait_for(|| cli.link_ready(s)).await;
    (cli, s)
}

/// One call at a time, the large requests after the first are written
/// into the room granted with the one before: none is read (each READ
/// is three one-way trips: the read request, the READ's request, its
/// data), every byte arrives and each handler runs once; what the
/// grants hold is gone when the session ends. (Before: a READ per call.)
#[test]
fn large_requests_after_the_first_are_written() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(41, PACKET);
        let (srv, runs) = server(&net, bulk_config());
        let (cli, s) = linked_client(&net, &srv, 0).await;
        // A request is written when it fits the slot's room (granted
        // after the last request read: its length and the trailer), read
        // otherwise.
        let sizes = [
            10_000,
            10_000,
            9_000,
            30_000,
            30_000,
            100_000,
            100_000,
            WRITTEN_REQUEST_MAX,
            WRITTEN_REQUEST_MAX,
        ];
        let reads = srv.stats().bulk_reads;
        let (mut want_read, mut want_written, mut room) = (0, 0, THRESHOLD);
        for (i, &len) in sizes.iter().enumerate() {
            let req = request(1, i, len);
            let resp = cli.call(s, ECHO, &req).await.unwrap();
            assert!(resp[..] == answer(&req)[..], "{len} bytes");
            // The room stays; a larger request, read, gets a larger one.
            if len <= room {
                want_written += 1;
            } else {
                want_read += 1;
                room = len;
            }
        }
        let (read, written) = (
            srv.stats().bulk_reads - reads,
            srv.stats().bulk_request_writes,
        );
        assert_eq!((read, written), (want_read, want_written));
        assert_eq!((read, written), (4, 5));
        assert_eq!(cli.stats().bulk_request_writes, written);
        // Now the same size again and again: written every time.
        for i in 0..8 {
            let req = request(2, i, 20_000);
            assert!(cli.call(s, ECHO, &req).await.unwrap()[..] == answer(&req)[..]);
        }
        assert!(srv.stats().bulk_reads - reads <= read + 1);
        assert!(runs.borrow().values().all(|&n| n == 1));
        assert_eq!(srv.stats().malformed_packets, 0);
        wait_for(|| srv.memory().request_bytes == 0).await;
        let m = srv.memory();
        assert!(
            m.granted_bytes >= 20_000 && m.granted_bytes <= m.request_budget / 2,
            "{m:?}"
        );
        // A request past the largest written one is read and gets no room.
        let req = request(3, 0, WRITTEN_REQUEST_MAX + 1);
        let reads = srv.stats().bulk_reads;
        assert!(cli.call(s, ECHO, &req).await.unwrap()[..] == answer(&req)[..]);
        assert_eq!(srv.stats().bulk_reads - reads, 1);
        cli.disconnect(s);
        wait_for(|| srv.memory().granted_bytes == 0).await;
    });
}

/// Clients that take their grant and never use it: the room all of them
/// are granted stays within half the request memory, apart from it, so
/// a client that comes later is still served (its large requests read,
/// then written once room frees); ending the sessions gives it all back.
#[test]
fn unused_grants_are_bounded_apart_from_requests() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(42, PACKET);
        let small = RpcConfig {
            max_msg_len: 64 << 10,
            request_memory: 160 << 10,
            ..bulk_config()
        };
        let (srv, runs) = server(&net, small);
        let budget = srv.memory().request_budget;
        let mut idle = Vec::new();
        for c in 0..8 {
            let (cli, s) = linked_client(&net, &srv, c).await;
            // Each slot gets its room: 8 calls at once.
            let reqs: Vec<Vec<u8>> = (0..8).map(|i| request(10 + c, i, 30_000)).collect();
            let resps = futures::future::join_all(reqs.iter().map(|r| cli.call(s, ECHO, r))).await;
            for (req, resp) in reqs.iter().zip(resps) {
                assert!(resp.unwrap()[..] == answer(req)[..]);
            }
            let m = srv.memory();
            assert!(m.granted_bytes <= budget / 2, "client {c}: {m:?}");
            idle.push((cli, s));
        }
        assert!(srv.memory().granted_bytes > 0);
        // A newcomer: its requests as large as the budget allows are
        // served (by READ: the room for grants is taken), none is busy.
        let (cli, s) = linked_client(&net, &srv, 99).await;
        for i in 0..4 {
            let req = request(30, i, 60_000);
            assert!(cli.call(s, ECHO, &req).await.unwrap()[..] == answer(&req)[..]);
        }
        assert_eq!(cli.stats().busy_pauses, 0);
        assert!(runs.borrow().values().all(|&n| n == 1));
        assert!(srv.memory().granted_bytes <= budget / 2);
        for (c, s) in &idle {
            c.disconnect(*s);
        }
        cli.disconnect(s);
        wait_for(|| srv.memory().granted_bytes == 0).await;
        wait_for(|| srv.memory().request_bytes == 0).await;
    });
}

/// The room a server granted a raw peer, misused: an immediate claiming
/// more than the room, a request written twice (its number again), an
/// immediate over another peer's link into that room: each dropped and
/// counted malformed, no handler run for it, no more memory held; a
/// request written properly is served once, its room handed to the
/// handler (no longer granted).
#[test]
fn misused_grants_run_nothing() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(43, PACKET);
        let (srv, runs) = server(&net, bulk_config());
        let mut raw = RawPeer::connect(&net, &srv).await;
        raw.open_link(1).await;
        // A read request (slot 0): read, answered, and room granted.
        let first = request(7, 0, 10_000);
        let (_, addr, rkey) = raw.bulk.expose(first.clone()).unwrap();
        let grant = |raw: &mut RawPeer, req_num: u64, desc: BulkDesc, len: usize| {
            let h = Header {
                req_type: ECHO,
                req_num,
                msg_len: len as u32,
                pkt_count: 1,
                ..Header::new(PacketKind::ReadRequest)
            };
            raw.send(h, &desc.encode_offer(0));
        };
        grant(&mut raw, 0, BulkDesc { addr, rkey }, first.len());
        let (h, payload) = raw.expect(PacketKind::Offer).await;
        assert_eq!(
            (h.req_num, h.msg_len as usize),
            (0, first.len() + WRITE_TRAILER)
        );
        let room = BulkDesc::decode(&payload).unwrap();
        let held = srv.memory().granted_bytes;
        assert_eq!(held, first.len() + WRITE_TRAILER);
        let malformed = srv.stats().malformed_packets;

        // An immediate claiming more than the room: dropped, nothing run,
        // the room still the slot's (and no more held).
        let mut bytes = request(7, 1, 100);
        bytes.extend_from_slice(&encode_trailer(8, ECHO, None));
        let imm = encode_imm(8, first.len() + WRITE_TRAILER + 1);
        raw.bulk
            .write_imm(1, bytes, room.addr, room.rkey, imm, 1)
            .unwrap();
        wait_for(|| srv.stats().malformed_packets == malformed + 1).await;
        assert_eq!(srv.memory().granted_bytes, held);
        assert_eq!(srv.stats().bulk_request_writes, 0);

        // A read request in slot 0 again: the same room announced again
        // (the last offer packet may have been lost), then a request
        // written properly: served once, the room handed to its handler
        // (the next room comes with a response WRITE, and this peer
        // offered none).
        grant(&mut raw, 16, BulkDesc { addr, rkey }, first.len());
        let (h, payload) = raw.expect(PacketKind::Offer).await;
        assert_eq!(h.req_num, 16);
        assert_eq!(BulkDesc::decode(&payload).unwrap(), room);
        let second = request(7, 2, 5_000);
        let mut bytes = second.clone();
        bytes.extend_from_slice(&encode_trailer(24, ECHO, None));
        let imm = encode_imm(24, bytes.len());
        raw.bulk
            .write_imm(1, bytes.clone(), room.addr, room.rkey, imm, 2)
            .unwrap();
        wait_for(|| srv.stats().bulk_request_writes == 1).await;
        wait_for(|| runs.borrow().get(&second) == Some(&1)).await;
        // The slot's next room: the buffer its last response was exposed
        // in (the response and the trailer), one room per slot still.
        let held = srv.memory().granted_bytes;
        assert_eq!(held, first.len() + 4 + WRITE_TRAILER);
        // A read request in slot 0 once more: that room announced.
        grant(&mut raw, 32, BulkDesc { addr, rkey }, first.len());
        let (h, payload) = raw.expect(PacketKind::Offer).await;
        assert_eq!(h.req_num, 32);
        let next_room = BulkDesc::decode(&payload).unwrap();
        assert_ne!(next_room, room);
        assert_eq!(srv.memory().granted_bytes, held);

        // A stranger with a session and link of its own, writing into
        // the room granted to the other peer, its immediate for slot 0 of
        // its own session (which was granted nothing): dropped, nothing
        // run, the other peer's room still held.
        let mut stranger = RawPeer::connect(&net, &srv).await;
        stranger.open_link(5).await;
        let (malformed, held) = (srv.stats().malformed_packets, srv.memory().granted_bytes);
        assert!(held > 0);
        let mut forged = request(8, 0, 100);
        forged.extend_from_slice(&encode_trailer(40, ECHO, None));
        let forged_imm = encode_imm(40, forged.len());
        stranger
            .bulk
            .write_imm(5, forged, next_room.addr, next_room.rkey, forged_imm, 4)
            .unwrap();
        wait_for(|| srv.stats().malformed_packets == malformed + 1).await;
        assert_eq!(srv.stats().bulk_request_writes, 1);
        assert!(runs.borrow().get(&request(8, 0, 100)).is_none());
        assert!(runs.borrow().get(&request(7, 1, 100)).is_none());
        assert_eq!(srv.memory().granted_bytes, held);
        // The request number 24 written again into the next room: not
        // new, dropped; its handler does not run twice.
        let malformed = srv.stats().malformed_packets;
        raw.bulk
            .write_imm(1, bytes, next_room.addr, next_room.rkey, imm, 3)
            .unwrap();
        wait_for(|| srv.stats().malformed_packets == malformed + 1).await;
        assert_eq!(runs.borrow().get(&second), Some(&1));
        assert_eq!(srv.stats().bulk_request_writes, 1);

        assert_eq!(srv.memory().granted_bytes, held);
    });
}

/// Large calls by READ and written requests (30 KB to 205 KB: those past
/// 128 KiB by READ, so that datagrams go to be lost), 18 tasks on 3
/// sessions, over a network that loses, duplicates and reorders
/// datagrams (read requests, offers, credit returns): every call
/// answered, each handler run once, none timed out (`lossy`'s checks). A response
/// written by WRITE pumps its session for calls that waited for credits
/// (without, two calls waited for credits forever here).
#[test]
fn large_calls_over_a_lossy_network() {
    lossy(5, 6, config(), |i| 30_000 + i * 35_000);
}

/// The room a written request offers for its response is the slot's last
/// request buffer, which the server could READ over all its length: it
/// is exposed again as it is, with no pass zeroing it per call (before,
/// a buffer of the pool, zeroed whole: the request's length per call).
/// Only room past what the buffer holds is zeroed (a longer response).
#[test]
fn the_response_room_of_a_written_request_is_not_zeroed_per_call() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(47, PACKET);
        let (srv, runs) = server(&net, bulk_config());
        let (cli, s) = linked_client(&net, &srv, 0).await;
        const LEN: usize = 50_000;
        // The first large call of the size is read (its grant follows),
        // the second written with a room from the pool.
        for i in 0..2 {
            let req = request(4, i, LEN);
            assert!(cli.call(s, ECHO, &req).await.unwrap()[..] == answer(&req)[..]);
        }
        let zeroed = net.zeroed_bytes();
        let written = cli.stats().bulk_request_writes;
        for i in 2..12 {
            let req = request(4, i, LEN);
            assert!(cli.call(s, ECHO, &req).await.unwrap()[..] == answer(&req)[..]);
        }
        assert_eq!(cli.stats().bulk_request_writes - written, 10);
        // The test's handler answers 4 bytes more than it got: those and
        // the response WRITE's trailer are the room past the client's
        // spare; the server's room for the next request is its last
        // response's buffer, past which only the request's trailer is
        // zeroed. No other byte is zeroed.
        assert_eq!(
            net.zeroed_bytes() - zeroed,
            10 * (4 + RESP_TRAILER + WRITE_TRAILER) as u64,
            "bytes zeroed in 10 written calls"
        );
        // A shorter request, its response room the spare as it is; then
        // one as long as before again.
        for (i, len) in [(12, LEN / 2), (13, LEN)] {
            let req = request(4, i, len);
            assert!(cli.call(s, ECHO, &req).await.unwrap()[..] == answer(&req)[..]);
        }
        assert!(runs.borrow().values().all(|&n| n == 1));
        assert_eq!(srv.stats().malformed_packets, 0);
        assert_eq!(cli.stats().malformed_packets, 0);
        cli.disconnect(s);
        wait_for(|| srv.memory().granted_bytes == 0).await;
    });
}

/// A written request is not copied out of its room: the room itself is
/// the handler's request (only its trailer is read before it is handed
/// over), and the room for the slot's next request is announced in the
/// response WRITE's trailer, so every call after the first written one
/// is written too, with no offer packet. (Before: each request copied
/// out of the room, `len` bytes per call.)
#[test]
fn written_requests_are_handed_to_the_handler_without_a_copy() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(48, PACKET);
        let (srv, runs) = server(&net, bulk_config());
        let (cli, s) = linked_client(&net, &srv, 0).await;
        const LEN: usize = 60_000;
        // Read (its grant follows in an offer packet), then written.
        for i in 0..2 {
            let req = request(5, i, LEN);
            assert!(cli.call(s, ECHO, &req).await.unwrap()[..] == answer(&req)[..]);
        }
        let copied = net.copied_out_bytes();
        let written = srv.stats().bulk_request_writes;
        let reads = srv.stats().bulk_reads;
        for i in 2..12 {
            let req = request(5, i, LEN);
            assert!(cli.call(s, ECHO, &req).await.unwrap()[..] == answer(&req)[..]);
        }
        assert_eq!(srv.stats().bulk_request_writes - written, 10);
        assert_eq!(srv.stats().bulk_reads, reads);
        assert_eq!(
            net.copied_out_bytes() - copied,
            10 * WRITE_TRAILER as u64,
            "bytes copied out of rooms in 10 written calls"
        );
        assert!(runs.borrow().values().all(|&n| n == 1));
        assert_eq!(srv.stats().malformed_packets, 0);
        assert_eq!(cli.stats().malformed_packets, 0);
        // At most one room per slot, charged to the grants.
        let m = srv.memory();
        assert!(
            m.granted_bytes > 0 && m.granted_bytes <= LEN + 4 + WRITE_TRAILER,
            "{m:?}"
        );
        cli.disconnect(s);
        wait_for(|| srv.memory().granted_bytes == 0).await;
    });
}

/// A written request is registered once per call, as the WRITE's source:
/// the client keeps it unexposed once its WRITE completed (the server has
/// it), so a call registers its request and the room offered for its
/// response, no more; the server its response (the WRITE's source) and
/// the room for the slot's next request. And its start pumps no slots
/// (its WRITE took the one credit; nothing else waits to be sent).
#[test]
fn a_written_call_registers_its_request_once() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(49, PACKET);
        let (srv, runs) = server(&net, bulk_config());
        let (cli, s) = linked_client(&net, &srv, 0).await;
        let (c, v) = (
            cli.with_transport(|t| t.id()),
            srv.with_transport(|t| t.id()),
        );
        const LEN: usize = 40_000;
        for i in 0..2 {
            let req = request(6, i, LEN);
            assert!(cli.call(s, ECHO, &req).await.unwrap()[..] == answer(&req)[..]);
        }
        let (cr, sr) = (net.registrations(c), net.registrations(v));
        let written = cli.stats().bulk_request_writes;
        let pumps = cli.work_counts().pumps;
        for i in 2..12 {
            let req = request(6, i, LEN);
            assert!(cli.call(s, ECHO, &req).await.unwrap()[..] == answer(&req)[..]);
        }
        assert_eq!(cli.stats().bulk_request_writes - written, 10);
        assert_eq!(
            (net.registrations(c) - cr, net.registrations(v) - sr),
            (10 * 2, 10 * 2),
            "registrations of the client and the server in 10 written calls"
        );
        // A written call's start sends nothing else: no pump over the
        // session's slots.
        assert_eq!(
            cli.work_counts().pumps - pumps,
            0,
            "pumps in 10 written calls"
        );
        assert_eq!(cli.stats().retransmissions, 0);
        assert!(runs.borrow().values().all(|&n| n == 1));
        // Nothing of the client's stays exposed between calls.
        assert_eq!(net.exposed_by(c), 0);
        cli.disconnect(s);
        wait_for(|| srv.memory().granted_bytes == 0).await;
    });
}

/// A written request whose response is late is resent as a read request:
/// the client exposes the request it kept only then (one registration
/// more for that call), the server, which took the written request,
/// answers the resend as a duplicate (its handler runs once, nothing is
/// read), and the response completes the call; then nothing of the
/// client's stays exposed.
#[test]
fn a_written_request_is_exposed_when_its_resend_is_due() {
    const SLOW: u8 = 9;
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(50, PACKET);
        let (srv, runs) = server(&net, bulk_config());
        let gate = Rc::new(Cell::new(false));
        let held = gate.clone();
        srv.register(SLOW, move |req: Request| {
            let held = held.clone();
            async move {
                while !held.get() {
                    verbio_runtime::sleep(Duration::from_millis(1)).await;
                }
                let mut resp = req.response();
                resp.extend_from_slice(&answer(req.data()));
                resp
            }
        })
        .unwrap();
        let (cli, s) = linked_client(&net, &srv, 0).await;
        let c = cli.with_transport(|t| t.id());
        // The room granted after the linking call: its length and the
        // trailer.
        let req = request(7, 0, THRESHOLD);
        let (cr, reads) = (net.registrations(c), srv.stats().bulk_reads);
        let resent = cli.stats().retransmissions;
        let call = cli.call(s, SLOW, &req);
        let opened = async {
            wait_for(|| cli.stats().retransmissions > resent).await;
            // The resend is a read request of the request's buffer:
            // exposed now, beside the room offered for the response.
            assert_eq!(net.exposed_by(c), 2);
            gate.set(true);
        };
        let (resp, ()) = futures::join!(call, opened);
        assert!(resp.unwrap()[..] == answer(&req)[..]);
        assert_eq!(cli.stats().bulk_request_writes, 1);
        assert_eq!(srv.stats().bulk_reads, reads, "the resend was not read");
        // The WRITE's source, the response's room, the resend's exposure.
        assert_eq!(net.registrations(c) - cr, 3);
        assert!(runs.borrow().values().all(|&n| n == 1));
        assert_eq!(srv.stats().malformed_packets, 0);
        assert_eq!(cli.stats().malformed_packets, 0);
        // The next call takes the exposed request back.
        let next = request(7, 1, 100);
        assert!(cli.call(s, ECHO, &next).await.unwrap()[..] == answer(&next)[..]);
        assert_eq!(net.exposed_by(c), 0);
    });
}

/// Starting a written call costs no run of the client's dispatcher: the
/// request's WRITE is polled once with the dispatcher's waker where it
/// starts, so the dispatcher runs when the WRITE completes (here: when
/// the network lets the held WRITE through), not before to poll it once.
/// (Before: every written call woke the dispatcher at its start, a task
/// run and a poll of every receive source per call.)
#[test]
fn a_written_call_wakes_the_dispatcher_only_when_its_write_completes() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(51, PACKET);
        let (srv, runs) = server(&net, bulk_config());
        let (cli, s) = linked_client(&net, &srv, 0).await;
        // The grant of the linking call's slot fits this request.
        let req = request(8, 0, THRESHOLD);
        net.hold_writes(true);
        let before = cli.work_counts().dispatches;
        let call = cli.call(s, ECHO, &req);
        let release = async {
            wait_for(|| net.held_writes() == 1).await;
            // Time for any woken task to run (well under the timeout).
            for _ in 0..20 {
                verbio_runtime::yield_now().await;
            }
            assert_eq!(
                cli.work_counts().dispatches - before,
                0,
                "dispatcher runs while the request's WRITE is under way"
            );
            net.hold_writes(false);
        };
        let (resp, ()) = futures::join!(call, release);
        assert!(resp.unwrap()[..] == answer(&req)[..]);
        assert_eq!(cli.stats().bulk_request_writes, 1);
        assert!(cli.work_counts().dispatches - before >= 1);
        assert!(runs.borrow().values().all(|&n| n == 1));
    });
}
