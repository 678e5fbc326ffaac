//! Fuzzes the RPC engine with sequences of peer packets (server and client
//! endpoints): no panic, and the limits hold after every packet (see
//! `verbio_ops::fuzz_checks::rpc_engine`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    verbio_ops::fuzz_checks::rpc_engine::check(data);
});
