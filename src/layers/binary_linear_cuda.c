/* The binary linear layer on CUDA (SPEC §2). The parameters live in device memory, so an
 * optimizer updates them in place through bie_binary_linear_param views; scale_a and scale_w
 * are device scalars that the kernels read, which keeps the forward free of host syncs.
 *
 * Life-cycle calls that are rare and not on the hot path (reset, set_weight_data, prepare,
 * generate/set qweight, word size) reuse the CPU weight code: the weight is staged to the
 * host, changed there, and uploaded; the device copy changes only when all of that worked. */
#include <cuda_runtime_api.h>
#include <math.h>
#include <string.h>

#include "../cuda/cuda_internal.h"
#include "bie_cuda.h"
#include "binary_linear_cuda.h"

struct bie_bl_cuda {
    int64_t ld; /* GEMM-layout row bytes for in_features bits */
    int parts;  /* popcount slices per row */
    /* Parameters. */
    float *w_f32;      /* training weight before prepare_params, or NULL */
    int8_t *w_i8;      /* training weight after prepare_params, or NULL */
    void *qweight;     /* packed weight in the user format [out, words], or NULL */
    uint8_t *qbits;    /* the packed weight in the GEMM layout (inference), or NULL */
    int *qpopc;
    float *bias_a;     /* [in] */
    float *scalars;    /* scale_a, scale_w, and the forward's {scale_a, scale_w} for backward */
    bool scale_a_known; /* scale_a is non-zero: set by the user or measured */
    /* Activations of the last forward (kept for the backward in training mode). */
    uint8_t *abits, *amask;
    int *apopc;
    int64_t a_cap; /* rows allocated */
    /* Weight bits of the last training forward. */
    uint8_t *wbits;
    int *wpopc;
    /* Gradients of the last backward. */
    bool has_grads;
    float *g_w, *g_bias, *g_scale;
    int8_t *g_w_i8;
};

enum { SCALE_A = 0, SCALE_W = 1, SAVED_SCALES = 2 };

static const char *const MODULE = "binary_linear (cuda)";

/* ---------------------------------------------------------------- device memory */

static bie_status cuda_ok(cudaError_t err, const char *what) {
    if (err == cudaSuccess) return BIE_OK;
    cudaGetLastError();
    return bie_fail(err == cudaErrorMemoryAllocation ? BIE_ERR_OUT_OF_MEMORY : BIE_ERR_CUDA,
                    "%s: %s: %s", MODULE, what, cudaGetErrorString(err));
}

static bie_status dev_alloc(void **p, size_t bytes, const char *what) {
    *p = NULL;
    return cuda_ok(cudaMalloc(p, bytes ? bytes : 1), what);
}

static void dev_free(void *p) {
    if (p) cudaFree(p);
}

#define DEV_FREE(p)                                                                            \
    do {                                                                                       \
        dev_free(p);                                                                           \
        (p) = NULL;                                                                            \
    } while (0)

/* Copies and waits on the current stream (the one every launch of the calling thread uses). */
static bie_status copy_sync(void *dst, const void *src, size_t bytes, const char *what) {
    cudaStream_t st = (cudaStream_t)bie_cuda_current_stream();
    BIE_TRY(cuda_ok(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, st), what));
    return cuda_ok(cudaStreamSynchronize(st), what);
}

static size_t weight_count(const bie_binary_linear *l) { return (size_t)(l->in * l->out); }
static size_t qweight_bytes(const bie_binary_linear *l) {
    return (size_t)l->out * (size_t)bie_packed_row_bytes(l->in, l->w.word_bits);
}

/* ---------------------------------------------------------------- host staging */

/* Copy the device weight buffers into l->w's host buffers. */
static bie_status stage_down(bie_binary_linear *l) {
    struct bie_bl_cuda *c = l->cuda;
    bie_binary_weight *w = &l->w;
    const size_t n = weight_count(l);
    bie_status st = BIE_OK;
    if (c->w_f32 && (w->f32 = bie_alloc_aligned(n * sizeof(float))) == NULL) goto oom;
    if (c->w_i8 && (w->i8 = bie_alloc_aligned(n)) == NULL) goto oom;
    if (c->qweight && (w->qweight = bie_alloc_aligned(qweight_bytes(l))) == NULL) goto oom;
    if (c->w_f32 && (st = copy_sync(w->f32, c->w_f32, n * sizeof(float), "weight to host")) != BIE_OK) goto fail;
    if (c->w_i8 && (st = copy_sync(w->i8, c->w_i8, n, "weight to host")) != BIE_OK) goto fail;
    if (c->qweight && (st = copy_sync(w->qweight, c->qweight, qweight_bytes(l), "qweight to host")) != BIE_OK)
        goto fail;
    return BIE_OK;
oom:
    st = bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: host staging of the weight", MODULE);
fail:
    bie_bw_free(w);
    return st;
}

/* Upload l->w's host buffers as the new device weight (replacing the old buffers only when
 * every allocation and copy worked), rebuild the inference cache, free the host buffers. */
static bie_status stage_up(bie_binary_linear *l) {
    struct bie_bl_cuda *c = l->cuda;
    bie_binary_weight *w = &l->w;
    const size_t n = weight_count(l);
    float *f32 = NULL;
    int8_t *i8 = NULL;
    void *q = NULL;
    uint8_t *qbits = NULL;
    int *qpopc = NULL;
    bie_status st = BIE_OK;
    if (w->f32 && ((st = dev_alloc((void **)&f32, n * sizeof(float), "weight")) != BIE_OK ||
                   (st = copy_sync(f32, w->f32, n * sizeof(float), "weight upload")) != BIE_OK))
        goto fail;
    if (w->i8 && ((st = dev_alloc((void **)&i8, n, "weight")) != BIE_OK ||
                  (st = copy_sync(i8, w->i8, n, "weight upload")) != BIE_OK))
        goto fail;
    if (w->qweight) {
        const int64_t rb = bie_packed_row_bytes(l->in, w->word_bits);
        if ((st = dev_alloc(&q, qweight_bytes(l), "qweight")) != BIE_OK ||
            (st = copy_sync(q, w->qweight, qweight_bytes(l), "qweight upload")) != BIE_OK ||
            (st = dev_alloc((void **)&qbits, (size_t)(l->out * c->ld), "qweight bits")) != BIE_OK ||
            (st = dev_alloc((void **)&qpopc, (size_t)(l->out * c->parts) * sizeof(int), "qweight bits")) != BIE_OK ||
            (st = bie_cuda_repack_rows(q, rb, l->out, l->in, c->ld, qbits, qpopc)) != BIE_OK ||
            (st = cuda_ok(cudaStreamSynchronize((cudaStream_t)bie_cuda_current_stream()), "qweight repack")) != BIE_OK)
            goto fail;
    }
    if ((st = copy_sync(c->scalars + SCALE_W, &w->scale_w, sizeof(float), "scale_w upload")) != BIE_OK) goto fail;
    dev_free(c->w_f32);
    dev_free(c->w_i8);
    dev_free(c->qweight);
    dev_free(c->qbits);
    dev_free(c->qpopc);
    c->w_f32 = f32;
    c->w_i8 = i8;
    c->qweight = q;
    c->qbits = qbits;
    c->qpopc = qpopc;
    bie_bw_free(w);
    return BIE_OK;
fail:
    dev_free(f32);
    dev_free(i8);
    dev_free(q);
    dev_free(qbits);
    dev_free(qpopc);
    bie_bw_free(w);
    return st;
}

/* ---------------------------------------------------------------- life cycle */

bie_status bie_blc_create(bie_binary_linear *l) {
    if (bie_cuda_device_count() <= l->device.index || l->device.index < 0)
        return bie_fail(BIE_ERR_DEVICE, "%s: no CUDA device %d", MODULE, l->device.index);
    BIE_TRY(cuda_ok(cudaSetDevice(l->device.index), "cudaSetDevice"));
    struct bie_bl_cuda *c = calloc(1, sizeof *c);
    if (c == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: layer", MODULE);
    c->ld = bie_cuda_row_stride(l->in);
    c->parts = bie_cuda_popc_parts(c->ld);
    l->cuda = c;
    const float init[4] = {0.0f, 1.0f, 0.0f, 1.0f};
    bie_status st;
    if ((st = dev_alloc((void **)&c->bias_a, (size_t)l->in * sizeof(float), "bias_a")) != BIE_OK ||
        (st = cuda_ok(cudaMemset(c->bias_a, 0, (size_t)l->in * sizeof(float)), "bias_a")) != BIE_OK ||
        (st = cuda_ok(cudaDeviceSynchronize(), "bias_a")) != BIE_OK ||
        (st = dev_alloc((void **)&c->scalars, sizeof init, "scales")) != BIE_OK ||
        (st = copy_sync(c->scalars, init, sizeof init, "scales")) != BIE_OK ||
        (st = dev_alloc((void **)&c->wbits, (size_t)(l->out * c->ld), "weight bits")) != BIE_OK ||
        (st = dev_alloc((void **)&c->wpopc, (size_t)(l->out * c->parts) * sizeof(int), "weight bits")) != BIE_OK) {
        bie_blc_free(l);
        return st;
    }
    return BIE_OK;
}

void bie_blc_drop_saved(bie_binary_linear *l) { l->has_saved = false; }

static void free_activations(struct bie_bl_cuda *c) {
    DEV_FREE(c->abits);
    DEV_FREE(c->amask);
    DEV_FREE(c->apopc);
    c->a_cap = 0;
}

void bie_blc_free(bie_binary_linear *l) {
    struct bie_bl_cuda *c = l->cuda;
    if (c == NULL) return;
    free_activations(c);
    dev_free(c->w_f32);
    dev_free(c->w_i8);
    dev_free(c->qweight);
    dev_free(c->qbits);
    dev_free(c->qpopc);
    dev_free(c->bias_a);
    dev_free(c->scalars);
    dev_free(c->wbits);
    dev_free(c->wpopc);
    dev_free(c->g_w);
    dev_free(c->g_w_i8);
    dev_free(c->g_bias);
    dev_free(c->g_scale);
    free(c);
    l->cuda = NULL;
}

bie_status bie_blc_reset(bie_binary_linear *l, uint64_t seed) {
    BIE_TRY(bie_bw_reset(&l->w, seed)); /* host weight: a fresh float one */
    BIE_TRY(stage_up(l));
    l->has_saved = false;
    return BIE_OK;
}

bie_status bie_blc_prepare(bie_binary_linear *l) {
    if (l->cuda->w_f32 == NULL) {
        if (l->cuda->w_i8) return BIE_OK; /* already int8 */
        return bie_bw_no_weight("binary_linear_prepare_params");
    }
    BIE_TRY(stage_down(l));
    bie_status st = bie_bw_prepare(&l->w, "binary_linear_prepare_params");
    if (st != BIE_OK) {
        bie_bw_free(&l->w);
        return st;
    }
    BIE_TRY(stage_up(l));
    l->has_saved = false;
    return BIE_OK;
}

/* The device tensors a CUDA layer accepts: on its device, of this dtype, `last` columns. */
static bie_status check_device_rows(const bie_binary_linear *l, const bie_tensor *t, const char *what,
                                    bie_dtype dtype, int64_t last, const bie_tensor *like,
                                    const char *who) {
    if (t == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: %s is NULL", who, what);
    if (t->data == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: %s has no data", who, what);
    if (t->device.type != BIE_DEVICE_CUDA || t->device.index != l->device.index)
        return bie_fail(BIE_ERR_DEVICE, "%s: %s must be on CUDA device %d (the layer's device)", who,
                        what, l->device.index);
    bie_tensor host = *t;
    host.device = bie_cpu();
    return bie_check_rows_tensor(&host, what, dtype, last, like, who);
}

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) bits = sign | 0x7f800000u | (man << 13);
    else if (exp != 0) bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (man == 0) bits = sign;
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

/* Device tensor of the layer's dtype -> host float32 (n elements). */
static bie_status to_host_f32(const bie_binary_linear *l, const void *src, size_t n, float *dst) {
    if (l->dtype == BIE_F32) return copy_sync(dst, src, n * sizeof(float), "weight to host");
    uint16_t *h = malloc(n * sizeof(uint16_t));
    if (h == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: host staging", MODULE);
    bie_status st = copy_sync(h, src, n * sizeof(uint16_t), "weight to host");
    for (size_t i = 0; st == BIE_OK && i < n; i++) {
        if (l->dtype == BIE_BF16) {
            uint32_t bits = (uint32_t)h[i] << 16;
            memcpy(&dst[i], &bits, sizeof bits);
        } else {
            dst[i] = half_to_float(h[i]);
        }
    }
    free(h);
    return st;
}

bie_status bie_blc_set_weight_data(bie_binary_linear *l, const bie_tensor *w) {
    static const char *who = "binary_linear_set_weight_data";
    BIE_TRY(check_device_rows(l, w, "weight", l->dtype, l->in, NULL, who));
    if (w->ndim != 2 || w->shape[0] != l->out)
        return bie_fail(BIE_ERR_SHAPE, "%s: weight must be [%lld, %lld]", who, (long long)l->out,
                        (long long)l->in);
    float *host = bie_alloc_aligned(weight_count(l) * sizeof(float));
    if (host == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: host staging", who);
    bie_status st = to_host_f32(l, w->data, weight_count(l), host);
    if (st == BIE_OK) st = stage_down(l);
    if (st == BIE_OK) {
        st = bie_bw_set_data(&l->w, host, who);
        if (st == BIE_OK) st = stage_up(l);
        else bie_bw_free(&l->w);
    }
    bie_free_aligned(host);
    if (st == BIE_OK) l->has_saved = false;
    return st;
}

/* Stage down, run a host weight operation, stage up. */
static bie_status staged(bie_binary_linear *l, bie_status st) {
    if (st != BIE_OK) {
        bie_bw_free(&l->w);
        return st;
    }
    return stage_up(l);
}

bie_status bie_blc_generate_quantized_weight(bie_binary_linear *l, bool qweight_only) {
    BIE_TRY(stage_down(l));
    BIE_TRY(staged(l, bie_bw_generate_qweight(&l->w, qweight_only, "generate_quantized_weight")));
    if (qweight_only) l->has_saved = false;
    return BIE_OK;
}

bie_status bie_blc_set_quantized_weight_data(bie_binary_linear *l, const bie_tensor *q) {
    static const char *who = "binary_linear_set_quantized_weight_data";
    const int64_t words = bie_packed_words(l->in, l->w.word_bits);
    BIE_TRY(check_device_rows(l, q, "qweight", bie_bw_word_dtype(l->w.word_bits), words, NULL, who));
    if (q->ndim != 2 || q->shape[0] != l->out)
        return bie_fail(BIE_ERR_SHAPE, "%s: qweight must be [%lld, %lld]", who, (long long)l->out,
                        (long long)words);
    void *host = bie_alloc_aligned(qweight_bytes(l));
    if (host == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: host staging", who);
    bie_status st = copy_sync(host, q->data, qweight_bytes(l), "qweight to host");
    if (st == BIE_OK && (st = stage_down(l)) == BIE_OK)
        st = staged(l, bie_bw_set_qweight(&l->w, host, who));
    bie_free_aligned(host);
    return st;
}

bie_status bie_blc_set_bits(bie_binary_linear *l, int bits) {
    if (!bie_word_bits_ok(bits) || l->cuda->qweight == NULL) return bie_bw_set_word_bits(&l->w, bits, MODULE);
    BIE_TRY(stage_down(l));
    return staged(l, bie_bw_set_word_bits(&l->w, bits, MODULE));
}

static bie_status device_view(const bie_binary_linear *l, bie_tensor *v, void *data, bie_dtype dt,
                              int ndim, int64_t d0, int64_t d1) {
    int64_t shape[2] = {d0, d1};
    BIE_TRY(bie_tensor_view(v, data, dt, ndim, shape));
    v->device = l->device;
    return BIE_OK;
}

bie_status bie_blc_param(bie_binary_linear *l, bie_param which, bie_tensor *v) {
    struct bie_bl_cuda *c = l->cuda;
    switch (which) {
    case BIE_PARAM_WEIGHT:
        if (c->w_i8) return device_view(l, v, c->w_i8, BIE_I8, 2, l->out, l->in);
        if (c->w_f32) return device_view(l, v, c->w_f32, BIE_F32, 2, l->out, l->in);
        return bie_bw_no_weight("binary_linear_param");
    case BIE_PARAM_QWEIGHT:
        if (c->qweight == NULL)
            return bie_fail(BIE_ERR_STATE, "%s: no qweight yet (generate_quantized_weight)", MODULE);
        return device_view(l, v, c->qweight, bie_bw_word_dtype(l->w.word_bits), 2, l->out,
                           bie_packed_words(l->in, l->w.word_bits));
    case BIE_PARAM_BIAS_A: return device_view(l, v, c->bias_a, BIE_F32, 1, l->in, 0);
    case BIE_PARAM_SCALE_A: return device_view(l, v, c->scalars + SCALE_A, BIE_F32, 1, 1, 0);
    case BIE_PARAM_SCALE_W: return device_view(l, v, c->scalars + SCALE_W, BIE_F32, 1, 1, 0);
    case BIE_PARAM_WEIGHT_FLOAT_GRAD: break;
    }
    return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: parameter %d does not exist", MODULE, (int)which);
}

bie_status bie_blc_grad(bie_binary_linear *l, bie_param which, bie_tensor *v) {
    struct bie_bl_cuda *c = l->cuda;
    static const char *who = "binary_linear_grad";
    if (!c->has_grads) return bie_fail(BIE_ERR_STATE, "%s: no gradients yet (run backward first)", who);
    switch (which) {
    case BIE_PARAM_WEIGHT:
        if (c->g_w_i8) return device_view(l, v, c->g_w_i8, BIE_I8, 2, l->out, l->in);
        return device_view(l, v, c->g_w, BIE_F32, 2, l->out, l->in);
    case BIE_PARAM_WEIGHT_FLOAT_GRAD: return device_view(l, v, c->g_w, BIE_F32, 2, l->out, l->in);
    case BIE_PARAM_BIAS_A: return device_view(l, v, c->g_bias, BIE_F32, 1, l->in, 0);
    case BIE_PARAM_SCALE_A: return device_view(l, v, c->g_scale, BIE_F32, 1, 1, 0);
    default: break;
    }
    return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: parameter %d has no gradient", who, (int)which);
}

bie_status bie_blc_set_scale_a(bie_binary_linear *l, float scale_a) {
    BIE_TRY(copy_sync(l->cuda->scalars + SCALE_A, &scale_a, sizeof scale_a, "scale_a upload"));
    l->cuda->scale_a_known = scale_a != 0.0f;
    return BIE_OK;
}

bool bie_blc_has_qweight(const bie_binary_linear *l) { return l->cuda->qweight != NULL; }

/* ---------------------------------------------------------------- forward */

bie_status bie_blc_check_forward(const bie_binary_linear *l, const bie_tensor *x) {
    static const char *who = "binary_linear_check_forward";
    if (x == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: input is NULL", who);
    if (x->device.type != BIE_DEVICE_CUDA || x->device.index != l->device.index)
        return bie_fail(BIE_ERR_DEVICE, "%s: input must be on CUDA device %d (the layer's device)",
                        who, l->device.index);
    if (x->dtype == BIE_U8 || x->dtype == BIE_U32 || x->dtype == BIE_U64) {
        if (x->dtype != bie_bw_word_dtype(l->w.word_bits))
            return bie_fail(BIE_ERR_DTYPE, "%s: packed input is %s but bits_binary_word is %d", who,
                            bie_dtype_name(x->dtype), l->w.word_bits);
        return check_device_rows(l, x, "packed input", x->dtype, bie_packed_words(l->in, l->w.word_bits),
                                 NULL, who);
    }
    if (x->dtype != l->dtype)
        return bie_fail(BIE_ERR_DTYPE, "%s: input dtype %s differs from the layer's %s (or packed "
                        "words)", who, bie_dtype_name(x->dtype), bie_dtype_name(l->dtype));
    return check_device_rows(l, x, "input", l->dtype, l->in, NULL, who);
}

/* Measure scale_a on x when it is still 0 (SPEC §2: factor * mean|x|, before the shift). */
static bie_status ensure_scale_a(bie_binary_linear *l, const bie_tensor *x, const char *who) {
    if (l->cuda->scale_a_known) return BIE_OK;
    double sum = 0;
    const int64_t n = bie_tensor_numel(x);
    BIE_TRY(bie_cuda_abs_sum(x->dtype, x->data, n, &sum));
    const double mean = sum / (double)n;
    float v = (float)((l->symmetric ? 2.0 : 4.0) * sum / (double)n);
    if (!isfinite(v) || v <= 0)
        return bie_fail(BIE_ERR_NOT_FINITE, "%s: cannot initialise scale_a from this input "
                        "(mean|x| = %g): it must be positive and finite", who, mean);
    return bie_blc_set_scale_a(l, v);
}

bie_status bie_blc_set_activation(bie_binary_linear *l, const bie_tensor *x, bie_tensor *x_out) {
    static const char *who = "binary_linear_set_activation";
    BIE_TRY(check_device_rows(l, x, "input", l->dtype, l->in, NULL, who));
    if (x_out) BIE_TRY(check_device_rows(l, x_out, "output", l->dtype, l->in, x, who));
    BIE_TRY(ensure_scale_a(l, x, who));
    if (x_out == NULL) return BIE_OK;
    const int64_t m = bie_tensor_numel(x) / l->in;
    return bie_cuda_add_bias(l->dtype, x->data, m, l->in, l->cuda->bias_a, x_out->data);
}

/* Room for the packed activations of m rows (contents are not kept). */
static bie_status reserve_activations(bie_binary_linear *l, int64_t m) {
    struct bie_bl_cuda *c = l->cuda;
    if (m <= c->a_cap) return BIE_OK;
    l->has_saved = false;
    free_activations(c);
    BIE_TRY(dev_alloc((void **)&c->abits, (size_t)(m * c->ld), "packed activations"));
    BIE_TRY(dev_alloc((void **)&c->amask, (size_t)(m * c->ld), "activation mask"));
    /* Popcount slices: c->parts per row, or finer ones for up to 16 rows (see pack_act). */
    const size_t counts = (size_t)(m * c->parts + 16 * bie_cuda_act_popc_parts(1, c->ld));
    BIE_TRY(dev_alloc((void **)&c->apopc, counts * sizeof(int), "activation counts"));
    c->a_cap = m;
    return BIE_OK;
}

/* The packed weight the forward multiplies with: the training weight's signs, packed now
 * (the optimizer may have changed it), or the inference cache, built on first use. */
static bie_status forward_weight(bie_binary_linear *l, const uint8_t **bits, const int **popc) {
    struct bie_bl_cuda *c = l->cuda;
    const bool training = l->training;
    if (!training && c->qbits) {
        *bits = c->qbits;
        *popc = c->qpopc;
        return BIE_OK;
    }
    uint8_t *dst = c->wbits;
    int *dst_popc = c->wpopc;
    if (!training) {
        BIE_TRY(dev_alloc((void **)&c->qbits, (size_t)(l->out * c->ld), "weight bits"));
        if (dev_alloc((void **)&c->qpopc, (size_t)(l->out * c->parts) * sizeof(int), "weight bits") != BIE_OK) {
            DEV_FREE(c->qbits);
            return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: weight bits", MODULE);
        }
        dst = c->qbits;
        dst_popc = c->qpopc;
    }
    if (c->w_i8) BIE_TRY(bie_cuda_pack_weight(BIE_I8, c->w_i8, l->out, l->in, c->ld, dst, dst_popc));
    else BIE_TRY(bie_cuda_pack_weight(BIE_F32, c->w_f32, l->out, l->in, c->ld, dst, dst_popc));
    *bits = dst;
    *popc = dst_popc;
    return BIE_OK;
}

bie_status bie_blc_forward(bie_binary_linear *l, const bie_tensor *x, bie_tensor *out) {
    static const char *who = "binary_linear_forward";
    struct bie_bl_cuda *c = l->cuda;
    BIE_TRY(bie_blc_check_forward(l, x));
    BIE_TRY(check_device_rows(l, out, "output", l->dtype, l->out, x, who));
    const bool packed_input = x->dtype != l->dtype;
    const bool keep = l->training && !packed_input;
    const bool has_weight = c->w_i8 || c->w_f32;
    if (!has_weight && (l->training || c->qbits == NULL)) return bie_bw_no_weight(who);
    if (packed_input && !c->scale_a_known)
        return bie_fail(BIE_ERR_STATE, "%s: scale_a is 0 (uninitialised) and cannot be measured on "
                        "pre-packed input: run a float forward or set scale_a first", who);
    const int64_t m = bie_tensor_numel(x) / x->shape[x->ndim - 1];
    if (m > 65535LL * 64)
        return bie_fail(BIE_ERR_OVERFLOW, "%s: %lld rows exceed the CUDA grid limit", who, (long long)m);
    if (!packed_input) BIE_TRY(ensure_scale_a(l, x, who));
    BIE_TRY(reserve_activations(l, m));
    l->has_saved = false;
    if (packed_input) {
        BIE_TRY(bie_cuda_repack_rows(x->data, bie_packed_row_bytes(l->in, l->w.word_bits), m, l->in,
                                     c->ld, c->abits, c->apopc));
    } else {
        BIE_TRY(bie_cuda_pack_act(l->dtype, x->data, m, l->in, c->bias_a, c->scalars + SCALE_A,
                                  c->scalars + SCALE_W, keep ? c->scalars + SAVED_SCALES : NULL, c->ld,
                                  c->abits, keep ? c->amask : NULL, c->apopc));
    }
    const uint8_t *wbits = NULL;
    const int *wpopc = NULL;
    BIE_TRY(forward_weight(l, &wbits, &wpopc));
    const int parts_a = packed_input ? c->parts : bie_cuda_act_popc_parts(m, c->ld);
    BIE_TRY(bie_cuda_bgemm_launch(l->kernel_id, m, l->out, l->in, c->abits, wbits, c->ld, c->apopc, parts_a,
                                  wpopc, 0.0f, c->scalars + SCALE_A, c->scalars + SCALE_W, l->dtype,
                                  out->data));
    if (keep) {
        l->saved_m = m;
        l->saved_ndim = x->ndim;
        memcpy(l->saved_shape, x->shape, sizeof l->saved_shape);
        l->has_saved = true;
    }
    return BIE_OK;
}

/* ---------------------------------------------------------------- backward */

static bie_status reserve_grads(bie_binary_linear *l) {
    struct bie_bl_cuda *c = l->cuda;
    const size_t n = weight_count(l);
    if (c->g_w == NULL) BIE_TRY(dev_alloc((void **)&c->g_w, n * sizeof(float), "grad weight"));
    if (c->g_bias == NULL) BIE_TRY(dev_alloc((void **)&c->g_bias, (size_t)l->in * sizeof(float), "grad bias_a"));
    if (c->g_scale == NULL) BIE_TRY(dev_alloc((void **)&c->g_scale, sizeof(float), "grad scale_a"));
    if (c->w_i8 && c->g_w_i8 == NULL) BIE_TRY(dev_alloc((void **)&c->g_w_i8, n, "grad weight"));
    if (!c->w_i8) DEV_FREE(c->g_w_i8);
    return BIE_OK;
}

bie_status bie_blc_backward(bie_binary_linear *l, const bie_tensor *grad_out, bie_tensor *grad_x) {
    static const char *who = "binary_linear_backward";
    struct bie_bl_cuda *c = l->cuda;
    if (!l->has_saved)
        return bie_fail(BIE_ERR_STATE, "%s: no saved activations: run a training-mode forward "
                        "on float input first", who);
    bie_tensor like;
    memset(&like, 0, sizeof like);
    like.ndim = l->saved_ndim;
    memcpy(like.shape, l->saved_shape, sizeof like.shape);
    BIE_TRY(check_device_rows(l, grad_out, "grad_out", l->dtype, l->out, &like, who));
    if (grad_x) BIE_TRY(check_device_rows(l, grad_x, "grad_x", l->dtype, l->in, &like, who));
    if (l->saved_m > INT32_MAX)
        return bie_fail(BIE_ERR_OVERFLOW, "%s: %lld rows exceed the BLAS index range", who,
                        (long long)l->saved_m);
    BIE_TRY(reserve_grads(l));
    bie_cuda_bl_backward_args a = {
        .dtype = l->dtype, .m = l->saved_m, .n = l->out, .k = l->in, .ld = c->ld,
        .grad_out = grad_out->data, .grad_x = grad_x ? grad_x->data : NULL, .wbits = c->wbits,
        .signs = c->abits, .mask = c->amask, .saved_scales = c->scalars + SAVED_SCALES,
        .grad_w = c->g_w, .grad_w_i8 = c->g_w_i8, .grad_bias = c->g_bias, .grad_scale_a = c->g_scale,
    };
    BIE_TRY(bie_cuda_binary_linear_backward(&a));
    c->has_grads = true;
    return BIE_OK;
}

/* ---------------------------------------------------------------- kernel selection */

bie_status bie_blc_set_kernel(bie_binary_linear *l, int id) {
    static const char *who = "set_gemm_kernel";
    if (id == -1) {
        l->kernel_id = -1;
        return BIE_OK;
    }
    bie_kernel_info info;
    if (bie_kernel_find(id, &info) != BIE_OK || info.op != BIE_OP_BINARY_GEMM)
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: no binary GEMM kernel with id %d (see "
                        "bie_kernel_get for the list)", who, id);
    if (info.device != BIE_DEVICE_CUDA)
        return bie_fail(BIE_ERR_DEVICE, "%s: kernel %d (%s) runs on the CPU; this layer is on CUDA",
                        who, id, info.name);
    if (!bie_cuda_kernel_fits(id, l->in))
        return bie_fail(BIE_ERR_UNSUPPORTED, "%s: kernel %d (%s) cannot run in_features = %lld", who,
                        id, info.name, (long long)l->in);
    l->kernel_id = id;
    return BIE_OK;
}

/* Times every CUDA binary kernel that fits on the layer's shape (random bits, best of a few
 * launches measured with events) and keeps the fastest. */
bie_status bie_blc_select_kernel(bie_binary_linear *l, const bie_tensor *x) {
    BIE_TRY(bie_blc_check_forward(l, x));
    const int64_t m = bie_tensor_numel(x) / x->shape[x->ndim - 1], n = l->out, k = l->in;
    const int64_t ld = l->cuda->ld, parts = l->cuda->parts;
    uint8_t *ws = NULL;
    const size_t bits = (size_t)((m + n) * ld), counts = (size_t)((m + n) * parts) * sizeof(int);
    const size_t outb = (size_t)(m * n) * sizeof(float);
    BIE_TRY(dev_alloc((void **)&ws, bits + counts + outb, "select_gemm_kernel workspace"));
    cudaEvent_t e0 = NULL, e1 = NULL;
    cudaStream_t stream = (cudaStream_t)bie_cuda_current_stream();
    bie_status st = cuda_ok(cudaMemset(ws, 0x5a, bits + counts), "select_gemm_kernel");
    if (st == BIE_OK) st = cuda_ok(cudaDeviceSynchronize(), "select_gemm_kernel");
    if (st == BIE_OK) st = cuda_ok(cudaEventCreate(&e0), "cudaEventCreate");
    if (st == BIE_OK) st = cuda_ok(cudaEventCreate(&e1), "cudaEventCreate");
    int best_id = -1;
    float best = 1e30f;
    const int count = bie_kernel_count();
    for (int i = 0; i < count && st == BIE_OK; i++) {
        bie_kernel_info info;
        if (bie_kernel_get(i, &info) != BIE_OK || info.device != BIE_DEVICE_CUDA ||
            info.op != BIE_OP_BINARY_GEMM || !bie_cuda_kernel_fits(info.id, k))
            continue;
        const uint8_t *a = ws, *b = ws + m * ld;
        const int *pa = (const int *)(ws + bits), *pb = pa + m * parts;
        float *out = (float *)(ws + bits + counts);
        float t_best = 1e30f;
        for (int rep = 0; rep < 4 && st == BIE_OK; rep++) { /* rep 0 warms up */
            cudaEventRecord(e0, stream);
            st = bie_cuda_bgemm_launch(info.id, m, n, k, a, b, ld, pa, (int)parts, pb, 1.0f, NULL, NULL,
                                       BIE_F32, out);
            cudaEventRecord(e1, stream);
            if (st == BIE_OK) st = cuda_ok(cudaEventSynchronize(e1), "select_gemm_kernel");
            float ms = 0;
            if (st == BIE_OK && rep > 0 && cudaEventElapsedTime(&ms, e0, e1) == cudaSuccess && ms < t_best)
                t_best = ms;
        }
        if (st == BIE_OK && t_best < best) {
            best = t_best;
            best_id = info.id;
        }
    }
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    dev_free(ws);
    BIE_TRY(st);
    if (best_id < 0) return bie_fail(BIE_ERR_UNSUPPORTED, "select_gemm_kernel: no CUDA kernel fits this shape");
    l->kernel_id = best_id;
    return BIE_OK;
}
