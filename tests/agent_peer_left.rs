//! `Rdma::close` once the peer has finished and left (soft device, or the
//! device named by `VERBIO_TEST_DEVICE`): the peer sends a window of small
//! messages and drops its connection as soon as its last `send` returned;
//! this side reads them all (returning credits to the peer INLINE as it
//! reposts their buffers) and then closes. Its credit returns are best
//! effort: one the departing peer never acknowledged is flushed, and that
//! must not make `close` fail with the flush of an inline send, as if a
//! message of the application's had been lost. `close` reports the
//! peer's departure (`Disconnected`) or succeeds, depending on which it
//! saw first.

mod common;

use common::*;
use verbio::ops::agent::{AgentError, CloseReason};
use verbio::RdmaBuilder;

/// Messages per round: many credit batches (the default batch is 16).
const MESSAGES: usize = 600;
/// Rounds: the flush is a race with the peer's departure.
const ROUNDS: usize = 30;

#[test]
fn close_after_the_peer_left_is_not_failed_by_a_flushed_credit_return() {
    let mut outcomes = Vec::new();
    for round in 0..ROUNDS {
        let (addr, server) = serve_rdma(RdmaBuilder::new, 1, move |mut c| async move {
            let r = c.remove(0);
            let msg = pattern(64, round as u8);
            for i in 0..MESSAGES {
                r.send(&msg)
                    .await
                    .unwrap_or_else(|e| panic!("round {round}: send {i}: {e}"));
            }
            // Dropped at once: its `Close` follows the messages, then its
            // QP goes.
            drop(r);
        });
        let (rt, dev) = runtime_and_device();
        let outcome = block(&rt, async {
            let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
            let want = pattern(64, round as u8);
            for i in 0..MESSAGES {
                let got = r
                    .receive()
                    .await
                    .unwrap_or_else(|e| panic!("round {round}: message {i}: {e}"));
                assert_eq!(got, want, "round {round}: message {i}");
            }
            r.close().await
        });
        server.join().expect("peer thread");
        match outcome {
            Ok(()) => outcomes.push("ok"),
            Err(AgentError::Closed(CloseReason::Disconnected)) => outcomes.push("disconnected"),
            Err(e) => panic!(
                "round {round}: close after the peer left failed with {}",
                verbio::ops::ErrorChain(&e)
            ),
        }
    }
    eprintln!("close outcomes: {outcomes:?}");
}
