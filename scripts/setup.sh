#!/usr/bin/env bash
# Installs what the tests need on a fresh machine: C/C++ compilers, binutils, iproute2, OpenMPI's
# mpirun (Debian), and NCCL 2.32.3's wheel (PyPI) in a cache, for the ABI conformance test.
# Idempotent.
set -euo pipefail
need=()
command -v gcc >/dev/null || need+=(gcc)
command -v g++ >/dev/null || need+=(g++)
command -v make >/dev/null || need+=(make)
command -v readelf >/dev/null || need+=(binutils)
command -v unzip >/dev/null || need+=(unzip)
# The multi-host tests make network namespaces (they skip, saying so, where that is refused).
command -v ip >/dev/null || need+=(iproute2)
command -v unshare >/dev/null || need+=(util-linux)
# The perf tools across namespace hosts under mpirun.
command -v mpirun >/dev/null || need+=(openmpi-bin)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq && apt-get install -y -qq "${need[@]}"
fi
root=$(cd "$(dirname "$0")/.." && pwd)
if [ -x "$root/scripts/fetch-upstream-nccl.sh" ]; then
  "$root/scripts/fetch-upstream-nccl.sh" "$root/target/upstream-nccl" >/dev/null
fi
# NVRTC from PyPI, for the test that compiles the CUDA kernels (no GPU needed).
nv="$root/target/cuda-wheels"
if [ ! -e "$nv/nvidia/cuda_nvrtc/lib/libnvrtc.so.12" ]; then
  python3 -m pip install -q --disable-pip-version-check --target "$nv" "nvidia-cuda-nvrtc-cu12==12.9.*" >/dev/null
fi
# nvcc from PyPI (CUDA 13), which build.rs finds there and compiles the kernels with into the
# fatbin the library embeds (a folder of its own: pip --target leaves an existing nvidia/ be).
nvcc="$root/target/cuda-nvcc"
if [ ! -x "$nvcc/nvidia/cu13/bin/nvcc" ]; then
  python3 -m pip install -q --disable-pip-version-check --target "$nvcc" "nvidia-cuda-nvcc==13.5.*" >/dev/null
  # A build made before nvcc was here embedded no kernels, and cargo does not know that nvcc's
  # arrival changes that: the next build runs build.rs again.
  touch "$root/build.rs"
fi
