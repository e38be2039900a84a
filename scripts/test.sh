#!/usr/bin/env bash
# The whole test suite: installs what the tests need (as root, through apt
# and pip), then format, lint, tests (every backend the machine can run:
# CPU ISAs, wgpu on Mesa's software Vulkan, NVRTC compile checks, NEON under
# qemu) and a short fuzz run. Under CI=true a test that would skip for a
# missing tool fails instead.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
# Each step prints the wall time so far and the CPU time of the finished
# commands (user + system, from /proc: CI's budget is 30 minutes on 2 cores).
cpu() { awk -v t="$(getconf CLK_TCK)" '{printf "%d", ($16 + $17) / t}' "/proc/$$/stat" 2>/dev/null || echo "?"; }
step() { printf '\n== %s (%ss, %s s of CPU)\n' "$1" "$(( $(date +%s) - start ))" "$(cpu)"; }

if [ "${CI:-}" = "true" ]; then
  # A clean clone builds once: incremental state would only be written.
  export CARGO_INCREMENTAL=0
  # What a test may not skip here (hgca_testkit::require): wgpu on Mesa's
  # software Vulkan, NVRTC and ptxas from PyPI, NEON under qemu, the CPU
  # facts, and every x86 ISA the kernel reports (read from /proc/cpuinfo,
  # independently of the library's own detection).
  req="wgpu,nvrtc,neon,proc-cpuinfo,gguf-ref"
  grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo && grep -qw f16c /proc/cpuinfo && req="$req,v3"
  grep -qw avx512f /proc/cpuinfo && grep -qw avx512bw /proc/cpuinfo && grep -qw avx512vl /proc/cpuinfo && req="$req,v4"
  export HGCA_REQUIRE=$req
fi
# Whether a capability is listed in HGCA_REQUIRE (the shell side of the policy).
required() { [[ ",${HGCA_REQUIRE:-}," == *",$1,"* ]]; }
export CARGO_TERM_COLOR=never
# Mesa's device-select Vulkan layer prints an "error:" line without
# XDG_RUNTIME_DIR; with one adapter it has nothing to select.
export NODEVICE_SELECT=1

step "system packages"
[ -f scripts/setup-vulkan.sh ] && bash scripts/setup-vulkan.sh
if [ -f scripts/setup-cuda.sh ]; then
  # Prints `export ...` lines for NVRTC, its headers and ptxas.
  if cuda_env=$(bash scripts/setup-cuda.sh); then
    eval "$cuda_env"
  else
    echo "setup-cuda.sh failed: the CUDA compile checks will not find NVRTC"
    required nvrtc && exit 1
  fi
fi

step "Python packages (the venv of the wheel's tests; numpy and gguf for the Gemma 3 reference)"
bash scripts/python.sh --deps

step "format"
cargo fmt --all --check

step "clippy"
cargo clippy --workspace --all-targets --all-features -- -D warnings

step "tests"
# Libraries, binaries and test targets, then the doc tests. Examples are not
# built here: clippy --all-targets above has checked they compile, and the
# soak example builds in release below.
source scripts/test-scope.sh
{ cargo test "${test_scope[@]}" --lib --bins --tests -- --nocapture 2>&1
  cargo test "${test_scope[@]}" --doc 2>&1; } | tee target/test.log | grep -E '^(test |running |test result|     Running|   Doc-tests)|SKIP|adapter|ISA|panicked|error' || true
grep -q '^test result: FAILED' target/test.log && { echo "tests failed"; exit 1; }
grep -qE '^error(\[|:)' target/test.log && { echo "build failed"; exit 1; }
step "C ABI (header, C test under ASan/UBSan, C++ example)"
bash scripts/capi.sh 2>&1 | tee target/capi.log
step "Python (abi3 wheel with maturin, pytest over it)"
bash scripts/python.sh 2>&1 | tee target/python.log
step "soak (a hybrid layer decodes 1M tokens: memory and accuracy), in the background"
# One thread for about four minutes: it runs beside the inlining check and
# the NEON step (whose linking and qemu leave a core idle much of the time),
# and its result is read after them.
cargo build --release -q -p hgca-hybrid --example soak
target/release/examples/soak >target/soak.log 2>&1 &
soak_pid=$!
trap 'kill "$soak_pid" 2>/dev/null || true' EXIT
step "SIMD inlining (the test binaries)"
bash scripts/check-inlined.sh

passed=$( (grep -E '^test result:' target/test.log | sed -E 's/.* ([0-9]+) passed; ([0-9]+) failed.*/\1 \2/'; sed -nE 's/^capi: ([0-9]+) passed, ([0-9]+) failed$/\1 \2/p' target/capi.log; sed -nE 's/^([0-9]+) passed.* in .*$/\1 0/p' target/python.log) | awk '{p+=$1; f+=$2} END {print p+0, f+0}')

if [ -f scripts/neon-test.sh ]; then
  step "NEON under qemu"
  bash scripts/neon-test.sh
fi

step "soak's result"
if ! wait "$soak_pid"; then cat target/soak.log; echo "soak failed"; exit 1; fi
trap - EXIT
cat target/soak.log

step "fuzz (5 targets, ${HGCA_FUZZ_SECONDS:-120} s)"
bash scripts/fuzz.sh "${HGCA_FUZZ_SECONDS:-120}"

step "done"
read -r p f <<<"$passed"
echo "tests: $p passed, $f failed"
