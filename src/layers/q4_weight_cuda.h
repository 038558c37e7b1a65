/* The 4-bit weight of a layer on CUDA (linear or conv2d), in the shared device state of
 * cuda_layer.h: the float training weight (w_f32) and the user-format nibble rows (qweight,
 * [rows, ceil(cols / 2)] bytes), as bie_q4_weight on the host.
 *
 * Life-cycle calls that are rare and not on the hot path (reset, set_weight_data, prepare,
 * generate/set qweight) reuse the CPU weight code, so that scale_w and the codes are the
 * CPU's bit for bit: the weight is staged to the host `bie_q4_weight` (with the device
 * scale_w), changed there and uploaded; the device copy changes only when all of that
 * worked. The host struct holds no buffers between calls. */
#ifndef BIE_Q4_WEIGHT_CUDA_H
#define BIE_Q4_WEIGHT_CUDA_H

#include "cuda_layer.h"
#include "q4_weight.h"

bie_status bie_cq4w_reset(bie_cuda_bw *d, bie_q4_weight *host, uint64_t seed);
bie_status bie_cq4w_prepare(bie_cuda_bw *d, bie_q4_weight *host, const char *who);
/* w: a device tensor of `dtype`, already checked to hold rows * cols elements. */
bie_status bie_cq4w_set_weight_data(bie_cuda_bw *d, bie_q4_weight *host, bie_dtype dtype,
                                    const bie_tensor *w, const char *who);
bie_status bie_cq4w_generate_qweight(bie_cuda_bw *d, bie_q4_weight *host, bool qweight_only,
                                     const char *who);
/* q: a device U8 tensor already checked to be [rows, ceil(cols / 2)]. */
bie_status bie_cq4w_set_qweight(bie_cuda_bw *d, bie_q4_weight *host, const bie_tensor *q,
                                const char *who);
/* Parameter views: QWEIGHT [rows, ceil(cols / 2)] U8, else bie_cbw_param_common. */
bie_status bie_cq4w_param(bie_cuda_bw *d, bie_param which, int wndim, const int64_t *wshape,
                          bie_tensor *v);
/* Kernel id -1 (default) or a CUDA 4-bit GEMM kernel that runs rows of k codes. */
bie_status bie_cq4w_check_kernel(int id, int64_t k, const char *who);

#endif
