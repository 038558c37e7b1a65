// The graph's float layers on the device (train_cuda.h): float conv2d through an im2col
// buffer and cuBLAS, average pools, add / accumulate, channel concat and RPReLU.
// Deterministic by construction, as train_kernels.cu: one writer per element, reductions of
// a shape fixed by the problem size alone summing in a fixed order (in double), no floating-
// point atomics. Where the CPU kernel (float_conv.c, graph_layers.c) is element by element
// or sums one window / plane in order, the kernels repeat its arithmetic with the _rn
// intrinsics (never fused into FMAs), so their results equal the CPU's bit for bit: the
// pools, add, accumulate, concat, RPReLU's forward and dx. Conv2d (cuBLAS SGEMM, FP32 math as
// the handle's default) and RPReLU's per-channel sums differ from the CPU's in summation
// order only.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>

#include "../train/train_cuda.h"
#include "backward_common.cuh"
#include "cuda_common.cuh"
#include "train_common.cuh"

namespace bie_cuda {
namespace {

// A 2D launch: blocks of kThreads along a row of `cols` elements, rows over grid y (the
// kernels loop over rows beyond 65535).
dim3 grid_rows(int64_t cols, int64_t rows) {
    return dim3((unsigned)((cols + kThreads - 1) / kThreads),
                (unsigned)std::min<int64_t>(std::max<int64_t>(rows, 1), 65535));
}

bie_status zero_floats(float *p, int64_t n, const char *what) {
    if (p == nullptr || n <= 0) return BIE_OK;
    return check(cudaMemsetAsync(p, 0, (size_t)n * sizeof(float), current_stream), what);
}

// ---------------------------------------------------------------- per-channel reductions
// As train_kernels.cu, with N sums at once: channel ch of [n, c, inner] holds the n * inner
// elements (b * c + ch) * inner + i. Stage 1: block (split, channel) sums every `splits`-th
// run of kThreads elements of its channel (each thread in order, then a fixed tree) into
// part[ch * splits + split]; stage 2: one thread per channel adds the splits in order. Every
// element is visited by exactly one thread, so a term may also write an output per element.

template <int N> struct Sums { double v[N]; };

// n * inner elements per channel; none (n = 0 or inner = 0) gives zeros with rows of 1.
ChannelShape channel_shape(int64_t n, int64_t c, int64_t inner) {
    ChannelShape g = n > 0 && inner > 0 ? ChannelShape{n, c, inner, 1} : ChannelShape{0, c, 1, 1};
    g.splits = splits_for(g.n * g.inner, c);
    return g;
}

template <int N, class Term>
__global__ void __launch_bounds__(kThreads)
    channel_partial(ChannelShape g, Term term, Sums<N> *part) {
    __shared__ double sh[N][kThreads];
    const int64_t count = g.n * g.inner;
    const int64_t stride = (int64_t)g.splits * kThreads;
    const int64_t step_b = stride / g.inner, step_i = stride % g.inner;
    for (int64_t ch = blockIdx.y; ch < g.c; ch += gridDim.y) {
        Sums<N> acc;
        for (int q = 0; q < N; q++) acc.v[q] = 0;
        int64_t e = (int64_t)blockIdx.x * kThreads + threadIdx.x;
        if (e < count) {
            int64_t bi = e / g.inner, i = e % g.inner;
            for (; e < count; e += stride) {
                const Sums<N> t = term((bi * g.c + ch) * g.inner + i, ch);
                for (int q = 0; q < N; q++) acc.v[q] += t.v[q];
                bi += step_b;
                i += step_i;
                if (i >= g.inner) {
                    i -= g.inner;
                    bi++;
                }
            }
        }
        for (int q = 0; q < N; q++) sh[q][threadIdx.x] = acc.v[q];
        __syncthreads();
        for (int o = kThreads / 2; o > 0; o >>= 1) {
            if ((int)threadIdx.x < o)
                for (int q = 0; q < N; q++) sh[q][threadIdx.x] += sh[q][threadIdx.x + o];
            __syncthreads();
        }
        if (threadIdx.x == 0)
            for (int q = 0; q < N; q++) part[ch * g.splits + blockIdx.x].v[q] = sh[q][0];
        __syncthreads();  // the next channel reuses the shared arrays
    }
}

template <int N, class Finish>
__global__ void channel_final(const Sums<N> *part, int64_t c, int splits, Finish finish) {
    for (int64_t ch = thread_index(); ch < c; ch += thread_stride()) {
        Sums<N> acc;
        for (int q = 0; q < N; q++) acc.v[q] = 0;
        for (int s = 0; s < splits; s++)
            for (int q = 0; q < N; q++) acc.v[q] += part[ch * splits + s].v[q];
        finish(ch, acc);
    }
}

template <int N, class Term, class Finish>
bie_status channel_reduce(const ChannelShape &g, Term term, Finish finish, const char *what) {
    if (g.c <= 0) return BIE_OK;
    Scratch part;
    BIE_CUDA_TRY(part.get((size_t)(g.c * g.splits) * sizeof(Sums<N>), what));
    Sums<N> *p = static_cast<Sums<N> *>(part.p);
    channel_partial<N><<<dim3((unsigned)g.splits, (unsigned)std::min<int64_t>(g.c, 65535)),
                         kThreads, 0, current_stream>>>(g, term, p);
    channel_final<N><<<grid_1d(g.c), kThreads, 0, current_stream>>>(p, g.c, g.splits, finish);
    return launched(what);
}

// ---------------------------------------------------------------- conv2d

// The column matrix: K = c k k rows of P = oh ow columns per image. Images go in chunks of
// up to kChunkImages (fewer where a chunk's work would pass kWorkBudget floats). Work of a
// chunk of nb images: the columns [K][nb P] (padded to 64 floats), then the output gradient
// regrouped as [o][nb P] (backward). The forward uses the first part only, as [nb][K][P],
// and nothing for a pointwise conv (1x1, stride 1, no padding: the image is its columns).
constexpr int64_t kChunkImages = 32;
constexpr int64_t kWorkBudget = (int64_t)1 << 26;

struct ConvDims {
    int64_t K, P, nb, col_floats;
    bool pointwise;
};

ConvDims conv_dims(const bie_conv_geom &g) {
    ConvDims d;
    d.K = g.c * g.k * g.k;
    d.P = g.oh * g.ow;
    const int64_t per_image = (d.K + g.o) * d.P;
    d.nb = std::min(g.n, kChunkImages);
    if (per_image > 0) d.nb = std::min(d.nb, std::max<int64_t>(1, kWorkBudget / per_image));
    d.col_floats = (d.nb * d.K * d.P + 63) / 64 * 64;
    d.pointwise = g.k == 1 && g.s == 1 && g.p == 0 && g.oh == g.h && g.ow == g.w;
    return d;
}

bool fits_int(int64_t v) { return v >= 0 && v <= INT_MAX; }

// The extents the GEMMs (int sizes) and the kernels' 32-bit index math need.
bie_status conv_check(const bie_conv_geom &g, const ConvDims &d, const char *who) {
    if (fits_int(d.K) && fits_int(g.o) && fits_int(d.nb * d.P) && fits_int(g.h * g.w) &&
        fits_int(d.nb * g.c) && fits_int(d.nb * d.K) && fits_int(d.nb * g.o) && fits_int(g.k) &&
        fits_int(g.s) && fits_int(g.p) && fits_int(g.d))
        return BIE_OK;
    return bie_fail(BIE_ERR_INVALID_ARGUMENT,
                    "%s: sizes (c %lld, %lldx%lld, o %lld, k %lld) exceed the kernels' range", who,
                    (long long)g.c, (long long)g.h, (long long)g.w, (long long)g.o, (long long)g.k);
}

// Columns of `nb` images x [nb, c, h, w]: row (img, kidx = (ci k + ky) k + kx), position
// pix = oy ow + ox goes to col[kidx rs + img is + pix]; 0 outside the image.
__global__ void __launch_bounds__(kThreads)
    im2col(const float *x, bie_conv_geom g, int nb, int64_t rs, int64_t is, float *col) {
    const int ow = (int)g.ow, P = (int)(g.oh * g.ow), pix = blockIdx.x * kThreads + threadIdx.x;
    if (pix >= P) return;
    const int k = (int)g.k, kk = k * k, K = (int)g.c * kk, h = (int)g.h, w = (int)g.w;
    const int oy = pix / ow, ox = pix - oy * ow;
    const int iy0 = oy * (int)g.s - (int)g.p, ix0 = ox * (int)g.s - (int)g.p, d = (int)g.d;
    const int rows = nb * K;
    for (int r = blockIdx.y; r < rows; r += gridDim.y) {
        const int img = r / K, kidx = r - img * K;
        const int ci = kidx / kk, t = kidx - ci * kk, ky = t / k, kx = t - ky * k;
        const int iy = iy0 + ky * d, ix = ix0 + kx * d;
        float v = 0.0f;
        if (iy >= 0 && iy < h && ix >= 0 && ix < w)
            v = x[((int64_t)img * g.c + ci) * h * w + (int64_t)iy * w + ix];
        col[kidx * rs + img * is + pix] = v;
    }
}

// dy of nb images [nb][o][P] -> [o][nb P].
__global__ void __launch_bounds__(kThreads)
    group_rows(const float *dy, int nb, int o, int P, float *out) {
    const int pix = blockIdx.x * kThreads + threadIdx.x;
    if (pix >= P) return;
    for (int r = blockIdx.y; r < nb * o; r += gridDim.y) {
        const int img = r / o, oc = r - img * o;
        out[((int64_t)oc * nb + img) * P + pix] = dy[(int64_t)r * P + pix];
    }
}

// y[img, oc, :] += b[oc] over rows = n o.
__global__ void __launch_bounds__(kThreads)
    add_bias_planes(float *y, int64_t rows, int64_t o, int64_t P, const float *b) {
    for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
        const float bias = b[r % o];
        for (int64_t i = thread_index(); i < P; i += thread_stride())
            y[r * P + i] = __fadd_rn(y[r * P + i], bias);
    }
}

struct Everything {  // col2im's mask: every input gets its gradient
    __device__ bool operator()(int, int, int, int64_t) const { return true; }
};

// The calling thread's cuBLAS handle with host scalars for one call; device scalars again
// (the handle's usual mode) when it ends.
struct HostScalars {
    cublasHandle_t h = nullptr;
    bool open = false;
    bie_status begin(const char *who) {
        BIE_CUDA_TRY(blas_handle(&h));
        BIE_CUDA_TRY(blas_check(cublasSetPointerMode(h, CUBLAS_POINTER_MODE_HOST), who));
        open = true;
        return BIE_OK;
    }
    bie_status end(bie_status s, const char *who) {
        if (!open) return s;
        open = false;
        const bie_status r = blas_check(cublasSetPointerMode(h, CUBLAS_POINTER_MODE_DEVICE), who);
        return s != BIE_OK ? s : r;
    }
    ~HostScalars() {
        if (open) cublasSetPointerMode(h, CUBLAS_POINTER_MODE_DEVICE);
    }
};

const float kOne = 1.0f, kZeroF = 0.0f;

bie_status conv_forward_gemms(cublasHandle_t h, const bie_conv_geom &g, const ConvDims &d,
                              const float *x, const float *w, float *y, float *work) {
    const char *who = "conv2d forward (CUDA)";
    const int64_t K = d.K, P = d.P, o = g.o, x_image = g.c * g.h * g.w;
    // pointwise: the images are the columns, in chunks that keep cuBLAS's batch moderate
    const int64_t step = d.pointwise ? std::min<int64_t>(g.n, 4096) : d.nb;
    for (int64_t i0 = 0; i0 < g.n; i0 += step) {
        const int64_t cur = std::min(step, g.n - i0);
        const float *cols = x + i0 * x_image;
        if (!d.pointwise) {
            im2col<<<grid_rows(P, cur * K), kThreads, 0, current_stream>>>(
                x + i0 * x_image, g, (int)cur, P, K * P, work);
            BIE_CUDA_TRY(launched("conv2d forward (im2col)"));
            cols = work;
        }
        // y_i [o][P] = W [o][K] cols_i [K][P]; column-major: y_i^T = cols_i^T W^T
        BIE_CUDA_TRY(blas_check(
            cublasSgemmStridedBatched(h, CUBLAS_OP_N, CUBLAS_OP_N, (int)P, (int)o, (int)K, &kOne,
                                      cols, (int)P, (long long)(K * P), w, (int)K, 0LL, &kZeroF,
                                      y + i0 * o * P, (int)P, (long long)(o * P), (int)cur),
            who));
    }
    return BIE_OK;
}

bie_status conv_backward_gemms(cublasHandle_t h, const bie_conv_geom &g, const ConvDims &d,
                               const float *x, const float *dy, const float *w, float *dx,
                               float *dw, float *work) {
    const char *who = "conv2d backward (CUDA)";
    const int64_t K = d.K, P = d.P, o = g.o, x_image = g.c * g.h * g.w;
    float *cols = work, *grows = work + d.col_floats;
    for (int64_t i0 = 0; i0 < g.n; i0 += d.nb) {
        const int64_t cur = std::min(d.nb, g.n - i0), R = cur * P;
        im2col<<<grid_rows(P, cur * K), kThreads, 0, current_stream>>>(x + i0 * x_image, g,
                                                                       (int)cur, R, P, cols);
        group_rows<<<grid_rows(P, cur * o), kThreads, 0, current_stream>>>(
            dy + i0 * o * P, (int)cur, (int)o, (int)P, grows);
        BIE_CUDA_TRY(launched("conv2d backward (im2col)"));
        // dw [o][K] (+)= G [o][R] cols^T: column-major dw^T [K, o] = cols [K, R] G^T; the first
        // chunk overwrites, the next ones add in order
        BIE_CUDA_TRY(
            blas_check(cublasSgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, (int)K, (int)o, (int)R, &kOne, cols,
                                   (int)R, grows, (int)R, i0 == 0 ? &kZeroF : &kOne, dw, (int)K),
                       who));
        if (dx == nullptr || x_image == 0) continue;
        // gradient columns [K][R] = W^T G, over the columns (queued after the GEMM above)
        BIE_CUDA_TRY(blas_check(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_T, (int)R, (int)K, (int)o,
                                            &kOne, grows, (int)R, w, (int)K, &kZeroF, cols, (int)R),
                                who));
        bie_conv_geom gc = g;
        gc.n = cur;
        launch_conv_col2im_mask<float>(cols, Everything{}, gc, nullptr, dx + i0 * x_image);
        BIE_CUDA_TRY(launched("conv2d backward (col2im)"));
    }
    return BIE_OK;
}

struct SumTerm {
    const float *x;
    __device__ Sums<1> operator()(int64_t at, int64_t) const { return Sums<1>{{(double)x[at]}}; }
};
struct StoreSum {
    float *out;
    __device__ void operator()(int64_t ch, const Sums<1> &s) const { out[ch] = (float)s.v[0]; }
};

// ---------------------------------------------------------------- pools

// One output per thread: the window's sum in double, rows then columns, times 1 / (k k).
__global__ void avgpool_fwd(const float *x, int64_t planes, int64_t h, int64_t w, int k, int s,
                            int64_t oh, int64_t ow, double inv, float *y) {
    const int64_t total = planes * oh * ow;
    for (int64_t o = thread_index(); o < total; o += thread_stride()) {
        const int64_t ox = o % ow, oy = (o / ow) % oh, p = o / (ow * oh);
        const float *win = x + p * h * w + oy * s * w + ox * s;
        double sum = 0;
        for (int i = 0; i < k; i++)
            for (int j = 0; j < k; j++) sum = __dadd_rn(sum, (double)win[i * w + j]);
        y[o] = (float)__dmul_rn(sum, inv);
    }
}

// One input per thread: dy / (k k) of the windows that hold it, added in increasing output
// order from 0 (the CPU's scatter order).
__global__ void avgpool_bwd(const float *dy, int64_t planes, int64_t h, int64_t w, int k, int s,
                            int64_t oh, int64_t ow, float inv, float *dx) {
    const int64_t total = planes * h * w;
    for (int64_t at = thread_index(); at < total; at += thread_stride()) {
        const int64_t ix = at % w, iy = (at / w) % h, p = at / (w * h);
        // outputs o with o s <= i <= o s + k - 1
        const int64_t y0 = iy < k ? 0 : (iy - k + s) / s, y1 = iy / s < oh ? iy / s : oh - 1;
        const int64_t x0 = ix < k ? 0 : (ix - k + s) / s, x1 = ix / s < ow ? ix / s : ow - 1;
        const float *dyp = dy + p * oh * ow;
        float acc = 0.0f;
        for (int64_t oy = y0; oy <= y1; oy++)
            for (int64_t ox = x0; ox <= x1; ox++)
                acc = __fadd_rn(acc, __fmul_rn(dyp[oy * ow + ox], inv));
        dx[at] = acc;
    }
}

// One plane per thread: its sum in double, in order, over `inner`.
__global__ void global_avgpool_fwd(const float *x, int64_t planes, int64_t inner, float *y) {
    for (int64_t p = thread_index(); p < planes; p += thread_stride()) {
        const float *xp = x + p * inner;
        double sum = 0;
        for (int64_t i = 0; i < inner; i++) sum = __dadd_rn(sum, (double)xp[i]);
        y[p] = (float)__ddiv_rn(sum, (double)inner);
    }
}

__global__ void global_avgpool_bwd(const float *dy, int64_t planes, int64_t inner, float *dx) {
    for (int64_t r = blockIdx.y; r < planes; r += gridDim.y) {
        const float g = (float)__ddiv_rn((double)dy[r], (double)inner);
        for (int64_t i = thread_index(); i < inner; i += thread_stride()) dx[r * inner + i] = g;
    }
}

// ---------------------------------------------------------------- add, concat, RPReLU

__global__ void add_fwd(const float *a, const float *b, int64_t n, float *y) {
    for (int64_t i = thread_index(); i < n; i += thread_stride()) y[i] = __fadd_rn(a[i], b[i]);
}

// Rows of `block` floats: src row r at src + r * src_ld, dst row r at dst + r * dst_ld.
__global__ void copy_rows(const float *src, int64_t src_ld, float *dst, int64_t dst_ld,
                          int64_t rows, int64_t block) {
    for (int64_t r = blockIdx.y; r < rows; r += gridDim.y)
        for (int64_t i = thread_index(); i < block; i += thread_stride())
            dst[r * dst_ld + i] = src[r * src_ld + i];
}

bie_status concat_rows(const float *src, int64_t src_ld, float *dst, int64_t dst_ld, int64_t rows,
                       int64_t block, const char *what) {
    if (rows > 0 && block > 0) {
        const dim3 grid((unsigned)std::min<int64_t>((block + kThreads - 1) / kThreads, 1024),
                        (unsigned)std::min<int64_t>(rows, 65535));
        copy_rows<<<grid, kThreads, 0, current_stream>>>(src, src_ld, dst, dst_ld, rows, block);
    }
    return launched(what);
}

__global__ void rprelu_fwd(const float *x, int64_t total, int64_t channels, int64_t inner,
                           const float *shift_in, const float *slopes, const float *shift_out,
                           float *y) {
    for (int64_t i = thread_index(); i < total; i += thread_stride()) {
        const int64_t c = (i / inner) % channels;
        const float t = __fadd_rn(x[i], shift_in[c]);
        y[i] = __fadd_rn(t >= 0 ? t : __fmul_rn(slopes[c], t), shift_out[c]);
    }
}

// RPReLU's backward per element: writes dx (when not NULL) and gives the three sums
// (d shift_in: dx; d slope: dy t where t < 0; d shift_out: dy).
struct RpreluTerm {
    const float *x, *dy, *shift_in, *slopes;
    float *dx;
    __device__ Sums<3> operator()(int64_t at, int64_t ch) const {
        const float t = __fadd_rn(x[at], shift_in[ch]), g = dy[at];
        const float gx = t >= 0 ? g : __fmul_rn(slopes[ch], g);
        if (dx) dx[at] = gx;
        // a float times a float is exact in double, as on the CPU
        return Sums<3>{{(double)gx, t < 0 ? (double)g * (double)t : 0.0, (double)g}};
    }
};
struct StoreRprelu {
    float *dshift_in, *dslopes, *dshift_out;
    __device__ void operator()(int64_t ch, const Sums<3> &s) const {
        dshift_in[ch] = (float)s.v[0];
        dslopes[ch] = (float)s.v[1];
        dshift_out[ch] = (float)s.v[2];
    }
};

}  // namespace
}  // namespace bie_cuda

using namespace bie_cuda;

extern "C" {

int64_t bie_cuda_conv2d_work_floats(const bie_conv_geom *g) {
    const ConvDims d = conv_dims(*g);
    return d.col_floats + d.nb * g->o * d.P;
}

bie_status bie_cuda_conv2d_forward(const bie_conv_geom *g, const float *x, const float *w,
                                   const float *b, float *y, float *work) {
    const char *who = "conv2d forward (CUDA)";
    const ConvDims d = conv_dims(*g);
    const int64_t rows = g->n * g->o;
    if (rows == 0 || d.P == 0) return BIE_OK;
    BIE_CUDA_TRY(conv_check(*g, d, who));
    if (d.K == 0) {
        BIE_CUDA_TRY(zero_floats(y, rows * d.P, who));
    } else {
        HostScalars blas;
        BIE_CUDA_TRY(blas.begin(who));
        BIE_CUDA_TRY(blas.end(conv_forward_gemms(blas.h, *g, d, x, w, y, work), who));
    }
    if (b != nullptr)
        add_bias_planes<<<grid_rows(std::min<int64_t>(d.P, 4096), rows), kThreads, 0,
                          current_stream>>>(y, rows, g->o, d.P, b);
    return launched("conv2d forward (bias)");
}

bie_status bie_cuda_conv2d_backward(const bie_conv_geom *g, const float *x, const float *dy,
                                    const float *w, float *dx, float *dw, float *db, float *work) {
    const char *who = "conv2d backward (CUDA)";
    const ConvDims d = conv_dims(*g);
    BIE_CUDA_TRY(conv_check(*g, d, who));
    if (g->n == 0 || d.P == 0 || d.K == 0 || g->o == 0) {  // no products: zero gradients
        BIE_CUDA_TRY(zero_floats(dw, g->o * d.K, who));
        BIE_CUDA_TRY(zero_floats(dx, g->n * g->c * g->h * g->w, who));
    } else {
        HostScalars blas;
        BIE_CUDA_TRY(blas.begin(who));
        BIE_CUDA_TRY(blas.end(conv_backward_gemms(blas.h, *g, d, x, dy, w, dx, dw, work), who));
    }
    if (db == nullptr) return BIE_OK;
    return channel_reduce<1>(channel_shape(g->n, g->o, d.P), SumTerm{dy}, StoreSum{db},
                             "conv2d backward (bias gradient)");
}

bie_status bie_cuda_avgpool_forward(const float *x, int64_t planes, int64_t h, int64_t w, int k,
                                    int s, int64_t oh, int64_t ow, float *y) {
    const int64_t total = planes * oh * ow;
    if (total > 0)
        avgpool_fwd<<<grid_1d(total), kThreads, 0, current_stream>>>(x, planes, h, w, k, s, oh, ow,
                                                                     1.0 / ((double)k * k), y);
    return launched("avgpool forward");
}

bie_status bie_cuda_avgpool_backward(const float *dy, int64_t planes, int64_t h, int64_t w, int k,
                                     int s, int64_t oh, int64_t ow, float *dx) {
    const int64_t total = planes * h * w;
    if (total > 0)
        avgpool_bwd<<<grid_1d(total), kThreads, 0, current_stream>>>(
            dy, planes, h, w, k, s, oh, ow, (float)(1.0 / ((double)k * k)), dx);
    return launched("avgpool backward");
}

bie_status bie_cuda_global_avgpool_forward(const float *x, int64_t planes, int64_t inner,
                                           float *y) {
    if (planes > 0)
        global_avgpool_fwd<<<grid_1d(planes), kThreads, 0, current_stream>>>(x, planes, inner, y);
    return launched("global avgpool forward");
}

bie_status bie_cuda_global_avgpool_backward(const float *dy, int64_t planes, int64_t inner,
                                            float *dx) {
    if (planes > 0 && inner > 0)
        global_avgpool_bwd<<<grid_rows(std::min<int64_t>(inner, 4096), planes), kThreads, 0,
                             current_stream>>>(dy, planes, inner, dx);
    return launched("global avgpool backward");
}

bie_status bie_cuda_add_forward(const float *a, const float *b, int64_t n, float *y) {
    if (n > 0) add_fwd<<<grid_1d(n), kThreads, 0, current_stream>>>(a, b, n, y);
    return launched("add forward");
}

bie_status bie_cuda_accumulate(float *acc, const float *x, int64_t n) {
    if (n > 0) add_fwd<<<grid_1d(n), kThreads, 0, current_stream>>>(acc, x, n, acc);
    return launched("accumulate");
}

bie_status bie_cuda_concat_copy(const float *x, int64_t outer, int64_t ci, int64_t inner,
                                int64_t ctotal, int64_t offset, float *y) {
    return concat_rows(x, ci * inner, y + offset * inner, ctotal * inner, outer, ci * inner,
                       "concat copy");
}

bie_status bie_cuda_concat_slice(const float *y, int64_t outer, int64_t ci, int64_t inner,
                                 int64_t ctotal, int64_t offset, float *x) {
    return concat_rows(y + offset * inner, ctotal * inner, x, ci * inner, outer, ci * inner,
                       "concat slice");
}

bie_status bie_cuda_rprelu_forward(const float *x, int64_t outer, int64_t channels, int64_t inner,
                                   const float *shift_in, const float *slopes,
                                   const float *shift_out, float *y) {
    const int64_t total = outer * channels * inner;
    if (total > 0)
        rprelu_fwd<<<grid_1d(total), kThreads, 0, current_stream>>>(x, total, channels, inner,
                                                                    shift_in, slopes, shift_out, y);
    return launched("rprelu forward");
}

bie_status bie_cuda_rprelu_backward(const float *x, const float *dy, int64_t outer,
                                    int64_t channels, int64_t inner, const float *shift_in,
                                    const float *slopes, float *dx, float *dshift_in,
                                    float *dslopes, float *dshift_out) {
    return channel_reduce<3>(channel_shape(outer, channels, inner),
                             RpreluTerm{x, dy, shift_in, slopes, dx},
                             StoreRprelu{dshift_in, dslopes, dshift_out}, "rprelu backward");
}

}  // extern "C"
