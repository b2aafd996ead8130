#!/usr/bin/env bash
# Rewrites debian/libtp0.symbols from a built libtp.so: every exported tp_
# symbol, those already listed keeping their version, new ones at the
# version of debian/changelog's top entry. Run it after adding or removing
# public API (the symbols_file test fails until the file matches).
#   scripts/update-symbols.sh [BUILD_DIR (default build)]
set -euo pipefail
cd "$(dirname "$0")/.."
lib=${1:-build}/libtp.so
file=debian/libtp0.symbols
[ -e "$lib" ] || { echo "update-symbols: no $lib (build first)" >&2; exit 1; }
ver=$(sed -n '1s/^[^(]*(\([^)]*\)).*/\1/p' debian/changelog)
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
{
    sed -n '1,/^\*/p' "$file"
    nm -D --defined-only "$lib" | awk '$2 == "T" && $3 ~ /^tp_/ { print $3 }' | sort -u |
        while read -r sym; do
            old=$(grep -m1 "^ $sym@Base " "$file" | awk '{ print $2 }' || true)
            echo " $sym@Base ${old:-$ver}"
        done
} >"$tmp"
if cmp -s "$tmp" "$file"; then
    echo "update-symbols: $file is up to date"
else
    diff "$file" "$tmp" || true
    cp "$tmp" "$file"
    echo "update-symbols: $file rewritten"
fi
