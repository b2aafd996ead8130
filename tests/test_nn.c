/* Modules: the tree and its FQNs, parameters, hooks, forwards of the built-in
 * kinds against the ops they call, comm-debug scopes, deterministic
 * initialisation and state dicts at every parallel degree, SGD and Adam
 * (hand-computed, and with Partial and sharded gradients), every error path
 * and allocation failures. */
#include <math.h>
#include <stdlib.h>

#include "tp_test.h"

/* ---- helpers (main thread unless said otherwise) -------------------------- */

/* A tensor of small integers from (seed, global index). Any thread. */
static tp_status randint(int nd, const int64_t *shape, uint64_t seed, tp_tensor **t)
{
    TP_TEST_TRY(tp_tensor_zeros(TP_F32, TP_CPU, nd, shape, t));
    return tp_tensor_fill_random(*t, TP_RNG_RANDINT, -4, 5, seed, NULL, NULL);
}

static tp_tensor *mk(int nd, const int64_t *shape, uint64_t seed)
{
    tp_tensor *t = NULL;
    CHECK_OK(randint(nd, shape, seed, &t));
    return t;
}

static tp_tensor *mk_data(int nd, const int64_t *shape, const float *data)
{
    tp_tensor *t = NULL;
    CHECK_OK(tp_tensor_from_data(TP_F32, nd, shape, data, &t));
    return t;
}

static void assert_equal(const tp_tensor *a, const tp_tensor *b, const char *what)
{
    bool eq = false;
    CHECK_OK(tp_tensor_equal(a, b, &eq));
    cr_assert(eq, "%s: tensors differ", what);
}

static double at(const tp_tensor *t, int64_t i, int64_t j)
{
    double v = 0;
    int64_t idx[2] = {i, j};
    CHECK_OK(tp_tensor_get(t, tp_tensor_ndim(t) == 1 ? &idx[1] : idx, &v));
    return v;
}

/* Collects FQNs and tensors from tp_module_named_parameters. Any thread. */
#define MAX_P 16
typedef struct {
    int n;
    char fqn[MAX_P][64];
    tp_tensor *t[MAX_P];
    int stop_after; /* return TP_ERR_STATE after this many; 0: never */
} plist;

static tp_status collect(const char *fqn, tp_tensor *t, void *ctx)
{
    plist *l = ctx;
    if (l->n >= MAX_P)
        return TP_ERR_NO_MEMORY;
    snprintf(l->fqn[l->n], sizeof l->fqn[0], "%s", fqn);
    l->t[l->n++] = t;
    if (l->stop_after && l->n == l->stop_after)
        return TP_ERR_STATE;
    return TP_OK;
}

/* A container holding net1 = Linear(in, hid), net2 = Linear(hid, out). */
static tp_status make_mlp(int64_t in, int64_t hid, int64_t out, tp_module **root)
{
    tp_module *c = NULL, *a = NULL, *b = NULL;
    TP_TEST_TRY(tp_nn_container_create(&c));
    tp_status st = tp_nn_linear_create(in, hid, true, &a);
    if (st == TP_OK)
        st = tp_module_add_child(c, "net1", a);
    if (st == TP_OK)
        st = tp_nn_linear_create(hid, out, true, &b);
    if (st == TP_OK)
        st = tp_module_add_child(c, "net2", b);
    if (st != TP_OK) {
        if (a && !tp_module_child(c, "net1"))
            tp_module_free(a);
        if (b && !tp_module_child(c, "net2"))
            tp_module_free(b);
        tp_module_free(c);
        return st;
    }
    *root = c;
    return TP_OK;
}

/* ---- the tree --------------------------------------------------------------- */

Test(nn, tree_names_and_find, .timeout = 30)
{
    tp_module *root = NULL, *l1 = NULL, *l2 = NULL, *seq = NULL, *r = NULL, *l3 = NULL;
    CHECK_OK(tp_nn_container_create(&root));
    CHECK_OK(tp_nn_linear_create(4, 3, true, &l1));
    CHECK_OK(tp_nn_linear_create(3, 2, false, &l2));
    CHECK_OK(tp_nn_sequential_create(&seq));
    CHECK_OK(tp_nn_relu_create(&r));
    CHECK_OK(tp_nn_linear_create(2, 2, true, &l3));
    CHECK_OK(tp_module_add_child(root, "net1", l1));
    CHECK_OK(tp_module_add_child(root, "net2", l2));
    CHECK_OK(tp_module_add_child(root, "layers", seq));
    CHECK_OK(tp_module_add_child(seq, "0", r));
    CHECK_OK(tp_module_add_child(seq, "1", l3));

    cr_assert_eq(tp_module_num_children(root), 3);
    cr_assert_eq(tp_module_num_children(seq), 2);
    cr_assert_eq(tp_module_num_children(l1), 0);
    const char *name = NULL;
    cr_assert_eq(tp_module_child_at(root, 0, &name), l1);
    cr_assert_str_eq(name, "net1");
    cr_assert_eq(tp_module_child_at(root, 2, &name), seq);
    cr_assert_str_eq(name, "layers");
    cr_assert_null(tp_module_child_at(root, 3, &name));
    cr_assert_null(name);
    cr_assert_null(tp_module_child_at(root, -1, NULL));
    cr_assert_eq(tp_module_child(root, "net2"), l2);
    cr_assert_null(tp_module_child(root, "net3"));

    cr_assert_eq(tp_module_find(root, ""), root);
    cr_assert_eq(tp_module_find(root, "net1"), l1);
    cr_assert_eq(tp_module_find(root, "layers.1"), l3);
    cr_assert_eq(tp_module_find(seq, "0"), r);
    cr_assert_null(tp_module_find(root, "layers.2"));
    cr_assert_null(tp_module_find(root, "layers."));
    cr_assert_null(tp_module_find(root, ".net1"));
    cr_assert_null(tp_module_find(root, "layers..1"));
    cr_assert_null(tp_module_find(root, "net1.weight")); /* parameters are not modules */
    cr_assert_null(tp_module_find(NULL, ""));

    cr_assert_str_eq(tp_module_name(root), "");
    cr_assert_str_eq(tp_module_name(l3), "1");
    cr_assert_str_eq(tp_module_type_name(root), "Container");
    cr_assert_str_eq(tp_module_type_name(seq), "Sequential");
    cr_assert_str_eq(tp_module_type_name(l1), "Linear");
    cr_assert_str_eq(tp_module_type_name(r), "ReLU");
    cr_assert_eq(tp_module_kind_of(seq), TP_MODULE_SEQUENTIAL);
    cr_assert_eq(tp_module_kind_of(l1), TP_MODULE_LINEAR);
    cr_assert_eq(tp_module_kind_of(root), TP_MODULE_CONTAINER);

    /* names: unique, non-empty, no '.'; one parent; no cycles */
    tp_module *x = NULL;
    CHECK_OK(tp_nn_identity_create(&x));
    CHECK_ERR(tp_module_add_child(root, "net1", x), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "already has a child named 'net1'"), "%s",
              tp_last_error());
    CHECK_ERR(tp_module_add_child(root, "a.b", x), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "contains '.'"), "%s", tp_last_error());
    CHECK_ERR(tp_module_add_child(root, "", x), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_module_add_child(root, NULL, x), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_module_add_child(NULL, "x", x), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_module_add_child(root, "x", NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_module_add_child(root, "again", l1), TP_ERR_INVALID_ARG); /* re-parenting */
    cr_assert(strstr(tp_last_error(), "already has a parent"), "%s", tp_last_error());
    CHECK_ERR(tp_module_add_child(x, "self", x), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_module_add_child(seq, "root", root), TP_ERR_INVALID_ARG); /* a cycle */
    cr_assert(strstr(tp_last_error(), "its own ancestor"), "%s", tp_last_error());
    /* a child and a parameter cannot share a name */
    CHECK_ERR(tp_module_add_child(l1, "weight", x), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "already has a parameter named 'weight'"), "%s",
              tp_last_error());
    cr_assert_eq(tp_module_num_children(root), 3, "failed adds leave the tree unchanged");
    cr_assert_str_eq(tp_module_name(x), "");
    tp_module_free(x); /* never added: still the caller's */

    /* freeing a child is a no-op: the root owns it */
    tp_module_free(l3);
    cr_assert_eq(tp_module_find(root, "layers.1"), l3);
    cr_assert_str_eq(tp_module_type_name(l3), "Linear");
    tp_module_free(root);
    tp_module_free(NULL);
}

Test(nn, null_safe_getters, .timeout = 30)
{
    cr_assert_eq(tp_module_num_children(NULL), 0);
    cr_assert_null(tp_module_child(NULL, "a"));
    cr_assert_null(tp_module_child_at(NULL, 0, NULL));
    cr_assert_null(tp_module_type_name(NULL));
    cr_assert_null(tp_module_name(NULL));
    cr_assert_null(tp_module_ctx(NULL));
    cr_assert_null(tp_module_parameter(NULL, "weight"));
    cr_assert_eq((int)tp_module_kind_of(NULL), -1);
    tp_module_zero_grad(NULL);
    tp_adam_free(NULL);
}

/* ---- parameters ---------------------------------------------------------- */

Test(nn, named_parameters_order_and_fqns, .timeout = 30)
{
    tp_module *root = NULL;
    CHECK_OK(make_mlp(4, 6, 2, &root));
    plist l = {0};
    CHECK_OK(tp_module_named_parameters(root, collect, &l));
    cr_assert_eq(l.n, 4);
    const char *want[] = {"net1.weight", "net1.bias", "net2.weight", "net2.bias"};
    for (int i = 0; i < 4; i++)
        cr_assert_str_eq(l.fqn[i], want[i]);
    /* weight [out, in], bias [out], zero, requiring grad */
    cr_assert_eq(tp_tensor_ndim(l.t[0]), 2);
    cr_assert_eq(tp_tensor_size(l.t[0], 0), 6);
    cr_assert_eq(tp_tensor_size(l.t[0], 1), 4);
    cr_assert_eq(tp_tensor_size(l.t[1], 0), 6);
    cr_assert_eq(tp_tensor_size(l.t[2], 0), 2);
    cr_assert_eq(tp_tensor_size(l.t[2], 1), 6);
    for (int i = 0; i < 4; i++) {
        cr_assert(tp_tensor_requires_grad(l.t[i]));
        cr_assert_eq(tp_tensor_dtype(l.t[i]), TP_F32);
        cr_assert(!tp_tensor_is_dtensor(l.t[i]));
        tp_tensor *z = NULL;
        CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, tp_tensor_ndim(l.t[i]), tp_tensor_shape(l.t[i]),
                                 &z));
        assert_equal(l.t[i], z, l.fqn[i]);
        tp_tensor_release(z);
    }
    cr_assert_eq(tp_module_parameter(tp_module_child(root, "net1"), "weight"), l.t[0]);
    /* from a subtree the FQNs are relative to it */
    plist s = {0};
    CHECK_OK(tp_module_named_parameters(tp_module_child(root, "net2"), collect, &s));
    cr_assert_eq(s.n, 2);
    cr_assert_str_eq(s.fqn[0], "weight");
    cr_assert_str_eq(s.fqn[1], "bias");
    /* the walk stops at the first non-OK return */
    plist stop = {.stop_after = 2};
    cr_assert_eq(tp_module_named_parameters(root, collect, &stop), TP_ERR_STATE);
    cr_assert_eq(stop.n, 2);
    CHECK_ERR(tp_module_named_parameters(NULL, collect, &s), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_module_named_parameters(root, NULL, &s), TP_ERR_INVALID_ARG);
    tp_module_free(root);

    /* a Sequential's children are named "0", "1", ... by the caller; a module's
     * own parameters come before its children's; absent ones are skipped */
    tp_module *seq = NULL, *a = NULL, *relu = NULL, *b = NULL, *norm = NULL, *rms = NULL;
    CHECK_OK(tp_nn_sequential_create(&seq));
    CHECK_OK(tp_nn_linear_create(3, 3, false, &a));
    CHECK_OK(tp_nn_relu_create(&relu));
    CHECK_OK(tp_nn_linear_create(3, 2, true, &b));
    CHECK_OK(tp_nn_layer_norm_create(2, true, 1e-5, &norm));
    CHECK_OK(tp_nn_rms_norm_create(2, false, 1e-6, &rms));
    CHECK_OK(tp_module_add_child(seq, "0", a));
    CHECK_OK(tp_module_add_child(seq, "1", relu));
    CHECK_OK(tp_module_add_child(seq, "2", b));
    CHECK_OK(tp_module_add_child(seq, "3", norm));
    CHECK_OK(tp_module_add_child(seq, "4", rms));
    tp_tensor *own = mk(1, (int64_t[]){2}, 1);
    CHECK_OK(tp_module_register_parameter(seq, "scale", own));
    cr_assert(tp_tensor_requires_grad(own));
    tp_tensor_release(own);
    plist q = {0};
    CHECK_OK(tp_module_named_parameters(seq, collect, &q));
    const char *wq[] = {"scale", "0.weight", "2.weight", "2.bias", "3.weight", "3.bias"};
    cr_assert_eq(q.n, 6);
    for (int i = 0; i < 6; i++)
        cr_assert_str_eq(q.fqn[i], wq[i]);
    cr_assert_null(tp_module_parameter(a, "bias"), "bias=false: no bias");
    cr_assert_null(tp_module_parameter(rms, "weight"), "affine=false: no weight");
    cr_assert_null(tp_module_parameter(a, "nope"));
    tp_module_free(seq);
}

Test(nn, register_and_set_parameter, .timeout = 30)
{
    tp_module *lin = NULL;
    CHECK_OK(tp_nn_linear_create(4, 3, true, &lin));
    tp_tensor *w = mk(2, (int64_t[]){3, 4}, 5);
    cr_assert(!tp_tensor_requires_grad(w));
    CHECK_OK(tp_module_set_parameter(lin, "weight", w));
    cr_assert_eq(tp_module_parameter(lin, "weight"), w);
    cr_assert(tp_tensor_requires_grad(w), "set marks requires_grad");
    tp_tensor_release(w); /* the module holds its own reference */
    plist l = {0};
    CHECK_OK(tp_module_named_parameters(lin, collect, &l));
    cr_assert_eq(l.n, 2);
    cr_assert_str_eq(l.fqn[0], "weight", "replacing keeps the order");
    cr_assert_str_eq(l.fqn[1], "bias");
    cr_assert_eq(tp_tensor_size(l.t[0], 1), 4);

    /* the absent bias of a bias-free Linear can be installed */
    tp_module *nb = NULL;
    CHECK_OK(tp_nn_linear_create(4, 3, false, &nb));
    tp_tensor *b = mk(1, (int64_t[]){3}, 6);
    CHECK_OK(tp_module_set_parameter(nb, "bias", b));
    cr_assert_eq(tp_module_parameter(nb, "bias"), b);
    tp_tensor_release(b);

    tp_tensor *t = mk(1, (int64_t[]){3}, 7);
    CHECK_ERR(tp_module_set_parameter(lin, "nope", t), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "Linear has no parameter 'nope'"), "%s", tp_last_error());
    CHECK_ERR(tp_module_set_parameter(lin, "bias", NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_module_set_parameter(NULL, "bias", t), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_module_set_parameter(lin, NULL, t), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_module_register_parameter(lin, "bias", t), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "already has a parameter named 'bias'"), "%s",
              tp_last_error());
    CHECK_ERR(tp_module_register_parameter(lin, "a.b", t), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_module_register_parameter(lin, "", t), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_module_register_parameter(lin, NULL, t), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_module_register_parameter(NULL, "x", t), TP_ERR_INVALID_ARG);
    /* integer tensors cannot require grad */
    tp_tensor *it = NULL;
    CHECK_OK(tp_tensor_zeros(TP_I64, TP_CPU, 1, (int64_t[]){3}, &it));
    CHECK_ERR(tp_module_register_parameter(lin, "idx", it), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "parameter 'idx'"), "%s", tp_last_error());
    CHECK_ERR(tp_module_set_parameter(lin, "bias", it), TP_ERR_INVALID_ARG);
    cr_assert_null(tp_module_parameter(lin, "idx"));
    /* a parameter name cannot shadow a child */
    tp_module *c = NULL, *id = NULL;
    CHECK_OK(tp_nn_container_create(&c));
    CHECK_OK(tp_nn_identity_create(&id));
    CHECK_OK(tp_module_add_child(c, "sub", id));
    CHECK_ERR(tp_module_register_parameter(c, "sub", t), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "already has a child named 'sub'"), "%s", tp_last_error());
    tp_tensor_release(it);
    tp_tensor_release(t);
    tp_module_free(c);
    tp_module_free(nb);
    tp_module_free(lin);
}

Test(nn, zero_grad, .timeout = 30)
{
    tp_module *root = NULL;
    CHECK_OK(make_mlp(3, 4, 2, &root));
    CHECK_OK(tp_module_init(root, 3));
    tp_tensor *x = mk(2, (int64_t[]){2, 3}, 1), *h = NULL, *y = NULL, *loss = NULL;
    CHECK_OK(tp_module_call(tp_module_child(root, "net1"), x, &h));
    CHECK_OK(tp_module_call(tp_module_child(root, "net2"), h, &y));
    CHECK_OK(tp_sum_all(y, &loss));
    CHECK_OK(tp_backward(loss, NULL));
    plist l = {0};
    CHECK_OK(tp_module_named_parameters(root, collect, &l));
    for (int i = 0; i < l.n; i++)
        cr_assert_not_null(tp_tensor_grad(l.t[i]), "%s has a gradient", l.fqn[i]);
    tp_module_zero_grad(root);
    for (int i = 0; i < l.n; i++)
        cr_assert_null(tp_tensor_grad(l.t[i]), "%s: gradient dropped", l.fqn[i]);
    tp_tensor_release(x);
    tp_tensor_release(h);
    tp_tensor_release(y);
    tp_tensor_release(loss);
    tp_module_free(root);
}

/* ---- forwards of the built-in kinds ----------------------------------------- */

static tp_tensor *call1(tp_module *m, tp_tensor *x)
{
    tp_tensor *y = NULL;
    CHECK_OK(tp_module_call(m, x, &y));
    cr_assert_not_null(y);
    return y;
}

Test(nn, builtin_forwards_equal_the_ops, .timeout = 30)
{
    tp_tensor *x = mk(3, (int64_t[]){2, 3, 4}, 11), *y = NULL, *r = NULL;

    /* Linear */
    tp_module *lin = NULL;
    CHECK_OK(tp_nn_linear_create(4, 5, true, &lin));
    CHECK_OK(tp_module_init(lin, 1));
    y = call1(lin, x);
    CHECK_OK(tp_linear(x, tp_module_parameter(lin, "weight"), tp_module_parameter(lin, "bias"),
                       &r));
    assert_equal(y, r, "Linear");
    cr_assert_eq(tp_tensor_size(y, -1), 5);
    tp_tensor_release(y);
    tp_tensor_release(r);
    tp_module *lnb = NULL;
    CHECK_OK(tp_nn_linear_create(4, 5, false, &lnb));
    CHECK_OK(tp_module_init(lnb, 1));
    y = call1(lnb, x);
    CHECK_OK(tp_linear(x, tp_module_parameter(lnb, "weight"), NULL, &r));
    assert_equal(y, r, "Linear without bias");
    tp_tensor_release(y);
    tp_tensor_release(r);

    /* Embedding */
    tp_module *emb = NULL;
    CHECK_OK(tp_nn_embedding_create(6, 4, &emb));
    CHECK_OK(tp_module_init(emb, 2));
    tp_tensor *idx = NULL;
    CHECK_OK(tp_tensor_zeros(TP_I64, TP_CPU, 2, (int64_t[]){2, 3}, &idx));
    CHECK_OK(tp_tensor_fill_random(idx, TP_RNG_RANDINT, 0, 6, 3, NULL, NULL));
    y = call1(emb, idx);
    CHECK_OK(tp_embedding(idx, tp_module_parameter(emb, "weight"), &r));
    assert_equal(y, r, "Embedding");
    cr_assert_eq(tp_tensor_ndim(y), 3);
    tp_tensor_release(y);
    tp_tensor_release(r);

    /* norms, affine and not */
    tp_module *ln = NULL, *ln0 = NULL, *rms = NULL, *rms0 = NULL;
    CHECK_OK(tp_nn_layer_norm_create(4, true, 1e-5, &ln));
    CHECK_OK(tp_nn_layer_norm_create(4, false, 1e-3, &ln0));
    CHECK_OK(tp_nn_rms_norm_create(4, true, 1e-6, &rms));
    CHECK_OK(tp_nn_rms_norm_create(4, false, 1e-2, &rms0));
    /* non-trivial affine values */
    tp_tensor *g = mk(1, (int64_t[]){4}, 21), *b = mk(1, (int64_t[]){4}, 22);
    CHECK_OK(tp_module_set_parameter(ln, "weight", g));
    CHECK_OK(tp_module_set_parameter(ln, "bias", b));
    CHECK_OK(tp_module_set_parameter(rms, "weight", g));
    y = call1(ln, x);
    CHECK_OK(tp_layer_norm(x, g, b, 1e-5, &r));
    assert_equal(y, r, "LayerNorm");
    tp_tensor_release(y);
    tp_tensor_release(r);
    y = call1(ln0, x);
    CHECK_OK(tp_layer_norm(x, NULL, NULL, 1e-3, &r));
    assert_equal(y, r, "LayerNorm without affine");
    tp_tensor_release(y);
    tp_tensor_release(r);
    y = call1(rms, x);
    CHECK_OK(tp_rms_norm(x, g, 1e-6, &r));
    assert_equal(y, r, "RMSNorm");
    tp_tensor_release(y);
    tp_tensor_release(r);
    y = call1(rms0, x);
    CHECK_OK(tp_rms_norm(x, NULL, 1e-2, &r));
    assert_equal(y, r, "RMSNorm without affine");
    tp_tensor_release(y);
    tp_tensor_release(r);

    /* activations */
    tp_module *relu = NULL, *gelu = NULL, *gelut = NULL, *id = NULL;
    CHECK_OK(tp_nn_relu_create(&relu));
    CHECK_OK(tp_nn_gelu_create(TP_GELU_EXACT, &gelu));
    CHECK_OK(tp_nn_gelu_create(TP_GELU_TANH, &gelut));
    CHECK_OK(tp_nn_identity_create(&id));
    y = call1(relu, x);
    CHECK_OK(tp_relu(x, &r));
    assert_equal(y, r, "ReLU");
    tp_tensor_release(y);
    tp_tensor_release(r);
    y = call1(gelu, x);
    CHECK_OK(tp_gelu(x, TP_GELU_EXACT, &r));
    assert_equal(y, r, "GELU");
    tp_tensor_release(y);
    tp_tensor_release(r);
    y = call1(gelut, x);
    CHECK_OK(tp_gelu(x, TP_GELU_TANH, &r));
    assert_equal(y, r, "GELU tanh");
    tp_tensor_release(y);
    tp_tensor_release(r);
    y = call1(id, x);
    cr_assert_eq(y, x, "Identity returns its input");
    tp_tensor_release(y);
    cr_assert_str_eq(tp_module_type_name(gelu), "GELU");
    cr_assert_str_eq(tp_module_type_name(id), "Identity");

    tp_tensor_release(g);
    tp_tensor_release(b);
    tp_tensor_release(idx);
    tp_tensor_release(x);
    tp_module *mods[] = {lin, lnb, emb, ln, ln0, rms, rms0, relu, gelu, gelut, id};
    for (size_t i = 0; i < sizeof mods / sizeof mods[0]; i++)
        tp_module_free(mods[i]);
}

Test(nn, dropout_masks_advance_per_call, .timeout = 30)
{
    tp_module *d = NULL, *d0 = NULL;
    CHECK_OK(tp_nn_dropout_create(0.5, 77, &d));
    CHECK_OK(tp_nn_dropout_create(0.0, 77, &d0));
    cr_assert_str_eq(tp_module_type_name(d), "Dropout");
    tp_tensor *x = NULL, *y1, *y2, *r1 = NULL, *r2 = NULL;
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 2, (int64_t[]){8, 16}, &x));
    CHECK_OK(tp_tensor_fill(x, 1.0));
    y1 = call1(d, x);
    y2 = call1(d, x);
    CHECK_OK(tp_dropout(x, 0.5, 77, true, &r1));
    CHECK_OK(tp_dropout(x, 0.5, 78, true, &r2));
    assert_equal(y1, r1, "first call: seed");
    assert_equal(y2, r2, "second call: seed + 1");
    bool eq = true;
    CHECK_OK(tp_tensor_equal(y1, y2, &eq));
    cr_assert(!eq, "successive calls draw different masks");
    /* a fresh module with the same seed repeats the sequence */
    tp_module *d2 = NULL;
    CHECK_OK(tp_nn_dropout_create(0.5, 77, &d2));
    tp_tensor *z = call1(d2, x);
    assert_equal(z, r1, "same seed, same first mask");
    tp_tensor *w = call1(d0, x);
    assert_equal(w, x, "p = 0 is the identity");
    tp_tensor *tps[] = {x, y1, y2, r1, r2, z, w};
    for (size_t i = 0; i < sizeof tps / sizeof tps[0]; i++)
        tp_tensor_release(tps[i]);
    tp_module_free(d);
    tp_module_free(d0);
    tp_module_free(d2);
}

Test(nn, sequential_chains_its_children, .timeout = 30)
{
    tp_module *seq = NULL, *a = NULL, *relu = NULL, *b = NULL;
    CHECK_OK(tp_nn_sequential_create(&seq));
    tp_tensor *x = mk(2, (int64_t[]){3, 4}, 1);
    tp_tensor *y = call1(seq, x);
    cr_assert_eq(y, x, "an empty Sequential returns its input");
    tp_tensor_release(y);
    CHECK_OK(tp_nn_linear_create(4, 6, true, &a));
    CHECK_OK(tp_nn_relu_create(&relu));
    CHECK_OK(tp_nn_linear_create(6, 2, true, &b));
    CHECK_OK(tp_module_add_child(seq, "0", a));
    CHECK_OK(tp_module_add_child(seq, "1", relu));
    CHECK_OK(tp_module_add_child(seq, "2", b));
    CHECK_OK(tp_module_init(seq, 9));
    y = call1(seq, x);
    tp_tensor *h = NULL, *hr = NULL, *r = NULL;
    CHECK_OK(tp_linear(x, tp_module_parameter(a, "weight"), tp_module_parameter(a, "bias"), &h));
    CHECK_OK(tp_relu(h, &hr));
    CHECK_OK(tp_linear(hr, tp_module_parameter(b, "weight"), tp_module_parameter(b, "bias"), &r));
    assert_equal(y, r, "Sequential");
    /* an error inside a child comes out of the Sequential */
    tp_tensor *bad = mk(2, (int64_t[]){3, 5}, 1), *o = (tp_tensor *)0x1;
    tp_clear_error();
    cr_assert_eq(tp_module_call(seq, bad, &o), TP_ERR_INVALID_ARG);
    cr_assert_null(o);
    cr_assert(strstr(tp_last_error(), "input has 5 features, weight expects 4"), "%s",
              tp_last_error());
    cr_assert_str_eq(tp_comm_debug_current_scope(), "Global", "scopes popped on failure");
    tp_tensor *tps[] = {x, y, h, hr, r, bad};
    for (size_t i = 0; i < sizeof tps / sizeof tps[0]; i++)
        tp_tensor_release(tps[i]);
    tp_module_free(seq);
}

Test(nn, builtin_input_errors, .timeout = 30)
{
    tp_module *lin = NULL, *c = NULL;
    CHECK_OK(tp_nn_linear_create(4, 3, true, &lin));
    CHECK_OK(tp_nn_container_create(&c));
    tp_tensor *x = mk(2, (int64_t[]){2, 4}, 1), *y = (tp_tensor *)0x1;
    tp_tensor *two[2] = {x, x};
    CHECK_ERR(tp_module_forward(lin, 2, two, 0, NULL, &y), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "Linear takes 1 input, got 2"), "%s", tp_last_error());
    cr_assert_null(y);
    CHECK_ERR(tp_module_forward(lin, 0, NULL, 0, NULL, &y), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "Linear takes 1 input, got 0"), "%s", tp_last_error());
    tp_kwarg kw = {"x", x};
    CHECK_ERR(tp_module_forward(lin, 1, &x, 1, &kw, &y), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "Linear takes no keyword inputs, got 1"), "%s",
              tp_last_error());
    CHECK_ERR(tp_module_call(lin, NULL, &y), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "None"), "%s", tp_last_error());
    CHECK_ERR(tp_module_call(c, x, &y), TP_ERR_NOT_SUPPORTED);
    cr_assert(strstr(tp_last_error(), "Container has no forward; call its children"), "%s",
              tp_last_error());
    cr_assert_null(y);
    /* argument checks of tp_module_forward itself */
    CHECK_ERR(tp_module_forward(NULL, 1, &x, 0, NULL, &y), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_module_forward(lin, 1, &x, 0, NULL, NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_module_forward(lin, -1, &x, 0, NULL, &y), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_module_forward(lin, 1, NULL, 0, NULL, &y), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_module_forward(lin, 1, &x, 1, NULL, &y), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_module_forward(lin, 1, &x, -1, NULL, &y), TP_ERR_INVALID_ARG);
    tp_kwarg noname = {NULL, x};
    CHECK_ERR(tp_module_forward(lin, 1, &x, 1, &noname, &y), TP_ERR_INVALID_ARG);
    cr_assert_null(y);
    cr_assert_str_eq(tp_comm_debug_current_scope(), "Global");
    tp_tensor_release(x);
    tp_module_free(lin);
    tp_module_free(c);
}

Test(nn, create_errors, .timeout = 30)
{
    tp_module *m = (tp_module *)0x1;
    CHECK_ERR(tp_nn_linear_create(-1, 3, true, &m), TP_ERR_INVALID_ARG);
    cr_assert_null(m);
    CHECK_ERR(tp_nn_linear_create(3, -2, true, &m), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_nn_linear_create(3, 2, true, NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_nn_embedding_create(-1, 3, &m), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_nn_embedding_create(3, -1, &m), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_nn_embedding_create(3, 3, NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_nn_layer_norm_create(-1, true, 1e-5, &m), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_nn_layer_norm_create(4, true, -1, &m), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_nn_rms_norm_create(4, true, NAN, &m), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_nn_rms_norm_create(4, true, 1e-5, NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_nn_dropout_create(1.0, 0, &m), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "[0, 1)"), "%s", tp_last_error());
    CHECK_ERR(tp_nn_dropout_create(-0.1, 0, &m), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_nn_dropout_create(NAN, 0, &m), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_nn_gelu_create((tp_gelu_approx)7, &m), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_nn_identity_create(NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_nn_relu_create(NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_nn_gelu_create(TP_GELU_EXACT, NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_nn_sequential_create(NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_nn_container_create(NULL), TP_ERR_INVALID_ARG);
    cr_assert_null(m);
    /* zero-sized modules are fine */
    CHECK_OK(tp_nn_linear_create(0, 0, true, &m));
    CHECK_OK(tp_module_init(m, 1));
    tp_module_free(m);
}

/* ---- custom modules and hooks ------------------------------------------------- */

typedef struct {
    char log[32];
    int freed;
    int forward_nargs, forward_nkw;
    bool saw_none_arg, saw_none_kw;
    char kw_names[2][16];
    tp_tensor *seen_input; /* what the hook got as args[0] (borrowed) */
} hook_log;

static void logc(hook_log *l, char c)
{
    size_t n = strlen(l->log);
    if (n + 1 < sizeof l->log) {
        l->log[n] = c;
        l->log[n + 1] = '\0';
    }
}

/* out = args[0] + args[2] (args[1] must be None), times kw "scale" if given;
 * a None "bias" keyword is skipped. */
static tp_status custom_fwd(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                            const tp_kwarg *kw, tp_tensor **out)
{
    hook_log *l = tp_module_ctx(self);
    logc(l, 'F');
    l->forward_nargs = nargs;
    l->forward_nkw = nkw;
    l->saw_none_arg = nargs > 1 && args[1] == NULL;
    for (int i = 0; i < nkw && i < 2; i++) {
        snprintf(l->kw_names[i], sizeof l->kw_names[i], "%s", kw[i].name);
        if (!kw[i].value)
            l->saw_none_kw = true;
    }
    tp_tensor *sum = NULL;
    TP_TEST_TRY(tp_add(args[0], args[2], &sum));
    for (int i = 0; i < nkw; i++)
        if (!strcmp(kw[i].name, "scale") && kw[i].value) {
            tp_tensor *p = NULL;
            tp_status st = tp_mul(sum, kw[i].value, &p);
            tp_tensor_release(sum);
            if (st != TP_OK)
                return st;
            sum = p;
        }
    *out = sum;
    return TP_OK;
}

static void count_free(void *ctx) { ((hook_log *)ctx)->freed++; }

/* Pre-hooks log their letter; 'a' doubles args[0], 'b' replaces kw[0]. */
static tp_status pre_a(tp_module *m, int nargs, tp_tensor **args, int nkw, tp_kwarg *kw,
                       void *ctx)
{
    (void)m, (void)nkw, (void)kw;
    logc(ctx, 'a');
    if (nargs < 1)
        return TP_ERR_STATE;
    tp_tensor *d = NULL;
    TP_TEST_TRY(tp_scale(args[0], 2.0, &d));
    tp_tensor_release(args[0]);
    args[0] = d;
    return TP_OK;
}

static tp_status pre_b(tp_module *m, int nargs, tp_tensor **args, int nkw, tp_kwarg *kw,
                       void *ctx)
{
    (void)m, (void)nargs, (void)args;
    logc(ctx, 'b');
    if (nkw < 1 || !kw[0].value)
        return TP_ERR_STATE;
    tp_tensor *n = NULL;
    TP_TEST_TRY(tp_scale(kw[0].value, -1.0, &n));
    tp_tensor_release(kw[0].value);
    kw[0].value = n;
    return TP_OK;
}

static tp_status post_c(tp_module *m, int nargs, tp_tensor *const *args, tp_tensor **out,
                        void *ctx)
{
    (void)m, (void)nargs, (void)args;
    logc(ctx, 'c');
    tp_tensor *n = NULL;
    TP_TEST_TRY(tp_scale(*out, 3.0, &n));
    tp_tensor_release(*out);
    *out = n;
    return TP_OK;
}

static tp_status post_d(tp_module *m, int nargs, tp_tensor *const *args, tp_tensor **out,
                        void *ctx)
{
    (void)m, (void)out;
    hook_log *l = ctx;
    logc(l, 'd');
    l->seen_input = nargs > 0 ? args[0] : NULL;
    return TP_OK;
}

static tp_status pre_fail(tp_module *m, int nargs, tp_tensor **args, int nkw, tp_kwarg *kw,
                          void *ctx)
{
    (void)m, (void)nargs, (void)args, (void)nkw, (void)kw;
    logc(ctx, 'X');
    return TP_ERR_MISMATCH;
}

static tp_status post_fail(tp_module *m, int nargs, tp_tensor *const *args, tp_tensor **out,
                           void *ctx)
{
    (void)m, (void)nargs, (void)args, (void)out;
    logc(ctx, 'Y');
    return TP_ERR_MISMATCH;
}

/* (x + y) * s, with None in the middle of the positional inputs. */
static tp_status run_adder(tp_module *m, tp_tensor *x, tp_tensor *y, tp_tensor *s,
                           tp_tensor **out)
{
    tp_tensor *args[3] = {x, NULL, y};
    tp_kwarg kw[2] = {{"scale", s}, {"bias", NULL}};
    return tp_module_forward(m, 3, args, 2, kw, out);
}

Test(nn, custom_module_positional_keyword_and_none_inputs, .timeout = 30)
{
    hook_log hl = {0};
    tp_module *m = NULL;
    CHECK_OK(tp_nn_custom_create("Adder", custom_fwd, &hl, count_free, &m));
    cr_assert_eq(tp_module_kind_of(m), TP_MODULE_CUSTOM);
    cr_assert_str_eq(tp_module_type_name(m), "Adder");
    cr_assert_eq(tp_module_ctx(m), &hl);
    tp_tensor *x = mk(2, (int64_t[]){2, 3}, 1), *y = mk(2, (int64_t[]){2, 3}, 2),
              *s = mk(2, (int64_t[]){2, 3}, 3), *out = NULL, *sum = NULL, *ref = NULL;
    CHECK_OK(run_adder(m, x, y, s, &out));
    CHECK_OK(tp_add(x, y, &sum));
    CHECK_OK(tp_mul(sum, s, &ref));
    assert_equal(out, ref, "custom forward");
    cr_assert_eq(hl.forward_nargs, 3);
    cr_assert_eq(hl.forward_nkw, 2);
    cr_assert(hl.saw_none_arg, "a NULL positional input arrives as None");
    cr_assert(hl.saw_none_kw, "a NULL keyword input arrives as None");
    cr_assert_str_eq(hl.kw_names[0], "scale");
    cr_assert_str_eq(hl.kw_names[1], "bias");
    cr_assert_str_eq(hl.log, "F");
    tp_tensor_release(out);
    tp_tensor_release(sum);
    tp_tensor_release(ref);
    tp_tensor_release(x);
    tp_tensor_release(y);
    tp_tensor_release(s);
    tp_module_free(m);
    cr_assert_eq(hl.freed, 1, "ctx_free runs at tp_module_free");

    /* NULL ctx_free is fine */
    CHECK_OK(tp_nn_custom_create("Plain", custom_fwd, &hl, NULL, &m));
    tp_module_free(m);
    cr_assert_eq(hl.freed, 1);
}

static tp_status no_output_fwd(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                               const tp_kwarg *kw, tp_tensor **out)
{
    (void)self, (void)nargs, (void)args, (void)nkw, (void)kw, (void)out;
    return TP_OK;
}

static tp_status failing_fwd(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                             const tp_kwarg *kw, tp_tensor **out)
{
    (void)self, (void)nkw, (void)kw;
    /* fails after producing something: tp_module_forward releases it */
    if (nargs > 0)
        *out = tp_tensor_retain(args[0]);
    tp_tensor *v = NULL;
    return tp_tensor_narrow(args[0], 5, 0, 1, &v); /* dim 5 of a 1-D tensor */
}

Test(nn, custom_module_errors, .timeout = 30)
{
    tp_module *m = (tp_module *)0x1;
    hook_log hl = {0};
    CHECK_ERR(tp_nn_custom_create(NULL, custom_fwd, NULL, NULL, &m), TP_ERR_INVALID_ARG);
    cr_assert_null(m);
    CHECK_ERR(tp_nn_custom_create("", custom_fwd, NULL, NULL, &m), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_nn_custom_create("a.b", custom_fwd, NULL, NULL, &m), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_nn_custom_create("Global", custom_fwd, NULL, NULL, &m), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_nn_custom_create("T", NULL, NULL, NULL, &m), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_nn_custom_create("T", custom_fwd, &hl, count_free, NULL), TP_ERR_INVALID_ARG);
    cr_assert_eq(hl.freed, 0, "a failed create leaves ctx to the caller");

    tp_tensor *x = mk(1, (int64_t[]){3}, 1), *out = (tp_tensor *)0x1;
    CHECK_OK(tp_nn_custom_create("Empty", no_output_fwd, NULL, NULL, &m));
    CHECK_ERR(tp_module_call(m, x, &out), TP_ERR_STATE);
    cr_assert(strstr(tp_last_error(), "the forward of Empty returned no output"), "%s",
              tp_last_error());
    cr_assert_null(out);
    tp_module_free(m);
    CHECK_OK(tp_nn_custom_create("Failing", failing_fwd, NULL, NULL, &m));
    out = (tp_tensor *)0x1;
    CHECK_ERR(tp_module_call(m, x, &out), TP_ERR_INVALID_ARG);
    cr_assert_null(out);
    cr_assert_str_eq(tp_comm_debug_current_scope(), "Global");
    /* hooks: NULL arguments */
    CHECK_ERR(tp_module_add_forward_pre_hook(NULL, pre_a, NULL, NULL, NULL),
              TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_module_add_forward_pre_hook(m, NULL, NULL, NULL, NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_module_add_forward_hook(NULL, post_c, NULL, NULL, NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_module_add_forward_hook(m, NULL, NULL, NULL, NULL), TP_ERR_INVALID_ARG);
    tp_module_free(m);
    tp_tensor_release(x);
}

Test(nn, hooks_replace_inputs_and_outputs_in_order, .timeout = 30)
{
    hook_log hl = {0};
    tp_module *m = NULL;
    CHECK_OK(tp_nn_custom_create("Adder", custom_fwd, &hl, NULL, &m));
    CHECK_OK(tp_module_add_forward_pre_hook(m, pre_a, &hl, count_free, NULL));
    CHECK_OK(tp_module_add_forward_pre_hook(m, pre_b, &hl, count_free, NULL));
    CHECK_OK(tp_module_add_forward_hook(m, post_c, &hl, count_free, NULL));
    CHECK_OK(tp_module_add_forward_hook(m, post_d, &hl, count_free, NULL));
    tp_tensor *x = mk(2, (int64_t[]){2, 3}, 1), *y = mk(2, (int64_t[]){2, 3}, 2),
              *s = mk(2, (int64_t[]){2, 3}, 3), *x0 = NULL, *out = NULL;
    CHECK_OK(tp_tensor_clone(x, &x0));
    CHECK_OK(run_adder(m, x, y, s, &out));
    cr_assert_str_eq(hl.log, "abFcd", "pre-hooks, forward, hooks, each in order");
    /* expected: (2x + y) * (-s) * 3 */
    tp_tensor *x2 = NULL, *sum = NULL, *ns = NULL, *prod = NULL, *ref = NULL;
    CHECK_OK(tp_scale(x, 2.0, &x2));
    CHECK_OK(tp_add(x2, y, &sum));
    CHECK_OK(tp_scale(s, -1.0, &ns));
    CHECK_OK(tp_mul(sum, ns, &prod));
    CHECK_OK(tp_scale(prod, 3.0, &ref));
    assert_equal(out, ref, "hooked forward");
    cr_assert_not_null(hl.seen_input);
    cr_assert_neq(hl.seen_input, x, "hooks see the inputs the pre-hooks installed");
    assert_equal(x, x0, "the caller's input is untouched");

    /* a failing pre-hook stops before the forward; a failing hook drops the
     * output; both leave the scope stack as it was */
    hook_log fl = {0};
    tp_module *f = NULL;
    CHECK_OK(tp_nn_custom_create("Adder", custom_fwd, &fl, NULL, &f));
    CHECK_OK(tp_module_add_forward_pre_hook(f, pre_fail, &fl, NULL, NULL));
    tp_tensor *o = (tp_tensor *)0x1;
    cr_assert_eq(run_adder(f, x, y, s, &o), TP_ERR_MISMATCH);
    cr_assert_null(o);
    cr_assert_str_eq(fl.log, "X");
    cr_assert_str_eq(tp_comm_debug_current_scope(), "Global");
    tp_module_free(f);
    fl = (hook_log){0};
    CHECK_OK(tp_nn_custom_create("Adder", custom_fwd, &fl, NULL, &f));
    CHECK_OK(tp_module_add_forward_hook(f, post_fail, &fl, NULL, NULL));
    CHECK_OK(tp_module_add_forward_hook(f, post_d, &fl, NULL, NULL));
    o = (tp_tensor *)0x1;
    cr_assert_eq(run_adder(f, x, y, s, &o), TP_ERR_MISMATCH);
    cr_assert_null(o);
    cr_assert_str_eq(fl.log, "FY", "hooks after a failing one do not run");
    cr_assert_str_eq(tp_comm_debug_current_scope(), "Global");
    tp_module_free(f);

    tp_tensor *tps[] = {x, y, s, x0, out, x2, sum, ns, prod, ref};
    for (size_t i = 0; i < sizeof tps / sizeof tps[0]; i++)
        tp_tensor_release(tps[i]);
    cr_assert_eq(hl.freed, 0);
    tp_module_free(m);
    cr_assert_eq(hl.freed, 4, "every hook's ctx_free runs at tp_module_free");
}

Test(nn, hooks_on_builtin_modules, .timeout = 30)
{
    /* a pre-hook replacing the input of a Linear, a hook on a Sequential child */
    hook_log hl = {0};
    tp_module *seq = NULL, *lin = NULL, *id = NULL;
    CHECK_OK(tp_nn_sequential_create(&seq));
    CHECK_OK(tp_nn_linear_create(3, 3, false, &lin));
    CHECK_OK(tp_nn_identity_create(&id));
    CHECK_OK(tp_module_add_child(seq, "0", id));
    CHECK_OK(tp_module_add_child(seq, "1", lin));
    CHECK_OK(tp_module_init(seq, 4));
    CHECK_OK(tp_module_add_forward_pre_hook(lin, pre_a, &hl, NULL, NULL));
    CHECK_OK(tp_module_add_forward_hook(id, post_c, &hl, NULL, NULL));
    tp_tensor *x = mk(2, (int64_t[]){2, 3}, 1), *y = call1(seq, x), *x6 = NULL, *ref = NULL;
    cr_assert_str_eq(hl.log, "ca");
    CHECK_OK(tp_scale(x, 6.0, &x6));
    CHECK_OK(tp_linear(x6, tp_module_parameter(lin, "weight"), NULL, &ref));
    assert_equal(y, ref, "Sequential with hooks");
    tp_tensor_release(x);
    tp_tensor_release(y);
    tp_tensor_release(x6);
    tp_tensor_release(ref);
    tp_module_free(seq);
}

/* ---- removing hooks ------------------------------------------------------------- */

static tp_status step_logger(tp_module *m, void *ctx)
{
    (void)m;
    logc(ctx, 'S');
    return TP_OK;
}

Test(nn, hooks_removed_by_handle, .timeout = 30)
{
    hook_log hl = {0}, sl = {0};
    tp_module *m = NULL;
    int ha = -1, hb = -1, hc = -1, hd = -1, hs = -1, bad = -1;
    CHECK_OK(tp_nn_custom_create("Adder", custom_fwd, &hl, NULL, &m));
    CHECK_OK(tp_module_add_forward_pre_hook(m, pre_a, &hl, count_free, &ha));
    CHECK_OK(tp_module_add_forward_pre_hook(m, pre_b, &hl, count_free, &hb));
    CHECK_OK(tp_module_add_forward_hook(m, post_c, &hl, count_free, &hc));
    CHECK_OK(tp_module_add_forward_hook(m, post_d, &hl, count_free, &hd));
    CHECK_OK(tp_module_add_step_pre_hook(m, step_logger, &sl, count_free, &hs));
    int hs_all[] = {ha, hb, hc, hd, hs};
    for (int i = 0; i < 5; i++) {
        cr_assert_gt(hs_all[i], 0, "handle %d is %d", i, hs_all[i]);
        for (int j = 0; j < i; j++)
            cr_assert_neq(hs_all[i], hs_all[j], "handles %d and %d are equal", j, i);
    }
    CHECK_ERR(tp_module_add_forward_hook(NULL, post_c, &hl, count_free, &bad),
              TP_ERR_INVALID_ARG);
    cr_assert_eq(bad, 0, "a failed add sets the handle to 0");
    cr_assert_eq(hl.freed, 0, "a failed add leaves ctx to the caller");

    tp_tensor *x = mk(2, (int64_t[]){2, 3}, 1), *y = mk(2, (int64_t[]){2, 3}, 2),
              *s = mk(2, (int64_t[]){2, 3}, 3), *out = NULL;
    CHECK_OK(run_adder(m, x, y, s, &out));
    tp_tensor_release(out);
    cr_assert_str_eq(hl.log, "abFcd");

    tp_module_remove_hook(m, hb);
    cr_assert_eq(hl.freed, 1, "ctx_free runs when the hook is removed");
    tp_module_remove_hook(m, hc);
    cr_assert_eq(hl.freed, 2);
    hl.log[0] = '\0';
    CHECK_OK(run_adder(m, x, y, s, &out));
    cr_assert_str_eq(hl.log, "aFd", "removed hooks do not run");
    /* (2x + y) * s: neither the negation of b nor the tripling of c */
    tp_tensor *x2 = NULL, *sum = NULL, *ref = NULL;
    CHECK_OK(tp_scale(x, 2.0, &x2));
    CHECK_OK(tp_add(x2, y, &sum));
    CHECK_OK(tp_mul(sum, s, &ref));
    assert_equal(out, ref, "forward without the removed hooks");
    tp_tensor_release(out);

    /* unknown handles, a second removal, NULL: no-ops */
    tp_module_remove_hook(m, hb);
    tp_module_remove_hook(m, 0);
    tp_module_remove_hook(m, -1);
    tp_module_remove_hook(m, 1000);
    tp_module_remove_hook(NULL, ha);
    cr_assert_eq(hl.freed, 2, "a no-op removal freed something");
    hl.log[0] = '\0';
    CHECK_OK(run_adder(m, x, y, s, &out));
    tp_tensor_release(out);
    cr_assert_str_eq(hl.log, "aFd");

    /* a step pre-hook */
    CHECK_OK(tp_sgd_step(m, 0.1));
    cr_assert_str_eq(sl.log, "S");
    tp_module_remove_hook(m, hs);
    cr_assert_eq(sl.freed, 1);
    CHECK_OK(tp_sgd_step(m, 0.1));
    cr_assert_str_eq(sl.log, "S", "a removed step pre-hook ran");

    /* a handle given out after removals is new */
    int he = -1;
    CHECK_OK(tp_module_add_forward_hook(m, post_c, &hl, count_free, &he));
    for (int i = 0; i < 5; i++)
        cr_assert_neq(he, hs_all[i], "handle %d reused", he);
    tp_module_remove_hook(m, ha);
    tp_module_remove_hook(m, hd);
    cr_assert_eq(hl.freed, 4);
    tp_module_free(m);
    cr_assert_eq(hl.freed, 5, "every ctx_free ran once (%d)", hl.freed);
    cr_assert_eq(sl.freed, 1);
    tp_tensor *tps[] = {x, y, s, x2, sum, ref};
    for (size_t i = 0; i < sizeof tps / sizeof tps[0]; i++)
        tp_tensor_release(tps[i]);
}

/* A pre-hook that removes itself and another hook while the forward runs;
 * its ctx must stay valid until the module returns. */
typedef struct remover {
    tp_module *m; /* where the handles live */
    int self, other;
    int runs, post_runs, freed, freed_inside;
} remover;

static tp_status pre_remover(tp_module *m, int nargs, tp_tensor **args, int nkw, tp_kwarg *kw,
                             void *ctx)
{
    (void)m, (void)nargs, (void)args, (void)nkw, (void)kw;
    remover *r = ctx;
    r->runs++;
    tp_module_remove_hook(r->m, r->self);
    tp_module_remove_hook(r->m, r->other);
    r->freed_inside = r->freed; /* ctx is still ours */
    return TP_OK;
}

static tp_status post_count(tp_module *m, int nargs, tp_tensor *const *args, tp_tensor **out,
                            void *ctx)
{
    (void)m, (void)nargs, (void)args, (void)out;
    ((remover *)ctx)->post_runs++;
    return TP_OK;
}

static void remover_free(void *ctx) { ((remover *)ctx)->freed++; }

Test(nn, hooks_removed_while_running, .timeout = 30)
{
    /* on the running module itself */
    remover r = {0};
    tp_module *lin = NULL;
    CHECK_OK(tp_nn_linear_create(3, 3, false, &lin));
    CHECK_OK(tp_module_init(lin, 4));
    r.m = lin;
    CHECK_OK(tp_module_add_forward_pre_hook(lin, pre_remover, &r, remover_free, &r.self));
    CHECK_OK(tp_module_add_forward_hook(lin, post_count, &r, remover_free, &r.other));
    tp_tensor *x = mk(2, (int64_t[]){2, 3}, 1), *y = call1(lin, x);
    cr_assert_eq(r.runs, 1);
    cr_assert_eq(r.post_runs, 0, "a hook removed earlier in the forward ran");
    cr_assert_eq(r.freed_inside, 0, "ctx_free ran while the hook was running");
    cr_assert_eq(r.freed, 2, "ctx_free runs once the module returns (%d)", r.freed);
    tp_tensor *y2 = call1(lin, x);
    cr_assert_eq(r.runs, 1);
    cr_assert_eq(r.post_runs, 0);
    assert_equal(y2, y, "the plain Linear");
    tp_module_free(lin);
    cr_assert_eq(r.freed, 2, "ctx_free ran again at tp_module_free");
    tp_tensor_release(y);
    tp_tensor_release(y2);

    /* a child's hook removes a hook of its running parent */
    remover q = {0};
    tp_module *seq = NULL, *id = NULL;
    CHECK_OK(tp_nn_sequential_create(&seq));
    CHECK_OK(tp_nn_identity_create(&id));
    CHECK_OK(tp_module_add_child(seq, "0", id));
    q.m = seq;
    CHECK_OK(tp_module_add_forward_hook(seq, post_count, &q, remover_free, &q.other));
    CHECK_OK(tp_module_add_forward_pre_hook(id, pre_remover, &q, NULL, NULL));
    y = call1(seq, x);
    cr_assert_eq(q.runs, 1);
    cr_assert_eq(q.post_runs, 0, "the parent's hook ran after its removal");
    cr_assert_eq(q.freed, 1);
    tp_tensor_release(y);
    tp_module_free(seq);
    cr_assert_eq(q.freed, 1);
    tp_tensor_release(x);
}

/* ---- comm-debug scopes ---------------------------------------------------------- */

typedef struct {
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} rank_ctx;

/* Inner: all_reduce of its input on the world (ctx). */
static tp_status allreduce_fwd(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                               const tp_kwarg *kw, tp_tensor **out)
{
    (void)nargs, (void)nkw, (void)kw;
    tp_tensor *r = NULL;
    TP_TEST_TRY(tp_tensor_zeros(TP_F32, TP_CPU, tp_tensor_ndim(args[0]),
                                tp_tensor_shape(args[0]), &r));
    tp_status st = tp_all_reduce(tp_module_ctx(self), args[0], r, TP_SUM, NULL);
    if (st != TP_OK) {
        tp_tensor_release(r);
        return st;
    }
    *out = r;
    return TP_OK;
}

/* MLP: net2(net1(x)). */
static tp_status mlp_fwd(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                         const tp_kwarg *kw, tp_tensor **out)
{
    (void)nargs, (void)nkw, (void)kw;
    tp_tensor *h = NULL;
    TP_TEST_TRY(tp_module_call(tp_module_child(self, "net1"), args[0], &h));
    tp_status st = tp_module_call(tp_module_child(self, "net2"), h, out);
    tp_tensor_release(h);
    return st;
}

static tp_status barrier_pre(tp_module *m, int nargs, tp_tensor **args, int nkw, tp_kwarg *kw,
                             void *ctx)
{
    (void)m, (void)nargs, (void)args, (void)nkw, (void)kw;
    return tp_barrier(ctx, NULL);
}

static tp_status allreduce_post(tp_module *m, int nargs, tp_tensor *const *args,
                                tp_tensor **out, void *ctx)
{
    (void)m, (void)nargs, (void)args;
    return tp_all_reduce(ctx, *out, *out, TP_SUM, NULL);
}

/* Inner, in a user scope "core" of its own (nested in the module's). */
static tp_status core_allreduce_fwd(tp_module *self, int nargs, tp_tensor *const *args,
                                    int nkw, const tp_kwarg *kw, tp_tensor **out)
{
    TP_TEST_TRY(tp_comm_debug_push_scope("core"));
    tp_status st = allreduce_fwd(self, nargs, args, nkw, kw, out);
    tp_status pop = tp_comm_debug_pop_scope();
    return st != TP_OK ? st : pop;
}

/* A container: calls its first child. */
static tp_status first_child_fwd(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                                 const tp_kwarg *kw, tp_tensor **out)
{
    (void)nargs, (void)nkw, (void)kw;
    return tp_module_call(tp_module_child_at(self, 0, NULL), args[0], out);
}

/* A container calling its first child inside a user scope "heads". */
static tp_status heads_fwd(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                           const tp_kwarg *kw, tp_tensor **out)
{
    TP_TEST_TRY(tp_comm_debug_push_scope("heads"));
    tp_status st = first_child_fwd(self, nargs, args, nkw, kw, out);
    tp_status pop = tp_comm_debug_pop_scope();
    return st != TP_OK ? st : pop;
}

/* Runs a comm-debug writer into buf (NUL-terminated). */
static tp_status capture_writer(tp_status (*writer)(const tp_comm_debug *, FILE *),
                                const tp_comm_debug *d, char *buf, size_t cap)
{
    memset(buf, 0, cap);
    FILE *f = fmemopen(buf, cap - 1, "w");
    if (!f)
        return TP_ERR_BACKEND;
    tp_status st = writer(d, f);
    fclose(f);
    return st;
}

/* The checked query refuses a scope never seen: exact code, the message
 * names the scope and contains `part`. */
static void expect_never_seen(tp_test_slot *s, const tp_comm_debug *d, const char *fqn,
                              const char *part, const char *what)
{
    int64_t got = -1;
    tp_clear_error();
    tp_status st = tp_comm_debug_scope_count(d, fqn, TP_PHASE_COUNT, TP_COLL_ANY, &got);
    char quoted[300];
    snprintf(quoted, sizeof quoted, "scope \"%s\" was never entered", fqn);
    RANK_EXPECT(s, st == TP_ERR_INVALID_ARG && got == 0,
                "%s: scope \"%s\": %s, count %lld; expected TP_ERR_INVALID_ARG", what, fqn,
                tp_status_name(st), (long long)got);
    RANK_EXPECT(s, strstr(tp_last_error(), quoted) && strstr(tp_last_error(), part),
                "%s: the message for \"%s\" lacks '%s' or '%s': %s", what, fqn, quoted, part,
                tp_last_error());
}

#define SCOPE_IS(s, d, fqn, phase, kind, want, what)                                  \
    (void)tp_test_scope_count_is(s, d, fqn, TP_PHASE_##phase, TP_COLL_##kind, want, what)

/*
 * MLP (custom): net1 = Inner (all_reduce inside a user scope "core"),
 * net2 = Linear with a barrier pre-hook; a root Linear "solo" whose hook
 * all-reduces. Module scopes are the plan FQNs ("net1"), the root's is "",
 * whoever calls the module.
 */
static tp_status scope_body(tp_comm *w, void *arg)
{
    rank_ctx *c = arg;
    tp_test_slot *s = &c->slot[tp_comm_rank(w)];
    tp_module *mlp = NULL, *inner = NULL, *lin = NULL, *solo = NULL;
    RANK_OK(s, tp_nn_custom_create("MLP", mlp_fwd, NULL, NULL, &mlp));
    RANK_OK(s, tp_nn_custom_create("Inner", core_allreduce_fwd, w, NULL, &inner));
    RANK_OK(s, tp_module_add_child(mlp, "net1", inner));
    RANK_OK(s, tp_nn_linear_create(4, 4, true, &lin));
    RANK_OK(s, tp_module_add_child(mlp, "net2", lin));
    RANK_OK(s, tp_module_add_forward_pre_hook(lin, barrier_pre, w, NULL, NULL));
    RANK_OK(s, tp_module_init(mlp, 5));
    RANK_OK(s, tp_nn_linear_create(4, 2, true, &solo));
    RANK_OK(s, tp_module_add_forward_hook(solo, allreduce_post, w, NULL, NULL));

    tp_comm_debug *d = NULL;
    tp_tensor *x = NULL, *y = NULL, *z = NULL;
    char buf[4096];
    RANK_OK(s, randint(2, (int64_t[]){2, 4}, 3, &x));
    RANK_OK(s, tp_comm_debug_create(&d));

    /* through the root, then a user scope of the training step */
    RANK_OK(s, tp_comm_debug_begin(d));
    RANK_OK(s, tp_module_call(mlp, x, &y));
    RANK_OK(s, tp_comm_debug_push_scope("loss"));
    RANK_OK(s, tp_barrier(w, NULL));
    RANK_OK(s, tp_comm_debug_pop_scope());
    RANK_OK(s, tp_comm_debug_end(d));
    SCOPE_IS(s, d, TP_COMM_DEBUG_GLOBAL, COUNT, ANY, 3, "Global");
    SCOPE_IS(s, d, TP_COMM_DEBUG_ROOT, COUNT, ANY, 2, "the root MLP");
    SCOPE_IS(s, d, "net1", FORWARD, ALL_REDUCE, 1, "net1");
    SCOPE_IS(s, d, "net1", COUNT, ANY, 1, "net1");
    SCOPE_IS(s, d, "net1.core", FORWARD, ALL_REDUCE, 1, "a user scope nests in the module's");
    SCOPE_IS(s, d, "net2", FORWARD, BARRIER, 1, "net2: the pre-hook's barrier counts there");
    SCOPE_IS(s, d, "net2", COUNT, ALL_REDUCE, 0, "net2 was seen, without all_reduce");
    SCOPE_IS(s, d, "loss", FORWARD, BARRIER, 1, "loss");
    expect_never_seen(s, d, "net3",
                      "; scopes seen: \"Global\", \"\" (MLP), \"net1\", \"net1.core\", "
                      "\"net2\", \"loss\"", "a module that does not exist");
    RANK_EXPECT(s, !strcmp(tp_last_error(),
                           "comm_debug_scope_count: scope \"net3\" was never entered while the "
                           "counter was active; scopes seen: \"Global\", \"\" (MLP), \"net1\", "
                           "\"net1.core\", \"net2\", \"loss\""),
                "message: %s", tp_last_error());
    expect_never_seen(s, d, "MLP.net1", "did you mean \"net1\"?", "the type-name prefix");
    expect_never_seen(s, d, "MLP", "the root module's scope is \"\"", "the root's type name");
    RANK_EXPECT(s, tp_comm_debug_module_count(d, "net3", TP_PHASE_COUNT, TP_COLL_ANY) == 0,
                "the unchecked query reads 0 for a scope never seen");

    static const char json[] =
        "{\n"
        "  \"Global\": {\"forward\": {\"all_reduce\": 1, \"barrier\": 2}, \"backward\": {}},\n"
        "  \"\": {\"forward\": {\"all_reduce\": 1, \"barrier\": 1}, \"backward\": {}},\n"
        "  \"net1\": {\"forward\": {\"all_reduce\": 1}, \"backward\": {}},\n"
        "  \"net1.core\": {\"forward\": {\"all_reduce\": 1}, \"backward\": {}},\n"
        "  \"net2\": {\"forward\": {\"barrier\": 1}, \"backward\": {}},\n"
        "  \"loss\": {\"forward\": {\"barrier\": 1}, \"backward\": {}}\n"
        "}\n";
    RANK_OK(s, capture_writer(tp_comm_debug_write_json, d, buf, sizeof buf));
    RANK_EXPECT(s, !strcmp(buf, json), "JSON:\n%.440s", buf);
    static const char table[] =
        "Global\n"
        "  FORWARD PASS\n"
        "    all_reduce: 1\n"
        "    barrier: 2\n"
        "  MLP\n"
        "    FORWARD PASS\n"
        "      all_reduce: 1\n"
        "      barrier: 1\n"
        "    net1\n"
        "      FORWARD PASS\n"
        "        all_reduce: 1\n"
        "      net1.core\n"
        "        FORWARD PASS\n"
        "          all_reduce: 1\n"
        "    net2\n"
        "      FORWARD PASS\n"
        "        barrier: 1\n"
        "  loss\n"
        "    FORWARD PASS\n"
        "      barrier: 1\n";
    RANK_OK(s, capture_writer(tp_comm_debug_write_table, d, buf, sizeof buf));
    RANK_EXPECT(s, !strcmp(buf, table), "table:\n%.440s", buf);
    tp_tensor_release(y);
    y = NULL;

    /* net2 called directly: the same scope, and not its root's */
    RANK_OK(s, tp_comm_debug_begin(d));
    RANK_OK(s, tp_module_call(tp_module_find(mlp, "net2"), x, &y));
    RANK_OK(s, tp_comm_debug_end(d));
    SCOPE_IS(s, d, "net2", FORWARD, BARRIER, 1, "net2 called directly");
    expect_never_seen(s, d, TP_COMM_DEBUG_ROOT, "scopes seen: \"Global\", \"net2\"",
                      "the root, which did not run");
    RANK_OK(s, capture_writer(tp_comm_debug_write_table, d, buf, sizeof buf));
    RANK_EXPECT(s, !strcmp(buf, "Global\n  FORWARD PASS\n    barrier: 1\n"
                                "  net2\n    FORWARD PASS\n      barrier: 1\n"),
                "table of a direct call:\n%.440s", buf);
    tp_tensor_release(y);
    y = NULL;

    /* module scopes do not nest in user scopes; two roots share "" */
    RANK_OK(s, tp_comm_debug_begin(d));
    RANK_OK(s, tp_comm_debug_push_scope("step"));
    RANK_OK(s, tp_module_call(mlp, x, &y));
    RANK_OK(s, tp_comm_debug_pop_scope());
    RANK_OK(s, tp_module_call(solo, x, &z));
    RANK_OK(s, tp_comm_debug_end(d));
    SCOPE_IS(s, d, "step", COUNT, ANY, 2, "the user scope around the model");
    SCOPE_IS(s, d, "net1", FORWARD, ALL_REDUCE, 1, "net1 inside a user scope");
    expect_never_seen(s, d, "step.net1", "\"step\", \"\" (MLP, Linear), \"net1\"",
                      "a module inside a user scope");
    SCOPE_IS(s, d, TP_COMM_DEBUG_ROOT, FORWARD, ALL_REDUCE, 2, "both roots");
    SCOPE_IS(s, d, TP_COMM_DEBUG_ROOT, FORWARD, BARRIER, 1, "both roots");
    RANK_OK(s, capture_writer(tp_comm_debug_write_table, d, buf, sizeof buf));
    RANK_EXPECT(s, strstr(buf, "\n  step\n") && strstr(buf, "\n    MLP, Linear\n"),
                "table with two roots:\n%.440s", buf);
    SCOPE_IS(s, d, TP_COMM_DEBUG_GLOBAL, COUNT, ANY, 3, "Global");
    tp_tensor_release(y);
    y = NULL;

    /* a scope open twice (a user scope named like the module inside it)
     * counts each collective once */
    RANK_OK(s, tp_comm_debug_begin(d));
    RANK_OK(s, tp_comm_debug_push_scope("net1"));
    RANK_OK(s, tp_module_call(mlp, x, &y));
    RANK_OK(s, tp_comm_debug_pop_scope());
    RANK_OK(s, tp_comm_debug_end(d));
    SCOPE_IS(s, d, "net1", FORWARD, ALL_REDUCE, 1, "net1 open twice");
    SCOPE_IS(s, d, "net1", FORWARD, BARRIER, 1, "the user scope net1 around net2");
    SCOPE_IS(s, d, "net1.core", FORWARD, ALL_REDUCE, 1, "net1.core");
    RANK_EXPECT(s, !strcmp(tp_comm_debug_current_scope(), "Global"), "scope left open: %s",
                tp_comm_debug_current_scope());
    tp_comm_debug_free(d);
    tp_tensor_release(x);
    tp_tensor_release(y);
    tp_tensor_release(z);
    tp_module_free(mlp);
    tp_module_free(solo);
    return TP_OK;
}

TP_TEST_WORLD_SIZE_PARAMS(nn, comm_debug_scopes_are_plan_fqns)

ParameterizedTest(int *n, nn, comm_debug_scopes_are_plan_fqns, .timeout = 60)
{
    rank_ctx c = {0};
    tp_test_run(*n, scope_body, &c, c.slot);
}

/* Transformer -> layers -> 0 -> attention (calls wq inside a user scope
 * "heads") -> wq (all_reduce): deep FQNs, and wq called on its own. */
static tp_status deep_scope_body(tp_comm *w, void *arg)
{
    rank_ctx *c = arg;
    tp_test_slot *s = &c->slot[tp_comm_rank(w)];
    static const struct {
        const char *type, *name;
    } chain[] = {{"ModuleList", "layers"}, {"Block", "0"}, {"Attention", "attention"}};
    tp_module *root = NULL, *m = NULL, *wq = NULL;
    RANK_OK(s, tp_nn_custom_create("Transformer", first_child_fwd, NULL, NULL, &root));
    tp_module *parent = root;
    for (size_t i = 0; i < sizeof chain / sizeof chain[0]; i++) {
        RANK_OK(s, tp_nn_custom_create(chain[i].type, i == 2 ? heads_fwd : first_child_fwd, NULL,
                                       NULL, &m));
        RANK_OK(s, tp_module_add_child(parent, chain[i].name, m));
        parent = m;
    }
    RANK_OK(s, tp_nn_custom_create("Inner", allreduce_fwd, w, NULL, &wq));
    RANK_OK(s, tp_module_add_child(parent, "wq", wq));

    tp_comm_debug *d = NULL;
    tp_tensor *x = NULL, *y = NULL;
    char buf[4096];
    RANK_OK(s, randint(2, (int64_t[]){2, 4}, 3, &x));
    RANK_OK(s, tp_comm_debug_create(&d));
    RANK_OK(s, tp_comm_debug_begin(d));
    RANK_OK(s, tp_module_call(root, x, &y));
    RANK_OK(s, tp_comm_debug_end(d));
    static const char *const fqns[] = {TP_COMM_DEBUG_GLOBAL, TP_COMM_DEBUG_ROOT, "layers",
                                       "layers.0", "layers.0.attention",
                                       "layers.0.attention.heads", "layers.0.attention.wq"};
    for (size_t i = 0; i < sizeof fqns / sizeof fqns[0]; i++)
        SCOPE_IS(s, d, fqns[i], FORWARD, ALL_REDUCE, 1, "through the root");
    RANK_EXPECT(s, tp_module_find(root, "layers.0.attention.wq") == wq,
                "tp_module_find resolves the scope's FQN");
    RANK_OK(s, capture_writer(tp_comm_debug_write_table, d, buf, sizeof buf));
    RANK_EXPECT(s, strstr(buf, "\n  Transformer\n") &&
                       strstr(buf, "\n          layers.0.attention.heads\n") &&
                       strstr(buf, "\n            layers.0.attention.wq\n") &&
                       strstr(buf, "\n                all_reduce: 1\n"),
                "table (indented by nesting):\n%.440s", buf);
    tp_tensor_release(y);
    y = NULL;

    RANK_OK(s, tp_comm_debug_begin(d));
    RANK_OK(s, tp_module_call(wq, x, &y));
    RANK_OK(s, tp_comm_debug_end(d));
    SCOPE_IS(s, d, "layers.0.attention.wq", FORWARD, ALL_REDUCE, 1, "wq called directly");
    expect_never_seen(s, d, "layers.0.attention", "scopes seen: \"Global\", "
                      "\"layers.0.attention.wq\"", "wq's parent did not run");
    expect_never_seen(s, d, "wq", "scopes seen", "wq's own name is not its FQN");
    RANK_OK(s, capture_writer(tp_comm_debug_write_table, d, buf, sizeof buf));
    RANK_EXPECT(s, !strcmp(buf, "Global\n  FORWARD PASS\n    all_reduce: 1\n"
                                "  layers.0.attention.wq\n    FORWARD PASS\n"
                                "      all_reduce: 1\n"),
                "table of a direct call:\n%.440s", buf);
    tp_comm_debug_free(d);
    tp_tensor_release(x);
    tp_tensor_release(y);
    tp_module_free(root);
    return TP_OK;
}

TP_TEST_WORLD_SIZE_PARAMS(nn, comm_debug_deep_fqns)

ParameterizedTest(int *n, nn, comm_debug_deep_fqns, .timeout = 60)
{
    rank_ctx c = {0};
    tp_test_run(*n, deep_scope_body, &c, c.slot);
}

/* "Global" is the root of all scopes: a child of a root named so cannot have
 * it as its module scope, deeper it can. */
Test(nn, comm_debug_child_named_global, .timeout = 10)
{
    tp_module *root = NULL, *lin = NULL, *mid = NULL, *deep = NULL;
    tp_tensor *x = NULL, *y = NULL;
    CHECK_OK(tp_nn_custom_create("Net", first_child_fwd, NULL, NULL, &root));
    CHECK_OK(tp_nn_linear_create(4, 4, true, &lin));
    CHECK_OK(tp_module_add_child(root, "Global", lin));
    CHECK_OK(tp_module_init(root, 1));
    CHECK_OK(randint(2, (int64_t[]){2, 4}, 3, &x));
    CHECK_ERR(tp_module_call(root, x, &y), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "\"Global\" is reserved"), "message: %s", tp_last_error());
    cr_assert_null(y);
    CHECK_ERR(tp_module_call(lin, x, &y), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "Linear 'Global'"), "message: %s", tp_last_error());
    cr_assert_str_eq(tp_comm_debug_current_scope(), "Global", "scopes popped on failure");

    CHECK_OK(tp_nn_custom_create("Mid", first_child_fwd, NULL, NULL, &mid));
    CHECK_OK(tp_nn_linear_create(4, 4, true, &deep));
    CHECK_OK(tp_module_add_child(mid, "Global", deep));
    CHECK_OK(tp_module_init(mid, 1));
    CHECK_OK(tp_module_add_child(root, "mid", mid));
    tp_comm_debug *d = NULL;
    CHECK_OK(tp_comm_debug_create(&d));
    CHECK_OK(tp_comm_debug_begin(d));
    CHECK_OK(tp_module_call(mid, x, &y));
    CHECK_OK(tp_comm_debug_end(d));
    int64_t n = -1;
    CHECK_OK(tp_comm_debug_scope_count(d, "mid.Global", TP_PHASE_COUNT, TP_COLL_ANY, &n));
    cr_assert_eq(n, 0);
    tp_comm_debug_free(d);
    tp_tensor_release(x);
    tp_tensor_release(y);
    tp_module_free(root);
}

/* ---- deterministic initialisation and state dicts at every degree ------------- */

/* net1 Linear(7,5), net2 Linear(5,3), emb Embedding(6,5), norm LayerNorm(5),
 * cust (custom) with parameter "scale" [5,3]. Any thread. */
static tp_status make_net(tp_module **out)
{
    tp_module *root = NULL, *m = NULL;
    TP_TEST_TRY(make_mlp(7, 5, 3, &root));
    tp_status st = tp_nn_embedding_create(6, 5, &m);
    if (st == TP_OK && (st = tp_module_add_child(root, "emb", m)) == TP_OK)
        m = NULL;
    if (st == TP_OK)
        st = tp_nn_layer_norm_create(5, true, 1e-5, &m);
    if (st == TP_OK && (st = tp_module_add_child(root, "norm", m)) == TP_OK)
        m = NULL;
    if (st == TP_OK)
        st = tp_nn_custom_create("Scale", custom_fwd, NULL, NULL, &m);
    if (st == TP_OK && (st = tp_module_add_child(root, "cust", m)) == TP_OK) {
        tp_tensor *t = NULL;
        st = tp_tensor_zeros(TP_F32, TP_CPU, 2, (int64_t[]){5, 3}, &t);
        if (st == TP_OK)
            st = tp_module_register_parameter(m, "scale", t);
        tp_tensor_release(t);
        m = NULL;
    }
    tp_module_free(m);
    if (st != TP_OK) {
        tp_module_free(root);
        return st;
    }
    *out = root;
    return TP_OK;
}

#define NET_N 9
static const char *const net_fqns[NET_N] = {"net1.weight", "net1.bias",  "net2.weight",
                                            "net2.bias",   "emb.weight", "norm.weight",
                                            "norm.bias",   "cust.scale", NULL};

/* The placement of each parameter on the last mesh dim (mesh dim 0 of a 2-D
 * mesh shards tensor dim 0 as well). */
static tp_placement net_placement(int i)
{
    switch (i) {
    case 0: case 1: case 5: return tp_shard(0);
    case 2: case 4: case 7: return tp_shard(1);
    default: return tp_replicate();
    }
}

/* Distributes every parameter of net over mesh (distribute, no comm; the
 * custom parameter through from_local). Any thread. */
static tp_status shard_net(tp_mesh *mesh, tp_module *net)
{
    int md = tp_mesh_ndim(mesh);
    for (int i = 0; net_fqns[i]; i++) {
        char owner_path[64];
        snprintf(owner_path, sizeof owner_path, "%s", net_fqns[i]);
        char *dot = strrchr(owner_path, '.');
        *dot = '\0';
        tp_module *owner = tp_module_find(net, owner_path);
        if (!owner)
            return TP_ERR_STATE;
        tp_tensor *p = tp_module_parameter(owner, dot + 1), *dt = NULL;
        tp_placement pl[2];
        for (int d = 0; d < md; d++)
            pl[d] = d == md - 1 ? net_placement(i) : tp_shard(0);
        if (i == 7) {
            int64_t ls[2], off[2];
            TP_TEST_TRY(tp_dtensor_shard_extent(mesh, 2, tp_tensor_shape(p), md, pl, NULL, ls,
                                                off));
            tp_tensor *local = NULL;
            TP_TEST_TRY(tp_tensor_zeros(TP_F32, TP_CPU, 2, ls, &local));
            tp_from_local_options o = {.global_shape = tp_tensor_shape(p)};
            tp_status st = tp_dtensor_from_local(mesh, local, md, pl, &o, &dt);
            tp_tensor_release(local);
            TP_TEST_TRY(st);
        } else {
            TP_TEST_TRY(tp_dtensor_distribute(mesh, p, md, pl, -1, &dt));
        }
        tp_status st = tp_module_set_parameter(owner, dot + 1, dt);
        tp_tensor_release(dt);
        TP_TEST_TRY(st);
    }
    return TP_OK;
}

typedef struct {
    int mesh_ndim;
    int64_t mesh_shape[2];
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} dist_ctx;

static tp_status init_body(tp_comm *w, void *arg)
{
    dist_ctx *c = arg;
    tp_test_slot *s = &c->slot[tp_comm_rank(w)];
    tp_mesh *mesh = NULL;
    tp_module *ref = NULL, *net = NULL;
    RANK_OK(s, tp_mesh_create(w, c->mesh_ndim, c->mesh_shape, NULL, &mesh));
    RANK_OK(s, make_net(&ref));
    RANK_OK(s, make_net(&net));
    RANK_OK(s, shard_net(mesh, net));
    RANK_OK(s, tp_module_init(ref, 1234));
    RANK_OK(s, tp_module_init(net, 1234));
    plist lr = {0}, ln = {0};
    RANK_OK(s, tp_module_named_parameters(ref, collect, &lr));
    RANK_OK(s, tp_module_named_parameters(net, collect, &ln));
    RANK_EXPECT(s, lr.n == NET_N - 1 && ln.n == NET_N - 1, "%d and %d parameters", lr.n, ln.n);
    for (int i = 0; i < ln.n && i < lr.n; i++) {
        RANK_EXPECT(s, !strcmp(ln.fqn[i], net_fqns[i]) && !strcmp(lr.fqn[i], net_fqns[i]),
                    "parameter %d is %s / %s", i, ln.fqn[i], lr.fqn[i]);
        RANK_EXPECT(s, tp_tensor_is_dtensor(ln.t[i]), "%s stays a DTensor", ln.fqn[i]);
        tp_tensor *full = NULL;
        RANK_OK(s, tp_dtensor_full_tensor(ln.t[i], &full));
        bool eq = false;
        RANK_OK(s, tp_tensor_equal(full, lr.t[i], &eq));
        RANK_EXPECT(s, eq, "%s: sharded init differs from the single-rank one", ln.fqn[i]);
        tp_tensor_release(full);
    }
    tp_module_free(ref);
    tp_module_free(net);
    tp_mesh_free(mesh);
    return TP_OK;
}

typedef struct {
    int ndim;
    int64_t shape[2];
} mesh_case;

ParameterizedTestParameters(nn, init_equal_at_every_degree)
{
    static mesh_case m[] = {{1, {1}}, {1, {2}}, {1, {3}}, {1, {4}}, {1, {8}}, {2, {2, 2}}};
    return cr_make_param_array(mesh_case, m, sizeof m / sizeof m[0]);
}

ParameterizedTest(mesh_case *mc, nn, init_equal_at_every_degree, .timeout = 60)
{
    dist_ctx c = {.mesh_ndim = mc->ndim};
    int n = 1;
    for (int d = 0; d < mc->ndim; d++)
        n *= (int)(c.mesh_shape[d] = mc->shape[d]);
    tp_test_run(n, init_body, &c, c.slot);
}

Test(nn, init_distributions, .timeout = 30)
{
    tp_module *net = NULL, *again = NULL, *other = NULL;
    CHECK_OK(make_net(&net));
    CHECK_OK(make_net(&again));
    CHECK_OK(make_net(&other));
    CHECK_OK(tp_module_init(net, 7));
    CHECK_OK(tp_module_init(again, 7));
    CHECK_OK(tp_module_init(other, 8));
    plist a = {0}, b = {0}, o = {0};
    CHECK_OK(tp_module_named_parameters(net, collect, &a));
    CHECK_OK(tp_module_named_parameters(again, collect, &b));
    CHECK_OK(tp_module_named_parameters(other, collect, &o));
    for (int i = 0; i < a.n; i++) {
        assert_equal(a.t[i], b.t[i], a.fqn[i]);
        bool eq = true;
        CHECK_OK(tp_tensor_equal(a.t[i], o.t[i], &eq));
        if (i != 5 && i != 6)
            cr_assert(!eq, "%s: another seed gives other values", a.fqn[i]);
    }
    /* bounds: Linear uniform(+-1/sqrt(in)), custom uniform(+-0.1), norm 1 / 0 */
    double bound[NET_N] = {1 / sqrt(7.0), 1 / sqrt(7.0), 1 / sqrt(5.0), 1 / sqrt(5.0), 0, 0, 0,
                           0.1};
    for (int i = 0; i < a.n; i++) {
        tp_tensor *t = a.t[i];
        int64_t rows = tp_tensor_size(t, 0);
        int64_t cols = tp_tensor_ndim(t) == 2 ? tp_tensor_size(t, 1) : 1;
        double mn = 1e9, mx = -1e9, sum = 0, sq = 0;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t k = 0; k < cols; k++) {
                double v = tp_tensor_ndim(t) == 2 ? at(t, r, k) : at(t, 0, r);
                mn = fmin(mn, v);
                mx = fmax(mx, v);
                sum += v;
                sq += v * v;
            }
        if (i == 5)
            cr_assert(mn == 1 && mx == 1, "norm.weight is 1");
        else if (i == 6)
            cr_assert(mn == 0 && mx == 0, "norm.bias is 0");
        else if (i == 4) {
            double nel = (double)(rows * cols), mean = sum / nel, var = sq / nel - mean * mean;
            cr_assert(fabs(mean) < 0.6 && var > 0.4 && var < 2 && mx < 6 && mn > -6,
                      "emb.weight looks normal(0, 1): mean %g, variance %g", mean, var);
        }
        else
            cr_assert(mn >= -bound[i] && mx < bound[i] && mx > mn, "%s in [%g, %g]: %g..%g",
                      a.fqn[i], -bound[i], bound[i], mn, mx);
    }
    /* two Linears of one shape draw different values (the FQN is in the seed) */
    tp_module *twin = NULL;
    CHECK_OK(make_mlp(4, 4, 4, &twin));
    CHECK_OK(tp_module_init(twin, 1));
    bool eq = true;
    CHECK_OK(tp_tensor_equal(tp_module_parameter(tp_module_child(twin, "net1"), "weight"),
                             tp_module_parameter(tp_module_child(twin, "net2"), "weight"), &eq));
    cr_assert(!eq, "net1.weight and net2.weight differ");
    CHECK_ERR(tp_module_init(NULL, 1), TP_ERR_INVALID_ARG);
    tp_module_free(twin);
    tp_module_free(net);
    tp_module_free(again);
    tp_module_free(other);
}

/* The full value a test loads for parameter i. Any thread. */
static tp_status sd_value(int i, tp_tensor *param, tp_tensor **out)
{
    return randint(tp_tensor_ndim(param), tp_tensor_shape(param), 100 + (uint64_t)i, out);
}

typedef struct {
    tp_test_slot *s;
    int calls;
    tp_tensor *expect[NET_N];
} sd_check;

static tp_status sd_cb(const char *fqn, tp_tensor *full, void *ctx)
{
    sd_check *k = ctx;
    int i = k->calls++;
    RANK_EXPECT(k->s, i < NET_N - 1 && !strcmp(fqn, net_fqns[i]), "state dict entry %d is %s",
                i, fqn);
    if (i >= NET_N - 1)
        return TP_OK;
    RANK_EXPECT(k->s, !tp_tensor_is_dtensor(full), "%s: the state dict holds plain tensors", fqn);
    bool eq = false;
    TP_TEST_TRY(tp_tensor_equal(full, k->expect[i], &eq));
    RANK_EXPECT(k->s, eq, "%s: gathered value differs from the loaded one", fqn);
    return TP_OK;
}

static tp_status state_dict_body(tp_comm *w, void *arg)
{
    dist_ctx *c = arg;
    tp_test_slot *s = &c->slot[tp_comm_rank(w)];
    tp_mesh *mesh = NULL;
    tp_module *net = NULL;
    RANK_OK(s, tp_mesh_create(w, c->mesh_ndim, c->mesh_shape, NULL, &mesh));
    RANK_OK(s, make_net(&net));
    RANK_OK(s, shard_net(mesh, net));
    plist l = {0};
    RANK_OK(s, tp_module_named_parameters(net, collect, &l));
    sd_check k = {.s = s};
    for (int i = 0; i < l.n; i++)
        RANK_OK(s, sd_value(i, l.t[i], &k.expect[i]));
    RANK_OK(s, tp_module_load_state_dict(net, l.n, net_fqns, k.expect, true));
    /* each rank holds exactly its block of the loaded value */
    for (int i = 0; i < l.n; i++) {
        tp_tensor *p = l.t[i], *v = tp_tensor_retain(k.expect[i]);
        int64_t ls[2], off[2];
        int nd = tp_tensor_ndim(p);
        RANK_OK(s, tp_dtensor_shard_extent(mesh, nd, tp_tensor_shape(p), c->mesh_ndim,
                                           tp_dtensor_placements(p), NULL, ls, off));
        for (int d = 0; d < nd; d++) {
            tp_tensor *n = NULL;
            RANK_OK(s, tp_tensor_narrow(v, d, off[d], ls[d], &n));
            tp_tensor_release(v);
            v = n;
        }
        bool eq = false;
        RANK_OK(s, tp_tensor_equal(tp_dtensor_local(p), v, &eq));
        RANK_EXPECT(s, eq, "%s: local shard is not this rank's block", l.fqn[i]);
        tp_tensor_release(v);
    }
    RANK_OK(s, tp_module_state_dict(net, sd_cb, &k));
    RANK_EXPECT(s, k.calls == NET_N - 1, "state dict called fn %d times", k.calls);

    /* non-strict: a subset and an unknown name; the rest keeps its values */
    tp_tensor *nw = NULL;
    RANK_OK(s, sd_value(50, l.t[0], &nw));
    const char *names[2] = {"net1.weight", "nope"};
    tp_tensor *vals[2] = {nw, nw};
    RANK_OK(s, tp_module_load_state_dict(net, 2, names, vals, false));
    tp_tensor_release(k.expect[0]);
    k.expect[0] = nw;
    k.calls = 0;
    RANK_OK(s, tp_module_state_dict(net, sd_cb, &k));
    for (int i = 0; i < l.n; i++)
        tp_tensor_release(k.expect[i]);
    tp_module_free(net);
    tp_mesh_free(mesh);
    return TP_OK;
}

ParameterizedTestParameters(nn, state_dict_round_trip)
{
    static mesh_case m[] = {{1, {1}}, {1, {2}}, {1, {3}}, {1, {4}}, {1, {8}}, {2, {2, 2}}};
    return cr_make_param_array(mesh_case, m, sizeof m / sizeof m[0]);
}

ParameterizedTest(mesh_case *mc, nn, state_dict_round_trip, .timeout = 60)
{
    dist_ctx c = {.mesh_ndim = mc->ndim};
    int n = 1;
    for (int d = 0; d < mc->ndim; d++)
        n *= (int)(c.mesh_shape[d] = mc->shape[d]);
    tp_test_run(n, state_dict_body, &c, c.slot);
}

static tp_status count_cb(const char *fqn, tp_tensor *full, void *ctx)
{
    (void)fqn, (void)full;
    return ++*(int *)ctx == 2 ? TP_ERR_STATE : TP_OK;
}

Test(nn, load_state_dict_errors, .timeout = 30)
{
    tp_module *root = NULL;
    CHECK_OK(make_mlp(3, 2, 2, &root));
    tp_tensor *w1 = mk(2, (int64_t[]){2, 3}, 1), *b1 = mk(1, (int64_t[]){2}, 2),
              *w2 = mk(2, (int64_t[]){2, 2}, 3), *b2 = mk(1, (int64_t[]){2}, 4);
    tp_tensor *zero = NULL;
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 2, (int64_t[]){2, 3}, &zero));
    tp_tensor *w1p = tp_module_parameter(tp_module_child(root, "net1"), "weight");

    /* strict: unknown names and missing parameters, listed; nothing copied */
    const char *names[3] = {"net1.weight", "net3.weight", "net1.bias"};
    tp_tensor *vals[3] = {w1, w1, b1};
    CHECK_ERR(tp_module_load_state_dict(root, 3, names, vals, true), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "unknown names: net3.weight"), "%s", tp_last_error());
    cr_assert(strstr(tp_last_error(), "missing parameters: net2.weight, net2.bias"), "%s",
              tp_last_error());
    assert_equal(w1p, zero, "a refused load copies nothing");
    /* only missing */
    CHECK_ERR(tp_module_load_state_dict(root, 1, names, vals, true), TP_ERR_INVALID_ARG);
    cr_assert(!strstr(tp_last_error(), "unknown"), "%s", tp_last_error());
    cr_assert(strstr(tp_last_error(), "missing parameters: net1.bias, net2.weight, net2.bias"),
              "%s", tp_last_error());
    /* shape mismatch: an error even when not strict, before any copy */
    const char *all[4] = {"net1.weight", "net1.bias", "net2.weight", "net2.bias"};
    tp_tensor *bad[4] = {w1, b1, w1, b2};
    CHECK_ERR(tp_module_load_state_dict(root, 4, all, bad, false), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "'net2.weight' has shape [2, 3], the parameter has [2, 2]"),
              "%s", tp_last_error());
    assert_equal(w1p, zero, "a refused load copies nothing");
    /* NULLs and DTensor values */
    CHECK_ERR(tp_module_load_state_dict(NULL, 1, names, vals, true), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_module_load_state_dict(root, -1, names, vals, true), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_module_load_state_dict(root, 1, NULL, vals, true), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_module_load_state_dict(root, 1, names, NULL, true), TP_ERR_INVALID_ARG);
    const char *nn[1] = {NULL};
    CHECK_ERR(tp_module_load_state_dict(root, 1, nn, vals, false), TP_ERR_INVALID_ARG);
    tp_tensor *nv[1] = {NULL};
    CHECK_ERR(tp_module_load_state_dict(root, 1, names, nv, false), TP_ERR_INVALID_ARG);
    /* non-strict partial load works; an empty strict load of an empty module too */
    CHECK_OK(tp_module_load_state_dict(root, 2, names, vals, false));
    assert_equal(w1p, w1, "loaded");
    tp_tensor *good[4] = {w1, b1, w2, b2};
    CHECK_OK(tp_module_load_state_dict(root, 4, all, good, true));
    assert_equal(tp_module_parameter(tp_module_child(root, "net2"), "bias"), b2, "loaded");
    tp_module *relu = NULL;
    CHECK_OK(tp_nn_relu_create(&relu));
    CHECK_OK(tp_module_load_state_dict(relu, 0, NULL, NULL, true));
    /* other dtypes convert */
    tp_tensor *w1d = NULL;
    CHECK_OK(tp_tensor_to(w2, TP_F64, TP_CPU, &w1d));
    CHECK_OK(tp_module_load_state_dict(root, 1, &all[2], &w1d, false));
    assert_equal(tp_module_parameter(tp_module_child(root, "net2"), "weight"), w2, "from f64");

    /* state dict: clones of plain parameters; stops at fn's first error */
    int calls = 0;
    CHECK_ERR(tp_module_state_dict(NULL, count_cb, &calls), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_module_state_dict(root, NULL, &calls), TP_ERR_INVALID_ARG);
    cr_assert_eq(tp_module_state_dict(root, count_cb, &calls), TP_ERR_STATE);
    cr_assert_eq(calls, 2);

    tp_tensor *tps[] = {w1, b1, w2, b2, zero, w1d};
    for (size_t i = 0; i < sizeof tps / sizeof tps[0]; i++)
        tp_tensor_release(tps[i]);
    tp_module_free(relu);
    tp_module_free(root);
}

static tp_status partial_param_body(tp_comm *w, void *arg)
{
    rank_ctx *c = arg;
    tp_test_slot *s = &c->slot[tp_comm_rank(w)];
    tp_mesh *mesh = NULL;
    tp_module *lin = NULL;
    RANK_OK(s, tp_mesh_create(w, 1, (int64_t[]){tp_comm_size(w)}, NULL, &mesh));
    RANK_OK(s, tp_nn_linear_create(3, 2, true, &lin));
    tp_tensor *local = NULL, *dt = NULL;
    RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, 1, (int64_t[]){2}, &local));
    tp_placement P = tp_partial(TP_SUM);
    RANK_OK(s, tp_dtensor_from_local(mesh, local, 1, &P, NULL, &dt));
    RANK_OK(s, tp_module_set_parameter(lin, "bias", dt));
    tp_status st = tp_module_init(lin, 1);
    RANK_EXPECT(s, st == TP_ERR_NOT_SUPPORTED && strstr(tp_last_error(), "Partial"),
                "init of a Partial parameter: %s %s", tp_status_name(st), tp_last_error());
    tp_tensor *full = NULL;
    RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, 1, (int64_t[]){2}, &full));
    const char *name = "bias";
    st = tp_module_load_state_dict(lin, 1, &name, &full, false);
    RANK_EXPECT(s, st == TP_ERR_NOT_SUPPORTED, "load into a Partial parameter: %s %s",
                tp_status_name(st), tp_last_error());
    /* a DTensor value is refused */
    st = tp_module_load_state_dict(lin, 1, &name, &dt, false);
    RANK_EXPECT(s, st == TP_ERR_INVALID_ARG && strstr(tp_last_error(), "is a DTensor"),
                "DTensor value: %s %s", tp_status_name(st), tp_last_error());
    tp_tensor_release(full);
    tp_tensor_release(local);
    tp_tensor_release(dt);
    tp_module_free(lin);
    tp_mesh_free(mesh);
    return TP_OK;
}

Test(nn, partial_parameters_are_refused, .timeout = 30)
{
    rank_ctx c = {0};
    tp_test_run(2, partial_param_body, &c, c.slot);
}

/* ---- optimizers ------------------------------------------------------------------ */

/* Linear(3, 2) with W = [[1,2,3],[4,5,6]], b = [1,-1]; loss = sum(linear(x))
 * for x = [[1,0,2],[-1,1,1]]: dW = [[0,1,3],[0,1,3]], db = [2,2]. */
static tp_module *hand_linear(void)
{
    tp_module *lin = NULL;
    CHECK_OK(tp_nn_linear_create(3, 2, true, &lin));
    tp_tensor *w = mk_data(2, (int64_t[]){2, 3}, (float[]){1, 2, 3, 4, 5, 6});
    tp_tensor *b = mk_data(1, (int64_t[]){2}, (float[]){1, -1});
    const char *names[2] = {"weight", "bias"};
    tp_tensor *vals[2] = {w, b};
    CHECK_OK(tp_module_load_state_dict(lin, 2, names, vals, true));
    tp_tensor_release(w);
    tp_tensor_release(b);
    return lin;
}

static void hand_backward(tp_module *lin)
{
    tp_tensor *x = mk_data(2, (int64_t[]){2, 3}, (float[]){1, 0, 2, -1, 1, 1});
    tp_tensor *y = call1(lin, x), *loss = NULL;
    CHECK_OK(tp_sum_all(y, &loss));
    CHECK_OK(tp_backward(loss, NULL));
    tp_tensor_release(x);
    tp_tensor_release(y);
    tp_tensor_release(loss);
}

static const double hand_w[6] = {1, 2, 3, 4, 5, 6}, hand_b[2] = {1, -1};
static const double hand_gw[6] = {0, 1, 3, 0, 1, 3}, hand_gb[2] = {2, 2};

Test(nn, sgd_step_by_hand, .timeout = 30)
{
    tp_module *lin = hand_linear();
    hand_backward(lin);
    tp_tensor *w = tp_module_parameter(lin, "weight"), *b = tp_module_parameter(lin, "bias");
    CHECK_OK(tp_sgd_step(lin, 0.5));
    for (int i = 0; i < 6; i++)
        cr_assert_eq(at(w, i / 3, i % 3), hand_w[i] - 0.5 * hand_gw[i], "w[%d]", i);
    for (int i = 0; i < 2; i++)
        cr_assert_eq(at(b, 0, i), hand_b[i] - 0.5 * hand_gb[i], "b[%d]", i);
    cr_assert(tp_tensor_requires_grad(w) && !tp_tensor_has_grad_fn(w), "still a leaf");
    /* gradients accumulate until zero_grad; parameters without one are skipped */
    tp_module_zero_grad(lin);
    CHECK_OK(tp_sgd_step(lin, 0.5));
    cr_assert_eq(at(w, 0, 2), 3 - 1.5);
    hand_backward(lin);
    hand_backward(lin);
    CHECK_OK(tp_sgd_step(lin, 0.25));
    cr_assert_eq(at(w, 0, 2), 3 - 1.5 - 0.25 * 6);
    cr_assert_eq(at(b, 0, 1), -1 - 1 - 0.25 * 4);
    CHECK_ERR(tp_sgd_step(NULL, 0.1), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_sgd_step(lin, -0.1), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_sgd_step(lin, NAN), TP_ERR_INVALID_ARG);
    tp_module_free(lin);
}

/* Step pre-hooks run before any parameter changes, for the module stepped
 * and its descendants; a failing one stops the step. */
typedef struct step_log {
    int calls;
    double w_seen; /* weight[0][2] when the hook ran */
    tp_status ret;
    int freed;
} step_log;

static tp_status step_hook(tp_module *m, void *ctx)
{
    step_log *l = ctx;
    l->calls++;
    l->w_seen = at(tp_module_parameter(m, "weight"), 0, 2);
    return l->ret;
}

static void step_log_free(void *ctx) { ((step_log *)ctx)->freed++; }

Test(nn, step_pre_hooks, .timeout = 30)
{
    tp_module *lin = hand_linear(), *root = NULL;
    step_log l = {0};
    CHECK_OK(tp_module_add_step_pre_hook(lin, step_hook, &l, step_log_free, NULL));
    CHECK_OK(tp_nn_sequential_create(&root));
    CHECK_OK(tp_module_add_child(root, "lin", lin));
    hand_backward(lin);
    tp_adam *adam = NULL;
    CHECK_OK(tp_adam_create(root, 0.1, 0.9, 0.999, 1e-8, &adam));
    CHECK_OK(tp_sgd_step(root, 0.5)); /* the child's hook runs for its ancestor's step */
    cr_assert_eq(l.calls, 1);
    cr_assert_eq(l.w_seen, 3, "the hook ran after the update (saw %g)", l.w_seen);
    CHECK_OK(tp_adam_step(adam));
    cr_assert_eq(l.calls, 2);
    l.ret = TP_ERR_ABORTED;
    double before = at(tp_module_parameter(lin, "weight"), 0, 2);
    cr_assert_eq(tp_sgd_step(root, 0.5), TP_ERR_ABORTED);
    cr_assert_eq(tp_adam_step(adam), TP_ERR_ABORTED);
    cr_assert_eq(at(tp_module_parameter(lin, "weight"), 0, 2), before,
                 "a failing hook must stop the step before any update");
    CHECK_ERR(tp_module_add_step_pre_hook(NULL, step_hook, &l, NULL, NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_module_add_step_pre_hook(lin, NULL, &l, NULL, NULL), TP_ERR_INVALID_ARG);
    tp_adam_free(adam);
    tp_module_free(root);
    cr_assert_eq(l.freed, 1, "ctx_free ran %d times", l.freed);
}

/* torch.optim.Adam on a constant gradient, in double. */
static double adam_ref(double p, double g, int steps, double lr, double b1, double b2,
                       double eps)
{
    double m = 0, v = 0;
    for (int t = 1; t <= steps; t++) {
        m = b1 * m + (1 - b1) * g;
        v = b2 * v + (1 - b2) * g * g;
        double mh = m / (1 - pow(b1, t)), vh = v / (1 - pow(b2, t));
        p -= lr * mh / (sqrt(vh) + eps);
    }
    return p;
}

Test(nn, adam_steps_by_hand, .timeout = 30)
{
    const double lr = 0.1, b1 = 0.8, b2 = 0.9, eps = 1e-3;
    tp_module *lin = hand_linear();
    tp_adam *opt = (tp_adam *)0x1;
    CHECK_OK(tp_adam_create(lin, lr, b1, b2, eps, &opt));
    tp_tensor *w = tp_module_parameter(lin, "weight"), *b = tp_module_parameter(lin, "bias");
    for (int step = 1; step <= 3; step++) {
        tp_module_zero_grad(lin);
        hand_backward(lin); /* dW and db do not depend on W, b */
        CHECK_OK(tp_adam_step(opt));
        for (int i = 0; i < 6; i++) {
            double want = adam_ref(hand_w[i], hand_gw[i], step, lr, b1, b2, eps);
            cr_assert(fabs(at(w, i / 3, i % 3) - want) <= 1e-6, "step %d w[%d] = %.9g, want %.9g",
                      step, i, at(w, i / 3, i % 3), want);
        }
        for (int i = 0; i < 2; i++) {
            double want = adam_ref(hand_b[i], hand_gb[i], step, lr, b1, b2, eps);
            cr_assert(fabs(at(b, 0, i) - want) <= 1e-6, "step %d b[%d]", step, i);
        }
    }
    tp_adam_free(opt);
    tp_module_free(lin);

    /* zeros mean PyTorch's defaults */
    lin = hand_linear();
    w = tp_module_parameter(lin, "weight");
    CHECK_OK(tp_adam_create(lin, 0, 0, 0, 0, &opt));
    hand_backward(lin);
    CHECK_OK(tp_adam_step(opt));
    for (int i = 0; i < 6; i++) {
        double want = adam_ref(hand_w[i], hand_gw[i], 1, 1e-3, 0.9, 0.999, 1e-8);
        cr_assert(fabs(at(w, i / 3, i % 3) - want) <= 1e-6, "defaults: w[%d]", i);
    }
    tp_adam_free(opt);
    tp_module_free(lin);
}

Test(nn, adam_state_is_per_parameter, .timeout = 30)
{
    /* net2 gets its first gradient at the second step: its bias correction
     * starts there (step 1 of its own) */
    const double lr = 0.05;
    tp_module *root = NULL;
    CHECK_OK(make_mlp(3, 3, 3, &root));
    CHECK_OK(tp_module_init(root, 2));
    tp_module *n1 = tp_module_child(root, "net1"), *n2 = tp_module_child(root, "net2");
    tp_tensor *b2 = tp_module_parameter(n2, "bias"), *b2_0 = NULL;
    CHECK_OK(tp_tensor_clone(b2, &b2_0));
    tp_adam *opt = NULL;
    CHECK_OK(tp_adam_create(root, lr, 0.9, 0.99, 1e-8, &opt));
    tp_tensor *x = mk(2, (int64_t[]){4, 3}, 1), *h = call1(n1, x), *loss = NULL;
    CHECK_OK(tp_sum_all(h, &loss));
    CHECK_OK(tp_backward(loss, NULL));
    CHECK_OK(tp_adam_step(opt));
    assert_equal(b2, b2_0, "net2 has no gradient yet: untouched");
    tp_tensor_release(h);
    tp_tensor_release(loss);
    tp_module_zero_grad(root);
    h = call1(n1, x);
    tp_tensor *y = call1(n2, h);
    CHECK_OK(tp_sum_all(y, &loss));
    CHECK_OK(tp_backward(loss, NULL));
    CHECK_OK(tp_adam_step(opt));
    /* d loss / d b2 = batch size = 4 */
    for (int i = 0; i < 3; i++) {
        double want = adam_ref(at(b2_0, 0, i), 4, 1, lr, 0.9, 0.99, 1e-8);
        cr_assert(fabs(at(b2, 0, i) - want) <= 1e-6, "net2.bias[%d] = %g, want %g", i,
                  at(b2, 0, i), want);
    }
    /* a parameter replaced after its first step is refused */
    tp_tensor *nb = mk(1, (int64_t[]){3}, 9);
    CHECK_OK(tp_module_set_parameter(n2, "bias", nb));
    tp_tensor_release(y);
    tp_tensor_release(loss);
    tp_tensor_release(h);
    h = call1(n1, x);
    y = call1(n2, h);
    CHECK_OK(tp_sum_all(y, &loss));
    CHECK_OK(tp_backward(loss, NULL));
    CHECK_ERR(tp_adam_step(opt), TP_ERR_STATE);
    cr_assert(strstr(tp_last_error(), "'net2.bias' was replaced"), "%s", tp_last_error());

    CHECK_ERR(tp_adam_step(NULL), TP_ERR_INVALID_ARG);
    tp_adam *bad = (tp_adam *)0x1;
    CHECK_ERR(tp_adam_create(NULL, 0, 0, 0, 0, &bad), TP_ERR_INVALID_ARG);
    cr_assert_null(bad);
    CHECK_ERR(tp_adam_create(root, 0, 0, 0, 0, NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_adam_create(root, -1, 0, 0, 0, &bad), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_adam_create(root, 0, 1.0, 0, 0, &bad), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_adam_create(root, 0, 0, -0.5, 0, &bad), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_adam_create(root, 0, 0, 0, -1e-8, &bad), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_adam_create(root, NAN, 0, 0, 0, &bad), TP_ERR_INVALID_ARG);

    tp_tensor *tps[] = {b2_0, x, h, y, loss, nb};
    for (size_t i = 0; i < sizeof tps / sizeof tps[0]; i++)
        tp_tensor_release(tps[i]);
    tp_adam_free(opt);
    tp_module_free(root);
}

/* SGD and Adam on distributed parameters equal the single-rank updates:
 *  - "partial": parameters R, input batch-sharded: the gradients are
 *    Partial(sum) and the step reduces them (2 all_reduces: weight, bias);
 *  - "colwise": W, b S(0), input R: gradients already S(0), no comm;
 *  - "rowwise": W S(1), b R, input S(-1). */
typedef struct {
    int which; /* 0 partial, 1 colwise, 2 rowwise */
    bool adam;
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} opt_ctx;

/* loss = sum(linear(x)); forward and backward. Any thread. */
static tp_status lin_backward(tp_module *lin, tp_tensor *x)
{
    tp_tensor *y = NULL, *loss = NULL;
    TP_TEST_TRY(tp_module_call(lin, x, &y));
    tp_status st = tp_sum_all(y, &loss);
    if (st == TP_OK)
        st = tp_backward(loss, NULL);
    tp_tensor_release(y);
    tp_tensor_release(loss);
    return st;
}

static tp_status opt_step(tp_module *m, tp_adam *opt)
{
    return opt ? tp_adam_step(opt) : tp_sgd_step(m, 0.5);
}

static tp_status opt_body(tp_comm *w, void *arg)
{
    opt_ctx *c = arg;
    tp_test_slot *s = &c->slot[tp_comm_rank(w)];
    int n = tp_comm_size(w);
    tp_mesh *mesh = NULL;
    tp_module *ref = NULL, *dist = NULL;
    RANK_OK(s, tp_mesh_create(w, 1, (int64_t[]){n}, NULL, &mesh));
    RANK_OK(s, tp_nn_linear_create(5, 7, true, &ref));
    RANK_OK(s, tp_nn_linear_create(5, 7, true, &dist));
    tp_tensor *wv = NULL, *bv = NULL, *x = NULL, *xd = NULL;
    RANK_OK(s, randint(2, (int64_t[]){7, 5}, 1, &wv));
    RANK_OK(s, randint(1, (int64_t[]){7}, 2, &bv));
    RANK_OK(s, randint(2, (int64_t[]){6, 5}, 3, &x)); /* batch 6: uneven at 4 and 8 */
    const char *names[2] = {"weight", "bias"};
    tp_tensor *vals[2] = {wv, bv};
    RANK_OK(s, tp_module_load_state_dict(ref, 2, names, vals, true));
    tp_placement pw, pb, px;
    switch (c->which) {
    case 0: pw = tp_replicate(), pb = tp_replicate(), px = tp_shard(0); break;
    case 1: pw = tp_shard(0), pb = tp_shard(0), px = tp_replicate(); break;
    default: pw = tp_shard(1), pb = tp_replicate(), px = tp_shard(-1); break;
    }
    tp_tensor *dw = NULL, *db = NULL;
    RANK_OK(s, tp_dtensor_distribute(mesh, tp_module_parameter(dist, "weight"), 1, &pw, -1, &dw));
    RANK_OK(s, tp_dtensor_distribute(mesh, tp_module_parameter(dist, "bias"), 1, &pb, -1, &db));
    RANK_OK(s, tp_module_set_parameter(dist, "weight", dw));
    RANK_OK(s, tp_module_set_parameter(dist, "bias", db));
    tp_tensor_release(dw);
    tp_tensor_release(db);
    RANK_OK(s, tp_module_load_state_dict(dist, 2, names, vals, true));
    RANK_OK(s, tp_dtensor_distribute(mesh, x, 1, &px, -1, &xd));

    tp_adam *oref = NULL, *odist = NULL;
    if (c->adam) {
        RANK_OK(s, tp_adam_create(ref, 0.1, 0.8, 0.9, 1e-3, &oref));
        RANK_OK(s, tp_adam_create(dist, 0.1, 0.8, 0.9, 1e-3, &odist));
    }
    for (int step = 0; step < 2; step++) {
        tp_module_zero_grad(ref);
        tp_module_zero_grad(dist);
        RANK_OK(s, lin_backward(ref, x));
        RANK_OK(s, opt_step(ref, oref));
        RANK_OK(s, lin_backward(dist, xd));
        tp_tensor *g = tp_tensor_grad(tp_module_parameter(dist, "weight"));
        RANK_EXPECT(s, g && tp_tensor_is_dtensor(g), "the weight has a DTensor gradient");
        if (c->which == 0 && g)
            RANK_EXPECT(s, tp_dtensor_placements(g)[0].kind == TP_PLACEMENT_PARTIAL,
                        "the partial case has a Partial gradient");
        tp_comm_debug *d = NULL;
        RANK_OK(s, tp_comm_debug_create(&d));
        RANK_OK(s, tp_comm_debug_begin(d));
        tp_status st = opt_step(dist, odist);
        RANK_OK(s, tp_comm_debug_end(d));
        RANK_OK(s, st);
        int64_t want = c->which == 0 && n > 1 ? 2 : 0;
        RANK_EXPECT(s, tp_comm_debug_total(d) == want &&
                           tp_comm_debug_count(d, TP_COLL_ALL_REDUCE) == want,
                    "case %d: the step issued %lld collectives, want %lld all_reduces",
                    c->which, (long long)tp_comm_debug_total(d), (long long)want);
        tp_comm_debug_free(d);
        for (int i = 0; i < 2; i++) {
            tp_tensor *p = tp_module_parameter(dist, names[i]), *full = NULL;
            RANK_EXPECT(s, tp_dtensor_placements(p)[0].kind == (i ? pb : pw).kind,
                        "%s keeps its layout", names[i]);
            RANK_OK(s, tp_dtensor_full_tensor(p, &full));
            double diff = 1;
            RANK_OK(s, tp_tensor_max_abs_diff(full, tp_module_parameter(ref, names[i]), &diff));
            RANK_EXPECT(s, diff == 0, "case %d %s step %d: %s differs by %g", c->which,
                        c->adam ? "adam" : "sgd", step, names[i], diff);
            tp_tensor_release(full);
        }
    }
    tp_adam_free(oref);
    tp_adam_free(odist);
    tp_tensor_release(wv);
    tp_tensor_release(bv);
    tp_tensor_release(x);
    tp_tensor_release(xd);
    tp_module_free(ref);
    tp_module_free(dist);
    tp_mesh_free(mesh);
    return TP_OK;
}

TP_TEST_WORLD_SIZE_PARAMS(nn, sgd_partial_gradient)
ParameterizedTest(int *n, nn, sgd_partial_gradient, .timeout = 60)
{
    opt_ctx c = {.which = 0};
    tp_test_run(*n, opt_body, &c, c.slot);
}

TP_TEST_WORLD_SIZE_PARAMS(nn, sgd_sharded_parameters)
ParameterizedTest(int *n, nn, sgd_sharded_parameters, .timeout = 60)
{
    for (int which = 1; which <= 2; which++) {
        opt_ctx c = {.which = which};
        tp_test_run(*n, opt_body, &c, c.slot);
    }
}

TP_TEST_WORLD_SIZE_PARAMS(nn, adam_distributed)
ParameterizedTest(int *n, nn, adam_distributed, .timeout = 60)
{
    for (int which = 0; which <= 2; which++) {
        opt_ctx c = {.which = which, .adam = true};
        tp_test_run(*n, opt_body, &c, c.slot);
    }
}

/* ---- allocation failures --------------------------------------------------------- */

static tp_test_alloc A;

static tp_status noop_pre(tp_module *m, int nargs, tp_tensor **args, int nkw, tp_kwarg *kw,
                          void *ctx)
{
    (void)m, (void)nargs, (void)args, (void)nkw, (void)kw, (void)ctx;
    return TP_OK;
}

static tp_status drop_cb(const char *fqn, tp_tensor *full, void *ctx)
{
    (void)fqn, (void)full, (void)ctx;
    return TP_OK;
}

static hook_log scenario_log;

/* Everything the module layer does on one thread, cleaning up on any
 * failure. */
static tp_status nn_scenario(void)
{
    tp_module *root = NULL, *seq = NULL, *m = NULL;
    tp_tensor *x = NULL, *y = NULL, *loss = NULL, *w = NULL;
    tp_adam *opt = NULL;
    tp_status st = make_mlp(3, 4, 2, &root);
    if (st != TP_OK)
        return st;
    const char *longname = "a_rather_long_child_name_to_force_the_path_buffer_to_grow_0123456789";
#define TRY(e)                                                                  \
    do {                                                                        \
        if ((st = (e)) != TP_OK)                                                \
            goto out;                                                           \
    } while (0)
    TRY(tp_nn_sequential_create(&seq));
    if ((st = tp_module_add_child(root, longname, seq)) != TP_OK) {
        tp_module_free(seq);
        goto out;
    }
    TRY(tp_nn_embedding_create(4, 3, &m));
    if ((st = tp_module_add_child(seq, "0", m)) != TP_OK) {
        tp_module_free(m);
        goto out;
    }
    TRY(tp_nn_custom_create("Custom", custom_fwd, NULL, NULL, &m));
    if ((st = tp_module_add_child(seq, "1", m)) != TP_OK) {
        tp_module_free(m);
        goto out;
    }
    TRY(randint(1, (int64_t[]){2}, 1, &w));
    TRY(tp_module_register_parameter(m, "p", w));
    for (int i = 0; i < 6; i++) {
        TRY(tp_module_add_forward_pre_hook(tp_module_child(root, "net1"), noop_pre, NULL, NULL,
                                           NULL));
        TRY(tp_module_add_forward_hook(tp_module_child(root, "net2"), post_d, &scenario_log,
                                       NULL, NULL));
    }
    TRY(tp_module_init(root, 3));
    TRY(randint(2, (int64_t[]){2, 3}, 2, &x));
    tp_tensor *many[10] = {x, x, x, x, x, x, x, x, x, x};
    tp_kwarg kws[10];
    for (int i = 0; i < 10; i++)
        kws[i] = (tp_kwarg){"k", x};
    TRY(tp_module_forward(tp_module_child(root, "net1"), 1, many, 0, NULL, &y));
    tp_tensor_release(y);
    y = NULL;
    /* more inputs than fit inline: the argument arrays go to the heap */
    st = tp_module_forward(tp_module_child(root, "net1"), 10, many, 10, kws, &y);
    if (st == TP_ERR_INVALID_ARG)
        st = TP_OK; /* Linear takes 1 input: reached the forward */
    TRY(st);
    TRY(tp_module_call(tp_module_child(root, "net1"), x, &y));
    TRY(tp_sum_all(y, &loss));
    TRY(tp_backward(loss, NULL));
    TRY(tp_module_state_dict(root, drop_cb, NULL));
    const char *names[1] = {"net1.bias"};
    tp_tensor *vals[1] = {NULL};
    TRY(randint(1, (int64_t[]){4}, 5, &vals[0]));
    st = tp_module_load_state_dict(root, 1, names, vals, true); /* strict: missing ones */
    tp_tensor_release(vals[0]);
    if (st == TP_ERR_INVALID_ARG)
        st = TP_OK;
    TRY(st);
    TRY(tp_sgd_step(root, 0.1));
    TRY(tp_adam_create(root, 0, 0, 0, 0, &opt));
    TRY(tp_adam_step(opt));
#undef TRY
out:
    tp_adam_free(opt);
    tp_tensor_release(x);
    tp_tensor_release(y);
    tp_tensor_release(loss);
    tp_tensor_release(w);
    tp_module_free(root);
    return st;
}

static void nn_alloc_install(void)
{
    tp_allocator a = {tp_test_alloc_fn, tp_test_free_fn, &A};
    A = (tp_test_alloc){0, 0, -1};
    cr_assert_eq(tp_set_allocator(&a), TP_OK);
}

static void nn_alloc_restore(void) { tp_set_allocator(NULL); }

Test(nn, allocation_failures, .init = nn_alloc_install, .fini = nn_alloc_restore,
     .timeout = 60)
{
    long k = 0;
    for (;; k++) {
        A.count = 0;
        A.fail_at = k;
        tp_clear_error();
        tp_status st = nn_scenario();
        A.fail_at = -1;
        if (st == TP_OK) {
            cr_assert_leq(A.count, k, "succeeded although allocation %ld failed", k);
            break;
        }
        cr_assert_eq(st, TP_ERR_NO_MEMORY, "allocation %ld failing: %s (%s)", k,
                     tp_status_name(st), tp_last_error());
        cr_assert(strstr(tp_last_error(), "out of memory"), "allocation %ld: message %s", k,
                  tp_last_error());
        cr_assert_eq(A.live, 0, "allocation %ld failing leaked %ld (%s)", k, A.live,
                     tp_last_error());
        cr_assert_str_eq(tp_comm_debug_current_scope(), "Global");
    }
    cr_assert_eq(A.live, 0, "the successful run leaked %ld", A.live);
    cr_assert_gt(k, 50, "the scenario allocates (%ld)", k);
}

/* The scenario under an active comm-debug counter, plus a second root of
 * another type (its type name joins the root scope's label). */
static tp_status counted_scenario(void)
{
    tp_comm_debug *d = NULL;
    tp_module *solo = NULL;
    tp_tensor *x = NULL, *y = NULL;
    tp_status st = tp_comm_debug_create(&d);
    if (st != TP_OK)
        return st;
    st = tp_comm_debug_begin(d);
    if (st == TP_OK)
        st = nn_scenario();
    if (st == TP_OK)
        st = tp_nn_linear_create(3, 3, false, &solo);
    if (st == TP_OK)
        st = randint(2, (int64_t[]){2, 3}, 2, &x);
    if (st == TP_OK)
        st = tp_module_call(solo, x, &y);
    if (tp_comm_debug_active() == d)
        (void)tp_comm_debug_end(d);
    char buf[4096];
    if (st == TP_OK && capture_writer(tp_comm_debug_write_table, d, buf, sizeof buf) != TP_OK)
        st = TP_ERR_BACKEND;
    tp_comm_debug_free(d);
    tp_module_free(solo);
    tp_tensor_release(x);
    tp_tensor_release(y);
    return st;
}

/* Every allocation failing in turn, with the counter registering scopes and
 * autograd saving them: out of memory or success (a scope the counter could
 * not register is left out of its lists, not an error), never a leak or a
 * scope left open. */
Test(nn, allocation_failures_counted, .init = nn_alloc_install, .fini = nn_alloc_restore,
     .timeout = 120)
{
    tp_status st = counted_scenario();
    cr_assert_eq(st, TP_OK, "%s (%s)", tp_status_name(st), tp_last_error());
    cr_assert_eq(A.live, 0, "the successful run leaked %ld", A.live);
    const long total = A.count;
    for (long k = 0; k < total; k++) {
        A.count = 0;
        A.fail_at = k;
        tp_clear_error();
        st = counted_scenario();
        A.fail_at = -1;
        cr_assert(st == TP_OK || st == TP_ERR_NO_MEMORY, "allocation %ld failing: %s (%s)", k,
                  tp_status_name(st), tp_last_error());
        cr_assert_eq(A.live, 0, "allocation %ld failing leaked %ld (%s)", k, A.live,
                     tp_last_error());
        cr_assert_str_eq(tp_comm_debug_current_scope(), "Global");
        cr_assert_null(tp_comm_debug_active());
    }
}

/* Evaluation mode makes Dropout the identity, for the whole subtree. */
Test(nn, training_mode, .timeout = 10)
{
    tp_module *seq = NULL, *drop = NULL;
    CHECK_OK(tp_nn_sequential_create(&seq));
    CHECK_OK(tp_nn_dropout_create(0.5, 7, &drop));
    CHECK_OK(tp_module_add_child(seq, "0", drop));
    cr_assert(tp_module_is_training(seq) && tp_module_is_training(drop));
    int64_t n = 64;
    tp_tensor *x = NULL, *y = NULL;
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 1, &n, &x));
    CHECK_OK(tp_tensor_fill(x, 1));
    CHECK_OK(tp_module_call(seq, x, &y));
    bool eq = true;
    CHECK_OK(tp_tensor_equal(x, y, &eq));
    cr_assert(!eq, "dropout in training mode left every element unchanged");
    tp_tensor_release(y);
    tp_module_set_training(seq, false);
    cr_assert(!tp_module_is_training(drop), "evaluation mode did not reach the child");
    CHECK_OK(tp_module_call(seq, x, &y));
    CHECK_OK(tp_tensor_equal(x, y, &eq));
    cr_assert(eq, "dropout in evaluation mode changed the input");
    tp_tensor_release(y);
    tp_tensor_release(x);
    tp_module_free(seq);
    cr_assert(!tp_module_is_training(NULL));
}

/* ---- tied weights ------------------------------------------------------------ */

/* logits = head(emb(idx)), the output Linear's weight being the Embedding's
 * (GPT-style tying). TIE_ONE has no head: the forward applies emb.weight
 * with tp_linear, the same model written with one parameter. TIE_SAME
 * registers the Embedding's tensor as head.weight; TIE_VIEW a second handle
 * over the same storage (tp_tensor_view). */
enum { TV = 6, TD = 4, TN = 5 };
typedef enum { TIE_ONE, TIE_SAME, TIE_VIEW } tie_kind;

static tp_status tied_fwd(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                          const tp_kwarg *kw, tp_tensor **out)
{
    (void)nargs, (void)nkw, (void)kw;
    tp_module *emb = tp_module_child(self, "emb"), *head = tp_module_child(self, "head");
    tp_tensor *h = NULL;
    TP_TEST_TRY(tp_module_call(emb, args[0], &h));
    tp_status st = head ? tp_module_call(head, h, out)
                        : tp_linear(h, tp_module_parameter(emb, "weight"), NULL, out);
    tp_tensor_release(h);
    return st;
}

static tp_module *tied_model(tie_kind kind)
{
    tp_module *m = NULL, *emb = NULL, *head = NULL;
    CHECK_OK(tp_nn_custom_create("Tied", tied_fwd, NULL, NULL, &m));
    CHECK_OK(tp_nn_embedding_create(TV, TD, &emb));
    CHECK_OK(tp_module_add_child(m, "emb", emb));
    if (kind != TIE_ONE) {
        CHECK_OK(tp_nn_linear_create(TD, TV, false, &head));
        CHECK_OK(tp_module_add_child(m, "head", head));
        tp_tensor *w = tp_module_parameter(emb, "weight"), *v = NULL;
        if (kind == TIE_VIEW)
            CHECK_OK(tp_tensor_view(w, 2, (int64_t[]){TV, TD}, &v));
        CHECK_OK(tp_module_set_parameter(head, "weight", v ? v : w));
        tp_tensor_release(v);
    }
    CHECK_OK(tp_module_init(m, 31));
    return m;
}

/* loss = mean(logits * logits) over fixed tokens */
static void tied_backward(tp_module *m, uint64_t seed)
{
    tp_tensor *idx = NULL, *y = NULL, *sq = NULL, *loss = NULL;
    CHECK_OK(tp_tensor_zeros(TP_I64, TP_CPU, 1, (int64_t[]){TN}, &idx));
    CHECK_OK(tp_tensor_fill_random(idx, TP_RNG_RANDINT, 0, TV, seed, NULL, NULL));
    CHECK_OK(tp_module_call(m, idx, &y));
    CHECK_OK(tp_mul(y, y, &sq));
    CHECK_OK(tp_mean_all(sq, &loss));
    CHECK_OK(tp_backward(loss, NULL));
    tp_tensor_release(loss);
    tp_tensor_release(sq);
    tp_tensor_release(y);
    tp_tensor_release(idx);
}

static void assert_close_t(const tp_tensor *a, const tp_tensor *b, const char *what, int step)
{
    bool ok = false;
    double d = -1;
    CHECK_OK(tp_tensor_allclose(a, b, 1e-6, 1e-7, &ok));
    CHECK_OK(tp_tensor_max_abs_diff(a, b, &d));
    cr_assert(ok, "%s, step %d: the tied model's weight differs from the one-parameter "
              "model's by %g", what, step, d);
}

static tp_status count_names(const char *fqn, tp_tensor *full, void *ctx)
{
    (void)full;
    plist *l = ctx;
    return collect(fqn, NULL, l);
}

/* SGD and Adam step a tied weight once per step, with the sum of both uses'
 * gradients: the tied model trains exactly like the one-parameter model,
 * whether the tie is one tensor or two handles over one storage region. */
Test(nn, tied_weights_step_once, .timeout = 60)
{
    for (int kind = TIE_SAME; kind <= TIE_VIEW; kind++) {
        for (int adam = 0; adam <= 1; adam++) {
            const char *what = kind == TIE_SAME ? (adam ? "one tensor, Adam" : "one tensor, SGD")
                                                : (adam ? "one storage region, Adam"
                                                        : "one storage region, SGD");
            tp_module *one = tied_model(TIE_ONE), *tied = tied_model(kind);
            tp_tensor *w1 = tp_module_parameter(tp_module_child(one, "emb"), "weight");
            tp_tensor *wt = tp_module_parameter(tp_module_child(tied, "emb"), "weight");
            tp_tensor *wh = tp_module_parameter(tp_module_child(tied, "head"), "weight");
            cr_assert_eq(wt == wh, kind == TIE_SAME);
            /* initialised once, as the Embedding it first belongs to */
            assert_close_t(wt, w1, what, -1);
            tp_adam *o1 = NULL, *ot = NULL;
            if (adam) {
                CHECK_OK(tp_adam_create(one, 0.05, 0.9, 0.999, 1e-8, &o1));
                CHECK_OK(tp_adam_create(tied, 0.05, 0.9, 0.999, 1e-8, &ot));
            }
            for (int step = 0; step < 3; step++) {
                tied_backward(one, 40 + (uint64_t)step);
                tied_backward(tied, 40 + (uint64_t)step);
                CHECK_OK(adam ? tp_adam_step(o1) : tp_sgd_step(one, 0.1));
                CHECK_OK(adam ? tp_adam_step(ot) : tp_sgd_step(tied, 0.1));
                assert_close_t(wt, w1, what, step);
                assert_close_t(wh, w1, what, step);
                tp_module_zero_grad(one);
                tp_module_zero_grad(tied);
                cr_assert_null(tp_tensor_grad(wt));
                cr_assert_null(tp_tensor_grad(wh));
            }
            tp_adam_free(o1);
            tp_adam_free(ot);
            tp_module_free(one);
            tp_module_free(tied);
        }
    }
}

/* named_parameters lists a tied tensor once, under its first name (PyTorch's
 * default); state dicts list every name, and loading goes through each. Two
 * handles over one storage are two entries of named_parameters (two
 * tensors), as two Parameters sharing storage are in PyTorch. */
/* One step over handles of two tensors in every arrangement: handles over one
 * region (c, h over a's; d over b's) are stepped once with their gradients
 * summed, the same tensor under a second name (e) once, and handles over
 * other regions of the same storage (f starts where a does but is shorter;
 * g starts elsewhere) on their own. */
Test(nn, tied_handles_grouped_by_region, .timeout = 30)
{
    const int64_t six = 6;
    tp_module *m = NULL;
    CHECK_OK(tp_nn_custom_create("Handles", custom_fwd, NULL, NULL, &m));
    tp_tensor *a = mk(1, &six, 1), *b = mk(1, &six, 2), *a0 = NULL, *b0 = NULL;
    CHECK_OK(tp_tensor_clone(a, &a0));
    CHECK_OK(tp_tensor_clone(b, &b0));
    tp_tensor *c = NULL, *d = NULL, *f = NULL, *g = NULL, *h = NULL;
    CHECK_OK(tp_tensor_view(a, 1, &six, &c));
    CHECK_OK(tp_tensor_view(b, 1, &six, &d));
    CHECK_OK(tp_tensor_narrow(a, 0, 0, 3, &f));
    CHECK_OK(tp_tensor_narrow(a, 0, 3, 3, &g));
    CHECK_OK(tp_tensor_view(a, 1, &six, &h));
    const char *names[] = {"f", "a", "b", "c", "e", "d", "g", "h"};
    tp_tensor *handles[] = {f, a, b, c, a, d, g, h};
    tp_tensor *grads[8] = {NULL};
    for (int i = 0; i < 8; i++) {
        CHECK_OK(tp_module_register_parameter(m, names[i], handles[i]));
        if (handles[i] == a && grads[1]) /* e: a's gradient */
            continue;
        grads[i] = mk(1, (int64_t[]){tp_tensor_size(handles[i], 0)}, 10 + (uint64_t)i);
        CHECK_OK(tp_tensor_set_grad(handles[i], grads[i]));
    }
    CHECK_OK(tp_sgd_step(m, 1.0));
    for (int k = 0; k < 6; k++) {
        /* a: a, c, h once; f on [0, 3), g on [3, 6) */
        double ga = at(grads[1], 0, k) + at(grads[3], 0, k) + at(grads[7], 0, k);
        double part = k < 3 ? at(grads[0], 0, k) : at(grads[6], 0, k - 3);
        cr_assert_eq(at(a, 0, k), at(a0, 0, k) - ga - part, "a[%d]", k);
        double gb = at(grads[2], 0, k) + at(grads[5], 0, k);
        cr_assert_eq(at(b, 0, k), at(b0, 0, k) - gb, "b[%d]", k);
    }
    for (int i = 0; i < 8; i++)
        tp_tensor_release(grads[i]);
    tp_tensor *all[] = {a, b, c, d, f, g, h, a0, b0};
    for (int i = 0; i < 9; i++)
        tp_tensor_release(all[i]);
    tp_module_free(m);
}

Test(nn, tied_weights_names, .timeout = 30)
{
    tp_module *tied = tied_model(TIE_SAME), *view = tied_model(TIE_VIEW);
    plist l = {0};
    CHECK_OK(tp_module_named_parameters(tied, collect, &l));
    cr_assert_eq(l.n, 1, "named_parameters listed %d entries", l.n);
    cr_assert_str_eq(l.fqn[0], "emb.weight");
    l = (plist){0};
    CHECK_OK(tp_module_state_dict(tied, count_names, &l));
    cr_assert_eq(l.n, 2, "the state dict listed %d entries", l.n);
    cr_assert_str_eq(l.fqn[0], "emb.weight");
    cr_assert_str_eq(l.fqn[1], "head.weight");
    l = (plist){0};
    CHECK_OK(tp_module_named_parameters(view, collect, &l));
    cr_assert_eq(l.n, 2, "two handles: named_parameters listed %d entries", l.n);

    /* strict loading wants both names; the last value wins */
    tp_tensor *a = mk(2, (int64_t[]){TV, TD}, 3), *b = mk(2, (int64_t[]){TV, TD}, 4);
    const char *names[2] = {"emb.weight", "head.weight"};
    tp_tensor *vals[2] = {a, b};
    CHECK_OK(tp_module_load_state_dict(tied, 2, names, vals, true));
    assert_equal(tp_module_parameter(tp_module_child(tied, "head"), "weight"), b,
                 "head.weight after loading");
    assert_equal(tp_module_parameter(tp_module_child(tied, "emb"), "weight"), b,
                 "emb.weight after loading");
    CHECK_ERR(tp_module_load_state_dict(tied, 1, names, vals, true), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "missing parameters: head.weight"), "%s", tp_last_error());
    tp_tensor_release(a);
    tp_tensor_release(b);
    tp_module_free(tied);
    tp_module_free(view);
}

static tp_status count_param(const char *fqn, tp_tensor *p, void *ctx)
{
    (void)fqn;
    (void)p;
    ++*(int *)ctx;
    return TP_OK;
}

/* SiLU as a module: its forward is tp_silu (forward and gradient), it has no
 * parameters, and it sits in a Sequential between two Linears as the MLP of
 * a Llama-family model without the gate would. */
Test(nn, silu_module, .timeout = 30)
{
    tp_module *silu = NULL, *seq = NULL, *a = NULL, *b = NULL;
    CHECK_OK(tp_nn_silu_create(&silu));
    cr_assert_str_eq(tp_module_type_name(silu), "SiLU");
    cr_assert_eq(tp_module_kind_of(silu), TP_MODULE_SILU);
    int np = 0;
    CHECK_OK(tp_module_named_parameters(silu, count_param, &np));
    cr_assert_eq(np, 0, "SiLU has %d parameters", np);
    tp_tensor *x = mk(3, (int64_t[]){2, 3, 4}, 5), *x2 = NULL, *y = NULL, *r = NULL;
    CHECK_OK(tp_tensor_clone(x, &x2));
    CHECK_OK(tp_tensor_set_requires_grad(x, true));
    CHECK_OK(tp_tensor_set_requires_grad(x2, true));
    y = call1(silu, x);
    CHECK_OK(tp_silu(x2, &r));
    assert_equal(y, r, "SiLU");
    tp_tensor *g = mk(3, (int64_t[]){2, 3, 4}, 6);
    CHECK_OK(tp_backward(y, g));
    CHECK_OK(tp_backward(r, g));
    assert_equal(tp_tensor_grad(x), tp_tensor_grad(x2), "SiLU gradient");
    tp_tensor_release(y);
    tp_tensor_release(r);
    /* one input, no keywords */
    tp_tensor *two[2] = {x, x}, *o = (tp_tensor *)0x1;
    CHECK_ERR(tp_module_forward(silu, 2, two, 0, NULL, &o), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "SiLU takes 1 input, got 2"), "%s", tp_last_error());
    cr_assert_null(o);
    CHECK_ERR(tp_nn_silu_create(NULL), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "tp_nn_silu_create: out is NULL"), "%s", tp_last_error());

    /* Linear(4, 6) -> SiLU -> Linear(6, 2) */
    CHECK_OK(tp_nn_sequential_create(&seq));
    CHECK_OK(tp_nn_linear_create(4, 6, true, &a));
    CHECK_OK(tp_nn_linear_create(6, 2, true, &b));
    CHECK_OK(tp_module_add_child(seq, "0", a));
    CHECK_OK(tp_module_add_child(seq, "1", silu));
    CHECK_OK(tp_module_add_child(seq, "2", b));
    CHECK_OK(tp_module_init(seq, 9));
    cr_assert_eq(tp_module_find(seq, "1"), silu);
    y = call1(seq, x2);
    tp_tensor *h = NULL, *hs = NULL;
    CHECK_OK(tp_linear(x2, tp_module_parameter(a, "weight"), tp_module_parameter(a, "bias"), &h));
    CHECK_OK(tp_silu(h, &hs));
    CHECK_OK(tp_linear(hs, tp_module_parameter(b, "weight"), tp_module_parameter(b, "bias"), &r));
    assert_equal(y, r, "Sequential with SiLU");
    tp_tensor *tps[] = {x, x2, y, r, g, h, hs};
    for (size_t i = 0; i < sizeof tps / sizeof tps[0]; i++)
        tp_tensor_release(tps[i]);
    tp_module_free(seq);
}
