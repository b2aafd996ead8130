/* Hardware descriptions (tp/hw.h): the presets, the alpha-beta and GEMM
 * formulas against values worked out by hand, the link class of a group,
 * the JSON round trip, and every kind of bad file with the field named. */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tp_test.h"

/* Round numbers, so that the expected times below are worked out by hand. */
static const char *const base_json =
    "{\"name\": \"round\", \"devices_per_node\": 4,"
    " \"compute\": {\"peak_flops\": {\"f32\": 1e12},"
    "   \"gemm_efficiency\": [{\"min_dim\": 0, \"efficiency\": 0.1},"
    "     {\"min_dim\": 64, \"efficiency\": 0.5}, {\"min_dim\": 1024, \"efficiency\": 1}],"
    "   \"memory_bandwidth\": 1e11, \"kernel_latency\": 1e-6},"
    " \"links\": {\"intra_node\": {\"latency\": 1e-5, \"bandwidth\": 1e9, \"algorithm\": \"ring\"},"
    "   \"inter_node\": {\"latency\": 1e-5, \"bandwidth\": 1e9, \"algorithm\": \"tree\"}}}";

/* base_json with the first `from` replaced by `to`. */
static char *edited(const char *from, const char *to)
{
    const char *at = strstr(base_json, from);
    cr_assert(at, "'%s' not in the base description", from);
    size_t n = strlen(base_json) - strlen(from) + strlen(to) + 1;
    char *s = malloc(n);
    snprintf(s, n, "%.*s%s%s", (int)(at - base_json), base_json, to, at + strlen(from));
    return s;
}

static tp_hw *load_base(void)
{
    tp_hw *hw = NULL;
    cr_assert_eq(tp_hw_load_string(base_json, "round", &hw), TP_OK, "%s", tp_last_error());
    return hw;
}

static void expect_time(double got, double want, const char *what)
{
    cr_assert(fabs(got - want) <= 1e-12 * fmax(1.0, fabs(want)), "%s: %.15g s, expected %.15g s",
              what, got, want);
}

Test(hw, presets_load, .timeout = 30)
{
    const char *const *names = tp_hw_preset_names();
    int n = 0;
    for (; names[n]; n++) {
        tp_hw *hw = NULL;
        cr_assert_eq(tp_hw_preset(names[n], &hw), TP_OK, "%s: %s", names[n], tp_last_error());
        cr_assert_str_eq(tp_hw_name(hw), names[n]);
        cr_assert_eq(tp_hw_devices_per_node(hw), 8);
        double t = 0;
        cr_assert_eq(tp_hw_gemm_time(hw, TP_BF16, 8192, 8192, 8192, &t), TP_OK);
        cr_assert(t > 0 && t < 0.1, "%s: an 8192^3 bf16 GEMM in %g s", names[n], t);
        tp_hw_free(hw);
    }
    cr_assert_eq(n, 2);
    /* memory: nvidia-smi's total, 81559 MiB (H100 SXM 80 GB) and 81920 MiB (A100 SXM 80 GB) */
    const struct {
        const char *name;
        double bytes;
    } mem[] = {{"h100-sxm-ndr", 81559.0 * 1048576}, {"a100-sxm-hdr", 81920.0 * 1048576}};
    for (int i = 0; i < 2; i++) {
        tp_hw *hw = NULL;
        cr_assert_eq(tp_hw_preset(mem[i].name, &hw), TP_OK);
        cr_assert_eq(tp_hw_memory_bytes(hw), mem[i].bytes, "%s: %.17g bytes", mem[i].name,
                     tp_hw_memory_bytes(hw));
        tp_hw_free(hw);
    }
    /* H100's bf16 8192^3: 2 * 8192^3 / (989e12 * 0.75) + 4e-6 */
    tp_hw *h = NULL;
    double t = 0;
    cr_assert_eq(tp_hw_preset("h100-sxm-ndr", &h), TP_OK);
    cr_assert_eq(tp_hw_gemm_time(h, TP_BF16, 8192, 8192, 8192, &t), TP_OK);
    expect_time(t, 1.099511627776e12 / 741.75e12 + 4e-6, "h100 bf16 8192^3");
    tp_hw_free(h);
}

Test(hw, unknown_preset, .timeout = 30)
{
    tp_hw *hw = (tp_hw *)1;
    cr_assert_eq(tp_hw_preset("h200", &hw), TP_ERR_INVALID_ARG);
    cr_assert_null(hw);
    cr_assert(strstr(tp_last_error(), "no preset 'h200'") &&
                  strstr(tp_last_error(), "h100-sxm-ndr, a100-sxm-hdr"),
              "%s", tp_last_error());
}

/* Each kind on a group of 4 and of 5 (where log2 rounds up), ring on the
 * intra-node link and tree on the inter-node one, 1e9 bytes at 1e9 B/s and
 * 10 us per step: (steps, bytes factor) worked out per algorithm. */
typedef struct {
    tp_coll_kind kind;
    int g;
    double ring, tree;
} coll_case;

Test(hw, collective_formulas, .timeout = 30)
{
    static const coll_case c[] = {
        /* ring: 2(g-1) steps, 2(g-1)/g; tree: 2 ceil(log2 g) steps, 2(g-1)/g */
        {TP_COLL_ALL_REDUCE, 4, 6e-5 + 1.5, 4e-5 + 1.5},
        {TP_COLL_ALL_REDUCE, 5, 8e-5 + 1.6, 6e-5 + 1.6},
        /* ring: g-1 steps, (g-1)/g; tree: ceil(log2 g), (g-1)/g */
        {TP_COLL_ALL_GATHER, 4, 3e-5 + 0.75, 2e-5 + 0.75},
        {TP_COLL_REDUCE_SCATTER, 5, 4e-5 + 0.8, 3e-5 + 0.8},
        {TP_COLL_SCATTER, 4, 3e-5 + 0.75, 2e-5 + 0.75},
        /* ring (pairwise): g-1, (g-1)/g; tree (Bruck): ceil(log2 g), ceil(log2 g)/2 */
        {TP_COLL_ALL_TO_ALL, 4, 3e-5 + 0.75, 2e-5 + 1.0},
        {TP_COLL_ALL_TO_ALL, 5, 4e-5 + 0.8, 3e-5 + 1.5},
        /* ring (chain): g-1, 1; tree (scatter + all_gather): 2 ceil(log2 g), 2(g-1)/g */
        {TP_COLL_BROADCAST, 4, 3e-5 + 1.0, 4e-5 + 1.5},
        /* no bytes: 2(g-1) steps; ceil(log2 g) */
        {TP_COLL_BARRIER, 4, 6e-5, 2e-5},
    };
    tp_hw *hw = load_base();
    for (size_t i = 0; i < sizeof c / sizeof *c; i++) {
        double r = -1, t = -1;
        uint64_t bytes = c[i].kind == TP_COLL_BARRIER ? 0 : 1000000000u;
        cr_assert_eq(tp_hw_collective_time(hw, c[i].kind, c[i].g, TP_LINK_INTRA_NODE, bytes, &r),
                     TP_OK);
        cr_assert_eq(tp_hw_collective_time(hw, c[i].kind, c[i].g, TP_LINK_INTER_NODE, bytes, &t),
                     TP_OK);
        char what[96];
        snprintf(what, sizeof what, "%s over %d, ring", tp_coll_kind_name(c[i].kind), c[i].g);
        expect_time(r, c[i].ring, what);
        snprintf(what, sizeof what, "%s over %d, tree", tp_coll_kind_name(c[i].kind), c[i].g);
        expect_time(t, c[i].tree, what);
    }
    double t = -1;
    cr_assert_eq(tp_hw_collective_time(hw, TP_COLL_ALL_REDUCE, 1, TP_LINK_INTER_NODE, 1u << 30, &t),
                 TP_OK);
    cr_assert_eq(t, 0, "a group of one costs %g s", t);
    cr_assert_eq(tp_hw_collective_time(hw, TP_COLL_ALL_REDUCE, 0, TP_LINK_INTRA_NODE, 1, &t),
                 TP_ERR_INVALID_ARG);
    cr_assert_eq(tp_hw_collective_time(hw, TP_COLL_KIND_COUNT, 2, TP_LINK_INTRA_NODE, 1, &t),
                 TP_ERR_INVALID_ARG);
    cr_assert_eq(tp_hw_collective_time(hw, TP_COLL_ALL_REDUCE, 2, (tp_link_class)2, 1, &t),
                 TP_ERR_INVALID_ARG);
    tp_hw_free(hw);
}

Test(hw, gemm_and_elementwise, .timeout = 30)
{
    tp_hw *hw = load_base();
    double t = -1;
    /* min dim 1024: efficiency 1; 2 * 2^30 flops at 1e12 + 1 us */
    cr_assert_eq(tp_hw_gemm_time(hw, TP_F32, 1024, 1024, 1024, &t), TP_OK);
    expect_time(t, 2.147483648e-3 + 1e-6, "1024^3");
    /* min dim 32 (k): the first row, 0.1 */
    cr_assert_eq(tp_hw_gemm_time(hw, TP_F32, 4096, 4096, 32, &t), TP_OK);
    expect_time(t, 1.073741824e9 / 1e11 + 1e-6, "4096 x 4096 x 32");
    /* min dim exactly 64: the second row, 0.5 */
    cr_assert_eq(tp_hw_gemm_time(hw, TP_F32, 64, 100, 200, &t), TP_OK);
    expect_time(t, 2.56e6 / 5e11 + 1e-6, "64 x 100 x 200");
    cr_assert_eq(tp_hw_gemm_time(hw, TP_F32, 0, 10, 10, &t), TP_OK);
    cr_assert_eq(t, 0);
    cr_assert_eq(tp_hw_gemm_time(hw, TP_F32, -1, 10, 10, &t), TP_ERR_INVALID_ARG);
    cr_assert_eq(tp_hw_gemm_time(hw, TP_BF16, 8, 8, 8, &t), TP_ERR_NOT_SUPPORTED);
    cr_assert(strstr(tp_last_error(), "'round' has no peak_flops for bf16"), "%s", tp_last_error());
    cr_assert_eq(tp_hw_elementwise_time(hw, 1000000000u, &t), TP_OK);
    expect_time(t, 1e-2 + 1e-6, "1e9 bytes element-wise");
    cr_assert_eq(tp_hw_elementwise_time(hw, 0, &t), TP_OK);
    cr_assert_eq(t, 0);
    tp_hw_free(hw);
}

Test(hw, group_link, .timeout = 30)
{
    tp_hw *hw = load_base(); /* 4 devices per node */
    tp_link_class l = TP_LINK_INTER_NODE;
    const int one_node[] = {4, 5, 6, 7}, two_nodes[] = {3, 4}, dp[] = {1, 5, 9, 13}, alone[] = {9};
    cr_assert_eq(tp_hw_group_link(hw, one_node, 4, &l), TP_OK);
    cr_assert_eq(l, TP_LINK_INTRA_NODE);
    cr_assert_eq(tp_hw_group_link(hw, two_nodes, 2, &l), TP_OK);
    cr_assert_eq(l, TP_LINK_INTER_NODE);
    cr_assert_eq(tp_hw_group_link(hw, dp, 4, &l), TP_OK);
    cr_assert_eq(l, TP_LINK_INTER_NODE);
    cr_assert_eq(tp_hw_group_link(hw, alone, 1, &l), TP_OK);
    cr_assert_eq(l, TP_LINK_INTRA_NODE);
    const int neg[] = {0, -1};
    cr_assert_eq(tp_hw_group_link(hw, neg, 2, &l), TP_ERR_INVALID_ARG);
    cr_assert_eq(tp_hw_group_link(hw, one_node, 0, &l), TP_ERR_INVALID_ARG);
    cr_assert_eq(tp_hw_group_link(NULL, one_node, 1, &l), TP_ERR_INVALID_ARG);
    tp_hw_free(hw);
}

/* Ranks sharing a device: every kernel takes ranks_per_device times as long,
 * collectives do not change, a node holds devices_per_node x
 * ranks_per_device ranks; from the file or from tp_hw_share_devices, and
 * kept through a round trip. */
Test(hw, ranks_per_device, .timeout = 30)
{
    tp_hw *hw = load_base(), *sh = NULL, *f = NULL;
    cr_assert_eq(tp_hw_ranks_per_device(hw), 1);
    cr_assert_eq(tp_hw_share_devices(hw, 3, &sh), TP_OK, "%s", tp_last_error());
    cr_assert_eq(tp_hw_ranks_per_device(sh), 3);
    cr_assert_eq(tp_hw_ranks_per_device(hw), 1, "the source description is unchanged");
    double t = -1, c1 = -1, c3 = -2;
    cr_assert_eq(tp_hw_gemm_time(sh, TP_F32, 1024, 1024, 1024, &t), TP_OK);
    expect_time(t, 3 * (2.147483648e-3 + 1e-6), "1024^3 on a device shared by 3");
    cr_assert_eq(tp_hw_elementwise_time(sh, 1000000000u, &t), TP_OK);
    expect_time(t, 3 * (1e-2 + 1e-6), "1e9 bytes element-wise, shared by 3");
    cr_assert_eq(
        tp_hw_collective_time(hw, TP_COLL_ALL_REDUCE, 4, TP_LINK_INTRA_NODE, 1u << 20, &c1), TP_OK);
    cr_assert_eq(
        tp_hw_collective_time(sh, TP_COLL_ALL_REDUCE, 4, TP_LINK_INTRA_NODE, 1u << 20, &c3), TP_OK);
    cr_assert_eq(c1, c3, "a collective's time does not depend on the sharing");
    /* 4 devices x 3 ranks: ranks 0-11 on node 0 */
    const int pair[] = {3, 11}, across[] = {11, 12};
    tp_link_class l = TP_LINK_INTER_NODE;
    cr_assert_eq(tp_hw_group_link(hw, pair, 2, &l), TP_OK);
    cr_assert_eq(l, TP_LINK_INTER_NODE);
    cr_assert_eq(tp_hw_group_link(sh, pair, 2, &l), TP_OK);
    cr_assert_eq(l, TP_LINK_INTRA_NODE);
    cr_assert_eq(tp_hw_group_link(sh, across, 2, &l), TP_OK);
    cr_assert_eq(l, TP_LINK_INTER_NODE);
    /* from the file, and written out */
    char *text =
        edited("\"devices_per_node\": 4", "\"devices_per_node\": 4, \"ranks_per_device\": 3");
    cr_assert_eq(tp_hw_load_string(text, "shared", &f), TP_OK, "%s", tp_last_error());
    cr_assert_eq(tp_hw_ranks_per_device(f), 3);
    char *buf = NULL;
    size_t len = 0;
    FILE *mem = open_memstream(&buf, &len);
    cr_assert_eq(tp_hw_write_json(f, mem), TP_OK);
    fclose(mem);
    cr_assert(strstr(buf, "\"ranks_per_device\": 3"), "%s", buf);
    /* errors */
    tp_hw *none = (tp_hw *)1;
    cr_assert_eq(tp_hw_share_devices(hw, 0, &none), TP_ERR_INVALID_ARG);
    cr_assert_null(none);
    cr_assert(strstr(tp_last_error(), "ranks_per_device must be from 1 to 65536, got 0"), "%s",
              tp_last_error());
    cr_assert_eq(tp_hw_share_devices(NULL, 2, &none), TP_ERR_INVALID_ARG);
    cr_assert_eq(tp_hw_share_devices(hw, 2, NULL), TP_ERR_INVALID_ARG);
    cr_assert_eq(tp_hw_ranks_per_device(NULL), 0);
    free(buf);
    free(text);
    tp_hw_free(f);
    tp_hw_free(sh);
    tp_hw_free(hw);
}

/* memory_bytes: optional (0 when absent), read, kept by tp_hw_share_devices,
 * written only when given, and read back the same. */
Test(hw, memory_bytes, .timeout = 30)
{
    tp_hw *hw = load_base(), *m = NULL, *sh = NULL, *back = NULL;
    cr_assert_eq(tp_hw_memory_bytes(hw), 0, "a description that does not say");
    cr_assert_eq(tp_hw_memory_bytes(NULL), 0);
    char *buf = NULL;
    size_t len = 0;
    FILE *mem = open_memstream(&buf, &len);
    cr_assert_eq(tp_hw_write_json(hw, mem), TP_OK);
    fclose(mem);
    cr_assert_null(strstr(buf, "memory_bytes"), "written though not given: %s", buf);
    free(buf);
    char *text = edited("\"devices_per_node\": 4",
                        "\"devices_per_node\": 4, \"memory_bytes\": 34359738368");
    cr_assert_eq(tp_hw_load_string(text, "mem", &m), TP_OK, "%s", tp_last_error());
    cr_assert_eq(tp_hw_memory_bytes(m), 34359738368.0);
    cr_assert_eq(tp_hw_share_devices(m, 2, &sh), TP_OK);
    cr_assert_eq(tp_hw_memory_bytes(sh), 34359738368.0);
    mem = open_memstream(&buf, &len);
    cr_assert_eq(tp_hw_write_json(m, mem), TP_OK);
    fclose(mem);
    cr_assert_eq(tp_hw_load_string(buf, "written", &back), TP_OK, "%s", tp_last_error());
    cr_assert_eq(tp_hw_memory_bytes(back), 34359738368.0, "%s", buf);
    free(buf);
    free(text);
    tp_hw_free(back);
    tp_hw_free(sh);
    tp_hw_free(m);
    tp_hw_free(hw);
}

/* Written out and read back, a description answers every question alike. */
Test(hw, json_round_trip, .timeout = 30)
{
    const char *const *names = tp_hw_preset_names();
    for (int i = 0; names[i]; i++) {
        tp_hw *a = NULL, *b = NULL;
        cr_assert_eq(tp_hw_preset(names[i], &a), TP_OK);
        char path[] = "/tmp/tp_hw_XXXXXX";
        int fd = mkstemp(path);
        cr_assert_geq(fd, 0);
        FILE *f = fdopen(fd, "w");
        cr_assert_eq(tp_hw_write_json(a, f), TP_OK, "%s", tp_last_error());
        fclose(f);
        cr_assert_eq(tp_hw_load_file(path, &b), TP_OK, "%s", tp_last_error());
        unlink(path);
        cr_assert_str_eq(tp_hw_name(b), tp_hw_name(a));
        cr_assert_eq(tp_hw_memory_bytes(b), tp_hw_memory_bytes(a));
        for (int64_t d = 1; d <= 16384; d *= 4) {
            double ta = 0, tb = 1;
            cr_assert_eq(tp_hw_gemm_time(a, TP_BF16, d, 2 * d, d, &ta), TP_OK);
            cr_assert_eq(tp_hw_gemm_time(b, TP_BF16, d, 2 * d, d, &tb), TP_OK);
            cr_assert_eq(ta, tb, "%s: gemm %lld differs after the round trip", names[i],
                         (long long)d);
        }
        for (int k = 0; k < TP_COLL_KIND_COUNT; k++)
            for (int link = 0; link < 2; link++) {
                double ta = 0, tb = 1;
                cr_assert_eq(tp_hw_collective_time(a, k, 8, link, 1u << 24, &ta), TP_OK);
                cr_assert_eq(tp_hw_collective_time(b, k, 8, link, 1u << 24, &tb), TP_OK);
                cr_assert_eq(ta, tb, "%s: %s differs after the round trip", names[i],
                             tp_coll_kind_name(k));
            }
        double ta = 0, tb = 1;
        cr_assert_eq(tp_hw_elementwise_time(a, 12345, &ta), TP_OK);
        cr_assert_eq(tp_hw_elementwise_time(b, 12345, &tb), TP_OK);
        cr_assert_eq(ta, tb);
        tp_hw_free(a);
        tp_hw_free(b);
    }
}

typedef struct {
    const char *from, *to; /* edit of base_json; from NULL: `to` is the whole text */
    const char *field;     /* the message names this */
} bad_case;

/* Criterion hands parameters to the test process by value (pointers into
 * this one would not hold there): the cases are a table, the parameter an
 * index into it. */
static const bad_case bad_cases[] = {
    {"\"devices_per_node\"", "\"devices_per_nod\"", "devices_per_nod is not a known key"},
    {"\"algorithm\": \"tree\"", "\"algorithm\": \"tree\", \"bandwith\": 1",
     "links.inter_node.bandwith is not a known key"},
    {"\"bandwidth\": 1e9, \"algorithm\": \"ring\"", "\"bandwidth\": -1, \"algorithm\": \"ring\"",
     "links.intra_node.bandwidth must be a number > 0"},
    {"\"latency\": 1e-5, \"bandwidth\": 1e9, \"algorithm\": \"tree\"",
     "\"latency\": \"fast\", \"bandwidth\": 1e9, \"algorithm\": \"tree\"",
     "links.inter_node.latency must be a number >= 0"},
    {"\"algorithm\": \"tree\"", "\"algorithm\": \"tree\", \"async_progress\": 1",
     "links.inter_node.async_progress must be true or false"},
    {"\"algorithm\": \"tree\"", "\"algorithm\": \"star\"",
     "links.inter_node.algorithm must be \"ring\" or \"tree\""},
    {"\"efficiency\": 0.5", "\"efficiency\": 1.5",
     "compute.gemm_efficiency[1].efficiency must be a number > 0 and <= 1"},
    {"\"min_dim\": 1024", "\"min_dim\": 32", "compute.gemm_efficiency[2] min_dim must be"},
    {"\"min_dim\": 0", "\"min_dim\": 8", "compute.gemm_efficiency[0] min_dim must be"},
    {"{\"f32\": 1e12}", "{\"i32\": 1e12}", "compute.peak_flops has 'i32'"},
    {"{\"f32\": 1e12}", "{}", "compute.peak_flops names no dtype"},
    {"{\"f32\": 1e12}", "{\"f32\": 0}", "compute.peak_flops.f32 must be a number > 0"},
    {"\"memory_bandwidth\": 1e11, ", "", "compute.memory_bandwidth is missing"},
    {"\"devices_per_node\": 4", "\"devices_per_node\": 0",
     "devices_per_node must be an integer from 1"},
    {"\"devices_per_node\": 4", "\"devices_per_node\": 2.5",
     "devices_per_node must be an integer from 1"},
    {"\"devices_per_node\": 4", "\"devices_per_node\": 4, \"ranks_per_device\": 0",
     "ranks_per_device must be an integer from 1 to 65536"},
    {"\"devices_per_node\": 4", "\"devices_per_node\": 4, \"ranks_per_device\": 1.5",
     "ranks_per_device must be an integer from 1 to 65536"},
    {"\"devices_per_node\": 4", "\"devices_per_node\": 4, \"memory_bytes\": 0",
     "memory_bytes must be a number > 0"},
    {"\"devices_per_node\": 4", "\"devices_per_node\": 4, \"memory_bytes\": -8e10",
     "memory_bytes must be a number > 0"},
    {"\"devices_per_node\": 4", "\"devices_per_node\": 4, \"memory_bytes\": \"80GB\"",
     "memory_bytes must be a number > 0"},
    {"\"devices_per_node\": 4", "\"devices_per_node\": 4, \"memory_gib\": 80",
     "memory_gib is not a known key"},
    {"\"name\": \"round\"", "\"name\": \"\"", "name must be a non-empty string"},
    {"\"inter_node\": {", "\"inter\": {", "links.inter is not a known key"},
    {NULL, "[1, 2]", "the top level must be an object"},
    {NULL, "{\"name\": \"x\",", "malformed JSON at line 1"},
    {"\"devices_per_node\": 4", "\"devices_per_node\": 4, \"devices_per_node\": 4",
     "malformed JSON"},
};
#define N_BAD ((int)(sizeof bad_cases / sizeof *bad_cases))

ParameterizedTestParameters(hw, bad_descriptions)
{
    static int idx[N_BAD];
    for (int i = 0; i < N_BAD; i++)
        idx[i] = i;
    return cr_make_param_array(int, idx, N_BAD);
}

/* Each bad description: TP_ERR_INVALID_ARG naming the description and the
 * field, no handle. */
ParameterizedTest(int *i, hw, bad_descriptions, .timeout = 30)
{
    const bad_case *c = &bad_cases[*i];
    char *text = c->from ? edited(c->from, c->to) : strdup(c->to);
    tp_hw *hw = (tp_hw *)1;
    tp_status st = tp_hw_load_string(text, "bad.json", &hw);
    cr_assert_eq(st, TP_ERR_INVALID_ARG, "%s: %s (%s)", c->field, tp_status_name(st),
                 tp_last_error());
    cr_assert_null(hw);
    cr_assert(strstr(tp_last_error(), "hardware description 'bad.json'") &&
                  strstr(tp_last_error(), c->field),
              "'%s' lacks '%s'", tp_last_error(), c->field);
    free(text);
}

Test(hw, files_and_null, .timeout = 30)
{
    tp_hw *hw = (tp_hw *)1;
    cr_assert_eq(tp_hw_load_file("/nonexistent/hw.json", &hw), TP_ERR_BACKEND);
    cr_assert_null(hw);
    cr_assert(strstr(tp_last_error(), "'/nonexistent/hw.json': cannot read it"), "%s",
              tp_last_error());
    char path[] = "/tmp/tp_hw_XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    cr_assert_eq(write(fd, "{\"name\": 3}", 11), 11);
    close(fd);
    cr_assert_eq(tp_hw_load_file(path, &hw), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), path) && strstr(tp_last_error(), "name must be"), "%s",
              tp_last_error());
    unlink(path);
    cr_assert_eq(tp_hw_load_file(NULL, &hw), TP_ERR_INVALID_ARG);
    cr_assert_eq(tp_hw_load_string(NULL, NULL, &hw), TP_ERR_INVALID_ARG);
    cr_assert_eq(tp_hw_load_string("{}", NULL, NULL), TP_ERR_INVALID_ARG);
    cr_assert_eq(tp_hw_preset(NULL, &hw), TP_ERR_INVALID_ARG);
    cr_assert_eq(tp_hw_write_json(NULL, stdout), TP_ERR_INVALID_ARG);
    /* a stream that cannot take the bytes: an error with the system's reason */
    FILE *full = fopen("/dev/full", "w");
    if (full) {
        cr_assert_eq(tp_hw_preset("h100-sxm-ndr", &hw), TP_OK);
        cr_assert_eq(tp_hw_write_json(hw, full), TP_ERR_BACKEND);
        cr_assert(strstr(tp_last_error(), "tp_hw_write_json: cannot write the description: "), "%s",
                  tp_last_error());
        cr_assert(strstr(tp_last_error(), strerror(ENOSPC)), "%s", tp_last_error());
        fclose(full);
        tp_hw_free(hw);
    }
    tp_hw_free(NULL);
    cr_assert_str_eq(tp_hw_name(NULL), "");
}
