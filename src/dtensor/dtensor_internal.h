/* Internal definitions of the dtensor layer: the distribution of a DTensor,
 * autograd metadata and nodes, the redistribute executor. Not installed. */
#ifndef TP_DTENSOR_INTERNAL_H
#define TP_DTENSOR_INTERNAL_H

#include <stdatomic.h>

#include "collectives/comm_debug_internal.h"
#include "core/core.h"
#include "dtensor/grad_pending.h"
#include "tp/comm_debug.h"
#include "tp/dtensor.h"
#include "tp/ops.h"

/* The layout of a DTensor (part of its extension, tp__ext below). */
typedef struct tp__dist {
    tp_tensor *local; /* retained; plain */
    tp_mesh *mesh;    /* holds a reference (tp_mesh_retain) */
    int mesh_ndim;
    tp_placement placements[TP_MESH_MAX_DIMS]; /* normalized shard dims */
} tp__dist;

/* New DTensor header over `local` (retained) with this layout; global shape
 * given; holds a reference on mesh. No checks, no autograd. */
tp_status tp__dtensor_wrap(tp_mesh *mesh, tp_tensor *local, const tp_placement *placements,
                           int ndim, const int64_t *global_shape, tp_tensor **out);

/* Shard extent along every tensor dim for a mesh coordinate (NULL: this
 * rank's), following the nesting rule (mesh dim 0 splits first). */
void tp__shard_extent(const tp_mesh *mesh, int ndim, const int64_t *global_shape,
                      const tp_placement *placements, const int64_t *coord, int64_t *local_shape,
                      int64_t *offset);

/* Validates a placement list against a mesh and a tensor rank; normalizes
 * shard dims into `out`. allow_partial: Partial allowed at all. */
tp_status tp__placements_check(const char *fn, const tp_mesh *mesh, int ndim, int n,
                               const tp_placement *in, bool allow_partial, tp_placement *out);

bool tp__placement_eq(tp_placement a, tp_placement b);

/* ---- autograd ------------------------------------------------------------- */

#define TP__NODE_MAX_INPUTS 4

typedef struct tp__node tp__node;

/* Computes the gradients of the node's inputs from the gradient of its output.
 * grad_in[i] starts NULL; set it (a new reference) for every input that
 * requires grad. */
typedef tp_status (*tp__backward_fn)(tp__node *node, tp_tensor *grad_out, tp_tensor **grad_in);

/* Saved state that points at a mesh (an op's, to_local's, the vocab-parallel
 * cross entropy's) takes no reference of its own: the node retains a DTensor
 * on that mesh (an input that requires grad, or the op's redistributed
 * inputs) until free_saved has run, and the DTensor holds the mesh. */
struct tp__node {
    atomic_long refcount;
    const char *name;
    tp__backward_fn backward;
    void (*free_saved)(tp__node *node);
    int n_inputs;
    tp_tensor **inputs; /* retained; NULL where no grad flows: inputs_inline, or
                         * allocated for a custom function of more inputs */
    tp_tensor *inputs_inline[TP__NODE_MAX_INPUTS];
    void *saved;
    tp_tensor *saved_t[4]; /* retained tensors for the backward, released with the graph */
    bool released;
    tp__cd_saved *scope; /* comm-debug scopes at creation (NULL: none), re-entered in backward */
    /* Whether a gradient of placements `in` (NULL: a plain tensor) reaches
     * inputs[0] with its local data unchanged, and as what: placements into
     * out on *mesh, or *plain. NULL: the node may change it. (from_local,
     * to_local: the walk of tp__op_gelu_source.) */
    bool (*grad_passes)(const tp__node *node, const tp_placement *in, tp_placement *out,
                        tp_mesh **mesh, bool *plain);
    /* backward bookkeeping */
    int pending;
    tp_tensor *grad_acc;
};

typedef struct tp__grad_hook {
    tp_grad_hook_fn fn;
    void *ctx;
    int id;
    struct tp__grad_hook *next;
} tp__grad_hook;

typedef struct tp__autograd {
    bool requires_grad;
    tp_tensor *grad;     /* accumulated (leaves) */
    bool grad_owned;     /* grad is this leaf's own buffer (a sum libtp made, or
                          * one installed with tp_tensor_set_grad): later
                          * contributions are added into it in place */
    tp__node *grad_fn;   /* retained */
    tp__grad_hook *hooks; /* post-accumulate hooks, in registration order */
    int next_hook_id;
    int leaf_pending;    /* during a backward: contributions still to come */
    /* the gradient's final value is in flight (grad_pending.h) */
    tp__grad_pending_fn pending;
    void *pending_ctx;
} tp__autograd;

/* ---- the tensor extension ---------------------------------------------------- */

/* What this layer hangs on a tensor through core's extension seam
 * (tp_tensor.ext, with tp__ext_ops): autograd state for any tensor, and the
 * layout of a DTensor. A DTensor (a tensor without storage) has one from its
 * creation; a plain tensor gets one when autograd first needs it. Freed with
 * the tensor's last reference, by the finalize hook. */
typedef struct tp__ext {
    tp__autograd ag; /* all zero: no autograd state */
    tp__dist dist;   /* a DTensor's; zero for a plain tensor */
} tp__ext;

extern const tp__tensor_ext_ops tp__ext_ops;

/* t's extension, created (zeroed) when missing; NULL when out of memory. */
tp__ext *tp__ext_get(tp_tensor *t);

/* t's layout when t is a DTensor, else NULL (t may be NULL). */
static inline tp__dist *tp__dist_of(const tp_tensor *t)
{
    return t && !t->storage ? &((tp__ext *)t->ext)->dist : NULL;
}

/* t's autograd state, NULL when it has none (t may be NULL). */
static inline tp__autograd *tp__ag_of(const tp_tensor *t)
{
    return t && t->ext ? &((tp__ext *)t->ext)->ag : NULL;
}

/* true when recording is on and any of the tensors requires grad. */
bool tp__needs_grad(int n, tp_tensor *const *inputs);

/* Creates a node over the inputs (those not requiring grad are stored NULL)
 * and attaches it to `out` as its grad_fn. On allocation failure returns
 * TP_ERR_NO_MEMORY and leaves `out` untouched. */
tp_status tp__node_attach(tp_tensor *out, const char *name, tp__backward_fn backward, int n,
                          tp_tensor *const *inputs, tp__node **node_out);

/* free_saved for nodes whose saved state is one tp__malloc'd block. */
void tp__node_free_saved(tp__node *node);

/* a + b into a new tensor (plain or DTensor; for DTensors b is first brought
 * to a's placements, Partial targets allowed). */
tp_status tp__grad_add(tp_tensor *a, tp_tensor *b, tp_tensor **out);

/* ---- redistribute --------------------------------------------------------- */

/* Redistributes to `placements` (normalized, validated); internal callers may
 * target Partial. record: attach an autograd node when inputs require grad.
 * grad_placements is what the backward turns the gradient into (NULL: the
 * source placements with Partial replaced by Replicate). */
tp_status tp__redistribute(tp_tensor *dt, const tp_placement *placements, bool record,
                           tp_tensor **out);

/* One mesh dim's step of tp_dtensor_distribute: root splits `cur` along k
 * into chunks (torch.chunk rule) and every rank of `comm` receives its own,
 * contiguous. Non-root ranks pass cur NULL; every rank passes the level's
 * shape, dtype and device. */
tp_status tp__scatter_dim(tp_comm *comm, tp_tensor *cur, const int64_t *shape, int ndim,
                          tp_dtype dtype, tp_device dev, int k, int root, tp_tensor **out);

/* tp_scaled_dot_product_attention_with whose scores scratch (no gradient
 * wanted) is sized for at least key_capacity keys: a KV cache's decode
 * steps, whose key count grows by one each, then reuse one cached block. */
tp_status tp__sdpa_with_capacity(tp_tensor *q, tp_tensor *k, tp_tensor *v,
                                 const tp_sdpa_options *opts, int64_t key_capacity,
                                 tp_tensor **out);

#endif /* TP_DTENSOR_INTERNAL_H */
