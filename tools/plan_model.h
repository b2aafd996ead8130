/*
 * The Llama-shaped decoder that tp-plan and tp-bench-sim play as one rank of
 * a simulated dp x tp world on meta tensors (docs/sim.md, docs/plan.md):
 * per block RMSNorm, attention with colwise wq/wk/wv and rowwise wo, a gated
 * GELU MLP with colwise w1/w3 and rowwise w2, residuals; optionally a token
 * embedding (rowwise), a final RMSNorm and a colwise output projection whose
 * logits feed a cross entropy (vocabulary-parallel with loss_parallel).
 * With vocab 0 the loss is the mean of the last block's output.
 *
 * Or, with plan_cfg.llm, a Hugging Face config's model as src/models builds
 * it (tp_llm_create: grouped kv heads, SwiGLU, the config's vocabulary and
 * tied embeddings), parallelized with the standard plan (tp_llm_plan_create),
 * its step tp_llm_forward and tp_llm_loss: the same step around it.
 */
#ifndef TP_TOOLS_PLAN_MODEL_H
#define TP_TOOLS_PLAN_MODEL_H

#include <stdbool.h>
#include <stdint.h>

#include "tp.h"

typedef struct plan_cfg {
    int64_t layers, hidden, ffn, heads, vocab, seq, batch;
    tp_dtype dtype;
    int64_t dp, tp, rank;
    bool sp;            /* sequence parallel between the TP regions */
    bool loss_parallel; /* the logits stay sharded on the vocabulary (needs vocab) */
    /* NULL: the decoder above. Else the model of this config (borrowed, must
     * outlive the calls), whose sizes are then the model's: layers, hidden,
     * ffn, heads and vocab are not read. */
    const tp_llm_config *llm;
    /* activation recomputation of the decoder blocks (tp_module_set_recompute):
     * every ac_every-th block (0 or 1: all of them) */
    tp_recompute_mode ac;
    int64_t ac_every;
    /* fully sharded data parallel over dp (each block a unit, then the
     * root) instead of DDP; keep_after_forward: FSDP2's
     * reshard_after_forward=False */
    bool fsdp, keep_after_forward;
} plan_cfg;

/* What one simulated step gave. */
typedef struct plan_step {
    tp_comm_debug *dbg;   /* the step's collectives (forward to optimizer) */
    tp_plan_trace *trace; /* the step's kernels, collectives and waits */
    double t_build, t_setup, t_forward, t_backward, t_optim; /* wall seconds */
    int64_t params;       /* this rank's parameter elements */
    int64_t params_total; /* the model's (global shapes; a tied weight once) */
    uint64_t param_bytes; /* this rank's parameters, in their dtype */
    uint64_t peak_bytes;  /* tp_memory_stats(TP_META) peak, 0 when not known */
} plan_step;

/* NULL when c is valid; else a static message naming the field at fault
 * ("heads (6) must be divisible by tp (4)"; with llm, the config's key:
 * "num_attention_heads (6) must be divisible by tp (4)"). */
const char *plan_cfg_check(const plan_cfg *c);

/* Plays one training step (build on meta, parallelize, DDP over dp, Adam;
 * forward, backward, optimizer step) as rank c->rank; *out owns dbg and
 * trace (plan_step_free). */
tp_status plan_run_step(const plan_cfg *c, plan_step *out);
void plan_step_free(plan_step *s);

/* Runs the same step for real on this machine: dp x tp shm ranks (threads)
 * on the CPU, one warm-up step and then `steps` steps, each between two
 * barriers; seconds[i] is rank 0's wall time of step i. */
tp_status plan_measure_steps(const plan_cfg *c, int steps, double *seconds);

/* The same on `world` (dp x tp ranks of any backend, e.g. one process per
 * rank of an "mpi" world under mpirun), every rank calling it; seconds is
 * filled on rank 0 only. TP_ERR_INVALID_ARG when the world's size is not
 * dp x tp. */
tp_status plan_measure_steps_on(const plan_cfg *c, tp_comm *world, int steps, double *seconds);

#endif /* TP_TOOLS_PLAN_MODEL_H */
