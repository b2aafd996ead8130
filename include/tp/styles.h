/*
 * tp/styles.h - parallel styles and tp_parallelize_module.
 *
 * A style says how a module's parameters are distributed over a 1-D mesh and
 * how its inputs and outputs are laid out. Layouts are single placements
 * (the mesh is 1-D); an optional layout (tp_layout) may be None.
 *
 *   style                parameters                      input               output
 *   Colwise              Linear W,b -> S(0);             to R                S(-1) -> output_layouts
 *                        Embedding W -> S(1)
 *   Rowwise              Linear W -> S(1), b -> R;       Linear: to S(-1);   P -> output_layouts
 *                        Embedding W -> S(0)             Embedding: to R
 *   SequenceParallel     all -> R (no communication)     to S(sequence_dim)  S(sequence_dim)
 *   PrepareModuleInput   none                            per input           -
 *   PrepareModuleOutput  none                            -                   per output
 *
 * Plain tensors reaching a styled module are taken to have the style's input
 * layouts (tp_dtensor_from_local, no communication); with use_local_output
 * the output is returned as this rank's local tensor. As in PyTorch, a plain
 * tensor's global shape is inferred from this rank's shard (even sharding):
 * for uneven shards (a sequence length the ranks do not divide) pass
 * DTensors built with their global shape (tp_dtensor_from_local's
 * global_shape), or keep the outputs DTensors between styled modules;
 * otherwise the ranks disagree and every rank gets TP_ERR_MISMATCH from the
 * first collective, saying so (see tp_from_local_options).
 */
#ifndef TP_STYLES_H
#define TP_STYLES_H

#include <stdbool.h>

#include "tp/dtensor.h"
#include "tp/mesh.h"
#include "tp/nn.h"
#include "tp/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* An immutable value. Owner: the caller (tp_*_create, tp_style_free). Plan
 * entries borrow it; tp_parallelize_module copies what it needs into the
 * hooks it installs (owned by the module), so a style may be freed as soon as
 * the call returns. */
typedef struct tp_style tp_style;

/* An optional placement: set = false is None (the input passes untouched). */
typedef struct tp_layout {
    bool set;
    tp_placement p;
} tp_layout;

static inline tp_layout tp_layout_of(tp_placement p)
{
    tp_layout l = {true, p};
    return l;
}
static inline tp_layout tp_layout_none(void)
{
    tp_layout l = {false, {TP_PLACEMENT_REPLICATE, 0, TP_SUM}};
    return l;
}

/*
 * A boolean option whose zero value means "the style's default", so that a
 * zero-initialized options struct is every default of the table above:
 * TP_FLAG_DEFAULT (0), TP_FLAG_TRUE (1, so `true` also reads as TP_FLAG_TRUE)
 * or TP_FLAG_FALSE. Note that `false` is 0, the default: write TP_FLAG_FALSE
 * to turn off an option whose default is on. Other values are
 * TP_ERR_INVALID_ARG.
 */
typedef enum tp_flag { TP_FLAG_DEFAULT = 0, TP_FLAG_TRUE = 1, TP_FLAG_FALSE = 2 } tp_flag;

/*
 * Options: zero-initialized means every default of the table above.
 * use_local_output (PyTorch's name, in every style): the module's output (or,
 * for PrepareModuleInput, each prepared input) is handed on as this rank's
 * local tensor (tp_dtensor_to_local) instead of as a DTensor. Defaults as
 * PyTorch's: true for Colwise, Rowwise and PrepareModuleOutput, false for
 * SequenceParallel and PrepareModuleInput.
 */
typedef struct tp_colwise_options {
    tp_layout input_layouts;  /* default R */
    tp_layout output_layouts; /* default S(-1) */
    tp_flag use_local_output; /* default true */
} tp_colwise_options;

typedef struct tp_rowwise_options {
    tp_layout input_layouts;  /* default S(-1) (Embedding: R) */
    tp_layout output_layouts; /* default R */
    tp_flag use_local_output; /* default true */
} tp_rowwise_options;

typedef struct tp_sequence_parallel_options {
    int sequence_dim; /* default 1; set sequence_dim_set to use 0 */
    bool sequence_dim_set;
    tp_flag use_local_output; /* default false */
} tp_sequence_parallel_options;

#define TP_STYLE_MAX_LAYOUTS 8

typedef struct tp_kwarg_layout {
    const char *name;
    tp_layout layout;
    tp_layout desired;
} tp_kwarg_layout;

typedef struct tp_prepare_input_options {
    int n_inputs; /* entries of the two arrays below (must match) */
    tp_layout input_layouts[TP_STYLE_MAX_LAYOUTS];
    int n_desired;
    tp_layout desired_input_layouts[TP_STYLE_MAX_LAYOUTS];
    int n_kwargs;
    tp_kwarg_layout kwargs[TP_STYLE_MAX_LAYOUTS];
    tp_flag use_local_output; /* default false */
} tp_prepare_input_options;

typedef struct tp_prepare_output_options {
    int n_outputs;
    tp_layout output_layouts[TP_STYLE_MAX_LAYOUTS];
    int n_desired;
    tp_layout desired_output_layouts[TP_STYLE_MAX_LAYOUTS];
    tp_flag use_local_output; /* default true */
} tp_prepare_output_options;

/* Styles are values shared by reference between plan entries; free them after
 * parallelizing. opts NULL: defaults. Length mismatches (n_inputs !=
 * n_desired, ...) are TP_ERR_INVALID_ARG ("input_layouts and
 * desired_input_layouts should have same length"). */
TP_API tp_status tp_colwise_parallel_create(const tp_colwise_options *opts, tp_style **out);
TP_API tp_status tp_rowwise_parallel_create(const tp_rowwise_options *opts, tp_style **out);
TP_API tp_status tp_sequence_parallel_create(const tp_sequence_parallel_options *opts,
                                             tp_style **out);
TP_API tp_status tp_prepare_module_input_create(const tp_prepare_input_options *opts,
                                                tp_style **out);
TP_API tp_status tp_prepare_module_output_create(const tp_prepare_output_options *opts,
                                                 tp_style **out);
TP_API tp_status tp_prepare_module_input_output_create(const tp_prepare_input_options *in,
                                                       const tp_prepare_output_options *out_opts,
                                                       tp_style **out);
TP_API void tp_style_free(tp_style *s);

typedef struct tp_plan_entry {
    const char *fqn; /* dotted pattern, fnmatch per token; "" is the module itself */
    const tp_style *style;
} tp_plan_entry;

/* src_data_rank: every rank already holds the parameters' values; nothing is
 * sent. */
#define TP_SRC_DATA_RANK_NONE (-1)

typedef struct tp_parallelize_options {
    /* The mesh rank whose parameter values are used (PyTorch's
     * src_data_rank; 0, the zero value, by default): each parameter a style
     * shards is scattered from it (one scatter: each rank receives only its
     * shard), each one it replicates broadcast from it (one broadcast),
     * through tp_dtensor_distribute. SequenceParallel sends nothing (its
     * parameters are taken to be equal everywhere, as in PyTorch). Or
     * TP_SRC_DATA_RANK_NONE: every rank's own values are used and nothing is
     * sent. Another value is TP_ERR_INVALID_ARG before any communication. */
    int src_data_rank;
    /* receives the indices of plan entries that matched no module (may be
     * NULL); *n_unmatched is their count. Unmatched entries are an error
     * unless allow_unmatched. */
    int *unmatched;
    int *n_unmatched;
    bool allow_unmatched;
} tp_parallelize_options;

/*
 * Collective over the mesh: applies each plan entry's style to every module
 * whose FQN (relative to `module`) matches the entry's pattern, token by
 * token with fnmatch ("layers.*.attention.wq", "net[12]"). `mesh` must be
 * 1-D (pass tp_mesh_slice of a larger mesh). Colwise/Rowwise on a module that
 * is not Linear or Embedding, or a second parameter-sharding style on the same
 * module, are TP_ERR_INVALID_ARG naming the module. The module's hooks and
 * DTensor parameters hold references on `mesh`: the caller may free its mesh
 * right after this call.
 */
TP_API tp_status tp_parallelize_module(tp_module *module, tp_mesh *mesh, int n,
                                       const tp_plan_entry *plan,
                                       const tp_parallelize_options *opts);

/* fnmatch-per-token test of a dotted FQN against a dotted pattern. */
TP_API bool tp_fqn_match(const char *pattern, const char *fqn);

#ifdef __cplusplus
}
#endif

#endif /* TP_STYLES_H */
