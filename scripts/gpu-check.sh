#!/usr/bin/env bash
# The GPU machine's check, in one call, building nothing there.
#
#   scripts/gpu-check.sh --prepare     # here: build the library, perf tools, C tests and the
#                                      # example into target/gpu-check/ (what the device call carries)
#   scripts/gpu-check.sh               # there (device tool: carry target/gpu-check); log in $OUT
#
#   scripts/gpu-check.sh --verify-pack # here: does the pack match this tree? (the run checks too)
#
# On a machine with a CUDA driver it runs, each step under a time limit cut to what is left of
# the whole run's (GPU_CHECK_DEADLINE, 530 s: a hang fails its step, and the steps the deadline
# leaves no time for are skipped and counted), the C programs with OXCCL_TIMEOUT_S=30 (a hang
# ends in an error naming what it waited for), in the order of what the issue needs most:
#  0. the pack against the tree (a stale pack is a failure); the environment logged, and its
#     NCCL_*/OXCCL_* cleared;
#  1. the CUDA executor on device buffers: where its kernels came from (the library's fatbin, and
#     NVRTC with OXCCL_KERNELS=nvrtc); every collective x datatype x op on 1, 2 and 4 ranks of
#     the one GPU (coll_matrix cuda), ranks as threads and as processes (cuda_ranks; with
#     `grouped`, 48 all-reduces in one group: the kernels' large parameter; with `mixed`,
#     collectives and sends/receives grouped differently by even and odd ranks, whose sends and
#     receives run on the side stream beside the collectives), CUDA graph capture
#     and replay (cuda_graph); a peer process killed while an eager launch or a graph's replay
#     waits for it (cuda_peer_death: ncclRemoteError naming it, the stream drains); the TP/PP
#     example on device buffers, 8 ranks (processes) on the one GPU;
#  2. issue 13's figures: the device-to-device copy bandwidth (torch, apart from either
#     library); all_reduce_perf at nranks=1 against NVIDIA's libnccl.so.2 (the one torch loads)
#     side by side: the sweep, then 8 B-32 MiB with 200 calls a size and 64 MiB-1 GiB, the two
#     in turn, best of two; 2 and 4 ranks on the one GPU, 1 GiB exactly, 8 B over 2 ranks;
#     the targets' verdicts;
#  3. PyTorch with LD_PRELOAD=libnccl.so.2 (scripts/gpu-torch-check.py): world sizes 1 and 2;
#     NVIDIA's own perf tools (upstream nccl-tests, scripts/build-nccl-tests.sh: built here
#     against NVIDIA's headers) unchanged on our library: every tool, datatype and op with
#     checks at nranks=1, graphs, registered buffers, and all_reduce_perf beside NVIDIA's;
#     then more perf: the CPU time per call, bfloat16, host-staged, two processes and two
#     "hosts", every tool at 2 ranks and at nranks=1 against NVIDIA's;
#  5. connections between processes by CUDA IPC (the default since 12-06; it passed here on
#     12-06 behind OXCCL_CUDA_IPC=1): the connection lines of cuda_ranks with 3 processes, the
#     TP/PP example and two processes' all_reduce_perf must say P2P/IPC, and cuda_ranks with 2
#     and 4 processes in pinned host memory (OXCCL_CUDA_IPC=0) must say SHM; and the direct
#     all-reduce of ranks on one GPU (on by default since 12-06): coll_matrix on
#     2, 3, 4 and 8 ranks saying it ran, the ring's (OXCCL_CUDA_DIRECT=0) all-reduce matrix
#     on 2 ranks and its all_reduce_perf -g 2 and -g 4 beside the default's rows; the device
#     board (ranks as threads: cuda_ranks 2 and 4 threads, all_reduce_perf -t 2 and -t 4 against
#     the limit); nranks=1 on the wide and the copy kernel (OXCCL_CUDA_CE_COPY_BYTES=1,
#     OXCCL_CUDA_COPY_KERNEL=1) beside the copy engine (the default since 12-06); and 2 ranks'
#     bandwidth by blocks per lane (OXCCL_CUDA_BLOCKS) and slot size, for the next defaults;
#  6. last, what may stop by design (12 ranks as threads, more than the hardware queues; 2 on
#     one queue, CUDA_DEVICE_MAX_CONNECTIONS=1), then the host executor there (OXCCL_DEVICE=host:
#     the C programs, perf tools and the TP/PP example with the machine's many cores; CI runs
#     them too).
# What comes back ($OUT, at most 8 files): gpu-check.log (everything), summary.txt (a line a
# step and every verdict) and aux.tgz (each step's own output).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
pack="$root/target/gpu-check"

# The sources the pack is built from.
stamp_files() { git -C "$root" ls-files --cached --others --exclude-standard src cuda build.rs Cargo.toml Cargo.lock ffi-tests nccl-tests-compat examples scripts/gpu-torch-check.py; }
verify_pack() {  # in $root: the files whose hashes differ from the pack's STAMP (none: ok)
  [ -f "$pack/STAMP" ] || { echo "no $pack/STAMP: the pack predates stamps"; return 1; }
  local bad
  bad=$(sha256sum -c --quiet "$pack/STAMP" 2>/dev/null | sed 's/: FAILED.*//' | head -20)
  [ -z "$bad" ] || { echo "STALE PACK: built from $(cat "$pack/COMMIT" 2>/dev/null); changed since: $bad"; return 1; }
}

if [ "${1:-}" = "--prepare" ]; then
  set -e
  cd "$root"
  # NVIDIA's own perf tools (upstream nccl-tests), built as users build them, packed below (the
  # carry limit: 58 MB stripped, 14 MB packed). NCCL_TESTS_SRC names their sources (a folder,
  # or a git repository with the release), else they are cloned from GitHub;
  # NCCL_TESTS_SRC=none leaves them out, and the run fails that step. First, so that a
  # machine without the sources stops here, the pack it had left as it was.
  rm -rf target/nccl-tests
  if [ "${NCCL_TESTS_SRC:-}" != none ]; then
    scripts/build-nccl-tests.sh target/nccl-tests >/dev/null || {
      echo "gpu-check --prepare: upstream nccl-tests did not build (no GitHub here? set" \
        "NCCL_TESTS_SRC to their sources or a git repository holding them, or to none)" >&2
      exit 1
    }
  fi
  cargo build --release --lib
  # The library must embed nvcc's fatbin (the first check there asks for it). A build made
  # before scripts/setup.sh installed nvcc has none, and cargo would not run build.rs again.
  has_fatbin() { python3 -c 'import sys; sys.exit(b"\x50\xed\x55\xba" not in open(sys.argv[1], "rb").read())' "$1"; }
  if ! has_fatbin target/release/libnccl.so; then
    touch build.rs
    cargo build --release --lib
    has_fatbin target/release/libnccl.so || {
      echo "gpu-check --prepare: the library embeds no nvcc fatbin (no nvcc here? run scripts/setup.sh)" >&2
      exit 1
    }
  fi
  make -s -C nccl-tests-compat
  OXCCL_DEVICE=host cargo test --release --test ffi ex_single >/dev/null   # builds the C programs
  rm -rf "$pack"; mkdir -p "$pack/lib" "$pack/bin"
  cp target/release/libnccl.so "$pack/lib/libnccl.so.2"
  for t in all_reduce all_gather broadcast reduce reduce_scatter alltoall gather scatter sendrecv hypercube; do
    cp "target/release/${t}_perf" "$pack/bin/"
  done
  cp target/release/ffi-tests/bin/* "$pack/bin/"
  cp scripts/gpu-torch-check.py "$pack/bin/" 2>/dev/null || true
  # The kernels compiled here (NVRTC from PyPI) for sm_80/90/100, as the library's kernel cache
  # there (OXCCL_CACHE_DIR): the GPU machine needs no NVRTC of its own.
  OXCCL_KERNEL_EXPORT="$pack/kcache" cargo test --release --lib kernels_compile_with_nvrtc >/dev/null
  ls "$pack/kcache" >/dev/null 2>&1 || {
    echo "gpu-check --prepare: no kernel cache: NVRTC was not found here (on a fresh machine," \
      "run scripts/setup.sh first: it installs nvidia-cuda-nvrtc from PyPI)" >&2
    exit 1
  }
  ls "$pack/kcache"
  make -s -C examples BUILD="$pack/bin" LIBDIR="$root/target/release"
  # (NVIDIA's own perf tools were built before the pack was emptied, below.)
  [ ! -d target/nccl-tests ] || tar czf "$pack/nccl-tests.tgz" -C target nccl-tests
  # What the pack was built from: the run there (and --verify-pack here) compares it with the
  # working tree that travels with it, so that a stale pack is a failure, not a silent test of
  # old code.
  stamp_files | xargs sha256sum >"$pack/STAMP"
  git rev-parse HEAD >"$pack/COMMIT"
  du -sh "$pack"
  # The device tool carries at most 64 MiB, the working tree (about 3 MiB) included.
  mib=$(du -sm "$pack" | cut -f1)
  [ "$mib" -le 60 ] || { echo "gpu-check --prepare: the pack is $mib MiB, over the 60 the carry leaves it" >&2; exit 1; }
  exit 0
fi
if [ "${1:-}" = "--verify-pack" ]; then
  cd "$root" && verify_pack && echo "the pack in $pack matches this tree"
  exit $?
fi

# What comes back from the device call is at most 8 files of $OUT: the log (everything, perf
# tables included), the summary (one line a step) and one archive of the steps' own files,
# which are written to $AUX (packed at each section's end and at exit).
OUT="${OUT:-$root/target/gpu-check-out}"
AUX="${TMPDIR:-/tmp}/gpu-check-aux"
rm -rf "$AUX"; mkdir -p "$OUT" "$AUX"
export PYTHONDONTWRITEBYTECODE=1
log="$OUT/gpu-check.log"
: >"$log"
fails=0 skipped=0
say() { echo "$*" | tee -a "$log"; }
summarize() { grep -E '^(== |   ok|   FAILED|   TIMED OUT|   SKIPPED|  .*(PASS|FAIL)|# (failures|the pack|inherited|[A-Z][a-z][a-z] [A-Z][a-z][a-z] )|STALE)' "$log" >"$OUT/summary.txt"; }
pack_aux() { tar czf "$OUT/aux.tgz.part" -C "$AUX" . 2>/dev/null && mv -f "$OUT/aux.tgz.part" "$OUT/aux.tgz"; summarize; }
trap pack_aux EXIT
# The whole run ends by GPU_CHECK_DEADLINE seconds (the device call's limit is 560): every
# step's limit is cut to the time left, and a step with under 5 s left is skipped (counted).
DEADLINE=${GPU_CHECK_DEADLINE:-530}
left() { echo $((DEADLINE - SECONDS - 5)); }
cut() { local l=$1; [ "$l" -le "$(left)" ] || l=$(left); [ "$l" -ge 5 ] && echo "$l"; }  # a limit cut to what is left; fails under 5 s
skip() { say "   SKIPPED (the deadline, $DEADLINE s, is near)"; skipped=$((skipped + 1)); return 2; }
check() {  # name, limit (s), command... (a program, or a shell function of this script)
  local name=$1 limit=$2; shift 2
  say "== $name: $*"
  limit=$(cut "$limit") || { skip; return 2; }
  local t0=$SECONDS
  local run=("$@")
  # timeout(1) runs programs only: a function runs in a bash that has it.
  declare -F "$1" >/dev/null && run=(bash -c "$(declare -f "$1"); \"\$@\"" _ "$@")
  # A hang in a C program ends in its own error (OXCCL_TIMEOUT_S names what it waited for)
  # before the step's limit; PyTorch's step unsets it.
  OXCCL_TIMEOUT_S=${CHECK_TIMEOUT_S:-30} timeout -k 5 "$limit" "${run[@]}" >>"$log" 2>&1
  local rc=$?
  case $rc in
    0) say "   ok ($((SECONDS - t0)) s)" ;;
    124 | 137) say "   TIMED OUT (limit $limit s)"; fails=$((fails + 1)) ;;
    *) say "   FAILED (rc=$rc, $((SECONDS - t0)) s)"; fails=$((fails + 1)) ;;
  esac
  return $rc
}
[ -f "$pack/lib/libnccl.so.2" ] || { say "no $pack: run scripts/gpu-check.sh --prepare here and carry target/gpu-check"; exit 2; }
OXLIB="$pack/lib"
B="$pack/bin"
export B OXLIB OUT AUX  # shell functions run under timeout in a child bash (check, perf)

say "# $(date -u) $(hostname) $(nproc) cores"
(cd "$root" && verify_pack && echo "# the pack is this tree's (built from $(cat "$pack/COMMIT" 2>/dev/null))") 2>&1 | tee -a "$log" || { say "   FAILED: the pack is not this tree's (scripts/gpu-check.sh --prepare)"; fails=$((fails + 1)); }
# What the machine's environment sets, logged, then cleared: only this script's own settings
# reach the steps (the NVIDIA baseline included).
say "# inherited: $(env | grep -E '^(NCCL|OXCCL|CUDA|LD_|TORCH)' | sort | tr '\n' ' ')"
for v in $(env | grep -oE '^(NCCL|OXCCL)_[A-Za-z0-9_]*'); do unset "$v"; done
unset LD_PRELOAD
timeout 20 nvidia-smi >>"$log" 2>&1 || say "(no nvidia-smi)"
# NVIDIA's NCCL, the CUDA runtime (for the perf tools) and NVRTC from the Python packages.
sites=$(python3 -c 'import site,sys; print(" ".join(site.getsitepackages()+[site.getusersitepackages()]))' 2>/dev/null)
findlib() { for s in $sites /usr/local/cuda /usr/lib/x86_64-linux-gnu; do timeout 20 find -L "$s/" -name "$1" 2>/dev/null | head -1; done | head -1; }
# NVIDIA's NCCL: the one torch loads (what PyTorch users run), else the first found.
NV_NCCL=$(timeout 60 python3 -c 'import torch
for l in open("/proc/self/maps"):
    if "libnccl.so" in l: print(l.split()[-1]); break' 2>/dev/null)
[ -n "$NV_NCCL" ] || NV_NCCL=$(findlib 'libnccl.so.2')
CUDART=$(findlib 'libcudart.so.1[0-9]*')
NVRTC=$(findlib 'libnvrtc.so.1[0-9]')
say "NVIDIA NCCL: ${NV_NCCL:-none}; cudart: ${CUDART:-none}; nvrtc: ${NVRTC:-none}"
timeout 60 python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())' >>"$log" 2>&1
[ -n "$NVRTC" ] && export OXCCL_NVRTC="$NVRTC"
# The library embeds nvcc's fatbin; NVRTC's images, compiled where the pack was made, serve the
# fallback (OXCCL_KERNELS=nvrtc below; a cache miss compiles them here with NVRTC).
export OXCCL_CACHE_DIR="${TMPDIR:-/tmp}/oxccl-kcache"
mkdir -p "$OXCCL_CACHE_DIR" && cp "$pack"/kcache/* "$OXCCL_CACHE_DIR"/ 2>/dev/null
ls "$OXCCL_CACHE_DIR" >>"$log"
RTDIR=$([ -n "$CUDART" ] && dirname "$CUDART")
BASE_LD_PATH=${LD_LIBRARY_PATH:-}  # (where the machine's libcuda may be: perf keeps it)
export LD_LIBRARY_PATH="$OXLIB${RTDIR:+:$RTDIR}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# 1. The CUDA executor on device buffers.
export NCCL_DEBUG=WARN
check "CUDA: 1 rank, every collective" 60 env NCCL_DEBUG=INFO "$B/coll_matrix" 1 cuda big=none
check "CUDA: 2 ranks (threads), six collectives and a send/recv ring" 60 "$B/cuda_ranks" 2 threads
says() {  # label, regex, command...: with NCCL_DEBUG=INFO (log in $AUX/<label>.log, kept) the
  # command must succeed and print a line the (extended) regex matches
  local log="$AUX/$1.log" re=$2; shift 2
  env NCCL_DEBUG=INFO "$@" >"$log" 2>&1; local rc=$?
  grep -v ' NCCL INFO ' "$log" | tail -3
  grep -Em2 "$re" "$log" || { echo "no line matches: $re"; return 1; }
  return $rc
}
export -f says  # functions that `check` runs in a child bash call it
kernels='CUDA kernels for sm_[0-9]+ on device [0-9]+'
check "CUDA: the kernels are the library's fatbin (nvcc)" 60 \
  says kernels-fatbin "$kernels: the library's own" "$B/coll_matrix" 1 cuda coll=AllReduce big=none
check "CUDA: the kernels from NVRTC (OXCCL_KERNELS=nvrtc)" 60 \
  says kernels-nvrtc "$kernels: (cached|NVRTC)" env OXCCL_KERNELS=nvrtc "$B/coll_matrix" 1 cuda coll=AllReduce big=none
check "CUDA: 2 ranks, every collective x datatype x op" 120 "$B/coll_matrix" 2 cuda big=none
check "CUDA: 4 ranks, every collective x datatype x op" 150 "$B/coll_matrix" 4 cuda
# ncclMemAlloc's memory comes from cuMemCreate (NCCL_CUMEM_ENABLE; an INFO line per
# allocation says so), with no fallback to cuMemAlloc (an INFO line would say why).
cumem() {
  says memalloc-3 "ncclMemAlloc: [0-9]+ bytes on device [0-9]+ at 0x[0-9a-f]+: cuMem" \
    env -u NCCL_CUMEM_ENABLE "$@" || return 1
  ! grep -m3 "cuMem allocation .* not made" "$AUX/memalloc-3.log"
}
check "CUDA: 3 ranks, ncclMemAlloc buffers (cuMem)" 90 cumem "$B/coll_matrix" 3 cuda memalloc big=none
check "CUDA: 4 ranks as threads" 60 "$B/cuda_ranks" 4 threads
check "CUDA: 4 ranks as threads, in place" 60 "$B/cuda_ranks" 4 threads inplace
check "CUDA: 2 ranks as processes" 60 "$B/cuda_ranks" 2 processes
check "CUDA: 4 ranks as processes, in place" 90 "$B/cuda_ranks" 4 processes inplace timeout=80
check "CUDA: 48 all-reduces in one group (the kernels' large parameter), 2 threads" 60 \
  "$B/cuda_ranks" 2 threads grouped
check "CUDA: 48 all-reduces in one group, 3 processes, in place" 90 \
  "$B/cuda_ranks" 3 processes inplace grouped timeout=80
# Collectives and a send/recv ring of 2 MiB (past the 512 KiB FIFO), grouped by even ranks,
# one by one by odd ones: the sends and receives run beside the group's collectives, on the
# communicator's side stream (new since the last GPU run, emulated device only).
check "CUDA: a group's sends and receives beside its collectives, 2 threads (board)" 60 \
  env OXCCL_CHUNK_BYTES=65536 "$B/cuda_ranks" 2 threads mixed
check "CUDA: a group's sends and receives beside its collectives, 3 processes" 90 \
  env OXCCL_CHUNK_BYTES=65536 "$B/cuda_ranks" 3 processes mixed timeout=80
check "CUDA: graph capture and replay, 2 ranks" 60 "$B/cuda_graph" 2
check "CUDA: graph capture, global capture mode" 60 "$B/cuda_graph" 2 global
check "CUDA: a peer process dies while an all-reduce waits for it" 60 "$B/cuda_peer_death" eager
check "CUDA: a peer process dies while a graph's replay waits for it" 60 "$B/cuda_peer_death" graph
# 9 ranks' all-to-all in one launch: 153 lanes, more than the GPU's SMs (132), each past a FIFO's
# depth: ends only because its lanes go in desc::lane_key's order (a hang here is the limit).
check "CUDA: alltoall of 9 ranks in one launch (more lanes than SMs)" 60 \
  "$B/alltoall_perf" -b 64M -e 64M -n 2 -w 1 -g 9 -c 1

# The TP/PP example (issue 15) on device buffers: 8 processes on the one GPU, the MLP in the
# example's own kernels (compiled with NVRTC at start-up), every collective on the GPU.
tppp() {
  local port=$((29700 + RANDOM % 200)) pids=() rc=0
  for r in 7 6 5 4 3 2 1 0; do
    # TPPP_HOSTS=2: ranks 0-3 and 4-7 on two "hosts" (the pipeline over the network).
    OXCCL_HOSTID=tppp$((r * ${TPPP_HOSTS:-1} / 8)) RANK=$r WORLD_SIZE=8 MASTER_ADDR=127.0.0.1 \
      MASTER_PORT=$port "$B/tp_pp_mlp" "$@" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  return $rc
}
check "CUDA: tp_pp_mlp 8 ranks --tp 4 --pp 2 --exact" 60 tppp --tp 4 --pp 2 --exact --device cuda
check "CUDA: tp_pp_mlp 8 ranks on 2 \"hosts\" (OXCCL_HOSTID), exact" 60 \
  env TPPP_HOSTS=2 bash -c "$(declare -f tppp); tppp --tp 4 --pp 2 --exact --microbatches 8 --device cuda"

pack_aux
# 2. Perf tools on the GPU; nranks=1 against NVIDIA's NCCL side by side.
perf() {  # label, lib dir, args...: the run must be the named library's (its version line;
  # ours on the CUDA executor), print its table, and find no wrong value
  local label=$1 dir=$2 t0=$SECONDS limit=${PERF_LIMIT:-120}; shift 2
  local f="$AUX/perf-$label.txt"
  say "== perf ($label): $*"
  limit=$(cut "$limit") || { skip; return 2; }
  local path="$dir${RTDIR:+:$RTDIR}${BASE_LD_PATH:+:$BASE_LD_PATH}"
  if declare -F "$1" >/dev/null; then  # a shell function: run it in a bash under the limit
    LD_LIBRARY_PATH="$path" timeout -k 5 "$limit" bash -c "$(declare -f "$1"); \"\$@\"" _ "$@" >"$f" 2>&1
  else
    LD_LIBRARY_PATH="$path" timeout -k 5 "$limit" "$@" >"$f" 2>&1
  fi
  local rc=$? why=""
  cat "$f" >>"$log"
  if [ "$dir" != "$OXLIB" ] && grep -q "undefined symbol" "$f"; then
    say "   (NVIDIA's library here lacks this tool's API: left out)"
    return 0
  fi
  if [ "$dir" = "$OXLIB" ]; then
    grep -q "NCCL version 2.32.3+oxccl" "$f" || why="no oxccl version line: not oxccl's library"
    # (Our tools print the executor; upstream's do not, and run with OXCCL_DEVICE=cuda, which
    # fails rather than fall back to the host executor.)
    grep -q "oxccl CUDA executor" "$f" || [[ " $* " == *" OXCCL_DEVICE=cuda "* ]] ||
      why="${why:+$why; }not on oxccl's CUDA executor"
  else
    grep -q "NCCL version" "$f" && ! grep -q "+oxccl" "$f" || why="no NVIDIA version line: not NVIDIA's library"
  fi
  grep -q "Avg bus bandwidth" "$f" || why="${why:+$why; }no table"
  ! grep -q "Out of bounds values : [1-9]" "$f" || why="${why:+$why; }wrong values"
  case $rc in
    0) ;;
    124 | 137) why="TIMED OUT (limit $limit s)${why:+; $why}" ;;
    *) why="rc=$rc${why:+; $why}" ;;
  esac
  [ -z "$why" ] || { say "   FAILED ($why)"; fails=$((fails + 1)); }
  say "   ($label: $((SECONDS - t0)) s; $SECONDS s into the check)"
}
# The measurements for the next defaults (section 5) run only while the check is inside its
# budget (GPU_CHECK_BUDGET seconds, default 420): they are the first to go when time runs short
# (every step also stops at the deadline). Plan for one call: 560 s of it, with the machine's
# start, leave too little of the 15 minutes for a second.
in_budget() {  # what would be skipped
  [ "$SECONDS" -lt "${GPU_CHECK_BUDGET:-420}" ] && return 0
  say "(past the budget of ${GPU_CHECK_BUDGET:-420} s at $SECONDS s: $1 left out)"
  return 1
}
# The perf tables' rows, for the target summaries below: {bytes: (time us, algbw, busbw)}.
cat >"$AUX/perfrows.py" <<'PY'
import sys
def rows(name):  # perf-<name>.txt in the folder the summary was given (argv[1])
    out = sys.argv[1]
    r = {}
    try:
        for line in open(f"{out}/perf-{name}.txt", errors="replace"):
            f = line.split()
            if len(f) >= 8 and f[0].isdigit():
                r[int(f[0])] = (float(f[5]), float(f[6]), float(f[7]))
    except OSError:
        pass
    return r
PY
sweep=(-b 8 -e 1G -f 4 -n 20 -w 5)
perf oxccl-g1 "$OXLIB" "$B/all_reduce_perf" "${sweep[@]}" -g 1
# The device-to-device copy bandwidth that the targets' limit is built on, measured apart from
# either library: torch's copy (the copy engine) and an SM kernel (a multiply by 1), 1 GiB,
# 20 calls each after 3 (the library's own nranks=1 copy and NVIDIA's join them below).
say "== device-to-device copy bandwidth, 1 GiB (torch)"
timeout 60 python3 - "$AUX" <<'PY' 2>&1 | tee -a "$log"
import sys, torch
n = 1 << 30
x = torch.ones(n, dtype=torch.uint8, device="cuda")
y = torch.empty_like(x)
xf, yf = x.view(torch.float32), y.view(torch.float32)
def rate(f, k=20):
    for _ in range(3):
        f()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(k):
        f()
    b.record()
    b.synchronize()
    return n / (a.elapsed_time(b) / k / 1e3) / 1e9
ce = rate(lambda: y.copy_(x))
sm = rate(lambda: torch.mul(xf, 1, out=yf))
open(f"{sys.argv[1]}/copybw.txt", "w").write(f"{ce} {sm}\n")
print(f"  torch copy_ (copy engine) {ce:.1f} GB/s, torch mul (SM kernel) {sm:.1f} GB/s")
PY
# (The GPU must be ours alone while the figures are taken: anything else on it is logged.)
timeout 10 nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2>&1 | sed 's/^/  other process on the GPU: /' | tee -a "$log"

if [ -n "$NV_NCCL" ]; then
  NVDIR=$(dirname "$NV_NCCL")
  perf nvidia-g1 "$NVDIR" "$B/all_reduce_perf" "${sweep[@]}" -g 1
  # One rank moves no bytes between ranks (busbw is 0): compare algbw, the copy's rate.
  say "== nranks=1 all_reduce algbw (out of place), oxccl vs NVIDIA"
  paste <(grep -E '^ +[0-9]+ ' "$AUX/perf-oxccl-g1.txt" | awk '{print $1, $7}') \
        <(grep -E '^ +[0-9]+ ' "$AUX/perf-nvidia-g1.txt" | awk '{print $7, $6}') |
    awk '{printf "%12s B  oxccl %9s GB/s  nvidia %9s GB/s  ratio %s   (nvidia %s us)\n", $1, $2, $3, ($3>0? sprintf("%.2f",$2/$3):"-"), $4}' | tee -a "$log"
  # Up to a few MiB a call takes 5-10 us on both, and one sweep's rows swing by 30% (12-06:
  # 0.72x to 1.18x): 200 calls a size, the two libraries in turn, twice, best of two.
  mid=(-b 8 -e 32M -f 4 -n 200 -w 20 -g 1)
  for round in 1 2; do
    perf "oxccl-g1-mid$round" "$OXLIB" "$B/all_reduce_perf" "${mid[@]}"
    perf "nvidia-g1-mid$round" "$NVDIR" "$B/all_reduce_perf" "${mid[@]}"
  done
  # Above 32 MiB: 64 MiB to 1 GiB, the two in turn, twice, best of two (no checks: the
  # sweeps above checked these sizes).
  big=(-b 64M -e 1G -f 2 -n 20 -w 5 -c 0 -g 1)
  for round in 1 2; do
    perf "oxccl-g1-big$round" "$OXLIB" "$B/all_reduce_perf" "${big[@]}"
    perf "nvidia-g1-big$round" "$NVDIR" "$B/all_reduce_perf" "${big[@]}"
  done
  python3 - "$AUX" <<'PY' 2>&1 | tee -a "$log"
import sys
out = sys.argv[1]
sys.path.insert(0, out)
from perfrows import rows
def best(lib, col, pick):
    runs = [rows(f"{lib}-g1-{k}") for k in ("mid1", "mid2", "big1", "big2")]
    return {b: pick(r[b][col] for r in runs if b in r) for b in set().union(*runs)}
ox, nv = best("oxccl", 1, max), best("nvidia", 1, max)
to, tn = best("oxccl", 0, min), best("nvidia", 0, min)
print("== nranks=1 all_reduce against NVIDIA's, the two in turn, best of two runs each (8 B-32 MiB: 200 calls a size; 64 MiB-1 GiB: 20): algbw (GB/s), or time (us) below 64 KiB")
worst = None
for b in sorted(set(ox) & set(nv)):
    if b < 1 << 16:
        # The tools print 0.00 GB/s there: compare times (NVIDIA's over ours).
        r = tn[b] / to[b] if to[b] > 0 else float("nan")
        print(f"  {b:>10} B  oxccl {to[b]:8.2f} us  nvidia {tn[b]:8.2f} us  ratio {r:.2f}")
    elif nv[b] > 0:
        r = ox[b] / nv[b]
        print(f"  {b:>10} B  oxccl {ox[b]:8.1f}  nvidia {nv[b]:8.1f}  ratio {r:.2f}")
    else:
        continue
    if r == r:
        worst = r if worst is None else min(worst, r)
if worst is None:
    print("  nranks=1 against NVIDIA: no rows to compare FAIL")
else:
    print(f"  nranks=1, 8 B-1 GiB: worst ratio {worst:.2f} {'PASS' if worst >= 1 else 'FAIL'} (target >= 1 at every size)")
PY
else
  say "   FAILED: NVIDIA's libnccl.so.2 was not found: the nranks=1 comparison is missing"
  fails=$((fails + 1))
fi
perf oxccl-g2 "$OXLIB" "$B/all_reduce_perf" "${sweep[@]}" -g 2
# (Up to 128 MiB with checks: at 1 GiB the tool's own set-up and checks of 4 x 1 GiB on the
# host take longer than the limit; 1 GiB itself runs below, unchecked.)
perf oxccl-g4 "$OXLIB" "$B/all_reduce_perf" -b 8 -e 256M -f 8 -n 10 -w 3 -g 4
# The targets' sizes exactly (the sweeps' sizes stop at 512 MiB and 128 MiB): 1 GiB, no checks;
# 8 bytes over 2 ranks, 1000 calls, twice.
for n in 1 2 4; do
  perf "oxccl-g$n-1g" "$OXLIB" "$B/all_reduce_perf" -b 1G -e 1G -n 20 -w 5 -c 0 -g $n
done
for round in 1 2; do
  perf "oxccl-g2-8b$round" "$OXLIB" "$B/all_reduce_perf" -b 8 -e 8 -n 1000 -w 100 -g 2
done
# Issue 13's targets: n ranks on one GPU read n inputs and write n outputs, so busbw is at
# most (n-1)/n^2 x 2 x the device-to-device copy bandwidth (the largest of the copies measured
# in this run): >= 80% of it at 1 GiB; 8-byte all-reduce over 2 ranks <= 15 us; nranks=1
# >= NVIDIA's at every size (above).
python3 - "$AUX" <<'PY' 2>&1 | tee -a "$log"
import sys
out = sys.argv[1]
sys.path.insert(0, out)
from perfrows import rows
G = 1 << 30
print("== issue 13 targets")
copies = {}
try:
    ce, sm = (float(x) for x in open(f"{out}/copybw.txt").read().split())
    copies["torch copy_"], copies["torch mul"] = ce, sm
except (OSError, ValueError):
    pass
for name in ("oxccl-g1-1g", "nvidia-g1-big1", "nvidia-g1-big2"):
    if G in rows(name):
        copies[name] = rows(name)[G][1]
if copies:
    which, copy = max(copies.items(), key=lambda kv: kv[1])
    print("  copy, 1 GiB: " + ", ".join(f"{k} {v:.1f}" for k, v in copies.items()) + f" GB/s; the limit takes {which}")
    for n in (2, 4):
        r, lim = rows(f"oxccl-g{n}-1g"), (n - 1) / n**2 * 2 * copy
        if G in r:
            bw = r[G][2]
            print(f"  {n} ranks, 1 GiB: busbw {bw:.1f} GB/s, limit {lim:.1f}: {bw / lim:.0%} {'PASS' if bw >= 0.8 * lim else 'FAIL'} (target 80%)")
        else:
            print(f"  {n} ranks, 1 GiB: no row FAIL")
else:
    print("  no copy bandwidth was measured FAIL")
t8 = [t[0] for t in (rows(f"oxccl-g2-8b{k}").get(8) for k in (1, 2)) if t]
if t8:
    print(f"  8-byte all-reduce, 2 ranks, best of two runs of 1000 calls: {min(t8):.1f} us {'PASS' if min(t8) <= 15 else 'FAIL'} (target 15 us)")
else:
    print("  8-byte all-reduce, 2 ranks: no row FAIL")
PY
pack_aux

# 3. PyTorch through LD_PRELOAD.
if [ -f "$root/scripts/gpu-torch-check.py" ]; then
  check "PyTorch: torch.distributed nccl, world 1 and 2, CUDA graph" 300 \
    env -u OXCCL_TIMEOUT_S LD_PRELOAD="$OXLIB/libnccl.so.2" python3 "$root/scripts/gpu-torch-check.py" --timeout 120
fi

pack_aux
# 3a. NVIDIA's own perf tools (upstream nccl-tests), built where the pack was made against
#     NVIDIA's headers and linked to libnccl.so.2, as users' binaries are: unchanged on our
#     library (OXCCL_DEVICE=cuda: no silent host executor; NCCL_DEBUG=VERSION: the version line
#     says which library ran). Without MPI they put rank r on GPU r, so one GPU holds one rank:
#     every tool with its data checked (buffers from ncclMemAlloc), every datatype x op, CUDA
#     graphs (-G), registered buffers (-R 1), the NULL stream and blocking waits (its
#     all_reduce_perf beside NVIDIA's library comes in section 5, inside the budget).
if [ -f "$pack/nccl-tests.tgz" ]; then
  UP="${TMPDIR:-/tmp}/gpu-check-nccl-tests"
  rm -rf "$UP" && mkdir -p "$UP"
  tar xzf "$pack/nccl-tests.tgz" -C "$UP" || { say "   FAILED: nccl-tests.tgz did not unpack"; fails=$((fails + 1)); }
  UP="$UP/nccl-tests"
  say "# $(cat "$UP/VERSION" 2>/dev/null)"
  up=(env OXCCL_DEVICE=cuda NCCL_DEBUG=VERSION)
  for t in all_reduce all_gather broadcast reduce reduce_scatter alltoall alltoallv gather scatter sendrecv hypercube; do
    PERF_LIMIT=30 perf "upstream-$t" "$OXLIB" "${up[@]}" "$UP/${t}_perf" -b 8 -e 32M -f 32 -n 5 -w 1 -c 1 -g 1
  done
  PERF_LIMIT=60 perf upstream-types-ops "$OXLIB" "${up[@]}" "$UP/all_reduce_perf" -d all -o all -b 8 -e 1M -f 128 -n 2 -w 1 -c 1 -g 1
  PERF_LIMIT=30 perf upstream-graphs "$OXLIB" "${up[@]}" "$UP/all_reduce_perf" -G 3 -b 8 -e 16M -f 64 -n 5 -w 1 -c 1 -g 1
  for t in all_reduce sendrecv; do
    PERF_LIMIT=30 perf "upstream-$t-registered" "$OXLIB" "${up[@]}" "$UP/${t}_perf" -R 1 -b 8 -e 16M -f 64 -n 5 -w 1 -c 1 -g 1
  done
  PERF_LIMIT=30 perf upstream-nullstream-blocking "$OXLIB" "${up[@]}" "$UP/all_reduce_perf" -y 1 -z 1 -u 1 -b 8 -e 1M -f 64 -n 5 -w 1 -c 1 -g 1
else
  say "   FAILED: no nccl-tests.tgz in the pack (NCCL_TESTS_SRC=none at --prepare?): NVIDIA's own tools did not run"
  fails=$((fails + 1))
fi

pack_aux
# 3b. More perf: the CPU time per call, bfloat16, host-staged, processes, "hosts", every tool.
if [ -n "$NV_NCCL" ]; then
  # Where both take a few microseconds a call, the host's cost of a call decides (12-06: ours
  # 8.5 us at 512 B against NVIDIA's 5.7): the CPU time of an enqueue (-C 1), side by side.
  cpu=(-b 8 -e 512K -f 16 -n 200 -w 20 -c 0 -C 1 -g 1)
  perf oxccl-g1-cpu "$OXLIB" "$B/all_reduce_perf" "${cpu[@]}"
  perf nvidia-g1-cpu "$NVDIR" "$B/all_reduce_perf" "${cpu[@]}"
  say "== nranks=1 all_reduce, CPU time per call (us, out of place), oxccl vs NVIDIA"
  paste <(grep -E '^ +[0-9]+ ' "$AUX/perf-oxccl-g1-cpu.txt" | awk '{print $1, $6}') \
        <(grep -E '^ +[0-9]+ ' "$AUX/perf-nvidia-g1-cpu.txt" | awk '{print $6}') |
    awk '{printf "%12s B  oxccl %8s us  nvidia %8s us\n", $1, $2, $3}' | tee -a "$log"
fi
# bfloat16 (what tensor parallelism all-reduces): its kernels go element by element where
# f32 moves 16-byte packs; the gap to the f32 run above says whether packs for 2-byte types
# (+60% kernel compile time, more registers: tried 12-05, not landed) would pay.
perf oxccl-g2-bf16 "$OXLIB" "$B/all_reduce_perf" -b 1M -e 256M -f 4 -n 10 -w 3 -g 2 -d bfloat16
perf oxccl-g2-hoststaged "$OXLIB" env NCCL_P2P_DISABLE=1 OXCCL_CUDA_DIRECT=0 "$B/all_reduce_perf" -b 8 -e 64M -f 8 -n 10 -w 3 -g 2
# Two processes on the one GPU (the GPU time-slices them);
# "hosts": as two "hosts" (OXCCL_HOSTID), so that the network transport's proxies move the
# GPU's pinned FIFOs over TCP (issue 14 on the CUDA executor), NET/Socket in rank 0's log.
two_procs() {  # same|hosts, command...
  local where=$1 port=$((29800 + RANDOM % 190)) rc=0 h0="" h1=""
  shift
  [ "$where" = hosts ] && h0="OXCCL_HOSTID=gpuhost0 NCCL_DEBUG=INFO" h1="OXCCL_HOSTID=gpuhost1"
  # shellcheck disable=SC2086 # h0 and h1 are VAR=value words
  env $h1 RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "$@" >"$AUX/rank1-$port-$RANDOM.txt" 2>&1 &
  local p=$!
  # shellcheck disable=SC2086
  env $h0 RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "$@" || rc=1
  wait $p || rc=1
  return $rc
}
# (In pinned host memory here, OXCCL_CUDA_IPC=0; by CUDA IPC, the default, in section 5.)
perf oxccl-2procs-host "$OXLIB" env OXCCL_CUDA_IPC=0 bash -c \
  "$(declare -f two_procs); two_procs same $B/all_reduce_perf -b 8 -e 16M -f 8 -n 5 -w 2 -g 1"
perf oxccl-2hosts "$OXLIB" two_procs hosts "$B/all_reduce_perf" -b 8 -e 64M -f 8 -n 5 -w 2 -g 1
grep -m2 "via NET" "$AUX/perf-oxccl-2hosts.txt" 2>/dev/null | tee -a "$log"
perf sendrecv-2hosts "$OXLIB" two_procs hosts "$B/sendrecv_perf" -b 8 -e 64M -f 8 -n 5 -w 2 -g 1
for t in all_gather broadcast reduce_scatter alltoall sendrecv gather scatter hypercube; do
  perf "$t-g2" "$OXLIB" "$B/${t}_perf" -b 8 -e 64M -f 8 -n 10 -w 3 -g 2
done

# Every other tool at nranks=1 against NVIDIA's, side by side (a tool whose API NVIDIA's library
# here lacks is left out, not failed).
if [ -n "$NV_NCCL" ]; then
  tools=(all_gather broadcast reduce reduce_scatter alltoall sendrecv gather scatter hypercube)
  for t in "${tools[@]}"; do
    perf "oxccl-$t-g1" "$OXLIB" "$B/${t}_perf" -b 8 -e 64M -f 8 -n 10 -w 3 -g 1
    perf "nvidia-$t-g1" "$NVDIR" "$B/${t}_perf" -b 8 -e 64M -f 8 -n 10 -w 3 -g 1
  done
  python3 - "$AUX" "${tools[@]}" <<'PY' 2>&1 | tee -a "$log"
import sys
out, tools = sys.argv[1], sys.argv[2:]
sys.path.insert(0, out)
from perfrows import rows
print("== nranks=1, every tool: algbw (GB/s) from 64 KiB, oxccl against NVIDIA")
for t in tools:
    ox, nv = rows(f"oxccl-{t}-g1"), rows(f"nvidia-{t}-g1")
    cells = [f"{b >> 10} KiB {ox[b][1] / nv[b][1]:.2f}" for b in sorted(set(ox) & set(nv)) if b >= 1 << 16 and nv[b][1] > 0]
    print(f"  {t:>15}: " + ("  ".join(cells) if cells else "no rows to compare"))
PY
fi
pack_aux
# 5. CUDA IPC between processes and the direct all-reduce (both on by default since 12-06)
#    with what they replaced beside them (pinned host memory, the ring), what is off by default
#    until this check has passed, and measurements for the next defaults (last: a run cut
#    short by its limit, or a hang, keeps everything above).
unset OXCCL_DEVICE
# Processes by default take CUDA IPC (connections in the receiving end's device memory): the
# connection lines must say P2P/IPC (`says`); with OXCCL_CUDA_IPC=0, pinned host memory (SHM).
check "CUDA IPC (default): 3 ranks as processes" 60 \
  says ipc-ranks3 "via P2P/IPC" "$B/cuda_ranks" 3 processes
check "CUDA IPC (default): tp_pp_mlp 8 ranks --tp 4 --pp 2 --exact" 60 \
  says ipc-tppp "via P2P/IPC" bash -c "$(declare -f tppp); tppp --tp 4 --pp 2 --exact --device cuda"
check "pinned host memory (OXCCL_CUDA_IPC=0): 2 ranks as processes" 60 \
  says host-ranks2 "via SHM" env OXCCL_CUDA_IPC=0 "$B/cuda_ranks" 2 processes
check "pinned host memory (OXCCL_CUDA_IPC=0): 4 ranks as processes, in place" 90 \
  says host-ranks4 "via SHM" env OXCCL_CUDA_IPC=0 "$B/cuda_ranks" 4 processes inplace timeout=80
perf oxccl-2procs-ipc "$OXLIB" env NCCL_DEBUG=INFO bash -c \
  "$(declare -f two_procs); two_procs same $B/all_reduce_perf -b 8 -e 64M -f 8 -n 5 -w 2 -g 1"
grep -m2 "via P2P/IPC" "$AUX/perf-oxccl-2procs-ipc.txt" | tee -a "$log" ||
  { say "   FAILED: no connection via P2P/IPC by default"; fails=$((fails + 1)); }
# Two GPUs or more (every lent machine so far had one): ranks on two GPUs joined by NVLink keep
# their connections in device memory, in one process (P2P/direct pointer) and between
# processes (P2P/IPC, the default); the perf tools put rank r on GPU r % count.
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "${ngpu:-0}" -ge 2 ]; then
  nvidia-smi topo -m >>"$log" 2>&1
  check "CUDA, 2 GPUs: all_reduce_perf -g 2 (one process)" 60 \
    says p2p-g2 "via P2P/direct pointer" "$B/all_reduce_perf" -b 8 -e 64M -f 8 -n 5 -w 1 -g 2 -c 1
  check "CUDA, 2 GPUs: 2 ranks as processes (CUDA IPC)" 60 \
    says p2p-ipc "via P2P/IPC" bash -c \
    "$(declare -f two_procs); two_procs same $B/all_reduce_perf -b 8 -e 64M -f 8 -n 5 -w 1 -g 1 -c 1"
else
  say "(one GPU: the two-GPU checks are left out)"
fi
# The direct all-reduce (the default: one kernel reads every rank's input and writes every
# rank's output, where one group holds every rank of a communicator on the GPU): every
# datatype x op (PreMulSum with host and device scalars, avg) on 2, 3, 4 and 8 ranks, whose logs
# must say the direct algorithm ran for every all-reduce; then the ring's (OXCCL_CUDA_DIRECT=0)
# bandwidth on 2 and 4 ranks beside the default's.
direct() {  # label, command...: by default the command must succeed, its all-reduces must
  # have taken the direct kernel (NCCL_DEBUG_SUBSYS=TUNING), and none the ring or another
  # algorithm (a silent fallback would make the target rows above the ring's)
  local label=$1; shift
  says "$label" "Algo Direct \(one kernel" env NCCL_DEBUG_SUBSYS=TUNING "$@" || return 1
  ! grep -E "AllReduce: [1-9][0-9]* Bytes -> Algo " "$AUX/$label.log" | grep -vFm3 "Algo Direct (one kernel"
}
export -f direct
# (Only all-reduces change: coll_matrix runs those alone.)
check "CUDA direct: 2 ranks, AllReduce x datatype x op" 60 direct direct-2 "$B/coll_matrix" 2 cuda coll=AllReduce
check "CUDA direct: 3 ranks, ncclMemAlloc buffers" 60 direct direct-3 "$B/coll_matrix" 3 cuda memalloc coll=AllReduce
check "CUDA direct: 4 ranks" 90 direct direct-4 "$B/coll_matrix" 4 cuda coll=AllReduce
check "CUDA direct: 8 ranks (the kernel for up to 16)" 90 \
  direct direct-8 "$B/coll_matrix" 8 cuda coll=AllReduce big=none
check "CUDA direct: all_reduce_perf -g 2 takes it" 30 \
  direct direct-perf "$B/all_reduce_perf" -b 8 -e 1M -f 32 -n 1 -w 0 -g 2
# The device board (new since the last GPU run, emulated device only): ranks of one process
# on the GPU that launch apart (a thread per rank) meet there; every all-reduce must say so.
board() {  # label, command...: as `direct`, for `Algo Direct (device board`
  local label=$1; shift
  says "$label" "Algo Direct \(device board" env NCCL_DEBUG_SUBSYS=TUNING "$@" || return 1
  ! grep -E "AllReduce: [1-9][0-9]* Bytes -> Algo " "$AUX/$label.log" | grep -vFm3 "Algo Direct (device board"
}
export -f board
check "CUDA board: 2 ranks as threads, six collectives and a send/recv ring" 60 \
  board board-threads2 "$B/cuda_ranks" 2 threads
check "CUDA board: 4 ranks as threads, in place" 60 board board-threads4 "$B/cuda_ranks" 4 threads inplace
check "CUDA board: all_reduce_perf -t 2 takes it" 30 \
  board board-perf "$B/all_reduce_perf" -b 8 -e 1M -f 32 -n 1 -w 0 -t 2 -g 1
# (The TP/PP example's other shapes.)
check "CUDA: tp_pp_mlp 8 ranks, float, H 512, 4 layers" 60 \
  tppp --tp 4 --pp 2 --hidden 512 --layers 4 --microbatches 8 --batch 32 --device cuda
check "CUDA: tp_pp_mlp 8 ranks, rows-first, exact" 60 \
  tppp --tp 4 --pp 2 --exact --split rows-first --device cuda
perf oxccl-t2 "$OXLIB" "$B/all_reduce_perf" -b 8 -e 1G -f 8 -n 10 -w 3 -t 2 -g 1
perf oxccl-t4 "$OXLIB" "$B/all_reduce_perf" -b 8 -e 256M -f 8 -n 10 -w 3 -t 4 -g 1
for t in all_gather reduce_scatter broadcast reduce; do
  perf "$t-t2" "$OXLIB" "$B/${t}_perf" -b 8 -e 64M -f 8 -n 5 -w 2 -t 2 -g 1
done
python3 - "$AUX" <<'PY' 2>&1 | tee -a "$log"
import sys
out = sys.argv[1]
sys.path.insert(0, out)
from perfrows import rows
g1 = rows("oxccl-g1")
print("== ranks as threads (the device board) against the limit and the one-kernel rows (-g)")
for n, t, g in ((2, "oxccl-t2", "oxccl-g2"), (4, "oxccl-t4", "oxccl-g4")):
    r, d = rows(t), rows(g)
    if g1 and r:
        lim = (n - 1) / n**2 * 2 * g1[max(g1)][1]
        b = max(r)
        print(f"  {n} threads: busbw {r[b][2]:.1f} GB/s at {b} B ({r[b][2] / lim:.0%} of the limit "
              f"{lim:.1f}; -g {n}: {d.get(b, (0, 0, 0))[2]:.1f})")
    if r.get(8):
        print(f"  {n} threads, 8 B: {r[8][0]:.1f} us (-g {n}: {d.get(8, (0, 0, 0))[0]:.1f})")
PY
# The ring's all-reduces in one process, which the matrices above no longer run by default.
check "CUDA ring (OXCCL_CUDA_DIRECT=0): 2 ranks, AllReduce x datatype x op" 60 \
  env OXCCL_CUDA_DIRECT=0 "$B/coll_matrix" 2 cuda coll=AllReduce
perf oxccl-g2-ring "$OXLIB" env OXCCL_CUDA_DIRECT=0 "$B/all_reduce_perf" "${sweep[@]}" -g 2
perf oxccl-g4-ring "$OXLIB" env OXCCL_CUDA_DIRECT=0 "$B/all_reduce_perf" -b 8 -e 256M -f 8 -n 10 -w 3 -g 4
# Device-scope step fences on the ring (OXCCL_CUDA_FENCE=gpu, off by default): every
# all-reduce of the matrix checked.
check "CUDA ring with device-scope fences (OXCCL_CUDA_FENCE=gpu): 2 ranks, AllReduce x datatype x op" 60 \
  says fence-matrix "device-scope fences" env OXCCL_CUDA_DIRECT=0 OXCCL_CUDA_FENCE=gpu \
  "$B/coll_matrix" 2 cuda coll=AllReduce
perf all_reduce-g2-fence "$OXLIB" env OXCCL_CUDA_DIRECT=0 OXCCL_CUDA_FENCE=gpu "$B/all_reduce_perf" -b 1M -e 128M -f 4 -n 10 -w 3 -g 2
# The ring split across 4 rings that run at once (OXCCL_CUDA_CHANNELS=4, off by default):
# all-reduce, broadcast and reduce checked by the tools (#wrong), 1-64 MiB, 2 ranks.
# (After a failure the other two are left out: an untested mode that hangs would spend the
# device call's time.)
for t in all_reduce broadcast reduce; do
  before=$fails
  perf "$t-g2-ch4" "$OXLIB" env OXCCL_CUDA_DIRECT=0 OXCCL_CUDA_CHANNELS=4 "$B/${t}_perf" -b 1M -e 64M -f 4 -n 10 -w 3 -g 2
  [ "$fails" -eq "$before" ] || { say "   (4 channels failed: the other tools with them left out)"; break; }
done
python3 - "$AUX" <<'PY' 2>&1 | tee -a "$log"
import sys
out = sys.argv[1]
sys.path.insert(0, out)
from perfrows import rows
g1 = rows("oxccl-g1")
print("== the ring (OXCCL_CUDA_DIRECT=0) beside the default (direct) rows of the targets above")
for n, name in ((2, "oxccl-g2"), (4, "oxccl-g4")):
    d, ring = rows(name), rows(name + "-ring")
    if g1 and ring:
        top = max(g1)
        lim = (n - 1) / n**2 * 2 * g1[top][1]
        b = max(ring)
        print(f"  {n} ranks: ring busbw {ring[b][2]:.1f} GB/s at {b} B (default {d.get(b, (0, 0, 0))[2]:.1f}); "
              f"limit {lim:.1f}: ring {ring[b][2] / lim:.0%}")
    if n == 2 and ring.get(8):
        print(f"  8-byte all-reduce, 2 ranks: ring {ring[8][0]:.1f} us")
PY
# Sends by reference between ranks of one process on one GPU (the default past a FIFO's worth,
# 8 MiB a connection: the receiver reads the sender's buffer) beside NCCL_P2P_DIRECT_DISABLE=1
# (every byte through the FIFO's slots): send/recv, and the ring's all-reduce, on 2 ranks, the
# data checked by the tools (#wrong).
if in_budget "sends by reference beside the slots"; then
  perf sendrecv-g2 "$OXLIB" "$B/sendrecv_perf" -b 2M -e 512M -f 4 -n 10 -w 3 -g 2
  perf sendrecv-g2-slots "$OXLIB" env NCCL_P2P_DIRECT_DISABLE=1 "$B/sendrecv_perf" -b 2M -e 512M -f 4 -n 10 -w 3 -g 2
  perf oxccl-g2-ring-slots "$OXLIB" env OXCCL_CUDA_DIRECT=0 NCCL_P2P_DIRECT_DISABLE=1 "$B/all_reduce_perf" -b 2M -e 512M -f 4 -n 10 -w 3 -g 2
  python3 - "$AUX" <<'PY' 2>&1 | tee -a "$log"
import sys
sys.path.insert(0, sys.argv[1])
from perfrows import rows
print("== sends by reference (default) / through the slots (NCCL_P2P_DIRECT_DISABLE=1), busbw, 2 ranks on the GPU")
for what, ref, slots in (("send/recv", "sendrecv-g2", "sendrecv-g2-slots"),
                         ("ring all-reduce", "oxccl-g2-ring", "oxccl-g2-ring-slots")):
    a, b = rows(ref), rows(slots)
    for size in sorted(set(a) & set(b)):
        if size >= 1 << 20 and b[size][2] > 0:
            print(f"  {what} {size} B: {a[size][2]:.1f} / {b[size][2]:.1f} GB/s = {a[size][2] / b[size][2]:.2f}")
PY
fi
# Registered buffers between two processes on the one GPU (CUDA IPC): with -R 1 the tool
# registers its buffers (ncclMemAlloc: cuMem memory, which the other process maps by a file
# descriptor; with NCCL_CUMEM_ENABLE=0 cuMemAlloc memory, opened by its legacy IPC handle),
# and the other process's kernels read them where they are, beside the same transfers through
# the slots; the data checked by the tool (#wrong). (The processes time-slice the GPU without
# MPS: slow either way; the ratio is what counts.)
if in_budget "registered buffers between processes"; then
  perf sendrecv-2procs-registered "$OXLIB" bash -c \
    "$(declare -f two_procs); two_procs same $B/sendrecv_perf -R 1 -b 4M -e 64M -f 4 -n 5 -w 2 -g 1"
  perf sendrecv-2procs-registered-legacy "$OXLIB" env NCCL_CUMEM_ENABLE=0 bash -c \
    "$(declare -f two_procs); two_procs same $B/sendrecv_perf -R 1 -b 4M -e 64M -f 4 -n 5 -w 2 -g 1"
  perf sendrecv-2procs-slots "$OXLIB" env NCCL_CUMEM_ENABLE=0 bash -c \
    "$(declare -f two_procs); two_procs same $B/sendrecv_perf -b 4M -e 64M -f 4 -n 5 -w 2 -g 1"
  python3 - "$AUX" <<'PY' 2>&1 | tee -a "$log"
import sys
sys.path.insert(0, sys.argv[1])
from perfrows import rows
print("== registered buffers read in place / through the slots, send/recv busbw, 2 processes on the GPU")
b = rows("sendrecv-2procs-slots")
for label, reg in (("ncclMemAlloc (cuMem)", "sendrecv-2procs-registered"),
                   ("cuMemAlloc (legacy IPC)", "sendrecv-2procs-registered-legacy")):
    a = rows(reg)
    for size in sorted(set(a) & set(b)):
        if b[size][2] > 0:
            print(f"  {label} {size} B: {a[size][2]:.2f} / {b[size][2]:.2f} GB/s = {a[size][2] / b[size][2]:.2f}")
PY
fi
# NVIDIA's own all_reduce_perf (section 3a) at nranks=1 on both libraries, 8 B-1 GiB, one run
# each (section 2 has our tool's best of two): the same figures from NVIDIA's binary.
if [ -n "$NV_NCCL" ] && [ -x "${UP:-}/all_reduce_perf" ] && in_budget "NVIDIA's all_reduce_perf on both libraries"; then
  upsweep=(-b 8 -e 1G -f 8 -n 20 -w 5 -c 0 -g 1)
  perf upstream-oxccl-g1 "$OXLIB" env OXCCL_DEVICE=cuda NCCL_DEBUG=VERSION "$UP/all_reduce_perf" "${upsweep[@]}"
  perf upstream-nvidia-g1 "$NVDIR" env NCCL_DEBUG=VERSION "$UP/all_reduce_perf" "${upsweep[@]}"
  python3 - "$AUX" <<'PY' 2>&1 | tee -a "$log"
import sys
out = sys.argv[1]
sys.path.insert(0, out)
from perfrows import rows
ox, nv = rows("upstream-oxccl-g1"), rows("upstream-nvidia-g1")
print("== NVIDIA's all_reduce_perf, nranks=1: oxccl against NVIDIA's library (one run each), time (us) below 64 KiB, algbw above")
both = sorted(set(ox) & set(nv))
for b in both:
    o, n = ox[b], nv[b]
    r = (n[0] / o[0] if o[0] > 0 else float("nan")) if b < 1 << 16 else (o[1] / n[1] if n[1] > 0 else float("nan"))
    print(f"  {b:>12} B  oxccl {o[0]:9.2f} us {o[1]:7.1f} GB/s  nvidia {n[0]:9.2f} us {n[1]:7.1f} GB/s  ratio {r:.2f}")
if not both:
    print("  no rows to compare (a run failed, or NVIDIA's library lacks the tool's API: see above)")
PY
fi
# nranks=1 with every copy on the wide kernel (OXCCL_CUDA_CE_COPY_BYTES=1) and on the copy
# kernel (with OXCCL_CUDA_COPY_KERNEL=1) against the copy engine (the default, as NVIDIA's NCCL
# copies: on an H100 on 12-06 it beat both kernels at every size) and NVIDIA's NCCL (the rows
# of section 2).
if in_budget "nranks=1 on the kernels"; then
perf oxccl-g1-wide "$OXLIB" env OXCCL_CUDA_CE_COPY_BYTES=1 "$B/all_reduce_perf" "${sweep[@]}" -g 1
perf oxccl-g1-copy "$OXLIB" env OXCCL_CUDA_CE_COPY_BYTES=1 OXCCL_CUDA_COPY_KERNEL=1 "$B/all_reduce_perf" "${sweep[@]}" -g 1
python3 - "$AUX" <<'PY' 2>&1 | tee -a "$log"
import sys
out = sys.argv[1]
sys.path.insert(0, out)
from perfrows import rows
wide, copy, ce, nv = rows("oxccl-g1-wide"), rows("oxccl-g1-copy"), rows("oxccl-g1"), rows("nvidia-g1")
print("== nranks=1 all_reduce algbw (GB/s) from 64 KiB: wide kernel, copy kernel, copy engine, NVIDIA")
for b in sorted(set(copy) | set(wide)):
    if b >= 1 << 16:
        w, c, e, n = (r.get(b, (0, 0, 0))[1] for r in (wide, copy, ce, nv))
        best = max((w, "wide"), (c, "copy"), (e, "engine"))
        print(f"  {b:>12} B  wide {w:8.1f}  copy {c:8.1f}  engine {e:8.1f}  nvidia {n:8.1f}  "
              f"best {best[1]} {best[0] / n if n else float('nan'):.2f}x nvidia")
PY
fi
# Two processes on the one GPU under MPS, where the machine has it: their kernels then share
# the GPU at once instead of time-slicing (0.46 GB/s at 16 MiB without it on 12-06). Before
# the tuning runs, which the budget may cut; the daemon is stopped after.
if in_budget "the run under MPS"; then
if command -v nvidia-cuda-mps-control >/dev/null; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/oxccl-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/oxccl-mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  # (Bounded, and not through a pipe: the daemon may keep an inherited pipe open.)
  if timeout 10 nvidia-cuda-mps-control -d >>"$log" 2>&1; then
    # Pinned host memory (OXCCL_CUDA_IPC=0) against connections in device memory opened by
    # CUDA IPC (the default since 12-06): without MPS both took the 4.5 ms time slice.
    perf oxccl-2procs-mps "$OXLIB" env OXCCL_CUDA_IPC=0 bash -c \
      "$(declare -f two_procs); two_procs same $B/all_reduce_perf -b 8 -e 64M -f 8 -n 10 -w 3 -g 1"
    perf oxccl-2procs-mps-ipc "$OXLIB" two_procs same "$B/all_reduce_perf" -b 8 -e 64M -f 8 -n 10 -w 3 -g 1
    python3 - "$AUX" <<'PY' 2>&1 | tee -a "$log"
import sys
out = sys.argv[1]
sys.path.insert(0, out)
from perfrows import rows
host, ipc = rows("oxccl-2procs-mps"), rows("oxccl-2procs-mps-ipc")
print("== 2 processes on the one GPU under MPS, all_reduce: pinned host memory (OXCCL_CUDA_IPC=0) against CUDA IPC (default)")
for b in sorted(set(host) | set(ipc)):
    h, i = host.get(b, (0, 0, 0)), ipc.get(b, (0, 0, 0))
    print(f"  {b:>10} B  host {h[0]:9.1f} us {h[2]:7.2f} GB/s   ipc {i[0]:9.1f} us {i[2]:7.2f} GB/s")
PY
    echo quit | timeout 10 nvidia-cuda-mps-control
  else
    say "(MPS did not start: the two-process run under MPS is left out)"
  fi
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
else
  say "(no nvidia-cuda-mps-control: the two-process run under MPS is left out)"
fi
fi
# Blocks per lane (OXCCL_CUDA_BLOCKS, default 8) and slot size (OXCCL_CHUNK_BYTES, 1 MiB on the
# CUDA executor) against 2 ranks' ring bandwidth (what ranks in threads or processes of their
# own, and GPUs over P2P, run), over the sizes: at 64 MiB on 12-06, 32 blocks and 4 MiB slots
# gave 203 GB/s and 64 blocks 232, against 64 by default; the ring split across 2 or 4
# rings that run at once (OXCCL_CUDA_CHANNELS); device-scope step fences (OXCCL_CUDA_FENCE).
# What the next defaults should be.
if in_budget "the ring tuning sweep"; then
tune=("OXCCL_CUDA_BLOCKS=32 OXCCL_CHUNK_BYTES=4M" "OXCCL_CUDA_BLOCKS=64 OXCCL_CHUNK_BYTES=4M"
  "OXCCL_CUDA_BLOCKS=64 OXCCL_CHUNK_BYTES=2M" "OXCCL_CUDA_CHANNELS=2" "OXCCL_CUDA_CHANNELS=4"
  "OXCCL_CUDA_CHANNELS=4 OXCCL_CUDA_BLOCKS=16 OXCCL_CHUNK_BYTES=4M" "OXCCL_CUDA_FENCE=gpu"
  "OXCCL_CUDA_FENCE=gpu OXCCL_CUDA_CHANNELS=4 OXCCL_CUDA_BLOCKS=16 OXCCL_CHUNK_BYTES=4M")
for v in "${tune[@]}"; do
  in_budget "the tuning runs from $v on" || break
  # shellcheck disable=SC2086 # VAR=value words
  perf "oxccl-g2-${v//[= ]/-}" "$OXLIB" env OXCCL_CUDA_DIRECT=0 $v "$B/all_reduce_perf" -b 128K -e 128M -f 4 -n 10 -w 3 -c 0 -g 2
done
python3 - "$AUX" "${tune[@]}" <<'PY' 2>&1 | tee -a "$log"
import sys
out, tune = sys.argv[1], sys.argv[2:]
sys.path.insert(0, out)
from perfrows import rows
base = rows("oxccl-g2-ring")
runs = [rows("oxccl-g2-" + v.replace("=", "-").replace(" ", "-")) for v in tune]
print("== 2 ranks, ring all_reduce busbw (GB/s) by blocks per lane, slot size, rings and fence scope; default: 8, 1 MiB, 1, sys")
# Columns as wide as their labels (short names: OXCCL_CUDA_ and OXCCL_ left out).
names = [v.replace("OXCCL_CUDA_", "").replace("OXCCL_", "") for v in tune]
print(f"  {'bytes':>12}  {'default':>8}  " + "  ".join(f"{v:>{max(len(v), 8)}}" for v in names))
for b in sorted(set().union(*[set(r) for r in runs])):
    cells = "  ".join(f"{r.get(b, (0, 0, 0))[2]:>{max(len(v), 8)}.1f}" for v, r in zip(names, runs))
    print(f"  {b:>12}  {base.get(b, (0, 0, 0))[2]:>8.1f}  {cells}")
PY
fi
# Last: what may stop by design, then the host executor (CI runs it too).
# Ranks launching apart whose streams must share hardware queues (more ranks than
# CUDA_DEVICE_MAX_CONNECTIONS, 8 by default; then one queue, as Megatron-LM sets): the
# library WARNs that this can stop; these say whether it does on this GPU (a failure here is
# that hazard seen, and the WARN's advice is the way around it).
check "CUDA board: 12 ranks as threads (more than 8 hardware queues)" 30 \
  "$B/cuda_ranks" 12 threads timeout=20
check "CUDA board: 2 ranks as threads, CUDA_DEVICE_MAX_CONNECTIONS=1" 30 \
  env CUDA_DEVICE_MAX_CONNECTIONS=1 "$B/cuda_ranks" 2 threads timeout=20
# The host executor there.
export OXCCL_DEVICE=host
check "host: C, one process, InitAll + group" 60 "$B/ex_single_process"
check "host: collective matrix, 8 ranks" 120 "$B/coll_matrix" 8 big=none
check "host: all_reduce_perf -g 8" 60 "$B/all_reduce_perf" -b 8 -e 64M -f 8 -g 8 -n 5 -w 1
check "host: tp_pp_mlp --tp 4 --pp 2 --exact" 60 tppp --tp 4 --pp 2 --exact
unset OXCCL_DEVICE
say "# failures: $fails, skipped for the deadline: $skipped ($SECONDS s)"
exit $((fails > 0))
