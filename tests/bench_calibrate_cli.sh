#!/usr/bin/env bash
# The contract of tp-bench-calibrate, quick sizes (-q -r 1): a bad command
# line exits 2 with the usage; a run writes a description that it reads back
# ("wrote FILE (this-machine, read back)"), JSON with every section of the
# format (docs/plan.md), and prints the all_reduce points beside the model.
#   tests/bench_calibrate_cli.sh BUILD/bench/tp-bench-calibrate
set -uo pipefail
bench=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

for args in "-w 1" "-w 65" "-r 0" "-o" "--bogus" "--backend tcp" "--backend"; do
    # shellcheck disable=SC2086
    "$bench" $args >"$tmp/out" 2>&1
    rc=$?
    [ $rc -eq 2 ] || fail "'$args' exits $rc, not 2"
    grep -q "usage:" "$tmp/out" || fail "'$args' prints no usage"
done

# --backend mpi in one process: a clear refusal (libtp with MPI), or the
# world's error (without). Under AddressSanitizer without leak checks, as
# the MPI suites run: OpenMPI's own allocations stay at exit.
ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0" \
    "$bench" -q -r 1 --backend mpi >"$tmp/out" 2>&1
rc=$?
if ! { [ $rc -eq 2 ] && grep -q "needs mpirun -np 2 or more" "$tmp/out"; } &&
    ! { [ $rc -eq 1 ] && grep -q 'tp_comm_create_world("mpi")' "$tmp/out"; }; then
    fail "--backend mpi alone exits $rc: $(cat "$tmp/out")"
fi

"$bench" -q -r 1 -o "$tmp/hw.json" >"$tmp/out" 2>&1 || fail "a run exits $?: $(cat "$tmp/out")"
grep -q "^wrote $tmp/hw.json (this-machine, read back)" "$tmp/out" || fail "no 'wrote ... read back' line"
[ "$(grep -cE '^ *[0-9]+ B ' "$tmp/out")" -eq 4 ] || fail "not 4 all_reduce points (4 KiB to 256 KiB)"
for key in '"name": "this-machine"' '"peak_flops"' '"bf16"' '"gemm_efficiency"' \
    '"memory_bandwidth"' '"kernel_latency"' '"intra_node"' '"inter_node"' '"algorithm": "ring"'; do
    grep -qF "$key" "$tmp/hw.json" || fail "the description lacks $key"
done
if command -v python3 >/dev/null; then
    python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); assert len(d["compute"]["gemm_efficiency"]) == 3' \
        "$tmp/hw.json" || fail "the description is not JSON with 3 GEMM rows"
fi

if [ $fails -ne 0 ]; then
    cat "$tmp/out"
    exit 1
fi
echo "tp-bench-calibrate CLI: ok"
