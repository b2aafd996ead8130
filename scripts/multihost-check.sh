#!/usr/bin/env bash
# multihost-check.sh - libtp's mpi engine across two hosts made on this one:
# two network namespaces joined by a veth pair (addresses inside those
# namespaces only), mpirun started in the first with an rsh agent that runs
# the remote daemon in the second (`ip netns exec`), TCP forced (btl tcp,self;
# pml ob1). Runs the MPI suites, both examples (TP and DPxTP, with the step
# time on two hosts against one), tp-bench-mpi beside the bare MPI calls, and
# the three faults (a rank killed, a rank stopped, the link cut), then prints
# a summary. Deletes everything it made (trap). Needs root; skips (exit 0) with
# a message where namespaces cannot be made.
#
# usage: scripts/multihost-check.sh
#   -h, --help   this text
# environment:
#   BUILD_DIR=build        meson build directory with libtp built (-Dmpi=enabled)
#   SUITES="mesh ..."      the MPI suites to run at 4 processes (default: all
#                          eleven of tests/meson.build), "" for none
#   LINK="1ms 1gbit"       netem delay and rate of the link for the examples,
#                          the benchmark and the faults ("" for none; needs tc)
#   BENCH_MAX=4M           largest size of the benchmark (64M for the table of
#                          docs/multihost.md: ~15 minutes over a 1 Gbit link)
#   BENCH_REPS=3           its repetitions
#   BENCH_ARGS=""          more tp-bench-mpi options (e.g. "--collective
#                          all_reduce -b 128K", "--self" for its A/A run)
#   FAULT_TIMEOUT=5        TP_COMM timeout of the fault cases (seconds)
#   TCP_PUT=0              1 keeps OpenMPI's TCP "put" protocol for large
#                          messages (its default; docs/multihost.md,
#                          "Transports": it halves a large two-way exchange)
# Exit status: 0 every step passed (or skipped: no namespaces); 1 a step
# failed; 2 setup error; 64 bad usage.
set -uo pipefail
case ${1:-} in
-h | --help)
    sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 0
    ;;
"") ;;
*)
    echo "multihost-check.sh: unknown argument $1" >&2
    exit 64
    ;;
esac
repo=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-build}
case $build in /*) ;; *) build=$repo/$build ;; esac
suites=${SUITES-mesh dtensor ops_linear ops_elementwise ops_view ops_reduce ops_loss ops_attention nn styles dp}
link=${LINK-1ms 1gbit}
bench_max=${BENCH_MAX:-4M}
bench_reps=${BENCH_REPS:-3}
read -r -a bench_args <<<"${BENCH_ARGS:-}"
fault_timeout=${FAULT_TIMEOUT:-5}
# OpenMPI's TCP transport sends the rest of a large message as one emulated
# RDMA put, which holds the connection until it is through: the other
# direction's handshake waits behind it (docs/multihost.md, "Transports")
tcp_flags="--mca btl_tcp_flags send,inplace,need-ack,need-csum"
[ "${TCP_PUT:-0}" = 1 ] && tcp_flags=

skip() {
    echo "multihost-check: SKIP: $*"
    exit 0
}
die() {
    echo "multihost-check: $*" >&2
    exit 2
}
[ "$(id -u)" = 0 ] || skip "needs root to make network namespaces"
command -v ip >/dev/null || skip "no ip (iproute2)"
command -v mpirun >/dev/null || skip "no mpirun"
for exe in tests/test_mpi_comm tests/test_mpi_exit bench/tp-bench-mpi examples/tp-example-mlp \
    examples/tp-example-transformer; do
    [ -x "$build/$exe" ] || die "no $build/$exe: build with -Dmpi=enabled first"
done

# ---- two hosts -------------------------------------------------------------
tag=tpmh$$
nsa=${tag}a nsb=${tag}b va=${tag}a0 vb=${tag}b0
hosta=10.251.0.1 hostb=10.251.0.2
tmp=$(mktemp -d)
cleanup() {
    for ns in "$nsa" "$nsb"; do
        pids=$(ip netns pids "$ns" 2>/dev/null)
        [ -n "$pids" ] && kill -9 $pids 2>/dev/null
        ip netns del "$ns" 2>/dev/null
    done
    ip link del "$va" 2>/dev/null
    rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
ip netns add "$nsa" 2>/dev/null || skip "cannot create a network namespace (ip netns add)"
ip netns add "$nsb" || skip "cannot create a second network namespace"
ip link add "$va" type veth peer name "$vb" || skip "cannot create a veth pair"
ip link set "$va" netns "$nsa" && ip link set "$vb" netns "$nsb" &&
    ip -n "$nsa" addr add $hosta/24 dev "$va" && ip -n "$nsb" addr add $hostb/24 dev "$vb" &&
    ip -n "$nsa" link set lo up && ip -n "$nsb" link set lo up &&
    ip -n "$nsa" link set "$va" up && ip -n "$nsb" link set "$vb" up ||
    die "could not set up the veth pair"
link_desc=unshaped
shape_link() { # shape_link on|off: netem delay + rate, else tbf rate only
    [ -n "$link" ] && command -v tc >/dev/null || return 0
    set -- "$1" $link
    local p ns dev kind=netem
    for p in "$nsa:$va" "$nsb:$vb"; do
        ns=${p%%:*} dev=${p#*:}
        if [ "$1" = off ]; then
            ip netns exec "$ns" tc qdisc del dev "$dev" root 2>/dev/null
        elif ! ip netns exec "$ns" tc qdisc replace dev "$dev" root netem delay "$2" \
            rate "$3" 2>/dev/null; then
            # no netem in this kernel: the rate alone, with a token bucket
            kind=tbf
            ip netns exec "$ns" tc qdisc replace dev "$dev" root tbf rate "$3" burst 256kb \
                latency 50ms 2>/dev/null || kind=none
        fi
    done
    case $1:$kind in
    on:netem) link_desc="netem: $2 delay, $3 each way" ;;
    on:tbf) link_desc="tbf: $3, no added delay (the kernel has no netem)" ;;
    on:none) link_desc="unshaped (tc could not shape the veth pair)" ;;
    esac
}

# the rsh agent: mpirun calls it as `agent [options] HOST COMMAND...`
cat >"$tmp/rsh" <<EOF
#!/bin/sh
while [ \$# -gt 0 ]; do case \$1 in -*) shift ;; *) break ;; esac; done
host=\$1
shift
case \$host in
$hosta) ns=$nsa ;;
$hostb) ns=$nsb ;;
*) echo "multihost-check rsh: unknown host \$host" >&2; exit 1 ;;
esac
exec ip netns exec "\$ns" /bin/sh -c "\$*"
EOF
printf '%s slots=2\n%s slots=2\n' $hosta $hostb >"$tmp/hosts"
# mpirun in the first host; TCP only; the runtime's own connections probed
# every second, so a cut link ends the job in seconds instead of 5+ minutes
cat >"$tmp/mpirun" <<EOF
#!/bin/sh
exec ip netns exec $nsa mpirun --allow-run-as-root --hostfile $tmp/hosts \\
    --mca plm_rsh_agent $tmp/rsh --mca pml ob1 --mca btl tcp,self $tcp_flags \\
    --mca btl_tcp_if_include 10.251.0.0/24 --mca oob_tcp_if_include 10.251.0.0/24 \\
    --mca oob_tcp_keepalive_time 1 --mca oob_tcp_keepalive_intvl 1 \\
    --mca oob_tcp_keepalive_probes 3 --bind-to none --map-by node "\$@"
EOF
chmod +x "$tmp/rsh" "$tmp/mpirun"
export TP_COMM_TIMEOUT=${TP_COMM_TIMEOUT:-120}
# the one-host run: vader's single-copy (CMA) needs ptrace rights containers lack
export OMPI_MCA_btl_vader_single_copy_mechanism=${OMPI_MCA_btl_vader_single_copy_mechanism:-none}

# ---- steps -----------------------------------------------------------------
summary=()
failed=0
step() { # step NAME LIMIT COMMAND...: runs it, logs to $tmp/NAME.log, records
    local name=$1 limit=$2 t0 rc
    shift 2
    t0=$(date +%s.%N)
    timeout -k 5 "$limit" "$@" >"$tmp/$name.log" 2>&1
    rc=$?
    local took
    took=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    if [ $rc = 0 ]; then
        summary+=("PASS  $name (${took} s)")
    else
        summary+=("FAIL  $name (exit $rc, ${took} s)")
        failed=1
        echo "---- $name failed (exit $rc), last lines:" >&2
        tail -n 20 "$tmp/$name.log" >&2
    fi
    echo "multihost-check: $name: exit $rc, $took s"
}

echo "multihost-check: hosts $hosta ($nsa) and $hostb ($nsb), TCP${tcp_flags:+ without put}"
step mpi_comm_np2 600 "$tmp/mpirun" -np 2 "$build/tests/test_mpi_comm"
step mpi_comm_np4 600 "$tmp/mpirun" -np 4 "$build/tests/test_mpi_comm"
for t in $suites; do
    step "${t}_mpi_np4" 900 "$tmp/mpirun" -np 4 "$build/tests/test_${t}_mpi" --jobs 1
done

shape_link on
echo "multihost-check: link for the examples, the benchmark and the faults: $link_desc"
step example_mlp_np2 600 "$tmp/mpirun" -np 2 "$build/examples/tp-example-mlp" -b mpi -r 2
# 20 Adam steps, so that the steps dominate the wall time compared below
step example_transformer_tp_np4 600 "$tmp/mpirun" -np 4 \
    "$build/examples/tp-example-transformer" -b mpi -r 4 -s 20
step example_transformer_dpxtp_np4 600 "$tmp/mpirun" -np 4 \
    "$build/examples/tp-example-transformer" -b mpi -r 4 -d 2 -s 20
# the same TP run on one host (shared memory)
step example_transformer_tp_np4_1host 600 mpirun --allow-run-as-root --oversubscribe \
    --bind-to none -np 4 "$build/examples/tp-example-transformer" -b mpi -r 4 -s 20
step bench_np2 1800 "$tmp/mpirun" -np 2 "$build/bench/tp-bench-mpi" -b 4K -e "$bench_max" \
    -f 4 -R "$bench_reps" --target-s 0.2 "${bench_args[@]}"

fault=$repo/tests/mpi/fault_exit.sh
for m in kill stop; do
    step "fault_${m}_np2" 300 "$fault" "$tmp/mpirun" "$build/tests/test_mpi_exit" $m 2 \
        "$fault_timeout"
done
export FAULT_CMD="ip -n $nsb link set $vb down"
step fault_cut_np2 300 "$fault" "$tmp/mpirun" "$build/tests/test_mpi_exit" cut 2 "$fault_timeout"
unset FAULT_CMD
shape_link off

# ---- summary ---------------------------------------------------------------
echo
echo "== multihost-check summary"
printf '%s\n' "${summary[@]}"
echo
echo "-- transformer TP, 4 ranks, 20 steps (and each process's 1-rank reference): wall time"
printf '%s\n' "${summary[@]}" | grep example_transformer_tp
echo "-- tp-bench-mpi over the two hosts, link $link_desc (ratio = libtp / the better bare MPI call)"
grep -v '^multihost' "$tmp/bench_np2.log" | grep -E '^(#|[a-z_]+ +[0-9])'
echo "-- faults: when the job ended after the fault"
for m in kill stop cut; do
    printf '%-5s %s\n' "$m" "$(grep -h 'job ended' "$tmp/fault_${m}_np2.log")"
done
exit $failed
