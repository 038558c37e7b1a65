/* Binary conv2d (SPEC §3) against direct loops: forward bit-exact (64-bit integer dot over
 * the taps inside the input, zero padding) for every kernel and many geometries, inference
 * with packed weights equal to training, backward against double precision, bad input. */
#include "layer_ref.h"
#include "test_util.h"

typedef ref_geom geom;

static int64_t out_size(int64_t in, const geom *g) {
    return ref_out_size(in, g->k, g->s, g->p, g->d);
}

static bie_layer *make_layer(const geom *g, uint64_t seed) {
    bie_layer *l = NULL;
    if (bie_binary_conv2d_create(&l, g->c, g->o, (int)g->k, (int)g->s, (int)g->p, (int)g->d,
                                 bie_cpu(), BIE_F32, true) != BIE_OK) {
        fprintf(stderr, "create: %s\n", bie_last_error());
        exit(2);
    }
    CHECK_OK(bie_layer_reset_parameters(l, seed));
    CHECK_OK(bie_layer_prepare_params(l));
    bie_tensor b;
    CHECK_OK(bie_layer_param(l, BIE_PARAM_BIAS_A, &b));
    tu_fill(b.data, g->c, -0.2f, 0.2f);
    return l;
}

/* The layer's weight codes: the signs of its int8 weight. */
static int8_t *weight_signs(bie_layer *l, const geom *g) {
    bie_tensor w;
    CHECK_OK(bie_layer_param(l, BIE_PARAM_WEIGHT, &w));
    const int64_t nw = g->o * ref_fan_in(g);
    int8_t *codes = tu_alloc((size_t)nw);
    for (int64_t i = 0; i < nw; i++) codes[i] = REF_BINARY.weight_code(&w, i, 1.0f);
    return codes;
}

static void ref_forward_layer(bie_layer *l, const geom *g, const float *x, float *expect) {
    bie_tensor b, sa, sw;
    bie_layer_param(l, BIE_PARAM_BIAS_A, &b);
    bie_layer_param(l, BIE_PARAM_SCALE_A, &sa);
    bie_layer_param(l, BIE_PARAM_SCALE_W, &sw);
    int8_t *codes = weight_signs(l, g);
    ref_forward(g, &REF_BINARY, x, b.data, codes, *(float *)sa.data, *(float *)sw.data, expect);
    free(codes);
}

static void test_forward(const geom *g) {
    bie_layer *l = make_layer(g, 11 + (uint64_t)g->c);
    int64_t oh = out_size(g->h, g), ow = out_size(g->w, g);
    int64_t nx = g->n * g->c * g->h * g->w, no = g->n * g->o * oh * ow;
    float *x = tu_alloc((size_t)nx * 4), *out = tu_alloc((size_t)no * 4),
          *expect = tu_alloc((size_t)no * 4);
    tu_fill(x, nx, -1, 1);
    bie_tensor tx = tu_view(x, BIE_F32, 4, g->n, g->c, g->h, g->w),
               to = tu_view(out, BIE_F32, 4, g->n, g->o, oh, ow);
    int64_t qh, qw;
    CHECK_OK(tu_layer_output_hw(l, g->h, g->w, &qh, &qw));
    CHECK(qh == oh && qw == ow);
    tu_poison(out, no);
    CHECK_OK(bie_layer_forward(l, &tx, &to));
    ref_forward_layer(l, g, x, expect);
    int same = tu_same_bits(out, expect, no);
    CHECK(same);
    if (!same)
        fprintf(stderr,
                "  default kernel differs: n%lld c%lld %lldx%lld o%lld k%lld s%lld p%lld d%lld\n",
                (long long)g->n, (long long)g->c, (long long)g->h, (long long)g->w, (long long)g->o,
                (long long)g->k, (long long)g->s, (long long)g->p, (long long)g->d);
    for (int idx = 0; idx < bie_kernel_count(); idx++) {
        bie_kernel_info info;
        CHECK_OK(bie_kernel_get(idx, &info));
        if (!info.available || info.device != BIE_DEVICE_CPU || info.op != BIE_OP_BINARY_GEMM)
            continue;
        CHECK_OK(bie_layer_set_gemm_kernel(l, info.id));
        tu_poison(out, no);
        CHECK_OK(bie_layer_forward(l, &tx, &to));
        same = tu_same_bits(out, expect, no);
        CHECK(same);
        if (!same)
            fprintf(stderr, "  %s differs (c%lld k%lld)\n", info.name, (long long)g->c,
                    (long long)g->k);
    }
    CHECK_OK(bie_layer_select_gemm_kernel(l, &tx));
    /* inference with packed weights, then without the int8 weight */
    CHECK_OK(bie_layer_set_training(l, false));
    const int words[3] = {8, 32, 64};
    CHECK_OK(bie_layer_set_bits_binary_word(l, words[g->c % 3]));
    tu_poison(out, no);
    CHECK_OK(bie_layer_forward(l, &tx, &to));
    CHECK(tu_same_bits(out, expect, no));
    CHECK_OK(bie_layer_generate_quantized_weight(l, true));
    tu_poison(out, no);
    CHECK_OK(bie_layer_forward(l, &tx, &to));
    CHECK(tu_same_bits(out, expect, no));
    bie_tensor ow_view;
    CHECK_OK(bie_layer_opt_weight(l, &ow_view));
    CHECK(ow_view.shape[0] == g->o &&
          ow_view.shape[1] == bie_packed_words(g->c * g->k * g->k, tu_layer_bits(l)));
    CHECK_OK(bie_layer_set_training(l, true));
    CHECK(bie_layer_forward(l, &tx, &to) == BIE_ERR_STATE);
    bie_layer_free(l);
    free(x);
    free(out);
    free(expect);
}

/* forward_again: the kept training forward's output bit for bit, whatever changed since (the
 * input buffer, scale_a, the weight's values in place); nothing kept or a bad output: an
 * error and the output untouched. */
static void test_forward_again(const geom *g) {
    bie_layer *l = make_layer(g, 23 + (uint64_t)g->c);
    int64_t oh = out_size(g->h, g), ow = out_size(g->w, g);
    int64_t nx = g->n * g->c * g->h * g->w, no = g->n * g->o * oh * ow;
    float *x = tu_alloc((size_t)nx * 4), *out = tu_alloc((size_t)no * 4),
          *expect = tu_alloc((size_t)no * 4), *poison = tu_alloc((size_t)no * 4);
    tu_fill(x, nx, -1.5f, 1.5f);
    tu_poison(poison, no);
    bie_tensor tx = tu_view(x, BIE_F32, 4, g->n, g->c, g->h, g->w),
               to = tu_view(out, BIE_F32, 4, g->n, g->o, oh, ow);
    tu_poison(out, no);
    CHECK(bie_layer_forward_again(l, &to) == BIE_ERR_STATE);
    CHECK(tu_same_bits(out, poison, no));
    CHECK_OK(bie_layer_forward(l, &tx, &to));
    tu_check_forward_again(l, x, nx, &to, expect, no);
    bie_tensor bad = tu_view(out, BIE_F32, 4, g->n, g->o + 1, oh, ow);
    bie_tensor bad_dtype = tu_view(out, BIE_BF16, 4, g->n, g->o, oh, ow);
    tu_poison(out, no);
    CHECK(bie_layer_forward_again(l, &bad) == BIE_ERR_SHAPE);
    CHECK(bie_layer_forward_again(l, &bad_dtype) == BIE_ERR_DTYPE);
    CHECK(bie_layer_forward_again(l, NULL) == BIE_ERR_NULL_POINTER);
    CHECK(bie_layer_forward_again(NULL, &to) == BIE_ERR_NULL_POINTER);
    CHECK(tu_same_bits(out, poison, no));
    CHECK_OK(bie_layer_set_training(l, false)); /* leaving training mode drops what was kept */
    CHECK(bie_layer_forward_again(l, &to) == BIE_ERR_STATE);
    CHECK(tu_same_bits(out, poison, no));
    bie_layer_free(l);
    free(x);
    free(out);
    free(expect);
    free(poison);
}

static double rel_err(const float *got, const double *ref, int64_t n) {
    double e = 0, r = 0;
    for (int64_t i = 0; i < n; i++) {
        e += (got[i] - ref[i]) * (got[i] - ref[i]);
        r += ref[i] * ref[i];
    }
    return sqrt(e) / (sqrt(r) + 1e-12);
}

static void test_backward(const geom *g) {
    bie_layer *l = make_layer(g, 5 + (uint64_t)g->o);
    int64_t oh = out_size(g->h, g), ow = out_size(g->w, g), hw = g->h * g->w;
    int64_t nx = g->n * g->c * hw, no = g->n * g->o * oh * ow, K = g->c * g->k * g->k;
    float *x = tu_alloc((size_t)nx * 4), *out = tu_alloc((size_t)no * 4),
          *go = tu_alloc((size_t)no * 4);
    float *gx = tu_alloc((size_t)nx * 4);
    tu_fill(x, nx, -1.5f, 1.5f);
    tu_fill(go, no, -1, 1);
    bie_tensor tx = tu_view(x, BIE_F32, 4, g->n, g->c, g->h, g->w),
               to = tu_view(out, BIE_F32, 4, g->n, g->o, oh, ow);
    bie_tensor tg = tu_view(go, BIE_F32, 4, g->n, g->o, oh, ow),
               tgx = tu_view(gx, BIE_F32, 4, g->n, g->c, g->h, g->w);
    CHECK_OK(bie_layer_forward(l, &tx, &to));
    tu_poison(gx, nx);
    CHECK_OK(bie_layer_backward(l, &tg, &tgx));
    bie_tensor b, sa, sw;
    CHECK_OK(bie_layer_param(l, BIE_PARAM_BIAS_A, &b));
    CHECK_OK(bie_layer_param(l, BIE_PARAM_SCALE_A, &sa));
    CHECK_OK(bie_layer_param(l, BIE_PARAM_SCALE_W, &sw));
    int8_t *codes = weight_signs(l, g);
    double *rgx = tu_alloc((size_t)nx * sizeof(double)),
           *rgw = tu_alloc((size_t)(g->o * K) * sizeof(double));
    double *rgb = tu_alloc((size_t)g->c * sizeof(double)), rgs = 0, gs_tol = 0;
    ref_backward(g, &REF_BINARY, x, b.data, codes, *(float *)sa.data, *(float *)sw.data, go, rgx,
                 rgw, rgb, &rgs, &gs_tol);
    free(codes);
    CHECK(rel_err(gx, rgx, nx) < 1e-5);
    bie_tensor ggw, ggb, ggs, ggq;
    CHECK_OK(bie_layer_grad(l, BIE_PARAM_WEIGHT_FLOAT_GRAD, &ggw));
    CHECK_OK(bie_layer_grad(l, BIE_PARAM_BIAS_A, &ggb));
    CHECK_OK(bie_layer_grad(l, BIE_PARAM_SCALE_A, &ggs));
    CHECK_OK(bie_layer_grad(l, BIE_PARAM_WEIGHT, &ggq));
    CHECK(ggq.dtype == BIE_I8 && ggq.ndim == 4);
    CHECK(rel_err(ggw.data, rgw, g->o * K) < 1e-5);
    CHECK(rel_err(ggb.data, rgb, g->c) < 1e-5);
    CHECK(fabs(*(float *)ggs.data - rgs) <= 1e-4 * fabs(rgs) + 1e-5);
    free(rgx);
    free(rgw);
    free(rgb);
    free(x);
    free(out);
    free(go);
    free(gx);
    bie_layer_free(l);
}

/* Inference uses an installed qweight, not the training weight (as binary linear does). */
static void test_installed_qweight(void) {
    const geom g = {1, 5, 6, 6, 3, 3, 1, 1, 1};
    bie_layer *l = make_layer(&g, 3);
    int64_t words = bie_packed_words(g.c * g.k * g.k, 8), no = g.o * 36;
    uint8_t *ones = tu_alloc((size_t)(g.o * words)), *zeros = tu_alloc((size_t)(g.o * words));
    memset(ones, 0xff, (size_t)(g.o * words));
    memset(zeros, 0, (size_t)(g.o * words));
    float x[5 * 36], a[3 * 36], b[3 * 36];
    tu_fill(x, 5 * 36, -1, 1);
    bie_tensor tx = tu_view(x, BIE_F32, 4, 1, 5, 6, 6), ta = tu_view(a, BIE_F32, 4, 1, 3, 6, 6);
    bie_tensor tb = tu_view(b, BIE_F32, 4, 1, 3, 6, 6);
    bie_tensor q1 = tu_view(ones, BIE_U8, 2, g.o, words, 0, 0),
               q0 = tu_view(zeros, BIE_U8, 2, g.o, words, 0, 0);
    CHECK_OK(bie_layer_set_training(l, false));
    CHECK_OK(bie_layer_set_quantized_weight_data(l, &q1));
    CHECK_OK(bie_layer_forward(l, &tx, &ta));
    CHECK_OK(bie_layer_set_quantized_weight_data(l, &q0));
    CHECK_OK(bie_layer_forward(l, &tx, &tb));
    int opposite = 1;
    for (int64_t i = 0; i < no; i++) opposite &= a[i] == -b[i];
    CHECK(opposite); /* all +1 weights vs all -1 weights */
    free(ones);
    free(zeros);
    bie_layer_free(l);
}

static void test_bad_input(void) {
    bie_layer *l = NULL;
    CHECK(bie_binary_conv2d_create(&l, 3, 4, 3, 0, 1, 1, bie_cpu(), BIE_F32, true) ==
          BIE_ERR_INVALID_ARGUMENT);
    CHECK(bie_binary_conv2d_create(&l, 3, 4, 3, 1, -1, 1, bie_cpu(), BIE_F32, true) ==
          BIE_ERR_INVALID_ARGUMENT);
    CHECK(bie_binary_conv2d_create(&l, 3, 4, 3, 1, 1, 0, bie_cpu(), BIE_F32, true) ==
          BIE_ERR_INVALID_ARGUMENT);
    CHECK(bie_binary_conv2d_create(&l, 0, 4, 3, 1, 1, 1, bie_cpu(), BIE_F32, true) ==
          BIE_ERR_INVALID_ARGUMENT);
    CHECK(l == NULL);
    CHECK_OK(bie_binary_conv2d_create(&l, 3, 4, 3, 1, 0, 2, bie_cpu(), BIE_F32, true));
    float x[2 * 3 * 4 * 4], out[64];
    tu_fill(x, 96, -1, 1);
    tu_poison(out, 64);
    bie_tensor rank3 = tu_view(x, BIE_F32, 3, 3, 4, 8, 0);
    bie_tensor chans = tu_view(x, BIE_F32, 4, 2, 6, 4, 2);
    bie_tensor small = tu_view(x, BIE_F32, 4, 2, 3, 4, 4); /* dilated kernel 5 > 4 */
    bie_tensor o = tu_view(out, BIE_F32, 4, 1, 4, 2, 2);
    CHECK(bie_layer_forward(l, &rank3, &o) == BIE_ERR_SHAPE);
    CHECK(bie_layer_forward(l, &chans, &o) == BIE_ERR_SHAPE);
    CHECK(bie_layer_forward(l, &small, &o) == BIE_ERR_SHAPE);
    CHECK(strstr(bie_last_error(), "larger than the padded input") != NULL);
    CHECK(bie_layer_backward(l, &o, NULL) == BIE_ERR_STATE);
    float poison[64];
    tu_poison(poison, 64);
    CHECK(tu_same_bits(out, poison, 64));
    bie_tensor sa;
    CHECK_OK(bie_layer_param(l, BIE_PARAM_SCALE_A, &sa));
    CHECK(*(float *)sa.data == 0.0f);
    bie_layer_free(l);
    CHECK_OK(bie_q4_conv2d_create(&l, 3, 4, 3, 1, 1, 1, bie_cpu(), BIE_F32));
    CHECK(bie_layer_forward_again(l, &o) == BIE_ERR_UNSUPPORTED); /* binary kinds only */
    CHECK(strstr(bie_last_error(), "q4_conv2d") != NULL);
    CHECK(tu_same_bits(out, poison, 64));
    bie_layer_free(l);
}

int main(void) {
    if (tu_forced_set_missing()) return TU_SKIP;
    tu_seed(31);
    const geom shapes[] = {
        {1, 1, 1, 1, 1, 1, 1, 0, 1},
        {1, 3, 5, 5, 4, 3, 1, 1, 1},
        {2, 7, 9, 6, 5, 3, 2, 1, 1},
        {1, 65, 7, 7, 3, 3, 1, 2, 2},
        {3, 16, 8, 8, 8, 1, 1, 0, 1},
        {1, 5, 11, 13, 7, 5, 2, 2, 1},
        {1, 130, 6, 5, 9, 3, 1, 1, 1},
        {2, 64, 14, 14, 16, 3, 1, 1, 1},
        {1, 3, 4, 4, 2, 3, 3, 0, 1},
        {1, 2, 3, 3, 2, 3, 1, 3, 1},
        {1, 33, 10, 5, 17, 2, 1, 0, 3},
        /* a plane large enough that the forward finds the outside taps per pixel itself */
        {1, 1, 700, 660, 2, 3, 1, 1, 1},
    };
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        test_forward(&shapes[i]);
        if (shapes[i].h < 100) test_forward_again(&shapes[i]);
    }
    const geom bshapes[] = {{1, 1, 1, 1, 1, 1, 1, 0, 1},
                            {2, 3, 5, 4, 4, 3, 1, 1, 1},
                            {1, 9, 7, 7, 5, 3, 2, 2, 2},
                            {2, 16, 6, 6, 8, 1, 1, 0, 1},
                            /* stride 1: rows of bits expanded 8 at a time, partial ranges */
                            {2, 5, 9, 19, 6, 3, 1, 2, 2},
                            {1, 3, 6, 17, 4, 5, 1, 0, 1},
                            {1, 4, 5, 23, 3, 3, 1, 1, 1}};
    for (size_t i = 0; i < sizeof bshapes / sizeof bshapes[0]; i++) test_backward(&bshapes[i]);
    test_installed_qweight();
    test_bad_input();
    return tu_finish();
}
