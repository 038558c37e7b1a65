/* The training library's float kernels and optimizer steps on a CUDA device
 * (src/cuda/train_kernels.cu). Each kernel takes the arguments of its CPU counterpart in
 * train_internal.h, with pointers to device memory of the current CUDA device; it runs
 * asynchronously on bie's current stream and returns BIE_ERR_CUDA when a launch fails.
 * Results are deterministic: every reduction runs in a fixed order (no float atomics), and
 * where the arithmetic decides something discrete (the sign-flip step, max-pool's argmax) it
 * is the CPU's, operation for operation. Include only under BIE_HAVE_CUDA. */
#ifndef BIE_TRAIN_CUDA_H
#define BIE_TRAIN_CUDA_H

#include "../core/formats.h"
#include "../core/internal.h"
#include "bie_train.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- float layers: see train_internal.h for the meaning of every argument */

/* y[m, out] = x[m, in] w^T + b (b may be NULL); cuBLAS. m, in, out <= INT_MAX. */
bie_status bie_cuda_linear_forward(const float *x, int64_t m, int64_t in, int64_t out,
                                   const float *w, const float *b, float *y);
/* dx (may be NULL) = dy w; dw = dy^T x; db (may be NULL) = column sums of dy (in double). */
bie_status bie_cuda_linear_backward(const float *x, const float *dy, int64_t m, int64_t in,
                                    int64_t out, const float *w, float *dx, float *dw, float *db);
bie_status bie_cuda_relu_forward(const float *x, int64_t n, float *y);
bie_status bie_cuda_relu_backward(const float *y, const float *dy, int64_t n, float *dx);
bie_status bie_cuda_prelu_forward(const float *x, int64_t outer, int64_t channels, int64_t inner,
                                  const float *slopes, int64_t n_slopes, float *y);
/* dx may be NULL; dslopes (n_slopes entries) is always written. */
bie_status bie_cuda_prelu_backward(const float *x, const float *dy, int64_t outer, int64_t channels,
                                   int64_t inner, const float *slopes, int64_t n_slopes, float *dx,
                                   float *dslopes);
/* argmax may be NULL; first maximum wins ties, as on the CPU. */
bie_status bie_cuda_maxpool_forward(const float *x, int64_t planes, int64_t h, int64_t w, int k,
                                    int s, int64_t oh, int64_t ow, float *y, int32_t *argmax);
/* dx = 0, then dx[plane][argmax[o]] += dy[o] over each plane's outputs in increasing order
 * (one warp per plane), so overlapping windows add exactly as on the CPU. */
bie_status bie_cuda_maxpool_backward(const float *dy, const int32_t *argmax, int64_t planes,
                                     int64_t h, int64_t w, int64_t oh, int64_t ow, float *dx);
bie_status bie_cuda_batchnorm_forward_train(const float *x, int64_t n, int64_t c, int64_t inner,
                                            const float *gamma, const float *beta, float eps,
                                            float *y, float *xhat, float *invstd, float *batch_mean,
                                            float *batch_var);
bie_status bie_cuda_batchnorm_update_running(int64_t c, float momentum, const float *batch_mean,
                                             const float *batch_var, float *running_mean,
                                             float *running_var);
bie_status bie_cuda_batchnorm_forward_eval(const float *x, int64_t n, int64_t c, int64_t inner,
                                           const float *gamma, const float *beta, float eps,
                                           const float *running_mean, const float *running_var,
                                           float *y);
/* dx may be NULL. */
bie_status bie_cuda_batchnorm_backward(const float *xhat, const float *invstd, const float *dy,
                                       int64_t n, int64_t c, int64_t inner, const float *gamma,
                                       float *dx, float *dgamma, float *dbeta);

/* ---- the graph's float layers (src/cuda/train_graph_kernels.cu); conv2d through an
 * im2col buffer (`work`, bie_cuda_conv2d_work_floats(g) floats of device memory) and cuBLAS */
int64_t bie_cuda_conv2d_work_floats(const bie_conv_geom *g);
bie_status bie_cuda_conv2d_forward(const bie_conv_geom *g, const float *x, const float *w,
                                   const float *b, float *y, float *work);
bie_status bie_cuda_conv2d_backward(const bie_conv_geom *g, const float *x, const float *dy,
                                    const float *w, float *dx, float *dw, float *db, float *work);
bie_status bie_cuda_avgpool_forward(const float *x, int64_t planes, int64_t h, int64_t w, int k,
                                    int s, int64_t oh, int64_t ow, float *y);
bie_status bie_cuda_avgpool_backward(const float *dy, int64_t planes, int64_t h, int64_t w, int k,
                                     int s, int64_t oh, int64_t ow, float *dx);
bie_status bie_cuda_global_avgpool_forward(const float *x, int64_t planes, int64_t inner, float *y);
bie_status bie_cuda_global_avgpool_backward(const float *dy, int64_t planes, int64_t inner,
                                            float *dx);
bie_status bie_cuda_add_forward(const float *a, const float *b, int64_t n, float *y);
bie_status bie_cuda_accumulate(float *acc, const float *x, int64_t n);
bie_status bie_cuda_concat_copy(const float *x, int64_t outer, int64_t ci, int64_t inner,
                                int64_t ctotal, int64_t offset, float *y);
bie_status bie_cuda_concat_slice(const float *y, int64_t outer, int64_t ci, int64_t inner,
                                 int64_t ctotal, int64_t offset, float *x);
bie_status bie_cuda_rprelu_forward(const float *x, int64_t outer, int64_t channels, int64_t inner,
                                   const float *shift_in, const float *slopes,
                                   const float *shift_out, float *y);
bie_status bie_cuda_rprelu_backward(const float *x, const float *dy, int64_t outer,
                                    int64_t channels, int64_t inner, const float *shift_in,
                                    const float *slopes, float *dx, float *dshift_in,
                                    float *dslopes, float *dshift_out);

/* ---- optimizer steps on device arrays (formulas of src/train/optim.c; arguments already
 * validated by the caller) */

bie_status bie_cuda_adam_step(float *p, const float *g, float *m, float *v, int64_t n, int64_t step,
                              const bie_adam_options *o);
/* Exactly one of g8 / gf is not NULL. flipped is a host pointer (may be NULL); only when it
 * is not NULL does the call wait for the stream, to read the count. */
bie_status bie_cuda_signflip_step(int8_t *w, const int8_t *g8, const float *gf, float *m, float *v,
                                  int64_t n, float lr, float beta1, float beta2, int64_t *flipped);

/* ---- the training loop's loss and projection (train_loss.cu), queued without waiting */

/* bie_softmax_cross_entropy_accumulate on device logits [n, c] and grad (may alias), labels
 * in host memory (labels_on_host; staged by the call) or device memory, sums[3] in device
 * memory. */
bie_status bie_cuda_softmax_ce_accumulate(const float *logits, const int32_t *labels,
                                          bool labels_on_host, int64_t n, int64_t c, float *grad,
                                          double *sums);
/* x[i] = max(x[i], factor * floor[i]) for i < n (a NaN in x stays). */
bie_status bie_cuda_clamp_min_scaled(float *x, const float *floor, int64_t n, float factor);

/* ---- device memory of the current CUDA device */

/* cudaMalloc (a zero-byte request gets a 1-byte block); BIE_ERR_OUT_OF_MEMORY naming `what`. */
bie_status bie_cuda_train_alloc(void **p, size_t bytes, const char *what);
void bie_cuda_train_free(void *p); /* ignores NULL */
/* Copy in any direction on the current stream. Returns once the host may use its side: it
 * waits for copies into host memory and from pinned host memory, not for copies into device
 * memory from device or pageable host memory (stream ordered; the source is staged). */
bie_status bie_cuda_train_copy(void *dst, const void *src, size_t bytes);
/* Zero bytes on the current stream (no wait). */
bie_status bie_cuda_train_memset0(void *p, size_t bytes);
/* Wait for the current stream. */
bie_status bie_cuda_train_sync(void);
/* Make CUDA device `device` current; *previous receives the one that was (restore it with
 * bie_cuda_train_set_device(previous, NULL)). */
bie_status bie_cuda_train_set_device(int device, int *previous);

#ifdef __cplusplus
}
#endif
#endif
