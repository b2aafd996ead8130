/* Internal to src/ckpt: the parsed header of a safetensors file. */
#ifndef TP_CKPT_ST_INTERNAL_H
#define TP_CKPT_ST_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tp/mesh.h"
#include "tp/safetensors.h"
#include "tp/tensor.h"

typedef struct tp__st_entry {
    char *name;
    char dtype_name[16];
    int dtype;   /* a tp_dtype, or -1: a dtype of the format libtp cannot load */
    size_t size; /* element bytes */
    int ndim;
    int64_t shape[TP_MAX_DIMS];
    uint64_t begin, end; /* in the data buffer */
} tp__st_entry;

typedef struct tp__st_file {
    int fd;
    char *path;
    uint64_t data_start, data_size;
    int n;
    tp__st_entry *e;
} tp__st_file;

typedef struct tp__st_paths {
    char **p;
    int n;
    size_t cap;
} tp__st_paths;

/* Opens and checks a file's header (on failure *f holds nothing). */
tp_status tp__st_file_open(const char *path, tp__st_file *f);
void tp__st_file_close(tp__st_file *f);
/* pread of exactly n bytes; `data` bytes count in tp_safetensors_bytes_read. */
tp_status tp__st_pread(const tp__st_file *f, void *buf, size_t n, uint64_t off, bool data);
/* The distinct shard files of an index, as paths beside it. */
tp_status tp__st_index(const char *path, tp__st_paths *out);
void tp__st_paths_free(tp__st_paths *p);
/* The format's name of a libtp dtype. */
const char *tp__st_dtype_name(tp_dtype d);

/* The ranks of mesh (NULL: no communication) agree on an outcome through one
 * all_reduce of flag (a 1-element i32 CPU tensor): local_st where this rank
 * failed, TP_ERR_MISMATCH where only another rank did, TP_OK otherwise. */
tp_status tp__st_agree(const char *fn, tp_mesh *mesh, tp_tensor *flag, tp_status local_st);

#endif /* TP_CKPT_ST_INTERNAL_H */
