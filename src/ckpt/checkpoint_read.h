/* Internal to src/ckpt: reading checkpoints (checkpoint_read.c), used by
 * the load (checkpoint_load.c). */
#ifndef TP_CKPT_CHECKPOINT_READ_H
#define TP_CKPT_CHECKPOINT_READ_H

#include <jansson.h>

#include "ckpt/checkpoint_internal.h"

typedef struct tp__ck_dfile {
    char *path;
    int fd;          /* opened at first use; -1 */
    uint64_t size;   /* as recorded */
    uint64_t actual; /* as found */
} tp__ck_dfile;

/* A stored block: bytes [offset, offset + length) of a data file, holding
 * box [begin, end) of its tensor, row-major. */
typedef struct tp__ck_shard {
    int file;
    uint64_t offset, length;
    int64_t begin[TP_MAX_DIMS], end[TP_MAX_DIMS];
    uint32_t crc;
} tp__ck_shard;

/* A tensor of the checkpoint, checked: dtype, global shape, its blocks
 * (inside the tensor and their files, tiling it). */
typedef struct tp__ck_entry {
    int dtype;
    int ndim;
    int64_t shape[TP_MAX_DIMS];
    int n;
    tp__ck_shard *s;
    uint64_t numel_sum;
} tp__ck_entry;

typedef struct tp__ck_reader {
    const char *fn;
    const char *dir; /* borrowed */
    char *meta;      /* dir/metadata.json */
    json_t *root;
    tp__ck_dfile *files;
    int nfiles;
} tp__ck_reader;

/* Reads and checks metadata.json (format, version, files, their sizes). On
 * failure r holds what was opened: close it either way. */
tp_status tp__ck_reader_open(const char *fn, const char *dir, tp__ck_reader *r);
void tp__ck_reader_close(tp__ck_reader *r);

/* Parses and checks entry j (`what` names it in errors). */
tp_status tp__ck_parse_entry(const tp__ck_reader *r, const char *what, json_t *j, tp__ck_entry *e);
void tp__ck_entry_free(tp__ck_entry *e);

typedef enum {
    TP__CK_READ_VERIFY, /* read, and check the CRCs this rank checks */
    TP__CK_VERIFY,      /* only check them (each block read whole, in chunks) */
    TP__CK_READ,        /* only read */
} tp__ck_read_mode;

/* Reads this rank's block of param's tensor (global shape e's) from the
 * stored blocks into dst (row-major, e's dtype, the block's shape), and/or
 * checks the CRC of the blocks this rank is to check (salt spreads the ones
 * no rank reads whole over the ranks). */
tp_status tp__ck_read_box(tp__ck_reader *r, const tp__ck_list *l, const char *what,
                          const tp__ck_entry *e, const tp_tensor *param, int salt,
                          tp__ck_read_mode mode, void *dst);

#endif /* TP_CKPT_CHECKPOINT_READ_H */
