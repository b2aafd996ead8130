/* What the layers above nn (styles, and whatever builds on modules next) may
 * know of a module beyond tp/nn.h: a few accessors and a slot for their own
 * per-module state. The module's layout stays private to src/nn
 * (nn_internal.h); an upper layer includes this header, never that one.
 * Not installed.
 *
 * Besides these, upper layers use the public API: tp_module_kind_of and
 * tp_module_type_name (the type), tp_module_parameter /
 * tp_module_set_parameter (a parameter by name), tp_module_num_children /
 * tp_module_child_at (the tree), and the tp_module_add_*_hook functions. */
#ifndef TP_NN_EXT_H
#define TP_NN_EXT_H

#include <stdint.h>

#include "core/core.h"
#include "tp/nn.h"

/* A Linear's in_features (the global size of its input's last dim); -1 for
 * another kind or NULL. */
int64_t tp__module_linear_in(const tp_module *m);

/* m's own parameter slots (not its children's), in registration order,
 * absent ones (a Linear's bias without bias) included; 0 for NULL. */
int tp__module_num_params(const tp_module *m);
/* Slot i's tensor (borrowed; NULL for an absent parameter or i out of
 * range), its name in *name (may be NULL; NULL when i is out of range).
 * Replace it with tp_module_set_parameter. */
tp_tensor *tp__module_param_at(const tp_module *m, int i, const char **name);

/* ---- attachments ----------------------------------------------------------------
 *
 * State an upper layer keeps on a module (the parameter-sharding style that
 * distributed its parameters, say), keyed by the address of an object the
 * owner defines (`static const char key;`), so that owners never collide and
 * the module knows nothing of them. The module owns what is attached:
 * free_fn (may be NULL) runs once, when the attachment is replaced or
 * removed, or when the last module holding it is freed (a replica made by
 * tp_module_replicate holds its original's attachments too). Not
 * thread-safe: a module is changed by one thread at a time. */

/* Attaches ptr under key, replacing (and freeing) what was attached there;
 * ptr NULL removes the attachment. On failure (TP_ERR_NO_MEMORY, or
 * TP_ERR_INVALID_ARG for a NULL module or key) the caller keeps ptr:
 * free_fn is not called. */
tp_status tp__module_attach(tp_module *m, const void *key, void *ptr, void (*free_fn)(void *));
/* What is attached to m under key, or NULL. */
void *tp__module_attached(const tp_module *m, const void *key);

/* ---- optimizer state, as checkpoints save and restore it (optim.c) ------------
 *
 * An optimizer's per-parameter state: made at a parameter's first step with a
 * gradient, keyed by its first FQN (named_parameters order) and its tensor. */

/* One of the two stateful optimizers (exactly one set). */
typedef struct tp__opt_ref {
    tp_adam *adam;
    tp_sgd *sgd;
} tp__opt_ref;

typedef struct tp__opt_state {
    const char *fqn;   /* the parameter's first FQN */
    tp_tensor *param;  /* the parameter (a DTensor or a plain tensor) */
    tp_tensor *master; /* f32 master of a bf16/f16 parameter's local block; NULL: none */
    tp_tensor *m, *v;  /* f32 local blocks: Adam's exp_avg and exp_avg_sq; SGD's
                        * momentum buffer in m (v NULL); NULL: none yet */
    int64_t step;      /* the parameter's steps */
} tp__opt_state;

typedef struct tp__opt_hyperparams {
    double lr, beta1, beta2, eps, weight_decay, momentum, dampening;
    bool decoupled, nesterov;
} tp__opt_hyperparams;

/* The states, in creation order: state i, borrowed (valid until the next
 * step or commit). */
int tp__opt_num_states(tp__opt_ref o);
void tp__opt_state_at(tp__opt_ref o, int i, tp__opt_state *out);
void tp__opt_hyper(tp__opt_ref o, tp__opt_hyperparams *h);
/* The module the optimizer steps. */
tp_module *tp__opt_module(tp__opt_ref o);

/* A replacement set of states, built before anything changes (the only
 * fallible part: it copies the FQNs and retains the tensors), then
 * installed by commit, which cannot fail and takes p. The caller checks
 * that each param is the module's current parameter of that FQN and the
 * tensors' shapes. */
typedef struct tp__opt_pending tp__opt_pending;
tp_status tp__opt_pending_new(int n, const tp__opt_state *v, tp__opt_pending **out);
void tp__opt_pending_commit(tp__opt_ref o, tp__opt_pending *p);
/* NULL is a no-op. */
void tp__opt_pending_free(tp__opt_pending *p);

#endif /* TP_NN_EXT_H */
