// The binary linear layer's opt-in FP8 backward products with the passes after them in their
// epilogues (sm_90a): kernel 121's pipeline (bgemm_tma.cu: persistent blocks, a TMA producer
// warpgroup, two consumer warpgroups of 64 rows, a three-stage ring of 128-byte k blocks) on
// e4m3 rows, four wgmma.m64n256k32.f32.e4m3.e4m3 a k block, f32 accumulators (the tensor
// cores sum the whole reduction in their own accumulator: below f32, bie.h).
//
// out [M][N] = alpha A B^T with A [M][K] and B [N][K] e4m3 rows of K bytes (K-major both, the
// only layout 8-bit wgmma reads; the tensor maps zero-fill past K) and alpha = *s0 * *s1 (the
// layer's scale and grad_out's dequantization factor, read on the device).
// Two epilogues:
// - the mask (grad_x): each value rounded to the output dtype, zero where the clip bit is
//   clear, stored (unless out is NULL); per consumer warpgroup of a tile row (64 rows) the
//   column sums of those values (as stored) and of their products
//   with sign(x') into part_sum / part_dot [2 tiles_m][N] (each column of a part written by
//   the one block that owns it);
// - the store (grad_w): the f32 values and, per block, the largest |value| into
//   amax_part[blockIdx.x] (entries past the grid zero), ready for quantize_i8_partials.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>

#include "backward_common.cuh"
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
constexpr int kBKB = 128;  // bytes per row per k block: four wgmma k steps of 32 bytes
constexpr int kStages = 3;
constexpr int kThreads = 384;  // producer warpgroup + two consumer warpgroups
constexpr int kStageA = kBM * kBKB, kStage = (kBM + kBN) * kBKB;
// Shared memory after the 1024-byte alignment: the ring, the two consumers' staging areas
// (bgemm_wgmma.cuh's), their tiles' clip and sign words (64 rows x 8 + 8 words each, the mask
// epilogue), the full and empty barriers.
constexpr int kRingBytes = kStages * kStage;
constexpr int kBitsBytes = 64 * 16 * 4;
constexpr int kBitsOffset = kRingBytes + 2 * kStgBytes;
constexpr int kBarOffset = kBitsOffset + 2 * kBitsBytes;
constexpr size_t kSmem = 1024 + (size_t)kBarOffset + 2 * kStages * 8;
static_assert(kStage % 1024 == 0 && kStageA % 1024 == 0, "stages keep the swizzle alignment");

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// v as the output dtype gives it back.
__device__ __forceinline__ float as_stored(float v, int type) {
    return type == kOutBF16  ? __bfloat162float(__float2bfloat16(v))
           : type == kOutF16 ? __half2float(__float2half(v))
                             : v;
}

// The mask epilogue's clip and sign words of a warpgroup's 64 rows (row0..) and 256 columns
// (bn0..) into bits [64][16] (8 clip words, then 8 sign words a row): two 16-byte copies a
// thread, in flight during the tile's products (cp.async; rows past M are not copied). Rows of
// ld bytes, ld a multiple of 32, so a row's 32 bytes from bn0 / 8 lie inside it.
__device__ __forceinline__ void fetch_bits(const BwdGemmArgs &p, unsigned bits, int row0, int bn0) {
    const int wt = threadIdx.x & 127;
#pragma unroll
    for (int q = 0; q < 2; q++) {
        const int id = wt + 128 * q, r = id >> 2, which = (id >> 1) & 1, part = id & 1;
        const int row = row0 + r;
        if (row >= p.M) continue;
        const uint8_t *src = (which ? p.signs : p.mask) + (int64_t)row * p.ld + bn0 / 8 + 16 * part;
        cp_async16(bits + (unsigned)((r * 16 + which * 8 + part * 4) * 4), src, true);
    }
    cp_async_commit();
}

// One warpgroup's 64 x 256 accumulators (rows row0.., columns bn0..; the wgmma m64n256
// layout) through its staging area, 128 columns at a time. bar: the warpgroup's named barrier.
// - store (grad_w), as warpgroup_epilogue: warp er takes rows er, er + 4, .., each lane four
//   consecutive columns;
// - MASK (grad_x): warp er takes the 32 columns 32 er.. of every row, lane l the four columns
//   4 (l % 8).. of rows 4 it + l / 8, so that a column's sum is the warp's own (two shuffles)
//   and each lane reads one clip word and one sign word a row. bits holds the tile's words
//   (fetch_bits, waited for here); part is the tile row's part of this warpgroup.
template <bool MASK>
__device__ __forceinline__ void bwd_epilogue(const float (&d)[128], float *stg,
                                             const unsigned *bits, int row0, int bn0, int64_t part,
                                             const BwdGemmArgs &p, float alpha, float &amax,
                                             int bar) {
    const int wt = threadIdx.x & 127, lane = wt & 31, er = wt >> 5;
    const int wr = er * 16 + (lane >> 2), t4 = lane & 3;  // this thread's accumulator rows
    const int M = (int)p.M, N = (int)p.N;
    const int type = MASK ? p.out_type : (int)kOutF32;
    const size_t elem = type == kOutF32 ? 4 : 2;
    const bool aligned = p.out && reinterpret_cast<uintptr_t>(p.out) % (4 * elem) == 0;
    // this lane's first column in the half, its first row and the step between its rows
    const int ec = MASK ? 32 * er + 4 * (lane & 7) : 4 * lane;
    const int r0 = MASK ? lane >> 3 : er;
    if constexpr (MASK) cp_async_wait<0>();  // this thread's copies; the barrier below: all
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int col = bn0 + 128 * half + ec;
        const int word = MASK ? 4 * half + er : 0, sh = ec & 31;
#pragma unroll
        for (int c = 0; c < 16; c++)
#pragma unroll
            for (int h = 0; h < 2; h++)
                *reinterpret_cast<float2 *>(stg + (wr + 8 * h) * kStgPitch + 8 * c + 2 * t4) =
                    make_float2(d[4 * (c + 16 * half) + 2 * h], d[4 * (c + 16 * half) + 2 * h + 1]);
        warpgroup_barrier(bar);
        float cs[4] = {0.0f, 0.0f, 0.0f, 0.0f}, cd[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (col < N) {
#pragma unroll
            for (int it = 0; it < 16; it++) {
                const int r = r0 + 4 * it, row = row0 + r;
                if (row >= M) break;
                const float4 q = *reinterpret_cast<const float4 *>(stg + r * kStgPitch + ec);
                float v[4] = {q.x * alpha, q.y * alpha, q.z * alpha, q.w * alpha};
                if constexpr (MASK) {
                    const unsigned mw = bits[r * 16 + word] >> sh,
                                   sw = bits[r * 16 + 8 + word] >> sh;
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        v[e] = (mw >> e) & 1 ? as_stored(v[e], type) : 0.0f;
                        cs[e] += v[e];
                        cd[e] += (sw >> e) & 1 ? v[e] : -v[e];
                    }
                } else {
#pragma unroll
                    for (int e = 0; e < 4; e++) amax = fmaxf(amax, fabsf(v[e]));
                }
                if (p.out)
                    store_out4(p.out, (int64_t)row * N + col, v[0], v[1], v[2], v[3], 4, aligned,
                               type);
            }
        }
        if constexpr (MASK) {
            // lanes l, l + 8, l + 16, l + 24 hold the same columns (every warp runs these)
#pragma unroll
            for (int e = 0; e < 4; e++)
#pragma unroll
                for (int o = 8; o < 32; o <<= 1) {
                    cs[e] += __shfl_xor_sync(0xffffffffu, cs[e], o);
                    cd[e] += __shfl_xor_sync(0xffffffffu, cd[e], o);
                }
            if (lane < 8)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    if (col + e < N)
                        p.part_sum[part * N + col + e] = cs[e],
                                                    p.part_dot[part * N + col + e] = cd[e];
        }
        warpgroup_barrier(bar);  // the staging area read back before it is written again
    }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

template <bool MASK>
__global__ void __launch_bounds__(kThreads, 1)
    bwd_gemm(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
             BwdGemmArgs p, int tiles_m, int tiles_n) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ uint8_t smem[];
    __shared__ unsigned block_amax;  // the store epilogue's largest |value| (float bits)
    const unsigned base = (smem_u32(smem) + 1023) & ~1023u;
    uint8_t *gbase = smem + (base - smem_u32(smem));  // the same address, generic
    const unsigned full0 = base + kBarOffset, empty0 = full0 + kStages * 8;
    const int tid = threadIdx.x, wg = tid >> 7;
    const int kblocks = (int)((p.K + kBKB - 1) / kBKB);
    const int my_tiles =
        (tiles_m * tiles_n - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;
    auto origin = [&](int j, int &tm, int &tn) {
        grouped_tile((int)blockIdx.x + j * (int)gridDim.x, tiles_m, tiles_n, tm, tn);
    };
    if (tid == 0) {
        for (int s = 0; s < kStages; s++) {
            mbar_init(full0 + 8 * s, 1);   // the producer's arrival (and the copies' bytes)
            mbar_init(empty0 + 8 * s, 2);  // one arrival per consumer warpgroup
        }
        mbar_init_fence();
        block_amax = 0u;
    }
    __syncthreads();
    pdl_wait();  // the operands and scales come from the kernels just before (pdl.cuh)

    if (wg == 0) {  // the producer
        setmaxnreg_dec<40>();
        if (tid == 0)
            tma_ring_produce(&map_a, &map_b, my_tiles, kblocks, kBKB, kStages, kStage, kStageA,
                             base, full0, empty0, [&](int j, int &row_a, int &row_b) {
                                 int tm, tn;
                                 origin(j, tm, tn);
                                 row_a = tm * kBM, row_b = tn * kBN;
                             });
        return;
    }

    // A consumer: rows 64 c .. of each tile.
    setmaxnreg_inc<232>();
    const int c = wg - 1, wt = tid & 127;
    float *stg = reinterpret_cast<float *>(gbase + kRingBytes + c * kStgBytes);
    const unsigned bits = base + (unsigned)(kBitsOffset + c * kBitsBytes);
    const float alpha = p.s0[0] * p.s1[0];
    float amax = 0.0f;
    float d[128];
    for (int j = 0, i = 0; j < my_tiles; j++) {
        int tm, tn;
        origin(j, tm, tn);
        if constexpr (MASK) fetch_bits(p, bits, tm * kBM + c * 64, tn * kBN);
#pragma unroll
        for (int x = 0; x < 128; x++) d[x] = 0.0f;
        for (int kb = 0; kb < kblocks; kb++, i++) {
            const int s = i % kStages;
            mbar_wait(full0 + 8 * s, (unsigned)(i / kStages) & 1u);
            const unsigned stage = base + (unsigned)(s * kStage);
            const unsigned a_tile = stage + (unsigned)(c * 64 * kBKB), b_tile = stage + kStageA;
            fence_acc(d);
            wgmma_fence();
#pragma unroll
            for (int q = 0; q < kBKB / 32; q++)
                wgmma_e4m3_ss_64x256x32(d, smem_desc(a_tile + 32 * q, 16, 1024, 1),
                                        smem_desc(b_tile + 32 * q, 16, 1024, 1));
            wgmma_commit();
            wgmma_wait<1>();
            fence_acc(d);
            if (kb > 0 && wt == 0) mbar_arrive(empty0 + 8 * ((i - 1) % kStages));
        }
        wgmma_wait<0>();
        fence_acc(d);
        if (wt == 0) mbar_arrive(empty0 + 8 * ((i - 1) % kStages));
        bwd_epilogue<MASK>(d, stg, reinterpret_cast<const unsigned *>(gbase + (bits - base)),
                           tm * kBM + c * 64, tn * kBN, (int64_t)tm * 2 + c, p, alpha, amax, c + 1);
    }
    if constexpr (!MASK) {
        for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        if ((tid & 31) == 0) atomicMax(&block_amax, __float_as_uint(amax));  // amax >= 0
        asm volatile("bar.sync 3, 256;\n" ::: "memory");                     // both consumers
        if (tid == 128) p.amax_part[blockIdx.x] = __uint_as_float(block_amax);
        if (blockIdx.x == 0)
            for (int e = (int)gridDim.x + tid - 128; e < kAmaxBlocks; e += 256)
                p.amax_part[e] = 0.0f;
    }
#else
    (void)map_a, (void)map_b, (void)p, (void)tiles_m, (void)tiles_n;
#endif
}

}  // namespace

int64_t bwd_gemm_parts(int64_t M) { return 2 * ((M + kBM - 1) / kBM); }

bool bwd_gemm_tma_usable() { return bgemm_tma_usable() && kSmem <= max_smem(); }

bie_status bwd_gemm_tma_launch(const BwdGemmArgs &p) {
    const char *who = "cuda linear backward gemm (wgmma, TMA)";
    const bool mask = p.mask != nullptr;
    if (!bwd_gemm_tma_usable())
        return bie_fail(BIE_ERR_UNSUPPORTED, "%s: needs a device of compute capability 9.0", who);
    const int64_t tiles_m = (p.M + kBM - 1) / kBM, tiles_n = (p.N + kBN - 1) / kBN;
    if (p.M < 1 || p.N < 1 || p.K < 1 || p.K % 16 != 0 || p.M > INT_MAX || p.N > INT_MAX ||
        tiles_m * tiles_n > INT_MAX || p.M * p.N > ((int64_t)1 << 40))
        return bie_fail(BIE_ERR_INTERNAL, "%s: shape %lld x %lld x %lld", who, (long long)p.M,
                        (long long)p.N, (long long)p.K);
    if (mask ? p.signs == nullptr || p.part_sum == nullptr || p.part_dot == nullptr || p.ld % 32 ||
                   reinterpret_cast<uintptr_t>(p.mask) % 16 ||
                   reinterpret_cast<uintptr_t>(p.signs) % 16
             : p.out == nullptr || p.amax_part == nullptr)
        return bie_fail(BIE_ERR_INTERNAL, "%s: epilogue arguments", who);
    CUtensorMap map_a, map_b;
    if (!tma_map_rows(&map_a, p.a, p.M, p.K, kBM) || !tma_map_rows(&map_b, p.b, p.N, p.K, kBN))
        return bie_fail(BIE_ERR_UNSUPPORTED, "%s: the driver cannot describe the operands", who);
    auto fn = mask ? bwd_gemm<true> : bwd_gemm<false>;
    BIE_CUDA_TRY(
        check(cudaFuncSetAttribute(reinterpret_cast<const void *>(fn),
                                   cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kSmem),
              "cudaFuncSetAttribute"));
    // at most kAmaxBlocks blocks: one partial maximum each
    const int64_t blocks =
        std::min<int64_t>({tiles_m * tiles_n, (int64_t)device_sms(), (int64_t)kAmaxBlocks});
    BIE_CUDA_TRY(check(launch_after(fn, dim3((unsigned)blocks), dim3(kThreads), kSmem, map_a, map_b,
                                    p, (int)tiles_m, (int)tiles_n),
                       who));
    return check(cudaGetLastError(), who);
}

}  // namespace bie_cuda
