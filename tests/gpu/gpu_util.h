/* Helpers of the GPU tests: dtype conversions on the host, device upload/download of float
 * values in any float dtype, poisoning and comparisons. */
#ifndef BIE_TEST_GPU_UTIL_H
#define BIE_TEST_GPU_UTIL_H

#include <math.h>

#include "../test_util.h"
#include "bie_cuda.h"

static const bie_dtype kDtypes[] = {BIE_F32, BIE_BF16, BIE_F16};

/* ---- host conversions (the values the tests use are exact in every dtype) */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}
static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline uint16_t to_f16(float f) {
    _Float16 h = (_Float16)f; /* round to nearest even */
    uint16_t u;
    memcpy(&u, &h, 2);
    return u;
}
static inline float from_f16(uint16_t u) {
    _Float16 h;
    memcpy(&h, &u, 2);
    return (float)h;
}
/* A float32 value as the dtype rounds it. */
static inline float round_to(bie_dtype dt, float f) {
    return dt == BIE_BF16 ? from_bf16(to_bf16(f)) : dt == BIE_F16 ? from_f16(to_f16(f)) : f;
}

/* Device tensor of dtype dt holding the float values v (already representable). */
/* v rounded to the nearest e4m3 value (ties to even), saturated at +-448 (SATFINITE). */
static inline float round_e4m3(float v) {
    const float a = fabsf(v);
    if (!(a > 0.0f)) return v;
    int e;
    frexpf(a, &e); /* a = f 2^e, f in [0.5, 1): the leading bit is 2^(e - 1) */
    const float step = ldexpf(1.0f, (e - 1 < -6 ? -6 : e - 1) - 3); /* subnormals: 2^-9 */
    float q = rintf(a / step) * step;
    if (q > 448.0f) q = 448.0f;
    return v < 0 ? -q : q;
}

static inline bie_tensor upload_as(bie_dtype dt, const float *v, int64_t rows, int64_t cols) {
    int64_t shape[2] = {rows, cols}, n = rows * cols;
    bie_tensor d;
    CHECK_OK(bie_cuda_tensor_alloc(&d, dt, 2, shape, 0));
    void *host = tu_alloc((size_t)n * 4);
    if (dt == BIE_F32) memcpy(host, v, (size_t)n * 4);
    for (int64_t i = 0; dt != BIE_F32 && i < n; i++)
        ((uint16_t *)host)[i] = dt == BIE_BF16 ? to_bf16(v[i]) : to_f16(v[i]);
    bie_tensor h = tu_view(host, dt, 2, rows, cols, 0, 0);
    CHECK_OK(bie_tensor_copy(&d, &h));
    free(host);
    return d;
}

/* Device tensor -> host floats. */
static inline void download_as(const bie_tensor *d, float *out) {
    int64_t n = bie_tensor_numel(d);
    void *host = tu_alloc((size_t)n * 4);
    bie_tensor h = *d;
    h.data = host;
    h.device = bie_cpu();
    h.owns_data = false;
    CHECK_OK(bie_tensor_copy(&h, d));
    for (int64_t i = 0; i < n; i++)
        out[i] = d->dtype == BIE_F32    ? ((float *)host)[i]
                 : d->dtype == BIE_BF16 ? from_bf16(((uint16_t *)host)[i])
                 : d->dtype == BIE_I8   ? (float)((int8_t *)host)[i]
                                        : from_f16(((uint16_t *)host)[i]);
    free(host);
}

static inline bie_tensor device_empty(bie_dtype dt, int64_t rows, int64_t cols) {
    int64_t shape[2] = {rows, cols};
    bie_tensor d;
    CHECK_OK(bie_cuda_tensor_alloc(&d, dt, 2, shape, 0));
    return d;
}

/* Fill a device tensor with `byte` in every byte. */
static inline void poison_device_with(bie_tensor *d, uint8_t byte) {
    size_t bytes = (size_t)bie_tensor_numel(d) * bie_dtype_size(d->dtype);
    uint8_t *p = tu_alloc(bytes);
    memset(p, byte, bytes);
    bie_tensor h = *d;
    h.data = p;
    h.device = bie_cpu();
    h.owns_data = false;
    CHECK_OK(bie_tensor_copy(d, &h));
    free(p);
}

/* Fill a device tensor with NaN-looking bytes, so an unwritten element fails a comparison. */
static inline void poison_device(bie_tensor *d) { poison_device_with(d, 0xff); }

static inline int compare_exact(const char *what, const float *got, const float *expect,
                                int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (memcmp(&got[i], &expect[i], 4) != 0) {
            fprintf(stderr, "  %s: element %lld differs: %.9g vs %.9g\n", what, (long long)i,
                    (double)got[i], (double)expect[i]);
            return 0;
        }
    return 1;
}

/* No CUDA device: says so (the caller returns TU_SKIP). */
static inline int gpu_missing(void) {
    if (bie_cuda_device_count() > 0) return 0;
    printf("skipped: no CUDA device (%s)\n",
           bie_cuda_built() ? "CUDA backend built" : "CPU-only build");
    return 1;
}

/* Whether every element of a poisoned float device tensor still reads as NaN: the failed
 * calls before it wrote nothing. */
static inline int still_poisoned(const bie_tensor *d) {
    const int64_t n = bie_tensor_numel(d);
    float *o = tu_alloc((size_t)n * 4);
    download_as(d, o);
    int still = 1;
    for (int64_t i = 0; i < n; i++) still &= isnan(o[i]) != 0;
    free(o);
    return still;
}

/* Host copy of the bytes of a tensor on either device (the caller frees it). */
static inline void *download_bytes(const bie_tensor *d) {
    const size_t bytes = (size_t)bie_tensor_numel(d) * bie_dtype_size(d->dtype);
    void *p = tu_alloc(bytes ? bytes : 1);
    bie_tensor h = *d;
    h.data = p;
    h.device = bie_cpu();
    h.owns_data = false;
    CHECK_OK(bie_tensor_copy(&h, d));
    return p;
}

/* Whether a device tensor holds exactly the bytes of `host` (as many as the tensor has). */
static inline int device_bytes_match(const bie_tensor *d, const void *host) {
    void *copy = download_bytes(d);
    const int same =
        memcmp(copy, host, (size_t)bie_tensor_numel(d) * bie_dtype_size(d->dtype)) == 0;
    free(copy);
    return same;
}

/* Values r / 64, |r| < 256: exact in bfloat16 and float16; some exact zeros. */
static inline void fill_input(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = (float)((int)(tu_next() % 511) - 255) / 64.0f;
}

/* [n][c][hw] -> [n][hw][c] (back = 0) or the reverse, host floats. */
static inline void nhwc_order(const float *src, float *dst, int64_t n, int64_t c, int64_t hw,
                              int back) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t ch = 0; ch < c; ch++)
            for (int64_t q = 0; q < hw; q++) {
                const int64_t a = (i * c + ch) * hw + q, b = (i * hw + q) * c + ch;
                if (back)
                    dst[a] = src[b];
                else
                    dst[b] = src[a];
            }
}

/* The GPU layer's forward (into a poisoned device output of dtype dt) against the CPU
 * layer's float32 forward (into a poisoned host output) rounded to dt, bit for bit. The
 * output has ndim (2 or 4) dimensions `shape`; nhwc: the GPU's 4-D output is NHWC in memory
 * (the CPU's NCHW). Returns whether they match. */
static inline int forward_matches_layout(bie_dtype dt, int ndim, const int64_t *shape,
                                         bie_layer *gpu, bie_layer *cpu, const bie_tensor *gx,
                                         const bie_tensor *cx, const char *what, int nhwc) {
    int64_t count = 1;
    for (int d = 0; d < ndim; d++) count *= shape[d];
    bie_tensor gout = device_empty(dt, count / shape[ndim - 1], shape[ndim - 1]);
    gout.ndim = ndim;
    for (int d = 0; d < ndim; d++) gout.shape[d] = shape[d];
    poison_device(&gout);
    float *cout = tu_alloc((size_t)count * 4), *got = tu_alloc((size_t)count * 4);
    tu_poison(cout, count);
    bie_tensor ch = ndim == 4 ? tu_view(cout, BIE_F32, 4, shape[0], shape[1], shape[2], shape[3])
                              : tu_view(cout, BIE_F32, 2, shape[0], shape[1], 0, 0);
    bie_status st = bie_layer_forward(gpu, gx, &gout);
    CHECK(st == BIE_OK);
    if (st != BIE_OK) fprintf(stderr, "  %s: %s\n", what, bie_last_error());
    CHECK_OK(bie_layer_forward(cpu, cx, &ch));
    download_as(&gout, got);
    if (nhwc && ndim == 4) { /* to NCHW */
        float *t = tu_alloc((size_t)count * 4);
        nhwc_order(got, t, shape[0], shape[1], shape[2] * shape[3], 1);
        memcpy(got, t, (size_t)count * 4);
        free(t);
    }
    for (int64_t i = 0; i < count; i++) cout[i] = round_to(dt, cout[i]);
    const int same = compare_exact(what, got, cout, count);
    CHECK(same);
    bie_tensor_free(&gout);
    free(cout);
    free(got);
    return same;
}

static inline int forward_matches_as(bie_dtype dt, int ndim, const int64_t *shape, bie_layer *gpu,
                                     bie_layer *cpu, const bie_tensor *gx, const bie_tensor *cx,
                                     const char *what) {
    return forward_matches_layout(dt, ndim, shape, gpu, cpu, gx, cx, what, 0);
}

/* |got - ref| <= tol * max|ref| + 1e-6 everywhere. */
static inline int compare_close(const char *what, const float *got, const float *ref, int64_t n,
                                double tol) {
    double amax = 0;
    for (int64_t i = 0; i < n; i++) amax = fmax(amax, fabs(ref[i]));
    for (int64_t i = 0; i < n; i++)
        if (!(fabs((double)got[i] - ref[i]) <= tol * amax + 1e-6)) {
            fprintf(stderr, "  %s: element %lld: %.7g vs %.7g (max|ref| %.4g)\n", what,
                    (long long)i, (double)got[i], (double)ref[i], amax);
            return 0;
        }
    return 1;
}

/* View a contiguous tensor with another shape of the same element count. */
static inline void reshape4(bie_tensor *t, int64_t a, int64_t b, int64_t c, int64_t d) {
    t->ndim = 4;
    t->shape[0] = a;
    t->shape[1] = b;
    t->shape[2] = c;
    t->shape[3] = d;
}

#endif
