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

/* A layer description with the builders' defaults: binary layers symmetric with 8-bit words,
 * batch norm eps 1e-5 and momentum 0.1, conv kernel_size k, stride s, padding p, dilation d
 * (fields a type does not use are ignored). */
static inline bie_layer_info ttu_info(bie_layer_type type, int64_t in, int64_t out, int k, int s,
                                      int p, int d) {
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
    i.eps = 1e-5f;
    i.momentum = 0.1f;
    return i;
}

/* Append a low-bit layer as bie_model_add_layer describes it (ttu_info's defaults). */
static inline bie_status ttu_add_low_bit(bie_model *m, bie_layer_type type, int64_t in, int64_t out,
                                         int k, int s, int p, int d) {
    const bie_layer_info i = ttu_info(type, in, out, k, s, p, d);
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

#ifndef TTU_H
#define TTU_H 1e-2f /* finite-difference step */
#endif

/* Checks every analytic gradient (input and trainable parameters) of L = sum(y * r) for a
 * model in training mode against central differences. x must keep away from kinks. */
static inline void ttu_grad_check(bie_model *m, float *x, int ndim, const int64_t *shape,
                                  const char *label) {
    int on;
    int64_t os[BIE_MAX_DIMS];
    CHECK_OK(bie_model_output_shape(m, ndim, shape, &on, os));
    const int64_t nx = ttu_numel(ndim, shape), ny = ttu_numel(on, os);
    float *r = tu_alloc((size_t)ny * 4), *gx = tu_alloc((size_t)nx * 4);
    tu_fill(r, ny, -1, 1);
    bie_tensor tx = ttu_view(x, ndim, shape), tr = ttu_view(r, on, os),
               tgx = ttu_view(gx, ndim, shape);
    bie_tensor y;
    CHECK_OK(bie_model_forward(m, &tx, &y));
    CHECK(y.ndim == on && ttu_numel(y.ndim, y.shape) == ny);
    tu_poison(gx, nx);
    CHECK_OK(bie_model_backward(m, &tr, &tgx));

    int bad = 0, checked = 0;
    const int64_t stride_x = nx > 120 ? nx / 97 : 1; /* a spread sample of large inputs */
    for (int64_t i = 0; i < nx; i += stride_x) {
        const double num = ttu_numeric(m, &tx, r, &x[i], TTU_H);
        checked++;
        if (!ttu_close(gx[i], num, 5e-3, 1e-2)) {
            if (bad++ < 3)
                fprintf(stderr, "  %s: d/dx[%lld] = %g, numeric %g\n", label, (long long)i,
                        (double)gx[i], num);
        }
    }
    for (int p = 0; p < bie_model_param_count(m); p++) {
        bie_model_param prm;
        CHECK_OK(bie_model_param_get(m, p, &prm));
        if (prm.kind != BIE_PARAM_KIND_FLOAT) {
            CHECK(prm.grad.data == NULL);
            continue;
        }
        CHECK(prm.grad.data != NULL && prm.grad.dtype == BIE_F32);
        if (prm.grad.data == NULL) continue;
        const int64_t n = bie_tensor_numel(&prm.value);
        float *ana = tu_alloc((size_t)n * 4);
        memcpy(ana, prm.grad.data,
               (size_t)n * 4); /* the forwards below keep the gradient, but copy */
        for (int64_t i = 0; i<n; i += n> 100 ? n / 53 : 1) {
            const double num = ttu_numeric(m, &tx, r, (float *)prm.value.data + i, TTU_H);
            checked++;
            if (!ttu_close(ana[i], num, 5e-3, 1e-2)) {
                if (bad++ < 6)
                    fprintf(stderr, "  %s: d/d%s[%lld] = %g, numeric %g\n", label, prm.name,
                            (long long)i, (double)ana[i], num);
            }
        }
        free(ana);
    }
    CHECK(checked > 0);
    CHECK(bad == 0);
    if (bad) fprintf(stderr, "  %s: %d of %d gradients differ\n", label, bad, checked);
    free(r);
    free(gx);
}

#endif
