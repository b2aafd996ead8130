#!/usr/bin/env bash
# The contract of tp-bench-memory and of tp-bench-layers -l mlp-gemm, on tiny
# shapes (a few seconds): bad command lines exit 64 naming the option; the
# memory CSV's counted bytes are exactly what the sharding implies: the MLP
# (H -> 4H -> H, biases) holds 4 (2 H 4H / W + 4H / W + H) bytes of
# parameters on rank 0 (the rowwise bias is replicated) and as many of
# gradients, the block's attention and MLP weights are 1/W; the measured
# peak per rank falls with W; mlp-gemm prints a row per rank count.
#   tests/bench_memory_cli.sh BUILD/bench/tp-bench-memory BUILD/bench/tp-bench-layers
set -uo pipefail
bench=$1 layers=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

"$bench" --help >"$tmp/help" 2>&1 || fail "--help exits $?"
for opt in -m -g -t -H --heads --head-dim -s --csv; do
    grep -q -- "^ *$opt " "$tmp/help" || fail "--help does not list $opt"
done
for args in "-m foo" "-g 0" "-g x" "-t 0" "-s" "--bogus"; do
    # shellcheck disable=SC2086
    "$bench" $args >"$tmp/out" 2>&1
    rc=$?
    [ $rc -eq 64 ] || fail "$args exits $rc, not 64"
    grep -qF -- "${args%% *}" "$tmp/out" || fail "$args: the message does not name the option"
done

H=64 T=16
"$bench" -t $T -H $H --heads 4 --head-dim 16 -g 1,2,4 --csv "$tmp/m.csv" >"$tmp/out" 2>&1 ||
    fail "tp-bench-memory exits $?: $(cat "$tmp/out")"
awk -F, -v H=$H '
    NR == 1 { for (i = 1; i <= NF; i++) c[$i] = i; next }
    {
        m = $c["model"]; W = $c["ranks"]; p = $c["params_bytes"]; g = $c["grads_bytes"]
        peak[m, W] = $c["peak_bytes_per_rank"]; rows++
        if (m == "mlp") want = 4 * (2 * H * 4 * H / W + 4 * H / W + H)
        else            want = 4 * (2 * 2 * H + (3 * H * H + H * H + 2 * H * 4 * H + 4 * H) / W + H) # norms, w[qkv] wo (heads x dim = H), w1 w2 + b1 sharded, b2
        if (p != want) { print "FAIL: " m " W=" W ": params " p " bytes, want " want; bad++ }
        if (g != p) { print "FAIL: " m " W=" W ": grads " g " bytes, params " p; bad++ }
    }
    END {
        if (rows != 6) { print "FAIL: " rows " rows, want 6"; bad++ }
        split("mlp block", ms, " ")
        for (k = 1; k <= 2; k++)
            if (!(peak[ms[k], 1] > peak[ms[k], 2] && peak[ms[k], 2] > peak[ms[k], 4])) {
                print "FAIL: " ms[k] ": peak per rank does not fall with W: " peak[ms[k], 1] " " peak[ms[k], 2] " " peak[ms[k], 4]; bad++
            }
        exit bad > 0
    }' "$tmp/m.csv" || fails=$((fails + 1))

"$layers" -l mlp-gemm -p fwd,fwd+bwd -t 8 -H 16 -g 1,2 -R 1 -n 1 -w 0 --csv "$tmp/g.csv" >"$tmp/out" 2>&1 ||
    fail "tp-bench-layers -l mlp-gemm exits $?: $(cat "$tmp/out")"
[ "$(grep -c '^mlp-gemm,' "$tmp/g.csv")" = 4 ] || fail "mlp-gemm: not 4 CSV rows: $(cat "$tmp/g.csv")"
"$layers" -l mlp-gemm --backend nccl >"$tmp/out" 2>&1
[ $? -eq 64 ] || fail "mlp-gemm with --backend nccl is not refused with 64"

[ $fails -eq 0 ] && echo "bench_memory_cli: all checks passed"
exit $((fails > 0))
