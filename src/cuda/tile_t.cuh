// Tiles transposed through shared memory, shared by the passes that write a matrix's values
// transposed for a backward product: the 4-bit weight values (q4pack.cu, q4backward.cu) and the
// binary weight's ±1 values (pack.cu).
#pragma once
#include "dtype.cuh"

namespace bie_cuda {

// 64 x 64 tiles of 16-bit values transposed through shared memory (the weight's values [k][n]
// that the grad_x product takes): thread t of 256 puts 16 values of tile row t / 4, columns
// 16 (t % 4) .., into tile [row][col] at a pitch of 65 values (so that the column reads of
// tile_store_t meet no bank conflict); after a __syncthreads, tile_store_t writes two 16-byte
// pieces of eight rows of one column (a warp: four columns x 128 contiguous bytes) to
// dst[(c0 + col) * rows + r0 + row], skipping columns at or past `cols` and rows past `rows`
// (rows a multiple of 8, dst 16-byte aligned).
constexpr int kTilePitch = 65;
template <typename T>
__device__ __forceinline__ void tile_put(T *tile, int t, const float (&v)[16]) {
    const int r = t >> 2, c16 = (t & 3) * 16;
#pragma unroll
    for (int j = 0; j < 16; j++) tile[r * kTilePitch + c16 + j] = from_f32<T>(v[j]);
}
template <typename T>
__device__ __forceinline__ void tile_store_t(const T *tile, int t, int64_t r0, int64_t c0,
                                             int64_t rows, int64_t cols, T *dst) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int id = t + 256 * h, col = id >> 3, x = id & 7;
        if (c0 + col >= cols || r0 + 8 * x >= rows) continue;
        T e[8];
#pragma unroll
        for (int i = 0; i < 8; i++) e[i] = tile[(8 * x + i) * kTilePitch + col];
        *reinterpret_cast<uint4 *>(dst + (c0 + col) * rows + r0 + 8 * x) =
            *reinterpret_cast<const uint4 *>(e);
    }
}

}  // namespace bie_cuda
