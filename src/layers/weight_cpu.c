/* The weight operations of the layers on the CPU (layer.h's bie_weight_ops): the weight of
 * a binary layer (bie_binary_weight) or of a 4-bit layer (bie_q4_weight) lives in host
 * memory, and the operations are the weight formats' own. */
#include "layer.h"

static bie_status view(bie_tensor *v, void *data, bie_dtype dt, int ndim, int64_t d0, int64_t d1) {
    const int64_t shape[2] = {d0, d1};
    return bie_tensor_view(v, data, dt, ndim, shape);
}

/* BIAS_A, SCALE_A (the CPU's); anything else does not exist. */
static bie_status common_param(bie_layer *l, bie_param which, float *scale_w, bie_tensor *v) {
    switch (which) {
    case BIE_PARAM_BIAS_A: return view(v, l->bias_a, BIE_F32, 1, l->in, 0);
    case BIE_PARAM_SCALE_A: return view(v, &l->scale_a, BIE_F32, 1, 1, 0);
    case BIE_PARAM_SCALE_W: return view(v, scale_w, BIE_F32, 1, 1, 0);
    default: break;
    }
    return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: parameter %d does not exist", l->kind->name,
                    (int)which);
}

static bie_status no_qweight(const bie_layer *l) {
    return bie_fail(BIE_ERR_STATE, "%s: no qweight yet (generate_quantized_weight)", l->kind->name);
}

static bie_status grad(bie_layer *l, bie_param which, int wndim, const int64_t *wshape,
                       bie_tensor *v) {
    return bie_grads_view(&l->grads, which, wndim, wshape, &l->in, v, l->kind->name);
}

static bie_status set_scale_a(bie_layer *l, float scale_a) {
    l->scale_a = scale_a;
    return BIE_OK;
}
static bie_status get_scale_a(bie_layer *l, float *scale_a) {
    *scale_a = l->scale_a;
    return BIE_OK;
}

/* ---------------------------------------------------------------- binary */

static bie_status b_reset(bie_layer *l, uint64_t seed) { return bie_bw_reset(&l->w, seed); }
static bie_status b_prepare(bie_layer *l, const char *who) { return bie_bw_prepare(&l->w, who); }
static bie_status b_set_data(bie_layer *l, const bie_tensor *w, const char *who) {
    return bie_bw_set_data(&l->w, w->data, who);
}
static bie_status b_generate(bie_layer *l, bool qweight_only, const char *who) {
    return bie_bw_generate_qweight(&l->w, qweight_only, who);
}
static bie_status b_set_qweight(bie_layer *l, const bie_tensor *q, const char *who) {
    return bie_bw_set_qweight(&l->w, q->data, who);
}
static bie_status b_set_word_bits(bie_layer *l, int bits, const char *who) {
    return bie_bw_set_word_bits(&l->w, bits, who);
}
static bool b_has_qweight(const bie_layer *l) { return l->w.qweight != NULL; }
static bool b_has_weight(const bie_layer *l) { return bie_bw_has_training_weight(&l->w); }
static bool b_is_float(const bie_layer *l) { return l->w.f32 != NULL; }

static bie_status b_param(bie_layer *l, bie_param which, int wndim, const int64_t *wshape,
                          bie_tensor *v) {
    switch (which) {
    case BIE_PARAM_WEIGHT:
        if (l->w.i8) return bie_tensor_view(v, l->w.i8, BIE_I8, wndim, wshape);
        if (l->w.f32) return bie_tensor_view(v, l->w.f32, BIE_F32, wndim, wshape);
        return bie_bw_no_weight(l->kind->name);
    case BIE_PARAM_QWEIGHT:
        if (l->w.qweight == NULL) return no_qweight(l);
        return view(v, l->w.qweight, bie_bw_word_dtype(l->w.word_bits), 2, l->out,
                    bie_packed_words(l->fan_in, l->w.word_bits));
    default: return common_param(l, which, &l->w.scale_w, v);
    }
}

const bie_weight_ops bie_binary_weight_cpu_ops = {
    .reset = b_reset,
    .prepare = b_prepare,
    .set_data = b_set_data,
    .generate = b_generate,
    .set_qweight = b_set_qweight,
    .set_word_bits = b_set_word_bits,
    .has_qweight = b_has_qweight,
    .has_weight = b_has_weight,
    .weight_is_float = b_is_float,
    .param = b_param,
    .grad = grad,
    .set_scale_a = set_scale_a,
    .get_scale_a = get_scale_a,
};

/* ---------------------------------------------------------------- 4-bit */

static bie_status q_reset(bie_layer *l, uint64_t seed) { return bie_q4w_reset(&l->qw, seed); }
static bie_status q_prepare(bie_layer *l, const char *who) { return bie_q4w_prepare(&l->qw, who); }
static bie_status q_set_data(bie_layer *l, const bie_tensor *w, const char *who) {
    return bie_q4w_set_data(&l->qw, w->data, who);
}
static bie_status q_generate(bie_layer *l, bool qweight_only, const char *who) {
    return bie_q4w_generate_qweight(&l->qw, qweight_only, who);
}
static bie_status q_set_qweight(bie_layer *l, const bie_tensor *q, const char *who) {
    return bie_q4w_set_qweight(&l->qw, q->data, who);
}
static bool q_has_qweight(const bie_layer *l) { return l->qw.qweight != NULL; }
static bool q_has_weight(const bie_layer *l) { return l->qw.f32 != NULL; }

static bie_status q_param(bie_layer *l, bie_param which, int wndim, const int64_t *wshape,
                          bie_tensor *v) {
    switch (which) {
    case BIE_PARAM_WEIGHT:
        if (l->qw.f32 == NULL) return bie_bw_no_weight(l->kind->name);
        return bie_tensor_view(v, l->qw.f32, BIE_F32, wndim, wshape);
    case BIE_PARAM_QWEIGHT:
        if (l->qw.qweight == NULL) return no_qweight(l);
        return view(v, l->qw.qweight, BIE_U8, 2, l->out, bie_nibble_row_bytes(l->fan_in));
    default: return common_param(l, which, &l->qw.scale_w, v);
    }
}

const bie_weight_ops bie_q4_weight_cpu_ops = {
    .reset = q_reset,
    .prepare = q_prepare,
    .set_data = q_set_data,
    .generate = q_generate,
    .set_qweight = q_set_qweight,
    .set_word_bits = NULL,
    .has_qweight = q_has_qweight,
    .has_weight = q_has_weight,
    .weight_is_float = q_has_weight,
    .param = q_param,
    .grad = grad,
    .set_scale_a = set_scale_a,
    .get_scale_a = get_scale_a,
};
