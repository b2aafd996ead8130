/* Data parallelism, internal: the step graph shared by the passes (graph.c)
 * and the DDP executor (ddp.c). Not installed. */
#ifndef TP_DP_INTERNAL_H
#define TP_DP_INTERNAL_H

#include "core/core.h"
#include "tp/dp.h"

typedef enum tp__gnode_kind {
    TP__G_READY = 0,  /* arg: parameter */
    TP__G_COPY_IN,    /* arg: bucket */
    TP__G_ALL_REDUCE, /* arg: bucket */
    TP__G_WAIT,       /* arg: bucket */
    TP__G_COPY_OUT,   /* arg: bucket */
    TP__G_STEP        /* arg: unused */
} tp__gnode_kind;

typedef struct tp__gnode {
    tp__gnode_kind kind;
    int arg;
} tp__gnode;

typedef struct tp__gbucket {
    int first, count; /* a run of the ready order */
    int64_t numel;    /* elements over its parameters */
} tp__gbucket;

struct tp_step_graph {
    int n;              /* parameters */
    int64_t *numel;     /* per parameter (registration order) */
    tp_dtype *dtype;    /* the bucket dtype: what the all_reduce moves */
    bool *converts;     /* the gradient has another dtype (reduce_dtype): copied
                         * into and out of its bucket, never a view */
    int *devkey;        /* device type * 65536 + index: buckets never mix devices */
    char **names;       /* per parameter, for tp_step_graph_write */
    int *order;         /* ready order: parameter indices */
    int64_t *offset;    /* element offset of each parameter in its bucket */
    int *bucket_of;     /* parameter -> bucket */
    tp__gbucket *buckets;
    int nb;
    tp__gnode *nodes;
    int nn;
    size_t cap_bytes;
    /* the schedule is a function of these and the order */
    bool fused, late, views;
    const tp_pass **applied;
    int n_applied;
    size_t cap_applied;
    int version;        /* bumped whenever the schedule changes */
    tp_ddp *owner;      /* NULL for a standalone graph */
};

/* A graph over n parameters (all arrays copied), plain schedule. Refuses
 * (TP_ERR_INVALID_ARG, errors prefixed with fn) sizes that are negative or
 * whose byte counts, alone or summed over the parameters, exceed a 64-bit
 * (and size_t) byte count, so that no bucket size or offset can overflow. */
tp_status tp__graph_new(const char *fn, int n, const int64_t *numel, const tp_dtype *dtype,
                        const int *devkey, const char *const *names, size_t cap_bytes,
                        tp_step_graph **out);
/* Rebuilds buckets and nodes from the order and the flags. */
tp_status tp__graph_rebuild(tp_step_graph *g);
/* Installs a new ready order (a permutation) and rebuilds. */
tp_status tp__graph_set_order(tp_step_graph *g, const int *order);

/* ddp.c: whether a step is in progress (passes are refused then). */
bool tp__ddp_in_step(const tp_ddp *ddp);

#endif /* TP_DP_INTERNAL_H */
