// Binary GEMM on Hopper's warpgroup MMA with TMA loads and warp specialization (kernel 121,
// sm_90a): kernel 120's products (bgemm_wgmma.cu: 128 x 256 tiles of
// wgmma.m64n256k256.s32.b1.b1.and.popc, persistent blocks, the same epilogue), with the
// operands brought by the tensor memory accelerator instead of every thread's cp.async.
//
// A block has three warpgroups. The first is the producer: after giving up most of its
// registers, one of its threads walks the block's (tile, k block) sequence and, for each,
// waits until the ring stage is free, then issues two bulk tensor copies (the tile's 128 A
// rows and 256 B rows of 128 bytes, 128-byte-swizzled by the copy itself) that complete on
// the stage's "full" barrier. The other two are consumers (64 rows of the tile each): they
// wait on "full", issue four wgmma, and once those have completed (wait_group 1 at the next
// k block, or 0 at the tile's end) release the stage on its "empty" barrier (one arrival per
// warpgroup). No block-wide barrier runs in the main loop, and the producer fills the stages
// of the next tile while the consumers run this tile's epilogue (each warpgroup through its
// own staging area: bgemm_wgmma.cuh).
//
// The same pipeline serves the 4-bit GEMM on int8 codes (4-bit kernel 211): a k block is then
// 128 codes, four wgmma.m64n256k32.s32.s8.s8 with both operands in shared memory, and the
// accumulators are the dot products themselves.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>

#include "bgemm_wgmma.cuh"
#include "cuda_common.cuh"
#include "cuda_internal.h"
#include "epilogue.cuh"
#include "mma.cuh"
#include "pdl.cuh"
#include "tma.cuh"
#include "wgmma.cuh"
#include "wgmma_entry.cuh"

namespace bie_cuda {

namespace {

constexpr int kBM = 128, kBN = 256;
constexpr int kBKB = 128;  // bytes per row per k block (1024 bits, four wgmma k steps)
constexpr int kStages = 3;
constexpr int kThreads = 384;  // producer warpgroup + two consumer warpgroups
constexpr int kStageA = kBM * kBKB, kStage = (kBM + kBN) * kBKB;
// Shared memory after the 1024-byte alignment: the ring, two staging areas, the popcounts of
// each consumer (256 columns, 64 rows), the full and empty barriers.
constexpr int kRingBytes = kStages * kStage;
constexpr int kPopOffset = kRingBytes + 2 * kStgBytes;
constexpr int kBarOffset = kPopOffset + 2 * (kBN + 64) * 4;
constexpr size_t kSmem = 1024 + (size_t)kBarOffset + 2 * kStages * 8;
static_assert(kStage % 1024 == 0 && kStageA % 1024 == 0, "stages keep the swizzle alignment");
static_assert(kStgBytes % 16 == 0, "staging areas 16-byte aligned");

// Q4: the 4-bit GEMM on int8 codes (rows of ld bytes, one code a byte, zero past k): the same
// ring, wgmma.m64n256k32.s32.s8.s8 with both operands in shared memory (32 bytes of k each, as
// the b1 form's 256 bits), no popcounts, and the accumulators stored as the dot products.
template <bool Q4>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_tma(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
             int m, int n, int64_t k, int64_t ld64, const int *__restrict__ pa,
             const int *__restrict__ pb, int parts_a, int parts_b, int tiles_m, int tiles_n,
             Epilogue ep) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ uint8_t smem[];
    const unsigned base = (smem_u32(smem) + 1023) & ~1023u;
    uint8_t *gbase = smem + (base - smem_u32(smem));  // the same address, generic
    const unsigned full0 = base + kBarOffset, empty0 = full0 + kStages * 8;
    const int tid = threadIdx.x, wg = tid >> 7;
    const int kblocks = (int)(ld64 / kBKB);
    const int my_tiles =
        (tiles_m * tiles_n - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;
    auto origin = [&](int j, int &bm0, int &bn0) {
        int tm, tn;
        grouped_tile((int)blockIdx.x + j * (int)gridDim.x, tiles_m, tiles_n, tm, tn);
        bm0 = tm * kBM, bn0 = tn * kBN;
    };
    if (tid == 0) {
        tma_ring_init(full0, empty0, kStages, 2);
        mbar_init_fence();
    }
    __syncthreads();
    pdl_wait();  // A, B and their popcounts may come from the kernel just before (pdl.cuh)

    if (wg == 0) {  // the producer
        setmaxnreg_dec<40>();
        if (tid == 0)
            tma_ring_produce(&map_a, &map_b, my_tiles, kblocks, kBKB, kStages, kStage, kStageA,
                             base, full0, empty0, origin);
        return;
    }

    // A consumer: rows 64 c .. of each tile.
    setmaxnreg_inc<232>();
    const int c = wg - 1, wt = tid & 127;
    int *stg = reinterpret_cast<int *>(gbase + kRingBytes + c * kStgBytes);
    int *pop_b = reinterpret_cast<int *>(gbase + kPopOffset) + c * (kBN + 64);
    int *pop_a = pop_b + kBN;
    const float scale = ep.scale();
    const bool fast = rows4_ok(ep, n, k);
    int d[128];
    for (int j = 0, i = 0; j < my_tiles; j++) {
        int bm0, bn0;
        origin(j, bm0, bn0);
#pragma unroll
        for (int x = 0; x < 128; x++) d[x] = 0;
        for (int kb = 0; kb < kblocks; kb++, i++) {
            const int s = i % kStages;
            mbar_wait(full0 + 8 * s, (unsigned)(i / kStages) & 1u);
            const unsigned stage = base + (unsigned)(s * kStage);
            const unsigned a_tile = stage + (unsigned)(c * 64 * kBKB), b_tile = stage + kStageA;
            fence_acc(d);
            wgmma_fence();
#pragma unroll
            for (int q = 0; q < kBKB / 32; q++) {
                const uint64_t da = smem_desc(a_tile + 32 * q, 16, 1024, 1),
                               db = smem_desc(b_tile + 32 * q, 16, 1024, 1);
                if constexpr (Q4)
                    wgmma_s8_ss_64x256x32(d, da, db);
                else
                    wgmma_b1_64x256x256(d, da, db);
            }
            wgmma_commit();
            if (!Q4 && kb == 0) {  // the popcounts, read while the products run (the last epilogue
                                   // ended with the warpgroup past its reads of them)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int col = bn0 + wt + 128 * h;
                    pop_b[wt + 128 * h] = col < n ? row_popc(pb, col, parts_b) : 0;
                }
                if (wt < 64) {
                    const int row = bm0 + c * 64 + wt;
                    pop_a[wt] = row < m ? row_popc(pa, row, parts_a) : 0;
                }
            }
            wgmma_wait<1>();
            fence_acc(d);
            if (kb > 0 && wt == 0) mbar_arrive(empty0 + 8 * ((i - 1) % kStages));
        }
        wgmma_wait<0>();
        fence_acc(d);
        if (wt == 0) mbar_arrive(empty0 + 8 * ((i - 1) % kStages));
        warpgroup_barrier(c + 1);  // the popcounts
        warpgroup_epilogue<Q4>(d, stg, pop_a, pop_b, bm0 + c * 64, bn0, m, n, k, ep, scale, fast,
                               c + 1);
    }
#else
    (void)map_a, (void)map_b, (void)m, (void)n, (void)k, (void)ld64, (void)pa, (void)pb,
        (void)parts_a, (void)parts_b, (void)tiles_m, (void)tiles_n, (void)ep;
#endif
}

PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
    static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
        void *p = nullptr;
        cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                             &q) != cudaSuccess ||
            q != cudaDriverEntryPointSuccess) {
            cudaGetLastError();
            p = nullptr;
        }
        return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
    }();
    return fn;
}

}  // namespace

namespace {

// A tensor map of bytes (rank dims, the innermost first) read in 128-byte-swizzled boxes (or, with
// swizzle false, boxes stored as they lie), parts outside the tensor zero-filled.
bool encode_swizzled(CUtensorMap *map, const void *base, cuuint32_t rank, const cuuint64_t *dims,
                     const cuuint64_t *strides, const cuuint32_t *box,
                     const cuuint32_t *unit = nullptr, bool swizzle = true) {
    const PFN_cuTensorMapEncodeTiled_v12000 fn = encode_tiled();
    const cuuint32_t ones[4] = {1, 1, 1, 1};
    if (unit == nullptr) unit = ones;
    return fn != nullptr && fn(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, rank, const_cast<void *>(base),
                               dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                               swizzle ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
                               CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace

bool tma_map_rows(CUtensorMap *map, const void *base, int64_t rows, int64_t ld, int box_rows) {
    if (rows < 1 || ld % 16 != 0) return false;
    const cuuint64_t dims[2] = {(cuuint64_t)ld, (cuuint64_t)rows};
    const cuuint64_t strides[1] = {(cuuint64_t)ld};
    const cuuint32_t box[2] = {128, (cuuint32_t)box_rows};
    return encode_swizzled(map, base, 2, dims, strides, box);
}

bool tma_map_bytes(CUtensorMap *map, const void *base, int64_t rows, int64_t ld, int box_bytes,
                   int box_rows) {
    if (rows < 1 || ld % 16 != 0 || box_bytes % 16 != 0) return false;
    const cuuint64_t dims[2] = {(cuuint64_t)ld, (cuuint64_t)rows};
    const cuuint64_t strides[1] = {(cuuint64_t)ld};
    const cuuint32_t box[2] = {(cuuint32_t)box_bytes, (cuuint32_t)box_rows};
    return encode_swizzled(map, base, 2, dims, strides, box, nullptr, false);
}

bool tma_map_nhwc(CUtensorMap *map, const void *base, int64_t n, int64_t h, int64_t w, int64_t ld,
                  int bw, int bh, int bn, int step) {
    if (n < 1 || h < 1 || w < 1 || ld % 16 != 0 || step < 1 || step > 8 || bw * step > 256 ||
        bh * step > 256 || bn > 256)
        return false;
    const cuuint64_t dims[4] = {(cuuint64_t)ld, (cuuint64_t)w, (cuuint64_t)h, (cuuint64_t)n};
    const cuuint64_t strides[3] = {(cuuint64_t)ld, (cuuint64_t)(ld * w), (cuuint64_t)(ld * w * h)};
    // A box traverses bw x bh pixels `step` apart: boxDim counts the elements it spans.
    const cuuint32_t box[4] = {128, (cuuint32_t)(bw * step), (cuuint32_t)(bh * step),
                               (cuuint32_t)bn},
                     unit[4] = {1, (cuuint32_t)step, (cuuint32_t)step, 1};
    return encode_swizzled(map, base, 4, dims, strides, box, unit);
}

size_t bgemm_tma_smem() { return kSmem; }

bool bgemm_tma_usable() { return wgmma_usable() && encode_tiled() != nullptr; }

namespace {

template <bool Q4>
bie_status launch(const char *who, int64_t m, int64_t n, int64_t k, const uint8_t *a,
                  const uint8_t *b, int64_t ld, const int *pa, int parts_a, const int *pb,
                  int parts_b, const Epilogue &ep) {
    int64_t tiles_m = 0, tiles_n = 0;
    BIE_CUDA_TRY(wgmma_grid(who, m, n, ld, kBM, kBN, kBKB, kSmem, &tiles_m, &tiles_n));
    CUtensorMap map_a, map_b;
    if (!tma_map_rows(&map_a, a, m, ld, kBM) || !tma_map_rows(&map_b, b, n, ld, kBN))
        return bie_fail(BIE_ERR_UNSUPPORTED, "%s: the driver cannot describe the operands", who);
    BIE_CUDA_TRY(
        check(cudaFuncSetAttribute(reinterpret_cast<const void *>(gemm_tma<Q4>),
                                   cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kSmem),
              "cudaFuncSetAttribute"));
    const int64_t blocks = std::min<int64_t>(tiles_m * tiles_n, device_sms());
    BIE_CUDA_TRY(check(launch_after(gemm_tma<Q4>, dim3((unsigned)blocks), dim3(kThreads), kSmem,
                                    map_a, map_b, (int)m, (int)n, k, ld, pa, pb, parts_a, parts_b,
                                    (int)tiles_m, (int)tiles_n, ep),
                       who));
    return check(cudaGetLastError(), who);
}

}  // namespace

bie_status bgemm_tma_launch(int64_t m, int64_t n, int64_t k, const uint8_t *a, const uint8_t *b,
                            int64_t ld, const int *pa, int parts_a, const int *pb, int parts_b,
                            const Epilogue &ep) {
    return launch<false>("cuda binary gemm (wgmma, TMA)", m, n, k, a, b, ld, pa, parts_a, pb,
                         parts_b, ep);
}

bie_status q4gemm_tma_launch(int64_t m, int64_t n, int64_t k, const int8_t *a, const int8_t *b,
                             int64_t ld, const Epilogue &ep) {
    return launch<true>("cuda 4-bit gemm (int8 codes, wgmma, TMA)", m, n, k,
                        reinterpret_cast<const uint8_t *>(a), reinterpret_cast<const uint8_t *>(b),
                        ld, nullptr, 0, nullptr, 0, ep);
}

}  // namespace bie_cuda
