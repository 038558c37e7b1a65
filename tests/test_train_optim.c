/* Optimizer steps on tensors against straightforward reference loops: sign-flip (its
 * initial state from a seed; flips exactly where SPEC §5's formulas say, int8 and float
 * gradients with exact zeros, many steps; a weight whose gradient stays 0 never flips) and
 * Adam / AdamW (the textbook formulas with bias correction, in double); bad input leaves
 * every buffer unchanged. */
#include "train/train_test_util.h"

static bie_tensor view_of(void *data, bie_dtype dt, int64_t rows, int64_t cols) {
    return tu_view(data, dt, 2, rows, cols, 0, 0);
}

/* Random int8 weights, no zeros except where the caller puts them. */
static void fill_weights(int8_t *w, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        int q = (int)(tu_next() % 256) - 128;
        w[i] = (int8_t)(q == 0 ? 1 : q);
    }
}

/* The documented generator: splitmix64 from the seed, delta = (bits53 + 1) * 1e-3 / 2^53. */
static float ref_delta(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)((double)((z >> 11) + 1) * (1.0 / 9007199254740992.0) * 1e-3);
}

static void test_signflip_init(int64_t rows, int64_t cols) {
    const int64_t n = rows * cols;
    int8_t *w = tu_alloc((size_t)n), *w0 = tu_alloc((size_t)n);
    float *m = tu_alloc((size_t)n * 4), *v = tu_alloc((size_t)n * 4);
    float *v2 = tu_alloc((size_t)n * 4), *m2 = tu_alloc((size_t)n * 4);
    fill_weights(w, n);
    w[0] = 0; /* sign(0) = +1: v < 0 */
    w[n - 1] = -128;
    memcpy(w0, w, (size_t)n);
    for (int64_t i = 0; i < n; i++) m[i] = 5.0f, v[i] = 5.0f, m2[i] = 1.0f;
    bie_tensor tw = view_of(w, BIE_I8, rows, cols), tm = view_of(m, BIE_F32, rows, cols),
               tv = view_of(v, BIE_F32, rows, cols), tv2 = view_of(v2, BIE_F32, rows, cols),
               tm2 = view_of(m2, BIE_F32, rows, cols);
    CHECK_OK(bie_signflip_init(&tw, &tm, &tv, 42));
    CHECK(memcmp(w, w0, (size_t)n) == 0);
    uint64_t state = 42;
    int bad = 0;
    double sum = 0;
    for (int64_t i = 0; i < n; i++) {
        const float delta = ref_delta(&state);
        bad += m[i] != 0.0f || !(delta > 0.0f && delta <= 1e-3f);
        bad += v[i] != (w[i] < 0 ? delta : -delta); /* v = -sign(w) * delta */
        sum += delta;
    }
    CHECK(bad == 0);
    if (n >= 1000) CHECK(fabs(sum / (double)n - 5e-4) < 5e-5); /* uniform in (0, 1e-3] */
    /* the same seed gives the same state; another seed another one */
    CHECK_OK(bie_signflip_init(&tw, &tm2, &tv2, 42));
    CHECK(memcmp(v, v2, (size_t)n * 4) == 0 && memcmp(m, m2, (size_t)n * 4) == 0);
    CHECK_OK(bie_signflip_init(&tw, &tm2, &tv2, 43));
    if (n > 1) CHECK(memcmp(v, v2, (size_t)n * 4) != 0);

    /* bad input changes nothing */
    memcpy(v2, v, (size_t)n * 4);
    bie_tensor wrong = view_of(v2, BIE_F32, cols, rows);
    if (rows != cols) CHECK(bie_signflip_init(&tw, &tm, &wrong, 1) == BIE_ERR_SHAPE);
    CHECK(bie_signflip_init(NULL, &tm, &tv, 1) == BIE_ERR_NULL_POINTER);
    CHECK(bie_signflip_init(&tw, NULL, &tv, 1) == BIE_ERR_NULL_POINTER);
    CHECK(bie_signflip_init(&tw, &tm, NULL, 1) == BIE_ERR_NULL_POINTER);
    CHECK(bie_signflip_init(&tm, &tm, &tv, 1) == BIE_ERR_DTYPE);
    CHECK(bie_signflip_init(&tw, &tw, &tv, 1) == BIE_ERR_DTYPE);
    CHECK(bie_signflip_init(&tw, &tv, &tv, 1) == BIE_ERR_INVALID_ARGUMENT); /* m aliases v */
    CHECK(memcmp(v, v2, (size_t)n * 4) == 0 && memcmp(w, w0, (size_t)n) == 0);
    free(w), free(w0), free(m), free(v), free(v2), free(m2);
}

/* Gradients exactly 0 from the start: not one flip in 1000 steps, m stays 0. */
static void test_zero_grad_never_flips(float lr, float b1, float b2, int float_grad) {
    enum { ROWS = 17, COLS = 61, N = ROWS * COLS };
    int8_t w[N], w0[N], g8[N];
    float gf[N], m[N], v[N];
    fill_weights(w, N);
    w[0] = 0, w[1] = -128, w[2] = 127, w[3] = 1, w[4] = -1;
    memcpy(w0, w, sizeof w);
    memset(g8, 0, sizeof g8);
    for (int i = 0; i < N; i++) gf[i] = (i % 2) ? 0.0f : -0.0f;
    bie_tensor tw = view_of(w, BIE_I8, ROWS, COLS), tm = view_of(m, BIE_F32, ROWS, COLS),
               tv = view_of(v, BIE_F32, ROWS, COLS);
    bie_tensor tg = float_grad ? view_of(gf, BIE_F32, ROWS, COLS) : view_of(g8, BIE_I8, ROWS, COLS);
    CHECK_OK(bie_signflip_init(&tw, &tm, &tv, 5));
    int64_t total = 0;
    for (int step = 0; step < 1000; step++) {
        int64_t flips = -1;
        CHECK_OK(bie_signflip_step(&tw, &tg, &tm, &tv, lr, b1, b2, &flips));
        total += flips;
    }
    CHECK(total == 0);
    CHECK(memcmp(w, w0, sizeof w) == 0);
    int bad = 0;
    for (int i = 0; i < N; i++) bad += m[i] != 0.0f || (w[i] < 0) != (v[i] > 0);
    CHECK(bad == 0);
}

/* SPEC §5 literally, one element; the products kept apart (no fused multiply-add). */
static int ref_step(int8_t *w, float *m, float *v, float g, float lr, float b1, float b2) {
    volatile float t = (1.0f - b1) * (g - *m);
    *m = *m + t;
    const float sgn0 = *m > 0 ? 1.0f : *m < 0 ? -1.0f : 0.0f;
    t = (1.0f - b2) * (sgn0 * lr - *v);
    *v = *v + t;
    const int u = *v >= 0 ? -1 : 1; /* -sign(v), sign(0) = +1 */
    const int sw = *w >= 0 ? 1 : -1;
    if (u == sw) return 0;
    *w = *w == 0 ? -1 : *w == -128 ? 127 : (int8_t) - *w;
    return 1;
}

static void test_signflip(int64_t rows, int64_t cols, int float_grad, int steps, float lr, float b1,
                          float b2) {
    const int64_t n = rows * cols;
    int8_t *w = tu_alloc((size_t)n), *wr = tu_alloc((size_t)n), *g8 = tu_alloc((size_t)n);
    int8_t *w0 = tu_alloc((size_t)n);
    float *gf = tu_alloc((size_t)n * 4), *m = tu_alloc((size_t)n * 4), *v = tu_alloc((size_t)n * 4);
    float *mr = tu_alloc((size_t)n * 4), *vr = tu_alloc((size_t)n * 4);
    fill_weights(w, n);
    w[0] = 0;        /* sign(0) = +1: flips to -1 */
    w[n - 1] = -128; /* flips to 127 */
    memcpy(wr, w, (size_t)n);
    memcpy(w0, w, (size_t)n);
    bie_tensor tw = view_of(w, BIE_I8, rows, cols), tm = view_of(m, BIE_F32, rows, cols),
               tv = view_of(v, BIE_F32, rows, cols);
    bie_tensor tg = float_grad ? view_of(gf, BIE_F32, rows, cols) : view_of(g8, BIE_I8, rows, cols);
    CHECK_OK(bie_signflip_init(&tw, &tm, &tv, 1234));
    memcpy(mr, m, (size_t)n * 4);
    memcpy(vr, v, (size_t)n * 4);
    int64_t total_flips = 0;
    int same = 1, agree = 1;
    for (int step = 0; step < steps; step++) {
        /* every 5th element's gradient stays 0; the others have a per-element bias (some
         * signs persist, some alternate) and are exactly 0 one step in 8 */
        for (int64_t i = 0; i < n; i++) {
            const float bias = (float)((int)(i % 7) - 3) * 0.2f;
            const bool zero = i % 5 == 2 || tu_next() % 8 == 0;
            gf[i] = zero ? 0.0f : tu_uniform(-1, 1) + bias;
            g8[i] = zero ? 0 : (int8_t)((int)(tu_next() % 255) - 127 + (int)(bias * 100));
        }
        int64_t want_flips = 0;
        for (int64_t i = 0; i < n; i++)
            want_flips +=
                ref_step(&wr[i], &mr[i], &vr[i], float_grad ? gf[i] : (float)g8[i], lr, b1, b2);
        int64_t flips = -1;
        CHECK_OK(bie_signflip_step(&tw, &tg, &tm, &tv, lr, b1, b2, &flips));
        same &= flips == want_flips && memcmp(w, wr, (size_t)n) == 0 &&
                memcmp(m, mr, (size_t)n * 4) == 0 && memcmp(v, vr, (size_t)n * 4) == 0;
        total_flips += flips;
        /* every weight's sign is -sign(v) */
        for (int64_t i = 0; i < n; i++) agree &= (w[i] < 0) == (v[i] >= 0);
    }
    CHECK(same);
    CHECK(agree);
    CHECK(total_flips > 0);
    int dead = 0;
    for (int64_t i = 2; i < n; i += 5) dead += w[i] != w0[i];
    CHECK(dead == 0); /* the weights whose gradient stayed 0 never flipped */

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
    free(w), free(wr), free(w0), free(g8), free(gf), free(m), free(v), free(mr), free(vr);
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

/* x = max(x, factor * floor): the reference loop; NaN stays; bad input changes nothing. */
static void test_clamp_min_scaled(int64_t rows, int64_t cols, float factor) {
    const int64_t n = rows * cols;
    float *x = tu_alloc((size_t)n * 4), *f = tu_alloc((size_t)n * 4),
          *want = tu_alloc((size_t)n * 4);
    tu_fill(x, n, -2, 2);
    tu_fill(f, n, -2, 2);
    x[0] = NAN;
    for (int64_t i = 0; i < n; i++) {
        const float lo = factor * f[i];
        want[i] = x[i] < lo ? lo : x[i];
    }
    bie_tensor tx = view_of(x, BIE_F32, rows, cols), tf = view_of(f, BIE_F32, rows, cols);
    CHECK_OK(bie_clamp_min_scaled(&tx, &tf, factor));
    CHECK(tu_same_bits(x, want, n));
    int changed = 0;
    for (int64_t i = 1; i < n; i++) changed += x[i] == factor * f[i];
    CHECK(n < 8 || changed > 0); /* some elements were clamped */
    bie_tensor t_short = view_of(f, BIE_F32, rows, cols > 1 ? cols - 1 : 1);
    bie_tensor t_i8 = view_of(f, BIE_I8, rows, cols);
    if (cols > 1) CHECK(bie_clamp_min_scaled(&tx, &t_short, factor) == BIE_ERR_SHAPE);
    CHECK(bie_clamp_min_scaled(&tx, &t_i8, factor) == BIE_ERR_DTYPE);
    CHECK(bie_clamp_min_scaled(&tx, NULL, factor) == BIE_ERR_NULL_POINTER);
    CHECK(bie_clamp_min_scaled(NULL, &tf, factor) == BIE_ERR_NULL_POINTER);
    CHECK(bie_clamp_min_scaled(&tx, &tf, INFINITY) == BIE_ERR_INVALID_ARGUMENT);
    CHECK(tu_same_bits(x, want, n));
    free(x), free(f), free(want);
}

int main(void) {
    tu_seed(99);
    test_signflip_init(7, 13);
    test_signflip_init(1, 1);
    test_signflip_init(200, 300);
    test_zero_grad_never_flips(1e-4f, 0.99f, 0.9999f, 0); /* the defaults */
    test_zero_grad_never_flips(1e-4f, 0.99f, 0.9999f, 1);
    test_zero_grad_never_flips(1e-2f, 0.5f, 0.9f, 0);
    test_signflip(7, 13, 1, 1000, 1e-3f, 0.9f, 0.99f);
    test_signflip(1, 1000, 0, 1000, 1e-3f, 0.9f, 0.99f);
    test_signflip(5, 1000, 1, 1000, 1e-4f, 0.99f, 0.9999f); /* the defaults */
    test_signflip(33, 65, 0, 300, 1e-2f, 0.5f, 0.6f);
    test_signflip(200, 300, 1, 30, 1e-3f, 0.9f, 0.9f); /* the parallel loop */
    test_adam(5, 9, 0.0f, false);
    test_adam(1, 1, 0.1f, false);
    test_adam(17, 31, 0.05f, true);
    test_clamp_min_scaled(1, 1, 0.5f);
    test_clamp_min_scaled(7, 13, 0.5f);
    test_clamp_min_scaled(3, 100, -1.25f);
    return tu_finish();
}
