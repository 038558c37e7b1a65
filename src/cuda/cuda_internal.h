/* Functions the C side of the library calls into the CUDA backend (or its stubs). */
#ifndef BIE_CUDA_INTERNAL_H
#define BIE_CUDA_INTERNAL_H

#include "bie.h"

#ifdef __cplusplus
extern "C" {
#endif

/* CUDA kernels in the public registry. */
int bie_cuda_kernel_count_internal(void);
void bie_cuda_kernel_describe(int index, bie_kernel_info *info);
/* Index of the CUDA kernel with this id, or -1. */
int bie_cuda_kernel_index(int id);
/* cudaFree for bie_tensor_free; ignores NULL. */
void bie_cuda_free_ptr(void *p);

#ifdef __cplusplus
}
#endif
#endif
