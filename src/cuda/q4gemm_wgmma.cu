// 4-bit GEMM on Hopper's warpgroup MMA (wgmma, sm_90a): the same products as q4gemm.cu (plain
// rows, RowsA, and implicit convolutions, ConvA), at the rate of the int8 wgmma instead of
// the warp-level mma.sync.
//
// A block computes a 128 x 256 output tile with two warpgroups (each 64 rows x all 256
// columns, wgmma.m64n256k32.s32.s8.s8, A from registers, B from shared memory); convolutions
// with few output pixels per channel tile use 128 x 128 tiles (m64n128k32). Per k block
// of 128 codes (64 bytes per row):
//  1. cp.async brings the block's A and B rows, still nibbles, into a ring of raw stages
//     (KSTAGES deep, issued KSTAGES - 1 blocks ahead);
//  2. every thread unpacks its share of the B rows to int8 (q4_unpack.cuh: even codes, then
//     odd codes of each 16-byte chunk, a permutation of k that A and B share) into one of two
//     int8 tiles, laid out as wgmma reads them: 128-byte rows, 8-row groups of 1024 bytes,
//     the 16-byte chunk c of row r at chunk c ^ (r % 8) (the 128-byte swizzle);
//  3. each warp loads its 16 A rows with ldmatrix and unpacks them in registers, in the
//     wgmma A fragment layout (the mma.sync one);
//  4. after a proxy fence and a barrier, each warpgroup issues four wgmma (k 32 each) and
//     goes on to the next block while they run; before an int8 tile or A registers are
//     written again it waits for the wgmma that read them (wait_group 1, then the barrier).
// The accumulators are the mma.sync fragment layout per warp (16 rows, 4 words per 8
// columns), so the epilogues are the other kernels' (epilogue.cuh, q4_rows.cuh).
//
// Measured at 8192^3 on the H100: 1,052-1,098 TOPS; with A unpacked to shared memory like B
// and both wgmma operands there, 1,005-1,054 (more shared-memory traffic).
//
// The device code exists only in the sm_90a build of this file (the only architecture it is
// compiled for); wgmma_usable() tells the host whether the current device runs it.
#include <cuda_runtime.h>

#include <climits>

#include "cuda_common.cuh"
#include "cuda_internal.h"
#include "epilogue.cuh"
#include "mma.cuh"
#include "pdl.cuh"
#include "q4_rows.cuh"
#include "q4_unpack.cuh"
#include "wgmma.cuh"
#include "wgmma_entry.cuh"

namespace bie_cuda {

namespace {

constexpr int kBM = 128;
constexpr int kBKB = 64;     // packed bytes per row per k block (128 codes)
constexpr int kS8Row = 128;  // int8 bytes per row of an unpacked tile
constexpr int KSTAGES = 4;
constexpr int kThreads = 256;
// A thread's first kAChunks chunks of 16 packed bytes per stage are A rows.
constexpr int kAChunks = kBM * kBKB / 16 / kThreads;
// The shapes of a block with BN columns (256, or 128 for convolutions with few pixels).
template <int BN> struct Tile {
    static constexpr int kRows = kBM + BN, kRawStage = kRows * kBKB, kS8Tile = BN * kS8Row;
    static constexpr int kChunks = kRows * kBKB / 16 / kThreads;  // per stage, per thread
    static_assert(kChunks * kThreads * 16 == kRawStage && kAChunks * kThreads * 16 == kBM * kBKB,
                  "copy split");
    // The int8 tiles first (1024-byte aligned, as the swizzle wants), then the raw stages.
    static constexpr size_t kSmem = 1024 + 2 * (size_t)kS8Tile + (size_t)KSTAGES * kRawStage;
};

template <class AL, int BN, bool WIDE>
__global__ void __launch_bounds__(kThreads, BN == 128 ? 2 : 1)
    q4gemm_wgmma(int m, int n, AL al, const uint8_t *__restrict__ B, int64_t ld64, int tiles_m,
                 int tiles_n, Epilogue ep) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using TL = Tile<BN>;
    extern __shared__ uint8_t smem[];
    const unsigned s8 = (smem_u32(smem) + 1023) & ~1023u, raw = s8 + 2 * TL::kS8Tile;
    const unsigned ld = (unsigned)ld64;  // <= 2^23 (k <= 2^24)
    const int kblocks = (int)(ld / kBKB);
    const int tid = threadIdx.x, lane = tid & 31;
    int tm, tn;
    grouped_tile(blockIdx.x, tiles_m, tiles_n, tm, tn);
    const int bm0 = tm * kBM, bn0 = tn * BN;

    // This thread's chunks: rows tid / 4 + 64 u of the stage (A rows, then B rows), bytes
    // 16 q of them. Rows past m (n) are zero-filled from a valid address. In a raw stage,
    // chunk q of row r sits at q ^ ((r / 2) % 4): the 8 rows an ldmatrix reads are in
    // distinct banks.
    const int q = tid & 3, r0 = tid >> 2;
    constexpr int kRowStep = kThreads / 4, kBChunks = TL::kChunks - kAChunks;
    typename AL::template State<kAChunks> a_state;
    al.prepare(a_state, m, ld, bm0 + r0, kRowStep, 16 * q);
    const uint8_t *b_src[kBChunks];
    bool b_ok[kBChunks];
#pragma unroll
    for (int u = 0; u < kBChunks; u++) {
        const int row = bn0 + r0 + u * kRowStep;
        b_src[u] = B + (size_t)(unsigned)min(row, n - 1) * ld + 16 * q;
        b_ok[u] = row < n;
    }
    const unsigned raw_ofs = r0 * kBKB + ((q ^ ((r0 >> 1) & 3)) << 4);
    auto load_a = [&](int kb) {
        const unsigned dst = raw + (kb % KSTAGES) * TL::kRawStage + raw_ofs;
#pragma unroll
        for (int u = 0; u < kAChunks; u++) {
            bool ok;
            const uint8_t *src = al.src(a_state, u, ok);
            cp_async16(dst + u * kRowStep * kBKB, src, ok);
        }
        al.template next<kAChunks, kBKB>(a_state);
    };
    auto load_b = [&](int kb) {
        const unsigned dst = raw + (kb % KSTAGES) * TL::kRawStage + kBM * kBKB + raw_ofs;
#pragma unroll
        for (int u = 0; u < kBChunks; u++)
            cp_async16(dst + u * kRowStep * kBKB, b_src[u] + (size_t)kb * kBKB, b_ok[u]);
    };
    // Raw chunk q of a B row -> int8 chunks 2q (even codes) and 2q + 1 (odd codes), swizzled.
    const unsigned sw = (unsigned)(r0 & 7);
    const unsigned even_ofs = r0 * kS8Row + ((2 * q) ^ sw) * 16,
                   odd_ofs = r0 * kS8Row + ((2 * q + 1) ^ sw) * 16;
    auto unpack_b = [&](int kb) {
        const unsigned from = raw + (kb % KSTAGES) * TL::kRawStage + kBM * kBKB + raw_ofs,
                       to = s8 + (kb & 1) * TL::kS8Tile;
        unsigned w[kBChunks][4];  // all loads first: their latencies overlap
#pragma unroll
        for (int u = 0; u < kBChunks; u++)
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                         : "=r"(w[u][0]), "=r"(w[u][1]), "=r"(w[u][2]), "=r"(w[u][3])
                         : "r"(from + u * kRowStep * kBKB));
#pragma unroll
        for (int u = 0; u < kBChunks; u++) {
            unsigned e[4], o[4];
#pragma unroll
            for (int i = 0; i < 4; i++) unpack<WIDE>(w[u][i], e[i], o[i]);
            const unsigned row = to + u * kRowStep * kS8Row;
            asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(row + even_ofs),
                         "r"(e[0]), "r"(e[1]), "r"(e[2]), "r"(e[3]));
            asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(row + odd_ofs),
                         "r"(o[0]), "r"(o[1]), "r"(o[2]), "r"(o[3]));
        }
    };
    // This warp's 16 A rows straight from the raw stage into wgmma A fragments. An
    // ldmatrix.x4 of (rows 0-7 | 8-15) x (chunk c | c + 1) gives word t of rows g and g + 8
    // for two k steps; their even codes are bytes 4t.. and the odd ones 16 + 4t.. of a step,
    // as unpack_b lays out B.
    const int wg = tid >> 7;
    const unsigned a_row = wg * 64 + ((tid >> 5) & 3) * 16 + (lane & 7) + 8 * ((lane >> 3) & 1);
    const unsigned a_frag = raw + a_row * kBKB, a_sw = (a_row >> 1) & 3, a_hi = lane >> 4;
    auto frags_a = [&](int kb, unsigned(&af)[4][4]) {
        const unsigned base = a_frag + (kb % KSTAGES) * TL::kRawStage;
#pragma unroll
        for (int c = 0; c < 4; c += 2) {
            unsigned w[4];
            ldmatrix_x4(w, base + (((c + a_hi) ^ a_sw) << 4));
            unpack<WIDE>(w[0], af[c][0], af[c][2]);
            unpack<WIDE>(w[1], af[c][1], af[c][3]);
            unpack<WIDE>(w[2], af[c + 1][0], af[c + 1][2]);
            unpack<WIDE>(w[3], af[c + 1][1], af[c + 1][3]);
        }
    };

    int d[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; i++) d[i] = 0;

        // B (weights, written before the kernel that produced A) loads before the wait for that
        // kernel (pdl.cuh) and joins the first stage's copy group.
#pragma unroll
    for (int s = 0; s < KSTAGES - 1; s++)
        if (s < kblocks) load_b(s);
    pdl_wait();
#pragma unroll
    for (int s = 0; s < KSTAGES - 1; s++) {
        if (s < kblocks) load_a(s);
        cp_async_commit();
    }
    unsigned af0[4][4], af1[4][4];  // the A fragments of even and odd k blocks
    auto step = [&](int kb, unsigned(&af)[4][4]) {
        cp_async_wait<KSTAGES - 2>();
        __syncthreads();  // raw stage kb in; the int8 tile kb & 1 no longer read (wait below)
        if (kb + KSTAGES - 1 < kblocks) {
            load_a(kb + KSTAGES - 1);
            load_b(kb + KSTAGES - 1);
        }
        cp_async_commit();
        frags_a(kb, af);
        unpack_b(kb);
        fence_proxy_async();
        __syncthreads();
        const unsigned tile = s8 + (kb & 1) * TL::kS8Tile;
        fence_acc(d);
        wgmma_fence();
#pragma unroll
        for (int s = 0; s < 4; s++) wgmma_s8<BN>(d, af[s], smem_desc(tile + 32 * s, 16, 1024, 1));
        wgmma_commit();
        wgmma_wait<1>();
        fence_acc(d);
    };
    int kb = 0;
    for (; kb + 1 < kblocks; kb += 2) {
        step(kb, af0);
        step(kb + 1, af1);
    }
    if (kb < kblocks) step(kb, af0);
    wgmma_wait<0>();
    fence_acc(d);
    cp_async_wait<0>();

    const float scale = ep.scale();
    const int g = lane >> 2, t4 = lane & 3, wrow = wg * 64 + ((tid >> 5) & 3) * 16 + g;
    if constexpr (AL::kNchwTile) {
        // Convolutions: the tile goes channel-major through shared memory (conv_tile_out).
        constexpr int RS =
            kBM + 4;  // ints per channel: conflict-free fragment writes and row reads
        static_assert((size_t)BN * RS * sizeof(int) <=
                          2 * (size_t)TL::kS8Tile + KSTAGES * (size_t)TL::kRawStage,
                      "tile fits");
        int *sC = reinterpret_cast<int *>(smem);
        __syncthreads();
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int j = 0; j < BN / 8; j++) {
                const int cl = j * 8 + 2 * t4;
                sC[cl * RS + wrow + 8 * h] = unpacked_dot<WIDE>(d[4 * j + 2 * h]);
                sC[(cl + 1) * RS + wrow + 8 * h] = unpacked_dot<WIDE>(d[4 * j + 2 * h + 1]);
            }
        __syncthreads();
        conv_tile_out<kBM, kThreads>(ep, sC, RS, m, n, bm0, bn0, BN, al.pairs, scale, tid);
    } else {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int row = bm0 + wrow + 8 * h;
            if (row >= m) continue;
            const OutRow orow = ep.row(row);
#pragma unroll
            for (int j = 0; j < BN / 8; j++) {
                const int col = bn0 + j * 8 + 2 * t4;
                const long long d0 = unpacked_dot<WIDE>(d[4 * j + 2 * h]),
                                d1 = unpacked_dot<WIDE>(d[4 * j + 2 * h + 1]);
                if (col + 1 < n)
                    ep.store2(orow, col, d0, d1, scale);
                else if (col < n)
                    ep.store(orow, col, d0, scale);
            }
        }
    }
#else
    (void)m, (void)n, (void)al, (void)B, (void)ld64, (void)tiles_m, (void)tiles_n, (void)ep;
#endif
}

}  // namespace

size_t q4gemm_wgmma_smem(int bn) { return bn == 128 ? Tile<128>::kSmem : Tile<256>::kSmem; }

// Compute capability 9.0 exactly (the sm_90a instructions run nowhere else).
bool wgmma_usable() { return device_cc() == 90; }

bie_status wgmma_grid(const char *who, int64_t m, int64_t n, int64_t ld, int bm, int bn, int bkb,
                      size_t smem, int64_t *tiles_m, int64_t *tiles_n) {
    if (!wgmma_usable() || smem > max_smem())
        return bie_fail(BIE_ERR_UNSUPPORTED, "%s: needs a device of compute capability 9.0", who);
    *tiles_m = (m + bm - 1) / bm, *tiles_n = (n + bn - 1) / bn;
    if (m > INT_MAX || n > INT_MAX || *tiles_m * *tiles_n > INT_MAX)
        return bie_fail(BIE_ERR_OVERFLOW, "%s: %lld x %lld outputs are too many", who, (long long)m,
                        (long long)n);
    if (ld % bkb != 0)
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: row stride %lld", who, (long long)ld);
    return BIE_OK;
}

int q4conv_wgmma_blocks_per_sm(int bn) {
    auto fn = bn == 128 ? q4gemm_wgmma<ConvA, 128, false> : q4gemm_wgmma<ConvA, 256, false>;
    const size_t smem = q4gemm_wgmma_smem(bn);
    int blocks = 0;
    if (!wgmma_usable() || smem > max_smem() ||
        cudaFuncSetAttribute(reinterpret_cast<const void *>(fn),
                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                             (int)smem) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, fn, kThreads, smem) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return blocks;
}

// Grid and checks shared by the launchers; fn is the kernel for the problem's k.
template <class AL, int BN>
bie_status launch(const char *who, int64_t m, int64_t n, int64_t k, const AL &al, const uint8_t *b,
                  int64_t ld, const Epilogue &ep, bool after) {
    constexpr size_t kSmem = Tile<BN>::kSmem;
    int64_t tiles_m = 0, tiles_n = 0;
    BIE_CUDA_TRY(wgmma_grid(who, m, n, ld, kBM, BN, kBKB, kSmem, &tiles_m, &tiles_n));
    auto fn = k >= kWideK ? q4gemm_wgmma<AL, BN, true> : q4gemm_wgmma<AL, BN, false>;
    BIE_CUDA_TRY(
        check(cudaFuncSetAttribute(reinterpret_cast<const void *>(fn),
                                   cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kSmem),
              "cudaFuncSetAttribute"));
    const dim3 grid((unsigned)(tiles_m * tiles_n));
    if (after)
        BIE_CUDA_TRY(check(launch_after(fn, grid, dim3(kThreads), kSmem, (int)m, (int)n, al, b, ld,
                                        (int)tiles_m, (int)tiles_n, ep),
                           who));
    else
        fn<<<grid, kThreads, kSmem, current_stream>>>((int)m, (int)n, al, b, ld, (int)tiles_m,
                                                      (int)tiles_n, ep);
    return check(cudaGetLastError(), who);
}

// m x n outputs of the product of 4-bit rows a [m][ld] and b [n][ld] (ld a multiple of 64).
bie_status q4gemm_wgmma_launch(int64_t m, int64_t n, int64_t k, const uint8_t *a, const uint8_t *b,
                               int64_t ld, const Epilogue &ep) {
    return launch<RowsA, 256>("cuda 4-bit gemm (wgmma)", m, n, k, RowsA{a}, b, ld, ep, false);
}

// The implicit convolution of q4gemm.cu's ConvA rows with weight taps b [o][ld] in tiles of
// bn (128 or 256) channels, launched after the input's encode (pdl.cuh).
bie_status q4conv_wgmma_launch(int bn, int64_t rows, int64_t o, const ConvA &al, const uint8_t *b,
                               int64_t ld, const Epilogue &ep) {
    static const char *who = "cuda 4-bit implicit conv (wgmma)";
    return bn == 128 ? launch<ConvA, 128>(who, rows, o, ld * 2, al, b, ld, ep, true)
                     : launch<ConvA, 256>(who, rows, o, ld * 2, al, b, ld, ep, true);
}

}  // namespace bie_cuda
