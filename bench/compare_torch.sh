#!/usr/bin/env bash
# compare_torch.sh - the Megatron MLP block, libtp against PyTorch DTensor
# tensor parallelism, side by side in one run.
#
# The block Linear(H, 4H) -> GELU(tanh) -> Linear(4H, H) (default H 2048:
# 2048 -> 8192 -> 2048), 2048 tokens, forward + backward, f32, one BLAS/torch
# thread per rank, on 1 and 2 ranks:
#   libtp  build/bench/tp-bench-layers -l mlp -p fwd+bwd -g R -R 1 (ranks as
#          threads, ColwiseParallel + RowwiseParallel, shm backend)
#   torch  bench/torch_mlp.py --ranks R (1: the plain nn.Sequential; 2: two
#          processes, gloo, parallelize_module with ColwiseParallel and
#          RowwiseParallel on a CPU device mesh)
#   gemm   build/bench/tp-bench-layers -l mlp-gemm -p fwd+bwd -g R -R 1: the
#          five sgemm calls of libtp's pass alone, by hand, on each rank's
#          shards (no bias, GELU, autograd or collective): libtp's floor
# run alternately, libtp 1, torch 1, gemm 1, libtp 2, torch 2, gemm 2,
# repeated -r times. All time a pass between two barriers (the slowest rank)
# and keep the median of -n passes after -w untimed ones. The table gives
# each side's median over the repetitions with the min-max, libtp/torch
# (below 1: libtp faster) and libtp/gemm (what libtp adds to its GEMMs), as
# medians of the ratios inside each repetition with their min-max, and each
# side's speedup 1 -> 2 ranks.
#
# usage: bench/compare_torch.sh [-b BUILD] [-t TOKENS] [-H HIDDEN] [-r REPS]
#                               [-n ITERS] [-w WARMUP] [-o OUT]
#   -b BUILD   build directory with bench/tp-bench-layers (default build)
#   -t TOKENS  tokens (default 2048); -H HIDDEN  H (default 2048)
#              (quick: -t 512 -H 512)
#   -r REPS    repetitions of the six runs (default 3)
#   -n ITERS   timed passes per run (default 3); -w WARMUP untimed (default 2)
#   -o OUT     output stem (default bench/results/compare_torch-<date>): OUT.txt
#              the table, OUT.csv one row per run, OUT/ the raw files
#   -h, --help this text
# environment: TORCH_PYTHON  a python with torch (default: python3 if it
#              imports torch). Without torch the script says so and exits 0.
# Exit status: 0 done (or skipped: no torch); 1 a run failed; 64 bad usage.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
build=build tokens=2048 hidden=2048 reps=3 iters=3 warmup=2 out=""
# shellcheck source=bench/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
bench_name=compare_torch
bench_usage="bench/compare_torch.sh [-b BUILD] [-t TOKENS] [-H HIDDEN] [-r REPS] [-n ITERS] [-w WARMUP] [-o OUT]"
while getopts ":b:t:H:r:n:w:o:h-:" opt; do
    case $opt in
    b) build=$OPTARG ;;
    t) tokens=$OPTARG ;;
    H) hidden=$OPTARG ;;
    r) reps=$OPTARG ;;
    n) iters=$OPTARG ;;
    w) warmup=$OPTARG ;;
    o) out=$OPTARG ;;
    *) bench_getopt "$opt" ;;
    esac
done
shift $((OPTIND - 1))
[ $# -eq 0 ] || bench_bad "unexpected argument '$1'"
for v in "$tokens" "$hidden" "$reps" "$iters"; do [[ $v =~ ^[1-9][0-9]*$ ]] || bench_bad "'$v' is not a positive integer"; done
[[ $warmup =~ ^[0-9]+$ ]] || bench_bad "-w '$warmup' is not an integer >= 0"
case $build in /*) ;; *) build=$repo/$build ;; esac

py=${TORCH_PYTHON:-python3}
if ! "$py" -c "import torch, torch.distributed as d; assert d.is_available() and d.is_gloo_available()" 2>/dev/null; then
    echo "compare_torch: SKIP: no torch with gloo for '$py' (set TORCH_PYTHON to a python that has torch)"
    exit 0
fi
torch_version=$("$py" -c "import torch; print(torch.__version__)")
bench=$build/bench/tp-bench-layers
if [ ! -x "$bench" ]; then
    ninja -C "$build" bench/tp-bench-layers >/dev/null || { echo "compare_torch: cannot build $bench" >&2; exit 1; }
fi

stamp=$(date +%Y%m%d-%H%M%S)
[ -n "$out" ] || out=$repo/bench/results/compare_torch-$stamp
raw=$out
mkdir -p "$raw"
csv=$out.csv txt=$out.txt
load_before=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?")
start=$(date +%s)
status=0
echo "# compare_torch: MLP $hidden -> $((4 * hidden)) -> $hidden, $tokens tokens, $reps repetitions; load before $load_before" >&2

# time_ms of the one row of a CSV with a header row, by column name
time_of() {
    awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) if ($i == "time_ms") c = i; next } c && $c != "" { print $c; exit }' "$1"
}
echo "rep,impl,ranks,time_ms" >"$csv"
for rep in $(seq 1 "$reps"); do
    for ranks in 1 2; do
        a=$raw/libtp-$ranks-$rep
        if "$bench" -l mlp -p fwd+bwd -t "$tokens" -H "$hidden" -g "$ranks" -R 1 -n "$iters" -w "$warmup" \
                --csv "$a.csv" >"$a.log" 2>&1 && [ -n "$(time_of "$a.csv")" ]; then
            echo "$rep,libtp,$ranks,$(time_of "$a.csv")" >>"$csv"
        else
            echo "# libtp $ranks ranks rep $rep failed, see $a.log" >&2
            status=1
        fi
        b=$raw/torch-$ranks-$rep
        if "$py" "$here/torch_mlp.py" --ranks "$ranks" -t "$tokens" -H "$hidden" -n "$iters" -w "$warmup" \
                --csv "$b.csv" >"$b.log" 2>&1 && [ -n "$(time_of "$b.csv")" ]; then
            echo "$rep,torch,$ranks,$(time_of "$b.csv")" >>"$csv"
        else
            echo "# torch $ranks ranks rep $rep failed, see $b.log" >&2
            status=1
        fi
        c=$raw/gemm-$ranks-$rep
        if "$bench" -l mlp-gemm -p fwd+bwd -t "$tokens" -H "$hidden" -g "$ranks" -R 1 -n "$iters" -w "$warmup" \
                --csv "$c.csv" >"$c.log" 2>&1 && [ -n "$(time_of "$c.csv")" ]; then
            echo "$rep,gemm,$ranks,$(time_of "$c.csv")" >>"$csv"
        else
            echo "# gemm $ranks ranks rep $rep failed, see $c.log" >&2
            status=1
        fi
    done
    echo "# repetition $rep done ($(($(date +%s) - start)) s)" >&2
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?")

rev=$(git -C "$repo" describe --always --dirty 2>/dev/null || echo "?")
{
    echo "# Megatron MLP block $hidden -> $((4 * hidden)) -> $hidden, $tokens tokens, fwd+bwd, f32, 1 thread per rank ($(date -u +%Y-%m-%d))"
    echo "# machine: $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2 | sed 's/^ //'), $(nproc) cores; libtp $rev (shm, OpenBLAS); torch $torch_version (gloo, its own BLAS)"
    echo "# load average (1, 5, 15 min) before: $load_before, after: $load_after; $reps repetitions of libtp 1, torch 1, gemm 1, libtp 2, torch 2, gemm 2; $(($(date +%s) - start)) s"
    echo "# a run: median of $iters passes after $warmup untimed; shown: median over repetitions [min .. max]"
    awk -F, -v reps="$reps" '
        function sortv(a, n,    i, j, x) { for (i = 2; i <= n; i++) { x = a[i]; for (j = i - 1; j >= 1 && a[j] > x; j--) a[j + 1] = a[j]; a[j + 1] = x } }
        function stats(list,    v, n, j) {
            n = split(list, v, " ")
            if (!n) return "-"
            for (j = 1; j <= n; j++) v[j] += 0
            sortv(v, n)
            return sprintf("%8.3f [%.3f .. %.3f]", n % 2 ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2, v[1], v[n])
        }
        NR == 1 { next }
        { t[$2, $3, $1] = $4 }
        # the median [min .. max] of impl a / impl b inside each repetition, r ranks
        function ratio(a, b, r,    k, v) {
            v = ""
            for (k = 1; k <= reps; k++)
                if ((a, r, k) in t && (b, r, k) in t && t[b, r, k] > 0)
                    v = v " " t[a, r, k] / t[b, r, k]
            return stats(v)
        }
        function times(impl, r,    k, v) {
            v = ""
            for (k = 1; k <= reps; k++)
                if ((impl, r, k) in t)
                    v = v " " t[impl, r, k]
            return stats(v)
        }
        END {
            for (r = 1; r <= 2; r++)
                printf "%d rank%s  libtp %s ms   torch %s ms   gemm %s ms\n", r, r == 1 ? " " : "s", times("libtp", r), times("torch", r), times("gemm", r)
            for (r = 1; r <= 2; r++)
                printf "%d rank%s  libtp/torch %s   libtp/gemm %s\n", r, r == 1 ? " " : "s", ratio("libtp", "torch", r), ratio("libtp", "gemm", r)
            for (s = 1; s <= 3; s++) {
                impl = s == 1 ? "libtp" : s == 2 ? "torch" : "gemm"; sp = ""
                for (k = 1; k <= reps; k++)
                    if ((impl, 1, k) in t && (impl, 2, k) in t && t[impl, 2, k] > 0)
                        sp = sp " " t[impl, 1, k] / t[impl, 2, k]
                printf "speedup 1 -> 2 ranks, %s: %s\n", impl, stats(sp)
            }
        }' "$csv"
    echo "# csv: $csv; raw runs: $raw/"
} | tee "$txt"
exit $status
