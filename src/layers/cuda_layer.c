/* The device state every layer on CUDA shares: see cuda_layer.h. */
#include "cuda_layer.h"
#include "layer.h"

#include <cuda_runtime_api.h>
#include <math.h>
#include <string.h>

#include "../cuda/cuda_internal.h"
#include "bie_cuda.h"
#include "conv_common.h"

/* ---------------------------------------------------------------- device memory */

bie_status bie_cbw_cuda_ok(int cuda_error, const char *module, const char *what) {
    cudaError_t err = (cudaError_t)cuda_error;
    if (err == cudaSuccess) return BIE_OK;
    cudaGetLastError();
    return bie_fail(err == cudaErrorMemoryAllocation ? BIE_ERR_OUT_OF_MEMORY : BIE_ERR_CUDA,
                    "%s: %s: %s", module, what, cudaGetErrorString(err));
}

bie_status bie_cbw_alloc(void **p, size_t bytes, const char *module, const char *what) {
    *p = NULL;
    return bie_cbw_cuda_ok(cudaMalloc(p, bytes ? bytes : 1), module, what);
}

void bie_cbw_free_ptr(void *p) {
    if (p) cudaFree(p);
}

bie_status bie_cbw_copy_sync(void *dst, const void *src, size_t bytes, const char *module,
                             const char *what) {
    cudaStream_t st = (cudaStream_t)bie_cuda_current_stream();
    BIE_TRY(bie_cbw_cuda_ok(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, st), module, what));
    return bie_cbw_cuda_ok(cudaStreamSynchronize(st), module, what);
}

bie_status bie_cbw_upload(const bie_cuda_bw *d, void **dst, const void *src, size_t bytes,
                          const char *what) {
    *dst = NULL;
    if (src == NULL) return BIE_OK;
    BIE_TRY(bie_cbw_alloc(dst, bytes, d->module, what));
    bie_status st = bie_cbw_copy_sync(*dst, src, bytes, d->module, what);
    if (st != BIE_OK) {
        bie_cbw_free_ptr(*dst);
        *dst = NULL;
    }
    return st;
}

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f)
        bits = sign | 0x7f800000u | (man << 13);
    else if (exp != 0)
        bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (man == 0)
        bits = sign;
    else {
        int e = 113;
        while (!(man & 0x400)) {
            man <<= 1;
            e--;
        }
        bits = sign | ((uint32_t)e << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

bie_status bie_cbw_to_host_f32(const bie_cuda_bw *d, bie_dtype dtype, const void *src, size_t n,
                               float *dst) {
    if (dtype == BIE_F32)
        return bie_cbw_copy_sync(dst, src, n * sizeof(float), d->module, "weight to host");
    uint16_t *h = malloc(n * sizeof(uint16_t));
    if (h == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: host staging", d->module);
    bie_status st = bie_cbw_copy_sync(h, src, n * sizeof(uint16_t), d->module, "weight to host");
    for (size_t i = 0; st == BIE_OK && i < n; i++) {
        if (dtype == BIE_BF16) {
            uint32_t bits = (uint32_t)h[i] << 16;
            memcpy(&dst[i], &bits, sizeof bits);
        } else {
            dst[i] = half_to_float(h[i]);
        }
    }
    free(h);
    return st;
}

/* ---------------------------------------------------------------- life cycle */

bie_status bie_cbw_create(bie_cuda_bw *d, int device, int64_t rows, int64_t cols, int64_t bias_len,
                          const char *module) {
    memset(d, 0, sizeof *d);
    d->device = device;
    d->rows = rows;
    d->cols = cols;
    d->bias_len = bias_len;
    d->module = module;
    if (bie_cuda_device_count() <= device || device < 0)
        return bie_fail(BIE_ERR_DEVICE, "%s: no CUDA device %d", module, device);
    BIE_TRY(bie_cbw_cuda_ok(cudaSetDevice(device), module, "cudaSetDevice"));
    const float init[4] = {0.0f, 1.0f, 0.0f, 1.0f};
    bie_status st;
    const size_t bias_bytes = (size_t)bias_len * sizeof(float);
    if ((st = bie_cbw_alloc((void **)&d->bias_a, bias_bytes, module, "bias_a")) != BIE_OK ||
        (st = bie_cbw_cuda_ok(cudaMemset(d->bias_a, 0, bias_bytes), module, "bias_a")) != BIE_OK ||
        (st = bie_cbw_cuda_ok(cudaDeviceSynchronize(), module, "bias_a")) != BIE_OK ||
        (st = bie_cbw_alloc((void **)&d->scalars, sizeof init, module, "scales")) != BIE_OK ||
        (st = bie_cbw_copy_sync(d->scalars, init, sizeof init, module, "scales")) != BIE_OK) {
        bie_cbw_free(d);
        return st;
    }
    return BIE_OK;
}

void bie_cbw_free(bie_cuda_bw *d) {
    bie_cbw_free_ptr(d->w_f32);
    bie_cbw_free_ptr(d->w_i8);
    bie_cbw_free_ptr(d->qweight);
    bie_cbw_free_ptr(d->bias_a);
    bie_cbw_free_ptr(d->scalars);
    bie_cbw_free_ptr(d->g_w);
    bie_cbw_free_ptr(d->g_w_i8);
    bie_cbw_free_ptr(d->g_bias);
    bie_cbw_free_ptr(d->g_scale);
    const char *module = d->module;
    memset(d, 0, sizeof *d);
    d->module = module;
}

/* ---------------------------------------------------------------- views and checks */

bie_status bie_cbw_view(int device, bie_tensor *v, void *data, bie_dtype dt, int ndim,
                        const int64_t *shape) {
    BIE_TRY(bie_tensor_view(v, data, dt, ndim, shape));
    v->device.type = BIE_DEVICE_CUDA;
    v->device.index = device;
    return BIE_OK;
}

bie_status bie_cbw_param_common(bie_cuda_bw *d, bie_param which, int wndim, const int64_t *wshape,
                                bie_tensor *v) {
    const int64_t one = 1;
    switch (which) {
    case BIE_PARAM_WEIGHT:
        if (d->w_i8) return bie_cbw_view(d->device, v, d->w_i8, BIE_I8, wndim, wshape);
        if (d->w_f32) return bie_cbw_view(d->device, v, d->w_f32, BIE_F32, wndim, wshape);
        return bie_bw_no_weight(d->module);
    case BIE_PARAM_BIAS_A: return bie_cbw_view(d->device, v, d->bias_a, BIE_F32, 1, &d->bias_len);
    case BIE_PARAM_SCALE_A:
        return bie_cbw_view(d->device, v, d->scalars + BIE_CBW_SCALE_A, BIE_F32, 1, &one);
    case BIE_PARAM_SCALE_W:
        return bie_cbw_view(d->device, v, d->scalars + BIE_CBW_SCALE_W, BIE_F32, 1, &one);
    default: break;
    }
    return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: parameter %d does not exist", d->module,
                    (int)which);
}

bie_status bie_cbw_grad(bie_cuda_bw *d, bie_param which, int wndim, const int64_t *wshape,
                        bie_tensor *v) {
    const int64_t one = 1;
    if (!d->has_grads)
        return bie_fail(BIE_ERR_STATE, "%s: no gradients yet (run backward first)", d->module);
    const bool f32_target = d->g_w_target && d->g_w_target_dtype == BIE_F32;
    switch (which) {
    case BIE_PARAM_WEIGHT:
        if (d->g_w_target)
            return bie_cbw_view(d->device, v, d->g_w_target, d->g_w_target_dtype, wndim, wshape);
        if (d->g_w_i8) return bie_cbw_view(d->device, v, d->g_w_i8, BIE_I8, wndim, wshape);
        return bie_cbw_view(d->device, v, d->g_w, BIE_F32, wndim, wshape);
    case BIE_PARAM_WEIGHT_FLOAT_GRAD:
        return bie_cbw_view(d->device, v, f32_target ? d->g_w_target : d->g_w, BIE_F32, wndim,
                            wshape);
    case BIE_PARAM_BIAS_A: return bie_cbw_view(d->device, v, d->g_bias, BIE_F32, 1, &d->bias_len);
    case BIE_PARAM_SCALE_A: return bie_cbw_view(d->device, v, d->g_scale, BIE_F32, 1, &one);
    default: break;
    }
    return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: parameter %d has no gradient", d->module,
                    (int)which);
}

bie_status bie_cbw_reserve_grads(bie_cuda_bw *d, void *target) {
    const size_t n = (size_t)(d->rows * d->cols);
    /* the float gradient: the target's place for a float weight, the layer's own for an int8
     * one (the int8 quantization reads it; WEIGHT_FLOAT_GRAD views it) */
    if (d->g_w == NULL && (d->w_i8 || target == NULL))
        BIE_TRY(bie_cbw_alloc((void **)&d->g_w, n * sizeof(float), d->module, "grad weight"));
    if (d->g_bias == NULL)
        BIE_TRY(bie_cbw_alloc((void **)&d->g_bias, (size_t)d->bias_len * sizeof(float), d->module,
                              "grad bias_a"));
    if (d->g_scale == NULL)
        BIE_TRY(bie_cbw_alloc((void **)&d->g_scale, sizeof(float), d->module, "grad scale_a"));
    if (d->w_i8 && d->g_w_i8 == NULL && target == NULL)
        BIE_TRY(bie_cbw_alloc((void **)&d->g_w_i8, n, d->module, "grad weight"));
    if (!d->w_i8) {
        bie_cbw_free_ptr(d->g_w_i8);
        d->g_w_i8 = NULL;
    }
    d->out_w = d->w_i8 || target == NULL ? d->g_w : (float *)target;
    d->out_w_i8 = d->w_i8 ? (target ? (int8_t *)target : d->g_w_i8) : NULL;
    d->out_target = target;
    return BIE_OK;
}

void bie_cbw_grads_done(bie_cuda_bw *d) {
    d->has_grads = true;
    d->g_w_target = d->out_target;
    d->g_w_target_dtype = d->w_i8 ? BIE_I8 : BIE_F32;
    d->out_target = NULL;
}

bie_status bie_cbw_set_scale_a(bie_cuda_bw *d, float scale_a) {
    BIE_TRY(bie_cbw_copy_sync(d->scalars + BIE_CBW_SCALE_A, &scale_a, sizeof scale_a, d->module,
                              "scale_a upload"));
    d->scale_a_known = scale_a != 0.0f;
    return BIE_OK;
}

bie_status bie_cbw_read_scale_a(bie_cuda_bw *d, float *scale_a) {
    BIE_TRY(bie_cbw_copy_sync(scale_a, d->scalars + BIE_CBW_SCALE_A, sizeof *scale_a, d->module,
                              "scale_a read back"));
    d->scale_a_known = *scale_a != 0.0f;
    return BIE_OK;
}

bie_status bie_cbw_scale_a_known(bie_cuda_bw *d, bool *known) {
    float v;
    if (!d->scale_a_known) BIE_TRY(bie_cbw_read_scale_a(d, &v));
    *known = d->scale_a_known;
    return BIE_OK;
}

bie_status bie_cbw_ensure_scale_a(bie_cuda_bw *d, bie_dtype dtype, const void *x, int64_t n,
                                  double factor, const char *who) {
    bool known;
    BIE_TRY(bie_cbw_scale_a_known(d, &known));
    if (known) return BIE_OK;
    double sum = 0;
    BIE_TRY(bie_cuda_abs_sum(dtype, x, n, &sum));
    const double mean = sum / (double)n;
    float v = (float)(factor * sum / (double)n);
    if (!isfinite(v) || v <= 0)
        return bie_fail(BIE_ERR_NOT_FINITE,
                        "%s: cannot initialise scale_a from this input "
                        "(mean|x| = %g): it must be positive and finite",
                        who, mean);
    return bie_cbw_set_scale_a(d, v);
}

bie_status bie_cbw_save_scales(bie_cuda_bw *d) {
    cudaStream_t st = (cudaStream_t)bie_cuda_current_stream();
    return bie_cbw_cuda_ok(cudaMemcpyAsync(d->scalars + BIE_CBW_SAVED_SCALES, d->scalars,
                                           2 * sizeof(float), cudaMemcpyDeviceToDevice, st),
                           d->module, "saved scales");
}

bie_status bie_cbw_on_device(int device, const bie_tensor *t, const char *what, const char *who,
                             bie_tensor *host) {
    if (t == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: %s is NULL", who, what);
    if (t->device.type != BIE_DEVICE_CUDA || t->device.index != device)
        return bie_fail(BIE_ERR_DEVICE, "%s: %s must be on CUDA device %d (the layer's device)",
                        who, what, device);
    *host = *t;
    host->device = bie_cpu();
    return BIE_OK;
}

bie_status bie_cbw_check_tensor(int device, const bie_tensor *t, const char *what, bie_dtype dtype,
                                int64_t last, const bie_tensor *like, const char *who) {
    if (t != NULL && t->data == NULL)
        return bie_fail(BIE_ERR_NULL_POINTER, "%s: %s has no data", who, what);
    bie_tensor host;
    BIE_TRY(bie_cbw_on_device(device, t, what, who, &host));
    return bie_check_rows_tensor(&host, what, dtype, last, like, who);
}

bie_status bie_cbw_check_shape4(int device, const bie_tensor *t, bie_dtype dtype,
                                const int64_t *shape, const char *what, const char *who) {
    bie_tensor host;
    BIE_TRY(bie_cbw_on_device(device, t, what, who, &host));
    return bie_conv_check_shape4_as(&host, dtype, shape, what, who);
}

bie_status bie_cuda_layer_state(bie_layer *l, size_t size, const char *module) {
    bie_cuda_bw *d = calloc(1, size);
    if (d == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: layer", module);
    bie_status st = bie_cbw_create(d, l->device.index, l->out, l->fan_in, l->in, module);
    if (st != BIE_OK) {
        free(d);
        return st;
    }
    l->backend = d;
    return BIE_OK;
}

void bie_cuda_layer_state_free(bie_layer *l) {
    if (l->backend == NULL) return;
    bie_cbw_free((bie_cuda_bw *)l->backend);
    free(l->backend);
    l->backend = NULL;
}
