//! The round-trip estimator.

use super::rtt::{RttEstimator, MAX_RTO_FACTOR};

#[test]
fn unsampled_waits_the_floor() {
    assert_eq!(RttEstimator::default().rto(3), 3);
}

#[test]
fn fast_round_trips_keep_the_floor() {
    let mut e = RttEstimator::default();
    for _ in 0..20 {
        e.sample(0);
    }
    assert_eq!(e.rto(3), 3);
}

#[test]
fn steady_slow_round_trips_raise_the_timeout_above_them() {
    let mut e = RttEstimator::default();
    e.sample(5);
    // First sample: srtt 5, rttvar 2.5: 15 ticks, capped at 4 * 3.
    assert_eq!(e.rto(3), 12);
    for _ in 0..50 {
        e.sample(5);
    }
    // The deviation decays: the timeout nears the round trip, above it.
    let rto = e.rto(3);
    assert!((6..=7).contains(&rto), "{rto}");
}

#[test]
fn jitter_widens_the_timeout() {
    let mut steady = RttEstimator::default();
    let mut jittery = RttEstimator::default();
    for i in 0..40 {
        steady.sample(4);
        jittery.sample(if i % 2 == 0 { 2 } else { 6 });
    }
    assert!(jittery.rto(3) > steady.rto(3) + 2, "{jittery:?} {steady:?}");
}

#[test]
fn the_timeout_is_capped() {
    let mut e = RttEstimator::default();
    for _ in 0..10 {
        e.sample(1000);
    }
    assert_eq!(e.rto(3), 3 * MAX_RTO_FACTOR);
    e.sample(u64::MAX);
    assert_eq!(e.rto(3), 3 * MAX_RTO_FACTOR);
}

/// A server whose handler answers a bit later than the client's `rto`
/// (under its retry bound): once the client learned the round trip it
/// waits for the answers instead of resending to the server every call.
#[test]
fn a_slow_but_sure_server_gets_few_resends_once_learned() {
    use std::time::Duration;

    use verbio_runtime::Runtime;

    use super::mem::MemNetwork;
    use super::tests::{config, request};
    use super::{Request, Rpc};

    const SLOW: u8 = 2;
    const CALLS: usize = 20;
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let net = MemNetwork::new(11, 4096);
        // rto 5 ms: a handler of 8 ms is resent to at least once per call
        // at a fixed timeout.
        let srv = Rpc::new(net.endpoint(), config());
        srv.register(SLOW, |req: Request| async move {
            verbio_runtime::sleep(Duration::from_millis(8)).await;
            let mut resp = req.response();
            resp.extend_from_slice(req.data());
            resp
        })
        .unwrap();
        let cli = Rpc::new(net.endpoint(), config());
        let s = cli.connect(&srv.local_addr()).await.unwrap();
        for i in 0..CALLS {
            let req = request(0, i, 16);
            assert_eq!(&cli.call(s, SLOW, &req).await.unwrap()[..], &req[..]);
        }
        let c = cli.stats();
        // The first calls may be resent to while the round trip is learned.
        assert!(c.retransmissions <= 6, "{c:?}");
        assert_eq!(c.timeouts, 0);
    });
}

/// The resends a transfer under way adds to a call's bound: none for no
/// bytes, one per `rto`'s worth of bytes at the floor rate, rounded up.
#[test]
fn a_transfer_extends_the_bound_by_its_bytes_at_the_floor_rate() {
    use super::engine::resend::{extra_retries, TRANSFER_FLOOR_RATE};
    use std::time::Duration;
    let rto = Duration::from_millis(20);
    let per_rto = (TRANSFER_FLOOR_RATE / 50) as usize;
    assert_eq!(extra_retries(0, rto), 0);
    assert_eq!(extra_retries(1, rto), 1);
    assert_eq!(extra_retries(per_rto, rto), 1);
    assert_eq!(extra_retries(per_rto + 1, rto), 2);
    assert_eq!(extra_retries(16 << 20, rto), 13);
    // A tiny timeout still grants a finite number.
    assert_eq!(extra_retries(16 << 20, Duration::ZERO), 16 << 20);
}
