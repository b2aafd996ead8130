/* Internal to src/plan: the hardware description (tp/hw.h) and its
 * built-in presets (hw_presets.c). */
#ifndef TP_PLAN_HW_INTERNAL_H
#define TP_PLAN_HW_INTERNAL_H

#include <stdint.h>

#include "tp/hw.h"

#define TP__HW_MAX_GEMM_ROWS 16
#define TP__HW_MAX_RANKS_PER_DEVICE 65536

typedef struct {
    double latency;   /* seconds per algorithm step */
    double bandwidth; /* bytes per second over a rank's busiest link */
    tp_coll_algo algo;
    bool async_progress; /* asynchronous collectives move data beside compute
                          * (false: only inside the wait on them) */
} tp__hw_link;

struct tp_hw {
    char name[128];
    char description[512];
    int devices_per_node;
    int ranks_per_device;              /* ranks time-sharing one device (1: a device each) */
    double memory_bytes;               /* one device's memory; 0: not given */
    double peak_flops[TP_DTYPE_COUNT]; /* 0: not given */
    struct {
        int64_t min_dim;
        double efficiency;
    } gemm[TP__HW_MAX_GEMM_ROWS];
    int n_gemm;
    double mem_bw;     /* bytes per second */
    double kernel_lat; /* seconds per kernel */
    tp__hw_link link[2];
};

/* The JSON text of preset `name`, NULL when there is none. */
const char *tp__hw_preset_json(const char *name);
/* "a, b" (static). */
const char *tp__hw_preset_list(void);

#endif /* TP_PLAN_HW_INTERNAL_H */
