// The binary linear layer's backward products with the passes after them in their epilogues
// (sm_90a): kernel 121's pipeline (bgemm_tma.cu: persistent blocks, a TMA producer warpgroup,
// two consumer warpgroups of 64 rows, a three-stage ring of 128-byte k blocks) on e4m3 rows
// (the opt-in FP8 backward: four wgmma.m64n256k32.f32.e4m3.e4m3 a k block) or on 16-bit rows
// (the exact grad_x of a 16-bit layer: four wgmma.m64n256k16.f32.bf16 / f16), f32 accumulators
// (the tensor cores sum the whole reduction in their own accumulator: below f32, bie.h). For
// the exact grad_x, B (the ±1 weight) is made in each stage by the consumers from the weight's
// sign bits, which the producer brings with A (kOpBits16: no ±1 matrix in memory).
//
// out [M][N] = alpha A B^T with A [M][K] and B [N][K] rows (K-major both, the only layout
// 8-bit wgmma reads; the tensor maps zero-fill past K) and alpha = *s0 * *s1 (the layer's
// scale and grad_out's dequantization factor, read on the device). Three epilogues:
// - the mask (grad_x): each value rounded to the output dtype, zero where the clip bit is
//   clear, stored (unless out is NULL); per 64 rows of a tile the column sums of those values
//   (as stored) and of their products with sign(x') into part_sum / part_dot [2 tiles_m][N]
//   (each column of a part written by the one block that owns it; the 4-bit layers' form: of
//   their products with the rounding residuals). For a 16-bit grad_x the
//   consumers leave the rounded tile in shared memory and go on with their next tile while
//   the producer warpgroup's three spare warps apply it (kMaskAsync); an f32 grad_x is done
//   in the consumers (kMaskInline);
// - the store (grad_w): the f32 values and, per block, the largest |value| into
//   amax_part[blockIdx.x] (entries past the grid zero), ready for quantize_i8_partials.
// kMaskAsync also takes a side job (BwdGemmArgs::side_q, BIE_CUDA_LINEAR_SIDE=1): grad_w's
// int8 quantization, and its amax before it, in the epilogue warps between their tiles.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <type_traits>

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
// Shared memory after the 1024-byte alignment: the ring; the staging area (the two consumers'
// of bgemm_wgmma.cuh, or the whole tile's 16-bit values for the epilogue warps); the tile's
// clip and sign words (8 KB); the full and empty barriers, then the staged and drained ones.
// With B from sign bits (kOpBits16), a stage also holds the k block's bits (64 rows x 32
// bytes) after B, and the staging area only the 16-bit tile.
constexpr int kBitsBytes = 64 * 16 * 4;   // a consumer's (the inline mask epilogue)
constexpr int kTilePitch = 2 * kBN + 16;  // bytes a row of the 16-bit staged tile
constexpr int kBBits = 64 * kBN / 8;      // kOpBits16: a k block's sign bits of B
__host__ __device__ constexpr int stage_bytes(bool bits) { return kStage + (bits ? kBBits : 0); }
__host__ __device__ constexpr int ring_bytes(bool bits) { return kStages * stage_bytes(bits); }
__host__ __device__ constexpr int bits_offset(bool bits) {
    return ring_bytes(bits) + (bits ? kBM * kTilePitch : 2 * kStgBytes);
}
__host__ __device__ constexpr int bar_offset(bool bits) {
    return bits_offset(bits) + 2 * kBitsBytes;
}
constexpr size_t smem_bytes(bool bits) {
    return 1024 + (size_t)bar_offset(bits) + (2 * kStages + 2) * 8;
}
static_assert(kBM * kTilePitch <= 2 * kStgBytes, "the 16-bit tile fits the staging area");
static_assert(stage_bytes(true) % 1024 == 0 && kStage % 1024 == 0 && kStageA % 1024 == 0,
              "stages keep the swizzle alignment");

// The epilogues: the store (grad_w), the mask in the consumers (grad_x in f32), the mask in
// the producer warpgroup's spare warps while the consumers go on with the next tile (grad_x
// in a 16-bit type: the tile's values, rounded to it, fit the staging area).
enum Mode { kStore, kMaskInline, kMaskAsync };

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

constexpr int kEpiThreads = 96;  // warps 1 .. 3 of the producer warpgroup
constexpr int kEpiBar = 4;       // their named barrier

// v as the output dtype gives it back.
__device__ __forceinline__ float as_stored(float v, int type) {
    return type == kOutBF16  ? __bfloat162float(__float2bfloat16(v))
           : type == kOutF16 ? __half2float(__float2half(v))
                             : v;
}

// One 32-byte k step of a k block: wgmma m64n256k32 on e4m3 or m64n256k16 on 16-bit floats
// (BN: B N-major, 16 rows of the k block from b on).
template <typename E, bool BN>
__device__ __forceinline__ void mma_step(float (&d)[128], uint64_t a, uint64_t b) {
    if constexpr (std::is_same<E, uint8_t>::value)
        wgmma_e4m3_ss_64x256x32(d, a, b);
    else if constexpr (BN)
        wgmma_f16_ss_bn256<E>(d, a, b);
    else
        wgmma_f16_ss<E, 256>(d, a, b);
}

// kOpBits16: consumer c's half of B (the k block's 64 rows x columns 128 c .. 128 c + 127, ±1
// of the 16-bit type, one2 its +1 in both halves; +1 where the bit is set) from the block's
// sign bits (bits, 64 rows of 32 bytes) into b (N-major, four 64-column boxes of 64 rows x 128
// bytes, 128-byte swizzled): one byte of bits is a row's 16-byte chunk; thread wt writes
// chunks wt, wt + 128, .. (a warp: four whole rows of a box, free of bank conflicts).
__device__ __forceinline__ void make_b(const uint8_t *bits, uint8_t *b, int c, int wt,
                                       unsigned one2) {
#pragma unroll
    for (int u = 0; u < 8; u++) {
        const int id = wt + 128 * u, q = 2 * c + (id >> 9), r = (id >> 3) & 63, x = id & 7;
        const unsigned nb = ~(unsigned)bits[r * 32 + 8 * q + x];
        uint4 v;
        v.x = one2 | (nb & 1u) << 15 | (nb >> 1 & 1u) << 31;
        v.y = one2 | (nb >> 2 & 1u) << 15 | (nb >> 3 & 1u) << 31;
        v.z = one2 | (nb >> 4 & 1u) << 15 | (nb >> 5 & 1u) << 31;
        v.w = one2 | (nb >> 6 & 1u) << 15 | (nb >> 7 & 1u) << 31;
        *reinterpret_cast<uint4 *>(b + q * 64 * 128 + r * 128 + ((x ^ (r & 7)) << 4)) = v;
    }
}

// kMaskAsync, a consumer: its 64 rows of the tile (alpha d rounded to out_type) into the
// staged tile tile16 (rows of kTilePitch bytes), pairs of columns as the m64n256 layout holds
// them (a warp's 32-bit stores: 8 rows x 4 words in 32 banks).
__device__ __forceinline__ void stage_tile16(const float (&d)[128], uint8_t *tile16, int c,
                                             float alpha, int type) {
    const int wt = threadIdx.x & 127, lane = wt & 31;
    const int row = 64 * c + (wt >> 5) * 16 + (lane >> 2), col = 2 * (lane & 3);
#pragma unroll
    for (int n8 = 0; n8 < 32; n8++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const float x = d[4 * n8 + 2 * h] * alpha, y = d[4 * n8 + 2 * h + 1] * alpha;
            uint32_t v;
            if (type == kOutBF16) {
                const __nv_bfloat162 b = __floats2bfloat162_rn(x, y);
                v = *reinterpret_cast<const uint32_t *>(&b);
            } else {
                const __half2 b = __floats2half2_rn(x, y);
                v = *reinterpret_cast<const uint32_t *>(&b);
            }
            *reinterpret_cast<uint32_t *>(tile16 + (row + 8 * h) * kTilePitch +
                                          2 * (8 * n8 + col)) = v;
        }
}

__device__ __forceinline__ float half_bits_f32(uint32_t b, int type) {
    return type == kOutBF16 ? __bfloat162float(__ushort_as_bfloat16((unsigned short)b))
                            : __half2float(__ushort_as_half((unsigned short)b));
}

// kMaskAsync, the epilogue warps (ew = thread - 32 of the producer warpgroup) on one staged
// tile (rows row0.., columns bn0.., tile row tm): the clip and sign words into bits [16][128]
// (word, then row: 8 clip words, 8 sign words), then warp e takes the 32-column blocks e, e + 3,
// .. : lane l the four columns 4 (l % 8).. of rows 16 q + 4 (l / 8) + i (both reads free of bank
// conflicts), masks, stores 8 bytes a row and sums; part 2 tm + h gets rows 64 h .. 64 h + 63.
// The 4-bit form (Q4, p.resid): no sign words; the dot takes each value times its residual: the
// tile's residual lines are prefetched to L2 with the words, and a lane loads its 16 rows' four
// residuals at once before it uses them (one latency per 16 rows, not one per row). ready():
// waits until the tile is staged (after the words are requested).
template <bool Q4, class Ready>
__device__ __forceinline__ void epi_tile(const uint8_t *tile16, uint32_t *bits, int row0, int bn0,
                                         int tm, const BwdGemmArgs &p, Ready ready) {
    const int ew = (int)threadIdx.x - 32, lane = ew & 31, e = ew >> 5;
    const int M = (int)p.M, N = (int)p.N, type = p.out_type;
    asm volatile("bar.sync %0, %1;\n" ::"n"(kEpiBar), "n"(kEpiThreads) : "memory");  // bits free
#pragma unroll
    for (int batch = 0; batch < 2; batch++) {  // 512 16-byte pieces (row, which, half), 3 + 3
        uint4 w[3];
#pragma unroll
        for (int q = 0; q < 3; q++) {
            const int id = ew + kEpiThreads * (3 * batch + q), r = id >> 2;
            const int which = (id >> 1) & 1, hf = id & 1;
            w[q] = make_uint4(0, 0, 0, 0);
            if (id < 512 && row0 + r < M && !(which && Q4))
                w[q] = __ldg(reinterpret_cast<const uint4 *>((which ? p.signs : p.mask) +
                                                             (int64_t)(row0 + r) * p.ld + bn0 / 8) +
                             hf);
        }
#pragma unroll
        for (int q = 0; q < 3; q++) {
            const int id = ew + kEpiThreads * (3 * batch + q), r = id >> 2;
            const int wd = ((id >> 1) & 1) * 8 + (id & 1) * 4;
            if (id >= 512) continue;
            bits[(wd + 0) * kBM + r] = w[q].x, bits[(wd + 1) * kBM + r] = w[q].y;
            bits[(wd + 2) * kBM + r] = w[q].z, bits[(wd + 3) * kBM + r] = w[q].w;
        }
    }
    const int8_t *resid = p.resid;
    if (Q4)  // the residual rows' 128-byte lines: the bytes at 0, 128 and 255 of the span touch
             // each
        for (int id = ew; id < 3 * kBM; id += kEpiThreads) {
            const int r = id / 3, at = min(bn0 + 128 * (id % 3) - (id % 3 == 2), N - 1);
            if (row0 + r < M)
                asm volatile(
                    "prefetch.global.L2 [%0];\n" ::"l"(resid + (int64_t)(row0 + r) * N + at));
        }
    ready();
    asm volatile("bar.sync %0, %1;\n" ::"n"(kEpiBar), "n"(kEpiThreads) : "memory");  // bits in
    const bool aligned = p.out && reinterpret_cast<uintptr_t>(p.out) % 8 == 0;
    const int sh = 4 * (lane & 7);
    for (int cb = e; cb < 8; cb += 3) {
        const int col = bn0 + 32 * cb + sh;
        const bool live = col < N;  // N a multiple of 16: all four columns or none
#pragma unroll 1
        for (int h = 0; h < 2; h++) {
            float cs[4] = {0.0f, 0.0f, 0.0f, 0.0f}, cd[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            uint32_t rq[16];  // the 4-bit form: four residuals a row
            if (Q4)
#pragma unroll
                for (int it = 0; it < 16; it++) {
                    const int row = row0 + 64 * h + 16 * (it >> 2) + 4 * (lane >> 3) + (it & 3);
                    rq[it] = live && row < M ? __ldg(reinterpret_cast<const uint32_t *>(
                                                   resid + (int64_t)row * N + col))
                                             : 0u;
                }
#pragma unroll(Q4 ? 16 : 4)
            for (int it = 0; it < 16; it++) {
                const int r = 64 * h + 16 * (it >> 2) + 4 * (lane >> 3) + (it & 3), row = row0 + r;
                if (!live || row >= M) continue;
                const uint2 raw =
                    *reinterpret_cast<const uint2 *>(tile16 + r * kTilePitch + 2 * (32 * cb + sh));
                const uint32_t mw = bits[cb * kBM + r] >> sh, sw = bits[(8 + cb) * kBM + r] >> sh;
                const uint32_t hb[4] = {raw.x & 0xffffu, raw.x >> 16, raw.y & 0xffffu, raw.y >> 16};
                uint32_t kept[4];
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    kept[q] = (mw >> q) & 1 ? hb[q] : 0u;  // +0 in both 16-bit types
                    const float v = half_bits_f32(kept[q], type);
                    cs[q] += v;
                    if (Q4)
                        cd[q] += v * (float)(int8_t)(rq[it] >> 8 * q);
                    else
                        cd[q] += (sw >> q) & 1 ? v : -v;
                }
                if (p.out) {
                    const int64_t at = (int64_t)row * N + col;
                    if (aligned)
                        *reinterpret_cast<uint2 *>(static_cast<uint16_t *>(p.out) + at) =
                            make_uint2(kept[0] | kept[1] << 16, kept[2] | kept[3] << 16);
                    else
#pragma unroll
                        for (int q = 0; q < 4; q++)
                            static_cast<uint16_t *>(p.out)[at + q] = (uint16_t)kept[q];
                }
            }
#pragma unroll
            for (int q = 0; q < 4; q++)
#pragma unroll
                for (int o = 8; o < 32; o <<= 1) {
                    cs[q] += __shfl_xor_sync(0xffffffffu, cs[q], o);
                    cd[q] += __shfl_xor_sync(0xffffffffu, cd[q], o);
                }
            if (lane < 8 && live) {
                const int64_t at = (int64_t)(2 * tm + h) * N + col;
#pragma unroll
                for (int q = 0; q < 4; q++) p.part_sum[at + q] = cs[q], p.part_dot[at + q] = cd[q];
            }
        }
    }
}

// The side job (BwdGemmArgs::side_q), in the epilogue warps (ew = thread - 32 of the
// producer warpgroup) between their tiles: this block's share [u0, u1) of side_x in units of
// four elements (vec: side_x 16-byte and side_q 4-byte aligned) or of one; the last block also
// takes the elements past the last whole unit (tail..side_n). A thread's 16-byte loads four at a
// time, the next four in flight while these are used (the warps' register budget), from L2:
// each step's bytes are prefetched there kAhead steps before; the loads stream (evict first:
// kept out of the GEMM's L2 share).
struct SideSlice {
    int64_t u0, u1, tail;
    bool vec;
};
__device__ __forceinline__ SideSlice side_slice(const BwdGemmArgs &p) {
    SideSlice s;
    s.vec = (reinterpret_cast<uintptr_t>(p.side_x) % 16 |
             reinterpret_cast<uintptr_t>(p.side_q) % 4) == 0;
    const int64_t units = s.vec ? p.side_n / 4 : p.side_n, g = gridDim.x;
    const int64_t per = (units + g - 1) / g;
    s.u0 = min(units, per * blockIdx.x);
    s.u1 = min(units, s.u0 + per);
    s.tail = blockIdx.x == gridDim.x - 1 ? (s.vec ? units * 4 : p.side_n) : p.side_n;
    return s;
}
constexpr int kSideLoads = 4, kAhead = 6;

// f over the values of units [a0, a1) (vec) and of elements [tail, side_n), thread ew's share:
// f(unit or element index, its values, how many).
template <class F>
__device__ __forceinline__ void side_walk(const BwdGemmArgs &p, const SideSlice &s, int64_t a0,
                                          int64_t a1, bool tail, int ew, F f) {
    if (s.vec) {
        const float4 *x = reinterpret_cast<const float4 *>(p.side_x);
        constexpr int64_t kStep = kSideLoads * kEpiThreads;
        // each step's units brought into L2 kAhead steps before they are loaded
        auto ahead = [&](int64_t from) {
            if (ew == 0 && from < a1)
                bulk_prefetch_l2(x + from, (unsigned)(16 * min(kStep, a1 - from)));
        };
        for (int i = 0; i < kAhead; i++) ahead(a0 + i * kStep);
        // this thread's units a0 + ew + kEpiThreads i (i < cnt), kSideLoads at a time, the
        // next ones' loads in flight while these are used
        const int cnt = a1 > a0 + ew ? (int)((a1 - a0 - ew + kEpiThreads - 1) / kEpiThreads) : 0;
        const float4 *px = x + a0 + ew;
        float4 cur[kSideLoads], nxt[kSideLoads];
        auto load = [&](float4(&v)[kSideLoads], int i0) {
#pragma unroll
            for (int i = 0; i < kSideLoads; i++)
                v[i] = i0 + i < cnt ? __ldcs(px + (i0 + i) * kEpiThreads)
                                    : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        };
        load(cur, 0);
        for (int i0 = 0; i0 < cnt; i0 += kSideLoads) {
            ahead(a0 + (int64_t)(i0 / kSideLoads + kAhead) * kStep);
            load(nxt, i0 + kSideLoads);
#pragma unroll
            for (int i = 0; i < kSideLoads; i++)
                if (i0 + i < cnt) f(a0 + ew + (int64_t)(i0 + i) * kEpiThreads, cur[i], 4);
#pragma unroll
            for (int i = 0; i < kSideLoads; i++) cur[i] = nxt[i];
        }
    } else {
        for (int64_t u = a0 + ew; u < a1; u += kEpiThreads)
            f(u, make_float4(__ldcs(p.side_x + u), 0.0f, 0.0f, 0.0f), 1);
    }
    if (tail)
        for (int64_t e = s.tail + ew; e < p.side_n; e += kEpiThreads)
            f(e, make_float4(__ldcs(p.side_x + e), 0.0f, 0.0f, 0.0f), -1);
}

// With side_sync: the block's largest |value| into side_part[blockIdx.x], then counted.
__device__ __forceinline__ void side_amax(const BwdGemmArgs &p, int ew, float *red) {
    const SideSlice s = side_slice(p);
    float a = 0.0f;
    side_walk(p, s, s.u0, s.u1, true, ew, [&](int64_t, float4 v, int n) {
        a = fmaxf(a, fabsf(v.x));
        if (n == 4) a = fmaxf(fmaxf(a, fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
    });
    for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    if ((ew & 31) == 0) red[ew >> 5] = a;
    asm volatile("bar.sync %0, %1;\n" ::"n"(kEpiBar), "n"(kEpiThreads) : "memory");
    if (ew == 0) {
        p.side_part[blockIdx.x] = fmaxf(fmaxf(red[0], red[1]), red[2]);
        __threadfence();
        atomicAdd(p.side_sync, 1u);
    }
}

// The amax the quantization divides by: the largest of the partial maxima (with side_sync,
// once every block has counted its own), in every epilogue thread.
__device__ __forceinline__ float side_global_amax(const BwdGemmArgs &p, int ew) {
    int parts = kAmaxBlocks;
    if (p.side_sync) {
        parts = (int)gridDim.x;
        if (ew == 0) {
            unsigned n;
            for (;;) {
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n"
                             : "=r"(n)
                             : "l"(p.side_sync)
                             : "memory");
                if (n >= gridDim.x) break;
                __nanosleep(128);
            }
        }
        asm volatile("bar.sync %0, %1;\n" ::"n"(kEpiBar), "n"(kEpiThreads) : "memory");
    }
    float a = 0.0f;
    for (int i = ew & 31; i < parts; i += 32) a = fmaxf(a, __ldcg(p.side_part + i));
    for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    return a;
}

// Part q of Q of the block's share quantized by amax (as quantize_i8_partials does it).
__device__ __forceinline__ void side_quantize(const BwdGemmArgs &p, int q, int Q, float amax,
                                              int ew) {
    const SideSlice s = side_slice(p);
    const float inv = 1.0f / amax;
    const int64_t len = s.u1 - s.u0;
    side_walk(p, s, s.u0 + len * q / Q, s.u0 + len * (q + 1) / Q, q == Q - 1, ew,
              [&](int64_t u, float4 v, int n) {
                  if (n == 4) {
                      char4 o;
                      o.x = quantize_one(v.x, amax, inv), o.y = quantize_one(v.y, amax, inv);
                      o.z = quantize_one(v.z, amax, inv), o.w = quantize_one(v.w, amax, inv);
                      __stcs(reinterpret_cast<char4 *>(p.side_q) + u, o);
                  } else {
                      p.side_q[u] = quantize_one(v.x, amax, inv);
                  }
              });
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

// E: uint8_t (e4m3 operands), __nv_bfloat16 or __half. BITS (16-bit E, kMaskAsync): B from the
// sign bits (map_b: their rows, boxes of 64 rows x 32 bytes), written into each stage by the
// consumers.
template <int MODE, typename E, bool BITS = false>
__global__ void __launch_bounds__(kThreads, 1)
    bwd_gemm(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
             const __grid_constant__ BwdGemmArgs p, int tiles_m, int tiles_n) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr bool MASK = MODE != kStore, ASYNC = MODE == kMaskAsync;
    static_assert(!BITS || (ASYNC && !std::is_same<E, uint8_t>::value), "16-bit B from bits");
    constexpr int kSt = stage_bytes(BITS);
    extern __shared__ uint8_t smem[];
    __shared__ unsigned block_amax;  // the store epilogue's largest |value| (float bits)
    __shared__ float side_red[kEpiThreads / 32];  // the side job's amax, a warp each
    const unsigned base = (smem_u32(smem) + 1023) & ~1023u;
    uint8_t *gbase = smem + (base - smem_u32(smem));  // the same address, generic
    const unsigned full0 = base + bar_offset(BITS), empty0 = full0 + kStages * 8;
    // kMaskAsync: the tile staged (every consumer thread arrives) and read back (every
    // epilogue thread), once a tile each
    const unsigned staged = empty0 + kStages * 8, drained = staged + 8;
    const int tid = threadIdx.x, wg = tid >> 7;
    const int kblocks = (int)((p.K * (int64_t)sizeof(E) + kBKB - 1) / kBKB);
    const int my_tiles =
        (tiles_m * tiles_n - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;
    auto origin = [&](int j, int &tm, int &tn) {
        grouped_tile((int)blockIdx.x + j * (int)gridDim.x, tiles_m, tiles_n, tm, tn);
    };
    if (tid == 0) {
        tma_ring_init(full0, empty0, kStages, 2);
        mbar_init(staged, 256);
        mbar_init(drained, kEpiThreads);
        mbar_init_fence();
        block_amax = 0u;
    }
    __syncthreads();
    pdl_wait();  // the operands and scales come from the kernels just before (pdl.cuh)
    uint8_t *tile16 = gbase + ring_bytes(BITS);  // kMaskAsync's staged tile

    if (wg == 0) {  // the producer (thread 0) and, kMaskAsync, the epilogue warps (1 .. 3)
        setmaxnreg_dec<ASYNC ? 104 : 40>();  // 104 + 2 x 200 = 3 x 168
        if (tid == 0 && BITS) {
            tma_ring_walk(&map_a, &map_b, my_tiles, kblocks, kStages, full0, empty0, origin,
                          [&](int s, int kb, int tm, int tn, unsigned full) {
                              const unsigned dst = base + (unsigned)(s * kSt);
                              mbar_arrive_expect_tx(full, kStageA + kBBits);
                              tma_load_2d(dst, &map_a, kb * kBKB, tm * kBM, full);
                              tma_load_2d(dst + kStage, &map_b, tn * (kBN / 8), kb * 64, full);
                          });
        } else if (tid == 0) {
            tma_ring_produce(&map_a, &map_b, my_tiles, kblocks, kBKB, kStages, kStage, kStageA,
                             base, full0, empty0, [&](int j, int &row_a, int &row_b) {
                                 int tm, tn;
                                 origin(j, tm, tn);
                                 row_a = tm * kBM, row_b = tn * kBN;
                             });
        }
        if constexpr (ASYNC) {
            if (tid >= 32) {
                // the side job: with side_sync, the amax share before the first tile, then
                // the quantization in Q parts, one before each of the remaining tiles (and
                // whatever is left after the last)
                const int ew = tid - 32, first = p.side_sync ? 1 : 0;
                const int Q = max(my_tiles - first, 1);
                float amax = -1.0f;
                auto side_part = [&](int q) {
                    if (amax < 0.0f) amax = side_global_amax(p, ew);
                    side_quantize(p, q, Q, amax, ew);
                };
                for (int j = 0; j < my_tiles; j++) {
                    if (p.side_q && j == 0 && first) side_amax(p, ew, side_red);
                    if (p.side_q && j >= first) side_part(j - first);
                    int tm, tn;
                    origin(j, tm, tn);
                    uint32_t *bits = reinterpret_cast<uint32_t *>(gbase + bits_offset(BITS));
                    auto ready = [&] { mbar_wait(staged, (unsigned)j & 1u); };
                    if (p.resid)
                        epi_tile<true>(tile16, bits, tm * kBM, tn * kBN, tm, p, ready);
                    else
                        epi_tile<false>(tile16, bits, tm * kBM, tn * kBN, tm, p, ready);
                    mbar_arrive(drained);
                }
                if (p.side_q && first && my_tiles == 0) side_amax(p, ew, side_red);
                if (p.side_q)
                    for (int q = max(my_tiles - first, 0); q < Q; q++) side_part(q);
            }
        }
        return;
    }

    // A consumer: rows 64 c .. of each tile.
    setmaxnreg_inc<ASYNC ? 200 : 232>();
    const int c = wg - 1, wt = tid & 127;
    float *stg = reinterpret_cast<float *>(gbase + ring_bytes(BITS) + c * kStgBytes);
    const unsigned bits = base + (unsigned)(bits_offset(BITS) + c * kBitsBytes);
    const float alpha = p.s0[0] * p.s1[0];
    float amax = 0.0f;
    float d[128];
    for (int j = 0, i = 0; j < my_tiles; j++) {
        int tm, tn;
        origin(j, tm, tn);
        if constexpr (MODE == kMaskInline) fetch_bits(p, bits, tm * kBM + c * 64, tn * kBN);
#pragma unroll
        for (int x = 0; x < 128; x++) d[x] = 0.0f;
        for (int kb = 0; kb < kblocks; kb++, i++) {
            const int s = i % kStages;
            mbar_wait(full0 + 8 * s, (unsigned)(i / kStages) & 1u);
            const unsigned stage = base + (unsigned)(s * kSt);
            const unsigned a_tile = stage + (unsigned)(c * 64 * kBKB), b_tile = stage + kStageA;
            if constexpr (BITS) {  // both halves of B written before either consumer reads it
                make_b(gbase + (stage - base) + kStage, gbase + (b_tile - base), c, wt,
                       std::is_same<E, __half>::value ? 0x3c003c00u : 0x3f803f80u);
                fence_proxy_async();
                asm volatile("bar.sync 5, 256;\n" ::: "memory");
            }
            fence_acc(d);
            wgmma_fence();
#pragma unroll
            for (int q = 0; q < kBKB / 32; q++)  // B N-major: 16 rows (2048 bytes) a step
                mma_step<E, BITS>(d, smem_desc(a_tile + 32 * q, 16, 1024, 1),
                                  BITS ? smem_desc(b_tile + 2048 * q, 64 * 128, 1024, 1)
                                       : smem_desc(b_tile + 32 * q, 16, 1024, 1));
            wgmma_commit();
            wgmma_wait<1>();
            fence_acc(d);
            if (kb > 0 && wt == 0) mbar_arrive(empty0 + 8 * ((i - 1) % kStages));
        }
        wgmma_wait<0>();
        fence_acc(d);
        if (wt == 0) mbar_arrive(empty0 + 8 * ((i - 1) % kStages));
        if constexpr (ASYNC) {
            if (j > 0) mbar_wait(drained, (unsigned)(j - 1) & 1u);  // the last tile read back
            stage_tile16(d, tile16, c, alpha, p.out_type);
            mbar_arrive(staged);
        } else {
            bwd_epilogue<MASK>(d, stg, reinterpret_cast<const unsigned *>(gbase + (bits - base)),
                               tm * kBM + c * 64, tn * kBN, (int64_t)tm * 2 + c, p, alpha, amax,
                               c + 1);
        }
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

namespace {
// The mask in the epilogue warps where grad_x is 16-bit (BIE_CUDA_LINEAR_ASYNC_EPI=0: in the
// consumers).
bool async_epilogue_off() {
    static const bool off = env_is("BIE_CUDA_LINEAR_ASYNC_EPI", "0");
    return off;
}
bool async_epilogue(const BwdGemmArgs &p) {
    return p.mask != nullptr && p.out_type != kOutF32 && !async_epilogue_off();
}
}  // namespace

bool bwd_gemm_q4_usable() { return bwd_gemm_tma_usable() && !async_epilogue_off(); }

bool bwd_gemm_side_taken(const BwdGemmArgs &p) {
    return p.side_q != nullptr && bwd_gemm_tma_usable() && async_epilogue(p);
}

bool bwd_gemm_tma_usable() {
    return bgemm_tma_usable() && std::max(smem_bytes(false), smem_bytes(true)) <= max_smem();
}

bie_status bwd_gemm_tma_launch(const BwdGemmArgs &p) {
    const char *who = "cuda linear backward gemm (wgmma, TMA)";
    const bool mask = p.mask != nullptr;
    if (!bwd_gemm_tma_usable())
        return bie_fail(BIE_ERR_UNSUPPORTED, "%s: needs a device of compute capability 9.0", who);
    const int64_t tiles_m = (p.M + kBM - 1) / kBM, tiles_n = (p.N + kBN - 1) / kBN;
    const bool from_bits = p.op == kOpBits16, same16 = p.op == kOpSame16 || from_bits;
    const int64_t row_bytes = p.K * (same16 ? 2 : 1);
    if (same16 && (!mask || p.out_type == kOutF32))
        return bie_fail(BIE_ERR_INTERNAL, "%s: 16-bit operands take the mask epilogue", who);
    if (p.M < 1 || p.N < 1 || p.K < 1 || row_bytes % 16 != 0 || p.N % 16 != 0 || p.M > INT_MAX ||
        p.N > INT_MAX || tiles_m * tiles_n > INT_MAX || p.M * p.N > ((int64_t)1 << 40))
        return bie_fail(BIE_ERR_INTERNAL, "%s: shape %lld x %lld x %lld", who, (long long)p.M,
                        (long long)p.N, (long long)p.K);
    if (mask ? (p.signs == nullptr && p.resid == nullptr) || p.part_sum == nullptr ||
                   p.part_dot == nullptr || p.ld % 32 || reinterpret_cast<uintptr_t>(p.mask) % 16 ||
                   reinterpret_cast<uintptr_t>(p.signs) % 16 ||
                   reinterpret_cast<uintptr_t>(p.resid) % 4
             : p.out == nullptr || p.amax_part == nullptr)
        return bie_fail(BIE_ERR_INTERNAL, "%s: epilogue arguments", who);
    CUtensorMap map_a, map_b;
    if (from_bits && (p.ldb % 16 || p.ldb * 8 < p.N || reinterpret_cast<uintptr_t>(p.b) % 16))
        return bie_fail(BIE_ERR_INTERNAL, "%s: the sign bits of B", who);
    if (!tma_map_rows(&map_a, p.a, p.M, row_bytes, kBM) ||
        !(from_bits ? tma_map_bytes(&map_b, p.b, p.K, p.ldb, kBN / 8, 64)
                    : tma_map_rows(&map_b, p.b, p.N, row_bytes, kBN)))
        return bie_fail(BIE_ERR_UNSUPPORTED, "%s: the driver cannot describe the operands", who);
    const bool async = async_epilogue(p);
    if (p.resid && !async)
        return bie_fail(BIE_ERR_INTERNAL, "%s: the 4-bit sums take the 16-bit epilogue", who);
    if (p.side_q && (!async || p.side_x == nullptr || p.side_part == nullptr || p.side_n < 0))
        return bie_fail(BIE_ERR_INTERNAL, "%s: the side job's arguments", who);
    const bool bf16 = p.out_type == kOutBF16;
    auto fn = from_bits ? (bf16 ? bwd_gemm<kMaskAsync, __nv_bfloat16, true>
                                : bwd_gemm<kMaskAsync, __half, true>)
              : same16 ? (bf16 ? bwd_gemm<kMaskAsync, __nv_bfloat16> : bwd_gemm<kMaskAsync, __half>)
              : !mask  ? bwd_gemm<kStore, uint8_t>
              : async  ? bwd_gemm<kMaskAsync, uint8_t>
                       : bwd_gemm<kMaskInline, uint8_t>;
    const size_t smem = smem_bytes(from_bits);
    BIE_CUDA_TRY(check(cudaFuncSetAttribute(reinterpret_cast<const void *>(fn),
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
                       "cudaFuncSetAttribute"));
    // at most kAmaxBlocks blocks: one partial maximum each
    const int64_t blocks =
        std::min<int64_t>({tiles_m * tiles_n, (int64_t)device_sms(), (int64_t)kAmaxBlocks});
    BIE_CUDA_TRY(check(launch_after(fn, dim3((unsigned)blocks), dim3(kThreads), smem, map_a, map_b,
                                    p, (int)tiles_m, (int)tiles_n),
                       who));
    return check(cudaGetLastError(), who);
}

}  // namespace bie_cuda
