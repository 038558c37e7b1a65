/* The graph's CUDA float kernels (src/cuda/train_graph_kernels.cu, declared in
 * src/train/train_cuda.h) against their CPU kernels (train_internal.h) on random data over
 * many shapes: conv2d (batch 1, odd sizes, k 1 / 3 / 5, stride 1 / 2 / 3, padding, dilation,
 * pointwise 1x1, batches over several image chunks, with and without bias / dx / db) within
 * 1e-4 of the largest reference value (the GEMMs sum in another order) and db within 1e-5;
 * average pool, global average pool, add, accumulate, concat copy / slice, RPReLU's forward
 * and dx equal bit for bit (the same arithmetic); RPReLU's per-channel sums within 1e-5.
 * Every kernel runs twice into poisoned outputs (and a poisoned conv work buffer) and must
 * give identical bits. Reports itself skipped (77) without a GPU.
 * Usage: test_cuda_graph_kernels [--small] */
#include "bie_train.h"
#include "train_kernel_util.h"

#ifdef BIE_TEST_CUDA_INTERNALS

/* ---- conv2d */

typedef struct conv_case {
    int64_t n, c, h, w, o;
    int k, s, p, d;
} conv_case;

static void check_conv(conv_case cc, int with_bias, int with_dx, int with_db) {
    bie_conv_geom g = {cc.n, cc.c, cc.h, cc.w, cc.o, 0, 0, cc.k, cc.s, cc.p, cc.d, 0};
    g.oh = (cc.h + 2 * cc.p - (int64_t)cc.d * (cc.k - 1) - 1) / cc.s + 1;
    g.ow = (cc.w + 2 * cc.p - (int64_t)cc.d * (cc.k - 1) - 1) / cc.s + 1;
    const int64_t nx = g.n * g.c * g.h * g.w, nw = g.o * g.c * g.k * g.k,
                  ny = g.n * g.o * g.oh * g.ow;
    float *x = fvec(nx), *w = fvec(nw), *b = fvec(g.o), *dy = fvec(ny);
    fill_signed(x, nx);
    fill_signed(w, nw);
    fill_signed(b, g.o);
    fill_signed(dy, ny);
    float *y = fvec(ny), *dx = fvec(nx), *dw = fvec(nw), *db = fvec(g.o);
    float *work = fvec(bie_conv2d_work_floats(&g));
    tu_poison(y, ny), tu_poison(dx, nx), tu_poison(dw, nw), tu_poison(db, g.o);
    bie_conv2d_forward(&g, x, w, with_bias ? b : NULL, y, work);
    bie_conv2d_backward(&g, x, dy, w, with_dx ? dx : NULL, dw, with_db ? db : NULL, work);

    const int64_t nwork = bie_cuda_conv2d_work_floats(&g);
    CHECK(nwork >= 0);
    const size_t work_bytes = (size_t)(nwork > 0 ? nwork : 0) * 4;
    float *gwork = dput(NULL, work_bytes);
    float *gx = dput(x, (size_t)nx * 4), *gw = dput(w, (size_t)nw * 4);
    float *gb = dput(b, (size_t)g.o * 4), *gdy = dput(dy, (size_t)ny * 4);
    out_buf fo[1] = {out_make((size_t)ny * 4, 1)};
    TWICE(fo, 1, gwork, work_bytes,
          bie_cuda_conv2d_forward(&g, gx, gw, with_bias ? gb : NULL, fo[0].dev, gwork),
          "conv2d forward");
    int ok = compare_close("conv2d y", fo[0].host[0], y, ny, 1e-4);
    out_buf bo[3] = {out_make((size_t)nx * 4, with_dx), out_make((size_t)nw * 4, 1),
                     out_make((size_t)g.o * 4, with_db)};
    TWICE(bo, 3, gwork, work_bytes,
          bie_cuda_conv2d_backward(&g, gx, gdy, gw, bo[0].dev, bo[1].dev, bo[2].dev, gwork),
          "conv2d backward");
    if (with_dx) ok &= compare_close("conv2d dx", bo[0].host[0], dx, nx, 1e-4);
    ok &= compare_close("conv2d dw", bo[1].host[0], dw, nw, 1e-4);
    if (with_db) ok &= compare_close("conv2d db", bo[2].host[0], db, g.o, 1e-5);
    CHECK(ok);
    if (!ok)
        fprintf(stderr,
                "  conv2d n=%lld c=%lld %lldx%lld o=%lld k=%d s=%d p=%d d=%d bias=%d dx=%d "
                "db=%d\n",
                (long long)cc.n, (long long)cc.c, (long long)cc.h, (long long)cc.w, (long long)cc.o,
                cc.k, cc.s, cc.p, cc.d, with_bias, with_dx, with_db);
    out_free(&fo[0]);
    for (int i = 0; i < 3; i++) out_free(&bo[i]);
    bie_cuda_train_free(gx), bie_cuda_train_free(gw), bie_cuda_train_free(gb),
        bie_cuda_train_free(gdy), bie_cuda_train_free(gwork);
    free(x), free(w), free(b), free(dy), free(y), free(dx), free(dw), free(db), free(work);
}

/* ---- pools */

static void check_avgpool(int64_t planes, int64_t h, int64_t w, int k, int s) {
    const int64_t oh = (h - k) / s + 1, ow = (w - k) / s + 1, n = planes * h * w,
                  no = planes * oh * ow;
    float *x = fvec(n), *dy = fvec(no), *y = fvec(no), *dx = fvec(n);
    fill_signed(x, n);
    fill_signed(dy, no);
    bie_avgpool_forward(x, planes, h, w, k, s, oh, ow, y);
    bie_avgpool_backward(dy, planes, h, w, k, s, oh, ow, dx);
    float *gx = dput(x, (size_t)n * 4), *gdy = dput(dy, (size_t)no * 4);
    out_buf fo[1] = {out_make((size_t)no * 4, 1)}, bo[1] = {out_make((size_t)n * 4, 1)};
    TWICE(fo, 1, NULL, 0, bie_cuda_avgpool_forward(gx, planes, h, w, k, s, oh, ow, fo[0].dev),
          "avgpool forward");
    int ok = compare_exact("avgpool y", fo[0].host[0], y, no);
    TWICE(bo, 1, NULL, 0, bie_cuda_avgpool_backward(gdy, planes, h, w, k, s, oh, ow, bo[0].dev),
          "avgpool backward");
    ok &= compare_exact("avgpool dx", bo[0].host[0], dx, n);
    CHECK(ok);
    if (!ok)
        fprintf(stderr, "  avgpool planes=%lld %lldx%lld k=%d s=%d\n", (long long)planes,
                (long long)h, (long long)w, k, s);
    out_free(&fo[0]), out_free(&bo[0]);
    bie_cuda_train_free(gx), bie_cuda_train_free(gdy);
    free(x), free(dy), free(y), free(dx);
}

static void check_global_avgpool(int64_t planes, int64_t inner) {
    const int64_t n = planes * inner;
    float *x = fvec(n), *dy = fvec(planes), *y = fvec(planes), *dx = fvec(n);
    fill_signed(x, n);
    fill_signed(dy, planes);
    bie_global_avgpool_forward(x, planes, inner, y);
    bie_global_avgpool_backward(dy, planes, inner, dx);
    float *gx = dput(x, (size_t)n * 4), *gdy = dput(dy, (size_t)planes * 4);
    out_buf fo[1] = {out_make((size_t)planes * 4, 1)}, bo[1] = {out_make((size_t)n * 4, 1)};
    TWICE(fo, 1, NULL, 0, bie_cuda_global_avgpool_forward(gx, planes, inner, fo[0].dev),
          "global avgpool forward");
    /* the same sum in double, in the same order: exact */
    int ok = compare_exact("global avgpool y", fo[0].host[0], y, planes);
    TWICE(bo, 1, NULL, 0, bie_cuda_global_avgpool_backward(gdy, planes, inner, bo[0].dev),
          "global avgpool backward");
    ok &= compare_exact("global avgpool dx", bo[0].host[0], dx, n);
    CHECK(ok);
    if (!ok)
        fprintf(stderr, "  global avgpool planes=%lld inner=%lld\n", (long long)planes,
                (long long)inner);
    out_free(&fo[0]), out_free(&bo[0]);
    bie_cuda_train_free(gx), bie_cuda_train_free(gdy);
    free(x), free(dy), free(y), free(dx);
}

/* ---- add and accumulate (also in place: y = a, y = b) */

static void check_add(int64_t n) {
    float *a = fvec(n), *b = fvec(n), *y = fvec(n), *acc = fvec(n), *got = fvec(n);
    fill_signed(a, n);
    fill_signed(b, n);
    bie_add_forward(a, b, n, y);
    memcpy(acc, a, (size_t)n * 4);
    bie_accumulate(acc, b, n);
    float *ga = dput(a, (size_t)n * 4), *gb = dput(b, (size_t)n * 4);
    out_buf o[1] = {out_make((size_t)n * 4, 1)};
    TWICE(o, 1, NULL, 0, bie_cuda_add_forward(ga, gb, n, o[0].dev), "add forward");
    int ok = compare_exact("add y", o[0].host[0], y, n);
    for (int alias = 0; alias < 2; alias++) { /* y = a, then y = b */
        float *t = dput(alias ? b : a, (size_t)n * 4);
        CHECK_OK(bie_cuda_add_forward(alias ? ga : t, alias ? t : gb, n, t));
        dget(got, t, (size_t)n * 4);
        ok &= compare_exact("add y (in place)", got, y, n);
        bie_cuda_train_free(t);
    }
    float *gacc = dput(a, (size_t)n * 4);
    CHECK_OK(bie_cuda_accumulate(gacc, gb, n));
    dget(got, gacc, (size_t)n * 4);
    ok &= compare_exact("accumulate", got, acc, n);
    CHECK(ok);
    if (!ok) fprintf(stderr, "  add n=%lld\n", (long long)n);
    out_free(&o[0]);
    bie_cuda_train_free(ga), bie_cuda_train_free(gb), bie_cuda_train_free(gacc);
    free(a), free(b), free(y), free(acc), free(got);
}

/* ---- concat: copy into a filled y (the other channels must stay), slice back out */

static void check_concat(int64_t outer, int64_t ci, int64_t inner, int64_t ctotal, int64_t offset) {
    const int64_t nx = outer * ci * inner, ny = outer * ctotal * inner;
    float *x = fvec(nx), *y0 = fvec(ny), *y = fvec(ny), *xs = fvec(nx), *got = fvec(ny);
    fill_signed(x, nx);
    fill_signed(y0, ny);
    memcpy(y, y0, (size_t)ny * 4);
    bie_concat_copy(x, outer, ci, inner, ctotal, offset, y);
    bie_concat_slice(y0, outer, ci, inner, ctotal, offset, xs);
    float *gx = dput(x, (size_t)nx * 4), *gy0 = dput(y0, (size_t)ny * 4);
    float *gy = dput(y0, (size_t)ny * 4);
    int ok = 1;
    for (int rep = 0; rep < 2; rep++) {
        CHECK_OK(bie_cuda_train_copy(gy, y0, (size_t)ny * 4));
        CHECK_OK(bie_cuda_concat_copy(gx, outer, ci, inner, ctotal, offset, gy));
        dget(got, gy, (size_t)ny * 4);
        ok &= compare_exact("concat copy", got, y, ny);
    }
    out_buf o[1] = {out_make((size_t)nx * 4, 1)};
    TWICE(o, 1, NULL, 0, bie_cuda_concat_slice(gy0, outer, ci, inner, ctotal, offset, o[0].dev),
          "concat slice");
    ok &= compare_exact("concat slice", o[0].host[0], xs, nx);
    CHECK(ok);
    if (!ok)
        fprintf(stderr, "  concat outer=%lld ci=%lld inner=%lld ctotal=%lld offset=%lld\n",
                (long long)outer, (long long)ci, (long long)inner, (long long)ctotal,
                (long long)offset);
    out_free(&o[0]);
    bie_cuda_train_free(gx), bie_cuda_train_free(gy0), bie_cuda_train_free(gy);
    free(x), free(y0), free(y), free(xs), free(got);
}

/* ---- RPReLU */

static void check_rprelu(int64_t outer, int64_t channels, int64_t inner, int with_dx) {
    const int64_t n = outer * channels * inner;
    float *x = fvec(n), *dy = fvec(n), *si = fvec(channels), *sl = fvec(channels),
          *so = fvec(channels);
    tu_fill(si, channels, -0.5f, 0.5f);
    tu_fill(sl, channels, -0.5f, 0.5f);
    tu_fill(so, channels, -0.5f, 0.5f);
    fill_signed(x, n);
    fill_signed(dy, n);
    /* some inputs land exactly on t = 0 (the >= 0 branch) */
    for (int64_t i = 0; i < n; i++)
        if (tu_next() % 16 == 0) x[i] = -si[(i / inner) % channels];
    float *y = fvec(n), *dx = fvec(n), *dsi = fvec(channels), *dsl = fvec(channels),
          *dso = fvec(channels);
    bie_rprelu_forward(x, outer, channels, inner, si, sl, so, y);
    bie_rprelu_backward(x, dy, outer, channels, inner, si, sl, with_dx ? dx : NULL, dsi, dsl, dso);
    float *gx = dput(x, (size_t)n * 4), *gdy = dput(dy, (size_t)n * 4);
    float *gsi = dput(si, (size_t)channels * 4), *gsl = dput(sl, (size_t)channels * 4),
          *gso = dput(so, (size_t)channels * 4);
    out_buf fo[1] = {out_make((size_t)n * 4, 1)};
    TWICE(fo, 1, NULL, 0,
          bie_cuda_rprelu_forward(gx, outer, channels, inner, gsi, gsl, gso, fo[0].dev),
          "rprelu forward");
    int ok = compare_exact("rprelu y", fo[0].host[0], y, n);
    out_buf bo[4] = {out_make((size_t)n * 4, with_dx), out_make((size_t)channels * 4, 1),
                     out_make((size_t)channels * 4, 1), out_make((size_t)channels * 4, 1)};
    TWICE(bo, 4, NULL, 0,
          bie_cuda_rprelu_backward(gx, gdy, outer, channels, inner, gsi, gsl, bo[0].dev, bo[1].dev,
                                   bo[2].dev, bo[3].dev),
          "rprelu backward");
    if (with_dx) ok &= compare_exact("rprelu dx", bo[0].host[0], dx, n);
    ok &= compare_close("rprelu dshift_in", bo[1].host[0], dsi, channels, 1e-5);
    ok &= compare_close("rprelu dslopes", bo[2].host[0], dsl, channels, 1e-5);
    ok &= compare_close("rprelu dshift_out", bo[3].host[0], dso, channels, 1e-5);
    CHECK(ok);
    if (!ok)
        fprintf(stderr, "  rprelu %lld x %lld x %lld dx=%d\n", (long long)outer,
                (long long)channels, (long long)inner, with_dx);
    out_free(&fo[0]);
    for (int i = 0; i < 4; i++) out_free(&bo[i]);
    bie_cuda_train_free(gx), bie_cuda_train_free(gdy), bie_cuda_train_free(gsi),
        bie_cuda_train_free(gsl), bie_cuda_train_free(gso);
    free(x), free(dy), free(si), free(sl), free(so), free(y), free(dx), free(dsi), free(dsl),
        free(dso);
}
#endif /* BIE_TEST_CUDA_INTERNALS */

int main(int argc, char **argv) {
    /* --small: a few small shapes, for runs under compute-sanitizer */
    const int small = argc > 1 && strcmp(argv[1], "--small") == 0;
    if (gpu_missing()) return TU_SKIP;
    tu_seed(2025);
#ifdef BIE_TEST_CUDA_INTERNALS
    /* n c h w o k s p d */
    const conv_case conv[] = {
        {1, 1, 1, 1, 1, 1, 1, 0, 1},    /* pointwise, one element */
        {2, 3, 5, 7, 4, 3, 1, 1, 1},    /* odd sizes, padding */
        {1, 3, 8, 8, 5, 1, 1, 0, 1},    /* pointwise, batch 1 */
        {3, 4, 9, 9, 6, 1, 2, 0, 1},    /* 1x1 stride 2: not pointwise */
        {2, 5, 11, 13, 7, 5, 2, 2, 1},  /* k 5, stride 2 */
        {2, 3, 10, 10, 4, 3, 1, 2, 2},  /* dilation */
        {1, 2, 2, 3, 3, 3, 1, 1, 1},    /* window larger than the image */
        {40, 3, 8, 8, 8, 3, 1, 1, 1},   /* two image chunks, the last partial */
        {2, 3, 7, 7, 4, 3, 3, 1, 1},    /* stride 3 */
        {1, 2, 9, 9, 3, 3, 2, 0, 1},    /* no padding, stride 2 */
        {0, 3, 5, 5, 4, 3, 1, 1, 1},    /* no images: zero gradients */
        {33, 16, 9, 9, 16, 1, 1, 0, 1}, /* pointwise over two chunks */
        {70, 16, 16, 16, 32, 3, 1, 1, 1}, {8, 64, 14, 14, 64, 3, 1, 1, 1},
        {2, 8, 32, 32, 16, 5, 1, 2, 1},   {4, 1, 28, 28, 8, 3, 1, 0, 1},
        {3, 5, 17, 19, 6, 5, 2, 4, 2},   /* dilation with stride */
        {26, 64, 64, 64, 64, 3, 1, 1, 1} /* chunks shortened by the work budget */
    };
    const size_t nconv = small ? 12 : sizeof conv / sizeof conv[0];
    for (size_t i = 0; i < nconv; i++)
        for (int variant = 0; variant < 3; variant++)
            check_conv(conv[i], variant != 1, variant != 2, variant != 2);

    const int64_t pool[][5] = {{1, 1, 1, 1, 1},    {1, 2, 2, 2, 2},   {3, 5, 7, 2, 2},
                               {2, 7, 7, 3, 1},    {5, 9, 8, 3, 2},   {64, 32, 32, 2, 2},
                               {4, 33, 17, 3, 2},  {1, 40, 40, 5, 3}, {2, 9, 9, 2, 3},
                               {33, 70, 70, 3, 1}, {512, 8, 8, 8, 8}};
    const size_t npool = small ? 5 : sizeof pool / sizeof pool[0];
    for (size_t i = 0; i < npool; i++)
        check_avgpool(pool[i][0], pool[i][1], pool[i][2], (int)pool[i][3], (int)pool[i][4]);

    const int64_t gap[][2] = {{1, 1},     {3, 7}, {64, 49},    {5, 1000},
                              {4096, 64}, {7, 3}, {2, 100003}, {70000, 1}};
    const size_t ngap = small ? 4 : sizeof gap / sizeof gap[0];
    for (size_t i = 0; i < ngap; i++) check_global_avgpool(gap[i][0], gap[i][1]);

    const int64_t add_n[] = {1, 7, 1000, 65537, (1 << 20) + 3};
    for (size_t i = 0; i < (small ? 3 : 5); i++) check_add(add_n[i]);

    const int64_t cat[][5] = {{1, 1, 1, 1, 0},      {2, 3, 5, 7, 4},     {3, 2, 1, 5, 0},
                              {1, 5, 3, 5, 0},      {4, 16, 49, 48, 16}, {2, 7, 1, 9, 2},
                              {64, 32, 256, 96, 64}};
    const size_t ncat = small ? 4 : sizeof cat / sizeof cat[0];
    for (size_t i = 0; i < ncat; i++)
        check_concat(cat[i][0], cat[i][1], cat[i][2], cat[i][3], cat[i][4]);

    const int64_t rp[][3] = {{1, 1, 1},    {2, 3, 5},    {1, 16, 1},  {7, 5, 13},   {32, 64, 64},
                             {3, 1, 1000}, {8, 4, 8192}, {2, 600, 3}, {64, 3, 4096}};
    const size_t nrp = small ? 4 : sizeof rp / sizeof rp[0];
    for (size_t i = 0; i < nrp; i++) check_rprelu(rp[i][0], rp[i][1], rp[i][2], i % 3 != 1);
#else
    (void)small;
#endif
    return tu_finish();
}
