/* Internal layout of modules, private to src/nn: layers above reach modules
 * through nn_ext.h and the public API. Not installed. */
#ifndef TP_NN_INTERNAL_H
#define TP_NN_INTERNAL_H

#include <stdatomic.h>

#include "core/core.h"
#include "nn/nn_ext.h"
#include "tp/nn.h"

/* A user context with its destructor, shared by a module and its replicas
 * (tp_module_replicate): ctx_free runs once, when the last of them lets go
 * (the module freed, the hook removed), whatever the order. Thread-safe:
 * replicas may live on other threads. */
typedef struct tp__ctx_ref {
    atomic_int refs;
    void *ctx;
    void (*ctx_free)(void *ctx);
} tp__ctx_ref;

/* A new reference holding ctx (refs 1); NULL when out of memory. */
tp__ctx_ref *tp__ctx_ref_new(void *ctx, void (*ctx_free)(void *ctx));
/* Returns r; NULL is a no-op. */
tp__ctx_ref *tp__ctx_ref_retain(tp__ctx_ref *r);
/* The last release calls ctx_free(ctx). NULL is a no-op. */
void tp__ctx_ref_release(tp__ctx_ref *r);

typedef struct tp__hook {
    void *fn; /* tp_forward_pre_hook, tp_forward_hook or tp_step_pre_hook;
               * NULL once removed while the module was running (dropped
               * when it returns) */
    void *ctx;
    tp__ctx_ref *ref; /* owns ctx; NULL when there is no ctx_free */
    int id;           /* the handle: > 0, unique within the module */
} tp__hook;

/* An upper layer's state on a module (tp__module_attach). */
typedef struct tp__attachment {
    const void *key;
    tp__ctx_ref *ref; /* owns the pointer; shared with replicas */
} tp__attachment;

struct tp_module {
    tp_module_kind kind;
    char *type_name; /* owned */
    char *name;      /* owned; "" for a root */
    tp_module *parent;

    int n_children;
    size_t cap_children;
    tp_module **children; /* owned, insertion order */

    int n_params;
    size_t cap_params;
    char **param_names;  /* owned */
    tp_tensor **params;  /* retained; NULL for an absent optional one (bias=false) */

    int n_pre;
    size_t cap_pre;
    tp__hook *pre_hooks;
    int n_post;
    size_t cap_post;
    tp__hook *post_hooks;
    int n_step;
    size_t cap_step;
    tp__hook *step_hooks; /* tp_step_pre_hook: before an optimizer step */
    int next_hook_id;
    /* > 0 while this module's hooks may be iterating (its forward, its step
     * hooks): removals only mark entries, compacted when it drops to 0 */
    int busy;
    bool hooks_removed;

    union {
        struct {
            int64_t in, out;
            bool bias;
            bool fused_gelu;     /* forward: tp_linear_gelu (tp_nn_linear_fuse_gelu) */
            tp_gelu_approx gelu; /* its approximation */
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
    tp__ctx_ref *ctx_ref; /* owns ctx (shared with replicas); NULL: no ctx_free */

    int n_attached;
    size_t cap_attached;
    tp__attachment *attached; /* owned: upper layers' state (nn_ext.h) */
    bool training; /* dropout active (default true) */
    tp_recompute_mode recompute; /* activation recomputation of this module (recompute.c) */
    /* The logical device (tp_module_device): {CPU, 0} for every module
     * created by the library; a replica's modules hold the device they were
     * replicated to (replicate.c), which for the CPU names a logical device
     * (one per shm rank) that physical tensors do not record. */
    tp_device device;
};

/* The FQN of m relative to root ("" for root itself) into buf; returns its
 * full length (see module.c). */
size_t tp__module_fqn(const tp_module *root, const tp_module *m, char *buf, size_t len);

/* m's forward (m->forward, between its hooks) with m->recompute applied:
 * run without recording and recorded as one function that runs it again in
 * backward (recompute.c). Called only while grad is enabled. */
tp_status tp__recompute_forward(tp_module *m, int nargs, tp_tensor **args, int nkw,
                                tp_kwarg *kw, tp_tensor **out);

/* Runs the step pre-hooks of m's subtree, depth first (optimizers call it
 * before updating). */
tp_status tp__module_run_step_hooks(tp_module *m);

/* Calls fn(fqn, param, ctx) for the parameters of m's subtree, depth first
 * in registration order. unique: a tensor registered under several names
 * (a tied weight) is reported once, under the first (what
 * tp_module_named_parameters shows); otherwise every name is (state dicts). */
tp_status tp__module_walk_params(tp_module *m, bool unique,
                                 tp_status (*fn)(const char *fqn, tp_tensor *param, void *ctx),
                                 void *ctx);

/* Whether a and b are one parameter (optim.c): the same tensor, or two
 * handles over the same storage region (storage, offset, shape, strides,
 * dtype) with the same layout (both plain, or DTensors on one mesh with the
 * same placements and global shape). Handles over overlapping but different
 * regions are different parameters. */
bool tp__param_same(const tp_tensor *a, const tp_tensor *b);

/* Original parameters -> their copies (tp_module_to, tp_module_replicate),
 * so that a tied parameter stays tied in the copy: the same tensor maps to
 * the same copy, another handle over the same parameter (tp__param_same) to
 * a handle over the copy's storage with its own layout. Holds no
 * references; zero-initialize, free v. */
typedef struct tp__param_map {
    struct tp__param_pair {
        const tp_tensor *from;
        tp_tensor *to;
    } *v;
    size_t n, cap;
} tp__param_map;

/* Records from -> to; false when out of memory (nothing recorded). */
bool tp__param_map_add(tp__param_map *mm, const tp_tensor *from, tp_tensor *to);
/* The copy of p as a new reference in *out (a new handle when p is another
 * handle of a mapped parameter; it requires grad as the copy does), or NULL
 * when p's parameter was not copied yet. */
tp_status tp__param_map_find(const tp__param_map *mm, tp_tensor *p, tp_tensor **out);

/* ---- the optimizers as the grad scaler drives them (optim.c, amp.c) ---- */

/* A step whose gradients are multiplied by inv_scale (in f32, as they are
 * read: the scaler's unscaling fused into the step). */
tp_status tp__adam_step_scaled(tp_adam *opt, float inv_scale);
tp_status tp__sgd_step_scaled(tp_sgd *opt, float inv_scale);
tp_module *tp__adam_module(const tp_adam *opt);
tp_module *tp__sgd_module(const tp_sgd *opt);
/* *found: some gradient of m's parameters holds an inf or NaN, in this
 * rank's local values (no communication). */
tp_status tp__grads_nonfinite(const char *fn, tp_module *m, bool *found);

#endif /* TP_NN_INTERNAL_H */
