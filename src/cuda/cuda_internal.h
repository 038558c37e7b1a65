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
/* The calling thread's current stream (cudaStream_t; NULL = the default stream). */
void *bie_cuda_current_stream(void);
/* cudaFree for bie_tensor_free; ignores NULL. */
void bie_cuda_free_ptr(void *p);

/* ---- The device GEMM layout of packed binary rows: rows of bie_cuda_row_stride(k) bytes
 * (a multiple of BIE_CUDA_ROW_ALIGN, so every kernel's k block divides it), bit j of a row at
 * byte j / 8, bit j % 8, zero past k; each row's popcount kept as partial counts
 * [rows][parts]: bie_cuda_popc_parts(ld) of them (one per 8192-bit slice), or for the
 * activations packed by bie_cuda_pack_act, bie_cuda_act_popc_parts(m, ld) (one per 1024-bit
 * slice when m <= 16, so that short inputs are packed by many blocks). Every launcher below
 * runs asynchronously on the calling thread's current stream. */
#define BIE_CUDA_ROW_ALIGN 256
int64_t bie_cuda_row_stride(int64_t k);
int bie_cuda_popc_parts(int64_t ld);
int bie_cuda_act_popc_parts(int64_t m, int64_t ld);

/* x (f32/bf16/f16, [m, k]) + bias (f32 [k]) into sign bits, and clip-mask bits
 * (-1 <= v / *scale_a <= 1) when mask is not NULL; saved_scales (when not NULL) receives
 * {*scale_a, *scale_w}. */
bie_status bie_cuda_pack_act(bie_dtype dtype, const void *x, int64_t m, int64_t k,
                             const float *bias, const float *scale_a, const float *scale_w,
                             float *saved_scales, int64_t ld, uint8_t *bits, uint8_t *mask,
                             int *popc);
/* Sign bits (w >= 0) of an int8 or float weight [n, k]. */
bie_status bie_cuda_pack_weight(bie_dtype dtype, const void *w, int64_t n, int64_t k, int64_t ld,
                                uint8_t *bits, int *popc);
/* Rows of the user's packed format (src_stride bytes, garbage past k) into the layout. */
bie_status bie_cuda_repack_rows(const void *src, int64_t src_stride, int64_t rows, int64_t k,
                                int64_t ld, uint8_t *dst, int *popc);
/* out[m, k] = x + bias (broadcast over rows), in x's dtype. */
bie_status bie_cuda_add_bias(bie_dtype dtype, const void *x, int64_t m, int64_t k,
                             const float *bias, void *out);
/* sum |x| over n elements, deterministic; waits for the result. */
bie_status bie_cuda_abs_sum(bie_dtype dtype, const void *x, int64_t n, double *result);

/* Where a GEMM's [m, n] result goes when it is a convolution's output: row r is pixel
 * r % plane of image r / plane, column c is output channel c, stored NCHW; when corr is not
 * NULL, the integer dot of a pixel of class pix_class[pixel] gets corr[class * n + c] added
 * first (class 0: nothing; the binary convolution's zero-padding correction). */
typedef struct bie_cuda_conv_out {
    int64_t plane;        /* output pixels per image (OH * OW) */
    const int *pix_class; /* [plane] */
    const int *corr;      /* [classes, n] */
} bie_cuda_conv_out;

/* out[m, n] (f32/bf16/f16) = (float)dot * scale (pa has parts_a counts per row, pb
 * bie_cuda_popc_parts(ld)), with scale = *scale_a * *scale_w when scale_a is not NULL, else
 * `scale`; row-major, or a convolution's output when conv is not NULL. k is the number of
 * valid bit positions (the AND form's k); the kernels run over the whole ld bytes of every
 * row, whose bits past the valid ones are zero in both operands. kernel_id < 0: the default
 * for the shape. */
bie_status bie_cuda_bgemm_launch(int kernel_id, int64_t m, int64_t n, int64_t k, const uint8_t *a,
                                 const uint8_t *b, int64_t ld, const int *pa, int parts_a,
                                 const int *pb, float scale, const float *scale_a,
                                 const float *scale_w, bie_dtype out_dtype, void *out,
                                 const bie_cuda_conv_out *conv);
/* Whether kernel `id` can run rows of k bits (shared-memory limits). */
bool bie_cuda_kernel_fits(int id, int64_t k);

/* ---- Binary linear backward on the device (SPEC §2); see backward.cu. */
typedef struct bie_cuda_bl_backward_args {
    bie_dtype dtype;                /* of grad_out and grad_x */
    int64_t m, n, k, ld;
    const void *grad_out;           /* [m, n] */
    void *grad_x;                   /* [m, k] or NULL */
    const uint8_t *wbits;           /* the forward's weight sign bits (layout rows) */
    const uint8_t *signs, *mask;    /* saved activation bits (layout rows) */
    const float *saved_scales;      /* {scale_a, scale_w} of the forward */
    float *grad_w;                  /* [n, k] f32 */
    int8_t *grad_w_i8;              /* [n, k] or NULL */
    float *grad_bias;               /* [k] */
    float *grad_scale_a;            /* [1] */
} bie_cuda_bl_backward_args;
bie_status bie_cuda_binary_linear_backward(const bie_cuda_bl_backward_args *args);

#ifdef __cplusplus
}
#endif
#endif
