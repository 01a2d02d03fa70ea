#!/usr/bin/env bash
# Lays out an NCCL_HOME: PREFIX/include/nccl.h, PREFIX/lib/libnccl.so.2.32.3 and its
# libnccl.so.2 / libnccl.so links, as `make NCCL_HOME=PREFIX` (nccl-tests) and `-lnccl` expect.
# usage: scripts/install.sh PREFIX
set -euo pipefail
prefix=${1:?usage: scripts/install.sh PREFIX}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
cargo build --release --lib
mkdir -p "$prefix/include" "$prefix/lib"
install -m 0644 include/nccl.h "$prefix/include/nccl.h"
install -m 0755 target/release/libnccl.so "$prefix/lib/libnccl.so.2.32.3"
ln -sf libnccl.so.2.32.3 "$prefix/lib/libnccl.so.2"
ln -sf libnccl.so.2 "$prefix/lib/libnccl.so"
echo "installed oxccl into $prefix (include/nccl.h, lib/libnccl.so.2.32.3, libnccl.so.2, libnccl.so)"
