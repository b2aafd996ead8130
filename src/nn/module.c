/* The module tree: children, parameters, FQNs, hooks, forward dispatch and
 * freeing. The built-in kinds (builtin.c) set `forward` like a custom module
 * does, so dispatch here is the same for every kind. */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "collectives/comm_debug_internal.h"
#include "core/meta_mem.h"
#include "nn/nn_internal.h"

/* ---- names ---------------------------------------------------------------- */

static int tp__param_index(const tp_module *m, const char *name)
{
    for (int i = 0; i < m->n_params; i++)
        if (!strcmp(m->param_names[i], name))
            return i;
    return -1;
}

static int tp__child_index(const tp_module *m, const char *name)
{
    for (int i = 0; i < m->n_children; i++)
        if (!strcmp(m->children[i]->name, name))
            return i;
    return -1;
}

/* A child or parameter name: non-empty, no '.', and free in m (children and
 * parameters share one namespace, as attributes do in PyTorch, so that an FQN
 * names one thing). */
static tp_status tp__check_name(const char *fn, const tp_module *m, const char *name)
{
    TP_ARG_CHECK(name, "%s: name is NULL", fn);
    TP_ARG_CHECK(name[0], "%s: name is empty", fn);
    TP_ARG_CHECK(!strchr(name, '.'), "%s: name '%s' contains '.'", fn, name);
    TP_ARG_CHECK(tp__child_index(m, name) < 0, "%s: %s already has a child named '%s'", fn,
                 m->type_name, name);
    TP_ARG_CHECK(tp__param_index(m, name) < 0, "%s: %s already has a parameter named '%s'",
                 fn, m->type_name, name);
    return TP_OK;
}

/* ---- lifetime ------------------------------------------------------------- */

tp__ctx_ref *tp__ctx_ref_new(void *ctx, void (*ctx_free)(void *ctx))
{
    tp__ctx_ref *r = tp__malloc(sizeof *r);
    if (!r)
        return NULL;
    atomic_init(&r->refs, 1);
    r->ctx = ctx;
    r->ctx_free = ctx_free;
    return r;
}

tp__ctx_ref *tp__ctx_ref_retain(tp__ctx_ref *r)
{
    if (r)
        atomic_fetch_add(&r->refs, 1);
    return r;
}

void tp__ctx_ref_release(tp__ctx_ref *r)
{
    if (!r || atomic_fetch_sub(&r->refs, 1) != 1)
        return;
    if (r->ctx_free)
        r->ctx_free(r->ctx);
    tp__free(r);
}

static void tp__hooks_free(tp__hook *h, int n)
{
    for (int i = 0; i < n; i++)
        tp__ctx_ref_release(h[i].ref);
    tp__free(h);
}

static void tp__module_destroy(tp_module *m)
{
    for (int i = 0; i < m->n_children; i++)
        tp__module_destroy(m->children[i]);
    tp__free(m->children);
    for (int i = 0; i < m->n_params; i++) {
        tp__free(m->param_names[i]);
        tp_tensor_release(m->params[i]);
    }
    tp__free(m->param_names);
    tp__free(m->params);
    tp__hooks_free(m->pre_hooks, m->n_pre);
    tp__hooks_free(m->post_hooks, m->n_post);
    tp__hooks_free(m->step_hooks, m->n_step);
    for (int i = 0; i < m->n_attached; i++)
        tp__ctx_ref_release(m->attached[i].ref);
    tp__free(m->attached);
    tp__ctx_ref_release(m->ctx_ref);
    tp__free(m->type_name);
    tp__free(m->name);
    tp__free(m);
}

/* A module with a parent belongs to that parent: freeing it here would leave
 * a dangling child pointer behind, so the call is a no-op (nothing is freed,
 * nothing leaks: the root's free releases it). */
void tp_module_free(tp_module *m)
{
    if (!m || m->parent)
        return;
    tp__module_destroy(m);
}

/* ---- the tree ------------------------------------------------------------- */

tp_status tp_module_add_child(tp_module *parent, const char *name, tp_module *child)
{
    const char *fn = "tp_module_add_child";
    TP_ARG_CHECK(parent, "%s: parent is NULL", fn);
    TP_ARG_CHECK(child, "%s: child is NULL", fn);
    TP_CHECK(tp__check_name(fn, parent, name));
    TP_ARG_CHECK(!child->parent, "%s: the module '%s' (%s) already has a parent", fn, name,
                 child->type_name);
    for (const tp_module *a = parent; a; a = a->parent)
        TP_ARG_CHECK(a != child, "%s: adding '%s' would make a module its own ancestor", fn,
                     name);
    char *copy = tp__strdup(name);
    if (!copy)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    if (!tp__grow_array((void **)&parent->children, parent->n_children, &parent->cap_children,
                        sizeof *parent->children)) {
        tp__free(copy);
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    }
    tp__free(child->name);
    child->name = copy;
    child->parent = parent;
    parent->children[parent->n_children++] = child;
    return TP_OK;
}

tp_module *tp_module_child(const tp_module *m, const char *name)
{
    if (!m || !name)
        return NULL;
    int i = tp__child_index(m, name);
    return i < 0 ? NULL : m->children[i];
}

tp_module *tp_module_find(tp_module *m, const char *fqn)
{
    if (!m || !fqn)
        return NULL;
    const char *p = fqn;
    while (*p) {
        const char *dot = strchr(p, '.');
        size_t len = dot ? (size_t)(dot - p) : strlen(p);
        if (len == 0)
            return NULL; /* "a..b", ".a", "a." */
        tp_module *next = NULL;
        for (int i = 0; i < m->n_children; i++) {
            const char *cn = m->children[i]->name;
            if (strlen(cn) == len && !memcmp(cn, p, len)) {
                next = m->children[i];
                break;
            }
        }
        if (!next)
            return NULL;
        m = next;
        if (!dot)
            break;
        p = dot + 1;
        if (!*p)
            return NULL;
    }
    return m;
}

int tp_module_num_children(const tp_module *m) { return m ? m->n_children : 0; }

tp_module *tp_module_child_at(const tp_module *m, int i, const char **name)
{
    if (name)
        *name = NULL;
    if (!m || i < 0 || i >= m->n_children)
        return NULL;
    if (name)
        *name = m->children[i]->name;
    return m->children[i];
}

tp_module_kind tp_module_kind_of(const tp_module *m)
{
    return m ? m->kind : (tp_module_kind)-1;
}

const char *tp_module_type_name(const tp_module *m) { return m ? m->type_name : NULL; }

const char *tp_module_name(const tp_module *m) { return m ? m->name : NULL; }

void *tp_module_ctx(const tp_module *m) { return m ? m->ctx : NULL; }

/* ---- what upper layers see (nn_ext.h) ------------------------------------------ */

int64_t tp__module_linear_in(const tp_module *m)
{
    return m && m->kind == TP_MODULE_LINEAR ? m->cfg.linear.in : -1;
}

int tp__module_num_params(const tp_module *m) { return m ? m->n_params : 0; }

tp_tensor *tp__module_param_at(const tp_module *m, int i, const char **name)
{
    if (name)
        *name = NULL;
    if (!m || i < 0 || i >= m->n_params)
        return NULL;
    if (name)
        *name = m->param_names[i];
    return m->params[i];
}

static int tp__attachment_index(const tp_module *m, const void *key)
{
    for (int i = 0; i < m->n_attached; i++)
        if (m->attached[i].key == key)
            return i;
    return -1;
}

tp_status tp__module_attach(tp_module *m, const void *key, void *ptr, void (*free_fn)(void *))
{
    const char *fn = "tp__module_attach";
    TP_ARG_CHECK(m && key, "%s: module or key is NULL", fn);
    int i = tp__attachment_index(m, key);
    tp__ctx_ref *ref = NULL;
    if (ptr && !(ref = tp__ctx_ref_new(ptr, free_fn)))
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    if (i < 0 && ref &&
        !tp__grow_array((void **)&m->attached, (size_t)m->n_attached, &m->cap_attached,
                        sizeof *m->attached)) {
        ref->ctx_free = NULL; /* the caller keeps ptr */
        tp__ctx_ref_release(ref);
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    }
    if (i >= 0) {
        tp__ctx_ref_release(m->attached[i].ref);
        if (ref) {
            m->attached[i].ref = ref;
        } else {
            memmove(&m->attached[i], &m->attached[i + 1],
                    (size_t)(m->n_attached - i - 1) * sizeof *m->attached);
            m->n_attached--;
        }
    } else if (ref) {
        m->attached[m->n_attached++] = (tp__attachment){key, ref};
    }
    return TP_OK;
}

void *tp__module_attached(const tp_module *m, const void *key)
{
    int i = m ? tp__attachment_index(m, key) : -1;
    return i < 0 ? NULL : m->attached[i].ref->ctx;
}

/* Writes the path of m below root at logical position pos (characters past
 * the buffer are dropped); returns the new logical position. */
static size_t tp__fqn_put(const tp_module *root, const tp_module *m, char *buf, size_t len,
                          size_t pos)
{
    if (m == root || !m->parent)
        return pos;
    pos = tp__fqn_put(root, m->parent, buf, len, pos);
    if (pos) {
        if (pos < len - 1)
            buf[pos] = '.';
        pos++;
    }
    for (const char *c = m->name; *c; c++, pos++)
        if (pos < len - 1)
            buf[pos] = *c;
    return pos;
}

/* Returns the path's full length (a path longer than the buffer is
 * truncated), or SIZE_MAX when buf is unusable or m is not root or below it;
 * root NULL means the top of m's tree. */
size_t tp__module_fqn(const tp_module *root, const tp_module *m, char *buf, size_t len)
{
    if (!buf || !len || !m)
        return SIZE_MAX;
    const tp_module *a = m;
    while (a != root && a->parent)
        a = a->parent;
    if (root && a != root) {
        buf[0] = '\0';
        return SIZE_MAX;
    }
    size_t end = tp__fqn_put(root, m, buf, len, 0);
    buf[end < len - 1 ? end : len - 1] = '\0';
    return end;
}

/* ---- parameters ------------------------------------------------------------ */

/* Marks t as a parameter. A tensor that already requires grad (a DTensor a
 * style built from a local leaf that requires grad, say) is left as it is:
 * requires_grad cannot be set on a non-leaf. */
static tp_status tp__mark_param(const char *fn, const char *name, tp_tensor *t)
{
    tp__meta_mem_tag(t, TP_MEM_PARAMETERS, NULL); /* memory accounting on meta */
    if (tp_tensor_requires_grad(t))
        return TP_OK;
    tp_status st = tp_tensor_set_requires_grad(t, true);
    if (st != TP_OK)
        tp__error_prefix("%s: parameter '%s'", fn, name);
    return st;
}

/* t NULL registers an absent parameter ("None", as a Linear's bias without
 * bias): it keeps its name and place but is skipped by every walk. */
tp_status tp_module_register_parameter(tp_module *m, const char *name, tp_tensor *t)
{
    const char *fn = "tp_module_register_parameter";
    TP_ARG_CHECK(m, "%s: module is NULL", fn);
    TP_CHECK(tp__check_name(fn, m, name));
    if (t)
        TP_CHECK(tp__mark_param(fn, name, t));
    char *copy = tp__strdup(name);
    if (!copy)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    /* the two arrays share cap_params: grow names against a copy of it, so a
     * failure growing params leaves cap_params true for both (a names array
     * larger than recorded is harmless) */
    size_t cap_names = m->cap_params;
    if (!tp__grow_array((void **)&m->param_names, m->n_params, &cap_names, sizeof *m->param_names) ||
        !tp__grow_array((void **)&m->params, m->n_params, &m->cap_params, sizeof *m->params)) {
        tp__free(copy);
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    }
    m->param_names[m->n_params] = copy;
    m->params[m->n_params] = tp_tensor_retain(t);
    m->n_params++;
    return TP_OK;
}

tp_tensor *tp_module_parameter(const tp_module *m, const char *name)
{
    if (!m || !name)
        return NULL;
    int i = tp__param_index(m, name);
    return i < 0 ? NULL : m->params[i];
}

tp_status tp_module_set_parameter(tp_module *m, const char *name, tp_tensor *t)
{
    const char *fn = "tp_module_set_parameter";
    TP_ARG_CHECK(m, "%s: module is NULL", fn);
    TP_ARG_CHECK(name, "%s: name is NULL", fn);
    TP_ARG_CHECK(t, "%s: tensor for '%s' is NULL", fn, name);
    int i = tp__param_index(m, name);
    TP_ARG_CHECK(i >= 0, "%s: %s has no parameter '%s'", fn, m->type_name, name);
    TP_CHECK(tp__mark_param(fn, name, t));
    tp_tensor *old = m->params[i];
    m->params[i] = tp_tensor_retain(t);
    tp_tensor_release(old);
    return TP_OK;
}

/* A growable string for FQNs. */
typedef struct {
    char *s;
    size_t len, cap;
} tp__path;

static bool tp__path_push(tp__path *p, const char *name)
{
    size_t n = strlen(name), need = p->len + (p->len ? 1 : 0) + n + 1;
    if (need > p->cap) {
        size_t cap = p->cap ? p->cap : 64;
        while (cap < need)
            cap *= 2;
        char *s = tp__malloc(cap);
        if (!s)
            return false;
        memcpy(s, p->s ? p->s : "", p->len + 1);
        tp__free(p->s);
        p->s = s;
        p->cap = cap;
    }
    if (p->len)
        p->s[p->len++] = '.';
    memcpy(p->s + p->len, name, n + 1);
    p->len += n;
    return true;
}

static void tp__path_pop(tp__path *p, size_t len)
{
    p->len = len;
    p->s[len] = '\0';
}

typedef struct {
    const tp_tensor *t;
    size_t k; /* walk position */
} tp__walk_key;

/* The present parameters of m's subtree in walk order (depth first, in
 * registration order) into key[*n...]; key NULL only counts them. */
static void tp__walk_tensors(const tp_module *m, tp__walk_key *key, size_t *n)
{
    for (int i = 0; i < m->n_params; i++)
        if (m->params[i]) {
            if (key)
                key[*n] = (tp__walk_key){m->params[i], *n};
            (*n)++;
        }
    for (int i = 0; i < m->n_children; i++)
        tp__walk_tensors(m->children[i], key, n);
}

static int tp__walk_key_cmp(const void *pa, const void *pb)
{
    const tp__walk_key *a = pa, *b = pb;
    uintptr_t ta = (uintptr_t)a->t, tb = (uintptr_t)b->t;
    if (ta != tb)
        return ta < tb ? -1 : 1;
    return a->k < b->k ? -1 : a->k > b->k;
}

/* Which parameters of a walk repeat an earlier one. */
typedef struct {
    bool *again; /* again[k]: the k-th parameter of the walk was reached before */
    size_t n;    /* entries of again */
    size_t k;    /* the walk's position */
} tp__repeats;

/* Fills r (zeroed by the caller). A sort, not a pairwise scan: optimizers
 * walk every step. */
static tp_status tp__walk_repeats(const tp_module *m, tp__repeats *r)
{
    size_t n = 0;
    tp__walk_tensors(m, NULL, &n);
    if (!n)
        return TP_OK;
    tp__walk_key *key = tp__malloc(n * sizeof *key);
    bool *again = tp__calloc(n, sizeof *again);
    if (!key || !again) {
        tp__free(key);
        tp__free(again);
        return tp__error(TP_ERR_NO_MEMORY, "tp_module_named_parameters: out of memory");
    }
    size_t k = 0;
    tp__walk_tensors(m, key, &k);
    qsort(key, n, sizeof *key, tp__walk_key_cmp);
    for (k = 1; k < n; k++)
        if (key[k].t == key[k - 1].t)
            again[key[k].k] = true;
    tp__free(key);
    r->again = again;
    r->n = n;
    return TP_OK;
}

/* r NULL: every name is reported. Otherwise a tensor reached under a second
 * name (a tied weight) is skipped, as PyTorch's named_parameters() does by
 * default. (Parameters fn registers meanwhile are past r's entries: they are
 * reported.) */
static tp_status tp__walk_params(tp_module *m, tp__path *path, tp__repeats *r,
                                 tp_status (*fn)(const char *, tp_tensor *, void *), void *ctx)
{
    size_t base = path->len;
    for (int i = 0; i < m->n_params; i++) {
        if (!m->params[i])
            continue;
        if (r && r->k++ < r->n && r->again[r->k - 1])
            continue;
        if (!tp__path_push(path, m->param_names[i]))
            return tp__error(TP_ERR_NO_MEMORY, "tp_module_named_parameters: out of memory");
        tp_status st = fn(path->s, m->params[i], ctx);
        tp__path_pop(path, base);
        if (st != TP_OK)
            return st;
    }
    for (int i = 0; i < m->n_children; i++) {
        if (!tp__path_push(path, m->children[i]->name))
            return tp__error(TP_ERR_NO_MEMORY, "tp_module_named_parameters: out of memory");
        tp_status st = tp__walk_params(m->children[i], path, r, fn, ctx);
        tp__path_pop(path, base);
        if (st != TP_OK)
            return st;
    }
    return TP_OK;
}

/* ---- moving between devices ------------------------------------------------- */

/* Where each moved parameter goes: slot i of module m; its copy is entry k of
 * the map (k the index of the slot here). */
typedef struct {
    tp_module *m;
    int i;
} tp__slot;

typedef struct {
    tp__slot *slot;
    size_t cap;
    tp__param_map map; /* old (borrowed: the module holds it until the swap)
                        * -> moved (a reference) */
    const char *fn;
    bool cast;      /* tp_module_to_dtype: the dtype changes, the device stays */
    tp_device dev;  /* tp_module_to */
    tp_dtype dtype; /* tp_module_to_dtype */
} tp__moves;

/* Whether parameter t is left as it is. */
static bool tp__stays(const tp__moves *mv, const tp_tensor *t)
{
    if (mv->cast)
        return tp_tensor_dtype(t) == mv->dtype || !tp_dtype_is_float(tp_tensor_dtype(t));
    return tp__device_eq(tp_tensor_device(t), mv->dev);
}

/* t (plain) on dev in dtype: a copy, or, from the meta device to another,
 * which has no values to copy, zeros of t's shape. */
static tp_status tp__local_to(const tp_tensor *t, tp_dtype dtype, tp_device dev, tp_tensor **out)
{
    if (tp_tensor_is_meta(t) && dev.type != TP_DEVICE_META)
        return tp_tensor_zeros(dtype, dev, tp_tensor_ndim(t), tp_tensor_shape(t), out);
    return tp_tensor_to(t, dtype, dev, out);
}

/* A copy of p (a parameter, or a gradient) on dev in dtype: a plain copy,
 * or a DTensor over a copy of its local shard with p's layout. */
static tp_status tp__copy_to(tp_tensor *p, tp_dtype dtype, tp_device dev, tp_tensor **out)
{
    if (!tp_tensor_is_dtensor(p))
        return tp__local_to(p, dtype, dev, out);
    tp_tensor *nl = NULL;
    tp_status st = tp__local_to(tp_dtensor_local(p), dtype, dev, &nl);
    if (st == TP_OK) {
        tp_mesh *mesh = tp_dtensor_mesh(p);
        tp_from_local_options o = {.global_shape = tp_tensor_shape(p), .check = false};
        st = tp_dtensor_from_local(mesh, nl, tp_mesh_ndim(mesh), tp_dtensor_placements(p), &o, out);
    }
    tp_tensor_release(nl);
    return st;
}

/* A copy of parameter p where mv sends it, marked requires_grad. */
static tp_status tp__moved(const tp__moves *mv, tp_tensor *p, tp_tensor **out)
{
    tp_tensor *r = NULL;
    tp_status st = mv->cast ? tp__copy_to(p, mv->dtype, tp_tensor_device(p), &r)
                            : tp__copy_to(p, tp_tensor_dtype(p), mv->dev, &r);
    if (st == TP_OK)
        st = tp_tensor_set_requires_grad(r, true);
    if (st != TP_OK) {
        tp_tensor_release(r);
        return st;
    }
    *out = r;
    return TP_OK;
}

/* A second handle over the storage of `copy` with the layout of `like` (a
 * handle over the same region as the parameter `copy` was made from):
 * handles that were one parameter before the copy stay one. Requires grad
 * as `copy` does. */
static tp_status tp__copy_alias(tp_tensor *copy, const tp_tensor *like, tp_tensor **out)
{
    tp_tensor *r = NULL;
    tp_status st;
    if (tp_tensor_is_dtensor(copy)) {
        tp_tensor *v = NULL;
        st = tp__tensor_alias(tp_dtensor_local(copy), &v);
        if (st == TP_OK) {
            tp_mesh *mesh = tp_dtensor_mesh(like);
            tp_from_local_options o = {.global_shape = tp_tensor_shape(like), .check = false};
            st = tp_dtensor_from_local(mesh, v, tp_mesh_ndim(mesh), tp_dtensor_placements(like),
                                       &o, &r);
        }
        tp_tensor_release(v);
    } else {
        st = tp__tensor_alias(copy, &r);
    }
    if (st == TP_OK && tp_tensor_requires_grad(copy))
        st = tp_tensor_set_requires_grad(r, true);
    if (st != TP_OK) {
        tp_tensor_release(r);
        return st;
    }
    *out = r;
    return TP_OK;
}

bool tp__param_map_add(tp__param_map *mm, const tp_tensor *from, tp_tensor *to)
{
    if (!tp__grow_array((void **)&mm->v, mm->n, &mm->cap, sizeof *mm->v))
        return false;
    mm->v[mm->n].from = from;
    mm->v[mm->n++].to = to;
    return true;
}

tp_status tp__param_map_find(const tp__param_map *mm, tp_tensor *p, tp_tensor **out)
{
    *out = NULL;
    for (size_t k = 0; k < mm->n; k++)
        if (mm->v[k].from == p) {
            *out = tp_tensor_retain(mm->v[k].to);
            return TP_OK;
        }
    for (size_t k = 0; k < mm->n; k++)
        if (tp__param_same(mm->v[k].from, p))
            return tp__copy_alias(mm->v[k].to, p, out);
    return TP_OK;
}

/* A tied parameter (one tensor under several names, or handles over one
 * storage region: tp__param_same) is copied once; every name gets the copy. */
/* A cast keeps gradients: old's gradient, cast like the parameter, becomes
 * t's (once: a tied tensor reached again already has it). */
static tp_status tp__cast_grad(const tp__moves *mv, tp_tensor *old, tp_tensor *t)
{
    tp_tensor *g = mv->cast ? tp_tensor_grad(old) : NULL, *c = NULL;
    if (!g || tp_tensor_grad(t))
        return TP_OK;
    tp_status st = tp__copy_to(g, mv->dtype, tp_tensor_device(g), &c);
    if (st == TP_OK)
        st = tp_tensor_set_grad(t, c);
    tp_tensor_release(c);
    return st;
}

static tp_status tp__collect_moves(tp_module *m, tp__moves *mv)
{
    for (int i = 0; i < m->n_params; i++) {
        tp_tensor *old = m->params[i];
        if (!old || tp__stays(mv, old))
            continue;
        if (!tp__grow_array((void **)&mv->slot, mv->map.n, &mv->cap, sizeof *mv->slot))
            return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", mv->fn);
        tp_tensor *t = NULL;
        tp_status st = tp__param_map_find(&mv->map, old, &t);
        if (!t && st == TP_OK)
            st = tp__moved(mv, old, &t);
        if (st == TP_OK)
            st = tp__cast_grad(mv, old, t);
        if (st == TP_OK && !tp__param_map_add(&mv->map, old, t))
            st = tp__error(TP_ERR_NO_MEMORY, "out of memory");
        if (st != TP_OK) {
            tp_tensor_release(t);
            tp__error_prefix("%s: parameter '%s' of %s", mv->fn, m->param_names[i], m->type_name);
            return st;
        }
        mv->slot[mv->map.n - 1] = (tp__slot){m, i};
    }
    for (int i = 0; i < m->n_children; i++)
        TP_CHECK(tp__collect_moves(m->children[i], mv));
    return TP_OK;
}

/* Makes every copy first, then swaps them in: all or nothing. */
static tp_status tp__apply_moves(tp_module *m, tp__moves *mv)
{
    tp_status st = tp__collect_moves(m, mv);
    for (size_t k = 0; k < mv->map.n; k++) {
        if (st == TP_OK) { /* all copies made: swap them in */
            tp_module *o = mv->slot[k].m;
            tp_tensor *old = o->params[mv->slot[k].i];
            o->params[mv->slot[k].i] = mv->map.v[k].to;
            tp_tensor_release(old);
        } else {
            tp_tensor_release(mv->map.v[k].to);
        }
    }
    tp__free(mv->slot);
    tp__free(mv->map.v);
    return st;
}

tp_status tp_module_to(tp_module *m, tp_device device)
{
    TP_ARG_CHECK(m, "tp_module_to: module is NULL");
    if (device.type == TP_DEVICE_CUDA && tp_cuda_device_count() == 0)
        return tp__error(TP_ERR_NOT_SUPPORTED, "tp_module_to: CUDA device %d unavailable (%s)",
                         device.index, tp__cuda_unavailable_reason());
    tp__moves mv = {.fn = "tp_module_to", .dev = device};
    return tp__apply_moves(m, &mv);
}

tp_status tp_module_to_dtype(tp_module *m, tp_dtype dtype)
{
    const char *fn = "tp_module_to_dtype";
    TP_ARG_CHECK(m, "%s: module is NULL", fn);
    TP_ARG_CHECK(dtype == TP_F32 || dtype == TP_BF16 || dtype == TP_F16,
                 "%s: dtype %s (%d) is not a parameter dtype: use f32, bf16 or f16", fn,
                 tp_dtype_name(dtype), (int)dtype);
    tp__moves mv = {.fn = fn, .cast = true, .dtype = dtype};
    return tp__apply_moves(m, &mv);
}

tp_status tp_module_named_parameters(tp_module *m,
                                     tp_status (*fn)(const char *fqn, tp_tensor *param,
                                                     void *ctx),
                                     void *ctx)
{
    const char *f = "tp_module_named_parameters";
    TP_ARG_CHECK(m, "%s: module is NULL", f);
    TP_ARG_CHECK(fn, "%s: fn is NULL", f);
    return tp__module_walk_params(m, true, fn, ctx);
}

tp_status tp__module_walk_params(tp_module *m, bool unique,
                                 tp_status (*fn)(const char *fqn, tp_tensor *param, void *ctx),
                                 void *ctx)
{
    tp__path path = {0};
    tp__repeats r = {0};
    tp_status st = unique ? tp__walk_repeats(m, &r) : TP_OK;
    if (st == TP_OK)
        st = tp__walk_params(m, &path, unique ? &r : NULL, fn, ctx);
    tp__free(path.s);
    tp__free(r.again);
    return st;
}

void tp_module_zero_grad(tp_module *m)
{
    if (!m)
        return;
    for (int i = 0; i < m->n_params; i++)
        if (m->params[i])
            tp_tensor_zero_grad(m->params[i]);
    for (int i = 0; i < m->n_children; i++)
        tp_module_zero_grad(m->children[i]);
}

/* ---- hooks ------------------------------------------------------------------ */

/* On failure the caller keeps ctx: ctx_free is not called (as a blob's
 * deleter is not when wrapping it fails). */
enum { TP__HOOK_PRE, TP__HOOK_POST, TP__HOOK_STEP, TP__HOOK_KINDS };

static tp__hook **tp__hook_list(tp_module *m, int which, int **n, size_t **cap)
{
    switch (which) {
    case TP__HOOK_PRE:
        *n = &m->n_pre, *cap = &m->cap_pre;
        return &m->pre_hooks;
    case TP__HOOK_POST:
        *n = &m->n_post, *cap = &m->cap_post;
        return &m->post_hooks;
    default:
        *n = &m->n_step, *cap = &m->cap_step;
        return &m->step_hooks;
    }
}

static tp_status tp__add_hook(const char *fn, tp_module *m, void *hook, void *ctx,
                              void (*ctx_free)(void *), int which, int *handle)
{
    if (handle)
        *handle = 0;
    TP_ARG_CHECK(m, "%s: module is NULL", fn);
    TP_ARG_CHECK(hook, "%s: hook is NULL", fn);
    /* the module's state, not the arguments, refuses: handles are never
     * reused, so after INT_MAX hooks the module takes no more */
    if (m->next_hook_id == INT_MAX)
        return tp__error(TP_ERR_STATE, "%s: %s has run out of hook handles", fn, m->type_name);
    int *n = NULL;
    size_t *cap = NULL;
    tp__hook **v = tp__hook_list(m, which, &n, &cap);
    if (!tp__grow_array((void **)v, *n, cap, sizeof **v))
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    tp__ctx_ref *ref = NULL;
    if (ctx_free && !(ref = tp__ctx_ref_new(ctx, ctx_free)))
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    int id = ++m->next_hook_id;
    (*v)[(*n)++] = (tp__hook){hook, ctx, ref, id};
    if (handle)
        *handle = id;
    return TP_OK;
}

tp_status tp_module_add_forward_pre_hook(tp_module *m, tp_forward_pre_hook fn, void *ctx,
                                         void (*ctx_free)(void *ctx), int *handle)
{
    return tp__add_hook("tp_module_add_forward_pre_hook", m, (void *)fn, ctx, ctx_free,
                        TP__HOOK_PRE, handle);
}

tp_status tp_module_add_forward_hook(tp_module *m, tp_forward_hook fn, void *ctx,
                                     void (*ctx_free)(void *ctx), int *handle)
{
    return tp__add_hook("tp_module_add_forward_hook", m, (void *)fn, ctx, ctx_free,
                        TP__HOOK_POST, handle);
}

tp_status tp_module_add_step_pre_hook(tp_module *m, tp_step_pre_hook fn, void *ctx,
                                      void (*ctx_free)(void *ctx), int *handle)
{
    return tp__add_hook("tp_module_add_step_pre_hook", m, (void *)fn, ctx, ctx_free,
                        TP__HOOK_STEP, handle);
}

/* Drops the entries removed while m was busy. */
static void tp__hooks_compact(tp_module *m)
{
    for (int which = 0; which < TP__HOOK_KINDS; which++) {
        int *n = NULL;
    size_t *cap = NULL;
        tp__hook *v = *tp__hook_list(m, which, &n, &cap);
        int k = 0;
        for (int i = 0; i < *n; i++) {
            if (v[i].fn)
                v[k++] = v[i];
            else
                tp__ctx_ref_release(v[i].ref);
        }
        *n = k;
    }
    m->hooks_removed = false;
}

static void tp__module_enter(tp_module *m) { m->busy++; }

static void tp__module_leave(tp_module *m)
{
    if (--m->busy == 0 && m->hooks_removed)
        tp__hooks_compact(m);
}

void tp_module_remove_hook(tp_module *m, int handle)
{
    if (!m || handle <= 0)
        return;
    for (int which = 0; which < TP__HOOK_KINDS; which++) {
        int *n = NULL;
    size_t *cap = NULL;
        tp__hook *v = *tp__hook_list(m, which, &n, &cap);
        for (int i = 0; i < *n; i++) {
            if (v[i].id != handle || !v[i].fn)
                continue;
            v[i].fn = NULL; /* skipped from now on, in a running forward too */
            if (m->busy) {
                /* the hook itself may be running: keep its ctx until the
                 * module returns */
                m->hooks_removed = true;
            } else {
                tp__ctx_ref_release(v[i].ref);
                memmove(&v[i], &v[i + 1], (size_t)(*n - i - 1) * sizeof *v);
                (*n)--;
            }
            return;
        }
    }
}

tp_status tp__module_run_step_hooks(tp_module *m)
{
    tp_status st = TP_OK;
    tp__module_enter(m);
    for (int i = 0; i < m->n_step && st == TP_OK; i++) {
        tp_step_pre_hook h = (tp_step_pre_hook)m->step_hooks[i].fn;
        if (h)
            st = h(m, m->step_hooks[i].ctx);
    }
    tp__module_leave(m);
    for (int i = 0; i < m->n_children && st == TP_OK; i++)
        st = tp__module_run_step_hooks(m->children[i]);
    return st;
}

/* ---- forward ------------------------------------------------------------------ */

#define TP__INLINE_ARGS 8

tp_status tp_module_forward(tp_module *m, int nargs, tp_tensor *const *args, int nkw,
                            const tp_kwarg *kw, tp_tensor **out)
{
    const char *fn = "tp_module_forward";
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    *out = NULL;
    TP_ARG_CHECK(m, "%s: module is NULL", fn);
    TP_ARG_CHECK(nargs >= 0, "%s: nargs %d is negative", fn, nargs);
    TP_ARG_CHECK(nkw >= 0, "%s: nkw %d is negative", fn, nkw);
    TP_ARG_CHECK(nargs == 0 || args, "%s: args is NULL with %d inputs", fn, nargs);
    TP_ARG_CHECK(nkw == 0 || kw, "%s: kw is NULL with %d keyword inputs", fn, nkw);
    for (int i = 0; i < nkw; i++)
        TP_ARG_CHECK(kw[i].name, "%s: keyword input %d has no name", fn, i);
    TP_ARG_CHECK(m->forward, "%s: %s has no forward", fn, m->type_name);

    /* Mutable copies holding their own references: pre-hooks replace
     * entries, and the caller's arrays stay untouched. */
    tp_tensor *a_inline[TP__INLINE_ARGS], **a = a_inline;
    tp_kwarg k_inline[TP__INLINE_ARGS], *k = k_inline;
    if (nargs > TP__INLINE_ARGS && !(a = tp__malloc((size_t)nargs * sizeof *a)))
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    if (nkw > TP__INLINE_ARGS && !(k = tp__malloc((size_t)nkw * sizeof *k))) {
        if (a != a_inline)
            tp__free(a);
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    }
    for (int i = 0; i < nargs; i++)
        a[i] = tp_tensor_retain(args[i]);
    for (int i = 0; i < nkw; i++) {
        k[i].name = kw[i].name;
        k[i].value = tp_tensor_retain(kw[i].value);
    }

    /* Hooks run inside the scope: the collectives styles issue there count
     * for this module. The scope is the module's FQN in its tree ("" for a
     * root), whoever calls it; one character past the limit is enough for
     * the push to refuse a longer one. */
    tp_tensor *res = NULL;
    char scope[TP__CD_MAX_FQN + 2];
    size_t len = tp__module_fqn(NULL, m, scope, sizeof scope);
    tp_status st = tp__comm_debug_push_module(scope, len, m->parent ? NULL : m->type_name);
    if (st != TP_OK) {
        tp__error_prefix("%s: %s '%s'", fn, m->type_name, scope);
        goto done;
    }
    /* Entries stay in place while busy (removals only mark them), so the
     * indices hold; a hook added meanwhile is appended and runs too. */
    tp__module_enter(m);
    /* memory accounting on meta: the parameters belong to this scope */
    for (int i = 0; i < m->n_params; i++)
        tp__meta_mem_tag(m->params[i], TP_MEM_PARAMETERS, scope);
    for (int i = 0; i < m->n_pre && st == TP_OK; i++) {
        tp_forward_pre_hook h = (tp_forward_pre_hook)m->pre_hooks[i].fn;
        if (h)
            st = h(m, nargs, a, nkw, k, m->pre_hooks[i].ctx);
    }
    if (st == TP_OK) {
        st = m->recompute != TP_RECOMPUTE_NONE && tp_grad_enabled()
                 ? tp__recompute_forward(m, nargs, a, nkw, k, &res)
                 : m->forward(m, nargs, a, nkw, k, &res);
        if (st == TP_OK && !res)
            st = tp__error(TP_ERR_STATE, "%s: the forward of %s returned no output", fn,
                           m->type_name);
    }
    for (int i = 0; i < m->n_post && st == TP_OK; i++) {
        tp_forward_hook h = (tp_forward_hook)m->post_hooks[i].fn;
        if (h)
            st = h(m, nargs, a, &res, m->post_hooks[i].ctx);
    }
    tp__module_leave(m);
    (void)tp_comm_debug_pop_scope();

done:
    for (int i = 0; i < nargs; i++)
        tp_tensor_release(a[i]);
    for (int i = 0; i < nkw; i++)
        tp_tensor_release(k[i].value);
    if (a != a_inline)
        tp__free(a);
    if (k != k_inline)
        tp__free(k);
    if (st != TP_OK) {
        tp_tensor_release(res);
        return st;
    }
    *out = res;
    return TP_OK;
}

tp_status tp_module_call(tp_module *m, tp_tensor *x, tp_tensor **out)
{
    return tp_module_forward(m, 1, &x, 0, NULL, out);
}

void tp_module_set_training(tp_module *m, bool training)
{
    if (!m)
        return;
    m->training = training;
    for (int i = 0; i < m->n_children; i++)
        tp_module_set_training(m->children[i], training);
}

bool tp_module_is_training(const tp_module *m) { return m && m->training; }
