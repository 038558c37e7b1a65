/* The training library's CUDA float kernels and optimizer steps (src/train/train_cuda.h)
 * against their CPU kernels (train_internal.h) on random data over many shapes (batch 1,
 * odd sizes, overlapping pooling windows, shapes that split the channel reductions):
 * float results within 1e-5 of the largest reference value, results the CPU decides
 * element by element (ReLU, PReLU, max-pool values and argmax, sign-flip weights, moments
 * and flip count, batch norm's running statistics and evaluation) equal bit for bit, Adam
 * within 1e-6. Every kernel runs twice into poisoned outputs and must give identical bits.
 * Then the public bie_adam_step / bie_signflip_init / bie_signflip_step on CUDA tensors
 * against the CPU (sign flips, state and counts bit for bit over many steps; a zero gradient
 * never flips), and mixed-device calls refused with nothing changed. Reports itself
 * skipped (77) without a GPU. Usage: test_cuda_train_kernels [--small] */
#include "bie_train.h"
#include "train_kernel_util.h"

#ifdef BIE_TEST_CUDA_INTERNALS

static int equal_i32(const char *what, const int32_t *got, const int32_t *expect, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (got[i] != expect[i]) {
            fprintf(stderr, "  %s: element %lld: %d vs %d\n", what, (long long)i, got[i],
                    expect[i]);
            return 0;
        }
    return 1;
}

/* ---- linear */

static void check_linear(int64_t m, int64_t in, int64_t out, int with_bias, int with_dx,
                         int with_db) {
    float *x = fvec(m * in), *w = fvec(out * in), *b = fvec(out), *dy = fvec(m * out);
    fill_signed(x, m * in);
    fill_signed(w, out * in);
    fill_signed(b, out);
    fill_signed(dy, m * out);
    float *y = fvec(m * out), *dx = fvec(m * in), *dw = fvec(out * in), *db = fvec(out);
    bie_linear_forward(x, m, in, out, w, with_bias ? b : NULL, y);
    bie_linear_backward(x, dy, m, in, out, w, with_dx ? dx : NULL, dw, with_db ? db : NULL);

    float *gx = dput(x, (size_t)(m * in) * 4), *gw = dput(w, (size_t)(out * in) * 4);
    float *gb = dput(b, (size_t)out * 4), *gdy = dput(dy, (size_t)(m * out) * 4);
    out_buf fo[1] = {out_make((size_t)(m * out) * 4, 1)};
    TWICE(fo, 1, NULL, 0,
          bie_cuda_linear_forward(gx, m, in, out, gw, with_bias ? gb : NULL, fo[0].dev),
          "linear forward");
    int ok = compare_close("linear y", fo[0].host[0], y, m * out, 1e-5);
    out_buf bo[3] = {out_make((size_t)(m * in) * 4, with_dx), out_make((size_t)(out * in) * 4, 1),
                     out_make((size_t)out * 4, with_db)};
    TWICE(bo, 3, NULL, 0,
          bie_cuda_linear_backward(gx, gdy, m, in, out, gw, bo[0].dev, bo[1].dev, bo[2].dev),
          "linear backward");
    if (with_dx) ok &= compare_close("linear dx", bo[0].host[0], dx, m * in, 1e-5);
    ok &= compare_close("linear dw", bo[1].host[0], dw, out * in, 1e-5);
    if (with_db) ok &= compare_close("linear db", bo[2].host[0], db, out, 1e-5);
    CHECK(ok);
    if (!ok)
        fprintf(stderr, "  linear m=%lld in=%lld out=%lld bias=%d dx=%d db=%d\n", (long long)m,
                (long long)in, (long long)out, with_bias, with_dx, with_db);
    out_free(&fo[0]);
    for (int i = 0; i < 3; i++) out_free(&bo[i]);
    bie_cuda_train_free(gx), bie_cuda_train_free(gw), bie_cuda_train_free(gb),
        bie_cuda_train_free(gdy);
    free(x), free(w), free(b), free(dy), free(y), free(dx), free(dw), free(db);
}

/* ---- ReLU and PReLU */

static void check_relu(int64_t n) {
    float *x = fvec(n), *dy = fvec(n), *y = fvec(n), *dx = fvec(n);
    fill_signed(x, n);
    fill_signed(dy, n);
    bie_relu_forward(x, n, y);
    bie_relu_backward(y, dy, n, dx);
    float *gx = dput(x, (size_t)n * 4), *gy = dput(y, (size_t)n * 4),
          *gdy = dput(dy, (size_t)n * 4);
    out_buf o[1] = {out_make((size_t)n * 4, 1)};
    TWICE(o, 1, NULL, 0, bie_cuda_relu_forward(gx, n, o[0].dev), "relu forward");
    int ok = compare_exact("relu y", o[0].host[0], y, n);
    TWICE(o, 1, NULL, 0, bie_cuda_relu_backward(gy, gdy, n, o[0].dev), "relu backward");
    ok &= compare_exact("relu dx", o[0].host[0], dx, n);
    CHECK(ok);
    if (!ok) fprintf(stderr, "  relu n=%lld\n", (long long)n);
    out_free(&o[0]);
    bie_cuda_train_free(gx), bie_cuda_train_free(gy), bie_cuda_train_free(gdy);
    free(x), free(dy), free(y), free(dx);
}

static void check_prelu(int64_t outer, int64_t channels, int64_t inner, int shared, int with_dx) {
    const int64_t n = outer * channels * inner, ns = shared ? 1 : channels;
    float *x = fvec(n), *dy = fvec(n), *sl = fvec(ns), *y = fvec(n), *dx = fvec(n), *ds = fvec(ns);
    fill_signed(x, n);
    fill_signed(dy, n);
    tu_fill(sl, ns, -0.5f, 0.5f);
    bie_prelu_forward(x, outer, channels, inner, sl, ns, y);
    bie_prelu_backward(x, dy, outer, channels, inner, sl, ns, with_dx ? dx : NULL, ds);
    float *gx = dput(x, (size_t)n * 4), *gdy = dput(dy, (size_t)n * 4),
          *gs = dput(sl, (size_t)ns * 4);
    out_buf fo[1] = {out_make((size_t)n * 4, 1)};
    TWICE(fo, 1, NULL, 0, bie_cuda_prelu_forward(gx, outer, channels, inner, gs, ns, fo[0].dev),
          "prelu forward");
    int ok = compare_exact("prelu y", fo[0].host[0], y, n);
    out_buf bo[2] = {out_make((size_t)n * 4, with_dx), out_make((size_t)ns * 4, 1)};
    TWICE(bo, 2, NULL, 0,
          bie_cuda_prelu_backward(gx, gdy, outer, channels, inner, gs, ns, bo[0].dev, bo[1].dev),
          "prelu backward");
    if (with_dx) ok &= compare_exact("prelu dx", bo[0].host[0], dx, n);
    ok &= compare_close("prelu dslopes", bo[1].host[0], ds, ns, 1e-5);
    CHECK(ok);
    if (!ok)
        fprintf(stderr, "  prelu %lld x %lld x %lld shared=%d\n", (long long)outer,
                (long long)channels, (long long)inner, shared);
    out_free(&fo[0]);
    out_free(&bo[0]), out_free(&bo[1]);
    bie_cuda_train_free(gx), bie_cuda_train_free(gdy), bie_cuda_train_free(gs);
    free(x), free(dy), free(sl), free(y), free(dx), free(ds);
}

/* ---- max-pool */

static void check_maxpool(int64_t planes, int64_t h, int64_t w, int k, int s) {
    const int64_t oh = (h - k) / s + 1, ow = (w - k) / s + 1, n = planes * h * w,
                  no = planes * oh * ow;
    float *x = fvec(n), *dy = fvec(no), *y = fvec(no), *dx = fvec(n);
    int32_t *am = tu_alloc((size_t)no * 4);
    /* few distinct values: ties, where the first maximum must win */
    for (int64_t i = 0; i < n; i++) x[i] = (float)((int)(tu_next() % 9) - 4) * 0.25f;
    fill_signed(dy, no);
    bie_maxpool_forward(x, planes, h, w, k, s, oh, ow, y, am);
    bie_maxpool_backward(dy, am, planes, h, w, oh, ow, dx);
    float *gx = dput(x, (size_t)n * 4), *gdy = dput(dy, (size_t)no * 4);
    int32_t *gam = dput(am, (size_t)no * 4);
    out_buf fo[2] = {out_make((size_t)no * 4, 1), out_make((size_t)no * 4, 1)};
    TWICE(fo, 2, NULL, 0,
          bie_cuda_maxpool_forward(gx, planes, h, w, k, s, oh, ow, fo[0].dev, fo[1].dev),
          "maxpool forward");
    int ok = compare_exact("maxpool y", fo[0].host[0], y, no);
    ok &= equal_i32("maxpool argmax", fo[1].host[0], am, no);
    TWICE(fo, 1, NULL, 0, bie_cuda_maxpool_forward(gx, planes, h, w, k, s, oh, ow, fo[0].dev, NULL),
          "maxpool forward (evaluation)");
    ok &= compare_exact("maxpool y (no argmax)", fo[0].host[0], y, no);
    out_buf bo[1] = {out_make((size_t)n * 4, 1)};
    TWICE(bo, 1, NULL, 0, bie_cuda_maxpool_backward(gdy, gam, planes, h, w, oh, ow, bo[0].dev),
          "maxpool backward");
    ok &= compare_exact("maxpool dx", bo[0].host[0], dx, n);
    CHECK(ok);
    if (!ok)
        fprintf(stderr, "  maxpool planes=%lld %lldx%lld k=%d s=%d\n", (long long)planes,
                (long long)h, (long long)w, k, s);
    out_free(&fo[0]), out_free(&fo[1]), out_free(&bo[0]);
    bie_cuda_train_free(gx), bie_cuda_train_free(gdy), bie_cuda_train_free(gam);
    free(x), free(dy), free(y), free(dx), free(am);
}

/* ---- batch norm */

static void check_batchnorm(int64_t n, int64_t c, int64_t inner, int with_dx) {
    const int64_t total = n * c * inner;
    float *x = fvec(total), *dy = fvec(total), *gamma = fvec(c), *beta = fvec(c);
    /* an offset per channel: the variance pass must not lose it */
    for (int64_t i = 0; i < total; i++)
        x[i] = tu_uniform(-1.0f, 1.0f) * 2.0f + (float)((i / inner) % c % 5);
    fill_signed(dy, total);
    tu_fill(gamma, c, 0.5f, 1.5f);
    tu_fill(beta, c, -0.5f, 0.5f);
    const float eps = 1e-5f, momentum = 0.1f;
    float *y = fvec(total), *xhat = fvec(total), *is = fvec(c), *bm = fvec(c), *bv = fvec(c);
    bie_batchnorm_forward_train(x, n, c, inner, gamma, beta, eps, y, xhat, is, bm, bv);
    float *gx = dput(x, (size_t)total * 4), *gdy = dput(dy, (size_t)total * 4);
    float *gg = dput(gamma, (size_t)c * 4), *gb = dput(beta, (size_t)c * 4);
    out_buf fo[5] = {out_make((size_t)total * 4, 1), out_make((size_t)total * 4, 1),
                     out_make((size_t)c * 4, 1), out_make((size_t)c * 4, 1),
                     out_make((size_t)c * 4, 1)};
    TWICE(fo, 5, NULL, 0,
          bie_cuda_batchnorm_forward_train(gx, n, c, inner, gg, gb, eps, fo[0].dev, fo[1].dev,
                                           fo[2].dev, fo[3].dev, fo[4].dev),
          "batchnorm forward");
    int ok = compare_close("bn y", fo[0].host[0], y, total, 1e-5);
    ok &= compare_close("bn xhat", fo[1].host[0], xhat, total, 1e-5);
    ok &= compare_close("bn invstd", fo[2].host[0], is, c, 1e-5);
    ok &= compare_close("bn batch_mean", fo[3].host[0], bm, c, 1e-5);
    ok &= compare_close("bn batch_var", fo[4].host[0], bv, c, 1e-5);

    /* running statistics from the CPU's batch statistics: exact */
    float *rm = fvec(c), *rv = fvec(c), *rm0 = fvec(c), *rv0 = fvec(c);
    tu_fill(rm0, c, -1.0f, 1.0f);
    tu_fill(rv0, c, 0.5f, 2.0f);
    memcpy(rm, rm0, (size_t)c * 4), memcpy(rv, rv0, (size_t)c * 4);
    bie_batchnorm_update_running(c, momentum, bm, bv, rm, rv);
    float *gbm = dput(bm, (size_t)c * 4), *gbv = dput(bv, (size_t)c * 4);
    float *grm = dput(rm0, (size_t)c * 4), *grv = dput(rv0, (size_t)c * 4);
    CHECK_OK(bie_cuda_batchnorm_update_running(c, momentum, gbm, gbv, grm, grv));
    float *got = fvec(c);
    dget(got, grm, (size_t)c * 4);
    ok &= compare_exact("bn running_mean", got, rm, c);
    dget(got, grv, (size_t)c * 4);
    ok &= compare_exact("bn running_var", got, rv, c);

    /* evaluation: exact */
    float *ye = fvec(total);
    bie_batchnorm_forward_eval(x, n, c, inner, gamma, beta, eps, rm, rv, ye);
    out_buf eo[1] = {out_make((size_t)total * 4, 1)};
    TWICE(eo, 1, NULL, 0,
          bie_cuda_batchnorm_forward_eval(gx, n, c, inner, gg, gb, eps, grm, grv, eo[0].dev),
          "batchnorm eval");
    ok &= compare_exact("bn eval y", eo[0].host[0], ye, total);

    /* backward from the CPU's saved xhat and invstd */
    float *dx = fvec(total), *dg = fvec(c), *dbt = fvec(c);
    bie_batchnorm_backward(xhat, is, dy, n, c, inner, gamma, with_dx ? dx : NULL, dg, dbt);
    float *gxh = dput(xhat, (size_t)total * 4), *gis = dput(is, (size_t)c * 4);
    out_buf bo[3] = {out_make((size_t)total * 4, with_dx), out_make((size_t)c * 4, 1),
                     out_make((size_t)c * 4, 1)};
    TWICE(bo, 3, NULL, 0,
          bie_cuda_batchnorm_backward(gxh, gis, gdy, n, c, inner, gg, bo[0].dev, bo[1].dev,
                                      bo[2].dev),
          "batchnorm backward");
    if (with_dx) ok &= compare_close("bn dx", bo[0].host[0], dx, total, 1e-5);
    ok &= compare_close("bn dgamma", bo[1].host[0], dg, c, 1e-5);
    ok &= compare_close("bn dbeta", bo[2].host[0], dbt, c, 1e-5);
    CHECK(ok);
    if (!ok)
        fprintf(stderr, "  batchnorm n=%lld c=%lld inner=%lld\n", (long long)n, (long long)c,
                (long long)inner);
    for (int i = 0; i < 5; i++) out_free(&fo[i]);
    for (int i = 0; i < 3; i++) out_free(&bo[i]);
    out_free(&eo[0]);
    bie_cuda_train_free(gx), bie_cuda_train_free(gdy), bie_cuda_train_free(gg),
        bie_cuda_train_free(gb);
    bie_cuda_train_free(gbm), bie_cuda_train_free(gbv), bie_cuda_train_free(grm),
        bie_cuda_train_free(grv);
    bie_cuda_train_free(gxh), bie_cuda_train_free(gis);
    free(x), free(dy), free(gamma), free(beta), free(y), free(xhat), free(is), free(bm), free(bv);
    free(rm), free(rv), free(rm0), free(rv0), free(got), free(ye), free(dx), free(dg), free(dbt);
}

/* ---- optimizer steps through the internal entry points */

static int close_rel(const char *what, const float *got, const float *ref, int64_t n, double tol) {
    for (int64_t i = 0; i < n; i++)
        if (!(fabs((double)got[i] - ref[i]) <= tol * fabs(ref[i]) + 1e-12)) {
            fprintf(stderr, "  %s: element %lld: %.9g vs %.9g\n", what, (long long)i,
                    (double)got[i], (double)ref[i]);
            return 0;
        }
    return 1;
}

static void check_adam_kernel(int64_t n, int variant) {
    bie_adam_options o = bie_adam_defaults();
    o.lr = 0.01f;
    if (variant == 1) o.weight_decay = 0.05f; /* Adam with L2 */
    if (variant == 2) {                       /* AdamW */
        o.weight_decay = 0.1f;
        o.decoupled = true;
    }
    float *p = fvec(n), *m = fvec(n), *v = fvec(n), *g = fvec(3 * n);
    fill_signed(p, n);
    memset(m, 0, (size_t)n * 4), memset(v, 0, (size_t)n * 4);
    fill_signed(g, 3 * n);
    float *gp = dput(p, (size_t)n * 4), *gm = dput(m, (size_t)n * 4), *gv = dput(v, (size_t)n * 4);
    float *gg = dput(g, (size_t)(3 * n) * 4);
    /* a second device state, stepped the same way: the two must agree bit for bit */
    float *gp2 = dput(p, (size_t)n * 4), *gm2 = dput(m, (size_t)n * 4),
          *gv2 = dput(v, (size_t)n * 4);
    int64_t shape[1] = {n};
    bie_tensor tp, tm, tv, tg;
    CHECK_OK(bie_tensor_view(&tp, p, BIE_F32, 1, shape));
    CHECK_OK(bie_tensor_view(&tm, m, BIE_F32, 1, shape));
    CHECK_OK(bie_tensor_view(&tv, v, BIE_F32, 1, shape));
    int ok = 1;
    float *got = fvec(n), *got2 = fvec(n);
    for (int64_t step = 1; step <= 3; step++) {
        CHECK_OK(bie_tensor_view(&tg, g + (step - 1) * n, BIE_F32, 1, shape));
        CHECK_OK(bie_adam_step(&tp, &tg, &tm, &tv, step, &o));
        CHECK_OK(bie_cuda_adam_step(gp, gg + (step - 1) * n, gm, gv, n, step, &o));
        CHECK_OK(bie_cuda_adam_step(gp2, gg + (step - 1) * n, gm2, gv2, n, step, &o));
        dget(got, gp, (size_t)n * 4), dget(got2, gp2, (size_t)n * 4);
        ok &= close_rel("adam p", got, p, n, 1e-6) && same_bits("adam p", got, got2, (size_t)n * 4);
        dget(got, gm, (size_t)n * 4), dget(got2, gm2, (size_t)n * 4);
        ok &= close_rel("adam m", got, m, n, 1e-6) && same_bits("adam m", got, got2, (size_t)n * 4);
        dget(got, gv, (size_t)n * 4), dget(got2, gv2, (size_t)n * 4);
        ok &= close_rel("adam v", got, v, n, 1e-6) && same_bits("adam v", got, got2, (size_t)n * 4);
    }
    CHECK(ok);
    if (!ok) fprintf(stderr, "  adam n=%lld variant %d\n", (long long)n, variant);
    bie_cuda_train_free(gp), bie_cuda_train_free(gm), bie_cuda_train_free(gv),
        bie_cuda_train_free(gg);
    bie_cuda_train_free(gp2), bie_cuda_train_free(gm2), bie_cuda_train_free(gv2);
    free(p), free(m), free(v), free(g), free(got), free(got2);
}

static void fill_weights_i8(int8_t *w, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const uint64_t r = tu_next();
        w[i] = r % 8 == 0 ? 0 : r % 8 == 1 ? INT8_MIN : r % 8 == 2 ? INT8_MAX : (int8_t)(r >> 56);
    }
}

static void check_signflip_kernel(int64_t n, int int8_grad) {
    const float lr = 0.01f, b1 = 0.9f, b2 = 0.99f;
    int8_t *w = tu_alloc((size_t)n), *g8 = tu_alloc((size_t)(3 * n));
    float *gf = fvec(3 * n), *m = fvec(n), *v = fvec(n);
    fill_weights_i8(w, n);
    fill_weights_i8(g8, 3 * n);
    fill_signed(gf, 3 * n);
    /* moments near the decision boundaries, with exact zeros */
    for (int64_t i = 0; i < n; i++) {
        m[i] = (tu_next() % 8 == 0) ? 0.0f : tu_uniform(-0.05f, 0.05f);
        v[i] = (tu_next() % 8 == 0) ? 0.0f : tu_uniform(-0.002f, 0.002f);
    }
    int8_t *gw[2];
    float *gm[2], *gv[2];
    for (int r = 0; r < 2; r++)
        gw[r] = dput(w, (size_t)n), gm[r] = dput(m, (size_t)n * 4), gv[r] = dput(v, (size_t)n * 4);
    int8_t *gg8 = dput(g8, (size_t)(3 * n));
    float *ggf = dput(gf, (size_t)(3 * n) * 4);
    int64_t shape[1] = {n};
    bie_tensor tw, tm, tv, tg;
    CHECK_OK(bie_tensor_view(&tw, w, BIE_I8, 1, shape));
    CHECK_OK(bie_tensor_view(&tm, m, BIE_F32, 1, shape));
    CHECK_OK(bie_tensor_view(&tv, v, BIE_F32, 1, shape));
    int ok = 1;
    int8_t *gotw = tu_alloc((size_t)n);
    float *got = fvec(n);
    int64_t total_flips = 0;
    for (int step = 0; step < 3; step++) {
        const int64_t off = step * n;
        if (int8_grad)
            CHECK_OK(bie_tensor_view(&tg, g8 + off, BIE_I8, 1, shape));
        else
            CHECK_OK(bie_tensor_view(&tg, gf + off, BIE_F32, 1, shape));
        int64_t flips = -1, got_flips[2] = {-2, -3};
        CHECK_OK(bie_signflip_step(&tw, &tg, &tm, &tv, lr, b1, b2, &flips));
        for (int r = 0; r < 2; r++)
            CHECK_OK(bie_cuda_signflip_step(gw[r], int8_grad ? gg8 + off : NULL,
                                            int8_grad ? NULL : ggf + off, gm[r], gv[r], n, lr, b1,
                                            b2, r == 0 || step == 1 ? &got_flips[r] : NULL));
        if (got_flips[0] != flips)
            fprintf(stderr, "  flip count %lld vs %lld\n", (long long)got_flips[0],
                    (long long)flips);
        ok &= got_flips[0] == flips;
        if (step == 1) ok &= got_flips[1] == flips;
        total_flips += flips;
        for (int r = 0; r < 2; r++) {
            dget(gotw, gw[r], (size_t)n);
            if (memcmp(gotw, w, (size_t)n) != 0)
                fprintf(stderr, "  signflip weights differ (run %d)\n", r);
            ok &= memcmp(gotw, w, (size_t)n) == 0;
            dget(got, gm[r], (size_t)n * 4);
            ok &= compare_exact("signflip m", got, m, n);
            dget(got, gv[r], (size_t)n * 4);
            ok &= compare_exact("signflip v", got, v, n);
        }
    }
    if (n >= 100) CHECK(total_flips > 0); /* the data must exercise flips */
    CHECK(ok);
    if (!ok) fprintf(stderr, "  signflip n=%lld int8 grad=%d\n", (long long)n, int8_grad);
    for (int r = 0; r < 2; r++)
        bie_cuda_train_free(gw[r]), bie_cuda_train_free(gm[r]), bie_cuda_train_free(gv[r]);
    bie_cuda_train_free(gg8), bie_cuda_train_free(ggf);
    free(w), free(g8), free(gf), free(m), free(v), free(gotw), free(got);
}
#endif /* BIE_TEST_CUDA_INTERNALS */

/* ---- the public steps on CUDA tensors */

static bie_tensor cuda_from(const void *host, bie_dtype dt, int64_t n) {
    int64_t shape[1] = {n};
    bie_tensor d, h;
    CHECK_OK(bie_cuda_tensor_alloc(&d, dt, 1, shape, 0));
    CHECK_OK(bie_tensor_view(&h, (void *)host, dt, 1, shape));
    CHECK_OK(bie_tensor_copy(&d, &h));
    return d;
}

static void to_host(void *host, const bie_tensor *d) {
    bie_tensor h = *d;
    h.data = host;
    h.device = bie_cpu();
    h.owns_data = false;
    CHECK_OK(bie_tensor_copy(&h, d));
}

static void check_public_adam(int64_t n) {
    bie_adam_options o = bie_adam_defaults();
    o.lr = 0.02f;
    o.weight_decay = 0.01f;
    o.decoupled = true;
    float *p = fvec(n), *g = fvec(n), *m = fvec(n), *v = fvec(n), *got = fvec(n);
    fill_signed(p, n);
    fill_signed(g, n);
    memset(m, 0, (size_t)n * 4), memset(v, 0, (size_t)n * 4);
    bie_tensor dp = cuda_from(p, BIE_F32, n), dg = cuda_from(g, BIE_F32, n);
    bie_tensor dm = cuda_from(m, BIE_F32, n), dv = cuda_from(v, BIE_F32, n);
    int64_t shape[1] = {n};
    bie_tensor hp, hg, hm, hv;
    CHECK_OK(bie_tensor_view(&hp, p, BIE_F32, 1, shape));
    CHECK_OK(bie_tensor_view(&hg, g, BIE_F32, 1, shape));
    CHECK_OK(bie_tensor_view(&hm, m, BIE_F32, 1, shape));
    CHECK_OK(bie_tensor_view(&hv, v, BIE_F32, 1, shape));

    /* mixed devices: refused before anything changes */
    float *before = fvec(n);
    to_host(before, &dp);
    CHECK(bie_adam_step(&dp, &hg, &dm, &dv, 1, &o) == BIE_ERR_DEVICE);
    CHECK(bie_adam_step(&dp, &dg, &dm, &hv, 1, &o) == BIE_ERR_DEVICE);
    CHECK(bie_adam_step(&hp, &hg, &dm, &hv, 1, &o) == BIE_ERR_DEVICE);
    bie_tensor wrong = dg;
    wrong.device.index = 1; /* another device's tensor (need not exist) */
    CHECK(bie_adam_step(&dp, &wrong, &dm, &dv, 1, &o) == BIE_ERR_DEVICE);
    to_host(got, &dp);
    CHECK(memcmp(got, before, (size_t)n * 4) == 0);
    to_host(got, &dm);
    CHECK(memcmp(got, m, (size_t)n * 4) == 0);
    CHECK(memcmp(before, p, (size_t)n * 4) == 0);

    for (int64_t step = 1; step <= 2; step++) {
        CHECK_OK(bie_adam_step(&hp, &hg, &hm, &hv, step, &o));
        CHECK_OK(bie_adam_step(&dp, &dg, &dm, &dv, step, &o));
        CHECK_OK(bie_cuda_synchronize());
        to_host(got, &dp);
        int ok = 1;
        for (int64_t i = 0; i < n; i++)
            ok &= fabs((double)got[i] - p[i]) <= 1e-6 * fabs(p[i]) + 1e-12;
        CHECK(ok);
        to_host(got, &dv);
        ok = 1;
        for (int64_t i = 0; i < n; i++)
            ok &= fabs((double)got[i] - v[i]) <= 1e-6 * fabs(v[i]) + 1e-12;
        CHECK(ok);
    }
    bie_tensor_free(&dp), bie_tensor_free(&dg), bie_tensor_free(&dm), bie_tensor_free(&dv);
    free(p), free(g), free(m), free(v), free(got), free(before);
}

/* bie_signflip_init on CUDA tensors gives the CPU's state bit for bit; then `steps` steps
 * (int8 gradients, exact zeros, every 5th element's always 0) give the CPU's weights, flip
 * counts and moments bit for bit, and the weights whose gradient stayed 0 never flip. */
static void check_public_signflip(int64_t n, int steps, float lr, float b1, float b2) {
    int8_t *w = tu_alloc((size_t)n), *g = tu_alloc((size_t)n), *gotw = tu_alloc((size_t)n);
    float *m = fvec(n), *v = fvec(n), *got = fvec(n);
    memset(g, 0, (size_t)n);
    for (int64_t i = 0; i < n; i++) {
        w[i] = (int8_t)(tu_next() >> 56);
        m[i] = tu_uniform(-0.05f, 0.05f);
        v[i] = tu_uniform(-0.002f, 0.002f);
    }
    bie_tensor dw = cuda_from(w, BIE_I8, n), dg = cuda_from(g, BIE_I8, n);
    bie_tensor dm = cuda_from(m, BIE_F32, n), dv = cuda_from(v, BIE_F32, n);
    int64_t shape[1] = {n};
    bie_tensor hw, hg, hm, hv;
    CHECK_OK(bie_tensor_view(&hw, w, BIE_I8, 1, shape));
    CHECK_OK(bie_tensor_view(&hg, g, BIE_I8, 1, shape));
    CHECK_OK(bie_tensor_view(&hm, m, BIE_F32, 1, shape));
    CHECK_OK(bie_tensor_view(&hv, v, BIE_F32, 1, shape));

    int8_t *w0 = tu_alloc((size_t)n);
    memcpy(w0, w, (size_t)n);
    int64_t flips = -7;
    CHECK(bie_signflip_step(&dw, &hg, &dm, &dv, lr, b1, b2, &flips) == BIE_ERR_DEVICE);
    CHECK(bie_signflip_step(&hw, &hg, &dm, &hv, lr, b1, b2, &flips) == BIE_ERR_DEVICE);
    CHECK(bie_signflip_step(&dw, &dg, &dm, &hv, lr, b1, b2, &flips) == BIE_ERR_DEVICE);
    CHECK(bie_signflip_init(&dw, &dm, &hv, 9) == BIE_ERR_DEVICE);
    CHECK(bie_signflip_init(&hw, &dm, &dv, 9) == BIE_ERR_DEVICE);
    CHECK(flips == -7);
    CHECK(memcmp(w, w0, (size_t)n) == 0);
    to_host(gotw, &dw);
    CHECK(memcmp(gotw, w0, (size_t)n) == 0);
    to_host(got, &dm);
    CHECK(memcmp(got, m, (size_t)n * 4) == 0);
    to_host(got, &dv);
    CHECK(memcmp(got, v, (size_t)n * 4) == 0);

    /* the initial state: m = 0, v = -sign(w) * delta, the same bits on both devices */
    CHECK_OK(bie_signflip_init(&hw, &hm, &hv, 9));
    CHECK_OK(bie_signflip_init(&dw, &dm, &dv, 9));
    to_host(got, &dv);
    CHECK(memcmp(got, v, (size_t)n * 4) == 0);
    to_host(got, &dm);
    CHECK(memcmp(got, m, (size_t)n * 4) == 0);
    int bad = 0;
    for (int64_t i = 0; i < n; i++)
        bad += m[i] != 0.0f ||
               (w[i] < 0 ? !(v[i] > 0 && v[i] <= 1e-3f) : !(v[i] < 0 && v[i] >= -1e-3f));
    CHECK(bad == 0);

    int same = 1;
    int64_t total = 0;
    for (int step = 0; step < steps; step++) {
        for (int64_t i = 0; i < n; i++) {
            const uint64_t r = tu_next();
            g[i] = i % 5 == 2 || r % 8 == 0 ? 0 : (int8_t)(r >> 56);
        }
        bie_tensor dgs = cuda_from(g, BIE_I8, n);
        int64_t cpu_flips = -1, gpu_flips = -2;
        CHECK_OK(bie_signflip_step(&hw, &hg, &hm, &hv, lr, b1, b2, &cpu_flips));
        const int count = step % 3 != 0; /* and without the count (asynchronous) */
        CHECK_OK(bie_signflip_step(&dw, &dgs, &dm, &dv, lr, b1, b2, count ? &gpu_flips : NULL));
        CHECK_OK(bie_cuda_synchronize());
        if (count) same &= gpu_flips == cpu_flips;
        total += cpu_flips;
        to_host(gotw, &dw);
        same &= memcmp(gotw, w, (size_t)n) == 0;
        to_host(got, &dv);
        same &= memcmp(got, v, (size_t)n * 4) == 0;
        to_host(got, &dm);
        same &= memcmp(got, m, (size_t)n * 4) == 0;
        bie_tensor_free(&dgs);
    }
    CHECK(same);
    CHECK(total > 0);
    int dead = 0;
    for (int64_t i = 2; i < n; i += 5) dead += w[i] != w0[i];
    CHECK(dead == 0);
    bie_tensor_free(&dw), bie_tensor_free(&dg), bie_tensor_free(&dm), bie_tensor_free(&dv);
    free(w), free(g), free(gotw), free(m), free(v), free(got), free(w0);
}

/* Gradients exactly 0 from the start: on CUDA not one flip in 1000 steps. */
static void check_public_zero_grad(int64_t n) {
    int8_t *w = tu_alloc((size_t)n), *g = tu_alloc((size_t)n), *gotw = tu_alloc((size_t)n);
    for (int64_t i = 0; i < n; i++) w[i] = (int8_t)(tu_next() >> 56);
    memset(g, 0, (size_t)n);
    float *zeros = fvec(n);
    memset(zeros, 0, (size_t)n * 4);
    bie_tensor dw = cuda_from(w, BIE_I8, n), dg = cuda_from(g, BIE_I8, n);
    bie_tensor dm = cuda_from(zeros, BIE_F32, n), dv = cuda_from(zeros, BIE_F32, n);
    CHECK_OK(bie_signflip_init(&dw, &dm, &dv, 3));
    int64_t total = 0;
    for (int step = 0; step < 1000; step++) {
        int64_t flips = -1;
        CHECK_OK(bie_signflip_step(&dw, &dg, &dm, &dv, 1e-4f, 0.99f, 0.9999f,
                                   step % 100 == 99 ? &flips : NULL));
        if (step % 100 == 99) total += flips;
    }
    to_host(gotw, &dw);
    CHECK(total == 0);
    CHECK(memcmp(gotw, w, (size_t)n) == 0);
    bie_tensor_free(&dw), bie_tensor_free(&dg), bie_tensor_free(&dm), bie_tensor_free(&dv);
    free(w), free(g), free(gotw), free(zeros);
}

/* bie_softmax_cross_entropy_accumulate on CUDA tensors against the CPU's: the gradient within
 * 1e-6 / n (its entries are at most 1 / n), the loss total within 1e-9 relative, correct and
 * non-finite rows exactly, totals added to what the device's sums held; labels from the host
 * and from the device; the gradient poisoned before, and overwriting the logits; a device
 * label out of range counted with a zero gradient row and the other rows unchanged. */
static bie_tensor as_matrix(bie_tensor t, int64_t rows, int64_t cols) {
    t.ndim = 2, t.shape[0] = rows, t.shape[1] = cols;
    return t;
}

static int grads_close(const float *got, const float *want, int64_t n, int64_t rows) {
    for (int64_t i = 0; i < n; i++)
        if (!(fabs((double)got[i] - want[i]) <= 1e-6 / (double)rows)) {
            fprintf(stderr, "  cross-entropy grad %lld: %g vs %g\n", (long long)i, got[i], want[i]);
            return 0;
        }
    return 1;
}

static void check_public_cross_entropy(int64_t n, int64_t c) {
    const int64_t nc = n * c, zs[2] = {n, c}, ls[1] = {n}, three = 3;
    float *z = fvec(nc), *want = fvec(nc), *got = fvec(nc), *poison = fvec(nc);
    int32_t *lab = tu_alloc((size_t)n * 4);
    for (int64_t i = 0; i < nc; i++) z[i] = 4.0f * tu_uniform(-1.0f, 1.0f);
    for (int64_t i = 0; i < n; i++) lab[i] = (int32_t)(tu_next() % (uint64_t)c);
    if (n > 2) z[(n / 2) * c + c / 2] = NAN; /* one non-finite row */
    tu_poison(poison, nc);
    double hsums[3] = {0.25, 3, 0}, dsums[3] = {0.25, 3, 0}, first[3];
    bie_tensor hz, hw, hl, hs;
    CHECK_OK(bie_tensor_view(&hz, z, BIE_F32, 2, zs));
    CHECK_OK(bie_tensor_view(&hw, want, BIE_F32, 2, zs));
    CHECK_OK(bie_tensor_view(&hl, lab, BIE_I32, 1, ls));
    CHECK_OK(bie_tensor_view(&hs, hsums, BIE_F64, 1, &three));
    CHECK_OK(bie_softmax_cross_entropy_accumulate(&hz, &hl, &hw, &hs));

    bie_tensor dz = as_matrix(cuda_from(z, BIE_F32, nc), n, c);
    bie_tensor dg = as_matrix(cuda_from(poison, BIE_F32, nc), n, c);
    bie_tensor dl = cuda_from(lab, BIE_I32, n), ds = cuda_from(dsums, BIE_F64, 3);
    /* labels from the host */
    CHECK_OK(bie_softmax_cross_entropy_accumulate(&dz, &hl, &dg, &ds));
    to_host(got, &dg);
    to_host(dsums, &ds);
    CHECK(grads_close(got, want, nc, n));
    CHECK(fabs(dsums[0] - hsums[0]) <= 1e-9 * fabs(hsums[0]));
    CHECK(dsums[1] == hsums[1] && dsums[2] == hsums[2] && dsums[2] == (n > 2));
    memcpy(first, dsums, sizeof first);
    /* labels on the device, the gradient over the logits: the same gradient, totals added */
    CHECK_OK(bie_softmax_cross_entropy_accumulate(&dz, &dl, &dz, &ds));
    to_host(got, &dz);
    to_host(dsums, &ds);
    CHECK(grads_close(got, want, nc, n));
    CHECK(fabs((dsums[0] - first[0]) - (first[0] - 0.25)) <= 1e-9 * fabs(first[0]));
    CHECK(dsums[1] - first[1] == first[1] - 3 && dsums[2] == 2 * first[2]);
    /* a device label out of range: counted, its row zero, the others as before */
    bie_tensor dz2 = as_matrix(cuda_from(z, BIE_F32, nc), n, c);
    lab[0] = (int32_t)(n % 2 ? c : -1);
    bie_tensor dl_bad = cuda_from(lab, BIE_I32, n);
    memcpy(first, dsums, sizeof first);
    CHECK_OK(bie_softmax_cross_entropy_accumulate(&dz2, &dl_bad, &dg, &ds));
    to_host(got, &dg);
    to_host(dsums, &ds);
    int zero = 1;
    for (int64_t j = 0; j < c; j++) zero &= got[j] == 0.0f;
    CHECK(zero && dsums[2] == first[2] + 1 + (n > 2));
    CHECK(grads_close(got + c, want + c, nc - c, n));
    /* the host labels out of range: refused, nothing queued */
    memcpy(first, dsums, sizeof first);
    CHECK(bie_softmax_cross_entropy_accumulate(&dz2, &hl, &dg, &ds) == BIE_ERR_INVALID_ARGUMENT);
    bie_tensor hs_wrong = hs;
    CHECK(bie_softmax_cross_entropy_accumulate(&dz2, &dl, &dg, &hs_wrong) == BIE_ERR_DEVICE);
    CHECK(bie_softmax_cross_entropy_accumulate(&dz2, &dl, &hw, &ds) == BIE_ERR_DEVICE);
    to_host(dsums, &ds);
    CHECK(memcmp(first, dsums, sizeof first) == 0);
    bie_tensor_free(&dz), bie_tensor_free(&dz2), bie_tensor_free(&dg), bie_tensor_free(&dl);
    bie_tensor_free(&dl_bad), bie_tensor_free(&ds);
    free(z), free(want), free(got), free(poison), free(lab);
}

/* bie_clamp_min_scaled on CUDA tensors: the CPU's result bit for bit (NaN kept). */
static void check_public_clamp(int64_t n) {
    float *x = fvec(n), *f = fvec(n), *got = fvec(n);
    fill_signed(x, n);
    fill_signed(f, n);
    x[n / 2] = NAN;
    bie_tensor dx = cuda_from(x, BIE_F32, n), df = cuda_from(f, BIE_F32, n), hx, hf;
    int64_t shape[1] = {n};
    CHECK_OK(bie_tensor_view(&hx, x, BIE_F32, 1, shape));
    CHECK_OK(bie_tensor_view(&hf, f, BIE_F32, 1, shape));
    CHECK_OK(bie_clamp_min_scaled(&hx, &hf, 0.5f));
    CHECK_OK(bie_clamp_min_scaled(&dx, &df, 0.5f));
    to_host(got, &dx);
    CHECK(memcmp(got, x, (size_t)n * 4) == 0);
    CHECK(bie_clamp_min_scaled(&dx, &hf, 0.5f) == BIE_ERR_DEVICE);
    bie_tensor_free(&dx), bie_tensor_free(&df);
    free(x), free(f), free(got);
}

int main(int argc, char **argv) {
    /* --small: a few small shapes, for runs under compute-sanitizer */
    const int small = argc > 1 && strcmp(argv[1], "--small") == 0;
    if (gpu_missing()) return TU_SKIP;
    tu_seed(2024);
#ifdef BIE_TEST_CUDA_INTERNALS
    const int64_t lin[][3] = {{1, 1, 1},       {1, 7, 3},       {2, 5, 1},     {3, 1, 4},
                              {17, 33, 9},     {64, 100, 10},   {5, 257, 129}, {1, 1000, 1},
                              {128, 784, 256}, {256, 512, 513}, {1000, 3, 7}};
    const size_t nlin = small ? 4 : sizeof lin / sizeof lin[0];
    for (size_t i = 0; i < nlin; i++)
        for (int variant = 0; variant < 3; variant++)
            check_linear(lin[i][0], lin[i][1], lin[i][2], variant != 1, variant != 2, variant != 2);

    const int64_t relu_n[] = {1, 7, 1000, 65537, (1 << 20) + 3};
    for (size_t i = 0; i < (small ? 3 : 5); i++) check_relu(relu_n[i]);

    const int64_t pre[][3] = {{1, 1, 1},    {2, 3, 5},    {1, 16, 1},  {7, 5, 13},   {32, 64, 64},
                              {3, 1, 1000}, {8, 4, 8192}, {2, 600, 3}, {64, 3, 4096}};
    const size_t npre = small ? 4 : sizeof pre / sizeof pre[0];
    for (size_t i = 0; i < npre; i++)
        for (int shared = 0; shared < 2; shared++)
            check_prelu(pre[i][0], pre[i][1], pre[i][2], shared, !shared || i % 2);

    const int64_t pool[][5] = {{1, 1, 1, 1, 1},    {1, 2, 2, 2, 2},    {3, 5, 7, 2, 2},
                               {2, 7, 7, 3, 1},    {5, 9, 8, 3, 2},    {64, 32, 32, 2, 2},
                               {4, 33, 17, 3, 2},  {1, 40, 40, 5, 3},  {2, 9, 9, 2, 3},
                               {33, 70, 70, 3, 1}, {512, 16, 16, 2, 2}};
    const size_t npool = small ? 5 : sizeof pool / sizeof pool[0];
    for (size_t i = 0; i < npool; i++)
        check_maxpool(pool[i][0], pool[i][1], pool[i][2], (int)pool[i][3], (int)pool[i][4]);

    const int64_t bn[][3] = {{2, 1, 1},     {2, 3, 1},      {1, 3, 5},     {1, 4, 1},
                             {2, 5, 7},     {3, 17, 1},     {8, 16, 64},   {2, 600, 1},
                             {32, 8, 1024}, {128, 3, 1024}, {256, 513, 1}, {2, 70000, 1}};
    const size_t nbn = small ? 5 : sizeof bn / sizeof bn[0];
    for (size_t i = 0; i < nbn; i++) check_batchnorm(bn[i][0], bn[i][1], bn[i][2], i % 3 != 2);

    const int64_t opt_n[] = {1, 7, 1000, 100003};
    for (size_t i = 0; i < (small ? 3 : 4); i++) {
        for (int variant = 0; variant < 3; variant++) check_adam_kernel(opt_n[i], variant);
        check_signflip_kernel(opt_n[i], 1);
        check_signflip_kernel(opt_n[i], 0);
    }
#endif
    check_public_adam(small ? 33 : 5001);
    check_public_signflip(small ? 33 : 5001, small ? 5 : 300, 1e-3f, 0.9f, 0.99f);
    check_public_signflip(small ? 33 : 5001, small ? 5 : 50, 1e-2f, 0.5f, 0.6f);
    check_public_zero_grad(small ? 33 : 100003);
    const int64_t ce[][2] = {{1, 1}, {1, 10}, {3, 2}, {64, 10}, {129, 37}, {3, 2049}, {1000, 1000}};
    for (size_t i = 0; i < (small ? 5 : sizeof ce / sizeof ce[0]); i++)
        check_public_cross_entropy(ce[i][0], ce[i][1]);
    check_public_clamp(1);
    check_public_clamp(small ? 33 : 100003);
    return tu_finish();
}
