#!/usr/bin/env bash
# The contract of tp-bench-layers and plot_layers.sh, on tiny shapes (a few
# seconds): --help names every option with its default, bad values exit 64
# naming the option, a sweep writes the repeated rows (median within min-max,
# the 1-rank speedup 1) and the load lines, --mlp-check prints PASS/FAIL per
# target and exits 0 or 1, -l mlp-fused (the block with its GELU fused into
# the colwise Linear) prints its rows and, run with mlp, one fused/unfused
# ratio line per point, and plot_layers.sh reads the CSV by column name
# and draws one line per (layer, pass, tokens, hidden) in rank order; with
# FAIL_FIRST (tests/bench_fail_first.c built as a shared library) preloaded,
# a failed warm-up run of the 1-rank baseline is named and exits 2.
#   tests/bench_layers_cli.sh BUILD/bench/tp-bench-layers SRC/bench/plot_layers.sh [FAIL_FIRST]
set -uo pipefail
bench=$1 plot=$2 fail_first=${3:+$(realpath "$3")}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

# ---- --help -----------------------------------------------------------------
"$bench" --help >"$tmp/help" 2>&1 || fail "--help exits $?"
for opt in -l -p -t -H -V -g -n -w -R --dtype --backend --bootstrap --csv -v --verbose --mlp-check -h --help; do
    grep -q -- "^ *$opt[ ,]" "$tmp/help" || grep -q -- ", $opt " "$tmp/help" || fail "--help does not list $opt"
done
for dflt in "512,2048" "256,512,1024" "1,2 (mpi: 1,N)" "8192" "Linear layers 2" "embeddings 8" "fwd,fwd+bwd"; do
    grep -qF -- "$dflt" "$tmp/help" || fail "--help does not give the default '$dflt'"
done
grep -qE -- '-R N .* 3$' "$tmp/help" || fail "--help does not give -R's default 3"
grep -q -- 'mlp-fused' "$tmp/help" || fail "--help does not name the layer mlp-fused"

# ---- bad command lines: 64 and the option named ------------------------------
bad() { # expected-text args...
    local want=$1
    shift
    "$bench" "$@" >"$tmp/out" 2>&1
    local rc=$?
    [ $rc -eq 64 ] || fail "$* exits $rc, not 64"
    grep -qF -- "$want" "$tmp/out" || fail "$*: the message does not name '$want': $(head -c 200 "$tmp/out")"
}
bad "-R '0'" -R 0
bad "-R '101'" -R 101
bad "-l 'foo'" -l foo
bad "-p 'back'" -p back
bad "-g '0'" -g 0
bad "-n 'x'" -n x
bad "-w '-1'" -w -1
bad "--frobnicate" --frobnicate
bad "--csv" --csv
bad "--dtype 'f64'" --dtype f64
bad "(--dtype f32)" -l mlp-gemm --dtype bf16
bad "(--dtype f32)" --mlp-check --dtype f16
bad "mlp-fused" -l mlp-fuse

# ---- a tiny sweep -------------------------------------------------------------
"$bench" -l colwise,emb-row -t 16 -H 8 -V 64 -g 1,2 -n 2 -w 1 -R 2 --csv "$tmp/l.csv" >"$tmp/sweep" 2>&1 ||
    fail "tiny sweep exits $?: $(tail -n 3 "$tmp/sweep")"
grep -q '^# load average before' "$tmp/sweep" || fail "no load average before the sweep"
grep -q '^# load average after' "$tmp/sweep" || fail "no load average after the sweep"
awk -F, '
    NR == 1 { for (i = 1; i <= NF; i++) ix[$i] = i
              split("layer pass tokens hidden ranks time_ms time_min_ms time_max_ms speedup speedup_min speedup_max runs iters warmup backend machine faults_per_pass other_cores load_before", need, " ")
              for (k in need) if (!(need[k] in ix)) { print "FAIL: the CSV has no column " need[k]; bad++ }
              next }
    {
        rows++
        if ($ix["runs"] != 2) { print "FAIL: runs " $ix["runs"] " in row " NR; bad++ }
        if ($ix["iters"] != 2) { print "FAIL: iters " $ix["iters"] " in row " NR; bad++ }
        if (!($ix["time_min_ms"] <= $ix["time_ms"] && $ix["time_ms"] <= $ix["time_max_ms"])) { print "FAIL: time outside its range in row " NR; bad++ }
        if ($ix["ranks"] == 1 && $ix["speedup"] != "1.000") { print "FAIL: 1-rank speedup " $ix["speedup"]; bad++ }
        if ($ix["ranks"] == 2 && !($ix["speedup_min"] <= $ix["speedup"] && $ix["speedup"] <= $ix["speedup_max"])) { print "FAIL: speedup outside its range in row " NR; bad++ }
        if ($ix["warmup"] != 1) { print "FAIL: warmup " $ix["warmup"] " in row " NR; bad++ }
    }
    END { if (rows != 8) { print "FAIL: " rows " rows, want 8 (2 layers x 2 passes x 2 rank counts)"; bad++ } exit bad > 0 }
' "$tmp/l.csv" || fails=$((fails + 1))
# the default warm-up: 2 passes for a Linear layer, 8 for an embedding
"$bench" -l colwise,emb-col -p fwd -t 16 -H 8 -V 64 -g 1 -n 1 -R 1 --csv "$tmp/w.csv" >/dev/null 2>&1 || fail "default warm-up sweep exits $?"
awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) ix[$i] = i; next } { w[$ix["layer"]] = $ix["warmup"] }
         END { exit !(w["colwise"] == 2 && w["emb-col"] == 8) }' "$tmp/w.csv" || fail "default warm-up is not 2 (Linear) / 8 (embedding)"

# --dtype: bf16 parameters and input, named in the header and the CSV
"$bench" -l colwise,mlp -p fwd+bwd -t 16 -H 8 -g 1,2 -n 1 -w 1 -R 1 --dtype bf16 --csv "$tmp/d.csv" >"$tmp/d" 2>&1 ||
    fail "the bf16 sweep exits $?"
grep -q '^# dtype bf16' "$tmp/d" || fail "the bf16 sweep's header does not name its dtype"
awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) ix[$i] = i; next } { rows++; bad += $ix["dtype"] != "bf16" }
         END { exit !(rows == 4 && bad == 0) }' "$tmp/d.csv" || fail "the bf16 sweep's CSV rows do not say bf16"

# ---- mlp-fused: the block with the GELU fused into net1, beside mlp ------------
"$bench" -l mlp,mlp-fused -t 16 -H 8 -g 1,2 -n 1 -w 1 -R 2 --csv "$tmp/fu.csv" >"$tmp/fu" 2>&1 ||
    fail "the mlp,mlp-fused sweep exits $?: $(tail -n 3 "$tmp/fu")"
n=$(grep -cE '^mlp-fused +(fwd|fwd\+bwd) +16 +8 +[12] ' "$tmp/fu")
[ "$n" = 4 ] || fail "the mlp-fused sweep prints $n mlp-fused rows, want 4 (2 passes x 2 rank counts): $(tail -n 5 "$tmp/fu")"
awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) ix[$i] = i; next } { r[$ix["layer"]]++ }
         END { exit !(r["mlp"] == 4 && r["mlp-fused"] == 4) }' "$tmp/fu.csv" ||
    fail "the mlp,mlp-fused CSV does not hold 4 rows of each: $(cut -d, -f1-5 "$tmp/fu.csv")"
# fused/unfused per point: the median within its min-max
awk '/^# mlp-fused vs mlp (fwd|fwd\+bwd) T=16 H=8 ranks [12]: .*fused\/unfused/ {
         n++; s = $0; sub(/.*fused\/unfused /, "", s); gsub(/[][]/, "", s); split(s, v, " ")
         if (!(v[1] > 0 && v[2] <= v[1] && v[1] <= v[4])) { print "FAIL: fused/unfused outside its range: " $0; bad++ } }
     END { if (n != 4) { print "FAIL: " n " fused/unfused lines, want 4"; bad++ } exit bad > 0 }' "$tmp/fu" ||
    fails=$((fails + 1))
# alone (no mlp row to compare with): its rows, no ratio line
"$bench" -l mlp-fused -p fwd+bwd -t 16 -H 8 -g 2 -n 1 -w 1 -R 1 >"$tmp/fa" 2>&1 ||
    fail "-l mlp-fused alone exits $?: $(tail -n 3 "$tmp/fa")"
grep -qE '^mlp-fused +fwd\+bwd +16 +8 +2 ' "$tmp/fa" || fail "-l mlp-fused alone prints no row: $(tail -n 3 "$tmp/fa")"
grep -q 'fused/unfused' "$tmp/fa" && fail "-l mlp-fused alone prints a fused/unfused line"

# ---- cores: the ones this process may run on, as nproc and tp-bench-comm count
if command -v taskset >/dev/null && [ "$(nproc)" -gt 1 ]; then
    cpu=$(taskset -pc $$ | sed 's/.*: *//; s/[,-].*//')
    taskset -c "$cpu" "$bench" -l colwise -p fwd -t 16 -H 8 -g 1 -n 1 -w 0 -R 1 --csv "$tmp/c.csv" >/dev/null 2>&1 ||
        fail "the sweep on one CPU exits $?"
    grep -q '(1 cores)$' "$tmp/c.csv" || fail "on one CPU (taskset -c $cpu) the machine column is not '(1 cores)': $(tail -n 1 "$tmp/c.csv")"
fi

# ---- a failed run: named, exit 2 ----------------------------------------------
# the first run of the sweep is the untimed warm-up of the 1-rank baseline; it
# fails, the 2-rank runs still succeed
if [ -n "$fail_first" ]; then
    # ASan wants its runtime first in the library list; the preload comes before it
    ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}verify_asan_link_order=0" LD_PRELOAD="$fail_first" \
        "$bench" -l colwise -p fwd -t 16 -H 8 -g 1,2 -n 1 -w 1 -R 1 --csv "$tmp/f.csv" >"$tmp/fail" 2>&1
    rc=$?
    grep -q 'bench_fail_first: tp_mesh_create fails once' "$tmp/fail" || fail "the failure was not injected: $(tail -n 3 "$tmp/fail")"
    [ $rc -eq 2 ] || fail "a failed warm-up run of the baseline exits $rc, not 2"
    grep -q 'colwise fwd T=16 H=8, warm-up run on 1 rank failed: TP_ERR_NO_MEMORY' "$tmp/fail" ||
        fail "the failed warm-up run is not named: $(tail -n 3 "$tmp/fail")"
    awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) ix[$i] = i; next } { r[$ix["ranks"]]++ }
             END { exit !(r[2] == 1 && !(1 in r)) }' "$tmp/f.csv" ||
        fail "after a failed baseline warm-up the CSV should hold the 2-rank row only: $(cat "$tmp/f.csv")"
fi

# ---- --mlp-check ----------------------------------------------------------------
"$bench" --mlp-check -t 16 -H 8 -R 1 -n 1 -w 0 >"$tmp/mlp" 2>&1
rc=$?
[ $rc -eq 0 ] || [ $rc -eq 1 ] || fail "--mlp-check exits $rc: $(tail -n 3 "$tmp/mlp")"
n=$(grep -cE '^(PASS|FAIL)  .*target' "$tmp/mlp")
[ "$n" = 2 ] || fail "--mlp-check prints $n PASS/FAIL lines, want 2"
nfail=$(grep -c '^FAIL' "$tmp/mlp")
{ [ $rc -eq 1 ] && [ "$nfail" -gt 0 ]; } || { [ $rc -eq 0 ] && [ "$nfail" = 0 ]; } ||
    fail "--mlp-check exit $rc does not match its $nfail FAIL lines"
grep -q '>= 1.80x' "$tmp/mlp" || fail "--mlp-check does not give the speedup threshold"
grep -q '<= 1.10' "$tmp/mlp" || fail "--mlp-check does not give the by-hand threshold"

# ---- plot_layers.sh: columns by name, one line per size, rank order -------------
"$plot" "$tmp/l.csv" "$(dirname "$plot")/../docs/img" >/dev/null 2>&1
[ $? -eq 64 ] || fail "plot_layers.sh writes into docs/img without --docs"
if command -v gnuplot >/dev/null; then
    # columns shuffled and renamed around the ones the script needs; rows out of rank order
    cat >"$tmp/p.csv" <<'CSV'
backend,speedup,ranks,layer,extra,pass,hidden,tokens,speedup_min,speedup_max,gflops
shm,3.5,4,colwise,x,fwd,8,16,3.0,3.9,40
shm,1.000,1,colwise,x,fwd,8,16,1,1,10
shm,1.9,2,colwise,x,fwd,8,16,1.8,2.0,19
shm,1.000,1,colwise,x,fwd,16,16,1,1,12
shm,1.5,2,colwise,x,fwd,16,16,1.4,1.6,18
CSV
    mkdir "$tmp/data"
    PLOT_DATA_DIR=$tmp/data "$plot" "$tmp/p.csv" "$tmp/png" >"$tmp/plot" 2>&1 || fail "plot_layers.sh exits $?: $(cat "$tmp/plot")"
    [ -s "$tmp/png/layers_speedup.png" ] || fail "no layers_speedup.png"
    [ -s "$tmp/png/layers_gflops.png" ] || fail "no layers_gflops.png"
    want_a=$'1 1.000 1 1 10 10 10 0\n2 1.9 1.8 2 9.5 9.5 9.5 0\n4 3.5 3 3.9 10 10 10 0'
    got_a=$(cat "$tmp/data/colwise__fwd__16__8.dat" 2>/dev/null)
    [ "$got_a" = "$want_a" ] || fail "T=16 H=8 line: got '$got_a', want '$want_a'"
    [ "$(cat "$tmp/data/colwise__fwd__16__16.dat" 2>/dev/null | wc -l)" = 2 ] || fail "T=16 H=16 is not a line of its own with 2 points"
else
    echo "gnuplot not installed: the plot checks skipped"
fi

[ $fails -eq 0 ] && echo "bench_layers_cli: all checks passed"
exit $((fails > 0))
