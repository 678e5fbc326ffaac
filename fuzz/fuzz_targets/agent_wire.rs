//! Fuzzes `verbio_ops::agent::wire::decode`: no panic, and every frame that
//! decodes re-encodes to the same bytes (see `verbio_ops::fuzz_checks::agent_wire`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    verbio_ops::fuzz_checks::agent_wire::check(data);
});
