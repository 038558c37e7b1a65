/*
 * bie — low-bit (1-bit and 4-bit) neural-network layers in C.
 *
 * One public header, ordered from simple to advanced:
 *   1. status codes and the per-thread error message
 *   2. devices, dtypes and the tensor descriptor
 *   3. threads and library information
 *   4. bit-packing (sign bits, SPEC §1)
 *   5. the kernel registry
 *   6. the binary linear layer (seed classes BinaryLinearBase, BinaryLinearCutlass,
 *      BinaryLinearForward)
 *
 * Rules that hold for every function below:
 *   - every function returns a bie_status (BIE_OK on success) unless documented otherwise;
 *   - on error, a message is available from bie_last_error() in the calling thread, and the
 *     outputs and the layer's state are left exactly as they were;
 *   - the library never aborts or exits on bad input;
 *   - distinct layers may be used from different threads at once; one layer is used by one
 *     thread at a time.
 */
#ifndef BIE_H
#define BIE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define BIE_API __declspec(dllexport)
#else
#define BIE_API __attribute__((visibility("default")))
#endif

#define BIE_VERSION_MAJOR 0
#define BIE_VERSION_MINOR 1
#define BIE_VERSION_PATCH 0

/* ---------------------------------------------------------------- 1. status */

typedef enum bie_status {
    BIE_OK = 0,
    BIE_ERR_NULL_POINTER = 1,     /* a required pointer argument was NULL */
    BIE_ERR_INVALID_ARGUMENT = 2, /* a value out of its allowed range */
    BIE_ERR_SHAPE = 3,            /* tensor rank or extents do not match */
    BIE_ERR_DTYPE = 4,            /* tensor dtype not accepted here */
    BIE_ERR_DEVICE = 5,           /* tensor on the wrong device, or device not available */
    BIE_ERR_UNSUPPORTED = 6,      /* valid request this build or CPU cannot run */
    BIE_ERR_STATE = 7,            /* call not allowed in the layer's current state */
    BIE_ERR_OUT_OF_MEMORY = 8,
    BIE_ERR_OVERFLOW = 9, /* sizes whose products overflow the library's index types */
    BIE_ERR_NOT_FINITE = 10, /* a scale or value that must be finite and non-zero is not */
    BIE_ERR_IO = 11,
    BIE_ERR_CUDA = 12,
    BIE_ERR_INTERNAL = 13
} bie_status;

/* Short constant name of a status ("BIE_ERR_SHAPE"); never NULL. */
BIE_API const char *bie_status_name(bie_status status);

/* Message of the last error raised in the calling thread ("" if none). The pointer stays
 * valid until the next failing call in this thread. */
BIE_API const char *bie_last_error(void);

/* ------------------------------------------------------ 2. devices and tensors */

typedef enum bie_device_type { BIE_DEVICE_CPU = 0, BIE_DEVICE_CUDA = 1 } bie_device_type;

typedef struct bie_device {
    bie_device_type type;
    int index; /* CUDA device ordinal; 0 for the CPU */
} bie_device;

BIE_API bie_device bie_cpu(void);

typedef enum bie_dtype {
    BIE_F32 = 0,
    BIE_BF16 = 1, /* accepted on CUDA only */
    BIE_F16 = 2,  /* accepted on CUDA only */
    BIE_I8 = 3,
    BIE_U8 = 4,  /* packed words of 8 bits */
    BIE_U32 = 5, /* packed words of 32 bits */
    BIE_U64 = 6, /* packed words of 64 bits */
    BIE_I32 = 7
} bie_dtype;

/* Size of one element in bytes (0 for an unknown dtype). */
BIE_API size_t bie_dtype_size(bie_dtype dtype);
BIE_API const char *bie_dtype_name(bie_dtype dtype);

#define BIE_MAX_DIMS 4

/* A row-major, contiguous tensor of up to 4 dimensions. The struct is plain data: a view of
 * caller memory is made with bie_tensor_view(); bie_tensor_alloc() makes an owning one that
 * bie_tensor_free() releases. Tensors returned by a layer (parameters, gradients) are views
 * of the layer's memory, valid until the layer changes that buffer or is freed. */
typedef struct bie_tensor {
    void *data;
    bie_dtype dtype;
    int ndim;                   /* 1..4 (0 = empty descriptor) */
    int64_t shape[BIE_MAX_DIMS]; /* extents; shape[ndim..] are ignored */
    bie_device device;
    bool owns_data; /* true: bie_tensor_free() releases data */
} bie_tensor;

/* Describe caller memory. Errors: NULL out, ndim outside 1..4, negative extents. */
BIE_API bie_status bie_tensor_view(bie_tensor *out, void *data, bie_dtype dtype, int ndim,
                                   const int64_t *shape);
/* Allocate an owning CPU tensor (64-byte aligned, zero-filled). */
BIE_API bie_status bie_tensor_alloc(bie_tensor *out, bie_dtype dtype, int ndim,
                                    const int64_t *shape);
/* Release an owning tensor's memory and clear the descriptor; NULL and views are fine. */
BIE_API void bie_tensor_free(bie_tensor *t);
/* Number of elements (product of the extents), or -1 if it overflows. */
BIE_API int64_t bie_tensor_numel(const bie_tensor *t);

/* ------------------------------------------------------- 3. threads, version */

/* Threads used by the library's CPU kernels (OpenMP) and by OpenBLAS; 0 = the default
 * (OMP_NUM_THREADS or the number of cores). Errors: n < 0. */
BIE_API bie_status bie_set_num_threads(int n);
BIE_API int bie_get_num_threads(void);

/* "major.minor.patch" */
BIE_API const char *bie_version_string(void);

/* ------------------------------------------------------------ 4. bit-packing */

/* Pack the signs of a [rows, cols] tensor (F32 or I8; any leading shape is flattened into
 * rows) into words of `word_bits` in {8, 32, 64}: element j of a row goes to word j / W,
 * bit j % W, least significant first; bit 1 means +1 (value >= 0), bit 0 means -1. The last
 * word of a row is padded with zero bits. dst must have dtype U8/U32/U64 matching
 * word_bits, the same leading extents and last extent ceil(cols / W).
 * Errors: NULL, bad word size, dtype or shape mismatch, non-CPU tensors. */
BIE_API bie_status bie_pack_signs(const bie_tensor *src, int word_bits, bie_tensor *dst);

/* Inverse of bie_pack_signs: writes ±1 into dst (F32 or I8) whose last extent `cols` says
 * how many bits of each packed row are valid. */
BIE_API bie_status bie_unpack_signs(const bie_tensor *src, int word_bits, bie_tensor *dst);

/* Words of `word_bits` needed for a row of `cols` elements: ceil(cols / word_bits). */
BIE_API int64_t bie_packed_words(int64_t cols, int word_bits);

/* ------------------------------------------------------- 5. the kernel registry */

typedef enum bie_op {
    BIE_OP_BINARY_GEMM = 0, /* ±1 bit rows, exact popcount dot products */
    BIE_OP_Q4_GEMM = 1      /* 4-bit codes (as int8 rows), exact int32 dot products */
} bie_op;

typedef struct bie_kernel_info {
    int id;              /* stable id, accepted by the layers' set_gemm_kernel */
    const char *name;    /* e.g. "cpu.avx2.bgemm_4x2" */
    const char *isa;     /* "scalar", "generic", "avx2", "avx512" */
    bie_op op;
    bie_device_type device;
    int64_t preferred_max_m; /* default choice only up to this m (INT64_MAX: any); every
                                kernel runs every shape */
    bool available;      /* this CPU has the ISA and BIE_CPU_KERNELS allows it */
} bie_kernel_info;

/* Number of registered kernels (available or not). */
BIE_API int bie_kernel_count(void);
/* Describe the kernel at position `index` (0..count-1). */
BIE_API bie_status bie_kernel_get(int index, bie_kernel_info *info);
/* Describe the kernel with this id. Errors: unknown id. */
BIE_API bie_status bie_kernel_find(int id, bie_kernel_info *info);
/* The CPU kernel the library uses for `op` on m rows when none is selected. */
BIE_API bie_status bie_kernel_default(bie_op op, int64_t m, bie_kernel_info *info);
/* The highest CPU kernel set this process uses: "scalar", "generic", "avx2" or "avx512",
 * i.e. what the CPU supports, capped by the environment variable BIE_CPU_KERNELS. */
BIE_API const char *bie_cpu_kernel_set(void);

/* Binary GEMM on the CPU on bit-packed rows (the layers' engine, exposed for benchmarks
 * and tests): out[i * n + j] = (float)dot(a_i, b_j) * scale, where a_i (m rows) and b_j
 * (n rows) are packed sign rows of k valid bits with the given row strides in bytes and
 * dot is the exact ±1 dot product. kernel_id < 0 picks the default kernel for the shape.
 * Errors: NULL, sizes < 1, strides shorter than ceil(k / 8) bytes, unknown or unavailable
 * kernel, non-finite scale. */
BIE_API bie_status bie_binary_gemm(int kernel_id, int64_t m, int64_t n, int64_t k,
                                   const void *a, int64_t a_row_bytes, const void *b,
                                   int64_t b_row_bytes, float scale, float *out);

/* 4-bit GEMM on the CPU: out[i * n + j] = (float)dot(a_i, b_j) * scale, a and b rows of
 * k int8 codes in [-8, 7] (4-bit values; see bie_q4_quantize) with the given row strides in
 * elements, dot exact in integers. kernel_id < 0 picks the default. Errors: as
 * bie_binary_gemm; k > 2^24. */
BIE_API bie_status bie_q4_gemm(int kernel_id, int64_t m, int64_t n, int64_t k, const int8_t *a,
                               int64_t lda, const int8_t *b, int64_t ldb, float scale, float *out);

/* ------------------------------------------------------ 6. binary linear layer */

/* Opaque handle: counterpart of BinaryLinearBase / BinaryLinearCutlass. */
typedef struct bie_binary_linear bie_binary_linear;

/* Parameters and buffers of a layer, for bie_*_param() and bie_*_grad(). */
typedef enum bie_param {
    BIE_PARAM_WEIGHT = 0,  /* [out, in] F32 before prepare_params, I8 after; absent after
                              generate_quantized_weight(qweight_only) */
    BIE_PARAM_QWEIGHT = 1, /* [out, ceil(in / W)] U8/U32/U64 packed signs, or absent */
    BIE_PARAM_BIAS_A = 2,  /* [in] F32 */
    BIE_PARAM_SCALE_A = 3, /* [1] F32 */
    BIE_PARAM_SCALE_W = 4, /* [1] F32 */
    BIE_PARAM_WEIGHT_FLOAT_GRAD = 5 /* grad only: the float gradient of the weight */
} bie_param;

/* Create a layer (BinaryLinearBase.__init__): weight [out_features, in_features] filled by
 * reset_parameters with seed 0, bias_a zeros, scale_a 0 (initialised by the first
 * set_activation), scale_w 1, bits_binary_word 8, training mode, default kernel.
 * Errors: NULL out, features < 1 or > 2^31 - 1, device not available, dtype not F32 on
 * the CPU. */
BIE_API bie_status bie_binary_linear_create(bie_binary_linear **out, int64_t in_features,
                                            int64_t out_features, bie_device device,
                                            bie_dtype dtype, bool symmetric);
/* Release the layer and everything it owns; NULL is fine. */
BIE_API void bie_binary_linear_free(bie_binary_linear *layer);

/* reset_parameters: Kaiming-uniform (a = sqrt(5)), i.e. uniform in ±1/sqrt(in_features),
 * from a generator seeded with `seed`. Makes the weight float again (drops int8/qweight). */
BIE_API bie_status bie_binary_linear_reset_parameters(bie_binary_linear *layer, uint64_t seed);

/* set_weight_data: copy w ([out, in], dtype = the layer's dtype) and call prepare_params.
 * Errors: NULL, dtype or shape mismatch, non-finite values. */
BIE_API bie_status bie_binary_linear_set_weight_data(bie_binary_linear *layer,
                                                     const bie_tensor *w);

/* prepare_params: scale_w = mean|w|; the weight becomes the int8 quantization of
 * w - mean(w), with zeros replaced by sign (SPEC §2). A layer whose weight is already int8
 * is left unchanged. Errors: weight absent (qweight_only). */
BIE_API bie_status bie_binary_linear_prepare_params(bie_binary_linear *layer);

/* generate_quantized_weight: pack sign(weight) into qweight; with qweight_only the
 * float/int8 weight is freed and the layer becomes inference-only. Errors: no weight. */
BIE_API bie_status bie_binary_linear_generate_quantized_weight(bie_binary_linear *layer,
                                                               bool qweight_only);

/* set_quantized_weight_data: install packed weights [out, ceil(in / W)] of dtype
 * U8/U32/U64 matching bits_binary_word (padding bits are ignored). */
BIE_API bie_status bie_binary_linear_set_quantized_weight_data(bie_binary_linear *layer,
                                                               const bie_tensor *q);

/* set_bits_binary_word: 8, 32 or 64; an existing qweight is re-laid out. */
BIE_API bie_status bie_binary_linear_set_bits_binary_word(bie_binary_linear *layer,
                                                          int bits);
BIE_API int bie_binary_linear_bits_binary_word(const bie_binary_linear *layer);

/* opt_weight: a view of the weight in training mode; in inference mode the packed weight,
 * generated on first use. */
BIE_API bie_status bie_binary_linear_opt_weight(bie_binary_linear *layer, bie_tensor *view);

/* _check_forward: x must be a CPU tensor whose last extent is in_features (F32) or
 * ceil(in_features / W) (pre-packed U8/U32/U64 matching W), with rank 1..4. */
BIE_API bie_status bie_binary_linear_check_forward(const bie_binary_linear *layer,
                                                   const bie_tensor *x);

/* set_activation: if scale_a == 0, set it to 2 mean|x| (symmetric) or 4 mean|x|; write
 * x + bias_a into x_out (same shape as x; may alias x). x_out may be NULL to initialise
 * scale_a only. Errors: check_forward's, x_out shape, an all-zero x (scale would be 0). */
BIE_API bie_status bie_binary_linear_set_activation(bie_binary_linear *layer,
                                                    const bie_tensor *x, bie_tensor *x_out);

/* select_gemm_kernel: time every available kernel for this x's (m, n, k) and keep the
 * fastest. Does not change scale_a or any parameter. */
BIE_API bie_status bie_binary_linear_select_gemm_kernel(bie_binary_linear *layer,
                                                        const bie_tensor *x);
/* Use kernel `id` (-1 = the default per shape). Errors: unknown id, other device, not
 * available on this CPU. */
BIE_API bie_status bie_binary_linear_set_gemm_kernel(bie_binary_linear *layer, int id);
BIE_API int bie_binary_linear_gemm_kernel(const bie_binary_linear *layer);

/* Training (true, the default) or inference mode (module.train() / module.eval()). */
BIE_API bie_status bie_binary_linear_set_training(bie_binary_linear *layer, bool training);
BIE_API bool bie_binary_linear_training(const bie_binary_linear *layer);

/* forward: x [..., in] F32 (or pre-packed, see check_forward) to out [..., out_features]
 * F32 with the same leading extents: out = scale_a * scale_w * sign(x + bias_a) . sign(w).
 * In training mode with float input, keeps the packed signs and clip mask of x + bias_a
 * for backward. Errors: check_forward's, out shape/dtype, weight absent in training. */
BIE_API bie_status bie_binary_linear_forward(bie_binary_linear *layer, const bie_tensor *x,
                                             bie_tensor *out);

/* backward: grad_out shaped like the last forward's output. Writes grad_x (shaped like the
 * last input; may be NULL) and sets the layer's gradients (bie_binary_linear_grad).
 * Errors: no training forward before, shapes. */
BIE_API bie_status bie_binary_linear_backward(bie_binary_linear *layer,
                                              const bie_tensor *grad_out, bie_tensor *grad_x);

/* A view of a parameter (writable: an optimizer updates it in place). Errors: absent. */
BIE_API bie_status bie_binary_linear_param(bie_binary_linear *layer, bie_param which,
                                           bie_tensor *view);
/* A view of a gradient from the last backward: WEIGHT (I8 quantized if the weight is int8,
 * else F32), WEIGHT_FLOAT_GRAD (F32), BIAS_A, SCALE_A. Errors: no backward yet. */
BIE_API bie_status bie_binary_linear_grad(bie_binary_linear *layer, bie_param which,
                                          bie_tensor *view);
/* Set scale_a directly (e.g. when loading a model). Errors: non-finite or negative. */
BIE_API bie_status bie_binary_linear_set_scale_a(bie_binary_linear *layer, float scale_a);

BIE_API int64_t bie_binary_linear_in_features(const bie_binary_linear *layer);
BIE_API int64_t bie_binary_linear_out_features(const bie_binary_linear *layer);

/* ------------------------------------------------------ 7. binary conv2d layer */

/* Opaque handle: counterpart of BinaryConv2dForward and its layer (SPEC §3). Input and
 * output are NCHW float32; weight [out_c, in_c, k, k]; bias_a [in_c]; groups = 1. Every
 * function has the meaning of its bie_binary_linear_* namesake; the differences are listed
 * here. */
typedef struct bie_binary_conv2d bie_binary_conv2d;

/* Errors: channels < 1, kernel_size < 1, stride < 1, padding < 0, dilation < 1,
 * in_c * k * k >= 2^24, dtype not F32, device not available. */
BIE_API bie_status bie_binary_conv2d_create(bie_binary_conv2d **out, int64_t in_channels,
                                            int64_t out_channels, int kernel_size, int stride,
                                            int padding, int dilation, bie_device device,
                                            bie_dtype dtype, bool symmetric);
BIE_API void bie_binary_conv2d_free(bie_binary_conv2d *layer);
/* Kaiming-uniform with fan_in = in_c * k * k. */
BIE_API bie_status bie_binary_conv2d_reset_parameters(bie_binary_conv2d *layer, uint64_t seed);
/* w: [out_c, in_c, k, k] F32. */
BIE_API bie_status bie_binary_conv2d_set_weight_data(bie_binary_conv2d *layer, const bie_tensor *w);
BIE_API bie_status bie_binary_conv2d_prepare_params(bie_binary_conv2d *layer);
/* qweight: [out_c, ceil(in_c * k * k / W)] words; the weight flattened in [c, i, j] order. */
BIE_API bie_status bie_binary_conv2d_generate_quantized_weight(bie_binary_conv2d *layer,
                                                               bool qweight_only);
BIE_API bie_status bie_binary_conv2d_set_quantized_weight_data(bie_binary_conv2d *layer,
                                                               const bie_tensor *q);
BIE_API bie_status bie_binary_conv2d_set_bits_binary_word(bie_binary_conv2d *layer, int bits);
BIE_API int bie_binary_conv2d_bits_binary_word(const bie_binary_conv2d *layer);
BIE_API bie_status bie_binary_conv2d_opt_weight(bie_binary_conv2d *layer, bie_tensor *view);
/* x: [N, in_c, H, W] F32 on the CPU with the padded input at least as large as the dilated
 * kernel: H + 2p >= d (k - 1) + 1 (same for W). */
BIE_API bie_status bie_binary_conv2d_check_forward(const bie_binary_conv2d *layer,
                                                   const bie_tensor *x);
/* Output extents for an input of H x W (0 when the kernel does not fit). */
BIE_API bie_status bie_binary_conv2d_output_size(const bie_binary_conv2d *layer, int64_t h,
                                                 int64_t w, int64_t *out_h, int64_t *out_w);
/* x_out = x + bias_a[c] (per channel); may be NULL. */
BIE_API bie_status bie_binary_conv2d_set_activation(bie_binary_conv2d *layer,
                                                    const bie_tensor *x, bie_tensor *x_out);
BIE_API bie_status bie_binary_conv2d_select_gemm_kernel(bie_binary_conv2d *layer,
                                                        const bie_tensor *x);
BIE_API bie_status bie_binary_conv2d_set_gemm_kernel(bie_binary_conv2d *layer, int id);
BIE_API int bie_binary_conv2d_gemm_kernel(const bie_binary_conv2d *layer);
BIE_API bie_status bie_binary_conv2d_set_training(bie_binary_conv2d *layer, bool training);
BIE_API bool bie_binary_conv2d_training(const bie_binary_conv2d *layer);
/* out: [N, out_c, OH, OW] F32, OH = floor((H + 2p - d(k - 1) - 1) / s) + 1. Taps outside
 * the input contribute 0 (zero padding). */
BIE_API bie_status bie_binary_conv2d_forward(bie_binary_conv2d *layer, const bie_tensor *x,
                                             bie_tensor *out);
BIE_API bie_status bie_binary_conv2d_backward(bie_binary_conv2d *layer,
                                              const bie_tensor *grad_out, bie_tensor *grad_x);
/* WEIGHT is [out_c, in_c, k, k]; QWEIGHT [out_c, words]; BIAS_A [in_c]. */
BIE_API bie_status bie_binary_conv2d_param(bie_binary_conv2d *layer, bie_param which,
                                           bie_tensor *view);
BIE_API bie_status bie_binary_conv2d_grad(bie_binary_conv2d *layer, bie_param which,
                                          bie_tensor *view);
BIE_API bie_status bie_binary_conv2d_set_scale_a(bie_binary_conv2d *layer, float scale_a);

/* ------------------------------------------------------ 8. 4-bit linear layer */

/* Opaque handle: the 4-bit linear layer (SPEC §4 with a matrix product in place of the
 * convolution): out = scale_a * scale_w * q4(x + bias_a, scale_a) . q4(w, scale_w), exact
 * integer dot products. The weight stays float for training (straight-through); qweight
 * holds the 4-bit codes, two per byte, even index in the low nibble. Functions have the
 * meaning of their bie_binary_linear_* namesakes except:
 *   prepare_params: scale_w = max(2 mean|w| / 5.6345, 1e-5) (the weight stays float);
 *   set_activation: scale_a = 2 mean|x| / 11.269 when 0;
 *   backward: grad_w is float only; the forward keeps 4-bit codes, the clip mask and an
 *   8-bit rounding residual per input element (13 bits instead of 32), so grad_scale_a is
 *   exact up to the residual's resolution of 1/254. */
typedef struct bie_q4_linear bie_q4_linear;

BIE_API bie_status bie_q4_linear_create(bie_q4_linear **out, int64_t in_features,
                                        int64_t out_features, bie_device device, bie_dtype dtype);
BIE_API void bie_q4_linear_free(bie_q4_linear *layer);
BIE_API bie_status bie_q4_linear_reset_parameters(bie_q4_linear *layer, uint64_t seed);
BIE_API bie_status bie_q4_linear_set_weight_data(bie_q4_linear *layer, const bie_tensor *w);
BIE_API bie_status bie_q4_linear_prepare_params(bie_q4_linear *layer);
BIE_API bie_status bie_q4_linear_generate_quantized_weight(bie_q4_linear *layer,
                                                           bool qweight_only);
/* q: [out, ceil(in / 2)] U8. */
BIE_API bie_status bie_q4_linear_set_quantized_weight_data(bie_q4_linear *layer,
                                                           const bie_tensor *q);
BIE_API bie_status bie_q4_linear_opt_weight(bie_q4_linear *layer, bie_tensor *view);
BIE_API bie_status bie_q4_linear_check_forward(const bie_q4_linear *layer, const bie_tensor *x);
BIE_API bie_status bie_q4_linear_set_activation(bie_q4_linear *layer, const bie_tensor *x,
                                                bie_tensor *x_out);
BIE_API bie_status bie_q4_linear_set_gemm_kernel(bie_q4_linear *layer, int id);
BIE_API bie_status bie_q4_linear_set_training(bie_q4_linear *layer, bool training);
BIE_API bie_status bie_q4_linear_forward(bie_q4_linear *layer, const bie_tensor *x,
                                         bie_tensor *out);
BIE_API bie_status bie_q4_linear_backward(bie_q4_linear *layer, const bie_tensor *grad_out,
                                          bie_tensor *grad_x);
/* WEIGHT [out, in] F32; QWEIGHT [out, ceil(in / 2)] U8; BIAS_A; SCALE_A; SCALE_W. */
BIE_API bie_status bie_q4_linear_param(bie_q4_linear *layer, bie_param which, bie_tensor *view);
/* WEIGHT (= WEIGHT_FLOAT_GRAD), BIAS_A, SCALE_A. */
BIE_API bie_status bie_q4_linear_grad(bie_q4_linear *layer, bie_param which, bie_tensor *view);
BIE_API bie_status bie_q4_linear_set_scale_a(bie_q4_linear *layer, float scale_a);

/* ------------------------------------------------------ 9. 4-bit conv2d layer */

/* Opaque handle: counterpart of Q4Conv2dCutlassForward and its layer (SPEC §4). NCHW float32
 * input and output, weight [out_c, in_c, k, k] (float, straight-through), qweight
 * [out_c, ceil(in_c k k / 2)] nibbles in [c, i, j] order, bias_a [in_c]; no channel-count
 * constraints; zero padding is exact (padded taps have code 0). Functions mean what their
 * bie_q4_linear_* and bie_binary_conv2d_* namesakes mean. */
typedef struct bie_q4_conv2d bie_q4_conv2d;

BIE_API bie_status bie_q4_conv2d_create(bie_q4_conv2d **out, int64_t in_channels,
                                        int64_t out_channels, int kernel_size, int stride,
                                        int padding, int dilation, bie_device device,
                                        bie_dtype dtype);
BIE_API void bie_q4_conv2d_free(bie_q4_conv2d *layer);
BIE_API bie_status bie_q4_conv2d_reset_parameters(bie_q4_conv2d *layer, uint64_t seed);
BIE_API bie_status bie_q4_conv2d_set_weight_data(bie_q4_conv2d *layer, const bie_tensor *w);
BIE_API bie_status bie_q4_conv2d_prepare_params(bie_q4_conv2d *layer);
BIE_API bie_status bie_q4_conv2d_generate_quantized_weight(bie_q4_conv2d *layer,
                                                           bool qweight_only);
BIE_API bie_status bie_q4_conv2d_set_quantized_weight_data(bie_q4_conv2d *layer,
                                                           const bie_tensor *q);
BIE_API bie_status bie_q4_conv2d_opt_weight(bie_q4_conv2d *layer, bie_tensor *view);
BIE_API bie_status bie_q4_conv2d_check_forward(const bie_q4_conv2d *layer, const bie_tensor *x);
BIE_API bie_status bie_q4_conv2d_output_size(const bie_q4_conv2d *layer, int64_t h, int64_t w,
                                             int64_t *out_h, int64_t *out_w);
BIE_API bie_status bie_q4_conv2d_set_activation(bie_q4_conv2d *layer, const bie_tensor *x,
                                                bie_tensor *x_out);
BIE_API bie_status bie_q4_conv2d_set_gemm_kernel(bie_q4_conv2d *layer, int id);
BIE_API bie_status bie_q4_conv2d_set_training(bie_q4_conv2d *layer, bool training);
BIE_API bie_status bie_q4_conv2d_forward(bie_q4_conv2d *layer, const bie_tensor *x,
                                         bie_tensor *out);
BIE_API bie_status bie_q4_conv2d_backward(bie_q4_conv2d *layer, const bie_tensor *grad_out,
                                          bie_tensor *grad_x);
BIE_API bie_status bie_q4_conv2d_param(bie_q4_conv2d *layer, bie_param which, bie_tensor *view);
BIE_API bie_status bie_q4_conv2d_grad(bie_q4_conv2d *layer, bie_param which, bie_tensor *view);
BIE_API bie_status bie_q4_conv2d_set_scale_a(bie_q4_conv2d *layer, float scale_a);

#ifdef __cplusplus
}
#endif
#endif /* BIE_H */
