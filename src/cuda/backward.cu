// Binary linear backward on the device (SPEC §2), from the packed sign and clip-mask bits the
// forward kept: the two float GEMMs in cuBLAS on ±1 operands (the scales enter as alpha, read
// from device memory), the mask, the reductions and the int8 quantization in our kernels.
// Every reduction has a fixed shape and order, so results do not vary from run to run.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <type_traits>

#include "backward_common.cuh"
#include "cuda_internal.h"

namespace bie_cuda {

__device__ __forceinline__ bool bit_at(const uint8_t *row, int64_t c) {
    return (row[c >> 3] >> (c & 7)) & 1;
}

// ±1 from packed sign bits, dst [rows, k] from layout rows of ld bytes: one thread per 16
// bytes of dst (E = 16 / sizeof(T) columns, from E bits of one word), so that a warp's stores
// are 512 contiguous bytes; grid-stride; element stores where the rows are not 16-byte
// aligned.
template <typename T>
__global__ void __launch_bounds__(256)
    signs_of_words(const uint8_t *bits, int64_t ld, int64_t rows, int64_t k, bool vec, T *dst) {
    constexpr int E = 16 / sizeof(T);
    const int64_t per_row = (k + E - 1) / E;
    for (int64_t id = (int64_t)blockIdx.x * 256 + threadIdx.x; id < rows * per_row;
         id += (int64_t)gridDim.x * 256) {
        const int64_t r = id / per_row, c0 = (id - r * per_row) * E;
        const unsigned b = reinterpret_cast<const unsigned *>(bits + r * ld)[c0 >> 5] >> (c0 & 31);
        T *out = dst + r * k + c0;
        if (vec && k - c0 >= E) {
            uint4 raw;
            T *e = reinterpret_cast<T *>(&raw);
#pragma unroll
            for (int j = 0; j < E; j++) e[j] = from_f32<T>((b >> j) & 1 ? 1.0f : -1.0f);
            *reinterpret_cast<uint4 *>(out) = raw;
        } else {
            for (int j = 0; j < E && c0 + j < k; j++)
                out[j] = from_f32<T>((b >> j) & 1 ? 1.0f : -1.0f);
        }
    }
}

// p[0 .. min(V, left)) = v in T: one store of V values where `vec` (16 bytes, or 8 for four
// 16-bit values).
template <typename T, int V>
__device__ __forceinline__ void store_n(T *p, bool vec, int64_t left, const float (&v)[V]) {
    static_assert(V * sizeof(T) == 16 || V * sizeof(T) == 8, "one 8- or 16-byte store");
    if (vec && left >= V) {
        if constexpr (sizeof(T) == 4) {
            *reinterpret_cast<float4 *>(p) = make_float4(v[0], v[1], v[2], v[3]);
        } else {
            unsigned w[V / 2];
#pragma unroll
            for (int j = 0; j < V / 2; j++)
                w[j] = (unsigned)bits_of(from_f32<T>(v[2 * j])) |
                       (unsigned)bits_of(from_f32<T>(v[2 * j + 1])) << 16;
            if constexpr (V == 8)
                *reinterpret_cast<uint4 *>(p) = make_uint4(w[0], w[1], w[2], w[3]);
            else
                *reinterpret_cast<uint2 *>(p) = make_uint2(w[0], w[1]);
        }
    } else {
#pragma unroll
        for (int e = 0; e < V; e++)
            if (e < left) p[e] = from_f32<T>(v[e]);
    }
}

// A lane's columns of one row of g as loaded: four f32 values; eight 16-bit values kept
// packed in one 16-byte register quad until used (the same bytes a load, in fewer registers).
template <typename G> struct LaneVals {
    static constexpr int V = 8;
    uint4 raw;
    __device__ __forceinline__ void clear() { raw = make_uint4(0u, 0u, 0u, 0u); }
    __device__ __forceinline__ void load(const G *p, bool vec, int64_t left) {
        if (vec && left >= V) {
            raw = __ldg(reinterpret_cast<const uint4 *>(p));
            return;
        }
        unsigned h[V] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int e = 0; e < V && e < left; e++)
            h[e] = __ldg(reinterpret_cast<const unsigned short *>(p) + e);
        raw =
            make_uint4(h[0] | h[1] << 16, h[2] | h[3] << 16, h[4] | h[5] << 16, h[6] | h[7] << 16);
    }
    __device__ __forceinline__ float at(int e) const {
        const unsigned w = e < 2 ? raw.x : e < 4 ? raw.y : e < 6 ? raw.z : raw.w;
        const unsigned bits = (e & 1) ? w >> 16 : w & 0xffffu;
        if constexpr (std::is_same<G, __half>::value)
            return __half2float(__ushort_as_half((unsigned short)bits));
        else
            return __uint_as_float(bits << 16);  // bfloat16: the high half of a float
    }
};
template <> struct LaneVals<float> {
    static constexpr int V = 4;
    float v[4];
    __device__ __forceinline__ void clear() { v[0] = v[1] = v[2] = v[3] = 0.0f; }
    __device__ __forceinline__ void load(const float *p, bool vec, int64_t left) {
        load_n(p, vec, left, v);
    }
    __device__ __forceinline__ float at(int e) const { return v[e]; }
};
// Columns a lane of the mask pass takes: 4 of f32 g, 8 of 16-bit g (16 bytes a row either way).
template <typename G> __host__ __device__ constexpr int mask_lane_cols() { return LaneVals<G>::V; }

// The clip mask applied to g [m, k] (grad_x before the mask, G: f32, or the layer's 16-bit type
// where the FP8 products wrote it) and everything the backward reduces from it, in one pass. A
// lane owns V = mask_lane_cols<G>() columns (16 bytes of a row of g), a warp 32 V, a block 256 V:
// block (x, y) covers columns 256 V x .. and row group y of gridDim.y (rows y m / gridDim.y ..
// (y + 1) m / gridDim.y); warp w owns the columns 256 V x + 32 V w .., lane l those from
// c = .. + V l, and walks every row of the group, kMaskRows rows a step with all their loads
// issued first (a warp's load of a row is 512 contiguous bytes of g). The mask and sign bits of
// a lane's columns are V bits of one 32-bit word of the row. Writes grad_x (if asked), the
// group's column sums col_part[y][c] (double, each lane summing its rows in order) and the
// block's sum of grad_x * sign(x') dot_part[y][x] (its lanes' sums added in a fixed order).
// Q4 (the 4-bit layers, f32 g): the clip bits are flat over the m k elements (bit r k + c), and
// the dot is of grad_x with the rounding residuals resid [m, k] instead, each product exact in
// double (the caller divides by 254); a lane's four clip bits come from one byte and its four
// residuals from one 4-byte load where vec_r (k % 4 == 0, resid 4-byte aligned).
constexpr int kMaskRows = 8;
template <typename T, typename G, bool Q4>
__global__ void __launch_bounds__(256)
    mask_reduce(const G *__restrict__ g, int64_t m, int64_t k, int64_t ld,
                const uint8_t *__restrict__ mask, const uint8_t *__restrict__ signs,
                const int8_t *__restrict__ resid, bool vec_g, bool vec_x, bool vec_r,
                T *__restrict__ grad_x, double *__restrict__ col_part,
                double *__restrict__ dot_part) {
    constexpr int V = mask_lane_cols<G>(), R = kMaskRows;
    static_assert(!Q4 || V == 4, "the 4-bit form reads f32 g");
    using Dot = std::conditional_t<Q4, double, float>;
    __shared__ double dots[256];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t c = (int64_t)blockIdx.x * (256 * V) + 32 * V * warp + V * lane, left = k - c;
    const int64_t y = blockIdx.y;
    const int64_t r0 = y * m / gridDim.y, r1 = (y + 1) * m / gridDim.y;
    double col[V], dot = 0.0;
#pragma unroll
    for (int e = 0; e < V; e++) col[e] = 0.0;
    if (left > 0) {
        const int64_t w = c >> 5;
        const int sh = (int)(c & 31);
        for (int64_t r = r0; r < r1; r += R) {
            LaneVals<G> q[R];
            unsigned mb[R], sb[R];
            int rs[R][4];
#pragma unroll
            for (int i = 0; i < R; i++) {
                const int64_t row = r + i;
                mb[i] = sb[i] = 0u;
                q[i].clear();
#pragma unroll
                for (int e = 0; e < 4; e++) rs[i][e] = 0;
                if (row >= r1) continue;
                q[i].load(g + row * k + c, vec_g, left);
                if constexpr (Q4) {
                    const int64_t at = row * k + c;
                    if (vec_r && left >= 4) {
                        mb[i] = (unsigned)mask[at >> 3] >> (at & 7);  // at % 4 == 0: one byte
                        const char4 qr = *reinterpret_cast<const char4 *>(resid + at);
                        rs[i][0] = qr.x, rs[i][1] = qr.y, rs[i][2] = qr.z, rs[i][3] = qr.w;
                    } else {
                        for (int e = 0; e < 4 && e < left; e++) {
                            mb[i] |= (unsigned)bit_at(mask, at + e) << e;
                            rs[i][e] = resid[at + e];
                        }
                    }
                } else {
                    mb[i] = reinterpret_cast<const unsigned *>(mask + row * ld)[w] >> sh;
                    sb[i] = reinterpret_cast<const unsigned *>(signs + row * ld)[w] >> sh;
                }
            }
#pragma unroll
            for (int i = 0; i < R; i++) {
                if (r + i >= r1) break;
                Dot rowdot = 0;
                float v[V];
#pragma unroll
                for (int e = 0; e < V; e++) {
                    const bool on = (mb[i] >> e) & 1;
                    v[e] = on ? q[i].at(e) : 0.0f;
                    if constexpr (Q4) {
                        if (on) rowdot += (double)v[e] * (double)rs[i][e];
                    } else {
                        rowdot += (sb[i] >> e) & 1 ? v[e] : -v[e];
                    }
                    col[e] += v[e];
                }
                dot += rowdot;
                if (grad_x) store_n<T, V>(grad_x + (r + i) * k + c, vec_x, left, v);
            }
        }
#pragma unroll
        for (int e = 0; e < V; e++)
            if (e < left) col_part[y * k + c + e] = col[e];
    }
    dots[threadIdx.x] = dot;
    __syncthreads();
    for (int o = 128; o > 0; o >>= 1) {
        if ((int)threadIdx.x < o) dots[threadIdx.x] += dots[threadIdx.x + o];
        __syncthreads();
    }
    if (threadIdx.x == 0) dot_part[y * gridDim.x + blockIdx.x] = dots[0];
}

// out[c] = the sum of the parts partial column sums part[y][c] (the mask pass's row groups,
// the conv backward's images): block b sums columns 32 b .. 32 b + 31 (lane = column, a
// warp's loads 256 contiguous bytes), warp j the parts j, j + 8, ... in order, then the eight
// shares in warp order.
__global__ void __launch_bounds__(256)
    col_sums_final(const double *part, int64_t parts, int64_t k, float *out) {
    __shared__ double sh[8][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t c = (int64_t)blockIdx.x * 32 + lane;
    double s = 0;
    for (int64_t y = warp; y < parts && c < k; y += 8) s += part[y * k + c];
    sh[warp][lane] = s;
    __syncthreads();
    if (warp == 0 && c < k) {
        double t = 0;
        for (int j = 0; j < 8; j++) t += sh[j][lane];
        out[c] = (float)t;
    }
}

// The fused linear backward's per-part column sums (float, [parts][k] each): grad_bias[c] =
// the sum of part_sum[.][c], dots[c] = that of part_dot[.][c], each in double and a fixed
// order (block b: columns 32 b ..; warp j: the parts j, j + 8, ..; then the warps in order).
__global__ void __launch_bounds__(256)
    part_col_sums(const float *part_sum, const float *part_dot, int64_t parts, int64_t k,
                  float *grad_bias, double *dots) {
    __shared__ double sh[2][8][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t c = (int64_t)blockIdx.x * 32 + lane;
    double s = 0, t = 0;
    for (int64_t y = warp; y < parts && c < k; y += 8)
        s += part_sum[y * k + c], t += part_dot[y * k + c];
    sh[0][warp][lane] = s;
    sh[1][warp][lane] = t;
    __syncthreads();
    if (warp == 0 && c < k) {
        double a = 0, b = 0;
        for (int j = 0; j < 8; j++) a += sh[0][j][lane], b += sh[1][j][lane];
        grad_bias[c] = (float)a;
        dots[c] = b;
    }
}

// grad_scale_a = sum(row_dot) / sqrt(m k), one block of 1024 threads (more loads in
// flight), fixed order.
__global__ void __launch_bounds__(1024)
    scale_grad(const double *row_dot, int64_t m, double denom, float *out) {
    __shared__ double sh[1024];
    double s = 0;
    for (int64_t i = threadIdx.x; i < m; i += 1024) s += row_dot[i];
    sh[threadIdx.x] = s;
    __syncthreads();
    for (int o = 512; o > 0; o >>= 1) {
        if ((int)threadIdx.x < o) sh[threadIdx.x] += sh[threadIdx.x + o];
        __syncthreads();
    }
    if (threadIdx.x == 0) *out = (float)(sh[0] / denom);
}

// Per-tensor int8 quantization (SPEC §1): amax over a fixed grid (kAmaxBlocks partial maxima,
// each block's kAmaxThreads threads reading 16 bytes a step where `vec`), then
// q = rint(v * 127 / amax).
template <typename T>
__global__ void __launch_bounds__(kAmaxThreads)
    amax_partial(const T *__restrict__ x, int64_t n, bool vec, float *__restrict__ part) {
    constexpr int V = 16 / sizeof(T);
    const int64_t stride = (int64_t)kAmaxBlocks * kAmaxThreads,
                  first = (int64_t)blockIdx.x * kAmaxThreads + threadIdx.x;
    float a = 0;
    int64_t i = first;
    if (vec) {
        for (; i < n / V; i += stride) {
            const uint4 u = reinterpret_cast<const uint4 *>(x)[i];
            const T *e = reinterpret_cast<const T *>(&u);
#pragma unroll
            for (int j = 0; j < V; j++) a = fmaxf(a, fabsf(to_f32(e[j])));
        }
        i = n / V * V + first;
    }
    for (; i < n; i += stride) a = fmaxf(a, fabsf(to_f32(x[i])));
    a = block_max<kAmaxThreads>(a);
    if (threadIdx.x == 0) part[blockIdx.x] = a;
}
// q = quantization of x with the amax that is the largest of the kAmaxBlocks partial maxima
// in part (each block reduces them itself: no pass between); four elements per step when
// `vec`, their groups from the last to the first where `reverse` (the end of x first).
__global__ void __launch_bounds__(kAmaxBlocks)
    quantize_i8(const float *x, int64_t n, const float *part, bool vec, bool reverse, int8_t *q) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    // vec: four 16-byte loads a thread in flight, the next four issued before these are
    // stored (the first ones during the amax)
    const int64_t n4 = vec ? n / 4 : 0;
    auto pos = [&](int64_t at) { return reverse ? n4 - 1 - at : at; };
    float4 v[4];
    auto load = [&](int64_t at) {
#pragma unroll
        for (int u = 0; u < 4; u++)
            v[u] = at + u * stride < n4
                       ? __ldg(reinterpret_cast<const float4 *>(x) + pos(at + u * stride))
                       : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    };
    load(i);
    const float amax = block_max<kAmaxBlocks>(part[threadIdx.x]), inv = 1.0f / amax;
    for (; i < n4; i += 4 * stride) {
        float4 cur[4];
#pragma unroll
        for (int u = 0; u < 4; u++) cur[u] = v[u];
        load(i + 4 * stride);
#pragma unroll
        for (int u = 0; u < 4; u++) {
            if (i + u * stride >= n4) break;
            char4 o;
            o.x = quantize_one(cur[u].x, amax, inv);
            o.y = quantize_one(cur[u].y, amax, inv);
            o.z = quantize_one(cur[u].z, amax, inv);
            o.w = quantize_one(cur[u].w, amax, inv);
            reinterpret_cast<char4 *>(q)[pos(i + u * stride)] = o;
        }
    }
    for (i = n4 * 4 + (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        q[i] = quantize_one(x[i], amax, inv);
}

__device__ float kZero = 0.0f;

// One cuBLAS handle per thread (handles are not thread-safe), bound to the current stream.
thread_local cublasHandle_t blas = nullptr;

bie_status blas_check(cublasStatus_t s, const char *what) {
    if (s == CUBLAS_STATUS_SUCCESS) return BIE_OK;
    return bie_fail(BIE_ERR_CUDA, "%s: cuBLAS status %d", what, (int)s);
}

bie_status blas_handle(cublasHandle_t *out) {
    if (blas == nullptr) BIE_CUDA_TRY(blas_check(cublasCreate(&blas), "cublasCreate"));
    BIE_CUDA_TRY(blas_check(cublasSetStream(blas, current_stream), "cublasSetStream"));
    BIE_CUDA_TRY(
        blas_check(cublasSetPointerMode(blas, CUBLAS_POINTER_MODE_DEVICE), "cublasSetPointerMode"));
    *out = blas;
    return BIE_OK;
}

bie_status device_zero(float **out) {
    return check(cudaGetSymbolAddress((void **)out, kZero), "cudaGetSymbolAddress");
}

void sum_over(const double *parts, int64_t count, double denom, float *out) {
    scale_grad<<<1, 1024, 0, current_stream>>>(parts, count, denom, out);
}

static unsigned grid_for(int64_t count) {
    int64_t b = (count + 255) / 256;
    return (unsigned)(b < 65535 ? (b > 0 ? b : 1) : 65535);
}

void linear_part_sums(const float *part_sum, const float *part_dot, int64_t parts, int64_t k,
                      double denom, double *dots, float *grad_bias, float *grad_scale_a) {
    part_col_sums<<<(unsigned)((k + 31) / 32), 256, 0, current_stream>>>(part_sum, part_dot, parts,
                                                                         k, grad_bias, dots);
    sum_over(dots, k, denom, grad_scale_a);
}

size_t amax_workspace_bytes() { return kAmaxBlocks * sizeof(float); }

template <typename T> void amax_partials(const T *x, int64_t n, float *part) {
    amax_partial<T><<<kAmaxBlocks, kAmaxThreads, 0, current_stream>>>(
        x, n, reinterpret_cast<uintptr_t>(x) % 16 == 0, part);
}
template void amax_partials<float>(const float *, int64_t, float *);
template void amax_partials<__nv_bfloat16>(const __nv_bfloat16 *, int64_t, float *);
template void amax_partials<__half>(const __half *, int64_t, float *);

void quantize_i8_partials(const float *x, int64_t n, const float *partials, int8_t *q,
                          bool reverse) {
    const bool vec = (reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(q)) % 16 == 0;
    const int64_t steps = vec ? n / 4 : n;
    quantize_i8<<<std::min(grid_for(steps), 2048u), kAmaxBlocks, 0, current_stream>>>(
        x, n, partials, vec, reverse, q);
}

bool quantize_after_product() { return env_is("BIE_CUDA_LINEAR_QORDER", "1"); }

void quantize_grad_i8(const float *x, int64_t n, float *workspace, int8_t *q) {
    amax_partials(x, n, workspace);
    quantize_i8_partials(x, n, workspace, q);
}

template <typename T> cudaDataType_t blas_type() {
    return std::is_same<T, float>::value           ? CUDA_R_32F
           : std::is_same<T, __nv_bfloat16>::value ? CUDA_R_16BF
                                                   : CUDA_R_16F;
}

// ±1 rows [rows, k] of T from layout sign rows.
template <typename T>
void expand_signs(const uint8_t *bits, int64_t ld, int64_t rows, int64_t k, T *dst) {
    const int64_t chunks = (k * (int64_t)sizeof(T) + 15) / 16;  // signs_of_words's per row
    signs_of_words<T><<<grid_for(rows * chunks), 256, 0, current_stream>>>(
        bits, ld, rows, k, rows_aligned16<T>(dst, k), dst);
}
template void expand_signs<__nv_bfloat16>(const uint8_t *, int64_t, int64_t, int64_t,
                                          __nv_bfloat16 *);
template void expand_signs<__half>(const uint8_t *, int64_t, int64_t, int64_t, __half *);

// grad_w, row-major [n, k] = grad_out^T [n, m] @ sign(x') [m, k] * scale_a (xsign: the ±1
// activations [m, k] in T, expanded here), in cuBLAS.
template <typename T>
bie_status grad_w_product(cublasHandle_t h, const bie_cuda_bl_backward_args &a, T *xsign,
                          const float *zero) {
    const cudaDataType_t ctype = blas_type<T>();
    expand_signs<T>(a.signs, a.ld, a.m, a.k, xsign);
    return blas_check(
        cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, (int)a.k, (int)a.n, (int)a.m, a.saved_scales,
                     xsign, ctype, (int)a.k, a.grad_out, ctype, (int)a.n, zero, a.grad_w,
                     CUDA_R_32F, (int)a.k, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx (grad_w)");
}

template <typename T> bie_status exact_grad_w(const bie_cuda_bl_backward_args &a) {
    Workspace<1> ws;  // ±1 activations [m, k] (T)
    BIE_CUDA_TRY(
        ws.alloc({(size_t)(a.m * a.k) * sizeof(T)}, "cudaMallocAsync (backward workspace)"));
    cublasHandle_t h = nullptr;
    float *zero = nullptr;
    bie_status s = blas_handle(&h);
    if (s == BIE_OK) s = device_zero(&zero);
    if (s == BIE_OK) s = grad_w_product<T>(h, a, ws.at<T>(0), zero);
    return ws.release(s);
}
template bie_status exact_grad_w<__nv_bfloat16>(const bie_cuda_bl_backward_args &);
template bie_status exact_grad_w<__half>(const bie_cuda_bl_backward_args &);

// The exact products (SPEC §2): grad_x before the mask, g [m, k] (f32), and grad_w, in cuBLAS
// on ±1 operands expanded from the sign bits (a workspace of their own).
template <typename T>
bie_status exact_products(const bie_cuda_bl_backward_args &a, cudaDataType_t ctype,
                          const float *zero, float *g) {
    const int64_t m = a.m, n = a.n, k = a.k;
    Workspace<2> ws;  // ±1 weight [n, k], ±1 activations [m, k] (T)
    BIE_CUDA_TRY(ws.alloc({(size_t)(n * k) * sizeof(T), (size_t)(m * k) * sizeof(T)},
                          "cudaMallocAsync (backward workspace)"));
    T *wsign = ws.at<T>(0), *xsign = ws.at<T>(1);
    cublasHandle_t h = nullptr;
    bie_status s = blas_handle(&h);
    if (s != BIE_OK) return ws.release(s);
    expand_signs<T>(a.wbits, a.ld, n, k, wsign);
    // grad_x (before the mask), row-major [m, k] = grad_out [m, n] @ sign(w) [n, k] * scale_w
    s = blas_check(
        cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, (int)k, (int)m, (int)n, a.saved_scales + 1, wsign,
                     ctype, (int)k, a.grad_out, ctype, (int)n, zero, g, CUDA_R_32F, (int)k,
                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx (grad_x)");
    if (s == BIE_OK) s = grad_w_product<T>(h, a, xsign, zero);
    return ws.release(s);
}

MaskPass mask_pass_shape(int64_t m, int64_t k, bool two_per_sm, int lane_cols) {
    MaskPass p;
    p.lane_cols = lane_cols;
    p.col_blocks = (unsigned)((k + 256 * lane_cols - 1) / (256 * lane_cols));
    // Row groups: one wave of long blocks on a 132-SM device (three resident blocks an SM for
    // the binary form's registers on f32 g; two for the 4-bit form's and for 16-bit g, whose
    // lanes take eight columns each), at least 16 rows a group. The same grid on every device,
    // so that the sums come out the same. BIE_CUDA_MASK_BLOCKS=N asks for N blocks instead (to
    // time one grid against another).
    static const int64_t asked = [] {
        const char *e = std::getenv("BIE_CUDA_MASK_BLOCKS");
        return e ? (int64_t)std::max(1, std::atoi(e)) : (int64_t)0;
    }();
    const int64_t blocks = asked ? asked : two_per_sm ? 256 : 384;
    const int64_t want = (blocks + p.col_blocks - 1) / p.col_blocks;
    p.groups = (unsigned)std::max<int64_t>(1, std::min<int64_t>(want, (m + 15) / 16));
    p.dot_bytes = (size_t)p.groups * p.col_blocks * sizeof(double);
    p.col_bytes = (size_t)p.groups * (size_t)k * sizeof(double);
    return p;
}

template <typename T, typename G>
bie_status mask_pass(const MaskPass &p, const G *g, int64_t m, int64_t k, const MaskBits &bits,
                     T *grad_x, double *dot_part, double *col_part, double denom, float *grad_bias,
                     float *grad_scale_a) {
    if (p.lane_cols != mask_lane_cols<G>())  // a shape made for the other form of g
        return bie_fail(BIE_ERR_INTERNAL, "mask pass: a shape of %d columns a lane for g of %d",
                        p.lane_cols, mask_lane_cols<G>());
    const dim3 grid(p.col_blocks, p.groups);
    const bool vec_g = rows_aligned16<G>(g, k), vec_x = rows_aligned16<T>(grad_x, k);
    const bool vec_r = k % 4 == 0 && reinterpret_cast<uintptr_t>(bits.resid) % 4 == 0;
    bool q4 = false;
    if constexpr (sizeof(G) == 4) {
        if (bits.resid) {  // the 4-bit form (f32 g only)
            mask_reduce<T, G, true>
                <<<grid, 256, 0, current_stream>>>(g, m, k, 0, bits.mask, nullptr, bits.resid,
                                                   vec_g, vec_x, vec_r, grad_x, col_part, dot_part);
            q4 = true;
        }
    }
    if (!q4)
        mask_reduce<T, G, false>
            <<<grid, 256, 0, current_stream>>>(g, m, k, bits.ld, bits.mask, bits.signs, nullptr,
                                               vec_g, vec_x, false, grad_x, col_part, dot_part);
    col_sums_final<<<(unsigned)((k + 31) / 32), 256, 0, current_stream>>>(col_part, p.groups, k,
                                                                          grad_bias);
    sum_over(dot_part, (int64_t)p.groups * p.col_blocks, denom, grad_scale_a);
    return BIE_OK;
}
#define BIE_MASK_PASS(T, G)                                                                \
    template bie_status mask_pass<T, G>(const MaskPass &, const G *, int64_t, int64_t,     \
                                        const MaskBits &, T *, double *, double *, double, \
                                        float *, float *)
BIE_MASK_PASS(float, float);
BIE_MASK_PASS(__nv_bfloat16, float);
BIE_MASK_PASS(__half, float);
BIE_MASK_PASS(__nv_bfloat16, __nv_bfloat16);  // grad_x from the FP8 products
BIE_MASK_PASS(__half, __half);
#undef BIE_MASK_PASS

template <typename T>
bie_status backward_typed(const bie_cuda_bl_backward_args &a, cudaDataType_t ctype) {
    const int64_t m = a.m, n = a.n, k = a.k;
    const bool fp8_fits = fp8_backward_fits(a);
    if (fp8_fits && fp8_backward_fused_usable()) return fp8_backward_fused(a);
    if (!fp8_fits && exact_fused_fits(a)) return exact_backward_fused(a);
    // the FP8 products leave g in T: for 16-bit layers the mask pass's registers then allow
    // two blocks an SM
    const bool g16 = fp8_fits && sizeof(T) == 2;
    const MaskPass p32 = mask_pass_shape(m, k, false, mask_lane_cols<float>()),
                   p16 = g16 ? mask_pass_shape(m, k, true, mask_lane_cols<T>()) : p32;
    // Workspace: grad_x before the mask [m, k] (f32), the mask pass's dot partials and column
    // partial sums, amax partials.
    Workspace<4> ws;
    BIE_CUDA_TRY(ws.alloc({(size_t)(m * k) * sizeof(float), std::max(p32.dot_bytes, p16.dot_bytes),
                           std::max(p32.col_bytes, p16.col_bytes), amax_workspace_bytes()},
                          "cudaMallocAsync (backward workspace)"));
    float *g = ws.at<float>(0);

    float *zero = nullptr;
    bie_status s = device_zero(&zero);
    bool fp8 = false;  // the FP8 products are in g (as T) and grad_w
    if (s == BIE_OK && fp8_fits) s = fp8_backward_products(a, ctype, g, &fp8);
    if (s == BIE_OK && !fp8) s = exact_products<T>(a, ctype, zero, g);
    if (s != BIE_OK) return ws.release(s);
    const MaskBits bits{a.mask, a.signs, a.ld, nullptr};
    const double denom = std::sqrt((double)m * (double)k);
    T *grad_x = static_cast<T *>(a.grad_x);
    s = fp8 ? mask_pass<T, T>(p16, reinterpret_cast<const T *>(g), m, k, bits, grad_x,
                              ws.at<double>(1), ws.at<double>(2), denom, a.grad_bias,
                              a.grad_scale_a)
            : mask_pass<T, float>(p32, g, m, k, bits, grad_x, ws.at<double>(1), ws.at<double>(2),
                                  denom, a.grad_bias, a.grad_scale_a);
    if (s != BIE_OK) return ws.release(s);
    if (a.grad_w_i8) quantize_grad_i8(a.grad_w, n * k, ws.at<float>(3), a.grad_w_i8);
    return ws.release(check(cudaGetLastError(), "binary linear backward kernels"));
}

// ---- Binary conv2d backward (SPEC §3): conv2d_weight and conv2d_input as two GEMMs over the
// im2col of the saved signs, then a gather col2im that applies the clip mask and reduces.

__device__ __forceinline__ bool word_bit(const uint32_t *w, int64_t bit) {
    return (w[bit >> 5] >> (bit & 31)) & 1;
}

// ±1 weight [o][c k k] from the forward's tap-layout rows: block (element block, rows).
template <typename T>
__global__ void __launch_bounds__(256)
    conv_weight_signs(const uint32_t *bits, bie_conv_geom g64, int words, T *dst) {
    const int C = (int)g64.c, cw = (C + 31) / 32, kk = (int)(g64.k * g64.k), K = C * kk,
              O = (int)g64.o;
    const int e = blockIdx.x * 256 + threadIdx.x;
    if (e >= K) return;
    const int c = e / kk, t = e - c * kk;
    for (int o = blockIdx.y; o < O; o += gridDim.y)
        dst[(int64_t)o * K + e] =
            from_f32<T>(word_bit(bits + (int64_t)o * words + t * cw, c) ? 1.0f : -1.0f);
}

// S [c k k][n oh ow]: sign(x') at each tap, 0 outside the input. Block (pixel block, sign
// word): each thread owns one output pixel and one word of 32 channels; for every tap it
// loads that word once and writes its 32 elements, neighbouring threads writing neighbouring
// pixels. No division in the inner loops (this kernel writes the largest buffer). KF: the
// kernel size fixed at compile time (0: from the shape), so that the taps' loads unroll.
template <typename T, int KF>
__global__ void __launch_bounds__(256)
    conv_sign_cols(const uint32_t *__restrict__ signs, bie_conv_geom g64, T *__restrict__ dst) {
    const int C = (int)g64.c, cw = (C + 31) / 32, k = KF ? KF : (int)g64.k, kk = k * k;
    const int h = (int)g64.h, w = (int)g64.w, ow = (int)g64.ow, plane = (int)(g64.oh * g64.ow);
    const int rows = (int)g64.n * plane, r = blockIdx.x * 256 + threadIdx.x, word = blockIdx.y;
    if (r >= rows) return;
    const int n = r / plane, pix = r - n * plane, oy = pix / ow, ox = pix - oy * ow;
    const int y0 = oy * (int)g64.s - (int)g64.p, x0 = ox * (int)g64.s - (int)g64.p, d = (int)g64.d;
    const uint32_t *img = signs + (int64_t)n * h * w * cw + word;
    const int c0 = word * 32, cn = C - c0 < 32 ? C - c0 : 32;
    const T plus = from_f32<T>(1.0f), minus = from_f32<T>(-1.0f), zero = from_f32<T>(0.0f);
#pragma unroll
    for (int i = 0; i < k; i++) {
        const int iy = y0 + i * d;
#pragma unroll
        for (int j = 0; j < k; j++) {
            const int ix = x0 + j * d, t = i * k + j;
            const bool inside = iy >= 0 && iy < h && ix >= 0 && ix < w;
            const uint32_t bits = inside ? img[(iy * w + ix) * cw] : 0u;
            T *out = dst + ((int64_t)c0 * kk + t) * rows + r;
            for (int b = 0; b < cn; b++)
                out[(int64_t)b * kk * rows] = !inside ? zero : (bits >> b) & 1 ? plus : minus;
        }
    }
}

// G [o][n oh ow] from grad_out [n][o][oh ow] (or NHWC [n oh ow][o]): block (pixel block,
// channels).
template <typename T>
__global__ void __launch_bounds__(256)
    conv_grad_rows(const T *grad_out, bie_conv_geom g64, T *dst) {
    const int plane = (int)(g64.oh * g64.ow), rows = (int)g64.n * plane, O = (int)g64.o;
    const int r = blockIdx.x * 256 + threadIdx.x;
    if (r >= rows) return;
    const int n = r / plane, pix = r - n * plane;
    for (int o = blockIdx.y; o < O; o += gridDim.y)
        dst[(int64_t)o * rows + r] =
            grad_out[g64.nhwc ? (int64_t)r * O + o : ((int64_t)n * O + o) * plane + pix];
}

// The clip bit of an element from the NHWC mask words (conv_col2im_mask).
struct NhwcMask {
    const uint32_t *bits;
    int cw, hw;
    __device__ bool operator()(int n, int c, int pix, int64_t) const {
        return word_bit(bits + ((int64_t)n * hw + pix) * cw, c);
    }
};

// One warp per (n, c) plane of g: its sum and its dot with sign(x'), in double, fixed order.
__global__ void __launch_bounds__(256)
    conv_plane_sums(const float *g, const uint32_t *signs, bie_conv_geom g64, double *plane_sum,
                    double *plane_dot) {
    const int C = (int)g64.c, cw = (C + 31) / 32, hw = (int)(g64.h * g64.w),
              lane = threadIdx.x & 31;
    const int nc = blockIdx.x * 8 + (threadIdx.x >> 5);
    if (nc >= (int)g64.n * C) return;
    const int n = nc / C, c = nc - n * C;
    const float *row = g + (int64_t)nc * hw;
    double sum = 0, dot = 0;
    for (int pix = lane; pix < hw; pix += 32) {
        const float v = row[pix];
        sum += v;
        dot += word_bit(signs + ((int64_t)n * hw + pix) * cw, c) ? v : -v;
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
bie_status conv_backward_typed(const bie_cuda_bconv_backward_args &a, cudaDataType_t ctype) {
    cudaStream_t st = current_stream;
    const bie_conv_geom &g = a.g;
    const int64_t kk = g.k * g.k, K = g.c * kk, rows = g.n * g.oh * g.ow;
    // Workspace: ±1 weight [o, K], sign columns [K, rows] and gradient rows [o, rows] (T),
    // grad columns [K, rows] (f32), per-plane sums and dots, amax partials, masked grad_x (f32).
    Workspace<7> ws;
    BIE_CUDA_TRY(ws.alloc({(size_t)(g.o * K) * sizeof(T), (size_t)(rows * K) * sizeof(T),
                           (size_t)(g.o * rows) * sizeof(T), (size_t)(rows * K) * sizeof(float),
                           (size_t)(2 * g.n * g.c) * sizeof(double), amax_workspace_bytes(),
                           (size_t)(g.n * g.c * g.h * g.w) * sizeof(float)},
                          "cudaMallocAsync (conv backward workspace)"));
    T *wsign = ws.at<T>(0), *scols = ws.at<T>(1);
    T *grows = ws.at<T>(2);
    float *gcols = ws.at<float>(3), *amax = ws.at<float>(5);
    double *plane_sum = ws.at<double>(4), *plane_dot = plane_sum + g.n * g.c;
    float *gmasked = ws.at<float>(6);
    const uint32_t *wbits = reinterpret_cast<const uint32_t *>(a.wbits);

    bie_status s = BIE_OK;
    float *zero = nullptr;
    cublasHandle_t h = nullptr;
    if ((s = check(cudaGetSymbolAddress((void **)&zero, kZero), "cudaGetSymbolAddress")) != BIE_OK)
        goto done;
    if ((s = blas_handle(&h)) != BIE_OK) goto done;
    conv_weight_signs<T>
        <<<dim3((unsigned)((K + 255) / 256), (unsigned)std::min<int64_t>(g.o, 4096)), 256, 0, st>>>(
            wbits, g, (int)(a.ld / 4), wsign);
    {
        const unsigned pb = (unsigned)((rows + 255) / 256);
        (g.k == 3 ? conv_sign_cols<T, 3>
                  : conv_sign_cols<T, 0>)<<<dim3(pb, (unsigned)bie_cuda_conv_cw(&g)), 256, 0, st>>>(
            a.signs, g, scols);
        conv_grad_rows<T><<<dim3(pb, (unsigned)std::min<int64_t>(g.o, 4096)), 256, 0, st>>>(
            static_cast<const T *>(a.grad_out), g, grows);
    }
    // grad_w, row-major [o, K] = G [o, rows] @ S^T (S row-major [K, rows]) * scale_a
    s = blas_check(
        cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, (int)K, (int)g.o, (int)rows, a.saved_scales,
                     scols, ctype, (int)rows, grows, ctype, (int)rows, zero, a.grad_w, CUDA_R_32F,
                     (int)K, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx (conv grad_w)");
    if (s != BIE_OK) goto done;
    // grad columns, row-major [K, rows] = sign(w)^T [K, o] @ G [o, rows] * scale_w
    s = blas_check(
        cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, (int)rows, (int)K, (int)g.o, a.saved_scales + 1,
                     grows, ctype, (int)rows, wsign, ctype, (int)K, zero, gcols, CUDA_R_32F,
                     (int)rows, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx (conv grad_x)");
    if (s != BIE_OK) goto done;
    {
        const NhwcMask mask = {a.mask, (int)bie_cuda_conv_cw(&g), (int)(g.h * g.w)};
        launch_conv_col2im_mask(gcols, mask, g, static_cast<T *>(a.grad_x), gmasked);
        conv_plane_sums<<<(unsigned)((g.n * g.c + 7) / 8), 256, 0, st>>>(gmasked, a.signs, g,
                                                                         plane_sum, plane_dot);
    }
    conv_bias_scale_sums(plane_sum, plane_dot, g.n, g.c,
                         std::sqrt((double)g.n * (double)g.c * (double)(g.h * g.w)), a.grad_bias,
                         a.grad_scale_a);
    if (a.grad_w_i8) quantize_grad_i8(a.grad_w, g.o * K, amax, a.grad_w_i8);
    s = check(cudaGetLastError(), "binary conv2d backward kernels");
done:
    return ws.release(s);
}

void conv_grad_rows_any(bie_dtype dtype, const void *grad_out, const bie_conv_geom &g, void *dst) {
    const dim3 grid((unsigned)((g.n * g.oh * g.ow + 255) / 256),
                    (unsigned)std::min<int64_t>(g.o, 4096));
    if (dtype == BIE_F32)
        conv_grad_rows<float><<<grid, 256, 0, current_stream>>>(
            static_cast<const float *>(grad_out), g, static_cast<float *>(dst));
    else if (dtype == BIE_BF16)
        conv_grad_rows<__nv_bfloat16><<<grid, 256, 0, current_stream>>>(
            static_cast<const __nv_bfloat16 *>(grad_out), g, static_cast<__nv_bfloat16 *>(dst));
    else
        conv_grad_rows<__half><<<grid, 256, 0, current_stream>>>(
            static_cast<const __half *>(grad_out), g, static_cast<__half *>(dst));
}

void conv_bias_scale_sums(const double *plane_sum, const double *plane_dot, int64_t n, int64_t c,
                          double denom, float *grad_bias, float *grad_scale) {
    col_sums_final<<<(unsigned)((c + 31) / 32), 256, 0, current_stream>>>(plane_sum, n, c,
                                                                          grad_bias);
    sum_over(plane_dot, n * c, denom, grad_scale);
}

}  // namespace bie_cuda

using namespace bie_cuda;

static bool g_conv_backward_gemm = false;

extern "C" void bie_cuda_conv_backward_force_gemm(bool on) { g_conv_backward_gemm = on; }
bool bie_cuda::conv_backward_gemm_forced() { return g_conv_backward_gemm; }

extern "C" bie_status bie_cuda_binary_conv2d_backward(const bie_cuda_bconv_backward_args *args) {
    if (!g_conv_backward_gemm && conv_backward_mma_fits(*args)) return conv_backward_mma(*args);
    switch (args->dtype) {
    case BIE_F32: return conv_backward_typed<float>(*args, CUDA_R_32F);
    case BIE_BF16: return conv_backward_typed<__nv_bfloat16>(*args, CUDA_R_16BF);
    case BIE_F16: return conv_backward_typed<__half>(*args, CUDA_R_16F);
    default:
        return bie_fail(BIE_ERR_DTYPE, "cuda conv backward: dtype %s", bie_dtype_name(args->dtype));
    }
}

extern "C" bie_status bie_cuda_binary_linear_backward(const bie_cuda_bl_backward_args *args) {
    switch (args->dtype) {
    case BIE_F32: return backward_typed<float>(*args, CUDA_R_32F);
    case BIE_BF16: return backward_typed<__nv_bfloat16>(*args, CUDA_R_16BF);
    case BIE_F16: return backward_typed<__half>(*args, CUDA_R_16F);
    default: return bie_fail(BIE_ERR_DTYPE, "cuda backward: dtype %s", bie_dtype_name(args->dtype));
    }
}
