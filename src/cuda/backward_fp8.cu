// The opt-in FP8 backward products of the binary linear layer (bie_layer_set_backward_mode):
// grad_x and grad_w on e4m3 tensor cores, on Hopper through linear_backward_tma.cu's kernels
// (the mask, its sums and grad_w's amax in their epilogues), elsewhere through cuBLASLt (grad_x
// before the mask; the mask pass follows in backward.cu). The ±1 operands
// are exact in e4m3; grad_out is rounded once to e4m3 after scaling by 448 / amax(grad_out)
// (its largest magnitude becomes e4m3's largest finite value), and the GEMMs multiply the
// result back by amax / 448. cuBLASLt's FP8 kernels want both operands K-major ("TN"), so
// the kernels here write the ±1 operands transposed from the sign bits and grad_out both as
// it lies and transposed.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "backward_common.cuh"
#include "cuda_internal.h"
#include "dtype.cuh"
#include "epilogue.cuh"
#include "wgmma_entry.cuh"

namespace bie_cuda {
namespace {

constexpr size_t kLtWorkspace = (size_t)32 << 20;
__device__ float kFp8One = 1.0f;

// scales[1] = 448 / amax (amax = part[0]; 1 when grad_out is all zero), scales[0] = its
// inverse, the factor the GEMMs apply to the e4m3 operand. That one comes first: cuBLASLt
// refuses (NOT_SUPPORTED) a B scale pointer one float past an aligned one.
constexpr int kQTile = 64, kQPitch = kQTile + 4;

// grad_out [m, n] (T; m, n multiples of 16) -> e4m3 of grad_out * scales[1], as [m, n] (g8)
// and [n, m] (g8t): a 64 x 64 tile per block through shared memory; each thread loads 16
// elements of a row and stores 16 bytes of g8, then gathers 16 rows of a column for one
// 16-byte store of g8t. vec: grad_out 16-byte aligned.
template <typename T>
__global__ void __launch_bounds__(256)
    fp8_quantize(const T *g, int64_t m, int64_t n, bool vec, const float *part, float *scales,
                 uint8_t *g8, uint8_t *g8t) {
    static_assert(kAmaxBlocks == 256, "a block reduces the partial maxima");
    __shared__ __align__(16) uint8_t tile[kQTile][kQPitch];
    const float s = fp8_scale_of_partials(part, scales);
    const int64_t r0 = (int64_t)blockIdx.y * kQTile, c0 = (int64_t)blockIdx.x * kQTile;
    const int a = threadIdx.x >> 2, b = (threadIdx.x & 3) * 16;
    if (r0 + a < m && c0 + b < n) {
        float v[16];
        load_n(g + (r0 + a) * n + c0 + b, vec, 16, v);
        uint32_t q[4];
#pragma unroll
        for (int i = 0; i < 4; i++)
            q[i] = to_e4m3(v[4 * i] * s) | (uint32_t)to_e4m3(v[4 * i + 1] * s) << 8 |
                   (uint32_t)to_e4m3(v[4 * i + 2] * s) << 16 |
                   (uint32_t)to_e4m3(v[4 * i + 3] * s) << 24;
        *reinterpret_cast<uint4 *>(g8 + (r0 + a) * n + c0 + b) = make_uint4(q[0], q[1], q[2], q[3]);
#pragma unroll
        for (int i = 0; i < 4; i++) reinterpret_cast<uint32_t *>(&tile[a][b])[i] = q[i];
    }
    __syncthreads();
    // Transposed: column a of the tile, rows b .. b + 16.
    if (c0 + a < n && r0 + b < m) {
        uint32_t q[4] = {0, 0, 0, 0};
#pragma unroll
        for (int i = 0; i < 16; i++) q[i / 4] |= (uint32_t)tile[b + i][a] << (8 * (i % 4));
        *reinterpret_cast<uint4 *>(g8t + (c0 + a) * m + r0 + b) =
            make_uint4(q[0], q[1], q[2], q[3]);
    }
}

// Sign bits of `rows` layout rows (bit j of row r: element (r, j), j < k; ld bytes) -> the
// transposed ±1 matrix [k, rows] of ES-byte elements (pos / neg: the bits of +1 / -1; rows a
// multiple of 16 / ES). Block: kSignRows rows x kSignWords 32-bit words of columns (256
// columns). The block's words are read first (eight threads a row: 32 contiguous bytes) into
// shared memory; then each thread makes R = 16 / ES consecutive rows of one column a step (one
// 16-byte store), kSignRows / R steps. A warp's step: 8 columns of one word x 4 R rows (8
// runs of 64 contiguous bytes), its four row chunks R rows apart, which sign_at spreads over
// banks. 64 rows a block rather than 128 (twice the blocks in flight): 12.1 -> 10.0 us for the
// e4m3 form of 4096 x 4096 signs on an H200, the 16-bit form unchanged (14.6 / 14.5); a warp
// per 32 x 32 bit block transposed by shuffles (each lane then writing one column's 32 rows)
// took 16.2 / 32.9.
constexpr int kSignWords = 8, kSignRows = 64;
__device__ __forceinline__ int sign_at(int i, int wd) { return i * (kSignWords + 1) + wd + i / 32; }
template <int ES>
__global__ void __launch_bounds__(256)
    signs_t(const uint8_t *bits, int64_t ld, int64_t rows, int64_t k, uint32_t pos, uint32_t neg,
            uint8_t *out) {
    constexpr int R = 16 / ES, CH = kSignRows / R;  // rows a store, row chunks a block
    static_assert(CH % 4 == 0, "four row chunks a warp step");
    __shared__ uint32_t words[kSignRows * (kSignWords + 1) + kSignRows / 32];
    const int64_t r0 = (int64_t)blockIdx.y * kSignRows, w0 = (int64_t)blockIdx.x * kSignWords;
    const int64_t row_words = (k + 31) / 32;
#pragma unroll
    for (int q = 0; q < kSignRows * kSignWords / 256; q++) {
        const int id = q * 256 + (int)threadIdx.x, i = id / kSignWords, wd = id % kSignWords;
        const int64_t r = r0 + i, w = w0 + wd;
        words[sign_at(i, wd)] =
            r < rows && w < row_words ? reinterpret_cast<const uint32_t *>(bits + r * ld)[w] : 0u;
    }
    __syncthreads();
    const int lane = (int)threadIdx.x & 31;
#pragma unroll
    for (int q = 0; q < CH; q++) {
        const int t = q * 8 + ((int)threadIdx.x >> 5);  // 32 column groups x CH / 4 row groups
        const int j = (t / (CH / 4)) * 8 + (lane & 7);
        const int i0 = ((t % (CH / 4)) * 4 + (lane >> 3)) * R;
        const int64_t col = w0 * 32 + j;
        if (col >= k || r0 + i0 >= rows) continue;
        uint32_t v[4] = {0, 0, 0, 0};
#pragma unroll
        for (int e = 0; e < R; e++)
            v[e * ES / 4] |= ((words[sign_at(i0 + e, j / 32)] >> (j % 32)) & 1 ? pos : neg)
                             << (8 * ES * (e % (4 / ES)));
        *reinterpret_cast<uint4 *>(out + (col * rows + r0 + i0) * ES) =
            make_uint4(v[0], v[1], v[2], v[3]);
    }
}

// signs_t on the current stream: a block per kSignRows rows and kSignWords words of columns.
template <int ES>
void launch_signs_t(const uint8_t *bits, int64_t ld, int64_t rows, int64_t k, uint32_t pos,
                    uint32_t neg, uint8_t *out) {
    const unsigned words = (unsigned)((k + 32 * kSignWords - 1) / (32 * kSignWords));
    signs_t<ES>
        <<<dim3(words, (unsigned)((rows + kSignRows - 1) / kSignRows)), 256, 0, current_stream>>>(
            bits, ld, rows, k, pos, neg, out);
}

thread_local cublasLtHandle_t lt = nullptr;

bie_status lt_check(cublasStatus_t s, const char *what) {
    return s == CUBLAS_STATUS_SUCCESS
               ? BIE_OK
               : bie_fail(BIE_ERR_CUDA, "%s failed (cuBLASLt status %d)", what, (int)s);
}

// The algorithm cuBLASLt's heuristic chose for a shape, kept per thread (the query costs
// host time on every backward call otherwise): a few recent shapes, replaced in turn.
struct LtPlan {
    int device = -1;
    cudaDataType_t dtype = CUDA_R_32F;
    int64_t mo = 0, no = 0, kr = 0;
    uint32_t align_d = 0;
    bool found = false;
    cublasLtMatmulAlgo_t algo = {};
};
constexpr int kLtPlans = 8;
thread_local LtPlan lt_plans[kLtPlans];
thread_local int lt_plan_next = 0;

// The heuristic's first kLtCandidates algorithms for a shape are timed once (a warm-up and a
// timed run each on the current stream, CUDA events, the host waiting: once per shape and
// thread) and the fastest is kept, unless the stream is being captured into a graph (no waits
// allowed there: the heuristic's first is kept) or BIE_CUDA_LT_TUNE=0.
constexpr int kLtCandidates = 8;
template <typename Run>
bie_status fastest_algo(const cublasLtMatmulHeuristicResult_t *heur, int found, Run run,
                        int *best) {
    *best = 0;
    static const bool tune = !env_is("BIE_CUDA_LT_TUNE", "0");
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    if (!tune || cudaStreamIsCapturing(current_stream, &cap) != cudaSuccess ||
        cap != cudaStreamCaptureStatusNone) {
        cudaGetLastError();
        return BIE_OK;
    }
    cudaEvent_t ev[2] = {nullptr, nullptr};
    bie_status s = check(cudaEventCreate(&ev[0]), "cudaEventCreate");
    if (s == BIE_OK) s = check(cudaEventCreate(&ev[1]), "cudaEventCreate");
    float best_ms = 0;
    for (int i = 0; i < found && s == BIE_OK; i++) {
        if (heur[i].state != CUBLAS_STATUS_SUCCESS) continue;
        if (run(&heur[i].algo) != CUBLAS_STATUS_SUCCESS) continue;  // warm-up; skip refusals
        s = check(cudaEventRecord(ev[0], current_stream), "cudaEventRecord");
        const bool ran = run(&heur[i].algo) == CUBLAS_STATUS_SUCCESS;
        if (s == BIE_OK) s = check(cudaEventRecord(ev[1], current_stream), "cudaEventRecord");
        if (s == BIE_OK) s = check(cudaEventSynchronize(ev[1]), "cudaEventSynchronize");
        float ms = 0;
        if (s == BIE_OK) s = check(cudaEventElapsedTime(&ms, ev[0], ev[1]), "cudaEventElapsedTime");
        if (s == BIE_OK && ran && (best_ms == 0 || ms < best_ms)) best_ms = ms, *best = i;
    }
    for (cudaEvent_t e : ev)
        if (e) cudaEventDestroy(e);
    return s;
}

// The largest power of two (at most 256) that divides the address: the alignment the
// heuristic is told D has (its default is 256 bytes, and an algorithm chosen for that need
// not accept a less aligned D).
uint32_t alignment_of(const void *p) {
    const uintptr_t v = reinterpret_cast<uintptr_t>(p) | 256u;
    return (uint32_t)(v & (~v + 1));
}

// D [mo rows of ld mo, no columns] (column-major, of type dtype: f32, bf16 or f16) = *alpha *
// *scale_b * A^T B, with A stored [kr, mo] and B [kr, no] (column-major, e4m3, K-major both;
// 256-byte aligned). *ok is false where cuBLASLt offers no FP8 algorithm for the shape
// (nothing is launched then).
bie_status lt_fp8_gemm(int64_t mo, int64_t no, int64_t kr, const uint8_t *a, const uint8_t *b,
                       const float *alpha, const float *zero, const float *scale_b,
                       cudaDataType_t dtype, void *d, void *workspace, bool *ok) {
    *ok = false;
    if (lt == nullptr) BIE_CUDA_TRY(lt_check(cublasLtCreate(&lt), "cublasLtCreate"));
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
    cublasLtMatmulPreference_t pref = nullptr;
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    const cublasLtPointerMode_t pm = CUBLASLT_POINTER_MODE_DEVICE;
    const float *one = nullptr;
    size_t ws = kLtWorkspace;
    bie_status s = check(cudaGetSymbolAddress((void **)&one, kFp8One), "cudaGetSymbolAddress");
    auto set = [&](cublasLtMatmulDescAttributes_t attr, const void *v, size_t size) {
        if (s == BIE_OK)
            s = lt_check(cublasLtMatmulDescSetAttribute(desc, attr, v, size),
                         "cublasLtMatmulDescSetAttribute");
    };
    if (s == BIE_OK)
        s = lt_check(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                     "cublasLtMatmulDescCreate");
    set(CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta);
    set(CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb);
    set(CUBLASLT_MATMUL_DESC_POINTER_MODE, &pm, sizeof pm);
    set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &one, sizeof one);
    set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_b, sizeof scale_b);
    if (s == BIE_OK)
        s = lt_check(
            cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, (uint64_t)kr, (uint64_t)mo, kr),
            "cublasLtMatrixLayoutCreate");
    if (s == BIE_OK)
        s = lt_check(
            cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, (uint64_t)kr, (uint64_t)no, kr),
            "cublasLtMatrixLayoutCreate");
    if (s == BIE_OK)
        s = lt_check(cublasLtMatrixLayoutCreate(&ld, dtype, (uint64_t)mo, (uint64_t)no, mo),
                     "cublasLtMatrixLayoutCreate");
    int dev = -1;
    if (s == BIE_OK) s = check(cudaGetDevice(&dev), "cudaGetDevice");
    const uint32_t align_d = alignment_of(d);
    LtPlan *plan = nullptr;
    for (LtPlan &p : lt_plans)
        if (p.device == dev && p.dtype == dtype && p.mo == mo && p.no == no && p.kr == kr &&
            p.align_d == align_d)
            plan = &p;
    if (s == BIE_OK && plan == nullptr) {
        s = lt_check(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
        auto pset = [&](cublasLtMatmulPreferenceAttributes_t attr, const void *v, size_t size) {
            if (s == BIE_OK)
                s = lt_check(cublasLtMatmulPreferenceSetAttribute(pref, attr, v, size),
                             "cublasLtMatmulPreferenceSetAttribute");
        };
        pset(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
        pset(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_d, sizeof align_d);
        pset(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d, sizeof align_d);
        cublasLtMatmulHeuristicResult_t heur[kLtCandidates] = {};
        int found = 0;
        if (s == BIE_OK &&
            cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, ld, ld, pref, kLtCandidates, heur,
                                           &found) != CUBLAS_STATUS_SUCCESS)
            found = 0;
        int best = 0;
        if (s == BIE_OK && found > 1)
            s = fastest_algo(
                heur, found,
                [&](const cublasLtMatmulAlgo_t *algo) {
                    return cublasLtMatmul(lt, desc, alpha, a, la, b, lb, zero, d, ld, d, ld, algo,
                                          workspace, ws, current_stream);
                },
                &best);
        if (s == BIE_OK) {
            plan = &lt_plans[lt_plan_next];
            lt_plan_next = (lt_plan_next + 1) % kLtPlans;
            *plan = LtPlan{dev, dtype, mo, no, kr, align_d, found > 0, heur[best].algo};
        }
    }
    if (s == BIE_OK && plan->found) {
        s = lt_check(cublasLtMatmul(lt, desc, alpha, a, la, b, lb, zero, d, ld, d, ld, &plan->algo,
                                    workspace, ws, current_stream),
                     "cublasLtMatmul (fp8)");
        *ok = s == BIE_OK;
    }
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (ld) cublasLtMatrixLayoutDestroy(ld);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (desc) cublasLtMatmulDescDestroy(desc);
    return s;
}

// The ±1 weight transposed [k][n] of bytes-byte values that the training forward wrote, or NULL.
const void *forward_signs(const bie_cuda_bl_backward_args &a, int bytes) {
    return a.wsignt_bytes == bytes ? a.wsignt : nullptr;
}

// grad_out's e4m3 copies g8 [m, n] and g8t [n, m] (with grad_out's amax partials part and
// the scales: scales[0] the dequantization factor) and the transposed ±1 operands: the weight's
// [k, n] into ws (unless the training forward wrote it), *swt set to where it is, and sxt [k, m],
// on the current stream.
template <typename T>
void fp8_operands(const bie_cuda_bl_backward_args &a, float *part, float *scales, uint8_t *g8,
                  uint8_t *g8t, uint8_t *ws, const uint8_t **swt, uint8_t *sxt) {
    const int64_t m = a.m, n = a.n, k = a.k;
    cudaStream_t st = current_stream;
    const T *go = static_cast<const T *>(a.grad_out);
    amax_partials(go, m * n, part);
    const bool vec = reinterpret_cast<uintptr_t>(go) % 16 == 0;
    fp8_quantize<T>
        <<<dim3((unsigned)((n + kQTile - 1) / kQTile), (unsigned)((m + kQTile - 1) / kQTile)), 256,
           0, st>>>(go, m, n, vec, part, scales, g8, g8t);
    *swt = static_cast<const uint8_t *>(forward_signs(a, 1));
    if (!*swt) {
        launch_signs_t<1>(a.wbits, a.ld, n, k, 0x38u, 0xb8u, ws);
        *swt = ws;
    }
    launch_signs_t<1>(a.signs, a.ld, m, k, 0x38u, 0xb8u, sxt);
}

// The products in cuBLASLt: grad_x before the mask into g (ctype: T's, so one rounding, the
// one the masked grad_x had anyway, and half the bytes of f32 for 16-bit layers; the mask
// pass's sums then add those values) and grad_w.
template <typename T>
bie_status fp8_products_typed(const bie_cuda_bl_backward_args &a, cudaDataType_t ctype, void *g,
                              bool *done) {
    const int64_t m = a.m, n = a.n, k = a.k;
    Workspace<7> ws;
    BIE_CUDA_TRY(
        ws.alloc({(size_t)(m * n), (size_t)(m * n), forward_signs(a, 1) ? 0 : (size_t)(k * n),
                  (size_t)(k * m), amax_workspace_bytes(), 2 * sizeof(float), kLtWorkspace},
                 "cudaMallocAsync (fp8 backward workspace)"));
    uint8_t *g8 = ws.at<uint8_t>(0), *g8t = ws.at<uint8_t>(1), *sxt = ws.at<uint8_t>(3);
    const uint8_t *swt = nullptr;
    float *scales = ws.at<float>(5);
    float *zero = nullptr;
    bie_status s = device_zero(&zero);
    if (s != BIE_OK) return ws.release(s);
    fp8_operands<T>(a, ws.at<float>(4), scales, g8, g8t, ws.at<uint8_t>(2), &swt, sxt);
    s = check(cudaGetLastError(), "fp8 backward kernels");
    bool ok_x = false, ok_w = false;
    // grad_x before the mask, row-major [m, k] (column-major [k, m]) = scale_w sign(w)^T-major
    // x grad_out: A = sign(w) as [k][n] (K = n), B = grad_out as [m][n].
    if (s == BIE_OK)
        s = lt_fp8_gemm(k, m, n, swt, g8, a.saved_scales + 1, zero, scales, ctype, g,
                        ws.at<uint8_t>(6), &ok_x);
    // grad_w, row-major [n, k] = scale_a grad_out^T sign(x'): A = sign(x') as [k][m] (K = m),
    // B = grad_out^T as [n][m].
    if (s == BIE_OK && ok_x)
        s = lt_fp8_gemm(k, n, m, sxt, g8t, a.saved_scales, zero, scales, CUDA_R_32F, a.grad_w,
                        ws.at<uint8_t>(6), &ok_w);
    *done = s == BIE_OK && ok_x && ok_w;
    return ws.release(s);
}

// BIE_CUDA_LINEAR_SIDE=1: grad_w's int8 quantization (into q, of grad_w [count]) as the side
// job of grad_x's kernel gx, by the partial maxima part where sync is NULL, else by an amax
// found there too (sync: a counter of the workspace, zeroed here). Returns whether gx takes it
// (else the passes of their own follow gx). Exact, but slower at 4096^3 on an H200: the
// kernel's three epilogue warps do it at a few GB/s an SM, and grad_x's kernel took 236
// against 181 us (exact, amax and quantization) and 175 against 107 (FP8, the quantization),
// where the passes take 19 + 21.5 and 24 us.
bool side_quantization(BwdGemmArgs &gx, const float *grad_w, int64_t count, int8_t *q, float *part,
                       unsigned *sync) {
    static const bool on = env_is("BIE_CUDA_LINEAR_SIDE", "1");
    if (q == nullptr || !on) return false;
    gx.side_x = grad_w, gx.side_q = q, gx.side_n = count, gx.side_part = part;
    gx.side_sync = sync;
    if (!bwd_gemm_side_taken(gx)) {
        gx.side_q = nullptr;
        return false;
    }
    if (sync) (void)cudaMemsetAsync(sync, 0, sizeof(unsigned), current_stream);
    return true;
}

// The whole backward on the kernels of linear_backward_tma.cu: grad_w with its amax partials
// in the first product's epilogue, grad_x with the mask and its sums in the second's, then the
// column sums' final pass and grad_w's int8 quantization (BIE_CUDA_LINEAR_SIDE=1: the side
// job of grad_x's kernel).
template <typename T> bie_status fp8_fused_typed(const bie_cuda_bl_backward_args &a) {
    const int64_t m = a.m, n = a.n, k = a.k, parts = bwd_gemm_parts(m);
    Workspace<9> ws;
    BIE_CUDA_TRY(
        ws.alloc({(size_t)(m * n), (size_t)(m * n), forward_signs(a, 1) ? 0 : (size_t)(k * n),
                  (size_t)(k * m), amax_workspace_bytes(), 2 * sizeof(float),
                  (size_t)(parts * k) * sizeof(float), (size_t)(parts * k) * sizeof(float),
                  (size_t)k * sizeof(double) + amax_workspace_bytes()},
                 "cudaMallocAsync (fp8 backward workspace)"));
    uint8_t *g8 = ws.at<uint8_t>(0), *g8t = ws.at<uint8_t>(1), *sxt = ws.at<uint8_t>(3);
    const uint8_t *swt = nullptr;
    float *scales = ws.at<float>(5), *part_sum = ws.at<float>(6), *part_dot = ws.at<float>(7);
    double *dots = ws.at<double>(8);
    float *wamax = reinterpret_cast<float *>(dots + k);
    fp8_operands<T>(a, ws.at<float>(4), scales, g8, g8t, ws.at<uint8_t>(2), &swt, sxt);
    bie_status s = check(cudaGetLastError(), "fp8 backward kernels");
    // grad_w [n, k] = scale_a grad_out^T sign(x'): A = grad_out^T [n][m], B = sign(x') as [k][m].
    BwdGemmArgs gw = {};
    gw.M = n, gw.N = k, gw.K = m, gw.a = g8t, gw.b = sxt;
    gw.s0 = a.saved_scales, gw.s1 = scales;
    gw.out = a.grad_w, gw.out_type = kOutF32, gw.amax_part = wamax;
    if (s == BIE_OK) s = bwd_gemm_tma_launch(gw);
    // BIE_CUDA_LINEAR_QORDER=1: the quantization while grad_w's last tiles are in L2
    static const bool early = quantize_after_product();
    const bool quantized = s == BIE_OK && a.grad_w_i8 && early;
    if (quantized) quantize_i8_partials(a.grad_w, n * k, wamax, a.grad_w_i8, true);
    // grad_x [m, k] = scale_w grad_out sign(w): A = grad_out [m][n], B = sign(w) as [k][n]
    BwdGemmArgs gx = {};
    gx.M = m, gx.N = k, gx.K = n, gx.a = g8, gx.b = swt;
    gx.s0 = a.saved_scales + 1, gx.s1 = scales, gx.out = a.grad_x;
    gx.out_type = out_type_of(a.dtype);
    gx.mask = a.mask, gx.signs = a.signs, gx.ld = a.ld, gx.part_sum = part_sum;
    gx.part_dot = part_dot;
    const bool side =
        !quantized && side_quantization(gx, a.grad_w, n * k, a.grad_w_i8, wamax, nullptr);
    if (s == BIE_OK) s = bwd_gemm_tma_launch(gx);
    if (s == BIE_OK)
        linear_part_sums(part_sum, part_dot, parts, k, std::sqrt((double)m * (double)k), dots,
                         a.grad_bias, a.grad_scale_a);
    if (s == BIE_OK && a.grad_w_i8 && !side && !quantized)
        quantize_i8_partials(a.grad_w, n * k, wamax, a.grad_w_i8);
    if (s == BIE_OK) s = check(cudaGetLastError(), "fp8 backward kernels");
    return ws.release(s);
}

// The exact backward of a 16-bit layer with grad_x on linear_backward_tma.cu's kernel:
// grad_x [m, k] = scale_w grad_out sign(w) with A = grad_out [m][n] as it lies and B = sign(w)
// from a ±1 matrix [k][n] in T written first (BIE_CUDA_LINEAR_BITS=1: made in each stage by
// the consumers from the weight's sign bits, exact too but slower: 262 against 182 + 13 us at
// 4096^3 on an H200, the consumers' writes in the products' path), the mask and its sums in the
// epilogue (of the values as stored, as a 16-bit grad_x tensor sums); grad_w before it, on
// linear_wgrad_tma.cu's kernel (the forms below), then its int8 quantization
// (BIE_CUDA_LINEAR_SIDE=1: the side job of grad_x's kernel).
template <typename T> bie_status exact_fused_typed(const bie_cuda_bl_backward_args &a) {
    const int64_t m = a.m, n = a.n, k = a.k, parts = bwd_gemm_parts(m);
    static const bool on_chip = exact_on_chip();
    // grad_w (BIE_CUDA_LINEAR_WGRAD): by default on linear_wgrad_tma.cu's kernel from a ±1
    // activation matrix, its amax in the epilogue (181 against 174 + 21 us of cuBLAS and the
    // amax pass at 4096^3 on an H200); "1", that kernel from the sign bits (exact too but
    // slower: 204); "cublas", cuBLAS on the ±1 activations, then the amax pass
    static const int wgrad_form = env_is("BIE_CUDA_LINEAR_WGRAD", "cublas") ? 0
                                  : env_is("BIE_CUDA_LINEAR_WGRAD", "1")    ? 1
                                                                            : 2;
    const bool own = wgrad_form > 0 && linear_wgrad16_usable(), wgrad_mem = own && wgrad_form == 2;
    // ±1 weight [k][n] (unless on chip), the sums' parts, their dots, amax parts, side counter,
    // ±1 activations [m][k] (for grad_w's own kernel from memory)
    Workspace<7> ws;
    BIE_CUDA_TRY(ws.alloc({on_chip || forward_signs(a, 2) ? 0 : (size_t)(k * n) * sizeof(T),
                           (size_t)(parts * k) * sizeof(float), (size_t)(parts * k) * sizeof(float),
                           (size_t)k * sizeof(double), amax_workspace_bytes(), sizeof(unsigned),
                           wgrad_mem ? (size_t)(m * k) * sizeof(T) : 0},
                          "cudaMallocAsync (backward workspace)"));
    T *wst = ws.at<T>(0);
    float *part_sum = ws.at<float>(1), *part_dot = ws.at<float>(2), *one = nullptr;
    float *wamax = ws.at<float>(4);
    bie_status s = check(cudaGetSymbolAddress((void **)&one, kFp8One), "cudaGetSymbolAddress");
    if (s != BIE_OK) return ws.release(s);
    constexpr bool half = std::is_same<T, __half>::value;
    BwdGemmArgs gx = {};
    gx.op = kOpBits16, gx.M = m, gx.N = k, gx.K = n, gx.a = a.grad_out, gx.b = a.wbits;
    gx.ldb = a.ld;
    gx.s0 = a.saved_scales + 1, gx.s1 = one, gx.out = a.grad_x;
    gx.out_type = out_type_of(a.dtype);
    gx.mask = a.mask, gx.signs = a.signs, gx.ld = a.ld, gx.part_sum = part_sum;
    gx.part_dot = part_dot;
    // BIE_CUDA_LINEAR_QORDER=1: grad_w quantized right after its own kernel (amax partials
    // from its epilogue), while its last tiles are in L2
    static const bool after = quantize_after_product();
    const bool early = after && own && a.grad_w_i8;
    const bool side = !early && side_quantization(gx, a.grad_w, n * k, a.grad_w_i8, wamax,
                                                  own ? nullptr : ws.at<unsigned>(5));
    if (own) {
        WgradArgs wa = {half,           m,        n,     k,      a.grad_out, a.signs, a.ld,
                        a.saved_scales, a.grad_w, wamax, nullptr};
        if (wgrad_mem) {
            expand_signs<T>(a.signs, a.ld, m, k, ws.at<T>(6));
            wa.xsign = ws.at<T>(6);
        }
        s = linear_wgrad16_launch(wa);
        if (s == BIE_OK && early) quantize_i8_partials(a.grad_w, n * k, wamax, a.grad_w_i8, true);
    } else {
        s = exact_grad_w<T>(a);
    }
    if (s == BIE_OK && !on_chip && forward_signs(a, 2)) {  // by the training forward
        gx.op = kOpSame16, gx.b = forward_signs(a, 2);
    } else if (s == BIE_OK && !on_chip) {
        launch_signs_t<2>(a.wbits, a.ld, n, k, half ? 0x3c00u : 0x3f80u, half ? 0xbc00u : 0xbf80u,
                          reinterpret_cast<uint8_t *>(wst));
        gx.op = kOpSame16, gx.b = wst;
    }
    if (s == BIE_OK) s = bwd_gemm_tma_launch(gx);
    if (s == BIE_OK)
        linear_part_sums(part_sum, part_dot, parts, k, std::sqrt((double)m * (double)k),
                         ws.at<double>(3), a.grad_bias, a.grad_scale_a);
    if (s == BIE_OK && a.grad_w_i8 && !side && !early) {
        if (own)
            quantize_i8_partials(a.grad_w, n * k, wamax, a.grad_w_i8);
        else
            quantize_grad_i8(a.grad_w, n * k, wamax, a.grad_w_i8);
    }
    if (s == BIE_OK) s = check(cudaGetLastError(), "binary linear backward kernels");
    return ws.release(s);
}

}  // namespace

bool exact_fused_fits(const bie_cuda_bl_backward_args &a) {
    return (a.dtype == BIE_BF16 || a.dtype == BIE_F16) && a.n % 16 == 0 && a.k % 16 == 0 &&
           reinterpret_cast<uintptr_t>(a.grad_out) % 16 == 0 && fp8_backward_fused_usable();
}

bie_status exact_backward_fused(const bie_cuda_bl_backward_args &a) {
    return a.dtype == BIE_BF16 ? exact_fused_typed<__nv_bfloat16>(a) : exact_fused_typed<__half>(a);
}

bool exact_on_chip() { return env_is("BIE_CUDA_LINEAR_BITS", "1"); }

bool fp8_backward_fits(const bie_cuda_bl_backward_args &a) {
    return a.fp8 && a.m % 16 == 0 && a.n % 16 == 0 && a.k % 16 == 0 && device_cc() >= 89;
}

bie_status fp8_backward_products(const bie_cuda_bl_backward_args &a, cudaDataType_t ctype, void *g,
                                 bool *done) {
    switch (a.dtype) {
    case BIE_F32: return fp8_products_typed<float>(a, ctype, g, done);
    case BIE_BF16: return fp8_products_typed<__nv_bfloat16>(a, ctype, g, done);
    default: return fp8_products_typed<__half>(a, ctype, g, done);
    }
}

bool fp8_backward_fused_usable() {
    static const bool wanted = !env_is("BIE_CUDA_LINEAR_FUSED", "0");
    return wanted && bwd_gemm_tma_usable();
}

bie_status fp8_backward_fused(const bie_cuda_bl_backward_args &a) {
    switch (a.dtype) {
    case BIE_F32: return fp8_fused_typed<float>(a);
    case BIE_BF16: return fp8_fused_typed<__nv_bfloat16>(a);
    default: return fp8_fused_typed<__half>(a);
    }
}

}  // namespace bie_cuda

extern "C" int bie_cuda_weight_signs_bytes(bie_dtype dtype, const int8_t *w, int64_t n, int64_t k,
                                           int64_t ld, bool fp8) {
    static const bool on = bie_cuda::env_is("BIE_CUDA_LINEAR_WSIGNS", "1");
    if (!on || !w || reinterpret_cast<uintptr_t>(w) % 16 || ld != k / 8 ||
        !bie_cuda_weight_signs_shape(n, k))
        return 0;
    if (fp8) return bie_cuda::device_cc() >= 89 ? 1 : 0;  // fp8_operands' swt
    // exact_fused_typed's ±1 weight, unless it makes B on chip
    return (dtype == BIE_BF16 || dtype == BIE_F16) && bie_cuda::fp8_backward_fused_usable() &&
                   !bie_cuda::exact_on_chip()
               ? 2
               : 0;
}

extern "C" bool bie_cuda_fp8_usable(int device) {
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    return major * 10 + minor >= 89;
}
