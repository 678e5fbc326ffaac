#!/bin/bash
BIN=/work/wt/flake-target/release/verbio-perf
OUT=/work/wt/flake/vmout
cd $OUT
port=19000
run() { # name api size extra...
  local name=$1 api=$2 size=$3; shift 3
  port=$((port+1))
  taskset -c 0 "$@" $BIN send_lat -p $port -s $size -n 2000 --api $api -d rxe0 -x 1 >/dev/null 2>$OUT/$name.srv.err &
  local srv=$!
  sleep 0.5
  taskset -c 1 "$@" $BIN send_lat 127.0.0.1 -p $port -s $size -n 2000 --api $api -d rxe0 -x 1 --json > $OUT/$name.json 2>$OUT/$name.err
  wait $srv
}
for r in 1 2; do
 for s in 64 1024; do
  for api in verbs rdma; do
    run plain_${api}_${s}_r$r $api $s
  done
 done
done
for api in verbs rdma; do
  port=$((port+1)); taskset -c 0 strace -f -c -o $OUT/strace_${api}_srv.txt $BIN send_lat -p $port -s 64 -n 2000 --api $api -d rxe0 -x 1 >/dev/null 2>/dev/null & sleep 0.5; taskset -c 1 strace -f -c -o $OUT/strace_${api}_cli.txt $BIN send_lat 127.0.0.1 -p $port -s 64 -n 2000 --api $api -d rxe0 -x 1 --json > $OUT/strace_$api.json 2>/dev/null; wait
done
ls $OUT
