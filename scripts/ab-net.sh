#!/usr/bin/env bash
# scripts/ab-net.sh VARIANT... : variants side by side across 2 namespace hosts (needs root)
#
# Each VARIANT is LIBDIR:ENV (a folder holding libnccl.so.2, then space-separated VAR=value for
# both ranks; "-" alone is this tree's library as it is). In each of R rounds (default 3) it runs
# all_reduce_perf, 1 rank per host over veth, with every variant in turn and then OpenMPI's
# MPI_Allreduce (--mca btl tcp,self; target/bench/bin/mpi_allreduce from scripts/bench-net.sh),
# and prints the out-of-place time (us) of each (INPLACE=1: oxccl's in-place time; MPI's
# is its only one), then each one's median and best over the rounds. SZ (default 1K) and
# N (iterations, default 1000) choose the size; LIMIT (default 300 s) bounds each run.
# Example, one socket against two with a helper thread, at 16 MiB:
#   SZ=16M N=30 scripts/ab-net.sh "target/release:NCCL_NSOCKS_PERTHREAD=1" \
#     "target/release:NCCL_SOCKET_NTHREADS=2"
set -uo pipefail
[ $# -ge 1 ] || { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOL=$ROOT/target/release/all_reduce_perf
MPI=$ROOT/target/bench/bin/mpi_allreduce
N=${N:-1000} R=${R:-3} SZ=${SZ:-1K}
T="oxab$$"
cleanup() {
  for i in 0 1; do
    for p in $(ip netns pids "$T$i" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
    ip netns del "$T$i" 2>/dev/null
  done
  ip link del "${T}br" 2>/dev/null
  rm -f "/tmp/$T".*
}
trap cleanup EXIT
trap 'exit 130' INT TERM
ip link add "${T}br" type bridge && ip addr add 10.75.0.254/24 dev "${T}br" && ip link set "${T}br" up || exit 1
for i in 0 1; do
  { ip netns add "$T$i" && ip -n "$T$i" link set lo up &&
    ip link add "${T}v$i" type veth peer name "${T}p$i" &&
    ip link set "${T}v$i" netns "$T$i" && ip -n "$T$i" link set "${T}v$i" name eth0 &&
    ip -n "$T$i" addr add "10.75.0.$((i + 1))/24" dev eth0 && ip -n "$T$i" link set eth0 up &&
    ip link set "${T}p$i" master "${T}br" up; } || { echo "ab-net: setting up host $i failed" >&2; exit 1; }
done
# A host: its namespace, a private /dev/shm and its own hostname.
on() {
  local i=$1; shift
  ip netns exec "$T$i" unshare --mount --uts --propagation private \
    sh -c "mount -t tmpfs tmpfs /dev/shm && hostname $T-host$i && exec \"\$@\"" sh "$@"
}
for rep in $(seq "$R"); do
  line="round $rep:"
  for v in "$@"; do
    [ "$v" = - ] && v="$ROOT/target/release:"
    for r in 1 0; do
      # shellcheck disable=SC2086 # the variant's VAR=value words
      on $r timeout -k 5 "${LIMIT:-300}" env LD_LIBRARY_PATH="${v%%:*}" OXCCL_DEVICE=host RANK=$r WORLD_SIZE=2 MASTER_ADDR=10.75.0.1 \
        MASTER_PORT=29551 NCCL_SOCKET_IFNAME=eth0 ${v#*:} "$TOOL" -b "$SZ" -e "$SZ" -n "$N" -w 20 \
        -d float -o sum >"/tmp/$T.$r" 2>&1 &
    done
    wait
    t=$(grep -E '^ +[0-9]' "/tmp/$T.0" | awk -v c="${INPLACE:+10}" '{print $(c ? c : 6)}')
    line="$line  [$v] $t"
    echo "$v $t" >>"/tmp/$T.all"
  done
  if [ -x "$MPI" ] && command -v mpirun >/dev/null; then
    PMIX_MCA_ptl_tcp_remote_connections=1 PMIX_MCA_ptl_tcp_if_include="${T}br" \
      timeout -k 5 "${LIMIT:-300}" mpirun --allow-run-as-root --oversubscribe --mca btl tcp,self \
      --mca btl_tcp_if_include 10.75.0.0/24 --mca oob_tcp_if_include "${T}br" \
      -np 1 ip netns exec "${T}0" "$MPI" -b "$SZ" -e "$SZ" -n "$N" -w 20 : \
      -np 1 ip netns exec "${T}1" "$MPI" -b "$SZ" -e "$SZ" -n "$N" -w 20 >"/tmp/$T.mpi" 2>&1
    t=$(grep -E '^ +[0-9]' "/tmp/$T.mpi" | awk '{print $6}')
    line="$line  [mpi] $t"
    echo "mpi $t" >>"/tmp/$T.all"
  fi
  echo "$line"
done
# Median and best of each variant (rounds that printed no time are left out).
python3 - "/tmp/$T.all" <<'EOF2'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    v, *t = line.split()
    if t:
        runs.setdefault(v, []).append(float(t[0]))
for v, ts in runs.items():
    print(f"[{v}] median {statistics.median(ts):.2f}  best {min(ts):.2f}  ({len(ts)} rounds)")
EOF2
