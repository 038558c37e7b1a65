// 4-bit linear and conv2d backward on the device (SPEC §4), from what the forward kept: the
// weight and input codes, the clip bits and the rounding residuals. The float GEMMs run in
// cuBLAS on the codes (exact in every float dtype; the scales enter as alpha, read from
// device memory); the mask and the reductions in our kernels, each of a fixed shape and
// order, so results do not vary from run to run.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>

#include "backward_common.cuh"
#include "cuda_internal.h"
#include "q4_common.cuh"
#include "wgmma_entry.cuh"

namespace bie_cuda {

// Values of the codes of rows of ld bytes (the 4-bit layout, eight codes a 32-bit word, or, I8,
// one int8 code a byte) as T, dst [rows, k]: one thread per eight codes, their values in one
// 16-byte store (two for f32) where `vec` (k % 8 == 0, dst 16-byte aligned); grid-stride.
template <typename T, bool I8>
__global__ void __launch_bounds__(256)
    values_of_codes(const uint8_t *codes, int64_t ld, int64_t rows, int64_t k, bool vec, T *dst) {
    const int64_t per_row = (k + 7) / 8;
    for (int64_t id = (int64_t)blockIdx.x * 256 + threadIdx.x; id < rows * per_row;
         id += (int64_t)gridDim.x * 256) {
        const int64_t r = id / per_row, c0 = (id - r * per_row) * 8;
        T e[8];
        if (I8) {
            const uint2 w = reinterpret_cast<const uint2 *>(codes + r * ld)[c0 >> 3];
            const int8_t *b = reinterpret_cast<const int8_t *>(&w);
#pragma unroll
            for (int j = 0; j < 8; j++) e[j] = from_f32<T>((float)b[j]);
        } else {
            const unsigned w = reinterpret_cast<const unsigned *>(codes + r * ld)[c0 >> 3];
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const int nib = (w >> (4 * j)) & 15;
                e[j] = from_f32<T>((float)nibble_code(nib));
            }
        }
        T *out = dst + r * k + c0;
        if (vec) {
            const uint4 *src = reinterpret_cast<const uint4 *>(e);
#pragma unroll
            for (int q = 0; q < (int)sizeof(e) / 16; q++)
                reinterpret_cast<uint4 *>(out)[q] = src[q];
        } else {
            for (int j = 0; j < 8 && c0 + j < k; j++) out[j] = e[j];
        }
    }
}

template <typename T>
void launch_values(const uint8_t *codes, int64_t ld, bool i8, int64_t rows, int64_t k, T *dst) {
    const int64_t items = rows * ((k + 7) / 8);
    const bool vec = k % 8 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0;
    const unsigned grid = (unsigned)std::min<int64_t>((items + 255) / 256, 1 << 20);
    if (i8)
        values_of_codes<T, true><<<grid, 256, 0, current_stream>>>(codes, ld, rows, k, vec, dst);
    else
        values_of_codes<T, false><<<grid, 256, 0, current_stream>>>(codes, ld, rows, k, vec, dst);
}

// The activation codes' values [m][k] the grad_w product takes: those the training forward
// wrote (a.xval), else made now from the codes into ws.
template <typename T> const T *act_values(const bie_cuda_q4l_backward_args &a, T *ws) {
    if (a.xval) return static_cast<const T *>(a.xval);
    launch_values<T>(a.xcodes, a.ld, a.i8, a.m, a.k, ws);
    return ws;
}

// The transposed values [k][rows] (T, 16-bit) of the code rows (ld bytes; I8: one int8 code a
// byte, else eight codes a 32-bit word), rows a multiple of 8, dst 16-byte aligned: a block per
// 64 x 64 tile, thread t reading 16 codes of row t / 4 (one load), through tile_put and
// tile_store_t (tile_t.cuh).
template <typename T, bool I8>
__global__ void __launch_bounds__(256)
    values_of_codes_t(const uint8_t *codes, int64_t ld, int64_t rows, int64_t k, T *dst) {
    __shared__ T tile[64 * kTilePitch];
    const int t = (int)threadIdx.x, r = t >> 2, c16 = (t & 3) * 16;
    const int64_t r0 = (int64_t)blockIdx.y * 64, c0 = (int64_t)blockIdx.x * 64;
    float v[16];
    if (r0 + r < rows) {
        const uint8_t *row = codes + (r0 + r) * ld;
        if (I8) {
            const uint4 w = *reinterpret_cast<const uint4 *>(row + c0 + c16);
            const int8_t *b = reinterpret_cast<const int8_t *>(&w);
#pragma unroll
            for (int j = 0; j < 16; j++) v[j] = (float)b[j];
        } else {
            const uint2 w = *reinterpret_cast<const uint2 *>(row + (c0 + c16) / 2);
#pragma unroll
            for (int j = 0; j < 16; j++)
                v[j] = (float)nibble_code(((j < 8 ? w.x : w.y) >> (4 * (j & 7))) & 15);
        }
    } else {
#pragma unroll
        for (int j = 0; j < 16; j++) v[j] = 0.0f;
    }
    tile_put(tile, t, v);
    __syncthreads();
    tile_store_t(tile, t, r0, c0, rows, k, dst);
}

// The 4-bit linear backward of a 16-bit layer with grad_x on linear_backward_tma.cu's kernel
// (its 4-bit form): grad_x [m, k] = scale_w grad_out q4(w) with B the weight's values
// transposed [k][n] (T), the clip bits and the sums of grad_x (as stored) and of its products
// with the residuals in the epilogue, which takes the place of the f32 grad_x and the mask pass
// (BIE_CUDA_Q4_FUSED=0: those); grad_w in cuBLAS as below. Where it applies: bf16 / f16, n a
// multiple of 16, k of 256 (the flat clip bits are then rows of k / 8 bytes, a multiple of 32),
// the operands aligned, the kernel usable.
__device__ float kQ4One = 1.0f;  // the kernel's second factor of alpha
bool q4_fused_shape(bie_dtype dtype, int64_t n, int64_t k) {
    static const bool off = env_is("BIE_CUDA_Q4_FUSED", "0");
    return !off && (dtype == BIE_BF16 || dtype == BIE_F16) && n % 16 == 0 && k % 256 == 0 &&
           k <= INT_MAX && bwd_gemm_q4_usable();
}
bool q4_fused_fits(const bie_cuda_q4l_backward_args &a) {
    return q4_fused_shape(a.dtype, a.n, a.k) && a.m <= INT_MAX &&
           reinterpret_cast<uintptr_t>(a.grad_out) % 16 == 0 &&
           reinterpret_cast<uintptr_t>(a.mask) % 16 == 0 &&
           reinterpret_cast<uintptr_t>(a.resid) % 4 == 0 &&
           reinterpret_cast<uintptr_t>(a.wvalt) % 16 == 0;
}

template <typename T>
bie_status q4_fused_typed(const bie_cuda_q4l_backward_args &a, cudaDataType_t ctype) {
    const int64_t m = a.m, n = a.n, k = a.k, parts = bwd_gemm_parts(m);
    // Workspace: weight values transposed [k, n] (unless the forward wrote them, a.wvalt),
    // activation values [m, k] (T), the sums' parts and their dots [parts, k] (f32), the dots'
    // column sums (k doubles).
    Workspace<5> ws;
    BIE_CUDA_TRY(
        ws.alloc({a.wvalt ? 0 : (size_t)(n * k) * sizeof(T),
                  a.xval ? 0 : (size_t)(m * k) * sizeof(T), (size_t)(parts * k) * sizeof(float),
                  (size_t)(parts * k) * sizeof(float), (size_t)k * sizeof(double)},
                 "cudaMallocAsync (4-bit backward workspace)"));
    const T *wvalt = a.wvalt ? static_cast<const T *>(a.wvalt) : ws.at<T>(0);
    float *part_sum = ws.at<float>(2), *part_dot = ws.at<float>(3), *one = nullptr, *zero = nullptr;
    cublasHandle_t h = nullptr;
    bie_status s = check(cudaGetSymbolAddress((void **)&one, kQ4One), "cudaGetSymbolAddress");
    if (s == BIE_OK) s = device_zero(&zero);
    if (s == BIE_OK) s = blas_handle(&h);
    if (s != BIE_OK) return ws.release(s);
    const T *xval = act_values<T>(a, ws.at<T>(1));
    // grad_w, row-major [n, k] = grad_out^T [n, m] @ q4(x') [m, k] * scale_a
    s = blas_check(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, (int)k, (int)n, (int)m, a.saved_scales,
                                xval, ctype, (int)k, a.grad_out, ctype, (int)n, zero, a.grad_w,
                                CUDA_R_32F, (int)k, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                   "cublasGemmEx (4-bit grad_w)");
    if (s != BIE_OK) return ws.release(s);
    const dim3 grid((unsigned)((k + 63) / 64), (unsigned)((n + 63) / 64));
    if (!a.wvalt && a.i8)
        values_of_codes_t<T, true>
            <<<grid, 256, 0, current_stream>>>(a.wcodes, a.ld, n, k, ws.at<T>(0));
    else if (!a.wvalt)
        values_of_codes_t<T, false>
            <<<grid, 256, 0, current_stream>>>(a.wcodes, a.ld, n, k, ws.at<T>(0));
    BwdGemmArgs gx = {};
    gx.op = kOpSame16, gx.M = m, gx.N = k, gx.K = n, gx.a = a.grad_out, gx.b = wvalt;
    gx.s0 = a.saved_scales + 1, gx.s1 = one, gx.out = a.grad_x;
    gx.out_type = out_type_of(a.dtype);
    gx.mask = a.mask, gx.ld = k / 8, gx.resid = a.resid;
    gx.part_sum = part_sum, gx.part_dot = part_dot;
    s = bwd_gemm_tma_launch(gx);
    // grad_scale_a = sum of grad_x * resid / 254 over sqrt(7 m k)
    if (s == BIE_OK)
        linear_part_sums(part_sum, part_dot, parts, k,
                         std::sqrt((double)m * (double)k * 7.0) * 254.0, ws.at<double>(4),
                         a.grad_bias, a.grad_scale_a);
    if (s == BIE_OK) s = check(cudaGetLastError(), "4-bit linear backward kernels");
    return ws.release(s);
}

template <typename T>
bie_status q4_backward_typed(const bie_cuda_q4l_backward_args &a, cudaDataType_t ctype) {
    if (q4_fused_fits(a)) return q4_fused_typed<T>(a, ctype);
    const int64_t m = a.m, n = a.n, k = a.k;
    const MaskPass p = mask_pass_shape(m, k, true);
    // Workspace: weight values [n, k], activation values [m, k] (T), grad_x before the mask
    // [m, k] (f32), the mask pass's dot partials and column partial sums.
    Workspace<5> ws;
    BIE_CUDA_TRY(ws.alloc({(size_t)(n * k) * sizeof(T), a.xval ? 0 : (size_t)(m * k) * sizeof(T),
                           (size_t)(m * k) * sizeof(float), p.dot_bytes, p.col_bytes},
                          "cudaMallocAsync (4-bit backward workspace)"));
    T *wval = ws.at<T>(0);
    const T *xval = nullptr;
    float *g = ws.at<float>(2);

    bie_status s = BIE_OK;
    float *zero = nullptr;
    cublasHandle_t h = nullptr;
    if ((s = device_zero(&zero)) != BIE_OK) goto done;
    if ((s = blas_handle(&h)) != BIE_OK) goto done;
    launch_values<T>(a.wcodes, a.ld, a.i8, n, k, wval);
    xval = act_values<T>(a, ws.at<T>(1));
    // grad_x (before the mask), row-major [m, k] = grad_out [m, n] @ q4(w) [n, k] * scale_w
    s = blas_check(
        cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, (int)k, (int)m, (int)n, a.saved_scales + 1, wval,
                     ctype, (int)k, a.grad_out, ctype, (int)n, zero, g, CUDA_R_32F, (int)k,
                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx (4-bit grad_x)");
    if (s != BIE_OK) goto done;
    // grad_w, row-major [n, k] = grad_out^T [n, m] @ q4(x') [m, k] * scale_a
    s = blas_check(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, (int)k, (int)n, (int)m, a.saved_scales,
                                xval, ctype, (int)k, a.grad_out, ctype, (int)n, zero, a.grad_w,
                                CUDA_R_32F, (int)k, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                   "cublasGemmEx (4-bit grad_w)");
    if (s != BIE_OK) goto done;
    // grad_scale_a = sum of grad_x * resid / 254 over sqrt(7 m k): the pass sums grad_x * resid.
    s = mask_pass(p, g, m, k, MaskBits{a.mask, nullptr, 0, a.resid}, static_cast<T *>(a.grad_x),
                  ws.at<double>(3), ws.at<double>(4),
                  std::sqrt((double)m * (double)k * 7.0) * 254.0, a.grad_bias, a.grad_scale_a);
    if (s == BIE_OK) s = check(cudaGetLastError(), "4-bit linear backward kernels");
done:
    return ws.release(s);
}

// ---- conv2d: conv2d_weight and conv2d_input as two GEMMs over the im2col of the saved
// codes, then a gather col2im that applies the clip bits, and per-plane reductions.

// X [c k k][n oh ow]: the code under each tap of each output pixel, 0 outside the input.
// Block (pixel block, channel): neighbouring threads write neighbouring pixels. 32-bit index
// math (the layer checks the extents), no division per element. KF: the kernel size fixed at
// compile time (0: from the shape), so that the taps' loads unroll.
template <typename T, int KF>
__global__ void __launch_bounds__(256)
    q4_conv_value_cols(const uint8_t *__restrict__ codes, bie_conv_geom g64, T *__restrict__ dst) {
    const int k = KF ? KF : (int)g64.k, kk = k * k, h = (int)g64.h, w = (int)g64.w,
              ow = (int)g64.ow;
    const int plane = (int)(g64.oh * g64.ow), rows = (int)g64.n * plane, d = (int)g64.d;
    const int r = blockIdx.x * 256 + threadIdx.x;
    if (r >= rows) return;
    const int n = r / plane, pix = r - n * plane, oy = pix / ow, ox = pix - oy * ow;
    const int y0 = oy * (int)g64.s - (int)g64.p, x0 = ox * (int)g64.s - (int)g64.p;
    for (int c = blockIdx.y; c < (int)g64.c; c += gridDim.y) {
        const int64_t img = ((int64_t)n * g64.c + c) * h * w;
        T *out = dst + (int64_t)c * kk * rows + r;
#pragma unroll
        for (int i = 0; i < k; i++) {
            const int iy = y0 + i * d;
#pragma unroll
            for (int j = 0; j < k; j++) {
                const int ix = x0 + j * d, t = i * k + j;
                const bool inside = iy >= 0 && iy < h && ix >= 0 && ix < w;
                const float v = inside ? (float)code_at(codes, img + iy * w + ix) : 0.0f;
                out[(int64_t)t * rows] = from_f32<T>(v);
            }
        }
    }
}

// The clip bit of an element from the flat NCHW mask bits (conv_col2im_mask).
struct FlatMask {
    const uint8_t *bits;
    __device__ bool operator()(int, int, int, int64_t at) const {
        return (bits[at >> 3] >> (at & 7)) & 1;
    }
};

// One warp per (n, c) plane of gm: its sum and its sum of gm * resid / 254, in double.
__global__ void __launch_bounds__(256)
    q4_conv_plane_sums(const float *gm, const int8_t *resid, int64_t planes, int64_t hw,
                       double *plane_sum, double *plane_dot) {
    const int lane = threadIdx.x & 31;
    const int64_t nc = (int64_t)blockIdx.x * 8 + (threadIdx.x >> 5);
    if (nc >= planes) return;
    double sum = 0, dot = 0;
    for (int64_t pix = lane; pix < hw; pix += 32) {
        const float v = gm[nc * hw + pix];
        sum += v;
        dot += (double)v * (double)resid[nc * hw + pix] / 254.0;
    }
    for (int o = 16; o > 0; o >>= 1) {
        sum += __shfl_down_sync(0xffffffffu, sum, o);
        dot += __shfl_down_sync(0xffffffffu, dot, o);
    }
    if (lane == 0) {
        plane_sum[nc] = sum;
        plane_dot[nc] = dot;
    }
}

template <typename T>
bie_status q4_conv_backward_typed(const bie_cuda_q4conv_backward_args &a, cudaDataType_t ctype) {
    cudaStream_t st = current_stream;
    const bie_conv_geom &g = a.g;
    const int64_t K = g.c * g.k * g.k, rows = g.n * g.oh * g.ow, planes = g.n * g.c, hw = g.h * g.w;
    // Workspace: weight values [o, K], code columns [K, rows] and gradient rows [o, rows] (T),
    // grad columns [K, rows] (f32), per-plane sums and dots, masked grad_x (f32).
    Workspace<6> ws;
    BIE_CUDA_TRY(
        ws.alloc({(size_t)(g.o * K) * sizeof(T), (size_t)(rows * K) * sizeof(T),
                  (size_t)(g.o * rows) * sizeof(T), (size_t)(rows * K) * sizeof(float),
                  (size_t)(2 * planes) * sizeof(double), (size_t)(planes * hw) * sizeof(float)},
                 "cudaMallocAsync (4-bit conv backward workspace)"));
    T *wval = ws.at<T>(0), *xcols = ws.at<T>(1);
    T *grows = ws.at<T>(2);
    float *gcols = ws.at<float>(3), *gm = ws.at<float>(5);
    double *plane_sum = ws.at<double>(4), *plane_dot = plane_sum + planes;

    bie_status s = BIE_OK;
    float *zero = nullptr;
    cublasHandle_t h = nullptr;
    if ((s = device_zero(&zero)) != BIE_OK) goto done;
    if ((s = blas_handle(&h)) != BIE_OK) goto done;
    launch_values<T>(a.wcodes, a.ld, false, g.o, K, wval);
    (g.k == 3
         ? q4_conv_value_cols<T, 3>
         : q4_conv_value_cols<
               T,
               0>)<<<dim3((unsigned)((rows + 255) / 256), (unsigned)std::min<int64_t>(g.c, 65535)),
                     256, 0, st>>>(a.codes, g, xcols);
    conv_grad_rows_any(a.dtype, a.grad_out, g, grows);
    // grad_w, row-major [o, K] = G [o, rows] @ X^T (X row-major [K, rows]) * scale_a
    s = blas_check(
        cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, (int)K, (int)g.o, (int)rows, a.saved_scales,
                     xcols, ctype, (int)rows, grows, ctype, (int)rows, zero, a.grad_w, CUDA_R_32F,
                     (int)K, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx (4-bit conv grad_w)");
    if (s != BIE_OK) goto done;
    // grad columns, row-major [K, rows] = q4(w)^T [K, o] @ G [o, rows] * scale_w
    s = blas_check(
        cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, (int)rows, (int)K, (int)g.o, a.saved_scales + 1,
                     grows, ctype, (int)rows, wval, ctype, (int)K, zero, gcols, CUDA_R_32F,
                     (int)rows, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx (4-bit conv grad_x)");
    if (s != BIE_OK) goto done;
    {
        launch_conv_col2im_mask(gcols, FlatMask{a.mask}, g, static_cast<T *>(a.grad_x), gm);
        q4_conv_plane_sums<<<(unsigned)((planes + 7) / 8), 256, 0, st>>>(gm, a.resid, planes, hw,
                                                                         plane_sum, plane_dot);
    }
    conv_bias_scale_sums(plane_sum, plane_dot, g.n, g.c,
                         std::sqrt((double)planes * (double)hw * 7.0), a.grad_bias, a.grad_scale_a);
    s = check(cudaGetLastError(), "4-bit conv2d backward kernels");
done:
    return ws.release(s);
}

}  // namespace bie_cuda

using namespace bie_cuda;

// BIE_CUDA_Q4_WVALUES=0: the backward makes the weight's values itself (values_of_codes_t).
extern "C" bool bie_cuda_q4_weight_values_wanted(bie_dtype dtype, const float *w, int64_t n,
                                                 int64_t k) {
    static const bool off = env_is("BIE_CUDA_Q4_WVALUES", "0");
    return !off && q4_fused_shape(dtype, n, k) && n / 64 < 65535 &&
           reinterpret_cast<uintptr_t>(w) % 16 == 0;
}

extern "C" bie_status bie_cuda_q4_linear_backward(const bie_cuda_q4l_backward_args *args) {
    switch (args->dtype) {
    case BIE_F32: return q4_backward_typed<float>(*args, CUDA_R_32F);
    case BIE_BF16: return q4_backward_typed<__nv_bfloat16>(*args, CUDA_R_16BF);
    case BIE_F16: return q4_backward_typed<__half>(*args, CUDA_R_16F);
    default:
        return bie_fail(BIE_ERR_DTYPE, "cuda 4-bit backward: dtype %s",
                        bie_dtype_name(args->dtype));
    }
}

extern "C" bie_status bie_cuda_q4_conv2d_backward(const bie_cuda_q4conv_backward_args *args) {
    bie_status s;
    if (q4_conv_backward_tma(*args, &s)) return s;
    switch (args->dtype) {
    case BIE_F32: return q4_conv_backward_typed<float>(*args, CUDA_R_32F);
    case BIE_BF16: return q4_conv_backward_typed<__nv_bfloat16>(*args, CUDA_R_16BF);
    case BIE_F16: return q4_conv_backward_typed<__half>(*args, CUDA_R_16F);
    default:
        return bie_fail(BIE_ERR_DTYPE, "cuda 4-bit conv backward: dtype %s",
                        bie_dtype_name(args->dtype));
    }
}
