"""Plots bandwidth and latency against message size from verbio-perf runs.

Usage (through scripts/plot-perf.sh, which installs matplotlib):
    plot_perf.py -o OUT.png [--title TITLE] LABEL=FILE[,FILE...] ...

Each FILE is either a verbio-perf `--json` document or the text table of a
verbio-perf or perftest run (`-a` sweeps, bandwidth or latency tests). The
left panel shows the average bandwidth (MB/s, 2^20 bytes) of the bandwidth
files, the right one the typical (median) latency of the latency files; one
line per LABEL.
"""

import argparse
import json
import re
import sys


def parse_text(text):
    """Rows of a perftest-style table: ('bw'|'lat', [(bytes, value)])."""
    kind = None
    rows = []
    for line in text.splitlines():
        if "BW average" in line:
            kind = "bw"
            continue
        if "t_typical" in line:
            kind = "lat"
            continue
        cols = line.split()
        if kind and len(cols) >= 5 and re.fullmatch(r"\d+", cols[0]):
            try:
                # bw: bytes iters peak avg rate; lat: bytes iters min max typical ...
                value = float(cols[3] if kind == "bw" else cols[4])
            except ValueError:
                continue
            rows.append((int(cols[0]), value))
    return kind, rows


def parse_file(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        doc = json.loads(text)
    except ValueError:
        return parse_text(text)
    results = doc.get("results", [])
    if results and "bw_avg_mbps" in results[0]:
        return "bw", [(r["bytes"], r["bw_avg_mbps"]) for r in results]
    return "lat", [(r["bytes"], r["t_typical"]) for r in results]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--out", required=True, help="the PNG to write")
    ap.add_argument("--title", default="verbio-perf")
    ap.add_argument("series", nargs="+", help="LABEL=FILE[,FILE...]")
    args = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bw_ax, lat_ax) = plt.subplots(1, 2, figsize=(12, 4.8))
    drawn = {"bw": 0, "lat": 0}
    for spec in args.series:
        label, _, files = spec.partition("=")
        if not files:
            sys.exit(f"plot_perf: expected LABEL=FILE[,FILE...], got {spec!r}")
        for path in files.split(","):
            kind, rows = parse_file(path)
            if not rows:
                sys.exit(f"plot_perf: no results in {path}")
            ax = bw_ax if kind == "bw" else lat_ax
            xs, ys = zip(*sorted(rows))
            ax.plot(xs, ys, marker="o", markersize=3, label=label)
            drawn[kind] += 1
    for ax, what, ylabel in (
        (bw_ax, "bw", "average bandwidth [MB/s]"),
        (lat_ax, "lat", "typical latency [usec]"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size [bytes]")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        if drawn[what]:
            ax.legend()
    bw_ax.set_title("bandwidth")
    lat_ax.set_title("latency")
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"plot_perf: wrote {args.out}")


if __name__ == "__main__":
    main()
