//! Shared receive queues on the soft device: the cases of `srq_cases/`,
//! which `ibverbs_srq.rs` runs on rxe with the same assertions.

mod srq_cases;

use verbio_runtime::provider::{Context, SoftConfig, WcStatus};

fn ctx() -> Context {
    Context::open_soft(SoftConfig::default()).expect("open soft device")
}

#[test]
fn messages_of_many_qps_share_the_srq() {
    srq_cases::messages_of_many_qps_share_the_srq(&ctx(), 0);
}

#[test]
fn post_recv_on_an_srq_qp_is_refused() {
    srq_cases::post_recv_on_an_srq_qp_is_refused(&ctx(), 0);
}

#[test]
fn srq_capacity_and_bad_limit() {
    srq_cases::srq_capacity_and_bad_limit(&ctx(), 0);
}

#[test]
fn limit_event_fires_once_until_rearmed() {
    srq_cases::limit_event_fires_once_until_rearmed(&ctx(), 0);
}

#[test]
fn empty_srq_answers_rnr() {
    srq_cases::empty_srq_answers_rnr(&ctx(), 0);
}

#[test]
fn too_small_srq_wr_fails_only_its_qp() {
    srq_cases::too_small_srq_wr_fails_only_its_qp(&ctx(), 0, WcStatus::LocLenErr);
}
