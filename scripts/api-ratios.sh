#!/bin/bash
# api-ratios.sh -- the high-level `Rdma` connection against the runtime's
# verbs, side by side in one run on the software device: verbio-perf
# send_lat and write_lat (typical round trip / 2) and write_bw (average
# bandwidth) with `--api verbs` and `--api rdma`, alternating round by
# round, with both sides sleeping on the completion channel and with both
# busy-polling. (write_lat: `--api verbs` polls memory for the peer's
# WRITE as perftest does, whatever the mode; `--api rdma` is a ping-pong
# of write_with_imm awaited with receive_write_imm.)
# Prints each round's figures, then per mode the medians and the ratio
# rdma / verbs (latency: lower is better; bandwidth: higher is better).
#
#   scripts/api-ratios.sh [--rounds N] [--iters N] [--size BYTES] [--bw-size BYTES]
#
# Defaults: 5 rounds, 3000 latency iterations of 64 B, write_bw of 64 KiB
# at perftest's depth. Builds verbio-perf in release mode first.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
ROUNDS=5
ITERS=3000
SIZE=64
BW_SIZE=65536
while [ $# -gt 0 ]; do
    case $1 in
        --rounds) ROUNDS=$2; shift ;;
        --iters) ITERS=$2; shift ;;
        --size) SIZE=$2; shift ;;
        --bw-size) BW_SIZE=$2; shift ;;
        -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
        *) echo "api-ratios: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
command -v jq >/dev/null || { echo "api-ratios: needs jq" >&2; exit 2; }
cd "$ROOT"
cargo build -q --release -p verbio-perf
BIN=target/release/verbio-perf
PORT=18700

# run TEST API MODE CLIENT-ARGS...: one server/client pair; prints the figure.
run() {
    local test=$1 api=$2 mode=$3; shift 3
    local poll=()
    [ "$mode" = busy ] && poll=(--busy-poll 1000000)
    PORT=$((PORT + 1))
    "$BIN" "$test" --api "$api" -d soft0 -p "$PORT" "${poll[@]}" >/dev/null 2>&1 &
    local srv=$!
    local out
    out=$("$BIN" "$test" 127.0.0.1 --api "$api" -d soft0 -p "$PORT" "${poll[@]}" --json "$@" 2>/dev/null)
    wait "$srv"
    case $test in
        send_lat | write_lat) jq -r '.results[0].t_typical * 100 | round / 100' <<<"$out" ;;
        write_bw) jq -r '.results[0].bw_avg_mbps | round' <<<"$out" ;;
    esac
}

median() { sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }

printf '%-6s %-9s %-5s %s\n' mode test api figures
for mode in sleep busy; do
    for test in send_lat write_lat write_bw; do
        declare -A got=([verbs]="" [rdma]="")
        for ((r = 0; r < ROUNDS; r++)); do
            # Alternate which API goes first.
            if ((r % 2)); then order="rdma verbs"; else order="verbs rdma"; fi
            for api in $order; do
                if [ "$test" != write_bw ]; then
                    v=$(run "$test" "$api" "$mode" -n "$ITERS" -s "$SIZE")
                else
                    v=$(run write_bw "$api" "$mode" -n 2000 -s "$BW_SIZE")
                fi
                got[$api]+="$v "
            done
        done
        for api in verbs rdma; do printf '%-6s %-9s %-5s %s\n' "$mode" "$test" "$api" "${got[$api]}"; done
        mv=$(tr ' ' '\n' <<<"${got[verbs]}" | grep . | median)
        mr=$(tr ' ' '\n' <<<"${got[rdma]}" | grep . | median)
        unit=$([ "$test" = write_bw ] && echo "MB/s" || echo "us (typical one-way)")
        printf '%-6s %-9s medians: verbs %s, rdma %s %s; rdma/verbs = %.2fx\n' \
            "$mode" "$test" "$mv" "$mr" "$unit" "$(awk -v a="$mr" -v b="$mv" 'BEGIN {print a / b}')"
        unset got
    done
done
