/*
 * tp/dp.h - data parallelism: a module's gradients averaged over a process
 * group (torch DistributedDataParallel), with gradient buckets whose
 * all_reduce is launched during backward and waited for before the optimizer
 * step, and the passes that build that schedule.
 *
 *   tp_ddp *ddp;
 *   tp_ddp_create(model, dp_comm, NULL, &ddp);   // collective over dp_comm
 *   for (...) {
 *       tp_module_call(model, x, &y);          // x: this rank's part of the batch
 *       ... loss ...; tp_backward(loss, NULL); // buckets all_reduce as they fill
 *       tp_sgd_step(model, lr);                // waits for them first
 *       tp_module_zero_grad(model);
 *   }
 *   tp_ddp_free(ddp);
 *
 * The comm may be any backend (shm, mpi, nccl, a user's): a world, a mesh
 * dim (tp_mesh_comm(mesh, tp_mesh_dim_index(mesh, "dp"))) for data parallel
 * x tensor parallel, or a split. Parameters may be DTensors (a
 * tensor-parallel module): their local shards are averaged over the comm.
 *
 * The step graph. A DDP executes a schedule of nodes over one training step:
 * "ready p" (p's gradient is final: a gradient hook fired), "copy in b"
 * (gradients into bucket b's buffer), "all_reduce b" (launched
 * asynchronously), "wait b", "copy out b" (averaged values back into the
 * gradients), and "step" (the optimizer step: tp_sgd_step / tp_adam_step or
 * tp_ddp_sync run the schedule up to there). Parameters are listed in the
 * order their gradients became ready in the first backward (before it, the
 * reverse of registration order, the usual backward order). Passes rewrite
 * the schedule:
 *
 *   bucket_fusion    parameters grouped, in ready order, into buckets of at
 *                    most bucket_cap_bytes (one parameter alone may exceed
 *                    it): concatenate -> one all_reduce -> split back
 *   late_waits       every wait (and copy out) moved just before the step, so
 *                    the collectives overlap the rest of backward; must be
 *                    applied after bucket_fusion
 *   remove_copies    gradients become views into their bucket (tp_tensor_set_grad):
 *                    backward writes straight into the buffer, no copy in or
 *                    out; needs bucket_fusion
 *
 * Without passes (tp_ddp_options.manual_passes), the schedule is plain data
 * parallelism: every gradient all_reduced on its own, in place, and waited
 * for at once. By default the three passes are applied (remove_copies only
 * with gradient_as_bucket_view), which is PyTorch DDP's behaviour.
 *
 * Gradients read before the step. With late waits, a bucket's all_reduce is
 * in flight from its launch (during backward) until the step. Reading one
 * of its parameters' gradients meanwhile (tp_tensor_grad), replacing it
 * (tp_tensor_set_grad), dropping it (tp_tensor_zero_grad,
 * tp_module_zero_grad) or adding a second backward into it first waits for
 * that bucket and copies its average out: what is read is the averaged
 * gradient, and the other buckets stay in flight until the step. Gradients
 * dropped that way stay dropped: the step applies nothing to them. A bucket
 * not launched yet (its parameters did not all get a gradient in this
 * backward) is launched at the step, and its gradients read before that are
 * this rank's own. If the wait fails, tp_tensor_grad returns NULL with
 * tp_last_error() naming the failure, and the DDP is failed (sticky, as for
 * any failed step).
 */
#ifndef TP_DP_H
#define TP_DP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include "tp/comm.h"
#include "tp/nn.h"
#include "tp/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- step graphs and passes ------------------------------------------------ */

/* Owner: the caller for a graph from tp_step_graph_create
 * (tp_step_graph_free); a DDP's graph (tp_ddp_graph) is the DDP's, borrowed
 * until tp_ddp_free, and tp_step_graph_free on it is a no-op. */
typedef struct tp_step_graph tp_step_graph;
/* A pass is the caller's (usually a static const object), borrowed by every
 * graph it was applied to: it must outlive them. */
typedef struct tp_pass tp_pass;

/*
 * A pass: a named rewrite of a step graph. `prerequisites` (NULL-terminated,
 * may be NULL) must all have been applied to the graph before this one;
 * `apply_after` (NULL-terminated, may be NULL) are passes this one must come
 * after: once this pass was applied, applying one of them is an error (it
 * would undo or invalidate this one). Passes may be applied again.
 */
struct tp_pass {
    const char *name;
    const tp_pass *const *prerequisites;
    const tp_pass *const *apply_after;
    tp_status (*run)(tp_step_graph *g, void *ctx);
    void *ctx;
};

/* Applies a pass: TP_ERR_STATE with "[a, b] are the prerequisites of <pass>"
 * when prerequisites are missing, or "<other> must be applied after <pass>"
 * when an applied pass lists this one in its apply_after; the graph is then
 * unchanged. Otherwise runs it and records it as applied. On a DDP's graph,
 * only between steps (TP_ERR_STATE during one); the new schedule is used from
 * the next step on. */
TP_API tp_status tp_pass_apply(const tp_pass *pass, tp_step_graph *g);

/* The built-in passes (see the top of this file). */
TP_API const tp_pass *tp_pass_bucket_fusion(void);
TP_API const tp_pass *tp_pass_late_waits(void);
TP_API const tp_pass *tp_pass_remove_copies(void);

/* A graph of n parameters of the given sizes (elements) and one dtype, not
 * attached to any module: for inspecting passes, and for user-written passes
 * and their ordering. bucket_cap_bytes 0 means the default (25 MiB). Sizes
 * must be >= 0 and their byte counts (numel * dtype size), each and summed
 * over the parameters, at most INT64_MAX (and SIZE_MAX): otherwise
 * TP_ERR_INVALID_ARG naming the parameter ("parameter i (param<i>): ..."). */
TP_API tp_status tp_step_graph_create(int n, const int64_t *numel, tp_dtype dtype,
                                      size_t bucket_cap_bytes, tp_step_graph **out);
TP_API void tp_step_graph_free(tp_step_graph *g);

/* Inspection. */
TP_API int tp_step_graph_num_params(const tp_step_graph *g);
TP_API int tp_step_graph_num_buckets(const tp_step_graph *g);
/* The bucket of parameter i (registration index), -1 if out of range. */
TP_API int tp_step_graph_bucket_of(const tp_step_graph *g, int param);
/* Number of passes applied so far and the name of the i-th. */
TP_API int tp_step_graph_num_applied(const tp_step_graph *g);
TP_API const char *tp_step_graph_applied(const tp_step_graph *g, int i);
/* The schedule, one node per line ("ready net1.weight", "all_reduce b0",
 * ...). */
TP_API tp_status tp_step_graph_write(const tp_step_graph *g, FILE *f);

/* ---- data-parallel wrapper ------------------------------------------------- */

/* Owner: the caller (tp_ddp_create, tp_ddp_free). It holds a reference on
 * its comm and on every parameter it wraps, owns its step graph and bucket
 * buffers, and borrows the module: the hooks it adds to the module hold a
 * small shared handle that outlives the DDP and goes quiet when it is freed,
 * so module, comm and DDP may be freed in any order. */
typedef struct tp_ddp tp_ddp;

typedef struct tp_ddp_options {
    /* bucket size cap in bytes; 0: 25 MiB */
    size_t bucket_cap_bytes;
    /* gradients are views into the buckets (the remove_copies pass) */
    bool gradient_as_bucket_view;
    /* true: every rank already holds the same parameters, nothing is sent;
     * false (default): rank 0's are broadcast to the others at wrap */
    bool params_everywhere;
    /* true: apply no pass; the caller applies them to tp_ddp_graph() */
    bool manual_passes;
    /* at most this many bucket all_reduces in flight (0: no limit): before
     * launching one more, the oldest is waited for. Backends that progress
     * only inside calls and slow down with many requests outstanding (MPI on
     * shared memory) do better with 1; NCCL progresses on its own. */
    int max_in_flight;
    /* reduce_dtype (torch MixedPrecision.reduce_dtype), used when
     * has_reduce_dtype is true (TP_F32 is 0, so the flag says "set"; a zeroed
     * options struct reduces in the gradients' own dtype, as before): every
     * float gradient of another dtype is converted to reduce_dtype (f32,
     * bf16 or f16; others are TP_ERR_INVALID_ARG) into its bucket, averaged
     * there, and converted back (rounded once) when the bucket settles.
     * Buckets hold reduce_dtype, and bucket_cap_bytes counts its bytes: a
     * bf16 model reduced in f32 has the buckets, and the all_reduce count, of
     * the same model in f32. Such gradients cannot be views into their
     * bucket: with gradient_as_bucket_view (the remove_copies pass) it is
     * TP_ERR_NOT_SUPPORTED. */
    bool has_reduce_dtype;
    tp_dtype reduce_dtype;
} tp_ddp_options;

/*
 * Collective over comm: wraps `module` (the module stays the caller's; the
 * DDP adds hooks to it and its parameters). The DDP holds a reference on
 * comm, so module, comm and DDP may be freed in any order (the module's hooks
 * go quiet once the DDP is freed). Every parameter that requires grad takes
 * part; all must be on one device type the comm's backend moves. opts NULL:
 * defaults. A tensor registered under several names (tied weights) is one
 * parameter: one gradient hook, one slot in one bucket, all_reduced once per
 * step. Distinct handles over one storage region (one parameter for the
 * optimizers, tp/nn.h) each hold their own gradient and are reduced
 * separately; the step sums them.
 */
TP_API tp_status tp_ddp_create(tp_module *module, tp_comm *comm, const tp_ddp_options *opts,
                               tp_ddp **out);
/* Removes the hooks and frees the buffers, after waiting for (and discarding)
 * a step in progress. NULL is a no-op. */
TP_API void tp_ddp_free(tp_ddp *ddp);

/* Runs the schedule up to the step: launches what is left, waits for every
 * bucket and leaves the averaged gradients in the parameters. Parameters
 * that got no gradient this step contribute zeros (and receive the average).
 * The optimizers call it through a step pre-hook; reading a gradient waits
 * for its own bucket (see above), and tp_ddp_sync for all of them, as the
 * step does. Idempotent between steps. */
TP_API tp_status tp_ddp_sync(tp_ddp *ddp);

/* The DDP's step graph, for tp_pass_apply and inspection (borrowed). */
TP_API tp_step_graph *tp_ddp_graph(tp_ddp *ddp);
TP_API tp_comm *tp_ddp_comm(const tp_ddp *ddp);
TP_API tp_module *tp_ddp_module(const tp_ddp *ddp);

/* ---- fully sharded data parallel --------------------------------------------
 *
 * FSDP2's fully_shard on libtp's DTensors. Each parameter of a unit (a
 * module and its subtree, less the units inside it) is kept sharded on dim 0
 * over the mesh's "dp" dim: the parameter the module, the optimizers, the
 * gradient clipping and the checkpoints see is a DTensor holding this rank's
 * rows of it. Around the unit's forward its parameters are gathered:
 *
 *   for each block: tp_fully_shard(block, mesh, &opts);
 *   tp_fully_shard(model, mesh, &opts);          // the root: the rest
 *   tp_adam_create(model, ...);                   // after sharding: it steps the shards
 *   for (...) { forward; loss; tp_backward; tp_adam_step; tp_module_zero_grad }
 *
 * - Before a unit's forward: one all_gather over dp of its parameters (one
 *   flat buffer per unit, in param_dtype), copied out into each parameter's
 *   unsharded tensor (the TP shard the module computes with), which the
 *   module holds while it runs.
 * - After it: the unsharded tensors' memory is freed (reshard after forward;
 *   not for the root, whose parameters backward needs first, nor with
 *   keep_after_forward), and gathered again when backward reaches the unit.
 * - In backward, once every unsharded parameter of the unit has its
 *   gradient: one reduce_scatter over dp (in reduce_dtype) averages them
 *   into the sharded parameters' gradients, and the unsharded memory is
 *   freed again.
 * - Prefetch: the unit that runs next (in forward order, learnt in the
 *   first step; in backward, the reverse) has its all_gather issued before
 *   the current unit computes.
 * - The optimizer step first finishes a reduce_scatter that is still due
 *   (parameters that got no gradient this step contribute zeros).
 *
 * Collectives of a step with reshard after forward, N units: forward N
 * all_gathers, backward N - 1 all_gathers and N reduce_scatters (PyTorch
 * 2.15's fully_shard issues the same for the same model and mesh).
 *
 * Meshes. `mesh` is a 1-D mesh (its one dim is dp; the parameters are plain
 * tensors), or a mesh with a "dp" dim and a "tp" dim (and for HSDP a
 * "dp_replicate" dim, below) whose "tp" dim is the mesh
 * the parameters' TP placements live on (tp_mesh_slice(mesh, 1, {"tp"}):
 * same size, same coordinate). A sharded parameter is a DTensor on the
 * (tp, dp) view of the mesh (tp_mesh_slice(mesh, 2, {"tp", "dp"})) with
 * placements [its TP placement, Shard(0)]: the nesting order (the TP shard
 * first, then its rows over dp) that PyTorch writes as _StridedShard(0) on
 * dp when both shard dim 0. Uneven dim 0: rank r holds rows
 * [r c, min((r + 1) c, n)) of the n rows of its TP shard, c = ceil(n / dp),
 * padded to c in the flat buffers, as FSDP2 pads. Parameters that do not
 * require grad are left as they are.
 *
 * HSDP (FSDP2's fully_shard on a 2-D (replicate, shard) mesh): a mesh dim
 * named "dp_replicate" beside "dp" (and "tp") holds replicas of the shards:
 * gathers run over dp only, and each unit's reduce_scattered gradients are
 * all_reduced (averaged) over dp_replicate, one all_reduce per unit in
 * backward. The sharded parameters then live on the (dp_replicate, tp, dp)
 * view with Replicate on dp_replicate. The batch splits over
 * dp_replicate x dp.
 */
typedef struct tp_fsdp_options {
    /* false (default): a unit's parameters are freed after its forward and
     * gathered again in backward, the root's excepted (FSDP2's default,
     * reshard_after_forward=None; its explicit True reshards the root too);
     * true: kept from the forward to the backward (one all_gather a step,
     * FSDP2's False) */
    bool keep_after_forward;
    /* true: no prefetching of the next unit's all_gather */
    bool no_prefetch;
    /* the dtype the parameters are gathered and computed in (FSDP2's
     * MixedPrecisionPolicy.param_dtype), when has_param_dtype: the shards
     * keep theirs (f32 masters of a bf16 computation) */
    bool has_param_dtype;
    tp_dtype param_dtype;
    /* the dtype gradients are reduce_scattered in (reduce_dtype), when
     * has_reduce_dtype; else param_dtype */
    bool has_reduce_dtype;
    tp_dtype reduce_dtype;
} tp_fsdp_options;

/*
 * Collective over mesh: makes `unit` a fully sharded unit (see above). Call
 * it on the inner units first (each transformer block), then on the root.
 * Every parameter of the unit's subtree that requires grad and is not in a
 * unit already is sharded; they must share one dtype and one device, be
 * plain (1-D mesh) or DTensors on the mesh's tp dim with Shard or Replicate
 * placements, and a parameter tied between two units is refused (shard the
 * module that holds both). TP_ERR_INVALID_ARG naming the parameter or the
 * mesh at fault (a mesh other than dp, (dp, tp), (dp_replicate, dp) or
 * (dp_replicate, dp, tp) in any order), TP_ERR_STATE for a module sharded already; nothing
 * changed then. Parameters replaced by the call: create optimizers after
 * it. The unit's state lives with the module (freed with it); the module
 * must outlive the graphs it records. opts NULL: defaults.
 */
TP_API tp_status tp_fully_shard(tp_module *unit, tp_mesh *mesh, const tp_fsdp_options *opts);
/* Whether m is a fully sharded unit. */
TP_API bool tp_module_is_fully_sharded(const tp_module *m);

#ifdef __cplusplus
}
#endif

#endif /* TP_DP_H */
