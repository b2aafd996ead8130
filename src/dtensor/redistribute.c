/*
 * Redistribution between layouts.
 *
 * A plan is a list of steps, each changing the placement of one mesh dim and
 * issuing at most one collective on that dim's communicator:
 *
 *   S(i) -> R     all_gather along i       R -> S(i)  local chunk
 *   P -> R        all_reduce               P -> S(i)  reduce_scatter along i
 *   S(i) -> S(j)  all_to_all               R -> P     local (sum: / W)
 *   S(i) -> P(sum)  local: the level's full extent along i, zeros but for
 *                   this rank's rows (public, as in PyTorch 2.15)
 *
 * On N-D meshes the plan first walks the mesh dims from last to first,
 * turning a dim to Replicate where the sharding of the same tensor dim by
 * earlier mesh dims differs between source and target (nested sharding must
 * be undone inner first), applying every other change on the way; then it
 * walks first to last applying what remains. Uneven shards (torch.chunk) are
 * padded to the chunk size for the collective and trimmed after. Plans depend
 * only on the placements and are cached per thread.
 */
#include <stdatomic.h>
#include <string.h>

#include "dtensor/debug_log.h"
#include "dtensor/dtensor_internal.h"
#include "dtensor/stash.h"
#include "kernels/kernels.h"

typedef struct {
    int mesh_dim;
    tp_placement from, to;
} tp__step;

typedef struct {
    int n;
    tp__step s[2 * TP_MESH_MAX_DIMS];
} tp__plan;

static void tp__make_plan(int m, const tp_placement *src, const tp_placement *dst, tp__plan *plan)
{
    tp_placement cur[TP_MESH_MAX_DIMS];
    memcpy(cur, src, sizeof(tp_placement) * (size_t)m);
    plan->n = 0;
    bool sharded = false;
    for (int i = 0; i < m; i++)
        sharded |= src[i].kind == TP_PLACEMENT_SHARD;
    if (m > 1 && sharded) {
        for (int d = m - 1; d >= 0; d--) {
            tp_placement tgt = dst[d];
            if (tgt.kind == TP_PLACEMENT_SHARD) {
                for (int i = 0; i < d; i++) {
                    bool a = cur[i].kind == TP_PLACEMENT_SHARD && cur[i].dim == tgt.dim;
                    bool b = dst[i].kind == TP_PLACEMENT_SHARD && dst[i].dim == tgt.dim;
                    if (a != b) {
                        tgt = tp_replicate();
                        break;
                    }
                }
            }
            if (!tp__placement_eq(cur[d], tgt)) {
                plan->s[plan->n++] = (tp__step){d, cur[d], tgt};
                cur[d] = tgt;
            }
        }
    }
    for (int d = 0; d < m; d++)
        if (!tp__placement_eq(cur[d], dst[d])) {
            plan->s[plan->n++] = (tp__step){d, cur[d], dst[d]};
            cur[d] = dst[d];
        }
}

/* ---- the per-thread plan cache ------------------------------------------- */

#define TP__CACHE 64

typedef struct {
    bool used;
    int m;
    tp_placement src[TP_MESH_MAX_DIMS], dst[TP_MESH_MAX_DIMS];
    tp__plan plan;
} tp__cache_entry;

static _Thread_local tp__cache_entry tp__cache[TP__CACHE];

static unsigned tp__hash(int m, const tp_placement *src, const tp_placement *dst)
{
    unsigned h = 2166136261u ^ (unsigned)m;
    for (int i = 0; i < m; i++) {
        h = (h ^ (unsigned)(src[i].kind * 31 + src[i].dim * 7 + (int)src[i].op)) * 16777619u;
        h = (h ^ (unsigned)(dst[i].kind * 37 + dst[i].dim * 11 + (int)dst[i].op)) * 16777619u;
    }
    return h;
}

static bool tp__same(int m, const tp_placement *a, const tp_placement *b)
{
    for (int i = 0; i < m; i++)
        if (!tp__placement_eq(a[i], b[i]))
            return false;
    return true;
}

static const tp__plan *tp__get_plan(int m, const tp_placement *src, const tp_placement *dst)
{
    tp__cache_entry *e = &tp__cache[tp__hash(m, src, dst) % TP__CACHE];
    if (e->used && e->m == m && tp__same(m, e->src, src) && tp__same(m, e->dst, dst))
        return &e->plan;
    e->used = true;
    e->m = m;
    memcpy(e->src, src, sizeof(tp_placement) * (size_t)m);
    memcpy(e->dst, dst, sizeof(tp_placement) * (size_t)m);
    tp__make_plan(m, src, dst, &e->plan);
    return &e->plan;
}

/* ---- validation of a step ------------------------------------------------ */

/* Shard -> Partial exists for sum only (PyTorch 2.15); a Partial never
 * changes its reduce op. */
static tp_status tp__step_check(const char *fn, const tp__step *st)
{
    char a[32], b[32];
    if (st->to.kind == TP_PLACEMENT_PARTIAL && st->from.kind == TP_PLACEMENT_SHARD &&
        st->to.op != TP_SUM)
        return tp__error(TP_ERR_NOT_SUPPORTED,
                         "%s: %s -> %s on mesh dim %d is not supported (Shard -> Partial is "
                         "for sum only)",
                         fn, tp_placement_str(st->from, a, sizeof a),
                         tp_placement_str(st->to, b, sizeof b), st->mesh_dim);
    if (st->to.kind == TP_PLACEMENT_PARTIAL && st->from.kind == TP_PLACEMENT_PARTIAL)
        return tp__error(TP_ERR_NOT_SUPPORTED,
                         "%s: %s -> %s on mesh dim %d is not supported (a Partial keeps its "
                         "reduce op)",
                         fn, tp_placement_str(st->from, a, sizeof a),
                         tp_placement_str(st->to, b, sizeof b), st->mesh_dim);
    return TP_OK;
}

static tp_coll_kind tp__step_kind(const tp__step *st, int64_t w)
{
    if (w == 1)
        return TP_COLL_KIND_COUNT;
    tp_placement_kind f = st->from.kind, t = st->to.kind;
    if (f == TP_PLACEMENT_SHARD && t == TP_PLACEMENT_REPLICATE)
        return TP_COLL_ALL_GATHER;
    if (f == TP_PLACEMENT_PARTIAL && t == TP_PLACEMENT_REPLICATE)
        return TP_COLL_ALL_REDUCE;
    if (f == TP_PLACEMENT_PARTIAL && t == TP_PLACEMENT_SHARD)
        return TP_COLL_REDUCE_SCATTER;
    if (f == TP_PLACEMENT_SHARD && t == TP_PLACEMENT_SHARD)
        return TP_COLL_ALL_TO_ALL;
    return TP_COLL_KIND_COUNT; /* local */
}

tp_status tp_dtensor_plan_collectives(const tp_mesh *mesh, int ndim, int nplacements,
                                      const tp_placement *src_in, const tp_placement *dst_in,
                                      int64_t *counts)
{
    const char *fn = "tp_dtensor_plan_collectives";
    TP_ARG_CHECK(counts, "%s: counts is NULL", fn);
    TP_ARG_CHECK(ndim >= 0 && ndim <= TP_MAX_DIMS, "%s: ndim %d out of range [0, %d]", fn, ndim,
                 TP_MAX_DIMS);
    tp_placement src[TP_MESH_MAX_DIMS], dst[TP_MESH_MAX_DIMS];
    TP_CHECK(tp__placements_check(fn, mesh, ndim, nplacements, src_in, true, src));
    TP_CHECK(tp__placements_check(fn, mesh, ndim, nplacements, dst_in, true, dst));
    int m = tp_mesh_ndim(mesh);
    tp__plan plan;
    tp__make_plan(m, src, dst, &plan);
    for (int k = 0; k < TP_COLL_KIND_COUNT; k++)
        counts[k] = 0;
    for (int i = 0; i < plan.n; i++) {
        TP_CHECK(tp__step_check("tp_dtensor_redistribute", &plan.s[i]));
        tp_coll_kind k = tp__step_kind(&plan.s[i], tp_mesh_size(mesh, plan.s[i].mesh_dim));
        if (k != TP_COLL_KIND_COUNT)
            counts[k]++;
    }
    return TP_OK;
}

/* ---- executing steps ----------------------------------------------------- */

/* The size of tensor dim k at mesh level d: the global size split by the mesh
 * dims before d that currently shard k (this rank's chunks). */
static int64_t tp__level_size(const tp_mesh *mesh, const tp_placement *cur, int d, int k,
                              int64_t global)
{
    int64_t n = global;
    for (int i = 0; i < d; i++) {
        if (cur[i].kind == TP_PLACEMENT_SHARD && cur[i].dim == k) {
            int64_t start = 0, len = 0;
            tp_chunk_range(n, tp_mesh_size(mesh, i), tp_mesh_coord(mesh, i), &start, &len);
            n = len;
        }
    }
    return n;
}

static tp_status tp__new_like(const tp_tensor *t, const int64_t *shape, bool zero, tp_tensor **out)
{
    return zero ? tp_tensor_zeros(t->dtype, tp_tensor_device(t), t->ndim, shape, out)
                : tp_tensor_empty(t->dtype, tp_tensor_device(t), t->ndim, shape, out);
}

/* dst (a view) <- src (a view) */
static tp_status tp__copy_block(tp_tensor *dst, int dim, int64_t start, int64_t len,
                                tp_tensor *src, int sdim, int64_t sstart, int64_t slen)
{
    tp_tensor *a = NULL, *b = NULL;
    tp_status st = tp_tensor_narrow(dst, dim, start, len, &a);
    if (st == TP_OK)
        st = tp_tensor_narrow(src, sdim, sstart, slen, &b);
    if (st == TP_OK)
        st = tp_tensor_copy(a, b);
    tp_tensor_release(a);
    tp_tensor_release(b);
    return st;
}

/* A contiguous version of `t` restricted to [start, start+len) along k. */
static tp_status tp__chunk_of(tp_tensor *t, int k, int64_t start, int64_t len, tp_tensor **out)
{
    tp_tensor *v = NULL;
    TP_CHECK(tp_tensor_narrow(t, k, start, len, &v));
    if (tp_tensor_is_contiguous(v)) {
        *out = v;
        return TP_OK;
    }
    tp_status st = tp_tensor_clone(v, out);
    tp_tensor_release(v);
    return st;
}

/* Copies between t and `packed`, t's chunks along k for w ranks (torch.chunk
 * rule) each padded to the chunk size ([w, ...t's shape with dim k the chunk
 * size...]): into packed (pack) or out of it. */
static tp_status tp__chunks_copy(tp_tensor *packed, tp_tensor *t, int k, int64_t w, bool pack)
{
    tp_status st = TP_OK;
    for (int64_t r = 0; r < w && st == TP_OK; r++) {
        int64_t s0 = 0, l0 = 0;
        tp_chunk_range(t->shape[k], w, r, &s0, &l0);
        if (l0 == 0)
            continue;
        tp_tensor *blk = NULL;
        st = tp_tensor_select(packed, 0, r, &blk);
        if (st == TP_OK)
            st = pack ? tp__copy_block(blk, k, 0, l0, t, k, s0, l0)
                      : tp__copy_block(t, k, s0, l0, blk, k, 0, l0);
        tp_tensor_release(blk);
    }
    return st;
}

/* t packed for the collectives that move one block per rank: a new tensor,
 * zero past each chunk's end. */
static tp_status tp__pack_chunks(tp_tensor *t, int k, int64_t w, tp_tensor **out)
{
    int64_t L = t->shape[k], pshape[TP_MAX_DIMS + 1];
    memcpy(pshape + 1, t->shape, sizeof(int64_t) * (size_t)t->ndim);
    pshape[0] = w;
    pshape[1 + k] = (L + w - 1) / w;
    tp_tensor *send = NULL;
    tp_status st = tp_tensor_zeros(t->dtype, tp_tensor_device(t), t->ndim + 1, pshape, &send);
    if (st == TP_OK)
        st = tp__chunks_copy(send, t, k, w, true);
    if (st != TP_OK) {
        tp_tensor_release(send);
        return st;
    }
    *out = send;
    return TP_OK;
}

static tp_status tp__all_gather_dim(tp_comm *comm, tp_tensor *local, int k, int64_t L,
                                    tp_tensor **out)
{
    int64_t w = tp_comm_size(comm), cs = (L + w - 1) / w;
    int64_t shape[TP_MAX_DIMS], pshape[TP_MAX_DIMS + 1];
    memcpy(shape, local->shape, sizeof shape);
    shape[k] = L;
    bool even = L == cs * w;
    if (k == 0 && even) {
        TP_CHECK(tp__new_like(local, shape, false, out));
        tp_status st = tp_all_gather(comm, local, *out, NULL);
        if (st != TP_OK) {
            tp_tensor_release(*out);
            *out = NULL;
        }
        return st;
    }
    /* padded blocks: [w, ...local shape with dim k = cs...] */
    tp_tensor *send = NULL, *recv = NULL, *res = NULL;
    memcpy(pshape + 1, local->shape, sizeof(int64_t) * (size_t)local->ndim);
    pshape[0] = w;
    pshape[1 + k] = cs;
    tp_status st = tp__new_like(local, pshape + 1, true, &send);
    if (st == TP_OK)
        st = tp__copy_block(send, k, 0, local->shape[k], local, k, 0, local->shape[k]);
    if (st == TP_OK)
        st = tp_tensor_empty(local->dtype, tp_tensor_device(local), local->ndim + 1, pshape,
                             &recv);
    if (st == TP_OK)
        st = tp_all_gather(comm, send, recv, NULL);
    if (st == TP_OK)
        st = tp__new_like(local, shape, false, &res);
    if (st == TP_OK)
        st = tp__chunks_copy(recv, res, k, w, false);
    tp_tensor_release(send);
    tp_tensor_release(recv);
    if (st != TP_OK) {
        tp_tensor_release(res);
        return st;
    }
    *out = res;
    return TP_OK;
}

static tp_status tp__reduce_scatter_dim(tp_comm *comm, tp_tensor *local, int k, tp_reduce_op op,
                                        int64_t c, tp_tensor **out)
{
    int64_t w = tp_comm_size(comm), L = local->shape[k], cs = (L + w - 1) / w;
    int64_t start = 0, len = 0;
    tp_chunk_range(L, w, c, &start, &len);
    if (k == 0 && L == cs * w) {
        int64_t shape[TP_MAX_DIMS];
        memcpy(shape, local->shape, sizeof shape);
        shape[0] = cs;
        TP_CHECK(tp__new_like(local, shape, false, out));
        tp_status st = tp_reduce_scatter(comm, local, *out, op, NULL);
        if (st != TP_OK) {
            tp_tensor_release(*out);
            *out = NULL;
        }
        return st;
    }
    int64_t shape[TP_MAX_DIMS];
    memcpy(shape, local->shape, sizeof shape);
    shape[k] = cs;
    tp_tensor *send = NULL, *recv = NULL;
    tp_status st = tp__pack_chunks(local, k, w, &send);
    if (st == TP_OK)
        st = tp__new_like(local, shape, false, &recv);
    if (st == TP_OK)
        st = tp_reduce_scatter(comm, send, recv, op, NULL);
    if (st == TP_OK)
        st = tp__chunk_of(recv, k, 0, len, out);
    tp_tensor_release(send);
    tp_tensor_release(recv);
    return st;
}

tp_status tp__scatter_dim(tp_comm *comm, tp_tensor *cur, const int64_t *shape, int ndim,
                          tp_dtype dtype, tp_device dev, int k, int root, tp_tensor **out)
{
    int64_t w = tp_comm_size(comm), c = tp_comm_rank(comm), L = shape[k];
    int64_t cs = (L + w - 1) / w, start = 0, len = 0;
    tp_chunk_range(L, w, c, &start, &len);
    int64_t rshape[TP_MAX_DIMS];
    memcpy(rshape, shape, sizeof(int64_t) * (size_t)ndim);
    rshape[k] = cs;
    tp_tensor *send = NULL, *recv = NULL;
    tp_status st = TP_OK;
    if (cur && k == 0 && L == cs * w)
        send = tp_tensor_retain(cur); /* the blocks are cur's rows already */
    else if (cur)
        st = tp__pack_chunks(cur, k, w, &send);
    if (st == TP_OK)
        st = tp_tensor_empty(dtype, dev, ndim, rshape, &recv);
    if (st == TP_OK)
        st = tp_scatter(comm, send, recv, root, NULL);
    if (st == TP_OK)
        st = tp__chunk_of(recv, k, 0, len, out);
    tp_tensor_release(send);
    tp_tensor_release(recv);
    return st;
}

static tp_status tp__all_to_all_dims(tp_comm *comm, tp_tensor *local, int i, int j, int64_t Li,
                                     int64_t c, tp_tensor **out)
{
    int64_t w = tp_comm_size(comm), Lj = local->shape[j];
    int64_t ci = (Li + w - 1) / w, cj = (Lj + w - 1) / w;
    int64_t pshape[TP_MAX_DIMS + 1], shape[TP_MAX_DIMS];
    memcpy(pshape + 1, local->shape, sizeof(int64_t) * (size_t)local->ndim);
    pshape[0] = w;
    pshape[1 + i] = ci;
    pshape[1 + j] = cj;
    int64_t sj = 0, lj = 0;
    tp_chunk_range(Lj, w, c, &sj, &lj);
    tp_tensor *send = NULL, *recv = NULL, *res = NULL;
    tp_status st = tp_tensor_zeros(local->dtype, tp_tensor_device(local), local->ndim + 1, pshape,
                                   &send);
    int64_t li_mine = local->shape[i];
    for (int64_t r = 0; r < w && st == TP_OK; r++) {
        int64_t s0 = 0, l0 = 0;
        tp_chunk_range(Lj, w, r, &s0, &l0);
        if (l0 == 0 || li_mine == 0)
            continue;
        tp_tensor *blk = NULL, *blk2 = NULL, *src = NULL;
        st = tp_tensor_select(send, 0, r, &blk);
        if (st == TP_OK)
            st = tp_tensor_narrow(blk, i, 0, li_mine, &blk2);
        if (st == TP_OK)
            st = tp_tensor_narrow(local, j, s0, l0, &src);
        tp_tensor *dst = NULL;
        if (st == TP_OK)
            st = tp_tensor_narrow(blk2, j, 0, l0, &dst);
        if (st == TP_OK)
            st = tp_tensor_copy(dst, src);
        tp_tensor_release(dst);
        tp_tensor_release(blk);
        tp_tensor_release(blk2);
        tp_tensor_release(src);
    }
    if (st == TP_OK)
        st = tp_tensor_empty(local->dtype, tp_tensor_device(local), local->ndim + 1, pshape,
                             &recv);
    if (st == TP_OK)
        st = tp_all_to_all(comm, send, recv, NULL);
    memcpy(shape, local->shape, sizeof shape);
    shape[i] = Li;
    shape[j] = lj;
    if (st == TP_OK)
        st = tp__new_like(local, shape, false, &res);
    for (int64_t r = 0; r < w && st == TP_OK; r++) {
        int64_t s0 = 0, l0 = 0;
        tp_chunk_range(Li, w, r, &s0, &l0);
        if (l0 == 0 || lj == 0)
            continue;
        tp_tensor *blk = NULL, *a = NULL, *b = NULL, *d1 = NULL;
        st = tp_tensor_select(recv, 0, r, &blk);
        if (st == TP_OK)
            st = tp_tensor_narrow(blk, i, 0, l0, &a);
        if (st == TP_OK)
            st = tp_tensor_narrow(a, j, 0, lj, &b);
        if (st == TP_OK)
            st = tp_tensor_narrow(res, i, s0, l0, &d1);
        if (st == TP_OK)
            st = tp_tensor_copy(d1, b);
        tp_tensor_release(blk);
        tp_tensor_release(a);
        tp_tensor_release(b);
        tp_tensor_release(d1);
    }
    tp_tensor_release(send);
    tp_tensor_release(recv);
    if (st != TP_OK) {
        tp_tensor_release(res);
        return st;
    }
    *out = res;
    return TP_OK;
}

/* ---- the partial-reduce setting ----------------------------------------- */

static atomic_bool tp__partial_f32;

void tp_set_partial_reduce_f32(bool on)
{
    atomic_store(&tp__partial_f32, on);
}

bool tp_partial_reduce_f32(void)
{
    return atomic_load(&tp__partial_f32);
}

/* Partial -> Replicate (all_reduce) or Partial -> Shard(k) (reduce_scatter,
 * k >= 0) of local by op: one collective. With the setting on, a bf16/f16
 * local is reduced in f32 (converted, reduced, converted back once). */
static tp_status tp__run_reduce(tp_comm *comm, tp_tensor *local, int k, tp_reduce_op op, int64_t c,
                                tp_tensor **out)
{
    tp_tensor *in = local, *wide = NULL, *res = NULL;
    tp_status st = TP_OK;
    if ((local->dtype == TP_BF16 || local->dtype == TP_F16) && tp_partial_reduce_f32()) {
        TP_CHECK(tp_tensor_to(local, TP_F32, tp_tensor_device(local), &wide));
        in = wide;
    }
    if (k >= 0) {
        st = tp__reduce_scatter_dim(comm, in, k, op, c, &res);
    } else {
        st = tp__new_like(in, in->shape, false, &res);
        if (st == TP_OK)
            st = tp_all_reduce(comm, in, res, op, NULL);
    }
    if (st == TP_OK && wide) {
        tp_tensor *narrow = NULL;
        st = tp_tensor_to(res, local->dtype, tp_tensor_device(res), &narrow);
        tp_tensor_release(res);
        res = narrow;
    }
    tp_tensor_release(wide);
    if (st != TP_OK) {
        tp_tensor_release(res);
        return st;
    }
    *out = res;
    return TP_OK;
}

static tp_status tp__run_step(const tp_mesh *mesh, const tp__step *step, const tp_placement *cur,
                              const int64_t *global, tp_tensor *local, tp_tensor **out)
{
    int d = step->mesh_dim;
    int64_t w = tp_mesh_size(mesh, d), c = tp_mesh_coord(mesh, d);
    tp_comm *comm = tp_mesh_comm(mesh, d);
    tp_placement_kind f = step->from.kind, t = step->to.kind;
    if (w == 1) {
        *out = tp_tensor_retain(local);
        return TP_OK;
    }
    if (f == TP_PLACEMENT_SHARD && t == TP_PLACEMENT_REPLICATE) {
        int k = step->from.dim;
        return tp__all_gather_dim(comm, local, k, tp__level_size(mesh, cur, d, k, global[k]), out);
    }
    if (f == TP_PLACEMENT_REPLICATE && t == TP_PLACEMENT_SHARD) {
        int k = step->to.dim;
        int64_t start = 0, len = 0;
        tp_chunk_range(local->shape[k], w, c, &start, &len);
        return tp__chunk_of(local, k, start, len, out);
    }
    if (f == TP_PLACEMENT_PARTIAL && t == TP_PLACEMENT_REPLICATE)
        return tp__run_reduce(comm, local, -1, step->from.op, c, out);
    if (f == TP_PLACEMENT_PARTIAL && t == TP_PLACEMENT_SHARD)
        return tp__run_reduce(comm, local, step->to.dim, step->from.op, c, out);
    if (f == TP_PLACEMENT_SHARD && t == TP_PLACEMENT_SHARD) {
        int i = step->from.dim, j = step->to.dim;
        return tp__all_to_all_dims(comm, local, i, j, tp__level_size(mesh, cur, d, i, global[i]),
                                   c, out);
    }
    if (f == TP_PLACEMENT_REPLICATE && t == TP_PLACEMENT_PARTIAL) {
        if (step->to.op != TP_SUM) {
            *out = tp_tensor_retain(local);
            return TP_OK;
        }
        TP_CHECK(tp_tensor_clone(local, out));
        int64_t n = tp_tensor_numel(*out);
        tp_device dev = tp_tensor_device(*out);
        if (dev.type != TP_DEVICE_CPU) {
            const tp__kernels *k = NULL;
            tp_status st = tp__kernels_for(dev, &k);
            if (st == TP_OK && k->supports(TP__KOP_SCALE, (*out)->dtype)) {
                st = k->scale(dev, (*out)->dtype, tp_tensor_data(*out), (float)(1.0 / (double)w),
                              tp_tensor_data(*out), n);
            } else if (st == TP_OK) { /* other dtypes through the host */
                tp_tensor *h = NULL;
                st = tp_tensor_to(*out, (*out)->dtype, TP_CPU, &h);
                for (int64_t e = 0; st == TP_OK && e < n; e++)
                    tp__store_f64(tp_tensor_data(h), h->dtype, e,
                                  tp__load_f64(tp_tensor_data(h), h->dtype, e) / (double)w);
                if (st == TP_OK)
                    st = tp_tensor_copy(*out, h);
                tp_tensor_release(h);
            }
            if (st != TP_OK) {
                tp_tensor_release(*out);
                *out = NULL;
            }
            return st;
        }
        for (int64_t e = 0; e < n; e++)
            tp__store_f64(tp_tensor_data(*out), (*out)->dtype, e,
                          tp__load_f64(tp_tensor_data(*out), (*out)->dtype, e) / (double)w);
        return TP_OK;
    }
    if (f == TP_PLACEMENT_SHARD && t == TP_PLACEMENT_PARTIAL && step->to.op == TP_SUM) {
        /* the level's full extent along k, zeros but for this rank's rows:
         * the terms sum to the value */
        int k = step->from.dim;
        int64_t L = tp__level_size(mesh, cur, d, k, global[k]), start = 0, len = 0;
        tp_chunk_range(L, w, c, &start, &len);
        int64_t shape[TP_MAX_DIMS];
        memcpy(shape, local->shape, sizeof shape);
        shape[k] = L;
        TP_CHECK(tp__new_like(local, shape, true, out));
        tp_status st = len ? tp__copy_block(*out, k, start, len, local, k, 0, len) : TP_OK;
        if (st != TP_OK) {
            tp_tensor_release(*out);
            *out = NULL;
        }
        return st;
    }
    return tp__step_check("tp_dtensor_redistribute", step);
}

/* A collective over a sharded dim that the ranks issued with different sizes
 * (TP_ERR_MISMATCH: shm compares every call, other backends with
 * tp_comm_set_check) means they disagree on the DTensor's global shape: the
 * usual cause is a DTensor built from uneven local shards without its
 * global shape, which is then inferred from each rank's own shard (PyTorch's
 * from_local does the same, and cannot know better). Says what to change. */
static void tp__shape_hint(const tp_mesh *mesh, const tp__step *step, const tp_tensor *dt)
{
    int k = step->from.kind == TP_PLACEMENT_SHARD ? step->from.dim : step->to.dim;
    long long w = (long long)tp_mesh_size(mesh, step->mesh_dim);
    char msg[1024], shape[128];
    snprintf(msg, sizeof msg, "%s", tp_last_error());
    tp__error(TP_ERR_MISMATCH,
              "%s. The ranks likely hold different global shapes for this DTensor (%s here, "
              "dim %d sharded over %lld ranks): for uneven shards (a sequence length the ranks "
              "do not divide) pass a DTensor built with its global_shape, or make dim %d "
              "divisible by %lld; built from local shards without it (tp_dtensor_from_local "
              "with no global_shape, as the styles do with a plain input), a DTensor takes "
              "every shard to be as large as this rank's",
              msg, tp__shape_str(dt->ndim, dt->shape, shape, sizeof shape), k, w, k, w);
}

typedef struct {
    tp_placement src[TP_MESH_MAX_DIMS];
} tp__redist_saved;

static tp_status tp__redist_bwd(tp__node *node, tp_tensor *g, tp_tensor **gin)
{
    tp__redist_saved *sv = node->saved;
    tp__dist *d = tp__dist_of(g);
    tp_placement want[TP_MESH_MAX_DIMS];
    for (int i = 0; i < d->mesh_ndim; i++)
        want[i] = sv->src[i].kind == TP_PLACEMENT_PARTIAL ? tp_replicate() : sv->src[i];
    return tp__redistribute(g, want, false, &gin[0]);
}

static const char tp__redistribute_tag[] = "redistribute";

tp_status tp__redistribute(tp_tensor *dt, const tp_placement *placements, bool record,
                           tp_tensor **out)
{
    const char *fn = "tp_dtensor_redistribute";
    tp__dist *d = tp__dist_of(dt);
    int m = d->mesh_ndim;
    const tp__plan *cached = tp__get_plan(m, d->placements, placements);
    tp__plan plan = *cached; /* a nested redistribute may evict the entry */
    tp_placement cur[TP_MESH_MAX_DIMS];
    memcpy(cur, d->placements, sizeof cur);
    for (int i = 0; i < plan.n; i++)
        TP_CHECK(tp__step_check(fn, &plan.s[i]));
    tp_tensor *local = NULL;
    tp_status st = TP_OK;
    /* selective recompute: a redistribution that moves data is kept */
    bool replay = plan.n > 0 && tp__stash_replaying();
    if (replay)
        st = tp__stash_take(tp__redistribute_tag, &local, NULL, 0);
    else
        local = tp_tensor_retain(d->local);
    for (int i = 0; i < plan.n && st == TP_OK && !replay; i++) {
        tp_tensor *next = NULL;
        const tp__step *s = &plan.s[i];
        if (TP_LOG_ON(TP_LOG_INFO))
            tp__log_redistribute_step(dt, placements, i, plan.n, s->mesh_dim, s->from, s->to,
                                      tp__step_kind(s, tp_mesh_size(d->mesh, s->mesh_dim)), local);
        st = tp__run_step(d->mesh, &plan.s[i], cur, dt->shape, local, &next);
        if (st == TP_ERR_MISMATCH && (plan.s[i].from.kind == TP_PLACEMENT_SHARD ||
                                      plan.s[i].to.kind == TP_PLACEMENT_SHARD))
            tp__shape_hint(d->mesh, &plan.s[i], dt);
        if (st == TP_OK) {
            tp_tensor_release(local);
            local = next;
            cur[plan.s[i].mesh_dim] = plan.s[i].to;
        }
    }
    if (st == TP_OK && plan.n > 0 && !replay)
        st = tp__stash_put(tp__redistribute_tag, local, NULL, 0);
    tp_tensor *res = NULL;
    if (st == TP_OK)
        st = tp__dtensor_wrap(d->mesh, local, placements, dt->ndim, dt->shape, &res);
    tp_tensor_release(local);
    if (st != TP_OK)
        return st;
    if (record && tp__needs_grad(1, &dt)) {
        tp__node *node = NULL;
        tp__redist_saved *sv = tp__malloc(sizeof *sv);
        st = sv ? tp__node_attach(res, "redistribute", tp__redist_bwd, 1, &dt, &node)
                : tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
        if (st != TP_OK) {
            tp__free(sv);
            tp_tensor_release(res);
            return st;
        }
        memcpy(sv->src, d->placements, sizeof sv->src);
        node->saved = sv;
        node->free_saved = tp__node_free_saved;
    }
    *out = res;
    return TP_OK;
}

tp_status tp_dtensor_redistribute(tp_tensor *dt, int nplacements, const tp_placement *placements,
                                  tp_tensor **out)
{
    const char *fn = "tp_dtensor_redistribute";
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    *out = NULL;
    TP_ARG_CHECK(dt, "%s: dt is NULL", fn);
    TP_ARG_CHECK(tp__dist_of(dt), "%s: dt is not a DTensor (use tp_dtensor_distribute)", fn);
    tp__dist *d = tp__dist_of(dt);
    tp_placement p[TP_MESH_MAX_DIMS];
    TP_CHECK(tp__placements_check(fn, d->mesh, dt->ndim, nplacements, placements, true, p));
    /* of the conversions to Partial only Shard -> Partial(sum) is public (as
     * in PyTorch 2.15) */
    for (int i = 0; i < d->mesh_ndim; i++) {
        tp_placement from = d->placements[i];
        if (p[i].kind != TP_PLACEMENT_PARTIAL || tp__placement_eq(p[i], from))
            continue;
        if (from.kind == TP_PLACEMENT_SHARD && p[i].op == TP_SUM)
            continue;
        char a[32], b[32];
        tp_placement_str(from, a, sizeof a);
        tp_placement_str(p[i], b, sizeof b);
        if (from.kind == TP_PLACEMENT_REPLICATE)
            return tp__error(TP_ERR_INVALID_ARG,
                             "%s: mesh dim %d: %s -> %s: redistributing Replicate to Partial is "
                             "for internal use; only Shard -> Partial(sum) is public",
                             fn, i, a, b);
        return tp__error(TP_ERR_NOT_SUPPORTED,
                         "%s: mesh dim %d: %s -> %s is not supported; only Shard -> "
                         "Partial(sum) is",
                         fn, i, a, b);
    }
    tp_status st = tp__redistribute(dt, p, true, out);
    if (st != TP_OK && st != TP_ERR_NOT_SUPPORTED && st != TP_ERR_INVALID_ARG)
        tp__error_prefix("%s", fn);
    return st;
}
