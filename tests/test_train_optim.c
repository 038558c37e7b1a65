/* Optimizer steps on tensors against straightforward reference loops: sign-flip (flips
 * exactly where SPEC §5's formula says, int8 and float gradients, several steps) and
 * Adam / AdamW (the textbook formulas with bias correction, in double); bad input leaves
 * every buffer unchanged. */
#include "train/train_test_util.h"

static bie_tensor view_of(void *data, bie_dtype dt, int64_t rows, int64_t cols) {
    return tu_view(data, dt, 2, rows, cols, 0, 0);
}

static void test_signflip(int64_t rows, int64_t cols, int float_grad) {
    const int64_t n = rows * cols;
    int8_t *w = tu_alloc((size_t)n), *wr = tu_alloc((size_t)n), *g8 = tu_alloc((size_t)n);
    float *gf = tu_alloc((size_t)n * 4), *m = tu_alloc((size_t)n * 4), *v = tu_alloc((size_t)n * 4);
    float *mr = tu_alloc((size_t)n * 4), *vr = tu_alloc((size_t)n * 4);
    for (int64_t i = 0; i < n; i++) {
        int q = (int)(tu_next() % 255) - 127;
        w[i] = (int8_t)(q == 0 ? 1 : q);
    }
    w[0] = 0;        /* sign(0) = +1: flips to -1 */
    w[n - 1] = -128; /* flips to 127 */
    memcpy(wr, w, (size_t)n);
    memset(m, 0, (size_t)n * 4);
    memset(v, 0, (size_t)n * 4);
    memset(mr, 0, (size_t)n * 4);
    memset(vr, 0, (size_t)n * 4);
    const float lr = 1e-3f, b1 = 0.9f, b2 = 0.99f;
    bie_tensor tw = view_of(w, BIE_I8, rows, cols), tm = view_of(m, BIE_F32, rows, cols),
               tv = view_of(v, BIE_F32, rows, cols);
    bie_tensor tg = float_grad ? view_of(gf, BIE_F32, rows, cols) : view_of(g8, BIE_I8, rows, cols);
    int64_t total_flips = 0;
    for (int step = 0; step < 6; step++) {
        /* gradients with a per-element bias, so some signs persist and some alternate */
        for (int64_t i = 0; i < n; i++) {
            const float bias = (float)((int)(i % 7) - 3) * 0.2f;
            gf[i] = tu_uniform(-1, 1) + bias;
            g8[i] = (int8_t)((int)(tu_next() % 255) - 127);
        }
        int64_t want_flips = 0;
        for (int64_t i = 0; i < n; i++) { /* the reference: SPEC §5 literally */
            const float g = float_grad ? gf[i] : (float)g8[i];
            mr[i] = mr[i] + (1.0f - b1) * (g - mr[i]);
            const float sm = mr[i] >= 0 ? 1.0f : -1.0f;
            vr[i] = vr[i] + (1.0f - b2) * (sm * lr - vr[i]);
            const int u = vr[i] >= 0 ? -1 : 1;
            const int sw = wr[i] >= 0 ? 1 : -1;
            if (u != sw) {
                wr[i] = wr[i] == 0 ? -1 : wr[i] == -128 ? 127 : (int8_t)-wr[i];
                want_flips++;
            }
        }
        int64_t flips = -1;
        CHECK_OK(bie_signflip_step(&tw, &tg, &tm, &tv, lr, b1, b2, &flips));
        CHECK(flips == want_flips);
        CHECK(memcmp(w, wr, (size_t)n) == 0);
        int close = 1;
        for (int64_t i = 0; i < n; i++)
            close &= ttu_close(m[i], mr[i], 1e-7, 1e-6) && ttu_close(v[i], vr[i], 1e-12, 1e-6);
        CHECK(close);
        total_flips += flips;
        /* every weight's sign is now -sign(v) */
        int agree = 1;
        for (int64_t i = 0; i < n; i++) agree &= (w[i] < 0) == (v[i] >= 0);
        CHECK(agree);
    }
    CHECK(total_flips > 0);

    /* bad input changes nothing */
    memcpy(wr, w, (size_t)n);
    memcpy(mr, m, (size_t)n * 4);
    bie_tensor wrong = view_of(m, BIE_F32, cols, rows); /* transposed shape */
    if (rows != cols)
        CHECK(bie_signflip_step(&tw, &tg, &wrong, &tv, lr, b1, b2, NULL) == BIE_ERR_SHAPE);
    CHECK(bie_signflip_step(&tw, &tg, &tm, &tv, 0.0f, b1, b2, NULL) == BIE_ERR_INVALID_ARGUMENT);
    CHECK(bie_signflip_step(&tw, &tg, &tm, &tv, lr, 1.0f, b2, NULL) == BIE_ERR_INVALID_ARGUMENT);
    CHECK(bie_signflip_step(&tw, &tg, &tm, &tv, lr, b1, NAN, NULL) == BIE_ERR_INVALID_ARGUMENT);
    CHECK(bie_signflip_step(&tm, &tg, &tm, &tv, lr, b1, b2, NULL) == BIE_ERR_DTYPE);
    CHECK(bie_signflip_step(&tw, &tg, &tw, &tv, lr, b1, b2, NULL) == BIE_ERR_DTYPE);
    CHECK(bie_signflip_step(&tw, NULL, &tm, &tv, lr, b1, b2, NULL) == BIE_ERR_NULL_POINTER);
    CHECK(memcmp(w, wr, (size_t)n) == 0 && memcmp(m, mr, (size_t)n * 4) == 0);
    free(w), free(wr), free(g8), free(gf), free(m), free(v), free(mr), free(vr);
}

static void test_adam(int64_t rows, int64_t cols, float wd, bool decoupled) {
    const int64_t n = rows * cols;
    float *p = tu_alloc((size_t)n * 4), *g = tu_alloc((size_t)n * 4), *m = tu_alloc((size_t)n * 4),
          *v = tu_alloc((size_t)n * 4);
    double *pr = tu_alloc((size_t)n * 8), *mr = tu_alloc((size_t)n * 8),
           *vr = tu_alloc((size_t)n * 8);
    tu_fill(p, n, -1, 1);
    for (int64_t i = 0; i < n; i++) pr[i] = p[i], mr[i] = 0, vr[i] = 0;
    memset(m, 0, (size_t)n * 4);
    memset(v, 0, (size_t)n * 4);
    bie_adam_options o = bie_adam_defaults();
    CHECK(o.lr == 1e-3f && o.beta1 == 0.9f && o.beta2 == 0.999f && o.eps == 1e-8f &&
          o.weight_decay == 0 && !o.decoupled);
    o.lr = 0.01f;
    o.weight_decay = wd;
    o.decoupled = decoupled;
    bie_tensor tp = view_of(p, BIE_F32, rows, cols), tg = view_of(g, BIE_F32, rows, cols);
    bie_tensor tm = view_of(m, BIE_F32, rows, cols), tv = view_of(v, BIE_F32, rows, cols);
    int bad = 0;
    for (int step = 1; step <= 5; step++) {
        tu_fill(g, n, -2, 2);
        CHECK_OK(bie_adam_step(&tp, &tg, &tm, &tv, step, &o));
        for (int64_t i = 0; i < n; i++) { /* the textbook formulas, in double */
            double gi = g[i];
            if (decoupled)
                pr[i] -= (double)o.lr * wd * pr[i];
            else
                gi += wd * pr[i];
            mr[i] = 0.9 * mr[i] + 0.1 * gi;
            vr[i] = 0.999 * vr[i] + 0.001 * gi * gi;
            const double mh = mr[i] / (1 - pow(0.9, step)), vh = vr[i] / (1 - pow(0.999, step));
            pr[i] -= (double)o.lr * mh / (sqrt(vh) + 1e-8);
            bad += !ttu_close(p[i], pr[i], 2e-6, 1e-5);
        }
    }
    CHECK(bad == 0);
    /* bad input changes nothing */
    float *keep = tu_alloc((size_t)n * 4);
    memcpy(keep, p, (size_t)n * 4);
    CHECK(bie_adam_step(&tp, &tg, &tm, &tv, 0, &o) == BIE_ERR_INVALID_ARGUMENT);
    bie_adam_options bad_o = o;
    bad_o.eps = 0;
    CHECK(bie_adam_step(&tp, &tg, &tm, &tv, 6, &bad_o) == BIE_ERR_INVALID_ARGUMENT);
    bad_o = o;
    bad_o.weight_decay = -1;
    CHECK(bie_adam_step(&tp, &tg, &tm, &tv, 6, &bad_o) == BIE_ERR_INVALID_ARGUMENT);
    bie_tensor flat = tu_view(g, BIE_F32, 1, n, 0, 0, 0);
    CHECK(bie_adam_step(&tp, &flat, &tm, &tv, 6, &o) == BIE_ERR_SHAPE);
    CHECK(bie_adam_step(&tp, &tg, &tm, &tv, 6, NULL) == BIE_ERR_NULL_POINTER);
    CHECK(memcmp(keep, p, (size_t)n * 4) == 0);
    free(keep), free(p), free(g), free(m), free(v), free(pr), free(mr), free(vr);
}

int main(void) {
    tu_seed(99);
    test_signflip(7, 13, 1);
    test_signflip(1, 1000, 0);
    test_signflip(33, 65, 1);
    test_adam(5, 9, 0.0f, false);
    test_adam(1, 1, 0.1f, false);
    test_adam(17, 31, 0.05f, true);
    return tu_finish();
}
