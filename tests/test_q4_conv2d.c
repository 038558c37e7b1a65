/* 4-bit conv2d (SPEC §4) against direct loops: forward exact for every 4-bit kernel and many
 * geometries (zero padding, stride, dilation, odd channels, batch), packed-weight inference
 * equal to training, backward against double precision, bad input. */
#include "layer_ref.h"
#include "test_util.h"

typedef ref_geom geom;

static int64_t osz(int64_t in, const geom *g) { return ref_out_size(in, g->k, g->s, g->p, g->d); }

static void run_case(const geom *g, int check_backward) {
    bie_layer *l = NULL;
    CHECK_OK(bie_q4_conv2d_create(&l, g->c, g->o, (int)g->k, (int)g->s, (int)g->p, (int)g->d,
                                  bie_cpu(), BIE_F32));
    const int64_t oh = osz(g->h, g), ow = osz(g->w, g), hw = g->h * g->w, K = g->c * g->k * g->k;
    const int64_t nx = g->n * g->c * hw, no = g->n * g->o * oh * ow;
    float *w = tu_alloc((size_t)(g->o * K) * 4), *x = tu_alloc((size_t)nx * 4);
    float *out = tu_alloc((size_t)no * 4), *expect = tu_alloc((size_t)no * 4);
    tu_fill(w, g->o * K, -0.5f, 0.5f);
    for (int64_t i = 0; i < g->o * K; i += 7) w[i] *= 40.0f; /* outliers: codes clamp at -8 / 7 */
    tu_fill(x, nx, -2, 2);
    bie_tensor tw = tu_view(w, BIE_F32, 4, g->o, g->c, g->k, g->k),
               tx = tu_view(x, BIE_F32, 4, g->n, g->c, g->h, g->w);
    bie_tensor to = tu_view(out, BIE_F32, 4, g->n, g->o, oh, ow);
    CHECK_OK(bie_layer_set_weight_data(l, &tw));
    bie_tensor bias, sa, sw;
    CHECK_OK(bie_layer_param(l, BIE_PARAM_BIAS_A, &bias));
    tu_fill(bias.data, g->c, -0.1f, 0.1f);
    const float *b = bias.data;
    tu_poison(out, no);
    CHECK_OK(bie_layer_forward(l, &tx, &to));
    CHECK_OK(bie_layer_param(l, BIE_PARAM_SCALE_A, &sa));
    CHECK_OK(bie_layer_param(l, BIE_PARAM_SCALE_W, &sw));
    const float scale_a = *(float *)sa.data, scale_w = *(float *)sw.data;
    int8_t *wcode = tu_alloc((size_t)(g->o * K));
    for (int64_t i = 0; i < g->o * K; i++) wcode[i] = ref_q4(w[i], scale_w);
    ref_forward(g, &REF_Q4, x, b, wcode, scale_a, scale_w, expect);
    CHECK(tu_same_bits(out, expect, no));
    for (int idx = 0; idx < bie_kernel_count(); idx++) {
        bie_kernel_info info;
        CHECK_OK(bie_kernel_get(idx, &info));
        if (info.op != BIE_OP_Q4_GEMM || !info.available || info.device != BIE_DEVICE_CPU) continue;
        CHECK_OK(bie_layer_set_gemm_kernel(l, info.id));
        tu_poison(out, no);
        CHECK_OK(bie_layer_forward(l, &tx, &to));
        int same = tu_same_bits(out, expect, no);
        CHECK(same);
        if (!same)
            fprintf(stderr, "  %s differs (c%lld k%lld s%lld p%lld d%lld)\n", info.name,
                    (long long)g->c, (long long)g->k, (long long)g->s, (long long)g->p,
                    (long long)g->d);
    }
    CHECK_OK(bie_layer_set_gemm_kernel(l, -1));

    if (check_backward) {
        float *go = tu_alloc((size_t)no * 4), *gx = tu_alloc((size_t)nx * 4);
        tu_fill(go, no, -1, 1);
        bie_tensor tg = tu_view(go, BIE_F32, 4, g->n, g->o, oh, ow),
                   tgx = tu_view(gx, BIE_F32, 4, g->n, g->c, g->h, g->w);
        CHECK_OK(bie_layer_forward(l, &tx, &to));
        tu_poison(gx, nx);
        CHECK_OK(bie_layer_backward(l, &tg, &tgx));
        double *rgx = tu_alloc((size_t)nx * sizeof(double)),
               *rgw = tu_alloc((size_t)(g->o * K) * sizeof(double));
        double *rgb = tu_alloc((size_t)g->c * sizeof(double)), rgs = 0, bound = 0, e = 0, r = 0;
        ref_backward(g, &REF_Q4, x, b, wcode, scale_a, scale_w, go, rgx, rgw, rgb, &rgs, &bound);
        for (int64_t i = 0; i < nx; i++) {
            e += (gx[i] - rgx[i]) * (gx[i] - rgx[i]);
            r += rgx[i] * rgx[i];
        }
        CHECK(sqrt(e) <= 1e-5 * sqrt(r) + 1e-6);
        bound += 1e-6; /* the rounding residual's resolution (layer_ref.h), and a little */
        bie_tensor ggw, ggb, ggs;
        CHECK_OK(bie_layer_grad(l, BIE_PARAM_WEIGHT, &ggw));
        CHECK_OK(bie_layer_grad(l, BIE_PARAM_BIAS_A, &ggb));
        CHECK_OK(bie_layer_grad(l, BIE_PARAM_SCALE_A, &ggs));
        e = r = 0;
        for (int64_t i = 0; i < g->o * K; i++) {
            double d = ((float *)ggw.data)[i] - rgw[i];
            e += d * d, r += rgw[i] * rgw[i];
        }
        CHECK(sqrt(e) <= 1e-5 * sqrt(r) + 1e-6);
        e = r = 0;
        for (int64_t c = 0; c < g->c; c++) {
            double d = ((float *)ggb.data)[c] - rgb[c];
            e += d * d, r += rgb[c] * rgb[c];
        }
        CHECK(sqrt(e) <= 1e-5 * sqrt(r) + 1e-6);
        CHECK(fabs(*(float *)ggs.data - rgs) <= bound + 1e-4 * fabs(rgs));
        free(rgx), free(rgw), free(rgb), free(go), free(gx);
    }
    /* packed-weight inference equals training; weight-free training refused */
    CHECK_OK(bie_layer_set_training(l, false));
    CHECK_OK(bie_layer_generate_quantized_weight(l, true));
    tu_poison(out, no);
    CHECK_OK(bie_layer_forward(l, &tx, &to));
    CHECK(tu_same_bits(out, expect, no));
    CHECK_OK(bie_layer_set_training(l, true));
    CHECK(bie_layer_forward(l, &tx, &to) == BIE_ERR_STATE);
    bie_layer_free(l);
    free(w), free(x), free(out), free(expect), free(wcode);
}

static void test_bad_input(void) {
    bie_layer *l = NULL;
    CHECK(bie_q4_conv2d_create(&l, 3, 4, 3, 0, 1, 1, bie_cpu(), BIE_F32) ==
          BIE_ERR_INVALID_ARGUMENT);
    CHECK(bie_q4_conv2d_create(&l, 3, 4, 3, 1, -1, 1, bie_cpu(), BIE_F32) ==
          BIE_ERR_INVALID_ARGUMENT);
    CHECK(bie_q4_conv2d_create(&l, 3, 4, 3, 1, 1, 0, bie_cpu(), BIE_F32) ==
          BIE_ERR_INVALID_ARGUMENT);
    CHECK(l == NULL);
    CHECK_OK(bie_q4_conv2d_create(&l, 3, 4, 3, 1, 0, 2, bie_cpu(), BIE_F32));
    float x[96], out[64], poison[64];
    tu_fill(x, 96, -1, 1);
    tu_poison(out, 64);
    tu_poison(poison, 64);
    bie_tensor chans = tu_view(x, BIE_F32, 4, 2, 6, 4, 2),
               small = tu_view(x, BIE_F32, 4, 2, 3, 4, 4);
    bie_tensor o = tu_view(out, BIE_F32, 4, 1, 4, 2, 2);
    CHECK(bie_layer_forward(l, &chans, &o) == BIE_ERR_SHAPE);
    CHECK(bie_layer_forward(l, &small, &o) == BIE_ERR_SHAPE);
    CHECK(bie_layer_backward(l, &o, NULL) == BIE_ERR_STATE);
    CHECK(tu_same_bits(out, poison, 64));
    bie_layer_free(l);
}

int main(void) {
    if (tu_forced_set_missing()) return TU_SKIP;
    tu_seed(44);
    const geom shapes[] = {{1, 1, 1, 1, 1, 1, 1, 0, 1},  {1, 3, 5, 5, 4, 3, 1, 1, 1},
                           {2, 7, 9, 6, 5, 3, 2, 1, 1},  {1, 33, 7, 7, 3, 3, 1, 2, 2},
                           {3, 16, 8, 8, 8, 1, 1, 0, 1}, {1, 5, 11, 13, 7, 5, 2, 2, 1},
                           {2, 64, 6, 6, 9, 3, 1, 1, 1}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) run_case(&shapes[i], i < 5);
    test_bad_input();
    return tu_finish();
}
