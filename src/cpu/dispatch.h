/* CPU kernel registry and runtime ISA dispatch. */
#ifndef BIE_CPU_DISPATCH_H
#define BIE_CPU_DISPATCH_H

#include "bie.h"
#include "kernels/kernels.h"

enum { BIE_ISA_SCALAR = 0, BIE_ISA_GENERIC = 1, BIE_ISA_AVX2 = 2, BIE_ISA_AVX512 = 3 };

typedef struct bie_cpu_kernel {
    int id;
    const char *name;
    bie_op op;
    int isa;
    int64_t preferred_max_m;
    bie_row_popc_fn rows;        /* row kernel, or NULL */
    const bie_tile_kernel *tile; /* tile micro-kernel, or NULL */
} bie_cpu_kernel;

/* Registered CPU kernel with this id, or NULL. */
const bie_cpu_kernel *bie_cpu_kernel_by_id(int id);
/* Whether this process may run the kernel (CPU features, BIE_CPU_KERNELS cap). */
bool bie_cpu_kernel_available(const bie_cpu_kernel *k);
/* Default binary GEMM kernel for m rows: the best available ISA, its row kernel for small m. */
const bie_cpu_kernel *bie_cpu_default_kernel(int64_t m);
/* Default kernel of an op for m rows. */
const bie_cpu_kernel *bie_cpu_default_kernel_for(bie_op op, int64_t m);
/* Number of CPU kernels and the i-th one. */
int bie_cpu_kernel_count(void);
const bie_cpu_kernel *bie_cpu_kernel_at(int i);

/* Row packing functions of the active ISA. */
typedef struct bie_cpu_pack_kernels {
    bie_pack_f32_row_fn f32;
    bie_pack_i8_row_fn i8;
    bie_q4_quantize_fn q4;
} bie_cpu_pack_kernels;
bie_cpu_pack_kernels bie_cpu_pack(void);

/* Kernel for a call: the default of `op` for m rows when kernel_id < 0, else that kernel,
 * which must exist, compute `op` and be available. */
bie_status bie_cpu_kernel_for_call(bie_op op, int kernel_id, int64_t m, const char *who,
                                   const bie_cpu_kernel **out);

/* The frame: out[i * n + j] = (float)(k - 2 popc(a_i ^ b_j)) * scale, all checks done. */
bie_status bie_cpu_bgemm(const bie_cpu_kernel *kern, int64_t m, int64_t n, int64_t k,
                         const uint8_t *a, int64_t lda, const uint8_t *b, int64_t ldb, float scale,
                         float *out);

/* Weight-side panels packed once for a tile kernel, reused across calls (inference). */
typedef struct bie_packed_b {
    const bie_cpu_kernel *kern;
    int64_t n, k;
    uint8_t *panels; /* NULL for row kernels (they read rows in place) */
} bie_packed_b;
bie_status bie_cpu_pack_b(const bie_cpu_kernel *kern, int64_t n, int64_t k, const uint8_t *b,
                          int64_t ldb, bie_packed_b *out);
void bie_cpu_packed_b_free(bie_packed_b *p);
bool bie_cpu_packed_b_fits(const bie_packed_b *p, const bie_cpu_kernel *kern, int64_t n, int64_t k);
/* The frame with B already packed (tile kernels only). */
bie_status bie_cpu_bgemm_packed(const bie_cpu_kernel *kern, int64_t m, const uint8_t *a,
                                int64_t lda, const bie_packed_b *b, float scale, float *out);

#endif
