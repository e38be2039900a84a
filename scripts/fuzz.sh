#!/usr/bin/env bash
# Short fuzz run of the merge numerics: bash scripts/fuzz.sh [seconds]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
if ! command -v cargo-fuzz >/dev/null 2>&1; then
  cargo install --locked cargo-fuzz@0.13.2
fi
if ! rustup toolchain list | grep -q nightly; then
  echo "cargo fuzz needs a nightly toolchain (rustup toolchain install nightly)" >&2
  exit 1
fi
cd fuzz
cargo +nightly fuzz build merge
cargo +nightly fuzz run merge -- -max_total_time="$secs" -print_final_stats=1 2>&1 | tee ../target/fuzz.log | grep -E 'Done|panicked|ERROR|SUMMARY|stat::number_of_executed_units' || true
grep -q '^Done [0-9]* runs' ../target/fuzz.log || { echo "fuzz run failed"; exit 1; }
