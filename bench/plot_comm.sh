#!/usr/bin/env bash
# plot_comm.sh - busbw against size per collective (gnuplot), libtp with its
# memcpy roof and, when given, its peers.
#
#   bench/plot_comm.sh [--docs] [--inplace] [--mpi CSV]... [--gloo CSV]... TP.csv... OUT_DIR
#
#   TP.csv      tp-bench-comm --csv output (one or more runs: the points are
#               the median over the rows of a collective and size, the error
#               bars the min-max over those rows and, where the CSV has a
#               reps column, over time_min_us..time_max_us, the range of the
#               repetitions inside a run)
#   --mpi CSV   OpenMPI's figures: bench/compare_mpi.sh's CSV
#               (bench/results/compare_mpi-*.csv, column mpi_busbw_GBps) or
#               mpi_coll's own CSV
#   --gloo CSV  torch.distributed gloo's: bench/compare_gloo.sh's CSV
#               (bench/results/compare_gloo-*.csv) or gloo_coll.py's
#   --inplace   plot libtp's in-place rows (default: out of place; broadcast
#               is in place either way)
#   --docs      allow OUT_DIR to be the repository's docs/img/
# Writes OUT_DIR/comm_busbw.png: one panel per collective, busbw (GB/s, the
# nccl-tests convention) against the size on log axes, and the roof: the busbw
# the collective would reach if it moved its model traffic (bench/README.md,
# "The roof and the traffic model") at the memcpy bandwidth tp-bench-comm
# measured in the same run (needs the CSV's roof_GBps_per_thread and
# model_bytes_per_rank; absent with --roof-bytes 0). Columns are found by name
# (header row), so the CSV's layout may change around them: op or collective,
# size_bytes or bytes, iter_med_us / time_med_us / time_us, nranks, inplace.
# busbw is recomputed from the size and the median time with nccl-tests'
# factors (2(n-1)/n all_reduce, (n-1)/n all_gather, reduce_scatter,
# all_to_all, scatter, 1 broadcast), so every series uses the same formula.
# Needs gnuplot (Debian: apt-get install gnuplot-nox).
set -euo pipefail

# shellcheck source=bench/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
bench_name=plot_comm
bench_usage="bench/plot_comm.sh [--docs] [--inplace] [--mpi CSV]... [--gloo CSV]... TP.csv... OUT_DIR"
docs=0 inplace=0
tp=() mpi=() gloo=()
while [ $# -gt 0 ]; do
    case $1 in
    --docs) docs=1 ;;
    --inplace) inplace=1 ;;
    --mpi) [ $# -ge 2 ] || bench_bad "--mpi needs a CSV"; mpi+=("$2"); shift ;;
    --gloo) [ $# -ge 2 ] || bench_bad "--gloo needs a CSV"; gloo+=("$2"); shift ;;
    -h | --help) bench_help ;;
    -*) bench_bad "unknown option $1" ;;
    *) tp+=("$1") ;;
    esac
    shift
done
[ ${#tp[@]} -ge 2 ] || bench_bad "one TP.csv or more, then OUT_DIR"
out=${tp[-1]}
unset 'tp[-1]'
for f in "${tp[@]}" "${mpi[@]}" "${gloo[@]}"; do
    [ -s "$f" ] || { echo "plot_comm: no such CSV (or empty): $f" >&2; exit 1; }
done
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ "$(realpath -m "$out")" = "$(realpath -m "$here/../docs/img")" ] && [ $docs = 0 ]; then
    echo "plot_comm: $out is the README's figure directory; pass --docs to overwrite it" >&2
    exit 64
fi
command -v gnuplot >/dev/null || { echo "plot_comm: gnuplot not found (apt-get install gnuplot-nox)" >&2; exit 1; }
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# extract SERIES FILE...: "series op size busbw busbw_lo busbw_hi" per row,
# plus "roof op size busbw" for libtp's rows that carry a roof.
extract() {
    local series=$1
    shift
    awk -F, -v series="$series" -v want_inplace="$inplace" '
        function col(names,    k, n, nm) {
            n = split(names, nm, " ")
            for (k = 1; k <= n; k++) if (nm[k] in ix) return $(ix[nm[k]])
            return ""
        }
        function has(names,    k, n, nm) { n = split(names, nm, " "); for (k = 1; k <= n; k++) if (nm[k] in ix) return 1; return 0 }
        function norm(op) {
            op = tolower(op); sub(/_perf$/, "", op); gsub(/[_ -]/, "", op)
            if (op == "bcast") op = "broadcast"
            return op
        }
        function factor(op, n) {
            if (op == "broadcast") return 1
            if (n <= 1) return 0
            if (op == "allreduce") return 2 * (n - 1) / n
            return (n - 1) / n
        }
        FNR == 1 {
            delete ix
            for (i = 1; i <= NF; i++) { gsub(/[ \r"]/, "", $i); ix[$i] = i }
            peer = has("mpi_busbw_GBps") ? "mpi_" : has("gloo_busbw_GBps") ? "gloo_" : ""
            if (!has("op coll collective") || !has("size_bytes bytes")) {
                printf "plot_comm: %s: no op/collective or size_bytes/bytes column\n", FILENAME > "/dev/stderr"
                nextfile
            }
            next
        }
        {
            gsub(/\r/, "")
            op = norm(col("op coll collective")); s = col("size_bytes bytes") + 0
            if (op == "" || s <= 0) next
            n = col("nranks np"); n = n == "" ? 2 : n + 0
            if (series == "libtp" && has("inplace") && op != "broadcast" && col("inplace") + 0 != want_inplace) next
            f = factor(op, n)
            if (peer != "") {                       # a comparison script: its peer column
                bw = col(peer "busbw_GBps") + 0; lo = bw; hi = bw
            } else {
                t = col("iter_med_us time_med_us"); if (t == "") t = col("time_us")
                if (t == "" && has("median_s")) t = col("median_s") * 1e6
                t += 0
                if (t > 0 && f > 0) bw = s * f / t / 1e3; else bw = col("busbw_med_GBps busbw_GBps") + 0
                lo = bw; hi = bw
                tmin = col("time_min_us") + 0; tmax = col("time_max_us") + 0
                # the range over repetitions (CSVs with a reps column; before
                # that, time_min_us was the fastest single call: not a spread)
                if (has("reps") && tmax > 0 && f > 0) lo = s * f / tmax / 1e3
                if (has("reps") && tmin > 0 && f > 0) hi = s * f / tmin / 1e3
                roof = col("roof_GBps_per_thread") + 0; model = col("model_bytes_per_rank") + 0
                if (series == "libtp" && roof > 0 && model > 0 && f > 0)
                    printf "roof %s %d %.6g\n", op, s, roof * s / model * f
                if (series == "libtp" && !meta) {
                    meta = 1
                    printf "meta backend %s, %d ranks, %s %s, %s\n", col("backend"), n, col("dtype"),
                           col("redop"), want_inplace ? "in place" : "out of place" 
                }
            }
            if (bw > 0) printf "%s %s %d %.6g %.6g %.6g\n", series, op, s, bw, lo, hi
        }' "$@"
}
{
    extract libtp "${tp[@]}"
    [ ${#mpi[@]} -eq 0 ] || extract OpenMPI "${mpi[@]}"
    [ ${#gloo[@]} -eq 0 ] || extract gloo "${gloo[@]}"
} >"$tmp/rows"

# aggregate: per series, collective and size the median with the min-max
awk -v d="$tmp" '
    function sortv(a, n,    i, j, x) { for (i = 2; i <= n; i++) { x = a[i]; for (j = i - 1; j >= 1 && a[j] > x; j--) a[j + 1] = a[j]; a[j + 1] = x } }
    $1 == "meta" { if (!m) { m = 1; sub(/^meta /, ""); print > (d "/title") } next }
    {
        k = $1 SUBSEP $2 SUBSEP $3
        if (!(k in n)) keys[++nk] = k
        v[k, ++n[k]] = $4
        if ($1 != "roof") {
            if (!(k in lo) || $5 < lo[k]) lo[k] = $5
            if (!(k in hi) || $6 > hi[k]) hi[k] = $6
        }
        ops[$2] = 1
    }
    END {
        for (i = 1; i <= nk; i++) {
            k = keys[i]; split(k, f, SUBSEP)
            delete a
            for (j = 1; j <= n[k]; j++) a[j] = v[k, j] + 0
            sortv(a, n[k])
            med = n[k] % 2 ? a[(n[k] + 1) / 2] : (a[n[k] / 2] + a[n[k] / 2 + 1]) / 2
            l = (k in lo) ? lo[k] : med; h = (k in hi) ? hi[k] : med
            if (l > med) l = med
            if (h < med) h = med
            print f[3], med, l, h > (d "/" f[1] "__" f[2] ".dat")
        }
        for (o in ops) print o > (d "/ops")
    }' "$tmp/rows"
[ -s "$tmp/ops" ] || { echo "plot_comm: no rows to plot" >&2; exit 1; }
for f in "$tmp"/*.dat; do sort -n -k1,1 -o "$f" "$f"; done
# the data behind the lines, for tests and for a look: PLOT_DATA_DIR=dir
[ -z "${PLOT_DATA_DIR:-}" ] || cp "$tmp"/*.dat "$PLOT_DATA_DIR"/

# panels in the usual order
order="allreduce allgather reducescatter alltoall broadcast scatter"
declare -A pretty=([allreduce]=all_reduce [allgather]=all_gather [reducescatter]=reduce_scatter
                   [alltoall]=all_to_all [broadcast]=broadcast [scatter]=scatter)
panels=()
for o in $order; do grep -qx "$o" "$tmp/ops" && panels+=("$o"); done
while read -r o; do [[ " $order " == *" $o "* ]] || panels+=("$o"); done <"$tmp/ops"
np=${#panels[@]}
cols=$((np < 3 ? np : 3))
rows=$(((np + cols - 1) / cols))
# x tics: the sizes present, as 4K / 16M
xt=$(cat "$tmp"/*.dat | awk '{ print $1 }' | sort -n -u | awk '
    { s = $1; l = s >= 1073741824 ? s / 1073741824 "G" : s >= 1048576 ? s / 1048576 "M" : s >= 1024 ? s / 1024 "K" : s
      printf "%s\"%s\" %s", (NR > 1 ? ", " : ""), l, s }')
title="libtp: $(cat "$tmp/title" 2>/dev/null || echo "tp-bench-comm")"
peers=""
[ ${#mpi[@]} -eq 0 ] || peers+=" OpenMPI (compare_mpi.sh)"
[ ${#gloo[@]} -eq 0 ] || peers+="${peers:+,} torch.distributed gloo (compare_gloo.sh)"
[ -z "$peers" ] || title+="; peers:$peers"

{
    cat <<GP
set terminal pngcairo size $((440 * cols + 40)),$((380 * rows + 80)) noenhanced font ",10"
set output '$out/comm_busbw.png'
set multiplot layout $rows,$cols title "busbw against size per collective (median, bars min-max; dashed: the memcpy roof)\n$title" font ",11"
set logscale xy
set xtics ($xt) rotate by -45
set grid
set xlabel 'size (bytes)'
set ylabel 'busbw (GB/s)'
set key bottom right font ",8"
GP
    for o in "${panels[@]}"; do
        line=""
        add() { [ -n "$line" ] && line+=", "; line+="$1"; }
        [ -s "$tmp/libtp__$o.dat" ] && add "'$tmp/libtp__$o.dat' using 1:2:3:4 with yerrorlines lt 1 pt 7 ps 0.6 title 'libtp'"
        [ -s "$tmp/roof__$o.dat" ] && add "'$tmp/roof__$o.dat' using 1:2 with lines lt 1 dt 2 title 'libtp memcpy roof'"
        [ -s "$tmp/OpenMPI__$o.dat" ] && add "'$tmp/OpenMPI__$o.dat' using 1:2:3:4 with yerrorlines lt 2 pt 5 ps 0.6 title 'OpenMPI'"
        [ -s "$tmp/gloo__$o.dat" ] && add "'$tmp/gloo__$o.dat' using 1:2:3:4 with yerrorlines lt 4 pt 9 ps 0.6 title 'gloo'"
        echo "set title '${pretty[$o]:-$o}'"
        echo "plot $line"
    done
    echo "unset multiplot"
} | gnuplot
echo "plot_comm: wrote $out/comm_busbw.png"
