#!/usr/bin/env bash
# Runs every test of the project on the host executor (no GPU needed):
# formatting and lints, the Rust unit and integration tests (engine, ABI conformance against
# NCCL 2.32.3's header, the C/C++ programs of ffi-tests/, the perf tools' sweep).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
scripts/setup.sh
export OXCCL_DEVICE=host
cargo fmt --check
cargo clippy --workspace --all-targets -- -D warnings
# The C programs and the ABI checks load target/release/libnccl.so, the net plugin test
# target/release/libnccl_net_oxccl.so (net-plugin/): build them first.
cargo build --release --workspace --lib
cargo test --release --no-fail-fast 2>&1
