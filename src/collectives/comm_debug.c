/* The comm-debug counter: the per-thread phase and scope stack, and the
 * counters the collectives dispatch layer feeds through
 * tp__comm_debug_record(); and the TRACE lines of TP_DEBUG for the
 * collectives it records. */
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "collectives/coll.h"
#include "collectives/comm_debug_internal.h"
#include "core/log.h"
#include "core/meta_mem.h"

#define TP__CD_MAX_DEPTH 32
/* A root module's type name as the thread keeps it (longer ones are cut),
 * and the most characters of the list of them a root scope shows. */
#define TP__CD_MAX_TYPE 63
#define TP__CD_MAX_LABEL 255

typedef struct tp__cd_scope {
    int64_t counts[TP_PHASE_COUNT][TP_COLL_KIND_COUNT];
    uint32_t hash;
    int depth; /* nesting level when first entered: 1 at the top */
    size_t len;
    /* the root scope "": the type names of the roots that entered it,
     * ", "-separated, for the table; NULL for other scopes. Points into the
     * same allocation, after fqn. */
    char *label;
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

/* One open scope. Its FQN is at buf + off (NUL-terminated), followed by the
 * root type name (NUL-terminated, empty unless a root module entered it). */
typedef struct tp__cd_level {
    uint16_t off, len, type_len;
    /* an enclosing level has the same FQN (a user scope named like a
     * module, a module called again from inside itself): the count goes to
     * that scope once */
    bool dup;
    /* position + 1 of the scope in the active counter, 0 = not resolved
     * yet. Valid for the active counter only: begin and push refresh the
     * levels they touch, so a record normally finds every level resolved
     * and neither hashes nor allocates. */
    uint32_t slot;
    /* the level's interned record once a save needed it (NULL until then);
     * valid while the level is open */
    tp__cd_saved *path;
} tp__cd_level;

#define TP__CD_LEVEL_BYTES (TP__CD_MAX_FQN + 1 + TP__CD_MAX_TYPE + 1)
/* Saved scopes (see "saving and re-entering scopes"): buckets per thread,
 * and the most interned records in the process. */
#define TP__CD_PATH_BUCKETS 256
#define TP__CD_MAX_PATHS 65536

typedef struct tp__cd_thread {
    tp_comm_debug *active;
    tp_phase phase;
    int depth;
    tp__cd_level lv[TP__CD_MAX_DEPTH + 1]; /* levels 1..depth */
    char buf[TP__CD_MAX_DEPTH * TP__CD_LEVEL_BYTES];
    tp__cd_saved *paths[TP__CD_PATH_BUCKETS]; /* this thread's interned records */
} tp__cd_thread;

static _Thread_local tp__cd_thread tp__cd;

/* The address of a thread-local object is unique among live threads, which is
 * all the owner field needs. */
static uintptr_t tp__cd_self(void) { return (uintptr_t)&tp__cd; }

static const char *tp__cd_fqn(const tp__cd_thread *t, int l) { return t->buf + t->lv[l].off; }
static const char *tp__cd_type(const tp__cd_thread *t, int l)
{
    return t->buf + t->lv[l].off + t->lv[l].len + 1;
}

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
    if (!tp__grow_array((void **)&d->scopes, d->nscopes, &d->scopes_cap, sizeof *d->scopes))
        return false;
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

/* A scope record with room for a label of label_len characters (none when
 * label is NULL), counts zero. */
static tp__cd_scope *tp__cd_scope_new(const char *fqn, size_t len, uint32_t hash, int depth,
                                      const char *label, size_t label_len)
{
    tp__cd_scope *sc = tp__malloc(sizeof *sc + len + 1 + (label ? label_len + 1 : 0));
    if (!sc)
        return NULL;
    memset(sc->counts, 0, sizeof sc->counts);
    sc->hash = hash;
    sc->depth = depth;
    sc->len = len;
    memcpy(sc->fqn, fqn, len);
    sc->fqn[len] = '\0';
    sc->label = NULL;
    if (label) {
        sc->label = sc->fqn + len + 1;
        memcpy(sc->label, label, label_len);
        sc->label[label_len] = '\0';
    }
    return sc;
}

/* Adds a root type name to the label of scope v unless it is listed already.
 * The record is replaced by a larger one (positions stay valid); out of
 * memory, or past TP__CD_MAX_LABEL characters, the label ends in ", ..."
 * if it fits, else stays as it is: it is only what the table shows. */
static void tp__cd_add_type(tp_comm_debug *d, uint32_t v, const char *type, size_t tlen)
{
    tp__cd_scope *sc = d->scopes[v - 1];
    const char *lab = sc->label ? sc->label : "";
    size_t llen = strlen(lab);
    for (const char *p = lab; *p;) {
        const char *sep = strstr(p, ", ");
        size_t n = sep ? (size_t)(sep - p) : strlen(p);
        if (n == tlen && memcmp(p, type, tlen) == 0)
            return;
        if (!sep)
            break;
        p = sep + 2;
    }
    static const char more[] = ", ...";
    bool full = llen >= sizeof more - 1 && strcmp(lab + llen - (sizeof more - 1), more) == 0;
    if (full)
        return;
    char buf[TP__CD_MAX_LABEL + 1];
    memcpy(buf, lab, llen);
    size_t n = llen;
    if (n + (llen ? 2 : 0) + tlen <= TP__CD_MAX_LABEL) {
        if (llen) {
            memcpy(buf + n, ", ", 2);
            n += 2;
        }
        memcpy(buf + n, type, tlen);
        n += tlen;
    } else if (n + sizeof more - 1 <= TP__CD_MAX_LABEL) {
        memcpy(buf + n, more, sizeof more - 1);
        n += sizeof more - 1;
    } else {
        return;
    }
    tp__cd_scope *ns = tp__cd_scope_new(sc->fqn, sc->len, sc->hash, sc->depth, buf, n);
    if (!ns)
        return;
    memcpy(ns->counts, sc->counts, sizeof sc->counts);
    d->scopes[v - 1] = ns;
    tp__free(sc);
}

/* Position + 1 of the calling thread's level-l scope in d, registering it on
 * first sight; 0 when it cannot be allocated. */
static uint32_t tp__cd_intern(tp_comm_debug *d, const tp__cd_thread *t, int level)
{
    const char *fqn = tp__cd_fqn(t, level);
    size_t len = t->lv[level].len;
    const char *type = tp__cd_type(t, level);
    size_t tlen = t->lv[level].type_len;
    uint32_t hash = tp__cd_hash(fqn, len);
    uint32_t v = tp__cd_find(d, fqn, len, hash);
    if (v) {
        if (tlen)
            tp__cd_add_type(d, v, type, tlen);
        return v;
    }
    tp__cd_scope *sc = NULL;
    if (tp__cd_reserve(d))
        sc = tp__cd_scope_new(fqn, len, hash, level, tlen ? type : NULL, tlen);
    if (!sc) {
        d->scopes_missing = true;
        return 0;
    }
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

/* The counting itself, out of line so that a thread with no active counter,
 * every collective's path, does not pay this function's register saves. */
__attribute__((noinline)) static void tp__cd_record(tp__cd_thread *t, tp_comm_debug *d,
                                                    tp_coll_kind kind, size_t bytes)
{
    if ((unsigned)kind >= TP_COLL_KIND_COUNT)
        return; /* the dispatch layer validated it; never index out of range */
    tp_phase ph = t->phase;
    d->global[ph][kind]++;
    d->bytes[kind] += bytes;
    for (int l = 1; l <= t->depth; l++) {
        if (t->lv[l].dup)
            continue;
        uint32_t v = t->lv[l].slot;
        if (!v) {
            /* only after an allocation failure at begin/push: retry, and
             * keep the totals right even if it fails again */
            v = t->lv[l].slot = tp__cd_intern(d, t, l);
            if (!v) {
                d->dropped++;
                continue;
            }
        }
        d->scopes[v - 1]->counts[ph][kind]++;
    }
}

void tp__comm_debug_record(tp_coll_kind kind, size_t bytes)
{
    tp__cd_thread *t = &tp__cd;
    tp_comm_debug *d = t->active;
    if (__builtin_expect(d == NULL, 1))
        return;
    tp__cd_record(t, d, kind, bytes);
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
        t->lv[l].slot = t->lv[l].dup ? 0 : tp__cd_intern(debug, t, l);
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

/* Pushes the scope fqn[0..len) as it is (type: a root module's type name,
 * or NULL); fn names the caller in errors. */
/* Set once the meta memory accounting (core, below this layer) reads its
 * scopes from here: before the first scope every thread is in the root. */
static atomic_bool tp__cd_scopes_given;

static tp_status tp__cd_push(const char *fn, const char *fqn, size_t len, const char *type)
{
    tp__cd_thread *t = &tp__cd;
    if (!atomic_load_explicit(&tp__cd_scopes_given, memory_order_acquire)) {
        tp__meta_mem_set_scope_source(tp_comm_debug_current_scope);
        atomic_store_explicit(&tp__cd_scopes_given, true, memory_order_release);
    }
    TP_ARG_CHECK(t->depth < TP__CD_MAX_DEPTH,
                 "%s: cannot enter scope \"%.*s\" under \"%s\": at most %d nested scopes", fn,
                 (int)len, fqn, tp_comm_debug_current_scope(), TP__CD_MAX_DEPTH);
    TP_ARG_CHECK(len <= TP__CD_MAX_FQN,
                 "%s: scope FQN \"%.*s...\" has %zu characters, at most %d allowed", fn, 64,
                 fqn, len, TP__CD_MAX_FQN); /* len > 64 here: fqn holds 64 at least */
    TP_ARG_CHECK(len != sizeof TP_COMM_DEBUG_GLOBAL - 1 || memcmp(fqn, TP_COMM_DEBUG_GLOBAL, len),
                 "%s: scope FQN \"%s\" is reserved for the root of all scopes", fn,
                 TP_COMM_DEBUG_GLOBAL);
    size_t tlen = type ? strlen(type) : 0;
    if (tlen > TP__CD_MAX_TYPE)
        tlen = TP__CD_MAX_TYPE;
    int l = t->depth + 1;
    const tp__cd_level *up = l > 1 ? &t->lv[l - 1] : NULL;
    size_t off = up ? (size_t)up->off + up->len + 1 + up->type_len + 1 : 0;
    char *dst = t->buf + off;
    memcpy(dst, fqn, len);
    dst[len] = '\0';
    memcpy(dst + len + 1, type ? type : "", tlen);
    dst[len + 1 + tlen] = '\0';
    tp__cd_level *lv = &t->lv[l];
    lv->off = (uint16_t)off;
    lv->len = (uint16_t)len;
    lv->type_len = (uint16_t)tlen;
    lv->dup = false;
    lv->path = NULL;
    for (int e = 1; e < l && !lv->dup; e++)
        lv->dup = t->lv[e].len == len && memcmp(tp__cd_fqn(t, e), dst, len) == 0;
    t->depth = l;
    /* Registering now, not at the first record, lists scopes that issue no
     * collective too (as PyTorch's CommDebugMode does) and keeps the record
     * path free of lookups. A repeated FQN still adds its type name. */
    lv->slot = 0;
    if (t->active && (!lv->dup || tlen)) {
        uint32_t v = tp__cd_intern(t->active, t, l);
        lv->slot = lv->dup ? 0 : v;
    }
    return TP_OK;
}

tp_status tp_comm_debug_push_scope(const char *name)
{
    const char *fn = "comm_debug_push_scope";
    TP_ARG_CHECK(name, "%s: name is NULL", fn);
    tp__cd_thread *t = &tp__cd;
    size_t n = strlen(name);
    TP_ARG_CHECK(n > 0, "%s: empty scope name", fn);
    TP_ARG_CHECK(!memchr(name, '.', n),
                 "%s: scope name \"%s\" contains '.' (push one level at a time)", fn, name);
    /* nested in the current scope; the root module's scope "" adds no
     * prefix, like the top level */
    size_t cur = t->depth ? t->lv[t->depth].len : 0;
    size_t start = cur ? cur + 1 : 0;
    TP_ARG_CHECK(start + n <= TP__CD_MAX_FQN,
                 "%s: cannot push \"%s\" under \"%s\": the FQN would have %zu characters, "
                 "at most %d allowed", fn, name, tp_comm_debug_current_scope(), start + n,
                 TP__CD_MAX_FQN);
    TP_ARG_CHECK(start || strcmp(name, TP_COMM_DEBUG_GLOBAL) != 0,
                 "%s: \"%s\" is reserved for the root of all scopes", fn,
                 TP_COMM_DEBUG_GLOBAL);
    char fqn[TP__CD_MAX_FQN + 1];
    if (cur) {
        memcpy(fqn, tp__cd_fqn(t, t->depth), cur);
        fqn[cur] = '.';
    }
    memcpy(fqn + start, name, n);
    return tp__cd_push(fn, fqn, start + n, NULL);
}

tp_status tp__comm_debug_push_module(const char *fqn, size_t len, const char *root_type)
{
    if (!fqn)
        return tp__error(TP_ERR_INVALID_ARG, "module scope: fqn is NULL");
    return tp__cd_push("module scope", fqn, len, root_type);
}

tp_status tp_comm_debug_pop_scope(void)
{
    tp__cd_thread *t = &tp__cd;
    if (t->depth == 0)
        return tp__error(TP_ERR_STATE, "comm_debug_pop_scope: no scope is open");
    t->depth--;
    return TP_OK;
}

const char *tp_comm_debug_current_scope(void)
{
    const tp__cd_thread *t = &tp__cd;
    return t->depth ? tp__cd_fqn(t, t->depth) : TP_COMM_DEBUG_GLOBAL;
}

/* ---- saving and re-entering scopes (autograd) ------------------------------ */

/*
 * Every op that autograd records saves the scopes open on its thread, counter
 * or not (a backward counted alone still counts in its forward's scopes), so
 * a save must cost next to nothing. A saved stack is a chain of immutable
 * records, one per level, each pointing at the level that encloses it. Each
 * thread interns them in a small hash table: the first save under an open
 * scope finds or makes that scope's record (and its enclosing ones), caches
 * it in the level, and every later save under it returns the cached pointer.
 * Module calls repeat the same stacks every step, so after the first step no
 * save allocates. Interned records are never freed (a node may outlive the
 * thread that recorded it); they are allocated from libc rather than through
 * tp_allocator, which would count them as live forever, and linked into one
 * list so they stay reachable. Past TP__CD_MAX_PATHS of them (scope names
 * made up per call), or when libc cannot allocate, a save makes private
 * copies through tp_allocator instead, owned by the node that saved them.
 */
struct tp__cd_saved {
    const tp__cd_saved *parent; /* the enclosing level; NULL for level 1 */
    tp__cd_saved *next;         /* interned: the next record in its bucket */
    tp__cd_saved *all;          /* interned: the list of every interned record */
    uint32_t hash;
    uint16_t len, type_len;
    bool owned; /* a private copy, freed with the save that returned it */
    char text[]; /* the FQN, NUL, the root type name, NUL */
};

static _Atomic(tp__cd_saved *) tp__cd_paths_all;
static atomic_size_t tp__cd_npaths;

static uint32_t tp__cd_path_hash(const tp__cd_saved *parent, const char *fqn, size_t len,
                                 const char *type, size_t tlen)
{
    uintptr_t up = (uintptr_t)parent;
    uint32_t h = tp__cd_hash(fqn, len) ^ (uint32_t)(up ^ (up >> 32)) * 0x9e3779b1u;
    return h ^ tp__cd_hash(type, tlen) * 31u;
}

static tp__cd_saved *tp__cd_path_new(void *(*alloc)(size_t), const tp__cd_saved *parent,
                                     const char *fqn, size_t len, const char *type, size_t tlen)
{
    tp__cd_saved *p = alloc(sizeof *p + len + 1 + tlen + 1);
    if (!p)
        return NULL;
    memset(p, 0, sizeof *p);
    p->parent = parent;
    p->len = (uint16_t)len;
    p->type_len = (uint16_t)tlen;
    memcpy(p->text, fqn, len);
    p->text[len] = '\0';
    memcpy(p->text + len + 1, type, tlen);
    p->text[len + 1 + tlen] = '\0';
    return p;
}

/* The interned record of level l under parent (interned too, or NULL for
 * level 1); NULL past the limit or out of memory. */
static tp__cd_saved *tp__cd_path_intern(tp__cd_thread *t, const tp__cd_saved *parent, int l)
{
    const char *fqn = tp__cd_fqn(t, l), *type = tp__cd_type(t, l);
    size_t len = t->lv[l].len, tlen = t->lv[l].type_len;
    uint32_t h = tp__cd_path_hash(parent, fqn, len, type, tlen);
    tp__cd_saved **bucket = &t->paths[h & (TP__CD_PATH_BUCKETS - 1)];
    for (tp__cd_saved *p = *bucket; p; p = p->next)
        if (p->hash == h && p->parent == parent && p->len == len && p->type_len == tlen &&
            memcmp(p->text, fqn, len) == 0 && memcmp(p->text + len + 1, type, tlen) == 0)
            return p;
    if (atomic_fetch_add_explicit(&tp__cd_npaths, 1, memory_order_relaxed) >= TP__CD_MAX_PATHS) {
        atomic_fetch_sub_explicit(&tp__cd_npaths, 1, memory_order_relaxed);
        return NULL;
    }
    tp__cd_saved *p = tp__cd_path_new(malloc, parent, fqn, len, type, tlen);
    if (!p) {
        atomic_fetch_sub_explicit(&tp__cd_npaths, 1, memory_order_relaxed);
        return NULL;
    }
    p->hash = h;
    p->next = *bucket;
    *bucket = p;
    p->all = atomic_load_explicit(&tp__cd_paths_all, memory_order_relaxed);
    while (!atomic_compare_exchange_weak_explicit(&tp__cd_paths_all, &p->all, p,
                                                  memory_order_release, memory_order_relaxed))
        ;
    return p;
}

/* Resolves the open levels that have no record yet. */
static tp_status tp__cd_save_slow(tp__cd_thread *t, tp__cd_saved **out)
{
    tp__cd_saved *up = NULL;
    for (int l = 1; l <= t->depth; l++) {
        tp__cd_level *lv = &t->lv[l];
        if (lv->path) { /* resolved levels sit below unresolved ones */
            up = lv->path;
            continue;
        }
        tp__cd_saved *p = !up || !up->owned ? tp__cd_path_intern(t, up, l) : NULL;
        if (p) {
            lv->path = p;
        } else {
            p = tp__cd_path_new(tp__malloc, up, tp__cd_fqn(t, l), lv->len, tp__cd_type(t, l),
                                lv->type_len);
            if (!p) {
                tp__comm_debug_saved_free(up);
                return tp__error(TP_ERR_NO_MEMORY, "comm-debug scopes: out of memory");
            }
            p->owned = true;
        }
        up = p;
    }
    *out = up;
    return TP_OK;
}

tp_status tp__comm_debug_save(tp__cd_saved **out)
{
    tp__cd_thread *t = &tp__cd;
    *out = NULL;
    if (!t->depth)
        return TP_OK;
    tp__cd_saved *p = t->lv[t->depth].path;
    if (TP_LIKELY(p != NULL)) {
        *out = p;
        return TP_OK;
    }
    return tp__cd_save_slow(t, out);
}

void tp__comm_debug_saved_free(tp__cd_saved *saved)
{
    while (saved && saved->owned) {
        tp__cd_saved *up = (tp__cd_saved *)saved->parent;
        tp__free(saved);
        saved = up;
    }
}

int tp__comm_debug_enter(const tp__cd_saved *saved)
{
    const tp__cd_saved *chain[TP__CD_MAX_DEPTH];
    int n = 0;
    for (const tp__cd_saved *p = saved; p && n < TP__CD_MAX_DEPTH; p = p->parent)
        chain[n++] = p;
    int pushed = 0;
    while (n-- > 0) {
        const tp__cd_saved *p = chain[n];
        if (tp__cd_push("comm-debug scopes", p->text, p->len,
                        p->type_len ? p->text + p->len + 1 : NULL) != TP_OK)
            break;
        pushed++;
    }
    return pushed;
}

int tp__comm_debug_depth(void) { return tp__cd.depth; }

void tp__comm_debug_leave(int n)
{
    while (n-- > 0 && tp__cd.depth > 0)
        tp__cd.depth--;
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

typedef int64_t tp__cd_counts[TP_PHASE_COUNT][TP_COLL_KIND_COUNT];

/* The counts of scope fqn, or NULL for a scope the counter never saw. */
static const tp__cd_counts *tp__cd_lookup(const tp_comm_debug *debug, const char *fqn)
{
    if (strcmp(fqn, TP_COMM_DEBUG_GLOBAL) == 0)
        return (const tp__cd_counts *)&debug->global;
    size_t len = strlen(fqn);
    uint32_t v = tp__cd_find(debug, fqn, len, tp__cd_hash(fqn, len));
    return v ? (const tp__cd_counts *)&debug->scopes[v - 1]->counts : NULL;
}

int64_t tp_comm_debug_module_count(const tp_comm_debug *debug, const char *fqn,
                                   tp_phase phase, tp_coll_kind kind)
{
    if (!debug || !fqn)
        return 0;
    const tp__cd_counts *c = tp__cd_lookup(debug, fqn);
    return c ? tp__cd_sum(*c, phase, kind) : 0;
}

/* The error for a scope the counter never saw: names it, lists the scopes it
 * saw, and points at the likely mistake. */
static tp_status tp__cd_not_seen(const tp_comm_debug *d, const char *fn, const char *fqn)
{
    char list[640];
    size_t n = (size_t)snprintf(list, sizeof list, "\"%s\"", TP_COMM_DEBUG_GLOBAL);
    size_t i = 0;
    for (; i < d->nscopes; i++) {
        const tp__cd_scope *sc = d->scopes[i];
        char item[TP__CD_MAX_FQN + TP__CD_MAX_LABEL + 8];
        int w = sc->label ? snprintf(item, sizeof item, ", \"%s\" (%s)", sc->fqn, sc->label)
                          : snprintf(item, sizeof item, ", \"%s\"", sc->fqn);
        if (w < 0 || n + (size_t)w + 24 >= sizeof list)
            break;
        memcpy(list + n, item, (size_t)w + 1);
        n += (size_t)w;
    }
    if (i < d->nscopes)
        snprintf(list + n, sizeof list - n, ", ... (%zu more)", d->nscopes - i);

    /* "MLP.net1" for "net1", "MLP" for "": the names of other naming rules */
    char hint[TP__CD_MAX_FQN + 96] = "";
    const char *dot = strchr(fqn, '.');
    if (dot && tp__cd_lookup(d, dot + 1))
        snprintf(hint, sizeof hint, "; module scopes do not start with the root's type name: "
                                    "did you mean \"%s\"?", dot + 1);
    for (size_t k = 0; k < d->nscopes && !hint[0]; k++)
        if (d->scopes[k]->label && d->scopes[k]->len == 0 &&
            strcmp(d->scopes[k]->label, fqn) == 0)
            snprintf(hint, sizeof hint, "; the root module's scope is \"\" "
                                        "(TP_COMM_DEBUG_ROOT), not its type name");
    return tp__error(TP_ERR_INVALID_ARG,
                     "%s: scope \"%s\" was never entered while the counter was active%s; "
                     "scopes seen: %s%s", fn, fqn, hint, list,
                     d->scopes_missing ? " (some could not be recorded: out of memory)" : "");
}

tp_status tp_comm_debug_scope_count(const tp_comm_debug *debug, const char *fqn, tp_phase phase,
                                    tp_coll_kind kind, int64_t *count)
{
    const char *fn = "comm_debug_scope_count";
    TP_ARG_CHECK(count, "%s: count is NULL", fn);
    *count = 0;
    TP_ARG_CHECK(debug, "%s: debug is NULL", fn);
    TP_ARG_CHECK(fqn, "%s: fqn is NULL", fn);
    TP_ARG_CHECK((unsigned)phase <= TP_PHASE_COUNT,
                 "%s: phase %d is not TP_PHASE_FORWARD, TP_PHASE_BACKWARD, "
                 "TP_PHASE_RECOMPUTE or TP_PHASE_COUNT (all)", fn, (int)phase);
    TP_ARG_CHECK((unsigned)kind <= TP_COLL_ANY,
                 "%s: kind %d is not a tp_coll_kind or TP_COLL_ANY", fn, (int)kind);
    uintptr_t owner = atomic_load_explicit(&((tp_comm_debug *)debug)->owner,
                                           memory_order_acquire);
    if (owner != 0 && owner != tp__cd_self())
        return tp__error(TP_ERR_STATE, "%s: the counter is active on another thread", fn);
    const tp__cd_counts *c = tp__cd_lookup(debug, fqn);
    if (!c)
        return tp__cd_not_seen(debug, fn, fqn);
    *count = tp__cd_sum(*c, phase, kind);
    return TP_OK;
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

static const char *const tp__cd_phase_json[TP_PHASE_COUNT] = {"forward", "backward",
                                                              "recompute"};
static const char *const tp__cd_phase_table[TP_PHASE_COUNT] = {"FORWARD PASS", "BACKWARD PASS",
                                                               "RECOMPUTE (IN BACKWARD)"};

/* Whether phase p has a count: "recompute" is written only where it does. */
static bool tp__cd_phase_any(const int64_t counts[TP_PHASE_COUNT][TP_COLL_KIND_COUNT], int p)
{
    for (int k = 0; k < TP_COLL_KIND_COUNT; k++)
        if (counts[p][k])
            return true;
    return false;
}

static void tp__cd_json_scope(tp__cd_out *o, const char *fqn,
                              const int64_t counts[TP_PHASE_COUNT][TP_COLL_KIND_COUNT],
                              bool last)
{
    tp__cd_printf(o, "  ");
    tp__cd_json_string(o, fqn);
    tp__cd_printf(o, ": {");
    for (int p = 0; p < TP_PHASE_COUNT; p++) {
        if (p == TP_PHASE_RECOMPUTE && !tp__cd_phase_any(counts, p))
            continue;
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
        tp__cd_table_scope(&o, debug->scopes[i]->label ? debug->scopes[i]->label
                                                       : debug->scopes[i]->fqn,
                           debug->scopes[i]->depth, debug->scopes[i]->counts);
    if (debug->dropped)
        tp__cd_printf(&o, "note: %lld per-scope count(s) dropped (out of memory); the totals "
                          "are complete\n", (long long)debug->dropped);
    else if (debug->scopes_missing)
        tp__cd_printf(&o, "note: some scopes may be missing (out of memory)\n");
    if (o.failed)
        return tp__error(TP_ERR_BACKEND, "comm_debug_write_table: write failed");
    return TP_OK;
}

/* ---- TP_DEBUG ------------------------------------------------------------ */

uint32_t tp__comm_debug_comm_id(uint32_t parent, uint32_t seq, int color)
{
    uint32_t w[3] = {parent, seq, (uint32_t)color};
    return tp__cd_hash((const char *)w, sizeof w);
}

void tp__comm_debug_trace(const tp_comm *comm, const tp_coll_desc *d, size_t bytes,
                          double seconds)
{
    if (!tp__log_enabled(TP_LOG_TRACE))
        return;
    char what[256] = "", a[96], b[96];
    if (d->kind != TP_COLL_BARRIER) {
        const tp_tensor *s = d->send ? d->send : d->recv; /* scatter off the root: recv only */
        int n = snprintf(what, sizeof what, "%s %s", tp_dtype_name(d->dtype),
                         tp__shape_str(s->ndim, s->shape, a, sizeof a));
        bool same = d->recv && d->recv->ndim == s->ndim &&
                    !memcmp(d->recv->shape, s->shape, sizeof(int64_t) * (size_t)s->ndim);
        if (d->recv && !same && n > 0 && (size_t)n < sizeof what)
            n += snprintf(what + n, sizeof what - (size_t)n, " -> %s",
                          tp__shape_str(d->recv->ndim, d->recv->shape, b, sizeof b));
        if (n > 0 && (size_t)n < sizeof what)
            snprintf(what + n, sizeof what - (size_t)n, ", count %zu, ", d->count);
    }
    char extra[48] = "";
    if (d->kind == TP_COLL_ALL_REDUCE || d->kind == TP_COLL_REDUCE_SCATTER)
        snprintf(extra, sizeof extra, ", %s", tp_reduce_op_name(d->op));
    else if (d->kind == TP_COLL_BROADCAST || d->kind == TP_COLL_SCATTER)
        snprintf(extra, sizeof extra, ", root %d", d->root);
    char took[32] = ", async";
    if (seconds >= 0)
        snprintf(took, sizeof took, ", %.1f us", seconds * 1e6);
    tp__log(TP_LOG_TRACE, "coll %s comm %08x (%s, rank %d of %d): %s%zu bytes%s%s",
            tp_coll_kind_name(d->kind), comm->id, comm->ops.name, comm->rank, comm->size, what,
            bytes, extra, took);
}
