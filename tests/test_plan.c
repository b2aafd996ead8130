/* Plan traces and the step-time walk (tp/plan.h): traces built by hand whose
 * step times are worked out by hand (compute, a synchronous collective,
 * an asynchronous bucket hidden behind compute and its exposed remainder),
 * what the meta engine and a simulated world record, the Chrome trace
 * output, and bad events and calls with the problem named. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tp_test.h"

/* Round numbers: 4 devices per node; f32 peak 1e12 at efficiency 0.5;
 * 1e9 B/s memory; no kernel latency; intra-node links free of latency at
 * 1e9 B/s, inter-node ones 1e-6 s per step at 1e8 B/s, both ring. */
static const char *const hw_json =
    "{\"name\": \"round\", \"devices_per_node\": 4,"
    " \"compute\": {\"peak_flops\": {\"f32\": 1e12},"
    "   \"gemm_efficiency\": [{\"min_dim\": 0, \"efficiency\": 0.5}],"
    "   \"memory_bandwidth\": 1e9, \"kernel_latency\": 0},"
    " \"links\": {\"intra_node\": {\"latency\": 0, \"bandwidth\": 1e9, \"algorithm\": \"ring\"},"
    "   \"inter_node\": {\"latency\": 1e-6, \"bandwidth\": 1e8, \"algorithm\": \"ring\"}}}";

static tp_hw *round_hw(void)
{
    tp_hw *hw = NULL;
    cr_assert_eq(tp_hw_load_string(hw_json, "round", &hw), TP_OK, "%s", tp_last_error());
    return hw;
}

static void near(double got, double want, const char *what)
{
    cr_assert(fabs(got - want) <= 1e-12 * fmax(1.0, fabs(want)), "%s: %.15g, expected %.15g", what,
              got, want);
}

static void add_gemm(tp_plan_trace *t, int64_t m, int64_t n, int64_t k)
{
    tp_plan_event e = {.kind = TP_PLAN_GEMM, .dtype = TP_F32, .m = m, .n = n, .k = k};
    cr_assert_eq(tp_plan_trace_add(t, &e), TP_OK, "%s", tp_last_error());
}

static void add_ew(tp_plan_trace *t, uint64_t bytes, tp_plan_phase phase)
{
    tp_plan_event e = {.kind = TP_PLAN_ELEMENTWISE, .phase = phase, .bytes = bytes};
    cr_assert_eq(tp_plan_trace_add(t, &e), TP_OK, "%s", tp_last_error());
}

static void add_coll(tp_plan_trace *t, uint64_t id, int g, int64_t stride, uint64_t bytes,
                     bool async)
{
    tp_plan_event e = {.kind = TP_PLAN_COLLECTIVE,
                       .coll = TP_COLL_ALL_REDUCE,
                       .group_size = g,
                       .first_rank = 0,
                       .rank_stride = stride,
                       .bytes = bytes,
                       .async = async,
                       .id = id};
    cr_assert_eq(tp_plan_trace_add(t, &e), TP_OK, "%s", tp_last_error());
}

static void add_wait(tp_plan_trace *t, uint64_t id)
{
    tp_plan_event e = {.kind = TP_PLAN_WAIT, .id = id};
    cr_assert_eq(tp_plan_trace_add(t, &e), TP_OK, "%s", tp_last_error());
}

/* gemm 1000^3: 2e9 / (1e12 * 0.5) = 4 ms; 1e6 bytes element-wise: 1 ms;
 * all_reduce of 4e6 bytes over ranks 0..3 (one node, ring):
 * 2 * 3/4 * 4e6 / 1e9 = 6 ms, exposed entirely. */
Test(plan, walk_sync_by_hand, .timeout = 30)
{
    tp_hw *hw = round_hw();
    tp_plan_trace *t = NULL;
    cr_assert_eq(tp_plan_trace_create(&t), TP_OK);
    add_gemm(t, 1000, 1000, 1000);
    add_ew(t, 1000000, TP_PLAN_BACKWARD);
    add_coll(t, 1, 4, 1, 4000000, false);
    tp_plan_result r;
    cr_assert_eq(tp_plan_walk(t, hw, &r), TP_OK, "%s", tp_last_error());
    near(r.compute_s, 5e-3, "compute");
    near(r.comm_s, 6e-3, "comm");
    near(r.exposed_comm_s, 6e-3, "exposed");
    near(r.step_s, 11e-3, "step");
    near(r.phase_s[TP_PLAN_FORWARD], 4e-3, "forward");
    near(r.phase_s[TP_PLAN_BACKWARD], 1e-3, "backward");
    near(r.gemm_flops, 2e9, "flops");
    near(r.mfu, 2e9 / 11e-3 / 1e12, "mfu");
    cr_assert_eq(r.gemms, 1);
    cr_assert_eq(r.elementwise, 1);
    cr_assert_eq(r.collectives, 1);
    cr_assert_eq(r.coll_count[TP_COLL_ALL_REDUCE], 1);
    cr_assert_eq(r.coll_bytes[TP_COLL_ALL_REDUCE], 4000000);
    near(r.coll_s[TP_COLL_ALL_REDUCE], 6e-3, "all_reduce time");
    tp_plan_trace_free(t);
    tp_hw_free(hw);
}

/* A 4 ms GEMM, an asynchronous bucket over ranks 0 and 4, another 4 ms GEMM
 * and 1 ms of element-wise work, then the wait on the bucket. */
static tp_plan_trace *bucket_trace(void)
{
    tp_plan_trace *t = NULL;
    cr_assert_eq(tp_plan_trace_create(&t), TP_OK);
    add_gemm(t, 1000, 1000, 1000);
    add_coll(t, 1, 2, 4, 1000000, true);
    add_gemm(t, 1000, 1000, 1000);
    add_ew(t, 1000000, TP_PLAN_BACKWARD);
    add_wait(t, 1);
    return t;
}

/* An asynchronous bucket over ranks 0 and 4 (two nodes: inter-node ring,
 * 2 steps * 1e-6 + 2 * 1/2 * 1e6 / 1e8 = 10.002 ms) issued after a 4 ms
 * GEMM: it runs beside the next 4 ms GEMM and 1 ms of element-wise work,
 * and the wait at 9 ms exposes the rest, 14.002 - 9 = 5.002 ms. A second
 * bucket issued then, never waited on, starts when the link is free and
 * ends the step: 4 ms of compute after the wait hide 4 of its 10.002 ms. */
Test(plan, walk_async_bucket_overlap, .timeout = 30)
{
    tp_hw *hw = round_hw();
    tp_plan_trace *t = bucket_trace();
    tp_plan_result r;
    cr_assert_eq(tp_plan_walk(t, hw, &r), TP_OK, "%s", tp_last_error());
    near(r.compute_s, 9e-3, "compute");
    near(r.comm_s, 10.002e-3, "comm");
    near(r.exposed_comm_s, 5.002e-3, "exposed");
    near(r.step_s, 14.002e-3, "step");
    cr_assert_eq(r.waits, 1);

    add_coll(t, 2, 2, 4, 1000000, true);
    add_gemm(t, 1000, 1000, 1000);
    cr_assert_eq(tp_plan_walk(t, hw, &r), TP_OK, "%s", tp_last_error());
    near(r.compute_s, 13e-3, "compute");
    near(r.comm_s, 20.004e-3, "comm");
    near(r.exposed_comm_s, 5.002e-3 + 6.002e-3, "exposed");
    near(r.step_s, 24.004e-3, "step");
    tp_plan_trace_free(t);
    tp_hw_free(hw);
}

/* The same trace on links without async progress (CPU backends: data moves
 * only inside the wait): the first bucket moves at its wait at 9 ms, all
 * 10.002 ms exposed; the second, never waited on, after the last GEMM at
 * 23.002 ms, 10.002 ms more. The bucket's span is empty at its issue. */
Test(plan, walk_async_without_progress_moves_at_the_wait, .timeout = 30)
{
    char *json = strdup(hw_json);
    for (char *at = json; (at = strstr(at, "\"algorithm\": \"ring\"")) != NULL; at++) {
        size_t n = strlen(json) + 32;
        char *next = malloc(n);
        snprintf(next, n, "%.*s\"algorithm\": \"ring\", \"async_progress\": false%s",
                 (int)(at - json), json, at + strlen("\"algorithm\": \"ring\""));
        at = next + (at - json) + 1;
        free(json);
        json = next;
    }
    tp_hw *hw = NULL;
    cr_assert_eq(tp_hw_load_string(json, "no-progress", &hw), TP_OK, "%s", tp_last_error());
    cr_assert(!tp_hw_async_progress(hw, TP_LINK_INTRA_NODE) &&
              !tp_hw_async_progress(hw, TP_LINK_INTER_NODE));
    tp_hw *on = round_hw();
    cr_assert(tp_hw_async_progress(on, TP_LINK_INTER_NODE), "async progress is the default");
    cr_assert(!tp_hw_async_progress(NULL, TP_LINK_INTRA_NODE));
    cr_assert(!tp_hw_async_progress(on, (tp_link_class)2));
    tp_plan_trace *t = bucket_trace();
    tp_plan_result r;
    cr_assert_eq(tp_plan_walk(t, hw, &r), TP_OK, "%s", tp_last_error());
    near(r.compute_s, 9e-3, "compute");
    near(r.comm_s, 10.002e-3, "comm");
    near(r.exposed_comm_s, 10.002e-3, "exposed");
    near(r.step_s, 19.002e-3, "step");
    add_coll(t, 2, 2, 4, 1000000, true);
    add_gemm(t, 1000, 1000, 1000);
    cr_assert_eq(tp_plan_walk(t, hw, &r), TP_OK, "%s", tp_last_error());
    near(r.compute_s, 13e-3, "compute");
    near(r.exposed_comm_s, 20.004e-3, "exposed");
    near(r.step_s, 33.004e-3, "step");
    /* written out, the flag stays */
    char *buf = NULL;
    size_t len = 0;
    FILE *mem = open_memstream(&buf, &len);
    cr_assert_eq(tp_hw_write_json(hw, mem), TP_OK);
    fclose(mem);
    cr_assert(strstr(buf, "\"async_progress\": false"), "%s", buf);
    free(buf);
    free(json);
    tp_plan_trace_free(t);
    tp_hw_free(on);
    tp_hw_free(hw);
}

/* A synchronous collective waits for the link: issued while a 10.002 ms
 * bucket runs from 4 ms, a 6 ms intra-node all_reduce starts at 14.002 ms. */
Test(plan, walk_sync_after_async_waits_for_the_link, .timeout = 30)
{
    tp_hw *hw = round_hw();
    tp_plan_trace *t = NULL;
    cr_assert_eq(tp_plan_trace_create(&t), TP_OK);
    add_gemm(t, 1000, 1000, 1000);
    add_coll(t, 7, 2, 4, 1000000, true);
    add_coll(t, 8, 4, 1, 4000000, false);
    add_wait(t, 7);
    tp_plan_result r;
    cr_assert_eq(tp_plan_walk(t, hw, &r), TP_OK, "%s", tp_last_error());
    near(r.step_s, 20.002e-3, "step");
    near(r.exposed_comm_s, 16.002e-3, "exposed");
    tp_plan_trace_free(t);
    tp_hw_free(hw);
}

/* Rank 6 of a simulated 2 x 4 (dp x tp) world: what the meta engine and the
 * dispatch layer record, with each group placed in the world. */
Test(plan, records_meta_kernels_and_sim_collectives, .timeout = 60)
{
    tp_comm *world = NULL;
    tp_mesh *mesh = NULL;
    tp_sim_options so = {.world_size = 8, .rank = 6};
    cr_assert_eq(tp_comm_create_world("sim", &so, &world), TP_OK, "%s", tp_last_error());
    const char *names[2] = {"dp", "tp"};
    cr_assert_eq(tp_mesh_create(world, 2, (int64_t[]){2, 4}, names, &mesh), TP_OK, "%s",
                 tp_last_error());
    tp_tensor *a = NULL, *b = NULL, *y = NULL, *buf = NULL;
    cr_assert_eq(tp_tensor_empty(TP_F32, TP_META, 2, (int64_t[]){64, 32}, &a), TP_OK);
    cr_assert_eq(tp_tensor_empty(TP_F32, TP_META, 2, (int64_t[]){32, 16}, &b), TP_OK);
    cr_assert_eq(tp_tensor_empty(TP_F32, TP_META, 1, (int64_t[]){100}, &buf), TP_OK);
    tp_plan_trace *t = NULL;
    cr_assert_eq(tp_plan_trace_create(&t), TP_OK);
    cr_assert_eq(tp_plan_trace_begin(t), TP_OK);
    cr_assert_eq(tp_matmul(a, b, &y), TP_OK, "%s", tp_last_error());
    cr_assert_eq(tp_all_reduce(tp_mesh_comm(mesh, 1), buf, buf, TP_SUM, NULL), TP_OK);
    tp_work *w = NULL;
    cr_assert_eq(tp_all_reduce(tp_mesh_comm(mesh, 0), buf, buf, TP_SUM, &w), TP_OK);
    cr_assert_eq(tp_work_wait(w), TP_OK);
    tp_work_free(w);
    cr_assert_eq(tp_plan_trace_end(t), TP_OK);
    /* not recorded after the end */
    cr_assert_eq(tp_all_reduce(tp_mesh_comm(mesh, 1), buf, buf, TP_SUM, NULL), TP_OK);

    cr_assert_eq(tp_plan_trace_count(t), 4);
    const tp_plan_event *e = tp_plan_trace_event(t, 0);
    cr_assert_eq(e->kind, TP_PLAN_GEMM);
    cr_assert(e->m == 64 && e->n == 16 && e->k == 32, "gemm %lld x %lld x %lld", (long long)e->m,
              (long long)e->n, (long long)e->k);
    cr_assert_eq(e->phase, TP_PLAN_FORWARD);
    e = tp_plan_trace_event(t, 1); /* tp group of rank 6: ranks 4..7 */
    cr_assert_eq(e->kind, TP_PLAN_COLLECTIVE);
    cr_assert(e->group_size == 4 && e->first_rank == 4 && e->rank_stride == 1 && !e->async);
    cr_assert_eq(e->bytes, 400);
    e = tp_plan_trace_event(t, 2); /* dp group of rank 6: ranks 2 and 6 */
    cr_assert(e->group_size == 2 && e->first_rank == 2 && e->rank_stride == 4 && e->async);
    uint64_t id = e->id;
    cr_assert(id > 0);
    e = tp_plan_trace_event(t, 3);
    cr_assert(e->kind == TP_PLAN_WAIT && e->id == id);
    cr_assert_null(tp_plan_trace_event(t, 4));

    /* on the round hardware: 2*64*16*32 / 5e11; 2*3/4*400/1e9; the dp
     * group spans nodes 0 and 1: 2e-6 + 400/1e8, fully exposed at the wait */
    tp_hw *hw = round_hw();
    tp_plan_result r;
    cr_assert_eq(tp_plan_walk(t, hw, &r), TP_OK, "%s", tp_last_error());
    double g = 2.0 * 64 * 16 * 32 / 5e11, c1 = 1.5 * 400 / 1e9, c2 = 2e-6 + 400 / 1e8;
    near(r.step_s, g + c1 + c2, "step");
    near(r.exposed_comm_s, c1 + c2, "exposed");
    tp_hw_free(hw);
    tp_plan_trace_free(t);
    tp_tensor_release(y);
    tp_tensor_release(a);
    tp_tensor_release(b);
    tp_tensor_release(buf);
    tp_mesh_free(mesh);
    cr_assert_eq(tp_comm_free(world), TP_OK);
}

Test(plan, chrome_trace_has_both_lanes, .timeout = 30)
{
    tp_hw *hw = round_hw();
    tp_plan_trace *t = NULL;
    cr_assert_eq(tp_plan_trace_create(&t), TP_OK);
    add_gemm(t, 1000, 1000, 1000);
    add_coll(t, 1, 2, 4, 1000000, true);
    add_gemm(t, 1000, 1000, 1000);
    add_wait(t, 1);
    FILE *f = tmpfile();
    cr_assert(f);
    cr_assert_eq(tp_plan_write_chrome_trace(t, hw, 3, f), TP_OK, "%s", tp_last_error());
    rewind(f);
    char buf[4096];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = 0;
    fclose(f);
    cr_assert(strncmp(buf, "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[", 38) == 0, "%s", buf);
    /* the bucket: on lane 1 from 4 ms for 10.002 ms; the wait exposes 6.002 ms */
    cr_assert(strstr(buf, "\"name\":\"all_reduce\",\"cat\":\"forward\",\"ph\":\"X\",\"pid\":3,"
                          "\"tid\":1,\"ts\":4000.000,\"dur\":10002.000"),
              "%s", buf);
    cr_assert(strstr(buf, "\"name\":\"gemm\",\"cat\":\"forward\",\"ph\":\"X\",\"pid\":3,\"tid\":0,"
                          "\"ts\":4000.000,\"dur\":4000.000"),
              "%s", buf);
    cr_assert(strstr(buf, "\"name\":\"wait\",\"cat\":\"forward\",\"ph\":\"X\",\"pid\":3,\"tid\":0,"
                          "\"ts\":8000.000,\"dur\":6002.000"),
              "%s", buf);
    cr_assert(strstr(buf, "\n]}\n"), "%s", buf);
    tp_plan_trace_free(t);
    tp_hw_free(hw);
}

static void expect_add_error(tp_plan_trace *t, tp_plan_event e, const char *needle)
{
    cr_assert_eq(tp_plan_trace_add(t, &e), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), needle), "'%s' not in: %s", needle, tp_last_error());
}

Test(plan, bad_events_and_calls_are_named, .timeout = 30)
{
    tp_plan_trace *t = NULL, *u = NULL;
    cr_assert_eq(tp_plan_trace_create(&t), TP_OK);
    cr_assert_eq(tp_plan_trace_create(&u), TP_OK);
    expect_add_error(t, (tp_plan_event){.kind = TP_PLAN_GEMM, .m = -1}, "m, n, k must be >= 0");
    expect_add_error(t, (tp_plan_event){.kind = TP_PLAN_COLLECTIVE, .group_size = 0, .id = 1},
                     "group_size must be >= 1, got 0");
    expect_add_error(
        t, (tp_plan_event){.kind = TP_PLAN_COLLECTIVE, .group_size = 2, .rank_stride = 1, .id = 0},
        "collective id 0");
    expect_add_error(t, (tp_plan_event){.kind = TP_PLAN_WAIT, .id = 5}, "wait on id 5");
    expect_add_error(t, (tp_plan_event){.kind = (tp_plan_event_kind)9}, "event kind 9");
    add_coll(t, 3, 2, 1, 8, false);
    expect_add_error(t, (tp_plan_event){.kind = TP_PLAN_WAIT, .id = 3}, "no earlier asynchronous");
    cr_assert_eq(tp_plan_trace_count(t), 1);

    cr_assert_eq(tp_plan_trace_begin(t), TP_OK);
    cr_assert_eq(tp_plan_trace_begin(u), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "active on this thread already"), "%s", tp_last_error());
    cr_assert_eq(tp_plan_trace_end(u), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "not the active one"), "%s", tp_last_error());
    cr_assert_eq(tp_plan_trace_end(t), TP_OK);

    /* a dtype the description has no peak for */
    tp_hw *hw = round_hw();
    tp_plan_event e = {.kind = TP_PLAN_GEMM, .dtype = TP_F64, .m = 2, .n = 2, .k = 2};
    cr_assert_eq(tp_plan_trace_add(t, &e), TP_OK);
    tp_plan_result r;
    cr_assert_eq(tp_plan_walk(t, hw, &r), TP_ERR_NOT_SUPPORTED);
    cr_assert(strstr(tp_last_error(), "event 1"), "%s", tp_last_error());
    cr_assert_eq(tp_plan_walk(NULL, hw, &r), TP_ERR_INVALID_ARG);
    tp_hw_free(hw);
    tp_plan_trace_free(t);
    tp_plan_trace_free(u);
}

static void *failing_alloc(void *ctx, size_t size, size_t alignment)
{
    return NULL;
}

static void plain_free(void *ctx, void *ptr)
{
    free(ptr);
}

/* Out of memory: creating and adding report it; a recording that cannot be
 * stored is reported by the end, and the events before it stay. */
Test(plan, out_of_memory_is_reported, .timeout = 30)
{
    tp_comm *world = NULL;
    tp_sim_options so = {.world_size = 4, .rank = 1};
    cr_assert_eq(tp_comm_create_world("sim", &so, &world), TP_OK, "%s", tp_last_error());
    tp_tensor *buf = NULL;
    cr_assert_eq(tp_tensor_empty(TP_F32, TP_META, 1, (int64_t[]){16}, &buf), TP_OK);
    tp_plan_trace *t = NULL;
    cr_assert_eq(tp_plan_trace_create(&t), TP_OK);
    add_gemm(t, 1, 1, 1); /* the first block of events */

    tp_allocator none = {failing_alloc, plain_free, NULL};
    cr_assert_eq(tp_set_allocator(&none), TP_OK);
    tp_plan_trace *u = (tp_plan_trace *)0x1;
    tp_status created = tp_plan_trace_create(&u);
    tp_status begun = tp_plan_trace_begin(t);
    tp_status reduced = TP_OK;
    for (int i = 0; i < 64 && reduced == TP_OK; i++) /* past the first block */
        reduced = tp_all_reduce(world, buf, buf, TP_SUM, NULL);
    tp_status ended = tp_plan_trace_end(t);
    char msg[256];
    snprintf(msg, sizeof msg, "%s", tp_last_error());
    tp_set_allocator(NULL);

    cr_assert_eq(created, TP_ERR_NO_MEMORY);
    cr_assert_null(u);
    cr_assert_eq(begun, TP_OK);
    cr_assert_eq(reduced, TP_OK, "%s", tp_status_name(reduced));
    cr_assert_eq(ended, TP_ERR_NO_MEMORY);
    cr_assert(strstr(msg, "were not recorded"), "%s", msg);
    size_t n = tp_plan_trace_count(t);
    cr_assert(n >= 1 && n < 65, "%zu events", n);
    cr_assert_eq(tp_plan_trace_event(t, 0)->kind, TP_PLAN_GEMM);
    tp_plan_trace_free(t);
    tp_tensor_release(buf);
    cr_assert_eq(tp_comm_free(world), TP_OK);
}

/* A copy onto a meta tensor moves nothing but costs its time in a planned
 * step (DDP's bucket copies go through tp_tensor_copy): one element-wise
 * event of dst's elements, read and written; none outside a trace. */
Test(plan, records_copies_onto_meta, .timeout = 30)
{
    int64_t shape[2] = {3, 5};
    tp_tensor *a = NULL, *b = NULL;
    cr_assert_eq(tp_tensor_empty(TP_F32, TP_META, 2, shape, &a), TP_OK, "%s", tp_last_error());
    cr_assert_eq(tp_tensor_empty(TP_BF16, TP_META, 2, shape, &b), TP_OK, "%s", tp_last_error());
    tp_plan_trace *t = NULL;
    cr_assert_eq(tp_plan_trace_create(&t), TP_OK);
    cr_assert_eq(tp_tensor_copy(b, a), TP_OK, "%s", tp_last_error()); /* no trace yet */
    cr_assert_eq(tp_plan_trace_begin(t), TP_OK);
    cr_assert_eq(tp_tensor_copy(b, a), TP_OK, "%s", tp_last_error());
    cr_assert_eq(tp_plan_trace_end(t), TP_OK);
    cr_assert_eq(tp_tensor_copy(b, a), TP_OK, "%s", tp_last_error()); /* after it */
    cr_assert_eq(tp_plan_trace_count(t), 1);
    const tp_plan_event *e = tp_plan_trace_event(t, 0);
    cr_assert_eq(e->kind, TP_PLAN_ELEMENTWISE);
    cr_assert_eq(e->bytes, 15u * 2u * 2u, "15 bf16 elements read and written: %llu bytes",
                 (unsigned long long)e->bytes);
    tp_plan_trace_free(t);
    tp_tensor_release(a);
    tp_tensor_release(b);
}

/* ---- the TP MLP with net1's GELU fused -------------------------------------------
 * Rank 1 of a simulated world of 4, on meta: net1 (64 -> 256) colwise, net2
 * (256 -> 64) rowwise, 128 rows. Fused, net2's backward takes net1's GELU
 * backward into its product (its gradient reaches net1 through from_local
 * and to_local untouched), so the backward has no GELU-backward sweep over
 * the rank's [128, 64] (three arrays: the GELU's input, the incoming
 * gradient, its own); the unfused MLP has one. */
static int gelu_bwd_sweeps(bool fused)
{
    tp_comm *world = NULL;
    tp_mesh *mesh = NULL;
    tp_sim_options so = {.world_size = 4, .rank = 1};
    cr_assert_eq(tp_comm_create_world("sim", &so, &world), TP_OK, "%s", tp_last_error());
    cr_assert_eq(tp_mesh_create(world, 1, (int64_t[]){4}, NULL, &mesh), TP_OK);
    cr_assert_eq(tp_nn_set_default_device(TP_META), TP_OK);
    tp_module *m = NULL, *a = NULL, *g = NULL, *b = NULL;
    cr_assert_eq(tp_nn_sequential_create(&m), TP_OK);
    cr_assert_eq(tp_nn_linear_create(64, 256, true, &a), TP_OK);
    if (fused)
        cr_assert_eq(tp_nn_linear_fuse_gelu(a, TP_GELU_TANH), TP_OK);
    cr_assert_eq(tp_module_add_child(m, "net1", a), TP_OK);
    if (!fused) {
        cr_assert_eq(tp_nn_gelu_create(TP_GELU_TANH, &g), TP_OK);
        cr_assert_eq(tp_module_add_child(m, "act", g), TP_OK);
    }
    cr_assert_eq(tp_nn_linear_create(256, 64, true, &b), TP_OK);
    cr_assert_eq(tp_module_add_child(m, "net2", b), TP_OK);
    tp_nn_set_default_device(TP_CPU);
    tp_style *cs = NULL, *rs = NULL;
    cr_assert_eq(tp_colwise_parallel_create(NULL, &cs), TP_OK);
    cr_assert_eq(tp_rowwise_parallel_create(NULL, &rs), TP_OK);
    tp_plan_entry plan[2] = {{"net1", cs}, {"net2", rs}};
    tp_parallelize_options po = {.src_data_rank = TP_SRC_DATA_RANK_NONE};
    cr_assert_eq(tp_parallelize_module(m, mesh, 2, plan, &po), TP_OK, "%s", tp_last_error());
    tp_style_free(cs);
    tp_style_free(rs);
    tp_tensor *x = NULL, *y = NULL, *l = NULL;
    cr_assert_eq(tp_tensor_empty(TP_F32, TP_META, 2, (int64_t[]){128, 64}, &x), TP_OK);
    tp_plan_trace *t = NULL;
    cr_assert_eq(tp_plan_trace_create(&t), TP_OK);
    cr_assert_eq(tp_plan_trace_begin(t), TP_OK);
    cr_assert_eq(tp_module_call(m, x, &y), TP_OK, "%s", tp_last_error());
    cr_assert_eq(tp_sum_all(y, &l), TP_OK, "%s", tp_last_error());
    cr_assert_eq(tp_backward(l, NULL), TP_OK, "%s", tp_last_error());
    cr_assert_eq(tp_plan_trace_end(t), TP_OK);
    int sweeps = 0, gemms = 0;
    for (size_t i = 0; i < tp_plan_trace_count(t); i++) {
        const tp_plan_event *e = tp_plan_trace_event(t, i);
        if (e->phase != TP_PLAN_BACKWARD)
            continue;
        gemms += e->kind == TP_PLAN_GEMM;
        sweeps += e->kind == TP_PLAN_ELEMENTWISE && e->bytes == 128 * 64 * 4 * 3;
    }
    /* either way net2's two products and net1's weight gradient (x needs none) */
    cr_assert_eq(gemms, 3, "%s: %d products in the backward", fused ? "fused" : "unfused", gemms);
    tp_plan_trace_free(t);
    tp_tensor_release(l);
    tp_tensor_release(y);
    tp_tensor_release(x);
    tp_module_free(m);
    tp_mesh_free(mesh);
    cr_assert_eq(tp_comm_free(world), TP_OK);
    return sweeps;
}

Test(plan, fused_gelu_mlp_backward_has_no_gelu_sweep, .timeout = 30)
{
    cr_assert_eq(gelu_bwd_sweeps(false), 1, "the unfused MLP's GELU backward");
    cr_assert_eq(gelu_bwd_sweeps(true), 0, "the fused MLP still sweeps for its GELU backward");
}
