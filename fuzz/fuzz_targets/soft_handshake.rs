//! Fuzzes the soft RDMA device's handshake before a peer engine is proven
//! (private to `verbio_runtime::provider::soft`): it never buffers more than
//! one handshake packet, agrees with itself however the bytes are split, and
//! what it cuts re-encodes to the same bytes (see
//! `verbio_ops::fuzz_checks::soft_handshake`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    verbio_ops::fuzz_checks::soft_handshake::check(data);
});
