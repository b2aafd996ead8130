#!/usr/bin/env bash
# compare_mpi.sh - libtp's shm collectives against OpenMPI's on this machine.
#
# Runs tp-bench-comm (2 rank threads, -R 1) and the peer baseline mpi_coll
# (mpirun -np 2) interleaved, A B A B, one collective at a time, sizes
# 4 KiB .. 256 MiB (x4, the peer's steps), and prints per collective and size:
# libtp busbw, OpenMPI busbw, their ratio, libtp roof%, and the 4 KiB
# all_reduce latency of both. These machines are noisy (30-45% between runs):
# only the ratios inside one invocation mean something.
#
# usage: bench/compare_mpi.sh [PEERS_DIR]
#   PEERS_DIR        where mpi_coll.c lives (default: $TP_PEERS_DIR, else
#                    ../shared/peers relative to the repository root)
#   -h, --help       this text
# environment:
#   TP_BUILD_DIR     meson build directory (default <repo>/build-bench; set up
#                    if missing, then `ninja` builds tp-bench-comm)
#   TP_BENCH_COMM    use this tp-bench-comm binary instead of building one
#   REPS=2           repetitions of each A B pair
#   TARGET_S=0.3     seconds per point for both programs (mpi_coll's default)
#   MAX_MIB=256      largest size
#   COLLS="allreduce allgather reduce_scatter alltoall bcast"
#   NP=2             ranks
#   RETABULATE=DIR   skip building and running: redo the CSV and the table
#                    from the raw directory DIR of an earlier invocation
# Output: a table on stdout, and under <repo>/bench/results/ (gitignored):
#   compare_mpi-<stamp>.csv  one row per repetition, collective and size
#   compare_mpi-<stamp>.txt  the table
#   compare_mpi-<stamp>/     the raw CSV and logs of every run
# Exit status: 0 done; 1 a run failed or a result check failed; 2 setup
# error (or a CSV without a column the join needs); 64 bad usage.
set -euo pipefail

# shellcheck source=bench/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
bench_name=compare_mpi.sh
bench_usage="bench/compare_mpi.sh [PEERS_DIR]"
case ${1:-} in
-h | --help) bench_help ;;
-*) bench_bad "unknown option $1" ;;
esac
[ $# -le 1 ] || bench_bad "one PEERS_DIR, not $# arguments"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
peers=${1:-${TP_PEERS_DIR:-$repo/../shared/peers}}
build=${TP_BUILD_DIR:-$repo/build-bench}
reps=${REPS:-2}
target=${TARGET_S:-0.3}
max_mib=${MAX_MIB:-256}
colls=${COLLS:-"allreduce allgather reduce_scatter alltoall bcast"}
np=${NP:-2}

die() { echo "compare_mpi.sh: $*" >&2; exit 2; }

[ -f "$peers/mpi_coll.c" ] || die "no mpi_coll.c in '$peers' (pass the peers directory or set TP_PEERS_DIR)"
command -v mpicc >/dev/null || die "mpicc not found (Debian: apt-get install libopenmpi-dev openmpi-bin)"
command -v mpirun >/dev/null || die "mpirun not found"

if [ -n "${RETABULATE:-}" ]; then
    raw=${RETABULATE%/}
    [ -d "$raw" ] || die "RETABULATE: no directory $raw"
    csv=$raw.csv
    txt=$raw.txt
    start=$(date +%s)
    status=0
else
stamp=$(date +%Y%m%d-%H%M%S)
results=$repo/bench/results
raw=$results/compare_mpi-$stamp
mkdir -p "$raw"
csv=$raw.csv
txt=$raw.txt

# ---- build both programs ------------------------------------------------------
mpicc -O2 -o "$raw/mpi_coll" "$peers/mpi_coll.c" >"$raw/mpicc.log" 2>&1 ||
    die "mpicc failed on $peers/mpi_coll.c, see $raw/mpicc.log"
if [ -n "${TP_BENCH_COMM:-}" ]; then
    bench=$TP_BENCH_COMM
else
    if [ ! -d "$build" ]; then
        meson setup "$build" "$repo" >"$raw/meson-setup.log" 2>&1 ||
            die "meson setup failed, see $raw/meson-setup.log"
    fi
    ninja -C "$build" bench/tp-bench-comm >"$raw/ninja.log" 2>&1 ||
        die "building tp-bench-comm failed, see $raw/ninja.log"
    bench=$build/bench/tp-bench-comm
fi
[ -x "$bench" ] || die "no executable tp-bench-comm at $bench"

# ---- run, interleaved ---------------------------------------------------------
status=0
echo "# compare_mpi: $np ranks, sizes 4K..${max_mib}M x4, $reps repetitions, ${target} s per point"
echo "# libtp: $bench (backend shm); peer: $peers/mpi_coll.c"
echo "# raw output: $raw"
start=$(date +%s)
for coll in $colls; do
    for rep in $(seq 1 "$reps"); do
        a=$raw/tp-$coll-$rep
        # -R 1: the A B pairs are the repetitions here
        if ! "$bench" -g "$np" --collective "$coll" -b 4K -e "${max_mib}M" -f 4 -R 1 \
                --target-s "$target" --csv "$a.csv" >"$a.log" 2>&1; then
            echo "# libtp $coll rep $rep: tp-bench-comm failed (exit $?), see $a.log" >&2
            status=1
        fi
        b=$raw/mpi-$coll-$rep
        if ! mpirun --allow-run-as-root --oversubscribe -np "$np" "$raw/mpi_coll" "$target" \
                "$max_mib" "$coll" >"$b.csv" 2>"$b.log"; then
            echo "# OpenMPI $coll rep $rep: mpi_coll failed (exit $?), see $b.log" >&2
            status=1
        fi
        echo "# $coll rep $rep done ($(($(date +%s) - start)) s)"
    done
done
fi

# ---- join -----------------------------------------------------------------------
# Every CSV is read by column name (its header row), so a column added or moved
# changes nothing here, and one renamed or gone stops the script naming it.
# tp CSV (tp-bench-comm --csv): two records per size, out of place (inplace 0)
#   then in place; size_bytes, time_us (mean per call), iter_med_us (median per
#   call of the slowest rank), busbw_GBps (from time_us), wrong,
#   model_bytes_per_rank, roof_GBps_per_thread
# mpi CSV (mpi_coll): bytes, median_s, busbw_GBps (from the median), verify
# Both sides are compared out of place on the median over iterations (mpi_coll
# reports the median; tp-bench-comm's CSV has it as iter_med_us, next to the
# table's mean per call, time_us).
# header(NAMES): bench_awk_header in lib.sh
echo "rep,coll,bytes,tp_busbw_GBps,tp_time_us,tp_busbw_mean_GBps,tp_roof_frac,tp_roof_GBps_per_thread,tp_wrong,mpi_busbw_GBps,mpi_time_us,mpi_verify,ratio" >"$csv"
for coll in $colls; do
    for rep in $(seq 1 "$reps"); do
        a=$raw/tp-$coll-$rep.csv
        b=$raw/mpi-$coll-$rep.csv
        [ -s "$a" ] && [ -s "$b" ] || continue
        awk -F, -v rep="$rep" -v coll="$coll" "$bench_awk_header"'
            FNR == 1 {
                if (FILENAME == ARGV[1])
                    header("inplace size_bytes time_us iter_med_us busbw_GBps wrong model_bytes_per_rank roof_GBps_per_thread")
                else
                    header("bytes median_s busbw_GBps verify")
                next
            }
            FILENAME == ARGV[1] {
                if ($c["inplace"] != 0) next # the in-place records
                # busbw and roof fraction from the median time, as mpi_coll reports
                med = $c["iter_med_us"]; roof = $c["roof_GBps_per_thread"]
                bm = (med + 0 > 0) ? sprintf("%.4f", $c["busbw_GBps"] * $c["time_us"] / med) : ""
                rf = (roof + 0 > 0 && med + 0 > 0) ? sprintf("%.4f", $c["model_bytes_per_rank"] / (med * 1e-6) / 1e9 / roof) : ""
                tp[$c["size_bytes"]] = bm "," med "," $c["busbw_GBps"] "," rf "," roof "," $c["wrong"]
                next
            }
            ($c["bytes"] in tp) {
                split(tp[$c["bytes"]], t, ",")
                mb = $c["busbw_GBps"]
                ratio = (mb + 0 > 0) ? sprintf("%.4f", t[1] / mb) : ""
                printf "%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%.3f,%s,%s\n", rep, coll, $c["bytes"], t[1], t[2], t[3],
                       t[4], t[5], t[6], mb, $c["median_s"] * 1e6, $c["verify"], ratio
            }' "$a" "$b" >>"$csv"
    done
done

# ---- table ------------------------------------------------------------------------
{
    echo "#"
    # the roof of each tp-bench-comm run: memcpy traffic per thread, n threads at once
    grep -ho "roof = the [a-z]*: [0-9.]* GB/s traffic per thread" "$raw"/tp-*.log 2>/dev/null |
        awk '{ print $5 }' | sort -g | awk '
            { v[NR] = $1 }
            END {
                if (NR) printf "# libtp memcpy roof (per thread, %d threads at once): median %.2f GB/s over %d runs (%.2f..%.2f)\n", '"$np"', v[int((NR + 1) / 2)], NR, v[1], v[NR]
            }'
    awk -F, "$bench_awk_header"'
        function gm(sum, cnt) { return cnt ? exp(sum / cnt) : 0 }
        NR == 1 { header("coll bytes tp_busbw_GBps tp_time_us tp_roof_frac tp_wrong mpi_busbw_GBps mpi_time_us mpi_verify ratio"); next }
        {
            co = $c["coll"]; by = $c["bytes"]; tb = $c["tp_busbw_GBps"]; mb = $c["mpi_busbw_GBps"]
            rf = $c["tp_roof_frac"]; ra = $c["ratio"]; w = $c["tp_wrong"]
            key = co SUBSEP by
            if (!(key in n)) { order[++nk] = key }
            n[key]++
            if (tb + 0 > 0) { ltp[key] += log(tb); ntp[key]++ }
            if (mb + 0 > 0) { lmpi[key] += log(mb); nmpi[key]++ }
            if (rf != "") { roof[key] += rf; nroof[key]++ }
            if (ra != "") reps[key] = reps[key] sprintf(" %.2f", ra)
            if (w + 0 > 0) bad[key] += w
            if ($c["mpi_verify"] != "ok") mbad[key]++
            if (co == "allreduce" && by + 0 == 4096) { tl[++nlat] = $c["tp_time_us"]; ml[nlat] = $c["mpi_time_us"] }
        }
        END {
            printf "# %-15s %10s %9s %9s %7s %7s  %-6s %s\n", "collective", "size(B)", "libtp", "OpenMPI", "ratio", "roof%", "checks", "ratio per A B pair"
            printf "# %-15s %10s %9s %9s %7s %7s\n", "", "", "busbw", "busbw", "tp/mpi", "libtp"
            for (i = 1; i <= nk; i++) {
                k = order[i]; split(k, f, SUBSEP)
                t = gm(ltp[k], ntp[k]); m = gm(lmpi[k], nmpi[k])
                r = (t > 0 && m > 0) ? sprintf("%.2f", t / m) : "-"
                rf = nroof[k] ? sprintf("%.1f", 100 * roof[k] / nroof[k]) : "-"
                chk = (bad[k] ? "WRONG" : "") (mbad[k] ? "MPIFAIL" : "")
                if (chk == "") chk = "ok"
                printf "  %-15s %10d %9.2f %9.2f %7s %7s  %-6s%s\n", f[1], f[2], t, m, r, rf, chk, reps[k]
            }
            if (nlat) {
                s = ""; st = 0; sm = 0
                for (j = 1; j <= nlat; j++) { s = s sprintf(" %.1f/%.1f", tl[j], ml[j]); st += tl[j]; sm += ml[j] }
                printf "#\n# 4 KiB all_reduce time (median over iterations), libtp vs OpenMPI: %.2f us vs %.2f us (mean of %d runs; per run libtp/mpi:%s)\n", st / nlat, sm / nlat, nlat, s
            }
            print "# busbw in GB/s, nccl-tests convention, median over iterations, geometric mean over repetitions;"
            print "# ratio = libtp/OpenMPI (geometric mean of the ratios of each A B pair); roof% from libtp median time"
        }' "$csv"
    echo "# csv: $csv"
    echo "# total $(($(date +%s) - start)) s"
} | tee "$txt"

exit $status
