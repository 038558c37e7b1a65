// The training library's float layers and optimizer steps on the device (train_cuda.h).
// Deterministic by construction: element-wise kernels have one writer per element, every
// reduction has a shape fixed by the problem size alone (never by the device) and sums in a
// fixed order, and nothing uses floating-point atomics. Where the CPU's float arithmetic
// decides something discrete or is cheap to mirror exactly, the kernels spell it with the
// _rn intrinsics, which nvcc never fuses into FMAs, so results equal the CPU's bit for bit.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>

#include "../train/train_cuda.h"
#include "backward_common.cuh"
#include "cuda_common.cuh"
#include "train_common.cuh"

namespace bie_cuda {
namespace {

// ---------------------------------------------------------------- linear

__global__ void add_bias_rows(float *y, int64_t m, int64_t out, const float *b) {
    for (int64_t i = thread_index(); i < m * out; i += thread_stride())
        y[i] = __fadd_rn(y[i], b[i % out]);
}

// db[j] = sum over the rows of dy[:, j] in double: block (32 columns, 8 row slices), each
// slice summing its rows in order, then the 8 slices in order.
__global__ void __launch_bounds__(256)
    column_sums_f64(const float *dy, int64_t m, int64_t out, float *db) {
    __shared__ double part[8][32];
    const int64_t j = (int64_t)blockIdx.x * 32 + threadIdx.x;
    double s = 0;
    if (j < out)
        for (int64_t r = threadIdx.y; r < m; r += 8) s += (double)dy[r * out + j];
    part[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && j < out) {
        double t = 0;
        for (int i = 0; i < 8; i++) t += part[i][threadIdx.x];
        db[j] = (float)t;
    }
}

// C (row-major [rows, cols]) = op(A) op(B) with k inner, as a column-major cuBLAS call on the
// transposed problem; a zero inner dimension gives zeros.
struct Gemm {
    cublasOperation_t ta, tb;
    int64_t rows, cols, k;  // column-major m, n, k of the cuBLAS call
    const float *a;
    int64_t lda;
    const float *b;
    int64_t ldb;
    float *c;
    int64_t ldc;
};

bie_status run_gemm(cublasHandle_t h, const Gemm &g, const char *what) {
    if (g.rows == 0 || g.cols == 0) return BIE_OK;
    if (g.k == 0)
        return check(
            cudaMemsetAsync(g.c, 0, (size_t)(g.rows * g.cols) * sizeof(float), current_stream),
            what);
    const float one = 1.0f, zero = 0.0f;
    return blas_check(cublasSgemm(h, g.ta, g.tb, (int)g.rows, (int)g.cols, (int)g.k, &one, g.a,
                                  (int)g.lda, g.b, (int)g.ldb, &zero, g.c, (int)g.ldc),
                      what);
}

bie_status gemms(const Gemm *list, int count, const char *who) {
    cublasHandle_t h = nullptr;
    BIE_CUDA_TRY(blas_handle(&h));
    // The shared handle keeps its scalars in device memory; these calls pass host scalars.
    BIE_CUDA_TRY(blas_check(cublasSetPointerMode(h, CUBLAS_POINTER_MODE_HOST), who));
    bie_status s = BIE_OK;
    for (int i = 0; i < count && s == BIE_OK; i++) s = run_gemm(h, list[i], who);
    bie_status r = blas_check(cublasSetPointerMode(h, CUBLAS_POINTER_MODE_DEVICE), who);
    return s != BIE_OK ? s : r;
}

bool fits_int(int64_t v) { return v >= 0 && v <= INT_MAX; }

// ---------------------------------------------------------------- element-wise layers

__global__ void relu_fwd(const float *x, int64_t n, float *y) {
    for (int64_t i = thread_index(); i < n; i += thread_stride()) y[i] = x[i] > 0 ? x[i] : 0.0f;
}

__global__ void relu_bwd(const float *y, const float *dy, int64_t n, float *dx) {
    for (int64_t i = thread_index(); i < n; i += thread_stride()) dx[i] = y[i] > 0 ? dy[i] : 0.0f;
}

__global__ void prelu_fwd(const float *x, int64_t total, int64_t channels, int64_t inner,
                          const float *slopes, int64_t n_slopes, float *y) {
    for (int64_t i = thread_index(); i < total; i += thread_stride()) {
        const float a = slopes[n_slopes == 1 ? 0 : (i / inner) % channels];
        y[i] = x[i] >= 0 ? x[i] : __fmul_rn(a, x[i]);
    }
}

__global__ void prelu_bwd_dx(const float *x, const float *dy, int64_t total, int64_t channels,
                             int64_t inner, const float *slopes, int64_t n_slopes, float *dx) {
    for (int64_t i = thread_index(); i < total; i += thread_stride()) {
        const float a = slopes[n_slopes == 1 ? 0 : (i / inner) % channels];
        dx[i] = x[i] >= 0 ? dy[i] : __fmul_rn(a, dy[i]);
    }
}

// ---------------------------------------------------------------- per-channel reductions
// Channel ch of a tensor [n, c, inner] holds the n * inner elements (b * c + ch) * inner + i.
// Stage 1: block (split, channel) sums every `splits`-th run of kThreads elements of its
// channel (each thread in order, then a fixed tree) into part[ch * splits + split]; stage 2:
// one thread per channel adds the splits in order. Two sums at once (double2).

unsigned channel_grid_y(int64_t c) { return (unsigned)(c < 1 ? 1 : c > 65535 ? 65535 : c); }

template <class Term>
__global__ void __launch_bounds__(kThreads)
    channel_partial(ChannelShape g, Term term, double2 *part) {
    __shared__ double sa[kThreads], sb[kThreads];
    const int64_t count = g.n * g.inner;
    const int64_t stride = (int64_t)g.splits * kThreads;
    const int64_t step_b = stride / g.inner, step_i = stride % g.inner;
    for (int64_t ch = blockIdx.y; ch < g.c; ch += gridDim.y) {
        double a = 0, b = 0;
        int64_t e = (int64_t)blockIdx.x * kThreads + threadIdx.x;
        if (e < count) {
            int64_t bi = e / g.inner, i = e % g.inner;
            for (; e < count; e += stride) {
                const double2 t = term((bi * g.c + ch) * g.inner + i, ch);
                a += t.x;
                b += t.y;
                bi += step_b;
                i += step_i;
                if (i >= g.inner) {
                    i -= g.inner;
                    bi++;
                }
            }
        }
        sa[threadIdx.x] = a;
        sb[threadIdx.x] = b;
        __syncthreads();
        for (int o = kThreads / 2; o > 0; o >>= 1) {
            if ((int)threadIdx.x < o) {
                sa[threadIdx.x] += sa[threadIdx.x + o];
                sb[threadIdx.x] += sb[threadIdx.x + o];
            }
            __syncthreads();
        }
        if (threadIdx.x == 0) part[ch * g.splits + blockIdx.x] = make_double2(sa[0], sb[0]);
        __syncthreads();  // the next channel reuses the shared arrays
    }
}

template <class Finish>
__global__ void channel_final(const double2 *part, int64_t c, int splits, Finish finish) {
    for (int64_t ch = thread_index(); ch < c; ch += thread_stride()) {
        double a = 0, b = 0;
        for (int s = 0; s < splits; s++) {
            a += part[ch * splits + s].x;
            b += part[ch * splits + s].y;
        }
        finish(ch, a, b);
    }
}

template <class Term, class Finish>
void channel_reduce(const ChannelShape &g, Term term, Finish finish, double2 *part) {
    channel_partial<<<dim3((unsigned)g.splits, channel_grid_y(g.c)), kThreads, 0, current_stream>>>(
        g, term, part);
    channel_final<<<grid_1d(g.c), kThreads, 0, current_stream>>>(part, g.c, g.splits, finish);
}

// Batch norm's per-channel reductions over n x inner elements (none: n = 0 with rows of 1, so
// nothing divides by zero) and their scratch: the partial sums, then one result per channel.
struct BnReduce {
    ChannelShape g;
    Scratch ws;
    double2 *part = nullptr, *stat = nullptr;
    bie_status init(int64_t n, int64_t c, int64_t inner, const char *what) {
        g = inner > 0 ? ChannelShape{n, c, inner, 1} : ChannelShape{0, c, 1, 1};
        g.splits = splits_for(n * inner, c);
        BIE_CUDA_TRY(ws.get((size_t)(c * g.splits + c) * sizeof(double2), what));
        part = static_cast<double2 *>(ws.p);
        stat = part + c * g.splits;
        return BIE_OK;
    }
};

struct PreluSlopeTerm {
    const float *x, *dy;
    __device__ double2 operator()(int64_t at, int64_t) const {
        const float v = x[at];
        // a float times a float is exact in double, as on the CPU
        return make_double2(v < 0 ? (double)dy[at] * (double)v : 0.0, 0.0);
    }
};
struct StoreSlope {
    float *dslopes;
    __device__ void operator()(int64_t ch, double a, double) const { dslopes[ch] = (float)a; }
};

// ---------------------------------------------------------------- batch norm

struct SumTerm {
    const float *x;
    __device__ double2 operator()(int64_t at, int64_t) const {
        return make_double2((double)x[at], 0.0);
    }
};
struct StoreMean {
    double2 *stat;  // (mean, invstd) per channel
    double count;
    __device__ void operator()(int64_t ch, double a, double) const { stat[ch].x = a / count; }
};
struct SquareTerm {
    const float *x;
    const double2 *stat;
    __device__ double2 operator()(int64_t at, int64_t ch) const {
        const double d = __dsub_rn((double)x[at], stat[ch].x);
        return make_double2(__dmul_rn(d, d), 0.0);
    }
};
struct StoreVar {
    double2 *stat;
    int64_t count;
    float eps;
    float *invstd, *batch_mean, *batch_var;
    __device__ void operator()(int64_t ch, double sq, double) const {
        const double var = sq / (double)count;  // biased: what normalises the batch
        const double is = 1.0 / sqrt(var + (double)eps);
        stat[ch].y = is;
        invstd[ch] = (float)is;
        batch_mean[ch] = (float)stat[ch].x;
        batch_var[ch] = (float)(count > 1 ? sq / (double)(count - 1) : var);
    }
};

__global__ void bn_normalise(const float *x, int64_t total, int64_t c, int64_t inner,
                             const double2 *stat, const float *gamma, const float *beta, float *y,
                             float *xhat) {
    for (int64_t at = thread_index(); at < total; at += thread_stride()) {
        const int64_t ch = (at / inner) % c;
        const float xh = (float)__dmul_rn(__dsub_rn((double)x[at], stat[ch].x), stat[ch].y);
        xhat[at] = xh;
        y[at] = __fadd_rn(__fmul_rn(gamma[ch], xh), beta[ch]);
    }
}

__global__ void bn_running(int64_t c, float momentum, const float *bm, const float *bv, float *rm,
                           float *rv) {
    const float keep = 1.0f - momentum;
    for (int64_t ch = thread_index(); ch < c; ch += thread_stride()) {
        rm[ch] = __fadd_rn(__fmul_rn(keep, rm[ch]), __fmul_rn(momentum, bm[ch]));
        rv[ch] = __fadd_rn(__fmul_rn(keep, rv[ch]), __fmul_rn(momentum, bv[ch]));
    }
}

__global__ void bn_eval(const float *x, int64_t total, int64_t c, int64_t inner, const float *gamma,
                        const float *beta, float eps, const float *rmean, const float *rvar,
                        float *y) {
    for (int64_t at = thread_index(); at < total; at += thread_stride()) {
        const int64_t ch = (at / inner) % c;
        const float scale =
            (float)((double)gamma[ch] / sqrt(__dadd_rn((double)rvar[ch], (double)eps)));
        const float shift = __fsub_rn(beta[ch], __fmul_rn(rmean[ch], scale));
        y[at] = __fadd_rn(__fmul_rn(x[at], scale), shift);
    }
}

struct GradTerm {
    const float *dy, *xhat;
    __device__ double2 operator()(int64_t at, int64_t) const {
        return make_double2((double)dy[at], (double)dy[at] * (double)xhat[at]);
    }
};
struct StoreGrad {
    double2 *stat;  // (sum dy, sum dy xhat)
    float *dgamma, *dbeta;
    __device__ void operator()(int64_t ch, double sdy, double sdyx) const {
        stat[ch] = make_double2(sdy, sdyx);
        dgamma[ch] = (float)sdyx;
        dbeta[ch] = (float)sdy;
    }
};

__global__ void bn_dx(const float *xhat, const float *invstd, const float *dy, int64_t total,
                      int64_t c, int64_t inner, int64_t count, const double2 *stat,
                      const float *gamma, float *dx) {
    const double cnt = (double)count;
    for (int64_t at = thread_index(); at < total; at += thread_stride()) {
        const int64_t ch = (at / inner) % c;
        const double k = __ddiv_rn(__dmul_rn((double)gamma[ch], (double)invstd[ch]), cnt);
        const double t = __dsub_rn(__dsub_rn(__dmul_rn(cnt, (double)dy[at]), stat[ch].x),
                                   __dmul_rn((double)xhat[at], stat[ch].y));
        dx[at] = (float)__dmul_rn(k, t);
    }
}

// ---------------------------------------------------------------- max-pool

__global__ void maxpool_fwd(const float *x, int64_t planes, int64_t h, int64_t w, int k, int s,
                            int64_t oh, int64_t ow, float *y, int32_t *argmax) {
    const int64_t total = planes * oh * ow;
    for (int64_t o = thread_index(); o < total; o += thread_stride()) {
        const int64_t ox = o % ow, oy = (o / ow) % oh, p = o / (ow * oh);
        const float *xp = x + p * h * w;
        int64_t best = oy * s * w + ox * s;
        for (int i = 0; i < k; i++)
            for (int j = 0; j < k; j++) {
                const int64_t at = (oy * s + i) * w + ox * s + j;
                if (xp[at] > xp[best]) best = at;  // first maximum wins ties
            }
        y[o] = xp[best];
        if (argmax) argmax[o] = (int32_t)best;
    }
}

// One warp per plane: zero the plane, then take its outputs 32 at a time; lanes whose
// outputs picked the same input form a group, and the group's lowest lane adds their
// gradients in lane order, so every input receives its additions in increasing output
// order, as on the CPU.
__global__ void __launch_bounds__(256)
    maxpool_bwd(const float *dy, const int32_t *argmax, int64_t planes, int64_t hw, int64_t ohw,
                float *dx) {
    __shared__ float vals[8][32];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int64_t warps = (int64_t)gridDim.x * 8;
    for (int64_t p = (int64_t)blockIdx.x * 8 + wid; p < planes; p += warps) {
        float *dxp = dx + p * hw;
        for (int64_t i = lane; i < hw; i += 32) dxp[i] = 0.0f;
        __syncwarp();
        for (int64_t base = 0; base < ohw; base += 32) {
            const int64_t o = base + lane;
            const bool valid = o < ohw;
            const int target =
                valid ? argmax[p * ohw + o] : -1 - lane;  // lanes past the end: unique
            vals[wid][lane] = valid ? dy[p * ohw + o] : 0.0f;
            const unsigned group = __match_any_sync(0xffffffffu, target);
            __syncwarp();
            if (valid && lane == __ffs(group) - 1) {
                float acc = dxp[target];
                for (unsigned g = group; g; g &= g - 1)
                    acc = __fadd_rn(acc, vals[wid][__ffs(g) - 1]);
                dxp[target] = acc;
            }
            __syncwarp();
        }
    }
}

// ---------------------------------------------------------------- optimizer steps

struct AdamScalars {
    float beta1, beta2, one_minus_beta1, one_minus_beta2, eps, step_size, bc2_sqrt, decay, l2;
};

__global__ void adam_kernel(float *p, const float *g, float *m, float *v, int64_t n,
                            AdamScalars s) {
    for (int64_t i = thread_index(); i < n; i += thread_stride()) {
        const float pi = p[i];
        const float gi = __fadd_rn(g[i], __fmul_rn(s.l2, pi));
        const float mi = __fadd_rn(__fmul_rn(s.beta1, m[i]), __fmul_rn(s.one_minus_beta1, gi));
        const float vi =
            __fadd_rn(__fmul_rn(s.beta2, v[i]), __fmul_rn(__fmul_rn(s.one_minus_beta2, gi), gi));
        m[i] = mi;
        v[i] = vi;
        const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), s.bc2_sqrt), s.eps);
        p[i] = __fsub_rn(__fmul_rn(pi, s.decay), __fdiv_rn(__fmul_rn(s.step_size, mi), denom));
    }
}

__global__ void __launch_bounds__(kThreads)
    signflip_kernel(int8_t *w, const int8_t *g8, const float *gf, float *m, float *v, int64_t n,
                    float lr, float a1, float a2, unsigned long long *count) {
    __shared__ unsigned long long sh[kThreads];
    unsigned long long flips = 0;
    for (int64_t i = thread_index(); i < n; i += thread_stride()) {
        const float g = g8 ? (float)g8[i] : gf[i];
        const float mi =
            __fadd_rn(m[i], __fmul_rn(a1, __fsub_rn(g, m[i])));  // lerp(m, g, 1 - beta1)
        const float target = mi > 0 ? lr : mi < 0 ? -lr : 0.0f;  // sgn0(m) lr, sgn0(0) = 0
        const float vi = __fadd_rn(v[i], __fmul_rn(a2, __fsub_rn(target, v[i])));
        m[i] = mi;
        v[i] = vi;
        const bool want_negative = vi >= 0;  // u = -sign(v), sign(0) = +1
        const int8_t wi = w[i];
        if ((wi < 0) != want_negative) {
            // -(-128) does not fit: it becomes 127
            w[i] = wi == 0 ? (int8_t)-1 : wi == INT8_MIN ? (int8_t)INT8_MAX : (int8_t)-wi;
            flips++;
        }
    }
    if (count == nullptr) return;
    sh[threadIdx.x] = flips;
    __syncthreads();
    for (int o = kThreads / 2; o > 0; o >>= 1) {
        if ((int)threadIdx.x < o) sh[threadIdx.x] += sh[threadIdx.x + o];
        __syncthreads();
    }
    // integer sums: exact in any order
    if (threadIdx.x == 0 && sh[0]) atomicAdd(count, sh[0]);
}

}  // namespace
}  // namespace bie_cuda

using namespace bie_cuda;

extern "C" {

bie_status bie_cuda_linear_forward(const float *x, int64_t m, int64_t in, int64_t out,
                                   const float *w, const float *b, float *y) {
    if (!fits_int(m) || !fits_int(in) || !fits_int(out))
        return bie_fail(BIE_ERR_INVALID_ARGUMENT,
                        "linear (CUDA): sizes %lld x %lld -> %lld exceed the GEMM's range",
                        (long long)m, (long long)in, (long long)out);
    // y^T [out, m] (column-major) = w [in, out]^T x^T [in, m]
    const Gemm g = {CUBLAS_OP_T, CUBLAS_OP_N, out, m, in, w, in, x, in, y, out};
    BIE_CUDA_TRY(gemms(&g, 1, "linear forward (cublasSgemm)"));
    if (b != nullptr && m * out > 0)
        add_bias_rows<<<grid_1d(m * out), kThreads, 0, current_stream>>>(y, m, out, b);
    return launched("linear forward");
}

bie_status bie_cuda_linear_backward(const float *x, const float *dy, int64_t m, int64_t in,
                                    int64_t out, const float *w, float *dx, float *dw, float *db) {
    if (!fits_int(m) || !fits_int(in) || !fits_int(out))
        return bie_fail(BIE_ERR_INVALID_ARGUMENT,
                        "linear (CUDA): sizes %lld x %lld -> %lld exceed the GEMM's range",
                        (long long)m, (long long)in, (long long)out);
    Gemm list[2];
    int count = 0;
    // dx^T [in, m] = w^T [in, out] dy^T [out, m]
    if (dx) list[count++] = {CUBLAS_OP_N, CUBLAS_OP_N, in, m, out, w, in, dy, out, dx, in};
    // dw^T [in, out] = x^T [in, m] dy [m, out]
    list[count++] = {CUBLAS_OP_N, CUBLAS_OP_T, in, out, m, x, in, dy, out, dw, in};
    BIE_CUDA_TRY(gemms(list, count, "linear backward (cublasSgemm)"));
    if (db != nullptr && out > 0)
        column_sums_f64<<<(unsigned)((out + 31) / 32), dim3(32, 8), 0, current_stream>>>(dy, m, out,
                                                                                         db);
    return launched("linear backward");
}

bie_status bie_cuda_relu_forward(const float *x, int64_t n, float *y) {
    if (n > 0) relu_fwd<<<grid_1d(n), kThreads, 0, current_stream>>>(x, n, y);
    return launched("relu forward");
}

bie_status bie_cuda_relu_backward(const float *y, const float *dy, int64_t n, float *dx) {
    if (n > 0) relu_bwd<<<grid_1d(n), kThreads, 0, current_stream>>>(y, dy, n, dx);
    return launched("relu backward");
}

bie_status bie_cuda_prelu_forward(const float *x, int64_t outer, int64_t channels, int64_t inner,
                                  const float *slopes, int64_t n_slopes, float *y) {
    const int64_t total = outer * channels * inner;
    if (total > 0)
        prelu_fwd<<<grid_1d(total), kThreads, 0, current_stream>>>(x, total, channels, inner,
                                                                   slopes, n_slopes, y);
    return launched("prelu forward");
}

bie_status bie_cuda_prelu_backward(const float *x, const float *dy, int64_t outer, int64_t channels,
                                   int64_t inner, const float *slopes, int64_t n_slopes, float *dx,
                                   float *dslopes) {
    const int64_t total = outer * channels * inner;
    if (dx && total > 0)
        prelu_bwd_dx<<<grid_1d(total), kThreads, 0, current_stream>>>(x, dy, total, channels, inner,
                                                                      slopes, n_slopes, dx);
    // a shared slope sums over everything: one channel of one row
    ChannelShape g =
        n_slopes == 1 ? ChannelShape{1, 1, total, 1} : ChannelShape{outer, channels, inner, 1};
    if (g.c == 0) return launched("prelu backward");
    if (g.inner == 0) {  // no elements: zeros (and no division by a zero row length)
        g.n = 0;
        g.inner = 1;
    }
    g.splits = splits_for(g.n * g.inner, g.c);
    Scratch part;
    BIE_CUDA_TRY(part.get((size_t)(g.c * g.splits) * sizeof(double2), "prelu backward (scratch)"));
    channel_reduce(g, PreluSlopeTerm{x, dy}, StoreSlope{dslopes}, static_cast<double2 *>(part.p));
    return launched("prelu backward");
}

bie_status bie_cuda_maxpool_forward(const float *x, int64_t planes, int64_t h, int64_t w, int k,
                                    int s, int64_t oh, int64_t ow, float *y, int32_t *argmax) {
    const int64_t total = planes * oh * ow;
    if (total > 0)
        maxpool_fwd<<<grid_1d(total), kThreads, 0, current_stream>>>(x, planes, h, w, k, s, oh, ow,
                                                                     y, argmax);
    return launched("maxpool forward");
}

bie_status bie_cuda_maxpool_backward(const float *dy, const int32_t *argmax, int64_t planes,
                                     int64_t h, int64_t w, int64_t oh, int64_t ow, float *dx) {
    if (planes > 0 && h * w > 0) {
        const int64_t blocks = (planes + 7) / 8;
        maxpool_bwd<<<(unsigned)(blocks > 32768 ? 32768 : blocks), 256, 0, current_stream>>>(
            dy, argmax, planes, h * w, oh * ow, dx);
    }
    return launched("maxpool backward");
}

bie_status bie_cuda_batchnorm_forward_train(const float *x, int64_t n, int64_t c, int64_t inner,
                                            const float *gamma, const float *beta, float eps,
                                            float *y, float *xhat, float *invstd, float *batch_mean,
                                            float *batch_var) {
    if (c <= 0) return BIE_OK;
    const int64_t count = n * inner;
    BnReduce r;
    BIE_CUDA_TRY(r.init(n, c, inner, "batch norm forward (scratch)"));
    double2 *stat = r.stat;
    channel_reduce(r.g, SumTerm{x}, StoreMean{stat, (double)count}, r.part);
    channel_reduce(r.g, SquareTerm{x, stat},
                   StoreVar{stat, count, eps, invstd, batch_mean, batch_var}, r.part);
    const int64_t total = count * c;
    if (total > 0)
        bn_normalise<<<grid_1d(total), kThreads, 0, current_stream>>>(x, total, c, inner, stat,
                                                                      gamma, beta, y, xhat);
    return launched("batch norm forward");
}

bie_status bie_cuda_batchnorm_update_running(int64_t c, float momentum, const float *batch_mean,
                                             const float *batch_var, float *running_mean,
                                             float *running_var) {
    if (c > 0)
        bn_running<<<grid_1d(c), kThreads, 0, current_stream>>>(c, momentum, batch_mean, batch_var,
                                                                running_mean, running_var);
    return launched("batch norm running statistics");
}

bie_status bie_cuda_batchnorm_forward_eval(const float *x, int64_t n, int64_t c, int64_t inner,
                                           const float *gamma, const float *beta, float eps,
                                           const float *running_mean, const float *running_var,
                                           float *y) {
    const int64_t total = n * c * inner;
    if (total > 0)
        bn_eval<<<grid_1d(total), kThreads, 0, current_stream>>>(x, total, c, inner, gamma, beta,
                                                                 eps, running_mean, running_var, y);
    return launched("batch norm forward (evaluation)");
}

bie_status bie_cuda_batchnorm_backward(const float *xhat, const float *invstd, const float *dy,
                                       int64_t n, int64_t c, int64_t inner, const float *gamma,
                                       float *dx, float *dgamma, float *dbeta) {
    if (c <= 0) return BIE_OK;
    const int64_t count = n * inner;
    BnReduce r;
    BIE_CUDA_TRY(r.init(n, c, inner, "batch norm backward (scratch)"));
    double2 *stat = r.stat;
    channel_reduce(r.g, GradTerm{dy, xhat}, StoreGrad{stat, dgamma, dbeta}, r.part);
    const int64_t total = count * c;
    if (dx && total > 0)
        bn_dx<<<grid_1d(total), kThreads, 0, current_stream>>>(xhat, invstd, dy, total, c, inner,
                                                               count, stat, gamma, dx);
    return launched("batch norm backward");
}

bie_status bie_cuda_adam_step(float *p, const float *g, float *m, float *v, int64_t n, int64_t step,
                              const bie_adam_options *o) {
    if (o == nullptr) return bie_fail(BIE_ERR_NULL_POINTER, "adam_step (CUDA): options is NULL");
    // The scalars exactly as the CPU step computes them.
    const double bc1 = 1.0 - std::pow((double)o->beta1, (double)step);
    const double bc2 = 1.0 - std::pow((double)o->beta2, (double)step);
    AdamScalars s;
    s.beta1 = o->beta1;
    s.beta2 = o->beta2;
    s.one_minus_beta1 = 1.0f - o->beta1;
    s.one_minus_beta2 = 1.0f - o->beta2;
    s.eps = o->eps;
    s.step_size = (float)((double)o->lr / bc1);
    s.bc2_sqrt = (float)std::sqrt(bc2);
    s.decay = o->decoupled ? 1.0f - o->lr * o->weight_decay : 1.0f;
    s.l2 = o->decoupled ? 0.0f : o->weight_decay;
    if (n > 0) adam_kernel<<<grid_1d(n), kThreads, 0, current_stream>>>(p, g, m, v, n, s);
    return launched("adam step");
}

bie_status bie_cuda_signflip_step(int8_t *w, const int8_t *g8, const float *gf, float *m, float *v,
                                  int64_t n, float lr, float beta1, float beta2, int64_t *flipped) {
    if ((g8 == nullptr) == (gf == nullptr))
        return bie_fail(BIE_ERR_INVALID_ARGUMENT,
                        "signflip_step (CUDA): exactly one gradient array is needed");
    const float a1 = 1.0f - beta1, a2 = 1.0f - beta2;
    if (flipped == nullptr) {
        if (n > 0)
            signflip_kernel<<<grid_1d(n), kThreads, 0, current_stream>>>(w, g8, gf, m, v, n, lr, a1,
                                                                         a2, nullptr);
        return launched("signflip step");
    }
    Scratch ws;
    BIE_CUDA_TRY(ws.get(sizeof(unsigned long long), "signflip step (scratch)"));
    unsigned long long *count = static_cast<unsigned long long *>(ws.p), host = 0;
    BIE_CUDA_TRY(
        check(cudaMemsetAsync(count, 0, sizeof host, current_stream), "signflip step (memset)"));
    if (n > 0)
        signflip_kernel<<<grid_1d(n), kThreads, 0, current_stream>>>(w, g8, gf, m, v, n, lr, a1, a2,
                                                                     count);
    BIE_CUDA_TRY(launched("signflip step"));
    BIE_CUDA_TRY(
        check(cudaMemcpyAsync(&host, count, sizeof host, cudaMemcpyDeviceToHost, current_stream),
              "signflip step (count)"));
    BIE_CUDA_TRY(check(cudaStreamSynchronize(current_stream), "signflip step (wait)"));
    *flipped = (int64_t)host;
    return BIE_OK;
}

bie_status bie_cuda_train_alloc(void **p, size_t bytes, const char *what) {
    *p = nullptr;
    cudaError_t err = cudaMalloc(p, bytes ? bytes : 1);
    if (err == cudaSuccess) return BIE_OK;
    *p = nullptr;
    cudaGetLastError();
    if (err == cudaErrorMemoryAllocation)
        return bie_fail(BIE_ERR_OUT_OF_MEMORY, "out of CUDA device memory for %s (%zu bytes)", what,
                        bytes);
    return bie_fail(BIE_ERR_CUDA, "cudaMalloc for %s (%zu bytes): %s", what, bytes,
                    cudaGetErrorString(err));
}

void bie_cuda_train_free(void *p) {
    if (p) cudaFree(p);
}

// Where p points: device, pageable host (unregistered), pinned host or managed memory.
static cudaMemoryType memory_type(const void *p) {
    cudaPointerAttributes attr;
    if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
        cudaGetLastError();
        return cudaMemoryTypeManaged;  // unknown: treated as memory the host reads at once
    }
    return attr.type;
}

bie_status bie_cuda_train_copy(void *dst, const void *src, size_t bytes) {
    if (bytes == 0) return BIE_OK;
    BIE_CUDA_TRY(check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, current_stream),
                       "cudaMemcpyAsync"));
    // Device to device is ordered on the stream like a kernel; from pageable host memory the
    // source is staged before the call returns. Only a host destination, or a host source
    // the DMA reads later, needs the wait.
    const cudaMemoryType from = memory_type(src);
    if (memory_type(dst) == cudaMemoryTypeDevice &&
        (from == cudaMemoryTypeDevice || from == cudaMemoryTypeUnregistered))
        return BIE_OK;
    return check(cudaStreamSynchronize(current_stream), "cudaStreamSynchronize");
}

bie_status bie_cuda_train_memset0(void *p, size_t bytes) {
    if (bytes == 0) return BIE_OK;
    return check(cudaMemsetAsync(p, 0, bytes, current_stream), "cudaMemsetAsync");
}

bie_status bie_cuda_train_sync(void) {
    return check(cudaStreamSynchronize(current_stream), "cudaStreamSynchronize");
}

bie_status bie_cuda_train_set_device(int device, int *previous) {
    int now = 0;
    BIE_CUDA_TRY(check(cudaGetDevice(&now), "cudaGetDevice"));
    if (previous) *previous = now;
    if (now == device) return BIE_OK;
    return check(cudaSetDevice(device), "cudaSetDevice");
}

}  // extern "C"
