// The binary conv2d's weight rows on the device (layout in cuda_internal.h): sign bits in tap
// order, their popcounts per 8192-bit part, the per-tap sums and the zero-padding corrections
// of every padding class, from the int8 or float weight or the user's packed bits. One kernel
// does all of it: a training forward runs it on every call (the optimizer may have changed the
// weight), and the weight is small, so separate passes would each cost a launch's latency.
#include <cuda_runtime.h>

#include "cuda_common.cuh"
#include "cuda_internal.h"

namespace bie_cuda {
namespace {

// Sign of element idx of weight row `row` ([c, i, j] order) from the source format.
template <typename S>
__device__ __forceinline__ bool weight_sign(const S *src, int64_t rb, int64_t row, int64_t idx);
template <>
__device__ __forceinline__ bool weight_sign<int8_t>(const int8_t *w, int64_t rb, int64_t row,
                                                    int64_t idx) {
    return w[row * rb + idx] >= 0;
}
template <>
__device__ __forceinline__ bool weight_sign<float>(const float *w, int64_t rb, int64_t row,
                                                   int64_t idx) {
    return w[row * rb + idx] >= 0.0f;
}
template <>
__device__ __forceinline__ bool weight_sign<uint8_t>(const uint8_t *q, int64_t rb, int64_t row,
                                                     int64_t idx) {
    return (q[row * rb + (idx >> 3)] >> (idx & 7)) & 1;
}

// The sum of the tap sums ts [k k] over the taps outside class cls's valid ranges.
__device__ int class_correction(const int *ts, int k, int cls, const int *ylim, const int *xlim,
                                int nx) {
    const int cy = cls / nx, cx = cls - cy * nx;
    int sum = 0;
    for (int i = 0; i < k; i++)
        for (int j = 0; j < k; j++) {
            const bool inside = i >= ylim[2 * cy] && i < ylim[2 * cy + 1] && j >= xlim[2 * cx] &&
                                j < xlim[2 * cx + 1];
            if (!inside) sum += ts[i * k + j];
        }
    return sum;
}

constexpr int kRowWords = 8;         // words of a tap a warp ballots in one step
constexpr int kRowThreads = 256;     // a block's threads (8 warps)
constexpr int kSmemMax = 48 * 1024;  // a block's shared memory (the default limit)

// The offset of the staged row in a block's shared memory, after the tap sums and part counts.
__host__ __device__ inline int stage_offset(int kk, int parts) {
    return ((kk + parts) * (int)sizeof(int) + 15) & ~15;
}

// Block per weight row o; warp w takes taps w, w + 8, ... A tap's word of 32 channels is one
// ballot (lane = channel). Where STAGED, the row's bytes come first into shared memory with
// coalesced loads all in flight at once (the taps' channels are kk elements apart: read from
// global memory, each word would be a strided load). Then the row's padding words, its
// popcount per part, and where `corr` its correction of each of the ny nx classes
// (corr [class][o]). Shared memory: the tap sums [k k], the part counts [parts], the row.
template <typename S, bool STAGED>
__global__ void __launch_bounds__(kRowThreads)
    conv_weight_rows(const S *__restrict__ src, int64_t rb, bie_conv_geom g64, int words, int parts,
                     uint32_t *__restrict__ bits, int *__restrict__ popc, int *__restrict__ tapsum,
                     const int *__restrict__ ylim, int ny, const int *__restrict__ xlim, int nx,
                     int *__restrict__ corr) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int C = (int)g64.c, O = (int)g64.o, k = (int)g64.k, kk = k * k, cw = (C + 31) / 32;
    const int o = (int)blockIdx.x, lane = (int)threadIdx.x & 31, warp = (int)threadIdx.x >> 5;
    int *ts = reinterpret_cast<int *>(smem), *pc = ts + kk;
    for (int i = (int)threadIdx.x; i < parts; i += kRowThreads) pc[i] = 0;
    const S *wsrc = src;
    int64_t wrow = o;
    if (STAGED) {
        const int64_t bytes = rb * (int64_t)sizeof(S);
        const unsigned char *from = reinterpret_cast<const unsigned char *>(src + (int64_t)o * rb);
        unsigned char *to = smem + stage_offset(kk, parts);
        if ((reinterpret_cast<uintptr_t>(from) | (uintptr_t)bytes) % 4 == 0) {
            const int n4 = (int)(bytes / 4);
            for (int i0 = (int)threadIdx.x; i0 < n4; i0 += 4 * kRowThreads) {
                unsigned v[4];
#pragma unroll
                for (int u = 0; u < 4; u++)
                    if (i0 + u * kRowThreads < n4)
                        v[u] = reinterpret_cast<const unsigned *>(from)[i0 + u * kRowThreads];
#pragma unroll
                for (int u = 0; u < 4; u++)
                    if (i0 + u * kRowThreads < n4)
                        reinterpret_cast<unsigned *>(to)[i0 + u * kRowThreads] = v[u];
            }
        } else {
            for (int i = (int)threadIdx.x; i < (int)bytes; i += kRowThreads) to[i] = from[i];
        }
        wsrc = reinterpret_cast<const S *>(to);
        wrow = 0;
    }
    __syncthreads();
    uint32_t *row = bits + (int64_t)o * words;
    for (int t = warp; t < kk; t += kRowThreads / 32) {
        int ones = 0;
        for (int w0 = 0; w0 < cw; w0 += kRowWords) {
            bool s[kRowWords];
#pragma unroll
            for (int u = 0; u < kRowWords; u++) {
                const int c = (w0 + u) * 32 + lane;
                s[u] = c < C && weight_sign(wsrc, rb, wrow, (int64_t)c * kk + t);
            }
            uint32_t mine = 0;
#pragma unroll
            for (int u = 0; u < kRowWords; u++) {
                const uint32_t v = __ballot_sync(0xffffffffu, s[u]);
                if (lane == u) mine = v;
                ones += __popc(v);
            }
            if (lane < kRowWords && w0 + lane < cw) {
                const int q = t * cw + w0 + lane;
                row[q] = mine;
                if (mine) atomicAdd(&pc[q >> 8], __popc(mine));
            }
        }
        if (lane == 0) {
            ts[t] = 2 * ones - C;
            tapsum[(int64_t)o * kk + t] = 2 * ones - C;
        }
    }
    for (int q = kk * cw + (int)threadIdx.x; q < words; q += kRowThreads) row[q] = 0;
    __syncthreads();
    for (int i = (int)threadIdx.x; i < parts; i += kRowThreads)
        popc[(int64_t)o * parts + i] = pc[i];
    if (corr)
        for (int cls = (int)threadIdx.x; cls < ny * nx; cls += kRowThreads)
            corr[(int64_t)cls * O + o] = class_correction(ts, k, cls, ylim, xlim, nx);
}

// corr [class][o] from the tap sums alone (a new geometry for weight rows kept from before).
__global__ void corrections(const int *tapsum, bie_conv_geom g, const int *ylim, const int *xlim,
                            int ny, int nx, int *corr) {
    const int k = (int)g.k, kk = k * k;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < (int64_t)ny * nx * g.o;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t cls = idx / g.o, o = idx % g.o;
        corr[idx] = class_correction(tapsum + o * kk, k, (int)cls, ylim, xlim, nx);
    }
}

template <typename S>
void launch_rows(const S *src, int64_t rb, const bie_conv_geom *g, int64_t ld, uint8_t *bits,
                 int *popc, int *tapsum, const bie_cuda_conv_classes *cls, int *corr) {
    const int parts = bie_cuda_popc_parts(ld), kk = (int)(g->k * g->k);
    const int64_t staged = stage_offset(kk, parts) + rb * (int64_t)sizeof(S);
    const bool stage = staged <= kSmemMax;
    const size_t smem = stage ? (size_t)staged : (size_t)(kk + parts) * sizeof(int);
    (stage ? conv_weight_rows<S, true>
           : conv_weight_rows<S, false>)<<<(unsigned)g->o, kRowThreads, smem, current_stream>>>(
        src, rb, *g, (int)(ld / 4), parts, reinterpret_cast<uint32_t *>(bits), popc, tapsum,
        corr ? cls->ylim : nullptr, corr ? cls->ny : 0, corr ? cls->xlim : nullptr,
        corr ? cls->nx : 0, corr);
}

}  // namespace
}  // namespace bie_cuda

using namespace bie_cuda;

extern "C" {

bie_status bie_cuda_conv_pack_weight(bie_dtype dtype, const void *src, int64_t src_row_bytes,
                                     const bie_conv_geom *g, int64_t ld, uint8_t *bits, int *popc,
                                     int *tapsum, const bie_cuda_conv_classes *cls, int *corr) {
    if ((g->k * g->k + bie_cuda_popc_parts(ld)) * (int64_t)sizeof(int) > kSmemMax)
        return bie_fail(BIE_ERR_UNSUPPORTED, "cuda conv pack: kernel size %lld too large",
                        (long long)g->k);
    if (corr && cls == NULL) corr = NULL;
    const int64_t K = g->c * g->k * g->k;
    switch (dtype) {
    case BIE_I8:
        launch_rows(static_cast<const int8_t *>(src), K, g, ld, bits, popc, tapsum, cls, corr);
        break;
    case BIE_F32:
        launch_rows(static_cast<const float *>(src), K, g, ld, bits, popc, tapsum, cls, corr);
        break;
    case BIE_U8:
        launch_rows(static_cast<const uint8_t *>(src), src_row_bytes, g, ld, bits, popc, tapsum,
                    cls, corr);
        break;
    default:
        return bie_fail(BIE_ERR_DTYPE, "cuda conv pack: weight dtype %s", bie_dtype_name(dtype));
    }
    return check(cudaGetLastError(), "cuda conv pack weight");
}

bie_status bie_cuda_conv_corrections(const int *tapsum, const bie_conv_geom *g,
                                     const bie_cuda_conv_classes *cls, int *corr) {
    const int64_t count = (int64_t)cls->ny * cls->nx * g->o;
    const int64_t blocks = (count + 255) / 256;
    corrections<<<(unsigned)(blocks < 1       ? 1
                             : blocks > 65535 ? 65535
                                              : blocks),
                  256, 0, current_stream>>>(tapsum, *g, cls->ylim, cls->xlim, cls->ny, cls->nx,
                                            corr);
    return check(cudaGetLastError(), "cuda conv corrections");
}

}  // extern "C"
