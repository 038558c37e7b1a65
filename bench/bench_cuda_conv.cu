// GPU convolution benchmark: bie's binary conv2d layer (bfloat16 in and out) against cuDNN's
// bfloat16 convolution on the same shape, in one run, timed with CUDA events (median of
// repeats, best of two interleaved rounds). cuDNN gets its fastest algorithm (cudnnFind) in
// both NCHW and NHWC layouts and the faster of the two is the baseline.
// Prints one JSON line per case. Usage: bie_bench_cuda_conv [filters...]
#include <cuda_runtime.h>
#include <cudnn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "bench_layer.h"
#include "bie.h"
#include "bie_cuda.h"

#define CK(x)                                                                                  \
    do {                                                                                       \
        cudaError_t e_ = (x);                                                                  \
        if (e_ != cudaSuccess) {                                                               \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)
#define DNN(x)                                                                                  \
    do {                                                                                        \
        cudnnStatus_t s_ = (x);                                                                 \
        if (s_ != CUDNN_STATUS_SUCCESS) {                                                       \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudnnGetErrorString(s_)); \
            exit(1);                                                                            \
        }                                                                                       \
    } while (0)

static void ok(bie_status s, const char *what) {
    if (s != BIE_OK) {
        fprintf(stderr, "bie: %s: %s\n", what, bie_last_error());
        exit(1);
    }
}

static bool wanted(int argc, char **argv, const char *name) {
    if (argc < 2) return true;
    for (int i = 1; i < argc; i++)
        if (strstr(name, argv[i])) return true;
    return false;
}

// Small random bf16 values in (-2, 2).
static void fill_bf16(void *p, int64_t count, unsigned seed) {
    std::vector<uint16_t> h(count);
    unsigned s = seed * 2654435761u + 7;
    for (auto &v : h) {
        s = s * 1664525u + 1013904223u;
        v = (uint16_t)(0x3f80 | ((s >> 9) & 0x7f) | ((s >> 31) << 15));
    }
    CK(cudaMemcpy(p, h.data(), count * 2, cudaMemcpyHostToDevice));
}

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
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

// Host time per call of f (what a call costs the CPU, launches included): inner calls
// between two synchronizations, median of reps. When it exceeds the GPU time per call, the
// GPU waits on the host and the timed loop measures the host.
template <class F> static double host_time(F f, int inner, int reps) {
    std::vector<double> t;
    for (int r = 0; r < reps; r++) {
        CK(cudaDeviceSynchronize());
        const auto a = std::chrono::steady_clock::now();
        for (int i = 0; i < inner; i++) f();
        const auto b = std::chrono::steady_clock::now();
        t.push_back(std::chrono::duration<double>(b - a).count() / inner);
    }
    CK(cudaDeviceSynchronize());
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

struct Shape {
    int n, c, h, w, o, k, s, p;
    int oh() const { return (h + 2 * p - k) / s + 1; }
    int ow() const { return (w + 2 * p - k) / s + 1; }
    double flops() const { return 2.0 * n * o * oh() * ow() * (double)c * k * k; }
};

// cuDNN bf16 convolution (forward, and with train also backward data + backward filter) in
// one layout, with the fastest algorithms cudnnFind reports.
struct Dnn {
    cudnnHandle_t h;
    cudnnTensorDescriptor_t x, y;
    cudnnFilterDescriptor_t w;
    cudnnConvolutionDescriptor_t conv;
    cudnnConvolutionFwdAlgo_t fwd;
    cudnnConvolutionBwdDataAlgo_t bwd_data;
    cudnnConvolutionBwdFilterAlgo_t bwd_filter;
    void *ws = nullptr;
    size_t ws_bytes = 0;

    Dnn(cudnnHandle_t handle, const Shape &g, cudnnTensorFormat_t fmt) : h(handle) {
        DNN(cudnnCreateTensorDescriptor(&x));
        DNN(cudnnCreateTensorDescriptor(&y));
        DNN(cudnnCreateFilterDescriptor(&w));
        DNN(cudnnCreateConvolutionDescriptor(&conv));
        DNN(cudnnSetTensor4dDescriptor(x, fmt, CUDNN_DATA_BFLOAT16, g.n, g.c, g.h, g.w));
        DNN(cudnnSetTensor4dDescriptor(y, fmt, CUDNN_DATA_BFLOAT16, g.n, g.o, g.oh(), g.ow()));
        DNN(cudnnSetFilter4dDescriptor(w, CUDNN_DATA_BFLOAT16, fmt, g.o, g.c, g.k, g.k));
        DNN(cudnnSetConvolution2dDescriptor(conv, g.p, g.p, g.s, g.s, 1, 1, CUDNN_CROSS_CORRELATION,
                                            CUDNN_DATA_FLOAT));
        DNN(cudnnSetConvolutionMathType(conv, CUDNN_TENSOR_OP_MATH));
        int found = 0;
        cudnnConvolutionFwdAlgoPerf_t fp[16];
        DNN(cudnnFindConvolutionForwardAlgorithm(h, x, w, conv, y, 16, &found, fp));
        fwd = fp[0].algo;
        ws_bytes = std::max(ws_bytes, fp[0].memory);
        cudnnConvolutionBwdDataAlgoPerf_t dp[16];
        DNN(cudnnFindConvolutionBackwardDataAlgorithm(h, w, y, conv, x, 16, &found, dp));
        bwd_data = dp[0].algo;
        ws_bytes = std::max(ws_bytes, dp[0].memory);
        cudnnConvolutionBwdFilterAlgoPerf_t bp[16];
        DNN(cudnnFindConvolutionBackwardFilterAlgorithm(h, x, y, conv, w, 16, &found, bp));
        bwd_filter = bp[0].algo;
        ws_bytes = std::max(ws_bytes, bp[0].memory);
        CK(cudaMalloc(&ws, ws_bytes ? ws_bytes : 1));
    }
    ~Dnn() {
        cudaFree(ws);
        cudnnDestroyTensorDescriptor(x);
        cudnnDestroyTensorDescriptor(y);
        cudnnDestroyFilterDescriptor(w);
        cudnnDestroyConvolutionDescriptor(conv);
    }
    void forward(const void *xd, const void *wd, void *yd) {
        float one = 1, zero = 0;
        DNN(cudnnConvolutionForward(h, &one, x, xd, w, wd, conv, fwd, ws, ws_bytes, &zero, y, yd));
    }
    void backward(const void *xd, const void *wd, const void *gy, void *gx, void *gw) {
        float one = 1, zero = 0;
        DNN(cudnnConvolutionBackwardData(h, &one, w, wd, y, gy, conv, bwd_data, ws, ws_bytes, &zero,
                                         x, gx));
        DNN(cudnnConvolutionBackwardFilter(h, &one, x, xd, y, gy, conv, bwd_filter, ws, ws_bytes,
                                           &zero, w, gw));
    }
};

// Profile mode (BIE_BENCH_PROFILE set): ours only, a few launches, for a profiler. True when
// it ran.
template <class F, class G> static bool profile_only(const char *name, F fwd, G train) {
    if (getenv("BIE_BENCH_PROFILE") == nullptr) return false;
    for (int i = 0; i < 3; i++) fwd();
    for (int i = 0; i < 3; i++) train();
    CK(cudaDeviceSynchronize());
    fprintf(stderr, "%s: profile mode (3 forwards, 3 training steps)\n", name);
    return true;
}

static bie_tensor dev4(int64_t a, int64_t b, int64_t c, int64_t d) {
    int64_t shape[4] = {a, b, c, d};
    bie_tensor t;
    ok(bie_cuda_tensor_alloc(&t, BIE_BF16, 4, shape, 0), "alloc");
    return t;
}

// Inference forward (packed weights) and a training step (forward + backward with grad_x) of
// bie's bf16 binary conv2d, against cuDNN bf16 forward and forward + both backward passes.
static void conv_case(cudnnHandle_t dnn, const char *name, Shape g) {
    bie_device cuda = {BIE_DEVICE_CUDA, 0};
    bie_tensor x = dev4(g.n, g.c, g.h, g.w), y = dev4(g.n, g.o, g.oh(), g.ow());
    bie_tensor gx = dev4(g.n, g.c, g.h, g.w), gy = dev4(g.n, g.o, g.oh(), g.ow());
    bie_tensor w = dev4(g.o, g.c, g.k, g.k), gw = dev4(g.o, g.c, g.k, g.k);
    fill_bf16(x.data, bie_tensor_numel(&x), 1);
    fill_bf16(w.data, bie_tensor_numel(&w), 2);
    fill_bf16(gy.data, bie_tensor_numel(&gy), 3);

    bie_layer *train, *infer;
    ok(bie_binary_conv2d_create(&train, g.c, g.o, g.k, g.s, g.p, 1, cuda, BIE_BF16, true),
       "create");
    ok(bie_binary_conv2d_create(&infer, g.c, g.o, g.k, g.s, g.p, 1, cuda, BIE_BF16, true),
       "create");
    ok(bie_layer_prepare_params(train), "prepare");
    ok(bie_layer_prepare_params(infer), "prepare");
    ok(bie_layer_set_training(infer, false), "eval");
    ok(bie_layer_generate_quantized_weight(infer, true), "pack");
    // The default path (implicit GEMM) and the im2col path with the kernel select_gemm_kernel
    // picks.
    auto ours_fwd = [&] { ok(bie_layer_forward(infer, &x, &y), "forward"); };
    auto ours_train = [&] {
        ok(bie_layer_forward(train, &x, &y), "forward");
        ok(bie_layer_backward(train, &gy, &gx), "backward");
    };
    if (profile_only(name, ours_fwd, ours_train)) {
        bie_layer_free(train);
        bie_layer_free(infer);
        return;
    }
    ok(bie_layer_select_gemm_kernel(infer, &x), "select");
    const int im2col_kernel = bench_kernel_id(infer);
    const double f_im2col = time_it(ours_fwd, 20, 7);
    ok(bie_layer_set_gemm_kernel(infer, -1), "default kernel");
    Dnn nchw(dnn, g, CUDNN_TENSOR_NCHW), nhwc(dnn, g, CUDNN_TENSOR_NHWC);
    auto base_fwd = [&](Dnn &d) { return [&] { d.forward(x.data, w.data, y.data); }; };
    auto base_train = [&](Dnn &d) {
        return [&] {
            d.forward(x.data, w.data, y.data);
            d.backward(x.data, w.data, gy.data, gx.data, gw.data);
        };
    };
    const int inner = 20, reps = 7;
    double f_ours = 1e30, f_nchw = 1e30, f_nhwc = 1e30, t_ours = 1e30, t_nchw = 1e30, t_nhwc = 1e30;
    for (int round = 0; round < 2; round++) {
        f_ours = std::min(f_ours, time_it(ours_fwd, inner, reps));
        f_nchw = std::min(f_nchw, time_it(base_fwd(nchw), inner, reps));
        f_nhwc = std::min(f_nhwc, time_it(base_fwd(nhwc), inner, reps));
        t_ours = std::min(t_ours, time_it(ours_train, inner, reps));
        t_nchw = std::min(t_nchw, time_it(base_train(nchw), inner, reps));
        t_nhwc = std::min(t_nhwc, time_it(base_train(nhwc), inner, reps));
    }
    const double f_base = std::min(f_nchw, f_nhwc), t_base = std::min(t_nchw, t_nhwc);
    const double f_host = host_time(ours_fwd, inner, reps);
    printf("{\"name\":\"%s\",\"n\":%d,\"c\":%d,\"h\":%d,\"w\":%d,\"o\":%d,\"k\":%d,\"stride\":%d,"
           "\"pad\":%d,"
           "\"im2col_kernel\":%d,\"fwd_im2col_s\":%.6e,\"fwd_ours_s\":%.6e,\"fwd_cudnn_nchw_s\":%."
           "6e,\"fwd_cudnn_nhwc_s\":%.6e,"
           "\"fwd_ratio\":%.3f,\"fwd_host_s\":%.6e,\"fwd_ours_tops\":%.1f,\"fwd_cudnn_tflops\":%."
           "1f,\"train_ours_s\":%.6e,"
           "\"train_cudnn_nchw_s\":%.6e,\"train_cudnn_nhwc_s\":%.6e,\"train_ratio\":%.3f,"
           "\"baseline\":\"cuDNN bf16 convolution, fastest algorithm and layout\"}\n",
           name, g.n, g.c, g.h, g.w, g.o, g.k, g.s, g.p, im2col_kernel, f_im2col, f_ours, f_nchw,
           f_nhwc, f_base / f_ours, f_host, g.flops() / f_ours / 1e12, g.flops() / f_base / 1e12,
           t_ours, t_nchw, t_nhwc, t_base / t_ours);
    fflush(stdout);
    bie_layer_free(train);
    bie_layer_free(infer);
    bie_tensor_free(&x), bie_tensor_free(&y), bie_tensor_free(&gx), bie_tensor_free(&gy);
    bie_tensor_free(&w), bie_tensor_free(&gw);
}

// Inference forward and training step of bie's bf16 4-bit conv2d against cuDNN bf16.
static void q4conv_case(cudnnHandle_t dnn, const char *name, Shape g) {
    bie_device cuda = {BIE_DEVICE_CUDA, 0};
    bie_tensor x = dev4(g.n, g.c, g.h, g.w), y = dev4(g.n, g.o, g.oh(), g.ow());
    bie_tensor gx = dev4(g.n, g.c, g.h, g.w), gy = dev4(g.n, g.o, g.oh(), g.ow());
    bie_tensor w = dev4(g.o, g.c, g.k, g.k), gw = dev4(g.o, g.c, g.k, g.k);
    fill_bf16(x.data, bie_tensor_numel(&x), 1);
    fill_bf16(w.data, bie_tensor_numel(&w), 2);
    fill_bf16(gy.data, bie_tensor_numel(&gy), 3);
    bie_layer *train, *infer;
    ok(bie_q4_conv2d_create(&train, g.c, g.o, g.k, g.s, g.p, 1, cuda, BIE_BF16), "create");
    ok(bie_q4_conv2d_create(&infer, g.c, g.o, g.k, g.s, g.p, 1, cuda, BIE_BF16), "create");
    ok(bie_layer_prepare_params(train), "prepare");
    ok(bie_layer_prepare_params(infer), "prepare");
    ok(bie_layer_set_training(infer, false), "eval");
    ok(bie_layer_generate_quantized_weight(infer, true), "pack");
    auto ours_fwd = [&] { ok(bie_layer_forward(infer, &x, &y), "forward"); };
    auto ours_train = [&] {
        ok(bie_layer_forward(train, &x, &y), "forward");
        ok(bie_layer_backward(train, &gy, &gx), "backward");
    };
    if (profile_only(name, ours_fwd, ours_train)) {
        bie_layer_free(train);
        bie_layer_free(infer);
        return;
    }
    Dnn nchw(dnn, g, CUDNN_TENSOR_NCHW), nhwc(dnn, g, CUDNN_TENSOR_NHWC);
    auto base_fwd = [&](Dnn &d) { return [&] { d.forward(x.data, w.data, y.data); }; };
    auto base_train = [&](Dnn &d) {
        return [&] {
            d.forward(x.data, w.data, y.data);
            d.backward(x.data, w.data, gy.data, gx.data, gw.data);
        };
    };
    double f_ours = 1e30, f_base = 1e30, t_ours = 1e30, t_base = 1e30;
    for (int round = 0; round < 2; round++) {
        f_ours = std::min(f_ours, time_it(ours_fwd, 20, 7));
        f_base = std::min({f_base, time_it(base_fwd(nchw), 20, 7), time_it(base_fwd(nhwc), 20, 7)});
        t_ours = std::min(t_ours, time_it(ours_train, 20, 7));
        t_base =
            std::min({t_base, time_it(base_train(nchw), 20, 7), time_it(base_train(nhwc), 20, 7)});
    }
    printf("{\"name\":\"%s\",\"n\":%d,\"c\":%d,\"h\":%d,\"w\":%d,\"o\":%d,\"k\":%d,\"fwd_ours_s\":%"
           ".6e,"
           "\"fwd_cudnn_s\":%.6e,\"fwd_ratio\":%.3f,\"fwd_ours_tops\":%.1f,\"train_ours_s\":%.6e,"
           "\"train_cudnn_s\":%.6e,\"train_ratio\":%.3f,\"baseline\":\"cuDNN bf16 convolution, "
           "fastest "
           "algorithm and layout\"}\n",
           name, g.n, g.c, g.h, g.w, g.o, g.k, f_ours, f_base, f_base / f_ours,
           g.flops() / f_ours / 1e12, t_ours, t_base, t_base / t_ours);
    fflush(stdout);
    bie_layer_free(train);
    bie_layer_free(infer);
    bie_tensor_free(&x), bie_tensor_free(&y), bie_tensor_free(&gx), bie_tensor_free(&gy);
    bie_tensor_free(&w), bie_tensor_free(&gw);
}

int main(int argc, char **argv) {
    if (bie_cuda_device_count() == 0) {
        fprintf(stderr, "bie_bench_cuda_conv: no CUDA device\n");
        return 0;
    }
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    fprintf(stderr, "bie_bench_cuda_conv: %s, cuDNN %zu\n", p.name, cudnnGetVersion());
    cudnnHandle_t dnn;
    DNN(cudnnCreate(&dnn));
    if (wanted(argc, argv, "cuda_bconv_256_14"))
        conv_case(dnn, "cuda_bconv_256_14", {64, 256, 14, 14, 256, 3, 1, 1});
    if (wanted(argc, argv, "cuda_bconv_128_28"))
        conv_case(dnn, "cuda_bconv_128_28", {64, 128, 28, 28, 128, 3, 1, 1});
    if (wanted(argc, argv, "cuda_bconv_512_7"))
        conv_case(dnn, "cuda_bconv_512_7", {64, 512, 7, 7, 512, 3, 1, 1});
    if (wanted(argc, argv, "cuda_q4conv_256_14"))
        q4conv_case(dnn, "cuda_q4conv_256_14", {64, 256, 14, 14, 256, 3, 1, 1});
    if (wanted(argc, argv, "cuda_q4conv_128_28"))
        q4conv_case(dnn, "cuda_q4conv_128_28", {64, 128, 28, 28, 128, 3, 1, 1});
    if (wanted(argc, argv, "cuda_q4conv_512_7"))
        q4conv_case(dnn, "cuda_q4conv_512_7", {64, 512, 7, 7, 512, 3, 1, 1});
    cudnnDestroy(dnn);
    return 0;
}
