#!/usr/bin/env python3
"""Checks that verbio-runtime's modules depend on each other one way only.

Every `crate::<module>` path in runtime/src (tests excluded: `*tests.rs`,
`tests/` folders and `#[cfg(test)]` modules at the end of a file) makes an
edge from the file's top-level module to <module>. The script fails if the
graph has a cycle, or if an edge points up the declared layer order.

A second rule keeps provider identity below the provider contract: no code
above `provider/` (runtime/src outside provider/, and ops/src; tests
excluded as above) names a concrete provider (the soft device, libibverbs or
the test fake: their modules, `ProviderKind::Soft`/`Ibverbs`, `as_soft`,
`as_ibverbs`, `open_soft`, `SoftConfig`), except in the places listed in
CHOOSERS, each with the reason it must. Above the contract the layers test
capability flags (`ProviderCaps`) and carry provider addresses
(`ProviderAddr`) instead.

A third rule keeps verbio-ops' RPC folder (ops/src/rpc) one way: each file
(a folder listed whole counts as one) uses only those before it in
RPC_LAYERS, through `super::`, `self::`, a child module's name or
`crate::rpc::` paths, and none names an item by the folder's re-export
(`crate::rpc::Name`), which hides the module it comes from.
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent / "runtime" / "src"
# Lowest first. A module may only use modules listed before it (or itself).
LAYERS = ["report", "accept_error", "provider", "buf", "wake", "op", "reactor", "compat", "qp", "device", "cm", "pool", "testing"]
CRATE_PATH = re.compile(r"\bcrate::([A-Za-z_]+)")

OPS = ROOT.parent.parent / "ops" / "src"
# What names a concrete provider in code (string literals are not code).
PROVIDER_NAME = re.compile(
    r"\b(?:soft|ibverbs)::|\bprovider::fake\b|\bProviderKind::(?:Soft|Ibverbs)\b"
    r"|\b(?:as_soft|as_ibverbs|open_soft)\b|\bSoftConfig\b"
)
STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
# The places above provider/ that must choose a provider, and why: a path
# (ending in "/": the folder) and the reason, or a path, the one line
# pattern allowed there, and the reason.
CHOOSERS = {
    "runtime/src/cm/backend.rs": "registration: picks the connection manager backend of the device's provider (for_device)",
    "runtime/src/cm/mod.rs": (r"^pub use soft::fuzz_check::", "re-exports the soft CM frame's fuzz check (feature fuzzing)"),
    "runtime/src/cm/soft/": "the software device's connection manager backend (TCP, its own frame)",
    "runtime/src/cm/ibverbs.rs": "the RDMA CM backend (librdmacm), which only a libibverbs device has",
    "runtime/src/testing.rs": "test doubles (feature test-util): the fake provider's QP is what it offers",
    "ops/src/fuzz_checks/": "fuzz targets (feature fuzzing): reach the soft device's private codecs, build seed endpoints of each provider",
}


RPC = OPS / "rpc"
# Lowest first; "engine/x" is ops/src/rpc/engine/x.rs, "engine" its mod.rs,
# "mem" the whole mem/ folder. A file may only use files listed before it.
RPC_LAYERS = [
    "waker", "header", "transport", "error", "addr", "budget", "buf", "rtt", "session", "config",
    "id_map", "table", "request", "runner", "mem", "ud_bulk", "ud",
    "engine", "engine/packets", "engine/call_end", "engine/write_format", "engine/release",
    "engine/paths", "engine/receive", "engine/sessions", "engine/idle", "engine/admission",
    "engine/links", "engine/link_send", "engine/client_calls", "engine/client_answers",
    "engine/server_requests", "engine/handlers", "engine/read_path", "engine/bulk_completions",
    "engine/written_responses", "engine/written_requests", "engine/resend",
    "dispatcher", "call", "endpoint",
]
RPC_WHOLE = {"mem"}
RPC_PATH = re.compile(r"\b((?:super::)+|self::|crate::rpc::)((?:[a-z_][a-z0-9_]*::)*)([A-Za-z_][A-Za-z0-9_]*)")


def rpc_module(parts: list[str]) -> str | None:
    """The RPC_LAYERS unit of module path `parts` (below ops/src/rpc)."""
    if parts and parts[0] in RPC_WHOLE:
        return parts[0]
    return "/".join(parts) if parts else None


def rpc_resolve(base: list[str], path: list[str]) -> list[str]:
    """The longest module path `base + path[..k]` that is a file or folder."""
    found = list(base)
    for name in path:
        cand = found + [name]
        if (RPC / ("/".join(cand) + ".rs")).exists() or (RPC / "/".join(cand) / "mod.rs").exists():
            found = cand
        else:
            break
    return found


def rpc_order() -> list[str]:
    """Edges of ops/src/rpc that point up RPC_LAYERS (tests excluded)."""
    bad = []
    tests = test_module_files(RPC)
    for path in sorted(RPC.rglob("*.rs")):
        if is_test(path, RPC) or path in tests or path == RPC / "mod.rs":
            continue
        rel = path.relative_to(RPC).with_suffix("")
        parts = list(rel.parts)
        is_dir_mod = parts[-1] == "mod"
        here = parts[:-1] if is_dir_mod else parts
        src = rpc_module(here)
        code = strip_tests(path.read_text())
        children = re.findall(r"^(?:pub(?:\([a-z]+\))? )?mod (\w+);", code, re.M) if is_dir_mod else []
        refs = []
        for lead, mids, last in RPC_PATH.findall(code):
            mods = [m for m in mids.split("::") if m]
            if lead == "crate::rpc::":
                base = []
            elif lead == "self::":
                base = here
            else:
                base = here[: max(0, len(here) - lead.count("super"))]
            target = rpc_resolve(base, mods + [last])
            if not target and last[0].isupper():
                bad.append(f"rpc/{rel}.rs: {lead}{mids}{last} hides its module: use its module path")
                continue
            refs.append(target)
        for child in children:
            if re.search(rf"(?<![:\w]){child}::", code):
                refs.append(here + [child])
        for target in refs:
            dst = rpc_module(target)
            if dst is None or dst == src or (src in RPC_WHOLE and dst == src):
                continue
            if src not in RPC_LAYERS or dst not in RPC_LAYERS:
                bad.append(f"rpc: {src} -> {dst}: file not in RPC_LAYERS (rpc/{rel}.rs)")
            elif RPC_LAYERS.index(dst) > RPC_LAYERS.index(src):
                bad.append(f"rpc: {src} -> {dst}: points up RPC_LAYERS (rpc/{rel}.rs)")
    return sorted(set(bad))


def top_module(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0].removesuffix(".rs")


def strip_tests(text: str) -> str:
    # Drop a trailing `#[cfg(test)] mod ... { ... }` block and comments.
    cut = re.search(r"^#\[cfg\(test\)\]\s*\nmod \w+ \{", text, re.M)
    if cut:
        text = text[: cut.start()]
    return "\n".join(l for l in text.splitlines() if not l.lstrip().startswith("//"))


def is_test(path: pathlib.Path, root: pathlib.Path) -> bool:
    rel = path.relative_to(root)
    return path.name.endswith("tests.rs") or "tests" in rel.parts


TEST_MOD = re.compile(r"^#\[cfg\(test\)\]\s*\n\s*mod (\w+);", re.M)


def test_module_files(root: pathlib.Path) -> set[pathlib.Path]:
    """Files of modules declared `#[cfg(test)] mod name;`."""
    found = set()
    for path in root.rglob("*.rs"):
        here = path.parent if path.name in ("mod.rs", "lib.rs") else path.with_suffix("")
        for name in TEST_MOD.findall(path.read_text()):
            found |= {here / f"{name}.rs", here / name / "mod.rs"}
    return found


def provider_names() -> list[str]:
    """Code above provider/ that names a concrete provider, outside CHOOSERS."""
    bad = []
    used = set()
    repo = ROOT.parent.parent
    for root in (ROOT, OPS):
        tests = test_module_files(root)
        for path in sorted(root.rglob("*.rs")):
            rel = str(path.relative_to(repo))
            if is_test(path, root) or path in tests or rel.startswith("runtime/src/provider/"):
                continue
            chooser = next((c for c in CHOOSERS if rel == c or (c.endswith("/") and rel.startswith(c))), None)
            code = STRING.sub('""', strip_tests(path.read_text()))
            for n, line in enumerate(code.splitlines(), 1):
                m = PROVIDER_NAME.search(line)
                if not m:
                    continue
                only = CHOOSERS[chooser][0] if chooser and isinstance(CHOOSERS[chooser], tuple) else None
                if chooser and (only is None or re.search(only, line)):
                    used.add(chooser)
                else:
                    bad.append(f"{rel}: names a provider ({m.group(0)}) above provider/: test ProviderCaps or carry a ProviderAddr instead, or list it in CHOOSERS with a reason")
    for c in CHOOSERS:
        if c not in used:
            bad.append(f"CHOOSERS lists {c}, which names no provider any more: remove it")
    return bad


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
    bad = list(bad_roots) + provider_names() + rpc_order()
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
    print(f"provider names above provider/ only in: {', '.join(sorted(CHOOSERS))}")
    print("ok: no cycles, every edge points down, no provider named above the contract, ops/src/rpc one way")
    return 0


if __name__ == "__main__":
    sys.exit(main())
