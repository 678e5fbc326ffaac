//! The handshake listener's TCP backlog (issue 31): a burst of clients
//! larger than std's and mio's backlog of 128 all connect before the
//! application accepts any of them. With a backlog of 128 the kernel
//! queues 129 and drops the SYNs of the others, which then wait for
//! their SYN's retransmission (a second, then three) and, as long as
//! nobody accepts, time out.

use std::net::TcpStream;
use std::time::{Duration, Instant};

use verbio_runtime::{Runtime, TcpListener, LISTEN_BACKLOG};

/// Clients of the burst: well above 128, within a default file limit.
const BURST: usize = 300;

/// Longest a loopback connect may take here (a loaded machine included);
/// a dropped SYN takes a second before its first retransmission.
const CONNECT_LIMIT: Duration = Duration::from_millis(900);

/// `net.core.somaxconn`, the kernel's cap on a backlog.
fn somaxconn() -> Option<usize> {
    std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .ok()?
        .trim()
        .parse()
        .ok()
}

#[test]
fn a_burst_of_clients_is_queued_before_any_is_accepted() {
    assert!(LISTEN_BACKLOG as usize > BURST);
    match somaxconn() {
        Some(cap) if cap > BURST => {}
        other => {
            println!("SKIPPED: net.core.somaxconn {other:?} caps the backlog below {BURST}");
            return;
        }
    }
    let _rt = Runtime::new().unwrap();
    let listener = TcpListener::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = listener.local_addr().unwrap();
    let mut clients = Vec::with_capacity(BURST);
    for i in 0..BURST {
        let t = Instant::now();
        let c = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
            .unwrap_or_else(|e| panic!("client {i} of {BURST}, nothing accepted yet: {e}"));
        let took = t.elapsed();
        assert!(
            took < CONNECT_LIMIT,
            "client {i} of {BURST} took {took:?}: its SYN was dropped (backlog full?)"
        );
        clients.push(c);
    }
}
