/* The dtensor layer's TP_DEBUG lines: what an op chose and how a layout
 * changes. Only reached when the level asks for them (debug_log.h). */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "dtensor/debug_log.h"
#include "dtensor/ops_internal.h"

/* A line under construction; text past the end is dropped (tp__log marks a
 * cut line). */
typedef struct {
    char buf[1024];
    size_t n;
} tp__line;

__attribute__((format(printf, 2, 3))) static void tp__line_add(tp__line *l, const char *fmt, ...)
{
    if (l->n >= sizeof l->buf - 1)
        return;
    va_list ap;
    va_start(ap, fmt);
    int w = vsnprintf(l->buf + l->n, sizeof l->buf - l->n, fmt, ap);
    va_end(ap);
    if (w > 0)
        l->n = l->n + (size_t)w < sizeof l->buf ? l->n + (size_t)w : sizeof l->buf - 1;
}

static void tp__line_mesh(tp__line *l, const tp_mesh *mesh)
{
    int m = tp_mesh_ndim(mesh);
    tp__line_add(l, "(");
    for (int d = 0; d < m; d++) {
        const char *name = tp_mesh_dim_name(mesh, d);
        tp__line_add(l, "%s%s=%lld", d ? ", " : "", name && *name ? name : "?",
                     (long long)tp_mesh_size(mesh, d));
    }
    tp__line_add(l, ")");
}

static void tp__line_placements(tp__line *l, int m, const tp_placement *p)
{
    char s[TP_MESH_MAX_DIMS * 16 + 8];
    tp__line_add(l, "%s", tp_placements_str(m, p, s, sizeof s));
}

static bool tp__same_placements(int m, const tp_placement *a, const tp_placement *b)
{
    for (int d = 0; d < m; d++)
        if (!tp__placement_eq(a[d], b[d]))
            return false;
    return true;
}

void tp__log_op(const tp__op *op, const tp__node *node, const tp_tensor *gy)
{
    if (!tp__log_enabled(TP_LOG_INFO))
        return;
    const tp__op_def *def = op->def;
    int m = op->mesh_ndim;
    tp__line l = {.n = 0};
    char shape[128];
    tp__line_add(&l, "op %s%s on mesh ", def->name, node ? " backward" : "");
    tp__line_mesh(&l, op->mesh);
    if (!node) {
        tp__line_add(&l, ":");
        for (int i = 0; i < def->n_inputs; i++) {
            tp__line_add(&l, "%s %s", i ? "," : "", def->input_names[i]);
            const tp_tensor *a = op->arg[i];
            if (!a) {
                tp__line_add(&l, " -");
                continue;
            }
            tp__line_add(&l, " %s ", tp__shape_str(op->arg_ndim[i], op->arg_shape[i], shape,
                                                   sizeof shape));
            const tp_placement *cur = tp_dtensor_placements(a);
            if (!tp__same_placements(m, cur, op->in_pl[i])) {
                tp__line_placements(&l, m, cur);
                tp__line_add(&l, " => ");
            }
            tp__line_placements(&l, m, op->in_pl[i]);
        }
        tp__line_add(&l, " -> out ");
        tp__line_placements(&l, m, op->out_pl);
    } else {
        /* the local backward reads a Partial output's gradient as Replicate */
        tp_placement want[TP_MESH_MAX_DIMS];
        for (int d = 0; d < m; d++)
            want[d] = op->out_pl[d].kind == TP_PLACEMENT_PARTIAL ? tp_replicate() : op->out_pl[d];
        tp__line_add(&l, ": grad out ");
        const tp_placement *cur =
            gy && tp_tensor_is_dtensor(gy) ? tp_dtensor_placements(gy) : NULL;
        if (cur && !tp__same_placements(m, cur, want)) {
            tp__line_placements(&l, m, cur);
            tp__line_add(&l, " => ");
        }
        tp__line_placements(&l, m, want);
        tp__line_add(&l, " ->");
        bool any = false;
        for (int i = 0; i < def->n_inputs; i++) {
            if (!node->inputs[i])
                continue;
            tp__line_add(&l, "%s grad %s ", any ? "," : "", def->input_names[i]);
            tp__line_placements(&l, m, op->grad_pl[i]);
            any = true;
        }
        if (!any)
            tp__line_add(&l, " no grads");
    }
    tp__log(TP_LOG_INFO, "%s", l.buf);
}

void tp__log_redistribute_step(const tp_tensor *dt, const tp_placement *dst, int step,
                               int nsteps, int mesh_dim, tp_placement from, tp_placement to,
                               tp_coll_kind kind, const tp_tensor *local)
{
    if (!tp__log_enabled(TP_LOG_INFO))
        return;
    const tp_mesh *mesh = tp_dtensor_mesh(dt);
    int m = tp_mesh_ndim(mesh);
    tp__line l = {.n = 0};
    char shape[128], a[32], b[32];
    tp__line_add(&l, "redistribute %s ", tp__shape_str(dt->ndim, dt->shape, shape, sizeof shape));
    tp__line_placements(&l, m, tp_dtensor_placements(dt));
    tp__line_add(&l, " -> ");
    tp__line_placements(&l, m, dst);
    const char *name = tp_mesh_dim_name(mesh, mesh_dim);
    tp__line_add(&l, " step %d/%d: mesh dim %d (%s=%lld) %s -> %s, %s, input %s %s, %lld bytes",
                 step + 1, nsteps, mesh_dim, name && *name ? name : "?",
                 (long long)tp_mesh_size(mesh, mesh_dim), tp_placement_str(from, a, sizeof a),
                 tp_placement_str(to, b, sizeof b),
                 kind < TP_COLL_KIND_COUNT ? tp_coll_kind_name(kind) : "no collective",
                 tp_dtype_name(local->dtype),
                 tp__shape_str(local->ndim, local->shape, shape, sizeof shape),
                 (long long)(tp_tensor_numel(local) * (int64_t)tp_dtype_size(local->dtype)));
    tp__log(TP_LOG_INFO, "%s", l.buf);
}
