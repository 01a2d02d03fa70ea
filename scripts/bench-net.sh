#!/usr/bin/env bash
# scripts/bench-net.sh [--quick]
#
# The network transport across two "hosts" (network namespaces with their own hostname and
# /dev/shm, joined by veth pairs to a bridge), 1 rank per host, all_reduce f32 sum from 1 KiB
# to 256 MiB (--quick: to 16 MiB), side by side in one run:
#   (a) oxccl all_reduce_perf (env launcher, rank 0's host as MASTER_ADDR)
#   (b) OpenMPI MPI_Allreduce over TCP (--mca btl tcp,self) in the same namespaces
#   (c) iperf3 between the same namespaces, each direction and both at once: the link's ceiling
# Prints one table (busbw GB/s, oxccl/MPI) and the targets, each from runs of oxccl and MPI in
# turn (the sweep's rows are single samples of a noisy machine): oxccl/MPI >= 1.5 at 16, 64
# and 256 MiB (--quick: 16 and 64; best of three runs each, of 30, 10 and 4 all-reduces),
# oxccl >= 70% of iperf3's bidirectional rate per direction, the mean of the two (at 16 MiB),
# 1 KiB latency <= MPI's (2000 all-reduces, best of two runs each); then
# 2 hosts x 2 ranks, the flat ring against the hierarchical all-reduce (tree/ring). Raw outputs
# under target/bench-net/. Needs root; installs iperf3 and OpenMPI if missing. Removes its
# namespaces and links on exit.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
QUICK=0
[ "${1:-}" = "--quick" ] && QUICK=1
MAX=$([ "$QUICK" = 1 ] && echo 16M || echo 256M)
OUT="$ROOT/target/bench-net"
BIN="$ROOT/target/bench/bin"
mkdir -p "$OUT" "$BIN"
log() { echo "bench-net: $*" >&2; }
[ "$(id -u)" = 0 ] || { log "needs root (network namespaces)"; exit 1; }
# packages, not commands: some images carry openmpi-bin (mpicc) without libopenmpi-dev (mpi.h)
for p in iperf3 openmpi-bin libopenmpi-dev; do
  dpkg -s "$p" >/dev/null 2>&1 || apt-get install -y -q "$p" >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null && apt-get install -y -q "$p" >/dev/null; }
done

log "building"
(cd "$ROOT" && cargo build --release -q)
make -s -C "$ROOT/nccl-tests-compat" >/dev/null
mpicc -O2 -o "$BIN/mpi_allreduce" "$ROOT/nccl-tests-compat/bench/mpi_allreduce.c"
LIB="$ROOT/target/release"
TOOL="$ROOT/target/release/all_reduce_perf"

# ---- two hosts: namespaces bn0, bn1 (10.79.0.1, .2) on a bridge in this namespace (10.79.0.254,
# which MPI's launcher needs to reach its ranks) --------------------------------------------------
T="bn$$"
cleanup() {
  for i in 0 1; do
    for p in $(ip netns pids "$T$i" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
    ip netns del "$T$i" 2>/dev/null || true
  done
  ip link del "${T}br" 2>/dev/null || true
}
trap cleanup EXIT
ip link add "${T}br" type bridge
ip addr add 10.79.0.254/24 dev "${T}br"
ip link set "${T}br" up
for i in 0 1; do
  ip netns add "$T$i"
  ip -n "$T$i" link set lo up
  ip link add "${T}v$i" type veth peer name "${T}p$i"
  ip link set "${T}v$i" netns "$T$i"
  ip -n "$T$i" link set "${T}v$i" name eth0
  ip -n "$T$i" addr add "10.79.0.$((i + 1))/24" dev eth0
  ip -n "$T$i" link set eth0 up
  ip link set "${T}p$i" master "${T}br" up
done
# Runs a command on host i with its own hostname and /dev/shm.
on() {
  local i=$1
  shift
  ip netns exec "$T$i" unshare --mount --uts --propagation private \
    sh -c "mount -t tmpfs tmpfs /dev/shm && hostname $T-host$i && exec \"\$@\"" sh "$@"
}

# ---- (a) oxccl ---------------------------------------------------------------------------
log "oxccl all_reduce_perf, 1 rank per host"
for r in 1 0; do
  on "$r" env LD_LIBRARY_PATH="$LIB" OXCCL_DEVICE=host RANK=$r WORLD_SIZE=2 \
    MASTER_ADDR=10.79.0.1 MASTER_PORT=29555 NCCL_SOCKET_IFNAME=eth0 \
    "$TOOL" -b 1K -e "$MAX" -f 4 -n 20 -w 5 -d float -o sum >"$OUT/oxccl.rank$r.txt" 2>&1 &
done
wait
# ---- (a2) 2 hosts x 2 ranks: the flat ring against the hierarchical all-reduce -----------------
log "oxccl all_reduce_perf, 2 hosts x 2 ranks: NCCL_ALGO=ring, then tree"
# The two ranks of a host share its /dev/shm (one `on` each host).
for algo in ring tree; do
  for h in 1 0; do
    on "$h" env LD_LIBRARY_PATH="$LIB" OXCCL_DEVICE=host WORLD_SIZE=4 MASTER_ADDR=10.79.0.1 \
      MASTER_PORT=29556 NCCL_SOCKET_IFNAME=eth0 NCCL_ALGO=$algo sh -c "
        for r in $((2 * h + 1)) $((2 * h)); do
          RANK=\$r '$TOOL' -b 1K -e $MAX -f 4 -n 20 -w 5 -d float -o sum \
            >'$OUT/oxccl4.$algo.rank'\$r.txt 2>&1 &
        done
        wait" &
  done
  wait
done
# ---- (b) MPI -----------------------------------------------------------------------------
log "OpenMPI MPI_Allreduce over TCP"
PMIX_MCA_ptl_tcp_remote_connections=1 PMIX_MCA_ptl_tcp_if_include="${T}br" \
  mpirun --allow-run-as-root --oversubscribe --mca btl tcp,self \
  --mca btl_tcp_if_include 10.79.0.0/24 --mca oob_tcp_if_include "${T}br" \
  -np 1 ip netns exec "${T}0" "$BIN/mpi_allreduce" -b 1K -e "$MAX" -f 4 -n 20 -w 5 : \
  -np 1 ip netns exec "${T}1" "$BIN/mpi_allreduce" -b 1K -e "$MAX" -f 4 -n 20 -w 5 \
  >"$OUT/mpi.txt" 2>&1 || log "MPI failed: see $OUT/mpi.txt"
# ---- (d), (e): oxccl and MPI in turn, ROUNDS times at one size (the sweeps above run 20 per
# size, their first size also pays the start-up, and each row is one sample of a noisy
# machine; the targets take each side's best round). Outputs oxccl.TAG<k>.rank<r>.txt and
# mpi.TAG<k>.txt.
in_turn() {  # tag, rounds, size, iterations, warm-up, first port
  local tag=$1 rounds=$2 size=$3 n=$4 w=$5 port=$6 k r
  for k in $(seq "$rounds"); do
    for r in 1 0; do
      on "$r" env LD_LIBRARY_PATH="$LIB" OXCCL_DEVICE=host RANK=$r WORLD_SIZE=2 \
        MASTER_ADDR=10.79.0.1 MASTER_PORT=$((port + k)) NCCL_SOCKET_IFNAME=eth0 \
        "$TOOL" -b "$size" -e "$size" -n "$n" -w "$w" -d float -o sum \
        >"$OUT/oxccl.$tag$k.rank$r.txt" 2>&1 &
    done
    wait
    PMIX_MCA_ptl_tcp_remote_connections=1 PMIX_MCA_ptl_tcp_if_include="${T}br" \
      mpirun --allow-run-as-root --oversubscribe --mca btl tcp,self \
      --mca btl_tcp_if_include 10.79.0.0/24 --mca oob_tcp_if_include "${T}br" \
      -np 1 ip netns exec "${T}0" "$BIN/mpi_allreduce" -b "$size" -e "$size" -n "$n" -w "$w" : \
      -np 1 ip netns exec "${T}1" "$BIN/mpi_allreduce" -b "$size" -e "$size" -n "$n" -w "$w" \
      >"$OUT/mpi.$tag$k.txt" 2>&1 || log "MPI failed: see $OUT/mpi.$tag$k.txt"
  done
}
log "1 KiB latency, 2000 iterations, oxccl and MPI in turn, twice"
in_turn lat 2 1K 2000 100 29557
# The 1.5x target holds from 16 MiB up: each size of it, oxccl and MPI in turn, three times
# (fewer iterations as the sizes grow: each run stays within a few seconds).
BW_SIZES=$([ "$QUICK" = 1 ] && echo "16M:30:5 64M:10:2" || echo "16M:30:5 64M:10:2 256M:4:1")
port=29567
for spec in $BW_SIZES; do
  IFS=: read -r size n w <<<"$spec"
  log "$size, $n iterations, oxccl and MPI in turn, three times"
  in_turn "bw$size." 3 "$size" "$n" "$w" "$port"
  port=$((port + 10))
done
# ---- (c) iperf3 --------------------------------------------------------------------------
log "iperf3"
ip netns exec "${T}1" iperf3 -s -D -1 >/dev/null
sleep 0.3
ip netns exec "${T}0" iperf3 -c 10.79.0.2 -t 4 --bidir -J >"$OUT/iperf3.json" 2>&1 || true

python3 - "$OUT" "$BW_SIZES" <<'EOF'
import json, sys
out = sys.argv[1]
bw_sizes = [spec.split(":")[0] for spec in sys.argv[2].split()]
mib = lambda tag: int(tag.rstrip("M")) << 20
def rows(path):
    r = {}
    for line in open(path, errors="replace"):
        f = line.split()
        if len(f) >= 6 and f[0].isdigit():
            r[int(f[0])] = float(f[5])  # time (us), out of place
    return r
ox, mpi = rows(f"{out}/oxccl.rank0.txt"), rows(f"{out}/mpi.txt")
wrong = [l for l in open(f"{out}/oxccl.rank0.txt") if l.split()[:1] and l.split()[0].isdigit() and l.split()[8] != "0"]
bus = lambda b, t: b / t / 1e3  # busbw GB/s for 2 ranks: 2(n-1)/n = 1
try:
    j = json.load(open(f"{out}/iperf3.json"))
    e = j["end"]
    up = e["sum_sent"]["bits_per_second"] / 8e9
    down = e.get("sum_sent_bidir_reverse", e["sum_received"])["bits_per_second"] / 8e9
except Exception as ex:
    up = down = float("nan")
print(f"iperf3 between the hosts, both directions at once: {up:.2f} and {down:.2f} GB/s")
print(f"{'size':>10} {'oxccl':>8} {'MPI':>8} {'ox/MPI':>7} {'ox us':>9} {'MPI us':>9}")
for b in sorted(ox):
    o, m = ox[b], mpi.get(b)
    print(f"{b:>10} {bus(b, o):8.3f} {bus(b, m) if m else float('nan'):8.3f} "
          f"{(m / o) if m else float('nan'):7.2f} {o:9.1f} {m if m else float('nan'):9.1f}")
print("\nTargets:")
M16 = 16 << 20
best = {}
for tag in bw_sizes:
    b = mib(tag)
    bo = [rows(f"{out}/oxccl.bw{tag}.{k}.rank0.txt").get(b) for k in (1, 2, 3)]
    bm = [rows(f"{out}/mpi.bw{tag}.{k}.txt").get(b) for k in (1, 2, 3)]
    if not (all(bo) and all(bm)):
        print(f"  oxccl/MPI >= 1.5 at {tag[:-1] + ' MiB':<7} (best)  no result (see {out})  FAIL")
        continue
    o, m = best[b] = min(bo), min(bm)
    runs = " ".join(f"{t / 1e3:.1f}" for t in bo) + " / " + " ".join(f"{t / 1e3:.1f}" for t in bm)
    print(f"  oxccl/MPI >= 1.5 at {tag[:-1] + ' MiB':<7} (best)  measured {m / o:.2f} (ms: {runs})  {'PASS' if m / o >= 1.5 else 'FAIL'}")
if M16 in best:
    o, m = best[M16]
    # Both directions at once: on a CPU-bound link one may starve the other (0.4 and 3.9 GB/s
    # on a 2-core VM); an all-reduce moves as much each way, so its share is their mean.
    link = (up + down) / 2
    print(f"  oxccl >= 70% of iperf3 (mean dir.)  measured {bus(M16, o):.2f} of {link:.2f} GB/s = {bus(M16, o) / link:.0%}"
          f" (MPI {bus(M16, m) / link:.0%})  {'PASS' if bus(M16, o) >= 0.7 * link else 'FAIL'}")
lat = lambda f: [rows(f"{out}/{f.format(k)}").get(1024) for k in (1, 2)]
lo, lm = lat("oxccl.lat{}.rank0.txt"), lat("mpi.lat{}.txt")
if all(lo) and all(lm):
    o, m = min(lo), min(lm)
    print(f"  1 KiB latency <= MPI's (2000 its)   measured {o:.1f} vs {m:.1f} us "
          f"(runs: {lo[0]:.1f} {lo[1]:.1f} / {lm[0]:.1f} {lm[1]:.1f})  {'PASS' if o <= m else 'FAIL'}")
print(f"  #wrong 0                            {'PASS' if not wrong else 'FAIL'}")

ring, tree = rows(f"{out}/oxccl4.ring.rank0.txt"), rows(f"{out}/oxccl4.tree.rank0.txt")
bus4 = lambda b, t: b / t / 1e3 * 1.5  # busbw for 4 ranks: 2(n-1)/n = 1.5
print("\n2 hosts x 2 ranks: flat ring (NCCL_ALGO=ring) against hierarchical (NCCL_ALGO=tree)")
print(f"{'size':>10} {'ring':>8} {'tree':>8} {'tree/ring':>9} {'ring us':>9} {'tree us':>9}")
for b in sorted(ring):
    t = tree.get(b)
    print(f"{b:>10} {bus4(b, ring[b]):8.3f} {bus4(b, t) if t else float('nan'):8.3f} "
          f"{(ring[b] / t) if t else float('nan'):9.2f} {ring[b]:9.1f} {t if t else float('nan'):9.1f}")
wrong4 = [l for a in ("ring", "tree") for l in open(f"{out}/oxccl4.{a}.rank0.txt")
          if l.split()[:1] and l.split()[0].isdigit() and l.split()[8] != "0"]
print(f"  #wrong 0 (2 x 2)                    {'PASS' if not wrong4 and ring and tree else 'FAIL'}")
EOF
