/* Convolution geometry, checks and float im2col / col2im (conv_common.h). */
#include "conv_common.h"

#include <string.h>

bie_status bie_conv_check_params(int64_t in_c, int64_t out_c, int k, int s, int p, int d,
                                 const char *who) {
    if (in_c < 1 || out_c < 1 || in_c > INT32_MAX || out_c > INT32_MAX)
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: channels (%lld, %lld) must be in 1..2^31-1",
                        who, (long long)in_c, (long long)out_c);
    if (k < 1 || s < 1 || p < 0 || d < 1)
        return bie_fail(BIE_ERR_INVALID_ARGUMENT,
                        "%s: kernel_size (%d), stride (%d) and dilation "
                        "(%d) must be >= 1 and padding (%d) >= 0",
                        who, k, s, d, p);
    int64_t fan = in_c * k * (int64_t)k, numel;
    if (fan >= (1 << 24) || !bie_mul_ok(fan, out_c, &numel) || numel > INT64_MAX / 8)
        return bie_fail(BIE_ERR_OVERFLOW, "%s: in_c * k * k = %lld must be < 2^24", who,
                        (long long)fan);
    return BIE_OK;
}

int64_t bie_conv_out_extent(int64_t in, int64_t k, int64_t s, int64_t p, int64_t d) {
    int64_t span = d * (k - 1) + 1, padded = in + 2 * p;
    return padded < span ? 0 : (padded - span) / s + 1;
}

bie_status bie_conv_check_input(const bie_tensor *x, int64_t in_c, int64_t k, int64_t s, int64_t p,
                                int64_t d, const char *who) {
    return bie_conv_check_input_as(x, BIE_F32, in_c, k, s, p, d, who);
}

bie_status bie_conv_check_input_as(const bie_tensor *x, bie_dtype dtype, int64_t in_c, int64_t k,
                                   int64_t s, int64_t p, int64_t d, const char *who) {
    if (x == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: input is NULL", who);
    if (x->ndim != 4)
        return bie_fail(BIE_ERR_SHAPE, "%s: input must be NCHW (rank 4), got rank %d", who,
                        x->ndim);
    BIE_TRY(bie_check_rows_tensor(x, "input", dtype, x->shape[3], NULL, who));
    if (x->shape[1] != in_c)
        return bie_fail(BIE_ERR_SHAPE, "%s: input has %lld channels, the layer %lld", who,
                        (long long)x->shape[1], (long long)in_c);
    if (bie_conv_out_extent(x->shape[2], k, s, p, d) < 1 ||
        bie_conv_out_extent(x->shape[3], k, s, p, d) < 1)
        return bie_fail(BIE_ERR_SHAPE,
                        "%s: the dilated kernel (%lld) is larger than the padded "
                        "input (%lld x %lld)",
                        who, (long long)(d * (k - 1) + 1), (long long)(x->shape[2] + 2 * p),
                        (long long)(x->shape[3] + 2 * p));
    return BIE_OK;
}

bie_conv_geom bie_conv_geometry(const bie_tensor *x, int64_t out_c, int64_t k, int64_t s, int64_t p,
                                int64_t d) {
    bie_conv_geom g = {x->shape[0],
                       x->shape[1],
                       x->shape[2],
                       x->shape[3],
                       out_c,
                       bie_conv_out_extent(x->shape[2], k, s, p, d),
                       bie_conv_out_extent(x->shape[3], k, s, p, d),
                       k,
                       s,
                       p,
                       d,
                       0};
    return g;
}

bie_status bie_conv_check_shape4(const bie_tensor *t, const int64_t *shape, const char *what,
                                 const char *who) {
    return bie_conv_check_shape4_as(t, BIE_F32, shape, what, who);
}

bie_status bie_conv_check_shape4_as(const bie_tensor *t, bie_dtype dtype, const int64_t *shape,
                                    const char *what, const char *who) {
    BIE_TRY(bie_check_rows_tensor(t, what, dtype, shape[3], NULL, who));
    if (t->ndim != 4 || memcmp(t->shape, shape, 4 * sizeof(int64_t)) != 0)
        return bie_fail(BIE_ERR_SHAPE, "%s: %s must be [%lld, %lld, %lld, %lld]", who, what,
                        (long long)shape[0], (long long)shape[1], (long long)shape[2],
                        (long long)shape[3]);
    return BIE_OK;
}

void bie_conv_col2im(const bie_conv_geom *g, const float *cols, float *gx) {
    const int64_t plane = g->oh * g->ow, kk = g->k * g->k;
#pragma omp parallel for num_threads(bie_threads()) schedule(static) if (g->c * kk * plane > 65536)
    for (int64_t c = 0; c < g->c; c++) /* each thread owns whole channels: no write races */
        for (int64_t t = 0; t < kk; t++) {
            int64_t i = t / g->k, j = t % g->k;
            const float *row = cols + (c * kk + t) * plane;
            /* at stride 1 the columns that land inside the input are ox in [lo, hi): a plain
             * loop there (each element still gets its taps in the same order) */
            const int64_t shift = j * g->d - g->p;
            int64_t lo = shift < 0 ? -shift : 0, hi = g->w - shift < g->ow ? g->w - shift : g->ow;
            if (hi < lo) hi = lo;
            for (int64_t oy = 0; oy < g->oh; oy++) {
                int64_t iy = bie_conv_in(g, oy, i);
                if (iy < 0 || iy >= g->h) continue;
                float *dst = gx + (c * g->h + iy) * g->w;
                const float *src = row + oy * g->ow;
                if (g->s == 1) {
                    for (int64_t ox = lo; ox < hi; ox++) dst[ox + shift] += src[ox];
                    continue;
                }
                for (int64_t ox = 0; ox < g->ow; ox++) {
                    int64_t ix = bie_conv_in(g, ox, j);
                    if (ix >= 0 && ix < g->w) dst[ix] += src[ox];
                }
            }
        }
}

void bie_conv_im2col_f32(const bie_conv_geom *g, const float *img, float *cols) {
    const int64_t plane = g->oh * g->ow, kk = g->k * g->k;
#pragma omp parallel for num_threads(bie_threads()) schedule(static) if (g->c * kk * plane > 65536)
    for (int64_t r = 0; r < g->c * kk; r++) {
        int64_t c = r / kk, i = (r % kk) / g->k, j = r % g->k;
        float *row = cols + r * plane;
        for (int64_t oy = 0; oy < g->oh; oy++) {
            int64_t iy = bie_conv_in(g, oy, i);
            for (int64_t ox = 0; ox < g->ow; ox++) {
                int64_t ix = bie_conv_in(g, ox, j);
                row[oy * g->ow + ox] = (iy >= 0 && iy < g->h && ix >= 0 && ix < g->w)
                                           ? img[(c * g->h + iy) * g->w + ix]
                                           : 0.0f;
            }
        }
    }
}
