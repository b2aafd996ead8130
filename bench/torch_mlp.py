#!/usr/bin/env python3
"""torch_mlp.py - the Megatron MLP block in PyTorch, timed as tp-bench-layers times libtp's.

Started by bench/compare_torch.sh; runs alone too:

    python3 bench/torch_mlp.py --ranks 2 -t 2048 -H 2048 -n 3 -w 2

The block is nn.Sequential(Linear(H, 4H), GELU(approximate="tanh"),
Linear(4H, H)), f32, on T tokens; a pass is forward, loss = y.sum(),
backward, zero_grad (the input needs no gradient), as in tp-bench-layers
-l mlp -p fwd+bwd. With --ranks 1 the plain module runs in this process; with
--ranks N > 1, N processes (torch.multiprocessing, spawn) join a gloo process
group over a FileStore on this machine, and the block is split with the
public tensor-parallel API: parallelize_module(block, mesh, {"0":
ColwiseParallel(), "2": RowwiseParallel()}) on a 1-D CPU device mesh. Every
process runs one intra-op thread (OMP/MKL threads 1, torch.set_num_threads(1)).

Timing, as in tp-bench-layers: -w untimed passes, then -n timed passes, each
between two barriers; every rank times from its exit of the first to its exit
of the second; a pass counts as the longest; the run's time is the median.
Prints one line and, with --csv, writes a header row and one row:
impl, ranks, tokens, hidden, ffn, pass, time_ms, time_min_ms, time_max_ms,
iters, warmup, threads, torch.
"""
import argparse
import os
import sys
import tempfile
import time

# one intra-op thread per rank, before torch loads its thread pools
for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[var] = "1"


def build(torch, H):
    torch.manual_seed(42)
    nn = torch.nn
    return nn.Sequential(nn.Linear(H, 4 * H), nn.GELU(approximate="tanh"), nn.Linear(4 * H, H))


def passes(torch, model, x, args, barrier):
    times = []
    for i in range(args.warmup + args.iters):
        barrier()
        t0 = time.perf_counter()
        y = model(x)
        loss = y.sum()
        loss.backward()
        model.zero_grad(set_to_none=True)
        del y, loss
        barrier()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return times


def worker(rank, args, store, queue):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=args.ranks)
    try:
        mesh = init_device_mesh("cpu", (args.ranks,))
        model = parallelize_module(build(torch, args.hidden), mesh,
                                   {"0": ColwiseParallel(), "2": RowwiseParallel()})
        g = torch.Generator().manual_seed(7)
        x = torch.rand(args.tokens, args.hidden, generator=g) * 2 - 1
        times = torch.tensor(passes(torch, model, x, args, dist.barrier), dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        if rank == 0:
            queue.put(times.tolist())
        dist.barrier()  # nobody tears gloo down while a peer still talks
    finally:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=1, help="1: the plain module; N: N processes, gloo, TP")
    ap.add_argument("-t", "--tokens", type=int, default=2048, help="tokens (2048)")
    ap.add_argument("-H", "--hidden", type=int, default=2048, help="hidden size H; the block is H -> 4H -> H (2048)")
    ap.add_argument("-n", "--iters", type=int, default=3, help="timed passes (3)")
    ap.add_argument("-w", "--warmup", type=int, default=2, help="untimed passes before them (2)")
    ap.add_argument("--csv", help="write a header row and the result here")
    args = ap.parse_args()
    if args.ranks < 1 or args.tokens < 1 or args.hidden < 1 or args.iters < 1 or args.warmup < 0 \
            or args.hidden % args.ranks:
        print("torch_mlp: --ranks, -t, -H, -n >= 1, -w >= 0, and H a multiple of the ranks", file=sys.stderr)
        return 64
    try:
        import torch
        import torch.multiprocessing as mp
    except ImportError:
        print("torch_mlp: torch is not installed for %s" % sys.executable, file=sys.stderr)
        return 3
    if args.ranks == 1:
        torch.set_num_threads(1)
        model = build(torch, args.hidden)
        g = torch.Generator().manual_seed(7)
        x = torch.rand(args.tokens, args.hidden, generator=g) * 2 - 1
        times = passes(torch, model, x, args, lambda: None)
    else:
        with tempfile.TemporaryDirectory() as d:
            queue = mp.get_context("spawn").SimpleQueue()
            try:
                mp.spawn(worker, args=(args, os.path.join(d, "store"), queue), nprocs=args.ranks, join=True)
            except mp.ProcessExitedException as e:
                # a crash in gloo's teardown after the times were sent still
                # leaves them valid; anything earlier leaves the queue empty
                if queue.empty():
                    raise
                print("torch_mlp: note: a rank died at teardown (%s); its times had been sent" % e,
                      file=sys.stderr)
            times = queue.get()
    s = sorted(times)
    n = len(s)
    med = s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
    print("torch %s MLP %d -> %d -> %d, %d tokens, fwd+bwd, %d rank%s: %.3f ms (median of %d after %d; "
          "min %.3f, max %.3f)" % (torch.__version__, args.hidden, 4 * args.hidden, args.hidden, args.tokens,
                                   args.ranks, "" if args.ranks == 1 else "s", med * 1e3, n, args.warmup,
                                   s[0] * 1e3, s[-1] * 1e3))
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("impl,ranks,tokens,hidden,ffn,pass,time_ms,time_min_ms,time_max_ms,iters,warmup,threads,torch\n")
            f.write("torch,%d,%d,%d,%d,fwd+bwd,%.4f,%.4f,%.4f,%d,%d,1,%s\n" % (
                args.ranks, args.tokens, args.hidden, 4 * args.hidden, med * 1e3, s[0] * 1e3, s[-1] * 1e3,
                n, args.warmup, torch.__version__))
    return 0


if __name__ == "__main__":
    sys.exit(main())
