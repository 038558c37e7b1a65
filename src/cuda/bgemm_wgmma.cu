// Binary GEMM on Hopper's warpgroup MMA (wgmma b1 AND-popc, sm_90a): the products of
// bgemm.cu's kernels, dot = k - 2 popc(a) - 2 popc(b) + 4 popc(a AND b), at the rate of
// wgmma.m64n256k256 instead of the warp-level mma.m16n8k256 (kernel 120).
//
// A block computes a 128 x 256 output tile with two warpgroups (each 64 rows x all 256
// columns; A and B from shared memory, both K-major). Per k block of 1024 bits (128 bytes per
// row), cp.async brings the block's 128 A rows and 256 B rows into a ring of KSTAGES stages,
// laid out as wgmma reads them: 128-byte rows, 8-row groups of 1024 bytes, the 16-byte chunk
// c of row r at chunk c ^ (r % 8) (the 128-byte swizzle). Each warpgroup issues four wgmma
// (k 256 each) per k block and goes on while they run. A stage is refilled only after the
// wgmma that read it completed in both warpgroups (wait_group 1 in each, then the next step's
// barrier), so the copies run two k blocks ahead of the products.
//
// The accumulators are the mma.sync fragment layout per warp (16 rows, 4 words per 8
// columns): the epilogue is bgemm.cu's (store_dot, epilogue.cuh).
//
// The device code exists only in the sm_90a build of this file; wgmma_usable() tells the host
// whether the current device runs it. Rows are in the device GEMM layout (cuda_internal.h):
// ld a multiple of 256 bytes, zero-padded, with their popcounts.
#include <cuda_runtime.h>

#include <climits>

#include "cuda_common.cuh"
#include "cuda_internal.h"
#include "epilogue.cuh"
#include "mma.cuh"
#include "pdl.cuh"
#include "wgmma.cuh"
#include "wgmma_entry.cuh"

namespace bie_cuda {

namespace {

constexpr int kBM = 128, kBN = 256;
constexpr int kBKB = 128;  // bytes per row per k block (1024 bits, four wgmma k steps)
constexpr int KSTAGES = 4;
constexpr int kThreads = 256;
constexpr int kStage = (kBM + kBN) * kBKB;                       // bytes: A rows, then B rows
constexpr int kChunks = kStage / 16 / kThreads;                  // 16-byte copies per thread
constexpr size_t kSmem = 1024 + (size_t)KSTAGES * kStage;        // + the swizzle's alignment
static_assert(kChunks * kThreads * 16 == kStage, "copy split");  // 12 per thread
static_assert(kBKB == 128, "one 128-byte swizzle row per row and k block");

__global__ void __launch_bounds__(kThreads, 1)
    bgemm_b1_wgmma(int m, int n, int64_t k, const uint8_t *__restrict__ A,
                   const uint8_t *__restrict__ B, int64_t ld64, const int *__restrict__ pa,
                   const int *__restrict__ pb, int parts_a, int parts_b, int tiles_m, int tiles_n,
                   Epilogue ep) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ uint8_t smem[];
    const unsigned ring = (smem_u32(smem) + 1023) & ~1023u;
    const int kblocks = (int)(ld64 / kBKB);
    const int tid = threadIdx.x, lane = tid & 31, wg = tid >> 7;
    int tm, tn;
    grouped_tile(blockIdx.x, tiles_m, tiles_n, tm, tn);
    const int bm0 = tm * kBM, bn0 = tn * kBN;

    // This thread's copies: stage rows tid / 8 + 32 u (A rows 0..127, then B rows), chunk
    // tid % 8 of each, stored at chunk (tid % 8) ^ (row % 8). Rows past m (n) are zero-filled
    // from a valid address.
    const int q = tid & 7, r0 = tid >> 3;
    const uint8_t *src[kChunks];
    bool ok[kChunks];
    unsigned dst[kChunks];
#pragma unroll
    for (int u = 0; u < kChunks; u++) {
        const int r = r0 + 32 * u;  // row in the stage
        const bool is_a = r < kBM;
        const int row = is_a ? bm0 + r : bn0 + (r - kBM), limit = is_a ? m : n;
        src[u] = (is_a ? A : B) + (size_t)(unsigned)min(row, limit - 1) * (size_t)ld64 + 16 * q;
        ok[u] = row < limit;
        dst[u] = (unsigned)(r * kBKB + ((q ^ (r & 7)) << 4));
    }
    auto load = [&](int kb) {
        const unsigned base = ring + (unsigned)((kb % KSTAGES) * kStage);
#pragma unroll
        for (int u = 0; u < kChunks; u++)
            cp_async16(base + dst[u], src[u] + (size_t)kb * kBKB, ok[u]);
    };

    int d[128];
#pragma unroll
    for (int i = 0; i < 128; i++) d[i] = 0;

    pdl_wait();  // A, B and their popcounts may come from the kernel just before (pdl.cuh)
#pragma unroll
    for (int s = 0; s < 2; s++) {
        if (s < kblocks) load(s);
        cp_async_commit();
    }
    for (int kb = 0; kb < kblocks; kb++) {
        cp_async_wait<1>();   // this thread's copies of k block kb are in (kb + 1 may not be)
        fence_proxy_async();  // visible to the wgmma (async proxy)
        __syncthreads();      // everyone's copies of kb; both warpgroups past wait_group 1 of
                              // kb - 1, so the stage of kb - 2 is free
        if (kb + 2 < kblocks) load(kb + 2);
        cp_async_commit();
        const unsigned stage = ring + (unsigned)((kb % KSTAGES) * kStage);
        const unsigned a_tile = stage + (unsigned)(wg * 64 * kBKB), b_tile = stage + kBM * kBKB;
        fence_acc(d);
        wgmma_fence();
#pragma unroll
        for (int s = 0; s < kBKB / 32; s++)
            wgmma_b1_64x256x256(d, smem_desc(a_tile + 32 * s, 16, 1024, 1),
                                smem_desc(b_tile + 32 * s, 16, 1024, 1));
        wgmma_commit();
        wgmma_wait<1>();
        fence_acc(d);
    }
    wgmma_wait<0>();
    fence_acc(d);
    cp_async_wait<0>();

    // Epilogue: rows g and g + 8 of this warp's 16, columns 8 j + 2 t (+1) of the tile. The
    // row popcounts are read once before the stores; the column ones once per column pair.
    const float scale = ep.scale();
    const int g = lane >> 2, t4 = lane & 3, wrow = bm0 + wg * 64 + ((tid >> 5) & 3) * 16 + g;
    int prow[2];
    OutRow orow[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int row = wrow + 8 * h;
        prow[h] = row < m ? row_popc(pa, row, parts_a) : 0;
        orow[h] = ep.row(row < m ? row : 0);
    }
#pragma unroll
    for (int j = 0; j < kBN / 8; j++) {
        const int col = bn0 + j * 8 + 2 * t4;
        if (col >= n) continue;
        const int pc0 = row_popc(pb, col, parts_b);
        const int pc1 = col + 1 < n ? row_popc(pb, col + 1, parts_b) : 0;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            if (wrow + 8 * h >= m) continue;
            store_dot(ep, orow[h], col, k, prow[h], pc0, d[4 * j + 2 * h], scale);
            if (col + 1 < n)
                store_dot(ep, orow[h], col + 1, k, prow[h], pc1, d[4 * j + 2 * h + 1], scale);
        }
    }
#else
    (void)m, (void)n, (void)k, (void)A, (void)B, (void)ld64, (void)pa, (void)pb, (void)parts_a,
        (void)parts_b, (void)tiles_m, (void)tiles_n, (void)ep;
#endif
}

}  // namespace

size_t bgemm_wgmma_smem() { return kSmem; }

bie_status bgemm_wgmma_launch(int64_t m, int64_t n, int64_t k, const uint8_t *a, const uint8_t *b,
                              int64_t ld, const int *pa, int parts_a, const int *pb, int parts_b,
                              const Epilogue &ep) {
    static const char *who = "cuda binary gemm (wgmma)";
    int64_t tiles_m = 0, tiles_n = 0;
    BIE_CUDA_TRY(wgmma_grid(who, m, n, ld, kBM, kBN, kBKB, kSmem, &tiles_m, &tiles_n));
    BIE_CUDA_TRY(
        check(cudaFuncSetAttribute(reinterpret_cast<const void *>(bgemm_b1_wgmma),
                                   cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kSmem),
              "cudaFuncSetAttribute"));
    BIE_CUDA_TRY(check(launch_after(bgemm_b1_wgmma, dim3((unsigned)(tiles_m * tiles_n)),
                                    dim3(kThreads), kSmem, (int)m, (int)n, k, a, b, ld, pa, pb,
                                    parts_a, parts_b, (int)tiles_m, (int)tiles_n, ep),
                       who));
    return check(cudaGetLastError(), who);
}

}  // namespace bie_cuda
