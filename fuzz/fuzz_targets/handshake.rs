//! Fuzzes the connection handshake decoder (`verbio_ops::connect::handshake`):
//! no panic, the entry points agree, and decoded frames round-trip (see
//! `verbio_ops::fuzz_checks::handshake`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    verbio_ops::fuzz_checks::handshake::check(data);
});
