#!/usr/bin/env bash
# compare_gloo.sh - libtp's shm collectives against torch.distributed's gloo,
# side by side in one run.
#
# For each collective, A = tp-bench-comm (ranks as threads, backend shm) and
# B = bench/gloo_coll.py (ranks as processes, gloo over a FileStore on this
# machine, one torch thread each) run alternately, A B A B (-r pairs), on the
# same sizes, and the table gives per collective and size both sides' median
# time and busbw and the ratio gloo time / libtp time (above 1: libtp faster):
# the median over the A B pairs of the ratio inside each pair, with its min-max.
# all_reduce runs in place on both sides (torch's only form; tp-bench-comm
# --inplace 1), broadcast too; all_gather, reduce_scatter and all_to_all out of
# place (all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single).
#
# usage: bench/compare_gloo.sh [-b BUILD] [-n RANKS] [-s SIZES] [-c COLLS] [-r PAIRS]
#                              [-t SECONDS] [-o OUT]
#   -b BUILD    build directory with bench/tp-bench-comm (default build; built
#               with ninja if missing)
#   -n RANKS    ranks on both sides (default 2)
#   -s SIZES    comma-separated sizes, K/M suffixes (default 4K,64K,1M,16M,64M)
#   -c COLLS    collectives (default all_reduce,all_gather,reduce_scatter,all_to_all,broadcast)
#   -r PAIRS    A B pairs (default 3)
#   -t SECONDS  timed seconds per point on each side (default 0.2)
#   -o OUT      output stem (default bench/results/compare_gloo-<date>): OUT.txt
#               the table, OUT.csv one row per pair, collective and size, OUT/
#               the raw CSV and logs of every run
#   -h, --help  this text
# environment: TORCH_PYTHON  a python with torch (default: python3 if it
#               imports torch). Without torch the script says so and exits 0.
#              TP_BENCH_COMM  this tp-bench-comm binary instead of BUILD's
# Exit status: 0 done (or skipped: no torch); 1 a run failed or a result was
# wrong; 64 bad usage.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
build=build np=2 sizes=4K,64K,1M,16M,64M reps=3 target=0.2 out=""
colls=all_reduce,all_gather,reduce_scatter,all_to_all,broadcast
# shellcheck source=bench/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
bench_name=compare_gloo
bench_usage="bench/compare_gloo.sh [-b BUILD] [-n RANKS] [-s SIZES] [-c COLLS] [-r PAIRS] [-t SECONDS] [-o OUT]"
while getopts ":b:n:s:c:r:t:o:h-:" opt; do
    case $opt in
    b) build=$OPTARG ;;
    n) np=$OPTARG ;;
    s) sizes=$OPTARG ;;
    c) colls=$OPTARG ;;
    r) reps=$OPTARG ;;
    t) target=$OPTARG ;;
    o) out=$OPTARG ;;
    *) bench_getopt "$opt" ;;
    esac
done
shift $((OPTIND - 1))
[ $# -eq 0 ] || bench_bad "unexpected argument '$1'"
for v in "$np" "$reps"; do [[ $v =~ ^[1-9][0-9]*$ ]] || bench_bad "'$v' is not a positive integer"; done
case $build in /*) ;; *) build=$repo/$build ;; esac

# ---- torch ---------------------------------------------------------------------
py=${TORCH_PYTHON:-python3}
if ! "$py" -c "import torch, torch.distributed as d; assert d.is_available() and d.is_gloo_available()" 2>/dev/null; then
    echo "compare_gloo: SKIP: no torch with gloo for '$py' (set TORCH_PYTHON to a python that has torch)"
    exit 0
fi
torch_version=$("$py" -c "import torch; print(torch.__version__)")

bench=${TP_BENCH_COMM:-$build/bench/tp-bench-comm}
if [ ! -x "$bench" ]; then
    ninja -C "$build" bench/tp-bench-comm >/dev/null || { echo "compare_gloo: cannot build $bench" >&2; exit 1; }
fi

stamp=$(date +%Y%m%d-%H%M%S)
[ -n "$out" ] || out=$repo/bench/results/compare_gloo-$stamp
raw=$out
mkdir -p "$raw"
csv=$out.csv txt=$out.txt

# sizes in bytes, for gloo_coll.py and for picking tp-bench-comm's rows
to_bytes() {
    local s=${1^^} m=1
    case $s in *K) m=1024 ;; *M) m=1048576 ;; *G) m=1073741824 ;; esac
    s=${s%[KMG]}
    [[ $s =~ ^[0-9]+$ ]] || { echo "compare_gloo: bad size '$1'" >&2; exit 64; }
    echo $((s * m))
}
IFS=, read -r -a size_list <<<"$sizes"
IFS=, read -r -a coll_list <<<"$colls"
bytes_list=()
for s in "${size_list[@]}"; do bytes_list+=("$(to_bytes "$s")"); done
bytes_csv=$(IFS=,; echo "${bytes_list[*]}")

load_before=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?")
start=$(date +%s)
status=0
echo "# compare_gloo: $np ranks, sizes $sizes, $reps A B pairs, ${target} s per point; load before $load_before" >&2
for coll in "${coll_list[@]}"; do
    for rep in $(seq 1 "$reps"); do
        # A: one tp-bench-comm run per size (its -b -e -f sweep cannot take a
        # list); it records both forms, the join below picks one
        a=$raw/tp-$coll-$rep
        : >"$a.log"
        rm -f "$a.csv"
        for b in "${bytes_list[@]}"; do
            if ! "$bench" -g "$np" --collective "$coll" -b "$b" -e "$b" --target-s "$target" \
                    --roof-bytes 0 --csv "$a.part.csv" >>"$a.log" 2>&1; then
                echo "# libtp $coll $b B rep $rep failed, see $a.log" >&2
                status=1
                continue
            fi
            if [ -s "$a.csv" ]; then tail -n +2 "$a.part.csv" >>"$a.csv"; else cat "$a.part.csv" >"$a.csv"; fi
        done
        rm -f "$a.part.csv"
        b=$raw/gloo-$coll-$rep
        if ! "$py" "$here/gloo_coll.py" --np "$np" --op "$coll" --sizes "$bytes_csv" --target-s "$target" \
                --csv "$b.csv" >"$b.log" 2>&1; then
            echo "# gloo $coll rep $rep failed (or counted wrong elements), see $b.log" >&2
            status=1
        fi
    done
    echo "# $coll done ($(($(date +%s) - start)) s)" >&2
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?")

# ---- join by column name: one row per pair, collective and size -----------------
# Every CSV is read by column name (its header row), so a column added or moved
# changes nothing here, and one renamed or gone stops the script naming it.
# header(NAMES): bench_awk_header in lib.sh
echo "rep,op,size_bytes,tp_time_us,gloo_time_us,tp_busbw_GBps,gloo_busbw_GBps,ratio,tp_wrong,gloo_wrong" >"$csv"
for coll in "${coll_list[@]}"; do
    for rep in $(seq 1 "$reps"); do
        a=$raw/tp-$coll-$rep.csv b=$raw/gloo-$coll-$rep.csv
        [ -s "$a" ] && [ -s "$b" ] || continue
        inplace=0
        [ "$coll" = all_reduce ] || [ "$coll" = broadcast ] && inplace=1
        awk -F, -v rep="$rep" -v coll="$coll" -v want="$inplace" -v n="$np" "$bench_awk_header"'
            # busbw from the size and the median time, nccl-tests factors
            function busbw(size, us,    f) {
                f = coll == "broadcast" ? 1 : n < 2 ? 0 : coll == "all_reduce" ? 2 * (n - 1) / n : (n - 1) / n
                return us > 0 ? sprintf("%.4f", size * f / us / 1e3) : ""
            }
            # the median per call of the slowest rank: iter_med_us in the
            # tp-bench-comm CSV, time_med_us in the gloo_coll.py one
            FNR == 1 {
                if (FILENAME == ARGV[1]) header("size_bytes inplace iter_med_us wrong")
                else header("size_bytes time_med_us wrong")
                sz = c["size_bytes"]; w = c["wrong"]; t = FILENAME == ARGV[1] ? c["iter_med_us"] : c["time_med_us"]
                next
            }
            FILENAME == ARGV[1] && $c["inplace"] != want { next }
            FILENAME == ARGV[1] { tt[$sz] = $t; tw[$sz] = $w; next }
            ($sz in tt) {
                r = (tt[$sz] + 0 > 0) ? sprintf("%.4f", $t / tt[$sz]) : ""
                printf "%s,%s,%s,%s,%s,%s,%s,%s,%s,%s\n", rep, coll, $sz, tt[$sz], $t, busbw($sz, tt[$sz]),
                       busbw($sz, $t), r, tw[$sz], $w
            }' "$a" "$b" >>"$csv"
    done
done

rev=$(git -C "$repo" describe --always --dirty 2>/dev/null || echo "?")
{
    echo "# libtp shm vs torch.distributed gloo, $np ranks ($(date -u +%Y-%m-%d))"
    echo "# machine: $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2 | sed 's/^ //'), $(nproc) cores; libtp $rev; torch $torch_version"
    echo "# load average (1, 5, 15 min) before: $load_before, after: $load_after; $reps A B pairs; $(($(date +%s) - start)) s"
    echo "# A = tp-bench-comm -g $np (threads), B = gloo_coll.py --np $np (processes); time = median over calls (slowest rank),"
    echo "# then the median over the pairs; ratio = gloo time / libtp time inside each pair: median [min .. max]"
    awk -F, "$bench_awk_header"'
        function sortv(a, n,    i, j, x) { for (i = 2; i <= n; i++) { x = a[i]; for (j = i - 1; j >= 1 && a[j] > x; j--) a[j + 1] = a[j]; a[j + 1] = x } }
        function med(list,    v, n, j) { n = split(list, v, " "); if (!n) return 0; for (j = 1; j <= n; j++) v[j] += 0; sortv(v, n); return n % 2 ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2 }
        function lo(list,    v, n, i, m) { n = split(list, v, " "); m = v[1] + 0; for (i = 2; i <= n; i++) if (v[i] + 0 < m) m = v[i] + 0; return m }
        function hi(list,    v, n, i, m) { n = split(list, v, " "); m = v[1] + 0; for (i = 2; i <= n; i++) if (v[i] + 0 > m) m = v[i] + 0; return m }
        function fmt_t(us) { return us >= 1000 ? sprintf("%.2f ms", us / 1000) : sprintf("%.1f us", us) }
        function fmt_s(b) { return b >= 1048576 ? sprintf("%dM", b / 1048576) : b >= 1024 ? sprintf("%dK", b / 1024) : b }
        NR == 1 { header("op size_bytes tp_time_us gloo_time_us tp_busbw_GBps gloo_busbw_GBps ratio tp_wrong gloo_wrong"); next }
        {
            k = $c["op"] SUBSEP $c["size_bytes"]
            if (!(k in seen)) { seen[k] = 1; order[++nk] = k }
            ttp = $c["tp_time_us"]; tgl = $c["gloo_time_us"]
            tpt[k] = tpt[k] " " ttp; glt[k] = glt[k] " " tgl
            # busbw x time is the same in every pair (size x the busbw factor)
            if (ttp + 0 > 0) tpbt[k] = $c["tp_busbw_GBps"] * ttp
            if (tgl + 0 > 0) glbt[k] = $c["gloo_busbw_GBps"] * tgl
            if ($c["ratio"] != "") rat[k] = rat[k] " " $c["ratio"]
            bad[k] += $c["tp_wrong"] + $c["gloo_wrong"]
        }
        END {
            printf "%-15s %6s %11s %11s %8s %8s %7s %17s %s\n", "collective", "size", "libtp time", "gloo time",
                   "libtp", "gloo", "ratio", "[min .. max]", "checks"
            printf "%-15s %6s %11s %11s %8s %8s %7s\n", "", "", "", "", "busbw", "busbw", "gloo/tp"
            for (i = 1; i <= nk; i++) {
                k = order[i]; split(k, f, SUBSEP)
                mt = med(tpt[k]); mg = med(glt[k])
                printf "%-15s %6s %11s %11s %8.2f %8.2f %7.2f   [%6.2f .. %6.2f] %s\n", f[1], fmt_s(f[2]),
                       fmt_t(mt), fmt_t(mg), (mt > 0 ? tpbt[k] / mt : 0), (mg > 0 ? glbt[k] / mg : 0), med(rat[k]),
                       lo(rat[k]), hi(rat[k]), bad[k] ? "WRONG" : "ok"
            }
            print "# busbw in GB/s (nccl-tests convention) at the median time shown"
        }' "$csv"
    echo "# csv: $csv; raw runs: $raw/"
} | tee "$txt"
if awk -F, "$bench_awk_header"'
        NR == 1 { header("tp_wrong gloo_wrong"); next }
        $c["tp_wrong"] + $c["gloo_wrong"] > 0 { bad = 1 }
        END { exit !bad }' "$csv"; then status=1; fi
exit $status
