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
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
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

// c += popcount(A AND B) for a 16x8 tile over 256 bits (Hopper runs AND-popc at full rate).
__device__ __forceinline__ void mma_b1_and(int (&c)[4], const unsigned (&a)[4], unsigned b0,
                                           unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace bie_cuda
