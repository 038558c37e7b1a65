/* Functions the C side of the library calls into the CUDA backend (or its stubs). */
#ifndef BIE_CUDA_INTERNAL_H
#define BIE_CUDA_INTERNAL_H

#include "../core/formats.h"
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
/* Scratch memory of one call, stream-ordered on the current stream (the pool's memory is reused
 * by later calls; capturable in a CUDA graph); bie_cuda_scratch_free (NULL ignored) after the
 * call's last use of it, in stream order. */
bie_status bie_cuda_scratch_alloc(void **p, size_t bytes, const char *what);
void bie_cuda_scratch_free(void *p);

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
/* Whether an n x k weight has the shape of bie_cuda_pack_weight_signs (k % 2048 == 0,
 * n % 16 == 0). */
bool bie_cuda_weight_signs_shape(int64_t n, int64_t k);
/* bie_cuda_pack_weight of an int8 weight (16-byte aligned; ld == k / 8, the layout without
 * padding, as bie_cuda_weight_signs_shape gives) and, in the same pass, its ±1 values
 * transposed [k][n] (16-byte aligned): es == 2, in dtype (bf16 / f16: the exact backward's
 * grad_x operand), es == 1, e4m3 (the FP8 backward's); bie_cuda_bl_backward_args.wsignt. */
bie_status bie_cuda_pack_weight_signs(const int8_t *w, int64_t n, int64_t k, int64_t ld,
                                      uint8_t *bits, int *popc, int es, bie_dtype dtype,
                                      void *signs_t);
/* The bytes a value of the ±1 weight that a training forward of a dtype binary linear layer
 * should write for its backward (fp8: BIE_BACKWARD_FP8) with bie_cuda_pack_weight_signs from
 * its int8 weight w (rows of ld bytes): 2 for the exact backward on the fused kernels, 1 (e4m3)
 * for the FP8 backward on an FP8 device, 0 for none (no int8 weight, or w or ld not as
 * bie_cuda_pack_weight_signs needs them; and until timed on a GPU unless
 * BIE_CUDA_LINEAR_WSIGNS=1: by default the backward makes it from the bits). */
int bie_cuda_weight_signs_bytes(bie_dtype dtype, const int8_t *w, int64_t n, int64_t k, int64_t ld,
                                bool fp8);
/* Rows of the user's packed format (src_stride bytes, garbage past k) into the layout. */
bie_status bie_cuda_repack_rows(const void *src, int64_t src_stride, int64_t rows, int64_t k,
                                int64_t ld, uint8_t *dst, int *popc);
/* out[m, k] = x + bias (broadcast over rows), in x's dtype. */
bie_status bie_cuda_add_bias(bie_dtype dtype, const void *x, int64_t m, int64_t k,
                             const float *bias, void *out);
/* out[n, c, hw] = x + bias[c] (NCHW planes), in x's dtype. */
bie_status bie_cuda_add_bias_planes(bie_dtype dtype, const void *x, int64_t n, int64_t c,
                                    int64_t hw, const float *bias, void *out);
/* sum |x| over n elements, deterministic; waits for the result. */
bie_status bie_cuda_abs_sum(bie_dtype dtype, const void *x, int64_t n, double *result);

/* Where a GEMM's [m, n] result goes when it is a convolution's output: row r is pixel
 * r % plane of image r / plane, column c is output channel c, stored NCHW (or NHWC: the
 * GEMM's own row-major layout); when corr is not NULL, the integer dot of a pixel of class
 * pix_class[pixel] gets corr[class * n + c] added first (class 0: nothing; the binary
 * convolution's zero-padding correction). */
typedef struct bie_cuda_conv_out {
    int64_t plane;        /* output pixels per image (OH * OW) */
    const int *pix_class; /* [plane] */
    const int *corr;      /* [classes, n] */
    int nhwc;             /* 1: NHWC output */
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
/* Whether binary kernel `id` can run rows of ld bytes (a multiple of 64): shared memory, and
 * its k block dividing ld. */
bool bie_cuda_bgemm_kernel_fits_ld(int id, int64_t ld);

/* ---- The device layout of 4-bit rows (q4gemm.cu, q4pack.cu): rows of
 * bie_cuda_q4_row_stride(k) bytes (a multiple of BIE_CUDA_Q4_ROW_ALIGN), k two's-complement
 * codes, code j in byte j / 2 (even j in the low nibble, SPEC §1), zero past k. */
#define BIE_CUDA_Q4_ROW_ALIGN 128
int64_t bie_cuda_q4_row_stride(int64_t k);
/* Rows of one int8 code a byte, for 4-bit kernel 211 (TMA loads): k rounded up to 128. */
int64_t bie_cuda_q4_i8_row_stride(int64_t k);
/* Whether an m x n x k product with kernel_id (-1: the default choice) runs best on int8 code
 * rows (kernel 211, bie_cuda_q4gemm_i8_launch): kernel 211 named, or the default choice at
 * sizes where it beats the 4-bit rows' kernels, on a device that runs it. */
bool bie_cuda_q4_i8_wanted(int kernel_id, int64_t m, int64_t n, int64_t k);
/* The 4-bit kernels, indexed 0..bie_cuda_q4_kernel_count()-1 (the registry functions above
 * list them after the binary ones). */
int bie_cuda_q4_kernel_count(void);
void bie_cuda_q4_kernel_describe(int index, bie_kernel_info *info);
int bie_cuda_q4_kernel_index(int id);
bool bie_cuda_q4_kernel_fits(int id, int64_t k);
/* codes = q4(x + bias, *scale_a) of x (f32/bf16/f16, [m, k]; bias f32 [k] or NULL), computed
 * exactly as the CPU layer does, in rows of ld bytes: the 4-bit layout, or with i8 one int8
 * code a byte (ld = bie_cuda_q4_i8_row_stride(k)). When mask is not NULL, also the backward's
 * state in the CPU layer's flat layout over the m * k inputs: clip bit i =
 * 1{-8 <= v_i / s <= 7} at byte i / 8, bit i % 8 (ceil(m k / 8) bytes) and resid[i] =
 * rint((rint(v_i / s) - v_i / s) * 254) inside the clip range, else 0 ([m * k] int8). */
bie_status bie_cuda_q4_pack_act(bie_dtype dtype, const void *x, int64_t m, int64_t k,
                                const float *bias, const float *scale_a, int64_t ld, bool i8,
                                uint8_t *codes, uint8_t *mask, int8_t *resid);
/* Whether a training forward of a dtype input with k columns can write its codes' values with
 * the codes (bie_cuda_q4_pack_act_values; 16-bit dtypes, k % 8 == 0): opt-in until timed on a
 * GPU (BIE_CUDA_Q4_XVALUES=1; by default the backward makes them from the codes). */
bool bie_cuda_q4_act_values_wanted(bie_dtype dtype, int64_t k);
/* bie_cuda_q4_pack_act with, where values is not NULL (then also mask and resid, resid 8-byte
 * and values 16-byte aligned, bie_cuda_q4_act_values_wanted), the codes' values in dtype [m, k]
 * (bie_cuda_q4l_backward_args.xval), written in the same pass. */
bie_status bie_cuda_q4_pack_act_values(bie_dtype dtype, const void *x, int64_t m, int64_t k,
                                       const float *bias, const float *scale_a, int64_t ld, bool i8,
                                       uint8_t *codes, uint8_t *mask, int8_t *resid, void *values);
/* codes = q4(w, *scale_w) of a float weight [n, k] (SPEC §4), rows as bie_cuda_q4_pack_act. */
bie_status bie_cuda_q4_pack_weight(const float *w, int64_t n, int64_t k, const float *scale_w,
                                   int64_t ld, bool i8, uint8_t *codes);
/* In a training forward where bie_cuda_q4_weight_values_wanted (the fused backward's shape,
 * w 16-byte aligned): the codes as bie_cuda_q4_pack_weight and, in the same pass, their values
 * transposed, valt [k][n] (dtype, a 16-bit one), which the backward's grad_x product takes
 * (bie_cuda_q4l_backward_args.wvalt). */
bool bie_cuda_q4_weight_values_wanted(bie_dtype dtype, const float *w, int64_t n, int64_t k);
bie_status bie_cuda_q4_pack_weight_values(const float *w, int64_t n, int64_t k,
                                          const float *scale_w, bool i8, bie_dtype dtype,
                                          uint8_t *codes, void *valt);
/* int8 codes in [-8, 7] (rows of `stride` elements; other values count modulo 16). */
bie_status bie_cuda_q4_pack_codes(const int8_t *src, int64_t stride, int64_t rows, int64_t k,
                                  int64_t ld, uint8_t *codes);
/* The user's nibble rows (ceil(k / 2) bytes each; the last high nibble of odd k ignored). */
bie_status bie_cuda_q4_repack_rows(const void *src, int64_t rows, int64_t k, int64_t ld,
                                   uint8_t *dst);
/* out[m, n] = (float)dot * scale over 4-bit layout rows, exact in int32 for k <= 2^24;
 * otherwise as bie_cuda_bgemm_launch (scale_a/scale_w, output dtype, conv, kernel_id < 0). */
bie_status bie_cuda_q4gemm_launch(int kernel_id, int64_t m, int64_t n, int64_t k, const uint8_t *a,
                                  const uint8_t *b, int64_t ld, float scale, const float *scale_a,
                                  const float *scale_w, bie_dtype out_dtype, void *out,
                                  const bie_cuda_conv_out *conv);
/* 4-bit kernel 211 on int8 code rows a [m][ld] and b [n][ld] (ld a multiple of 128 and >= k,
 * codes zero past k), the output as bie_cuda_q4gemm_launch; BIE_ERR_UNSUPPORTED on devices
 * that do not run it. */
bie_status bie_cuda_q4gemm_i8_launch(int64_t m, int64_t n, int64_t k, const int8_t *a,
                                     const int8_t *b, int64_t ld, float scale, const float *scale_a,
                                     const float *scale_w, bie_dtype out_dtype, void *out,
                                     const bie_cuda_conv_out *conv);

/* ---- Binary conv2d on the device (SPEC §3). Input signs (and clip-mask bits) are kept NHWC:
 * one row of cw = ceil(C / 32) 32-bit words per input pixel, channel c at word c / 32, bit
 * c % 32. GEMM rows (weights: one per output channel; im2col: one per output pixel) hold the
 * k * k taps in [i, j] order, each tap as the cw words of its pixel (channel bits past C are
 * zero in both operands, so the AND form's k is C k k). Taps outside the input are zero bits
 * (-1) in the im2col rows, and the epilogue adds back, per output channel, the sum over those
 * taps of sum_c sign(w) (class corrections, see bie_cuda_conv_out). */
static inline int64_t bie_cuda_conv_cw(const bie_conv_geom *g) { return (g->c + 31) / 32; }

/* signs (and mask when not NULL) [n h w][cw] of x (NCHW, f32/bf16/f16) + bias[c]; the mask
 * bit is -1 <= v / *scale_a <= 1; saved_scales as bie_cuda_pack_act. */
bie_status bie_cuda_conv_pack_input(bie_dtype dtype, const void *x, const bie_conv_geom *g,
                                    const float *bias, const float *scale_a, const float *scale_w,
                                    float *saved_scales, uint32_t *signs, uint32_t *mask);
/* The padding classes of a geometry (device arrays): class cy * nx + cx has valid taps i in
 * [ylim[2 cy], ylim[2 cy + 1]) and j in [xlim[2 cx], xlim[2 cx + 1]). */
typedef struct bie_cuda_conv_classes {
    const int *ylim, *xlim;
    int ny, nx;
} bie_cuda_conv_classes;
/* Weight rows [o][ld] in the tap layout with bie_cuda_popc_parts(ld) counts per row, and
 * tapsum [o][k k] = sum_c sign(w[o, c, tap]). src: int8 or f32 [o, c k k] (sign: >= 0), or
 * (dtype U8) rows of src_row_bytes bytes of packed bits in [c, i, j] order (the user format).
 * Where corr is not NULL, also the corrections of the classes `cls` (as
 * bie_cuda_conv_corrections), in the same kernel. */
bie_status bie_cuda_conv_pack_weight(bie_dtype dtype, const void *src, int64_t src_row_bytes,
                                     const bie_conv_geom *g, int64_t ld, uint8_t *bits, int *popc,
                                     int *tapsum, const bie_cuda_conv_classes *cls, int *corr);
/* Bit im2col: row r = output pixel r (over all images) [n oh ow][ld], one popcount per row. */
bie_status bie_cuda_conv_im2col(const uint32_t *signs, const bie_conv_geom *g, int64_t ld,
                                uint8_t *cols, int *popc);
/* corr [ny nx][o]: for each class of `cls`, the sum of tapsum over the taps outside its
 * valid ranges. */
bie_status bie_cuda_conv_corrections(const int *tapsum, const bie_conv_geom *g,
                                     const bie_cuda_conv_classes *cls, int *corr);

/* The implicit-GEMM forward (no im2col pass): the channel-tile width it runs with for this
 * shape (with `classes` padding classes) on the current device (256, 128 or 64), or 0 when
 * the weight rows do not fit in shared memory (then use bie_cuda_conv_im2col +
 * bie_cuda_bgemm_launch). wbits/wpopc/ld as bie_cuda_conv_pack_weight wrote them; the output and
 * scales as bie_cuda_bgemm_launch. */
int bie_cuda_conv_implicit_bn(const bie_conv_geom *g, int classes);
bie_status bie_cuda_conv_implicit(const uint32_t *signs, const bie_conv_geom *g,
                                  const uint8_t *wbits, int64_t ld, const int *wpopc, int bn,
                                  int classes, const float *scale_a, const float *scale_w,
                                  bie_dtype out_dtype, void *out, const bie_cuda_conv_out *conv);

/* The fused kernel's weight image (the weight rows and their column terms in its shared
 * memory layout, per block of bn output channels), owned by the layer: built by
 * bie_cuda_conv_fused when !valid or the plan's bn differs; the layer clears valid whenever
 * the packed weight or the corrections change and frees data with cudaFree. Zero it first. */
typedef struct bie_cuda_fused_image {
    void *data;
    size_t cap; /* bytes allocated */
    int bn;
    bool valid;
} bie_cuda_fused_image;

/* The inference forward in one kernel (the input's pack fused into the implicit GEMM;
 * conv_fused.cu) where it applies: ceil(C / 32) % 4 == 0 and the band's tiles fit in shared
 * memory. x, bias as bie_cuda_conv_pack_input (dtype is the input's and the output's), the
 * rest as bie_cuda_conv_implicit; img as above. *ran = false (and nothing launched) when it
 * does not apply. */
bie_status bie_cuda_conv_fused(bie_dtype dtype, const void *x, const bie_conv_geom *g,
                               const float *bias, const uint8_t *wbits, int64_t ld,
                               const int *wpopc, int classes, const float *scale_a,
                               const float *scale_w, void *out, const bie_cuda_conv_out *conv,
                               bie_cuda_fused_image *img, bool *ran);
/* For the tests: plans of the fused kernel limited to bn channels (64, 128 or 256) and bands
 * of bp pixels (a multiple of 32 or of the output width, at most 2048); 0 lifts a limit. Where
 * no such plan fits, the two-kernel path runs. Process-wide: set it before the calls it is for. */
void bie_cuda_conv_fused_force_plan(int bn, int bp);
/* For the tests: the plan of the last bie_cuda_conv_fused call (0, 0 when it did not run). */
void bie_cuda_conv_fused_last_plan(int *bn, int *bp);

typedef struct bie_cuda_bconv_backward_args {
    bie_dtype dtype; /* of grad_out and grad_x */
    bie_conv_geom g;
    const void *grad_out; /* [n, o, oh, ow] */
    void *grad_x;         /* [n, c, h, w] or NULL */
    const uint8_t *wbits; /* the forward's weight rows (tap layout) */
    int64_t ld;
    const uint32_t *signs, *mask; /* the forward's NHWC bits */
    const float *saved_scales;    /* {scale_a, scale_w} of the forward */
    float *grad_w;                /* [o, c k k] f32 */
    int8_t *grad_w_i8;            /* or NULL */
    float *grad_bias;             /* [c] */
    float *grad_scale_a;          /* [1] */
    /* BIE_BACKWARD_FP8: grad_x (and the grad_bias / grad_scale_a sums over it) from grad_out
     * rounded to e4m3 at the per-tensor scale 448 / amax, on e4m3 tensor cores, where the TMA
     * grad_x kernel takes the layer (16-bit, channels-last, Hopper); grad_w stays exact. */
    bool fp8;
} bie_cuda_bconv_backward_args;
bie_status bie_cuda_binary_conv2d_backward(const bie_cuda_bconv_backward_args *args);
/* For the tests: the 16-bit binary conv backward through the cuBLAS GEMMs over im2col
 * buffers (the path float32 takes) instead of the tensor-core kernels. Process-wide. */
void bie_cuda_conv_backward_force_gemm(bool on);
/* For the tests: whether the binary conv2d backward of a layer of this dtype and geometry runs
 * grad_x on e4m3 in BIE_BACKWARD_FP8 mode (the TMA grad_x kernel takes it; else exact). */
bool bie_cuda_conv_fp8_grad_x(bie_dtype dtype, const bie_conv_geom *g);

/* ---- Binary linear backward on the device (SPEC §2); see backward.cu. */
typedef struct bie_cuda_bl_backward_args {
    bie_dtype dtype; /* of grad_out and grad_x */
    int64_t m, n, k, ld;
    const void *grad_out;        /* [m, n] */
    void *grad_x;                /* [m, k] or NULL */
    const uint8_t *wbits;        /* the forward's weight sign bits (layout rows) */
    const void *wsignt;          /* the forward's ±1 weight transposed [k][n], or NULL */
    int wsignt_bytes;            /* its values: 2 (dtype), 1 (e4m3) */
    const uint8_t *signs, *mask; /* saved activation bits (layout rows) */
    const float *saved_scales;   /* {scale_a, scale_w} of the forward */
    float *grad_w;               /* [n, k] f32 */
    int8_t *grad_w_i8;           /* [n, k] or NULL */
    float *grad_bias;            /* [k] */
    float *grad_scale_a;         /* [1] */
    bool fp8;                    /* BIE_BACKWARD_FP8: the products on e4m3 where they apply */
} bie_cuda_bl_backward_args;
bie_status bie_cuda_binary_linear_backward(const bie_cuda_bl_backward_args *args);
/* Whether CUDA device `device` has FP8 tensor cores (compute capability 8.9 or newer). */
bool bie_cuda_fp8_usable(int device);

/* ---- 4-bit linear backward on the device (SPEC §4); see q4backward.cu. */
typedef struct bie_cuda_q4l_backward_args {
    bie_dtype dtype; /* of grad_out and grad_x */
    int64_t m, n, k, ld;
    bool i8;                   /* codes in int8 rows of ld bytes (else 4-bit layout rows) */
    const void *grad_out;      /* [m, n] */
    void *grad_x;              /* [m, k] or NULL */
    const uint8_t *wcodes;     /* the forward's weight codes */
    const uint8_t *xcodes;     /* the forward's activation codes */
    const void *wvalt;         /* the weight's values transposed [k][n], or NULL */
    const void *xval;          /* the activation codes' values [m, k] (dtype), or NULL */
    const uint8_t *mask;       /* clip bits, flat over m k (bie_cuda_q4_pack_act) */
    const int8_t *resid;       /* rounding residuals * 254, flat over m k */
    const float *saved_scales; /* {scale_a, scale_w} of the forward */
    float *grad_w;             /* [n, k] f32 */
    float *grad_bias;          /* [k] */
    float *grad_scale_a;       /* [1] */
} bie_cuda_q4l_backward_args;
bie_status bie_cuda_q4_linear_backward(const bie_cuda_q4l_backward_args *args);

/* ---- 4-bit conv2d on the device (SPEC §4; q4conv.cu, q4backward.cu). The input's codes are
 * kept flat over N C H W as nibbles (code i in byte i / 2, even i low; ceil(N C H W / 8) * 4
 * bytes), with the clip bits and residuals in the layout of bie_cuda_q4_pack_act (flat over
 * N C H W, bias of channel c on plane c). GEMM rows: one per output pixel, the C k k taps in
 * [c, i, j] order (the weight's own order), code 0 for taps outside the input. */
bie_status bie_cuda_q4_conv_encode(bie_dtype dtype, const void *x, const bie_conv_geom *g,
                                   const float *bias, const float *scale_a, uint8_t *codes,
                                   uint8_t *mask, int8_t *resid);
/* cols [n oh ow][ld] 4-bit layout rows (ld = bie_cuda_q4_row_stride(C k k)). */
bie_status bie_cuda_q4_conv_im2col(const uint8_t *codes, const bie_conv_geom *g, int64_t ld,
                                   uint8_t *cols);

/* The implicit-GEMM forward (no im2col): the input's codes NHWC, each pixel's C codes as
 * nibbles padded with code 0 to cb = bie_cuda_q4_conv_cb(C) bytes (a multiple of 64), and
 * the weight rows [o][k k cb] in tap order ([i, j], then the channels). */
int64_t bie_cuda_q4_conv_cb(int64_t c);
/* With mask and resid (a training forward that keeps its backward state NHWC, see
 * bie_cuda_q4_conv_nhwc_state): also the clip bits, [n h w][cp / 8] bytes (cp = C rounded up
 * to a multiple of 64; channel c at bit c % 8 of byte c / 8), and the residuals, [n h w][cp],
 * 0 past C. */
bie_status bie_cuda_q4_conv_encode_nhwc(bie_dtype dtype, const void *x, const bie_conv_geom *g,
                                        const float *bias, const float *scale_a, uint8_t *codes,
                                        uint8_t *mask, int8_t *resid);
/* Whether a training forward of this layer keeps its backward state NHWC (the implicit
 * GEMM's codes, with bie_cuda_q4_conv_encode_nhwc's clip bits and residuals): where the
 * backward runs on the TMA implicit GEMMs, which read only that state. */
bool bie_cuda_q4_conv_nhwc_state(bie_dtype dtype, const bie_conv_geom *g);
/* Weight rows of the GEMM layout ([c, i, j] codes, `ld` bytes) to the tap layout. */
bie_status bie_cuda_q4_conv_weight_taps(const uint8_t *wcodes, int64_t ld, const bie_conv_geom *g,
                                        uint8_t *taps);
/* Both weight layouts from the float weight [o, c k k] in one pass: codes q4(w, *scale_w)
 * in the GEMM layout (as bie_cuda_q4_pack_weight) and in the tap layout. */
bie_status bie_cuda_q4_conv_pack_weight(const float *w, const bie_conv_geom *g,
                                        const float *scale_w, int64_t ld, uint8_t *codes,
                                        uint8_t *taps);
/* out (NCHW, out_dtype) = scale_a scale_w (codes * taps); variant: the tile shape, an index
 * of q4gemm.cu's q4_conv_kernels (< 0: the default for the shape). */
bie_status bie_cuda_q4conv_implicit(int variant, const uint8_t *codes, const bie_conv_geom *g,
                                    const uint8_t *wtaps, const float *scale_a,
                                    const float *scale_w, bie_dtype out_dtype, void *out);

typedef struct bie_cuda_q4conv_backward_args {
    bie_dtype dtype; /* of grad_out and grad_x */
    bie_conv_geom g;
    const void *grad_out;  /* [n, o, oh, ow] */
    void *grad_x;          /* [n, c, h, w] or NULL */
    const uint8_t *wcodes; /* the forward's weight codes (4-bit layout rows [o][ld]) */
    int64_t ld;
    /* The forward's input state: flat over n c h w (codes, clip bits and residuals of
     * bie_cuda_q4_conv_encode), or where nhwc_state, bie_cuda_q4_conv_encode_nhwc's. */
    int nhwc_state;
    const uint8_t *codes;      /* input codes */
    const uint8_t *mask;       /* clip bits */
    const int8_t *resid;       /* rounding residuals * 254 */
    const float *saved_scales; /* {scale_a, scale_w} of the forward */
    float *grad_w;             /* [o, c k k] f32 */
    float *grad_bias;          /* [c] */
    float *grad_scale_a;       /* [1] */
} bie_cuda_q4conv_backward_args;
bie_status bie_cuda_q4_conv2d_backward(const bie_cuda_q4conv_backward_args *args);

/* ---- Batch norm, residual add and PReLU fused (bie.h §7; checked by layers/bn_act.c).
 * y, res, out, grad_*: [outer][c][inner] of dtype; every other pointer float32 [c] (slope [1]
 * when slope_shared); NULL where bie_bn_act_params allows it. */
typedef struct bie_cuda_bn_act {
    int device;
    bie_dtype dtype;
    int64_t outer, c, inner;
    const float *gamma, *beta, *slope;
    bool slope_shared;
    float *running_mean, *running_var;
    float eps, momentum;
    bool training;
} bie_cuda_bn_act;
bie_status bie_cuda_bn_act_forward(const bie_cuda_bn_act *a, const void *y, const void *res,
                                   float *save_mean, float *save_rstd, void *out);
bie_status bie_cuda_bn_act_backward(const bie_cuda_bn_act *a, const void *grad_out, const void *y,
                                    const void *res, const float *save_mean, const float *save_rstd,
                                    void *grad_y, void *grad_res, float *grad_gamma,
                                    float *grad_beta, float *grad_slope);

#ifdef __cplusplus
}
#endif
#endif
