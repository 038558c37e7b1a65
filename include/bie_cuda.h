/*
 * bie — CUDA entry points. Every function exists in every build; without the CUDA backend
 * (no nvcc at build time) or without a GPU they return BIE_ERR_UNSUPPORTED / BIE_ERR_DEVICE
 * with a message, so callers can probe at run time.
 */
#ifndef BIE_CUDA_H
#define BIE_CUDA_H

#include "bie.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Number of usable CUDA devices (0 without the backend, a driver or a GPU). Never fails. */
BIE_API int bie_cuda_device_count(void);
/* true when this library was built with the CUDA backend. */
BIE_API bool bie_cuda_built(void);

/* Device memory: a tensor on CUDA device `device` (uninitialised). Free with
 * bie_tensor_free. Errors: no backend/device, bad shape, out of memory. */
BIE_API bie_status bie_cuda_tensor_alloc(bie_tensor *out, bie_dtype dtype, int ndim,
                                         const int64_t *shape, int device);
/* Copy between any two tensors of equal dtype and element count (host or device).
 * Synchronous with respect to the host. */
BIE_API bie_status bie_tensor_copy(bie_tensor *dst, const bie_tensor *src);

/* The stream bie launches on in the calling thread (NULL = the default stream). */
BIE_API bie_status bie_cuda_set_stream(void *cuda_stream);
/* Wait for all work bie queued on the calling thread's stream. */
BIE_API bie_status bie_cuda_synchronize(void);

/* Binary GEMM on tensor cores, on device memory (see bie_binary_gemm for the meaning):
 * out[i * n + j] = (float)dot(a_i, b_j) * scale over k valid bits; rows of packed signs with
 * the given strides in bytes (>= ceil(k / 8)); padding bits are ignored. kernel_id < 0 picks
 * the default. Asynchronous on the current stream. Errors: as bie_binary_gemm, plus
 * pointers that are not device memory, k > 2^28. */
BIE_API bie_status bie_cuda_binary_gemm(int kernel_id, int64_t m, int64_t n, int64_t k,
                                        const void *a, int64_t a_row_bytes, const void *b,
                                        int64_t b_row_bytes, float scale, float *out);

/* 4-bit GEMM on tensor cores, on device memory (see bie_q4_gemm for the meaning):
 * out[i * n + j] = (float)dot(a_i, b_j) * scale, a and b rows of k int8 codes in [-8, 7]
 * (other values count by their low 4 bits) with the given row strides in elements, the dot
 * product exact. kernel_id < 0 picks the default. Asynchronous on the current stream.
 * Errors: as bie_q4_gemm, plus pointers that are not device memory. */
BIE_API bie_status bie_cuda_q4_gemm(int kernel_id, int64_t m, int64_t n, int64_t k, const int8_t *a,
                                    int64_t lda, const int8_t *b, int64_t ldb, float scale,
                                    float *out);

#ifdef __cplusplus
}
#endif
#endif
