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
    awk -F'[:|]' '/Synthesis: Tested:/ {
            for (i = 1; i <= NF; i++) {
                if ($i ~ /Passing/) p += $(i+1)
                if ($i ~ /Failing/) f += $(i+1)
                if ($i ~ /Crashing/) f += $(i+1)
            }
        }
        END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
fi
exit $rc
