/* tp_parallelize_module: matches plan entries against the module tree (FQN
 * patterns, fnmatch per dot-separated token) and applies their styles. Every
 * check (patterns, module kinds, double sharding) runs before anything is
 * applied, so a plan that fails validation leaves the module unchanged. */
#include <fnmatch.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "styles/styles_internal.h"

/* Matches one token [p, pe) against [f, fe) with fnmatch (flags 0). */
static bool tp__token_match(const char *p, size_t pn, const char *f, size_t fn)
{
    char pb[256], fb[256];
    char *pa = pn < sizeof pb ? pb : tp__malloc(pn + 1);
    char *fa = fn < sizeof fb ? fb : tp__malloc(fn + 1);
    bool ok = false;
    if (pa && fa) {
        memcpy(pa, p, pn);
        pa[pn] = '\0';
        memcpy(fa, f, fn);
        fa[fn] = '\0';
        ok = fnmatch(pa, fa, 0) == 0;
    }
    if (pa != pb)
        tp__free(pa);
    if (fa != fb)
        tp__free(fa);
    return ok;
}

bool tp_fqn_match(const char *pattern, const char *fqn)
{
    if (!pattern || !fqn)
        return false;
    /* "" is the module itself and nothing else ("*" matches children only) */
    if (!pattern[0] || !fqn[0])
        return !pattern[0] && !fqn[0];
    /* a pattern without fnmatch's special characters matches itself alone
     * (plans resolved to module names, as tp_llm_parallelize's, are all
     * literal: the whole-tree match of a 70B model is then string compares) */
    if (!strpbrk(pattern, "*?[\\"))
        return strcmp(pattern, fqn) == 0;
    const char *p = pattern, *f = fqn;
    for (;;) {
        const char *pe = strchr(p, '.'), *fe = strchr(f, '.');
        size_t pn = pe ? (size_t)(pe - p) : strlen(p);
        size_t fn = fe ? (size_t)(fe - f) : strlen(f);
        if (!tp__token_match(p, pn, f, fn))
            return false;
        if (!pe || !fe)
            return !pe && !fe; /* same token count */
        p = pe + 1;
        f = fe + 1;
    }
}

/* ---- the module list ------------------------------------------------------ */

typedef struct tp__mod_entry {
    tp_module *m;
    char *fqn;
    const tp_style *sharder; /* the parameter-sharding style this plan gives it */
} tp__mod_entry;

typedef struct tp__mod_list {
    tp__mod_entry *v;
    int n;
    size_t cap;
} tp__mod_list;

static void tp__mod_list_free(tp__mod_list *l)
{
    for (int i = 0; i < l->n; i++)
        tp__free(l->v[i].fqn);
    tp__free(l->v);
}

/* Depth first, parents before children, children in insertion order. */
static tp_status tp__collect(tp__mod_list *l, tp_module *m, const char *fqn)
{
    if (!tp__grow_array((void **)&l->v, l->n, &l->cap, sizeof *l->v))
        return tp__error(TP_ERR_NO_MEMORY, "tp_parallelize_module: out of memory");
    char *own = tp__strdup(fqn);
    if (!own)
        return tp__error(TP_ERR_NO_MEMORY, "tp_parallelize_module: out of memory");
    l->v[l->n].m = m;
    l->v[l->n].fqn = own;
    l->v[l->n].sharder = NULL;
    l->n++;
    for (int i = 0; i < tp_module_num_children(m); i++) {
        const char *name = NULL;
        tp_module *c = tp_module_child_at(m, i, &name);
        size_t len = strlen(fqn) + strlen(name) + 2;
        char *cf = tp__malloc(len);
        if (!cf)
            return tp__error(TP_ERR_NO_MEMORY, "tp_parallelize_module: out of memory");
        if (fqn[0])
            snprintf(cf, len, "%s.%s", fqn, name);
        else
            snprintf(cf, len, "%s", name);
        tp_status st = tp__collect(l, c, cf);
        tp__free(cf);
        if (st != TP_OK)
            return st;
    }
    return TP_OK;
}

static int tp__entry_cmp(const void *a, const void *b)
{
    return strcmp((*(tp__mod_entry *const *)a)->fqn, (*(tp__mod_entry *const *)b)->fqn);
}

/* The first module of l at or after index `from` (tree order) that pattern
 * pat matches, or -1. A literal pattern (plans resolved to module names, a
 * model's thousand entries) is looked up in by_fqn (l's entries sorted by
 * FQN, FQNs unique in a tree) instead of matched against every module. */
static int tp__next_match(const tp__mod_list *l, tp__mod_entry *const *by_fqn, const char *pat,
                          int from)
{
    if (by_fqn && !strpbrk(pat, "*?[\\")) {
        int lo = 0, hi = l->n - 1;
        while (lo <= hi) {
            int mid = lo + (hi - lo) / 2, c = strcmp(pat, by_fqn[mid]->fqn);
            if (!c) {
                int i = (int)(by_fqn[mid] - l->v);
                return i >= from ? i : -1;
            }
            if (c < 0)
                hi = mid - 1;
            else
                lo = mid + 1;
        }
        return -1;
    }
    for (int i = from; i < l->n; i++)
        if (tp_fqn_match(pat, l->v[i].fqn))
            return i;
    return -1;
}

tp_status tp_parallelize_module(tp_module *module, tp_mesh *mesh, int n,
                                const tp_plan_entry *plan, const tp_parallelize_options *opts)
{
    const char *fn = "tp_parallelize_module";
    if (opts && opts->n_unmatched)
        *opts->n_unmatched = 0;
    TP_ARG_CHECK(module, "%s: module is NULL", fn);
    TP_ARG_CHECK(mesh, "%s: mesh is NULL", fn);
    TP_ARG_CHECK(n >= 0, "%s: n is %d", fn, n);
    TP_ARG_CHECK(n == 0 || plan, "%s: plan is NULL", fn);
    int md = tp_mesh_ndim(mesh);
    TP_ARG_CHECK(md == 1, "%s: mesh is %d-d; pass a 1-d slice (tp_mesh_slice)", fn, md);
    int src = opts ? opts->src_data_rank : 0;
    TP_ARG_CHECK(src == TP_SRC_DATA_RANK_NONE || (src >= 0 && src < tp_mesh_numel(mesh)),
                 "%s: src_data_rank %d is not a rank of the %lld-rank mesh (nor "
                 "TP_SRC_DATA_RANK_NONE)",
                 fn, src, (long long)tp_mesh_numel(mesh));
    for (int e = 0; e < n; e++) {
        TP_ARG_CHECK(plan[e].fqn, "%s: plan[%d].fqn is NULL", fn, e);
        TP_ARG_CHECK(plan[e].style, "%s: plan[%d] ('%s') has no style", fn, e, plan[e].fqn);
    }

    tp__mod_list l = {0};
    tp_status st = tp__collect(&l, module, "");
    int *hits = NULL;
    tp__mod_entry **by_fqn = NULL;
    if (st == TP_OK && n > 0) {
        hits = tp__calloc((size_t)n, sizeof *hits);
        by_fqn = tp__malloc((size_t)l.n * sizeof *by_fqn);
        if (!hits || !by_fqn)
            st = tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    }
    if (st == TP_OK && by_fqn) {
        for (int i = 0; i < l.n; i++)
            by_fqn[i] = &l.v[i];
        qsort(by_fqn, (size_t)l.n, sizeof *by_fqn, tp__entry_cmp);
    }

    /* 1. match every entry and validate every (entry, module) pair */
    int n_unmatched = 0, first_unmatched = -1;
    for (int e = 0; e < n && st == TP_OK; e++) {
        const tp_style *s = plan[e].style;
        for (int i = tp__next_match(&l, by_fqn, plan[e].fqn, 0); i >= 0 && st == TP_OK;
             i = tp__next_match(&l, by_fqn, plan[e].fqn, i + 1)) {
            tp__mod_entry *me = &l.v[i];
            hits[e]++;
            st = tp__style_check(s, me->m, me->fqn);
            if (st != TP_OK || !tp__style_shards_params(s))
                continue;
            const char *prev = me->sharder ? tp__style_name(me->sharder) : tp__style_sharded_by(me->m);
            if (prev) {
                char wb[300];
                st = tp__error(TP_ERR_INVALID_ARG,
                               "%s: module %s is already sharded by %s; cannot also apply %s "
                               "(plan entry %d, '%s')",
                               fn, tp__style_where(me->fqn, wb, sizeof wb), prev, tp__style_name(s), e,
                               plan[e].fqn);
            }
            me->sharder = s;
        }
        if (hits && hits[e] == 0) {
            if (opts && opts->unmatched)
                opts->unmatched[n_unmatched] = e;
            if (first_unmatched < 0)
                first_unmatched = e;
            n_unmatched++;
        }
    }
    if (opts && opts->n_unmatched && st == TP_OK)
        *opts->n_unmatched = n_unmatched;
    if (st == TP_OK && n_unmatched > 0 && !(opts && opts->allow_unmatched))
        st = tp__error(TP_ERR_INVALID_ARG,
                       "%s: plan entry %d ('%s', %s) matched no module%s", fn, first_unmatched,
                       plan[first_unmatched].fqn, tp__style_name(plan[first_unmatched].style),
                       n_unmatched > 1 ? " (and other entries too)" : "");

    /* 2. apply, entry by entry, modules in tree order */
    for (int e = 0; e < n && st == TP_OK; e++)
        for (int i = tp__next_match(&l, by_fqn, plan[e].fqn, 0); i >= 0 && st == TP_OK;
             i = tp__next_match(&l, by_fqn, plan[e].fqn, i + 1))
            st = tp__style_apply(plan[e].style, l.v[i].m, l.v[i].fqn, mesh, src);

    tp__free(by_fqn);
    tp__free(hits);
    tp__mod_list_free(&l);
    return st;
}
