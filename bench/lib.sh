# shellcheck shell=bash disable=SC2034
# bench/lib.sh - what the bench/ scripts share; sourced by them, not run.
#
# bench_help         the calling script's header comment (line 2 up to its
#                    `set -euo` line, less the "# ") on stdout; exit 0
# bench_bad MESSAGE  "NAME: MESSAGE" and "usage: USAGE" on stderr; exit 64
#                    (NAME and USAGE: the script's $bench_name, $bench_usage)
# bench_getopt OPT   the getopts cases every script shares, for an optstring
#                    that starts with ':' and ends with "h-:": -h and --help,
#                    unknown options, a missing value; use as the last case:
#                    *) bench_getopt "$opt" ;;
# bench_transformers sets py (a python with torch and transformers: $TORCH_PYTHON,
#                    else /root/hfenv/bin/python if present, else python3) and
#                    versions ("PyTorch X + transformers Y"); without them says
#                    "NAME: SKIP: ..." and exits 0
# bench_llm_bin BUILD sets bench to BUILD/bench/tp-bench-llm, building it when
#                    missing (exit 1 when that fails)
# bench_awk_header   awk source of header(NAMES): maps the header row's names
#                    to column numbers in c[] (c["size_bytes"] = 9), so CSVs
#                    are read by name and a column added or moved changes
#                    nothing; a name in NAMES the row lacks stops awk (exit 2)
#                    naming the file and the column. Use:
#                    awk -F, "$bench_awk_header"' FNR == 1 { header("a b"); next } { print $c["a"] }'

bench_help() {
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 0
}

bench_bad() {
    echo "${bench_name:-$(basename "$0")}: $*" >&2
    [ -z "${bench_usage:-}" ] || echo "usage: $bench_usage (-h: help)" >&2
    exit 64
}

bench_getopt() {
    case $1 in
    h) bench_help ;;
    -) [ "$OPTARG" = help ] && bench_help; bench_bad "unknown option --$OPTARG" ;;
    :) bench_bad "option -$OPTARG needs a value" ;;
    *) bench_bad "unknown option -$OPTARG" ;;
    esac
}

bench_transformers() {
    py=${TORCH_PYTHON:-}
    if [ -z "$py" ]; then
        if [ -x /root/hfenv/bin/python ]; then py=/root/hfenv/bin/python; else py=python3; fi
    fi
    if ! "$py" -c "import torch, transformers" 2>/dev/null; then
        echo "$bench_name: SKIP: no torch with transformers for '$py' (set TORCH_PYTHON to a python that has them)"
        exit 0
    fi
    versions=$("$py" -c "import torch, transformers; print('PyTorch', torch.__version__, '+ transformers', transformers.__version__)")
}

bench_llm_bin() {
    bench=$1/bench/tp-bench-llm
    if [ ! -x "$bench" ]; then
        ninja -C "$1" bench/tp-bench-llm >/dev/null || { echo "$bench_name: cannot build $bench" >&2; exit 1; }
    fi
}

# shellcheck disable=SC2016
bench_awk_header='
function header(need,    i, n, k, a) {
    delete c
    for (i = 1; i <= NF; i++) { gsub(/^[ \r]+|[ \r]+$/, "", $i); c[$i] = i }
    n = split(need, a, " ")
    for (k = 1; k <= n; k++)
        if (!(a[k] in c)) {
            printf "%s has no column %s (the CSV header row names its columns)\n", FILENAME, a[k] > "/dev/stderr"
            exit 2
        }
}'
