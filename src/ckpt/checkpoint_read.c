/* Reading a sharded checkpoint: metadata.json checked entry by entry, and
 * the part of a tensor one rank needs read from the stored blocks that
 * overlap it (pread runs), with the blocks' CRC-32C verified once per load.
 * See tp/checkpoint.h; the load itself is checkpoint_load.c. */
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt/checkpoint_read.h"

#define TP__CK_MAX_META (1u << 30)
#define TP__CK_VERIFY_CHUNK (4u << 20)
#define TP__CK_READ_CHUNK (4u << 20)
#define TP__CK_SPLIT_MIN (16u << 20) /* a plain read this long is read in two halves at once */

/* ---- metadata.json and the data files ---------------------------------------------- */

static tp_status tp__ck_slurp(const char *fn, const char *path, char **out, size_t *len)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return tp__error(TP_ERR_BACKEND, "%s: cannot open '%s': %s", fn, path, strerror(errno));
    struct stat sb;
    tp_status st = TP_OK;
    if (fstat(fd, &sb) != 0 || (uint64_t)sb.st_size > TP__CK_MAX_META)
        st = tp__error(TP_ERR_INVALID_ARG, "%s: '%s': cannot stat it or larger than %u bytes", fn,
                       path, TP__CK_MAX_META);
    char *text = st == TP_OK ? tp__malloc((size_t)sb.st_size + 1) : NULL;
    if (st == TP_OK && !text)
        st = tp__error(TP_ERR_NO_MEMORY, "%s: out of memory reading '%s'", fn, path);
    if (st == TP_OK)
        st = tp__ck_pread(fd, path, text, (size_t)sb.st_size, 0, false);
    close(fd);
    if (st != TP_OK) {
        tp__free(text);
        return st;
    }
    text[sb.st_size] = '\0';
    *out = text;
    *len = (size_t)sb.st_size;
    return TP_OK;
}

/* "files": names (plain) and recorded sizes; each one's actual size. */
static tp_status tp__ck_files(tp__ck_reader *r)
{
    json_t *files = json_object_get(r->root, "files");
    if (!json_is_array(files) || json_array_size(files) == 0 || json_array_size(files) > (1u << 20))
        return tp__error(TP_ERR_INVALID_ARG, "%s: '%s': \"files\" is not a non-empty array", r->fn,
                         r->meta);
    r->nfiles = (int)json_array_size(files);
    r->files = tp__calloc((size_t)r->nfiles, sizeof *r->files);
    if (!r->files)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", r->fn);
    for (int i = 0; i < r->nfiles; i++)
        r->files[i].fd = -1;
    for (int i = 0; i < r->nfiles; i++) {
        tp__ck_dfile *f = &r->files[i];
        json_t *e = json_array_get(files, (size_t)i), *name = json_object_get(e, "name"),
               *size = json_object_get(e, "size");
        if (!json_is_string(name) || strchr(json_string_value(name), '/') ||
            !json_is_integer(size) || json_integer_value(size) < 0)
            return tp__error(TP_ERR_INVALID_ARG,
                             "%s: '%s': files[%d] needs a plain file name and a size", r->fn,
                             r->meta, i);
        f->size = (uint64_t)json_integer_value(size);
        if (!(f->path = tp__ck_path(r->dir, json_string_value(name))))
            return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", r->fn);
        struct stat sb;
        if (stat(f->path, &sb) != 0)
            return tp__error(TP_ERR_BACKEND, "%s: cannot stat data file '%s': %s", r->fn, f->path,
                             strerror(errno));
        f->actual = (uint64_t)sb.st_size;
    }
    return TP_OK;
}

tp_status tp__ck_reader_open(const char *fn, const char *dir, tp__ck_reader *r)
{
    memset(r, 0, sizeof *r);
    r->fn = fn;
    r->dir = dir;
    if (!(r->meta = tp__ck_path(dir, TP__CK_META)))
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    char *text = NULL;
    size_t len = 0;
    TP_CHECK(tp__ck_slurp(fn, r->meta, &text, &len));
    json_error_t jerr;
    r->root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
    tp__free(text);
    if (!r->root)
        return tp__error(TP_ERR_INVALID_ARG, "%s: '%s': malformed JSON at line %d column %d: %s",
                         fn, r->meta, jerr.line, jerr.column, jerr.text);
    json_t *format = json_object_get(r->root, "format"),
           *version = json_object_get(r->root, "version");
    if (!json_is_string(format) || strcmp(json_string_value(format), TP__CK_FORMAT) ||
        !json_is_integer(version))
        return tp__error(TP_ERR_INVALID_ARG,
                         "%s: '%s' is not a libtp checkpoint (needs \"format\": \"%s\" and an "
                         "integer \"version\")",
                         fn, r->meta, TP__CK_FORMAT);
    if (json_integer_value(version) > TP_CHECKPOINT_VERSION || json_integer_value(version) < 1)
        return tp__error(TP_ERR_NOT_SUPPORTED,
                         "%s: '%s' has format version %lld; this library reads version %d", fn,
                         r->meta, (long long)json_integer_value(version), TP_CHECKPOINT_VERSION);
    if (!json_is_object(json_object_get(r->root, "model")))
        return tp__error(TP_ERR_INVALID_ARG, "%s: '%s': no \"model\" object", fn, r->meta);
    return tp__ck_files(r);
}

void tp__ck_reader_close(tp__ck_reader *r)
{
    for (int i = 0; r->files && i < r->nfiles; i++) {
        if (r->files[i].fd >= 0)
            close(r->files[i].fd);
        tp__free(r->files[i].path);
    }
    tp__free(r->files);
    tp__free(r->meta);
    json_decref(r->root);
    memset(r, 0, sizeof *r);
}

static tp_status tp__ck_fd(tp__ck_reader *r, int file, int *fd)
{
    tp__ck_dfile *f = &r->files[file];
    if (f->fd < 0) {
        if ((f->fd = open(f->path, O_RDONLY | O_CLOEXEC)) < 0)
            return tp__error(TP_ERR_BACKEND, "%s: cannot open data file '%s': %s", r->fn, f->path,
                             strerror(errno));
        (void)posix_fadvise(f->fd, 0, 0, POSIX_FADV_SEQUENTIAL); /* a larger readahead */
    }
    *fd = f->fd;
    return TP_OK;
}

/* ---- entries ------------------------------------------------------------------------ */

void tp__ck_entry_free(tp__ck_entry *e)
{
    tp__free(e->s);
    memset(e, 0, sizeof *e);
}

static bool tp__ck_int(json_t *v, int64_t lo, int64_t hi, int64_t *out)
{
    if (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > hi)
        return false;
    *out = json_integer_value(v);
    return true;
}

/* Shard k: its fields, its box inside the tensor, its bytes inside its file
 * (as the metadata records it and as the file is). */
static tp_status tp__ck_parse_shard(const tp__ck_reader *r, const char *what, json_t *j, int k,
                                    tp__ck_entry *e)
{
    tp__ck_shard *s = &e->s[k];
    json_t *b = json_object_get(j, "begin"), *en = json_object_get(j, "end");
    int64_t file = 0, off = 0, len = 0, crc = 0;
    if (!tp__ck_int(json_object_get(j, "file"), 0, r->nfiles - 1, &file) ||
        !tp__ck_int(json_object_get(j, "offset"), 0, INT64_MAX, &off) ||
        !tp__ck_int(json_object_get(j, "length"), 0, INT64_MAX, &len) ||
        !tp__ck_int(json_object_get(j, "crc32c"), 0, UINT32_MAX, &crc) || !json_is_array(b) ||
        !json_is_array(en) || json_array_size(b) != (size_t)e->ndim ||
        json_array_size(en) != (size_t)e->ndim)
        return tp__error(TP_ERR_INVALID_ARG,
                         "%s: %s in '%s': block %d needs file (one of the %d files), offset, "
                         "length, crc32c and begin/end of %d entries",
                         r->fn, what, r->meta, k, r->nfiles, e->ndim);
    s->file = (int)file;
    s->offset = (uint64_t)off;
    s->length = (uint64_t)len;
    s->crc = (uint32_t)crc;
    uint64_t numel = 1;
    for (int d = 0; d < e->ndim; d++) {
        if (!tp__ck_int(json_array_get(b, (size_t)d), 0, e->shape[d], &s->begin[d]) ||
            !tp__ck_int(json_array_get(en, (size_t)d), s->begin[d], e->shape[d], &s->end[d]))
            return tp__error(TP_ERR_INVALID_ARG,
                             "%s: %s in '%s': block %d lies outside the tensor on dim %d", r->fn,
                             what, r->meta, k, d);
        numel *= (uint64_t)(s->end[d] - s->begin[d]);
    }
    if (numel * tp_dtype_size((tp_dtype)e->dtype) != s->length)
        return tp__error(TP_ERR_INVALID_ARG,
                         "%s: %s in '%s': block %d is %llu bytes, its box of %llu %s elements "
                         "needs %llu",
                         r->fn, what, r->meta, k, (unsigned long long)s->length,
                         (unsigned long long)numel, tp__ck_dtype_name((tp_dtype)e->dtype),
                         (unsigned long long)(numel * tp_dtype_size((tp_dtype)e->dtype)));
    e->numel_sum += numel;
    const tp__ck_dfile *f = &r->files[s->file];
    if (s->offset > f->size || s->length > f->size - s->offset)
        return tp__error(TP_ERR_INVALID_ARG,
                         "%s: %s in '%s': block %d at [%llu, +%llu) overflows data file '%s' "
                         "(%llu bytes)",
                         r->fn, what, r->meta, k, (unsigned long long)s->offset,
                         (unsigned long long)s->length, f->path, (unsigned long long)f->size);
    if (s->offset + s->length > f->actual)
        return tp__error(TP_ERR_INVALID_ARG,
                         "%s: %s: block %d at [%llu, +%llu) lies beyond the end of data file "
                         "'%s' (%llu bytes, %llu recorded): truncated file",
                         r->fn, what, k, (unsigned long long)s->offset,
                         (unsigned long long)s->length, f->path, (unsigned long long)f->actual,
                         (unsigned long long)f->size);
    return TP_OK;
}

/* The blocks tile the tensor: their volumes add up and no two overlap. */
static tp_status tp__ck_check_tiling(const tp__ck_reader *r, const char *what,
                                     const tp__ck_entry *e)
{
    uint64_t numel = 1;
    for (int d = 0; d < e->ndim; d++)
        numel *= (uint64_t)e->shape[d];
    bool overlap = false;
    for (int a = 0; a < e->n && !overlap; a++)
        for (int b = a + 1; b < e->n && !overlap; b++) {
            bool meet = true;
            for (int d = 0; d < e->ndim && meet; d++)
                meet = e->s[a].begin[d] < e->s[b].end[d] && e->s[b].begin[d] < e->s[a].end[d];
            uint64_t va = e->s[a].length, vb = e->s[b].length;
            overlap = meet && va && vb;
        }
    if (overlap || e->numel_sum != numel)
        return tp__error(TP_ERR_INVALID_ARG,
                         "%s: %s in '%s': the stored blocks do not tile the tensor (%s, %llu of "
                         "%llu elements)",
                         r->fn, what, r->meta, overlap ? "two overlap" : "they cover",
                         (unsigned long long)e->numel_sum, (unsigned long long)numel);
    return TP_OK;
}

tp_status tp__ck_parse_entry(const tp__ck_reader *r, const char *what, json_t *j, tp__ck_entry *e)
{
    memset(e, 0, sizeof *e);
    json_t *dt = json_object_get(j, "dtype"), *sh = json_object_get(j, "shape"),
           *shards = json_object_get(j, "shards");
    if (!json_is_object(j) || !json_is_string(dt) || !json_is_array(sh) || !json_is_array(shards) ||
        json_array_size(sh) > TP_MAX_DIMS || json_array_size(shards) > (1u << 16))
        return tp__error(TP_ERR_INVALID_ARG,
                         "%s: %s in '%s': needs a dtype, a shape (at most %d dims) and shards",
                         r->fn, what, r->meta, TP_MAX_DIMS);
    e->dtype = tp__ck_dtype_of(json_string_value(dt));
    if (e->dtype < 0)
        return tp__error(TP_ERR_INVALID_ARG, "%s: %s in '%s': unknown dtype '%s'", r->fn, what,
                         r->meta, json_string_value(dt));
    e->ndim = (int)json_array_size(sh);
    uint64_t numel = 1;
    for (int d = 0; d < e->ndim; d++) {
        if (!tp__ck_int(json_array_get(sh, (size_t)d), 0, (int64_t)1 << 40, &e->shape[d]))
            return tp__error(TP_ERR_INVALID_ARG, "%s: %s in '%s': bad shape entry %d", r->fn, what,
                             r->meta, d);
        /* at most 2^48 elements in all, so every block's volume fits */
        if (e->shape[d] && numel > ((uint64_t)1 << 48) / (uint64_t)e->shape[d])
            return tp__error(TP_ERR_INVALID_ARG, "%s: %s in '%s': shape too large", r->fn, what,
                             r->meta);
        numel *= (uint64_t)e->shape[d];
    }
    e->n = (int)json_array_size(shards);
    e->s = tp__calloc((size_t)(e->n ? e->n : 1), sizeof *e->s);
    if (!e->s)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", r->fn);
    for (int k = 0; k < e->n; k++)
        TP_CHECK(tp__ck_parse_shard(r, what, json_array_get(shards, (size_t)k), k, e));
    return tp__ck_check_tiling(r, what, e);
}

/* ---- reading a box ---------------------------------------------------------------- */

/* The second half of a plain read, on a thread of its own. */
typedef struct {
    int fd;
    const char *path;
    char *dst;
    size_t n;
    uint64_t off;
    tp_status st;
    char msg[512];
} tp__ck_rhalf;

static void *tp__ck_rhalf_run(void *arg)
{
    tp__ck_rhalf *h = arg;
    h->st = tp__ck_pread(h->fd, h->path, h->dst, h->n, h->off, false);
    if (h->st != TP_OK)
        snprintf(h->msg, sizeof h->msg, "%s", tp_last_error());
    return NULL;
}

/* Reads n bytes at off into dst; from TP__CK_SPLIT_MIN on, in two halves at
 * once (a second thread), so that copying a large block out of the page
 * cache (the second pass of an in-place load) is not one core's copy. One
 * read when the thread cannot be had. */
static tp_status tp__ck_read_split(int fd, const char *path, char *dst, size_t n, uint64_t off)
{
    size_t half = (n / 2) & ~(size_t)4095;
    tp__ck_rhalf h = {fd, path, dst + half, n - half, off + half, TP_OK, ""};
    pthread_t th;
    if (n < TP__CK_SPLIT_MIN || pthread_create(&th, NULL, tp__ck_rhalf_run, &h) != 0)
        return tp__ck_pread(fd, path, dst, n, off, true);
    tp_status st = tp__ck_pread(fd, path, dst, half, off, true);
    pthread_join(th, NULL);
    if (h.st == TP_OK)
        tp__ck_count_read(n - half);
    else if (st == TP_OK)
        st = tp__error(h.st, "%s", h.msg);
    return st;
}

/* Reads region [lo, hi) of stored block s into dst (a row-major array of
 * shape dshape whose element 0 is at global index doff): one pread per run
 * of elements contiguous in both. *crc (may be NULL): continued over the
 * bytes in file order (a region that is the whole block is read in order). */
static tp_status tp__ck_read_region(tp__ck_reader *r, const tp__ck_entry *e, const tp__ck_shard *s,
                                    const int64_t *lo, const int64_t *hi, char *dst,
                                    const int64_t *dshape, const int64_t *doff, uint32_t *crc)
{
    int nd = e->ndim, fd = -1;
    size_t es = tp_dtype_size((tp_dtype)e->dtype);
    TP_CHECK(tp__ck_fd(r, s->file, &fd));
    /* [d]: elements in dims d.. of the block and of dst (a row-major stride
     * of dim d is [d + 1]) */
    int64_t sstride[TP_MAX_DIMS + 1], dstride[TP_MAX_DIMS + 1];
    sstride[nd] = dstride[nd] = 1;
    for (int d = nd - 1; d >= 0; d--) {
        sstride[d] = sstride[d + 1] * (s->end[d] - s->begin[d]);
        dstride[d] = dstride[d + 1] * dshape[d];
    }
    int k = nd - 1; /* dims after k are whole in the region, the block and dst */
    while (k > 0 && hi[k] - lo[k] == s->end[k] - s->begin[k] && hi[k] - lo[k] == dshape[k])
        k--;
    size_t run = (size_t)(nd ? (hi[k] - lo[k]) * sstride[k + 1] : 1) * es;
    int64_t idx[TP_MAX_DIMS] = {0};
    const char *path = r->files[s->file].path;
    for (;;) {
        int64_t so = 0, dof = 0;
        for (int d = 0; d <= k && nd; d++) {
            int64_t g = lo[d] + (d < k ? idx[d] : 0);
            so += (g - s->begin[d]) * sstride[d + 1];
            dof += (g - doff[d]) * dstride[d + 1];
        }
        char *p = dst + (size_t)dof * es;
        uint64_t from = s->offset + (uint64_t)so * es;
        if (!crc)
            TP_CHECK(tp__ck_read_split(fd, path, p, run, from));
        /* in chunks: each one summed while it is still in cache */
        for (size_t at = 0; crc && at < run; at += TP__CK_READ_CHUNK) {
            size_t len = run - at < TP__CK_READ_CHUNK ? run - at : TP__CK_READ_CHUNK;
            TP_CHECK(tp__ck_pread(fd, path, p + at, len, from + at, true));
            *crc = tp__ck_crc32c(*crc, p + at, len);
        }
        int d = k - 1;
        while (d >= 0 && ++idx[d] == hi[d] - lo[d])
            idx[d--] = 0;
        if (d < 0)
            return TP_OK;
    }
}

static tp_status tp__ck_crc_mismatch(const tp__ck_reader *r, const char *what, int k,
                                     const tp__ck_shard *s, uint32_t got)
{
    return tp__error(TP_ERR_INVALID_ARG,
                     "%s: %s: block %d at [%llu, +%llu) of data file '%s': CRC-32C 0x%08x, the "
                     "metadata says 0x%08x: corrupted data",
                     r->fn, what, k, (unsigned long long)s->offset, (unsigned long long)s->length,
                     r->files[s->file].path, got, s->crc);
}

/* Checking a block's CRC with its reading overlapped: a reader thread
 * reads chunk i + 1 into one buffer while the caller sums chunk i in the
 * other, so a cold load's first pass runs at the disk's speed rather than
 * the disk's plus the checksum's. */
typedef struct tp__ck_rpipe {
    int fd;
    const char *path;
    uint64_t off, len;
    size_t chunk;
    char *buf[2];
    int full[2]; /* 0 free, 1 read, -1 the read failed (st, msg) */
    bool stop;   /* the caller is done: the reader leaves */
    tp_status st;
    char msg[512];
    pthread_mutex_t mu;
    pthread_cond_t cv;
} tp__ck_rpipe;

static void tp__ck_rpipe_post(tp__ck_rpipe *p, int b, int v)
{
    pthread_mutex_lock(&p->mu);
    p->full[b] = v;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

static void *tp__ck_rpipe_reader(void *arg)
{
    tp__ck_rpipe *p = arg;
    int b = 0;
    for (uint64_t at = 0; at < p->len; at += p->chunk, b ^= 1) {
        pthread_mutex_lock(&p->mu);
        while (p->full[b] != 0 && !p->stop)
            pthread_cond_wait(&p->cv, &p->mu);
        bool stop = p->stop;
        pthread_mutex_unlock(&p->mu);
        if (stop)
            break;
        size_t n = p->len - at < p->chunk ? (size_t)(p->len - at) : p->chunk;
        tp_status st = tp__ck_pread(p->fd, p->path, p->buf[b], n, p->off + at, false);
        if (st != TP_OK) {
            p->st = st; /* read by the caller after it sees -1 under the lock */
            snprintf(p->msg, sizeof p->msg, "%s", tp_last_error());
            tp__ck_rpipe_post(p, b, -1);
            break;
        }
        tp__ck_rpipe_post(p, b, 1);
    }
    return NULL;
}

/* The CRC of p's range, read by p's reader thread (started here; *started
 * false, and nothing read, when it cannot be). */
static tp_status tp__ck_rpipe_crc(tp__ck_rpipe *p, bool *started, uint32_t *crc)
{
    pthread_t th;
    *started = pthread_create(&th, NULL, tp__ck_rpipe_reader, p) == 0;
    if (!*started)
        return TP_OK;
    tp_status st = TP_OK;
    int b = 0;
    for (uint64_t at = 0; at < p->len && st == TP_OK; at += p->chunk, b ^= 1) {
        pthread_mutex_lock(&p->mu);
        while (p->full[b] == 0)
            pthread_cond_wait(&p->cv, &p->mu);
        int v = p->full[b];
        pthread_mutex_unlock(&p->mu);
        if (v < 0) {
            st = tp__error(p->st, "%s", p->msg);
            break;
        }
        size_t n = p->len - at < p->chunk ? (size_t)(p->len - at) : p->chunk;
        *crc = tp__ck_crc32c(*crc, p->buf[b], n);
        tp__ck_count_read(n);
        tp__ck_rpipe_post(p, b, 0);
    }
    pthread_mutex_lock(&p->mu);
    p->stop = true;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    pthread_join(th, NULL);
    return st;
}

/* Reads a whole block in bounded chunks, only to check its CRC: overlapped
 * (tp__ck_rpipe) when it spans several chunks, else (or when the second
 * buffer or the thread cannot be had) one chunk after the other. */
static tp_status tp__ck_verify_stream(tp__ck_reader *r, const char *what, int k,
                                      const tp__ck_shard *s)
{
    int fd = -1;
    TP_CHECK(tp__ck_fd(r, s->file, &fd));
    size_t chunk = s->length < TP__CK_VERIFY_CHUNK ? (size_t)s->length : TP__CK_VERIFY_CHUNK;
    tp__ck_rpipe p = {.fd = fd,
                      .path = r->files[s->file].path,
                      .off = s->offset,
                      .len = s->length,
                      .chunk = chunk};
    p.buf[0] = tp__malloc(chunk ? chunk : 1);
    if (!p.buf[0])
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", r->fn);
    uint32_t crc = 0;
    tp_status st = TP_OK;
    bool started = false;
    if (s->length > chunk && (p.buf[1] = tp__malloc(chunk)) != NULL) {
        pthread_mutex_init(&p.mu, NULL);
        pthread_cond_init(&p.cv, NULL);
        st = tp__ck_rpipe_crc(&p, &started, &crc);
        pthread_cond_destroy(&p.cv);
        pthread_mutex_destroy(&p.mu);
        tp__free(p.buf[1]);
    }
    if (!started) {
        for (uint64_t at = 0; at < s->length && st == TP_OK; at += chunk) {
            size_t n = s->length - at < chunk ? (size_t)(s->length - at) : chunk;
            st = tp__ck_pread(fd, p.path, p.buf[0], n, s->offset + at, true);
            crc = tp__ck_crc32c(crc, p.buf[0], n);
        }
    }
    tp__free(p.buf[0]);
    if (st == TP_OK && crc != s->crc)
        st = tp__ck_crc_mismatch(r, what, k, s, crc);
    return st;
}

/* Whether box [off, off + shape) contains block s. */
static bool tp__ck_contains(int nd, const int64_t *shape, const int64_t *off, const tp__ck_shard *s)
{
    for (int d = 0; d < nd; d++)
        if (s->begin[d] < off[d] || s->end[d] > off[d] + shape[d])
            return false;
    return true;
}

/* Which rank checks block s's CRC: the lowest whose box holds all of it,
 * else (no rank needs all of it) one chosen by the block's index; *whole:
 * that rank reads all of it anyway. */
static tp_status tp__ck_verifier(const tp__ck_list *l, const tp_tensor *param, int nd,
                                 const tp__ck_shard *s, int salt, int *rank, bool *whole)
{
    for (int q = 0; q < l->size; q++) {
        int64_t shape[TP_MAX_DIMS], off[TP_MAX_DIMS];
        bool owner;
        TP_CHECK(tp__ck_block(l, param, q, shape, off, &owner));
        if (tp__ck_contains(nd, shape, off, s)) {
            *rank = q;
            *whole = true;
            return TP_OK;
        }
    }
    *rank = salt % l->size;
    *whole = false;
    return TP_OK;
}

tp_status tp__ck_read_box(tp__ck_reader *r, const tp__ck_list *l, const char *what,
                          const tp__ck_entry *e, const tp_tensor *param, int salt,
                          tp__ck_read_mode mode, void *dst)
{
    int nd = e->ndim;
    int64_t shape[TP_MAX_DIMS], off[TP_MAX_DIMS];
    bool owner;
    TP_CHECK(tp__ck_block(l, param, l->rank, shape, off, &owner));
    for (int k = 0; k < e->n; k++) {
        const tp__ck_shard *s = &e->s[k];
        if (s->length == 0)
            continue;
        int vr = 0;
        bool whole = false;
        if (mode != TP__CK_READ)
            TP_CHECK(tp__ck_verifier(l, param, nd, s, salt + k, &vr, &whole));
        bool mine = mode != TP__CK_READ && vr == l->rank;
        if (mine && (!whole || mode == TP__CK_VERIFY))
            TP_CHECK(tp__ck_verify_stream(r, what, k, s));
        if (mode == TP__CK_VERIFY)
            continue;
        int64_t lo[TP_MAX_DIMS], hi[TP_MAX_DIMS];
        bool empty = false;
        for (int d = 0; d < nd; d++) {
            lo[d] = s->begin[d] > off[d] ? s->begin[d] : off[d];
            hi[d] = s->end[d] < off[d] + shape[d] ? s->end[d] : off[d] + shape[d];
            empty = empty || lo[d] >= hi[d];
        }
        if (empty)
            continue;
        uint32_t crc = 0;
        bool check = mine && whole;
        TP_CHECK(tp__ck_read_region(r, e, s, lo, hi, dst, shape, off, check ? &crc : NULL));
        if (check && crc != s->crc)
            return tp__ck_crc_mismatch(r, what, k, s, crc);
    }
    return TP_OK;
}
