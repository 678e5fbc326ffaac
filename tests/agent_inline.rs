//! `Rdma::send` of a small message is posted INLINE (soft device, or the
//! device named by `VERBIO_TEST_DEVICE`): the connection's QP is created
//! with `max_inline_data` room for a 64-byte message and its `Data` header
//! by default (the verbs layer then posts such a SEND inline), as the
//! builder asks, and the builder refuses a `max_inline_data` above
//! `MAX_INLINE_DATA`. A send still returns at its completion: a message
//! whose `send` returned reaches the peer even if the sender's runtime is
//! dropped right after (`tests/agent_messages.rs`).

mod common;

use common::*;
use verbio::ops::agent::wire::DATA_OVERHEAD;
use verbio::ops::agent::{AgentError, DEFAULT_MAX_INLINE_DATA, MAX_INLINE_DATA};
use verbio::RdmaBuilder;

/// A server that receives `n` messages and returns them.
fn receiver(n: usize) -> (std::net::SocketAddr, std::thread::JoinHandle<Vec<Vec<u8>>>) {
    serve_rdma(RdmaBuilder::new, 1, move |mut c| async move {
        let r = c.remove(0);
        let mut got = Vec::new();
        for _ in 0..n {
            got.push(r.receive().await.expect("message"));
        }
        // Until the client closes.
        let _ = r.receive().await;
        got
    })
}

#[test]
fn the_default_qp_takes_a_64_byte_message_inline() {
    assert!(DEFAULT_MAX_INLINE_DATA as usize >= 64 + DATA_OVERHEAD);
    let small = pattern(64, 3);
    let large = pattern(4000, 4);
    let (addr, server) = receiver(2);
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let inline = r.qp().caps().max_inline_data as usize;
        assert!(
            inline >= 64 + DATA_OVERHEAD,
            "the QP takes {inline} bytes inline, less than a 64-byte message with its header"
        );
        r.send(&small).await.expect("small send");
        r.send(&large).await.expect("large send");
        r.close().await.expect("close");
    });
    assert_eq!(server.join().expect("server"), [small, large]);
}

#[test]
fn max_inline_data_above_the_limit_is_refused() {
    let (rt, _dev) = runtime_and_device();
    block(&rt, async {
        // Refused before any connection is attempted (nothing listens here).
        let err = RdmaBuilder::new()
            .max_inline_data(MAX_INLINE_DATA + 1)
            .connect("127.0.0.1:1".parse().unwrap())
            .await
            .expect_err("refused");
        assert!(
            matches!(
                err,
                AgentError::Config {
                    setting: "max_inline_data",
                    ..
                }
            ),
            "{err:?}"
        );
    });
}
