#!/usr/bin/env bash
# Installs what the tests need on a fresh machine: C/C++ compilers and binutils (Debian), and
# NCCL 2.32.3's wheel (PyPI) in a cache, for the ABI conformance test. Idempotent.
set -euo pipefail
need=()
command -v gcc >/dev/null || need+=(gcc)
command -v g++ >/dev/null || need+=(g++)
command -v make >/dev/null || need+=(make)
command -v readelf >/dev/null || need+=(binutils)
command -v unzip >/dev/null || need+=(unzip)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq && apt-get install -y -qq "${need[@]}"
fi
root=$(cd "$(dirname "$0")/.." && pwd)
if [ -x "$root/scripts/fetch-upstream-nccl.sh" ]; then
  "$root/scripts/fetch-upstream-nccl.sh" "$root/target/upstream-nccl" >/dev/null
fi
