#!/usr/bin/env bash
# fuzz.sh -- run verbio's cargo-fuzz targets (fuzz/) on the stable toolchain.
#
# Usage:
#   scripts/fuzz.sh TARGET|all [SECONDS] [-- LIBFUZZER_ARGS...]
#
#   TARGET    agent_wire | handshake | handshake_exchange | soft_packet | soft_handshake |
#             rpc_header |
#             cm_frame, or
#             `all` (one after the other, never in parallel)
#   SECONDS   fuzzing time per target (default 60)
#   LIBFUZZER_ARGS  passed on to libFuzzer, e.g. -- -jobs=2 -max_len=4096
#
# Installs cargo-fuzz first if it is missing (`cargo install cargo-fuzz
# --locked`, about 3 minutes). Runs
#   RUSTC_BOOTSTRAP=1 cargo fuzz run TARGET fuzz/corpus/TARGET -- -max_total_time=SECONDS
# (RUSTC_BOOTSTRAP lets stable rustc accept the sanitizer flags cargo-fuzz
# passes; AddressSanitizer and debug assertions are on). The corpus starts from
# the committed seeds fuzz/corpus/TARGET/seed-* (written by
# `cargo run --example fuzz_seeds`); inputs libFuzzer adds there are
# git-ignored. The properties checked are verbio_ops::fuzz_checks, the same
# ones `cargo test --test fuzz_replay` replays on stable.
#
# Prints a summary per target: executions, exec/s, coverage (cov = edges,
# ft = features), corpus size, and the crash artifact if any. A crash
# artifact lands in fuzz/artifacts/TARGET/; minimize it with
#   RUSTC_BOOTSTRAP=1 cargo fuzz tmin TARGET fuzz/artifacts/TARGET/crash-...
# and keep it as a regression seed: fuzz/corpus/TARGET/seed-regress-<what>.
#
# Source coverage of a corpus (needs `rustup component add llvm-tools`):
#   RUSTC_BOOTSTRAP=1 cargo fuzz coverage TARGET fuzz/corpus/TARGET
#   $(rustc --print sysroot)/lib/rustlib/x86_64-unknown-linux-gnu/bin/llvm-cov report \
#     target/x86_64-unknown-linux-gnu/coverage/x86_64-unknown-linux-gnu/release/TARGET \
#     -instr-profile=fuzz/coverage/TARGET/coverage.profdata ops/src/agent/wire.rs
#
# Exit status: 0 if no target crashed, 1 if one did, 2 on usage errors.
set -euo pipefail

TARGETS=(agent_wire handshake handshake_exchange soft_packet soft_handshake rpc_header cm_frame)
cd "$(dirname "$0")/.."

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
    exit 2
}

[[ $# -ge 1 ]] || usage
what=$1
shift
seconds=60
if [[ $# -ge 1 && $1 != -- ]]; then
    seconds=$1
    shift
fi
[[ $seconds =~ ^[0-9]+$ ]] || usage
if [[ $# -ge 1 ]]; then
    [[ $1 == -- ]] || usage
    shift
fi
extra=("$@")

case $what in
all) run=("${TARGETS[@]}") ;;
agent_wire | handshake | handshake_exchange | soft_packet | soft_handshake | rpc_header | cm_frame) run=("$what") ;;
*) usage ;;
esac

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz.sh: installing cargo-fuzz (about 3 minutes)..." >&2
    cargo install cargo-fuzz --locked
fi

export RUSTC_BOOTSTRAP=1
logdir=${TMPDIR:-/tmp}/verbio-fuzz
mkdir -p "$logdir"
summary=()
status=0
for target in "${run[@]}"; do
    log=$logdir/$target.log
    echo "== fuzzing $target for ${seconds}s (log: $log)" >&2
    set +e
    cargo fuzz run "$target" "fuzz/corpus/$target" -- \
        -max_total_time="$seconds" -print_final_stats=1 "${extra[@]}" 2>&1 | tee "$log" |
        grep --line-buffered -E '^#[0-9]+\s+(INITED|DONE|pulse)|ERROR|panicked|Test unit written' >&2
    rc=${PIPESTATUS[0]}
    set -e
    # The last status line: "#N DONE cov: C ft: F corp: K/S ... exec/s: E ...".
    last=$(grep -E '^#[0-9]+\s' "$log" | tail -n 1 || true)
    execs=$(grep -oE '^stat::number_of_executed_units: *[0-9]+' "$log" | grep -oE '[0-9]+$' || true)
    rate=$(grep -oE '^stat::average_exec_per_sec: *[0-9]+' "$log" | grep -oE '[0-9]+$' || true)
    cov=$(grep -oE 'cov: [0-9]+' <<<"$last" | grep -oE '[0-9]+' || true)
    ft=$(grep -oE 'ft: [0-9]+' <<<"$last" | grep -oE '[0-9]+' || true)
    corp=$(grep -oE 'corp: [0-9]+/[0-9A-Za-z]+' <<<"$last" | cut -d' ' -f2 || true)
    line=$(printf '%-12s <=%ss  execs %-10s exec/s %-8s cov %-5s ft %-6s corpus %s' \
        "$target" "$seconds" "${execs:-?}" "${rate:-?}" "${cov:-?}" "${ft:-?}" "${corp:-?}")
    if [[ $rc -ne 0 ]]; then
        artifact=$(grep -oE 'Test unit written to \S+' "$log" | tail -n 1 | cut -d' ' -f5 || true)
        line+="  CRASH (exit $rc) ${artifact:-see $log}"
        status=1
    else
        line+="  ok"
    fi
    summary+=("$line")
done

echo
echo "fuzz summary:"
printf '  %s\n' "${summary[@]}"
exit $status
