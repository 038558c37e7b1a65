/* The binary conv2d layer on CUDA against the CPU layer: forward bit for bit (float32,
 * bfloat16 and float16 outputs equal the CPU's float32 result rounded once to that dtype) in
 * training and inference modes with every CUDA kernel, over strides, paddings (including
 * output rows with no valid tap), dilations, 1x1 and even kernels and channel counts that are
 * not multiples of 32; special values (infinities, NaN, signed zeros, subnormals, x = -bias)
 * in inference; backward within float tolerance; bad input rejected with outputs untouched. Reports
 * itself skipped (77) without a GPU. Usage: test_cuda_binary_conv2d [--small] */
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
    int nhwc; /* the GPU layer's activations are NHWC (channels last) */
} pair;

/* A device tensor [n, c, h, w] of dtype dt holding x (host NCHW), NHWC in memory if nhwc. */
static bie_tensor upload4(bie_dtype dt, const float *x, int64_t n, int64_t c, int64_t h, int64_t w,
                          int nhwc) {
    const int64_t count = n * c * h * w;
    float *t = NULL;
    if (nhwc) {
        t = tu_alloc((size_t)count * 4);
        nhwc_order(x, t, n, c, h * w, 0);
    }
    bie_tensor d = upload_as(dt, t ? t : x, n * c * h, w);
    reshape4(&d, n, c, h, w);
    free(t);
    return d;
}

/* Host NCHW floats of a device tensor [n, c, h, w] (NHWC in memory if nhwc). */
static void download4(const bie_tensor *d, float *out, int nhwc) {
    const int64_t count = d->shape[0] * d->shape[1] * d->shape[2] * d->shape[3];
    if (!nhwc) {
        download_as(d, out);
        return;
    }
    float *t = tu_alloc((size_t)count * 4);
    download_as(d, t);
    nhwc_order(t, out, d->shape[0], d->shape[1], d->shape[2] * d->shape[3], 1);
    free(t);
}

static pair make_pair(bie_dtype dt, geo g, uint64_t seed) {
    pair p = {NULL, NULL, dt, g, 0, 0, 0};
    bie_device cuda = {BIE_DEVICE_CUDA, 0};
    CHECK_OK(
        bie_binary_conv2d_create(&p.cpu, g.c, g.o, g.k, g.s, g.p, g.d, bie_cpu(), BIE_F32, true));
    CHECK_OK(bie_binary_conv2d_create(&p.gpu, g.c, g.o, g.k, g.s, g.p, g.d, cuda, dt, true));
    CHECK_OK(bie_layer_reset_parameters(p.cpu, seed));
    CHECK_OK(bie_layer_reset_parameters(p.gpu, seed));
    CHECK_OK(bie_layer_prepare_params(p.cpu));
    CHECK_OK(bie_layer_prepare_params(p.gpu));
    CHECK_OK(tu_layer_output_hw(p.gpu, g.h, g.w, &p.oh, &p.ow));
    float *bias = tu_alloc((size_t)g.c * 4);
    tu_fill(bias, g.c, -0.3f, 0.3f);
    bie_tensor cb, gb, hb = tu_view(bias, BIE_F32, 1, g.c, 0, 0, 0);
    CHECK_OK(bie_layer_param(p.cpu, BIE_PARAM_BIAS_A, &cb));
    memcpy(cb.data, bias, (size_t)g.c * 4);
    CHECK_OK(bie_layer_param(p.gpu, BIE_PARAM_BIAS_A, &gb));
    CHECK(gb.device.type == BIE_DEVICE_CUDA);
    CHECK_OK(bie_tensor_copy(&gb, &hb));
    free(bias);
    bie_tensor cw, gw;
    const int64_t nw = g.o * g.c * g.k * g.k;
    CHECK_OK(bie_layer_param(p.cpu, BIE_PARAM_WEIGHT, &cw));
    CHECK_OK(bie_layer_param(p.gpu, BIE_PARAM_WEIGHT, &gw));
    CHECK(cw.dtype == BIE_I8 && gw.dtype == BIE_I8 && gw.ndim == 4);
    float *a = tu_alloc((size_t)nw * 4), *b = tu_alloc((size_t)nw * 4);
    download_as(&gw, a);
    for (int64_t i = 0; i < nw; i++) b[i] = (float)((int8_t *)cw.data)[i];
    CHECK(compare_exact("int8 weight", a, b, nw));
    free(a);
    free(b);
    return p;
}

static void free_pair(pair *p) {
    bie_layer_free(p->cpu);
    bie_layer_free(p->gpu);
}

static void forward_matches(pair *p, const bie_tensor *gx, const bie_tensor *cx, const char *what) {
    const geo *g = &p->g;
    const int64_t shape[4] = {g->n, g->o, p->oh, p->ow};
    if (!forward_matches_layout(p->dt, 4, shape, p->gpu, p->cpu, gx, cx, what, p->nhwc))
        fprintf(stderr,
                "  (dtype %s n=%lld c=%lld %lldx%lld o=%lld k=%d s=%d p=%d d=%d kernel %d%s)\n",
                bie_dtype_name(p->dt), (long long)g->n, (long long)g->c, (long long)g->h,
                (long long)g->w, (long long)g->o, g->k, g->s, g->p, g->d, tu_layer_kernel(p->gpu),
                p->nhwc ? ", NHWC" : "");
}

/* The GPU backward against the CPU's. fp8: the GPU layer runs grad_x on e4m3, so the CPU's
 * grad_x, grad_bias_a and grad_scale_a get grad_out as it sees it (rounded to e4m3 at the
 * per-tensor scale 448 / amax), and its grad_w the exact grad_out. */
static void backward_matches(pair *p, int fp8) {
    const geo *g = &p->g;
    const int64_t ng = g->n * g->o * p->oh * p->ow, nx = g->n * g->c * g->h * g->w;
    const int64_t nw = g->o * g->c * g->k * g->k;
    float *go = tu_alloc((size_t)ng * 4), *gr = tu_alloc((size_t)ng * 4);
    fill_input(go, ng);
    /* grad_out as the GPU holds it: the fp8 scale and rounding start from these values */
    for (int64_t i = 0; i < ng; i++) go[i] = round_to(p->dt, go[i]);
    float amax = 0.0f;
    for (int64_t i = 0; i < ng; i++) amax = fmaxf(amax, fabsf(go[i]));
    const float s = amax > 0 ? 448.0f / amax : 1.0f, inv = amax > 0 ? amax / 448.0f : 1.0f;
    for (int64_t i = 0; i < ng; i++) gr[i] = fp8 ? round_e4m3(go[i] * s) * inv : go[i];
    bie_tensor gg = upload4(p->dt, go, g->n, g->o, p->oh, p->ow, p->nhwc);
    bie_tensor cg = tu_view(gr, BIE_F32, 4, g->n, g->o, p->oh, p->ow);
    bie_tensor cg_exact = tu_view(go, BIE_F32, 4, g->n, g->o, p->oh, p->ow);
    bie_tensor ggx = device_empty(p->dt, g->n * g->c * g->h, g->w);
    reshape4(&ggx, g->n, g->c, g->h, g->w);
    poison_device(&ggx);
    float *cgx = tu_alloc((size_t)nx * 4), *got = tu_alloc((size_t)(nx > nw ? nx : nw) * 4);
    bie_tensor cgxv = tu_view(cgx, BIE_F32, 4, g->n, g->c, g->h, g->w);
    bie_status st = bie_layer_backward(p->gpu, &gg, &ggx);
    CHECK(st == BIE_OK);
    if (st != BIE_OK) fprintf(stderr, "  backward: %s\n", bie_last_error());
    CHECK_OK(bie_layer_backward(p->cpu, &cg, &cgxv));
    /* fp8: the FP8 tensor cores' sums are not f32-exact (bie.h), and here they run over the
     * whole reduction in the tensor cores' accumulator: up to 1.02e-3 of max|grad_x| measured
     * (float16 output), so 4e-3 on top of the e4m3 rounding done above. */
    const double dtol = p->dt == BIE_F32 ? 1e-5 : p->dt == BIE_BF16 ? 8e-3 : 1e-3;
    const double tol = fp8 ? fmax(4e-3, dtol) : dtol;
    download4(&ggx, got, p->nhwc);
    CHECK(compare_close("grad_x", got, cgx, nx, tol));
    bie_tensor a, b;
    CHECK_OK(bie_layer_grad(p->gpu, BIE_PARAM_BIAS_A, &a));
    CHECK_OK(bie_layer_grad(p->cpu, BIE_PARAM_BIAS_A, &b));
    download_as(&a, got);
    CHECK(compare_close("grad_bias_a", got, b.data, g->c, tol));
    CHECK_OK(bie_layer_grad(p->gpu, BIE_PARAM_SCALE_A, &a));
    CHECK_OK(bie_layer_grad(p->cpu, BIE_PARAM_SCALE_A, &b));
    download_as(&a, got);
    const float ref = *(float *)b.data;
    CHECK(fabs(got[0] - ref) <= tol * 10 * fabs(ref) + 1e-5);
    if (fp8) CHECK_OK(bie_layer_backward(p->cpu, &cg_exact, &cgxv)); /* grad_w: exact */
    CHECK_OK(bie_layer_grad(p->gpu, BIE_PARAM_WEIGHT_FLOAT_GRAD, &a));
    CHECK_OK(bie_layer_grad(p->cpu, BIE_PARAM_WEIGHT_FLOAT_GRAD, &b));
    download_as(&a, got);
    CHECK(compare_close("grad_w", got, b.data, nw, 1e-5));
    CHECK_OK(bie_layer_grad(p->gpu, BIE_PARAM_WEIGHT, &a));
    CHECK_OK(bie_layer_grad(p->cpu, BIE_PARAM_WEIGHT, &b));
    CHECK(a.dtype == BIE_I8 && b.dtype == BIE_I8);
    download_as(&a, got);
    int64_t off = 0;
    for (int64_t i = 0; i < nw; i++) off += fabsf(got[i] - (float)((int8_t *)b.data)[i]) > 1.0f;
    CHECK(off == 0);
    bie_tensor_free(&gg);
    bie_tensor_free(&ggx);
    free(go);
    free(gr);
    free(cgx);
    free(got);
}

/* forward_again after a training forward: the same bytes as that forward's output, from the
 * kept state (scale_a changed in between, then put back). */
static void again_matches(pair *p, const bie_tensor *gx, const char *what) {
    const geo *g = &p->g;
    const int64_t no = g->n * g->o * p->oh * p->ow;
    bie_tensor a = device_empty(p->dt, g->n * g->o * p->oh, p->ow);
    bie_tensor b = device_empty(p->dt, g->n * g->o * p->oh, p->ow);
    reshape4(&a, g->n, g->o, p->oh, p->ow);
    reshape4(&b, g->n, g->o, p->oh, p->ow);
    poison_device(&a);
    poison_device(&b);
    CHECK_OK(bie_layer_forward(p->gpu, gx, &a));
    float scale_a = 0;
    CHECK_OK(bie_layer_get_scale_a(p->gpu, &scale_a));
    CHECK_OK(bie_layer_set_scale_a(p->gpu, scale_a * 3.0f));
    const bie_status st = bie_layer_forward_again(p->gpu, &b);
    CHECK(st == BIE_OK);
    CHECK_OK(bie_layer_set_scale_a(p->gpu, scale_a));
    float *fa = tu_alloc((size_t)no * 4), *fb = tu_alloc((size_t)no * 4);
    download_as(&a, fa);
    download_as(&b, fb);
    const int same = st == BIE_OK && tu_same_bits(fa, fb, no);
    CHECK(same);
    if (!same)
        fprintf(stderr, "  forward_again differs (%s; %s n=%lld c=%lld o=%lld k=%d s=%d%s): %s\n",
                what, bie_dtype_name(p->dt), (long long)g->n, (long long)g->c, (long long)g->o,
                g->k, g->s, p->nhwc ? ", NHWC" : "", st == BIE_OK ? "values" : bie_last_error());
    bie_tensor_free(&a);
    bie_tensor_free(&b);
    free(fa);
    free(fb);
}

/* nhwc: the GPU layer runs on channels-last activations (the CPU's stay NCHW). */
static void check_shape(bie_dtype dt, geo g, int all_kernels, int nhwc) {
    pair p = make_pair(dt, g, 77 + (uint64_t)(g.n * 131 + g.c * 17 + g.o * 3 + g.k));
    p.nhwc = nhwc;
    CHECK_OK(bie_layer_set_channels_last(p.gpu, nhwc != 0));
    const int64_t nx = g.n * g.c * g.h * g.w;
    float *x = tu_alloc((size_t)nx * 4);
    fill_input(x, nx);
    bie_tensor gx = upload4(dt, x, g.n, g.c, g.h, g.w, nhwc);
    bie_tensor cx = tu_view(x, BIE_F32, 4, g.n, g.c, g.h, g.w);

    CHECK_OK(bie_layer_set_activation(p.gpu, &gx, NULL));
    bie_tensor sa;
    float measured = 0;
    CHECK_OK(bie_layer_param(p.gpu, BIE_PARAM_SCALE_A, &sa));
    download_as(&sa, &measured);
    double s = 0;
    for (int64_t i = 0; i < nx; i++) s += fabs(x[i]);
    const float expect = (float)(2.0 * s / (double)nx);
    CHECK(fabsf(measured - expect) <= 1e-6f * expect);
    CHECK_OK(bie_layer_set_scale_a(p.cpu, measured));

    forward_matches(&p, &gx, &cx, "training forward");
    again_matches(&p, &gx, "default kernel");
    backward_matches(&p, 0);
#ifdef BIE_TEST_CUDA_INTERNALS
    /* The opt-in FP8 backward: grad_x on e4m3 where the TMA grad_x kernel takes the layer
     * (elsewhere the mode runs the exact backward checked above; devices without FP8 tensor
     * cores refuse the mode). */
    const bie_conv_geom cgeo = {g.n, g.c, g.h, g.w, g.o, p.oh, p.ow, g.k, g.s, g.p, g.d, nhwc};
    if (bie_cuda_conv_fp8_grad_x(dt, &cgeo) &&
        bie_layer_set_backward_mode(p.gpu, BIE_BACKWARD_FP8) == BIE_OK) {
        backward_matches(&p, 1);
        CHECK_OK(bie_layer_set_backward_mode(p.gpu, BIE_BACKWARD_EXACT));
    }
    if (dt != BIE_F32) { /* the 16-bit backward's other path: cuBLAS over im2col buffers */
        bie_cuda_conv_backward_force_gemm(true);
        forward_matches(&p, &gx, &cx, "training forward (GEMM backward)");
        backward_matches(&p, 0);
        bie_cuda_conv_backward_force_gemm(false);
    }
#endif
    if (all_kernels) {
        for (int i = 0; i < bie_kernel_count(); i++) {
            bie_kernel_info info;
            CHECK_OK(bie_kernel_get(i, &info));
            if (info.device != BIE_DEVICE_CUDA ||
                bie_layer_set_gemm_kernel(p.gpu, info.id) != BIE_OK)
                continue;
            forward_matches(&p, &gx, &cx, info.name);
            again_matches(&p, &gx, info.name);
        }
        CHECK_OK(bie_layer_select_gemm_kernel(p.gpu, &gx));
        forward_matches(&p, &gx, &cx, "selected kernel");
        CHECK_OK(bie_layer_set_gemm_kernel(p.gpu, -1));
    }

    /* Inference from the packed weight only (identical to the CPU's). */
    CHECK_OK(bie_layer_set_training(p.cpu, false));
    CHECK_OK(bie_layer_set_training(p.gpu, false));
    CHECK_OK(bie_layer_generate_quantized_weight(p.cpu, true));
    CHECK_OK(bie_layer_generate_quantized_weight(p.gpu, true));
    bie_tensor q, cq;
    CHECK_OK(bie_layer_param(p.gpu, BIE_PARAM_QWEIGHT, &q));
    CHECK_OK(bie_layer_param(p.cpu, BIE_PARAM_QWEIGHT, &cq));
    CHECK(device_bytes_match(&q, cq.data));
    forward_matches(&p, &gx, &cx, "inference forward");
#ifdef BIE_TEST_CUDA_INTERNALS
    /* The fused kernel (ceil(C / 32) % 4 == 0) under other plans: every channel width, bands
     * of 32 and 96 pixels (starting mid-row, running on into the next image), of two output
     * rows and of 2048 pixels (several images). The plans that fit run; some must. */
    if ((g.c + 31) / 32 % 4 == 0 && !nhwc) { /* (NCHW input only) */
        const int bns[] = {64, 128, 256}, bps[] = {32, 96, 2 * (int)p.ow, 2048};
        int ran = 0;
        for (int i = 0; i < 3; i++)
            for (int j = 0; j < 4; j++) {
                bie_cuda_conv_fused_force_plan(bns[i], bps[j]);
                char what[64];
                snprintf(what, sizeof what, "fused plan %d x %d", bns[i], bps[j]);
                forward_matches(&p, &gx, &cx, what);
                int bn, bp;
                bie_cuda_conv_fused_last_plan(&bn, &bp);
                CHECK(bn == 0 || (bn == bns[i] && bp == bps[j]));
                ran += bn != 0;
            }
        bie_cuda_conv_fused_force_plan(0, 0);
        CHECK(ran >= 4);
    }
#endif
    /* A new weight while in inference: the packed rows, the corrections and the fused
     * kernel's weight image follow it. */
    CHECK_OK(bie_layer_reset_parameters(p.cpu, 991 + (uint64_t)g.o));
    CHECK_OK(bie_layer_reset_parameters(p.gpu, 991 + (uint64_t)g.o));
    CHECK_OK(bie_layer_prepare_params(p.cpu));
    CHECK_OK(bie_layer_prepare_params(p.gpu));
    CHECK_OK(bie_layer_generate_quantized_weight(p.cpu, true));
    CHECK_OK(bie_layer_generate_quantized_weight(p.gpu, true));
    forward_matches(&p, &gx, &cx, "inference forward, new weight");

    bie_tensor_free(&gx);
    free(x);
    free_pair(&p);
}

/* Inference forward on special values, bit for bit against the CPU: biases of +-0, +-inf,
 * NaN and tiny (subnormal) values, inputs of +-0, +-inf, NaN, subnormals and exactly -bias
 * (v = x + bias = 0), in every dtype; C = 128 and 100 take the fused kernel. */
static void special_values(bie_dtype dt, int64_t c) {
    const geo g = {2, c, 5, 6, 40, 3, 1, 1, 1};
    pair p = make_pair(dt, g, 11);
    const float inf = INFINITY, nan = NAN;
    const float biases[] = {0.0f,   -0.0f,  inf,     -inf,  nan,   0.5f,
                            -0.25f, 1e-40f, -1e-40f, 3e38f, -3e38f};
    const float xs[] = {0.0f, -0.0f,   inf,    -inf, nan,   -0.5f, 0.25f,
                        0.5f, -1e-40f, 1e-40f, 1.0f, -2.0f, 6e-8f};
    const int nb = (int)(sizeof biases / sizeof biases[0]), nxv = (int)(sizeof xs / sizeof xs[0]);
    float *bias = tu_alloc((size_t)c * 4);
    for (int64_t i = 0; i < c; i++)
        bias[i] = i % 3 == 0 ? biases[(i / 3) % nb] : (float)((i % 7) - 3) * 0.125f;
    bie_tensor cb, gb, hb = tu_view(bias, BIE_F32, 1, c, 0, 0, 0);
    CHECK_OK(bie_layer_param(p.cpu, BIE_PARAM_BIAS_A, &cb));
    memcpy(cb.data, bias, (size_t)c * 4);
    CHECK_OK(bie_layer_param(p.gpu, BIE_PARAM_BIAS_A, &gb));
    CHECK_OK(bie_tensor_copy(&gb, &hb));
    const int64_t nx = g.n * c * g.h * g.w, hw = g.h * g.w;
    float *x = tu_alloc((size_t)nx * 4);
    fill_input(x, nx);
    for (int64_t i = 0; i < nx; i++) {
        const int64_t ch = i / hw % c;
        if (i % 5 == 0)
            x[i] = xs[(i / 5) % nxv];
        else if (i % 5 == 1 && isfinite(bias[ch]))
            x[i] = -bias[ch]; /* v = 0 where -bias is exact */
        x[i] = round_to(dt, x[i]);
    }
    bie_tensor gx = upload_as(dt, x, g.n * c * g.h, g.w);
    reshape4(&gx, g.n, c, g.h, g.w);
    bie_tensor cx = tu_view(x, BIE_F32, 4, g.n, c, g.h, g.w);
    CHECK_OK(bie_layer_set_scale_a(p.cpu, 1.5f));
    CHECK_OK(bie_layer_set_scale_a(p.gpu, 1.5f));
    CHECK_OK(bie_layer_set_training(p.cpu, false));
    CHECK_OK(bie_layer_set_training(p.gpu, false));
    CHECK_OK(bie_layer_generate_quantized_weight(p.cpu, true));
    CHECK_OK(bie_layer_generate_quantized_weight(p.gpu, true));
    forward_matches(&p, &gx, &cx, "special values");
    bie_tensor_free(&gx);
    free(x);
    free(bias);
    free_pair(&p);
}

/* The training pack's clip mask at its bound: float32 inputs whose quotient by scale_a is 1 or -1
 * give or take a few ulps (bias_a zero), among ordinary ones, through the NCHW pack and both
 * NHWC packs (40 channels; 64: eight channels a lane). A mask bit off by the rounding of the
 * quotient shows in grad_x against the CPU. */
static void clip_boundary(int64_t c, int nhwc) {
    const geo g = {2, c, 5, 6, 8, 3, 1, 1, 1};
    pair p = make_pair(BIE_F32, g, 31);
    p.nhwc = nhwc;
    CHECK_OK(bie_layer_set_channels_last(p.gpu, nhwc != 0));
    float *zero = tu_alloc((size_t)c * 4);
    memset(zero, 0, (size_t)c * 4);
    bie_tensor cb, gb, hb = tu_view(zero, BIE_F32, 1, c, 0, 0, 0);
    CHECK_OK(bie_layer_param(p.cpu, BIE_PARAM_BIAS_A, &cb));
    memcpy(cb.data, zero, (size_t)c * 4);
    CHECK_OK(bie_layer_param(p.gpu, BIE_PARAM_BIAS_A, &gb));
    CHECK_OK(bie_tensor_copy(&gb, &hb));
    const int64_t nx = g.n * c * g.h * g.w;
    float *x = tu_alloc((size_t)nx * 4);
    const float scales[] = {0.75f, 1.1f, 3.0f, 0.01f};
    for (int si = 0; si < 4; si++) {
        const float sa = scales[si];
        CHECK_OK(bie_layer_set_scale_a(p.cpu, sa));
        CHECK_OK(bie_layer_set_scale_a(p.gpu, sa));
        fill_input(x, nx);
        for (int64_t i = 0; i < nx; i++) {
            if (i % 7 == 6) continue; /* an ordinary value */
            float v = sa;
            for (int k = (int)(i % 13) - 6; k != 0; k += k > 0 ? -1 : 1)
                v = nextafterf(v, k > 0 ? INFINITY : 0.0f);
            x[i] = (i / 13) % 2 ? -v : v;
        }
        bie_tensor gx = upload4(BIE_F32, x, g.n, c, g.h, g.w, nhwc);
        bie_tensor cx = tu_view(x, BIE_F32, 4, g.n, c, g.h, g.w);
        forward_matches(&p, &gx, &cx, "clip bound");
        backward_matches(&p, 0);
        bie_tensor_free(&gx);
    }
    free(x);
    free(zero);
    free_pair(&p);
}

static void bad_input(void) {
    const geo g = {2, 5, 6, 6, 4, 3, 1, 1, 1};
    pair p = make_pair(BIE_BF16, g, 5);
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
    bie_tensor wrong = device_empty(BIE_BF16, 2 * 4 * 6, 5);
    reshape4(&wrong, 2, 4, 6, 5);
    CHECK(bie_layer_forward(p.gpu, &gx, &wrong) == BIE_ERR_SHAPE);
    bie_tensor three = device_empty(BIE_BF16, 2 * 4, 6);
    reshape4(&three, 2, 4, 6, 1);
    CHECK(bie_layer_forward(p.gpu, &three, &out) == BIE_ERR_SHAPE); /* 4 channels, not 5 */
    bie_tensor gout = device_empty(BIE_BF16, 2 * 4 * 6, 6);
    reshape4(&gout, 2, 4, 6, 6);
    CHECK(bie_layer_backward(p.gpu, &gout, NULL) == BIE_ERR_STATE); /* no forward yet */
    CHECK(bie_layer_forward_again(p.gpu, &out) == BIE_ERR_STATE);
    CHECK_OK(bie_layer_forward(p.gpu, &gx, &gout)); /* a training forward kept */
    bie_tensor host_out = tu_view(x, BIE_F32, 4, 2, 4, 6, 6);
    CHECK(bie_layer_forward_again(p.gpu, &host_out) == BIE_ERR_DEVICE);
    CHECK(bie_layer_forward_again(p.gpu, &wrong) == BIE_ERR_SHAPE);
    bie_tensor out32 = device_empty(BIE_F32, 2 * 4 * 6, 6);
    reshape4(&out32, 2, 4, 6, 6);
    CHECK(bie_layer_forward_again(p.gpu, &out32) == BIE_ERR_DTYPE);
    bie_tensor_free(&out32);
    CHECK(bie_layer_set_gemm_kernel(p.gpu, 1) != BIE_OK); /* a CPU kernel */
    CHECK(bie_layer_set_gemm_kernel(p.gpu, 12345) == BIE_ERR_INVALID_ARGUMENT);
    CHECK(bie_layer_set_bits_binary_word(p.gpu, 7) == BIE_ERR_INVALID_ARGUMENT);
    bie_device cuda = {BIE_DEVICE_CUDA, 0}, nodev = {BIE_DEVICE_CUDA, 999};
    bie_layer *l = NULL;
    CHECK(bie_binary_conv2d_create(&l, 4, 4, 3, 1, 1, 1, cuda, BIE_I8, true) == BIE_ERR_DTYPE &&
          l == NULL);
    CHECK(bie_binary_conv2d_create(&l, 4, 4, 3, 1, 1, 1, nodev, BIE_F32, true) == BIE_ERR_DEVICE &&
          l == NULL);
    CHECK(still_poisoned(&out)); /* failed calls wrote nothing */
    bie_tensor_free(&gx);
    bie_tensor_free(&gx32);
    bie_tensor_free(&out);
    bie_tensor_free(&wrong);
    bie_tensor_free(&three);
    bie_tensor_free(&gout);
    free_pair(&p);
}

int main(int argc, char **argv) {
    const int small = argc > 1 && strcmp(argv[1], "--small") == 0;
    if (gpu_missing()) return TU_SKIP;
    tu_seed(93);
    static const geo shapes[] = {
        /* n, c, h, w, o, k, s, p, d */
        {1, 1, 1, 1, 1, 1, 1, 0, 1},
        {2, 3, 5, 7, 4, 3, 1, 1, 1},
        {1, 33, 9, 8, 17, 3, 2, 1, 1},
        {1, 5, 3, 3, 7, 3, 1, 3, 1},
        {2, 16, 11, 13, 8, 5, 2, 2, 2},
        {1, 70, 6, 6, 65, 1, 1, 0, 1},
        {2, 31, 17, 9, 5, 4, 3, 0, 1},
        {3, 64, 14, 14, 32, 3, 1, 1, 1},
        {2, 128, 8, 8, 96, 3, 1, 2, 1},
        {4, 256, 14, 14, 256, 3, 1, 1, 1},
        /* more pixel tiles than blocks (each block walks several; even and odd planes) */
        {6, 40, 28, 28, 130, 3, 1, 1, 1},
        {7, 33, 27, 27, 200, 3, 1, 1, 1},
        /* the fused inference kernel (ceil(C / 32) % 4 == 0): partial sign words, strides,
         * dilation, even and 1x1 kernels, rows with no valid tap, odd widths (1-pixel loads),
         * several channel groups and bands per image */
        {3, 100, 13, 11, 70, 3, 2, 1, 1},
        {1, 128, 30, 30, 33, 3, 1, 1, 2},
        {2, 256, 9, 7, 50, 2, 1, 0, 1},
        {1, 512, 5, 6, 40, 1, 1, 0, 1},
        {2, 128, 23, 20, 64, 5, 3, 2, 1},
        {1, 120, 6, 6, 300, 3, 1, 3, 1},
        /* batches large enough for the fused kernel's planner to take 256-channel 16-warp
         * blocks, 128-channel blocks with 4-pixel loads, bands over several 6x6 images (and
         * every plan under forced plans, below) */
        {8, 256, 12, 12, 512, 3, 1, 1, 1},
        {16, 128, 12, 12, 512, 3, 1, 1, 1},
        {32, 128, 6, 6, 512, 3, 1, 1, 1},
        /* the 16-bit backward's halo kernel (stride 1, output the input's size), 128-pixel
         * tiles: dilation 2, one 130-pixel row per tile (a 256-pixel one: the grid is small),
         * rows of 9 or 33 pixels, tiles across images */
        {2, 20, 9, 11, 24, 3, 1, 2, 2},
        {1, 24, 3, 130, 40, 3, 1, 1, 1},
        {5, 70, 9, 33, 66, 3, 1, 1, 1},
        /* enough rows for its 256-pixel tiles (264 and 300 of them; 30-pixel rows leave 16
         * pixels of each tile empty) */
        {66, 8, 32, 32, 8, 3, 1, 1, 1},
        {60, 12, 40, 30, 16, 3, 1, 1, 1},
        /* the 16-bit backward's stride phases (grad_x per (y mod s, x mod s) over the taps
         * that reach it): stride 2 with dilation 2, an even kernel, a 1x1 kernel (phases no
         * tap reaches: zero gradient), stride 3 (9 phases), more tiles than one per phase */
        {2, 40, 15, 10, 24, 3, 2, 1, 2},
        {1, 20, 10, 9, 16, 2, 2, 0, 1},
        {2, 16, 7, 7, 8, 1, 2, 0, 1},
        {2, 24, 11, 12, 40, 3, 3, 1, 1},
        {9, 64, 16, 16, 72, 3, 2, 1, 1},
        /* the halo kernel on wgmma with 128 channels a block (channels padded to a multiple
         * of 128): 100 and 200 channels leave part of the last block's words past C */
        {3, 100, 10, 9, 70, 3, 1, 1, 1},
        {2, 200, 8, 8, 72, 3, 1, 1, 1},
        {2, 100, 6, 5, 40, 3, 1, 1, 1},
        /* channels last, stride 1: grad_x in the halo form (one gradient box per 64 output
         * channels, each tap a view into it) with dilation 2 and a last band of 9 of 10 rows,
         * a 5 x 5 kernel, no padding (the output smaller than the input) */
        {3, 130, 19, 20, 100, 3, 1, 2, 2},
        {2, 64, 16, 28, 70, 5, 1, 2, 1},
        {2, 40, 20, 30, 64, 3, 1, 0, 1},
        /* grad_w on wgmma with 128 output channels a block: 130 leave the second 64 part empty */
        {2, 40, 6, 7, 130, 3, 1, 1, 1},
    };
    const int count_all = (int)(sizeof shapes / sizeof shapes[0]), count = small ? 4 : count_all;
    for (int d = 0; d < 3; d++)
        for (int i = 0; i < count; i++) check_shape(kDtypes[d], shapes[i], d == 0 && i % 3 == 1, 0);
    /* Channels last: every shape in bfloat16 (every third with every kernel), every third in
     * float32 (the cuBLAS backward) and float16. */
    for (int i = 0; i < count; i++) {
        check_shape(BIE_BF16, shapes[i], i % 3 == 2, 1);
        if (i % 3 == 0) {
            check_shape(BIE_F32, shapes[i], 0, 1);
            check_shape(BIE_F16, shapes[i], 0, 1);
        }
    }
    if (small) {
        check_shape(BIE_BF16, shapes[8], 0, 0); /* one shape of the fused kernel, every plan */
        check_shape(BIE_F16, shapes[count_all - 2], 0, 0);  /* 128 channels a grad_x block */
        check_shape(BIE_BF16, shapes[count_all - 1], 0, 0); /* 128 output channels a grad_w block */
        check_shape(BIE_BF16, shapes[count_all - 2], 0, 1); /* the same, channels last */
        const geo in_place = {2, 64, 6, 6, 64, 3, 1, 1, 1}; /* 64 channels: grad_out in place */
        check_shape(BIE_F16, in_place, 0, 1);
    }
    for (int d = 0; d < 3; d++) {
        special_values(kDtypes[d], 128);
        special_values(kDtypes[d], 100);
    }
    for (int nhwc = 0; nhwc < 2; nhwc++) {
        clip_boundary(40, nhwc);
        clip_boundary(64, nhwc);
    }
    bad_input();
    return tu_finish();
}
