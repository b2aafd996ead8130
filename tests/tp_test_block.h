/*
 * tp_test_block.h - the small transformer-style block that test_sim and
 * test_meta_memory run on meta, sim and real worlds: [LayerNorm "norm" ->]
 * Linear "w1" (d -> f) -> tanh GELU -> Linear "w2" (f -> d) [+ the input],
 * and its TP plan (w1 colwise, w2 rowwise; with sp, sequence parallel on dim
 * 0 between them and the norm sequence parallel).
 */
#ifndef TP_TEST_BLOCK_H
#define TP_TEST_BLOCK_H

#include "tp_test.h"

/* The forward: with a child "norm" the block with its residual, else the
 * bare MLP. */
static inline tp_status tp_test_block_forward(tp_module *self, int nargs, tp_tensor *const *args,
                                              int nkw, const tp_kwarg *kw, tp_tensor **out)
{
    (void)nargs;
    (void)nkw;
    (void)kw;
    tp_tensor *h = NULL, *a = NULL, *g = NULL, *y = NULL;
    bool block = tp_module_child(self, "norm") != NULL;
    tp_status st = block ? tp_module_call(tp_module_child(self, "norm"), args[0], &h) : TP_OK;
    if (st == TP_OK)
        st = tp_module_call(tp_module_child(self, "w1"), block ? h : args[0], &a);
    if (st == TP_OK)
        st = tp_gelu(a, TP_GELU_TANH, &g);
    if (st == TP_OK)
        st = tp_module_call(tp_module_child(self, "w2"), g, block ? &y : out);
    if (st == TP_OK && block)
        st = tp_add(args[0], y, out);
    tp_tensor_release(h);
    tp_tensor_release(a);
    tp_tensor_release(g);
    tp_tensor_release(y);
    return st;
}

/* Adds c (made by the call that returned `made`) as m's child `name`. */
static inline tp_status tp_test_block_add_child(tp_module *m, const char *name, tp_status made,
                                                tp_module **c)
{
    if (made != TP_OK)
        return made;
    tp_status st = tp_module_add_child(m, name, *c);
    if (st != TP_OK)
        tp_module_free(*c);
    return st;
}

/* The block ("Block", with the norm) or the MLP ("MLP") of width d and
 * hidden f on `dev` (the thread's default device while it is built),
 * initialized with seed 11. */
static inline tp_status tp_test_block_make(int64_t d, int64_t f, bool norm, tp_device dev,
                                           tp_module **out)
{
    tp_device prev = tp_nn_default_device();
    TP_TEST_TRY(tp_nn_set_default_device(dev));
    tp_module *m = NULL, *n = NULL, *w1 = NULL, *w2 = NULL;
    tp_status st =
        tp_nn_custom_create(norm ? "Block" : "MLP", tp_test_block_forward, NULL, NULL, &m);
    if (st == TP_OK && norm)
        st = tp_test_block_add_child(m, "norm", tp_nn_layer_norm_create(d, true, 1e-5, &n), &n);
    if (st == TP_OK)
        st = tp_test_block_add_child(m, "w1", tp_nn_linear_create(d, f, true, &w1), &w1);
    if (st == TP_OK)
        st = tp_test_block_add_child(m, "w2", tp_nn_linear_create(f, d, true, &w2), &w2);
    if (st == TP_OK)
        st = tp_module_init(m, 11);
    tp_nn_set_default_device(prev);
    if (st != TP_OK) {
        tp_module_free(m);
        return st;
    }
    *out = m;
    return TP_OK;
}

/* The TP plan on mesh (1-D): w1 colwise, w2 rowwise; with sp, their
 * inputs and outputs Shard(0) and the norm sequence parallel. */
static inline tp_status tp_test_block_parallelize(tp_module *m, tp_mesh *mesh, bool sp)
{
    tp_style *s[3] = {NULL, NULL, NULL};
    tp_colwise_options co = {0};
    tp_rowwise_options ro = {0};
    tp_sequence_parallel_options so = {.sequence_dim = 0, .sequence_dim_set = true};
    if (sp) {
        co.input_layouts = tp_layout_of(tp_shard(0));
        ro.output_layouts = tp_layout_of(tp_shard(0));
    }
    tp_status st = tp_colwise_parallel_create(&co, &s[0]);
    if (st == TP_OK)
        st = tp_rowwise_parallel_create(&ro, &s[1]);
    if (st == TP_OK && sp)
        st = tp_sequence_parallel_create(&so, &s[2]);
    if (st == TP_OK) {
        tp_plan_entry plan[3] = {{"w1", s[0]}, {"w2", s[1]}, {"norm", s[2]}};
        st = tp_parallelize_module(m, mesh, sp ? 3 : 2, plan, NULL);
    }
    for (int i = 0; i < 3; i++)
        tp_style_free(s[i]);
    return st;
}

#endif /* TP_TEST_BLOCK_H */
