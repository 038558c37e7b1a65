// Binary conv2d forward pieces on the device (layouts in cuda_internal.h): the input's sign
// and clip bits per pixel (NHWC), the weight rows in tap order with their per-tap sums, the
// bit im2col the GEMM multiplies, and the zero-padding corrections per pixel class.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda_common.cuh"
#include "cuda_internal.h"
#include "dtype.cuh"
#include "epilogue.cuh"
#include "mma.cuh"

namespace bie_cuda {
namespace {

unsigned blocks_for(int64_t count, int threads) {
    int64_t b = (count + threads - 1) / threads;
    return (unsigned)(b < 1 ? 1 : b > 1048576 ? 1048576 : b);
}

// Raw bits of VP consecutive elements of type T (2 or 4 bytes) as 32-bit words, read with one
// aligned load of sizeof(T) * VP bytes (2, 4 or 8).
template <int BYTES> struct RawRun;
template <> struct RawRun<2> {
    uint32_t w[1];
    __device__ __forceinline__ void load(const void *p) { w[0] = *static_cast<const unsigned short *>(p); }
};
template <> struct RawRun<4> {
    uint32_t w[1];
    __device__ __forceinline__ void load(const void *p) { w[0] = *static_cast<const uint32_t *>(p); }
};
template <> struct RawRun<8> {
    uint32_t w[2];
    __device__ __forceinline__ void load(const void *p) {
        const uint2 v = *static_cast<const uint2 *>(p);
        w[0] = v.x;
        w[1] = v.y;
    }
};

// Element j of a run as float (little endian: element 0 in the low bits).
template <typename T> __device__ __forceinline__ float run_elem(const uint32_t *w, int j);
template <> __device__ __forceinline__ float run_elem<float>(const uint32_t *w, int j) {
    return to_f32(__uint_as_float(w[j]));
}
template <> __device__ __forceinline__ float run_elem<__nv_bfloat16>(const uint32_t *w, int j) {
    return to_f32(__ushort_as_bfloat16((unsigned short)(w[j >> 1] >> (16 * (j & 1)))));
}
template <> __device__ __forceinline__ float run_elem<__half>(const uint32_t *w, int j) {
    return to_f32(__ushort_as_half((unsigned short)(w[j >> 1] >> (16 * (j & 1)))));
}

constexpr int kPackWords = 8;       // sign words per block: a 32 B run of every output row
constexpr int kPackMinWarps = 1024; // enough warps to fill a large GPU before loads get wider
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
    pack_input(const T *__restrict__ x, bie_cuda_conv_shape g64, int wc, int pg, const float *__restrict__ bias,
               const float *scale_a, const float *scale_w, float *saved_scales, uint32_t *signs, uint32_t *mask) {
    extern __shared__ uint32_t pack_tile[];
    const int hw = (int)(g64.h * g64.w), C = (int)g64.c, cw = (C + 31) / 32;
    const int nhw = (int)(g64.n * g64.h * g64.w);
    const int rows = pg * 32 * VP, ld = wc | 1;  // odd row stride: the lanes' words spread over the banks
    const int first = (int)blockIdx.x * rows, left = nhw - first;
    const int w0 = (int)blockIdx.y * wc, words = min(wc, cw - w0);
    const int warp = (int)threadIdx.x >> 5, lane = (int)threadIdx.x & 31;
    uint32_t *tsign = pack_tile, *tmask = pack_tile + rows * ld;
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
        const float sa = TRAIN ? *scale_a : 1.0f;
#pragma unroll
        for (int c = 0; c < 32; c++) {
            const float b = __shfl_sync(0xffffffffu, lane_bias, c);
#pragma unroll
            for (int j = 0; j < VP; j++) {
                const float v = run_elem<T>(run[c].w, j) + b;
                sb[j] |= (uint32_t)(v >= 0.0f) << c;
                if (TRAIN) {  // the divisions only in training
                    const float q = v / sa;
                    mb[j] |= (uint32_t)(q >= -1.0f && q <= 1.0f) << c;
                }
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
void launch_pack_input(const T *x, const bie_cuda_conv_shape *g, int64_t cw, const float *bias,
                       const float *scale_a, const float *scale_w, float *saved_scales, uint32_t *signs,
                       uint32_t *mask) {
    const int64_t nhw = g->n * g->h * g->w;
    const int wc = (int)(cw < kPackWords ? (cw < 1 ? 1 : cw) : kPackWords), pg = kPackWords / wc;
    const int64_t rows = (int64_t)pg * 32 * VP, tiles = (nhw + rows - 1) / rows;
    const dim3 grid((unsigned)(tiles < 1 ? 1 : tiles), (unsigned)((cw + wc - 1) / wc < 1 ? 1 : (cw + wc - 1) / wc));
    const size_t smem = (size_t)rows * (wc | 1) * sizeof(uint32_t) * (mask ? 2 : 1);
    if (mask)
        pack_input<T, VP, true><<<grid, 32 * pg * wc, smem, current_stream>>>(x, *g, wc, pg, bias, scale_a,
                                                                               scale_w, saved_scales, signs, mask);
    else
        pack_input<T, VP, false><<<grid, 32 * pg * wc, smem, current_stream>>>(x, *g, wc, pg, bias, scale_a,
                                                                                scale_w, saved_scales, signs, mask);
}

// Pixels per lane: the widest aligned run of at most 8 bytes, narrowed while the grid would
// have too few warps (small inputs gain more from lanes than from wider loads).
template <typename T>
void pack_input_any(const void *xv, const bie_cuda_conv_shape *g, const float *bias, const float *scale_a,
                    const float *scale_w, float *saved_scales, uint32_t *signs, uint32_t *mask) {
    const T *x = static_cast<const T *>(xv);
    const int64_t hw = g->h * g->w, nhw = g->n * hw, cw = bie_cuda_conv_cw(g);
    int vp = 1;
    while (vp * 2 * sizeof(T) <= 8 && hw % (vp * 2) == 0 && (uintptr_t)x % (vp * 2 * sizeof(T)) == 0) vp *= 2;
    while (vp > 1 && (nhw + 32 * vp - 1) / (32 * vp) * cw < kPackMinWarps) vp /= 2;
    constexpr int kWide = 8 / sizeof(T);  // 2 (f32) or 4 (16-bit types)
    if (vp >= 4) launch_pack_input<T, kWide>(x, g, cw, bias, scale_a, scale_w, saved_scales, signs, mask);
    else if (vp == 2) launch_pack_input<T, 2>(x, g, cw, bias, scale_a, scale_w, saved_scales, signs, mask);
    else launch_pack_input<T, 1>(x, g, cw, bias, scale_a, scale_w, saved_scales, signs, mask);
}

// Sign of element idx of weight row `row` ([c, i, j] order) from the source format.
template <typename S> __device__ __forceinline__ bool weight_sign(const S *src, int64_t rb, int64_t row, int64_t idx);
template <> __device__ __forceinline__ bool weight_sign<int8_t>(const int8_t *w, int64_t rb, int64_t row, int64_t idx) {
    return w[row * rb + idx] >= 0;
}
template <> __device__ __forceinline__ bool weight_sign<float>(const float *w, int64_t rb, int64_t row, int64_t idx) {
    return w[row * rb + idx] >= 0.0f;
}
template <> __device__ __forceinline__ bool weight_sign<uint8_t>(const uint8_t *q, int64_t rb, int64_t row, int64_t idx) {
    return (q[row * rb + (idx >> 3)] >> (idx & 7)) & 1;
}

// Block (row, part): the 256 words of popcount part `part` of weight row `row`.
template <typename S>
__global__ void __launch_bounds__(256)
    pack_weight(const S *__restrict__ src, int64_t rb, bie_cuda_conv_shape g, int64_t cw, int64_t ld,
                uint32_t *bits, int *popc) {
    const int64_t row = blockIdx.x, words = ld / 4, kk = g.k * g.k;
    const int64_t q = (int64_t)blockIdx.y * 256 + threadIdx.x;
    uint32_t v = 0;
    if (q < kk * cw && q < words) {
        const int64_t t = q / cw, c0 = (q % cw) * 32, cn = g.c - c0 < 32 ? g.c - c0 : 32;
        for (int64_t c = 0; c < cn; c++) v |= (uint32_t)weight_sign(src, rb, row, (c0 + c) * kk + t) << c;
    }
    if (q < words) bits[row * words + q] = v;
    int count = __popc(v);
    for (int o = 16; o > 0; o >>= 1) count += __shfl_down_sync(0xffffffffu, count, o);
    __shared__ int partial[8];
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = count;
    __syncthreads();
    if (threadIdx.x == 0) {
        int total = 0;
        for (int i = 0; i < 8; i++) total += partial[i];
        popc[row * gridDim.y + blockIdx.y] = total;
    }
}

// tapsum[o][t] = 2 * (ones among the tap's C bits) - C.
__global__ void tap_sums(const uint32_t *bits, bie_cuda_conv_shape g, int64_t cw, int64_t ld, int *tapsum) {
    const int64_t kk = g.k * g.k, words = ld / 4;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < g.o * kk;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t o = idx / kk, t = idx % kk;
        int ones = 0;
        for (int64_t w = 0; w < cw; w++) ones += __popc(bits[o * words + t * cw + w]);
        tapsum[idx] = 2 * ones - (int)g.c;
    }
}

// One warp per output pixel: its row of k k taps (cw words each, zero outside the input)
// and the row's popcount. 32-bit index math.
__global__ void __launch_bounds__(256)
    im2col_bits(const uint32_t *__restrict__ signs, bie_cuda_conv_shape g64, int words, uint32_t *cols, int *popc) {
    const int C = (int)g64.c, cw = (C + 31) / 32, k = (int)g64.k, s = (int)g64.s, p = (int)g64.p, d = (int)g64.d;
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

__global__ void corrections(const int *tapsum, bie_cuda_conv_shape g, const int *ylim, const int *xlim,
                            int ny, int nx, int *corr) {
    const int64_t kk = g.k * g.k;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < (int64_t)ny * nx * g.o;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t cls = idx / g.o, o = idx % g.o;
        const int cy = (int)(cls / nx), cx = (int)(cls % nx);
        int sum = 0;
        for (int64_t i = 0; i < g.k; i++)
            for (int64_t j = 0; j < g.k; j++) {
                const bool inside = i >= ylim[2 * cy] && i < ylim[2 * cy + 1] && j >= xlim[2 * cx] && j < xlim[2 * cx + 1];
                if (!inside) sum += tapsum[o * kk + i * g.k + j];
            }
        corr[idx] = sum;
    }
}


// ---- Implicit-GEMM binary convolution. One block computes a 64-pixel x BN-channel tile over
// the whole of k at once: the BN weight rows and the 64 pixels' receptive fields (gathered
// straight from the NHWC sign words with cp.async, zero-filled outside the input: no im2col
// pass) are staged in shared memory, each row's popcount is taken there, and 8 warps (2 x 4)
// run the b1 AND-popc mma over k in 256-bit steps. The epilogue is the GEMM's (conv output
// with the padding-class correction). Rows in shared memory are `ldr` bytes (the taps' cw
// words, padded with zeros to 32 bytes) plus 16, so ldmatrix rows fall in distinct banks.
constexpr int kConvBM = 64;

// cp.async of 4, 8 or 16 bytes (pred false: zero-fill).
__device__ __forceinline__ void cp_async_n(unsigned dst, const void *src, int bytes, bool pred) {
    const int n = pred ? bytes : 0;
    if (bytes == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
    else if (bytes == 8)
        asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(n));
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}

template <int BN>
__global__ void __launch_bounds__(256, BN == 256 ? 2 : BN == 128 ? 3 : 4)
    bconv_implicit(const uint32_t *__restrict__ signs, bie_cuda_conv_shape g64, const uint8_t *__restrict__ wbits,
                   int64_t ld, const int *__restrict__ wpopc, int ldr, int unit, int classes, Epilogue ep) {
    constexpr int WN = BN / 4, NT = WN / 8, MT = 2;  // warps 2 (rows) x 4 (channels), 32 x WN each
    extern __shared__ __align__(16) uint8_t smem[];
    const int stride = ldr + 16;
    uint8_t *sA = smem, *sB = smem + kConvBM * stride;
    size_t operands = (size_t)(kConvBM + BN) * stride, tile = (size_t)kConvBM * (BN + 1) * sizeof(int);
    operands = (operands > tile ? operands : tile);
    int *sPa = reinterpret_cast<int *>(smem + (operands + 15) / 16 * 16);
    int *sCorr = sPa + kConvBM;  // [classes][BN]: the block's columns of the correction table

    const int C = (int)g64.c, cw = (C + 31) / 32, k = (int)g64.k, kk = k * k, h = (int)g64.h, w = (int)g64.w;
    const int ow = (int)g64.ow, plane = (int)(g64.oh * g64.ow), rows = (int)g64.n * plane, O = (int)g64.o;
    const int used = kk * cw * 4;  // bytes of taps in a row
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp >> 2, wn = warp & 3;
    const int m0 = blockIdx.x * kConvBM, n0 = blockIdx.y * BN;

    // Weights: BN rows of ldr bytes in 16-byte chunks, 256 / BN threads per row (rows past O
    // zero-filled). No division: every thread keeps one row.
    {
        constexpr int TPR = 256 / BN;
        const int r = tid / TPR, part = tid % TPR;
        const bool ok = n0 + r < O;
        const uint8_t *src = wbits + (int64_t)(ok ? n0 + r : 0) * ld;
        for (int c = part; c < ldr / 16; c += TPR)
            cp_async_n(smem_u32(sB + r * stride + c * 16), src + c * 16, 16, ok);
    }
    // Receptive fields: 4 threads per pixel row, taps part, part + 4, ...; each tap is cw
    // words copied in pieces of `unit` words (zero-filled outside the input).
    {
        const int r = tid >> 2, part = tid & 3, row = m0 + r, bytes = unit * 4;
        int n = 0, y0 = 0, x0 = 0;
        const bool row_ok = row < rows;
        if (row_ok) {
            n = row / plane;
            const int pix = row - n * plane, oy = pix / ow;
            y0 = oy * (int)g64.s - (int)g64.p;
            x0 = (pix - oy * ow) * (int)g64.s - (int)g64.p;
        }
        const uint32_t *img = signs + (int64_t)n * h * w * cw;
        const int d = (int)g64.d;
        for (int t = part; t < kk; t += 4) {
            const int i = t / k, iy = y0 + i * d, ix = x0 + (t - i * k) * d;
            const bool ok = row_ok && iy >= 0 && iy < h && ix >= 0 && ix < w;
            const uint32_t *src = ok ? img + (iy * w + ix) * cw : signs;
            const unsigned dst = smem_u32(sA + r * stride + t * cw * 4);
            for (int wd = 0; wd < cw; wd += unit) cp_async_n(dst + wd * 4, src + (ok ? wd : 0), bytes, ok);
        }
    }
    // Zero tail of the activation rows (the weights' tail is zero in memory).
    for (int idx = tid; idx < kConvBM * ((ldr - used) / 4); idx += 256) {
        const int per = (ldr - used) / 4, r = idx / per, q = idx - r * per;
        *reinterpret_cast<uint32_t *>(sA + r * stride + used + q * 4) = 0u;
    }
    cp_async_commit();
    // The correction table's columns of this block, in shared memory: the epilogue then has
    // no global loads between its stores (which the compiler would have to order).
    for (int idx = tid; idx < classes * BN; idx += 256) {
        const int cls = idx / BN, col = n0 + idx - cls * BN;
        sCorr[idx] = ep.conv.corr && col < O ? ep.conv.corr[(int64_t)cls * O + col] : 0;
    }
    cp_async_wait<0>();
    __syncthreads();

    // Row popcounts: 4 threads per row.
    {
        const int r = tid >> 2, part = tid & 3;
        int cnt = 0;
        for (int q = part; q < ldr / 4; q += 4) cnt += __popc(*reinterpret_cast<const uint32_t *>(sA + r * stride + q * 4));
        cnt += __shfl_xor_sync(0xffffffffu, cnt, 1);
        cnt += __shfl_xor_sync(0xffffffffu, cnt, 2);
        if (part == 0) sPa[r] = cnt;
    }

    int acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0;
    const int q = lane >> 3, r8 = lane & 7;
    for (int kc = 0; kc < ldr / 32; kc++) {
        unsigned af[MT][4];
#pragma unroll
        for (int i = 0; i < MT; i++) {
            const int row = wm * 32 + i * 16 + r8 + 8 * (q & 1);
            ldmatrix_x4(af[i], smem_u32(sA + row * stride + kc * 32 + 16 * (q >> 1)));
        }
#pragma unroll
        for (int j = 0; j < NT; j += 2) {
            const int row = wn * WN + j * 8 + r8 + 8 * (q >> 1);
            unsigned t4[4];
            ldmatrix_x4(t4, smem_u32(sB + row * stride + kc * 32 + 16 * (q & 1)));
#pragma unroll
            for (int i = 0; i < MT; i++) {
                mma_b1_and(acc[i][j], af[i], t4[0], t4[1]);
                mma_b1_and(acc[i][j + 1], af[i], t4[2], t4[3]);
            }
        }
    }

    // Epilogue. First every thread turns its fragment sums into the final integer dot
    // products (AND form plus the padding correction of the pixel's class) in a shared-memory
    // tile (reusing the operand space); then each thread owns one pixel row of the tile and
    // walks channels 4 apart, so the NCHW stores of neighbouring threads are contiguous and
    // the per-element work is a load, a multiply and a store.
    int *sRowCls = sCorr + classes * BN;  // [64]
    if (tid < kConvBM) {
        const int row = m0 + tid, pix = row % plane;
        sRowCls[tid] = row < rows && ep.conv.corr ? ep.conv.pix_class[pix] : 0;
    }
    const int g = lane >> 2, t4 = lane & 3, parts = (int)((ld + 1023) / 1024);
    int pcol[NT][2];
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int col = n0 + wn * WN + j * 8 + 2 * t4 + e;
            int sum = 0;
            if (col < O)
                for (int part = 0; part < parts; part++) sum += wpopc[(int64_t)col * parts + part];
            pcol[j][e] = sum;
        }
    __syncthreads();  // operands no longer needed; sPa and sRowCls complete
    constexpr int CS = BN + 1;  // odd row stride: conflict-free row reads below
    int *sC = reinterpret_cast<int *>(smem);
    const int K = C * kk;  // < 2^24
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const int rl = wm * 32 + i * 16 + g + 8 * hh;
            const int rowterm = K - 2 * sPa[rl];
            const int *corr = sCorr + sRowCls[rl] * BN;
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int cl = wn * WN + j * 8 + 2 * t4 + e;
                    sC[rl * CS + cl] = rowterm - 2 * pcol[j][e] + 4 * acc[i][j][hh * 2 + e] + corr[cl];
                }
        }
    __syncthreads();
    const float scale = ep.scale();
    const int r = tid & (kConvBM - 1), row = m0 + r;
    if (row >= rows) return;
    const int n = row / plane, pix = row - n * plane;
    const int cl0 = tid / kConvBM, cols = O - n0 < BN ? O - n0 : BN;
    const int64_t step = (int64_t)(256 / kConvBM) * plane;
    const int64_t first = ((int64_t)n * O + n0 + cl0) * plane + pix;
    const int *src = sC + r * CS;
    if (ep.out_type == kOutF32) {
        float *o = static_cast<float *>(ep.out) + first;
        for (int cl = cl0; cl < cols; cl += 256 / kConvBM, o += step) *o = (float)src[cl] * scale;
    } else if (ep.out_type == kOutBF16) {
        __nv_bfloat16 *o = static_cast<__nv_bfloat16 *>(ep.out) + first;
        for (int cl = cl0; cl < cols; cl += 256 / kConvBM, o += step) *o = __float2bfloat16((float)src[cl] * scale);
    } else {
        __half *o = static_cast<__half *>(ep.out) + first;
        for (int cl = cl0; cl < cols; cl += 256 / kConvBM, o += step) *o = __float2half((float)src[cl] * scale);
    }
}

// Operand rows (reused for the 64 x (BN + 1) tile of dot products), then the rows'
// popcounts, the corrections and the rows' classes.
size_t implicit_smem(int bn, int ldr, int classes) {
    size_t operands = (size_t)(kConvBM + bn) * (ldr + 16), tile = (size_t)kConvBM * (bn + 1) * sizeof(int);
    operands = (operands > tile ? operands : tile);
    operands = (operands + 15) / 16 * 16;
    return operands + (size_t)(kConvBM + classes * bn + kConvBM) * sizeof(int);
}

}  // namespace
}  // namespace bie_cuda

using namespace bie_cuda;

extern "C" {

bie_status bie_cuda_conv_pack_input(bie_dtype dtype, const void *x, const bie_cuda_conv_shape *g,
                                    const float *bias, const float *scale_a, const float *scale_w,
                                    float *saved_scales, uint32_t *signs, uint32_t *mask) {
    switch (dtype) {
    case BIE_F32: pack_input_any<float>(x, g, bias, scale_a, scale_w, saved_scales, signs, mask); break;
    case BIE_BF16: pack_input_any<__nv_bfloat16>(x, g, bias, scale_a, scale_w, saved_scales, signs, mask); break;
    case BIE_F16: pack_input_any<__half>(x, g, bias, scale_a, scale_w, saved_scales, signs, mask); break;
    default: return bie_fail(BIE_ERR_DTYPE, "cuda conv pack: dtype %s", bie_dtype_name(dtype));
    }
    return check(cudaGetLastError(), "cuda conv pack input");
}

bie_status bie_cuda_conv_pack_weight(bie_dtype dtype, const void *src, int64_t src_row_bytes,
                                     const bie_cuda_conv_shape *g, int64_t ld, uint8_t *bits,
                                     int *popc, int *tapsum) {
    const int64_t cw = bie_cuda_conv_cw(g), K = g->c * g->k * g->k;
    const dim3 grid((unsigned)g->o, (unsigned)bie_cuda_popc_parts(ld));
    cudaStream_t st = current_stream;
    uint32_t *b = reinterpret_cast<uint32_t *>(bits);
    switch (dtype) {
    case BIE_I8: pack_weight<<<grid, 256, 0, st>>>(static_cast<const int8_t *>(src), K, *g, cw, ld, b, popc); break;
    case BIE_F32: pack_weight<<<grid, 256, 0, st>>>(static_cast<const float *>(src), K, *g, cw, ld, b, popc); break;
    case BIE_U8:
        pack_weight<<<grid, 256, 0, st>>>(static_cast<const uint8_t *>(src), src_row_bytes, *g, cw, ld, b, popc);
        break;
    default: return bie_fail(BIE_ERR_DTYPE, "cuda conv pack: weight dtype %s", bie_dtype_name(dtype));
    }
    tap_sums<<<blocks_for(g->o * g->k * g->k, 256), 256, 0, st>>>(b, *g, cw, ld, tapsum);
    return check(cudaGetLastError(), "cuda conv pack weight");
}

bie_status bie_cuda_conv_im2col(const uint32_t *signs, const bie_cuda_conv_shape *g, int64_t ld,
                                uint8_t *cols, int *popc) {
    const int64_t rows = g->n * g->oh * g->ow;
    im2col_bits<<<(unsigned)((rows * 32 + 255) / 256), 256, 0, current_stream>>>(
        signs, *g, (int)(ld / 4), reinterpret_cast<uint32_t *>(cols), popc);
    return check(cudaGetLastError(), "cuda conv im2col");
}

bie_status bie_cuda_conv_corrections(const int *tapsum, const bie_cuda_conv_shape *g,
                                     const int *ylim, int ny, const int *xlim, int nx, int *corr) {
    corrections<<<blocks_for((int64_t)ny * nx * g->o, 256), 256, 0, current_stream>>>(tapsum, *g, ylim, xlim,
                                                                                     ny, nx, corr);
    return check(cudaGetLastError(), "cuda conv corrections");
}


int bie_cuda_conv_implicit_bn(const bie_cuda_conv_shape *g, int classes) {
    const int64_t cw = bie_cuda_conv_cw(g), ldr = (g->k * g->k * cw * 4 + 31) / 32 * 32;
    int dev = 0, max_smem = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    if (ldr > 16384) return 0;
    // The widest channel tile that fits and still gives every SM two blocks (wider tiles
    // gather each pixel's receptive field fewer times, but a block's latency is only hidden
    // by others on its SM), no wider than the layer needs; else the narrowest that fits.
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
        cudaGetLastError();
        sms = 1;
    }
    const int64_t tiles = (g->n * g->oh * g->ow + kConvBM - 1) / kConvBM;
    const int widths[3] = {256, 128, 64};
    int best = 0;
    for (int i = 0; i < 3; i++) {
        if (i < 2 && g->o <= widths[i + 1]) continue;
        if (implicit_smem(widths[i], (int)ldr, classes) > (size_t)max_smem) continue;
        best = widths[i];
        if (tiles * ((g->o + best - 1) / best) >= 2 * sms) return best;
    }
    return best;
}

bie_status bie_cuda_conv_implicit(const uint32_t *signs, const bie_cuda_conv_shape *g, const uint8_t *wbits,
                                  int64_t ld, const int *wpopc, int bn, int classes, const float *scale_a,
                                  const float *scale_w, bie_dtype out_dtype, void *out,
                                  const bie_cuda_conv_out *conv) {
    const int64_t cw = bie_cuda_conv_cw(g), ldr = (g->k * g->k * cw * 4 + 31) / 32 * 32;
    const int unit = cw % 4 == 0 ? 4 : cw % 2 == 0 ? 2 : 1;
    const int which = out_type_of(out_dtype);
    if (which < 0) return bie_fail(BIE_ERR_DTYPE, "cuda conv: output dtype %s", bie_dtype_name(out_dtype));
    const Epilogue ep = make_epilogue(which, out, g->o, 0.0f, scale_a, scale_w, conv);
    const size_t smem = implicit_smem(bn, (int)ldr, classes);
    const int64_t rows = g->n * g->oh * g->ow;
    const dim3 grid((unsigned)((rows + kConvBM - 1) / kConvBM), (unsigned)((g->o + bn - 1) / bn));
    auto fn = bn == 256 ? bconv_implicit<256> : bn == 128 ? bconv_implicit<128> : bconv_implicit<64>;
    BIE_CUDA_TRY(check(cudaFuncSetAttribute(reinterpret_cast<const void *>(fn),
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
                       "cudaFuncSetAttribute"));
    BIE_CUDA_TRY(check(cudaFuncSetAttribute(reinterpret_cast<const void *>(fn),
                                            cudaFuncAttributePreferredSharedMemoryCarveout, 100),
                       "cudaFuncSetAttribute"));
    fn<<<grid, 256, smem, current_stream>>>(signs, *g, wbits, ld, wpopc, (int)ldr, unit, classes, ep);
    return check(cudaGetLastError(), "cuda conv implicit gemm");
}

}  // extern "C"
