#!/usr/bin/env bash
# Run a directory of upstream nccl-tests binaries (built by the user; this script never downloads
# or builds them) against a libnccl.so.2 of our choosing, and summarise #wrong and avg busbw.
#
#   NCCL_TESTS_DIR=/path/to/nccl-tests/build  [OXCCL_LIB_DIR=target/release]  \
#     nccl-tests-compat/run-upstream.sh [extra perf-tool args, default: -b 8 -e 16M -f 4 -g 2]
#
# OXCCL_LIB_DIR is prepended to LD_LIBRARY_PATH (default: ../target/release next to this script,
# where cargo build leaves libnccl.so.2).
# Exit status: 0 when every tool exits 0 with no wrong elements, 1 otherwise.
set -u
here=$(cd "$(dirname "$0")" && pwd)
dir=${NCCL_TESTS_DIR:?set NCCL_TESTS_DIR to a directory of nccl-tests binaries}
lib=${OXCCL_LIB_DIR:-$here/../target/release}
# Programs load libnccl.so.2 (the SONAME). `cargo build` makes target/release/libnccl.so.2 (a link
# to libnccl.so); a folder holding only libnccl.so gets a private folder with the link.
if [ ! -e "$lib/libnccl.so.2" ]; then
  if [ -e "$lib/libnccl.so" ]; then
    linkdir=$(mktemp -d /tmp/oxccl-lib.XXXXXX)
    ln -s "$(cd "$lib" && pwd)/libnccl.so" "$linkdir/libnccl.so.2"
    lib=$linkdir
  else
    echo "run-upstream.sh: no libnccl.so.2 or libnccl.so in $lib (build it: cargo build --release)" >&2
    exit 1
  fi
fi
echo "library: $(readlink -f "$lib/libnccl.so.2")"
export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(-b 8 -e 16M -f 4 -g 2)
tools="all_reduce_perf all_gather_perf broadcast_perf reduce_perf reduce_scatter_perf alltoall_perf gather_perf scatter_perf sendrecv_perf hypercube_perf"
logdir=$(mktemp -d /tmp/oxccl-upstream.XXXXXX)
status=0
printf '%-22s %5s %8s %8s %14s\n' tool rc rows wrong avg_busbw
for t in $tools; do
  bin="$dir/$t"
  [ -x "$bin" ] || bin="$dir/${t}_mpi"
  if [ ! -x "$bin" ]; then printf '%-22s %5s\n' "$t" missing; continue; fi
  log="$logdir/$t.log"
  "$bin" "${args[@]}" >"$log" 2>&1
  rc=$?
  # data rows: lines not starting with '#' whose first field is a number; #wrong are fields 9 and 13
  read -r rows wrong < <(awk '!/^#/ && $1 ~ /^[0-9]+$/ && NF >= 13 {
      n++; if ($9 != "N/A") w += $9; if ($13 != "N/A") w += $13 } END { print n+0, w+0 }' "$log")
  bw=$(awk -F: '/Avg bus bandwidth/ { split($2, a, " "); print a[1] }' "$log")
  printf '%-22s %5s %8s %8s %14s\n' "$t" "$rc" "$rows" "$wrong" "${bw:-?}"
  if [ "$rc" -ne 0 ] || [ "$wrong" != 0 ] || [ "$rows" = 0 ]; then status=1; fi
done
echo "logs: $logdir"
exit $status
