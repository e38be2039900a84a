#!/usr/bin/env bash
# Every fuzz target, two lanes at once (one per core), from the seed corpora
# kept in fuzz/seeds: bash scripts/fuzz.sh [seconds of wall time, default 240]
#   lane 1: merge, then gguf (no sanitizer, RSS capped; the loader bounds
#           allocations itself)
#   lane 2: paged, capi, hybrid
# merge, paged, capi and hybrid are built optimised under the address
# sanitizer (they reach the unsafe SIMD kernels and the C ABI's raw
# pointers). gguf links candle and tokenizers: an optimised build of them
# took 13 of CI's minutes, so it is built unoptimised (about 3.5 minutes on
# 2 cores; it runs about 360 inputs/s instead of 3900, which is why it gets
# the larger share of its lane).
# All with debug assertions, so an arithmetic overflow is a finding.
# Fails on any finding; prints the executions of each target and the total.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-240}
if ! command -v cargo-fuzz >/dev/null 2>&1; then
  cargo install --locked cargo-fuzz@0.13.2
fi
if ! rustup toolchain list | grep -q nightly; then
  echo "cargo fuzz needs a nightly toolchain (rustup toolchain install nightly)" >&2
  exit 1
fi
root=$PWD
logs=$root/target/fuzz
rm -rf "$logs"; mkdir -p "$logs"
cd fuzz
# Debug assertions on (-a): an arithmetic overflow is a finding too.
# A build that fails shows its errors, not only the last line of cargo-fuzz's backtrace.
build() {
  if ! cargo +nightly fuzz build "$@" >"$logs/build.log" 2>&1; then
    grep -E '^(error|warning: unused)' -A12 "$logs/build.log" | head -60
    echo "fuzz: the build failed (cargo +nightly fuzz build $*)" >&2
    exit 1
  fi
  tail -1 "$logs/build.log"
}
build -O -a
CARGO_PROFILE_DEV_DEBUG=line-tables-only build --dev -a -s none --features llm --target-dir target/nosan gguf
# One corpus per target, seeded from the repository's (never written back).
for t in merge paged capi hybrid gguf; do
  rm -rf "$logs/corpus-$t"; mkdir -p "$logs/corpus-$t"
  [ -d "seeds/$t" ] && cp -r "seeds/$t/." "$logs/corpus-$t/"
done
triple=$(rustc +nightly -vV | sed -n 's/^host: //p')
run() { # target seconds target-dir/profile extra-libfuzzer-flags...
  # The built binaries, run directly: `cargo fuzz run` may rebuild first.
  local t=$1 s=$2 dir=$3; shift 3
  "${dir%/*}/$triple/${dir##*/}/$t" "$logs/corpus-$t" -max_total_time="$s" \
    -print_final_stats=1 -artifact_prefix="$logs/$t-" "$@" >"$logs/$t.log" 2>&1 || true
}
lane1() {
  run merge $((secs * 40 / 100)) target/release
  run gguf $((secs * 60 / 100)) target/nosan/debug -rss_limit_mb=1024
}
lane2() {
  run paged $((secs * 40 / 100)) target/release
  run capi $((secs * 35 / 100)) target/release
  run hybrid $((secs * 25 / 100)) target/release
}
lane1 & l1=$!
lane2 & l2=$!
wait $l1 $l2
total=0; bad=0
for t in merge gguf paged capi hybrid; do
  n=$(sed -nE 's/^stat::number_of_executed_units: *([0-9]+)/\1/p' "$logs/$t.log" | tail -1)
  if grep -qE '^Done [0-9]+ runs' "$logs/$t.log" && [ -n "$n" ]; then
    printf 'fuzz %-7s %10s executions\n' "$t" "$n"
    total=$((total + n))
  else
    echo "fuzz $t: FAILED (finding or crash); the log's tail:"
    grep -E 'panicked|ERROR|SUMMARY|Test unit written|assert' -A3 "$logs/$t.log" | head -30
    bad=1
  fi
done
echo "fuzz: $total executions over 5 targets in ${secs} s"
exit $bad
