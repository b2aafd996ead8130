/* The comm-debug counter: the per-thread phase and scope stack, and the
 * counters the collectives dispatch layer feeds through
 * tp__comm_debug_record(). */
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "collectives/coll.h"

#define TP__CD_MAX_DEPTH 32
#define TP__CD_MAX_FQN 255

typedef struct tp__cd_scope {
    int64_t counts[TP_PHASE_COUNT][TP_COLL_KIND_COUNT];
    uint32_t hash;
    int depth; /* levels: "mlp" is 1, "mlp.net1" is 2 */
    size_t len;
    char fqn[];
} tp__cd_scope;

struct tp_comm_debug {
    /* Identity of the thread the counter is active on, 0 when inactive. The
     * release on end / acquire on begin hands the counts from one owner to
     * the next without further locking. */
    atomic_uintptr_t owner;
    int64_t global[TP_PHASE_COUNT][TP_COLL_KIND_COUNT];
    uint64_t bytes[TP_COLL_KIND_COUNT];
    tp__cd_scope **scopes; /* first-seen order, for the writers */
    size_t nscopes, scopes_cap;
    /* open addressing over scopes: position + 1, 0 = empty; capacity is a
     * power of two kept at least twice nscopes */
    uint32_t *index;
    size_t index_cap;
    int64_t dropped;     /* per-scope attributions lost to allocation failure */
    bool scopes_missing; /* a scope could not be registered (out of memory) */
};

typedef struct tp__cd_thread {
    tp_comm_debug *active;
    tp_phase phase;
    int depth;
    /* end[l]: length of the level-l FQN, a prefix of fqn (end[0] = 0) */
    uint16_t end[TP__CD_MAX_DEPTH + 1];
    /* slot[l]: position + 1 of the level-l scope in `active`, 0 = not
     * resolved yet. Valid for the active counter only: begin and push
     * refresh the levels they touch, so a record normally finds every level
     * resolved and neither hashes nor allocates. */
    uint32_t slot[TP__CD_MAX_DEPTH + 1];
    char fqn[TP__CD_MAX_FQN + 1];
} tp__cd_thread;

static _Thread_local tp__cd_thread tp__cd;

/* The address of a thread-local object is unique among live threads, which is
 * all the owner field needs. */
static uintptr_t tp__cd_self(void) { return (uintptr_t)&tp__cd; }

static uint32_t tp__cd_hash(const char *s, size_t len)
{
    uint32_t h = 2166136261u; /* FNV-1a */
    for (size_t i = 0; i < len; i++) {
        h ^= (unsigned char)s[i];
        h *= 16777619u;
    }
    return h;
}

/* Position + 1 of the scope named s[0..len), or 0. */
static uint32_t tp__cd_find(const tp_comm_debug *d, const char *s, size_t len, uint32_t hash)
{
    if (!d->index_cap)
        return 0;
    size_t mask = d->index_cap - 1;
    for (size_t i = hash & mask;; i = (i + 1) & mask) {
        uint32_t v = d->index[i];
        if (!v)
            return 0;
        const tp__cd_scope *sc = d->scopes[v - 1];
        if (sc->hash == hash && sc->len == len && memcmp(sc->fqn, s, len) == 0)
            return v;
    }
}

static void tp__cd_index_put(uint32_t *index, size_t cap, uint32_t hash, uint32_t v)
{
    size_t mask = cap - 1;
    size_t i = hash & mask;
    while (index[i])
        i = (i + 1) & mask;
    index[i] = v;
}

/* Makes room for one more scope. Each step either completes or leaves the
 * counter as it was, so a failure leaks nothing and loses nothing. */
static bool tp__cd_reserve(tp_comm_debug *d)
{
    if (d->nscopes >= UINT32_MAX - 1)
        return false;
    if (d->nscopes == d->scopes_cap) {
        size_t cap = d->scopes_cap ? 2 * d->scopes_cap : 16;
        tp__cd_scope **s = tp__malloc(cap * sizeof *s);
        if (!s)
            return false;
        if (d->nscopes)
            memcpy(s, d->scopes, d->nscopes * sizeof *s);
        tp__free(d->scopes);
        d->scopes = s;
        d->scopes_cap = cap;
    }
    if (2 * (d->nscopes + 1) > d->index_cap) {
        size_t cap = d->index_cap ? 2 * d->index_cap : 32;
        uint32_t *ix = tp__calloc(cap, sizeof *ix);
        if (!ix)
            return false;
        for (size_t i = 0; i < d->nscopes; i++)
            tp__cd_index_put(ix, cap, d->scopes[i]->hash, (uint32_t)(i + 1));
        tp__free(d->index);
        d->index = ix;
        d->index_cap = cap;
    }
    return true;
}

/* Position + 1 of the calling thread's level-l scope in d, registering it on
 * first sight; 0 when it cannot be allocated. */
static uint32_t tp__cd_intern(tp_comm_debug *d, const tp__cd_thread *t, int level)
{
    size_t len = t->end[level];
    uint32_t hash = tp__cd_hash(t->fqn, len);
    uint32_t v = tp__cd_find(d, t->fqn, len, hash);
    if (v)
        return v;
    tp__cd_scope *sc = NULL;
    if (tp__cd_reserve(d))
        sc = tp__malloc(sizeof *sc + len + 1);
    if (!sc) {
        d->scopes_missing = true;
        return 0;
    }
    memset(sc->counts, 0, sizeof sc->counts);
    sc->hash = hash;
    sc->depth = level;
    sc->len = len;
    memcpy(sc->fqn, t->fqn, len);
    sc->fqn[len] = '\0';
    d->scopes[d->nscopes++] = sc;
    v = (uint32_t)d->nscopes;
    tp__cd_index_put(d->index, d->index_cap, hash, v);
    return v;
}

static void tp__cd_clear(tp_comm_debug *d)
{
    for (size_t i = 0; i < d->nscopes; i++)
        tp__free(d->scopes[i]);
    d->nscopes = 0;
    if (d->index_cap)
        memset(d->index, 0, d->index_cap * sizeof *d->index);
    memset(d->global, 0, sizeof d->global);
    memset(d->bytes, 0, sizeof d->bytes);
    d->dropped = 0;
    d->scopes_missing = false;
}

/* ---- recording ----------------------------------------------------------- */

void tp__comm_debug_record(tp_coll_kind kind, size_t bytes)
{
    tp__cd_thread *t = &tp__cd;
    tp_comm_debug *d = t->active;
    if (__builtin_expect(d == NULL, 1))
        return;
    if ((unsigned)kind >= TP_COLL_KIND_COUNT)
        return; /* the dispatch layer validated it; never index out of range */
    tp_phase ph = t->phase;
    d->global[ph][kind]++;
    d->bytes[kind] += bytes;
    for (int l = 1; l <= t->depth; l++) {
        uint32_t v = t->slot[l];
        if (!v) {
            /* only after an allocation failure at begin/push: retry, and
             * keep the totals right even if it fails again */
            v = t->slot[l] = tp__cd_intern(d, t, l);
            if (!v) {
                d->dropped++;
                continue;
            }
        }
        d->scopes[v - 1]->counts[ph][kind]++;
    }
}

/* ---- lifetime and activation --------------------------------------------- */

tp_status tp_comm_debug_create(tp_comm_debug **out)
{
    TP_ARG_CHECK(out, "comm_debug_create: out is NULL");
    *out = NULL;
    tp_comm_debug *d = tp__calloc(1, sizeof *d);
    if (!d)
        return tp__error(TP_ERR_NO_MEMORY, "comm_debug_create: out of memory");
    atomic_init(&d->owner, 0);
    *out = d;
    return TP_OK;
}

void tp_comm_debug_free(tp_comm_debug *debug)
{
    if (!debug)
        return;
    uintptr_t owner = atomic_load_explicit(&debug->owner, memory_order_acquire);
    if (owner == tp__cd_self()) {
        tp_comm_debug_end(debug);
    } else if (owner != 0) {
        /* Freeing it would pull the counter from under the thread that
         * records into it; leaking it is the only safe answer. */
        tp__error(TP_ERR_STATE, "comm_debug_free: the counter is active on another thread "
                                "and was not freed; end it on that thread first");
        return;
    }
    tp__cd_clear(debug);
    tp__free(debug->scopes);
    tp__free(debug->index);
    tp__free(debug);
}

tp_status tp_comm_debug_begin(tp_comm_debug *debug)
{
    TP_ARG_CHECK(debug, "comm_debug_begin: debug is NULL");
    tp__cd_thread *t = &tp__cd;
    if (t->active == debug)
        return tp__error(TP_ERR_STATE, "comm_debug_begin: the counter is already active on "
                                       "this thread");
    if (t->active)
        return tp__error(TP_ERR_STATE, "comm_debug_begin: another counter is already active "
                                       "on this thread; end it first");
    uintptr_t expected = 0;
    if (!atomic_compare_exchange_strong_explicit(&debug->owner, &expected, tp__cd_self(),
                                                 memory_order_acquire, memory_order_relaxed))
        return tp__error(TP_ERR_STATE, "comm_debug_begin: the counter is active on another "
                                       "thread");
    tp__cd_clear(debug);
    t->active = debug;
    /* Scopes already open count as seen, outermost first, as the table
     * expects; a failure here is retried by the next record. */
    for (int l = 1; l <= t->depth; l++)
        t->slot[l] = tp__cd_intern(debug, t, l);
    return TP_OK;
}

tp_status tp_comm_debug_end(tp_comm_debug *debug)
{
    TP_ARG_CHECK(debug, "comm_debug_end: debug is NULL");
    tp__cd_thread *t = &tp__cd;
    if (t->active != debug)
        return tp__error(TP_ERR_STATE, "comm_debug_end: the counter is not active on this "
                                       "thread");
    t->active = NULL;
    atomic_store_explicit(&debug->owner, 0, memory_order_release);
    return TP_OK;
}

tp_comm_debug *tp_comm_debug_active(void) { return tp__cd.active; }

/* ---- phase and scopes ---------------------------------------------------- */

void tp_comm_debug_set_phase(tp_phase phase)
{
    if ((unsigned)phase < TP_PHASE_COUNT)
        tp__cd.phase = phase;
}

tp_phase tp_comm_debug_phase(void) { return tp__cd.phase; }

tp_status tp_comm_debug_push_scope(const char *name)
{
    TP_ARG_CHECK(name, "comm_debug_push_scope: name is NULL");
    tp__cd_thread *t = &tp__cd;
    size_t n = strlen(name);
    TP_ARG_CHECK(n > 0, "comm_debug_push_scope: empty scope name");
    TP_ARG_CHECK(!memchr(name, '.', n),
                 "comm_debug_push_scope: scope name \"%s\" contains '.' (push one level at "
                 "a time)", name);
    TP_ARG_CHECK(t->depth > 0 || strcmp(name, TP_COMM_DEBUG_GLOBAL) != 0,
                 "comm_debug_push_scope: \"%s\" is reserved for the root scope",
                 TP_COMM_DEBUG_GLOBAL);
    TP_ARG_CHECK(t->depth < TP__CD_MAX_DEPTH,
                 "comm_debug_push_scope: cannot push \"%s\" under \"%s\": at most %d nested "
                 "scopes", name, t->fqn, TP__CD_MAX_DEPTH);
    size_t start = t->depth ? (size_t)t->end[t->depth] + 1 : 0;
    TP_ARG_CHECK(start + n <= TP__CD_MAX_FQN,
                 "comm_debug_push_scope: cannot push \"%s\" under \"%s\": the FQN would have "
                 "%zu characters, at most %d allowed", name, t->depth ? t->fqn : "",
                 start + n, TP__CD_MAX_FQN);
    if (t->depth)
        t->fqn[start - 1] = '.';
    memcpy(t->fqn + start, name, n);
    t->fqn[start + n] = '\0';
    t->depth++;
    t->end[t->depth] = (uint16_t)(start + n);
    /* Registering now, not at the first record, lists scopes that issue no
     * collective too (as PyTorch's CommDebugMode does) and keeps the record
     * path free of lookups. */
    t->slot[t->depth] = t->active ? tp__cd_intern(t->active, t, t->depth) : 0;
    return TP_OK;
}

tp_status tp_comm_debug_pop_scope(void)
{
    tp__cd_thread *t = &tp__cd;
    if (t->depth == 0)
        return tp__error(TP_ERR_STATE, "comm_debug_pop_scope: no scope is open");
    t->depth--;
    t->fqn[t->end[t->depth]] = '\0';
    return TP_OK;
}

const char *tp_comm_debug_current_scope(void)
{
    return tp__cd.depth ? tp__cd.fqn : TP_COMM_DEBUG_GLOBAL;
}

/* ---- queries ------------------------------------------------------------- */

static int64_t tp__cd_sum(const int64_t counts[TP_PHASE_COUNT][TP_COLL_KIND_COUNT],
                          tp_phase phase, tp_coll_kind kind)
{
    if ((unsigned)phase > TP_PHASE_COUNT || (unsigned)kind > TP_COLL_ANY)
        return 0;
    int64_t sum = 0;
    for (int p = 0; p < TP_PHASE_COUNT; p++) {
        if (phase != TP_PHASE_COUNT && p != (int)phase)
            continue;
        for (int k = 0; k < TP_COLL_KIND_COUNT; k++)
            if (kind == TP_COLL_ANY || k == (int)kind)
                sum += counts[p][k];
    }
    return sum;
}

int64_t tp_comm_debug_count(const tp_comm_debug *debug, tp_coll_kind kind)
{
    return debug ? tp__cd_sum(debug->global, TP_PHASE_COUNT, kind) : 0;
}

int64_t tp_comm_debug_total(const tp_comm_debug *debug)
{
    return tp_comm_debug_count(debug, TP_COLL_ANY);
}

int64_t tp_comm_debug_bytes(const tp_comm_debug *debug, tp_coll_kind kind)
{
    if (!debug || (unsigned)kind > TP_COLL_ANY)
        return 0;
    uint64_t sum = 0;
    for (int k = 0; k < TP_COLL_KIND_COUNT; k++)
        if (kind == TP_COLL_ANY || k == (int)kind)
            sum += debug->bytes[k];
    return sum > INT64_MAX ? INT64_MAX : (int64_t)sum;
}

int64_t tp_comm_debug_module_count(const tp_comm_debug *debug, const char *fqn,
                                   tp_phase phase, tp_coll_kind kind)
{
    if (!debug || !fqn)
        return 0;
    if (strcmp(fqn, TP_COMM_DEBUG_GLOBAL) == 0)
        return tp__cd_sum(debug->global, phase, kind);
    size_t len = strlen(fqn);
    uint32_t v = tp__cd_find(debug, fqn, len, tp__cd_hash(fqn, len));
    return v ? tp__cd_sum(debug->scopes[v - 1]->counts, phase, kind) : 0;
}

/* ---- writers ------------------------------------------------------------- */

/* A stream plus a sticky error flag, so the writers check once at the end. */
typedef struct tp__cd_out {
    FILE *f;
    bool failed;
} tp__cd_out;

__attribute__((format(printf, 2, 3))) static void tp__cd_printf(tp__cd_out *o,
                                                                 const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    if (vfprintf(o->f, fmt, ap) < 0)
        o->failed = true;
    va_end(ap);
}

static void tp__cd_putc(tp__cd_out *o, int c)
{
    if (fputc(c, o->f) == EOF)
        o->failed = true;
}

static void tp__cd_json_string(tp__cd_out *o, const char *s)
{
    tp__cd_putc(o, '"');
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        switch (*p) {
        case '"': tp__cd_printf(o, "\\\""); break;
        case '\\': tp__cd_printf(o, "\\\\"); break;
        case '\n': tp__cd_printf(o, "\\n"); break;
        case '\r': tp__cd_printf(o, "\\r"); break;
        case '\t': tp__cd_printf(o, "\\t"); break;
        default:
            if (*p < 0x20)
                tp__cd_printf(o, "\\u%04x", *p);
            else
                tp__cd_putc(o, *p); /* bytes >= 0x80 pass through: names are UTF-8 */
        }
    }
    tp__cd_putc(o, '"');
}

static const char *const tp__cd_phase_json[TP_PHASE_COUNT] = {"forward", "backward"};
static const char *const tp__cd_phase_table[TP_PHASE_COUNT] = {"FORWARD PASS",
                                                               "BACKWARD PASS"};

static void tp__cd_json_scope(tp__cd_out *o, const char *fqn,
                              const int64_t counts[TP_PHASE_COUNT][TP_COLL_KIND_COUNT],
                              bool last)
{
    tp__cd_printf(o, "  ");
    tp__cd_json_string(o, fqn);
    tp__cd_printf(o, ": {");
    for (int p = 0; p < TP_PHASE_COUNT; p++) {
        tp__cd_printf(o, "%s\"%s\": {", p ? ", " : "", tp__cd_phase_json[p]);
        bool first = true;
        for (int k = 0; k < TP_COLL_KIND_COUNT; k++) {
            if (!counts[p][k])
                continue;
            tp__cd_printf(o, "%s\"%s\": %lld", first ? "" : ", ",
                          tp_coll_kind_name((tp_coll_kind)k), (long long)counts[p][k]);
            first = false;
        }
        tp__cd_putc(o, '}');
    }
    tp__cd_printf(o, "}%s\n", last ? "" : ",");
}

/* The writers walk the scope list, which the owning thread may be growing:
 * refuse while the counter records on another thread. */
static tp_status tp__cd_check_writer(const tp_comm_debug *debug, FILE *f, const char *who)
{
    TP_ARG_CHECK(debug, "%s: debug is NULL", who);
    TP_ARG_CHECK(f, "%s: f is NULL", who);
    uintptr_t owner = atomic_load_explicit(&((tp_comm_debug *)debug)->owner,
                                           memory_order_acquire);
    if (owner != 0 && owner != tp__cd_self())
        return tp__error(TP_ERR_STATE, "%s: the counter is active on another thread", who);
    return TP_OK;
}

tp_status tp_comm_debug_write_json(const tp_comm_debug *debug, FILE *f)
{
    TP_CHECK(tp__cd_check_writer(debug, f, "comm_debug_write_json"));
    tp__cd_out o = {f, false};
    tp__cd_printf(&o, "{\n");
    tp__cd_json_scope(&o, TP_COMM_DEBUG_GLOBAL, debug->global, debug->nscopes == 0);
    for (size_t i = 0; i < debug->nscopes; i++)
        tp__cd_json_scope(&o, debug->scopes[i]->fqn, debug->scopes[i]->counts,
                          i + 1 == debug->nscopes);
    tp__cd_printf(&o, "}\n");
    if (o.failed)
        return tp__error(TP_ERR_BACKEND, "comm_debug_write_json: write failed");
    return TP_OK;
}

static void tp__cd_table_scope(tp__cd_out *o, const char *fqn, int depth,
                               const int64_t counts[TP_PHASE_COUNT][TP_COLL_KIND_COUNT])
{
    tp__cd_printf(o, "%*s%s\n", 2 * depth, "", fqn);
    for (int p = 0; p < TP_PHASE_COUNT; p++) {
        bool any = false;
        for (int k = 0; k < TP_COLL_KIND_COUNT; k++) {
            if (!counts[p][k])
                continue;
            if (!any)
                tp__cd_printf(o, "%*s%s\n", 2 * (depth + 1), "", tp__cd_phase_table[p]);
            any = true;
            tp__cd_printf(o, "%*s%s: %lld\n", 2 * (depth + 2), "",
                          tp_coll_kind_name((tp_coll_kind)k), (long long)counts[p][k]);
        }
    }
}

tp_status tp_comm_debug_write_table(const tp_comm_debug *debug, FILE *f)
{
    TP_CHECK(tp__cd_check_writer(debug, f, "comm_debug_write_table"));
    tp__cd_out o = {f, false};
    tp__cd_table_scope(&o, TP_COMM_DEBUG_GLOBAL, 0, debug->global);
    for (size_t i = 0; i < debug->nscopes; i++)
        tp__cd_table_scope(&o, debug->scopes[i]->fqn, debug->scopes[i]->depth,
                           debug->scopes[i]->counts);
    if (debug->dropped)
        tp__cd_printf(&o, "note: %lld per-scope count(s) dropped (out of memory); the totals "
                          "are complete\n", (long long)debug->dropped);
    else if (debug->scopes_missing)
        tp__cd_printf(&o, "note: some scopes may be missing (out of memory)\n");
    if (o.failed)
        return tp__error(TP_ERR_BACKEND, "comm_debug_write_table: write failed");
    return TP_OK;
}
