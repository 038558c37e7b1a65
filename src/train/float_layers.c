/* Float layers a low-bit network needs around its binary layers: linear (OpenBLAS), ReLU,
 * PReLU, max-pool. Parallel loops split work statically and every sum runs in a fixed
 * order, so results do not depend on scheduling. */
#include <cblas.h>
#include <string.h>

#include "train_internal.h"

/* The shared splitmix64 stream behind every float layer's initialisation. */
uint64_t bie_train_splitmix64(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void bie_train_fill_uniform(float *dst, int64_t n, double bound, uint64_t *state) {
    for (int64_t i = 0; i < n; i++) {
        double u = (double)(bie_train_splitmix64(state) >> 11) * (1.0 / 9007199254740992.0);
        dst[i] = (float)((2.0 * u - 1.0) * bound);
    }
}

void bie_linear_forward(const float *x, int64_t m, int64_t in, int64_t out, const float *w,
                        const float *b, float *y) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m, (int)out, (int)in, 1.0f, x,
                (int)in, w, (int)in, 0.0f, y, (int)out);
    if (b == NULL) return;
#pragma omp parallel for schedule(static) \
    num_threads(bie_threads()) if (m * out > BIE_TRAIN_PARALLEL_MIN)
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < out; j++) y[i * out + j] += b[j];
}

void bie_linear_backward(const float *x, const float *dy, int64_t m, int64_t in, int64_t out,
                         const float *w, float *dx, float *dw, float *db) {
    if (dx)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)in, (int)out, 1.0f, dy,
                    (int)out, w, (int)in, 0.0f, dx, (int)in);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)out, (int)in, (int)m, 1.0f, dy,
                (int)out, x, (int)in, 0.0f, dw, (int)in);
    if (db == NULL) return;
        /* Column sums: each thread owns a block of columns and walks the rows in order. */
#pragma omp parallel for schedule(static) \
    num_threads(bie_threads()) if (m * out > BIE_TRAIN_PARALLEL_MIN)
    for (int64_t j = 0; j < out; j++) {
        double s = 0;
        for (int64_t i = 0; i < m; i++) s += dy[i * out + j];
        db[j] = (float)s;
    }
}

void bie_relu_forward(const float *x, int64_t n, float *y) {
#pragma omp parallel for schedule(static) num_threads(bie_threads()) if (n > BIE_TRAIN_PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) y[i] = x[i] > 0 ? x[i] : 0.0f;
}

/* The output is positive exactly where the input was: no need to keep the input. */
void bie_relu_backward(const float *y, const float *dy, int64_t n, float *dx) {
#pragma omp parallel for schedule(static) num_threads(bie_threads()) if (n > BIE_TRAIN_PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) dx[i] = y[i] > 0 ? dy[i] : 0.0f;
}

void bie_prelu_forward(const float *x, int64_t outer, int64_t channels, int64_t inner,
                       const float *slopes, int64_t n_slopes, float *y) {
#pragma omp parallel for schedule(static) \
    num_threads(bie_threads()) if (outer * channels * inner > BIE_TRAIN_PARALLEL_MIN)
    for (int64_t oc = 0; oc < outer * channels; oc++) {
        const float a = slopes[n_slopes == 1 ? 0 : oc % channels];
        const float *xs = x + oc * inner;
        float *ys = y + oc * inner;
        for (int64_t i = 0; i < inner; i++) ys[i] = xs[i] >= 0 ? xs[i] : a * xs[i];
    }
}

void bie_prelu_backward(const float *x, const float *dy, int64_t outer, int64_t channels,
                        int64_t inner, const float *slopes, int64_t n_slopes, float *dx,
                        float *dslopes) {
    if (dx) {
#pragma omp parallel for schedule(static) \
    num_threads(bie_threads()) if (outer * channels * inner > BIE_TRAIN_PARALLEL_MIN)
        for (int64_t oc = 0; oc < outer * channels; oc++) {
            const float a = slopes[n_slopes == 1 ? 0 : oc % channels];
            for (int64_t i = oc * inner; i < (oc + 1) * inner; i++)
                dx[i] = x[i] >= 0 ? dy[i] : a * dy[i];
        }
    }
    /* d slope = sum of dy * x over the negative inputs of its channel(s), in a fixed order:
     * one thread per channel, or one pass for a shared slope. */
    if (n_slopes == 1) {
        double s = 0;
        for (int64_t i = 0; i < outer * channels * inner; i++)
            if (x[i] < 0) s += (double)dy[i] * x[i];
        dslopes[0] = (float)s;
        return;
    }
#pragma omp parallel for schedule(static) \
    num_threads(bie_threads()) if (outer * channels * inner > BIE_TRAIN_PARALLEL_MIN)
    for (int64_t c = 0; c < channels; c++) {
        double s = 0;
        for (int64_t o = 0; o < outer; o++) {
            const int64_t base = (o * channels + c) * inner;
            for (int64_t i = 0; i < inner; i++)
                if (x[base + i] < 0) s += (double)dy[base + i] * x[base + i];
        }
        dslopes[c] = (float)s;
    }
}

void bie_maxpool_forward(const float *x, int64_t planes, int64_t h, int64_t w, int k, int s,
                         int64_t oh, int64_t ow, float *y, int32_t *argmax) {
#pragma omp parallel for schedule(static) \
    num_threads(bie_threads()) if (planes * oh * ow * k * k > BIE_TRAIN_PARALLEL_MIN)
    for (int64_t p = 0; p < planes; p++) {
        const float *xp = x + p * h * w;
        for (int64_t oy = 0; oy < oh; oy++)
            for (int64_t ox = 0; ox < ow; ox++) {
                int64_t best = oy * s * w + ox * s;
                for (int i = 0; i < k; i++)
                    for (int j = 0; j < k; j++) {
                        const int64_t at = (oy * s + i) * w + ox * s + j;
                        if (xp[at] > xp[best]) best = at; /* first maximum wins ties */
                    }
                y[(p * oh + oy) * ow + ox] = xp[best];
                if (argmax) argmax[(p * oh + oy) * ow + ox] = (int32_t)best;
            }
    }
}

void bie_maxpool_backward(const float *dy, const int32_t *argmax, int64_t planes, int64_t h,
                          int64_t w, int64_t oh, int64_t ow, float *dx) {
    /* One thread per plane: overlapping windows add into the same plane in a fixed order. */
#pragma omp parallel for schedule(static) \
    num_threads(bie_threads()) if (planes * h * w > BIE_TRAIN_PARALLEL_MIN)
    for (int64_t p = 0; p < planes; p++) {
        float *dxp = dx + p * h * w;
        memset(dxp, 0, (size_t)(h * w) * sizeof(float));
        for (int64_t o = p * oh * ow; o < (p + 1) * oh * ow; o++) dxp[argmax[o]] += dy[o];
    }
}
