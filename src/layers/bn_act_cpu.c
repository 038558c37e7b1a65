/* The CPU kernels of the fused batch norm, residual add and PReLU (bie.h §7; bn_act.c checks
 * the arguments): float32 data, sums in double.
 *
 * Two layouts of [outer][C][inner], as on CUDA: rows (inner = 1: channels-last, [N][C]) walk
 * each row's channels contiguously, a block of rows at a time, with one accumulator per
 * channel; planes (inner > 1) walk each (image, channel) plane with kLanes accumulators by
 * position. Both split the work in pieces fixed by the shape alone and add the pieces in
 * order, so the results do not depend on the number of threads. The statistics are sums of
 * y - shift (shift: the channel's first element) and their squares, as on CUDA; the terms of a
 * plane are summed in float lanes, flushed into double every kFlush elements. Compiled with
 * -fno-trapping-math (the selects below then vectorize; nothing here relies on floating-point
 * traps, and NaNs still propagate) and -ffp-contract=off (CMakeLists.txt). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bn_act_cpu.h"

enum { kLanes = 8, kMaxBlocks = 1024, kMinBlockRows = 64 };

static float vec_at(const bie_tensor *t, int64_t c, float absent) {
    if (t == NULL) return absent;
    const float *v = t->data;
    return t->shape[0] == 1 ? v[0] : v[c];
}

/* Per channel: the map z = y a + b + res and the slope (1 without an activation). */
typedef struct {
    float *a, *b, *s;
} bn_consts;

static bool consts_alloc(bn_consts *k, int64_t c) {
    k->a = malloc((size_t)c * 3 * sizeof(float));
    k->b = k->a ? k->a + c : NULL;
    k->s = k->a ? k->a + 2 * c : NULL;
    return k->a != NULL;
}

static void consts_fill(const bie_bn_act_params *p, int64_t C, const float *mean, const float *rstd,
                        bn_consts *k) {
    for (int64_t c = 0; c < C; c++) {
        k->a[c] = vec_at(p->gamma, c, 1.0f) * rstd[c];
        k->b[c] = vec_at(p->beta, c, 0.0f) - mean[c] * k->a[c];
        k->s[c] = vec_at(p->slope, c, 1.0f);
    }
}

/* The rows' blocks: at most kMaxBlocks of at least kMinBlockRows rows. */
static int64_t block_rows(int64_t rows) {
    int64_t b = (rows + kMaxBlocks - 1) / kMaxBlocks;
    return b < kMinBlockRows ? kMinBlockRows : b;
}

/* ---------------------------------------------------------------- sums
 * n = 2 (forward): sums of d = y - shift and d d. n = 3 (backward): sums of dz, dz xhat and,
 * where z <= 0, z g. out[j * C + c] gets sum j of channel c. The element terms below are
 * branch-free (selects) so that the loops over a row's channels or a plane's lanes vectorize;
 * without an activation the slope is 1 (dz = g either way) and the third sum is unused. */

typedef struct {
    int n;
    const float *y, *res, *g, *shift, *mean, *rstd;
    const float *zeros; /* a run's worth of zeros, read where res is NULL */
    bn_consts k;
} bn_sums;

static inline void stat_terms(float y, float shift, double *t0, double *t1) {
    const double d = (double)y - shift;
    *t0 += d, *t1 += d * d;
}

static inline void grad_terms(float y, float r, float g, float a, float b, float s, float mean,
                              float rstd, double *t0, double *t1, double *t2) {
    const float z = y * a + b + r, sg = s * g; /* both sides of each select, computed */
    const double zg = (double)z * g;
    const bool pos = z > 0.0f;
    const float dz = pos ? g : sg;
    *t0 += dz;
    *t1 += (double)dz * (((double)y - mean) * rstd);
    *t2 += pos ? 0.0 : zg;
}

/* Rows [r0, r1) of the rows layout into acc[3][C]. */
static void rows_block(const bn_sums *s, int64_t r0, int64_t r1, int64_t C, double *acc) {
    const float *restrict y = s->y, *restrict res = s->res, *restrict g = s->g;
    double *restrict a0 = acc, *restrict a1 = acc + C, *restrict a2 = acc + 2 * C;
    for (int64_t r = r0; r < r1; r++) {
        const float *restrict yr = y + r * C;
        if (s->n == 2) {
            for (int64_t c = 0; c < C; c++) stat_terms(yr[c], s->shift[c], &a0[c], &a1[c]);
            continue;
        }
        const float *restrict gr = g + r * C, *restrict rr = res ? res + r * C : s->zeros;
        for (int64_t c = 0; c < C; c++)
            grad_terms(yr[c], rr[c], gr[c], s->k.a[c], s->k.b[c], s->k.s[c], s->mean[c], s->rstd[c],
                       &a0[c], &a1[c], &a2[c]);
    }
}

static bie_status sums_rows(const bn_sums *s, int64_t rows, int64_t C, double *out) {
    const int64_t br = block_rows(rows), blocks = (rows + br - 1) / br;
    double *part = calloc((size_t)(blocks ? blocks : 1) * 3 * (size_t)C, sizeof *part);
    if (part == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "bie_bn_act (cpu): sums");
#pragma omp parallel for schedule(static)
    for (int64_t bl = 0; bl < blocks; bl++)
        rows_block(s, bl * br, (bl + 1) * br < rows ? (bl + 1) * br : rows, C, part + bl * 3 * C);
    memset(out, 0, (size_t)s->n * (size_t)C * sizeof *out);
    for (int64_t bl = 0; bl < blocks; bl++)
        for (int64_t j = 0; j < s->n * C; j++) out[j] += part[bl * 3 * C + j];
    free(part);
    return BIE_OK;
}

/* One plane (n elements of channel c from at) into the lanes t[3][kLanes] by position. */
/* A plane's terms in float, kLanes lanes by position, each run of kFlush elements then added
 * to the double lanes t: float arithmetic vectorizes twice as wide, and no float sum takes
 * more than kFlush / kLanes terms. */
enum { kFlush = 512 };

static inline void stat_f(float y, float shift, float *t0, float *t1) {
    const float d = y - shift;
    *t0 += d, *t1 += d * d;
}

static inline void grad_f(float y, float r, float g, float a, float b, float s, float mean,
                          float rstd, float *t0, float *t1, float *t2) {
    const float z = y * a + b + r, sg = s * g, zg = z * g;
    const bool pos = z > 0.0f;
    const float dz = pos ? g : sg;
    *t0 += dz, *t1 += dz * ((y - mean) * rstd), *t2 += pos ? 0.0f : zg;
}

static void plane_sums(const bn_sums *s, int64_t c, int64_t at, int64_t n, double t[3][kLanes]) {
    const float *restrict y = s->y + at, *restrict g = s->g ? s->g + at : NULL;
    const float *restrict r = s->res ? s->res + at : s->zeros;
    const float sh = s->shift ? s->shift[c] : 0.0f;
    const float a = s->k.a ? s->k.a[c] : 0.0f, b = s->k.a ? s->k.b[c] : 0.0f;
    const float sl = s->k.a ? s->k.s[c] : 0.0f, m = s->mean ? s->mean[c] : 0.0f;
    const float rs = s->rstd ? s->rstd[c] : 0.0f;
    for (int64_t i0 = 0; i0 < n; i0 += kFlush) {
        const int64_t i1 = i0 + kFlush < n ? i0 + kFlush : n;
        const int64_t whole = i0 + (i1 - i0) / kLanes * kLanes; /* i0: a multiple of kLanes */
        float f[3][kLanes] = {{0.0f}};
        if (s->n == 2) {
            for (int64_t i = i0; i < whole; i += kLanes)
                for (int l = 0; l < kLanes; l++) stat_f(y[i + l], sh, &f[0][l], &f[1][l]);
            for (int64_t i = whole; i < i1; i++)
                stat_f(y[i], sh, &f[0][i - whole], &f[1][i - whole]);
        } else {
            for (int64_t i = i0; i < whole; i += kLanes)
                for (int l = 0; l < kLanes; l++)
                    grad_f(y[i + l], r[i + l], g[i + l], a, b, sl, m, rs, &f[0][l], &f[1][l],
                           &f[2][l]);
            for (int64_t i = whole; i < i1; i++)
                grad_f(y[i], r[i], g[i], a, b, sl, m, rs, &f[0][i - whole], &f[1][i - whole],
                       &f[2][i - whole]);
        }
        for (int j = 0; j < 3; j++)
            for (int l = 0; l < kLanes; l++) t[j][l] += f[j][l];
    }
}

static void sums_planes(const bn_sums *s, int64_t outer, int64_t C, int64_t inner, double *out) {
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < C; c++) {
        double tot[3] = {0.0, 0.0, 0.0};
        for (int64_t o = 0; o < outer; o++) {
            double lane[3][kLanes] = {{0.0}};
            plane_sums(s, c, (o * C + c) * inner, inner, lane);
            for (int j = 0; j < 3; j++)
                for (int l = 0; l < kLanes; l++) tot[j] += lane[j][l];
        }
        for (int j = 0; j < s->n; j++) out[j * C + c] = tot[j];
    }
}

static bie_status sums(const bn_sums *s, int64_t outer, int64_t C, int64_t inner, double *out) {
    if (inner == 1) return sums_rows(s, outer, C, out);
    sums_planes(s, outer, C, inner, out);
    return BIE_OK;
}

/* ---------------------------------------------------------------- elementwise passes
 * A run: one row (channels 0 .. C - 1, constants by element) or one plane (one channel). */

static inline float act_out(float y, float r, float a, float b, float s) {
    const float z = y * a + b + r, sz = s * z;
    return z > 0.0f ? z : sz;
}

static void forward_run(const float *restrict y, const float *restrict res, float *restrict out,
                        int64_t n, const bn_consts *k, int64_t c, bool by_element) {
    if (by_element) {
        const float *restrict a = k->a, *restrict b = k->b, *restrict s = k->s;
        for (int64_t i = 0; i < n; i++) out[i] = act_out(y[i], res[i], a[i], b[i], s[i]);
        return;
    }
    const float a = k->a[c], b = k->b[c], s = k->s[c];
    for (int64_t i = 0; i < n; i++) out[i] = act_out(y[i], res[i], a, b, s);
}

/* The backward's per-channel constants: the map, the slope, and grad_y = k1 dz + c2 (y - mean)
 * + c3. */
typedef struct {
    const float *a, *b, *s, *k1, *c2, *c3, *mean;
} bn_bwd;

static inline void backward_elems(const float *restrict y, const float *restrict res,
                                  const float *restrict g, float *restrict gy, float *restrict gr,
                                  int64_t n, const bn_bwd *q, int64_t c, bool by_element,
                                  bool has_gr) {
    for (int64_t i = 0; i < n; i++) {
        const int64_t ch = by_element ? i : c;
        const float z = y[i] * q->a[ch] + q->b[ch] + res[i], sg = q->s[ch] * g[i];
        const float dz = z > 0.0f ? g[i] : sg;
        if (has_gr) gr[i] = dz;
        gy[i] = q->k1[ch] * dz + q->c2[ch] * (y[i] - q->mean[ch]) + q->c3[ch];
    }
}

/* (the four variants spelled out, so that each inner loop is branch-free) */
static void backward_run(const float *y, const float *res, const float *g, float *gy, float *gr,
                         int64_t n, const bn_bwd *q, int64_t c, bool by_element) {
    if (by_element && gr)
        backward_elems(y, res, g, gy, gr, n, q, c, true, true);
    else if (by_element)
        backward_elems(y, res, g, gy, gr, n, q, c, true, false);
    else if (gr)
        backward_elems(y, res, g, gy, gr, n, q, c, false, true);
    else
        backward_elems(y, res, g, gy, gr, n, q, c, false, false);
}

/* ---------------------------------------------------------------- passes */

bie_status bie_bn_act_cpu_forward(const bie_bn_act_params *p, int64_t outer, int64_t C,
                                  int64_t inner, const float *y, const float *res, float *save_mean,
                                  float *save_rstd, float *out) {
    bn_consts k;
    double *tot = malloc((size_t)C * 2 * sizeof *tot);
    float *shift = malloc((size_t)C * sizeof *shift);
    float *zeros = calloc((size_t)(inner == 1 ? C : inner), sizeof *zeros); /* res NULL */
    if (tot == NULL || shift == NULL || zeros == NULL || !consts_alloc(&k, C)) {
        free(tot), free(shift), free(zeros);
        return bie_fail(BIE_ERR_OUT_OF_MEMORY, "bie_bn_act_forward (cpu): %lld channels",
                        (long long)C);
    }
    float *rm = p->running_mean ? p->running_mean->data : NULL;
    float *rv = p->running_var ? p->running_var->data : NULL;
    const int64_t count = outer * inner;
    bie_status st = BIE_OK;
    if (p->training) {
        for (int64_t c = 0; c < C; c++) shift[c] = y[c * inner];
        const bn_sums s = {.n = 2, .y = y, .shift = shift};
        st = sums(&s, outer, C, inner, tot);
        for (int64_t c = 0; c < C && st == BIE_OK; c++) {
            const double d = tot[c] / (double)count, m = shift[c] + d;
            const double var = fmax(tot[C + c] / (double)count - d * d, 0.0);
            save_mean[c] = (float)m;
            save_rstd[c] = (float)(1.0 / sqrt(var + (double)p->eps));
            if (rm) {
                const double mo = p->momentum;
                rm[c] = (float)((1.0 - mo) * rm[c] + mo * m);
                rv[c] =
                    (float)((1.0 - mo) * rv[c] + mo * (var * (double)count / (double)(count - 1)));
            }
        }
    } else {
        for (int64_t c = 0; c < C; c++) {
            save_mean[c] = rm[c];
            save_rstd[c] = (float)(1.0 / sqrt((double)rv[c] + (double)p->eps));
        }
    }
    if (st == BIE_OK) {
        consts_fill(p, C, save_mean, save_rstd, &k);
        const bool rows = inner == 1;
        const int64_t n_c = rows ? 1 : C, n_i = rows ? C : inner;
#pragma omp parallel for collapse(2) schedule(static)
        for (int64_t o = 0; o < outer; o++)
            for (int64_t cc = 0; cc < n_c; cc++) {
                const int64_t at = (o * n_c + cc) * n_i;
                forward_run(y + at, res ? res + at : zeros, out + at, n_i, &k, cc, rows);
            }
    }
    free(tot), free(shift), free(zeros), free(k.a);
    return st;
}

bie_status bie_bn_act_cpu_backward(const bie_bn_act_params *p, int64_t outer, int64_t C,
                                   int64_t inner, const float *gout, const float *y,
                                   const float *res, const float *save_mean, const float *save_rstd,
                                   float *grad_y, float *grad_res, float *grad_gamma,
                                   float *grad_beta, float *grad_slope) {
    bn_consts k;
    double *tot = malloc((size_t)C * 3 * sizeof *tot);
    float *k1 = malloc((size_t)C * 3 * sizeof *k1);
    float *zeros = calloc((size_t)(inner == 1 ? C : inner), sizeof *zeros); /* res NULL */
    if (tot == NULL || k1 == NULL || zeros == NULL || !consts_alloc(&k, C)) {
        free(tot), free(k1), free(zeros);
        return bie_fail(BIE_ERR_OUT_OF_MEMORY, "bie_bn_act_backward (cpu): %lld channels",
                        (long long)C);
    }
    consts_fill(p, C, save_mean, save_rstd, &k);
    const bn_sums s = {.n = 3,
                       .y = y,
                       .res = res,
                       .g = gout,
                       .mean = save_mean,
                       .rstd = save_rstd,
                       .zeros = zeros,
                       .k = k};
    const bie_status st = sums(&s, outer, C, inner, tot);
    if (st == BIE_OK) {
        float *c2 = k1 + C, *c3 = k1 + 2 * C;
        const double n = (double)(outer * inner);
        double slope_total = 0.0;
        for (int64_t c = 0; c < C; c++) {
            if (grad_gamma) grad_gamma[c] = (float)tot[C + c];
            if (grad_beta) grad_beta[c] = (float)tot[c];
            if (grad_slope && p->slope->shape[0] == C) grad_slope[c] = (float)tot[2 * C + c];
            slope_total += tot[2 * C + c];
            const double kk = (double)vec_at(p->gamma, c, 1.0f) * save_rstd[c];
            k1[c] = (float)kk;
            c2[c] = p->training ? (float)(-kk * save_rstd[c] * tot[C + c] / n) : 0.0f;
            c3[c] = p->training ? (float)(-kk * tot[c] / n) : 0.0f;
        }
        if (grad_slope && p->slope->shape[0] != C) grad_slope[0] = (float)slope_total;
        const bn_bwd q = {k.a, k.b, k.s, k1, c2, c3, save_mean};
        const bool rows = inner == 1;
        const int64_t n_c = rows ? 1 : C, n_i = rows ? C : inner;
#pragma omp parallel for collapse(2) schedule(static)
        for (int64_t o = 0; o < outer; o++)
            for (int64_t cc = 0; cc < n_c; cc++) {
                const int64_t at = (o * n_c + cc) * n_i;
                backward_run(y + at, res ? res + at : zeros, gout + at, grad_y + at,
                             grad_res ? grad_res + at : NULL, n_i, &q, cc, rows);
            }
    }
    free(tot), free(k1), free(zeros), free(k.a);
    return st;
}
