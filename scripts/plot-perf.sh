#!/usr/bin/env bash
# plot-perf.sh -- one PNG of bandwidth and latency against message size from
# verbio-perf `-a --json` sweeps (or verbio-perf / perftest text tables).
#
#   scripts/plot-perf.sh -o docs/img/NAME.png [--title TITLE] LABEL=FILE[,FILE...] ...
#
# Installs matplotlib from PyPI into a virtual environment under
# target/plot-venv on first use. Example (soft device against TCP):
#
#   verbio-perf send_bw -a -n 200 --json > soft-bw.json   (with its server)
#   verbio-perf send_lat -a -n 200 --json > soft-lat.json
#   ... the same with --transport tcp ...
#   scripts/plot-perf.sh -o docs/img/soft-vs-tcp.png soft=soft-bw.json,soft-lat.json \
#       tcp=tcp-bw.json,tcp-lat.json
#
# scripts/sweep-soft-tcp.sh runs those sweeps and this plot in one go.
#
#   scripts/plot-perf.sh --sweep DIR [perf_sweep.py's options]
#
# runs scripts/perf_sweep.py (the tables and plot of scripts/perf-sweep.sh)
# with the same matplotlib.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=$ROOT/target/plot-venv
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import matplotlib' 2>/dev/null; then
    echo "plot-perf: installing matplotlib into $VENV" >&2
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q matplotlib
fi
if [ "${1:-}" = --sweep ]; then
    shift
    exec "$VENV/bin/python" "$ROOT/scripts/perf_sweep.py" "$@"
fi
exec "$VENV/bin/python" "$ROOT/scripts/plot_perf.py" "$@"
