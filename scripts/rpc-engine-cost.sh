#!/bin/bash
# rpc-engine-cost.sh -- the RPC engine's cost per 32-byte call (client,
# server and handler task on one thread over the in-memory network), for
# several rpc_echo builds side by side in one run: thread CPU ns per call
# (`rpc_echo --engine-only`, ROUNDS rounds, builds alternating) and
# user-space instructions per call counted by callgrind, (I(N2) - I(N1)) /
# (calls(N2) - calls(N1)) so start-up and tear-down cancel, split into the
# runtime's executor, the in-memory network, the engine and the example's
# own timing and sorting. The engine's own cost per call is every
# instruction but the in-memory network's functions (a test transport's
# queues, buffers and wakes; the copies themselves, memcpy, stay counted
# with the engine's, which slightly overstates the engine) and the
# example's timing and sort: printed as instructions and as the thread
# CPU time in the same proportion (median ns x own / all instructions).
# Each build's thread CPU comes two ways: with a timestamp before and
# after each call (for the latency percentiles: on this VM's clock a
# pair costs tens of ns) and with the calls timed as one batch (builds
# that have it: `--no-latency` in `rpc_echo --help`); callgrind counts
# the batch pass where there is one.
#
#   scripts/rpc-engine-cost.sh [--rounds R] [--no-callgrind] NAME=BINARY ...
#
# e.g. before=/tmp/rpc_echo.before after=target/release/examples/rpc_echo;
# a BINARY may carry flags: "inline=target/release/examples/rpc_echo --inline-handler".
# Needs valgrind for the instruction counts.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
ROUNDS=5
CALLGRIND=1
BUILDS=()
while [ $# -gt 0 ]; do
    case $1 in
        --rounds) ROUNDS=$2; shift ;;
        --no-callgrind) CALLGRIND=0 ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *=*) BUILDS+=("$1") ;;
        *) echo "rpc-engine-cost: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
[ ${#BUILDS[@]} -gt 0 ] || { echo "rpc-engine-cost: give NAME=BINARY builds" >&2; exit 2; }
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

echo "thread CPU ns per call, $ROUNDS rounds of 20000 calls, builds alternating"
echo "(timed: a timestamp before and after each call, for the latency percentiles;"
echo " batch: the calls timed as one batch, no clock per call; '-': a build without it):"
for r in $(seq "$ROUNDS"); do
    line="  round $r:"
    for b in "${BUILDS[@]}"; do
        out=$(${b#*=} --engine-only --calls 20000)
        ns=$(sed -n 's/.*: \([0-9]*\) ns of thread CPU.*/\1/p' <<<"$out")
        batch=$(sed -n 's/.*: \([0-9]*\) ns of batch thread CPU.*/\1/p' <<<"$out")
        line="$line ${b%%=*} timed $ns batch ${batch:--}"
        echo "$ns" >> "$OUT/${b%%=*}.ns"
        [ -z "$batch" ] || echo "$batch" >> "$OUT/${b%%=*}.batch"
    done
    echo "$line"
done
median() { sort -n "$1" | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }
for b in "${BUILDS[@]}"; do
    median "$OUT/${b%%=*}.ns" >"$OUT/${b%%=*}.median"
    batch=-
    [ -f "$OUT/${b%%=*}.batch" ] && batch=$(median "$OUT/${b%%=*}.batch")
    echo "$batch" >"$OUT/${b%%=*}.bmedian"
    echo "  ${b%%=*}: median timed $(cat "$OUT/${b%%=*}.median") ns, batch $batch ns"
done
[ "$CALLGRIND" = 1 ] || exit 0
command -v valgrind >/dev/null || { echo "rpc-engine-cost: no valgrind: instruction counts skipped" >&2; exit 0; }
# Calls made: --calls N plus a tenth for warm-up.
N1=2000 N2=12000
CALLS=$(( (N2 + N2 / 10) - (N1 + N1 / 10) ))
echo "instructions per call (callgrind, $N1 vs $N2 calls):"
for b in "${BUILDS[@]}"; do
    name=${b%%=*} bin=${b#*=}
    # The batch pass alone where the build has it (what the batch ns
    # figure times); else the calls with their timestamps.
    pass=
    ns_file="$OUT/$name.median"
    if ${bin%% *} --help 2>/dev/null | grep -q -- --no-latency; then
        pass=--no-latency
        ns_file="$OUT/$name.bmedian"
    fi
    for n in $N1 $N2; do
        valgrind --tool=callgrind --callgrind-out-file="$OUT/$name.$n.out" $bin --engine-only $pass --calls $n >/dev/null 2>&1
    done
    per() { python3 "$ROOT/scripts/callgrind-per-rt.py" --match "$1" "$OUT/$name.$N1.out" "$OUT/$name.$N2.out" "$CALLS" 0 | awk '/of them/ {print $1}'; }
    total=$(python3 "$ROOT/scripts/callgrind-per-rt.py" "$OUT/$name.$N1.out" "$OUT/$name.$N2.out" "$CALLS" 0 | awk '/per iteration/ {print $1}')
    runtime=$(per '^(?!.*rpc::mem::).*(verbio_runtime::|vec_deque::VecDeque<T,A>::make_contiguous)')
    mem=$(per '(rpc::mem::|^__memcpy)')
    engine=$(per '^(?!.*rpc::mem::)(?!.*verbio_runtime::).*(verbio_ops::rpc|poll_fn::PollFn)')
    bench=$(per '(sort|Timespec|Instant|clock_gettime|rpc_echo)')
    echo "  $name (${pass:-timed calls}): $total in all: engine $engine, runtime executor $runtime, in-memory network $mem, the example's timing $bench"
    net=$(per 'rpc::mem::')
    awk -v t="$total" -v n="$net" -v b="$bench" -v ns="$(cat "$ns_file")" 'BEGIN {
        own = t - n - b
        printf "  %s: the engine'"'"'s own (all but the network'"'"'s functions and the example'"'"'s timing): %d instructions, %.0f ns (%.0f ns x %d / %d)\n", "'"$name"'", own, ns * own / t, ns, own, t
    }'
done
