/* The one place that knows which CPU kernels exist. To add a kernel: implement it under
 * kernels/<isa>/, declare it in kernels/kernels.h, add one line to the table below. */
#include "dispatch.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "../core/device.h"
#include "../core/internal.h"

#define ANY_M INT64_MAX

static const bie_cpu_kernel kernels[] = {
    {0, "cpu.scalar.bgemm_ref", BIE_OP_BINARY_GEMM, BIE_ISA_SCALAR, ANY_M, bie_row_popc_ref, NULL},
    {1, "cpu.generic.bgemv", BIE_OP_BINARY_GEMM, BIE_ISA_GENERIC, 4, bie_row_popc_generic, NULL},
    {2, "cpu.generic.bgemm_4x4", BIE_OP_BINARY_GEMM, BIE_ISA_GENERIC, ANY_M, NULL,
     &bie_tile_generic_4x4},
    {20, "cpu.generic.q4gemm_4x4", BIE_OP_Q4_GEMM, BIE_ISA_SCALAR, ANY_M, NULL,
     &bie_i8tile_generic_4x4},
#ifdef BIE_HAVE_X86_KERNELS
    {3, "cpu.avx2.bgemv", BIE_OP_BINARY_GEMM, BIE_ISA_AVX2, 4, bie_row_popc_avx2, NULL},
    {4, "cpu.avx2.bgemm_4x2", BIE_OP_BINARY_GEMM, BIE_ISA_AVX2, ANY_M, NULL, &bie_tile_avx2_4x2},
    {5, "cpu.avx2.bgemm_3x3", BIE_OP_BINARY_GEMM, BIE_ISA_AVX2, ANY_M, NULL, &bie_tile_avx2_3x3},
    {21, "cpu.avx2.q4gemm_3x2", BIE_OP_Q4_GEMM, BIE_ISA_AVX2, ANY_M, NULL, &bie_i8tile_avx2_3x2},
    {6, "cpu.avx512.bgemv", BIE_OP_BINARY_GEMM, BIE_ISA_AVX512, 4, bie_row_popc_avx512, NULL},
    /* 4x4 (horizontal sums) wins at m = 64, the 6x32 outer product at m = 2048 (BENCHMARKS.md) */
    {7, "cpu.avx512.bgemm_4x4", BIE_OP_BINARY_GEMM, BIE_ISA_AVX512, 128, NULL,
     &bie_tile_avx512_4x4},
    {8, "cpu.avx512.bgemm_6x32", BIE_OP_BINARY_GEMM, BIE_ISA_AVX512, ANY_M, NULL,
     &bie_tile_avx512_6x32},
    {22, "cpu.avx512.q4gemm_vnni_6x32", BIE_OP_Q4_GEMM, BIE_ISA_AVX512, ANY_M, NULL,
     &bie_i8tile_vnni_6x32},
#endif
};
#define NKERNELS ((int)(sizeof kernels / sizeof kernels[0]))

static const char *isa_names[] = {"scalar", "generic", "avx2", "avx512"};

static int detect_isa(void) {
#if defined(BIE_HAVE_X86_KERNELS)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vpopcntdq") && __builtin_cpu_supports("avx512vnni"))
        return BIE_ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt")) return BIE_ISA_AVX2;
#endif
    return BIE_ISA_GENERIC;
}

/* Highest ISA used: the CPU's, capped by BIE_CPU_KERNELS=scalar|generic|avx2|avx512.
 * Computed once; a racing first call computes the same value. */
static int active_isa(void) {
    static atomic_int cached = -1;
    int v = atomic_load(&cached);
    if (v >= 0) return v;
    v = detect_isa();
    const char *env = getenv("BIE_CPU_KERNELS");
    if (env && *env) {
        for (int i = 0; i < 4; i++)
            if (strcmp(env, isa_names[i]) == 0 && i < v) v = i;
    }
    atomic_store(&cached, v);
    return v;
}

const char *bie_cpu_kernel_set(void) { return isa_names[active_isa()]; }

const bie_cpu_kernel *bie_cpu_kernel_by_id(int id) {
    for (int i = 0; i < NKERNELS; i++)
        if (kernels[i].id == id) return &kernels[i];
    return NULL;
}

bool bie_cpu_kernel_available(const bie_cpu_kernel *k) { return k && k->isa <= active_isa(); }

const bie_cpu_kernel *bie_cpu_default_kernel_for(bie_op op, int64_t m) {
    int isa = active_isa();
    const bie_cpu_kernel *best = NULL;
    for (int i = 0; i < NKERNELS; i++) { /* the best ISA; among its kernels the tightest m range */
        const bie_cpu_kernel *k = &kernels[i];
        if (k->op != op || k->isa > isa || m > k->preferred_max_m) continue;
        if (best == NULL || k->isa > best->isa ||
            (k->isa == best->isa && k->preferred_max_m < best->preferred_max_m))
            best = k;
    }
    return best;
}

const bie_cpu_kernel *bie_cpu_default_kernel(int64_t m) {
    return bie_cpu_default_kernel_for(BIE_OP_BINARY_GEMM, m);
}

bie_cpu_pack_kernels bie_cpu_pack(void) {
    bie_cpu_pack_kernels p = {bie_pack_f32_row_generic, bie_pack_i8_row_generic,
                              bie_q4_quantize_generic};
#ifdef BIE_HAVE_X86_KERNELS
    if (active_isa() >= BIE_ISA_AVX2) {
        p.f32 = bie_pack_f32_row_avx2;
        p.i8 = bie_pack_i8_row_avx2;
        p.q4 = bie_q4_quantize_avx2;
    }
#endif
    return p;
}

int bie_cpu_kernel_count(void) { return NKERNELS; }
const bie_cpu_kernel *bie_cpu_kernel_at(int i) {
    return i >= 0 && i < NKERNELS ? &kernels[i] : NULL;
}

/* ---- public registry (CPU kernels; a CUDA build appends its own) */

static void describe(const bie_cpu_kernel *k, bie_kernel_info *info) {
    info->id = k->id;
    info->name = k->name;
    info->isa = isa_names[k->isa];
    info->op = k->op;
    info->device = BIE_DEVICE_CPU;
    info->preferred_max_m = k->preferred_max_m;
    info->available = bie_cpu_kernel_available(k);
}

/* Position i < NKERNELS: CPU kernels; then each registered device's, in registry order. */
int bie_kernel_count(void) {
    int n = NKERNELS;
    for (int i = 0; i < bie_device_count(); i++) n += bie_device_at(i)->kernel_count();
    return n;
}

bie_status bie_kernel_get(int index, bie_kernel_info *info) {
    BIE_CHECK_NULL(info);
    if (index < 0 || index >= bie_kernel_count())
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "bie_kernel_get: index %d outside 0..%d", index,
                        bie_kernel_count() - 1);
    if (index < NKERNELS) {
        describe(&kernels[index], info);
        return BIE_OK;
    }
    index -= NKERNELS;
    for (int i = 0; i < bie_device_count(); i++) {
        const bie_device_iface *dev = bie_device_at(i);
        if (index < dev->kernel_count()) {
            dev->kernel_describe(index, info);
            break;
        }
        index -= dev->kernel_count();
    }
    return BIE_OK;
}

bie_status bie_kernel_find(int id, bie_kernel_info *info) {
    BIE_CHECK_NULL(info);
    const bie_cpu_kernel *k = bie_cpu_kernel_by_id(id);
    if (k != NULL) {
        describe(k, info);
        return BIE_OK;
    }
    for (int i = 0; i < bie_device_count(); i++) {
        const bie_device_iface *dev = bie_device_at(i);
        const int at = dev->kernel_index(id);
        if (at >= 0) {
            dev->kernel_describe(at, info);
            return BIE_OK;
        }
    }
    return bie_fail(BIE_ERR_INVALID_ARGUMENT, "no kernel with id %d", id);
}

bie_status bie_kernel_default(bie_op op, int64_t m, bie_kernel_info *info) {
    BIE_CHECK_NULL(info);
    if (m < 1) return bie_fail(BIE_ERR_SHAPE, "bie_kernel_default: m must be >= 1");
    const bie_cpu_kernel *k = bie_cpu_default_kernel_for(op, m);
    if (k == NULL)
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "bie_kernel_default: unknown op %d", (int)op);
    describe(k, info);
    return BIE_OK;
}
