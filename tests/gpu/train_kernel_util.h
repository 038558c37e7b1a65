/* What the tests of the training library's CUDA kernels share (test_cuda_train_kernels.c,
 * test_cuda_graph_kernels.c): random data, device buffers, outputs of two poisoned runs. */
#ifndef BIE_TEST_TRAIN_KERNEL_UTIL_H
#define BIE_TEST_TRAIN_KERNEL_UTIL_H

#include "gpu_util.h"
#ifdef BIE_TEST_CUDA_INTERNALS
#include "train/train_cuda.h"
#include "train/train_internal.h"
#endif

static inline float *fvec(int64_t n) { return tu_alloc((size_t)n * sizeof(float)); }

/* Random values in [-1, 1) with some exact zeros (the >= 0 branches). */
static inline void fill_signed(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = (tu_next() % 16 == 0) ? 0.0f : tu_uniform(-1.0f, 1.0f);
}

#ifdef BIE_TEST_CUDA_INTERNALS

/* ---- device buffers */

static inline void *dput(const void *host, size_t bytes) {
    void *d = NULL;
    CHECK_OK(bie_cuda_train_alloc(&d, bytes, "test buffer"));
    if (host) CHECK_OK(bie_cuda_train_copy(d, host, bytes));
    return d;
}

/* All bytes 0xff: NaN floats, argmax -1, int8 -1. */
static inline void dpoison(void *d, size_t bytes) {
    uint8_t *p = tu_alloc(bytes);
    memset(p, 0xff, bytes);
    CHECK_OK(bie_cuda_train_copy(d, p, bytes));
    free(p);
}

static inline void dget(void *host, const void *d, size_t bytes) {
    CHECK_OK(bie_cuda_train_sync());
    CHECK_OK(bie_cuda_train_copy(host, d, bytes));
}

static inline int same_bits(const char *what, const void *a, const void *b, size_t bytes) {
    if (memcmp(a, b, bytes) == 0) return 1;
    fprintf(stderr, "  %s: two runs differ\n", what);
    return 0;
}

/* An output of a kernel under test: its device buffer and the host copies of two runs. */
typedef struct out_buf {
    void *dev;
    void *host[2];
    size_t bytes;
} out_buf;

static inline out_buf out_make(size_t bytes, int present) {
    out_buf o = {NULL, {NULL, NULL}, bytes};
    if (!present) return o;
    o.dev = dput(NULL, bytes);
    o.host[0] = tu_alloc(bytes);
    o.host[1] = tu_alloc(bytes);
    return o;
}

static inline void out_free(out_buf *o) {
    bie_cuda_train_free(o->dev);
    free(o->host[0]);
    free(o->host[1]);
}

/* Two runs of a kernel: outputs (and `scratch`, may be NULL) poisoned before each, the
 * second run's bits must equal the first's. */
#define TWICE(outs, nouts, scratch, scratch_bytes, launch, what)                                   \
    do {                                                                                           \
        for (int rep_ = 0; rep_ < 2; rep_++) {                                                     \
            for (int o_ = 0; o_ < (nouts); o_++)                                                   \
                if ((outs)[o_].dev) dpoison((outs)[o_].dev, (outs)[o_].bytes);                     \
            if (scratch) dpoison((scratch), (scratch_bytes));                                      \
            CHECK_OK(launch);                                                                      \
            for (int o_ = 0; o_ < (nouts); o_++)                                                   \
                if ((outs)[o_].dev) dget((outs)[o_].host[rep_], (outs)[o_].dev, (outs)[o_].bytes); \
        }                                                                                          \
        for (int o_ = 0; o_ < (nouts); o_++)                                                       \
            if ((outs)[o_].dev)                                                                    \
                CHECK(same_bits(what, (outs)[o_].host[0], (outs)[o_].host[1], (outs)[o_].bytes));  \
    } while (0)

#endif /* BIE_TEST_CUDA_INTERNALS */
#endif
