/* Bad input (SPEC §7) to the binary linear layer, bit-packing, the binary GEMM, tensor
 * descriptors, the kernel registry and threads. Every failing call is checked for: the exact
 * status; a new, non-empty bie_last_error(); every output buffer (poisoned before, with NaN
 * bit patterns or 0xA5 bytes) still holding exactly its poison; and, for layer calls, the
 * layer's state (parameters, qweight, gradients, word size, kernel id, training flag,
 * snapshotted byte by byte before the call) unchanged. Valid tensors hold fixed-seed random
 * data. Prints "N passed, M failed" (counting checks); exits non-zero on any failure. */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bie.h"

enum { IN = 37, OUT = 5, W8 = 5 /* ceil(IN / 8) */, W32 = 2 /* ceil(IN / 32) */ };

static int g_pass, g_fail, g_cases;
static const char *g_case = "(setup)";
static char g_marker[512];

static void report(bool ok, const char *file, int line, const char *what) {
    if (ok) {
        g_pass++;
        return;
    }
    g_fail++;
    fprintf(stderr, "%s:%d: [%s] FAILED: %s\n", file, line, g_case, what);
}
#define CHECK(expr) report((expr) ? true : false, __FILE__, __LINE__, #expr)
#define CASE(name) (g_case = (name), g_cases++)

static void die(const char *what) {
    fprintf(stderr, "test setup failed (%s): %s\n", what, bie_last_error());
    exit(2);
}

/* ---------------------------------------------------------------- buffers */

static uint64_t g_rng = 0x2545F4914F6CDD1Dull; /* xorshift64, fixed seed */
static uint64_t rnd_u64(void) {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return g_rng;
}
static float rnd_f32(void) { /* uniform in (-1, 1), never 0 */
    float v = (float)((double)(rnd_u64() >> 11) * (2.0 / 9007199254740992.0) - 1.0);
    return v != 0.0f ? v : 0.5f;
}

static const uint32_t POISON_F32 = 0x7FC5A5A5u; /* a quiet NaN with a payload */
static unsigned char poison_byte(bie_dtype dt, size_t i) {
    unsigned char pat[4];
    memcpy(pat, &POISON_F32, 4);
    return dt == BIE_F32 ? pat[i % 4] : 0xA5;
}
static bool is_poison(const void *p, size_t bytes, bie_dtype dt) {
    for (size_t i = 0; i < bytes; i++)
        if (((const unsigned char *)p)[i] != poison_byte(dt, i)) return false;
    return true;
}

/* Every tensor of a test function lives in this pool, released at its end. Poisoned buffers
 * (outputs, and structs an erroring call must not write) are watched: after every failing
 * call, each must still hold exactly its poison. */
typedef struct {
    bie_tensor t;
    void *mem;
    size_t bytes;
    bie_dtype dt;
    bool owned, watched;
} slot;
static slot g_pool[256];
static int g_npool;

static slot *pool_add(void *mem, size_t bytes, bie_dtype dt, bool owned, bool watched) {
    if (g_npool == (int)(sizeof g_pool / sizeof g_pool[0])) die("pool full");
    slot *s = &g_pool[g_npool++];
    *s = (slot){.mem = mem, .bytes = bytes, .dt = dt, .owned = owned, .watched = watched};
    return s;
}
static void pool_release(void) {
    for (int i = 0; i < g_npool; i++)
        if (g_pool[i].owned) free(g_pool[i].mem);
    g_npool = 0;
}
/* Poison a struct (a view or info out-parameter) that an erroring call must leave as is. */
static void watch_struct(void *p, size_t bytes) {
    memset(p, 0xA5, bytes);
    pool_add(p, bytes, BIE_U8, false, true);
}

typedef enum { RANDOM, POISON, ZERO } fill_kind;
static bie_tensor *make(bie_dtype dt, fill_kind fill, int ndim, const int64_t *shape) {
    size_t n = 1;
    for (int i = 0; i < ndim; i++) n *= (size_t)shape[i];
    size_t bytes = n * bie_dtype_size(dt);
    unsigned char *mem = malloc(bytes ? bytes : 1);
    if (mem == NULL) die("malloc");
    for (size_t i = 0; i < bytes; i++)
        mem[i] = fill == POISON ? poison_byte(dt, i)
                 : fill == ZERO ? 0
                                : (unsigned char)(rnd_u64() >> 56);
    if (fill == RANDOM && dt == BIE_F32)
        for (size_t i = 0; i < n; i++) ((float *)(void *)mem)[i] = rnd_f32();
    slot *s = pool_add(mem, bytes, dt, true, fill == POISON);
    if (bie_tensor_view(&s->t, mem, dt, ndim, shape) != BIE_OK) die("view");
    return &s->t;
}
#define NDIM(...) ((int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)))
#define MK(dt, fill, ...) make((dt), (fill), NDIM(__VA_ARGS__), (const int64_t[]){__VA_ARGS__})
#define F32(...) MK(BIE_F32, RANDOM, __VA_ARGS__)
#define OUTBUF(...) MK(BIE_F32, POISON, __VA_ARGS__)

/* An altered copy of a descriptor (same memory), e.g. WITH(x, ndim = 5). */
static bie_tensor *alt(const bie_tensor *src) {
    slot *s = pool_add(NULL, 0, BIE_U8, false, false);
    s->t = *src;
    return &s->t;
}
#define WITH(src, assignment)      \
    __extension__({                \
        bie_tensor *t_ = alt(src); \
        t_->assignment;            \
        t_;                        \
    })
#define ON_CUDA(src) WITH(src, device.type = BIE_DEVICE_CUDA)

/* ---------------------------------------------------------------- status, message, outputs */

/* Leave a known message as the last error, so that a failing call that sets none is seen. */
static void set_marker(void) {
    bie_kernel_info info;
    (void)bie_kernel_find(-424242, &info);
}

static void check_status(const char *file, int line, const char *expr, bie_status got,
                         bie_status want) {
    char msg[1024];
    snprintf(msg, sizeof msg, "%s returned %s, expected %s", expr, bie_status_name(got),
             bie_status_name(want));
    report(got == want, file, line, msg);
    const char *e = bie_last_error();
    snprintf(msg, sizeof msg, "%s set no new error message (last: \"%s\")", expr, e ? e : "(null)");
    report(e != NULL && e[0] != '\0' && strcmp(e, g_marker) != 0, file, line, msg);
    for (int i = 0; i < g_npool; i++) {
        if (!g_pool[i].watched) continue;
        snprintf(msg, sizeof msg, "%s wrote into poisoned output #%d (%zu bytes)", expr, i,
                 g_pool[i].bytes);
        bool ok = is_poison(g_pool[i].mem, g_pool[i].bytes, g_pool[i].dt);
        report(ok, file, line, msg);
        for (size_t j = 0; !ok && j < g_pool[i].bytes; j++) /* re-poison: no cascade */
            ((unsigned char *)g_pool[i].mem)[j] = poison_byte(g_pool[i].dt, j);
    }
}
#define EXPECT_S(want, call, text)                           \
    do {                                                     \
        set_marker();                                        \
        bie_status st_ = (call);                             \
        check_status(__FILE__, __LINE__, text, st_, (want)); \
    } while (0)
#define EXPECT(want, call) EXPECT_S(want, call, #call)

/* ---------------------------------------------------------------- layer state */

static const char *const ITEM_NAMES[9] = {"WEIGHT",
                                          "QWEIGHT",
                                          "BIAS_A",
                                          "SCALE_A",
                                          "SCALE_W",
                                          "grad WEIGHT",
                                          "grad WEIGHT_FLOAT_GRAD",
                                          "grad BIAS_A",
                                          "grad SCALE_A"};
static const char *const SCALAR_NAMES[5] = {"bits_binary_word", "gemm kernel id", "training flag",
                                            "in_features", "out_features"};

typedef struct {
    bie_status st; /* of the query: an absent parameter is part of the state too */
    bie_tensor v;
    unsigned char *copy;
    size_t bytes;
} item;

typedef struct {
    item it[9];
    int64_t scalar[5]; /* see SCALAR_NAMES */
} snap;

static void take_snap(snap *s, bie_layer *l) {
    static const bie_param which[9] = {BIE_PARAM_WEIGHT,
                                       BIE_PARAM_QWEIGHT,
                                       BIE_PARAM_BIAS_A,
                                       BIE_PARAM_SCALE_A,
                                       BIE_PARAM_SCALE_W,
                                       BIE_PARAM_WEIGHT,
                                       BIE_PARAM_WEIGHT_FLOAT_GRAD,
                                       BIE_PARAM_BIAS_A,
                                       BIE_PARAM_SCALE_A}; /* 5 parameters, 4 gradients */
    memset(s, 0, sizeof *s);
    for (int i = 0; i < 9; i++) {
        item *it = &s->it[i];
        it->st = i < 5 ? bie_layer_param(l, which[i], &it->v) : bie_layer_grad(l, which[i], &it->v);
        if (it->st != BIE_OK) continue;
        it->bytes = (size_t)bie_tensor_numel(&it->v) * bie_dtype_size(it->v.dtype);
        it->copy = malloc(it->bytes ? it->bytes : 1);
        if (it->copy == NULL) die("snapshot");
        memcpy(it->copy, it->v.data, it->bytes);
    }
    bie_layer_desc d;
    if (bie_layer_describe(l, &d) != BIE_OK) die("describe");
    s->scalar[0] = d.bits_binary_word;
    s->scalar[1] = d.kernel_id;
    s->scalar[2] = d.training;
    s->scalar[3] = d.in;
    s->scalar[4] = d.out;
}

static bool same_item(const item *a, const item *b) {
    if (a->st != b->st) return false;
    if (a->st != BIE_OK) return true;
    if (a->v.data != b->v.data || a->v.dtype != b->v.dtype || a->v.ndim != b->v.ndim) return false;
    for (int i = 0; i < a->v.ndim; i++)
        if (a->v.shape[i] != b->v.shape[i]) return false;
    return a->bytes == b->bytes && memcmp(a->copy, b->copy, a->bytes) == 0;
}

static void check_same(const char *file, int line, snap *a, snap *b) {
    char msg[128];
    for (int i = 0; i < 9; i++) {
        snprintf(msg, sizeof msg, "layer state changed: %s", ITEM_NAMES[i]);
        report(same_item(&a->it[i], &b->it[i]), file, line, msg);
        free(a->it[i].copy);
        free(b->it[i].copy);
    }
    for (int i = 0; i < 5; i++) {
        snprintf(msg, sizeof msg, "layer state changed: %s", SCALAR_NAMES[i]);
        report(a->scalar[i] == b->scalar[i], file, line, msg);
    }
}

/* EXPECT for a call on layer l, which must also leave l's state unchanged. */
#define EXPECT_L(l, want, call)                            \
    do {                                                   \
        snap before_, after_;                              \
        take_snap(&before_, (l));                          \
        EXPECT_S(want, call, #call);                       \
        take_snap(&after_, (l));                           \
        check_same(__FILE__, __LINE__, &before_, &after_); \
    } while (0)

static bie_layer *new_layer(void) {
    bie_layer *l = NULL;
    if (bie_binary_linear_create(&l, IN, OUT, bie_cpu(), BIE_F32, true) != BIE_OK) die("create");
    return l;
}

/* Id of the first binary CPU kernel (not the scalar reference) that is / is not available,
 * or -1. */
static int find_kernel(bool available) {
    for (int i = 0; i < bie_kernel_count(); i++) {
        bie_kernel_info info;
        if (bie_kernel_get(i, &info) == BIE_OK && info.available == available &&
            info.device == BIE_DEVICE_CPU && info.op == BIE_OP_BINARY_GEMM && info.id > 0)
            return info.id;
    }
    return -1;
}

/* A layer in a rich state: int8 weight, qweight, scale_a, a chosen kernel, and the saved
 * activations and gradients of one training step on x [2, 3, IN] with grad_out g. y and gx
 * are poisoned outputs of the right shapes. */
typedef struct {
    bie_layer *l;
    bie_tensor *x, *y, *g, *gx, *gx_ref;
} fixture;

static void fixture_init(fixture *f) {
    f->l = new_layer();
    f->x = F32(2, 3, IN);
    f->g = F32(2, 3, OUT);
    f->gx_ref = MK(BIE_F32, ZERO, 2, 3, IN);
    if (bie_layer_set_weight_data(f->l, F32(OUT, IN)) != BIE_OK ||
        bie_layer_generate_quantized_weight(f->l, false) != BIE_OK ||
        bie_layer_set_gemm_kernel(f->l, find_kernel(true)) != BIE_OK ||
        bie_layer_forward(f->l, f->x, MK(BIE_F32, ZERO, 2, 3, OUT)) != BIE_OK ||
        bie_layer_backward(f->l, f->g, f->gx_ref) != BIE_OK)
        die("fixture");
    f->y = OUTBUF(2, 3, OUT);
    f->gx = OUTBUF(2, 3, IN);
}

/* The saved activations survived: a backward now gives the fixture's grad_x bit for bit. */
static void check_saved(fixture *f, int line) {
    bie_tensor *gx2 = MK(BIE_F32, ZERO, 2, 3, IN);
    bool ok = bie_layer_backward(f->l, f->g, gx2) == BIE_OK &&
              memcmp(gx2->data, f->gx_ref->data, (size_t)2 * 3 * IN * sizeof(float)) == 0;
    report(ok, __FILE__, line, "saved activations changed (backward after the errors differs)");
}

/* ---------------------------------------------------------------- forward */

static void test_forward(void) {
    fixture f;
    fixture_init(&f);
    bie_layer *l = f.l;
    bie_tensor *x = f.x, *y = f.y, *y6 = OUTBUF(6, OUT);

    CASE("forward: NULL layer");
    EXPECT(BIE_ERR_NULL_POINTER, bie_layer_forward(NULL, x, y));
    CASE("forward: NULL input");
    EXPECT_L(l, BIE_ERR_NULL_POINTER, bie_layer_forward(l, NULL, y));
    CASE("forward: NULL output");
    EXPECT_L(l, BIE_ERR_NULL_POINTER, bie_layer_forward(l, x, NULL));
    CASE("forward: input with NULL data");
    EXPECT_L(l, BIE_ERR_NULL_POINTER, bie_layer_forward(l, WITH(x, data = NULL), y));
    CASE("forward: output with NULL data");
    EXPECT_L(l, BIE_ERR_NULL_POINTER, bie_layer_forward(l, x, WITH(y, data = NULL)));
    CASE("forward: input last extent != in_features");
    EXPECT_L(l, BIE_ERR_SHAPE, bie_layer_forward(l, F32(6, IN + 1), y6));
    CASE("forward: output last extent != out_features");
    EXPECT_L(l, BIE_ERR_SHAPE, bie_layer_forward(l, x, OUTBUF(2, 3, OUT + 1)));
    CASE("forward: output leading extents differ from the input's");
    EXPECT_L(l, BIE_ERR_SHAPE, bie_layer_forward(l, x, OUTBUF(3, 2, OUT)));
    CASE("forward: output rank differs from the input's (same element count)");
    EXPECT_L(l, BIE_ERR_SHAPE, bie_layer_forward(l, x, y6));
    CASE("forward: input of rank 0, of rank 5");
    EXPECT_L(l, BIE_ERR_SHAPE, bie_layer_forward(l, WITH(x, ndim = 0), y));
    EXPECT_L(l, BIE_ERR_SHAPE, bie_layer_forward(l, WITH(x, ndim = 5), y));
    CASE("forward: output of rank 0, of rank 5");
    EXPECT_L(l, BIE_ERR_SHAPE, bie_layer_forward(l, x, WITH(y, ndim = 0)));
    EXPECT_L(l, BIE_ERR_SHAPE, bie_layer_forward(l, x, WITH(y, ndim = 5)));
    CASE("forward: negative leading extent");
    EXPECT_L(l, BIE_ERR_SHAPE, bie_layer_forward(l, WITH(x, shape[0] = -2), y));
    CASE("forward: extents whose product overflows");
    EXPECT_L(l, BIE_ERR_OVERFLOW, bie_layer_forward(l, WITH(x, shape[0] = INT64_MAX / 2), y));
    CASE("forward: input dtype int32");
    EXPECT_L(l, BIE_ERR_DTYPE, bie_layer_forward(l, MK(BIE_I32, RANDOM, 2, 3, IN), y));
    CASE("forward: input dtype int8");
    EXPECT_L(l, BIE_ERR_DTYPE, bie_layer_forward(l, MK(BIE_I8, RANDOM, 2, 3, IN), y));
    CASE("forward: input dtype bfloat16 on the CPU");
    EXPECT_L(l, BIE_ERR_DTYPE, bie_layer_forward(l, MK(BIE_BF16, RANDOM, 2, 3, IN), y));
    CASE("forward: output dtype int32");
    EXPECT_L(l, BIE_ERR_DTYPE, bie_layer_forward(l, x, MK(BIE_I32, POISON, 2, 3, OUT)));
    CASE("forward: input on a CUDA device");
    EXPECT_L(l, BIE_ERR_DEVICE, bie_layer_forward(l, ON_CUDA(x), y));
    CASE("forward: output on a CUDA device");
    EXPECT_L(l, BIE_ERR_DEVICE, bie_layer_forward(l, x, ON_CUDA(y)));
    CASE("forward: packed input U32, U64 while bits_binary_word is 8");
    EXPECT_L(l, BIE_ERR_DTYPE, bie_layer_forward(l, MK(BIE_U32, RANDOM, 6, W32), y6));
    EXPECT_L(l, BIE_ERR_DTYPE, bie_layer_forward(l, MK(BIE_U64, RANDOM, 6, 1), y6));
    CASE("forward: packed U8 input whose width is not ceil(in / 8)");
    EXPECT_L(l, BIE_ERR_SHAPE, bie_layer_forward(l, MK(BIE_U8, RANDOM, 6, W8 - 1), y6));
    EXPECT_L(l, BIE_ERR_SHAPE, bie_layer_forward(l, MK(BIE_U8, RANDOM, 6, IN), y6));

    CASE("forward: scale_w made NaN through its parameter view");
    bie_tensor sw;
    CHECK(bie_layer_param(l, BIE_PARAM_SCALE_W, &sw) == BIE_OK);
    const float keep_sw = *(float *)sw.data;
    *(float *)sw.data = NAN;
    EXPECT_L(l, BIE_ERR_NOT_FINITE, bie_layer_forward(l, x, y));
    *(float *)sw.data = keep_sw;
    check_saved(&f, __LINE__);

    CHECK(bie_layer_set_bits_binary_word(l, 32) == BIE_OK);
    CASE("forward: packed U32 input of width ceil(in / 8) after set_bits_binary_word(32)");
    EXPECT_L(l, BIE_ERR_SHAPE, bie_layer_forward(l, MK(BIE_U32, RANDOM, 6, W8), y6));
    CASE("forward: packed U8 input after set_bits_binary_word(32)");
    EXPECT_L(l, BIE_ERR_DTYPE, bie_layer_forward(l, MK(BIE_U8, RANDOM, 6, W32), y6));
    bie_layer_free(l);
    pool_release();
}

/* Scales that cannot be measured or used; an inference-only layer. */
static void test_forward_state(void) {
    bie_layer *l = new_layer(); /* scale_a == 0 */
    bie_tensor *x = F32(4, IN), *x0 = MK(BIE_F32, ZERO, 4, IN), *y = OUTBUF(4, OUT);
    bie_tensor *xinf = F32(4, IN), *packed = MK(BIE_U8, RANDOM, 4, W8);
    ((float *)xinf->data)[5] = INFINITY;
    CASE("forward: all-zero input while scale_a == 0");
    EXPECT_L(l, BIE_ERR_NOT_FINITE, bie_layer_forward(l, x0, y));
    CASE("forward: input holding +inf while scale_a == 0");
    EXPECT_L(l, BIE_ERR_NOT_FINITE, bie_layer_forward(l, xinf, y));
    CASE("set_activation: all-zero input while scale_a == 0");
    EXPECT_L(l, BIE_ERR_NOT_FINITE, bie_layer_set_activation(l, x0, OUTBUF(4, IN)));
    CASE("set_activation: x_out shape differs from x's");
    EXPECT_L(l, BIE_ERR_SHAPE, bie_layer_set_activation(l, x, OUTBUF(2, 2, IN)));
    CASE("forward: pre-packed input while scale_a == 0");
    EXPECT_L(l, BIE_ERR_STATE, bie_layer_forward(l, packed, y));
    CASE("set_activation: pre-packed input");
    EXPECT_L(l, BIE_ERR_DTYPE, bie_layer_set_activation(l, packed, NULL));
    bie_layer_free(l);

    CASE("forward: scale_a * scale_w overflows to +inf");
    l = new_layer();
    bie_tensor *w = F32(OUT, IN);
    for (int i = 0; i < OUT * IN; i++) ((float *)w->data)[i] *= 1000.0f; /* scale_w ~ 500 */
    CHECK(bie_layer_set_weight_data(l, w) == BIE_OK);
    CHECK(bie_layer_set_scale_a(l, 3.0e38f) == BIE_OK);
    EXPECT_L(l, BIE_ERR_NOT_FINITE, bie_layer_forward(l, x, y));
    bie_layer_free(l);

    l = new_layer();
    CHECK(bie_layer_generate_quantized_weight(l, true) == BIE_OK);
    CASE("forward: training forward after generate_quantized_weight(qweight_only)");
    EXPECT_L(l, BIE_ERR_STATE, bie_layer_forward(l, x, y));
    CASE("prepare_params after generate_quantized_weight(qweight_only)");
    EXPECT_L(l, BIE_ERR_STATE, bie_layer_prepare_params(l));
    CASE("param WEIGHT after generate_quantized_weight(qweight_only)");
    bie_tensor v;
    watch_struct(&v, sizeof v);
    EXPECT_L(l, BIE_ERR_STATE, bie_layer_param(l, BIE_PARAM_WEIGHT, &v));
    bie_layer_free(l);
    pool_release();
}

/* ---------------------------------------------------------------- backward */

static void test_backward(void) {
    bie_layer *l = new_layer();
    bie_tensor *g6 = F32(6, OUT), *gx6 = OUTBUF(6, IN), v;
    watch_struct(&v, sizeof v);
    CASE("backward: before any forward");
    EXPECT_L(l, BIE_ERR_STATE, bie_layer_backward(l, g6, gx6));
    CASE("backward: NULL layer");
    EXPECT(BIE_ERR_NULL_POINTER, bie_layer_backward(NULL, g6, gx6));
    CASE("grad: before any backward");
    EXPECT_L(l, BIE_ERR_STATE, bie_layer_grad(l, BIE_PARAM_BIAS_A, &v));
    CASE("forward_again: before any forward; NULL layer");
    EXPECT_L(l, BIE_ERR_STATE, bie_layer_forward_again(l, OUTBUF(2, 3, OUT)));
    EXPECT(BIE_ERR_NULL_POINTER, bie_layer_forward_again(NULL, OUTBUF(2, 3, OUT)));
    bie_layer_free(l);

    fixture f;
    fixture_init(&f);
    l = f.l;
    bie_tensor *g = f.g, *gx = f.gx;
    CASE("backward: grad_out last extent != out_features");
    EXPECT_L(l, BIE_ERR_SHAPE, bie_layer_backward(l, F32(2, 3, OUT + 1), gx));
    CASE("backward: grad_out leading extents differ from the forward's output");
    EXPECT_L(l, BIE_ERR_SHAPE, bie_layer_backward(l, F32(3, 2, OUT), gx));
    CASE("backward: grad_out of another rank (same element count)");
    EXPECT_L(l, BIE_ERR_SHAPE, bie_layer_backward(l, g6, gx));
    CASE("backward: grad_x shape differs from the forward's input");
    EXPECT_L(l, BIE_ERR_SHAPE, bie_layer_backward(l, g, gx6));
    EXPECT_L(l, BIE_ERR_SHAPE, bie_layer_backward(l, g, OUTBUF(2, 3, IN - 1)));
    CASE("backward: NULL grad_out");
    EXPECT_L(l, BIE_ERR_NULL_POINTER, bie_layer_backward(l, NULL, gx));
    CASE("backward: grad_out dtype int32");
    EXPECT_L(l, BIE_ERR_DTYPE, bie_layer_backward(l, MK(BIE_I32, RANDOM, 2, 3, OUT), gx));
    CASE("backward: grad_out on a CUDA device");
    EXPECT_L(l, BIE_ERR_DEVICE, bie_layer_backward(l, ON_CUDA(g), gx));
    CASE("grad: parameter without a gradient");
    EXPECT_L(l, BIE_ERR_INVALID_ARGUMENT, bie_layer_grad(l, BIE_PARAM_SCALE_W, &v));
    CASE("forward_again: NULL out, out without data");
    EXPECT_L(l, BIE_ERR_NULL_POINTER, bie_layer_forward_again(l, NULL));
    EXPECT_L(l, BIE_ERR_NULL_POINTER, bie_layer_forward_again(l, WITH(f.y, data = NULL)));
    CASE("forward_again: out shape differs from the forward's output");
    EXPECT_L(l, BIE_ERR_SHAPE, bie_layer_forward_again(l, OUTBUF(2, 3, OUT + 1)));
    EXPECT_L(l, BIE_ERR_SHAPE, bie_layer_forward_again(l, OUTBUF(6, OUT)));
    CASE("forward_again: out dtype int32");
    EXPECT_L(l, BIE_ERR_DTYPE, bie_layer_forward_again(l, MK(BIE_I32, RANDOM, 2, 3, OUT)));
    CASE("forward_again: out on a CUDA device");
    EXPECT_L(l, BIE_ERR_DEVICE, bie_layer_forward_again(l, ON_CUDA(f.y)));
    check_saved(&f, __LINE__);
    CASE("backward: after set_training(false)");
    CHECK(bie_layer_set_training(l, false) == BIE_OK);
    EXPECT_L(l, BIE_ERR_STATE, bie_layer_backward(l, g, gx));
    bie_layer_free(l);
    pool_release();
}

/* ---------------------------------------------------------------- setters */

static void test_setters(void) {
    fixture f;
    fixture_init(&f);
    bie_layer *l = f.l;
    bie_tensor v, *w;
    watch_struct(&v, sizeof v);
    static const int bad_bits[5] = {7, 0, 16, -8, 128};
    CASE("set_bits_binary_word(7), (0), (16), (-8), (128)");
    for (int i = 0; i < 5; i++)
        EXPECT_L(l, BIE_ERR_INVALID_ARGUMENT, bie_layer_set_bits_binary_word(l, bad_bits[i]));
    CASE("set_backward_mode: unknown modes; FP8 on a CPU layer");
    EXPECT_L(l, BIE_ERR_INVALID_ARGUMENT, bie_layer_set_backward_mode(l, (bie_backward_mode)2));
    EXPECT_L(l, BIE_ERR_INVALID_ARGUMENT, bie_layer_set_backward_mode(l, (bie_backward_mode)-1));
    EXPECT_L(l, BIE_ERR_UNSUPPORTED, bie_layer_set_backward_mode(l, BIE_BACKWARD_FP8));
    EXPECT(BIE_ERR_NULL_POINTER, bie_layer_set_backward_mode(NULL, BIE_BACKWARD_EXACT));
    EXPECT(BIE_ERR_NULL_POINTER, bie_layer_get_backward_mode(l, NULL));
    {
        bie_backward_mode mode = BIE_BACKWARD_FP8;
        CHECK(bie_layer_get_backward_mode(l, &mode) == BIE_OK && mode == BIE_BACKWARD_EXACT);
        CHECK(bie_layer_set_backward_mode(l, BIE_BACKWARD_EXACT) == BIE_OK);
    }
    CASE("set_channels_last: a linear layer; a conv layer on the CPU (NCHW only)");
    EXPECT_L(l, BIE_ERR_INVALID_ARGUMENT, bie_layer_set_channels_last(l, true));
    EXPECT(BIE_ERR_NULL_POINTER, bie_layer_set_channels_last(NULL, true));
    EXPECT(BIE_ERR_NULL_POINTER, bie_layer_get_channels_last(l, NULL));
    {
        bie_layer *conv = NULL;
        bool on = true;
        CHECK(bie_binary_conv2d_create(&conv, 4, 6, 3, 1, 1, 1, bie_cpu(), BIE_F32, true) ==
              BIE_OK);
        EXPECT_L(conv, BIE_ERR_UNSUPPORTED, bie_layer_set_channels_last(conv, true));
        CHECK(bie_layer_get_channels_last(conv, &on) == BIE_OK && !on);
        CHECK(bie_layer_set_channels_last(conv, false) == BIE_OK);
        bie_layer_free(conv);
    }
    CASE("set_gemm_kernel(9999), (-2): unknown ids");
    EXPECT_L(l, BIE_ERR_INVALID_ARGUMENT, bie_layer_set_gemm_kernel(l, 9999));
    EXPECT_L(l, BIE_ERR_INVALID_ARGUMENT, bie_layer_set_gemm_kernel(l, -2));
    if (find_kernel(false) >= 0) {
        CASE("set_gemm_kernel: a kernel this CPU cannot run");
        EXPECT_L(l, BIE_ERR_UNSUPPORTED, bie_layer_set_gemm_kernel(l, find_kernel(false)));
    }
    CASE("set_scale_a(NaN), (+inf), (-inf), (-1)");
    EXPECT_L(l, BIE_ERR_NOT_FINITE, bie_layer_set_scale_a(l, NAN));
    EXPECT_L(l, BIE_ERR_NOT_FINITE, bie_layer_set_scale_a(l, INFINITY));
    EXPECT_L(l, BIE_ERR_NOT_FINITE, bie_layer_set_scale_a(l, -INFINITY));
    /* bie.h groups "non-finite or negative"; the library reports both as NOT_FINITE. */
    EXPECT_L(l, BIE_ERR_NOT_FINITE, bie_layer_set_scale_a(l, -1.0f));
    CASE("get_scale_a(NULL out)");
    EXPECT_L(l, BIE_ERR_NULL_POINTER, bie_layer_get_scale_a(l, NULL));
    {
        float before = -1.0f, after = -1.0f, back = -1.0f;
        CHECK(bie_layer_get_scale_a(l, &before) == BIE_OK && before >= 0.0f);
        CHECK(bie_layer_set_scale_a(l, 0.625f) == BIE_OK);
        CHECK(bie_layer_get_scale_a(l, &after) == BIE_OK && after == 0.625f);
        CHECK(bie_layer_set_scale_a(l, before) == BIE_OK);
        CHECK(bie_layer_get_scale_a(l, &back) == BIE_OK && back == before);
    }

    CASE("set_weight_data: shapes [out+1, in], [out, in+1], [1, out, in], [out*in]");
    EXPECT_L(l, BIE_ERR_SHAPE, bie_layer_set_weight_data(l, F32(OUT + 1, IN)));
    EXPECT_L(l, BIE_ERR_SHAPE, bie_layer_set_weight_data(l, F32(OUT, IN + 1)));
    EXPECT_L(l, BIE_ERR_SHAPE, bie_layer_set_weight_data(l, F32(1, OUT, IN)));
    EXPECT_L(l, BIE_ERR_SHAPE, bie_layer_set_weight_data(l, F32(OUT * IN)));
    CASE("set_weight_data: dtype int8");
    EXPECT_L(l, BIE_ERR_DTYPE, bie_layer_set_weight_data(l, MK(BIE_I8, RANDOM, OUT, IN)));
    CASE("set_weight_data: a NaN inside, a -inf inside, all zeros");
    w = F32(OUT, IN);
    ((float *)w->data)[OUT * IN / 2] = NAN;
    EXPECT_L(l, BIE_ERR_NOT_FINITE, bie_layer_set_weight_data(l, w));
    ((float *)w->data)[OUT * IN / 2] = -INFINITY;
    EXPECT_L(l, BIE_ERR_NOT_FINITE, bie_layer_set_weight_data(l, w));
    EXPECT_L(l, BIE_ERR_NOT_FINITE, bie_layer_set_weight_data(l, MK(BIE_F32, ZERO, OUT, IN)));
    CASE("set_weight_data: NULL tensor, NULL data");
    EXPECT_L(l, BIE_ERR_NULL_POINTER, bie_layer_set_weight_data(l, NULL));
    EXPECT_L(l, BIE_ERR_NULL_POINTER,
             bie_layer_set_weight_data(l, WITH(F32(OUT, IN), data = NULL)));
    CASE("set_weight_data: tensor on a CUDA device");
    EXPECT_L(l, BIE_ERR_DEVICE, bie_layer_set_weight_data(l, ON_CUDA(F32(OUT, IN))));

    CASE("set_quantized_weight_data: dtype U32, float32 while bits_binary_word is 8");
    EXPECT_L(l, BIE_ERR_DTYPE,
             bie_layer_set_quantized_weight_data(l, MK(BIE_U32, RANDOM, OUT, W32)));
    EXPECT_L(l, BIE_ERR_DTYPE, bie_layer_set_quantized_weight_data(l, F32(OUT, W8)));
    CASE("set_quantized_weight_data: shapes [out, W-1], [out+1, W], [out*W]; NULL");
    EXPECT_L(l, BIE_ERR_SHAPE,
             bie_layer_set_quantized_weight_data(l, MK(BIE_U8, RANDOM, OUT, W8 - 1)));
    EXPECT_L(l, BIE_ERR_SHAPE,
             bie_layer_set_quantized_weight_data(l, MK(BIE_U8, RANDOM, OUT + 1, W8)));
    EXPECT_L(l, BIE_ERR_SHAPE,
             bie_layer_set_quantized_weight_data(l, MK(BIE_U8, RANDOM, OUT * W8)));
    EXPECT_L(l, BIE_ERR_NULL_POINTER, bie_layer_set_quantized_weight_data(l, NULL));

    CASE("param: unknown parameter, WEIGHT_FLOAT_GRAD (a gradient only), NULL view");
    EXPECT_L(l, BIE_ERR_INVALID_ARGUMENT, bie_layer_param(l, (bie_param)99, &v));
    EXPECT_L(l, BIE_ERR_INVALID_ARGUMENT, bie_layer_param(l, BIE_PARAM_WEIGHT_FLOAT_GRAD, &v));
    EXPECT_L(l, BIE_ERR_NULL_POINTER, bie_layer_param(l, BIE_PARAM_WEIGHT, NULL));
    CASE("select_gemm_kernel: input with a wrong last extent, NULL input");
    EXPECT_L(l, BIE_ERR_SHAPE, bie_layer_select_gemm_kernel(l, F32(4, IN - 1)));
    EXPECT_L(l, BIE_ERR_NULL_POINTER, bie_layer_select_gemm_kernel(l, NULL));
    CASE("check_forward: input of rank 5");
    EXPECT_L(l, BIE_ERR_SHAPE, bie_layer_check_forward(l, WITH(f.x, ndim = 5)));
    CASE("describe: NULL layer, NULL desc");
    bie_layer_desc desc;
    watch_struct(&desc, sizeof desc);
    EXPECT(BIE_ERR_NULL_POINTER, bie_layer_describe(NULL, &desc));
    EXPECT_L(l, BIE_ERR_NULL_POINTER, bie_layer_describe(l, NULL));
    CASE("output_shape: last extent != in_features, rank 0, rank 5, NULL shapes");
    int out_ndim;
    int64_t out_shape[BIE_MAX_DIMS];
    watch_struct(&out_ndim, sizeof out_ndim);
    watch_struct(out_shape, sizeof out_shape);
    const int64_t bad_in[2] = {6, IN + 1}, good_in[2] = {6, IN}, five[5] = {1, 1, 1, 6, IN};
    EXPECT_L(l, BIE_ERR_SHAPE, bie_layer_output_shape(l, 2, bad_in, &out_ndim, out_shape));
    EXPECT_L(l, BIE_ERR_SHAPE, bie_layer_output_shape(l, 0, good_in, &out_ndim, out_shape));
    EXPECT_L(l, BIE_ERR_SHAPE, bie_layer_output_shape(l, 5, five, &out_ndim, out_shape));
    EXPECT_L(l, BIE_ERR_NULL_POINTER, bie_layer_output_shape(l, 2, NULL, &out_ndim, out_shape));
    EXPECT_L(l, BIE_ERR_NULL_POINTER, bie_layer_output_shape(l, 2, good_in, NULL, out_shape));
    EXPECT_L(l, BIE_ERR_NULL_POINTER, bie_layer_output_shape(l, 2, good_in, &out_ndim, NULL));
    check_saved(&f, __LINE__);
    bie_layer_free(l);

    l = new_layer();
    CASE("prepare_params: NaN written into the float weight");
    bie_tensor wv;
    CHECK(bie_layer_param(l, BIE_PARAM_WEIGHT, &wv) == BIE_OK && wv.dtype == BIE_F32);
    ((float *)wv.data)[3] = NAN;
    EXPECT_L(l, BIE_ERR_NOT_FINITE, bie_layer_prepare_params(l));
    CASE("param QWEIGHT before generate_quantized_weight");
    EXPECT_L(l, BIE_ERR_STATE, bie_layer_param(l, BIE_PARAM_QWEIGHT, &v));
    bie_layer_free(l);
    CASE("set_bits_binary_word on 4-bit layers: a binary-only setting");
    if (bie_q4_linear_create(&l, IN, OUT, bie_cpu(), BIE_F32) != BIE_OK) die("create q4_linear");
    EXPECT_L(l, BIE_ERR_UNSUPPORTED, bie_layer_set_bits_binary_word(l, 32));
    bie_layer_free(l);
    if (bie_q4_conv2d_create(&l, 3, OUT, 3, 1, 1, 1, bie_cpu(), BIE_F32) != BIE_OK)
        die("create q4_conv2d");
    EXPECT_L(l, BIE_ERR_UNSUPPORTED, bie_layer_set_bits_binary_word(l, 8));
    bie_layer_free(l);
    CASE("layer setters with a NULL layer");
    EXPECT(BIE_ERR_NULL_POINTER, bie_layer_set_bits_binary_word(NULL, 32));
    EXPECT(BIE_ERR_NULL_POINTER, bie_layer_set_gemm_kernel(NULL, -1));
    EXPECT(BIE_ERR_NULL_POINTER, bie_layer_set_scale_a(NULL, 1.0f));
    EXPECT(BIE_ERR_NULL_POINTER, bie_layer_prepare_params(NULL));
    EXPECT(BIE_ERR_NULL_POINTER, bie_layer_set_training(NULL, true));
    pool_release();
}

/* ---------------------------------------------------------------- create */

static void test_create(void) {
    static char sentinel_obj;
    bie_layer *const sentinel = (bie_layer *)(void *)&sentinel_obj;
    bie_layer *p = sentinel;
    const bie_device cuda0 = {BIE_DEVICE_CUDA, 0}, cuda9999 = {BIE_DEVICE_CUDA, 9999};
    const bie_device unknown = {(bie_device_type)7, 0}, cpu = bie_cpu();
    bool has_cuda = false; /* a CUDA build lists CUDA kernels */
    for (int i = 0; i < bie_kernel_count(); i++) {
        bie_kernel_info info;
        if (bie_kernel_get(i, &info) == BIE_OK && info.device == BIE_DEVICE_CUDA) has_cuda = true;
    }
    CASE("create: in_features 0, out_features 0");
    EXPECT(BIE_ERR_INVALID_ARGUMENT, bie_binary_linear_create(&p, 0, OUT, cpu, BIE_F32, true));
    EXPECT(BIE_ERR_INVALID_ARGUMENT, bie_binary_linear_create(&p, IN, 0, cpu, BIE_F32, true));
    CASE("create: negative in_features, in_features = 2^31");
    EXPECT(BIE_ERR_INVALID_ARGUMENT, bie_binary_linear_create(&p, -3, OUT, cpu, BIE_F32, true));
    EXPECT(BIE_ERR_INVALID_ARGUMENT,
           bie_binary_linear_create(&p, INT64_C(1) << 31, OUT, cpu, BIE_F32, true));
    CASE("create: out_features * in_features too large (2^31-1 squared)");
    EXPECT(BIE_ERR_OVERFLOW,
           bie_binary_linear_create(&p, INT32_MAX, INT32_MAX, cpu, BIE_F32, true));
    CASE("create: dtype bfloat16, float16, int8 on the CPU");
    EXPECT(BIE_ERR_DTYPE, bie_binary_linear_create(&p, IN, OUT, cpu, BIE_BF16, true));
    EXPECT(BIE_ERR_DTYPE, bie_binary_linear_create(&p, IN, OUT, cpu, BIE_F16, false));
    EXPECT(BIE_ERR_DTYPE, bie_binary_linear_create(&p, IN, OUT, cpu, BIE_I8, true));
    CASE("create: CUDA device without a CUDA backend, CUDA ordinal 9999, unknown device type");
    if (!has_cuda)
        EXPECT(BIE_ERR_DEVICE, bie_binary_linear_create(&p, IN, OUT, cuda0, BIE_F32, true));
    EXPECT(BIE_ERR_DEVICE, bie_binary_linear_create(&p, IN, OUT, cuda9999, BIE_F32, true));
    EXPECT(BIE_ERR_DEVICE, bie_binary_linear_create(&p, IN, OUT, unknown, BIE_F32, true));
    CHECK(p == sentinel);
    CASE("create: NULL out");
    EXPECT(BIE_ERR_NULL_POINTER, bie_binary_linear_create(NULL, IN, OUT, cpu, BIE_F32, true));
}

/* ---------------------------------------------------------------- packing */

static void test_pack(void) {
    bie_tensor *src = F32(3, 20), *dst = MK(BIE_U8, POISON, 3, 3);
    CASE("pack_signs: word size 7, 0, 16");
    EXPECT(BIE_ERR_INVALID_ARGUMENT, bie_pack_signs(src, 7, dst));
    EXPECT(BIE_ERR_INVALID_ARGUMENT, bie_pack_signs(src, 0, dst));
    EXPECT(BIE_ERR_INVALID_ARGUMENT, bie_pack_signs(src, 16, dst));
    CASE("pack_signs: NULL src, NULL dst, src with NULL data");
    EXPECT(BIE_ERR_NULL_POINTER, bie_pack_signs(NULL, 8, dst));
    EXPECT(BIE_ERR_NULL_POINTER, bie_pack_signs(src, 8, NULL));
    EXPECT(BIE_ERR_NULL_POINTER, bie_pack_signs(WITH(src, data = NULL), 8, dst));
    CASE("pack_signs: dst on a CUDA device");
    EXPECT(BIE_ERR_DEVICE, bie_pack_signs(src, 8, ON_CUDA(dst)));
    CASE("pack_signs: src dtype int32, uint8");
    EXPECT(BIE_ERR_DTYPE, bie_pack_signs(MK(BIE_I32, RANDOM, 3, 20), 8, dst));
    EXPECT(BIE_ERR_DTYPE, bie_pack_signs(MK(BIE_U8, RANDOM, 3, 20), 8, dst));
    CASE("pack_signs: dst U32 for 8-bit words, U8 for 64-bit words, float32");
    EXPECT(BIE_ERR_DTYPE, bie_pack_signs(src, 8, MK(BIE_U32, POISON, 3, 3)));
    EXPECT(BIE_ERR_DTYPE, bie_pack_signs(src, 64, dst));
    EXPECT(BIE_ERR_DTYPE, bie_pack_signs(src, 8, OUTBUF(3, 3)));
    CASE("pack_signs: packed width != ceil(cols / W)");
    EXPECT(BIE_ERR_SHAPE, bie_pack_signs(src, 8, MK(BIE_U8, POISON, 3, 2)));
    EXPECT(BIE_ERR_SHAPE, bie_pack_signs(src, 32, MK(BIE_U32, POISON, 3, 2)));
    CASE("pack_signs: leading extents differ, ranks differ");
    EXPECT(BIE_ERR_SHAPE, bie_pack_signs(src, 8, MK(BIE_U8, POISON, 4, 3)));
    EXPECT(BIE_ERR_SHAPE, bie_pack_signs(src, 8, MK(BIE_U8, POISON, 1, 3, 3)));
    CASE("pack_signs: rank 0, rank 5");
    EXPECT(BIE_ERR_SHAPE, bie_pack_signs(WITH(src, ndim = 0), 8, WITH(dst, ndim = 0)));
    EXPECT(BIE_ERR_SHAPE, bie_pack_signs(WITH(src, ndim = 5), 8, WITH(dst, ndim = 5)));
    CASE("pack_signs: negative extent (a shape error, as in bie_tensor_view and the layers)");
    EXPECT(BIE_ERR_SHAPE, bie_pack_signs(WITH(src, shape[0] = -3), 8, WITH(dst, shape[0] = -3)));

    bie_tensor *packed = MK(BIE_U8, RANDOM, 3, 3), *un = OUTBUF(3, 20);
    CASE("unpack_signs: word size 7");
    EXPECT(BIE_ERR_INVALID_ARGUMENT, bie_unpack_signs(packed, 7, un));
    CASE("unpack_signs: dst dtype int32, src dtype U32 for 8-bit words");
    EXPECT(BIE_ERR_DTYPE, bie_unpack_signs(packed, 8, MK(BIE_I32, POISON, 3, 20)));
    EXPECT(BIE_ERR_DTYPE, bie_unpack_signs(MK(BIE_U32, RANDOM, 3, 1), 8, un));
    CASE("unpack_signs: packed width != ceil(cols / W)");
    EXPECT(BIE_ERR_SHAPE, bie_unpack_signs(packed, 8, OUTBUF(3, 30)));
    CASE("unpack_signs: negative extent");
    EXPECT(BIE_ERR_SHAPE,
           bie_unpack_signs(WITH(packed, shape[0] = -3), 8, WITH(un, shape[0] = -3)));
    pool_release();
}

/* ---------------------------------------------------------------- binary GEMM */

static void test_gemm(void) {
    enum { M = 3, N = 5, K = 29, RB = 4 };
    const void *a = MK(BIE_U8, RANDOM, M, RB)->data, *b = MK(BIE_U8, RANDOM, N, RB)->data;
    float *out = OUTBUF(M, N)->data;
    const int64_t huge = INT64_C(1) << 40, bigk = INT64_C(1) << 31;
    CASE("binary_gemm: k = 0, m = 0, n = -1");
    EXPECT(BIE_ERR_SHAPE, bie_binary_gemm(-1, M, N, 0, a, RB, b, RB, 1.0f, out));
    EXPECT(BIE_ERR_SHAPE, bie_binary_gemm(-1, 0, N, K, a, RB, b, RB, 1.0f, out));
    EXPECT(BIE_ERR_SHAPE, bie_binary_gemm(-1, M, -1, K, a, RB, b, RB, 1.0f, out));
    CASE("binary_gemm: a or b row stride shorter than ceil(k / 8)");
    EXPECT(BIE_ERR_SHAPE, bie_binary_gemm(-1, M, N, K, a, RB - 1, b, RB, 1.0f, out));
    EXPECT(BIE_ERR_SHAPE, bie_binary_gemm(-1, M, N, K, a, RB, b, RB - 1, 1.0f, out));
    CASE("binary_gemm: scale NaN, +inf");
    EXPECT(BIE_ERR_NOT_FINITE, bie_binary_gemm(-1, M, N, K, a, RB, b, RB, NAN, out));
    EXPECT(BIE_ERR_NOT_FINITE, bie_binary_gemm(-1, M, N, K, a, RB, b, RB, INFINITY, out));
    CASE("binary_gemm: unknown kernel id 9999");
    EXPECT(BIE_ERR_INVALID_ARGUMENT, bie_binary_gemm(9999, M, N, K, a, RB, b, RB, 1.0f, out));
    if (find_kernel(false) >= 0) {
        CASE("binary_gemm: a kernel this CPU cannot run");
        EXPECT(BIE_ERR_UNSUPPORTED,
               bie_binary_gemm(find_kernel(false), M, N, K, a, RB, b, RB, 1.0f, out));
    }
    CASE("binary_gemm: NULL a, b, out");
    EXPECT(BIE_ERR_NULL_POINTER, bie_binary_gemm(-1, M, N, K, NULL, RB, b, RB, 1.0f, out));
    EXPECT(BIE_ERR_NULL_POINTER, bie_binary_gemm(-1, M, N, K, a, RB, NULL, RB, 1.0f, out));
    EXPECT(BIE_ERR_NULL_POINTER, bie_binary_gemm(-1, M, N, K, a, RB, b, RB, 1.0f, NULL));
    CASE("binary_gemm: m * n overflows, k > 2^31 - 1");
    EXPECT(BIE_ERR_OVERFLOW, bie_binary_gemm(-1, huge, huge, K, a, RB, b, RB, 1.0f, out));
    EXPECT(BIE_ERR_OVERFLOW, bie_binary_gemm(-1, M, N, bigk, a, bigk / 8, b, bigk / 8, 1.0f, out));
    pool_release();
}

/* ---------------------------------------------------------------- tensors, registry, threads */

static void test_misc(void) {
    float data[8];
    bie_tensor v;
    bie_kernel_info info;
    watch_struct(&v, sizeof v);
    watch_struct(&info, sizeof info);
    const int64_t shape[5] = {2, 4, 1, 1, 1}, neg[2] = {2, -4}, big[1] = {INT64_C(1) << 62};
    CASE("tensor_view: ndim 0, 5, -1");
    EXPECT(BIE_ERR_SHAPE, bie_tensor_view(&v, data, BIE_F32, 0, shape));
    EXPECT(BIE_ERR_SHAPE, bie_tensor_view(&v, data, BIE_F32, 5, shape));
    EXPECT(BIE_ERR_SHAPE, bie_tensor_view(&v, data, BIE_F32, -1, shape));
    CASE("tensor_view: negative extent");
    EXPECT(BIE_ERR_SHAPE, bie_tensor_view(&v, data, BIE_F32, 2, neg));
    CASE("tensor_view: NULL out, NULL shape");
    EXPECT(BIE_ERR_NULL_POINTER, bie_tensor_view(NULL, data, BIE_F32, 2, shape));
    EXPECT(BIE_ERR_NULL_POINTER, bie_tensor_view(&v, data, BIE_F32, 2, NULL));
    CASE("tensor_view: unknown dtype");
    EXPECT(BIE_ERR_DTYPE, bie_tensor_view(&v, data, (bie_dtype)42, 2, shape));
    CASE("tensor_view: byte count overflows");
    EXPECT(BIE_ERR_OVERFLOW, bie_tensor_view(&v, data, BIE_F32, 1, big));
    CASE("tensor_alloc: negative extent, byte count overflows");
    EXPECT(BIE_ERR_SHAPE, bie_tensor_alloc(&v, BIE_F32, 2, neg));
    EXPECT(BIE_ERR_OVERFLOW, bie_tensor_alloc(&v, BIE_F32, 1, big));
    CASE("kernel_get(-1), kernel_get(count)");
    EXPECT(BIE_ERR_INVALID_ARGUMENT, bie_kernel_get(-1, &info));
    EXPECT(BIE_ERR_INVALID_ARGUMENT, bie_kernel_get(bie_kernel_count(), &info));
    CASE("kernel_get, kernel_find: NULL info");
    EXPECT(BIE_ERR_NULL_POINTER, bie_kernel_get(0, NULL));
    EXPECT(BIE_ERR_NULL_POINTER, bie_kernel_find(0, NULL));
    CASE("kernel_find(9999)");
    EXPECT(BIE_ERR_INVALID_ARGUMENT, bie_kernel_find(9999, &info));
    CASE("set_num_threads(-1), (INT32_MIN)");
    const int threads = bie_get_num_threads();
    EXPECT(BIE_ERR_INVALID_ARGUMENT, bie_set_num_threads(-1));
    EXPECT(BIE_ERR_INVALID_ARGUMENT, bie_set_num_threads(INT32_MIN));
    CHECK(bie_get_num_threads() == threads);
    pool_release();
}

int main(void) {
    set_marker();
    snprintf(g_marker, sizeof g_marker, "%s", bie_last_error());
    CHECK(g_marker[0] != '\0');
    test_forward();
    test_forward_state();
    test_backward();
    test_setters();
    test_create();
    test_pack();
    test_gemm();
    test_misc();
    fprintf(stderr, "bad_input: %d cases, CPU kernel set %s\n", g_cases, bie_cpu_kernel_set());
    printf("%d passed, %d failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}
