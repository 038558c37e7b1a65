/* 4-bit GEMM kernels and the 4-bit linear layer (SPEC §4) against direct implementations:
 * exact integer results for every kernel, packed-weight inference equal to training,
 * backward against double precision. */
#include "layer_ref.h"
#include "test_util.h"

#define q4_ref ref_q4 /* clamp(rint(v / s), -8, 7), half to even */

static void test_gemm_kernels(void) {
    const int64_t shapes[][3] = {{1, 1, 1},     {1, 5, 7},     {3, 2, 31},
                                 {4, 4, 32},    {5, 3, 33},    {17, 9, 100},
                                 {64, 33, 257}, {2, 70, 1000}, {33, 65, 4099}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int64_t m = shapes[s][0], n = shapes[s][1], k = shapes[s][2], lda = k + (int64_t)(s % 3),
                ldb = k + 1;
        int8_t *a = tu_alloc((size_t)(m * lda)), *b = tu_alloc((size_t)(n * ldb));
        for (int64_t i = 0; i < m * lda; i++) a[i] = (int8_t)((int)(tu_next() % 16) - 8);
        for (int64_t i = 0; i < n * ldb; i++) b[i] = (int8_t)((int)(tu_next() % 16) - 8);
        float scale = tu_uniform(0.01f, 1.0f), *expect = tu_alloc((size_t)(m * n) * 4),
              *out = tu_alloc((size_t)(m * n) * 4);
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < n; j++) {
                int64_t dot = 0;
                for (int64_t c = 0; c < k; c++) dot += (int64_t)a[i * lda + c] * b[j * ldb + c];
                expect[i * n + j] = (float)dot * scale;
            }
        for (int idx = -1; idx < bie_kernel_count(); idx++) {
            int id = -1;
            if (idx >= 0) {
                bie_kernel_info info;
                CHECK_OK(bie_kernel_get(idx, &info));
                if (info.op != BIE_OP_Q4_GEMM || !info.available || info.device != BIE_DEVICE_CPU)
                    continue;
                id = info.id;
            }
            tu_poison(out, m * n);
            CHECK_OK(bie_q4_gemm(id, m, n, k, a, lda, b, ldb, scale, out));
            int same = tu_same_bits(out, expect, m * n);
            CHECK(same);
            if (!same)
                fprintf(stderr, "  q4 kernel %d differs at m=%lld n=%lld k=%lld\n", id,
                        (long long)m, (long long)n, (long long)k);
        }
        /* a binary kernel id is refused for a 4-bit product */
        CHECK(bie_q4_gemm(4, m, n, k, a, lda, b, ldb, scale, out) == BIE_ERR_INVALID_ARGUMENT);
        free(a);
        free(b);
        free(expect);
        free(out);
    }
}

static void test_layer(int64_t m, int64_t k, int64_t n) {
    bie_layer *l = NULL;
    CHECK_OK(bie_q4_linear_create(&l, k, n, bie_cpu(), BIE_F32));
    float *w = tu_alloc((size_t)(n * k) * 4), *x = tu_alloc((size_t)(m * k) * 4);
    float *out = tu_alloc((size_t)(m * n) * 4), *expect = tu_alloc((size_t)(m * n) * 4),
          *o2 = tu_alloc((size_t)(m * n) * 4);
    tu_fill(w, n * k, -0.5f, 0.5f);
    for (int64_t i = 0; i < n * k; i += 7) w[i] *= 40.0f; /* outliers: codes clamp at -8 / 7 */
    tu_fill(x, m * k, -2, 2);
    bie_tensor tw = tu_view(w, BIE_F32, 2, n, k, 0, 0), tx = tu_view(x, BIE_F32, 2, m, k, 0, 0);
    bie_tensor to = tu_view(out, BIE_F32, 2, m, n, 0, 0), to2 = tu_view(o2, BIE_F32, 2, m, n, 0, 0);
    CHECK_OK(bie_layer_set_weight_data(l, &tw));
    bie_tensor bias, sa, sw;
    CHECK_OK(bie_layer_param(l, BIE_PARAM_BIAS_A, &bias));
    tu_fill(bias.data, k, -0.1f, 0.1f);
    const float *b = bias.data;
    tu_poison(out, m * n);
    CHECK_OK(bie_layer_forward(l, &tx, &to));
    CHECK_OK(bie_layer_param(l, BIE_PARAM_SCALE_A, &sa));
    CHECK_OK(bie_layer_param(l, BIE_PARAM_SCALE_W, &sw));
    float scale_a = *(float *)sa.data, scale_w = *(float *)sw.data;
    double sx = 0, swsum = 0;
    for (int64_t i = 0; i < m * k; i++) sx += fabs((double)x[i]);
    for (int64_t i = 0; i < n * k; i++) swsum += fabs((double)w[i]);
    CHECK(scale_a == (float)((2.0 / 11.269) * sx / (double)(m * k)));
    float sw_expect = (float)(2.0 * swsum / (double)(n * k) / 5.6345);
    CHECK(scale_w == (sw_expect > 1e-5f ? sw_expect : 1e-5f));
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            int64_t dot = 0;
            for (int64_t c = 0; c < k; c++)
                dot +=
                    (int64_t)q4_ref(x[i * k + c] + b[c], scale_a) * q4_ref(w[j * k + c], scale_w);
            expect[i * n + j] = (float)dot * (scale_a * scale_w);
        }
    CHECK(tu_same_bits(out, expect, m * n));

    /* backward against double precision */
    float *g = tu_alloc((size_t)(m * n) * 4), *gx = tu_alloc((size_t)(m * k) * 4);
    tu_fill(g, m * n, -1, 1);
    bie_tensor tg = tu_view(g, BIE_F32, 2, m, n, 0, 0), tgx = tu_view(gx, BIE_F32, 2, m, k, 0, 0);
    tu_poison(gx, m * k);
    CHECK_OK(bie_layer_backward(l, &tg, &tgx));
    double *rgx = calloc((size_t)(m * k), sizeof(double)),
           *rgw = calloc((size_t)(n * k), sizeof(double));
    double rgs = 0, bound = 0, e = 0, r = 0;
    for (int64_t i = 0; i < m; i++)
        for (int64_t c = 0; c < k; c++) {
            float xp = x[i * k + c] + b[c], v = xp / scale_a;
            double acc = 0;
            for (int64_t j = 0; j < n; j++) {
                acc += (double)g[i * n + j] * q4_ref(w[j * k + c], scale_w) * scale_w;
                rgw[j * k + c] += (double)g[i * n + j] * q4_ref(xp, scale_a) * scale_a;
            }
            double gxi = (v >= -8 && v <= 7) ? acc : 0;
            rgx[i * k + c] = gxi;
            rgs += gxi * (nearbyintf(v) - v);
            bound += fabs(gxi);
        }
    rgs /= sqrt((double)(m * k) * 7);
    bound = bound / 508.0 / sqrt((double)(m * k) * 7) + 1e-6;
    for (int64_t i = 0; i < m * k; i++)
        e += (gx[i] - rgx[i]) * (gx[i] - rgx[i]), r += rgx[i] * rgx[i];
    CHECK(sqrt(e) <= 1e-5 * sqrt(r) + 1e-6);
    bie_tensor ggw, ggs;
    CHECK_OK(bie_layer_grad(l, BIE_PARAM_WEIGHT, &ggw));
    CHECK_OK(bie_layer_grad(l, BIE_PARAM_SCALE_A, &ggs));
    e = r = 0;
    for (int64_t i = 0; i < n * k; i++) {
        double d = ((float *)ggw.data)[i] - rgw[i];
        e += d * d, r += rgw[i] * rgw[i];
    }
    CHECK(sqrt(e) <= 1e-5 * sqrt(r) + 1e-6);
    CHECK(fabs(*(float *)ggs.data - rgs) <= bound + 1e-4 * fabs(rgs));

    /* packed-weight inference equals training; qweight round trip; weight-free */
    CHECK_OK(bie_layer_set_training(l, false));
    tu_poison(o2, m * n);
    CHECK_OK(bie_layer_forward(l, &tx, &to2));
    CHECK(tu_same_bits(o2, expect, m * n));
    CHECK_OK(bie_layer_generate_quantized_weight(l, true));
    bie_tensor qv;
    CHECK_OK(bie_layer_opt_weight(l, &qv));
    CHECK(qv.dtype == BIE_U8 && qv.shape[1] == (k + 1) / 2);
    uint8_t *qcopy = tu_alloc((size_t)(n * qv.shape[1]));
    memcpy(qcopy, qv.data, (size_t)(n * qv.shape[1]));
    bie_tensor tq = tu_view(qcopy, BIE_U8, 2, n, qv.shape[1], 0, 0);
    CHECK_OK(bie_layer_set_quantized_weight_data(l, &tq));
    tu_poison(o2, m * n);
    CHECK_OK(bie_layer_forward(l, &tx, &to2));
    CHECK(tu_same_bits(o2, expect, m * n));
    CHECK(bie_layer_param(l, BIE_PARAM_WEIGHT, &qv) == BIE_ERR_STATE);
    CHECK_OK(bie_layer_set_training(l, true));
    CHECK(bie_layer_forward(l, &tx, &to2) == BIE_ERR_STATE);
    /* bad input leaves outputs untouched */
    bie_tensor bad = tu_view(x, BIE_F32, 2, m, k > 1 ? k - 1 : 2, 0, 0);
    tu_poison(o2, m * n);
    float *poison = tu_alloc((size_t)(m * n) * 4);
    tu_poison(poison, m * n);
    CHECK(bie_layer_forward(l, &bad, &to2) == BIE_ERR_SHAPE);
    CHECK(tu_same_bits(o2, poison, m * n));
    CHECK(bie_layer_set_gemm_kernel(l, 4) == BIE_ERR_INVALID_ARGUMENT); /* a binary kernel */
    free(poison);
    free(qcopy);
    free(rgx);
    free(rgw);
    free(g);
    free(gx);
    free(w);
    free(x);
    free(out);
    free(o2);
    free(expect);
    bie_layer_free(l);
}

int main(void) {
    if (tu_forced_set_missing()) return TU_SKIP;
    tu_seed(4);
    test_gemm_kernels();
    const int64_t shapes[][3] = {{1, 1, 1},   {1, 7, 3},   {3, 33, 5},
                                 {8, 64, 16}, {5, 257, 9}, {17, 100, 33}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        test_layer(shapes[i][0], shapes[i][1], shapes[i][2]);
    return tu_finish();
}
