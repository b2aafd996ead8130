/* Internal to src/models. Not installed. */
#ifndef TP_MODELS_INTERNAL_H
#define TP_MODELS_INTERNAL_H

#include <stdint.h>

#include "tp/models.h"

/* What a forward of the whole model hands its attention modules beyond
 * their inputs: the KV cache of tp_llm_forward_cached (NULL otherwise). One
 * per model, shared by the root, its "model" child and every attention
 * module; owned by the root. */
typedef struct tp__llm_run {
    tp_llm_cache *cache;
} tp__llm_run;

/* The context of a model's root and of its "model" child. */
typedef struct tp__llm {
    tp_llm_config cfg;
    tp__llm_run *run;
} tp__llm;

/* The context of an attention module. */
typedef struct tp__llm_attn {
    int64_t head_dim;
    /* Key/value heads replicated over the ranks that share one (tp larger
     * than the kv heads): the kv head this rank computes, and the tp mesh
     * (retained); -1 and NULL when k_proj and v_proj are sharded by the plan
     * or not parallelized. */
    int64_t kv_head;
    tp_mesh *mesh;
    int64_t layer;    /* the decoder layer's index */
    tp__llm_run *run; /* the model's (borrowed) */
} tp__llm_attn;

/* Frees an attention context (releasing its mesh). */
void tp__llm_attn_free(void *ctx);

/* The context of a model root tp_llm_create made (an attachment marks it),
 * else NULL. */
const tp__llm *tp__llm_of(const tp_module *m);

/* TP_ERR_INVALID_ARG naming the field unless cfg describes a model that can
 * be built (what tp_llm_config_parse checks, for configs filled by hand). */
tp_status tp__llm_config_check(const char *fn, const tp_llm_config *cfg);

/* Attention over the cache's positions and the new ones (generate.c): k and
 * v [B, local kv heads, S, D] (rotated) are written after the cache's length
 * in layer `layer`'s buffers, and q [B, local heads, S, D] attends over
 * every position so far (causal, the cache's padding mask). */
tp_status tp__llm_cache_attend(tp_llm_cache *cache, int64_t layer, tp_tensor *q, tp_tensor *k,
                               tp_tensor *v, double scale, tp_tensor **out);

#endif /* TP_MODELS_INTERNAL_H */
