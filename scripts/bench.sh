#!/usr/bin/env bash
# scripts/bench.sh [--quick]
#
# One benchmark of oxccl's host executor on this machine, side by side with its baselines:
#   (a) all_reduce_perf, 2 processes (env launcher RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, shared memory),
#       on malloc buffers, and again with -R 1 (buffers from ncclMemAlloc, registered: zero-copy)
#   (b) all_reduce_perf -g 2: 2 ranks as threads of one process
#   (c) OpenMPI MPI_Allreduce (nccl-tests-compat/bench/mpi_allreduce.c), mpirun -np 2
#   (d) memcpy bandwidth (nccl-tests-compat/bench/memcpy_probe.c), the machine's copy ceiling
# f32 sum, sizes 8 B .. 256 MiB by factor 2 (--quick: .. 16 MiB). Prints one table and the
# project's targets with PASS/FAIL; writes target/bench/allreduce.{csv,png} and the raw outputs
# under target/bench/raw/. Installs what it lacks (OpenMPI via apt-get, matplotlib via pip).
# Iterations per size band (same for a, b, c; warm-up in parentheses):
#   8 B .. 64 KiB: N_SMALL (W_SMALL)   128 KiB .. 8 MiB: N_MID (W_MID)   16 MiB ..: N_LARGE (W_LARGE)
# The whole set of sweeps runs REPEATS times (default 3; --quick: 1), the kinds interleaved (their
# order rotated from one repeat to the next, so that none always runs first after a pause), and
# the table shows each size's median time (the machine is shared: single runs are noisy).
# Override with those environment variables. Nothing in the library is tuned here.
# BASELINE_LIB=DIR (a folder with another build's libnccl.so or libnccl.so.2, e.g. an earlier
# commit's target/release) adds (a) run with that library, interleaved with the others, and a
# table of this build's figures over the baseline's: refactors compare old and new in one run.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
QUICK=0
for arg in "$@"; do
  case "$arg" in
    --quick) QUICK=1 ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "usage: $0 [--quick]" >&2; exit 2 ;;
  esac
done

if [ "$QUICK" = 1 ]; then
  MAX=16M; MAX_BYTES=$((16 << 20))
  : "${N_SMALL:=300}" "${W_SMALL:=30}" "${N_MID:=40}" "${W_MID:=5}" "${N_LARGE:=10}" "${W_LARGE:=3}" "${REPEATS:=1}"
else
  MAX=256M; MAX_BYTES=$((256 << 20))
  : "${N_SMALL:=1000}" "${W_SMALL:=100}" "${N_MID:=100}" "${W_MID:=10}" "${N_LARGE:=20}" "${W_LARGE:=5}" "${REPEATS:=3}"
fi

OUT="$ROOT/target/bench"
RAW="$OUT/raw"
BIN="$OUT/bin"
LIB="$OUT/lib"
mkdir -p "$RAW" "$BIN" "$LIB"
rm -f "$RAW"/*.txt
log() { printf '== %s\n' "$*" >&2; }
die() { printf 'bench.sh: %s\n' "$*" >&2; exit 1; }
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"

# ---- prerequisites ------------------------------------------------------------------------
# the commands alone are not enough: some images carry openmpi-bin without mpi.h
if ! dpkg -s openmpi-bin libopenmpi-dev >/dev/null 2>&1; then
  log "installing OpenMPI (openmpi-bin libopenmpi-dev)"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get install -y -q openmpi-bin libopenmpi-dev >/dev/null 2>&1 ||
    { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q openmpi-bin libopenmpi-dev >/dev/null; } ||
    die "could not install OpenMPI"
fi
PY=python3
command -v "$PY" >/dev/null || die "python3 is needed for the report"
if ! "$PY" -c 'import matplotlib' 2>/dev/null; then
  log "installing matplotlib"
  "$PY" -m pip install -q matplotlib >&2 || log "matplotlib could not be installed: no plot"
fi

# ---- build --------------------------------------------------------------------------------
log "cargo build --release"
(cd "$ROOT" && cargo build --release -q) || die "cargo build --release failed"
SO="$ROOT/target/release/libnccl.so"
[ -f "$SO" ] || die "$SO missing"
[ "$(nm -D --defined-only "$SO" | grep -cw ncclAllReduce)" != 0 ] || die "$SO does not export ncclAllReduce (C ABI not merged yet?)"
ln -sf "$SO" "$LIB/libnccl.so.2"   # the tools need the SONAME at run time
log "building the perf tools and the probes"
make -s -C "$ROOT/nccl-tests-compat" NCCL_LIB="$ROOT/target/release" BUILDDIR="$BIN" "$BIN/all_reduce_perf" >&2
mpicc -O2 -Wall -Wextra -o "$BIN/mpi_allreduce" "$ROOT/nccl-tests-compat/bench/mpi_allreduce.c"
cc -O2 -Wall -Wextra -std=c11 -o "$BIN/memcpy_probe" "$ROOT/nccl-tests-compat/bench/memcpy_probe.c"

# ---- runs ---------------------------------------------------------------------------------
# size bands: "min max iters warmup"
BANDS=("8 64K $N_SMALL $W_SMALL" "128K 8M $N_MID $W_MID" "16M $MAX $N_LARGE $W_LARGE")
oxenv=(env -u OXCCL_FAULT -u NCCL_TESTS_MIN_BW -u OMPI_COMM_WORLD_SIZE
       LD_LIBRARY_PATH="$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" OXCCL_DEVICE=host)

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

two_procs() {  # name min max iters warmup [more options]
  local name=$1 port pids=() rc=0
  shift
  port="$(free_port)"
  for r in 1 0; do
    "${oxenv[@]}" RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" \
      "${bind[@]/\%R/$r}" "$BIN/all_reduce_perf" -b "$1" -e "$2" -f 2 -n "$3" -w "$4" -d float -o sum -T 600 "${@:5}" \
      >"$RAW/$name.rank$r.tmp" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  cat "$RAW/$name.rank0.tmp" >>"$RAW/oxccl-$name.txt"
  sed 's/^/[rank1] /' "$RAW/$name.rank1.tmp" >>"$RAW/oxccl-$name.rank1.txt"
  rm -f "$RAW/$name".rank*.tmp
  return $rc
}
# Each rank on its own core, as mpirun places MPI's ranks (--bind-to core, its default for 2
# processes): a rank that waits spins, and an unbound pair shares one core with whatever else
# wakes up on the machine far longer than a bound pair (measured with a busy loop running: 8 B
# took 3-10 us unbound, 1 us bound; MPI, bound, 0.3-0.9). BIND=0 runs them unbound.
bind=()
if [ "${BIND:-1}" = 1 ] && command -v taskset >/dev/null && [ "$(nproc)" -ge 2 ]; then
  bind=(taskset -c %R)
fi
run_2proc() { two_procs 2proc "$@"; }
run_2proc_reg() { two_procs 2proc-reg "$@" -R 1; }
# The same two runs with the baseline library (BASELINE_LIB), from its own lib folder.
with_base() {
  local saved=("${oxenv[@]}")
  oxenv=(env -u OXCCL_FAULT -u NCCL_TESTS_MIN_BW -u OMPI_COMM_WORLD_SIZE
         LD_LIBRARY_PATH="$BASE_LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" OXCCL_DEVICE=host)
  "$@"
  local rc=$?
  oxenv=("${saved[@]}")
  return $rc
}
run_base_2proc() { with_base two_procs base-2proc "$@"; }
run_base_2proc_reg() { with_base two_procs base-2proc-reg "$@" -R 1; }
run_2thread() {
  "${oxenv[@]}" "$BIN/all_reduce_perf" -g 2 -b "$1" -e "$2" -f 2 -n "$3" -w "$4" -d float -o sum -T 600 \
    >>"$RAW/oxccl-2thread.txt" 2>&1
}
run_mpi() {
  mpirun --allow-run-as-root --oversubscribe -np 2 "$BIN/mpi_allreduce" -b "$1" -e "$2" -f 2 -n "$3" -w "$4" \
    >>"$RAW/mpi.txt" 2>&1
}

START=$SECONDS
STATUS=0
LOAD0="$(cut -d' ' -f1-3 /proc/loadavg)"
KINDS=(2proc 2proc_reg 2thread mpi)
if [ -n "${BASELINE_LIB:-}" ]; then
  BASE_LIBDIR="$OUT/baselib"
  mkdir -p "$BASE_LIBDIR"
  if [ -f "$BASELINE_LIB/libnccl.so.2" ]; then base_so="$BASELINE_LIB/libnccl.so.2"; else base_so="$BASELINE_LIB/libnccl.so"; fi
  [ -f "$base_so" ] || die "BASELINE_LIB=$BASELINE_LIB holds no libnccl.so(.2)"
  ln -sf "$(cd "$(dirname "$base_so")" && pwd)/$(basename "$base_so")" "$BASE_LIBDIR/libnccl.so.2"
  KINDS=(2proc base_2proc 2proc_reg base_2proc_reg 2thread mpi)
fi
for rep in $(seq 1 "$REPEATS"); do
  for band in "${BANDS[@]}"; do
    read -r lo hi n w <<<"$band"
    for i in "${!KINDS[@]}"; do
      kind=${KINDS[$(((i + rep - 1) % ${#KINDS[@]}))]}
      log "[$rep/$REPEATS] $kind all_reduce $lo..$hi, $n iters ($w warm-up)"
      "run_$kind" "$lo" "$hi" "$n" "$w" || { STATUS=1; log "$kind run failed (exit $?), see $RAW"; }
    done
  done
done
log "memcpy probe 8..$MAX"
"$BIN/memcpy_probe" -b 8 -e "$MAX" -f 2 -m "$([ "$QUICK" = 1 ] && echo 20 || echo 100)" -t 5 >"$RAW/memcpy.txt" || STATUS=1
log "measured in $((SECONDS - START)) s"
LOADS="load average (1/5/15 min) before: $LOAD0, after: $(cut -d' ' -f1-3 /proc/loadavg)"

# ---- report -------------------------------------------------------------------------------
echo
"$PY" "$ROOT/nccl-tests-compat/bench/report.py" \
  --proc "$RAW/oxccl-2proc.txt" --reg "$RAW/oxccl-2proc-reg.txt" --thread "$RAW/oxccl-2thread.txt" --mpi "$RAW/mpi.txt" \
  --memcpy "$RAW/memcpy.txt" --csv "$OUT/allreduce.csv" --png "$OUT/allreduce.png" \
  --max-bytes "$MAX_BYTES" --repeats "$REPEATS" --note "$LOADS" \
  ${BASELINE_LIB:+--base "$RAW/oxccl-base-2proc.txt" --base-reg "$RAW/oxccl-base-2proc-reg.txt" --base-name "$BASELINE_LIB"} \
  --title "all_reduce f32 sum, 2 ranks, $(nproc) cores$([ "$QUICK" = 1 ] && echo ' (--quick)')" || STATUS=1
[ "$STATUS" = 0 ] || echo "bench.sh: some runs failed or reported wrong results; see $RAW" >&2
exit "$STATUS"
