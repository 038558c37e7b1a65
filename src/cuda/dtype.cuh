// Element conversions of the device kernels: the float dtypes a layer reads and writes
// (float32 / bfloat16 / float16, and int8 weights) to float32 and back.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cfloat>
#include <cstdint>
#include <type_traits>

namespace bie_cuda {

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(int8_t v) { return (float)v; }

// The training pack's clip test -1 <= fl(v / sa) <= 1 (SPEC: the CPU's float division) as
// |v| <= clip_bound(sa), without the division. fl(v / sa) is monotone in v, fl(|sa| / |sa|) = 1,
// and the next float above |sa| gives a quotient above 1 + 2^-24 (|sa|'s spacing is more than
// 2^-24 |sa|), which rounds above 1: so for a finite nonzero sa the test is |v| <= |sa|. A zero
// sa passes nothing (every quotient is infinite or NaN), an infinite one every finite v, a NaN
// one nothing (the comparison with NaN is false).
__device__ __forceinline__ float clip_bound(float sa) {
    const float a = fabsf(sa);
    return a == 0.0f ? -1.0f : a == INFINITY ? FLT_MAX : a;
}

// Rounded to nearest even for the 16-bit types.
template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
    return __float2bfloat16(v);
}
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half(v); }

// e4m3 (FP8) of v, rounded to nearest even, saturated to +-448 (the FP8 backward's operands).
__device__ __forceinline__ uint8_t to_e4m3(float v) {
    return (uint8_t)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}

// The bits of a 16-bit value, and back.
__device__ __forceinline__ uint16_t bits_of(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }
__device__ __forceinline__ uint16_t bits_of(__half v) { return __half_as_ushort(v); }
template <typename T> __device__ __forceinline__ T of_bits(uint16_t b);
template <> __device__ __forceinline__ __nv_bfloat16 of_bits<__nv_bfloat16>(uint16_t b) {
    return __ushort_as_bfloat16(b);
}
template <> __device__ __forceinline__ __half of_bits<__half>(uint16_t b) {
    return __ushort_as_half(b);
}

// N consecutive elements of T (8 bytes, or whole 16-byte units) as raw words: one load per 8 or
// 16 bytes (p aligned to that), all of them in flight until unpack() turns them into floats.
template <int N, typename T> struct RawN {
    static constexpr int kBytes = N * (int)sizeof(T);
    static_assert(kBytes == 8 || kBytes % 16 == 0, "one 8-byte or whole 16-byte loads");
    unsigned w[kBytes / 4];
    __device__ __forceinline__ void load(const T *p) {
        if constexpr (kBytes == 8) {
            const uint2 q = __ldg(reinterpret_cast<const uint2 *>(p));
            w[0] = q.x, w[1] = q.y;
        } else {
#pragma unroll
            for (int i = 0; i < kBytes / 16; i++) {
                const uint4 q = __ldg(reinterpret_cast<const uint4 *>(p) + i);
                w[4 * i] = q.x, w[4 * i + 1] = q.y, w[4 * i + 2] = q.z, w[4 * i + 3] = q.w;
            }
        }
    }
    __device__ __forceinline__ void unpack(float (&v)[N]) const {
        const T *e = reinterpret_cast<const T *>(w);
#pragma unroll
        for (int j = 0; j < N; j++) v[j] = to_f32(e[j]);
    }
};

// N consecutive elements p[0 .. N) as float (0 past `left`): RawN's loads when `vec` (p aligned
// to N elements of T, at most 16 bytes, and all N inside), else one load per element.
template <int N, typename T>
__device__ __forceinline__ void load_n(const T *p, bool vec, int64_t left, float (&v)[N]) {
    if (vec && left >= N) {
        RawN<N, T> raw;
        raw.load(p);
        raw.unpack(v);
    } else {
#pragma unroll
        for (int j = 0; j < N; j++) v[j] = j < left ? to_f32(p[j]) : 0.0f;
    }
}

// Whether rows of k elements of T starting at base are all 16-byte aligned.
template <typename T> inline bool rows_aligned16(const void *base, int64_t k) {
    return base != nullptr && reinterpret_cast<uintptr_t>(base) % 16 == 0 &&
           (k * (int64_t)sizeof(T)) % 16 == 0;
}

}  // namespace bie_cuda
