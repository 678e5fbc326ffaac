//! Fuzzes the soft RDMA device's packet decoder (private to
//! `verbio_runtime::provider::soft`): no panic, and every packet that decodes
//! re-encodes to the same bytes (see `verbio_ops::fuzz_checks::soft_packet`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    verbio_ops::fuzz_checks::soft_packet::check(data);
});
