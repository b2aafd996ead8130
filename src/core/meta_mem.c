/* Memory accounting on the meta device (tp/meta_memory.h): meta.c's alloc
 * and free report every storage here, the library's hooks tag storages with
 * a category (tp__meta_mem_tag), and the public queries and report read the
 * counters. One mutex guards everything: a table from storage address to
 * its entry (open addressing, linear probing, deletion by backward shift)
 * and the scopes, interned by FQN and never freed.
 *
 * The split at the peak is kept lazily: while the live bytes only grow, the
 * peak is "now" (peak_dirty); the first free or retag after a new peak
 * copies the live split into the at-peak one. An entry still live and
 * allocated no later than the allocation that set the peak was live at the
 * peak, so a retag moves its bytes in the at-peak split too; one allocated
 * after the window start (the last reset) moves in the totals too. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "core/cache.h"
#include "core/core.h"
#include "core/meta_mem.h"
#include "tp/comm_debug.h"

#define NCAT TP_MEM_CATEGORY_COUNT

typedef struct mm_entry {
    uintptr_t addr; /* 0: empty slot */
    size_t bytes;
    uint64_t seq;
    uint32_t scope;
    uint8_t cat;
} mm_entry;

typedef struct mm_scope {
    char *name;
    size_t live[NCAT], at_peak[NCAT], total[NCAT];
} mm_scope;

static struct {
    pthread_mutex_t lock;
    mm_entry *tab;
    size_t cap, n; /* cap: a power of two, or 0 */
    mm_scope *sc;
    size_t nsc, capsc;
    uint32_t last_scope;
    uint32_t *scidx; /* scope name hash -> index + 1 (0: empty), load <= 1/2 */
    size_t scidx_cap;
    size_t allocated, peak;
    uint64_t seq, peak_seq, window_seq, num_allocs;
    bool peak_dirty;
    tp_meta_rounding rounding;
} g = {.lock = PTHREAD_MUTEX_INITIALIZER};

/* category priority: a tag only raises (other < activations < gradients <
 * optimizer < master < parameters) */
static const int rank_of[NCAT] = {5, 2, 3, 4, 1, 0};

static size_t mm_hash(uintptr_t a, size_t cap)
{
    return (size_t)(((uint64_t)a >> 6) * 0x9E3779B97F4A7C15ull >> 20) & (cap - 1);
}

static mm_entry *mm_find(uintptr_t a)
{
    if (!g.cap)
        return NULL;
    for (size_t i = mm_hash(a, g.cap);; i = (i + 1) & (g.cap - 1)) {
        if (g.tab[i].addr == a)
            return &g.tab[i];
        if (!g.tab[i].addr)
            return NULL;
    }
}

static void mm_put(mm_entry *tab, size_t cap, const mm_entry *e)
{
    size_t i = mm_hash(e->addr, cap);
    while (tab[i].addr)
        i = (i + 1) & (cap - 1);
    tab[i] = *e;
}

/* Room for one more entry (load at most 1/2). */
static bool mm_reserve(void)
{
    if (2 * (g.n + 1) <= g.cap)
        return true;
    size_t cap = g.cap ? 2 * g.cap : 1024;
    /* the accounting's own tables live for the process, like the CUDA
     * context: from libc, not the allocator hook (which serves tensors and
     * per-call memory, and whose counting tests expect nothing left) */
    mm_entry *tab = calloc(cap, sizeof *tab);
    if (!tab)
        return false;
    for (size_t i = 0; i < g.cap; i++)
        if (g.tab[i].addr)
            mm_put(tab, cap, &g.tab[i]);
    free(g.tab);
    g.tab = tab;
    g.cap = cap;
    return true;
}

/* Removes slot i, shifting back the entries of its probe run. */
static void mm_remove(size_t i)
{
    size_t m = g.cap - 1;
    g.tab[i].addr = 0;
    for (size_t j = (i + 1) & m; g.tab[j].addr; j = (j + 1) & m) {
        size_t h = mm_hash(g.tab[j].addr, g.cap);
        /* j's entry may move to i when its home h is not in (i, j] */
        if ((j > i && (h <= i || h > j)) || (j < i && h <= i && h > j)) {
            g.tab[i] = g.tab[j];
            g.tab[j].addr = 0;
            i = j;
        }
    }
    g.n--;
}

static size_t mm_name_hash(const char *name, size_t cap)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (const unsigned char *p = (const unsigned char *)name; *p; p++)
        h = (h ^ *p) * 1099511628211ull;
    return (size_t)(h ^ (h >> 29)) & (cap - 1);
}

/* The slot of `name` in the scope index: its entry, or the empty slot
 * where it would go. */
static size_t mm_scidx_slot(const uint32_t *idx, size_t cap, const char *name)
{
    size_t i = mm_name_hash(name, cap);
    while (idx[i] && strcmp(g.sc[idx[i] - 1].name, name) != 0)
        i = (i + 1) & (cap - 1);
    return i;
}

/* Room in the scope index for one more name; false when out of memory. */
static bool mm_scidx_reserve(void)
{
    if (2 * (g.nsc + 1) <= g.scidx_cap)
        return true;
    size_t cap = g.scidx_cap ? 2 * g.scidx_cap : 64;
    uint32_t *idx = calloc(cap, sizeof *idx); /* libc, as the entry table */
    if (!idx)
        return false;
    for (size_t i = 0; i < g.nsc; i++)
        idx[mm_scidx_slot(idx, cap, g.sc[i].name)] = (uint32_t)i + 1;
    free(g.scidx);
    g.scidx = idx;
    g.scidx_cap = cap;
    return true;
}

/* The index of scope `name`, interned; -1 when out of memory. A module
 * tree of a deep model has thousands of scopes, each allocation looks its
 * scope up: by hash, not by a scan. */
static int64_t mm_scope_of(const char *name)
{
    if (g.nsc && strcmp(g.sc[g.last_scope].name, name) == 0)
        return g.last_scope;
    if (g.nsc) {
        const uint32_t hit = g.scidx[mm_scidx_slot(g.scidx, g.scidx_cap, name)];
        if (hit)
            return g.last_scope = hit - 1;
    }
    if (g.nsc >= UINT32_MAX - 1 || !mm_scidx_reserve())
        return -1;
    if (g.nsc == g.capsc) { /* libc, as the entry table */
        size_t cap = g.capsc ? 2 * g.capsc : 16;
        void *sc = realloc(g.sc, cap * sizeof *g.sc);
        if (!sc)
            return -1;
        g.sc = sc;
        g.capsc = cap;
    }
    char *copy = strdup(name);
    if (!copy)
        return -1;
    memset(&g.sc[g.nsc], 0, sizeof g.sc[g.nsc]);
    g.sc[g.nsc].name = copy;
    g.scidx[mm_scidx_slot(g.scidx, g.scidx_cap, copy)] = (uint32_t)g.nsc + 1;
    g.last_scope = (uint32_t)g.nsc;
    return (int64_t)g.nsc++;
}

/* The at-peak split becomes the live one if the peak is "now". */
static void mm_settle_peak(void)
{
    if (!g.peak_dirty)
        return;
    for (size_t i = 0; i < g.nsc; i++)
        memcpy(g.sc[i].at_peak, g.sc[i].live, sizeof g.sc[i].live);
    g.peak_dirty = false;
}

static size_t mm_rounded(size_t n)
{
    switch (g.rounding) {
    case TP_META_ROUND_CPU:
        return tp__cpu_block_size(n);
    case TP_META_ROUND_CUDA:
        n = n ? n : 1;
        return (n + 511) / 512 * 512;
    default:
        return n;
    }
}

static _Atomic(const char *(*)(void)) mm_scope_source;

static _Atomic(void (*)(tp_dtype, int64_t)) mm_copy_observer;

void tp__meta_set_copy_observer(void (*observer)(tp_dtype dtype, int64_t elems))
{
    atomic_store_explicit(&mm_copy_observer, observer, memory_order_release);
}

void tp__meta_note_copy(tp_dtype dtype, int64_t elems)
{
    void (*f)(tp_dtype, int64_t) = atomic_load_explicit(&mm_copy_observer, memory_order_acquire);
    if (f)
        f(dtype, elems);
}

void tp__meta_mem_set_scope_source(const char *(*current_scope)(void))
{
    atomic_store_explicit(&mm_scope_source, current_scope, memory_order_release);
}

static const char *mm_current_scope(void)
{
    const char *(*f)(void) = atomic_load_explicit(&mm_scope_source, memory_order_acquire);
    return f ? f() : TP_COMM_DEBUG_GLOBAL;
}

tp_status tp__meta_mem_alloc(const char *fn, uintptr_t addr, size_t nbytes)
{
    const char *scope = mm_current_scope();
    pthread_mutex_lock(&g.lock);
    int64_t s = mm_scope_of(scope);
    if (s < 0 || !mm_reserve()) {
        pthread_mutex_unlock(&g.lock);
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory for the meta memory table", fn);
    }
    mm_entry e = {.addr = addr,
                  .bytes = mm_rounded(nbytes),
                  .seq = ++g.seq,
                  .scope = (uint32_t)s,
                  .cat = TP_MEM_OTHER};
    mm_put(g.tab, g.cap, &e);
    g.n++;
    g.num_allocs++;
    g.allocated += e.bytes;
    g.sc[s].live[TP_MEM_OTHER] += e.bytes;
    g.sc[s].total[TP_MEM_OTHER] += e.bytes;
    if (g.allocated > g.peak) {
        g.peak = g.allocated;
        g.peak_seq = e.seq;
        g.peak_dirty = true;
    }
    pthread_mutex_unlock(&g.lock);
    return TP_OK;
}

void tp__meta_mem_free(uintptr_t addr)
{
    pthread_mutex_lock(&g.lock);
    mm_entry *e = mm_find(addr);
    if (e) {
        mm_settle_peak();
        g.allocated -= e->bytes;
        g.sc[e->scope].live[e->cat] -= e->bytes;
        mm_remove((size_t)(e - g.tab));
    }
    pthread_mutex_unlock(&g.lock);
}

/* Moves e's bytes to category c and scope s in every split it is part of. */
static void mm_move(mm_entry *e, int c, uint32_t s)
{
    mm_scope *from = &g.sc[e->scope], *to = &g.sc[s];
    from->live[e->cat] -= e->bytes;
    to->live[c] += e->bytes;
    if (e->seq <= g.peak_seq) {
        from->at_peak[e->cat] -= e->bytes;
        to->at_peak[c] += e->bytes;
    }
    if (e->seq > g.window_seq) {
        from->total[e->cat] -= e->bytes;
        to->total[c] += e->bytes;
    }
    e->cat = (uint8_t)c;
    e->scope = s;
}

void tp__meta_mem_tag(const tp_tensor *t, tp_mem_category c, const char *scope)
{
    const tp_tensor *l = t ? tp__tensor_local(t) : NULL;
    if (!l || !l->storage || l->storage->device.type != TP_DEVICE_META || !l->storage->owned)
        return;
    pthread_mutex_lock(&g.lock);
    mm_entry *e = mm_find((uintptr_t)l->storage->data);
    if (e) {
        int64_t s = scope ? mm_scope_of(scope) : -1;
        uint32_t to = s >= 0 ? (uint32_t)s : e->scope;
        int cat = rank_of[c] > rank_of[e->cat] ? (int)c : e->cat;
        if (cat != e->cat || to != e->scope) {
            mm_settle_peak();
            mm_move(e, cat, to);
        }
    }
    pthread_mutex_unlock(&g.lock);
}

void tp__meta_mem_tag_owner(const tp_tensor *t, tp_mem_category c, const char *fqn)
{
    char scope[TP__META_MEM_MAX_SCOPE];
    const char *dot = fqn ? strrchr(fqn, '.') : NULL;
    size_t n = dot ? (size_t)(dot - fqn) : 0;
    if (n >= sizeof scope)
        n = sizeof scope - 1;
    if (n)
        memcpy(scope, fqn, n);
    scope[n] = '\0';
    tp__meta_mem_tag(t, c, fqn ? scope : NULL);
}

/* ---- the device's statistics ---------------------------------------------- */

tp_status tp__meta_mem_stats(const char *fn, int index, tp_memory_info *out)
{
    (void)fn;
    (void)index;
    pthread_mutex_lock(&g.lock);
    *out = (tp_memory_info){.allocated = g.allocated,
                            .reserved = g.allocated,
                            .peak_allocated = g.peak,
                            .num_allocs = g.num_allocs};
    pthread_mutex_unlock(&g.lock);
    return TP_OK;
}

tp_status tp__meta_mem_reset_peak(const char *fn, int index)
{
    (void)fn;
    (void)index;
    pthread_mutex_lock(&g.lock);
    g.peak = g.allocated;
    g.peak_seq = g.seq;
    g.window_seq = g.seq;
    g.peak_dirty = true;
    for (size_t i = 0; i < g.nsc; i++)
        memset(g.sc[i].total, 0, sizeof g.sc[i].total);
    pthread_mutex_unlock(&g.lock);
    return TP_OK;
}

/* ---- queries --------------------------------------------------------------- */

const char *tp_mem_category_name(tp_mem_category c)
{
    static const char *const names[NCAT] = {"parameters", "gradients",   "optimizer",
                                            "master",     "activations", "other"};
    if (c == TP_MEM_ANY)
        return "any";
    return (int)c >= 0 && c < NCAT ? names[c] : NULL;
}

tp_status tp_meta_memory_set_rounding(tp_meta_rounding r)
{
    TP_ARG_CHECK(r == TP_META_ROUND_EXACT || r == TP_META_ROUND_CPU || r == TP_META_ROUND_CUDA,
                 "tp_meta_memory_set_rounding: unknown rounding %d", (int)r);
    pthread_mutex_lock(&g.lock);
    g.rounding = r;
    pthread_mutex_unlock(&g.lock);
    return TP_OK;
}

tp_meta_rounding tp_meta_memory_rounding(void)
{
    pthread_mutex_lock(&g.lock);
    tp_meta_rounding r = g.rounding;
    pthread_mutex_unlock(&g.lock);
    return r;
}

static const size_t *mm_row(const mm_scope *s, tp_meta_mem_view v)
{
    return v == TP_META_MEM_LIVE ? s->live : v == TP_META_MEM_AT_PEAK ? s->at_peak : s->total;
}

/* Sum over the categories c selects of one scope's row. Lock held. */
static size_t mm_sum(const mm_scope *s, tp_meta_mem_view v, tp_mem_category c)
{
    const size_t *row = mm_row(s, v);
    if (c != TP_MEM_ANY)
        return row[c];
    size_t sum = 0;
    for (int k = 0; k < NCAT; k++)
        sum += row[k];
    return sum;
}

size_t tp_meta_memory_bytes(tp_meta_mem_view view, const char *scope, tp_mem_category c)
{
    if ((int)view < 0 || view > TP_META_MEM_TOTAL || (c != TP_MEM_ANY && ((int)c < 0 || c >= NCAT)))
        return 0;
    size_t sum = 0;
    pthread_mutex_lock(&g.lock);
    mm_settle_peak();
    for (size_t i = 0; i < g.nsc; i++)
        if (!scope || strcmp(g.sc[i].name, scope) == 0)
            sum += mm_sum(&g.sc[i], view, c);
    pthread_mutex_unlock(&g.lock);
    return sum;
}

int tp_meta_memory_scope_count(void)
{
    pthread_mutex_lock(&g.lock);
    size_t n = g.nsc;
    pthread_mutex_unlock(&g.lock);
    return n > INT32_MAX ? INT32_MAX : (int)n;
}

const char *tp_meta_memory_scope_name(int i)
{
    pthread_mutex_lock(&g.lock);
    const char *name = i >= 0 && (size_t)i < g.nsc ? g.sc[i].name : NULL;
    pthread_mutex_unlock(&g.lock);
    return name;
}

/* ---- the report ------------------------------------------------------------ */

typedef struct mm_snap {
    size_t allocated, peak;
    uint64_t num_allocs;
    tp_meta_rounding rounding;
    size_t n;
    mm_scope *sc; /* names borrowed (interned for good), rows copied */
} mm_snap;

static tp_status mm_snapshot(mm_snap *s)
{
    pthread_mutex_lock(&g.lock);
    mm_settle_peak();
    s->allocated = g.allocated;
    s->peak = g.peak;
    s->num_allocs = g.num_allocs;
    s->rounding = g.rounding;
    s->n = g.nsc;
    s->sc = tp__malloc((g.nsc + 1) * sizeof *s->sc);
    if (s->sc) {
        memcpy(s->sc, g.sc, g.nsc * sizeof *s->sc);
        /* the last row: all scopes */
        mm_scope *all = &s->sc[g.nsc];
        memset(all, 0, sizeof *all);
        for (size_t i = 0; i < g.nsc; i++)
            for (int k = 0; k < NCAT; k++) {
                all->at_peak[k] += g.sc[i].at_peak[k];
                all->total[k] += g.sc[i].total[k];
            }
    }
    pthread_mutex_unlock(&g.lock);
    return s->sc ? TP_OK
                 : tp__error(TP_ERR_NO_MEMORY, "tp_meta_memory_write_report: out of memory");
}

static bool mm_empty(const mm_scope *s)
{
    return mm_sum(s, TP_META_MEM_AT_PEAK, TP_MEM_ANY) == 0 &&
           mm_sum(s, TP_META_MEM_TOTAL, TP_MEM_ANY) == 0;
}

static const char *mm_rounding_name(tp_meta_rounding r)
{
    return r == TP_META_ROUND_CPU ? "cpu" : r == TP_META_ROUND_CUDA ? "cuda" : "exact";
}

static bool mm_table_row(FILE *f, const char *name, const size_t *row)
{
    size_t sum = 0;
    bool ok = fprintf(f, "%-32s", name) >= 0;
    for (int k = 0; k < NCAT; k++) {
        sum += row[k];
        ok = ok && fprintf(f, " %14zu", row[k]) >= 0;
    }
    return ok && fprintf(f, " %14zu\n", sum) >= 0;
}

static bool mm_table_part(FILE *f, const mm_snap *s, tp_meta_mem_view v, const char *title)
{
    bool ok = fprintf(f, "\n%s (bytes)\n%-32s", title, "scope") >= 0;
    for (int k = 0; k < NCAT; k++)
        ok = ok && fprintf(f, " %14s", tp_mem_category_name((tp_mem_category)k)) >= 0;
    ok = ok && fprintf(f, " %14s\n", "total") >= 0;
    for (size_t i = 0; i < s->n && ok; i++)
        if (!mm_empty(&s->sc[i]))
            ok = mm_table_row(f, s->sc[i].name[0] ? s->sc[i].name : "(root)", mm_row(&s->sc[i], v));
    return ok && mm_table_row(f, "(all scopes)", mm_row(&s->sc[s->n], v));
}

static bool mm_write_table(FILE *f, const mm_snap *s)
{
    bool ok = fprintf(f,
                      "meta memory (%s rounding): allocated %zu bytes, peak %zu bytes, "
                      "%llu allocations\n",
                      mm_rounding_name(s->rounding), s->allocated, s->peak,
                      (unsigned long long)s->num_allocs) >= 0;
    ok = ok && mm_table_part(f, s, TP_META_MEM_AT_PEAK, "live at the peak");
    return ok && mm_table_part(f, s, TP_META_MEM_TOTAL, "allocated in total");
}

static bool mm_json_str(FILE *f, const char *str)
{
    bool ok = fputc('"', f) != EOF;
    for (const unsigned char *p = (const unsigned char *)str; *p && ok; p++) {
        if (*p == '"' || *p == '\\')
            ok = fprintf(f, "\\%c", *p) >= 0;
        else if (*p < 0x20)
            ok = fprintf(f, "\\u%04x", *p) >= 0;
        else
            ok = fputc(*p, f) != EOF;
    }
    return ok && fputc('"', f) != EOF;
}

static bool mm_json_row(FILE *f, const char *key, const size_t *row)
{
    bool ok = fprintf(f, "\"%s\": {", key) >= 0;
    size_t sum = 0;
    for (int k = 0; k < NCAT && ok; k++) {
        sum += row[k];
        ok = fprintf(f, "\"%s\": %zu, ", tp_mem_category_name((tp_mem_category)k), row[k]) >= 0;
    }
    return ok && fprintf(f, "\"total\": %zu}", sum) >= 0;
}

static bool mm_json_scope(FILE *f, const mm_scope *sc, const char *lead)
{
    bool ok = fputs(lead, f) >= 0;
    ok = ok && mm_json_row(f, "at_peak", sc->at_peak) && fputs(", ", f) >= 0;
    return ok && mm_json_row(f, "total", sc->total);
}

static bool mm_write_json(FILE *f, const mm_snap *s)
{
    bool ok = fprintf(f,
                      "{\"rounding\": \"%s\", \"allocated\": %zu, \"peak\": %zu, "
                      "\"num_allocs\": %llu,\n ",
                      mm_rounding_name(s->rounding), s->allocated, s->peak,
                      (unsigned long long)s->num_allocs) >= 0;
    ok = ok && mm_json_scope(f, &s->sc[s->n], "") && fputs(",\n \"scopes\": [", f) >= 0;
    bool first = true;
    for (size_t i = 0; i < s->n && ok; i++) {
        if (mm_empty(&s->sc[i]))
            continue;
        ok = fputs(first ? "\n  {\"scope\": " : ",\n  {\"scope\": ", f) >= 0 &&
             mm_json_str(f, s->sc[i].name) && mm_json_scope(f, &s->sc[i], ", ") &&
             fputc('}', f) != EOF;
        first = false;
    }
    return ok && fputs("]}\n", f) >= 0;
}

tp_status tp_meta_memory_write_report(FILE *f, tp_meta_report_format format)
{
    const char *fn = "tp_meta_memory_write_report";
    TP_ARG_CHECK(f, "%s: f is NULL", fn);
    TP_ARG_CHECK(format == TP_META_REPORT_TABLE || format == TP_META_REPORT_JSON,
                 "%s: unknown format %d", fn, (int)format);
    mm_snap s;
    TP_CHECK(mm_snapshot(&s));
    bool ok = format == TP_META_REPORT_TABLE ? mm_write_table(f, &s) : mm_write_json(f, &s);
    tp__free(s.sc);
    return ok ? TP_OK : tp__error(TP_ERR_BACKEND, "%s: writing the report failed", fn);
}
