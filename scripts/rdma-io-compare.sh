#!/bin/bash
# rdma-io-compare.sh -- verbio's Send handles against the rdma-io crate in
# the rxe VM: a 64 B echo under tokio's multi-thread runtime, both in one
# process and one VM boot (compare/rdma-io-echo), medians, p99s and their
# ratios to rdma-io's (below 1: verbio is faster).
#
#   scripts/rdma-io-compare.sh [--grpc] [--sizes LIST] [-- ECHO_ARGS...]
#
# ECHO_ARGS go to rdma-io-echo (default: --size 64 --iters 2000 --rounds 5;
# --ip is the guest's rxe address). --sizes 64,4K,64K,1M runs the echo at
# each size in the same boot (K and M: KiB and MiB) and ends with a table
# per size of verbio's own-thread `Rdma` and handle medians and p99s
# against rdma-io's (ratios below 1: verbio is faster). --grpc also runs verbio-tonic's
# examples/grpc_echo (release, ibverbs) with --tcp in the same boot: gRPC
# over verbio on rxe0 against tonic over the guest's kernel TCP.
#
# Builds on the host (release, features ibverbs): rdma-io links libibverbs
# and librdmacm, so the host needs Debian's libibverbs-dev and
# librdmacm-dev (installed here when missing), and the crates.io registry
# for rdma-io. Output: target/rdma-io-compare/out.txt.
#
# --ab A,B[,...] runs prebuilt rdma-io-echo binaries instead of building one
# (e.g. main's and a branch's, each built with this script or
# `cargo build --release --manifest-path compare/rdma-io-echo/Cargo.toml`
# and copied aside), alternating A, B, ... per run in the same boot,
# --ab-runs times (default 3): an A/B of two builds on the same host load.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
. "$ROOT/scripts/lib/rxe-host.sh"
GRPC=0
SIZES=
AB=
AB_RUNS=3
ECHO_ARGS=()
while [ $# -gt 0 ]; do
    case $1 in
        --grpc) GRPC=1 ;;
        --sizes) SIZES=${2:?--sizes needs a list}; shift ;;
        --ab) AB=${2:?--ab needs a list of binaries}; shift ;;
        --ab-runs) AB_RUNS=${2:?--ab-runs needs a count}; shift ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        --) shift; ECHO_ARGS=("$@"); break ;;
        *) echo "rdma-io-compare: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
VM=$(rxe_vm_script)
[ -x "$VM" ] || { echo "SKIPPED: rxe VM script not found ($VM)"; exit 0; }
if [ ! -e /usr/include/infiniband/verbs.h ] || [ ! -e /usr/include/rdma/rdma_cma.h ]; then
    echo "rdma-io-compare: installing libibverbs-dev and librdmacm-dev (rdma-io builds against them)" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs-dev librdmacm-dev >&2 \
        || { echo "rdma-io-compare: could not install them" >&2; exit 1; }
fi
DIR=$ROOT/target/rdma-io-compare
mkdir -p "$DIR"
TD=${CARGO_TARGET_DIR:-$ROOT/target}
AB_BINS=
if [ -n "$AB" ]; then
    i=0
    for b in $(echo "$AB" | tr ',' ' '); do
        [ -x "$b" ] || { echo "rdma-io-compare: --ab: $b is not executable" >&2; exit 2; }
        # The guest sees this checkout read-write (and the host's root
        # read-only): copied here under a name of its own.
        i=$((i + 1))
        cp "$b" "$DIR/rdma-io-echo.ab$i" || exit 1
        AB_BINS="$AB_BINS $DIR/rdma-io-echo.ab$i"
        echo "rdma-io-compare: ab$i is $b" >&2
    done
else
    # A target directory copied from another checkout keeps that
    # checkout's paths in the verbio crates' dep-info (this crate is a
    # workspace of its own with verbio outside it, so they are absolute),
    # and cargo would take those builds as fresh: rebuild them.
    if ls "$TD"/compare/release/deps/verbio_ops-*.d >/dev/null 2>&1 \
        && ! grep -qs " $ROOT/ops/src/lib.rs" "$TD"/compare/release/deps/verbio_ops-*.d; then
        echo "rdma-io-compare: verbio's build in $TD/compare is another checkout's: rebuilding it" >&2
        rm -rf "$TD"/compare/release/.fingerprint/verbio-*
    fi
    echo "rdma-io-compare: building compare/rdma-io-echo (release)" >&2
    CARGO_TARGET_DIR=$TD/compare cargo build -q --release \
        --manifest-path compare/rdma-io-echo/Cargo.toml || exit 1
    # The guest sees only this checkout (and the host's root read-only).
    cp "$TD/compare/release/rdma-io-echo" "$DIR/rdma-io-echo"
fi
if [ "$GRPC" = 1 ]; then
    echo "rdma-io-compare: building verbio-tonic's examples/grpc_echo (release, ibverbs)" >&2
    cargo build -q --release -p verbio-tonic --example grpc_echo --features ibverbs || exit 1
    cp "$TD/release/examples/grpc_echo" "$DIR/grpc_echo"
fi
GUEST=$DIR/guest.sh
{
    echo '#!/bin/sh'
    # (printf with no argument would still print one empty one.)
    printf 'set --'
    [ ${#ECHO_ARGS[@]} = 0 ] || printf " '%s'" "${ECHO_ARGS[@]}"
    echo
    echo "GRPC=$GRPC DIR='$DIR' SIZES='$SIZES' AB_BINS='$AB_BINS' AB_RUNS='$AB_RUNS'"
    cat <<'GUEST'
export VERBIO_DEVICE=${RXE_DEV:-rxe0} VERBIO_GID_INDEX=${RXE_GID_INDEX:-1}
echo "== guest: $(uname -r), $(nproc) CPUs, device $VERBIO_DEVICE, RDMA CM on ${RXE_IP:-10.77.0.1}"
rc=0
if [ -n "$AB_BINS" ]; then
    r=1
    while [ "$r" -le "$AB_RUNS" ]; do
        for b in $AB_BINS; do
            echo "== run $r: ${b##*/} $*"
            timeout 600 "$b" --ip "${RXE_IP:-10.77.0.1}" "$@" 2>&1 | grep -v ' INFO ' || rc=1
        done
        r=$((r + 1))
    done
elif [ -z "$SIZES" ]; then
    echo "== rdma-io-echo $*"
    timeout 600 "$DIR/rdma-io-echo" --ip "${RXE_IP:-10.77.0.1}" "$@" 2>&1 | grep -v ' INFO '
    rc=$?
else
    for s in $(echo "$SIZES" | tr ',' ' '); do
        n=$(( $(echo "$s" | sed -e 's/[Kk]$/*1024/' -e 's/[Mm]$/*1048576/') ))
        echo "== rdma-io-echo --size $n $*"
        timeout 900 "$DIR/rdma-io-echo" --ip "${RXE_IP:-10.77.0.1}" --size "$n" "$@" 2>&1 \
            | grep -v ' INFO ' | tee "/tmp/echo_$n.txt" || rc=1
    done
    echo "== per size: median and p99 (µs), ratio to rdma-io as shipped (below 1: verbio faster)"
    printf '%-9s %-44s %10s %10s %9s %9s\n' size contender median p99 med/rio p99/rio
    for s in $(echo "$SIZES" | tr ',' ' '); do
        n=$(( $(echo "$s" | sed -e 's/[Kk]$/*1024/' -e 's/[Mm]$/*1048576/') ))
        awk -v size="$s" '/^(verbio|rdma-io)/ && NF >= 6 {
            name = $0; sub(/ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+× +[0-9.]+×$/, "", name)
            printf "%-9s %-44s %10s %10s %9s %9s\n", size, name, $(NF-4), $(NF-3), $(NF-1), $NF
        }' "/tmp/echo_$n.txt"
        # (The pipe above gives tee's status: a failed echo shows here.)
        grep -q '^rdma-io' "/tmp/echo_$n.txt" \
            || { printf '%-9s n/a: %s\n' "$s" "$(tail -1 "/tmp/echo_$n.txt")"; rc=1; }
    done
fi
if [ "$GRPC" = 1 ]; then
    echo "== grpc_echo --tcp on $VERBIO_DEVICE (tonic over verbio vs tonic over the guest's kernel TCP)"
    timeout 900 "$DIR/grpc_echo" --tcp --calls 400 --payloads 32 --stream-mib 8 \
        --chunks 1048576 --workers 2 --timeout 300 2>&1 | grep -v ' INFO ' || rc=1
fi
exit $rc
GUEST
} > "$GUEST"
chmod +x "$GUEST"
"$VM" -- "$GUEST" | tee "$DIR/out.txt"
rc=${PIPESTATUS[0]}
[ "$rc" = 0 ] || echo "rdma-io-compare: the VM run failed (exit $rc)" >&2
exit "$rc"
