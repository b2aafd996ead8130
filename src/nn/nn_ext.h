/* What the layers above nn (styles, and whatever builds on modules next) may
 * know of a module beyond tp/nn.h: a few accessors and a slot for their own
 * per-module state. The module's layout stays private to src/nn
 * (nn_internal.h); an upper layer includes this header, never that one.
 * Not installed.
 *
 * Besides these, upper layers use the public API: tp_module_kind_of and
 * tp_module_type_name (the type), tp_module_parameter /
 * tp_module_set_parameter (a parameter by name), tp_module_num_children /
 * tp_module_child_at (the tree), and the tp_module_add_*_hook functions. */
#ifndef TP_NN_EXT_H
#define TP_NN_EXT_H

#include <stdint.h>

#include "core/core.h"
#include "tp/nn.h"

/* A Linear's in_features (the global size of its input's last dim); -1 for
 * another kind or NULL. */
int64_t tp__module_linear_in(const tp_module *m);

/* m's own parameter slots (not its children's), in registration order,
 * absent ones (a Linear's bias without bias) included; 0 for NULL. */
int tp__module_num_params(const tp_module *m);
/* Slot i's tensor (borrowed; NULL for an absent parameter or i out of
 * range), its name in *name (may be NULL; NULL when i is out of range).
 * Replace it with tp_module_set_parameter. */
tp_tensor *tp__module_param_at(const tp_module *m, int i, const char **name);

/* ---- attachments ----------------------------------------------------------------
 *
 * State an upper layer keeps on a module (the parameter-sharding style that
 * distributed its parameters, say), keyed by the address of an object the
 * owner defines (`static const char key;`), so that owners never collide and
 * the module knows nothing of them. The module owns what is attached:
 * free_fn (may be NULL) runs once, when the attachment is replaced or
 * removed, or when the last module holding it is freed (a replica made by
 * tp_module_replicate holds its original's attachments too). Not
 * thread-safe: a module is changed by one thread at a time. */

/* Attaches ptr under key, replacing (and freeing) what was attached there;
 * ptr NULL removes the attachment. On failure (TP_ERR_NO_MEMORY, or
 * TP_ERR_INVALID_ARG for a NULL module or key) the caller keeps ptr:
 * free_fn is not called. */
tp_status tp__module_attach(tp_module *m, const void *key, void *ptr, void (*free_fn)(void *));
/* What is attached to m under key, or NULL. */
void *tp__module_attached(const tp_module *m, const void *key);

#endif /* TP_NN_EXT_H */
