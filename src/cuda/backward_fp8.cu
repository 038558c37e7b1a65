// The opt-in FP8 backward products of the binary linear layer (bie_layer_set_backward_mode):
// grad_x before the mask and grad_w on e4m3 tensor cores through cuBLASLt. The ±1 operands
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

#include "backward_common.cuh"
#include "cuda_internal.h"

namespace bie_cuda {
namespace {

constexpr size_t kLtWorkspace = (size_t)32 << 20;
__device__ float kFp8One = 1.0f;

__device__ __forceinline__ uint8_t to_e4m3(float v) {
    return (uint8_t)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}

// scales[0] = 448 / amax (amax = part[0]; 1 when grad_out is all zero), scales[1] = its
// inverse, the factor the GEMMs apply to the e4m3 operand.
__global__ void fp8_scales(const float *part, float *scales) {
    const float a = part[0];
    const bool some = a > 0.0f && isfinite(a);
    scales[0] = some ? 448.0f / a : 1.0f;
    scales[1] = some ? a / 448.0f : 1.0f;
}

// grad_out [m, n] (T) -> e4m3 of grad_out * scales[0], as [m, n] (g8) and [n, m] (g8t): a
// 32 x 32 tile per block through shared memory, both writes coalesced.
template <typename T>
__global__ void __launch_bounds__(256)
    fp8_quantize(const T *g, int64_t m, int64_t n, const float *scales, uint8_t *g8, uint8_t *g8t) {
    __shared__ uint8_t tile[32][33];
    const float s = scales[0];
    const int64_t r0 = (int64_t)blockIdx.y * 32, c0 = (int64_t)blockIdx.x * 32;
    const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    for (int r = ty; r < 32; r += 8) {
        const int64_t row = r0 + r, col = c0 + tx;
        if (row < m && col < n) {
            const uint8_t q = to_e4m3(to_f32(g[row * n + col]) * s);
            g8[row * n + col] = q;
            tile[r][tx] = q;
        }
    }
    __syncthreads();
    for (int c = ty; c < 32; c += 8) {
        const int64_t col = c0 + c, row = r0 + tx;
        if (row < m && col < n) g8t[col * m + row] = tile[tx][c];
    }
}

// Sign bits of `rows` layout rows (ld bytes; bit j of row r: element (r, j), j < k) -> the
// transposed ±1 matrix [k, rows] in e4m3 (0x38 = 1, 0xb8 = -1). Block: 32 rows x one 32-bit
// word of columns; thread t writes 4 consecutive rows of column t / 8.
__global__ void __launch_bounds__(256)
    fp8_signs_t(const uint8_t *bits, int64_t ld, int64_t rows, int64_t k, uint8_t *out) {
    __shared__ uint32_t words[32];
    const int64_t r0 = (int64_t)blockIdx.y * 32, w = blockIdx.x;
    if (threadIdx.x < 32) {
        const int64_t r = r0 + threadIdx.x;
        words[threadIdx.x] = r < rows ? reinterpret_cast<const uint32_t *>(bits + r * ld)[w] : 0u;
    }
    __syncthreads();
    const int j = threadIdx.x >> 3, i0 = (threadIdx.x & 7) * 4;
    const int64_t col = w * 32 + j;
    if (col >= k) return;
    uint8_t v[4];
#pragma unroll
    for (int e = 0; e < 4; e++) v[e] = (words[i0 + e] >> j) & 1 ? 0x38 : 0xb8;
    uint8_t *dst = out + col * rows + r0 + i0;
    if (r0 + i0 + 4 <= rows && (reinterpret_cast<uintptr_t>(dst) & 3) == 0) {
        *reinterpret_cast<uint32_t *>(dst) =
            v[0] | (uint32_t)v[1] << 8 | (uint32_t)v[2] << 16 | (uint32_t)v[3] << 24;
    } else {
        for (int e = 0; e < 4; e++)
            if (r0 + i0 + e < rows) dst[e] = v[e];
    }
}

thread_local cublasLtHandle_t lt = nullptr;

bie_status lt_check(cublasStatus_t s, const char *what) {
    return s == CUBLAS_STATUS_SUCCESS
               ? BIE_OK
               : bie_fail(BIE_ERR_CUDA, "%s failed (cuBLASLt status %d)", what, (int)s);
}

// D [mo rows of ld mo, no columns] (column-major, f32) = *alpha * *scale_b * A^T B, with A
// stored [kr, mo] and B [kr, no] (column-major, e4m3, K-major both). *ok is false where
// cuBLASLt offers no FP8 algorithm for the shape (nothing is launched then).
bie_status lt_fp8_gemm(int64_t mo, int64_t no, int64_t kr, const uint8_t *a, const uint8_t *b,
                       const float *alpha, const float *zero, const float *scale_b, float *d,
                       void *workspace, bool *ok) {
    *ok = false;
    if (lt == nullptr) BIE_CUDA_TRY(lt_check(cublasLtCreate(&lt), "cublasLtCreate"));
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
    cublasLtMatmulPreference_t pref = nullptr;
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    const cublasLtPointerMode_t pm = CUBLASLT_POINTER_MODE_DEVICE;
    const float *one = nullptr;
    size_t ws = kLtWorkspace;
    cublasLtMatmulHeuristicResult_t heur = {};
    int found = 0;
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
        s = lt_check(cublasLtMatrixLayoutCreate(&ld, CUDA_R_32F, (uint64_t)mo, (uint64_t)no, mo),
                     "cublasLtMatrixLayoutCreate");
    if (s == BIE_OK)
        s = lt_check(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
    if (s == BIE_OK)
        s = lt_check(cublasLtMatmulPreferenceSetAttribute(
                         pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws),
                     "cublasLtMatmulPreferenceSetAttribute");
    if (s == BIE_OK && cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, ld, ld, pref, 1, &heur,
                                                      &found) != CUBLAS_STATUS_SUCCESS)
        found = 0;
    if (s == BIE_OK && found > 0) {
        s = lt_check(cublasLtMatmul(lt, desc, alpha, a, la, b, lb, zero, d, ld, d, ld, &heur.algo,
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

template <typename T>
bie_status fp8_products_typed(const bie_cuda_bl_backward_args &a, float *g, bool *done) {
    const int64_t m = a.m, n = a.n, k = a.k;
    Workspace<7> ws;
    BIE_CUDA_TRY(ws.alloc({(size_t)(m * n), (size_t)(m * n), (size_t)(k * n), (size_t)(k * m),
                           amax_workspace_bytes(), 2 * sizeof(float), kLtWorkspace},
                          "cudaMallocAsync (fp8 backward workspace)"));
    uint8_t *g8 = ws.at<uint8_t>(0), *g8t = ws.at<uint8_t>(1);
    uint8_t *swt = ws.at<uint8_t>(2), *sxt = ws.at<uint8_t>(3);
    float *part = ws.at<float>(4), *scales = ws.at<float>(5);
    float *zero = nullptr;
    bie_status s = device_zero(&zero);
    if (s != BIE_OK) return ws.release(s);
    cudaStream_t st = current_stream;
    const T *go = static_cast<const T *>(a.grad_out);
    amax_into(go, m * n, part);
    fp8_scales<<<1, 1, 0, st>>>(part, scales);
    fp8_quantize<T><<<dim3((unsigned)((n + 31) / 32), (unsigned)((m + 31) / 32)), 256, 0, st>>>(
        go, m, n, scales, g8, g8t);
    const unsigned words = (unsigned)((k + 31) / 32);
    fp8_signs_t<<<dim3(words, (unsigned)((n + 31) / 32)), 256, 0, st>>>(a.wbits, a.ld, n, k, swt);
    fp8_signs_t<<<dim3(words, (unsigned)((m + 31) / 32)), 256, 0, st>>>(a.signs, a.ld, m, k, sxt);
    s = check(cudaGetLastError(), "fp8 backward kernels");
    bool ok_x = false, ok_w = false;
    // grad_x before the mask, row-major [m, k] (column-major [k, m]) = scale_w sign(w)^T-major
    // x grad_out: A = sign(w) as [k][n] (K = n), B = grad_out as [m][n].
    if (s == BIE_OK)
        s = lt_fp8_gemm(k, m, n, swt, g8, a.saved_scales + 1, zero, scales + 1, g,
                        ws.at<uint8_t>(6), &ok_x);
    // grad_w, row-major [n, k] = scale_a grad_out^T sign(x'): A = sign(x') as [k][m] (K = m),
    // B = grad_out^T as [n][m].
    if (s == BIE_OK && ok_x)
        s = lt_fp8_gemm(k, n, m, sxt, g8t, a.saved_scales, zero, scales + 1, a.grad_w,
                        ws.at<uint8_t>(6), &ok_w);
    *done = s == BIE_OK && ok_x && ok_w;
    return ws.release(s);
}

}  // namespace

bool fp8_backward_fits(const bie_cuda_bl_backward_args &a) {
    return a.fp8 && a.m % 16 == 0 && a.n % 16 == 0 && a.k % 16 == 0 && device_cc() >= 89;
}

bie_status fp8_backward_products(const bie_cuda_bl_backward_args &a, float *g, bool *done) {
    switch (a.dtype) {
    case BIE_F32: return fp8_products_typed<float>(a, g, done);
    case BIE_BF16: return fp8_products_typed<__nv_bfloat16>(a, g, done);
    default: return fp8_products_typed<__half>(a, g, done);
    }
}

}  // namespace bie_cuda

extern "C" bool bie_cuda_fp8_usable(int device) {
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    return major * 10 + minor >= 89;
}
