#!/usr/bin/env python3
"""Reads the output of nccl-tests' *_perf programs, and tp-bench-comm's.

nccl-tests (https://github.com/NVIDIA/nccl-tests) prints, per run, two header
rows and one data row per size:

  #       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
  #        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
          4096          1024     float     sum      -1    22.76    0.18    0.18      0    22.61    0.18    0.18      0
  # Out of bounds values : 0 OK
  # Avg bus bandwidth    : 12.3456

The first four time/algbw/busbw/#wrong columns are the out-of-place call, the
last four the in-place one; #wrong is a count, or N/A where the results were
not checked. This reader does what the common community parsers do: it takes
the data rows by position (whitespace-separated fields, 13 of them), skips
'#' lines, and reads the two closing lines. On top it checks that every
field parses, that algbw = size / time within the printed rounding, and, where
a "# Collective test starting: X_perf" line names the collective and "Rank"
lines give the rank count, that busbw = algbw x nccl-tests' factor.

  nccl_tests_parse.py [--lenient] FILE...   parse files ('-': stdin)
  nccl_tests_parse.py --bench TP_BENCH_COMM run tp-bench-comm on small sizes
                                            (2 and 3 ranks, every collective,
                                            several dtypes and reductions) and
                                            parse its output strictly
  nccl_tests_parse.py --self-test           parse verbatim nccl-tests output
                                            (below), and broken variants that
                                            must be refused

Strict (the default): every line is a '#' comment, a blank, or a data row, and
every table ends with both closing lines, whose counts agree with the rows.
Lenient (real logs): other lines (NCCL INFO, warnings) are skipped, and a
table may be cut short. Exit status: 0 all good, 1 a problem (printed).
Python 3 standard library only.
"""

import csv
import math
import os
import re
import subprocess
import sys
import tempfile

COLUMNS = ["size", "count", "type", "redop", "root",
           "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong"]
UNITS = ["(B)", "(elements)", "(us)", "(GB/s)", "(GB/s)", "(us)", "(GB/s)", "(GB/s)"]
TYPES = {"int8", "uint8", "int32", "uint32", "int64", "uint64", "half", "float", "double",
         "bfloat16", "fp8_e4m3", "fp8_e5m2", "char", "int"}
REDOPS = {"sum", "prod", "max", "min", "avg", "mulsum", "premulsum", "none"}

# busbw / algbw of each nccl-tests program at n ranks (doc/PERFORMANCE.md)
BUS_FACTOR = {
    "all_reduce_perf": lambda n: 2.0 * (n - 1) / n,
    "all_gather_perf": lambda n: (n - 1) / n,
    "reduce_scatter_perf": lambda n: (n - 1) / n,
    "alltoall_perf": lambda n: (n - 1) / n,
    "broadcast_perf": lambda n: 1.0,
    "reduce_perf": lambda n: 1.0,
    "scatter_perf": lambda n: (n - 1) / n,
    "gather_perf": lambda n: (n - 1) / n,
}

OOB_RE = re.compile(r"^#\s*Out of bounds values\s*:\s*(\S+)\s+(\S+)")
AVG_RE = re.compile(r"^#\s*Avg bus bandwidth\s*:\s*(\S+)")
START_RE = re.compile(r"^#\s*Collective test starting:\s*(\S+)")
END_RE = re.compile(r"^#\s*Collective test concluded:\s*(\S+)")
RANK_RE = re.compile(r"^#\s*Rank\s+(\d+)\s")


class Row:
    def __init__(self, lineno, fields):
        self.lineno = lineno
        self.fields = fields
        self.size = self.count = self.root = 0
        self.type = self.redop = ""
        self.forms = []  # [(time, algbw, busbw, wrong or None)] out-of-place, in-place


class Table:
    def __init__(self, collective=None):
        self.collective = collective
        self.header = False
        self.rows = []
        self.oob = None  # (count, "OK"|"FAILED")
        self.avg = None
        self.concluded = False


class Parsed:
    def __init__(self):
        self.tables = []
        self.errors = []
        self.skipped = 0  # non-table lines skipped (lenient)
        self.ranks = set()


def _int(text, what, errs, where, lo=None):
    try:
        v = int(text)
    except ValueError:
        errs.append(f"{where}: {what} '{text}' is not an integer")
        return None
    if lo is not None and v < lo:
        errs.append(f"{where}: {what} {v} is below {lo}")
    return v


def _float(text, what, errs, where):
    try:
        v = float(text)
    except ValueError:
        errs.append(f"{where}: {what} '{text}' is not a number")
        return None
    if not math.isfinite(v) or v < 0:
        errs.append(f"{where}: {what} '{text}' is not a finite number >= 0")
        return None
    return v


def _wrong(text, errs, where):
    if text == "N/A":
        return None
    v = _float(text, "#wrong", errs, where)
    if v is not None and v != int(v):
        errs.append(f"{where}: #wrong '{text}' is not a whole count")
    return v


def _time_step(t):
    """Half the last printed digit of nccl-tests' time column."""
    return 0.005 if t < 100 else 0.05 if t < 10000 else 0.5


def parse_row(lineno, fields, errs):
    where = f"line {lineno}"
    row = Row(lineno, fields)
    row.size = _int(fields[0], "size", errs, where, 0)
    row.count = _int(fields[1], "count", errs, where, 0)
    row.type = fields[2]
    if row.type not in TYPES:
        errs.append(f"{where}: type '{row.type}' is not one of nccl-tests' types")
    row.redop = fields[3]
    if row.redop not in REDOPS:
        errs.append(f"{where}: redop '{row.redop}' is not one of nccl-tests' reductions")
    row.root = _int(fields[4], "root", errs, where, -1)
    for base, form in ((5, "out-of-place"), (9, "in-place")):
        t = _float(fields[base], form + " time", errs, where)
        alg = _float(fields[base + 1], form + " algbw", errs, where)
        bus = _float(fields[base + 2], form + " busbw", errs, where)
        wrong = _wrong(fields[base + 3], errs, f"{where} ({form})")
        row.forms.append((t, alg, bus, wrong))
        if None in (t, alg, row.size) or t <= 0:
            continue
        # algbw = size / time, both as printed: allow their rounding
        step = _time_step(t)
        hi = row.size / max(t - step, 1e-9) / 1e3 + 0.0051
        lo = row.size / (t + step) / 1e3 - 0.0051
        if not lo <= alg <= hi:
            errs.append(f"{where}: {form} algbw {alg} is not size / time = "
                        f"{row.size / t / 1e3:.4f} GB/s")
    return row


def parse(text, strict=True):
    """Tables and problems of one output. strict: see the module docstring."""
    p = Parsed()
    cur = None

    def table():
        nonlocal cur
        if cur is None:
            cur = Table()
            p.tables.append(cur)
        return cur

    for lineno, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if not s:
            continue
        if s.startswith("#"):
            m = START_RE.match(s)
            if m:
                cur = Table(m.group(1))
                p.tables.append(cur)
                continue
            m = RANK_RE.match(s)
            if m:
                p.ranks.add(int(m.group(1)))
                continue
            m = OOB_RE.match(s)
            if m:
                t = table()
                n = _int(m.group(1), "out of bounds count", p.errors, f"line {lineno}", 0)
                if m.group(2) not in ("OK", "FAILED"):
                    p.errors.append(f"line {lineno}: out of bounds verdict '{m.group(2)}' "
                                    "is neither OK nor FAILED")
                elif n is not None and (n > 0) != (m.group(2) == "FAILED"):
                    p.errors.append(f"line {lineno}: {n} out of bounds values but {m.group(2)}")
                t.oob = (n, m.group(2))
                continue
            m = AVG_RE.match(s)
            if m:
                t = table()
                t.avg = _float(m.group(1), "avg bus bandwidth", p.errors, f"line {lineno}")
                continue
            m = END_RE.match(s)
            if m:
                if cur is not None:
                    cur.concluded = True
                continue
            words = s[1:].split()
            if words[:1] == ["size"]:
                if words != COLUMNS:
                    p.errors.append(f"line {lineno}: header {words} is not nccl-tests' {COLUMNS}")
                if cur is not None and (cur.rows or cur.oob):
                    cur = None  # a new run without a "starting" line
                table().header = True
            elif words[:1] == ["(B)"] and words != UNITS:
                p.errors.append(f"line {lineno}: units {words} are not nccl-tests' {UNITS}")
            continue
        fields = s.split()
        looks_like_row = len(fields) == len(COLUMNS) and re.fullmatch(r"\d+", fields[0])
        if not looks_like_row:
            if strict:
                p.errors.append(f"line {lineno}: not a '#' line nor a row of "
                                f"{len(COLUMNS)} fields: {s[:100]}")
            else:
                p.skipped += 1
            continue
        t = table()
        if t.oob is not None or t.avg is not None:
            p.errors.append(f"line {lineno}: a row after its table's closing lines")
        t.rows.append(parse_row(lineno, fields, p.errors))
    return p


def check_tables(p, strict=True):
    """Cross-checks of each table; appends to p.errors."""
    n = len(p.ranks)
    if not p.tables:
        p.errors.append("no table found")
    for i, t in enumerate(p.tables, 1):
        name = f"table {i}" + (f" ({t.collective})" if t.collective else "")
        if strict:
            if not t.header:
                p.errors.append(f"{name}: no header rows")
            if not t.rows:
                p.errors.append(f"{name}: no data rows")
            if t.oob is None:
                p.errors.append(f"{name}: no '# Out of bounds values' line")
            if t.avg is None:
                p.errors.append(f"{name}: no '# Avg bus bandwidth' line")
            if t.collective and not t.concluded:
                p.errors.append(f"{name}: no '# Collective test concluded' line")
        busbw = [f[2] for r in t.rows for f in r.forms if f[2] is not None]
        failed = sum(1 for r in t.rows for f in r.forms if f[3])
        if t.oob is not None and t.oob[0] is not None and t.rows and t.oob[0] != failed:
            p.errors.append(f"{name}: out of bounds values {t.oob[0]} but {failed} "
                            "results with #wrong > 0")
        if t.avg is not None and busbw and strict:
            mean = sum(busbw) / len(busbw)
            if abs(mean - t.avg) > 0.0051 + 1e-5 * abs(mean):
                p.errors.append(f"{name}: avg bus bandwidth {t.avg} is not the mean "
                                f"{mean:.4f} of the busbw columns")
        factor = BUS_FACTOR.get(t.collective or "")
        if factor and n > 0:
            f = factor(n)
            for r in t.rows:
                for form, (_, alg, bus, _) in zip(("out-of-place", "in-place"), r.forms):
                    if alg is not None and bus is not None and abs(bus - alg * f) > 0.0051 + 0.0051 * f:
                        p.errors.append(f"line {r.lineno}: {form} busbw {bus} is not algbw x "
                                        f"{f:.4f} at {n} ranks for {t.collective}")


def parse_checked(text, strict=True):
    p = parse(text, strict)
    check_tables(p, strict)
    return p


# ---- verbatim nccl-tests output -------------------------------------------------
# A few lines each, as posted; the source of each is named above it.

FIXTURES = [
    # all_reduce_perf -b 8 -e 8G -f 2 -g 1 under mpirun -np 16 on two nodes of
    # 8 H100s: a whole run, from its first line to the closing lines.
    # https://github.com/lessizzmore/create-a3mega-ztan-fork, file
    # ztan-NCCL-test-result
    ("all_reduce_perf, a whole run on 16 ranks", 31, (0, 70.742), """\
# nThread 1 nGpus 1 minBytes 8 maxBytes 8589934592 step: 2(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0
#
# Using devices
#  Rank  0 Group  0 Pid   6899 on ztan-mig-235z device  0 [0000:04:00] NVIDIA H100 80GB HBM3
#  Rank  1 Group  0 Pid   6900 on ztan-mig-235z device  1 [0000:05:00] NVIDIA H100 80GB HBM3
#  Rank  2 Group  0 Pid   6901 on ztan-mig-235z device  2 [0000:0b:00] NVIDIA H100 80GB HBM3
#  Rank  3 Group  0 Pid   6902 on ztan-mig-235z device  3 [0000:0c:00] NVIDIA H100 80GB HBM3
#  Rank  4 Group  0 Pid   6903 on ztan-mig-235z device  4 [0000:84:00] NVIDIA H100 80GB HBM3
#  Rank  5 Group  0 Pid   6904 on ztan-mig-235z device  5 [0000:85:00] NVIDIA H100 80GB HBM3
#  Rank  6 Group  0 Pid   6905 on ztan-mig-235z device  6 [0000:8b:00] NVIDIA H100 80GB HBM3
#  Rank  7 Group  0 Pid   6906 on ztan-mig-235z device  7 [0000:8c:00] NVIDIA H100 80GB HBM3
#  Rank  8 Group  0 Pid   6733 on ztan-mig-gq73 device  0 [0000:04:00] NVIDIA H100 80GB HBM3
#  Rank  9 Group  0 Pid   6734 on ztan-mig-gq73 device  1 [0000:05:00] NVIDIA H100 80GB HBM3
#  Rank 10 Group  0 Pid   6735 on ztan-mig-gq73 device  2 [0000:0b:00] NVIDIA H100 80GB HBM3
#  Rank 11 Group  0 Pid   6736 on ztan-mig-gq73 device  3 [0000:0c:00] NVIDIA H100 80GB HBM3
#  Rank 12 Group  0 Pid   6737 on ztan-mig-gq73 device  4 [0000:84:00] NVIDIA H100 80GB HBM3
#  Rank 13 Group  0 Pid   6738 on ztan-mig-gq73 device  5 [0000:85:00] NVIDIA H100 80GB HBM3
#  Rank 14 Group  0 Pid   6739 on ztan-mig-gq73 device  6 [0000:8b:00] NVIDIA H100 80GB HBM3
#  Rank 15 Group  0 Pid   6740 on ztan-mig-gq73 device  7 [0000:8c:00] NVIDIA H100 80GB HBM3
#
#                                                              out-of-place                       in-place          
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)       
           8             2     float     sum      -1    135.8    0.00    0.00      0    123.5    0.00    0.00      0
          16             4     float     sum      -1    123.2    0.00    0.00      0    122.3    0.00    0.00      0
          32             8     float     sum      -1    123.3    0.00    0.00      0    122.7    0.00    0.00      0
          64            16     float     sum      -1    123.4    0.00    0.00      0    122.9    0.00    0.00      0
         128            32     float     sum      -1    123.0    0.00    0.00      0    122.7    0.00    0.00      0
         256            64     float     sum      -1    123.6    0.00    0.00      0    122.7    0.00    0.00      0
         512           128     float     sum      -1    126.6    0.00    0.01      0    123.4    0.00    0.01      0
        1024           256     float     sum      -1    147.1    0.01    0.01      0    123.1    0.01    0.02      0
        2048           512     float     sum      -1    125.8    0.02    0.03      0    124.6    0.02    0.03      0
        4096          1024     float     sum      -1    126.9    0.03    0.06      0    125.6    0.03    0.06      0
        8192          2048     float     sum      -1    131.6    0.06    0.12      0    130.6    0.06    0.12      0
       16384          4096     float     sum      -1    138.6    0.12    0.22      0    137.6    0.12    0.22      0
       32768          8192     float     sum      -1    155.2    0.21    0.40      0    153.1    0.21    0.40      0
       65536         16384     float     sum      -1    159.4    0.41    0.77      0    157.6    0.42    0.78      0
      131072         32768     float     sum      -1    159.3    0.82    1.54      0    169.0    0.78    1.45      0
      262144         65536     float     sum      -1    167.1    1.57    2.94      0    163.9    1.60    3.00      0
      524288        131072     float     sum      -1    174.2    3.01    5.64      0    171.0    3.07    5.75      0
     1048576        262144     float     sum      -1    203.2    5.16    9.68      0    207.2    5.06    9.49      0
     2097152        524288     float     sum      -1    254.0    8.26   15.48      0    252.9    8.29   15.55      0
     4194304       1048576     float     sum      -1    364.6   11.50   21.57      0    356.6   11.76   22.05      0
     8388608       2097152     float     sum      -1    571.9   14.67   27.50      0    563.5   14.89   27.91      0
    16777216       4194304     float     sum      -1    977.6   17.16   32.18      0    951.6   17.63   33.06      0
    33554432       8388608     float     sum      -1   1059.9   31.66   59.36      0   1054.0   31.84   59.69      0
    67108864      16777216     float     sum      -1   1261.6   53.20   99.74      0   1270.2   52.83   99.06      0
   134217728      33554432     float     sum      -1   1652.2   81.24  152.32      0   1636.7   82.01  153.76      0
   268435456      67108864     float     sum      -1   2360.9  113.70  213.19      0   2359.9  113.75  213.28      0
   536870912     134217728     float     sum      -1   3817.5  140.63  263.69      0   3828.0  140.25  262.97      0
  1073741824     268435456     float     sum      -1   6759.0  158.86  297.86      0   6737.4  159.37  298.82      0
  2147483648     536870912     float     sum      -1    12646  169.81  318.40      0    12641  169.88  318.52      0
  4294967296    1073741824     float     sum      -1    24361  176.31  330.58      0    24365  176.27  330.51      0
  8589934592    2147483648     float     sum      -1    47535  180.71  338.82      0    47743  179.92  337.35      0
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 70.742 
"""),
    # reduce_scatter_perf on 8 GPUs of 2 nodes: header rows and the first rows
    # (sizes 0 and up). https://github.com/NVIDIA/nccl-tests/issues/128 (comment
    # of 2023-02-02)
    ("reduce_scatter_perf, header and small sizes", 7, None, """\
#                                                              out-of-place                       in-place          
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)       
           0             0     float     sum      -1     5.70    0.00    0.00      0     5.54    0.00    0.00      0
           0             0     float     sum      -1     5.92    0.00    0.00      0     5.51    0.00    0.00      0
           0             0     float     sum      -1     5.52    0.00    0.00      0     5.55    0.00    0.00      0
           0             0     float     sum      -1     5.53    0.00    0.00      0     5.53    0.00    0.00      0
           0             0     float     sum      -1     5.57    0.00    0.00      0     5.52    0.00    0.00      0
         128             4     float     sum      -1    32.31    0.00    0.00      0    25.35    0.01    0.00      0
         256             8     float     sum      -1    24.01    0.01    0.01      0    23.18    0.01    0.01      0
"""),
    # all_reduce_perf, the last rows of a -i sweep and the closing lines.
    # https://github.com/NVIDIA/nccl-tests/issues/119
    ("all_reduce_perf, last rows and closing lines", 6, (0, 84.8558), """\
   127926280      31981570     float     sum      -1   2560.7   49.96   95.75      0   2556.2   50.05   95.92      0
   128974856      32243714     float     sum      -1   2583.9   49.92   95.67      0   2562.4   50.33   96.47      0
   130023432      32505858     float     sum      -1   2584.7   50.31   96.42      0   2587.1   50.26   96.33      0
   131072008      32768002     float     sum      -1   2604.6   50.32   96.45      0   2630.6   49.83   95.50      0
   132120584      33030146     float     sum      -1   2644.1   49.97   95.77      0   2619.1   50.45   96.69      0
   133169160      33292290     float     sum      -1   2666.0   49.95   95.74      0   2660.4   50.06   95.94      0
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 84.8558
"""),
    # all_reduce_perf on 2 GPUs with NCCL_DEBUG=INFO: log lines between the
    # last row and the closing lines. https://github.com/NVIDIA/nccl/issues/1706
    ("all_reduce_perf, NCCL INFO lines among the rows", 1, (0, 8.62002), """\
   134217728      33554432     float     sum      -1   5190.8   25.86   25.86      0   5186.6   25.88   25.88      0
deepseek:2081594:2081611 [0] NCCL INFO comm 0x55f6848de3b0 rank 0 nranks 2 cudaDev 0 busId f000 - Destroy COMPLETE
deepseek:2081594:2081611 [1] NCCL INFO comm 0x55f68495f4f0 rank 1 nranks 2 cudaDev 1 busId 34000 - Destroy COMPLETE
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 8.62002 
#
"""),
    # alltoall_perf on 4 GPUs: in-place results not checked (N/A), after
    # NCCL INFO lines. https://github.com/NVIDIA/nccl-tests/issues/321
    ("alltoall_perf, N/A in the in-place #wrong", 5, None, """\
vm-host40:34002:34055 [1] NCCL INFO NCCL_IB_TIMEOUT set by environment to 21.
vm-host38:33958:34012 [1] NCCL INFO NCCL_IB_TIMEOUT set by environment to 21.
     1048576         65536     float    none      -1    52.94   19.81   14.85      0    53.47   19.61   14.71    N/A
     2097152        131072     float    none      -1    72.12   29.08   21.81      0    80.45   26.07   19.55    N/A
     4194304        262144     float    none      -1    95.86   43.75   32.82      0    94.87   44.21   33.16    N/A
  1073741824      67108864     float    none      -1    16035   66.96   50.22      0    16110   66.65   49.99    N/A
  4294967296     268435456     float    none      -1    64101   67.00   50.25      0    63946   67.17   50.37    N/A
"""),
]


def self_test():
    failures = []
    for i, (name, nrows, closing, text) in enumerate(FIXTURES):
        # the whole run is read strictly, the excerpts as logs
        p = parse_checked(text, strict=i == 0)
        rows = [r for t in p.tables for r in t.rows]
        if p.errors:
            failures.append(f"{name}: {p.errors}")
        if len(rows) != nrows:
            failures.append(f"{name}: {len(rows)} rows, expected {nrows}")
        if closing is not None:
            t = p.tables[-1]
            if t.oob is None or t.oob[0] != closing[0] or t.avg != closing[1]:
                failures.append(f"{name}: closing lines read as {t.oob} {t.avg}, "
                                f"expected {closing}")
    # the whole run: 16 ranks, so busbw = algbw x 2 x 15/16 was checked
    whole = FIXTURES[0][3]
    p = parse_checked(whole, strict=True)
    if len(p.ranks) != 16:
        failures.append(f"whole run: {len(p.ranks)} ranks read, expected 16")
    # values by position, as a script reads them
    p = parse_checked(FIXTURES[4][3], strict=False)
    r = p.tables[0].rows[0]
    if (r.size, r.count, r.type, r.redop, r.root) != (1048576, 65536, "float", "none", -1) or \
            r.forms[0] != (52.94, 19.81, 14.85, 0.0) or r.forms[1] != (53.47, 19.61, 14.71, None):
        failures.append(f"alltoall row read as {r.size} {r.count} {r.forms}")
    if p.skipped != 2:
        failures.append(f"alltoall: {p.skipped} log lines skipped, expected 2")

    # broken variants of the whole run must be refused: the checks bite
    row = "     1048576        262144     float     sum      -1    203.2    5.16    9.68      0"
    if row not in whole:
        failures.append("self-test: the row to break is not in the whole run")
    broken = {
        "a '-' for a time": whole.replace(row + "    207.2", row + "        -"),
        "a wrong count and an OK verdict": whole.replace(row + "    207.2    5.06    9.49      0",
                                                         row + "    207.2    5.06    9.49      3"),
        "a missing column": whole.replace(row, row.replace("    5.16", "")),
        "an extra column": whole.replace("337.35      0\n", "337.35      0   12.5\n"),
        "an algbw that is not size / time": whole.replace("203.2    5.16", "203.2    6.16"),
        "a busbw that is not algbw x 2(n-1)/n": whole.replace("5.16    9.68", "5.16    5.16"),
        "an unknown type": whole.replace("262144     float", "262144      fp42"),
        "a #wrong that is not a count": whole.replace("9.68      0", "9.68    0.5"),
        "no Avg bus bandwidth line": whole.replace("# Avg bus bandwidth    : 70.742 \n", ""),
        "no Out of bounds line": whole.replace("# Out of bounds values : 0 OK\n", ""),
        "an average that is not the rows'": whole.replace("70.742", "60.742"),
        "a renamed column": whole.replace("#wrong     time", "#error     time", 1),
    }
    for what, text in broken.items():
        if text == whole:
            failures.append(f"self-test: the variant with {what} changed nothing")
        elif not parse_checked(text, strict=True).errors:
            failures.append(f"accepted {what}")

    for f in failures:
        print("FAIL:", f)
    print(f"self-test: {len(FIXTURES)} verbatim nccl-tests outputs, {len(broken)} broken "
          f"variants: {'FAILED' if failures else 'OK'}")
    return 1 if failures else 0


# ---- tp-bench-comm ---------------------------------------------------------------

PERF = {"all_reduce": "all_reduce_perf", "all_gather": "all_gather_perf",
        "reduce_scatter": "reduce_scatter_perf", "all_to_all": "alltoall_perf",
        "broadcast": "broadcast_perf", "scatter": "scatter_perf"}
ALL = list(PERF)
SPLIT = {"all_gather", "reduce_scatter", "all_to_all", "scatter"}
REDUCES = {"all_reduce", "reduce_scatter"}
ROOTED = {"broadcast", "scatter"}
ELT = {"int32": 4, "int64": 8, "half": 2, "float": 4, "double": 8, "bfloat16": 2}
# (collective, column) whose #wrong is N/A: the form libtp lacks
UNCHECKED = {("all_to_all", 1), ("broadcast", 0)}

# (ranks, collectives, dtype, reductions, roots, sizes, extra arguments)
RUNS = [
    (2, ALL, "float", ["sum"], [0], (1024, 65536, 8, 0), ["-n", "3", "-R", "2"]),
    (3, ALL, "bfloat16", ["max"], [0, 1, 2], (1000, 40000, 6, 0),
     ["-o", "max", "-r", "all", "-z", "1", "-a", "3", "-n", "3", "-R", "2"]),
    (3, ["all_reduce", "reduce_scatter"], "int64", ["sum", "prod", "max", "min", "avg"], [0],
     (96, 12288, 4, 0), ["-o", "all", "-n", "2", "-R", "1", "-c", "2", "-a", "0"]),
    (2, ["all_reduce", "reduce_scatter", "all_gather"], "half", ["avg"], [0], (1024, 4096, 4, 0),
     ["-o", "avg", "-n", "2", "-R", "3", "-a", "2"]),
    (2, ["broadcast", "scatter", "all_to_all"], "double", ["sum"], [1], (1024, 4096, 1, 1024),
     ["-i", "1K", "-r", "1", "-n", "2", "-R", "1", "-z", "1"]),
    (3, ["all_reduce", "all_gather", "scatter"], "int32", ["sum"], [2], (4, 100, 5, 0),
     ["-r", "2", "-n", "2", "-R", "2"]),
]


def sizes(lo, hi, factor, step):
    s = lo
    while s <= hi:
        yield s
        s = s * factor if factor > 1 else s + step


def expected_rows(coll, n, dtype, redops, roots, size_args):
    es = ELT[dtype]
    rows = []
    for redop in (redops if coll in REDUCES else ["none"]):
        for root in (roots if coll in ROOTED else [-1]):
            for s in sizes(*size_args):
                k = s // es // n if coll in SPLIT else s // es
                if k == 0:
                    continue
                count = k * n if coll in SPLIT else k
                rows.append((count * es, k, dtype, redop, root))
    return rows


def run_bench(binary):
    failures = []
    for n, colls, dtype, redops, roots, size_args, extra in RUNS:
        lo, hi, factor, step = size_args
        with tempfile.TemporaryDirectory() as tmp:
            csv_path = os.path.join(tmp, "out.csv")
            cmd = [binary, "-g", str(n), "--collective", ",".join(colls), "-d", dtype,
                   "-b", str(lo), "-e", str(hi), "-w", "1", "--roof-bytes", "0",
                   "--target-s", "0.01", "--csv", csv_path] + extra
            if factor > 1:
                cmd += ["-f", str(factor)]
            what = " ".join(cmd[1:])
            res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 universal_newlines=True, timeout=240)
            if res.returncode != 0:
                failures.append(f"{what}: exit {res.returncode}: {res.stderr.strip()}")
                continue
            p = parse_checked(res.stdout, strict=True)
            problems = list(p.errors)
            if len(p.ranks) != n:
                problems.append(f"{len(p.ranks)} Rank lines, expected {n}")
            colls = [c for c in ALL if c in colls]  # tp-bench-comm's order
            got = [t.collective for t in p.tables]
            want = [PERF[c] for c in colls]
            if got != want:
                problems.append(f"tables {got}, expected {want}")
            for t, coll in zip(p.tables, colls):
                rows = [(r.size, r.count, r.type, r.redop, r.root) for r in t.rows]
                exp = expected_rows(coll, n, dtype, redops, roots, size_args)
                if rows != exp:
                    problems.append(f"{coll}: rows {rows} expected {exp}")
                for r in t.rows:
                    for form, (_, _, _, wrong) in enumerate(r.forms):
                        if (coll, form) in UNCHECKED:
                            if wrong is not None:
                                problems.append(f"line {r.lineno}: #wrong {wrong} where N/A "
                                                "was expected (no such form in libtp)")
                        elif wrong is None:
                            problems.append(f"line {r.lineno}: #wrong N/A, results not checked")
                        elif wrong > 0:
                            problems.append(f"line {r.lineno}: #wrong {wrong:g}")
                if t.oob != (0, "OK"):
                    problems.append(f"{coll}: out of bounds line {t.oob}")
            with open(csv_path, newline="") as f:
                records = list(csv.DictReader(f))
            nrows = sum(len(t.rows) for t in p.tables)
            if len(records) != 2 * nrows:
                problems.append(f"CSV: {len(records)} records for {nrows} rows, expected 2 each")
            for rec in records:
                reps = rec["rep_times_us"].split()
                if not (float(rec["time_min_us"]) <= float(rec["time_us"]) <= float(rec["time_max_us"])):
                    problems.append(f"CSV: median {rec['time_us']} outside "
                                    f"{rec['time_min_us']}..{rec['time_max_us']}")
                if rec["collective"] not in ROOTED and rec["root"] != "-1":
                    problems.append(f"CSV: root {rec['root']} for {rec['collective']}, expected -1")
                if len(reps) != int(rec["reps"]):
                    problems.append(f"CSV: {len(reps)} repetition times for reps={rec['reps']}")
            if problems:
                failures.append(f"{what}:\n  " + "\n  ".join(problems[:20]))
            else:
                print(f"ok: {what}: {len(p.tables)} tables, {nrows} rows")

    # nccl-tests' options with a meaning libtp cannot give are refused by name
    for args, needle in ((["-d", "int8"], "int8"), (["-d", "uint64"], "uint64"),
                         (["-o", "all_reduce"], "--collective"), (["-o", "mulsum"], "mulsum"),
                         (["-t", "2"], "-t"), (["-i", "1K", "-f", "2"], "-i"),
                         (["-a", "4"], "-a"), (["-r", "5", "-g", "2"], "-r 5")):
        res = subprocess.run([binary] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             universal_newlines=True, timeout=60)
        if res.returncode != 64 or needle not in res.stderr:
            failures.append(f"{' '.join(args)}: exit {res.returncode}, stderr "
                            f"{res.stderr.strip()!r}; expected 64 naming {needle!r}")
        else:
            print(f"ok: {' '.join(args)} refused: {res.stderr.strip().splitlines()[0]}")

    for f in failures:
        print("FAIL:", f)
    print(f"tp-bench-comm: {len(RUNS)} runs parsed as nccl-tests output: "
          f"{'FAILED' if failures else 'OK'}")
    return 1 if failures else 0


def main(argv):
    if argv[1:2] == ["--self-test"]:
        return self_test()
    if argv[1:2] == ["--bench"] and len(argv) == 3:
        return run_bench(argv[2])
    strict = True
    files = argv[1:]
    if files[:1] == ["--lenient"]:
        strict = False
        files = files[1:]
    if not files or files[0].startswith("-") and files[0] != "-":
        print(__doc__.strip().split("\n\n")[2], file=sys.stderr)
        return 64
    status = 0
    for path in files:
        text = sys.stdin.read() if path == "-" else open(path).read()
        p = parse_checked(text, strict)
        for e in p.errors:
            print(f"{path}: {e}")
        nrows = sum(len(t.rows) for t in p.tables)
        print(f"{path}: {len(p.tables)} tables, {nrows} rows, "
              f"{'problems: ' + str(len(p.errors)) if p.errors else 'every field parses'}")
        status = status or (1 if p.errors else 0)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv))
