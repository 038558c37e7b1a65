// 4-bit GEMM on tensor cores. Hopper has no fast 4-bit mma (SPEC §6), so the operands stay
// nibbles in device memory (half the bytes of int8 to move) and become int8 on chip, in
// registers, right before mma.m16n8k32.s8.s8.s32.
//
// Device layout (cuda_internal.h): rows of ld = bie_cuda_q4_row_stride(k) bytes, code j of a
// row in byte j / 2 (even j in the low nibble, SPEC §1), zero past k; ld is a multiple of
// BIE_CUDA_Q4_ROW_ALIGN, which every kernel's k block divides, so main loops have no k tail.
//
// Unpacking (q4_unpack.cuh): a lane's ldmatrix word of 8 codes becomes two int8x4 fragment
// registers, the even codes for the first k half of an mma and the odd ones for the second.
#include <cuda_runtime.h>

#include <atomic>
#include <climits>

#include "bie_cuda.h"
#include "cuda_common.cuh"
#include "cuda_internal.h"
#include "epilogue.cuh"
#include "mma.cuh"
#include "pdl.cuh"
#include "q4_common.cuh"
#include "q4_rows.cuh"
#include "q4_unpack.cuh"
#include "wgmma_entry.cuh"

namespace bie_cuda {

// c += a . b over a 16x8x32 tile of signed bytes.
__device__ __forceinline__ void mma_s8(int (&c)[4], const unsigned (&a)[4], unsigned b0,
                                       unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// BM x BN output tile per block, WARPS_M x WARPS_N warps, each owning a (BM / WARPS_M) x
// (BN / WARPS_N) sub-tile of 16x8 mma tiles; a STAGES-deep cp.async pipeline over k blocks of
// BKB bytes (2 BKB codes). Shared rows are BKB + 16 bytes, so that the 8 rows one ldmatrix
// reads fall in distinct banks. Blocks are numbered along n within groups of 8 tile rows, so
// that blocks running at the same time share their A and B tiles in L2. Rows past m (n) are
// zero-filled (from a valid address, row m - 1, which is not read).
// PIPE: the fragments of each 64-code step are loaded from shared memory one step ahead, and
// across k blocks too (the barrier comes before the last step of a block), so that the
// ldmatrix latency hides behind the previous step's mma.
template <int BM, int BN, int WARPS_M, int WARPS_N, int BKB, int STAGES, int MINB, bool PIPE,
          bool WIDE, class AL = RowsA>
__global__ void __launch_bounds__(32 * WARPS_M * WARPS_N, MINB)
    q4gemm_s8(int m, int n, AL al, const uint8_t *__restrict__ B, int64_t ld64, int tiles_m,
              int tiles_n, Epilogue ep) {
    constexpr int THREADS = 32 * WARPS_M * WARPS_N;
    constexpr int kSmemRow = BKB + 16, CHUNKS = BKB / 16, KC = BKB / 32;
    constexpr int WTM = BM / WARPS_M, WTN = BN / WARPS_N;
    constexpr int MT = WTM / 16, NT = WTN / 8;
    // Each thread copies the same 16-byte column of rows r0, r0 + ROWSTEP, ... of a stage.
    constexpr int ROWSTEP = THREADS / CHUNKS, A_ITERS = BM / ROWSTEP, B_ITERS = BN / ROWSTEP;
    constexpr int STAGE_A = BM * kSmemRow, STAGE_B = BN * kSmemRow;
    static_assert(NT % 2 == 0, "B fragments are loaded two n8 tiles at a time");
    static_assert(BKB % 32 == 0, "an ldmatrix step covers 32 bytes (64 codes)");
    static_assert(!PIPE || KC % 2 == 0, "the fragment double buffer alternates within a k block");
    static_assert(THREADS % CHUNKS == 0 && BM % ROWSTEP == 0 && BN % ROWSTEP == 0, "copy split");
    extern __shared__ __align__(16) uint8_t smem[];
    const unsigned sA = smem_u32(smem), sB = sA + STAGES * STAGE_A;

    const unsigned ld = (unsigned)ld64;  // <= 2^23 (k <= 2^24)
    const int kblocks = (int)(ld / BKB);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;
    int tm, tn;
    {
        constexpr int G = 8;
        const int per_group = G * tiles_n, pid = blockIdx.x;
        const int first = pid / per_group * G, size = min(tiles_m - first, G);
        tm = first + (pid % per_group) % size;
        tn = (pid % per_group) / size;
    }
    const int bm0 = tm * BM, bn0 = tn * BN;

    const int r0 = tid / CHUNKS, c16 = (tid % CHUNKS) * 16;
    const uint8_t *b_col = B + c16;  // advanced by BKB per k block
    typename AL::template State<A_ITERS> a_state;
    al.prepare(a_state, m, ld, bm0 + r0, ROWSTEP, c16);
    const unsigned a_dst = sA + r0 * kSmemRow + c16, b_dst = sB + r0 * kSmemRow + c16;
    auto load_a = [&](int stage) {
#pragma unroll
        for (int i = 0; i < A_ITERS; i++) {
            bool ok;
            const uint8_t *src = al.src(a_state, i, ok);
            cp_async16(a_dst + stage * STAGE_A + i * ROWSTEP * kSmemRow, src, ok);
        }
        al.template next<A_ITERS, BKB>(a_state);
    };
    auto load_b = [&](int stage) {
#pragma unroll
        for (int i = 0; i < B_ITERS; i++) {
            const int row = bn0 + r0 + i * ROWSTEP;
            cp_async16(b_dst + stage * STAGE_B + i * ROWSTEP * kSmemRow,
                       b_col + (size_t)(unsigned)min(row, n - 1) * ld, row < n);
        }
        b_col += BKB;
    };
    auto load_stage = [&](int stage) {
        load_a(stage);
        load_b(stage);
    };

    int acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0;

    // This lane's ldmatrix row addresses in stage 0. A: matrices (rows 0-7 | 8-15) x (bytes
    // 0-15 | 16-31) of an m16 tile give word t of rows g and g + 8 for both mma k steps;
    // B: (bytes 0-15 | 16-31) x (n8 tile j | j + 1).
    const int q = lane >> 3, r8 = lane & 7;
    const unsigned a_frag = sA + (wm * WTM + r8 + 8 * (q & 1)) * kSmemRow + 16 * (q >> 1);
    const unsigned b_frag = sB + (wn * WTN + r8 + 8 * (q >> 1)) * kSmemRow + 16 * (q & 1);
    // Raw words of one 64-code step: A per m16 tile, B per pair of n8 tiles.
    auto load_frags = [&](unsigned(&wa)[MT][4], unsigned(&wb)[NT / 2][4], unsigned a_s,
                          unsigned b_s, int kc) {
#pragma unroll
        for (int i = 0; i < MT; i++) ldmatrix_x4(wa[i], a_s + i * 16 * kSmemRow + kc * 32);
#pragma unroll
        for (int j = 0; j < NT / 2; j++) ldmatrix_x4(wb[j], b_s + j * 16 * kSmemRow + kc * 32);
    };
    auto compute = [&](const unsigned(&wa)[MT][4], const unsigned(&wb)[NT / 2][4]) {
        unsigned af[MT][2][4];
#pragma unroll
        for (int i = 0; i < MT; i++) {
            unpack<WIDE>(wa[i][0], af[i][0][0], af[i][0][2]);
            unpack<WIDE>(wa[i][1], af[i][0][1], af[i][0][3]);
            unpack<WIDE>(wa[i][2], af[i][1][0], af[i][1][2]);
            unpack<WIDE>(wa[i][3], af[i][1][1], af[i][1][3]);
        }
#pragma unroll
        for (int j = 0; j < NT; j += 2) {
            unsigned b[4][2];
#pragma unroll
            for (int u = 0; u < 4; u++) unpack<WIDE>(wb[j / 2][u], b[u][0], b[u][1]);
#pragma unroll
            for (int i = 0; i < MT; i++) {
                mma_s8(acc[i][j], af[i][0], b[0][0], b[0][1]);
                mma_s8(acc[i][j], af[i][1], b[1][0], b[1][1]);
                mma_s8(acc[i][j + 1], af[i][0], b[2][0], b[2][1]);
                mma_s8(acc[i][j + 1], af[i][1], b[3][0], b[3][1]);
            }
        }
    };

    // The prologue's B tiles (the weights, written before the kernel that produced A) load
    // before the wait for that kernel (pdl.cuh); they join the first stage's copy group.
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++)
        if (s < kblocks) load_b(s);
    pdl_wait();
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < kblocks) load_a(s);
        cp_async_commit();
    }
    int read_stage = 0, write_stage = STAGES - 1;
    if (PIPE) {
        unsigned wa[2][MT][4], wb[2][NT / 2][4];
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        load_frags(wa[0], wb[0], a_frag, b_frag, 0);
        for (int kb = 0; kb < kblocks; kb++) {
            const unsigned a_s = a_frag + read_stage * STAGE_A, b_s = b_frag + read_stage * STAGE_B;
#pragma unroll
            for (int kc = 0; kc < KC; kc++) {
                if (kc == 0) {  // the stage read in the previous k block is free (barrier)
                    if (kb + STAGES - 1 < kblocks) load_stage(write_stage);
                    cp_async_commit();
                    write_stage = write_stage == STAGES - 1 ? 0 : write_stage + 1;
                }
                if (kc == KC - 1) {  // next stage in: its first step loads during this one
                    cp_async_wait<STAGES - 2>();
                    __syncthreads();
                    read_stage = read_stage == STAGES - 1 ? 0 : read_stage + 1;
                    if (kb + 1 < kblocks)
                        load_frags(wa[0], wb[0], a_frag + read_stage * STAGE_A,
                                   b_frag + read_stage * STAGE_B, 0);
                } else {
                    load_frags(wa[(kc + 1) & 1], wb[(kc + 1) & 1], a_s, b_s, kc + 1);
                }
                compute(wa[kc & 1], wb[kc & 1]);
            }
        }
    } else {
        for (int kb = 0; kb < kblocks; kb++) {
            cp_async_wait<STAGES - 2>();
            __syncthreads();
            if (kb + STAGES - 1 < kblocks) load_stage(write_stage);
            cp_async_commit();
            write_stage = write_stage == STAGES - 1 ? 0 : write_stage + 1;
            const unsigned a_s = a_frag + read_stage * STAGE_A, b_s = b_frag + read_stage * STAGE_B;
            read_stage = read_stage == STAGES - 1 ? 0 : read_stage + 1;
#pragma unroll
            for (int kc = 0; kc < KC; kc++) {
                unsigned wa[MT][4], wb[NT / 2][4];
                load_frags(wa, wb, a_s, b_s, kc);
                compute(wa, wb);
            }
        }
    }
    cp_async_wait<0>();

    const float scale = ep.scale();
    const int g = lane >> 2, t4 = lane & 3;
    if constexpr (AL::kNchwTile) {
        // Convolutions: the tile's dot products go through shared memory (the operand
        // stages are free now), channel-major, then each thread walks one pixel row (or a
        // pair of rows) of it, so neighbouring threads store neighbouring pixels of a
        // channel plane (contiguous NCHW stores instead of two values per plane per thread).
        constexpr int RS = BM + 4;  // ints per channel: conflict-free fragment writes and row reads
        static_assert((size_t)BN * RS * sizeof(int) <= (size_t)STAGES * (STAGE_A + STAGE_B),
                      "tile fits");
        int *sC = reinterpret_cast<int *>(smem);
        __syncthreads();
#pragma unroll
        for (int i = 0; i < MT; i++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int rl = wm * WTM + i * 16 + g + 8 * h;
#pragma unroll
                for (int j = 0; j < NT; j++) {
                    const int cl = wn * WTN + j * 8 + 2 * t4;
                    const int v0 = acc[i][j][2 * h], v1 = acc[i][j][2 * h + 1];
                    sC[cl * RS + rl] = unpacked_dot<WIDE>(v0);
                    sC[(cl + 1) * RS + rl] = unpacked_dot<WIDE>(v1);
                }
            }
        __syncthreads();
        conv_tile_out<BM, THREADS>(ep, sC, RS, m, n, bm0, bn0, BN, al.pairs, scale, tid);
    } else {
#pragma unroll
        for (int i = 0; i < MT; i++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int row = bm0 + wm * WTM + i * 16 + g + 8 * h;
                if (row >= m) continue;
                const OutRow orow = ep.row(row);
#pragma unroll
                for (int j = 0; j < NT; j++) {
                    const int col = bn0 + wn * WTN + j * 8 + 2 * t4;
                    const int v0 = acc[i][j][2 * h], v1 = acc[i][j][2 * h + 1];
                    const long long d0 = unpacked_dot<WIDE>(v0), d1 = unpacked_dot<WIDE>(v1);
                    if (col + 1 < n)
                        ep.store2(orow, col, d0, d1, scale);
                    else if (col < n)
                        ep.store(orow, col, d0, scale);
                }
            }
    }
}

typedef void (*Q4KernelFn)(int, int, RowsA, const uint8_t *, int64_t, int, int, Epilogue);

struct Q4Kernel {
    int id;
    const char *name;
    int bm, bn, bkb, stages, threads;
    int64_t preferred_max_m;
    Q4KernelFn narrow, wide;  // NULL for the wgmma kernels (q4gemm_wgmma.cu, bgemm_tma.cu)
    bool wgmma;
    bool i8;  // bgemm_tma.cu's kernel on int8 codes (TMA loads): the nibble rows converted first
};

// The wide path (rare k >= 2^17) always runs unpipelined: its longer unpacking would not
// fit the pipelined variant's registers.
#define BIE_Q4_KERNEL(id, BM, BN, WM, WN, BKB, ST, MINB, PIPE, SUFFIX, MAXM)                      \
    {                                                                                             \
        id, "cuda.mma_s8.q4gemm_" #BM "x" #BN "_w" #WM "x" #WN "_k" #BKB "_s" #ST SUFFIX, BM, BN, \
            BKB, ST, 32 * WM *WN, MAXM, q4gemm_s8<BM, BN, WM, WN, BKB, ST, MINB, PIPE, false>,    \
            q4gemm_s8<BM, BN, WM, WN, BKB, ST, MINB, false, true>, false, false                   \
    }

// Measured on the H100 at 8192^3: 210 (wgmma, q4gemm_wgmma.cu) 1,052-1,098 TOPS, 205 ~820,
// 202 ~800, 200 ~780-810, 204 ~750; 2x4 warps of 64x32 and 256x128 tiles were slower
// (720-770) and were dropped.
const Q4Kernel q4_kernels[] = {
    BIE_Q4_KERNEL(200, 128, 128, 2, 2, 128, 3, 2, false, "", INT64_MAX),
    BIE_Q4_KERNEL(201, 64, 64, 2, 2, 64, 4, 4, false, "", INT64_MAX),
    BIE_Q4_KERNEL(202, 128, 128, 2, 2, 128, 3, 2, true, "_pipe", INT64_MAX),
    BIE_Q4_KERNEL(204, 128, 128, 2, 2, 64, 4, 2, false, "", INT64_MAX),
    BIE_Q4_KERNEL(205, 128, 128, 2, 2, 64, 4, 2, true, "_pipe", INT64_MAX),
    BIE_Q4_KERNEL(206, 16, 64, 1, 2, 128, 4, 4, false, "", 16),
    {210, "cuda.wgmma_s8.q4gemm_128x256_k128_s4", 128, 256, 64, 4, 256, INT64_MAX, NULL, NULL, true,
     false},
    {211, "cuda.wgmma_s8_tma.q4gemm_i8_128x256_k128_s3", 128, 256, 128, 3, 384, INT64_MAX, NULL,
     NULL, true, true},
};
constexpr int kNumQ4 = sizeof q4_kernels / sizeof q4_kernels[0];

size_t q4_smem_bytes(const Q4Kernel &kern) {
    if (kern.i8) return bgemm_tma_smem();
    if (kern.wgmma) return q4gemm_wgmma_smem(256);
    return (size_t)kern.stages * (kern.bm + kern.bn) * (kern.bkb + 16);
}

// Weight streaming shape (m <= 16): 16-row tiles. Small problems need more blocks than
// 128x128 tiles give to fill the GPU. Otherwise the fastest measured at 4096^3 and 8192^3:
// the wgmma kernel where the device runs it, else 205.
const Q4Kernel *q4_default_kernel(int64_t m, int64_t n) {
    if (m <= 16) return &q4_kernels[5];
    if (m * n < (int64_t)4096 * 4096) return &q4_kernels[1];
    const int w = bie_cuda_q4_kernel_index(210);
    return w >= 0 && bie_cuda_q4_kernel_fits(210, 0) ? &q4_kernels[w] : &q4_kernels[4];
}

// Implicit 4-bit convolutions (ConvA rows): tile shapes and k blocks (a k block must not
// straddle two taps: cb is a multiple of it).
struct Q4ConvKernel {
    int bm, bn, bkb, stages, threads;
    void (*narrow)(int, int, ConvA, const uint8_t *, int64_t, int, int, Epilogue);
    void (*wide)(int, int, ConvA, const uint8_t *, int64_t, int, int, Epilogue);
    bool wgmma;  // q4gemm_wgmma.cu's kernel (narrow and wide NULL)
};
constexpr int kConvBKB = 64;
#define BIE_Q4_CONV_KERNEL(BM, BN, WM, WN, BKB, ST, MINB, PIPE)                 \
    {                                                                           \
        BM, BN, BKB, ST, 32 * WM *WN,                                           \
            q4gemm_s8<BM, BN, WM, WN, BKB, ST, MINB, PIPE, false, ConvA>,       \
            q4gemm_s8<BM, BN, WM, WN, BKB, ST, MINB, false, true, ConvA>, false \
    }
// The variants the default choice uses (others measured are listed there).
enum {
    kConvSmall = 0,
    kConvK64 = 1,
    kConvK128 = 2,
    kConvWave = 3,
    kConvWgmma = 4,
    kConvWgmma128 = 5
};
const Q4ConvKernel q4_conv_kernels[] = {
    BIE_Q4_CONV_KERNEL(64, 64, 2, 2, 64, 4, 4, false),   // kConvSmall: small problems, more blocks
    BIE_Q4_CONV_KERNEL(128, 64, 4, 2, 64, 4, 2, true),   // kConvK64: padded channels % 128 != 0
    BIE_Q4_CONV_KERNEL(128, 64, 4, 2, 128, 3, 2, true),  // kConvK128
    BIE_Q4_CONV_KERNEL(96, 128, 2, 4, 128, 2, 2, true),  // kConvWave: fewer, larger tiles
    {128, 256, 64, 4, 256, NULL, NULL, true},            // kConvWgmma (compute capability 9.0)
    {128, 128, 64, 4, 256, NULL, NULL, true},            // kConvWgmma128 (compute capability 9.0)
};
constexpr int kNumQ4Conv = sizeof q4_conv_kernels / sizeof q4_conv_kernels[0];

size_t conv_smem(const Q4ConvKernel &kern) {
    return kern.wgmma ? q4gemm_wgmma_smem(kern.bn)
                      : (size_t)kern.stages * (kern.bm + kern.bn) * (kern.bkb + 16);
}

// Blocks of a variant that fit on one SM of the current device (0 when unknown), found once
// per device (a forward asks for every candidate).
int conv_blocks_per_sm(int variant) {
    static std::atomic<int> known[16][kNumQ4Conv];  // blocks + 1; 0: not asked yet
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) dev = -1;
    if (dev >= 0 && dev < 16) {
        const int k = known[dev][variant].load(std::memory_order_relaxed);
        if (k) return k - 1;
    }
    const Q4ConvKernel &kern = q4_conv_kernels[variant];
    const size_t smem = conv_smem(kern);
    int blocks = 0;
    if (kern.wgmma) {
        blocks = q4conv_wgmma_blocks_per_sm(kern.bn);
        if (blocks == 0) return 0;
    } else if (smem > max_smem() ||
               cudaFuncSetAttribute(reinterpret_cast<const void *>(kern.narrow),
                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)smem) != cudaSuccess ||
               cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kern.narrow, kern.threads,
                                                             smem) != cudaSuccess) {
        cudaGetLastError();
        return 0;  // not cached: a later call may succeed
    }
    if (dev >= 0 && dev < 16) known[dev][variant].store(blocks + 1, std::memory_order_relaxed);
    return blocks;
}

// The default variant for rows x o outputs. A problem too small for one 128 x 64 block per
// SM takes 64 x 64 tiles (more blocks). Otherwise the candidates are ranked by their waves
// of blocks times a wave's time: a tile's outputs over the variant's throughput per SM,
// measured on the H100 (N=64, C=O=256, 14x14, forward in us; relative throughput per SM
// in brackets): 128 x 64 with 8 warps and 128-byte k blocks, 392 tiles in 1.5 waves of 2
// per SM, 40.5-43.7 [1]; 96 x 128, 262 tiles in one wave, 39.6 [0.83]. Others measured
// there: 128 x 64 with 64-byte k blocks 41.7-42.7, 96 x 64 44.5, 192 x 64 44.1-49.5,
// 192 x 128 39.7-41.3, 4 warps 45.4-49.6, 64 x 64 54.5, 128 x 128 57-59. Later, with
// paired stores, 96 x 128 with two stages of k blocks (kConvWave) 37.2 / 37.3 against
// three stages 39.5 / 39.0 and three unpipelined 38.5 / 40.7 in one run. The wgmma tiles
// (128 x 256, one per SM, compute capability 9.0 only) [2.5]: 33.4 against kConvWave's 38.9
// in one run; slower where they are few or half empty (512 -> 512 at 7x7: 50 tiles, 50.3 vs
// 44.6; 128 -> 128 at 28x28: 54.4 vs 48.3), which the rate keeps them from. The 128 x 128
// wgmma tiles (two blocks per SM) [1.2]: 128 -> 128 at 28x28 43.5 against kConvWave's 49.2,
// 256 -> 256 at 14x14 36.6 against the 128 x 256 tiles' 33.1, 512 at 7x7 55.9 against
// kConvK128's 45.3, in one run. The model is coarse: at 128 x 28 x 28 (64-byte channel
// blocks) it ranks kConvK64 (49.0) above these tiles (43.5); a rate that fixes that would
// also take them at 256 x 14 x 14, where they lose.
int default_conv_variant(int64_t rows, int64_t o, int64_t cb) {
    int dev = 0, sms = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
        cudaGetLastError();
        sms = 1;
    }
    if (((rows + 127) / 128) * ((o + 63) / 64) < sms) return kConvSmall;
    struct Candidate {
        int variant;
        double rate;
    };
    const Candidate wide[] = {{kConvK128, 1.0},
                              {kConvWave, 0.83},
                              {kConvWgmma, 2.5},
                              {kConvWgmma128, 1.2}},
                    narrow[] = {{kConvK64, 1.0}, {kConvWgmma, 2.5}, {kConvWgmma128, 1.4}};
    const Candidate *cand = cb % 128 == 0 ? wide : narrow;
    const int count = cb % 128 == 0 ? 4 : 3;
    int best = cand[0].variant;
    double best_cost = 0;
    for (int i = 0; i < count; i++) {
        const Q4ConvKernel &kern = q4_conv_kernels[cand[i].variant];
        const int per_sm = conv_blocks_per_sm(cand[i].variant);
        if (per_sm < 1) continue;
        const int64_t tiles = ((rows + kern.bm - 1) / kern.bm) * ((o + kern.bn - 1) / kern.bn);
        const int64_t waves = (tiles + (int64_t)sms * per_sm - 1) / ((int64_t)sms * per_sm);
        const double cost = (double)waves * kern.bm * kern.bn / cand[i].rate;
        if (best_cost == 0 || cost < best_cost) best = cand[i].variant, best_cost = cost;
    }
    return best;
}

// Nibble rows [rows][ld] (code 2 j in the low nibble of byte j) to int8 code rows [rows][ld8]
// (ld8 >= 2 ld, a multiple of 4): a thread per 4 codes (two bytes in, one word out).
__global__ void __launch_bounds__(256)
    nibbles_to_i8(const uint8_t *__restrict__ src, int64_t rows, int64_t ld, int64_t ld8,
                  uint32_t *__restrict__ dst) {
    const int64_t words = ld8 / 4, total = rows * words;
    for (int64_t i = (int64_t)blockIdx.x * 256 + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * 256) {
        const int64_t r = i / words, w = i - r * words;
        uint32_t v = 0;
        if (2 * w < ld) {
            const uint8_t *p = src + r * ld + 2 * w;
            const unsigned nib = (unsigned)p[0] | (unsigned)p[1] << 8;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int c = (int)((nib >> (4 * j)) & 15u);
                v |= (uint32_t)(uint8_t)(int8_t)nibble_code(c) << (8 * j);
            }
        }
        dst[i] = v;
    }
}

// Kernel 211 on nibble rows: both operands converted to int8 rows in a stream-ordered
// workspace (rows of the TMA kernel's 128-byte k blocks), then the product.
bie_status q4gemm_i8_from_nibbles(int64_t m, int64_t n, int64_t k, const uint8_t *a,
                                  const uint8_t *b, int64_t ld, const Epilogue &ep) {
    cudaStream_t st = current_stream;
    const int64_t ld8 = bie_cuda_q4_i8_row_stride(k);
    uint8_t *ws = NULL;
    BIE_CUDA_TRY(check(cudaMallocAsync((void **)&ws, (size_t)(m + n) * (size_t)ld8, st),
                       "cudaMallocAsync (4-bit gemm int8 rows)"));
    auto convert = [&](const uint8_t *src, int64_t rows, uint8_t *dst) {
        const int64_t blocks = std::min<int64_t>((rows * (ld8 / 4) + 255) / 256, 65535);
        nibbles_to_i8<<<(unsigned)std::max<int64_t>(1, blocks), 256, 0, st>>>(
            src, rows, ld, ld8, reinterpret_cast<uint32_t *>(dst));
    };
    convert(a, m, ws);
    convert(b, n, ws + m * ld8);
    bie_status s = q4gemm_tma_launch(m, n, k, reinterpret_cast<const int8_t *>(ws),
                                     reinterpret_cast<const int8_t *>(ws + m * ld8), ld8, ep);
    const cudaError_t free_err = cudaFreeAsync(ws, st);
    BIE_CUDA_TRY(s);
    return check(free_err, "cudaFreeAsync (4-bit gemm int8 rows)");
}

}  // namespace bie_cuda

using namespace bie_cuda;

extern "C" {

int64_t bie_cuda_q4_i8_row_stride(int64_t k) { return (k + 127) / 128 * 128; }

bool bie_cuda_q4_i8_wanted(int kernel_id, int64_t m, int64_t n, int64_t k) {
    if (kernel_id >= 0 && kernel_id != 211) return false;
    if (kernel_id < 0 && q4_default_kernel(m, n)->id != 210) return false;
    return bie_cuda_q4_kernel_fits(211, k);
}

int64_t bie_cuda_q4_row_stride(int64_t k) {
    const int64_t bytes = (k + 1) / 2;
    return (bytes + BIE_CUDA_Q4_ROW_ALIGN - 1) / BIE_CUDA_Q4_ROW_ALIGN * BIE_CUDA_Q4_ROW_ALIGN;
}

int bie_cuda_q4_kernel_count(void) { return kNumQ4; }

void bie_cuda_q4_kernel_describe(int index, bie_kernel_info *info) {
    const Q4Kernel &kern = q4_kernels[index];
    info->id = kern.id;
    info->name = kern.name;
    info->isa = kern.wgmma ? "sm_90a" : "sm_80";
    info->op = BIE_OP_Q4_GEMM;
    info->device = BIE_DEVICE_CUDA;
    info->preferred_max_m = kern.preferred_max_m;
    info->available = bie_cuda_device_count() > 0 && (!kern.wgmma || wgmma_usable()) &&
                      (!kern.i8 || bgemm_tma_usable());
}

int bie_cuda_q4_kernel_index(int id) {
    for (int i = 0; i < kNumQ4; i++)
        if (q4_kernels[i].id == id) return i;
    return -1;
}

bool bie_cuda_q4_kernel_fits(int id, int64_t k) {
    (void)k;  // the tiles stream k; shared memory does not depend on it
    const int idx = bie_cuda_q4_kernel_index(id);
    return idx >= 0 && q4_smem_bytes(q4_kernels[idx]) <= max_smem() &&
           (!q4_kernels[idx].wgmma || wgmma_usable()) &&
           (!q4_kernels[idx].i8 || bgemm_tma_usable());
}

bie_status bie_cuda_q4gemm_launch(int kernel_id, int64_t m, int64_t n, int64_t k, const uint8_t *a,
                                  const uint8_t *b, int64_t ld, float scale, const float *scale_a,
                                  const float *scale_w, bie_dtype out_dtype, void *out,
                                  const bie_cuda_conv_out *conv) {
    static const char *who = "cuda 4-bit gemm";
    const Q4Kernel *kern = q4_default_kernel(m, n);
    if (kernel_id >= 0) {
        const int idx = bie_cuda_q4_kernel_index(kernel_id);
        if (idx < 0)
            return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: no CUDA 4-bit kernel with id %d", who,
                            kernel_id);
        kern = &q4_kernels[idx];
    }
    const int which = out_type_of(out_dtype);
    if (which < 0)
        return bie_fail(BIE_ERR_DTYPE, "%s: output dtype %s", who, bie_dtype_name(out_dtype));
    const int64_t tiles_m = (m + kern->bm - 1) / kern->bm, tiles_n = (n + kern->bn - 1) / kern->bn;
    if (m > INT_MAX || n > INT_MAX || tiles_m * tiles_n > INT_MAX)
        return bie_fail(BIE_ERR_OVERFLOW, "%s: %lld x %lld outputs are too many", who, (long long)m,
                        (long long)n);
    const size_t smem = q4_smem_bytes(*kern);
    if (smem > max_smem())
        return bie_fail(BIE_ERR_UNSUPPORTED, "%s: kernel %s needs %zu bytes of shared memory", who,
                        kern->name, smem);
    const Epilogue ep = make_epilogue(which, out, n, scale, scale_a, scale_w, conv);
    if (kern->i8) return q4gemm_i8_from_nibbles(m, n, k, a, b, ld, ep);
    if (kern->wgmma) return q4gemm_wgmma_launch(m, n, k, a, b, ld, ep);
    const Q4KernelFn fn = k >= kWideK ? kern->wide : kern->narrow;
    BIE_CUDA_TRY(check(cudaFuncSetAttribute(reinterpret_cast<const void *>(fn),
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
                       "cudaFuncSetAttribute"));
    fn<<<(unsigned)(tiles_m * tiles_n), kern->threads, smem, current_stream>>>(
        (int)m, (int)n, RowsA{a}, b, ld, (int)tiles_m, (int)tiles_n, ep);
    return check(cudaGetLastError(), "4-bit gemm launch");
}

bie_status bie_cuda_q4gemm_i8_launch(int64_t m, int64_t n, int64_t k, const int8_t *a,
                                     const int8_t *b, int64_t ld, float scale, const float *scale_a,
                                     const float *scale_w, bie_dtype out_dtype, void *out,
                                     const bie_cuda_conv_out *conv) {
    static const char *who = "cuda 4-bit gemm (int8 codes)";
    const int which = out_type_of(out_dtype);
    if (which < 0)
        return bie_fail(BIE_ERR_DTYPE, "%s: output dtype %s", who, bie_dtype_name(out_dtype));
    if (m > INT_MAX || n > INT_MAX || ld % 128 != 0 || ld < k)
        return bie_fail(BIE_ERR_SHAPE, "%s: m = %lld, n = %lld, ld = %lld for k = %lld", who,
                        (long long)m, (long long)n, (long long)ld, (long long)k);
    if (!bie_cuda_q4_kernel_fits(211, k))
        return bie_fail(BIE_ERR_UNSUPPORTED, "%s: this device does not run kernel 211", who);
    return q4gemm_tma_launch(m, n, k, a, b, ld,
                             make_epilogue(which, out, n, scale, scale_a, scale_w, conv));
}

bie_status bie_cuda_q4_gemm(int kernel_id, int64_t m, int64_t n, int64_t k, const int8_t *a,
                            int64_t lda, const int8_t *b, int64_t ldb, float scale, float *out) {
    static const char *who = "bie_cuda_q4_gemm";
    if (a == NULL || b == NULL || out == NULL)
        return bie_fail(BIE_ERR_NULL_POINTER, "%s: a, b and out must not be NULL", who);
    if (m < 1 || n < 1 || k < 1) return bie_fail(BIE_ERR_SHAPE, "%s: m, n, k must be >= 1", who);
    if (k > (1 << 24))
        return bie_fail(BIE_ERR_OVERFLOW, "%s: k = %lld exceeds 2^24", who, (long long)k);
    if (m > INT_MAX || n > INT_MAX)
        return bie_fail(BIE_ERR_OVERFLOW, "%s: m and n must be < 2^31", who);
    if (lda < k || ldb < k) return bie_fail(BIE_ERR_SHAPE, "%s: row strides must be >= k", who);
    if (!(scale - scale == 0.0f))
        return bie_fail(BIE_ERR_NOT_FINITE, "%s: scale is not finite", who);
    if (kernel_id >= 0 && bie_cuda_q4_kernel_index(kernel_id) < 0)
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: no CUDA 4-bit kernel with id %d", who,
                        kernel_id);
    BIE_CUDA_TRY(require_device());
    if (!is_device_pointer(a) || !is_device_pointer(b) || !is_device_pointer(out))
        return bie_fail(BIE_ERR_DEVICE, "%s: a, b and out must be CUDA device memory", who);

    const int64_t ld = bie_cuda_q4_row_stride(k);
    cudaStream_t st = current_stream;
    uint8_t *ws = NULL;
    BIE_CUDA_TRY(
        check(cudaMallocAsync((void **)&ws, (size_t)(m + n) * (size_t)ld, st), "cudaMallocAsync"));
    bie_status s = bie_cuda_q4_pack_codes(a, lda, m, k, ld, ws);
    if (s == BIE_OK) s = bie_cuda_q4_pack_codes(b, ldb, n, k, ld, ws + m * ld);
    if (s == BIE_OK)
        s = bie_cuda_q4gemm_launch(kernel_id, m, n, k, ws, ws + m * ld, ld, scale, NULL, NULL,
                                   BIE_F32, out, NULL);
    cudaError_t free_err = cudaFreeAsync(ws, st);
    BIE_CUDA_TRY(s);
    return check(free_err, "cudaFreeAsync");
}

int64_t bie_cuda_q4_conv_cb(int64_t c) {
    const int64_t bytes = (c + 1) / 2;
    return (bytes + kConvBKB - 1) / kConvBKB * kConvBKB;
}

bie_status bie_cuda_q4conv_implicit(int variant, const uint8_t *codes, const bie_conv_geom *g,
                                    const uint8_t *wtaps, const float *scale_a,
                                    const float *scale_w, bie_dtype out_dtype, void *out) {
    static const char *who = "cuda 4-bit implicit conv";
    const int64_t rows = g->n * g->oh * g->ow, cb = bie_cuda_q4_conv_cb(g->c),
                  ld = g->k * g->k * cb;
    if (variant < 0) variant = default_conv_variant(rows, g->o, cb);
    if (variant >= kNumQ4Conv)
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: variant %d", who, variant);
    if (cb % q4_conv_kernels[variant].bkb != 0)
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: variant %d needs whole k blocks per tap",
                        who, variant);
    const Q4ConvKernel &kern = q4_conv_kernels[variant];
    const int which = out_type_of(out_dtype);
    if (which < 0)
        return bie_fail(BIE_ERR_DTYPE, "%s: output dtype %s", who, bie_dtype_name(out_dtype));
    const int64_t tiles_m = (rows + kern.bm - 1) / kern.bm,
                  tiles_n = (g->o + kern.bn - 1) / kern.bn;
    if (rows > INT_MAX || tiles_m * tiles_n > INT_MAX || ld * 2 > (1 << 24) ||
        g->n * g->h * g->w * cb > INT_MAX * (int64_t)64)
        return bie_fail(BIE_ERR_OVERFLOW, "%s: problem too large", who);
    const size_t smem = conv_smem(kern);
    const bie_cuda_conv_out conv = {g->oh * g->ow, NULL, NULL, 0};
    const Epilogue ep = make_epilogue(which, out, g->o, 0.0f, scale_a, scale_w, &conv);
    const ConvA al = {codes,
                      (int)cb,
                      (int)g->h,
                      (int)g->w,
                      (int)g->ow,
                      (int)(g->oh * g->ow),
                      (int)g->k,
                      (int)g->s,
                      (int)g->p,
                      (int)g->d,
                      conv_pairs_ok(g->oh * g->ow, out, which)};
    if (kern.wgmma) return q4conv_wgmma_launch(kern.bn, rows, g->o, al, wtaps, ld, ep);
    auto fn = ld * 2 >= kWideK ? kern.wide : kern.narrow;
    BIE_CUDA_TRY(check(cudaFuncSetAttribute(reinterpret_cast<const void *>(fn),
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
                       "cudaFuncSetAttribute"));
    // After the input's encode (pdl.cuh): the weight taps are ready before it runs.
    BIE_CUDA_TRY(
        check(launch_after(fn, dim3((unsigned)(tiles_m * tiles_n)), dim3(kern.threads), smem,
                           (int)rows, (int)g->o, al, wtaps, ld, (int)tiles_m, (int)tiles_n, ep),
              who));
    return check(cudaGetLastError(), who);
}

}  // extern "C"
