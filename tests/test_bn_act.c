/* The fused batch norm + residual add + PReLU of bie.h §7 (bie_bn_act_forward / _backward) on
 * the CPU against a double-precision reference written from the formulas (PyTorch's
 * BatchNorm2d, then + res, then PReLU): outputs, saved statistics, running statistics and
 * every gradient, on random data with a nonzero mean, over ranks 2..4 and odd extents, with
 * and without res / gamma / beta, slope per channel, shared or absent, training and
 * inference. Outputs are poisoned before each call. Bad input is rejected with every output
 * and the running statistics untouched; out == y, out == res and grad_y == grad_out work. */
#include <math.h>

#include "test_util.h"

enum { SLOPE_NONE = 0, SLOPE_CHANNEL = 1, SLOPE_SHARED = 2 };

typedef struct cfg {
    int ndim;
    int64_t shape[4];
    bool res, gamma, beta, training, running; /* running: running statistics given */
    int slope;                                /* SLOPE_* */
    bool grads;                               /* backward asks for the optional gradients */
    float eps, momentum, offset;              /* y = offset + spread * normal */
} cfg;

/* Buffers (per-channel ones with room past C, so a wrong length cannot read out of bounds)
 * and their views. */
typedef struct fx {
    cfg c;
    int64_t outer, C, inner, n, per, ns; /* per: elements a channel; ns: slope length */
    float *y, *y0, *res, *out, *g, *gy, *gres;
    float *gamma, *beta, *slope, *rm, *rv, *rm0, *rv0, *smean, *srstd, *ggamma, *gbeta, *gslope;
    bie_tensor ty, tres, tout, tg, tgy, tgres;
    bie_tensor tgamma, tbeta, tslope, trm, trv, tsmean, tsrstd, tggamma, tgbeta, tgslope;
    bie_bn_act_params p;
    float *snap; /* fx_snap: every output and running statistic */
} fx;

/* The reference's results, in double. */
typedef struct ref {
    double *mean, *rstd, *rm, *rv, *z, *out;
    double *gy, *dz, *ggamma, *gbeta, *gslope, *agamma, *abeta, *aslope; /* a*: sums of |term| */
    double *gys; /* the size of grad_y's terms (it may cancel to ~0: 2 elements a channel) */
} ref;

static double normal(void) {
    const double u1 = fmax(tu_uniform(0, 1), 1e-7), u2 = tu_uniform(0, 1);
    return sqrt(-2 * log(u1)) * cos(6.283185307179586 * u2);
}

static bie_tensor act_view(const fx *f, float *data) {
    const int64_t *s = f->c.shape;
    return tu_view(data, BIE_F32, f->c.ndim, s[0], s[1], s[2], s[3]);
}
static bie_tensor vec_view(float *data, int64_t n) { return tu_view(data, BIE_F32, 1, n, 0, 0, 0); }

static void describe(const cfg *c, char *buf, size_t size) {
    snprintf(buf, size,
             "shape [%lld][%lld][%lld][%lld] ndim %d, res %d gamma %d beta %d slope %d "
             "training %d running %d grads %d eps %g momentum %g offset %g",
             (long long)c->shape[0], (long long)c->shape[1], (long long)c->shape[2],
             (long long)c->shape[3], c->ndim, c->res, c->gamma, c->beta, c->slope, c->training,
             c->running, c->grads, (double)c->eps, (double)c->momentum, (double)c->offset);
}

static void fx_init(fx *f, const cfg *c) {
    memset(f, 0, sizeof *f);
    f->c = *c;
    f->outer = c->shape[0];
    f->C = c->shape[1];
    f->inner = 1;
    for (int d = 2; d < c->ndim; d++) f->inner *= c->shape[d];
    f->n = f->outer * f->C * f->inner;
    f->per = f->outer * f->inner;
    f->ns = c->slope == SLOPE_SHARED ? 1 : f->C;
    const size_t an = (size_t)f->n * 4, cn = (size_t)(f->C + 8) * 4;
    float **acts[] = {&f->y, &f->y0, &f->res, &f->out, &f->g, &f->gy, &f->gres};
    for (size_t i = 0; i < sizeof acts / sizeof acts[0]; i++) {
        *acts[i] = tu_alloc(an);
        tu_poison(*acts[i], f->n);
    }
    float **chans[] = {&f->gamma, &f->beta,  &f->slope, &f->rm,     &f->rv,    &f->rm0,
                       &f->rv0,   &f->smean, &f->srstd, &f->ggamma, &f->gbeta, &f->gslope};
    for (size_t i = 0; i < sizeof chans / sizeof chans[0]; i++) {
        *chans[i] = tu_alloc(cn);
        tu_poison(*chans[i], f->C + 8);
    }
    f->snap = tu_alloc(3 * an + 16 * cn);
    /* Data: per channel an offset near c->offset and a spread; never all zeros. */
    for (int64_t ch = 0; ch < f->C; ch++) {
        const double off = c->offset + tu_uniform(-1, 1), spread = tu_uniform(0.3f, 2.0f);
        for (int64_t o = 0; o < f->outer; o++)
            for (int64_t i = 0; i < f->inner; i++)
                f->y[(o * f->C + ch) * f->inner + i] = (float)(off + spread * normal());
        const float gm = tu_uniform(0.5f, 1.5f);
        f->gamma[ch] = tu_next() & 1 ? gm : -gm;
        f->beta[ch] = tu_uniform(-0.5f, 0.5f);
        f->slope[ch] = tu_uniform(-0.25f, 0.5f);
        f->rm0[ch] = (float)off + tu_uniform(-0.5f, 0.5f);
        f->rv0[ch] = (float)(spread * spread) * tu_uniform(0.5f, 1.5f);
    }
    for (int64_t i = 0; i < f->n; i++) f->res[i] = (float)normal();
    tu_fill(f->g, f->n, -1, 1);
    memcpy(f->rm, f->rm0, (size_t)f->C * 4);
    memcpy(f->rv, f->rv0, (size_t)f->C * 4);
    f->ty = act_view(f, f->y);
    f->tres = act_view(f, f->res);
    f->tout = act_view(f, f->out);
    f->tg = act_view(f, f->g);
    f->tgy = act_view(f, f->gy);
    f->tgres = act_view(f, f->gres);
    f->tgamma = vec_view(f->gamma, f->C);
    f->tbeta = vec_view(f->beta, f->C);
    f->tslope = vec_view(f->slope, f->ns);
    f->trm = vec_view(f->rm, f->C);
    f->trv = vec_view(f->rv, f->C);
    f->tsmean = vec_view(f->smean, f->C);
    f->tsrstd = vec_view(f->srstd, f->C);
    f->tggamma = vec_view(f->ggamma, f->C);
    f->tgbeta = vec_view(f->gbeta, f->C);
    f->tgslope = vec_view(f->gslope, f->ns);
    f->p.gamma = c->gamma ? &f->tgamma : NULL;
    f->p.beta = c->beta ? &f->tbeta : NULL;
    f->p.slope = c->slope != SLOPE_NONE ? &f->tslope : NULL;
    f->p.running_mean = c->running ? &f->trm : NULL;
    f->p.running_var = c->running ? &f->trv : NULL;
    f->p.eps = c->eps;
    f->p.momentum = c->momentum;
    f->p.training = c->training;
}

static void fx_free(fx *f) {
    float *all[] = {f->y,     f->y0,    f->res,    f->out,   f->g,      f->gy,  f->gres,
                    f->gamma, f->beta,  f->slope,  f->rm,    f->rv,     f->rm0, f->rv0,
                    f->smean, f->srstd, f->ggamma, f->gbeta, f->gslope, f->snap};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]);
}

/* Everything a call may write, concatenated (fx_same: still the same bits). */
static int64_t fx_gather(const fx *f, float *dst) {
    const float *acts[] = {f->out, f->gy, f->gres};
    const float *chans[] = {f->rm, f->rv, f->smean, f->srstd, f->ggamma, f->gbeta, f->gslope};
    int64_t k = 0;
    for (size_t i = 0; i < 3; i++, k += f->n) memcpy(dst + k, acts[i], (size_t)f->n * 4);
    for (size_t i = 0; i < 7; i++, k += f->C + 8) memcpy(dst + k, chans[i], (size_t)(f->C + 8) * 4);
    return k;
}
static void fx_snap(fx *f) { fx_gather(f, f->snap); }
static int fx_same(const fx *f) {
    float *now = tu_alloc((size_t)(3 * f->n + 7 * (f->C + 8)) * 4);
    const int64_t k = fx_gather(f, now);
    const int same = tu_same_bits(now, f->snap, k);
    free(now);
    return same;
}

static void ref_alloc(ref *r, const fx *f) {
    double **chans[] = {&r->mean,  &r->rstd,   &r->rm,     &r->rv,    &r->ggamma,
                        &r->gbeta, &r->gslope, &r->agamma, &r->abeta, &r->aslope};
    for (size_t i = 0; i < sizeof chans / sizeof chans[0]; i++)
        *chans[i] = tu_alloc((size_t)f->C * 8);
    double **acts[] = {&r->z, &r->out, &r->gy, &r->dz, &r->gys};
    for (size_t i = 0; i < sizeof acts / sizeof acts[0]; i++) *acts[i] = tu_alloc((size_t)f->n * 8);
}
static void ref_free(ref *r) {
    double *all[] = {r->mean,  r->rstd,   r->rm, r->rv,  r->ggamma, r->gbeta, r->gslope, r->agamma,
                     r->abeta, r->aslope, r->z,  r->out, r->gy,     r->dz,    r->gys};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]);
}

#define IDX(o, ch, i) (((o)*f->C + (ch)) * f->inner + (i))

static double gam(const fx *f, int64_t ch) { return f->c.gamma ? f->gamma[ch] : 1.0; }
static double slp(const fx *f, int64_t ch) {
    return f->c.slope == SLOPE_SHARED ? f->slope[0] : f->slope[ch];
}

/* Forward from the formulas (running statistics from rm0 / rv0). */
static void ref_forward(const fx *f, ref *r) {
    const double n = (double)f->per, m = f->c.momentum;
    for (int64_t ch = 0; ch < f->C; ch++) {
        double mean, var;
        if (f->c.training) {
            double s = 0, q = 0;
            for (int64_t o = 0; o < f->outer; o++)
                for (int64_t i = 0; i < f->inner; i++) s += f->y[IDX(o, ch, i)];
            mean = s / n;
            for (int64_t o = 0; o < f->outer; o++)
                for (int64_t i = 0; i < f->inner; i++) {
                    const double d = f->y[IDX(o, ch, i)] - mean;
                    q += d * d;
                }
            var = q / n;
            r->rm[ch] = (1 - m) * f->rm0[ch] + m * mean;
            r->rv[ch] = (1 - m) * f->rv0[ch] + m * var * n / (n - 1);
        } else {
            mean = f->rm0[ch];
            var = f->rv0[ch];
            r->rm[ch] = f->rm0[ch];
            r->rv[ch] = f->rv0[ch];
        }
        r->mean[ch] = mean;
        r->rstd[ch] = 1 / sqrt(var + (double)f->c.eps);
        for (int64_t o = 0; o < f->outer; o++)
            for (int64_t i = 0; i < f->inner; i++) {
                const int64_t k = IDX(o, ch, i);
                double z = gam(f, ch) * (f->y[k] - mean) * r->rstd[ch];
                if (f->c.beta) z += f->beta[ch];
                if (f->c.res) z += f->res[k];
                r->z[k] = z;
                r->out[k] = f->c.slope == SLOPE_NONE || z > 0 ? z : slp(f, ch) * z;
            }
    }
}

/* Backward from the formulas, with the reference forward's statistics. */
static void ref_backward(const fx *f, ref *r) {
    const double n = (double)f->per;
    for (int64_t ch = 0; ch < f->C; ch++) {
        double sb = 0, sg = 0, ss = 0, ab = 0, ag = 0, as = 0;
        for (int64_t o = 0; o < f->outer; o++)
            for (int64_t i = 0; i < f->inner; i++) {
                const int64_t k = IDX(o, ch, i);
                const double g = f->g[k], z = r->z[k];
                const double xhat = (f->y[k] - r->mean[ch]) * r->rstd[ch];
                const bool pass = f->c.slope == SLOPE_NONE || z > 0;
                const double dz = pass ? g : slp(f, ch) * g, zg = pass ? 0 : z * g;
                r->dz[k] = dz;
                sb += dz;
                ab += fabs(dz);
                sg += dz * xhat;
                ag += fabs(dz * xhat);
                ss += zg;
                as += fabs(zg);
            }
        r->gbeta[ch] = sb;
        r->ggamma[ch] = sg;
        r->gslope[ch] = ss;
        r->abeta[ch] = ab;
        r->agamma[ch] = ag;
        r->aslope[ch] = as;
        for (int64_t o = 0; o < f->outer; o++)
            for (int64_t i = 0; i < f->inner; i++) {
                const int64_t k = IDX(o, ch, i);
                const double xhat = (f->y[k] - r->mean[ch]) * r->rstd[ch];
                const double d = f->c.training ? r->dz[k] - sb / n - xhat * sg / n : r->dz[k];
                r->gy[k] = gam(f, ch) * r->rstd[ch] * d;
                r->gys[k] = fabs(gam(f, ch) * r->rstd[ch]) *
                            (fabs(r->dz[k]) + (f->c.training ? ab / n + fabs(xhat) * ag / n : 0));
            }
    }
    if (f->c.slope == SLOPE_SHARED) {
        for (int64_t ch = 1; ch < f->C; ch++) {
            r->gslope[0] += r->gslope[ch];
            r->aslope[0] += r->aslope[ch];
        }
    }
}

/* Move every z within 1e-4 of the PReLU kink away from it (float and double must agree on
 * its side): res or y nudged, the reference run again. */
static void keep_off_kink(fx *f, ref *r) {
    for (int round = 0; round < 50; round++) {
        ref_forward(f, r);
        int near = 0;
        for (int64_t k = 0; k < f->n; k++)
            if (fabs(r->z[k]) < 1e-4) {
                near = 1;
                if (f->c.res)
                    f->res[k] += 4e-4f;
                else
                    f->y[k] += 1e-3f;
            }
        if (!near) return;
    }
}

static char g_what[256];

/* |got - ref| <= rtol |ref| + atol (+ atol_per[i] when given) everywhere. */
static int close_to(const char *name, const float *got, const double *want, int64_t n, double rtol,
                    double atol, const double *atol_per) {
    for (int64_t i = 0; i < n; i++) {
        const double tol = rtol * fabs(want[i]) + atol + (atol_per ? atol_per[i] : 0);
        if (!(fabs((double)got[i] - want[i]) <= tol)) {
            fprintf(stderr, "  %s[%lld]: got %.9g, expected %.9g (tol %.3g)\n    %s\n", name,
                    (long long)i, (double)got[i], want[i], tol, g_what);
            return 0;
        }
    }
    return 1;
}
static double amax(const double *x, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; i++) m = fmax(m, fabs(x[i]));
    return m;
}
static void scaled(double *dst, const double *src, int64_t n, double s) {
    for (int64_t i = 0; i < n; i++) dst[i] = s * src[i] + 1e-9;
}

static bie_status call_forward(fx *f) {
    return bie_bn_act_forward(&f->p, &f->ty, f->c.res ? &f->tres : NULL, &f->tsmean, &f->tsrstd,
                              &f->tout);
}
static bie_status call_backward(fx *f, bie_tensor *grad_out, bie_tensor *grad_y) {
    const cfg *c = &f->c;
    return bie_bn_act_backward(&f->p, grad_out, &f->ty, c->res ? &f->tres : NULL, &f->tsmean,
                               &f->tsrstd, grad_y, c->res && c->grads ? &f->tgres : NULL,
                               c->gamma && c->grads ? &f->tggamma : NULL,
                               c->beta && c->grads ? &f->tgbeta : NULL,
                               c->slope != SLOPE_NONE && c->grads ? &f->tgslope : NULL);
}

/* One configuration: forward and backward against the reference. */
static void run_case(const cfg *c) {
    fx f;
    ref r;
    fx_init(&f, c);
    ref_alloc(&r, &f);
    describe(c, g_what, sizeof g_what);
    keep_off_kink(&f, &r);
    ref_backward(&f, &r);
    memcpy(f.y0, f.y, (size_t)f.n * 4);

    /* forward */
    tu_poison(f.out, f.n);
    tu_poison(f.smean, f.C);
    tu_poison(f.srstd, f.C);
    CHECK_OK(call_forward(&f));
    const double out_scale = fmax(amax(r.out, f.n), 1e-3);
    CHECK(close_to("out", f.out, r.out, f.n, 1e-4, 1e-5 * out_scale, NULL));
    CHECK(close_to("save_mean", f.smean, r.mean, f.C, 1e-5, 1e-6, NULL));
    CHECK(close_to("save_rstd", f.srstd, r.rstd, f.C, 1e-5, 0, NULL));
    if (c->running && c->training) {
        CHECK(close_to("running_mean", f.rm, r.rm, f.C, 1e-5, 1e-6, NULL));
        CHECK(close_to("running_var", f.rv, r.rv, f.C, 1e-5, 1e-6, NULL));
    } else {
        CHECK(tu_same_bits(f.rm, f.rm0, f.C) && tu_same_bits(f.rv, f.rv0, f.C));
    }
    CHECK(tu_same_bits(f.y, f.y0, f.n));

    /* backward, from the forward's save_mean / save_rstd */
    float *g0 = tu_alloc((size_t)f.n * 4);
    memcpy(g0, f.g, (size_t)f.n * 4);
    float *pois[] = {f.gy, f.gres, f.ggamma, f.gbeta, f.gslope};
    const int64_t plen[] = {f.n, f.n, f.C, f.C, f.ns};
    for (int i = 0; i < 5; i++) tu_poison(pois[i], plen[i]);
    CHECK_OK(call_backward(&f, &f.tg, &f.tgy));
    double *tol = tu_alloc((size_t)f.n * 8);
    scaled(tol, r.gys, f.n, 1e-5);
    CHECK(close_to("grad_y", f.gy, r.gy, f.n, 1e-4, 0, tol));
    if (c->grads && c->res)
        CHECK(close_to("grad_res", f.gres, r.dz, f.n, 1e-5, 1e-6 * amax(r.dz, f.n), NULL));
    if (c->grads && c->gamma) {
        scaled(tol, r.agamma, f.C, 1e-5);
        CHECK(close_to("grad_gamma", f.ggamma, r.ggamma, f.C, 1e-4, 0, tol));
    }
    if (c->grads && c->beta) {
        scaled(tol, r.abeta, f.C, 1e-5);
        CHECK(close_to("grad_beta", f.gbeta, r.gbeta, f.C, 1e-4, 0, tol));
    }
    if (c->grads && c->slope != SLOPE_NONE) {
        scaled(tol, r.aslope, f.ns, 1e-5);
        CHECK(close_to("grad_slope", f.gslope, r.gslope, f.ns, 1e-4, 0, tol));
    }
    CHECK(tu_same_bits(f.g, g0, f.n) && tu_same_bits(f.y, f.y0, f.n));
    free(tol);
    free(g0);
    ref_free(&r);
    fx_free(&f);
}

/* Every flag combination on one shape (training skipped with 1 element a channel). */
static void run_shape(int ndim, int64_t d0, int64_t d1, int64_t d2, int64_t d3) {
    static const float momenta[] = {0.1f, 0.1f, 0.0f, 1.0f, 0.5f};
    int v = 0;
    for (int training = 1; training >= 0; training--)
        for (int res = 0; res < 2; res++)
            for (int slope = 0; slope < 3; slope++)
                for (int affine = 0; affine < 3; affine++, v++) {
                    cfg c = {.ndim = ndim, .shape = {d0, d1, d2, d3}};
                    c.res = res;
                    c.slope = slope;
                    c.training = training;
                    c.gamma = affine != 1; /* 0: both, 1: neither, 2: gamma only */
                    c.beta = affine == 0;
                    c.running = !training || v % 4 != 3;
                    c.grads = v % 5 != 4;
                    c.eps = v % 3 == 2 ? 1e-3f : 1e-5f;
                    c.momentum = momenta[v % 5];
                    c.offset = v % 2 ? 3.0f : -1.0f;
                    const int64_t per = d0 * (ndim > 2 ? d2 : 1) * (ndim > 3 ? d3 : 1);
                    if (training && per < 2) continue;
                    run_case(&c);
                }
}

/* out == y, out == res and grad_y == grad_out against the separate-buffer results. */
static void test_aliasing(int ndim, int64_t d0, int64_t d1, int64_t d2, int64_t d3, bool training) {
    cfg c = {ndim, {d0, d1, d2, d3}, true, true,  true, training,
             true, SLOPE_CHANNEL,    true, 1e-5f, 0.1f, 3.0f};
    fx f;
    fx_init(&f, &c);
    describe(&c, g_what, sizeof g_what);
    const size_t an = (size_t)f.n * 4, cn = (size_t)f.C * 4;
    float *buf = tu_alloc(an), *out = tu_alloc(an), *sm = tu_alloc(cn), *sr = tu_alloc(cn);
    float *rm = tu_alloc(cn), *rv = tu_alloc(cn), *gy = tu_alloc(an), *gres = tu_alloc(an);
    tu_poison(f.out, f.n);
    CHECK_OK(call_forward(&f));
    memcpy(out, f.out, an);
    memcpy(sm, f.smean, cn);
    memcpy(sr, f.srstd, cn);
    memcpy(rm, f.rm, cn);
    memcpy(rv, f.rv, cn);
    CHECK_OK(call_backward(&f, &f.tg, &f.tgy));
    memcpy(gy, f.gy, an);
    memcpy(gres, f.gres, an);
    double *want = tu_alloc((size_t)f.n * 8);
    for (int64_t i = 0; i < f.n; i++) want[i] = out[i];
    const double scale = 1e-6 * amax(want, f.n);

    /* out == y */
    bie_tensor tb = act_view(&f, buf);
    memcpy(buf, f.y, an);
    memcpy(f.rm, f.rm0, cn);
    memcpy(f.rv, f.rv0, cn);
    CHECK_OK(bie_bn_act_forward(&f.p, &tb, &f.tres, &f.tsmean, &f.tsrstd, &tb));
    CHECK(close_to("out (out == y)", buf, want, f.n, 1e-6, scale, NULL));
    CHECK(tu_same_bits(f.smean, sm, f.C) && tu_same_bits(f.srstd, sr, f.C));
    CHECK(tu_same_bits(f.rm, rm, f.C) && tu_same_bits(f.rv, rv, f.C));

    /* out == res */
    memcpy(buf, f.res, an);
    memcpy(f.rm, f.rm0, cn);
    memcpy(f.rv, f.rv0, cn);
    CHECK_OK(bie_bn_act_forward(&f.p, &f.ty, &tb, &f.tsmean, &f.tsrstd, &tb));
    CHECK(close_to("out (out == res)", buf, want, f.n, 1e-6, scale, NULL));
    CHECK(tu_same_bits(f.rm, rm, f.C) && tu_same_bits(f.rv, rv, f.C));

    /* grad_y == grad_out */
    memcpy(f.smean, sm, cn);
    memcpy(f.srstd, sr, cn);
    memcpy(buf, f.g, an);
    tu_poison(f.gres, f.n);
    CHECK_OK(call_backward(&f, &tb, &tb));
    for (int64_t i = 0; i < f.n; i++) want[i] = gy[i];
    CHECK(close_to("grad_y (grad_y == grad_out)", buf, want, f.n, 1e-6,
                   1e-6 * fmax(amax(want, f.n), 1e-6), NULL));
    for (int64_t i = 0; i < f.n; i++) want[i] = gres[i];
    CHECK(close_to("grad_res (grad_y == grad_out)", f.gres, want, f.n, 1e-6, 1e-7, NULL));
    free(want);
    float *bufs[] = {buf, out, sm, sr, rm, rv, gy, gres};
    for (int i = 0; i < 8; i++) free(bufs[i]);
    fx_free(&f);
}

/* ---- bad input: the call fails (with `want`, or any error when want is BIE_OK) and
 * writes nothing. */
static void expect_fail(fx *f, bie_status st, bie_status want, const char *what, int line) {
    const int ok = want == BIE_OK ? st != BIE_OK : st == want;
    CHECK(ok);
    if (!ok)
        fprintf(stderr, "  line %d: %s: got %s, expected %s\n", line, what, bie_status_name(st),
                want == BIE_OK ? "an error" : bie_status_name(want));
    if (st != BIE_OK) CHECK(bie_last_error()[0] != '\0');
    const int same = fx_same(f);
    CHECK(same);
    if (!same) fprintf(stderr, "  line %d: %s: a failed call wrote an output\n", line, what);
}
#define ANY_ERR BIE_OK
#define FAILS(f, want, what, call)                    \
    do {                                              \
        fx_snap(f);                                   \
        expect_fail(f, (call), want, what, __LINE__); \
    } while (0)

static bie_tensor reshaped(const bie_tensor *t, int ndim, int64_t a, int64_t b, int64_t c,
                           int64_t d) {
    bie_tensor r = *t;
    r.ndim = ndim;
    r.shape[0] = a;
    r.shape[1] = b;
    r.shape[2] = c;
    r.shape[3] = d;
    return r;
}

static void test_bad_forward(fx *f) {
    bie_bn_act_params *p = &f->p;
    bie_tensor *y = &f->ty, *res = &f->tres, *sm = &f->tsmean, *sr = &f->tsrstd, *out = &f->tout;
    const int64_t C = f->C;
    FAILS(f, BIE_ERR_NULL_POINTER, "NULL p", bie_bn_act_forward(NULL, y, res, sm, sr, out));
    FAILS(f, BIE_ERR_NULL_POINTER, "NULL y", bie_bn_act_forward(p, NULL, res, sm, sr, out));
    FAILS(f, BIE_ERR_NULL_POINTER, "NULL out", bie_bn_act_forward(p, y, res, sm, sr, NULL));
    FAILS(f, BIE_ERR_NULL_POINTER, "NULL save_mean", bie_bn_act_forward(p, y, res, NULL, sr, out));
    FAILS(f, BIE_ERR_NULL_POINTER, "NULL save_rstd", bie_bn_act_forward(p, y, res, sm, NULL, out));
    bie_tensor t = *y;
    t.data = NULL;
    FAILS(f, ANY_ERR, "y data NULL", bie_bn_act_forward(p, &t, res, sm, sr, out));
    /* [2][3][4][5] against smaller or reordered shapes of the same buffers */
    t = reshaped(res, 4, 2, 3, 4, 4);
    FAILS(f, BIE_ERR_SHAPE, "res shape", bie_bn_act_forward(p, y, &t, sm, sr, out));
    t = reshaped(res, 3, 2, 3, 20, 0);
    FAILS(f, BIE_ERR_SHAPE, "res rank", bie_bn_act_forward(p, y, &t, sm, sr, out));
    t = reshaped(out, 4, 2, 3, 4, 4);
    FAILS(f, BIE_ERR_SHAPE, "out shape", bie_bn_act_forward(p, y, res, sm, sr, &t));
    t = reshaped(out, 4, 2, 3, 5, 4);
    FAILS(f, BIE_ERR_SHAPE, "out extents swapped", bie_bn_act_forward(p, y, res, sm, sr, &t));
    t = reshaped(y, 4, 1, 3, 4, 5);
    FAILS(f, BIE_ERR_SHAPE, "y shape", bie_bn_act_forward(p, &t, res, sm, sr, out));
    bie_tensor t1 = reshaped(y, 1, 120, 0, 0, 0), t2 = reshaped(res, 1, 120, 0, 0, 0),
               t3 = reshaped(out, 1, 120, 0, 0, 0);
    FAILS(f, ANY_ERR, "rank 1", bie_bn_act_forward(p, &t1, &t2, sm, sr, &t3));
    /* per-channel lengths */
    bie_tensor *fields[] = {&f->tgamma, &f->tbeta, &f->tslope, &f->trm, &f->trv, sm, sr};
    const char *names[] = {"gamma",       "beta",      "slope",    "running_mean",
                           "running_var", "save_mean", "save_rstd"};
    for (int i = 0; i < 7; i++)
        for (int64_t len = C - 1; len <= C + 1; len += 2) {
            const int64_t saved = fields[i]->shape[0];
            fields[i]->shape[0] = len; /* C = 3: slope of 2 or 4 is neither [C] nor [1] */
            FAILS(f, ANY_ERR, names[i], bie_bn_act_forward(p, y, res, sm, sr, out));
            fields[i]->shape[0] = saved;
        }
    /* dtypes: F16 is CUDA only */
    bie_tensor h1 = *y, h2 = *res, h3 = *out;
    h1.dtype = h2.dtype = h3.dtype = BIE_F16;
    FAILS(f, ANY_ERR, "F16 on the CPU", bie_bn_act_forward(p, &h1, &h2, sm, sr, &h3));
    FAILS(f, ANY_ERR, "F16 out", bie_bn_act_forward(p, y, res, sm, sr, &h3));
    FAILS(f, ANY_ERR, "F16 res", bie_bn_act_forward(p, y, &h2, sm, sr, out));
    bie_tensor hg = f->tgamma;
    hg.dtype = BIE_F16;
    const bie_tensor *gsave = p->gamma;
    p->gamma = &hg;
    FAILS(f, ANY_ERR, "F16 gamma", bie_bn_act_forward(p, y, res, sm, sr, out));
    p->gamma = gsave;
    bie_tensor dev = *y;
    dev.device.type = BIE_DEVICE_CUDA; /* a CUDA tensor among CPU ones */
    FAILS(f, ANY_ERR, "device mix", bie_bn_act_forward(p, y, res, sm, sr, &dev));
    /* eps and momentum */
    const float bad_eps[] = {0.0f, -1e-5f, NAN, INFINITY};
    for (int i = 0; i < 4; i++) {
        p->eps = bad_eps[i];
        FAILS(f, ANY_ERR, "eps", bie_bn_act_forward(p, y, res, sm, sr, out));
    }
    p->eps = f->c.eps;
    const float bad_m[] = {-0.1f, 1.5f, NAN};
    for (int i = 0; i < 3; i++) {
        p->momentum = bad_m[i];
        FAILS(f, ANY_ERR, "momentum", bie_bn_act_forward(p, y, res, sm, sr, out));
    }
    p->momentum = f->c.momentum;
    /* inference without running statistics */
    p->training = false;
    p->running_mean = NULL;
    FAILS(f, ANY_ERR, "inference, running_mean NULL", bie_bn_act_forward(p, y, res, sm, sr, out));
    p->running_mean = &f->trm;
    p->running_var = NULL;
    FAILS(f, ANY_ERR, "inference, running_var NULL", bie_bn_act_forward(p, y, res, sm, sr, out));
    p->running_var = &f->trv;
    p->training = f->c.training;
}

static void test_bad_backward(fx *f) {
    bie_bn_act_params *p = &f->p;
    bie_tensor *go = &f->tg, *y = &f->ty, *res = &f->tres, *sm = &f->tsmean, *sr = &f->tsrstd;
    bie_tensor *gy = &f->tgy, *gr = &f->tgres, *gg = &f->tggamma, *gb = &f->tgbeta,
               *gs = &f->tgslope;
    const int64_t C = f->C;
#define BWD(P, GO, Y, RES, SM, SR, GY, GR, GG, GB, GS) \
    bie_bn_act_backward(P, GO, Y, RES, SM, SR, GY, GR, GG, GB, GS)
    FAILS(f, BIE_ERR_NULL_POINTER, "bwd NULL p", BWD(NULL, go, y, res, sm, sr, gy, gr, gg, gb, gs));
    FAILS(f, BIE_ERR_NULL_POINTER, "bwd NULL grad_out",
          BWD(p, NULL, y, res, sm, sr, gy, gr, gg, gb, gs));
    FAILS(f, BIE_ERR_NULL_POINTER, "bwd NULL y", BWD(p, go, NULL, res, sm, sr, gy, gr, gg, gb, gs));
    FAILS(f, BIE_ERR_NULL_POINTER, "bwd NULL save_mean",
          BWD(p, go, y, res, NULL, sr, gy, gr, gg, gb, gs));
    FAILS(f, BIE_ERR_NULL_POINTER, "bwd NULL save_rstd",
          BWD(p, go, y, res, sm, NULL, gy, gr, gg, gb, gs));
    FAILS(f, BIE_ERR_NULL_POINTER, "bwd NULL grad_y",
          BWD(p, go, y, res, sm, sr, NULL, gr, gg, gb, gs));
    bie_tensor t = reshaped(go, 4, 2, 3, 4, 4);
    FAILS(f, BIE_ERR_SHAPE, "bwd grad_out shape", BWD(p, &t, y, res, sm, sr, gy, gr, gg, gb, gs));
    t = reshaped(go, 3, 2, 3, 20, 0);
    FAILS(f, BIE_ERR_SHAPE, "bwd grad_out rank", BWD(p, &t, y, res, sm, sr, gy, gr, gg, gb, gs));
    t = reshaped(gy, 4, 2, 3, 4, 4);
    FAILS(f, BIE_ERR_SHAPE, "bwd grad_y shape", BWD(p, go, y, res, sm, sr, &t, gr, gg, gb, gs));
    t = reshaped(gr, 4, 2, 3, 4, 4);
    FAILS(f, BIE_ERR_SHAPE, "bwd grad_res shape", BWD(p, go, y, res, sm, sr, gy, &t, gg, gb, gs));
    t = reshaped(res, 4, 2, 3, 5, 4);
    FAILS(f, BIE_ERR_SHAPE, "bwd res shape", BWD(p, go, y, &t, sm, sr, gy, gr, gg, gb, gs));
    t = reshaped(y, 4, 1, 3, 4, 5);
    FAILS(f, BIE_ERR_SHAPE, "bwd y shape", BWD(p, go, &t, res, sm, sr, gy, gr, gg, gb, gs));
    bie_tensor *fields[] = {gg, gb, sm, sr, &f->tgamma, &f->tbeta};
    const char *names[] = {"grad_gamma", "grad_beta", "save_mean", "save_rstd", "gamma", "beta"};
    for (int i = 0; i < 6; i++)
        for (int64_t len = C - 1; len <= C + 1; len += 2) {
            const int64_t saved = fields[i]->shape[0];
            fields[i]->shape[0] = len;
            FAILS(f, ANY_ERR, names[i], BWD(p, go, y, res, sm, sr, gy, gr, gg, gb, gs));
            fields[i]->shape[0] = saved;
        }
    t = *gs;
    t.shape[0] = 1; /* slope [C], grad_slope [1] */
    FAILS(f, ANY_ERR, "bwd grad_slope length", BWD(p, go, y, res, sm, sr, gy, gr, gg, gb, &t));
    t = *go;
    t.dtype = BIE_F16;
    FAILS(f, ANY_ERR, "bwd F16 grad_out", BWD(p, &t, y, res, sm, sr, gy, gr, gg, gb, gs));
    t = *gy;
    t.dtype = BIE_F16;
    FAILS(f, ANY_ERR, "bwd F16 grad_y", BWD(p, go, y, res, sm, sr, &t, gr, gg, gb, gs));
    t = *gy;
    t.device.type = BIE_DEVICE_CUDA;
    FAILS(f, ANY_ERR, "bwd device mix", BWD(p, go, y, res, sm, sr, &t, gr, gg, gb, gs));
    const float bad_eps[] = {0.0f, -1.0f, NAN};
    for (int i = 0; i < 3; i++) {
        p->eps = bad_eps[i];
        FAILS(f, ANY_ERR, "bwd eps", BWD(p, go, y, res, sm, sr, gy, gr, gg, gb, gs));
    }
    p->eps = f->c.eps;
#undef BWD
}

/* Training with one element a channel ([1][C] and [1][C][1]) is refused both ways;
 * inference on [1][C] works. */
static void test_single_element(int ndim) {
    cfg c = {ndim, {1, 5, 1, 1},  true, true,  true, true,
             true, SLOPE_CHANNEL, true, 1e-5f, 0.1f, 3.0f};
    fx f;
    fx_init(&f, &c);
    tu_poison(f.out, f.n);
    tu_poison(f.gy, f.n);
    FAILS(&f, ANY_ERR, "training, 1 element a channel", call_forward(&f));
    for (int64_t ch = 0; ch < f.C; ch++) f.smean[ch] = 3, f.srstd[ch] = 1;
    FAILS(&f, ANY_ERR, "bwd training, 1 element a channel", call_backward(&f, &f.tg, &f.tgy));
    fx_free(&f);
    c.training = false;
    run_case(&c);
}

static void test_bad_input(void) {
    cfg c = {4, {2, 3, 4, 5}, true, true, true, true, true, SLOPE_CHANNEL, true, 1e-5f, 0.1f, 3.0f};
    fx f;
    fx_init(&f, &c);
    describe(&c, g_what, sizeof g_what);
    /* the valid calls succeed */
    CHECK_OK(call_forward(&f));
    CHECK_OK(call_backward(&f, &f.tg, &f.tgy));
    test_bad_forward(&f);
    test_bad_backward(&f);
    /* and still do */
    CHECK_OK(call_forward(&f));
    CHECK_OK(call_backward(&f, &f.tg, &f.tgy));
    fx_free(&f);
    test_single_element(2);
    test_single_element(3);
}

int main(void) {
    tu_seed(77);
    /* rank 2 [N][C] */
    run_shape(2, 8, 3, 0, 0);
    run_shape(2, 2, 5, 0, 0);
    run_shape(2, 2, 1, 0, 0);
    run_shape(2, 33, 17, 0, 0);
    run_shape(2, 64, 64, 0, 0);
    run_shape(2, 1000, 5, 0, 0);
    run_shape(2, 1, 3, 0, 0); /* inference only */
    /* rank 3 [outer][C][inner], channels-last views [P][C][1] */
    run_shape(3, 4, 3, 7, 0);
    run_shape(3, 1, 5, 16, 0);
    run_shape(3, 2, 17, 7, 0);
    run_shape(3, 1, 1, 7, 0);
    run_shape(3, 2, 3, 1, 0);
    run_shape(3, 300, 64, 1, 0);
    run_shape(3, 777, 20, 1, 0);
    /* rank 4 NCHW */
    run_shape(4, 2, 3, 4, 4);
    run_shape(4, 1, 64, 4, 4);
    run_shape(4, 3, 5, 7, 7);
    run_shape(4, 1, 1, 16, 16);
    run_shape(4, 2, 17, 7, 1);
    run_shape(4, 2, 64, 8, 8);
    run_shape(4, 1, 3, 1, 1); /* inference only */
    test_aliasing(4, 2, 5, 3, 3, true);
    test_aliasing(4, 2, 5, 3, 3, false);
    test_aliasing(3, 50, 17, 1, 0, true);
    test_aliasing(2, 9, 64, 0, 0, true);
    test_bad_input();
    return tu_finish();
}
