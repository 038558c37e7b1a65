// Binary conv2d forward pieces on the device (layouts in cuda_internal.h): the input's sign
// and clip bits per pixel (NHWC), the bit im2col the GEMM multiplies, and the implicit GEMM.
// The weight rows in tap order, their per-tap sums and the zero-padding corrections per pixel
// class come from conv_weight.cu.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "conv_common.cuh"
#include "cuda_common.cuh"
#include "cuda_internal.h"
#include "dtype.cuh"
#include "epilogue.cuh"
#include "mma.cuh"
#include "pdl.cuh"

namespace bie_cuda {
namespace {

unsigned blocks_for(int64_t count, int threads) {
    int64_t b = (count + threads - 1) / threads;
    return (unsigned)(b < 1 ? 1 : b > 1048576 ? 1048576 : b);
}

constexpr int kPackWords = 8;        // sign words per block: a 32 B run of every output row
constexpr int kPackMinWarps = 1024;  // enough warps to fill a large GPU before loads get wider
// (H100, N=64, C=256, 14x14: 1024 gives 2-pixel loads and a 28.1 us forward, 2048 1-pixel
// loads and 28.8-29.2 us, 512 4-pixel loads and 28.1-28.4 us)

// Block (pixel tile, word chunk): pg groups of 32 VP pixels, counted over all images in NHW
// order (no idle lanes at the end of each image), times wc sign words. Warp = one (group,
// word) cell; lane = VP consecutive pixels of the cell's 32 channel planes, one aligned load
// per channel, so a warp's load is one coalesced 32 VP element run and a lane forms its
// pixels' words without exchanging data. The words go through shared memory so that the
// tile's output rows are written as contiguous runs (the whole tile is one contiguous range
// when cw <= kPackWords). VP > 1 needs hw % VP == 0 and x aligned to VP elements: then a run
// never crosses an image or a misaligned address. v = x + bias and the mask test are the
// CPU's float arithmetic. Pixel indices in 32 bits (the layer caps n h w), element offsets in 64.
template <typename T, int VP, bool TRAIN>
__global__ void __launch_bounds__(256)
    pack_input(const T *__restrict__ x, bie_conv_geom g64, int wc, int pg,
               const float *__restrict__ bias, const float *scale_a, const float *scale_w,
               float *saved_scales, uint32_t *signs, uint32_t *mask) {
    extern __shared__ uint32_t pack_tile[];
    const int hw = (int)(g64.h * g64.w), C = (int)g64.c, cw = (C + 31) / 32;
    const int nhw = (int)(g64.n * g64.h * g64.w);
    const int rows = pg * 32 * VP,
              ld = wc | 1;  // odd row stride: the lanes' words spread over the banks
    const int first = (int)blockIdx.x * rows, left = nhw - first;
    const int w0 = (int)blockIdx.y * wc, words = min(wc, cw - w0);
    const int warp = (int)threadIdx.x >> 5, lane = (int)threadIdx.x & 31;
    uint32_t *tsign = pack_tile, *tmask = pack_tile + rows * ld;
    pdl_trigger();  // the GEMM that reads these words may launch now
    if (saved_scales && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
        saved_scales[0] = *scale_a;
        saved_scales[1] = *scale_w;
    }
    const int group = warp / wc, wl = warp - group * wc;
    if (wl < words) {
        const int off = (group * 32 + lane) * VP;  // the lane's first pixel in the tile
        const bool live = off < left;
        const int c0 = (w0 + wl) * 32, cn = min(32, C - c0);
        const uint32_t valid = live ? (cn == 32 ? 0xffffffffu : (1u << cn) - 1) : 0u;
        const float lane_bias = lane < cn ? bias[c0 + lane] : 0.0f;
        int n = 0, pix = 0;
        if (live) {
            n = (first + off) / hw;
            pix = first + off - n * hw;
        }
        const T *src = x + ((int64_t)n * C + c0) * hw + pix;
        RawRun<sizeof(T) * VP> run[32];
#pragma unroll
        for (int c = 0; c < 32; c++) {
            run[c] = RawRun<sizeof(T) * VP>{};
            if (live && c < cn) run[c].load(src + (int64_t)c * hw);
        }
        uint32_t sb[VP], mb[VP];
#pragma unroll
        for (int j = 0; j < VP; j++) sb[j] = mb[j] = 0;
        const float bound = TRAIN ? clip_bound(*scale_a) : 1.0f;
#pragma unroll
        for (int c = 0; c < 32; c++) {
            const float b = __shfl_sync(0xffffffffu, lane_bias, c);
#pragma unroll
            for (int j = 0; j < VP; j++) {
                const float v = run_elem<T>(run[c].w, j) + b;
                sb[j] |= (uint32_t)(v >= 0.0f) << c;
                if (TRAIN) mb[j] |= (uint32_t)(fabsf(v) <= bound) << c;
            }
        }
#pragma unroll
        for (int j = 0; j < VP; j++) {
            tsign[(off + j) * ld + wl] = sb[j] & valid;
            if (TRAIN) tmask[(off + j) * ld + wl] = mb[j] & valid;
        }
    }
    __syncthreads();
    const int count = min(rows, left) * words;
    for (int i = (int)threadIdx.x; i < count; i += (int)blockDim.x) {
        const int r = i / words, j = i - r * words;
        const int64_t dst = (int64_t)(first + r) * cw + w0 + j;
        signs[dst] = tsign[r * ld + j];
        if (TRAIN) mask[dst] = tmask[r * ld + j];
    }
}

template <typename T, int VP>
void launch_pack_input(const T *x, const bie_conv_geom *g, int64_t cw, const float *bias,
                       const float *scale_a, const float *scale_w, float *saved_scales,
                       uint32_t *signs, uint32_t *mask) {
    const int64_t nhw = g->n * g->h * g->w;
    const int wc = (int)(cw < kPackWords ? (cw < 1 ? 1 : cw) : kPackWords), pg = kPackWords / wc;
    const int64_t rows = (int64_t)pg * 32 * VP, tiles = (nhw + rows - 1) / rows;
    const dim3 grid((unsigned)(tiles < 1 ? 1 : tiles),
                    (unsigned)((cw + wc - 1) / wc < 1 ? 1 : (cw + wc - 1) / wc));
    const size_t smem = (size_t)rows * (wc | 1) * sizeof(uint32_t) * (mask ? 2 : 1);
    if (mask)
        pack_input<T, VP, true><<<grid, 32 * pg * wc, smem, current_stream>>>(
            x, *g, wc, pg, bias, scale_a, scale_w, saved_scales, signs, mask);
    else
        pack_input<T, VP, false><<<grid, 32 * pg * wc, smem, current_stream>>>(
            x, *g, wc, pg, bias, scale_a, scale_w, saved_scales, signs, mask);
}

// NHWC input: a warp per (pixel, sign word) cell, lane l = channel 32 word + l, so that a
// warp's load is one contiguous run of 32 elements and its two ballots are the cell's sign
// and mask words. The same float arithmetic as pack_input.
template <typename T, bool TRAIN>
__global__ void __launch_bounds__(256)
    pack_input_nhwc(const T *__restrict__ x, bie_conv_geom g64, const float *__restrict__ bias,
                    const float *scale_a, const float *scale_w, float *saved_scales,
                    uint32_t *signs, uint32_t *mask) {
    pdl_trigger();  // the GEMM that reads these words may launch now
    if (saved_scales && blockIdx.x == 0 && threadIdx.x == 0) {
        saved_scales[0] = *scale_a;
        saved_scales[1] = *scale_w;
    }
    const int C = (int)g64.c, cw = (C + 31) / 32, lane = (int)threadIdx.x & 31;
    const int64_t cells = g64.n * g64.h * g64.w * cw;
    const float bound = TRAIN ? clip_bound(*scale_a) : 1.0f;
    for (int64_t cell = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; cell < cells;
         cell += ((int64_t)gridDim.x * blockDim.x) >> 5) {
        const int64_t pix = cell / cw;
        const int c = (int)(cell - pix * cw) * 32 + lane;
        bool s = false, m = false;
        if (c < C) {
            const float v = to_f32(x[pix * C + c]) + bias[c];
            s = v >= 0.0f;
            if (TRAIN) m = fabsf(v) <= bound;
        }
        const uint32_t sb = __ballot_sync(0xffffffffu, s), mb = __ballot_sync(0xffffffffu, m);
        if (lane == 0) {
            signs[cell] = sb;
            if (TRAIN) mask[cell] = mb;
        }
    }
}

// NHWC input whose channels are a multiple of 32 (x 16-byte aligned): lane = 8 consecutive
// elements (one or two 16-byte loads), so that four neighbouring lanes hold one sign word's
// channels and a warp loads 32 x 8 contiguous elements. Chunk q (of 8 elements) is channels
// 8 (q % (C / 8)) .. + 7 of its pixel, and four chunks 4 w .. 4 w + 3 are word w of the NHWC
// words. The same float arithmetic as pack_input. 32-bit chunk indices (the launcher checks).
template <typename T, bool TRAIN>
__global__ void __launch_bounds__(256)
    pack_input_nhwc8(const T *__restrict__ x, unsigned chunks, unsigned per_pixel,
                     const float *__restrict__ bias, const float *scale_a, const float *scale_w,
                     float *saved_scales, uint32_t *signs, uint32_t *mask) {
    pdl_trigger();  // the GEMM that reads these words may launch now
    if (saved_scales && blockIdx.x == 0 && threadIdx.x == 0) {
        saved_scales[0] = *scale_a;
        saved_scales[1] = *scale_w;
    }
    const int lane = (int)threadIdx.x & 31, sh = 8 * (lane & 3);
    const float bound = TRAIN ? clip_bound(*scale_a) : 1.0f;
    const unsigned warps = gridDim.x * (blockDim.x / 32);
    for (unsigned qb = (blockIdx.x * blockDim.x + threadIdx.x) / 32 * 32; qb < chunks;
         qb += warps * 32) {
        const unsigned q = qb + lane;
        uint32_t sb = 0, mb = 0;
        if (q < chunks) {
            const unsigned c0 = q % per_pixel * 8;
            float v[8];
            if constexpr (sizeof(T) == 2) {
                const uint4 raw = reinterpret_cast<const uint4 *>(x)[q];
                const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
                for (int j = 0; j < 8; j++) v[j] = run_elem<T>(w, j);
            } else {
                const float4 a = reinterpret_cast<const float4 *>(x)[2 * q],
                             b = reinterpret_cast<const float4 *>(x)[2 * q + 1];
                v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
                v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
            }
            const float4 b0 = *reinterpret_cast<const float4 *>(bias + c0),
                         b1 = *reinterpret_cast<const float4 *>(bias + c0 + 4);
            const float bb[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const float e = v[j] + bb[j];
                sb |= (uint32_t)(e >= 0.0f) << j;
                if (TRAIN) mb |= (uint32_t)(fabsf(e) <= bound) << j;
            }
        }
        sb <<= sh;
        mb <<= sh;
        sb |= __shfl_xor_sync(0xffffffffu, sb, 1);
        sb |= __shfl_xor_sync(0xffffffffu, sb, 2);
        if (TRAIN) {
            mb |= __shfl_xor_sync(0xffffffffu, mb, 1);
            mb |= __shfl_xor_sync(0xffffffffu, mb, 2);
        }
        if ((lane & 3) == 0 && q < chunks) {
            signs[q >> 2] = sb;
            if (TRAIN) mask[q >> 2] = mb;
        }
    }
}

// Pixels per lane: the widest aligned run of at most 8 bytes, narrowed while the grid would
// have too few warps (small inputs gain more from lanes than from wider loads).
template <typename T>
void pack_input_any(const void *xv, const bie_conv_geom *g, const float *bias, const float *scale_a,
                    const float *scale_w, float *saved_scales, uint32_t *signs, uint32_t *mask) {
    const T *x = static_cast<const T *>(xv);
    const int64_t hw = g->h * g->w, nhw = g->n * hw, cw = bie_cuda_conv_cw(g);
    const int64_t chunks = nhw * g->c / 8;
    if (g->nhwc && g->c % 32 == 0 && chunks < ((int64_t)1 << 31) && (uintptr_t)x % 16 == 0 &&
        (uintptr_t)bias % 16 == 0) {
        const unsigned blocks = blocks_for(chunks, 256);
        if (mask)
            pack_input_nhwc8<T, true><<<blocks, 256, 0, current_stream>>>(
                x, (unsigned)chunks, (unsigned)(g->c / 8), bias, scale_a, scale_w, saved_scales,
                signs, mask);
        else
            pack_input_nhwc8<T, false><<<blocks, 256, 0, current_stream>>>(
                x, (unsigned)chunks, (unsigned)(g->c / 8), bias, scale_a, scale_w, saved_scales,
                signs, mask);
        return;
    }
    if (g->nhwc) {
        const unsigned blocks = blocks_for(nhw * cw * 32, 256);
        if (mask)
            pack_input_nhwc<T, true><<<blocks, 256, 0, current_stream>>>(
                x, *g, bias, scale_a, scale_w, saved_scales, signs, mask);
        else
            pack_input_nhwc<T, false><<<blocks, 256, 0, current_stream>>>(
                x, *g, bias, scale_a, scale_w, saved_scales, signs, mask);
        return;
    }
    int vp = 1;
    while (vp * 2 * sizeof(T) <= 8 && hw % (vp * 2) == 0 &&
           (uintptr_t)x % (vp * 2 * sizeof(T)) == 0)
        vp *= 2;
    while (vp > 1 && (nhw + 32 * vp - 1) / (32 * vp) * cw < kPackMinWarps) vp /= 2;
    constexpr int kWide = 8 / sizeof(T);  // 2 (f32) or 4 (16-bit types)
    if (vp >= 4)
        launch_pack_input<T, kWide>(x, g, cw, bias, scale_a, scale_w, saved_scales, signs, mask);
    else if (vp == 2)
        launch_pack_input<T, 2>(x, g, cw, bias, scale_a, scale_w, saved_scales, signs, mask);
    else
        launch_pack_input<T, 1>(x, g, cw, bias, scale_a, scale_w, saved_scales, signs, mask);
}

// One warp per output pixel: its row of k k taps (cw words each, zero outside the input)
// and the row's popcount. 32-bit index math.
__global__ void __launch_bounds__(256)
    im2col_bits(const uint32_t *__restrict__ signs, bie_conv_geom g64, int words, uint32_t *cols,
                int *popc) {
    const int C = (int)g64.c, cw = (C + 31) / 32, k = (int)g64.k, s = (int)g64.s, p = (int)g64.p,
              d = (int)g64.d;
    const int h = (int)g64.h, w = (int)g64.w, oh = (int)g64.oh, ow = (int)g64.ow;
    const int plane = oh * ow, rows = (int)g64.n * plane, used = k * k * cw;
    const int lane = threadIdx.x & 31;
    const int r = (int)(((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    if (r >= rows) return;
    const int n = r / plane, pix = r - n * plane, oy = pix / ow, ox = pix - oy * ow;
    const uint32_t *img = signs + (int64_t)n * h * w * cw;
    int count = 0;
    for (int q = lane; q < words; q += 32) {
        uint32_t v = 0;
        if (q < used) {
            const int t = q / cw, wd = q - t * cw, i = t / k, j = t - i * k;
            const int iy = oy * s - p + i * d, ix = ox * s - p + j * d;
            if (iy >= 0 && iy < h && ix >= 0 && ix < w) v = img[(iy * w + ix) * cw + wd];
        }
        cols[(int64_t)r * words + q] = v;
        count += __popc(v);
    }
    for (int o = 16; o > 0; o >>= 1) count += __shfl_down_sync(0xffffffffu, count, o);
    if (lane == 0) popc[r] = count;
}

// ---- Implicit-GEMM binary convolution, persistent. A block keeps BN weight rows (output
// channels) in shared memory for the whole kernel and walks 32-pixel tiles t = blockIdx.x,
// blockIdx.x + gridDim.x, ...: each tile's receptive fields are gathered straight from the
// NHWC sign words with cp.async (zero-filled outside the input: no im2col pass) into one of
// two buffers while the tile before it is multiplied and stored, so a block keeps loads,
// mma and stores in flight at once. 2 x BN / 32 warps, each a 16-pixel x 32-channel tile of
// b1 AND-popc mma over k in 256-bit steps. The epilogue is the GEMM's (conv output with the
// padding-class correction), through a shared-memory tile so that NCHW stores are
// contiguous runs of pixels. Rows in shared memory are `ldr` bytes (the taps' cw words,
// padded with zeros to 32 bytes) plus 16, so ldmatrix rows fall in distinct banks.
constexpr int kConvBM = 32;

// Shared memory of a block: the weight rows, two pixel-tile buffers, the tile of dot
// products, the block's columns of the correction table and of the weight popcounts, the
// rows' popcounts, the padding-class tables, and per buffer each row's class and output
// offset.
// The tile of dot products is channel-major, kConvCS ints per channel: the fragments' writes
// (8 rows x 4 channel pairs per instruction) and the stores' reads (32 rows of a channel)
// are both free of bank conflicts.
constexpr int kConvCS = kConvBM + 4;
struct ConvSmem {
    size_t b, a, c, corr, pa, ycls, xcls, rcls, rbase, total;
    __host__ __device__ ConvSmem(int bn, int ldr, int classes, int oh, int ow) {
        const size_t stride = (size_t)ldr + 16;
        b = 0;
        a = b + (size_t)bn * stride;
        c = a + 2 * kConvBM * stride;
        rbase = c + (size_t)bn * kConvCS * sizeof(int);  // 8-byte aligned
        corr = rbase + 2 * kConvBM * sizeof(long long);
        pa = corr + (size_t)classes * bn * sizeof(int);
        rcls = pa + kConvBM * sizeof(int);
        ycls = rcls + 2 * kConvBM * sizeof(int);
        xcls = ycls + (size_t)oh * sizeof(int);
        total = xcls + (size_t)ow * sizeof(int);
    }
};

// UNIT: sign words per cp.async (4 when cw % 4 == 0, 2 when cw % 2 == 0, else 1). PAIRS: each
// thread stores two neighbouring pixels of a channel at once (even planes, output aligned to two
// elements).
template <int BN, int UNIT>
__global__ void __launch_bounds__(2 * BN, 1)
    bconv_implicit(const uint32_t *__restrict__ signs, bie_conv_geom g64,
                   const uint8_t *__restrict__ wbits, int64_t ld, const int *__restrict__ wpopc,
                   int ldr, int classes, int tiles, bool pairs, FastDiv by_plane, FastDiv by_ow,
                   FastDiv by_k, Epilogue ep) {
    constexpr int THREADS = 2 * BN, WARPS_N = BN / 32, NT = 4, TPR = THREADS / kConvBM;
    extern __shared__ __align__(16) uint8_t smem[];
    const int oh = (int)g64.oh, ow = (int)g64.ow;
    const ConvSmem lay(BN, ldr, classes, oh, ow);
    const int stride = ldr + 16;
    uint8_t *sB = smem + lay.b, *sA = smem + lay.a;
    int *sC = reinterpret_cast<int *>(smem + lay.c),
        *sCorr = reinterpret_cast<int *>(smem + lay.corr);
    int *sPa = reinterpret_cast<int *>(smem + lay.pa);
    int *sYcls = reinterpret_cast<int *>(smem + lay.ycls),
        *sXcls = reinterpret_cast<int *>(smem + lay.xcls);
    int *sRowCls = reinterpret_cast<int *>(smem + lay.rcls);
    long long *sRowBase = reinterpret_cast<long long *>(smem + lay.rbase);

    const int C = (int)g64.c, cw = (C + 31) / 32, k = (int)g64.k, kk = k * k, h = (int)g64.h,
              w = (int)g64.w;
    const int plane = oh * ow, rows = (int)g64.n * plane, O = (int)g64.o;
    const int used = kk * cw * 4;  // bytes of taps in a row
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp / WARPS_N,
              wn = warp % WARPS_N;
    const int n0 = blockIdx.y * BN;

    // Weights: BN rows of ldr bytes in 16-byte chunks (rows past O zero-filled), and the
    // columns' popcounts.
    {
        const int chunks = ldr / 16;
        for (int i = tid; i < BN * chunks; i += THREADS) {
            const int r = i / chunks, c = i - r * chunks;
            const bool ok = n0 + r < O;
            cp_async_n(smem_u32(sB + r * stride + c * 16),
                       wbits + (int64_t)(ok ? n0 + r : 0) * ld + c * 16, 16, ok);
        }
    }
    // Zero tails of the pixel rows of both buffers (the gathers never write them).
    for (int i = tid; i < 2 * kConvBM * ((ldr - used) / 4); i += THREADS) {
        const int per = (ldr - used) / 4, r = i / per, q = i - r * per;
        *reinterpret_cast<uint32_t *>(sA + r * stride + used + q * 4) = 0u;
    }
    // Gathers tile t into buffer buf: TPR threads per pixel row, each taking the row's taps
    // part, part + TPR, ... (cw words each, in pieces of UNIT words).
    const int dil = (int)g64.d, grow = tid / TPR, gpart = tid % TPR;
    auto gather = [&](int t, int buf) {
        const int row = t * kConvBM + grow;
        const unsigned dst = smem_u32(sA + (buf * kConvBM + grow) * stride);
        int n = 0, y0 = 0, x0 = 0;
        const bool row_ok = row < rows;
        if (row_ok) {
            n = by_plane.div(row);
            const int pix = row - n * plane, oy = by_ow.div(pix);
            y0 = oy * (int)g64.s - (int)g64.p;
            x0 = (pix - oy * ow) * (int)g64.s - (int)g64.p;
        }
        const uint32_t *img = signs + (int64_t)n * h * w * cw;
        for (int tap = gpart; tap < kk; tap += TPR) {
            const int ti = by_k.div(tap), iy = y0 + ti * dil, ix = x0 + (tap - ti * k) * dil;
            const bool ok = row_ok && iy >= 0 && iy < h && ix >= 0 && ix < w;
            const uint32_t *src = ok ? img + (iy * w + ix) * cw : signs;
            const unsigned d = dst + tap * cw * 4;
            for (int wd = 0; wd < cw; wd += UNIT)
                cp_async_n(d + wd * 4, src + (ok ? wd : 0), UNIT * 4, ok);
        }
    };
    // Tile t's rows' padding classes and output offsets, into buffer buf (a thread per row).
    auto row_info = [&](int t, int buf) {
        if (tid >= kConvBM) return;
        const int row = min(t * kConvBM + tid, rows - 1), n = by_plane.div(row),
                  pix = row - n * plane, oy = by_ow.div(pix);
        sRowCls[buf * kConvBM + tid] = sYcls[oy] + sXcls[pix - oy * ow];
        sRowBase[buf * kConvBM + tid] = (long long)n * O * plane + pix;
    };

    // Everything above reads only the weights, which the layer prepares before the input's
    // pack; the input's words and the corrections come from the kernels just before.
    pdl_wait();
    if ((int)blockIdx.x < tiles) gather(blockIdx.x, 0);
    cp_async_commit();
    // While the first tile's rows arrive: the class tables, and per class and column the
    // padding correction less twice the column's popcount (the AND form's column term).
    const int parts = (int)((ld + 1023) / 1024);
    for (int i = tid; i < classes * BN; i += THREADS) {
        const int cls = i / BN, col = n0 + i - cls * BN;
        int v = 0;
        if (col < O) {
            v = ep.conv.corr ? ep.conv.corr[(int64_t)cls * O + col] : 0;
            for (int part = 0; part < parts; part++) v -= 2 * wpopc[(int64_t)col * parts + part];
        }
        sCorr[i] = v;
    }
    const bool nhwc = ep.conv.nhwc != 0;
    // NHWC rows whose every four-channel group starts aligned for one vector store.
    const bool vec4 =
        O % 4 == 0 && reinterpret_cast<uintptr_t>(ep.out) % (ep.out_type == kOutF32 ? 16 : 8) == 0;
    constexpr int LDN = BN + 8;  // NHWC: the tile of dot products pixel-major, LDN ints a row
    static_assert(kConvBM * LDN <= BN * kConvCS, "the NHWC tile fits the channel-major one");
    // A pixel's class is (row class) * nx + (column class): class(oy, ox) = class(oy, 0) +
    // class(0, ox) - class(0, 0), from two small tables instead of a load per pixel.
    for (int i = tid; i < oh + ow; i += THREADS) {
        const int *pc = ep.conv.pix_class;
        if (i < oh)
            sYcls[i] = pc ? pc[i * ow] : 0;
        else
            sXcls[i - oh] = pc ? pc[i - oh] - pc[0] : 0;
    }
    __syncthreads();  // the class tables
    row_info(blockIdx.x, 0);

    const float scale = ep.scale();
    const int K = C * kk;  // < 2^24
    const int q = lane >> 3, r8 = lane & 7, g = lane >> 2, t4 = lane & 3;
    const int cols = O - n0 < BN ? O - n0 : BN;
    int buf = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x, buf ^= 1) {
        if (t + (int)gridDim.x < tiles) gather(t + gridDim.x, buf ^ 1);
        cp_async_commit();
        cp_async_wait<1>();  // this tile's rows (and the weights) have landed
        __syncthreads();
        const uint8_t *tA = sA + buf * kConvBM * stride;
        // Row popcounts: TPR threads per row.
        {
            const int r = tid / TPR, part = tid % TPR;
            int cnt = 0;
            for (int i = part; i < ldr / 4; i += TPR)
                cnt += __popc(*reinterpret_cast<const uint32_t *>(tA + r * stride + i * 4));
#pragma unroll
            for (int o = TPR / 2; o > 0; o >>= 1) cnt += __shfl_xor_sync(0xffffffffu, cnt, o);
            if (part == 0) sPa[r] = cnt;
        }
        int acc[NT][4];
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[j][e] = 0;
        const unsigned a_at = smem_u32(tA + (wm * 16 + r8 + 8 * (q & 1)) * stride + 16 * (q >> 1));
        const unsigned b_at = smem_u32(sB + (wn * 32 + r8 + 8 * (q >> 1)) * stride + 16 * (q & 1));
        for (int kc = 0; kc < ldr / 32; kc++) {
            unsigned af[4];
            ldmatrix_x4(af, a_at + kc * 32);
#pragma unroll
            for (int j = 0; j < NT; j += 2) {
                unsigned bf[4];
                ldmatrix_x4(bf, b_at + j * 8 * stride + kc * 32);
                mma_b1_and(acc[j], af, bf[0], bf[1]);
                mma_b1_and(acc[j + 1], af, bf[2], bf[3]);
            }
        }
        __syncthreads();  // sPa complete; the previous tile's stores have read sC
        // Final integer dot products: AND form plus the padding correction of the row's class.
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const int rl = wm * 16 + g + 8 * hh;
            const int rowterm = K - 2 * sPa[rl];
            const int *corr = sCorr + sRowCls[buf * kConvBM + rl] * BN;
#pragma unroll
            for (int j = 0; j < NT; j++) {
                const int cl = wn * 32 + j * 8 + 2 * t4;
                const int v0 = rowterm + 4 * acc[j][hh * 2] + corr[cl],
                          v1 = rowterm + 4 * acc[j][hh * 2 + 1] + corr[cl + 1];
                if (nhwc) {  // (8-byte stores: the two half-warps each cover the 32 banks)
                    *reinterpret_cast<int2 *>(sC + rl * LDN + cl) = make_int2(v0, v1);
                } else {
                    sC[cl * kConvCS + rl] = v0;
                    sC[(cl + 1) * kConvCS + rl] = v1;
                }
            }
        }
        // Output offsets of the rows this thread stores (read before the next gather may
        // overwrite them).
        const int pr = pairs ? 2 * (tid % (kConvBM / 2)) : tid % kConvBM;
        const long long base = sRowBase[buf * kConvBM + pr];
        __syncthreads();
        if (t + (int)gridDim.x < tiles)
            row_info(t + gridDim.x, buf ^ 1);  // read after the next barrier
        // Stores: a warp writes 32 (or 2 x 32) neighbouring pixels of one channel plane; NHWC:
        // four neighbouring channels a thread, BN / 4 threads a pixel.
        if (nhwc) {
            for (int i = tid; i < kConvBM * (BN / 4); i += THREADS) {
                const int rl = i / (BN / 4), cl = 4 * (i % (BN / 4));
                if (t * kConvBM + rl >= rows || cl >= cols) continue;
                const int4 d = *reinterpret_cast<const int4 *>(sC + rl * LDN + cl);
                store_out4(ep.out, (int64_t)(t * kConvBM + rl) * O + n0 + cl, (float)d.x * scale,
                           (float)d.y * scale, (float)d.z * scale, (float)d.w * scale,
                           min(4, cols - cl), vec4, ep.out_type);
            }
            continue;
        }
        const int row = t * kConvBM + pr;
        if (row < rows) {
            const int per = pairs ? kConvBM / 2 : kConvBM, cstep = THREADS / per, cl0 = tid / per;
            const int64_t step = (int64_t)cstep * plane, first = base + (int64_t)(n0 + cl0) * plane;
            store_tile_rows(ep, sC + pr, kConvCS, cl0, cstep, cols, first, step, pairs, scale);
        }
    }
    cp_async_wait<0>();
}

}  // namespace
}  // namespace bie_cuda

using namespace bie_cuda;

extern "C" {

bie_status bie_cuda_conv_pack_input(bie_dtype dtype, const void *x, const bie_conv_geom *g,
                                    const float *bias, const float *scale_a, const float *scale_w,
                                    float *saved_scales, uint32_t *signs, uint32_t *mask) {
    switch (dtype) {
    case BIE_F32:
        pack_input_any<float>(x, g, bias, scale_a, scale_w, saved_scales, signs, mask);
        break;
    case BIE_BF16:
        pack_input_any<__nv_bfloat16>(x, g, bias, scale_a, scale_w, saved_scales, signs, mask);
        break;
    case BIE_F16:
        pack_input_any<__half>(x, g, bias, scale_a, scale_w, saved_scales, signs, mask);
        break;
    default: return bie_fail(BIE_ERR_DTYPE, "cuda conv pack: dtype %s", bie_dtype_name(dtype));
    }
    return check(cudaGetLastError(), "cuda conv pack input");
}

bie_status bie_cuda_conv_im2col(const uint32_t *signs, const bie_conv_geom *g, int64_t ld,
                                uint8_t *cols, int *popc) {
    const int64_t rows = g->n * g->oh * g->ow;
    im2col_bits<<<(unsigned)((rows * 32 + 255) / 256), 256, 0, current_stream>>>(
        signs, *g, (int)(ld / 4), reinterpret_cast<uint32_t *>(cols), popc);
    return check(cudaGetLastError(), "cuda conv im2col");
}

int bie_cuda_conv_implicit_bn(const bie_conv_geom *g, int classes) {
    const int64_t cw = bie_cuda_conv_cw(g), ldr = (g->k * g->k * cw * 4 + 31) / 32 * 32;
    int dev = 0, max_smem = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) !=
            cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    if (ldr > 16384) return 0;
    // 64 channels per block when that covers the layer, else 128 (each channel tile gathers
    // the receptive fields again; two 128-channel blocks share an SM). Measured on the H100,
    // forward in us, channel tiles 64 / 128 / 256: N=64 256->256 14x14 24.7 / 23.3 / 24.4;
    // 128->128 28x28 32.7 / 31.1.
    const int widths[2] = {64, 128};
    int best = 0;
    for (int i = 0; i < 2; i++) {
        if (ConvSmem(widths[i], (int)ldr, classes, (int)g->oh, (int)g->ow).total > (size_t)max_smem)
            break;
        best = widths[i];
        if (g->o <= widths[i]) break;
    }
    return best;
}

bie_status bie_cuda_conv_implicit(const uint32_t *signs, const bie_conv_geom *g,
                                  const uint8_t *wbits, int64_t ld, const int *wpopc, int bn,
                                  int classes, const float *scale_a, const float *scale_w,
                                  bie_dtype out_dtype, void *out, const bie_cuda_conv_out *conv) {
    const int64_t cw = bie_cuda_conv_cw(g), ldr = (g->k * g->k * cw * 4 + 31) / 32 * 32;
    const int which = out_type_of(out_dtype);
    if (which < 0)
        return bie_fail(BIE_ERR_DTYPE, "cuda conv: output dtype %s", bie_dtype_name(out_dtype));
    if (bn != 64 && bn != 128)
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "cuda conv: tile width %d", bn);
    const Epilogue ep = make_epilogue(which, out, g->o, 0.0f, scale_a, scale_w, conv);
    const size_t smem = ConvSmem(bn, (int)ldr, classes, (int)g->oh, (int)g->ow).total;
    const bool wide = cw % 4 == 0;
    auto fn = bn == 128 ? (wide          ? bconv_implicit<128, 4>
                           : cw % 2 == 0 ? bconv_implicit<128, 2>
                                         : bconv_implicit<128, 1>)
                        : (wide          ? bconv_implicit<64, 4>
                           : cw % 2 == 0 ? bconv_implicit<64, 2>
                                         : bconv_implicit<64, 1>);
    const bool pairs = conv_pairs_ok(g->oh * g->ow, out, which);
    // Held to the launch: the shared memory depends on the geometry.
    std::lock_guard<std::mutex> smem_lock(smem_attribute_mutex());
    BIE_CUDA_TRY(check(cudaFuncSetAttribute(reinterpret_cast<const void *>(fn),
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
                       "cudaFuncSetAttribute"));
    int dev = 0, sms = 1, per_sm = 1;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, 2 * bn, smem) != cudaSuccess) {
        cudaGetLastError();
        sms = per_sm = 1;
    }
    // Enough blocks to fill the GPU once, then as few as leave every block the same number
    // of pixel tiles (the largest count decides the time).
    const int64_t rows = g->n * g->oh * g->ow, tiles = (rows + kConvBM - 1) / kConvBM,
                  groups = (g->o + bn - 1) / bn;
    int64_t blocks = (int64_t)sms * (per_sm < 1 ? 1 : per_sm) / groups;
    blocks = blocks < 1 ? 1 : blocks > tiles ? tiles : blocks;
    const int64_t per_block = (tiles + blocks - 1) / blocks;
    blocks = (tiles + per_block - 1) / per_block;
    const dim3 grid((unsigned)blocks, (unsigned)groups);
    BIE_CUDA_TRY(
        check(launch_after(fn, grid, dim3(2 * bn), smem, signs, *g, wbits, ld, wpopc, (int)ldr,
                           classes, (int)tiles, pairs, FastDiv((int)(g->oh * g->ow)),
                           FastDiv((int)g->ow), FastDiv((int)g->k), ep),
              "cuda conv implicit gemm"));
    return check(cudaGetLastError(), "cuda conv implicit gemm");
}

}  // extern "C"
