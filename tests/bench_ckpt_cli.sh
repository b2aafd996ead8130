#!/usr/bin/env bash
# The contract of tp-bench-ckpt on its small model (a few seconds): a bad
# command line exits 2 with the usage; a run prints one row per rank count
# (1, 2, 4), each ratio as "median% [min-max]" over the repetitions, a
# default (in-place) load peak of 0.00 model above the model and a
# copy_first peak of at least 1.00, and the disk loop's figures.
#   tests/bench_ckpt_cli.sh BUILD/bench/tp-bench-ckpt
set -uo pipefail
bench=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

for args in "-m foo" "-r 0" "-r 17" "--bogus" "-d"; do
    # shellcheck disable=SC2086
    "$bench" $args >"$tmp/out" 2>&1
    rc=$?
    [ $rc -eq 2 ] || fail "'$args' exits $rc, not 2"
    grep -q "usage:" "$tmp/out" || fail "'$args' prints no usage"
done
"$bench" -m foo >"$tmp/out" 2>&1
grep -q "unknown model 'foo'" "$tmp/out" || fail "-m foo: the message does not name the model"

"$bench" -d "$tmp" -m transformer -r 2 >"$tmp/out" 2>&1 || fail "a run exits $?: $(cat "$tmp/out")"
awk '
    $1 ~ /^[124]$/ {
        rows++
        # W, save, ratio, [lo-hi], load, ratio, [lo-hi], cold, ratio, [lo-hi], peak, copy-first, peak
        n = split($0, f, /[ \t]+/)
        line = $0
        if (gsub(/%/, "%", line) != 3) { print "FAIL: row " $1 " has not three ratios: " $0; bad++ }
        if (gsub(/\[ *[0-9]+- *[0-9]+\]/, "", line) != 3) { print "FAIL: row " $1 " has not three [min-max]: " $0; bad++ }
        if ($(NF - 2) != "0.00") { print "FAIL: row " $1 ": in-place peak " $(NF - 2) ", not 0.00"; bad++ }
        if ($NF + 0 < 1.0) { print "FAIL: row " $1 ": copy-first peak " $NF " below 1.00"; bad++ }
    }
    END {
        if (rows != 3) { print "FAIL: " rows + 0 " rows, want 3 (W = 1, 2, 4)"; bad++ }
        exit bad > 0
    }' "$tmp/out" || fails=$((fails + 1))
grep -q "^disk (same size" "$tmp/out" || fail "no disk line"
[ -z "$(ls -A "$tmp" | grep -v '^out$')" ] || fail "files left in the directory: $(ls "$tmp")"

if [ $fails -ne 0 ]; then
    cat "$tmp/out"
    exit 1
fi
echo "tp-bench-ckpt CLI: ok"
