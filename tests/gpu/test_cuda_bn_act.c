/* The fused batch norm + residual add + PReLU of bie.h §7 on CUDA (float32, bfloat16 and
 * float16 activations) against the CPU's float32 implementation on the same values (the
 * inputs rounded to the CUDA dtype first): out, save_mean, save_rstd, the running
 * statistics and every gradient, over channels-last views [P][C][1] (C = 1, 3, 20, 64, 128;
 * P from 1 to 4999) and NCHW tensors, with and without res / gamma / beta, slope per channel,
 * shared or absent, training and inference; device outputs are poisoned before each call.
 * A large bfloat16 [131072][64][1] case runs many blocks. Bad calls (shapes, dtypes, a CPU
 * tensor among CUDA ones) fail and leave every output untouched. Reports itself skipped (77)
 * without a GPU. Usage: test_cuda_bn_act [--small] */
#include <math.h>

#include "gpu_util.h"

enum { SLOPE_NONE = 0, SLOPE_CHANNEL = 1, SLOPE_SHARED = 2 };

typedef struct gcase {
    int ndim;
    int64_t shape[4];
    bie_dtype dt;
    bool res, gamma, beta, training, running;
    int slope;
    float momentum;
    bool misalign; /* activations one element past a 16-byte boundary */
} gcase;

/* Host values of one case (activations already rounded to the CUDA dtype). */
typedef struct host {
    int64_t outer, C, inner, n, per, ns;
    float *y, *res, *g, *gamma, *beta, *slope, *rm0, *rv0;
} host;

static double normal(void) {
    const double u1 = fmax(tu_uniform(0, 1), 1e-7), u2 = tu_uniform(0, 1);
    return sqrt(-2 * log(u1)) * cos(6.283185307179586 * u2);
}

static void set_shape(bie_tensor *t, int ndim, const int64_t *shape) {
    t->ndim = ndim;
    for (int d = 0; d < ndim; d++) t->shape[d] = shape[d];
}
/* A device activation tensor shaped like the case's, holding v (NULL: uninitialised); with
 * c->misalign its data starts one element into the allocation (not 16-byte aligned). */
static bie_tensor dev_act(bie_dtype dt, const float *v, const gcase *c, int64_t n) {
    const int64_t off = c->misalign ? 1 : 0;
    bie_tensor t = device_empty(dt, 1, n + off);
    t.data = (char *)t.data + off * (int64_t)bie_dtype_size(dt);
    t.shape[1] = n;
    if (v) {
        void *hbuf = tu_alloc((size_t)n * 4);
        if (dt == BIE_F32) memcpy(hbuf, v, (size_t)n * 4);
        for (int64_t i = 0; dt != BIE_F32 && i < n; i++)
            ((uint16_t *)hbuf)[i] = dt == BIE_BF16 ? to_bf16(v[i]) : to_f16(v[i]);
        bie_tensor h = tu_view(hbuf, dt, 2, 1, n, 0, 0);
        CHECK_OK(bie_tensor_copy(&t, &h));
        free(hbuf);
    }
    set_shape(&t, c->ndim, c->shape);
    return t;
}
static void dev_act_free(bie_tensor *t, const gcase *c) {
    t->data = (char *)t->data - (c->misalign ? (int64_t)bie_dtype_size(t->dtype) : 0);
    bie_tensor_free(t);
}
static bie_tensor dev_vec(const float *v, int64_t n) {
    bie_tensor t = v ? upload_as(BIE_F32, v, 1, n) : device_empty(BIE_F32, 1, n);
    t.ndim = 1;
    t.shape[0] = n;
    return t;
}

static void host_init(host *h, const gcase *c) {
    memset(h, 0, sizeof *h);
    h->outer = c->shape[0];
    h->C = c->shape[1];
    h->inner = 1;
    for (int d = 2; d < c->ndim; d++) h->inner *= c->shape[d];
    h->n = h->outer * h->C * h->inner;
    h->per = h->outer * h->inner;
    h->ns = c->slope == SLOPE_SHARED ? 1 : h->C;
    h->y = tu_alloc((size_t)h->n * 4);
    h->res = tu_alloc((size_t)h->n * 4);
    h->g = tu_alloc((size_t)h->n * 4);
    float **chans[] = {&h->gamma, &h->beta, &h->slope, &h->rm0, &h->rv0};
    for (int i = 0; i < 5; i++) *chans[i] = tu_alloc((size_t)h->C * 4);
    for (int64_t ch = 0; ch < h->C; ch++) {
        const double off = 3 + tu_uniform(-1, 1), spread = tu_uniform(0.3f, 2.0f);
        for (int64_t o = 0; o < h->outer; o++)
            for (int64_t i = 0; i < h->inner; i++)
                h->y[(o * h->C + ch) * h->inner + i] =
                    round_to(c->dt, (float)(off + spread * normal()));
        const float gm = tu_uniform(0.5f, 1.5f);
        h->gamma[ch] = tu_next() & 1 ? gm : -gm;
        h->beta[ch] = tu_uniform(-0.5f, 0.5f);
        h->slope[ch] = tu_uniform(-0.25f, 0.5f);
        h->rm0[ch] = (float)off + tu_uniform(-0.5f, 0.5f);
        h->rv0[ch] = (float)(spread * spread) * tu_uniform(0.5f, 1.5f);
    }
    for (int64_t i = 0; i < h->n; i++) {
        h->res[i] = round_to(c->dt, (float)normal());
        h->g[i] = round_to(c->dt, tu_uniform(-1, 1));
    }
}
static void host_free(host *h) {
    float *all[] = {h->y, h->res, h->g, h->gamma, h->beta, h->slope, h->rm0, h->rv0};
    for (int i = 0; i < 8; i++) free(all[i]);
}

/* Move every z = gamma (y - mean) rstd + beta + res within 1e-3 of the PReLU kink away from
 * it (the CPU and the GPU must agree on its side in the backward); nudged values stay
 * representable in the dtype. */
static void keep_off_kink(host *h, const gcase *c) {
    double *mean = tu_alloc((size_t)h->C * 8), *rstd = tu_alloc((size_t)h->C * 8);
    for (int round = 0; round < 50; round++) {
        for (int64_t ch = 0; ch < h->C; ch++) {
            double s = 0, q = 0, m, v;
            for (int64_t o = 0; o < h->outer; o++)
                for (int64_t i = 0; i < h->inner; i++) s += h->y[(o * h->C + ch) * h->inner + i];
            m = s / (double)h->per;
            for (int64_t o = 0; o < h->outer; o++)
                for (int64_t i = 0; i < h->inner; i++) {
                    const double d = h->y[(o * h->C + ch) * h->inner + i] - m;
                    q += d * d;
                }
            v = q / (double)h->per;
            if (!c->training) m = h->rm0[ch], v = h->rv0[ch];
            mean[ch] = m;
            rstd[ch] = 1 / sqrt(v + 1e-5);
        }
        int near = 0;
        for (int64_t k = 0; k < h->n; k++) {
            const int64_t ch = (k / h->inner) % h->C;
            const double z = (c->gamma ? h->gamma[ch] : 1.0) * (h->y[k] - mean[ch]) * rstd[ch] +
                             (c->beta ? h->beta[ch] : 0.0) + (c->res ? h->res[k] : 0.0);
            if (fabs(z) >= 1e-3) continue;
            near = 1;
            if (c->res)
                h->res[k] = round_to(c->dt, h->res[k] + 0.05f);
            else
                h->y[k] = round_to(c->dt, h->y[k] + 0.05f);
        }
        if (!near) break;
    }
    free(mean);
    free(rstd);
}

static double act_tol(bie_dtype dt) { return dt == BIE_BF16 ? 1e-2 : dt == BIE_F16 ? 2e-3 : 1e-4; }

static char g_what[200];
static void describe(const gcase *c) {
    snprintf(g_what, sizeof g_what,
             "%s [%lld][%lld][%lld][%lld] ndim %d res %d gamma %d beta %d slope %d training %d "
             "running %d",
             bie_dtype_name(c->dt), (long long)c->shape[0], (long long)c->shape[1],
             (long long)c->shape[2], (long long)c->shape[3], c->ndim, c->res, c->gamma, c->beta,
             c->slope, c->training, c->running);
}

/* A device tensor (any float dtype) against host float32 values: |d| <= tol max|ref| + atol. */
static void device_close(const char *name, const bie_tensor *d, const float *ref, double tol,
                         double atol) {
    const int64_t n = bie_tensor_numel(d);
    float *got = tu_alloc((size_t)n * 4);
    download_as(d, got);
    double amax = 0;
    for (int64_t i = 0; i < n; i++) amax = fmax(amax, fabs(ref[i]));
    int ok = 1;
    for (int64_t i = 0; i < n && ok; i++)
        if (!(fabs((double)got[i] - ref[i]) <= tol * amax + atol)) {
            fprintf(stderr, "  %s[%lld]: gpu %.7g, cpu %.7g (max|cpu| %.4g)\n    %s\n", name,
                    (long long)i, (double)got[i], (double)ref[i], amax, g_what);
            ok = 0;
        }
    CHECK(ok);
    free(got);
}

static void run_gcase(const gcase *c) {
    host h;
    host_init(&h, c);
    keep_off_kink(&h, c);
    describe(c);
    const int64_t n = h.n, C = h.C;
    const size_t an = (size_t)n * 4, cn = (size_t)C * 4;
    /* CPU: float32 on the rounded values */
    float *co = tu_alloc(an), *cgy = tu_alloc(an), *cgr = tu_alloc(an);
    float *csm = tu_alloc(cn), *csr = tu_alloc(cn), *crm = tu_alloc(cn), *crv = tu_alloc(cn);
    float *cgg = tu_alloc(cn), *cgb = tu_alloc(cn), *cgs = tu_alloc(cn);
    memcpy(crm, h.rm0, cn);
    memcpy(crv, h.rv0, cn);
    float *pois[] = {co, cgy, cgr, csm, csr, cgg, cgb, cgs};
    const int64_t plen[] = {n, n, n, C, C, C, C, C};
    for (int i = 0; i < 8; i++) tu_poison(pois[i], plen[i]);
    const int64_t *s = c->shape;
#define HACT(p) tu_view(p, BIE_F32, c->ndim, s[0], s[1], s[2], s[3])
#define HVEC(p, len) tu_view(p, BIE_F32, 1, len, 0, 0, 0)
    bie_tensor hy = HACT(h.y), hres = HACT(h.res), hg = HACT(h.g), hout = HACT(co), hgy = HACT(cgy),
               hgr = HACT(cgr);
    bie_tensor hgam = HVEC(h.gamma, C), hbet = HVEC(h.beta, C), hslo = HVEC(h.slope, h.ns),
               hrm = HVEC(crm, C), hrv = HVEC(crv, C), hsm = HVEC(csm, C), hsr = HVEC(csr, C),
               hgg = HVEC(cgg, C), hgb = HVEC(cgb, C), hgs = HVEC(cgs, h.ns);
    bie_bn_act_params cp = {c->gamma ? &hgam : NULL,
                            c->beta ? &hbet : NULL,
                            c->slope != SLOPE_NONE ? &hslo : NULL,
                            c->running ? &hrm : NULL,
                            c->running ? &hrv : NULL,
                            1e-5f,
                            c->momentum,
                            c->training};
    /* CUDA */
    bie_tensor dy = dev_act(c->dt, h.y, c, n), dres = dev_act(c->dt, h.res, c, n),
               dg = dev_act(c->dt, h.g, c, n), dout = dev_act(c->dt, NULL, c, n),
               dgy = dev_act(c->dt, NULL, c, n), dgr = dev_act(c->dt, NULL, c, n);
    bie_tensor dgam = dev_vec(h.gamma, C), dbet = dev_vec(h.beta, C), dslo = dev_vec(h.slope, h.ns),
               drm = dev_vec(h.rm0, C), drv = dev_vec(h.rv0, C), dsm = dev_vec(NULL, C),
               dsr = dev_vec(NULL, C), dgg = dev_vec(NULL, C), dgb = dev_vec(NULL, C),
               dgs = dev_vec(NULL, h.ns);
    bie_tensor *dpois[] = {&dout, &dgy, &dgr, &dsm, &dsr, &dgg, &dgb, &dgs};
    for (int i = 0; i < 8; i++) poison_device(dpois[i]);
    bie_bn_act_params gp = cp;
    gp.gamma = c->gamma ? &dgam : NULL;
    gp.beta = c->beta ? &dbet : NULL;
    gp.slope = c->slope != SLOPE_NONE ? &dslo : NULL;
    gp.running_mean = c->running ? &drm : NULL;
    gp.running_var = c->running ? &drv : NULL;

    /* forward */
    CHECK_OK(bie_bn_act_forward(&cp, &hy, c->res ? &hres : NULL, &hsm, &hsr, &hout));
    bie_status st = bie_bn_act_forward(&gp, &dy, c->res ? &dres : NULL, &dsm, &dsr, &dout);
    CHECK(st == BIE_OK);
    if (st != BIE_OK) fprintf(stderr, "  forward: %s\n    %s\n", bie_last_error(), g_what);
    const double tol = act_tol(c->dt);
    device_close("out", &dout, co, tol, 1e-6);
    device_close("save_mean", &dsm, csm, 1e-5, 1e-6);
    device_close("save_rstd", &dsr, csr, 1e-4, 1e-6);
    if (c->running && c->training) {
        device_close("running_mean", &drm, crm, 1e-5, 1e-6);
        device_close("running_var", &drv, crv, 1e-4, 1e-6);
    } else {
        CHECK(device_bytes_match(&drm, h.rm0) && device_bytes_match(&drv, h.rv0));
    }

    /* backward, each side from its own forward's statistics */
    CHECK_OK(bie_bn_act_backward(&cp, &hg, &hy, c->res ? &hres : NULL, &hsm, &hsr, &hgy,
                                 c->res ? &hgr : NULL, c->gamma ? &hgg : NULL,
                                 c->beta ? &hgb : NULL, c->slope ? &hgs : NULL));
    st = bie_bn_act_backward(&gp, &dg, &dy, c->res ? &dres : NULL, &dsm, &dsr, &dgy,
                             c->res ? &dgr : NULL, c->gamma ? &dgg : NULL, c->beta ? &dgb : NULL,
                             c->slope ? &dgs : NULL);
    CHECK(st == BIE_OK);
    if (st != BIE_OK) fprintf(stderr, "  backward: %s\n    %s\n", bie_last_error(), g_what);
    /* grad_y may cancel to ~0 (2 elements a channel): an absolute term of its terms' size */
    double gscale = 0;
    for (int64_t ch = 0; ch < C; ch++)
        gscale = fmax(gscale, fabs((c->gamma ? h.gamma[ch] : 1.0) * csr[ch]));
    device_close("grad_y", &dgy, cgy, tol, 1e-6 + 1e-5 * gscale);
    if (c->res) device_close("grad_res", &dgr, cgr, tol, 1e-6);
    /* per-channel float32 sums of up to `per` terms of magnitude up to ~5 */
    const double atol = 1e-6 * 5 * (double)h.per;
    if (c->gamma) device_close("grad_gamma", &dgg, cgg, 1e-4, atol);
    if (c->beta) device_close("grad_beta", &dgb, cgb, 1e-4, atol);
    if (c->slope) device_close("grad_slope", &dgs, cgs, 1e-4, atol * (double)h.C / (double)h.ns);
#undef HACT
#undef HVEC

    bie_tensor *acts[] = {&dy, &dres, &dg, &dout, &dgy, &dgr};
    for (int i = 0; i < 6; i++) dev_act_free(acts[i], c);
    bie_tensor *vecs[] = {&dgam, &dbet, &dslo, &drm, &drv, &dsm, &dsr, &dgg, &dgb, &dgs};
    for (int i = 0; i < 10; i++) bie_tensor_free(vecs[i]);
    for (int i = 0; i < 8; i++) free(pois[i]);
    free(crm);
    free(crv);
    host_free(&h);
}

/* Every flag combination on one shape, the dtypes in turn. */
static int g_variant;
static void run_shape(int ndim, int64_t d0, int64_t d1, int64_t d2, int64_t d3) {
    const int64_t per = d0 * (ndim > 2 ? d2 : 1) * (ndim > 3 ? d3 : 1);
    for (int training = 1; training >= 0; training--)
        for (int res = 0; res < 2; res++)
            for (int slope = 0; slope < 3; slope++) {
                const int v = g_variant++;
                if (training && per < 2) continue;
                gcase c = {.ndim = ndim, .shape = {d0, d1, d2, d3}, .dt = kDtypes[v % 3]};
                c.res = res;
                c.slope = slope;
                c.training = training;
                c.gamma = v % 4 != 1;
                c.beta = v % 4 != 1 && v % 4 != 2;
                c.running = !training || v % 5 != 3;
                c.momentum = v % 7 == 6 ? 1.0f : 0.1f;
                c.misalign = v % 11 == 5; /* the kernels' unvectorised path */
                run_gcase(&c);
            }
}

/* Bad calls on CUDA fail and leave every output (and the running statistics) untouched. */
static void test_bad_calls(bie_dtype dt) {
    const gcase c = {4, {4, 8, 5, 5}, dt, true, true, true, true, true, SLOPE_CHANNEL, 0.1f, false};
    host h;
    host_init(&h, &c);
    const int64_t n = h.n, C = h.C;
    bie_tensor dy = dev_act(dt, h.y, &c, n), dres = dev_act(dt, h.res, &c, n),
               dg = dev_act(dt, h.g, &c, n), dout = dev_act(dt, NULL, &c, n),
               dgy = dev_act(dt, NULL, &c, n), dgr = dev_act(dt, NULL, &c, n);
    bie_tensor dgam = dev_vec(h.gamma, C), dbet = dev_vec(h.beta, C), dslo = dev_vec(h.slope, C),
               drm = dev_vec(h.rm0, C), drv = dev_vec(h.rv0, C), dsm = dev_vec(NULL, C),
               dsr = dev_vec(NULL, C), dgg = dev_vec(NULL, C), dgb = dev_vec(NULL, C),
               dgs = dev_vec(NULL, C);
    bie_bn_act_params p = {&dgam, &dbet, &dslo, &drm, &drv, 1e-5f, 0.1f, true};
    bie_tensor *outs[] = {&dout, &dgy, &dgr, &dsm, &dsr, &dgg, &dgb, &dgs};
    for (int i = 0; i < 8; i++) poison_device(outs[i]);
    float *host_out = tu_alloc((size_t)n * 4), *host_cv = tu_alloc((size_t)C * 4);
    tu_poison(host_out, n);
    bie_tensor hout = tu_view(host_out, BIE_F32, 4, 4, 8, 5, 5);
    bie_tensor hgam = tu_view(h.gamma, BIE_F32, 1, C, 0, 0, 0);
    bie_tensor hsm = tu_view(host_cv, BIE_F32, 1, C, 0, 0, 0);
    tu_poison(host_cv, C);

    bie_tensor t = dres;
    t.shape[3] = 4; /* res [4][8][5][4] */
    CHECK(bie_bn_act_forward(&p, &dy, &t, &dsm, &dsr, &dout) == BIE_ERR_SHAPE);
    t = dout;
    t.ndim = 3;
    t.shape[2] = 25; /* out [4][8][25]: same count, another rank */
    CHECK(bie_bn_act_forward(&p, &dy, &dres, &dsm, &dsr, &t) == BIE_ERR_SHAPE);
    t = dout;
    t.dtype = dt == BIE_F16 ? BIE_BF16 : BIE_F16; /* another dtype, same bytes a value */
    CHECK(bie_bn_act_forward(&p, &dy, &dres, &dsm, &dsr, &t) != BIE_OK);
    t = dgam;
    t.shape[0] = C - 1;
    p.gamma = &t;
    CHECK(bie_bn_act_forward(&p, &dy, &dres, &dsm, &dsr, &dout) != BIE_OK);
    p.gamma = &dgam;
    p.eps = 0;
    CHECK(bie_bn_act_forward(&p, &dy, &dres, &dsm, &dsr, &dout) != BIE_OK);
    p.eps = 1e-5f;
    p.momentum = 2;
    CHECK(bie_bn_act_forward(&p, &dy, &dres, &dsm, &dsr, &dout) != BIE_OK);
    p.momentum = 0.1f;
    /* a CPU tensor among CUDA ones (the F32 case: only the device differs) */
    if (dt == BIE_F32) {
        CHECK(bie_bn_act_forward(&p, &dy, &dres, &dsm, &dsr, &hout) == BIE_ERR_DEVICE);
        CHECK(bie_bn_act_forward(&p, &dy, &dres, &hsm, &dsr, &dout) == BIE_ERR_DEVICE);
        p.gamma = &hgam;
        CHECK(bie_bn_act_forward(&p, &dy, &dres, &dsm, &dsr, &dout) == BIE_ERR_DEVICE);
        CHECK(bie_bn_act_backward(&p, &dg, &dy, &dres, &dsm, &dsr, &dgy, &dgr, &dgg, &dgb, &dgs) ==
              BIE_ERR_DEVICE);
        p.gamma = &dgam;
        CHECK(bie_bn_act_backward(&p, &dg, &dy, &dres, &dsm, &dsr, &hout, &dgr, &dgg, &dgb, &dgs) ==
              BIE_ERR_DEVICE);
    }
    /* backward with mismatched shapes */
    t = dg;
    t.shape[0] = 3;
    CHECK(bie_bn_act_backward(&p, &t, &dy, &dres, &dsm, &dsr, &dgy, &dgr, &dgg, &dgb, &dgs) ==
          BIE_ERR_SHAPE);
    t = dgr;
    t.shape[2] = 4;
    CHECK(bie_bn_act_backward(&p, &dg, &dy, &dres, &dsm, &dsr, &dgy, &t, &dgg, &dgb, &dgs) ==
          BIE_ERR_SHAPE);
    for (int i = 0; i < 8; i++) CHECK(still_poisoned(outs[i]));
    CHECK(device_bytes_match(&drm, h.rm0) && device_bytes_match(&drv, h.rv0));
    float *pois = tu_alloc((size_t)n * 4);
    tu_poison(pois, n);
    CHECK(tu_same_bits(host_out, pois, n) && tu_same_bits(host_cv, pois, C));
    free(pois);
    /* the valid calls still work */
    CHECK_OK(bie_bn_act_forward(&p, &dy, &dres, &dsm, &dsr, &dout));
    CHECK_OK(bie_bn_act_backward(&p, &dg, &dy, &dres, &dsm, &dsr, &dgy, &dgr, &dgg, &dgb, &dgs));
    CHECK(!still_poisoned(&dout) && !still_poisoned(&dgy));

    bie_tensor *acts[] = {&dy, &dres, &dg, &dout, &dgy, &dgr};
    for (int i = 0; i < 6; i++) dev_act_free(acts[i], &c);
    bie_tensor *vecs[] = {&dgam, &dbet, &dslo, &drm, &drv, &dsm, &dsr, &dgg, &dgb, &dgs};
    for (int i = 0; i < 10; i++) bie_tensor_free(vecs[i]);
    free(host_out);
    free(host_cv);
    host_free(&h);
}

int main(int argc, char **argv) {
    const int small = argc > 1 && strcmp(argv[1], "--small") == 0;
    if (gpu_missing()) return TU_SKIP;
    tu_seed(2718);
    for (int d = 0; d < 3; d++) test_bad_calls(kDtypes[d]);
    /* channels-last views [P][C][1] */
    static const int64_t chans[] = {64, 128, 3, 20, 1};
    static const int64_t rows[] = {1, 2, 7, 33, 257, 1000, 4999};
    const int nrows = small ? 4 : 7;
    for (int i = 0; i < 5; i++)
        for (int j = 0; j < nrows; j++) run_shape(3, rows[j], chans[i], 1, 0);
    run_shape(2, 513, 20, 0, 0); /* rank 2 [N][C] */
    /* rows of more than 256 vectors or scalars (several blocks across the channels) */
    static const int64_t wide[] = {300, 1100, 2056};
    for (int i = 0; i < 3; i++) {
        run_shape(3, 3, wide[i], 1, 0);
        if (!small) run_shape(3, 40, wide[i], 1, 0);
    }
    /* NCHW */
    static const int64_t ns[] = {1, 2, 3}, cs[] = {1, 5, 64},
                         hw[][2] = {{1, 1}, {7, 7}, {4, 4}, {32, 32}};
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < 3; b++)
            for (int k = 0; k < (small ? 3 : 4); k++)
                run_shape(4, ns[a], cs[b], hw[k][0], hw[k][1]);
    /* many blocks: [1024 * 32 * 32 / 8][64][1] bfloat16, training and inference */
    const int64_t big = small ? 4096 : 1024 * 32 * 32 / 8;
    gcase c = {3,    {big, 64, 1, 0}, BIE_BF16, true, true, true, true,
               true, SLOPE_CHANNEL,   0.1f,     false};
    run_gcase(&c);
    c.training = false;
    c.slope = SLOPE_SHARED;
    run_gcase(&c);
    /* large planes: many splits of one channel's reduction */
    c = (gcase){4,    {8, 64, 32, 32}, BIE_F16, true, true, true, true,
                true, SLOPE_CHANNEL,   0.1f,    false};
    if (!small) run_gcase(&c);
    c = (gcase){4,    {2, 1, 512, 512}, BIE_F32, true, true, true, true,
                true, SLOPE_SHARED,     0.1f,    false};
    if (!small) run_gcase(&c);
    c = (gcase){4,    {1, 3, 256, 256}, BIE_BF16, false, true, false, true,
                true, SLOPE_CHANNEL,    0.1f,     true};
    if (!small) run_gcase(&c);
    return tu_finish();
}
