//! The runtime's counters: ops, doorbells and post lists, parks.

use std::time::Duration;

use futures::FutureExt;

use crate::op::{Completable, SubmitError};
use crate::provider::{Completion, QpCaps, SendOp, WcStatus};
use crate::reactor::{sleep, Runtime};
use crate::testing::{settle, FakeQp};

struct Bare;

impl Completable for Bare {
    type Output = Result<Completion, String>;
    fn complete(self, c: Completion) -> Self::Output {
        Ok(c)
    }
    fn fail(self, e: SubmitError) -> Self::Output {
        Err(e.to_string())
    }
}

fn write() -> SendOp {
    SendOp::Write {
        remote_addr: 0,
        rkey: 0,
    }
}

#[test]
fn ops_doorbells_and_post_lists_are_counted() {
    let rt = Runtime::new().unwrap();
    let caps = QpCaps {
        max_send_wr: 8,
        ..QpCaps::default()
    };
    let (qp, fake) = FakeQp::queue_pair(3, caps, 64);
    let before = rt.stats();
    // Three single WRs submitted in one poll phase: one post list.
    let mut ops = rt.block_on(async {
        (0..3)
            .map(|_| qp.send_without_memory(Bare, write()))
            .collect::<Vec<_>>()
    });
    let s = rt.stats();
    assert_eq!(s.ops_submitted - before.ops_submitted, 3);
    assert_eq!(
        s.doorbells - before.doorbells,
        1,
        "one doorbell for the phase"
    );
    assert_eq!(s.wrs_posted - before.wrs_posted, 3);
    assert_eq!(fake.doorbells(), 1);
    fake.complete_send(WcStatus::Success, 0).unwrap();
    fake.complete_send(WcStatus::Success, 0).unwrap();
    fake.complete_send(WcStatus::RemAccessErr, 0).unwrap();
    settle(&rt);
    let results: Vec<_> = ops
        .iter_mut()
        .map(|op| op.now_or_never().expect("completed"))
        .collect();
    assert_eq!(results.iter().filter(|r| r.is_ok()).count(), 3);
    let s = rt.stats();
    assert_eq!(s.completions - before.completions, 3);
    assert_eq!(s.ops_failed - before.ops_failed, 1, "the error completion");
    assert_eq!(s.ops_in_slab, 0);
}

#[test]
fn a_sleep_is_a_park() {
    let rt = Runtime::new().unwrap();
    let before = rt.stats().parks;
    rt.block_on(sleep(Duration::from_millis(2)));
    assert!(rt.stats().parks > before, "the reactor slept in epoll");
}
