/* Scaled dot-product attention over the last two dims, PyTorch's math
 * attention with grouped kv heads (enable_gqa / HF repeat_kv), different
 * query and key lengths (a causal diagonal moved by key_offset) and a key
 * padding mask: out = safe_softmax(q k^T * scale + mask) v.
 *
 * The n_rep query heads of one kv head are contiguous in q, so each (leading
 * index, kv head) pair is one group: its queries are one [n_rep * Sq, D]
 * matrix, the scores one GEMM against K^T, and in the backward dK and dV one
 * GEMM each, the sum over the group's query heads falling out of the
 * product. The mask and the softmax are one pass of the attn_softmax
 * kernel per group, while the group's scores are still in cache. */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "dtensor/ops_internal.h"

static const char *const FN = "scaled_dot_product_attention";

typedef struct {
    bool causal;
    double scale; /* 0: 1/sqrt(D) */
    int64_t key_offset;
    int64_t key_capacity; /* the no-grad scores scratch is sized for this many keys */
    tp_sdpa_backend backend; /* as asked; the forward resolves AUTO */
    bool flash;              /* set by the forward: the fused kernels ran */
} sdpa_params;

/* The head dim (grouped), or -1 for 2-D and 3-D inputs (no head dim). */
static int head_dim_of(int nd)
{
    return nd >= 4 ? nd - 3 : -1;
}

/* Whether the head dim may be sharded on mesh_dim: always for as many kv as
 * query heads (each rank's q and kv chunks are the same heads, even when
 * uneven); else when the heads that earlier mesh dims left on a rank (the
 * dispatcher chooses the mesh dims in order, so op->in_pl holds their
 * choices) split evenly over this one, so that every rank's local group
 * mapping (local q head h uses local kv head h / n_rep) is the global one. */
static bool heads_shardable(const tp__op *op, int mesh_dim, int hd)
{
    int64_t hq = tp__op_gshape(op, 0)[hd], hkv = tp__op_gshape(op, 1)[hd];
    if (hq == hkv)
        return true;
    for (int e = 0; e < mesh_dim; e++) {
        tp_placement p = op->in_pl[0][e];
        if (p.kind == TP_PLACEMENT_SHARD && p.dim == hd) {
            int64_t w = tp_mesh_size(op->mesh, e);
            hq /= w;
            hkv /= w;
        }
    }
    int64_t w = tp_mesh_size(op->mesh, mesh_dim);
    return hkv > 0 && hkv % w == 0;
}

static int sdpa_strategies(const tp__op *op, int mesh_dim, tp__strategy *s)
{
    int nd = tp__op_gndim(op, 0), hd = head_dim_of(nd), n = 0;
    int nlead = hd >= 0 ? hd : nd - 2;
    /* a leading dim sharded alike on q, k, v; key_padding [B, Sk] follows
     * the batch dim (it exists only for 4-D q, whose one leading dim is B) */
    for (int d = 0; d < nlead; d++) {
        tp_placement pad = d == 0 ? tp__S(0) : tp__R();
        s[n++] = (tp__strategy){{tp__S(d), tp__S(d), tp__S(d), pad}, tp__S(d),
                                {tp__S(d), tp__S(d), tp__S(d), tp__R()}};
    }
    if (hd >= 0 && heads_shardable(op, mesh_dim, hd))
        s[n++] = (tp__strategy){{tp__S(hd), tp__S(hd), tp__S(hd), tp__R()}, tp__S(hd),
                                {tp__S(hd), tp__S(hd), tp__S(hd), tp__R()}};
    s[n++] = (tp__strategy){{tp__R(), tp__R(), tp__R(), tp__R()}, tp__R(),
                            {tp__R(), tp__R(), tp__R(), tp__R()}};
    return n;
}

/* q's shape with v's last dim */
static tp_status sdpa_shape(const tp__op *op, int *ndim, int64_t *shape)
{
    int nd = tp__op_gndim(op, 0);
    *ndim = nd;
    memcpy(shape, tp__op_gshape(op, 0), sizeof(int64_t) * (size_t)nd);
    shape[nd - 1] = tp__op_gshape(op, 2)[nd - 1];
    return TP_OK;
}

/* The local geometry: G groups (leading indices x kv heads) of M = n_rep *
 * Sq query rows each. */
typedef struct {
    int64_t G, n_rep, M, Sq, Sk, D, Dv;
    int64_t pad_div; /* groups per key_padding row: the local kv heads */
    float scale;
    /* where the rows of k, v and key_padding lie: group b's key j at
     * b * k_gs + j * k_ld (elements); a KV cache hands a view of its first
     * Sk positions, whose groups lie max_len rows apart */
    int64_t k_gs, k_ld, v_gs, v_ld, pad_ld;
} sdpa_geom;

/* Whether t's rows lie as groups of equally spaced rows: unit last stride,
 * rows `*ld` apart, and the leading dims (all but the last two) folding into
 * one group stride `*gs`. True for contiguous tensors (gs = rows * cols,
 * ld = cols) and for a narrow of the row dim of one (a cache's prefix). */
static bool grouped_rows(const tp_tensor *t, int64_t *gs, int64_t *ld)
{
    const int nd = t->ndim;
    const int64_t *sh = t->shape, *st = t->stride;
    if (sh[nd - 1] > 1 && st[nd - 1] != 1)
        return false;
    *ld = sh[nd - 2] > 1 ? st[nd - 2] : sh[nd - 1];
    if (*ld < sh[nd - 1])
        return false;
    *gs = *ld * sh[nd - 2];
    int d = nd - 3;
    while (d >= 0 && sh[d] == 1)
        d--;
    if (d < 0)
        return true;
    *gs = st[d];
    int64_t next = st[d] * sh[d]; /* the stride that folds the next dim out into d */
    for (int e = d - 1; e >= 0; e--) {
        if (sh[e] == 1)
            continue;
        if (st[e] != next)
            return false;
        next = st[e] * sh[e];
    }
    return true;
}

/* The inputs as the kernels read them: q contiguous, k and v as
 * grouped_rows, key_padding rows with a unit stride; an input laid out
 * otherwise is copied into tmp[i] (released by the caller) and read from
 * there. */
static tp_status sdpa_layout(tp_tensor *const *in, tp_tensor **use, tp_tensor **tmp,
                             sdpa_geom *g)
{
    for (int i = 0; i < 4; i++) {
        use[i] = in[i];
        tmp[i] = NULL;
        if (!in[i])
            continue;
        int64_t gs = 0, ld = 0;
        bool ok = i == 0 ? tp_tensor_is_contiguous(in[i])
                         : i == 3 ? in[i]->shape[1] <= 1 || in[i]->stride[1] == 1
                                  : grouped_rows(in[i], &gs, &ld);
        if (!ok) {
            tp_status st = tp_tensor_clone(in[i], &tmp[i]);
            if (st != TP_OK) {
                while (i-- > 0)
                    tp_tensor_release(tmp[i]);
                return st;
            }
            use[i] = tmp[i];
            if (i == 1 || i == 2)
                grouped_rows(use[i], &gs, &ld);
        }
        if (i == 1) {
            g->k_gs = gs;
            g->k_ld = ld;
        } else if (i == 2) {
            g->v_gs = gs;
            g->v_ld = ld;
        } else if (i == 3) {
            g->pad_ld = use[i]->shape[0] > 1 ? use[i]->stride[0] : use[i]->shape[1];
        }
    }
    return TP_OK;
}

static void sdpa_geom_of(const tp__op *op, tp_tensor *const *in, sdpa_geom *g)
{
    const sdpa_params *p = TP__OP_PARAMS(op, const sdpa_params);
    const tp_tensor *q = in[0], *k = in[1], *v = in[2];
    int nd = q->ndim, hd = head_dim_of(nd);
    g->Sq = q->shape[nd - 2];
    g->D = q->shape[nd - 1];
    g->Sk = k->shape[nd - 2];
    g->Dv = v->shape[nd - 1];
    /* n_rep from the global shapes: a rank may hold no heads */
    g->n_rep = hd >= 0 && tp__op_gshape(op, 1)[hd] > 0
                   ? tp__op_gshape(op, 0)[hd] / tp__op_gshape(op, 1)[hd]
                   : 1;
    g->G = 1;
    for (int i = 0; i + 2 < nd; i++)
        g->G *= k->shape[i];
    g->pad_div = hd >= 0 && k->shape[hd] > 0 ? k->shape[hd] : 1;
    TP_ASSERT(hd < 0 || q->shape[hd] == g->n_rep * k->shape[hd]);
    g->M = g->n_rep * g->Sq;
    g->scale = p->scale != 0 ? (float)p->scale : (float)(1.0 / sqrt((double)g->D));
}

/* The element e of a buffer of dtype dt. */
static void *at(tp_dtype dt, const void *base, int64_t e)
{
    return (char *)base + e * (int64_t)tp_dtype_size(dt);
}

/* C = alpha op(A) op(B) (beta 0) with the op's engine, in the op's dtype
 * (f32 accumulation) */
static tp_status gemm(const tp__op *op, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
                      float alpha, const void *a, int64_t lda, const void *b, int64_t ldb, void *c,
                      int64_t ldc)
{
    return op->k->gemm(op->dev, op->dt, ta, tb, m, n, k, alpha, a, lda, b, ldb, 0.0f, c, ldc);
}

/* TP_SDPA_BACKEND from the environment, read once: AUTO when unset. */
static tp_sdpa_backend env_backend(void)
{
    static _Atomic int cached = -1;
    int b = atomic_load_explicit(&cached, memory_order_relaxed);
    if (b >= 0)
        return (tp_sdpa_backend)b;
    const char *e = getenv("TP_SDPA_BACKEND");
    b = e && strcmp(e, "math") == 0    ? TP_SDPA_BACKEND_MATH
        : e && strcmp(e, "flash") == 0 ? TP_SDPA_BACKEND_FLASH
                                       : TP_SDPA_BACKEND_AUTO;
    if (e && *e && b == TP_SDPA_BACKEND_AUTO && strcmp(e, "auto") != 0)
        tp__log(TP_LOG_WARN, "%s: TP_SDPA_BACKEND=%s is none of auto, math, flash; using auto",
                FN, e);
    atomic_store_explicit(&cached, b, memory_order_relaxed);
    return (tp_sdpa_backend)b;
}

/* Whether this call runs the fused kernels: FLASH asks for them (refused
 * for a head wider than they take); AUTO takes them wherever they are the
 * faster form: the CPU (every dtype; the meta engine plans as the CPU
 * runs) and CUDA in bf16 and f16. CUDA f32 keeps the math form, whose
 * products run on cuBLAS where the fused f32 kernels have no tensor
 * cores. */
static tp_status sdpa_use_flash(const tp__op *op, const sdpa_geom *g, bool *flash)
{
    const sdpa_params *p = TP__OP_PARAMS(op, const sdpa_params);
    tp_sdpa_backend b = p->backend == TP_SDPA_BACKEND_AUTO ? env_backend() : p->backend;
    const bool fits = g->D <= TP__FLASH_MAX_HEAD_DIM && g->Dv <= TP__FLASH_MAX_HEAD_DIM;
    if (b == TP_SDPA_BACKEND_FLASH && !fits)
        return tp__error(TP_ERR_NOT_SUPPORTED,
                         "%s: the flash backend takes head dims up to %d; q/k have %lld, v %lld",
                         FN, TP__FLASH_MAX_HEAD_DIM, (long long)g->D, (long long)g->Dv);
    if (b == TP_SDPA_BACKEND_AUTO)
        b = fits && (op->dev.type != TP_DEVICE_CUDA || op->dt != TP_F32) ? TP_SDPA_BACKEND_FLASH
                                                                           : TP_SDPA_BACKEND_MATH;
    *flash = b == TP_SDPA_BACKEND_FLASH;
    return TP_OK;
}

static tp__attn_geom flash_geom(const tp__op *op, const sdpa_geom *g, const tp_tensor *pad)
{
    const sdpa_params *p = TP__OP_PARAMS(op, const sdpa_params);
    return (tp__attn_geom){.G = g->G,
                           .M = g->M,
                           .Sq = g->Sq,
                           .Sk = g->Sk,
                           .D = g->D,
                           .Dv = g->Dv,
                           .k_gs = g->k_gs,
                           .k_ld = g->k_ld,
                           .v_gs = g->v_gs,
                           .v_ld = g->v_ld,
                           .key_offset = p->key_offset,
                           .pad = pad ? tp_tensor_data(pad) : NULL,
                           .pad_dtype = pad ? pad->dtype : TP_I64,
                           .pad_div = g->pad_div,
                           .pad_ld = g->pad_ld,
                           .scale = g->scale,
                           .causal = p->causal};
}

/* The fused forward: the output and each row's log-sum-exp (f32 [G * M]),
 * both kept for the backward when a gradient is wanted; no scores in
 * memory. */
static tp_status sdpa_flash_fwd(tp__op *op, tp_tensor *const *use, const sdpa_geom *g,
                                bool keep, tp_tensor **out)
{
    tp_tensor *q = use[0];
    int64_t oshape[TP_MAX_DIMS];
    memcpy(oshape, q->shape, sizeof(int64_t) * (size_t)q->ndim);
    oshape[q->ndim - 1] = g->Dv;
    int64_t lshape[1] = {g->G * g->M};
    tp_tensor *lse = NULL;
    tp_status st = tp__new(op->dt, op->dev, q->ndim, oshape, false, out);
    if (st == TP_OK)
        st = tp__f32(op->dev, 1, lshape, false, &lse);
    if (st == TP_OK) {
        const tp__attn_geom fg = flash_geom(op, g, use[3]);
        st = op->k->flash_attn_fwd(op->dev, op->dt, &fg, tp_tensor_data(q),
                                   tp_tensor_data(use[1]), tp_tensor_data(use[2]),
                                   tp_tensor_data(*out), tp_tensor_data(lse));
    }
    if (st != TP_OK || !keep) {
        tp_tensor_release(lse);
        if (st != TP_OK) {
            tp_tensor_release(*out);
            *out = NULL;
        }
        return st;
    }
    st = tp__op_save_output(*out, &op->saved[1]);
    if (st != TP_OK) {
        tp_tensor_release(lse);
        tp_tensor_release(*out);
        *out = NULL;
        return st;
    }
    op->saved[0] = lse;
    return TP_OK;
}

/* The probabilities (the masked safe softmax of the scores, in the op's
 * dtype, as PyTorch's math attention keeps them) are saved for the backward
 * when a gradient is wanted; otherwise one group's scores are scratch. */
static tp_status sdpa_fwd(tp__op *op, tp_tensor *const *in, tp_tensor **out)
{
    const sdpa_params *p = TP__OP_PARAMS(op, const sdpa_params);
    tp_tensor *q = in[0], *k = in[1], *v = in[2], *pad = in[3];
    sdpa_geom g;
    sdpa_geom_of(op, in, &g);
    tp_tensor *use[4], *tmp[4];
    TP_CHECK(sdpa_layout(in, use, tmp, &g));
    bool keep = tp__needs_grad(op->def->n_inputs, op->in); /* as tp__op_run records a node */
    bool flash = false;
    tp_status st = sdpa_use_flash(op, &g, &flash);
    if (st != TP_OK || flash) {
        if (st == TP_OK)
            st = sdpa_flash_fwd(op, use, &g, keep, out);
        TP__OP_PARAMS(op, sdpa_params)->flash = flash;
        for (int i = 0; i < 4; i++)
            tp_tensor_release(tmp[i]);
        return st;
    }
    q = use[0];
    k = use[1];
    v = use[2];
    pad = use[3];
    int64_t oshape[TP_MAX_DIMS];
    memcpy(oshape, q->shape, sizeof(int64_t) * (size_t)q->ndim);
    oshape[q->ndim - 1] = g.Dv;
    /* without a gradient one group's scores are scratch, sized for
     * key_capacity keys when that is more: a decode step over a growing
     * cache then asks the allocator for the same size every time */
    int64_t pshape[2] = {(keep ? g.G : 1) * g.M,
                         keep || p->key_capacity < g.Sk ? g.Sk : p->key_capacity};
    tp_tensor *probs = NULL;
    st = tp__new(op->dt, op->dev, q->ndim, oshape, false, out);
    if (st == TP_OK)
        st = tp__new(op->dt, op->dev, 2, pshape, false, &probs);
    const tp_dtype dt = op->dt;
    const void *qd = tp_tensor_data(q), *kd = tp_tensor_data(k), *vd = tp_tensor_data(v);
    const void *padd = pad ? tp_tensor_data(pad) : NULL;
    const size_t pes = pad ? tp_dtype_size(pad->dtype) : 0;
    void *od = tp_tensor_data(*out), *pd = probs ? tp_tensor_data(probs) : NULL;
    for (int64_t b = 0; b < g.G && st == TP_OK; b++) {
        void *sc = at(dt, pd, keep ? b * g.M * g.Sk : 0);
        const void *kb = at(dt, kd, b * g.k_gs), *vb = at(dt, vd, b * g.v_gs);
        /* this group's padding row: its batch entry's */
        const void *padb =
            padd ? (const char *)padd + (size_t)(b / g.pad_div * g.pad_ld) * pes : NULL;
        st = gemm(op, false, true, g.M, g.Sk, g.D, g.scale, at(dt, qd, b * g.M * g.D), g.D, kb,
                  g.k_ld, sc, g.Sk);
        if (st == TP_OK && g.M > 0 && g.Sk > 0)
            st = op->k->attn_softmax(op->dev, dt, sc, 1, g.M, g.Sq, g.Sk, p->key_offset,
                                     p->causal, padb, pad ? pad->dtype : TP_I64, 1);
        if (st == TP_OK)
            st = gemm(op, false, false, g.M, g.Dv, g.Sk, 1.0f, sc, g.Sk, vb, g.v_ld,
                      at(dt, od, b * g.M * g.Dv), g.Dv);
    }
    for (int i = 0; i < 4; i++)
        tp_tensor_release(tmp[i]);
    if (st != TP_OK || !keep) {
        tp_tensor_release(probs);
        if (st != TP_OK) {
            tp_tensor_release(*out);
            *out = NULL;
        }
        return st;
    }
    op->saved[0] = probs;
    return TP_OK;
}

/* Per group: dv = p^T dout; ds = softmax backward of dout v^T; dq = ds k *
 * scale; dk = ds^T q * scale; each over the group's n_rep * Sq rows, so dk
 * and dv sum over its query heads. Only the gradients wanted are made. */
static tp_status sdpa_bwd(tp__op *op, tp_tensor *const *in, tp_tensor *gy, tp_tensor **g)
{
    sdpa_geom m;
    sdpa_geom_of(op, in, &m);
    tp_tensor *use[4], *tmp[4];
    TP_CHECK(sdpa_layout(in, use, tmp, &m));
    in = use;
    const tp_dtype dt = op->dt;
    tp_status st = TP_OK;
    const bool want_q = op->need_grad[0], want_k = op->need_grad[1], want_v = op->need_grad[2];
    for (int i = 0; i < 3 && st == TP_OK; i++)
        if (op->need_grad[i])
            st = tp__new(dt, op->dev, in[i]->ndim, in[i]->shape, false, &g[i]);
    if (TP__OP_PARAMS(op, const sdpa_params)->flash) {
        /* the fused backward recomputes the probabilities from lse */
        tp_tensor *delta = NULL;
        int64_t dshape[1] = {m.G * m.M};
        if (st == TP_OK)
            st = tp__f32(op->dev, 1, dshape, false, &delta);
        if (st == TP_OK) {
            const tp__attn_geom fg = flash_geom(op, &m, in[3]);
            st = op->k->flash_attn_bwd(
                op->dev, dt, &fg, tp_tensor_data(in[0]), tp_tensor_data(in[1]),
                tp_tensor_data(in[2]), tp_tensor_data(op->saved[1]), tp_tensor_data(op->saved[0]),
                tp_tensor_data(gy), tp_tensor_data(delta), want_q ? tp_tensor_data(g[0]) : NULL,
                want_k ? tp_tensor_data(g[1]) : NULL, want_v ? tp_tensor_data(g[2]) : NULL);
        }
        tp_tensor_release(delta);
        for (int i = 0; i < 4; i++)
            tp_tensor_release(tmp[i]);
        return st;
    }
    tp_tensor *ds = NULL;
    int64_t dsshape[2] = {m.M, m.Sk};
    if (st == TP_OK && (want_q || want_k))
        st = tp__new(dt, op->dev, 2, dsshape, false, &ds);
    const void *qd = tp_tensor_data(in[0]), *kd = tp_tensor_data(in[1]),
               *vd = tp_tensor_data(in[2]), *pd = tp_tensor_data(op->saved[0]),
               *god = tp_tensor_data(gy);
    void *dsd = ds ? tp_tensor_data(ds) : NULL;
    for (int64_t b = 0; b < m.G && st == TP_OK; b++) {
        const void *pb = at(dt, pd, b * m.M * m.Sk), *gob = at(dt, god, b * m.M * m.Dv);
        const void *qb = at(dt, qd, b * m.M * m.D), *kb = at(dt, kd, b * m.k_gs);
        if (want_v)
            st = gemm(op, true, false, m.Sk, m.Dv, m.M, 1.0f, pb, m.Sk, gob, m.Dv,
                      at(dt, tp_tensor_data(g[2]), b * m.Sk * m.Dv), m.Dv);
        if (st != TP_OK || !ds)
            continue;
        st = gemm(op, false, true, m.M, m.Sk, m.Dv, 1.0f, gob, m.Dv, at(dt, vd, b * m.v_gs),
                  m.v_ld, dsd, m.Sk);
        if (st == TP_OK && m.M > 0 && m.Sk > 0)
            st = op->k->softmax_bwd(op->dev, dt, pb, dsd, dsd, m.M, m.Sk);
        if (st == TP_OK && want_q)
            st = gemm(op, false, false, m.M, m.D, m.Sk, m.scale, dsd, m.Sk, kb, m.k_ld,
                      at(dt, tp_tensor_data(g[0]), b * m.M * m.D), m.D);
        if (st == TP_OK && want_k)
            st = gemm(op, true, false, m.Sk, m.D, m.M, m.scale, dsd, m.Sk, qb, m.D,
                      at(dt, tp_tensor_data(g[1]), b * m.Sk * m.D), m.D);
    }
    tp_tensor_release(ds);
    for (int i = 0; i < 4; i++)
        tp_tensor_release(tmp[i]);
    return st;
}

static const tp__op_def sdpa_def = {
    .name = "scaled_dot_product_attention",
    .n_inputs = 4,
    .input_names = {"q", "k", "v", "key_padding"},
    .optional_mask = 1u << 3,
    .nondiff_mask = 1u << 3,
    .dtype_kernel = TP__KOP_ATTN_SOFTMAX,
    .strided_ok = true, /* sdpa_layout reads views or copies them */
    .strategies = sdpa_strategies,
    .out_shape = sdpa_shape,
    .forward = sdpa_fwd,
    .backward = sdpa_bwd,
};

/* All the argument checks, on the global shapes (a DTensor's shape is its
 * logical one), before anything is redistributed. */
static tp_status sdpa_check(const tp_tensor *q, const tp_tensor *k, const tp_tensor *v,
                            const tp_sdpa_options *o)
{
    TP_ARG_CHECK(q, "%s: q is NULL", FN);
    TP_ARG_CHECK(k, "%s: k is NULL", FN);
    TP_ARG_CHECK(v, "%s: v is NULL", FN);
    TP_ARG_CHECK(o->scale >= 0, "%s: scale %g is negative", FN, o->scale);
    TP_ARG_CHECK(o->backend == TP_SDPA_BACKEND_AUTO || o->backend == TP_SDPA_BACKEND_MATH ||
                     o->backend == TP_SDPA_BACKEND_FLASH,
                 "%s: backend %d is none of TP_SDPA_BACKEND_AUTO, _MATH, _FLASH", FN,
                 (int)o->backend);
    TP_ARG_CHECK(o->key_offset >= 0, "%s: key_offset %lld is negative", FN,
                 (long long)o->key_offset);
    int nd = q->ndim, hd = head_dim_of(nd);
    TP_ARG_CHECK(nd >= 2, "%s: q must have at least 2 dims [..., seq, head_dim], it has %d", FN,
                 nd);
    const tp_tensor *kv[2] = {k, v};
    const char *names[2] = {"k", "v"};
    char b1[96], b2[96];
    for (int i = 0; i < 2; i++) {
        TP_ARG_CHECK(kv[i]->ndim == nd, "%s: %s has %d dims, q has %d", FN, names[i],
                     kv[i]->ndim, nd);
        int nlead = hd >= 0 ? hd : nd - 2;
        for (int d = 0; d < nlead; d++)
            TP_ARG_CHECK(kv[i]->shape[d] == q->shape[d],
                         "%s: q, k and v must have the same leading dims: q %s, %s %s", FN,
                         tp__shape_str(nd, q->shape, b1, sizeof b1), names[i],
                         tp__shape_str(nd, kv[i]->shape, b2, sizeof b2));
    }
    TP_ARG_CHECK(k->shape[nd - 1] == q->shape[nd - 1],
                 "%s: q and k must have the same head_dim: q %s, k %s", FN,
                 tp__shape_str(nd, q->shape, b1, sizeof b1),
                 tp__shape_str(nd, k->shape, b2, sizeof b2));
    TP_ARG_CHECK(v->shape[nd - 2] == k->shape[nd - 2],
                 "%s: k has %lld keys but v has %lld (k %s, v %s)", FN,
                 (long long)k->shape[nd - 2], (long long)v->shape[nd - 2],
                 tp__shape_str(nd, k->shape, b1, sizeof b1),
                 tp__shape_str(nd, v->shape, b2, sizeof b2));
    if (hd >= 0) {
        int64_t hq = q->shape[hd], hkv = k->shape[hd];
        TP_ARG_CHECK(v->shape[hd] == hkv, "%s: k has %lld key/value heads but v has %lld", FN,
                     (long long)hkv, (long long)v->shape[hd]);
        TP_ARG_CHECK(hkv > 0 ? hq % hkv == 0 : hq == 0,
                     "%s: %lld query heads are not a multiple of %lld key/value heads", FN,
                     (long long)hq, (long long)hkv);
    }
    const tp_tensor *pad = o->key_padding;
    if (pad) {
        TP_ARG_CHECK(nd == 4, "%s: key_padding needs 4-D q [batch, heads, seq, head_dim], q is %s",
                     FN, tp__shape_str(nd, q->shape, b1, sizeof b1));
        TP_ARG_CHECK(pad->dtype == TP_I64 || pad->dtype == TP_I32,
                     "%s: key_padding is %s; it must be i64 or i32 (0 = padding)", FN,
                     tp_dtype_name(pad->dtype));
        int64_t want[2] = {q->shape[0], k->shape[2]};
        TP_ARG_CHECK(pad->ndim == 2 && pad->shape[0] == want[0] && pad->shape[1] == want[1],
                     "%s: key_padding is %s, expected [batch, keys] = %s", FN,
                     tp__shape_str(pad->ndim, pad->shape, b1, sizeof b1),
                     tp__shape_str(2, want, b2, sizeof b2));
    }
    return TP_OK;
}

tp_status tp__sdpa_with_capacity(tp_tensor *q, tp_tensor *k, tp_tensor *v,
                                 const tp_sdpa_options *opts, int64_t key_capacity,
                                 tp_tensor **out)
{
    TP_ARG_CHECK(out, "%s: out is NULL", FN);
    *out = NULL;
    const tp_sdpa_options o = opts ? *opts : (tp_sdpa_options){0};
    TP_CHECK(sdpa_check(q, k, v, &o));
    sdpa_params p = {o.causal, o.scale, o.key_offset, key_capacity, o.backend, false};
    tp_tensor *args[4] = {q, k, v, o.key_padding};
    return tp__op_run(&sdpa_def, args, &p, sizeof p, out);
}

tp_status tp_scaled_dot_product_attention_with(tp_tensor *q, tp_tensor *k, tp_tensor *v,
                                               const tp_sdpa_options *opts, tp_tensor **out)
{
    return tp__sdpa_with_capacity(q, k, v, opts, 0, out);
}

tp_status tp_scaled_dot_product_attention(tp_tensor *q, tp_tensor *k, tp_tensor *v, bool causal,
                                          double scale, tp_tensor **out)
{
    tp_sdpa_options o = {.causal = causal, .scale = scale};
    return tp_scaled_dot_product_attention_with(q, k, v, &o, out);
}
