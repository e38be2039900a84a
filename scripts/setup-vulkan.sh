#!/usr/bin/env bash
# Installs Mesa's software Vulkan driver (lavapipe, adapter "llvmpipe") and the
# Vulkan loader, so that hgca-gpu's wgpu tests find an adapter on a machine
# without a GPU. Idempotent: does nothing when the packages are present.
#
# Usage: scripts/setup-vulkan.sh   (as root, or with passwordless sudo)
set -euo pipefail

PKGS=(mesa-vulkan-drivers libvulkan1)

missing=()
for p in "${PKGS[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$p")
    fi
done

if [ "${#missing[@]}" -eq 0 ]; then
    echo "setup-vulkan: ${PKGS[*]} already installed"
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "setup-vulkan: apt-get not found; install ${missing[*]} by hand (wgpu tests will skip without an adapter)"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "setup-vulkan: not root and no passwordless sudo; skipping install of ${missing[*]} (wgpu tests will skip without an adapter)"
        exit 0
    fi
fi

echo "setup-vulkan: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "setup-vulkan: done"
