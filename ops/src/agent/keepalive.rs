//! The connection's keepalive ([`RdmaBuilder::keepalive`](super::RdmaBuilder::keepalive)):
//! when nothing arrived for an interval, a zero-length RDMA WRITE probes
//! the peer. It consumes none of the peer's receives or credits; RC's
//! retransmission fails it if the peer's port is gone, which fails the QP
//! and so every pending receive. A connection on which messages arrive
//! sends nothing.

use std::rc::Weak;
use std::time::Duration;

use verbio_runtime::sleep;

use super::error::CloseReason;
use super::rdma::Shared;
use crate::verbs::{RemoteBuf, Verbs};

/// Probes the peer of `shared` every `every` in which nothing arrived;
/// returns once the connection is down or dropped.
pub(crate) async fn run(shared: Weak<Shared>, every: Duration) {
    let mut seen = None;
    loop {
        sleep(every).await;
        let Some(s) = shared.upgrade() else { return };
        if s.is_down() {
            return;
        }
        let arrivals = s.arrivals.get();
        if seen.replace(arrivals) != Some(arrivals) {
            continue; // something arrived: the peer is alive
        }
        // A buffer with no initialized bytes: a WRITE of none, to nowhere
        // (a zero-length WRITE checks no rkey).
        let buf = match s.pool.alloc(1) {
            Ok(b) => b,
            Err(e) => {
                tracing::debug!(error = %crate::error::ErrorChain(&e), "keepalive: no buffer");
                continue;
            }
        };
        s.keepalive_probes.set(s.keepalive_probes.get() + 1);
        let probe = s.qp.write(buf, RemoteBuf::new(0, 0, 0));
        drop(s); // not kept alive by the probe
        let (result, _buf) = probe.await;
        if let Err(e) = result {
            let Some(s) = shared.upgrade() else { return };
            if !s.is_down() {
                tracing::debug!(error = %crate::error::ErrorChain(&e), "keepalive probe failed");
                s.fail(CloseReason::Transport(format!(
                    "keepalive probe after {every:?} with nothing received: {}",
                    crate::error::ErrorChain(&e)
                )));
            }
            return;
        }
    }
}
