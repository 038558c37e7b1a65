// GPU benchmark: bie's binary GEMM on tensor cores against cuBLAS bf16, and its 4-bit GEMM against
// cuBLAS int8 and bf16, on the same shapes, in one run, timed with CUDA events over many launches
// (median of repeats).
// Prints one JSON line per case: name, ours_s, baseline_s, ratio, ours_tops, baseline_tflops.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bie.h"
#include "bie_cuda.h"
#include "cuda/cuda_internal.h"

#define CK(x)                                                                                  \
    do {                                                                                       \
        cudaError_t e_ = (x);                                                                  \
        if (e_ != cudaSuccess) {                                                               \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

static void fill_random(void *p, size_t bytes, unsigned seed) {
    std::vector<unsigned> h((bytes + 3) / 4);
    unsigned s = seed * 2654435761u + 1;
    for (auto &v : h) v = (s = s * 1664525u + 1013904223u) ^ (s >> 13);
    CK(cudaMemcpy(p, h.data(), bytes, cudaMemcpyHostToDevice));
}

// Median over `reps` of the mean time of `inner` back-to-back launches.
template <class F> static double time_it(F f, int inner, int reps) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    f();
    CK(cudaDeviceSynchronize());
    std::vector<double> t;
    for (int r = 0; r < reps; r++) {
        CK(cudaEventRecord(a));
        for (int i = 0; i < inner; i++) f();
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms * 1e-3 / inner);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

static bool wanted(int argc, char **argv, const char *name) {
    if (argc < 2) return true;
    for (int i = 1; i < argc; i++)
        if (strstr(name, argv[i])) return true;
    return false;
}

static void bie_ok(bie_status s, const char *what);

static void bgemm_case(cublasHandle_t h, const char *name, int64_t m, int64_t n, int64_t k,
                       int kernel_id) {
    int64_t rb = (k + 7) / 8;
    void *a, *b, *out, *fa, *fb, *fc;
    CK(cudaMalloc(&a, m * rb));
    CK(cudaMalloc(&b, n * rb));
    CK(cudaMalloc(&out, m * n * 4));
    fill_random(a, m * rb, 1);
    fill_random(b, n * rb, 2);
    CK(cudaMalloc(&fa, m * k * 2));
    CK(cudaMalloc(&fb, n * k * 2));
    CK(cudaMalloc(&fc, m * n * 2));
    // bf16 operands from random bits, masked to small finite values (exponent cleared)
    fill_random(fa, m * k * 2, 3);
    fill_random(fb, n * k * 2, 4);
    std::vector<uint16_t> fix(1 << 20);
    for (int64_t off = 0; off < m * k; off += (int64_t)fix.size()) {
        int64_t cnt = std::min<int64_t>(fix.size(), m * k - off);
        for (int64_t i = 0; i < cnt; i++)
            fix[i] = (uint16_t)(0x3c00 | ((i * 2654435761u) >> 20 & 0x01ff) | ((i & 1) << 15));
        CK(cudaMemcpy((uint16_t *)fa + off, fix.data(), cnt * 2, cudaMemcpyHostToDevice));
    }
    for (int64_t off = 0; off < n * k; off += (int64_t)fix.size()) {
        int64_t cnt = std::min<int64_t>(fix.size(), n * k - off);
        for (int64_t i = 0; i < cnt; i++)
            fix[i] = (uint16_t)(0x3c00 | ((i * 40503u) >> 7 & 0x01ff) | ((i >> 3 & 1) << 15));
        CK(cudaMemcpy((uint16_t *)fb + off, fix.data(), cnt * 2, cudaMemcpyHostToDevice));
    }
    double work = 2.0 * m * n * k;
    int inner = work > 1e12 ? 5 : work > 1e10 ? 20 : 200;
    auto ours = [&] {
        if (bie_cuda_binary_gemm(kernel_id, m, n, k, a, rb, b, rb, 1.0f, (float *)out) != BIE_OK) {
            fprintf(stderr, "bie: %s\n", bie_last_error());
            exit(1);
        }
    };
    float one = 1.0f, zero = 0.0f;
    auto base = [&] {
        // C[m, n] (row-major) = A[m, k] B[n, k]^T  ==  column-major C^T = B A^T
        cublasStatus_t s =
            cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, (int)n, (int)m, (int)k, &one, fb, CUDA_R_16BF,
                         (int)k, fa, CUDA_R_16BF, (int)k, &zero, fc, CUDA_R_16BF, (int)n,
                         CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        if (s != CUBLAS_STATUS_SUCCESS) {
            fprintf(stderr, "cublasGemmEx failed: %d\n", (int)s);
            exit(1);
        }
    };
    // The GEMM kernel alone, on operands already in the device layout (as a layer runs it:
    // the entry point above re-lays out both operands on every call), f32 and bf16 output.
    const int64_t ld = bie_cuda_row_stride(k);
    const int parts = bie_cuda_popc_parts(ld);
    uint8_t *ad, *bd;
    int *pa, *pb;
    CK(cudaMalloc(&ad, m * ld));
    CK(cudaMalloc(&bd, n * ld));
    CK(cudaMalloc(&pa, m * parts * sizeof(int)));
    CK(cudaMalloc(&pb, n * parts * sizeof(int)));
    bie_ok(bie_cuda_repack_rows(a, rb, m, k, ld, ad, pa), "repack");
    bie_ok(bie_cuda_repack_rows(b, rb, n, k, ld, bd, pb), "repack");
    auto kernel_only = [&](bie_dtype dt) {
        bie_ok(bie_cuda_bgemm_launch(kernel_id, m, n, k, ad, bd, ld, pa, parts, pb, 1.0f, NULL,
                                     NULL, dt, out, NULL),
               "binary gemm");
    };
    double t_ours = 0, t_base = 0, t_kern = 0, t_kern16 = 0;
    for (int round = 0; round < 2; round++) {  // interleave, keep the better round
        double o = time_it(ours, inner, 7), bb = time_it(base, inner, 7);
        double kf = time_it([&] { kernel_only(BIE_F32); }, inner, 7);
        double kh = time_it([&] { kernel_only(BIE_BF16); }, inner, 7);
        t_ours = round ? std::min(t_ours, o) : o;
        t_base = round ? std::min(t_base, bb) : bb;
        t_kern = round ? std::min(t_kern, kf) : kf;
        t_kern16 = round ? std::min(t_kern16, kh) : kh;
    }
    bie_kernel_info info;
    const char *kname = "default";
    if (kernel_id >= 0 && bie_kernel_find(kernel_id, &info) == BIE_OK) kname = info.name;
    printf(
        "{\"name\":\"%s\",\"kernel\":\"%s\",\"m\":%lld,\"n\":%lld,\"k\":%lld,\"ours_s\":%.6e,"
        "\"baseline_s\":%.6e,\"ratio\":%.3f,\"ours_tops\":%.1f,\"baseline_tflops\":%.1f,"
        "\"kernel_s\":%.6e,\"kernel_tops\":%.1f,\"kernel_bf16_s\":%.6e,\"kernel_bf16_tops\":%.1f,"
        "\"baseline\":\"cublasGemmEx bf16\"}\n",
        name, kname, (long long)m, (long long)n, (long long)k, t_ours, t_base, t_base / t_ours,
        work / t_ours / 1e12, work / t_base / 1e12, t_kern, work / t_kern / 1e12, t_kern16,
        work / t_kern16 / 1e12);
    fflush(stdout);
    cudaFree(a), cudaFree(b), cudaFree(out), cudaFree(fa), cudaFree(fb), cudaFree(fc);
    cudaFree(ad), cudaFree(bd), cudaFree(pa), cudaFree(pb);
}

// bie's 4-bit GEMM against cuBLAS int8 (int8 operands, int32 output) and bf16 on the same
// shape. ours_s: the GEMM kernel alone on operands already in the device nibble layout (as a
// layer with packed weights runs it), f32 output (bf16 in the bf16_out case); ours_api_s:
// bie_cuda_q4_gemm from int8 codes, i.e. packing both operands on every call, like cuBLAS
// int8 gets them. "correct" compares the API's first outputs with cuBLAS int8's.
static void q4gemm_case(cublasHandle_t h, const char *name, int64_t m, int64_t n, int64_t k,
                        int kernel_id, bie_dtype out_dtype) {
    const int64_t ld = bie_cuda_q4_row_stride(k);
    int8_t *a, *b;
    uint8_t *pa, *pb;
    void *out, *c32, *fa, *fb, *fc;
    CK(cudaMalloc(&a, m * k));
    CK(cudaMalloc(&b, n * k));
    CK(cudaMalloc(&pa, m * ld));
    CK(cudaMalloc(&pb, n * ld));
    CK(cudaMalloc(&out, m * n * 4));
    CK(cudaMalloc(&c32, m * n * 4));
    CK(cudaMalloc(&fa, m * k * 2));
    CK(cudaMalloc(&fb, n * k * 2));
    CK(cudaMalloc(&fc, m * n * 2));
    {
        std::vector<int8_t> hc(std::max(m, n) * k);
        unsigned s = 12345;
        for (auto &v : hc) v = (int8_t)((int)((s = s * 1664525u + 1013904223u) >> 28) - 8);
        CK(cudaMemcpy(a, hc.data(), m * k, cudaMemcpyHostToDevice));
        for (auto &v : hc) v = (int8_t)((int)((s = s * 1664525u + 1013904223u) >> 28) - 8);
        CK(cudaMemcpy(b, hc.data(), n * k, cudaMemcpyHostToDevice));
    }
    fill_random(fa, m * k * 2, 3);
    fill_random(fb, n * k * 2, 4);
    {  // small finite bf16 values: random mantissa and sign, exponent of 1
        std::vector<uint16_t> fix(std::max(m, n) * k);
        for (size_t i = 0; i < fix.size(); i++)
            fix[i] = (uint16_t)(0x3f80 | ((i * 2654435761u) >> 20 & 0x7f) | ((i & 1) << 15));
        CK(cudaMemcpy(fa, fix.data(), m * k * 2, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(fb, fix.data(), n * k * 2, cudaMemcpyHostToDevice));
    }
    bie_ok(bie_cuda_q4_pack_codes(a, k, m, k, ld, pa), "pack");
    bie_ok(bie_cuda_q4_pack_codes(b, k, n, k, ld, pb), "pack");
    const double work = 2.0 * m * n * k;
    const int inner = work > 1e12 ? 5 : work > 1e10 ? 20 : 200;
    auto ours = [&] {
        bie_ok(bie_cuda_q4gemm_launch(kernel_id, m, n, k, pa, pb, ld, 1.0f, NULL, NULL, out_dtype,
                                      out, NULL),
               "q4 gemm");
    };
    // Kernel 211 on the int8 codes as they are (rows of k bytes, k a multiple of 128): the
    // kernel alone, without the conversion from nibble rows that ours_s includes.
    const bool i8_rows = kernel_id == 211 && k % 128 == 0;
    auto ours_i8 = [&] {
        bie_ok(bie_cuda_q4gemm_i8_launch(m, n, k, a, b, k, 1.0f, NULL, NULL, out_dtype, out, NULL),
               "q4 gemm (int8 rows)");
    };
    auto ours_api = [&] {
        bie_ok(bie_cuda_q4_gemm(kernel_id, m, n, k, a, k, b, k, 1.0f, (float *)out), "q4 gemm");
    };
    auto int8 = [&] {
        // C[m, n] (row-major) = A[m, k] B[n, k]^T  ==  column-major C^T = B A^T
        int one = 1, zero = 0;
        cublasStatus_t s =
            cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, (int)n, (int)m, (int)k, &one, b, CUDA_R_8I,
                         (int)k, a, CUDA_R_8I, (int)k, &zero, c32, CUDA_R_32I, (int)n,
                         CUBLAS_COMPUTE_32I, CUBLAS_GEMM_DEFAULT);
        if (s != CUBLAS_STATUS_SUCCESS) {
            fprintf(stderr, "cublasGemmEx int8 failed: %d\n", (int)s);
            exit(1);
        }
    };
    auto bf16 = [&] {
        float one = 1.0f, zero = 0.0f;
        cublasStatus_t s =
            cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, (int)n, (int)m, (int)k, &one, fb, CUDA_R_16BF,
                         (int)k, fa, CUDA_R_16BF, (int)k, &zero, fc, CUDA_R_16BF, (int)n,
                         CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        if (s != CUBLAS_STATUS_SUCCESS) {
            fprintf(stderr, "cublasGemmEx bf16 failed: %d\n", (int)s);
            exit(1);
        }
    };
    double t_ours = 0, t_api = 0, t_i8 = 0, t_bf = 0, t_rows = 0;
    for (int round = 0; round < 2; round++) {  // interleave, keep the better round
        double o = time_it(ours, inner, 7), p = time_it(ours_api, inner, 7);
        const double r = i8_rows ? time_it(ours_i8, inner, 7) : 0.0;
        t_rows = round ? std::min(t_rows, r) : r;
        double i8 = time_it(int8, inner, 7), bb = time_it(bf16, inner, 7);
        t_ours = round ? std::min(t_ours, o) : o;
        t_api = round ? std::min(t_api, p) : p;
        t_i8 = round ? std::min(t_i8, i8) : i8;
        t_bf = round ? std::min(t_bf, bb) : bb;
    }
    if (i8_rows) {  // kernel 211 on the int8 rows against cuBLAS int8 too
        ours_i8();
        int8();
        const int64_t n_check = std::min<int64_t>(m * n, 1 << 20);
        std::vector<float> ro(n_check);
        std::vector<int> ri(n_check);
        CK(cudaMemcpy(ro.data(), out, n_check * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(ri.data(), c32, n_check * 4, cudaMemcpyDeviceToHost));
        bool same = out_dtype == BIE_F32;
        for (int64_t i = 0; same && i < n_check; i++) same = ro[i] == (float)ri[i];
        printf("{\"name\":\"%s/int8_rows\",\"m\":%lld,\"n\":%lld,\"k\":%lld,\"ours_s\":%.6e,"
               "\"int8_s\":%.6e,\"ours_tops\":%.1f,\"ratio_int8\":%.3f,\"correct\":%s}\n",
               name, (long long)m, (long long)n, (long long)k, t_rows, t_i8, work / t_rows / 1e12,
               t_i8 / t_rows, same ? "true" : "false");
    }
    ours_api();
    int8();
    const int64_t check = std::min<int64_t>(m * n, 1 << 20);
    std::vector<float> ho(check);
    std::vector<int> hi(check);
    CK(cudaMemcpy(ho.data(), out, check * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hi.data(), c32, check * 4, cudaMemcpyDeviceToHost));
    bool correct = true;
    for (int64_t i = 0; i < check; i++) correct = correct && ho[i] == (float)hi[i];
    bie_kernel_info info;
    const char *kname = "default";
    if (kernel_id >= 0 && bie_kernel_find(kernel_id, &info) == BIE_OK) kname = info.name;
    printf("{\"name\":\"%s\",\"kernel\":\"%s\",\"m\":%lld,\"n\":%lld,\"k\":%lld,\"ours_s\":%.6e,"
           "\"ours_api_s\":%.6e,\"int8_s\":%.6e,\"bf16_s\":%.6e,\"ours_tops\":%.1f,\"ours_api_"
           "tops\":%.1f,"
           "\"int8_tops\":%.1f,\"bf16_tflops\":%.1f,\"ratio_int8\":%.3f,\"ratio_bf16\":%.3f,"
           "\"api_ratio_int8\":%.3f,\"correct\":%s,\"baseline\":\"cublasGemmEx int8 (32I) and "
           "bf16\"}\n",
           name, kname, (long long)m, (long long)n, (long long)k, t_ours, t_api, t_i8, t_bf,
           work / t_ours / 1e12, work / t_api / 1e12, work / t_i8 / 1e12, work / t_bf / 1e12,
           t_i8 / t_ours, t_bf / t_ours, t_i8 / t_api, correct ? "true" : "false");
    fflush(stdout);
    cudaFree(a), cudaFree(b), cudaFree(pa), cudaFree(pb), cudaFree(out), cudaFree(c32);
    cudaFree(fa), cudaFree(fb), cudaFree(fc);
}

static void bie_ok(bie_status s, const char *what) {
    if (s != BIE_OK) {
        fprintf(stderr, "bie: %s: %s\n", what, bie_last_error());
        exit(1);
    }
}

static bie_tensor dev_tensor(bie_dtype dt, int64_t rows, int64_t cols) {
    int64_t shape[2] = {rows, cols};
    bie_tensor t;
    bie_ok(bie_cuda_tensor_alloc(&t, dt, 2, shape, 0), "alloc");
    return t;
}

// bf16 values in [-2, 2) from random bits (exponent fixed, random mantissa and sign).
static void fill_bf16(void *p, int64_t count, unsigned seed) {
    std::vector<uint16_t> h(count);
    unsigned s = seed * 2654435761u + 1;
    for (auto &v : h) {
        s = s * 1664525u + 1013904223u;
        v = (uint16_t)(0x3f80 | ((s >> 9) & 0x7f) | ((s >> 31) << 15));
    }
    CK(cudaMemcpy(p, h.data(), count * 2, cudaMemcpyHostToDevice));
}

static void gemm_bf16(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int64_t m,
                      int64_t n, int64_t k, const void *a, int64_t lda, const void *b, int64_t ldb,
                      void *c, int64_t ldc) {
    float one = 1.0f, zero = 0.0f;
    cublasStatus_t s = cublasGemmEx(h, ta, tb, (int)m, (int)n, (int)k, &one, a, CUDA_R_16BF,
                                    (int)lda, b, CUDA_R_16BF, (int)ldb, &zero, c, CUDA_R_16BF,
                                    (int)ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "cublasGemmEx failed: %d\n", (int)s);
        exit(1);
    }
}

// Inference forward of a bfloat16 binary linear layer (packed weights only) for m rows, N = K =
// 8192, against cuBLAS bf16 y = x W^T; timed over many launches and as a replayed CUDA graph.
static void layer_forward_case(cublasHandle_t h, const char *name, int64_t m, int64_t nk) {
    bie_device cuda = {BIE_DEVICE_CUDA, 0};
    bie_layer *l;
    bie_ok(bie_binary_linear_create(&l, nk, nk, cuda, BIE_BF16, true), "create");
    bie_ok(bie_layer_prepare_params(l), "prepare");
    bie_ok(bie_layer_set_scale_a(l, 1.0f), "scale_a");
    bie_ok(bie_layer_set_training(l, false), "eval");
    bie_ok(bie_layer_generate_quantized_weight(l, true), "pack");
    bie_tensor x = dev_tensor(BIE_BF16, m, nk), y = dev_tensor(BIE_BF16, m, nk);
    bie_tensor w = dev_tensor(BIE_BF16, nk, nk);
    fill_bf16(x.data, m * nk, 5);
    fill_bf16(w.data, nk * nk, 6);
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    bie_ok(bie_cuda_set_stream(st), "stream");
    cublasSetStream(h, st);
    auto ours = [&] { bie_ok(bie_layer_forward(l, &x, &y), "forward"); };
    auto base = [&] {
        gemm_bf16(h, CUBLAS_OP_T, CUBLAS_OP_N, nk, m, nk, w.data, nk, x.data, nk, y.data, nk);
    };
    ours();
    CK(cudaStreamSynchronize(st));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    ours();
    CK(cudaStreamEndCapture(st, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    auto ours_graph = [&] { CK(cudaGraphLaunch(exec, st)); };
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    auto timed = [&](auto f) {
        std::vector<double> t;
        for (int r = 0; r < 7; r++) {
            CK(cudaEventRecord(a, st));
            for (int i = 0; i < 200; i++) f();
            CK(cudaEventRecord(b, st));
            CK(cudaEventSynchronize(b));
            float ms;
            CK(cudaEventElapsedTime(&ms, a, b));
            t.push_back(ms * 1e-3 / 200);
        }
        std::sort(t.begin(), t.end());
        return t[t.size() / 2];
    };
    timed(ours);
    double t_ours = timed(ours), t_graph = timed(ours_graph), t_base = timed(base);
    printf(
        "{\"name\":\"%s\",\"m\":%lld,\"n\":%lld,\"k\":%lld,\"ours_s\":%.6e,\"ours_graph_s\":%.6e,"
        "\"baseline_s\":%.6e,\"ratio\":%.3f,\"weight_gbps\":%.0f,\"baseline\":\"cublasGemmEx bf16 "
        "(x W^T)\"}\n",
        name, (long long)m, (long long)nk, (long long)nk, t_ours, t_graph, t_base,
        t_base / std::min(t_ours, t_graph), (double)nk * nk / 8 / std::min(t_ours, t_graph) / 1e9);
    fflush(stdout);
    bie_ok(bie_cuda_set_stream(nullptr), "stream");
    cublasSetStream(h, nullptr);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(st);
    bie_tensor_free(&x), bie_tensor_free(&y), bie_tensor_free(&w);
    bie_layer_free(l);
}

// A training step (forward + backward with grad_x) of a bfloat16 binary linear layer against
// a bf16 linear layer's forward + backward in cuBLAS (three GEMMs).
// mode: the binary layer's backward; q4: the 4-bit layer instead (exact backward only).
static void layer_train_case(cublasHandle_t h, const char *name, int64_t m, int64_t nk,
                             bie_backward_mode mode, bool q4 = false, int kernel_id = -1) {
    bie_device cuda = {BIE_DEVICE_CUDA, 0};
    bie_layer *l;
    if (q4)
        bie_ok(bie_q4_linear_create(&l, nk, nk, cuda, BIE_BF16), "create");
    else
        bie_ok(bie_binary_linear_create(&l, nk, nk, cuda, BIE_BF16, true), "create");
    bie_ok(bie_layer_prepare_params(l), "prepare");
    if (kernel_id >= 0 && bie_layer_set_gemm_kernel(l, kernel_id) != BIE_OK) {
        fprintf(stderr, "%s: skipped (%s)\n", name, bie_last_error());
        bie_layer_free(l);
        return;
    }
    if (!q4 && bie_layer_set_backward_mode(l, mode) != BIE_OK) {
        fprintf(stderr, "%s: skipped (%s)\n", name, bie_last_error());
        bie_layer_free(l);
        return;
    }
    bie_tensor x = dev_tensor(BIE_BF16, m, nk), y = dev_tensor(BIE_BF16, m, nk);
    bie_tensor g = dev_tensor(BIE_BF16, m, nk), gx = dev_tensor(BIE_BF16, m, nk);
    bie_tensor w = dev_tensor(BIE_BF16, nk, nk), gw = dev_tensor(BIE_BF16, nk, nk);
    fill_bf16(x.data, m * nk, 7);
    fill_bf16(g.data, m * nk, 8);
    fill_bf16(w.data, nk * nk, 9);
    auto ours = [&] {
        bie_ok(bie_layer_forward(l, &x, &y), "forward");
        bie_ok(bie_layer_backward(l, &g, &gx), "backward");
    };
    auto ours_fwd = [&] { bie_ok(bie_layer_forward(l, &x, &y), "forward"); };
    auto base = [&] {
        gemm_bf16(h, CUBLAS_OP_T, CUBLAS_OP_N, nk, m, nk, w.data, nk, x.data, nk, y.data,
                  nk);  // y = x W^T
        gemm_bf16(h, CUBLAS_OP_N, CUBLAS_OP_N, nk, m, nk, w.data, nk, g.data, nk, gx.data,
                  nk);  // gx = g W
        gemm_bf16(h, CUBLAS_OP_N, CUBLAS_OP_T, nk, nk, m, x.data, nk, g.data, nk, gw.data,
                  nk);  // gw = g^T x
    };
    auto base_fwd = [&] {
        gemm_bf16(h, CUBLAS_OP_T, CUBLAS_OP_N, nk, m, nk, w.data, nk, x.data, nk, y.data, nk);
    };
    double t_ours = time_it(ours, 10, 7), t_base = time_it(base, 10, 7);
    double t_of = time_it(ours_fwd, 10, 7), t_bf = time_it(base_fwd, 10, 7);
    printf(
        "{\"name\":\"%s\",\"m\":%lld,\"n\":%lld,\"k\":%lld,\"ours_s\":%.6e,\"baseline_s\":%.6e,"
        "\"ratio\":%.3f,\"ours_forward_s\":%.6e,\"baseline_forward_s\":%.6e,\"forward_ratio\":%.3f,"
        "\"backward\":\"%s\",\"baseline\":\"bf16 linear forward+backward, cublasGemmEx x3\"}\n",
        name, (long long)m, (long long)nk, (long long)nk, t_ours, t_base, t_base / t_ours, t_of,
        t_bf, t_bf / t_of,
        q4                         ? "4-bit, exact"
        : mode == BIE_BACKWARD_FP8 ? "fp8"
                                   : "exact");
    fflush(stdout);
    bie_tensor_free(&x), bie_tensor_free(&y), bie_tensor_free(&g), bie_tensor_free(&gx);
    bie_tensor_free(&w), bie_tensor_free(&gw);
    bie_layer_free(l);
}

int main(int argc, char **argv) {
    if (bie_cuda_device_count() == 0) {
        fprintf(stderr, "no CUDA device\n");
        return 1;
    }
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    fprintf(stderr, "bie_bench_cuda: %s, %d SMs\n", p.name, p.multiProcessorCount);
    cublasHandle_t h;
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) return 1;
    struct {
        const char *name;
        int64_t m, n, k;
        int id;
    } cases[] = {
        {"cuda_bgemm_8192", 8192, 8192, 8192, -1},
        {"cuda_bgemm_8192/100", 8192, 8192, 8192, 100},
        {"cuda_bgemm_8192/101", 8192, 8192, 8192, 101},
        {"cuda_bgemm_8192/102", 8192, 8192, 8192, 102},
        {"cuda_bgemm_8192/103", 8192, 8192, 8192, 103},
        {"cuda_bgemm_8192/104", 8192, 8192, 8192, 104},
        {"cuda_bgemm_8192/105", 8192, 8192, 8192, 105},
        {"cuda_bgemm_8192/106", 8192, 8192, 8192, 106},
        {"cuda_bgemm_8192/107", 8192, 8192, 8192, 107},
        {"cuda_bgemm_8192/108", 8192, 8192, 8192, 108},
        {"cuda_bgemm_4096", 4096, 4096, 4096, -1},
        {"cuda_bgemm_4096/102", 4096, 4096, 4096, 102},
        {"cuda_bgemm_4096/120", 4096, 4096, 4096, 120},
        {"cuda_bgemm_8192/120", 8192, 8192, 8192, 120},
        {"cuda_bgemm_4096/121", 4096, 4096, 4096, 121},
        {"cuda_bgemm_8192/121", 8192, 8192, 8192, 121},
        {"cuda_bgemm_2048", 2048, 2048, 2048, -1},
        {"cuda_bgemm_2048/101", 2048, 2048, 2048, 101},
        {"cuda_bgemm_2048/120", 2048, 2048, 2048, 120},
        {"cuda_bgemm_2048/121", 2048, 2048, 2048, 121},
        {"cuda_bgemm_1024x4096", 1024, 4096, 4096, -1},
        {"cuda_bgemm_1024x4096/101", 1024, 4096, 4096, 101},
        {"cuda_bgemm_1024x4096/120", 1024, 4096, 4096, 120},
        {"cuda_bgemm_1024x4096/121", 1024, 4096, 4096, 121},
        {"cuda_bgemm_512x4096", 512, 4096, 4096, -1},
        {"cuda_bgemm_512x4096/101", 512, 4096, 4096, 101},
        {"cuda_bgemm_512x4096/120", 512, 4096, 4096, 120},
        {"cuda_bgemm_512x4096/121", 512, 4096, 4096, 121},
        {"cuda_bgemm_256x4096", 256, 4096, 4096, -1},
        {"cuda_bgemm_256x4096/120", 256, 4096, 4096, 120},
        {"cuda_bgemm_256x4096/121", 256, 4096, 4096, 121},
        {"cuda_bgemm_m1", 1, 8192, 8192, -1},
        {"cuda_bgemm_m16", 16, 8192, 8192, -1},
        {"cuda_bgemm_m16/102", 16, 8192, 8192, 102},
    };
    for (auto &c : cases)
        if (wanted(argc, argv, c.name)) bgemm_case(h, c.name, c.m, c.n, c.k, c.id);
    std::remove_reference_t<decltype(cases[0])> q4_cases[] = {
        {"cuda_q4gemm_8192", 8192, 8192, 8192, -1},
        {"cuda_q4gemm_8192/200", 8192, 8192, 8192, 200},
        {"cuda_q4gemm_8192/202", 8192, 8192, 8192, 202},
        {"cuda_q4gemm_8192/204", 8192, 8192, 8192, 204},
        {"cuda_q4gemm_8192/205", 8192, 8192, 8192, 205},
        {"cuda_q4gemm_8192/210", 8192, 8192, 8192, 210},
        {"cuda_q4gemm_8192/211", 8192, 8192, 8192, 211},
        {"cuda_q4gemm_8192/bf16_out", 8192, 8192, 8192, -1},
        {"cuda_q4gemm_4096", 4096, 4096, 4096, -1},
        {"cuda_q4gemm_4096/200", 4096, 4096, 4096, 200},
        {"cuda_q4gemm_4096/201", 4096, 4096, 4096, 201},
        {"cuda_q4gemm_4096/202", 4096, 4096, 4096, 202},
        {"cuda_q4gemm_4096/205", 4096, 4096, 4096, 205},
        {"cuda_q4gemm_4096/210", 4096, 4096, 4096, 210},
        {"cuda_q4gemm_4096/211", 4096, 4096, 4096, 211},
        {"cuda_q4gemm_m16", 16, 8192, 8192, -1},
        {"cuda_q4gemm_m1", 1, 8192, 8192, -1},
    };
    for (auto &c : q4_cases)
        if (wanted(argc, argv, c.name))
            q4gemm_case(h, c.name, c.m, c.n, c.k, c.id,
                        strstr(c.name, "bf16_out") ? BIE_BF16 : BIE_F32);
    if (wanted(argc, argv, "cuda_linear_fwd_m1"))
        layer_forward_case(h, "cuda_linear_fwd_m1", 1, 8192);
    if (wanted(argc, argv, "cuda_linear_fwd_m16"))
        layer_forward_case(h, "cuda_linear_fwd_m16", 16, 8192);
    if (wanted(argc, argv, "cuda_linear_train_4096"))
        layer_train_case(h, "cuda_linear_train_4096", 4096, 4096, BIE_BACKWARD_EXACT);
    if (wanted(argc, argv, "cuda_linear_train_fp8_4096"))
        layer_train_case(h, "cuda_linear_train_fp8_4096", 4096, 4096, BIE_BACKWARD_FP8);
    if (wanted(argc, argv, "cuda_q4linear_train_4096"))
        layer_train_case(h, "cuda_q4linear_train_4096", 4096, 4096, BIE_BACKWARD_EXACT, true);
    if (wanted(argc, argv, "cuda_q4linear_train_4096/211"))  // the TMA kernel on int8 codes
        layer_train_case(h, "cuda_q4linear_train_4096/211", 4096, 4096, BIE_BACKWARD_EXACT, true,
                         211);
    cublasDestroy(h);
    return 0;
}
