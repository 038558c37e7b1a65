/* The binary linear layer (SPEC §2) against direct implementations of its formulas:
 * forward bit-exact against a 64-bit integer reference for every kernel and word size;
 * pre-packed input, inference with packed weights and qweight_only equal to training;
 * backward against double precision; prepare_params, set_activation and the life cycle. */
#include "test_util.h"

typedef struct {
    int64_t m, k, n;
} shape3;

/* A layer with a random bias_a, prepared (int8) weights from `seed`. */
static bie_layer *make_layer(int64_t k, int64_t n, uint64_t seed) {
    bie_layer *l = NULL;
    if (bie_binary_linear_create(&l, k, n, bie_cpu(), BIE_F32, true) != BIE_OK) {
        fprintf(stderr, "create failed: %s\n", bie_last_error());
        exit(2);
    }
    CHECK_OK(bie_layer_reset_parameters(l, seed));
    CHECK_OK(bie_layer_prepare_params(l));
    bie_tensor b;
    CHECK_OK(bie_layer_param(l, BIE_PARAM_BIAS_A, &b));
    tu_fill(b.data, k, -0.1f, 0.1f);
    return l;
}

/* Expected forward output: (float)dot * (scale_a * scale_w), dot in 64-bit integers on the
 * signs of x + bias_a and of the weight. */
static void ref_forward(bie_layer *l, const float *x, int64_t m, float *expect) {
    int64_t k = tu_layer_in(l), n = tu_layer_out(l);
    bie_tensor w, b, sa, sw;
    bie_layer_param(l, BIE_PARAM_WEIGHT, &w);
    bie_layer_param(l, BIE_PARAM_BIAS_A, &b);
    bie_layer_param(l, BIE_PARAM_SCALE_A, &sa);
    bie_layer_param(l, BIE_PARAM_SCALE_W, &sw);
    const float *bias = b.data;
    float scale = *(float *)sa.data * *(float *)sw.data;
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            int64_t dot = 0;
            for (int64_t c = 0; c < k; c++) {
                int sx = x[i * k + c] + bias[c] >= 0 ? 1 : -1;
                int sv = w.dtype == BIE_I8 ? ((int8_t *)w.data)[j * k + c] >= 0 ? 1 : -1
                         : ((float *)w.data)[j * k + c] >= 0 ? 1
                                                             : -1;
                dot += sx * sv;
            }
            expect[i * n + j] = (float)dot * scale;
        }
}

static void test_forward_exact(shape3 s, int word_bits) {
    bie_layer *l = make_layer(s.k, s.n, 7 + (uint64_t)s.k);
    CHECK_OK(bie_layer_set_bits_binary_word(l, word_bits));
    float *x = tu_alloc((size_t)(s.m * s.k) * sizeof(float));
    float *out = tu_alloc((size_t)(s.m * s.n) * sizeof(float));
    float *expect = tu_alloc((size_t)(s.m * s.n) * sizeof(float));
    float *train = tu_alloc((size_t)(s.m * s.n) * sizeof(float));
    tu_fill(x, s.m * s.k, -1, 1);
    bie_tensor tx = tu_view(x, BIE_F32, 2, s.m, s.k, 0, 0);
    bie_tensor to = tu_view(out, BIE_F32, 2, s.m, s.n, 0, 0);

    /* scale_a initialised by the first forward: 2 mean|x| */
    tu_poison(train, s.m * s.n);
    bie_tensor tt = tu_view(train, BIE_F32, 2, s.m, s.n, 0, 0);
    CHECK_OK(bie_layer_forward(l, &tx, &tt));
    double sum = 0;
    for (int64_t i = 0; i < s.m * s.k; i++) sum += fabs((double)x[i]);
    bie_tensor sa;
    CHECK_OK(bie_layer_param(l, BIE_PARAM_SCALE_A, &sa));
    CHECK(*(float *)sa.data == (float)(2.0 * sum / (double)(s.m * s.k)));
    ref_forward(l, x, s.m, expect);
    CHECK(tu_same_bits(train, expect, s.m * s.n));

    /* every available kernel, training mode */
    for (int idx = 0; idx < bie_kernel_count(); idx++) {
        bie_kernel_info info;
        CHECK_OK(bie_kernel_get(idx, &info));
        if (!info.available || info.device != BIE_DEVICE_CPU || info.op != BIE_OP_BINARY_GEMM)
            continue;
        CHECK_OK(bie_layer_set_gemm_kernel(l, info.id));
        tu_poison(out, s.m * s.n);
        CHECK_OK(bie_layer_forward(l, &tx, &to));
        int same = tu_same_bits(out, expect, s.m * s.n);
        CHECK(same);
        if (!same)
            fprintf(stderr, "  %s differs: m=%lld k=%lld n=%lld W=%d\n", info.name, (long long)s.m,
                    (long long)s.k, (long long)s.n, word_bits);
    }
    CHECK_OK(bie_layer_set_gemm_kernel(l, -1));

    /* pre-packed input: the signs of x + bias_a in words of W bits */
    int64_t words = bie_packed_words(s.k, word_bits);
    float *xb = tu_alloc((size_t)(s.m * s.k) * sizeof(float));
    bie_tensor bias;
    CHECK_OK(bie_layer_param(l, BIE_PARAM_BIAS_A, &bias));
    for (int64_t i = 0; i < s.m; i++)
        for (int64_t c = 0; c < s.k; c++)
            xb[i * s.k + c] = x[i * s.k + c] + ((float *)bias.data)[c];
    bie_dtype pdt = word_bits == 8 ? BIE_U8 : word_bits == 32 ? BIE_U32 : BIE_U64;
    uint8_t *packed = tu_alloc((size_t)(s.m * words * (word_bits / 8)));
    bie_tensor txb = tu_view(xb, BIE_F32, 2, s.m, s.k, 0, 0);
    bie_tensor tp = tu_view(packed, pdt, 2, s.m, words, 0, 0);
    CHECK_OK(bie_pack_signs(&txb, word_bits, &tp));
    tu_poison(out, s.m * s.n);
    CHECK_OK(bie_layer_forward(l, &tp, &to));
    CHECK(tu_same_bits(out, expect, s.m * s.n));

    /* inference with packed weights, then weight-free (qweight_only) */
    CHECK_OK(bie_layer_set_training(l, false));
    tu_poison(out, s.m * s.n);
    CHECK_OK(bie_layer_forward(l, &tx, &to));
    CHECK(tu_same_bits(out, expect, s.m * s.n));
    bie_tensor ow;
    CHECK_OK(bie_layer_opt_weight(l, &ow));
    CHECK(ow.dtype == pdt && ow.shape[0] == s.n && ow.shape[1] == words);
    CHECK_OK(bie_layer_generate_quantized_weight(l, true));
    bie_tensor wv;
    CHECK(bie_layer_param(l, BIE_PARAM_WEIGHT, &wv) == BIE_ERR_STATE);
    tu_poison(out, s.m * s.n);
    CHECK_OK(bie_layer_forward(l, &tx, &to));
    CHECK(tu_same_bits(out, expect, s.m * s.n));
    /* a new word size re-lays out the packed weight; results stay the same */
    CHECK_OK(bie_layer_set_bits_binary_word(l, word_bits == 64 ? 8 : 64));
    tu_poison(out, s.m * s.n);
    CHECK_OK(bie_layer_forward(l, &tx, &to));
    CHECK(tu_same_bits(out, expect, s.m * s.n));
    /* training forward is refused once the weight is gone */
    CHECK_OK(bie_layer_set_training(l, true));
    CHECK(bie_layer_forward(l, &tx, &to) == BIE_ERR_STATE);

    bie_layer_free(l);
    free(x);
    free(xb);
    free(out);
    free(expect);
    free(train);
    free(packed);
}

/* Backward in double precision straight from SPEC §2. */
/* forward_again: the kept training forward's output bit for bit (the input buffer, scale_a
 * and the weight's values changed since; rank-3 input); nothing kept or a bad output: an
 * error and the output untouched. */
static void test_forward_again(shape3 s) {
    bie_layer *l = make_layer(s.k, s.n, 19 + (uint64_t)s.k);
    const int64_t no = s.m * s.n;
    float *x = tu_alloc((size_t)(s.m * s.k) * sizeof(float));
    float *out = tu_alloc((size_t)no * sizeof(float)), *expect = tu_alloc((size_t)no * 4),
          *poison = tu_alloc((size_t)no * 4);
    tu_fill(x, s.m * s.k, -1.5f, 1.5f);
    tu_poison(poison, no);
    bie_tensor tx = tu_view(x, BIE_F32, 3, 1, s.m, s.k, 0);
    bie_tensor to = tu_view(out, BIE_F32, 3, 1, s.m, s.n, 0);
    tu_poison(out, no);
    CHECK(bie_layer_forward_again(l, &to) == BIE_ERR_STATE);
    CHECK_OK(bie_layer_forward(l, &tx, &to));
    tu_check_forward_again(l, x, s.m * s.k, &to, expect, no);
    bie_tensor flat = tu_view(out, BIE_F32, 2, s.m, s.n, 0, 0); /* rank 2, as the input was not */
    bie_tensor wide = tu_view(out, BIE_F32, 3, 1, s.m, s.n + 1, 0);
    tu_poison(out, no);
    CHECK(bie_layer_forward_again(l, &flat) == BIE_ERR_SHAPE);
    CHECK(bie_layer_forward_again(l, &wide) == BIE_ERR_SHAPE);
    CHECK(tu_same_bits(out, poison, no));
    bie_layer_free(l);
    free(x);
    free(out);
    free(expect);
    free(poison);
}

static void test_backward(shape3 s) {
    bie_layer *l = make_layer(s.k, s.n, 99 + (uint64_t)s.n);
    const int64_t m = s.m, k = s.k, n = s.n;
    float *x = tu_alloc((size_t)(m * k) * sizeof(float));
    float *out = tu_alloc((size_t)(m * n) * sizeof(float));
    float *g = tu_alloc((size_t)(m * n) * sizeof(float));
    float *gx = tu_alloc((size_t)(m * k) * sizeof(float));
    tu_fill(x, m * k, -1.5f, 1.5f);
    tu_fill(g, m * n, -1, 1);
    bie_tensor tx = tu_view(x, BIE_F32, 2, m, k, 0, 0), to = tu_view(out, BIE_F32, 2, m, n, 0, 0);
    bie_tensor tg = tu_view(g, BIE_F32, 2, m, n, 0, 0), tgx = tu_view(gx, BIE_F32, 2, m, k, 0, 0);
    CHECK_OK(bie_layer_forward(l, &tx, &to));
    tu_poison(gx, m * k);
    CHECK_OK(bie_layer_backward(l, &tg, &tgx));

    bie_tensor w, b, sa, sw;
    CHECK_OK(bie_layer_param(l, BIE_PARAM_WEIGHT, &w));
    CHECK_OK(bie_layer_param(l, BIE_PARAM_BIAS_A, &b));
    CHECK_OK(bie_layer_param(l, BIE_PARAM_SCALE_A, &sa));
    CHECK_OK(bie_layer_param(l, BIE_PARAM_SCALE_W, &sw));
    const int8_t *wq = w.data;
    const float *bias = b.data;
    double scale_a = *(float *)sa.data, scale_w = *(float *)sw.data;
    double *rgx = calloc((size_t)(m * k), sizeof(double)),
           *rgw = calloc((size_t)(n * k), sizeof(double));
    double *rgb = calloc((size_t)k, sizeof(double)), rgs = 0;
    for (int64_t i = 0; i < m; i++)
        for (int64_t c = 0; c < k; c++) {
            float xp = x[i * k + c] + bias[c];
            float v = xp / (float)scale_a; /* the clip test as the forward evaluates it */
            double sx = xp >= 0 ? 1 : -1, acc = 0;
            for (int64_t j = 0; j < n; j++) {
                acc += (double)g[i * n + j] * (wq[j * k + c] >= 0 ? 1 : -1) * scale_w;
                rgw[j * k + c] += (double)g[i * n + j] * sx * scale_a;
            }
            double gxi = (v >= -1 && v <= 1) ? acc : 0.0;
            rgx[i * k + c] = gxi;
            rgs += gxi * sx;
            rgb[c] += gxi;
        }
    rgs /= sqrt((double)(m * k));

    double err = 0, norm = 0;
    for (int64_t i = 0; i < m * k; i++) {
        err += (gx[i] - rgx[i]) * (gx[i] - rgx[i]);
        norm += rgx[i] * rgx[i];
    }
    CHECK(sqrt(err) <= 1e-5 * sqrt(norm) + 1e-6);
    bie_tensor ggw, ggwf, ggb, ggs;
    CHECK_OK(bie_layer_grad(l, BIE_PARAM_WEIGHT, &ggw));
    CHECK_OK(bie_layer_grad(l, BIE_PARAM_WEIGHT_FLOAT_GRAD, &ggwf));
    CHECK_OK(bie_layer_grad(l, BIE_PARAM_BIAS_A, &ggb));
    CHECK_OK(bie_layer_grad(l, BIE_PARAM_SCALE_A, &ggs));
    CHECK(ggw.dtype == BIE_I8 && ggwf.dtype == BIE_F32);
    const float *gwf = ggwf.data;
    err = norm = 0;
    double amax = 0;
    for (int64_t i = 0; i < n * k; i++) {
        err += (gwf[i] - rgw[i]) * (gwf[i] - rgw[i]);
        norm += rgw[i] * rgw[i];
        amax = fmax(amax, fabs(rgw[i]));
    }
    CHECK(sqrt(err) <= 1e-5 * sqrt(norm) + 1e-6);
    /* int8 gradient: narrow-range per-tensor quantization of the float gradient */
    int qbad = 0;
    for (int64_t i = 0; i < n * k; i++) {
        double q = amax > 0 ? nearbyint(rgw[i] * 127.0 / amax) : 0;
        qbad += fabs(((int8_t *)ggw.data)[i] - q) > 1;
    }
    CHECK(qbad == 0);
    err = norm = 0;
    for (int64_t c = 0; c < k; c++) {
        err += (((float *)ggb.data)[c] - rgb[c]) * (((float *)ggb.data)[c] - rgb[c]);
        norm += rgb[c] * rgb[c];
    }
    CHECK(sqrt(err) <= 1e-5 * sqrt(norm) + 1e-6);
    CHECK(fabs(*(float *)ggs.data - rgs) <= 1e-4 * fabs(rgs) + 1e-5);

    /* grad_x may be NULL: the layer's gradients are still produced, identical */
    float gs_before = *(float *)ggs.data;
    CHECK_OK(bie_layer_backward(l, &tg, NULL));
    CHECK_OK(bie_layer_grad(l, BIE_PARAM_SCALE_A, &ggs));
    CHECK(*(float *)ggs.data == gs_before);

    free(rgx);
    free(rgw);
    free(rgb);
    free(x);
    free(out);
    free(g);
    free(gx);
    bie_layer_free(l);
}

/* prepare_params against SPEC §2 in double precision; reset_parameters bound and seeding. */
static void test_prepare_params(void) {
    const int64_t k = 37, n = 11;
    bie_layer *l = NULL;
    CHECK_OK(bie_binary_linear_create(&l, k, n, bie_cpu(), BIE_F32, true));
    bie_tensor w;
    CHECK_OK(bie_layer_reset_parameters(l, 5));
    CHECK_OK(bie_layer_param(l, BIE_PARAM_WEIGHT, &w));
    CHECK(w.dtype == BIE_F32);
    float bound = 1.0f / sqrtf((float)k), first = ((float *)w.data)[0];
    int out_of_bound = 0, zeros = 0;
    for (int64_t i = 0; i < n * k; i++) {
        out_of_bound += fabsf(((float *)w.data)[i]) > bound;
        zeros += ((float *)w.data)[i] == 0.0f;
    }
    CHECK(out_of_bound == 0 && zeros < 3);
    CHECK_OK(bie_layer_reset_parameters(l, 5));
    CHECK_OK(bie_layer_param(l, BIE_PARAM_WEIGHT, &w));
    CHECK(((float *)w.data)[0] == first); /* same seed, same weights */

    float *src = tu_alloc((size_t)(n * k) * sizeof(float));
    tu_fill(src, n * k, -2, 3);
    src[3] = 0.5f; /* a value near the mean quantizes to 0 and must become ±1 */
    bie_tensor ts = tu_view(src, BIE_F32, 2, n, k, 0, 0);
    CHECK_OK(bie_layer_set_weight_data(l, &ts));
    CHECK_OK(bie_layer_param(l, BIE_PARAM_WEIGHT, &w));
    CHECK(w.dtype == BIE_I8);
    double sum = 0, sabs = 0, amax = 0;
    for (int64_t i = 0; i < n * k; i++) {
        sum += src[i];
        sabs += fabs((double)src[i]);
    }
    double mean = sum / (double)(n * k);
    for (int64_t i = 0; i < n * k; i++) amax = fmax(amax, fabs(src[i] - mean));
    int bad = 0;
    for (int64_t i = 0; i < n * k; i++) {
        double wc = src[i] - mean, q = nearbyint(wc * 127 / amax);
        if (q == 0) q = wc >= 0 ? 1 : -1;
        bad += ((int8_t *)w.data)[i] != (int8_t)q;
    }
    CHECK(bad == 0);
    bie_tensor sw;
    CHECK_OK(bie_layer_param(l, BIE_PARAM_SCALE_W, &sw));
    CHECK(*(float *)sw.data == (float)(sabs / (double)(n * k)));
    free(src);
    bie_layer_free(l);
}

/* set_activation, leading shapes, select_gemm_kernel, asymmetric scale. */
static void test_activation_and_shapes(void) {
    const int64_t k = 19, n = 5;
    bie_layer *l = make_layer(k, n, 3);
    float x[2 * 3 * 19], xo[2 * 3 * 19], out[2 * 3 * 5], out2[2 * 3 * 5];
    tu_fill(x, 2 * 3 * k, -1, 1);
    bie_tensor tx = tu_view(x, BIE_F32, 3, 2, 3, k, 0), txo = tu_view(xo, BIE_F32, 3, 2, 3, k, 0);
    CHECK_OK(bie_layer_set_activation(l, &tx, &txo));
    bie_tensor b, sa;
    CHECK_OK(bie_layer_param(l, BIE_PARAM_BIAS_A, &b));
    int bad = 0;
    for (int64_t i = 0; i < 6; i++)
        for (int64_t c = 0; c < k; c++) bad += xo[i * k + c] != x[i * k + c] + ((float *)b.data)[c];
    CHECK(bad == 0);
    CHECK_OK(bie_layer_param(l, BIE_PARAM_SCALE_A, &sa));
    float s1 = *(float *)sa.data;
    CHECK(s1 > 0);
    /* a second set_activation keeps the initialised scale */
    CHECK_OK(bie_layer_set_activation(l, &txo, NULL));
    CHECK(*(float *)sa.data == s1);

    /* [2, 3, k] -> [2, 3, n], equal to the [6, k] -> [6, n] result */
    bie_tensor to = tu_view(out, BIE_F32, 3, 2, 3, n, 0);
    CHECK_OK(bie_layer_forward(l, &tx, &to));
    bie_tensor tx2 = tu_view(x, BIE_F32, 2, 6, k, 0, 0),
               to2 = tu_view(out2, BIE_F32, 2, 6, n, 0, 0);
    CHECK_OK(bie_layer_select_gemm_kernel(l, &tx2));
    bie_kernel_info info;
    CHECK_OK(bie_kernel_find(tu_layer_kernel(l), &info));
    CHECK(info.available);
    CHECK_OK(bie_layer_forward(l, &tx2, &to2));
    CHECK(tu_same_bits(out, out2, 6 * n));
    /* 1-D input is one row */
    bie_tensor t1 = tu_view(x, BIE_F32, 1, k, 0, 0, 0), o1 = tu_view(out2, BIE_F32, 1, n, 0, 0, 0);
    CHECK_OK(bie_layer_forward(l, &t1, &o1));
    CHECK(tu_same_bits(out, out2, n));
    bie_layer_free(l);

    /* asymmetric: scale_a = 4 mean|x| */
    bie_layer *a = NULL;
    CHECK_OK(bie_binary_linear_create(&a, k, n, bie_cpu(), BIE_F32, false));
    CHECK_OK(bie_layer_set_activation(a, &tx, NULL));
    CHECK_OK(bie_layer_param(a, BIE_PARAM_SCALE_A, &sa));
    double sum = 0;
    for (int64_t i = 0; i < 6 * k; i++) sum += fabs((double)x[i]);
    CHECK(*(float *)sa.data == (float)(4.0 * sum / (double)(6 * k)));
    bie_layer_free(a);
}

int main(void) {
    tu_seed(2024);
    printf("kernel set: %s\n", bie_cpu_kernel_set());
    if (tu_forced_set_missing()) return TU_SKIP;
    const shape3 shapes[] = {{1, 1, 1},     {1, 7, 3},      {2, 63, 1},   {3, 65, 5},
                             {1, 1000, 17}, {5, 64, 64},    {17, 257, 9}, {8, 513, 33},
                             {33, 100, 1},  {40, 4099, 12}, {64, 256, 70}};
    const int words[] = {8, 32, 64};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        for (int w = 0; w < 3; w++) test_forward_exact(shapes[i], words[w]);
    const shape3 bshapes[] = {{1, 1, 1}, {3, 7, 5}, {16, 65, 9}, {9, 130, 33}, {64, 96, 48}};
    for (size_t i = 0; i < sizeof bshapes / sizeof bshapes[0]; i++) {
        test_backward(bshapes[i]);
        test_forward_again(bshapes[i]);
    }
    test_prepare_params();
    test_activation_and_shapes();
    return tu_finish();
}
