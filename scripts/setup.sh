#!/usr/bin/env bash
# Installs the Debian packages libtp needs (when missing; needs root for that),
# then configures and builds it in $BUILD_DIR (default: build).
#   MESON_ARGS   extra arguments for a fresh `meson setup` (e.g. -Dwerror=true)
set -euo pipefail
cd "$(dirname "$0")/.."

pkgs=(gcc libc6-dev meson ninja-build pkg-config libopenblas-dev libjansson-dev libcriterion-dev
      libopenmpi-dev openmpi-bin)
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "setup: missing Debian packages: ${missing[*]} (run as root to install them)" >&2
        exit 1
    fi
    echo "setup: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

build=${BUILD_DIR:-build}
if [ ! -f "$build/build.ninja" ]; then
    # shellcheck disable=SC2086
    meson setup "$build" ${MESON_ARGS:-}
fi
ninja -C "$build"
