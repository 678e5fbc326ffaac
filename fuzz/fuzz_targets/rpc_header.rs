//! Fuzzes the RPC packet header decoder (`verbio_ops::rpc::header`): no
//! panic, the entry points agree, and decoded headers re-encode byte for byte
//! (see `verbio_ops::fuzz_checks::rpc_header`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    verbio_ops::fuzz_checks::rpc_header::check(data);
});
