#!/usr/bin/env python3
"""Runs libtp's suite, examples and GPU benchmarks from a build (or an
unpacked scripts/gpu-bundle.sh archive) and writes a report. Called by
scripts/gpu-check.sh, which prepares the build and the library path.

    gpu_check.py --root DIR --tests-json FILE --out DIR [--gpu-only] [--skip-bench]
                 [--budget-s S]

--budget-s S: the whole run must end within S seconds of its start (a lent
GPU machine's command limit, less a margin): each suite's and bench's time
limit is cut to what is left, what cannot start any more is reported as not
run for want of time (not a failure), and the report is rewritten after the
suites and after every bench, so that a run killed from outside still leaves
one. The benches run the newest targets first.

Exit status: 0 when no test failed and no GPU test skipped; 1 otherwise.
"""
import argparse
import csv
import json
import os
import re
import subprocess
import sys
import tarfile
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

SYNTH = re.compile(r"Synthesis: Tested: (\d+) \| Passing: (\d+) \| Failing: (\d+) \| Crashing: (\d+)")
SKIP = re.compile(r"^\[SKIP\] (\S+): (.*)$", re.M)
GPU_SKIP = re.compile(r"no CUDA device|without CUDA|without NCCL")
MPI_LINE = re.compile(r"^mpi: (\d+) passed, (\d+) failed", re.M)
GPU_SUITES = {"cuda", "cuda_kernels", "shm_cuda", "nccl", "replicate", "models", "generate",
              "fsdp"}


# GPU suites whose Criterion tests run several processes at once here (their
# cases hold no timing assertions)
FORKS = {"cuda_dist_nn": 10}


def is_gpu_suite(name):
    """The suites that need a GPU: GPU_SUITES, the cuda_dist* suites, every
    example test on CUDA (example_*cuda*) and the GPU bench checks
    (bench_*gpu*)."""
    return (name in GPU_SUITES or name.startswith("cuda_dist")
            or (name.startswith("example_") and "cuda" in name)
            or (name.startswith("bench_") and "gpu" in name))


def comm_summary(paths):
    """Rows of the comm benches' CSVs (tp-bench-comm --csv) run on a GPU: per
    collective, rank count and size, the out-of-place form where libtp has one
    (broadcast: in place), its busbw, busbw / the device copy's algbw, roof%,
    and libtp / bare NCCL where --nccl-bare ran."""
    rows = []
    for path in paths:
        if not os.path.exists(path):
            continue
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                if r.get("device") != "cuda" or r["inplace"] != r["call_inplace"]:
                    continue  # a CPU run, or a form libtp lacks (timed as the other)
                rows.append(r)
    seen, out = set(), []
    for r in rows:
        key = (r["backend"], r["collective"], r["nranks"], r["size_bytes"], r["dtype"])
        if key in seen:
            continue  # the in-place form of a row whose out-of-place form is listed
        seen.add(key)
        out.append(r)
    return out


NCU_KERNEL = re.compile(r"^  (\S.*?) \(\d+, \d+, \d+\)x\(\d+, \d+, \d+\), Device \d+, "
                        r"CC [\d.]+, Invocations (\d+)\s*$")
NCU_TIME = re.compile(r"^\s+gpu__time_duration\.sum\s+(\w+)\s+([\d.,]+)\s+([\d.,]+)\s+([\d.,]+)\s*$")
NCU_UNIT_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3,
               "msecond": 1e3, "s": 1e6, "second": 1e6}


def kernel_name(full):
    """'void <unnamed>::k_colsum<__nv_bfloat16, 0>(const T1 *, ...)' -> 'k_colsum<__nv_bfloat16, 0>'"""
    n = full[5:] if full.startswith("void ") else full
    n = n.replace("<unnamed>::", "").replace("(anonymous namespace)::", "")
    depth = 0
    for i, ch in enumerate(n):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            n = n[:i]
            break
    return n.strip()


def is_gemm_kernel(name):
    low = name.lower()
    return low.startswith("nvjet") or any(k in low for k in ("gemm", "xmma", "cutlass"))


def ncu_kernels(text):
    """ncu --print-summary per-kernel output with gpu__time_duration.sum ->
    [(kernel, invocations, total us)], launches of one name merged, largest
    total first. The average times the invocations is each entry's total."""
    rows, name, inv = {}, None, 0
    for line in text.splitlines():
        m = NCU_KERNEL.match(line)
        if m:
            name, inv = kernel_name(m.group(1)), int(m.group(2))
            continue
        t = NCU_TIME.match(line)
        if t and name is not None and t.group(1) in NCU_UNIT_US:
            avg_us = float(t.group(4).replace(",", "")) * NCU_UNIT_US[t.group(1)]
            r = rows.setdefault(name, [0, 0.0])
            r[0] += inv
            r[1] += avg_us * inv
            name = None
    return sorted(((n, c, tot) for n, (c, tot) in rows.items()), key=lambda r: -r[2])


def write_ncu_summary(f, title, rows):
    total = sum(r[2] for r in rows)
    if not rows or total <= 0:
        return
    gemm = sum(r[2] for r in rows if is_gemm_kernel(r[0]))
    f.write(f"\n## {title}: device time per kernel (ncu)\n\n"
            f"{total:.1f} us in all: GEMMs (cuBLAS) {gemm:.1f} us ({100 * gemm / total:.1f}%), "
            f"the rest {total - gemm:.1f} us. ncu serializes kernels and fixes clocks, so "
            "totals exceed a timed pass; the shares are the point. The run builds the layer "
            "too: its parameters' conversions (`k_convert`) are set-up, not the pass.\n\n"
            "| kernel | launches | us | share |\n| --- | ---: | ---: | ---: |\n")
    for n, c, tot in rows:
        f.write(f"| `{n}` | {c} | {tot:.1f} | {100 * tot / total:.1f}% |\n")


def fmt_frac(v, scale=1.0, digits=3):
    try:
        return f"{float(v) * scale:.{digits}f}"
    except (TypeError, ValueError):
        return "-"


def write_comm_summary(f, rows):
    if not rows:
        return
    f.write("\n## Collectives on the GPU: summary (from the comm benches' CSVs)\n\n"
            "busbw/copy: busbw over the algbw of a device-to-device cudaMemcpyAsync of the same "
            "bytes; roof%: modelled traffic on the GPU over the copy's (bench/README.md). "
            "Out-of-place form (broadcast: in place).\n\n"
            "| size (B) | collective | backend | ranks | busbw GB/s | busbw/copy | roof% "
            "| libtp/bare (min..max) | #wrong |\n"
            "| ---: | --- | --- | ---: | ---: | ---: | ---: | --- | ---: |\n")
    for r in rows:
        bare = "-"
        if r.get("bare_ratio"):
            bare = (f"{fmt_frac(r['bare_ratio'])} ({fmt_frac(r['bare_ratio_min'])}.."
                    f"{fmt_frac(r['bare_ratio_max'])})")
        f.write(f"| {r['size_bytes']} | {r['collective']} | {r['backend']} | {r['nranks']} | "
                f"{fmt_frac(r['busbw_GBps'], digits=1)} | {fmt_frac(r.get('busbw_over_copy'))} | "
                f"{fmt_frac(r.get('roof_frac'), 100.0, 1)} | {bare} | {r['wrong'] or 'N/A'} |\n")


def run(cmd, log, env=None, timeout=600, cwd=None):
    t0 = time.time()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                               timeout=timeout, cwd=cwd)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            f.write(f"\n[gpu-check] timed out after {timeout} s\n")
            rc = 124
        except OSError as e:
            f.write(f"\n[gpu-check] could not start: {e}\n")
            rc = 127
    with open(log) as f:
        return rc, time.time() - t0, f.read()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True, help="build dir or unpacked bundle")
    ap.add_argument("--tests-json", required=True, help="meson introspect --tests output")
    ap.add_argument("--out", required=True)
    ap.add_argument("--gpu-only", action="store_true", help="only the GPU suites")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--device", default="", help="the GPU, in words, for the report")
    ap.add_argument("--profile-mlp", action="store_true",
                    help="also time every kernel of one bf16 TP MLP pass with Nsight Compute (ncu)")
    ap.add_argument("--suites", default="",
                    help="only these suites (comma-separated names; a trailing * matches a prefix)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2,
                    help="suites run at once (the GPU suites one at a time among them)")
    ap.add_argument("--max-test-seconds", type=float, default=0,
                    help="cap on each suite's time limit (0: the suite's own)")
    ap.add_argument("--budget-s", type=float, default=0,
                    help="end the whole run within this many seconds (0: no limit)")
    a = ap.parse_args()
    a.root = os.path.abspath(a.root)
    t_start = time.time()

    def left():
        """Seconds of the budget left (a large number without one)."""
        return a.budget_s - (time.time() - t_start) if a.budget_s > 0 else 1e9

    os.makedirs(os.path.join(a.out, "logs"), exist_ok=True)
    logs = os.path.join(a.out, "logs")
    with open(a.tests_json) as f:
        tests = json.load(f)
    env = dict(os.environ)
    env.setdefault("TP_COMM_TIMEOUT", "60")

    rows = []
    failed_any = False
    gpu_skipped_total = 0
    # the build recorded its own paths: map them onto this root (the build
    # dir, or the unpacked bundle) and onto this checkout (the sources)
    build_dir = next((os.path.dirname(os.path.dirname(os.path.normpath(t["cmd"][0])))
                      for t in tests if os.path.basename(t["cmd"][0]).startswith("test_")), "")
    src_dir = os.path.dirname(build_dir)

    def remap(c):
        if not c.startswith("/") or not build_dir:
            return c
        n = os.path.normpath(c)
        if n == build_dir:
            return a.root
        if n.startswith(build_dir + "/"):
            return os.path.join(a.root, n[len(build_dir) + 1:])
        if n.startswith(src_dir + "/") and not os.path.exists(n):
            return os.path.join(os.getcwd(), n[len(src_dir) + 1:])
        # normalized: "<build>/../tests/x.sh" does not resolve where the
        # build dir is absent, even when the checkout has the same path
        return n

    def run_one(t):
        """Runs one meson test; returns its report row."""
        name = t["name"]
        cmd = [remap(c) for c in t["cmd"]]
        if name in FORKS and "--jobs" in cmd:
            # hundreds of short GPU tests, one process each: CUDA's start-up
            # per process dominates, so several at once
            cmd[cmd.index("--jobs") + 1] = str(FORKS[name])
        missing = [c for c in cmd if c.startswith("/") and not os.path.exists(c)]
        if missing:
            # mpirun (or a file) that this machine does not have
            return dict(suite=name, status="not run", passed=0, failed=0, skipped=0,
                        gpu_skipped=0, seconds=0.0,
                        note=f"{os.path.basename(missing[0])} not on this machine")
        tenv = dict(env)
        for k, v in (t.get("env") or {}).items():
            if k in ("LD_LIBRARY_PATH", "LD_PRELOAD"):
                # the build's own folders, then this machine's (CUDA's libraries)
                parts = [remap(x) for x in v.replace(" ", ":").split(":") if x]
                if env.get(k):
                    parts.append(env[k])
                tenv[k] = ":".join(parts)
            else:
                tenv[k] = remap(v)
        limit = min(t.get("timeout") or 600, a.max_test_seconds or 600, left() - MARGIN_S)
        if limit < MIN_RUN_S:
            return dict(suite=name, status="not run", passed=0, failed=0, skipped=0,
                        gpu_skipped=0, seconds=0.0, note="the time budget was spent")
        rc, secs, out = run(cmd, os.path.join(logs, f"test-{name}.log"), tenv, timeout=limit,
                            cwd=t.get("workdir") or a.root)
        m = SYNTH.search(out)
        skips = SKIP.findall(out)
        gskips = sum(1 for _, why in skips if GPU_SKIP.search(why))
        mp = MPI_LINE.findall(out)
        if m:
            tested, passing, failing, crashing = map(int, m.groups())
            passed, failed = passing, failing + crashing
        elif mp:
            passed = sum(int(x) for x, _ in mp)
            failed = sum(int(y) for _, y in mp)
        else:
            passed, failed = (1, 0) if rc in (0, 77) else (0, 1)
            if rc == 77:
                skips = [(name, "skipped (exit 77): " + (out.strip().splitlines() or [""])[-1])]
                gskips = 1 if GPU_SKIP.search(skips[0][1]) else 0
                passed = 0
        if rc not in (0, 77) and failed == 0:
            failed = 1
        status = "ok" if failed == 0 and rc in (0, 77) else f"FAIL (rc {rc})"
        row = dict(suite=name, status=status, passed=passed, failed=failed,
                   skipped=len(skips), gpu_skipped=gskips, seconds=round(secs, 1), note="")
        print(f"[gpu-check] {name}: {status}, {passed} passed, {failed} failed, "
              f"{len(skips)} skipped ({gskips} for want of a GPU), {secs:.1f} s", flush=True)
        return row

    # The GPU suites one at a time (their timeouts and timings stay honest),
    # beside the CPU suites on the other cores; serial tests (is_parallel:
    # false) alone at the end.
    wanted = [w for w in a.suites.split(",") if w]

    def picked(name):
        return any(name == w or (w.endswith("*") and name.startswith(w[:-1])) for w in wanted)

    chosen = [t for t in tests if (not a.gpu_only or is_gpu_suite(t["name"]))
              and (not wanted or picked(t["name"]))]
    gpu = [t for t in chosen if is_gpu_suite(t["name"]) and t.get("is_parallel", True)]
    cpu = [t for t in chosen if not is_gpu_suite(t["name"]) and t.get("is_parallel", True)]
    serial = [t for t in chosen if not t.get("is_parallel", True)]
    results = {}
    with ThreadPoolExecutor(max_workers=1) as gpool, \
            ThreadPoolExecutor(max_workers=max(1, a.jobs - 1)) as cpool:
        futs = {gpool.submit(run_one, t): t["name"] for t in gpu}
        futs.update({cpool.submit(run_one, t): t["name"] for t in cpu})
        for f, name in futs.items():
            results[name] = f.result()
    for t in serial:
        results[t["name"]] = run_one(t)
    for t in chosen:
        r = results[t["name"]]
        rows.append(r)
        if r["status"] != "ok" and r["status"] != "not run":
            failed_any = True
        if is_gpu_suite(r["suite"]):
            gpu_skipped_total += r["gpu_skipped"]

    # examples: on the GPU where they take a device option
    ex_rows = []
    for ex in ("tp-example-mlp", "tp-example-transformer"):
        path = os.path.join(a.root, "examples", ex)
        if not os.path.exists(path):
            continue
        if left() - MARGIN_S < MIN_RUN_S:
            ex_rows.append((ex, "", "not run", 0.0, "the time budget was spent"))
            continue
        _, _, helptext = run([path, "--help"], os.path.join(logs, f"{ex}-help.log"), env, 30)
        args = ["--device", "cuda"] if "--device" in helptext else []
        rc, secs, out = run([path] + args, os.path.join(logs, f"example-{ex}.log"), env,
                            min(300, max(1, left() - MARGIN_S)))
        ex_rows.append((ex, " ".join(args) or "(cpu: no device option)", rc, secs,
                        out.strip().splitlines()[-1] if out.strip() else ""))
        if rc:
            failed_any = True
        print(f"[gpu-check] {ex} {' '.join(args)}: rc {rc}, {secs:.1f} s", flush=True)
    write_report(a, rows, ex_rows, [], [], failed_any, gpu_skipped_total, pending=True)

    benches, comm_csvs = [], []
    if not a.skip_bench:
        b = lambda n: os.path.join(a.root, "bench", n)
        # the comm benches (about 60 s together on an H100): every call is
        # checked (-c 1) and timed until its stream is done; -n 0 --target-s
        # bounds each timed loop at about 30-50 ms whatever a call costs
        sweep = ["-b", "4M", "-e", "256M", "-f", "4", "-w", "5", "-n", "0", "-c", "1"]
        plan = [
            ("tp_linear against bare cublasGemmEx (bf16, f32, TF32)",
             [b("tp-bench-gemm"), "-s", "4096,8192,16384,8192x2048x8192", "--dtype",
              "bf16,f32,tf32", "-R", "3", "--ms", "50",
              "--csv", os.path.join(a.out, "bench-gemm.csv")]),
            ("per-op host time with CUDA tensors against the bare launch",
             [b("tp-bench-ops"), "--cuda", "--csv", os.path.join(a.out, "bench-ops-cuda.csv")]),
            ("TP MLP block in bf16 on 1, 2, 4 ranks of one GPU, unfused and with the GELU "
             "fused into the colwise Linear, against cuBLAS by hand",
             [b("tp-bench-layers"), "--device", "cuda", "-l", "mlp,mlp-fused,mlp-gemm", "-p",
              "fwd+bwd",
              "-t", "8192", "-H", "2048", "-g", "1,2,4", "--dtype", "bf16", "-n", "5", "-w", "2",
              "-R", "3", "--csv", os.path.join(a.out, "bench-layers-cuda.csv")]),
            ("fused attention against the math form: causal, bf16, 32/8 heads, head dim 128, "
             "seq 4096 (targets: fwd >= 50%, fwd+bwd >= 35% of the dense peak)",
             [b("tp-bench-attn"), "--cuda", "-b", "1", "-H", "32", "-K", "8", "-s", "4096",
              "-D", "128", "-r", "5", "--csv", os.path.join(a.out, "bench-attn-cuda.csv")]),
            ("fused attention at seq 16384: memory linear in the sequence",
             [b("tp-bench-attn"), "--cuda", "-b", "1", "-H", "32", "-K", "8", "-s", "16384",
              "-D", "128", "-r", "2", "--backend", "flash",
              "--csv", os.path.join(a.out, "bench-attn-cuda-16k.csv")]),
            ("decode: the 100M Llama in bf16 on one GPU, tp 1 and 2 (threads sharing it)",
             [b("tp-bench-llm"), "-p", "decode", "--device", "cuda", "--dtype", "bf16", "-b", "1",
              "-s", "128", "--new-tokens", "128", "--tp", "1,2", "-r", "3", "-w", "1",
              "--csv", os.path.join(a.out, "bench-decode-cuda.csv")]),
            ("decode as above with the math attention (TP_SDPA_BACKEND=math): the fused "
             "attention's share",
             ["/usr/bin/env", "TP_SDPA_BACKEND=math", b("tp-bench-llm"), "-p", "decode",
              "--device", "cuda", "--dtype", "bf16", "-b", "1", "-s", "128", "--new-tokens",
              "128", "--tp", "1,2", "-r", "3", "-w", "1",
              "--csv", os.path.join(a.out, "bench-decode-cuda-math.csv")]),
            # one Llama-3-8B-shaped layer (vocab 1024: the layer is what is
            # timed), about 11 TFLOP of GEMMs per fwd+bwd pass; tp-bench-llm
            # times its GEMMs (cuBLAS) and its attention (libtp's fused op)
            # by hand in the same run and prints the ratio
            ("8B-shaped decoder layer (hidden 4096, 32/8 heads, FFN 14336) fwd + bwd in bf16 at "
             "8192 tokens against its GEMMs and attention by hand (target: >= 0.85)",
             [b("tp-bench-llm"), "-p", "fwd+bwd", "--device", "cuda", "--dtype", "bf16",
              "--config", "8b-layer", "-b", "1", "-s", "8192", "--tp", "1", "-r", "3", "-w", "1",
              "--csv", os.path.join(a.out, "bench-llm-8b-layer.csv")]),
            # 1.75G parameters, drawn on the host at the build: tp 1 only,
            # and half the 100M run's new tokens
            ("decode: an 8B-shaped stack of 8 layers in bf16 on one GPU, batch 1: per-token "
             "latency",
             [b("tp-bench-llm"), "-p", "decode", "--device", "cuda", "--dtype", "bf16",
              "--config", "8b-stack", "-b", "1", "-s", "128", "--new-tokens", "64", "--tp", "1",
              "-r", "3", "-w", "1",
              "--csv", os.path.join(a.out, "bench-decode-8b-stack-cuda.csv")]),
        ]
        for g in (2, 4):
            comm_csvs.append(os.path.join(a.out, f"bench-comm-shm-cuda-g{g}.csv"))
            plan.append((f"shm on one GPU: {g} rank{'s' if g > 1 else ''} as threads, cuda buffers",
                         [b("tp-bench-comm"), "--backend", "shm", "--device", "cuda", "-g", str(g),
                          "--collective", "all_reduce,all_gather,reduce_scatter,all_to_all,broadcast"]
                         + sweep + ["-R", "3", "--target-s", "0.03", "--csv", comm_csvs[-1]]))
        comm_csvs.append(os.path.join(a.out, "bench-comm-nccl.csv"))
        plan += [
            ("nccl world of one: all_reduce, all_gather, and bare NCCL",
             [b("tp-bench-comm"), "--backend", "nccl", "-g", "1", "--nccl-bare", "--collective",
              "all_reduce,all_gather"] + sweep + ["-R", "5", "--target-s", "0.05",
                                                  "--csv", comm_csvs[-1]]),
        ]
        # PyTorch's flash attention on the same shapes, where torch is
        # installed on the GPU machine (its wheels are too big to carry)
        peer = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            "bench", "torch_sdpa.py")
        if os.path.exists(peer) and subprocess.run(
                [sys.executable, "-c", "import torch"], capture_output=True).returncode == 0:
            plan.append(("PyTorch's flash scaled_dot_product_attention, the same shapes",
                         [sys.executable, peer, "-b", "1", "-H", "32", "-K", "8", "-s", "4096",
                          "-D", "128", "-r", "5"]))
        if a.profile_mlp:
            ncu = shutil.which("ncu") or next(iter(sorted(
                __import__("glob").glob("/opt/nvidia/nsight-compute/*/ncu"))), None)
            if ncu:
                # every kernel's device time, summed per kernel name, of one
                # forward + backward of the block (no warm-up repetition)
                plan.append(("kernels of one TP MLP pass (bf16, 1 rank), by ncu",
                             [ncu, "--metrics", "gpu__time_duration.sum", "--print-summary",
                              "per-kernel", b("tp-bench-layers"), "--device", "cuda", "-l", "mlp",
                              "-p", "fwd+bwd", "-t", "8192", "-H", "2048", "-g", "1", "--dtype",
                              "bf16", "-n", "1", "-w", "0", "-R", "1"]))
            else:
                print("[gpu-check] --profile-mlp: ncu not found", flush=True)
        # under a budget the newest targets come first
        plan.sort(key=lambda tc: bench_rank(tc[0]))
        for title, cmd in plan:
            if not os.path.exists(cmd[0]):
                continue
            if left() - MARGIN_S < MIN_RUN_S:
                benches.append((title, " ".join([os.path.basename(cmd[0])] + cmd[1:]),
                                "not run", 0.0, "the time budget was spent"))
                print(f"[gpu-check] bench {title}: not run (the time budget was spent)",
                      flush=True)
                continue
            slug = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")[:40]
            rc, secs, out = run(cmd, os.path.join(logs, f"bench-{slug}.log"), env,
                                min(480, left() - MARGIN_S))
            benches.append((title, " ".join([os.path.basename(cmd[0])] + cmd[1:]), rc, secs, out))
            # the GPU benches exit 1 when they ran but missed a target: that is
            # a figure for the report, not a failure of the check
            # (tp-bench-llm prints its targets as met or missed and exits 0
            # either way: its 1 is a failure)
            missed_ok = os.path.basename(cmd[0]) in ("tp-bench-gemm", "tp-bench-ops",
                                                     "tp-bench-layers")
            if rc != 0 and not (rc == 1 and missed_ok):
                failed_any = True
            print(f"[gpu-check] bench {title}: rc {rc}, {secs:.1f} s", flush=True)
            write_report(a, rows, ex_rows, benches, comm_csvs, failed_any, gpu_skipped_total,
                         pending=True)

    return write_report(a, rows, ex_rows, benches, comm_csvs, failed_any, gpu_skipped_total,
                        pending=False)


# Under --budget-s: seconds kept free at the end (the report, the logs'
# archive), and the least a suite or bench is started with.
MARGIN_S = 20
MIN_RUN_S = 15

# The benches' order: the targets of the newest issue first (fused attention,
# the fused MLP, the 8B-shaped layer, decode), then the rest as listed.
BENCH_FIRST = ("fused attention against", "TP MLP block", "8B-shaped decoder layer",
               "decode: the 100M", "decode: an 8B", "decode as above", "fused attention at seq",
               "PyTorch's flash")


def bench_rank(title):
    for i, p in enumerate(BENCH_FIRST):
        if title.startswith(p):
            return i
    return len(BENCH_FIRST)


def write_report(a, rows, ex_rows, benches, comm_csvs, failed_any, gpu_skipped_total, pending):
    """gpu-results.csv, gpu-report.md and gpu-logs.tar.xz from what ran so
    far (pending: more is to come; the report says so). Returns the exit
    status."""
    logs = os.path.join(a.out, "logs")
    with open(os.path.join(a.out, "gpu-results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["suite", "status", "passed", "failed", "skipped",
                                          "gpu_skipped", "seconds", "note"])
        w.writeheader()
        w.writerows(rows)

    tp = sum(r["passed"] for r in rows)
    tf = sum(r["failed"] for r in rows)
    ok = not failed_any and gpu_skipped_total == 0
    verdict = ("PASS" if ok else "FAIL") + (" so far (still running)" if pending else "")
    with open(os.path.join(a.out, "gpu-report.md"), "w") as f:
        f.write(f"# libtp GPU check: {verdict}\n\n")
        f.write(f"- device: {a.device or 'unknown'}\n")
        info = os.path.join(a.root, "BUILD_INFO")
        if os.path.exists(info):
            for line in open(info):
                f.write(f"- {line.strip()}\n")
        f.write(f"- tests: {tp} passed, {tf} failed; GPU tests skipped: {gpu_skipped_total}\n\n")
        f.write("| suite | status | passed | failed | skipped | of them for want of a GPU | s |\n")
        f.write("| --- | --- | ---: | ---: | ---: | ---: | ---: |\n")
        for r in rows:
            f.write(f"| {r['suite']} | {r['status']}{' ' + r['note'] if r['note'] else ''} | "
                    f"{r['passed']} | {r['failed']} | {r['skipped']} | {r['gpu_skipped']} | "
                    f"{r['seconds']} |\n")
        if ex_rows:
            f.write("\n## Examples\n\n| example | arguments | rc | s | last line |\n"
                    "| --- | --- | ---: | ---: | --- |\n")
            for ex, args, rc, secs, last in ex_rows:
                f.write(f"| {ex} | {args} | {rc} | {secs:.1f} | {last} |\n")
        if comm_csvs:
            write_comm_summary(f, comm_summary(comm_csvs))
        for title, cmd, rc, secs, out in benches:
            if rc == "not run":
                f.write(f"\n## {title}\n\n`{cmd}`: not run ({out})\n")
                continue
            if "by ncu" in title:
                write_ncu_summary(f, title, ncu_kernels(out))
            f.write(f"\n## {title}\n\n`{cmd}` (rc {rc}, {secs:.1f} s)\n\n```\n")
            lines = out.splitlines()
            f.write("\n".join(lines[-60:]) + "\n```\n")

    if pending:
        return 0 if ok else 1
    with tarfile.open(os.path.join(a.out, "gpu-logs.tar.xz"), "w:xz") as tar:
        tar.add(logs, arcname="logs")
    print(f"[gpu-check] {'PASS' if ok else 'FAIL'}: {tp} passed, {tf} failed, "
          f"{gpu_skipped_total} GPU tests skipped; report: {a.out}/gpu-report.md", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
