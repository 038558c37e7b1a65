/* The 4-bit conv2d layer on CUDA against the CPU layer: forward bit for bit (float32,
 * bfloat16 and float16 outputs equal the CPU's float32 result rounded once to that dtype) in
 * training and inference modes (packed weights only), by the default path (the implicit GEMM
 * for 32 to 2048 input channels, else im2col + GEMM) and with every CUDA 4-bit kernel, over
 * strides, paddings (including output rows with no valid tap), dilations, 1x1 and even
 * kernels and odd channel counts; backward within float tolerance (16-bit 3 x 3 layers: both
 * the TMA implicit GEMMs and the im2col + cuBLAS path); bad input rejected with
 * outputs untouched. Reports itself skipped (77) without a GPU.
 * Usage: test_cuda_q4_conv2d [--small] */
#include <math.h>

#include "gpu_util.h"
#ifdef BIE_TEST_CUDA_INTERNALS
#include "cuda/cuda_internal.h"
#endif

typedef struct geo {
    int64_t n, c, h, w, o;
    int k, s, p, d;
} geo;

typedef struct pair {
    bie_layer *cpu, *gpu;
    bie_dtype dt;
    geo g;
    int64_t oh, ow;
} pair;

static float param_scalar(bie_layer *l, bie_param which) {
    bie_tensor t;
    float v = NAN;
    CHECK_OK(bie_layer_param(l, which, &t));
    if (t.device.type == BIE_DEVICE_CUDA)
        download_as(&t, &v);
    else
        v = *(float *)t.data;
    return v;
}

static pair make_pair(bie_dtype dt, geo g, int random_weight) {
    pair p = {NULL, NULL, dt, g, 0, 0};
    bie_device cuda = {BIE_DEVICE_CUDA, 0};
    const int64_t nw = g.o * g.c * g.k * g.k;
    CHECK_OK(bie_q4_conv2d_create(&p.cpu, g.c, g.o, g.k, g.s, g.p, g.d, bie_cpu(), BIE_F32));
    CHECK_OK(bie_q4_conv2d_create(&p.gpu, g.c, g.o, g.k, g.s, g.p, g.d, cuda, dt));
    if (random_weight) { /* set_weight_data in the layer's dtype; r / 256 and outliers that clamp */
        float *w = tu_alloc((size_t)nw * 4);
        for (int64_t i = 0; i < nw; i++) w[i] = (float)((int)(tu_next() % 257) - 128) / 256.0f;
        for (int64_t i = 0; i < nw; i += 7) w[i] *= 16.0f;
        bie_tensor cw = tu_view(w, BIE_F32, 4, g.o, g.c, g.k, g.k),
                   gw = upload_as(dt, w, g.o * g.c * g.k, g.k);
        reshape4(&gw, g.o, g.c, g.k, g.k);
        CHECK_OK(bie_layer_set_weight_data(p.cpu, &cw));
        CHECK_OK(bie_layer_set_weight_data(p.gpu, &gw));
        bie_tensor_free(&gw);
        free(w);
    } else {
        CHECK_OK(bie_layer_reset_parameters(p.cpu, 31 + (uint64_t)nw));
        CHECK_OK(bie_layer_reset_parameters(p.gpu, 31 + (uint64_t)nw));
        CHECK_OK(bie_layer_prepare_params(p.cpu));
        CHECK_OK(bie_layer_prepare_params(p.gpu));
    }
    CHECK_OK(tu_layer_output_hw(p.gpu, g.h, g.w, &p.oh, &p.ow));
    bie_tensor cw, gw;
    CHECK_OK(bie_layer_param(p.cpu, BIE_PARAM_WEIGHT, &cw));
    CHECK_OK(bie_layer_param(p.gpu, BIE_PARAM_WEIGHT, &gw));
    CHECK(gw.dtype == BIE_F32 && gw.ndim == 4 && gw.device.type == BIE_DEVICE_CUDA);
    float *a = tu_alloc((size_t)nw * 4);
    download_as(&gw, a);
    CHECK(compare_exact("float weight", a, cw.data, nw));
    free(a);
    const float sw_cpu = param_scalar(p.cpu, BIE_PARAM_SCALE_W),
                sw_gpu = param_scalar(p.gpu, BIE_PARAM_SCALE_W);
    CHECK(memcmp(&sw_cpu, &sw_gpu, 4) == 0);
    float *bias = tu_alloc((size_t)g.c * 4);
    tu_fill(bias, g.c, -0.3f, 0.3f);
    bie_tensor cb, gb, hb = tu_view(bias, BIE_F32, 1, g.c, 0, 0, 0);
    CHECK_OK(bie_layer_param(p.cpu, BIE_PARAM_BIAS_A, &cb));
    memcpy(cb.data, bias, (size_t)g.c * 4);
    CHECK_OK(bie_layer_param(p.gpu, BIE_PARAM_BIAS_A, &gb));
    CHECK(gb.device.type == BIE_DEVICE_CUDA);
    CHECK_OK(bie_tensor_copy(&gb, &hb));
    free(bias);
    return p;
}

static void free_pair(pair *p) {
    bie_layer_free(p->cpu);
    bie_layer_free(p->gpu);
}

static void forward_matches(pair *p, const bie_tensor *gx, const bie_tensor *cx, const char *what) {
    const geo *g = &p->g;
    const int64_t shape[4] = {g->n, g->o, p->oh, p->ow};
    if (!forward_matches_as(p->dt, 4, shape, p->gpu, p->cpu, gx, cx, what))
        fprintf(stderr, "  (dtype %s n=%lld c=%lld %lldx%lld o=%lld k=%d s=%d p=%d d=%d)\n",
                bie_dtype_name(p->dt), (long long)g->n, (long long)g->c, (long long)g->h,
                (long long)g->w, (long long)g->o, g->k, g->s, g->p, g->d);
}

static void backward_matches(pair *p, int with_grad_x) {
    const geo *g = &p->g;
    const int64_t ng = g->n * g->o * p->oh * p->ow, nx = g->n * g->c * g->h * g->w;
    const int64_t nw = g->o * g->c * g->k * g->k;
    float *go = tu_alloc((size_t)ng * 4);
    fill_input(go, ng);
    bie_tensor gg = upload_as(p->dt, go, g->n * g->o * p->oh, p->ow);
    reshape4(&gg, g->n, g->o, p->oh, p->ow);
    bie_tensor cg = tu_view(go, BIE_F32, 4, g->n, g->o, p->oh, p->ow);
    bie_tensor ggx = device_empty(p->dt, g->n * g->c * g->h, g->w);
    reshape4(&ggx, g->n, g->c, g->h, g->w);
    poison_device(&ggx);
    float *cgx = tu_alloc((size_t)nx * 4), *got = tu_alloc((size_t)(nx > nw ? nx : nw) * 4);
    bie_tensor cgxv = tu_view(cgx, BIE_F32, 4, g->n, g->c, g->h, g->w);
    bie_status st = bie_layer_backward(p->gpu, &gg, with_grad_x ? &ggx : NULL);
    CHECK(st == BIE_OK);
    if (st != BIE_OK) fprintf(stderr, "  backward: %s\n", bie_last_error());
    CHECK_OK(bie_layer_backward(p->cpu, &cg, &cgxv));
    const double tol = p->dt == BIE_F32 ? 1e-5 : p->dt == BIE_BF16 ? 8e-3 : 1e-3;
    if (with_grad_x) {
        download_as(&ggx, got);
        CHECK(compare_close("grad_x", got, cgx, nx, tol));
    }
    bie_tensor a, b;
    CHECK_OK(bie_layer_grad(p->gpu, BIE_PARAM_WEIGHT, &a));
    CHECK_OK(bie_layer_grad(p->cpu, BIE_PARAM_WEIGHT, &b));
    CHECK(a.dtype == BIE_F32 && a.ndim == 4 && a.device.type == BIE_DEVICE_CUDA);
    download_as(&a, got);
    CHECK(compare_close("grad_w", got, b.data, nw, 1e-5));
    CHECK_OK(bie_layer_grad(p->gpu, BIE_PARAM_BIAS_A, &a));
    CHECK_OK(bie_layer_grad(p->cpu, BIE_PARAM_BIAS_A, &b));
    download_as(&a, got);
    CHECK(compare_close("grad_bias_a", got, b.data, g->c, 1e-5));
    CHECK_OK(bie_layer_grad(p->gpu, BIE_PARAM_SCALE_A, &a));
    CHECK_OK(bie_layer_grad(p->cpu, BIE_PARAM_SCALE_A, &b));
    download_as(&a, got);
    const float ref = *(float *)b.data;
    double gmean = 0;
    for (int64_t i = 0; i < nx; i++) gmean += fabs(cgx[i]);
    gmean /= (double)nx;
    const int ok = fabs(got[0] - ref) <= 1e-4 * fabs(ref) + 1e-5 * gmean;
    if (!ok) fprintf(stderr, "  grad_scale_a: %.9g vs %.9g\n", (double)got[0], (double)ref);
    CHECK(ok);
    bie_tensor_free(&gg);
    bie_tensor_free(&ggx);
    free(go);
    free(cgx);
    free(got);
}

static void check_shape(bie_dtype dt, geo g, int all_kernels) {
    tu_seed(500 + (uint64_t)(g.n * 131 + g.c * 17 + g.o * 3 + g.k) + (uint64_t)dt);
    pair p = make_pair(dt, g, (int)((g.c + g.o) & 1));
    const int64_t nx = g.n * g.c * g.h * g.w;
    float *x = tu_alloc((size_t)nx * 4);
    fill_input(x, nx);
    bie_tensor gx = upload_as(dt, x, g.n * g.c * g.h, g.w);
    reshape4(&gx, g.n, g.c, g.h, g.w);
    bie_tensor cx = tu_view(x, BIE_F32, 4, g.n, g.c, g.h, g.w);

    CHECK_OK(bie_layer_set_activation(p.gpu, &gx, NULL));
    const float measured = param_scalar(p.gpu, BIE_PARAM_SCALE_A);
    double s = 0;
    for (int64_t i = 0; i < nx; i++) s += fabs(x[i]);
    const float expect = (float)(2.0 / 11.269 * s / (double)nx);
    CHECK(fabsf(measured - expect) <= 1e-6f * expect);
    CHECK_OK(bie_layer_set_scale_a(p.cpu, measured));

    forward_matches(&p, &gx, &cx, "training forward");
    backward_matches(&p, 1);
#ifdef BIE_TEST_CUDA_INTERNALS
    if (dt != BIE_F32) { /* the 16-bit backward's other path: cuBLAS over im2col buffers */
        bie_cuda_conv_backward_force_gemm(true);
        forward_matches(&p, &gx, &cx, "training forward (GEMM backward)");
        backward_matches(&p, 1);
        bie_cuda_conv_backward_force_gemm(false);
    }
#endif
    if (all_kernels) {
        for (int i = 0; i < bie_kernel_count(); i++) {
            bie_kernel_info info;
            CHECK_OK(bie_kernel_get(i, &info));
            if (info.device != BIE_DEVICE_CUDA || info.op != BIE_OP_Q4_GEMM) continue;
            CHECK_OK(bie_layer_set_gemm_kernel(p.gpu, info.id));
            forward_matches(&p, &gx, &cx, info.name);
        }
        CHECK_OK(bie_layer_set_gemm_kernel(p.gpu, -1));
        backward_matches(&p, 0);
    }

    /* set_activation: x + bias_a in the input's dtype. */
    bie_tensor xo = device_empty(dt, g.n * g.c * g.h, g.w);
    reshape4(&xo, g.n, g.c, g.h, g.w);
    float *ref = tu_alloc((size_t)nx * 4), *got = tu_alloc((size_t)nx * 4);
    bie_tensor cxo = tu_view(ref, BIE_F32, 4, g.n, g.c, g.h, g.w);
    CHECK_OK(bie_layer_set_activation(p.gpu, &gx, &xo));
    CHECK_OK(bie_layer_set_activation(p.cpu, &cx, &cxo));
    download_as(&xo, got);
    for (int64_t i = 0; i < nx; i++) ref[i] = round_to(dt, ref[i]);
    CHECK(compare_exact("set_activation", got, ref, nx));
    bie_tensor_free(&xo);
    free(ref);
    free(got);

    /* Inference: from the float weight, then from the packed weight only (equal to the CPU's). */
    CHECK_OK(bie_layer_set_training(p.cpu, false));
    CHECK_OK(bie_layer_set_training(p.gpu, false));
    forward_matches(&p, &gx, &cx, "inference forward (float weight)");
    CHECK_OK(bie_layer_generate_quantized_weight(p.cpu, true));
    CHECK_OK(bie_layer_generate_quantized_weight(p.gpu, true));
    bie_tensor q, cq, v;
    CHECK_OK(bie_layer_param(p.gpu, BIE_PARAM_QWEIGHT, &q));
    CHECK_OK(bie_layer_param(p.cpu, BIE_PARAM_QWEIGHT, &cq));
    CHECK(device_bytes_match(&q, cq.data));
    CHECK(bie_layer_param(p.gpu, BIE_PARAM_WEIGHT, &v) == BIE_ERR_STATE);
    CHECK_OK(bie_layer_opt_weight(p.gpu, &v));
    CHECK(v.data == q.data);
    forward_matches(&p, &gx, &cx, "inference forward (qweight only)");
    if (all_kernels)
        for (int i = 0; i < bie_kernel_count(); i++) {
            bie_kernel_info info;
            CHECK_OK(bie_kernel_get(i, &info));
            if (info.device != BIE_DEVICE_CUDA || info.op != BIE_OP_Q4_GEMM) continue;
            CHECK_OK(bie_layer_set_gemm_kernel(p.gpu, info.id));
            forward_matches(&p, &gx, &cx, info.name);
        }

    bie_tensor_free(&gx);
    free(x);
    free_pair(&p);
}

/* Inputs at and around the half-integer multiples of scale_a (after the bias), where the
 * encode's multiply gives way to the division: the codes must still be the CPU's. */
static void check_halves(geo g) {
    tu_seed(900);
    pair p = make_pair(BIE_F32, g, 0);
    const int64_t nx = g.n * g.c * g.h * g.w, hw = g.h * g.w;
    float *x = tu_alloc((size_t)nx * 4);
    fill_input(x, nx);
    bie_tensor gx = upload_as(BIE_F32, x, g.n * g.c * g.h, g.w);
    reshape4(&gx, g.n, g.c, g.h, g.w);
    bie_tensor cx = tu_view(x, BIE_F32, 4, g.n, g.c, g.h, g.w), cb;
    CHECK_OK(bie_layer_set_activation(p.gpu, &gx, NULL));
    const float s = param_scalar(p.gpu, BIE_PARAM_SCALE_A);
    CHECK_OK(bie_layer_set_scale_a(p.cpu, s));
    CHECK_OK(bie_layer_param(p.cpu, BIE_PARAM_BIAS_A, &cb));
    const float *bias = cb.data;
    for (int64_t i = 0; i < nx; i++) {
        const int h = (int)(tu_next() % 21) - 10;
        float v = (float)(h + 0.5) * s - bias[(i / hw) % g.c];
        for (int u = (int)(tu_next() % 7); u > 0; u--)
            v = nextafterf(v, (tu_next() & 1) ? INFINITY : -INFINITY);
        x[i] = v;
    }
    bie_tensor_free(&gx);
    gx = upload_as(BIE_F32, x, g.n * g.c * g.h, g.w);
    reshape4(&gx, g.n, g.c, g.h, g.w);
    forward_matches(&p, &gx, &cx, "training forward at the halves");
    CHECK_OK(bie_layer_set_training(p.cpu, false));
    CHECK_OK(bie_layer_set_training(p.gpu, false));
    forward_matches(&p, &gx, &cx, "inference forward at the halves");
    bie_tensor_free(&gx);
    free(x);
    free_pair(&p);
}

static void bad_input(void) {
    const geo g = {2, 5, 6, 6, 4, 3, 1, 1, 1};
    tu_seed(5);
    pair p = make_pair(BIE_BF16, g, 1);
    float x[2 * 5 * 36];
    fill_input(x, 2 * 5 * 36);
    bie_tensor gx = upload_as(BIE_BF16, x, 2 * 5 * 6, 6), hx = tu_view(x, BIE_F32, 4, 2, 5, 6, 6);
    reshape4(&gx, 2, 5, 6, 6);
    bie_tensor gx32 = upload_as(BIE_F32, x, 2 * 5 * 6, 6);
    reshape4(&gx32, 2, 5, 6, 6);
    bie_tensor out = device_empty(BIE_BF16, 2 * 4 * 6, 6);
    reshape4(&out, 2, 4, 6, 6);
    poison_device(&out);
    CHECK(bie_layer_forward(p.gpu, &hx, &out) == BIE_ERR_DEVICE);  /* host input */
    CHECK(bie_layer_forward(p.gpu, &gx32, &out) == BIE_ERR_DTYPE); /* wrong dtype */
    CHECK(bie_layer_forward(p.gpu, NULL, &out) == BIE_ERR_NULL_POINTER);
    bie_tensor wrong = device_empty(BIE_BF16, 2 * 4 * 6, 5);
    reshape4(&wrong, 2, 4, 6, 5);
    CHECK(bie_layer_forward(p.gpu, &gx, &wrong) == BIE_ERR_SHAPE);
    bie_tensor three = device_empty(BIE_BF16, 2 * 4, 6);
    reshape4(&three, 2, 4, 6, 1);
    CHECK(bie_layer_forward(p.gpu, &three, &out) == BIE_ERR_SHAPE); /* 4 channels, not 5 */
    bie_tensor gout = device_empty(BIE_BF16, 2 * 4 * 6, 6);
    reshape4(&gout, 2, 4, 6, 6);
    CHECK(bie_layer_backward(p.gpu, &gout, NULL) == BIE_ERR_STATE); /* no forward yet */
    CHECK(bie_layer_set_gemm_kernel(p.gpu, 1) != BIE_OK);           /* a CPU kernel */
    CHECK(bie_layer_set_gemm_kernel(p.gpu, 12345) == BIE_ERR_INVALID_ARGUMENT);
    CHECK(bie_layer_set_scale_a(p.gpu, INFINITY) != BIE_OK);
    bie_tensor w_wrong = device_empty(BIE_F32, 4 * 5 * 3, 3); /* the layer is bfloat16 */
    reshape4(&w_wrong, 4, 5, 3, 3);
    CHECK(bie_layer_set_weight_data(p.gpu, &w_wrong) == BIE_ERR_DTYPE);
    bie_tensor q_wrong = device_empty(BIE_U8, 4, 22); /* 23 bytes per row */
    CHECK(bie_layer_set_quantized_weight_data(p.gpu, &q_wrong) == BIE_ERR_SHAPE);
    bie_device cuda = {BIE_DEVICE_CUDA, 0}, nodev = {BIE_DEVICE_CUDA, 999};
    bie_layer *l = NULL;
    CHECK(bie_q4_conv2d_create(&l, 4, 4, 3, 1, 1, 1, cuda, BIE_I8) == BIE_ERR_DTYPE && l == NULL);
    CHECK(bie_q4_conv2d_create(&l, 4, 4, 3, 1, 1, 1, nodev, BIE_F32) == BIE_ERR_DEVICE &&
          l == NULL);
    /* After a training forward, grad_out of another shape is refused. */
    CHECK_OK(bie_layer_forward(p.gpu, &gx, &out));
    CHECK(bie_layer_backward(p.gpu, &wrong, NULL) == BIE_ERR_SHAPE);
    poison_device(&out);
    CHECK(bie_layer_forward(p.gpu, &gx32, &out) == BIE_ERR_DTYPE);
    CHECK(still_poisoned(&out)); /* failed calls wrote nothing */
    bie_tensor_free(&gx);
    bie_tensor_free(&gx32);
    bie_tensor_free(&out);
    bie_tensor_free(&wrong);
    bie_tensor_free(&three);
    bie_tensor_free(&gout);
    bie_tensor_free(&w_wrong);
    bie_tensor_free(&q_wrong);
    free_pair(&p);
}

int main(int argc, char **argv) {
    const int small = argc > 1 && strcmp(argv[1], "--small") == 0;
    if (gpu_missing()) return TU_SKIP;
    static const geo shapes[] = {
        /* n, c, h, w, o, k, s, p, d */
        {1, 1, 1, 1, 1, 1, 1, 0, 1},        {2, 3, 5, 7, 4, 3, 1, 1, 1},
        {1, 33, 9, 8, 17, 3, 2, 1, 1},      {1, 5, 3, 3, 7, 3, 1, 3, 1},
        {2, 16, 11, 13, 8, 5, 2, 2, 2},     {1, 70, 6, 6, 65, 1, 1, 0, 1},
        {2, 31, 17, 9, 5, 4, 3, 0, 1},      {3, 64, 14, 14, 32, 3, 1, 1, 1},
        {2, 128, 8, 8, 96, 3, 1, 2, 1},     {4, 256, 14, 14, 256, 3, 1, 1, 1},
        {2, 40, 9, 11, 19, 2, 1, 1, 2},     {1, 601, 5, 4, 33, 3, 1, 1, 1},
        {1, 2050, 3, 3, 3, 1, 1, 0, 1},     {5, 48, 7, 5, 130, 3, 2, 2, 1},
        {32, 96, 14, 14, 130, 3, 1, 1, 1},  /* enough blocks for the large-tile implicit GEMM */
        {24, 130, 15, 15, 200, 3, 1, 1, 1}, /* 128 x 64 tiles with 128-byte k blocks (132 SMs) */
        {40, 136, 15, 15, 256, 3, 1, 1, 1}, /* wgmma tiles (compute capability 9.0; else 96 x 128)
                                             */
        {80, 136, 15, 15, 128, 3, 1, 1, 1}, /* 128 x 128 wgmma tiles (else 96 x 128; 132 SMs) */
        {40, 120, 15, 15, 256, 3, 1, 1, 1}, /* wgmma, an odd number of 64-byte k blocks */
    };
    const int count = small ? 4 : (int)(sizeof shapes / sizeof shapes[0]);
    for (int d = 0; d < 3; d++)
        for (int i = 0; i < count; i++) check_shape(kDtypes[d], shapes[i], !small && i % 3 == 1);
    const geo halves = {2, 40, 6, 7, 24, 3, 1, 1, 1};
    check_halves(halves);
    bad_input();
    return tu_finish();
}
