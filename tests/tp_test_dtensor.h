/*
 * tp_test_dtensor.h - building DTensor test inputs whose values every rank can
 * compute: integer-valued global tensors from (seed, index), distributed with
 * any placements, Partial ones split into integer terms.
 */
#ifndef TP_TEST_DTENSOR_H
#define TP_TEST_DTENSOR_H

#include "tp_test.h"

/* A global integer-valued f32 tensor (RANDINT in [-4, 5) of seed). */
static inline tp_status tp_test_global_tensor(int nd, const int64_t *shape, uint64_t seed,
                                              tp_tensor **t)
{
    TP_TEST_TRY(tp_tensor_zeros(TP_F32, TP_CPU, nd, shape, t));
    return tp_tensor_fill_random(*t, TP_RNG_RANDINT, -4, 5, seed, NULL, NULL);
}

/*
 * The DTensor holding `full` with placements pl (mesh ndim entries). At most
 * one mesh dim may be Partial: the value is then split into integer terms,
 * Partial(sum): coordinate 0 holds x - (W-1) n and the others n (n another
 * random integer tensor), Partial(max): coordinate 0 holds x and the others
 * x - 1 - coordinate. The result is a leaf.
 */
static inline tp_status tp_test_make_dtensor(tp_mesh *mesh, tp_tensor *full, const tp_placement *pl,
                                             uint64_t seed, tp_tensor **out)
{
    int m = tp_mesh_ndim(mesh), pd = -1;
    tp_placement pr[TP_MESH_MAX_DIMS];
    for (int d = 0; d < m; d++) {
        pr[d] = pl[d];
        if (pl[d].kind == TP_PLACEMENT_PARTIAL) {
            pd = d;
            pr[d] = tp_replicate();
        }
    }
    if (pd < 0)
        return tp_dtensor_distribute(mesh, full, m, pl, -1, out);
    tp_tensor *dx = NULL, *noise = NULL, *dn = NULL, *local = NULL;
    int nd = tp_tensor_ndim(full);
    TP_TEST_TRY(tp_dtensor_distribute(mesh, full, m, pr, -1, &dx));
    TP_TEST_TRY(tp_test_global_tensor(nd, tp_tensor_shape(full), seed, &noise));
    TP_TEST_TRY(tp_dtensor_distribute(mesh, noise, m, pr, -1, &dn));
    TP_TEST_TRY(tp_tensor_clone(tp_dtensor_local(dx), &local));
    float *v = tp_tensor_data(local);
    const float *nv = tp_tensor_data(tp_dtensor_local(dn));
    int64_t n = tp_tensor_numel(local), coord = tp_mesh_coord(mesh, pd), w = tp_mesh_size(mesh, pd);
    for (int64_t i = 0; i < n; i++) {
        if (pl[pd].op == TP_MAX)
            v[i] = coord == 0 ? v[i] : v[i] - 1.0f - (float)coord;
        else
            v[i] = coord == 0 ? v[i] - (float)(w - 1) * nv[i] : nv[i];
    }
    tp_from_local_options opt = {.global_shape = tp_tensor_shape(full)};
    tp_status st = tp_dtensor_from_local(mesh, local, m, pl, &opt, out);
    tp_tensor_release(local);
    tp_tensor_release(dn);
    tp_tensor_release(noise);
    tp_tensor_release(dx);
    return st;
}

static inline bool tp_test_placement_eq(tp_placement a, tp_placement b)
{
    if (a.kind != b.kind)
        return false;
    if (a.kind == TP_PLACEMENT_SHARD)
        return a.dim == b.dim;
    if (a.kind == TP_PLACEMENT_PARTIAL)
        return a.op == b.op;
    return true;
}

#endif /* TP_TEST_DTENSOR_H */
