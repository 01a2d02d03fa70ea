#!/usr/bin/env bash
# The GPU machine's check, in one call, building nothing there.
#
#   scripts/gpu-check.sh --prepare     # here: build the library, perf tools and C tests into
#                                      # target/gpu-check/ (what the device call carries)
#   scripts/gpu-check.sh               # there (device tool: carry target/gpu-check); log in $OUT
#
# What it checks on a machine with a CUDA driver: that libnccl.so.2 loads, finds the driver and
# says plainly that the CUDA executor is not there yet (ncclInvalidUsage with a message) instead of
# running anything on the GPU; and, with OXCCL_DEVICE=host, that the C programs and every perf tool
# give exact results there too, with the many cores such a machine has (up to 16 ranks), plus
# an all_reduce_perf sweep for the log. When the CUDA executor lands, its GPU tests join here.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
pack="$root/target/gpu-check"

if [ "${1:-}" = "--prepare" ]; then
  set -e
  cd "$root"
  cargo build --release --lib
  make -s -C nccl-tests-compat
  cargo test --release --test ffi --no-run >/dev/null 2>&1 || true
  OXCCL_DEVICE=host cargo test --release --test ffi ex_single >/dev/null   # builds the C programs
  rm -rf "$pack"; mkdir -p "$pack/lib" "$pack/bin"
  cp target/release/libnccl.so "$pack/lib/libnccl.so.2"
  for t in all_reduce all_gather broadcast reduce reduce_scatter alltoall gather scatter sendrecv hypercube; do
    cp "target/release/${t}_perf" "$pack/bin/"
  done
  cp target/release/ffi-tests/bin/* "$pack/bin/"
  make -s -C examples BUILD="$pack/bin" LIBDIR="$root/target/release"
  du -sh "$pack"
  exit 0
fi

OUT="${OUT:-$root/target/gpu-check-out}"
mkdir -p "$OUT"
log="$OUT/gpu-check.log"
: >"$log"
fails=0
say() { echo "$*" | tee -a "$log"; }
check() {  # name, command...
  local name=$1; shift
  say "== $name: $*"
  if timeout 300 "$@" >>"$log" 2>&1; then say "   ok"; else say "   FAILED (rc=$?)"; fails=$((fails + 1)); fi
}
[ -f "$pack/lib/libnccl.so.2" ] || { say "no $pack: run scripts/gpu-check.sh --prepare here and carry target/gpu-check"; exit 2; }
export LD_LIBRARY_PATH="$pack/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
B="$pack/bin"

say "# $(date -u) $(hostname) $(nproc) cores"
nvidia-smi -L >>"$log" 2>&1 || say "(no nvidia-smi)"
ldconfig -p | grep -q libcuda.so && say "libcuda: present" || say "libcuda: not found"

# 1. With the driver present and no OXCCL_DEVICE, init must fail cleanly, naming the CUDA executor.
say "== CUDA executor not there yet: ex_single_process without OXCCL_DEVICE"
env -u OXCCL_DEVICE "$B/ex_single_process" >"$OUT/cuda-probe.txt" 2>&1; rc=$?
cat "$OUT/cuda-probe.txt" >>"$log"
if [ $rc -ne 0 ] && grep -qi "cuda" "$OUT/cuda-probe.txt"; then say "   ok (rc=$rc, message names CUDA)"; else say "   UNEXPECTED (rc=$rc)"; fails=$((fails + 1)); fi

# 2. Host executor on this machine's cores.
export OXCCL_DEVICE=host
check "C: one process, InitAll + group" "$B/ex_single_process"
check "C: thread per rank" "$B/ex_threads"
check "C: process per rank" "$B/ex_processes"
for n in 4 8; do check "C: collective matrix, $n ranks" "$B/coll_matrix" "$n" big=none; done
check "C: collective matrix, 8 ranks, host streams" "$B/coll_matrix" 8 stream big=none
check "C: bad input" "$B/bad_input"
for t in all_reduce all_gather broadcast reduce reduce_scatter alltoall gather scatter sendrecv hypercube; do
  check "perf: ${t}_perf -g 8" "$B/${t}_perf" -b 8 -e 8M -f 8 -g 8 -n 5 -w 1
done
check "perf: all_reduce_perf -g 16" "$B/all_reduce_perf" -b 8 -e 64M -f 8 -g 16 -n 5 -w 1
check "perf: all_reduce_perf -t 8 (threads)" "$B/all_reduce_perf" -b 8 -e 64M -f 4 -t 8 -n 10 -w 2
# The tensor/pipeline-parallel example, 8 ranks (TP=4, PP=2), host buffers (its GPU variant
# comes with the CUDA executor).
tppp() {
  local port=$((29700 + RANDOM % 200)) pids=() rc=0
  for r in 7 6 5 4 3 2 1 0; do
    RANK=$r WORLD_SIZE=8 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "$B/tp_pp_mlp" "$@" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  return $rc
}
check "example: tp_pp_mlp --tp 4 --pp 2 --exact" tppp --tp 4 --pp 2 --exact
check "example: tp_pp_mlp --tp 4 --pp 2 --hidden 256 --layers 4" tppp --tp 4 --pp 2 --hidden 256 --layers 4
say "== perf sweep: all_reduce_perf -b 8 -e 256M -f 2 -g 8"
"$B/all_reduce_perf" -b 8 -e 256M -f 2 -g 8 -n 20 -w 3 2>&1 | tee -a "$log" | tail -4
say "# failures: $fails"
exit $((fails > 0))
