#!/usr/bin/env bash
# hgca's main job on this machine, on the best backend it finds.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== 1. the exact LSE merge"
cargo run --release -q -p hgca-kernels --example merge_demo
