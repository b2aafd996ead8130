#!/usr/bin/env bash
# compare_backends.sh - libtp's shm backend against its mpi backend, same
# machine, same sizes, one invocation.
#
# A = ranks as threads of one process (--backend shm, -g N), B = one rank per
# process (mpirun -np N ... --backend mpi). For every collective and size, and
# for a few Linear/Embedding layers, it runs A B A B (-r pairs) and writes a
# Markdown table: the median time and busbw of each side (median over the
# repetitions) and shm/mpi, the speed ratio inside each A B pair and its median
# (> 1: shm faster). These machines are noisy: only the ratios inside one
# invocation mean something, and the median resists a pair hit by another job.
#
# usage: bench/compare_backends.sh [options]
#   -b DIR     meson build directory holding bench/tp-bench-comm and
#              bench/tp-bench-layers, libtp built with MPI (default: build)
#   -n N       ranks (default 2)
#   -s LIST    sizes for the collectives, K/M/G suffixes (default 4K,1M,16M,64M)
#   -c LIST    collectives (default all_reduce,all_gather,reduce_scatter,all_to_all,broadcast)
#   -l LIST    layers for tp-bench-layers (default colwise,rowwise,mlp,emb-row)
#   -t LIST    tokens for the layers (default 2048)
#   -H LIST    hidden sizes for the layers (default 512)
#   -r N       A B pairs (default 2)
#   -T SEC     seconds per collective point (tp-bench-comm --target-s, default 0.2)
#   -i N       timed passes per layer point (tp-bench-layers -n, default 5)
#   -w N       untimed passes before them (tp-bench-layers -w, default 6: the
#              embeddings' backward takes about 5 before its buffers are reused)
#   -k SEC     time limit of each run (default 300)
#   -p PARTS   comm, layers or comm,layers (default)
#   -o FILE    the Markdown table (default bench/results/backends-<date>.md)
#   -h, --help this text
# environment: MPIRUN_ARGS (default "--bind-to none": rank threads are not
# bound either, so neither side is pinned to a core another job is using)
# Raw CSV and logs: next to the table, in <FILE without .md>/.
# Exit status: 0 all runs passed; 1 a run failed, timed out or counted wrong
# elements (the table says which); 2 setup error; 64 bad command line.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")

build=build
np=2
sizes=4K,1M,16M,64M
colls=all_reduce,all_gather,reduce_scatter,all_to_all,broadcast
layers=colwise,rowwise,mlp,emb-row
tokens=2048
hidden=512
reps=2
target=0.2
layer_iters=5
layer_warmup=6
limit=300
parts=comm,layers
out=

die() { echo "compare_backends.sh: $*" >&2; exit 2; }
# shellcheck source=bench/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
bench_name=compare_backends.sh
bench_usage="bench/compare_backends.sh [-b DIR] [-n N] [-s LIST] [-c LIST] [-l LIST] [-t LIST] [-H LIST] [-r N] [-T SEC] [-i N] [-w N] [-k SEC] [-p PARTS] [-o FILE]"

while getopts ":b:n:s:c:l:t:H:r:T:i:w:k:p:o:h-:" opt; do
    case $opt in
    b) build=$OPTARG ;;
    n) np=$OPTARG ;;
    s) sizes=$OPTARG ;;
    c) colls=$OPTARG ;;
    l) layers=$OPTARG ;;
    t) tokens=$OPTARG ;;
    H) hidden=$OPTARG ;;
    r) reps=$OPTARG ;;
    T) target=$OPTARG ;;
    i) layer_iters=$OPTARG ;;
    w) layer_warmup=$OPTARG ;;
    k) limit=$OPTARG ;;
    p) parts=$OPTARG ;;
    o) out=$OPTARG ;;
    *) bench_getopt "$opt" ;;
    esac
done
shift $((OPTIND - 1))
[ $# -eq 0 ] || bench_bad "unexpected argument '$1'"
for v in "$np" "$reps" "$layer_iters" "$layer_warmup" "$limit"; do
    [[ $v =~ ^[1-9][0-9]*$ ]] || bench_bad "'$v' is not a positive integer"
done
do_comm=0 do_layers=0
case ",$parts," in *,comm,*) do_comm=1 ;; esac
case ",$parts," in *,layers,*) do_layers=1 ;; esac
[ $do_comm = 1 ] || [ $do_layers = 1 ] || bench_bad "-p takes comm, layers or both"

comm_bin=$build/bench/tp-bench-comm
layers_bin=$build/bench/tp-bench-layers
for b in $([ $do_comm = 1 ] && echo "$comm_bin") $([ $do_layers = 1 ] && echo "$layers_bin"); do
    [ -x "$b" ] || die "no $b: build it with
    meson setup $build -Dbench=true -Dmpi=enabled && ninja -C $build
(or pass another build directory with -b)"
done
command -v mpirun >/dev/null || die "mpirun not found (Debian: apt-get install openmpi-bin)"
command -v timeout >/dev/null || die "timeout (coreutils) not found"
if [ $do_comm = 1 ] && "$comm_bin" --help 2>&1 | grep -q '^  mpi .*not in this libtp'; then
    die "$comm_bin: libtp was built without MPI (meson configure $build -Dmpi=enabled)"
fi
if [ $do_layers = 1 ] && ! "$layers_bin" --help 2>&1 | grep -q -- '^  -R N'; then
    die "$layers_bin predates --backend and -R: rebuild it (ninja -C $build)"
fi

export OMPI_MCA_btl_vader_single_copy_mechanism=none
read -r -a mpirun_extra <<<"${MPIRUN_ARGS---bind-to none}"
mpirun=(mpirun --allow-run-as-root --oversubscribe "${mpirun_extra[@]}" -np "$np")

stamp=$(date -u +%Y%m%d-%H%M%S)
[ -n "$out" ] || out=$repo/bench/results/backends-$stamp.md
mkdir -p "$(dirname "$out")"
raw=${out%.md}
mkdir -p "$raw"
status=0
failed_runs=()

# run NAME CMD...: CMD's stdout+stderr to $raw/NAME.log, under the time limit
run() {
    local name=$1 rc=0
    shift
    timeout -k 10 "$limit" "$@" >"$raw/$name.log" 2>&1 || rc=$?
    if [ $rc -ne 0 ]; then
        if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
            failed_runs+=("$name: timed out after $limit s")
        else
            failed_runs+=("$name: exit $rc")
        fi
        echo "# ${failed_runs[-1]}, see $raw/$name.log" >&2
        status=1
    fi
}

IFS=, read -r -a size_list <<<"$sizes"
IFS=, read -r -a coll_list <<<"$colls"
IFS=, read -r -a layer_list <<<"$layers"
start=$(date +%s)
load_before=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?")
echo "# compare_backends: $np ranks, shm (threads) vs mpi (mpirun -np $np ${MPIRUN_ARGS---bind-to none}), $reps A B pairs; raw output in $raw" >&2

# ---- collectives: one (collective, size) point per run, A B A B ---------------
# -R 1: the A B pairs are the repetitions here
comm_opts=(-n 0 -R 1 --target-s "$target" --roof-bytes 0 -c 1)
if [ $do_comm = 1 ]; then
    for coll in "${coll_list[@]}"; do
        for size in "${size_list[@]}"; do
            for rep in $(seq 1 "$reps"); do
                run "comm-shm-$coll-$size-$rep" "$comm_bin" --backend shm -g "$np" --collective "$coll" \
                    -b "$size" -e "$size" "${comm_opts[@]}" --csv "$raw/comm-shm-$coll-$size-$rep.csv"
                run "comm-mpi-$coll-$size-$rep" "${mpirun[@]}" "$comm_bin" --backend mpi --collective "$coll" \
                    -b "$size" -e "$size" "${comm_opts[@]}" --csv "$raw/comm-mpi-$coll-$size-$rep.csv"
            done
        done
        echo "# $coll done ($(($(date +%s) - start)) s)" >&2
    done
fi

# ---- layers: one layer per run, ranks 1 and N, A B A B -------------------------
if [ $do_layers = 1 ]; then
    for layer in "${layer_list[@]}"; do
        for rep in $(seq 1 "$reps"); do
            # -R 1: the A B pairs are this script's repetitions
            run "layers-shm-$layer-$rep" "$layers_bin" --backend shm -g "1,$np" -R 1 -l "$layer" \
                -t "$tokens" -H "$hidden" -n "$layer_iters" -w "$layer_warmup" \
                --csv "$raw/layers-shm-$layer-$rep.csv"
            run "layers-mpi-$layer-$rep" "${mpirun[@]}" "$layers_bin" --backend mpi -g "1,$np" -R 1 \
                -l "$layer" -t "$tokens" -H "$hidden" -n "$layer_iters" -w "$layer_warmup" \
                --csv "$raw/layers-mpi-$layer-$rep.csv"
        done
        echo "# $layer done ($(($(date +%s) - start)) s)" >&2
    done
fi
load_after=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?")

# ---- join: one row per repetition ------------------------------------------------
# Every CSV is read by column name (its header row), so a column added or moved
# changes nothing here, and one renamed or gone stops the script naming it.
# tp-bench-comm CSV: the out-of-place record (inplace 0) is compared, on the
#   median per call (iter_med_us) and the busbw of that time (busbw_GBps is
#   from the mean, time_us); wrong
# tp-bench-layers CSV: rows keyed by layer, pass, tokens, hidden, ranks; time_ms
# header(NAMES): bench_awk_header in lib.sh
joined=$raw/joined.csv
echo "kind,name,size,pass,ranks,rep,shm_time,mpi_time,shm_busbw,mpi_busbw,wrong" >"$joined"
if [ $do_comm = 1 ]; then
    for coll in "${coll_list[@]}"; do
        for size in "${size_list[@]}"; do
            for rep in $(seq 1 "$reps"); do
                a=$raw/comm-shm-$coll-$size-$rep.csv
                b=$raw/comm-mpi-$coll-$size-$rep.csv
                if [ ! -s "$a" ] || [ ! -s "$b" ]; then
                    echo "comm,$coll,$size,,$np,$rep,,,,," >>"$joined"
                    continue
                fi
                awk -F, -v coll="$coll" -v size="$size" -v rep="$rep" -v np="$np" "$bench_awk_header"'
                    function bw(    med) { med = $c["iter_med_us"]; return med + 0 > 0 ? $c["busbw_GBps"] * $c["time_us"] / med : 0 }
                    FNR == 1 { header("inplace time_us iter_med_us busbw_GBps wrong"); next }
                    $c["inplace"] != 0 { next }
                    FILENAME == ARGV[1] { t = $c["iter_med_us"]; sbw = bw(); w = $c["wrong"]; next }
                    { printf "comm,%s,%s,,%s,%s,%s,%s,%s,%s,%d\n", coll, size, np, rep, t, $c["iter_med_us"],
                             sbw, bw(), w + $c["wrong"] }
                ' "$a" "$b" >>"$joined"
            done
        done
    done
fi
if [ $do_layers = 1 ]; then
    for layer in "${layer_list[@]}"; do
        for rep in $(seq 1 "$reps"); do
            a=$raw/layers-shm-$layer-$rep.csv
            b=$raw/layers-mpi-$layer-$rep.csv
            if [ ! -s "$a" ] || [ ! -s "$b" ]; then continue; fi
            awk -F, -v rep="$rep" "$bench_awk_header"'
                function key() { return $c["layer"] SUBSEP $c["pass"] SUBSEP $c["tokens"] SUBSEP $c["hidden"] SUBSEP $c["ranks"] }
                FNR == 1 { header("layer pass tokens hidden ranks time_ms"); next }
                FILENAME == ARGV[1] { t[key()] = $c["time_ms"]; next }
                key() in t {
                    printf "layer,%s,T=%s H=%s,%s,%s,%s,%s,%s,,,0\n", $c["layer"], $c["tokens"], $c["hidden"],
                           $c["pass"], $c["ranks"], rep, t[key()], $c["time_ms"]
                }' "$a" "$b" >>"$joined"
        done
    done
fi

# ---- table ----------------------------------------------------------------------
mpi_version=$(mpirun --version 2>/dev/null | head -n 1 || true)
# the commit the binaries were built from: the build directory's source tree
src=$(sed -n 's/.*"source": *"\([^"]*\)".*/\1/p' "$build/meson-info/meson-info.json" 2>/dev/null | head -n 1)
rev=$(git -C "${src:-$repo}" describe --always --dirty 2>/dev/null || echo "?")
{
    echo "## libtp shm versus mpi backend, $np ranks ($(date -u +%Y-%m-%d))"
    echo
    echo "Machine: $(nproc) cores, $(uname -m); ${mpi_version:-mpirun ?}; libtp $rev; build \`$build\`."
    echo "Load average (1, 5, 15 min) before: $load_before, after: $load_after. $reps A B pairs, $(($(date +%s) - start)) s."
    echo
    if [ $do_comm = 1 ]; then
        echo "A = \`tp-bench-comm --backend shm -g $np\` (ranks as threads), B = \`mpirun -np $np ${MPIRUN_ARGS---bind-to none} tp-bench-comm --backend mpi\` (one rank per process), one collective and size per run, f32 sum, out of place, results checked."
        echo
    fi
    awk -F, "$bench_awk_header"'
        # median of a space-separated list (the mean of the middle two for an even count)
        function med(list,    v, m, i, j, x) {
            m = split(list, v, " ")
            if (!m) return 0
            for (i = 2; i <= m; i++) {
                x = v[i] + 0
                for (j = i - 1; j >= 1 && v[j] + 0 > x; j--) v[j + 1] = v[j]
                v[j + 1] = x
            }
            return m % 2 ? v[(m + 1) / 2] : (v[m / 2] + v[m / 2 + 1]) / 2
        }
        function fmt_t(us) { return us >= 1000 ? sprintf("%.2f ms", us / 1000) : sprintf("%.1f µs", us) }
        NR == 1 { header("kind name size pass ranks shm_time mpi_time shm_busbw mpi_busbw wrong"); next }
        {
            key = $c["kind"] SUBSEP $c["name"] SUBSEP $c["size"] SUBSEP $c["pass"] SUBSEP $c["ranks"]
            if (!(key in seen)) { seen[key] = 1; order[++nk] = key; kind[nk] = $c["kind"] }
            a = $c["shm_time"]; b = $c["mpi_time"]
            if (a + 0 > 0 && b + 0 > 0) {
                ts[key] = ts[key] " " a; tm[key] = tm[key] " " b; n[key]++
                r = b / a  # speed ratio shm/mpi = time mpi / time shm
                rr[key] = rr[key] " " r; pairs[key] = pairs[key] sprintf(" %.2f", r)
                bs[key] = bs[key] " " $c["shm_busbw"]; bm[key] = bm[key] " " $c["mpi_busbw"]
            } else {
                failed[key]++
            }
            if ($c["wrong"] > 0) wrong[key] += $c["wrong"]
        }
        END {
            hdr = 0
            for (i = 1; i <= nk; i++) {
                if (kind[i] != "comm") continue
                if (!hdr) {
                    print "| collective | size | shm time | mpi time | shm busbw (GB/s) | mpi busbw (GB/s) | shm/mpi | per A B pair |"
                    print "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
                    hdr = 1
                }
                k = order[i]; split(k, f, SUBSEP)
                note = (failed[k] ? sprintf(" (%d run(s) failed)", failed[k]) : "") (wrong[k] ? sprintf(" (%d wrong elements)", wrong[k]) : "")
                if (n[k])
                    printf "| %s | %s | %s | %s | %.2f | %.2f | %.2f |%s%s |\n", f[2], f[3],
                           fmt_t(med(ts[k])), fmt_t(med(tm[k])), med(bs[k]), med(bm[k]),
                           med(rr[k]), pairs[k], note
                else
                    printf "| %s | %s | - | - | - | - | - |%s |\n", f[2], f[3], note
            }
            if (hdr) print ""
            hdr = 0
            for (i = 1; i <= nk; i++) {
                if (kind[i] != "layer") continue
                if (!hdr) {
                    print "| layer | size | pass | ranks | shm time (ms) | mpi time (ms) | shm/mpi | per A B pair |"
                    print "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |"
                    hdr = 1
                }
                k = order[i]; split(k, f, SUBSEP)
                printf "| %s | %s | %s | %s | %.2f | %.2f | %.2f |%s |\n", f[2], f[3], f[4], f[5],
                       med(ts[k]), med(tm[k]), med(rr[k]), pairs[k]
            }
            if (hdr) print ""
        }' "$joined"
    echo "Times are medians over iterations (collectives) or passes (layers), then the median over the"
    echo "repetitions; busbw in GB/s (10^9 B/s) from the median time, nccl-tests factors. shm/mpi is the"
    echo "speed ratio time(mpi) / time(shm) inside each A B pair (listed), and its median over the pairs:"
    echo "> 1 means the shm backend was faster. Layer rows with 1 rank run no collective: their ratio"
    echo "shows how far the two launch methods differ without communication (noise, placement)."
    if [ $do_layers = 1 ]; then
        echo "Layers: \`tp-bench-layers -g 1,$np -R 1 -l LAYER -t $tokens -H $hidden -n $layer_iters -w $layer_warmup\`, 1 BLAS thread per rank."
    fi
    if [ ${#failed_runs[@]} -gt 0 ]; then
        echo
        echo "Failed runs (logs in \`$raw\`):"
        for f in "${failed_runs[@]}"; do echo "- $f"; done
    fi
} | tee "$out"
echo "# table: $out; raw runs: $raw" >&2
if [ $status -ne 0 ] || awk -F, "$bench_awk_header"'
        NR == 1 { header("shm_time wrong"); next }
        $c["wrong"] > 0 || $c["shm_time"] == "" { bad = 1 }
        END { exit !bad }' "$joined"; then
    echo "# compare_backends: some runs failed or counted wrong elements (see the table and $raw)" >&2
    exit 1
fi
exit 0
