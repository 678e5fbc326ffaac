//! The UD transport's RC links (`ud_bulk.rs`) on the soft device: the
//! registered buffers of finished SENDs kept for the next ones.

use std::task::Poll;
use std::time::Duration;

use verbio_runtime::provider::{Context as DevContext, SoftConfig};
use verbio_runtime::{timeout, Device, Runtime};

use super::header::HEADER_LEN;
use super::session::SESSION_SLOTS;
use super::transport::{Bulk, LinkPacket};
use super::ud_bulk::{spare_sends, UdBulk};

/// Links of the window (a session each, as `verbio-perf send_bw --api
/// rpc -t 128` opens).
const LINKS: u64 = 16;

/// Sends a session's worth of packets on every link of `tx` and polls
/// both sides until every SEND finished and `rx` received them all
/// (bounded: a count, not a timing). Returns the packets received.
fn send_window(rt: &Runtime, tx: &mut UdBulk, rx: &mut UdBulk, payload: &[u8]) -> usize {
    let head = [0u8; HEADER_LEN];
    for link in 0..LINKS {
        for _ in 0..SESSION_SLOTS {
            tx.send_packet(link, &head, payload).unwrap();
        }
    }
    let want = LINKS as usize * SESSION_SLOTS;
    let mut got = 0;
    let done = std::future::poll_fn(|cx| {
        let (mut out, mut broken) = (Vec::<(u64, LinkPacket)>::new(), Vec::new());
        tx.poll_received(cx, &mut out, &mut broken);
        assert!(broken.is_empty(), "links broke: {broken:?}");
        rx.poll_received(cx, &mut out, &mut broken);
        assert!(broken.is_empty(), "links broke: {broken:?}");
        got += out.len();
        if got >= want && tx.links_sending() == 0 {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    });
    rt.block_on(async { timeout(Duration::from_secs(20), done).await })
        .expect("the window's SENDs finish and arrive");
    got
}

/// A window of SENDs over 16 links (128, one per call of the window)
/// that finish together: every one's registered buffer is kept, so the
/// next window takes none from the pool. (Kept to one link's send queue,
/// 64 of the 128 went back and the next window took 64 from the pool.)
#[test]
fn a_window_over_many_links_keeps_every_finished_sends_buffer() {
    let rt = Runtime::new().unwrap();
    let dev = Device::open(DevContext::open_soft(SoftConfig::default()).unwrap()).unwrap();
    let (mut tx, mut rx) = (UdBulk::new(&dev), UdBulk::new(&dev));
    for link in 0..LINKS {
        let a = tx.open(link).unwrap();
        let b = rx.open(link).unwrap();
        tx.connect(link, &b).unwrap();
        rx.connect(link, &a).unwrap();
    }
    let window = LINKS as usize * SESSION_SLOTS;
    assert!(spare_sends(LINKS as usize) >= window);
    let payload = vec![5u8; 4096];
    assert_eq!(send_window(&rt, &mut tx, &mut rx, &payload), window);
    assert_eq!(tx.spare_len(), window, "every finished SEND's buffer kept");
    let pooled = tx.send_pool_stats();
    assert_eq!(send_window(&rt, &mut tx, &mut rx, &payload), window);
    assert_eq!(tx.spare_len(), window);
    let after = tx.send_pool_stats();
    assert_eq!(
        (after.blocks_in_use, after.free_blocks),
        (pooled.blocks_in_use, pooled.free_blocks),
        "the second window took no buffer from the pool"
    );
}

/// The buffers kept: at least one link's send queue, the window of every
/// link open beyond that, never more than the shared receive queue holds.
#[test]
fn spare_sends_follow_the_links_within_bounds() {
    assert_eq!(spare_sends(0), 64);
    assert_eq!(spare_sends(1), 64);
    assert_eq!(spare_sends(16), 16 * SESSION_SLOTS);
    assert_eq!(spare_sends(32), 256);
    assert_eq!(spare_sends(usize::MAX), 256);
}
