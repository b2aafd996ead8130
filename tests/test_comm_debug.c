/* The comm-debug counter: the per-thread scope/phase API, counter state rules,
 * the writers, allocation failures, and exact counts of real collectives
 * issued by ranks running as threads. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>

#include "tp_test.h"

#define CD_TIMEOUT 30
#define CD_COMM_TIMEOUT 60

/* ---- a small JSON reader for the writer's schema --------------------------
 *
 * Accepts exactly {"<scope>": {"forward": {"<kind>": N, ...}, "backward":
 * {...}}, ...} with arbitrary whitespace and string escapes, so a test fails
 * on malformed output, not just on missing substrings. */

#define JSON_MAX_SCOPES 64
#define JSON_MAX_LEAVES 256
#define JSON_NAME 300

typedef struct json_leaf {
    int scope;
    int phase;
    char kind[32];
    long long value;
} json_leaf;

typedef struct json_doc {
    char scope[JSON_MAX_SCOPES][JSON_NAME]; /* in document order */
    int nscopes;
    json_leaf leaf[JSON_MAX_LEAVES];
    int nleaves;
} json_doc;

static void json_ws(const char **p)
{
    while (**p == ' ' || **p == '\n' || **p == '\t' || **p == '\r')
        (*p)++;
}

static bool json_lit(const char **p, char c)
{
    json_ws(p);
    if (**p != c)
        return false;
    (*p)++;
    return true;
}

static bool json_string(const char **p, char *out, size_t cap)
{
    size_t n = 0;
    if (!json_lit(p, '"'))
        return false;
    for (;;) {
        unsigned char c = (unsigned char)*(*p)++;
        if (c == '\0' || c < 0x20)
            return false;
        if (c == '"')
            break;
        if (c == '\\') {
            c = (unsigned char)*(*p)++;
            switch (c) {
            case '"': case '\\': case '/': break;
            case 'n': c = '\n'; break;
            case 't': c = '\t'; break;
            case 'r': c = '\r'; break;
            case 'b': c = '\b'; break;
            case 'f': c = '\f'; break;
            case 'u': {
                unsigned v = 0;
                for (int i = 0; i < 4; i++) {
                    char h = *(*p)++;
                    v <<= 4;
                    if (h >= '0' && h <= '9') v |= (unsigned)(h - '0');
                    else if (h >= 'a' && h <= 'f') v |= (unsigned)(h - 'a' + 10);
                    else if (h >= 'A' && h <= 'F') v |= (unsigned)(h - 'A' + 10);
                    else return false;
                }
                if (v > 0x7f)
                    return false; /* the writer only escapes control bytes */
                c = (unsigned char)v;
                break;
            }
            default:
                return false;
            }
        }
        if (n + 1 >= cap)
            return false;
        out[n++] = (char)c;
    }
    out[n] = '\0';
    return true;
}

static bool json_phase(const char **p, json_doc *doc, int scope, int phase)
{
    if (!json_lit(p, '{'))
        return false;
    if (json_lit(p, '}'))
        return true;
    do {
        if (doc->nleaves == JSON_MAX_LEAVES)
            return false;
        json_leaf *l = &doc->leaf[doc->nleaves++];
        l->scope = scope;
        l->phase = phase;
        if (!json_string(p, l->kind, sizeof l->kind) || !json_lit(p, ':'))
            return false;
        json_ws(p);
        char *end;
        l->value = strtoll(*p, &end, 10);
        if (end == *p || l->value <= 0) /* zero counts are left out */
            return false;
        *p = end;
    } while (json_lit(p, ','));
    return json_lit(p, '}');
}

static bool json_parse(const char *s, json_doc *doc)
{
    memset(doc, 0, sizeof *doc);
    const char **p = &s;
    if (!json_lit(p, '{'))
        return false;
    do {
        if (doc->nscopes == JSON_MAX_SCOPES)
            return false;
        int sc = doc->nscopes++;
        char key[32];
        if (!json_string(p, doc->scope[sc], JSON_NAME) || !json_lit(p, ':') || !json_lit(p, '{'))
            return false;
        if (!json_string(p, key, sizeof key) || strcmp(key, "forward") != 0 ||
            !json_lit(p, ':') || !json_phase(p, doc, sc, 0) || !json_lit(p, ','))
            return false;
        if (!json_string(p, key, sizeof key) || strcmp(key, "backward") != 0 ||
            !json_lit(p, ':') || !json_phase(p, doc, sc, 1) || !json_lit(p, '}'))
            return false;
    } while (json_lit(p, ','));
    if (!json_lit(p, '}'))
        return false;
    json_ws(p);
    return **p == '\0';
}

static int json_scope_index(const json_doc *doc, const char *scope)
{
    for (int i = 0; i < doc->nscopes; i++)
        if (strcmp(doc->scope[i], scope) == 0)
            return i;
    return -1;
}

/* Count for (scope, phase, kind); 0 when absent, -1 when the scope is absent. */
static long long json_get(const json_doc *doc, const char *scope, int phase, const char *kind)
{
    int sc = json_scope_index(doc, scope);
    if (sc < 0)
        return -1;
    for (int i = 0; i < doc->nleaves; i++)
        if (doc->leaf[i].scope == sc && doc->leaf[i].phase == phase &&
            strcmp(doc->leaf[i].kind, kind) == 0)
            return doc->leaf[i].value;
    return 0;
}

/* Runs a writer into buf (NUL-terminated). */
static tp_status capture(tp_status (*writer)(const tp_comm_debug *, FILE *),
                         const tp_comm_debug *d, char *buf, size_t cap)
{
    memset(buf, 0, cap);
    FILE *f = fmemopen(buf, cap - 1, "w");
    if (!f)
        return TP_ERR_BACKEND;
    tp_status st = writer(d, f);
    fclose(f);
    return st;
}

/* ---- scopes and phase (no communication) --------------------------------- */

Test(comm_debug, scope_push_pop, .timeout = CD_TIMEOUT)
{
    cr_assert_str_eq(tp_comm_debug_current_scope(), "Global");
    cr_assert_eq(tp_comm_debug_push_scope("mlp"), TP_OK);
    cr_assert_str_eq(tp_comm_debug_current_scope(), "mlp");
    cr_assert_eq(tp_comm_debug_push_scope("net1"), TP_OK);
    cr_assert_str_eq(tp_comm_debug_current_scope(), "mlp.net1");
    cr_assert_eq(tp_comm_debug_pop_scope(), TP_OK);
    cr_assert_str_eq(tp_comm_debug_current_scope(), "mlp");
    cr_assert_eq(tp_comm_debug_push_scope("net2"), TP_OK);
    cr_assert_str_eq(tp_comm_debug_current_scope(), "mlp.net2");
    /* "Global" is reserved only as a top-level name */
    cr_assert_eq(tp_comm_debug_push_scope("Global"), TP_OK);
    cr_assert_str_eq(tp_comm_debug_current_scope(), "mlp.net2.Global");
    for (int i = 0; i < 3; i++)
        cr_assert_eq(tp_comm_debug_pop_scope(), TP_OK);
    cr_assert_str_eq(tp_comm_debug_current_scope(), "Global");
    tp_clear_error();
    cr_assert_eq(tp_comm_debug_pop_scope(), TP_ERR_STATE);
    cr_assert(strstr(tp_last_error(), "no scope") != NULL, "message: %s", tp_last_error());
    cr_assert_str_eq(tp_comm_debug_current_scope(), "Global");
}

Test(comm_debug, scope_bad_names, .timeout = CD_TIMEOUT)
{
    cr_assert_eq(tp_comm_debug_push_scope("outer"), TP_OK);
    cr_assert_eq(tp_comm_debug_push_scope(NULL), TP_ERR_INVALID_ARG);
    cr_assert_eq(tp_comm_debug_push_scope(""), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "empty") != NULL, "message: %s", tp_last_error());
    cr_assert_eq(tp_comm_debug_push_scope("a.b"), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "a.b") != NULL, "message: %s", tp_last_error());
    cr_assert_str_eq(tp_comm_debug_current_scope(), "outer", "failed pushes change nothing");
    cr_assert_eq(tp_comm_debug_pop_scope(), TP_OK);
    cr_assert_eq(tp_comm_debug_push_scope("Global"), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "reserved") != NULL, "message: %s", tp_last_error());
    cr_assert_str_eq(tp_comm_debug_current_scope(), "Global");
    cr_assert_eq(tp_comm_debug_pop_scope(), TP_ERR_STATE);
}

Test(comm_debug, scope_depth_limit, .timeout = CD_TIMEOUT)
{
    char expect[256] = "";
    for (int i = 0; i < 32; i++) {
        cr_assert_eq(tp_comm_debug_push_scope("s"), TP_OK, "level %d: %s", i + 1,
                     tp_last_error());
        strcat(expect, i ? ".s" : "s");
    }
    cr_assert_str_eq(tp_comm_debug_current_scope(), expect);
    cr_assert_eq(tp_comm_debug_push_scope("s"), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "32") != NULL, "message: %s", tp_last_error());
    cr_assert_str_eq(tp_comm_debug_current_scope(), expect);
    for (int i = 0; i < 32; i++)
        cr_assert_eq(tp_comm_debug_pop_scope(), TP_OK);
    cr_assert_eq(tp_comm_debug_pop_scope(), TP_ERR_STATE);
}

Test(comm_debug, scope_fqn_limit, .timeout = CD_TIMEOUT)
{
    char name[300];
    /* a single name of exactly 255 characters fits, 256 does not */
    memset(name, 'x', 256);
    name[256] = '\0';
    cr_assert_eq(tp_comm_debug_push_scope(name), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "255") != NULL, "message: %s", tp_last_error());
    name[255] = '\0';
    cr_assert_eq(tp_comm_debug_push_scope(name), TP_OK);
    cr_assert_eq(strlen(tp_comm_debug_current_scope()), 255);
    cr_assert_eq(tp_comm_debug_push_scope("y"), TP_ERR_INVALID_ARG);
    cr_assert_eq(tp_comm_debug_pop_scope(), TP_OK);

    /* nested: "a." + 253 characters is 255 */
    cr_assert_eq(tp_comm_debug_push_scope("a"), TP_OK);
    name[254] = '\0';
    cr_assert_eq(tp_comm_debug_push_scope(name), TP_ERR_INVALID_ARG);
    cr_assert_str_eq(tp_comm_debug_current_scope(), "a");
    name[253] = '\0';
    cr_assert_eq(tp_comm_debug_push_scope(name), TP_OK);
    cr_assert_eq(strlen(tp_comm_debug_current_scope()), 255);
    cr_assert_eq(strncmp(tp_comm_debug_current_scope(), "a.xxx", 5), 0);
    cr_assert_eq(tp_comm_debug_pop_scope(), TP_OK);
    cr_assert_str_eq(tp_comm_debug_current_scope(), "a");
    cr_assert_eq(tp_comm_debug_pop_scope(), TP_OK);
}

/* A module whose FQN is over the limit is refused with its real length, not
 * the length of the buffer it was cut to: "outer.inner.leaf" with names of
 * na, nb and nc characters. */
static void long_fqn_case(int na, int nb, int nc)
{
    char name[3][600];
    int lens[3] = {na, nb, nc};
    for (int i = 0; i < 3; i++) {
        memset(name[i], 'a' + i, (size_t)lens[i]);
        name[i][lens[i]] = '\0';
    }
    tp_module *root = NULL, *outer = NULL, *inner = NULL, *leaf = NULL;
    cr_assert_eq(tp_nn_container_create(&root), TP_OK);
    cr_assert_eq(tp_nn_container_create(&outer), TP_OK);
    cr_assert_eq(tp_nn_container_create(&inner), TP_OK);
    cr_assert_eq(tp_nn_linear_create(4, 3, false, &leaf), TP_OK);
    cr_assert_eq(tp_module_add_child(inner, name[2], leaf), TP_OK);
    cr_assert_eq(tp_module_add_child(outer, name[1], inner), TP_OK);
    cr_assert_eq(tp_module_add_child(root, name[0], outer), TP_OK);
    tp_tensor *x = NULL, *y = NULL;
    cr_assert_eq(tp_tensor_zeros(TP_F32, TP_CPU, 2, (int64_t[]){2, 4}, &x), TP_OK);
    cr_assert_eq(tp_module_call(leaf, x, &y), TP_ERR_INVALID_ARG);
    char want[64];
    snprintf(want, sizeof want, "has %d characters, at most 255 allowed", na + nb + nc + 2);
    cr_assert(strstr(tp_last_error(), want), "want \"%s\" in: %s", want, tp_last_error());
    cr_assert_null(y);
    cr_assert_str_eq(tp_comm_debug_current_scope(), TP_COMM_DEBUG_GLOBAL, "stack unchanged");
    tp_tensor_release(x);
    tp_module_free(root);
}

Test(comm_debug, module_fqn_over_limit_reports_its_length, .timeout = CD_TIMEOUT)
{
    long_fqn_case(100, 100, 100); /* 302 */
    long_fqn_case(120, 80, 54);   /* 256: one past the limit */
    long_fqn_case(500, 500, 500); /* 1502 */
}

Test(comm_debug, phase, .timeout = CD_TIMEOUT)
{
    cr_assert_eq(tp_comm_debug_phase(), TP_PHASE_FORWARD);
    tp_comm_debug_set_phase(TP_PHASE_BACKWARD);
    cr_assert_eq(tp_comm_debug_phase(), TP_PHASE_BACKWARD);
    tp_comm_debug_set_phase(TP_PHASE_COUNT); /* not a phase: ignored */
    cr_assert_eq(tp_comm_debug_phase(), TP_PHASE_BACKWARD);
    tp_comm_debug_set_phase(TP_PHASE_FORWARD);
    cr_assert_eq(tp_comm_debug_phase(), TP_PHASE_FORWARD);
}

/* Phase and scopes are per thread: another thread starts from the defaults
 * and its changes do not leak back. */
typedef struct thread_view {
    char scope_before[64];
    tp_phase phase_before;
    char scope_after[64];
} thread_view;

static void *other_thread_scopes(void *arg)
{
    thread_view *v = arg;
    snprintf(v->scope_before, sizeof v->scope_before, "%s", tp_comm_debug_current_scope());
    v->phase_before = tp_comm_debug_phase();
    tp_comm_debug_push_scope("theirs");
    tp_comm_debug_set_phase(TP_PHASE_BACKWARD);
    snprintf(v->scope_after, sizeof v->scope_after, "%s", tp_comm_debug_current_scope());
    return NULL;
}

Test(comm_debug, scope_and_phase_are_per_thread, .timeout = CD_TIMEOUT)
{
    cr_assert_eq(tp_comm_debug_push_scope("mine"), TP_OK);
    tp_comm_debug_set_phase(TP_PHASE_BACKWARD);
    thread_view v;
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, other_thread_scopes, &v), 0);
    pthread_join(th, NULL);
    cr_assert_str_eq(v.scope_before, "Global");
    cr_assert_eq(v.phase_before, TP_PHASE_FORWARD);
    cr_assert_str_eq(v.scope_after, "theirs");
    cr_assert_str_eq(tp_comm_debug_current_scope(), "mine");
    cr_assert_eq(tp_comm_debug_phase(), TP_PHASE_BACKWARD);
}

/* ---- counter state (no communication) ------------------------------------ */

Test(comm_debug, null_arguments, .timeout = CD_TIMEOUT)
{
    char buf[64];
    cr_assert_eq(tp_comm_debug_create(NULL), TP_ERR_INVALID_ARG);
    cr_assert_eq(tp_comm_debug_begin(NULL), TP_ERR_INVALID_ARG);
    cr_assert_eq(tp_comm_debug_end(NULL), TP_ERR_INVALID_ARG);
    tp_comm_debug_free(NULL);
    cr_assert_eq(tp_comm_debug_count(NULL, TP_COLL_ANY), 0);
    cr_assert_eq(tp_comm_debug_total(NULL), 0);
    cr_assert_eq(tp_comm_debug_bytes(NULL, TP_COLL_ANY), 0);
    cr_assert_eq(tp_comm_debug_module_count(NULL, "Global", TP_PHASE_COUNT, TP_COLL_ANY), 0);
    cr_assert_eq(capture(tp_comm_debug_write_json, NULL, buf, sizeof buf), TP_ERR_INVALID_ARG);
    cr_assert_eq(capture(tp_comm_debug_write_table, NULL, buf, sizeof buf), TP_ERR_INVALID_ARG);

    tp_comm_debug *d = NULL;
    cr_assert_eq(tp_comm_debug_create(&d), TP_OK);
    cr_assert_eq(tp_comm_debug_write_json(d, NULL), TP_ERR_INVALID_ARG);
    cr_assert_eq(tp_comm_debug_write_table(d, NULL), TP_ERR_INVALID_ARG);
    cr_assert_eq(tp_comm_debug_module_count(d, NULL, TP_PHASE_COUNT, TP_COLL_ANY), 0);
    /* out-of-range kinds and phases count nothing rather than read past */
    cr_assert_eq(tp_comm_debug_count(d, (tp_coll_kind)(TP_COLL_ANY + 1)), 0);
    cr_assert_eq(tp_comm_debug_bytes(d, (tp_coll_kind)-1), 0);
    cr_assert_eq(tp_comm_debug_module_count(d, "Global", (tp_phase)7, TP_COLL_ANY), 0);
    tp_comm_debug_free(d);
}

/* The checked query: seen (entered while active, or open at begin) with 0
 * collectives is TP_OK and 0; never seen, and bad arguments, are errors. */
Test(comm_debug, scope_count_seen_and_never_seen, .timeout = CD_TIMEOUT)
{
    tp_comm_debug *d = NULL;
    int64_t n = -1;
    CHECK_OK(tp_comm_debug_create(&d));
    CHECK_OK(tp_comm_debug_scope_count(d, "Global", TP_PHASE_COUNT, TP_COLL_ANY, &n));
    cr_assert_eq(n, 0, "Global is always seen");
    CHECK_OK(tp_comm_debug_push_scope("before")); /* open at begin: seen */
    CHECK_OK(tp_comm_debug_begin(d));
    CHECK_OK(tp_comm_debug_push_scope("a"));
    CHECK_OK(tp_comm_debug_pop_scope());
    CHECK_OK(tp_comm_debug_pop_scope());
    n = -1;
    CHECK_OK(tp_comm_debug_scope_count(d, "before.a", TP_PHASE_FORWARD, TP_COLL_ALL_REDUCE,
                                       &n)); /* also while active, on this thread */
    cr_assert_eq(n, 0);
    CHECK_OK(tp_comm_debug_end(d));
    CHECK_OK(tp_comm_debug_push_scope("after")); /* not active: not seen */
    CHECK_OK(tp_comm_debug_pop_scope());
    for (int p = 0; p <= TP_PHASE_COUNT; p++)
        for (int k = 0; k <= TP_COLL_ANY; k++) {
            n = -1;
            CHECK_OK(tp_comm_debug_scope_count(d, "before", (tp_phase)p, (tp_coll_kind)k, &n));
            cr_assert_eq(n, 0);
        }

    static const char *const unseen[] = {"after", "a", "Before", "before.a.b", ""};
    for (size_t i = 0; i < sizeof unseen / sizeof unseen[0]; i++) {
        n = -1;
        CHECK_ERR(tp_comm_debug_scope_count(d, unseen[i], TP_PHASE_COUNT, TP_COLL_ANY, &n),
                  TP_ERR_INVALID_ARG);
        cr_assert_eq(n, 0, "the count is 0 on error");
        char want[256];
        snprintf(want, sizeof want,
                 "comm_debug_scope_count: scope \"%s\" was never entered while the counter "
                 "was active; scopes seen: \"Global\", \"before\", \"before.a\"", unseen[i]);
        cr_assert_str_eq(tp_last_error(), want);
        cr_assert_eq(tp_comm_debug_module_count(d, unseen[i], TP_PHASE_COUNT, TP_COLL_ANY), 0,
                     "the unchecked query reads 0");
    }
    /* a near miss across the separator gets a hint */
    CHECK_ERR(tp_comm_debug_scope_count(d, "x.before", TP_PHASE_COUNT, TP_COLL_ANY, &n),
              TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "did you mean \"before\"?"), "message: %s",
              tp_last_error());

    CHECK_ERR(tp_comm_debug_scope_count(NULL, "Global", TP_PHASE_COUNT, TP_COLL_ANY, &n),
              TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_comm_debug_scope_count(d, NULL, TP_PHASE_COUNT, TP_COLL_ANY, &n),
              TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_comm_debug_scope_count(d, "Global", TP_PHASE_COUNT, TP_COLL_ANY, NULL),
              TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_comm_debug_scope_count(d, "Global", (tp_phase)(TP_PHASE_COUNT + 1),
                                        TP_COLL_ANY, &n),
              TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "phase 4"), "message: %s", tp_last_error());
    CHECK_ERR(tp_comm_debug_scope_count(d, "Global", TP_PHASE_COUNT,
                                        (tp_coll_kind)(TP_COLL_ANY + 1), &n),
              TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "kind"), "message: %s", tp_last_error());

    /* a long list is cut, saying how many were left out */
    CHECK_OK(tp_comm_debug_begin(d));
    for (int i = 0; i < 100; i++) {
        char name[16];
        snprintf(name, sizeof name, "scope%d", i);
        CHECK_OK(tp_comm_debug_push_scope(name));
        CHECK_OK(tp_comm_debug_pop_scope());
    }
    CHECK_OK(tp_comm_debug_end(d));
    CHECK_ERR(tp_comm_debug_scope_count(d, "nope", TP_PHASE_COUNT, TP_COLL_ANY, &n),
              TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "\"scope0\", \"scope1\"") &&
                  strstr(tp_last_error(), " more)"),
              "message: %s", tp_last_error());
    tp_comm_debug_free(d);
}

Test(comm_debug, begin_end_states, .timeout = CD_TIMEOUT)
{
    tp_comm_debug *a = NULL, *b = NULL;
    cr_assert_eq(tp_comm_debug_create(&a), TP_OK);
    cr_assert_eq(tp_comm_debug_create(&b), TP_OK);
    cr_assert_null(tp_comm_debug_active());

    cr_assert_eq(tp_comm_debug_end(a), TP_ERR_STATE, "end before begin");
    cr_assert_eq(tp_comm_debug_begin(a), TP_OK);
    cr_assert_eq(tp_comm_debug_active(), a);
    cr_assert_eq(tp_comm_debug_begin(a), TP_ERR_STATE, "begin twice");
    cr_assert(strstr(tp_last_error(), "already active") != NULL, "message: %s",
              tp_last_error());
    cr_assert_eq(tp_comm_debug_begin(b), TP_ERR_STATE, "a second counter on this thread");
    cr_assert_eq(tp_comm_debug_end(b), TP_ERR_STATE, "b is not active");
    cr_assert_eq(tp_comm_debug_active(), a);
    cr_assert_eq(tp_comm_debug_end(a), TP_OK);
    cr_assert_null(tp_comm_debug_active());
    cr_assert_eq(tp_comm_debug_end(a), TP_ERR_STATE, "end twice");

    /* one after the other is fine */
    cr_assert_eq(tp_comm_debug_begin(b), TP_OK);
    cr_assert_eq(tp_comm_debug_active(), b);
    cr_assert_eq(tp_comm_debug_end(b), TP_OK);
    cr_assert_eq(tp_comm_debug_begin(a), TP_OK);

    /* freeing the active counter ends it first */
    tp_comm_debug_free(a);
    cr_assert_null(tp_comm_debug_active());
    cr_assert_eq(tp_comm_debug_begin(b), TP_OK);
    cr_assert_eq(tp_comm_debug_end(b), TP_OK);
    tp_comm_debug_free(b);
}

Test(comm_debug, empty_counter, .timeout = CD_TIMEOUT)
{
    tp_comm_debug *d = NULL;
    char buf[1024];
    cr_assert_eq(tp_comm_debug_create(&d), TP_OK);
    for (int pass = 0; pass < 2; pass++) { /* before begin, and after an empty session */
        for (int k = 0; k <= TP_COLL_ANY; k++) {
            cr_assert_eq(tp_comm_debug_count(d, (tp_coll_kind)k), 0);
            cr_assert_eq(tp_comm_debug_bytes(d, (tp_coll_kind)k), 0);
            for (int p = 0; p <= TP_PHASE_COUNT; p++)
                cr_assert_eq(tp_comm_debug_module_count(d, "Global", (tp_phase)p,
                                                        (tp_coll_kind)k), 0);
        }
        cr_assert_eq(tp_comm_debug_total(d), 0);
        cr_assert_eq(tp_comm_debug_module_count(d, "mlp", TP_PHASE_COUNT, TP_COLL_ANY), 0);

        cr_assert_eq(capture(tp_comm_debug_write_json, d, buf, sizeof buf), TP_OK);
        json_doc doc;
        cr_assert(json_parse(buf, &doc), "invalid JSON:\n%s", buf);
        cr_assert_eq(doc.nscopes, 1, "JSON:\n%s", buf);
        cr_assert_str_eq(doc.scope[0], "Global");
        cr_assert_eq(doc.nleaves, 0, "JSON:\n%s", buf);

        cr_assert_eq(capture(tp_comm_debug_write_table, d, buf, sizeof buf), TP_OK);
        cr_assert_str_eq(buf, "Global\n");

        cr_assert_eq(tp_comm_debug_begin(d), TP_OK);
        cr_assert_eq(tp_comm_debug_end(d), TP_OK);
    }
    tp_comm_debug_free(d);
}

Test(comm_debug, write_errors, .timeout = CD_TIMEOUT)
{
    tp_comm_debug *d = NULL;
    cr_assert_eq(tp_comm_debug_create(&d), TP_OK);
    FILE *f = fopen("/dev/null", "r"); /* every write fails */
    cr_assert_not_null(f);
    cr_assert_eq(tp_comm_debug_write_json(d, f), TP_ERR_BACKEND);
    cr_assert(strstr(tp_last_error(), "write") != NULL, "message: %s", tp_last_error());
    cr_assert_eq(tp_comm_debug_write_table(d, f), TP_ERR_BACKEND);
    fclose(f);
    tp_comm_debug_free(d);
}

/* Scopes entered while a counter is active (or open when it begins) are listed
 * even without collectives, in first-seen order, with names escaped. */
Test(comm_debug, scopes_listed_without_collectives, .timeout = CD_TIMEOUT)
{
    static const char odd[] = "q\"uo\\te\nnl\x01";
    tp_comm_debug *d = NULL;
    char buf[4096];
    cr_assert_eq(tp_comm_debug_create(&d), TP_OK);
    cr_assert_eq(tp_comm_debug_push_scope("model"), TP_OK); /* open before begin */
    cr_assert_eq(tp_comm_debug_begin(d), TP_OK);
    cr_assert_eq(tp_comm_debug_push_scope("net1"), TP_OK);
    cr_assert_eq(tp_comm_debug_pop_scope(), TP_OK);
    cr_assert_eq(tp_comm_debug_push_scope("relu"), TP_OK);
    cr_assert_eq(tp_comm_debug_pop_scope(), TP_OK);
    cr_assert_eq(tp_comm_debug_push_scope("net1"), TP_OK); /* seen already */
    cr_assert_eq(tp_comm_debug_pop_scope(), TP_OK);
    cr_assert_eq(tp_comm_debug_push_scope(odd), TP_OK);
    cr_assert_eq(tp_comm_debug_pop_scope(), TP_OK);
    cr_assert_eq(tp_comm_debug_pop_scope(), TP_OK);
    cr_assert_eq(tp_comm_debug_end(d), TP_OK);
    cr_assert_eq(tp_comm_debug_push_scope("after"), TP_OK); /* not active: not listed */
    cr_assert_eq(tp_comm_debug_pop_scope(), TP_OK);

    cr_assert_eq(capture(tp_comm_debug_write_json, d, buf, sizeof buf), TP_OK);
    json_doc doc;
    cr_assert(json_parse(buf, &doc), "invalid JSON:\n%s", buf);
    char odd_fqn[64];
    snprintf(odd_fqn, sizeof odd_fqn, "model.%s", odd);
    const char *expect[] = {"Global", "model", "model.net1", "model.relu", odd_fqn};
    cr_assert_eq(doc.nscopes, 5, "JSON:\n%s", buf);
    for (int i = 0; i < 5; i++)
        cr_assert_str_eq(doc.scope[i], expect[i], "scope %d in JSON:\n%s", i, buf);
    cr_assert_eq(doc.nleaves, 0);

    cr_assert_eq(capture(tp_comm_debug_write_table, d, buf, sizeof buf), TP_OK);
    cr_assert(strncmp(buf, "Global\n  model\n    model.net1\n    model.relu\n", 45) == 0,
              "table:\n%s", buf);
    tp_comm_debug_free(d);
}

/* Begin on one thread while the counter is active on another. */
typedef struct cross_ctx {
    tp_comm_debug *d;
    pthread_barrier_t begun, release;
    tp_status begin_st, end_st;
    tp_comm_debug *active_seen;
} cross_ctx;

static void *cross_owner(void *arg)
{
    cross_ctx *c = arg;
    c->begin_st = tp_comm_debug_begin(c->d);
    c->active_seen = tp_comm_debug_active();
    pthread_barrier_wait(&c->begun);
    pthread_barrier_wait(&c->release);
    c->end_st = tp_comm_debug_end(c->d);
    return NULL;
}

Test(comm_debug, active_on_another_thread, .timeout = CD_TIMEOUT)
{
    cross_ctx c;
    memset(&c, 0, sizeof c);
    cr_assert_eq(tp_comm_debug_create(&c.d), TP_OK);
    pthread_barrier_init(&c.begun, NULL, 2);
    pthread_barrier_init(&c.release, NULL, 2);
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, cross_owner, &c), 0);
    pthread_barrier_wait(&c.begun);

    /* collect everything before asserting, so the owner is always released */
    tp_comm_debug *active_here = tp_comm_debug_active();
    tp_status begin_here = tp_comm_debug_begin(c.d);
    char begin_msg[256];
    snprintf(begin_msg, sizeof begin_msg, "%s", tp_last_error());
    tp_status end_here = tp_comm_debug_end(c.d);
    char buf[256];
    tp_status json_here = capture(tp_comm_debug_write_json, c.d, buf, sizeof buf);
    int64_t count_here = -1;
    tp_status scope_here = tp_comm_debug_scope_count(c.d, "Global", TP_PHASE_COUNT, TP_COLL_ANY,
                                                     &count_here);
    tp_clear_error();
    tp_comm_debug_free(c.d); /* must refuse: still active over there */
    char free_msg[256];
    snprintf(free_msg, sizeof free_msg, "%s", tp_last_error());

    pthread_barrier_wait(&c.release);
    pthread_join(th, NULL);
    pthread_barrier_destroy(&c.begun);
    pthread_barrier_destroy(&c.release);

    cr_assert_eq(c.begin_st, TP_OK);
    cr_assert_eq(c.active_seen, c.d);
    cr_assert_null(active_here, "activation is per thread");
    cr_assert_eq(begin_here, TP_ERR_STATE);
    cr_assert(strstr(begin_msg, "another thread") != NULL, "message: %s", begin_msg);
    cr_assert_eq(end_here, TP_ERR_STATE);
    cr_assert_eq(json_here, TP_ERR_STATE);
    cr_assert_eq(scope_here, TP_ERR_STATE);
    cr_assert_eq(count_here, 0);
    cr_assert(strstr(free_msg, "not freed") != NULL, "message: %s", free_msg);
    cr_assert_eq(c.end_st, TP_OK);

    /* the owner ended it, so it moves to this thread */
    cr_assert_eq(tp_comm_debug_begin(c.d), TP_OK);
    cr_assert_eq(tp_comm_debug_end(c.d), TP_OK);
    tp_comm_debug_free(c.d);
}

/* ---- allocation failures (no communication) ------------------------------ */

static atomic_long alloc_live;
static atomic_long alloc_calls;
static atomic_long alloc_fail_at; /* -1: never */

static void *failing_alloc(void *ctx, size_t size, size_t alignment)
{
    (void)ctx;
    long n = atomic_fetch_add(&alloc_calls, 1);
    if (n == atomic_load(&alloc_fail_at))
        return NULL;
    if (alignment < sizeof(void *))
        alignment = sizeof(void *);
    void *p = NULL;
    if (posix_memalign(&p, alignment, size ? size : 1) != 0)
        return NULL;
    atomic_fetch_add(&alloc_live, 1);
    return p;
}

static void failing_free(void *ctx, void *p)
{
    (void)ctx;
    atomic_fetch_sub(&alloc_live, 1);
    free(p);
}

static void install_failing_allocator(long fail_at)
{
    atomic_store(&alloc_live, 0);
    atomic_store(&alloc_calls, 0);
    atomic_store(&alloc_fail_at, fail_at);
    tp_allocator a = {failing_alloc, failing_free, NULL};
    cr_assert_eq(tp_set_allocator(&a), TP_OK);
}

/* Enough scopes to grow the scope list and its index a few times. */
#define ALLOC_SCOPES 40

/* One session with the fail_at-th allocation failing (never when < 0):
 * *complete tells whether every scope made it into the JSON; whatever
 * failed, nothing may leak. */
static void alloc_session(long fail_at, bool *complete)
{
    install_failing_allocator(fail_at);
    tp_comm_debug *d = NULL;
    tp_status st = tp_comm_debug_create(&d);
    if (st != TP_OK) {
        cr_assert_eq(st, TP_ERR_NO_MEMORY, "fail_at %ld", fail_at);
        cr_assert_null(d);
        *complete = false;
    } else {
        char name[16];
        cr_assert_eq(tp_comm_debug_begin(d), TP_OK, "fail_at %ld", fail_at);
        cr_assert_eq(tp_comm_debug_push_scope("root"), TP_OK);
        for (int i = 0; i < ALLOC_SCOPES; i++) {
            snprintf(name, sizeof name, "m%d", i);
            /* registration may fail; the push itself never does */
            cr_assert_eq(tp_comm_debug_push_scope(name), TP_OK, "fail_at %ld", fail_at);
            cr_assert_eq(tp_comm_debug_pop_scope(), TP_OK);
        }
        cr_assert_eq(tp_comm_debug_pop_scope(), TP_OK);
        cr_assert_eq(tp_comm_debug_end(d), TP_OK);

        static char buf[16384];
        cr_assert_eq(capture(tp_comm_debug_write_json, d, buf, sizeof buf), TP_OK);
        json_doc doc;
        cr_assert(json_parse(buf, &doc), "fail_at %ld: invalid JSON:\n%s", fail_at, buf);
        *complete = doc.nscopes == ALLOC_SCOPES + 2;
        cr_assert_eq(capture(tp_comm_debug_write_table, d, buf, sizeof buf), TP_OK);
        bool noted = strstr(buf, "note:") != NULL;
        cr_assert_eq(noted, !*complete, "fail_at %ld: table:\n%s", fail_at, buf);
        tp_comm_debug_free(d);
    }
    cr_assert_eq(atomic_load(&alloc_live), 0, "fail_at %ld: %ld allocations leaked", fail_at,
                 atomic_load(&alloc_live));
    tp_set_allocator(NULL);
}

Test(comm_debug, allocation_failures, .timeout = CD_TIMEOUT)
{
    bool complete = false;
    alloc_session(-1, &complete);
    cr_assert(complete, "without failures every scope is listed");
    long total = atomic_load(&alloc_calls);
    cr_assert_gt(total, ALLOC_SCOPES, "one allocation per new scope at least");
    for (long k = 0; k < total; k++) {
        alloc_session(k, &complete);
        cr_assert(!complete, "failing allocation %ld of %ld went unnoticed", k, total);
    }
}

/* ---- scopes saved by autograd ------------------------------------------------ */

/* Allocations of one recorded op (a * a, a requires grad) through the
 * installed allocator. */
static long allocs_of_recorded_op(tp_tensor *a)
{
    tp_tensor *y = NULL;
    long before = atomic_load(&alloc_calls);
    cr_assert_eq(tp_mul(a, a, &y), TP_OK);
    long n = atomic_load(&alloc_calls) - before;
    cr_assert(tp_tensor_has_grad_fn(y), "the op was recorded");
    tp_tensor_release(y);
    return n;
}

/* Every op autograd records saves the open scopes (a backward re-enters
 * them), counter or not: that costs no allocation of its own, under the same
 * scopes as the previous op or under new ones. */
Test(comm_debug, recording_an_op_in_a_scope_allocates_nothing_more, .timeout = CD_TIMEOUT)
{
    install_failing_allocator(-1);
    tp_tensor *a = NULL;
    cr_assert_eq(tp_tensor_zeros(TP_F32, TP_CPU, 1, (int64_t[]){4}, &a), TP_OK);
    cr_assert_eq(tp_tensor_set_requires_grad(a, true), TP_OK);
    long outside = allocs_of_recorded_op(a);
    cr_assert_gt(outside, 0);
    cr_assert_eq(tp_comm_debug_push_scope("block"), TP_OK);
    cr_assert_eq(tp_comm_debug_push_scope("attn"), TP_OK);
    for (int i = 0; i < 3; i++)
        cr_assert_eq(allocs_of_recorded_op(a), outside, "op %d under block.attn", i);
    cr_assert_eq(tp_comm_debug_pop_scope(), TP_OK);
    cr_assert_eq(tp_comm_debug_push_scope("mlp"), TP_OK);
    cr_assert_eq(allocs_of_recorded_op(a), outside, "under block.mlp");
    cr_assert_eq(tp_comm_debug_pop_scope(), TP_OK);
    cr_assert_eq(tp_comm_debug_pop_scope(), TP_OK);
    tp_tensor_release(a);
    cr_assert_eq(atomic_load(&alloc_live), 0);
    tp_set_allocator(NULL);
}

/* Scope names made up per call would intern without end: past a limit the
 * saves are private copies, freed with their nodes, and a backward still
 * re-enters them. */
Test(comm_debug, saved_scopes_past_the_intern_limit, .timeout = 120)
{
    install_failing_allocator(-1);
    tp_tensor *a = NULL, *keep[3] = {NULL};
    cr_assert_eq(tp_tensor_zeros(TP_F32, TP_CPU, 1, (int64_t[]){4}, &a), TP_OK);
    cr_assert_eq(tp_tensor_set_requires_grad(a, true), TP_OK);
    cr_assert_eq(tp_comm_debug_push_scope("run"), TP_OK);
    enum { N = 66000 }; /* above the 65536 interned records */
    char name[32];
    for (int i = 0; i < N; i++) {
        snprintf(name, sizeof name, "s%d", i);
        cr_assert_eq(tp_comm_debug_push_scope(name), TP_OK);
        tp_tensor *y = NULL;
        cr_assert_eq(tp_mul(a, a, &y), TP_OK);
        if (i == 0 || i >= N - 2)
            keep[i ? i - (N - 3) : 0] = y;
        else
            tp_tensor_release(y);
        cr_assert_eq(tp_comm_debug_pop_scope(), TP_OK);
    }
    cr_assert_eq(tp_comm_debug_pop_scope(), TP_OK);
    long live = atomic_load(&alloc_live);
    tp_comm_debug *d = NULL;
    cr_assert_eq(tp_comm_debug_create(&d), TP_OK);
    cr_assert_eq(tp_comm_debug_begin(d), TP_OK);
    for (int k = 0; k < 3; k++) {
        tp_tensor *l = NULL;
        cr_assert_eq(tp_sum_all(keep[k], &l), TP_OK);
        cr_assert_eq(tp_backward(l, NULL), TP_OK);
        tp_tensor_release(l);
    }
    cr_assert_eq(tp_comm_debug_end(d), TP_OK);
    const char *seen[] = {"run", "run.s0", "run.s65998", "run.s65999"};
    for (int k = 0; k < 4; k++) {
        int64_t n = -1;
        cr_assert_eq(tp_comm_debug_scope_count(d, seen[k], TP_PHASE_COUNT, TP_COLL_ANY, &n),
                     TP_OK, "%s re-entered by the backward: %s", seen[k], tp_last_error());
        cr_assert_eq(n, 0);
    }
    tp_comm_debug_free(d);
    cr_assert_leq(atomic_load(&alloc_live), live, "the backward freed what it made");
    for (int k = 0; k < 3; k++)
        tp_tensor_release(keep[k]);
    tp_tensor_release(a);
    cr_assert_eq(atomic_load(&alloc_live), 0, "the private copies went with their nodes");
    tp_set_allocator(NULL);
}

/* ---- counting real collectives ------------------------------------------- */

ParameterizedTestParameters(comm_debug, counts)
{
    static int sizes[] = TP_TEST_WORLD_SIZES;
    return cr_make_param_array(int, sizes, TP_TEST_N_WORLD_SIZES);
}

enum { MQ_GLOBAL, MQ_MLP, MQ_NET1, MQ_NET2, MQ_NET3, MQ_BARE_NET1, MQ_COUNT };
static const char *const mq_name[MQ_COUNT] = {"Global", "mlp", "mlp.net1", "mlp.net2",
                                              "mlp.net3", "net1"};

typedef struct counts_slot {
    tp_test_slot t;
    int64_t count[TP_COLL_KIND_COUNT + 1];
    int64_t bytes[TP_COLL_KIND_COUNT + 1];
    int64_t total;
    /* [scope][phase or TP_PHASE_COUNT][kind or TP_COLL_ANY] */
    int64_t module[MQ_COUNT][TP_PHASE_COUNT + 1][TP_COLL_KIND_COUNT + 1];
    /* the checked query, both phases, every kind */
    tp_status scope_st[MQ_COUNT];
    int64_t scope_any[MQ_COUNT];
    char never_seen_msg[2][512]; /* mlp.net3 and net1 */
    tp_status json_st, table_st, invalid_st;
    int64_t total_after_invalid;
    bool active_after_end;
    char json[4096];
    char table[4096];
} counts_slot;

typedef struct counts_ctx {
    counts_slot slot[TP_TEST_MAX_RANKS];
} counts_ctx;

typedef struct counts_bufs {
    tp_tensor *ar4;   /* f32[4]: all_reduce */
    tp_tensor *ar_i64; /* i64[2]: all_reduce */
    tp_tensor *bc;    /* f64[3]: broadcast */
    tp_tensor *ag_send, *ag_recv; /* f32[2] -> f32[2n] */
    tp_tensor *rs_send, *rs_recv; /* f32[3n] -> f32[3] */
    tp_tensor *a2a_send, *a2a_recv; /* f32[n] -> f32[n] */
    tp_tensor *sc_send, *sc_recv;   /* f32[2n] (on the root) -> f32[2] */
} counts_bufs;

static tp_status make_vec(tp_dtype dtype, int64_t n, tp_tensor **out)
{
    return tp_tensor_zeros(dtype, TP_CPU, 1, &n, out);
}

/*
 * The mix, with n ranks (bytes per the header's convention):
 *
 *   before begin:  all_reduce, barrier                     not counted
 *   Global  fwd:   broadcast f64[3]                        24
 *                  scatter f32[2n] -> f32[2], root n - 1   8n
 *   mlp     fwd:   all_reduce f32[4] (async)               16
 *   mlp.net1 fwd:  all_gather f32[2] -> f32[2n]            8n
 *   mlp.net1 bwd:  all_gather x2                           16n
 *                  reduce_scatter f32[3n] -> f32[3]        12n
 *   mlp.net2 bwd:  all_to_all f32[n] -> f32[n]             4n
 *                  barrier                                 0
 *   mlp     fwd:   all_reduce i64[2]                       16
 *   Global  bwd:   barrier                                 0
 *   after end:     all_reduce                              not counted
 */
static tp_status counts_body(tp_comm *w, counts_slot *s, tp_comm_debug *d, counts_bufs *b)
{
    tp_test_slot *t = &s->t;
    tp_work *work = NULL;

    RANK_OK(t, tp_all_reduce(w, b->ar4, b->ar4, TP_SUM, NULL));
    RANK_OK(t, tp_barrier(w, NULL));

    RANK_OK(t, tp_comm_debug_begin(d));
    tp_comm_debug_set_phase(TP_PHASE_FORWARD);
    RANK_OK(t, tp_broadcast(w, b->bc, 0, NULL));
    RANK_OK(t, tp_scatter(w, b->sc_send, b->sc_recv, tp_comm_size(w) - 1, NULL));
    RANK_OK(t, tp_comm_debug_push_scope("mlp"));
    RANK_OK(t, tp_all_reduce(w, b->ar4, b->ar4, TP_SUM, &work));
    RANK_OK(t, tp_work_wait(work));
    tp_work_free(work);
    RANK_OK(t, tp_comm_debug_push_scope("net1"));
    RANK_OK(t, tp_all_gather(w, b->ag_send, b->ag_recv, NULL));
    tp_comm_debug_set_phase(TP_PHASE_BACKWARD);
    RANK_OK(t, tp_all_gather(w, b->ag_send, b->ag_recv, NULL));
    RANK_OK(t, tp_all_gather(w, b->ag_send, b->ag_recv, NULL));
    RANK_OK(t, tp_reduce_scatter(w, b->rs_send, b->rs_recv, TP_SUM, NULL));
    RANK_OK(t, tp_comm_debug_pop_scope());
    RANK_OK(t, tp_comm_debug_push_scope("net2"));
    RANK_OK(t, tp_all_to_all(w, b->a2a_send, b->a2a_recv, NULL));
    RANK_OK(t, tp_barrier(w, NULL));
    RANK_OK(t, tp_comm_debug_pop_scope());
    tp_comm_debug_set_phase(TP_PHASE_FORWARD);
    RANK_OK(t, tp_all_reduce(w, b->ar_i64, b->ar_i64, TP_MAX, NULL));
    RANK_OK(t, tp_comm_debug_pop_scope());
    tp_comm_debug_set_phase(TP_PHASE_BACKWARD);
    RANK_OK(t, tp_barrier(w, NULL));
    tp_comm_debug_set_phase(TP_PHASE_FORWARD);
    RANK_OK(t, tp_comm_debug_end(d));
    s->active_after_end = tp_comm_debug_active() != NULL;

    RANK_OK(t, tp_all_reduce(w, b->ar4, b->ar4, TP_SUM, NULL));

    for (int k = 0; k <= TP_COLL_ANY; k++) {
        s->count[k] = tp_comm_debug_count(d, (tp_coll_kind)k);
        s->bytes[k] = tp_comm_debug_bytes(d, (tp_coll_kind)k);
    }
    s->total = tp_comm_debug_total(d);
    for (int m = 0; m < MQ_COUNT; m++)
        for (int p = 0; p <= TP_PHASE_COUNT; p++)
            for (int k = 0; k <= TP_COLL_ANY; k++)
                s->module[m][p][k] =
                    tp_comm_debug_module_count(d, mq_name[m], (tp_phase)p, (tp_coll_kind)k);
    for (int m = 0; m < MQ_COUNT; m++) {
        s->scope_any[m] = -1;
        tp_clear_error();
        s->scope_st[m] = tp_comm_debug_scope_count(d, mq_name[m], TP_PHASE_COUNT, TP_COLL_ANY,
                                                   &s->scope_any[m]);
        if (m >= MQ_NET3)
            snprintf(s->never_seen_msg[m - MQ_NET3], sizeof s->never_seen_msg[0], "%s",
                     tp_last_error());
    }
    s->json_st = capture(tp_comm_debug_write_json, d, s->json, sizeof s->json);
    s->table_st = capture(tp_comm_debug_write_table, d, s->table, sizeof s->table);

    /* A call rejected by validation is not a collective: last, since the
     * communicator may not be usable afterwards. */
    RANK_OK(t, tp_comm_debug_begin(d));
    s->invalid_st = tp_all_reduce(w, NULL, NULL, TP_SUM, NULL);
    RANK_OK(t, tp_comm_debug_end(d));
    s->total_after_invalid = tp_comm_debug_total(d);
    return TP_OK;
}

static tp_status counts_rank(tp_comm *w, void *arg)
{
    counts_ctx *c = arg;
    int r = tp_comm_rank(w), n = tp_comm_size(w);
    counts_slot *s = &c->slot[r];
    counts_bufs b;
    memset(&b, 0, sizeof b);
    tp_comm_debug *d = NULL;
    tp_status st = TP_OK;
    if (st == TP_OK) st = make_vec(TP_F32, 4, &b.ar4);
    if (st == TP_OK) st = make_vec(TP_I64, 2, &b.ar_i64);
    if (st == TP_OK) st = make_vec(TP_F64, 3, &b.bc);
    if (st == TP_OK) st = make_vec(TP_F32, 2, &b.ag_send);
    if (st == TP_OK) st = make_vec(TP_F32, 2 * (int64_t)n, &b.ag_recv);
    if (st == TP_OK) st = make_vec(TP_F32, 3 * (int64_t)n, &b.rs_send);
    if (st == TP_OK) st = make_vec(TP_F32, 3, &b.rs_recv);
    if (st == TP_OK) st = make_vec(TP_F32, n, &b.a2a_send);
    if (st == TP_OK) st = make_vec(TP_F32, n, &b.a2a_recv);
    if (st == TP_OK && r == n - 1) st = make_vec(TP_F32, 2 * (int64_t)n, &b.sc_send);
    if (st == TP_OK) st = make_vec(TP_F32, 2, &b.sc_recv);
    if (st == TP_OK) st = tp_comm_debug_create(&d);
    if (st != TP_OK)
        RANK_EXPECT(&s->t, 0, "setup: %s (%s)", tp_status_name(st), tp_last_error());
    else
        st = counts_body(w, s, d, &b);
    tp_comm_debug_free(d);
    tp_tensor *all[] = {b.ar4,     b.ar_i64,   b.bc,       b.ag_send, b.ag_recv, b.rs_send,
                        b.rs_recv, b.a2a_send, b.a2a_recv, b.sc_send, b.sc_recv};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        tp_tensor_release(all[i]);
    return st;
}

/* expected[scope][phase][kind] for the mix above */
static void counts_expected(int64_t e[MQ_COUNT][TP_PHASE_COUNT][TP_COLL_KIND_COUNT])
{
    memset(e, 0, sizeof(int64_t) * MQ_COUNT * TP_PHASE_COUNT * TP_COLL_KIND_COUNT);
    enum { F = TP_PHASE_FORWARD, B = TP_PHASE_BACKWARD };
    e[MQ_NET1][F][TP_COLL_ALL_GATHER] = 1;
    e[MQ_NET1][B][TP_COLL_ALL_GATHER] = 2;
    e[MQ_NET1][B][TP_COLL_REDUCE_SCATTER] = 1;
    e[MQ_NET2][B][TP_COLL_ALL_TO_ALL] = 1;
    e[MQ_NET2][B][TP_COLL_BARRIER] = 1;
    /* a scope includes its children */
    for (int p = 0; p < TP_PHASE_COUNT; p++)
        for (int k = 0; k < TP_COLL_KIND_COUNT; k++)
            e[MQ_MLP][p][k] = e[MQ_NET1][p][k] + e[MQ_NET2][p][k];
    e[MQ_MLP][F][TP_COLL_ALL_REDUCE] = 2;
    memcpy(e[MQ_GLOBAL], e[MQ_MLP], sizeof e[MQ_GLOBAL]);
    e[MQ_GLOBAL][F][TP_COLL_BROADCAST] = 1;
    e[MQ_GLOBAL][F][TP_COLL_SCATTER] = 1;
    e[MQ_GLOBAL][B][TP_COLL_BARRIER] += 1;
}

ParameterizedTest(int *np, comm_debug, counts, .timeout = CD_COMM_TIMEOUT)
{
    int n = *np;
    counts_ctx *c = calloc(1, sizeof *c);
    cr_assert_not_null(c);
    tp_status st = tp_run_local(n, counts_rank, c);
    tp_test_slot slots[TP_TEST_MAX_RANKS];
    for (int r = 0; r < n; r++)
        slots[r] = c->slot[r].t;
    tp_test_assert_slots(slots, n);
    cr_assert_eq(st, TP_OK, "run: %s (%s)", tp_status_name(st), tp_last_error());

    int64_t e[MQ_COUNT][TP_PHASE_COUNT][TP_COLL_KIND_COUNT];
    counts_expected(e);
    const int64_t count[TP_COLL_KIND_COUNT] = {
        [TP_COLL_ALL_REDUCE] = 2, [TP_COLL_ALL_GATHER] = 3, [TP_COLL_REDUCE_SCATTER] = 1,
        [TP_COLL_ALL_TO_ALL] = 1, [TP_COLL_BROADCAST] = 1, [TP_COLL_BARRIER] = 2,
        [TP_COLL_SCATTER] = 1};
    const int64_t bytes[TP_COLL_KIND_COUNT] = {
        [TP_COLL_ALL_REDUCE] = 16 + 16, [TP_COLL_ALL_GATHER] = 3 * 8 * n,
        [TP_COLL_REDUCE_SCATTER] = 12 * n, [TP_COLL_ALL_TO_ALL] = 4 * n,
        [TP_COLL_BROADCAST] = 24, [TP_COLL_BARRIER] = 0, [TP_COLL_SCATTER] = 8 * n};

    for (int r = 0; r < n; r++) {
        const counts_slot *s = &c->slot[r];
        int64_t sum_count = 0, sum_bytes = 0;
        for (int k = 0; k < TP_COLL_KIND_COUNT; k++) {
            cr_assert_eq(s->count[k], count[k], "n=%d rank %d: %s count %lld, want %lld", n, r,
                         tp_coll_kind_name((tp_coll_kind)k), (long long)s->count[k],
                         (long long)count[k]);
            cr_assert_eq(s->bytes[k], bytes[k], "n=%d rank %d: %s bytes %lld, want %lld", n, r,
                         tp_coll_kind_name((tp_coll_kind)k), (long long)s->bytes[k],
                         (long long)bytes[k]);
            sum_count += count[k];
            sum_bytes += bytes[k];
        }
        cr_assert_eq(s->count[TP_COLL_ANY], sum_count);
        cr_assert_eq(s->bytes[TP_COLL_ANY], sum_bytes);
        cr_assert_eq(s->total, 11, "n=%d rank %d: total %lld", n, r, (long long)s->total);
        cr_assert_eq(sum_count, 11);
        cr_assert(!s->active_after_end);

        for (int m = 0; m < MQ_COUNT; m++) {
            int64_t both_any = 0;
            for (int p = 0; p < TP_PHASE_COUNT; p++) {
                int64_t phase_any = 0;
                for (int k = 0; k < TP_COLL_KIND_COUNT; k++) {
                    int64_t want = e[m][p][k]; /* 0 for mlp.net3 and net1 */
                    cr_assert_eq(s->module[m][p][k], want,
                                 "n=%d rank %d: %s %s %s = %lld, want %lld", n, r, mq_name[m],
                                 p ? "backward" : "forward",
                                 tp_coll_kind_name((tp_coll_kind)k),
                                 (long long)s->module[m][p][k], (long long)want);
                    phase_any += want;
                }
                cr_assert_eq(s->module[m][p][TP_COLL_ANY], phase_any, "n=%d %s phase %d any",
                             n, mq_name[m], p);
                both_any += phase_any;
            }
            cr_assert_eq(s->module[m][TP_PHASE_COUNT][TP_COLL_ANY], both_any);
            for (int k = 0; k < TP_COLL_KIND_COUNT; k++)
                cr_assert_eq(s->module[m][TP_PHASE_COUNT][k],
                             s->module[m][0][k] + s->module[m][1][k]);
        }
        cr_assert_eq(s->module[MQ_GLOBAL][TP_PHASE_COUNT][TP_COLL_ANY], s->total,
                     "Global holds every record");
        /* the checked query: the same counts for the scopes seen, an error
         * naming the others (the unchecked one read 0 for them above) */
        for (int m = 0; m < MQ_NET3; m++) {
            cr_assert_eq(s->scope_st[m], TP_OK, "n=%d rank %d: %s: %s", n, r, mq_name[m],
                         tp_status_name(s->scope_st[m]));
            cr_assert_eq(s->scope_any[m], s->module[m][TP_PHASE_COUNT][TP_COLL_ANY]);
        }
        for (int m = MQ_NET3; m < MQ_COUNT; m++) {
            cr_assert_eq(s->scope_st[m], TP_ERR_INVALID_ARG, "n=%d rank %d: %s: %s", n, r,
                         mq_name[m], tp_status_name(s->scope_st[m]));
            cr_assert_eq(s->scope_any[m], 0);
            char want[512];
            snprintf(want, sizeof want,
                     "comm_debug_scope_count: scope \"%s\" was never entered while the counter "
                     "was active; scopes seen: \"Global\", \"mlp\", \"mlp.net1\", "
                     "\"mlp.net2\"", mq_name[m]);
            cr_assert_str_eq(s->never_seen_msg[m - MQ_NET3], want);
        }

        /* JSON: valid, scopes in first-seen order, same numbers */
        cr_assert_eq(s->json_st, TP_OK);
        json_doc doc;
        cr_assert(json_parse(s->json, &doc), "n=%d rank %d: invalid JSON:\n%s", n, r, s->json);
        cr_assert_eq(doc.nscopes, 4, "JSON:\n%s", s->json);
        for (int m = 0; m < 4; m++) {
            cr_assert_str_eq(doc.scope[m], mq_name[m], "JSON:\n%s", s->json);
            for (int p = 0; p < TP_PHASE_COUNT; p++)
                for (int k = 0; k < TP_COLL_KIND_COUNT; k++)
                    cr_assert_eq(json_get(&doc, mq_name[m], p,
                                          tp_coll_kind_name((tp_coll_kind)k)),
                                 e[m][p][k], "JSON %s/%d/%s:\n%s", mq_name[m], p,
                                 tp_coll_kind_name((tp_coll_kind)k), s->json);
        }
        int64_t leaves = 0;
        for (int i = 0; i < doc.nleaves; i++)
            leaves += doc.leaf[i].value;
        cr_assert_eq(leaves, 11 + 8 + 4 + 2, "no other entries in JSON:\n%s", s->json);

        /* table: the PyTorch CommDebugMode layout */
        cr_assert_eq(s->table_st, TP_OK);
        static const char table[] =
            "Global\n"
            "  FORWARD PASS\n"
            "    all_reduce: 2\n"
            "    all_gather: 1\n"
            "    broadcast: 1\n"
            "    scatter: 1\n"
            "  BACKWARD PASS\n"
            "    all_gather: 2\n"
            "    reduce_scatter: 1\n"
            "    all_to_all: 1\n"
            "    barrier: 2\n"
            "  mlp\n"
            "    FORWARD PASS\n"
            "      all_reduce: 2\n"
            "      all_gather: 1\n"
            "    BACKWARD PASS\n"
            "      all_gather: 2\n"
            "      reduce_scatter: 1\n"
            "      all_to_all: 1\n"
            "      barrier: 1\n"
            "    mlp.net1\n"
            "      FORWARD PASS\n"
            "        all_gather: 1\n"
            "      BACKWARD PASS\n"
            "        all_gather: 2\n"
            "        reduce_scatter: 1\n"
            "    mlp.net2\n"
            "      BACKWARD PASS\n"
            "        all_to_all: 1\n"
            "        barrier: 1\n";
        cr_assert_str_eq(s->table, table, "n=%d rank %d", n, r);

        cr_assert_neq(s->invalid_st, TP_OK);
        cr_assert_eq(s->total_after_invalid, 0, "a rejected call is not counted");
    }
    free(c);
}

/* Every rank has its own counter, active over a different window of the same
 * collectives: rank r counts the barriers from the r-th on. Counters on other
 * threads, and a second counter on the same thread, do not interfere. */
ParameterizedTestParameters(comm_debug, per_rank_windows)
{
    static int sizes[] = TP_TEST_WORLD_SIZES;
    return cr_make_param_array(int, sizes, TP_TEST_N_WORLD_SIZES);
}

typedef struct window_slot {
    tp_test_slot t;
    int64_t barriers;
    int64_t first_total, second_total, restarted_total;
    int64_t second_all_reduce;
} window_slot;

typedef struct window_ctx {
    window_slot slot[TP_TEST_MAX_RANKS];
} window_ctx;

static tp_status window_body(tp_comm *w, window_slot *s, tp_comm_debug *a, tp_comm_debug *b,
                             tp_tensor *x)
{
    tp_test_slot *t = &s->t;
    int r = tp_comm_rank(w), n = tp_comm_size(w);
    for (int i = 0; i < n; i++) {
        if (i == r)
            RANK_OK(t, tp_comm_debug_begin(a));
        RANK_OK(t, tp_barrier(w, NULL));
    }
    RANK_OK(t, tp_comm_debug_end(a));
    s->barriers = tp_comm_debug_count(a, TP_COLL_BARRIER);
    s->first_total = tp_comm_debug_total(a);

    /* a second counter on the same thread, one after the other */
    RANK_OK(t, tp_comm_debug_begin(b));
    for (int i = 0; i < 2; i++)
        RANK_OK(t, tp_all_reduce(w, x, x, TP_SUM, NULL));
    RANK_OK(t, tp_comm_debug_end(b));
    s->second_total = tp_comm_debug_total(b);
    s->second_all_reduce = tp_comm_debug_module_count(b, "Global", TP_PHASE_FORWARD,
                                                      TP_COLL_ALL_REDUCE);

    /* begin clears: a restarted counter forgets its earlier session */
    RANK_OK(t, tp_comm_debug_begin(a));
    RANK_OK(t, tp_comm_debug_end(a));
    s->restarted_total = tp_comm_debug_total(a);
    return TP_OK;
}

static tp_status window_rank(tp_comm *w, void *arg)
{
    window_ctx *c = arg;
    window_slot *s = &c->slot[tp_comm_rank(w)];
    tp_comm_debug *a = NULL, *b = NULL;
    tp_tensor *x = NULL;
    tp_status st = make_vec(TP_F32, 8, &x);
    if (st == TP_OK) st = tp_comm_debug_create(&a);
    if (st == TP_OK) st = tp_comm_debug_create(&b);
    if (st != TP_OK)
        RANK_EXPECT(&s->t, 0, "setup: %s (%s)", tp_status_name(st), tp_last_error());
    else
        st = window_body(w, s, a, b, x);
    tp_comm_debug_free(a);
    tp_comm_debug_free(b);
    tp_tensor_release(x);
    return st;
}

ParameterizedTest(int *np, comm_debug, per_rank_windows, .timeout = CD_COMM_TIMEOUT)
{
    int n = *np;
    window_ctx *c = calloc(1, sizeof *c);
    cr_assert_not_null(c);
    tp_status st = tp_run_local(n, window_rank, c);
    tp_test_slot slots[TP_TEST_MAX_RANKS];
    for (int r = 0; r < n; r++)
        slots[r] = c->slot[r].t;
    tp_test_assert_slots(slots, n);
    cr_assert_eq(st, TP_OK, "run: %s (%s)", tp_status_name(st), tp_last_error());
    for (int r = 0; r < n; r++) {
        const window_slot *s = &c->slot[r];
        cr_assert_eq(s->barriers, n - r, "n=%d rank %d: %lld barriers", n, r,
                     (long long)s->barriers);
        cr_assert_eq(s->first_total, n - r);
        cr_assert_eq(s->second_total, 2);
        cr_assert_eq(s->second_all_reduce, 2);
        cr_assert_eq(s->restarted_total, 0);
    }
    free(c);
}

/* Only rank 0 counts; the others issue the same collectives with none active. */
typedef struct solo_ctx {
    tp_test_slot slot[TP_TEST_MAX_RANKS];
    int64_t total[TP_TEST_MAX_RANKS];
    bool had_active[TP_TEST_MAX_RANKS];
} solo_ctx;

static tp_status solo_rank(tp_comm *w, void *arg)
{
    solo_ctx *c = arg;
    int r = tp_comm_rank(w);
    tp_test_slot *t = &c->slot[r];
    tp_comm_debug *d = NULL;
    RANK_OK(t, tp_comm_debug_create(&d));
    tp_status st = TP_OK;
    if (r == 0)
        st = tp_comm_debug_begin(d);
    c->had_active[r] = tp_comm_debug_active() != NULL;
    for (int i = 0; i < 3 && st == TP_OK; i++)
        st = tp_barrier(w, NULL);
    if (r == 0 && st == TP_OK)
        st = tp_comm_debug_end(d);
    c->total[r] = tp_comm_debug_total(d);
    if (st != TP_OK)
        RANK_EXPECT(t, 0, "%s (%s)", tp_status_name(st), tp_last_error());
    tp_comm_debug_free(d);
    return st;
}

Test(comm_debug, only_active_threads_count, .timeout = CD_COMM_TIMEOUT)
{
    solo_ctx c;
    memset(&c, 0, sizeof c);
    tp_status st = tp_run_local(3, solo_rank, &c);
    tp_test_assert_slots(c.slot, 3);
    cr_assert_eq(st, TP_OK, "run: %s (%s)", tp_status_name(st), tp_last_error());
    cr_assert(c.had_active[0]);
    cr_assert_eq(c.total[0], 3);
    for (int r = 1; r < 3; r++) {
        cr_assert(!c.had_active[r]);
        cr_assert_eq(c.total[r], 0);
    }
}

/* A record whose scope cannot be registered (out of memory) still counts in
 * the totals; the table says that per-scope counts were dropped. One rank, so
 * only this thread allocates while the failure is armed. */
static _Thread_local bool fail_this_thread;
static atomic_long drop_live;

static void *drop_alloc(void *ctx, size_t size, size_t alignment)
{
    (void)ctx;
    if (fail_this_thread)
        return NULL;
    if (alignment < sizeof(void *))
        alignment = sizeof(void *);
    void *p = NULL;
    if (posix_memalign(&p, alignment, size ? size : 1) != 0)
        return NULL;
    atomic_fetch_add(&drop_live, 1);
    return p;
}

static void drop_free(void *ctx, void *p)
{
    (void)ctx;
    atomic_fetch_sub(&drop_live, 1);
    free(p);
}

typedef struct drop_ctx {
    tp_test_slot slot;
    tp_status barrier_st;
    int64_t total, global, scope_count, retried_count;
    char table[2048];
} drop_ctx;

static tp_status drop_rank(tp_comm *w, void *arg)
{
    drop_ctx *c = arg;
    tp_test_slot *t = &c->slot;
    tp_comm_debug *d = NULL;
    RANK_OK(t, tp_comm_debug_create(&d));
    tp_status st = tp_comm_debug_begin(d);
    if (st == TP_OK) {
        fail_this_thread = true;
        st = tp_comm_debug_push_scope("lost"); /* registration fails, push succeeds */
        if (st == TP_OK)
            c->barrier_st = tp_barrier(w, NULL); /* its record cannot register either */
        fail_this_thread = false;
    }
    if (st == TP_OK && c->barrier_st == TP_OK)
        st = tp_barrier(w, NULL); /* now the retry succeeds */
    if (st == TP_OK)
        st = tp_comm_debug_pop_scope();
    if (st == TP_OK)
        st = tp_comm_debug_end(d);
    c->total = tp_comm_debug_total(d);
    c->global = tp_comm_debug_module_count(d, "Global", TP_PHASE_COUNT, TP_COLL_BARRIER);
    c->scope_count = tp_comm_debug_module_count(d, "lost", TP_PHASE_COUNT, TP_COLL_ANY);
    if (st == TP_OK)
        st = capture(tp_comm_debug_write_table, d, c->table, sizeof c->table);
    if (st != TP_OK)
        RANK_EXPECT(t, 0, "%s (%s)", tp_status_name(st), tp_last_error());
    tp_comm_debug_free(d);
    return st;
}

Test(comm_debug, record_without_memory, .timeout = CD_COMM_TIMEOUT)
{
    drop_ctx c;
    memset(&c, 0, sizeof c);
    atomic_store(&drop_live, 0);
    tp_allocator a = {drop_alloc, drop_free, NULL};
    cr_assert_eq(tp_set_allocator(&a), TP_OK);
    tp_status st = tp_run_local(1, drop_rank, &c);
    tp_set_allocator(NULL);
    tp_test_assert_slots(&c.slot, 1);
    cr_assert_eq(st, TP_OK, "run: %s (%s)", tp_status_name(st), tp_last_error());
    if (c.barrier_st != TP_OK)
        cr_skip_test("the backend allocates per barrier (%s); drop path not reachable",
                     tp_status_name(c.barrier_st));
    cr_assert_eq(c.total, 2, "both records are in the totals");
    cr_assert_eq(c.global, 2);
    cr_assert_eq(c.scope_count, 1, "the second record registered the scope");
    cr_assert(strstr(c.table, "note:") != NULL && strstr(c.table, "dropped") != NULL,
              "table:\n%s", c.table);
    cr_assert(strstr(c.table, "  lost\n    FORWARD PASS\n      barrier: 1\n") != NULL,
              "table:\n%s", c.table);
    cr_assert_eq(atomic_load(&drop_live), 0, "leaked %ld allocations",
                 atomic_load(&drop_live));
}
