#!/usr/bin/env bash
# The main job: build libnccl.so.2 and the perf tools, then run a 4-rank all-reduce benchmark
# (nccl-tests' all_reduce_perf command line and table) on the host executor.
#
#   scripts/main-job.sh                 # all_reduce_perf -b 8 -e 128M -f 2 -g 4
#   scripts/main-job.sh -b 1K -e 1M     # extra arguments are passed to all_reduce_perf
#
# With a CUDA driver present the host executor is still used unless OXCCL_DEVICE is set to
# something else (the CUDA executor is a later step).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
command -v cc >/dev/null && command -v make >/dev/null || scripts/setup.sh
cargo build --release --lib
make -s -C nccl-tests-compat
# The tools load libnccl.so.2 (the SONAME): lay out a lib directory holding it.
lib="$root/target/release/lib"
mkdir -p "$lib"
ln -sf ../libnccl.so "$lib/libnccl.so.2"
export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export OXCCL_DEVICE="${OXCCL_DEVICE:-host}"
exec target/release/all_reduce_perf -b 8 -e 128M -f 2 -g 4 "$@"
