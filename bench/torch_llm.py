#!/usr/bin/env python3
"""torch_llm.py - a Llama model in transformers (eager attention, f32, CPU), timed as tp-bench-llm times libtp's.

Started by bench/compare_llm.sh; runs alone too:

    build/bench/tp-bench-llm --dump-config /tmp/100m.json --config 100m
    python3 bench/torch_llm.py --config /tmp/100m.json -b 8 -s 512 --threads 1 -r 3 -w 1

The model: AutoModelForCausalLM.from_config of the config.json (the file
tp-bench-llm --dump-config writes, or a model directory's), with
attn_implementation="eager", in f32, weights as transformers initializes
them. The ids are pseudo-random in [0, vocab). A pass, as in tp-bench-llm:
fwd: model(input_ids, use_cache=False) under torch.no_grad() (the logits of
every position); fwd+bwd: model(input_ids, labels=input_ids, use_cache=False),
loss.backward(), model.zero_grad(set_to_none=True). -w untimed passes, then
-r timed ones; prints the median [min .. max] (and the median CPU time of the
process over a pass, time.process_time()) and, with --csv, writes a header
row and one row per pass kind in tp-bench-llm's columns (impl "torch", tp 1).
--threads T: torch.set_num_threads(T) (OMP/MKL/OpenBLAS threads T, set before
torch loads), one inter-op thread.
"""
import argparse
import json
import os
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="a config.json, or a directory holding one")
    ap.add_argument("-b", "--batch", type=int, default=8, help="sequences (8)")
    ap.add_argument("-s", "--seq", type=int, default=512, help="tokens per sequence (512)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1)")
    ap.add_argument("-p", "--pass", dest="passes", default="both", choices=["fwd", "fwd+bwd", "both"])
    ap.add_argument("-r", "--reps", type=int, default=3, help="timed passes (3)")
    ap.add_argument("-w", "--warmup", type=int, default=1, help="untimed passes before them (1)")
    ap.add_argument("--name", help="the model's name in the CSV (default: the config's file name)")
    ap.add_argument("--csv", help="write a header row and the results here")
    args = ap.parse_args()
    if args.batch < 1 or args.seq < 2 or args.threads < 1 or args.reps < 1 or args.warmup < 0:
        print("torch_llm: -b, --threads, -r >= 1, -s >= 2, -w >= 0", file=sys.stderr)
        return 64
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    try:
        import torch
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as e:
        print("torch_llm: %s (python %s)" % (e, sys.executable), file=sys.stderr)
        return 3
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    path = args.config
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        d = json.load(f)
    model_type = d.pop("model_type", None) or {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                                                "Qwen2ForCausalLM": "qwen2"}[d["architectures"][0]]
    cfg = AutoConfig.for_model(model_type, **d)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    model.train(False)  # no dropout (there is none at attention_dropout 0 either)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
    nparams = sum(p.numel() for p in model.parameters())

    def fwd():
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=False)
        del out
        return None

    def fwd_bwd():
        out = model(input_ids=ids, labels=ids, use_cache=False)
        loss = out.loss
        loss.backward()
        v = loss.item()
        model.zero_grad(set_to_none=True)
        del out, loss
        return v

    kinds = [("fwd", fwd), ("fwd+bwd", fwd_bwd)]
    if args.passes != "both":
        kinds = [k for k in kinds if k[0] == args.passes]
    name = args.name or os.path.splitext(os.path.basename(path))[0]
    rows = []
    for kind, fn in kinds:
        times, cpus, first = [], [], None
        for i in range(args.warmup + args.reps):
            t0, c0 = time.perf_counter(), time.process_time()
            v = fn()
            t, c = time.perf_counter() - t0, time.process_time() - c0
            if first is None:
                first = v
            if i >= args.warmup:
                times.append(t)
                cpus.append(c)
        s = sorted(times)
        n = len(s)
        med = s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
        sc = sorted(cpus)
        cpu = sc[n // 2] if n % 2 else (sc[n // 2 - 1] + sc[n // 2]) / 2
        tokens = args.batch * args.seq
        print("torch %s transformers %s %s %.1fM parameters, eager, f32, %d x %d tokens, %d thread%s, %s: "
              "%.1f ms (median of %d after %d; min %.1f, max %.1f; CPU %.1f ms)%s"
              % (torch.__version__, transformers.__version__, name, nparams / 1e6, args.batch, args.seq,
                 args.threads, "" if args.threads == 1 else "s", kind, med * 1e3, n, args.warmup,
                 s[0] * 1e3, s[-1] * 1e3, cpu * 1e3, "" if first is None else "; loss %.6f" % first))
        rows.append("torch,%s,%d,%d,%d,1,%d,%s,%.3f,%.3f,%.3f,%d,%d,%.1f,,%s,torch %s transformers %s,%d,%.3f\n" % (
            name, nparams, args.batch, args.seq, args.threads, kind, med * 1e3, s[0] * 1e3, s[-1] * 1e3, n,
            args.warmup, tokens / med, "" if first is None else "%.6f" % first, torch.__version__,
            transformers.__version__, len(os.sched_getaffinity(0)), cpu * 1e3))
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("impl,model,params,batch,seq,tp,threads,pass,time_ms,time_min_ms,time_max_ms,"
                    "reps,warmup,tokens_per_s,peak_mib,loss,backend,cores,cpu_ms\n")
            f.writelines(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
