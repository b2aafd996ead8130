#!/usr/bin/env bash
# The command line of the GPU benches: tp-bench-gemm, tp-bench-ops --cuda and
# tp-bench-layers --device cuda. Bad command lines exit 64 naming the
# option; without a CUDA device each says "no CUDA device" and exits 2; with
# one, tiny runs write their rows and CSV (exit 0, or 1 for a missed target).
#   tests/bench_gpu_perf_cli.sh BUILD/bench/tp-bench-gemm BUILD/bench/tp-bench-ops BUILD/bench/tp-bench-layers
set -uo pipefail
gemm=$1 ops=$2 layers=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

# ---- --help ---------------------------------------------------------------------
"$gemm" --help >"$tmp/help" 2>&1 || fail "tp-bench-gemm --help exits $?"
for opt in -s --dtype -R --ms -d --csv -h; do
    grep -q -- "^ *$opt[ ,]" "$tmp/help" || fail "tp-bench-gemm --help does not list $opt"
done
for dflt in "4096,8192,16384," "8192x2048x8192" "bf16,f32,tf32"; do
    grep -qF -- "$dflt" "$tmp/help" || fail "tp-bench-gemm --help does not give the default '$dflt'"
done
"$ops" --help >"$tmp/help" 2>&1 || fail "tp-bench-ops --help exits $?"
grep -q -- "--cuda" "$tmp/help" || fail "tp-bench-ops --help does not list --cuda"
grep -q -- "--csv" "$tmp/help" || fail "tp-bench-ops --help does not list --csv"
"$layers" --help >"$tmp/help" 2>&1 || fail "tp-bench-layers --help exits $?"
grep -q -- "^ *--device " "$tmp/help" || fail "tp-bench-layers --help does not list --device"

# ---- bad command lines: 64 and the option named ---------------------------------
bad() { # expected-text program args...
    local want=$1 prog=$2
    shift 2
    "$prog" "$@" >"$tmp/out" 2>&1
    local rc=$?
    [ $rc -eq 64 ] || fail "$(basename "$prog") $* exits $rc, not 64"
    grep -qF -- "$want" "$tmp/out" || fail "$(basename "$prog") $*: the message does not name '$want': $(head -c 200 "$tmp/out")"
}
bad "-s '0'" "$gemm" -s 0
bad "-s '4096x'" "$gemm" -s 4096x
bad "-s '64x64'" "$gemm" -s 64x64
bad "-s '1x2x3x4'" "$gemm" -s 1x2x3x4
bad "-s '64,'" "$gemm" -s 64,
bad "-s 'foo'" "$gemm" -s foo
bad "--dtype 'f64'" "$gemm" --dtype f64
bad "--dtype ''" "$gemm" --dtype ""
bad "-R '0'" "$gemm" -R 0
bad "-R '101'" "$gemm" -R 101
bad "--ms '0'" "$gemm" --ms 0
bad "-d '-1'" "$gemm" -d -1
bad "--frobnicate" "$gemm" --frobnicate
bad "--csv" "$gemm" --csv
bad "--frobnicate" "$ops" --frobnicate
bad "--csv" "$ops" --csv
bad "--cuda takes no -g" "$ops" --cuda -g 2
bad "--device 'gpu'" "$layers" --device gpu
bad "--device cuda goes with --backend shm" "$layers" --device cuda --backend mpi
bad "--device cuda goes with --backend shm" "$layers" --device cuda --mlp-check
bad "(--dtype f32)" "$layers" -l mlp-gemm --dtype bf16

# ---- no device: a clear message and exit 2; a device: tiny runs ---------------------
"$gemm" -s 64,32x48x16 --dtype bf16,f32 -R 2 --ms 1 --csv "$tmp/g.csv" >"$tmp/g" 2>&1
rc=$?
if [ $rc -eq 2 ] && grep -q "no CUDA device" "$tmp/g"; then
    [ -e "$tmp/g.csv" ] && fail "tp-bench-gemm wrote a CSV without a device"
    "$ops" --cuda --csv "$tmp/o.csv" >"$tmp/o" 2>&1
    rc=$?
    [ $rc -eq 2 ] || fail "tp-bench-ops --cuda without a device exits $rc, not 2"
    grep -q "no CUDA device" "$tmp/o" || fail "tp-bench-ops --cuda: no 'no CUDA device': $(head -c 200 "$tmp/o")"
    "$layers" --device cuda -l mlp,mlp-gemm -t 16 -H 8 -g 1 -n 1 -R 1 >"$tmp/l" 2>&1
    rc=$?
    [ $rc -eq 2 ] || fail "tp-bench-layers --device cuda without a device exits $rc, not 2"
    grep -q "no CUDA device" "$tmp/l" || fail "tp-bench-layers --device cuda: no 'no CUDA device': $(head -c 200 "$tmp/l")"
    echo "no CUDA device: checked the command line and the skip path only"
else
    [ $rc -le 1 ] || fail "tp-bench-gemm tiny run exits $rc: $(tail -n 3 "$tmp/g")"
    awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) ix[$i] = i; next }
             { rows++; if (!($ix["ratio_min"] <= $ix["ratio"] && $ix["ratio"] <= $ix["ratio_max"])) bad++
               if ($ix["tflops"] <= 0) bad++ }
             END { exit !(rows == 4 && !bad) }' "$tmp/g.csv" ||
        fail "tp-bench-gemm CSV: want 4 rows with ratio inside its range: $(cat "$tmp/g.csv")"
    "$ops" --cuda --csv "$tmp/o.csv" >"$tmp/o" 2>&1
    rc=$?
    [ $rc -le 1 ] || fail "tp-bench-ops --cuda exits $rc: $(tail -n 3 "$tmp/o")"
    [ "$(wc -l <"$tmp/o.csv")" -eq 5 ] || fail "tp-bench-ops --cuda CSV: want a header and 4 rows"
    "$layers" --device cuda -l mlp,mlp-gemm -p fwd+bwd -t 64 -H 32 -g 1,2 -n 1 -w 1 -R 1 --dtype bf16 \
        --csv "$tmp/l.csv" >"$tmp/l" 2>&1
    rc=$?
    [ $rc -le 1 ] || fail "tp-bench-layers --device cuda exits $rc: $(tail -n 3 "$tmp/l")"
    [ "$(grep -c '^# mlp vs mlp-gemm' "$tmp/l")" -eq 2 ] || fail "tp-bench-layers --device cuda: want 2 mlp vs mlp-gemm lines"
fi

[ $fails -eq 0 ] && echo "bench_gpu_perf_cli: all checks passed"
exit $((fails > 0))
