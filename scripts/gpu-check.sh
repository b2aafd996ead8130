#!/usr/bin/env bash
# One command that proves libtp on a GPU: builds it with CUDA and NCCL (or
# takes a prebuilt archive from scripts/gpu-bundle.sh), runs the whole test
# suite with the GPU present, runs the examples and the GPU benchmarks, and
# writes a report: gpu-report.md (Markdown), gpu-results.csv (one row per
# suite), the benchmarks' CSVs and gpu-logs.tar.xz (every log).
#
#   scripts/gpu-check.sh [--bundle ARCHIVE] [--out DIR] [--gpu-only] [--skip-bench]
#
#   --bundle ARCHIVE  run a scripts/gpu-bundle.sh archive instead of building
#                     (for a GPU machine without libtp's build dependencies)
#   --out DIR         where the report goes (default: $OUT when set, else gpu-report)
#   --gpu-only        only the GPU suites (cuda, cuda_kernels, nccl, replicate)
#   --skip-bench      no benchmarks
#
# Exit status: 0 when every test passed and no GPU test was skipped; 1 when a
# test failed or a GPU test skipped; 2 when there is no GPU or nothing to run.
set -euo pipefail
cd "$(dirname "$0")/.."

bundle="" out=${OUT:-gpu-report} extra=()
while [ $# -gt 0 ]; do
    case $1 in
    --bundle) bundle=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --gpu-only | --skip-bench) extra+=("$1"); shift ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu-check: unknown option $1 (see --help)" >&2; exit 64 ;;
    esac
done

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu-check: no GPU here (nvidia-smi finds none)" >&2
    exit 2
fi
device=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)
echo "gpu-check: $(nvidia-smi -L | wc -l) GPU(s); first: $device"
mkdir -p "$out"

if [ -n "$bundle" ]; then
    root=${TP_GPU_BUNDLE_DIR:-/tmp/tp-gpu-bundle}
    rm -rf "$root" && mkdir -p "$root"
    tar -C "$root" -xJf "$bundle"
    cat "$root/BUILD_INFO"
    # CUDA's libraries come from this machine (they must match its driver):
    # a toolkit's, or the nvidia-* Python wheels'
    dirs=()
    for lib in libcuda.so.1 libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libnccl.so.2; do
        p=$(ldconfig -p 2>/dev/null | awk -v l="$lib" '$1 == l {print $NF; exit}')
        if [ -z "$p" ]; then
            p=$(find /usr/local/cuda*/lib64 /usr/local/nvidia/lib* /usr/lib/x86_64-linux-gnu \
                    $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null) \
                    -name "$lib" 2>/dev/null | head -1 || true)
        fi
        if [ -z "$p" ]; then
            echo "gpu-check: $lib not found on this machine" >&2
            exit 2
        fi
        dirs+=("$(dirname "$p")")
    done
    libpath="$root/lib:$(printf '%s\n' "${dirs[@]}" | awk '!seen[$0]++' | paste -sd:)"
    export LD_LIBRARY_PATH="$libpath${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    tests_json=$root/tests.json
else
    root=${BUILD_DIR:-build-gpu}
    BUILD_DIR=$root MESON_ARGS="-Dbuildtype=release -Dcuda=enabled -Dnccl=enabled ${MESON_ARGS:-}" \
        ./scripts/setup.sh
    tests_json=$out/tests.json
    meson introspect --tests "$root" > "$tests_json"
fi

python3 scripts/gpu_check.py --root "$root" --tests-json "$tests_json" --out "$out" \
    --device "$device" "${extra[@]}"
