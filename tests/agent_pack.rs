//! Packs of the high-level `Rdma` connection (soft device, two runtimes on
//! two threads): whole messages that wait for a send credit together go in
//! one SEND, arrive in the order they were sent with their immediates, and
//! a send dropped while its pack fills is not delivered.

mod common;

use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use common::*;
use verbio::runtime::sleep;
use verbio::{AgentError, Rdma, RdmaBuilder};

/// The `i`th message: its bytes (0 to 299 of them) and its immediate.
fn message(i: usize) -> Msg {
    let bytes = pattern(i * 37 % 300, i as u8);
    let imm = (i % 3 == 0).then_some(i as u32 ^ 0x5a5a_0000);
    (bytes, imm)
}

/// A message and its immediate.
type Msg = (Vec<u8>, Option<u32>);

/// A server that receives user messages (with their immediates) until an
/// empty one with the immediate `u32::MAX`.
fn collector(
    builder: fn() -> RdmaBuilder,
) -> (std::net::SocketAddr, std::thread::JoinHandle<Vec<Msg>>) {
    serve_rdma(builder, 1, |mut c| async move {
        let r = c.remove(0);
        let mut got = Vec::new();
        loop {
            let m = r.receive_with_imm().await.expect("server receive");
            if m.1 == Some(u32::MAX) {
                break;
            }
            got.push(m);
        }
        got
    })
}

/// Waits (bounded) until all of the peer's `want` credits are at hand.
async fn credits_at_hand(r: &Rdma, want: u32) {
    for _ in 0..2_000 {
        if r.send_credits() == want {
            return;
        }
        sleep(Duration::from_millis(1)).await;
    }
    panic!("{} credits, expected {want}", r.send_credits());
}

type SendFut<'a> = Pin<Box<dyn Future<Output = Result<(), AgentError>> + 'a>>;

fn send<'a>(r: &'a Rdma, m: &'a Msg) -> SendFut<'a> {
    match m.1 {
        Some(imm) => Box::pin(r.send_with_imm(&m.0, imm)),
        None => Box::pin(r.send(&m.0)),
    }
}

#[test]
fn messages_that_wait_for_credits_share_sends_and_keep_their_order() {
    const N: usize = 600;
    // Few credits, returned one at a time: most sends wait for one.
    let (addr, server) = collector(|| RdmaBuilder::new().recv_buf_count(4).credit_batch(1));
    let (rt, dev) = runtime_and_device();
    let msgs: Vec<_> = (0..N).map(message).collect();
    let packs = block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        // All at once: the first four take the credits, the rest wait in
        // packs (polled in order, so they join them in order).
        let sends: Vec<_> = msgs.iter().map(|m| send(&r, m)).collect();
        for res in futures::future::join_all(sends).await {
            res.expect("send");
        }
        let packs = r.packs_sent();
        // The server stops at this one (and its side may be gone before
        // the SEND's ACK reaches this side: the close's result is not
        // this test's).
        r.send_with_imm(b"", u32::MAX).await.expect("end");
        let _ = r.close().await;
        packs
    });
    let got = server.join().expect("server");
    assert_eq!(got.len(), N);
    for (i, (g, m)) in got.iter().zip(&msgs).enumerate() {
        assert_eq!(g, m, "message {i}");
    }
    // Up to 14 messages of at most 300 bytes fit one 4 KiB receive buffer.
    assert!(
        packs > 0 && (packs as usize) < N / 2,
        "{packs} packs for {N} messages"
    );
}

#[test]
fn a_send_dropped_while_its_pack_fills_is_not_delivered() {
    let (addr, server) = collector(|| RdmaBuilder::new().recv_buf_count(2).credit_batch(1));
    let (rt, dev) = runtime_and_device();
    let msgs: Vec<_> = (0..6).map(|i| (pattern(50 + i, i as u8), None)).collect();
    let sent = block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        credits_at_hand(&r, 2).await;
        // The two credits: the first message goes at once (INLINE), the
        // second (half the window spent: a backlog) in a pack of its own,
        // as the usual whole frame.
        r.send(&msgs[0].0).await.expect("first");
        r.send(&msgs[1].0).await.expect("second");
        assert_eq!(r.send_credits(), 0);
        let packs = r.packs_sent();
        // Four more, each polled once without yielding (no credit can
        // come back meanwhile): all in one pack. The third is dropped
        // before the pack is posted; the others go.
        let mut futs: Vec<Option<SendFut<'_>>> =
            msgs[2..].iter().map(|m| Some(send(&r, m))).collect();
        poll_fn(|cx| {
            for f in futs.iter_mut().flatten() {
                assert!(f.as_mut().poll(cx).is_pending(), "no credit: it waits");
            }
            Poll::Ready(())
        })
        .await;
        drop(futs[1].take());
        for f in futs.into_iter().flatten() {
            f.await.expect("packed send");
        }
        assert_eq!(r.packs_sent(), packs + 1, "the three left went in one pack");
        // Every credit comes back: the dropped message took none.
        credits_at_hand(&r, 2).await;
        r.send_with_imm(b"", u32::MAX).await.expect("end");
        let _ = r.close().await;
        vec![&msgs[0], &msgs[1], &msgs[2], &msgs[4], &msgs[5]]
            .into_iter()
            .cloned()
            .collect::<Vec<_>>()
    });
    assert_eq!(server.join().expect("server"), sent);
}
