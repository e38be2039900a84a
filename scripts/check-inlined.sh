#!/usr/bin/env bash
# Checks that hgca-cpu's SIMD code was compiled inside its ISA's target
# features. A kernel that LLVM leaves outside pulp's `vectorize` calls every
# `core::arch` intrinsic out of line: the AVX2 block bounds ran ~45x slower
# that way (see `dispatch!` in hgca-cpu/src/isa.rs), and no test fails.
#
#   scripts/check-inlined.sh            the test build's binaries of the CPU
#                                       kernels (attention, the sparse FFN,
#                                       the quantised matvec) and the
#                                       hybrid layer (run
#                                       after scripts/test.sh's `cargo
#                                       test`; nothing to rebuild)
#   scripts/check-inlined.sh --release  builds hgca-cpu's examples in release
#                                       (~3 min from clean) and checks them
#
# The test profile (opt-level 2) leaves some intrinsics as calls inside
# `vectorize` and in small generic helpers (`array::map`, iterator folds)
# that release inlines, so there only calls from closures (the shape of the
# failure: a `FnOnce::call_once` shim not inlined into `vectorize`) count;
# in release, every call to an intrinsic does.
set -euo pipefail
cd "$(dirname "$0")/.."

command -v objdump >/dev/null || { echo "check-inlined: objdump not found (binutils)"; exit 1; }
if [ "${1:-}" = "--release" ]; then
  cargo build --release -p hgca-cpu --examples
  bins=(target/release/examples/kernel_speed target/release/examples/select_speed)
  where='.'
else
  # The exact test executables of the suite's build (`cargo test
  # <test_scope> --lib --bins --tests`, as scripts/test.sh
  # runs it; nothing is rebuilt after it), not whatever
  # matching file is newest in target/.
  source scripts/test-scope.sh
  mapfile -t bins < <(cargo test "${test_scope[@]}" --lib --bins --tests --no-run --message-format=json 2>/dev/null \
    | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    t = m.get("target", {})
    if m.get("reason") == "compiler-artifact" and m.get("executable") and t.get("name") in ("hgca_cpu", "cpu", "hgca_hybrid", "layers"):
        print(m["executable"])
')
  # hgca-cpu's and hgca-hybrid's unit tests and their integration tests
  # (one binary per crate: tests/cpu, tests/layers).
  [ ${#bins[@]} -ge 4 ] || { echo "check-inlined: expected 4 test binaries of hgca-cpu and hgca-hybrid, found ${#bins[@]}"; exit 1; }
  where='FnOnce::call_once|\{\{closure\}\}'
fi

bad=0
dis=$(mktemp)
trap 'rm -f "$dis"' EXIT
for b in "${bins[@]}"; do
  objdump -d --no-show-raw-insn -C "$b" > "$dis"
  # Functions (demangled) holding a call (or tail jump) to a core::arch
  # intrinsic; CPU feature detection (std_detect, compiler_builtins,
  # crates' cpuid probes) is not kernel code.
  # (An outlined intrinsic's own body, jumping inside itself, is skipped:
  # its callers are what is reported.)
  found=$(awk '/^[0-9a-f]+ </ { f = $0 } /(call|jmp).*<core::core_arch::/ && f !~ /<core::core_arch::/ { print f }' "$dis" \
    | { grep -Ev 'std_detect|compiler_builtins|cpuid' || true; } \
    | { grep -E "$where" || true; } | sort | uniq -c)
  if [ -n "$found" ]; then
    echo "check-inlined: $b calls SIMD intrinsics out of line in:"
    echo "$found"
    bad=1
  else
    echo "check-inlined: $b: every SIMD intrinsic inlined"
  fi
done
exit $bad
