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
// The grid is persistent (one block per SM, tiles blockIdx.x, + gridDim.x, ...): the copy
// ring runs on across tiles, so the next tile's first k blocks arrive during this tile's
// epilogue. A tile's row and column popcounts go to shared memory while its first products
// run. The epilogue is warpgroup_epilogue (bgemm_wgmma.cuh, shared with kernel 121): through
// the two ring stages no copy is using, stored four columns at a time.
//
// The device code exists only in the sm_90a build of this file; wgmma_usable() tells the host
// whether the current device runs it. Rows are in the device GEMM layout (cuda_internal.h):
// ld a multiple of 256 bytes, zero-padded, with their popcounts.
#include <cuda_runtime.h>

#include <algorithm>

#include "bgemm_wgmma.cuh"
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
static_assert(kStgBytes <= kStage, "a warpgroup's staging fits one stage");

__global__ void __launch_bounds__(kThreads, 1)
    bgemm_b1_wgmma(int m, int n, int64_t k, const uint8_t *__restrict__ A,
                   const uint8_t *__restrict__ B, int64_t ld64, const int *__restrict__ pa,
                   const int *__restrict__ pb, int parts_a, int parts_b, int tiles_m, int tiles_n,
                   Epilogue ep) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ uint8_t smem[];
    __shared__ int pop_a[kBM], pop_b[kBN];  // the current tile's row and column popcounts
    const unsigned ring = (smem_u32(smem) + 1023) & ~1023u;
    const int kblocks = (int)(ld64 / kBKB);
    const int tid = threadIdx.x, wg = tid >> 7;
    // Tiles blockIdx.x, + gridDim.x, ... (grouped_tile order); steps (tile, k block) run as one
    // sequence, so the copies of the next tile's first k blocks overlap this tile's epilogue.
    const int my_tiles =
        (tiles_m * tiles_n - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;
    const int steps = my_tiles * kblocks;
    auto origin = [&](int j, int &bm0, int &bn0) {
        int tm, tn;
        grouped_tile((int)blockIdx.x + j * (int)gridDim.x, tiles_m, tiles_n, tm, tn);
        bm0 = tm * kBM, bn0 = tn * kBN;
    };

    // This thread's copies: stage rows tid / 8 + 32 u (A rows 0..127 for u < 4, then B rows),
    // chunk tid % 8 of each, stored at chunk (tid % 8) ^ (row % 8). Rows past m (n) are
    // zero-filled from a valid address.
    const int q = tid & 7, r0 = tid >> 3;
    auto load = [&](int i) {
        const int j = i / kblocks, kb = i - j * kblocks;
        int bm0, bn0;
        origin(j, bm0, bn0);
        const unsigned base = ring + (unsigned)((i % KSTAGES) * kStage);
#pragma unroll
        for (int u = 0; u < kChunks; u++) {
            const int r = r0 + 32 * u;  // row in the stage
            const bool is_a = u < kBM / 32;
            const int row = is_a ? bm0 + r : bn0 + (r - kBM), limit = is_a ? m : n;
            const uint8_t *src = (is_a ? A : B) +
                                 (size_t)(unsigned)min(row, limit - 1) * (size_t)ld64 + 16 * q +
                                 (size_t)kb * kBKB;
            cp_async16(base + (unsigned)(r * kBKB + ((q ^ (r & 7)) << 4)), src, row < limit);
        }
    };

    pdl_wait();  // A, B and their popcounts may come from the kernel just before (pdl.cuh)
#pragma unroll
    for (int s = 0; s < 2; s++) {
        if (s < steps) load(s);
        cp_async_commit();
    }
    const float scale = ep.scale();
    const bool fast = rows4_ok(ep, n, k);  // the four-column stores (bgemm_wgmma.cuh)
    int d[128];
    for (int j = 0, i = 0; j < my_tiles; j++) {
        int bm0, bn0;
        origin(j, bm0, bn0);
#pragma unroll
        for (int x = 0; x < 128; x++) d[x] = 0;
        for (int kb = 0; kb < kblocks; kb++, i++) {
            cp_async_wait<1>();   // this thread's copies of step i are in (i + 1 may not be)
            fence_proxy_async();  // visible to the wgmma (async proxy)
            __syncthreads();      // everyone's copies of i; both warpgroups past wait_group 1
                                  // of i - 1, so the stage of i - 2 is free; the last
                                  // epilogue's popcount reads are done
            if (i + 2 < steps) load(i + 2);
            cp_async_commit();
            const unsigned stage = ring + (unsigned)((i % KSTAGES) * kStage);
            const unsigned a_tile = stage + (unsigned)(wg * 64 * kBKB), b_tile = stage + kBM * kBKB;
            fence_acc(d);
            wgmma_fence();
#pragma unroll
            for (int s = 0; s < kBKB / 32; s++)
                wgmma_b1_64x256x256(d, smem_desc(a_tile + 32 * s, 16, 1024, 1),
                                    smem_desc(b_tile + 32 * s, 16, 1024, 1));
            wgmma_commit();
            if (kb == 0) {  // the popcounts, read while the products run
                pop_b[tid] = bn0 + tid < n ? row_popc(pb, bn0 + tid, parts_b) : 0;
                if (tid < kBM) pop_a[tid] = bm0 + tid < m ? row_popc(pa, bm0 + tid, parts_a) : 0;
            }
            wgmma_wait<1>();
            fence_acc(d);
        }
        wgmma_wait<0>();
        fence_acc(d);
        __syncthreads();  // the popcounts

        // The epilogue, through the two stages no copy is using (those of the tile's last
        // two k blocks: one per warpgroup).
        int *stg = reinterpret_cast<int *>(smem + (ring - smem_u32(smem)) +
                                           (size_t)(((i + 2 + wg) % KSTAGES) * kStage));
        warpgroup_epilogue(d, stg, pop_a + wg * 64, pop_b, bm0 + wg * 64, bn0, m, n, k, ep, scale,
                           fast, wg + 1);
    }
    cp_async_wait<0>();
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
    const int64_t blocks = std::min<int64_t>(tiles_m * tiles_n, device_sms());
    BIE_CUDA_TRY(check(
        launch_after(bgemm_b1_wgmma, dim3((unsigned)blocks), dim3(kThreads), kSmem, (int)m, (int)n,
                     k, a, b, ld, pa, pb, parts_a, parts_b, (int)tiles_m, (int)tiles_n, ep),
        who));
    return check(cudaGetLastError(), who);
}

}  // namespace bie_cuda
