#!/usr/bin/env python3
"""The GPU check's reading of Nsight Compute's per-kernel summary
(scripts/gpu_check.py: ncu_kernels, kernel_name, write_ncu_summary), held to
a real one: tests/fixtures/ncu-mlp-h200.txt, `ncu --metrics
gpu__time_duration.sum --print-summary per-kernel` of one bf16 TP MLP pass
on an H200. Needs no GPU.

    gpu_check_ncu.py SCRIPTS_DIR FIXTURE
"""
import io
import sys

sys.path.insert(0, sys.argv[1])
import gpu_check as g  # noqa: E402

fails = 0


def check(cond, what):
    global fails
    if not cond:
        print("FAIL:", what)
        fails += 1


rows = g.ncu_kernels(open(sys.argv[2]).read())
by = {n: (c, t) for n, c, t in rows}
check(len(rows) == 13, f"13 kernels after merging launches of one name, got {len(rows)}: {rows}")
check(rows[0][0] == "nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN", f"largest first: {rows[0]}")
check([t for _, _, t in rows] == sorted((t for _, _, t in rows), reverse=True), "sorted by total")
# two launches of one name (different grids) merge: 2 x 30.98 avg in the file
c, t = by.get("k_colsum_part<__nv_bfloat16, 0>", (0, 0))
check(c == 2 and abs(t - 61.96) < 1e-6, f"k_colsum_part: {c} launches, {t} us")
c, t = by.get("k_convert<B16, float>", (0, 0))
check(c == 4 and abs(t - (2.62 + 3.42 + 2 * 124.16)) < 1e-6, f"k_convert merged: {c}, {t}")
gemm = sum(t for n, _, t in rows if g.is_gemm_kernel(n))
check(abs(gemm - (2 * 416.22 + 419.04 + 463.46 + 437.95)) < 1e-6, f"GEMM total {gemm}")
check(not g.is_gemm_kernel("k_gelu_fwd_vec<__nv_bfloat16>"), "GELU is not a GEMM")

# names: return type, anonymous namespace and parameter list dropped,
# template arguments (with their own parentheses-free commas) kept
check(g.kernel_name("void <unnamed>::k_colsum<__nv_bfloat16, 0>(const T1 *, long, double)")
      == "k_colsum<__nv_bfloat16, 0>", "kernel_name with template arguments")
check(g.kernel_name("void (anonymous namespace)::k_fill<float>(T1 *, float, long)")
      == "k_fill<float>", "kernel_name, the other spelling of the anonymous namespace")
check(g.kernel_name("nvjet_sm90_tst_128x256") == "nvjet_sm90_tst_128x256", "a plain name")

# units: ms and ns scale to us; a metric with no kernel line before it is ignored
text = ("    gpu__time_duration.sum          us    1.00    1.00    1.00\n"
        "  k_a (1, 1, 1)x(32, 1, 1), Device 0, CC 9.0, Invocations 3\n"
        "    gpu__time_duration.sum          ms    6.43    6.43    6.43\n"
        "  k_b (1, 1, 1)x(32, 1, 1), Device 0, CC 9.0, Invocations 1\n"
        "    gpu__time_duration.sum          ns  500.00  500.00  500.00\n")
r = {n: t for n, _, t in g.ncu_kernels(text)}
check(abs(r.get("k_a", 0) - 3 * 6430) < 1e-6 and abs(r.get("k_b", 0) - 0.5) < 1e-9, f"units: {r}")

f = io.StringIO()
g.write_ncu_summary(f, "kernels", rows)
out = f.getvalue()
check("GEMMs (cuBLAS) 2152.9 us (75.9%)" in out, "the summary's GEMM line: " + out[:300])
check(out.count("\n| `") == 13, "one table row per kernel")
f = io.StringIO()
g.write_ncu_summary(f, "kernels", [])
check(f.getvalue() == "", "no rows: no section")

print("gpu_check_ncu: all checks passed" if not fails else f"gpu_check_ncu: {fails} failed")
sys.exit(1 if fails else 0)
