#!/usr/bin/env bash
# Builds libtp with CUDA and NCCL here and packs what scripts/gpu-check.sh
# runs (library, tests, benches, examples) with every shared library they
# need, the C library and its loader included, into one archive: for a GPU
# machine that has the NVIDIA driver and the CUDA 13 runtime libraries
# (cudart, cuBLAS, NCCL: from a CUDA toolkit or the nvidia-* Python wheels)
# but not libtp's build dependencies (Criterion, OpenBLAS, a compiler).
#
#   scripts/gpu-bundle.sh [ARCHIVE]     default: .gpu/bundle.tar.xz
#
# Then, on the GPU machine, from the repository root:
#   scripts/gpu-check.sh --bundle .gpu/bundle.tar.xz
#
# The binaries' loader is set (patchelf) to <unpack dir>/lib/ld-linux-x86-64.so.2
# and their library path (DT_RPATH) to <unpack dir>/lib, so they run whatever
# the other machine's C library is; gpu-check.sh unpacks
# into the same fixed directory (TP_GPU_BUNDLE_DIR, default /tmp/tp-gpu-bundle).
# CUDA's own libraries (libcuda, cudart, cuBLAS, NCCL) are not packed: they must
# match the driver, so they are taken from the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."

archive=${1:-.gpu/bundle.tar.xz}
build=${BUILD_DIR:-build-gpu}
dest=${TP_GPU_BUNDLE_DIR:-/tmp/tp-gpu-bundle}

if ! command -v patchelf >/dev/null; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "gpu-bundle: patchelf is missing (apt-get install patchelf, as root)" >&2
        exit 1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends patchelf \
        >/dev/null
fi
command -v nvcc >/dev/null || { echo "gpu-bundle: nvcc not found: a CUDA toolkit is needed" >&2; exit 1; }

BUILD_DIR=$build MESON_ARGS="-Dbuildtype=release -Dwerror=true -Dcuda=enabled -Dnccl=enabled -Dmpi=enabled" \
    ./scripts/setup.sh

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/lib" "$stage/tests" "$stage/bench" "$stage/examples"
cp -L "$build"/libtp.so.0 "$stage/lib/"
bins=()
for f in "$build"/tests/* "$build"/bench/* "$build"/examples/*; do
    # programs and the modules tests preload (test helpers included)
    [ -f "$f" ] && [ -x "$f" ] || continue
    sub=$(basename "$(dirname "$f")")
    cp "$f" "$stage/$sub/"
    bins+=("$stage/$sub/$(basename "$f")")
done
# the suite's list and arguments, as meson runs it
meson introspect --tests "$build" > "$stage/tests.json"

# every shared library the binaries load, except the driver's and CUDA's
skip='^(linux-vdso|libcuda\.|libnvidia|libcudart|libcublas|libcublasLt|libnccl)'
ldd "${bins[@]}" "$stage/lib/libtp.so.0" 2>/dev/null \
    | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u \
    | while read -r name path; do
        if ! [[ $name =~ $skip ]]; then cp -L "$path" "$stage/lib/$name"; fi
    done
cp -L /lib64/ld-linux-x86-64.so.2 "$stage/lib/"

# DT_RPATH (not RUNPATH) so that it also serves the libraries' own needs, and
# so that LD_LIBRARY_PATH carries only CUDA's folders: programs of the GPU
# machine itself (python3, bash) must not pick up this C library.
# Every packed library gets it too: one with a RUNPATH of its own (Debian's
# libmpi) would otherwise find its needs in the other machine's ld.so.cache.
libs=()
for l in "$stage"/lib/*; do
    case $(basename "$l") in
    ld-linux* | libc.so* | libm.so* | libpthread.so* | libdl.so* | librt.so* | libresolv.so*) ;;
    *) libs+=("$l") ;;
    esac
done
for b in "${bins[@]}" "${libs[@]}"; do
    if patchelf --print-interpreter "$b" >/dev/null 2>&1; then
        patchelf --set-interpreter "$dest/lib/ld-linux-x86-64.so.2" "$b"
    fi
    patchelf --remove-rpath "$b"
    patchelf --force-rpath --set-rpath "$dest/lib" "$b"
done
{
    echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), $(ldd --version | head -1)"
    nvcc --version | tail -1
} > "$stage/BUILD_INFO"

mkdir -p "$(dirname "$archive")"
tar -C "$stage" -cJf "$archive" .
echo "gpu-bundle: $archive ($(du -h "$archive" | cut -f1)), $(ls "$stage/lib" | wc -l) libraries, ${#bins[@]} programs"
