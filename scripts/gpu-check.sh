#!/usr/bin/env bash
# One command that proves libtp on a GPU: builds it with CUDA and NCCL (or
# takes a prebuilt archive from scripts/gpu-bundle.sh), runs the whole test
# suite with the GPU present, runs the examples and the GPU benchmarks, and
# writes a report: gpu-report.md (Markdown), gpu-results.csv (one row per
# suite), the benchmarks' CSVs and gpu-logs.tar.xz (every log).
#
#   scripts/gpu-check.sh [--bundle ARCHIVE] [--out DIR] [--gpu-only] [--skip-bench]
#                        [--profile-mlp] [--suites LIST] [--jobs N] [--max-test-seconds S]
#                        [--budget-s S]
#
#   --bundle ARCHIVE  run a scripts/gpu-bundle.sh archive instead of building
#                     (for a GPU machine without libtp's build dependencies)
#   --out DIR         where the report goes (default: $OUT when set, else gpu-report)
#   --gpu-only        only the GPU suites (cuda, cuda_kernels, shm_cuda, nccl, replicate, models,
#                     cuda_dist*, the examples on CUDA, the GPU bench checks)
#   --skip-bench      no benchmarks
#   --profile-mlp     also time every kernel of one bf16 TP MLP pass with ncu
#   --max-test-seconds S  cap each suite's time limit at S seconds
#   --budget-s S      end within S seconds of the start of the runs (a lent
#                     machine's command limit less the build or unpacking and
#                     a margin): limits are cut to what is left, what cannot
#                     start is reported as not run, the report is rewritten
#                     as results come in, and the benches run newest targets
#                     first
#   --suites LIST     only these suites (comma-separated; a trailing * matches a prefix)
#   --jobs N          suites at once (default: the cores; GPU suites one at a time)
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
    --gpu-only | --skip-bench | --profile-mlp) extra+=("$1"); shift ;;
    --max-test-seconds | --suites | --jobs | --budget-s) extra+=("$1" "$2"); shift 2 ;;
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
    # the driver's libcuda; cudart, cuBLAS and NCCL from the nvidia-* Python
    # wheels or a CUDA toolkit, and from the system's library path last. A
    # candidate that needs a newer C library than the bundle's is passed over
    # (a distribution's libnccl is often built against its own glibc).
    dirs=()
    for lib in libcuda.so.1 libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libnccl.so.2; do
        p=$(python3 - "$lib" "$root/lib/libc.so.6" <<'PY'
import glob, re, site, subprocess, sys
lib, libc = sys.argv[1], sys.argv[2]
def glibc_need(path):
    data = open(path, "rb").read()
    v = [int(m.group(1)) for m in re.finditer(rb"GLIBC_2\.(\d+)", data)]
    return max(v) if v else 0
have = glibc_need(libc)
ldc = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout.splitlines()
system = [l.split()[-1] for l in ldc if l.strip().startswith(lib + " ")]
wheels = [c for d in site.getsitepackages() for c in glob.glob(f"{d}/nvidia/*/lib/{lib}")]
toolkit = glob.glob(f"/usr/local/cuda*/lib64/{lib}") + glob.glob(f"/usr/local/cuda*/targets/*/lib/{lib}")
order = system + glob.glob(f"/usr/local/nvidia/lib*/{lib}") if lib == "libcuda.so.1" else wheels + toolkit + system
for c in order:
    if lib == "libcuda.so.1" or glibc_need(c) <= have:
        print(c)
        break
PY
)
        if [ -z "$p" ]; then
            echo "gpu-check: no usable $lib on this machine" >&2
            exit 2
        fi
        echo "gpu-check: $lib from $p"
        dirs+=("$(dirname "$p")")
    done
    # the bundle's own folder is in its programs' DT_RPATH, never in
    # LD_LIBRARY_PATH: this machine's programs must keep their C library
    libpath="$(printf '%s\n' "${dirs[@]}" | awk '!seen[$0]++' | paste -sd:)"
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
