// The GEMM epilogue shared by the CUDA integer kernels (binary and 4-bit): an exact integer
// dot product becomes (float)dot * scale in the output dtype, stored either row-major
// [m, n] (linear layers) or as an NCHW convolution output.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda_internal.h"

namespace bie_cuda {

// Output dtypes, chosen at run time (one kernel per tile shape, not three).
enum OutType { kOutF32 = 0, kOutBF16 = 1, kOutF16 = 2 };

// -1 for a dtype the epilogue cannot write.
inline int out_type_of(bie_dtype dt) {
    return dt == BIE_F32 ? kOutF32 : dt == BIE_BF16 ? kOutBF16 : dt == BIE_F16 ? kOutF16 : -1;
}

__device__ __forceinline__ void store_out(void *out, int64_t i, float v, int type) {
    if (type == kOutF32)
        static_cast<float *>(out)[i] = v;
    else if (type == kOutBF16)
        static_cast<__nv_bfloat16 *>(out)[i] = __float2bfloat16(v);
    else
        static_cast<__half *>(out)[i] = __float2half(v);
}

// out[i], out[i + 1] = v0, v1 as one store where out + i is aligned to two elements, else two.
__device__ __forceinline__ void store_out2(void *out, int64_t i, float v0, float v1, int type) {
    const int elem = type == kOutF32 ? 4 : 2;
    if ((reinterpret_cast<uintptr_t>(out) + (uintptr_t)i * elem) % (2 * elem) != 0) {
        store_out(out, i, v0, type);
        store_out(out, i + 1, v1, type);
    } else if (type == kOutF32) {
        *reinterpret_cast<float2 *>(static_cast<float *>(out) + i) = make_float2(v0, v1);
    } else if (type == kOutBF16) {
        *reinterpret_cast<__nv_bfloat162 *>(static_cast<__nv_bfloat16 *>(out) + i) =
            __floats2bfloat162_rn(v0, v1);
    } else {
        *reinterpret_cast<__half2 *>(static_cast<__half *>(out) + i) = __floats2half2_rn(v0, v1);
    }
}

// Two pairs of 16-bit elements (bfloat162 / half2) as one 8-byte store at 16-bit element i.
template <typename P>
__device__ __forceinline__ void store_pairs(void *out, int64_t i, const P &lo, const P &hi) {
    uint2 u;
    u.x = *reinterpret_cast<const uint32_t *>(&lo);
    u.y = *reinterpret_cast<const uint32_t *>(&hi);
    *reinterpret_cast<uint2 *>(static_cast<uint16_t *>(out) + i) = u;
}

// out[i .. i + n - 1] = v0 .. v3 (n <= 4): one vector store where n is 4 and the caller says
// out + i is aligned to four elements, else one store an element.
__device__ __forceinline__ void store_out4(void *out, int64_t i, float v0, float v1, float v2,
                                           float v3, int n, bool aligned, int type) {
    if (n != 4 || !aligned) {
        const float v[4] = {v0, v1, v2, v3};
        for (int e = 0; e < n; e++) store_out(out, i + e, v[e], type);
    } else if (type == kOutF32) {
        *reinterpret_cast<float4 *>(static_cast<float *>(out) + i) = make_float4(v0, v1, v2, v3);
    } else if (type == kOutBF16) {
        store_pairs(out, i, __floats2bfloat162_rn(v0, v1), __floats2bfloat162_rn(v2, v3));
    } else {
        store_pairs(out, i, __floats2half2_rn(v0, v1), __floats2half2_rn(v2, v3));
    }
}

// Where one output row goes: its first element's index, the step between columns, and the
// padding class of a convolution pixel (0: no correction).
struct OutRow {
    int64_t base;
    int cls;
};

// out_type and out as above; n output columns. The scale is scale_a * scale_w read on the
// device (layers, whose scales live in device memory) or a constant. A convolution
// (conv.plane > 0) maps row r to image r / plane, pixel r % plane, and column c to channel c:
// out[(image * n + c) * plane + pixel] (NHWC: out[r * n + c]); with conv.corr, dot +=
// corr[class(pixel) * n + c] first (the binary kernels' zero-padding correction).
struct Epilogue {
    int out_type;
    void *out;
    int64_t n;
    float scale_value;
    const float *scale_a, *scale_w;
    bie_cuda_conv_out conv;

    __device__ __forceinline__ float scale() const {
        return scale_a ? scale_a[0] * scale_w[0] : scale_value;
    }
    __device__ __forceinline__ OutRow row(int64_t r) const {
        if (conv.plane == 0) return {r * n, 0};
        const int64_t img = r / conv.plane, pix = r - img * conv.plane;
        const int cls = conv.corr ? conv.pix_class[pix] : 0;
        return {conv.nhwc ? r * n : img * n * conv.plane + pix, cls};
    }
    // Elements between neighbouring columns of a row.
    __device__ __forceinline__ int64_t col_step() const {
        return conv.plane && !conv.nhwc ? conv.plane : 1;
    }
    __device__ __forceinline__ void store(const OutRow &r, int64_t col, long long dot,
                                          float s) const {
        if (r.cls) dot += conv.corr[(int64_t)r.cls * n + col];
        store_out(out, r.base + col * col_step(), (float)dot * s, out_type);
    }
    // Columns col and col + 1 (< n) of one row: a single vector store when they are adjacent
    // and aligned in memory (row-major output), else two stores; the same values either way.
    __device__ __forceinline__ void store2(const OutRow &r, int64_t col, long long d0, long long d1,
                                           float s) const {
        if (conv.plane == 0 || conv.nhwc) {
            if (r.cls) {
                d0 += conv.corr[(int64_t)r.cls * n + col];
                d1 += conv.corr[(int64_t)r.cls * n + col + 1];
            }
            store_out2(out, r.base + col, (float)d0 * s, (float)d1 * s, out_type);
            return;
        }
        store(r, col, d0, s);
        store(r, col + 1, d1, s);
    }
};

// The stores of a convolution tile of integer dot products kept channel-major in shared
// memory (src[cl * rs] is channel cl of this thread's pixel row): channels cl0, cl0 + cstep,
// ... < cols, to out + first, + step, ... (NCHW: step = cstep planes), times scale. With
// pairs the thread stores its row and the next (src[cl * rs + 1]) as one two-element store:
// the caller guarantees both pixels are in one plane and `first` is even (with out aligned
// to two elements). Neighbouring threads take neighbouring pixels, so a warp's stores are
// contiguous runs of a channel plane.
__device__ __forceinline__ void store_tile_rows(const Epilogue &ep, const int *src, int rs, int cl0,
                                                int cstep, int cols, int64_t first, int64_t step,
                                                bool pairs, float scale) {
    if (pairs) {
        if (ep.out_type == kOutF32) {
            float *o = static_cast<float *>(ep.out) + first;
            for (int cl = cl0; cl < cols; cl += cstep, o += step) {
                const int2 v = *reinterpret_cast<const int2 *>(src + cl * rs);
                *reinterpret_cast<float2 *>(o) =
                    make_float2((float)v.x * scale, (float)v.y * scale);
            }
        } else if (ep.out_type == kOutBF16) {
            __nv_bfloat16 *o = static_cast<__nv_bfloat16 *>(ep.out) + first;
            for (int cl = cl0; cl < cols; cl += cstep, o += step) {
                const int2 v = *reinterpret_cast<const int2 *>(src + cl * rs);
                *reinterpret_cast<__nv_bfloat162 *>(o) =
                    __floats2bfloat162_rn((float)v.x * scale, (float)v.y * scale);
            }
        } else {
            __half *o = static_cast<__half *>(ep.out) + first;
            for (int cl = cl0; cl < cols; cl += cstep, o += step) {
                const int2 v = *reinterpret_cast<const int2 *>(src + cl * rs);
                *reinterpret_cast<__half2 *>(o) =
                    __floats2half2_rn((float)v.x * scale, (float)v.y * scale);
            }
        }
    } else if (ep.out_type == kOutF32) {
        float *o = static_cast<float *>(ep.out) + first;
        for (int cl = cl0; cl < cols; cl += cstep, o += step) *o = (float)src[cl * rs] * scale;
    } else if (ep.out_type == kOutBF16) {
        __nv_bfloat16 *o = static_cast<__nv_bfloat16 *>(ep.out) + first;
        for (int cl = cl0; cl < cols; cl += cstep, o += step)
            *o = __float2bfloat16((float)src[cl * rs] * scale);
    } else {
        __half *o = static_cast<__half *>(ep.out) + first;
        for (int cl = cl0; cl < cols; cl += cstep, o += step)
            *o = __float2half((float)src[cl * rs] * scale);
    }
}

// Whether a convolution's tile stores may pair neighbouring pixels: even planes (a pair
// never straddles two images) and an output aligned to two elements.
inline bool conv_pairs_ok(int64_t plane, const void *out, int out_type) {
    const size_t elem = out_type == kOutF32 ? 4 : 2;
    return plane % 2 == 0 && reinterpret_cast<uintptr_t>(out) % (2 * elem) == 0;
}

// The epilogue for a launcher's arguments (conv may be NULL: row-major output).
inline Epilogue make_epilogue(int out_type, void *out, int64_t n, float scale, const float *scale_a,
                              const float *scale_w, const bie_cuda_conv_out *conv) {
    Epilogue e;
    e.out_type = out_type;
    e.out = out;
    e.n = n;
    e.scale_value = scale;
    e.scale_a = scale_a;
    e.scale_w = scale_w;
    e.conv = conv ? *conv : bie_cuda_conv_out{0, nullptr, nullptr, 0};
    return e;
}

// The binary GEMMs: popc(row) from its partial counts (bgemm.cu, bgemm_wgmma.cu), and the
// AND-form back-transform before the shared epilogue (bgemm.cu's kernels; one float multiply,
// as every backend).
__device__ __forceinline__ int row_popc(const int *p, int64_t row, int parts) {
    int s = 0;
    for (int i = 0; i < parts; i++) s += p[row * parts + i];
    return s;
}
__device__ __forceinline__ void store_dot(const Epilogue &ep, const OutRow &row, int64_t col,
                                          int64_t k, int pa, int pb, int acc, float scale) {
    ep.store(row, col, k - 2LL * pa - 2LL * pb + 4LL * acc, scale);
}

}  // namespace bie_cuda
