#!/usr/bin/env bash
# Builds and runs the consumer program (tests/consumer/consumer.c: a 2-rank shm
# all_reduce and a colwise Linear, checked against one rank) the four ways a
# project can consume libtp, as root on a Debian machine:
#   pkgconfig  a default install (meson setup with no options: prefix
#              /usr/local), the program built with `pkg-config --cflags --libs
#              libtp` and run, both with NO environment variables
#   cmake      the same install, the program built with find_package(libtp
#              CONFIG) and libtp::libtp (tests/consumer/CMakeLists.txt)
#   meson      libtp as a Meson subproject of the program
#              (tests/consumer/meson.build, --force-fallback-for=libtp)
#   deb        dpkg-buildpackage -b -us -uc (the nocheck option and profile: the
#              suite has run on the same source before), lintian with no
#              errors, the packages installed, the program built through
#              pkg-config and CMake against them, tp-bench-comm run (a
#              2-rank all_reduce with its result check)
# Each path leaves the system as it found it: it uninstalls (or purges the
# packages it installed, with what apt pulled in for them), removes the
# directories the install created and its temporary directory, and checks
# that nothing of libtp is left for the loader, pkg-config or CMake.
# The tools it needs (cmake, dpkg-dev, debhelper, lintian, ... and libtp's
# build dependencies) are installed with apt-get when missing and stay; the
# Debian ones only before the deb path, so the default install is made as on a
# machine without dpkg-dev when it had none.
#
# Usage: scripts/consumer-check.sh [PATH...]   (default: all four)
# Prints a summary line per path with its time; exit status 0 when every
# path passed, 1 otherwise. Nothing is written in the source tree.
# shellcheck disable=SC2317  # the path_* functions are called as "path_$p"
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=$PWD
PATHS=("$@")
[ ${#PATHS[@]} -gt 0 ] || PATHS=(pkgconfig cmake meson deb)
export DEBIAN_FRONTEND=noninteractive
# what a login shell of root has: the pkg-config path runs under exactly this
CLEAN_ENV=(env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root)

log() { echo "consumer-check: $*"; }
die() {
    echo "consumer-check: $*" >&2
    exit 1
}

[ "$(id -u)" -eq 0 ] || die "run as root: it installs packages and libtp itself"

# What the default build and the pkgconfig, cmake and meson paths need. The
# Debian tools come only before the deb path, so that the default install is
# made as on a machine without dpkg-dev (where Meson alone would pick lib64).
TOOLS=(gcc libc6-dev meson ninja-build pkg-config cmake python3 libopenblas-dev libjansson-dev)
DEB_TOOLS=(dpkg-dev debhelper lintian)
install_missing() {
    local missing=() p
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' ||
            missing+=("$p")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        log "installing ${missing[*]}"
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
}

# The source tree (tracked and untracked files that git does not ignore, so
# no build directories) copied to $1.
copy_tree() {
    mkdir -p "$1"
    if git -C "$SRC" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
        git -C "$SRC" ls-files -z --cached --others --exclude-standard |
            (cd "$SRC" && tar -c --null -T - 2>/dev/null) | tar -x -C "$1"
    else
        tar -C "$SRC" --exclude='./build*' --exclude=./debian/build -c . | tar -x -C "$1"
    fi
}

# Nothing of libtp left where the loader, pkg-config or CMake look.
check_gone() {
    ldconfig
    if ldconfig -p | grep -q 'libtp\.so'; then
        die "$1: the loader still knows libtp.so"
    fi
    if "${CLEAN_ENV[@]}" pkg-config --exists libtp; then
        die "$1: pkg-config still finds libtp"
    fi
    local left
    left=$(find /usr/include /usr/local/include /usr/lib /usr/local/lib -maxdepth 4 \
        \( -name 'tp.h' -o -name 'libtp.*' -o -name 'libtp' \) 2>/dev/null || true)
    [ -z "$left" ] || die "$1: left behind: $left"
}

# ---- pkgconfig and cmake: a default install from source ---------------------

# Configures and builds libtp with the default options in $WORK/build (tests
# and benchmarks off: neither is installed). Prints the files and directories
# an install would create (those that do not exist yet) to $WORK/created.
build_default() {
    meson setup "$WORK/build" "$SRC" -Dtests=disabled -Dbench=false >"$WORK/setup.log"
    ninja -C "$WORK/build" >"$WORK/build.log"
    log "dpkg-architecture: $(command -v dpkg-architecture || echo absent);" \
        "libtp.so goes to $(meson introspect "$WORK/build" --installed | grep -o '"/[^"]*/libtp.so"')"
    meson introspect "$WORK/build" --installed | python3 -c '
import json, os, sys
new = set()
for dest in json.load(sys.stdin).values():
    p = dest
    while not os.path.lexists(p):
        new.add(p)
        p = os.path.dirname(p)
print("\n".join(sorted(new, key=lambda s: -s.count("/"))))' >"$WORK/created"
}

install_default() {
    meson install -C "$WORK/build" --quiet >"$WORK/install.log"
}

# meson uninstall (which removes the directories it logged as created), then
# whatever of the install is still there (deepest first).
uninstall_default() {
    ninja -C "$WORK/build" uninstall >"$WORK/uninstall.log" 2>&1 || true
    local p
    while read -r p; do
        if [ -d "$p" ] && [ ! -L "$p" ]; then
            rmdir "$p" 2>/dev/null || log "not empty after uninstall: $p"
        elif [ -e "$p" ] || [ -L "$p" ]; then
            rm -f "$p"
            log "still there after uninstall: $p"
        fi
    done <"$WORK/created"
}

path_pkgconfig() {
    install_default
    trap uninstall_default EXIT
    # no PKG_CONFIG_PATH, no LD_LIBRARY_PATH, nothing but a login PATH
    "${CLEAN_ENV[@]}" sh -c "cc -std=c11 -O2 '$SRC/tests/consumer/consumer.c' -o '$WORK/consumer' \
        \$(pkg-config --cflags --libs libtp) -lm"
    "${CLEAN_ENV[@]}" "$WORK/consumer"
    uninstall_default
    trap - EXIT
    check_gone pkgconfig
}

# Builds tests/consumer/CMakeLists.txt in $1 against the installed libtp, runs it.
cmake_consumer() {
    cmake -G Ninja -S "$SRC/tests/consumer" -B "$1" >"$1.log"
    grep 'libtp ' "$1.log"
    cmake --build "$1" >>"$1.log"
    "${CLEAN_ENV[@]}" "$1/consumer"
}

path_cmake() {
    install_default
    trap uninstall_default EXIT
    cmake_consumer "$WORK/cmake"
    uninstall_default
    trap - EXIT
    check_gone cmake
}

# ---- meson: libtp as a subproject ----------------------------------------------

path_meson() {
    local dir="$WORK/meson-consumer"
    mkdir -p "$dir/subprojects"
    cp "$SRC/tests/consumer/consumer.c" "$SRC/tests/consumer/meson.build" "$dir/"
    copy_tree "$dir/subprojects/libtp"
    meson setup "$dir/build" "$dir" --force-fallback-for=libtp >"$dir/setup.log"
    grep -i 'subproject libtp\|Dependency libtp' "$dir/setup.log" || true
    ninja -C "$dir/build" >"$dir/build.log"
    "$dir/build/consumer"
}

# ---- deb: the Debian packages ---------------------------------------------------

purge_debs() {
    local added
    added=$(comm -13 "$WORK/dpkg-before" <(dpkg-query -W -f='${Package}\n' | sort))
    # shellcheck disable=SC2086
    [ -z "$added" ] || apt-get purge -y -qq $added >/dev/null
}

path_deb() {
    local dir="$WORK/deb"
    install_missing "${DEB_TOOLS[@]}"
    # libtp's build dependencies, as debian/control lists them
    apt-get build-dep -y -qq -P nocheck "$SRC" >/dev/null
    copy_tree "$dir/libtp"
    (cd "$dir/libtp" && DEB_BUILD_OPTIONS=nocheck dpkg-buildpackage -b -us -uc -Pnocheck) \
        >"$dir/build.log" 2>&1 || {
        tail -40 "$dir/build.log"
        return 1
    }
    # the symbols file: a symbol gone fails the build; new ones show here
    grep -A30 'dpkg-gensymbols: warning' "$dir/build.log" || true
    # (lintian leaves temporary directories in $TMPDIR: keep them in $WORK)
    mkdir -p "$dir/tmp"
    TMPDIR="$dir/tmp" lintian --fail-on error "$dir"/libtp_*.changes
    dpkg-query -W -f='${Package}\n' | sort >"$WORK/dpkg-before"
    trap purge_debs EXIT
    apt-get install -y -qq "$dir"/libtp0_*.deb "$dir"/libtp-dev_*.deb \
        "$dir"/libtp-tools_*.deb >/dev/null
    "${CLEAN_ENV[@]}" sh -c "cc -std=c11 -O2 '$SRC/tests/consumer/consumer.c' -o '$dir/consumer' \
        \$(pkg-config --cflags --libs libtp) -lm"
    "${CLEAN_ENV[@]}" "$dir/consumer"
    cmake_consumer "$dir/cmake"
    "${CLEAN_ENV[@]}" tp-bench-comm -g 2 -b 4K -e 4K -n 2 -w 1 -R 1 -c 1 --roof-bytes 0 \
        --collective all_reduce 2>/dev/null | grep -E '^#   all_reduce +OK'
    purge_debs
    trap - EXIT
    check_gone deb
}

# ---- the paths, one after the other ------------------------------------------------

install_missing "${TOOLS[@]}"
WORK=$(mktemp -d /tmp/libtp-consumer.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
summary=()
failed=0
built=0
for p in "${PATHS[@]}"; do
    case $p in
    pkgconfig | cmake | meson | deb) ;;
    *) die "unknown path '$p' (pkgconfig, cmake, meson, deb)" ;;
    esac
    if [ $built -eq 0 ] && { [ "$p" = pkgconfig ] || [ "$p" = cmake ]; }; then
        log "building libtp with the default options"
        start=$SECONDS
        build_default
        summary+=("$(printf '%-10s %ds (configure and build for pkgconfig and cmake)' build \
            $((SECONDS - start)))")
        built=1
    fi
    log "== $p"
    start=$SECONDS
    set +e
    (
        set -e
        "path_$p"
    )
    rc=$?
    set -e
    if [ $rc -eq 0 ]; then
        summary+=("$(printf '%-10s passed (%ds)' "$p" $((SECONDS - start)))")
    else
        summary+=("$(printf '%-10s FAILED (%ds)' "$p" $((SECONDS - start)))")
        failed=1
    fi
done
echo "== consumer-check summary ($SECONDS s in all)"
printf '%s\n' "${summary[@]}"
exit $failed
