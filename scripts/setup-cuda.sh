#!/usr/bin/env bash
# Sets up what the CUDA backend's compile check needs, without a CUDA toolkit
# and without a GPU: NVRTC (libnvrtc.so.12), the CUDA runtime headers and
# ptxas, all from NVIDIA's pip wheels, in a Python venv.
#
#   eval "$(bash scripts/setup-cuda.sh)"      # install if needed, export the env
#   cargo test -p hgca-gpu --features cuda --test cuda
#
# Idempotent: the wheels are installed only when a file they provide is
# missing. Progress goes to stderr; stdout carries only `export` lines.
#
# Environment:
#   HGCA_CUDA_VENV  venv folder (default: <repo>/.venv/cuda, git-ignored)
#   PYTHON          interpreter that creates the venv (default: python3)
#   HGCA_CUDA_WHEEL_VERSION  e.g. 12.4: pin the wheels to that CUDA release
#                   (NVRTC's PTX must not be newer than the GPU driver)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${HGCA_CUDA_VENV:-$root/.venv/cuda}
python=${PYTHON:-python3}

log() { echo "setup-cuda: $*" >&2; }

if ! command -v "$python" >/dev/null 2>&1; then
    log "no '$python' on PATH: install Python 3 (with venv) first"
    exit 1
fi

if [ ! -x "$venv/bin/python" ]; then
    log "creating venv $venv"
    "$python" -m venv "$venv" >&2
fi

site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
nvrtc_dir=$site/nvidia/cuda_nvrtc/lib
include_dir=$site/nvidia/cuda_runtime/include
nvcc_bin=$site/nvidia/cuda_nvcc/bin

if [ -n "${HGCA_CUDA_WHEEL_VERSION:-}" ]; then
    spec="==${HGCA_CUDA_WHEEL_VERSION}.*"
else
    spec=">=12.4,<13"
fi
installed=$( ("$venv/bin/python" -m pip show nvidia-cuda-nvrtc-cu12 2>/dev/null || true) | sed -n "s/^Version: //p")
if [ -n "${HGCA_CUDA_WHEEL_VERSION:-}" ] && [ -n "$installed" ] \
    && [ "${installed#"$HGCA_CUDA_WHEEL_VERSION".}" = "$installed" ]; then
    log "installed NVRTC $installed does not match $HGCA_CUDA_WHEEL_VERSION: reinstalling"
    rm -f "$nvrtc_dir/libnvrtc.so.12"
fi
if [ -e "$nvrtc_dir/libnvrtc.so.12" ] && [ -e "$include_dir/cuda_fp16.h" ] && [ -x "$nvcc_bin/ptxas" ]; then
    log "wheels already installed in $venv"
else
    log "installing nvidia-cuda-{nvrtc,runtime,nvcc}-cu12 into $venv (about 130 MB)"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
        --force-reinstall "nvidia-cuda-nvrtc-cu12$spec" "nvidia-cuda-runtime-cu12$spec" \
        "nvidia-cuda-nvcc-cu12$spec" >&2
fi

for f in "$nvrtc_dir/libnvrtc.so.12" "$include_dir/cuda_fp16.h" "$nvcc_bin/ptxas"; do
    if [ ! -e "$f" ]; then
        log "expected file missing after install: $f"
        exit 1
    fi
done
chmod +x "$nvcc_bin/ptxas" 2>/dev/null || true

# cudarc's dynamic loader tries, among others, `libnvrtc.so` and
# `libnvrtc.so.12`; the wheel ships the latter, which is enough. The
# unversioned name is added inside the venv for other loaders.
[ -e "$nvrtc_dir/libnvrtc.so" ] || ln -s libnvrtc.so.12 "$nvrtc_dir/libnvrtc.so"

echo "export LD_LIBRARY_PATH=\"$nvrtc_dir\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}\""
echo "export HGCA_CUDA_INCLUDE=\"$include_dir\""
echo "export HGCA_PTXAS=\"$nvcc_bin/ptxas\""
