#!/usr/bin/env bash
# Builds NVIDIA's own perf tools (upstream nccl-tests) as a user of NCCL builds them: against
# NVIDIA's NCCL 2.32.3 headers, linked to -lnccl (NVIDIA's libnccl.so.2, from its PyPI wheel),
# so that the binaries are the ones oxccl must run unchanged (LD_LIBRARY_PATH picks the library).
# No GPU is needed to build them; they need one to run (the GPU check carries them).
#
#   scripts/build-nccl-tests.sh OUT_DIR
#
#   NCCL_TESTS_SRC  the sources: a folder of them, or a git repository that holds NCCL_TESTS_REF
#                   (default: a clone of https://github.com/NVIDIA/nccl-tests)
#   NCCL_TESTS_REF  the release (default v2.19.6, the newest on 2026-12-07)
#   NCCL_TESTS_ARCH the GPU architectures (default 90: the H100 and H200 the device tool lends)
#
# nvcc and the CUDA runtime come from PyPI (scripts/setup.sh puts nvidia-cuda-nvcc in
# target/cuda-nvcc); this script adds CCCL's headers (nvidia-cuda-cccl: cuda_fp16.h needs
# <nv/target>), which the library's own kernels do not need. The CUDA runtime is linked in
# statically: the binaries need only libcuda (the driver) and libnccl.so.2 where they run.
# Leaves OUT_DIR/<tool>_perf, stripped (the sizes the device tool carries).
set -euo pipefail
out=${1:?usage: build-nccl-tests.sh OUT_DIR}
root=$(cd "$(dirname "$0")/.." && pwd)
ref=${NCCL_TESTS_REF:-v2.19.6}
arch=${NCCL_TESTS_ARCH:-90}
cuda="$root/target/cuda-nvcc/nvidia/cu13"
[ -x "$cuda/bin/nvcc" ] || { echo "build-nccl-tests: no nvcc in $cuda (run scripts/setup.sh)" >&2; exit 1; }
cccl="$root/target/cuda-cccl"
if [ ! -d "$cccl/nvidia/cu13/include/nv" ]; then
  python3 -m pip install -q --disable-pip-version-check --no-deps --target "$cccl" \
    "nvidia-cuda-cccl==13.3.5.0.6" >/dev/null
fi
nccl=$("$root/scripts/fetch-upstream-nccl.sh" "$root/target/upstream-nccl" --lib)
work=$(mktemp -d /tmp/oxccl-nccl-tests.XXXXXX)
trap 'rm -rf "$work"' EXIT
src=${NCCL_TESTS_SRC:-}
if [ -z "$src" ]; then
  git clone -q --depth 1 --branch "$ref" https://github.com/NVIDIA/nccl-tests "$work/src"
elif [ -d "$src/src" ] && [ -f "$src/Makefile" ]; then
  cp -r "$src" "$work/src"
  ref="the sources in $src"
else
  mkdir "$work/src" && git -C "$src" archive "$ref" | tar x -C "$work/src"
fi
# -lnccl at link time: NVIDIA's library, under the name the linker looks for.
mkdir -p "$work/nccl/lib"
ln -s "$nccl/include" "$work/nccl/include"
ln -s "$nccl/lib/libnccl.so.2" "$work/nccl/lib/libnccl.so"
gencode="-gencode=arch=compute_$arch,code=sm_$arch -gencode=arch=compute_$arch,code=compute_$arch"
make -s -j"$(nproc)" -C "$work/src/src" build BUILDDIR="$work/build" CUDA_HOME="$cuda" \
  CUDA_LIB="$cuda/lib" NCCL_HOME="$work/nccl" CUDARTLIB=cudart_static \
  NVCC_GENCODE="$gencode -I$cccl/nvidia/cu13/include/cccl -I$cccl/nvidia/cu13/include" >&2
mkdir -p "$out"
for b in "$work"/build/*_perf; do strip -o "$out/$(basename "$b")" "$b"; done
echo "nccl-tests $ref, sm_$arch, against NVIDIA's NCCL 2.32.3 headers" >"$out/VERSION"
ls "$out"
