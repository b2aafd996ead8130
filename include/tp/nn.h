/*
 * tp/nn.h - modules: Linear, Embedding, LayerNorm, RMSNorm, Dropout, Identity,
 * ReLU, GELU, SiLU, Sequential, containers with named children and custom modules
 * whose forward the user writes with library ops; parameters with dotted
 * fully qualified names (FQNs), forward pre-hooks and hooks, deterministic
 * initialisation, state dicts, SGD and Adam, and replication onto devices
 * (torch.nn.parallel.replicate).
 *
 * Modules form a tree; a parent owns its children (tp_module_free frees the
 * subtree). Parameters are tensors (plain, or DTensors once a parallel style
 * distributed them) that require grad. A module's forward takes positional
 * inputs and keyword inputs; a NULL input is "None".
 */
#ifndef TP_NN_H
#define TP_NN_H

#include <stdbool.h>
#include <stdint.h>

#include "tp/dtensor.h"
#include "tp/ops.h"
#include "tp/status.h"
#include "tp/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * A module. Owner: its creator (tp_nn_*_create, tp_module_replicate) until
 * tp_module_add_child hands it to a parent; from then on the parent owns it
 * and tp_module_free of the root frees the subtree (tp_module_free of a child
 * is a no-op). A module holds a reference on each parameter and owns its
 * hooks' and custom ctx (ctx_free; shared with its replicas, the last holder
 * frees them); what its getters return is borrowed, valid until the module is
 * freed or the entry replaced. One thread uses a module at a time (a replica
 * is another module).
 */
typedef struct tp_module tp_module;

typedef enum tp_module_kind {
    TP_MODULE_LINEAR = 0,
    TP_MODULE_EMBEDDING,
    TP_MODULE_LAYER_NORM,
    TP_MODULE_RMS_NORM,
    TP_MODULE_DROPOUT,
    TP_MODULE_IDENTITY,
    TP_MODULE_RELU,
    TP_MODULE_GELU,
    TP_MODULE_SEQUENTIAL, /* children run in order, output feeding input */
    TP_MODULE_CONTAINER,  /* named children, no forward of its own */
    TP_MODULE_CUSTOM,     /* forward written by the user */
    TP_MODULE_SILU        /* SiLU (appended: the values above stay) */
} tp_module_kind;

/* A keyword input. */
typedef struct tp_kwarg {
    const char *name;
    tp_tensor *value; /* NULL: None */
} tp_kwarg;

/* A custom forward: reads self's children and parameters, computes with
 * library ops (tp_module_forward on children included) and returns one new
 * reference in *out. */
typedef tp_status (*tp_forward_fn)(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                                   const tp_kwarg *kw, tp_tensor **out);

/* ---- creation ------------------------------------------------------------ */

/* Parameters are allocated and zero until tp_module_init (or a state dict),
 * on the calling thread's default device (below). */
TP_API tp_status tp_nn_linear_create(int64_t in_features, int64_t out_features, bool bias,
                                     tp_module **out);
TP_API tp_status tp_nn_embedding_create(int64_t num, int64_t dim, tp_module **out);
/* Fuses the GELU that follows a Linear into it: from then on the Linear's
 * forward is tp_linear_gelu(x, weight, bias, approx), GELU(Linear(x)) as one
 * op (on CUDA one cuBLASLt product with the activation in its epilogue).
 * Its type name, parameters, FQNs and state dict stay a Linear's, so
 * checkpoints and parallelize plans written for the unfused model apply;
 * the GELU module after it is the caller's to drop (or replace with
 * Identity). ColwiseParallel applies (the output is S(-1), as before);
 * RowwiseParallel does not (its output is a partial sum, whose GELU is not
 * the GELU of the total): a Linear already split along its input features
 * is TP_ERR_INVALID_ARG here, and RowwiseParallel on a fused Linear is
 * refused by tp_parallelize_module. Not a Linear, or approx out of range:
 * TP_ERR_INVALID_ARG. Calling it again changes the approximation. */
TP_API tp_status tp_nn_linear_fuse_gelu(tp_module *linear, tp_gelu_approx approx);
/* Whether m is a Linear with a fused GELU (its approximation into *approx
 * when non-NULL). */
TP_API bool tp_nn_linear_fused_gelu(const tp_module *m, tp_gelu_approx *approx);
TP_API tp_status tp_nn_layer_norm_create(int64_t dim, bool affine, double eps, tp_module **out);
TP_API tp_status tp_nn_rms_norm_create(int64_t dim, bool affine, double eps, tp_module **out);
/* Dropout: the mask depends on (seed + call count, global element index). */
TP_API tp_status tp_nn_dropout_create(double p, uint64_t seed, tp_module **out);
TP_API tp_status tp_nn_identity_create(tp_module **out);
TP_API tp_status tp_nn_relu_create(tp_module **out);
TP_API tp_status tp_nn_gelu_create(tp_gelu_approx approx, tp_module **out);
/* SiLU (type name "SiLU"): forward tp_silu on its one input; no parameters. */
TP_API tp_status tp_nn_silu_create(tp_module **out);
TP_API tp_status tp_nn_sequential_create(tp_module **out);
TP_API tp_status tp_nn_container_create(tp_module **out);
/* ctx is passed back through tp_module_ctx; ctx_free (may be NULL) runs once,
 * when the module and every replica of it (tp_module_replicate) are freed. On
 * failure the caller keeps ctx (ctx_free is not called). */
TP_API tp_status tp_nn_custom_create(const char *type_name, tp_forward_fn forward, void *ctx,
                                     void (*ctx_free)(void *ctx), tp_module **out);
/* The device the built-in modules created afterwards on the calling thread
 * make their parameters on: TP_CPU until set (per thread, like PyTorch's
 * `with torch.device(...)`). TP_META builds a model of any size with no
 * memory behind its parameters (docs/sim.md); tp_module_to moves it to a
 * real device later. The CPU and meta devices take index 0 (another is
 * TP_ERR_INVALID_ARG); a CUDA device must exist (TP_ERR_NOT_SUPPORTED
 * otherwise). On error the setting is unchanged. Custom modules register
 * tensors of their own choosing. */
TP_API tp_status tp_nn_set_default_device(tp_device device);
TP_API tp_device tp_nn_default_device(void);

/* Frees the module and its subtree. NULL is a no-op. Only a root (a module
 * that is nobody's child) may be freed. */
TP_API void tp_module_free(tp_module *m);

/* ---- the tree -------------------------------------------------------------- */

/* Adds `child` under `name` (non-empty, no '.', unique among the children);
 * the parent takes ownership. A module has at most one parent. */
TP_API tp_status tp_module_add_child(tp_module *parent, const char *name, tp_module *child);
/* Child by name, or NULL. */
TP_API tp_module *tp_module_child(const tp_module *m, const char *name);
/* Module at a dotted path below m ("" is m itself), or NULL. */
TP_API tp_module *tp_module_find(tp_module *m, const char *fqn);
TP_API int tp_module_num_children(const tp_module *m);
/* i-th child in insertion order, with its name. */
TP_API tp_module *tp_module_child_at(const tp_module *m, int i, const char **name);
TP_API tp_module_kind tp_module_kind_of(const tp_module *m);
/* "Linear", "Embedding", ... or the custom type name. */
TP_API const char *tp_module_type_name(const tp_module *m);
/* The name under which m hangs in its parent ("" for a root). */
TP_API const char *tp_module_name(const tp_module *m);
TP_API void *tp_module_ctx(const tp_module *m);

/* ---- parameters ---------------------------------------------------------- */

/* Registers a parameter of a custom module (retained; marked requires_grad).
 * Names as for children. */
TP_API tp_status tp_module_register_parameter(tp_module *m, const char *name, tp_tensor *t);
/* Parameter by (local) name: Linear "weight"/"bias", Embedding "weight",
 * norms "weight"/"bias"; NULL if absent. Borrowed. */
TP_API tp_tensor *tp_module_parameter(const tp_module *m, const char *name);
/* Replaces a parameter (a style distributing it); the new tensor is retained
 * and marked requires_grad, the old one released. */
TP_API tp_status tp_module_set_parameter(tp_module *m, const char *name, tp_tensor *t);
/* Calls fn(fqn, param, ctx) for every parameter of the subtree, in
 * registration order, depth first; stops at the first non-OK return. A
 * tensor registered under several names (tied weights: one tp_tensor given
 * to tp_module_register_parameter / tp_module_set_parameter in several
 * places) is reported once, under the first name reached, as PyTorch's
 * named_parameters() does; state dicts list every name. */
TP_API tp_status tp_module_named_parameters(tp_module *m,
                                            tp_status (*fn)(const char *fqn, tp_tensor *param,
                                                            void *ctx),
                                            void *ctx);
/* Sets every parameter's gradient to none. */
TP_API void tp_module_zero_grad(tp_module *m);

/* Moves every parameter of the subtree to `device` (TP_CPU or TP_CUDA(i)):
 * each parameter not already there is replaced by a copy on the device (for a
 * DTensor parameter: a DTensor with the same mesh, placements and global
 * shape whose local shard is the copy), marked requires_grad and without a
 * gradient; the module drops the old tensor (with its gradient): references
 * the caller kept still point at the old one. Ties are kept: a tensor
 * registered under several names is copied once and every name gets the
 * copy, and handles over one storage region (one parameter for the
 * optimizers, see below) become handles over one new storage. An Adam
 * optimizer created earlier refuses the replaced parameters (create it
 * after moving). All or nothing: on failure no parameter has moved. A
 * CUDA device needs a CUDA build (TP_ERR_NOT_SUPPORTED otherwise).
 * TP_META drops every parameter's values (each becomes a meta tensor of
 * its shape and layout); from TP_META to a real device, which has no values
 * to copy, each parameter becomes zeros there: call tp_module_init (or load
 * a state dict) afterwards. */
TP_API tp_status tp_module_to(tp_module *m, tp_device device);

/*
 * param_dtype (mixed precision): casts every floating-point parameter of the
 * subtree to `dtype` (TP_F32, TP_BF16 or TP_F16; anything else is
 * TP_ERR_INVALID_ARG naming the dtype). Each parameter of another float
 * dtype is replaced by a copy in `dtype` (values rounded to nearest even) on
 * the same device; a DTensor parameter by a DTensor over a cast copy of its
 * local shard, with the same mesh, placements and global shape. A
 * parameter's gradient, if it has one, is cast the same way and becomes the
 * copy's gradient (PyTorch's module.to(dtype) does so too). Parameters
 * already in `dtype` and non-float ones are left alone. Ties are kept as by
 * tp_module_to, and as there the module drops the old tensors (references
 * the caller kept still point at them), optimizers created earlier refuse
 * the replaced parameters, and a DDP created earlier keeps the old ones:
 * cast first, then wrap (tp_ddp_create) and create optimizers. All or
 * nothing: on failure no parameter has changed. Not collective.
 *
 * Low-precision parameters train with f32 master weights through tp_adam
 * and tp_sgd (below), with gradients reduced in f32 by a DDP whose options
 * ask for it (tp/dp.h, has_reduce_dtype), and for f16 with loss scaling
 * (tp_grad_scaler, below).
 */
TP_API tp_status tp_module_to_dtype(tp_module *m, tp_dtype dtype);

/* ---- activation recomputation --------------------------------------------------
 *
 * Activation checkpointing (torch.utils.checkpoint, Megatron's activation
 * recomputation), here called recompute (tp_checkpoint_* is the on-disk
 * format). A module set to recompute runs its forward without keeping what
 * its backward needs, and runs it again during backward, just before its
 * gradients are needed:
 *
 *   TP_RECOMPUTE_FULL       keeps the module's inputs only; backward
 *                           recomputes the whole forward (its collectives
 *                           included)
 *   TP_RECOMPUTE_SELECTIVE  also keeps the outputs of its GEMMs (linear,
 *                           matmul) and of its redistributions (the
 *                           collectives), which the recompute reuses: it
 *                           redoes attention (as Megatron-LM's selective
 *                           recomputation does) and the element-wise work
 *                           (norms, activations, rotary, residuals), and
 *                           issues no GEMM and no collective
 *
 * Gradients are bit-identical to running without recomputation: the
 * recompute runs the same kernels on the same values, and each Dropout
 * module of the subtree replays the mask it drew in the forward (its
 * counter is rewound, then set back). Set on the units of a model (each
 * transformer block: tp_module_set_recompute_every on the container of the
 * blocks); the module's own hooks (a style's input and output preparation,
 * data parallelism's) run once, outside the recomputed part, its
 * children's run again. Collectives a recompute issues are counted by
 * comm-debug in TP_PHASE_RECOMPUTE, so the forward and backward counts
 * read as without it. Only while grad is enabled: under tp_no_grad_begin
 * (evaluation, generation) the module runs as usual. The module must
 * outlive the recorded graph (as its parameters do). A forward of the
 * module must compute the same function when run again: one that draws
 * random numbers other than through Dropout modules, or reads state that
 * changes between forward and backward, does not. */
typedef enum tp_recompute_mode {
    TP_RECOMPUTE_NONE = 0,
    TP_RECOMPUTE_FULL = 1,
    TP_RECOMPUTE_SELECTIVE = 2,
} tp_recompute_mode;

/* Sets m's mode (its children keep theirs; a child set too is recomputed
 * inside m's recompute, and again in its own backward). TP_ERR_INVALID_ARG
 * for NULL or an unknown mode. */
TP_API tp_status tp_module_set_recompute(tp_module *m, tp_recompute_mode mode);
/* m's mode (TP_RECOMPUTE_NONE for NULL). */
TP_API tp_recompute_mode tp_module_recompute(const tp_module *m);
/* Per-layer selection: child i of parent (in registration order; the
 * blocks of a model, "model.layers") gets `mode` when i % every == 0 and
 * TP_RECOMPUTE_NONE otherwise (every 1: all of them; every 2: blocks 0, 2,
 * 4, ...), as torchtitan's ac_freq selects them. TP_ERR_INVALID_ARG for a
 * NULL parent, every < 1 or an unknown mode, nothing changed. */
TP_API tp_status tp_module_set_recompute_every(tp_module *parent, int every,
                                               tp_recompute_mode mode);

/* Training mode of m and its subtree (default true); in evaluation mode
 * Dropout is the identity. */
TP_API void tp_module_set_training(tp_module *m, bool training);
TP_API bool tp_module_is_training(const tp_module *m);

/* ---- forward and hooks -------------------------------------------------------- */

/* Runs pre-hooks, the module's forward, then hooks. Enters the comm-debug
 * scope of the module (its name; the root's type name at the top). */
TP_API tp_status tp_module_forward(tp_module *m, int nargs, tp_tensor *const *args, int nkw,
                                   const tp_kwarg *kw, tp_tensor **out);
/* One positional input. */
TP_API tp_status tp_module_call(tp_module *m, tp_tensor *x, tp_tensor **out);

/* A pre-hook may replace inputs: it receives the argument arrays (owned by the
 * caller, entries replaceable: release the old one, store a new reference). */
typedef tp_status (*tp_forward_pre_hook)(tp_module *m, int nargs, tp_tensor **args, int nkw,
                                         tp_kwarg *kw, void *ctx);
/* A hook may replace the output (*out: release the old, store a new one). */
typedef tp_status (*tp_forward_hook)(tp_module *m, int nargs, tp_tensor *const *args,
                                     tp_tensor **out, void *ctx);
/*
 * Hooks run in registration order. ctx_free (may be NULL) runs once, when the
 * hook is removed or the module is freed (with replicas: when the last module
 * holding the hook lets go). On failure the caller keeps ctx (ctx_free is not
 * called). *handle (may be NULL) receives a handle for tp_module_remove_hook:
 * > 0, unique among the hooks of every kind on m (a replica's copy of a hook
 * has the original's handle); 0 on failure. Handles are never reused: a
 * module that has been given INT_MAX hooks refuses more (TP_ERR_STATE).
 */
TP_API tp_status tp_module_add_forward_pre_hook(tp_module *m, tp_forward_pre_hook fn, void *ctx,
                                                void (*ctx_free)(void *ctx), int *handle);
TP_API tp_status tp_module_add_forward_hook(tp_module *m, tp_forward_hook fn, void *ctx,
                                            void (*ctx_free)(void *ctx), int *handle);
/* A step pre-hook runs when tp_sgd_step / tp_sgd_opt_step / tp_adam_step /
 * tp_clip_grad_norm is called on m or an ancestor, before any parameter (or
 * gradient) changes (data parallelism waits for its
 * gradient all_reduces there). A failing hook stops the step with its status,
 * no parameter updated. Hooks of a subtree run depth first, in registration
 * order per module. */
typedef tp_status (*tp_step_pre_hook)(tp_module *m, void *ctx);
TP_API tp_status tp_module_add_step_pre_hook(tp_module *m, tp_step_pre_hook fn, void *ctx,
                                             void (*ctx_free)(void *ctx), int *handle);
/*
 * Removes the hook (of any kind) with this handle from m: it does not run
 * again, and its ctx_free runs once (at once, or, when the hook is removed
 * while m is running its forward or its step hooks, e.g. by the hook itself,
 * as soon as m returns; it does not run again in that forward either). A
 * handle that m does not hold (unknown, 0, already removed) and a NULL m are
 * no-ops. Hooks a parallel style or a DDP installed have no handle given out:
 * they stay for the module's life.
 */
TP_API void tp_module_remove_hook(tp_module *m, int handle);

/* ---- initialisation and state dicts ---------------------------------------- */

/*
 * Deterministic initialisation of every parameter from (seed, FQN): the
 * global value of each parameter is the same at every parallel degree, each
 * rank generating only its shard (counter-based RNG). Linear weight and bias:
 * uniform(-1/sqrt(in), 1/sqrt(in)); Embedding: normal(0, 1); norm weights 1,
 * biases 0. No communication. A tied parameter is initialised once, from its
 * first FQN (named_parameters order) and the module that registered it there
 * (an Embedding tied to a later output Linear: normal(0, 1)); PyTorch, which
 * initialises per module, leaves the last module's values instead.
 */
TP_API tp_status tp_module_init(tp_module *m, uint64_t seed);

/* Loads full (unsharded) values: for each FQN in names, this rank's shard of
 * values[i] (global shape) goes into the parameter, whatever its layout. Names
 * that match no parameter and parameters not named are TP_ERR_INVALID_ARG
 * (listing them) unless `strict` is false. A tied parameter has every one of
 * its names (strict wants them all) and receives each value in turn: the
 * last one named wins, as in PyTorch. No communication. */
TP_API tp_status tp_module_load_state_dict(tp_module *m, int n, const char *const *names,
                                           tp_tensor *const *values, bool strict);
/* Collective: calls fn(fqn, full_value, ctx) for every parameter with its full
 * (gathered) value, a plain tensor; a tied parameter once per name, as
 * PyTorch's state_dict() lists it. */
TP_API tp_status tp_module_state_dict(tp_module *m,
                                      tp_status (*fn)(const char *fqn, tp_tensor *full,
                                                      void *ctx),
                                      void *ctx);

/* ---- replication ----------------------------------------------------------- */

/*
 * The device of a module: where its parameters live, or for a replica the
 * device it was replicated to (a module without parameters reports that).
 * CUDA: the device of the first parameter of the subtree (depth first).
 * CPU: a LOGICAL device {TP_DEVICE_CPU, k}, one per shm rank (all of them
 * host memory; CPU tensors themselves always report index 0): k is 0 for
 * every module the library creates and the replica's index for the modules
 * of a replica made by tp_module_replicate. NULL: {TP_DEVICE_CPU, -1}.
 */
TP_API tp_device tp_module_device(const tp_module *m);

/*
 * torch.nn.parallel.replicate: replicas[i] becomes a new root module, a copy
 * of `module` for devices[i] (n >= 1 entries). Each replica is a full tree of
 * new modules with the same kinds, type and child names (so the same FQNs),
 * configuration (Dropout's seed and call count included), training flag,
 * forward functions and hooks; it computes what `module` computes, given the
 * same inputs on its device. The caller frees each replica with
 * tp_module_free, in any order relative to `module`.
 *
 * Parameters. A replica on the module's own device (tp_module_device:
 * logical CPU device k, or CUDA device i holding the parameters) SHARES
 * storage with the original: each of its parameters is a new tensor viewing
 * the original's storage (same data pointer; the storage is refcounted, so it
 * outlives whichever is freed first), and in-place updates of the original
 * (tp_sgd_step, tp_adam_step, tp_module_load_state_dict) are seen by the
 * replica, and the other way round. A replica on any other device gets DEEP
 * COPIES (tp_tensor_to, the copy path of tp_module_to), unaffected by later
 * updates. A tensor registered in several places of the tree (tied weights)
 * stays one tensor in each replica, and handles over one storage region (one
 * parameter for the optimizers, below) stay handles over one storage, as
 * with tp_module_to. Replica parameters are leaves of their
 * own: they require grad when the original's do, start without a gradient,
 * and a backward through a replica accumulates into the replica's
 * parameters, never into the original's (PyTorch's replicas are non-leaf
 * views whose gradients flow back to the original; here reducing replica
 * gradients is the data-parallel wrapper's job). libtp modules have no
 * buffers: parameters are the whole state.
 *
 * Shared, not copied: custom modules' ctx and hooks' ctx are the original's
 * pointers, and each ctx_free runs once, when the original and every replica
 * holding it are freed (in any order). A custom forward must reach its
 * children and parameters through `self`, not through module pointers kept in
 * ctx, or a replica would run the original's modules.
 *
 * Devices: TP_CUDA(i) (a CUDA build and a device: TP_ERR_NOT_SUPPORTED
 * otherwise, as for tensors; i past the device count: TP_ERR_INVALID_ARG) or
 * a logical CPU device {TP_DEVICE_CPU, k}, k >= 0, whose parameters are host
 * tensors; a list may mix both and repeat a device. Replicating a CPU module
 * to a CUDA device deep-copies, and the other way round.
 *
 * Errors: NULL module, devices or replicas, n <= 0, a negative index or an
 * unknown device type, and a module that is some module's child are
 * TP_ERR_INVALID_ARG; a module with DTensor parameters (already
 * tensor-parallel: replicate before tp_parallelize_module) is
 * TP_ERR_NOT_SUPPORTED. All or nothing: on any failure every replicas[i] is
 * NULL and nothing stays allocated. Not collective; call it from one thread
 * and hand replicas[r] to rank r.
 */
TP_API tp_status tp_module_replicate(tp_module *module, const tp_device *devices, int n,
                                     tp_module **replicas);

/* ---- optimizers ------------------------------------------------------------ */

/*
 * The optimizers see each parameter once. A tensor registered under several
 * names (tied weights) is one parameter: its gradient already sums every use,
 * it is updated once per step and has one Adam state. Distinct handles over
 * the same storage region (same storage, offset, shape, strides and dtype,
 * and for DTensors the same mesh, placements and global shape: a second
 * tp_tensor_view of a weight, say) are one parameter too: each handle
 * accumulates its own gradient, and the step applies their sum once, so the
 * result equals the model written with one parameter (for SGD that is also
 * what PyTorch gives, stepping each; for Adam PyTorch would keep two states).
 * Handles over overlapping but different regions are different parameters.
 */

/*
 * Precision. Updates compute in f32 (the kernels in double, rounded to f32
 * once), whatever the parameters' dtype: f32, bf16 or f16 (others are
 * TP_ERR_NOT_SUPPORTED naming the parameter). Gradients are read in f32.
 * A bf16/f16 parameter is written rounded once per step (to nearest even).
 * tp_adam and tp_sgd keep an f32 master copy of each bf16/f16 parameter's
 * local block (created from the parameter at its first step, on its
 * device, with Adam's f32 m and v), step the master and write the
 * parameter from it, so updates smaller than half an ulp of the parameter
 * accumulate; the stateless tp_sgd_step has no master and loses them. Once
 * a master exists it is the optimizer's truth: a value written into the
 * parameter by other means (a state-dict load) is overwritten at the next
 * step; create the optimizer after loading.
 */

/* p -= lr * grad for every parameter with a gradient (a Partial gradient is
 * reduced to the parameter's layout first: collective). Stateless: a
 * bf16/f16 parameter is updated in f32 and rounded once, without master
 * weights (see tp_sgd). */
TP_API tp_status tp_sgd_step(tp_module *m, double lr);

/* SGD with state: the same update as tp_sgd_step, plus f32 master weights
 * for bf16/f16 parameters (a stateless function cannot keep them, hence an
 * object). Owner: the caller (tp_sgd_create, tp_sgd_create_with,
 * tp_sgd_free). It borrows the module, which must outlive it, and holds a
 * reference on every low-precision parameter it keeps a master for (with
 * momentum: every parameter, for its f32 momentum buffer), and the master. A
 * parameter replaced after its first step (tp_module_to_dtype, a parallel
 * style) is TP_ERR_STATE at the next step. */
typedef struct tp_sgd tp_sgd;
/* lr: finite and >= 0 (no default: 0 is a valid rate, as in tp_sgd_step). */
TP_API tp_status tp_sgd_create(tp_module *m, double lr, tp_sgd **out);

/* torch.optim.SGD's options (zero-initialise, then set what differs; all
 * zero is plain SGD at lr 0). Per parameter and step, with g its gradient:
 *   d = g + weight_decay * p                      (L2 weight decay)
 *   buf = d (first step), else momentum * buf + (1 - dampening) * d
 *   d = nesterov ? d + momentum * buf : buf       (when momentum != 0)
 *   p -= lr * d
 * The momentum buffer is f32, one per parameter (its local block), made at
 * its first step with a gradient; the products and sums are f32 with a
 * rounding each, as torch's single-tensor (foreach=False) loop. */
typedef struct tp_sgd_options {
    double lr;           /* finite, >= 0 */
    double momentum;     /* finite, >= 0 */
    double dampening;    /* finite */
    double weight_decay; /* finite, >= 0 */
    bool nesterov;       /* requires momentum > 0 and dampening == 0 */
} tp_sgd_options;
/* opts NULL: all zero. A bad option is TP_ERR_INVALID_ARG naming it; *out is
 * NULL on any error. */
TP_API tp_status tp_sgd_create_with(tp_module *m, const tp_sgd_options *opts, tp_sgd **out);
/* One step over the module's parameters (step pre-hooks first, as
 * tp_sgd_step). */
TP_API tp_status tp_sgd_opt_step(tp_sgd *opt);
/* The rate of the next steps (a schedule sets it before each step):
 * finite and >= 0, else TP_ERR_INVALID_ARG (the rate is kept). */
TP_API tp_status tp_sgd_set_lr(tp_sgd *opt, double lr);
/* The current rate; NaN for NULL. */
TP_API double tp_sgd_lr(const tp_sgd *opt);
/* NULL is a no-op. */
TP_API void tp_sgd_free(tp_sgd *opt);

/* Owner: the caller (tp_adam_create, tp_adam_free). It borrows the module,
 * which must outlive it, and holds a reference on every parameter it keeps
 * state for, and its moment tensors (f32) and masters (f32, bf16/f16
 * parameters only). */
typedef struct tp_adam tp_adam;
/* Adam (PyTorch defaults when zero: lr 1e-3, betas 0.9/0.999, eps 1e-8). */
TP_API tp_status tp_adam_create(tp_module *m, double lr, double beta1, double beta2, double eps,
                                tp_adam **out);

/* torch.optim.Adam / AdamW options (zero-initialise; zero lr, beta1, beta2
 * and eps take the defaults above; weight_decay 0 is none, note that
 * torch.optim.AdamW's default is 0.01). With weight decay wd:
 *   decoupled (AdamW): p *= 1 - lr * wd, then the Adam update with g;
 *   otherwise (Adam):  the Adam update with g + wd * p.
 * Both as torch's single-tensor loop (foreach=False, amsgrad=False). */
typedef struct tp_adam_options {
    double lr;           /* finite, >= 0 */
    double beta1, beta2; /* in [0, 1) */
    double eps;          /* finite, >= 0 */
    double weight_decay; /* finite, >= 0 */
    bool decoupled;      /* true: AdamW */
} tp_adam_options;
/* opts NULL: all zero. A bad option is TP_ERR_INVALID_ARG naming it; *out is
 * NULL on any error. */
TP_API tp_status tp_adam_create_with(tp_module *m, const tp_adam_options *opts, tp_adam **out);
TP_API tp_status tp_adam_step(tp_adam *opt);
/* As tp_sgd_set_lr / tp_sgd_lr. The bias corrections count each
 * parameter's own steps, whatever the rate. */
TP_API tp_status tp_adam_set_lr(tp_adam *opt, double lr);
TP_API double tp_adam_lr(const tp_adam *opt);
TP_API void tp_adam_free(tp_adam *opt);

/*
 * Gradient clipping, as torch.nn.utils.clip_grad_norm_(parameters,
 * max_norm, norm_type): the total norm of every parameter's gradient taken
 * together (norm_type 2: the square root of the sum of squares; INFINITY:
 * the largest |g|), then, when clip_coef = max_norm / (total + 1e-6) is
 * below 1, every gradient multiplied by it in place, in its own dtype. A
 * NaN or inf total scales by NaN or 0, as torch's default
 * (error_if_nonfinite=False). *total_norm (may be NULL) gets the total
 * norm, NaN on error.
 *
 * Each parameter counts once (tied handles: their summed gradient). The
 * step pre-hooks run first (a DDP's all_reduces; the optimizer's step
 * runs them again, a no-op then). DTensor gradients are reduced where they
 * live (f32 local sums of squares, combined in double); the norm is the
 * unsharded model's: collective on every rank of each mesh, which must all
 * call it with the same parameters holding gradients. Collectives, per
 * mesh: one all_reduce (of 2^ndim doubles) per mesh dim of size > 1 on
 * which some parameter with a gradient is Shard; none for Replicate-only
 * and plain parameters. A Partial gradient is first reduced to its
 * parameter's placements for the norm (as the optimizers do: one
 * redistribute each, its collectives in addition); its local terms are
 * scaled as they are.
 *
 * Errors: m NULL, max_norm negative or NaN, norm_type neither 2 nor
 * INFINITY: TP_ERR_INVALID_ARG (nothing is scaled).
 */
TP_API tp_status tp_clip_grad_norm(tp_module *m, double max_norm, double norm_type,
                                   double *total_norm);

/*
 * The learning rate of step `step` (0-based) of a linear warm-up then a
 * cosine decay (the common warm-up + cosine lambda; transformers'
 * get_cosine_with_min_lr_schedule_with_warmup):
 *   step < warmup:          base_lr * step / warmup
 *   warmup <= step < total: min_lr + (base_lr - min_lr) (1 + cos(pi (step -
 *                           warmup) / (total - warmup))) / 2
 *   step >= total:          min_lr
 * The decay is torch's CosineAnnealingLR closed form (eta_min = min_lr,
 * T_max = total - warmup), held at min_lr after total. Set it with
 * tp_sgd_set_lr / tp_adam_set_lr before each step. Errors
 * (TP_ERR_INVALID_ARG, *lr NaN): lr NULL, step < 0, warmup not in [0,
 * total], base_lr not finite or < 0, min_lr not in [0, base_lr].
 */
TP_API tp_status tp_lr_warmup_cosine(int64_t step, int64_t warmup, int64_t total, double base_lr,
                                     double min_lr, double *lr);

/* ---- loss scaling (torch.amp.GradScaler) ---------------------------------------- */

/*
 * f16 gradients underflow: small ones round to zero. A grad scaler
 * multiplies the loss by a scale S before backward, so that gradients are S
 * times larger in f16, and the optimizer step divides them by S again, in
 * f32, as it reads them (the unscaling is fused into the step, like
 * PyTorch's fused optimizers: a low-precision gradient is never stored
 * unscaled, so the gradients keep their scaled values in their storage).
 * When a gradient holds an inf or a NaN (S too large: f16 overflowed), the
 * step is skipped on every rank and S backs off; after growth_interval
 * steps in a row without one, S grows:
 *
 *   tp_grad_scaler *gs;
 *   tp_grad_scaler_create(world_comm, NULL, &gs);   // NULL comm: one process
 *   for (...) {
 *       ... loss ...;
 *       tp_grad_scaler_scale(gs, loss, &scaled); tp_backward(scaled, NULL);
 *       tp_grad_scaler_step_adam(gs, adam, &stepped);  // or _step_sgd (tp_sgd)
 *       tp_grad_scaler_update(gs);
 *       tp_module_zero_grad(model);
 *   }
 *
 * The inf/NaN check is collective over the scaler's comm: one all_reduce
 * (max) of a one-element f32 flag per step, so that every rank skips the
 * same steps. Give it a comm that spans every rank holding gradients of the
 * model (the world of a data x tensor parallel run); NULL for one process.
 * With an f16 loss the default initial scale 2^16 overflows f16 (largest
 * 65504) as soon as the loss is about 1 or more: that step is skipped and
 * the scale backs off to 2^15, as PyTorch does on any overflow; an
 * init_scale of 2^10 or so avoids the skipped steps.
 *
 * Owner: the caller (tp_grad_scaler_create, tp_grad_scaler_free). It holds
 * a reference on its comm. One thread uses a scaler (one per rank).
 */
typedef struct tp_grad_scaler tp_grad_scaler;

/* Zero fields take PyTorch's defaults. */
typedef struct tp_grad_scaler_options {
    double init_scale;     /* 0: 65536 (2^16); else finite and > 0 */
    double growth_factor;  /* 0: 2.0; else finite and > 1 */
    double backoff_factor; /* 0: 0.5; else in (0, 1) */
    int growth_interval;   /* 0: 2000; else > 0 */
} tp_grad_scaler_options;

/* comm may be NULL (no agreement between processes); opts NULL: defaults. */
TP_API tp_status tp_grad_scaler_create(tp_comm *comm, const tp_grad_scaler_options *opts,
                                       tp_grad_scaler **out);
/* NULL is a no-op. */
TP_API void tp_grad_scaler_free(tp_grad_scaler *gs);
/* *out = loss * scale (tp_scale: recorded for backward; a new reference). */
TP_API tp_status tp_grad_scaler_scale(tp_grad_scaler *gs, tp_tensor *loss, tp_tensor **out);
/*
 * torch's unscale_: the inf/NaN check of this step. Runs m's step
 * pre-hooks first (a DDP's gradient all_reduces finish there), then checks
 * every gradient of m's parameters (each handle's local values) and
 * all_reduces (max) the found flag over the comm: collective, one
 * all_reduce. *found_inf (may be NULL) receives the agreed flag. Once per
 * step: a second call before tp_grad_scaler_update is TP_ERR_STATE. The
 * gradients are not changed (the step unscales as it reads them).
 */
TP_API tp_status tp_grad_scaler_unscale(tp_grad_scaler *gs, tp_module *m, bool *found_inf);
/* The optimizer step through the scaler: unscales (the check above, on the
 * optimizer's module) unless done this step; when an inf/NaN was found
 * the step is skipped (*stepped false, no parameter or state changes),
 * else the optimizer steps with every gradient divided by the scale (in f32)
 * and *stepped is true. stepped may be NULL. */
TP_API tp_status tp_grad_scaler_step_adam(tp_grad_scaler *gs, tp_adam *opt, bool *stepped);
TP_API tp_status tp_grad_scaler_step_sgd(tp_grad_scaler *gs, tp_sgd *opt, bool *stepped);
/* Ends the step: an inf/NaN found: scale *= backoff_factor and the count of
 * good steps restarts; else that count grows, and when it reaches
 * growth_interval, scale *= growth_factor and it restarts. TP_ERR_STATE
 * when no check ran since the last update (no unscale or step through the
 * scaler). Not collective (the flag was agreed already). */
TP_API tp_status tp_grad_scaler_update(tp_grad_scaler *gs);
/* The current scale (0 for NULL). */
TP_API double tp_grad_scaler_get_scale(const tp_grad_scaler *gs);
/* Good steps since the last growth or backoff (-1 for NULL). */
TP_API int tp_grad_scaler_growth_tracker(const tp_grad_scaler *gs);

#ifdef __cplusplus
}
#endif

#endif /* TP_NN_H */
