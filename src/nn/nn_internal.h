/* Internal layout of modules, shared by src/nn and src/styles. Not installed. */
#ifndef TP_NN_INTERNAL_H
#define TP_NN_INTERNAL_H

#include "core/core.h"
#include "tp/nn.h"

typedef struct tp__hook {
    void *fn; /* tp_forward_pre_hook or tp_forward_hook */
    void *ctx;
    void (*ctx_free)(void *ctx);
} tp__hook;

struct tp_module {
    tp_module_kind kind;
    char *type_name; /* owned */
    char *name;      /* owned; "" for a root */
    tp_module *parent;

    int n_children, cap_children;
    tp_module **children; /* owned, insertion order */

    int n_params, cap_params;
    char **param_names;  /* owned */
    tp_tensor **params;  /* retained; NULL for an absent optional one (bias=false) */

    int n_pre, cap_pre;
    tp__hook *pre_hooks;
    int n_post, cap_post;
    tp__hook *post_hooks;

    union {
        struct {
            int64_t in, out;
            bool bias;
        } linear;
        struct {
            int64_t num, dim;
        } embedding;
        struct {
            int64_t dim;
            bool affine;
            double eps;
        } norm;
        struct {
            double p;
            uint64_t seed;
            uint64_t calls;
        } dropout;
        tp_gelu_approx gelu;
    } cfg;

    tp_forward_fn forward; /* every kind: built-ins set their own */
    void *ctx;
    void (*ctx_free)(void *ctx);

    /* set by a parameter-sharding style (Colwise, Rowwise, SequenceParallel):
     * a second one on the same module is an error */
    const char *sharded_by;
    bool training; /* dropout active (default true) */
};

/* The FQN of m relative to root ("" for root itself) into buf. */
const char *tp__module_fqn(const tp_module *root, const tp_module *m, char *buf, size_t len);

#endif /* TP_NN_INTERNAL_H */
