/* Activation recomputation (tp/nn.h, "activation recomputation").
 *
 * A module set to recompute runs its forward without recording and is
 * recorded as one custom function (tp_function_attach) whose inputs are the
 * module's inputs that require grad and the parameters of its subtree that
 * do. Its backward runs the forward again with recording on, from detached
 * copies of those inputs, and differentiates it with tp_autograd_grad: the
 * gradients of the inputs and parameters come back as the function's input
 * gradients, so autograd adds them into the parameters (their hooks, data
 * parallelism's among them, fire as without recomputation).
 *
 * Selective recomputation keeps more: while the forward runs, the outputs
 * of the ops that tp__recompute_stash_* marks as kept (GEMMs, attention,
 * collectives: ops_internal.h's stash points) are appended to a stash; the
 * recompute replays them in order instead of computing them again. */
#include <string.h>

#include "dtensor/stash.h"
#include "nn/nn_internal.h"
#include "tp/comm_debug.h"

/* The Dropout modules of a subtree and the counter each had before the
 * forward, so that the recompute draws the same masks. */
typedef struct tp__rc_drop {
    tp_module *m;
    uint64_t calls;
} tp__rc_drop;

typedef struct tp__rc {
    tp_module *m; /* borrowed: outlives the graph (documented) */
    tp_recompute_mode mode;
    int nargs, nkw;
    tp_tensor **args; /* retained: the forward's inputs, all of them */
    tp_kwarg *kw;     /* names copied (kw_names), values retained */
    char *kw_names;
    /* the function's inputs: n_args_in entries of args/kw (arg_of: index
     * into args, or nargs + index into kw), then the parameters */
    int n_in, n_args_in;
    int *arg_of;
    tp_tensor **in; /* retained */
    int n_drop;
    tp__rc_drop *drop;
    tp__stash *stash; /* selective: the kept outputs, in the order made */
} tp__rc;

static void tp__rc_free(void *p)
{
    tp__rc *rc = p;
    if (!rc)
        return;
    for (int i = 0; i < rc->nargs; i++)
        tp_tensor_release(rc->args[i]);
    for (int i = 0; i < rc->nkw; i++)
        tp_tensor_release(rc->kw[i].value);
    for (int i = 0; i < rc->n_in; i++)
        tp_tensor_release(rc->in[i]);
    tp__stash_free(rc->stash);
    tp__free(rc->args);
    tp__free(rc->kw);
    tp__free(rc->kw_names);
    tp__free(rc->arg_of);
    tp__free(rc->in);
    tp__free(rc->drop);
    tp__free(rc);
}

/* ---- building the record ------------------------------------------------------- */

typedef struct {
    tp__rc *rc;
    size_t cap;
} tp__rc_build;

static tp_status tp__rc_push_in(tp__rc_build *b, tp_tensor *t)
{
    tp__rc *rc = b->rc;
    if (!tp__grow_array((void **)&rc->in, (size_t)rc->n_in, &b->cap, sizeof *rc->in))
        return tp__error(TP_ERR_NO_MEMORY, "out of memory");
    rc->in[rc->n_in++] = tp_tensor_retain(t);
    return TP_OK;
}

static tp_status tp__rc_param(const char *fqn, tp_tensor *p, void *ctx)
{
    (void)fqn;
    if (!p || !tp_tensor_requires_grad(p))
        return TP_OK;
    return tp__rc_push_in(ctx, p);
}

static tp_status tp__rc_drops(tp__rc *rc, tp_module *m, size_t *cap)
{
    if (m->kind == TP_MODULE_DROPOUT) {
        if (!tp__grow_array((void **)&rc->drop, (size_t)rc->n_drop, cap, sizeof *rc->drop))
            return tp__error(TP_ERR_NO_MEMORY, "out of memory");
        rc->drop[rc->n_drop++] = (tp__rc_drop){m, m->cfg.dropout.calls};
    }
    for (int i = 0; i < m->n_children; i++)
        TP_CHECK(tp__rc_drops(rc, m->children[i], cap));
    return TP_OK;
}

static tp_status tp__rc_build_record(tp_module *m, int nargs, tp_tensor **args, int nkw,
                                     tp_kwarg *kw, tp__rc **out)
{
    tp__rc *rc = tp__calloc(1, sizeof *rc);
    if (!rc)
        return tp__error(TP_ERR_NO_MEMORY, "out of memory");
    rc->m = m;
    rc->mode = m->recompute;
    size_t names = 0;
    for (int i = 0; i < nkw; i++)
        names += strlen(kw[i].name) + 1;
    int n_args = nargs + nkw;
    if ((nargs && !(rc->args = tp__calloc((size_t)nargs, sizeof *rc->args))) ||
        (nkw && !(rc->kw = tp__calloc((size_t)nkw, sizeof *rc->kw))) ||
        (nkw && !(rc->kw_names = tp__malloc(names))) ||
        (n_args && !(rc->arg_of = tp__calloc((size_t)n_args, sizeof *rc->arg_of)))) {
        tp__rc_free(rc);
        return tp__error(TP_ERR_NO_MEMORY, "out of memory");
    }
    rc->nargs = nargs;
    for (int i = 0; i < nargs; i++)
        rc->args[i] = tp_tensor_retain(args[i]);
    char *name = rc->kw_names;
    for (int i = 0; i < nkw; i++) {
        size_t len = strlen(kw[i].name) + 1;
        memcpy(name, kw[i].name, len);
        rc->kw[i].name = name;
        rc->kw[i].value = tp_tensor_retain(kw[i].value);
        rc->nkw = i + 1;
        name += len;
    }
    tp__rc_build b = {rc, 0};
    tp_status st = TP_OK;
    for (int i = 0; i < n_args && st == TP_OK; i++) {
        tp_tensor *t = i < nargs ? args[i] : kw[i - nargs].value;
        if (t && tp_tensor_requires_grad(t)) {
            rc->arg_of[rc->n_args_in] = i;
            st = tp__rc_push_in(&b, t);
            if (st == TP_OK)
                rc->n_args_in++;
        }
    }
    if (st == TP_OK)
        st = tp__module_walk_params(m, true, tp__rc_param, &b);
    size_t cap = 0;
    if (st == TP_OK)
        st = tp__rc_drops(rc, m, &cap);
    if (st != TP_OK) {
        tp__rc_free(rc);
        return st;
    }
    *out = rc;
    return TP_OK;
}

/* Sets every recorded Dropout's counter from rc (the forward's), keeping the
 * current ones in now[] to put back. */
static void tp__rc_rewind(tp__rc *rc, uint64_t *now)
{
    for (int i = 0; i < rc->n_drop; i++) {
        now[i] = rc->drop[i].m->cfg.dropout.calls;
        rc->drop[i].m->cfg.dropout.calls = rc->drop[i].calls;
    }
}

static void tp__rc_restore(tp__rc *rc, const uint64_t *now)
{
    for (int i = 0; i < rc->n_drop; i++)
        rc->drop[i].m->cfg.dropout.calls = now[i];
}

/* ---- backward: the forward again, differentiated ------------------------------ */

static tp_status tp__rc_backward(void *ctx, tp_tensor *grad_out, int n, tp_tensor **grad_in)
{
    tp__rc *rc = ctx;
    tp_module *m = rc->m;
    tp_status st = TP_OK;
    uint64_t now_inline[8], *now = now_inline;
    tp_tensor *a_inline[8], **a = a_inline;
    tp_kwarg k_inline[8], *k = k_inline;
    tp_tensor *leaves_inline[16], **leaves = leaves_inline;
    if ((rc->n_drop > 8 && !(now = tp__malloc((size_t)rc->n_drop * sizeof *now))) ||
        (rc->nargs > 8 && !(a = tp__malloc((size_t)rc->nargs * sizeof *a))) ||
        (rc->nkw > 8 && !(k = tp__malloc((size_t)rc->nkw * sizeof *k))) ||
        (n > 16 && !(leaves = tp__malloc((size_t)n * sizeof *leaves)))) {
        st = tp__error(TP_ERR_NO_MEMORY, "out of memory");
        goto out;
    }
    for (int i = 0; i < rc->nargs; i++)
        a[i] = rc->args[i];
    for (int i = 0; i < rc->nkw; i++)
        k[i] = rc->kw[i];
    /* the inputs that require grad become leaves of the recomputed graph */
    int made = 0;
    for (; made < rc->n_args_in && st == TP_OK; made++) {
        int j = rc->arg_of[made];
        tp_tensor *d = NULL;
        st = tp_tensor_detach(rc->in[made], &d);
        if (st == TP_OK && (st = tp_tensor_set_requires_grad(d, true)) != TP_OK)
            tp_tensor_release(d);
        if (st != TP_OK)
            break;
        leaves[made] = d;
        if (j < rc->nargs)
            a[j] = d;
        else
            k[j - rc->nargs].value = d;
    }
    for (int i = rc->n_args_in; i < n; i++)
        leaves[i] = rc->in[i];

    tp_tensor *res = NULL;
    if (st == TP_OK) {
        int token = tp_enable_grad_begin();
        tp_phase phase = tp_comm_debug_phase();
        tp_comm_debug_set_phase(TP_PHASE_RECOMPUTE);
        tp__rc_rewind(rc, now);
        bool replay = rc->stash && tp__stash_replay_begin(rc->stash);
        st = m->forward(m, rc->nargs, a, rc->nkw, k, &res);
        if (replay)
            st = tp__stash_replay_end(rc->stash, st);
        tp__rc_restore(rc, now);
        tp_comm_debug_set_phase(phase);
        if (st == TP_OK && !res)
            st = tp__error(TP_ERR_STATE, "the forward of %s returned no output",
                           m->type_name);
        if (st == TP_OK)
            st = tp_autograd_grad(res, grad_out, n, leaves, grad_in);
        tp_enable_grad_end(token);
    }
    if (st != TP_OK)
        tp__error_prefix("recomputing %s", m->type_name);
    tp_tensor_release(res);
    for (int i = 0; i < made; i++)
        tp_tensor_release(leaves[i]);
out:
    if (now != now_inline)
        tp__free(now);
    if (a != a_inline)
        tp__free(a);
    if (k != k_inline)
        tp__free(k);
    if (leaves != leaves_inline)
        tp__free(leaves);
    return st;
}

/* ---- forward ---------------------------------------------------------------------- */

tp_status tp__recompute_forward(tp_module *m, int nargs, tp_tensor **args, int nkw,
                                tp_kwarg *kw, tp_tensor **out)
{
    *out = NULL;
    /* inside a selective recompute's forward (recording or replaying its
     * stash), a module runs as it is: its ops are the outer one's to keep */
    if (tp__stash_active())
        return m->forward(m, nargs, args, nkw, kw, out);
    tp__rc *rc = NULL;
    TP_CHECK(tp__rc_build_record(m, nargs, args, nkw, kw, &rc));
    if (rc->n_in == 0) { /* nothing to differentiate: nothing to recompute */
        tp__rc_free(rc);
        return m->forward(m, nargs, args, nkw, kw, out);
    }
    tp_status st = TP_OK;
    bool stashing = false;
    if (rc->mode == TP_RECOMPUTE_SELECTIVE) {
        st = tp__stash_create(&rc->stash);
        stashing = st == TP_OK && tp__stash_record_begin(rc->stash);
    }
    tp_tensor *res = NULL;
    if (st == TP_OK) {
        tp_no_grad_begin();
        st = m->forward(m, nargs, args, nkw, kw, &res);
        tp_no_grad_end();
    }
    if (stashing)
        tp__stash_record_end(rc->stash);
    if (st == TP_OK && !res)
        st = tp__error(TP_ERR_STATE, "tp_module_forward: the forward of %s returned no output",
                       m->type_name);
    /* an output that is an input (an identity forward) gets its own handle,
     * so that the function does not take over the input's history */
    if (st == TP_OK && tp_tensor_requires_grad(res)) {
        tp_tensor *d = NULL;
        st = tp_tensor_detach(res, &d);
        tp_tensor_release(res);
        res = d;
    }
    if (st == TP_OK) {
        st = tp_function_attach(res, "recompute", rc->n_in, rc->in, tp__rc_backward, rc,
                                tp__rc_free);
        if (st == TP_OK)
            rc = NULL; /* the graph's now */
    }
    tp__rc_free(rc);
    if (st != TP_OK) {
        tp_tensor_release(res);
        return st;
    }
    *out = res;
    return TP_OK;
}

/* ---- settings ---------------------------------------------------------------------- */

static bool tp__recompute_mode_ok(tp_recompute_mode mode)
{
    return mode == TP_RECOMPUTE_NONE || mode == TP_RECOMPUTE_FULL ||
           mode == TP_RECOMPUTE_SELECTIVE;
}

tp_status tp_module_set_recompute(tp_module *m, tp_recompute_mode mode)
{
    const char *fn = "tp_module_set_recompute";
    TP_ARG_CHECK(m, "%s: module is NULL", fn);
    TP_ARG_CHECK(tp__recompute_mode_ok(mode),
                 "%s: mode %d is not TP_RECOMPUTE_NONE, _FULL or _SELECTIVE", fn, (int)mode);
    m->recompute = mode;
    return TP_OK;
}

tp_recompute_mode tp_module_recompute(const tp_module *m)
{
    return m ? m->recompute : TP_RECOMPUTE_NONE;
}

tp_status tp_module_set_recompute_every(tp_module *parent, int every, tp_recompute_mode mode)
{
    const char *fn = "tp_module_set_recompute_every";
    TP_ARG_CHECK(parent, "%s: parent is NULL", fn);
    TP_ARG_CHECK(every >= 1, "%s: every %d must be >= 1", fn, every);
    TP_ARG_CHECK(tp__recompute_mode_ok(mode),
                 "%s: mode %d is not TP_RECOMPUTE_NONE, _FULL or _SELECTIVE", fn, (int)mode);
    for (int i = 0; i < parent->n_children; i++)
        parent->children[i]->recompute = i % every == 0 ? mode : TP_RECOMPUTE_NONE;
    return TP_OK;
}
