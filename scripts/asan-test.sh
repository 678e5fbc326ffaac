#!/usr/bin/env bash
# asan-test.sh -- the whole test suite under AddressSanitizer.
#
# The software device's engine thread reads and writes registered memory
# through raw pointers, as a NIC's DMA does; a buffer freed while a WR may
# still touch it (a cancel-safety bug) shows up here as a heap-use-after-free
# reported by ASan, even when the plain test run happens to pass.
#
# Leak detection is off: some tests check that dropping a runtime whose
# device never released a buffer leaks it on purpose (freeing it could let
# the device write into reused memory).
#
# Usage: scripts/asan-test.sh [extra cargo test args]
# Needs only the stable toolchain (RUSTC_BOOTSTRAP lets it accept -Zsanitizer).
set -euo pipefail
cd "$(dirname "$0")/.."
target=$(rustc -vV | sed -n 's/^host: //p')
export RUSTC_BOOTSTRAP=1
export RUSTFLAGS="-Zsanitizer=address"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1"
# Tests that bound the resident set skip that bound under ASan (its
# quarantine keeps freed memory resident) and say so.
export VERBIO_ASAN=1
export CARGO_TARGET_DIR="${ASAN_TARGET_DIR:-target/asan}"
# --target keeps the sanitizer flags off build scripts and proc macros.
# Doctests are left out (rustdoc links them without the sanitizer runtime);
# they run in the plain `cargo test --workspace`.
# verbio-tonic (gRPC over the handles) has no unsafe code of its own and
# its transport is the handles' tests' (run here): compiling tonic, hyper
# and prost again under ASan would only cost CI time.
exec cargo test --workspace --exclude verbio-tonic --target "$target" --lib --bins --tests "$@"
