/* Scalar references of the low-bit layers' math, straight from SPEC §1-4, shared by the layer
 * tests. Every layer is seen as a convolution: a linear layer on m rows of `in` features is a
 * convolution of m images of in channels and 1x1 pixels with a 1x1 kernel (same memory
 * layout for x [m, in], weight [out, in] and out [m, out]), so one forward and one backward
 * serve all four kinds. What differs between binary and 4-bit layers is a ref_quant: the
 * activation code, the clip range, the scales and the grad_scale_a term. */
#ifndef BIE_TEST_LAYER_REF_H
#define BIE_TEST_LAYER_REF_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

#include "bie.h"

/* sign(v) = +1 if v >= 0 else -1 (SPEC §1: zero maps to +1). */
static inline int ref_sign(float v) { return v >= 0 ? 1 : -1; }

/* q4(v, s) = clamp(rint(v / s), -8, 7) with round-half-to-even (SPEC §1). */
static inline int8_t ref_q4(float v, float s) {
    float q = nearbyintf(v / s);
    return (int8_t)(q < -8 ? -8 : q > 7 ? 7 : q);
}

/* Output extent of a convolution axis: floor((in + 2p - d(k - 1) - 1) / s) + 1. */
static inline int64_t ref_out_size(int64_t in, int64_t k, int64_t s, int64_t p, int64_t d) {
    return (in + 2 * p - d * (k - 1) - 1) / s + 1;
}

/* n images of c channels and h x w pixels into o channels; square kernel k, stride s,
 * padding p, dilation d. */
typedef struct {
    int64_t n, c, h, w, o, k, s, p, d;
} ref_geom;

/* A linear layer on m rows: 1x1 images, 1x1 kernel. */
static inline ref_geom ref_linear_geom(int64_t m, int64_t in, int64_t out) {
    return (ref_geom){m, in, 1, 1, out, 1, 1, 0, 1};
}
static inline int64_t ref_oh(const ref_geom *g) {
    return ref_out_size(g->h, g->k, g->s, g->p, g->d);
}
static inline int64_t ref_ow(const ref_geom *g) {
    return ref_out_size(g->w, g->k, g->s, g->p, g->d);
}
static inline int64_t ref_numel_x(const ref_geom *g) { return g->n * g->c * g->h * g->w; }
static inline int64_t ref_numel_out(const ref_geom *g) {
    return g->n * g->o * ref_oh(g) * ref_ow(g);
}
static inline int64_t ref_fan_in(const ref_geom *g) { return g->c * g->k * g->k; }

/* What distinguishes binary (SPEC §2-3) from 4-bit (SPEC §4) layers. */
typedef struct {
    /* the code of x' = x + bias_a in the product: sign(x') or q4(x', scale_a) */
    int (*act_code)(float xp, float scale_a);
    /* 1{lo <= x' / scale_a <= hi}, the quotient in float as the forward evaluates it */
    float clip_lo, clip_hi;
    /* grad_scale_a = sum(grad_x * term(x')) / sqrt(numel(x') * gs_norm) */
    double (*gs_term)(float xp, float scale_a);
    double gs_norm;
    /* the 4-bit layers keep an 8-bit rounding residual (resolution 1/254, so an error of at
     * most 1/508 per element) in place of the float input: grad_scale_a may be off by
     * gs_resolution * sum|grad_x| / sqrt(numel * gs_norm) */
    double gs_resolution;
    /* scale_a measured on the first input (before the shift) */
    float (*scale_a)(const float *x, int64_t n, bool symmetric);
    /* scale_w that prepare_params derives from the float weight */
    float (*scale_w)(const float *w, int64_t n);
    /* the weight's codes: sign of the (int8 or float) weight, or q4(w, scale_w) */
    int8_t (*weight_code)(const bie_tensor *weight, int64_t i, float scale_w);
} ref_quant;

static inline int ref_binary_act(float xp, float scale_a) {
    (void)scale_a;
    return ref_sign(xp);
}
static inline int ref_q4_act(float xp, float scale_a) { return ref_q4(xp, scale_a); }
static inline double ref_binary_gs_term(float xp, float scale_a) {
    (void)scale_a;
    return ref_sign(xp);
}
static inline double ref_q4_gs_term(float xp, float scale_a) {
    float v = xp / scale_a;
    return (double)(nearbyintf(v) - v);
}
static inline double ref_mean_abs(const float *x, int64_t n) {
    double sum = 0;
    for (int64_t i = 0; i < n; i++) sum += fabs((double)x[i]);
    return sum / (double)n;
}
/* 2 mean|x| (symmetric) or 4 mean|x| */
static inline float ref_binary_scale_a(const float *x, int64_t n, bool symmetric) {
    double sum = 0;
    for (int64_t i = 0; i < n; i++) sum += fabs((double)x[i]);
    return (float)((symmetric ? 2.0 : 4.0) * sum / (double)n);
}
/* 2 mean|x| / 11.269 */
static inline float ref_q4_scale_a(const float *x, int64_t n, bool symmetric) {
    (void)symmetric;
    double sum = 0;
    for (int64_t i = 0; i < n; i++) sum += fabs((double)x[i]);
    return (float)((2.0 / 11.269) * sum / (double)n);
}
/* sum|w| / numel */
static inline float ref_binary_scale_w(const float *w, int64_t n) {
    return (float)ref_mean_abs(w, n);
}
/* max(2 mean|w| / 5.6345, 1e-5) */
static inline float ref_q4_scale_w(const float *w, int64_t n) {
    double sum = 0;
    for (int64_t i = 0; i < n; i++) sum += fabs((double)w[i]);
    float s = (float)(2.0 * sum / (double)n / 5.6345);
    return s > 1e-5f ? s : 1e-5f;
}
static inline int8_t ref_binary_weight_code(const bie_tensor *w, int64_t i, float scale_w) {
    (void)scale_w;
    return (int8_t)(w->dtype == BIE_I8 ? (((const int8_t *)w->data)[i] >= 0 ? 1 : -1)
                                       : ref_sign(((const float *)w->data)[i]));
}
static inline int8_t ref_q4_weight_code(const bie_tensor *w, int64_t i, float scale_w) {
    return ref_q4(((const float *)w->data)[i], scale_w);
}

static const ref_quant REF_BINARY = {ref_binary_act,
                                     -1.0f,
                                     1.0f,
                                     ref_binary_gs_term,
                                     1.0,
                                     0.0,
                                     ref_binary_scale_a,
                                     ref_binary_scale_w,
                                     ref_binary_weight_code};
static const ref_quant REF_Q4 = {
    ref_q4_act,  -8.0f,          7.0f,           ref_q4_gs_term,    7.0,
    1.0 / 508.0, ref_q4_scale_a, ref_q4_scale_w, ref_q4_weight_code};

/* The flat indices of input element (n, c, y, x) and weight element (o, c, i, j). */
static inline int64_t ref_xi(const ref_geom *g, int64_t n, int64_t c, int64_t y, int64_t x) {
    return ((n * g->c + c) * g->h + y) * g->w + x;
}
static inline int64_t ref_wi(const ref_geom *g, int64_t o, int64_t c, int64_t i, int64_t j) {
    return ((o * g->c + c) * g->k + i) * g->k + j;
}

/* Visit every (output element, input element, weight element) triple of the convolution whose
 * tap lies inside the input (taps outside contribute 0: zero padding). */
#define REF_FOR_TAPS(g, oi, xi, wi, ...)                                                      \
    do {                                                                                      \
        const int64_t oh_ = ref_oh(g), ow_ = ref_ow(g);                                       \
        for (int64_t n_ = 0; n_ < (g)->n; n_++)                                               \
            for (int64_t o_ = 0; o_ < (g)->o; o_++)                                           \
                for (int64_t y_ = 0; y_ < oh_; y_++)                                          \
                    for (int64_t x_ = 0; x_ < ow_; x_++) {                                    \
                        const int64_t oi = ((n_ * (g)->o + o_) * oh_ + y_) * ow_ + x_;        \
                        for (int64_t c_ = 0; c_ < (g)->c; c_++)                               \
                            for (int64_t i_ = 0; i_ < (g)->k; i_++)                           \
                                for (int64_t j_ = 0; j_ < (g)->k; j_++) {                     \
                                    const int64_t iy_ = y_ * (g)->s - (g)->p + i_ * (g)->d;   \
                                    const int64_t ix_ = x_ * (g)->s - (g)->p + j_ * (g)->d;   \
                                    if (iy_ < 0 || iy_ >= (g)->h || ix_ < 0 || ix_ >= (g)->w) \
                                        continue;                                             \
                                    const int64_t xi = ref_xi(g, n_, c_, iy_, ix_);           \
                                    const int64_t wi = ref_wi(g, o_, c_, i_, j_);             \
                                    __VA_ARGS__                                               \
                                }                                                             \
                    }                                                                         \
    } while (0)

/* x' = x + bias_a[c] for input element xi. */
static inline float ref_shifted(const ref_geom *g, const float *x, const float *bias, int64_t xi) {
    return x[xi] + bias[(xi / (g->h * g->w)) % g->c];
}

/* Forward: out[n, o, y, x] = (float)dot * (scale_a * scale_w), dot exact in 64-bit integers
 * over the activation codes of x + bias_a and the weight codes wcode [o, c, k, k]. */
static inline void ref_forward(const ref_geom *g, const ref_quant *q, const float *x,
                               const float *bias, const int8_t *wcode, float scale_a, float scale_w,
                               float *out) {
    const int64_t no = ref_numel_out(g);
    int64_t *dot = calloc((size_t)no, sizeof(int64_t));
    if (dot == NULL) abort();
    REF_FOR_TAPS(g, oi, xi, wi, {
        dot[oi] += (int64_t)q->act_code(ref_shifted(g, x, bias, xi), scale_a) * wcode[wi];
    });
    const float scale = scale_a * scale_w;
    for (int64_t i = 0; i < no; i++) out[i] = (float)dot[i] * scale;
    free(dot);
}

/* Backward in double precision (SPEC §2-4): grad_x = conv_input(grad_out, wcode * scale_w)
 * clipped to the activation's range; grad_w = conv_weight(act_code(x') * scale_a, grad_out);
 * grad_bias_a[c] = sum of grad_x over channel c; grad_scale_a from the quant's term.
 * gx [numel x], gw [o, c, k, k], gb [c] are zeroed and filled here; *gs_tol receives the
 * absolute error the quant's saved state allows in grad_scale_a. */
static inline void ref_backward(const ref_geom *g, const ref_quant *q, const float *x,
                                const float *bias, const int8_t *wcode, float scale_a,
                                float scale_w, const float *gout, double *gx, double *gw,
                                double *gb, double *gs, double *gs_tol) {
    const int64_t nx = ref_numel_x(g), hw = g->h * g->w;
    for (int64_t i = 0; i < nx; i++) gx[i] = 0;
    for (int64_t i = 0; i < g->o * ref_fan_in(g); i++) gw[i] = 0;
    for (int64_t c = 0; c < g->c; c++) gb[c] = 0;
    REF_FOR_TAPS(g, oi, xi, wi, {
        gx[xi] += (double)gout[oi] * wcode[wi] * (double)scale_w;
        gw[wi] +=
            (double)gout[oi] * q->act_code(ref_shifted(g, x, bias, xi), scale_a) * (double)scale_a;
    });
    double sum = 0, abs_sum = 0;
    for (int64_t i = 0; i < nx; i++) {
        const float xp = ref_shifted(g, x, bias, i), v = xp / scale_a;
        if (!(v >= q->clip_lo && v <= q->clip_hi)) gx[i] = 0;
        sum += gx[i] * q->gs_term(xp, scale_a);
        abs_sum += fabs(gx[i]);
        gb[(i / hw) % g->c] += gx[i];
    }
    const double root = sqrt((double)nx * q->gs_norm);
    *gs = sum / root;
    *gs_tol = q->gs_resolution * abs_sum / root;
}

/* ||got - ref|| <= tol ||ref|| + 1e-6 (Euclidean norms). */
static inline bool ref_close(const float *got, const double *ref, int64_t n, double tol) {
    double e = 0, r = 0;
    for (int64_t i = 0; i < n; i++) {
        e += ((double)got[i] - ref[i]) * ((double)got[i] - ref[i]);
        r += ref[i] * ref[i];
    }
    return sqrt(e) <= tol * sqrt(r) + 1e-6;
}

/* An int8 gradient: the narrow-range per-tensor quantization of the float gradient ref
 * (SPEC §1), each code within one step. */
static inline bool ref_int8_grad_ok(const int8_t *got, const double *ref, int64_t n) {
    double amax = 0;
    for (int64_t i = 0; i < n; i++) amax = fmax(amax, fabs(ref[i]));
    for (int64_t i = 0; i < n; i++) {
        double q = amax > 0 ? nearbyint(ref[i] * 127.0 / amax) : 0;
        if (fabs(got[i] - q) > 1) return false;
    }
    return true;
}

#endif
