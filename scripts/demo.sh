#!/usr/bin/env bash
# hgca's main job on this machine, on the best backend it finds:
#   1. the exact LSE merge of two partials against the f64 reference;
#   2. the hybrid attention demo: a 128k-token decode (CUDA, else a wgpu GPU,
#      else the CPU in both roles), accuracy against full attention, time split;
#   3. a real model (SmolLM2-135M) over a long text: perplexity of full vs
#      hybrid attention (downloads the model and the text on first run).
set -euo pipefail
cd "$(dirname "$0")/.."
export NODEVICE_SELECT=1
# Optional backends: Mesa's Vulkan driver for wgpu, NVRTC for CUDA (as root).
[ "$(id -u)" -eq 0 ] && bash scripts/setup-vulkan.sh >/dev/null 2>&1 || true
if [ -f scripts/setup-cuda.sh ]; then eval "$(bash scripts/setup-cuda.sh 2>/dev/null)" || true; fi

echo "== 1. the exact LSE merge"
cargo run --release -q -p hgca-kernels --example merge_demo

echo
echo "== 2. hybrid attention, long-context decode"
cargo build --release -q -p hgca-demo
target/release/hgca-demo hybrid "$@"
echo
target/release/hgca-demo hybrid --shift --context 32768 --steps 32
echo
target/release/hgca-demo harness --context 16384 --steps 32
echo
# How large a window a GPU budget allows (32 layers, batch 4, 128k context, 16 GiB).
target/release/hgca-demo plan --context 131072 --batch 4 --gpu-gib 16

if [ -f scripts/run-model.sh ]; then
  echo
  echo "== 3. a real model, long context"
  bash scripts/run-model.sh
fi
