//! Shared by the crate's tests: a pool whose threads each have a device
//! (a fresh soft device, or the one `VERBIO_TEST_DEVICE` names, e.g.
//! `rxe0` in the rxe VM), and bounded waits.
#![allow(dead_code)]

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use verbio::runtime::Pool;

/// Bound of every wait in these tests.
pub const WAIT: Duration = Duration::from_secs(20);

/// A pool of `threads` runtime threads, each with its own device.
pub fn pool(threads: usize) -> Arc<Pool> {
    let device = std::env::var("VERBIO_TEST_DEVICE")
        .ok()
        .filter(|n| !n.trim().is_empty());
    Arc::new(
        Pool::builder()
            .threads(threads)
            .grace_period(Duration::from_millis(200))
            .device_per_thread(move |_| verbio::provider::open_device(device.as_deref()))
            .build()
            .expect("a pool with a device per thread"),
    )
}

/// A loopback address on an ephemeral port.
pub fn any_addr() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// `fut`, or a panic naming `what` after [`WAIT`].
pub async fn bounded<F: Future>(what: &str, fut: F) -> F::Output {
    match tokio::time::timeout(WAIT, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: not done within {WAIT:?}"),
    }
}
