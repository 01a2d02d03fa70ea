#!/usr/bin/env bash
# Fetches NVIDIA's NCCL 2.32.3 wheel (the reference for oxccl's ABI tests) into a cache, and
# unpacks its public headers (and, with --lib, libnccl.so.2) under OUT_DIR/nvidia/nccl/.
#   usage: scripts/fetch-upstream-nccl.sh OUT_DIR [--lib]
#   cache: $OXCCL_WHEEL_CACHE, default ~/.cache/oxccl-wheels
set -euo pipefail
out=${1:?usage: fetch-upstream-nccl.sh OUT_DIR [--lib]}
want_lib=${2:-}
cache=${OXCCL_WHEEL_CACHE:-$HOME/.cache/oxccl-wheels}
mkdir -p "$cache" "$out"
shopt -s nullglob
wheels=("$cache"/nvidia_nccl_cu13-2.32.3-*.whl)
if [ ${#wheels[@]} -eq 0 ]; then
  python3 -m pip download --quiet --no-deps --only-binary=:all: \
    nvidia-nccl-cu13==2.32.3 -d "$cache" >&2
  wheels=("$cache"/nvidia_nccl_cu13-2.32.3-*.whl)
fi
[ ${#wheels[@]} -gt 0 ] || { echo "no NCCL 2.32.3 wheel in $cache" >&2; exit 1; }
whl=${wheels[0]}
python3 - "$whl" "$out" "$want_lib" <<'PY'
import sys, zipfile
whl, out, want_lib = sys.argv[1], sys.argv[2], sys.argv[3]
with zipfile.ZipFile(whl) as z:
    for n in z.namelist():
        if n.startswith("nvidia/nccl/include/") or (want_lib == "--lib" and n == "nvidia/nccl/lib/libnccl.so.2"):
            z.extract(n, out)
PY
echo "$out/nvidia/nccl"
