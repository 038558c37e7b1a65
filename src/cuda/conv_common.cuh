// Pieces the binary conv kernels share (conv.cu: the pack, the implicit GEMM;
// conv_fused_kernel.cu: the fused pack + implicit GEMM): raw element runs of the NCHW input
// and small cp.async.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "dtype.cuh"

namespace bie_cuda {

// Division of non-negative ints below 2^31 by a divisor fixed per launch, as a multiply-high
// and a shift (the magic number from the host): the per-step pixel index math of wgrad_mma.
struct FastDiv {
    unsigned m, l;
    explicit FastDiv(int d) {
        l = 0;
        while ((1ull << l) < (unsigned long long)d) l++;
        m = (unsigned)(((1ull << 32) * ((1ull << l) - (unsigned long long)d)) / (unsigned)d + 1);
    }
    __device__ __forceinline__ int div(int n) const {
        return (int)((__umulhi((unsigned)n, m) + (unsigned)n) >> l);
    }
};

// Raw bits of VP consecutive elements of type T (2 or 4 bytes) as 32-bit words, read with one
// aligned load of sizeof(T) * VP bytes (2, 4 or 8).
template <int BYTES> struct RawRun;
template <> struct RawRun<2> {
    uint32_t w[1];
    __device__ __forceinline__ void load(const void *p) {
        w[0] = *static_cast<const unsigned short *>(p);
    }
};
template <> struct RawRun<4> {
    uint32_t w[1];
    __device__ __forceinline__ void load(const void *p) {
        w[0] = *static_cast<const uint32_t *>(p);
    }
};
template <> struct RawRun<8> {
    uint32_t w[2];
    __device__ __forceinline__ void load(const void *p) {
        const uint2 v = *static_cast<const uint2 *>(p);
        w[0] = v.x;
        w[1] = v.y;
    }
};

// Element j of a run as float (little endian: element 0 in the low bits).
template <typename T> __device__ __forceinline__ float run_elem(const uint32_t *w, int j);
template <> __device__ __forceinline__ float run_elem<float>(const uint32_t *w, int j) {
    return to_f32(__uint_as_float(w[j]));
}
template <> __device__ __forceinline__ float run_elem<__nv_bfloat16>(const uint32_t *w, int j) {
    return to_f32(__ushort_as_bfloat16((unsigned short)(w[j >> 1] >> (16 * (j & 1)))));
}
template <> __device__ __forceinline__ float run_elem<__half>(const uint32_t *w, int j) {
    return to_f32(__ushort_as_half((unsigned short)(w[j >> 1] >> (16 * (j & 1)))));
}

// cp.async of 4, 8 or 16 bytes (pred false: zero-fill).
__device__ __forceinline__ void cp_async_n(unsigned dst, const void *src, int bytes, bool pred) {
    const int n = pred ? bytes : 0;
    if (bytes == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                     "r"(n));
    else if (bytes == 8)
        asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(n));
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}

}  // namespace bie_cuda
