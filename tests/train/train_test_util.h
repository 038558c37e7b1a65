/* Helpers for the training-library tests: models on random data, losses of the form
 * L = sum(y * r), finite differences. */
#ifndef BIE_TRAIN_TEST_UTIL_H
#define BIE_TRAIN_TEST_UTIL_H

#include "../test_util.h"
#include "bie_train.h"

static inline int64_t ttu_numel(int ndim, const int64_t *shape) {
    int64_t n = 1;
    for (int d = 0; d < ndim; d++) n *= shape[d];
    return n;
}

static inline int ttu_same_shape(const bie_tensor *a, const bie_tensor *b) {
    if (a->ndim != b->ndim) return 0;
    for (int d = 0; d < a->ndim; d++)
        if (a->shape[d] != b->shape[d]) return 0;
    return 1;
}

static inline bie_tensor ttu_view(float *data, int ndim, const int64_t *shape) {
    bie_tensor t;
    if (bie_tensor_view(&t, data, BIE_F32, ndim, shape) != BIE_OK) {
        fprintf(stderr, "bad view: %s\n", bie_last_error());
        exit(2);
    }
    return t;
}

/* Append a low-bit layer as bie_model_add_layer describes it: binary layers symmetric with
 * 8-bit words; conv2d with the given kernel_size, stride, padding, dilation. */
static inline bie_status ttu_add_low_bit(bie_model *m, bie_layer_type type, int64_t in, int64_t out,
                                         int k, int s, int p, int d) {
    bie_layer_info i;
    memset(&i, 0, sizeof i);
    i.type = type;
    i.in = in;
    i.out = out;
    i.kernel_size = k;
    i.stride = s;
    i.padding = p;
    i.dilation = d;
    i.symmetric = true;
    i.bits_binary_word = 8;
    return bie_model_add_layer(m, &i);
}
static inline bie_status ttu_add_binary_linear(bie_model *m, int64_t in, int64_t out) {
    return ttu_add_low_bit(m, BIE_LAYER_BINARY_LINEAR, in, out, 0, 0, 0, 0);
}
static inline bie_status ttu_add_q4_linear(bie_model *m, int64_t in, int64_t out) {
    return ttu_add_low_bit(m, BIE_LAYER_Q4_LINEAR, in, out, 0, 0, 0, 0);
}
static inline bie_status ttu_add_binary_conv2d(bie_model *m, int64_t in_c, int64_t out_c, int k,
                                               int s, int p, int d) {
    return ttu_add_low_bit(m, BIE_LAYER_BINARY_CONV2D, in_c, out_c, k, s, p, d);
}
static inline bie_status ttu_add_q4_conv2d(bie_model *m, int64_t in_c, int64_t out_c, int k, int s,
                                           int p, int d) {
    return ttu_add_low_bit(m, BIE_LAYER_Q4_CONV2D, in_c, out_c, k, s, p, d);
}

/* L = sum(y * r) over the model's output for input x (in double); NAN if the forward fails. */
static inline double ttu_loss(bie_model *m, const bie_tensor *x, const float *r) {
    bie_tensor y;
    if (bie_model_forward(m, x, &y) != BIE_OK) {
        fprintf(stderr, "forward failed: %s\n", bie_last_error());
        return NAN;
    }
    double l = 0;
    const float *yy = y.data;
    for (int64_t i = 0; i < bie_tensor_numel(&y); i++) l += (double)yy[i] * r[i];
    return l;
}

/* Central difference of L in the float at p. */
static inline double ttu_numeric(bie_model *m, const bie_tensor *x, const float *r, float *p,
                                 float h) {
    const float keep = *p;
    *p = keep + h;
    const double lp = ttu_loss(m, x, r);
    *p = keep - h;
    const double lm = ttu_loss(m, x, r);
    *p = keep;
    return (lp - lm) / (2.0 * (double)h);
}

static inline int ttu_close(double got, double want, double atol, double rtol) {
    return fabs(got - want) <= atol + rtol * fabs(want);
}

#endif
