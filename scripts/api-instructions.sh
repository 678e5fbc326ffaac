#!/bin/bash
# api-instructions.sh -- user-space instructions per round trip of the
# send_lat client's runtime thread, `--api rdma` against `--api verbs`, on
# the software device, counted by callgrind (deterministic: unlike times,
# comparable across runs and loaded machines). Per build and API, the
# client runs N1 and N2 round trips sleeping on the completion channel
# (`-e`); (I(N2) - I(N1)) / (N2 - N1) cancels start-up and tear-down. The
# soft device's engine threads and the server are not counted.
#
#   scripts/api-instructions.sh [--iters N1,N2] [NAME=BINARY ...]
#
# Without NAME=BINARY, builds this tree's verbio-perf (release) and counts
# it; with them, counts each given verbio-perf build (e.g. the tree before
# a change and after: `base=/tmp/base/verbio-perf new=target/release/verbio-perf`).
# Prints per build: verbs and rdma instructions per round trip, both
# counts, and the runtime counts' difference and ratio. Needs valgrind.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
ITERS=200,1000
BUILDS=()
while [ $# -gt 0 ]; do
    case $1 in
        --iters) ITERS=$2; shift ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        *=*) BUILDS+=("$1") ;;
        *) echo "api-instructions: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
command -v valgrind >/dev/null || { echo "api-instructions: needs valgrind" >&2; exit 2; }
N1=${ITERS%,*}
N2=${ITERS#*,}
[ "$N2" -gt "$N1" ] || { echo "api-instructions: --iters N1,N2 with N2 > N1" >&2; exit 2; }
cd "$ROOT"
if [ ${#BUILDS[@]} -eq 0 ]; then
    cargo build -q --release -p verbio-perf
    BUILDS=("this=target/release/verbio-perf")
fi
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
PORT=$((18900 + RANDOM % 500))

# The runtime count's functions (see above).
RUNTIME='^(?!.*provider::).*(verbio_ops|verbio_perf|verbio_runtime::(reactor|qp|op|wake|buf)|futures_|slab::)'

# count BIN API N: the client's callgrind profile, $OUT/API.N.out-01 (thread
# 1: the client's runtime thread).
count() {
    local bin=$1 api=$2 n=$3
    PORT=$((PORT + 1))
    "$bin" send_lat -e -d soft0 -p "$PORT" -s 64 -n "$n" --api "$api" >/dev/null 2>&1 &
    local srv=$!
    # The client retries its connect until the server listens.
    valgrind --tool=callgrind --separate-threads=yes \
        --callgrind-out-file="$OUT/$api.$n.out" \
        "$bin" send_lat 127.0.0.1 -e -d soft0 -p "$PORT" -s 64 -n "$n" --api "$api" \
        >"$OUT/client.log" 2>&1 || { cat "$OUT/client.log" >&2; kill "$srv" 2>/dev/null; return 1; }
    wait "$srv"
}

# per API: "ALL RUNTIME" instructions per round trip.
per_rt() {
    python3 scripts/callgrind-per-rt.py --match "$RUNTIME" "$OUT/$1.$N1.out-01" "$OUT/$1.$N2.out-01" \
        $((N2 - N1)) 0 | awk 'NR == 1 {a = $1} NR == 2 {r = $1} END {print a, r}'
}

printf '%-12s %10s %10s %10s %10s %11s %8s\n' build verbs-all rdma-all verbs rdma rdma-verbs ratio
for b in "${BUILDS[@]}"; do
    name=${b%%=*}
    bin=${b#*=}
    for api in verbs rdma; do
        count "$bin" "$api" "$N1"
        count "$bin" "$api" "$N2"
    done
    read -r va vr <<<"$(per_rt verbs)"
    read -r ra rr <<<"$(per_rt rdma)"
    printf '%-12s %10s %10s %10s %10s %11s %8s\n' "$name" "$va" "$ra" "$vr" "$rr" $((rr - vr)) \
        "$(awk -v r="$rr" -v v="$vr" 'BEGIN {printf "%.2fx", r / v}')"
    rm -f "$OUT"/*.out*
done
