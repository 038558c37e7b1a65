/* The binary weight format (binary_weight.h) and what the layers share about weights, scales,
 * gradients and tensor checks. */
#include "binary_weight.h"
#include "../core/device.h"

#include <math.h>
#include <string.h>

#include "../cpu/frame/pack.h"

void bie_bw_init(bie_binary_weight *w, int64_t rows, int64_t cols) {
    memset(w, 0, sizeof *w);
    w->rows = rows;
    w->cols = cols;
    w->word_bits = 8;
    w->scale_w = 1.0f;
}

void bie_bw_free(bie_binary_weight *w) {
    bie_free_aligned(w->f32);
    bie_free_aligned(w->i8);
    bie_free_aligned(w->qweight);
    w->f32 = NULL;
    w->i8 = NULL;
    w->qweight = NULL;
}

bool bie_bw_has_training_weight(const bie_binary_weight *w) { return w->f32 || w->i8; }

bie_dtype bie_bw_word_dtype(int word_bits) {
    return word_bits == 8 ? BIE_U8 : word_bits == 32 ? BIE_U32 : BIE_U64;
}

bie_status bie_bw_no_weight(const char *who) {
    return bie_fail(BIE_ERR_STATE,
                    "%s: the layer has no weight (freed by "
                    "generate_quantized_weight(qweight_only)): it is inference-only",
                    who);
}

static uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

bie_status bie_bw_reset(bie_binary_weight *w, uint64_t seed) {
    int64_t n = w->rows * w->cols;
    float *f = bie_alloc_aligned((size_t)n * sizeof(float));
    if (f == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "reset_parameters: weight");
    /* kaiming_uniform_(a = sqrt(5)): gain sqrt(2 / (1 + 5)), bound gain * sqrt(3 / fan_in)
     * = 1 / sqrt(fan_in). */
    double bound = 1.0 / sqrt((double)w->cols);
    uint64_t s = seed;
    for (int64_t i = 0; i < n; i++) {
        double u = (double)(splitmix64(&s) >> 11) * (1.0 / 9007199254740992.0);
        f[i] = (float)((2.0 * u - 1.0) * bound);
    }
    bie_bw_free(w);
    w->f32 = f;
    return BIE_OK;
}

/* scale_w = mean|w|; int8 quantization of w - mean(w) with zeros replaced by the sign. */
static bie_status quantize_weight(const float *f, int64_t n, int8_t **q_out, float *scale_w,
                                  const char *who) {
    double sum = 0, sum_abs = 0;
    for (int64_t i = 0; i < n; i++) {
        sum += f[i];
        sum_abs += fabs((double)f[i]);
    }
    float sw = (float)(sum_abs / (double)n);
    if (!isfinite(sw) || sw <= 0)
        return bie_fail(BIE_ERR_NOT_FINITE,
                        "%s: scale_w = mean|w| = %g is not a positive finite "
                        "number (all-zero or non-finite weight)",
                        who, (double)sw);
    int8_t *q = bie_alloc_aligned((size_t)n);
    if (q == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: int8 weight", who);
    double mean = sum / (double)n, amax = 0;
    for (int64_t i = 0; i < n; i++) amax = fmax(amax, fabs((double)f[i] - mean));
    for (int64_t i = 0; i < n; i++) {
        double wc = (double)f[i] - mean;
        double v = amax > 0 ? nearbyint(wc * 127.0 / amax) : 0.0;
        v = v > 127 ? 127 : v < -127 ? -127 : v;
        q[i] = v != 0 ? (int8_t)v : (wc >= 0 ? 1 : -1);
    }
    *q_out = q;
    *scale_w = sw;
    return BIE_OK;
}

bie_status bie_bw_prepare(bie_binary_weight *w, const char *who) {
    if (w->i8) return BIE_OK; /* already prepared */
    if (w->f32 == NULL) return bie_bw_no_weight(who);
    int8_t *q;
    float sw;
    BIE_TRY(quantize_weight(w->f32, w->rows * w->cols, &q, &sw, who));
    bie_free_aligned(w->f32);
    w->f32 = NULL;
    w->i8 = q;
    w->scale_w = sw;
    return BIE_OK;
}

bie_status bie_bw_set_data(bie_binary_weight *w, const float *data, const char *who) {
    int64_t n = w->rows * w->cols;
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(data[i]))
            return bie_fail(BIE_ERR_NOT_FINITE, "%s: weight has non-finite values", who);
    int8_t *q;
    float sw;
    BIE_TRY(quantize_weight(data, n, &q, &sw, who));
    bie_bw_free(w);
    w->i8 = q;
    w->scale_w = sw;
    return BIE_OK;
}

bie_status bie_bw_pack(const bie_binary_weight *w, int64_t row_bytes, uint8_t **out,
                       const char *who) {
    if (!bie_bw_has_training_weight(w)) return bie_bw_no_weight(who);
    uint8_t *q = bie_alloc_aligned((size_t)(w->rows * row_bytes));
    if (q == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: packed weight", who);
    if (w->i8)
        bie_pack_i8_rows(w->i8, w->rows, w->cols, q, row_bytes);
    else
        bie_pack_f32_rows(w->f32, w->rows, w->cols, w->cols, NULL, q, row_bytes, NULL, 1, 0, 0);
    *out = q;
    return BIE_OK;
}

bie_status bie_bw_generate_qweight(bie_binary_weight *w, bool qweight_only, const char *who) {
    if (!bie_bw_has_training_weight(w)) {
        if (w->qweight) return BIE_OK; /* already packed and weight-free */
        return bie_bw_no_weight(who);
    }
    uint8_t *q = NULL;
    BIE_TRY(bie_bw_pack(w, bie_packed_row_bytes(w->cols, w->word_bits), &q, who));
    bie_free_aligned(w->qweight);
    w->qweight = q;
    if (qweight_only) {
        bie_free_aligned(w->f32);
        bie_free_aligned(w->i8);
        w->f32 = NULL;
        w->i8 = NULL;
    }
    return BIE_OK;
}

/* Copy packed rows between word sizes' paddings; padding bytes and bits end up zero. */
static void copy_rows(const bie_binary_weight *w, const uint8_t *src, int64_t src_rb, uint8_t *dst,
                      int64_t dst_rb) {
    int64_t nb = (w->cols + 7) / 8;
    for (int64_t r = 0; r < w->rows; r++) {
        uint8_t *row = dst + r * dst_rb;
        memcpy(row, src + r * src_rb, (size_t)nb);
        row[nb - 1] &= bie_tail_mask(w->cols);
        memset(row + nb, 0, (size_t)(dst_rb - nb));
    }
}

bie_status bie_bw_set_qweight(bie_binary_weight *w, const void *q, const char *who) {
    int64_t rb = bie_packed_row_bytes(w->cols, w->word_bits);
    uint8_t *copy = bie_alloc_aligned((size_t)(w->rows * rb));
    if (copy == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: qweight", who);
    copy_rows(w, q, rb, copy, rb);
    bie_free_aligned(w->qweight);
    w->qweight = copy;
    return BIE_OK;
}

bie_status bie_bw_set_word_bits(bie_binary_weight *w, int bits, const char *who) {
    if (!bie_word_bits_ok(bits))
        return bie_fail(BIE_ERR_INVALID_ARGUMENT,
                        "%s: bits_binary_word must be 8, 32 or 64 (got %d)", who, bits);
    if (bits == w->word_bits) return BIE_OK;
    if (w->qweight) { /* same bit stream, new row padding */
        int64_t old_rb = bie_packed_row_bytes(w->cols, w->word_bits);
        int64_t new_rb = bie_packed_row_bytes(w->cols, bits);
        uint8_t *q = bie_alloc_aligned((size_t)(w->rows * new_rb));
        if (q == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: qweight", who);
        copy_rows(w, w->qweight, old_rb, q, new_rb);
        bie_free_aligned(w->qweight);
        w->qweight = q;
    }
    w->word_bits = bits;
    return BIE_OK;
}

bie_status bie_activation_scale(float current, const float *x, int64_t n, double factor,
                                const char *who, float *scale) {
    if (current != 0.0f) {
        *scale = current;
        return BIE_OK;
    }
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += fabs((double)x[i]);
    float v = (float)(factor * s / (double)n);
    if (!isfinite(v) || v <= 0)
        return bie_fail(BIE_ERR_NOT_FINITE,
                        "%s: cannot initialise scale_a from this input "
                        "(mean|x| = %g): it must be positive and finite",
                        who, s / (double)n);
    *scale = v;
    return BIE_OK;
}

void bie_quantize_i8(const float *x, int64_t n, int8_t *q) {
    float amax = 0;
#pragma omp parallel for num_threads(bie_threads()) reduction(max : amax) if (n > 65536)
    for (int64_t i = 0; i < n; i++) amax = amax > fabsf(x[i]) ? amax : fabsf(x[i]);
#pragma omp parallel for num_threads(bie_threads()) if (n > 65536)
    for (int64_t i = 0; i < n; i++) {
        float v = amax > 0 ? rintf(x[i] * 127.0f / amax) : 0.0f;
        q[i] = (int8_t)(v > 127 ? 127 : v < -127 ? -127 : v);
    }
}

bie_status bie_check_rows_tensor(const bie_tensor *t, const char *what, bie_dtype dtype,
                                 int64_t last, const bie_tensor *like, const char *who) {
    if (t == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: %s is NULL", who, what);
    if (t->data == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: %s has no data", who, what);
    if (t->device.type != BIE_DEVICE_CPU)
        return bie_fail(BIE_ERR_DEVICE, "%s: %s is not on the CPU", who, what);
    if (t->dtype != dtype)
        return bie_fail(BIE_ERR_DTYPE, "%s: %s has dtype %s, expected %s", who, what,
                        bie_dtype_name(t->dtype), bie_dtype_name(dtype));
    if (t->ndim < 1 || t->ndim > BIE_MAX_DIMS)
        return bie_fail(BIE_ERR_SHAPE, "%s: %s has rank %d, expected 1..4", who, what, t->ndim);
    for (int i = 0; i < t->ndim; i++)
        if (t->shape[i] < 1)
            return bie_fail(BIE_ERR_SHAPE, "%s: %s has extent %lld at dim %d (must be >= 1)", who,
                            what, (long long)t->shape[i], i);
    if (bie_tensor_numel(t) < 0)
        return bie_fail(BIE_ERR_OVERFLOW, "%s: %s element count overflows", who, what);
    if (t->shape[t->ndim - 1] != last)
        return bie_fail(BIE_ERR_SHAPE, "%s: %s last extent is %lld, expected %lld", who, what,
                        (long long)t->shape[t->ndim - 1], (long long)last);
    if (like) {
        if (like->ndim != t->ndim)
            return bie_fail(BIE_ERR_SHAPE, "%s: %s has rank %d, expected %d", who, what, t->ndim,
                            like->ndim);
        for (int i = 0; i + 1 < t->ndim; i++)
            if (t->shape[i] != like->shape[i])
                return bie_fail(BIE_ERR_SHAPE, "%s: %s extent %d is %lld, expected %lld", who, what,
                                i, (long long)t->shape[i], (long long)like->shape[i]);
    }
    return BIE_OK;
}

float *bie_layer_bias_alloc(int64_t n) {
    float *b = bie_alloc_aligned((size_t)n * sizeof(float));
    if (b) memset(b, 0, (size_t)n * sizeof(float));
    return b;
}

bie_status bie_check_scale_a(float scale_a, const char *who) {
    if (!isfinite(scale_a) || scale_a < 0)
        return bie_fail(BIE_ERR_NOT_FINITE, "%s: scale_a must be finite and >= 0 (got %g)", who,
                        (double)scale_a);
    return BIE_OK;
}

void bie_grads_free(bie_layer_grads *g) {
    bie_free_aligned(g->w);
    bie_free_aligned(g->w_i8);
    bie_free_aligned(g->bias_a);
    memset(g, 0, sizeof *g);
}

void bie_grads_install(bie_layer_grads *g, float *w, int8_t *w_i8, float *bias_a, float scale_a) {
    bie_grads_free(g);
    g->w = w;
    g->w_i8 = w_i8;
    g->bias_a = bias_a;
    g->scale_a = scale_a;
    g->present = true;
}

bie_status bie_grads_view(bie_layer_grads *g, bie_param which, int wndim, const int64_t *wshape,
                          const int64_t *bias_len, bie_tensor *v, const char *who) {
    if (v == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: 'view' is NULL", who);
    if (!g->present) return bie_fail(BIE_ERR_STATE, "%s: no gradients yet (run backward)", who);
    const int64_t one = 1;
    switch (which) {
    case BIE_PARAM_WEIGHT:
        if (g->w_i8) return bie_tensor_view(v, g->w_i8, BIE_I8, wndim, wshape);
        return bie_tensor_view(v, g->w, BIE_F32, wndim, wshape);
    case BIE_PARAM_WEIGHT_FLOAT_GRAD: return bie_tensor_view(v, g->w, BIE_F32, wndim, wshape);
    case BIE_PARAM_BIAS_A: return bie_tensor_view(v, g->bias_a, BIE_F32, 1, bias_len);
    case BIE_PARAM_SCALE_A: return bie_tensor_view(v, &g->scale_a, BIE_F32, 1, &one);
    default: break;
    }
    return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: parameter %d has no gradient", who, (int)which);
}

bie_status bie_layer_check_device(bie_device device, bie_dtype dtype, const char *who) {
    if (device.type == BIE_DEVICE_CUDA && bie_device_get(device.type) == NULL)
        return bie_fail(BIE_ERR_DEVICE, "%s: this build has no CUDA backend", who);
    if (device.type != BIE_DEVICE_CPU && device.type != BIE_DEVICE_CUDA)
        return bie_fail(BIE_ERR_DEVICE, "%s: unknown device type %d", who, (int)device.type);
    if (device.type == BIE_DEVICE_CPU && dtype != BIE_F32)
        return bie_fail(BIE_ERR_DTYPE, "%s: dtype %s is not supported on the CPU (float32 only)",
                        who, bie_dtype_name(dtype));
    if (dtype != BIE_F32 && dtype != BIE_BF16 && dtype != BIE_F16)
        return bie_fail(BIE_ERR_DTYPE,
                        "%s: dtype %s is not a float type (float32, bfloat16, "
                        "float16 on CUDA)",
                        who, bie_dtype_name(dtype));
    return BIE_OK;
}
