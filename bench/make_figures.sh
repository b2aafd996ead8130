#!/usr/bin/env bash
# make_figures.sh - the README's figures, from scratch, in one command.
#
#   bench/make_figures.sh [-b BUILD] OUT_DIR        # e.g. bench/results/figures
#   bench/make_figures.sh [-b BUILD] --docs         # docs/img/, the README's
#   -b BUILD  meson build directory (default build); -h, --help this text
#
# Runs, on this machine, one after the other (about 7 minutes on 2 cores;
# run it on a quiet machine: the load average is printed before and after):
#   1. tp-bench-layers -g 1,2 -R 3 --csv OUT/layers.csv (the default layers)
#   2. tp-bench-comm -g 2 -b 4K -e 256M -f 4 --csv OUT/comm.csv
#   3. bench/compare_mpi.sh (needs mpicc and mpi_coll.c in $TP_PEERS_DIR,
#      default ../shared/peers)
#   4. bench/compare_gloo.sh -o OUT/compare_gloo (needs torch: TORCH_PYTHON)
# then bench/plot_layers.sh and bench/plot_comm.sh into OUT_DIR:
# layers_speedup.png, layers_gflops.png, layers_collectives.png and
# comm_busbw.png. The CSVs and logs stay next to them (with --docs, in
# bench/results/figures-<date>/). A peer (3, 4) that cannot run or fails is
# named and left out of comm_busbw.png; with --docs that is an error (exit 1)
# and docs/img is not touched, since the README's figure shows both peers.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
build=$repo/build docs=0 out=""
# shellcheck source=bench/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
bench_name=make_figures
bench_usage="bench/make_figures.sh [-b BUILD] OUT_DIR | --docs"
while [ $# -gt 0 ]; do
    case $1 in
    -b) [ $# -ge 2 ] || bench_bad "option -b needs a value"; build=$2; shift ;;
    --docs) docs=1 ;;
    -h | --help) bench_help ;;
    -*) bench_bad "unknown option $1" ;;
    *) [ -z "$out" ] || bench_bad "one OUT_DIR, not '$out' and '$1'"; out=$1 ;;
    esac
    shift
done
[ $docs = 0 ] || [ -z "$out" ] || bench_bad "--docs writes into docs/img and takes no OUT_DIR"
[ $docs = 1 ] || [ -n "$out" ] || bench_bad "OUT_DIR or --docs is needed"
if [ $docs = 1 ]; then
    img=$repo/docs/img
    out=$repo/bench/results/figures-$(date +%Y%m%d-%H%M%S)
else
    img=$out
fi
mkdir -p "$out"
ninja -C "$build" bench/tp-bench-layers bench/tp-bench-comm >/dev/null

echo "# make_figures: $(uptime)" | tee "$out/uptime.txt"
"$build/bench/tp-bench-layers" -g 1,2 -R 3 --csv "$out/layers.csv" | tee "$out/layers.txt"
"$build/bench/tp-bench-comm" -g 2 -b 4K -e 256M -f 4 --csv "$out/comm.csv" >"$out/comm.txt"
# The peers' curves in comm_busbw.png. A peer that cannot run here, or whose
# run fails, is left out of the figure and named; with --docs the figures are
# the README's, so a missing peer fails the script before docs/img is touched.
peers=() missing=()
skip() { # PEER REASON
    missing+=("$1: $2")
    echo "make_figures: $1 left out of comm_busbw.png: $2" >&2
}
peers_dir=${TP_PEERS_DIR:-$repo/../shared/peers}
if ! command -v mpicc >/dev/null; then
    skip OpenMPI "mpicc not found"
elif [ ! -f "$peers_dir/mpi_coll.c" ]; then
    skip OpenMPI "no $peers_dir/mpi_coll.c (set TP_PEERS_DIR)"
else
    mpi_rc=0
    TP_BENCH_COMM=$build/bench/tp-bench-comm "$here/compare_mpi.sh" "$peers_dir" >"$out/compare_mpi.txt" 2>&1 || mpi_rc=$?
    # compare_mpi.sh names its CSV in the table's last lines
    mpi_csv=$(sed -n 's/^# csv: //p' "$out/compare_mpi.txt" | tail -n 1)
    if [ $mpi_rc -ne 0 ]; then
        skip OpenMPI "compare_mpi.sh failed (exit $mpi_rc), see $out/compare_mpi.txt"
    elif [ -z "$mpi_csv" ] || [ ! -s "$mpi_csv" ]; then
        skip OpenMPI "compare_mpi.sh wrote no CSV, see $out/compare_mpi.txt"
    else
        cp "$mpi_csv" "$out/compare_mpi.csv"
        peers+=(--mpi "$out/compare_mpi.csv")
    fi
fi
gloo_rc=0
"$here/compare_gloo.sh" -b "$build" -o "$out/compare_gloo" 2>&1 | tee "$out/compare_gloo.log" || gloo_rc=$?
if [ $gloo_rc -ne 0 ]; then
    skip gloo "compare_gloo.sh failed (exit $gloo_rc), see $out/compare_gloo.log"
elif grep -q '^compare_gloo: SKIP' "$out/compare_gloo.log"; then
    skip gloo "$(sed -n 's/^compare_gloo: SKIP: //p' "$out/compare_gloo.log")"
elif [ ! -s "$out/compare_gloo.csv" ]; then
    skip gloo "compare_gloo.sh wrote no CSV, see $out/compare_gloo.log"
else
    peers+=(--gloo "$out/compare_gloo.csv")
fi
echo "# make_figures: $(uptime)" | tee -a "$out/uptime.txt"

if [ $docs = 1 ] && [ ${#missing[@]} -gt 0 ]; then
    echo "make_figures: --docs: docs/img left as it was, the README's comm_busbw.png needs every peer; missing:" >&2
    printf '  %s\n' "${missing[@]}" >&2
    echo "make_figures: the data of this run is in $out" >&2
    exit 1
fi

flag=()
[ $docs = 1 ] && flag=(--docs)
"$here/plot_layers.sh" "${flag[@]}" "$out/layers.csv" "$img"
"$here/plot_comm.sh" "${flag[@]}" "${peers[@]}" "$out/comm.csv" "$img"
echo "make_figures: data in $out, figures in $img"
if [ ${#missing[@]} -gt 0 ]; then
    echo "make_figures: comm_busbw.png has no curve for:" >&2
    printf '  %s\n' "${missing[@]}" >&2
fi
