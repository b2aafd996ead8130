/*
 * tp-bench-llm: a Llama model (tp/models.h) on the CPU in f32 (or on CUDA
 * devices in f32, bf16 or f16): the forward, and the forward + backward of
 * the causal-LM loss, at tensor-parallel degrees 1, 2 and 4 (ranks as
 * threads of the shm backend, or one MPI process each), and the loading of
 * a sharded Hugging Face checkpoint against the disk's read rate and each
 * rank's shard.
 *
 *   tp-bench-llm [--config NAME|FILE | --model DIR] [-b B] [-s S] [--tp LIST]
 *                [--threads K] [-p fwd|fwd+bwd|both] [-r REPS] [-w WARMUP]
 *                [--csv FILE] [--plan-at-1] [--backend shm|mpi]
 *                [--device cpu|cuda] [--dtype f32|bf16|f16]
 *   tp-bench-llm -p decode [--new-tokens N] [--config NAME|FILE | --model DIR] [-b B]
 *                [-s PROMPT] [--tp LIST] [--threads K] [-r REPS] [-w WARMUP] [--csv FILE]
 *   tp-bench-llm -p train [--dp N] [--tp N] [--fsdp [--fsdp-ends] | --ddp-bucket-view]
 *                [--recompute none|selective|full[:K]] [--count-memory] [--config NAME|FILE] [-b B] [-s S] [--threads K]
 *                [-r REPS] [-w WARMUP] [--csv FILE]
 *   tp-bench-llm --dump-config FILE [--config NAME|FILE]
 *   tp-bench-llm --save DIR [--config NAME|FILE] [--max-shard-bytes B]
 *   tp-bench-llm --load DIR [--tp N] [-r REPS] [--backend shm|mpi] [--no-drop]
 *
 * Models: --config 100m (default; the ~100M-parameter Llama of issue 32:
 * hidden 768, 12 layers, 12 heads, 4 kv heads, intermediate 2048, vocab
 * 32000, 124.7M parameters with the untied lm_head), 1b (hidden 1536, 8
 * layers, intermediate 4096, 12 heads, 4 kv heads, vocab 32000: 300M
 * parameters, 1.12 GiB in f32, the loading benchmark's), tiny (hidden 64, 2
 * layers, 4 heads, vocab 256: the smoke test's), 8b-layer (one decoder
 * layer of Llama-3-8B's shape: hidden 4096, 32 heads, 8 kv heads, head dim
 * 128, intermediate 14336, rope theta 500000, eps 1e-5, 8192 positions;
 * vocab 1024, so that the layer and not the embedding or lm_head is what a
 * pass times: 226.5M parameters), 8b-stack (the same with 8 layers, for
 * -p decode: 1.75G parameters, 3.3 GiB in bf16), or a config.json (a file
 * or a directory holding one); parameters from tp_module_init (seed 1).
 * --model DIR loads DIR's weights as well (tp_llm_load).
 *
 * A pass: a barrier, then the work, then a barrier; each rank times from its
 * exit of the first to its exit of the second and a pass counts as the
 * slowest rank's. fwd: tp_llm_forward under no-grad (the logits of every
 * position, as transformers' model(input_ids)); fwd+bwd: tp_llm_forward,
 * tp_llm_loss (labels = the ids), tp_backward, tp_module_zero_grad. The ids
 * are pseudo-random in [0, vocab) and the same on every rank. -w untimed
 * passes, then -r timed ones: the table shows the median [min .. max], the
 * tokens per second of the median and the speedup of the median over tp 1
 * (when tp 1 ran), and the peak of libtp's tensor memory during the timed
 * passes (tp_memory_stats: all ranks of the process together).
 *
 * tp 1 runs the plain model (no DTensors), as a single-process user runs
 * it; --plan-at-1 parallelizes it over a mesh of one rank instead (the
 * DTensor dispatch then costs what it costs). tp must divide the attention
 * and the key/value heads (4 kv heads: tp 1, 2, 4); others are skipped
 * with a note. --threads K: OpenBLAS threads (default 1); the setting is
 * process-wide (openblas_set_num_threads), so with shm ranks every rank's
 * GEMMs draw on the same pool of K threads; nominal threads = tp x K.
 *
 * --device cuda (fwd, fwd+bwd, both) builds the model on the GPU (rank r on
 * device r modulo the devices: shm ranks share one GPU, as -p decode's),
 * --dtype bf16|f16 casts it (tp_module_to_dtype; --dtype is CUDA's: the CPU
 * passes are f32), and a pass ends with tp_cuda_synchronize on every rank
 * before its clock is read; the peak is tp_memory_stats of rank 0's
 * device. Beside the passes, measured in the same run on the same GPU
 * (device 0) once the model is freed, what a hand-written program would
 * spend on the same pass:
 *  - GEMMs by hand: the matrix products of one pass at rank 0's shards of
 *    this degree (per layer q [T,H] x [hq*D,H]^T, k and v [T,H] x
 *    [hkv*D,H]^T, o, gate and up [T,H] x [F,H]^T, down [T,F] x [H,F]^T,
 *    then lm_head; fwd+bwd: each one's dX and dW products too; T = batch x
 *    seq; colwise q, k, v, gate, up, lm_head and rowwise o, down sharded
 *    over tp) as cublasGemmEx calls (bench_cuda.h: the model's dtype in and
 *    out, f32 accumulation, CUBLAS_GEMM_DEFAULT) on buffers allocated before
 *    the timing, each run between CUDA events;
 *  - attention by hand: libtp's fused attention
 *    (tp_scaled_dot_product_attention_with: causal, grouped kv heads, the
 *    backend the model's calls get) on plain CUDA tensors q [B, hq, S, D],
 *    k and v [B, hkv, S, D], one call per layer (fwd+bwd: each then
 *    tp_backward with a random gradient), between tp_cuda_synchronize;
 * both for every rank that shares device 0 (tp over the devices, rounded
 * up), max(-w, 1) untimed runs, then -r timed. Per pass the table shows
 * the model's median, the two by hand, and (GEMMs + attention) / model:
 * the median [min .. max] of repetition i's by hand over the model's pass
 * i (target for the fwd+bwd pass: >= 0.85; a missed target is a figure,
 * not a failure). The CSV's rows then end in device, dtype and these.
 * Without a CUDA device --device cuda exits 1 saying so.
 *
 * -p decode: generation through the KV cache (tp_llm_generate, greedy, no
 * eos: every sequence runs N new tokens, default 128) of -b prompts of -s
 * pseudo-random tokens. Per repetition: the time to first token (the
 * prompt's forward and the first token), decode tokens/s (batch x decode
 * steps / their time, the slowest rank's) and the median and p99 of a
 * decode step. Beside them, measured in the same run on this thread:
 *  - GEMMs by hand: the BLAS calls of one decode step at this tp
 *    degree (one rank's shards of q, k, v, o, gate, up, down per layer, the
 *    attention's two products per kv head over the cache at its mean
 *    length, and the lm_head's vocab shard; sgemv for one row, as the
 *    library calls it), timed alone (median of 20);
 *  - host time: the same decode steps run on the meta device (no
 *    arithmetic, no data: what the library does around the kernels) as
 *    rank 0 of a sim world of tp ranks (collectives complete at once), per
 *    step and per layer (median of 50 steps after 5).
 * --device cuda puts the model and its cache on the GPU (rank r on device r
 * modulo the devices: shm ranks share one GPU), --dtype bf16|f16 casts it;
 * the GEMMs by hand are then not run (the CPU's BLAS says nothing there).
 *
 * -p train: training steps (tp_llm_forward, tp_llm_loss, tp_backward,
 * tp_adam_step (AdamW, betas 0.9/0.999), tp_module_zero_grad) of the model
 * on a dp x tp mesh of shm rank threads (--dp N, default 1; --tp N, default
 * 1), parallelized with the standard plan over tp as tests/test_fsdp.c does,
 * then data parallel over dp: DDP (tp_ddp_create, 25 MiB buckets,
 * gradients copied into them) by default, or with --fsdp fully sharded
 * (tp_fully_shard of every block, then of the root; reshard after forward
 * and prefetch on, the defaults); --fsdp-ends also makes model.embed_tokens
 * a unit before the blocks and lm_head one after them (as torchtitan does:
 * the root then holds the final norm only); --ddp-bucket-view: DDP's
 * gradients are views into its buckets (gradient_as_bucket_view). -b is the global batch, split over dp;
 * the tp ranks of a dp rank share its rows. --recompute MODE[:K] sets
 * activation recomputation on the blocks (tp_module_set_recompute_every on
 * model.layers: every K-th, default every one). Per step the slowest
 * rank's time (-w untimed steps, then -r timed). Memory per rank: held
 * (tensor bytes live between steps: parameters, gradients, Adam's state,
 * DDP buckets), kept (live once the loss is computed, less held: what the
 * forward keeps for the backward, the logits and the loss's own included,
 * and under FSDP the root's gathered parameters) and the peak of the timed
 * steps. With --count-memory these are each rank thread's own tensor
 * blocks, counted by an allocator installed for the run (tp_set_allocator:
 * no caching, so its step times are not the usual ones; the largest rank's
 * figures are shown); without it, tp_memory_stats(TP_CPU) of the process
 * divided by the ranks (held and peak only).
 *
 * --load DIR: the model of DIR's config.json built at --tp N (default 4),
 * then per repetition: the page cache dropped (echo 3 >
 * /proc/sys/vm/drop_caches where this process may, else
 * posix_fadvise(DONTNEED) of each file, which only drops what the kernel
 * can: the output says which), the checkpoint's files read with plain 8 MiB
 * read()s (the disk's rate), the cache dropped again and tp_llm_load timed
 * (cold); then the files read again and the load timed again (both from the
 * page cache: warm). Memory during a load: tp_memory_stats' peak of tensor
 * bytes, and the process's peak resident set (VmHWM of /proc/self/status,
 * reset through /proc/self/clear_refs before the load) above its resident
 * set before it, against the rank's shard (its parameters' bytes) and its
 * largest parameter. Both are per process: with --backend mpi (mpirun -np
 * N) that is per rank; with shm the ranks' sum. --save DIR writes the
 * model of --config, initialized, as a checkpoint (tp_llm_save, shards of at
 * most --max-shard-bytes; default 256 MiB) for --load.
 *
 * Exit status: 0 done; 1 a run failed; 2 bad usage.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cblas.h>
#include <tp.h>

#include "bench_cuda.h"
#include "bench_util.h"

#define EXIT_BAD 2
#define MAX_REPS 64
#define MAX_TP 8

static const struct preset {
    const char *name, *json;
} presets[] = {
    {"100m", "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 32000, "
             "\"hidden_size\": 768, \"intermediate_size\": 2048, \"num_hidden_layers\": 12, "
             "\"num_attention_heads\": 12, \"num_key_value_heads\": 4, "
             "\"max_position_embeddings\": 2048, \"rms_norm_eps\": 1e-6, "
             "\"rope_theta\": 10000.0, \"tie_word_embeddings\": false, \"hidden_act\": \"silu\"}"},
    {"1b", "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 32000, "
           "\"hidden_size\": 1536, \"intermediate_size\": 4096, \"num_hidden_layers\": 8, "
           "\"num_attention_heads\": 12, \"num_key_value_heads\": 4, "
           "\"max_position_embeddings\": 2048, \"rms_norm_eps\": 1e-6, "
           "\"rope_theta\": 10000.0, \"tie_word_embeddings\": false, \"hidden_act\": \"silu\"}"},
    {"tiny", "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 256, "
             "\"hidden_size\": 64, \"intermediate_size\": 128, \"num_hidden_layers\": 2, "
             "\"num_attention_heads\": 4, \"num_key_value_heads\": 4, "
             "\"max_position_embeddings\": 512, \"rms_norm_eps\": 1e-6, "
             "\"rope_theta\": 10000.0, \"tie_word_embeddings\": false, \"hidden_act\": \"silu\"}"},
    /* Llama-3-8B's layer; a small vocabulary, so that the layers are what a
     * pass times */
    {"8b-layer", "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 1024, "
                 "\"hidden_size\": 4096, \"intermediate_size\": 14336, \"num_hidden_layers\": 1, "
                 "\"num_attention_heads\": 32, \"num_key_value_heads\": 8, \"head_dim\": 128, "
                 "\"max_position_embeddings\": 8192, \"rms_norm_eps\": 1e-5, "
                 "\"rope_theta\": 500000.0, \"tie_word_embeddings\": false, "
                 "\"hidden_act\": \"silu\"}"},
    {"8b-stack", "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 1024, "
                 "\"hidden_size\": 4096, \"intermediate_size\": 14336, \"num_hidden_layers\": 8, "
                 "\"num_attention_heads\": 32, \"num_key_value_heads\": 8, \"head_dim\": 128, "
                 "\"max_position_embeddings\": 8192, \"rms_norm_eps\": 1e-5, "
                 "\"rope_theta\": 500000.0, \"tie_word_embeddings\": false, "
                 "\"hidden_act\": \"silu\"}"},
};

typedef struct {
    const char *config, *model, *csv, *dump, *save, *load;
    long batch, seq;
    int tps[MAX_TP], ntp;
    int threads, reps, warmup;
    bool fwd, bwd, plan_at_1, mpi, no_drop, decode, cuda;
    bool train, fsdp, count_memory, fsdp_ends, ddp_view; /* -p train */
    int dp, recompute_every;
    tp_recompute_mode recompute;
    long new_tokens;
    tp_dtype dtype; /* the model's dtype (-p decode, or --device cuda) */
    long max_shard;
    tp_llm_config cfg;
    char cfg_name[256];
    int64_t *ids;
} options;

static void usage(FILE *f)
{
    fprintf(f,
            "usage: tp-bench-llm [--config 100m|1b|tiny|8b-layer|8b-stack|FILE | --model DIR]\n"
            "                    [-b BATCH] [-s SEQ] [--tp LIST] [--threads K] [-p fwd|fwd+bwd|both]\n"
            "                    [-r REPS] [-w WARMUP] [--csv FILE] [--plan-at-1] [--backend shm|mpi]\n"
            "                    [--device cpu|cuda] [--dtype f32|bf16|f16 (with --device cuda)]\n"
            "       tp-bench-llm -p decode [--new-tokens N] [--config NAME|FILE | --model DIR]\n"
            "                    [-b B] [-s PROMPT] [--tp LIST] [--threads K] [-r R] [-w W] [--csv F]\n"
            "                    [--device cpu|cuda] [--dtype f32|bf16|f16]\n"
            "       tp-bench-llm -p train [--dp N] [--tp N] [--fsdp [--fsdp-ends] | --ddp-bucket-view]\n"
            "                    [--recompute none|selective|full[:K]] [--count-memory] [--config NAME|FILE] [-b B] [-s S] [-r R] [-w W]\n"
            "                    [--csv F]\n"
            "       tp-bench-llm --dump-config FILE [--config NAME|FILE]\n"
            "       tp-bench-llm --save DIR [--config NAME|FILE] [--max-shard-bytes B]\n"
            "       tp-bench-llm --load DIR [--tp N] [-r REPS] [--backend shm|mpi] [--no-drop]\n"
            "defaults: --config 100m -b 8 -s 512 --tp 1,2,4 --threads 1 -p both -r 3 -w 1;\n"
            "--load: --tp 4 -r 3; --save: --max-shard-bytes 268435456\n");
}

static int bad(const char *fmt, const char *a)
{
    fprintf(stderr, "tp-bench-llm: ");
    fprintf(stderr, fmt, a);
    fprintf(stderr, "\n");
    usage(stderr);
    return EXIT_BAD;
}

static bool parse_long(const char *s, long lo, long hi, long *out)
{
    char *end = NULL;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi)
        return false;
    *out = v;
    return true;
}

static bool parse_tps(const char *s, options *o)
{
    char buf[128];
    if (strlen(s) >= sizeof buf)
        return false;
    strcpy(buf, s);
    o->ntp = 0;
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        long v;
        if (o->ntp == MAX_TP || !parse_long(t, 1, 64, &v))
            return false;
        o->tps[o->ntp++] = (int)v;
    }
    return o->ntp > 0;
}

static int load_config(options *o)
{
    const char *spec = o->model ? o->model : o->config ? o->config : "100m";
    for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++)
        if (!strcmp(spec, presets[i].name)) {
            if (tp_llm_config_parse(presets[i].json, &o->cfg) != TP_OK) {
                fprintf(stderr, "tp-bench-llm: preset %s: %s\n", spec, tp_last_error());
                return 1;
            }
            snprintf(o->cfg_name, sizeof o->cfg_name, "%s", spec);
            return 0;
        }
    struct stat sb;
    if (stat(spec, &sb) != 0)
        return bad("--config '%s': neither 100m, 1b, tiny, 8b-layer, 8b-stack nor a config.json "
                   "file or directory",
                   spec);
    if (tp_llm_config_load(spec, &o->cfg) != TP_OK) {
        fprintf(stderr, "tp-bench-llm: %s\n", tp_last_error());
        return EXIT_BAD;
    }
    snprintf(o->cfg_name, sizeof o->cfg_name, "%s", spec);
    return 0;
}

static bool takes_value(const char *a)
{
    static const char *const valued[] = {"--config", "--model", "-b", "-s", "--tp", "--threads",
                                         "-p", "-r", "-w", "--csv", "--backend", "--dump-config",
                                         "--save", "--load", "--max-shard-bytes",
                                         "--new-tokens", "--device", "--dtype", "--dp",
                                         "--recompute"};
    for (size_t i = 0; i < sizeof valued / sizeof valued[0]; i++)
        if (!strcmp(a, valued[i]))
            return true;
    return false;
}

static int parse_args(int argc, char **argv, options *o)
{
    memset(o, 0, sizeof *o);
    o->batch = 8;
    o->seq = 512;
    o->threads = 1;
    o->reps = 3;
    o->warmup = 1;
    o->fwd = o->bwd = true;
    o->max_shard = 256L << 20;
    o->new_tokens = 128;
    bool tp_given = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        long n = 0;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            exit(0);
        } else if (!strcmp(a, "--plan-at-1")) {
            o->plan_at_1 = true;
            continue;
        } else if (!strcmp(a, "--no-drop")) {
            o->no_drop = true;
            continue;
        } else if (!strcmp(a, "--fsdp")) {
            o->fsdp = true;
            continue;
        } else if (!strcmp(a, "--count-memory")) {
            o->count_memory = true;
            continue;
        } else if (!strcmp(a, "--fsdp-ends")) {
            o->fsdp_ends = true;
            continue;
        } else if (!strcmp(a, "--ddp-bucket-view")) {
            o->ddp_view = true;
            continue;
        }
        if (a[0] != '-')
            return bad("unexpected argument '%s'", a);
        if (!takes_value(a))
            return bad("unknown option '%s'", a);
        if (!v)
            return bad("%s needs a value", a);
        i++;
        if (!strcmp(a, "--config"))
            o->config = v;
        else if (!strcmp(a, "--model"))
            o->model = v;
        else if (!strcmp(a, "--csv"))
            o->csv = v;
        else if (!strcmp(a, "--dump-config"))
            o->dump = v;
        else if (!strcmp(a, "--save"))
            o->save = v;
        else if (!strcmp(a, "--load"))
            o->load = v;
        else if (!strcmp(a, "-b") || !strcmp(a, "-s")) {
            if (!parse_long(v, 1, 1L << 20, &n))
                return bad("%s needs a count >= 1", a);
            *(a[1] == 'b' ? &o->batch : &o->seq) = n;
        } else if (!strcmp(a, "--tp")) {
            if (!parse_tps(v, o))
                return bad("--tp '%s' is not a list of counts in 1..64 (e.g. 1,2,4)", v);
            tp_given = true;
        } else if (!strcmp(a, "--threads")) {
            if (!parse_long(v, 1, 256, &n))
                return bad("--threads '%s' is not a count in 1..256", v);
            o->threads = (int)n;
        } else if (!strcmp(a, "-r")) {
            if (!parse_long(v, 1, MAX_REPS, &n))
                return bad("-r '%s' is not a count in 1..64", v);
            o->reps = (int)n;
        } else if (!strcmp(a, "-w")) {
            if (!parse_long(v, 0, 100, &n))
                return bad("-w '%s' is not a count in 0..100", v);
            o->warmup = (int)n;
        } else if (!strcmp(a, "--max-shard-bytes")) {
            if (!parse_long(v, 1, 1L << 50, &n))
                return bad("--max-shard-bytes '%s' is not a positive size", v);
            o->max_shard = n;
        } else if (!strcmp(a, "--device")) {
            if (strcmp(v, "cpu") && strcmp(v, "cuda"))
                return bad("--device '%s': cpu or cuda", v);
            o->cuda = !strcmp(v, "cuda");
        } else if (!strcmp(a, "--dtype")) {
            if (!strcmp(v, "f32") || !strcmp(v, "bf16") || !strcmp(v, "f16"))
                o->dtype = v[0] == 'b' ? TP_BF16 : v[1] == '1' ? TP_F16 : TP_F32;
            else
                return bad("--dtype '%s': f32, bf16 or f16", v);
        } else if (!strcmp(a, "--new-tokens")) {
            if (!parse_long(v, 2, 1L << 20, &n))
                return bad("--new-tokens '%s' is not a count >= 2", v);
            o->new_tokens = n;
        } else if (!strcmp(a, "--dp")) {
            if (!parse_long(v, 1, 64, &n))
                return bad("--dp '%s' is not a count in 1..64", v);
            o->dp = (int)n;
        } else if (!strcmp(a, "--recompute")) {
            const char *colon = strchr(v, ':');
            const size_t len = colon ? (size_t)(colon - v) : strlen(v);
            long every = 1;
            if (len == 4 && !strncmp(v, "none", 4))
                o->recompute = TP_RECOMPUTE_NONE;
            else if (len == 4 && !strncmp(v, "full", 4))
                o->recompute = TP_RECOMPUTE_FULL;
            else if (len == 9 && !strncmp(v, "selective", 9))
                o->recompute = TP_RECOMPUTE_SELECTIVE;
            else
                return bad("--recompute '%s': none, full or selective, with :K for every K-th block",
                           v);
            if (colon && !parse_long(colon + 1, 1, 1L << 20, &every))
                return bad("--recompute '%s': K (after ':') is not a count >= 1", v);
            o->recompute_every = (int)every;
        } else if (!strcmp(a, "-p")) {
            o->train = !strcmp(v, "train");
            if (o->train) {
                o->fwd = o->bwd = false;
                continue;
            }
            o->decode = !strcmp(v, "decode");
            o->fwd = !strcmp(v, "fwd") || !strcmp(v, "both");
            o->bwd = !strcmp(v, "fwd+bwd") || !strcmp(v, "both");
            if (!o->fwd && !o->bwd && !o->decode)
                return bad("-p '%s': fwd, fwd+bwd, both, decode or train", v);
        } else if (!strcmp(a, "--backend")) {
            if (strcmp(v, "shm") && strcmp(v, "mpi"))
                return bad("--backend '%s': shm or mpi", v);
            o->mpi = !strcmp(v, "mpi");
        }
    }
    if ((o->dp || o->fsdp || o->count_memory || o->recompute_every || o->fsdp_ends ||
         o->ddp_view) && !o->train)
        return bad("%s", "--dp, --fsdp, --fsdp-ends, --ddp-bucket-view, --recompute and "
                         "--count-memory are -p train's");
    if (o->fsdp_ends && !o->fsdp)
        return bad("%s", "--fsdp-ends is --fsdp's");
    if (o->ddp_view && o->fsdp)
        return bad("%s", "--ddp-bucket-view is DDP's (not with --fsdp)");
    if (o->train) {
        if (!o->dp)
            o->dp = 1;
        if (!o->recompute_every)
            o->recompute_every = 1;
        if (o->mpi)
            return bad("%s", "-p train runs shm rank threads (no --backend mpi)");
        if (!tp_given)
            o->tps[0] = 1, o->ntp = 1;
        if (o->ntp != 1)
            return bad("%s", "-p train runs one --tp N (on a dp x tp mesh)");
        if (o->dp * o->tps[0] > 64)
            return bad("%s", "-p train: dp x tp is at most 64 ranks");
        if (o->batch % o->dp)
            return bad("%s", "-p train: -b (the global batch) must be a multiple of --dp");
        if (o->fsdp && o->dp < 2)
            return bad("%s", "--fsdp shards over dp: needs --dp 2 or more");
        tp_given = true;
    }
    if ((o->cuda || o->dtype != TP_F32) && (o->train || o->dump || o->save || o->load))
        return bad("%s", "--device and --dtype are -p fwd, fwd+bwd, both and decode's");
    if (o->dtype != TP_F32 && !o->cuda && !o->decode)
        return bad("%s", "--dtype bf16|f16 of -p fwd, fwd+bwd and both needs --device cuda (the "
                         "CPU passes are f32)");
    if (!!o->dump + !!o->save + !!o->load > 1)
        return bad("%s", "--dump-config, --save and --load exclude each other");
    if (o->model && o->config)
        return bad("%s", "--model DIR and --config exclude each other");
    if (o->load && (o->model || o->config))
        return bad("%s", "--load DIR builds the model of DIR's config.json: no --config/--model");
    if (!tp_given) {
        o->ntp = 0;
        if (o->load)
            o->tps[o->ntp++] = 4;
        else
            for (int t = 1; t <= 4; t *= 2)
                o->tps[o->ntp++] = t;
    }
    if (o->load && o->ntp != 1)
        return bad("%s", "--load times one --tp N");
    if (o->mpi && o->ntp != 1)
        return bad("%s", "--backend mpi runs one --tp N (the mpirun -np)");
    if (o->load) {
        o->config = o->load;
        int rc = load_config(o);
        o->config = NULL;
        return rc;
    }
    int rc = load_config(o);
    if (rc)
        return rc;
    if ((o->bwd || o->train) && o->seq < 2 && !o->dump && !o->save)
        return bad("%s", "fwd+bwd needs -s 2 or more (the loss predicts the next token)");
    return 0;
}

static double param_count(const tp_llm_config *c)
{
    return (double)c->vocab_size * c->hidden_size * (c->tie_word_embeddings ? 1 : 2) +
           (double)c->num_hidden_layers *
               ((double)c->hidden_size * c->head_dim *
                    (2 * c->num_attention_heads + 2 * c->num_key_value_heads) +
                3.0 * c->hidden_size * c->intermediate_size + 2.0 * c->hidden_size) +
           c->hidden_size;
}

static void config_line(const options *o, char *buf, size_t n)
{
    const tp_llm_config *c = &o->cfg;
    snprintf(buf, n,
             "%s %s (hidden %lld, %lld layers, %lld heads, %lld kv heads, intermediate %lld, "
             "vocab %lld; %.1fM parameters)",
             tp_llm_arch_name(c->arch), o->cfg_name, (long long)c->hidden_size,
             (long long)c->num_hidden_layers, (long long)c->num_attention_heads,
             (long long)c->num_key_value_heads, (long long)c->intermediate_size,
             (long long)c->vocab_size, param_count(c) / 1e6);
}

/* ---- shared by the rank functions ------------------------------------------------ */

/* The model of o->cfg on a 1-D mesh over world: parallelized with the standard
 * plan when the world has several ranks (or plan_at_1), then initialized
 * (seed 1) or loaded from dir. */
static tp_status build_model(tp_comm *w, const options *o, bool plan, const char *dir,
                             tp_mesh **mesh, tp_module **model)
{
    tp_status st = TP_OK;
    const int64_t n = tp_comm_size(w);
    TRY(tp_mesh_create(w, 1, &n, (const char *[]){"tp"}, mesh));
    TRY(tp_llm_create(&o->cfg, model));
    if (plan) {
        const tp_parallelize_options po = {.src_data_rank = TP_SRC_DATA_RANK_NONE};
        TRY(tp_llm_parallelize(*model, *mesh, 0, NULL, &po));
    }
    if (dir)
        TRY(tp_llm_load(*model, dir));
    else
        TRY(tp_module_init(*model, 1));
out:
    return st;
}

/* The per-rank values v[0..n) replaced by their maximum over the world. */
static tp_status max_over(tp_comm *w, double *v, int64_t n)
{
    if (tp_comm_size(w) == 1)
        return TP_OK;
    tp_tensor *t = NULL;
    tp_status st = tp_tensor_from_blob(TP_F64, TP_CPU, 1, &n, v, NULL, NULL, &t);
    if (st == TP_OK)
        st = tp_all_reduce(w, t, t, TP_MAX, NULL);
    tp_tensor_release(t);
    return st;
}

/* ---- the timed passes ------------------------------------------------------------- */

typedef struct {
    const options *o;
    int tp;
    double fwd[MAX_REPS], bwd[MAX_REPS]; /* seconds, the slowest rank's */
    double cpu_fwd[MAX_REPS], cpu_bwd[MAX_REPS]; /* CPU seconds of rank 0's process */
    double peak_fwd, peak_bwd;           /* bytes above the start of the passes */
    double loss;
    /* --device cuda: per pass kind (fwd, fwd+bwd) and timed repetition, the
     * GEMMs and the attention by hand (seconds; NaN where they failed), the
     * ranks on device 0 they count, and the GEMMs' FLOPs */
    double hand_gemm[2][MAX_REPS], hand_attn[2][MAX_REPS];
    int share;
    double gemm_flop[2];
} perf_run;

/* CPU seconds of this process, all its threads. */
static double cpu_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static tp_status fwd_pass(tp_module *m, tp_tensor *ids)
{
    tp_tensor *logits = NULL;
    tp_no_grad_begin();
    tp_status st = tp_llm_forward(m, ids, NULL, NULL, &logits);
    tp_no_grad_end();
    tp_tensor_release(logits);
    return st;
}

/* ids: on the model's device, for the forward; labels: the same ids on the
 * CPU, for the loss (the same tensor on the CPU). */
static tp_status bwd_pass(tp_module *m, tp_tensor *ids, tp_tensor *labels, double *loss_out)
{
    tp_tensor *logits = NULL, *loss = NULL;
    tp_status st = tp_llm_forward(m, ids, NULL, NULL, &logits);
    if (st == TP_OK)
        st = tp_llm_loss(logits, labels, &loss);
    if (st == TP_OK && loss_out) {
        const tp_tensor *l = tp_tensor_is_dtensor(loss) ? tp_dtensor_local(loss) : loss;
        if (tp_tensor_device(l).type == TP_DEVICE_CPU && tp_tensor_dtype(l) == TP_F32)
            *loss_out = *(const float *)tp_tensor_data(l);
        else /* a device's, or a low-precision one: one synchronous read */
            st = tp_tensor_get(l, NULL, loss_out);
    }
    if (st == TP_OK)
        st = tp_backward(loss, NULL);
    tp_tensor_release(loss);
    tp_tensor_release(logits);
    tp_module_zero_grad(m);
    return st;
}

static tp_status perf_rank(tp_comm *w, void *arg)
{
    perf_run *r = arg;
    const options *o = r->o;
    const bool lead = tp_comm_rank(w) == 0;
    tp_status st = TP_OK;
    tp_mesh *mesh = NULL;
    tp_module *model = NULL;
    tp_tensor *ids = NULL, *ids_dev = NULL, *fwd_ids = NULL;
    double fwd[MAX_REPS] = {0}, bwd[MAX_REPS] = {0};
    tp_device dev = TP_CPU;
    if (o->cuda) { /* main() saw a device: rank r on device r modulo the devices */
        dev = TP_CUDA(tp_comm_rank(w) % tp_cuda_device_count());
        TRY(tp_nn_set_default_device(dev));
    }
    st = build_model(w, o, r->tp > 1 || o->plan_at_1, o->model, &mesh, &model);
    if (o->cuda)
        tp_nn_set_default_device(TP_CPU);
    TRY(st);
    if (o->dtype != TP_F32)
        TRY(tp_module_to_dtype(model, o->dtype));
    TRY(tp_tensor_from_data(TP_I64, 2, (const int64_t[]){o->batch, o->seq}, o->ids, &ids));
    if (o->cuda) /* the forward's ids on the model's device; the loss's on the CPU */
        TRY(tp_tensor_to(ids, TP_I64, dev, &ids_dev));
    fwd_ids = ids_dev ? ids_dev : ids;
    for (int kind = 0; kind < 2; kind++) {
        if (!(kind == 0 ? o->fwd : o->bwd))
            continue;
        double *times = kind == 0 ? fwd : bwd;
        size_t base = 0;
        for (int i = 0; i < o->warmup + o->reps; i++) {
            if (i == o->warmup) {
                TRY(tp_barrier(w, NULL));
                if (lead) {
                    tp_memory_info mi;
                    tp_memory_stats(dev, &mi);
                    base = mi.allocated;
                    tp_memory_reset_peak(dev);
                }
            }
            TRY(tp_barrier(w, NULL));
            const double t0 = bench_now_s(), c0 = cpu_now_s();
            if (kind == 0)
                TRY(fwd_pass(model, fwd_ids));
            else
                TRY(bwd_pass(model, fwd_ids, ids, i == 0 && lead ? &r->loss : NULL));
            if (o->cuda) /* the pass's kernels are done before the clock is read */
                TRY(tp_cuda_synchronize(dev.index));
            TRY(tp_barrier(w, NULL));
            if (i >= o->warmup) {
                times[i - o->warmup] = bench_now_s() - t0;
                if (lead)
                    (kind == 0 ? r->cpu_fwd : r->cpu_bwd)[i - o->warmup] = cpu_now_s() - c0;
            }
        }
        TRY(tp_barrier(w, NULL));
        if (lead) {
            tp_memory_info mi;
            tp_memory_stats(dev, &mi);
            *(kind == 0 ? &r->peak_fwd : &r->peak_bwd) = (double)(mi.peak_allocated - base);
        }
        TRY(max_over(w, times, o->reps));
    }
    if (lead) {
        memcpy(r->fwd, fwd, sizeof fwd);
        memcpy(r->bwd, bwd, sizeof bwd);
    }
out:
    tp_tensor_release(ids_dev);
    tp_tensor_release(ids);
    tp_module_free(model);
    tp_mesh_free(mesh);
    if (o->cuda) /* everything freed before the by hand runs on the device */
        tp_cuda_synchronize(dev.index);
    if (st != TP_OK && o->mpi)
        tp_comm_abort(w, "tp-bench-llm: a rank failed");
    return st;
}

/* Runs fn over tp ranks: threads (shm), or this process as one of mpirun's. */
static tp_status run_ranks(const options *o, int tp, tp_rank_fn fn, void *arg, int *world_rank)
{
    *world_rank = 0;
    if (!o->mpi)
        return tp_run_local(tp, fn, arg);
    tp_comm *world = NULL;
    tp_status st = tp_comm_create_world("mpi", NULL, &world);
    if (st != TP_OK) {
        fprintf(stderr, "tp-bench-llm: --backend mpi: %s\n", tp_last_error());
        return st;
    }
    *world_rank = tp_comm_rank(world);
    if (tp_comm_size(world) != tp) {
        if (*world_rank == 0)
            fprintf(stderr, "tp-bench-llm: mpirun started %d processes; --tp %d needs %d\n",
                    tp_comm_size(world), tp, tp);
        st = TP_ERR_INVALID_ARG;
    } else {
        st = fn(world, arg);
    }
    tp_comm_free(world);
    return st;
}

/* Runs fn (its per-degree state `run`, whose options and degree the caller
 * set) at degree o->tps[k], unless that degree cannot split the heads (a
 * note); false when skipped or failed (then *status 1 and a message). */
static bool run_degree(const options *o, int k, tp_rank_fn fn, void *run, int *world_rank,
                       int *status)
{
    const int tp = o->tps[k];
    if (o->cfg.num_attention_heads % tp || o->cfg.num_key_value_heads % tp) {
        printf("# tp %d skipped: it does not divide %lld attention heads and %lld kv heads\n", tp,
               (long long)o->cfg.num_attention_heads, (long long)o->cfg.num_key_value_heads);
        return false;
    }
    tp_status st = run_ranks(o, tp, fn, run, world_rank);
    if (st != TP_OK) {
        if (*world_rank == 0)
            fprintf(stderr, "tp-bench-llm: tp %d failed: %s (%s)\n", tp, tp_status_name(st),
                    tp_last_error());
        *status = 1;
        return false;
    }
    return true;
}

static void stats(double *v, int n, double *med, double *lo, double *hi)
{
    double c[MAX_REPS];
    memcpy(c, v, sizeof *v * (size_t)n);
    *med = bench_median(c, n); /* sorts c */
    *lo = c[0];
    *hi = c[n - 1];
}

/* ---- --device cuda: the pass by hand ----------------------------------------------- */

#if TP_HAVE_CUDA
/* The products of one pass at rank 0's shards of degree tp (bench_cuda.h's
 * form), for `share` ranks: per rank, each layer's forward of q, k, v, o,
 * gate, up and down, then lm_head's; with bwd then lm_head's dX and dW and
 * each layer's (the last layer first, down to q). A new array of *n
 * products, NULL when memory runs out; *flop: their FLOPs. */
static bench_gemm *pass_gemms(const options *o, int tp, bool bwd, int share, int *n,
                              double *flop)
{
    const tp_llm_config *c = &o->cfg;
    const int T = (int)(o->batch * o->seq), H = (int)c->hidden_size, D = (int)c->head_dim;
    const int hq = (int)(c->num_attention_heads / tp), hkv = (int)(c->num_key_value_heads / tp);
    const int F = (int)(c->intermediate_size / tp), V = (int)((c->vocab_size + tp - 1) / tp);
    const int L = (int)c->num_hidden_layers;
    /* Linear (out, in), y = x W^T: colwise q, k, v, gate, up; rowwise o, down */
    const int outs[7] = {hq * D, hkv * D, hkv * D, H, F, F, H};
    const int ins[7] = {H, H, H, hq * D, H, H, F};
    const size_t per = (size_t)(7 * L + 1) * (bwd ? 3 : 1);
    bench_gemm *g = malloc(sizeof *g * per * (size_t)share);
    if (!g)
        return NULL;
    int k = 0;
    for (int r = 0; r < share; r++) {
        for (int l = 0; l < L; l++)
            for (int j = 0; j < 7; j++)
                g[k++] = (bench_gemm){T, outs[j], ins[j], false, true};
        g[k++] = (bench_gemm){T, V, H, false, true};
        if (!bwd)
            continue;
        g[k++] = (bench_gemm){T, H, V, false, false}; /* dX = dY W */
        g[k++] = (bench_gemm){V, H, T, true, false};  /* dW = dY^T X */
        for (int l = L - 1; l >= 0; l--)
            for (int j = 6; j >= 0; j--) {
                g[k++] = (bench_gemm){T, ins[j], outs[j], false, false};
                g[k++] = (bench_gemm){outs[j], ins[j], T, true, false};
            }
    }
    *n = k;
    *flop = 0;
    for (int i = 0; i < k; i++)
        *flop += 2.0 * g[i].m * g[i].n * g[i].k;
    return g;
}

/* The attention of one pass at degree tp by hand on device 0, for `share`
 * ranks: libtp's fused attention (causal, grouped kv heads, the default
 * backend as the model's calls) on q [B, hq, S, D], k, v [B, hkv, S, D]
 * of the model's dtype, one call per layer and rank; with bwd each then
 * tp_backward with the random gradient g (q's shape). in[3] and g: the
 * caller's tensors on device 0. max(-w, 1) untimed runs, then -r timed
 * ones between tp_cuda_synchronize: times[0..reps) seconds. */
static tp_status attn_by_hand(const options *o, bool bwd, int share, tp_tensor *const *in,
                              tp_tensor *g, double *times)
{
    const tp_sdpa_options so = {.causal = true};
    const int64_t calls = o->cfg.num_hidden_layers * share;
    const int warm = o->warmup > 0 ? o->warmup : 1;
    tp_status st = TP_OK;
    for (int i = 0; i < 3 && st == TP_OK; i++)
        st = tp_tensor_set_requires_grad(in[i], bwd);
    if (st == TP_OK)
        st = tp_cuda_synchronize(0);
    for (int it = -warm; it < o->reps && st == TP_OK; it++) {
        const double t0 = bench_now_s();
        if (!bwd)
            tp_no_grad_begin();
        for (int64_t l = 0; l < calls && st == TP_OK; l++) {
            tp_tensor *out = NULL;
            st = tp_scaled_dot_product_attention_with(in[0], in[1], in[2], &so, &out);
            if (st == TP_OK && bwd)
                st = tp_backward(out, g);
            tp_tensor_release(out);
            for (int i = 0; i < 3 && bwd; i++)
                tp_tensor_zero_grad(in[i]);
        }
        if (!bwd)
            tp_no_grad_end();
        if (st == TP_OK)
            st = tp_cuda_synchronize(0);
        if (it >= 0)
            times[it] = bench_now_s() - t0;
    }
    return st;
}

/* The GEMMs and the attention of each pass kind r ran, by hand on device 0
 * for the ranks that shared it (r->share): r->hand_gemm, r->hand_attn (NaN
 * where one failed: then a message and false). */
static bool pass_by_hand(const options *o, perf_run *r)
{
    const tp_llm_config *c = &o->cfg;
    const int n = tp_cuda_device_count(), tp = r->tp;
    bool ok = true;
    r->share = (tp + n - 1) / n; /* ranks 0, n, 2n, ... are on device 0 */
    for (int kind = 0; kind < 2; kind++)
        for (int i = 0; i < o->reps; i++)
            r->hand_gemm[kind][i] = r->hand_attn[kind][i] = NAN;
    if (o->batch * o->seq > INT_MAX) {
        fprintf(stderr, "tp-bench-llm: tp %d: the GEMMs by hand take int sizes: %ld tokens are "
                "too many\n", tp, o->batch * o->seq);
        return false;
    }
    /* the model's memory back to the device for the buffers below */
    tp_memory_empty_cache(TP_CUDA(0));
    for (int kind = 0; kind < 2; kind++) {
        if (!(kind == 0 ? o->fwd : o->bwd))
            continue;
        int count = 0;
        char err[256] = "";
        bench_gemm *g = pass_gemms(o, tp, kind == 1, r->share, &count, &r->gemm_flop[kind]);
        if (!g)
            snprintf(err, sizeof err, "out of memory");
        const double med = g ? bench_cuda_gemms(0, o->dtype, g, count, o->warmup > 0 ? o->warmup : 1,
                                                o->reps, r->hand_gemm[kind], err, sizeof err)
                             : -1;
        free(g);
        if (med < 0) {
            fprintf(stderr, "tp-bench-llm: tp %d %s: the GEMMs by hand: %s\n", tp,
                    kind == 0 ? "fwd" : "fwd+bwd", err);
            for (int i = 0; i < o->reps; i++)
                r->hand_gemm[kind][i] = NAN;
            ok = false;
        }
    }
    const int64_t hq = c->num_attention_heads / tp, hkv = c->num_key_value_heads / tp;
    const int64_t shp[2][4] = {{o->batch, hq, o->seq, c->head_dim},
                               {o->batch, hkv, o->seq, c->head_dim}};
    tp_tensor *in[3] = {NULL, NULL, NULL}, *grad = NULL;
    tp_status st = TP_OK;
    for (int i = 0; i < 4 && st == TP_OK; i++) {
        tp_tensor **t = i < 3 ? &in[i] : &grad;
        st = tp_tensor_empty(o->dtype, TP_CUDA(0), 4, shp[i == 1 || i == 2], t);
        if (st == TP_OK)
            st = tp_tensor_fill_random(*t, TP_RNG_NORMAL, 0, 1, (uint64_t)i + 1, NULL, NULL);
    }
    if (st != TP_OK)
        fprintf(stderr, "tp-bench-llm: tp %d: the attention by hand's inputs: %s (%s)\n", tp,
                tp_status_name(st), tp_last_error());
    for (int kind = 0; kind < 2 && st == TP_OK; kind++) {
        if (!(kind == 0 ? o->fwd : o->bwd))
            continue;
        st = attn_by_hand(o, kind == 1, r->share, in, grad, r->hand_attn[kind]);
        if (st != TP_OK) {
            fprintf(stderr, "tp-bench-llm: tp %d %s: the attention by hand: %s (%s)\n", tp,
                    kind == 0 ? "fwd" : "fwd+bwd", tp_status_name(st), tp_last_error());
            for (int i = 0; i < o->reps; i++)
                r->hand_attn[kind][i] = NAN;
        }
    }
    for (int i = 0; i < 3; i++)
        tp_tensor_release(in[i]);
    tp_tensor_release(grad);
    tp_cuda_synchronize(0);
    tp_memory_empty_cache(TP_CUDA(0));
    return ok && st == TP_OK;
}
#endif

/* A pass kind's figures by hand (--device cuda): the medians of the GEMMs
 * and the attention, the GEMMs' TFLOP/s at their median, and (GEMMs +
 * attention) / model: the median [min .. max] of repetition i's by hand over
 * the model's pass i (NaN where one failed). */
typedef struct {
    double model, gemm, attn, tflops, ratio, ratio_lo, ratio_hi;
} hand_figures;

static void hand_stats(const options *o, const perf_run *r, int kind, hand_figures *h)
{
    double lo, hi, ratio[MAX_REPS];
    const double *model = kind == 0 ? r->fwd : r->bwd;
    stats((double *)model, o->reps, &h->model, &lo, &hi);
    stats((double *)r->hand_gemm[kind], o->reps, &h->gemm, &lo, &hi);
    stats((double *)r->hand_attn[kind], o->reps, &h->attn, &lo, &hi);
    bool ok = !isnan(h->gemm) && !isnan(h->attn);
    for (int i = 0; i < o->reps; i++) {
        ratio[i] = (r->hand_gemm[kind][i] + r->hand_attn[kind][i]) / model[i];
        ok = ok && !isnan(ratio[i]);
    }
    h->tflops = r->gemm_flop[kind] / h->gemm / 1e12;
    if (ok)
        stats(ratio, o->reps, &h->ratio, &h->ratio_lo, &h->ratio_hi);
    else
        h->ratio = h->ratio_lo = h->ratio_hi = NAN;
}

/* The pass by hand against the model's, per degree and pass kind. */
static void print_by_hand(const options *o, const perf_run *runs, const bool *ran,
                          const char *gpu)
{
    printf("# by hand, in the same run on device 0 (%s), after the model is freed: GEMMs = "
           "cublasGemmEx (%s in and out, f32 accumulation, CUBLAS_GEMM_DEFAULT) of one pass's "
           "products at rank 0's shards (per layer q, k, v, o, gate, up, down, then lm_head; "
           "fwd+bwd: each one's dX and dW too), timed with CUDA events; attn = libtp's fused "
           "attention (tp_scaled_dot_product_attention_with, causal, %lld/%lld heads, head dim "
           "%lld) on plain tensors, one call per layer (fwd+bwd: and its backward), to "
           "tp_cuda_synchronize; both for each rank on device 0 (ranks: the count), %d timed "
           "after %d; hand/model: (GEMMs + attn) / the model's pass, the median [min .. max] "
           "of repetition i over pass i; target for fwd+bwd: >= 0.85\n",
           gpu, tp_dtype_name(o->dtype), (long long)o->cfg.num_attention_heads,
           (long long)o->cfg.num_key_value_heads, (long long)o->cfg.head_dim, o->reps,
           o->warmup > 0 ? o->warmup : 1);
    printf("%3s %5s %8s %10s %10s %12s %10s %10s %26s %16s\n", "tp", "ranks", "pass",
           "model ms", "GEMMs ms", "GEMM TFLOP/s", "attn ms", "hand ms", "hand/model [min .. max]",
           "target");
    for (int kind = 0; kind < 2; kind++) {
        if (!(kind == 0 ? o->fwd : o->bwd))
            continue;
        for (int k = 0; k < o->ntp; k++) {
            if (!ran[k])
                continue;
            const perf_run *r = &runs[k];
            hand_figures h;
            hand_stats(o, r, kind, &h);
            char spread[64], target[32] = "-";
            snprintf(spread, sizeof spread, "%.3f [%.3f .. %.3f]", h.ratio, h.ratio_lo,
                     h.ratio_hi);
            if (kind == 1 && !isnan(h.ratio))
                snprintf(target, sizeof target, ">= 0.85: %s", h.ratio >= 0.85 ? "met" : "missed");
            printf("%3d %5d %8s %10.2f %10.2f %12.1f %10.2f %10.2f %26s %16s\n", r->tp, r->share,
                   kind == 0 ? "fwd" : "fwd+bwd", h.model * 1e3, h.gemm * 1e3, h.tflops,
                   h.attn * 1e3, (h.gemm + h.attn) * 1e3, spread, target);
        }
    }
}

/* o->ids: batch x seq pseudo-random ids in [0, vocab), the same every run;
 * and the OpenBLAS threads. false when memory runs out. */
static bool make_ids(options *o)
{
    const int64_t nids = o->batch * o->seq;
    o->ids = malloc(sizeof *o->ids * (size_t)nids);
    if (!o->ids)
        return false;
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (int64_t i = 0; i < nids; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        o->ids[i] = (int64_t)(x % (uint64_t)o->cfg.vocab_size);
    }
    openblas_set_num_threads(o->threads);
    return true;
}

static int run_perf(options *o)
{
    if (!make_ids(o))
        return 1;
    FILE *csv = NULL;
    char line[512];
    config_line(o, line, sizeof line);
    perf_run runs[MAX_TP];
    bool ran[MAX_TP] = {false};
    int status = 0, world_rank = 0;
    double load[3] = {0, 0, 0};
    bench_loadavg(load);
    for (int k = 0; k < o->ntp; k++) {
        memset(&runs[k], 0, sizeof runs[k]);
        runs[k].o = o;
        runs[k].tp = o->tps[k];
        if (!(ran[k] = run_degree(o, k, perf_rank, &runs[k], &world_rank, &status)))
            continue;
#if TP_HAVE_CUDA
        if (o->cuda && world_rank == 0 && !pass_by_hand(o, &runs[k]))
            status = 1;
#endif
    }
    if (world_rank != 0)
        return status;
    if (o->csv) {
        csv = fopen(o->csv, "w");
        if (!csv) {
            fprintf(stderr, "tp-bench-llm: cannot write %s: %s\n", o->csv, strerror(errno));
            return 1;
        }
        /* --device cuda: the device, the dtype and the pass by hand after the CPU's columns */
        fprintf(csv, "impl,model,params,batch,seq,tp,threads,pass,time_ms,time_min_ms,time_max_ms,"
                     "reps,warmup,tokens_per_s,peak_mib,loss,backend,cores,cpu_ms%s\n",
                o->cuda ? ",device,dtype,gemm_ms,attn_ms,hand_over_model,hand_over_model_min,"
                          "hand_over_model_max,gemm_tflops"
                        : "");
    }
    char gpu[256] = "";
#if TP_HAVE_CUDA
    if (o->cuda)
        bench_cuda_device_name(0, gpu, sizeof gpu);
#endif
    printf("# tp-bench-llm: %s\n", line);
    if (o->cuda)
        printf("# batch %ld x seq %ld = %ld tokens, %s, CUDA (%d device%s, rank r on device r "
               "%% %d; device 0: %s); %s ranks; %d cores; load average %.2f %.2f %.2f\n",
               o->batch, o->seq, o->batch * o->seq, tp_dtype_name(o->dtype),
               tp_cuda_device_count(), tp_cuda_device_count() == 1 ? "" : "s",
               tp_cuda_device_count(), gpu, o->mpi ? "mpi" : "shm (threads)", bench_cores(),
               load[0], load[1], load[2]);
    else
        printf("# batch %ld x seq %ld = %ld tokens, f32, CPU; %s ranks; OpenBLAS threads %d "
               "(process-wide, shared by the ranks); %d cores; load average %.2f %.2f %.2f\n",
               o->batch, o->seq, o->batch * o->seq, o->mpi ? "mpi" : "shm (threads)", o->threads,
               bench_cores(), load[0], load[1], load[2]);
    printf("# a pass: the slowest rank's%s; %d timed after %d untimed; median [min .. max]; "
           "peak: libtp tensor bytes above the passes' start, %s; CPU: the median CPU "
           "time of the process (%s) over a pass%s\n",
           o->cuda ? ", to tp_cuda_synchronize" : "", o->reps, o->warmup,
           o->cuda ? "on device 0 (the ranks on it)" : "all ranks",
           o->mpi ? "rank 0's" : "all ranks and BLAS threads, spinning included",
           o->plan_at_1 ? "; tp 1 under the plan (mesh of 1)" : "");
    printf("%3s %8s %8s %12s %24s %12s %9s %10s %12s\n", "tp", "threads", "pass", "median ms",
           "[min .. max] ms", "tokens/s", "vs tp 1", "peak MiB", "CPU ms");
    double base[2] = {0, 0};
    for (int k = 0; k < o->ntp; k++)
        if (ran[k] && runs[k].tp == 1) {
            double lo, hi;
            if (o->fwd)
                stats(runs[k].fwd, o->reps, &base[0], &lo, &hi);
            if (o->bwd)
                stats(runs[k].bwd, o->reps, &base[1], &lo, &hi);
        }
    for (int kind = 0; kind < 2; kind++) {
        if (!(kind == 0 ? o->fwd : o->bwd))
            continue;
        for (int k = 0; k < o->ntp; k++) {
            if (!ran[k])
                continue;
            const perf_run *r = &runs[k];
            double med, lo, hi;
            stats((double *)(kind == 0 ? r->fwd : r->bwd), o->reps, &med, &lo, &hi);
            const double peak = (kind == 0 ? r->peak_fwd : r->peak_bwd) / 1048576.0;
            double cpu, clo, chi;
            stats((double *)(kind == 0 ? r->cpu_fwd : r->cpu_bwd), o->reps, &cpu, &clo, &chi);
            char spread[64], speed[32];
            snprintf(spread, sizeof spread, "[%.1f .. %.1f]", lo * 1e3, hi * 1e3);
            if (base[kind] > 0)
                snprintf(speed, sizeof speed, "%.2fx", base[kind] / med);
            else
                snprintf(speed, sizeof speed, "-");
            printf("%3d %8d %8s %12.1f %24s %12.0f %9s %10.0f %12.1f\n", r->tp, o->threads,
                   kind == 0 ? "fwd" : "fwd+bwd", med * 1e3, spread,
                   (double)(o->batch * o->seq) / med, speed, peak, cpu * 1e3);
            if (csv) {
                char loss[32] = "", hand[256] = "";
                if (kind == 1)
                    snprintf(loss, sizeof loss, "%.6f", r->loss);
                if (o->cuda) {
                    hand_figures h;
                    hand_stats(o, r, kind, &h);
                    snprintf(hand, sizeof hand, ",cuda,%s,%.3f,%.3f,%.4f,%.4f,%.4f,%.1f",
                             tp_dtype_name(o->dtype), h.gemm * 1e3, h.attn * 1e3, h.ratio,
                             h.ratio_lo, h.ratio_hi, h.tflops);
                }
                fprintf(csv, "libtp,%s,%.0f,%ld,%ld,%d,%d,%s,%.3f,%.3f,%.3f,%d,%d,%.1f,%.1f,%s,%s,%d,"
                             "%.3f%s\n",
                        o->cfg_name, param_count(&o->cfg), o->batch, o->seq, r->tp, o->threads,
                        kind == 0 ? "fwd" : "fwd+bwd", med * 1e3, lo * 1e3, hi * 1e3, o->reps,
                        o->warmup, (double)(o->batch * o->seq) / med, peak, loss,
                        o->mpi ? "mpi" : "shm", bench_cores(), cpu * 1e3, hand);
            }
        }
    }
    if (o->cuda)
        print_by_hand(o, runs, ran, gpu);
    for (int k = 0; k < o->ntp && o->bwd; k++)
        if (ran[k]) {
            printf("# loss of the first pass (tp %d): %.6f\n", runs[k].tp, runs[k].loss);
            break;
        }
    if (csv && fclose(csv) != 0) {
        fprintf(stderr, "tp-bench-llm: cannot write %s\n", o->csv);
        status = 1;
    }
    return status;
}

/* ---- -p train: a training step under DDP or FSDP, with recompute --------------------- */

/* Per-rank tensor memory for --count-memory: an allocator (tp_set_allocator)
 * that charges each storage block to the rank thread that allocated it, as
 * tests/test_meta_memory.c does (tp_memory_stats(TP_CPU) is process-wide, and
 * shm ranks are threads of one process). With a user allocator libtp takes
 * each storage block as one 64-byte aligned allocation of a 64-byte header
 * plus the block's capacity, the bytes tp_memory_stats counts; other
 * allocations ask for less alignment and are not counted. Every allocation
 * carries a 64-byte (or `alignment`-byte) prefix that says where it came
 * from, so a free costs no lookup. Blocks allocated outside a rank thread
 * are not counted. */
typedef struct {
    _Atomic long long live, peak;
} rank_ctr;

static rank_ctr g_ctr[64];
static _Thread_local rank_ctr *tl_ctr;

typedef struct {
    void *raw;
    rank_ctr *ctr;
    size_t bytes;
} blk_hdr;

static void ctr_peak(rank_ctr *c, long long now)
{
    long long p = c->peak;
    while (now > p && !__atomic_compare_exchange_n(&c->peak, &p, now, false, __ATOMIC_RELAXED,
                                                   __ATOMIC_RELAXED))
        ;
}

static void *ctr_alloc(void *ctx, size_t size, size_t alignment)
{
    (void)ctx;
    size_t pad = alignment > 64 ? alignment : 64;
    size_t total = pad + (size + pad - 1) / pad * pad;
    char *raw = aligned_alloc(pad, total ? total : pad);
    if (!raw)
        return NULL;
    char *p = raw + pad;
    blk_hdr *h = (blk_hdr *)(void *)(p - sizeof(blk_hdr));
    h->raw = raw;
    h->ctr = alignment == 64 && size >= 64 ? tl_ctr : NULL;
    h->bytes = size - 64;
    if (h->ctr)
        ctr_peak(h->ctr, __atomic_add_fetch(&h->ctr->live, (long long)h->bytes, __ATOMIC_RELAXED));
    return p;
}

static void ctr_free(void *ctx, void *p)
{
    (void)ctx;
    if (!p)
        return;
    blk_hdr *h = (blk_hdr *)(void *)((char *)p - sizeof(blk_hdr));
    if (h->ctr)
        __atomic_sub_fetch(&h->ctr->live, (long long)h->bytes, __ATOMIC_RELAXED);
    free(h->raw);
}

typedef struct {
    const options *o;
    /* per timed step, the slowest rank's seconds */
    double step[MAX_REPS];
    /* per rank (bytes; --count-memory: that rank's, else the process's / ranks):
     * held between steps, kept from the forward for the backward (live after
     * the loss, less held), and the peak of the timed steps */
    double held[64], kept[64], peak[64];
    double loss;
} train_run;

/* A step: forward, loss, backward, optimizer step, zero_grad. *kept: the
 * bytes live after the loss (before the backward), when asked. */
static tp_status train_step(tp_module *m, tp_adam *opt, tp_tensor *ids, double *loss_out,
                            long long *kept)
{
    tp_tensor *logits = NULL, *loss = NULL;
    tp_status st = tp_llm_forward(m, ids, NULL, NULL, &logits);
    if (st == TP_OK)
        st = tp_llm_loss(logits, ids, &loss);
    if (st == TP_OK && kept && tl_ctr)
        *kept = tl_ctr->live;
    if (st == TP_OK && loss_out) {
        const tp_tensor *l = tp_tensor_is_dtensor(loss) ? tp_dtensor_local(loss) : loss;
        *loss_out = *(const float *)tp_tensor_data(l);
    }
    tp_tensor_release(logits); /* the graph keeps what it needs */
    if (st == TP_OK)
        st = tp_backward(loss, NULL);
    tp_tensor_release(loss);
    if (st == TP_OK)
        st = tp_adam_step(opt);
    tp_module_zero_grad(m);
    return st;
}

static tp_status train_rank(tp_comm *w, void *arg)
{
    train_run *r = arg;
    const options *o = r->o;
    const int rank = tp_comm_rank(w), n = tp_comm_size(w);
    const bool lead = rank == 0;
    tp_status st = TP_OK;
    tp_mesh *mesh = NULL, *tpm = NULL;
    tp_module *model = NULL;
    tp_ddp *ddp = NULL;
    tp_adam *opt = NULL;
    tp_tensor *ids = NULL;
    double times[MAX_REPS] = {0};
    long long kept = 0;
    if (o->count_memory)
        tl_ctr = &g_ctr[rank];
    TRY(tp_mesh_create(w, 2, (const int64_t[]){o->dp, o->tps[0]}, (const char *[]){"dp", "tp"},
                       &mesh));
    TRY(tp_mesh_slice(mesh, 1, (const char *[]){"tp"}, &tpm));
    TRY(tp_llm_create(&o->cfg, &model));
    if (o->tps[0] > 1) {
        const tp_parallelize_options po = {.src_data_rank = TP_SRC_DATA_RANK_NONE};
        TRY(tp_llm_parallelize(model, tpm, 0, NULL, &po));
    }
    TRY(tp_module_init(model, 1));
    tp_module *layers = tp_module_find(model, "model.layers");
    if (o->recompute != TP_RECOMPUTE_NONE)
        TRY(tp_module_set_recompute_every(layers, o->recompute_every, o->recompute));
    if (o->fsdp) {
        const tp_fsdp_options fo = {0}; /* reshard after forward, prefetch */
        if (o->fsdp_ends) /* torchtitan's: the embedding a unit before the blocks */
            TRY(tp_fully_shard(tp_module_find(model, "model.embed_tokens"), mesh, &fo));
        for (int i = 0; i < tp_module_num_children(layers); i++)
            TRY(tp_fully_shard(tp_module_child_at(layers, i, NULL), mesh, &fo));
        if (o->fsdp_ends) /* and the output projection one after them */
            TRY(tp_fully_shard(tp_module_find(model, "lm_head"), mesh, &fo));
        TRY(tp_fully_shard(model, mesh, &fo));
    } else if (o->dp > 1) {
        const tp_ddp_options dopts = {.params_everywhere = true,
                                      .gradient_as_bucket_view = o->ddp_view};
        TRY(tp_ddp_create(model, tp_mesh_comm(mesh, 0), &dopts, &ddp));
    }
    const tp_adam_options ao = {
        .lr = 1e-4, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01,
        .decoupled = true};
    TRY(tp_adam_create_with(model, &ao, &opt));
    /* this dp rank's rows of the global batch */
    const int64_t rows = o->batch / o->dp, dpr = tp_mesh_coord(mesh, 0);
    TRY(tp_tensor_from_data(TP_I64, 2, (const int64_t[]){rows, o->seq}, o->ids + dpr * rows * o->seq,
                            &ids));
    for (int i = 0; i < o->warmup + o->reps; i++) {
        const bool timed = i >= o->warmup;
        if (i == o->warmup) { /* between steps: the held bytes, then the peak from here */
            TRY(tp_barrier(w, NULL));
            if (o->count_memory) {
                r->held[rank] = (double)tl_ctr->live;
                __atomic_store_n(&tl_ctr->peak, tl_ctr->live, __ATOMIC_RELAXED);
            } else if (lead) {
                tp_memory_info mi;
                tp_memory_stats(TP_CPU, &mi);
                r->held[0] = (double)mi.allocated / n;
                tp_memory_reset_peak(TP_CPU);
            }
            TRY(tp_barrier(w, NULL));
        }
        TRY(tp_barrier(w, NULL));
        const double t0 = bench_now_s();
        TRY(train_step(model, opt, ids, i == 0 && lead ? &r->loss : NULL,
                       i == o->warmup ? &kept : NULL));
        TRY(tp_barrier(w, NULL));
        if (timed)
            times[i - o->warmup] = bench_now_s() - t0;
    }
    TRY(tp_barrier(w, NULL));
    if (o->count_memory) {
        r->peak[rank] = (double)tl_ctr->peak;
        r->kept[rank] = (double)kept - r->held[rank];
    } else if (lead) {
        tp_memory_info mi;
        tp_memory_stats(TP_CPU, &mi);
        r->peak[0] = (double)mi.peak_allocated / n;
    }
    TRY(max_over(w, times, o->reps));
    if (lead)
        memcpy(r->step, times, sizeof times);
out:
    tp_tensor_release(ids);
    tp_adam_free(opt);
    tp_ddp_free(ddp);
    tp_module_free(model);
    tp_mesh_free(tpm);
    tp_mesh_free(mesh);
    tl_ctr = NULL;
    return st;
}

static const char *recompute_name(tp_recompute_mode m)
{
    return m == TP_RECOMPUTE_FULL ? "full" : m == TP_RECOMPUTE_SELECTIVE ? "selective" : "none";
}

static int run_train(options *o)
{
    if (!make_ids(o))
        return 1;
    const int tp = o->tps[0], ranks = o->dp * tp;
    char line[512], mode[64];
    config_line(o, line, sizeof line);
    if (o->recompute != TP_RECOMPUTE_NONE && o->recompute_every > 1)
        snprintf(mode, sizeof mode, "%s:%d", recompute_name(o->recompute), o->recompute_every);
    else
        snprintf(mode, sizeof mode, "%s", recompute_name(o->recompute));
    const char *par = o->fsdp ? (o->fsdp_ends ? "fsdp+ends" : "fsdp")
                      : o->dp > 1 ? (o->ddp_view ? "ddp+view" : "ddp") : "none";
    if (o->cfg.num_attention_heads % tp || o->cfg.num_key_value_heads % tp) {
        fprintf(stderr, "tp-bench-llm: --tp %d does not divide the heads\n", tp);
        return EXIT_BAD;
    }
    train_run *r = calloc(1, sizeof *r);
    if (!r)
        return 1;
    r->o = o;
    double load[3] = {0, 0, 0};
    bench_loadavg(load);
    if (o->count_memory && tp_set_allocator(&(tp_allocator){ctr_alloc, ctr_free, NULL}) != TP_OK)
        return 1;
    memset(g_ctr, 0, sizeof g_ctr);
    tp_status st = tp_run_local(ranks, train_rank, r);
    if (o->count_memory)
        tp_set_allocator(NULL);
    if (st != TP_OK) {
        fprintf(stderr, "tp-bench-llm: -p train dp %d tp %d %s recompute %s failed: %s (%s)\n",
                o->dp, tp, par, mode, tp_status_name(st), tp_last_error());
        free(r);
        return 1;
    }
    /* per-rank memory: --count-memory's are each rank's; the largest is shown */
    const int nmem = o->count_memory ? ranks : 1;
    double held = 0, kept = 0, peak = 0;
    for (int k = 0; k < nmem; k++) {
        held = r->held[k] > held ? r->held[k] : held;
        kept = r->kept[k] > kept ? r->kept[k] : kept;
        peak = r->peak[k] > peak ? r->peak[k] : peak;
    }
    double med, lo, hi;
    stats(r->step, o->reps, &med, &lo, &hi);
    const double mib = 1048576.0;
    printf("# tp-bench-llm -p train: %s\n", line);
    printf("# dp %d x tp %d = %d shm rank threads, %s over dp, recompute %s of the blocks; "
           "global batch %ld (%ld per dp rank) x seq %ld, f32, AdamW; OpenBLAS threads %d; "
           "%d cores; load average %.2f %.2f %.2f\n",
           o->dp, tp, ranks,
           o->fsdp ? (o->fsdp_ends ? "FSDP (units: the embedding, every block, lm_head, then the "
                                     "root; reshard after forward)"
                                   : "FSDP (every block a unit, then the root; reshard after "
                                     "forward)")
           : o->dp > 1 ? (o->ddp_view ? "DDP (gradients as bucket views)" : "DDP")
                       : "nothing",
           mode, o->batch, o->batch / o->dp, o->seq, o->threads, bench_cores(), load[0], load[1],
           load[2]);
    printf("# a step: forward, loss, backward, optimizer step, zero_grad, the slowest rank's; %d "
           "timed after %d untimed; memory per rank: %s\n",
           o->reps, o->warmup,
           o->count_memory ? "each rank thread's own tensor blocks (counting allocator, no "
                             "caching: the times are not the library's usual ones), the largest "
                             "rank's"
                           : "tp_memory_stats(TP_CPU) of the process / ranks (use "
                             "--count-memory for each rank's own)");
    printf("%5s %5s %10s %8s %12s %24s %10s %10s %10s\n", "dp", "tp", "parallel", "recomp",
           "step ms", "[min .. max] ms", "held MiB", "kept MiB", "peak MiB");
    char spread[64], k[32] = "-";
    snprintf(spread, sizeof spread, "[%.1f .. %.1f]", lo * 1e3, hi * 1e3);
    if (o->count_memory)
        snprintf(k, sizeof k, "%.1f", kept / mib);
    printf("%5d %5d %10s %8s %12.1f %24s %10.1f %10s %10.1f\n", o->dp, tp, par, mode, med * 1e3,
           spread, held / mib, k, peak / mib);
    printf("# steps ms:");
    for (int i = 0; i < o->reps; i++)
        printf(" %.1f", r->step[i] * 1e3);
    printf("\n# loss of the first step: %.6f\n", r->loss);
    int status = 0;
    if (o->csv) {
        FILE *csv = fopen(o->csv, "w");
        if (!csv) {
            fprintf(stderr, "tp-bench-llm: cannot write %s: %s\n", o->csv, strerror(errno));
            free(r);
            return 1;
        }
        fprintf(csv, "impl,model,params,batch,seq,dp,tp,parallel,recompute,threads,step_ms,"
                     "step_min_ms,step_max_ms,reps,warmup,held_mib,kept_mib,peak_mib,"
                     "mem_per_rank,loss,cores\n");
        fprintf(csv, "libtp,%s,%.0f,%ld,%ld,%d,%d,%s,%s,%d,%.3f,%.3f,%.3f,%d,%d,%.3f,%.3f,%.3f,%s,"
                     "%.6f,%d\n",
                o->cfg_name, param_count(&o->cfg), o->batch, o->seq, o->dp, tp, par, mode,
                o->threads, med * 1e3, lo * 1e3, hi * 1e3, o->reps, o->warmup, held / mib,
                o->count_memory ? kept / mib : NAN, peak / mib,
                o->count_memory ? "counted" : "process/ranks", r->loss, bench_cores());
        if (fclose(csv) != 0)
            status = 1;
    }
    free(r);
    return status;
}

/* ---- -p decode ------------------------------------------------------------------------ */

typedef struct {
    const options *o;
    int tp;
    /* per timed repetition: the slowest rank's */
    double ttft[MAX_REPS], tok_s[MAX_REPS], p50[MAX_REPS], p99[MAX_REPS];
    double cache_mib;
} decode_run;

static tp_status decode_rank(tp_comm *w, void *arg)
{
    decode_run *r = arg;
    const options *o = r->o;
    const bool lead = tp_comm_rank(w) == 0;
    tp_status st = TP_OK;
    tp_mesh *mesh = NULL;
    tp_module *model = NULL;
    tp_tensor *ids = NULL, *toks = NULL;
    tp_llm_cache *cache = NULL;
    if (o->cuda) {
        const int n = tp_cuda_device_count();
        if (n <= 0) {
            fprintf(stderr, "tp-bench-llm: --device cuda: no CUDA device\n");
            st = TP_ERR_NOT_SUPPORTED;
            goto out;
        }
        TRY(tp_nn_set_default_device(TP_CUDA(tp_comm_rank(w) % n)));
    }
    st = build_model(w, o, r->tp > 1 || o->plan_at_1, o->model, &mesh, &model);
    tp_nn_set_default_device(TP_CPU);
    TRY(st);
    if (o->dtype != TP_F32)
        TRY(tp_module_to_dtype(model, o->dtype));
    TRY(tp_tensor_from_data(TP_I64, 2, (const int64_t[]){o->batch, o->seq}, o->ids, &ids));
    TRY(tp_llm_cache_create(model, o->batch, o->seq + o->new_tokens, &cache));
    const tp_llm_generate_options go = {
        .max_new_tokens = o->new_tokens, .n_eos = -1, .cache = cache};
    for (int i = 0; i < o->warmup + o->reps; i++) {
        tp_llm_generate_stats gs;
        TRY(tp_barrier(w, NULL));
        TRY(tp_llm_generate(model, ids, NULL, &go, &toks, &gs));
        tp_tensor_release(toks);
        toks = NULL;
        double v[4] = {gs.prefill_s, gs.decode_s / (double)gs.decode_steps, gs.step_p50_s,
                       gs.step_p99_s};
        TRY(max_over(w, v, 4));
        if (i >= o->warmup && lead) {
            const int k = i - o->warmup;
            r->ttft[k] = v[0];
            r->tok_s[k] = (double)o->batch / v[1];
            r->p50[k] = v[2];
            r->p99[k] = v[3];
        }
    }
    if (lead)
        r->cache_mib = (double)tp_llm_cache_nbytes(cache) / 1048576.0;
out:
    tp_llm_cache_free(cache);
    tp_tensor_release(ids);
    tp_module_free(model);
    tp_mesh_free(mesh);
    if (st != TP_OK && o->mpi)
        tp_comm_abort(w, "tp-bench-llm: a rank failed");
    return st;
}

/* Buffers filled with small values (touched: untouched pages read as the
 * one zero page, faster than memory). */
static float *filled(size_t n)
{
    float *p = malloc(sizeof *p * (n ? n : 1));
    for (size_t i = 0; p && i < n; i++)
        p[i] = (float)((i % 97) * 1e-3);
    return p;
}

/* y[m, n] = x[m, k] op(w) (w [n, k] when wt, else [k, n]): sgemm, or sgemv
 * for one row, as the library's CPU engine calls them. */
static void mm(int m, int n, int k, const float *x, const float *w, bool wt, float *y)
{
    if (m == 1)
        cblas_sgemv(CblasRowMajor, wt ? CblasNoTrans : CblasTrans, wt ? n : k, wt ? k : n, 1.0f,
                    w, k * wt + n * !wt, x, 1, 0.0f, y, 1);
    else
        cblas_sgemm(CblasRowMajor, CblasNoTrans, wt ? CblasTrans : CblasNoTrans, m, n, k, 1.0f,
                    x, k, w, wt ? k : n, 0.0f, y, n);
}

/* The GEMMs of one decode step of rank 0 at degree tp, by hand: seconds,
 * the median of 20 after 3. NaN when memory runs out. */
static double gemms_by_hand(const options *o, int tp)
{
    const tp_llm_config *c = &o->cfg;
    const int64_t B = o->batch, H = c->hidden_size, D = c->head_dim, L = c->num_hidden_layers;
    const int64_t hq = c->num_attention_heads / tp, hkv = c->num_key_value_heads / tp;
    const int64_t F = c->intermediate_size / tp, V = (c->vocab_size + tp - 1) / tp;
    const int64_t len = o->seq + o->new_tokens / 2, rep = hq / hkv;
    const int64_t nw[7] = {hq * D * H, hkv * D * H, hkv * D * H, H * hq * D, F * H, F * H, H * F};
    float *w[64][7] = {{0}}, *kv[64][2] = {{0}}, *head = filled((size_t)(V * H));
    float *x = filled((size_t)(B * (H > F ? (H > hq * D ? H : hq * D) : F))),
          *y = filled((size_t)(B * (V > F ? (V > H ? V : H) : F))),
          *sc = filled((size_t)(rep * len));
    bool ok = head && x && y && sc && L <= 64;
    for (int64_t l = 0; l < L && ok; l++) {
        for (int j = 0; j < 7 && ok; j++)
            ok = (w[l][j] = filled((size_t)nw[j])) != NULL;
        for (int j = 0; j < 2 && ok; j++)
            ok = (kv[l][j] = filled((size_t)(B * hkv * len * D))) != NULL;
    }
    double times[23], med = NAN;
    /* out x in weights, as Linear keeps them: y = x W^T */
    const int64_t outs[7] = {hq * D, hkv * D, hkv * D, H, F, F, H}, ins[7] = {H, H, H, hq * D, H, H, F};
    for (int it = 0; it < 23 && ok; it++) {
        const double t0 = bench_now_s();
        for (int64_t l = 0; l < L; l++) {
            for (int j = 0; j < 7; j++)
                mm((int)B, (int)outs[j], (int)ins[j], x, w[l][j], true, y);
            for (int64_t g = 0; g < B * hkv; g++) {
                mm((int)rep, (int)len, (int)D, x, kv[l][0] + g * len * D, true, sc);
                mm((int)rep, (int)D, (int)len, sc, kv[l][1] + g * len * D, false, y);
            }
        }
        mm((int)B, (int)V, (int)H, x, head, true, y);
        times[it] = bench_now_s() - t0;
    }
    if (ok)
        med = bench_median(times + 3, 20);
    for (int64_t l = 0; l < L && l < 64; l++) {
        for (int j = 0; j < 7; j++)
            free(w[l][j]);
        free(kv[l][0]);
        free(kv[l][1]);
    }
    free(head);
    free(x);
    free(y);
    free(sc);
    return med;
}

/* What the library does around the kernels in one decode step: the steps
 * on the meta device as rank 0 of a sim world of tp ranks. Seconds per
 * step (median of 50 after 5); NaN on failure (printed). */
static double host_on_meta(const options *o, int tp)
{
    tp_status st = TP_OK;
    tp_comm *w = NULL;
    tp_mesh *mesh = NULL;
    tp_module *model = NULL;
    tp_llm_cache *cache = NULL;
    tp_tensor *ids = NULL, *step = NULL, *logits = NULL;
    double times[55], med = NAN;
    tp_sim_options so = {.world_size = tp, .rank = 0};
    TRY(tp_comm_create_world("sim", &so, &w));
    TRY(tp_nn_set_default_device(TP_META));
    st = tp_llm_create(&o->cfg, &model);
    tp_nn_set_default_device(TP_CPU);
    TRY(st);
    if (tp > 1 || o->plan_at_1) {
        const int64_t n = tp;
        TRY(tp_mesh_create(w, 1, &n, (const char *[]){"tp"}, &mesh));
        const tp_parallelize_options po = {.src_data_rank = TP_SRC_DATA_RANK_NONE};
        TRY(tp_llm_parallelize(model, mesh, 0, NULL, &po));
    }
    TRY(tp_llm_cache_create(model, o->batch, o->seq + 56, &cache));
    TRY(tp_tensor_from_data(TP_I64, 2, (const int64_t[]){o->batch, o->seq}, o->ids, &ids));
    TRY(tp_tensor_zeros(TP_I64, TP_CPU, 2, (const int64_t[]){o->batch, 1}, &step));
    TRY(tp_llm_forward_cached(model, cache, ids, NULL, 1, &logits));
    for (int i = 0; i < 55; i++) {
        tp_tensor_release(logits);
        logits = NULL;
        const double t0 = bench_now_s();
        TRY(tp_llm_forward_cached(model, cache, step, NULL, 1, &logits));
        times[i] = bench_now_s() - t0;
    }
    med = bench_median(times + 5, 50);
out:
    if (st != TP_OK)
        fprintf(stderr, "tp-bench-llm: host time on meta at tp %d: %s\n", tp, tp_last_error());
    tp_tensor_release(logits);
    tp_tensor_release(step);
    tp_tensor_release(ids);
    tp_llm_cache_free(cache);
    tp_module_free(model);
    tp_mesh_free(mesh);
    tp_comm_free(w);
    return med;
}

static int run_decode(options *o)
{
    if (!make_ids(o))
        return 1;
    FILE *csv = NULL;
    char line[512];
    config_line(o, line, sizeof line);
    decode_run runs[MAX_TP];
    double gemm[MAX_TP], host[MAX_TP];
    bool ran[MAX_TP] = {false};
    int status = 0, world_rank = 0;
    double load[3] = {0, 0, 0};
    bench_loadavg(load);
    for (int k = 0; k < o->ntp; k++) {
        memset(&runs[k], 0, sizeof runs[k]);
        runs[k].o = o;
        runs[k].tp = o->tps[k];
        if (!(ran[k] = run_degree(o, k, decode_rank, &runs[k], &world_rank, &status)))
            continue;
        if (world_rank == 0) {
            gemm[k] = o->cuda ? NAN : gemms_by_hand(o, o->tps[k]);
            host[k] = host_on_meta(o, o->tps[k]);
        }
    }
    if (world_rank != 0)
        return status;
    if (o->csv) {
        csv = fopen(o->csv, "w");
        if (!csv) {
            fprintf(stderr, "tp-bench-llm: cannot write %s: %s\n", o->csv, strerror(errno));
            return 1;
        }
        fprintf(csv, "impl,model,tp,threads,batch,prompt,new_tokens,ttft_ms,decode_tok_s,"
                     "tok_ms_p50,tok_ms_p99,rep,gemm_ms,host_us_per_layer,device,dtype\n");
    }
    printf("# tp-bench-llm -p decode: %s\n", line);
    printf("# batch %ld, prompts of %ld tokens, %ld new tokens (greedy, no eos), %s, %s; %s "
           "ranks; OpenBLAS threads %d; %d cores; load average %.2f %.2f %.2f\n",
           o->batch, o->seq, o->new_tokens, tp_dtype_name(o->dtype), o->cuda ? "CUDA" : "CPU",
           o->mpi ? "mpi" : "shm (threads)", o->threads, bench_cores(), load[0], load[1],
           load[2]);
    printf("# %d timed generations after %d; median [min .. max]; a step: the slowest rank's; "
           "GEMMs by hand: one step's at the mean cache length, alone on one thread; host: "
           "a step on the meta device (no arithmetic)\n", o->reps, o->warmup);
    printf("%3s %10s %24s %9s %10s %10s %9s %11s %10s %14s %9s\n", "tp", "ttft ms",
           "decode tok/s [min..max]", "vs tp 1", "p50 ms", "p99 ms", "cache MiB", "GEMMs ms",
           "host ms", "host us/layer", "GEMM/p50");
    double base = 0;
    for (int k = 0; k < o->ntp; k++)
        if (ran[k] && runs[k].tp == 1) {
            double lo, hi;
            stats(runs[k].tok_s, o->reps, &base, &lo, &hi);
        }
    const double L = (double)o->cfg.num_hidden_layers;
    for (int k = 0; k < o->ntp; k++) {
        if (!ran[k])
            continue;
        const decode_run *r = &runs[k];
        double ttft, tok, lo, hi, p50, p99, x0, x1;
        stats((double *)r->ttft, o->reps, &ttft, &x0, &x1);
        stats((double *)r->tok_s, o->reps, &tok, &lo, &hi);
        stats((double *)r->p50, o->reps, &p50, &x0, &x1);
        stats((double *)r->p99, o->reps, &p99, &x0, &x1);
        char spread[64], speed[32] = "-";
        snprintf(spread, sizeof spread, "%.1f [%.1f..%.1f]", tok, lo, hi);
        if (base > 0)
            snprintf(speed, sizeof speed, "%.2fx", tok / base);
        printf("%3d %10.2f %24s %9s %10.3f %10.3f %9.1f %11.3f %10.3f %14.2f %9.2f\n", r->tp,
               ttft * 1e3, spread, speed, p50 * 1e3, p99 * 1e3, r->cache_mib, gemm[k] * 1e3,
               host[k] * 1e3, host[k] / L * 1e6, gemm[k] / p50);
        for (int i = 0; csv && i < o->reps; i++)
            fprintf(csv, "libtp,%s,%d,%d,%ld,%ld,%ld,%.3f,%.2f,%.4f,%.4f,%d,%.4f,%.3f,%s,%s\n",
                    o->cfg_name, r->tp, o->threads, o->batch, o->seq, o->new_tokens,
                    r->ttft[i] * 1e3, r->tok_s[i], r->p50[i] * 1e3, r->p99[i] * 1e3, i + 1,
                    gemm[k] * 1e3, host[k] / L * 1e6, o->cuda ? "cuda" : "cpu",
                    tp_dtype_name(o->dtype));
    }
    if (csv && fclose(csv) != 0) {
        fprintf(stderr, "tp-bench-llm: cannot write %s\n", o->csv);
        status = 1;
    }
    return status;
}

/* ---- --save and --dump-config ------------------------------------------------------ */

static tp_status save_rank(tp_comm *w, void *arg)
{
    const options *o = arg;
    tp_status st = TP_OK;
    tp_mesh *mesh = NULL;
    tp_module *model = NULL;
    TRY(build_model(w, o, tp_comm_size(w) > 1, NULL, &mesh, &model));
    TRY(tp_llm_save(model, o->save, (size_t)o->max_shard));
out:
    tp_module_free(model);
    tp_mesh_free(mesh);
    return st;
}

static int run_save(options *o)
{
    char line[512];
    config_line(o, line, sizeof line);
    const double t0 = bench_now_s();
    int world_rank = 0;
    tp_status st = run_ranks(o, o->tps[0], save_rank, o, &world_rank);
    if (world_rank != 0)
        return st != TP_OK;
    if (st != TP_OK) {
        fprintf(stderr, "tp-bench-llm: --save %s: %s (%s)\n", o->save, tp_status_name(st),
                tp_last_error());
        return 1;
    }
    printf("# tp-bench-llm: saved %s to %s (shards of at most %ld bytes) in %.1f s\n", line,
           o->save, o->max_shard, bench_now_s() - t0);
    return 0;
}

static int run_dump(options *o)
{
    char *json = NULL;
    if (tp_llm_config_to_json(&o->cfg, &json) != TP_OK) {
        fprintf(stderr, "tp-bench-llm: %s\n", tp_last_error());
        return 1;
    }
    FILE *f = fopen(o->dump, "w");
    bool ok = f && fputs(json, f) >= 0 && fputc('\n', f) != EOF;
    ok = (f && fclose(f) == 0) && ok;
    free(json);
    if (!ok) {
        fprintf(stderr, "tp-bench-llm: cannot write %s: %s\n", o->dump, strerror(errno));
        return 1;
    }
    return 0;
}

/* ---- --load ------------------------------------------------------------------------- */

#define MAX_FILES 256
#define CHUNK (8u << 20)

typedef struct {
    int n;
    char *path[MAX_FILES];
    double bytes;
} file_list;

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The .safetensors files of dir, sorted. */
static int list_files(const char *dir, file_list *fl)
{
    DIR *d = opendir(dir);
    if (!d) {
        fprintf(stderr, "tp-bench-llm: cannot open %s: %s\n", dir, strerror(errno));
        return EXIT_BAD;
    }
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t n = strlen(e->d_name);
        if (n < 12 || strcmp(e->d_name + n - 12, ".safetensors"))
            continue;
        if (fl->n == MAX_FILES)
            break;
        size_t len = strlen(dir) + n + 2;
        fl->path[fl->n] = malloc(len);
        snprintf(fl->path[fl->n], len, "%s/%s", dir, e->d_name);
        struct stat sb;
        if (stat(fl->path[fl->n], &sb) == 0)
            fl->bytes += (double)sb.st_size;
        fl->n++;
    }
    closedir(d);
    qsort(fl->path, (size_t)fl->n, sizeof *fl->path, cmp_str);
    if (fl->n == 0) {
        fprintf(stderr, "tp-bench-llm: %s holds no .safetensors file\n", dir);
        return EXIT_BAD;
    }
    return 0;
}

typedef struct {
    const options *o;
    file_list files;
    bool drop_all; /* /proc/sys/vm/drop_caches is writable */
    /* per repetition: disk read seconds (cold, warm), load seconds (cold, warm) */
    double disk[2][MAX_REPS], load[2][MAX_REPS];
    /* per rank (filled by rank 0 from the gathered rows): shard bytes, largest
     * parameter, tensor-peak during the cold and warm loads (the highest
     * over the repetitions), RSS peak above the RSS before the load */
    double shard[MAX_TP * 8], largest[MAX_TP * 8], tpeak[MAX_TP * 8], rss[MAX_TP * 8];
    double tbase[MAX_TP * 8];
    int nranks;
} load_run;

static void drop_caches(load_run *r)
{
    for (int i = 0; i < r->files.n; i++) {
        int fd = open(r->files.path[i], O_RDONLY);
        if (fd < 0)
            continue;
        posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
        close(fd);
    }
    if (r->drop_all) {
        sync();
        FILE *f = fopen("/proc/sys/vm/drop_caches", "w");
        if (!f || fputs("3\n", f) < 0 || fclose(f) != 0)
            r->drop_all = false;
    }
}

static double read_files(const file_list *fl, char *buf)
{
    const double t0 = bench_now_s();
    for (int i = 0; i < fl->n; i++) {
        int fd = open(fl->path[i], O_RDONLY);
        while (fd >= 0 && read(fd, buf, CHUNK) > 0)
            ;
        if (fd >= 0)
            close(fd);
    }
    return bench_now_s() - t0;
}

/* kB of a "Key:" line of /proc/self/status, or -1. */
static double proc_status_kb(const char *key)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    double v = -1;
    size_t n = strlen(key);
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, key, n)) {
            v = strtod(line + n, NULL);
            break;
        }
    if (f)
        fclose(f);
    return v;
}

static bool reset_hwm(void)
{
    FILE *f = fopen("/proc/self/clear_refs", "w");
    bool ok = f && fputs("5\n", f) >= 0;
    return (f && fclose(f) == 0) && ok;
}

typedef struct {
    double bytes, largest;
} param_sizes;

static tp_status add_param(const char *fqn, tp_tensor *p, void *ctx)
{
    (void)fqn;
    param_sizes *s = ctx;
    const tp_tensor *l = tp_tensor_is_dtensor(p) ? tp_dtensor_local(p) : p;
    const double b = (double)tp_tensor_nbytes(l);
    s->bytes += b;
    s->largest = b > s->largest ? b : s->largest;
    return TP_OK;
}

static tp_status load_rank(tp_comm *w, void *arg)
{
    load_run *r = arg;
    const options *o = r->o;
    const int rank = tp_comm_rank(w), n = tp_comm_size(w);
    /* this process measures its own memory: every rank under mpi, rank 0
     * for all the threads under shm */
    const bool lead = rank == 0, measures = o->mpi || lead;
    tp_status st = TP_OK;
    tp_mesh *mesh = NULL;
    tp_module *model = NULL;
    char *buf = NULL;
    /* per rank: shard, largest, tensor peak, tensor base, rss delta */
    double row[5] = {0}, *rows = NULL;
    tp_tensor *trow = NULL, *trows = NULL;
    const int64_t n5 = 5, nall = 5 * (int64_t)n;
    param_sizes ps = {0, 0};
    TRY(build_model(w, o, n > 1, NULL, &mesh, &model)); /* tp_module_init: not the file's values */
    TRY(tp_module_named_parameters(model, add_param, &ps));
    row[0] = ps.bytes;
    row[1] = ps.largest;
    if (lead && !(buf = malloc(CHUNK))) {
        st = TP_ERR_NO_MEMORY;
        goto out;
    }
    for (int rep = 0; rep < o->reps; rep++)
        for (int warm = 0; warm < 2; warm++) {
            TRY(tp_barrier(w, NULL));
            if (lead) {
                if (!warm && !o->no_drop)
                    drop_caches(r);
                r->disk[warm][rep] = read_files(&r->files, buf);
                if (!warm && !o->no_drop)
                    drop_caches(r);
            }
            TRY(tp_barrier(w, NULL));
            double rss0 = 0;
            size_t base = 0;
            if (measures) {
                tp_memory_empty_cache(TP_CPU);
                tp_memory_info mi;
                tp_memory_stats(TP_CPU, &mi);
                base = mi.allocated;
                tp_memory_reset_peak(TP_CPU);
                reset_hwm();
                rss0 = proc_status_kb("VmRSS:");
            }
            TRY(tp_barrier(w, NULL));
            const double t0 = bench_now_s();
            TRY(tp_llm_load(model, o->load));
            TRY(tp_barrier(w, NULL));
            const double t = bench_now_s() - t0;
            if (lead)
                r->load[warm][rep] = t;
            if (measures) {
                tp_memory_info mi;
                tp_memory_stats(TP_CPU, &mi);
                const double hwm = proc_status_kb("VmHWM:");
                row[2] = (double)mi.peak_allocated > row[2] ? (double)mi.peak_allocated : row[2];
                row[3] = (double)base;
                const double d = (hwm - rss0) * 1024.0;
                row[4] = d > row[4] ? d : row[4];
            }
        }
    /* every rank's row to rank 0 (shm: the memory figures are rank 0's, for
     * the whole process) */
    TRY(tp_tensor_from_blob(TP_F64, TP_CPU, 1, &n5, row, NULL, NULL, &trow));
    TRY(tp_tensor_empty(TP_F64, TP_CPU, 1, &nall, &trows));
    TRY(tp_all_gather(w, trow, trows, NULL));
    rows = tp_tensor_data(trows);
    if (lead) {
        r->nranks = n;
        for (int i = 0; i < n && i < MAX_TP * 8; i++) {
            r->shard[i] = rows[5 * i];
            r->largest[i] = rows[5 * i + 1];
            r->tpeak[i] = rows[5 * i + 2];
            r->tbase[i] = rows[5 * i + 3];
            r->rss[i] = rows[5 * i + 4];
        }
    }
out:
    free(buf);
    tp_tensor_release(trow);
    tp_tensor_release(trows);
    tp_module_free(model);
    tp_mesh_free(mesh);
    if (st != TP_OK && o->mpi)
        tp_comm_abort(w, "tp-bench-llm: a rank failed");
    return st;
}

static int run_load(options *o)
{
    load_run *r = calloc(1, sizeof *r);
    if (!r)
        return 1;
    r->o = o;
    int rc = list_files(o->load, &r->files);
    if (rc) {
        free(r);
        return rc;
    }
    const int tp = o->tps[0];
    if (o->cfg.num_attention_heads % tp || o->cfg.num_key_value_heads % tp) {
        fprintf(stderr, "tp-bench-llm: --tp %d does not divide %lld heads and %lld kv heads\n",
                tp, (long long)o->cfg.num_attention_heads, (long long)o->cfg.num_key_value_heads);
        rc = EXIT_BAD;
        goto done;
    }
    r->drop_all = !o->no_drop && access("/proc/sys/vm/drop_caches", W_OK) == 0;
    const bool drop_wanted = r->drop_all;
    int world_rank = 0;
    openblas_set_num_threads(1);
    tp_status st = run_ranks(o, tp, load_rank, r, &world_rank);
    if (world_rank != 0) {
        rc = st != TP_OK;
        goto done;
    }
    if (st != TP_OK) {
        fprintf(stderr, "tp-bench-llm: --load %s: %s (%s)\n", o->load, tp_status_name(st),
                tp_last_error());
        rc = 1;
        goto done;
    }
    char line[512];
    config_line(o, line, sizeof line);
    const double gb = r->files.bytes;
    printf("# tp-bench-llm --load: %s\n", line);
    printf("# %s: %d safetensors file%s, %.1f MiB; tp %d, %s ranks; %d repetition(s); cold: %s\n",
           o->load, r->files.n, r->files.n == 1 ? "" : "s", gb / 1048576.0, tp,
           o->mpi ? "mpi (one process each)" : "shm (threads of one process)", o->reps,
           o->no_drop         ? "not dropped (--no-drop: every figure is warm)"
           : r->drop_all      ? "echo 3 > /proc/sys/vm/drop_caches before each"
           : drop_wanted      ? "drop_caches failed midway, then posix_fadvise(DONTNEED) of each file"
                              : "posix_fadvise(DONTNEED) of each file (no drop_caches: not root?)");
    printf("%6s %28s %28s %26s %24s\n", "cache", "read() MB/s [min .. max]",
           "tp_llm_load MB/s [min .. max]", "load s [min .. max]", "load/read [min .. max]");
    for (int warm = 0; warm < 2; warm++) {
        double rd[MAX_REPS], ld[MAX_REPS], lt[MAX_REPS], ratio[MAX_REPS];
        for (int i = 0; i < o->reps; i++) {
            rd[i] = gb / r->disk[warm][i] / 1e6;
            ld[i] = gb / r->load[warm][i] / 1e6;
            lt[i] = r->load[warm][i];
            ratio[i] = ld[i] / rd[i];
        }
        double m[4], l[4], h[4];
        stats(rd, o->reps, &m[0], &l[0], &h[0]);
        stats(ld, o->reps, &m[1], &l[1], &h[1]);
        stats(lt, o->reps, &m[2], &l[2], &h[2]);
        stats(ratio, o->reps, &m[3], &l[3], &h[3]);
        char c[4][64];
        snprintf(c[0], sizeof c[0], "%.0f [%.0f .. %.0f]", m[0], l[0], h[0]);
        snprintf(c[1], sizeof c[1], "%.0f [%.0f .. %.0f]", m[1], l[1], h[1]);
        snprintf(c[2], sizeof c[2], "%.3f [%.3f .. %.3f]", m[2], l[2], h[2]);
        snprintf(c[3], sizeof c[3], "%.2f [%.2f .. %.2f]", m[3], l[3], h[3]);
        printf("%6s %28s %28s %26s %24s\n", warm ? "warm" : "cold", c[0], c[1], c[2], c[3]);
    }
    printf("# memory during a load (the highest over the loads): peak = tp_memory_stats "
           "peak_allocated (the parameters included),\n# above = peak less the tensor bytes "
           "held before the load (what the load adds); RSS+ = VmHWM above VmRSS before the load;\n"
           "# shard = the rank's parameter bytes; +1 = shard + its largest parameter (the "
           "issue's bound on the peak)\n");
    printf("%6s %10s %12s %10s %10s %11s %10s %10s\n", "rank", "shard MiB", "largest MiB",
           "peak MiB", "above MiB", "peak/shard", "peak/(+1)", "RSS+ MiB");
    const double M = 1048576.0;
    double sh = 0, big = 0;
    for (int i = 0; i < r->nranks; i++) {
        sh += r->shard[i];
        big += r->largest[i];
    }
    for (int i = 0; i < (o->mpi ? r->nranks : 1); i++) {
        const double s = o->mpi ? r->shard[i] : sh, l = o->mpi ? r->largest[i] : big;
        char who[16];
        if (o->mpi)
            snprintf(who, sizeof who, "%d", i);
        else
            snprintf(who, sizeof who, "all");
        printf("%6s %10.1f %12.1f %10.1f %10.1f %11.2f %10.2f %10.1f\n", who, s / M, l / M,
               r->tpeak[i] / M, (r->tpeak[i] - r->tbase[i]) / M, r->tpeak[i] / s,
               r->tpeak[i] / (s + l), r->rss[i] / M);
    }
    if (!o->mpi)
        printf("# shm: one process, so the memory is all ranks' together (largest: the sum of "
               "each rank's; per rank: mpirun -np %d tp-bench-llm --load DIR --tp %d "
               "--backend mpi)\n", tp, tp);
done:
    for (int i = 0; i < r->files.n; i++)
        free(r->files.path[i]);
    free(r);
    return rc;
}

int main(int argc, char **argv)
{
    options o;
    int rc = parse_args(argc, argv, &o);
    if (rc)
        return rc;
    if (o.cuda && tp_cuda_device_count() <= 0) {
        fprintf(stderr, "tp-bench-llm: --device cuda: no CUDA device\n");
        return 1;
    }
    if (o.dump)
        rc = run_dump(&o);
    else if (o.save)
        rc = run_save(&o);
    else if (o.load)
        rc = run_load(&o);
    else if (o.decode)
        rc = run_decode(&o);
    else if (o.train)
        rc = run_train(&o);
    else
        rc = run_perf(&o);
    free(o.ids);
    return rc;
}
