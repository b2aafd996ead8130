#!/usr/bin/env bash
# make_figures.sh - the README's figures, from scratch, in one command.
#
#   bench/make_figures.sh [-b BUILD] OUT_DIR        # e.g. bench/results/figures
#   bench/make_figures.sh [-b BUILD] --docs         # docs/img/, the README's
#
# Runs, on this machine, one after the other (about 7 minutes on 2 cores;
# run it on a quiet machine: the load average is printed before and after):
#   1. tp-bench-layers -g 1,2 -R 3 --csv OUT/layers.csv (the default layers)
#   2. tp-bench-comm -g 2 -b 4K -e 256M -f 4 --csv OUT/comm.csv
#   3. bench/compare_mpi.sh (when mpicc and the peers directory are there)
#   4. bench/compare_gloo.sh -o OUT/compare_gloo (when torch is there)
# then bench/plot_layers.sh and bench/plot_comm.sh into OUT_DIR:
# layers_speedup.png, layers_gflops.png, layers_collectives.png and
# comm_busbw.png. The CSVs and logs stay next to them (with --docs, in
# bench/results/figures-<date>/).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
build=$repo/build docs=0 out=""
while [ $# -gt 0 ]; do
    case $1 in
    -b) build=$2; shift ;;
    --docs) docs=1 ;;
    -h | --help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "usage: bench/make_figures.sh [-b BUILD] OUT_DIR | --docs" >&2; exit 64 ;;
    *) out=$1 ;;
    esac
    shift
done
if [ $docs = 1 ]; then
    img=$repo/docs/img
    out=$repo/bench/results/figures-$(date +%Y%m%d-%H%M%S)
else
    [ -n "$out" ] || { echo "usage: bench/make_figures.sh [-b BUILD] OUT_DIR | --docs" >&2; exit 64; }
    img=$out
fi
mkdir -p "$out"
ninja -C "$build" bench/tp-bench-layers bench/tp-bench-comm >/dev/null

echo "# make_figures: $(uptime)" | tee "$out/uptime.txt"
"$build/bench/tp-bench-layers" -g 1,2 -R 3 --csv "$out/layers.csv" | tee "$out/layers.txt"
"$build/bench/tp-bench-comm" -g 2 -b 4K -e 256M -f 4 --csv "$out/comm.csv" >"$out/comm.txt"
peers=()
if command -v mpicc >/dev/null && [ -f "${TP_PEERS_DIR:-$repo/../shared/peers}/mpi_coll.c" ]; then
    before=$(ls "$repo"/bench/results/compare_mpi-*.csv 2>/dev/null | sort | tail -n 1 || true)
    TP_BENCH_COMM=$build/bench/tp-bench-comm "$here/compare_mpi.sh" >"$out/compare_mpi.txt" 2>&1 || true
    after=$(ls "$repo"/bench/results/compare_mpi-*.csv 2>/dev/null | sort | tail -n 1 || true)
    if [ -n "$after" ] && [ "$after" != "$before" ]; then cp "$after" "$out/compare_mpi.csv"; peers+=(--mpi "$out/compare_mpi.csv"); fi
fi
"$here/compare_gloo.sh" -b "$build" -o "$out/compare_gloo" | tee "$out/compare_gloo.log" || true
[ -s "$out/compare_gloo.csv" ] && peers+=(--gloo "$out/compare_gloo.csv")
echo "# make_figures: $(uptime)" | tee -a "$out/uptime.txt"

flag=()
[ $docs = 1 ] && flag=(--docs)
"$here/plot_layers.sh" "${flag[@]}" "$out/layers.csv" "$img"
"$here/plot_comm.sh" "${flag[@]}" "${peers[@]}" "$out/comm.csv" "$img"
echo "make_figures: data in $out, figures in $img"
