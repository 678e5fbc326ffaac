//! Shared receive queues on an ibverbs device (rxe in the VM:
//! `scripts/rxe-test.sh --no-interop --no-devinfo ibverbs_srq`): the cases
//! of `srq_cases/`, which `soft_srq.rs` runs on the soft device with the
//! same assertions. Prints SKIPPED without a device.
#![cfg(feature = "ibverbs")]

mod ibverbs_support;
mod srq_cases;

use ibverbs_support::{device, gid_index};
use verbio_runtime::provider::WcStatus;

fn run(test: &str, case: fn(&verbio_runtime::provider::Context, u8)) {
    let Some(ctx) = device(test) else { return };
    let gid = gid_index(&ctx);
    case(&ctx, gid);
}

#[test]
fn messages_of_many_qps_share_the_srq() {
    run(
        "messages_of_many_qps_share_the_srq",
        srq_cases::messages_of_many_qps_share_the_srq,
    );
}

#[test]
fn post_recv_on_an_srq_qp_is_refused() {
    run(
        "post_recv_on_an_srq_qp_is_refused",
        srq_cases::post_recv_on_an_srq_qp_is_refused,
    );
}

#[test]
fn srq_capacity_and_bad_limit() {
    run(
        "srq_capacity_and_bad_limit",
        srq_cases::srq_capacity_and_bad_limit,
    );
}

#[test]
fn limit_event_fires_once_until_rearmed() {
    run(
        "limit_event_fires_once_until_rearmed",
        srq_cases::limit_event_fires_once_until_rearmed,
    );
}

#[test]
fn empty_srq_answers_rnr() {
    run("empty_srq_answers_rnr", srq_cases::empty_srq_answers_rnr);
}

#[test]
fn too_small_srq_wr_fails_only_its_qp() {
    run("too_small_srq_wr_fails_only_its_qp", |ctx, gid| {
        srq_cases::too_small_srq_wr_fails_only_its_qp(ctx, gid, WcStatus::LocQpOpErr)
    });
}
