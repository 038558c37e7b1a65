/* The binary linear layer on CUDA (SPEC §2). The parameters live in device memory, so an
 * optimizer updates them in place through bie_layer_param views; scale_a and scale_w
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
#include "binary_weight_cuda.h"
#include "layer_cuda.h"

struct bie_bl_cuda {
    bie_cuda_bw d; /* weight, bias_a, scalars, gradients */
    int parts;     /* popcount slices per row */
    /* The packed weight in the GEMM layout for inference (from qweight, or from the training
     * weight), built on first use; valid while qversion == d.version. */
    uint8_t *qbits;
    int *qpopc;
    unsigned qversion;
    /* Activations of the last forward (kept for the backward in training mode). */
    uint8_t *abits, *amask;
    int *apopc;
    int64_t a_cap; /* rows allocated */
    /* Weight bits of the last training forward. */
    uint8_t *wbits;
    int *wpopc;
    /* Their ±1 values transposed [in][out] (wsignt_bytes each: 16-bit, or e4m3 for the FP8
     * backward), written with them by a training forward where bie_cuda_weight_signs_bytes
     * says so (0: none this time; allocated on first use, 2 bytes a weight): the backward's
     * pass over the bits less. */
    void *wsignt;
    int wsignt_bytes;
};

static inline struct bie_bl_cuda *CU(const bie_layer *l) {
    return (struct bie_bl_cuda *)l->backend;
}

static const char *const MODULE = "binary_linear (cuda)";

/* ---------------------------------------------------------------- life cycle */

static void release(bie_layer *l);

static bie_status init(bie_layer *l) {
    BIE_TRY(bie_cuda_layer_state(l, sizeof(struct bie_bl_cuda), MODULE));
    struct bie_bl_cuda *c = CU(l);
    c->d.ld = bie_cuda_row_stride(l->in);
    c->parts = bie_cuda_popc_parts(c->d.ld);
    bie_status st =
        bie_cbw_alloc((void **)&c->wbits, (size_t)(l->out * c->d.ld), MODULE, "weight bits");
    if (st == BIE_OK)
        st = bie_cbw_alloc((void **)&c->wpopc, (size_t)(l->out * c->parts) * sizeof(int), MODULE,
                           "weight bits");
    if (st != BIE_OK) release(l);
    return st;
}

static void free_activations(struct bie_bl_cuda *c) {
    BIE_DEV_FREE(c->abits);
    BIE_DEV_FREE(c->amask);
    BIE_DEV_FREE(c->apopc);
    c->a_cap = 0;
}

static void release(bie_layer *l) {
    struct bie_bl_cuda *c = CU(l);
    if (c == NULL) return;
    free_activations(c);
    bie_cbw_free_ptr(c->qbits);
    bie_cbw_free_ptr(c->qpopc);
    bie_cbw_free_ptr(c->wbits);
    bie_cbw_free_ptr(c->wpopc);
    bie_cbw_free_ptr(c->wsignt);
    bie_cuda_layer_state_free(l);
}

/* ---------------------------------------------------------------- forward */

/* Room for the packed activations of m rows (contents are not kept). */
static bie_status reserve_activations(bie_layer *l, int64_t m) {
    struct bie_bl_cuda *c = CU(l);
    if (m <= c->a_cap) return BIE_OK;
    l->has_saved = false;
    free_activations(c);
    BIE_TRY(bie_cbw_alloc((void **)&c->abits, (size_t)(m * c->d.ld), MODULE, "packed activations"));
    BIE_TRY(bie_cbw_alloc((void **)&c->amask, (size_t)(m * c->d.ld), MODULE, "activation mask"));
    /* Popcount slices: c->parts per row, or finer ones for up to 16 rows (see pack_act). */
    const size_t counts = (size_t)(m * c->parts + 16 * bie_cuda_act_popc_parts(1, c->d.ld));
    BIE_TRY(bie_cbw_alloc((void **)&c->apopc, counts * sizeof(int), MODULE, "activation counts"));
    c->a_cap = m;
    return BIE_OK;
}

/* The packed weight the forward multiplies with: the training weight's signs, packed now
 * (the optimizer may have changed it), or the inference cache: qweight in the GEMM layout,
 * built after each weight change (qweight itself is generated on first use). */
static bie_status forward_weight(bie_layer *l, const uint8_t **bits, const int **popc) {
    struct bie_bl_cuda *c = CU(l);
    const bool training = l->training;
    /* As on the CPU (opt_weight): inference packs the weight into qweight on first use. */
    if (!training && c->d.qweight == NULL) BIE_TRY(bie_layer_generate_quantized_weight(l, false));
    if (!training && c->qbits && c->qversion == c->d.version) {
        *bits = c->qbits;
        *popc = c->qpopc;
        return BIE_OK;
    }
    uint8_t *dst = c->wbits;
    int *dst_popc = c->wpopc;
    c->wsignt_bytes = 0;
    const int es = training
                       ? bie_cuda_weight_signs_bytes(l->dtype, c->d.w_i8, l->out, l->in, c->d.ld,
                                                     l->backward_mode == BIE_BACKWARD_FP8)
                       : 0;
    if (es) {
        if (c->wsignt == NULL)
            BIE_TRY(
                bie_cbw_alloc(&c->wsignt, (size_t)(l->out * l->in) * 2, MODULE, "weight signs"));
        BIE_TRY(bie_cuda_pack_weight_signs(c->d.w_i8, l->out, l->in, c->d.ld, dst, dst_popc, es,
                                           l->dtype, c->wsignt));
        c->wsignt_bytes = es;
        *bits = dst;
        *popc = dst_popc;
        return BIE_OK;
    }
    if (!training) {
        if (c->qbits == NULL) {
            BIE_TRY(bie_cbw_alloc((void **)&c->qbits, (size_t)(l->out * c->d.ld), MODULE,
                                  "weight bits"));
            if (bie_cbw_alloc((void **)&c->qpopc, (size_t)(l->out * c->parts) * sizeof(int), MODULE,
                              "weight bits") != BIE_OK) {
                BIE_DEV_FREE(c->qbits);
                return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: weight bits", MODULE);
            }
        }
        dst = c->qbits;
        dst_popc = c->qpopc;
    }
    if (!training && c->d.qweight)
        BIE_TRY(bie_cuda_repack_rows(c->d.qweight, bie_packed_row_bytes(l->in, l->w.word_bits),
                                     l->out, l->in, c->d.ld, dst, dst_popc));
    else if (c->d.w_i8)
        BIE_TRY(bie_cuda_pack_weight(BIE_I8, c->d.w_i8, l->out, l->in, c->d.ld, dst, dst_popc));
    else
        BIE_TRY(bie_cuda_pack_weight(BIE_F32, c->d.w_f32, l->out, l->in, c->d.ld, dst, dst_popc));
    if (!training) c->qversion = c->d.version;
    *bits = dst;
    *popc = dst_popc;
    return BIE_OK;
}

static bie_status forward(bie_layer *l, const bie_tensor *x, bie_tensor *out) {
    static const char *who = "binary_linear_forward";
    struct bie_bl_cuda *c = CU(l);
    BIE_TRY(bie_layer_check_forward(l, x));
    BIE_TRY(bie_cbw_check_tensor(l->device.index, out, "output", l->dtype, l->out, x, who));
    const bool packed_input = x->dtype != l->dtype;
    const bool keep = l->training && !packed_input;
    const bool has_weight = c->d.w_i8 || c->d.w_f32;
    if (!has_weight && (l->training || c->d.qweight == NULL)) return bie_bw_no_weight(who);
    bool scale_known = true;
    if (packed_input) BIE_TRY(bie_cbw_scale_a_known(&c->d, &scale_known));
    if (!scale_known)
        return bie_fail(BIE_ERR_STATE,
                        "%s: scale_a is 0 (uninitialised) and cannot be measured on "
                        "pre-packed input: run a float forward or set scale_a first",
                        who);
    const int64_t m = bie_tensor_numel(x) / x->shape[x->ndim - 1];
    if (m > 65535LL * 64)
        return bie_fail(BIE_ERR_OVERFLOW, "%s: %lld rows exceed the CUDA grid limit", who,
                        (long long)m);
    if (!packed_input) BIE_TRY(bie_cuda_ensure_scale_a(l, x, who));
    BIE_TRY(reserve_activations(l, m));
    l->has_saved = false;
    float *scalars = c->d.scalars;
    if (packed_input) {
        BIE_TRY(bie_cuda_repack_rows(x->data, bie_packed_row_bytes(l->in, l->w.word_bits), m, l->in,
                                     c->d.ld, c->abits, c->apopc));
    } else {
        BIE_TRY(bie_cuda_pack_act(l->dtype, x->data, m, l->in, c->d.bias_a,
                                  scalars + BIE_CBW_SCALE_A, scalars + BIE_CBW_SCALE_W,
                                  keep ? scalars + BIE_CBW_SAVED_SCALES : NULL, c->d.ld, c->abits,
                                  keep ? c->amask : NULL, c->apopc));
    }
    const uint8_t *wbits = NULL;
    const int *wpopc = NULL;
    BIE_TRY(forward_weight(l, &wbits, &wpopc));
    const int parts_a = packed_input ? c->parts : bie_cuda_act_popc_parts(m, c->d.ld);
    BIE_TRY(bie_cuda_bgemm_launch(l->kernel_id, m, l->out, l->in, c->abits, wbits, c->d.ld,
                                  c->apopc, parts_a, wpopc, 0.0f, scalars + BIE_CBW_SCALE_A,
                                  scalars + BIE_CBW_SCALE_W, l->dtype, out->data, NULL));
    if (keep) {
        l->saved_m = m;
        l->saved_ndim = x->ndim;
        memcpy(l->saved_shape, x->shape, sizeof l->saved_shape);
        l->has_saved = true;
    }
    return BIE_OK;
}

/* The last training forward's output again from its kept sign rows, weight bits and the
 * scales it used (no pack). */
static bie_status forward_again(bie_layer *l, bie_tensor *out) {
    static const char *who = "binary_linear_forward_again";
    struct bie_bl_cuda *c = CU(l);
    if (!l->has_saved)
        return bie_fail(BIE_ERR_STATE,
                        "%s: nothing kept: run a training-mode forward on float input first", who);
    const bie_tensor like = bie_layer_saved_like(l);
    BIE_TRY(bie_cbw_check_tensor(l->device.index, out, "output", l->dtype, l->out, &like, who));
    const float *saved = c->d.scalars + BIE_CBW_SAVED_SCALES;
    const int64_t m = l->saved_m;
    return bie_cuda_bgemm_launch(l->kernel_id, m, l->out, l->in, c->abits, c->wbits, c->d.ld,
                                 c->apopc, bie_cuda_act_popc_parts(m, c->d.ld), c->wpopc, 0.0f,
                                 saved, saved + 1, l->dtype, out->data, NULL);
}

/* ---------------------------------------------------------------- backward */

static bie_status backward(bie_layer *l, const bie_tensor *grad_out, bie_tensor *grad_x) {
    static const char *who = "binary_linear_backward";
    struct bie_bl_cuda *c = CU(l);
    if (!l->has_saved)
        return bie_fail(BIE_ERR_STATE,
                        "%s: no saved activations: run a training-mode forward "
                        "on float input first",
                        who);
    const bie_tensor like = bie_layer_saved_like(l);
    BIE_TRY(
        bie_cbw_check_tensor(l->device.index, grad_out, "grad_out", l->dtype, l->out, &like, who));
    if (grad_x)
        BIE_TRY(
            bie_cbw_check_tensor(l->device.index, grad_x, "grad_x", l->dtype, l->in, &like, who));
    if (l->saved_m > INT32_MAX)
        return bie_fail(BIE_ERR_OVERFLOW, "%s: %lld rows exceed the BLAS index range", who,
                        (long long)l->saved_m);
    BIE_TRY(bie_cbw_reserve_grads(&c->d, l->wgrad_target));
    bie_cuda_bl_backward_args a = {
        .dtype = l->dtype,
        .m = l->saved_m,
        .n = l->out,
        .k = l->in,
        .ld = c->d.ld,
        .grad_out = grad_out->data,
        .grad_x = grad_x ? grad_x->data : NULL,
        .wbits = c->wbits,
        .wsignt = c->wsignt_bytes ? c->wsignt : NULL,
        .wsignt_bytes = c->wsignt_bytes,
        .signs = c->abits,
        .mask = c->amask,
        .saved_scales = c->d.scalars + BIE_CBW_SAVED_SCALES,
        .grad_w = c->d.out_w,
        .grad_w_i8 = c->d.out_w_i8,
        .grad_bias = c->d.g_bias,
        .grad_scale_a = c->d.g_scale,
        .fp8 = l->backward_mode == BIE_BACKWARD_FP8,
    };
    BIE_TRY(bie_cuda_binary_linear_backward(&a));
    bie_cbw_grads_done(&c->d);
    return BIE_OK;
}

const bie_layer_ops bie_binary_linear_cuda_ops = {
    .weight = &bie_binary_weight_cuda_ops,
    .device = &bie_cuda_device_ops,
    .init = init,
    .release = release,
    .forward = forward,
    .forward_again = forward_again,
    .backward = backward,
    .wgrad_target_direct = true,
    .check_backward_mode = bie_cuda_check_backward_mode,
};
