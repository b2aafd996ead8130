/*
 * tp/dtensor.h - distributed tensors, redistribution, autograd.
 *
 * A distributed tensor (DTensor) is a tp_tensor handle whose layout is a mesh
 * plus one placement per mesh dim: Shard(d) (split along tensor dim d,
 * torch.chunk rule: chunk = ceil(n / W), trailing ranks may hold fewer or zero
 * rows), Replicate (every rank holds all of it) or Partial(op) (every rank
 * holds a term; the value is their reduction). Several mesh dims may shard the
 * same tensor dim (mesh dim 0 splits first).
 *
 * For a DTensor, tp_tensor_ndim/shape/size/numel/dtype/device describe the
 * global (logical) tensor; its data lives in the local shard,
 * tp_dtensor_local(). Views and element access of core (narrow, get, copy,
 * data, ...) refuse DTensors: convert with tp_dtensor_to_local or
 * tp_dtensor_full_tensor first. A DTensor holds a reference on its mesh
 * (tp_mesh_retain), so the mesh may be freed first.
 *
 * Collective calls here are collective over the mesh: every rank of the mesh
 * calls them in the same order with the same layouts.
 *
 * Autograd: any tensor (plain or distributed) may require grad. Ops record a
 * tape; tp_backward walks it in reverse and accumulates gradients into
 * tp_tensor_grad() of the leaves. The backward of a redistribute is itself a
 * redistribute, recorded by the comm-debug counter in the backward phase.
 */
#ifndef TP_DTENSOR_H
#define TP_DTENSOR_H

#include <stdbool.h>
#include <stdint.h>

#include "tp/comm.h"
#include "tp/mesh.h"
#include "tp/status.h"
#include "tp/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum tp_placement_kind {
    TP_PLACEMENT_REPLICATE = 0,
    TP_PLACEMENT_SHARD,
    TP_PLACEMENT_PARTIAL
} tp_placement_kind;

/* A value type; the zero value is Replicate. */
typedef struct tp_placement {
    tp_placement_kind kind;
    int dim;         /* Shard: tensor dim, negative counts from the end */
    tp_reduce_op op; /* Partial: sum, avg, max or min */
} tp_placement;

static inline tp_placement tp_replicate(void)
{
    tp_placement p = {TP_PLACEMENT_REPLICATE, 0, TP_SUM};
    return p;
}
static inline tp_placement tp_shard(int dim)
{
    tp_placement p = {TP_PLACEMENT_SHARD, dim, TP_SUM};
    return p;
}
static inline tp_placement tp_partial(tp_reduce_op op)
{
    tp_placement p = {TP_PLACEMENT_PARTIAL, 0, op};
    return p;
}

/* "R", "S(1)", "P(sum)" into buf; returns buf. */
TP_API const char *tp_placement_str(tp_placement p, char *buf, size_t len);
/* "(S(0), R)" for a list; returns buf. */
TP_API const char *tp_placements_str(int n, const tp_placement *p, char *buf, size_t len);

/* ---- creating and converting --------------------------------------------- */

/*
 * Collective: the DTensor with `placements` (one per mesh dim) whose global
 * value is `full` (every rank passes a tensor of the same global shape and
 * dtype). The result is a leaf (requires_grad false) that owns its shard
 * (never `full`'s storage). Partial placements are refused.
 *
 * src_rank >= 0: the value of mesh rank src_rank is used (the others' values
 * are ignored). It travels mesh dim by mesh dim (dim 0 first) over the
 * per-dim communicators, from the rank whose coordinate on that dim is
 * src's: a Shard dim is a scatter (each rank receives only its chunk,
 * torch.chunk rule, padded to the chunk size for the collective), a
 * Replicate dim a broadcast. Step i involves the ranks whose coordinates
 * equal src's on every dim after i (they hold their block by then); each of
 * them issues one collective for it, so src issues one per mesh dim (also on
 * a dim of size 1) and a rank whose last differing coordinate is on dim h
 * issues one per dim from h on. On a 1-D mesh: one scatter (Shard) or one
 * broadcast (Replicate) on every rank.
 *
 * src_rank < 0: every rank already holds the same value; each takes its own
 * block and nothing is sent.
 */
TP_API tp_status tp_dtensor_distribute(tp_mesh *mesh, const tp_tensor *full, int nplacements,
                                       const tp_placement *placements, int src_rank,
                                       tp_tensor **out);

typedef struct tp_from_local_options {
    /* global shape (ndim of local), or NULL: inferred as if every shard were
     * as large as this rank's (even sharding, as PyTorch's from_local does).
     * Uneven shards (a dim the ranks do not divide) need it: inferred from
     * uneven shards, the ranks' global shapes differ, and the first
     * collective over that dim returns TP_ERR_MISMATCH on every rank, naming
     * the fix (the shm backend compares every collective; other backends do
     * with tp_comm_set_check / TP_COMM_CHECK=1, else such a collective
     * times out like any mismatched one) */
    const int64_t *global_shape;
    /* verify with collectives that Replicate mesh dims hold equal values and
     * the shard sizes add up (TP_ERR_MISMATCH otherwise); default off */
    bool check;
} tp_from_local_options;

/* The DTensor whose local shard on this rank is `local` (shared, not
 * copied). No communication unless options->check. Differentiable: the
 * gradient flows back to `local` as this rank's shard of the DTensor's
 * gradient. options may be NULL. */
TP_API tp_status tp_dtensor_from_local(tp_mesh *mesh, tp_tensor *local, int nplacements,
                                       const tp_placement *placements,
                                       const tp_from_local_options *options, tp_tensor **out);

/* This rank's shard as a plain tensor (shares storage). Differentiable: the
 * gradient of the result is taken to have `grad_placements` (ngrad = mesh
 * ndim; NULL with ngrad 0: the DTensor's own placements) when it flows back. */
TP_API tp_status tp_dtensor_to_local(tp_tensor *dt, int ngrad,
                                     const tp_placement *grad_placements, tp_tensor **out);

/* Collective: the whole global tensor on every rank, as a plain tensor
 * (redistributes to all-Replicate; differentiable). */
TP_API tp_status tp_dtensor_full_tensor(tp_tensor *dt, tp_tensor **out);

/* Collective: the same global value with new placements. Differentiable.
 *
 * Of the conversions to Partial only Shard -> Partial(sum) is public (as in
 * PyTorch 2.15): it costs no collective; this rank's local tensor becomes the
 * full extent along the shard dim (of the level that mesh dim splits, with
 * nested sharding) holding its shard in place and zeros elsewhere, so the
 * terms sum to the value. Its backward chunks a Replicate gradient locally.
 * Replicate -> Partial is TP_ERR_INVALID_ARG ("for internal use"); Shard ->
 * Partial(avg/max/min) and Partial(a) -> Partial(b), a != b, are
 * TP_ERR_NOT_SUPPORTED. */
TP_API tp_status tp_dtensor_redistribute(tp_tensor *dt, int nplacements,
                                         const tp_placement *placements, tp_tensor **out);

/* The collectives redistributing src -> dst issues on this mesh, per kind
 * (counts[TP_COLL_KIND_COUNT]); the same planner tp_dtensor_redistribute
 * runs, so tests and cost models can compare against it (Shard ->
 * Partial(sum) counts none). ndim is the tensor's, in [0, TP_MAX_DIMS].
 * Errors as for tp_dtensor_redistribute, except that Replicate -> Partial
 * (internal) is planned too. */
TP_API tp_status tp_dtensor_plan_collectives(const tp_mesh *mesh, int ndim, int nplacements,
                                             const tp_placement *src, const tp_placement *dst,
                                             int64_t *counts);

/* ---- properties ---------------------------------------------------------- */

TP_API bool tp_tensor_is_dtensor(const tp_tensor *t);
/* The mesh, the placements (mesh ndim entries, normalized: Shard dims are
 * non-negative) and the local shard (borrowed, lives as long as dt); NULL for
 * a plain tensor. */
TP_API tp_mesh *tp_dtensor_mesh(const tp_tensor *dt);
TP_API const tp_placement *tp_dtensor_placements(const tp_tensor *dt);
TP_API tp_tensor *tp_dtensor_local(const tp_tensor *dt);

/* Size and offset along tensor dim d of the shard that mesh coordinate `coord`
 * holds (coord: mesh ndim entries; NULL = this rank's), for a global shape
 * and placements. Pure arithmetic; used by tests and sharded initialisation. */
TP_API tp_status tp_dtensor_shard_extent(const tp_mesh *mesh, int ndim,
                                         const int64_t *global_shape, int nplacements,
                                         const tp_placement *placements, const int64_t *coord,
                                         int64_t *local_shape, int64_t *offset);

/* ---- autograd ------------------------------------------------------------ */

/* Marks a leaf tensor (plain or DTensor) as requiring grad. TP_ERR_STATE for
 * a non-leaf, TP_ERR_INVALID_ARG for a non-float dtype. */
TP_API tp_status tp_tensor_set_requires_grad(tp_tensor *t, bool requires_grad);
TP_API bool tp_tensor_requires_grad(const tp_tensor *t);
/* The accumulated gradient (borrowed; same layout as t for DTensors), or NULL
 * if none was computed yet.
 *
 * A gradient whose final value is still in flight (a parameter of a data
 * parallel module, tp/dp.h, between backward and the step: its bucket's
 * all_reduce was launched and is waited for late) is finished first: the
 * call waits for that bucket's all_reduce (and copies the average into the
 * gradient), so the value returned is the averaged gradient, never a
 * half-reduced or local one; the other buckets stay in flight. If that wait
 * fails, the result is NULL with tp_last_error() naming the failure (clear
 * it first to tell this from "no gradient"), and the data-parallel wrapper
 * is failed for good: every later read returns NULL the same way, and
 * tp_ddp_sync and the optimizer steps return TP_ERR_STATE, until
 * tp_ddp_free. */
TP_API tp_tensor *tp_tensor_grad(const tp_tensor *t);
/* Drops the accumulated gradient. A gradient in flight (see tp_tensor_grad)
 * is waited for first, so nothing writes into it afterwards, then dropped:
 * the step that follows applies nothing to t. If the wait fails, the
 * gradient is dropped anyway and the failure stays with the data-parallel
 * wrapper. */
TP_API void tp_tensor_zero_grad(tp_tensor *t);
/*
 * Installs g as t's gradient (t must require grad; a reference to g is
 * taken; NULL drops the gradient like tp_tensor_zero_grad). g has t's shape,
 * dtype and device; for a DTensor t, g is a DTensor on t's mesh (any
 * placements). Later backward passes add into g in place, as they do into a
 * gradient libtp allocated, so g may be a view into a larger buffer (a
 * communication bucket) that then receives the gradient without a copy. If a
 * contribution cannot be added in place (g not contiguous), the sum is a new
 * tensor and g is no longer t's gradient. A gradient in flight (see
 * tp_tensor_grad) is waited for first; if that fails, so does this call,
 * with t unchanged.
 */
TP_API tp_status tp_tensor_set_grad(tp_tensor *t, tp_tensor *g);

/* Post-accumulate gradient hook: called on backward's thread once per
 * tp_backward for every leaf that received a gradient, as soon as the last
 * contribution of that backward was added into tp_tensor_grad(t). Inside a
 * no-grad scope. A status other than TP_OK stops the backward, which returns
 * it. */
typedef tp_status (*tp_grad_hook_fn)(tp_tensor *t, void *ctx);
/* Registers a hook on a tensor that requires grad (leaves only: a hook on a
 * non-leaf is TP_ERR_STATE). Hooks run in registration order. *handle (may be
 * NULL) receives an id for tp_tensor_remove_grad_hook. */
TP_API tp_status tp_tensor_add_grad_hook(tp_tensor *t, tp_grad_hook_fn fn, void *ctx,
                                         int *handle);
/* Removes a hook; an unknown handle is a no-op. */
TP_API void tp_tensor_remove_grad_hook(tp_tensor *t, int handle);
/* true when t was produced by a recorded op (has a backward node). */
TP_API bool tp_tensor_has_grad_fn(const tp_tensor *t);

/*
 * Reverse mode from `loss`: grad NULL means a ones tensor (loss must then have
 * one element); otherwise grad has loss's shape and layout. Collective when
 * the graph contains DTensor ops. Gradients accumulate into the leaves'
 * tp_tensor_grad(); the graph is freed as it is walked (a second backward
 * through it is TP_ERR_STATE). The comm-debug phase is "backward" meanwhile.
 */
TP_API tp_status tp_backward(tp_tensor *loss, const tp_tensor *grad);

/* No-grad scopes (per thread, nestable): ops inside record nothing. */
TP_API void tp_no_grad_begin(void);
TP_API void tp_no_grad_end(void);
TP_API bool tp_grad_enabled(void);

#ifdef __cplusplus
}
#endif

#endif /* TP_DTENSOR_H */
