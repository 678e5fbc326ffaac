#!/usr/bin/env python3
"""callgrind-per-rt.py -- instructions per iteration, per function, from two
callgrind runs of the same program at different iteration counts.

    scripts/callgrind-per-rt.py [--match REGEX] SHORT.out LONG.out ITERATIONS [TOP]

ITERATIONS is the difference of the two runs' iteration counts; start-up and
tear-down cancel out. Prints the total and the TOP (default 25) functions by
self cost per iteration, with their calls per iteration. With --match, also
the total of the functions whose name matches REGEX (Python syntax). Used by
`scripts/rxe-test.sh --callgrind` (files in target/rxe-test/logs) and
`scripts/api-instructions.sh`.
"""
import collections
import re
import sys


def parse(path):
    """Self cost and call count per function name (name compression resolved)."""
    names = {}
    self_cost = collections.Counter()
    calls = collections.Counter()
    fn = cfn = None
    pending = None

    def name(rest):
        m = re.match(r"\((\d+)\)(?: (.*))?", rest)
        if not m:
            return rest
        if m.group(2):
            names[m.group(1)] = m.group(2)
        return names.get(m.group(1), m.group(1))

    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            if line.startswith("fn="):
                fn = name(line[3:])
            elif line.startswith("cfn="):
                cfn = name(line[4:])
            elif line.startswith("calls="):
                pending = int(line[6:].split()[0])
            elif line and (line[0].isdigit() or line[0] in "+-*"):
                parts = line.split()
                cost = int(parts[1]) if len(parts) > 1 else 0
                if pending is not None:
                    calls[cfn] += pending  # the next line is the call's inclusive cost
                    pending = None
                else:
                    self_cost[fn] += cost
    return self_cost, calls


def main():
    args = sys.argv[1:]
    match = None
    if len(args) >= 2 and args[0] == "--match":
        match = re.compile(args[1])
        args = args[2:]
    if len(args) < 3:
        sys.exit(__doc__)
    short, long_, n = args[0], args[1], float(args[2])
    top = int(args[3]) if len(args) > 3 else 25
    (sa, ca), (sb, cb) = parse(short), parse(long_)
    rows = sorted(
        (((sb[f] - sa[f]) / n, (cb[f] - ca[f]) / n, f) for f in set(sa) | set(sb)),
        reverse=True,
    )
    print(f"{sum(r[0] for r in rows):9.0f} instructions per iteration")
    if match:
        matched = sum(r[0] for r in rows if match.search(r[2]))
        print(f"{matched:9.0f} of them in functions matching {match.pattern}")
    for cost, c, f in rows[:top]:
        print(f"{cost:9.1f} {c:6.2f} calls  {f[:110]}")


if __name__ == "__main__":
    main()
