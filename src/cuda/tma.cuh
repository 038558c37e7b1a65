// Hopper's tensor memory accelerator (TMA) and shared-memory barriers (mbarrier) for the
// warp-specialized kernels (sm_90a): a producer thread issues bulk tensor copies that signal
// an mbarrier when their bytes have landed; consumers wait on it, and release a stage through
// a second mbarrier. Device code exists only in an sm_90a compilation; the host side builds
// the tensor maps through the driver entry point (no link against libcuda).
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace bie_cuda {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes the barriers' initialization visible to the other threads and the async proxy.
__device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Arrives once and expects `bytes` more from the copies that complete on this barrier.
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the barrier's phase of parity `parity` has completed (a barrier starts in phase
// 0: waiting on parity 1 returns at once). try_wait suspends the thread for a while in
// hardware before it reports "not yet", so the loop does not spin hot.
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    for (;;) {
        unsigned done;
        asm volatile("{\n"
                     ".reg .pred p;\n"
                     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n"
                     "}\n"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
        if (done) return;
    }
}
// A 2D box of the tensor map at (x, y) (x: the inner dimension, in elements) into shared
// memory at dst; its bytes complete on barrier bar.
__device__ __forceinline__ void tma_load_2d(unsigned dst, const CUtensorMap *map, int x, int y,
                                            unsigned bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, "
        "{%2, %3}], [%4];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar)
        : "memory");
}
// A 4D box of the tensor map at (x, y, z, w) (signed: a box reaching outside the tensor gets
// zeros there) into shared memory at dst; its bytes complete on barrier bar.
__device__ __forceinline__ void tma_load_4d(unsigned dst, const CUtensorMap *map, int x, int y,
                                            int z, int w, unsigned bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, "
        "{%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(z), "r"(w), "r"(bar)
        : "memory");
}
// A 2D box of shared memory at src (laid out as tma_load_2d would have written it) to the tensor
// map at (x, y), parts outside the tensor dropped; in the calling thread's bulk group.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap *map, int x, int y, unsigned src) {
    asm volatile(
        "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
            reinterpret_cast<uint64_t>(map)),
        "r"(x), "r"(y), "r"(src)
        : "memory");
}
__device__ __forceinline__ void tma_store_commit() {
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Waits until the calling thread's bulk groups but the last N have read their shared memory
// (READ) or completed.
template <int N, bool READ> __device__ __forceinline__ void tma_store_wait() {
    if constexpr (READ)
        asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
    else
        asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}
// bytes (a multiple of 16) from p (16-byte aligned) on into L2, with no registers or shared
// memory held while they come.
__device__ __forceinline__ void bulk_prefetch_l2(const void *p, unsigned bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
}
__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap *map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
// A ring's barriers (8 bytes each at full0 / empty0): full waits for the producer's arrival
// and the copies' bytes, empty for one arrival per consumer warpgroup. One thread calls it.
__device__ __forceinline__ void tma_ring_init(unsigned full0, unsigned empty0, int stages,
                                              unsigned consumers) {
    for (int s = 0; s < stages; s++) {
        mbar_init(full0 + 8 * s, 1);
        mbar_init(empty0 + 8 * s, consumers);
    }
}
// The producer thread's walk over a ring of `stages` stages that two tensor maps feed (both
// prefetched first): for each of the block's my_tiles tiles (origin(j, ta, tb): tile j's
// coordinates) and each of its kblocks k blocks, waits until the stage is free, then issue(s, kb,
// ta, tb, full), which arms the stage's full barrier with its copies' bytes and issues them.
template <class Origin, class Issue>
__device__ __forceinline__ void tma_ring_walk(const CUtensorMap *map_a, const CUtensorMap *map_b,
                                              int my_tiles, int kblocks, int stages, unsigned full0,
                                              unsigned empty0, Origin origin, Issue issue) {
    tma_prefetch_map(map_a);
    tma_prefetch_map(map_b);
    for (int j = 0, i = 0; j < my_tiles; j++) {
        int ta, tb;
        origin(j, ta, tb);
        for (int kb = 0; kb < kblocks; kb++, i++) {
            const int s = i % stages;
            mbar_wait(empty0 + 8 * s, ((unsigned)(i / stages) & 1u) ^ 1u);  // its readers done
            issue(s, kb, ta, tb, full0 + 8 * s);
        }
    }
}
// The producer thread of a ring of `stages` stages at base (stage_bytes each: A's box of
// stage_a bytes, then B's), with full and empty barriers at full0 / empty0 (8 bytes each): for
// each of the block's my_tiles tiles (origin(j, row_a, row_b): tile j's first A and B rows)
// and each of its kblocks k blocks of kb_bytes bytes, waits until the stage is free and issues
// the two copies, which complete on the stage's full barrier.
template <class Origin>
__device__ __forceinline__ void tma_ring_produce(const CUtensorMap *map_a, const CUtensorMap *map_b,
                                                 int my_tiles, int kblocks, int kb_bytes,
                                                 int stages, unsigned stage_bytes, unsigned stage_a,
                                                 unsigned base, unsigned full0, unsigned empty0,
                                                 Origin origin) {
    tma_ring_walk(map_a, map_b, my_tiles, kblocks, stages, full0, empty0, origin,
                  [&](int s, int kb, int row_a, int row_b, unsigned full) {
                      const unsigned dst = base + (unsigned)s * stage_bytes;
                      mbar_arrive_expect_tx(full, stage_bytes);
                      tma_load_2d(dst, map_a, kb * kb_bytes, row_a, full);
                      tma_load_2d(dst + stage_a, map_b, kb * kb_bytes, row_b, full);
                  });
}
// The warpgroup's registers per thread, lowered (producers) or raised (consumers).
template <int N> __device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N> __device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// A 2D tensor map of `rows` rows of `ld` bytes at base (16-byte aligned, ld a multiple of 16),
// read in boxes of box_rows rows x 128 bytes into 128-byte-swizzled shared memory (the layout
// the wgmma descriptors read); rows past the end arrive as zeros. False where the driver
// cannot make it.
bool tma_map_rows(CUtensorMap *map, const void *base, int64_t rows, int64_t ld, int box_rows);
// The same read in boxes of box_rows rows x box_bytes bytes (a multiple of 16, at most 256) stored
// as they lie (no swizzle).
bool tma_map_bytes(CUtensorMap *map, const void *base, int64_t rows, int64_t ld, int box_bytes,
                   int box_rows);
// A 4D tensor map of an NHWC-like tensor [n][h][w] of rows of `ld` bytes (16-byte aligned, ld a
// multiple of 16), read in boxes of 128 bytes x bw x bh x bn pixels (taking every step-th pixel
// along w and h: a box spans bw step x bh step, each at most 256) into 128-byte-swizzled
// shared memory, one 128-byte row per pixel; parts of a box outside the tensor arrive as zeros.
// False where the driver cannot make it.
bool tma_map_nhwc(CUtensorMap *map, const void *base, int64_t n, int64_t h, int64_t w, int64_t ld,
                  int bw, int bh, int bn, int step = 1);

}  // namespace bie_cuda
