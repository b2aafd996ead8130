#!/usr/bin/env bash
# The contract of tp-bench-sim's measuring mode on a tiny model: bad command
# lines exit 2 with the usage (or a reason), and --measure with a
# calibrated description prints how the ranks share the devices, the
# predicted against the measured step, and the walk's event counts.
#   tests/bench_sim_cli.sh BUILD/bench/tp-bench-sim BUILD/bench/tp-bench-calibrate
set -uo pipefail
sim=$1 calibrate=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }
tiny=(--layers 1 --hidden 64 --ffn 128 --heads 4 --seq 16)

for args in "--bogus" "--dp" "--backend tcp --measure 1 --hw x" "--measure 1"; do
    # shellcheck disable=SC2086
    "$sim" "${tiny[@]}" $args >"$tmp/out" 2>&1
    rc=$?
    [ $rc -eq 2 ] || fail "'$args' exits $rc, not 2"
    grep -qE "usage:|needs --hw" "$tmp/out" || fail "'$args' prints neither the usage nor why"
done
"$sim" "${tiny[@]}" --tp 1 --backend mpi >"$tmp/out" 2>&1
[ $? -eq 2 ] && grep -q "is for --measure" "$tmp/out" || fail "--backend mpi without --measure"

OPENBLAS_NUM_THREADS=1 "$calibrate" -q -r 1 -o "$tmp/hw.json" >"$tmp/cal" 2>&1 ||
    fail "calibrate exits $?: $(cat "$tmp/cal")"
OPENBLAS_NUM_THREADS=1 "$sim" "${tiny[@]}" --dp 1 --tp 4 --measure 2 --hw "$tmp/hw.json" \
    >"$tmp/out" 2>&1 || fail "a measured run exits $?"
devices=$(grep -oE '"devices_per_node": [0-9]+' "$tmp/hw.json" | grep -oE '[0-9]+$')
share=$(((4 + devices - 1) / devices))
grep -qE "^4 ranks \(shm threads\) on $devices devices?: $share ranks? per device" "$tmp/out" ||
    fail "no '4 ranks (shm threads) on $devices devices: $share per device' line"
grep -qE "^predicted step [0-9.]+ s .* measured over 2 steps: .* error vs median [-+][0-9.]+%" \
    "$tmp/out" || fail "no predicted-against-measured line"
grep -qE "^the walk: [1-9][0-9]* GEMMs, [1-9][0-9]* element-wise kernels, [1-9][0-9]* collectives" \
    "$tmp/out" || fail "no walk counts (tp 4 has collectives)"

if [ $fails -ne 0 ]; then
    cat "$tmp/out"
    exit 1
fi
echo "tp-bench-sim CLI: ok"
