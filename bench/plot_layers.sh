#!/usr/bin/env bash
# plot_layers.sh - PNG plots of a tp-bench-layers CSV (gnuplot).
#
#   bench/plot_layers.sh [--docs] LAYERS.csv OUT_DIR
#
# Writes into OUT_DIR (created if missing):
#   layers_speedup.png      speedup over one rank against the rank count, one
#                           panel per layer and pass, one line per (tokens,
#                           hidden), min-max error bars, the ideal line
#   layers_gflops.png       GFLOP/s per rank against the rank count (the Linear
#                           layers; the embeddings do no matrix products)
#   layers_collectives.png  share of a pass spent in collectives
# The titles come from the CSV (backend, machine, BLAS threads, runs, passes,
# load). Columns are found by their names in the header row, so added or
# reordered columns do not matter; a CSV without the min/max columns (older
# tp-bench-layers) is drawn without error bars.
#
# OUT_DIR is required. The repository's docs/img/ holds the README's figures:
# writing there needs --docs.
# Needs gnuplot (Debian: apt-get install gnuplot-nox).
set -euo pipefail

# shellcheck source=bench/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
bench_name=plot_layers
bench_usage="bench/plot_layers.sh [--docs] LAYERS.csv OUT_DIR"
docs=0
args=()
for a in "$@"; do
    case $a in
    --docs) docs=1 ;;
    -h | --help) bench_help ;;
    -*) bench_bad "unknown option $a" ;;
    *) args+=("$a") ;;
    esac
done
[ ${#args[@]} -eq 2 ] || bench_bad "LAYERS.csv and OUT_DIR, nothing else"
csv=${args[0]} out=${args[1]}
[ -s "$csv" ] || { echo "plot_layers: no such CSV (or empty): $csv" >&2; exit 1; }
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo_img=$(realpath -m "$here/../docs/img")
if [ "$(realpath -m "$out")" = "$repo_img" ] && [ $docs = 0 ]; then
    echo "plot_layers: $out is the README's figure directory; pass --docs to overwrite it" >&2
    exit 64
fi
command -v gnuplot >/dev/null || { echo "plot_layers: gnuplot not found (apt-get install gnuplot-nox)" >&2; exit 1; }
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# One data file per (layer, pass, tokens, hidden):
#   ranks speedup speedup_min speedup_max gflops/rank min max coll%
# and $tmp/meta: the panels (layer pass) in CSV order, the rank counts, the
# title. Missing columns read as empty.
awk -F, -v d="$tmp" '
    function col(name) { return (name in ix) ? $(ix[name]) : "" }
    function num(name, dflt,    v) { v = col(name); return v == "" ? dflt : v + 0 }
    NR == 1 {
        for (i = 1; i <= NF; i++) { gsub(/[ \r"]/, "", $i); ix[$i] = i }
        if (!("layer" in ix) || !("pass" in ix) || !("ranks" in ix) || !("tokens" in ix) || !("hidden" in ix)) {
            print "plot_layers: the CSV has no layer/pass/tokens/hidden/ranks columns" > "/dev/stderr"
            bad = 1; exit 1
        }
        next
    }
    {
        gsub(/\r/, "")
        l = col("layer"); p = col("pass"); t = col("tokens"); h = col("hidden"); r = col("ranks") + 0
        if (l == "" || r < 1) next
        panel = l " " p
        if (!(panel in seen_panel)) { seen_panel[panel] = 1; panels[++np] = panel }
        if (!((t " " h) in seen_size)) { seen_size[t " " h] = ++ns }
        if (!(r in seen_rank)) { seen_rank[r] = 1; ranks[++nr] = r }
        sp = col("speedup"); g = num("gflops", 0)
        f = d "/" l "__" p "__" t "__" h ".dat"
        if (!(f in files)) { files[f] = 1; list[++nf] = f "\t" panel "\t" t "\t" h "\t" seen_size[t " " h] }
        printf "%d %s %s %s %.6g %.6g %.6g %.6g\n", r, (sp == "" ? "NaN" : sp),
            num("speedup_min", sp == "" ? "NaN" : sp), num("speedup_max", sp == "" ? "NaN" : sp),
            g / r, num("gflops_min", g) / r, num("gflops_max", g) / r, 100 * num("coll_share", 0) > f
        if (!meta_done) {
            meta_done = 1
            be = col("backend"); mach = col("machine"); th = col("blas_threads"); runs = col("runs")
            it = col("iters"); ld = col("load_before")
            title = "backend " (be == "" ? "?" : be)
            if (mach != "") title = title ", " mach
            title = title ", " (th == "" ? "1" : th) " BLAS thread per rank"
            if (runs != "") title = title ", median of " runs " runs of " it " passes, bars min-max"
            if (ld != "") title = title ", load " ld " before"
        }
    }
    END {
        if (bad) exit 1
        for (i = 1; i <= np; i++) print "panel\t" panels[i] > (d "/meta")
        for (i = 1; i <= nf; i++) print "file\t" list[i] > (d "/meta")
        s = ""; for (i = 1; i <= nr; i++) s = s (i > 1 ? "," : "") ranks[i]
        print "ranks\t" s > (d "/meta")
        print "title\t" title > (d "/meta")
    }' "$csv"
[ -s "$tmp/meta" ] || { echo "plot_layers: no rows in $csv" >&2; exit 1; }
for f in "$tmp"/*.dat; do sort -n -k1,1 -o "$f" "$f"; done
# the data behind the lines, for tests and for a look: PLOT_DATA_DIR=dir
[ -z "${PLOT_DATA_DIR:-}" ] || cp "$tmp"/*.dat "$PLOT_DATA_DIR"/

title=$(awk -F'\t' '$1 == "title" { print $2 }' "$tmp/meta")
rank_list=$(awk -F'\t' '$1 == "ranks" { print $2 }' "$tmp/meta")
max_rank=$(tr , '\n' <<<"$rank_list" | sort -n | tail -n 1)
mapfile -t panels < <(awk -F'\t' '$1 == "panel" { print $2 }' "$tmp/meta")
passes=$(printf '%s\n' "${panels[@]}" | awk '{ print $2 }' | awk '!s[$0]++')
layers=$(printf '%s\n' "${panels[@]}" | awk '{ print $1 }' | awk '!s[$0]++')
npass=$(wc -l <<<"$passes")
xtics=$(tr , '\n' <<<"$rank_list" | sort -n | paste -sd, -)

# plot_cmd LAYERS KIND TITLE PNG: a gnuplot script with one panel per (pass,
# layer) of LAYERS (rows: passes, columns: layers). KIND: speedup | gflops | coll.
plot_cmd() {
    local want=$1 kind=$2 nl
    nl=$(wc -w <<<"$want")
    local w=$((380 * nl + 40)) h=$((360 * npass + 70))
    cat <<GP
set terminal pngcairo size $w,$h noenhanced font ",10"
set output '$4'
set multiplot layout $npass,$nl title "$3\n$title" font ",11"
set grid
set xrange [0.8:$max_rank * 1.15]
set xtics ($xtics)
set xlabel 'ranks'
set key top left font ",8" spacing 0.9
GP
    local pass layer
    while read -r pass; do
        for layer in $want; do
            local line="" f idx
            while IFS=$'\t' read -r _ fpath fpanel ft fh idx; do
                [ "$fpanel" = "$layer $pass" ] || continue
                [ -n "$line" ] && line+=", "
                case $kind in
                speedup) line+="'$fpath' using 1:2:3:4 with yerrorlines lt $idx pt 7 ps 0.6 title 'T=$ft H=$fh'" ;;
                gflops) line+="'$fpath' using 1:5:6:7 with yerrorlines lt $idx pt 7 ps 0.6 title 'T=$ft H=$fh'" ;;
                coll) line+="'$fpath' using 1:8 with linespoints lt $idx pt 7 ps 0.6 title 'T=$ft H=$fh'" ;;
                esac
            done < <(awk -F'\t' '$1 == "file"' "$tmp/meta")
            echo "set title '$layer, $pass'"
            case $kind in
            speedup)
                echo "set ylabel 'speedup over 1 rank (x)'"
                echo "set yrange [0:*]"
                [ -n "$line" ] && line+=", "
                line+="x with lines lc 'gray40' dt 2 title 'ideal'" ;;
            gflops)
                echo "set ylabel 'GFLOP/s per rank'"
                echo "set yrange [0:*]" ;;
            coll)
                echo "set ylabel 'time in collectives (% of the pass)'"
                echo "set yrange [0:1<*]" ;;
            esac
            if [ -z "$line" ]; then
                echo "set multiplot next"
            else
                echo "plot $line"
            fi
        done
    done <<<"$passes"
    echo "unset multiplot"
}

# shellcheck disable=SC2086
plot_cmd "$(echo $layers)" speedup "tp-bench-layers: speedup over one rank (the ideal: dashed)" \
    "$out/layers_speedup.png" | gnuplot
linear=$(grep -v '^emb' <<<"$layers" || true)
if [ -n "$linear" ]; then
    # shellcheck disable=SC2086
    plot_cmd "$(echo $linear)" gflops "tp-bench-layers: GFLOP/s per rank of the Linear layers' matrix products" \
        "$out/layers_gflops.png" | gnuplot
fi
# shellcheck disable=SC2086
# (a layer with no collectives has an all-zero panel: gnuplot's note on its
# y range says nothing)
plot_cmd "$(echo $layers)" coll "tp-bench-layers: share of a pass in collectives (re-issued alone and timed)" \
    "$out/layers_collectives.png" | gnuplot 2> >(grep -v 'empty y range' >&2)
echo "plot_layers: wrote $out/layers_speedup.png${linear:+, $out/layers_gflops.png} and $out/layers_collectives.png"
