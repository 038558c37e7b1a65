/* Binary linear layer (SPEC §2) on the CPU: the forward and the kind's CPU ops table (the life
 * cycle is layer.c's, the backward binary_linear_backward.c's, kernel selection
 * layer_cpu.c's). */
#include <math.h>
#include <string.h>

#include "../cpu/dispatch.h"
#include "../cpu/frame/pack.h"
#include "layer_cpu.h"

/* ---------------------------------------------------------------- helpers */

#define packed_dtype bie_bw_word_dtype

/* ---------------------------------------------------------------- forward */

/* Kernel for m rows: the selected one, or the default for the shape. */
static const bie_cpu_kernel *forward_kernel(const bie_layer *l, int64_t m) {
    if (l->kernel_id >= 0) return bie_cpu_kernel_by_id(l->kernel_id);
    return bie_cpu_default_kernel(m);
}

static bie_status forward(bie_layer *l, const bie_tensor *x, bie_tensor *out) {
    static const char *who = "binary_linear_forward";
    BIE_TRY(bie_layer_check_forward(l, x));
    BIE_TRY(bie_check_rows_tensor(out, "output", BIE_F32, l->out, x, who));
    const bool packed_input = x->dtype != BIE_F32;
    const bool keep = l->training && !packed_input;
    if (!bie_bw_has_training_weight(&l->w) && (l->training || l->w.qweight == NULL))
        return bie_bw_no_weight(who);
    if (packed_input && l->scale_a == 0.0f)
        return bie_fail(BIE_ERR_STATE,
                        "%s: scale_a is 0 (uninitialised) and cannot be measured on "
                        "pre-packed input: run a float forward or set scale_a first",
                        who);
    const int64_t m = bie_tensor_numel(x) / x->shape[x->ndim - 1];
    float scale_a = 0;
    BIE_TRY(bie_layer_activation_scale(l, x, &scale_a));
    const float scale = scale_a * l->w.scale_w;
    if (!isfinite(scale))
        return bie_fail(BIE_ERR_NOT_FINITE, "%s: scale_a * scale_w = %g is not finite", who,
                        (double)scale);
    const bie_cpu_kernel *kern = forward_kernel(l, m);

    /* Everything that can fail is allocated before any state changes. */
    const int64_t rb = bie_bl_row_bytes(l);
    int64_t a_bytes;
    if (!bie_mul_ok(m, rb, &a_bytes))
        return bie_fail(BIE_ERR_OVERFLOW, "%s: input of %lld rows is too large", who, (long long)m);
    uint8_t *signs = NULL, *mask = NULL, *wbits = NULL, *qnew = NULL;
    const uint8_t *a = x->data, *b = l->w.qweight;
    int64_t lda = bie_packed_row_bytes(l->in, l->w.word_bits), ldb = lda;
    bie_status st = BIE_OK;
    if (!packed_input && !keep) { /* inference: the packed input is scratch */
        if ((st = bie_ws_reserve(&l->ws, bie_ws_piece((size_t)a_bytes), who)) != BIE_OK) goto fail;
        signs = bie_ws_take(&l->ws, (size_t)a_bytes);
    } else if (!packed_input) {
        signs = bie_alloc_aligned((size_t)a_bytes);
    }
    if (!packed_input) {
        mask = keep ? bie_alloc_aligned((size_t)a_bytes) : NULL;
        if (signs == NULL || (keep && mask == NULL)) {
            st = bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: packed input", who);
            goto fail;
        }
        bie_pack_f32_rows(x->data, m, l->in, l->in, l->bias_a, signs, rb, mask, scale_a, -1.0f,
                          1.0f);
        a = signs;
        lda = rb;
    }
    if (l->training) {
        if ((st = bie_bw_pack(&l->w, rb, &wbits, who)) != BIE_OK) goto fail;
        b = wbits;
        ldb = rb;
    } else if (l->w.qweight == NULL) { /* opt_weight: packed on first use */
        if ((st = bie_bw_pack(&l->w, ldb, &qnew, who)) != BIE_OK) goto fail;
        b = qnew;
    }
    st = bie_cpu_bgemm(kern, m, l->out, l->in, a, lda, b, ldb, scale, out->data);
    if (st != BIE_OK) goto fail;

    l->scale_a = scale_a;
    if (qnew) l->w.qweight = qnew;
    if (keep) {
        bie_layer_drop_saved(l);
        l->saved_signs = signs;
        l->saved_mask = mask;
        l->saved_wbits = wbits;
        l->saved_m = m;
        l->saved_ndim = x->ndim;
        memcpy(l->saved_shape, x->shape, sizeof l->saved_shape);
        l->saved_scale_a = scale_a;
        l->saved_scale_w = l->w.scale_w;
        l->has_saved = true;
        return BIE_OK;
    }
    if (l->training) bie_layer_drop_saved(l); /* a packed-input forward cannot be differentiated */
    bie_free_aligned(wbits);
    return BIE_OK;
fail:
    if (keep) bie_free_aligned(signs);
    bie_free_aligned(mask);
    bie_free_aligned(wbits);
    bie_free_aligned(qnew);
    return st;
}

/* The last training forward's output again from its kept sign rows and weight bits and the
 * scales it used. */
static bie_status forward_again(bie_layer *l, bie_tensor *out) {
    static const char *who = "binary_linear_forward_again";
    if (!l->has_saved)
        return bie_fail(BIE_ERR_STATE,
                        "%s: nothing kept: run a training-mode forward on float input first", who);
    const bie_tensor like = bie_layer_saved_like(l);
    BIE_TRY(bie_check_rows_tensor(out, "output", BIE_F32, l->out, &like, who));
    const int64_t rb = bie_bl_row_bytes(l);
    return bie_cpu_bgemm(forward_kernel(l, l->saved_m), l->saved_m, l->out, l->in, l->saved_signs,
                         rb, l->saved_wbits, rb, l->saved_scale_a * l->saved_scale_w, out->data);
}

const bie_layer_ops bie_binary_linear_cpu_ops = {
    .weight = &bie_binary_weight_cpu_ops,
    .device = &bie_cpu_device_ops,
    .forward = forward,
    .forward_again = forward_again,
    .backward = bie_bl_cpu_backward,
};
