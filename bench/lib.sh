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
