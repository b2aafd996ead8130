/* Internal interface between styles.c (the style objects and their hooks) and
 * parallelize.c (plan matching). Not installed. */
#ifndef TP_STYLES_INTERNAL_H
#define TP_STYLES_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>

#include "nn/nn_ext.h"
#include "tp/styles.h"

/* "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
 * "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput". */
const char *tp__style_name(const tp_style *s);

/* true for the styles that distribute parameters (Colwise, Rowwise,
 * SequenceParallel): at most one of them per module. */
bool tp__style_shards_params(const tp_style *s);

/* The parameter-sharding style applied to m ("ColwiseParallel", ...), or
 * NULL. */
const char *tp__style_sharded_by(const tp_module *m);

/* "'net1'" or "the root module" (fqn NULL or "") into buf; returns buf. */
const char *tp__style_where(const char *fqn, char *buf, size_t len);

/* Local check (no communication, nothing changed) that the style can apply to
 * m, whose FQN relative to the parallelized root is fqn: Colwise/Rowwise need
 * a Linear or an Embedding. */
tp_status tp__style_check(const tp_style *s, const tp_module *m, const char *fqn);

/* Applies the style to m: distributes its parameters from mesh rank
 * src_data_rank (collective over the mesh when it is >= 0;
 * TP_SRC_DATA_RANK_NONE sends nothing) and installs the hooks. */
tp_status tp__style_apply(const tp_style *s, tp_module *m, const char *fqn, tp_mesh *mesh,
                          int src_data_rank);

#endif /* TP_STYLES_INTERNAL_H */
