/* The module tree: children, parameters, FQNs, hooks, forward dispatch and
 * freeing. The built-in kinds (builtin.c) set `forward` like a custom module
 * does, so dispatch here is the same for every kind. */
#include <limits.h>
#include <string.h>

#include "collectives/comm_debug_internal.h"
#include "nn/nn_internal.h"

/* ---- growable arrays ------------------------------------------------------ */

/* Makes room for one more element in *v (n used, *cap allocated). The old
 * block is kept on failure. */
static bool tp__grow(void **v, int n, int *cap, size_t elem)
{
    if (n < *cap)
        return true;
    int ncap = *cap ? *cap * 2 : 4;
    void *nv = tp__malloc((size_t)ncap * elem);
    if (!nv)
        return false;
    if (n)
        memcpy(nv, *v, (size_t)n * elem);
    tp__free(*v);
    *v = nv;
    *cap = ncap;
    return true;
}

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
    if (!tp__grow((void **)&parent->children, parent->n_children, &parent->cap_children,
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
    int cap_names = m->cap_params;
    if (!tp__grow((void **)&m->param_names, m->n_params, &cap_names, sizeof *m->param_names) ||
        !tp__grow((void **)&m->params, m->n_params, &m->cap_params, sizeof *m->params)) {
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

/* The tensors already reported by a deduplicating walk. */
typedef struct {
    const tp_tensor **v;
    size_t n, cap;
} tp__seen;

/* seen NULL: every name is reported. Otherwise a tensor reached under a
 * second name (a tied weight) is skipped, as PyTorch's named_parameters()
 * does by default. */
static tp_status tp__walk_params(tp_module *m, tp__path *path, tp__seen *seen,
                                 tp_status (*fn)(const char *, tp_tensor *, void *), void *ctx)
{
    size_t base = path->len;
    for (int i = 0; i < m->n_params; i++) {
        if (!m->params[i])
            continue;
        if (seen) {
            bool again = false;
            for (size_t k = 0; k < seen->n && !again; k++)
                again = seen->v[k] == m->params[i];
            if (again)
                continue;
            if (!tp__grow_array((void **)&seen->v, seen->n, &seen->cap, sizeof *seen->v))
                return tp__error(TP_ERR_NO_MEMORY, "tp_module_named_parameters: out of memory");
            seen->v[seen->n++] = m->params[i];
        }
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
        tp_status st = tp__walk_params(m->children[i], path, seen, fn, ctx);
        tp__path_pop(path, base);
        if (st != TP_OK)
            return st;
    }
    return TP_OK;
}

/* ---- moving between devices ------------------------------------------------- */

typedef struct {
    tp_module *m;
    int i;
    tp_tensor *old; /* borrowed: the module holds it until the swap */
    tp_tensor *t;   /* the moved parameter (a reference) */
} tp__move;

typedef struct {
    tp__move *v;
    int n, cap;
    tp_device dev;
} tp__moves;

static bool tp__on(const tp_tensor *t, tp_device dev)
{
    tp_device d = tp_tensor_device(t);
    return d.type == dev.type && d.index == dev.index;
}

/* A copy of parameter p on dev: a plain copy, or a DTensor over a copy of
 * its local shard with p's layout. Marked requires_grad. */
static tp_status tp__moved(tp_tensor *p, tp_device dev, tp_tensor **out)
{
    tp_tensor *r = NULL;
    tp_status st;
    if (tp_tensor_is_dtensor(p)) {
        tp_tensor *l = tp_dtensor_local(p), *nl = NULL;
        st = tp_tensor_to(l, tp_tensor_dtype(l), dev, &nl);
        if (st == TP_OK) {
            tp_mesh *mesh = tp_dtensor_mesh(p);
            tp_from_local_options o = {.global_shape = tp_tensor_shape(p), .check = false};
            st = tp_dtensor_from_local(mesh, nl, tp_mesh_ndim(mesh), tp_dtensor_placements(p), &o,
                                       &r);
        }
        tp_tensor_release(nl);
    } else {
        st = tp_tensor_to(p, tp_tensor_dtype(p), dev, &r);
    }
    if (st == TP_OK)
        st = tp_tensor_set_requires_grad(r, true);
    if (st != TP_OK) {
        tp_tensor_release(r);
        return st;
    }
    *out = r;
    return TP_OK;
}

/* A second handle over the storage of `moved` with the layout of `like` (a
 * handle over the same region as the parameter `moved` was copied from):
 * handles that were one parameter before the move stay one. */
static tp_status tp__moved_alias(tp_tensor *moved, tp_tensor *like, tp_tensor **out)
{
    tp_tensor *r = NULL;
    tp_status st;
    if (tp_tensor_is_dtensor(moved)) {
        tp_tensor *l = tp_dtensor_local(moved), *v = NULL;
        st = tp_tensor_view(l, tp_tensor_ndim(l), tp_tensor_shape(l), &v);
        if (st == TP_OK) {
            tp_mesh *mesh = tp_dtensor_mesh(like);
            tp_from_local_options o = {.global_shape = tp_tensor_shape(like), .check = false};
            st = tp_dtensor_from_local(mesh, v, tp_mesh_ndim(mesh), tp_dtensor_placements(like),
                                       &o, &r);
        }
        tp_tensor_release(v);
    } else {
        st = tp_tensor_view(moved, tp_tensor_ndim(moved), tp_tensor_shape(moved), &r);
    }
    if (st == TP_OK)
        st = tp_tensor_set_requires_grad(r, true);
    if (st != TP_OK) {
        tp_tensor_release(r);
        return st;
    }
    *out = r;
    return TP_OK;
}

/* A tied parameter (one tensor under several names, or handles over one
 * storage region: tp__param_same) is copied once; every name gets the copy. */
static tp_status tp__collect_moves(tp_module *m, tp__moves *mv)
{
    for (int i = 0; i < m->n_params; i++) {
        tp_tensor *old = m->params[i];
        if (!old || tp__on(old, mv->dev))
            continue;
        if (!tp__grow((void **)&mv->v, mv->n, &mv->cap, sizeof *mv->v))
            return tp__error(TP_ERR_NO_MEMORY, "tp_module_to: out of memory");
        tp_tensor *t = NULL;
        tp_status st = TP_OK;
        for (int k = 0; k < mv->n && !t; k++)
            if (mv->v[k].old == old)
                t = tp_tensor_retain(mv->v[k].t);
        for (int k = 0; k < mv->n && !t && st == TP_OK; k++)
            if (tp__param_same(mv->v[k].old, old))
                st = tp__moved_alias(mv->v[k].t, old, &t);
        if (!t && st == TP_OK)
            st = tp__moved(old, mv->dev, &t);
        if (st != TP_OK) {
            tp__error_prefix("tp_module_to: parameter '%s' of %s", m->param_names[i],
                             m->type_name);
            return st;
        }
        mv->v[mv->n++] = (tp__move){m, i, old, t};
    }
    for (int i = 0; i < m->n_children; i++)
        TP_CHECK(tp__collect_moves(m->children[i], mv));
    return TP_OK;
}

tp_status tp_module_to(tp_module *m, tp_device device)
{
    TP_ARG_CHECK(m, "tp_module_to: module is NULL");
    if (device.type == TP_DEVICE_CUDA && tp_cuda_device_count() == 0)
        return tp__error(TP_ERR_NOT_SUPPORTED, "tp_module_to: CUDA device %d unavailable (%s)",
                         device.index,
                         TP_HAVE_CUDA ? "no CUDA device" : "libtp was built without CUDA");
    tp__moves mv = {.dev = device};
    tp_status st = tp__collect_moves(m, &mv);
    for (int k = 0; k < mv.n; k++) {
        if (st == TP_OK) { /* all copies made: swap them in */
            tp_tensor *old = mv.v[k].m->params[mv.v[k].i];
            mv.v[k].m->params[mv.v[k].i] = mv.v[k].t;
            tp_tensor_release(old);
        } else {
            tp_tensor_release(mv.v[k].t);
        }
    }
    tp__free(mv.v);
    return st;
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
    tp__seen seen = {0};
    tp_status st = tp__walk_params(m, &path, unique ? &seen : NULL, fn, ctx);
    tp__free(path.s);
    tp__free(seen.v);
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

static tp__hook **tp__hook_list(tp_module *m, int which, int **n, int **cap)
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
    TP_ARG_CHECK(m->next_hook_id < INT_MAX, "%s: %s has run out of hook handles", fn,
                 m->type_name);
    int *n = NULL, *cap = NULL;
    tp__hook **v = tp__hook_list(m, which, &n, &cap);
    if (!tp__grow((void **)v, *n, cap, sizeof **v))
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
        int *n = NULL, *cap = NULL;
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
        int *n = NULL, *cap = NULL;
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
    for (int i = 0; i < m->n_pre && st == TP_OK; i++) {
        tp_forward_pre_hook h = (tp_forward_pre_hook)m->pre_hooks[i].fn;
        if (h)
            st = h(m, nargs, a, nkw, k, m->pre_hooks[i].ctx);
    }
    if (st == TP_OK) {
        st = m->forward(m, nargs, a, nkw, k, &res);
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
