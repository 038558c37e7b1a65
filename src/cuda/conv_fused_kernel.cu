// The fused binary conv kernel (the design: conv_fused.cu) and its launch: the input's pack
// into shared memory, the implicit GEMM on the packed pixels and the epilogue, instantiated
// per input type, pixels per lane in the pack and block width. The bounds its comments cite
// as fused_plan's (32-bit offsets) are checked by the planner (plan_fused, conv_fused.cu).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "conv_common.cuh"
#include "conv_fused.cuh"
#include "cuda_common.cuh"
#include "cuda_internal.h"
#include "epilogue.cuh"
#include "mma.cuh"
#include "pdl.cuh"

namespace bie_cuda {
namespace fused {
namespace {

// The sign test v = x + bias >= 0 of the CPU's float arithmetic, as one compare against a
// per-channel threshold in the input's own type: for finite bias the float sum has the
// exact sum's sign (a nonzero exact sum of two floats never rounds to zero), so v >= 0 iff
// x >= -bias, iff x >= the least T not below -bias. bias = +inf: true but for -inf and NaN
// (threshold: the lowest finite T); bias = -inf or NaN: never (threshold NaN). Thresholds
// are 32-bit words: a float, or the 16-bit value in both halves.
template <typename T> __device__ __forceinline__ uint32_t sign_threshold(float b);
template <> __device__ __forceinline__ uint32_t sign_threshold<float>(float b) {
    const float t = b != b || b == -INFINITY ? __int_as_float(0x7fc00000)
                    : b == INFINITY          ? -FLT_MAX
                                             : -b;
    return __float_as_uint(t);
}
template <> __device__ __forceinline__ uint32_t sign_threshold<__nv_bfloat16>(float b) {
    const unsigned short h = b != b || b == -INFINITY ? 0x7fc0
                             : b == INFINITY          ? 0xff7f
                                             : __bfloat16_as_ushort(__float2bfloat16_ru(-b));
    return h * 0x10001u;
}
template <> __device__ __forceinline__ uint32_t sign_threshold<__half>(float b) {
    const unsigned short h = b != b || b == -INFINITY ? 0x7e00
                             : b == INFINITY          ? 0xfbff
                                                      : __half_as_ushort(__float2half_ru(-b));
    return h * 0x10001u;
}

// Sign words of VP pixels from their runs of 32 channels (thr: the channels' thresholds).
// 16-bit types compare two pixels per instruction (mask: 0xffff in each true half); one
// merge per channel keeps bits c % 16 and 16 + c % 16 of the mask in lo (channels 0..15) or
// hi (16..31), so each half of lo and hi is one pixel's 16 channels.
template <typename T, int VP> struct PackBits {
    static __device__ __forceinline__ void run(const RawRun<sizeof(T) * VP> (&r)[32],
                                               const uint32_t *thr, uint32_t (&out)[VP]) {
        constexpr int NW = VP > 1 ? VP / 2 : 1;
        uint32_t lo[NW], hi[NW];
#pragma unroll
        for (int w = 0; w < NW; w++) lo[w] = hi[w] = 0;
#pragma unroll
        for (int c4 = 0; c4 < 32; c4 += 4) {
            const uint4 t4 = *reinterpret_cast<const uint4 *>(thr + c4);
            const uint32_t tv[4] = {t4.x, t4.y, t4.z, t4.w};
#pragma unroll
            for (int cc = 0; cc < 4; cc++) {
                const int c = c4 + cc;
#pragma unroll
                for (int w = 0; w < NW; w++) {
                    const uint32_t m = mask2(r[c].w[w], tv[cc]) & (0x10001u << (c & 15));
                    if (c < 16)
                        lo[w] |= m;
                    else
                        hi[w] |= m;
                }
            }
        }
#pragma unroll
        for (int w = 0; w < NW; w++) {
            out[2 * w] = __byte_perm(lo[w], hi[w], 0x5410);
            if (2 * w + 1 < VP) out[2 * w + 1] = __byte_perm(lo[w], hi[w], 0x7632);
        }
    }
    static __device__ __forceinline__ uint32_t mask2(uint32_t x, uint32_t t) {
        if constexpr (sizeof(T) == 2) {
            T x2[2], t2[2];
            memcpy(x2, &x, 4);
            memcpy(t2, &t, 4);
            using T2 = typename std::conditional<std::is_same<T, __half>::value, __half2,
                                                 __nv_bfloat162>::type;
            return __hge2_mask(*reinterpret_cast<const T2 *>(x2),
                               *reinterpret_cast<const T2 *>(t2));
        } else {
            return 0;
        }
    }
};
template <int VP> struct PackBits<float, VP> {
    static __device__ __forceinline__ void run(const RawRun<4 * VP> (&r)[32], const uint32_t *thr,
                                               uint32_t (&out)[VP]) {
#pragma unroll
        for (int j = 0; j < VP; j++) out[j] = 0;
#pragma unroll
        for (int c = 0; c < 32; c++) {
            const float t = __uint_as_float(thr[c]);
#pragma unroll
            for (int j = 0; j < VP; j++) out[j] |= __uint_as_float(r[c].w[j]) >= t ? 1u << c : 0u;
        }
    }
};

// Two values as one 32-bit word of a 16-bit type (the first in the low half).
template <typename T> __device__ __forceinline__ unsigned pack2(float a, float b) {
    const T h[2] = {from_f32<T>(a), from_f32<T>(b)};
    unsigned w;
    memcpy(&w, h, 4);
    return w;
}

// Four elements of T: read from shared memory, written whole to global memory (4-element
// aligned).
template <typename T> struct Quad {
    uint32_t w[sizeof(T)];
    __device__ __forceinline__ void load(unsigned at) {
        if constexpr (sizeof(T) == 2) {
            const uint2 v = lds64(at);
            w[0] = v.x, w[1] = v.y;
        } else {
            const uint4 v = lds128(at);
            w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
        }
    }
    __device__ __forceinline__ void store(T *o) const {
        if constexpr (sizeof(T) == 2)
            stg64(o, w[0], w[1]);
        else
            stg128(o, w[0], w[1], w[2], w[3]);
    }
};

// Byte offset of (channel c, pixel p) in a warp's stage: channel rows of 16 pixels, their
// 16-byte chunks swizzled so that both the writes in the accumulators' layout (stmatrix for
// 16-bit types, single words for float) and the reads of 4 neighbouring pixels of a channel
// spread over the banks.
template <typename T> __device__ __forceinline__ int stage_at(int c, int p) {
    constexpr int E = sizeof(T);
    const int chunk = p * E / 16, f = E == 2 ? (c >> 2) & 1 : ((c >> 1) & 1) << 1;
    return c * 16 * E + (chunk ^ f) * 16 + p * E % 16;
}

// One m16 half of a warp's tile (acc: lane's pixels g and g + 8, channel pairs 8 j + 2 t4)
// into its stage as output values: (K - 2 popc(row) + the row class's column term + 4
// popc(AND)) times the scale, the column term being correction - 2 popc(column). rowf: the
// two pixels' K - 2 popc(row) - 1.5 2^23; crow: their classes' biased column terms at the
// lane's first channel pair.
template <typename T>
__device__ __forceinline__ void stage_half(unsigned stage, const int (&acc)[4][4],
                                           const float (&rowf)[2], const int *const (&crow)[2],
                                           int lane, float scale) {
    const int g = lane >> 2, t4 = lane & 3;
    float v[4][2][2];
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int2 ct = *reinterpret_cast<const int2 *>(crow[r] + j * 8);
            v[j][r][0] = (__int_as_float(4 * acc[j][2 * r] + ct.x) + rowf[r]) * scale;
            v[j][r][1] = (__int_as_float(4 * acc[j][2 * r + 1] + ct.y) + rowf[r]) * scale;
        }
    if constexpr (sizeof(T) == 2 && kStmatrix) {
        // Matrix (j, r) of a stmatrix is pixels 8 r.. x channels 8 j..: stored transposed,
        // its row k (lane 8 m + k's address) is channel 8 j + k.
        const int m = lane >> 3, k = lane & 7;
#pragma unroll
        for (int jb = 0; jb < 4; jb += 2) {
            const unsigned at = stage + stage_at<T>(8 * (jb + (m >> 1)) + k, 8 * (m & 1));
            stmatrix_x4_trans(at, pack2<T>(v[jb][0][0], v[jb][0][1]),
                              pack2<T>(v[jb][1][0], v[jb][1][1]),
                              pack2<T>(v[jb + 1][0][0], v[jb + 1][0][1]),
                              pack2<T>(v[jb + 1][1][0], v[jb + 1][1][1]));
        }
    } else {
        // Element by element (float; 16-bit types before compute capability 9.0).
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int r = 0; r < 2; r++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const unsigned at = stage + stage_at<T>(8 * j + 2 * t4 + e, g + 8 * r);
                    if constexpr (sizeof(T) == 2) {
                        const T h = from_f32<T>(v[j][r][e]);
                        unsigned short bits;
                        memcpy(&bits, &h, 2);
                        sts16(at, bits);
                    } else {
                        sts32(at, __float_as_uint(v[j][r][e]));
                    }
                }
    }
}

// WARPS: 8 (two blocks per SM) or 16. VP: input pixels per lane in the pack (one aligned
// load of VP elements). Input and output are both of type T.
template <typename T, int VP, int WARPS>
__global__ void __launch_bounds__(WARPS * 32, WARPS == 8 ? 2 : 1)
    bconv_fused(const T *__restrict__ x, const float *__restrict__ bias,
                const uint8_t *__restrict__ wimg, bie_conv_geom g64, FusedPlan p, Epilogue ep) {
    extern __shared__ __align__(16) uint8_t smem[];
    const int C = (int)g64.c, cw = (C + 31) / 32, k = (int)g64.k, kk = k * k, H = (int)g64.h,
              W = (int)g64.w;
    const int s = (int)g64.s, pad = (int)g64.p, dil = (int)g64.d, oh = (int)g64.oh,
              ow = (int)g64.ow;
    const int O = (int)g64.o, plane = oh * ow;
    constexpr int kFusedThreads = WARPS * 32, kFusedWarps = WARPS;
    const FusedSmem lay(p, oh, ow);
    uint8_t *sB = smem + lay.b, *sImg = smem + lay.img;
    int *sPpix = reinterpret_cast<int *>(smem + lay.ppix),
        *sDelta = reinterpret_cast<int *>(smem + lay.delta);
    int *sCell = reinterpret_cast<int *>(smem + lay.cell),
        *sRcls = reinterpret_cast<int *>(smem + lay.rcls);
    int *sOofs = reinterpret_cast<int *>(smem + lay.oofs);
    const int *sCorr = reinterpret_cast<const int *>(smem + lay.corr);
    int *sYcls = reinterpret_cast<int *>(smem + lay.ycls),
        *sXcls = reinterpret_cast<int *>(smem + lay.xcls);
    Segment *sSeg = reinterpret_cast<Segment *>(smem + lay.seg);

    const int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5;
    uint8_t *sStage = smem + lay.stage + warp * stage_bytes((int)sizeof(T));
    // The band: batch pixels [px0, px0 + band_px), of images n_first.. (N oh ow < 2^31).
    const int px0 = (int)blockIdx.x * p.bp, band_px = min(p.bp, (int)g64.n * plane - px0);
    const int n_first = px0 / plane, nseg = (px0 + band_px - 1) / plane - n_first + 1;
    const int n0 = (int)blockIdx.y * p.bn, cols = min(p.bn, O - n0);
    const int kd = (k - 1) * dil + 1;  // field rows of one output row
    const int bstride = p.ldr + 16, chunks = p.ldr / 16, cells = p.pr * p.wp;

    pdl_trigger();  // the next kernel's preamble may overlap this one
    // Everything that does not depend on the input runs before pdl_wait, behind the kernel
    // just ahead of this one: the pixel classes of column 0 and of row 0 (4-byte cp.async,
    // waited for before the first barrier), then the channel block's weight image (the
    // weight rows and column terms, which the layer prepares before that kernel: see
    // bie_cuda_conv_fused), by one bulk copy where the device has them, waited for only
    // after the pack so that its transfer overlaps the wait for the input and its loads.
    for (int i = tid; i < oh + ow; i += kFusedThreads) {
        const int *pc = ep.conv.pix_class;
        cp_async_n(smem_u32(i < oh ? sYcls + i : sXcls + i - oh),
                   pc ? pc + (i < oh ? i * ow : i - oh) : reinterpret_cast<const int *>(wimg), 4,
                   pc != nullptr);
    }
    cp_async_commit();
    {
        const unsigned bytes = (unsigned)image_block_bytes(p);
        const uint8_t *src = wimg + (size_t)blockIdx.y * bytes;
        if (kBulk) {
            if (tid == 0) bulk_load(smem_u32(sB), src, bytes, smem_u32(smem + lay.bar));
        } else {
            for (unsigned i = 16u * tid; i < bytes; i += 16u * kFusedThreads)
                cp_async_n(smem_u32(sB) + i, src + i, 16, true);
        }
    }
    cp_async_commit();
    // The field (zero words stand for the padding) and its pixel popcounts start at zero.
    for (int i = tid; i < cells * p.pstride / 16; i += kFusedThreads)
        reinterpret_cast<uint4 *>(sImg)[i] = make_uint4(0u, 0u, 0u, 0u);
    for (int i = tid; i < cells; i += kFusedThreads) sPpix[i] = 0;
    // The segments: image n_first + j holds the band's pixels [a, e) of its plane, output
    // rows lo..hi, whose field (rows lo s - pad .. hi s - pad + kd - 1 of the input, those
    // inside it loaded) follows the fields of the segments before it.
    if (tid == 0) {
        int fr = 0, items = 0;
        for (int j = 0; j < nseg; j++) {
            const int base = (n_first + j) * plane, a = max(px0 - base, 0),
                      e = min(px0 + band_px - base, plane);
            const SegRows<int> sr = seg_rows(a, e, ow, s, pad, kd, H);
            const int fa = sr.iy0 * W, fb = max(sr.iy1 * W, fa), f0 = fa / VP * VP;
            sSeg[j] = {fa, fb, items, fr - (sr.lo * s - pad)};
            fr += sr.field;
            items += (fb - f0 + 32 * VP - 1) / (32 * VP) * cw;
        }
        sSeg[nseg] = {0, 0, items, 0};
    }
    // Chunk q of a GEMM row (16 bytes: words 4q..4q+3, inside one tap since cw % 4 == 0)
    // sits at this byte offset from its pixel's packed row; chunks past the taps multiply
    // zero weight bits, so any readable address does.
    for (int i = tid; i < chunks; i += kFusedThreads) {
        const int tap = 4 * i / cw, off = 4 * i - tap * cw;
        sDelta[i] =
            tap < kk ? (((tap / k) * dil) * p.wp + (tap % k) * dil) * p.pstride + off * 4 : 0;
    }
    cp_async_wait<1>();  // all but the weight image
    __syncthreads();
    // Each tile row (rows past the band repeat its last pixel): the field cell of its first
    // tap, its padding class, class(oy, 0) + class(0, ox) - class(0, 0), and the offset of
    // its output from the band's first image's (< 2^31: fused_plan).
    for (int r = tid; r < p.rows; r += kFusedThreads) {
        const int px = px0 + min(r, band_px - 1), j = px / plane - n_first,
                  pi = px - (n_first + j) * plane, oy = pi / ow, ox = pi - oy * ow;
        sCell[r] = (sSeg[j].rowbase + oy * s - pad) * p.wp + ox * s;
        sRcls[r] = sYcls[oy] + sXcls[ox] - sXcls[0];
        sOofs[r] = j * O * plane + pi;
    }

    pdl_wait();  // the input (and the bias, which training updates) may come from the kernel before
    // The input's pack: item = (segment, run group, sign word wd); warp = item, lane = VP
    // pixels from a VP-aligned start (a group covers 32 VP pixels of the segment's input
    // rows; pixels outside them are loaded but not stored), one aligned load per channel
    // (channels past C load channel C - 1 again; their thresholds clear the bits), and the
    // bias of channel 32 wd + lane, whose threshold the warp puts in its stage.
    const int items = sSeg[nseg].item0, xw = min(W, p.wp - pad);
    const int hw = H * W;  // C H W < 2^31 (fused_plan)
    RawRun<sizeof(T) * VP> run[32];
    float bv = 0.0f;
    // Item it's segment, sign word, and the lane's first pixel in the image's plane.
    auto item_at = [&](int it, int &j, int &wd, int &off) {
        j = 0;
        while (sSeg[j + 1].item0 <= it) j++;
        const int local = it - sSeg[j].item0, grp = local / cw;
        wd = local - grp * cw;
        off = sSeg[j].fa / VP * VP + (grp * 32 + lane) * VP;
    };
    auto load_item = [&](int j, int wd, int off) {
        const int ch = wd * 32 + lane;
        bv = ch < C ? bias[ch] : NAN;  // channels past C: a NaN threshold, so their bits are zero
        if (off >= sSeg[j].fb) return;
        const T *img = x + (int64_t)(n_first + j) * C * hw;
        const int c0 = wd * 32, cn = min(32, C - c0), first = c0 * hw + off;
        if (cn == 32) {
#pragma unroll
            for (int c = 0; c < 32; c++) run[c].load(img + first + c * hw);
        } else {
#pragma unroll
            for (int c = 0; c < 32; c++) run[c].load(img + first + min(c, cn - 1) * hw);
        }
    };
    uint32_t *thr = reinterpret_cast<uint32_t *>(sStage);  // the stage is free until the epilogue
    int iseg = 0, iwd = 0, ioff = 0;                       // the item in hand (its loads issued)
    if (warp < items) {
        item_at(warp, iseg, iwd, ioff);
        load_item(iseg, iwd, ioff);
    }
    for (int it = warp; it < items; it += kFusedWarps) {
        const Segment sg = sSeg[iseg];
        __syncwarp();  // the previous item's thresholds are read
        thr[lane] = sign_threshold<T>(bv);
        __syncwarp();
        if (ioff < sg.fb) {
            uint32_t sb[VP];
            PackBits<T, VP>::run(run, thr, sb);
            const int iy0 = ioff / W,
                      ix0 = ioff - iy0 * W;  // hw % VP == 0: the run is inside the plane
            // Store jj writes pixel (jj + lane) % VP of each lane's run: neighbouring lanes'
            // pixels lie VP cells apart, so the rotation spreads one store over more banks.
#pragma unroll
            for (int jj = 0; jj < VP; jj++) {
                const int r = (jj + lane) & (VP - 1);
                uint32_t v = sb[0];
#pragma unroll
                for (int t = 1; t < VP; t++) v = r == t ? sb[t] : v;
                int iy = iy0, ix = ix0 + r;
                while (ix >= W) ix -= W, iy++;
                if (ix < xw && ioff + r >= sg.fa && ioff + r < sg.fb) {
                    const int cell = (sg.rowbase + iy) * p.wp + pad + ix;
                    *reinterpret_cast<uint32_t *>(sImg + cell * p.pstride + iwd * 4) = v;
                    atomicAdd(sPpix + cell, __popc(v));
                }
            }
        }
        if (it + kFusedWarps < items) {
            item_at(it + kFusedWarps, iseg, iwd, ioff);
            load_item(iseg, iwd, ioff);
        }
    }
    cp_async_wait<0>();
    if (kBulk) bulk_wait(smem_u32(smem + lay.bar));
    __syncthreads();  // the field and its popcounts; the weight image

    // Warp tiles of 32 band pixels x 32 channels: two m16 A fragments from the packed
    // pixels, four n8 B fragments from the weight rows, per 256-bit k step.
    const float scale = ep.scale();
    const int K = C * kk;  // < 2^24
    const int q = lane >> 3, r8 = lane & 7, g = lane >> 2, t4 = lane & 3;
    const int nts = (cols + 31) / 32, units = (band_px + 31) / 32 * nts, ksteps = p.ldr / 32;
    T *out = static_cast<T *>(ep.out) + ((int64_t)n_first * O + n0) * plane;
    const unsigned stage_at0 = smem_u32(sStage);
    const bool vec4 = plane % 4 == 0 && p.bp % 4 == 0 &&
                      reinterpret_cast<uintptr_t>(ep.out) % (4 * sizeof(T)) == 0;
    const unsigned img_at = smem_u32(sImg);
    const int tap_row = dil * p.wp;
    int mt = warp / nts, nt = warp - mt * nts;
    for (int u = warp; u < units; u += kFusedWarps) {
        // Lane's row of the tile: K - 2 popcount(row), the sum over the taps of its pixels'
        // popcounts (3 x 3 unrolled).
        const int cell0 = sCell[mt * 32 + lane], rcls = sRcls[mt * 32 + lane];
        int pa = 0;
        if (k == 3) {
#pragma unroll
            for (int ti = 0; ti < 3; ti++)
#pragma unroll
                for (int tj = 0; tj < 3; tj++) pa += sPpix[cell0 + ti * tap_row + tj * dil];
        } else {
            for (int ti = 0; ti < k; ti++)
                for (int tj = 0; tj < k; tj++) pa += sPpix[cell0 + ti * tap_row + tj * dil];
        }
        const int rterm = K - 2 * pa;
        const unsigned a0 = img_at + __shfl_sync(~0u, cell0, r8 + 8 * (q & 1)) * p.pstride;
        const unsigned a1 = img_at + __shfl_sync(~0u, cell0, 16 + r8 + 8 * (q & 1)) * p.pstride;
        const unsigned b_at = smem_u32(sB + (nt * 32 + r8 + 8 * (q >> 1)) * bstride + 16 * (q & 1));
        int acc[2][4][4];
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[i][j][e] = 0;
        // Fragments of k step kc+1 load while the mma of step kc run.
        struct Frag {
            unsigned a[2][4], b[2][4];
        } f0, f1;
        auto load = [&](Frag &f, int kc) {
            const int dl = sDelta[2 * kc + (q >> 1)];
            ldmatrix_x4(f.a[0], a0 + dl);
            ldmatrix_x4(f.a[1], a1 + dl);
            ldmatrix_x4(f.b[0], b_at + kc * 32);
            ldmatrix_x4(f.b[1], b_at + 16 * bstride + kc * 32);
        };
        auto mma = [&](const Frag &f) {
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int jj = 0; jj < 2; jj++) {
                    mma_b1_and(acc[i][2 * jj], f.a[i], f.b[jj][0], f.b[jj][1]);
                    mma_b1_and(acc[i][2 * jj + 1], f.a[i], f.b[jj][2], f.b[jj][3]);
                }
        };
        load(f0, 0);
        int kc = 0;
        for (; kc + 2 <= ksteps; kc += 2) {
            load(f1, kc + 1);
            mma(f0);
            if (kc + 2 < ksteps) load(f0, kc + 2);
            mma(f1);
        }
        if (kc < ksteps) mma(f0);
        // Each 16-pixel half of the tile goes through the warp's stage as output values in
        // channel rows. Where the band's 4-pixel groups lie whole and aligned in the output
        // (vec4: the plane and the band are multiples of 4 pixels, so no group crosses into
        // the next image, and the output is aligned), lane = (4-pixel group, channel): one
        // 4-element store per channel, each instruction 8 channels x 16 pixels; else lane =
        // (pixel, channel parity), one element per store. Offsets in 32 bits: segs O plane <
        // 2^31 (fused_plan). One loop per store form (the other's predicates stay out).
        const int ncol = cols - nt * 32;
        const float rowf = (float)rterm - kTermBiasF;
        const int *const ccol = sCorr + nt * 32 + 2 * t4;
        auto halves = [&](auto vec4_form) {
#pragma unroll 1
            for (int i = 0; i < 2; i++) {
                const float rf[2] = {__shfl_sync(~0u, rowf, i * 16 + g),
                                     __shfl_sync(~0u, rowf, i * 16 + g + 8)};
                const int *const crow[2] = {
                    ccol + __shfl_sync(~0u, rcls, i * 16 + g) * corr_stride(p.bn),
                    ccol + __shfl_sync(~0u, rcls, i * 16 + g + 8) * corr_stride(p.bn)};
                __syncwarp();  // the stage is free (the thresholds or the previous half are read)
                // Static indices into acc in both branches keep it in registers.
                if (i == 0)
                    stage_half<T>(stage_at0, acc[0], rf, crow, lane, scale);
                else
                    stage_half<T>(stage_at0, acc[1], rf, crow, lane, scale);
                __syncwarp();
                // All of a lane's reads, then its stores.
                if constexpr (decltype(vec4_form)::value) {
                    const int rl = mt * 32 + i * 16 + 4 * (lane & 3), sub = lane >> 2;
                    Quad<T> v[4];
#pragma unroll
                    for (int q = 0; q < 4; q++)
                        v[q].load(stage_at0 + stage_at<T>(8 * q + sub, 4 * (lane & 3)));
                    if (rl < band_px) {
                        T *o = out + (sOofs[rl] + (nt * 32 + sub) * plane);
#pragma unroll
                        for (int q = 0; q < 4; q++, o += 8 * plane)
                            if (8 * q + sub < ncol) v[q].store(o);
                    }
                } else {
                    const int rl = mt * 32 + i * 16 + (lane & 15), par = lane >> 4;
                    T v[16];
#pragma unroll
                    for (int cc = 0; cc < 16; cc++)
                        v[cc] = *reinterpret_cast<const T *>(sStage +
                                                             stage_at<T>(2 * cc + par, lane & 15));
                    if (rl < band_px) {
                        T *o = out + (sOofs[rl] + (nt * 32 + par) * plane);
#pragma unroll
                        for (int cc = 0; cc < 16; cc++, o += 2 * plane)
                            if (2 * cc + par < ncol) *o = v[cc];
                    }
                }
            }
        };
        if (vec4)
            halves(std::true_type{});
        else
            halves(std::false_type{});
        nt += kFusedWarps;
        while (nt >= nts) nt -= nts, mt++;
    }
}

template <typename T, int VP>
cudaError_t launch_fused(const void *x, const float *bias, const uint8_t *wimg, bool overlap,
                         const bie_conv_geom *g, const FusedPlan &p, const Epilogue &ep) {
    auto fn = p.warps == 16 ? bconv_fused<T, VP, 16> : bconv_fused<T, VP, 8>;
    const size_t smem = FusedSmem(p, (int)g->oh, (int)g->ow).total;
    // Held to the launch: the shared memory depends on the plan.
    std::lock_guard<std::mutex> smem_lock(smem_attribute_mutex());
    cudaError_t e = cudaFuncSetAttribute(reinterpret_cast<const void *>(fn),
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
    const dim3 grid((unsigned)p.bands, (unsigned)((g->o + p.bn - 1) / p.bn));
    return launch_kernel(overlap, fn, grid, dim3(32 * p.warps), smem, static_cast<const T *>(x),
                         bias, wimg, *g, p, ep);
}

// Input pixels per lane: the widest aligned run of at most 8 bytes that divides the input
// plane (a run never crosses into the next channel).
template <typename T>
cudaError_t launch_fused_any(const void *x, const float *bias, const uint8_t *wimg, bool overlap,
                             const bie_conv_geom *g, const FusedPlan &p, const Epilogue &ep) {
    int vp = 1;
    while (vp * 2 * sizeof(T) <= 8 && (uintptr_t)x % (vp * 2 * sizeof(T)) == 0 &&
           (g->h * g->w) % (vp * 2) == 0)
        vp *= 2;
    constexpr int kWide = 8 / sizeof(T);
    if (vp >= kWide) return launch_fused<T, kWide>(x, bias, wimg, overlap, g, p, ep);
    if (vp == 2) return launch_fused<T, 2>(x, bias, wimg, overlap, g, p, ep);
    return launch_fused<T, 1>(x, bias, wimg, overlap, g, p, ep);
}

}  // namespace

cudaError_t launch_bconv_fused(bie_dtype dtype, const void *x, const float *bias,
                               const uint8_t *wimg, bool overlap, const bie_conv_geom *g,
                               const FusedPlan &p, const Epilogue &ep) {
    switch (dtype) {
    case BIE_F32: return launch_fused_any<float>(x, bias, wimg, overlap, g, p, ep);
    case BIE_BF16: return launch_fused_any<__nv_bfloat16>(x, bias, wimg, overlap, g, p, ep);
    default: return launch_fused_any<__half>(x, bias, wimg, overlap, g, p, ep);
    }
}

}  // namespace fused
}  // namespace bie_cuda
