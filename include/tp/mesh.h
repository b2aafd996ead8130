/*
 * tp/mesh.h - N-D device meshes.
 *
 * A mesh arranges the ranks of a world communicator in an N-D grid (row-major:
 * world rank = linear index of the coordinate). Each mesh dim has a name and a
 * sub-communicator grouping the ranks that differ only in that coordinate.
 *
 * Lifetime: a mesh is reference-counted. Everything that keeps a mesh holds a
 * reference of its own: DTensors on it (and so the parameters and autograd
 * nodes that hold those), the hooks a parallel style installs on modules. (A
 * slice needs nothing of its parent and holds no reference on it.)
 * tp_mesh_free drops the caller's reference, so the caller may free its mesh
 * right after tp_parallelize_module or after making DTensors on it; the mesh
 * goes when the last of them goes. The counting is thread-safe: a DTensor may
 * be released on another thread than the one that made its mesh, and the
 * last release frees the mesh's communicators on that thread.
 *
 * tp_mesh, in short: made by tp_mesh_create and tp_mesh_slice with one
 * reference, the caller's; tp_mesh_retain adds one, tp_mesh_free drops one,
 * the last frees it. Held by DTensors, style hooks and autograd nodes. It
 * keeps a reference on its group communicator (the world given to
 * tp_mesh_create, or a slice's own split) and owns the per-dim
 * communicators it split; tp_mesh_comm and tp_mesh_group lend them.
 */
#ifndef TP_MESH_H
#define TP_MESH_H

#include <stdint.h>

#include "tp/comm.h"
#include "tp/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TP_MESH_MAX_DIMS 8

typedef struct tp_mesh tp_mesh;

/*
 * Collective over `world`: creates a mesh of ndim dims (1..8) with the given
 * sizes (each >= 1; product must equal the world size, otherwise
 * TP_ERR_INVALID_ARG naming both) and optional distinct names (NULL: "dim0",
 * "dim1", ...). The mesh keeps its own sub-communicators and uses `world` as
 * its group (tp_mesh_group) and as the communicator of a dim spanning all of
 * it; it holds a reference on `world`, so the caller may tp_comm_free(world)
 * before or after freeing the mesh. *out starts with one reference, the
 * caller's.
 *
 * Arguments are validated locally before any communication, so a program
 * passing the same arguments on every rank gets the same TP_ERR_INVALID_ARG on
 * every rank; arguments that are invalid on some ranks only leave the others
 * waiting. A failure after validation (out of memory, backend error) aborts
 * `world` (when it has more than one rank) so that peers return
 * TP_ERR_ABORTED rather than hang.
 */
TP_API tp_status tp_mesh_create(tp_comm *world, int ndim, const int64_t *shape,
                                const char *const *names, tp_mesh **out);
/* Drops the caller's reference (NULL is a no-op). The mesh, with its
 * sub-communicators and its reference on the world, goes with the last
 * reference: DTensors, module hooks and autograd nodes on it keep it alive.
 * Never collective by itself; the last release frees communicators, which
 * some backends synchronize with peers (see tp_comm_free). */
TP_API void tp_mesh_free(tp_mesh *mesh);
/* Adds a reference for a caller that keeps the mesh (in its own structures,
 * on another thread); drop it with tp_mesh_free. Returns mesh; NULL gives
 * NULL. Thread-safe. */
TP_API tp_mesh *tp_mesh_retain(tp_mesh *mesh);

/* Accessors return -1 (NULL for pointers) for a NULL mesh. */
TP_API int tp_mesh_ndim(const tp_mesh *mesh);
/* Size of mesh dim d (negative counts from the end); -1 if out of range. */
TP_API int64_t tp_mesh_size(const tp_mesh *mesh, int d);
/* Number of ranks in the mesh. */
TP_API int64_t tp_mesh_numel(const tp_mesh *mesh);
/* This rank's coordinate along dim d; -1 if out of range. */
TP_API int64_t tp_mesh_coord(const tp_mesh *mesh, int d);
/* This rank's index in the mesh (row-major over coordinates). */
TP_API int tp_mesh_rank(const tp_mesh *mesh);
/* Name of dim d, or NULL if out of range. */
TP_API const char *tp_mesh_dim_name(const tp_mesh *mesh, int d);
/* Index of the dim called `name`, or -1. */
TP_API int tp_mesh_dim_index(const tp_mesh *mesh, const char *name);
/* Communicator of the ranks that share every coordinate but dim d (borrowed:
 * valid while the caller holds a reference on the mesh; work handles issued
 * on it stay valid after that). NULL if out of range. A dim that spans the
 * whole mesh (size == numel, e.g. the only dim of a 1-D mesh) uses the group
 * communicator itself. */
TP_API tp_comm *tp_mesh_comm(const tp_mesh *mesh, int d);
/* Communicator spanning all ranks of the mesh (borrowed, as tp_mesh_comm):
 * the world given to tp_mesh_create, or a slice's own group. */
TP_API tp_comm *tp_mesh_group(const tp_mesh *mesh);

/*
 * Collective over the mesh: the lower-dimensional mesh made of the named dims
 * (in the order given) that contains this rank, e.g. the "tp" slice of a
 * ("dp", "tp") mesh. Unknown or repeated names, or nnames outside
 * [1, ndim], are TP_ERR_INVALID_ARG. The slice is a mesh of its own (free it
 * with tp_mesh_free) that owns a new group communicator and borrows nothing
 * from the parent: the two may be freed in any order. Validation and
 * failures behave as in tp_mesh_create (a failure after validation aborts the
 * communicator the rank was splitting).
 */
TP_API tp_status tp_mesh_slice(tp_mesh *mesh, int nnames, const char *const *names,
                               tp_mesh **out);

#ifdef __cplusplus
}
#endif

#endif /* TP_MESH_H */
