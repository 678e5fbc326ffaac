//! Connections on a listener's shared receive queue share the device's
//! protection domain, yet none reaches the memory another exposes to its
//! peer (issue 31): a server connection's grant, staging ring and a large
//! message it offers for READ are each attacked from other connections
//! on the same SRQ, with the rkey its peer was given (stolen) and with the
//! rkey of the registration beneath it (the key a guess could hit), by
//! READ and by WRITE: every attempt fails with a remote access error,
//! while the rightful peer reaches all three and finds them untouched.
//! Also: a listener's first connections get receive queues of their own
//! and the ones beyond its threshold go on its SRQ.
//!
//! Runs on the soft device, or on the device `VERBIO_TEST_DEVICE` names
//! (rxe in `scripts/rxe-test.sh`).

mod common;

use std::rc::Rc;
use std::sync::mpsc;
use std::time::Duration;

use common::*;
use verbio::ops::agent::wire::MrToken;
use verbio::provider::{AccessFlags, WcStatus};
use verbio::runtime::{sleep, spawn};
use verbio::{AgentError, Rdma, RdmaBuilder};

/// The server's staging ring: a 16 KiB message is carried by it.
const RING: usize = 256 << 10;
/// Sent by READ: more than a quarter of the client's ring (it has none).
const LARGE: usize = 100 << 10;

fn status(e: &AgentError) -> Option<WcStatus> {
    match e {
        AgentError::Verb(v) => v.status(),
        _ => None,
    }
}

/// What the server's connection to the first client exposes, as the test
/// hook lists it: (what, token as the peer sees it, registration's rkey).
type Keys = Vec<(&'static str, MrToken, u32)>;

/// Waits (bounded) until `r` exposes a grant, its staging ring and the
/// offer of the second large message (`READ` offer ids count from 1 on a
/// connection; the first is released once the client read it).
async fn all_exposed(r: &Rdma) -> Keys {
    for _ in 0..2000 {
        let keys = r.exposed_memory_unchecked();
        let has = |what: &str| keys.iter().filter(|(w, _, _)| *w == what).count();
        let second_offer = keys
            .iter()
            .any(|(w, t, _)| *w == "read offer" && t.token_id & 0xffff == 2);
        if has("grant") == 1 && has("staging ring") == 1 && has("read offer") == 1 && second_offer {
            return keys;
        }
        sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "the server never exposed all three: {:?}",
        r.exposed_memory_unchecked()
    );
}

#[test]
fn a_connection_on_the_srq_cannot_reach_another_ones_memory() {
    let (addr_tx, addr_rx) = mpsc::channel();
    let (keys_tx, keys_rx) = mpsc::channel::<Keys>();
    let server = std::thread::spawn(move || {
        let (rt, dev) = runtime_and_device();
        block(&rt, async move {
            let l = RdmaBuilder::new()
                .shared_receive_queue(32)
                .staging_ring(RING)
                .device(dev)
                .listen("127.0.0.1:0".parse().unwrap())
                .expect("listen");
            addr_tx.send(l.local_addr().unwrap()).unwrap();
            let owner = Rc::new(l.accept().await.expect("accept the owner's peer"));
            assert!(owner.on_shared_receive_queue());
            // Every later connection is an attacker: held open, on the SRQ.
            let _attackers = spawn(async move {
                let mut held = Vec::new();
                while let Ok(c) = l.accept().await {
                    assert!(c.on_shared_receive_queue(), "attacker not on the SRQ");
                    held.push(c);
                }
            });
            // The client asked for a grant and sent a 16 KiB message: the
            // grant is live and the ring announced.
            let m = owner.receive().await.expect("the 16 KiB message");
            assert_eq!(m, pattern(16 << 10, 9));
            // Two large messages by READ: the client reads the first; the
            // second waits (its backlog is over its limit), offered.
            let o = owner.clone();
            let sends = spawn(async move {
                o.send(&pattern(LARGE, 1)).await.expect("first large");
                o.send(&pattern(LARGE, 2)).await.expect("second large");
            });
            let keys = all_exposed(&owner).await;
            for (what, token, raw) in &keys {
                assert_ne!(token.rkey, *raw, "{what}: not behind a window");
            }
            keys_tx.send(keys).unwrap();
            sends.await;
            let bye = owner.receive().await.expect("bye");
            assert_eq!(bye, b"bye");
        })
    });
    let addr = addr_rx.recv_timeout(WAIT).expect("server start");
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let a = dial_rdma(
            RdmaBuilder::new()
                .staging_ring(0)
                .max_unread_bytes(64 << 10),
            &dev,
            addr,
        )
        .await;
        let grant = a.request_remote_mr(4096).await.expect("grant");
        a.send(&pattern(16 << 10, 9)).await.expect("16 KiB");
        // The server's keys, once it exposes all three (this runtime keeps
        // running: the client's agent reads the first large message).
        let keys = loop {
            if let Ok(k) = keys_rx.try_recv() {
                break k;
            }
            sleep(Duration::from_millis(10)).await;
        };
        let token_of = |what: &str| {
            keys.iter()
                .find(|(w, _, _)| *w == what)
                .map(|(_, t, raw)| (*t, *raw))
                .unwrap_or_else(|| panic!("no {what}"))
        };
        // The rightful peer reaches all three.
        let mut mine = a.alloc_local_mr(64).unwrap();
        mine.copy_from_slice(&pattern(64, 5));
        let (res, _) = a.write(mine, &grant).await;
        res.expect("the owner's peer writes its grant");
        let (ring, _) = token_of("staging ring");
        let ring_mr = a.remote_mr_from_token_unchecked(ring);
        let mut zeros = a.alloc_local_mr(64).unwrap();
        zeros.fill(0);
        let (res, _) = a.write(zeros, &ring_mr).await;
        res.expect("the owner's peer writes the staging ring");
        let (offer, _) = token_of("read offer");
        let offer_mr = a.remote_mr_from_token_unchecked(offer);
        let (res, got) = a.read(a.alloc_local_mr(LARGE).unwrap(), &offer_mr).await;
        res.expect("the owner's peer reads the offer");
        assert_eq!(&got[..], &pattern(LARGE, 2)[..]);

        // Each attack on a connection of its own (a remote access error
        // ends the attacker's QP): the stolen key and the registration's,
        // by READ and by WRITE.
        let everything =
            AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC;
        let mut attacks = 0;
        for (what, token, raw) in &keys {
            for (key_kind, rkey) in [("stolen", token.rkey), ("registration's", *raw)] {
                for write in [false, true] {
                    let atk = a.new_connection().await.expect("attacker's connection");
                    let forged = MrToken {
                        rkey,
                        len: 64,
                        access: everything.bits(),
                        ..*token
                    };
                    let mr = atk.remote_mr_from_token_unchecked(forged);
                    let mut buf = atk.alloc_local_mr(64).unwrap();
                    buf.fill(0xEE);
                    let res = if write {
                        atk.write(buf, &mr).await.0
                    } else {
                        atk.read(buf, &mr).await.0
                    };
                    let op = if write { "WRITE" } else { "READ" };
                    let e = res.expect_err(&format!("{op} of the {what} with the {key_kind} key"));
                    assert_eq!(
                        status(&e),
                        Some(WcStatus::RemAccessErr),
                        "{op} of the {what} with the {key_kind} key: {e}"
                    );
                    attacks += 1;
                }
            }
        }
        assert_eq!(attacks, 12);

        // Untouched, and the owner's connection unharmed.
        let (res, back) = a.read(a.alloc_local_mr(4096).unwrap(), &grant).await;
        res.expect("read the grant back");
        assert_eq!(&back[..64], &pattern(64, 5)[..], "what its peer wrote");
        assert!(back[64..].iter().all(|&x| x == 0), "and nothing else");
        let (res, got) = a.read(a.alloc_local_mr(LARGE).unwrap(), &offer_mr).await;
        res.expect("read the offer again");
        assert_eq!(&got[..], &pattern(LARGE, 2)[..]);
        assert_eq!(a.receive().await.expect("first large"), pattern(LARGE, 1));
        assert_eq!(a.receive().await.expect("second large"), pattern(LARGE, 2));
        a.send(b"bye").await.expect("bye");
    });
    server.join().expect("server");
}

#[test]
fn connections_beyond_the_threshold_go_on_the_srq() {
    let (addr_tx, addr_rx) = mpsc::channel();
    let (flags_tx, flags_rx) = mpsc::channel();
    let server = std::thread::spawn(move || {
        let (rt, dev) = runtime_and_device();
        block(&rt, async move {
            let l = RdmaBuilder::new()
                .shared_receive_queue_above(2, 16)
                .device(dev)
                .listen("127.0.0.1:0".parse().unwrap())
                .expect("listen");
            addr_tx.send(l.local_addr().unwrap()).unwrap();
            let mut conns = Vec::new();
            for _ in 0..3 {
                let c = l.accept().await.expect("accept");
                flags_tx.send(c.on_shared_receive_queue()).unwrap();
                conns.push(c);
            }
            assert_eq!(l.own_queue_connections(), 2);
            // The first one closes: the next connection gets its own queue.
            let first = conns.remove(0);
            assert_eq!(first.receive().await.expect("first's bye"), b"bye");
            drop(first);
            for _ in 0..2000 {
                if l.own_queue_connections() == 1 {
                    break;
                }
                sleep(Duration::from_millis(5)).await;
            }
            assert_eq!(l.own_queue_connections(), 1, "the closed one's seat");
            let c = l.accept().await.expect("accept the fourth");
            flags_tx.send(c.on_shared_receive_queue()).unwrap();
            // Every one still echoes.
            conns.push(c);
            for c in &conns {
                let m = c.receive().await.expect("message");
                c.send(&m).await.expect("echo");
            }
        })
    });
    let addr = addr_rx.recv_timeout(WAIT).expect("server start");
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let mut clients = Vec::new();
        for _ in 0..3 {
            clients.push(dial_rdma(RdmaBuilder::new(), &dev, addr).await);
        }
        let first = clients.remove(0);
        first.send(b"bye").await.expect("bye");
        clients.push(dial_rdma(RdmaBuilder::new(), &dev, addr).await);
        for (i, c) in clients.iter().enumerate() {
            let m = pattern(3000 + i, i as u8);
            c.send(&m).await.expect("send");
            assert_eq!(c.receive().await.expect("echo"), m);
        }
        drop(first);
    });
    let flags: Vec<bool> = flags_rx.try_iter().collect();
    assert_eq!(
        flags,
        [false, false, true, false],
        "own, own, over the threshold: SRQ; a seat freed: own"
    );
    server.join().expect("server");
}
