// Hopper's warpgroup MMA (wgmma, sm_90a) for the kernels compiled for that architecture alone
// (q4gemm_wgmma.cu, bgemm_wgmma.cu): shared-memory matrix descriptors, the fences and waits
// around the asynchronous wgmma, and the instruction shapes the kernels use. Everything here
// exists only in an sm_90a compilation (__CUDA_ARCH_FEAT_SM90_ALL).
#pragma once
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace bie_cuda {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Shared-memory matrix descriptor of a K-major operand: start address, leading (K direction)
// and stride (M / N direction, between 8-row groups) byte offsets, and the swizzle mode (0:
// none, 1: 128-byte).
__device__ __forceinline__ uint64_t smem_desc(unsigned addr, unsigned lbo, unsigned sbo,
                                              unsigned swizzle) {
    return (uint64_t)((addr & 0x3ffff) >> 4) | ((uint64_t)((lbo & 0x3ffff) >> 4) << 16) |
           ((uint64_t)((sbo & 0x3ffff) >> 4) << 32) | ((uint64_t)swizzle << 62);
}

__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Generic-proxy shared-memory writes made visible to the wgmma (async
// proxy) reads; each writing thread fences before the barrier that precedes the wgmma.
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// The output tile (tm, tn) of block pid, in groups of 8 tile rows: the blocks running together
// share their A and B rows in L2.
__device__ __forceinline__ void grouped_tile(int pid, int tiles_m, int tiles_n, int &tm, int &tn) {
    constexpr int G = 8;
    const int per_group = G * tiles_n;
    const int first = pid / per_group * G, size = min(tiles_m - first, G);
    tm = first + (pid % per_group) % size;
    tn = (pid % per_group) / size;
}

// Keeps the compiler from moving accumulator accesses across the asynchronous wgmma.
template <int N> __device__ __forceinline__ void fence_acc(int (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+r"(d[i])::"memory");
}

// The accumulators of a 64 x N wgmma tile as asm operands: d[0] .. d[N / 2 - 1] read and
// written ("+r"), and their names %0 .. in the instruction text.
#define BIE_WGD4(i) "+r"(d[i]), "+r"(d[i + 1]), "+r"(d[i + 2]), "+r"(d[i + 3])
#define BIE_WGD16(i) BIE_WGD4(i), BIE_WGD4(i + 4), BIE_WGD4(i + 8), BIE_WGD4(i + 12)
#define BIE_WGD64(i) BIE_WGD16(i), BIE_WGD16(i + 16), BIE_WGD16(i + 32), BIE_WGD16(i + 48)
#define BIE_WGD128 BIE_WGD64(0), BIE_WGD64(64)
#define BIE_WG_NAMES64                                                                           \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, " \
    "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, " \
    "%56, %57, %58, %59, %60, %61, %62, %63"
#define BIE_WG_NAMES128                                                                          \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, " \
    "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, " \
    "%56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, " \
    "%74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, " \
    "%92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, "   \
    "%108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, " \
    "%123, %124, %125, %126, %127"

// d += a . b over 64 x 256 x 32 signed bytes, A from registers: this warp's 16 rows x 32
// bytes in the mma.sync A fragment layout (a0: row g, bytes 4t..4t+3; a1: row g + 8; a2, a3:
// bytes 16 + 4t.. of the same rows), B in shared memory.
__device__ __forceinline__ void wgmma_s8_64x256x32(int (&d)[128], const unsigned (&a)[4],
                                                   uint64_t b) {
    asm volatile("{\n"
                 ".reg .pred p;\n"
                 "setp.ne.b32 p, %133, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k32.s32.s8.s8 {" BIE_WG_NAMES128
                 "}, {%128, %129, %130, %131}, %132, p;\n"
                 "}\n"
                 : BIE_WGD128
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

// The same with 128 columns.
__device__ __forceinline__ void wgmma_s8_64x128x32(int (&d)[64], const unsigned (&a)[4],
                                                   uint64_t b) {
    asm volatile("{\n"
                 ".reg .pred p;\n"
                 "setp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 {" BIE_WG_NAMES64
                 "}, {%64, %65, %66, %67}, %68, p;\n"
                 "}\n"
                 : BIE_WGD64(0)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

// d += a . b over 64 x 256 x 32 signed bytes, A and B in shared memory (K-major).
__device__ __forceinline__ void wgmma_s8_ss_64x256x32(int (&d)[128], uint64_t a, uint64_t b) {
    asm volatile("{\n"
                 ".reg .pred p;\n"
                 "setp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k32.s32.s8.s8 {" BIE_WG_NAMES128
                 "}, %128, %129, p;\n"
                 "}\n"
                 : BIE_WGD128
                 : "l"(a), "l"(b), "r"(1));
}

// d += popc(a AND b) over 64 x 256 x 256 bits, A and B in shared memory (K-major).
__device__ __forceinline__ void wgmma_b1_64x256x256(int (&d)[128], uint64_t a, uint64_t b) {
    asm volatile("{\n"
                 ".reg .pred p;\n"
                 "setp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k256.s32.b1.b1.and.popc {" BIE_WG_NAMES128
                 "}, %128, %129, p;\n"
                 "}\n"
                 : BIE_WGD128
                 : "l"(a), "l"(b), "r"(1));
}

// d += a . b over 64 x N x 16 16-bit floats (T: __nv_bfloat16 or __half; N 64, 128 or 144), f32
// accumulators, A from registers (this warp's 16 rows in the mma.sync m16n8k16 A fragment
// layout), B in shared memory (K-major).
#define BIE_WGF4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define BIE_WGF16(i) BIE_WGF4(i), BIE_WGF4(i + 4), BIE_WGF4(i + 8), BIE_WGF4(i + 12)
#define BIE_WGF32 BIE_WGF16(0), BIE_WGF16(16)
#define BIE_WGF64 BIE_WGF16(0), BIE_WGF16(16), BIE_WGF16(32), BIE_WGF16(48)
#define BIE_WGF128                                                                           \
    BIE_WGF16(0), BIE_WGF16(16), BIE_WGF16(32), BIE_WGF16(48), BIE_WGF16(64), BIE_WGF16(80), \
        BIE_WGF16(96), BIE_WGF16(112)
#define BIE_WGF72 \
    BIE_WGF16(0), BIE_WGF16(16), BIE_WGF16(32), BIE_WGF16(48), BIE_WGF4(64), BIE_WGF4(68)
#define BIE_WG_NAMES32                                                                           \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define BIE_WG_NAMES72 BIE_WG_NAMES64 ", %64, %65, %66, %67, %68, %69, %70, %71"
// The instruction for a shape, type, accumulator list and the operand numbers after it.
#define BIE_WGMMA_F16(SHAPE, TY, NAMES, OUTS, A, DESC, PRED)                                 \
    asm volatile("{\n"                                                                       \
                 ".reg .pred p;\n"                                                           \
                 "setp.ne.b32 p, " PRED ", 0;\n"                                             \
                 "wgmma.mma_async.sync.aligned." SHAPE ".f32." TY "." TY " {" NAMES "}, {" A \
                 "}, " DESC ", p, 1, 1, 0;\n"                                                \
                 "}\n"                                                                       \
                 : OUTS                                                                      \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1))
template <typename T, int N>
__device__ __forceinline__ void wgmma_f16(float (&d)[N / 2], const unsigned (&a)[4], uint64_t b) {
    static_assert(N == 64 || N == 128 || N == 144, "instruction shapes written out");
    constexpr bool half = std::is_same<T, __half>::value;
    if constexpr (N == 64 && half)
        BIE_WGMMA_F16("m64n64k16", "f16", BIE_WG_NAMES32, BIE_WGF32, "%32, %33, %34, %35", "%36",
                      "%37");
    else if constexpr (N == 64)
        BIE_WGMMA_F16("m64n64k16", "bf16", BIE_WG_NAMES32, BIE_WGF32, "%32, %33, %34, %35", "%36",
                      "%37");
    else if constexpr (N == 128 && half)
        BIE_WGMMA_F16("m64n128k16", "f16", BIE_WG_NAMES64, BIE_WGF64, "%64, %65, %66, %67", "%68",
                      "%69");
    else if constexpr (N == 128)
        BIE_WGMMA_F16("m64n128k16", "bf16", BIE_WG_NAMES64, BIE_WGF64, "%64, %65, %66, %67", "%68",
                      "%69");
    else if constexpr (half)
        BIE_WGMMA_F16("m64n144k16", "f16", BIE_WG_NAMES72, BIE_WGF72, "%72, %73, %74, %75", "%76",
                      "%77");
    else
        BIE_WGMMA_F16("m64n144k16", "bf16", BIE_WG_NAMES72, BIE_WGF72, "%72, %73, %74, %75", "%76",
                      "%77");
}
// The same with A in shared memory too, read through the descriptor a; TRANS "0, 0": both
// operands K-major, "1, 1": both MN-major (the wgmma transposes them as it reads).
#define BIE_WGMMA_F16_SS(SHAPE, TY, NAMES, OUTS, ADESC, BDESC, PRED, TRANS)                     \
    asm volatile("{\n"                                                                          \
                 ".reg .pred p;\n"                                                              \
                 "setp.ne.b32 p, " PRED ", 0;\n"                                                \
                 "wgmma.mma_async.sync.aligned." SHAPE ".f32." TY "." TY " {" NAMES "}, " ADESC \
                 ", " BDESC ", p, 1, 1, " TRANS ";\n"                                           \
                 "}\n"                                                                          \
                 : OUTS                                                                         \
                 : "l"(a), "l"(b), "r"(1))
template <typename T, int N>
__device__ __forceinline__ void wgmma_f16_ss(float (&d)[N / 2], uint64_t a, uint64_t b) {
    static_assert(N == 64 || N == 128 || N == 256, "instruction shapes written out");
    constexpr bool half = std::is_same<T, __half>::value;
    if constexpr (N == 256 && half)
        BIE_WGMMA_F16_SS("m64n256k16", "f16", BIE_WG_NAMES128, BIE_WGF128, "%128", "%129", "%130",
                         "0, 0");
    else if constexpr (N == 256)
        BIE_WGMMA_F16_SS("m64n256k16", "bf16", BIE_WG_NAMES128, BIE_WGF128, "%128", "%129", "%130",
                         "0, 0");
    else if constexpr (N == 64 && half)
        BIE_WGMMA_F16_SS("m64n64k16", "f16", BIE_WG_NAMES32, BIE_WGF32, "%32", "%33", "%34",
                         "0, 0");
    else if constexpr (N == 64)
        BIE_WGMMA_F16_SS("m64n64k16", "bf16", BIE_WG_NAMES32, BIE_WGF32, "%32", "%33", "%34",
                         "0, 0");
    else if constexpr (half)
        BIE_WGMMA_F16_SS("m64n128k16", "f16", BIE_WG_NAMES64, BIE_WGF64, "%64", "%65", "%66",
                         "0, 0");
    else if constexpr (N == 128)
        BIE_WGMMA_F16_SS("m64n128k16", "bf16", BIE_WG_NAMES64, BIE_WGF64, "%64", "%65", "%66",
                         "0, 0");
}
// d += a . b over 64 x 256 x 32 e4m3 values, f32 accumulators, both operands K-major in
// shared memory (the only layout 8-bit wgmma reads).
__device__ __forceinline__ void wgmma_e4m3_ss_64x256x32(float (&d)[128], uint64_t a, uint64_t b) {
    asm volatile("{\n"
                 ".reg .pred p;\n"
                 "setp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 {" BIE_WG_NAMES128
                 "}, %128, %129, p, 1, 1;\n"
                 "}\n"
                 : BIE_WGF128
                 : "l"(a), "l"(b), "r"(1));
}
// d += a . b over 64 x 64 x 16 with both operands MN-major in shared memory (A: K rows of the
// 64 M values, B: K rows of the 64 N values).
template <typename T>
__device__ __forceinline__ void wgmma_f16_ss_mn64(float (&d)[32], uint64_t a, uint64_t b) {
    if constexpr (std::is_same<T, __half>::value)
        BIE_WGMMA_F16_SS("m64n64k16", "f16", BIE_WG_NAMES32, BIE_WGF32, "%32", "%33", "%34",
                         "1, 1");
    else
        BIE_WGMMA_F16_SS("m64n64k16", "bf16", BIE_WG_NAMES32, BIE_WGF32, "%32", "%33", "%34",
                         "1, 1");
}
// The same over 64 x 256 x 16 (A: K rows of the 64 M values, B: K rows of the 256 N values in
// four 64-value column blocks, LBO apart).
template <typename T>
__device__ __forceinline__ void wgmma_f16_ss_mn256(float (&d)[128], uint64_t a, uint64_t b) {
    if constexpr (std::is_same<T, __half>::value)
        BIE_WGMMA_F16_SS("m64n256k16", "f16", BIE_WG_NAMES128, BIE_WGF128, "%128", "%129", "%130",
                         "1, 1");
    else
        BIE_WGMMA_F16_SS("m64n256k16", "bf16", BIE_WG_NAMES128, BIE_WGF128, "%128", "%129", "%130",
                         "1, 1");
}
// The same with A K-major and B N-major (B: K rows of the 256 N values in four 64-value column
// blocks, LBO apart).
template <typename T>
__device__ __forceinline__ void wgmma_f16_ss_bn256(float (&d)[128], uint64_t a, uint64_t b) {
    if constexpr (std::is_same<T, __half>::value)
        BIE_WGMMA_F16_SS("m64n256k16", "f16", BIE_WG_NAMES128, BIE_WGF128, "%128", "%129", "%130",
                         "0, 1");
    else
        BIE_WGMMA_F16_SS("m64n256k16", "bf16", BIE_WG_NAMES128, BIE_WGF128, "%128", "%129", "%130",
                         "0, 1");
}
#undef BIE_WGMMA_F16
#undef BIE_WGMMA_F16_SS
#undef BIE_WGF4
#undef BIE_WGF16
#undef BIE_WGF32
#undef BIE_WGF64
#undef BIE_WGF128
#undef BIE_WGF72
#undef BIE_WG_NAMES32
#undef BIE_WG_NAMES72

// Keeps the compiler from moving float accumulator accesses across the asynchronous wgmma.
template <int N> __device__ __forceinline__ void fence_acc(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(d[i])::"memory");
}

// By the tile width.
template <int N>
__device__ __forceinline__ void wgmma_s8(int (&d)[N / 2], const unsigned (&a)[4], uint64_t b);
template <>
__device__ __forceinline__ void wgmma_s8<256>(int (&d)[128], const unsigned (&a)[4], uint64_t b) {
    wgmma_s8_64x256x32(d, a, b);
}
template <>
__device__ __forceinline__ void wgmma_s8<128>(int (&d)[64], const unsigned (&a)[4], uint64_t b) {
    wgmma_s8_64x128x32(d, a, b);
}

#undef BIE_WGD4
#undef BIE_WGD16
#undef BIE_WGD64
#undef BIE_WGD128
#undef BIE_WG_NAMES64
#undef BIE_WG_NAMES128

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace bie_cuda
