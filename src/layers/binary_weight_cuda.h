/* The device side of a binary layer on CUDA (linear or conv2d): the weight in device memory
 * (float, int8 or packed, as bie_binary_weight on the host), bias_a, the device scalars the
 * kernels read (scale_a, scale_w, and the forward's copies for the backward) and the last
 * backward's gradients. Tensors users pass or receive are device tensors.
 *
 * Life-cycle calls that are rare and not on the hot path (reset, set_weight_data, prepare,
 * generate/set qweight, word size) reuse the CPU weight code: the weight is staged to the
 * host `bie_binary_weight`, changed there and uploaded; the device copy changes only when all
 * of that worked. Each successful upload bumps `version`, so that layers can rebuild caches
 * derived from the weight (packed bits in their GEMM layout). */
#ifndef BIE_BINARY_WEIGHT_CUDA_H
#define BIE_BINARY_WEIGHT_CUDA_H

#include "binary_weight.h"

#ifdef BIE_HAVE_CUDA

enum { BIE_CBW_SCALE_A = 0, BIE_CBW_SCALE_W = 1, BIE_CBW_SAVED_SCALES = 2 };

typedef struct bie_cuda_bw {
    int device;
    int64_t rows, cols, bias_len;
    const char *module;
    float *w_f32;      /* training weight before prepare_params, or NULL */
    int8_t *w_i8;      /* training weight after prepare_params, or NULL */
    void *qweight;     /* packed weight in the user format [rows, words], or NULL */
    float *bias_a;     /* [bias_len] */
    float *scalars;    /* scale_a, scale_w, saved scale_a, saved scale_w */
    bool scale_a_known; /* scale_a is non-zero: set by the user or measured */
    unsigned version;  /* bumped by every successful upload */
    /* Gradients of the last backward. */
    bool has_grads;
    float *g_w, *g_bias, *g_scale;
    int8_t *g_w_i8;
} bie_cuda_bw;

/* Status of a CUDA runtime call, with `module` in the message. */
bie_status bie_cbw_cuda_ok(int cuda_error, const char *module, const char *what);
bie_status bie_cbw_alloc(void **p, size_t bytes, const char *module, const char *what);
void bie_cbw_free_ptr(void *p);
/* Copy (any direction) and wait, on the calling thread's stream. */
bie_status bie_cbw_copy_sync(void *dst, const void *src, size_t bytes, const char *module, const char *what);

/* On device `device`: bias_a zeros, scale_a 0, scale_w 1; host must be bie_bw_init'ed. */
bie_status bie_cbw_create(bie_cuda_bw *d, int device, int64_t rows, int64_t cols, int64_t bias_len,
                          const char *module);
void bie_cbw_free(bie_cuda_bw *d);

/* Host staging: copy the device weight into host's buffers / upload host's buffers as the new
 * device weight (host's buffers are freed either way). */
bie_status bie_cbw_stage_down(bie_cuda_bw *d, bie_binary_weight *host);
bie_status bie_cbw_stage_up(bie_cuda_bw *d, bie_binary_weight *host);

bie_status bie_cbw_reset(bie_cuda_bw *d, bie_binary_weight *host, uint64_t seed);
bie_status bie_cbw_prepare(bie_cuda_bw *d, bie_binary_weight *host, const char *who);
/* w: a device tensor of `dtype`, already checked to hold rows * cols elements. */
bie_status bie_cbw_set_weight_data(bie_cuda_bw *d, bie_binary_weight *host, bie_dtype dtype,
                                   const bie_tensor *w, const char *who);
bie_status bie_cbw_generate_qweight(bie_cuda_bw *d, bie_binary_weight *host, bool qweight_only,
                                    const char *who);
/* q: a device tensor already checked to be [rows, words] of the word dtype. */
bie_status bie_cbw_set_qweight(bie_cuda_bw *d, bie_binary_weight *host, const bie_tensor *q,
                               const char *who);
bie_status bie_cbw_set_bits(bie_cuda_bw *d, bie_binary_weight *host, int bits);

/* Parameter views: WEIGHT (wndim/wshape), QWEIGHT, BIAS_A, SCALE_A, SCALE_W. */
bie_status bie_cbw_param(bie_cuda_bw *d, const bie_binary_weight *host, bie_param which, int wndim,
                         const int64_t *wshape, bie_tensor *v);
/* Gradient views of the last backward. */
bie_status bie_cbw_grad(bie_cuda_bw *d, bie_param which, int wndim, const int64_t *wshape, bie_tensor *v);
/* Room for the gradients (int8 weight gradient only for an int8 weight). */
bie_status bie_cbw_reserve_grads(bie_cuda_bw *d);

bie_status bie_cbw_set_scale_a(bie_cuda_bw *d, float scale_a);
/* scale_a = factor * mean|x| over n elements of x (device, dtype) when still 0. */
bie_status bie_cbw_ensure_scale_a(bie_cuda_bw *d, bie_dtype dtype, const void *x, int64_t n,
                                  double factor, const char *who);

/* Kernel id -1 (default) or a CUDA binary GEMM kernel that runs rows of ld bytes. */
bie_status bie_cbw_check_kernel(int id, int64_t ld, const char *who);
/* The fastest CUDA binary GEMM kernel for (m, n, k) on rows of ld bytes, timed with events. */
bie_status bie_cbw_select_bgemm(int64_t m, int64_t n, int64_t k, int64_t ld, int *id);

/* A device tensor on CUDA device `device` of `dtype` whose last extent is `last` and whose
 * leading extents equal those of `like` (any when like is NULL). */
bie_status bie_cbw_check_tensor(int device, const bie_tensor *t, const char *what, bie_dtype dtype,
                                int64_t last, const bie_tensor *like, const char *who);
/* A view of device memory on device `device`. */
bie_status bie_cbw_view(int device, bie_tensor *v, void *data, bie_dtype dt, int ndim,
                        const int64_t *shape);

#endif
#endif
