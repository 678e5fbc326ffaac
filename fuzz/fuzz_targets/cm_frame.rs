//! Fuzzes the software device's connection-manager frame decoder (private
//! to `verbio_runtime::cm`): no panic, and every frame that decodes
//! re-encodes to the same bytes (see `verbio_ops::fuzz_checks::cm_frame`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    verbio_ops::fuzz_checks::cm_frame::check(data);
});
