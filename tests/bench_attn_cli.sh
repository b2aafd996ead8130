#!/usr/bin/env bash
# tp-bench-attn's command line and report: --help lists the options; bad
# command lines exit 64 naming the option; a tiny CPU run prints both
# backends' rows, the flash / math ratios and a CSV with one row per backend
# and pass, the fused form keeping less memory; --cuda says "no CUDA device"
# and exits 2 where there is none (with one, a tiny bf16 run).
#   tests/bench_attn_cli.sh BUILD/bench/tp-bench-attn
set -uo pipefail
attn=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

"$attn" --help >"$tmp/help" 2>&1 || fail "--help exits $?"
for opt in --cuda -t -b -H -K -s -D --no-causal --backend --fwd-only -r --csv; do
    grep -q -- "$opt" "$tmp/help" || fail "--help does not list $opt"
done

bad() { # expected-text args...
    local want=$1
    shift
    "$attn" "$@" >"$tmp/out" 2>&1
    local rc=$?
    [ $rc -eq 64 ] || fail "$* exits $rc, not 64"
    grep -qF -- "$want" "$tmp/out" || fail "$*: the message does not name '$want': $(head -c 200 "$tmp/out")"
}
bad "-s takes a positive integer, not '0'" -s 0
bad "-D takes a positive integer, not 'x'" -D x
bad "-t takes f32, bf16 or f16, not 'f64'" -t f64
bad "--backend takes math, flash or both, not 'fast'" --backend fast
bad "-H 6 heads are not a multiple of -K 4 kv heads" -H 6 -K 4
bad "unknown option --bogus" --bogus
bad "-r 65: at most 64 repeats" -r 65

"$attn" -s 96 -H 4 -K 2 -D 16 -r 2 --csv "$tmp/a.csv" >"$tmp/out" 2>&1 || fail "a tiny run exits $?: $(cat "$tmp/out")"
for w in "math   fwd " "math   fwd+bwd" "flash  fwd " "flash  fwd+bwd" "flash / math time, fwd:" \
    "flash / math time, fwd+bwd:"; do
    grep -qF -- "$w" "$tmp/out" || fail "the report lacks '$w'"
done
[ "$(wc -l <"$tmp/a.csv")" -eq 5 ] || fail "the CSV has $(wc -l <"$tmp/a.csv") lines, not a header and 4 rows"
# the memory column of the fwd+bwd rows: flash keeps less than math
awk -F, 'NR > 1 && $10 == "fwd+bwd" { m[$9] = $16 } END { exit !(m["flash"] < m["math"]) }' \
    "$tmp/a.csv" || fail "flash's memory is not below math's: $(cat "$tmp/a.csv")"

"$attn" -s 64 -H 2 -K 2 -D 8 -r 1 --backend flash --fwd-only >"$tmp/out" 2>&1 || fail "--backend flash --fwd-only exits $?"
grep -q "^math" "$tmp/out" && fail "--backend flash ran math"
grep -q "fwd+bwd" "$tmp/out" && fail "--fwd-only ran a backward"

"$attn" --cuda -s 128 -H 4 -K 2 -D 64 -r 1 >"$tmp/out" 2>&1
rc=$?
if grep -q "no CUDA device" "$tmp/out"; then
    [ $rc -eq 2 ] || fail "--cuda without a device exits $rc, not 2"
else
    [ $rc -eq 0 ] || fail "--cuda tiny run exits $rc: $(cat "$tmp/out")"
fi

[ $fails -eq 0 ] && echo "bench_attn_cli: OK"
exit $((fails > 0))
