// Packing for the 4-bit GEMM (q4gemm.cu): float activations (+ bias_a) and float weights
// quantized to 4-bit codes, int8 codes and the user's nibble rows, all into the device
// layout of cuda_internal.h (rows of ld bytes, even code in the low nibble, zero past k);
// plus, for the backward, the activations' clip bits and rounding residuals.
//
// The quantization is the CPU's, operation for operation (q4_common.cuh).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda_common.cuh"
#include "cuda_internal.h"
#include "q4_common.cuh"

namespace bie_cuda {

// Eight codes of a row, stored as one 32-bit word of the 4-bit layout or, I8, as eight int8
// codes (kernel 211's rows): group i of the destination either way.
template <bool I8> struct CodeGroup {
    unsigned lo = 0, hi = 0;
    __device__ __forceinline__ void set(int j, int code) {
        if (I8)
            (j < 4 ? lo : hi) |= (unsigned)(code & 255) << (8 * (j & 3));
        else
            lo |= (unsigned)(code & 15) << (4 * j);
    }
    __device__ __forceinline__ void store(void *dst, int64_t i) const {
        if (I8)
            reinterpret_cast<uint2 *>(dst)[i] = make_uint2(lo, hi);
        else
            reinterpret_cast<unsigned *>(dst)[i] = lo;
    }
};

// Groups per row of ld bytes.
template <bool I8> __host__ __device__ constexpr int64_t groups_of(int64_t ld) {
    return I8 ? ld / 8 : ld / 4;
}

// One thread per group of eight codes of the layout: group g of row r holds codes
// 8 g .. 8 g + 7 of row r, each taken from Src(row, col) for col < k (zero past k).
template <class Src, bool I8>
__global__ void __launch_bounds__(256)
    pack_q4_words(Src src, int64_t rows, int64_t k, int64_t ld, void *__restrict__ dst) {
    const int64_t groups = groups_of<I8>(ld), total = rows * groups;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t row = i / groups, c0 = (i - row * groups) * 8;
        CodeGroup<I8> w;
        if (c0 < k) {
#pragma unroll
            for (int j = 0; j < 8; j++)
                if (c0 + j < k) w.set(j, src(row, c0 + j));
        }
        w.store(dst, i);
    }
}

// Sources of codes.
template <typename T> struct ActCodes {  // q4(x + bias, *scale)
    const T *x;
    int64_t k;
    const float *bias, *scale;
    __device__ int operator()(int64_t row, int64_t col) const {
        float v = to_f32(x[row * k + col]);
        if (bias) v = __fadd_rn(v, bias[col]);
        return q4_code(v, *scale);
    }
};
struct Int8Codes {  // int8 codes, taken modulo 16
    const int8_t *c;
    int64_t stride;
    __device__ int operator()(int64_t row, int64_t col) const { return c[row * stride + col]; }
};

// The user's nibble rows (ceil(k / 2) bytes, the odd k's last high nibble ignored).
__global__ void __launch_bounds__(256)
    repack_q4_rows(const uint8_t *__restrict__ src, int64_t rows, int64_t k, int64_t ld,
                   unsigned *__restrict__ dst) {
    const int64_t words = ld / 4, total = rows * words, rb = (k + 1) / 2;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t row = i / words, b0 = (i - row * words) * 4;
        const uint8_t *s = src + row * rb;
        unsigned w = 0;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int64_t b = b0 + j;
            if (b < rb) {
                unsigned v = s[b];
                if (b == rb - 1 && (k & 1)) v &= 15u;
                w |= v << (8 * j);
            }
        }
        dst[i] = w;
    }
}

// The backward's saved state, in the CPU layer's layout (flat over the [m, k] input): clip
// bit i (1{-8 <= v / s <= 7}) at byte i / 8, bit i % 8, and resid[i] = (rint(q) - q) * 254
// rounded (0 outside the clip range). One thread per mask byte.
template <typename T>
__global__ void __launch_bounds__(256)
    q4_act_mask(const T *__restrict__ x, int64_t m, int64_t k, const float *__restrict__ bias,
                const float *__restrict__ scale, uint8_t *__restrict__ mask,
                int8_t *__restrict__ resid) {
    const int64_t n = m * k, nbytes = (n + 7) / 8;
    const float s = *scale;
    for (int64_t byte = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; byte < nbytes;
         byte += (int64_t)gridDim.x * blockDim.x) {
        unsigned bits = 0;
        for (int64_t i = byte * 8; i < byte * 8 + 8 && i < n; i++) {
            float v = to_f32(x[i]);
            if (bias) v = __fadd_rn(v, bias[i % k]);
            bits |= (unsigned)q4_clip_resid(v, s, &resid[i]) << (i & 7);
        }
        mask[byte] = (uint8_t)bits;
    }
}

// The codes and, where mask is not NULL, the clip bits and residuals in one pass, where a row
// holds whole mask bytes and residual words (k % 8 == 0, resid 8-byte aligned): one thread per
// group of eight codes of a row, each element divided once (QUOT: its quotient from the scale's
// reciprocal, taken once per thread: bie_q4_quotient); x read 16 bytes at a time where
// `vec` (x 16-byte aligned), the group's eight biases once, in two 16-byte loads (bias 16-byte
// aligned, else one at a time). Block (x, y) takes groups 256 x .. 256 x + 255 of rows y,
// y + gridDim.y, ... (no division of a flat index). VALS (16-bit T, a mask too): also the codes'
// values as T in the inputs' layout [m][k] (one 16-byte store per group), which the backward's
// grad_w product takes. Without a mask the code alone, dividing only near a half
// (q4_code_fast): also the weight's codes (T float, no bias, no mask).
template <typename T, bool I8, bool QUOT, bool VALS>
__global__ void __launch_bounds__(256)
    q4_act_state(const T *__restrict__ x, int64_t m, int64_t k, int64_t ld,
                 const float *__restrict__ bias, const float *__restrict__ scale, bool vec,
                 void *__restrict__ codes, uint8_t *__restrict__ mask, int8_t *__restrict__ resid,
                 T *__restrict__ values) {
    const int64_t groups = groups_of<I8>(ld);
    const int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, c0 = g * 8;
    if (g >= groups) return;
    const float s = *scale, inv = bie_q4_inverse(s), y = QUOT ? q4_reciprocal(s) : 0.0f;
    float b[8] = {};
    if (bias && c0 < k) {
        if (reinterpret_cast<uintptr_t>(bias) % 16 == 0) {
            const float4 b0 = reinterpret_cast<const float4 *>(bias + c0)[0];
            const float4 b1 = reinterpret_cast<const float4 *>(bias + c0)[1];
            b[0] = b0.x, b[1] = b0.y, b[2] = b0.z, b[3] = b0.w;
            b[4] = b1.x, b[5] = b1.y, b[6] = b1.z, b[7] = b1.w;
        } else {
#pragma unroll
            for (int j = 0; j < 8; j++) b[j] = bias[c0 + j];
        }
    }
    for (int64_t row = blockIdx.y; row < m; row += gridDim.y) {
        CodeGroup<I8> w;
        if (c0 < k) {
            const int64_t at = row * k + c0;
            unsigned bits = 0;
            uint2 rw;
            int8_t *r8 = reinterpret_cast<int8_t *>(&rw);
            float xv[8];
            T vv[8];
            load_n(x + at, vec, 8, xv);
#pragma unroll
            for (int j = 0; j < 8; j++) {
                float v = xv[j];
                if (bias) v = __fadd_rn(v, b[j]);
                if (mask) {  // one quotient gives the code, the clip bit and the residual
                    bool clip;
                    const int code = q4_state<QUOT>(v, s, y, &clip, &r8[j]);
                    w.set(j, code);
                    if (VALS) vv[j] = from_f32<T>((float)code);
                    bits |= (unsigned)clip << j;
                } else {
                    w.set(j, q4_code_fast(v, s, inv));
                }
            }
            if (mask) {
                mask[at >> 3] = (uint8_t)bits;
                *reinterpret_cast<uint2 *>(resid + at) = rw;
                if constexpr (VALS && sizeof(T) == 2)
                    *reinterpret_cast<uint4 *>(values + at) = *reinterpret_cast<const uint4 *>(vv);
            }
        }
        w.store(codes, row * groups + g);
    }
}

// The training forward's weight pass where the fused backward takes the weight's values
// (q4backward.cu): the codes of w [n, k] (T float, no bias) in rows of ld = k bytes (I8) or
// k / 2 (4-bit layout), and their values transposed, valt [k][n] (V, 16-bit), in one read of
// w instead of the codes' pass and a second one over them in the backward. A block per
// 64 x 64 tile (k % 256 == 0, so that ld is the codes' row stride in either layout; n % 8 == 0, w
// 16-byte aligned): thread t reads 16 floats of row t / 4 (four 16-byte loads), stores their codes
// in one piece and their values through tile_put and tile_store_t (tile_t.cuh).
template <typename V, bool I8>
__global__ void __launch_bounds__(256)
    q4_weight_values(const float *__restrict__ w, int64_t n, int64_t k, int64_t ld,
                     const float *__restrict__ scale, uint8_t *__restrict__ codes,
                     V *__restrict__ valt) {
    __shared__ V tile[64 * kTilePitch];
    const int t = (int)threadIdx.x, r = t >> 2, c16 = (t & 3) * 16;
    const int64_t r0 = (int64_t)blockIdx.y * 64, c0 = (int64_t)blockIdx.x * 64;
    const float s = *scale, inv = bie_q4_inverse(s);
    float q[16];
    if (r0 + r < n) {
        const float4 *src = reinterpret_cast<const float4 *>(w + (r0 + r) * k + c0 + c16);
        float v[16];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float4 f = src[i];
            v[4 * i] = f.x, v[4 * i + 1] = f.y, v[4 * i + 2] = f.z, v[4 * i + 3] = f.w;
        }
        CodeGroup<I8> g[2];
#pragma unroll
        for (int j = 0; j < 16; j++) {
            const int c = q4_code_fast(v[j], s, inv);
            g[j >> 3].set(j & 7, c);
            q[j] = (float)c;
        }
        const int64_t i0 = ((r0 + r) * ld + (I8 ? c0 + c16 : (c0 + c16) / 2)) / (I8 ? 8 : 4);
        g[0].store(codes, i0);
        g[1].store(codes, i0 + 1);
    } else {
#pragma unroll
        for (int j = 0; j < 16; j++) q[j] = 0.0f;
    }
    tile_put(tile, t, q);
    __syncthreads();
    tile_store_t(tile, t, r0, c0, n, k, valt);
}

unsigned grid_for(int64_t items) {
    const int64_t blocks = (items + 255) / 256;
    return (unsigned)(blocks < 1 ? 1 : blocks > (1 << 20) ? (1 << 20) : blocks);
}

template <class Src, bool I8 = false>
void launch_pack(Src src, int64_t rows, int64_t k, int64_t ld, uint8_t *dst) {
    pack_q4_words<Src, I8>
        <<<grid_for(rows * groups_of<I8>(ld)), 256, 0, current_stream>>>(src, rows, k, ld, dst);
}

bool q4_quotient_wanted() { return env_is("BIE_CUDA_Q4_QUOTIENT", "1"); }

// Whether launch_act takes its one-pass form (q4_act_state), the only one that writes values.
bool act_one_pass(int64_t k, const uint8_t *mask, const int8_t *resid) {
    return k % 8 == 0 && (!mask || reinterpret_cast<uintptr_t>(resid) % 8 == 0);
}

// x [m, k] (+ bias) to codes of rows of ld bytes (I8: int8 codes), with the clip bits and
// residuals where mask is not NULL, and the codes' values where values is not NULL (the caller
// checked act_one_pass and that mask is not NULL).
template <typename T, bool I8>
void launch_act(const T *x, int64_t m, int64_t k, const float *bias, const float *scale, int64_t ld,
                uint8_t *codes, uint8_t *mask, int8_t *resid, T *values) {
    if (act_one_pass(k, mask, resid)) {
        const dim3 grid((unsigned)((groups_of<I8>(ld) + 255) / 256),
                        (unsigned)std::max<int64_t>(1, std::min<int64_t>(m, 65535)));
        static const bool quot = q4_quotient_wanted();
        const bool vec = reinterpret_cast<uintptr_t>(x) % 16 == 0;
        auto fn =
            values ? (quot ? q4_act_state<T, I8, true, true> : q4_act_state<T, I8, false, true>)
                   : (quot ? q4_act_state<T, I8, true, false> : q4_act_state<T, I8, false, false>);
        fn<<<grid, 256, 0, current_stream>>>(x, m, k, ld, bias, scale, vec, codes, mask, resid,
                                             values);
        return;
    }
    launch_pack<ActCodes<T>, I8>(ActCodes<T>{x, k, bias, scale}, m, k, ld, codes);
    if (mask)
        q4_act_mask<T><<<grid_for((m * k + 7) / 8), 256, 0, current_stream>>>(x, m, k, bias, scale,
                                                                              mask, resid);
}

template <typename T>
void launch_act_any(bool i8, const void *x, int64_t m, int64_t k, const float *bias,
                    const float *scale, int64_t ld, uint8_t *codes, uint8_t *mask, int8_t *resid,
                    void *values = nullptr) {
    const T *xt = static_cast<const T *>(x);
    T *vt = static_cast<T *>(values);
    if (i8)
        launch_act<T, true>(xt, m, k, bias, scale, ld, codes, mask, resid, vt);
    else
        launch_act<T, false>(xt, m, k, bias, scale, ld, codes, mask, resid, vt);
}

}  // namespace bie_cuda

using namespace bie_cuda;

extern "C" {

bie_status bie_cuda_q4_pack_act(bie_dtype dtype, const void *x, int64_t m, int64_t k,
                                const float *bias, const float *scale_a, int64_t ld, bool i8,
                                uint8_t *codes, uint8_t *mask, int8_t *resid) {
    return bie_cuda_q4_pack_act_values(dtype, x, m, k, bias, scale_a, ld, i8, codes, mask, resid,
                                       NULL);
}

bool bie_cuda_q4_act_values_wanted(bie_dtype dtype, int64_t k) {
    static const bool on = env_is("BIE_CUDA_Q4_XVALUES", "1");
    return on && (dtype == BIE_BF16 || dtype == BIE_F16) && k % 8 == 0;
}

bie_status bie_cuda_q4_pack_act_values(bie_dtype dtype, const void *x, int64_t m, int64_t k,
                                       const float *bias, const float *scale_a, int64_t ld, bool i8,
                                       uint8_t *codes, uint8_t *mask, int8_t *resid, void *values) {
    if (values && (!mask || !act_one_pass(k, mask, resid) || dtype == BIE_F32 ||
                   reinterpret_cast<uintptr_t>(values) % 16))
        return bie_fail(BIE_ERR_INTERNAL,
                        "cuda 4-bit pack: no values of a %s input of %lld columns",
                        bie_dtype_name(dtype), (long long)k);
    switch (dtype) {
    case BIE_F32: launch_act_any<float>(i8, x, m, k, bias, scale_a, ld, codes, mask, resid); break;
    case BIE_BF16:
        launch_act_any<__nv_bfloat16>(i8, x, m, k, bias, scale_a, ld, codes, mask, resid, values);
        break;
    case BIE_F16:
        launch_act_any<__half>(i8, x, m, k, bias, scale_a, ld, codes, mask, resid, values);
        break;
    default: return bie_fail(BIE_ERR_DTYPE, "cuda 4-bit pack: dtype %s", bie_dtype_name(dtype));
    }
    return check(cudaGetLastError(), "cuda 4-bit pack activations");
}

bie_status bie_cuda_q4_pack_weight(const float *w, int64_t n, int64_t k, const float *scale_w,
                                   int64_t ld, bool i8, uint8_t *codes) {
    /* q4(w, scale_w) is the activations' q4 without a bias (q4_common.cuh) */
    launch_act_any<float>(i8, w, n, k, NULL, scale_w, ld, codes, NULL, NULL);
    return check(cudaGetLastError(), "cuda 4-bit pack weight");
}

bie_status bie_cuda_q4_pack_weight_values(const float *w, int64_t n, int64_t k,
                                          const float *scale_w, bool i8, bie_dtype dtype,
                                          uint8_t *codes, void *valt) {
    if (k % 256 || n % 8 || n / 64 >= 65535 || reinterpret_cast<uintptr_t>(w) % 16 ||
        reinterpret_cast<uintptr_t>(valt) % 16 || (dtype != BIE_BF16 && dtype != BIE_F16))
        return bie_fail(BIE_ERR_INTERNAL, "cuda 4-bit weight values: a %lld x %lld %s weight",
                        (long long)n, (long long)k, bie_dtype_name(dtype));
    const dim3 grid((unsigned)(k / 64), (unsigned)((n + 63) / 64));
    const int64_t ld = i8 ? k : k / 2;
#define BIE_WV(V, I8)       \
    q4_weight_values<V, I8> \
        <<<grid, 256, 0, current_stream>>>(w, n, k, ld, scale_w, codes, static_cast<V *>(valt))
    if (dtype == BIE_BF16) {
        if (i8)
            BIE_WV(__nv_bfloat16, true);
        else
            BIE_WV(__nv_bfloat16, false);
    } else {
        if (i8)
            BIE_WV(__half, true);
        else
            BIE_WV(__half, false);
    }
#undef BIE_WV
    return check(cudaGetLastError(), "cuda 4-bit weight values");
}

bie_status bie_cuda_q4_pack_codes(const int8_t *src, int64_t stride, int64_t rows, int64_t k,
                                  int64_t ld, uint8_t *codes) {
    launch_pack(Int8Codes{src, stride}, rows, k, ld, codes);
    return check(cudaGetLastError(), "cuda 4-bit pack codes");
}

bie_status bie_cuda_q4_repack_rows(const void *src, int64_t rows, int64_t k, int64_t ld,
                                   uint8_t *dst) {
    repack_q4_rows<<<grid_for(rows * (ld / 4)), 256, 0, current_stream>>>(
        static_cast<const uint8_t *>(src), rows, k, ld, reinterpret_cast<unsigned *>(dst));
    return check(cudaGetLastError(), "cuda 4-bit repack rows");
}

}  // extern "C"
