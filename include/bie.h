/*
 * bie — low-bit (1-bit and 4-bit) neural-network layers in C.
 *
 * One public header, ordered from simple to advanced:
 *   1. status codes and the per-thread error message
 *   2. devices, dtypes and the tensor descriptor
 *   3. threads and library information
 *   4. bit-packing (sign bits, SPEC §1)
 *   5. the kernel registry
 *   6. layers: one handle for every kind and device (binary and 4-bit, linear and conv2d)
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
    BIE_ERR_OVERFLOW = 9,    /* sizes whose products overflow the library's index types */
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
    BIE_I32 = 7,
    BIE_F64 = 8 /* training totals (bie_softmax_cross_entropy_accumulate) */
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
    int ndim;                    /* 1..4 (0 = empty descriptor) */
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
    int id;           /* stable id, accepted by the layers' set_gemm_kernel */
    const char *name; /* e.g. "cpu.avx2.bgemm_4x2" */
    const char *isa;  /* "scalar", "generic", "avx2", "avx512" */
    bie_op op;
    bie_device_type device;
    int64_t preferred_max_m; /* default choice only up to this m (INT64_MAX: any); every
                                kernel runs every shape */
    bool available;          /* this CPU has the ISA and BIE_CPU_KERNELS allows it */
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
BIE_API bie_status bie_binary_gemm(int kernel_id, int64_t m, int64_t n, int64_t k, const void *a,
                                   int64_t a_row_bytes, const void *b, int64_t b_row_bytes,
                                   float scale, float *out);

/* 4-bit GEMM on the CPU: out[i * n + j] = (float)dot(a_i, b_j) * scale, a and b rows of
 * k int8 codes in [-8, 7] (4-bit values; see bie_q4_quantize) with the given row strides in
 * elements, dot exact in integers. kernel_id < 0 picks the default. Errors: as
 * bie_binary_gemm; k > 2^24. */
BIE_API bie_status bie_q4_gemm(int kernel_id, int64_t m, int64_t n, int64_t k, const int8_t *a,
                               int64_t lda, const int8_t *b, int64_t ldb, float scale, float *out);

/* ------------------------------------------------------------------ 6. layers */

/* Opaque handle shared by every layer kind and device: the counterpart of the seed classes
 * BinaryLinearBase / BinaryLinearCutlass / BinaryLinearForward (binary linear),
 * BinaryConv2dForward (binary conv2d), Q4Conv2dCutlassForward (4-bit conv2d) and the 4-bit
 * linear layer. A layer is made by its kind's creator below; every other call is one
 * bie_layer_* function that works for every kind on every device (a call that does not
 * apply to a kind says so with BIE_ERR_UNSUPPORTED). */
typedef struct bie_layer bie_layer;

typedef enum bie_layer_kind {
    BIE_KIND_BINARY_LINEAR = 0, /* SPEC §2: x [..., in] -> [..., out] */
    BIE_KIND_BINARY_CONV2D = 1, /* SPEC §3: NCHW, weight [out_c, in_c, k, k] */
    BIE_KIND_Q4_LINEAR = 2,     /* SPEC §4 as a matrix product */
    BIE_KIND_Q4_CONV2D = 3      /* SPEC §4 */
} bie_layer_kind;

/* Parameters and buffers of a layer, for bie_layer_param() and bie_layer_grad(). */
typedef enum bie_param {
    BIE_PARAM_WEIGHT = 0,           /* binary: [out, fan_in] F32 before prepare_params, I8 after;
                                       4-bit: F32 always (straight-through); conv kinds shape it
                                       [out_c, in_c, k, k]; absent after
                                       generate_quantized_weight(qweight_only) */
    BIE_PARAM_QWEIGHT = 1,          /* binary: [out, ceil(fan_in / W)] U8/U32/U64 packed signs;
                                       4-bit: [out, ceil(fan_in / 2)] U8 nibbles; or absent */
    BIE_PARAM_BIAS_A = 2,           /* [in] F32 (in_features or in_channels) */
    BIE_PARAM_SCALE_A = 3,          /* [1] F32 */
    BIE_PARAM_SCALE_W = 4,          /* [1] F32 */
    BIE_PARAM_WEIGHT_FLOAT_GRAD = 5 /* grad only: the float gradient of the weight */
} bie_param;

/* Everything a layer is (bie_layer_describe); fields that do not apply to a kind are 0. */
typedef struct bie_layer_desc {
    bie_layer_kind kind;
    const char *name; /* "binary_linear", "binary_conv2d", "q4_linear", "q4_conv2d" */
    int64_t in, out;  /* in/out features (linear kinds) or channels (conv kinds) */
    int64_t fan_in;   /* weight columns: in (linear), in * k * k (conv) */
    int kernel_size, stride, padding, dilation; /* conv kinds */
    bie_device device;
    bie_dtype dtype;
    bool symmetric;       /* binary kinds (SPEC §2) */
    bool training;        /* training (the default) or inference mode */
    int kernel_id;        /* the selected GEMM kernel, -1 = the default per shape */
    int bits_binary_word; /* binary kinds: 8, 32 or 64; 0 for 4-bit kinds */
} bie_layer_desc;

/* --- creators. Each makes a layer in training mode with its weight filled by
 * reset_parameters with seed 0, bias_a zeros, scale_a 0 (initialised by the first
 * set_activation or float forward), scale_w 1, bits_binary_word 8 (binary kinds), the
 * default kernel. Layers on CUDA take and return tensors on their device, in their dtype
 * (F32, BF16 or F16); on the CPU the dtype is F32. Errors: NULL out, sizes out of range,
 * device not available, dtype not accepted on the device. */

/* BinaryLinearBase.__init__: weight [out_features, in_features]. Errors: features < 1 or
 * > 2^31 - 1. */
BIE_API bie_status bie_binary_linear_create(bie_layer **out, int64_t in_features,
                                            int64_t out_features, bie_device device,
                                            bie_dtype dtype, bool symmetric);
/* Binary conv2d (SPEC §3): square kernel, groups 1. Errors: channels < 1, kernel_size < 1,
 * stride < 1, padding < 0, dilation < 1, in_c * k * k >= 2^24. */
BIE_API bie_status bie_binary_conv2d_create(bie_layer **out, int64_t in_channels,
                                            int64_t out_channels, int kernel_size, int stride,
                                            int padding, int dilation, bie_device device,
                                            bie_dtype dtype, bool symmetric);
/* 4-bit linear: out = scale_a scale_w q4(x + bias_a, scale_a) . q4(w, scale_w), exact
 * integer dot products. Errors: in_features outside 1..2^24, out_features outside
 * 1..2^31 - 1. */
BIE_API bie_status bie_q4_linear_create(bie_layer **out, int64_t in_features, int64_t out_features,
                                        bie_device device, bie_dtype dtype);
/* 4-bit conv2d (SPEC §4), no channel-count constraints; zero padding is exact. Errors: as
 * bie_binary_conv2d_create. */
BIE_API bie_status bie_q4_conv2d_create(bie_layer **out, int64_t in_channels, int64_t out_channels,
                                        int kernel_size, int stride, int padding, int dilation,
                                        bie_device device, bie_dtype dtype);

/* Release the layer and everything it owns; NULL is fine. */
BIE_API void bie_layer_free(bie_layer *layer);

/* Kind, sizes, device, mode and kernel of a layer. Errors: NULL. */
BIE_API bie_status bie_layer_describe(const bie_layer *layer, bie_layer_desc *desc);

/* --- the weight. */

/* reset_parameters: Kaiming-uniform (a = sqrt(5)), i.e. uniform in ±1/sqrt(fan_in), from a
 * generator seeded with `seed`. Makes the weight float again (drops int8 weight and
 * qweight); bias_a, scale_a and scale_w are kept. */
BIE_API bie_status bie_layer_reset_parameters(bie_layer *layer, uint64_t seed);

/* set_weight_data: copy w ([out, in] for linear kinds, [out_c, in_c, k, k] for conv kinds;
 * the layer's dtype and device) and call prepare_params.
 * Errors: NULL, dtype, device or shape mismatch, non-finite values. */
BIE_API bie_status bie_layer_set_weight_data(bie_layer *layer, const bie_tensor *w);

/* prepare_params. Binary kinds: scale_w = mean|w|; the weight becomes the int8 quantization
 * of w - mean(w), with zeros replaced by sign (SPEC §2); a weight already int8 is left as it
 * is. 4-bit kinds: scale_w = max(2 mean|w| / 5.6345, 1e-5); the weight stays float.
 * Errors: weight absent (qweight_only). */
BIE_API bie_status bie_layer_prepare_params(bie_layer *layer);

/* generate_quantized_weight: pack the weight into qweight (signs, or 4-bit codes two per
 * byte, even index in the low nibble); with qweight_only the float / int8 weight is freed
 * and the layer becomes inference-only. Errors: no weight. */
BIE_API bie_status bie_layer_generate_quantized_weight(bie_layer *layer, bool qweight_only);

/* set_quantized_weight_data: install a packed weight of QWEIGHT's shape and dtype (binary:
 * U8/U32/U64 matching bits_binary_word, padding bits ignored; 4-bit: U8). */
BIE_API bie_status bie_layer_set_quantized_weight_data(bie_layer *layer, const bie_tensor *q);

/* set_bits_binary_word (binary kinds): 8, 32 or 64; an existing qweight is re-laid out.
 * Errors: other values; BIE_ERR_UNSUPPORTED on 4-bit kinds. */
BIE_API bie_status bie_layer_set_bits_binary_word(bie_layer *layer, int bits);

/* opt_weight: a view of the weight in training mode; in inference mode the packed weight,
 * generated on first use. */
BIE_API bie_status bie_layer_opt_weight(bie_layer *layer, bie_tensor *view);

/* A view of a parameter (writable: an optimizer updates it in place; on CUDA a device
 * tensor). Errors: NULL, a parameter the layer does not have now. */
BIE_API bie_status bie_layer_param(bie_layer *layer, bie_param which, bie_tensor *view);

/* Set scale_a directly (e.g. when loading a model); 0 = measure it on the next input.
 * Errors: non-finite or negative. */
BIE_API bie_status bie_layer_set_scale_a(bie_layer *layer, float scale_a);
/* The scale_a the layer holds now (0: to be measured on the next input), without handing out
 * a view. On CUDA it is read back from the device (waits for the layer's stream). Errors:
 * NULL. */
BIE_API bie_status bie_layer_get_scale_a(bie_layer *layer, float *scale_a);

/* --- running it. */

/* _check_forward: x must be on the layer's device with rank 1..4 and last extent in (linear
 * kinds; binary linear also accepts pre-packed U8/U32/U64 rows of ceil(in / W) words
 * matching W), or NCHW with in_c channels and room for the dilated kernel (conv kinds:
 * H + 2p >= d (k - 1) + 1, same for W), in the layer's dtype. */
BIE_API bie_status bie_layer_check_forward(const bie_layer *layer, const bie_tensor *x);

/* Shape of the output for an input of `in_ndim` extents `in_shape` (what check_forward
 * accepts): [..., out] for linear kinds, [N, out_c, OH, OW] with
 * OH = floor((H + 2p - d (k - 1) - 1) / s) + 1 for conv kinds. out_shape has room for
 * BIE_MAX_DIMS extents. Errors: NULL, a shape the layer does not accept. */
BIE_API bie_status bie_layer_output_shape(const bie_layer *layer, int in_ndim,
                                          const int64_t *in_shape, int *out_ndim,
                                          int64_t *out_shape);

/* set_activation: if scale_a == 0, set it from x (binary: 2 mean|x| symmetric, 4 mean|x|
 * otherwise; 4-bit: 2 mean|x| / 11.269); write x + bias_a into x_out (shaped like x; may
 * alias x; bias_a per feature or per channel). x_out may be NULL to initialise scale_a only.
 * Errors: check_forward's, x_out shape, an all-zero x (the scale would be 0). */
BIE_API bie_status bie_layer_set_activation(bie_layer *layer, const bie_tensor *x,
                                            bie_tensor *x_out);

/* select_gemm_kernel: time every available kernel of the layer's op and device on this x's
 * GEMM shape and keep the fastest. Changes no parameter. */
BIE_API bie_status bie_layer_select_gemm_kernel(bie_layer *layer, const bie_tensor *x);
/* Use kernel `id` (-1 = the default per shape). Errors: unknown id, another op or device,
 * not available on this CPU, cannot run the layer's rows. */
BIE_API bie_status bie_layer_set_gemm_kernel(bie_layer *layer, int id);

/* Training (true, the default) or inference mode (module.train() / module.eval()). */
BIE_API bie_status bie_layer_set_training(bie_layer *layer, bool training);

/* Conv kinds: whether the 4-D activations of later calls (forward's x and out, backward's
 * grad_out and grad_x, set_activation's x and x_out) are NHWC in memory ("channels last", as
 * PyTorch's torch.channels_last); their shapes stay [n, c, h, w]. A backward reads the layout of
 * the forward it follows. Results are the same in both layouts (the binary forward bit for bit).
 * Errors: linear kinds (BIE_ERR_INVALID_ARGUMENT); kinds and devices without NHWC kernels,
 * today all but the binary conv2d on CUDA (BIE_ERR_UNSUPPORTED: transpose around the call). */
BIE_API bie_status bie_layer_set_channels_last(bie_layer *layer, bool channels_last);
BIE_API bie_status bie_layer_get_channels_last(const bie_layer *layer, bool *channels_last);

/* The precision of a binary layer's two backward products (grad_x and grad_w). EXACT (the
 * default) is SPEC §2/§3: ±1 operands and grad_out as the layer's dtype holds it. FP8 is an
 * opt-in fast mode for the binary linear layer on CUDA devices with FP8 tensor cores
 * (compute capability 8.9 or newer): both products run on e4m3 operands; the ±1 operands are
 * exact in e4m3, grad_out is rounded to e4m3 with one per-tensor scale (amax / 448). Beyond
 * that rounding, the FP8 tensor cores sum at a lower precision than f32. For a 16-bit layer,
 * grad_bias_a and grad_scale_a sum grad_x as rounded to the layer's dtype. Shapes whose m, n
 * or k is not a multiple of 16 use EXACT. On compute capability 9.0 the linear layer's
 * products are bie's own kernels (the mask, those sums and grad_w's amax in their
 * epilogues), where the tensor cores sum the whole reduction in their own accumulator: up to
 * about 3e-4 of the largest gradient element in the GPU tests (H200). Elsewhere, or with the
 * environment variable BIE_CUDA_LINEAR_FUSED=0, they run in cuBLASLt (about 3e-5, H100),
 * whose first FP8 backward of each shape times the candidate algorithms once (the host waits
 * for that, once per shape and thread; not while the stream is being captured into a graph,
 * nor with BIE_CUDA_LT_TUNE=0) and keeps the fastest, so two processes may round its sums
 * differently. The binary conv2d on CUDA takes FP8 too: there
 * grad_x (and grad_bias_a and grad_scale_a, sums over it) runs on e4m3 with grad_out rounded the
 * same way, where its tensor-memory grad_x kernel takes the layer (16-bit, channels-last, compute
 * capability 9.0); there the tensor cores' lower-precision sum runs over the whole reduction (the
 * taps x the output channels): up to about 1e-3 of the largest grad_x element in the GPU tests
 * (measured on an H200). grad_w stays exact, and other layers run EXACT.
 * Other kinds and devices accept EXACT only (BIE_ERR_UNSUPPORTED).
 * EXACT on compute capability 9.0, for a bf16 or f16 binary linear layer whose n and k are
 * multiples of 16: grad_x runs on bie's own 16-bit tensor-core kernel on a ±1 weight matrix
 * made from the sign bits (f32 accumulators over the whole reduction, as cuBLAS), the mask in
 * its epilogue, and grad_w on bie's kernel of the same shape reading the ±1 activations, the
 * amax of grad_w in its epilogue (BIE_CUDA_LINEAR_WGRAD=cublas: in cuBLAS, then an amax pass;
 * =1: bie's kernel making the ±1 activations on chip from the sign bits; both slower today),
 * then grad_w's int8 quantization (BIE_CUDA_LINEAR_SIDE=1: in grad_x's kernel, in the
 * warps its tiles leave idle; the same int8 values, slower today);
 * grad_bias_a and grad_scale_a then sum grad_x as rounded to the layer's dtype (as a sum over
 * the stored 16-bit grad_x tensor does); BIE_CUDA_LINEAR_FUSED=0 keeps cuBLAS and the f32
 * sums. */
typedef enum bie_backward_mode { BIE_BACKWARD_EXACT = 0, BIE_BACKWARD_FP8 = 1 } bie_backward_mode;
BIE_API bie_status bie_layer_set_backward_mode(bie_layer *layer, bie_backward_mode mode);
BIE_API bie_status bie_layer_get_backward_mode(const bie_layer *layer, bie_backward_mode *mode);

/* forward: out (the layer's dtype and device; shape from bie_layer_output_shape) =
 * scale_a * scale_w * (sign or 4-bit code of x + bias_a) (.) (sign or code of w), exact
 * integer dot products; conv kinds treat taps outside the input as 0. In training mode with
 * float input the layer keeps what backward needs (packed signs or codes, clip mask).
 * Errors: check_forward's, out shape / dtype / device, weight absent in training, scale_a 0
 * with pre-packed input. */
BIE_API bie_status bie_layer_forward(bie_layer *layer, const bie_tensor *x, bie_tensor *out);

/* forward_again: out = the output of the last training forward, computed again from what that
 * forward kept for the backward (the packed input, the weight's bits and the scales it used;
 * no input needed), bit for bit the same. A caller that would keep the output only for a
 * backward (e.g. a batch norm's input) can drop it and call this instead. out: as forward's
 * (the layer's dtype and device, that forward's shape and layout). Binary kinds. Errors: no
 * training forward kept (BIE_ERR_STATE), out shape / dtype / device; the 4-bit kinds
 * (BIE_ERR_UNSUPPORTED). */
BIE_API bie_status bie_layer_forward_again(bie_layer *layer, bie_tensor *out);

/* backward: grad_out shaped like the last training forward's output. Writes grad_x (shaped
 * like the last input; may be NULL) and sets the layer's gradients (bie_layer_grad).
 * Errors: no training forward before, shapes. */
BIE_API bie_status bie_layer_backward(bie_layer *layer, const bie_tensor *grad_out,
                                      bie_tensor *grad_x);

/* A view of a gradient from the last backward: WEIGHT (binary kinds with an int8 weight: I8,
 * the int8 quantization of the float gradient, SPEC §2; else F32), WEIGHT_FLOAT_GRAD (F32),
 * BIAS_A, SCALE_A. Errors: no backward yet, no such gradient. */
BIE_API bie_status bie_layer_grad(bie_layer *layer, bie_param which, bie_tensor *view);

/* Where the next successful backward puts the weight's gradient (the one bie_layer_grad(WEIGHT)
 * views: I8 for a binary kind's int8 weight, else F32): also into `target`, memory of the
 * caller's on the layer's device with the weight's element count (any shape). On CUDA the
 * backward writes it there instead of into the layer's own buffer, and bie_layer_grad(WEIGHT)
 * (and WEIGHT_FLOAT_GRAD for a float weight) views the target until the next backward, so it
 * must stay valid that long; the CPU layers copy their gradient there. One backward only;
 * NULL cancels. For a framework that hands the gradient on as a tensor of its own: no copy
 * of it on the GPU. Errors: no training weight (BIE_ERR_STATE), target's device, dtype or
 * element count; at the backward, BIE_ERR_STATE where the weight's gradient dtype changed
 * since (prepare_params). */
BIE_API bie_status bie_layer_set_weight_grad_target(bie_layer *layer, const bie_tensor *target);

/* ------------------------------------- 7. batch norm, residual add and PReLU, fused */

/* The unit that follows a binary convolution in residual binary networks, in one pass over
 * the activations each way (plus one reduction pass):
 *     out = prelu(gamma (y - mean) rstd + beta + res),   prelu(z) = z > 0 ? z : slope z.
 * y, res, out (and the gradients below): rank 2..4, dim 1 the channels, [outer][C][inner]
 * in memory (NCHW: outer N, inner H W; [N][C]: inner 1). A channels-last NHWC tensor is
 * passed as the rank-3 view [N H W][C][1]. All the same shape and dtype: F32 on the CPU,
 * F32 / BF16 / F16 on CUDA; the arithmetic is float32 and each output is rounded once.
 * Per channel, F32 on the same device: gamma, beta, slope ([C], or [1] for one slope shared
 * by every channel), running_mean, running_var, save_mean, save_rstd ([C]). */
typedef struct bie_bn_act_params {
    const bie_tensor *gamma;                /* NULL: 1 */
    const bie_tensor *beta;                 /* NULL: 0 */
    const bie_tensor *slope;                /* NULL: no activation (out = z) */
    bie_tensor *running_mean, *running_var; /* NULL: not tracked (then training only) */
    float eps;                              /* > 0, finite */
    float momentum; /* 0..1: running = (1 - momentum) running + momentum batch */
    bool training;  /* batch statistics (and running updates) or the running ones */
} bie_bn_act_params;

/* forward. Training: mean and biased variance of each channel over its outer x inner
 * elements (at least 2), running_mean / running_var updated with the mean and the unbiased
 * variance; inference: the running statistics. save_mean / save_rstd receive the mean and
 * 1 / sqrt(var + eps) used, for the backward. res may be NULL (no residual). out may be y or
 * res (element by element). Errors: shapes, dtypes, devices, NULL required arguments, eps or
 * momentum out of range, fewer than 2 elements a channel in training, running statistics
 * NULL in inference; nothing is written then. */
BIE_API bie_status bie_bn_act_forward(const bie_bn_act_params *p, const bie_tensor *y,
                                      const bie_tensor *res, bie_tensor *save_mean,
                                      bie_tensor *save_rstd, bie_tensor *out);

/* backward of the forward above (the same p, y, res and its save_mean / save_rstd): from
 * grad_out, grad_y and the optional grad_res (= the gradient of z), grad_gamma, grad_beta
 * and grad_slope (shaped like their parameters; each may be NULL: not wanted). With
 * p->training the statistics' terms are included, as in training. grad_y may be grad_out.
 * Errors: as the forward's. */
BIE_API bie_status bie_bn_act_backward(const bie_bn_act_params *p, const bie_tensor *grad_out,
                                       const bie_tensor *y, const bie_tensor *res,
                                       const bie_tensor *save_mean, const bie_tensor *save_rstd,
                                       bie_tensor *grad_y, bie_tensor *grad_res,
                                       bie_tensor *grad_gamma, bie_tensor *grad_beta,
                                       bie_tensor *grad_slope);

#ifdef __cplusplus
}
#endif
#endif /* BIE_H */
