#!/usr/bin/env bash
# Cross-builds hgca-cpu's tests for aarch64 and runs them under qemu on an
# ARMv8.0 CPU model (cortex-a53: no FEAT_FP16, which the kernels do not need:
# FCVTL, half to single, is base AdvSIMD). The tests assert the NEON path
# was taken. Installs its tools with apt (as root) when missing.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v qemu-aarch64 >/dev/null 2>&1 || need+=(qemu-user)
command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 || need+=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross)
[ -d /usr/lib/rustlib/aarch64-unknown-linux-gnu ] || need+=(rustc-web cargo-web libstd-rust-web-dev:arm64)
if [ "${#need[@]}" -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    msg="neon-test: missing ${need[*]} and not root"
    if [[ ",${HGCA_REQUIRE:-}," == *",neon,"* ]]; then echo "$msg" >&2; exit 1; fi
    echo "SKIP: $msg"; exit 0
  fi
  dpkg --print-foreign-architectures | grep -qx arm64 || dpkg --add-architecture arm64
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

export RUSTC=/usr/bin/rustc RUSTDOC=/usr/bin/rustdoc CARGO_TARGET_DIR=target/aarch64
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER=qemu-aarch64
# Under qemu the NEON suite may not skip (hgca_testkit::require); the x86
# ISAs the caller listed do not exist here.
export HGCA_REQUIRE=neon
/usr/bin/cargo --version
cpu=cortex-a53
echo "== NEON tests under qemu, QEMU_CPU=$cpu (ARMv8.0)"
mkdir -p target/aarch64
log=target/aarch64/neon-$cpu.log
rc=0
# The portable scalar path is the same Rust on every target and runs
# natively in the main suite. Under qemu only the integration suite's NEON
# path and its ISA-independent tests run. Not run here, each also run
# natively: the library's unit tests (three, none on a NEON path), the
# window-role suite (it runs the best ISA's kernels), the doc tests (each
# one a cross-compiled binary), the edge tables (attention's and the paged
# one's) again on threads and the test of one backend shared by 8 threads
# (each over a minute under qemu: the split across threads is the same
# code on every ISA, the NEON kernels their threads call are those of the
# sequential tables, which run, and qemu on an x86 host gives the threads
# the host's stronger memory ordering, so they show no more here).
QEMU_CPU=$cpu /usr/bin/cargo test -p hgca-cpu --target aarch64-unknown-linux-gnu --test cpu -- --nocapture --skip scalar:: --skip window_suite:: --skip neon::paged_layouts_edge_table_threaded --skip neon::edge_table_threaded --skip conformance::shared_backend_from_8_threads_matches_one_thread >"$log" 2>&1 || rc=$?
grep -E '^test result|NEON path|ISA .* runs|panicked|FAILED|^error' "$log" || true
if [ "$rc" -ne 0 ]; then echo "NEON tests failed under QEMU_CPU=$cpu (log: $log)"; tail -30 "$log"; exit 1; fi
