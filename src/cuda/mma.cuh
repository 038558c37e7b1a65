// Thin wrappers over the PTX instructions the binary kernels use, in one place.
#pragma once
#include <cstdint>

namespace bie_cuda {

__device__ __forceinline__ unsigned smem_u32(const void *p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy; with pred false the destination is zero-filled.
__device__ __forceinline__ void cp_async16(unsigned dst, const void *src, bool pred) {
    int bytes = pred ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Four 8x8 matrices of 16-byte rows: lane l receives 32-bit word (l % 4) of row (l / 4) of
// each matrix; lanes 8q..8q+7 give the row addresses of matrix q. For bit rows this is
// exactly the b1 mma fragment distribution (row = lane / 4, 32 bits at word lane % 4).
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// The same with each 8x8 matrix transposed on the way (lane l receives elements (l / 4, 2 (l % 4)
// and + 1) of the transpose: for 16-bit elements, the mma fragment of a matrix stored with its
// rows as columns), and the two-matrix form (lanes 0..15 give the addresses).
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2(unsigned &r0, unsigned &r1, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r0), "=r"(r1)
                 : "r"(addr));
}

// One 16-byte shared-memory load, whole: the compiler may not narrow it to the bytes a
// predicated use needs (it did, into 16 conflicting byte loads).
__device__ __forceinline__ uint4 lds128(unsigned addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(addr)
                 : "memory");
    return v;
}

// 8-byte shared load and 2- and 4-byte shared stores by shared-window address.
__device__ __forceinline__ uint2 lds64(unsigned addr) {
    uint2 v;
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n"
                 : "=r"(v.x), "=r"(v.y)
                 : "r"(addr)
                 : "memory");
    return v;
}
__device__ __forceinline__ void sts16(unsigned addr, unsigned short v) {
    asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(addr), "h"(v) : "memory");
}
__device__ __forceinline__ void sts32(unsigned addr, unsigned v) {
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

// Whole 8- and 16-byte global stores (the compiler split a vector store in two).
__device__ __forceinline__ void stg64(void *p, unsigned a, unsigned b) {
    asm volatile("st.global.v2.u32 [%0], {%1, %2};\n" ::"l"(p), "r"(a), "r"(b) : "memory");
}
__device__ __forceinline__ void stg128(void *p, unsigned a, unsigned b, unsigned c, unsigned d) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(a), "r"(b), "r"(c),
                 "r"(d)
                 : "memory");
}

// Four 8x8 matrices of 16-bit elements, each stored transposed: lane l holds elements (l / 4,
// 2 (l % 4) and + 1) of each matrix (the mma accumulator layout), and lanes 8q..8q+7 give the
// addresses of rows 0..7 of matrix q in memory, row k being the matrix's column k.
// Compute capability 9.0 and later (kStmatrix); callers store element by element before.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr bool kStmatrix = true;
#else
constexpr bool kStmatrix = false;
#endif
__device__ __forceinline__ void stmatrix_x4_trans(unsigned addr, unsigned r0, unsigned r1,
                                                  unsigned r2, unsigned r3) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile(
        "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
        "r"(r0), "r"(r1), "r"(r2), "r"(r3)
        : "memory");
#else
    __trap();
#endif
}

// One bulk copy of `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to
// shared memory by the copy engine, its completion counted on an mbarrier (compute capability
// 9.0 and later: kBulk; callers copy otherwise). One thread initializes the barrier for one
// arrival, fences the initialization, then arms it with the byte count and issues the copy;
// after a block barrier every thread may wait for phase 0 to complete.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr bool kBulk = true;
#else
constexpr bool kBulk = false;
#endif
__device__ __forceinline__ void bulk_load(unsigned dst, const void *src, unsigned bytes,
                                          unsigned bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], "
                 "%2, [%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
#else
    __trap();
#endif
}
__device__ __forceinline__ void bulk_wait(unsigned bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("{\n"
                 ".reg .pred done;\n"
                 "wait_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], 0;\n"
                 "@!done bra wait_%=;\n"
                 "}\n" ::"r"(bar)
                 : "memory");
#else
    __trap();
#endif
}

// c += popcount(A AND B) for a 16x8 tile over 256 bits (Hopper runs AND-popc at full rate).
__device__ __forceinline__ void mma_b1_and(int (&c)[4], const unsigned (&a)[4], unsigned b0,
                                           unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c += a * b for a 16x8 tile over k = 16 of 16-bit floats (bfloat16 or float16), f32
// accumulators. Fragments (g = lane / 4, t = lane % 4): a[0] rows g, k 2t..2t+1; a[1] row
// g + 8; a[2], a[3] the same at k + 8; b0 k 2t..2t+1 of column g, b1 at k + 8; c[0..1] row g,
// columns 2t..2t+1, c[2..3] row g + 8. The lower half of a register is the lower index.
__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                               unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_f16_16816(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                              unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace bie_cuda
