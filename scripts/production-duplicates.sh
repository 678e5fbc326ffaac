#!/bin/bash
# production-duplicates.sh -- the pairs of places that share six or more
# lines (the `duplicates` command of the tool library) among production
# code only, at a git revision: the .rs files of runtime/src, ops/src,
# tonic/src and src, less test code (`*_tests.rs`, `tests.rs`, `tests/`
# folders, files of modules declared `#[cfg(test)] mod name;`, and inline
# `#[cfg(test)] mod name { ... }` blocks, cut to their closing brace at
# column 0).
#
#   scripts/production-duplicates.sh [REV] [MOST]
#
# REV defaults to HEAD, MOST (rows listed, 1-200) to 200. The first line
# of the output counts the pairs.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
REV=${1:-HEAD}
MOST=${2:-200}
command -v duplicates >/dev/null || { echo "production-duplicates: needs the duplicates command" >&2; exit 2; }
TREE=$(mktemp -d)
trap 'rm -rf "$TREE"' EXIT
git -C "$ROOT" archive "$REV" runtime/src ops/src tonic/src src | tar -x -C "$TREE"
python3 - "$TREE" <<'PY'
import pathlib
import re
import sys

root = pathlib.Path(sys.argv[1])
files = list(root.rglob("*.rs"))
test_mods = set()
for p in files:
    here = p.parent if p.name in ("mod.rs", "lib.rs", "main.rs") else p.with_suffix("")
    for name in re.findall(r"^#\[cfg\(test\)\]\s*\n\s*(?:pub(?:\(\w+\))? )?mod (\w+);", p.read_text(), re.M):
        test_mods |= {here / f"{name}.rs", here / name / "mod.rs"}
for p in files:
    rel = str(p.relative_to(root))
    if re.search(r"(_tests|/tests)\.rs$", rel) or "/tests/" in rel or p in test_mods:
        p.unlink()
        continue
    lines = p.read_text().split("\n")
    out = []
    i = 0
    while i < len(lines):
        if lines[i].strip() == "#[cfg(test)]":
            j = i + 1
            while j < len(lines) and lines[j].strip().startswith("#["):
                j += 1
            if j < len(lines) and re.match(r"^(pub(\(\w+\))? )?mod \w+ \{$", lines[j]):
                k = j + 1
                while k < len(lines) and lines[k] != "}":
                    k += 1
                i = k + 1
                continue
        out.append(lines[i])
        i += 1
    p.write_text("\n".join(out))
PY
cd "$TREE" && duplicates --most "$MOST" --seconds 120
