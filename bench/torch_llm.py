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
torch loads), one inter-op thread. --attn sdpa: attn_implementation="sdpa"
instead of "eager".

--generate times transformers' greedy decoding instead of the passes:

    python3 bench/torch_llm.py --config /tmp/100m.json --generate -b 1 -s 128 --new-tokens 128

-b prompts of -s tokens each (the same pseudo-random ids, no padding);
one generate call is model.generate(input_ids, attention_mask=ones,
do_sample=False, max_new_tokens=N, min_new_tokens=N, use_cache=True,
pad_token_id=0) under torch.no_grad(), N = --new-tokens (128). A logits
processor stamps time.perf_counter() each time generate calls it (once per new
token, after that step's forward); the start is stamped just before generate.
Per call: ttft = first stamp - start; the N - 1 per-token latencies are the
differences of consecutive stamps; decode tokens/s = batch * (N - 1) / (last
stamp - first stamp); p50 and p99 (nearest rank) of the latencies. -w untimed
calls, then -r timed ones; prints a line per timed call and the median [min ..
max] of decode tokens/s, ttft and p50; with --csv, a header row and one row per
timed call:
impl,model,tp,threads,batch,prompt,new_tokens,ttft_ms,decode_tok_s,tok_ms_p50,tok_ms_p99,rep
(impl "transformers", tp 1).
"""
import argparse
import json
import math
import os
import sys
import time


def median(v):
    s, n = sorted(v), len(v)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def generate_bench(args, torch, transformers, model, ids, name, nparams):
    """--generate: times model.generate token by token; returns the exit status."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Stamp(LogitsProcessor):
        """Records when generate asks for the next token's scores: after that step's forward."""

        def __init__(self):
            self.stamps = []

        def __call__(self, input_ids, scores):
            self.stamps.append(time.perf_counter())
            return scores

    n_new = args.new_tokens
    mask = torch.ones_like(ids)
    results = []
    for i in range(args.warmup + args.reps):
        stamp = Stamp()
        with torch.no_grad():
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n_new,
                                 min_new_tokens=n_new, use_cache=True, pad_token_id=0,
                                 logits_processor=LogitsProcessorList([stamp]))
        st = stamp.stamps
        if len(st) != n_new or out.shape[1] != ids.shape[1] + n_new:
            print("torch_llm: generate made %d tokens and %d stamps, not %d"
                  % (out.shape[1] - ids.shape[1], len(st), n_new), file=sys.stderr)
            return 1
        if i < args.warmup:
            continue
        lat = sorted(b - a for a, b in zip(st, st[1:]))
        r = dict(ttft=(st[0] - t0) * 1e3, tok_s=args.batch * (n_new - 1) / (st[-1] - st[0]),
                 p50=median(lat) * 1e3, p99=lat[math.ceil(0.99 * len(lat)) - 1] * 1e3)
        results.append(r)
        print("rep %d: ttft %.1f ms, decode %.1f tokens/s, per token p50 %.2f ms, p99 %.2f ms"
              % (len(results), r["ttft"], r["tok_s"], r["p50"], r["p99"]))

    def summary(key):
        v = [r[key] for r in results]
        return median(v), min(v), max(v)

    print("torch %s transformers %s %s %.1fM parameters, %s, f32, generate %d x (%d + %d) tokens, "
          "%d thread%s, %d timed after %d: decode %.1f tokens/s [%.1f .. %.1f], "
          "ttft %.1f ms [%.1f .. %.1f], per token p50 %.2f ms [%.2f .. %.2f]"
          % ((torch.__version__, transformers.__version__, name, nparams / 1e6, args.attn, args.batch,
              args.seq, n_new, args.threads, "" if args.threads == 1 else "s", args.reps, args.warmup)
             + summary("tok_s") + summary("ttft") + summary("p50")))
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("impl,model,tp,threads,batch,prompt,new_tokens,ttft_ms,decode_tok_s,tok_ms_p50,"
                    "tok_ms_p99,rep\n")
            for k, r in enumerate(results):
                f.write("transformers,%s,1,%d,%d,%d,%d,%.3f,%.3f,%.3f,%.3f,%d\n"
                        % (name, args.threads, args.batch, args.seq, n_new, r["ttft"], r["tok_s"],
                           r["p50"], r["p99"], k + 1))
    return 0


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
    ap.add_argument("--attn", default="eager", choices=["eager", "sdpa"],
                    help="transformers' attention implementation (eager)")
    ap.add_argument("--generate", action="store_true",
                    help="time greedy generation instead of the fwd / fwd+bwd passes")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens --generate makes (128)")
    args = ap.parse_args()
    if args.batch < 1 or args.seq < 2 or args.threads < 1 or args.reps < 1 or args.warmup < 0:
        print("torch_llm: -b, --threads, -r >= 1, -s >= 2, -w >= 0", file=sys.stderr)
        return 64
    if args.generate and args.new_tokens < 2:
        print("torch_llm: --new-tokens >= 2", file=sys.stderr)
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
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=args.attn, dtype=torch.float32)
    model.train(False)  # no dropout (there is none at attention_dropout 0 either)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
    nparams = sum(p.numel() for p in model.parameters())
    name = args.name or os.path.splitext(os.path.basename(path))[0]
    if args.generate:
        return generate_bench(args, torch, transformers, model, ids, name, nparams)

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
        print("torch %s transformers %s %s %.1fM parameters, %s, f32, %d x %d tokens, %d thread%s, %s: "
              "%.1f ms (median of %d after %d; min %.1f, max %.1f; CPU %.1f ms)%s"
              % (torch.__version__, transformers.__version__, name, nparams / 1e6, args.attn, args.batch,
                 args.seq, args.threads, "" if args.threads == 1 else "s", kind, med * 1e3, n, args.warmup,
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
