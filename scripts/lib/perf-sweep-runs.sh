# perf-sweep-runs.sh -- the runs of scripts/perf-sweep.sh (bash), on this
# host or inside the rxe VM: sourced, then `sweep_runs` called with these
# variables set:
#   BIN     a verbio-perf binary       DEV    device (soft0, rxe0)
#   GIDX    GID index or empty         OUT    directory for the results
#   SIZES   byte counts, comma-separated
#   PATHS   of verbs,rdma,rpc,tcp      TESTS  of send_lat,send_bw
#   DUR     seconds per run (-D)       WINDOW messages in flight (send_bw)
#   ROUNDS  rounds                     LIMIT  seconds before a run is killed
#   RDMA_FLAGS  more flags of the verbs, rdma and rpc runs (split on spaces)
#   SRV_PIN CLI_PIN  commands the server and client run under (empty, or
#               `taskset -c N` as `sweep_placement` sets them)
# Per size and test, each path's server and client run as two processes,
# the paths in an order rotated from size to size and round to round (so
# that the host's drift spreads over all of them). Each run leaves
# OUT/TEST_PATH_SIZE_rROUND.json (the client's --json), or .na with the
# reason it could not run (the client's last error line, or the timeout).

# sweep_port: the next TCP port of the runs (a fresh one per run: a
# server that is still closing holds its port for a moment), from 300
# starting at PERF_SWEEP_PORT (default 18700).
SWEEP_BASE=${PERF_SWEEP_PORT:-18700}
SWEEP_PORT=$SWEEP_BASE
sweep_port() {
    SWEEP_PORT=$(( SWEEP_PORT >= SWEEP_BASE + 299 ? SWEEP_BASE : SWEEP_PORT + 1 ))
}

# sweep_placement free|same|split: sets SRV_PIN and CLI_PIN: nothing; both
# processes on the first CPU this script may use; the server on it and the
# client on the second. False (SWEEP_PLACEMENT_ERR says why) if there are
# not enough CPUs or no taskset.
sweep_placement() {
    SRV_PIN= CLI_PIN=
    [ "$1" = free ] && return 0
    if ! command -v taskset >/dev/null; then
        SWEEP_PLACEMENT_ERR="taskset (util-linux) is not installed"
        return 1
    fi
    local list cpus=() part c
    list=$(taskset -pc $$ | sed 's/.*: *//')
    for part in ${list//,/ }; do
        case $part in
            *-*) for ((c = ${part%-*}; c <= ${part#*-}; c++)); do cpus+=("$c"); done ;;
            *) cpus+=("$part") ;;
        esac
    done
    if [ "$1" = split ] && [ ${#cpus[@]} -lt 2 ]; then
        SWEEP_PLACEMENT_ERR="needs two CPUs (this process may use $list)"
        return 1
    fi
    SRV_PIN="taskset -c ${cpus[0]}"
    CLI_PIN="taskset -c ${cpus[0]}"
    [ "$1" = split ] && CLI_PIN="taskset -c ${cpus[1]}"
    return 0
}

# sweep_window SIZE: send_bw's window at SIZE: WINDOW messages, fewer when
# they would hold more than 256 MiB (each side allocates its window).
sweep_window() {
    w=$(( (256 << 20) / $1 ))
    [ "$w" -lt 2 ] && w=2
    [ "$w" -gt "$WINDOW" ] && w=$WINDOW
    echo "$w"
}

# sweep_one TEST PATH SIZE ROUND: one server + client run.
sweep_one() {
    local test=$1 path=$2 size=$3 round=$4
    local base=$OUT/${test}_${path}_${size}_r$round
    local flags=(-s "$size" -D "$DUR")
    case $path in
        tcp) flags+=(--transport tcp) ;;
        *)
            flags+=(--api "$path" -d "$DEV")
            [ -n "$GIDX" ] && flags+=(-x "$GIDX")
            # shellcheck disable=SC2206 # flags split on spaces, on purpose
            [ -n "${RDMA_FLAGS:-}" ] && flags+=($RDMA_FLAGS)
            ;;
    esac
    [ "$test" = send_bw ] && flags+=(-t "$(sweep_window "$size")")
    sweep_port
    rm -f "$base.json" "$base.na"
    # shellcheck disable=SC2086 # SRV_PIN/CLI_PIN: a command and its arguments
    timeout "$LIMIT" ${SRV_PIN:-} "$BIN" "$test" -p "$SWEEP_PORT" "${flags[@]}" >/dev/null 2>"$base.srv" &
    local srv=$!
    local t0=$SECONDS rc=0
    # shellcheck disable=SC2086
    timeout "$LIMIT" ${CLI_PIN:-} "$BIN" "$test" 127.0.0.1 -p "$SWEEP_PORT" "${flags[@]}" --json \
        >"$base.json" 2>"$base.err" || rc=$?
    if [ $rc -ne 0 ]; then
        # The server waits for a client that will not come: end it.
        kill "$srv" 2>/dev/null || true
        local why
        if [ $rc -eq 124 ]; then
            why="did not finish within ${LIMIT} s"
        else
            # (`|| true`: under `set -eo pipefail` a grep that selects
            # nothing would end the whole sweep here.)
            why=$(grep -v '^\[' "$base.err" | tail -1 | sed 's/^verbio-perf: //' || true)
            [ -n "$why" ] || why="client exit status $rc"
        fi
        # A server that failed (a port taken, ...) says why the client could
        # not connect. A server killed above before it printed a line has
        # nothing to say (a client that fails at once races its server).
        wait "$srv" 2>/dev/null || {
            local srv_why
            srv_why=$(grep '^verbio-perf: ' "$base.srv" | tail -1 | sed 's/^verbio-perf: //' || true)
            [ -n "$srv_why" ] && why="$why (server: $srv_why)"
        }
        echo "$why" >"$base.na"
        rm -f "$base.json"
    fi
    wait "$srv" 2>/dev/null || true
    rm -f "$base.err" "$base.srv"
    printf 'perf-sweep: %-8s %-5s %9s B round %s: %s (%d s)\n' "$test" "$path" "$size" "$round" \
        "$([ -f "$base.na" ] && echo "n/a: $(cat "$base.na")" || echo ok)" $((SECONDS - t0)) >&2
}

# sweep_runs: every round, size, test and path (a run that fails is
# recorded as n/a, under `set -e` too).
sweep_runs() {
    mkdir -p "$OUT"
    local paths sizes tests k=0 r size test i n
    IFS=, read -r -a paths <<<"$PATHS"
    IFS=, read -r -a sizes <<<"$SIZES"
    IFS=, read -r -a tests <<<"$TESTS"
    n=${#paths[@]}
    for ((r = 1; r <= ROUNDS; r++)); do
        for size in "${sizes[@]}"; do
            for test in "${tests[@]}"; do
                k=$((k + 1))
                for ((i = 0; i < n; i++)); do
                    sweep_one "$test" "${paths[$(((i + k) % n))]}" "$size" "$r"
                done
            done
        done
    done
}
