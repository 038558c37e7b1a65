/* The CUDA binary GEMM kernels against the CPU backend, bit for bit, on random packed rows
 * of many shapes (m = 1, odd k, n = 1, tails of every tile size), with garbage in the padding
 * bits and poisoned outputs. Reports itself skipped (77) without a GPU. */
#include "bie_cuda.h"
#include "gpu_util.h"

static bie_tensor upload(const void *host, bie_dtype dt, int64_t count) {
    bie_tensor h = tu_view((void *)host, dt, 1, count, 0, 0, 0), d;
    int64_t shape[1] = {count};
    if (bie_cuda_tensor_alloc(&d, dt, 1, shape, 0) != BIE_OK || bie_tensor_copy(&d, &h) != BIE_OK) {
        fprintf(stderr, "upload failed: %s\n", bie_last_error());
        exit(2);
    }
    return d;
}

static int kernel_ids[16], nkernels;

static void check_shape(int64_t m, int64_t n, int64_t k, int64_t a_stride, int64_t b_stride) {
    uint8_t *a = tu_alloc((size_t)(m * a_stride)), *b = tu_alloc((size_t)(n * b_stride));
    tu_fill_bytes(a, m * a_stride);
    tu_fill_bytes(b, n * b_stride);
    float scale = tu_uniform(0.01f, 2.0f);
    float *expect = tu_alloc((size_t)(m * n) * sizeof(float));
    float *got = tu_alloc((size_t)(m * n) * sizeof(float));
    CHECK_OK(bie_binary_gemm(0, m, n, k, a, a_stride, b, b_stride, scale, expect)); /* scalar ref */
    bie_tensor da = upload(a, BIE_U8, m * a_stride), db = upload(b, BIE_U8, n * b_stride);
    tu_poison(got, m * n);
    bie_tensor dout = upload(got, BIE_F32, m * n), hout = tu_view(got, BIE_F32, 1, m * n, 0, 0, 0);
    for (int t = 0; t < nkernels; t++) {
        tu_poison(got, m * n);
        CHECK_OK(bie_tensor_copy(&dout, &hout)); /* poison the device output too */
        bie_status st = bie_cuda_binary_gemm(kernel_ids[t], m, n, k, da.data, a_stride, db.data,
                                             b_stride, scale, dout.data);
        CHECK(st == BIE_OK);
        if (st != BIE_OK) fprintf(stderr, "  %s\n", bie_last_error());
        CHECK_OK(bie_cuda_synchronize());
        CHECK_OK(bie_tensor_copy(&hout, &dout));
        int same = tu_same_bits(got, expect, m * n);
        CHECK(same);
        if (!same) {
            int64_t bad = 0, first = -1;
            for (int64_t i = 0; i < m * n; i++)
                if (memcmp(&got[i], &expect[i], 4)) bad++, first = first < 0 ? i : first;
            fprintf(stderr,
                    "  kernel %d m=%lld n=%lld k=%lld: %lld of %lld differ, first at (%lld, %lld): "
                    "%g vs %g\n",
                    kernel_ids[t], (long long)m, (long long)n, (long long)k, (long long)bad,
                    (long long)(m * n), (long long)(first / n), (long long)(first % n),
                    (double)got[first], (double)expect[first]);
        }
    }
    bie_tensor_free(&da);
    bie_tensor_free(&db);
    bie_tensor_free(&dout);
    free(a);
    free(b);
    free(expect);
    free(got);
}

int main(int argc, char **argv) {
    /* --small: a few small shapes, for runs under compute-sanitizer */
    const int small = argc > 1 && strcmp(argv[1], "--small") == 0;
    if (gpu_missing()) return TU_SKIP;
    tu_seed(77);
    kernel_ids[nkernels++] = -1;
    for (int i = 0; i < bie_kernel_count(); i++) {
        bie_kernel_info info;
        CHECK_OK(bie_kernel_get(i, &info));
        if (info.device == BIE_DEVICE_CUDA && info.op == BIE_OP_BINARY_GEMM && info.available &&
            nkernels < 16) {
            kernel_ids[nkernels++] = info.id;
            printf("kernel %d %s\n", info.id, info.name);
        }
    }
    /* 1100 x 4000 and 2100 x 2333: more output tiles than SMs, so the persistent kernels run
     * several tiles per block */
    const int64_t shapes[][3] = {
        {1, 1, 1},        {1, 7, 7},       {3, 5, 63},       {16, 8, 256},      {17, 9, 257},
        {1100, 4000, 65}, {64, 64, 512},   {65, 63, 511},    {1, 300, 1000},    {129, 130, 513},
        {200, 77, 4099},  {5, 1000, 2048}, {257, 129, 8191}, {1024, 512, 1536}, {2100, 2333, 300}};
    size_t count = small ? 6 : sizeof shapes / sizeof shapes[0];
    for (size_t s = 0; s < count; s++) {
        int64_t m = shapes[s][0], n = shapes[s][1], k = shapes[s][2];
        check_shape(m, n, k, (k + 7) / 8, (k + 7) / 8);             /* 8-bit words */
        check_shape(m, n, k, (k + 63) / 64 * 8, (k + 31) / 32 * 4); /* 64- and 32-bit words */
    }
    return tu_finish();
}
