// Nibbles to int8 on chip, shared by the 4-bit GEMM kernels (q4gemm.cu on mma.sync,
// q4gemm_wgmma.cu on Hopper's warpgroup mma).
//
// A 32-bit word holds 8 codes c0..c7 (c0 in the low nibble). It becomes two int8x4 words,
// the even codes (c0 c2 c4 c6) and the odd ones (c1 c3 c5 c7); both operands of a product
// are unpacked alike, so this permutation of k leaves the dot product unchanged. Two ways:
//  - narrow (k < kWideK): each code is left in the high nibble of its byte, i.e. the int8
//    value 16 c with its sign for free: odd = w & 0xf0f0f0f0, even = (w << 4) & 0xf0f0f0f0,
//    three instructions per word. The tensor cores then sum 256 a.b; |a.b| <= 64 k < 2^23
//    keeps every partial sum inside int32, and the epilogue shifts the 8 bits back out,
//    exactly.
//  - wide (kWideK <= k <= 2^24): true sign extension of each nibble (a few more
//    instructions), for products whose 256-fold sum could overflow.
#pragma once
#include <cstdint>

namespace bie_cuda {

// Codes of k at or above this take the wide unpacking.
constexpr int64_t kWideK = 1 << 17;

template <bool WIDE>
__device__ __forceinline__ void unpack(unsigned w, unsigned &even, unsigned &odd) {
    if (WIDE) {
        // Per byte: nibble x -> (x ^ 8) + 0x78 stays below 0x100 (no carry into the next
        // byte); flipping bit 7 then leaves x - 16 [x >= 8], the sign-extended code.
        even = (((w & 0x0f0f0f0fu) ^ 0x08080808u) + 0x78787878u) ^ 0x80808080u;
        odd = ((((w >> 4) & 0x0f0f0f0fu) ^ 0x08080808u) + 0x78787878u) ^ 0x80808080u;
    } else {
        even = (w << 4) & 0xf0f0f0f0u;
        odd = w & 0xf0f0f0f0u;
    }
}

// The dot product of two unpacked operands, back to the codes' own scale.
template <bool WIDE> __device__ __forceinline__ int unpacked_dot(int v) {
    return WIDE ? v : v >> 8;
}

}  // namespace bie_cuda
