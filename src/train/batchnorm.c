/* Batch normalisation over [n, c, inner] (BatchNorm1d: inner = 1; BatchNorm2d: inner = H W),
 * as PyTorch defines it. One thread per channel; sums run in double in a fixed order. */
#include <math.h>

#include "train_internal.h"

void bie_batchnorm_forward_train(const float *x, int64_t n, int64_t c, int64_t inner,
                                 const float *gamma, const float *beta, float eps, float *y,
                                 float *xhat, float *invstd, float *batch_mean, float *batch_var) {
    const int64_t count = n * inner;
#pragma omp parallel for schedule(static) \
    num_threads(bie_threads()) if (n * c * inner > BIE_TRAIN_PARALLEL_MIN)
    for (int64_t ch = 0; ch < c; ch++) {
        double sum = 0;
        for (int64_t b = 0; b < n; b++)
            for (int64_t i = 0; i < inner; i++) sum += x[(b * c + ch) * inner + i];
        const double mean = sum / (double)count;
        double sq = 0;
        for (int64_t b = 0; b < n; b++)
            for (int64_t i = 0; i < inner; i++) {
                const double d = x[(b * c + ch) * inner + i] - mean;
                sq += d * d;
            }
        const double var = sq / (double)count; /* biased: what normalises the batch */
        const double is = 1.0 / sqrt(var + (double)eps);
        invstd[ch] = (float)is;
        for (int64_t b = 0; b < n; b++)
            for (int64_t i = 0; i < inner; i++) {
                const int64_t at = (b * c + ch) * inner + i;
                const float xh = (float)((x[at] - mean) * is);
                xhat[at] = xh;
                y[at] = gamma[ch] * xh + beta[ch];
            }
        /* running statistics keep the unbiased variance, as PyTorch does */
        batch_mean[ch] = (float)mean;
        batch_var[ch] = (float)(count > 1 ? sq / (double)(count - 1) : var);
    }
}

void bie_batchnorm_update_running(int64_t c, float momentum, const float *batch_mean,
                                  const float *batch_var, float *running_mean, float *running_var) {
    for (int64_t ch = 0; ch < c; ch++) {
        running_mean[ch] = (1.0f - momentum) * running_mean[ch] + momentum * batch_mean[ch];
        running_var[ch] = (1.0f - momentum) * running_var[ch] + momentum * batch_var[ch];
    }
}

void bie_batchnorm_forward_eval(const float *x, int64_t n, int64_t c, int64_t inner,
                                const float *gamma, const float *beta, float eps,
                                const float *running_mean, const float *running_var, float *y) {
#pragma omp parallel for schedule(static) \
    num_threads(bie_threads()) if (n * c * inner > BIE_TRAIN_PARALLEL_MIN)
    for (int64_t bc = 0; bc < n * c; bc++) {
        const int64_t ch = bc % c;
        const float scale = (float)(gamma[ch] / sqrt((double)running_var[ch] + (double)eps));
        const float shift = beta[ch] - running_mean[ch] * scale;
        for (int64_t i = bc * inner; i < (bc + 1) * inner; i++) y[i] = x[i] * scale + shift;
    }
}

/* dx = gamma invstd / count * (count dy - sum(dy) - xhat sum(dy xhat)). */
void bie_batchnorm_backward(const float *xhat, const float *invstd, const float *dy, int64_t n,
                            int64_t c, int64_t inner, const float *gamma, float *dx, float *dgamma,
                            float *dbeta) {
    const int64_t count = n * inner;
#pragma omp parallel for schedule(static) \
    num_threads(bie_threads()) if (n * c * inner > BIE_TRAIN_PARALLEL_MIN)
    for (int64_t ch = 0; ch < c; ch++) {
        double sdy = 0, sdyx = 0;
        for (int64_t b = 0; b < n; b++)
            for (int64_t i = 0; i < inner; i++) {
                const int64_t at = (b * c + ch) * inner + i;
                sdy += dy[at];
                sdyx += (double)dy[at] * xhat[at];
            }
        dgamma[ch] = (float)sdyx;
        dbeta[ch] = (float)sdy;
        if (dx == NULL) continue;
        const double k = (double)gamma[ch] * invstd[ch] / (double)count;
        for (int64_t b = 0; b < n; b++)
            for (int64_t i = 0; i < inner; i++) {
                const int64_t at = (b * c + ch) * inner + i;
                dx[at] = (float)(k * ((double)count * dy[at] - sdy - xhat[at] * sdyx));
            }
    }
}
