#!/usr/bin/env bash
# scripts/ab-allreduce.sh LIBDIR_A LIBDIR_B ROUNDS [all_reduce_perf args...]
#
# Two builds of the library side by side: runs all_reduce_perf with 2 processes (env launcher,
# each rank bound to its own core) ROUNDS times with each library in turn (A, B, A, B, ...) and
# prints, per size, every round's out-of-place busbw (GB/s) for A and for B. Each LIBDIR holds a
# libnccl.so.2 (e.g. an earlier commit's target/release). Needs the perf tools built
# (make -C nccl-tests-compat). Example, 6 rounds from 64 KiB to 256 KiB:
#   scripts/ab-allreduce.sh /tmp/old target/release 6 -b 64K -e 256K -f 2 -n 300 -w 30
set -euo pipefail
[ $# -ge 3 ] || { sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
A=$1 B=$2 R=$3
shift 3
TOOL="$ROOT/target/release/all_reduce_perf"
[ -x "$TOOL" ] || { echo "ab-allreduce.sh: build the tools first (make -C nccl-tests-compat)" >&2; exit 1; }
run() {
  local lib=$1 port pid
  shift
  port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
  LD_LIBRARY_PATH=$lib OXCCL_DEVICE=host RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    taskset -c 1 "$TOOL" "$@" >/dev/null 2>&1 &
  pid=$!
  LD_LIBRARY_PATH=$lib OXCCL_DEVICE=host RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    taskset -c 0 "$TOOL" "$@" 2>&1 | awk '!/^#/ && $1 ~ /^[0-9]+$/ {print $1, $8}'
  wait "$pid"
}
for _ in $(seq 1 "$R"); do
  run "$A" "$@" | sed 's/^/A /'
  run "$B" "$@" | sed 's/^/B /'
done | awk '{k = $1 " " $2; v[k] = v[k] " " $3} END {for (k in v) print k, v[k]}' | sort -k2,2n -k1,1
