/* Internal to src/models. Not installed. */
#ifndef TP_MODELS_INTERNAL_H
#define TP_MODELS_INTERNAL_H

#include <stdint.h>

#include "tp/models.h"

/* The context of a model's root and of its "model" child. */
typedef struct tp__llm {
    tp_llm_config cfg;
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
} tp__llm_attn;

/* Frees an attention context (releasing its mesh). */
void tp__llm_attn_free(void *ctx);

/* The context of a model root tp_llm_create made (an attachment marks it),
 * else NULL. */
const tp__llm *tp__llm_of(const tp_module *m);

/* TP_ERR_INVALID_ARG naming the field unless cfg describes a model that can
 * be built (what tp_llm_config_parse checks, for configs filled by hand). */
tp_status tp__llm_config_check(const char *fn, const tp_llm_config *cfg);

#endif /* TP_MODELS_INTERNAL_H */
