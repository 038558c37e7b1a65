/* The binary weight of a layer on CUDA (linear or conv2d), in the shared device state of
 * cuda_layer.h: float, int8 or packed signs, as bie_binary_weight on the host.
 *
 * Life-cycle calls that are rare and not on the hot path (reset, set_weight_data, prepare,
 * generate/set qweight, word size) reuse the CPU weight code: the weight is staged to the
 * host `bie_binary_weight`, changed there and uploaded; the device copy changes only when all
 * of that worked. */
#ifndef BIE_BINARY_WEIGHT_CUDA_H
#define BIE_BINARY_WEIGHT_CUDA_H

#include "cuda_layer.h"

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

/* Parameter views: QWEIGHT (words of the layer's word size), else bie_cbw_param_common. */
bie_status bie_cbw_param(bie_cuda_bw *d, const bie_binary_weight *host, bie_param which, int wndim,
                         const int64_t *wshape, bie_tensor *v);

/* Kernel id -1 (default) or a CUDA binary GEMM kernel that runs rows of ld bytes. */
bie_status bie_cbw_check_kernel(int id, int64_t ld, const char *who);
/* The fastest CUDA GEMM kernel of `op` for (m, n, k) on rows of ld bytes, timed with events. */
bie_status bie_cbw_select_kernel(bie_op op, int64_t m, int64_t n, int64_t k, int64_t ld, int *id);

#endif
