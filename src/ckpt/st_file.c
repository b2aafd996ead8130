/* Reading safetensors headers (see tp/safetensors.h for the format): the
 * 8-byte length, the JSON (jansson), every entry checked against the file
 * before any tensor data is read. Also the index of a sharded set. */
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt/st_internal.h"
#include "core/base.h"

#define TP__ST_MAX_HEADER (100u * 1000u * 1000u) /* the format's own limit */

static const struct {
    const char *name;
    size_t size;
    int dtype; /* a tp_dtype, or -1: not loadable */
} tp__st_dtypes[] = {
    {"F32", 4, TP_F32}, {"F64", 8, TP_F64}, {"F16", 2, TP_F16}, {"BF16", 2, TP_BF16},
    {"I32", 4, TP_I32}, {"I64", 8, TP_I64}, {"I16", 2, -1},     {"I8", 1, -1},
    {"U8", 1, -1},      {"U16", 2, -1},     {"U32", 4, -1},     {"U64", 8, -1},
    {"BOOL", 1, -1},    {"F8_E4M3", 1, -1}, {"F8_E5M2", 1, -1},
};

const char *tp__st_dtype_name(tp_dtype d)
{
    for (size_t i = 0; i < sizeof tp__st_dtypes / sizeof *tp__st_dtypes; i++)
        if (tp__st_dtypes[i].dtype == (int)d)
            return tp__st_dtypes[i].name;
    return NULL;
}

/* Full-length pread; counts data bytes in the thread's counter when `data`. */
static _Thread_local uint64_t tp__st_read_total;

uint64_t tp_safetensors_bytes_read(void)
{
    return tp__st_read_total;
}

tp_status tp__st_pread(const tp__st_file *f, void *buf, size_t n, uint64_t off, bool data)
{
    char *p = buf;
    while (n > 0) {
        ssize_t got = pread(f->fd, p, n, (off_t)off);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            return tp__error(TP_ERR_BACKEND, "cannot read %zu bytes at offset %llu of '%s': %s", n,
                             (unsigned long long)off, f->path,
                             got < 0 ? strerror(errno) : "unexpected end of file");
        if (data)
            tp__st_read_total += (uint64_t)got;
        p += got;
        n -= (size_t)got;
        off += (uint64_t)got;
    }
    return TP_OK;
}

/* Opens for reading without waiting: a FIFO named as a checkpoint file would
 * block open() until some writer came (the caller then refuses anything but a
 * regular file); regular files ignore O_NONBLOCK. */
static int tp__st_open_regular(const char *path)
{
    return open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
}

void tp__st_file_close(tp__st_file *f)
{
    if (!f)
        return;
    if (f->fd >= 0)
        close(f->fd);
    for (int i = 0; i < f->n; i++)
        tp__free(f->e[i].name);
    tp__free(f->e);
    tp__free(f->path);
    f->fd = -1;
    f->e = NULL;
    f->path = NULL;
    f->n = 0;
}

/* One header entry: dtype, shape, data_offsets, checked against the data
 * buffer size. */
static tp_status tp__st_parse_entry(const tp__st_file *f, const char *name, json_t *v,
                                    tp__st_entry *e)
{
    const char *p = f->path;
    if (!json_is_object(v))
        return tp__error(TP_ERR_INVALID_ARG, "tensor '%s' in '%s': entry is not a JSON object",
                         name, p);
    json_t *dt = json_object_get(v, "dtype"), *sh = json_object_get(v, "shape"),
           *off = json_object_get(v, "data_offsets");
    if (!json_is_string(dt) || !json_is_array(sh) || !json_is_array(off) ||
        json_array_size(off) != 2)
        return tp__error(TP_ERR_INVALID_ARG,
                         "tensor '%s' in '%s': needs a string dtype, a shape array and "
                         "data_offsets [begin, end]",
                         name, p);
    e->size = 0;
    for (size_t i = 0; i < sizeof tp__st_dtypes / sizeof *tp__st_dtypes; i++)
        if (!strcmp(json_string_value(dt), tp__st_dtypes[i].name)) {
            e->size = tp__st_dtypes[i].size;
            e->dtype = tp__st_dtypes[i].dtype;
        }
    if (!e->size)
        return tp__error(TP_ERR_NOT_SUPPORTED, "tensor '%s' in '%s': unknown dtype '%s'", name, p,
                         json_string_value(dt));
    snprintf(e->dtype_name, sizeof e->dtype_name, "%s", json_string_value(dt));
    e->ndim = (int)json_array_size(sh);
    if (e->ndim > TP_MAX_DIMS)
        return tp__error(TP_ERR_NOT_SUPPORTED, "tensor '%s' in '%s': %d dims (at most %d)", name, p,
                         e->ndim, TP_MAX_DIMS);
    /* span, the product of the sizes other than 0, is checked before each
     * multiplication, as tp_tensor_empty checks it (a 0 does not excuse the
     * others): numel checked after its product alone let [2^24, 2^24, 2^16]
     * wrap to 0 elements and pass */
    uint64_t numel = 1, span = 1;
    for (int d = 0; d < e->ndim; d++) {
        json_t *x = json_array_get(sh, (size_t)d);
        if (!json_is_integer(x) || json_integer_value(x) < 0 ||
            json_integer_value(x) > (json_int_t)(1LL << 40))
            return tp__error(TP_ERR_INVALID_ARG, "tensor '%s' in '%s': bad shape entry %d", name, p,
                             d);
        e->shape[d] = json_integer_value(x);
        const uint64_t s = e->shape[d] ? (uint64_t)e->shape[d] : 1;
        if (span > (uint64_t)INT64_MAX / s)
            return tp__error(TP_ERR_INVALID_ARG, "tensor '%s' in '%s': shape too large", name, p);
        span *= s;
        numel *= (uint64_t)e->shape[d];
        if (numel > (1ULL << 48))
            return tp__error(TP_ERR_INVALID_ARG, "tensor '%s' in '%s': shape too large", name, p);
    }
    json_t *b = json_array_get(off, 0), *en = json_array_get(off, 1);
    if (!json_is_integer(b) || !json_is_integer(en) || json_integer_value(b) < 0 ||
        json_integer_value(en) < json_integer_value(b))
        return tp__error(TP_ERR_INVALID_ARG, "tensor '%s' in '%s': bad data_offsets", name, p);
    e->begin = (uint64_t)json_integer_value(b);
    e->end = (uint64_t)json_integer_value(en);
    if (e->end > f->data_size)
        return tp__error(TP_ERR_INVALID_ARG,
                         "tensor '%s' in '%s': data_offsets [%llu, %llu) lie beyond the end of "
                         "the data (%llu bytes; truncated file?)",
                         name, p, (unsigned long long)e->begin, (unsigned long long)e->end,
                         (unsigned long long)f->data_size);
    if (e->end - e->begin != numel * e->size)
        return tp__error(TP_ERR_INVALID_ARG,
                         "tensor '%s' in '%s': data_offsets span %llu bytes, dtype %s x shape "
                         "needs %llu",
                         name, p, (unsigned long long)(e->end - e->begin), e->dtype_name,
                         (unsigned long long)(numel * e->size));
    return TP_OK;
}

static int tp__st_cmp_begin(const void *a, const void *b)
{
    const tp__st_entry *x = a, *y = b;
    return x->begin < y->begin ? -1 : x->begin > y->begin;
}

/* No two tensors share bytes (empty tensors share nothing). */
static tp_status tp__st_check_overlap(const tp__st_file *f)
{
    tp__st_entry *c = tp__malloc((size_t)(f->n ? f->n : 1) * sizeof *c);
    if (!c)
        return tp__error(TP_ERR_NO_MEMORY, "reading '%s': out of memory", f->path);
    memcpy(c, f->e, (size_t)f->n * sizeof *c);
    qsort(c, (size_t)f->n, sizeof *c, tp__st_cmp_begin);
    tp_status st = TP_OK;
    const tp__st_entry *last = NULL; /* the one reaching furthest so far */
    for (int i = 0; i < f->n && st == TP_OK; i++) {
        if (c[i].begin == c[i].end)
            continue;
        if (last && c[i].begin < last->end)
            st = tp__error(TP_ERR_INVALID_ARG,
                           "tensors '%s' and '%s' in '%s' overlap ([%llu, %llu) and [%llu, %llu))",
                           last->name, c[i].name, f->path, (unsigned long long)last->begin,
                           (unsigned long long)last->end, (unsigned long long)c[i].begin,
                           (unsigned long long)c[i].end);
        if (!last || c[i].end > last->end)
            last = &c[i];
    }
    tp__free(c);
    return st;
}

/* Reads and checks the 8-byte length and the JSON text: *out (tp__malloc,
 * 0-terminated). */
static tp_status tp__st_header_text(tp__st_file *f, char **out)
{
    struct stat sb;
    if (fstat(f->fd, &sb) != 0)
        return tp__error(TP_ERR_BACKEND, "cannot stat '%s': %s", f->path, strerror(errno));
    if (!S_ISREG(sb.st_mode))
        return tp__error(TP_ERR_BACKEND, "'%s' is not a regular file", f->path);
    uint64_t fsize = (uint64_t)sb.st_size;
    unsigned char lenb[8];
    if (fsize < 8)
        return tp__error(TP_ERR_INVALID_ARG,
                         "'%s' is %llu bytes: too short for a safetensors "
                         "header length",
                         f->path, (unsigned long long)fsize);
    TP_CHECK(tp__st_pread(f, lenb, 8, 0, false));
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--)
        n = n << 8 | lenb[i];
    if (n > TP__ST_MAX_HEADER || n > fsize - 8)
        return tp__error(
            TP_ERR_INVALID_ARG, "'%s': header length %llu is too large (file %llu bytes, limit %u)",
            f->path, (unsigned long long)n, (unsigned long long)fsize, TP__ST_MAX_HEADER);
    char *text = tp__malloc((size_t)n + 1);
    if (!text)
        return tp__error(TP_ERR_NO_MEMORY, "'%s': out of memory for a %llu-byte header", f->path,
                         (unsigned long long)n);
    tp_status st = tp__st_pread(f, text, (size_t)n, 8, false);
    if (st != TP_OK) {
        tp__free(text);
        return st;
    }
    text[n] = '\0';
    f->data_start = 8 + n;
    f->data_size = fsize - 8 - n;
    *out = text;
    return TP_OK;
}

/* Parses the JSON into f->e. */
static tp_status tp__st_parse(tp__st_file *f, const char *text, size_t len)
{
    json_error_t jerr;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return tp__error(TP_ERR_INVALID_ARG, "'%s': malformed header JSON at line %d column %d: %s",
                         f->path, jerr.line, jerr.column, jerr.text);
    tp_status st = TP_OK;
    if (!json_is_object(root)) {
        st = tp__error(TP_ERR_INVALID_ARG, "'%s': the header is not a JSON object", f->path);
        goto done;
    }
    size_t cap = json_object_size(root);
    f->e = tp__calloc(cap ? cap : 1, sizeof *f->e);
    if (!f->e) {
        st = tp__error(TP_ERR_NO_MEMORY, "'%s': out of memory", f->path);
        goto done;
    }
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v)
    {
        if (!strcmp(key, "__metadata__")) {
            if (!json_is_object(v))
                st = tp__error(TP_ERR_INVALID_ARG, "'%s': __metadata__ is not an object", f->path);
            if (st != TP_OK)
                goto done;
            continue;
        }
        tp__st_entry *e = &f->e[f->n];
        memset(e, 0, sizeof *e);
        TP_CHECK_GOTO(tp__st_parse_entry(f, key, v, e), st, done);
        if (!(e->name = tp__strdup(key))) {
            st = tp__error(TP_ERR_NO_MEMORY, "'%s': out of memory", f->path);
            goto done;
        }
        f->n++;
    }
    st = tp__st_check_overlap(f);
done:
    json_decref(root);
    return st;
}

tp_status tp__st_file_open(const char *path, tp__st_file *f)
{
    memset(f, 0, sizeof *f);
    f->fd = -1;
    if (!(f->path = tp__strdup(path)))
        return tp__error(TP_ERR_NO_MEMORY, "opening '%s': out of memory", path);
    f->fd = tp__st_open_regular(path);
    if (f->fd < 0) {
        tp_status st = tp__error(TP_ERR_BACKEND, "cannot open '%s': %s", path, strerror(errno));
        tp__st_file_close(f);
        return st;
    }
    char *text = NULL;
    tp_status st = tp__st_header_text(f, &text);
    if (st == TP_OK)
        st = tp__st_parse(f, text, (size_t)(f->data_start - 8));
    tp__free(text);
    if (st != TP_OK)
        tp__st_file_close(f);
    return st;
}

/* ---- the index of a sharded set ------------------------------------------ */

/* Reads a whole small file (an index) into *out (tp__malloc, 0-terminated). */
static tp_status tp__st_slurp(const char *path, char **out, size_t *len)
{
    tp__st_file f = {.fd = -1, .path = (char *)path};
    f.fd = tp__st_open_regular(path);
    if (f.fd < 0)
        return tp__error(TP_ERR_BACKEND, "cannot open '%s': %s", path, strerror(errno));
    struct stat sb;
    tp_status st = TP_OK;
    if (fstat(f.fd, &sb) != 0 || !S_ISREG(sb.st_mode))
        st = tp__error(TP_ERR_BACKEND, "'%s': cannot stat it or not a regular file", path);
    else if ((uint64_t)sb.st_size > TP__ST_MAX_HEADER)
        st = tp__error(TP_ERR_INVALID_ARG, "'%s' is larger than %u bytes", path,
                       TP__ST_MAX_HEADER);
    char *text = st == TP_OK ? tp__malloc((size_t)sb.st_size + 1) : NULL;
    if (st == TP_OK && !text)
        st = tp__error(TP_ERR_NO_MEMORY, "'%s': out of memory", path);
    if (st == TP_OK)
        st = tp__st_pread(&f, text, (size_t)sb.st_size, 0, false);
    close(f.fd);
    if (st != TP_OK) {
        tp__free(text);
        return st;
    }
    text[sb.st_size] = '\0';
    *out = text;
    *len = (size_t)sb.st_size;
    return TP_OK;
}

/* Adds the distinct file names of the weight map, as paths beside the index. */
static tp_status tp__st_index_files(const char *path, json_t *map, tp__st_paths *out)
{
    const char *slash = strrchr(path, '/');
    size_t dir = slash ? (size_t)(slash - path) + 1 : 0;
    const char *key;
    json_t *v;
    json_object_foreach(map, key, v)
    {
        if (!json_is_string(v) || strchr(json_string_value(v), '/'))
            return tp__error(TP_ERR_INVALID_ARG,
                             "'%s': weight_map entry '%s' is not a plain file name", path, key);
        const char *name = json_string_value(v);
        size_t len = dir + strlen(name) + 1;
        char *full = tp__malloc(len);
        if (!full)
            return tp__error(TP_ERR_NO_MEMORY, "'%s': out of memory", path);
        memcpy(full, path, dir);
        memcpy(full + dir, name, strlen(name) + 1);
        bool seen = false;
        for (int i = 0; i < out->n && !seen; i++)
            seen = !strcmp(out->p[i], full);
        if (seen) {
            tp__free(full);
            continue;
        }
        if (!tp__grow_array((void **)&out->p, (size_t)out->n, &out->cap, sizeof *out->p)) {
            tp__free(full);
            return tp__error(TP_ERR_NO_MEMORY, "'%s': out of memory", path);
        }
        out->p[out->n++] = full;
    }
    return TP_OK;
}

tp_status tp__st_index(const char *path, tp__st_paths *out)
{
    memset(out, 0, sizeof *out);
    char *text = NULL;
    size_t len = 0;
    TP_CHECK(tp__st_slurp(path, &text, &len));
    json_error_t jerr;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
    tp__free(text);
    if (!root)
        return tp__error(TP_ERR_INVALID_ARG, "'%s': malformed index JSON at line %d column %d: %s",
                         path, jerr.line, jerr.column, jerr.text);
    json_t *map = json_object_get(root, "weight_map");
    tp_status st = json_is_object(map)
                       ? tp__st_index_files(path, map, out)
                       : tp__error(TP_ERR_INVALID_ARG, "'%s': no \"weight_map\" object", path);
    json_decref(root);
    if (st != TP_OK)
        tp__st_paths_free(out);
    return st;
}

void tp__st_paths_free(tp__st_paths *p)
{
    for (int i = 0; i < p->n; i++)
        tp__free(p->p[i]);
    tp__free(p->p);
    memset(p, 0, sizeof *p);
}
