/* The CUDA entry points of a build without the CUDA backend: they exist so that callers
 * (and language bindings) can probe at run time, and fail with a clear message. */
#include <string.h>

#include "../core/internal.h"
#include "bie_cuda.h"
#include "cuda_internal.h"

static bie_status not_built(const char *who) {
    return bie_fail(BIE_ERR_UNSUPPORTED,
                    "%s: this build of bie has no CUDA backend (nvcc was "
                    "not found when it was configured)",
                    who);
}

int bie_cuda_device_count(void) { return 0; }
bool bie_cuda_built(void) { return false; }

bie_status bie_cuda_tensor_alloc(bie_tensor *out, bie_dtype dtype, int ndim, const int64_t *shape,
                                 int device) {
    (void)out, (void)dtype, (void)ndim, (void)shape, (void)device;
    return not_built("bie_cuda_tensor_alloc");
}

bie_status bie_tensor_copy(bie_tensor *dst, const bie_tensor *src) {
    if (dst == NULL || src == NULL)
        return bie_fail(BIE_ERR_NULL_POINTER, "bie_tensor_copy: NULL tensor");
    if (dst->device.type != BIE_DEVICE_CPU || src->device.type != BIE_DEVICE_CPU)
        return not_built("bie_tensor_copy");
    if (dst->data == NULL || src->data == NULL)
        return bie_fail(BIE_ERR_NULL_POINTER, "bie_tensor_copy: tensor without data");
    if (dst->dtype != src->dtype) return bie_fail(BIE_ERR_DTYPE, "bie_tensor_copy: dtypes differ");
    int64_t n = bie_tensor_numel(src);
    if (n < 0 || n != bie_tensor_numel(dst))
        return bie_fail(BIE_ERR_SHAPE, "bie_tensor_copy: element counts differ");
    memmove(dst->data, src->data, (size_t)n * bie_dtype_size(src->dtype));
    return BIE_OK;
}

bie_status bie_cuda_set_stream(void *stream) {
    (void)stream;
    return not_built("bie_cuda_set_stream");
}
bie_status bie_cuda_synchronize(void) { return not_built("bie_cuda_synchronize"); }

bie_status bie_cuda_binary_gemm(int kernel_id, int64_t m, int64_t n, int64_t k, const void *a,
                                int64_t a_row_bytes, const void *b, int64_t b_row_bytes,
                                float scale, float *out) {
    (void)kernel_id, (void)m, (void)n, (void)k, (void)a, (void)a_row_bytes, (void)b;
    (void)b_row_bytes, (void)scale, (void)out;
    return not_built("bie_cuda_binary_gemm");
}

bie_status bie_cuda_q4_gemm(int kernel_id, int64_t m, int64_t n, int64_t k, const int8_t *a,
                            int64_t lda, const int8_t *b, int64_t ldb, float scale, float *out) {
    (void)kernel_id, (void)m, (void)n, (void)k, (void)a, (void)lda, (void)b, (void)ldb;
    (void)scale, (void)out;
    return not_built("bie_cuda_q4_gemm");
}

bie_status bie_cuda_bn_act_forward(const bie_cuda_bn_act *a, const void *y, const void *res,
                                   float *save_mean, float *save_rstd, void *out) {
    (void)a, (void)y, (void)res, (void)save_mean, (void)save_rstd, (void)out;
    return not_built("bie_bn_act_forward");
}

bie_status bie_cuda_bn_act_backward(const bie_cuda_bn_act *a, const void *grad_out, const void *y,
                                    const void *res, const float *save_mean, const float *save_rstd,
                                    void *grad_y, void *grad_res, float *grad_gamma,
                                    float *grad_beta, float *grad_slope) {
    (void)a, (void)grad_out, (void)y, (void)res, (void)save_mean, (void)save_rstd, (void)grad_y;
    (void)grad_res, (void)grad_gamma, (void)grad_beta, (void)grad_slope;
    return not_built("bie_bn_act_backward");
}
