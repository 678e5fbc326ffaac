//! Heap allocations per message on the `Rdma` send / receive path in steady
//! state: a 64-byte ping-pong over the soft device (`send`, then
//! `receive_msg`, the zero-copy receive, or a `MessageStream`), counted by a global allocator per
//! thread on the client's thread after a warm-up. The client's runtime
//! thread runs its `send` calls, its agent task (receive completions,
//! reposts, credits) and its reactor; the soft device's engine threads and
//! the echo server's thread are not counted.
//!
//! The count is zero: the receiving task takes the message from its
//! receive buffer itself, queues are `VecDeque`s that keep their capacity,
//! buffers come from the pool's free lists. The test prints the count and
//! holds it to [`MAX_PER_ROUND_TRIP`] (a channel node per message, as the
//! agent's inbox once had, is 1.0).

mod common;

use common::alloc_count::{allocs, Counting};
use common::*;
use futures::StreamExt;
use verbio::{MessageStream, RdmaBuilder};

#[global_allocator]
static GLOBAL: Counting = Counting;

const WARM_UP: usize = 500;
const MEASURED: usize = 2_000;
/// Allocations per round trip (one message sent, one received) on the
/// client's thread: 0 measured, plus room for a queue that grows
/// (amortized, a handful of times) when a loaded machine schedules a
/// larger burst than the warm-up did.
const MAX_PER_ROUND_TRIP: f64 = 0.01;

/// The peer: echoes every ping of the warm-up and the measured rounds,
/// then waits until the client closes.
fn echo_server() -> (std::net::SocketAddr, std::thread::JoinHandle<()>) {
    serve_rdma(RdmaBuilder::new, 1, |mut c| async move {
        let r = c.remove(0);
        for _ in 0..WARM_UP + MEASURED {
            let m = r.receive_msg().await.expect("ping");
            r.send(&m).await.expect("echo");
        }
        let _ = r.receive_msg().await;
    })
}

#[test]
fn allocations_per_message_through_a_message_stream() {
    let (addr, server) = echo_server();
    let (rt, dev) = runtime_and_device();
    let per_rt = block(&rt, async {
        let r = std::rc::Rc::new(dial_rdma(RdmaBuilder::new(), &dev, addr).await);
        let mut msgs = MessageStream::new(r.clone());
        let ping = [7u8; 64];
        let mut start = 0;
        for i in 0..WARM_UP + MEASURED {
            if i == WARM_UP {
                start = allocs();
            }
            r.send(&ping).await.expect("send");
            let m = msgs.next().await.expect("open").expect("echo");
            assert!(m[..] == ping[..]);
        }
        let n = allocs() - start;
        let per_rt = n as f64 / MEASURED as f64;
        println!("MessageStream: {n} allocations in {MEASURED} round trips");
        drop(msgs);
        r.shutdown().await.expect("close");
        per_rt
    });
    server.join().expect("server");
    assert!(
        per_rt <= MAX_PER_ROUND_TRIP,
        "{per_rt:.3} allocations per round trip through a MessageStream, more than {MAX_PER_ROUND_TRIP}"
    );
}

#[test]
fn allocations_per_message_in_steady_state() {
    let (addr, server) = echo_server();
    let (rt, dev) = runtime_and_device();
    let per_rt = block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let ping = [7u8; 64];
        let round = || async {
            r.send(&ping).await.expect("send");
            let m = r.receive_msg().await.expect("echo");
            assert!(m.is_zero_copy() && m[..] == ping[..]);
        };
        for _ in 0..WARM_UP {
            round().await;
        }
        let before = allocs();
        for _ in 0..MEASURED {
            round().await;
        }
        let n = allocs() - before;
        let per_rt = n as f64 / MEASURED as f64;
        println!(
            "{n} allocations in {MEASURED} round trips: {per_rt:.3} per round trip, \
             {:.3} per message",
            per_rt / 2.0
        );
        r.close().await.expect("close");
        per_rt
    });
    server.join().expect("server");
    assert!(
        per_rt <= MAX_PER_ROUND_TRIP,
        "{per_rt:.3} allocations per round trip, more than the {MAX_PER_ROUND_TRIP} allowed"
    );
}

/// A staged message (longer than a receive buffer: one RDMA WRITE into the
/// peer's staging ring) sent with `send_buf` and received with
/// `receive_msg`, echoed: in steady state no allocation on the client's
/// thread either. The send is posted in its first poll when a credit, the
/// ring's gate and room are at hand (it was a boxed future, one
/// allocation per message), and the copy out of the ring goes into a
/// vector the connection kept from a message dropped before (a fresh one
/// per message cost a page fault per 4 KiB for a good part of a stream's
/// messages).
#[test]
fn staged_messages_allocate_nothing_in_steady_state() {
    const SIZE: usize = 16 * 1024;
    let (addr, server) = echo_server();
    let (rt, dev) = runtime_and_device();
    let per_rt = block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let mut ping = buf_from(r.pool(), &[7u8; SIZE]);
        let mut start = 0;
        for i in 0..WARM_UP + MEASURED {
            if i == WARM_UP {
                assert!(r.staged_max_len() >= SIZE, "the peer's ring is announced");
                start = allocs();
            }
            let (res, back) = r.send_buf(ping).await;
            res.expect("send");
            ping = back;
            let m = r.receive_msg().await.expect("echo");
            assert!(m.len() == SIZE && m[0] == 7);
        }
        let n = allocs() - start;
        println!("staged: {n} allocations in {MEASURED} round trips");
        r.close().await.expect("close");
        n as f64 / MEASURED as f64
    });
    server.join().expect("server");
    assert!(
        per_rt <= MAX_PER_ROUND_TRIP,
        "{per_rt:.3} allocations per round trip of staged messages, more than {MAX_PER_ROUND_TRIP}"
    );
}

/// `receive_buf` of staged messages: one copy from the staging ring into a
/// buffer of the connection's pool, and in steady state no allocation
/// either (it took the message as a vector, one allocation and a copy,
/// then copied that into the pool buffer).
#[test]
fn receive_buf_copies_into_the_pool_without_allocating() {
    const SIZE: usize = 16 * 1024;
    let (addr, server) = echo_server();
    let (rt, dev) = runtime_and_device();
    let per_rt = block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let mut ping = buf_from(r.pool(), &pattern(SIZE, 3));
        let mut start = 0;
        for i in 0..WARM_UP + MEASURED {
            if i == WARM_UP {
                assert!(r.staged_max_len() >= SIZE, "the peer's ring is announced");
                start = allocs();
            }
            let (res, back) = r.send_buf(ping).await;
            res.expect("send");
            ping = back;
            let b = r.receive_buf().await.expect("echo");
            assert!(r.pool().owns(&b), "a buffer of the connection's pool");
            assert!(b[..] == ping[..], "echo {i} intact");
        }
        let n = allocs() - start;
        println!("receive_buf: {n} allocations in {MEASURED} round trips");
        r.close().await.expect("close");
        n as f64 / MEASURED as f64
    });
    server.join().expect("server");
    assert!(
        per_rt <= MAX_PER_ROUND_TRIP,
        "{per_rt:.3} allocations per round trip with receive_buf, more than {MAX_PER_ROUND_TRIP}"
    );
}
