#!/usr/bin/env bash
# perf-sweep.sh -- every path at every size in one run: verbio-perf send_lat
# (one message in flight) and send_bw (a window) through the verbs API, the
# Rdma agent, the RPC engine over UD and kernel TCP, from 64 B to 16 MiB in
# powers of 4; prints per size each path's figure and its ratio to verbs
# and to TCP, and plots them.
#
#   scripts/perf-sweep.sh [--rxe] [--sizes LIST] [--paths LIST] [--tests LIST]
#                         [-D SECONDS] [--window N] [--rounds N] [--limit SECONDS]
#                         [--plot PNG] [--title TEXT] [--guard X] [--bin BINARY]
#                         [--out DIR] [--markdown] [--rdma-flags FLAGS]
#                         [--stat median|best] [--known PATH:TEST:SIZE=Y]
#                         [--placement free|same|split]
#
#   --rxe          run inside the rxe VM (../shared/tools/rxe-vm) on rxe0,
#                  with a build of --features ibverbs; default: soft0 here
#   --sizes LIST   byte counts (K, M suffixes); default 64,256,...,16M
#   --paths LIST   of verbs,rdma,rpc,tcp (default all; verbs first: the
#                  ratios need it)
#   --tests LIST   of send_lat,send_bw (default both)
#   -D SECONDS     time per run (default 0.5; at least 5 messages run)
#   --window N     send_bw's messages in flight (default 128, fewer above
#                  2 MiB: at most 256 MiB in flight)
#   --rounds N     repeat the whole sweep; the median of the rounds counts
#   --stat best    count each path's best round instead of the median
#   --limit S      a run not done after S seconds is killed: n/a (default 120)
#   --plot PNG     plot figures and ratios (matplotlib from PyPI into
#                  target/plot-venv on first use)
#   --guard X      exit 1 if rdma or rpc is more than X times slower than
#                  verbs at any size and test, or could not run
#   --known P:T:S=Y  with --guard: a point known to miss X (e.g.
#                  rpc:send_bw:4K=6), printed as a known miss and held to
#                  Y instead (repeatable)
#   --bin BINARY   a verbio-perf binary (default: build the release one;
#                  with --rxe, one outside this checkout is copied under it)
#   --out DIR      results (default target/perf-sweep/soft0 or .../rxe0)
#   --markdown     print the tables in Markdown too
#   --rdma-flags F verbio-perf flags added to the verbs, rdma and rpc runs,
#                  e.g. "--busy-poll 1000000" (both sides get them)
#   --placement P  where the server and client processes run (with --rxe,
#                  on the guest's vCPUs): free (default: where the
#                  scheduler puts them), same (both pinned to one CPU) or
#                  split (server on one CPU, client on another). The
#                  scheduler keeps a process pair's threads where it first
#                  put them, and a wake-up across CPUs costs far more than
#                  one within (tens of us in a VM), so free runs of one
#                  build read one of two figures; a fixed placement
#                  compares like with like (docs/benchmarks.md). In the
#                  rxe guest on a loaded host, latencies follow the host's
#                  scheduling of the vCPU threads (steps of milliseconds)
#                  whatever the placement. With --rxe, same is refused
#                  unless --rdma-flags sets --busy-poll: there each
#                  process busy-polls 50 ms before it sleeps, so two on
#                  one CPU measure the scheduler's time slice
#
# A path that cannot carry a size (or fails, or times out) is printed as
# n/a with the reason; the sweep goes on. The ratios are slowdowns: a
# path's time per message (latency) or per byte (bandwidth) divided by
# the other path's; above 1 is slower.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
RXE=0
SIZES=64,256,1K,4K,16K,64K,256K,1M,4M,16M
PATHS=verbs,rdma,rpc,tcp
TESTS=send_lat,send_bw
DUR=0.5
WINDOW=128
ROUNDS=1
LIMIT=120
PLOT=
TITLE=
GUARD=
BIN=
OUT=
MARKDOWN=
RDMA_FLAGS=
STAT=median
PLACEMENT=free
KNOWN=()
while [ $# -gt 0 ]; do
    case $1 in
        --rxe) RXE=1 ;;
        --sizes) SIZES=$2; shift ;;
        --paths) PATHS=$2; shift ;;
        --tests) TESTS=$2; shift ;;
        -D) DUR=$2; shift ;;
        --window) WINDOW=$2; shift ;;
        --rounds) ROUNDS=$2; shift ;;
        --limit) LIMIT=$2; shift ;;
        --plot) PLOT=$2; shift ;;
        --title) TITLE=$2; shift ;;
        --guard) GUARD=$2; shift ;;
        --bin) BIN=$2; shift ;;
        --out) OUT=$2; shift ;;
        --markdown) MARKDOWN=--markdown ;;
        --rdma-flags) RDMA_FLAGS=$2; shift ;;
        --stat) STAT=$2; shift ;;
        --known) KNOWN+=(--known "$2"); shift ;;
        --placement) PLACEMENT=$2; shift ;;
        -h|--help) sed -n '2,55p' "$0"; exit 0 ;;
        *) echo "perf-sweep: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
die() { echo "perf-sweep: $*" >&2; exit 2; }
case ,$PATHS, in *,verbs,*) ;; *) die "--paths must include verbs (the ratios' reference)" ;; esac
for p in ${PATHS//,/ }; do
    case $p in verbs|rdma|rpc|tcp) ;; *) die "unknown path $p (verbs, rdma, rpc, tcp)" ;; esac
done
for t in ${TESTS//,/ }; do
    case $t in send_lat|send_bw) ;; *) die "unknown test $t (send_lat, send_bw)" ;; esac
done
case $STAT in median|best) ;; *) die "--stat takes median or best" ;; esac
case $PLACEMENT in free|same|split) ;; *) die "--placement takes free, same or split" ;; esac
# On rxe verbio-perf busy-polls the CQ for 50 ms before it sleeps (perftest
# does too), so two processes on one CPU each spin out their time slice while
# the other waits: every latency reads as the scheduler's slice (8 ms seen).
if [ "$RXE" = 1 ] && [ "$PLACEMENT" = same ]; then
    case " $RDMA_FLAGS " in
        *--busy-poll*) ;;
        *) die "--rxe --placement same: both processes would busy-poll one CPU and measure the scheduler's time slice; use --placement split, or add --rdma-flags '--busy-poll 0'" ;;
    esac
fi
case $ROUNDS in ''|*[!0-9]*|0) die "--rounds takes a count" ;; esac
case $WINDOW in ''|*[!0-9]*|0) die "--window takes a count" ;; esac
case $LIMIT in ''|*[!0-9]*|0) die "--limit takes seconds" ;; esac
# Sizes to plain byte counts (the runs name their files by them).
bytes=()
for s in ${SIZES//,/ }; do
    case $s in
        *[Kk]) n=${s%?}; m=1024 ;;
        *[Mm]) n=${s%?}; m=$((1 << 20)) ;;
        *) n=$s; m=1 ;;
    esac
    case $n in ''|*[!0-9]*) die "--sizes: $s is not a size (e.g. 64,4K,1M)" ;; esac
    bytes+=($((n * m)))
done
SIZES=$(IFS=,; echo "${bytes[*]}")

target_dir() {
    cargo metadata --format-version 1 --no-deps |
        python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])'
}

if [ "$RXE" = 1 ]; then
    . "$ROOT/scripts/lib/rxe-host.sh"
    DEV=rxe0 GIDX=1
    OUT=${OUT:-$ROOT/target/perf-sweep/rxe0}
    VM=$(rxe_vm_script)
    [ -x "$VM" ] || { echo "SKIPPED: rxe VM script not found ($VM)"; exit 0; }
    if [ -z "$BIN" ]; then
        cargo build -q --release -p verbio-perf --features ibverbs
        # The guest sees this checkout: the binary goes under it.
        mkdir -p "$ROOT/target/perf-sweep"
        cp "$(target_dir)/release/verbio-perf" "$ROOT/target/perf-sweep/verbio-perf-ibverbs"
        BIN=$ROOT/target/perf-sweep/verbio-perf-ibverbs
    fi
    case $(realpath -m "$BIN") in
        "$ROOT"/*) ;;
        *)
            # The guest sees only this checkout: a binary from elsewhere
            # (another worktree's target) is copied under it.
            [ -x "$BIN" ] || die "$BIN is not executable"
            mkdir -p "$ROOT/target/perf-sweep"
            GIVEN_COPY=$ROOT/target/perf-sweep/verbio-perf-given-$$
            cp "$BIN" "$GIVEN_COPY"
            BIN=$GIVEN_COPY
            ;;
    esac
    rxe_guest_binary perf-sweep "$BIN"
else
    DEV=soft0 GIDX=
    OUT=${OUT:-$ROOT/target/perf-sweep/soft0}
    if [ -z "$BIN" ]; then
        cargo build -q --release -p verbio-perf
        BIN=$(target_dir)/release/verbio-perf
    fi
fi
[ -x "$BIN" ] || die "$BIN is not executable"
rm -rf "$OUT"
mkdir -p "$OUT"
start=$(date -u '+%F %H:%M')
t0=$SECONDS
if [ "$RXE" = 1 ]; then
    case $(realpath -m "$OUT") in "$ROOT"/*) ;; *) die "--out must be under $ROOT with --rxe" ;; esac
    GUEST=$OUT/guest.sh
    {
        echo '#!/bin/bash'
        printf 'BIN=%q DEV=%q GIDX=%q OUT=%q SIZES=%q PATHS=%q TESTS=%q DUR=%q WINDOW=%q ROUNDS=%q LIMIT=%q RDMA_FLAGS=%q\n' \
            "$BIN" "$DEV" "$GIDX" "$OUT" "$SIZES" "$PATHS" "$TESTS" "$DUR" "$WINDOW" "$ROUNDS" "$LIMIT" "$RDMA_FLAGS"
        printf '. %q\n' "$ROOT/scripts/lib/perf-sweep-runs.sh"
        printf 'sweep_placement %q || { echo "perf-sweep: --placement %q in the guest: $SWEEP_PLACEMENT_ERR" >&2; exit 2; }\n' \
            "$PLACEMENT" "$PLACEMENT"
        echo 'sweep_runs'
    } >"$GUEST"
    chmod +x "$GUEST"
    rc=0
    "$VM" -- "$GUEST" || rc=$?
    [ -n "${GIVEN_COPY:-}" ] && rm -f "$GIVEN_COPY"
    [ "$rc" = 0 ] || { echo "perf-sweep: the VM run failed (exit $rc)"; exit "$rc"; }
else
    . "$ROOT/scripts/lib/perf-sweep-runs.sh"
    sweep_placement "$PLACEMENT" || die "--placement $PLACEMENT: $SWEEP_PLACEMENT_ERR"
    sweep_runs
fi
echo "perf-sweep: $(( SECONDS - t0 )) s of runs on $DEV" >&2
{
    echo "command: scripts/perf-sweep.sh$([ "$RXE" = 1 ] && echo ' --rxe') --sizes $SIZES --paths $PATHS --tests $TESTS -D $DUR --window $WINDOW --rounds $ROUNDS$([ -n "$RDMA_FLAGS" ] && printf ' --rdma-flags %q' "$RDMA_FLAGS")$([ "$PLACEMENT" != free ] && echo " --placement $PLACEMENT")"
    echo "device: $DEV"
    echo "started: $start UTC"
    echo "machine: $(nproc) cores, $(uname -sr)"
} >"$OUT/run.txt"
args=("$OUT" --stat "$STAT")
[ -n "$PLOT" ] && args+=(--plot "$PLOT" --title "${TITLE:-verbio-perf on $DEV: every path against verbs and kernel TCP, $start UTC}")
[ -n "$GUARD" ] && args+=(--guard "$GUARD" "${KNOWN[@]}")
[ -n "$MARKDOWN" ] && args+=(--markdown)
if [ -n "$PLOT" ]; then
    exec "$ROOT/scripts/plot-perf.sh" --sweep "${args[@]}"
fi
exec python3 "$ROOT/scripts/perf_sweep.py" "${args[@]}"
