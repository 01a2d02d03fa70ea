#!/usr/bin/env bash
# scripts/launch-cost.sh [N]
#
# What a small operation's launch costs on the host executor, in instructions: runs
# all_reduce_perf -b 8 -e 8 with 2 processes (env launcher, shared memory), rank 0 under
# callgrind, and prints the instructions executed inside ncclAllReduce per call. Rank 0 runs
# about 50 times slower under valgrind, so its peer is always there first and the figure counts
# the launch's own work, not waiting. N: iterations per column (default 50000). Needs valgrind
# (apt-get install valgrind) and the built library and tools (cargo build --release --lib &&
# make -C nccl-tests-compat). Instructions, unlike times, do not depend on the machine's load.
# LIBDIR=<folder holding another build's libnccl.so.2> measures that build with the same tools
# (run both, alternating, to compare a change with what it replaced).
# HOSTS=2: the two ranks on two "hosts" (OXCCL_HOSTID), so the operation goes over the network
# transport (loopback TCP) and the general path, 1 KiB; counts ncclAllReduce and the stream
# synchronize together (how much of the operation completes inside the call varies).
# CUDA=1: the CUDA executor's host side instead, on the recording driver of tests/cuda_logic.rs
# (its ignored test cuda_launch_cost: N one-rank all-reduces of 512 B out of place, copies on
# the copy engine), with its heap allocations per call. LIBDIR does not apply (the test links
# the library in): run it in each checkout to compare.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
N="${1:-50000}"
command -v valgrind >/dev/null || { echo "launch-cost.sh: valgrind is needed" >&2; exit 1; }
if [ "${CUDA:-0}" = 1 ]; then
  OUT="$(mktemp -d)"
  trap 'rm -rf "$OUT"' EXIT
  (cd "$ROOT" && cargo test --release --test cuda_logic --no-run) >"$OUT/build.txt" 2>&1 ||
    { cat "$OUT/build.txt" >&2; exit 1; }
  exe=$(sed -n 's/.*Executable tests\/cuda_logic.rs (\(.*\))/\1/p' "$OUT/build.txt")
  [ -n "$exe" ] || { echo "launch-cost.sh: no test binary in cargo's output" >&2; exit 1; }
  # Only what runs inside the calls is counted (--toggle-collect), allocations included.
  (cd "$ROOT" && OXCCL_COST_CALLS="$N" valgrind --tool=callgrind --callgrind-out-file="$OUT/cg.out" \
    --toggle-collect='nccl::api::enqueue*' "$exe" --ignored --exact cuda_launch_cost \
    >"$OUT/test.txt" 2>&1) || { cat "$OUT/test.txt" >&2; exit 1; }
  python3 - "$OUT/cg.out" "$N" <<'PY'
import re, sys
path, n = sys.argv[1], int(sys.argv[2])
names, cfn, ir, allocs = {}, None, 0, 0
def name(ref):  # "(12) foo" or "(12)": callgrind's compressed names
    m = re.match(r"\((\d+)\)(?: (.*))?", ref)
    if m.group(2):
        names[m.group(1)] = m.group(2)
    return names.get(m.group(1), "")
for line in open(path):
    if line.startswith(("fn=", "cfn=")):
        f = name(line.split("=", 1)[1].strip())
        if line.startswith("cfn="):
            cfn = f
    elif line.startswith("calls=") and cfn in ("malloc", "calloc", "realloc", "posix_memalign"):
        allocs += int(line.split()[0][6:])
    elif line.startswith("summary:"):
        ir = int(line.split()[1])
if ir == 0:
    sys.exit("launch-cost.sh: nothing was counted inside nccl::api::enqueue")
print(f"ncclAllReduce on the CUDA executor (recording driver), 512 B, 1 rank: "
      f"{ir / n:.0f} instructions and {allocs / n:.1f} heap allocations per call ({n} calls)")
PY
  exit 0
fi
TOOL="$ROOT/target/release/all_reduce_perf"
[ -x "$TOOL" ] || { echo "launch-cost.sh: build first: make -C nccl-tests-compat" >&2; exit 1; }
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
if [ -z "${LIBDIR:-}" ]; then
  # The tools load libnccl.so.2 (the SONAME): a lib directory holding it, as main-job.sh lays
  # out (without it a fresh checkout's tools could not start, and nothing was counted).
  [ -f "$ROOT/target/release/libnccl.so" ] || { echo "launch-cost.sh: build first: cargo build --release --lib" >&2; exit 1; }
  mkdir -p "$ROOT/target/release/lib"
  ln -sf ../libnccl.so "$ROOT/target/release/lib/libnccl.so.2"
fi
export LD_LIBRARY_PATH="${LIBDIR:-$ROOT/target/release/lib}" OXCCL_DEVICE=host WORLD_SIZE=2 MASTER_ADDR=127.0.0.1
export MASTER_PORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
if [ "${HOSTS:-1}" = 2 ]; then
  args=(-b 1K -e 1K -n "$N" -w 10 -c 0) h0=(env OXCCL_HOSTID=lc-host0) h1=(env OXCCL_HOSTID=lc-host1)
else
  args=(-b 8 -e 8 -n "$N" -w 10 -c 0) h0=() h1=()
fi
RANK=1 "${h1[@]}" "$TOOL" "${args[@]}" > "$OUT/rank1.txt" 2>&1 &
peer=$!
RANK=0 "${h0[@]}" valgrind --tool=callgrind --callgrind-out-file="$OUT/cg.out" "$TOOL" "${args[@]}" > "$OUT/rank0.txt" 2>&1 ||
  { echo "launch-cost.sh: rank 0 failed:" >&2; tail -20 "$OUT/rank0.txt" >&2; kill "$peer" 2>/dev/null; exit 1; }
wait "$peer"
# Out-of-place and in-place columns: 2N timed calls, plus warm-up and checks (negligible).
calls=$((2 * N))
callgrind_annotate --inclusive=yes "$OUT/cg.out" > "$OUT/annotated.txt" 2>/dev/null || true
# The inclusive count of the first line naming `pattern` (awk regex).
inclusive() { awk -v re="$1" '$0 ~ re && !n++ {gsub(",", "", $1); print $1}' "$OUT/annotated.txt"; }
ir=$(inclusive 'abi/coll.rs:ncclAllReduce ')
[ -n "$ir" ] || { echo "launch-cost.sh: no ncclAllReduce in the profile" >&2; exit 1; }
if [ "${HOSTS:-1}" = 2 ]; then
  sync=$(inclusive 'oxcclHostStreamSynchronize ')
  awk -v ir="$ir" -v s="${sync:-0}" -v c="$calls" 'BEGIN { printf "ncclAllReduce and its stream synchronize, 1 KiB, 2 hosts: %.0f instructions per call (%d calls)\n", (ir + s) / c, c }'
else
  awk -v ir="$ir" -v c="$calls" 'BEGIN { printf "ncclAllReduce, 8 B, 2 processes: %.0f instructions per call (%d calls)\n", ir / c, c }'
fi
