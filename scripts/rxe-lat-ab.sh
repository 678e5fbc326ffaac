#!/bin/bash
# rxe-lat-ab.sh -- send_lat of several builds of verbio-perf side by side
# in one rxe VM, against perftest's ib_send_lat, for A/B comparisons of
# small latency changes.
#
#   scripts/rxe-lat-ab.sh [--rounds N] [--iters N] [--size BYTES] NAME=BINARY[:FLAGS] ...
#
# Each BINARY is a build of `verbio-perf` with `--features ibverbs`, under
# this checkout (the guest sees only it and the host's root file system
# read-only); FLAGS are extra client arguments, comma-separated (e.g.
# `raw=target/release/verbio-perf:--api,raw`). Every round runs perftest and
# each build once (server and client processes on rxe0), the order rotated
# round by round: in this VM a run right after another binary's is often
# slower, and the rotation spreads that over all. Prints each run's typical
# (median) latency, then per build the median over the rounds and the median
# and quartiles of its per-round ratio to perftest.
#
# Defaults: 16 rounds of 3000 iterations of 64 bytes (about a minute for
# two builds). verbio-perf's latency tests send INLINE up to 64 bytes
# unless told otherwise: with --size above that, add `-I,BYTES` to FLAGS
# to keep its sends INLINE (perftest picks its own inline size).
# The VM and its knobs: ../shared/tools/rxe-vm (override with RXE_VM_SCRIPT).
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
. "$ROOT/scripts/lib/rxe-host.sh"
ROUNDS=16
ITERS=3000
SIZE=64
BUILDS=()
while [ $# -gt 0 ]; do
    case $1 in
        --rounds) ROUNDS=$2; shift ;;
        --iters) ITERS=$2; shift ;;
        --size) SIZE=$2; shift ;;
        -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
        -*) echo "rxe-lat-ab: unknown option $1" >&2; exit 2 ;;
        *=*) BUILDS+=("$1") ;;
        *) echo "rxe-lat-ab: expected NAME=BINARY[:FLAGS], got $1" >&2; exit 2 ;;
    esac
    shift
done
[ ${#BUILDS[@]} -gt 0 ] || { sed -n '2,21p' "$0"; exit 2; }
case $SIZE in ''|*[!0-9]*) echo "rxe-lat-ab: --size takes a byte count, got $SIZE" >&2; exit 2 ;; esac
for b in "${BUILDS[@]}"; do
    rest=${b#*=}
    rxe_guest_binary rxe-lat-ab "${rest%%:*}"
done
VM=$(rxe_vm_script)
[ -x "$VM" ] || { echo "SKIPPED: rxe VM script not found ($VM)"; exit 0; }

DIR=$ROOT/target/rxe-lat-ab
mkdir -p "$DIR"
GUEST=$DIR/guest.sh
OUT=$DIR/runs.txt
{
    echo '#!/bin/sh'
    echo "R=$ROUNDS N=$ITERS S=$SIZE"
    printf 'set --'; printf " '%s'" perftest=- "${BUILDS[@]}"; echo
    cat <<'GUEST'
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/rxe-send-lat.sh
# run_spec NAME=BINARY[:FLAGS]: one run of that build (or perftest).
run_spec() {
    name=${1%%=*} rest=${1#*=}
    bin=${rest%%:*} flags=
    case $rest in *:*) flags=$(echo "${rest#*:}" | tr ',' ' ') ;; esac
    if [ "$name" = perftest ]; then
        perftest_lat perftest "$S"
    else
        # shellcheck disable=SC2086 # FLAGS are words
        verbio_lat "$name" "$bin" "$S" $flags
    fi
}
rounds "$R" "$@"
GUEST
} > "$GUEST"
chmod +x "$GUEST"

"$VM" -- "$GUEST" | tee "$OUT"
rc=${PIPESTATUS[0]}
[ "$rc" = 0 ] || { echo "rxe-lat-ab: the VM run failed (exit $rc)"; exit "$rc"; }
python3 - "$OUT" "$(( ${#BUILDS[@]} + 1 ))" <<'PY'
import statistics, sys
path, k = sys.argv[1], int(sys.argv[2])
runs = []
for line in open(path):
    p = line.split()
    if len(p) == 2:
        try:
            runs.append((p[0], float(p[1])))
        except ValueError:
            runs.append((p[0], None))
rounds = [runs[i:i + k] for i in range(0, len(runs) - k + 1, k)]
names = [n for n, _ in rounds[0]] if rounds else []
print("\nbuild       rounds  median us  ratio to perftest per round: median (q1-q3)")
for name in sorted(names, key=lambda n: n != "perftest"):
    vals, ratios = [], []
    for rd in rounds:
        m = dict(rd)
        v, p = m.get(name), m.get("perftest")
        if v is not None:
            vals.append(v)
            if p:
                ratios.append(v / p)
    if not vals:
        print(f"{name:10s}  no result")
        continue
    line = f"{name:10s}  {len(vals):6d}  {statistics.median(vals):9.2f}"
    if ratios and name != "perftest":
        r = sorted(ratios)
        line += f"  {statistics.median(r):.3f} ({r[len(r) // 4]:.3f}-{r[3 * len(r) // 4]:.3f})"
    print(line)
PY
