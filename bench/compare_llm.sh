#!/usr/bin/env bash
# compare_llm.sh - a Llama model in libtp against the same model in Hugging
# Face transformers (eager attention, PyTorch), side by side in one run.
#
# The model of -c (default 100m: hidden 768, 12 layers, 12 heads, 4 kv heads,
# intermediate 2048, vocab 32000), f32 on the CPU, -B sequences of -S tokens,
# the forward (logits, no grad) and the forward + backward of the causal-LM
# loss:
#   libtp         build/bench/tp-bench-llm --tp N: tp 1 with -T OpenBLAS
#                 threads, tp 2 and 4 (ranks as threads, the standard plan)
#                 with one BLAS thread per rank
#   transformers  bench/torch_llm.py: LlamaForCausalLM from the same
#                 config.json (tp-bench-llm --dump-config), eager,
#                 torch.set_num_threads(-T)
# run alternately: libtp tp 1, transformers, libtp tp 2, libtp tp 4 (-t),
# repeated -r times; each run keeps the median of -n passes after -w untimed
# ones. The Markdown tables give each side's median over the repetitions
# with the min-max, libtp tp 1 / transformers (below 1: libtp faster) as the
# median [min-max] of the ratios inside each repetition, and the speedups of
# tp 2 and tp 4 over tp 1, likewise; and the ratio of the CPU time the two
# processes spent over a pass (all their threads: on a loaded machine the
# wall times grow with the other processes' share of the cores, the CPU times
# much less). The machine's cores are counted: ranks
# beyond them share cores (oversubscribed), and the table says so. A second
# table lists every run's wall and CPU time and their ratio (the cores it
# had).
#
# usage: bench/compare_llm.sh [-b BUILD] [-c CONFIG] [-B BATCH] [-S SEQ]
#                             [-T THREADS] [-t TPS] [-r REPS] [-n ITERS]
#                             [-w WARMUP] [-o OUT] [-R CSV]
#   -b BUILD    build directory with bench/tp-bench-llm (default build)
#   -c CONFIG   100m, 1b, tiny or a config.json (default 100m)
#   -B BATCH, -S SEQ   sequences and tokens each (default 8 x 512;
#               quick: -B 1 -S 128)
#   -T THREADS  threads of libtp tp 1 and of transformers (default 1)
#   -t TPS      libtp's degrees besides 1 (default "2 4"; "" for none)
#   -r REPS     repetitions of the runs (default 3)
#   -n ITERS    timed passes per run (default 1); -w WARMUP untimed (default 1)
#   -o OUT      output stem (default bench/results/compare_llm-<date>): OUT.md
#               the table, OUT.csv one row per run and pass, OUT/ the raw files
#   -R CSV      run nothing: the tables of an earlier run's OUT.csv
#   -h, --help  this text
# environment: TORCH_PYTHON  a python with torch and transformers (default:
#              /root/hfenv/bin/python if present, else python3). Without them
#              the script says so and exits 0.
# Exit status: 0 done (or skipped: no torch); 1 a run failed; 64 bad usage.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
build=build config=100m batch=8 seq=512 threads=1 tps="2 4" reps=3 iters=1 warmup=1 out="" rerender=""
# shellcheck source=bench/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
bench_name=compare_llm
bench_usage="bench/compare_llm.sh [-b BUILD] [-c CONFIG] [-B BATCH] [-S SEQ] [-T THREADS] [-t TPS] [-r REPS] [-n ITERS] [-w WARMUP] [-o OUT] [-R CSV]"
while getopts ":b:c:B:S:T:t:r:n:w:o:R:h-:" opt; do
    case $opt in
    b) build=$OPTARG ;;
    c) config=$OPTARG ;;
    B) batch=$OPTARG ;;
    S) seq=$OPTARG ;;
    T) threads=$OPTARG ;;
    t) tps=$OPTARG ;;
    r) reps=$OPTARG ;;
    n) iters=$OPTARG ;;
    w) warmup=$OPTARG ;;
    o) out=$OPTARG ;;
    R) rerender=$OPTARG ;;
    *) bench_getopt "$opt" ;;
    esac
done
shift $((OPTIND - 1))
[ $# -eq 0 ] || bench_bad "unexpected argument '$1'"
for v in "$batch" "$seq" "$threads" "$reps" "$iters"; do [[ $v =~ ^[1-9][0-9]*$ ]] || bench_bad "'$v' is not a positive integer"; done
[[ $warmup =~ ^[0-9]+$ ]] || bench_bad "-w '$warmup' is not an integer >= 0"
for t in $tps; do [[ $t =~ ^[2-9]$|^[1-9][0-9]+$ ]] || bench_bad "-t: '$t' is not a degree >= 2"; done
[ "$seq" -ge 2 ] || bench_bad "-S must be at least 2 (the loss predicts the next token)"
case $build in /*) ;; *) build=$repo/$build ;; esac

# The Markdown tables of a CSV this script wrote (its repetitions, degrees
# and threads read from it): the summary, then every run's wall and CPU time.
render() {
    awk -F, -v cores="$(nproc)" '
        function sortv(a, n,    i, j, x) { for (i = 2; i <= n; i++) { x = a[i]; for (j = i - 1; j >= 1 && a[j] > x; j--) a[j + 1] = a[j]; a[j + 1] = x } }
        function stats(list, fmt,    v, n, j) {
            n = split(list, v, " ")
            if (!n) return "-"
            for (j = 1; j <= n; j++) v[j] += 0
            sortv(v, n)
            return sprintf(fmt " [" fmt "-" fmt "]", n % 2 ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2, v[1], v[n])
        }
        NR == 1 { for (i = 1; i <= NF; i++) c[$i] = i; next }
        {
            who = $(c["impl"]) == "torch" ? "torch" : "tp" $(c["tp"])
            r = $(c["rep"]) + 0
            reps = r > reps ? r : reps
            t[who, $(c["pass"]), r] = $(c["time_ms"]) / 1000
            t["cpu:" who, $(c["pass"]), r] = $(c["cpu_ms"]) / 1000
            th[who] = $(c["threads"])
            if (who != "torch" && who != "tp1" && !(who in seen)) { seen[who] = 1; tps[++n] = $(c["tp"]) + 0 }
            runs[++nrun] = r SUBSEP who SUBSEP $(c["pass"])
        }
        function times(who, pass,    k, v) {
            v = ""
            for (k = 1; k <= reps; k++) if ((who, pass, k) in t) v = v " " t[who, pass, k]
            return stats(v, "%.4g")
        }
        function ratio(a, b, pass,    k, v) {
            v = ""
            for (k = 1; k <= reps; k++)
                if ((a, pass, k) in t && (b, pass, k) in t && t[b, pass, k] > 0) v = v " " t[a, pass, k] / t[b, pass, k]
            return stats(v, "%.2f")
        }
        END {
            line = sprintf("| pass | libtp tp 1, %d thread%s (s) | transformers, %d thread%s (s) | libtp / transformers | CPU time: libtp / transformers |",
                           th["tp1"], th["tp1"] == 1 ? "" : "s", th["torch"], th["torch"] == 1 ? "" : "s")
            sep = "| --- | --- | --- | --- | --- |"
            for (i = 1; i <= n; i++) {
                line = line sprintf(" libtp tp %d (s) | speedup tp %d / tp 1 |", tps[i], tps[i])
                sep = sep " --- | --- |"
            }
            print line; print sep
            for (p = 1; p <= 2; p++) {
                pass = p == 1 ? "fwd" : "fwd+bwd"
                row = sprintf("| %s | %s | %s | %sx | %sx |", pass, times("tp1", pass), times("torch", pass),
                              ratio("tp1", "torch", pass), ratio("cpu:tp1", "cpu:torch", pass))
                for (i = 1; i <= n; i++)
                    row = row sprintf(" %s | %sx |", times("tp" tps[i], pass), ratio("tp1", "tp" tps[i], pass))
                print row
            }
            print ""
            for (i = 1; i <= n; i++)
                if (tps[i] > cores)
                    printf "tp %d: %d rank threads on %d cores: oversubscribed, the ranks take turns on the cores.\n", tps[i], tps[i], cores
            if (th["tp1"] > cores || th["torch"] > cores)
                printf "%d threads on %d cores: oversubscribed.\n", (th["tp1"] > th["torch"]) ? th["tp1"] : th["torch"], cores
            print ""
            print "Every run: wall and CPU time of its pass (s), and CPU / wall: the cores it had on average"
            print "(a run of N threads that shows less than N shared the cores with other processes)."
            print ""
            print "| rep | run | threads | pass | wall (s) | CPU (s) | CPU / wall |"
            print "| --- | --- | --- | --- | --- | --- | --- |"
            for (k = 1; k <= nrun; k++) {
                split(runs[k], f, SUBSEP)
                w = t[f[2], f[3], f[1]]; cpu = t["cpu:" f[2], f[3], f[1]]
                name = (f[2] == "torch") ? "transformers" : ("libtp tp " substr(f[2], 3))
                nth = (f[2] == "torch" || f[2] == "tp1") ? th[f[2]] : (substr(f[2], 3) " x 1")
                printf "| %d | %s | %s | %s | %.2f | %.2f | %.2f |\n", f[1], name, nth, f[3], w, cpu, (w > 0) ? cpu / w : 0
            }
        }' "$1"
}

if [ -n "$rerender" ]; then
    [ -f "$rerender" ] || bench_bad "-R: no file '$rerender'"
    render "$rerender"
    exit 0
fi

bench_transformers
bench_llm_bin "$build"

stamp=$(date +%Y%m%d-%H%M%S)
[ -n "$out" ] || out=$repo/bench/results/compare_llm-$stamp
raw=$out
mkdir -p "$raw"
csv=$out.csv md=$out.md
cores=$(nproc)
"$bench" --dump-config "$raw/config.json" --config "$config"
load_before=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?")
start=$(date +%s)
status=0
echo "# compare_llm: $config, $batch x $seq tokens, $reps repetitions; load before $load_before" >&2

header="impl,model,params,batch,seq,tp,threads,pass,time_ms,time_min_ms,time_max_ms,reps,warmup,tokens_per_s,peak_mib,loss,backend,cores,cpu_ms"
echo "rep,$header" >"$csv"
# the rows of one run's CSV into ours, prefixed with the repetition
collect() {
    local f=$1 rep=$2
    [ -s "$f" ] && [ "$(wc -l <"$f")" -ge 3 ] || return 1
    tail -n +2 "$f" | sed "s/^/$rep,/" >>"$csv"
}
for rep in $(seq 1 "$reps"); do
    for who in 1 torch $tps; do
        if [ "$who" = torch ]; then
            f=$raw/torch-$rep
            if "$py" "$here/torch_llm.py" --config "$raw/config.json" --name "$config" -b "$batch" -s "$seq" \
                    --threads "$threads" -r "$iters" -w "$warmup" --csv "$f.csv" >"$f.log" 2>&1 &&
                    collect "$f.csv" "$rep"; then :; else
                echo "# transformers rep $rep failed, see $f.log" >&2
                status=1
            fi
        else
            f=$raw/libtp-tp$who-$rep
            th=1
            [ "$who" != 1 ] || th=$threads
            if "$bench" --config "$raw/config.json" -b "$batch" -s "$seq" --tp "$who" --threads "$th" \
                    -r "$iters" -w "$warmup" --csv "$f.csv" >"$f.log" 2>&1 && collect "$f.csv" "$rep"; then
                sed -i "s/^\([0-9]*\),libtp,[^,]*,/\1,libtp,$config,/" "$csv"
            else
                echo "# libtp tp $who rep $rep failed, see $f.log" >&2
                status=1
            fi
        fi
    done
    echo "# repetition $rep done ($(($(date +%s) - start)) s)" >&2
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?")

rev=$(git -C "$repo" describe --always --dirty 2>/dev/null || echo "?")
cpu=$(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2 | sed 's/^ //')
{
    echo "Llama $config, batch $batch x seq $seq, f32, CPU ($(date -u +%Y-%m-%d)); $cpu, $cores cores;"
    echo "libtp $rev (shm ranks as threads, OpenBLAS); $versions (eager attention)."
    echo "Each run: the median of $iters timed pass(es) after $warmup untimed; cells: median over $reps"
    echo "repetitions [min-max]; ratios and speedups taken inside each repetition. libtp tp 1 and"
    echo "transformers: $threads thread(s); libtp tp N: N ranks, one BLAS thread each."
    echo "Load average (1, 5, 15 min) before: $load_before, after: $load_after; $(($(date +%s) - start)) s."
    echo
    render "$csv"
    echo
    echo "csv: $csv; raw runs: $raw/"
} | tee "$md"
exit $status
