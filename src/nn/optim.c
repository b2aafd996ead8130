/* Deterministic initialisation, state dicts, SGD and Adam. Parameters are
 * reached through the module's parameter walk, so the FQNs here are the ones
 * users see.
 *
 * Tied parameters. A tensor registered under several names (an Embedding's
 * weight reused by the output Linear) is one parameter: the optimizers and
 * the initialisation see it once, under its first name (what
 * tp_module_named_parameters reports), while state dicts list every name.
 * Handles over the same storage region with the same layout (tp__param_same)
 * are one parameter too: each holds its own gradient, and the step applies
 * their sum once (for SGD that is what stepping each would give; for Adam it
 * is the only result equal to the single-parameter model). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/meta_mem.h"
#include "kernels/kernels.h"
#include "nn/nn_internal.h"

/* ---- helpers ---------------------------------------------------------------- */

/* A parameter list: (FQN, tensor) pairs in named_parameters order, and for a
 * unique list which entries are one parameter. */
typedef struct {
    char *fqn;
    tp_tensor *t; /* borrowed: the module holds it */
} tp__pentry;

typedef struct {
    tp__pentry *e;
    int n;
    size_t cap;
    int *rep;  /* unique lists: the first entry of i's parameter (rep[i] <= i) */
    int *next; /* unique lists: the next entry of i's parameter, -1 after the last */
} tp__plist;

static tp_status tp__plist_add(const char *fqn, tp_tensor *t, void *ctx)
{
    tp__plist *l = ctx;
    if (!tp__grow_array((void **)&l->e, (size_t)l->n, &l->cap, sizeof *l->e))
        return tp__error(TP_ERR_NO_MEMORY, "out of memory listing parameters");
    if (!(l->e[l->n].fqn = tp__strdup(fqn)))
        return tp__error(TP_ERR_NO_MEMORY, "out of memory listing parameters");
    l->e[l->n++].t = t;
    return TP_OK;
}

static void tp__plist_free(tp__plist *l)
{
    for (int i = 0; i < l->n; i++)
        tp__free(l->e[i].fqn);
    tp__free(l->e);
    tp__free(l->rep);
    tp__free(l->next);
    *l = (tp__plist){0};
}

static bool tp__same_placements(const tp_tensor *a, const tp_tensor *b)
{
    int md = tp_mesh_ndim(tp_dtensor_mesh(a));
    if (tp_dtensor_mesh(a) != tp_dtensor_mesh(b))
        return false;
    const tp_placement *pa = tp_dtensor_placements(a), *pb = tp_dtensor_placements(b);
    for (int d = 0; d < md; d++) {
        if (pa[d].kind != pb[d].kind)
            return false;
        if (pa[d].kind == TP_PLACEMENT_SHARD && pa[d].dim != pb[d].dim)
            return false;
        if (pa[d].kind == TP_PLACEMENT_PARTIAL && pa[d].op != pb[d].op)
            return false;
    }
    return true;
}

static bool tp__same_shape(const tp_tensor *a, const tp_tensor *b)
{
    return a->ndim == b->ndim && !memcmp(a->shape, b->shape, (size_t)a->ndim * sizeof *a->shape);
}

/* The tensor that holds this rank's values: the local shard of a DTensor,
 * the tensor itself otherwise. */
static tp_tensor *tp__storage_of(const tp_tensor *t)
{
    return tp_tensor_is_dtensor(t) ? tp_dtensor_local(t) : (tp_tensor *)t;
}

bool tp__param_same(const tp_tensor *a, const tp_tensor *b)
{
    if (a == b)
        return true;
    if (!a || !b || tp_tensor_is_dtensor(a) != tp_tensor_is_dtensor(b))
        return false;
    const tp_tensor *la = tp__storage_of(a), *lb = tp__storage_of(b);
    /* the cheap test first: most pairs are apart. Meta tensors have no
     * storage: only the same handle is the same */
    if (!la->storage || la->storage != lb->storage || la->offset != lb->offset)
        return false;
    if (a->dtype != b->dtype || !tp__same_shape(a, b))
        return false;
    if (a != la && (!tp__same_placements(a, b) || !tp__same_shape(la, lb)))
        return false;
    return !memcmp(la->stride, lb->stride, (size_t)la->ndim * sizeof *la->stride);
}

/* Where a parameter's elements start: handles that are one parameter
 * (tp__param_same) have the same key. */
typedef struct {
    uintptr_t storage; /* a meta tensor, without storage: the handle itself */
    int64_t offset;
    int i; /* the entry */
} tp__pkey;

static int tp__pkey_cmp(const void *pa, const void *pb)
{
    const tp__pkey *a = pa, *b = pb;
    if (a->storage != b->storage)
        return a->storage < b->storage ? -1 : 1;
    if (a->offset != b->offset)
        return a->offset < b->offset ? -1 : 1;
    return (a->i > b->i) - (a->i < b->i);
}

/* rep[] and next[] of a unique list: entries sorted by where their elements
 * start, so that only the few handles starting at one place are compared
 * (a pairwise scan of every entry costs milliseconds per step at thousands
 * of parameters). */
static tp_status tp__plist_group(tp__plist *l)
{
    size_t n = l->n ? (size_t)l->n : 1;
    tp__pkey *key = tp__malloc(n * sizeof *key);
    int *last = tp__malloc(n * sizeof *last);
    l->rep = tp__malloc(n * sizeof *l->rep);
    l->next = tp__malloc(n * sizeof *l->next);
    tp_status st = TP_OK;
    if (!key || !last || !l->rep || !l->next) {
        st = tp__error(TP_ERR_NO_MEMORY, "out of memory listing parameters");
        goto done;
    }
    for (int i = 0; i < l->n; i++) {
        const tp_tensor *loc = tp__storage_of(l->e[i].t);
        key[i] = loc->storage ? (tp__pkey){(uintptr_t)loc->storage, loc->offset, i}
                              : (tp__pkey){(uintptr_t)l->e[i].t, 0, i};
        l->rep[i] = i;
        l->next[i] = -1;
        last[i] = i;
    }
    qsort(key, (size_t)l->n, sizeof *key, tp__pkey_cmp);
    for (int a = 0, b; a < l->n; a = b) {
        b = a + 1;
        while (b < l->n && key[b].storage == key[a].storage && key[b].offset == key[a].offset)
            b++;
        /* one start, entries in list order: each joins the first earlier
         * parameter it is (tp__param_same is an equivalence) */
        for (int p = a + 1; p < b; p++) {
            int i = key[p].i;
            for (int q = a; q < p; q++) {
                int j = key[q].i;
                if (l->rep[j] == j && tp__param_same(l->e[j].t, l->e[i].t)) {
                    l->rep[i] = j;
                    l->next[last[j]] = i;
                    last[j] = i;
                    break;
                }
            }
        }
    }
done:
    tp__free(key);
    tp__free(last);
    return st;
}

/* unique: each tensor once, with rep[] and next[] grouping the handles that
 * are one parameter; otherwise every name (state dicts). */
static tp_status tp__plist_of(const char *fn, tp_module *m, bool unique, tp__plist *l)
{
    *l = (tp__plist){0};
    tp_status st = tp__module_walk_params(m, unique, tp__plist_add, l);
    if (st == TP_OK && unique)
        st = tp__plist_group(l);
    if (st != TP_OK) {
        tp__error_prefix("%s", fn);
        tp__plist_free(l);
    }
    return st;
}

/* This rank's block of a parameter: local shape and offset in the global
 * tensor. */
static tp_status tp__block_of(const char *fn, const char *fqn, tp_tensor *p, int64_t *shape,
                              int64_t *offset)
{
    int nd = tp_tensor_ndim(p);
    if (!tp_tensor_is_dtensor(p)) {
        memcpy(shape, tp_tensor_shape(p), (size_t)nd * sizeof *shape);
        memset(offset, 0, (size_t)nd * sizeof *offset);
        return TP_OK;
    }
    tp_mesh *mesh = tp_dtensor_mesh(p);
    const tp_placement *pl = tp_dtensor_placements(p);
    int md = tp_mesh_ndim(mesh);
    for (int d = 0; d < md; d++)
        if (pl[d].kind == TP_PLACEMENT_PARTIAL)
            return tp__error(TP_ERR_NOT_SUPPORTED,
                             "%s: parameter '%s' has a Partial placement on mesh dim %d", fn,
                             fqn, d);
    tp_status st = tp_dtensor_shard_extent(mesh, nd, tp_tensor_shape(p), md, pl, NULL, shape,
                                           offset);
    if (st != TP_OK)
        tp__error_prefix("%s: parameter '%s'", fn, fqn);
    return st;
}

/* ---- initialisation ------------------------------------------------------- */

static uint64_t tp__mix64(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

/* FNV-1a over the FQN, started from the mixed seed, finished with a mix so
 * that near FQNs ("net1.weight", "net2.weight") give unrelated streams. */
static uint64_t tp__param_seed(uint64_t seed, const char *fqn)
{
    uint64_t h = 0xcbf29ce484222325ull ^ tp__mix64(seed);
    for (const unsigned char *c = (const unsigned char *)fqn; *c; c++) {
        h ^= *c;
        h *= 0x100000001b3ull;
    }
    return tp__mix64(h);
}

typedef struct {
    tp_module *root;
    uint64_t seed;
} tp__init_ctx;

static tp_status tp__init_one(const char *fqn, tp_tensor *p, void *vctx)
{
    const char *fn = "tp_module_init";
    tp__init_ctx *c = vctx;

    /* the owner decides the distribution: split the FQN at its last dot */
    const char *dot = strrchr(fqn, '.');
    const char *local_name = dot ? dot + 1 : fqn;
    tp_module *owner = c->root;
    if (dot) {
        size_t n = (size_t)(dot - fqn);
        char *prefix = tp__malloc(n + 1);
        if (!prefix)
            return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
        memcpy(prefix, fqn, n);
        prefix[n] = '\0';
        owner = tp_module_find(c->root, prefix);
        tp__free(prefix);
        TP_ASSERT(owner);
    }

    bool constant = false;
    double value = 0, a = -0.1, b = 0.1;
    tp_rng_dist dist = TP_RNG_UNIFORM;
    switch (owner->kind) {
    case TP_MODULE_LINEAR: {
        int64_t in = owner->cfg.linear.in;
        double bound = in > 0 ? 1.0 / sqrt((double)in) : 0.0;
        a = -bound;
        b = bound;
        break;
    }
    case TP_MODULE_EMBEDDING:
        dist = TP_RNG_NORMAL;
        a = 0;
        b = 1;
        break;
    case TP_MODULE_LAYER_NORM:
    case TP_MODULE_RMS_NORM:
        constant = true;
        value = strcmp(local_name, "weight") == 0 ? 1.0 : 0.0;
        break;
    default:
        break; /* custom parameters: uniform(-0.1, 0.1) */
    }

    int64_t shape[TP_MAX_DIMS], offset[TP_MAX_DIMS];
    TP_CHECK(tp__block_of(fn, fqn, p, shape, offset));
    tp_tensor *dst = tp__storage_of(p);
    tp_status st = constant ? tp_tensor_fill(dst, value)
                            : tp_tensor_fill_random(dst, dist, a, b, tp__param_seed(c->seed, fqn),
                                                    tp_tensor_shape(p), offset);
    if (st != TP_OK)
        tp__error_prefix("%s: parameter '%s'", fn, fqn);
    return st;
}

/* A tied parameter is initialised once, from its first FQN and the module
 * that registered it there. */
tp_status tp_module_init(tp_module *m, uint64_t seed)
{
    const char *fn = "tp_module_init";
    TP_ARG_CHECK(m, "%s: module is NULL", fn);
    tp__init_ctx c = {m, seed};
    tp__plist l;
    TP_CHECK(tp__plist_of(fn, m, true, &l));
    tp_status st = TP_OK;
    for (int i = 0; i < l.n && st == TP_OK; i++)
        if (l.rep[i] == i)
            st = tp__init_one(l.e[i].fqn, l.e[i].t, &c);
    tp__plist_free(&l);
    return st;
}

/* ---- state dicts ----------------------------------------------------------- */

/* Appends to a bounded message (silently stops at the end). */
static void tp__msg_add(char *buf, size_t len, const char *s)
{
    size_t used = strlen(buf);
    if (used + 1 >= len)
        return;
    size_t n = strlen(s);
    if (n > len - used - 1)
        n = len - used - 1;
    memcpy(buf + used, s, n);
    buf[used + n] = '\0';
}

tp_status tp_module_load_state_dict(tp_module *m, int n, const char *const *names,
                                    tp_tensor *const *values, bool strict)
{
    const char *fn = "tp_module_load_state_dict";
    TP_ARG_CHECK(m, "%s: module is NULL", fn);
    TP_ARG_CHECK(n >= 0, "%s: n %d is negative", fn, n);
    TP_ARG_CHECK(n == 0 || (names && values), "%s: names or values is NULL with n = %d", fn, n);
    for (int i = 0; i < n; i++) {
        TP_ARG_CHECK(names[i], "%s: names[%d] is NULL", fn, i);
        TP_ARG_CHECK(values[i], "%s: the value of '%s' is NULL", fn, names[i]);
        TP_ARG_CHECK(!tp_tensor_is_dtensor(values[i]),
                     "%s: the value of '%s' is a DTensor; pass the full tensor "
                     "(tp_dtensor_full_tensor)", fn, names[i]);
    }

    tp__plist l; /* every name: a tied weight is loaded under each (the last wins) */
    TP_CHECK(tp__plist_of(fn, m, false, &l));
    tp_status st = TP_OK;
    int *match = tp__malloc((size_t)(n ? n : 1) * sizeof *match);
    bool *named = tp__calloc((size_t)(l.n ? l.n : 1), sizeof *named);
    if (!match || !named) {
        st = tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
        goto done;
    }

    /* Every check before any copy: a refused load leaves the module as it
     * was. */
    char unknown[512] = "", missing[512] = "";
    for (int i = 0; i < n; i++) {
        match[i] = -1;
        for (int j = 0; j < l.n; j++)
            if (!strcmp(names[i], l.e[j].fqn)) {
                match[i] = j;
                break;
            }
        if (match[i] < 0) {
            if (unknown[0])
                tp__msg_add(unknown, sizeof unknown, ", ");
            tp__msg_add(unknown, sizeof unknown, names[i]);
            continue;
        }
        named[match[i]] = true;
        tp_tensor *p = l.e[match[i]].t;
        int nd = tp_tensor_ndim(p);
        if (tp_tensor_ndim(values[i]) != nd ||
            memcmp(tp_tensor_shape(values[i]), tp_tensor_shape(p), (size_t)nd * sizeof(int64_t))) {
            char a[128], b[128];
            st = tp__error(TP_ERR_INVALID_ARG,
                           "%s: the value of '%s' has shape %s, the parameter has %s", fn,
                           names[i],
                           tp__shape_str(tp_tensor_ndim(values[i]), tp_tensor_shape(values[i]),
                                         a, sizeof a),
                           tp__shape_str(nd, tp_tensor_shape(p), b, sizeof b));
            goto done;
        }
        int64_t shape[TP_MAX_DIMS], offset[TP_MAX_DIMS];
        TP_CHECK_GOTO(tp__block_of(fn, names[i], p, shape, offset), st, done);
    }
    for (int j = 0; j < l.n; j++)
        if (!named[j]) {
            if (missing[0])
                tp__msg_add(missing, sizeof missing, ", ");
            tp__msg_add(missing, sizeof missing, l.e[j].fqn);
        }
    if (strict && (unknown[0] || missing[0])) {
        st = tp__error(TP_ERR_INVALID_ARG, "%s: %s%s%s%s%s", fn,
                       unknown[0] ? "unknown names: " : "", unknown,
                       unknown[0] && missing[0] ? "; " : "",
                       missing[0] ? "missing parameters: " : "", missing);
        goto done;
    }

    for (int i = 0; i < n && st == TP_OK; i++) {
        if (match[i] < 0)
            continue;
        tp_tensor *p = l.e[match[i]].t;
        int64_t shape[TP_MAX_DIMS], offset[TP_MAX_DIMS];
        TP_CHECK_GOTO(tp__block_of(fn, names[i], p, shape, offset), st, done);
        /* this rank's block of the full value: narrow every dim */
        tp_tensor *src = tp_tensor_retain(values[i]);
        for (int d = 0; d < tp_tensor_ndim(p) && st == TP_OK; d++) {
            tp_tensor *v = NULL;
            st = tp_tensor_narrow(src, d, offset[d], shape[d], &v);
            tp_tensor_release(src);
            src = v;
        }
        if (st == TP_OK)
            st = tp_tensor_copy(tp__storage_of(p), src);
        tp_tensor_release(src);
        if (st != TP_OK)
            tp__error_prefix("%s: '%s'", fn, names[i]);
    }

done:
    tp__free(match);
    tp__free(named);
    tp__plist_free(&l);
    return st;
}

tp_status tp_module_state_dict(tp_module *m,
                               tp_status (*fn)(const char *fqn, tp_tensor *full, void *ctx),
                               void *ctx)
{
    const char *f = "tp_module_state_dict";
    TP_ARG_CHECK(m, "%s: module is NULL", f);
    TP_ARG_CHECK(fn, "%s: fn is NULL", f);
    /* listed first: fn may be anything, the walk stays out of its way; a
     * tied weight is listed under each of its names, as PyTorch does */
    tp__plist l;
    TP_CHECK(tp__plist_of(f, m, false, &l));
    tp_status st = TP_OK;
    for (int i = 0; i < l.n && st == TP_OK; i++) {
        tp_tensor *full = NULL;
        tp_no_grad_begin();
        st = tp_tensor_is_dtensor(l.e[i].t) ? tp_dtensor_full_tensor(l.e[i].t, &full)
                                          : tp_tensor_clone(l.e[i].t, &full);
        tp_no_grad_end();
        if (st != TP_OK) {
            tp__error_prefix("%s: '%s'", f, l.e[i].fqn);
            break;
        }
        st = fn(l.e[i].fqn, full, ctx);
        tp_tensor_release(full);
    }
    tp__plist_free(&l);
    return st;
}

/* ---- optimizers ------------------------------------------------------------ */

/* This rank's gradient block of p as a contiguous f32 CPU tensor (a new
 * reference), or NULL when p has no gradient. A gradient whose layout
 * differs from the parameter's (a Partial one) is redistributed to it
 * first: collective. */
static tp_status tp__local_grad(const char *fn, const char *fqn, tp_tensor *p, tp_tensor **out)
{
    *out = NULL;
    tp_tensor *g = tp_tensor_grad(p);
    if (!g)
        return TP_OK;
    if (tp_tensor_is_dtensor(p) != tp_tensor_is_dtensor(g))
        return tp__error(TP_ERR_STATE, "%s: parameter '%s' is %s but its gradient is %s", fn,
                         fqn, tp_tensor_is_dtensor(p) ? "a DTensor" : "plain",
                         tp_tensor_is_dtensor(g) ? "a DTensor" : "plain");
    tp_tensor *gl = NULL;
    tp_status st = TP_OK;
    if (tp_tensor_is_dtensor(p) && !tp__same_placements(p, g)) {
        tp_tensor *r = NULL;
        tp_no_grad_begin();
        st = tp_dtensor_redistribute(g, tp_mesh_ndim(tp_dtensor_mesh(p)),
                                     tp_dtensor_placements(p), &r);
        tp_no_grad_end();
        if (st != TP_OK) {
            tp__error_prefix("%s: reducing the gradient of '%s'", fn, fqn);
            return st;
        }
        gl = tp_tensor_retain(tp_dtensor_local(r));
        tp_tensor_release(r);
    } else {
        gl = tp_tensor_retain(tp__storage_of(g));
    }
    tp_tensor *pl = tp__storage_of(p);
    if (tp_tensor_ndim(gl) != tp_tensor_ndim(pl) ||
        memcmp(tp_tensor_shape(gl), tp_tensor_shape(pl),
               (size_t)tp_tensor_ndim(pl) * sizeof(int64_t))) {
        tp_tensor_release(gl);
        return tp__error(TP_ERR_STATE, "%s: the gradient of '%s' does not match its shape", fn,
                         fqn);
    }
    tp_device pd = tp_tensor_device(pl), gd = tp_tensor_device(gl);
    if (tp_tensor_dtype(gl) != TP_F32 || !tp__device_eq(gd, pd) || !tp_tensor_is_contiguous(gl)) {
        /* the update reads the gradient where the parameter lives */
        tp_tensor *c = NULL;
        st = tp_tensor_to(gl, TP_F32, pd, &c);
        tp_tensor_release(gl);
        if (st != TP_OK)
            return st;
        gl = c;
    }
    *out = gl;
    return TP_OK;
}

/* The gradient of parameter i of a unique list: the sum of the local
 * gradients of its handles (tp__local_grad each), NULL when none has one. */
static tp_status tp__param_grad(const char *fn, const tp__plist *l, int i, tp_tensor **out)
{
    *out = NULL;
    tp_tensor *sum = NULL;
    for (int k = i; k >= 0; k = l->next[k]) {
        tp_tensor *g = NULL;
        tp_status st = tp__local_grad(fn, l->e[k].fqn, l->e[k].t, &g);
        if (st == TP_OK && g && sum) {
            tp_tensor *s = NULL;
            tp_no_grad_begin();
            st = tp_add(sum, g, &s);
            tp_no_grad_end();
            if (st != TP_OK)
                tp__error_prefix("%s: adding the gradients of '%s' and '%s'", fn, l->e[i].fqn,
                                 l->e[k].fqn);
            tp_tensor_release(g);
            g = s;
        }
        if (st != TP_OK) {
            tp_tensor_release(g);
            tp_tensor_release(sum);
            return st;
        }
        if (g) {
            tp_tensor_release(sum);
            sum = g;
        }
    }
    *out = sum;
    return TP_OK;
}

/* ---- one step over the parameters -------------------------------------------------- */

/* g / scale into a new f32 tensor (the grad scaler's unscaling, fused into
 * the step: a low-precision gradient is never stored unscaled). */
static tp_status tp__unscale(tp_tensor **g, float inv_scale)
{
    tp_device dev = tp_tensor_device(*g);
    const tp__kernels *k = NULL;
    tp_tensor *y = NULL;
    TP_CHECK(tp__kernels_for(dev, &k));
    TP_CHECK(tp_tensor_empty(TP_F32, dev, tp_tensor_ndim(*g), tp_tensor_shape(*g), &y));
    tp_status st =
        k->scale(dev, TP_F32, tp_tensor_data(*g), inv_scale, tp_tensor_data(y), tp_tensor_numel(y));
    if (st != TP_OK) {
        tp_tensor_release(y);
        return st;
    }
    tp_tensor_release(*g);
    *g = y;
    return TP_OK;
}

/*
 * Per-parameter state, keyed by the parameter's (first) FQN and created at
 * its first step with a gradient (as torch.optim's lazy state). Found by
 * the parameter's tensor (the list's first handle), checked against the
 * FQN: a step finds every state in O(log n).
 *
 * Master weights. A bf16/f16 parameter gets an f32 copy of its local block
 * (`master`, made from the parameter at that first step): the update runs
 * on it with the f32 kernel, and the parameter is written from it, rounded
 * once per step. Updates smaller than half a bf16/f16 ulp accumulate in the
 * master instead of being rounded away one by one.
 */
typedef struct {
    char *fqn;
    tp_tensor *param;  /* retained: a replaced parameter is detected, not updated */
    tp_tensor *master; /* f32, the local block's shape; NULL for an f32 parameter */
    tp_tensor *m, *v;  /* Adam's moments, f32; NULL for SGD */
    int64_t step;
} tp__pstate;

/* Sorted views of the states made before this step. */
typedef struct {
    const void *key; /* the state's param, or its fqn */
    int i;           /* the state */
} tp__pindex;

typedef struct {
    bool moments; /* Adam: every parameter has a state with m and v */
    bool always;  /* SGD with momentum: every parameter has a state (m made at its first step) */
    int n;
    size_t cap;
    tp__pstate *s;
    int n_indexed; /* states [0, n_indexed) are in the views */
    tp__pindex *by_param, *by_fqn;
} tp__pstates;

static void tp__pstates_free(tp__pstates *ps)
{
    for (int i = 0; i < ps->n; i++) {
        tp__free(ps->s[i].fqn);
        tp_tensor_release(ps->s[i].param);
        tp_tensor_release(ps->s[i].master);
        tp_tensor_release(ps->s[i].m);
        tp_tensor_release(ps->s[i].v);
    }
    tp__free(ps->s);
    tp__free(ps->by_param);
    tp__free(ps->by_fqn);
}

static int tp__pindex_param_cmp(const void *pa, const void *pb)
{
    uintptr_t a = (uintptr_t)((const tp__pindex *)pa)->key;
    uintptr_t b = (uintptr_t)((const tp__pindex *)pb)->key;
    return (a > b) - (a < b);
}

static int tp__pindex_fqn_cmp(const void *pa, const void *pb)
{
    return strcmp(((const tp__pindex *)pa)->key, ((const tp__pindex *)pb)->key);
}

/* Brings the views up to the states made by earlier steps. */
static tp_status tp__pstates_index(tp__pstates *ps, const char *fn)
{
    if (ps->n_indexed == ps->n)
        return TP_OK;
    size_t n = (size_t)ps->n;
    tp__pindex *p = tp__malloc(n * sizeof *p), *f = tp__malloc(n * sizeof *f);
    if (!p || !f) {
        tp__free(p);
        tp__free(f);
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    }
    for (int i = 0; i < ps->n; i++) {
        p[i] = (tp__pindex){ps->s[i].param, i};
        f[i] = (tp__pindex){ps->s[i].fqn, i};
    }
    qsort(p, n, sizeof *p, tp__pindex_param_cmp);
    qsort(f, n, sizeof *f, tp__pindex_fqn_cmp);
    tp__free(ps->by_param);
    tp__free(ps->by_fqn);
    ps->by_param = p;
    ps->by_fqn = f;
    ps->n_indexed = ps->n;
    return TP_OK;
}

/* The entry of a view whose key is key, or NULL. */
static const tp__pindex *tp__pindex_find(const tp__pindex *v, int n, const void *key,
                                         int (*cmp)(const void *, const void *))
{
    tp__pindex k = {key, -1};
    return n ? bsearch(&k, v, (size_t)n, sizeof *v, cmp) : NULL;
}

static tp_status tp__pstate_new(const char *fn, tp__pstates *ps, const char *fqn, tp_tensor *p,
                                tp__pstate **out)
{
    if (!tp__grow_array((void **)&ps->s, (size_t)ps->n, &ps->cap, sizeof *ps->s))
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    tp_tensor *pl = tp__storage_of(p);
    tp_device dev = tp_tensor_device(pl); /* states live with the parameter */
    int nd = tp_tensor_ndim(pl);
    const int64_t *shape = tp_tensor_shape(pl);
    tp__pstate st = {0};
    st.fqn = tp__strdup(fqn);
    tp_status rc = st.fqn ? TP_OK : tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    if (rc == TP_OK && tp_tensor_dtype(pl) != TP_F32)
        rc = tp_tensor_to(pl, TP_F32, dev, &st.master);
    if (rc == TP_OK && ps->moments)
        rc = tp_tensor_zeros(TP_F32, dev, nd, shape, &st.m);
    if (rc == TP_OK && ps->moments)
        rc = tp_tensor_zeros(TP_F32, dev, nd, shape, &st.v);
    if (rc != TP_OK) {
        tp__free(st.fqn);
        tp_tensor_release(st.master);
        tp_tensor_release(st.m);
        tp_tensor_release(st.v);
        return rc;
    }
    /* memory accounting on meta, in the parameter's module */
    tp__meta_mem_tag_owner(st.master, TP_MEM_MASTER, fqn);
    tp__meta_mem_tag_owner(st.m, TP_MEM_OPTIMIZER, fqn);
    tp__meta_mem_tag_owner(st.v, TP_MEM_OPTIMIZER, fqn);
    st.param = tp_tensor_retain(p);
    ps->s[ps->n] = st;
    *out = &ps->s[ps->n++];
    return TP_OK;
}

/* The state of parameter p (first FQN fqn), made at its first step; *out
 * stays NULL when p needs none (an f32 parameter of a stateless update). */
static tp_status tp__pstate_of(const char *fn, tp__pstates *ps, const char *fqn, tp_tensor *p,
                               tp__pstate **out)
{
    *out = NULL;
    /* the parameter's own state, unless the tree changed its first FQN */
    const tp__pindex *e = tp__pindex_find(ps->by_param, ps->n_indexed, p, tp__pindex_param_cmp);
    if (!e || strcmp(ps->s[e->i].fqn, fqn) != 0)
        e = tp__pindex_find(ps->by_fqn, ps->n_indexed, fqn, tp__pindex_fqn_cmp);
    if (e) {
        if (ps->s[e->i].param != p)
            return tp__error(TP_ERR_STATE,
                             "%s: parameter '%s' was replaced after its first step; create "
                             "the optimizer after parallelizing (or casting) the module",
                             fn, fqn);
        *out = &ps->s[e->i];
        return TP_OK;
    }
    if (!ps->moments && !ps->always && tp_tensor_dtype(p) == TP_F32)
        return TP_OK;
    return tp__pstate_new(fn, ps, fqn, p, out);
}

/* Applies an update to one parameter's f32 values w given its f32 gradient
 * g (both contiguous, on the parameter's device); s is its state (NULL for
 * a stateless one). */
typedef tp_status (*tp__update_fn)(void *opt, tp__pstate *s, tp_tensor *w, tp_tensor *g);

/* One parameter: the update runs on f32 values, that is the master (with
 * a state), the parameter's storage itself (f32 and contiguous), or an f32
 * copy; whatever is not the storage is written back into it, rounded once
 * to the parameter's dtype. */
static tp_status tp__step_param(const char *fn, tp__pstates *ps, const tp__pentry *e, tp_tensor *g,
                                tp__update_fn update, void *opt)
{
    tp_tensor *pl = tp__storage_of(e->t), *w = NULL;
    tp_dtype dt = tp_tensor_dtype(pl);
    if (dt != TP_F32 && dt != TP_BF16 && dt != TP_F16)
        return tp__error(TP_ERR_NOT_SUPPORTED,
                         "%s: parameter '%s' is %s; parameters must be f32, bf16 or f16", fn,
                         e->fqn, tp_dtype_name(dt));
    tp__pstate *s = NULL;
    if (ps)
        TP_CHECK(tp__pstate_of(fn, ps, e->fqn, e->t, &s));
    tp_status st = TP_OK;
    if (s && s->master)
        w = tp_tensor_retain(s->master);
    else if (dt == TP_F32 && tp_tensor_is_contiguous(pl))
        w = tp_tensor_retain(pl);
    else
        st = tp_tensor_to(pl, TP_F32, tp_tensor_device(pl), &w);
    if (st == TP_OK)
        st = update(opt, s, w, g);
    if (st == TP_OK && w != pl)
        st = tp_tensor_copy(pl, w);
    tp_tensor_release(w);
    return st;
}

/* An optimizer step over m's parameters: the step pre-hooks (a DDP's
 * gradient all_reduces), then each parameter with a gradient once, its
 * gradient (the sum over its handles) in f32 and multiplied by inv_scale. */
static tp_status tp__opt_step(const char *fn, tp_module *m, tp__pstates *ps, float inv_scale,
                              tp__update_fn update, void *opt)
{
    TP_CHECK(tp__module_run_step_hooks(m));
    if (ps)
        TP_CHECK(tp__pstates_index(ps, fn));
    tp__plist l;
    TP_CHECK(tp__plist_of(fn, m, true, &l));
    tp_status st = TP_OK;
    for (int i = 0; i < l.n && st == TP_OK; i++) {
        if (l.rep[i] != i)
            continue; /* another handle of parameter rep[i]: stepped with it */
        tp_tensor *g = NULL;
        st = tp__param_grad(fn, &l, i, &g);
        if (st == TP_OK && g && inv_scale != 1.0f)
            st = tp__unscale(&g, inv_scale);
        if (st == TP_OK && g)
            st = tp__step_param(fn, ps, &l.e[i], g, update, opt);
        tp_tensor_release(g);
    }
    tp__plist_free(&l);
    return st;
}

/* ---- SGD ---------------------------------------------------------------------- */

/*
 * SGD has two faces. tp_sgd_step(module, lr) is stateless, as it always
 * was: it cannot keep master weights between calls without hiding state
 * on the module (whose lifetime, replicas and casts it would then have to
 * follow), so on a bf16/f16 parameter it computes p - lr*g in f32 and
 * rounds p once per step, and an update below half an ulp is lost, as
 * documented. tp_sgd is the same update with state: an object the caller
 * owns, like tp_adam, that keeps the f32 master of every low-precision
 * parameter, so that such updates accumulate. Both share this code.
 */
static tp_status tp__sgd_update(void *opt, tp__pstate *s, tp_tensor *w, tp_tensor *g)
{
    (void)s;
    double lr = *(const double *)opt;
    tp_device dev = tp_tensor_device(w);
    const tp__kernels *k = NULL;
    TP_CHECK(tp__kernels_for(dev, &k));
    return k->sgd_step(dev, TP_F32, tp_tensor_data(w), tp_tensor_data(g), tp_tensor_numel(w), lr);
}

tp_status tp_sgd_step(tp_module *m, double lr)
{
    const char *fn = "tp_sgd_step";
    TP_ARG_CHECK(m, "%s: module is NULL", fn);
    TP_ARG_CHECK(isfinite(lr) && lr >= 0, "%s: lr %g must be finite and >= 0", fn, lr);
    return tp__opt_step(fn, m, NULL, 1.0f, tp__sgd_update, &lr);
}

/* A new f32 tensor of w's shape on w's device, holding a copy of a when a
 * is not NULL. */
static tp_status tp__f32_like(const tp__kernels *k, tp_tensor *w, tp_tensor *a, tp_tensor **out)
{
    tp_device dev = tp_tensor_device(w);
    TP_CHECK(tp_tensor_empty(TP_F32, dev, tp_tensor_ndim(w), tp_tensor_shape(w), out));
    tp_status st = TP_OK;
    if (a)
        st = k->copy(dev, TP_F32, tp_tensor_data(*out), tp_tensor_data(a), tp_tensor_numel(w));
    if (st != TP_OK) {
        tp_tensor_release(*out);
        *out = NULL;
    }
    return st;
}

/* y += alpha * x (f32, contiguous, n elements each), tmp as scratch: two
 * roundings, as torch's add_(x, alpha=...) on the CPU. */
static tp_status tp__axpy(const tp__kernels *k, tp_device dev, tp_tensor *y, double alpha,
                          tp_tensor *x, tp_tensor *tmp)
{
    int64_t n = tp_tensor_numel(y);
    TP_CHECK(k->scale(dev, TP_F32, tp_tensor_data(x), (float)alpha, tp_tensor_data(tmp), n));
    return k->accumulate(dev, TP_F32, tp_tensor_data(y), tp_tensor_data(tmp), n);
}

/* d = g + wd * w into a new tensor (torch's L2 weight decay,
 * grad.add(param, alpha=weight_decay)); tmp as scratch. */
static tp_status tp__decayed_grad(const tp__kernels *k, tp_tensor *w, tp_tensor *g, double wd,
                                  tp_tensor *tmp, tp_tensor **d)
{
    TP_CHECK(tp__f32_like(k, w, g, d));
    tp_status st = tp__axpy(k, tp_tensor_device(w), *d, wd, w, tmp);
    if (st != TP_OK) {
        tp_tensor_release(*d);
        *d = NULL;
    }
    return st;
}

struct tp_sgd {
    double lr; /* first: tp__sgd_update reads it when there is no momentum nor decay */
    double momentum, dampening, weight_decay;
    bool nesterov;
    tp_module *module;
    tp__pstates st;
};

/* torch.optim.SGD (foreach=False, maximize=False):
 *   d = g + wd p;  buf = d at the first step, else momentum buf + (1-dampening) d;
 *   d = nesterov ? d + momentum buf : buf;  p -= lr d
 * The momentum buffer is f32, in the state's m. */
static tp_status tp__sgdm_update(void *opt, tp__pstate *s, tp_tensor *w, tp_tensor *g)
{
    const tp_sgd *o = opt;
    tp_device dev = tp_tensor_device(w);
    const tp__kernels *k = NULL;
    TP_CHECK(tp__kernels_for(dev, &k));
    int64_t n = tp_tensor_numel(w);
    tp_tensor *tmp = NULL, *d = NULL;
    TP_CHECK(tp__f32_like(k, w, NULL, &tmp));
    tp_status st = TP_OK;
    if (o->weight_decay != 0)
        st = tp__decayed_grad(k, w, g, o->weight_decay, tmp, &d);
    else
        d = tp_tensor_retain(g);
    if (st == TP_OK && o->momentum != 0) {
        if (!s->m) {
            st = tp__f32_like(k, w, d, &s->m);
            tp__meta_mem_tag_owner(s->m, TP_MEM_OPTIMIZER, s->fqn); /* accounting on meta */
        } else {
            st = k->scale(dev, TP_F32, tp_tensor_data(s->m), (float)o->momentum,
                          tp_tensor_data(s->m), n);
            if (st == TP_OK)
                st = tp__axpy(k, dev, s->m, 1.0 - o->dampening, d, tmp);
        }
        if (st == TP_OK && o->nesterov) {
            tp_tensor *dn = NULL;
            st = tp__f32_like(k, w, d, &dn);
            if (st == TP_OK)
                st = tp__axpy(k, dev, dn, o->momentum, s->m, tmp);
            tp_tensor_release(d);
            d = dn;
        } else if (st == TP_OK) {
            tp_tensor_release(d);
            d = tp_tensor_retain(s->m);
        }
    }
    if (st == TP_OK)
        st = k->sgd_step(dev, TP_F32, tp_tensor_data(w), tp_tensor_data(d), n, o->lr);
    if (st == TP_OK && s)
        s->step++;
    tp_tensor_release(d);
    tp_tensor_release(tmp);
    return st;
}

static tp_status tp__sgd_check(const char *fn, const tp_sgd_options *o)
{
    TP_ARG_CHECK(isfinite(o->lr) && o->lr >= 0, "%s: lr %g must be finite and >= 0", fn, o->lr);
    TP_ARG_CHECK(isfinite(o->momentum) && o->momentum >= 0,
                 "%s: momentum %g must be finite and >= 0", fn, o->momentum);
    TP_ARG_CHECK(isfinite(o->dampening), "%s: dampening %g must be finite", fn, o->dampening);
    TP_ARG_CHECK(isfinite(o->weight_decay) && o->weight_decay >= 0,
                 "%s: weight_decay %g must be finite and >= 0", fn, o->weight_decay);
    TP_ARG_CHECK(!o->nesterov || (o->momentum > 0 && o->dampening == 0),
                 "%s: nesterov momentum requires momentum > 0 and dampening 0 (momentum %g, "
                 "dampening %g)",
                 fn, o->momentum, o->dampening);
    return TP_OK;
}

static tp_status tp__sgd_new(const char *fn, tp_module *m, const tp_sgd_options *opts, tp_sgd **out)
{
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    *out = NULL;
    TP_ARG_CHECK(m, "%s: module is NULL", fn);
    tp_sgd_options o = opts ? *opts : (tp_sgd_options){0};
    TP_CHECK(tp__sgd_check(fn, &o));
    tp_sgd *s = tp__calloc(1, sizeof *s);
    if (!s)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    s->lr = o.lr;
    s->momentum = o.momentum;
    s->dampening = o.dampening;
    s->weight_decay = o.weight_decay;
    s->nesterov = o.nesterov;
    s->module = m;
    s->st.always = o.momentum != 0;
    *out = s;
    return TP_OK;
}

tp_status tp_sgd_create(tp_module *m, double lr, tp_sgd **out)
{
    tp_sgd_options o = {.lr = lr};
    return tp__sgd_new("tp_sgd_create", m, &o, out);
}

tp_status tp_sgd_create_with(tp_module *m, const tp_sgd_options *opts, tp_sgd **out)
{
    return tp__sgd_new("tp_sgd_create_with", m, opts, out);
}

tp_status tp__sgd_step_scaled(tp_sgd *opt, float inv_scale)
{
    bool plain = opt->momentum == 0 && opt->weight_decay == 0;
    return tp__opt_step("tp_sgd_opt_step", opt->module, &opt->st, inv_scale,
                        plain ? tp__sgd_update : tp__sgdm_update, opt);
}

tp_status tp_sgd_opt_step(tp_sgd *opt)
{
    TP_ARG_CHECK(opt, "tp_sgd_opt_step: optimizer is NULL");
    return tp__sgd_step_scaled(opt, 1.0f);
}

tp_status tp_sgd_set_lr(tp_sgd *opt, double lr)
{
    TP_ARG_CHECK(opt, "tp_sgd_set_lr: optimizer is NULL");
    TP_ARG_CHECK(isfinite(lr) && lr >= 0, "tp_sgd_set_lr: lr %g must be finite and >= 0", lr);
    opt->lr = lr;
    return TP_OK;
}

double tp_sgd_lr(const tp_sgd *opt)
{
    return opt ? opt->lr : NAN;
}

tp_module *tp__sgd_module(const tp_sgd *opt)
{
    return opt->module;
}

void tp_sgd_free(tp_sgd *opt)
{
    if (!opt)
        return;
    tp__pstates_free(&opt->st);
    tp__free(opt);
}

/* ---- Adam --------------------------------------------------------------------- */

struct tp_adam {
    tp_module *module;
    double lr, beta1, beta2, eps, weight_decay;
    bool decoupled;
    tp__pstates st;
};

static tp_status tp__adam_check(const char *fn, const tp_adam_options *o)
{
    TP_ARG_CHECK(isfinite(o->lr) && o->lr >= 0, "%s: lr %g must be finite and >= 0", fn, o->lr);
    TP_ARG_CHECK(o->beta1 >= 0 && o->beta1 < 1, "%s: beta1 %g must be in [0, 1)", fn, o->beta1);
    TP_ARG_CHECK(o->beta2 >= 0 && o->beta2 < 1, "%s: beta2 %g must be in [0, 1)", fn, o->beta2);
    TP_ARG_CHECK(isfinite(o->eps) && o->eps >= 0, "%s: eps %g must be finite and >= 0", fn, o->eps);
    TP_ARG_CHECK(isfinite(o->weight_decay) && o->weight_decay >= 0,
                 "%s: weight_decay %g must be finite and >= 0", fn, o->weight_decay);
    return TP_OK;
}

static tp_status tp__adam_new(const char *fn, tp_module *m, const tp_adam_options *opts,
                              tp_adam **out)
{
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    *out = NULL;
    TP_ARG_CHECK(m, "%s: module is NULL", fn);
    tp_adam_options o = opts ? *opts : (tp_adam_options){0};
    TP_CHECK(tp__adam_check(fn, &o));
    tp_adam *a = tp__calloc(1, sizeof *a);
    if (!a)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    a->module = m;
    a->lr = o.lr ? o.lr : 1e-3;
    a->beta1 = o.beta1 ? o.beta1 : 0.9;
    a->beta2 = o.beta2 ? o.beta2 : 0.999;
    a->eps = o.eps ? o.eps : 1e-8;
    a->weight_decay = o.weight_decay;
    a->decoupled = o.decoupled;
    a->st.moments = true;
    *out = a;
    return TP_OK;
}

tp_status tp_adam_create(tp_module *m, double lr, double beta1, double beta2, double eps,
                         tp_adam **out)
{
    tp_adam_options o = {.lr = lr, .beta1 = beta1, .beta2 = beta2, .eps = eps};
    return tp__adam_new("tp_adam_create", m, &o, out);
}

tp_status tp_adam_create_with(tp_module *m, const tp_adam_options *opts, tp_adam **out)
{
    return tp__adam_new("tp_adam_create_with", m, opts, out);
}

void tp_adam_free(tp_adam *opt)
{
    if (!opt)
        return;
    tp__pstates_free(&opt->st);
    tp__free(opt);
}

/* torch.optim.Adam / AdamW (foreach=False, amsgrad=False, maximize=False):
 * AdamW first multiplies p by 1 - lr wd; Adam with weight decay adds wd p
 * to the gradient; then p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps). */
static tp_status tp__adam_update(void *opt, tp__pstate *s, tp_tensor *w, tp_tensor *g)
{
    const tp_adam *o = opt;
    s->step++;
    double bc1 = 1.0 - pow(o->beta1, (double)s->step);
    double bc2 = 1.0 - pow(o->beta2, (double)s->step);
    tp_device dev = tp_tensor_device(w); /* m and v live with the parameter */
    const tp__kernels *k = NULL;
    TP_CHECK(tp__kernels_for(dev, &k));
    int64_t n = tp_tensor_numel(w);
    tp_tensor *d = tp_tensor_retain(g), *tmp = NULL;
    tp_status st = TP_OK;
    if (o->weight_decay != 0 && o->decoupled) {
        st = k->scale(dev, TP_F32, tp_tensor_data(w), (float)(1.0 - o->lr * o->weight_decay),
                      tp_tensor_data(w), n);
    } else if (o->weight_decay != 0) {
        tp_tensor_release(d);
        d = NULL;
        st = tp__f32_like(k, w, NULL, &tmp);
        if (st == TP_OK)
            st = tp__decayed_grad(k, w, g, o->weight_decay, tmp, &d);
    }
    if (st == TP_OK)
        st =
            k->adam_step(dev, TP_F32, tp_tensor_data(w), tp_tensor_data(s->m), tp_tensor_data(s->v),
                         tp_tensor_data(d), n, o->beta1, o->beta2, o->lr / bc1, sqrt(bc2), o->eps);
    tp_tensor_release(d);
    tp_tensor_release(tmp);
    return st;
}

tp_status tp__adam_step_scaled(tp_adam *opt, float inv_scale)
{
    return tp__opt_step("tp_adam_step", opt->module, &opt->st, inv_scale, tp__adam_update, opt);
}

tp_status tp_adam_step(tp_adam *opt)
{
    TP_ARG_CHECK(opt, "tp_adam_step: optimizer is NULL");
    return tp__adam_step_scaled(opt, 1.0f);
}

tp_status tp_adam_set_lr(tp_adam *opt, double lr)
{
    TP_ARG_CHECK(opt, "tp_adam_set_lr: optimizer is NULL");
    TP_ARG_CHECK(isfinite(lr) && lr >= 0, "tp_adam_set_lr: lr %g must be finite and >= 0", lr);
    opt->lr = lr;
    return TP_OK;
}

double tp_adam_lr(const tp_adam *opt)
{
    return opt ? opt->lr : NAN;
}

tp_module *tp__adam_module(const tp_adam *opt)
{
    return opt->module;
}

/* ---- what the grad scaler reads (amp.c) ------------------------------------- */

/* Whether local gradient g (any float dtype) holds an inf or a NaN: its f32
 * copy times 0 is 0 where finite and NaN elsewhere, and their sum (in
 * double) is NaN exactly when one was. Kernels only: any device. */
static tp_status tp__nonfinite(tp_tensor *g, bool *found)
{
    tp_device dev = tp_tensor_device(g);
    const tp__kernels *k = NULL;
    tp_tensor *c = NULL, *y = NULL, *h = NULL;
    int64_t one = 1;
    TP_CHECK(tp__kernels_for(dev, &k));
    tp_status st = tp_tensor_to(g, TP_F32, dev, &c);
    if (st == TP_OK)
        st = k->scale(dev, TP_F32, tp_tensor_data(c), 0.0f, tp_tensor_data(c), tp_tensor_numel(c));
    if (st == TP_OK)
        st = tp_tensor_empty(TP_F32, dev, 1, &one, &y);
    if (st == TP_OK)
        st = k->sum_all(dev, TP_F32, tp_tensor_data(c), tp_tensor_numel(c), tp_tensor_data(y), 1.0);
    /* meta (a plan): no values, so nothing is found */
    if (st == TP_OK && dev.type != TP_DEVICE_META)
        st = tp_tensor_to(y, TP_F32, TP_CPU, &h);
    if (st == TP_OK && h && !isfinite(*(const float *)tp_tensor_data(h)))
        *found = true;
    tp_tensor_release(c);
    tp_tensor_release(y);
    tp_tensor_release(h);
    return st;
}

tp_status tp__grads_nonfinite(const char *fn, tp_module *m, bool *found)
{
    *found = false;
    tp__plist l;
    TP_CHECK(tp__plist_of(fn, m, true, &l));
    tp_status st = TP_OK;
    for (int i = 0; i < l.n && st == TP_OK && !*found; i++) {
        tp_tensor *g = tp_tensor_grad(l.e[i].t); /* every handle holds its own */
        if (g && tp_tensor_numel(tp__storage_of(g)) > 0)
            st = tp__nonfinite(tp__storage_of(g), found);
        if (st != TP_OK)
            tp__error_prefix("%s: checking the gradient of '%s'", fn, l.e[i].fqn);
    }
    tp__plist_free(&l);
    return st;
}

/* ---- gradient clipping ---------------------------------------------------------- */

/*
 * The total norm of a model's gradients, DTensors on any mesh included.
 * Each rank reduces its local blocks to one number per parameter (sum of
 * squares, or max |g|), added (or maxed) into a slot per mesh and per set
 * of mesh dims the parameter is sharded on (a bit mask): the parameters in
 * one slot are split the same way. A slot's value is complete once it is
 * summed over each of its sharded dims; it is identical along the others.
 * So per mesh, one all_reduce per mesh dim d (of size > 1) that some slot
 * is sharded on, over all slots at once: the slots not sharded on d enter
 * with their value at coordinate 0 of d and 0 elsewhere (exact), or as they
 * are for a max. Replicated-only and plain parameters need no collective.
 */
typedef struct {
    tp_mesh *mesh; /* borrowed: a parameter's */
    tp_device dev; /* where its gradients live: the reduction runs there */
    double *slot;  /* 1 << ndim, by shard mask */
    bool *used;    /* 1 << ndim */
} tp__norm_part;

typedef struct {
    bool inf;
    double plain; /* the plain parameters' part */
    tp__norm_part *p;
    int n;
    size_t cap;
} tp__norm_acc;

/* a + b, or max(a, b) propagating NaN (as torch's max) */
static double tp__norm_combine(bool inf, double a, double b)
{
    if (!inf)
        return a + b;
    if (isnan(a) || isnan(b))
        return NAN;
    return a > b ? a : b;
}

static void tp__norm_acc_free(tp__norm_acc *a)
{
    for (int i = 0; i < a->n; i++) {
        tp__free(a->p[i].slot);
        tp__free(a->p[i].used);
    }
    tp__free(a->p);
}

/* This rank's sum of squares (or max |g|) of local f32 contiguous g. */
static tp_status tp__grad_norm_local(tp_tensor *g, bool inf, double *out)
{
    *out = 0;
    int64_t n = tp_tensor_numel(g), two = 2;
    if (n == 0)
        return TP_OK;
    tp_device dev = tp_tensor_device(g);
    const tp__kernels *k = NULL;
    TP_CHECK(tp__kernels_for(dev, &k));
    tp_tensor *t = NULL, *y = NULL, *h = NULL;
    tp_status st = tp__f32_like(k, g, NULL, &t);
    if (st == TP_OK)
        st = tp_tensor_empty(TP_F32, dev, 1, &two, &y);
    float *yd = y ? tp_tensor_data(y) : NULL;
    if (st == TP_OK && inf) {
        /* max |g| = max(max g, max -g) */
        st = k->row_max(dev, TP_F32, tp_tensor_data(g), yd, 1, n, 1);
        if (st == TP_OK)
            st = k->scale(dev, TP_F32, tp_tensor_data(g), -1.0f, tp_tensor_data(t), n);
        if (st == TP_OK)
            st = k->row_max(dev, TP_F32, tp_tensor_data(t), yd + 1, 1, n, 1);
    } else if (st == TP_OK) {
        st = k->mul(dev, TP_F32, tp_tensor_data(g), tp_tensor_data(g), tp_tensor_data(t), n);
        if (st == TP_OK)
            st = k->sum_all(dev, TP_F32, tp_tensor_data(t), n, yd, 1.0);
        if (st == TP_OK)
            st = k->fill(dev, TP_F32, yd + 1, 0.0f, 1);
    }
    /* meta (a plan): no values; the norm reads as 0 */
    if (st == TP_OK && dev.type != TP_DEVICE_META)
        st = tp_tensor_to(y, TP_F32, TP_CPU, &h);
    if (st == TP_OK && h) {
        const float *v = tp_tensor_data(h);
        *out = tp__norm_combine(inf, v[0], v[1]);
    }
    tp_tensor_release(t);
    tp_tensor_release(y);
    tp_tensor_release(h);
    return st;
}

/* Adds parameter p's local value v (its gradient on dev) to its slot. */
static tp_status tp__norm_add(const char *fn, tp__norm_acc *a, tp_tensor *p, tp_device dev,
                              double v)
{
    if (!tp_tensor_is_dtensor(p)) {
        a->plain = tp__norm_combine(a->inf, a->plain, v);
        return TP_OK;
    }
    tp_mesh *mesh = tp_dtensor_mesh(p);
    int md = tp_mesh_ndim(mesh), i = 0;
    while (i < a->n && a->p[i].mesh != mesh)
        i++;
    if (i == a->n) {
        if (!tp__grow_array((void **)&a->p, (size_t)a->n, &a->cap, sizeof *a->p))
            return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
        tp__norm_part *pt = &a->p[a->n];
        *pt = (tp__norm_part){mesh, dev, tp__calloc((size_t)1 << md, sizeof(double)),
                              tp__calloc((size_t)1 << md, sizeof(bool))};
        a->n++; /* freed with the others even when half made */
        if (!pt->slot || !pt->used)
            return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    }
    const tp_placement *pl = tp_dtensor_placements(p);
    unsigned mask = 0;
    for (int d = 0; d < md; d++)
        if (pl[d].kind == TP_PLACEMENT_SHARD)
            mask |= 1u << d;
    tp__norm_part *pt = &a->p[i];
    pt->slot[mask] = pt->used[mask] ? tp__norm_combine(a->inf, pt->slot[mask], v) : v;
    pt->used[mask] = true;
    return TP_OK;
}

/* all_reduce of the n doubles in v over comm, on device dev. */
static tp_status tp__all_reduce_f64(tp_comm *comm, double *v, int64_t n, tp_device dev,
                                    tp_reduce_op op)
{
    tp_tensor *b = NULL, *db = NULL, *h = NULL;
    TP_CHECK(tp_tensor_empty(TP_F64, TP_CPU, 1, &n, &b));
    memcpy(tp_tensor_data(b), v, (size_t)n * sizeof *v);
    tp_status st = tp_tensor_to(b, TP_F64, dev, &db);
    if (st == TP_OK)
        st = tp_all_reduce(comm, db, db, op, NULL);
    /* meta (a simulated world): nothing moved, v keeps this rank's values */
    if (st == TP_OK && dev.type != TP_DEVICE_META)
        st = tp_tensor_to(db, TP_F64, TP_CPU, &h);
    if (st == TP_OK && h)
        memcpy(v, tp_tensor_data(h), (size_t)n * sizeof *v);
    tp_tensor_release(b);
    tp_tensor_release(db);
    tp_tensor_release(h);
    return st;
}

/* Completes the slots of one mesh (see above). */
static tp_status tp__norm_reduce(const char *fn, tp__norm_part *pt, bool inf)
{
    int md = tp_mesh_ndim(pt->mesh), ns = 1 << md;
    double *v = tp__malloc((size_t)ns * sizeof *v);
    if (!v)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    tp_status st = TP_OK;
    for (int d = 0; d < md && st == TP_OK; d++) {
        bool need = false;
        for (int s = 0; s < ns; s++)
            need = need || (pt->used[s] && (s >> d & 1));
        if (!need || tp_mesh_size(pt->mesh, d) == 1)
            continue;
        bool first = tp_mesh_coord(pt->mesh, d) == 0;
        for (int s = 0; s < ns; s++)
            v[s] = pt->used[s] && (inf || (s >> d & 1) || first) ? pt->slot[s] : 0.0;
        st = tp__all_reduce_f64(tp_mesh_comm(pt->mesh, d), v, ns, pt->dev, inf ? TP_MAX : TP_SUM);
        if (st != TP_OK) {
            tp__error_prefix("%s: reducing the norm over mesh dim %d", fn, d);
            break;
        }
        for (int s = 0; s < ns; s++)
            if (pt->used[s])
                pt->slot[s] = v[s];
    }
    tp__free(v);
    return st;
}

/* Multiplies the gradient of every handle of parameter i by coef, each
 * gradient once, in its own dtype (one rounding), where it lives. */
static tp_status tp__scale_grads(const tp__plist *l, int i, float coef)
{
    for (int k = i; k >= 0; k = l->next[k]) {
        tp_tensor *g = tp_tensor_grad(l->e[k].t);
        tp_tensor *gl = g ? tp__storage_of(g) : NULL;
        bool seen = false;
        for (int j = i; j != k && gl; j = l->next[j]) {
            tp_tensor *o = tp_tensor_grad(l->e[j].t);
            seen = seen || (o && tp__storage_of(o) == gl);
        }
        if (!gl || seen || tp_tensor_numel(gl) == 0)
            continue;
        tp_device dev = tp_tensor_device(gl);
        const tp__kernels *kt = NULL;
        TP_CHECK(tp__kernels_for(dev, &kt));
        if (tp_tensor_is_contiguous(gl)) {
            TP_CHECK(kt->scale(dev, tp_tensor_dtype(gl), tp_tensor_data(gl), coef,
                               tp_tensor_data(gl), tp_tensor_numel(gl)));
            continue;
        }
        tp_tensor *c = NULL;
        TP_CHECK(tp_tensor_to(gl, TP_F32, dev, &c));
        tp_status st =
            kt->scale(dev, TP_F32, tp_tensor_data(c), coef, tp_tensor_data(c), tp_tensor_numel(c));
        if (st == TP_OK)
            st = tp_tensor_copy(gl, c);
        tp_tensor_release(c);
        TP_CHECK(st);
    }
    return TP_OK;
}

/* The local parts of the norm of every parameter with a gradient. */
static tp_status tp__norm_local_parts(const char *fn, const tp__plist *l, tp__norm_acc *a)
{
    for (int i = 0; i < l->n; i++) {
        if (l->rep[i] != i)
            continue;
        tp_tensor *g = NULL;
        double v = 0;
        TP_CHECK(tp__param_grad(fn, l, i, &g));
        if (!g)
            continue;
        tp_status st = tp__grad_norm_local(g, a->inf, &v);
        if (st == TP_OK)
            st = tp__norm_add(fn, a, l->e[i].t, tp_tensor_device(g), v);
        tp_tensor_release(g);
        if (st != TP_OK) {
            tp__error_prefix("%s: the gradient of '%s'", fn, l->e[i].fqn);
            return st;
        }
    }
    return TP_OK;
}

tp_status tp_clip_grad_norm(tp_module *m, double max_norm, double norm_type, double *total_norm)
{
    const char *fn = "tp_clip_grad_norm";
    if (total_norm)
        *total_norm = NAN;
    TP_ARG_CHECK(m, "%s: module is NULL", fn);
    TP_ARG_CHECK(max_norm >= 0, "%s: max_norm %g must be >= 0", fn, max_norm);
    TP_ARG_CHECK(norm_type == 2.0 || norm_type == INFINITY,
                 "%s: norm_type %g is not supported (2 or INFINITY)", fn, norm_type);
    /* the gradients are final only after the step pre-hooks (a DDP's
     * all_reduces); the optimizer runs them again, a no-op then */
    TP_CHECK(tp__module_run_step_hooks(m));
    tp__plist l;
    TP_CHECK(tp__plist_of(fn, m, true, &l));
    tp__norm_acc a = {.inf = norm_type == INFINITY};
    tp_status st = tp__norm_local_parts(fn, &l, &a);
    double total = a.plain;
    for (int i = 0; i < a.n && st == TP_OK; i++) {
        st = tp__norm_reduce(fn, &a.p[i], a.inf);
        int ns = 1 << tp_mesh_ndim(a.p[i].mesh);
        for (int s = 0; s < ns && st == TP_OK; s++)
            if (a.p[i].used[s])
                total = tp__norm_combine(a.inf, total, a.p[i].slot[s]);
    }
    if (st == TP_OK && !a.inf)
        total = sqrt(total);
    /* torch.nn.utils.clip_grad_norm_: coef = max_norm / (total + 1e-6),
     * clamped to 1 (a NaN total makes every gradient NaN, as there) */
    double coef = max_norm / (total + 1e-6);
    for (int i = 0; i < l.n && st == TP_OK && !(coef >= 1.0); i++)
        if (l.rep[i] == i)
            st = tp__scale_grads(&l, i, (float)coef);
    if (st == TP_OK && total_norm)
        *total_norm = total;
    tp__norm_acc_free(&a);
    tp__plist_free(&l);
    return st;
}

/* ---- learning-rate schedules ---------------------------------------------------- */

tp_status tp_lr_warmup_cosine(int64_t step, int64_t warmup, int64_t total, double base_lr,
                              double min_lr, double *lr)
{
    const char *fn = "tp_lr_warmup_cosine";
    TP_ARG_CHECK(lr, "%s: lr is NULL", fn);
    *lr = NAN;
    TP_ARG_CHECK(step >= 0, "%s: step %lld is negative", fn, (long long)step);
    TP_ARG_CHECK(warmup >= 0 && warmup <= total, "%s: warmup %lld must be in [0, total %lld]", fn,
                 (long long)warmup, (long long)total);
    TP_ARG_CHECK(isfinite(base_lr) && base_lr >= 0, "%s: base_lr %g must be finite and >= 0", fn,
                 base_lr);
    TP_ARG_CHECK(isfinite(min_lr) && min_lr >= 0 && min_lr <= base_lr,
                 "%s: min_lr %g must be in [0, base_lr %g]", fn, min_lr, base_lr);
    if (step < warmup)
        *lr = base_lr * (double)step / (double)warmup;
    else if (step >= total)
        *lr = min_lr;
    else
        *lr = min_lr + (base_lr - min_lr) * 0.5 *
                           (1.0 + cos(3.14159265358979323846 * (double)(step - warmup) /
                                      (double)(total - warmup)));
    return TP_OK;
}

/* ---- optimizer state for checkpoints (nn_ext.h) ---------------------------- */

static tp__pstates *tp__opt_pstates(tp__opt_ref o)
{
    return o.adam ? &o.adam->st : o.sgd ? &o.sgd->st : NULL;
}

int tp__opt_num_states(tp__opt_ref o)
{
    tp__pstates *ps = tp__opt_pstates(o);
    return ps ? ps->n : 0;
}

void tp__opt_state_at(tp__opt_ref o, int i, tp__opt_state *out)
{
    const tp__pstate *s = &tp__opt_pstates(o)->s[i];
    *out = (tp__opt_state){s->fqn, s->param, s->master, s->m, s->v, s->step};
}

void tp__opt_hyper(tp__opt_ref o, tp__opt_hyperparams *h)
{
    *h = (tp__opt_hyperparams){0};
    if (o.adam) {
        const tp_adam *a = o.adam;
        *h = (tp__opt_hyperparams){.lr = a->lr,
                                   .beta1 = a->beta1,
                                   .beta2 = a->beta2,
                                   .eps = a->eps,
                                   .weight_decay = a->weight_decay,
                                   .decoupled = a->decoupled};
    } else if (o.sgd) {
        const tp_sgd *s = o.sgd;
        *h = (tp__opt_hyperparams){.lr = s->lr,
                                   .momentum = s->momentum,
                                   .dampening = s->dampening,
                                   .weight_decay = s->weight_decay,
                                   .nesterov = s->nesterov};
    }
}

tp_module *tp__opt_module(tp__opt_ref o)
{
    return o.adam ? o.adam->module : o.sgd ? o.sgd->module : NULL;
}

struct tp__opt_pending {
    tp__pstate *s;
    int n;
};

void tp__opt_pending_free(tp__opt_pending *p)
{
    if (!p)
        return;
    tp__pstates tmp = {.s = p->s, .n = p->n};
    tp__pstates_free(&tmp);
    tp__free(p);
}

tp_status tp__opt_pending_new(int n, const tp__opt_state *v, tp__opt_pending **out)
{
    *out = NULL;
    tp__opt_pending *p = tp__calloc(1, sizeof *p);
    if (p)
        p->s = tp__calloc((size_t)(n ? n : 1), sizeof *p->s);
    if (!p || !p->s) {
        tp__free(p);
        return tp__error(TP_ERR_NO_MEMORY, "out of memory restoring optimizer state");
    }
    for (int i = 0; i < n; i++, p->n++) {
        tp__pstate *s = &p->s[i];
        if (!(s->fqn = tp__strdup(v[i].fqn))) {
            tp__opt_pending_free(p);
            return tp__error(TP_ERR_NO_MEMORY, "out of memory restoring optimizer state");
        }
        s->param = tp_tensor_retain(v[i].param);
        s->master = v[i].master ? tp_tensor_retain(v[i].master) : NULL;
        s->m = v[i].m ? tp_tensor_retain(v[i].m) : NULL;
        s->v = v[i].v ? tp_tensor_retain(v[i].v) : NULL;
        s->step = v[i].step;
    }
    *out = p;
    return TP_OK;
}

void tp__opt_pending_commit(tp__opt_ref o, tp__opt_pending *p)
{
    tp__pstates *ps = tp__opt_pstates(o);
    tp__pstates old = *ps;
    old.by_param = old.by_fqn = NULL;
    tp__pstates_free(&old);
    tp__free(ps->by_param);
    tp__free(ps->by_fqn);
    ps->s = p->s;
    ps->n = p->n;
    ps->cap = (size_t)p->n;
    ps->n_indexed = 0;
    ps->by_param = ps->by_fqn = NULL;
    tp__free(p);
}
