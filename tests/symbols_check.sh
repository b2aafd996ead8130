#!/usr/bin/env bash
# The library's exported tp_ symbols are exactly those of
# debian/libtp0.symbols, so that an ABI change (a symbol added or gone)
# shows in the test suite, not first in a Debian build. On a mismatch it
# names each symbol and says how to update the file.
#   tests/symbols_check.sh BUILD/libtp.so SOURCE/debian/libtp0.symbols
set -uo pipefail
lib=$1 file=$2
command -v nm >/dev/null || { echo "symbols_check: no nm, skipped"; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
nm -D --defined-only "$lib" | awk '$2 == "T" && $3 ~ /^tp_/ { print $3 }' | sort -u >"$tmp/lib"
grep -E '^ tp_[A-Za-z0-9_]+@Base ' "$file" | sed 's/^ \([^@]*\)@.*/\1/' | sort -u >"$tmp/file"
[ -s "$tmp/lib" ] || { echo "FAIL: $lib exports no tp_ symbol"; exit 1; }
if ! cmp -s "$tmp/lib" "$tmp/file"; then
    comm -23 "$tmp/lib" "$tmp/file" | sed 's/^/FAIL: exported but not in the symbols file: /'
    comm -13 "$tmp/lib" "$tmp/file" | sed 's/^/FAIL: in the symbols file but not exported: /'
    echo "run scripts/update-symbols.sh after a build to rewrite $file"
    exit 1
fi
echo "symbols: $(wc -l <"$tmp/lib") exported, as $file lists"
