/* Local tensors: creation, lifetime, views, copies and conversions, fill,
 * element access and comparison. */
#include <float.h>
#include <math.h>
#include <stdint.h>

#include "tp_test.h"

static const tp_dtype all_dtypes[] = {TP_F32, TP_F64, TP_F16, TP_BF16, TP_I32, TP_I64};
#define N_DTYPES 6



/* Multi-index of row-major linear index i. */
static void unravel(int ndim, const int64_t *shape, int64_t i, int64_t *idx)
{
    for (int d = ndim - 1; d >= 0; d--) {
        idx[d] = shape[d] ? i % shape[d] : 0;
        i = shape[d] ? i / shape[d] : 0;
    }
}

/* Element i (row-major) of t = base + i. */
static void fill_seq(tp_tensor *t, double base)
{
    int64_t n = tp_tensor_numel(t), idx[TP_MAX_DIMS];
    for (int64_t i = 0; i < n; i++) {
        unravel(tp_tensor_ndim(t), tp_tensor_shape(t), i, idx);
        CHECK_OK(tp_tensor_set(t, idx, base + (double)i));
    }
}

static void expect_seq(const tp_tensor *t, double base)
{
    int64_t n = tp_tensor_numel(t), idx[TP_MAX_DIMS];
    for (int64_t i = 0; i < n; i++) {
        double v;
        unravel(tp_tensor_ndim(t), tp_tensor_shape(t), i, idx);
        CHECK_OK(tp_tensor_get(t, idx, &v));
        cr_assert_eq(v, base + (double)i, "element %lld: %g != %g", (long long)i, v,
                     base + (double)i);
    }
}

static double get1(const tp_tensor *t, int64_t i0)
{
    double v;
    CHECK_OK(tp_tensor_get(t, &i0, &v));
    return v;
}

static double get2(const tp_tensor *t, int64_t i0, int64_t i1)
{
    int64_t idx[2] = {i0, i1};
    double v;
    CHECK_OK(tp_tensor_get(t, idx, &v));
    return v;
}

/* ---- dtypes and creation ------------------------------------------------- */

Test(tensor, dtype_properties, .timeout = 30)
{
    const size_t sizes[] = {4, 8, 2, 2, 4, 8};
    const char *names[] = {"f32", "f64", "f16", "bf16", "i32", "i64"};
    const bool is_float[] = {true, true, true, true, false, false};
    for (int i = 0; i < N_DTYPES; i++) {
        cr_assert_eq(tp_dtype_size(all_dtypes[i]), sizes[i]);
        cr_assert_str_eq(tp_dtype_name(all_dtypes[i]), names[i]);
        cr_assert_eq(tp_dtype_is_float(all_dtypes[i]), is_float[i]);
    }
    cr_assert_eq(tp_dtype_size(TP_DTYPE_COUNT), 0);
    cr_assert_eq(tp_dtype_size((tp_dtype)-1), 0);
    cr_assert_str_eq(tp_dtype_name((tp_dtype)77), "invalid");
    cr_assert(!tp_dtype_is_float((tp_dtype)77));
}

Test(tensor, create_every_dtype_and_ndim, .timeout = 30)
{
    for (int k = 0; k < N_DTYPES; k++) {
        tp_dtype dt = all_dtypes[k];
        for (int nd = 0; nd <= TP_MAX_DIMS; nd++) {
            int64_t shape[TP_MAX_DIMS];
            int64_t numel = 1;
            for (int d = 0; d < nd; d++) {
                shape[d] = 1 + (d % 3);
                numel *= shape[d];
            }
            tp_tensor *e = NULL, *z = NULL;
            CHECK_OK(tp_tensor_empty(dt, TP_CPU, nd, shape, &e));
            CHECK_OK(tp_tensor_zeros(dt, TP_CPU, nd, shape, &z));
            cr_assert_eq(tp_tensor_ndim(e), nd);
            cr_assert_eq(tp_tensor_dtype(e), dt);
            cr_assert_eq(tp_tensor_numel(e), numel);
            cr_assert_eq(tp_tensor_nbytes(e), (size_t)numel * tp_dtype_size(dt));
            cr_assert(tp_tensor_is_contiguous(e));
            cr_assert_eq(tp_tensor_device(e).type, TP_DEVICE_CPU);
            cr_assert_eq((uintptr_t)tp_tensor_data(e) % 64, 0, "storage is 64-byte aligned");
            int64_t expect_stride = 1;
            for (int d = nd - 1; d >= 0; d--) {
                cr_assert_eq(tp_tensor_shape(e)[d], shape[d]);
                cr_assert_eq(tp_tensor_size(e, d), shape[d]);
                cr_assert_eq(tp_tensor_size(e, d - nd), shape[d], "negative dim");
                cr_assert_eq(tp_tensor_strides(e)[d], expect_stride);
                expect_stride *= shape[d];
            }
            cr_assert_eq(tp_tensor_size(e, nd), -1);
            cr_assert_eq(tp_tensor_size(e, -nd - 1), -1);
            cr_assert(!tp_tensor_shares_storage(e, z));
            const unsigned char *zb = tp_tensor_data(z);
            for (size_t b = 0; b < tp_tensor_nbytes(z); b++)
                cr_assert_eq(zb[b], 0, "zeros: byte %zu", b);
            tp_tensor_release(e);
            tp_tensor_release(z);
        }
    }
}

Test(tensor, empty_sizes, .timeout = 30)
{
    int64_t shape[3] = {3, 0, 4};
    tp_tensor *t = NULL, *u = NULL;
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 3, shape, &t));
    cr_assert_eq(tp_tensor_numel(t), 0);
    cr_assert_eq(tp_tensor_nbytes(t), 0);
    cr_assert_not_null(tp_tensor_data(t));
    CHECK_OK(tp_tensor_fill(t, 1.0));
    CHECK_OK(tp_tensor_empty(TP_F16, TP_CPU, 3, shape, &u));
    CHECK_OK(tp_tensor_copy(u, t));
    bool eq = false;
    CHECK_OK(tp_tensor_equal(t, u, &eq));
    cr_assert(eq);
    tp_tensor_release(u);
    CHECK_OK(tp_tensor_from_data(TP_I64, 3, shape, NULL, &u)); /* no data needed for 0 elements */
    cr_assert_eq(tp_tensor_numel(u), 0);
    tp_tensor_release(u);
    tp_tensor_release(t);
}

Test(tensor, invalid_creation, .timeout = 30)
{
    int64_t shape[TP_MAX_DIMS + 1] = {2, 2, 2, 2, 2, 2, 2, 2, 2};
    tp_tensor *t = (tp_tensor *)0x1;

    CHECK_ERR(tp_tensor_empty(TP_F32, TP_CPU, 2, shape, NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_zeros(TP_F32, TP_CPU, 2, shape, NULL), TP_ERR_INVALID_ARG);

    CHECK_ERR(tp_tensor_empty(TP_F32, TP_CPU, TP_MAX_DIMS + 1, shape, &t), TP_ERR_INVALID_ARG);
    cr_assert_null(t, "out is NULL after a failure");
    cr_assert(strstr(tp_last_error(), "ndim 9"), "%s", tp_last_error());
    CHECK_ERR(tp_tensor_empty(TP_F32, TP_CPU, -1, shape, &t), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_empty(TP_F32, TP_CPU, 2, NULL, &t), TP_ERR_INVALID_ARG);

    int64_t neg[2] = {3, -2};
    CHECK_ERR(tp_tensor_empty(TP_F32, TP_CPU, 2, neg, &t), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "-2") && strstr(tp_last_error(), "dim 1"), "%s",
              tp_last_error());
    CHECK_ERR(tp_tensor_zeros(TP_F32, TP_CPU, 2, neg, &t), TP_ERR_INVALID_ARG);

    CHECK_ERR(tp_tensor_empty(TP_DTYPE_COUNT, TP_CPU, 1, shape, &t), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_empty((tp_dtype)-3, TP_CPU, 1, shape, &t), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "dtype"), "%s", tp_last_error());

    int64_t huge[3] = {INT64_MAX / 2, 4, 4};
    CHECK_ERR(tp_tensor_empty(TP_F32, TP_CPU, 3, huge, &t), TP_ERR_INVALID_ARG);
    int64_t big[1] = {INT64_MAX / 2};
    CHECK_ERR(tp_tensor_empty(TP_F64, TP_CPU, 1, big, &t), TP_ERR_INVALID_ARG);

    /* devices */
    CHECK_ERR(tp_tensor_empty(TP_F32, ((tp_device){TP_DEVICE_CPU, 1}), 1, shape, &t),
               TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_empty(TP_F32, ((tp_device){(tp_device_type)7, 0}), 1, shape, &t),
               TP_ERR_INVALID_ARG);
    if (tp_cuda_device_count() == 0) {
        /* no GPU (or a CPU-only build): a clean NOT_SUPPORTED, never a crash */
        CHECK_ERR(tp_tensor_empty(TP_F32, TP_CUDA(0), 1, shape, &t), TP_ERR_NOT_SUPPORTED);
        cr_assert(strstr(tp_last_error(), "CUDA"), "%s", tp_last_error());
        CHECK_ERR(tp_tensor_zeros(TP_F32, TP_CUDA(0), 1, shape, &t), TP_ERR_NOT_SUPPORTED);
        float x = 0;
        CHECK_ERR(tp_tensor_from_blob(TP_F32, TP_CUDA(0), 0, NULL, &x, NULL, NULL, &t),
                   TP_ERR_NOT_SUPPORTED);
    }
    cr_assert_null(t);

    /* from_data / from_blob */
    CHECK_ERR(tp_tensor_from_data(TP_F32, 1, shape, NULL, &t), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_from_data(TP_F32, 1, shape, shape, NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_from_blob(TP_F32, TP_CPU, 1, shape, NULL, NULL, NULL, &t),
               TP_ERR_INVALID_ARG);
    float buf[4];
    CHECK_ERR(tp_tensor_from_blob(TP_F32, TP_CPU, 1, shape, (char *)buf + 1, NULL, NULL, &t),
               TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_from_blob(TP_F32, TP_CPU, 1, shape, buf, NULL, NULL, NULL),
               TP_ERR_INVALID_ARG);
    cr_assert_null(t);
}

Test(tensor, null_accessors, .timeout = 30)
{
    cr_assert_eq(tp_tensor_ndim(NULL), -1);
    cr_assert_null(tp_tensor_shape(NULL));
    cr_assert_null(tp_tensor_strides(NULL));
    cr_assert_eq(tp_tensor_size(NULL, 0), -1);
    cr_assert_eq(tp_tensor_numel(NULL), 0);
    cr_assert_eq(tp_tensor_nbytes(NULL), 0);
    cr_assert_null(tp_tensor_data(NULL));
    cr_assert(!tp_tensor_is_contiguous(NULL));
    cr_assert(!tp_tensor_shares_storage(NULL, NULL));
    cr_assert_eq(tp_tensor_dtype(NULL), TP_DTYPE_COUNT);
    cr_assert_eq(tp_tensor_device(NULL).index, -1);
    cr_assert_null(tp_tensor_retain(NULL));
    tp_tensor_release(NULL);

    tp_tensor *out = (tp_tensor *)0x1;
    bool b = true;
    double v = 1;
    CHECK_ERR(tp_tensor_narrow(NULL, 0, 0, 0, &out), TP_ERR_INVALID_ARG);
    cr_assert_null(out);
    CHECK_ERR(tp_tensor_chunk(NULL, 2, 0, 0, &out), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_select(NULL, 0, 0, &out), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_view(NULL, 0, NULL, &out), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_copy(NULL, NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_to(NULL, TP_F32, TP_CPU, &out), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_clone(NULL, &out), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_fill(NULL, 1.0), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_get(NULL, NULL, &v), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_set(NULL, NULL, 1.0), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_equal(NULL, NULL, &b), TP_ERR_INVALID_ARG);
    cr_assert(!b);
    CHECK_ERR(tp_tensor_allclose(NULL, NULL, 0, 0, &b), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_max_abs_diff(NULL, NULL, &v), TP_ERR_INVALID_ARG);

    int64_t n = 3;
    tp_tensor *t = NULL;
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 1, &n, &t));
    CHECK_ERR(tp_tensor_narrow(t, 0, 0, 1, NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_chunk(t, 2, 0, 0, NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_select(t, 0, 0, NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_view(t, 1, &n, NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_to(t, TP_F32, TP_CPU, NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_clone(t, NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_copy(t, NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_copy(NULL, t), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_get(t, &n, NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_equal(t, t, NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_allclose(t, t, 0, 0, NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_max_abs_diff(t, t, NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_equal(t, NULL, &b), TP_ERR_INVALID_ARG);
    tp_tensor_release(t);
}

/* ---- lifetime --------------------------------------------------------------- */

static void count_deleter(void *data, void *ctx)
{
    (void)data;
    ++*(int *)ctx;
}

Test(tensor, retain_release, .timeout = 30)
{
    float data[6] = {0};
    int deleted = 0;
    int64_t shape[2] = {2, 3};
    tp_tensor *t = NULL, *v = NULL;
    CHECK_OK(tp_tensor_from_blob(TP_F32, TP_CPU, 2, shape, data, count_deleter, &deleted, &t));
    cr_assert_eq(tp_tensor_data(t), (void *)data, "no copy");
    cr_assert_eq(tp_tensor_retain(t), t);
    tp_tensor_release(t);
    cr_assert_eq(deleted, 0);
    CHECK_OK(tp_tensor_narrow(t, 1, 1, 2, &v));
    tp_tensor_release(t); /* the view keeps the storage alive */
    cr_assert_eq(deleted, 0);
    CHECK_OK(tp_tensor_fill(v, 7.0));
    cr_assert_eq(data[1], 7.0f);
    cr_assert_eq(data[0], 0.0f);
    tp_tensor_release(v);
    cr_assert_eq(deleted, 1, "deleter runs exactly once at the last release");
}

Test(tensor, from_blob_without_deleter, .timeout = 30)
{
    int32_t data[4] = {1, 2, 3, 4};
    int64_t n = 4;
    tp_tensor *t = NULL;
    CHECK_OK(tp_tensor_from_blob(TP_I32, TP_CPU, 1, &n, data, NULL, NULL, &t));
    cr_assert_eq(get1(t, 2), 3.0);
    data[2] = 30;
    cr_assert_eq(get1(t, 2), 30.0, "blob is shared, not copied");
    tp_tensor_release(t);
    cr_assert_eq(data[3], 4, "memory is still the caller's");
}

Test(tensor, from_data_copies, .timeout = 30)
{
    double data[6] = {1, 2, 3, 4, 5, 6};
    int64_t shape[2] = {3, 2};
    tp_tensor *t = NULL;
    CHECK_OK(tp_tensor_from_data(TP_F64, 2, shape, data, &t));
    data[0] = 100;
    cr_assert_eq(get2(t, 0, 0), 1.0);
    cr_assert_eq(get2(t, 2, 1), 6.0);
    tp_tensor_release(t);
}

/* ---- views ------------------------------------------------------------------ */

Test(tensor, narrow, .timeout = 30)
{
    int64_t shape[2] = {4, 5};
    tp_tensor *t = NULL, *v = NULL, *w = NULL;
    CHECK_OK(tp_tensor_empty(TP_F32, TP_CPU, 2, shape, &t));
    fill_seq(t, 0);
    CHECK_OK(tp_tensor_narrow(t, 1, 1, 3, &v));
    cr_assert(tp_tensor_shares_storage(t, v));
    cr_assert_eq(tp_tensor_size(v, 0), 4);
    cr_assert_eq(tp_tensor_size(v, 1), 3);
    cr_assert(!tp_tensor_is_contiguous(v));
    cr_assert_eq(tp_tensor_strides(v)[0], 5);
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 3; j++)
            cr_assert_eq(get2(v, i, j), i * 5 + j + 1);
    int64_t idx[2] = {2, 0};
    CHECK_OK(tp_tensor_set(v, idx, -1.0));
    cr_assert_eq(get2(t, 2, 1), -1.0, "write through the view is seen by the base");
    CHECK_OK(tp_tensor_set(t, (int64_t[]){3, 3}, -2.0));
    cr_assert_eq(get2(v, 3, 2), -2.0, "and the other way");

    /* negative dim, nested, dim 0 keeps contiguity */
    CHECK_OK(tp_tensor_narrow(t, -2, 1, 2, &w));
    cr_assert(tp_tensor_is_contiguous(w));
    cr_assert_eq(get2(w, 0, 0), 5.0);
    tp_tensor_release(w);
    CHECK_OK(tp_tensor_narrow(v, 0, 4, 0, &w));
    cr_assert_eq(tp_tensor_numel(w), 0);
    tp_tensor_release(w);

    tp_tensor *bad = (tp_tensor *)0x1;
    CHECK_ERR(tp_tensor_narrow(t, 1, 3, 4, &bad), TP_ERR_INVALID_ARG);
    cr_assert_null(bad);
    cr_assert_str_eq(tp_last_error(),
                     "tp_tensor_narrow: start 3 + length 4 exceeds size 5 of dim 1");
    CHECK_ERR(tp_tensor_narrow(t, 2, 0, 1, &bad), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_narrow(t, -3, 0, 1, &bad), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_narrow(t, 0, -1, 1, &bad), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_narrow(t, 0, 0, -1, &bad), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_narrow(t, 0, 5, 0, &bad), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_narrow(t, 0, 1, INT64_MAX, &bad), TP_ERR_INVALID_ARG);
    tp_tensor_release(v);
    tp_tensor_release(t);
}

static void check_chunks(int64_t n, int64_t chunks, const int64_t *starts, const int64_t *lens)
{
    int64_t shape[2] = {3, n};
    tp_tensor *t = NULL;
    CHECK_OK(tp_tensor_empty(TP_I32, TP_CPU, 2, shape, &t));
    fill_seq(t, 0);
    for (int64_t i = 0; i < chunks; i++) {
        int64_t s = -1, l = -1;
        tp_chunk_range(n, chunks, i, &s, &l);
        cr_assert_eq(s, starts[i], "n=%lld chunks=%lld chunk %lld start %lld", (long long)n,
                     (long long)chunks, (long long)i, (long long)s);
        cr_assert_eq(l, lens[i], "n=%lld chunks=%lld chunk %lld length %lld", (long long)n,
                     (long long)chunks, (long long)i, (long long)l);
        tp_tensor *c = NULL;
        CHECK_OK(tp_tensor_chunk(t, chunks, -1, i, &c));
        cr_assert(tp_tensor_shares_storage(t, c));
        cr_assert_eq(tp_tensor_size(c, 0), 3);
        cr_assert_eq(tp_tensor_size(c, 1), lens[i]);
        for (int64_t r = 0; r < 3; r++)
            for (int64_t j = 0; j < lens[i]; j++)
                cr_assert_eq(get2(c, r, j), (double)(r * n + starts[i] + j));
        tp_tensor_release(c);
    }
    tp_tensor_release(t);
}

Test(tensor, chunk, .timeout = 30)
{
    check_chunks(5, 4, (int64_t[]){0, 2, 4, 5}, (int64_t[]){2, 2, 1, 0});
    check_chunks(2, 4, (int64_t[]){0, 1, 2, 2}, (int64_t[]){1, 1, 0, 0});
    check_chunks(7, 3, (int64_t[]){0, 3, 6}, (int64_t[]){3, 3, 1});
    check_chunks(8, 4, (int64_t[]){0, 2, 4, 6}, (int64_t[]){2, 2, 2, 2});
    check_chunks(6, 1, (int64_t[]){0}, (int64_t[]){6});
    check_chunks(0, 3, (int64_t[]){0, 0, 0}, (int64_t[]){0, 0, 0});
    /* torch.chunk(arange(7), 8): c = 1, chunk 7 is empty */
    check_chunks(7, 8, (int64_t[]){0, 1, 2, 3, 4, 5, 6, 7}, (int64_t[]){1, 1, 1, 1, 1, 1, 1, 0});

    int64_t s = -1, l = -1;
    tp_chunk_range(10, 0, 0, &s, &l);
    cr_assert(s == 0 && l == 0, "chunks 0 gives an empty range");
    tp_chunk_range(10, 3, 3, &s, &l);
    cr_assert(s == 0 && l == 0, "index out of range gives an empty range");
    tp_chunk_range(10, 3, 1, NULL, NULL); /* NULL outs are fine */
    tp_chunk_range(INT64_MAX, 2, 1, &s, &l);
    cr_assert_eq(s + l, INT64_MAX);

    int64_t n = 5;
    tp_tensor *t = NULL, *c = (tp_tensor *)0x1;
    CHECK_OK(tp_tensor_empty(TP_F32, TP_CPU, 1, &n, &t));
    CHECK_ERR(tp_tensor_chunk(t, 0, 0, 0, &c), TP_ERR_INVALID_ARG);
    cr_assert_null(c);
    CHECK_ERR(tp_tensor_chunk(t, 4, 0, 4, &c), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_chunk(t, 4, 0, -1, &c), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_chunk(t, 4, 1, 0, &c), TP_ERR_INVALID_ARG);
    tp_tensor_release(t);
}

Test(tensor, select, .timeout = 30)
{
    int64_t shape[3] = {2, 3, 4};
    tp_tensor *t = NULL, *s = NULL, *s2 = NULL;
    CHECK_OK(tp_tensor_empty(TP_F64, TP_CPU, 3, shape, &t));
    fill_seq(t, 0);
    CHECK_OK(tp_tensor_select(t, 1, 2, &s));
    cr_assert(tp_tensor_shares_storage(t, s));
    cr_assert_eq(tp_tensor_ndim(s), 2);
    cr_assert_eq(tp_tensor_size(s, 0), 2);
    cr_assert_eq(tp_tensor_size(s, 1), 4);
    for (int i = 0; i < 2; i++)
        for (int k = 0; k < 4; k++)
            cr_assert_eq(get2(s, i, k), i * 12 + 2 * 4 + k);
    CHECK_OK(tp_tensor_select(s, -1, -1, &s2)); /* negative dim and index */
    cr_assert_eq(tp_tensor_ndim(s2), 1);
    cr_assert_eq(get1(s2, 1), 12 + 8 + 3);
    CHECK_OK(tp_tensor_set(s2, (int64_t[]){0}, 99));
    cr_assert_eq(get2(s, 0, 0), 8.0); /* untouched element */
    int64_t idx[3] = {0, 2, 3};
    double v;
    CHECK_OK(tp_tensor_get(t, idx, &v));
    cr_assert_eq(v, 99.0, "write through a select of a select");
    tp_tensor_release(s2);

    /* select to a scalar */
    tp_tensor *sc = NULL, *sc2 = NULL;
    CHECK_OK(tp_tensor_select(s, 0, 1, &sc));
    CHECK_OK(tp_tensor_select(sc, 0, 3, &sc2));
    cr_assert_eq(tp_tensor_ndim(sc2), 0);
    CHECK_OK(tp_tensor_get(sc2, NULL, &v));
    cr_assert_eq(v, 12 + 8 + 3);
    tp_tensor *bad = (tp_tensor *)0x1;
    CHECK_ERR(tp_tensor_select(sc2, 0, 0, &bad), TP_ERR_INVALID_ARG);
    cr_assert_null(bad);
    tp_tensor_release(sc2);
    tp_tensor_release(sc);

    CHECK_ERR(tp_tensor_select(t, 1, 3, &bad), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_select(t, 1, -4, &bad), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_select(t, 3, 0, &bad), TP_ERR_INVALID_ARG);
    tp_tensor_release(s);
    tp_tensor_release(t);
}

Test(tensor, view, .timeout = 30)
{
    int64_t shape[3] = {2, 3, 4};
    tp_tensor *t = NULL, *v = NULL, *bad = (tp_tensor *)0x1;
    CHECK_OK(tp_tensor_empty(TP_I64, TP_CPU, 3, shape, &t));
    fill_seq(t, 0);

    CHECK_OK(tp_tensor_view(t, 2, (int64_t[]){6, -1}, &v));
    cr_assert(tp_tensor_shares_storage(t, v));
    cr_assert_eq(tp_tensor_size(v, 0), 6);
    cr_assert_eq(tp_tensor_size(v, 1), 4);
    expect_seq(v, 0);
    CHECK_OK(tp_tensor_set(v, (int64_t[]){5, 3}, -5));
    double x;
    CHECK_OK(tp_tensor_get(t, (int64_t[]){1, 2, 3}, &x));
    cr_assert_eq(x, -5.0);
    tp_tensor_release(v);

    CHECK_OK(tp_tensor_view(t, 1, (int64_t[]){-1}, &v));
    cr_assert_eq(tp_tensor_size(v, 0), 24);
    tp_tensor_release(v);
    CHECK_OK(tp_tensor_view(t, 4, (int64_t[]){1, 2, 12, 1}, &v));
    cr_assert(tp_tensor_is_contiguous(v));
    tp_tensor_release(v);

    CHECK_ERR(tp_tensor_view(t, 2, (int64_t[]){-1, -1}, &bad), TP_ERR_INVALID_ARG);
    cr_assert_null(bad);
    CHECK_ERR(tp_tensor_view(t, 2, (int64_t[]){5, -1}, &bad), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_view(t, 2, (int64_t[]){5, 5}, &bad), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_view(t, 2, (int64_t[]){-2, 12}, &bad), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_view(t, 9, (int64_t[]){1, 1, 1, 1, 1, 1, 1, 1, 24}, &bad),
               TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_view(t, 2, (int64_t[]){INT64_MAX, 4}, &bad), TP_ERR_INVALID_ARG);

    /* a narrowed (non-contiguous) view cannot be re-viewed */
    tp_tensor *n = NULL;
    CHECK_OK(tp_tensor_narrow(t, 2, 0, 2, &n));
    CHECK_ERR(tp_tensor_view(n, 1, (int64_t[]){12}, &bad), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "contiguous"), "%s", tp_last_error());
    tp_tensor_release(n);

    /* a contiguous narrow along dim 0 can, and keeps its offset */
    CHECK_OK(tp_tensor_narrow(t, 0, 1, 1, &n));
    CHECK_OK(tp_tensor_view(n, 2, (int64_t[]){3, 4}, &v));
    cr_assert_eq(get2(v, 0, 0), 12.0);
    tp_tensor_release(v);
    tp_tensor_release(n);

    /* zero elements: -1 is inferable only if the other sizes are non-zero */
    tp_tensor *z = NULL;
    CHECK_OK(tp_tensor_empty(TP_F32, TP_CPU, 2, (int64_t[]){0, 3}, &z));
    CHECK_OK(tp_tensor_view(z, 2, (int64_t[]){-1, 3}, &v));
    cr_assert_eq(tp_tensor_size(v, 0), 0);
    tp_tensor_release(v);
    CHECK_ERR(tp_tensor_view(z, 2, (int64_t[]){-1, 0}, &bad), TP_ERR_INVALID_ARG);
    tp_tensor_release(z);

    /* scalar <-> [1] */
    tp_tensor *one = NULL, *s = NULL;
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 1, (int64_t[]){1}, &one));
    CHECK_OK(tp_tensor_view(one, 0, NULL, &s));
    cr_assert_eq(tp_tensor_ndim(s), 0);
    cr_assert_eq(tp_tensor_numel(s), 1);
    tp_tensor_release(s);
    tp_tensor_release(one);
    tp_tensor_release(t);
}

/* ---- copies and conversions ---------------------------------------------- */

Test(tensor, copy_across_dtypes_integer_valued, .timeout = 30)
{
    int64_t shape[2] = {5, 41};
    tp_tensor *src = NULL;
    CHECK_OK(tp_tensor_empty(TP_F32, TP_CPU, 2, shape, &src));
    fill_seq(src, -100); /* -100 .. 104: exact in every dtype */
    for (int a = 0; a < N_DTYPES; a++) {
        tp_tensor *x = NULL;
        CHECK_OK(tp_tensor_to(src, all_dtypes[a], TP_CPU, &x));
        cr_assert_eq(tp_tensor_dtype(x), all_dtypes[a]);
        expect_seq(x, -100);
        for (int b = 0; b < N_DTYPES; b++) {
            tp_tensor *y = NULL;
            CHECK_OK(tp_tensor_empty(all_dtypes[b], TP_CPU, 2, shape, &y));
            CHECK_OK(tp_tensor_copy(y, x));
            bool eq = false;
            CHECK_OK(tp_tensor_equal(y, src, &eq));
            cr_assert(eq, "%s -> %s", tp_dtype_name(all_dtypes[a]), tp_dtype_name(all_dtypes[b]));
            tp_tensor_release(y);
        }
        tp_tensor_release(x);
    }
    tp_tensor_release(src);
}

static uint16_t f32_to_half_bits(float f, tp_dtype dt)
{
    int64_t n = 1;
    tp_tensor *s = NULL, *h = NULL;
    CHECK_OK(tp_tensor_from_data(TP_F32, 1, &n, &f, &s));
    CHECK_OK(tp_tensor_to(s, dt, TP_CPU, &h));
    uint16_t bits;
    memcpy(&bits, tp_tensor_data(h), 2);
    tp_tensor_release(s);
    tp_tensor_release(h);
    return bits;
}

static float half_bits_to_f32(uint16_t bits, tp_dtype dt)
{
    int64_t n = 1;
    tp_tensor *h = NULL, *s = NULL;
    CHECK_OK(tp_tensor_from_data(dt, 1, &n, &bits, &h));
    CHECK_OK(tp_tensor_to(h, TP_F32, TP_CPU, &s));
    float f;
    memcpy(&f, tp_tensor_data(s), 4);
    tp_tensor_release(s);
    tp_tensor_release(h);
    return f;
}

static float bits_f32(uint32_t x)
{
    float f;
    memcpy(&f, &x, 4);
    return f;
}

Test(tensor, f16_known_bits, .timeout = 30)
{
    struct { float f; uint16_t h; } cases[] = {
        {1.0f, 0x3c00},
        {-2.0f, 0xc000},
        {0.0f, 0x0000},
        {-0.0f, 0x8000},
        {65504.0f, 0x7bff},          /* max f16 */
        {65519.0f, 0x7bff},          /* below the halfway point */
        {65520.0f, 0x7c00},          /* halfway, odd max -> rounds to Inf */
        {65536.0f, 0x7c00},
        {1e10f, 0x7c00},
        {INFINITY, 0x7c00},
        {-INFINITY, 0xfc00},
        {0x1p-14f, 0x0400},          /* smallest normal */
        {0x1p-24f, 0x0001},          /* smallest subnormal */
        {0x1p-25f, 0x0000},          /* tie with 0 -> even 0 */
        {0x1.8p-25f, 0x0001},        /* above the tie */
        {0x1.8p-24f, 0x0002},        /* 1.5 ulp: tie between 1 and 2 -> even 2 */
        {0x1.4p-24f, 0x0001},        /* 1.25 ulp */
        {0x1.ff8p-15f, 0x03ff},      /* largest subnormal */
        {0x1.ffcp-15f, 0x0400},      /* largest subnormal + half ulp, odd -> rounds up to normal */
        {1e-10f, 0x0000},
        {1.0f + 0x1p-11f, 0x3c00},   /* tie between 1 and 1+2^-10 -> even */
        {1.0f + 0x3p-11f, 0x3c02},   /* tie between odd and even -> even (up) */
        {1.0f + 0x1p-11f + 0x1p-20f, 0x3c01},
        {2049.0f, 0x6800},           /* tie -> 2048 */
        {2051.0f, 0x6802},           /* tie -> 2052 */
        {0.1f, 0x2e66},
        {1.0f / 3.0f, 0x3555},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint16_t h = f32_to_half_bits(cases[i].f, TP_F16);
        cr_assert_eq(h, cases[i].h, "f16(%a) = 0x%04x, expected 0x%04x", (double)cases[i].f, h,
                     cases[i].h);
    }
    uint16_t qnan = f32_to_half_bits(NAN, TP_F16);
    cr_assert_eq(qnan & 0x7c00, 0x7c00);
    cr_assert_neq(qnan & 0x03ff, 0, "NaN stays NaN");
    /* a signalling NaN whose payload lives only in the low bits must not become Inf */
    uint16_t snan = f32_to_half_bits(bits_f32(0x7f800001u), TP_F16);
    cr_assert_eq(snan & 0x7c00, 0x7c00);
    cr_assert_neq(snan & 0x03ff, 0);

    cr_assert_eq(half_bits_to_f32(0x0001, TP_F16), 0x1p-24f);
    cr_assert_eq(half_bits_to_f32(0x03ff, TP_F16), 0x3ffp-24f);
    cr_assert_eq(half_bits_to_f32(0x0400, TP_F16), 0x1p-14f);
    cr_assert_eq(half_bits_to_f32(0x7bff, TP_F16), 65504.0f);
    cr_assert_eq(half_bits_to_f32(0x3555, TP_F16), 0.333251953125f);
    cr_assert_eq(half_bits_to_f32(0xfc00, TP_F16), -INFINITY);
    cr_assert(isnan(half_bits_to_f32(0x7e00, TP_F16)));
    cr_assert(isnan(half_bits_to_f32(0x7c01, TP_F16)));
    float mz = half_bits_to_f32(0x8000, TP_F16);
    cr_assert(mz == 0.0f && signbit(mz));
}

Test(tensor, f16_exhaustive_roundtrip_and_ties, .timeout = 30)
{
    /* every f16 value: f16 -> f32 -> f16 is the identity (NaNs stay NaN), and
     * the f32 midpoint between consecutive finite values rounds to the even
     * one while its f32 neighbours round to the nearer one */
    int64_t n = 65536;
    uint16_t *bits = malloc(sizeof *bits * (size_t)n);
    for (int64_t i = 0; i < n; i++)
        bits[i] = (uint16_t)i;
    tp_tensor *h = NULL, *f = NULL, *back = NULL;
    CHECK_OK(tp_tensor_from_data(TP_F16, 1, &n, bits, &h));
    CHECK_OK(tp_tensor_to(h, TP_F32, TP_CPU, &f));
    CHECK_OK(tp_tensor_to(f, TP_F16, TP_CPU, &back));
    const float *fv = tp_tensor_data(f);
    const uint16_t *bv = tp_tensor_data(back);
    for (int64_t i = 0; i < n; i++) {
        bool nan = (i & 0x7c00) == 0x7c00 && (i & 0x3ff);
        if (nan) {
            cr_assert(isnan(fv[i]), "0x%04x", (unsigned)i);
            cr_assert(isnan(half_bits_to_f32(bv[i], TP_F16)));
        } else {
            cr_assert_eq(bv[i], (uint16_t)i, "0x%04x -> %a -> 0x%04x", (unsigned)i,
                         (double)fv[i], bv[i]);
        }
    }
    for (uint32_t i = 0; i < 0x7bff; i++) { /* positive finite pairs (i, i+1) */
        float lo = fv[i], hi = fv[i + 1];
        float mid = (float)(((double)lo + (double)hi) / 2); /* exact in f32 */
        uint16_t even = (i & 1) ? (uint16_t)(i + 1) : (uint16_t)i;
        cr_assert_eq(f32_to_half_bits(mid, TP_F16), even, "tie above 0x%04x", i);
        cr_assert_eq(f32_to_half_bits(nextafterf(mid, 0.0f), TP_F16), (uint16_t)i);
        cr_assert_eq(f32_to_half_bits(nextafterf(mid, INFINITY), TP_F16), (uint16_t)(i + 1));
        cr_assert_eq(f32_to_half_bits(-mid, TP_F16), (uint16_t)(even | 0x8000));
    }
    tp_tensor_release(h);
    tp_tensor_release(f);
    tp_tensor_release(back);
    free(bits);
}

Test(tensor, bf16_known_bits, .timeout = 30)
{
    struct { uint32_t f; uint16_t h; } cases[] = {
        {0x3f800000u, 0x3f80}, /* 1.0 */
        {0xc0000000u, 0xc000}, /* -2.0 */
        {0x3f808000u, 0x3f80}, /* 1 + 2^-8: tie -> even */
        {0x3f818000u, 0x3f82}, /* tie from odd -> up to even */
        {0x3f808001u, 0x3f81}, /* just above the tie */
        {0x3f807fffu, 0x3f80}, /* just below */
        {0x7f7fffffu, 0x7f80}, /* FLT_MAX rounds to Inf */
        {0x7f7f7fffu, 0x7f7f}, /* largest that stays finite */
        {0x7f800000u, 0x7f80}, /* Inf */
        {0xff800000u, 0xff80}, /* -Inf */
        {0x00000001u, 0x0000}, /* f32 subnormal -> 0 */
        {0x00008000u, 0x0000}, /* subnormal tie -> even 0 */
        {0x00018000u, 0x0002}, /* subnormal tie from odd -> even */
        {0x80000000u, 0x8000}, /* -0 */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint16_t h = f32_to_half_bits(bits_f32(cases[i].f), TP_BF16);
        cr_assert_eq(h, cases[i].h, "bf16(0x%08x) = 0x%04x, expected 0x%04x", cases[i].f, h,
                     cases[i].h);
    }
    uint16_t nan = f32_to_half_bits(NAN, TP_BF16);
    cr_assert((nan & 0x7f80) == 0x7f80 && (nan & 0x7f));
    /* payload only in the dropped bits: must stay NaN, not become Inf */
    uint16_t snan = f32_to_half_bits(bits_f32(0x7f800001u), TP_BF16);
    cr_assert((snan & 0x7f80) == 0x7f80 && (snan & 0x7f), "0x%04x", snan);
    cr_assert_eq(half_bits_to_f32(0x3f80, TP_BF16), 1.0f);
    cr_assert_eq(half_bits_to_f32(0x0001, TP_BF16), bits_f32(0x00010000u));
    cr_assert(isnan(half_bits_to_f32(0x7fc0, TP_BF16)));
    /* every bf16 round-trips */
    for (uint32_t i = 0; i < 65536; i++) {
        if ((i & 0x7f80) == 0x7f80 && (i & 0x7f))
            continue;
        float f = bits_f32(i << 16);
        cr_assert_eq(f32_to_half_bits(f, TP_BF16), (uint16_t)i);
        if ((i & 0xff) == 0)
            cr_assert_eq(half_bits_to_f32((uint16_t)i, TP_BF16), f);
    }
}

Test(tensor, float_to_int_and_back, .timeout = 30)
{
    double vals[] = {2.7, -2.7, 0.5, -0.5, 1e20, -1e20, NAN, 2147483647.0, -2147483648.0};
    int32_t expect32[] = {2, -2, 0, 0, INT32_MAX, INT32_MIN, 0, INT32_MAX, INT32_MIN};
    int64_t expect64[] = {2, -2, 0, 0, INT64_MAX, INT64_MIN, 0, 2147483647LL, -2147483648LL};
    int64_t n = 9;
    tp_tensor *d = NULL, *i32 = NULL, *i64 = NULL;
    CHECK_OK(tp_tensor_from_data(TP_F64, 1, &n, vals, &d));
    CHECK_OK(tp_tensor_to(d, TP_I32, TP_CPU, &i32));
    CHECK_OK(tp_tensor_to(d, TP_I64, TP_CPU, &i64));
    const int32_t *p32 = tp_tensor_data(i32);
    const int64_t *p64 = tp_tensor_data(i64);
    for (int k = 0; k < n; k++) {
        cr_assert_eq(p32[k], expect32[k], "i32(%g) = %d", vals[k], p32[k]);
        cr_assert_eq(p64[k], expect64[k], "i64(%g) = %lld", vals[k], (long long)p64[k]);
    }
    /* i64 -> f64 of a large value, i64 -> f32 rounds once */
    int64_t big[2] = {(1LL << 53) + 1, (1LL << 24) + 1};
    int64_t two = 2;
    tp_tensor *bi = NULL, *bf = NULL;
    CHECK_OK(tp_tensor_from_data(TP_I64, 1, &two, big, &bi));
    CHECK_OK(tp_tensor_to(bi, TP_F32, TP_CPU, &bf));
    cr_assert_eq(((const float *)tp_tensor_data(bf))[1], 16777216.0f);
    tp_tensor_release(bf);
    tp_tensor_release(bi);
    tp_tensor_release(d);
    tp_tensor_release(i32);
    tp_tensor_release(i64);

    /* f64 -> f16 through f32 is correctly rounded */
    double third = 1.0 / 3.0;
    int64_t one = 1;
    tp_tensor *t = NULL, *h = NULL;
    CHECK_OK(tp_tensor_from_data(TP_F64, 1, &one, &third, &t));
    CHECK_OK(tp_tensor_to(t, TP_F16, TP_CPU, &h));
    cr_assert_eq(*(const uint16_t *)tp_tensor_data(h), 0x3555);
    tp_tensor_release(t);
    tp_tensor_release(h);
}

Test(tensor, strided_copy, .timeout = 30)
{
    int64_t shape[3] = {3, 4, 6};
    tp_tensor *base = NULL, *v = NULL, *dst = NULL;
    CHECK_OK(tp_tensor_empty(TP_F32, TP_CPU, 3, shape, &base));
    fill_seq(base, 0);

    /* source strided in the middle and last dims */
    tp_tensor *v1 = NULL;
    CHECK_OK(tp_tensor_narrow(base, 1, 1, 2, &v1));
    CHECK_OK(tp_tensor_narrow(v1, 2, 2, 3, &v));
    tp_tensor_release(v1);
    for (int k = 0; k < N_DTYPES; k++) {
        CHECK_OK(tp_tensor_empty(all_dtypes[k], TP_CPU, 3, (int64_t[]){3, 2, 3}, &dst));
        CHECK_OK(tp_tensor_copy(dst, v));
        int64_t idx[3];
        for (idx[0] = 0; idx[0] < 3; idx[0]++)
            for (idx[1] = 0; idx[1] < 2; idx[1]++)
                for (idx[2] = 0; idx[2] < 3; idx[2]++) {
                    double x;
                    CHECK_OK(tp_tensor_get(dst, idx, &x));
                    cr_assert_eq(x, (double)(idx[0] * 24 + (idx[1] + 1) * 6 + idx[2] + 2));
                }
        bool eq = false;
        CHECK_OK(tp_tensor_equal(dst, v, &eq));
        cr_assert(eq);
        tp_tensor_release(dst);
    }

    /* a column (select along the last dim: stride 6) copied to contiguous */
    tp_tensor *col = NULL, *colc = NULL;
    CHECK_OK(tp_tensor_select(base, 2, 5, &col));
    CHECK_OK(tp_tensor_clone(col, &colc));
    cr_assert(tp_tensor_is_contiguous(colc));
    cr_assert(!tp_tensor_shares_storage(col, colc));
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 4; j++)
            cr_assert_eq(get2(colc, i, j), (double)(i * 24 + j * 6 + 5));

    /* contiguous source into a strided destination: only the view changes */
    tp_tensor *ones = NULL;
    CHECK_OK(tp_tensor_empty(TP_I32, TP_CPU, 2, (int64_t[]){3, 4}, &ones));
    CHECK_OK(tp_tensor_fill(ones, -1));
    CHECK_OK(tp_tensor_copy(col, ones));
    for (int64_t i = 0; i < 72; i++) {
        int64_t idx[3] = {i / 24, (i / 6) % 4, i % 6};
        double x;
        CHECK_OK(tp_tensor_get(base, idx, &x));
        cr_assert_eq(x, idx[2] == 5 ? -1.0 : (double)i, "element %lld", (long long)i);
    }

    /* strided to strided of a different dtype */
    tp_tensor *other = NULL, *ocol = NULL;
    CHECK_OK(tp_tensor_zeros(TP_BF16, TP_CPU, 3, (int64_t[]){3, 4, 2}, &other));
    CHECK_OK(tp_tensor_select(other, 2, 1, &ocol));
    CHECK_OK(tp_tensor_copy(ocol, colc));
    bool eq = false;
    CHECK_OK(tp_tensor_equal(ocol, colc, &eq));
    cr_assert(eq);
    tp_tensor *ocol0 = NULL;
    CHECK_OK(tp_tensor_select(other, 2, 0, &ocol0));
    double diff = -1;
    CHECK_OK(tp_tensor_fill(ones, 0));
    CHECK_OK(tp_tensor_max_abs_diff(ocol0, ones, &diff));
    cr_assert_eq(diff, 0.0, "the other column is untouched");

    /* copy onto itself is a no-op */
    CHECK_OK(tp_tensor_copy(v, v));

    /* shape mismatch */
    CHECK_ERR(tp_tensor_copy(ones, v), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "[3, 4]") && strstr(tp_last_error(), "[3, 2, 3]"), "%s",
              tp_last_error());

    tp_tensor_release(ocol0);
    tp_tensor_release(ocol);
    tp_tensor_release(other);
    tp_tensor_release(ones);
    tp_tensor_release(colc);
    tp_tensor_release(col);
    tp_tensor_release(v);
    tp_tensor_release(base);
}

/* Copies between views of one storage: refused when the views share a byte
 * (memcpy on overlapping memory), allowed when they only interleave. */
#define EXPECT_OVERLAP(dst, src)                                                \
    do {                                                                        \
        CHECK_ERR(tp_tensor_copy((dst), (src)), TP_ERR_INVALID_ARG);            \
        cr_assert(strstr(tp_last_error(), "tp_tensor_copy: dst and src overlap in memory"), \
                  "copy(%s, %s): %s", #dst, #src, tp_last_error());             \
    } while (0)

Test(tensor, copy_between_overlapping_views, .timeout = 30)
{
    /* 1-D: [0, 6) and [1, 7) share five elements, either direction */
    int64_t ten = 10;
    tp_tensor *x = NULL, *a = NULL, *b = NULL, *c = NULL, *whole = NULL;
    CHECK_OK(tp_tensor_empty(TP_F32, TP_CPU, 1, &ten, &x));
    fill_seq(x, 0);
    CHECK_OK(tp_tensor_narrow(x, 0, 0, 6, &a));
    CHECK_OK(tp_tensor_narrow(x, 0, 1, 6, &b));
    EXPECT_OVERLAP(b, a);
    EXPECT_OVERLAP(a, b);
    expect_seq(x, 0); /* nothing was written */
    /* adjacent halves touch no common byte */
    tp_tensor_release(a);
    tp_tensor_release(b);
    CHECK_OK(tp_tensor_narrow(x, 0, 0, 5, &a));
    CHECK_OK(tp_tensor_narrow(x, 0, 5, 5, &b));
    CHECK_OK(tp_tensor_copy(b, a));
    for (int64_t i = 0; i < 10; i++)
        cr_assert_eq(get1(x, i), (double)(i % 5));
    /* a second handle on the same view is the same view */
    CHECK_OK(tp_tensor_narrow(x, 0, 0, 10, &whole));
    CHECK_OK(tp_tensor_copy(whole, x));
    tp_tensor_release(a);
    tp_tensor_release(b);
    tp_tensor_release(whole);
    tp_tensor_release(x);
    a = b = x = NULL;

    /* 2-D, m is 4 x 6 */
    int64_t shape[2] = {4, 6};
    tp_tensor *m = NULL, *v = NULL, *even = NULL, *odd = NULL;
    CHECK_OK(tp_tensor_empty(TP_I32, TP_CPU, 2, shape, &m));
    fill_seq(m, 0);
    /* rows [0, 2) and [1, 3) share row 1 */
    CHECK_OK(tp_tensor_narrow(m, 0, 0, 2, &a));
    CHECK_OK(tp_tensor_narrow(m, 0, 1, 2, &b));
    EXPECT_OVERLAP(a, b);
    tp_tensor_release(a);
    tp_tensor_release(b);
    /* even columns {0, 2, 4} and columns [2, 5) share columns 2 and 4,
     * though neither view is contiguous */
    CHECK_OK(tp_tensor_view(m, 3, (int64_t[]){4, 3, 2}, &v));
    CHECK_OK(tp_tensor_select(v, 2, 0, &even));
    CHECK_OK(tp_tensor_select(v, 2, 1, &odd));
    CHECK_OK(tp_tensor_narrow(m, 1, 2, 3, &c));
    EXPECT_OVERLAP(c, even);
    EXPECT_OVERLAP(even, c);
    /* a row and a column share their crossing element */
    tp_tensor *col = NULL;
    CHECK_OK(tp_tensor_select(m, 0, 1, &a));   /* row 1, 6 elements */
    CHECK_OK(tp_tensor_select(m, 1, 3, &col)); /* column 3, 4 elements */
    CHECK_OK(tp_tensor_narrow(a, 0, 1, 4, &b));   /* row 1, columns [1, 5): holds (1, 3) */
    EXPECT_OVERLAP(col, b);
    tp_tensor_release(b);
    CHECK_OK(tp_tensor_narrow(a, 0, 0, 4, &b)); /* row 1, columns [0, 4): holds (1, 3) too */
    EXPECT_OVERLAP(b, col);
    expect_seq(m, 0);
    /* even and odd columns interleave without sharing a byte: allowed */
    CHECK_OK(tp_tensor_copy(odd, even));
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 6; j++)
            cr_assert_eq(get2(m, i, j), (double)(i * 6 + j - j % 2), "m[%d][%d]", i, j);
    tp_tensor_release(a);
    tp_tensor_release(b);
    tp_tensor_release(c);
    tp_tensor_release(col);
    tp_tensor_release(v);
    tp_tensor_release(even);
    tp_tensor_release(odd);
    tp_tensor_release(m);

    /* even and odd rows of a large matrix interleave too; the check stays
     * quick */
    int64_t big[2] = {1000, 1002};
    tp_tensor *g = NULL, *gv = NULL, *r0 = NULL, *r1 = NULL, *c0 = NULL, *c1 = NULL;
    CHECK_OK(tp_tensor_zeros(TP_F64, TP_CPU, 2, big, &g));
    CHECK_OK(tp_tensor_view(g, 3, (int64_t[]){500, 2, 1002}, &gv));
    CHECK_OK(tp_tensor_select(gv, 1, 0, &r0));
    CHECK_OK(tp_tensor_select(gv, 1, 1, &r1));
    CHECK_OK(tp_tensor_fill(r0, 1.0));
    CHECK_OK(tp_tensor_copy(r1, r0));
    tp_tensor_release(gv);
    CHECK_OK(tp_tensor_view(g, 3, (int64_t[]){1000, 501, 2}, &gv));
    CHECK_OK(tp_tensor_select(gv, 2, 0, &c0));
    CHECK_OK(tp_tensor_select(gv, 2, 1, &c1));
    CHECK_OK(tp_tensor_fill(c0, 2.0));
    CHECK_OK(tp_tensor_copy(c1, c0));
    double diff = -1;
    tp_tensor *twos = NULL;
    CHECK_OK(tp_tensor_zeros(TP_F64, TP_CPU, 2, big, &twos));
    CHECK_OK(tp_tensor_fill(twos, 2.0));
    CHECK_OK(tp_tensor_max_abs_diff(g, twos, &diff));
    cr_assert_eq(diff, 0.0);
    /* rows 0, 2, ... against rows 2, 4, ...: shared */
    tp_tensor *r0n = NULL, *r0s = NULL;
    CHECK_OK(tp_tensor_narrow(r0, 0, 0, 499, &r0n));
    CHECK_OK(tp_tensor_narrow(r0, 0, 1, 499, &r0s));
    EXPECT_OVERLAP(r0s, r0n);
    tp_tensor_release(r0n);
    tp_tensor_release(r0s);

    /* tensors wrapping one buffer (tp_tensor_from_blob) are compared by
     * address, dtypes of different sizes included: f32 bytes [0, 16) against
     * f16 bytes [16, 24) are apart, against f16 bytes [14, 22) not */
    float buf[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    int64_t four = 4;
    tp_tensor *t32 = NULL, *t16 = NULL, *t16b = NULL, *t32b = NULL;
    CHECK_OK(tp_tensor_from_blob(TP_F32, TP_CPU, 1, &four, buf, NULL, NULL, &t32));
    CHECK_OK(tp_tensor_from_blob(TP_F16, TP_CPU, 1, &four, (char *)buf + 16, NULL, NULL, &t16));
    CHECK_OK(tp_tensor_from_blob(TP_F16, TP_CPU, 1, &four, (char *)buf + 14, NULL, NULL, &t16b));
    CHECK_OK(tp_tensor_from_blob(TP_F32, TP_CPU, 1, &four, buf, NULL, NULL, &t32b));
    CHECK_OK(tp_tensor_copy(t16, t32));
    for (int64_t i = 0; i < 4; i++)
        cr_assert_eq(get1(t16, i), (double)(i + 1));
    EXPECT_OVERLAP(t16b, t32);
    EXPECT_OVERLAP(t32, t16b);
    CHECK_OK(tp_tensor_copy(t32b, t32)); /* the same view through another blob */
    tp_tensor_release(t32);
    tp_tensor_release(t16);
    tp_tensor_release(t16b);
    tp_tensor_release(t32b);
    tp_tensor_release(twos);
    tp_tensor_release(c0);
    tp_tensor_release(c1);
    tp_tensor_release(r0);
    tp_tensor_release(r1);
    tp_tensor_release(gv);
    tp_tensor_release(g);
}

/* In an n-element f32 buffer holding 0, 1, 2, ...: copies columns
 * [c2, c2 + k) of the first `rows` rows of the buffer viewed w2 wide into
 * columns [c1, c1 + k) of the first `rows` rows of it viewed w1 wide (views
 * of one storage), then checks every element of the buffer. */
static void copy_columns(int64_t n, int64_t rows, int64_t k, int64_t w1, int64_t c1, int64_t w2,
                         int64_t c2)
{
    tp_tensor *buf = NULL, *v[2] = {NULL, NULL}, *r[2] = {NULL, NULL}, *c[2] = {NULL, NULL};
    CHECK_OK(tp_tensor_empty(TP_F32, TP_CPU, 1, &n, &buf));
    float *p = tp_tensor_data(buf);
    for (int64_t e = 0; e < n; e++)
        p[e] = (float)e;
    const int64_t w[2] = {w1, w2}, c0[2] = {c1, c2};
    for (int i = 0; i < 2; i++) {
        CHECK_OK(tp_tensor_view(buf, 2, (int64_t[]){n / w[i], w[i]}, &v[i]));
        CHECK_OK(tp_tensor_narrow(v[i], 0, 0, rows, &r[i]));
        CHECK_OK(tp_tensor_narrow(r[i], 1, c0[i], k, &c[i]));
    }
    CHECK_OK(tp_tensor_copy(c[0], c[1]));
    for (int64_t e = 0; e < n; e++) {
        int64_t i = e / w1, j = e % w1 - c1;
        float want = i < rows && j >= 0 && j < k ? (float)(i * w2 + c2 + j) : (float)e;
        cr_assert_eq(p[e], want, "buf[%lld] = %g, want %g", (long long)e, (double)p[e],
                     (double)want);
    }
    for (int i = 0; i < 2; i++) {
        tp_tensor_release(c[i]);
        tp_tensor_release(r[i]);
        tp_tensor_release(v[i]);
    }
    tp_tensor_release(buf);
}

/* Disjoint strided views of one large buffer, too many rows for the overlap
 * search to enumerate: column 0 of 250000 x 4 (elements 4i) from column 1
 * of 500000 x 2 narrowed to 250000 rows (elements 2i + 1). The copy goes
 * ahead (it used to be refused as "may overlap", though the check is
 * documented exact) and moves the right values. */
Test(tensor, copy_between_large_interleaved_views, .timeout = 60)
{
    copy_columns(1000000, 250000, 1, 4, 0, 2, 1);
}

/* Where the bounded search gives up and no shortcut decides, the copy goes
 * through a temporary: columns {0, 1} of 1000000 x 4 (first 500000 rows)
 * from columns {2, 3} of 500000 x 8 are disjoint (residues 0, 1 and 2, 3
 * mod 4), though their strides have gcd 1 element. */
Test(tensor, copy_through_a_temporary_when_overlap_is_undecided, .timeout = 60)
{
    copy_columns(4000000, 500000, 2, 4, 0, 8, 2);
}

Test(tensor, large_contiguous_copy_and_convert, .timeout = 30)
{
    int64_t shape[2] = {1024, 4096};
    tp_tensor *a = NULL, *b = NULL, *c = NULL;
    CHECK_OK(tp_tensor_empty(TP_F32, TP_CPU, 2, shape, &a));
    float *p = tp_tensor_data(a);
    for (int64_t i = 0; i < shape[0] * shape[1]; i++)
        p[i] = (float)(i % 1000);
    CHECK_OK(tp_tensor_clone(a, &b));
    CHECK_OK(tp_tensor_to(a, TP_BF16, TP_CPU, &c));
    bool eq = false;
    CHECK_OK(tp_tensor_equal(a, b, &eq));
    cr_assert(eq);
    CHECK_OK(tp_tensor_allclose(c, a, 0.01, 0, &eq));
    cr_assert(eq);
    tp_tensor_release(a);
    tp_tensor_release(b);
    tp_tensor_release(c);
}

Test(tensor, clone_and_to, .timeout = 30)
{
    int64_t shape[2] = {3, 5};
    tp_tensor *t = NULL, *c = NULL, *d = NULL;
    CHECK_OK(tp_tensor_empty(TP_I64, TP_CPU, 2, shape, &t));
    fill_seq(t, 10);
    CHECK_OK(tp_tensor_clone(t, &c));
    cr_assert(!tp_tensor_shares_storage(t, c));
    cr_assert_eq(tp_tensor_dtype(c), TP_I64);
    expect_seq(c, 10);
    CHECK_OK(tp_tensor_fill(t, 0));
    expect_seq(c, 10); /* independent */
    CHECK_OK(tp_tensor_to(c, TP_F16, TP_CPU, &d));
    cr_assert_eq(tp_tensor_dtype(d), TP_F16);
    expect_seq(d, 10);
    tp_tensor *bad = (tp_tensor *)0x1;
    CHECK_ERR(tp_tensor_to(c, (tp_dtype)17, TP_CPU, &bad), TP_ERR_INVALID_ARG);
    cr_assert_null(bad);
    if (tp_cuda_device_count() == 0)
        CHECK_ERR(tp_tensor_to(c, TP_F32, TP_CUDA(0), &bad), TP_ERR_NOT_SUPPORTED);
    tp_tensor_release(t);
    tp_tensor_release(c);
    tp_tensor_release(d);
}

/* ---- fill, get, set ------------------------------------------------------- */

Test(tensor, fill_every_dtype, .timeout = 30)
{
    int64_t shape[3] = {2, 3, 5};
    for (int k = 0; k < N_DTYPES; k++) {
        tp_tensor *t = NULL, *v = NULL;
        CHECK_OK(tp_tensor_empty(all_dtypes[k], TP_CPU, 3, shape, &t));
        CHECK_OK(tp_tensor_fill(t, 3.0));
        int64_t idx[3];
        for (int64_t i = 0; i < 30; i++) {
            unravel(3, shape, i, idx);
            double x;
            CHECK_OK(tp_tensor_get(t, idx, &x));
            cr_assert_eq(x, 3.0);
        }
        /* a strided view only */
        CHECK_OK(tp_tensor_narrow(t, 2, 1, 2, &v));
        CHECK_OK(tp_tensor_fill(v, 0.0));
        for (int64_t i = 0; i < 30; i++) {
            unravel(3, shape, i, idx);
            double x;
            CHECK_OK(tp_tensor_get(t, idx, &x));
            cr_assert_eq(x, (idx[2] == 1 || idx[2] == 2) ? 0.0 : 3.0, "%s element %lld",
                         tp_dtype_name(all_dtypes[k]), (long long)i);
        }
        CHECK_OK(tp_tensor_fill(t, -2.5));
        double x;
        CHECK_OK(tp_tensor_get(t, (int64_t[]){1, 2, 4}, &x));
        cr_assert_eq(x, tp_dtype_is_float(all_dtypes[k]) ? -2.5 : -2.0,
                     "integers truncate toward zero");
        tp_tensor_release(v);
        tp_tensor_release(t);
    }
    /* scalar */
    tp_tensor *s = NULL;
    double x = 0;
    CHECK_OK(tp_tensor_empty(TP_F64, TP_CPU, 0, NULL, &s));
    CHECK_OK(tp_tensor_fill(s, 1.25));
    CHECK_OK(tp_tensor_get(s, NULL, &x));
    cr_assert_eq(x, 1.25);
    CHECK_OK(tp_tensor_set(s, NULL, 2.5));
    CHECK_OK(tp_tensor_get(s, NULL, &x));
    cr_assert_eq(x, 2.5);
    tp_tensor_release(s);
}

Test(tensor, get_set_errors, .timeout = 30)
{
    int64_t shape[2] = {2, 3};
    tp_tensor *t = NULL;
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 2, shape, &t));
    double v = 5;
    CHECK_ERR(tp_tensor_get(t, (int64_t[]){0, 3}, &v), TP_ERR_INVALID_ARG);
    cr_assert_eq(v, 0.0);
    cr_assert(strstr(tp_last_error(), "index 3") && strstr(tp_last_error(), "dim 1"), "%s",
              tp_last_error());
    CHECK_ERR(tp_tensor_get(t, (int64_t[]){-1, 0}, &v), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_get(t, NULL, &v), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_set(t, (int64_t[]){2, 0}, 1.0), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_set(t, NULL, 1.0), TP_ERR_INVALID_ARG);
    tp_tensor_release(t);
}

/* ---- comparison ------------------------------------------------------------ */

Test(tensor, compare, .timeout = 30)
{
    int64_t n = 4;
    float av[4] = {1, 2, 3, 4}, bv[4] = {1, 2, 3, 4.5f};
    int32_t iv[4] = {1, 2, 3, 4};
    tp_tensor *a = NULL, *b = NULL, *ia = NULL;
    CHECK_OK(tp_tensor_from_data(TP_F32, 1, &n, av, &a));
    CHECK_OK(tp_tensor_from_data(TP_F32, 1, &n, bv, &b));
    CHECK_OK(tp_tensor_from_data(TP_I32, 1, &n, iv, &ia));
    bool r = false;
    double d = -1;

    CHECK_OK(tp_tensor_equal(a, a, &r));
    cr_assert(r);
    CHECK_OK(tp_tensor_equal(a, ia, &r));
    cr_assert(r, "dtypes may differ");
    CHECK_OK(tp_tensor_equal(a, b, &r));
    cr_assert(!r);
    CHECK_OK(tp_tensor_max_abs_diff(a, b, &d));
    cr_assert_eq(d, 0.5);
    CHECK_OK(tp_tensor_allclose(a, b, 0, 0.5, &r));
    cr_assert(r, "|diff| <= atol");
    CHECK_OK(tp_tensor_allclose(a, b, 0, 0.49, &r));
    cr_assert(!r);
    CHECK_OK(tp_tensor_allclose(a, b, 0.12, 0, &r));
    cr_assert(r, "0.5 <= 0.12 * 4.5");
    CHECK_OK(tp_tensor_allclose(a, b, 0.1, 0, &r));
    cr_assert(!r);
    CHECK_ERR(tp_tensor_allclose(a, b, -1, 0, &r), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_allclose(a, b, NAN, 0, &r), TP_ERR_INVALID_ARG);

    /* NaN: never equal or close, and the max difference is NaN */
    float nv[4] = {1, NAN, 3, 4};
    tp_tensor *na = NULL;
    CHECK_OK(tp_tensor_from_data(TP_F32, 1, &n, nv, &na));
    CHECK_OK(tp_tensor_equal(na, na, &r));
    cr_assert(!r);
    CHECK_OK(tp_tensor_allclose(na, na, 1, 1, &r));
    cr_assert(!r);
    CHECK_OK(tp_tensor_max_abs_diff(na, a, &d));
    cr_assert(isnan(d));
    CHECK_OK(tp_tensor_max_abs_diff(b, na, &d));
    cr_assert(isnan(d), "NaN wins over a later larger difference");

    /* infinities: equal ones compare equal and close */
    float inf1[4] = {INFINITY, -INFINITY, 0, 0}, inf2[4] = {INFINITY, -INFINITY, 0, 1};
    tp_tensor *x = NULL, *y = NULL;
    CHECK_OK(tp_tensor_from_data(TP_F32, 1, &n, inf1, &x));
    CHECK_OK(tp_tensor_from_data(TP_F32, 1, &n, inf2, &y));
    CHECK_OK(tp_tensor_equal(x, x, &r));
    cr_assert(r);
    CHECK_OK(tp_tensor_allclose(x, y, 0, 1, &r));
    cr_assert(r);
    CHECK_OK(tp_tensor_max_abs_diff(x, y, &d));
    cr_assert_eq(d, 1.0);
    float inf3[4] = {-INFINITY, -INFINITY, 0, 0};
    tp_tensor *z = NULL;
    CHECK_OK(tp_tensor_from_data(TP_F32, 1, &n, inf3, &z));
    CHECK_OK(tp_tensor_allclose(x, z, 1e9, 1e9, &r));
    cr_assert(!r);

    /* shape mismatch: equal/allclose say no, max_abs_diff is an error */
    tp_tensor *m = NULL;
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 2, (int64_t[]){2, 2}, &m));
    r = true;
    CHECK_OK(tp_tensor_equal(a, m, &r));
    cr_assert(!r);
    r = true;
    CHECK_OK(tp_tensor_allclose(a, m, 1, 1, &r));
    cr_assert(!r);
    CHECK_ERR(tp_tensor_max_abs_diff(a, m, &d), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "[4]") && strstr(tp_last_error(), "[2, 2]"), "%s",
              tp_last_error());

    /* strided views compare by value */
    tp_tensor *v1 = NULL, *v2 = NULL;
    CHECK_OK(tp_tensor_narrow(a, 0, 0, 3, &v1));
    CHECK_OK(tp_tensor_narrow(b, 0, 0, 3, &v2));
    CHECK_OK(tp_tensor_equal(v1, v2, &r));
    cr_assert(r);
    tp_tensor_release(v1);
    tp_tensor_release(v2);

    tp_tensor_release(m);
    tp_tensor_release(z);
    tp_tensor_release(x);
    tp_tensor_release(y);
    tp_tensor_release(na);
    tp_tensor_release(a);
    tp_tensor_release(b);
    tp_tensor_release(ia);
}

/* ---- CUDA (only where a device is present) ------------------------------ */

Test(tensor, cuda_roundtrip, .timeout = 60)
{
    if (tp_cuda_device_count() == 0)
        cr_skip_test("no CUDA device");
    int64_t shape[2] = {5, 7};
    tp_tensor *h = NULL, *g = NULL, *g16 = NULL, *back = NULL, *z = NULL;
    CHECK_OK(tp_tensor_empty(TP_F32, TP_CPU, 2, shape, &h));
    fill_seq(h, -10);
    CHECK_OK(tp_tensor_to(h, TP_F32, TP_CUDA(0), &g));
    cr_assert_eq(tp_tensor_device(g).type, TP_DEVICE_CUDA);
    CHECK_OK(tp_tensor_to(g, TP_BF16, TP_CUDA(0), &g16)); /* D2D with conversion: staged */
    CHECK_OK(tp_tensor_to(g16, TP_F64, TP_CPU, &back));
    expect_seq(back, -10);
    bool eq = false;
    CHECK_OK(tp_tensor_equal(g, h, &eq));
    cr_assert(eq);
    tp_tensor_release(back);

    /* strided CUDA source and destination */
    tp_tensor *gv = NULL, *hv = NULL;
    CHECK_OK(tp_tensor_narrow(g, 1, 2, 3, &gv));
    CHECK_OK(tp_tensor_narrow(h, 1, 2, 3, &hv));
    CHECK_OK(tp_tensor_equal(gv, hv, &eq));
    cr_assert(eq);
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CUDA(0), 2, (int64_t[]){5, 3}, &z));
    CHECK_OK(tp_tensor_fill(gv, 1.5));
    CHECK_OK(tp_tensor_to(g, TP_F32, TP_CPU, &back));
    for (int i = 0; i < 5; i++)
        for (int j = 0; j < 7; j++)
            cr_assert_eq(get2(back, i, j), (j >= 2 && j < 5) ? 1.5 : (double)(i * 7 + j - 10));
    CHECK_OK(tp_tensor_copy(gv, z));
    CHECK_OK(tp_tensor_max_abs_diff(gv, z, &(double){0}));
    double x = -1;
    CHECK_OK(tp_tensor_get(back, (int64_t[]){0, 0}, &x));
    CHECK_ERR(tp_tensor_get(g, (int64_t[]){0, 0}, &x), TP_ERR_NOT_SUPPORTED);
    tp_tensor_release(back);
    tp_tensor_release(gv);
    tp_tensor_release(hv);
    tp_tensor_release(z);
    tp_tensor_release(g16);
    tp_tensor_release(g);
    tp_tensor_release(h);
}
