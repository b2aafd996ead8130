/* The step graph of data parallelism and the passes over it: bucket fusion,
 * late waits, removal of the bucket copies, and the ordering rules between
 * passes (prerequisites, apply-after). */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "dp/dp_internal.h"

#define TP__DEFAULT_CAP ((size_t)25 << 20) /* PyTorch DDP's bucket_cap_mb */

/* ---- construction ---------------------------------------------------------- */

/* A DDP's graph belongs to the DDP (tp_ddp_free clears owner first):
 * freeing it here would leave the DDP with a dangling graph, so the call is
 * a no-op, as tp_module_free is on a child. */
void tp_step_graph_free(tp_step_graph *g)
{
    if (!g || g->owner)
        return;
    for (int i = 0; g->names && i < g->n; i++)
        tp__free(g->names[i]);
    tp__free(g->names);
    tp__free(g->numel);
    tp__free(g->dtype);
    tp__free(g->converts);
    tp__free(g->devkey);
    tp__free(g->order);
    tp__free(g->offset);
    tp__free(g->bucket_of);
    tp__free(g->buckets);
    tp__free(g->nodes);
    tp__free(g->applied);
    tp__free(g);
}

/* The largest byte count a bucket may reach: its offsets and sizes are
 * int64_t elements and its capacity arithmetic size_t bytes. */
#define TP__MAX_BYTES ((uint64_t)SIZE_MAX < (uint64_t)INT64_MAX ? (uint64_t)SIZE_MAX \
                                                                : (uint64_t)INT64_MAX)

static tp_status tp__check_sizes(const char *fn, int n, const int64_t *numel,
                                 const tp_dtype *dtype, const char *const *names)
{
    uint64_t total = 0;
    for (int i = 0; i < n; i++) {
        char buf[24];
        snprintf(buf, sizeof buf, "param%d", i);
        const char *name = names && names[i] ? names[i] : buf;
        if (numel[i] < 0)
            return tp__error(TP_ERR_INVALID_ARG, "%s: parameter %d (%s): numel %lld is negative",
                             fn, i, name, (long long)numel[i]);
        uint64_t es = tp_dtype_size(dtype[i]);
        if ((uint64_t)numel[i] > TP__MAX_BYTES / es)
            return tp__error(TP_ERR_INVALID_ARG,
                             "%s: parameter %d (%s): %lld elements of %s (%llu bytes each) "
                             "overflow a byte count (at most %llu bytes)",
                             fn, i, name, (long long)numel[i], tp_dtype_name(dtype[i]),
                             (unsigned long long)es, (unsigned long long)TP__MAX_BYTES);
        uint64_t bytes = (uint64_t)numel[i] * es;
        if (bytes > TP__MAX_BYTES - total)
            return tp__error(TP_ERR_INVALID_ARG,
                             "%s: parameter %d (%s): its %llu bytes take the parameters' total "
                             "past %llu bytes (a bucket holding them all would overflow)",
                             fn, i, name, (unsigned long long)bytes,
                             (unsigned long long)TP__MAX_BYTES);
        total += bytes;
    }
    return TP_OK;
}

tp_status tp__graph_new(const char *fn, int n, const int64_t *numel, const tp_dtype *dtype,
                        const int *devkey, const char *const *names, size_t cap_bytes,
                        tp_step_graph **out)
{
    TP_CHECK(tp__check_sizes(fn, n, numel, dtype, names));
    tp_step_graph *g = tp__calloc(1, sizeof *g);
    if (!g)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    g->n = n;
    g->cap_bytes = cap_bytes ? cap_bytes : TP__DEFAULT_CAP;
    size_t un = (size_t)(n > 0 ? n : 1);
    g->numel = tp__calloc(un, sizeof *g->numel);
    g->dtype = tp__calloc(un, sizeof *g->dtype);
    g->converts = tp__calloc(un, sizeof *g->converts);
    g->devkey = tp__calloc(un, sizeof *g->devkey);
    g->names = tp__calloc(un, sizeof *g->names);
    g->order = tp__calloc(un, sizeof *g->order);
    g->offset = tp__calloc(un, sizeof *g->offset);
    g->bucket_of = tp__calloc(un, sizeof *g->bucket_of);
    g->buckets = tp__calloc(un, sizeof *g->buckets);
    /* at most 3 nodes per parameter plus 2 per bucket (copy in/out) and the step */
    g->nodes = tp__calloc(5 * un + 1, sizeof *g->nodes);
    if (!g->numel || !g->dtype || !g->converts || !g->devkey || !g->names || !g->order ||
        !g->offset || !g->bucket_of || !g->buckets || !g->nodes) {
        tp_step_graph_free(g);
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    }
    for (int i = 0; i < n; i++) {
        g->numel[i] = numel[i];
        g->dtype[i] = dtype[i];
        g->devkey[i] = devkey ? devkey[i] : 0;
        char buf[24];
        snprintf(buf, sizeof buf, "param%d", i);
        g->names[i] = tp__strdup(names && names[i] ? names[i] : buf);
        if (!g->names[i]) {
            tp_step_graph_free(g);
            return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
        }
        g->order[i] = n - 1 - i; /* backward usually reaches the last parameters first */
    }
    tp_status st = tp__graph_rebuild(g);
    if (st != TP_OK) {
        tp_step_graph_free(g);
        return st;
    }
    *out = g;
    return TP_OK;
}

tp_status tp_step_graph_create(int n, const int64_t *numel, tp_dtype dtype,
                               size_t bucket_cap_bytes, tp_step_graph **out)
{
    const char *fn = "tp_step_graph_create";
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    *out = NULL;
    TP_ARG_CHECK(n >= 1, "%s: n %d must be at least 1", fn, n);
    TP_ARG_CHECK(numel, "%s: numel is NULL", fn);
    TP_ARG_CHECK((unsigned)dtype < TP_DTYPE_COUNT, "%s: invalid dtype %d", fn, (int)dtype);
    tp_dtype *dt = tp__calloc((size_t)n, sizeof *dt);
    if (!dt)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    for (int i = 0; i < n; i++)
        dt[i] = dtype;
    tp_status st = tp__graph_new(fn, n, numel, dt, NULL, NULL, bucket_cap_bytes, out);
    tp__free(dt);
    return st;
}

/* ---- the schedule ---------------------------------------------------------- */

tp_status tp__graph_rebuild(tp_step_graph *g)
{
    /* buckets: one per parameter, or runs of the ready order up to the cap */
    g->nb = 0;
    size_t bytes = 0;
    for (int k = 0; k < g->n; k++) {
        int p = g->order[k];
        size_t pb = (size_t)g->numel[p] * tp_dtype_size(g->dtype[p]);
        tp__gbucket *cur = g->nb ? &g->buckets[g->nb - 1] : NULL;
        bool fits = cur && g->fused && bytes + pb <= g->cap_bytes &&
                    g->dtype[g->order[cur->first]] == g->dtype[p] &&
                    g->devkey[g->order[cur->first]] == g->devkey[p];
        if (!fits) {
            cur = &g->buckets[g->nb++];
            *cur = (tp__gbucket){.first = k, .count = 0, .numel = 0};
            bytes = 0;
        }
        g->bucket_of[p] = g->nb - 1;
        g->offset[p] = cur->numel;
        cur->count++;
        cur->numel += g->numel[p];
        bytes += pb;
    }
    /* nodes */
    int nn = 0;
    for (int b = 0; b < g->nb; b++) {
        const tp__gbucket *bk = &g->buckets[b];
        for (int k = bk->first; k < bk->first + bk->count; k++)
            g->nodes[nn++] = (tp__gnode){TP__G_READY, g->order[k]};
        if (g->fused && !g->views)
            g->nodes[nn++] = (tp__gnode){TP__G_COPY_IN, b};
        g->nodes[nn++] = (tp__gnode){TP__G_ALL_REDUCE, b};
        if (!g->late) {
            g->nodes[nn++] = (tp__gnode){TP__G_WAIT, b};
            if (g->fused && !g->views)
                g->nodes[nn++] = (tp__gnode){TP__G_COPY_OUT, b};
        }
    }
    if (g->late) {
        for (int b = 0; b < g->nb; b++) {
            g->nodes[nn++] = (tp__gnode){TP__G_WAIT, b};
            if (g->fused && !g->views)
                g->nodes[nn++] = (tp__gnode){TP__G_COPY_OUT, b};
        }
    }
    g->nodes[nn++] = (tp__gnode){TP__G_STEP, 0};
    g->nn = nn;
    g->version++;
    return TP_OK;
}

tp_status tp__graph_set_order(tp_step_graph *g, const int *order)
{
    memcpy(g->order, order, (size_t)g->n * sizeof *order);
    return tp__graph_rebuild(g);
}

/* ---- passes ---------------------------------------------------------------- */

static bool tp__applied(const tp_step_graph *g, const tp_pass *p)
{
    for (int i = 0; i < g->n_applied; i++)
        if (g->applied[i] == p)
            return true;
    return false;
}

static const char *tp__pass_name(const tp_pass *p) { return p->name ? p->name : "(unnamed)"; }

tp_status tp_pass_apply(const tp_pass *pass, tp_step_graph *g)
{
    const char *fn = "tp_pass_apply";
    TP_ARG_CHECK(pass, "%s: pass is NULL", fn);
    TP_ARG_CHECK(g, "%s: graph is NULL", fn);
    TP_ARG_CHECK(pass->run, "%s: pass %s has no run function", fn, tp__pass_name(pass));
    if (g->owner && tp__ddp_in_step(g->owner))
        return tp__error(TP_ERR_STATE, "%s: %s: a training step is in progress on this DDP "
                         "(apply passes between steps, after tp_ddp_sync)", fn,
                         tp__pass_name(pass));
    /* prerequisites not applied yet, listed together */
    char missing[512] = "";
    size_t len = 0;
    for (const tp_pass *const *q = pass->prerequisites; q && *q; q++) {
        if (tp__applied(g, *q))
            continue;
        int w = snprintf(missing + len, sizeof missing - len, "%s%s", len ? ", " : "",
                         tp__pass_name(*q));
        if (w > 0 && (size_t)w < sizeof missing - len)
            len += (size_t)w;
    }
    if (len)
        return tp__error(TP_ERR_STATE, "%s: [%s] are the prerequisites of %s and have not been "
                         "applied", fn, missing, tp__pass_name(pass));
    /* an applied pass that must come after this one */
    for (int i = 0; i < g->n_applied; i++)
        for (const tp_pass *const *q = g->applied[i]->apply_after; q && *q; q++)
            if (*q == pass)
                return tp__error(TP_ERR_STATE, "%s: %s must be applied after %s, which was "
                                 "already applied before it", fn, tp__pass_name(g->applied[i]),
                                 tp__pass_name(pass));
    if (!tp__grow_array((void **)&g->applied, (size_t)g->n_applied, &g->cap_applied,
                        sizeof *g->applied))
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    tp_status st = pass->run(g, pass->ctx);
    if (st != TP_OK) {
        tp__error_prefix("%s: %s", fn, tp__pass_name(pass));
        return st;
    }
    g->applied[g->n_applied++] = pass;
    return TP_OK;
}

static tp_status tp__run_fusion(tp_step_graph *g, void *ctx)
{
    (void)ctx;
    g->fused = true;
    return tp__graph_rebuild(g);
}

static tp_status tp__run_late_waits(tp_step_graph *g, void *ctx)
{
    (void)ctx;
    g->late = true;
    return tp__graph_rebuild(g);
}

static tp_status tp__run_remove_copies(tp_step_graph *g, void *ctx)
{
    (void)ctx;
    /* a gradient converted for the all_reduce (reduce_dtype) has another
     * dtype than its bucket: it cannot be a view into it */
    for (int i = 0; i < g->n; i++)
        if (g->converts[i])
            return tp__error(TP_ERR_NOT_SUPPORTED,
                             "the gradient of %s is converted to %s for its all_reduce "
                             "(reduce_dtype): it cannot be a view into its bucket; leave "
                             "gradient_as_bucket_view off",
                             g->names[i], tp_dtype_name(g->dtype[i]));
    g->views = true;
    return tp__graph_rebuild(g);
}

extern const tp_pass tp__pass_fusion, tp__pass_late, tp__pass_views;
static const tp_pass *const tp__after_fusion[] = {&tp__pass_fusion, NULL};
const tp_pass tp__pass_fusion = {"bucket_fusion", NULL, NULL, tp__run_fusion, NULL};
const tp_pass tp__pass_late = {"late_waits", NULL, tp__after_fusion, tp__run_late_waits, NULL};
const tp_pass tp__pass_views = {"remove_copies", tp__after_fusion, tp__after_fusion,
                                tp__run_remove_copies, NULL};

const tp_pass *tp_pass_bucket_fusion(void) { return &tp__pass_fusion; }
const tp_pass *tp_pass_late_waits(void) { return &tp__pass_late; }
const tp_pass *tp_pass_remove_copies(void) { return &tp__pass_views; }

/* ---- inspection ------------------------------------------------------------ */

int tp_step_graph_num_params(const tp_step_graph *g) { return g ? g->n : 0; }
int tp_step_graph_num_buckets(const tp_step_graph *g) { return g ? g->nb : 0; }

int tp_step_graph_bucket_of(const tp_step_graph *g, int param)
{
    return g && param >= 0 && param < g->n ? g->bucket_of[param] : -1;
}

int tp_step_graph_num_applied(const tp_step_graph *g) { return g ? g->n_applied : 0; }

const char *tp_step_graph_applied(const tp_step_graph *g, int i)
{
    return g && i >= 0 && i < g->n_applied ? tp__pass_name(g->applied[i]) : NULL;
}

tp_status tp_step_graph_write(const tp_step_graph *g, FILE *f)
{
    const char *fn = "tp_step_graph_write";
    TP_ARG_CHECK(g, "%s: graph is NULL", fn);
    TP_ARG_CHECK(f, "%s: f is NULL", fn);
    static const char *const kinds[] = {"ready", "copy_in", "all_reduce", "wait", "copy_out",
                                        "step"};
    for (int i = 0; i < g->nn; i++) {
        const tp__gnode *nd = &g->nodes[i];
        int w;
        if (nd->kind == TP__G_READY)
            w = fprintf(f, "ready %s\n", g->names[nd->arg]);
        else if (nd->kind == TP__G_STEP)
            w = fprintf(f, "step\n");
        else
            w = fprintf(f, "%s b%d (%d params, %lld elements)\n", kinds[nd->kind], nd->arg,
                        g->buckets[nd->arg].count, (long long)g->buckets[nd->arg].numel);
        if (w < 0)
            return tp__error(TP_ERR_BACKEND, "%s: write failed", fn);
    }
    return TP_OK;
}
