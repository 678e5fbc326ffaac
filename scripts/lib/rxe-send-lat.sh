# rxe-send-lat.sh -- guest-side helpers (POSIX sh) for the rxe VM scripts
# that time send_lat (rxe-lat-ab.sh, rxe-size-sweep.sh): sourced by the
# script they generate, from the repository's root, with N set to the
# iteration count.

# verbio_lat LABEL BINARY SIZE [FLAGS...]: one verbio-perf send_lat between
# two processes on rxe0 (both given FLAGS, as perftest's sides take the
# same flags); prints LABEL and the typical one-way latency.
verbio_lat() {
    label=$1 bin=$2 size=$3
    shift 3
    timeout 120 "$bin" send_lat -d rxe0 -x 1 -p 18516 -s "$size" -n "$N" "$@" >/dev/null 2>&1 &
    srv=$!
    t=$(timeout 120 "$bin" send_lat 127.0.0.1 -d rxe0 -x 1 -p 18516 -s "$size" -n "$N" "$@" 2>&1 |
        awk -v s="$size" '$1 == s { print $5 }')
    wait $srv
    echo "$label ${t:-n/a}"
}

# perftest_lat LABEL SIZE: one ib_send_lat between two processes on rxe0.
perftest_lat() {
    label=$1 size=$2
    ib_send_lat -d rxe0 -x 1 -s "$size" -n "$N" >/dev/null 2>&1 &
    srv=$!
    w=0
    while [ $w -lt 100 ] && ! ss -ltn 2>/dev/null | grep -q ':18515 '; do
        sleep 0.1
        w=$((w + 1))
    done
    t=$(timeout 120 ib_send_lat -d rxe0 -x 1 -s "$size" -n "$N" 127.0.0.1 2>&1 |
        awk -v s="$size" '$1 == s { print $5 }')
    wait $srv
    echo "$label ${t:-n/a}"
}

# rounds R SPEC...: R rounds, each passing every SPEC once to the caller's
# `run_spec`, in an order rotated round by round (in this VM a run right
# after another binary's is often slower; the rotation spreads that).
rounds() {
    total=$1
    shift
    n=$#
    r=1
    while [ $r -le "$total" ]; do
        i=0
        while [ $i -lt $n ]; do
            k=$(( (i + r) % n + 1 ))
            eval "spec=\${$k}"
            run_spec "$spec"
            i=$((i + 1))
        done
        r=$((r + 1))
    done
}
