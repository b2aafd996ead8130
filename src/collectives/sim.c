/* The sim backend: one process plays rank `rank` of a world of `world_size`
 * ranks on meta tensors. A collective has nothing to move, so it completes
 * at once; the dispatch layer (comm.c) has validated and recorded it before
 * it gets here, exactly as for a real backend, so comm-debug counts and
 * bytes are those of the real world. A split cannot ask the other ranks
 * which color they chose: it takes the group size from the caller
 * (tp__comm_split_sized, which meshes use) and the key as the new rank. */
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
