#!/usr/bin/env bash
# Turns a tp-bench-layers CSV into PNG plots (gnuplot): speedup over one rank
# and the share of time in collectives, per layer, against the hidden size.
#   bench/plot_layers.sh results.csv [out_dir]
set -euo pipefail
csv=${1:?usage: plot_layers.sh results.csv [out_dir]}
out=${2:-$(dirname "$csv")}
command -v gnuplot >/dev/null || { echo "plot_layers: gnuplot not found (apt-get install gnuplot-nox)" >&2; exit 1; }
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# one data file per (layer, pass, tokens) with ranks > 1: hidden speedup coll_share.
# The embeddings do no arithmetic worth a speedup plot (their forward is a
# gather of microseconds); their rows stay in the CSV and the table.
awk -F, -v d="$tmp" 'NR > 1 && $5 > 1 && $1 !~ /^emb/ {
        f = d "/" $1 "_" $2 "_" $3 ".dat"
        print $4, $10, 100 * $9 >> f
        seen[f] = 1
    }' "$csv"
plot_cmd() { # $1: column, $2: label
    local first=1 line=""
    for f in "$tmp"/*.dat; do
        [ -e "$f" ] || continue
        local name; name=$(basename "$f" .dat)
        [ $first = 1 ] || line+=", "
        line+="'$f' using 1:$1 with linespoints title '${name//_/ }'"
        first=0
    done
    echo "$line"
}
gnuplot <<GP
set terminal pngcairo size 1000,600 noenhanced
set output '$out/layers_speedup.png'
set title 'Tensor-parallel Linear layers: speedup over one rank (2 ranks as threads, 1 BLAS thread each)'
set xlabel 'hidden size'
set ylabel 'speedup'
set logscale x 2
set key outside right
set grid
set yrange [0:*]
plot $(plot_cmd 2 speedup)
set output '$out/layers_collectives.png'
set title 'Share of the time spent in collectives'
set ylabel 'collectives (%)'
plot $(plot_cmd 3 share)
GP
echo "plot_layers: wrote $out/layers_speedup.png and $out/layers_collectives.png"
