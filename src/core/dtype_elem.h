/* One element of each dtype loaded and stored at an address of any
 * alignment, inline. The dtype-traits table (dtype.c) and tp_tensor_copy's
 * conversion loops (tensor.c) are both built from these, so each dtype's
 * conversion rules are written once. Not installed. */
#ifndef TP_CORE_DTYPE_ELEM_H
#define TP_CORE_DTYPE_ELEM_H

#include <string.h>

#include "base.h"

static inline float tp__ld_f32(const char *p) { float v; memcpy(&v, p, sizeof v); return v; }
static inline double tp__ld_f64(const char *p) { double v; memcpy(&v, p, sizeof v); return v; }
static inline float tp__ld_f16(const char *p) { uint16_t v; memcpy(&v, p, sizeof v); return tp__f16_to_f32(v); }
static inline float tp__ld_bf16(const char *p) { uint16_t v; memcpy(&v, p, sizeof v); return tp__bf16_to_f32(v); }
static inline int32_t tp__ld_i32(const char *p) { int32_t v; memcpy(&v, p, sizeof v); return v; }
static inline int64_t tp__ld_i64(const char *p) { int64_t v; memcpy(&v, p, sizeof v); return v; }

/* Stores from a float source (_d) and from an integer source (_i). Integers
 * convert directly so that i64 -> f32 rounds once, not via double. The rules
 * are the traits' (core/base.h). */
static inline void tp__st_f32_d(char *p, double v) { float x = (float)v; memcpy(p, &x, sizeof x); }
static inline void tp__st_f32_i(char *p, int64_t v) { float x = (float)v; memcpy(p, &x, sizeof x); }
static inline void tp__st_f64_d(char *p, double v) { memcpy(p, &v, sizeof v); }
static inline void tp__st_f64_i(char *p, int64_t v) { double x = (double)v; memcpy(p, &x, sizeof x); }
static inline void tp__st_f16_d(char *p, double v) { uint16_t x = tp__f32_to_f16((float)v); memcpy(p, &x, sizeof x); }
static inline void tp__st_f16_i(char *p, int64_t v) { uint16_t x = tp__f32_to_f16((float)v); memcpy(p, &x, sizeof x); }
static inline void tp__st_bf16_d(char *p, double v) { uint16_t x = tp__f32_to_bf16((float)v); memcpy(p, &x, sizeof x); }
static inline void tp__st_bf16_i(char *p, int64_t v) { uint16_t x = tp__f32_to_bf16((float)v); memcpy(p, &x, sizeof x); }
static inline void tp__st_i32_d(char *p, double v) { int32_t x = tp__f64_to_i32(v); memcpy(p, &x, sizeof x); }
static inline void tp__st_i32_i(char *p, int64_t v) { int32_t x = (int32_t)v; memcpy(p, &x, sizeof x); }
static inline void tp__st_i64_d(char *p, double v) { int64_t x = tp__f64_to_i64(v); memcpy(p, &x, sizeof x); }
static inline void tp__st_i64_i(char *p, int64_t v) { memcpy(p, &v, sizeof v); }

#endif /* TP_CORE_DTYPE_ELEM_H */
