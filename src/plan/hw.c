/* Hardware descriptions (JSON, checked field by field) and the alpha-beta
 * cost model over them. See tp/hw.h; the format and the formulas are in
 * docs/plan.md. */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <string.h>

#include "core/core.h"
#include "plan/hw_internal.h"
#include "tp/hw.h"

/* ---- reading ------------------------------------------------------------------------ */

typedef struct {
    const char *what; /* the file or string, for errors */
} tp__hw_ctx;

static tp_status tp__hw_bad(const tp__hw_ctx *c, const char *field, const char *fmt, ...)
{
    char why[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    return tp__error(TP_ERR_INVALID_ARG, "hardware description '%s': %s %s", c->what, field, why);
}

/* Every key of obj is one of keys (NULL-terminated); `at` names obj. */
static tp_status tp__hw_known(const tp__hw_ctx *c, json_t *obj, const char *at,
                              const char *const *keys)
{
    const char *key;
    json_t *v;
    json_object_foreach(obj, key, v)
    {
        bool ok = false;
        for (int i = 0; keys[i] && !ok; i++)
            ok = !strcmp(key, keys[i]);
        if (!ok) {
            char field[160];
            snprintf(field, sizeof field, "%s%s%s", at, at[0] ? "." : "", key);
            return tp__hw_bad(c, field, "is not a known key");
        }
    }
    return TP_OK;
}

/* obj[key] as a number in [lo, hi] (lo_open: > lo); `at` names obj. */
static tp_status tp__hw_num(const tp__hw_ctx *c, json_t *obj, const char *at, const char *key,
                            double lo, bool lo_open, double hi, double *out)
{
    char field[160];
    snprintf(field, sizeof field, "%s%s%s", at, at[0] ? "." : "", key);
    json_t *v = json_object_get(obj, key);
    if (!v)
        return tp__hw_bad(c, field, "is missing");
    double x = json_is_number(v) ? json_number_value(v) : NAN;
    if (isnan(x) || isinf(x) || (lo_open ? x <= lo : x < lo) || x > hi) {
        if (isinf(hi))
            return tp__hw_bad(c, field, "must be a number %s %g", lo_open ? ">" : ">=", lo);
        return tp__hw_bad(c, field, "must be a number %s %g and <= %g", lo_open ? ">" : ">=", lo,
                          hi);
    }
    *out = x;
    return TP_OK;
}

static json_t *tp__hw_obj(json_t *root, const char *key)
{
    json_t *v = json_object_get(root, key);
    return json_is_object(v) ? v : NULL;
}

static tp_status tp__hw_need_obj(const tp__hw_ctx *c, json_t *v, const char *field)
{
    return v ? TP_OK : tp__hw_bad(c, field, "must be an object");
}

static tp_status tp__hw_read_peaks(const tp__hw_ctx *c, json_t *peaks, tp_hw *hw)
{
    TP_CHECK(tp__hw_need_obj(c, peaks, "compute.peak_flops"));
    const char *key;
    json_t *v;
    int n = 0;
    json_object_foreach(peaks, key, v)
    {
        int d = -1;
        for (int i = 0; i < TP_DTYPE_COUNT && d < 0; i++)
            if (tp_dtype_is_float((tp_dtype)i) && !strcmp(key, tp_dtype_name((tp_dtype)i)))
                d = i;
        if (d < 0)
            return tp__hw_bad(c, "compute.peak_flops", "has '%s': not one of f32, f64, f16, bf16",
                              key);
        TP_CHECK(
            tp__hw_num(c, peaks, "compute.peak_flops", key, 0, true, INFINITY, &hw->peak_flops[d]));
        n++;
    }
    return n ? TP_OK : tp__hw_bad(c, "compute.peak_flops", "names no dtype");
}

static tp_status tp__hw_read_gemm(const tp__hw_ctx *c, json_t *t, tp_hw *hw)
{
    const char *field = "compute.gemm_efficiency";
    size_t n = json_is_array(t) ? json_array_size(t) : 0;
    if (n == 0 || n > TP__HW_MAX_GEMM_ROWS)
        return tp__hw_bad(c, field, "must be an array of 1 to %d rows", TP__HW_MAX_GEMM_ROWS);
    for (size_t i = 0; i < n; i++) {
        json_t *row = json_array_get(t, i);
        char at[64];
        snprintf(at, sizeof at, "%s[%zu]", field, i);
        TP_CHECK(tp__hw_need_obj(c, json_is_object(row) ? row : NULL, at));
        static const char *const keys[] = {"min_dim", "efficiency", NULL};
        TP_CHECK(tp__hw_known(c, row, at, keys));
        double md = 0;
        TP_CHECK(tp__hw_num(c, row, at, "min_dim", 0, false, INFINITY, &md));
        TP_CHECK(tp__hw_num(c, row, at, "efficiency", 0, true, 1, &hw->gemm[i].efficiency));
        hw->gemm[i].min_dim = (int64_t)md;
        if (md != floor(md) || (i == 0 && md != 0) || (i > 0 && md <= hw->gemm[i - 1].min_dim))
            return tp__hw_bad(c, at,
                              "min_dim must be an integer, 0 in the first row and "
                              "increasing");
    }
    hw->n_gemm = (int)n;
    return TP_OK;
}

static tp_status tp__hw_read_compute(const tp__hw_ctx *c, json_t *cmp, tp_hw *hw)
{
    TP_CHECK(tp__hw_need_obj(c, cmp, "compute"));
    static const char *const keys[] = {"peak_flops", "gemm_efficiency", "memory_bandwidth",
                                       "kernel_latency", NULL};
    TP_CHECK(tp__hw_known(c, cmp, "compute", keys));
    TP_CHECK(tp__hw_read_peaks(c, tp__hw_obj(cmp, "peak_flops"), hw));
    TP_CHECK(tp__hw_read_gemm(c, json_object_get(cmp, "gemm_efficiency"), hw));
    TP_CHECK(tp__hw_num(c, cmp, "compute", "memory_bandwidth", 0, true, INFINITY, &hw->mem_bw));
    return tp__hw_num(c, cmp, "compute", "kernel_latency", 0, false, INFINITY, &hw->kernel_lat);
}

static tp_status tp__hw_read_link(const tp__hw_ctx *c, json_t *links, const char *name,
                                  tp__hw_link *l)
{
    char at[64];
    snprintf(at, sizeof at, "links.%s", name);
    json_t *o = tp__hw_obj(links, name);
    TP_CHECK(tp__hw_need_obj(c, o, at));
    static const char *const keys[] = {"latency", "bandwidth", "algorithm", "async_progress", NULL};
    TP_CHECK(tp__hw_known(c, o, at, keys));
    TP_CHECK(tp__hw_num(c, o, at, "latency", 0, false, INFINITY, &l->latency));
    TP_CHECK(tp__hw_num(c, o, at, "bandwidth", 0, true, INFINITY, &l->bandwidth));
    json_t *ap = json_object_get(o, "async_progress");
    if (ap && !json_is_boolean(ap)) {
        char field[80];
        snprintf(field, sizeof field, "%s.async_progress", at);
        return tp__hw_bad(c, field, "must be true or false");
    }
    l->async_progress = !ap || json_is_true(ap);
    json_t *a = json_object_get(o, "algorithm");
    const char *s = json_is_string(a) ? json_string_value(a) : "";
    if (!strcmp(s, "ring"))
        l->algo = TP_ALGO_RING;
    else if (!strcmp(s, "tree"))
        l->algo = TP_ALGO_TREE;
    else {
        char field[80];
        snprintf(field, sizeof field, "%s.algorithm", at);
        return tp__hw_bad(c, field, "must be \"ring\" or \"tree\"");
    }
    return TP_OK;
}

static tp_status tp__hw_read(const tp__hw_ctx *c, json_t *root, tp_hw *hw)
{
    if (!json_is_object(root))
        return tp__hw_bad(c, "the top level", "must be an object");
    static const char *const keys[] = {"name", "description", "devices_per_node",
                                       "ranks_per_device", "memory_bytes", "compute", "links",
                                       NULL};
    TP_CHECK(tp__hw_known(c, root, "", keys));
    json_t *name = json_object_get(root, "name"), *desc = json_object_get(root, "description");
    if (!json_is_string(name) || !json_string_value(name)[0])
        return tp__hw_bad(c, "name", "must be a non-empty string");
    if (desc && !json_is_string(desc))
        return tp__hw_bad(c, "description", "must be a string");
    snprintf(hw->name, sizeof hw->name, "%s", json_string_value(name));
    snprintf(hw->description, sizeof hw->description, "%s", desc ? json_string_value(desc) : "");
    json_t *dpn = json_object_get(root, "devices_per_node");
    if (!json_is_integer(dpn) || json_integer_value(dpn) < 1 || json_integer_value(dpn) > 1 << 20)
        return tp__hw_bad(c, "devices_per_node", "must be an integer from 1 to %d", 1 << 20);
    hw->devices_per_node = (int)json_integer_value(dpn);
    json_t *rpd = json_object_get(root, "ranks_per_device");
    if (rpd && (!json_is_integer(rpd) || json_integer_value(rpd) < 1 ||
                json_integer_value(rpd) > TP__HW_MAX_RANKS_PER_DEVICE))
        return tp__hw_bad(c, "ranks_per_device", "must be an integer from 1 to %d",
                          TP__HW_MAX_RANKS_PER_DEVICE);
    hw->ranks_per_device = rpd ? (int)json_integer_value(rpd) : 1;
    if (json_object_get(root, "memory_bytes"))
        TP_CHECK(tp__hw_num(c, root, "", "memory_bytes", 0, true, INFINITY, &hw->memory_bytes));
    TP_CHECK(tp__hw_read_compute(c, tp__hw_obj(root, "compute"), hw));
    json_t *links = tp__hw_obj(root, "links");
    TP_CHECK(tp__hw_need_obj(c, links, "links"));
    static const char *const lkeys[] = {"intra_node", "inter_node", NULL};
    TP_CHECK(tp__hw_known(c, links, "links", lkeys));
    TP_CHECK(tp__hw_read_link(c, links, "intra_node", &hw->link[TP_LINK_INTRA_NODE]));
    return tp__hw_read_link(c, links, "inter_node", &hw->link[TP_LINK_INTER_NODE]);
}

static tp_status tp__hw_from_json(json_t *root, const char *what, tp_hw **out)
{
    tp_hw *hw = tp__calloc(1, sizeof *hw);
    if (!hw)
        return tp__error(TP_ERR_NO_MEMORY, "hardware description '%s': out of memory", what);
    tp__hw_ctx c = {what};
    tp_status st = tp__hw_read(&c, root, hw);
    if (st != TP_OK) {
        tp__free(hw);
        return st;
    }
    *out = hw;
    return TP_OK;
}

/* The description in root (NULL: jansson's err says why), which it releases. */
static tp_status tp__hw_from_parsed(json_t *root, const json_error_t *err, const char *what,
                                    tp_hw **out)
{
    if (!root)
        return tp__error(TP_ERR_INVALID_ARG,
                         "hardware description '%s': malformed JSON at line %d: %s", what,
                         err->line, err->text);
    tp_status st = tp__hw_from_json(root, what, out);
    json_decref(root);
    return st;
}

tp_status tp_hw_load_string(const char *json, const char *what, tp_hw **out)
{
    TP_ARG_CHECK(out, "tp_hw_load_string: out is NULL");
    *out = NULL;
    TP_ARG_CHECK(json, "tp_hw_load_string: json is NULL");
    json_error_t err;
    json_t *root = json_loads(json, JSON_REJECT_DUPLICATES, &err);
    return tp__hw_from_parsed(root, &err, what ? what : "<string>", out);
}

tp_status tp_hw_load_file(const char *path, tp_hw **out)
{
    TP_ARG_CHECK(out, "tp_hw_load_file: out is NULL");
    *out = NULL;
    TP_ARG_CHECK(path, "tp_hw_load_file: path is NULL");
    FILE *f = fopen(path, "r");
    if (!f)
        return tp__error(TP_ERR_BACKEND, "hardware description '%s': cannot read it", path);
    json_error_t err;
    json_t *root = json_loadf(f, JSON_REJECT_DUPLICATES, &err);
    fclose(f);
    return tp__hw_from_parsed(root, &err, path, out);
}

tp_status tp_hw_preset(const char *name, tp_hw **out)
{
    TP_ARG_CHECK(out, "tp_hw_preset: out is NULL");
    *out = NULL;
    TP_ARG_CHECK(name, "tp_hw_preset: name is NULL");
    const char *json = tp__hw_preset_json(name);
    if (!json)
        return tp__error(TP_ERR_INVALID_ARG, "tp_hw_preset: no preset '%s' (presets: %s)", name,
                         tp__hw_preset_list());
    return tp_hw_load_string(json, name, out);
}

void tp_hw_free(tp_hw *hw)
{
    tp__free(hw);
}

const char *tp_hw_name(const tp_hw *hw)
{
    return hw ? hw->name : "";
}

int tp_hw_devices_per_node(const tp_hw *hw)
{
    return hw ? hw->devices_per_node : 0;
}

bool tp_hw_async_progress(const tp_hw *hw, tp_link_class link)
{
    return hw && (link == TP_LINK_INTRA_NODE || link == TP_LINK_INTER_NODE) &&
           hw->link[link].async_progress;
}

int tp_hw_ranks_per_device(const tp_hw *hw)
{
    return hw ? hw->ranks_per_device : 0;
}

double tp_hw_memory_bytes(const tp_hw *hw)
{
    return hw ? hw->memory_bytes : 0;
}

tp_status tp_hw_share_devices(const tp_hw *hw, int ranks_per_device, tp_hw **out)
{
    TP_ARG_CHECK(out, "tp_hw_share_devices: out is NULL");
    *out = NULL;
    TP_ARG_CHECK(hw, "tp_hw_share_devices: hw is NULL");
    TP_ARG_CHECK(ranks_per_device >= 1 && ranks_per_device <= TP__HW_MAX_RANKS_PER_DEVICE,
                 "tp_hw_share_devices: ranks_per_device must be from 1 to %d, got %d",
                 TP__HW_MAX_RANKS_PER_DEVICE, ranks_per_device);
    tp_hw *c = tp__malloc(sizeof *c);
    if (!c)
        return tp__error(TP_ERR_NO_MEMORY, "tp_hw_share_devices: out of memory");
    *c = *hw;
    c->ranks_per_device = ranks_per_device;
    *out = c;
    return TP_OK;
}

/* ---- the model -------------------------------------------------------------------------- */

tp_status tp_hw_group_link(const tp_hw *hw, const int *ranks, int n, tp_link_class *out)
{
    TP_ARG_CHECK(hw && ranks && out, "tp_hw_group_link: hw, ranks or out is NULL");
    TP_ARG_CHECK(n >= 1, "tp_hw_group_link: a group of %d ranks", n);
    for (int i = 0; i < n; i++)
        TP_ARG_CHECK(ranks[i] >= 0, "tp_hw_group_link: rank %d at %d", ranks[i], i);
    /* a node holds devices_per_node devices of ranks_per_device ranks each */
    int64_t per_node = (int64_t)hw->devices_per_node * hw->ranks_per_device;
    *out = TP_LINK_INTRA_NODE;
    for (int i = 1; i < n; i++)
        if (ranks[i] / per_node != ranks[0] / per_node)
            *out = TP_LINK_INTER_NODE;
    return TP_OK;
}

static double tp__hw_gemm_eff(const tp_hw *hw, int64_t d)
{
    double e = hw->gemm[0].efficiency;
    for (int i = 1; i < hw->n_gemm && hw->gemm[i].min_dim <= d; i++)
        e = hw->gemm[i].efficiency;
    return e;
}

tp_status tp_hw_gemm_time(const tp_hw *hw, tp_dtype dtype, int64_t m, int64_t n, int64_t k,
                          double *seconds)
{
    TP_ARG_CHECK(hw && seconds, "tp_hw_gemm_time: hw or seconds is NULL");
    TP_ARG_CHECK(m >= 0 && n >= 0 && k >= 0,
                 "tp_hw_gemm_time: negative size [%lld, %lld] x "
                 "[%lld, %lld]",
                 (long long)m, (long long)k, (long long)k, (long long)n);
    TP_ARG_CHECK((unsigned)dtype < TP_DTYPE_COUNT, "tp_hw_gemm_time: invalid dtype %d", (int)dtype);
    if (!(hw->peak_flops[dtype] > 0))
        return tp__error(TP_ERR_NOT_SUPPORTED,
                         "tp_hw_gemm_time: hardware '%s' has no "
                         "peak_flops for %s",
                         hw->name, tp_dtype_name(dtype));
    if (m == 0 || n == 0 || k == 0) {
        *seconds = 0;
        return TP_OK;
    }
    int64_t d = m < n ? m : n;
    d = d < k ? d : k;
    double flops = 2.0 * (double)m * (double)n * (double)k;
    *seconds = (flops / (hw->peak_flops[dtype] * tp__hw_gemm_eff(hw, d)) + hw->kernel_lat) *
               hw->ranks_per_device;
    return TP_OK;
}

tp_status tp_hw_elementwise_time(const tp_hw *hw, uint64_t bytes, double *seconds)
{
    TP_ARG_CHECK(hw && seconds, "tp_hw_elementwise_time: hw or seconds is NULL");
    *seconds = bytes ? ((double)bytes / hw->mem_bw + hw->kernel_lat) * hw->ranks_per_device : 0;
    return TP_OK;
}

/* Latency steps and the bytes (as a fraction of the counted size) that go
 * over a rank's busiest link, for kind under algo on a group of g. */
static void tp__hw_cost_terms(tp_coll_kind kind, tp_coll_algo algo, int g, double *steps,
                              double *frac)
{
    double L = ceil(log2((double)g)), part = (double)(g - 1) / g;
    bool ring = algo == TP_ALGO_RING;
    switch (kind) {
    case TP_COLL_ALL_REDUCE:
        *steps = ring ? 2.0 * (g - 1) : 2 * L;
        *frac = 2 * part;
        return;
    case TP_COLL_ALL_GATHER:
    case TP_COLL_REDUCE_SCATTER:
    case TP_COLL_SCATTER:
        *steps = ring ? g - 1.0 : L;
        *frac = part;
        return;
    case TP_COLL_ALL_TO_ALL: /* pairwise exchange; Bruck's log2 rounds of half */
        *steps = ring ? g - 1.0 : L;
        *frac = ring ? part : L / 2;
        return;
    case TP_COLL_BROADCAST: /* pipelined chain; scatter + all_gather */
        *steps = ring ? g - 1.0 : 2 * L;
        *frac = ring ? 1 : 2 * part;
        return;
    default: /* barrier */
        *steps = ring ? 2.0 * (g - 1) : L;
        *frac = 0;
        return;
    }
}

tp_status tp_hw_collective_time(const tp_hw *hw, tp_coll_kind kind, int group_size,
                                tp_link_class link, uint64_t bytes, double *seconds)
{
    TP_ARG_CHECK(hw && seconds, "tp_hw_collective_time: hw or seconds is NULL");
    TP_ARG_CHECK((unsigned)kind < TP_COLL_KIND_COUNT, "tp_hw_collective_time: invalid kind %d",
                 (int)kind);
    TP_ARG_CHECK(link == TP_LINK_INTRA_NODE || link == TP_LINK_INTER_NODE,
                 "tp_hw_collective_time: invalid link class %d", (int)link);
    TP_ARG_CHECK(group_size >= 1, "tp_hw_collective_time: a group of %d ranks", group_size);
    if (group_size == 1) {
        *seconds = 0;
        return TP_OK;
    }
    const tp__hw_link *l = &hw->link[link];
    double steps = 0, frac = 0;
    tp__hw_cost_terms(kind, l->algo, group_size, &steps, &frac);
    *seconds = steps * l->latency + frac * (double)bytes / l->bandwidth;
    return TP_OK;
}

/* ---- writing ------------------------------------------------------------------------------ */

static json_t *tp__hw_link_json(const tp__hw_link *l)
{
    return json_pack("{s:f, s:f, s:s, s:b}", "latency", l->latency, "bandwidth", l->bandwidth,
                     "algorithm", l->algo == TP_ALGO_RING ? "ring" : "tree", "async_progress",
                     l->async_progress);
}

static json_t *tp__hw_json(const tp_hw *hw)
{
    json_t *peaks = json_object(), *gemm = json_array();
    for (int d = 0; peaks && d < TP_DTYPE_COUNT; d++)
        if (hw->peak_flops[d] > 0)
            json_object_set_new(peaks, tp_dtype_name((tp_dtype)d), json_real(hw->peak_flops[d]));
    for (int i = 0; gemm && i < hw->n_gemm; i++)
        json_array_append_new(gemm,
                              json_pack("{s:I, s:f}", "min_dim", (json_int_t)hw->gemm[i].min_dim,
                                        "efficiency", hw->gemm[i].efficiency));
    json_t *root =
        json_pack("{s:s, s:s, s:i, s:i, s:{s:o, s:o, s:f, s:f}, s:{s:o, s:o}}", "name", hw->name,
                  "description", hw->description, "devices_per_node", hw->devices_per_node,
                  "ranks_per_device", hw->ranks_per_device, "compute", "peak_flops", peaks,
                  "gemm_efficiency", gemm, "memory_bandwidth", hw->mem_bw, "kernel_latency",
                  hw->kernel_lat, "links", "intra_node", tp__hw_link_json(&hw->link[0]),
                  "inter_node", tp__hw_link_json(&hw->link[1]));
    /* optional: a description that does not say has no key (0 would not load) */
    if (root && hw->memory_bytes > 0 &&
        json_object_set_new(root, "memory_bytes", json_real(hw->memory_bytes)) != 0) {
        json_decref(root);
        return NULL;
    }
    return root;
}

tp_status tp_hw_write_json(const tp_hw *hw, FILE *f)
{
    TP_ARG_CHECK(hw && f, "tp_hw_write_json: hw or f is NULL");
    json_t *root = tp__hw_json(hw);
    if (!root)
        return tp__error(TP_ERR_NO_MEMORY, "tp_hw_write_json: out of memory");
    errno = 0;
    int rc = json_dumpf(root, f, JSON_INDENT(2) | JSON_REAL_PRECISION(17));
    json_decref(root);
    if (rc != 0 || fputc('\n', f) == EOF || fflush(f) != 0)
        return tp__error(TP_ERR_BACKEND, "tp_hw_write_json: cannot write the description: %s",
                         errno ? strerror(errno) : "write error");
    return TP_OK;
}
