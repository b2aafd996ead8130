/* The CPU caching allocator and tp_memory_stats: reuse of freed blocks, the
 * limit on idle bytes, tp_memory_empty_cache, peak statistics, a user
 * allocator (no caching, failures reported cleanly, nothing leaked), blocks
 * freed across rank threads, and zeroed allocations of reused blocks.
 * The statistics are process-wide: each test compares before/after. */
#include "tp_test.h"

#define LIMIT_DEFAULT ((size_t)1 << 30)

static void reset(void)
{
    tp_set_allocator(NULL);
    tp_memory_set_cache_limit(TP_CPU, LIMIT_DEFAULT);
    tp_memory_empty_cache(TP_CPU);
}

TestSuite(memory, .init = reset, .fini = reset, .timeout = 60);

static tp_memory_info stats(void)
{
    tp_memory_info s;
    CHECK_OK(tp_memory_stats(TP_CPU, &s));
    return s;
}

static size_t idle(tp_memory_info s) { return s.reserved - s.allocated; }

static tp_tensor *bytes_tensor(int64_t nbytes)
{
    tp_tensor *t = NULL;
    int64_t n = nbytes / 4;
    CHECK_OK(tp_tensor_empty(TP_F32, TP_CPU, 1, &n, &t));
    return t;
}

/* Freed then allocated again with the same size: served from the cache, the
 * same block, and the statistics back where they were. */
static void check_reuse(int64_t nbytes)
{
    tp_tensor *a = bytes_tensor(nbytes);
    void *pa = tp_tensor_data(a);
    tp_memory_info s0 = stats();
    cr_assert_geq(s0.allocated, (size_t)nbytes);
    tp_tensor_release(a);
    tp_memory_info s1 = stats();
    cr_assert_lt(s1.allocated, s0.allocated, "release lowers allocated");
    cr_assert_eq(s1.reserved, s0.reserved, "the block stays reserved in the cache");
    tp_tensor *b = bytes_tensor(nbytes);
    tp_memory_info s2 = stats();
    cr_assert_eq(tp_tensor_data(b), pa, "%lld bytes: the cached block is reused",
                 (long long)nbytes);
    cr_assert_eq(s2.num_allocs, s1.num_allocs + 1);
    cr_assert_eq(s2.num_cache_hits, s1.num_cache_hits + 1, "served from the cache");
    cr_assert_eq(s2.allocated, s0.allocated);
    cr_assert_eq(s2.reserved, s0.reserved);
    cr_assert_eq((uintptr_t)tp_tensor_data(b) % 64, 0, "storage stays 64-byte aligned");
    tp_tensor_release(b);
}

Test(memory, reuse_small_and_large)
{
    check_reuse(100);              /* classes below 1 KiB: capacities rounded to 64 */
    check_reuse(200);
    check_reuse(4000);             /* a small class */
    check_reuse(768 * 1024);       /* a medium class */
    check_reuse(6 * 1024 * 1024);  /* large: the shared best-fit pool */
}

Test(memory, large_best_fit_within_a_quarter)
{
    tp_tensor *a = bytes_tensor(8 << 20);
    void *pa = tp_tensor_data(a);
    tp_tensor_release(a);
    tp_memory_info s0 = stats();
    /* 4 MiB (a freed unsharded weight's half: a shard at 2 ranks) and 6 MiB
     * would leave more than a quarter of the 8 MiB block unused: fresh ones */
    tp_tensor *b = bytes_tensor(4 << 20), *b2 = bytes_tensor(6 << 20);
    cr_assert_neq(tp_tensor_data(b), pa);
    cr_assert_neq(tp_tensor_data(b2), pa);
    cr_assert_eq(stats().num_cache_hits, s0.num_cache_hits);
    cr_assert_eq(stats().allocated, s0.allocated + (10 << 20), "allocated counts 4 + 6 MiB");
    /* 7 MiB fits within a quarter: the 8 MiB block */
    tp_tensor *c = bytes_tensor(7 << 20);
    cr_assert_eq(tp_tensor_data(c), pa);
    cr_assert_eq(stats().num_cache_hits, s0.num_cache_hits + 1);
    tp_tensor_release(b);
    tp_tensor_release(b2);
    tp_tensor_release(c);
}

Test(memory, zeroed_reuse_is_zero)
{
    int64_t n = 3000;
    tp_tensor *a = NULL, *z = NULL;
    CHECK_OK(tp_tensor_empty(TP_F32, TP_CPU, 1, &n, &a));
    CHECK_OK(tp_tensor_fill(a, 7.0));
    void *pa = tp_tensor_data(a);
    tp_tensor_release(a);
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 1, &n, &z));
    cr_assert_eq(tp_tensor_data(z), pa, "the dirty block is reused");
    const float *v = tp_tensor_data(z);
    for (int64_t i = 0; i < n; i++)
        cr_assert_eq(v[i], 0.0f, "element %lld of a zeroed reused block is %g", (long long)i,
                     v[i]);
    tp_tensor_release(z);
}

Test(memory, limit_bounds_idle_bytes)
{
    size_t limit = (size_t)3 << 20;
    CHECK_OK(tp_memory_set_cache_limit(TP_CPU, limit));
    cr_assert_eq(stats().cache_limit, limit);
    tp_tensor *t[16];
    for (int i = 0; i < 8; i++)
        t[i] = bytes_tensor(512 * 1024); /* small classes, this thread's lists */
    for (int i = 8; i < 16; i++)
        t[i] = bytes_tensor(2 << 20); /* large */
    for (int i = 0; i < 16; i++) {
        tp_tensor_release(t[i]);
        cr_assert_leq(idle(stats()), limit, "after %d releases %zu idle bytes > limit", i + 1,
                      idle(stats()));
    }
    cr_assert_gt(idle(stats()), 0, "some blocks are kept");
    /* lowering the limit below what is held empties the cache */
    CHECK_OK(tp_memory_set_cache_limit(TP_CPU, 1024));
    cr_assert_eq(idle(stats()), 0);
    /* limit 0: nothing is cached */
    CHECK_OK(tp_memory_set_cache_limit(TP_CPU, 0));
    tp_memory_info s0 = stats();
    tp_tensor *a = bytes_tensor(4096);
    tp_tensor_release(a);
    a = bytes_tensor(4096);
    tp_tensor_release(a);
    tp_memory_info s1 = stats();
    cr_assert_eq(idle(s1), 0);
    cr_assert_eq(s1.num_allocs, s0.num_allocs + 2);
    cr_assert_eq(s1.num_cache_hits, s0.num_cache_hits);
}

Test(memory, empty_cache_returns_memory)
{
    tp_tensor *a = bytes_tensor(100000), *b = bytes_tensor(5 << 20);
    tp_memory_info s0 = stats();
    tp_tensor_release(a);
    tp_tensor_release(b);
    tp_memory_info s1 = stats();
    cr_assert_eq(s1.reserved, s0.reserved);
    cr_assert_geq(idle(s1), (size_t)(5 << 20) + 100000);
    CHECK_OK(tp_memory_empty_cache(TP_CPU));
    tp_memory_info s2 = stats();
    cr_assert_eq(s2.reserved, s2.allocated, "nothing idle after empty_cache");
    cr_assert_leq(s2.reserved, s1.reserved - ((size_t)(5 << 20) + 100000));
}

Test(memory, stats_and_peak_reset)
{
    CHECK_OK(tp_memory_reset_peak(TP_CPU));
    tp_memory_info s0 = stats();
    cr_assert_eq(s0.peak_allocated, s0.allocated);
    tp_tensor *a = bytes_tensor(1 << 20), *b = bytes_tensor(1 << 20);
    tp_memory_info s1 = stats();
    cr_assert_eq(s1.allocated, s0.allocated + (2u << 20));
    cr_assert_eq(s1.peak_allocated, s1.allocated);
    cr_assert_geq(s1.reserved, s1.allocated);
    cr_assert_eq(s1.num_allocs, s0.num_allocs + 2);
    tp_tensor_release(a);
    tp_tensor_release(b);
    tp_memory_info s2 = stats();
    cr_assert_eq(s2.allocated, s0.allocated);
    cr_assert_eq(s2.peak_allocated, s1.peak_allocated, "the peak stays after release");
    CHECK_OK(tp_memory_reset_peak(TP_CPU));
    cr_assert_eq(stats().peak_allocated, s0.allocated);
}

Test(memory, devices_and_arguments)
{
    tp_memory_info s;
    /* CUDA devices answer through the CUDA memory table (test_cuda.c covers
     * a present device); without one every call names the missing device */
    if (tp_cuda_device_count() == 0) {
        CHECK_ERR(tp_memory_stats(TP_CUDA(0), &s), TP_ERR_NOT_SUPPORTED);
        cr_assert(strstr(tp_last_error(), "CUDA"), "%s", tp_last_error());
        CHECK_ERR(tp_memory_reset_peak(TP_CUDA(0)), TP_ERR_NOT_SUPPORTED);
        CHECK_ERR(tp_memory_empty_cache(TP_CUDA(0)), TP_ERR_NOT_SUPPORTED);
        CHECK_ERR(tp_memory_set_cache_limit(TP_CUDA(0), 0), TP_ERR_NOT_SUPPORTED);
        cr_assert(strstr(tp_last_error(), "CUDA device 0"), "%s", tp_last_error());
    }
    if (TP_HAVE_CUDA) {
        CHECK_ERR(tp_memory_stats(TP_CUDA(-1), &s), TP_ERR_INVALID_ARG);
        cr_assert(strstr(tp_last_error(), "negative"), "%s", tp_last_error());
    }
    CHECK_ERR(tp_memory_stats(TP_CPU, NULL), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "out"), "%s", tp_last_error());
    CHECK_ERR(tp_memory_stats((tp_device){TP_DEVICE_CPU, 1}, &s), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "index"), "%s", tp_last_error());
    CHECK_ERR(tp_memory_empty_cache((tp_device){(tp_device_type)7, 0}), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "device type"), "%s", tp_last_error());
}

/* With a user allocator: no caching (each allocation reaches it, each release
 * frees through it), failures are TP_ERR_NO_MEMORY with nothing leaked. */
Test(memory, user_allocator_no_cache_and_failures)
{
    tp_tensor *before = bytes_tensor(4096);
    tp_tensor_release(before);
    cr_assert_gt(idle(stats()), 0);
    tp_memory_info s0 = stats();
    tp_test_alloc c = {0, 0, -1};
    tp_allocator a = {tp_test_alloc_fn, tp_test_free_fn, &c};
    CHECK_OK(tp_set_allocator(&a));
    cr_assert_eq(idle(stats()), 0, "installing an allocator empties the cache");
    int64_t n = 1000;
    for (long k = 0; k < 3; k++) {
        c.count = 0;
        c.fail_at = k;
        tp_tensor *t = (tp_tensor *)0x1;
        tp_clear_error();
        tp_status st = tp_tensor_zeros(TP_F32, TP_CPU, 1, &n, &t);
        c.fail_at = -1;
        if (st == TP_OK) {
            cr_assert_gt(c.live, 0, "the storage is live in the user allocator");
            tp_tensor_release(t);
            cr_assert_eq(c.live, 0, "release frees through the user allocator at once");
            break;
        }
        cr_assert_eq(st, TP_ERR_NO_MEMORY, "%s", tp_status_name(st));
        cr_assert(strstr(tp_last_error(), "out of memory"), "%s", tp_last_error());
        cr_assert_null(t);
        cr_assert_eq(c.live, 0, "allocation %ld failing leaked", k);
    }
    /* allocate/free twice: both reach the user allocator, no cache hits */
    tp_memory_info s1 = stats();
    long before_count = c.count;
    for (int i = 0; i < 2; i++) {
        tp_tensor *t = bytes_tensor(4096);
        tp_tensor_release(t);
    }
    tp_memory_info s2 = stats();
    cr_assert_geq(c.count - before_count, 4, "tensor objects and storage, twice");
    cr_assert_eq(c.live, 0);
    cr_assert_eq(s2.num_cache_hits, s1.num_cache_hits);
    cr_assert_eq(s2.allocated, s0.allocated);
    cr_assert_eq(idle(s2), 0);
    tp_set_allocator(NULL);
}

/* Rank threads allocate, hand their tensors to the next rank, which checks
 * and frees them (cross-thread frees), round after round; then the same-
 * thread pattern. Everything is back (allocated) afterwards, and rank threads'
 * caches are released when they exit. */
#define XR 8
#define XT 6
typedef struct xshare {
    tp_test_slot slots[TP_TEST_MAX_RANKS];
    tp_tensor *t[TP_TEST_MAX_RANKS][XT];
} xshare;

static tp_status cross_rank(tp_comm *w, void *arg)
{
    xshare *x = arg;
    int r = tp_comm_rank(w), n = tp_comm_size(w);
    tp_test_slot *slot = &x->slots[r];
    static const int64_t sizes[XT] = {16, 25, 1000, 40000, 300000, 1 << 20};
    for (int round = 0; round < 20; round++) {
        for (int i = 0; i < XT; i++) {
            int64_t m = sizes[(i + round) % XT];
            RANK_OK(slot, (round & 1 ? tp_tensor_zeros : tp_tensor_empty)(TP_F32, TP_CPU, 1, &m,
                                                                          &x->t[r][i]));
            if (round & 1) {
                const float *v = tp_tensor_data(x->t[r][i]);
                RANK_EXPECT(slot, v[0] == 0.0f && v[m - 1] == 0.0f, "zeros not zero");
            }
            RANK_OK(slot, tp_tensor_fill(x->t[r][i], r * 100 + round));
        }
        RANK_OK(slot, tp_barrier(w, NULL));
        int from = (r + 1) % n;
        for (int i = 0; i < XT; i++) {
            tp_tensor *t = x->t[from][i];
            const float *v = tp_tensor_data(t);
            int64_t m = tp_tensor_numel(t);
            RANK_EXPECT(slot, v[0] == from * 100 + round && v[m - 1] == from * 100 + round,
                        "round %d: rank %d's tensor %d was overwritten", round, from, i);
            tp_tensor_release(t);
        }
        RANK_OK(slot, tp_barrier(w, NULL));
    }
    for (int round = 0; round < 20; round++) {
        for (int i = 0; i < XT; i++) {
            int64_t m = sizes[(i + round) % XT];
            RANK_OK(slot, tp_tensor_empty(TP_F32, TP_CPU, 1, &m, &x->t[r][i]));
        }
        for (int i = 0; i < XT; i++)
            tp_tensor_release(x->t[r][i]);
    }
    return TP_OK;
}

Test(memory, cross_thread_frees, .timeout = 120)
{
    int sizes[] = {2, 3, 4, XR};
    for (int k = 0; k < 4; k++) {
        CHECK_OK(tp_memory_empty_cache(TP_CPU));
        tp_memory_info s0 = stats();
        xshare *x = calloc(1, sizeof *x);
        tp_test_run(sizes[k], cross_rank, x, x->slots);
        free(x);
        tp_memory_info s1 = stats();
        cr_assert_eq(s1.allocated, s0.allocated, "world %d: live bytes back", sizes[k]);
        cr_assert_gt(s1.num_cache_hits, s0.num_cache_hits, "world %d: blocks were reused",
                     sizes[k]);
        /* what stays idle was freed off its owner thread (shared pool) or by
         * this thread; the exited rank threads' own lists are gone, so the
         * empty below leaves nothing */
        CHECK_OK(tp_memory_empty_cache(TP_CPU));
        cr_assert_eq(idle(stats()), 0);
    }
}

static tp_status same_thread_rank(tp_comm *w, void *arg)
{
    tp_test_slot *slot = &((tp_test_slot *)arg)[tp_comm_rank(w)];
    for (int i = 0; i < 50; i++) {
        int64_t m = 1000 + 8 * tp_comm_rank(w);
        tp_tensor *t = NULL;
        RANK_OK(slot, tp_tensor_empty(TP_F32, TP_CPU, 1, &m, &t));
        tp_tensor_release(t);
    }
    return TP_OK;
}

Test(memory, thread_exit_releases_its_cache)
{
    CHECK_OK(tp_memory_empty_cache(TP_CPU));
    tp_memory_info s0 = stats();
    tp_test_slot slots[4] = {0};
    tp_test_run(4, same_thread_rank, slots, slots);
    tp_memory_info s1 = stats();
    cr_assert_geq(s1.num_cache_hits, s0.num_cache_hits + 4 * 49, "each rank reuses its block");
    cr_assert_eq(idle(s1), idle(s0), "the rank threads' cached blocks left with them");
}
