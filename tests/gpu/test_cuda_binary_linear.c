/* The binary linear layer on CUDA against the CPU layer: forward bit for bit (float32,
 * bfloat16 and float16 outputs equal the CPU's float32 result rounded once to that dtype), in
 * training and inference modes, from float and pre-packed input, with every CUDA kernel;
 * backward within float tolerance (int8 weight gradients within one step); bad input rejected
 * with outputs untouched; the opt-in FP8 backward against the CPU backward of grad_out rounded
 * to e4m3 as it does; the opt-in training weight pass against the default one. Random shapes
 * include m = 1, odd k and n, and k over 8192 bits.
 * Reports itself skipped (77) without a GPU. Usage: test_cuda_binary_linear [--small] */
#include <math.h>

#include "gpu_util.h"
#ifdef BIE_TEST_CUDA_INTERNALS
#include "cuda/cuda_internal.h"
#endif

typedef struct pair {
    bie_layer *cpu, *gpu;
    bie_dtype dt;
    int64_t k, n;
} pair;

static pair make_pair(bie_dtype dt, int64_t k, int64_t n, uint64_t seed) {
    pair p = {NULL, NULL, dt, k, n};
    bie_device cuda = {BIE_DEVICE_CUDA, 0};
    CHECK_OK(bie_binary_linear_create(&p.cpu, k, n, bie_cpu(), BIE_F32, true));
    CHECK_OK(bie_binary_linear_create(&p.gpu, k, n, cuda, dt, true));
    CHECK_OK(bie_layer_reset_parameters(p.cpu, seed));
    CHECK_OK(bie_layer_reset_parameters(p.gpu, seed));
    CHECK_OK(bie_layer_prepare_params(p.cpu));
    CHECK_OK(bie_layer_prepare_params(p.gpu));
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
    /* The int8 weights must agree after prepare_params. */
    bie_tensor cw, gw;
    CHECK_OK(bie_layer_param(p.cpu, BIE_PARAM_WEIGHT, &cw));
    CHECK_OK(bie_layer_param(p.gpu, BIE_PARAM_WEIGHT, &gw));
    CHECK(cw.dtype == BIE_I8 && gw.dtype == BIE_I8);
    float *w_host = tu_alloc((size_t)(k * n) * 4), *w_cpu = tu_alloc((size_t)(k * n) * 4);
    download_as(&gw, w_host);
    for (int64_t i = 0; i < k * n; i++) w_cpu[i] = (float)((int8_t *)cw.data)[i];
    CHECK(compare_exact("int8 weight", w_host, w_cpu, k * n));
    free(w_host);
    free(w_cpu);
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
        fprintf(stderr, "  (dtype %s m=%lld k=%lld n=%lld kernel %d)\n", bie_dtype_name(p->dt),
                (long long)m, (long long)p->k, (long long)p->n, tu_layer_kernel(p->gpu));
}

/* The GPU layer's qweight equals the CPU layer's, byte for byte. */
static void qweight_matches(pair *p) {
    bie_tensor q = {0}, cq = {0};
    CHECK_OK(bie_layer_param(p->gpu, BIE_PARAM_QWEIGHT, &q));
    CHECK_OK(bie_layer_param(p->cpu, BIE_PARAM_QWEIGHT, &cq));
    if (q.data == NULL || cq.data == NULL) return;
    CHECK(device_bytes_match(&q, cq.data));
}

/* The GPU backward against the CPU's; fp8: the GPU layer runs the FP8 products, so the CPU
 * gets grad_out as they see it (rounded to e4m3 at the per-tensor scale 448 / amax). */
static void backward_matches(pair *p, int64_t m, int fp8) {
    const int64_t k = p->k, n = p->n;
    float *g = tu_alloc((size_t)(m * n) * 4), *gc = tu_alloc((size_t)(m * n) * 4);
    fill_input(g, m * n); /* exact in every dtype */
    float amax = 0.0f;
    for (int64_t i = 0; i < m * n; i++) amax = fmaxf(amax, fabsf(g[i]));
    const float s = amax > 0 ? 448.0f / amax : 1.0f, inv = amax > 0 ? amax / 448.0f : 1.0f;
    for (int64_t i = 0; i < m * n; i++) gc[i] = fp8 ? round_e4m3(g[i] * s) * inv : g[i];
    bie_tensor gg = upload_as(p->dt, g, m, n), cg = tu_view(gc, BIE_F32, 2, m, n, 0, 0);
    bie_tensor ggx = device_empty(p->dt, m, k);
    poison_device(&ggx);
    float *cgx = tu_alloc((size_t)(m * k) * 4),
          *got = tu_alloc((size_t)(m * k > n * k ? m * k : n * k) * 4);
    bie_tensor cgxv = tu_view(cgx, BIE_F32, 2, m, k, 0, 0);
    bie_status st = bie_layer_backward(p->gpu, &gg, &ggx);
    CHECK(st == BIE_OK);
    if (st != BIE_OK) fprintf(stderr, "  backward: %s\n", bie_last_error());
    CHECK_OK(bie_layer_backward(p->cpu, &cg, &cgxv));
    /* fp8: the tensor cores' FP8 sums are not f32-exact (cuBLASLt: about 3e-5 of the largest
     * element; the fused Hopper kernels, which sum the whole reduction in the tensor cores'
     * accumulator: up to about 3e-4; bie.h), so 1e-3 of it on top of the e4m3 rounding done
     * above. */
    const double wtol = fp8 ? 1e-3 : 1e-5, tol = fmax(wtol, p->dt == BIE_F32    ? 1e-5
                                                            : p->dt == BIE_BF16 ? 8e-3
                                                                                : 1e-3);
    download_as(&ggx, got);
    CHECK(compare_close("grad_x", got, cgx, m * k, tol));
    bie_tensor a, b;
    CHECK_OK(bie_layer_grad(p->gpu, BIE_PARAM_WEIGHT_FLOAT_GRAD, &a));
    CHECK_OK(bie_layer_grad(p->cpu, BIE_PARAM_WEIGHT_FLOAT_GRAD, &b));
    download_as(&a, got);
    CHECK(compare_close("grad_w", got, b.data, n * k, wtol));
    /* the int8 gradient: exactly the quantization (SPEC §1) of the float one the layer gave */
    float wmax = 0.0f;
    for (int64_t i = 0; i < n * k; i++) wmax = fmaxf(wmax, fabsf(got[i]));
    int8_t *want = tu_alloc((size_t)(n * k));
    for (int64_t i = 0; i < n * k; i++) {
        const float v = wmax > 0 ? rintf(got[i] * 127.0f / wmax) : 0.0f;
        want[i] = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
    }
    CHECK_OK(bie_layer_grad(p->gpu, BIE_PARAM_WEIGHT, &a));
    CHECK_OK(bie_layer_grad(p->cpu, BIE_PARAM_WEIGHT, &b));
    CHECK(a.dtype == BIE_I8 && b.dtype == BIE_I8);
    download_as(&a, got);
    int64_t off = 0, unequal = 0;
    for (int64_t i = 0; i < n * k; i++) {
        off += fabsf(got[i] - (float)((int8_t *)b.data)[i]) > 1.0f;
        unequal += got[i] != (float)want[i];
    }
    CHECK(off == 0);
    CHECK(unequal == 0);
    if (unequal)
        fprintf(stderr, "  %lld int8 grad_w codes differ from the float grad_w's (m=%lld)\n",
                (long long)unequal, (long long)m);
    free(want);
    CHECK_OK(bie_layer_grad(p->gpu, BIE_PARAM_BIAS_A, &a));
    CHECK_OK(bie_layer_grad(p->cpu, BIE_PARAM_BIAS_A, &b));
    download_as(&a, got);
    CHECK(compare_close("grad_bias_a", got, b.data, k, tol));
    CHECK_OK(bie_layer_grad(p->gpu, BIE_PARAM_SCALE_A, &a));
    CHECK_OK(bie_layer_grad(p->cpu, BIE_PARAM_SCALE_A, &b));
    download_as(&a, got);
    float ref = *(float *)b.data;
    /* a sum of m k terms that cancel: its error is relative to the sum of their magnitudes */
    double mag = 0;
    for (int64_t i = 0; i < m * k; i++) mag += fabs(cgx[i]);
    mag /= sqrt((double)(m * k));
    CHECK(fabs(got[0] - ref) <= tol * 10 * fabs(ref) + tol * mag + 1e-5);
    if (!(fabs(got[0] - ref) <= tol * 10 * fabs(ref) + tol * mag + 1e-5))
        fprintf(stderr, "  grad_scale_a %g vs %g (terms' magnitude %g; %s m=%lld k=%lld n=%lld)\n",
                got[0], ref, mag, bie_dtype_name(p->dt), (long long)m, (long long)k, (long long)n);
    bie_tensor_free(&gg);
    bie_tensor_free(&ggx);
    free(g);
    free(gc);
    free(cgx);
    free(got);
}

/* forward_again after a training forward: the same bytes as that forward's output, from the
 * kept state (scale_a changed in between, then put back). */
static void again_matches(pair *p, const bie_tensor *gx, int64_t m, const char *what) {
    const int64_t n = tu_layer_out(p->gpu);
    bie_tensor a = device_empty(p->dt, m, n), b = device_empty(p->dt, m, n);
    poison_device(&a);
    poison_device(&b);
    CHECK_OK(bie_layer_forward(p->gpu, gx, &a));
    float scale_a = 0;
    CHECK_OK(bie_layer_get_scale_a(p->gpu, &scale_a));
    CHECK_OK(bie_layer_set_scale_a(p->gpu, scale_a * 3.0f));
    const bie_status st = bie_layer_forward_again(p->gpu, &b);
    CHECK(st == BIE_OK);
    CHECK_OK(bie_layer_set_scale_a(p->gpu, scale_a));
    float *fa = tu_alloc((size_t)(m * n) * 4), *fb = tu_alloc((size_t)(m * n) * 4);
    download_as(&a, fa);
    download_as(&b, fb);
    const int same = st == BIE_OK && tu_same_bits(fa, fb, m * n);
    CHECK(same);
    if (!same)
        fprintf(stderr, "  forward_again differs (%s; %s m=%lld n=%lld): %s\n", what,
                bie_dtype_name(p->dt), (long long)m, (long long)n,
                st == BIE_OK ? "values" : bie_last_error());
    bie_tensor_free(&a);
    bie_tensor_free(&b);
    free(fa);
    free(fb);
}

static void check_shape(bie_dtype dt, int64_t m, int64_t k, int64_t n, int all_kernels) {
    pair p = make_pair(dt, k, n, 1000 + (uint64_t)(m * 31 + k * 7 + n));
    float *x = tu_alloc((size_t)(m * k) * 4);
    fill_input(x, m * k);
    bie_tensor gx = upload_as(dt, x, m, k), cx = tu_view(x, BIE_F32, 2, m, k, 0, 0);

    /* scale_a measured on the device, then the same value on the CPU layer. */
    CHECK_OK(bie_layer_set_activation(p.gpu, &gx, NULL));
    bie_tensor sa;
    float measured = 0;
    CHECK_OK(bie_layer_param(p.gpu, BIE_PARAM_SCALE_A, &sa));
    download_as(&sa, &measured);
    double s = 0;
    for (int64_t i = 0; i < m * k; i++) s += fabs(x[i]);
    float expect = (float)(2.0 * s / (double)(m * k));
    CHECK(fabsf(measured - expect) <= 1e-6f * expect);
    CHECK_OK(bie_layer_set_scale_a(p.cpu, measured));

    forward_matches(&p, &gx, &cx, m, "training forward");
    again_matches(&p, &gx, m, "default kernel");
    backward_matches(&p, m, 0);
    /* The FP8 products where the device has them (m, n, k multiples of 16; else the exact
     * ones run), then back to the exact backward. */
    if (bie_layer_set_backward_mode(p.gpu, BIE_BACKWARD_FP8) == BIE_OK) {
        forward_matches(&p, &gx, &cx, m, "training forward (fp8 backward)");
        backward_matches(&p, m, m % 16 == 0 && n % 16 == 0 && k % 16 == 0);
        CHECK_OK(bie_layer_set_backward_mode(p.gpu, BIE_BACKWARD_EXACT));
    }

    if (all_kernels) {
        for (int i = 0; i < bie_kernel_count(); i++) {
            bie_kernel_info info;
            CHECK_OK(bie_kernel_get(i, &info));
            if (info.device != BIE_DEVICE_CUDA ||
                bie_layer_set_gemm_kernel(p.gpu, info.id) != BIE_OK)
                continue;
            forward_matches(&p, &gx, &cx, m, info.name);
            again_matches(&p, &gx, m, info.name);
        }
        CHECK_OK(bie_layer_select_gemm_kernel(p.gpu, &gx));
        bie_kernel_info info;
        CHECK_OK(bie_kernel_find(tu_layer_kernel(p.gpu), &info));
        CHECK(info.device == BIE_DEVICE_CUDA);
        forward_matches(&p, &gx, &cx, m, "selected kernel");
        CHECK_OK(bie_layer_set_gemm_kernel(p.gpu, -1));
    }

    /* Inference: packed weights only, then pre-packed input. */
    CHECK_OK(bie_layer_set_training(p.cpu, false));
    CHECK_OK(bie_layer_set_training(p.gpu, false));
    /* The first inference forward packs qweight on both devices (opt_weight). */
    forward_matches(&p, &gx, &cx, m, "inference forward, packed on first use");
    qweight_matches(&p);
    CHECK_OK(bie_layer_generate_quantized_weight(p.cpu, true));
    CHECK_OK(bie_layer_generate_quantized_weight(p.gpu, true));
    qweight_matches(&p);
    forward_matches(&p, &gx, &cx, m, "inference forward");

    const int64_t words = bie_packed_words(k, 8);
    uint8_t *packed = tu_alloc((size_t)(m * words));
    bie_tensor pv = tu_view(packed, BIE_U8, 2, m, words, 0, 0);
    CHECK_OK(bie_pack_signs(&cx, 8, &pv));
    int64_t shape[2] = {m, words};
    bie_tensor gp;
    CHECK_OK(bie_cuda_tensor_alloc(&gp, BIE_U8, 2, shape, 0));
    CHECK_OK(bie_tensor_copy(&gp, &pv));
    forward_matches(&p, &gp, &pv, m, "packed-input forward");
    bie_tensor_free(&gp);
    free(packed);

    bie_tensor_free(&gx);
    free(x);
    free_pair(&p);
}

/* Bad input: clear errors, outputs and state untouched. */
static void bad_input(void) {
    pair p = make_pair(BIE_BF16, 40, 24, 5);
    float x[3 * 40];
    fill_input(x, 3 * 40);
    bie_tensor gx = upload_as(BIE_BF16, x, 3, 40), hx = tu_view(x, BIE_F32, 2, 3, 40, 0, 0);
    bie_tensor out = device_empty(BIE_BF16, 3, 24), gx32 = upload_as(BIE_F32, x, 3, 40);
    poison_device(&out);
    CHECK(bie_layer_forward(p.gpu, &hx, &out) == BIE_ERR_DEVICE);  /* host input */
    CHECK(bie_layer_forward(p.gpu, &gx32, &out) == BIE_ERR_DTYPE); /* wrong dtype */
    bie_tensor wrong = device_empty(BIE_BF16, 3, 23);
    CHECK(bie_layer_forward(p.gpu, &gx, &wrong) == BIE_ERR_SHAPE);
    bie_tensor g = device_empty(BIE_BF16, 3, 24);
    CHECK(bie_layer_backward(p.gpu, &g, NULL) == BIE_ERR_STATE); /* no forward yet */
    CHECK(bie_layer_forward_again(p.gpu, &out) == BIE_ERR_STATE);
    CHECK_OK(bie_layer_forward(p.gpu, &gx, &g));                  /* a training forward kept */
    CHECK(bie_layer_forward_again(p.gpu, &hx) == BIE_ERR_DEVICE); /* (hx: a host [3, 40]) */
    CHECK(bie_layer_forward_again(p.gpu, &wrong) == BIE_ERR_SHAPE);
    CHECK(bie_layer_set_gemm_kernel(p.gpu, 1) != BIE_OK); /* a CPU kernel */
    CHECK(bie_layer_set_gemm_kernel(p.gpu, 12345) == BIE_ERR_INVALID_ARGUMENT);
    CHECK(bie_layer_set_bits_binary_word(p.gpu, 7) == BIE_ERR_INVALID_ARGUMENT);
    bie_device cuda = {BIE_DEVICE_CUDA, 0};
    bie_layer *l = NULL;
    CHECK(bie_binary_linear_create(&l, 4, 4, cuda, BIE_I8, true) == BIE_ERR_DTYPE && l == NULL);
    bie_device nodev = {BIE_DEVICE_CUDA, 999};
    CHECK(bie_binary_linear_create(&l, 4, 4, nodev, BIE_F32, true) == BIE_ERR_DEVICE && l == NULL);
    CHECK(still_poisoned(&out)); /* failed calls wrote nothing */
    bie_tensor_free(&gx);
    bie_tensor_free(&gx32);
    bie_tensor_free(&out);
    bie_tensor_free(&wrong);
    bie_tensor_free(&g);
    free_pair(&p);
}

#ifdef BIE_TEST_CUDA_INTERNALS
/* bie_cuda_pack_weight_signs (the opt-in training weight pass) against bie_cuda_pack_weight's
 * bits and popcounts, byte for byte, and its ±1 values transposed against the host's, in
 * each element form (bf16, f16, e4m3); outputs poisoned first; a shape it does not take
 * rejected with nothing written. */
static void check_weight_signs(int64_t n, int64_t k) {
    const int64_t ld = bie_cuda_row_stride(k), parts = bie_cuda_popc_parts(ld);
    CHECK(ld == k / 8 && bie_cuda_weight_signs_shape(n, k));
    int8_t *w = tu_alloc((size_t)(n * k));
    for (int64_t i = 0; i < n * k; i++) w[i] = (int8_t)((int)(tu_next() % 7) - 3); /* zeros too */
    int64_t shape[1] = {n * k};
    bie_tensor dw, bits, bits_ref, popc, popc_ref, st;
    CHECK_OK(bie_cuda_tensor_alloc(&dw, BIE_I8, 1, shape, 0));
    bie_tensor hw = tu_view(w, BIE_I8, 1, n * k, 0, 0, 0);
    CHECK_OK(bie_tensor_copy(&dw, &hw));
    shape[0] = n * ld;
    CHECK_OK(bie_cuda_tensor_alloc(&bits, BIE_U8, 1, shape, 0));
    CHECK_OK(bie_cuda_tensor_alloc(&bits_ref, BIE_U8, 1, shape, 0));
    shape[0] = n * parts;
    CHECK_OK(bie_cuda_tensor_alloc(&popc, BIE_I32, 1, shape, 0));
    CHECK_OK(bie_cuda_tensor_alloc(&popc_ref, BIE_I32, 1, shape, 0));
    shape[0] = n * k * 2;
    CHECK_OK(bie_cuda_tensor_alloc(&st, BIE_U8, 1, shape, 0));
    CHECK_OK(bie_cuda_pack_weight(BIE_I8, dw.data, n, k, ld, bits_ref.data, popc_ref.data));
    uint8_t *want_bits = download_bytes(&bits_ref);
    int *want_popc = download_bytes(&popc_ref);
    uint8_t *want = tu_alloc((size_t)(n * k * 2));
    for (int form = 0; form < 3; form++) {
        const int es = form == 2 ? 1 : 2;
        const bie_dtype dt = form == 1 ? BIE_F16 : BIE_BF16;
        const uint16_t pos = dt == BIE_F16 ? 0x3c00 : 0x3f80, neg = dt == BIE_F16 ? 0xbc00 : 0xbf80;
        for (int64_t c = 0; c < k; c++)
            for (int64_t r = 0; r < n; r++) {
                const bool p = w[r * k + c] >= 0;
                if (es == 1)
                    want[c * n + r] = p ? 0x38 : 0xb8;
                else
                    memcpy(want + (c * n + r) * 2, p ? &pos : &neg, 2);
            }
        poison_device_with(&bits, 0xa5);
        poison_device_with(&popc, 0xa5);
        poison_device_with(&st, 0x5a);
        CHECK_OK(
            bie_cuda_pack_weight_signs(dw.data, n, k, ld, bits.data, popc.data, es, dt, st.data));
        CHECK_OK(bie_cuda_synchronize());
        CHECK(device_bytes_match(&bits, want_bits));
        CHECK(device_bytes_match(&popc, want_popc));
        uint8_t *got = download_bytes(&st);
        const int same = memcmp(got, want, (size_t)(n * k * es)) == 0;
        CHECK(same);
        if (!same)
            fprintf(stderr, "  weight signs differ: n=%lld k=%lld es=%d %s\n", (long long)n,
                    (long long)k, es, bie_dtype_name(dt));
        free(got);
    }
    /* not its shape (k not a multiple of 2048), or an element form it does not have */
    poison_device_with(&bits, 0xa5);
    CHECK(bie_cuda_pack_weight_signs(dw.data, n, k - 64, ld, bits.data, popc.data, 2, BIE_BF16,
                                     st.data) != BIE_OK);
    CHECK(bie_cuda_pack_weight_signs(dw.data, n, k, ld, bits.data, popc.data, 2, BIE_F32,
                                     st.data) != BIE_OK);
    CHECK(bie_cuda_pack_weight_signs(dw.data, n, k, ld, bits.data, popc.data, 4, BIE_BF16,
                                     st.data) != BIE_OK);
    CHECK_OK(bie_cuda_synchronize());
    memset(want_bits, 0xa5, (size_t)(n * ld));
    CHECK(device_bytes_match(&bits, want_bits));
    free(want);
    free(want_bits);
    free(want_popc);
    free(w);
    bie_tensor_free(&dw);
    bie_tensor_free(&bits);
    bie_tensor_free(&bits_ref);
    bie_tensor_free(&popc);
    bie_tensor_free(&popc_ref);
    bie_tensor_free(&st);
}
#endif

int main(int argc, char **argv) {
    const int small = argc > 1 && strcmp(argv[1], "--small") == 0;
    if (gpu_missing()) return TU_SKIP;
    tu_seed(91);
    static const int64_t shapes[][3] = {/* m, k, n */
                                        {1, 1, 1},
                                        {1, 300, 77},
                                        {3, 63, 5},
                                        {48, 272, 16}, /* FP8 products (in --small too) */
                                        /* the ±1 weight written by the training forward
                                         * (BIE_CUDA_LINEAR_WSIGNS=1: k % 2048, n % 16; in
                                         * --small too) */
                                        {16, 2048, 16},
                                        {33, 6144, 144},
                                        {96, 2048, 48},
                                        {16, 256, 8},
                                        {17, 257, 9},
                                        {5, 1000, 300},
                                        {64, 512, 64},
                                        {33, 4099, 200},
                                        {130, 513, 129},
                                        {1, 8192, 64},
                                        {16, 20000, 40},
                                        {257, 1536, 96},
                                        /* packing 4 or 2 rows a block (k of 64 or 128 words,
                                         * rows not a multiple), a tall input (more row groups
                                         * in the backward's mask pass) */
                                        {150, 2048, 33},
                                        {301, 4096, 63},
                                        {20000, 40, 24},
                                        /* more FP8 backward shapes (multiples of 16) */
                                        {144, 48, 80},
                                        {256, 1024, 512},
                                        /* partial tiles of the fused FP8 kernels (rows not
                                         * a multiple of 128, columns of 256, k blocks of 128) */
                                        {272, 400, 144},
                                        {16, 2064, 48},
                                        /* the exact grad_w kernel's partial tiles (batch
                                         * rows of 64, features of 128, outputs of 256) */
                                        {80, 144, 272},
                                        /* more grad_x tiles than blocks (the int8 grad_w
                                         * the side job of its epilogue warps), exact and FP8 */
                                        {4100, 2064, 48},
                                        {1024, 8192, 32}};
    const int count = small ? 5 : (int)(sizeof shapes / sizeof shapes[0]);
    for (int d = 0; d < 3; d++)
        for (int i = 0; i < count; i++)
            check_shape(kDtypes[d], shapes[i][0], shapes[i][1], shapes[i][2],
                        d == 0 && (i % 3 == 1));
#ifdef BIE_TEST_CUDA_INTERNALS
    check_weight_signs(16, 2048);
    if (!small) {
        check_weight_signs(144, 6144);
        check_weight_signs(48, 4096);
        check_weight_signs(32, 16384); /* two popcount slices a row */
    }
#endif
    bad_input();
    return tu_finish();
}
