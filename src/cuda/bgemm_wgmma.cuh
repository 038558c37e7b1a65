// The epilogue of the binary wgmma GEMM kernels (bgemm_wgmma.cu: kernel 120, bgemm_tma.cu:
// kernel 121): one warpgroup's 64 x 256 block of AND-popc accumulators (the wgmma m64n256
// layout: per warp 16 rows, per 8 columns four words) becomes dot = k - 2 popc(row) -
// 2 popc(col) + 4 acc, (float)dot * scale in the output dtype. sm_90a code only.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "epilogue.cuh"

namespace bie_cuda {

constexpr int kStgPitch = 128 + 8;  // staging row (ints): 64 rows x 128 columns per warpgroup
constexpr int kStgBytes = 64 * kStgPitch * 4;

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Barrier of the 128 threads of one warpgroup (named barrier id >= 1; 0 is __syncthreads').
__device__ __forceinline__ void warpgroup_barrier(int id) {
    asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory");
}

// Four columns col.. of rows row0 + er + 4 it (it < 16, rows < m) of a row-major output of
// dtype T: dot = kk - 2 popc(row) - 2 popc(col) + 4 acc, with the accumulators from the
// staging rows (stg[r * kStgPitch + ec]) and cb[e] = -2 popc(col + e); as the scalar
// epilogue, (float)dot * scale rounded to T. One 16-byte (f32) or 8-byte store a row. DOT: the
// accumulators are the dot products (kk and rows_pop unused, cb zero).
template <int T, bool DOT>
__device__ __forceinline__ void store_rows4(const Epilogue &ep, const int *stg, const int *rows_pop,
                                            int er, int ec, int row0, int m, int col, int kk,
                                            const int (&cb)[4], float scale) {
    constexpr int kMul = DOT ? 1 : 4;
    for (int it = 0; it < 16; it++) {
        const int r = er + 4 * it;
        if (row0 + r >= m) break;
        const int base = DOT ? 0 : kk - 2 * rows_pop[r];
        const int4 v = *reinterpret_cast<const int4 *>(stg + r * kStgPitch + ec);
        const float f0 = (float)(base + cb[0] + kMul * v.x) * scale,
                    f1 = (float)(base + cb[1] + kMul * v.y) * scale,
                    f2 = (float)(base + cb[2] + kMul * v.z) * scale,
                    f3 = (float)(base + cb[3] + kMul * v.w) * scale;
        store_out4(ep.out, (int64_t)(row0 + r) * ep.n + col, f0, f1, f2, f3, 4, true, T);
    }
}

// Whether the four-column stores apply: row-major output in whole, 16-byte-aligned groups of
// four, and dot products that fit an int. Anything else takes Epilogue::store2.
__device__ __forceinline__ bool rows4_ok(const Epilogue &ep, int n, int64_t k) {
    return ep.conv.plane == 0 && n % 4 == 0 && (reinterpret_cast<uintptr_t>(ep.out) & 15) == 0 &&
           k < (1LL << 28);
}

// The warpgroup's rows row0 .. row0 + 63 (popcounts rows_pop[0..63]) and columns bn0 ..
// bn0 + 255 (popcounts pop_b[0..255], visible to the warpgroup), through its staging area stg
// (kStgBytes), 128 columns at a time: the accumulators go to shared memory as they lie in
// registers, then each warp takes whole rows and stores them four columns at a time. The code
// stays small (no per-dtype copy of 128 unrolled stores) and the global stores contiguous.
// bar: the warpgroup's named barrier. Ends with the staging area and the popcounts read.
// DOT: the accumulators are the dot products themselves (the 4-bit kernel on int8 codes: no
// popcounts, rows_pop and pop_b unused), else AND popcounts turned into ±1 dot products.
template <bool DOT = false>
__device__ __forceinline__ void warpgroup_epilogue(const int (&d)[128], int *stg,
                                                   const int *rows_pop, const int *pop_b, int row0,
                                                   int bn0, int m, int n, int64_t k,
                                                   const Epilogue &ep, float scale, bool fast,
                                                   int bar) {
    const int wt = threadIdx.x & 127, lane = wt & 31, er = wt >> 5, ec = 4 * lane;
    const int wr = (wt >> 5) * 16 + (lane >> 2), t4 = lane & 3;  // this thread's rows (+ 8)
#pragma unroll
    for (int half = 0; half < 2; half++) {
#pragma unroll
        for (int c = 0; c < 16; c++)
#pragma unroll
            for (int h = 0; h < 2; h++)
                *reinterpret_cast<int2 *>(stg + (wr + 8 * h) * kStgPitch + 8 * c + 2 * t4) =
                    make_int2(d[4 * (c + 16 * half) + 2 * h], d[4 * (c + 16 * half) + 2 * h + 1]);
        warpgroup_barrier(bar);
        const int cl = 128 * half + ec, col = bn0 + cl;
        if (fast) {
            const int cb[4] = {DOT ? 0 : -2 * pop_b[cl], DOT ? 0 : -2 * pop_b[cl + 1],
                               DOT ? 0 : -2 * pop_b[cl + 2], DOT ? 0 : -2 * pop_b[cl + 3]};
            const int kk = (int)k;
            if (col < n) {
                if (ep.out_type == kOutF32)
                    store_rows4<kOutF32, DOT>(ep, stg, rows_pop, er, ec, row0, m, col, kk, cb,
                                              scale);
                else if (ep.out_type == kOutBF16)
                    store_rows4<kOutBF16, DOT>(ep, stg, rows_pop, er, ec, row0, m, col, kk, cb,
                                               scale);
                else
                    store_rows4<kOutF16, DOT>(ep, stg, rows_pop, er, ec, row0, m, col, kk, cb,
                                              scale);
            }
        } else {
            for (int it = 0; it < 16; it++) {
                const int r = er + 4 * it, row = row0 + r;
                if (row >= m || col >= n) continue;
                const OutRow orow = ep.row(row);
                const int4 v = *reinterpret_cast<const int4 *>(stg + r * kStgPitch + ec);
                const int acc[4] = {v.x, v.y, v.z, v.w};
                if constexpr (DOT) {
#pragma unroll
                    for (int e = 0; e < 4; e += 2) {
                        if (col + e + 1 < n)
                            ep.store2(orow, col + e, acc[e], acc[e + 1], scale);
                        else if (col + e < n)
                            ep.store(orow, col + e, acc[e], scale);
                    }
                    continue;
                }
                const long long base = k - 2LL * rows_pop[r];
#pragma unroll
                for (int e = 0; e < 4; e += 2) {
                    const long long d0 = base - 2LL * pop_b[cl + e] + 4LL * acc[e];
                    if (col + e + 1 < n)
                        ep.store2(orow, col + e, d0,
                                  base - 2LL * pop_b[cl + e + 1] + 4LL * acc[e + 1], scale);
                    else if (col + e < n)
                        ep.store(orow, col + e, d0, scale);
                }
            }
        }
        warpgroup_barrier(bar);  // this half's readback is done
    }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace bie_cuda
