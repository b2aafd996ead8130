/* Internal to src/ckpt: sharded checkpoints (tp/checkpoint.h), shared by
 * checkpoint.c (what is saved, blocks, agreement), checkpoint_save.c and
 * checkpoint_load.c. */
#ifndef TP_CKPT_CHECKPOINT_INTERNAL_H
#define TP_CKPT_CHECKPOINT_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/base.h"
#include "nn/nn_ext.h"
#include "tp/checkpoint.h"
#include "tp/comm.h"
#include "tp/dtensor.h"
#include "tp/mesh.h"

#define TP__CK_META "metadata.json"
#define TP__CK_FORMAT "libtp-checkpoint"
#define TP__CK_ALIGN 64 /* blocks start on multiples of it in a data file */

/* What a tensor of the checkpoint is. */
typedef enum {
    TP__CK_PARAM = 0,
    TP__CK_EXP_AVG,    /* Adam m */
    TP__CK_EXP_AVG_SQ, /* Adam v */
    TP__CK_MOMENTUM,   /* SGD momentum buffer */
    TP__CK_MASTER,     /* f32 master of a bf16/f16 parameter */
    TP__CK_KINDS
} tp__ck_kind;

/* Their names in metadata.json (the optimizer's as torch's state_dict). */
extern const char *const tp__ck_kind_names[TP__CK_KINDS];

/* One tensor to save or load: a parameter or an optimizer state of one. */
typedef struct tp__ck_item {
    const char *fqn; /* the parameter's (borrowed from the list) */
    tp__ck_kind kind;
    tp_tensor *param; /* borrowed: mesh, placements, global shape */
    tp_tensor *local; /* save: the tensor holding this rank's block (borrowed) */
    tp_dtype dtype;   /* stored dtype: the parameter's, f32 for states */
} tp__ck_item;

/* The parameters (and optimizer states) in named_parameters order. */
typedef struct tp__ck_list {
    const char *fn;
    char **fqns; /* one per parameter, owned */
    tp_tensor **params;
    int np;
    size_t cap_p, cap_params;
    tp__ck_item *it;
    int n;
    size_t cap;
    int64_t *steps; /* optimizer steps per parameter; -1: no state */
    tp_mesh *mesh;  /* of the DTensor parameters; NULL: none */
    tp_comm *comm;  /* who takes part; NULL: the caller alone */
    int rank, size;
    tp__opt_ref opt;
} tp__ck_list;

/* Who takes part (the mesh of m's first DTensor parameter, or o->comm) and
 * the optimizer; checks the arguments. No allocation, no communication: the
 * same outcome on every rank. */
tp_status tp__ck_list_init(const char *fn, tp_module *m, const tp_checkpoint_optim *optim,
                           const tp_checkpoint_options *o, tp__ck_list *l);
/* Lists m's parameters (and, when with_state, the optimizer's states as
 * items); checks one mesh and no Partial placement. On failure l holds what
 * was listed: free it with tp__ck_list_free either way. */
tp_status tp__ck_list_fill(tp__ck_list *l, tp_module *m, bool with_state);
void tp__ck_list_free(tp__ck_list *l);
tp_status tp__ck_list_add(tp__ck_list *l, int p, tp__ck_kind kind, tp_tensor *local,
                          tp_dtype dtype);

/* The block of tensor `param` (global shape) that rank `rank` of the list's
 * group holds: shape and offset; *owner: whether that rank stores it (its
 * coordinate is 0 on every Replicate mesh dim; rank 0 for a plain tensor). */
tp_status tp__ck_block(const tp__ck_list *l, const tp_tensor *param, int rank, int64_t *shape,
                       int64_t *offset, bool *owner);

/* The ranks agree on an outcome: one all_reduce (the lowest failing rank),
 * then, when one failed, one broadcast of its status and message, which
 * every rank returns. comm NULL: local_st. */
tp_status tp__ck_agree(tp_comm *comm, tp_status local_st);

/* CRC-32C (Castagnoli) of n bytes, continuing crc (0 to start). */
uint32_t tp__ck_crc32c(uint32_t crc, const void *buf, size_t n);

/* Full-length pread / pwrite on fd, named path in errors. pread of data
 * (data files) counts in tp_checkpoint_bytes_read. */
tp_status tp__ck_pread(int fd, const char *path, void *buf, size_t n, uint64_t off, bool data);
tp_status tp__ck_pwrite(int fd, const char *path, const void *buf, size_t n, uint64_t off);
/* Adds n bytes read for this thread's tp_checkpoint_bytes_read (reads made
 * by a helper thread with data false, counted by the thread it serves). */
void tp__ck_count_read(uint64_t n);

/* "dir/name" into a new string (tp__malloc), NULL when out of memory. */
char *tp__ck_path(const char *dir, const char *name);
/* Data file name of rank r: "rank-00003.bin". */
void tp__ck_file_name(int r, char *buf, size_t len);
/* The dtype named (F32, F64, F16, BF16, I32, I64) or -1. */
int tp__ck_dtype_of(const char *name);
const char *tp__ck_dtype_name(tp_dtype d);

#endif /* TP_CKPT_CHECKPOINT_INTERNAL_H */
