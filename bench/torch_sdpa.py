#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention as tp-bench-attn's peer: the same
shapes, the same timing (one forward without a gradient, one forward +
backward, each from a synchronized device to a synchronized device, median
[min .. max] over the repeats) and the same FLOP count (causal: half of
4 B Hq S^2 D forward, 2.5 times that backward).

    torch_sdpa.py [--device cuda|cpu] [--dtype bf16|f16|f32] [-b B] [-H HEADS]
                  [-K KV_HEADS] [-s SEQ] [-D HEAD_DIM] [--no-causal]
                  [--backend flash|efficient|math|default] [-r REPEATS] [--threads N]

On CUDA --backend flash (the default there) is torch's FlashAttention-2
kernel (torch.nn.attention.sdpa_kernel(SDPBackend.FLASH_ATTENTION)); grouped
kv heads go through enable_gqa. Exit status 2 without torch or the device.
"""
import argparse
import statistics
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "f32"])
    ap.add_argument("-b", type=int, default=1)
    ap.add_argument("-H", type=int, default=32)
    ap.add_argument("-K", type=int, default=8)
    ap.add_argument("-s", type=int, default=4096)
    ap.add_argument("-D", type=int, default=128)
    ap.add_argument("--no-causal", action="store_true")
    ap.add_argument("--backend", default=None,
                    choices=["flash", "efficient", "math", "default"])
    ap.add_argument("-r", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch.set_num_threads (0: torch's default, every core)")
    a = ap.parse_args()
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as e:
        print(f"torch_sdpa: no torch here ({e})", file=sys.stderr)
        return 2
    if a.device == "cuda" and not torch.cuda.is_available():
        print("torch_sdpa: no CUDA device", file=sys.stderr)
        return 2
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    backend = a.backend or ("flash" if a.device == "cuda" else "math")
    dt = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[a.dtype]
    dev = torch.device(a.device)
    g = torch.Generator(device="cpu").manual_seed(1)
    mk = lambda h: torch.randn(a.b, h, a.s, a.D, generator=g).to(dev, dt)
    q, k, v, go = mk(a.H), mk(a.K), mk(a.K), mk(a.H)
    causal = not a.no_causal
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    kinds = {"flash": [SDPBackend.FLASH_ATTENTION],
             "efficient": [SDPBackend.EFFICIENT_ATTENTION],
             "math": [SDPBackend.MATH],
             "default": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                         SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]}[backend]

    def once():
        for t in (q, k, v):
            t.requires_grad_(False)
        sync()
        t0 = time.perf_counter()
        with sdpa_kernel(kinds):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=a.K != a.H)
        sync()
        f = time.perf_counter() - t0
        for t in (q, k, v):
            t.requires_grad_(True)
            t.grad = None
        if a.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        with sdpa_kernel(kinds):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                 enable_gqa=a.K != a.H)
        out.backward(go)
        sync()
        s = time.perf_counter() - t0
        peak = (torch.cuda.max_memory_allocated() - base) if a.device == "cuda" else float("nan")
        return f, s, peak

    once()  # warm-up
    runs = [once() for _ in range(a.r)]
    flop = 4.0 * a.b * a.H * a.s * a.s * a.D * (0.5 if causal else 1.0)
    name = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
    print(f"# torch {torch.__version__} sdpa ({backend}) on {name}: {a.dtype}, B {a.b}, "
          f"heads {a.H}/{a.K} kv, seq {a.s}, head dim {a.D}, "
          f"{'causal' if causal else 'not causal'}; {a.r} repeats, "
          f"{torch.get_num_threads()} threads")
    for i, pas in ((0, "fwd"), (1, "fwd+bwd")):
        ts = sorted(r[i] for r in runs)
        med = statistics.median(ts)
        tf = (flop * (3.5 if i else 1.0)) / med / 1e12
        extra = max(r[2] for r in runs) / 2**20 if i else float("nan")
        print(f"torch  {pas:8s} {med*1e3:9.3f} [{ts[0]*1e3:7.3f} .. {ts[-1]*1e3:7.3f}] "
              f"{tf:10.2f} TFLOP/s {extra:10.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
