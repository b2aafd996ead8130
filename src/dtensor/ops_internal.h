/* The op layer: one dispatcher that picks a sharding strategy per mesh dim,
 * redistributes the inputs to it (differentiably, counted), runs the local
 * kernel and records a node whose backward runs the local backward kernel and
 * wraps the gradients in the strategy's placements. Each op supplies a
 * tp__op_def. Not installed. */
#ifndef TP_OPS_INTERNAL_H
#define TP_OPS_INTERNAL_H

#include "dtensor/dtensor_internal.h"
#include "dtensor/stash.h"
#include "kernels/kernels.h"
#include "tp/ops.h"

#define TP__OP_MAX_IN 4
#define TP__OP_MAX_STRATS 24
#define TP__OP_MAX_SAVED 4

/* One strategy on one mesh dim. */
typedef struct tp__strategy {
    tp_placement in[TP__OP_MAX_IN];   /* what each present input must be */
    tp_placement out;                 /* what the output is */
    tp_placement grad[TP__OP_MAX_IN]; /* what the local gradient of input i is */
} tp__strategy;

typedef struct tp__op tp__op;

typedef struct tp__op_def {
    const char *name;
    int n_inputs;
    const char *input_names[TP__OP_MAX_IN];
    unsigned optional_mask;   /* bit i: input i may be NULL */
    unsigned nondiff_mask;    /* bit i: input i never gets a gradient (indices) */
    /* the kernel whose engine decides the dtypes the op takes (supports()
     * for the one dtype all differentiable inputs share: f32, bf16, f16).
     * TP__KOP_NONE: the copy kernel decides (views). */
    tp__kop dtype_kernel;
    bool strided_ok;          /* local inputs may be non-contiguous views (read by strides) */
    /* selective recomputation keeps the output (GEMMs; stash.h) */
    bool recompute_keep;
    /* the output is a GELU whose backward a consumer's product may take
     * over (tp_linear_gelu: tp__op_gelu_source) */
    bool gelu_output;
    /* fills up to TP__OP_MAX_STRATS strategies for one mesh dim; returns the
     * count. NULL: the op has no distributed form. */
    int (*strategies)(const tp__op *op, int mesh_dim, tp__strategy *out);
    /* global output shape from the global input shapes and params */
    tp_status (*out_shape)(const tp__op *op, int *ndim, int64_t *shape);
    /* local forward on the (redistributed) local inputs; allocates *out */
    tp_status (*forward)(tp__op *op, tp_tensor *const *in, tp_tensor **out);
    /* local backward: gy has the output's placement (Partial read as
     * Replicate); sets g[i] for every input with op->need_grad[i] */
    tp_status (*backward)(tp__op *op, tp_tensor *const *in, tp_tensor *gy, tp_tensor **g);
} tp__op_def;

struct tp__op {
    const tp__op_def *def;
    tp_tensor *arg[TP__OP_MAX_IN]; /* the caller's arguments (borrowed during the call) */
    tp_tensor *in[TP__OP_MAX_IN];  /* redistributed inputs (retained by a recorded node) */
    int arg_ndim[TP__OP_MAX_IN];   /* global shapes of the arguments */
    int64_t arg_shape[TP__OP_MAX_IN][TP_MAX_DIMS];
    bool need_grad[TP__OP_MAX_IN];
    bool distributed;
    tp_dtype dt;            /* the op's dtype: its differentiable inputs' (f32 when none) */
    tp_device dev;          /* where every local input lives, and where the op runs */
    const tp__kernels *k;   /* dev's engine */
    tp_mesh *mesh;
    int mesh_ndim;
    tp_placement in_pl[TP__OP_MAX_IN][TP_MESH_MAX_DIMS];
    tp_placement out_pl[TP_MESH_MAX_DIMS];
    tp_placement grad_pl[TP__OP_MAX_IN][TP_MESH_MAX_DIMS];
    int out_ndim;
    int64_t out_shape[TP_MAX_DIMS];
    tp_tensor *saved[TP__OP_MAX_SAVED]; /* local tensors the forward keeps for the backward */
    _Alignas(8) unsigned char params[160];
};

#define TP__OP_PARAMS(op, T) ((T *)(void *)(op)->params)

/* Runs an op: validation of plain/DTensor mixing, strategy choice,
 * redistribution, forward, recording. params (plen bytes) are copied. */
tp_status tp__op_run(const tp__op_def *def, tp_tensor *const *args, const void *params,
                     size_t plen, tp_tensor **out);

/* During op's backward: the node of the op with gelu_output whose output
 * gradient is, alone and with its local data unchanged, the gradient op
 * computes for its input i (the op's output reaches input i through nodes
 * that pass a gradient on untouched, to_local and from_local with matching
 * placements, and no node on the way expects another gradient), on op's
 * device and in its dtype; NULL when there is none. The caller may then
 * apply that op's GELU backward to the gradient it computes (the Megatron
 * MLP's net2 backward taking net1's GELU into its product). */
tp__node *tp__op_gelu_source(const tp__op *op, int i);

/* Global shape of input i (DTensor: logical; plain: its shape). Valid in
 * strategies, out_shape, forward and backward. */
static inline const int64_t *tp__op_gshape(const tp__op *op, int i) { return op->arg_shape[i]; }
static inline int tp__op_gndim(const tp__op *op, int i) { return op->arg_ndim[i]; }

/* true on the ranks that hold the single copy of a term added to a Partial
 * output (coordinate 0 on every mesh dim where the output is Partial), and
 * always for plain tensors. */
bool tp__op_partial_leader(const tp__op *op);

/* Global offset of this rank's shard of input i along every dim. */
void tp__op_offset(const tp__op *op, int i, int64_t *offset);

/* Strategy helpers. */
static inline tp_placement tp__R(void) { return tp_replicate(); }
static inline tp_placement tp__S(int d) { return tp_shard(d); }
static inline tp_placement tp__P(void) { return tp_partial(TP_SUM); }

/* New contiguous tensor of dtype dt and a shape on a device (zeroed by the
 * device's engine when zero). */
tp_status tp__new(tp_dtype dt, tp_device dev, int ndim, const int64_t *shape, bool zero,
                  tp_tensor **out);
/* tp__new of an f32 tensor: the statistics ops save (norm mean/rstd, the
 * cross-entropy row max and sums) are f32 whatever the op's dtype. */
tp_status tp__f32(tp_device dev, int ndim, const int64_t *shape, bool zero, tp_tensor **out);
/* dst = src, n elements of dtype dt on device dev (n may be 0 with NULL
 * pointers). */
tp_status tp__op_copy(tp_device dev, tp_dtype dt, void *dst, const void *src, int64_t n);
/* "cpu" or "cuda:N" into buf; returns buf. */
const char *tp__device_str(tp_device dev, char *buf, size_t len);
/* TP_ERR_INVALID_ARG naming both devices unless a and b (either may be NULL)
 * are on the same device. */
tp_status tp__same_device(const char *fn, const char *an, const tp_tensor *a, const char *bn,
                          const tp_tensor *b);
/* What a forward keeps of its own output for the backward: a second header
 * over the output's storage, not the output, whose autograd state holds the
 * op's node (keeping the output would be a cycle, never freed). */
static inline tp_status tp__op_save_output(const tp_tensor *out, tp_tensor **saved)
{
    return tp__tensor_alias(out, saved);
}
/* rows = product of all dims but the last, for a contiguous tensor. */
int64_t tp__rows(const tp_tensor *t);
/* Checks the dtypes of the op's differentiable arguments (before any
 * redistribution): all one dtype (else TP_ERR_INVALID_ARG "... the dtypes
 * must match"), one the op's dtype_kernel takes on the op's engine (else
 * TP_ERR_NOT_SUPPORTED); sets op->dt. */
tp_status tp__check_dtypes(tp__op *op);
/* TP_ERR_NOT_SUPPORTED (as tp__check_dtypes words it) unless the engine of
 * t's device takes t's dtype for kop: for ops that do not run through
 * tp__op_run (vocab-parallel cross entropy). */
tp_status tp__op_check_dtype(const char *fn, const char *what, const tp_tensor *t, tp__kop kop);

#endif /* TP_OPS_INTERNAL_H */
