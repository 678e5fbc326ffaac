//! Fuzzes the handshake's client and server roles
//! (`verbio_ops::connect::{connect_exchange, accept_exchange}`) with arbitrary
//! peer bytes arriving in split reads: no panic or hang, only valid frames
//! written, success only on a well-formed exchange (see
//! `verbio_ops::fuzz_checks::handshake_exchange`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    verbio_ops::fuzz_checks::handshake_exchange::check(data);
});
