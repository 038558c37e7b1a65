/* Every binary GEMM kernel against a 64-bit integer reference on random packed rows of many
 * shapes (m = 1, odd k, n = 1, ...), for every word size's row padding, with garbage in the
 * padding bits (which must be ignored) and poisoned outputs. BIE_CPU_KERNELS may force a
 * kernel set; a set this CPU lacks makes the program report itself skipped (exit 77). */
#include "test_util.h"

/* The definition: sum over the k valid elements of (±1) * (±1), one element at a time. */
static int64_t ref_dot(const uint8_t *a, const uint8_t *b, int64_t k) {
    int64_t dot = 0;
    for (int64_t c = 0; c < k; c++) {
        int x = (a[c >> 3] >> (c & 7)) & 1, y = (b[c >> 3] >> (c & 7)) & 1;
        dot += (2 * x - 1) * (2 * y - 1);
    }
    return dot;
}

/* Kernel ids to test: -1 (the default) and every available CPU kernel. */
static int kernel_ids[64], nkernels;

static void collect_kernels(void) {
    kernel_ids[nkernels++] = -1;
    for (int idx = 0; idx < bie_kernel_count() && nkernels < 64; idx++) {
        bie_kernel_info info;
        CHECK_OK(bie_kernel_get(idx, &info));
        if (!info.available || info.device != BIE_DEVICE_CPU || info.op != BIE_OP_BINARY_GEMM)
            continue;
        kernel_ids[nkernels++] = info.id;
        printf("kernel %d %s\n", info.id, info.name);
    }
}

/* One random problem, its reference computed once, every kernel compared bit for bit. */
static void check_shape(int64_t m, int64_t n, int64_t k, int w) {
    int64_t rb = bie_packed_words(k, w) * (w / 8);
    uint8_t *a = tu_alloc((size_t)(m * rb)), *b = tu_alloc((size_t)(n * rb));
    tu_fill_bytes(a, m * rb); /* padding bits get random garbage too */
    tu_fill_bytes(b, n * rb);
    float scale = tu_uniform(0.01f, 2.0f);
    float *expect = tu_alloc((size_t)(m * n) * sizeof(float));
    float *out = tu_alloc((size_t)(m * n) * sizeof(float));
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++)
            expect[i * n + j] = (float)ref_dot(a + i * rb, b + j * rb, k) * scale;
    for (int t = 0; t < nkernels; t++) {
        tu_poison(out, m * n);
        bie_status st = bie_binary_gemm(kernel_ids[t], m, n, k, a, rb, b, rb, scale, out);
        CHECK(st == BIE_OK);
        int same = st == BIE_OK && tu_same_bits(out, expect, m * n);
        CHECK(same);
        if (!same)
            fprintf(stderr,
                    "  kernel %d m=%lld n=%lld k=%lld w=%d differs from the reference (%s)\n",
                    kernel_ids[t], (long long)m, (long long)n, (long long)k, w,
                    st == BIE_OK ? "values" : bie_last_error());
    }
    free(a);
    free(b);
    free(out);
    free(expect);
}

int main(void) {
    printf("kernel set: %s\n", bie_cpu_kernel_set());
    if (tu_forced_set_missing()) return TU_SKIP;
    tu_seed(42);
    const int64_t shapes[][3] = {
        {1, 1, 1},      {1, 1, 7},     {1, 5, 63},    {3, 1, 65},    {4, 4, 64},     {5, 7, 1000},
        {1, 33, 255},   {7, 9, 256},   {9, 3, 257},   {16, 16, 511}, {17, 13, 513},  {2, 31, 1024},
        {33, 17, 2047}, {1, 64, 4096}, {65, 65, 129}, {12, 6, 8191}, {6, 12, 20000}, {130, 70, 300},
    };
    const int words[] = {8, 32, 64};
    collect_kernels();
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int w = 0; w < 3; w++) check_shape(shapes[s][0], shapes[s][1], shapes[s][2], words[w]);
    /* Larger cases: blocking, threads, and the AVX2 kernels' 63-step counter flush. */
    check_shape(20, 70, 70000, 64);
    check_shape(300, 40, 3000, 8);
    return tu_finish();
}
