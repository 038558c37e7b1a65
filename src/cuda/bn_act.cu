// Batch norm, residual add and PReLU fused on CUDA (bie.h §7; the arguments are checked by
// layers/bn_act.c):  out = prelu(a y + b + res), a = gamma rstd, b = beta - mean a.
//
// Forward (training): one reduction pass over y (per-channel sums of y - shift and its square,
// shift = the channel's first element, against cancellation), a finalize (one warp a channel,
// double sums in a fixed order), one elementwise pass (reads y and res, writes out).
// Backward: one reduction pass (sums of dz, dz xhat and the PReLU slope term, z recomputed
// from y and res exactly as the forward computed it), a finalize, one elementwise pass (reads
// grad_out, y, res; writes grad_y and grad_res). Deterministic: every sum has a fixed shape
// and order, no atomics.
//
// Two layouts of [outer][C][inner]: rows (inner = 1, channels-last and [N][C]): a thread owns V
// adjacent channels of a row (one 16-byte vector) and walks the rows, so its channel constants
// sit in registers; planes (inner > 1, NCHW): blocks per channel for the reductions, a flat
// pass for the elementwise ones. V = 16 bytes of elements where every row / plane is whole
// vectors and the pointers are aligned, else 1.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <initializer_list>

#include "cuda_common.cuh"
#include "cuda_internal.h"
#include "dtype.cuh"
#include "train_common.cuh"

namespace bie_cuda {
namespace {

template <typename T, int V> struct alignas(sizeof(T) * V) Pack { T e[V]; };

// out = prelu(fma(y, a, b) + r) (act: with a slope; without, out = z).
__device__ __forceinline__ float act_out(float y, float r, float a, float b, float s, bool act) {
    const float z = fmaf(y, a, b) + r;
    return z > 0.0f || !act ? z : s * z;
}

// Per-channel constants of the backward's elementwise pass.
struct BwdCoef {
    float a, b, s, k1, c2, mean, c3, pad;
    // grad_res (= dz) and grad_y of one element.
    __device__ void grads(float y, float r, float g, bool act, float &dz, float &gy) const {
        const float z = fmaf(y, a, b) + r;
        dz = z > 0.0f || !act ? g : s * g;
        gy = fmaf(k1, dz, fmaf(c2, y - mean, c3));
    }
};

// The three backward sums' terms of one element: dz, dz xhat and, where z <= 0, z g.
struct BwdTerm {
    float a, b, s, mean, rstd;
    bool act;
    __device__ void add(float y, float r, float g, float &s0, float &s1, float &s2) const {
        const float z = fmaf(y, a, b) + r;
        const float dz = z > 0.0f || !act ? g : s * g;
        s0 += dz;
        s1 = fmaf(dz, (y - mean) * rstd, s1);
        if (!(z > 0.0f)) s2 = fmaf(z, g, s2);
    }
};

struct Params {
    const float *gamma, *beta, *slope;
    bool slope_shared;
    int64_t c;
    __device__ float slope_at(int64_t ch) const {
        return slope == nullptr ? 1.0f : slope[slope_shared ? 0 : ch];
    }
    // The channel's map z = fma(y, a, b) + r, the same in the forward and the backward.
    __device__ void map(int64_t ch, float mean, float rstd, float &a, float &b) const {
        a = (gamma ? gamma[ch] : 1.0f) * rstd;
        b = fmaf(-mean, a, beta ? beta[ch] : 0.0f);
    }
    // The backward sums' constants of channel ch.
    __device__ BwdTerm term(int64_t ch, const float *mean, const float *rstd) const {
        BwdTerm t;
        t.mean = mean[ch], t.rstd = rstd[ch], t.s = slope_at(ch), t.act = slope != nullptr;
        map(ch, t.mean, t.rstd, t.a, t.b);
        return t;
    }
};

// ---------------------------------------------------------------- rows (inner = 1)
// Block (x, y): vectors [y 256, y 256 + ntr) of every rpi-th row from x rpi, rpi = 256 / ntr.
struct RowMap {
    int j, rl, ntr, rpi;
    bool live;
    __device__ RowMap(int64_t nv) {
        const int j0 = (int)blockIdx.y * kThreads;
        ntr = (int)(nv - j0 < kThreads ? nv - j0 : kThreads);
        rpi = kThreads / ntr;
        j = j0 + (int)threadIdx.x % ntr;
        rl = (int)threadIdx.x / ntr;
        live = rl < rpi;
    }
};

// Adds acc over the block's row lanes in a fixed order into part[blockIdx.x][channel].
template <int N, int V>
__device__ void rows_reduce(const RowMap &m, const float (&acc)[N][V], int64_t c, float4 *part) {
    __shared__ float red[N][V][kThreads];
#pragma unroll
    for (int n = 0; n < N; n++)
#pragma unroll
        for (int k = 0; k < V; k++) red[n][k][threadIdx.x] = m.live ? acc[n][k] : 0.0f;
    __syncthreads();
    if (m.rl != 0) return;
#pragma unroll
    for (int k = 0; k < V; k++) {
        float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int l = 0; l < m.rpi; l++)
#pragma unroll
            for (int n = 0; n < N; n++) t[n] += red[n][k][l * m.ntr + threadIdx.x];
        part[(int64_t)blockIdx.x * c + (int64_t)m.j * V + k] = make_float4(t[0], t[1], t[2], t[3]);
    }
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    rows_stats(const T *__restrict__ y, int64_t rows, int64_t c, float4 *part) {
    const RowMap m(c / V);
    float acc[2][V] = {}, sh[V];
    const Pack<T, V> p0 = reinterpret_cast<const Pack<T, V> *>(y)[m.j];
#pragma unroll
    for (int k = 0; k < V; k++) sh[k] = to_f32(p0.e[k]);
#pragma unroll 4
    for (int64_t r = m.live ? (int64_t)blockIdx.x * m.rpi + m.rl : rows; r < rows;
         r += (int64_t)gridDim.x * m.rpi) {
        const Pack<T, V> p = reinterpret_cast<const Pack<T, V> *>(y + r * c)[m.j];
#pragma unroll
        for (int k = 0; k < V; k++) {
            const float d = to_f32(p.e[k]) - sh[k];
            acc[0][k] += d;
            acc[1][k] = fmaf(d, d, acc[1][k]);
        }
    }
    rows_reduce<2, V>(m, acc, c, part);
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    rows_apply(const T *__restrict__ y, const T *__restrict__ res, T *out, int64_t rows, int64_t c,
               const float2 *__restrict__ coef, Params pr) {
    const RowMap m(c / V);
    if (!m.live) return;
    float a[V], b[V], s[V];
#pragma unroll
    for (int k = 0; k < V; k++) {
        const int64_t ch = (int64_t)m.j * V + k;
        a[k] = coef[ch].x, b[k] = coef[ch].y, s[k] = pr.slope_at(ch);
    }
#pragma unroll 4
    for (int64_t r = (int64_t)blockIdx.x * m.rpi + m.rl; r < rows;
         r += (int64_t)gridDim.x * m.rpi) {
        const int64_t at = r * c / V + m.j;
        const Pack<T, V> py = reinterpret_cast<const Pack<T, V> *>(y)[at];
        Pack<T, V> pr_{}, po;
        if (res) pr_ = reinterpret_cast<const Pack<T, V> *>(res)[at];
#pragma unroll
        for (int k = 0; k < V; k++)
            po.e[k] = from_f32<T>(act_out(to_f32(py.e[k]), res ? to_f32(pr_.e[k]) : 0.0f, a[k],
                                          b[k], s[k], pr.slope != nullptr));
        reinterpret_cast<Pack<T, V> *>(out)[at] = po;
    }
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    rows_bwd_sums(const T *__restrict__ g, const T *__restrict__ y, const T *__restrict__ res,
                  int64_t rows, int64_t c, const float *__restrict__ mean,
                  const float *__restrict__ rstd, Params pr, float4 *part) {
    const RowMap m(c / V);
    BwdTerm t[V];
#pragma unroll
    for (int k = 0; k < V; k++) t[k] = pr.term((int64_t)m.j * V + k, mean, rstd);
    float acc[3][V] = {};
#pragma unroll 4
    for (int64_t r = m.live ? (int64_t)blockIdx.x * m.rpi + m.rl : rows; r < rows;
         r += (int64_t)gridDim.x * m.rpi) {
        const int64_t at = r * c / V + m.j;
        const Pack<T, V> pg = reinterpret_cast<const Pack<T, V> *>(g)[at];
        const Pack<T, V> py = reinterpret_cast<const Pack<T, V> *>(y)[at];
        Pack<T, V> pq{};
        if (res) pq = reinterpret_cast<const Pack<T, V> *>(res)[at];
#pragma unroll
        for (int k = 0; k < V; k++)
            t[k].add(to_f32(py.e[k]), res ? to_f32(pq.e[k]) : 0.0f, to_f32(pg.e[k]), acc[0][k],
                     acc[1][k], acc[2][k]);
    }
    rows_reduce<3, V>(m, acc, c, part);
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    rows_bwd_apply(const T *__restrict__ g, const T *__restrict__ y, const T *__restrict__ res,
                   T *grad_y, T *grad_res, int64_t rows, int64_t c, const BwdCoef *__restrict__ cf,
                   bool act) {
    const RowMap m(c / V);
    if (!m.live) return;
    BwdCoef k_[V];
#pragma unroll
    for (int k = 0; k < V; k++) k_[k] = cf[(int64_t)m.j * V + k];
#pragma unroll 4
    for (int64_t r = (int64_t)blockIdx.x * m.rpi + m.rl; r < rows;
         r += (int64_t)gridDim.x * m.rpi) {
        const int64_t at = r * c / V + m.j;
        const Pack<T, V> pg = reinterpret_cast<const Pack<T, V> *>(g)[at];
        const Pack<T, V> py = reinterpret_cast<const Pack<T, V> *>(y)[at];
        Pack<T, V> pq{}, oy, orr;
        if (res) pq = reinterpret_cast<const Pack<T, V> *>(res)[at];
#pragma unroll
        for (int k = 0; k < V; k++) {
            float dz, gy;
            k_[k].grads(to_f32(py.e[k]), res ? to_f32(pq.e[k]) : 0.0f, to_f32(pg.e[k]), act, dz,
                        gy);
            orr.e[k] = from_f32<T>(dz), oy.e[k] = from_f32<T>(gy);
        }
        if (grad_res) reinterpret_cast<Pack<T, V> *>(grad_res)[at] = orr;
        reinterpret_cast<Pack<T, V> *>(grad_y)[at] = oy;
    }
}

// ---------------------------------------------------------------- planes (inner > 1)
// Block (split, channel): every splits-th vector of the channel's outer x inner / V vectors.

// The block's sums in a fixed tree into part[split][ch].
template <int N>
__device__ void block_reduce(float (&acc)[N], int64_t c, int64_t ch, float4 *part) {
    __shared__ float red[N][kThreads];
#pragma unroll
    for (int n = 0; n < N; n++) red[n][threadIdx.x] = acc[n];
    __syncthreads();
    for (int w = kThreads / 2; w > 0; w /= 2) {
        if ((int)threadIdx.x < w)
#pragma unroll
            for (int n = 0; n < N; n++) red[n][threadIdx.x] += red[n][threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0)
        part[(int64_t)blockIdx.x * c + ch] =
            make_float4(red[0][0], N > 1 ? red[N > 1 ? 1 : 0][0] : 0.0f,
                        N > 2 ? red[N > 2 ? 2 : 0][0] : 0.0f, 0.0f);
    __syncthreads();
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    planes_stats(const T *__restrict__ y, int64_t outer, int64_t c, int64_t inner, float4 *part) {
    const int64_t ipv = inner / V, nvec = outer * ipv;
    for (int64_t ch = blockIdx.y; ch < c; ch += gridDim.y) {
        const float sh = to_f32(y[ch * inner]);
        float acc[2] = {0.0f, 0.0f};
#pragma unroll 4
        for (int64_t v = (int64_t)blockIdx.x * kThreads + threadIdx.x; v < nvec;
             v += (int64_t)gridDim.x * kThreads) {
            const int64_t o = v / ipv;
            const Pack<T, V> p =
                reinterpret_cast<const Pack<T, V> *>(y + (o * c + ch) * inner)[v - o * ipv];
#pragma unroll
            for (int k = 0; k < V; k++) {
                const float d = to_f32(p.e[k]) - sh;
                acc[0] += d;
                acc[1] = fmaf(d, d, acc[1]);
            }
        }
        block_reduce<2>(acc, c, ch, part);
    }
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    planes_bwd_sums(const T *__restrict__ g, const T *__restrict__ y, const T *__restrict__ res,
                    int64_t outer, int64_t c, int64_t inner, const float *__restrict__ mean,
                    const float *__restrict__ rstd, Params pr, float4 *part) {
    const int64_t ipv = inner / V, nvec = outer * ipv;
    for (int64_t ch = blockIdx.y; ch < c; ch += gridDim.y) {
        const BwdTerm t = pr.term(ch, mean, rstd);
        float acc[3] = {0.0f, 0.0f, 0.0f};
#pragma unroll 4
        for (int64_t v = (int64_t)blockIdx.x * kThreads + threadIdx.x; v < nvec;
             v += (int64_t)gridDim.x * kThreads) {
            const int64_t o = v / ipv, at = (o * c + ch) * ipv + v - o * ipv;
            const Pack<T, V> pg = reinterpret_cast<const Pack<T, V> *>(g)[at];
            const Pack<T, V> py = reinterpret_cast<const Pack<T, V> *>(y)[at];
            Pack<T, V> pq{};
            if (res) pq = reinterpret_cast<const Pack<T, V> *>(res)[at];
#pragma unroll
            for (int k = 0; k < V; k++)
                t.add(to_f32(py.e[k]), res ? to_f32(pq.e[k]) : 0.0f, to_f32(pg.e[k]), acc[0],
                      acc[1], acc[2]);
        }
        block_reduce<3>(acc, c, ch, part);
    }
}

// Elementwise over every vector: channel (v V / inner) % c.
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    planes_apply(const T *__restrict__ y, const T *__restrict__ res, T *out, int64_t nvec,
                 int64_t c, int64_t ipv, const float2 *__restrict__ coef, Params pr) {
#pragma unroll 4
    for (int64_t v = thread_index(); v < nvec; v += thread_stride()) {
        const int64_t ch = v / ipv % c;
        const float a = coef[ch].x, b = coef[ch].y, s = pr.slope_at(ch);
        const Pack<T, V> py = reinterpret_cast<const Pack<T, V> *>(y)[v];
        Pack<T, V> pq{}, po;
        if (res) pq = reinterpret_cast<const Pack<T, V> *>(res)[v];
#pragma unroll
        for (int k = 0; k < V; k++)
            po.e[k] = from_f32<T>(act_out(to_f32(py.e[k]), res ? to_f32(pq.e[k]) : 0.0f, a, b, s,
                                          pr.slope != nullptr));
        reinterpret_cast<Pack<T, V> *>(out)[v] = po;
    }
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    planes_bwd_apply(const T *__restrict__ g, const T *__restrict__ y, const T *__restrict__ res,
                     T *grad_y, T *grad_res, int64_t nvec, int64_t c, int64_t ipv,
                     const BwdCoef *__restrict__ cf, bool act) {
#pragma unroll 4
    for (int64_t v = thread_index(); v < nvec; v += thread_stride()) {
        const BwdCoef q = cf[v / ipv % c];
        const Pack<T, V> pg = reinterpret_cast<const Pack<T, V> *>(g)[v];
        const Pack<T, V> py = reinterpret_cast<const Pack<T, V> *>(y)[v];
        Pack<T, V> pq{}, oy, orr;
        if (res) pq = reinterpret_cast<const Pack<T, V> *>(res)[v];
#pragma unroll
        for (int k = 0; k < V; k++) {
            float dz, gy;
            q.grads(to_f32(py.e[k]), res ? to_f32(pq.e[k]) : 0.0f, to_f32(pg.e[k]), act, dz, gy);
            orr.e[k] = from_f32<T>(dz), oy.e[k] = from_f32<T>(gy);
        }
        if (grad_res) reinterpret_cast<Pack<T, V> *>(grad_res)[v] = orr;
        reinterpret_cast<Pack<T, V> *>(grad_y)[v] = oy;
    }
}

// ---------------------------------------------------------------- finalizes
struct Sums3 {
    double x, y, z;
};

// One warp a channel: lane l adds splits l, l + 32, ... in double, then a fixed shuffle tree.
__device__ Sums3 warp_sums(const float4 *part, int splits, int64_t c, int64_t ch) {
    double s0 = 0.0, s1 = 0.0, s2 = 0.0;
    for (int i = (int)threadIdx.x % 32; i < splits; i += 32) {
        const float4 p = part[(int64_t)i * c + ch];
        s0 += p.x, s1 += p.y, s2 += p.z;
    }
    for (int o = 16; o > 0; o /= 2) {
        s0 += __shfl_xor_sync(0xffffffffu, s0, o);
        s1 += __shfl_xor_sync(0xffffffffu, s1, o);
        s2 += __shfl_xor_sync(0xffffffffu, s2, o);
    }
    return Sums3{s0, s1, s2};
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    fwd_finalize(const float4 *part, int splits, const T *y, int64_t c, int64_t inner,
                 int64_t count, Params pr, float *running_mean, float *running_var, float eps,
                 float momentum, float *save_mean, float *save_rstd, float2 *coef) {
    const int64_t ch = ((int64_t)blockIdx.x * kThreads + threadIdx.x) / 32;
    if (ch >= c) return;
    const Sums3 s = warp_sums(part, splits, c, ch);
    if (threadIdx.x % 32 != 0) return;
    const double n = (double)count, d = s.x / n;
    const double m = (double)to_f32(y[ch * inner]) + d, var = fmax(s.y / n - d * d, 0.0);
    const float mean = (float)m, rstd = (float)(1.0 / sqrt(var + (double)eps));
    if (running_mean) {
        const double mo = momentum;
        running_mean[ch] = (float)((1.0 - mo) * running_mean[ch] + mo * m);
        running_var[ch] = (float)((1.0 - mo) * running_var[ch] + mo * (var * n / (n - 1.0)));
    }
    save_mean[ch] = mean, save_rstd[ch] = rstd;
    float a, b;
    pr.map(ch, mean, rstd, a, b);
    coef[ch] = make_float2(a, b);
}

__global__ void eval_finalize(int64_t c, Params pr, const float *running_mean,
                              const float *running_var, float eps, float *save_mean,
                              float *save_rstd, float2 *coef) {
    for (int64_t ch = thread_index(); ch < c; ch += thread_stride()) {
        const float mean = running_mean[ch];
        const float rstd = (float)(1.0 / sqrt((double)running_var[ch] + (double)eps));
        save_mean[ch] = mean, save_rstd[ch] = rstd;
        float a, b;
        pr.map(ch, mean, rstd, a, b);
        coef[ch] = make_float2(a, b);
    }
}

__global__ void __launch_bounds__(kThreads)
    bwd_finalize(const float4 *part, int splits, int64_t c, int64_t count, bool training, Params pr,
                 const float *save_mean, const float *save_rstd, float *grad_gamma,
                 float *grad_beta, float *grad_slope, double *slope_sums, BwdCoef *cf) {
    const int64_t ch = ((int64_t)blockIdx.x * kThreads + threadIdx.x) / 32;
    if (ch >= c) return;
    const Sums3 s = warp_sums(part, splits, c, ch);
    if (threadIdx.x % 32 != 0) return;
    if (grad_gamma) grad_gamma[ch] = (float)s.y;
    if (grad_beta) grad_beta[ch] = (float)s.x;
    if (grad_slope && !pr.slope_shared) grad_slope[ch] = (float)s.z;
    slope_sums[ch] = s.z;
    BwdCoef q;
    q.mean = save_mean[ch];
    const float rstd = save_rstd[ch];
    pr.map(ch, q.mean, rstd, q.a, q.b);
    q.s = pr.slope_at(ch);
    const double k1 = (double)(pr.gamma ? pr.gamma[ch] : 1.0f) * rstd, n = (double)count;
    q.k1 = (float)k1;
    q.c2 = training ? (float)(-k1 * rstd * s.y / n) : 0.0f;
    q.c3 = training ? (float)(-k1 * s.x / n) : 0.0f;
    q.pad = 0.0f;
    cf[ch] = q;
}

// A shared slope's gradient: every channel's sum, in a fixed order.
__global__ void slope_total(const double *slope_sums, int64_t c, float *grad_slope) {
    double t = 0.0;
    for (int64_t ch = threadIdx.x; ch < c; ch += 32) t += slope_sums[ch];
    for (int o = 16; o > 0; o /= 2) t += __shfl_xor_sync(0xffffffffu, t, o);
    if (threadIdx.x == 0) grad_slope[0] = (float)t;
}

// ---------------------------------------------------------------- launches

template <typename T> constexpr int kVec = 16 / (int)sizeof(T);

bool aligned(const void *p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The blocks along the rows (per_sm blocks an SM in all), fewer where a thread would get
// fewer than min_rows rows: each thread loads its channels' coefficients once, and a
// reduction block writes a partial row of C (with many channels and few rows those loads and
// partials would outweigh the data).
int64_t row_blocks(int64_t rows, int64_t nv, int64_t gy, int per_sm, int min_rows) {
    const int64_t rpi = kThreads / std::min<int64_t>(nv, kThreads);
    const int64_t want = std::max<int64_t>(1, per_sm * device_sms() / gy);
    const int64_t enough = (rows + rpi * min_rows - 1) / (rpi * min_rows);
    return std::max<int64_t>(1, std::min<int64_t>({enough, want, 65535}));
}

struct Geom {
    int64_t outer, c, inner, count;
    bool rows;  // inner = 1
};

// The reductions' grids: rows: (splits, gy) blocks over nv vectors a row; planes: (splits,
// gy_planes) blocks, a channel per block row.
struct Grid {
    int64_t nv, gy, gy_planes, splits;
    Grid(const Geom &g, int v) {
        nv = g.rows ? g.c / v : 0;
        gy = g.rows ? (nv + kThreads - 1) / kThreads : 0;
        gy_planes = std::min<int64_t>(g.c, 65535);
        splits = g.rows
                     ? row_blocks(g.outer, nv, gy, 4, 8)
                     : std::max<int64_t>(
                           1, std::min<int64_t>({(g.count / v + kThreads * 4 - 1) / (kThreads * 4),
                                                 4 * device_sms() / gy_planes + 1, 1024}));
    }
};

template <typename T, int V>
bie_status forward_t(const bie_cuda_bn_act &a, const Geom &g, const T *y, const T *res,
                     float *save_mean, float *save_rstd, T *out) {
    static const char *who = "bie_bn_act_forward (cuda)";
    const Params pr{a.gamma, a.beta, a.slope, a.slope_shared, a.c};
    const Grid gr(g, V);
    const int64_t nv = gr.nv, gy = gr.gy, gy_planes = gr.gy_planes, splits = gr.splits;
    Scratch scratch;
    const size_t part_bytes = a.training ? (size_t)splits * g.c * sizeof(float4) : 0;
    BIE_CUDA_TRY(scratch.get(part_bytes + (size_t)g.c * sizeof(float2), who));
    float4 *part = static_cast<float4 *>(scratch.p);
    float2 *coef = reinterpret_cast<float2 *>(static_cast<char *>(scratch.p) + part_bytes);
    if (a.training) {
        if (g.rows)
            rows_stats<T, V><<<dim3((unsigned)splits, (unsigned)gy), kThreads, 0, current_stream>>>(
                y, g.outer, g.c, part);
        else
            planes_stats<T, V>
                <<<dim3((unsigned)splits, (unsigned)gy_planes), kThreads, 0, current_stream>>>(
                    y, g.outer, g.c, g.inner, part);
        BIE_CUDA_TRY(launched(who));
        fwd_finalize<T>
            <<<(unsigned)((g.c * 32 + kThreads - 1) / kThreads), kThreads, 0, current_stream>>>(
                part, (int)splits, y, g.c, g.inner, g.count, pr, a.running_mean, a.running_var,
                a.eps, a.momentum, save_mean, save_rstd, coef);
    } else {
        eval_finalize<<<grid_1d(g.c), kThreads, 0, current_stream>>>(
            g.c, pr, a.running_mean, a.running_var, a.eps, save_mean, save_rstd, coef);
    }
    BIE_CUDA_TRY(launched(who));
    if (g.count == 0) return BIE_OK;
    if (g.rows)
        rows_apply<T, V><<<dim3((unsigned)row_blocks(g.outer, nv, gy, 8, 8), (unsigned)gy),
                           kThreads, 0, current_stream>>>(y, res, out, g.outer, g.c, coef, pr);
    else
        planes_apply<T, V><<<grid_1d(g.count * g.c / V), kThreads, 0, current_stream>>>(
            y, res, out, g.count * g.c / V, g.c, g.inner / V, coef, pr);
    return launched(who);
}

template <typename T, int V>
bie_status backward_t(const bie_cuda_bn_act &a, const Geom &g, const T *gout, const T *y,
                      const T *res, const float *save_mean, const float *save_rstd, T *grad_y,
                      T *grad_res, float *grad_gamma, float *grad_beta, float *grad_slope) {
    static const char *who = "bie_bn_act_backward (cuda)";
    const Params pr{a.gamma, a.beta, a.slope, a.slope_shared, a.c};
    const Grid gr(g, V);
    const int64_t nv = gr.nv, gy = gr.gy, gy_planes = gr.gy_planes, splits = gr.splits;
    Scratch scratch;
    const size_t part_bytes = (size_t)splits * g.c * sizeof(float4);
    const size_t cf_bytes = (size_t)g.c * sizeof(BwdCoef);
    BIE_CUDA_TRY(scratch.get(part_bytes + cf_bytes + (size_t)g.c * sizeof(double), who));
    char *base = static_cast<char *>(scratch.p);
    float4 *part = reinterpret_cast<float4 *>(base);
    BwdCoef *cf = reinterpret_cast<BwdCoef *>(base + part_bytes);
    double *slope_sums = reinterpret_cast<double *>(base + part_bytes + cf_bytes);
    if (g.count > 0) {
        if (g.rows)
            rows_bwd_sums<T, V>
                <<<dim3((unsigned)splits, (unsigned)gy), kThreads, 0, current_stream>>>(
                    gout, y, res, g.outer, g.c, save_mean, save_rstd, pr, part);
        else
            planes_bwd_sums<T, V>
                <<<dim3((unsigned)splits, (unsigned)gy_planes), kThreads, 0, current_stream>>>(
                    gout, y, res, g.outer, g.c, g.inner, save_mean, save_rstd, pr, part);
        BIE_CUDA_TRY(launched(who));
    } else {
        BIE_CUDA_TRY(check(cudaMemsetAsync(part, 0, part_bytes, current_stream), who));
    }
    bwd_finalize<<<(unsigned)((g.c * 32 + kThreads - 1) / kThreads), kThreads, 0, current_stream>>>(
        part, (int)splits, g.c, g.count, a.training, pr, save_mean, save_rstd, grad_gamma,
        grad_beta, grad_slope, slope_sums, cf);
    BIE_CUDA_TRY(launched(who));
    if (grad_slope && a.slope_shared) {
        slope_total<<<1, 32, 0, current_stream>>>(slope_sums, g.c, grad_slope);
        BIE_CUDA_TRY(launched(who));
    }
    if (g.count == 0) return BIE_OK;
    const bool act = a.slope != nullptr;
    if (g.rows)
        rows_bwd_apply<T, V>
            <<<dim3((unsigned)row_blocks(g.outer, nv, gy, 8, 8), (unsigned)gy), kThreads, 0,
               current_stream>>>(gout, y, res, grad_y, grad_res, g.outer, g.c, cf, act);
    else
        planes_bwd_apply<T, V><<<grid_1d(g.count * g.c / V), kThreads, 0, current_stream>>>(
            gout, y, res, grad_y, grad_res, g.count * g.c / V, g.c, g.inner / V, cf, act);
    return launched(who);
}

Geom geom_of(const bie_cuda_bn_act &a) {
    return Geom{a.outer, a.c, a.inner, a.outer * a.inner, a.inner == 1};
}

// Whether whole 16-byte vectors fit: every row (rows) or plane (planes) a multiple of V
// elements, every pointer aligned.
template <typename T> bool vec_ok(const Geom &g, std::initializer_list<const void *> ptrs) {
    if ((g.rows ? g.c : g.inner) % kVec<T> != 0) return false;
    for (const void *p : ptrs)
        if (!aligned(p)) return false;
    return true;
}

template <typename T>
bie_status forward_dt(const bie_cuda_bn_act &a, const void *y, const void *res, float *sm,
                      float *sr, void *out) {
    const Geom g = geom_of(a);
    const T *ty = static_cast<const T *>(y), *tr = static_cast<const T *>(res);
    T *to = static_cast<T *>(out);
    if (vec_ok<T>(g, {y, res, out})) return forward_t<T, kVec<T>>(a, g, ty, tr, sm, sr, to);
    return forward_t<T, 1>(a, g, ty, tr, sm, sr, to);
}

template <typename T>
bie_status backward_dt(const bie_cuda_bn_act &a, const void *gout, const void *y, const void *res,
                       const float *sm, const float *sr, void *gy, void *gr, float *gg, float *gb,
                       float *gs) {
    const Geom g = geom_of(a);
    const T *tg = static_cast<const T *>(gout), *ty = static_cast<const T *>(y),
            *tr = static_cast<const T *>(res);
    T *tgy = static_cast<T *>(gy), *tgr = static_cast<T *>(gr);
    if (vec_ok<T>(g, {gout, y, res, gy, gr}))
        return backward_t<T, kVec<T>>(a, g, tg, ty, tr, sm, sr, tgy, tgr, gg, gb, gs);
    return backward_t<T, 1>(a, g, tg, ty, tr, sm, sr, tgy, tgr, gg, gb, gs);
}

}  // namespace
}  // namespace bie_cuda

using namespace bie_cuda;

bie_status bie_cuda_bn_act_forward(const bie_cuda_bn_act *a, const void *y, const void *res,
                                   float *save_mean, float *save_rstd, void *out) {
    BIE_CUDA_TRY(check(cudaSetDevice(a->device), "bie_bn_act_forward: cudaSetDevice"));
    switch (a->dtype) {
    case BIE_F32: return forward_dt<float>(*a, y, res, save_mean, save_rstd, out);
    case BIE_BF16: return forward_dt<__nv_bfloat16>(*a, y, res, save_mean, save_rstd, out);
    case BIE_F16: return forward_dt<__half>(*a, y, res, save_mean, save_rstd, out);
    default: return bie_fail(BIE_ERR_DTYPE, "bie_bn_act_forward: dtype");
    }
}

bie_status bie_cuda_bn_act_backward(const bie_cuda_bn_act *a, const void *grad_out, const void *y,
                                    const void *res, const float *save_mean, const float *save_rstd,
                                    void *grad_y, void *grad_res, float *grad_gamma,
                                    float *grad_beta, float *grad_slope) {
    BIE_CUDA_TRY(check(cudaSetDevice(a->device), "bie_bn_act_backward: cudaSetDevice"));
    switch (a->dtype) {
    case BIE_F32:
        return backward_dt<float>(*a, grad_out, y, res, save_mean, save_rstd, grad_y, grad_res,
                                  grad_gamma, grad_beta, grad_slope);
    case BIE_BF16:
        return backward_dt<__nv_bfloat16>(*a, grad_out, y, res, save_mean, save_rstd, grad_y,
                                          grad_res, grad_gamma, grad_beta, grad_slope);
    case BIE_F16:
        return backward_dt<__half>(*a, grad_out, y, res, save_mean, save_rstd, grad_y, grad_res,
                                   grad_gamma, grad_beta, grad_slope);
    default: return bie_fail(BIE_ERR_DTYPE, "bie_bn_act_backward: dtype");
    }
}
