/* N-D device meshes: named dims over a group communicator, one
 * sub-communicator per dim, and slicing into lower-dimensional meshes. */
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "collectives/comm_ref.h"
#include "core/core.h"
#include "tp/mesh.h"

/* A mesh is shared by whatever uses it (DTensors, style hooks): each holds a
 * reference, the caller's goes with tp_mesh_free, and the last one frees it,
 * on whichever thread drops it. It holds a reference on every communicator
 * it uses, so nothing it points to can go first. */
struct tp_mesh {
    atomic_int refs;
    int ndim;
    int rank;      /* index in `group`, == row-major index of `coord` */
    int64_t numel; /* product of shape == size of `group` */
    int64_t shape[TP_MESH_MAX_DIMS];
    int64_t coord[TP_MESH_MAX_DIMS];
    char *names[TP_MESH_MAX_DIMS];
    tp_comm *group;
    /* holds a reference on group: a slice's own split, or tp_mesh_create's
     * world (false only while a mesh is being built) */
    bool owns_group;
    tp_comm *comms[TP_MESH_MAX_DIMS];
    /* false where comms[d] aliases `group` (a dim spanning the whole mesh):
     * splitting would only build an identical communicator, which is costly
     * on backends like NCCL */
    bool owns_comm[TP_MESH_MAX_DIMS];
};

/* Longest "[a, b, ...]" for TP_MESH_MAX_DIMS int64 sizes, with room to spare. */
#define MESH_SHAPE_STR_LEN 256

/* Row-major linear index of the coordinates `idx` (n entries, in that order)
 * of `coord` over the matching sizes of `shape`. */
static int64_t mesh_linear(const int64_t *shape, const int64_t *coord, const int *idx, int n)
{
    int64_t lin = 0;
    for (int i = 0; i < n; i++)
        lin = lin * shape[idx[i]] + coord[idx[i]];
    return lin;
}

static void mesh_release(tp_mesh *m)
{
    for (int d = 0; d < m->ndim; d++) {
        if (m->owns_comm[d])
            tp__comm_release(m->comms[d]);
        tp__free(m->names[d]);
    }
    if (m->owns_group)
        tp__comm_release(m->group);
    tp__free(m);
}

/*
 * Checks names for a mesh of ndim dims: NULL means defaults; otherwise every
 * entry non-NULL, non-empty and distinct. Purely local, so that invalid
 * arguments fail before any collective.
 */
static tp_status mesh_check_names(const char *fn, int ndim, const char *const *names)
{
    if (!names)
        return TP_OK;
    for (int d = 0; d < ndim; d++) {
        TP_ARG_CHECK(names[d] != NULL, "%s: name of mesh dim %d is NULL", fn, d);
        TP_ARG_CHECK(names[d][0] != '\0', "%s: name of mesh dim %d is empty", fn, d);
        for (int e = 0; e < d; e++)
            TP_ARG_CHECK(strcmp(names[d], names[e]) != 0,
                         "%s: mesh dims %d and %d are both named \"%s\"", fn, e, d, names[d]);
    }
    return TP_OK;
}

/*
 * Builds a mesh over `group` from validated arguments (the product of shape
 * equals the group size). Collective over group: one split per dim that does
 * not span the whole mesh. On failure after this rank may have diverged from
 * its peers (an allocation or a split failing on some ranks only), aborts the
 * group so that peers waiting in a split return TP_ERR_ABORTED instead of
 * hanging.
 */
/* World-rank distance between neighbours along dim d (0: unknown). */
static int64_t mesh_dim_stride(const tp_mesh *m, int d)
{
    int64_t s = tp__comm_global_stride(m->group);
    for (int e = d + 1; e < m->ndim; e++)
        s *= m->shape[e];
    return s;
}

static tp_status mesh_build(tp_comm *group, int ndim, const int64_t *shape,
                            const char *const *names, tp_mesh **out)
{
    tp_status st = TP_OK;
    const int size = tp_comm_size(group);
    tp_mesh *m = tp__calloc(1, sizeof *m);
    if (!m) {
        st = tp__error(TP_ERR_NO_MEMORY, "out of memory allocating a %d-D mesh", ndim);
        goto fail;
    }
    atomic_init(&m->refs, 1);
    m->ndim = ndim;
    m->group = group;
    m->rank = tp_comm_rank(group);
    m->numel = size;

    int64_t rest = m->rank;
    for (int d = ndim - 1; d >= 0; d--) {
        m->shape[d] = shape[d];
        m->coord[d] = rest % shape[d];
        rest /= shape[d];
    }
    for (int d = 0; d < ndim; d++) {
        char dflt[32];
        const char *name = names ? names[d] : dflt;
        if (!names)
            snprintf(dflt, sizeof dflt, "dim%d", d);
        m->names[d] = tp__strdup(name);
        if (!m->names[d]) {
            st = tp__error(TP_ERR_NO_MEMORY, "out of memory copying the name of dim %d", d);
            goto fail;
        }
    }

    for (int d = 0; d < ndim; d++) {
        if (m->shape[d] == m->numel) {
            m->comms[d] = group;
            continue;
        }
        int others[TP_MESH_MAX_DIMS];
        int nothers = 0;
        for (int e = 0; e < ndim; e++)
            if (e != d)
                others[nothers++] = e;
        /* Both fit in int: they are below numel, which is a group size. */
        int color = (int)mesh_linear(m->shape, m->coord, others, nothers);
        int key = (int)m->coord[d];
        st = tp__comm_split_sized(group, color, key, (int)m->shape[d], &m->comms[d]);
        if (st != TP_OK) {
            tp__error_prefix("splitting dim %d (\"%s\")", d, m->names[d]);
            goto fail;
        }
        m->owns_comm[d] = true;
        tp__comm_set_global_stride(m->comms[d], mesh_dim_stride(m, d));
        /* A backend (possibly user-written) that ignores the key or the color
         * would give wrong groups silently; refuse it here instead. */
        if (!m->comms[d] || tp_comm_size(m->comms[d]) != m->shape[d] ||
            tp_comm_rank(m->comms[d]) != m->coord[d]) {
            st = tp__error(TP_ERR_BACKEND,
                           "splitting dim %d (\"%s\") gave rank %d of %d, expected "
                           "rank %lld of %lld", d, m->names[d], tp_comm_rank(m->comms[d]),
                           tp_comm_size(m->comms[d]), (long long)m->coord[d],
                           (long long)m->shape[d]);
            goto fail;
        }
    }
    *out = m;
    return TP_OK;

fail:
    if (size > 1) {
        /* The backend may set the thread's error text while aborting, so hand
         * it a copy and keep ours as the message the caller sees. */
        char reason[1024];
        snprintf(reason, sizeof reason, "%s", tp_last_error());
        tp_comm_abort(group, reason);
        tp__error_set_text(reason);
    }
    if (m)
        mesh_release(m);
    return st;
}

tp_status tp_mesh_create(tp_comm *world, int ndim, const int64_t *shape,
                         const char *const *names, tp_mesh **out)
{
    static const char fn[] = "tp_mesh_create";
    TP_ARG_CHECK(out != NULL, "%s: out is NULL", fn);
    *out = NULL;
    TP_ARG_CHECK(world != NULL, "%s: world communicator is NULL", fn);
    TP_ARG_CHECK(ndim >= 1 && ndim <= TP_MESH_MAX_DIMS,
                 "%s: ndim is %d, must be in [1, %d]", fn, ndim, TP_MESH_MAX_DIMS);
    TP_ARG_CHECK(shape != NULL, "%s: shape is NULL", fn);

    const int64_t world_size = tp_comm_size(world);
    int64_t numel = 1;
    bool overflow = false;
    for (int d = 0; d < ndim; d++) {
        TP_ARG_CHECK(shape[d] >= 1, "%s: mesh dim %d has size %lld, must be >= 1", fn, d,
                     (long long)shape[d]);
        if (numel > INT64_MAX / shape[d])
            overflow = true;
        else
            numel *= shape[d];
    }
    if (overflow || numel != world_size) {
        char buf[MESH_SHAPE_STR_LEN];
        tp__shape_str(ndim, shape, buf, sizeof buf);
        if (overflow)
            return tp__error(TP_ERR_INVALID_ARG,
                             "%s: mesh shape %s has more ranks than fit in int64 but the "
                             "world has %lld", fn, buf, (long long)world_size);
        return tp__error(TP_ERR_INVALID_ARG,
                         "%s: mesh shape %s has %lld ranks but the world has %lld", fn, buf,
                         (long long)numel, (long long)world_size);
    }
    TP_CHECK(mesh_check_names(fn, ndim, names));

    tp_status st = mesh_build(world, ndim, shape, names, out);
    if (st != TP_OK) {
        tp__error_prefix("%s", fn);
        return st;
    }
    /* the mesh uses world as its group (and as the communicator of a dim
     * spanning it): the caller may free world first */
    tp__comm_retain(world);
    (*out)->owns_group = true;
    return TP_OK;
}

tp_mesh *tp_mesh_retain(tp_mesh *mesh)
{
    if (mesh)
        atomic_fetch_add(&mesh->refs, 1);
    return mesh;
}

void tp_mesh_free(tp_mesh *mesh)
{
    if (mesh && atomic_fetch_sub(&mesh->refs, 1) == 1)
        mesh_release(mesh);
}

tp_status tp_mesh_slice(tp_mesh *mesh, int nnames, const char *const *names, tp_mesh **out)
{
    static const char fn[] = "tp_mesh_slice";
    TP_ARG_CHECK(out != NULL, "%s: out is NULL", fn);
    *out = NULL;
    TP_ARG_CHECK(mesh != NULL, "%s: mesh is NULL", fn);
    TP_ARG_CHECK(nnames >= 1 && nnames <= mesh->ndim,
                 "%s: %d names for a %d-D mesh, must be in [1, %d]", fn, nnames, mesh->ndim,
                 mesh->ndim);
    TP_ARG_CHECK(names != NULL, "%s: names is NULL", fn);

    int sel[TP_MESH_MAX_DIMS];
    bool selected[TP_MESH_MAX_DIMS] = {false};
    for (int i = 0; i < nnames; i++) {
        TP_ARG_CHECK(names[i] != NULL, "%s: name %d is NULL", fn, i);
        int d = tp_mesh_dim_index(mesh, names[i]);
        TP_ARG_CHECK(d >= 0, "%s: the mesh has no dim named \"%s\"", fn, names[i]);
        TP_ARG_CHECK(!selected[d], "%s: dim \"%s\" is named twice", fn, names[i]);
        selected[d] = true;
        sel[i] = d;
    }
    int rest[TP_MESH_MAX_DIMS];
    int nrest = 0;
    for (int d = 0; d < mesh->ndim; d++)
        if (!selected[d])
            rest[nrest++] = d;

    /* Key orders the slice row-major over the selected dims in the order
     * given, so that rank in the new group == linear index of its coordinate
     * in the slice, which is what mesh_build assumes. */
    int color = (int)mesh_linear(mesh->shape, mesh->coord, rest, nrest);
    int key = (int)mesh_linear(mesh->shape, mesh->coord, sel, nnames);
    tp_comm *group = NULL;
    int64_t numel = 1;
    for (int i = 0; i < nnames; i++)
        numel *= mesh->shape[sel[i]];
    tp_status st = tp__comm_split_sized(mesh->group, color, key, (int)numel, &group);
    if (st != TP_OK) {
        tp__error_prefix("%s", fn);
        return st;
    }

    int64_t shape[TP_MESH_MAX_DIMS];
    const char *sel_names[TP_MESH_MAX_DIMS];
    for (int i = 0; i < nnames; i++) {
        shape[i] = mesh->shape[sel[i]];
        sel_names[i] = mesh->names[sel[i]];
    }
    if (!group || tp_comm_rank(group) != key || tp_comm_size(group) != numel) {
        st = tp__error(TP_ERR_BACKEND, "%s: split gave rank %d of %d, expected rank %d of %lld",
                       fn, tp_comm_rank(group), tp_comm_size(group), key, (long long)numel);
        if (group && numel > 1)
            tp_comm_abort(group, tp_last_error());
        tp__comm_release(group);
        return st;
    }
    /* the slice's members are evenly spaced when its dims are consecutive
     * and in mesh order: the stride of its last one */
    bool consecutive = true;
    for (int i = 1; i < nnames; i++)
        consecutive = consecutive && sel[i] == sel[i - 1] + 1;
    tp__comm_set_global_stride(group, consecutive ? mesh_dim_stride(mesh, sel[nnames - 1]) : 0);
    st = mesh_build(group, nnames, shape, sel_names, out);
    if (st != TP_OK) {
        tp__comm_release(group);
        tp__error_prefix("%s", fn);
        return st;
    }
    (*out)->owns_group = true;
    /* each dim's members are as far apart in the world as in the parent's
     * dim, whatever order the slice names them in (a (tp, dp) view of a
     * (dp, tp) mesh): what plans time a collective's link by */
    for (int i = 0; i < nnames; i++)
        if ((*out)->comms[i] != group || nnames == 1)
            tp__comm_set_global_stride((*out)->comms[i], mesh_dim_stride(mesh, sel[i]));
    return TP_OK;
}

/* ---- accessors ------------------------------------------------------------ */

int tp_mesh_ndim(const tp_mesh *mesh) { return mesh ? mesh->ndim : -1; }

int64_t tp_mesh_size(const tp_mesh *mesh, int d)
{
    d = mesh ? tp__wrap_dim(d, mesh->ndim) : -1;
    return d >= 0 ? mesh->shape[d] : -1;
}

int64_t tp_mesh_numel(const tp_mesh *mesh) { return mesh ? mesh->numel : -1; }

int64_t tp_mesh_coord(const tp_mesh *mesh, int d)
{
    d = mesh ? tp__wrap_dim(d, mesh->ndim) : -1;
    return d >= 0 ? mesh->coord[d] : -1;
}

int tp_mesh_rank(const tp_mesh *mesh) { return mesh ? mesh->rank : -1; }

const char *tp_mesh_dim_name(const tp_mesh *mesh, int d)
{
    d = mesh ? tp__wrap_dim(d, mesh->ndim) : -1;
    return d >= 0 ? mesh->names[d] : NULL;
}

int tp_mesh_dim_index(const tp_mesh *mesh, const char *name)
{
    if (!mesh || !name)
        return -1;
    for (int d = 0; d < mesh->ndim; d++)
        if (strcmp(mesh->names[d], name) == 0)
            return d;
    return -1;
}

tp_comm *tp_mesh_comm(const tp_mesh *mesh, int d)
{
    d = mesh ? tp__wrap_dim(d, mesh->ndim) : -1;
    return d >= 0 ? mesh->comms[d] : NULL;
}

tp_comm *tp_mesh_group(const tp_mesh *mesh) { return mesh ? mesh->group : NULL; }
