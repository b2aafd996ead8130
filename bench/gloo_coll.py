#!/usr/bin/env python3
"""gloo_coll.py - torch.distributed's gloo collectives, timed as tp-bench-comm times libtp's.

Started by bench/compare_gloo.sh; runs alone too:

    python3 bench/gloo_coll.py --np 2 --op all_reduce --sizes 4096,1048576 --csv out.csv

--np processes (torch.multiprocessing, spawn) join a gloo process group over a
FileStore in a temporary directory (localhost, no network), each with one
intra-op thread. For every collective and size, as tp-bench-comm does: the
inputs are checked once (small integers whose sums are exact in f32), --warmup
untimed calls, then N timed calls, each after an untimed barrier; every rank
times its own call and a call counts as its slowest rank's time. N is chosen
so that the timed calls take about --target-s (at least 5, at most 20000).

all_reduce and broadcast run in place (torch.distributed's only forms; the
sums grow during the timed calls, as in tp-bench-comm --inplace 1), the others
out of place (all_gather_into_tensor, reduce_scatter_tensor,
all_to_all_single). Sizes follow tp-bench-comm (nccl-tests): S is the send = recv size of
all_reduce, the gathered (total) recv size of all_gather, the total send size
of reduce_scatter, the per-rank send size of all_to_all, the buffer of
broadcast. busbw = S / time x 2(n-1)/n for all_reduce, x (n-1)/n for
all_gather, reduce_scatter and all_to_all, x 1 for broadcast.

The CSV (rank 0, header row) uses tp-bench-comm's column names:
op, backend, nranks, dtype, size_bytes, count, iters, time_us (mean),
time_med_us, time_min_us, algbw_GBps, busbw_GBps (from the mean),
busbw_med_GBps (from the median), wrong.

A rank that fails ends the run: the others are stopped, and a rank left
waiting in a collective gives up after 120 s (the process group's timeout).
Exit status: 0 done; 1 a rank failed or counted wrong elements; 3 no torch;
64 bad usage.
"""
import argparse
import datetime
import os
import sys
import tempfile
import time

INIT_TIMEOUT_S = 120  # seconds a rank waits for its peers (gloo's collectives and store)
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
ALIASES = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
           "alltoall": "all_to_all", "bcast": "broadcast"}


def bus_factor(op, n):
    if n == 1:
        return 1.0 if op == "broadcast" else 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op == "broadcast":
        return 1.0
    return (n - 1) / n


def parse_size(s):
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)


def worker(rank, args, store_path, queue):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # a rank that fails leaves the others waiting in a collective: the timeout
    # turns that wait into an error instead of a hang
    dist.init_process_group("gloo", init_method="file://" + store_path, rank=rank,
                            world_size=args.np,
                            timeout=datetime.timedelta(seconds=INIT_TIMEOUT_S))
    n = args.np
    rows = []
    try:
        for op in args.op:
            for size in args.sizes:
                rows.append(run_point(torch, dist, rank, n, op, size, args))
        # only on success: a rank that raised does not come here, and a barrier
        # in its way out would wait for ranks stuck in the collective it left
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        queue.put(rows)


def buffers(torch, op, size, n, rank):
    """send, recv and the expected recv (None: not checked) for one call."""
    count = size // 4
    if op in ("all_gather", "reduce_scatter"):
        count = count // n * n  # whole elements per block
    block = count // n if n else count
    idx = torch.arange(count, dtype=torch.float32)
    if op == "all_reduce":  # in place, torch's only form
        send = (rank + 1 + idx.remainder(13))
        recv = send
        expect = sum(r + 1 for r in range(n)) + n * idx.remainder(13)
    elif op == "all_gather":
        send = torch.full((block,), float(rank + 1)) + torch.arange(block).remainder(7)
        recv = torch.empty(count)
        expect = torch.cat([torch.full((block,), float(r + 1)) + torch.arange(block).remainder(7)
                            for r in range(n)]) if block else torch.empty(0)
    elif op == "reduce_scatter":
        send = rank + 1 + idx.remainder(13)
        recv = torch.empty(block)
        mine = idx[rank * block:(rank + 1) * block].remainder(13)
        expect = sum(r + 1 for r in range(n)) + n * mine
    elif op == "all_to_all":
        count = count // n * n
        block = count // n
        # block j of rank r's input goes to rank j: tag it with (r, j)
        send = torch.cat([torch.full((block,), float(1 + rank * n + j)) for j in range(n)]) if block else torch.empty(0)
        recv = torch.empty(count)
        expect = torch.cat([torch.full((block,), float(1 + r * n + rank)) for r in range(n)]) if block else torch.empty(0)
    else:  # broadcast, root 0, in place
        send = (idx.remainder(13) + 1) if rank == 0 else torch.zeros(count)
        recv = send
        expect = idx.remainder(13) + 1
    return send, recv, expect


def call(dist, op, send, recv):
    if op == "all_reduce":
        dist.all_reduce(recv)
    elif op == "all_gather":
        dist.all_gather_into_tensor(recv, send)
    elif op == "reduce_scatter":
        dist.reduce_scatter_tensor(recv, send)
    elif op == "all_to_all":
        dist.all_to_all_single(recv, send)
    else:
        dist.broadcast(send, 0)


def run_point(torch, dist, rank, n, op, size, args):
    send, recv, expect = buffers(torch, op, size, n, rank)
    moved = {"all_reduce": recv.numel(), "all_gather": recv.numel(),
             "reduce_scatter": send.numel(), "all_to_all": send.numel(),
             "broadcast": send.numel()}[op] * 4
    wrong = 0
    call(dist, op, send, recv)
    if expect is not None:
        wrong = int((recv != expect).sum().item())
    for _ in range(args.warmup):
        call(dist, op, send, recv)
    # iterations: about target_s of calls, agreed on by all ranks
    probe = torch.zeros(1, dtype=torch.float64)
    t0 = time.perf_counter()
    for _ in range(3):
        call(dist, op, send, recv)
    probe[0] = (time.perf_counter() - t0) / 3
    dist.all_reduce(probe, op=dist.ReduceOp.MAX)
    iters = int(min(20000, max(5, args.target_s / max(probe.item(), 1e-7))))
    if args.iters:
        iters = args.iters
    times = torch.zeros(iters, dtype=torch.float64)
    for i in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        call(dist, op, send, recv)
        times[i] = time.perf_counter() - t0
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    if expect is not None and op in ("all_gather", "all_to_all"):
        wrong += int((recv != expect).sum().item())  # the copying collectives keep their values
    bad = torch.tensor([wrong], dtype=torch.float64)
    dist.all_reduce(bad)
    mean = times.mean().item()
    med = times.median().item() if iters % 2 else times.sort().values[iters // 2 - 1:iters // 2 + 1].mean().item()
    tmin = times.min().item()
    algbw = moved / mean / 1e9 if mean > 0 else 0
    fac = bus_factor(op, n)
    return {"op": op, "backend": "gloo", "nranks": n, "dtype": "f32", "size_bytes": moved,
            "count": moved // 4, "iters": iters, "time_us": mean * 1e6, "time_med_us": med * 1e6,
            "time_min_us": tmin * 1e6, "algbw_GBps": algbw, "busbw_GBps": algbw * fac,
            "busbw_med_GBps": moved / med / 1e9 * fac if med > 0 else 0, "wrong": int(bad.item())}


COLUMNS = ("op", "backend", "nranks", "dtype", "size_bytes", "count", "iters", "time_us",
           "time_med_us", "time_min_us", "algbw_GBps", "busbw_GBps", "busbw_med_GBps", "wrong")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--np", type=int, default=2, help="processes (ranks), default 2")
    ap.add_argument("--op", default="all", help="comma-separated collectives or 'all' (default)")
    ap.add_argument("--sizes", default="4K,64K,1M,16M",
                    help="comma-separated sizes in bytes, K/M/G suffixes (default 4K,64K,1M,16M)")
    ap.add_argument("--target-s", type=float, default=0.2, help="seconds of timed calls per point (0.2)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed calls per point (5)")
    ap.add_argument("--iters", type=int, default=0, help="fixed timed calls per point (0: from --target-s)")
    ap.add_argument("--csv", help="write the rows here too")
    args = ap.parse_args()
    try:
        import torch
        import torch.multiprocessing as mp
    except ImportError:
        print("gloo_coll: torch is not installed for %s" % sys.executable, file=sys.stderr)
        return 3
    ops = OPS if args.op == "all" else [ALIASES.get(o, o) for o in args.op.split(",")]
    for o in ops:
        if o not in OPS:
            print("gloo_coll: unknown collective %r (%s)" % (o, ", ".join(OPS)), file=sys.stderr)
            return 64
    args.op = list(ops)
    try:
        args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    except ValueError:
        print("gloo_coll: --sizes: bad size in %r" % args.sizes, file=sys.stderr)
        return 64
    if args.np < 1 or any(s < 4 for s in args.sizes):
        print("gloo_coll: --np >= 1 and sizes >= 4 bytes", file=sys.stderr)
        return 64
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.get_context("spawn")
        queue = ctx.SimpleQueue()
        try:
            mp.spawn(worker, args=(args, os.path.join(d, "store"), queue), nprocs=args.np, join=True)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            # spawn has ended the other ranks; e holds the failing rank's traceback
            print("gloo_coll: a rank failed, no results: %s" % str(e).strip(), file=sys.stderr)
            return 1
        rows = queue.get()
    print("# gloo_coll: torch %s, %d processes, gloo over a FileStore, 1 thread each" %
          (torch.__version__, args.np))
    print("# %-15s %12s %8s %12s %12s %10s %10s %6s" % ("op", "size(B)", "iters", "time(us)",
                                                        "median(us)", "busbw", "busbw_med", "wrong"))
    for r in rows:
        print("  %-15s %12d %8d %12.2f %12.2f %10.3f %10.3f %6d" % (
            r["op"], r["size_bytes"], r["iters"], r["time_us"], r["time_med_us"], r["busbw_GBps"],
            r["busbw_med_GBps"], r["wrong"]))
    if args.csv:
        with open(args.csv, "w") as f:
            f.write(",".join(COLUMNS) + "\n")
            for r in rows:
                f.write(",".join(("%.4f" % r[c]) if isinstance(r[c], float) else str(r[c])
                                 for c in COLUMNS) + "\n")
    return 1 if any(r["wrong"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
