#!/usr/bin/env python3
"""Checks that verbio-runtime's modules depend on each other one way only.

Every `crate::<module>` path in runtime/src (tests excluded: `*tests.rs`,
`tests/` folders and `#[cfg(test)]` modules at the end of a file) makes an
edge from the file's top-level module to <module>. The script fails if the
graph has a cycle, or if an edge points up the declared layer order.
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent / "runtime" / "src"
# Lowest first. A module may only use modules listed before it (or itself).
LAYERS = ["report", "accept_error", "provider", "buf", "wake", "op", "reactor", "compat", "qp", "device", "cm", "pool", "testing"]
CRATE_PATH = re.compile(r"\bcrate::([A-Za-z_]+)")


def top_module(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0].removesuffix(".rs")


def strip_tests(text: str) -> str:
    # Drop a trailing `#[cfg(test)] mod ... { ... }` block and comments.
    cut = re.search(r"^#\[cfg\(test\)\]\s*\nmod \w+ \{", text, re.M)
    if cut:
        text = text[: cut.start()]
    return "\n".join(l for l in text.splitlines() if not l.lstrip().startswith("//"))


def main() -> int:
    edges: dict[str, set[str]] = {}
    bad_roots: list[str] = []
    where: dict[tuple[str, str], str] = {}
    for path in sorted(ROOT.rglob("*.rs")):
        if path.name == "lib.rs" or path.name.endswith("tests.rs") or "tests" in path.parts:
            continue
        src = top_module(path)
        for dst in CRATE_PATH.findall(strip_tests(path.read_text())):
            if dst[0].isupper():
                bad_roots.append(f"{path.relative_to(ROOT)}: crate::{dst} hides its module: use its module path")
                continue
            if dst != src:
                edges.setdefault(src, set()).add(dst)
                where.setdefault((src, dst), str(path.relative_to(ROOT)))
    bad = list(bad_roots)
    for src, dsts in sorted(edges.items()):
        for dst in sorted(dsts):
            if src not in LAYERS or dst not in LAYERS:
                bad.append(f"{src} -> {dst}: module not in the layer list ({where[(src, dst)]})")
            elif LAYERS.index(dst) > LAYERS.index(src):
                bad.append(f"{src} -> {dst}: points up the layers ({where[(src, dst)]})")
    # A cycle implies an upward edge, but report cycles explicitly too.
    state: dict[str, int] = {}

    def visit(n: str, stack: list[str]) -> None:
        state[n] = 1
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                bad.append("cycle: " + " -> ".join(stack[stack.index(m):] + [m]) if m in stack else f"cycle via {m}")
            elif m not in state:
                visit(m, stack + [m])
        state[n] = 2

    for n in sorted(edges):
        if n not in state:
            visit(n, [n])
    print("layers (lowest first):", " -> ".join(LAYERS))
    for src, dsts in sorted(edges.items(), key=lambda e: LAYERS.index(e[0]) if e[0] in LAYERS else 99):
        print(f"  {src}: uses {', '.join(sorted(dsts))}")
    if bad:
        print("layering violations:")
        for b in bad:
            print("  " + b)
        return 1
    print("ok: no cycles, every edge points down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
