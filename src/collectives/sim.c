/* The sim backend: one process plays rank `rank` of a world of `world_size`
 * ranks on meta tensors. A collective has nothing to move, so it completes
 * at once; the dispatch layer (comm.c) has validated and recorded it before
 * it gets here, exactly as for a real backend, so comm-debug counts and
 * bytes are those of the real world. A split cannot ask the other ranks
 * which color they chose: it takes the group size from the caller
 * (tp__comm_split_sized, which meshes use) and the key as the new rank. */
#include <string.h>

#include "collectives/coll.h"

typedef struct sim_state {
    int rank, size;
} sim_state;

static tp_status sim_new(int rank, int size, void **out)
{
    sim_state *s = tp__malloc(sizeof *s);
    if (!s)
        return tp__error(TP_ERR_NO_MEMORY, "sim: out of memory for a communicator");
    s->rank = rank;
    s->size = size;
    *out = s;
    return TP_OK;
}

static tp_status sim_init_world(void *options, void **state, int *rank, int *size)
{
    const tp_sim_options *o = options;
    const char *fn = "tp_comm_create_world(\"sim\")";
    TP_ARG_CHECK(o, "%s: options are NULL; pass a tp_sim_options", fn);
    TP_ARG_CHECK(o->world_size >= 1 && o->world_size <= TP_SIM_MAX_WORLD,
                 "%s: world_size %d out of range [1, %d]", fn, o->world_size, TP_SIM_MAX_WORLD);
    TP_ARG_CHECK(o->rank >= 0 && o->rank < o->world_size,
                 "%s: rank %d out of range for world_size %d", fn, o->rank, o->world_size);
    TP_CHECK(sim_new(o->rank, o->world_size, state));
    *rank = o->rank;
    *size = o->world_size;
    return TP_OK;
}

static tp_status sim_collective(void *state, const tp_coll_desc *desc, void **work)
{
    *work = NULL; /* nothing to move: complete on return */
    return TP_OK;
}

static tp_status sim_split(void *state, int color, int key, double timeout_s, void **new_state,
                           int *new_rank, int *new_size)
{
    const sim_state *s = state;
    *new_state = NULL;
    if (color < 0)
        return TP_OK;
    int size = tp__comm_split_size_hint();
    if (size <= 0)
        return tp__error(TP_ERR_NOT_SUPPORTED,
                         "sim: tp_comm_split cannot tell how many of the %d simulated ranks chose "
                         "color %d; build groups with tp_mesh_create / tp_mesh_slice, which "
                         "know their sizes",
                         s->size, color);
    TP_ARG_CHECK(size <= s->size && key >= 0 && key < size,
                 "sim: split into a group of %d ranks (of %d) with key %d: the key must be the "
                 "rank in the group",
                 size, s->size, key);
    TP_CHECK(sim_new(key, size, new_state));
    *new_rank = key;
    *new_size = size;
    return TP_OK;
}

static void sim_free(void *state)
{
    tp__free(state);
}

const tp_backend tp__sim_backend = {
    .name = "sim",
    .device_mask = 1u << TP_DEVICE_META,
    .checks_descriptors = true, /* one rank: nobody to disagree with */
    .collective = sim_collective,
    .split = sim_split,
    .free = sim_free,
    .init_world = sim_init_world,
};

/* ---- playing several ranks ------------------------------------------------ */

static void sim_report_add(tp_sim_report *r, const tp_comm_debug *dbg, int rank)
{
    int64_t total = tp_comm_debug_total(dbg);
    for (int k = 0; k < TP_COLL_KIND_COUNT; k++) {
        int64_t n = tp_comm_debug_count(dbg, (tp_coll_kind)k);
        int64_t b = tp_comm_debug_bytes(dbg, (tp_coll_kind)k);
        if (r->ranks_played == 0 || n > r->max_count[k]) {
            r->max_count[k] = n;
            r->max_count_rank[k] = rank;
        }
        if (r->ranks_played == 0 || b > r->max_bytes[k]) {
            r->max_bytes[k] = b;
            r->max_bytes_rank[k] = rank;
        }
    }
    if (r->ranks_played == 0 || total > r->max_total) {
        r->max_total = total;
        r->max_total_rank = rank;
    }
    r->ranks_played++;
}

static tp_status sim_play(int world_size, int rank, tp_rank_fn fn, void *arg, tp_comm_debug *dbg)
{
    tp_sim_options o = {.world_size = world_size, .rank = rank};
    tp_comm *w = NULL;
    TP_CHECK(tp_comm_create_world("sim", &o, &w));
    tp_status st = tp_comm_debug_begin(dbg);
    if (st == TP_OK) {
        st = fn(w, arg);
        tp_status e = tp_comm_debug_end(dbg);
        st = st != TP_OK ? st : e;
    }
    tp_comm_free(w);
    return st;
}

tp_status tp_sim_each_rank(int world_size, int nranks, const int *ranks, tp_rank_fn fn, void *arg,
                           tp_sim_report *out)
{
    const char *fn_name = "tp_sim_each_rank";
    TP_ARG_CHECK(out, "%s: out is NULL", fn_name);
    memset(out, 0, sizeof *out);
    TP_ARG_CHECK(fn, "%s: fn is NULL", fn_name);
    TP_ARG_CHECK(world_size >= 1 && world_size <= TP_SIM_MAX_WORLD,
                 "%s: world_size %d out of range [1, %d]", fn_name, world_size, TP_SIM_MAX_WORLD);
    TP_ARG_CHECK(!ranks || nranks >= 1, "%s: %d ranks", fn_name, nranks);
    int n = ranks ? nranks : world_size;
    for (int i = 0; ranks && i < n; i++)
        TP_ARG_CHECK(ranks[i] >= 0 && ranks[i] < world_size,
                     "%s: ranks[%d] = %d out of range for world_size %d", fn_name, i, ranks[i],
                     world_size);
    tp_comm_debug *dbg = NULL;
    TP_CHECK(tp_comm_debug_create(&dbg));
    tp_status st = TP_OK;
    for (int i = 0; i < n && st == TP_OK; i++) {
        int r = ranks ? ranks[i] : i;
        st = sim_play(world_size, r, fn, arg, dbg);
        if (st == TP_OK)
            sim_report_add(out, dbg, r);
        else
            tp__error_prefix("sim rank %d", r);
    }
    tp_comm_debug_free(dbg);
    return st;
}
