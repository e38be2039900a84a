#!/usr/bin/env bash
# Real models through hgca's attention, over Austen's Persuasion (from
# Debian): SmolLM2-135M (GGUF from PyPI), full vs hybrid perplexity; then a
# long-context retrieval on Qwen2.5-Coder-0.5B (GGUF from PyPI, ~490 MB): the
# shift task in a 16k-token prompt, full attention against the hybrid layer
# and the paper's frozen rule. Downloads the models and the text on first
# run (scripts/fetch-model.sh). HGCA_QUICK=1 skips the 16k run (about nine
# minutes on 2 cores, most of it the 16k prefill of the three variants).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/fetch-model.sh --qwen2
cargo build --release -q -p hgca-llm
echo "-- generate (full attention)"
target/release/hgca-llm generate --prompt "It is a truth universally acknowledged, that" --max-tokens 32
echo "-- perplexity, 2048-token context, last 256 tokens decoded one by one: full vs hybrid (window 0.25)"
# f32 weights: candle's Q8_0 decode path quantises activations to 8 bits, and that
# rounding turns any tiny change upstream (an f32 summation order) into a
# perplexity jitter of about 1%, larger than what is measured here.
target/release/hgca-llm --weights f32 ppl --tokens 2048 --context 2048 --score-from 1792 --decode \
  --attn full,hybrid --window-ratio 0.25 --recovery mass:0.93
if [[ "${HGCA_QUICK:-0}" != 1 ]]; then
  echo "-- long-context retrieval: Qwen2.5-Coder-0.5B, a 16k-token prompt with two needles 25% and 75%"
  echo "   deep, asked in a two-turn chat one way and back (the shift task): full attention vs the hybrid"
  echo "   layer (window 0.25, default mass selector) vs the paper's frozen rule, from one prefill"
  target/release/hgca-llm --model models/Qwen2.5-Coder-0.5B-Instruct.gguf ruler --contexts 16384 \
    --tasks shift --docs 1 --variants full,mass:0.93@0.25,frozen@0.25
fi
