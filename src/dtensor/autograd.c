/* Reverse-mode autograd over a tape of op nodes.
 *
 * Every recorded op attaches a node to its output; the node holds references
 * to the inputs that need gradients and whatever the backward needs. The
 * backward walks the nodes reachable from the loss in reverse topological
 * order, summing the gradients that reach a node from several consumers
 * before calling it, and frees each node's saved state as soon as it ran. */
#include <stdio.h>
#include <string.h>

#include "core/meta_mem.h"
#include "dtensor/ops_internal.h"

static _Thread_local int tp__no_grad_depth;

void tp_no_grad_begin(void) { tp__no_grad_depth++; }
void tp_no_grad_end(void)
{
    if (tp__no_grad_depth > 0)
        tp__no_grad_depth--;
}
bool tp_grad_enabled(void) { return tp__no_grad_depth == 0; }

/* t's autograd state, created when missing; NULL when out of memory. */
static tp__autograd *tp__meta(tp_tensor *t)
{
    tp__ext *e = tp__ext_get(t);
    return e ? &e->ag : NULL;
}

bool tp_tensor_requires_grad(const tp_tensor *t)
{
    tp__autograd *ag = tp__ag_of(t);
    return ag && ag->requires_grad;
}

bool tp_tensor_has_grad_fn(const tp_tensor *t)
{
    tp__autograd *ag = tp__ag_of(t);
    return ag && ag->grad_fn;
}

/* ---- pending gradients (grad_pending.h) ------------------------------------- */

void tp__grad_pending_set(tp_tensor *t, tp__grad_pending_fn fn, void *ctx)
{
    tp__autograd *ag = tp__ag_of(t);
    if (!ag)
        return;
    ag->pending = fn;
    ag->pending_ctx = fn ? ctx : NULL;
}

tp_tensor *tp__grad_peek(const tp_tensor *t)
{
    tp__autograd *ag = tp__ag_of(t);
    return ag ? ag->grad : NULL;
}

/* Finishes the work that owns t's gradient before fn touches it. */
static tp_status tp__grad_settle(tp_tensor *t, const char *fn)
{
    tp__autograd *ag = tp__ag_of(t);
    if (!ag || !ag->pending)
        return TP_OK;
    tp_status st = ag->pending(t, fn, ag->pending_ctx);
    if (st != TP_OK && !tp_last_error()[0])
        tp__error(st, "%s: finishing the pending gradient failed", fn);
    return st;
}

/* ---- gradients ---------------------------------------------------------------- */

tp_tensor *tp_tensor_grad(const tp_tensor *t)
{
    tp__autograd *ag = tp__ag_of(t);
    if (!ag)
        return NULL;
    /* the tensor is the caller's; only its autograd state changes */
    if (tp__grad_settle((tp_tensor *)t, "tp_tensor_grad") != TP_OK)
        return NULL;
    return ag->grad;
}

void tp_tensor_zero_grad(tp_tensor *t)
{
    tp__autograd *ag = tp__ag_of(t);
    if (!ag)
        return;
    /* a gradient in flight is finished first, so that nothing still writes
     * into it; if that fails, the owner has recorded the failure (the DDP's
     * is sticky) and the gradient is dropped all the same */
    (void)tp__grad_settle(t, "tp_tensor_zero_grad");
    tp_tensor_release(ag->grad);
    ag->grad = NULL;
    ag->grad_owned = false;
}

tp_status tp_tensor_set_grad(tp_tensor *t, tp_tensor *g)
{
    const char *fn = "tp_tensor_set_grad";
    TP_ARG_CHECK(t, "%s: t is NULL", fn);
    TP_ARG_CHECK(tp_tensor_requires_grad(t), "%s: t does not require grad", fn);
    if (!g) {
        tp_tensor_zero_grad(t);
        return TP_OK;
    }
    TP_ARG_CHECK(g != t, "%s: a tensor cannot be its own gradient", fn);
    TP_ARG_CHECK(!tp_tensor_has_grad_fn(g), "%s: g is the output of a recorded op", fn);
    TP_ARG_CHECK(!tp__dist_of(t) == !tp__dist_of(g), "%s: t is %s but g is %s", fn,
                 tp__dist_of(t) ? "a DTensor" : "plain", tp__dist_of(g) ? "a DTensor" : "plain");
    TP_ARG_CHECK(g->dtype == t->dtype, "%s: g is %s, t is %s", fn, tp_dtype_name(g->dtype),
                 tp_dtype_name(t->dtype));
    if (g->ndim != t->ndim || memcmp(g->shape, t->shape, sizeof(int64_t) * (size_t)t->ndim)) {
        char a[200], b[200];
        return tp__error(TP_ERR_INVALID_ARG, "%s: g has shape %s, t has %s", fn,
                         tp__shape_str(g->ndim, g->shape, a, sizeof a),
                         tp__shape_str(t->ndim, t->shape, b, sizeof b));
    }
    if (tp__dist_of(t)) {
        TP_ARG_CHECK(tp__dist_of(g)->mesh == tp__dist_of(t)->mesh,
                     "%s: g is on another mesh than t", fn);
    } else {
        TP_CHECK(tp__same_device(fn, "t", t, "g", g));
    }
    TP_CHECK(tp__grad_settle(t, fn));
    tp__autograd *ag = tp__ag_of(t);
    tp_tensor_retain(g);
    tp_tensor_release(ag->grad);
    ag->grad = g;
    ag->grad_owned = true;
    tp__meta_mem_tag(g, TP_MEM_GRADIENTS, NULL); /* memory accounting on meta */
    return TP_OK;
}

tp_status tp_tensor_add_grad_hook(tp_tensor *t, tp_grad_hook_fn fn_, void *ctx, int *handle)
{
    const char *fn = "tp_tensor_add_grad_hook";
    TP_ARG_CHECK(t, "%s: t is NULL", fn);
    TP_ARG_CHECK(fn_, "%s: fn is NULL", fn);
    TP_ARG_CHECK(tp_tensor_requires_grad(t), "%s: t does not require grad", fn);
    if (tp_tensor_has_grad_fn(t))
        return tp__error(TP_ERR_STATE, "%s: t is the output of a recorded op; hooks go on leaves",
                         fn);
    tp__autograd *ag = tp__ag_of(t);
    tp__grad_hook *h = tp__calloc(1, sizeof *h);
    if (!h)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    h->fn = fn_;
    h->ctx = ctx;
    h->id = ++ag->next_hook_id;
    tp__grad_hook **tail = &ag->hooks;
    while (*tail)
        tail = &(*tail)->next;
    *tail = h;
    if (handle)
        *handle = h->id;
    return TP_OK;
}

void tp_tensor_remove_grad_hook(tp_tensor *t, int handle)
{
    tp__autograd *ag = tp__ag_of(t);
    if (!ag)
        return;
    for (tp__grad_hook **p = &ag->hooks; *p; p = &(*p)->next) {
        if ((*p)->id == handle) {
            tp__grad_hook *h = *p;
            *p = h->next;
            tp__free(h);
            return;
        }
    }
}

tp_status tp_tensor_set_requires_grad(tp_tensor *t, bool requires_grad)
{
    const char *fn = "tp_tensor_set_requires_grad";
    TP_ARG_CHECK(t, "%s: t is NULL", fn);
    if (tp_tensor_has_grad_fn(t))
        return tp__error(TP_ERR_STATE,
                         "%s: t is the output of a recorded op; only leaves can be marked", fn);
    TP_ARG_CHECK(tp_dtype_is_float(t->dtype), "%s: t is %s; gradients need a float dtype", fn,
                 tp_dtype_name(t->dtype));
    if (!requires_grad && !t->ext)
        return TP_OK;
    tp__autograd *ag = tp__meta(t);
    if (!ag)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    ag->requires_grad = requires_grad;
    return TP_OK;
}

bool tp__needs_grad(int n, tp_tensor *const *inputs)
{
    if (tp__no_grad_depth)
        return false;
    for (int i = 0; i < n; i++)
        if (tp_tensor_requires_grad(inputs[i]))
            return true;
    return false;
}

/* ---- nodes ---------------------------------------------------------------- */

static void tp__node_drop_graph(tp__node *n)
{
    if (n->released)
        return;
    n->released = true;
    if (n->free_saved)
        n->free_saved(n);
    n->saved = NULL;
    for (int i = 0; i < 4; i++) {
        tp_tensor_release(n->saved_t[i]);
        n->saved_t[i] = NULL;
    }
    for (int i = 0; i < n->n_inputs; i++) {
        tp_tensor_release(n->inputs[i]);
        n->inputs[i] = NULL;
    }
    tp_tensor_release(n->grad_acc);
    n->grad_acc = NULL;
}

void tp__node_free_saved(tp__node *node) { tp__free(node->saved); }

void tp__node_release(tp__node *n);
void tp__node_release(tp__node *n)
{
    if (!n || atomic_fetch_sub(&n->refcount, 1) != 1)
        return;
    tp__node_drop_graph(n);
    tp__comm_debug_saved_free(n->scope);
    if (n->inputs != n->inputs_inline)
        tp__free(n->inputs);
    tp__free(n);
}

/* Re-enters the scopes a node was created in, so that collectives of its
 * backward are counted for the module that ran its forward (and the scopes
 * around it). Returns the number of scopes pushed. */
static int tp__enter_scope(const tp__node *n) { return tp__comm_debug_enter(n->scope); }

static void tp__leave_scope(int pushed) { tp__comm_debug_leave(pushed); }

/* A node of n inputs (any n >= 0) attached to out. */
static tp_status tp__node_attach_n(tp_tensor *out, const char *name, tp__backward_fn backward,
                                   int n, tp_tensor *const *inputs, tp__node **node_out)
{
    tp__node *node = tp__calloc(1, sizeof *node);
    tp__autograd *ag = node ? tp__meta(out) : NULL;
    tp_tensor **in = node ? node->inputs_inline : NULL;
    if (node && n > TP__NODE_MAX_INPUTS)
        in = tp__calloc((size_t)n, sizeof *in);
    if (!node || !ag || !in) {
        tp__free(node);
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory for the autograd node", name);
    }
    node->inputs = in;
    atomic_init(&node->refcount, 1);
    if (tp__comm_debug_save(&node->scope) != TP_OK) {
        if (in != node->inputs_inline)
            tp__free(in);
        tp__free(node);
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory for the autograd node", name);
    }
    node->name = name;
    node->backward = backward;
    node->n_inputs = n;
    for (int i = 0; i < n; i++)
        node->inputs[i] = tp_tensor_requires_grad(inputs[i]) ? tp_tensor_retain(inputs[i]) : NULL;
    ag->requires_grad = true;
    ag->grad_fn = node;
    if (node_out)
        *node_out = node;
    return TP_OK;
}

tp_status tp__node_attach(tp_tensor *out, const char *name, tp__backward_fn backward, int n,
                          tp_tensor *const *inputs, tp__node **node_out)
{
    TP_ASSERT(n <= TP__NODE_MAX_INPUTS);
    return tp__node_attach_n(out, name, backward, n, inputs, node_out);
}

/* ---- gradient sums -------------------------------------------------------- */

/* r += b in place; r is contiguous and has b's shape. */
static tp_status tp__add_into_plain(tp_tensor *r, const tp_tensor *b)
{
    if (r->ndim != b->ndim || memcmp(r->shape, b->shape, sizeof(int64_t) * (size_t)r->ndim))
        return tp__error(TP_ERR_INVALID_ARG, "gradient shapes differ");
    int64_t n = tp_tensor_numel(r);
    tp_tensor *bc = NULL;
    tp_status st = tp_tensor_is_contiguous(b) ? TP_OK : tp_tensor_clone(b, &bc);
    const tp_tensor *src = bc ? bc : b;
    if (st == TP_OK)
        st = tp__same_device("backward", "a gradient", r, "the gradient added to it", src);
    const tp__kernels *k = NULL;
    tp_device dev = tp_tensor_device(r);
    if (st == TP_OK && r->dtype == src->dtype && tp__kernels_for(dev, &k) == TP_OK &&
        k->supports(TP__KOP_ACCUMULATE, r->dtype)) {
        /* f32, bf16, f16: the engine adds in f32 and rounds once */
        st = k->accumulate(dev, r->dtype, tp_tensor_data(r), tp_tensor_data(src), n);
    } else if (st == TP_OK && dev.type == TP_DEVICE_META) {
        /* other dtypes on meta: no values to add */
    } else if (st == TP_OK && dev.type == TP_DEVICE_CUDA) {
        /* other dtypes: summed on the host, then copied back */
        tp_tensor *ha = NULL, *hb = NULL;
        st = tp_tensor_to(r, r->dtype, TP_CPU, &ha);
        if (st == TP_OK)
            st = tp_tensor_to(src, src->dtype, TP_CPU, &hb);
        for (int64_t i = 0; st == TP_OK && i < n; i++)
            tp__store_f64(tp_tensor_data(ha), ha->dtype, i,
                          tp__load_f64(tp_tensor_data(ha), ha->dtype, i) +
                              tp__load_f64(tp_tensor_data(hb), hb->dtype, i));
        if (st == TP_OK)
            st = tp_tensor_copy(r, ha);
        tp_tensor_release(ha);
        tp_tensor_release(hb);
    } else if (st == TP_OK) {
        for (int64_t i = 0; i < n; i++)
            tp__store_f64(tp_tensor_data(r), r->dtype, i,
                          tp__load_f64(tp_tensor_data(r), r->dtype, i) +
                              tp__load_f64(tp_tensor_data(src), src->dtype, i));
    }
    tp_tensor_release(bc);
    return st;
}

static tp_status tp__add_plain(tp_tensor *a, tp_tensor *b, tp_tensor **out)
{
    if (a->ndim != b->ndim || memcmp(a->shape, b->shape, sizeof(int64_t) * (size_t)a->ndim))
        return tp__error(TP_ERR_INVALID_ARG, "gradient shapes differ");
    tp_tensor *r = NULL;
    TP_CHECK(tp_tensor_to(a, a->dtype, tp_tensor_device(a), &r));
    tp_status st = tp__add_into_plain(r, b);
    if (st != TP_OK) {
        tp_tensor_release(r);
        return st;
    }
    *out = r;
    return TP_OK;
}

/* a += b in place when a's storage can take it (contiguous, a DTensor's
 * local shard for DTensors, b first brought to a's placements). *done is
 * false (and nothing changed) when it cannot. */
static tp_status tp__grad_add_into(tp_tensor *a, tp_tensor *b, bool *done)
{
    *done = false;
    if (!tp__dist_of(a) && !tp__dist_of(b)) {
        if (!tp_tensor_is_contiguous(a) || a->dtype != b->dtype)
            return TP_OK;
        TP_CHECK(tp__add_into_plain(a, b));
        *done = true;
        return TP_OK;
    }
    if (!tp__dist_of(a) || !tp__dist_of(b))
        return tp__error(TP_ERR_INVALID_ARG, "a plain and a distributed gradient meet");
    tp__dist *da = tp__dist_of(a);
    if (!tp_tensor_is_contiguous(da->local) || a->dtype != b->dtype)
        return TP_OK;
    tp_tensor *bb = NULL;
    TP_CHECK(tp__redistribute(b, da->placements, false, &bb));
    tp_status st = tp__add_into_plain(da->local, tp_dtensor_local(bb));
    tp_tensor_release(bb);
    *done = st == TP_OK;
    return st;
}

tp_status tp__grad_add(tp_tensor *a, tp_tensor *b, tp_tensor **out)
{
    *out = NULL;
    if (!tp__dist_of(a) && !tp__dist_of(b))
        return tp__add_plain(a, b, out);
    if (!tp__dist_of(a) || !tp__dist_of(b))
        return tp__error(TP_ERR_INVALID_ARG, "a plain and a distributed gradient meet");
    tp__dist *da = tp__dist_of(a);
    tp_tensor *bb = NULL, *sum = NULL;
    TP_CHECK(tp__redistribute(b, da->placements, false, &bb));
    tp_status st = tp__add_plain(da->local, tp_dtensor_local(bb), &sum);
    if (st == TP_OK)
        st = tp__dtensor_wrap(da->mesh, sum, da->placements, a->ndim, a->shape, out);
    tp_tensor_release(sum);
    tp_tensor_release(bb);
    return st;
}

/* ---- backward ------------------------------------------------------------- */

typedef struct {
    tp__node **v;
    size_t n, cap;
} tp__nodes;

/* `all` holds a reference on every node it lists: releasing a consumer's
 * inputs during the walk may drop the last tensor that owns a node still
 * waiting in the queue. */
static bool tp__nodes_hold(tp__nodes *s, tp__node *n);

static bool tp__nodes_push(tp__nodes *s, tp__node *n)
{
    if (!tp__grow_array((void **)&s->v, s->n, &s->cap, sizeof *s->v))
        return false;
    s->v[s->n++] = n;
    return true;
}

static bool tp__nodes_hold(tp__nodes *s, tp__node *n)
{
    if (!tp__nodes_push(s, n))
        return false;
    atomic_fetch_add(&n->refcount, 1);
    return true;
}

static tp__node *tp__grad_fn(const tp_tensor *t)
{
    tp__autograd *ag = tp__ag_of(t);
    return ag ? ag->grad_fn : NULL;
}

/* Ones with loss's shape and layout (Replicate where loss is Partial). */
static tp_status tp__ones_like(tp_tensor *loss, tp_tensor **out)
{
    if (!tp__dist_of(loss)) {
        tp_tensor *o = NULL;
        TP_CHECK(tp_tensor_empty(loss->dtype, tp_tensor_device(loss), loss->ndim, loss->shape,
                                 &o));
        tp_status st = tp_tensor_fill(o, 1.0);
        if (st != TP_OK) {
            tp_tensor_release(o);
            return st;
        }
        *out = o;
        return TP_OK;
    }
    tp__dist *d = tp__dist_of(loss);
    tp_placement p[TP_MESH_MAX_DIMS];
    for (int i = 0; i < d->mesh_ndim; i++)
        p[i] = d->placements[i].kind == TP_PLACEMENT_PARTIAL ? tp_replicate() : d->placements[i];
    tp_tensor *o = NULL;
    TP_CHECK(tp__ones_like(d->local, &o));
    tp_status st = tp__dtensor_wrap(d->mesh, o, p, loss->ndim, loss->shape, out);
    tp_tensor_release(o);
    return st;
}

/* The first contribution is kept as is (it may be shared with other leaves
 * or nodes); later ones are summed into a buffer the leaf owns, in place once
 * it owns one. */
static tp_status tp__accumulate_leaf(tp_tensor *leaf, tp_tensor *g)
{
    tp__autograd *ag = tp__ag_of(leaf);
    /* a second backward before the step: the first one's gradient, in
     * flight, is finished before anything is added into it */
    TP_CHECK(tp__grad_settle(leaf, "tp_backward"));
    if (!ag->grad) {
        ag->grad = tp_tensor_retain(g);
        ag->grad_owned = false;
        tp__meta_mem_tag(g, TP_MEM_GRADIENTS, NULL); /* memory accounting on meta */
        return TP_OK;
    }
    if (ag->grad_owned) {
        bool done = false;
        TP_CHECK(tp__grad_add_into(ag->grad, g, &done));
        if (done)
            return TP_OK;
    }
    tp_tensor *sum = NULL;
    TP_CHECK(tp__grad_add(ag->grad, g, &sum));
    tp_tensor_release(ag->grad);
    ag->grad = sum;
    ag->grad_owned = true;
    tp__meta_mem_tag(sum, TP_MEM_GRADIENTS, NULL);
    return TP_OK;
}

/* Runs a leaf's hooks once its last contribution of this backward is in. */
static tp_status tp__leaf_done(tp_tensor *leaf)
{
    tp__autograd *ag = tp__ag_of(leaf);
    if (ag->leaf_pending > 0 && --ag->leaf_pending > 0)
        return TP_OK;
    for (tp__grad_hook *h = ag->hooks; h; h = h->next) {
        tp_status st = h->fn(leaf, h->ctx);
        if (st != TP_OK) {
            if (!tp_last_error()[0])
                tp__error(st, "a gradient hook failed");
            return st;
        }
    }
    return TP_OK;
}

static tp_status tp__accumulate_node(tp__node *n, tp_tensor *g)
{
    if (!n->grad_acc) {
        n->grad_acc = tp_tensor_retain(g);
        return TP_OK;
    }
    tp_tensor *sum = NULL;
    TP_CHECK(tp__grad_add(n->grad_acc, g, &sum));
    tp_tensor_release(n->grad_acc);
    n->grad_acc = sum;
    return TP_OK;
}

typedef struct {
    tp_tensor **v;
    size_t n, cap;
} tp__leaves;

/* Appends a reference to leaf. */
static bool tp__leaves_push(tp__leaves *s, tp_tensor *leaf)
{
    if (!tp__grow_array((void **)&s->v, s->n, &s->cap, sizeof *s->v))
        return false;
    s->v[s->n++] = tp_tensor_retain(leaf);
    return true;
}

/* tp_autograd_grad: the gradients reaching these leaves are summed into
 * grads[] instead of the leaves' own; other leaves receive nothing and no
 * hook runs. */
typedef struct tp__capture {
    int n;
    tp_tensor *const *leaves;
    tp_tensor **grads;
} tp__capture;

static tp_status tp__capture_add(tp__capture *c, tp_tensor *leaf, tp_tensor *g)
{
    for (int j = 0; j < c->n; j++) {
        if (c->leaves[j] != leaf)
            continue;
        if (!c->grads[j]) {
            c->grads[j] = tp_tensor_retain(g);
            return TP_OK;
        }
        tp_tensor *sum = NULL;
        TP_CHECK(tp__grad_add(c->grads[j], g, &sum));
        tp_tensor_release(c->grads[j]);
        c->grads[j] = sum;
        return TP_OK;
    }
    return TP_OK;
}

/* Counts, for every node reachable from root, how many edges lead into it
 * (node->pending), holding each in *all; leaves with hooks get their count
 * too (leaf_pending) and a reference in *leaves, so that their hooks run
 * after their last contribution. */
static tp_status tp__backward_count(const char *fn, tp__node *root, tp__nodes *all,
                                    tp__leaves *leaves, const tp__capture *capture)
{
    tp_status st = TP_OK;
    tp__nodes stack = {0};
    if (!tp__nodes_push(&stack, root) || !tp__nodes_hold(all, root)) {
        tp__free(stack.v);
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    }
    root->pending = 0;
    while (stack.n && st == TP_OK) {
        tp__node *n = stack.v[--stack.n];
        for (int i = 0; i < n->n_inputs; i++) {
            tp__node *p = tp__grad_fn(n->inputs[i]);
            if (!p) {
                tp_tensor *leaf = n->inputs[i];
                tp__autograd *lag = tp__ag_of(leaf);
                if (!capture && lag && lag->hooks && lag->leaf_pending++ == 0 &&
                    !tp__leaves_push(leaves, leaf)) {
                    lag->leaf_pending = 0;
                    st = tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
                    break;
                }
                continue;
            }
            if (p->released) {
                st = tp__error(TP_ERR_STATE, "%s: part of the graph (%s) was already freed by an "
                               "earlier backward", fn, p->name);
                break;
            }
            if (p->pending++ == 0 && (!tp__nodes_push(&stack, p) || !tp__nodes_hold(all, p)))
                st = tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
        }
    }
    tp__free(stack.v);
    return st;
}

/* Runs the counted graph from root, whose gradient is g0 (taken): each node
 * once all the edges into it have delivered, in the backward phase, each in
 * its own comm-debug scope, recording nothing. */
static tp_status tp__backward_run(const char *fn, tp__node *root, tp_tensor *g0,
                                  tp__capture *capture)
{
    tp_status st = TP_OK;
    tp__nodes ready = {0};
    tp_phase saved_phase = tp_comm_debug_phase();
    tp_comm_debug_set_phase(TP_PHASE_BACKWARD);
    /* nodes re-enter their own scopes from the top: leave the caller's */
    tp__node outer = {0};
    int outer_depth = 0;
    if (tp__comm_debug_save(&outer.scope) == TP_OK)
        outer_depth = tp__comm_debug_depth(); /* else keep them: attribution nests */
    tp__leave_scope(outer_depth);
    tp_no_grad_begin(); /* the backward itself records nothing */
    root->grad_acc = g0;
    if (!tp__nodes_push(&ready, root))
        st = tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    while (ready.n && st == TP_OK) {
        tp__node *n = ready.v[--ready.n];
        tp_tensor *gin_inline[TP__NODE_MAX_INPUTS] = {0}, **gin = gin_inline;
        if (n->n_inputs > TP__NODE_MAX_INPUTS &&
            !(gin = tp__calloc((size_t)n->n_inputs, sizeof *gin))) {
            st = tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
            break;
        }
        int pushed = tp__enter_scope(n);
        st = n->backward(n, n->grad_acc, gin);
        tp__leave_scope(pushed);
        if (st != TP_OK)
            tp__error_prefix("%s: backward of %s", fn, n->name);
        for (int i = 0; i < n->n_inputs; i++) {
            tp_tensor *in = n->inputs[i];
            if (st == TP_OK && in && gin[i]) {
                tp__node *p = tp__grad_fn(in);
                if (p) {
                    st = tp__accumulate_node(p, gin[i]);
                    if (st == TP_OK && --p->pending == 0 && !tp__nodes_push(&ready, p))
                        st = tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
                } else if (capture) {
                    st = tp__capture_add(capture, in, gin[i]);
                } else {
                    st = tp__accumulate_leaf(in, gin[i]);
                    if (st == TP_OK && tp__ag_of(in)->hooks)
                        st = tp__leaf_done(in);
                }
            }
            tp_tensor_release(gin[i]);
        }
        if (gin != gin_inline)
            tp__free(gin);
        tp__node_drop_graph(n);
    }
    tp_no_grad_end();
    if (outer.scope) {
        tp__enter_scope(&outer);
        tp__comm_debug_saved_free(outer.scope);
    }
    tp_comm_debug_set_phase(saved_phase);
    tp__free(ready.v);
    return st;
}

/* The gradient of root's graph seeded with grad (NULL: ones for a one-element
 * loss), into the leaves (capture NULL) or into capture->grads. */
static tp_status tp__backward_from(const char *fn, tp_tensor *loss, const tp_tensor *grad,
                                   tp__capture *capture)
{
    TP_ARG_CHECK(loss, "%s: %s is NULL", fn, capture ? "out" : "loss");
    if (!tp_tensor_requires_grad(loss))
        return tp__error(TP_ERR_INVALID_ARG, "%s: %s does not require grad", fn,
                         capture ? "out" : "loss");
    tp_tensor *g0 = NULL;
    if (grad) {
        TP_ARG_CHECK(grad->ndim == loss->ndim &&
                         !memcmp(grad->shape, loss->shape, sizeof(int64_t) * (size_t)loss->ndim),
                     "%s: grad shape differs from %s shape", fn, capture ? "out" : "loss");
        TP_ARG_CHECK(!tp__dist_of(grad) == !tp__dist_of(loss),
                     "%s: grad and %s must both be DTensors or both plain", fn,
                     capture ? "out" : "loss");
        g0 = tp_tensor_retain((tp_tensor *)grad);
    } else {
        TP_ARG_CHECK(tp_tensor_numel(loss) == 1,
                     "%s: %s has %lld elements; pass grad for a non-scalar one", fn,
                     capture ? "out" : "loss", (long long)tp_tensor_numel(loss));
        TP_CHECK(tp__ones_like(loss, &g0));
    }
    tp__node *root = tp__grad_fn(loss);
    if (!root) {
        tp_no_grad_begin();
        tp_status st;
        if (capture) {
            st = tp__capture_add(capture, loss, g0);
        } else {
            st = tp__accumulate_leaf(loss, g0);
            tp__ag_of(loss)->leaf_pending = 0;
            if (st == TP_OK)
                st = tp__leaf_done(loss);
        }
        tp_no_grad_end();
        tp_tensor_release(g0);
        return st;
    }
    if (root->released) {
        tp_tensor_release(g0);
        return tp__error(TP_ERR_STATE, "%s: the graph was already freed by an earlier backward",
                         fn);
    }

    tp__nodes all = {0};
    tp__leaves leaves = {0}; /* leaves with hooks, and their pending counts */
    tp_status st = tp__backward_count(fn, root, &all, &leaves, capture);
    if (st == TP_OK) {
        st = tp__backward_run(fn, root, g0, capture);
        g0 = NULL;
    }

    for (size_t i = 0; i < leaves.n; i++) {
        tp__ag_of(leaves.v[i])->leaf_pending = 0;
        tp_tensor_release(leaves.v[i]);
    }
    tp__free(leaves.v);
    /* whatever was not reached (on failure) is freed too: the graph is spent */
    for (size_t i = 0; i < all.n; i++) {
        all.v[i]->pending = 0;
        tp__node_drop_graph(all.v[i]);
        tp__node_release(all.v[i]);
    }
    tp_tensor_release(g0);
    tp__free(all.v);
    return st;
}

tp_status tp_backward(tp_tensor *loss, const tp_tensor *grad)
{
    return tp__backward_from("tp_backward", loss, grad, NULL);
}

tp_status tp_autograd_grad(tp_tensor *out, const tp_tensor *grad_out, int n,
                           tp_tensor *const *inputs, tp_tensor **grads)
{
    const char *fn = "tp_autograd_grad";
    TP_ARG_CHECK(n >= 0, "%s: n %d is negative", fn, n);
    TP_ARG_CHECK(n == 0 || (inputs && grads), "%s: %s is NULL with %d inputs", fn,
                 inputs ? "grads" : "inputs", n);
    for (int i = 0; i < n; i++)
        grads[i] = NULL;
    for (int i = 0; i < n; i++) {
        TP_ARG_CHECK(inputs[i], "%s: inputs[%d] is NULL", fn, i);
        TP_ARG_CHECK(tp_tensor_requires_grad(inputs[i]), "%s: inputs[%d] does not require grad",
                     fn, i);
        TP_ARG_CHECK(!tp_tensor_has_grad_fn(inputs[i]),
                     "%s: inputs[%d] is the output of a recorded op; gradients are taken with "
                     "respect to leaves (detach it and record from there)", fn, i);
    }
    tp__capture c = {n, inputs, grads};
    tp_status st = tp__backward_from(fn, out, grad_out, &c);
    if (st != TP_OK)
        for (int i = 0; i < n; i++) {
            tp_tensor_release(grads[i]);
            grads[i] = NULL;
        }
    return st;
}

/* ---- custom functions, detach, grad mode --------------------------------------- */

typedef struct tp__function {
    tp_function_backward_fn backward;
    void *ctx;
    void (*ctx_free)(void *ctx);
} tp__function;

static tp_status tp__function_backward(tp__node *node, tp_tensor *grad_out, tp_tensor **grad_in)
{
    tp__function *f = node->saved;
    tp_status st = f->backward(f->ctx, grad_out, node->n_inputs, grad_in);
    if (st != TP_OK && !tp_last_error()[0])
        tp__error(st, "the backward of %s failed", node->name);
    if (st == TP_OK)
        for (int i = 0; i < node->n_inputs; i++)
            if (grad_in[i] && !node->inputs[i]) { /* no gradient flows there */
                tp_tensor_release(grad_in[i]);
                grad_in[i] = NULL;
            }
    return st;
}

static void tp__function_free(tp__node *node)
{
    tp__function *f = node->saved;
    if (f && f->ctx_free)
        f->ctx_free(f->ctx);
    tp__free(f);
}

tp_status tp_function_attach(tp_tensor *out, const char *name, int n, tp_tensor *const *inputs,
                             tp_function_backward_fn backward, void *ctx,
                             void (*ctx_free)(void *ctx))
{
    const char *fn = "tp_function_attach";
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    TP_ARG_CHECK(name, "%s: name is NULL", fn);
    TP_ARG_CHECK(backward, "%s: backward is NULL", fn);
    TP_ARG_CHECK(n >= 0, "%s: n %d is negative", fn, n);
    TP_ARG_CHECK(n == 0 || inputs, "%s: inputs is NULL with %d inputs", fn, n);
    for (int i = 0; i < n; i++)
        TP_ARG_CHECK(inputs[i], "%s: inputs[%d] is NULL", fn, i);
    TP_ARG_CHECK(!tp_tensor_requires_grad(out),
                 "%s (%s): out already requires grad (it was recorded, or is a leaf); compute "
                 "it inside tp_no_grad_begin/end or pass tp_tensor_detach's copy", fn, name);
    for (int i = 0; i < n; i++)
        TP_ARG_CHECK(inputs[i] != out, "%s (%s): inputs[%d] is out itself", fn, name, i);
    if (!tp__needs_grad(n, inputs)) {
        if (ctx_free)
            ctx_free(ctx);
        return TP_OK;
    }
    tp__function *f = tp__calloc(1, sizeof *f);
    if (!f)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    tp__node *node = NULL;
    tp_status st = tp__node_attach_n(out, name, tp__function_backward, n, inputs, &node);
    if (st != TP_OK) {
        tp__free(f);
        return st;
    }
    f->backward = backward;
    f->ctx = ctx;
    f->ctx_free = ctx_free;
    node->saved = f;
    node->free_saved = tp__function_free;
    return TP_OK;
}

tp_status tp_tensor_detach(tp_tensor *t, tp_tensor **out)
{
    const char *fn = "tp_tensor_detach";
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    *out = NULL;
    TP_ARG_CHECK(t, "%s: t is NULL", fn);
    tp__dist *d = tp__dist_of(t);
    if (!d)
        return tp__tensor_alias(t, out);
    return tp__dtensor_wrap(d->mesh, d->local, d->placements, t->ndim, t->shape, out);
}

int tp_enable_grad_begin(void)
{
    int saved = tp__no_grad_depth;
    tp__no_grad_depth = 0;
    return saved;
}

void tp_enable_grad_end(int saved) { tp__no_grad_depth = saved > 0 ? saved : 0; }
