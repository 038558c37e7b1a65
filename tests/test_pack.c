/* Bit-packing: layout (SPEC §1) against a direct bit-by-bit check, round trips for every
 * word size and odd row lengths, from float32 and int8; the division-free 4-bit
 * quantization and the division-free quotient of the 4-bit backward state against the defining
 * ones. */
#include "../src/core/formats.h"
#include "test_util.h"

static void check_layout(int64_t rows, int64_t cols, int w) {
    float *x = tu_alloc((size_t)(rows * cols) * sizeof(float));
    int8_t *x8 = tu_alloc((size_t)(rows * cols));
    tu_fill(x, rows * cols, -1, 1);
    for (int64_t i = 0; i < rows * cols; i++) {
        if (tu_next() % 7 == 0) x[i] = (tu_next() & 1) ? 0.0f : -0.0f; /* sign(±0) = +1 */
        x8[i] = (int8_t)(tu_next() % 255 - 127);
    }
    int64_t words = bie_packed_words(cols, w);
    size_t bytes = (size_t)(rows * words * (w / 8));
    bie_dtype dt = w == 8 ? BIE_U8 : w == 32 ? BIE_U32 : BIE_U64;
    uint8_t *p = tu_alloc(bytes), *p8 = tu_alloc(bytes);
    memset(p, 0xA5, bytes);
    memset(p8, 0x5A, bytes);
    bie_tensor tx = tu_view(x, BIE_F32, 2, rows, cols, 0, 0);
    bie_tensor tx8 = tu_view(x8, BIE_I8, 2, rows, cols, 0, 0);
    bie_tensor tp = tu_view(p, dt, 2, rows, words, 0, 0);
    bie_tensor tp8 = tu_view(p8, dt, 2, rows, words, 0, 0);
    CHECK_OK(bie_pack_signs(&tx, w, &tp));
    CHECK_OK(bie_pack_signs(&tx8, w, &tp8));
    int bad = 0, bad8 = 0, badpad = 0;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c = 0; c < words * w; c++) {
            /* element c of row r: word c / w, bit c % w, read as a little-endian word */
            const uint8_t *word = p + (r * words + c / w) * (w / 8);
            const uint8_t *word8 = p8 + (r * words + c / w) * (w / 8);
            uint64_t v = 0, v8 = 0;
            memcpy(&v, word, (size_t)(w / 8));
            memcpy(&v8, word8, (size_t)(w / 8));
            int bit = (int)((v >> (c % w)) & 1), bit8 = (int)((v8 >> (c % w)) & 1);
            if (c < cols) {
                bad += bit != (x[r * cols + c] >= 0);
                bad8 += bit8 != (x8[r * cols + c] >= 0);
            } else {
                badpad += bit != 0 || bit8 != 0;
            }
        }
    }
    CHECK(bad == 0);
    CHECK(bad8 == 0);
    CHECK(badpad == 0);
    /* round trip to ±1 */
    float *u = tu_alloc((size_t)(rows * cols) * sizeof(float));
    int8_t *u8 = tu_alloc((size_t)(rows * cols));
    tu_poison(u, rows * cols);
    memset(u8, 0x7f, (size_t)(rows * cols));
    bie_tensor tu = tu_view(u, BIE_F32, 2, rows, cols, 0, 0);
    bie_tensor tu8 = tu_view(u8, BIE_I8, 2, rows, cols, 0, 0);
    CHECK_OK(bie_unpack_signs(&tp, w, &tu));
    CHECK_OK(bie_unpack_signs(&tp8, w, &tu8));
    int rt = 0;
    for (int64_t i = 0; i < rows * cols; i++) {
        rt += u[i] != (x[i] >= 0 ? 1.0f : -1.0f);
        rt += u8[i] != (x8[i] >= 0 ? 1 : -1);
    }
    CHECK(rt == 0);
    if (bad || bad8 || badpad || rt)
        fprintf(stderr, "  layout failure rows=%lld cols=%lld w=%d\n", (long long)rows,
                (long long)cols, w);
    free(x);
    free(x8);
    free(p);
    free(p8);
    free(u);
    free(u8);
}

/* bie_q4_fast against bie_q4 for one scale: values at, just around and between every
 * half-integer multiple of s in the code range and beyond, random values, specials. */
static int check_q4_fast_scale(float s) {
    const float inv = bie_q4_inverse(s);
    int bad = 0;
    for (int h = -40; h <= 40; h++) {
        float v = (float)(h * 0.5) * s;
        for (int u = 0; u < 12; u++) v = nextafterf(v, -INFINITY);
        for (int u = 0; u < 25; u++, v = nextafterf(v, INFINITY))
            bad += bie_q4_fast(v, s, inv) != bie_q4(v, s);
    }
    for (int i = 0; i < 20000; i++) {
        const float v = tu_uniform(-12.0f, 12.0f) * s;
        bad += bie_q4_fast(v, s, inv) != bie_q4(v, s);
        bad += bie_q4_fast(-v, s, inv) != bie_q4(-v, s);
    }
    const float special[] = {0.0f,   -0.0f,   INFINITY, -INFINITY, NAN,
                             1e-45f, -1e-45f, 1e-38f,   3e38f,     -3e38f};
    for (size_t i = 0; i < sizeof special / sizeof special[0]; i++)
        bad += bie_q4_fast(special[i], s, inv) != bie_q4(special[i], s);
    return bad;
}

static void check_q4_fast(void) {
    int bad = 0;
    for (int i = 0; i < 200; i++) bad += check_q4_fast_scale(tu_uniform(1e-3f, 4.0f));
    /* Powers of two, the edges of the multiply's range and scales past them (division only). */
    const float scales[] = {
        1.0f,     0.5f,      0.25f,     0x1p-10f,    0x1p-125f, 0x1.000002p-125f,
        0x1p125f, 0x1p-126f, 0x1p-140f, 0x1p126f,    1e-45f,    3e38f,
        -0.37f,   -2.0f,     0.1f,      1.0f / 3.0f, 7.0f};
    for (size_t i = 0; i < sizeof scales / sizeof scales[0]; i++)
        bad += check_q4_fast_scale(scales[i]);
    CHECK(bad == 0);
    CHECK(bie_q4_inverse(0x1p-126f) != bie_q4_inverse(0x1p-126f)); /* past the range: NaN */
    CHECK(bie_q4_inverse(2.0f) == 0.5f);
}

/* The 4-bit backward state of a quotient q (the CUDA activation pass's q4_state_of): code,
 * clip bit, residual. */
static int q4_state(float q, int *clip, int *resid) {
    const float r = rintf(q);
    *clip = q >= -8.0f && q <= 7.0f;
    *resid = *clip ? (int)(int8_t)rintf((r - q) * 254.0f) : 0;
    if (!(r == r)) return 0;
    return (int)(r < -8.0f ? -8.0f : r > 7.0f ? 7.0f : r);
}

/* bie_q4_quotient against the division for one scale: the quotient bit for bit wherever
 * |v / s| >= 2^-40 (NaN for NaN), the state always. */
static int64_t check_quotient_scale(float s) {
    const float y = bie_q4_reciprocal(s);
    int64_t bad = 0;
    float v = 0.0f;
    for (int i = 0; i < 60000; i++) {
        const int kind = i % 6;
        if (kind == 0) { /* at and around every multiple of s / 2 of the code range and past it */
            v = (float)((i / 6) % 81 - 40) * 0.5f * s;
            for (int u = (i / 486) % 13; u > 0; u--)
                v = nextafterf(v, ((i / 6) & 1) ? INFINITY : -INFINITY);
        } else if (kind == 1) {
            v = tu_uniform(-12.0f, 12.0f) * s;
        } else if (kind == 2) { /* any bit pattern */
            const uint32_t u = (uint32_t)tu_next();
            memcpy(&v, &u, 4);
        } else if (kind == 3) { /* any magnitude */
            v = ldexpf(tu_uniform(-1.0f, 1.0f), (int)(tu_next() % 300) - 150);
        } else if (kind == 4) { /* a residual at the int8 rounding edge: q = n + (j + 0.5) / 254 */
            const float q =
                (float)((int)(tu_next() % 17) - 8) + ((float)(tu_next() % 254) + 0.5f) / 254.0f;
            v = q * s;
            for (int u = (int)(tu_next() % 5); u > 0; u--) v = nextafterf(v, INFINITY);
        } else {
            const float sp[] = {0.0f,  -0.0f,  INFINITY, -INFINITY,      NAN,     1e-45f, -1e-40f,
                                3e38f, -3e38f, 0x1p60f,  0x1.000002p60f, -0x1p61f};
            v = sp[(i / 6) % 12];
        }
        const float a = v / s, b = bie_q4_quotient(v, s, y);
        int ca, ra, cb, rb;
        const int ka = q4_state(a, &ca, &ra), kb = q4_state(b, &cb, &rb);
        bad += ka != kb || ca != cb || ra != rb;
        if (a == a ? fabsf(a) >= 0x1p-40f && memcmp(&a, &b, 4) != 0 : b == b) bad++;
    }
    return bad;
}

static void check_q4_quotient(void) {
    int64_t bad = 0;
    for (int i = 0; i < 100; i++) bad += check_quotient_scale(tu_uniform(1e-3f, 4.0f));
    for (int i = 0; i < 100; i++) /* any scale of the range and past it */
        bad += check_quotient_scale(ldexpf(tu_uniform(1.0f, 2.0f), (int)(tu_next() % 140) - 70));
    const float scales[] = {0.37f,    1.7f,    0.013f,      2.5e-3f, 3e-5f,          1e-18f, 1.0f,
                            0x1p-60f, 0x1p60f, 0x1p-61f,    0x1p61f, 1e-45f,         0.0f,   -0.37f,
                            INFINITY, NAN,     1.0f / 3.0f, 7.0f,    0x1.fffffep-61f};
    for (size_t i = 0; i < sizeof scales / sizeof scales[0]; i++)
        bad += check_quotient_scale(scales[i]);
    CHECK(bad == 0);
    if (bad) fprintf(stderr, "  bie_q4_quotient: %lld differences\n", (long long)bad);
    CHECK(bie_q4_reciprocal(0x1p-61f) != bie_q4_reciprocal(0x1p-61f)); /* out of range: NaN */
    CHECK(bie_q4_reciprocal(4.0f) == 0.25f);
}

int main(void) {
    if (tu_forced_set_missing()) return TU_SKIP;
    check_q4_fast();
    check_q4_quotient();
    tu_seed(1);
    const int64_t cols_list[] = {1, 2, 7, 8, 9, 31, 32, 33, 63, 64, 65, 127, 200, 1000, 4099};
    const int words[] = {8, 32, 64};
    for (size_t c = 0; c < sizeof cols_list / sizeof cols_list[0]; c++)
        for (int w = 0; w < 3; w++)
            check_layout(1 + (int64_t)(tu_next() % 5), cols_list[c], words[w]);
    /* leading shape is flattened: [2, 3, 5] packs as 6 rows */
    float x[30];
    tu_fill(x, 30, -1, 1);
    uint8_t p[6];
    bie_tensor tx = tu_view(x, BIE_F32, 3, 2, 3, 5, 0), tp = tu_view(p, BIE_U8, 3, 2, 3, 1, 0);
    CHECK_OK(bie_pack_signs(&tx, 8, &tp));
    for (int r = 0; r < 6; r++) {
        unsigned expect = 0;
        for (int c = 0; c < 5; c++) expect |= (unsigned)(x[r * 5 + c] >= 0) << c;
        CHECK(p[r] == expect);
    }
    CHECK(bie_packed_words(65, 64) == 2);
    CHECK(bie_packed_words(64, 64) == 1);
    CHECK(bie_packed_words(9, 8) == 2);
    return tu_finish();
}
