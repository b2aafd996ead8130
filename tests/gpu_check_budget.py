#!/usr/bin/env python3
"""The GPU check's time budget (scripts/gpu_check.py --budget-s), on stand-in
suites that need no GPU: a suite that can no longer start within the budget
is reported as not run for want of time, not as a failure; the one that
starts runs under the time left; the report is written.

    gpu_check_budget.py SCRIPTS_DIR
"""
import csv
import json
import os
import subprocess
import sys
import tempfile

fails = 0


def check(cond, what):
    global fails
    if not cond:
        print("FAIL:", what)
        fails += 1


with tempfile.TemporaryDirectory() as d:
    tests = [
        {"name": "quick", "cmd": ["/bin/true"], "timeout": 30, "is_parallel": True},
        {"name": "slow", "cmd": ["/bin/sleep", "3"], "timeout": 60, "is_parallel": True},
        # serial: starts after the others, when 36 - 3 s leave less than the
        # 20 s margin plus the 15 s a suite is at least given
        {"name": "late", "cmd": ["/bin/true"], "timeout": 30, "is_parallel": False},
    ]
    tj = os.path.join(d, "tests.json")
    with open(tj, "w") as f:
        json.dump(tests, f)
    out = os.path.join(d, "out")
    p = subprocess.run([sys.executable, os.path.join(sys.argv[1], "gpu_check.py"), "--root", d,
                        "--tests-json", tj, "--out", out, "--skip-bench", "--budget-s", "36",
                        "--jobs", "3"], capture_output=True, text=True, timeout=60)
    check(p.returncode == 0, f"exit {p.returncode}: {p.stdout}{p.stderr}")
    rows = {r["suite"]: r for r in csv.DictReader(open(os.path.join(out, "gpu-results.csv")))}
    check(rows.get("quick", {}).get("status") == "ok", f"quick: {rows.get('quick')}")
    check(rows.get("slow", {}).get("status") == "ok", f"slow: {rows.get('slow')}")
    late = rows.get("late", {})
    check(late.get("status") == "not run" and "time budget" in late.get("note", ""),
          f"late: {late}")
    report = open(os.path.join(out, "gpu-report.md")).read()
    check(report.startswith("# libtp GPU check: PASS\n"), report[:80])
    check("| late | not run the time budget was spent |" in report, report)
    check(os.path.exists(os.path.join(out, "gpu-logs.tar.xz")), "no log archive")

print("gpu_check_budget:", "FAIL" if fails else "ok")
sys.exit(1 if fails else 0)
