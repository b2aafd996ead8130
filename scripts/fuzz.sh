#!/usr/bin/env bash
# Fuzzes what a Hugging Face model directory feeds libtp (tests/fuzz/fuzz_llm.c:
# config.json, safetensors headers, model.safetensors.index.json) with
# libFuzzer under AddressSanitizer (leak detection on) and UBSan, one target
# at a time, and prints each target's executions, time and coverage.
#
#   scripts/fuzz.sh [--runs N] [--max-time S] [--targets LIST] [--build DIR]
#                   [--build-only] [-- LIBFUZZER_ARGS...]
#
#   --runs N        executions per target (default 100000)
#   --max-time S    time limit per target in seconds (default 1200)
#   --targets LIST  comma-separated, of config, header, index (default: all three)
#   --build DIR     the clang build of libtp (default: build-fuzz); configured
#                   here when missing: static, ASan + UBSan, libFuzzer's
#                   coverage (-fsanitize=fuzzer-no-link), no CUDA, NCCL or MPI
#   --build-only    build DIR/fuzz_llm and stop
#
# Needs clang and libFuzzer (Debian: apt-get install clang libclang-rt-14-dev).
# Each target grows its corpus in DIR/fuzz-corpus/TARGET from the seeds in
# tests/fuzz/corpus/TARGET; a crash, leak or broken contract leaves its input
# in DIR/fuzz-artifacts/TARGET/ and the log in DIR/fuzz-TARGET.log. Copy a
# reproducer into tests/fuzz/regress/ so that the meson test fuzz_llm_replay
# keeps replaying it. Exit status: 0 when every target ran clean, 1 otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."

runs=100000 max_time=1200 targets=config,header,index build=build-fuzz build_only=0
while [ $# -gt 0 ]; do
    case $1 in
    --runs) runs=$2; shift 2 ;;
    --max-time) max_time=$2; shift 2 ;;
    --targets) targets=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    --build-only) build_only=1; shift ;;
    --) shift; break ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "fuzz: unknown option $1 (see --help)" >&2; exit 64 ;;
    esac
done

cc=${CC:-clang}
if ! command -v "$cc" >/dev/null; then
    echo "fuzz: $cc not found (Debian: apt-get install clang libclang-rt-14-dev)" >&2
    exit 2
fi
# fail fast when libFuzzer's runtime is missing
if ! echo 'int LLVMFuzzerTestOneInput(const char *d, long n) { return 0; }' |
    "$cc" -x c -fsanitize=fuzzer,address -o /dev/null - 2>/dev/null; then
    echo "fuzz: $cc cannot link -fsanitize=fuzzer (Debian: apt-get install libclang-rt-14-dev)" >&2
    exit 2
fi

sanitize_args="-fsanitize=fuzzer-no-link -fno-sanitize-recover=all -fno-omit-frame-pointer -g"
if [ ! -f "$build/build.ninja" ]; then
    CC=$cc meson setup "$build" \
        -Dbuildtype=debugoptimized -Ddefault_library=static \
        -Dcuda=disabled -Dnccl=disabled -Dmpi=disabled -Dtests=disabled -Dbench=false \
        -Db_sanitize=address,undefined -Db_lundef=false \
        -Dc_args="$sanitize_args"
fi
ninja -C "$build" libtp.a

# shellcheck disable=SC2046
"$cc" -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
    -fno-omit-frame-pointer -D_GNU_SOURCE -Iinclude -I"$build/include" \
    tests/fuzz/fuzz_llm.c "$build/libtp.a" \
    $(pkg-config --libs jansson) \
    $(pkg-config --libs openblas 2>/dev/null || echo -lopenblas) -lm -lpthread \
    -o "$build/fuzz_llm"
echo "fuzz: built $build/fuzz_llm"
[ "$build_only" = 1 ] && exit 0

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:symbolize=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
# tp_llm_forward of the config target's small models: one BLAS thread
export OPENBLAS_NUM_THREADS=1

rc=0
summary=()
IFS=, read -ra list <<<"$targets"
for t in "${list[@]}"; do
    case $t in config | header | index) ;; *) echo "fuzz: unknown target $t" >&2; exit 64 ;; esac
    work="$build/fuzz-corpus/$t" art="$build/fuzz-artifacts/$t" log="$build/fuzz-$t.log"
    mkdir -p "$work" "$art"
    echo "fuzz: target $t: $runs runs, at most ${max_time}s (log: $log)"
    start=$(date +%s)
    set +e
    FUZZ_LLM_MODE=$t "$build/fuzz_llm" -runs="$runs" -max_total_time="$max_time" \
        -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        -dict=tests/fuzz/fuzz_llm.dict -artifact_prefix="$art/" "$@" \
        "$work" "tests/fuzz/corpus/$t" >"$log" 2>&1
    status=$?
    set -e
    secs=$(($(date +%s) - start))
    done_line=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -1 || true)
    [ -n "$done_line" ] || done_line=$(grep -E '^#[0-9]+[[:space:]]' "$log" | tail -1 || true)
    execs=$(grep -E '^stat::number_of_executed_units:' "$log" | awk '{print $2}' || true)
    cov=$(echo "$done_line" | grep -oE 'cov: [0-9]+' | awk '{print $2}' || true)
    ft=$(echo "$done_line" | grep -oE 'ft: [0-9]+' | awk '{print $2}' || true)
    corp=$(echo "$done_line" | grep -oE 'corp: [0-9]+/[0-9]+[a-zA-Z]*' | awk '{print $2}' || true)
    if [ "$status" -ne 0 ]; then
        rc=1
        echo "fuzz: target $t FAILED (exit $status); inputs in $art/:" >&2
        grep -E 'ERROR|SUMMARY|fuzz_llm:|runtime error' "$log" | head -20 >&2 || true
    fi
    summary+=("$(printf '%-7s %10s %6ss %6s %7s %12s %s' "$t" "${execs:-?}" "$secs" "${cov:-?}" \
        "${ft:-?}" "${corp:-?}" "$([ "$status" -eq 0 ] && echo ok || echo FAILED)")")
done

printf '%-7s %10s %7s %6s %7s %12s %s\n' target execs time cov ft corpus result
printf '%s\n' "${summary[@]}"
exit $rc
