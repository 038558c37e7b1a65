/* The weight operations of the layers on CUDA (layer.h's bie_weight_ops): every kind's
 * device state starts with the shared bie_cuda_bw (cuda_layer.h), whose weight the format's
 * staging code changes (binary_weight_cuda.h, q4_weight_cuda.h). */
#include "binary_weight_cuda.h"
#include "layer_cuda.h"
#include "q4_weight_cuda.h"

static bie_cuda_bw *dev(const bie_layer *l) { return (bie_cuda_bw *)l->backend; }

static bool has_qweight(const bie_layer *l) { return dev(l)->qweight != NULL; }
static bool has_weight(const bie_layer *l) { return dev(l)->w_f32 || dev(l)->w_i8; }
static bool is_float(const bie_layer *l) { return dev(l)->w_f32 != NULL; }
static bie_status grad(bie_layer *l, bie_param which, int wndim, const int64_t *wshape,
                       bie_tensor *v) {
    return bie_cbw_grad(dev(l), which, wndim, wshape, v);
}
static bie_status set_scale_a(bie_layer *l, float scale_a) {
    return bie_cbw_set_scale_a(dev(l), scale_a);
}
static bie_status get_scale_a(bie_layer *l, float *scale_a) {
    return bie_cbw_read_scale_a(dev(l), scale_a);
}

/* ---------------------------------------------------------------- binary */

static bie_status b_reset(bie_layer *l, uint64_t seed) {
    return bie_cbw_reset(dev(l), &l->w, seed);
}
static bie_status b_prepare(bie_layer *l, const char *who) {
    return bie_cbw_prepare(dev(l), &l->w, who);
}
static bie_status b_set_data(bie_layer *l, const bie_tensor *w, const char *who) {
    return bie_cbw_set_weight_data(dev(l), &l->w, l->dtype, w, who);
}
static bie_status b_generate(bie_layer *l, bool qweight_only, const char *who) {
    return bie_cbw_generate_qweight(dev(l), &l->w, qweight_only, who);
}
static bie_status b_set_qweight(bie_layer *l, const bie_tensor *q, const char *who) {
    return bie_cbw_set_qweight(dev(l), &l->w, q, who);
}
static bie_status b_set_word_bits(bie_layer *l, int bits, const char *who) {
    (void)who;
    return bie_cbw_set_bits(dev(l), &l->w, bits);
}
/* A writable view of scale_a may change it behind the layer's back: from now on the value
 * on the device says whether it is set. */
static bie_status viewed(bie_layer *l, bie_param which, bie_status st) {
    if (st == BIE_OK && which == BIE_PARAM_SCALE_A) dev(l)->scale_a_known = false;
    return st;
}
static bie_status b_param(bie_layer *l, bie_param which, int wndim, const int64_t *wshape,
                          bie_tensor *v) {
    return viewed(l, which, bie_cbw_param(dev(l), &l->w, which, wndim, wshape, v));
}

const bie_weight_ops bie_binary_weight_cuda_ops = {
    .reset = b_reset,
    .prepare = b_prepare,
    .set_data = b_set_data,
    .generate = b_generate,
    .set_qweight = b_set_qweight,
    .set_word_bits = b_set_word_bits,
    .has_qweight = has_qweight,
    .has_weight = has_weight,
    .weight_is_float = is_float,
    .param = b_param,
    .grad = grad,
    .set_scale_a = set_scale_a,
    .get_scale_a = get_scale_a,
};

/* ---------------------------------------------------------------- 4-bit */

static bie_status q_reset(bie_layer *l, uint64_t seed) {
    return bie_cq4w_reset(dev(l), &l->qw, seed);
}
static bie_status q_prepare(bie_layer *l, const char *who) {
    return bie_cq4w_prepare(dev(l), &l->qw, who);
}
static bie_status q_set_data(bie_layer *l, const bie_tensor *w, const char *who) {
    return bie_cq4w_set_weight_data(dev(l), &l->qw, l->dtype, w, who);
}
static bie_status q_generate(bie_layer *l, bool qweight_only, const char *who) {
    return bie_cq4w_generate_qweight(dev(l), &l->qw, qweight_only, who);
}
static bie_status q_set_qweight(bie_layer *l, const bie_tensor *q, const char *who) {
    return bie_cq4w_set_qweight(dev(l), &l->qw, q, who);
}
static bie_status q_param(bie_layer *l, bie_param which, int wndim, const int64_t *wshape,
                          bie_tensor *v) {
    return viewed(l, which, bie_cq4w_param(dev(l), which, wndim, wshape, v));
}

const bie_weight_ops bie_q4_weight_cuda_ops = {
    .reset = q_reset,
    .prepare = q_prepare,
    .set_data = q_set_data,
    .generate = q_generate,
    .set_qweight = q_set_qweight,
    .set_word_bits = NULL,
    .has_qweight = has_qweight,
    .has_weight = has_weight,
    .weight_is_float = has_weight,
    .param = q_param,
    .grad = grad,
    .set_scale_a = set_scale_a,
    .get_scale_a = get_scale_a,
};
