// The training loop's loss and scale projection on the device (train_cuda.h): softmax
// cross-entropy whose totals stay on the device, and x = max(x, factor * floor). Nothing here
// waits for the device. The totals are summed in a fixed order (one block, rows per warp in
// order, warps in order), so a run reproduces them bit for bit.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdlib>
#include <cstring>

#include "../train/train_cuda.h"
#include "cuda_common.cuh"
#include "train_common.cuh"

namespace bie_cuda {
namespace {

constexpr int kLossWarps = 8;

// The larger of two (value, index) pairs, the smaller index on ties.
__device__ __forceinline__ void arg_max_pair(float &v, int64_t &i, float ov, int64_t oi) {
    if (ov > v || (ov == v && oi < i)) v = ov, i = oi;
}

// One block: warp w takes rows w, w + 8, ...; its lanes stride the row's c logits.
__global__ void __launch_bounds__(kLossWarps * 32)
    softmax_ce_rows(const float *z, const int32_t *__restrict__ labels, int64_t n, int64_t c,
                    float *g, double *__restrict__ sums) {
    const int lane = (int)threadIdx.x & 31, warp = (int)threadIdx.x >> 5;
    double loss = 0, hits = 0, bad = 0;  // this warp's rows, in order (lane 0's copy counts)
    for (int64_t r = warp; r < n; r += kLossWarps) {
        const float *zr = z + r * c;
        float *gr = g + r * c;
        const int32_t label = labels[r];
        bool finite = true;
        float best = -INFINITY;
        int64_t at = c;
        for (int64_t j = lane; j < c; j += 32) {
            const float v = zr[j];
            finite = finite && isfinite(v);
            if (at == c || v > best) best = v, at = j;
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const int64_t oi = __shfl_xor_sync(0xffffffffu, at, o);
            arg_max_pair(best, at, ov, oi);
        }
        finite = __all_sync(0xffffffffu, finite);
        if (!finite || label < 0 || label >= c) {
            for (int64_t j = lane; j < c; j += 32) gr[j] = 0.0f;
            bad += 1;
            continue;
        }
        const double mx = best;
        double se = 0;
        for (int64_t j = lane; j < c; j += 32) se += exp((double)zr[j] - mx);
        for (int o = 16; o > 0; o >>= 1) se += __shfl_xor_sync(0xffffffffu, se, o);
        const double lse = mx + log(se);
        loss += lse - (double)zr[label];
        hits += at == label;
        __syncwarp();  // every lane has read its logits before any gradient (may alias) is written
        for (int64_t j = lane; j < c; j += 32) {
            const double p = exp((double)zr[j] - lse);
            gr[j] = (float)((p - (j == label ? 1.0 : 0.0)) / (double)n);
        }
    }
    __shared__ double part[kLossWarps][3];
    if (lane == 0) part[warp][0] = loss, part[warp][1] = hits, part[warp][2] = bad;
    __syncthreads();
    if (threadIdx.x < 3) {
        double s = 0;
        for (int w = 0; w < kLossWarps; w++) s += part[w][threadIdx.x];
        sums[threadIdx.x] += s;
    }
}

__global__ void clamp_min_scaled_kernel(float *x, const float *floor, int64_t n, float factor) {
    for (int64_t i = thread_index(); i < n; i += thread_stride()) {
        const float lo = __fmul_rn(factor, floor[i]);
        if (x[i] < lo) x[i] = lo;
    }
}

}  // namespace
}  // namespace bie_cuda

using namespace bie_cuda;

bie_status bie_cuda_softmax_ce_accumulate(const float *logits, const int32_t *labels,
                                          bool labels_on_host, int64_t n, int64_t c, float *grad,
                                          double *sums) {
    Scratch staged;
    if (labels_on_host) {
        // Through a pageable copy of ours: cudaMemcpyAsync stages pageable memory before it
        // returns, so the caller may reuse its labels at once, pinned or not.
        const size_t bytes = (size_t)n * sizeof(int32_t);
        int32_t *copy = static_cast<int32_t *>(std::malloc(bytes));
        if (copy == nullptr)
            return bie_fail(BIE_ERR_OUT_OF_MEMORY, "softmax_cross_entropy_accumulate: labels");
        std::memcpy(copy, labels, bytes);
        bie_status st = staged.get(bytes, "softmax_cross_entropy_accumulate (labels)");
        if (st == BIE_OK)
            st = check(
                cudaMemcpyAsync(staged.p, copy, bytes, cudaMemcpyHostToDevice, current_stream),
                "softmax_cross_entropy_accumulate (labels)");
        std::free(copy);
        BIE_CUDA_TRY(st);
        labels = static_cast<const int32_t *>(staged.p);
    }
    softmax_ce_rows<<<1, kLossWarps * 32, 0, current_stream>>>(logits, labels, n, c, grad, sums);
    return launched("softmax_cross_entropy_accumulate");
}

bie_status bie_cuda_clamp_min_scaled(float *x, const float *floor, int64_t n, float factor) {
    if (n > 0)
        clamp_min_scaled_kernel<<<grid_1d(n), kThreads, 0, current_stream>>>(x, floor, n, factor);
    return launched("clamp_min_scaled");
}
