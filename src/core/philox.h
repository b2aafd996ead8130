/* Philox-4x32-10 shared by the host (core.h, rng.c, the CPU kernels) and the
 * CUDA kernels, so that a counter-based mask or fill is bit-identical on both.
 * Plain C with fixed-width integers only; not installed. */
#ifndef TP_PHILOX_H
#define TP_PHILOX_H

#include <stdint.h>

#ifdef __CUDACC__
#define TP__HD __host__ __device__
#else
#define TP__HD
#endif

/* Philox-4x32-10 on a full 128-bit counter and 64-bit key (Random123
 * numbering). Inline so the fill loops keep it in registers, and so tests can
 * check the Random123 known-answer vectors, whose counters use all 4 words. */
static inline TP__HD void tp__philox4x32_10(const uint32_t ctr[4], const uint32_t key[2],
                                            uint32_t out[4])
{
    uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3];
    uint32_t k0 = key[0], k1 = key[1];
    for (int r = 0; r < 10; r++) {
        if (r > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        uint64_t p0 = (uint64_t)0xD2511F53u * c0;
        uint64_t p1 = (uint64_t)0xCD9E8D57u * c2;
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
        uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c1 = (uint32_t)p1;
        c3 = (uint32_t)p0;
        c0 = n0;
        c2 = n2;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
}

/* tp_rng_uniform(seed, g): 53 bits of the first two words of the block at
 * counter g, as a double in [0, 1). */
static inline TP__HD double tp__rng_uniform53(uint64_t seed, uint64_t g)
{
    const uint32_t ctr[4] = {(uint32_t)g, (uint32_t)(g >> 32), 0, 0};
    const uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    uint32_t r[4];
    tp__philox4x32_10(ctr, key, r);
    return (double)((((uint64_t)r[0] << 32) | r[1]) >> 11) * 0x1.0p-53;
}

#endif /* TP_PHILOX_H */
