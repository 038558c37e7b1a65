/* The graph's CPU float kernels (src/train/float_conv.c, graph_layers.c) against direct
 * reference loops in double on random data: conv2d forward (a 7-deep loop) and backward
 * (the direct formulas for dx, dw, db, plus central differences of L = sum(y r)) over many
 * geometries (odd and non-square planes, k = 1, 3, 5, stride 1 / 2, padding 0 / 1 / 2,
 * dilation 1 / 2, batch 1); average pool (overlapping windows), global average pool, add
 * (aliased too), accumulate, channel concat / slice and RPReLU. Every output (and the conv's
 * work buffer) is poisoned with NaN before each call, so an unwritten element fails, and
 * every kernel but the OpenBLAS sgemms gives the same bits on 1, 2 and 3 threads (shapes past
 * the parallel limit). */
#include "test_util.h"
#include "train/train_internal.h"

/* Equal up to float rounding: within 1e-5 of the largest magnitude of `want`. */
static bool near(const float *got, const float *want, int64_t n) {
    float top = 0;
    for (int64_t i = 0; i < n; i++) top = fmaxf(top, fabsf(want[i]));
    for (int64_t i = 0; i < n; i++)
        if (!(fabsf(got[i] - want[i]) <= 1e-5f * top)) return false;
    return true;
}

static float *fvec(int64_t n) { return tu_alloc((size_t)(n > 0 ? n : 1) * sizeof(float)); }
static double *dvec(int64_t n) {
    double *p = tu_alloc((size_t)(n > 0 ? n : 1) * sizeof(double));
    memset(p, 0, (size_t)(n > 0 ? n : 1) * sizeof(double));
    return p;
}

/* got[i] against want[i] within rtol of the sum of |terms| (scale[i]) behind it, or of
 * |want[i]| without scale; counts one check per array, reports the first offenders. */
static void check_close(const char *label, const float *got, const double *want,
                        const double *scale, int64_t n, double rtol) {
    int bad = 0;
    for (int64_t i = 0; i < n; i++) {
        const double s = scale ? scale[i] : fabs(want[i]);
        if (!(fabs((double)got[i] - want[i]) <= rtol * s + 1e-6)) {
            if (bad++ < 3)
                fprintf(stderr, "  %s[%lld] = %.9g, want %.9g\n", label, (long long)i,
                        (double)got[i], want[i]);
        }
    }
    if (bad) fprintf(stderr, "%s: %d of %lld elements differ\n", label, bad, (long long)n);
    CHECK(bad == 0);
}

static const int kThreads[] = {1, 2, 3};
#define N_THREADS 3

/* ------------------------------------------------------------------ conv2d */

typedef struct conv_case {
    int64_t n, c, h, w, o, k, s, p, d;
} conv_case;

static bie_conv_geom geom_of(const conv_case *cc) {
    bie_conv_geom g = {cc->n, cc->c, cc->h, cc->w, cc->o, 0, 0, cc->k, cc->s, cc->p, cc->d, 0};
    g.oh = (cc->h + 2 * cc->p - cc->d * (cc->k - 1) - 1) / cc->s + 1;
    g.ow = (cc->w + 2 * cc->p - cc->d * (cc->k - 1) - 1) / cc->s + 1;
    return g;
}

/* Direct loops in double: y, dx, dw, db and the sums of |terms| behind each. */
static void conv_reference(const bie_conv_geom *g, const float *x, const float *w, const float *b,
                           const float *dy, double *y, double *ys, double *dx, double *dxs,
                           double *dw, double *dws, double *db, double *dbs) {
    const int64_t k = g->k;
    for (int64_t n = 0; n < g->n; n++)
        for (int64_t o = 0; o < g->o; o++)
            for (int64_t oy = 0; oy < g->oh; oy++)
                for (int64_t ox = 0; ox < g->ow; ox++) {
                    const int64_t yi = ((n * g->o + o) * g->oh + oy) * g->ow + ox;
                    double acc = b ? b[o] : 0, abs_acc = b ? fabs(b[o]) : 0;
                    const double gy = dy[yi];
                    db[o] += gy;
                    dbs[o] += fabs(gy);
                    for (int64_t c = 0; c < g->c; c++)
                        for (int64_t ky = 0; ky < k; ky++)
                            for (int64_t kx = 0; kx < k; kx++) {
                                const int64_t iy = oy * g->s - g->p + ky * g->d;
                                const int64_t ix = ox * g->s - g->p + kx * g->d;
                                if (iy < 0 || iy >= g->h || ix < 0 || ix >= g->w) continue;
                                const int64_t xi = ((n * g->c + c) * g->h + iy) * g->w + ix;
                                const int64_t wi = ((o * g->c + c) * k + ky) * k + kx;
                                acc += (double)w[wi] * x[xi];
                                abs_acc += fabs((double)w[wi] * x[xi]);
                                dx[xi] += gy * w[wi];
                                dxs[xi] += fabs(gy * w[wi]);
                                dw[wi] += gy * x[xi];
                                dws[wi] += fabs(gy * x[xi]);
                            }
                    y[yi] = acc;
                    ys[yi] = abs_acc;
                }
}

static double conv_loss(const bie_conv_geom *g, const float *x, const float *w, const float *b,
                        const float *r, float *y, float *work) {
    bie_conv2d_forward(g, x, w, b, y, work);
    double l = 0;
    for (int64_t i = 0; i < g->n * g->o * g->oh * g->ow; i++) l += (double)y[i] * r[i];
    return l;
}

/* Central differences of L = sum(y r) in a spread sample of x, w and b (the conv is linear
 * in each, so a large step is exact up to rounding). */
static void conv_finite_diff(const bie_conv_geom *g, float *x, float *w, float *b, const float *r,
                             const float *dx, const float *dw, const float *db, float *y,
                             float *work, const char *label) {
    const float h = 0.25f;
    const int64_t nx = g->n * g->c * g->h * g->w, nw = g->o * g->c * g->k * g->k;
    float *arrays[3] = {x, w, b};
    const float *grads[3] = {dx, dw, db};
    const int64_t sizes[3] = {nx, nw, g->o};
    int bad = 0;
    for (int a = 0; a < 3; a++) {
        const int64_t step = sizes[a] > 40 ? sizes[a] / 37 : 1;
        for (int64_t i = 0; i < sizes[a]; i += step) {
            float *p = &arrays[a][i];
            const float keep = *p;
            *p = keep + h;
            const double lp = conv_loss(g, x, w, b, r, y, work);
            *p = keep - h;
            const double lm = conv_loss(g, x, w, b, r, y, work);
            *p = keep;
            const double num = (lp - lm) / (2.0 * h), ana = grads[a][i];
            if (!(fabs(ana - num) <= 2e-3 + 2e-3 * fabs(num)) && bad++ < 3)
                fprintf(stderr, "  %s: finite difference of %s[%lld]: %g, analytic %g\n", label,
                        a == 0   ? "x"
                        : a == 1 ? "w"
                                 : "b",
                        (long long)i, num, ana);
        }
    }
    CHECK(bad == 0);
}

static void conv_check(const conv_case *cc) {
    const bie_conv_geom g = geom_of(cc);
    char label[128];
    snprintf(label, sizeof label, "conv n%lld c%lld %lldx%lld o%lld k%lld s%lld p%lld d%lld",
             (long long)cc->n, (long long)cc->c, (long long)cc->h, (long long)cc->w,
             (long long)cc->o, (long long)cc->k, (long long)cc->s, (long long)cc->p,
             (long long)cc->d);
    const int64_t nx = g.n * g.c * g.h * g.w, nw = g.o * g.c * g.k * g.k;
    const int64_t ny = g.n * g.o * g.oh * g.ow, nwork = bie_conv2d_work_floats(&g);
    CHECK(g.oh >= 1 && g.ow >= 1 && nwork >= 0);
    float *x = fvec(nx), *w = fvec(nw), *b = fvec(g.o), *dy = fvec(ny), *work = fvec(nwork);
    tu_fill(x, nx, -1, 1);
    tu_fill(w, nw, -1, 1);
    tu_fill(b, g.o, -1, 1);
    tu_fill(dy, ny, -1, 1);
    double *ry = dvec(ny), *rys = dvec(ny), *rdx = dvec(nx), *rdxs = dvec(nx), *rdw = dvec(nw),
           *rdws = dvec(nw), *rdb = dvec(g.o), *rdbs = dvec(g.o), *ry0 = dvec(ny), *ry0s = dvec(ny);
    conv_reference(&g, x, w, b, dy, ry, rys, rdx, rdxs, rdw, rdws, rdb, rdbs);
    {
        double *t1 = dvec(nx), *t2 = dvec(nx), *t3 = dvec(nw), *t4 = dvec(nw), *t5 = dvec(g.o),
               *t6 = dvec(g.o);
        conv_reference(&g, x, w, NULL, dy, ry0, ry0s, t1, t2, t3, t4, t5, t6);
        free(t1), free(t2), free(t3), free(t4), free(t5), free(t6);
    }

    float *y[N_THREADS], *y0[N_THREADS], *dx[N_THREADS], *dw[N_THREADS], *db[N_THREADS];
    float *dw2 = fvec(nw), *db2 = fvec(g.o);
    for (int t = 0; t < N_THREADS; t++) {
        CHECK_OK(bie_set_num_threads(kThreads[t]));
        y[t] = fvec(ny), y0[t] = fvec(ny), dx[t] = fvec(nx), dw[t] = fvec(nw), db[t] = fvec(g.o);
        tu_poison(y[t], ny), tu_poison(y0[t], ny), tu_poison(work, nwork);
        bie_conv2d_forward(&g, x, w, b, y[t], work);
        tu_poison(work, nwork);
        bie_conv2d_forward(&g, x, w, NULL, y0[t], work);
        tu_poison(dx[t], nx), tu_poison(dw[t], nw), tu_poison(db[t], g.o), tu_poison(work, nwork);
        bie_conv2d_backward(&g, x, dy, w, dx[t], dw[t], db[t], work);
        /* no dx, no db: dw alone, the same bits */
        tu_poison(dw2, nw), tu_poison(db2, g.o), tu_poison(work, nwork);
        bie_conv2d_backward(&g, x, dy, w, NULL, dw2, NULL, work);
        CHECK(tu_same_bits(dw2, dw[t], nw));
        tu_poison(work, nwork);
        bie_conv2d_backward(&g, x, dy, w, NULL, dw2, db2, work);
        CHECK(tu_same_bits(dw2, dw[t], nw) && tu_same_bits(db2, db[t], g.o));
        if (t == 0) {
            char l2[160];
            snprintf(l2, sizeof l2, "%s y", label);
            check_close(l2, y[t], ry, rys, ny, 2e-5);
            snprintf(l2, sizeof l2, "%s y (no bias)", label);
            check_close(l2, y0[t], ry0, ry0s, ny, 2e-5);
            snprintf(l2, sizeof l2, "%s dx", label);
            check_close(l2, dx[t], rdx, rdxs, nx, 2e-5);
            snprintf(l2, sizeof l2, "%s dw", label);
            check_close(l2, dw[t], rdw, rdws, nw, 2e-5);
            snprintf(l2, sizeof l2, "%s db", label);
            check_close(l2, db[t], rdb, rdbs, g.o, 1e-6);
        } else {
            /* OpenBLAS may block an sgemm differently for another thread count (seen on a
             * 16-core Xeon for a 1x1 conv): the conv agrees with itself across thread counts
             * up to rounding; db (bie's own sums) bit for bit. */
            const bool same = near(y[t], y[0], ny) && near(y0[t], y0[0], ny) &&
                              near(dx[t], dx[0], nx) && near(dw[t], dw[0], nw) &&
                              tu_same_bits(db[t], db[0], g.o);
            if (!same) fprintf(stderr, "%s: %d threads differ from 1\n", label, kThreads[t]);
            CHECK(same);
        }
    }
    CHECK_OK(bie_set_num_threads(1));
    float *r = fvec(ny), *yt = fvec(ny);
    tu_fill(r, ny, -1, 1);
    /* the gradients of L = sum(y r) are the backward with dy = r */
    tu_poison(dx[1], nx), tu_poison(dw[1], nw), tu_poison(db[1], g.o);
    bie_conv2d_backward(&g, x, r, w, dx[1], dw[1], db[1], work);
    conv_finite_diff(&g, x, w, b, r, dx[1], dw[1], db[1], yt, work, label);
    free(r), free(yt);

    for (int t = 0; t < N_THREADS; t++)
        free(y[t]), free(y0[t]), free(dx[t]), free(dw[t]), free(db[t]);
    free(x), free(w), free(b), free(dy), free(work), free(dw2), free(db2);
    free(ry), free(rys), free(rdx), free(rdxs), free(rdw), free(rdws), free(rdb), free(rdbs);
    free(ry0), free(ry0s);
}

static void test_conv(void) {
    static const conv_case cases[] = {
        /* n  c   h   w   o  k  s  p  d */
        {2, 3, 7, 5, 4, 3, 1, 1, 1},
        {1, 1, 28, 28, 8, 3, 1, 1, 1}, /* stem, batch 1 */
        {3, 5, 9, 11, 6, 3, 2, 0, 1},
        {2, 4, 10, 7, 3, 3, 1, 2, 2},
        {2, 6, 8, 8, 5, 1, 1, 0, 1},
        {1, 7, 5, 9, 3, 1, 1, 0, 1}, /* pointwise */
        {2, 6, 9, 7, 5, 1, 2, 0, 1},
        {1, 3, 6, 6, 2, 1, 1, 1, 1}, /* 1x1, stride / pad */
        {2, 2, 13, 9, 3, 5, 1, 2, 1},
        {1, 3, 12, 10, 4, 5, 2, 2, 2},
        {3, 2, 5, 4, 3, 5, 1, 2, 1},
        {2, 3, 11, 13, 2, 3, 2, 1, 2},
        {1, 2, 9, 9, 2, 3, 1, 0, 2},
        {2, 3, 3, 5, 2, 3, 1, 0, 1}, /* oh = 1 */
        {1, 2, 8, 8, 3, 3, 2, 0, 1},
        {1, 1, 1, 1, 1, 1, 1, 0, 1}, /* last row unread; 1x1 */
        {1, 2, 1, 6, 3, 3, 1, 1, 1},
        {2, 3, 4, 4, 2, 5, 2, 2, 1},
        /* past the parallel limit: im2col / col2im over threads; bias and db (stem) */
        {2, 8, 28, 28, 16, 3, 1, 1, 1},
        {4, 1, 28, 28, 64, 3, 1, 1, 1},
        {2, 64, 14, 14, 48, 1, 1, 0, 1},
        {2, 16, 15, 13, 8, 3, 2, 1, 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) conv_check(&cases[i]);
}

/* --------------------------------------------------------------- pooling */

static void test_avgpool(void) {
    static const int64_t cases[][5] = {
        /* planes h w k s */
        {6, 7, 5, 2, 2}, {3, 8, 8, 2, 2}, {4, 9, 7, 3, 2},     {2, 7, 6, 3, 1},    {5, 6, 6, 3, 3},
        {1, 5, 5, 1, 1}, {3, 5, 8, 5, 1}, {256, 28, 28, 2, 2}, {96, 15, 17, 3, 2},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const int64_t planes = cases[c][0], h = cases[c][1], w = cases[c][2];
        const int k = (int)cases[c][3], s = (int)cases[c][4];
        const int64_t oh = (h - k) / s + 1, ow = (w - k) / s + 1;
        const int64_t nx = planes * h * w, ny = planes * oh * ow;
        float *x = fvec(nx), *dy = fvec(ny);
        tu_fill(x, nx, -1, 1);
        tu_fill(dy, ny, -1, 1);
        double *ry = dvec(ny), *rdx = dvec(nx);
        for (int64_t p = 0; p < planes; p++)
            for (int64_t oy = 0; oy < oh; oy++)
                for (int64_t ox = 0; ox < ow; ox++) {
                    const int64_t yi = (p * oh + oy) * ow + ox;
                    for (int i = 0; i < k; i++)
                        for (int j = 0; j < k; j++) {
                            const int64_t xi = (p * h + oy * s + i) * w + ox * s + j;
                            ry[yi] += x[xi] / ((double)k * k);
                            rdx[xi] += dy[yi] / ((double)k * k);
                        }
                }
        float *y[N_THREADS], *dx[N_THREADS];
        for (int t = 0; t < N_THREADS; t++) {
            CHECK_OK(bie_set_num_threads(kThreads[t]));
            y[t] = fvec(ny), dx[t] = fvec(nx);
            tu_poison(y[t], ny), tu_poison(dx[t], nx);
            bie_avgpool_forward(x, planes, h, w, k, s, oh, ow, y[t]);
            bie_avgpool_backward(dy, planes, h, w, k, s, oh, ow, dx[t]);
            if (t == 0) {
                check_close("avgpool y", y[t], ry, NULL, ny, 1e-6);
                check_close("avgpool dx", dx[t], rdx, NULL, nx, 1e-5);
            } else {
                CHECK(tu_same_bits(y[t], y[0], ny) && tu_same_bits(dx[t], dx[0], nx));
            }
        }
        for (int t = 0; t < N_THREADS; t++) free(y[t]), free(dx[t]);
        free(x), free(dy), free(ry), free(rdx);
    }

    static const int64_t gcases[][2] = {{7, 49}, {1, 1}, {3, 5}, {640, 64}, {130, 784}};
    for (size_t c = 0; c < sizeof gcases / sizeof gcases[0]; c++) {
        const int64_t planes = gcases[c][0], inner = gcases[c][1], nx = planes * inner;
        float *x = fvec(nx), *dy = fvec(planes);
        tu_fill(x, nx, -1, 1);
        tu_fill(dy, planes, -1, 1);
        double *ry = dvec(planes), *rdx = dvec(nx);
        for (int64_t p = 0; p < planes; p++) {
            for (int64_t i = 0; i < inner; i++) ry[p] += x[p * inner + i];
            ry[p] /= (double)inner;
            for (int64_t i = 0; i < inner; i++) rdx[p * inner + i] = dy[p] / (double)inner;
        }
        float *y[N_THREADS], *dx[N_THREADS];
        for (int t = 0; t < N_THREADS; t++) {
            CHECK_OK(bie_set_num_threads(kThreads[t]));
            y[t] = fvec(planes), dx[t] = fvec(nx);
            tu_poison(y[t], planes), tu_poison(dx[t], nx);
            bie_global_avgpool_forward(x, planes, inner, y[t]);
            bie_global_avgpool_backward(dy, planes, inner, dx[t]);
            if (t == 0) {
                /* the mean of values in [-1, 1): within 1e-6 of 1 */
                int bad = 0;
                for (int64_t p = 0; p < planes; p++) bad += !(fabs(y[t][p] - ry[p]) <= 1e-6);
                CHECK(bad == 0);
                check_close("global avgpool dx", dx[t], rdx, NULL, nx, 1e-6);
            } else {
                CHECK(tu_same_bits(y[t], y[0], planes) && tu_same_bits(dx[t], dx[0], nx));
            }
        }
        for (int t = 0; t < N_THREADS; t++) free(y[t]), free(dx[t]);
        free(x), free(dy), free(ry), free(rdx);
    }
}

/* ------------------------------------------------- add, accumulate, concat */

static void test_add_accumulate(void) {
    static const int64_t sizes[] = {1, 7, 1000, 40001, 100003};
    for (size_t c = 0; c < sizeof sizes / sizeof sizes[0]; c++) {
        const int64_t n = sizes[c];
        float *a = fvec(n), *b = fvec(n), *y = fvec(n), *want = fvec(n), *acc = fvec(n);
        tu_fill(a, n, -1, 1);
        tu_fill(b, n, -1, 1);
        for (int64_t i = 0; i < n; i++) want[i] = a[i] + b[i];
        for (int t = 0; t < N_THREADS; t++) {
            CHECK_OK(bie_set_num_threads(kThreads[t]));
            tu_poison(y, n);
            bie_add_forward(a, b, n, y);
            CHECK(tu_same_bits(y, want, n));
            memcpy(y, a, (size_t)n * 4); /* y = a + b with y aliasing a, then b */
            bie_add_forward(y, b, n, y);
            CHECK(tu_same_bits(y, want, n));
            memcpy(y, b, (size_t)n * 4);
            bie_add_forward(a, y, n, y);
            CHECK(tu_same_bits(y, want, n));
            memcpy(acc, a, (size_t)n * 4);
            bie_accumulate(acc, b, n);
            CHECK(tu_same_bits(acc, want, n));
        }
        free(a), free(b), free(y), free(want), free(acc);
    }
}

static void test_concat(void) {
    /* outer, inner, and the channel counts of the inputs (0-terminated) */
    static const int64_t cases[][6] = {
        {2, 5, 3, 1, 4, 0},     {1, 1, 2, 2, 0, 0}, {3, 49, 7, 0, 0, 0},
        {4, 784, 16, 32, 5, 0}, {1, 9, 1, 1, 1, 1},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const int64_t outer = cases[c][0], inner = cases[c][1];
        int64_t ctotal = 0, parts = 0;
        for (int i = 2; i < 6 && cases[c][i]; i++) ctotal += cases[c][i], parts++;
        const int64_t ny = outer * ctotal * inner;
        float *y = fvec(ny), *want = fvec(ny), *back = fvec(ny), *xs[4];
        int64_t offset = 0;
        for (int64_t i = 0; i < parts; i++) {
            const int64_t ci = cases[c][2 + i];
            xs[i] = fvec(outer * ci * inner);
            tu_fill(xs[i], outer * ci * inner, -1, 1);
            for (int64_t o = 0; o < outer; o++)
                memcpy(want + (o * ctotal + offset) * inner, xs[i] + o * ci * inner,
                       (size_t)(ci * inner) * 4);
            offset += ci;
        }
        for (int t = 0; t < N_THREADS; t++) {
            CHECK_OK(bie_set_num_threads(kThreads[t]));
            tu_poison(y, ny);
            offset = 0;
            for (int64_t i = 0; i < parts; i++) {
                const int64_t ci = cases[c][2 + i];
                bie_concat_copy(xs[i], outer, ci, inner, ctotal, offset, y);
                /* only its channels are written: the later inputs' are still poison */
                bool untouched = true;
                for (int64_t o = 0; o < outer; o++)
                    for (int64_t e = (offset + ci) * inner; e < ctotal * inner; e++) {
                        float v = y[o * ctotal * inner + e];
                        uint32_t bits;
                        memcpy(&bits, &v, 4);
                        untouched = untouched && bits == 0x7fc0dead;
                    }
                CHECK(untouched);
                offset += ci;
            }
            CHECK(tu_same_bits(y, want, ny));
            offset = 0;
            for (int64_t i = 0; i < parts; i++) {
                const int64_t ci = cases[c][2 + i];
                tu_poison(back, outer * ci * inner);
                bie_concat_slice(want, outer, ci, inner, ctotal, offset, back);
                CHECK(tu_same_bits(back, xs[i], outer * ci * inner));
                offset += ci;
            }
        }
        for (int64_t i = 0; i < parts; i++) free(xs[i]);
        free(y), free(want), free(back);
    }
}

/* ------------------------------------------------------------------ RPReLU */

static void test_rprelu(void) {
    static const int64_t cases[][3] = {
        /* outer channels inner */
        {2, 3, 5}, {1, 1, 1}, {3, 7, 49}, {1, 4, 1}, {16, 64, 196}, {5, 3, 4000},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const int64_t outer = cases[c][0], ch = cases[c][1], inner = cases[c][2];
        const int64_t n = outer * ch * inner;
        float *x = fvec(n), *dy = fvec(n), *si = fvec(ch), *sl = fvec(ch), *so = fvec(ch);
        tu_fill(x, n, -1, 1);
        tu_fill(dy, n, -1, 1);
        tu_fill(si, ch, -0.5f, 0.5f);
        tu_fill(sl, ch, 0.05f, 0.5f);
        tu_fill(so, ch, -0.5f, 0.5f);
        double *ry = dvec(n), *rdx = dvec(n), *rdsi = dvec(ch), *rdsl = dvec(ch), *rdso = dvec(ch),
               *sc = dvec(ch);
        for (int64_t o = 0; o < outer; o++)
            for (int64_t k = 0; k < ch; k++)
                for (int64_t i = 0; i < inner; i++) {
                    const int64_t at = (o * ch + k) * inner + i;
                    const float t = x[at] + si[k]; /* the float t of the forward */
                    ry[at] = (t >= 0 ? (double)t : (double)sl[k] * t) + so[k];
                    rdx[at] = t >= 0 ? dy[at] : (double)sl[k] * dy[at];
                    rdsi[k] += rdx[at];
                    if (t < 0) rdsl[k] += (double)dy[at] * t;
                    rdso[k] += dy[at];
                    sc[k] += fabs(dy[at]);
                }
        float *y[N_THREADS], *dx[N_THREADS], *g[N_THREADS], *g2 = fvec(3 * ch);
        for (int t = 0; t < N_THREADS; t++) {
            CHECK_OK(bie_set_num_threads(kThreads[t]));
            y[t] = fvec(n), dx[t] = fvec(n), g[t] = fvec(3 * ch);
            tu_poison(y[t], n), tu_poison(dx[t], n), tu_poison(g[t], 3 * ch);
            bie_rprelu_forward(x, outer, ch, inner, si, sl, so, y[t]);
            bie_rprelu_backward(x, dy, outer, ch, inner, si, sl, dx[t], g[t], g[t] + ch,
                                g[t] + 2 * ch);
            tu_poison(g2, 3 * ch); /* without dx: the same parameter gradients */
            bie_rprelu_backward(x, dy, outer, ch, inner, si, sl, NULL, g2, g2 + ch, g2 + 2 * ch);
            CHECK(tu_same_bits(g2, g[t], 3 * ch));
            if (t == 0) {
                check_close("rprelu y", y[t], ry, NULL, n, 1e-6);
                check_close("rprelu dx", dx[t], rdx, NULL, n, 1e-6);
                check_close("rprelu dshift_in", g[t], rdsi, sc, ch, 1e-6);
                check_close("rprelu dslope", g[t] + ch, rdsl, sc, ch, 1e-6);
                check_close("rprelu dshift_out", g[t] + 2 * ch, rdso, sc, ch, 1e-6);
            } else {
                CHECK(tu_same_bits(y[t], y[0], n) && tu_same_bits(dx[t], dx[0], n) &&
                      tu_same_bits(g[t], g[0], 3 * ch));
            }
        }
        for (int t = 0; t < N_THREADS; t++) free(y[t]), free(dx[t]), free(g[t]);
        free(x), free(dy), free(si), free(sl), free(so), free(g2);
        free(ry), free(rdx), free(rdsi), free(rdsl), free(rdso), free(sc);
    }
}

int main(void) {
    tu_seed(20240611);
    test_conv();
    test_avgpool();
    test_add_accumulate();
    test_concat();
    test_rprelu();
    CHECK_OK(bie_set_num_threads(0));
    return tu_finish();
}
