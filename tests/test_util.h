/* Tiny test harness shared by the test programs: checks that count, a seeded generator,
 * poison patterns. */
#ifndef BIE_TEST_UTIL_H
#define BIE_TEST_UTIL_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bie.h"

static int tu_passed, tu_failed;

#define CHECK(cond)                                                                  \
    do {                                                                             \
        if (cond) {                                                                  \
            tu_passed++;                                                             \
        } else {                                                                     \
            tu_failed++;                                                             \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
        }                                                                            \
    } while (0)

#define CHECK_OK(call)                                                                \
    do {                                                                              \
        bie_status tu_st_ = (call);                                                   \
        if (tu_st_ == BIE_OK) {                                                       \
            tu_passed++;                                                              \
        } else {                                                                      \
            tu_failed++;                                                              \
            fprintf(stderr, "%s:%d: %s returned %s: %s\n", __FILE__, __LINE__, #call, \
                    bie_status_name(tu_st_), bie_last_error());                       \
        }                                                                             \
    } while (0)

/* BIE_CPU_KERNELS asks for a kernel set this CPU lacks: the caller reports a skip (77). */
static inline int tu_forced_set_missing(void) {
    const char *forced = getenv("BIE_CPU_KERNELS");
    if (forced && *forced && strcmp(forced, bie_cpu_kernel_set()) != 0) {
        printf("skipped: this CPU cannot run the '%s' kernel set (best: %s)\n", forced,
               bie_cpu_kernel_set());
        return 1;
    }
    return 0;
}
#define TU_SKIP 77

static inline int tu_finish(void) {
    printf("%d passed, %d failed\n", tu_passed, tu_failed);
    return tu_failed ? 1 : 0;
}

static uint64_t tu_state = 0x853c49e6748fea9bull;
static inline void tu_seed(uint64_t s) { tu_state = s * 2654435761ull + 1; }
static inline uint64_t tu_next(void) {
    tu_state = tu_state * 6364136223846793005ull + 1442695040888963407ull;
    uint64_t x = tu_state;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    return x ^ (x >> 33);
}
/* Uniform in [lo, hi). */
static inline float tu_uniform(float lo, float hi) {
    return lo + (hi - lo) * (float)((tu_next() >> 40) * (1.0 / 16777216.0));
}
static inline void tu_fill(float *x, int64_t n, float lo, float hi) {
    for (int64_t i = 0; i < n; i++) x[i] = tu_uniform(lo, hi);
}
static inline void tu_fill_bytes(void *p, int64_t n) {
    uint8_t *b = p;
    for (int64_t i = 0; i < n; i++) b[i] = (uint8_t)(tu_next() >> 56);
}
/* Poison floats with a NaN pattern that no computation produces. */
static inline void tu_poison(float *x, int64_t n) {
    uint32_t bits = 0x7fc0dead;
    for (int64_t i = 0; i < n; i++) memcpy(&x[i], &bits, 4);
}
static inline int tu_same_bits(const float *a, const float *b, int64_t n) {
    return memcmp(a, b, (size_t)n * sizeof(float)) == 0;
}
static inline void *tu_alloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}
static inline bie_tensor tu_view(void *data, bie_dtype dt, int ndim, int64_t d0, int64_t d1,
                                 int64_t d2, int64_t d3) {
    int64_t shape[4] = {d0, d1, d2, d3};
    bie_tensor t;
    if (bie_tensor_view(&t, data, dt, ndim, shape) != BIE_OK) {
        fprintf(stderr, "bad view: %s\n", bie_last_error());
        exit(2);
    }
    return t;
}

/* What the tests read of a layer through bie_layer_describe (exits on a NULL layer: a test
 * bug, not a library error). */
static inline bie_layer_desc tu_describe(const bie_layer *l) {
    bie_layer_desc d;
    if (bie_layer_describe(l, &d) != BIE_OK) {
        fprintf(stderr, "describe failed: %s\n", bie_last_error());
        exit(2);
    }
    return d;
}
static inline int tu_layer_bits(const bie_layer *l) { return tu_describe(l).bits_binary_word; }
static inline bool tu_layer_training(const bie_layer *l) { return tu_describe(l).training; }
static inline int tu_layer_kernel(const bie_layer *l) { return tu_describe(l).kernel_id; }
static inline int64_t tu_layer_in(const bie_layer *l) { return tu_describe(l).in; }
static inline int64_t tu_layer_out(const bie_layer *l) { return tu_describe(l).out; }
/* Output extents of a conv layer for one image of h x w (bie_layer_output_shape). */
static inline bie_status tu_layer_output_hw(const bie_layer *l, int64_t h, int64_t w,
                                            int64_t *out_h, int64_t *out_w) {
    int64_t in_shape[4] = {1, tu_describe(l).in, h, w}, out_shape[BIE_MAX_DIMS];
    int out_ndim = 0;
    bie_status st = bie_layer_output_shape(l, 4, in_shape, &out_ndim, out_shape);
    *out_h = st == BIE_OK ? out_shape[2] : 0; /* 0 when the shape is refused */
    *out_w = st == BIE_OK ? out_shape[3] : 0;
    return st;
}

/* forward_again of a CPU layer after its training forward wrote `no` floats into *to: what
 * that forward used changes first (its input buffer x of nx values, scale_a, the int8
 * weight's signs), then forward_again must write the same bits, twice (expect: scratch). */
static inline void tu_check_forward_again(bie_layer *l, float *x, int64_t nx, bie_tensor *to,
                                          float *expect, int64_t no) {
    memcpy(expect, to->data, (size_t)no * sizeof(float));
    tu_fill(x, nx, -1.5f, 1.5f);
    CHECK_OK(bie_layer_set_scale_a(l, 0.37f));
    bie_tensor w;
    CHECK_OK(bie_layer_param(l, BIE_PARAM_WEIGHT, &w));
    for (int64_t i = 0; i < bie_tensor_numel(&w); i++) ((int8_t *)w.data)[i] *= -1;
    for (int rep = 0; rep < 2; rep++) {
        tu_poison(to->data, no);
        CHECK_OK(bie_layer_forward_again(l, to));
        CHECK(tu_same_bits(to->data, expect, no));
    }
}

#endif
