// Where the 4-bit GEMM kernels' A rows come from (q4gemm.cu, q4gemm_wgmma.cu), and the NCHW
// store of a convolution tile.
#pragma once
#include <cstdint>

#include "epilogue.cuh"

namespace bie_cuda {

// Where a block's A rows come from. RowsA: rows of ld bytes (the GEMM). ConvA: an implicit
// convolution, row r = output pixel r (n, oy, ox), its k bytes the receptive field's taps
// in [i, j] order, each tap `cb` bytes of NHWC codes of one input pixel (zero outside the
// input; cb a multiple of the k block, so that a block's 16-byte chunks stay in one tap).
// prepare() keeps per-row state for the rows a thread copies; next() steps the k block.
struct RowsA {
    static constexpr bool kNchwTile = false;  // the Epilogue's own row-major / NCHW stores
    const uint8_t *a;
    template <int N> struct State {
        const uint8_t *row[N];
        bool ok[N];
        int kofs;
    };
    template <int N>
    __device__ __forceinline__ void prepare(State<N> &s, int m, unsigned ld, int row0, int rowstep,
                                            int c16) const {
#pragma unroll
        for (int i = 0; i < N; i++) {
            const int row = row0 + i * rowstep;
            s.row[i] = a + (size_t)(unsigned)min(row, m - 1) * ld + c16;
            s.ok[i] = row < m;
        }
        s.kofs = 0;
    }
    template <int N>
    __device__ __forceinline__ const uint8_t *src(const State<N> &s, int i, bool &ok) const {
        ok = s.ok[i];
        return s.row[i] + s.kofs;
    }
    template <int N, int BKB> __device__ __forceinline__ void next(State<N> &s) const {
        s.kofs += BKB;
    }
};

struct ConvA {
    static constexpr bool kNchwTile = true;  // NCHW output through a shared-memory tile
    const uint8_t *codes;                    // [n h w][cb]
    int cb, h, w, ow, plane, k, s, p, d;
    bool pairs;  // the epilogue may store two neighbouring pixels at once (conv_pairs_ok)
    template <int N> struct State {
        const uint8_t *img[N];
        int y0[N], x0[N];
        bool ok[N];
        int ti, tj, cofs;  // the k block's tap and offset in it (with this thread's chunk)
    };
    template <int N>
    __device__ __forceinline__ void prepare(State<N> &st, int m, unsigned, int row0, int rowstep,
                                            int c16) const {
#pragma unroll
        for (int i = 0; i < N; i++) {
            const int row = row0 + i * rowstep, r = min(row, m - 1);
            const int n = r / plane, pix = r - n * plane, oy = pix / ow;
            st.img[i] = codes + (size_t)n * h * w * cb;
            st.y0[i] = oy * s - p;
            st.x0[i] = (pix - oy * ow) * s - p;
            st.ok[i] = row < m;
        }
        st.ti = st.tj = 0;
        st.cofs = c16;
    }
    template <int N>
    __device__ __forceinline__ const uint8_t *src(const State<N> &st, int i, bool &ok) const {
        const int iy = st.y0[i] + st.ti * d, ix = st.x0[i] + st.tj * d;
        ok = st.ok[i] && iy >= 0 && iy < h && ix >= 0 && ix < w;
        return ok ? st.img[i] + (size_t)(iy * w + ix) * cb + st.cofs : codes;
    }
    template <int N, int BKB> __device__ __forceinline__ void next(State<N> &st) const {
        st.cofs += BKB;
        if (st.cofs >= cb) {
            st.cofs -= cb;
            if (++st.tj == k) {
                st.tj = 0;
                st.ti++;
            }
        }
    }
};

// The NCHW store of a BM x (up to) BN tile of dot products held channel-major in shared
// memory (sC[c * rs + r], r the tile row): each of THREADS threads walks one pixel row (or a
// pair of rows, when pairs) of it, so neighbouring threads store neighbouring pixels of a
// channel plane; the threads beyond a multiple of the rows per pass stay idle.
template <int BM, int THREADS>
__device__ __forceinline__ void conv_tile_out(const Epilogue &ep, const int *sC, int rs, int m,
                                              int n, int bm0, int bn0, int bn, bool pairs,
                                              float scale, int tid) {
    static_assert(BM <= THREADS && BM % 2 == 0, "a thread per tile row at least; whole pairs");
    const int per = pairs ? BM / 2 : BM, cstep = THREADS / per;
    const int r = pairs ? 2 * (tid % per) : tid % per, row = bm0 + r;
    if (row >= m || tid >= cstep * per) return;
    const int plane = (int)ep.conv.plane, nn = row / plane, pix = row - nn * plane;
    const int cl0 = tid / per, cols = n - bn0 < bn ? n - bn0 : bn;
    const int64_t step = (int64_t)cstep * plane,
                  first = ((int64_t)nn * n + bn0 + cl0) * plane + pix;
    store_tile_rows(ep, sC + r, rs, cl0, cstep, cols, first, step, pairs, scale);
}

}  // namespace bie_cuda
