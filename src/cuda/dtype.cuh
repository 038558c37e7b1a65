// Element conversions of the device kernels: the float dtypes a layer reads and writes
// (float32 / bfloat16 / float16, and int8 weights) to float32 and back.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace bie_cuda {

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(int8_t v) { return (float)v; }

// Rounded to nearest even for the 16-bit types.
template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
    return __float2bfloat16(v);
}
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half(v); }

// Eight consecutive elements p[0 .. 8) as float (0 past `left`): one 8-, 16- or two 16-byte
// loads when `vec` (p aligned to 8 elements of T, all 8 inside).
template <typename T>
__device__ __forceinline__ void load8(const T *p, bool vec, int64_t left, float (&v)[8]) {
    if (vec && left >= 8) {
        constexpr int kBytes = 8 * sizeof(T);
        if constexpr (kBytes == 8) {
            const uint2 raw = __ldg(reinterpret_cast<const uint2 *>(p));
            const T *e = reinterpret_cast<const T *>(&raw);
#pragma unroll
            for (int j = 0; j < 8; j++) v[j] = to_f32(e[j]);
        } else {
            uint4 raw[kBytes / 16];
#pragma unroll
            for (int i = 0; i < kBytes / 16; i++)
                raw[i] = __ldg(reinterpret_cast<const uint4 *>(p) + i);
            const T *e = reinterpret_cast<const T *>(raw);
#pragma unroll
            for (int j = 0; j < 8; j++) v[j] = to_f32(e[j]);
        }
    } else {
#pragma unroll
        for (int j = 0; j < 8; j++) v[j] = j < left ? to_f32(p[j]) : 0.0f;
    }
}

// Whether rows of k elements of T starting at base are all 16-byte aligned.
template <typename T> inline bool rows_aligned16(const void *base, int64_t k) {
    return base != nullptr && reinterpret_cast<uintptr_t>(base) % 16 == 0 &&
           (k * (int64_t)sizeof(T)) % 16 == 0;
}

}  // namespace bie_cuda
