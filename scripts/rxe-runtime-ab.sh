#!/usr/bin/env bash
# rxe-runtime-ab.sh -- the runtime's send_lat on rxe with the measuring loop
# held fixed: the `examples/perf.rs` of an older revision (the benchmark
# before `verbio-perf`) built twice, unchanged, against that revision's
# runtime and against this tree's, then run side by side with perftest
# in one VM boot by rxe-lat-ab.sh.
#
#   scripts/rxe-runtime-ab.sh [--rev REV] [--rounds N] [--iters N] [NAME=BINARY[:FLAGS] ...]
#
# --rev       the revision whose example and runtime are the reference
#             (default 42ef8b1, the build before the layering work; it
#             must have examples/perf.rs)
# NAME=...    further builds for rxe-lat-ab.sh (e.g. this tree's
#             verbio-perf, built with `--features ibverbs`)
#
# Each copy of the example is a standalone package under
# target/rxe-runtime-ab/ (its own workspace, the `verbio` dependency by
# path with that tree's Cargo.lock; REV's tree is a `git archive` there),
# so this tree is not modified. The old example takes `--server ADDR` /
# `--client ADDR` and the device from VERBIO_DEVICE; a generated shim
# maps rxe-lat-ab's verbio-perf flags (`send_lat [HOST] -d DEV -x GID
# -p PORT -s SIZE -n ITERS`) onto it.
# Prints rxe-lat-ab's table; per-round ratios of two builds from its log
# (target/rxe-lat-ab/runs.txt) are the comparison.
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
REV=42ef8b1
AB_ARGS=()
EXTRA=()
while [ $# -gt 0 ]; do
    case $1 in
        --rev) REV=$2; shift ;;
        --rounds | --iters) AB_ARGS+=("$1" "$2"); shift ;;
        -h | --help) sed -n '2,24p' "$0"; exit 0 ;;
        -*) echo "rxe-runtime-ab: unknown option $1" >&2; exit 2 ;;
        *=*) EXTRA+=("$1") ;;
        *) echo "rxe-runtime-ab: expected NAME=BINARY[:FLAGS], got $1" >&2; exit 2 ;;
    esac
    shift
done

DIR=$ROOT/target/rxe-runtime-ab
mkdir -p "$DIR"
SRC=$DIR/perf-$REV.rs
git -C "$ROOT" show "$REV:examples/perf.rs" > "$SRC" ||
    { echo "rxe-runtime-ab: $REV has no examples/perf.rs" >&2; exit 2; }
OLD_TREE=$DIR/tree-$REV
if [ ! -d "$OLD_TREE" ]; then
    # Extracted aside, then renamed: an interrupted extraction is not reused.
    rm -rf "$OLD_TREE.part"
    mkdir -p "$OLD_TREE.part"
    git -C "$ROOT" archive "$REV" | tar -x -C "$OLD_TREE.part"
    mv "$OLD_TREE.part" "$OLD_TREE"
fi

# package NAME TREE: builds the example against the verbio of TREE (with
# TREE's Cargo.lock); prints the binary's path.
package() {
    local pkg=$DIR/pkg-$1
    mkdir -p "$pkg/src"
    cp "$SRC" "$pkg/src/main.rs"
    cp "$2/Cargo.lock" "$pkg/Cargo.lock"
    cat > "$pkg/Cargo.toml" <<EOF
[package]
name = "perf-example"
version = "0.0.0"
edition = "2021"
publish = false

[dependencies]
verbio = { path = "$2", features = ["ibverbs"] }
futures = "0.3"

[profile.release]
debug = "line-tables-only"

[workspace]
EOF
    cargo build --quiet --release --manifest-path "$pkg/Cargo.toml" \
        --target-dir "$DIR/target-$1" >&2
    echo "$DIR/target-$1/release/perf-example"
}

# shim NAME BINARY: a verbio-perf-style command line for the old example.
shim() {
    local s=$DIR/shim-$1.sh
    cat > "$s" <<EOF
#!/bin/sh
test=\$1; shift
host=
case \${1:-} in -*) ;; *) host=\$1; shift ;; esac
port=18516 size=64 iters=1000 extra=
while [ \$# -gt 0 ]; do
    case \$1 in
        -p) port=\$2; shift 2 ;;
        -s) size=\$2; shift 2 ;;
        -n) iters=\$2; shift 2 ;;
        -d) export VERBIO_DEVICE=\$2; shift 2 ;;
        -x) export VERBIO_GID_INDEX=\$2; shift 2 ;;
        *) extra="\$extra \$1"; shift ;;
    esac
done
if [ -n "\$host" ]; then side="--client \$host:\$port"; else side="--server 0.0.0.0:\$port"; fi
# shellcheck disable=SC2086 # words
exec "$2" "\$test" \$side -s "\$size" -n "\$iters" \$extra
EOF
    chmod +x "$s"
    echo "$s"
}

old=$(package "$REV" "$OLD_TREE")
new=$(package this "$ROOT")
exec "$ROOT/scripts/rxe-lat-ab.sh" "${AB_ARGS[@]}" \
    "example-$REV=$(shim "$REV" "$old")" \
    "example-this=$(shim this "$new")" "${EXTRA[@]}"
