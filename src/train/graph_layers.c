/* The graph's other float layers: average pool, global average pool, add, gradient
 * accumulation, channel concat and RPReLU. Parallel loops split work statically; every sum
 * runs in double in a fixed order (one thread per plane or channel), so results do not
 * depend on the thread count. */
#include <string.h>

#include "train_internal.h"

void bie_avgpool_forward(const float *x, int64_t planes, int64_t h, int64_t w, int k, int s,
                         int64_t oh, int64_t ow, float *y) {
    const double inv = 1.0 / ((double)k * k);
#pragma omp parallel for schedule(static) \
    num_threads(bie_threads()) if (planes * oh * ow * k * k > BIE_TRAIN_PARALLEL_MIN)
    for (int64_t p = 0; p < planes; p++) {
        const float *xp = x + p * h * w;
        for (int64_t oy = 0; oy < oh; oy++)
            for (int64_t ox = 0; ox < ow; ox++) {
                const float *win = xp + oy * s * w + ox * s;
                double sum = 0;
                for (int i = 0; i < k; i++)
                    for (int j = 0; j < k; j++) sum += win[i * w + j];
                y[(p * oh + oy) * ow + ox] = (float)(sum * inv);
            }
    }
}

void bie_avgpool_backward(const float *dy, int64_t planes, int64_t h, int64_t w, int k, int s,
                          int64_t oh, int64_t ow, float *dx) {
    const float inv = (float)(1.0 / ((double)k * k));
    /* One thread per plane: overlapping windows add into the same plane in a fixed order. */
#pragma omp parallel for schedule(static) \
    num_threads(bie_threads()) if (planes * (h * w + oh * ow * k * k) > BIE_TRAIN_PARALLEL_MIN)
    for (int64_t p = 0; p < planes; p++) {
        float *dxp = dx + p * h * w;
        memset(dxp, 0, (size_t)(h * w) * sizeof(float));
        for (int64_t oy = 0; oy < oh; oy++)
            for (int64_t ox = 0; ox < ow; ox++) {
                const float g = dy[(p * oh + oy) * ow + ox] * inv;
                float *win = dxp + oy * s * w + ox * s;
                for (int i = 0; i < k; i++)
                    for (int j = 0; j < k; j++) win[i * w + j] += g;
            }
    }
}

void bie_global_avgpool_forward(const float *x, int64_t planes, int64_t inner, float *y) {
#pragma omp parallel for schedule(static) \
    num_threads(bie_threads()) if (planes * inner > BIE_TRAIN_PARALLEL_MIN)
    for (int64_t p = 0; p < planes; p++) {
        const float *xp = x + p * inner;
        double sum = 0;
        for (int64_t i = 0; i < inner; i++) sum += xp[i];
        y[p] = (float)(sum / (double)inner);
    }
}

void bie_global_avgpool_backward(const float *dy, int64_t planes, int64_t inner, float *dx) {
#pragma omp parallel for schedule(static) \
    num_threads(bie_threads()) if (planes * inner > BIE_TRAIN_PARALLEL_MIN)
    for (int64_t p = 0; p < planes; p++) {
        const float g = (float)((double)dy[p] / (double)inner);
        float *dxp = dx + p * inner;
        for (int64_t i = 0; i < inner; i++) dxp[i] = g;
    }
}

/* Element by element: y may be a or b. */
void bie_add_forward(const float *a, const float *b, int64_t n, float *y) {
#pragma omp parallel for schedule(static) num_threads(bie_threads()) if (n > BIE_TRAIN_PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) y[i] = a[i] + b[i];
}

void bie_accumulate(float *acc, const float *x, int64_t n) {
#pragma omp parallel for schedule(static) num_threads(bie_threads()) if (n > BIE_TRAIN_PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) acc[i] += x[i];
}

void bie_concat_copy(const float *x, int64_t outer, int64_t ci, int64_t inner, int64_t ctotal,
                     int64_t offset, float *y) {
    const int64_t block = ci * inner;
#pragma omp parallel for schedule(static) \
    num_threads(bie_threads()) if (outer * block > BIE_TRAIN_PARALLEL_MIN)
    for (int64_t o = 0; o < outer; o++)
        memcpy(y + (o * ctotal + offset) * inner, x + o * block, (size_t)block * sizeof(float));
}

void bie_concat_slice(const float *y, int64_t outer, int64_t ci, int64_t inner, int64_t ctotal,
                      int64_t offset, float *x) {
    const int64_t block = ci * inner;
#pragma omp parallel for schedule(static) \
    num_threads(bie_threads()) if (outer * block > BIE_TRAIN_PARALLEL_MIN)
    for (int64_t o = 0; o < outer; o++)
        memcpy(x + o * block, y + (o * ctotal + offset) * inner, (size_t)block * sizeof(float));
}

void bie_rprelu_forward(const float *x, int64_t outer, int64_t channels, int64_t inner,
                        const float *shift_in, const float *slopes, const float *shift_out,
                        float *y) {
#pragma omp parallel for schedule(static) \
    num_threads(bie_threads()) if (outer * channels * inner > BIE_TRAIN_PARALLEL_MIN)
    for (int64_t oc = 0; oc < outer * channels; oc++) {
        const int64_t c = oc % channels;
        const float a = slopes[c], si = shift_in[c], so = shift_out[c];
        const float *xs = x + oc * inner;
        float *ys = y + oc * inner;
        for (int64_t i = 0; i < inner; i++) {
            const float t = xs[i] + si;
            ys[i] = (t >= 0 ? t : a * t) + so;
        }
    }
}

/* One thread per channel: its three sums walk the batch, then the positions, in order. */
void bie_rprelu_backward(const float *x, const float *dy, int64_t outer, int64_t channels,
                         int64_t inner, const float *shift_in, const float *slopes, float *dx,
                         float *dshift_in, float *dslopes, float *dshift_out) {
#pragma omp parallel for schedule(static) \
    num_threads(bie_threads()) if (outer * channels * inner > BIE_TRAIN_PARALLEL_MIN)
    for (int64_t c = 0; c < channels; c++) {
        const float a = slopes[c], si = shift_in[c];
        double s_in = 0, s_slope = 0, s_out = 0;
        for (int64_t o = 0; o < outer; o++) {
            const int64_t base = (o * channels + c) * inner;
            for (int64_t i = 0; i < inner; i++) {
                const float t = x[base + i] + si, g = dy[base + i];
                const float gx = t >= 0 ? g : a * g;
                if (t < 0) s_slope += (double)g * t;
                s_in += gx;
                s_out += g;
                if (dx) dx[base + i] = gx;
            }
        }
        dshift_in[c] = (float)s_in;
        dslopes[c] = (float)s_slope;
        dshift_out[c] = (float)s_out;
    }
}
