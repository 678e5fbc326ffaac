#!/usr/bin/env bash
# rxe-test.sh -- run verbio's ibverbs provider tests against real verbs
# (soft-RoCE, rxe0) inside a throw-away QEMU VM, on a host without RDMA.
#
# Usage:
#   scripts/rxe-test.sh [--perftest] [--no-devinfo] [TEST_TARGET...]
#
#   TEST_TARGET   integration-test targets of verbio-runtime to build and run
#                 (default: every runtime/tests/ibverbs_*.rs)
#   --perftest    also run perftest's ib_write_bw / ib_send_lat in the same VM
#                 (reference figures; needs the Debian package `perftest`)
#   --no-devinfo  skip `examples/devinfo -d rxe0`
#
# The test binaries are built on the host (`cargo test --features ibverbs
# --no-run`), then run in the VM via ../shared/tools/rxe-vm/run-in-rxe-vm.sh
# (override with RXE_VM_SCRIPT) with VERBIO_TEST_DEVICE=rxe0 (the VM also sets
# RXE_GID_INDEX=1: RoCE v2 ::ffff:10.77.0.1). One boot for everything (~7 s +
# the tests; the first run downloads a kernel and installs qemu).
#
# Exit status: 0 when everything passed, or when the VM cannot be set up or
# booted (then it prints "SKIPPED: <reason>"); non-zero when a test failed.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
VM=${RXE_VM_SCRIPT:-$ROOT/../shared/tools/rxe-vm/run-in-rxe-vm.sh}
[ -x "$VM" ] || VM=/work/shared/tools/rxe-vm/run-in-rxe-vm.sh

PERFTEST=0
DEVINFO=1
TARGETS=()
for a in "$@"; do
    case "$a" in
        --perftest) PERFTEST=1 ;;
        --no-devinfo) DEVINFO=0 ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        -*) echo "rxe-test: unknown option $a" >&2; exit 2 ;;
        *) TARGETS+=("$a") ;;
    esac
done
if [ ${#TARGETS[@]} -eq 0 ]; then
    for f in runtime/tests/ibverbs_*.rs; do
        t=$(basename "$f" .rs)
        TARGETS+=("$t")
    done
fi

skip() { echo "SKIPPED: $*"; exit 0; }

[ -x "$VM" ] || skip "rxe VM script not found ($VM)"
command -v jq >/dev/null || { echo "rxe-test: needs jq" >&2; exit 2; }

# ------------------------------------------------------------------- build
TEST_ARGS=()
for t in "${TARGETS[@]}"; do TEST_ARGS+=(--test "$t"); done
echo "rxe-test: building ${TARGETS[*]} (features: ibverbs)" >&2
json=$(cargo test -p verbio-runtime --features ibverbs --no-run \
        --message-format=json "${TEST_ARGS[@]}") || { echo "rxe-test: build failed" >&2; exit 1; }
mapfile -t BINS < <(printf '%s\n' "$json" |
    jq -r 'select(.reason=="compiler-artifact" and .profile.test==true and .executable!=null) | .executable')
[ ${#BINS[@]} -gt 0 ] || { echo "rxe-test: no test binaries found" >&2; exit 1; }
DEVINFO_BIN=
if [ "$DEVINFO" = 1 ]; then
    json=$(cargo build --example devinfo --features ibverbs --message-format=json) \
        || { echo "rxe-test: building examples/devinfo failed" >&2; exit 1; }
    DEVINFO_BIN=$(printf '%s\n' "$json" |
        jq -r 'select(.reason=="compiler-artifact" and .target.name=="devinfo" and .executable!=null) | .executable' | tail -1)
fi

# --------------------------------------------------------- VM availability
"$VM" --setup >/dev/null 2>/tmp/rxe-test-setup.$$ || {
    tail -5 /tmp/rxe-test-setup.$$ >&2; rm -f /tmp/rxe-test-setup.$$
    skip "the rxe VM cannot be set up (QEMU / kernel package unavailable)"
}
rm -f /tmp/rxe-test-setup.$$

# ------------------------------------------------------------ guest script
# The guest sees the host's root file system read-only and $ROOT read-write,
# but a fresh /tmp: keep the script under $ROOT/target.
GDIR=$ROOT/target/rxe-test
mkdir -p "$GDIR"
GUEST=$GDIR/guest.sh
{
    echo '#!/bin/sh'
    echo 'export VERBIO_TEST_DEVICE=${VERBIO_TEST_DEVICE:-rxe0} RUST_BACKTRACE=1'
    echo 'fail=0'
    echo 'echo "== guest: $(uname -r), device $VERBIO_TEST_DEVICE, RXE_GID_INDEX=$RXE_GID_INDEX"'
    for b in "${BINS[@]}"; do
        echo "echo; echo \"== $(basename "$b")\""
        echo "'$b' --test-threads=2 --nocapture || { echo \"FAILED: $(basename "$b")\"; fail=1; }"
    done
    if [ -n "$DEVINFO_BIN" ]; then
        echo 'echo; echo "== examples/devinfo -d rxe0"'
        echo "'$DEVINFO_BIN' -d rxe0 || { echo 'FAILED: devinfo'; fail=1; }"
    fi
    if [ "$PERFTEST" = 1 ]; then
        cat <<'PERF'
perf() { # name, server args..., then the client adds 127.0.0.1
    tool=$1; shift
    echo; echo "== perftest: $tool $*"
    if ! command -v "$tool" >/dev/null; then echo "FAILED: $tool not installed"; fail=1; return; fi
    "$tool" "$@" >/tmp/srv.log 2>&1 &
    srv=$!
    i=0; while [ $i -lt 100 ] && ! ss -ltn 2>/dev/null | grep -q ':18515 '; do sleep 0.1; i=$((i+1)); done
    if ! "$tool" "$@" 127.0.0.1; then echo "FAILED: $tool client"; fail=1; fi
    wait $srv || { echo "FAILED: $tool server"; cat /tmp/srv.log; fail=1; }
}
perf ib_write_bw -d rxe0 -x 1 -s 65536 -n 2000
perf ib_send_lat -d rxe0 -x 1 -s 64 -n 1000
PERF
    fi
    echo 'echo; if [ $fail = 0 ]; then echo "rxe-test: ALL PASSED"; else echo "rxe-test: FAILURES"; fi'
    echo 'exit $fail'
} > "$GUEST"
chmod +x "$GUEST"

# --------------------------------------------------------------------- run
"$VM" -- "$GUEST"
rc=$?
case $rc in
    0) exit 0 ;;
    124) echo "rxe-test: the VM run timed out (RXE_VM_TIMEOUT)" >&2; exit 1 ;;
    125) skip "the rxe VM failed to boot or run the command (QEMU)" ;;
    *) exit "$rc" ;;
esac
