#!/usr/bin/env bash
# load_llm.sh - tp_llm_load of a sharded Hugging Face checkpoint against the
# disk's read rate, and each rank's peak memory against its shard.
#
# Writes the model of -c (default 1b: hidden 1536, 8 layers, intermediate
# 4096, 12 heads, 4 kv heads, vocab 32000; 300M parameters, 1.12 GiB in f32)
# as a checkpoint in shards of at most -s bytes (default 256 MiB) under -d
# (default /tmp/tp-bench-llm-<config>; never the repository), with
# tp-bench-llm --save, then times its loading at tp -t (default 4):
#   shm   tp-bench-llm --load DIR --tp T: ranks as threads of one process
#         (its memory is the ranks' sum)
#   mpi   mpirun -np T tp-bench-llm --load DIR --tp T --backend mpi: one
#         process per rank, so each rank's peak is its own (skipped without
#         mpirun)
# Each: -r repetitions of [page cache dropped, plain read() of the files,
# cache dropped, tp_llm_load; read() again, tp_llm_load again (warm)]. The
# cache is dropped with /proc/sys/vm/drop_caches where the user may (root),
# else with posix_fadvise(DONTNEED) per file; tp-bench-llm says which.
# The checkpoint is removed afterwards unless -k.
#
# usage: bench/load_llm.sh [-b BUILD] [-c CONFIG] [-d DIR] [-s BYTES] [-t TP]
#                          [-r REPS] [-k] [-o OUT]
#   -b BUILD   build directory with bench/tp-bench-llm (default build)
#   -c CONFIG  100m, 1b, tiny or a config.json (default 1b)
#   -d DIR     where the checkpoint goes (default /tmp/tp-bench-llm-CONFIG);
#              an existing checkpoint there is reused
#   -s BYTES   largest shard (default 268435456)
#   -t TP      ranks (default 4); -r REPS repetitions (default 3)
#   -k         keep the checkpoint
#   -o OUT     the report (default bench/results/load_llm-<date>.txt)
#   -h, --help this text
# Exit status: 0 done; 1 a run failed; 64 bad usage.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
build=build config=1b dir="" shard=268435456 tp=4 reps=3 keep=0 out=""
# shellcheck source=bench/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
bench_name=load_llm
bench_usage="bench/load_llm.sh [-b BUILD] [-c CONFIG] [-d DIR] [-s BYTES] [-t TP] [-r REPS] [-k] [-o OUT]"
while getopts ":b:c:d:s:t:r:ko:h-:" opt; do
    case $opt in
    b) build=$OPTARG ;;
    c) config=$OPTARG ;;
    d) dir=$OPTARG ;;
    s) shard=$OPTARG ;;
    t) tp=$OPTARG ;;
    r) reps=$OPTARG ;;
    k) keep=1 ;;
    o) out=$OPTARG ;;
    *) bench_getopt "$opt" ;;
    esac
done
shift $((OPTIND - 1))
[ $# -eq 0 ] || bench_bad "unexpected argument '$1'"
for v in "$shard" "$tp" "$reps"; do [[ $v =~ ^[1-9][0-9]*$ ]] || bench_bad "'$v' is not a positive integer"; done
case $build in /*) ;; *) build=$repo/$build ;; esac
[ -n "$dir" ] || dir=/tmp/tp-bench-llm-$(basename "$config" .json)
case $(cd "$(dirname "$dir")" 2>/dev/null && pwd)/ in
"$repo"/*) bench_bad "-d $dir is inside the repository: write the checkpoint elsewhere" ;;
esac
bench=$build/bench/tp-bench-llm
if [ ! -x "$bench" ]; then
    ninja -C "$build" bench/tp-bench-llm >/dev/null || { echo "load_llm: cannot build $bench" >&2; exit 1; }
fi
[ -n "$out" ] || out=$repo/bench/results/load_llm-$(date +%Y%m%d-%H%M%S).txt
mkdir -p "$(dirname "$out")"

if [ ! -f "$dir/model.safetensors.index.json" ] && [ ! -f "$dir/model.safetensors" ]; then
    echo "# load_llm: writing the $config checkpoint to $dir" >&2
    "$bench" --save "$dir" --config "$config" --max-shard-bytes "$shard" >&2
fi
[ $keep -eq 1 ] || trap 'rm -rf "$dir"' EXIT
# the report, in a subshell (it is piped to tee): its exit status is the runs'
report() {
    local status=0
    echo "# load_llm ($(date -u +%Y-%m-%d)): $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores, $(free -g | awk '/^Mem:/ { print $2 }') GiB;"
    echo "# $dir on $(df -P "$dir" | awk 'NR == 2 { print $1 }'); load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo
    echo "\$ tp-bench-llm --load $dir --tp $tp -r $reps"
    "$bench" --load "$dir" --tp "$tp" -r "$reps" || status=1
    if command -v mpirun >/dev/null; then
        echo
        echo "\$ mpirun -np $tp tp-bench-llm --load $dir --tp $tp -r $reps --backend mpi"
        OMPI_MCA_btl_vader_single_copy_mechanism=none mpirun --allow-run-as-root --oversubscribe -np "$tp" \
            "$bench" --load "$dir" --tp "$tp" -r "$reps" --backend mpi || status=1
    else
        echo "# no mpirun: the per-rank figures are skipped"
    fi
    echo
    echo "# load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
    return $status
}
report 2>&1 | tee "$out"
