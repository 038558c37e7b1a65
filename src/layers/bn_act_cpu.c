/* The CPU kernels of the fused batch norm, residual add and PReLU (bie.h §7; bn_act.c checks
 * the arguments): float32 data, float partial sums added into double.
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

/* Rows [r0, r1) of the rows layout into acc[3][C]: each row's terms added to the float sums
 * fa[3][C] (a loop over the row's channels, vectorized), which go into acc every kRowFlush
 * rows. */
enum { kRowFlush = 64 };

static void rows_block(const bn_sums *s, int64_t r0, int64_t r1, int64_t C, double *acc,
                       float *restrict fa) {
    const float *restrict y = s->y, *restrict res = s->res, *restrict g = s->g;
    float *restrict f0 = fa, *restrict f1 = fa + C, *restrict f2 = fa + 2 * C;
    memset(fa, 0, 3 * (size_t)C * sizeof *fa);
    for (int64_t r = r0; r < r1; r++) {
        const float *restrict yr = y + r * C;
        if (s->n == 2) {
            const float *restrict sh = s->shift;
            for (int64_t c = 0; c < C; c++) {
                const float d = yr[c] - sh[c];
                f0[c] += d, f1[c] += d * d;
            }
        } else {
            const float *restrict gr = g + r * C, *restrict rr = res ? res + r * C : s->zeros;
            const float *restrict a = s->k.a, *restrict b = s->k.b, *restrict sl = s->k.s;
            const float *restrict m = s->mean, *restrict rs = s->rstd;
            for (int64_t c = 0; c < C; c++) {
                const float z = yr[c] * a[c] + b[c] + rr[c], sg = sl[c] * gr[c], zg = z * gr[c];
                const bool pos = z > 0.0f;
                const float dz = pos ? gr[c] : sg;
                f0[c] += dz, f1[c] += dz * ((yr[c] - m[c]) * rs[c]), f2[c] += pos ? 0.0f : zg;
            }
        }
        if ((r - r0) % kRowFlush == kRowFlush - 1 || r + 1 == r1)
            for (int64_t j = 0; j < 3 * C; j++) acc[j] += fa[j], fa[j] = 0.0f;
    }
}

static bie_status sums_rows(const bn_sums *s, int64_t rows, int64_t C, double *out) {
    const int64_t br = block_rows(rows), blocks = (rows + br - 1) / br;
    double *part = calloc((size_t)(blocks ? blocks : 1) * 3 * (size_t)C, sizeof *part);
    float *fpart = malloc((size_t)(blocks ? blocks : 1) * 3 * (size_t)C * sizeof *fpart);
    if (part == NULL || fpart == NULL) {
        free(part), free(fpart);
        return bie_fail(BIE_ERR_OUT_OF_MEMORY, "bie_bn_act (cpu): sums");
    }
#pragma omp parallel for schedule(static)
    for (int64_t bl = 0; bl < blocks; bl++)
        rows_block(s, bl * br, (bl + 1) * br < rows ? (bl + 1) * br : rows, C, part + bl * 3 * C,
                   fpart + bl * 3 * C);
    memset(out, 0, (size_t)s->n * (size_t)C * sizeof *out);
    for (int64_t bl = 0; bl < blocks; bl++)
        for (int64_t j = 0; j < s->n * C; j++) out[j] += part[bl * 3 * C + j];
    free(part), free(fpart);
    return BIE_OK;
}

/* Planes: a channel's terms in float, summed in kLanes lanes by position within each run of
 * at most kFlush elements; the lanes are added to double sums whenever they hold kFlush terms
 * or more (float arithmetic vectorizes twice as wide, and no float sum takes many more than
 * 2 kFlush / kLanes terms). */
enum { kFlush = 512 };

/* n <= kFlush elements of channel c from at into the float lanes f (element i: lane
 * i % kLanes): the terms first (a map loop, vectorized), then their lane sums. */
static void run_sums(const bn_sums *s, int64_t c, int64_t at, int64_t n,
                     float (*restrict f)[kLanes]) {
    const float *restrict y = s->y + at, *restrict g = s->g ? s->g + at : NULL;
    const float *restrict r = s->res ? s->res + at : s->zeros;
    float t[3][kFlush];
    if (s->n == 2) {
        const float sh = s->shift[c];
        for (int64_t i = 0; i < n; i++) {
            const float d = y[i] - sh;
            t[0][i] = d, t[1][i] = d * d, t[2][i] = 0.0f;
        }
    } else {
        const float a = s->k.a[c], b = s->k.b[c], sl = s->k.s[c], m = s->mean[c];
        const float rs = s->rstd[c];
        for (int64_t i = 0; i < n; i++) {
            const float z = y[i] * a + b + r[i], sg = sl * g[i], zg = z * g[i];
            const bool pos = z > 0.0f;
            const float dz = pos ? g[i] : sg;
            t[0][i] = dz, t[1][i] = dz * ((y[i] - m) * rs), t[2][i] = pos ? 0.0f : zg;
        }
    }
    const int64_t whole = n / kLanes * kLanes;
    for (int j = 0; j < 3; j++) {
        for (int64_t i = 0; i < whole; i += kLanes)
            for (int l = 0; l < kLanes; l++) f[j][l] += t[j][i + l];
        for (int64_t i = whole; i < n; i++) f[j][i - whole] += t[j][i];
    }
}

static void flush(float f[3][kLanes], double t[3]) {
    for (int j = 0; j < 3; j++)
        for (int l = 0; l < kLanes; l++) t[j] += f[j][l], f[j][l] = 0.0f;
}

static void sums_planes(const bn_sums *s, int64_t outer, int64_t C, int64_t inner, double *out) {
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < C; c++) {
        double tot[3] = {0.0, 0.0, 0.0};
        float f[3][kLanes] = {{0.0f}};
        int64_t held = 0; /* terms in f */
        for (int64_t o = 0; o < outer; o++)
            for (int64_t i0 = 0; i0 < inner; i0 += kFlush) {
                const int64_t n = inner - i0 < kFlush ? inner - i0 : kFlush;
                run_sums(s, c, (o * C + c) * inner + i0, n, f);
                if ((held += n) >= kFlush) flush(f, tot), held = 0;
            }
        flush(f, tot);
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
