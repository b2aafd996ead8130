/* The built-in hardware descriptions (tp_hw_preset), in the file format of
 * docs/plan.md. Vendor peaks (dense, no sparsity) and typical achieved
 * efficiencies and link figures: estimates to plan with before a machine is
 * at hand, not measurements of one. Memory is the device's total as nvidia-smi
 * reports it (H100 SXM 80 GB: 81559 MiB; A100 SXM 80 GB: 81920 MiB), of which
 * the CUDA context takes a few hundred MiB before any tensor. */
#include <string.h>

#include "plan/hw_internal.h"

/* GEMM efficiency by the smallest of m, n, k: small products are latency-
 * and tile-bound; 4096 and above reach about three quarters of peak on both
 * parts (cuBLAS, bf16). */
#define TP__HW_GEMM_ROWS                                                                   \
    "[{\"min_dim\": 0, \"efficiency\": 0.05}, {\"min_dim\": 128, \"efficiency\": 0.25},"   \
    " {\"min_dim\": 512, \"efficiency\": 0.5}, {\"min_dim\": 1024, \"efficiency\": 0.65}," \
    " {\"min_dim\": 4096, \"efficiency\": 0.75}]"

static const struct {
    const char *name, *json;
} tp__hw_presets[] = {
    {"h100-sxm-ndr",
     "{\"name\": \"h100-sxm-ndr\","
     " \"description\": \"8 H100 SXM5 per node (NVLink 4 through NVSwitch, 450 GB/s each way per "
     "GPU), one 400 Gb/s InfiniBand NDR port per GPU between nodes\","
     " \"devices_per_node\": 8, \"memory_bytes\": 85520809984,"
     " \"compute\": {\"peak_flops\": {\"f32\": 67e12, \"f64\": 67e12, \"bf16\": 989e12,"
     " \"f16\": 989e12}, \"gemm_efficiency\": " TP__HW_GEMM_ROWS ","
     " \"memory_bandwidth\": 3.35e12, \"kernel_latency\": 4e-6},"
     " \"links\": {\"intra_node\": {\"latency\": 3e-6, \"bandwidth\": 360e9, \"algorithm\": "
     "\"ring\"},"
     " \"inter_node\": {\"latency\": 8e-6, \"bandwidth\": 45e9, \"algorithm\": \"ring\"}}}"},
    {"a100-sxm-hdr",
     "{\"name\": \"a100-sxm-hdr\","
     " \"description\": \"8 A100 SXM4 80 GB per node (NVLink 3 through NVSwitch, 300 GB/s each "
     "way per GPU), one 200 Gb/s InfiniBand HDR port per GPU between nodes\","
     " \"devices_per_node\": 8, \"memory_bytes\": 85899345920,"
     " \"compute\": {\"peak_flops\": {\"f32\": 19.5e12, \"f64\": 19.5e12, \"bf16\": 312e12,"
     " \"f16\": 312e12}, \"gemm_efficiency\": " TP__HW_GEMM_ROWS ","
     " \"memory_bandwidth\": 2.039e12, \"kernel_latency\": 4e-6},"
     " \"links\": {\"intra_node\": {\"latency\": 4e-6, \"bandwidth\": 230e9, \"algorithm\": "
     "\"ring\"},"
     " \"inter_node\": {\"latency\": 10e-6, \"bandwidth\": 22e9, \"algorithm\": \"ring\"}}}"},
};

#define TP__HW_NPRESETS ((int)(sizeof tp__hw_presets / sizeof *tp__hw_presets))

const char *tp__hw_preset_json(const char *name)
{
    for (int i = 0; i < TP__HW_NPRESETS; i++)
        if (!strcmp(name, tp__hw_presets[i].name))
            return tp__hw_presets[i].json;
    return NULL;
}

const char *tp__hw_preset_list(void)
{
    return "h100-sxm-ndr, a100-sxm-hdr";
}

const char *const *tp_hw_preset_names(void)
{
    static const char *const names[] = {"h100-sxm-ndr", "a100-sxm-hdr", NULL};
    return names;
}
