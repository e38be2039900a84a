#!/usr/bin/env bash
# Checks that hgca-cpu's SIMD code was compiled inside its ISA's target
# features. A kernel that LLVM leaves outside pulp's `vectorize` calls every
# `core::arch` intrinsic out of line: the AVX2 block bounds ran ~45x slower
# that way (see `dispatch!` in hgca-cpu/src/isa.rs), and no test fails.
#
#   scripts/check-inlined.sh            the test build's binaries of the CPU
#                                       kernels and the hybrid layer
#                                       (run after `cargo test`; no build)
#   scripts/check-inlined.sh --release  builds hgca-cpu's examples in release
#                                       (~3 min from clean) and checks them
#
# The test profile (opt-level 2) leaves a few intrinsic loads as calls even
# inside `vectorize`, so there only calls from closures (the shape of the
# failure: a `FnOnce::call_once` shim not inlined into `vectorize`) count;
# in release, every call to an intrinsic does.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--release" ]; then
  cargo build --release -p hgca-cpu --examples
  bins=(target/release/examples/kernel_speed target/release/examples/select_speed)
  where='.'
else
  bins=()
  for name in conformance hgca_cpu hybrid batch; do
    b=$(ls -t target/debug/deps/"$name"-* 2>/dev/null | grep -v '\.d$' | head -n 1 || true)
    [ -n "$b" ] && bins+=("$b")
  done
  [ ${#bins[@]} -gt 0 ] || { echo "check-inlined: no hgca-cpu test binary (run cargo test first)"; exit 1; }
  where='FnOnce::call_once|\{\{closure\}\}'
fi

command -v objdump >/dev/null || { echo "check-inlined: objdump not found (binutils)"; exit 1; }
bad=0
for b in "${bins[@]}"; do
  # Functions (demangled) holding a call to a core::arch intrinsic; CPU
  # feature detection (std_detect, compiler_builtins, crates' cpuid probes)
  # is not kernel code.
  found=$(objdump -d --no-show-raw-insn -C "$b" \
    | awk '/^[0-9a-f]+ </ { f = $0 } /call.*<core::core_arch::/ { print f }' \
    | grep -Ev 'std_detect|compiler_builtins|cpuid' \
    | grep -E "$where" | sort | uniq -c || true)
  if [ -n "$found" ]; then
    echo "check-inlined: $b calls SIMD intrinsics out of line in:"
    echo "$found"
    bad=1
  else
    echo "check-inlined: $b: every SIMD intrinsic inlined"
  fi
done
exit $bad
