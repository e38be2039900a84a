#!/usr/bin/env bash
# Device check of the CUDA backend, for a machine with an NVIDIA GPU (sized
# for an H200: under 6 minutes including the build on 16 cores).
#
#   bash scripts/gpu-check.sh --prepare   # on a dev machine (network, Rust):
#       builds the release test and bench binaries and packs them, with
#       NVRTC and ptxas (xz), into .venv/gpu-check/ (about 45 MB, git-ignored)
#       to carry to a bare GPU machine.
#   bash scripts/gpu-check.sh             # on the GPU machine; figures also go to $OUT
#
# On the GPU machine it uses .venv/gpu-check/ when present (no Rust, no
# network needed); otherwise it needs cargo and builds (and sets up NVRTC
# with scripts/setup-cuda.sh, which needs PyPI). Then it:
# 1. runs the CUDA tests (NVRTC/ptxas report and the shared conformance
#    suite against hgca-ref, on the GPU) with HGCA_REQUIRE=nvrtc,cuda, so
#    that a missing NVRTC, ptxas or GPU fails instead of skipping;
# 2. times decode attention (32/8 heads, d 128, f16, 4k..256k tokens) and the
#    merge against a device-to-device copy measured in the same run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
start=$(date +%s)
out=${OUT:-}
pack=.venv/gpu-check
log() { echo "gpu-check [$(( $(date +%s) - start ))s]: $*"; }

if [ "${1:-}" = "--prepare" ]; then
    eval "$(bash scripts/setup-cuda.sh)"
    log "building release test and bench binaries"
    cargo build --release -p hgca-gpu --features cuda,bench-timers --examples
    cargo build --release -p hgca-demo --no-default-features --features cuda
    exe=$(cargo test --release -p hgca-gpu --features cuda,bench-timers --test cuda --no-run 2>&1 \
        | sed -n 's/.*Executable tests\/cuda.rs (\(.*\))/\1/p' | tail -1)
    [ -x "$exe" ] || { echo "gpu-check: test binary not found" >&2; exit 1; }
    rm -rf "$pack" && mkdir -p "$pack"
    strip -o "$pack/cuda-tests" "$exe" 2>/dev/null || cp "$exe" "$pack/cuda-tests"
    strip -o "$pack/cuda-bench" target/release/examples/cuda_bench 2>/dev/null \
        || cp target/release/examples/cuda_bench "$pack/cuda-bench"
    strip -o "$pack/hgca-demo" target/release/hgca-demo 2>/dev/null \
        || cp target/release/hgca-demo "$pack/hgca-demo"
    nvrtc_dir=${LD_LIBRARY_PATH%%:*}
    log "compressing NVRTC and ptxas (xz, about a minute)"
    xz -T0 -6 -c "$nvrtc_dir/libnvrtc.so.12" > "$pack/libnvrtc.so.12.xz"
    for f in "$nvrtc_dir"/libnvrtc-builtins.so.12.*; do
        xz -6 -c "$f" > "$pack/$(basename "$f").xz"
    done
    xz -T0 -6 -c "$HGCA_PTXAS" > "$pack/ptxas.xz"
    du -sh "$pack"
    log "carry $pack to the GPU machine and run: bash scripts/gpu-check.sh"
    exit 0
fi

if [ -x "$pack/cuda-tests" ] && [ -x "$pack/cuda-bench" ]; then
    # Every stage runs even when an earlier one fails (a device call is
    # precious): the exit status says whether all passed.
    set +e
    failed=
    command -v nvidia-smi >/dev/null 2>&1 \
        && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader
    lib=$(mktemp -d)
    log "unpacking NVRTC and ptxas from $pack"
    for f in "$pack"/*.xz; do
        xz -dc "$f" > "$lib/$(basename "$f" .xz)"
    done
    chmod +x "$lib/ptxas"
    # cudarc tries `libnvrtc.so` before `libnvrtc.so.12`: without this link a
    # CUDA 13 image's own NVRTC wins, and its PTX (ISA 9.0) is newer than the
    # packed ptxas (12.9) reads.
    ln -sf libnvrtc.so.12 "$lib/libnvrtc.so"
    export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export HGCA_PTXAS="$lib/ptxas" HGCA_REQUIRE=nvrtc,cuda
    logs=${out:-$(mktemp -d)}
    mkdir -p "$logs"
    log "CUDA tests (compile report + conformance on the GPU)"
    "$pack/cuda-tests" --nocapture > "$logs/cuda_tests.log" 2>&1 || failed="$failed tests"
    grep -E "^test |test result|SKIP|panicked|FAILED|regs|spill" "$logs/cuda_tests.log" | tail -60
    log "timing decode and merge"
    "$pack/cuda-bench" 2>&1 | tee "$logs/cuda_bench.log"
    [ "${PIPESTATUS[0]}" = 0 ] || failed="$failed bench"
    # The shared-memory staged decode loop (opt-in until it has passed here).
    log "staged decode (HGCA_CUDA_STAGED=1): conformance and timing"
    mkdir -p "$logs/staged"
    HGCA_CUDA_STAGED=1 "$pack/cuda-tests" --nocapture > "$logs/staged/cuda_tests.log" 2>&1 \
        || failed="$failed staged_tests"
    grep -E "^test |test result" "$logs/staged/cuda_tests.log" | tail -10
    HGCA_CUDA_STAGED=1 OUT="$logs/staged" "$pack/cuda-bench" 2>&1 | tee "$logs/staged/cuda_bench.log"
    [ "${PIPESTATUS[0]}" = 0 ] || failed="$failed staged_bench"
    if [ -x "$pack/hgca-demo" ]; then
        for ctx in 131072 32768; do
            log "hybrid decode, CUDA dense + CPU sparse, context $ctx"
            "$pack/hgca-demo" hybrid --backend cuda --context $ctx --steps 24 2>&1 \
                | tee "$logs/demo_$ctx.log"
            [ "${PIPESTATUS[0]}" = 0 ] || failed="$failed demo_$ctx"
        done
    fi
    rm -rf "$lib"
    if [ -n "$failed" ]; then
        log "FAILED:$failed"
        exit 1
    fi
    log "done"
    exit 0
fi

if ! command -v cargo >/dev/null 2>&1; then
    for d in "$HOME/.cargo/bin" /usr/local/cargo/bin; do
        [ -x "$d/cargo" ] && export PATH="$d:$PATH" && break
    done
fi
if ! command -v cargo >/dev/null 2>&1; then
    echo "gpu-check: no 'cargo' on this machine: install a Rust toolchain (>= 1.88, e.g. rustup) and rerun" >&2
    exit 2
fi
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    drv_cuda=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9]*\.[0-9]*\).*/\1/p' | head -1)
    log "driver supports CUDA ${drv_cuda:-unknown}"
else
    log "nvidia-smi not found; the tests will say whether libcuda loads"
    drv_cuda=
fi

# NVRTC must not be newer than the driver, or the driver rejects its PTX:
# pin the wheels to the driver's CUDA 12.x when it is older than 12.9.
if [ -n "${drv_cuda:-}" ] && [ -z "${HGCA_CUDA_WHEEL_VERSION:-}" ]; then
    major=${drv_cuda%%.*}; minor=${drv_cuda#*.}
    if [ "$major" = 12 ] && [ "$minor" -lt 9 ]; then
        export HGCA_CUDA_WHEEL_VERSION="12.$minor"
    fi
fi
log "setting up NVRTC and ptxas"
eval "$(bash scripts/setup-cuda.sh)"
export HGCA_REQUIRE=nvrtc,cuda

jobs=$(nproc 2>/dev/null || echo 4)
log "building (release, --features cuda,bench-timers, $jobs jobs)"
cargo build --release -j "$jobs" -p hgca-gpu --features cuda,bench-timers --tests --examples

log "CUDA tests (compile report + conformance on the GPU)"
set -o pipefail
test_log=$(mktemp)
cargo test --release -j "$jobs" -p hgca-gpu --features cuda,bench-timers --test cuda -- --nocapture 2>&1 | tee "$test_log"

log "timing decode and merge"
cargo run --release -j "$jobs" -p hgca-gpu --features cuda,bench-timers --example cuda_bench
if [ -n "$out" ]; then
    mkdir -p "$out"
    cp "$test_log" "$out/cuda_tests.log"
fi
rm -f "$test_log"
log "done"
