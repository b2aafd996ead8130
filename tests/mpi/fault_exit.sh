#!/usr/bin/env bash
# A faulted mpi job ends, whole and on time: runs tests/mpi/test_mpi_exit.c
# under mpirun with one rank stopped (SIGSTOP) or killed (SIGKILL) and checks
# that mpirun returns (non-zero: the job failed) within TIMEOUT + 10 s of the
# fault, that every surviving rank passed its own checks (stop), or that the
# timeout called MPI_Abort (stop with TP_MPI_ABORT_ON_FAILURE=1), and that no
# process of the job is left. `cut`: nobody faults by itself; once every rank
# runs, the script runs $FAULT_CMD (scripts/multihost-check.sh: the link
# between its two hosts goes down) and every rank must time out and exit.
#   fault_exit.sh MPIRUN EXE stop|kill|abort|cut NP TIMEOUT [mpirun options...]
set -u
mpirun=$1 exe=$2 mode=$3 np=$4 limit=$5
shift 5
pass=0 fail=0
check() { # check COND-STATUS MESSAGE
    if [ "$1" = 0 ]; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: $2" >&2; fi
}
out=$(mktemp) err=$(mktemp)
trap 'rm -f "$out" "$err"' EXIT
arg=$mode
if [ "$mode" = abort ]; then arg=stop; export TP_MPI_ABORT_ON_FAILURE=1; fi
# the outer limit: far above TIMEOUT + 10 s, so that a hang shows as 124
# (137 is also what mpirun returns for a rank killed by SIGKILL: the time
# tells them apart)
outer=$((limit + 60))
start=$(date +%s)
timeout -k 5 $outer "$mpirun" --allow-run-as-root --oversubscribe "$@" -np "$np" \
    "$exe" "$arg" "$limit" >"$out" 2>"$err" &
job=$!
if [ "$mode" = cut ]; then
    # every rank runs its loop (printed its pid), then the fault
    for _ in $(seq 300); do
        [ "$(grep -c '^pid ' "$out")" -ge "$np" ] && break
        sleep 0.1
    done
    sleep 1
    echo "fault_at $(date +%s.%N)" >>"$out"
    sh -c "${FAULT_CMD:?cut needs FAULT_CMD}"
fi
wait $job
rc=$?
end=$(date +%s.%N)
cat "$out"
sed -n 1,40p "$err" >&2
fault=$(awk '$1 == "fault_at" {print $2}' "$out")
check "$([ -n "$fault" ]; echo $?)" "rank 1 did not report its fault"
check "$([ "$rc" != 124 ] && [ $(($(date +%s) - start)) -lt $outer ]; echo $?)" \
    "mpirun hung (killed by the outer limit of $outer s)"
check "$([ "$rc" != 0 ]; echo $?)" "mpirun returned 0 for a job with a faulted rank"
if [ -n "$fault" ]; then
    took=$(awk -v a="$fault" -v b="$end" 'BEGIN {printf "%.2f", b - a}')
    echo "job ended $took s after the fault (timeout $limit s)"
    check "$(awk -v t="$took" -v l="$limit" 'BEGIN {exit !(t <= l + 10)}'; echo $?)" \
        "job ended $took s after the fault, limit $limit + 10 s"
fi
case $mode in
cut)
    # no rank failed a check of its own: mpirun's runtime (with a short TCP
    # keepalive) may end the job on the lost daemon before the ranks time out
    check "$(! grep -q '^\[rank [0-9]*\] FAIL' "$err"; echo $?)" "a rank failed its checks"
    ;;
stop)
    # every rank but the stopped one passed its checks
    ok=$(grep -c '^mpi: [0-9]* passed, 0 failed' "$out")
    check "$([ "$ok" = $((np - 1)) ]; echo $?)" "$ok of $((np - 1)) surviving ranks passed"
    ;;
abort)
    check "$(grep -q 'TP_MPI_ABORT_ON_FAILURE=1: calling MPI_Abort' "$err"; echo $?)" \
        "no MPI_Abort after the timeout"
    ;;
esac
# no process of the job is left (a zombie is not a process left running) by
# timeout + 10 s after the fault: a rank on the far side of a cut link learns
# of the fault only from its own timeout, after mpirun has returned
deadline=$(awk -v f="$fault" -v l="$limit" 'BEGIN { printf "%.3f", f + l + 10 }')
npids=0
for pid in $(awk '$1 == "pid" {print $3}' "$out"); do
    npids=$((npids + 1))
    state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null || true)
    while [ -n "$state" ] && [ "$state" != Z ] &&
        awk -v d="$deadline" -v n="$(date +%s.%N)" 'BEGIN { exit !(n < d) }'; do
        sleep 0.2
        state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null || true)
    done
    check "$([ -z "$state" ] || [ "$state" = Z ]; echo $?)" "rank process $pid left (state $state)"
done
check "$([ "$npids" = "$np" ]; echo $?)" "$npids of $np ranks reported their pid"
echo "mpi: $pass passed, $fail failed"
[ "$fail" = 0 ]
