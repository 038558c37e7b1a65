/* Every layer kind on every device and every GEMM kernel of its op, against the scalar
 * references of layer_ref.h (SPEC §1-4): bie_layer_describe and bie_layer_output_shape,
 * prepare_params' scale_w, set_activation (scale_a and x + bias_a), the forward bit for bit,
 * the backward (grad_x, grad bias_a, grad scale_a, float and int8 weight gradients) within
 * float tolerance, the weight gradient into a caller's target, and inference from the packed
 * weight. Fresh random data for each case,
 * odd sizes and batch 1, every output poisoned with NaN before each call. CUDA runs where
 * bie_cuda_device_count() > 0 (a printed note otherwise; --require-cuda makes that a
 * failure). One row of `kinds` per layer kind: adding a kind is adding a row. */
#include "bie_cuda.h"
#include "layer_ref.h"
#include "test_util.h"

/* A layer kind: how to make one for a geometry, and which reference math applies. */
typedef struct {
    const char *name; /* as bie_layer_describe names it */
    bie_layer_kind kind;
    bool conv;   /* NCHW images, else rows of features */
    bool binary; /* has a word size and a symmetric flag */
    bie_op op;   /* the op of its GEMM kernels */
    const ref_quant *quant;
    bie_status (*create)(bie_layer **out, const ref_geom *g, bie_device dev, bool symmetric);
} kind_row;

static bie_status create_binary_linear(bie_layer **out, const ref_geom *g, bie_device dev,
                                       bool symmetric) {
    return bie_binary_linear_create(out, g->c, g->o, dev, BIE_F32, symmetric);
}
static bie_status create_binary_conv2d(bie_layer **out, const ref_geom *g, bie_device dev,
                                       bool symmetric) {
    return bie_binary_conv2d_create(out, g->c, g->o, (int)g->k, (int)g->s, (int)g->p, (int)g->d,
                                    dev, BIE_F32, symmetric);
}
static bie_status create_q4_linear(bie_layer **out, const ref_geom *g, bie_device dev,
                                   bool symmetric) {
    (void)symmetric;
    return bie_q4_linear_create(out, g->c, g->o, dev, BIE_F32);
}
static bie_status create_q4_conv2d(bie_layer **out, const ref_geom *g, bie_device dev,
                                   bool symmetric) {
    (void)symmetric;
    return bie_q4_conv2d_create(out, g->c, g->o, (int)g->k, (int)g->s, (int)g->p, (int)g->d, dev,
                                BIE_F32);
}

static const kind_row kinds[] = {
    {"binary_linear", BIE_KIND_BINARY_LINEAR, false, true, BIE_OP_BINARY_GEMM, &REF_BINARY,
     create_binary_linear},
    {"binary_conv2d", BIE_KIND_BINARY_CONV2D, true, true, BIE_OP_BINARY_GEMM, &REF_BINARY,
     create_binary_conv2d},
    {"q4_linear", BIE_KIND_Q4_LINEAR, false, false, BIE_OP_Q4_GEMM, &REF_Q4, create_q4_linear},
    {"q4_conv2d", BIE_KIND_Q4_CONV2D, true, false, BIE_OP_Q4_GEMM, &REF_Q4, create_q4_conv2d},
};

/* Linear shapes: {m, in, out} (batch 1, odd sizes, sizes off multiples of 8 / 32 / 64). */
static const int64_t linear_shapes[][3] = {{1, 1, 1},    {1, 37, 5},    {3, 65, 9},
                                           {7, 129, 33}, {16, 200, 17}, {33, 97, 70}};
/* Conv shapes: {n, c, h, w, o, k, s, p, d}. */
static const ref_geom conv_shapes[] = {
    {1, 1, 1, 1, 1, 1, 1, 0, 1},  {1, 3, 5, 5, 4, 3, 1, 1, 1},  {2, 7, 9, 6, 5, 3, 2, 1, 1},
    {1, 33, 7, 7, 3, 3, 1, 2, 2}, {3, 10, 6, 5, 9, 1, 1, 0, 1}, {1, 65, 6, 6, 7, 3, 1, 1, 1},
    {2, 5, 9, 11, 6, 5, 1, 2, 1},
};

/* ---------------------------------------------------------------- tensors on either device */

static size_t nbytes(const bie_tensor *t) {
    return (size_t)bie_tensor_numel(t) * bie_dtype_size(t->dtype);
}

static bie_tensor dev_alloc(bie_device dev, bie_dtype dt, int ndim, const int64_t *shape) {
    bie_tensor t;
    bie_status st = dev.type == BIE_DEVICE_CUDA
                        ? bie_cuda_tensor_alloc(&t, dt, ndim, shape, dev.index)
                        : bie_tensor_alloc(&t, dt, ndim, shape);
    if (st != BIE_OK) {
        fprintf(stderr, "tensor allocation failed: %s\n", bie_last_error());
        exit(2);
    }
    return t;
}

/* A host view with t's dtype and shape over `host`. */
static bie_tensor host_like(const bie_tensor *t, void *host) {
    bie_tensor h;
    if (bie_tensor_view(&h, host, t->dtype, t->ndim, t->shape) != BIE_OK) {
        fprintf(stderr, "bad view: %s\n", bie_last_error());
        exit(2);
    }
    return h;
}

/* host -> t, on either device. */
static void put(bie_tensor *t, const void *host) {
    if (t->device.type == BIE_DEVICE_CPU) {
        memcpy(t->data, host, nbytes(t));
        return;
    }
    bie_tensor h = host_like(t, (void *)host);
    CHECK_OK(bie_tensor_copy(t, &h));
}

/* t -> host, on either device. */
static void get(const bie_tensor *t, void *host) {
    if (t->device.type == BIE_DEVICE_CPU) {
        memcpy(host, t->data, nbytes(t));
        return;
    }
    bie_tensor h = host_like(t, host);
    CHECK_OK(bie_tensor_copy(&h, t));
}

/* Fill t (float32) with the NaN poison. */
static void poison(bie_tensor *t) {
    const int64_t n = bie_tensor_numel(t);
    float *p = tu_alloc((size_t)n * sizeof(float));
    tu_poison(p, n);
    put(t, p);
    free(p);
}

/* A scalar parameter (SCALE_A, SCALE_W) or gradient, read to the host. */
static float read_scalar(bie_layer *l, bie_param which, bool grad) {
    bie_tensor v;
    float s = NAN;
    bie_status st = grad ? bie_layer_grad(l, which, &v) : bie_layer_param(l, which, &v);
    CHECK_OK(st);
    if (st == BIE_OK && v.dtype == BIE_F32 && bie_tensor_numel(&v) == 1) get(&v, &s);
    return s;
}

/* A parameter or gradient copied to the host (F32 or I8; NULL with a failed check if absent),
 * its descriptor in *view. */
static void *read_tensor(bie_layer *l, bie_param which, bool grad, bie_tensor *view) {
    bie_status st = grad ? bie_layer_grad(l, which, view) : bie_layer_param(l, which, view);
    CHECK_OK(st);
    if (st != BIE_OK) return NULL;
    void *host = tu_alloc(nbytes(view));
    get(view, host);
    return host;
}

/* Scales measured on the device may be summed in another order than the reference's. */
static bool same_scale(float got, float want, bool on_cuda) {
    return on_cuda ? fabsf(got - want) <= 1e-5f * fabsf(want) : got == want;
}

/* ---------------------------------------------------------------- one case */

typedef struct {
    const kind_row *row;
    bie_device dev;
    ref_geom g;
    bool symmetric;
    int bits;
    char what[200];
} case_info;

static void describe_matches(const case_info *ci, bie_layer *l) {
    const kind_row *r = ci->row;
    const ref_geom *g = &ci->g;
    bie_layer_desc d;
    CHECK_OK(bie_layer_describe(l, &d));
    CHECK(d.kind == r->kind && d.name != NULL && strcmp(d.name, r->name) == 0);
    CHECK(d.in == g->c && d.out == g->o && d.fan_in == ref_fan_in(g));
    CHECK(d.device.type == ci->dev.type && d.device.index == ci->dev.index && d.dtype == BIE_F32);
    CHECK(d.training && d.kernel_id == -1);
    if (r->conv)
        CHECK(d.kernel_size == g->k && d.stride == g->s && d.padding == g->p && d.dilation == g->d);
    if (r->binary)
        CHECK(d.bits_binary_word == 8 && d.symmetric == ci->symmetric);
    else
        CHECK(d.bits_binary_word == 0);
}

/* Forward with kernel `id` (training mode, output poisoned) against `expect`, then the backward
 * against the reference gradients. */
static void check_kernel(const case_info *ci, bie_layer *l, int id, const char *kname,
                         bie_tensor *tx, bie_tensor *tout, bie_tensor *tg, bie_tensor *tgx,
                         const float *expect, const double *rgx, const double *rgw,
                         const double *rgb, double rgs, double gs_tol) {
    const ref_geom *g = &ci->g;
    const int64_t nx = ref_numel_x(g), no = ref_numel_out(g), nw = g->o * ref_fan_in(g);
    bie_status st = bie_layer_set_gemm_kernel(l, id);
    if (st == BIE_ERR_UNSUPPORTED && ci->dev.type == BIE_DEVICE_CUDA) {
        printf("note: %s: kernel %s does not run this layer's rows (%s)\n", ci->what, kname,
               bie_last_error());
        return;
    }
    CHECK_OK(st);
    if (st != BIE_OK) return;
    CHECK(tu_layer_kernel(l) == id);

    float *out = tu_alloc((size_t)no * sizeof(float)), *gx = tu_alloc((size_t)nx * sizeof(float));
    poison(tout);
    CHECK_OK(bie_layer_forward(l, tx, tout));
    get(tout, out);
    const int same = tu_same_bits(out, expect, no);
    CHECK(same);
    if (!same)
        for (int64_t i = 0; i < no; i++)
            if (memcmp(&out[i], &expect[i], sizeof(float)) != 0) {
                fprintf(stderr, "  forward differs: %s, kernel %s, element %lld: %.9g vs %.9g\n",
                        ci->what, kname, (long long)i, (double)out[i], (double)expect[i]);
                break;
            }

    poison(tgx);
    CHECK_OK(bie_layer_backward(l, tg, tgx));
    get(tgx, gx);
    int ok = ref_close(gx, rgx, nx, 1e-5);
    bie_tensor v;
    float *gb = read_tensor(l, BIE_PARAM_BIAS_A, true, &v);
    ok &= gb != NULL && v.dtype == BIE_F32 && bie_tensor_numel(&v) == g->c &&
          ref_close(gb, rgb, g->c, 1e-5);
    float *gwf = read_tensor(l, BIE_PARAM_WEIGHT_FLOAT_GRAD, true, &v);
    ok &= gwf != NULL && v.dtype == BIE_F32 && bie_tensor_numel(&v) == nw &&
          ref_close(gwf, rgw, nw, 1e-5);
    void *gw = read_tensor(l, BIE_PARAM_WEIGHT, true, &v);
    if (ci->row->binary) /* the weight is int8 after prepare_params: so is its gradient */
        ok &= gw != NULL && v.dtype == BIE_I8 && bie_tensor_numel(&v) == nw &&
              ref_int8_grad_ok(gw, rgw, nw);
    else
        ok &= gw != NULL && v.dtype == BIE_F32 && bie_tensor_numel(&v) == nw &&
              ref_close(gw, rgw, nw, 1e-5);
    const float gs = read_scalar(l, BIE_PARAM_SCALE_A, true);
    ok &= fabs(gs - rgs) <= gs_tol + 1e-4 * fabs(rgs) + 1e-5;
    CHECK(ok);
    if (!ok)
        fprintf(stderr, "  backward differs: %s, kernel %s (grad_scale_a %.9g vs %.9g)\n", ci->what,
                kname, (double)gs, rgs);
    free(gb), free(gwf), free(gw), free(out), free(gx);
}

/* bie_layer_set_weight_grad_target: a backward with a target puts the same weight gradient
 * (bit for bit: the same kernels on the same inputs) into the poisoned target, bie_layer_grad
 * views the target on CUDA, the next backward without one uses the layer's own buffer again;
 * bad targets fail and set nothing. After check_kernel's backward with the default kernel. */
static void check_grad_target(const case_info *ci, bie_layer *l, bie_tensor *tx, bie_tensor *tout,
                              bie_tensor *tg, bie_tensor *tgx) {
    const bool on_cuda = ci->dev.type == BIE_DEVICE_CUDA;
    const ref_geom *g = &ci->g;
    const int64_t nw = g->o * ref_fan_in(g);
    bie_tensor v;
    void *want = read_tensor(l, BIE_PARAM_WEIGHT, true, &v);
    if (want == NULL) return;
    const bie_dtype dt = v.dtype;
    const size_t bytes = (size_t)nw * bie_dtype_size(dt);
    const int64_t flat[1] = {nw}, wrong[1] = {nw + 1};
    bie_tensor target = dev_alloc(ci->dev, dt, 1, flat);
    bie_tensor bad_dtype = dev_alloc(ci->dev, dt == BIE_I8 ? BIE_F32 : BIE_I8, 1, flat);
    bie_tensor bad_size = dev_alloc(ci->dev, dt, 1, wrong);
    uint8_t *poison_bytes = tu_alloc(bytes), *got = tu_alloc(bytes);
    memset(poison_bytes, 0x7f, bytes);
    put(&target, poison_bytes);
    bie_tensor no_data = target;
    no_data.data = NULL;
    CHECK(bie_layer_set_weight_grad_target(NULL, &target) == BIE_ERR_NULL_POINTER);
    CHECK(bie_layer_set_weight_grad_target(l, &no_data) == BIE_ERR_NULL_POINTER);
    CHECK(bie_layer_set_weight_grad_target(l, &bad_dtype) == BIE_ERR_DTYPE);
    CHECK(bie_layer_set_weight_grad_target(l, &bad_size) == BIE_ERR_SHAPE);
    if (on_cuda) { /* host memory for a CUDA layer */
        bie_tensor host = host_like(&target, got);
        CHECK(bie_layer_set_weight_grad_target(l, &host) == BIE_ERR_DEVICE);
    }
    /* the failed calls set nothing: this backward leaves the target as it was */
    CHECK_OK(bie_layer_forward(l, tx, tout));
    CHECK_OK(bie_layer_backward(l, tg, tgx));
    get(&target, got);
    CHECK(memcmp(got, poison_bytes, bytes) == 0);

    CHECK_OK(bie_layer_set_weight_grad_target(l, &target));
    CHECK_OK(bie_layer_forward(l, tx, tout));
    CHECK_OK(bie_layer_backward(l, tg, tgx));
    get(&target, got);
    const bool same = memcmp(got, want, bytes) == 0;
    CHECK(same);
    if (!same) fprintf(stderr, "  weight gradient in the target differs: %s\n", ci->what);
    CHECK_OK(bie_layer_grad(l, BIE_PARAM_WEIGHT, &v));
    CHECK(v.dtype == dt && bie_tensor_numel(&v) == nw);
    if (on_cuda) CHECK(v.data == target.data);
    if (dt == BIE_F32 && on_cuda) {
        CHECK_OK(bie_layer_grad(l, BIE_PARAM_WEIGHT_FLOAT_GRAD, &v));
        CHECK(v.data == target.data);
    }
    /* one backward only: the next one writes the layer's own buffer, not the target */
    put(&target, poison_bytes);
    CHECK_OK(bie_layer_forward(l, tx, tout));
    CHECK_OK(bie_layer_backward(l, tg, tgx));
    get(&target, got);
    CHECK(memcmp(got, poison_bytes, bytes) == 0);
    void *again = read_tensor(l, BIE_PARAM_WEIGHT, true, &v);
    CHECK(again != NULL && memcmp(again, want, bytes) == 0 && v.data != target.data);
    /* NULL cancels a target */
    CHECK_OK(bie_layer_set_weight_grad_target(l, &target));
    CHECK_OK(bie_layer_set_weight_grad_target(l, NULL));
    CHECK_OK(bie_layer_forward(l, tx, tout));
    CHECK_OK(bie_layer_backward(l, tg, tgx));
    get(&target, got);
    CHECK(memcmp(got, poison_bytes, bytes) == 0);
    if (ci->row->binary) { /* a float weight's target, the weight int8 since: the backward fails */
        bie_layer *fresh = NULL;
        CHECK_OK(ci->row->create(&fresh, g, ci->dev, ci->symmetric));
        bie_tensor ftarget = dev_alloc(ci->dev, BIE_F32, 1, flat);
        poison(&ftarget);
        uint8_t *before = tu_alloc((size_t)nw * 4), *after = tu_alloc((size_t)nw * 4);
        get(&ftarget, before);
        CHECK_OK(bie_layer_set_weight_grad_target(fresh, &ftarget));
        CHECK_OK(bie_layer_prepare_params(fresh));
        CHECK_OK(bie_layer_forward(fresh, tx, tout));
        CHECK(bie_layer_backward(fresh, tg, tgx) == BIE_ERR_STATE);
        get(&ftarget, after);
        CHECK(memcmp(before, after, (size_t)nw * 4) == 0);
        bie_tensor_free(&ftarget);
        bie_layer_free(fresh);
        free(before), free(after);
    }
    bie_tensor_free(&target), bie_tensor_free(&bad_dtype), bie_tensor_free(&bad_size);
    free(poison_bytes), free(got), free(want), free(again);
}

static void run_case(case_info *ci) {
    const kind_row *r = ci->row;
    const ref_geom *g = &ci->g;
    const bool on_cuda = ci->dev.type == BIE_DEVICE_CUDA;
    const int64_t nx = ref_numel_x(g), no = ref_numel_out(g), K = ref_fan_in(g), nw = g->o * K;
    const int64_t oh = ref_oh(g), ow = ref_ow(g);
    snprintf(ci->what, sizeof ci->what,
             "%s on %s: n%lld c%lld %lldx%lld o%lld k%lld s%lld p%lld d%lld, W=%d, %ssymmetric",
             r->name, on_cuda ? "CUDA" : "CPU", (long long)g->n, (long long)g->c, (long long)g->h,
             (long long)g->w, (long long)g->o, (long long)g->k, (long long)g->s, (long long)g->p,
             (long long)g->d, ci->bits, ci->symmetric ? "" : "a");

    bie_layer *l = NULL;
    bie_status st = r->create(&l, g, ci->dev, ci->symmetric);
    CHECK_OK(st);
    if (st != BIE_OK) return;
    describe_matches(ci, l);

    /* shapes of x, out and the weight; bie_layer_output_shape agrees */
    const int xnd = r->conv ? 4 : 2;
    const int64_t xs[4] = {g->n, g->c, g->h, g->w}, os[4] = {g->n, g->o, oh, ow},
                  ws[4] = {g->o, g->c, g->k, g->k};
    int64_t qs[BIE_MAX_DIMS] = {0};
    int qnd = 0;
    CHECK_OK(bie_layer_output_shape(l, xnd, xs, &qnd, qs));
    CHECK(qnd == xnd && memcmp(qs, os, (size_t)xnd * sizeof(int64_t)) == 0);

    /* the word size: binary kinds take 8, 32 or 64; 4-bit kinds have none */
    if (r->binary) {
        CHECK_OK(bie_layer_set_bits_binary_word(l, ci->bits));
        CHECK(tu_layer_bits(l) == ci->bits);
    } else {
        CHECK(bie_layer_set_bits_binary_word(l, 8) == BIE_ERR_UNSUPPORTED);
    }

    /* a random float weight (outliers: 4-bit codes clamp at -8 / 7), prepared */
    float *w = tu_alloc((size_t)nw * sizeof(float)), *bias = tu_alloc((size_t)g->c * sizeof(float));
    tu_fill(w, nw, -0.5f, 0.5f);
    for (int64_t i = 0; i < nw; i += 7) w[i] *= 40.0f;
    bie_tensor tw = dev_alloc(ci->dev, BIE_F32, xnd, ws);
    put(&tw, w);
    CHECK_OK(bie_layer_set_weight_data(l, &tw));
    bie_tensor_free(&tw);
    const float scale_w = read_scalar(l, BIE_PARAM_SCALE_W, false);
    CHECK(same_scale(scale_w, r->quant->scale_w(w, nw), on_cuda));
    bie_tensor wv, bv;
    void *wh = read_tensor(l, BIE_PARAM_WEIGHT, false, &wv);
    CHECK(wh != NULL && wv.dtype == (r->binary ? BIE_I8 : BIE_F32) && bie_tensor_numel(&wv) == nw);
    int8_t *wcode = tu_alloc((size_t)nw);
    bie_tensor wht = host_like(&wv, wh);
    for (int64_t i = 0; i < nw; i++) wcode[i] = wh ? r->quant->weight_code(&wht, i, scale_w) : 0;
    free(wh);

    /* a random bias_a through its parameter view */
    tu_fill(bias, g->c, -0.1f, 0.1f);
    CHECK_OK(bie_layer_param(l, BIE_PARAM_BIAS_A, &bv));
    CHECK(bv.dtype == BIE_F32 && bie_tensor_numel(&bv) == g->c);
    put(&bv, bias);

    /* set_activation: scale_a measured on x, x_out = x + bias_a */
    float *x = tu_alloc((size_t)nx * sizeof(float)), *xo = tu_alloc((size_t)nx * sizeof(float));
    tu_fill(x, nx, -1.5f, 1.5f);
    for (int64_t i = 5; i < nx; i += 11)
        x[i] = -bias[(i / (g->h * g->w)) % g->c]; /* x' = 0: sign +1 */
    bie_tensor tx = dev_alloc(ci->dev, BIE_F32, xnd, xs),
               txo = dev_alloc(ci->dev, BIE_F32, xnd, xs);
    put(&tx, x);
    poison(&txo);
    CHECK_OK(bie_layer_set_activation(l, &tx, &txo));
    get(&txo, xo);
    int64_t shifted_bad = 0;
    for (int64_t i = 0; i < nx; i++) {
        const float want = ref_shifted(g, x, bias, i);
        shifted_bad += memcmp(&xo[i], &want, sizeof(float)) != 0;
    }
    CHECK(shifted_bad == 0);
    const float scale_a = read_scalar(l, BIE_PARAM_SCALE_A, false);
    CHECK(same_scale(scale_a, r->quant->scale_a(x, nx, ci->symmetric), on_cuda));

    /* references */
    float *expect = tu_alloc((size_t)no * sizeof(float)),
          *go = tu_alloc((size_t)no * sizeof(float));
    double *rgx = tu_alloc((size_t)nx * sizeof(double)),
           *rgw = tu_alloc((size_t)nw * sizeof(double));
    double *rgb = tu_alloc((size_t)g->c * sizeof(double)), rgs = 0, gs_tol = 0;
    tu_fill(go, no, -1, 1);
    ref_forward(g, r->quant, x, bias, wcode, scale_a, scale_w, expect);
    ref_backward(g, r->quant, x, bias, wcode, scale_a, scale_w, go, rgx, rgw, rgb, &rgs, &gs_tol);

    /* the default kernel, then every available kernel of the op on this device */
    bie_tensor tout = dev_alloc(ci->dev, BIE_F32, xnd, os),
               tg = dev_alloc(ci->dev, BIE_F32, xnd, os);
    bie_tensor tgx = dev_alloc(ci->dev, BIE_F32, xnd, xs);
    put(&tg, go);
    int kernels = 0;
    check_kernel(ci, l, -1, "default", &tx, &tout, &tg, &tgx, expect, rgx, rgw, rgb, rgs, gs_tol);
    check_grad_target(ci, l, &tx, &tout, &tg, &tgx);
    for (int i = 0; i < bie_kernel_count(); i++) {
        bie_kernel_info info;
        CHECK_OK(bie_kernel_get(i, &info));
        if (!info.available || info.op != r->op || info.device != ci->dev.type) continue;
        check_kernel(ci, l, info.id, info.name, &tx, &tout, &tg, &tgx, expect, rgx, rgw, rgb, rgs,
                     gs_tol);
        kernels++;
    }
    CHECK(kernels > 0);
    CHECK_OK(bie_layer_set_gemm_kernel(l, -1));

    /* inference from the packed weight alone equals training */
    float *out = tu_alloc((size_t)no * sizeof(float));
    CHECK_OK(bie_layer_set_training(l, false));
    CHECK_OK(bie_layer_generate_quantized_weight(l, true));
    CHECK(bie_layer_set_weight_grad_target(l, &tgx) == BIE_ERR_STATE); /* no training weight */
    poison(&tout);
    CHECK_OK(bie_layer_forward(l, &tx, &tout));
    get(&tout, out);
    CHECK(tu_same_bits(out, expect, no));
    if (!tu_same_bits(out, expect, no))
        fprintf(stderr, "  inference forward differs: %s\n", ci->what);

    bie_tensor_free(&tx), bie_tensor_free(&txo), bie_tensor_free(&tout), bie_tensor_free(&tg);
    bie_tensor_free(&tgx);
    bie_layer_free(l);
    free(w), free(bias), free(wcode), free(x), free(xo), free(expect), free(go), free(out);
    free(rgx), free(rgw), free(rgb);
}

static void run_device(bie_device dev) {
    static const int words[3] = {8, 32, 64};
    for (size_t r = 0; r < sizeof kinds / sizeof kinds[0]; r++) {
        const size_t count = kinds[r].conv ? sizeof conv_shapes / sizeof conv_shapes[0]
                                           : sizeof linear_shapes / sizeof linear_shapes[0];
        for (size_t s = 0; s < count; s++) {
            case_info ci = {
                .row = &kinds[r], .dev = dev, .symmetric = s % 2 == 0, .bits = words[s % 3]};
            ci.g = kinds[r].conv ? conv_shapes[s]
                                 : ref_linear_geom(linear_shapes[s][0], linear_shapes[s][1],
                                                   linear_shapes[s][2]);
            run_case(&ci);
        }
    }
}

int main(int argc, char **argv) {
    const bool require_cuda = argc > 1 && strcmp(argv[1], "--require-cuda") == 0;
    printf("kernel set: %s\n", bie_cpu_kernel_set());
    if (tu_forced_set_missing()) return TU_SKIP;
    tu_seed(20261125);
    run_device(bie_cpu());
    if (bie_cuda_device_count() > 0) {
        const bie_device cuda = {BIE_DEVICE_CUDA, 0};
        run_device(cuda);
    } else {
        printf("note: no CUDA device: the CUDA rows are skipped\n");
        CHECK(!require_cuda);
    }
    return tu_finish();
}
