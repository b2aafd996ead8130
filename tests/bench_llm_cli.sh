#!/usr/bin/env bash
# The contract of tp-bench-llm on its tiny model (a few seconds): a bad
# command line exits 2 with the usage; a run at tp 1, 2, 4 (one timed pass)
# prints a row per tp and pass with a positive time, writes the CSV, and
# skips a tp that does not divide the heads; --dump-config writes a
# config.json tp-bench-llm reads back; --save writes a sharded checkpoint,
# --model runs on its weights, and --load times it and prints the disk and
# memory tables.
#   tests/bench_llm_cli.sh BUILD/bench/tp-bench-llm
set -uo pipefail
bench=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

for args in "--config nope" "-r 0" "--tp 0" "--tp x" "-p bwd" "--bogus" "-b" \
            "--threads 0" "--backend tcp" "--save $tmp/a --load $tmp/b" "--load $tmp/none"; do
    # shellcheck disable=SC2086
    "$bench" $args >"$tmp/out" 2>&1
    rc=$?
    [ $rc -eq 2 ] || fail "'$args' exits $rc, not 2: $(head -c 300 "$tmp/out")"
done
"$bench" --bogus >"$tmp/out" 2>&1
grep -q "usage:" "$tmp/out" || fail "--bogus prints no usage"
grep -q -- "--bogus" "$tmp/out" || fail "--bogus: the message does not name it"
"$bench" --help >"$tmp/out" 2>&1 || fail "--help exits $?"
grep -q "usage:" "$tmp/out" || fail "--help prints no usage"

# the tiny model at tp 1, 2, 3, 4: 3 does not divide its 4 heads
"$bench" --config tiny -b 2 -s 16 --tp 1,2,3,4 -r 1 -w 0 --csv "$tmp/r.csv" >"$tmp/out" 2>&1 ||
    fail "a tiny run exits $?: $(cat "$tmp/out")"
grep -q "^# tp 3 skipped" "$tmp/out" || fail "tp 3 not reported as skipped"
awk '
    $1 ~ /^[124]$/ && ($3 == "fwd" || $3 == "fwd+bwd") {
        rows++
        if (!($4 > 0)) { print "FAIL: row tp " $1 " " $3 ": time " $4; bad++ }
    }
    END {
        if (rows != 6) { print "FAIL: " rows + 0 " rows, want 6 (tp 1, 2, 4 x fwd, fwd+bwd)"; bad++ }
        exit bad > 0
    }' "$tmp/out" || fails=$((fails + 1))
[ "$(wc -l <"$tmp/r.csv")" -eq 7 ] || fail "the CSV has $(wc -l <"$tmp/r.csv") lines, want 7"
head -n 1 "$tmp/r.csv" | grep -q "^impl,model,params,batch,seq,tp,threads,pass,time_ms," ||
    fail "CSV header: $(head -n 1 "$tmp/r.csv")"
grep -q "^libtp,tiny,.*,2,16,4,1,fwd+bwd," "$tmp/r.csv" || fail "no tp 4 fwd+bwd row in the CSV"

# the config round trip, then a model built from the file
"$bench" --dump-config "$tmp/cfg.json" --config tiny || fail "--dump-config exits $?"
grep -q '"hidden_size": *64' "$tmp/cfg.json" || fail "the dumped config: $(head -c 300 "$tmp/cfg.json")"
"$bench" --config "$tmp/cfg.json" -b 1 -s 8 --tp 2 -p fwd -r 1 -w 0 >"$tmp/out" 2>&1 ||
    fail "a run from the dumped config exits $?: $(cat "$tmp/out")"

# --save in shards, then --load without dropping the machine's caches
"$bench" --save "$tmp/ckpt" --config tiny --max-shard-bytes 100000 >"$tmp/out" 2>&1 ||
    fail "--save exits $?: $(cat "$tmp/out")"
[ "$(ls "$tmp/ckpt"/*.safetensors 2>/dev/null | wc -l)" -gt 1 ] || fail "--save wrote no shards: $(ls "$tmp/ckpt")"
[ -f "$tmp/ckpt/model.safetensors.index.json" ] || fail "--save wrote no index"
# the checkpoint's weights under --model, at tp 1 and 2
"$bench" --model "$tmp/ckpt" -b 1 -s 8 --tp 1,2 -p fwd+bwd -r 1 -w 0 >"$tmp/out" 2>&1 ||
    fail "--model exits $?: $(cat "$tmp/out")"
[ "$(grep -c '^  [12] .* fwd+bwd ' "$tmp/out")" -eq 2 ] || fail "--model: not two fwd+bwd rows: $(cat "$tmp/out")"
"$bench" --load "$tmp/ckpt" --tp 2 -r 1 --no-drop >"$tmp/out" 2>&1 || fail "--load exits $?: $(cat "$tmp/out")"
grep -q "^  cold " "$tmp/out" || fail "--load: no cold row: $(cat "$tmp/out")"
grep -q "^  warm " "$tmp/out" || fail "--load: no warm row"
awk '$1 == "all" { n++; if (!($4 > 0) || !($6 >= 1)) { print "FAIL: memory row: " $0; bad++ } }
     END { if (n != 1) { print "FAIL: " n + 0 " memory rows, want 1"; bad++ } exit bad > 0 }' "$tmp/out" ||
    fails=$((fails + 1))

if [ $fails -ne 0 ]; then
    cat "$tmp/out"
    exit 1
fi
echo "tp-bench-llm CLI: ok"
