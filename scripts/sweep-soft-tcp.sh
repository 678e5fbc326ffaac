#!/usr/bin/env bash
# sweep-soft-tcp.sh -- verbio-perf size sweeps (-a, 2 B .. 16 MiB) of send_bw
# and send_lat on the software device and over kernel TCP on loopback, then
# one PNG of both (scripts/plot-perf.sh).
#
#   scripts/sweep-soft-tcp.sh [-o docs/img/soft-vs-tcp.png] [-n ITERS] [--api verbs|raw|rdma]
#
# (scripts/perf-sweep.sh runs every path, verbs, Rdma, RPC and TCP, side
# by side with their ratios.)
#
# Builds verbio-perf (release); writes the JSON of every run under
# target/perf-sweep. Server and client are two processes on this host.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUT=docs/img/soft-vs-tcp.png
ITERS=200
API=verbs
while [ $# -gt 0 ]; do
    case $1 in
        -o) OUT=$2; shift ;;
        -n) ITERS=$2; shift ;;
        --api) API=$2; shift ;;
        -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
        *) echo "sweep-soft-tcp: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
cargo build -q --release -p verbio-perf
BIN=$(cargo metadata --format-version 1 --no-deps |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')/release/verbio-perf
DIR=$ROOT/target/perf-sweep
mkdir -p "$DIR"
PORT=18650

# run NAME TEST ARGS...: server and client processes; the client's JSON in $DIR/NAME.json.
run() {
    name=$1; test=$2; shift 2
    PORT=$((PORT + 1))
    "$BIN" "$test" -p "$PORT" "$@" 2>"$DIR/$name.srv" &
    srv=$!
    "$BIN" "$test" 127.0.0.1 -p "$PORT" -a -n "$ITERS" --json "$@" >"$DIR/$name.json"
    wait $srv
    echo "sweep-soft-tcp: $name done" >&2
}
run soft-bw send_bw -d soft0 --api "$API"
run tcp-bw send_bw --transport tcp
run soft-lat send_lat -d soft0 --api "$API"
run tcp-lat send_lat --transport tcp
scripts/plot-perf.sh -o "$OUT" --title "verbio-perf send_bw / send_lat: soft device ($API API) vs kernel TCP, loopback, $(date -u +%F)" \
    "soft device=$DIR/soft-bw.json,$DIR/soft-lat.json" "TCP=$DIR/tcp-bw.json,$DIR/tcp-lat.json"
