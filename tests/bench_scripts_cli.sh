#!/usr/bin/env bash
# The command line of the bench/ scripts: -h and --help print exactly the
# script's header comment (the lines between the #! line and `set -euo`, less
# their "# ") on stdout and exit 0; an unknown option exits 64 naming it.
# Nothing heavy runs: every script reads its options first.
#   tests/bench_scripts_cli.sh SRC/bench
set -uo pipefail
dir=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

for script in compare_backends.sh compare_gloo.sh compare_mpi.sh compare_torch.sh make_figures.sh \
              plot_comm.sh plot_layers.sh compare_llm.sh load_llm.sh compare_decode.sh \
              compare_fsdp.sh; do
    s=$dir/$script
    [ -f "$s" ] || { fail "$script: not in $dir"; continue; }
    grep -q '^set -euo' "$s" || { fail "$script: no 'set -euo' line ending its header"; continue; }
    awk 'NR == 1 { next } /^set -euo/ { exit } { sub(/^# ?/, ""); print }' "$s" >"$tmp/want"
    [ "$(wc -l <"$tmp/want")" -gt 3 ] || fail "$script: a header of $(wc -l <"$tmp/want") lines"
    for h in -h --help; do
        bash "$s" $h >"$tmp/out" 2>"$tmp/err"
        rc=$?
        [ $rc -eq 0 ] || fail "$script $h exits $rc, not 0"
        cmp -s "$tmp/out" "$tmp/want" ||
            fail "$script $h does not print its header comment: $(diff "$tmp/want" "$tmp/out" | head -n 4 | tr '\n' '|')"
        [ ! -s "$tmp/err" ] || fail "$script $h writes to stderr: $(head -c 200 "$tmp/err")"
    done
    for bad in -Q --frobnicate; do
        bash "$s" $bad >"$tmp/out" 2>"$tmp/err"
        rc=$?
        [ $rc -eq 64 ] || fail "$script $bad exits $rc, not 64"
        grep -q -- "$bad" "$tmp/err" || fail "$script $bad: the message does not name it: $(head -c 200 "$tmp/err")"
    done
done

[ $fails -eq 0 ] && echo "bench_scripts_cli: all checks passed"
exit $((fails > 0))
