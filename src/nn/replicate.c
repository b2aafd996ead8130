/* Replication of a module tree onto devices (torch.nn.parallel.replicate):
 * new module headers throughout, parameters shared with the original on its
 * own device and deep-copied elsewhere. */
#include <string.h>

#include "nn/nn_internal.h"

/* Where tensors of a (logical) device live: every logical CPU device is the
 * host. */
static tp_device tp__physical(tp_device d)
{
    return d.type == TP_DEVICE_CPU ? TP_CPU : d;
}

static const tp_tensor *tp__first_param(const tp_module *m)
{
    for (int i = 0; i < m->n_params; i++)
        if (m->params[i])
            return m->params[i];
    for (int i = 0; i < m->n_children; i++) {
        const tp_tensor *p = tp__first_param(m->children[i]);
        if (p)
            return p;
    }
    return NULL;
}

/* A CUDA parameter wins over the recorded logical device, so a module moved
 * with tp_module_to reports where its parameters went; CPU parameters cannot
 * tell logical devices apart, so the recorded one stands (unless it still
 * names a CUDA device the parameters were moved off). */
tp_device tp_module_device(const tp_module *m)
{
    if (!m)
        return (tp_device){TP_DEVICE_CPU, -1};
    const tp_tensor *p = tp__first_param(m);
    if (p) {
        tp_device d = tp_tensor_device(p);
        if (d.type == TP_DEVICE_CUDA)
            return d;
        return m->device.type == TP_DEVICE_CPU ? m->device : TP_CPU;
    }
    return m->device;
}

/* ---- the copy ------------------------------------------------------------------ */

typedef struct {
    tp_device src;      /* the original's logical device */
    tp_device dev;      /* this replica's logical device */
    tp_device phys;     /* where its tensors live */
    tp__param_map memo; /* original parameter -> its replica: ties stay ties */
} tp__rep;

/* The replica of parameter p (new reference): an alias when the replica is
 * on the original's device and p is where that device keeps its tensors, a
 * copy otherwise; for a parameter met before (a tied one: the same tensor,
 * or a handle over the same region), that replica or a handle over it. */
static tp_status tp__param_replica(tp__rep *r, const char *owner, const char *name,
                                   tp_tensor *p, tp_tensor **out)
{
    tp_tensor *t = NULL;
    tp_status st = tp__param_map_find(&r->memo, p, &t);
    if (st == TP_OK && !t) {
        if (tp__device_eq(r->dev, r->src) && tp__device_eq(tp_tensor_device(p), r->phys))
            st = tp__tensor_alias(p, &t);
        else
            st = tp_tensor_to(p, tp_tensor_dtype(p), r->phys, &t);
        if (st == TP_OK && tp_tensor_requires_grad(p))
            st = tp_tensor_set_requires_grad(t, true);
    }
    if (st == TP_OK && !tp__param_map_add(&r->memo, p, t))
        st = tp__error(TP_ERR_NO_MEMORY, "out of memory");
    if (st != TP_OK) {
        tp_tensor_release(t);
        tp__error_prefix("parameter '%s' of %s", name, owner);
        return st;
    }
    *out = t; /* the memo's entry lives as long as the module's reference */
    return TP_OK;
}

/* Hooks share the original's ctx: each copy holds a reference, so ctx_free
 * runs once, after the original and every replica have let go. Handles stay
 * the same (each module removes its own copy). Entries already removed but
 * not yet dropped (the original is running) are not copied. */
static tp__hook *tp__hooks_dup(const tp__hook *h, int n, int *nout)
{
    tp__hook *c = tp__malloc((size_t)(n ? n : 1) * sizeof *c);
    if (!c)
        return NULL;
    int k = 0;
    for (int i = 0; i < n; i++)
        if (h[i].fn)
            c[k++] = (tp__hook){h[i].fn, h[i].ctx, tp__ctx_ref_retain(h[i].ref), h[i].id};
    *nout = k;
    return c;
}

/* Builds the replica of src into *out. Messages are prefixed by the caller
 * with the function and the replica. On failure the partial tree is freed:
 * every array count only covers filled entries, so tp_module_free on the
 * partial root releases exactly what was made. */
static tp_status tp__replicate_tree(tp__rep *r, const tp_module *src, tp_module **out)
{
    tp_module *m = tp__calloc(1, sizeof *m);
    if (!m)
        return tp__error(TP_ERR_NO_MEMORY, "out of memory");
    m->kind = src->kind;
    m->cfg = src->cfg;
    m->forward = src->forward;
    m->ctx = src->ctx; /* shared: ctx_free runs after the last module lets go */
    m->ctx_ref = tp__ctx_ref_retain(src->ctx_ref);
    m->next_hook_id = src->next_hook_id;
    m->training = src->training;
    m->recompute = src->recompute;
    m->device = r->dev;
    m->type_name = tp__strdup(src->type_name);
    m->name = tp__strdup(src->name);
    tp_status st = TP_OK;
    if (!m->type_name || !m->name)
        goto oom;
    if (src->n_pre) {
        if (!(m->pre_hooks = tp__hooks_dup(src->pre_hooks, src->n_pre, &m->n_pre)))
            goto oom;
        m->cap_pre = src->n_pre;
    }
    if (src->n_post) {
        if (!(m->post_hooks = tp__hooks_dup(src->post_hooks, src->n_post, &m->n_post)))
            goto oom;
        m->cap_post = src->n_post;
    }
    if (src->n_attached) {
        /* shared, as hook contexts are */
        m->attached = tp__malloc((size_t)src->n_attached * sizeof *m->attached);
        if (!m->attached)
            goto oom;
        m->cap_attached = (size_t)src->n_attached;
        for (int i = 0; i < src->n_attached; i++)
            m->attached[m->n_attached++] =
                (tp__attachment){src->attached[i].key, tp__ctx_ref_retain(src->attached[i].ref)};
    }
    if (src->n_params) {
        m->param_names = tp__calloc((size_t)src->n_params, sizeof *m->param_names);
        m->params = tp__calloc((size_t)src->n_params, sizeof *m->params);
        if (!m->param_names || !m->params)
            goto oom;
        m->cap_params = src->n_params;
        for (int i = 0; i < src->n_params; i++) {
            char *name = tp__strdup(src->param_names[i]);
            if (!name)
                goto oom;
            tp_tensor *t = NULL;
            if (src->params[i]) {
                st = tp__param_replica(r, src->type_name, src->param_names[i], src->params[i],
                                       &t);
                if (st != TP_OK) {
                    tp__free(name);
                    goto fail;
                }
            }
            m->param_names[i] = name;
            m->params[i] = t;
            m->n_params++;
        }
    }
    if (src->n_children) {
        m->children = tp__calloc((size_t)src->n_children, sizeof *m->children);
        if (!m->children)
            goto oom;
        m->cap_children = src->n_children;
        for (int i = 0; i < src->n_children; i++) {
            tp_module *c = NULL;
            st = tp__replicate_tree(r, src->children[i], &c);
            if (st != TP_OK)
                goto fail;
            c->parent = m;
            m->children[m->n_children++] = c;
        }
    }
    *out = m;
    return TP_OK;
oom:
    st = tp__error(TP_ERR_NO_MEMORY, "out of memory");
fail:
    tp_module_free(m);
    return st;
}

/* ---- checks ---------------------------------------------------------------------- */

static tp_status tp__check_device(const char *fn, int i, tp_device d)
{
    TP_ARG_CHECK(d.type == TP_DEVICE_CPU || d.type == TP_DEVICE_CUDA,
                 "%s: devices[%d] has the unknown device type %d", fn, i, (int)d.type);
    const char *type = d.type == TP_DEVICE_CPU ? "cpu" : "cuda";
    TP_ARG_CHECK(d.index >= 0, "%s: devices[%d] is %s:%d, a negative index", fn, i, type,
                 d.index);
    if (d.type == TP_DEVICE_CUDA) {
        int count = tp_cuda_device_count();
        if (count == 0)
            return tp__error(TP_ERR_NOT_SUPPORTED, "%s: devices[%d] is cuda:%d, unavailable (%s)",
                             fn, i, d.index, tp__cuda_unavailable_reason());
        TP_ARG_CHECK(d.index < count, "%s: devices[%d] is cuda:%d but there are %d CUDA devices",
                     fn, i, d.index, count);
    }
    return TP_OK;
}

/* The first DTensor parameter of the subtree, with its owner, or NULL. */
static const tp_module *tp__find_dtensor(const tp_module *m, int *index)
{
    for (int i = 0; i < m->n_params; i++)
        if (m->params[i] && tp_tensor_is_dtensor(m->params[i])) {
            *index = i;
            return m;
        }
    for (int i = 0; i < m->n_children; i++) {
        const tp_module *o = tp__find_dtensor(m->children[i], index);
        if (o)
            return o;
    }
    return NULL;
}

static tp_status tp__check_replicate(const char *fn, const tp_module *module,
                                     const tp_device *devices, int n)
{
    TP_ARG_CHECK(module, "%s: module is NULL", fn);
    TP_ARG_CHECK(devices, "%s: devices is NULL", fn);
    TP_ARG_CHECK(n > 0, "%s: n is %d; at least one device is needed", fn, n);
    TP_ARG_CHECK(!module->parent,
                 "%s: the module '%s' (%s) is a child of %s; replicate the root of its tree",
                 fn, module->name, module->type_name, module->parent->type_name);
    for (int i = 0; i < n; i++)
        TP_CHECK(tp__check_device(fn, i, devices[i]));
    int pi = -1;
    const tp_module *o = tp__find_dtensor(module, &pi);
    if (o) {
        char path[256];
        tp__module_fqn(module, o, path, sizeof path);
        return tp__error(TP_ERR_NOT_SUPPORTED,
                         "%s: parameter '%s%s%s' is a DTensor; replicating a tensor-parallel "
                         "module is not supported (replicate before tp_parallelize_module)",
                         fn, path, path[0] ? "." : "", o->param_names[pi]);
    }
    return TP_OK;
}

tp_status tp_module_replicate(tp_module *module, const tp_device *devices, int n,
                              tp_module **replicas)
{
    const char *fn = "tp_module_replicate";
    TP_ARG_CHECK(replicas, "%s: replicas is NULL", fn);
    for (int i = 0; i < n; i++)
        replicas[i] = NULL;
    TP_CHECK(tp__check_replicate(fn, module, devices, n));

    tp__rep r = {.src = tp_module_device(module)};
    tp_status st = TP_OK;
    for (int i = 0; i < n && st == TP_OK; i++) {
        r.dev = devices[i];
        r.phys = tp__physical(devices[i]);
        r.memo.n = 0;
        st = tp__replicate_tree(&r, module, &replicas[i]);
        if (st != TP_OK)
            tp__error_prefix("%s: replica %d (%s:%d)", fn, i,
                             devices[i].type == TP_DEVICE_CPU ? "cpu" : "cuda",
                             devices[i].index);
    }
    tp__free(r.memo.v);
    if (st != TP_OK)
        for (int i = 0; i < n; i++) {
            tp_module_free(replicas[i]);
            replicas[i] = NULL;
        }
    return st;
}
