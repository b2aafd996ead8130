#!/usr/bin/env bash
# The contract of tp-plan on a small model (2 layers, hidden 256): the table
# and its columns, --json that parses and agrees with the table, --trace
# writing a Chrome trace-event file with compute and communication lanes,
# --sweep ranking a constructed case whose best TP degree is known, and bad
# configurations and options exiting 2 with the field or option named.
#   tests/tp_plan_cli.sh BUILD/tools/tp-plan
set -uo pipefail
plan=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }
small=(--layers 2 --hidden 256 --ffn 512 --heads 8 --vocab 1024 --seq 128)

# bad input: exit 2, the problem named on stderr
expect_bad() {
    local want=$1
    shift
    "$plan" "$@" >"$tmp/out" 2>"$tmp/err"
    local rc=$?
    [ $rc -eq 2 ] || fail "'$*' exits $rc, not 2"
    grep -qF -- "$want" "$tmp/err" || fail "'$*': '$want' not in: $(cat "$tmp/err")"
}
expect_bad "layers must be >= 1, got 0" "${small[@]}" --layers 0
expect_bad "hidden must be >= 1, got -256" "${small[@]}" --hidden -256
expect_bad "heads (6) must be divisible by tp (4)" "${small[@]}" --heads 6 --hidden 384 --mesh dp=1,tp=4
expect_bad "hidden (256) must be divisible by heads (3)" "${small[@]}" --heads 3
expect_bad "vocab (1001) must be divisible by tp (8)" "${small[@]}" --vocab 1001
expect_bad "loss parallel needs a vocabulary" "${small[@]}" --vocab 0 --loss-parallel
expect_bad "--bogus: unknown option" "${small[@]}" --bogus 1
expect_bad "--seq: not an integer" "${small[@]}" --seq 12x
expect_bad 'unknown dim "pp"' "${small[@]}" --mesh dp=2,pp=2
expect_bad 'unknown dtype "f64"' "${small[@]}" --dtype f64
expect_bad "h100-sxm-ndr" "${small[@]}" --hw no-such-machine
echo '{"name": "x", "bandwith": 1}' >"$tmp/typo.json"
expect_bad "bandwith" "${small[@]}" --hw "$tmp/typo.json"

echo '{"name": "x", "devices_per_node": 8, "memory_bytes": 0}' >"$tmp/nomem.json"
expect_bad "memory_bytes must be a number > 0" "${small[@]}" --hw "$tmp/nomem.json"
expect_bad '--memory-gib: "-1" is not a number > 0' "${small[@]}" --memory-gib -1

# the memory limit: the hardware's memory_bytes (the preset: nvidia-smi's
# 81559 MiB), --memory-gib over it, 80 GiB for a description without one
"$plan" "${small[@]}" >"$tmp/mem" 2>&1 || fail "the default run exits $?"
grep -qF "fits in 79.65 GiB (h100-sxm-ndr's memory_bytes)" "$tmp/mem" \
    || fail "the limit is not the preset's memory: $(grep memory "$tmp/mem")"
"$plan" "${small[@]}" --hw a100-sxm-hdr --memory-gib 0.0001 >"$tmp/mem" 2>&1 || fail "--memory-gib exits $?"
grep -qF "does NOT fit in 0.00 GiB (--memory-gib)" "$tmp/mem" \
    || fail "--memory-gib does not override: $(grep memory "$tmp/mem")"
"$plan" "${small[@]}" --hw a100-sxm-hdr --json >"$tmp/mem.json" 2>&1 || fail "--json exits $?"
python3 - "$tmp/mem.json" <<'PY' || fail "the JSON limit is not the A100 preset's"
import json, sys
d = json.load(open(sys.argv[1]))
assert d["memory_limit_bytes"] == 81920 * 2**20, d
assert d["memory_limit_from"] == "a100-sxm-hdr's memory_bytes", d
PY

# the table
"$plan" "${small[@]}" --mesh dp=2,tp=4 >"$tmp/table" 2>&1 || fail "the table run exits $?: $(cat "$tmp/table")"
grep -qE '^collective +count +MiB +time_s$' "$tmp/table" || fail "no collective table header"
# SP: 7 gathers per layer, the final norm's and the output's input, and the
# replicated logits [1, 128, 1024] bf16 (0.25 MiB)
grep -qE '^all_gather +17 +1\.250 ' "$tmp/table" || fail "not 17 all_gathers of 1.25 MiB in all (SP, 2 layers)"
grep -qE '^step time [0-9.]+ s = compute [0-9.]+ s \+ exposed communication [0-9.]+ s' "$tmp/table" \
    || fail "no step time line"
grep -qE '^tokens/s [0-9.]+, MFU [0-9.]+%$' "$tmp/table" || fail "no tokens/s and MFU line"
grep -qE '^memory per rank: ' "$tmp/table" || fail "no memory line"

# JSON, the same numbers; the trace file
"$plan" "${small[@]}" --mesh dp=2,tp=4 --loss-parallel --json --trace "$tmp/trace.json" \
    >"$tmp/plan.json" 2>"$tmp/err" || fail "the JSON run exits $?: $(cat "$tmp/err")"
python3 - "$tmp/plan.json" "$tmp/trace.json" <<'PY' || fail "JSON or trace checks failed"
import json, sys
d = json.load(open(sys.argv[1]))
p = d["plan"]
assert d["hardware"] == "h100-sxm-ndr" and d["model"]["layers"] == 2, d
assert p["dp"] == 2 and p["tp"] == 4 and p["sp"] and p["loss_parallel"], p
assert abs(p["step_s"] - (p["compute_s"] + p["exposed_comm_s"])) < 1e-7 * p["step_s"], p
assert 0 < p["exposed_comm_s"] <= p["comm_s"] + 1e-15, p
assert abs(p["tokens_per_s"] - 2 * 128 / p["step_s"]) < 1e-6 * p["tokens_per_s"], p
assert p["collectives"]["all_gather"]["count"] == 16, p
assert p["collectives"]["all_gather"]["bytes"] == 1 << 20, p
t = json.load(open(sys.argv[2]))
ev = [e for e in t["traceEvents"] if e["ph"] == "X"]
lanes = {e["tid"] for e in ev}
assert lanes == {0, 1}, lanes
assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in ev)
n_coll = sum(c["count"] for c in p["collectives"].values())
assert sum(1 for e in ev if e["tid"] == 1) == n_coll, (n_coll, len(ev))
end = max(e["ts"] + e["dur"] for e in ev)
assert abs(end - p["step_s"] * 1e6) < 1e-3 * end, (end, p["step_s"])
PY

# --sweep: 16 ranks, 8 per node, inter-node links a thousand times slower
# than NVLink-class ones: tp 8 keeps every TP collective on a node and has
# the smallest data-parallel all_reduce that still does (tp 16 sends its
# activations across nodes), so it ranks first.
cat >"$tmp/slow.json" <<'HW'
{"name": "slow-inter", "devices_per_node": 8,
 "compute": {"peak_flops": {"bf16": 1e15, "f32": 1e14},
   "gemm_efficiency": [{"min_dim": 0, "efficiency": 0.5}],
   "memory_bandwidth": 3e12, "kernel_latency": 0},
 "links": {"intra_node": {"latency": 1e-6, "bandwidth": 4e11, "algorithm": "ring"},
   "inter_node": {"latency": 1e-5, "bandwidth": 4e8, "algorithm": "ring"}}}
HW
"$plan" "${small[@]}" --hw "$tmp/slow.json" >"$tmp/mem" 2>&1 || fail "the slow.json run exits $?"
grep -qF "fits in 80.00 GiB (default: slow-inter gives no memory_bytes)" "$tmp/mem" \
    || fail "no 80 GiB default: $(grep memory "$tmp/mem")"
"$plan" "${small[@]}" --mesh dp=2,tp=8 --hw "$tmp/slow.json" --sweep --json >"$tmp/sweep.json" \
    2>"$tmp/err" || fail "the sweep exits $?: $(cat "$tmp/err")"
python3 - "$tmp/sweep.json" <<'PY' || fail "sweep checks failed"
import json, sys
s = json.load(open(sys.argv[1]))["sweep"]
assert s[0]["tp"] == 8, [(e["tp"], e["sp"], e["tokens_per_s"]) for e in s]
assert sorted({e["tp"] for e in s}) == [1, 2, 4, 8], s
assert len(s) == 7, len(s)  # tp 1 once, 2, 4 and 8 with and without SP
r = [e["tokens_per_s"] for e in s]
assert r == sorted(r, reverse=True), r
assert all(e["dp"] * e["tp"] == 16 for e in s)
PY
"$plan" "${small[@]}" --mesh dp=2,tp=8 --hw "$tmp/slow.json" --sweep >"$tmp/sweep" 2>&1 \
    || fail "the sweep table exits $?"
grep -qE '^1 +2 +8 ' "$tmp/sweep" || fail "the sweep table does not rank dp 2 x tp 8 first"

if [ $fails -ne 0 ]; then
    cat "$tmp/table" "$tmp/sweep" 2>/dev/null
    exit 1
fi
echo "tp-plan CLI: ok"
