"""Tables, ratios, plot and guard of a scripts/perf-sweep.sh run.

Usage:
    perf_sweep.py DIR [--plot PNG [--title TITLE]] [--guard X] [--markdown]
                      [--stat median|best] [--known PATH:TEST:SIZE=Y ...]

DIR holds TEST_PATH_SIZE_rROUND.json (a verbio-perf client's --json) or
.na (why that run could not be made), and run.txt (what ran). Prints, per
test, one line per size: each path's figure (the median over the rounds,
or with --stat best the best round: the lowest latency, the highest
bandwidth;
typical one-way latency in usec for send_lat, average MB/s for send_bw)
and its slowdown against verbs and against TCP: a path's time per message
(latency) or per byte (bandwidth) divided by the reference's, so that
above 1 is slower. --plot needs matplotlib (scripts/plot-perf.sh --sweep
provides it); the rest runs on the standard library. --guard X exits 1
if the Rdma agent or RPC is more than X times slower than verbs at any
size and test, or could not run there. --known PATH:TEST:SIZE=Y names
a point known to miss X (an open issue, printed as such by every run):
it is held to Y instead, so that it cannot get worse unseen.
"""

import argparse
import json
import os
import re
import statistics
import sys

PATHS = ["verbs", "rdma", "rpc", "tcp"]
NAMES = {"verbs": "verbs", "rdma": "Rdma", "rpc": "RPC/UD", "tcp": "TCP"}
COLORS = {"verbs": "C0", "rdma": "C1", "rpc": "C2", "tcp": "C3"}
GUARDED = ["rdma", "rpc"]
FILE = re.compile(r"^(send_lat|send_bw)_(verbs|rdma|rpc|tcp)_(\d+)_r(\d+)\.(json|na)$")


def size_name(b):
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift} {unit}"
    return f"{b} B"


def load(d, stat="median"):
    """{(test, path, size): figure over the rounds} and {(test, path, size): reason}."""
    vals, na = {}, {}
    for name in sorted(os.listdir(d)):
        m = FILE.match(name)
        if not m:
            continue
        test, path, size, _, kind = m.groups()
        key = (test, path, int(size))
        with open(os.path.join(d, name), encoding="utf-8") as f:
            text = f.read()
        if kind == "na":
            na.setdefault(key, text.strip() or "no reason given")
            continue
        try:
            row = json.loads(text)["results"][0]
            v = row["t_typical"] if test == "send_lat" else row["bw_avg_mbps"]
        except (ValueError, KeyError, IndexError) as e:
            na.setdefault(key, f"unreadable result ({e})")
            continue
        vals.setdefault(key, []).append(float(v))
    if stat == "best":
        med = {k: (min(v) if k[0] == "send_lat" else max(v)) for k, v in vals.items()}
    else:
        med = {k: statistics.median(v) for k, v in vals.items()}
    # A run that worked in some round counts; its failures only if none did.
    na = {k: r for k, r in na.items() if k not in med}
    return med, na


def slowdown(test, v, ref):
    """How many times slower v is than ref (latency: time; bw: 1/rate)."""
    if v is None or ref is None or v <= 0 or ref <= 0:
        return None
    return v / ref if test == "send_lat" else ref / v


def tables(med, na, paths, markdown):
    tests = [t for t in ("send_lat", "send_bw") if any(k[0] == t for k in list(med) + list(na))]
    out = []
    for test in tests:
        sizes = sorted({k[2] for k in list(med) + list(na) if k[0] == test})
        unit = "typical one-way latency [usec], one message in flight" if test == "send_lat" \
            else "average bandwidth [MB/s = 2^20 B/s], a window in flight"
        cols = []
        for p in paths:
            cols.append((p, None))
            if p != "verbs":
                cols.append((p, "verbs"))
            if p not in ("verbs", "tcp") and "tcp" in paths:
                cols.append((p, "tcp"))
            if p == "verbs" and "tcp" in paths:
                cols.append((p, "tcp"))
        head = ["size"] + [NAMES[p] if r is None else f"{NAMES[p]}/{NAMES[r]}" for p, r in cols]
        rows = []
        for s in sizes:
            row = [size_name(s)]
            for p, r in cols:
                v = med.get((test, p, s))
                if r is None:
                    row.append("n/a" if v is None else f"{v:.2f}")
                else:
                    x = slowdown(test, v, med.get((test, r, s)))
                    row.append("n/a" if x is None else f"{x:.2f}")
            rows.append(row)
        notes = [f"{NAMES[p]} {size_name(s)}: {r}" for (t, p, s), r in sorted(na.items()) if t == test]
        if markdown:
            out.append(f"\n**{test}**: {unit}; ratios are slowdowns (above 1: slower)\n")
            out.append("| " + " | ".join(head) + " |")
            out.append("|" + "---|" * len(head))
            out.extend("| " + " | ".join(r) + " |" for r in rows)
            out.extend(f"\nn/a: {n}" for n in notes)
        else:
            out.append(f"\n{test}: {unit}; ratios are slowdowns (above 1: slower)")
            widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
            out.append("  ".join(h.rjust(w) for h, w in zip(head, widths)))
            out.extend("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)
            out.extend(f"  n/a: {n}" for n in notes)
    return "\n".join(out)


def parse_size(text):
    """Bytes of "4096", "4K" or "1M"."""
    m = re.fullmatch(r"(\d+)([KM]?)", text.strip())
    if not m:
        raise ValueError(f"not a size: {text!r} (bytes, or with a K or M suffix)")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20}[m.group(2)]


def parse_known(spec):
    """(path, test, size), limit of "rpc:send_bw:4K=6"."""
    try:
        point, limit = spec.split("=")
        path, test, size = point.split(":")
        if path not in GUARDED or test not in ("send_lat", "send_bw"):
            raise ValueError(f"no guarded point {path}:{test}")
        return (path, test, parse_size(size)), float(limit)
    except ValueError as e:
        sys.exit(f"perf-sweep: --known {spec!r}: {e} (expected PATH:TEST:SIZE=LIMIT, e.g. rpc:send_bw:4K=6)")


def guard(med, na, paths, limit, known=None):
    """Failures of the guard, the worst ratio seen, and the known misses
    (points held to their own limit) with their ratios."""
    known = known or {}
    fails, worst, misses = [], None, []
    for (test, path, size) in sorted(set(med) | set(na)):
        if path not in GUARDED or path not in paths:
            continue
        where = f"{NAMES[path]} {test} {size_name(size)}"
        if (test, path, size) in na:
            fails.append(f"{where}: could not run ({na[(test, path, size)]})")
            continue
        ref = med.get((test, "verbs", size))
        if ref is None:
            why = na.get((test, "verbs", size), "no result")
            fails.append(f"{where}: verbs could not run ({why})")
            continue
        x = slowdown(test, med[(test, path, size)], ref)
        if x is None:
            fails.append(f"{where}: no usable figure")
            continue
        own = known.get((path, test, size))
        if own is not None and x > limit:
            misses.append(f"{where}: {x:.1f}x verbs, a known miss held to {own:g}x")
            if x > own:
                fails.append(f"{where}: {x:.1f}x slower than verbs (a known miss, limit {own:g}x)")
            continue
        if worst is None or x > worst[0]:
            worst = (x, where)
        if x > limit:
            fails.append(f"{where}: {x:.1f}x slower than verbs (limit {limit:g}x)")
    return fails, worst, misses


def plot(med, na, paths, out, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    sizes = sorted({k[2] for k in list(med) + list(na)})
    fig, axes = plt.subplots(2, 2, figsize=(13, 9), sharex=True)
    for col, test in enumerate(("send_lat", "send_bw")):
        top, bottom = axes[0][col], axes[1][col]
        for p in paths:
            pts = sorted((s, v) for (t, q, s), v in med.items() if t == test and q == p)
            if pts:
                xs, ys = zip(*pts)
                top.plot(xs, ys, marker="o", markersize=3, label=NAMES[p], color=COLORS[p])
            if p == "verbs":
                continue
            ratio = []
            for s, v in pts:
                x = slowdown(test, v, med.get((test, "verbs", s)))
                if x is not None:
                    ratio.append((s, x))
            if ratio:
                xs, ys = zip(*ratio)
                bottom.plot(
                    xs, ys, marker="o", markersize=3, label=f"{NAMES[p]} ÷ verbs", color=COLORS[p]
                )
            for (t, q, s) in na:
                if t == test and q == p:
                    bottom.plot([s], [1], marker="x", color=COLORS[p], linestyle="none")
        bottom.axhline(1, color="black", linewidth=0.8)
        bottom.axhline(3, color="red", linewidth=0.8, linestyle="--", label="3× (the CI guard's limit)")
        top.set_title(
            "send_lat: typical one-way latency [usec]" if test == "send_lat"
            else "send_bw: average bandwidth [MB/s]"
        )
        bottom.set_title("slowdown against verbs (above 1: slower; x: n/a)")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(sizes, [size_name(x) for x in sizes], rotation=45)
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        bottom.set_xlabel("message size [bytes]")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(f"perf-sweep: wrote {out}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--plot", metavar="PNG")
    ap.add_argument("--title", default="verbio-perf: every path")
    ap.add_argument("--guard", type=float, metavar="X")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--stat", choices=["median", "best"], default="median")
    ap.add_argument("--known", action="append", default=[], metavar="PATH:TEST:SIZE=Y")
    args = ap.parse_args()

    med, na = load(args.dir, args.stat)
    if not med and not na:
        sys.exit(f"perf-sweep: no results in {args.dir}")
    seen = {k[1] for k in list(med) + list(na)}
    paths = [p for p in PATHS if p in seen]
    info = os.path.join(args.dir, "run.txt")
    if os.path.exists(info):
        with open(info, encoding="utf-8") as f:
            print(f.read().rstrip())
    print(f"figure per path and size: the {args.stat} of the rounds")
    print(tables(med, na, paths, False))
    if args.markdown:
        print(tables(med, na, paths, True))
    if args.plot:
        plot(med, na, paths, args.plot, args.title)
    if args.guard is not None:
        known = dict(parse_known(k) for k in args.known)
        fails, worst, misses = guard(med, na, paths, args.guard, known)
        if worst:
            print(f"\nperf-sweep guard: worst {worst[1]}: {worst[0]:.2f}x verbs")
        for m in misses:
            print(f"perf-sweep guard: KNOWN MISS {m}")
        if fails:
            print(f"perf-sweep guard: FAIL ({len(fails)}):")
            for f in fails:
                print(f"  {f}")
            sys.exit(1)
        if misses:
            print(f"perf-sweep guard: PASS (Rdma and RPC within {args.guard:g}x verbs everywhere but the {len(misses)} known miss(es) above)")
        else:
            print(f"perf-sweep guard: PASS (Rdma and RPC within {args.guard:g}x verbs everywhere)")


if __name__ == "__main__":
    main()
