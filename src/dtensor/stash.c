/* The stash of selective activation recomputation (stash.h). */
#include "dtensor/stash.h"

#include "core/meta_mem.h"

#define TP__STASH_SAVED 4

typedef struct tp__stash_entry {
    const char *tag;
    tp_tensor *y;
    tp_tensor *saved[TP__STASH_SAVED];
} tp__stash_entry;

struct tp__stash {
    tp__stash_entry *v;
    size_t n, cap, pos;
};

static _Thread_local struct {
    tp__stash *s;
    bool replay;
} tp__stash_cur;

tp_status tp__stash_create(tp__stash **out)
{
    *out = tp__calloc(1, sizeof **out);
    return *out ? TP_OK : tp__error(TP_ERR_NO_MEMORY, "out of memory for a recompute stash");
}

void tp__stash_free(tp__stash *s)
{
    if (!s)
        return;
    for (size_t i = 0; i < s->n; i++) {
        tp_tensor_release(s->v[i].y);
        for (int j = 0; j < TP__STASH_SAVED; j++)
            tp_tensor_release(s->v[i].saved[j]);
    }
    tp__free(s->v);
    tp__free(s);
}

bool tp__stash_active(void) { return tp__stash_cur.s != NULL; }

bool tp__stash_record_begin(tp__stash *s)
{
    if (tp__stash_cur.s)
        return false;
    tp__stash_cur.s = s;
    tp__stash_cur.replay = false;
    return true;
}

void tp__stash_record_end(tp__stash *s)
{
    if (tp__stash_cur.s == s)
        tp__stash_cur.s = NULL;
}

bool tp__stash_replay_begin(tp__stash *s)
{
    if (tp__stash_cur.s)
        return false;
    s->pos = 0;
    tp__stash_cur.s = s;
    tp__stash_cur.replay = true;
    return true;
}

tp_status tp__stash_replay_end(tp__stash *s, tp_status st)
{
    if (tp__stash_cur.s == s)
        tp__stash_cur.s = NULL;
    if (st == TP_OK && s->pos != s->n)
        return tp__error(TP_ERR_STATE,
                         "the recomputed forward used %zu of the %zu outputs its first run "
                         "kept: it did not run the same ops again",
                         s->pos, s->n);
    return st;
}

bool tp__stash_replaying(void) { return tp__stash_cur.s && tp__stash_cur.replay; }

tp_status tp__stash_put(const char *tag, tp_tensor *y, tp_tensor *const *saved, int n)
{
    tp__stash *s = tp__stash_cur.s;
    if (!s || tp__stash_cur.replay)
        return TP_OK;
    TP_ASSERT(n <= TP__STASH_SAVED);
    if (!tp__grow_array((void **)&s->v, s->n, &s->cap, sizeof *s->v))
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory for the recompute stash", tag);
    tp__stash_entry *e = &s->v[s->n++];
    *e = (tp__stash_entry){.tag = tag, .y = tp_tensor_retain(y)};
    tp__meta_mem_tag(y, TP_MEM_ACTIVATIONS, NULL); /* memory accounting on meta */
    for (int j = 0; j < n; j++) {
        e->saved[j] = saved[j] ? tp_tensor_retain(saved[j]) : NULL;
        tp__meta_mem_tag(saved[j], TP_MEM_ACTIVATIONS, NULL);
    }
    return TP_OK;
}

tp_status tp__stash_take(const char *tag, tp_tensor **y, tp_tensor **saved, int n)
{
    tp__stash *s = tp__stash_cur.s;
    TP_ASSERT(s && tp__stash_cur.replay && n <= TP__STASH_SAVED);
    if (s->pos == s->n)
        return tp__error(TP_ERR_STATE,
                         "%s: the recomputed forward runs more kept ops than its first run "
                         "(%zu): it did not run the same ops again",
                         tag, s->n);
    tp__stash_entry *e = &s->v[s->pos];
    if (e->tag != tag)
        return tp__error(TP_ERR_STATE,
                         "%s: the recomputed forward's kept op %zu was %s in its first run: it "
                         "did not run the same ops again",
                         tag, s->pos, e->tag);
    s->pos++;
    /* a new handle: the kept tensor may be the first run's output itself,
     * which autograd state (the recompute's own node) hangs on now */
    TP_CHECK(tp__tensor_alias(e->y, y));
    for (int j = 0; j < n; j++)
        saved[j] = e->saved[j] ? tp_tensor_retain(e->saved[j]) : NULL;
    return TP_OK;
}
