/* CPU benchmark: bie's binary GEMM and binary linear layer against OpenBLAS sgemm of the
 * same shape, binary conv2d against im2col + sgemm, plus the register-resident XOR+popcount
 * limit of this machine.
 *
 * Usage: bie_bench [--threads N] [--min-time S] [--max-runs R] [--settle-ms T] [--trace]
 *                  [filter...]
 * Each filter is a substring of case names (none = all cases). One JSON object per line on
 * stdout; ratio = baseline_s / ours_s (> 1: bie is faster). Ops are counted as 2 per
 * multiply-accumulate (binary or float). Times are medians over runs interleaved in blocks
 * (see measure()); *_min_s are the fastest runs. --trace prints every sample to stderr. */
#include <cblas.h>
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_layer.h"
#include "bie.h"

/* ---------------------------------------------------------------- settings */

static int g_threads = 2;
static double g_min_time = 0.5; /* seconds per side */
static int g_max_runs = 200;
static int g_min_runs = 3;
static double g_block_s = 0.1;   /* runs of one side in a row */
static double g_settle_s = 0.15; /* pause before each block; see measure() */
static bool g_trace;             /* --trace: every sample to stderr */
static char **g_filters;
static int g_nfilters;

static bool selected(const char *name) {
    if (g_nfilters == 0) return true;
    for (int i = 0; i < g_nfilters; i++)
        if (strstr(name, g_filters[i])) return true;
    return false;
}

static void check(bie_status st, const char *what) {
    if (st == BIE_OK) return;
    fprintf(stderr, "bie_bench: %s failed: %s: %s\n", what, bie_status_name(st), bie_last_error());
    exit(1);
}

static void *xmalloc(size_t bytes) {
    void *p = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (p == NULL) {
        fprintf(stderr, "bie_bench: out of memory (%zu bytes)\n", bytes);
        exit(1);
    }
    return p;
}

/* ---------------------------------------------------------------- data */

static uint64_t g_rng = 0x5eed5eedULL;

static uint64_t rnd(void) {
    uint64_t z = (g_rng += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* Uniform in [-1, 1], never zero. */
static float *random_floats(int64_t n) {
    float *p = xmalloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) {
        float v = (float)((double)(rnd() >> 11) * (2.0 / 9007199254740992.0) - 1.0);
        p[i] = v != 0.0f ? v : 0.5f;
    }
    return p;
}

static uint8_t *random_bytes(int64_t n) {
    uint8_t *p = xmalloc((size_t)n);
    for (int64_t i = 0; i < n; i++) p[i] = (uint8_t)rnd();
    return p;
}

static bie_tensor view2(void *data, bie_dtype dt, int64_t d0, int64_t d1) {
    bie_tensor t;
    int64_t shape[2] = {d0, d1};
    check(bie_tensor_view(&t, data, dt, 2, shape), "bie_tensor_view");
    return t;
}

/* ---------------------------------------------------------------- timing */

typedef void (*run_fn)(void *ctx);

typedef struct timing {
    double ours_s, base_s;         /* medians */
    double ours_min_s, base_min_s; /* fastest runs */
    int runs, base_runs;
} timing;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static double timed(run_fn fn, void *ctx) {
    double t0 = now();
    fn(ctx);
    return now() - t0;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Sorts v. */
static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Samples of one side of a comparison. */
typedef struct side {
    const char *who;
    run_fn fn;
    void *ctx;
    double *t, sum;
    int n, block; /* runs so far; runs per block */
} side;

static void sleep_s(double s) {
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

static bool side_done(const side *s) {
    return s->fn == NULL || s->n >= g_max_runs || (s->n >= g_min_runs && s->sum >= g_min_time);
}

/* Settle (let the other runtime's idle threads stop spinning), then one block of runs. */
static void run_block(side *s, bool settle) {
    if (side_done(s)) return;
    if (settle) sleep_s(g_settle_s);
    for (int r = 0; r < s->block && !side_done(s); r++) {
        s->t[s->n] = timed(s->fn, s->ctx);
        if (g_trace) fprintf(stderr, "  %s run %d: %.3f ms\n", s->who, s->n, 1e3 * s->t[s->n]);
        s->sum += s->t[s->n++];
    }
}

/* One warm-up each, then rounds of a block of ours and a block of baseline runs (each block
 * about g_block_s long), until each side has run g_min_time seconds (and g_min_runs times)
 * or g_max_runs times. Medians of the per-run times. Before each block the program sleeps
 * g_settle_s: after a call OpenBLAS's idle threads spin for ~0.1 s and OpenMP's for a few
 * ms, and on 2 cores that spinning slowed the other side 2-7x when runs alternated one by one. */
static timing measure(run_fn ours, void *oc, run_fn base, void *bc) {
    side sd[2] = {{"ours", ours, oc, NULL, 0, 0, 1}, {"base", base, bc, NULL, 0, 0, 1}};
    for (int i = 0; i < 2; i++) {
        if (sd[i].fn == NULL) continue;
        if (base) sleep_s(g_settle_s);
        double warm = timed(sd[i].fn, sd[i].ctx);
        /* Blocks of ~g_block_s, at most a quarter of g_max_runs, so that fast cases still
         * alternate a few times. */
        double cap = (g_max_runs + 3) / 4, want = g_block_s / (warm > 1e-7 ? warm : 1e-7);
        sd[i].block = want < 1 ? 1 : want > cap ? (int)cap : (int)want;
        sd[i].t = xmalloc((size_t)g_max_runs * sizeof(double));
    }
    while (!side_done(&sd[0]) || !side_done(&sd[1])) {
        run_block(&sd[0], base != NULL);
        run_block(&sd[1], true);
    }
    timing t = {median(sd[0].t, sd[0].n),
                base ? median(sd[1].t, sd[1].n) : 0.0,
                sd[0].t[0],
                base ? sd[1].t[0] : 0.0,
                sd[0].n,
                sd[1].n};
    free(sd[0].t);
    free(sd[1].t);
    return t;
}

/* One JSON line. ops: operations per run (2 per multiply-accumulate) of each side; extra: a
 * JSON fragment (",\"key\":value...") or "". */
static void emit(const char *name, const char *label, const char *kernel, int threads, int64_t m,
                 int64_t n, int64_t k, timing t, double ours_ops, double base_ops,
                 const char *extra) {
    printf("{\"name\":\"%s\",\"label\":\"%s\",\"kernel\":", name, label);
    if (kernel)
        printf("\"%s\"", kernel);
    else
        printf("null");
    printf(",\"threads\":%d,\"m\":%lld,\"n\":%lld,\"k\":%lld,\"ours_s\":%.6e,\"baseline_s\":%.6e,"
           "\"ratio\":%.4f,\"ours_gops\":%.2f,\"baseline_gflops\":%.2f,\"runs\":%d,"
           "\"baseline_runs\":%d,\"ours_min_s\":%.6e,\"baseline_min_s\":%.6e%s}\n",
           threads, (long long)m, (long long)n, (long long)k, t.ours_s, t.base_s,
           t.base_s > 0 ? t.base_s / t.ours_s : 0.0, ours_ops / t.ours_s / 1e9,
           t.base_s > 0 ? base_ops / t.base_s / 1e9 : 0.0, t.runs, t.base_runs, t.ours_min_s,
           t.base_min_s, extra);
    fflush(stdout);
}

/* ---------------------------------------------------------------- kernels */

/* The kernel bie_binary_gemm(-1, ...) and the layers pick for m rows. */
static int default_kernel_id(int64_t m) {
    bie_kernel_info info;
    check(bie_kernel_default(BIE_OP_BINARY_GEMM, m, &info), "bie_kernel_default");
    return info.id;
}

static const char *kernel_name(int id) {
    bie_kernel_info info;
    if (id < 0) return "unknown";
    check(bie_kernel_find(id, &info), "bie_kernel_find");
    return info.name;
}

/* ---------------------------------------------------------------- float baselines */

typedef struct sgemm_ctx {
    int m, n, k;
    const float *a, *b; /* a [m, k], b [n, k] */
    float *c;
} sgemm_ctx;

static void run_sgemm(void *p) {
    sgemm_ctx *s = p;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, s->m, s->n, s->k, 1.0f, s->a, s->k, s->b,
                s->k, 0.0f, s->c, s->n);
}

/* Float linear layer backward: grad_x = G @ W, grad_W = G^T @ X. */
typedef struct float_bwd_ctx {
    int m, n, k;
    const float *g, *w, *x; /* g [m, n], w [n, k], x [m, k] */
    float *gx, *gw;
} float_bwd_ctx;

static void run_float_bwd(void *p) {
    float_bwd_ctx *s = p;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, s->m, s->k, s->n, 1.0f, s->g, s->n, s->w,
                s->k, 0.0f, s->gx, s->k);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, s->n, s->k, s->m, 1.0f, s->g, s->n, s->x,
                s->k, 0.0f, s->gw, s->k);
}

/* ---------------------------------------------------------------- binary GEMM cases */

typedef struct bgemm_ctx {
    int kernel_id;
    int64_t m, n, k, row_bytes;
    const uint8_t *a, *b;
    float *out;
} bgemm_ctx;

static void run_bgemm(void *p) {
    bgemm_ctx *s = p;
    check(bie_binary_gemm(s->kernel_id, s->m, s->n, s->k, s->a, s->row_bytes, s->b, s->row_bytes,
                          1.0f, s->out),
          "bie_binary_gemm");
}

/* Whether out matches the exact dot products (all of them when small, else a sample). */
static bool bgemm_correct(const bgemm_ctx *s) {
    int64_t total = s->m * s->n, samples = total < 4096 ? total : 4096;
    for (int64_t t = 0; t < samples; t++) {
        int64_t idx = samples == total ? t : (int64_t)(rnd() % (uint64_t)total);
        const uint8_t *ai = s->a + (idx / s->n) * s->row_bytes;
        const uint8_t *bj = s->b + (idx % s->n) * s->row_bytes;
        int64_t popc = 0;
        for (int64_t c = 0; c < s->k; c++) popc += ((ai[c >> 3] ^ bj[c >> 3]) >> (c & 7)) & 1;
        if (s->out[idx] != (float)(s->k - 2 * popc)) return false;
    }
    return true;
}

static void bench_bgemm(const char *name, int64_t m, int64_t n, int64_t k) {
    char full[160];
    bool any = selected(name);
    for (int i = 0; i < bie_kernel_count() && !any; i++) {
        bie_kernel_info info;
        check(bie_kernel_get(i, &info), "bie_kernel_get");
        snprintf(full, sizeof full, "%s/%s", name, info.name);
        any = selected(full);
    }
    if (!any) return;

    bgemm_ctx ours = {-1, m, n, k, (k + 7) / 8, NULL, NULL, NULL};
    ours.a = random_bytes(m * ours.row_bytes);
    ours.b = random_bytes(n * ours.row_bytes);
    ours.out = xmalloc((size_t)(m * n) * sizeof(float));
    sgemm_ctx base = {(int)m, (int)n, (int)k, random_floats(m * k), random_floats(n * k), NULL};
    base.c = xmalloc((size_t)(m * n) * sizeof(float));
    const double ops = 2.0 * (double)m * (double)n * (double)k;
    char extra[64];

    if (selected(name)) {
        timing t = measure(run_bgemm, &ours, run_sgemm, &base);
        snprintf(extra, sizeof extra, ",\"correct\":%s", bgemm_correct(&ours) ? "true" : "false");
        const char *kernel = kernel_name(default_kernel_id(m));
        emit(name, "bgemm", kernel, g_threads, m, n, k, t, ops, ops, extra);
    }
    for (int i = 0; i < bie_kernel_count(); i++) {
        bie_kernel_info info;
        check(bie_kernel_get(i, &info), "bie_kernel_get");
        snprintf(full, sizeof full, "%s/%s", name, info.name);
        if (!selected(full) || !info.available || info.device != BIE_DEVICE_CPU ||
            info.op != BIE_OP_BINARY_GEMM)
            continue;
        if (strcmp(info.isa, "scalar") == 0 && (double)m * (double)n * (double)k > 1e9) continue;
        ours.kernel_id = info.id;
        timing t = measure(run_bgemm, &ours, run_sgemm, &base);
        snprintf(extra, sizeof extra, ",\"correct\":%s", bgemm_correct(&ours) ? "true" : "false");
        emit(full, "bgemm", info.name, g_threads, m, n, k, t, ops, ops, extra);
    }
    void *bufs[] = {(void *)ours.a, (void *)ours.b, ours.out,
                    (void *)base.a, (void *)base.b, base.c};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
}

/* ---------------------------------------------------------------- layer cases */

typedef struct layer_ctx {
    bie_layer *layer;
    bie_tensor x, out, grad_out, grad_x;
} layer_ctx;

static void run_forward(void *p) {
    layer_ctx *s = p;
    check(bie_layer_forward(s->layer, &s->x, &s->out), "bie_layer_forward");
}

static void run_backward(void *p) {
    layer_ctx *s = p;
    check(bie_layer_backward(s->layer, &s->grad_out, &s->grad_x), "bie_layer_backward");
}

typedef enum layer_mode { LAYER_FWD, LAYER_BWD, LAYER_INFER } layer_mode;

static void bench_layer(const char *name, layer_mode mode, int64_t m, int64_t in, int64_t outf) {
    if (!selected(name)) return;
    layer_ctx s;
    memset(&s, 0, sizeof s);
    check(bie_binary_linear_create(&s.layer, in, outf, bie_cpu(), BIE_F32, true),
          "bie_binary_linear_create");
    check(bie_layer_prepare_params(s.layer), "bie_layer_prepare_params");
    float *x = random_floats(m * in), *y = xmalloc((size_t)(m * outf) * sizeof(float));
    float *g = random_floats(m * outf), *gx = xmalloc((size_t)(m * in) * sizeof(float));
    s.x = view2(x, BIE_F32, m, in);
    s.out = view2(y, BIE_F32, m, outf);
    s.grad_out = view2(g, BIE_F32, m, outf);
    s.grad_x = view2(gx, BIE_F32, m, in);
    if (mode == LAYER_INFER) {
        check(bie_layer_generate_quantized_weight(s.layer, false),
              "bie_layer_generate_quantized_weight");
        check(bie_layer_set_training(s.layer, false), "bie_layer_set_training");
    }
    if (mode == LAYER_BWD) run_forward(&s); /* saves what the backward needs */

    /* Float layer of the same shape: weight [out, in]. */
    float *w = random_floats(outf * in), *c = xmalloc((size_t)(m * outf) * sizeof(float));
    float *fgx = xmalloc((size_t)(m * in) * sizeof(float));
    float *fgw = xmalloc((size_t)(outf * in) * sizeof(float));
    sgemm_ctx fwd = {(int)m, (int)outf, (int)in, x, w, c};
    float_bwd_ctx bwd = {(int)m, (int)outf, (int)in, g, w, x, fgx, fgw};

    const double ops = 2.0 * (double)m * (double)outf * (double)in;
    timing t;
    const char *kernel;
    if (mode == LAYER_BWD) {
        t = measure(run_backward, &s, run_float_bwd, &bwd);
        kernel = NULL; /* the backward runs OpenBLAS sgemm, no bie kernel */
    } else {
        t = measure(run_forward, &s, run_sgemm, &fwd);
        int id = bench_kernel_id(s.layer);
        kernel = kernel_name(id >= 0 ? id : default_kernel_id(m));
    }
    double total_ops = mode == LAYER_BWD ? 2 * ops : ops;
    emit(name, "layer", kernel, g_threads, m, outf, in, t, total_ops, total_ops, "");

    bie_layer_free(s.layer);
    float *bufs[] = {x, y, g, gx, w, c, fgx, fgw};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
}

/* 4-bit linear forward (training mode, float weights quantized per call; or packed) vs a
 * float linear layer (sgemm) of the same shape. */
typedef struct q4_ctx {
    bie_layer *layer;
    bie_tensor x, out;
} q4_ctx;

static void run_q4_forward(void *p) {
    q4_ctx *s = p;
    check(bie_layer_forward(s->layer, &s->x, &s->out), "bie_layer_forward");
}

static void bench_q4_layer(const char *name, bool packed, int64_t m, int64_t in, int64_t outf) {
    if (!selected(name)) return;
    q4_ctx s;
    check(bie_q4_linear_create(&s.layer, in, outf, bie_cpu(), BIE_F32), "bie_q4_linear_create");
    check(bie_layer_prepare_params(s.layer), "bie_layer_prepare_params");
    if (packed) {
        check(bie_layer_generate_quantized_weight(s.layer, true), "generate_quantized_weight");
        check(bie_layer_set_training(s.layer, false), "bie_layer_set_training");
    }
    float *x = random_floats(m * in), *y = xmalloc((size_t)(m * outf) * sizeof(float));
    s.x = view2(x, BIE_F32, m, in);
    s.out = view2(y, BIE_F32, m, outf);
    float *w = random_floats(outf * in), *c = xmalloc((size_t)(m * outf) * sizeof(float));
    sgemm_ctx fwd = {(int)m, (int)outf, (int)in, x, w, c};
    const double ops = 2.0 * (double)m * (double)outf * (double)in;
    timing t = measure(run_q4_forward, &s, run_sgemm, &fwd);
    bie_kernel_info info;
    check(bie_kernel_default(BIE_OP_Q4_GEMM, m, &info), "bie_kernel_default");
    emit(name, "q4", info.name, g_threads, m, outf, in, t, ops, ops, "");
    bie_layer_free(s.layer);
    free(x), free(y), free(w), free(c);
}

/* ---------------------------------------------------------------- conv2d cases */

/* Binary conv2d (NCHW) against a float conv done the usual way: per image, im2col of the
 * float input (zero padding) and OpenBLAS sgemm W [O, C k k] x cols [C k k, OH OW]; the
 * backward as sgemm W^T x G then col2im (grad_x) and im2col(x) then G x cols^T (grad_W).
 * The baseline's im2col/col2im run on one thread: an OpenMP region between OpenBLAS
 * (pthreads) calls would fight its spinning threads (see measure()). */
typedef struct conv_ctx {
    bie_layer *layer;
    bie_layer *q4; /* set for the 4-bit cases (forward only) */
    bie_tensor x, out, grad_out, grad_x;
    int64_t n, c, h, w, o, k, s, p, d, oh, ow;
    const float *fx, *fw, *fg; /* float input, weight [O, C k k], grad_out */
    float *cols, *fout, *fgx, *fgw;
} conv_ctx;

/* Output columns ox with 0 <= ox s + off < w, as [*lo, *hi). */
static void conv_span(const conv_ctx *s, int64_t off, int64_t *lo, int64_t *hi) {
    *lo = off < 0 ? (-off + s->s - 1) / s->s : 0;
    *hi = s->w - off <= 0 ? 0 : (s->w - off + s->s - 1) / s->s;
    if (*hi > s->ow) *hi = s->ow;
    if (*lo > *hi) *lo = *hi;
}

/* cols [C k k, OH OW] (rows in [c, i, j] order) from one image x [C, H, W]; or, with
 * back, x += col2im(cols). */
static void im2col_f32(const conv_ctx *s, float *x, float *cols, bool back) {
    const int64_t plane = s->oh * s->ow;
    for (int64_t r = 0; r < s->c * s->k * s->k; r++) {
        int64_t c = r / (s->k * s->k), i = r / s->k % s->k, j = r % s->k, off = j * s->d - s->p;
        int64_t lo, hi;
        conv_span(s, off, &lo, &hi);
        for (int64_t oy = 0; oy < s->oh; oy++) {
            int64_t iy = oy * s->s - s->p + i * s->d;
            float *row = cols + r * plane + oy * s->ow;
            if (iy < 0 || iy >= s->h) {
                if (!back) memset(row, 0, (size_t)s->ow * sizeof(float));
                continue;
            }
            float *xr = x + (c * s->h + iy) * s->w;
            if (back) {
                for (int64_t ox = lo; ox < hi; ox++) xr[ox * s->s + off] += row[ox];
                continue;
            }
            memset(row, 0, (size_t)lo * sizeof(float));
            if (s->s == 1)
                memcpy(row + lo, xr + lo + off, (size_t)(hi - lo) * sizeof(float));
            else
                for (int64_t ox = lo; ox < hi; ox++) row[ox] = xr[ox * s->s + off];
            memset(row + hi, 0, (size_t)(s->ow - hi) * sizeof(float));
        }
    }
}

static void run_conv_fwd(void *p) {
    conv_ctx *s = p;
    check(bie_layer_forward(s->layer, &s->x, &s->out), "bie_layer_forward");
}

static void run_q4conv_fwd(void *p) {
    conv_ctx *s = p;
    check(bie_layer_forward(s->q4, &s->x, &s->out), "bie_layer_forward");
}

static void run_conv_bwd(void *p) {
    conv_ctx *s = p;
    check(bie_layer_backward(s->layer, &s->grad_out, &s->grad_x), "bie_layer_backward");
}

static void run_fconv_fwd(void *p) {
    conv_ctx *s = p;
    const int plane = (int)(s->oh * s->ow), kc = (int)(s->c * s->k * s->k), o = (int)s->o;
    for (int64_t n = 0; n < s->n; n++) {
        im2col_f32(s, (float *)s->fx + n * s->c * s->h * s->w, s->cols, false);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, o, plane, kc, 1.0f, s->fw, kc,
                    s->cols, plane, 0.0f, s->fout + n * o * plane, plane);
    }
}

static void run_fconv_bwd(void *p) {
    conv_ctx *s = p;
    const int plane = (int)(s->oh * s->ow), kc = (int)(s->c * s->k * s->k), o = (int)s->o;
    const int64_t chw = s->c * s->h * s->w;
    for (int64_t n = 0; n < s->n; n++) {
        const float *g = s->fg + n * o * plane;
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, kc, plane, o, 1.0f, s->fw, kc, g,
                    plane, 0.0f, s->cols, plane);
        memset(s->fgx + n * chw, 0, (size_t)chw * sizeof(float));
        im2col_f32(s, s->fgx + n * chw, s->cols, true);
        im2col_f32(s, (float *)s->fx + n * chw, s->cols, false);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, o, kc, plane, 1.0f, g, plane, s->cols,
                    plane, n ? 1.0f : 0.0f, s->fgw, kc);
    }
}

static bie_tensor view4(float *data, int64_t d0, int64_t d1, int64_t d2, int64_t d3) {
    bie_tensor t;
    int64_t shape[4] = {d0, d1, d2, d3};
    check(bie_tensor_view(&t, data, BIE_F32, 4, shape), "bie_tensor_view");
    return t;
}

static void bench_conv(const char *name, layer_mode mode, bool four_bit, int64_t n, int64_t c,
                       int64_t o, int64_t hw, int k, int pad) {
    if (!selected(name)) return;
    conv_ctx s = {.n = n, .c = c, .h = hw, .w = hw, .o = o, .k = k, .s = 1, .p = pad, .d = 1};
    if (four_bit) {
        check(bie_q4_conv2d_create(&s.q4, c, o, k, 1, pad, 1, bie_cpu(), BIE_F32),
              "bie_q4_conv2d_create");
        check(bie_layer_prepare_params(s.q4), "bie_layer_prepare_params");
        if (mode == LAYER_INFER) {
            check(bie_layer_generate_quantized_weight(s.q4, true), "generate_quantized_weight");
            check(bie_layer_set_training(s.q4, false), "bie_layer_set_training");
        }
    }
    check(bie_binary_conv2d_create(&s.layer, c, o, k, 1, pad, 1, bie_cpu(), BIE_F32, true),
          "bie_binary_conv2d_create");
    check(bie_layer_prepare_params(s.layer), "bie_layer_prepare_params");
    check(bench_output_hw(s.layer, hw, hw, &s.oh, &s.ow), "bie_layer_output_shape");
    const int64_t kc = c * k * k, plane = s.oh * s.ow;
    float *x = random_floats(n * c * hw * hw), *y = xmalloc((size_t)(n * o * plane) * 4);
    float *g = random_floats(n * o * plane), *gx = xmalloc((size_t)(n * c * hw * hw) * 4);
    s.x = view4(x, n, c, hw, hw);
    s.out = view4(y, n, o, s.oh, s.ow);
    s.grad_out = view4(g, n, o, s.oh, s.ow);
    s.grad_x = view4(gx, n, c, hw, hw);
    if (mode == LAYER_INFER && !four_bit) {
        check(bie_layer_generate_quantized_weight(s.layer, true),
              "bie_layer_generate_quantized_weight");
        check(bie_layer_set_training(s.layer, false), "bie_layer_set_training");
    }
    if (mode == LAYER_BWD) run_conv_fwd(&s); /* saves what the backward needs */

    float *w = random_floats(o * kc);
    s.fx = x;
    s.fw = w;
    s.fg = g;
    s.cols = xmalloc((size_t)(kc * plane) * 4);
    s.fout = xmalloc((size_t)(n * o * plane) * 4);
    s.fgx = xmalloc((size_t)(n * c * hw * hw) * 4);
    s.fgw = xmalloc((size_t)(o * kc) * 4);

    const double ops = 2.0 * (double)n * (double)o * (double)plane * (double)kc;
    timing t;
    const char *kernel = NULL; /* the backward runs OpenBLAS sgemm, no bie kernel */
    char extra[160];
    if (mode == LAYER_BWD) {
        t = measure(run_conv_bwd, &s, run_fconv_bwd, &s);
        snprintf(extra, sizeof extra, ",\"shape\":\"N%lld C%lld O%lld %lldx%lld k%d p%d\"",
                 (long long)n, (long long)c, (long long)o, (long long)hw, (long long)hw, k, pad);
    } else {
        t = measure(four_bit ? run_q4conv_fwd : run_conv_fwd, &s, run_fconv_fwd, &s);
        int id = bench_kernel_id(s.layer);
        kernel = kernel_name(id >= 0 ? id : default_kernel_id(o)); /* the layer's m is O */
        if (four_bit) {
            bie_kernel_info info;
            check(bie_kernel_default(BIE_OP_Q4_GEMM, o, &info), "bie_kernel_default");
            kernel = info.name;
        }
        int64_t nan = 0, nonzero = 0;
        for (int64_t i = 0; i < n * o * plane; i++) {
            nan += y[i] != y[i];
            nonzero += y[i] != 0.0f;
        }
        snprintf(extra, sizeof extra,
                 ",\"shape\":\"N%lld C%lld O%lld %lldx%lld k%d p%d\",\"output_ok\":%s",
                 (long long)n, (long long)c, (long long)o, (long long)hw, (long long)hw, k, pad,
                 nan == 0 && nonzero > 0 ? "true" : "false");
    }
    double total_ops = mode == LAYER_BWD ? 2 * ops : ops;
    emit(name, "conv2d", kernel, g_threads, o, n * plane, kc, t, total_ops, total_ops, extra);

    bie_layer_free(s.layer);
    bie_layer_free(s.q4);
    float *bufs[] = {x, y, g, gx, w, s.cols, s.fout, s.fgx, s.fgw};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
}

/* ---------------------------------------------------------------- popcount limit */

/* The library's AVX2 method (kernels/avx2/bgemm_avx2.c): nibble panels, so each 4x2 tile
 * element costs one XOR, one vpshufb and one byte add per 128 bits, with a vpsadbw widening
 * every 63 steps. PEAK_OPS counts the binary ops of one 63-step block. */
#define PEAK_STEPS 63
#define PEAK_OPS (4.0 * 2.0 * PEAK_STEPS * 128.0 * 2.0)

static volatile uint64_t g_sink;

__attribute__((target("avx2"))) static uint64_t hsum256(__m256i v) {
    __m128i s = _mm_add_epi64(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    return (uint64_t)_mm_cvtsi128_si64(s) + (uint64_t)_mm_extract_epi64(s, 1);
}

#define NIBBLE_LUT                                                                                 \
    _mm256_setr_epi8(0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4, 0, 1, 1, 2, 1, 2, 2, 3, 1, 2, \
                     2, 3, 2, 3, 3, 4)

/* Both loops are written in asm so that the compiler cannot drop or hoist them and keeps
 * all 8 accumulators in registers (GCC 12 spills some when this is written in C). */
#define PEAK_MAC(c, a, b)                \
    "vpxor %[" b "], %[" a "], %[t]\n\t" \
    "vpshufb %[t], %[lut], %[t]\n\t"     \
    "vpaddb %[t], %[" c "], %[" c "]\n\t"
/* accumulators c<i><j>: row a<i> against column b<j> */
#define PEAK_MACS4(b, j)      \
    PEAK_MAC("c0" j, "a0", b) \
    PEAK_MAC("c1" j, "a1", b) PEAK_MAC("c2" j, "a2", b) PEAK_MAC("c3" j, "a3", b)
#define PEAK_ALL_MACS(b0, b1) PEAK_MACS4(b0, "0") PEAK_MACS4(b1, "1")
#define PEAK_ACC_OPERANDS                                                                     \
    [c00] "+x"(c[0]), [c10] "+x"(c[1]), [c20] "+x"(c[2]), [c30] "+x"(c[3]), [c01] "+x"(c[4]), \
        [c11] "+x"(c[5]), [c21] "+x"(c[6]), [c31] "+x"(c[7]), [t] "=&x"(t)

__attribute__((target("avx2"))) static __m256i peak_widen(const __m256i c[8], __m256i wide) {
    const __m256i z = _mm256_setzero_si256();
    for (int i = 0; i < 8; i++) wide = _mm256_add_epi64(wide, _mm256_sad_epu8(c[i], z));
    return wide;
}

/* Operands in registers: per step 8 x (XOR, vpshufb, byte add), no loads. */
__attribute__((target("avx2"), noinline)) static void peak_registers(int64_t blocks,
                                                                     const uint8_t *a,
                                                                     const uint8_t *b) {
    const __m256i lut = NIBBLE_LUT, *av = (const __m256i *)a, *bv = (const __m256i *)b;
    const __m256i a0 = _mm256_loadu_si256(av), a1 = _mm256_loadu_si256(av + 1);
    const __m256i a2 = _mm256_loadu_si256(av + 2), a3 = _mm256_loadu_si256(av + 3);
    const __m256i b0 = _mm256_loadu_si256(bv), b1 = _mm256_loadu_si256(bv + 1);
    __m256i wide = _mm256_setzero_si256(), t;
    for (int64_t blk = 0; blk < blocks; blk++) {
        __m256i c[8];
        for (int i = 0; i < 8; i++) c[i] = _mm256_setzero_si256();
        for (int s = 0; s < PEAK_STEPS; s++)
            __asm__ volatile(PEAK_ALL_MACS("b0", "b1")
                             : PEAK_ACC_OPERANDS
                             : [a0] "x"(a0), [a1] "x"(a1), [a2] "x"(a2), [a3] "x"(a3), [b0] "x"(b0),
                               [b1] "x"(b1), [lut] "x"(lut));
        wide = peak_widen(c, wide);
    }
    g_sink += hsum256(wide);
}

/* The library's 4x2 micro-kernel step on L1-resident panels: 4 + 2 aligned loads, then
 * the same 8 x (XOR, vpshufb, byte add). */
__attribute__((target("avx2"), noinline)) static void peak_l1(int64_t blocks, const uint8_t *a,
                                                              const uint8_t *b) {
    const __m256i lut = NIBBLE_LUT;
    __m256i wide = _mm256_setzero_si256(), t, a0, a1, a2, a3, b0, b1;
    for (int64_t blk = 0; blk < blocks; blk++) {
        __m256i c[8];
        for (int i = 0; i < 8; i++) c[i] = _mm256_setzero_si256();
        for (int s = 0; s < PEAK_STEPS; s++) {
            const uint8_t *as = a + s * 4 * 32, *bs = b + s * 2 * 32;
            __asm__ volatile("vmovdqa (%[as]), %[a0]\n\t"
                             "vmovdqa 32(%[as]), %[a1]\n\t"
                             "vmovdqa 64(%[as]), %[a2]\n\t"
                             "vmovdqa 96(%[as]), %[a3]\n\t"
                             "vmovdqa (%[bs]), %[b0]\n\t"
                             "vmovdqa 32(%[bs]), %[b1]\n\t" PEAK_ALL_MACS("b0", "b1")
                             : PEAK_ACC_OPERANDS, [a0] "=&x"(a0), [a1] "=&x"(a1), [a2] "=&x"(a2),
                               [a3] "=&x"(a3), [b0] "=&x"(b0), [b1] "=&x"(b1)
                             : [as] "r"(as), [bs] "r"(bs), [lut] "x"(lut)
                             : "memory");
        }
        wide = peak_widen(c, wide);
    }
    g_sink += hsum256(wide);
}

typedef struct peak_ctx {
    bool l1;
    int threads;
    int64_t blocks;
    uint8_t *a[64], *b[64]; /* per-thread panels */
} peak_ctx;

static void run_peak(void *p) {
    peak_ctx *s = p;
#pragma omp parallel num_threads(s->threads)
    {
        int t = omp_get_thread_num();
        if (s->l1)
            peak_l1(s->blocks, s->a[t], s->b[t]);
        else
            peak_registers(s->blocks, s->a[t], s->b[t]);
    }
}

static void bench_peak(const char *name, bool l1) {
    if (!selected(name)) return;
    if (!__builtin_cpu_supports("avx2")) {
        fprintf(stderr, "bie_bench: %s skipped: no AVX2\n", name);
        return;
    }
    peak_ctx s = {l1, 1, 20000, {NULL}, {NULL}};
    int nt = g_threads < 64 ? g_threads : 64;
    for (int t = 0; t < nt; t++) {
        s.a[t] = random_bytes(PEAK_STEPS * 4 * 32);
        s.b[t] = random_bytes(PEAK_STEPS * 2 * 32);
        for (int i = 0; i < PEAK_STEPS * 4 * 32; i++) s.a[t][i] &= 15;
        for (int i = 0; i < PEAK_STEPS * 2 * 32; i++) s.b[t][i] &= 15;
    }
    const double ops = PEAK_OPS * (double)s.blocks;
    timing one = measure(run_peak, &s, NULL, NULL); /* one core */
    s.threads = nt;
    timing all = measure(run_peak, &s, NULL, NULL);
    char extra[256];
    snprintf(extra, sizeof extra,
             ",\"best_gops\":%.2f,\"all_threads\":%d,\"all_threads_gops\":%.2f,"
             "\"all_threads_best_gops\":%.2f",
             ops / one.ours_min_s / 1e9, nt, ops * nt / all.ours_s / 1e9,
             ops * nt / all.ours_min_s / 1e9);
    emit(name, "limit", l1 ? "bench.avx2.nibble_4x2_l1" : "bench.avx2.nibble_4x2_registers", 1, 0,
         0, 0, one, ops, 0, extra);
    for (int t = 0; t < nt; t++) {
        free(s.a[t]);
        free(s.b[t]);
    }
}

/* ---------------------------------------------------------------- main */

int main(int argc, char **argv) {
    g_filters = xmalloc((size_t)argc * sizeof(char *));
    for (int i = 1; i < argc; i++) {
        const char *opt = argv[i];
        bool has_value = i + 1 < argc;
        if (strcmp(opt, "--threads") == 0 && has_value) {
            g_threads = atoi(argv[++i]);
        } else if (strcmp(opt, "--min-time") == 0 && has_value) {
            g_min_time = atof(argv[++i]);
        } else if (strcmp(opt, "--max-runs") == 0 && has_value) {
            g_max_runs = atoi(argv[++i]);
        } else if (strcmp(opt, "--settle-ms") == 0 && has_value) {
            g_settle_s = atof(argv[++i]) / 1000.0;
        } else if (strcmp(opt, "--trace") == 0) {
            g_trace = true;
        } else if (strncmp(opt, "--", 2) == 0) {
            fprintf(stderr,
                    "usage: %s [--threads N] [--min-time S] [--max-runs R] [--settle-ms T] "
                    "[--trace] [filter...]\n",
                    argv[0]);
            return 2;
        } else {
            g_filters[g_nfilters++] = argv[i];
        }
    }
    if (g_threads < 1 || g_max_runs < 1 || !(g_min_time >= 0) || !(g_settle_s >= 0)) {
        fprintf(stderr, "bie_bench: --threads and --max-runs must be >= 1, --min-time and "
                        "--settle-ms >= 0\n");
        return 2;
    }
    if (g_min_runs > g_max_runs) g_min_runs = g_max_runs;
    check(bie_set_num_threads(g_threads), "bie_set_num_threads");
    openblas_set_num_threads(g_threads);
    omp_set_num_threads(g_threads);
    fprintf(stderr, "bie_bench: bie %s, CPU kernel set %s, %d threads (bie %d), OpenBLAS %s\n",
            bie_version_string(), bie_cpu_kernel_set(), g_threads, bie_get_num_threads(),
            openblas_get_config());

    bench_peak("popcount_peak", false);
    bench_peak("popcount_peak_l1", true);
    bench_bgemm("bgemm_2048", 2048, 2048, 2048);
    bench_bgemm("bgemm_m64", 64, 4096, 4096);
    bench_bgemm("bgemm_m1", 1, 4096, 4096);
    bench_layer("layer_fwd_m64", LAYER_FWD, 64, 4096, 4096);
    bench_layer("layer_fwd_2048", LAYER_FWD, 2048, 2048, 2048);
    bench_layer("layer_bwd_2048", LAYER_BWD, 2048, 2048, 2048);
    bench_layer("layer_infer_m1", LAYER_INFER, 1, 4096, 4096);
    bench_q4_layer("q4_linear_m64", false, 64, 4096, 4096);
    bench_q4_layer("q4_linear_m64_packed", true, 64, 4096, 4096);
    bench_conv("conv_256x14_n8", LAYER_FWD, false, 8, 256, 256, 14, 3, 1);
    bench_conv("conv_64x56_n1", LAYER_FWD, false, 1, 64, 64, 56, 3, 1);
    bench_conv("conv_256x14_n8_infer", LAYER_INFER, false, 8, 256, 256, 14, 3, 1);
    bench_conv("conv_256x14_n8_bwd", LAYER_BWD, false, 8, 256, 256, 14, 3, 1);
    bench_conv("q4conv_256x14_n8", LAYER_FWD, true, 8, 256, 256, 14, 3, 1);
    bench_conv("q4conv_256x14_n8_infer", LAYER_INFER, true, 8, 256, 256, 14, 3, 1);
    free(g_filters);
    return 0;
}
