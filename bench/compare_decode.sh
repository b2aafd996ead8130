#!/usr/bin/env bash
# compare_decode.sh - decoding through a KV cache: libtp's tp_llm_generate
# against transformers' generate on the same model, side by side in one run.
#
# The model of -c (default 100m: hidden 768, 12 layers, 12 heads, 4 kv heads,
# intermediate 2048, vocab 32000), f32 on the CPU, -B prompts of -S
# pseudo-random tokens, -N new tokens each, greedy, no eos:
#   libtp         build/bench/tp-bench-llm -p decode: tp 1 with -T OpenBLAS
#                 threads, then each degree of -t (ranks as threads, the
#                 standard plan) with one BLAS thread per rank
#   transformers  bench/torch_llm.py --generate (-a: its attention,
#                 default sdpa, what from_pretrained gives;
#                 torch.set_num_threads(-T), generate(do_sample=False,
#                 min_new_tokens=N, max_new_tokens=N))
# run alternately (libtp tp 1, transformers, libtp tp t...), repeated -r
# times; each run keeps the median of -n generations after -w untimed ones.
# The Markdown table gives each side's decode tokens/s (batch x decode steps
# / their time), time to first token and median step as the median over the
# repetitions [min-max], libtp tp 1 / transformers as the median [min-max]
# of the ratios inside each repetition (above 1: libtp faster), the speedups
# of the tp degrees over tp 1 likewise, and libtp's host time per layer
# (a decode step on the meta device, no arithmetic) and its GEMMs by hand.
#
# usage: bench/compare_decode.sh [-b BUILD] [-c CONFIG] [-B BATCH] [-S PROMPT]
#                                [-N NEW] [-T THREADS] [-t TPS] [-r REPS]
#                                [-n ITERS] [-w WARMUP] [-a ATTN] [-o OUT] [-R CSV]
#   -b BUILD    build directory with bench/tp-bench-llm (default build)
#   -c CONFIG   100m, 1b, tiny or a config.json (default 100m)
#   -B BATCH    prompts (default 1); -S PROMPT tokens each (default 128)
#   -N NEW      new tokens (default 128)
#   -T THREADS  threads of libtp tp 1 and of transformers (default 1)
#   -t TPS      libtp's degrees besides 1 (default "2"; "" for none)
#   -r REPS     repetitions of the runs (default 3)
#   -n ITERS    timed generations per run (default 1); -w WARMUP untimed (1)
#   -a ATTN     transformers' attention: sdpa (default) or eager
#   -o OUT      output stem (default bench/results/compare_decode-<date>):
#               OUT.md the table, OUT.csv one row per run, OUT/ the raw files
#   -R CSV      run nothing: the table of an earlier run's OUT.csv
#   -h, --help  this text
# environment: TORCH_PYTHON  a python with torch and transformers (default:
#              /root/hfenv/bin/python if present, else python3). Without them
#              the script says so and exits 0.
# Exit status: 0 done (or skipped: no torch); 1 a run failed; 64 bad usage.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
build=build config=100m batch=1 prompt=128 new=128 threads=1 tps="2" reps=3 iters=1 warmup=1 attn=sdpa
out="" rerender=""
# shellcheck source=bench/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
bench_name=compare_decode
bench_usage="bench/compare_decode.sh [-b BUILD] [-c CONFIG] [-B BATCH] [-S PROMPT] [-N NEW] [-T THREADS] [-t TPS] [-r REPS] [-n ITERS] [-w WARMUP] [-a ATTN] [-o OUT] [-R CSV]"
while getopts ":b:c:B:S:N:T:t:r:n:w:a:o:R:h-:" opt; do
    case $opt in
    b) build=$OPTARG ;;
    c) config=$OPTARG ;;
    B) batch=$OPTARG ;;
    S) prompt=$OPTARG ;;
    N) new=$OPTARG ;;
    T) threads=$OPTARG ;;
    t) tps=$OPTARG ;;
    r) reps=$OPTARG ;;
    n) iters=$OPTARG ;;
    w) warmup=$OPTARG ;;
    a) attn=$OPTARG ;;
    o) out=$OPTARG ;;
    R) rerender=$OPTARG ;;
    *) bench_getopt "$opt" ;;
    esac
done
shift $((OPTIND - 1))
[ $# -eq 0 ] || bench_bad "unexpected argument '$1'"
for v in "$batch" "$prompt" "$threads" "$reps" "$iters"; do [[ $v =~ ^[1-9][0-9]*$ ]] || bench_bad "'$v' is not a positive integer"; done
if ! [[ $new =~ ^[1-9][0-9]*$ ]] || [ "$new" -lt 2 ]; then bench_bad "-N '$new' is not a count >= 2"; fi
[[ $warmup =~ ^[0-9]+$ ]] || bench_bad "-w '$warmup' is not an integer >= 0"
[ "$attn" = sdpa ] || [ "$attn" = eager ] || bench_bad "-a '$attn': sdpa or eager"
for t in $tps; do [[ $t =~ ^[2-9]$|^[1-9][0-9]+$ ]] || bench_bad "-t: '$t' is not a degree >= 2"; done
case $build in /*) ;; *) build=$repo/$build ;; esac

# The Markdown table of a CSV this script wrote.
render() {
    awk -F, "$bench_awk_header"'
        function sortv(a, n,    i, j, x) { for (i = 2; i <= n; i++) { x = a[i]; for (j = i - 1; j >= 1 && a[j] > x; j--) a[j + 1] = a[j]; a[j + 1] = x } }
        function stats(list, fmt,    v, n, j) {
            n = split(list, v, " ")
            if (!n) return "-"
            for (j = 1; j <= n; j++) v[j] += 0
            sortv(v, n)
            return sprintf(fmt " [" fmt "-" fmt "]", n % 2 ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2, v[1], v[n])
        }
        FNR == 1 { header("rep impl tp threads batch prompt new_tokens ttft_ms decode_tok_s tok_ms_p50 host_us_per_layer gemm_ms"); next }
        {
            who = $c["impl"] == "libtp" ? "tp" $c["tp"] : "torch"
            r = $c["rep"] + 0
            reps = r > reps ? r : reps
            tok[who, r] = $c["decode_tok_s"]; ttft[who, r] = $c["ttft_ms"]; p50[who, r] = $c["tok_ms_p50"]
            if (who != "torch") { host[who] = host[who] " " $c["host_us_per_layer"]; gemm[who] = gemm[who] " " $c["gemm_ms"] }
            th[who] = $c["threads"]
            shape = sprintf("batch %d, prompts of %d tokens, %d new tokens", $c["batch"], $c["prompt"], $c["new_tokens"])
            if (who != "torch" && who != "tp1" && !(who in seen)) { seen[who] = 1; tps[++n] = $c["tp"] + 0 }
        }
        function col(arr, who, fmt,    k, v) { v = ""; for (k = 1; k <= reps; k++) if ((who, k) in arr) v = v " " arr[who, k]; return stats(v, fmt) }
        function ratio(a, b,    k, v) { v = ""; for (k = 1; k <= reps; k++) if ((a, k) in tok && (b, k) in tok && tok[b, k] > 0) v = v " " tok[a, k] / tok[b, k]; return stats(v, "%.2f") }
        END {
            print shape ", " reps " repetitions; median [min-max]"
            print ""
            print "| run | threads | decode tokens/s | time to first token (ms) | median step (ms) | host us/layer (meta) | GEMMs by hand (ms) |"
            print "| --- | --- | --- | --- | --- | --- | --- |"
            printf "| libtp tp 1 | %s | %s | %s | %s | %s | %s |\n", th["tp1"], col(tok, "tp1", "%.1f"), col(ttft, "tp1", "%.1f"), col(p50, "tp1", "%.2f"), stats(host["tp1"], "%.1f"), stats(gemm["tp1"], "%.2f")
            printf "| transformers | %s | %s | %s | %s | - | - |\n", th["torch"], col(tok, "torch", "%.1f"), col(ttft, "torch", "%.1f"), col(p50, "torch", "%.2f")
            for (i = 1; i <= n; i++) {
                w = "tp" tps[i]
                printf "| libtp tp %d | %d x 1 | %s | %s | %s | %s | %s |\n", tps[i], tps[i], col(tok, w, "%.1f"), col(ttft, w, "%.1f"), col(p50, w, "%.2f"), stats(host[w], "%.1f"), stats(gemm[w], "%.2f")
            }
            print ""
            print "libtp tp 1 / transformers, decode tokens/s: " ratio("tp1", "torch") "x"
            for (i = 1; i <= n; i++) print "libtp tp " tps[i] " / tp 1, decode tokens/s: " ratio("tp" tps[i], "tp1") "x"
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
[ -n "$out" ] || out=$repo/bench/results/compare_decode-$stamp
raw=$out
mkdir -p "$raw"
csv=$out.csv md=$out.md
"$bench" --dump-config "$raw/config.json" --config "$config"
load_before=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?")
status=0
echo "# compare_decode: $config, batch $batch, $prompt + $new tokens, $reps repetitions; load before $load_before" >&2
header="impl,model,tp,threads,batch,prompt,new_tokens,ttft_ms,decode_tok_s,tok_ms_p50,tok_ms_p99,gemm_ms,host_us_per_layer"
echo "rep,$header" >"$csv"
# one run's rows (its generations: their median) into ours, with the repetition
collect() {
    local f=$1 rep=$2
    [ -s "$f" ] || return 1
    awk -F, -v rep="$rep" "$bench_awk_header"'
        function med(list,    v, n, i, j, x) { n = split(list, v, " "); for (i = 2; i <= n; i++) { x = v[i] + 0; for (j = i - 1; j >= 1 && v[j] + 0 > x; j--) v[j + 1] = v[j]; v[j + 1] = x } return n % 2 ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2 }
        FNR == 1 { header("impl model tp threads batch prompt new_tokens ttft_ms decode_tok_s tok_ms_p50 tok_ms_p99"); g = ("gemm_ms" in c); h = ("host_us_per_layer" in c); next }
        { id = $c["impl"] "," $c["model"] "," $c["tp"] "," $c["threads"] "," $c["batch"] "," $c["prompt"] "," $c["new_tokens"]
          a[id] = a[id] " " $c["ttft_ms"]; b[id] = b[id] " " $c["decode_tok_s"]; p[id] = p[id] " " $c["tok_ms_p50"]; q[id] = q[id] " " $c["tok_ms_p99"]
          gm[id] = g ? $c["gemm_ms"] : ""; hu[id] = h ? $c["host_us_per_layer"] : "" }
        END { for (id in a) printf "%d,%s,%s,%s,%s,%s,%s,%s\n", rep, id, med(a[id]), med(b[id]), med(p[id]), med(q[id]), gm[id], hu[id] }' "$f" >>"$csv"
}
for rep in $(seq 1 "$reps"); do
    for who in 1 torch $tps; do
        f=$raw/$who-$rep
        if [ "$who" = torch ]; then
            if "$py" "$here/torch_llm.py" --config "$raw/config.json" --name "$config" --generate -b "$batch" -s "$prompt" \
                    --attn "$attn" --new-tokens "$new" --threads "$threads" -r "$iters" -w "$warmup" --csv "$f.csv" >"$f.log" 2>&1 &&
                    collect "$f.csv" "$rep"; then :; else
                echo "# transformers rep $rep failed, see $f.log" >&2
                status=1
            fi
        else
            th=$([ "$who" = 1 ] && echo "$threads" || echo 1)
            if "$bench" -p decode --config "$config" -b "$batch" -s "$prompt" --new-tokens "$new" --tp "$who" \
                    --threads "$th" -r "$iters" -w "$warmup" --csv "$f.csv" >"$f.log" 2>&1 &&
                    collect "$f.csv" "$rep"; then :; else
                echo "# libtp tp $who rep $rep failed, see $f.log" >&2
                status=1
            fi
        fi
    done
done
{
    echo "# compare_decode: $config, $(nproc) cores, $versions"
    echo "# command: bench/compare_decode.sh -c $config -B $batch -S $prompt -N $new -T $threads -t \"$tps\" -r $reps -n $iters -w $warmup -a $attn; load before $load_before, after $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?")"
    echo "# transformers: attn_implementation=\"$attn\""
    echo
    render "$csv"
} >"$md"
cat "$md"
exit $status
