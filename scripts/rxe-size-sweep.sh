#!/bin/bash
# rxe-size-sweep.sh -- send_lat at several message sizes in one rxe VM boot,
# perftest's ib_send_lat and a verbio-perf build (`--api verbs`, INLINE),
# the sizes interleaved round by round (the order rotated) so that the
# host's drift spreads over all of them. Shows what a size costs on rxe
# here, e.g. the step at 80 bytes of padded payload where the guest's
# crc32-pclmul takes its SIMD path for rxe's ICRC.
#
#   scripts/rxe-size-sweep.sh [--rounds N] [--iters N] [--sizes A,B,...] BINARY
#
# BINARY is a build of verbio-perf with `--features ibverbs` under this
# checkout (the guest sees only it). Defaults: 8 rounds of 3000 iterations
# at 64,72,76,80,88,112 bytes, busy-polling, `-I 128` so that every size
# goes INLINE. Prints each run's typical one-way latency, then per size
# the median over the rounds for perftest and verbio, and each size's
# median per-round difference to the first size.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
. "$ROOT/scripts/lib/rxe-host.sh"
ROUNDS=8
ITERS=3000
SIZES=64,72,76,80,88,112
BIN=
while [ $# -gt 0 ]; do
    case $1 in
        --rounds) ROUNDS=$2; shift ;;
        --iters) ITERS=$2; shift ;;
        --sizes) SIZES=$2; shift ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        -*) echo "rxe-size-sweep: unknown option $1" >&2; exit 2 ;;
        *) BIN=$1 ;;
    esac
    shift
done
[ -n "$BIN" ] || { sed -n '2,16p' "$0"; exit 2; }
rxe_guest_binary rxe-size-sweep "$BIN"
case $SIZES in *[!0-9,]*|'') echo "rxe-size-sweep: --sizes takes byte counts, e.g. 64,88" >&2; exit 2 ;; esac
VM=$(rxe_vm_script)
[ -x "$VM" ] || { echo "SKIPPED: rxe VM script not found ($VM)"; exit 0; }

DIR=$ROOT/target/rxe-size-sweep
mkdir -p "$DIR"
GUEST=$DIR/guest.sh
OUT=$DIR/runs.txt
{
    echo '#!/bin/sh'
    echo "R=$ROUNDS N=$ITERS B='$BIN'"
    printf 'set --'; for s in ${SIZES//,/ }; do printf " 'p %s' 'v %s'" "$s" "$s"; done; echo
    cat <<'GUEST'
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/rxe-send-lat.sh
# run_spec "TOOL SIZE": one run of perftest (p) or the verbio build (v).
run_spec() {
    set -- $1
    case $1 in
        p) perftest_lat "perftest $2" "$2" ;;
        v) verbio_lat "verbio $2" "$B" "$2" -I 128 --api verbs --busy-poll 1000000 ;;
    esac
}
rounds "$R" "$@"
GUEST
} > "$GUEST"
chmod +x "$GUEST"

"$VM" -- "$GUEST" | tee "$OUT"
rc=${PIPESTATUS[0]}
[ "$rc" = 0 ] || { echo "rxe-size-sweep: the VM run failed (exit $rc)"; exit "$rc"; }
python3 - "$OUT" "$SIZES" <<'PY'
import statistics, sys
path, sizes = sys.argv[1], [int(s) for s in sys.argv[2].split(",")]
runs = []
for line in open(path):
    p = line.split()
    if len(p) == 3 and p[0] in ("perftest", "verbio"):
        try:
            runs.append((p[0], int(p[1]), float(p[2])))
        except ValueError:
            pass
k = 2 * len(sizes)
rounds = [runs[i:i + k] for i in range(0, len(runs), k)]
print(f"\n{'size':>5}  {'perftest us':>11}  {'+ vs first':>10}  {'verbio us':>9}  {'+ vs first':>10}")
for s in sizes:
    line = f"{s:5d}"
    for tool in ("perftest", "verbio"):
        vals = [v for t, z, v in runs if t == tool and z == s]
        diffs = []
        for rd in rounds:
            m = {(t, z): v for t, z, v in rd}
            if (tool, s) in m and (tool, sizes[0]) in m:
                diffs.append(m[(tool, s)] - m[(tool, sizes[0])])
        w = 11 if tool == "perftest" else 9
        med = f"{statistics.median(vals):{w}.2f}" if vals else f"{'n/a':>{w}}"
        dif = f"{statistics.median(diffs):+10.2f}" if diffs else f"{'n/a':>10}"
        line += f"  {med}  {dif}"
    print(line)
PY
