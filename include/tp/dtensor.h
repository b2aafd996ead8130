/*
 * tp/dtensor.h - distributed tensors and redistribution.
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
 * Autograd (tp/autograd.h, included here) works on DTensors as on plain
 * tensors. The backward of a redistribute is itself a redistribute, recorded
 * by the comm-debug counter in the backward phase.
 */
#ifndef TP_DTENSOR_H
#define TP_DTENSOR_H

#include <stdbool.h>
#include <stdint.h>

#include "tp/autograd.h"
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
     * the shard sizes add up (TP_ERR_MISMATCH otherwise); default off.
     * Skipped for a meta `local` (no values: no check, no collectives) */
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

/* The partial-reduce setting: whether a Partial -> Replicate (all_reduce) or
 * Partial -> Shard (reduce_scatter) reduction of a bf16 or f16 DTensor runs
 * in f32: the local term is converted to f32, reduced, and the result
 * rounded back to the DTensor's dtype once. Same collectives (count and
 * kind; twice the bytes). Default false: the reduction runs in the tensor's
 * dtype, as PyTorch's (the shm backend already accumulates halves in f32
 * and rounds once; NCCL and MPI may round at every step). Process-wide,
 * thread-safe (atomic); read when a redistribution runs, so set it before
 * the ops it should affect, the same on every rank. f32 and other dtypes are
 * unaffected. */
TP_API void tp_set_partial_reduce_f32(bool on);
/* The partial-reduce setting (false unless tp_set_partial_reduce_f32(true)). */
TP_API bool tp_partial_reduce_f32(void);

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

#ifdef __cplusplus
}
#endif

#endif /* TP_DTENSOR_H */
