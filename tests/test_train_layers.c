/* The float layers of the training library (linear, batch norm 1d / 2d, ReLU, PReLU,
 * max-pool, flatten) and softmax cross-entropy: forward against direct formulas, every
 * gradient against central finite differences on random data of odd shapes, batch-norm
 * running statistics and evaluation mode against their definitions. */
#include "train/train_test_util.h"

/* Values at least `gap` away from 0 (ReLU / PReLU kinks). */
static void fill_away_from_zero(float *x, int64_t n, float gap) {
    for (int64_t i = 0; i < n; i++) {
        const float v = tu_uniform(gap, 1.5f);
        x[i] = tu_next() & 1 ? v : -v;
    }
}

/* Distinct values with gaps of 0.05 in random order (max-pool windows have one clear max). */
static void fill_distinct(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = 0.05f * (float)i - 0.025f * (float)n;
    for (int64_t i = n - 1; i > 0; i--) {
        const int64_t j = (int64_t)(tu_next() % (uint64_t)(i + 1));
        const float t = x[i];
        x[i] = x[j];
        x[j] = t;
    }
}

static void randomise_float_params(bie_model *m, float lo, float hi) {
    for (int p = 0; p < bie_model_param_count(m); p++) {
        bie_model_param prm;
        CHECK_OK(bie_model_param_get(m, p, &prm));
        if (prm.kind == BIE_PARAM_KIND_FLOAT)
            tu_fill(prm.value.data, bie_tensor_numel(&prm.value), lo, hi);
    }
}

static void test_linear(int64_t rows, int64_t in, int64_t out, bool bias, int ndim) {
    bie_model *m = NULL;
    CHECK_OK(bie_model_create(&m));
    CHECK_OK(bie_model_add_linear(m, in, out, bias));
    CHECK_OK(bie_model_reset_parameters(m, 7 + (uint64_t)in));
    int64_t shape[3] = {ndim == 3 ? 2 : rows, ndim == 3 ? rows : in, in};
    const int64_t m_rows = ndim == 3 ? 2 * rows : rows;
    float *x = tu_alloc((size_t)(m_rows * in) * 4);
    tu_fill(x, m_rows * in, -1, 1);
    bie_tensor tx = ttu_view(x, ndim, shape), y;
    CHECK_OK(bie_model_forward(m, &tx, &y));
    CHECK(y.ndim == ndim && y.shape[ndim - 1] == out);
    /* direct formula */
    bie_model_param w, b;
    CHECK_OK(bie_model_param_find(m, "0.weight", &w));
    CHECK(w.value.ndim == 2 && w.value.shape[0] == out && w.value.shape[1] == in);
    if (bias)
        CHECK_OK(bie_model_param_find(m, "0.bias", &b));
    else
        CHECK(bie_model_param_find(m, "0.bias", &b) == BIE_ERR_INVALID_ARGUMENT);
    int bad = 0;
    for (int64_t i = 0; i < m_rows; i++)
        for (int64_t j = 0; j < out; j++) {
            double s = bias ? ((float *)b.value.data)[j] : 0.0;
            for (int64_t k = 0; k < in; k++)
                s += (double)x[i * in + k] * ((float *)w.value.data)[j * in + k];
            bad += !ttu_close(((float *)y.data)[i * out + j], s, 1e-5, 1e-5);
        }
    CHECK(bad == 0);
    char label[64];
    snprintf(label, sizeof label, "linear %lldx%lld->%lld", (long long)m_rows, (long long)in,
             (long long)out);
    ttu_grad_check(m, x, ndim, shape, label);
    free(x);
    bie_model_free(m);
}

static void test_batchnorm(int two_d, int64_t n, int64_t c, int64_t h, int64_t w) {
    bie_model *m = NULL;
    CHECK_OK(bie_model_create(&m));
    CHECK_OK(two_d ? bie_model_add_batchnorm2d(m, c) : bie_model_add_batchnorm1d(m, c));
    const int ndim = two_d ? 4 : 2;
    int64_t shape[4] = {n, c, h, w};
    const int64_t inner = two_d ? h * w : 1, nx = n * c * inner;
    float *x = tu_alloc((size_t)nx * 4);
    for (int64_t i = 0; i < nx; i++)
        x[i] =
            tu_uniform(-1, 1) * (1.0f + (float)((i / inner) % c)) + 0.3f * (float)((i / inner) % c);
    bie_model_param gamma, beta, rm, rv;
    CHECK_OK(bie_model_param_find(m, "0.weight", &gamma));
    CHECK_OK(bie_model_param_find(m, "0.bias", &beta));
    CHECK_OK(bie_model_param_find(m, "0.running_mean", &rm));
    CHECK_OK(bie_model_param_find(m, "0.running_var", &rv));
    CHECK(rm.kind == BIE_PARAM_KIND_BUFFER && rv.kind == BIE_PARAM_KIND_BUFFER &&
          rm.grad.data == NULL);
    tu_fill(gamma.value.data, c, 0.5f, 1.5f);
    tu_fill(beta.value.data, c, -0.5f, 0.5f);

    /* one training forward: batch statistics normalise, running ones move by momentum 0.1 */
    bie_tensor tx = ttu_view(x, ndim, shape), y;
    CHECK_OK(bie_model_forward(m, &tx, &y));
    int bad = 0;
    for (int64_t ch = 0; ch < c; ch++) {
        double s = 0, sq = 0;
        const int64_t cnt = n * inner;
        for (int64_t b = 0; b < n; b++)
            for (int64_t i = 0; i < inner; i++) s += x[(b * c + ch) * inner + i];
        const double mean = s / (double)cnt;
        for (int64_t b = 0; b < n; b++)
            for (int64_t i = 0; i < inner; i++) sq += pow(x[(b * c + ch) * inner + i] - mean, 2);
        const double var = sq / (double)cnt, g = ((float *)gamma.value.data)[ch],
                     be = ((float *)beta.value.data)[ch];
        for (int64_t b = 0; b < n; b++)
            for (int64_t i = 0; i < inner; i++) {
                const int64_t at = (b * c + ch) * inner + i;
                bad += !ttu_close(((float *)y.data)[at], g * (x[at] - mean) / sqrt(var + 1e-5) + be,
                                  1e-5, 1e-4);
            }
        bad += !ttu_close(((float *)rm.value.data)[ch], 0.1 * mean, 1e-6, 1e-5);
        bad += !ttu_close(((float *)rv.value.data)[ch], 0.9 + 0.1 * sq / (double)(cnt - 1), 1e-6,
                          1e-5);
    }
    CHECK(bad == 0);

    char label[64];
    snprintf(label, sizeof label, "batchnorm%dd c=%lld", two_d ? 2 : 1, (long long)c);
    ttu_grad_check(m, x, ndim, shape, label);

    /* evaluation mode: running statistics, against the formula */
    tu_fill(rm.value.data, c, -0.5f, 0.5f);
    tu_fill(rv.value.data, c, 0.3f, 2.0f);
    CHECK_OK(bie_model_set_training(m, false));
    float *before = tu_alloc((size_t)c * 8);
    memcpy(before, rm.value.data, (size_t)c * 4);
    memcpy(before + c, rv.value.data, (size_t)c * 4);
    CHECK_OK(bie_model_forward(m, &tx, &y));
    bad = 0;
    for (int64_t at = 0; at < nx; at++) {
        const int64_t ch = (at / inner) % c;
        const double want = ((float *)gamma.value.data)[ch] *
                                (x[at] - ((float *)rm.value.data)[ch]) /
                                sqrt(((float *)rv.value.data)[ch] + 1e-5) +
                            ((float *)beta.value.data)[ch];
        bad += !ttu_close(((float *)y.data)[at], want, 1e-5, 1e-4);
    }
    CHECK(bad == 0);
    CHECK(memcmp(before, rm.value.data, (size_t)c * 4) == 0 &&
          memcmp(before + c, rv.value.data, (size_t)c * 4) == 0);
    /* no backward after an evaluation forward */
    float *gy = tu_alloc((size_t)nx * 4);
    tu_fill(gy, nx, -1, 1);
    bie_tensor tgy = ttu_view(gy, ndim, shape);
    CHECK(bie_model_backward(m, &tgy, NULL) == BIE_ERR_STATE);
    free(gy);
    free(before);
    free(x);
    bie_model_free(m);
}

static void test_relu_prelu(void) {
    { /* ReLU */
        bie_model *m = NULL;
        CHECK_OK(bie_model_create(&m));
        CHECK_OK(bie_model_add_relu(m));
        int64_t shape[2] = {3, 11};
        float x[33];
        fill_away_from_zero(x, 33, 0.05f);
        bie_tensor tx = ttu_view(x, 2, shape), y;
        CHECK_OK(bie_model_forward(m, &tx, &y));
        int bad = 0;
        for (int i = 0; i < 33; i++) bad += ((float *)y.data)[i] != (x[i] > 0 ? x[i] : 0.0f);
        CHECK(bad == 0);
        ttu_grad_check(m, x, 2, shape, "relu");
        bie_model_free(m);
    }
    for (int per_channel = 0; per_channel < 2; per_channel++) { /* PReLU */
        bie_model *m = NULL;
        CHECK_OK(bie_model_create(&m));
        int64_t shape[4] = {2, 3, 4, 5};
        CHECK_OK(bie_model_add_prelu(m, per_channel ? 3 : 1));
        bie_model_param a;
        CHECK_OK(bie_model_param_find(m, "0.weight", &a));
        CHECK(((float *)a.value.data)[0] == 0.25f);
        tu_fill(a.value.data, per_channel ? 3 : 1, 0.1f, 0.6f);
        float x[120];
        fill_away_from_zero(x, 120, 0.05f);
        bie_tensor tx = ttu_view(x, 4, shape), y;
        CHECK_OK(bie_model_forward(m, &tx, &y));
        int bad = 0;
        for (int i = 0; i < 120; i++) {
            const float s = ((float *)a.value.data)[per_channel ? (i / 20) % 3 : 0];
            bad += ((float *)y.data)[i] != (x[i] >= 0 ? x[i] : s * x[i]);
        }
        CHECK(bad == 0);
        ttu_grad_check(m, x, 4, shape, per_channel ? "prelu per channel" : "prelu shared");
        bie_model_free(m);
    }
}

static void test_maxpool(int64_t n, int64_t c, int64_t h, int64_t w, int k, int s) {
    bie_model *m = NULL;
    CHECK_OK(bie_model_create(&m));
    CHECK_OK(bie_model_add_maxpool2d(m, k, s));
    int64_t shape[4] = {n, c, h, w};
    const int64_t nx = n * c * h * w, oh = (h - k) / s + 1, ow = (w - k) / s + 1;
    float *x = tu_alloc((size_t)nx * 4);
    fill_distinct(x, nx);
    bie_tensor tx = ttu_view(x, 4, shape), y;
    CHECK_OK(bie_model_forward(m, &tx, &y));
    CHECK(y.ndim == 4 && y.shape[2] == oh && y.shape[3] == ow);
    int bad = 0;
    for (int64_t p = 0; p < n * c; p++)
        for (int64_t oy = 0; oy < oh; oy++)
            for (int64_t ox = 0; ox < ow; ox++) {
                float mx = -INFINITY;
                for (int i = 0; i < k; i++)
                    for (int j = 0; j < k; j++)
                        mx = fmaxf(mx, x[p * h * w + (oy * s + i) * w + ox * s + j]);
                bad += ((float *)y.data)[(p * oh + oy) * ow + ox] != mx;
            }
    CHECK(bad == 0);
    char label[64];
    snprintf(label, sizeof label, "maxpool k%d s%d", k, s);
    ttu_grad_check(m, x, 4, shape, label);
    free(x);
    bie_model_free(m);
}

static void test_flatten_and_chain(void) {
    bie_model *m = NULL;
    CHECK_OK(bie_model_create(&m));
    CHECK_OK(bie_model_add_flatten(m));
    CHECK_OK(bie_model_add_linear(m, 60, 9, true));
    CHECK_OK(bie_model_add_batchnorm1d(m, 9));
    CHECK_OK(bie_model_add_prelu(m, 9));
    CHECK_OK(bie_model_add_linear(m, 9, 4, true));
    CHECK_OK(bie_model_reset_parameters(m, 3));
    randomise_float_params(m, -0.6f, 0.6f);
    bie_model_param g;
    CHECK_OK(bie_model_param_find(m, "2.weight", &g));
    tu_fill(g.value.data, 9, 0.5f, 1.5f);
    int64_t shape[4] = {5, 3, 4, 5};
    float x[300];
    tu_fill(x, 300, -1, 1);
    int on;
    int64_t os[4];
    CHECK_OK(bie_model_output_shape(m, 4, shape, &on, os));
    CHECK(on == 2 && os[0] == 5 && os[1] == 4);
    ttu_grad_check(m, x, 4, shape, "flatten-linear-bn-prelu-linear");
    bie_model_free(m);
}

static void test_cross_entropy(int64_t n, int64_t c) {
    float *z = tu_alloc((size_t)(n * c) * 4), *g = tu_alloc((size_t)(n * c) * 4);
    int32_t *lab = tu_alloc((size_t)n * 4), *pred = tu_alloc((size_t)n * 4);
    tu_fill(z, n * c, -3, 3);
    for (int64_t i = 0; i < n; i++) lab[i] = (int32_t)(tu_next() % (uint64_t)c);
    int64_t zs[2] = {n, c}, ls[1] = {n};
    bie_tensor tz = ttu_view(z, 2, zs), tg = ttu_view(g, 2, zs), tl, tp;
    CHECK_OK(bie_tensor_view(&tl, lab, BIE_I32, 1, ls));
    CHECK_OK(bie_tensor_view(&tp, pred, BIE_I32, 1, ls));
    float loss = -1;
    tu_poison(g, n * c);
    CHECK_OK(bie_softmax_cross_entropy(&tz, &tl, &loss, &tg));
    double want = 0;
    int64_t hits = 0;
    for (int64_t i = 0; i < n; i++) {
        double mx = -INFINITY, se = 0;
        int64_t best = 0;
        for (int64_t j = 0; j < c; j++) {
            mx = fmax(mx, z[i * c + j]);
            if (z[i * c + j] > z[i * c + best]) best = j;
        }
        for (int64_t j = 0; j < c; j++) se += exp(z[i * c + j] - mx);
        want += mx + log(se) - z[i * c + lab[i]];
        hits += best == lab[i];
    }
    CHECK(ttu_close(loss, want / (double)n, 1e-6, 1e-5));
    int bad = 0;
    for (int64_t i = 0; i < n * c; i++) { /* central differences of the loss */
        const float keep = z[i];
        float lp, lm;
        z[i] = keep + 1e-2f;
        CHECK_OK(bie_softmax_cross_entropy(&tz, &tl, &lp, NULL));
        z[i] = keep - 1e-2f;
        CHECK_OK(bie_softmax_cross_entropy(&tz, &tl, &lm, NULL));
        z[i] = keep;
        bad += !ttu_close(g[i], ((double)lp - lm) / 2e-2, 2e-4, 1e-2);
    }
    CHECK(bad == 0);
    int64_t correct = -1;
    CHECK_OK(bie_count_correct(&tz, &tl, &correct));
    CHECK(correct == hits);
    CHECK_OK(bie_argmax(&tz, &tp));
    int agree = 0;
    for (int64_t i = 0; i < n; i++) agree += pred[i] == lab[i];
    CHECK(agree == hits);
    /* aliasing: the gradient may overwrite the logits */
    memcpy(g, z, (size_t)(n * c) * 4);
    float *g2 = tu_alloc((size_t)(n * c) * 4);
    bie_tensor tg2 = ttu_view(g2, 2, zs);
    CHECK_OK(bie_softmax_cross_entropy(&tz, &tl, &loss, &tg2));
    CHECK_OK(bie_softmax_cross_entropy(&tg, &tl, &loss, &tg));
    CHECK(tu_same_bits(g, g2, n * c));
    /* bad input: label out of range, shapes, dtypes; nothing written */
    lab[0] = (int32_t)c;
    memcpy(g2, g, (size_t)(n * c) * 4);
    CHECK(bie_softmax_cross_entropy(&tz, &tl, &loss, &tg) == BIE_ERR_INVALID_ARGUMENT);
    CHECK(tu_same_bits(g, g2, n * c));
    lab[0] = 0;
    int64_t bad_ls[1] = {n + 1};
    bie_tensor tl_bad;
    CHECK_OK(bie_tensor_view(&tl_bad, lab, BIE_I32, 1, bad_ls));
    CHECK(bie_softmax_cross_entropy(&tz, &tl_bad, &loss, NULL) == BIE_ERR_SHAPE);
    CHECK(bie_softmax_cross_entropy(&tz, &tz, &loss, NULL) == BIE_ERR_DTYPE);
    CHECK(bie_softmax_cross_entropy(&tz, &tl, NULL, NULL) == BIE_ERR_NULL_POINTER);
    CHECK(bie_count_correct(&tz, NULL, &correct) == BIE_ERR_NULL_POINTER);
    z[0] = NAN;
    CHECK(bie_softmax_cross_entropy(&tz, &tl, &loss, NULL) == BIE_ERR_NOT_FINITE);
    free(g2);
    free(z);
    free(g);
    free(lab);
    free(pred);
}

/* bie_softmax_cross_entropy_accumulate on the CPU: the gradient of bie_softmax_cross_entropy
 * bit for bit, totals added to what sums held, non-finite rows counted with a zero gradient,
 * bad input refused with nothing changed. */
static void test_cross_entropy_accumulate(int64_t n, int64_t c) {
    float *z = tu_alloc((size_t)(n * c) * 4), *g = tu_alloc((size_t)(n * c) * 4);
    float *want = tu_alloc((size_t)(n * c) * 4);
    int32_t *lab = tu_alloc((size_t)n * 4);
    tu_fill(z, n * c, -4, 4);
    for (int64_t i = 0; i < n; i++) lab[i] = (int32_t)(tu_next() % (uint64_t)c);
    int64_t zs[2] = {n, c}, ls[1] = {n}, three = 3;
    bie_tensor tz = ttu_view(z, 2, zs), tg = ttu_view(g, 2, zs), tw = ttu_view(want, 2, zs), tl, ts;
    double sums[3] = {1.5, 2, 0};
    CHECK_OK(bie_tensor_view(&tl, lab, BIE_I32, 1, ls));
    CHECK_OK(bie_tensor_view(&ts, sums, BIE_F64, 1, &three));
    float loss = 0;
    int64_t hits = 0;
    CHECK_OK(bie_softmax_cross_entropy(&tz, &tl, &loss, &tw));
    CHECK_OK(bie_count_correct(&tz, &tl, &hits));
    tu_poison(g, n * c);
    CHECK_OK(bie_softmax_cross_entropy_accumulate(&tz, &tl, &tg, &ts));
    CHECK(tu_same_bits(g, want, n * c));
    CHECK(ttu_close(sums[0] - 1.5, (double)loss * (double)n, 1e-6, 1e-6));
    CHECK(sums[1] == 2.0 + (double)hits && sums[2] == 0);
    /* aliasing: the gradient overwrites the logits */
    memcpy(g, z, (size_t)(n * c) * 4);
    CHECK_OK(bie_softmax_cross_entropy_accumulate(&tg, &tl, &tg, &ts));
    CHECK(tu_same_bits(g, want, n * c));
    /* a non-finite row: counted, zero gradient, nothing added for it */
    const int64_t r = n / 2;
    z[r * c + c - 1] = INFINITY;
    double before[3] = {sums[0], sums[1], sums[2]};
    tu_poison(g, n * c);
    CHECK_OK(bie_softmax_cross_entropy_accumulate(&tz, &tl, &tg, &ts));
    int zero_row = 1;
    for (int64_t j = 0; j < c; j++) zero_row &= g[r * c + j] == 0.0f;
    CHECK(zero_row && sums[2] == before[2] + 1 && sums[1] <= before[1] + (double)hits);
    z[r * c + c - 1] = 0;
    /* bad input: nothing written */
    memcpy(before, sums, sizeof before);
    memcpy(want, g, (size_t)(n * c) * 4);
    lab[0] = (int32_t)c;
    CHECK(bie_softmax_cross_entropy_accumulate(&tz, &tl, &tg, &ts) == BIE_ERR_INVALID_ARGUMENT);
    lab[0] = -1;
    CHECK(bie_softmax_cross_entropy_accumulate(&tz, &tl, &tg, &ts) == BIE_ERR_INVALID_ARGUMENT);
    lab[0] = 0;
    int64_t two = 2;
    bie_tensor short_sums, f32_sums;
    CHECK_OK(bie_tensor_view(&short_sums, sums, BIE_F64, 1, &two));
    CHECK_OK(bie_tensor_view(&f32_sums, sums, BIE_F32, 1, &three));
    CHECK(bie_softmax_cross_entropy_accumulate(&tz, &tl, &tg, &short_sums) == BIE_ERR_SHAPE);
    CHECK(bie_softmax_cross_entropy_accumulate(&tz, &tl, &tg, &f32_sums) == BIE_ERR_DTYPE);
    CHECK(bie_softmax_cross_entropy_accumulate(&tz, &tl, NULL, &ts) == BIE_ERR_NULL_POINTER);
    CHECK(bie_softmax_cross_entropy_accumulate(&tz, &tl, &tg, NULL) == BIE_ERR_NULL_POINTER);
    CHECK(bie_softmax_cross_entropy_accumulate(&tz, NULL, &tg, &ts) == BIE_ERR_NULL_POINTER);
    CHECK(bie_softmax_cross_entropy_accumulate(&tz, &tz, &tg, &ts) == BIE_ERR_DTYPE);
    int64_t gs_bad[2] = {n, c + 1};
    float *g_bad = tu_alloc((size_t)(n * (c + 1)) * 4);
    bie_tensor tg_bad = ttu_view(g_bad, 2, gs_bad);
    CHECK(bie_softmax_cross_entropy_accumulate(&tz, &tl, &tg_bad, &ts) == BIE_ERR_SHAPE);
    bie_tensor on_gpu = tl;
    on_gpu.device.type = BIE_DEVICE_CUDA;
    CHECK(bie_softmax_cross_entropy_accumulate(&tz, &on_gpu, &tg, &ts) == BIE_ERR_DEVICE);
    CHECK(memcmp(before, sums, sizeof before) == 0 && tu_same_bits(g, want, n * c));
    free(g_bad);
    free(z);
    free(g);
    free(want);
    free(lab);
}

int main(void) {
    tu_seed(2024);
    test_linear(3, 7, 5, true, 2);
    test_linear(1, 4, 3, false, 2);
    test_linear(3, 13, 6, true, 3);
    test_batchnorm(0, 6, 5, 1, 1);
    test_batchnorm(0, 2, 3, 1, 1);
    test_batchnorm(1, 2, 3, 5, 7);
    test_batchnorm(1, 1, 2, 3, 3);
    test_relu_prelu();
    test_cross_entropy_accumulate(1, 1);
    test_cross_entropy_accumulate(5, 10);
    test_cross_entropy_accumulate(64, 37);
    test_maxpool(2, 3, 7, 9, 2, 2);
    test_maxpool(1, 2, 9, 8, 3, 2);
    test_maxpool(1, 1, 5, 5, 5, 1);
    test_flatten_and_chain();
    test_cross_entropy(7, 5);
    test_cross_entropy(1, 3);
    test_cross_entropy(33, 10);
    return tu_finish();
}
