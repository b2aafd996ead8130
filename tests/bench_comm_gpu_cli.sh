#!/usr/bin/env bash
# tp-bench-comm's GPU command line, on any machine: --device cuda (shm ranks
# as threads on CUDA buffers) and --backend nccl --nccl-bare either run a tiny
# checked sweep (a GPU is there: exit 0, the '# gpu' copy-baseline lines, the
# '# bare' lines) or stop at once with "no CUDA device" and exit 77 (no GPU,
# or libtp without CUDA). Combinations the bench does not run exit 64 naming
# the option: --device cuda with mpi, --device cpu with nccl, --nccl-bare
# without nccl or beyond one rank, a device that is neither cpu nor cuda.
#   tests/bench_comm_gpu_cli.sh BUILD/bench/tp-bench-comm
set -uo pipefail
bench=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }
tiny=(-b 4K -e 8K -n 2 -w 1 -R 2 -c 1)

"$bench" --help >"$tmp/help" 2>&1 || fail "--help exits $?"
for opt in --device --nccl-bare; do
    grep -q -- "^ *$opt " "$tmp/help" || fail "--help does not list $opt"
done
nccl=0
grep -q "^  nccl .*" "$tmp/help" && ! grep -q "not in this libtp" <(grep -A1 "^  nccl " "$tmp/help") &&
    nccl=1

# expect_usage "what" pattern args...: exit 64 and the message matches pattern
expect_usage() {
    local what=$1 pat=$2
    shift 2
    "$bench" "$@" >"$tmp/out" 2>&1
    local rc=$?
    [ $rc -eq 64 ] || fail "$what: exits $rc, not 64: $(head -3 "$tmp/out")"
    grep -qE -- "$pat" "$tmp/out" || fail "$what: the message does not say '$pat': $(cat "$tmp/out")"
}
expect_usage "--device gpu" "bad value 'gpu' for --device" --device gpu
expect_usage "--device cuda --backend mpi" "(--device cuda with --backend mpi is not supported|backend 'mpi' is not registered)" \
    --device cuda --backend mpi
expect_usage "--nccl-bare on shm" "--nccl-bare .* needs --backend nccl -g 1" --nccl-bare
if [ $nccl -eq 1 ]; then
    expect_usage "--backend nccl --device cpu" "--device cpu with --backend nccl" --backend nccl --device cpu
    expect_usage "--nccl-bare -g 2" "--nccl-bare runs a world of one" --backend nccl -g 2 --nccl-bare
else
    expect_usage "--backend nccl without NCCL" "backend 'nccl' is not registered" --backend nccl -g 1 --nccl-bare
fi

# A GPU run: the tiny sweep passes with the GPU lines, or a clear skip (77).
# gpu_run "what" grep-for-on-a-GPU args...
gpu_run() {
    local what=$1 want=$2
    shift 2
    "$bench" "$@" "${tiny[@]}" --csv "$tmp/gpu.csv" >"$tmp/out" 2>&1
    local rc=$?
    if [ $rc -eq 77 ]; then
        local before=$fails
        grep -q "no CUDA device" "$tmp/out" || fail "$what: exit 77 without 'no CUDA device': $(cat "$tmp/out")"
        [ "$(wc -l <"$tmp/out")" -le 2 ] || fail "$what: more than the skip message: $(cat "$tmp/out")"
        [ ! -e "$tmp/gpu.csv" ] || fail "$what: a CSV was written though nothing ran"
        [ $fails -eq $before ] && echo "$what: no CUDA device (exit 77, as it must)"
        return
    fi
    [ $rc -eq 0 ] || { fail "$what: exits $rc: $(tail -20 "$tmp/out")"; return; }
    grep -q "^$want" "$tmp/out" || fail "$what: no '$want' lines"
    grep -q "FAILED\|ERROR" "$tmp/out" && fail "$what: a check failed: $(grep 'FAILED\|ERROR' "$tmp/out")"
    awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) c[$i] = i; next }
             $c["device"] != "cuda" || ($c["wrong"] != "" && $c["wrong"] != 0) { bad++ }
             END { exit bad > 0 || NR < 2 }' "$tmp/gpu.csv" ||
        fail "$what: the CSV has rows off the GPU or wrong elements"
    rm -f "$tmp/gpu.csv"
    echo "$what: ran on the GPU"
}
gpu_run "--backend shm --device cuda -g 2" "# gpu" --backend shm --device cuda -g 2
gpu_run "--backend shm --device cuda -g 1 all_reduce" "# gpu" --backend shm --device cuda -g 1 \
    --collective all_reduce
if [ $nccl -eq 1 ]; then
    gpu_run "--backend nccl -g 1 --nccl-bare" "# bare" --backend nccl -g 1 --nccl-bare \
        --collective all_reduce,all_gather
fi

# --device cpu is the default's explicit spelling: a CPU run, no GPU lines
"$bench" --device cpu -g 2 --collective all_reduce "${tiny[@]}" --roof-bytes 1M >"$tmp/out" 2>&1 ||
    fail "--device cpu exits $?: $(tail -5 "$tmp/out")"
grep -q "^# gpu" "$tmp/out" && fail "--device cpu printed GPU lines"
grep -q "device cpu \[shm\]" "$tmp/out" || fail "--device cpu: the ranks are not on the CPU"

[ $fails -eq 0 ] && echo "bench_comm_gpu_cli: all checks passed"
exit $((fails > 0))
