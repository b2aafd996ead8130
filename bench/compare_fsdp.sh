#!/usr/bin/env bash
# compare_fsdp.sh - fitting at scale (issue 34): per-rank memory and step time
# of a training step of the ~100M Llama under DDP and under FSDP, and the
# activation memory of the blocks' recompute none / selective / full.
#
# Every run is build/bench/tp-bench-llm -p train on the shm backend, dp x tp
# rank threads of one process (-d, -t; default 2 x 2), the model of -c
# (default 100m) with the standard TP plan over tp, -B global batch (split
# over dp) x -S tokens, f32, AdamW:
#   memory  --count-memory: each rank thread's own tensor blocks (an
#           allocator that charges a block to the thread that allocated it;
#           deterministic). held = live between steps (parameters, their
#           gradients or DDP buckets, Adam's state), kept = live once the
#           loss is computed less held (what the forward keeps for the
#           backward), peak = the step's peak; the largest rank's. Runs:
#           DDP, DDP with gradients as bucket views, FSDP (every block a
#           unit, then the root), FSDP with the embedding and lm_head units
#           of their own (--fsdp-ends), then DDP and FSDP with --recompute
#           selective and full. Each -m times (the spread shows it is
#           deterministic).
#   time    without the counting allocator (libtp's caching allocator, as a
#           user runs): DDP, FSDP, FSDP with --fsdp-ends in turn, -r times;
#           each run times -n steps after -w untimed ones (a step: the
#           slowest rank's). The table gives the median [min-max] over every
#           timed step of every run, and FSDP / DDP as the median [min-max]
#           of the ratios of the runs' medians within each round.
#
# usage: bench/compare_fsdp.sh [-b BUILD] [-c CONFIG] [-d DP] [-t TP] [-B BATCH]
#                              [-S SEQ] [-r REPS] [-m MEMREPS] [-n STEPS]
#                              [-w WARMUP] [-o OUT] [-R DIR]
#   -b BUILD    build directory with bench/tp-bench-llm (default build)
#   -c CONFIG   100m, 1b, tiny or a config.json (default 100m)
#   -d DP, -t TP  the mesh (default 2 x 2)
#   -B BATCH    global batch (default 4); -S SEQ tokens each (default 64)
#   -r REPS     rounds of the timed runs (default 3)
#   -m MEMREPS  runs of each memory configuration (default 2)
#   -n STEPS    timed steps per run (default 3); -w WARMUP untimed (default 1)
#   -o OUT      where the CSVs and logs go: OUT/, OUT.csv, OUT.md (default
#               bench/results/compare_fsdp-DATE)
#   -R DIR      render the tables of an earlier OUT/ again, running nothing
#
# Exit status: 0 done; 1 a run failed; 64 bad usage.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
build=build config=100m dp=2 tp=2 batch=4 seq=64 reps=3 memreps=2 steps=3 warmup=1
out="" rerender=""
# shellcheck source=bench/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
bench_name=compare_fsdp
bench_usage="bench/compare_fsdp.sh [-b BUILD] [-c CONFIG] [-d DP] [-t TP] [-B BATCH] [-S SEQ] [-r REPS] [-m MEMREPS] [-n STEPS] [-w WARMUP] [-o OUT] [-R DIR]"
while getopts ":b:c:d:t:B:S:r:m:n:w:o:R:h-:" opt; do
    case $opt in
    b) build=$OPTARG ;;
    c) config=$OPTARG ;;
    d) dp=$OPTARG ;;
    t) tp=$OPTARG ;;
    B) batch=$OPTARG ;;
    S) seq=$OPTARG ;;
    r) reps=$OPTARG ;;
    m) memreps=$OPTARG ;;
    n) steps=$OPTARG ;;
    w) warmup=$OPTARG ;;
    o) out=$OPTARG ;;
    R) rerender=$OPTARG ;;
    *) bench_getopt "$opt" ;;
    esac
done
shift $((OPTIND - 1))
[ $# -eq 0 ] || bench_bad "unexpected argument '$1'"
for v in "$dp" "$tp" "$batch" "$seq" "$reps" "$memreps" "$steps"; do
    [[ $v =~ ^[1-9][0-9]*$ ]] || bench_bad "'$v' is not a positive integer"
done
[[ $warmup =~ ^[0-9]+$ ]] || bench_bad "-w '$warmup' is not an integer >= 0"
[ "$dp" -ge 2 ] || bench_bad "-d $dp: FSDP and DDP need dp >= 2"
[ $((batch % dp)) -eq 0 ] || bench_bad "-B $batch is not a multiple of -d $dp"
case $build in /*) ;; *) build=$repo/$build ;; esac

# The Markdown tables of a results folder (its mem.csv and time.csv).
render() {
    local dir=$1
    echo "Per-rank tensor memory (MiB; each rank thread's own blocks, the largest rank's; median [min-max] over the runs)"
    echo
    echo "| data parallel | recompute | held between steps | kept for backward | peak of the step | peak / DDP's | kept / none's |"
    echo "| --- | --- | --- | --- | --- | --- | --- |"
    awk -F, "$bench_awk_header"'
        function sortv(a, n,    i, j, x) { for (i = 2; i <= n; i++) { x = a[i]; for (j = i - 1; j >= 1 && a[j] > x; j--) a[j + 1] = a[j]; a[j + 1] = x } }
        function stats(list, fmt,    v, n, j) {
            n = split(list, v, " ")
            if (!n) return "-"
            for (j = 1; j <= n; j++) v[j] += 0
            sortv(v, n)
            s = sprintf(fmt, n % 2 ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2)
            if (sprintf(fmt, v[1]) != sprintf(fmt, v[n])) s = s sprintf(" [" fmt "-" fmt "]", v[1], v[n])
            return s
        }
        function med(list,    v, n, j) { n = split(list, v, " "); for (j = 1; j <= n; j++) v[j] += 0; sortv(v, n); return n % 2 ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2 }
        FNR == 1 { header("parallel recompute held_mib kept_mib peak_mib"); next }
        {
            id = $c["parallel"] SUBSEP $c["recompute"]
            if (!(id in seen)) { seen[id] = 1; order[++n] = id }
            held[id] = held[id] " " $c["held_mib"]; kept[id] = kept[id] " " $c["kept_mib"]; peak[id] = peak[id] " " $c["peak_mib"]
        }
        END {
            ddp = med(peak["ddp" SUBSEP "none"])
            for (i = 1; i <= n; i++) {
                split(order[i], k, SUBSEP)
                none = med(kept[k[1] SUBSEP "none"])
                printf "| %s | %s | %s | %s | %s | %.2f | %s |\n", k[1], k[2], stats(held[order[i]], "%.1f"),
                    stats(kept[order[i]], "%.1f"), stats(peak[order[i]], "%.1f"),
                    (ddp > 0 ? med(peak[order[i]]) / ddp : 0),
                    (none > 0 ? sprintf("%.2f", med(kept[order[i]]) / none) : "-")
            }
        }' "$dir/mem.csv"
    echo
    echo "Step time (ms; libtp's caching allocator; median [min-max] over every timed step of every run)"
    echo
    echo "| data parallel | step | / DDP (ratio of run medians within a round) | peak MiB (process / ranks) |"
    echo "| --- | --- | --- | --- |"
    awk -F, "$bench_awk_header"'
        function sortv(a, n,    i, j, x) { for (i = 2; i <= n; i++) { x = a[i]; for (j = i - 1; j >= 1 && a[j] > x; j--) a[j + 1] = a[j]; a[j + 1] = x } }
        function stats(list, fmt,    v, n, j) {
            n = split(list, v, " ")
            if (!n) return "-"
            for (j = 1; j <= n; j++) v[j] += 0
            sortv(v, n)
            return sprintf(fmt " [" fmt "-" fmt "]", n % 2 ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2, v[1], v[n])
        }
        function med(list,    v, n, j) { n = split(list, v, " "); for (j = 1; j <= n; j++) v[j] += 0; sortv(v, n); return n % 2 ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2 }
        FNR == 1 { header("rep parallel step_ms peak_mib"); next }
        {
            p = $c["parallel"]; r = $c["rep"] + 0
            if (!(p in seen)) { seen[p] = 1; order[++n] = p }
            steps[p] = steps[p] " " $c["step_ms"]
            run[p, r] = run[p, r] " " $c["step_ms"]
            if (!((p, r) in pk)) { pk[p, r] = 1; peak[p] = peak[p] " " $c["peak_mib"] }
            reps = r > reps ? r : reps
        }
        END {
            for (i = 1; i <= n; i++) {
                p = order[i]; rat = ""
                for (r = 1; r <= reps; r++) if ((p, r) in run && ("ddp", r) in run) rat = rat " " med(run[p, r]) / med(run["ddp", r])
                printf "| %s | %s | %s | %s |\n", p, stats(steps[p], "%.0f"), stats(rat, "%.2f"), stats(peak[p], "%.0f")
            }
        }' "$dir/time.csv"
}

if [ -n "$rerender" ]; then
    [ -f "$rerender/mem.csv" ] || bench_bad "-R: no file '$rerender/mem.csv'"
    render "$rerender"
    exit 0
fi

bench_llm_bin "$build"

stamp=$(date +%Y%m%d-%H%M%S)
[ -n "$out" ] || out=$repo/bench/results/compare_fsdp-$stamp
raw=$out
mkdir -p "$raw"
md=$out.md
common=(-p train --config "$config" --dp "$dp" --tp "$tp" -b "$batch" -s "$seq")
load_before=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?")
status=0
echo "# compare_fsdp: $config, dp $dp x tp $tp, batch $batch x seq $seq; load before $load_before" >&2

# one run's CSV row (after its header) into ours, with the repetition
collect() {
    local f=$1 rep=$2 dest=$3
    [ -s "$f" ] || return 1
    [ -s "$dest" ] || echo "rep,$(head -n 1 "$f")" >"$dest"
    tail -n +2 "$f" | sed "s/^/$rep,/" >>"$dest"
}

# memory: deterministic, counted per rank thread
rm -f "$raw/mem.csv" "$raw/time.csv"
mem_runs=("ddp:none:" "ddp+view:none:--ddp-bucket-view" "fsdp:none:--fsdp" "fsdp+ends:none:--fsdp --fsdp-ends"
          "ddp:selective:" "ddp:full:" "fsdp:selective:--fsdp" "fsdp:full:--fsdp"
          "fsdp+ends:selective:--fsdp --fsdp-ends" "fsdp+ends:full:--fsdp --fsdp-ends")
for rep in $(seq 1 "$memreps"); do
    for spec in "${mem_runs[@]}"; do
        IFS=: read -r name rc flags <<<"$spec"
        f=$raw/mem-$name-$rc-$rep
        # shellcheck disable=SC2086
        if "$bench" "${common[@]}" $flags --recompute "$rc" --count-memory -r 1 -w 1 \
                --csv "$f.csv" >"$f.log" 2>&1 && collect "$f.csv" "$rep" "$raw/mem.csv"; then :; else
            echo "# memory $name recompute $rc rep $rep failed, see $f.log" >&2
            status=1
        fi
    done
done

# time: the caching allocator, the three layouts in turn; time.csv holds every
# timed step (from the run's "# steps ms:" line) with the run's peak
echo "rep,parallel,step_ms,peak_mib" >"$raw/time.csv"
for rep in $(seq 1 "$reps"); do
    for spec in "ddp:" "fsdp:--fsdp" "fsdp+ends:--fsdp --fsdp-ends"; do
        IFS=: read -r name flags <<<"$spec"
        f=$raw/time-$name-$rep
        # shellcheck disable=SC2086
        if "$bench" "${common[@]}" $flags -r "$steps" -w "$warmup" --csv "$f.csv" >"$f.log" 2>&1 &&
                peak=$(awk -F, "$bench_awk_header"'FNR == 1 { header("peak_mib"); next } { print $c["peak_mib"] }' "$f.csv") &&
                grep -q '^# steps ms:' "$f.log"; then
            awk -v rep="$rep" -v p="$name" -v peak="$peak" \
                '/^# steps ms:/ { for (i = 4; i <= NF; i++) print rep "," p "," $i "," peak }' "$f.log" >>"$raw/time.csv"
        else
            echo "# time $name rep $rep failed, see $f.log" >&2
            status=1
        fi
    done
done
{
    echo "# compare_fsdp: $config, dp $dp x tp $tp shm rank threads, $(nproc) cores ($(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -n 1))"
    echo "# command: bench/compare_fsdp.sh -c $config -d $dp -t $tp -B $batch -S $seq -r $reps -m $memreps -n $steps -w $warmup; load before $load_before, after $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?")"
    echo
    render "$raw"
} >"$md"
cat "$md"
exit $status
