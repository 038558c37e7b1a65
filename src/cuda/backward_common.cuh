// Pieces of the binary backward (backward.cu) that the 4-bit backward (q4backward.cu)
// shares: the per-thread cuBLAS handle and the fixed-order reductions.
#pragma once
#include <cublas_v2.h>

#include "cuda_common.cuh"
#include "cuda_internal.h"

namespace bie_cuda {
bie_status blas_check(cublasStatus_t s, const char *what);
// The calling thread's cuBLAS handle, bound to its current stream, scalars in device memory.
bie_status blas_handle(cublasHandle_t *out);
// A device float holding 0 (beta of the GEMMs).
bie_status device_zero(float **out);
// Bytes of the workspace column_sums needs for k columns.
size_t column_sums_workspace(int64_t k);
// out[c] = sum over the m rows of g [m, k], in double and a fixed order, on the current stream.
void column_sums(const float *g, int64_t m, int64_t k, void *workspace, float *out);
// *out = sum of parts[0 .. count) / denom, in double and a fixed order, on the current stream.
void sum_over(const double *parts, int64_t count, double denom, float *out);
// Convolutions: G [o][n oh ow] of grad_out [n][o][oh ow] (f32/bf16/f16), and from per-plane
// sums and dots [n][c]: grad_bias[c] = sum_n plane_sum, *grad_scale = sum plane_dot / denom.
void conv_grad_rows_any(bie_dtype dtype, const void *grad_out, const bie_cuda_conv_shape &g, void *dst);
void conv_bias_scale_sums(const double *plane_sum, const double *plane_dot, int64_t n, int64_t c, double denom,
                          float *grad_bias, float *grad_scale);
}  // namespace bie_cuda
