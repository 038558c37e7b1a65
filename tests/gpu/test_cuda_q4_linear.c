/* The 4-bit linear layer on CUDA against the CPU layer: forward bit for bit (float32,
 * bfloat16 and float16 outputs equal the CPU's float32 result rounded once to that dtype), in
 * training and inference modes (packed weights only, and weights installed with
 * set_quantized_weight_data), with every CUDA 4-bit kernel; backward within float tolerance;
 * the life cycle's parameters (scale_w, qweight) equal; bad input rejected with outputs
 * untouched. Random shapes include m = 1, odd k and n. Reports itself skipped (77) without a
 * GPU. Usage: test_cuda_q4_linear [--small] */
#include <math.h>

#include "gpu_util.h"

typedef struct pair {
    bie_layer *cpu, *gpu;
    bie_dtype dt;
    int64_t k, n;
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

/* Weights with values exact in every dtype (r / 256) and outliers that clamp at -8 / 7. */
static void fill_weight(float *w, int64_t n) {
    for (int64_t i = 0; i < n; i++) w[i] = (float)((int)(tu_next() % 257) - 128) / 256.0f;
    for (int64_t i = 0; i < n; i += 7) w[i] *= 16.0f;
}

static pair make_pair(bie_dtype dt, int64_t k, int64_t n, int random_weight) {
    pair p = {NULL, NULL, dt, k, n};
    bie_device cuda = {BIE_DEVICE_CUDA, 0};
    CHECK_OK(bie_q4_linear_create(&p.cpu, k, n, bie_cpu(), BIE_F32));
    CHECK_OK(bie_q4_linear_create(&p.gpu, k, n, cuda, dt));
    if (random_weight) { /* set_weight_data (in the layer's dtype) */
        float *w = tu_alloc((size_t)(n * k) * 4);
        fill_weight(w, n * k);
        bie_tensor cw = tu_view(w, BIE_F32, 2, n, k, 0, 0), gw = upload_as(dt, w, n, k);
        CHECK_OK(bie_layer_set_weight_data(p.cpu, &cw));
        CHECK_OK(bie_layer_set_weight_data(p.gpu, &gw));
        bie_tensor_free(&gw);
        free(w);
    } else { /* reset_parameters with the same seed, then prepare_params */
        CHECK_OK(bie_layer_reset_parameters(p.cpu, 77 + (uint64_t)k));
        CHECK_OK(bie_layer_reset_parameters(p.gpu, 77 + (uint64_t)k));
        CHECK_OK(bie_layer_prepare_params(p.cpu));
        CHECK_OK(bie_layer_prepare_params(p.gpu));
    }
    /* The same float weight and scale_w on both. */
    bie_tensor cw, gw;
    CHECK_OK(bie_layer_param(p.cpu, BIE_PARAM_WEIGHT, &cw));
    CHECK_OK(bie_layer_param(p.gpu, BIE_PARAM_WEIGHT, &gw));
    CHECK(gw.dtype == BIE_F32 && gw.device.type == BIE_DEVICE_CUDA);
    float *w_host = tu_alloc((size_t)(k * n) * 4);
    download_as(&gw, w_host);
    CHECK(compare_exact("float weight", w_host, cw.data, k * n));
    free(w_host);
    const float sw_cpu = param_scalar(p.cpu, BIE_PARAM_SCALE_W),
                sw_gpu = param_scalar(p.gpu, BIE_PARAM_SCALE_W);
    CHECK(memcmp(&sw_cpu, &sw_gpu, 4) == 0);
    /* The same random bias_a on both. */
    float *bias = tu_alloc((size_t)k * 4);
    tu_fill(bias, k, -0.3f, 0.3f);
    bie_tensor cb, gb;
    CHECK_OK(bie_layer_param(p.cpu, BIE_PARAM_BIAS_A, &cb));
    memcpy(cb.data, bias, (size_t)k * 4);
    CHECK_OK(bie_layer_param(p.gpu, BIE_PARAM_BIAS_A, &gb));
    bie_tensor hb = tu_view(bias, BIE_F32, 1, k, 0, 0, 0);
    CHECK(gb.device.type == BIE_DEVICE_CUDA);
    CHECK_OK(bie_tensor_copy(&gb, &hb));
    free(bias);
    return p;
}

static void free_pair(pair *p) {
    bie_layer_free(p->cpu);
    bie_layer_free(p->gpu);
}

/* GPU forward (output poisoned first) vs the CPU's float32 forward rounded to the dtype. */
static void forward_matches(pair *p, const bie_tensor *gx, const bie_tensor *cx, int64_t m,
                            const char *what) {
    const int64_t shape[2] = {m, p->n};
    if (!forward_matches_as(p->dt, 2, shape, p->gpu, p->cpu, gx, cx, what))
        fprintf(stderr, "  (dtype %s m=%lld k=%lld n=%lld)\n", bie_dtype_name(p->dt), (long long)m,
                (long long)p->k, (long long)p->n);
}

static void backward_matches(pair *p, int64_t m, int with_grad_x) {
    const int64_t k = p->k, n = p->n;
    float *g = tu_alloc((size_t)(m * n) * 4);
    fill_input(g, m * n); /* exact in every dtype */
    bie_tensor gg = upload_as(p->dt, g, m, n), cg = tu_view(g, BIE_F32, 2, m, n, 0, 0);
    bie_tensor ggx = device_empty(p->dt, m, k);
    poison_device(&ggx);
    float *cgx = tu_alloc((size_t)(m * k) * 4),
          *got = tu_alloc((size_t)(m * k > n * k ? m * k : n * k) * 4);
    bie_tensor cgxv = tu_view(cgx, BIE_F32, 2, m, k, 0, 0);
    bie_status st = bie_layer_backward(p->gpu, &gg, with_grad_x ? &ggx : NULL);
    CHECK(st == BIE_OK);
    if (st != BIE_OK) fprintf(stderr, "  backward: %s\n", bie_last_error());
    CHECK_OK(bie_layer_backward(p->cpu, &cg, &cgxv));
    const double tol = p->dt == BIE_F32 ? 1e-5 : p->dt == BIE_BF16 ? 8e-3 : 1e-3;
    if (with_grad_x) {
        download_as(&ggx, got);
        CHECK(compare_close("grad_x", got, cgx, m * k, tol));
    }
    bie_tensor a, b;
    CHECK_OK(bie_layer_grad(p->gpu, BIE_PARAM_WEIGHT, &a));
    CHECK_OK(bie_layer_grad(p->cpu, BIE_PARAM_WEIGHT, &b));
    CHECK(a.dtype == BIE_F32 && a.device.type == BIE_DEVICE_CUDA);
    download_as(&a, got);
    CHECK(compare_close("grad_w", got, b.data, n * k, 1e-5));
    CHECK_OK(bie_layer_grad(p->gpu, BIE_PARAM_WEIGHT_FLOAT_GRAD, &a));
    download_as(&a, got);
    CHECK(compare_close("grad_w (float)", got, b.data, n * k, 1e-5));
    CHECK_OK(bie_layer_grad(p->gpu, BIE_PARAM_BIAS_A, &a));
    CHECK_OK(bie_layer_grad(p->cpu, BIE_PARAM_BIAS_A, &b));
    download_as(&a, got);
    /* Where 16-bit grad_x comes from the GEMM's epilogue (k a multiple of 256, n of 16), the
     * sums are of grad_x as stored (SPEC: grad_bias_a = the sum of grad_x), so they carry its
     * rounding. */
    CHECK(compare_close("grad_bias_a", got, b.data, k, p->dt == BIE_F32 ? 1e-5 : tol));
    CHECK_OK(bie_layer_grad(p->gpu, BIE_PARAM_SCALE_A, &a));
    CHECK_OK(bie_layer_grad(p->cpu, BIE_PARAM_SCALE_A, &b));
    download_as(&a, got);
    const float ref = *(float *)b.data;
    /* The mean |grad_x| bounds the size of a rounding difference in the sum; with the sums of
     * 16-bit grad_x as stored, the terms' magnitude (|resid| / 254 <= 1/2) times its rounding. */
    double gmean = 0, mag = 0;
    for (int64_t i = 0; i < m * k; i++) gmean += fabs(cgx[i]);
    mag = gmean * 0.5 / sqrt(7.0 * (double)m * (double)k);
    gmean /= (double)(m * k);
    const double slack = p->dt == BIE_F32 ? 0 : tol * mag;
    const int ok = fabs(got[0] - ref) <= 1e-4 * fabs(ref) + 1e-5 * gmean + slack;
    if (!ok)
        fprintf(stderr, "  grad_scale_a: %.9g vs %.9g (%s m=%lld k=%lld n=%lld)\n", (double)got[0],
                (double)ref, bie_dtype_name(p->dt), (long long)m, (long long)k, (long long)n);
    CHECK(ok);
    bie_tensor_free(&gg);
    bie_tensor_free(&ggx);
    free(g);
    free(cgx);
    free(got);
}

/* Inference with the weight's codes only: generated from the float weight, then installed
 * from the CPU layer's qweight into a fresh GPU layer. */
static void inference_matches(pair *p, const bie_tensor *gx, const bie_tensor *cx, int64_t m) {
    CHECK_OK(bie_layer_set_training(p->cpu, false));
    CHECK_OK(bie_layer_set_training(p->gpu, false));
    forward_matches(p, gx, cx, m, "inference forward (float weight)");
    CHECK_OK(bie_layer_generate_quantized_weight(p->cpu, true));
    CHECK_OK(bie_layer_generate_quantized_weight(p->gpu, true));
    bie_tensor q, cq, v;
    CHECK_OK(bie_layer_param(p->gpu, BIE_PARAM_QWEIGHT, &q));
    CHECK_OK(bie_layer_param(p->cpu, BIE_PARAM_QWEIGHT, &cq));
    CHECK(q.dtype == BIE_U8 && q.ndim == 2 && q.shape[0] == p->n && q.shape[1] == (p->k + 1) / 2);
    uint8_t *qh = download_bytes(&q);
    CHECK(memcmp(qh, cq.data, (size_t)bie_tensor_numel(&q)) == 0);
    CHECK(bie_layer_param(p->gpu, BIE_PARAM_WEIGHT, &v) == BIE_ERR_STATE); /* freed */
    CHECK_OK(bie_layer_opt_weight(p->gpu, &v));
    CHECK(v.data == q.data);
    forward_matches(p, gx, cx, m, "inference forward (qweight only)");
    for (int i = 0; i < bie_kernel_count(); i++) {
        bie_kernel_info info;
        CHECK_OK(bie_kernel_get(i, &info));
        if (info.device != BIE_DEVICE_CUDA || info.op != BIE_OP_Q4_GEMM) continue;
        CHECK_OK(bie_layer_set_gemm_kernel(p->gpu, info.id));
        forward_matches(p, gx, cx, m, info.name);
    }
    CHECK_OK(bie_layer_set_gemm_kernel(p->gpu, -1));

    /* The same codes installed into a new layer (garbage in the odd k's unused nibble). */
    bie_layer *fresh = NULL;
    bie_device cuda = {BIE_DEVICE_CUDA, 0};
    CHECK_OK(bie_q4_linear_create(&fresh, p->k, p->n, cuda, p->dt));
    const int64_t rb = (p->k + 1) / 2;
    if (p->k & 1)
        for (int64_t r = 0; r < p->n; r++) qh[r * rb + rb - 1] |= 0xa0;
    bie_tensor hq = tu_view(qh, BIE_U8, 2, p->n, rb, 0, 0), dq;
    int64_t qshape[2] = {p->n, rb};
    CHECK_OK(bie_cuda_tensor_alloc(&dq, BIE_U8, 2, qshape, 0));
    CHECK_OK(bie_tensor_copy(&dq, &hq));
    CHECK_OK(bie_layer_set_quantized_weight_data(fresh, &dq));
    const float sa = param_scalar(p->gpu, BIE_PARAM_SCALE_A),
                sw = param_scalar(p->gpu, BIE_PARAM_SCALE_W);
    CHECK_OK(bie_layer_set_scale_a(fresh, sa));
    bie_tensor fsw;
    CHECK_OK(bie_layer_param(fresh, BIE_PARAM_SCALE_W, &fsw));
    bie_tensor hsw = tu_view((void *)&sw, BIE_F32, 1, 1, 0, 0, 0);
    CHECK_OK(bie_tensor_copy(&fsw, &hsw));
    bie_tensor fb, pb;
    CHECK_OK(bie_layer_param(fresh, BIE_PARAM_BIAS_A, &fb));
    CHECK_OK(bie_layer_param(p->gpu, BIE_PARAM_BIAS_A, &pb));
    CHECK_OK(bie_tensor_copy(&fb, &pb));
    CHECK_OK(bie_layer_set_training(fresh, false));
    bie_layer *keep = p->gpu;
    p->gpu = fresh;
    forward_matches(p, gx, cx, m, "inference forward (installed qweight)");
    p->gpu = keep;
    bie_layer_free(fresh);
    bie_tensor_free(&dq);
    free(qh);
}

static void check_shape(bie_dtype dt, int64_t m, int64_t k, int64_t n, int all_kernels) {
    tu_seed(1000 + (uint64_t)(m * 31 + k * 7 + n) + (uint64_t)dt);
    pair p = make_pair(dt, k, n, (int)((m + k) & 1));
    float *x = tu_alloc((size_t)(m * k) * 4);
    fill_input(x, m * k);
    bie_tensor gx = upload_as(dt, x, m, k), cx = tu_view(x, BIE_F32, 2, m, k, 0, 0);

    /* scale_a measured on the device (SPEC §4), then the same value on the CPU layer. */
    CHECK_OK(bie_layer_set_activation(p.gpu, &gx, NULL));
    const float measured = param_scalar(p.gpu, BIE_PARAM_SCALE_A);
    double s = 0;
    for (int64_t i = 0; i < m * k; i++) s += fabs(x[i]);
    const float expect = (float)(2.0 / 11.269 * s / (double)(m * k));
    CHECK(fabsf(measured - expect) <= 1e-6f * expect);
    CHECK_OK(bie_layer_set_scale_a(p.cpu, measured));

    forward_matches(&p, &gx, &cx, m, "training forward");
    backward_matches(&p, m, 1);
    if (all_kernels) {
        for (int i = 0; i < bie_kernel_count(); i++) {
            bie_kernel_info info;
            CHECK_OK(bie_kernel_get(i, &info));
            if (info.device != BIE_DEVICE_CUDA || info.op != BIE_OP_Q4_GEMM) continue;
            CHECK_OK(bie_layer_set_gemm_kernel(p.gpu, info.id));
            forward_matches(&p, &gx, &cx, m, info.name);
        }
        CHECK_OK(bie_layer_set_gemm_kernel(p.gpu, -1));
        backward_matches(&p, m, 0); /* without grad_x: the parameter gradients alone */
    }
    inference_matches(&p, &gx, &cx, m);

    bie_tensor_free(&gx);
    free(x);
    free_pair(&p);
}

/* set_activation: x + bias_a in the input's dtype. */
static void activation_matches(bie_dtype dt) {
    const int64_t m = 5, k = 37, n = 3;
    tu_seed(7);
    pair p = make_pair(dt, k, n, 1);
    float *x = tu_alloc((size_t)(m * k) * 4), *ref = tu_alloc((size_t)(m * k) * 4),
          *got = tu_alloc((size_t)(m * k) * 4);
    fill_input(x, m * k);
    bie_tensor gx = upload_as(dt, x, m, k), cx = tu_view(x, BIE_F32, 2, m, k, 0, 0);
    bie_tensor gout = device_empty(dt, m, k), cout = tu_view(ref, BIE_F32, 2, m, k, 0, 0);
    poison_device(&gout);
    CHECK_OK(bie_layer_set_activation(p.gpu, &gx, &gout));
    CHECK_OK(bie_layer_set_activation(p.cpu, &cx, &cout));
    download_as(&gout, got);
    for (int64_t i = 0; i < m * k; i++) ref[i] = round_to(dt, ref[i]);
    CHECK(compare_exact("set_activation", got, ref, m * k));
    bie_tensor_free(&gx);
    bie_tensor_free(&gout);
    free(x);
    free(ref);
    free(got);
    free_pair(&p);
}

/* Bad input: clear errors, outputs and state untouched. */
static void bad_input(void) {
    tu_seed(5);
    pair p = make_pair(BIE_BF16, 40, 24, 1);
    float x[3 * 40];
    fill_input(x, 3 * 40);
    bie_tensor gx = upload_as(BIE_BF16, x, 3, 40), hx = tu_view(x, BIE_F32, 2, 3, 40, 0, 0);
    bie_tensor out = device_empty(BIE_BF16, 3, 24), gx32 = upload_as(BIE_F32, x, 3, 40);
    poison_device(&out);
    CHECK(bie_layer_forward(p.gpu, &hx, &out) == BIE_ERR_DEVICE);  /* host input */
    CHECK(bie_layer_forward(p.gpu, &gx32, &out) == BIE_ERR_DTYPE); /* wrong dtype */
    CHECK(bie_layer_forward(p.gpu, NULL, &out) == BIE_ERR_NULL_POINTER);
    bie_tensor wrong = device_empty(BIE_BF16, 3, 23), wrong_in = device_empty(BIE_BF16, 3, 41);
    CHECK(bie_layer_forward(p.gpu, &gx, &wrong) == BIE_ERR_SHAPE);
    CHECK(bie_layer_forward(p.gpu, &wrong_in, &out) == BIE_ERR_SHAPE);
    bie_tensor g = device_empty(BIE_BF16, 3, 24);
    CHECK(bie_layer_backward(p.gpu, &g, NULL) == BIE_ERR_STATE); /* no forward yet */
    CHECK(bie_layer_set_gemm_kernel(p.gpu, 1) != BIE_OK);        /* a CPU kernel */
    CHECK(bie_layer_set_gemm_kernel(p.gpu, 12345) == BIE_ERR_INVALID_ARGUMENT);
    for (int i = 0; i < bie_kernel_count(); i++) { /* a CUDA binary kernel */
        bie_kernel_info info;
        CHECK_OK(bie_kernel_get(i, &info));
        if (info.device == BIE_DEVICE_CUDA && info.op == BIE_OP_BINARY_GEMM) {
            CHECK(bie_layer_set_gemm_kernel(p.gpu, info.id) == BIE_ERR_INVALID_ARGUMENT);
            break;
        }
    }
    CHECK(bie_layer_set_scale_a(p.gpu, NAN) != BIE_OK);
    CHECK(bie_layer_set_scale_a(p.gpu, -1.0f) != BIE_OK);
    bie_tensor w_wrong = device_empty(BIE_F32, 24, 40); /* the layer is bfloat16 */
    CHECK(bie_layer_set_weight_data(p.gpu, &w_wrong) == BIE_ERR_DTYPE);
    bie_tensor q_wrong = device_empty(BIE_BF16, 24, 20);
    CHECK(bie_layer_set_quantized_weight_data(p.gpu, &q_wrong) == BIE_ERR_DTYPE);
    bie_tensor pv;
    CHECK(bie_layer_param(p.gpu, BIE_PARAM_QWEIGHT, &pv) == BIE_ERR_STATE);
    CHECK(bie_layer_grad(p.gpu, BIE_PARAM_WEIGHT, &pv) == BIE_ERR_STATE);
    /* After a training forward, grad_out of another shape is refused. */
    CHECK_OK(bie_layer_forward(p.gpu, &gx, &out));
    bie_tensor g_wrong = device_empty(BIE_BF16, 4, 24);
    CHECK(bie_layer_backward(p.gpu, &g_wrong, NULL) == BIE_ERR_SHAPE);
    CHECK(bie_layer_backward(p.gpu, &g, &wrong) == BIE_ERR_SHAPE);
    poison_device(&out);
    CHECK(bie_layer_forward(p.gpu, &gx32, &out) == BIE_ERR_DTYPE);
    bie_device cuda = {BIE_DEVICE_CUDA, 0};
    bie_layer *l = NULL;
    CHECK(bie_q4_linear_create(&l, 4, 4, cuda, BIE_I8) == BIE_ERR_DTYPE && l == NULL);
    bie_device nodev = {BIE_DEVICE_CUDA, 999};
    CHECK(bie_q4_linear_create(&l, 4, 4, nodev, BIE_F32) == BIE_ERR_DEVICE && l == NULL);
    CHECK(still_poisoned(&out)); /* failed calls wrote nothing */
    bie_tensor_free(&gx);
    bie_tensor_free(&gx32);
    bie_tensor_free(&out);
    bie_tensor_free(&wrong);
    bie_tensor_free(&wrong_in);
    bie_tensor_free(&g);
    bie_tensor_free(&g_wrong);
    bie_tensor_free(&w_wrong);
    bie_tensor_free(&q_wrong);
    free_pair(&p);
}

int main(int argc, char **argv) {
    const int small = argc > 1 && strcmp(argv[1], "--small") == 0;
    if (gpu_missing()) return TU_SKIP;
    /* {16, 256, 16} and those with k a multiple of 256 and n of 16 take the 16-bit grad_x
     * of the GEMM with the mask epilogue (the first four: --small). */
    static const int64_t shapes[][3] = {
        /* m, k, n */
        {1, 1, 1},      {1, 300, 77},    {3, 63, 5},      {16, 256, 16},   {17, 257, 9},
        {5, 1000, 300}, {64, 512, 64},   {33, 4099, 200}, {130, 513, 129}, {1, 8192, 64},
        {16, 3001, 40}, {257, 1536, 96}, {300, 768, 272}, {129, 2304, 48}, {16, 256, 8}};
    const int count = small ? 4 : (int)(sizeof shapes / sizeof shapes[0]);
    for (int d = 0; d < 3; d++) {
        for (int i = 0; i < count; i++)
            check_shape(kDtypes[d], shapes[i][0], shapes[i][1], shapes[i][2], !small && i % 3 == 1);
        activation_matches(kDtypes[d]);
    }
    bad_input();
    return tu_finish();
}
