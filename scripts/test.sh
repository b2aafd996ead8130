#!/usr/bin/env bash
# Runs the whole test suite of an existing build ($BUILD_DIR, default: build)
# and closes with one line "N passed, N failed" summed over every Criterion
# executable. Extra arguments go to `meson test`.
set -uo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build}
meson test -C "$build" --print-errorlogs "$@"
rc=$?
log="$build/meson-logs/testlog.txt"
if [ -f "$log" ]; then
    # Criterion: "Synthesis: Tested: T | Passing: P | Failing: F | Crashing: C"
    # Criterion: "Synthesis: Tested: T | Passing: P | Failing: F | Crashing: C";
    # the MPI programs: "mpi: N passed, N failed" (checks, summed over ranks)
    awk -F'[:|]' '/Synthesis: Tested:/ {
            for (i = 1; i <= NF; i++) {
                if ($i ~ /Passing/) p += $(i+1)
                if ($i ~ /Failing/) f += $(i+1)
                if ($i ~ /Crashing/) f += $(i+1)
            }
        }
        /^mpi: [0-9]+ passed, [0-9]+ failed/ { split($2, a, " "); mp += a[1]; mf += a[3] }
        /^\[SKIP\] / { if ($0 ~ /no CUDA device|without CUDA|without NCCL/) gs++; else sk++ }
        END {
            if (mp + mf) printf "mpi checks: %d passed, %d failed\n", mp, mf
            if (gs) printf "GPU tests skipped: %d (no CUDA device, or built without CUDA/NCCL)\n", gs
            if (sk) printf "other tests skipped: %d (e.g. more ranks than mpirun started)\n", sk
            printf "tests: %d passed, %d failed\n", p, f
        }' "$log"
fi
exit $rc
