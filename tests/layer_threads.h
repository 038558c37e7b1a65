/* SPEC §7 under load: distinct layers used from different threads at the same time. Shared
 * by test_threads (CPU) and test_cuda_threads (CUDA, one stream per thread).
 *
 * Each of N threads owns one layer of every kind (its own shapes, seeds and data) and runs a
 * fixed script on each, R rounds over: create, bias_a, select_gemm_kernel, a training
 * forward and backward, a forward with every GEMM kernel of the layer's op and device
 * (set_gemm_kernel), inference mode with the packed weight (every word size for the binary
 * kinds), a refused call whose per-thread error message must name this thread's value, the
 * registry queries (kernel set, count, defaults), free. Every output, gradient and status
 * goes into the thread's record. The threads start together (a barrier), before any other
 * call into the library, so that lazily initialised state (CPU feature detection, device
 * queries, per-thread handles) is first touched concurrently. Then the main thread runs the
 * same scripts alone, and every round of every thread must equal that record: bit for bit
 * (forward outputs always; gradients too on the CPU; on CUDA the gradients come from cuBLAS,
 * which promises bit-wise equal results only while a single stream is active, so they are
 * compared within float tolerance and the int8 weight gradient within one step).
 * The harness keeps its own per-thread counters and generators: test_util.h's are globals. */
#ifndef BIE_TEST_LAYER_THREADS_H
#define BIE_TEST_LAYER_THREADS_H

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bie.h"
#include "bie_cuda.h"

#define LT_KINDS 4
#define LT_MAX_THREADS 16

/* ---- a record: tagged entries of bytes */
enum { LT_EXACT = 0, LT_GRAD = 1, LT_GRAD_I8 = 2 }; /* how an entry is compared on CUDA */

typedef struct lt_record {
    unsigned char *data;
    size_t len, cap;
    int failures; /* calls that failed where they must not, in this run */
} lt_record;

typedef struct lt_entry_head {
    uint32_t tag, how, bytes, pad;
} lt_entry_head;

static inline void lt_put(lt_record *r, uint32_t tag, uint32_t how, const void *p, size_t bytes) {
    const size_t need = r->len + sizeof(lt_entry_head) + bytes;
    if (need > r->cap) {
        size_t cap = r->cap ? r->cap : 4096;
        while (cap < need) cap *= 2;
        unsigned char *d = realloc(r->data, cap);
        if (d == NULL) {
            fprintf(stderr, "out of memory\n");
            exit(2);
        }
        r->data = d;
        r->cap = cap;
    }
    lt_entry_head h = {tag, how, (uint32_t)bytes, 0};
    memcpy(r->data + r->len, &h, sizeof h);
    if (bytes) memcpy(r->data + r->len + sizeof h, p, bytes);
    r->len = need;
}

static inline void lt_put_int(lt_record *r, uint32_t tag, int v) {
    lt_put(r, tag, LT_EXACT, &v, sizeof v);
}

/* A call that must succeed: its failure is counted and reported with the thread's message. */
#define LT_OK(r, tid, call)                                                                      \
    do {                                                                                         \
        bie_status lt_st_ = (call);                                                              \
        if (lt_st_ != BIE_OK) {                                                                  \
            (r)->failures++;                                                                     \
            fprintf(stderr, "thread %d: %s:%d: %s returned %s: %s\n", (tid), __FILE__, __LINE__, \
                    #call, bie_status_name(lt_st_), bie_last_error());                           \
        }                                                                                        \
    } while (0)

/* ---- a per-script generator (the same stream in every run of a script) */
static inline uint64_t lt_next(uint64_t *s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    uint64_t x = *s;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    return x ^ (x >> 33);
}
static inline void lt_fill(uint64_t *s, float *x, int64_t n, float lo, float hi) {
    for (int64_t i = 0; i < n; i++)
        x[i] = lo + (hi - lo) * (float)((lt_next(s) >> 40) * (1.0 / 16777216.0));
}

/* ---- device tensors: CPU or CUDA memory, filled and read through bie_tensor_copy */
typedef struct lt_ctx {
    bie_device dev;
    bool small; /* smaller shapes (sanitizer builds) */
} lt_ctx;

static inline bie_status lt_alloc(const lt_ctx *c, bie_tensor *t, int ndim, const int64_t *shape) {
    if (c->dev.type == BIE_DEVICE_CPU) return bie_tensor_alloc(t, BIE_F32, ndim, shape);
    return bie_cuda_tensor_alloc(t, BIE_F32, ndim, shape, c->dev.index);
}

static inline bie_status lt_upload(bie_tensor *t, const float *host) {
    bie_tensor h;
    bie_status st = bie_tensor_view(&h, (void *)host, BIE_F32, t->ndim, t->shape);
    return st != BIE_OK ? st : bie_tensor_copy(t, &h);
}

/* Any tensor (any dtype, CPU or CUDA) into the record. */
static inline void lt_put_tensor(lt_record *r, int tid, uint32_t tag, uint32_t how,
                                 const bie_tensor *t) {
    const int64_t n = bie_tensor_numel(t);
    const size_t bytes = (size_t)n * bie_dtype_size(t->dtype);
    unsigned char *host = malloc(bytes ? bytes : 1);
    if (host == NULL) exit(2);
    bie_tensor h;
    LT_OK(r, tid, bie_tensor_view(&h, host, t->dtype, t->ndim, t->shape));
    LT_OK(r, tid, bie_tensor_copy(&h, t));
    lt_put(r, tag, how, host, bytes);
    free(host);
}

/* ---- the script of thread t's layer of kind j */
static inline void lt_script(const lt_ctx *c, int t, int j, lt_record *r) {
    uint64_t s = 0x9e3779b97f4a7c15ull * (uint64_t)(t * LT_KINDS + j + 1);
    const int64_t sz = c->small ? 1 : 2;
    const bool conv = j == 1 || j == 3, binary = j <= 1;
    /* Shapes differ per thread (odd sizes, padding bits, strides): every shape-keyed choice
     * (default kernels, plans, workspaces) is made for several shapes at once. */
    const int64_t in = conv ? 3 + t : 37 + 13 * t * sz, out = conv ? 4 + 2 * t : 9 + 5 * t;
    const int64_t rows = conv ? 2 : 3 + t * sz, hw = conv ? 6 + t + 4 * sz : 0;
    const int k = 1 + 2 * (t % 2 + 1), stride = 1 + t % 2, pad = (t + j) % 2,
              dil = 1 + (t % 3 == 2);
    bie_layer *l = NULL;
    bie_status st;
    if (j == 0)
        st = bie_binary_linear_create(&l, in, out, c->dev, BIE_F32, t % 2 == 1);
    else if (j == 1)
        st =
            bie_binary_conv2d_create(&l, in, out, k, stride, pad, dil, c->dev, BIE_F32, t % 2 == 0);
    else if (j == 2)
        st = bie_q4_linear_create(&l, in, out, c->dev, BIE_F32);
    else
        st = bie_q4_conv2d_create(&l, in, out, k, stride, pad, dil, c->dev, BIE_F32);
    LT_OK(r, t, st);
    if (st != BIE_OK) return;
    LT_OK(r, t, bie_layer_reset_parameters(l, 1000 + 10 * (uint64_t)t + (uint64_t)j));

    const int xnd = conv ? 4 : 2;
    const int64_t xs[4] = {rows, in, hw, hw};
    int ond = 0;
    int64_t os[BIE_MAX_DIMS];
    LT_OK(r, t, bie_layer_output_shape(l, xnd, xs, &ond, os));
    bie_tensor x = {0}, y = {0}, gx = {0}, gy = {0}, bias;
    LT_OK(r, t, lt_alloc(c, &x, xnd, xs));
    LT_OK(r, t, lt_alloc(c, &gx, xnd, xs));
    LT_OK(r, t, lt_alloc(c, &y, ond, os));
    LT_OK(r, t, lt_alloc(c, &gy, ond, os));
    const int64_t nx = bie_tensor_numel(&x), ny = bie_tensor_numel(&y);
    float *hx = malloc((size_t)(nx + ny + in) * sizeof(float));
    if (hx == NULL || r->failures) exit(2);
    float *hy = hx + nx, *hb = hy + ny;
    lt_fill(&s, hx, nx, -1.0f, 1.0f);
    lt_fill(&s, hy, ny, -1.0f, 1.0f);
    lt_fill(&s, hb, in, -0.2f, 0.2f);
    LT_OK(r, t, lt_upload(&x, hx));
    LT_OK(r, t, lt_upload(&gy, hy));
    LT_OK(r, t, bie_layer_param(l, BIE_PARAM_BIAS_A, &bias));
    LT_OK(r, t, lt_upload(&bias, hb));

    /* Autotuning (timed; the pick may differ between runs, the results may not). */
    LT_OK(r, t, bie_layer_select_gemm_kernel(l, &x));
    LT_OK(r, t, bie_layer_forward(l, &x, &y));
    lt_put_tensor(r, t, 1, LT_EXACT, &y);
    LT_OK(r, t, bie_layer_backward(l, &gy, &gx));
    lt_put_tensor(r, t, 2, LT_GRAD, &gx);
    const bie_param grads[] = {BIE_PARAM_WEIGHT, BIE_PARAM_WEIGHT_FLOAT_GRAD, BIE_PARAM_BIAS_A,
                               BIE_PARAM_SCALE_A};
    for (int g = 0; g < 4; g++) {
        bie_tensor v;
        st = bie_layer_grad(l, grads[g], &v);
        lt_put_int(r, 3, (int)st);
        if (st == BIE_OK) lt_put_tensor(r, t, 4, v.dtype == BIE_I8 ? LT_GRAD_I8 : LT_GRAD, &v);
    }

    /* Every kernel of the layer's op on its device, in inference mode (no saved state). */
    LT_OK(r, t, bie_layer_set_training(l, false));
    const bie_op op = binary ? BIE_OP_BINARY_GEMM : BIE_OP_Q4_GEMM;
    for (int i = 0; i < bie_kernel_count(); i++) {
        bie_kernel_info info;
        LT_OK(r, t, bie_kernel_get(i, &info));
        if (info.op != op || info.device != c->dev.type || !info.available) continue;
        st = bie_layer_set_gemm_kernel(l, info.id);
        lt_put_int(r, 5, (int)st);
        if (st != BIE_OK) continue;
        LT_OK(r, t, bie_layer_forward(l, &x, &y));
        lt_put_tensor(r, t, 6, LT_EXACT, &y);
    }
    LT_OK(r, t, bie_layer_set_gemm_kernel(l, -1));
    /* The packed weight, and for the binary kinds every word size. */
    LT_OK(r, t, bie_layer_generate_quantized_weight(l, false));
    LT_OK(r, t, bie_layer_forward(l, &x, &y));
    lt_put_tensor(r, t, 7, LT_EXACT, &y);
    for (int bits = 32; binary && bits <= 64; bits *= 2) {
        LT_OK(r, t, bie_layer_set_bits_binary_word(l, bits));
        LT_OK(r, t, bie_layer_forward(l, &x, &y));
        lt_put_tensor(r, t, 8, LT_EXACT, &y);
    }

    /* The per-thread error message: a refused call names this thread's own kernel id. */
    const int bad_id = 1000000 + 100 * t + j;
    char want[16];
    snprintf(want, sizeof want, "%d", bad_id);
    if (bie_layer_set_gemm_kernel(l, bad_id) == BIE_OK || strstr(bie_last_error(), want) == NULL) {
        r->failures++;
        fprintf(stderr, "thread %d: set_gemm_kernel(%d): message '%s'\n", t, bad_id,
                bie_last_error());
    }
    /* The registry and the CPU kernel set (detected on first use). */
    const char *set = bie_cpu_kernel_set();
    lt_put(r, 9, LT_EXACT, set, strlen(set));
    lt_put_int(r, 10, bie_kernel_count());
    bie_kernel_info info;
    LT_OK(r, t, bie_kernel_default(op, rows, &info));
    lt_put_int(r, 11, info.id);

    bie_layer_free(l);
    bie_tensor_free(&x);
    bie_tensor_free(&y);
    bie_tensor_free(&gx);
    bie_tensor_free(&gy);
    free(hx);
}

/* ---- comparing a record with the reference */
static inline bool lt_same(const lt_record *ref, const lt_record *got, bool tolerant, int t,
                           int round) {
    size_t a = 0, b = 0;
    int entry = 0;
    while (a < ref->len && b < got->len) {
        lt_entry_head ha, hb;
        memcpy(&ha, ref->data + a, sizeof ha);
        memcpy(&hb, got->data + b, sizeof hb);
        const unsigned char *pa = ref->data + a + sizeof ha, *pb = got->data + b + sizeof hb;
        bool ok = ha.tag == hb.tag && ha.how == hb.how && ha.bytes == hb.bytes;
        if (ok && memcmp(pa, pb, ha.bytes) != 0) {
            ok = tolerant && ha.how != LT_EXACT;
            if (ok && ha.how == LT_GRAD_I8) {
                for (uint32_t i = 0; i < ha.bytes; i++)
                    ok = ok && abs((int)(int8_t)pa[i] - (int)(int8_t)pb[i]) <= 1;
            } else if (ok) {
                const uint32_t n = ha.bytes / 4;
                float amax = 0, va, vb;
                for (uint32_t i = 0; i < n; i++) {
                    memcpy(&va, pa + 4 * i, 4);
                    amax = fmaxf(amax, fabsf(va));
                }
                for (uint32_t i = 0; i < n && ok; i++) {
                    memcpy(&va, pa + 4 * i, 4);
                    memcpy(&vb, pb + 4 * i, 4);
                    ok = fabsf(va - vb) <= 1e-5f * amax;
                }
            }
        }
        if (!ok) {
            fprintf(stderr, "thread %d, round %d: entry %d (tag %u) differs from the reference\n",
                    t, round, entry, ha.tag);
            return false;
        }
        a += sizeof ha + ha.bytes;
        b += sizeof hb + hb.bytes;
        entry++;
    }
    if (a != ref->len || b != got->len) {
        fprintf(stderr, "thread %d, round %d: %d entries, then the records differ in length\n", t,
                round, entry);
        return false;
    }
    return true;
}

/* ---- the runner */
typedef struct lt_hooks {
    /* Per-thread set-up (e.g. a CUDA stream) and tear-down; NULL: none. */
    bool (*begin)(int t, void **state);
    void (*end)(void *state);
} lt_hooks;

typedef struct lt_worker {
    const lt_ctx *c;
    const lt_hooks *hooks;
    pthread_barrier_t *start;
    int t, rounds;
    lt_record *rec; /* one per round */
} lt_worker;

static inline void lt_run_scripts(const lt_ctx *c, int t, lt_record *r) {
    for (int j = 0; j < LT_KINDS; j++) lt_script(c, t, j, r);
}

static inline void *lt_thread(void *arg) {
    lt_worker *w = arg;
    void *state = NULL;
    const bool ready = w->hooks->begin == NULL || w->hooks->begin(w->t, &state);
    pthread_barrier_wait(w->start);
    for (int i = 0; i < w->rounds && ready; i++) lt_run_scripts(w->c, w->t, &w->rec[i]);
    if (!ready) w->rec[0].failures++;
    if (w->hooks->end) w->hooks->end(state);
    return NULL;
}

/* N threads x R rounds, then the reference; 0 when every round of every thread matches. */
static inline int lt_run(const lt_ctx *c, const lt_hooks *hooks, int threads, int rounds) {
    lt_worker w[LT_MAX_THREADS];
    pthread_t tid[LT_MAX_THREADS];
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, (unsigned)threads);
    for (int t = 0; t < threads; t++) {
        w[t] = (lt_worker){c, hooks, &start, t, rounds, calloc((size_t)rounds, sizeof(lt_record))};
        if (w[t].rec == NULL || pthread_create(&tid[t], NULL, lt_thread, &w[t]) != 0) {
            fprintf(stderr, "cannot start thread %d\n", t);
            return 2;
        }
    }
    for (int t = 0; t < threads; t++) pthread_join(tid[t], NULL);
    pthread_barrier_destroy(&start);

    int bad = 0;
    size_t compared = 0;
    void *state = NULL;
    const bool ready = hooks->begin == NULL || hooks->begin(threads, &state);
    for (int t = 0; t < threads && ready; t++) {
        lt_record ref = {0};
        lt_run_scripts(c, t, &ref);
        bad += ref.failures;
        compared += ref.len * (size_t)rounds;
        for (int i = 0; i < rounds; i++) {
            bad += w[t].rec[i].failures;
            bad += !lt_same(&ref, &w[t].rec[i], c->dev.type != BIE_DEVICE_CPU, t, i);
            free(w[t].rec[i].data);
        }
        free(w[t].rec);
        free(ref.data);
    }
    if (hooks->end) hooks->end(state);
    bad += !ready;
    printf("%d threads x %d rounds x %d layer kinds on %s, %zu bytes of results compared: %s\n",
           threads, rounds, LT_KINDS, c->dev.type == BIE_DEVICE_CPU ? "the CPU" : "CUDA", compared,
           bad ? "FAILED" : "all match");
    return bad ? 1 : 0;
}

/* --threads N (1..16), --rounds R, --small */
static inline void lt_args(int argc, char **argv, int *threads, int *rounds, bool *small) {
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc)
            *threads = atoi(argv[++i]);
        else if (strcmp(argv[i], "--rounds") == 0 && i + 1 < argc)
            *rounds = atoi(argv[++i]);
        else if (strcmp(argv[i], "--small") == 0)
            *small = true;
    }
    if (*threads < 1) *threads = 1;
    if (*threads > LT_MAX_THREADS) *threads = LT_MAX_THREADS;
    if (*rounds < 1) *rounds = 1;
}

#endif
